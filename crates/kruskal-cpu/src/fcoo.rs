//! MTTKRP on F-COO, following the F-COO GPU algorithm (segmented reduction)
//! on the CPU, and the block-walking code it shares with [`mod@crate::spttm`].
//!
//! An [`Fcoo`] keeps the nonzeros of one operation sorted so that each
//! output row is a contiguous *segment*, marked by a bit flag on its last
//! nonzero. The GPU kernel cuts the nonzeros into thread blocks of
//! `threadlen * BLOCK_THREADS` nonzeros, whatever the segments are, so the
//! work is balanced even when one row holds a large part of the tensor. Its
//! CPU counterpart here runs in two phases:
//!
//! 1. **Block starts.** Each block's first segment number is the count of
//!    segment ends before it: per-block popcounts of the bit flags (in
//!    parallel), then an exclusive prefix sum in block order. Segment `s`
//!    writes output row `segment_idx[0][s]`.
//! 2. **Blocks.** Blocks run in parallel (rayon). A block walks its
//!    nonzeros, closing a segment at each set bit flag. A segment wholly
//!    inside the block is written directly: each block owns a contiguous
//!    range of output rows (from its first segment's row up to the next
//!    block's), zeroes it, and writes its rows, so rows without nonzeros end
//!    up 0 and no two blocks write the same row. The first segment of a block
//!    (when the block's start flag says it began earlier) and its last
//!    segment (when the block's last bit flag is 0) cross a block edge: the
//!    block returns their sums as partials, and partials of one segment are
//!    added in block order afterwards. This is where the GPU kernel uses its
//!    only atomics.
//!
//! Per nonzero the product `val * prod_w Y_w(i_w, :)` is formed in f32 and
//! accumulated in f64 per segment (or piece of a segment), then stored as
//! f32. Blocks depend only on the tensor and `threadlen`, and partials are
//! summed in a fixed order: results are bit-identical for any thread count.

use kruskal_formats::{Fcoo, SparseTensor};
use ndarray::Array2;
use rayon::prelude::*;

use crate::{Result, mttkrp_slices, row_of};

/// GPU threads per thread block; a block holds `threadlen * BLOCK_THREADS`
/// nonzeros (4096 at the default `threadlen` of 8).
pub const BLOCK_THREADS: usize = 512;

// Blocks then start on a bit-flag word boundary, so a block reads whole
// words of flags.
const _: () = assert!(BLOCK_THREADS % 32 == 0);

/// One thread block's nonzeros and output rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Block {
    /// Nonzeros `nnz_lo..nnz_hi` (never empty).
    nnz_lo: usize,
    nnz_hi: usize,
    /// The segment of nonzero `nnz_lo`.
    seg_lo: usize,
    /// `seg_lo` began in an earlier block (the block's start flag is 0).
    head_shared: bool,
    /// Output rows `row_lo..row_hi` belong to this block: it zeroes them and
    /// writes those of its segments that lie wholly inside it.
    row_lo: usize,
    row_hi: usize,
}

/// The segments whose partial sums a block left in its two slots (head in
/// the first, tail in the second).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct BlockPartials {
    pub(crate) head: Option<usize>,
    pub(crate) tail: Option<usize>,
}

/// Joins the rows that block (or chunk) edges cut: block `b` left the
/// partial sums of its head and tail rows in `slots[2b]` and
/// `slots[2b + 1]` (`width` each). The pieces of one row are adjacent in
/// block order, so consecutive ones are summed, in that order, and each
/// joined row is handed to `store` once.
pub(crate) fn join_edges(
    partials: &[BlockPartials],
    slots: &[f64],
    width: usize,
    mut store: impl FnMut(usize, &[f64]),
) {
    let mut pending: Option<usize> = None;
    let mut sums = vec![0f64; width];
    for (b, p) in partials.iter().enumerate() {
        for (slot, row) in [(0, p.head), (1, p.tail)] {
            let Some(row) = row else { continue };
            let part = &slots[(2 * b + slot) * width..(2 * b + slot + 1) * width];
            if pending == Some(row) {
                sums.iter_mut().zip(part).for_each(|(a, x)| *a += x);
            } else {
                if let Some(done) = pending {
                    store(done, &sums);
                }
                sums.copy_from_slice(part);
                pending = Some(row);
            }
        }
    }
    if let Some(done) = pending {
        store(done, &sums);
    }
}

/// One segmented reduction: an F-COO, where its segments' results go, and
/// the width (rank) of a result row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reduction<'a> {
    pub fcoo: &'a Fcoo,
    /// The output row of segment `s` is `segment_rows[s]` (strictly
    /// increasing), or `s` itself when `None` (every segment has a row of
    /// its own, as in SpTTM).
    pub segment_rows: Option<&'a [u32]>,
    pub width: usize,
}

impl Reduction<'_> {
    #[inline(always)]
    fn row(&self, s: usize) -> usize {
        self.segment_rows.map_or(s, |rows| rows[s] as usize)
    }

    /// Phase 1: the blocks, with their first segments and the output rows
    /// they own (`out_rows` rows in all).
    ///
    /// Cost: `nnz / 32` word popcounts (parallel) and one pass over the
    /// blocks.
    fn plan_blocks(&self, out_rows: usize) -> Vec<Block> {
        let fcoo = self.fcoo;
        let nnz = fcoo.nnz();
        let per_block = fcoo.threadlen() * BLOCK_THREADS;
        let ends_per_block: Vec<usize> = fcoo
            .bit_flags()
            .par_chunks(per_block / 32)
            .map(|words| words.iter().map(|w| w.count_ones() as usize).sum())
            .collect();
        let mut blocks = Vec::with_capacity(ends_per_block.len());
        let mut seg_lo = 0;
        for (b, ends) in ends_per_block.into_iter().enumerate() {
            let nnz_lo = b * per_block;
            blocks.push(Block {
                nnz_lo,
                nnz_hi: nnz.min(nnz_lo + per_block),
                seg_lo,
                head_shared: !fcoo.chunk_starts_segment(b * BLOCK_THREADS),
                row_lo: if b == 0 { 0 } else { self.row(seg_lo) },
                row_hi: out_rows,
            });
            seg_lo += ends;
        }
        for b in 1..blocks.len() {
            blocks[b - 1].row_hi = blocks[b].row_lo;
        }
        blocks
    }

    /// Runs the reduction into `out` (`out_rows x width`, row-major,
    /// overwritten): phase 1, then `run_block` on every block in parallel,
    /// then the partials of segments crossing block edges, summed in block
    /// order.
    ///
    /// `run_block(block, rows, slots)` must zero `rows` (the block's own
    /// output rows), write the segments wholly inside the block there and
    /// leave the edge pieces' sums in `slots` (two rows of `width`): what
    /// [`Reduction::walk`] does.
    pub fn run(
        &self,
        out: &mut [f32],
        run_block: impl Fn(&Block, &mut [f32], &mut [f64]) -> BlockPartials + Sync,
    ) {
        let width = self.width;
        let blocks = self.plan_blocks(out.len() / width);
        if blocks.is_empty() {
            out.fill(0.0);
            return;
        }

        let mut pieces = Vec::with_capacity(blocks.len());
        let mut rest = &mut *out;
        for block in &blocks {
            let (mine, tail) = rest.split_at_mut((block.row_hi - block.row_lo) * width);
            pieces.push(mine);
            rest = tail;
        }
        let mut slots = vec![0f64; blocks.len() * 2 * width];
        let partials: Vec<BlockPartials> = blocks
            .par_iter()
            .zip(pieces)
            .zip(slots.par_chunks_mut(2 * width))
            .map(|((block, mine), slots)| run_block(block, mine, slots))
            .collect();

        // Fix-up: the pieces of one segment are adjacent in block order.
        join_edges(&partials, &slots, width, |seg, sums| {
            let row = self.row(seg);
            for (o, &s) in out[row * width..(row + 1) * width].iter_mut().zip(sums) {
                *o = s as f32;
            }
        });
    }

    /// Phase 2 for one block: zeroes `mine`, sums every segment piece of
    /// the block with `sum_segment(lo, hi, acc)` (which overwrites `acc`,
    /// `width` long, with the sum of nonzeros `lo..hi`), writes whole
    /// segments to `mine` and edge pieces to `slots`.
    ///
    /// Segment ends are found a flag word at a time (`trailing_zeros`), so
    /// the inner loop over a segment's nonzeros tests no flags.
    #[inline(always)]
    pub fn walk(
        &self,
        block: &Block,
        mine: &mut [f32],
        slots: &mut [f64],
        acc: &mut [f64],
        mut sum_segment: impl FnMut(usize, usize, &mut [f64]),
    ) -> BlockPartials {
        let width = self.width;
        mine.fill(0.0);
        let (head_slot, tail_slot) = slots.split_at_mut(width);
        let mut partials = BlockPartials::default();
        let flags = self.fcoo.bit_flags();
        let mut lo = block.nnz_lo;
        let mut seg = block.seg_lo;
        let first_word = block.nnz_lo / 32;
        let words = &flags[first_word..block.nnz_hi.div_ceil(32)];
        for (w, &word) in (first_word..).zip(words) {
            let mut bits = word;
            while bits != 0 {
                let hi = w * 32 + bits.trailing_zeros() as usize + 1;
                bits &= bits - 1;
                if seg == block.seg_lo && block.head_shared {
                    sum_segment(lo, hi, head_slot);
                    partials.head = Some(seg);
                } else {
                    sum_segment(lo, hi, acc);
                    let local = self.row(seg) - block.row_lo;
                    for (o, &a) in mine[local * width..(local + 1) * width]
                        .iter_mut()
                        .zip(acc.iter())
                    {
                        *o = a as f32;
                    }
                }
                lo = hi;
                seg += 1;
            }
        }
        // The last segment goes on in the next block.
        if lo < block.nnz_hi {
            if seg == block.seg_lo && block.head_shared {
                sum_segment(lo, block.nnz_hi, head_slot);
                partials.head = Some(seg);
            } else {
                sum_segment(lo, block.nnz_hi, tail_slot);
                partials.tail = Some(seg);
            }
        }
        partials
    }
}

/// The F-COO MTTKRP engine: one [`Fcoo::for_mttkrp`] per mode, built once
/// per tensor, and the segmented reduction described in the
/// [module documentation](self).
#[derive(Clone, Debug)]
pub struct FcooMttkrp {
    dims: Vec<u32>,
    threadlen: usize,
    modes: Vec<Fcoo>,
}

impl FcooMttkrp {
    /// Nonzeros per GPU thread by default: 8, one byte of bit flags, as in
    /// the paper.
    pub const DEFAULT_THREADLEN: usize = 8;

    /// Builds the F-COO of every mode.
    ///
    /// Errors: `threadlen` not a power of two in `1..=256`, or more than
    /// `u32::MAX` nonzeros (from [`Fcoo`]). Cost: one parallel sort per
    /// mode; memory `(4 * nmodes + 1/8 + 1/(8 * threadlen))` bytes per
    /// nonzero per mode plus 4 bytes per nonempty row.
    pub fn new(tensor: &SparseTensor, threadlen: usize) -> Result<Self> {
        let modes = (0..tensor.nmodes())
            .map(|mode| Fcoo::for_mttkrp(tensor, mode, threadlen))
            .collect::<kruskal_formats::Result<Vec<_>>>()?;
        Ok(FcooMttkrp {
            dims: tensor.dims().to_vec(),
            threadlen,
            modes,
        })
    }

    /// The F-COO of output mode `mode`, if the mode exists.
    pub fn fcoo(&self, mode: usize) -> Option<&Fcoo> {
        self.modes.get(mode)
    }

    pub fn threadlen(&self) -> usize {
        self.threadlen
    }

    /// Nonzeros per thread block, `threadlen * BLOCK_THREADS`.
    pub fn block_nnz(&self) -> usize {
        self.threadlen * BLOCK_THREADS
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// Bytes of all modes' F-COO arrays.
    pub fn bytes(&self) -> usize {
        self.modes.iter().map(Fcoo::bytes).sum()
    }

    /// Computes the MTTKRP for output `mode` into `out` (overwritten).
    ///
    /// Shapes: `factors[w]` is `dims[w] x rank` for every mode and `out` is
    /// `dims[mode] x rank`, all in standard (row-major, contiguous) layout.
    /// Cost: `nnz * (nmodes - 1) * rank` multiply-adds, parallel over thread
    /// blocks, plus `nnz / 32` popcounts.
    pub fn mttkrp(
        &self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<()> {
        let (rank, factors, out) = mttkrp_slices(&self.dims, mode, factors, out)?;
        let fcoo = &self.modes[mode];
        let product: Vec<&[f32]> = fcoo.product_modes().iter().map(|&w| factors[w]).collect();
        let red = Reduction {
            fcoo,
            segment_rows: Some(&fcoo.segment_idx()[0]),
            width: rank,
        };
        red.run(out, |block, mine, slots| {
            run_block(&red, block, &product, mine, slots)
        });
        Ok(())
    }
}

forward_engine!(FcooMttkrp, "fcoo");

/// One MTTKRP block. Dispatches to a kernel specialized for the rank where
/// one exists (its f64 accumulator then lives in registers) and to the best
/// instruction set of the running CPU; every variant adds the same f32
/// products in the same order, so results are bit-identical.
fn run_block(
    red: &Reduction<'_>,
    block: &Block,
    product: &[&[f32]],
    mine: &mut [f32],
    slots: &mut [f64],
) -> BlockPartials {
    by_rank!(
        red.width,
        run_block_fixed(red, block, product, mine, slots),
        run_block_any(red, block, product, mine, slots)
    )
}

/// [`run_block`] for a rank known at compile time.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn run_block_fixed<const R: usize>(
    red: &Reduction<'_>,
    block: &Block,
    product: &[&[f32]],
    mine: &mut [f32],
    slots: &mut [f64],
) -> BlockPartials {
    let mut acc = [0f64; R];
    let fcoo = red.fcoo;
    let values = fcoo.values();
    // Three modes, the common case: two factor rows per nonzero.
    if let ([a_idx, b_idx], [fa, fb]) = (fcoo.product_idx(), product) {
        return red.walk(block, mine, slots, &mut acc, |lo, hi, out| {
            let mut sum = [0f64; R];
            for k in lo..hi {
                let v = values[k];
                let a = row_of::<R>(fa, a_idx[k]);
                let b = row_of::<R>(fb, b_idx[k]);
                for r in 0..R {
                    sum[r] += f64::from(v * a[r] * b[r]);
                }
            }
            out.copy_from_slice(&sum);
        });
    }
    red.walk(block, mine, slots, &mut acc, |lo, hi, out| {
        let mut sum = [0f64; R];
        for k in lo..hi {
            let mut prod = [values[k]; R];
            for (idx, factor) in fcoo.product_idx().iter().zip(product) {
                let y = row_of::<R>(factor, idx[k]);
                for r in 0..R {
                    prod[r] *= y[r];
                }
            }
            for r in 0..R {
                sum[r] += f64::from(prod[r]);
            }
        }
        out.copy_from_slice(&sum);
    })
}

/// [`run_block`] for any rank.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn run_block_any(
    red: &Reduction<'_>,
    block: &Block,
    product: &[&[f32]],
    mine: &mut [f32],
    slots: &mut [f64],
) -> BlockPartials {
    let rank = red.width;
    let fcoo = red.fcoo;
    let mut acc = vec![0f64; rank];
    let mut prod = vec![0f32; rank];
    let values = fcoo.values();
    red.walk(block, mine, slots, &mut acc, |lo, hi, sum| {
        sum.fill(0.0);
        for k in lo..hi {
            prod.fill(values[k]);
            for (idx, factor) in fcoo.product_idx().iter().zip(product) {
                let i = idx[k] as usize;
                for (p, &y) in prod.iter_mut().zip(&factor[i * rank..(i + 1) * rank]) {
                    *p *= y;
                }
            }
            for (s, &p) in sum.iter_mut().zip(prod.iter()) {
                *s += f64::from(p);
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MttkrpEngine;
    use crate::testutil::{check_engine, factors_for, shared_tensors};
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    fn check_all_modes(t: &SparseTensor, threadlen: usize, rank: usize) {
        let modes: Vec<usize> = (0..t.nmodes()).collect();
        let mut engine = FcooMttkrp::new(t, threadlen).unwrap();
        check_engine(t, &mut engine, rank, &modes, 1e-6);
    }

    /// The longest segment of a mode, in nonzeros.
    fn longest_segment(f: &Fcoo) -> usize {
        let mut longest = 0;
        let mut start = 0;
        for k in 0..f.nnz() {
            if f.ends_segment(k) {
                longest = longest.max(k + 1 - start);
                start = k + 1;
            }
        }
        longest
    }

    #[test]
    fn blocks_cover_nonzeros_and_rows() {
        // Uniform in the other modes, so the hot row's draws are distinct.
        let mut spec = PowerLawSpec::new(vec![300, 4_000, 2_000], 20_000).with_draws();
        spec.exponents = vec![1.2, 0.0, 0.0];
        let t = power_law(&spec).unwrap();
        let f = Fcoo::for_mttkrp(&t, 0, 1).unwrap();
        let red = Reduction {
            fcoo: &f,
            segment_rows: Some(&f.segment_idx()[0]),
            width: 1,
        };
        let blocks = red.plan_blocks(300);
        assert_eq!(blocks.len(), f.nnz().div_ceil(BLOCK_THREADS));
        assert_eq!(blocks[0].row_lo, 0);
        assert_eq!(blocks.last().unwrap().row_hi, 300);
        for (b, block) in blocks.iter().enumerate() {
            assert_eq!(block.seg_lo, f.segment_of(block.nnz_lo));
            assert_eq!(
                block.head_shared,
                b > 0 && !f.ends_segment(block.nnz_lo - 1)
            );
            if b > 0 {
                assert_eq!(blocks[b - 1].nnz_hi, block.nnz_lo);
                assert_eq!(blocks[b - 1].row_hi, block.row_lo);
            }
        }
        assert_eq!(blocks.last().unwrap().nnz_hi, f.nnz());
        // Zipf 1.2 over 300 rows: the hottest row spans several blocks.
        assert!(longest_segment(&f) > 2 * BLOCK_THREADS);
        assert!(blocks.iter().filter(|b| b.head_shared).count() >= 2);
    }

    #[test]
    fn heavy_rows_spanning_many_blocks_are_exact() {
        // A third of the nonzeros in one row of every mode.
        let t = crate::testutil::hot_rows(&[20_000, 15_000, 10_000], 50_000);
        let engine = FcooMttkrp::new(&t, 1).unwrap();
        for mode in 0..3 {
            let f = engine.fcoo(mode).unwrap();
            assert!(longest_segment(f) > 10 * engine.block_nnz(), "mode {mode}");
        }
        for rank in [3, 16] {
            check_all_modes(&t, 1, rank);
        }
    }

    #[test]
    fn equals_reference_on_shared_tensors() {
        let tensors = shared_tensors();
        for (_, t) in &tensors {
            for threadlen in [1, FcooMttkrp::DEFAULT_THREADLEN] {
                check_all_modes(t, threadlen, 16);
            }
        }
    }

    #[test]
    fn empty_rows_are_zeroed() {
        let t = SparseTensor::new(
            vec![6, 2, 2],
            vec![vec![4, 4, 1], vec![0, 1, 1], vec![1, 1, 0]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap();
        check_all_modes(&t, 1, 3);
        // Rows 0, 2, 3 and 5 of mode 0 have no nonzeros.
        let engine = FcooMttkrp::new(&t, 1).unwrap();
        let factors = factors_for(t.dims(), 3, 1);
        let mut out = Array2::from_elem((6, 3), f32::NAN);
        engine.mttkrp(0, &factors, &mut out).unwrap();
        for row in [0, 2, 3, 5] {
            assert!(out.row(row).iter().all(|&x| x == 0.0), "row {row}");
        }
    }

    #[test]
    fn empty_tensor_gives_zeros() {
        let t = SparseTensor::new(vec![3, 2, 4], vec![vec![], vec![], vec![]], vec![]).unwrap();
        let engine = FcooMttkrp::new(&t, 8).unwrap();
        let factors = factors_for(t.dims(), 5, 1);
        let mut out = Array2::from_elem((2, 5), f32::NAN);
        engine.mttkrp(1, &factors, &mut out).unwrap();
        assert!(out.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn one_and_two_mode_tensors() {
        let t =
            SparseTensor::new(vec![7], vec![vec![3, 1, 3, 6]], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        check_all_modes(&t, 1, 2);
        let mut spec = PowerLawSpec::new(vec![90, 70], 5_000).with_draws();
        spec.exponents = vec![1.3; 2];
        check_all_modes(&power_law(&spec).unwrap(), 1, 8);
    }

    #[test]
    fn result_does_not_depend_on_thread_count() {
        let mut spec = PowerLawSpec::new(vec![300, 200, 100, 50], 40_000).with_draws();
        spec.exponents = vec![1.2; 4];
        let t = power_law(&spec).unwrap();
        let engine = FcooMttkrp::new(&t, 1).unwrap();
        let factors = factors_for(t.dims(), 7, 3);
        let run = |threads: usize, rank_factors: &[Array2<f32>]| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                (0..4)
                    .map(|mode| {
                        let rank = rank_factors[0].ncols();
                        let mut out = Array2::zeros((t.dims()[mode] as usize, rank));
                        engine.mttkrp(mode, rank_factors, &mut out).unwrap();
                        out
                    })
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(run(1, &factors), run(3, &factors));
        let factors16 = factors_for(t.dims(), 16, 3);
        assert_eq!(run(1, &factors16), run(3, &factors16));
    }

    #[test]
    fn shape_and_argument_errors_are_reported() {
        let t = power_law(&PowerLawSpec::new(vec![5, 4, 3], 20).with_draws()).unwrap();
        assert!(FcooMttkrp::new(&t, 3).is_err());
        assert!(FcooMttkrp::new(&t, 512).is_err());
        let engine = FcooMttkrp::new(&t, FcooMttkrp::DEFAULT_THREADLEN).unwrap();
        assert_eq!(engine.name(), "fcoo");
        assert!(engine.fcoo(3).is_none());
        let mut factors = factors_for(t.dims(), 2, 1);
        let mut out = Array2::zeros((5, 2));
        assert!(engine.mttkrp(3, &factors, &mut out).is_err());
        let mut wrong_out = Array2::zeros((4, 2));
        assert!(engine.mttkrp(0, &factors, &mut wrong_out).is_err());
        let mut transposed = Array2::zeros((2, 5));
        transposed.swap_axes(0, 1);
        let err = engine.mttkrp(0, &factors, &mut transposed).unwrap_err();
        assert!(err.to_string().contains("layout"), "{err}");
        assert!(engine.mttkrp(0, &factors[..2], &mut out).is_err());
        factors[1] = Array2::zeros((4, 3));
        let err = engine.mttkrp(0, &factors, &mut out).unwrap_err();
        assert!(err.to_string().contains("columns"), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn equals_reference_on_random_tensors(
            nmodes in 3usize..=6,
            dim_seed in any::<u64>(),
            nnz in 1usize..6_000,
            rank in prop_oneof![1usize..40, Just(64usize)],
            threadlen in prop_oneof![Just(1usize), Just(2), Just(8), Just(256)],
            exponent in 0.0f64..1.6,
        ) {
            let dims: Vec<u32> = (0..nmodes)
                .map(|m| 1 + ((dim_seed >> (m * 8)) % 60) as u32)
                .collect();
            let mut spec = PowerLawSpec::new(dims, nnz).with_draws().with_seed(dim_seed);
            spec.exponents = vec![exponent; nmodes];
            let t = power_law(&spec).unwrap();
            check_all_modes(&t, threadlen, rank);
        }
    }
}
