//! MTTKRP on a HiCOO tensor, block by block: the CPU counterpart of the
//! ParTI-GPU HiCOO kernel.
//!
//! The GPU kernel gives each block to a thread block and adds into the output
//! with global atomics. Here the blocks are scheduled so that no two tasks
//! write the same output row, and no atomics are needed:
//!
//! - for output mode `d`, the blocks are grouped by their mode-`d` block
//!   coordinate `c` (a *group*: every block whose nonzeros land in output rows
//!   `c * 2^b .. (c + 1) * 2^b`). The schedule lists block ids sorted by
//!   (mode-`d` coordinate, Morton position), so each group is a run;
//! - one task per group accumulates its blocks, in schedule order, into an f64
//!   buffer of `2^b x rank` (the in-block offset of mode `d` is the buffer
//!   row), then stores it as f32. The task owns its group's rows and the rows
//!   of the empty groups after it (the first task also those before it) and
//!   zeroes the rows no nonzero reaches;
//! - a group holding more than `split_nnz` nonzeros (power-law tensors put
//!   about 40% of the nonzeros in one block row) is cut into pieces of about
//!   equal nonzero count, cut points inside blocks allowed. Each piece fills
//!   its own buffer and the buffers are added in piece order afterwards.
//!
//! Products are computed in f32 (`val * prod_{w != d} Y_w(i_w, :)`, modes in
//! increasing order) and accumulated in f64. The schedule and the cut points
//! depend on the tensor only (`split_nnz` defaults to a fraction of the
//! nonzeros, not of the threads) and every sum runs in a fixed order, so the
//! result is bit-identical for any thread count.

use kruskal_formats::{Hicoo, SparseTensor};
use ndarray::Array2;
use rayon::prelude::*;

use crate::{Result, mttkrp_slices, row_of};

/// Groups are split into pieces of at least this many nonzeros: below it the
/// cost of one more `2^b x rank` buffer is not repaid.
const SPLIT_MIN_NNZ: usize = 1 << 15;
/// No task gets more than about `1 / SPLIT_PARTS` of the nonzeros (enough
/// tasks to balance 16 to 64 cores through work stealing).
const SPLIT_PARTS: usize = 64;

/// A task's share of one group (an unsplit group is one piece).
type Piece = kruskal_formats::hicoo::BlockPiece;

/// A non-empty group: the blocks sharing mode-`d` block coordinate `coord`.
#[derive(Clone, Debug, PartialEq)]
struct Group {
    coord: u32,
    /// Output rows `row_lo..row_hi` belong to this group's task (its own
    /// `2^b` rows and the rows of empty groups next to it).
    row_lo: usize,
    row_hi: usize,
    /// Its pieces are `pieces[piece_lo..piece_hi]`; more than one: split.
    piece_lo: usize,
    piece_hi: usize,
}

impl Group {
    fn is_split(&self) -> bool {
        self.piece_hi - self.piece_lo > 1
    }
}

/// The schedule of one output mode: blocks ordered by their block
/// coordinate in that mode, grouped, and heavy groups cut into pieces.
#[derive(Clone, Debug)]
pub struct ModeSchedule {
    mode: usize,
    /// The other modes, increasing (the order products are taken in).
    other_modes: Vec<usize>,
    /// Block ids sorted by (mode-`mode` block coordinate, Morton position).
    order: Vec<u32>,
    /// Non-empty groups, by increasing coordinate.
    groups: Vec<Group>,
    pieces: Vec<Piece>,
    /// Indices into `pieces` of the pieces of split groups, in group order.
    split_pieces: Vec<usize>,
}

impl ModeSchedule {
    /// Groups the blocks of `h` for output `mode` and cuts groups heavier
    /// than `split_nnz` nonzeros.
    ///
    /// Cost: [`Hicoo::block_groups`] (a parallel sort of the blocks and one
    /// pass over them).
    fn new(h: &Hicoo, mode: usize, split_nnz: usize) -> Self {
        let b = u32::from(h.block_bits());
        let dim = h.dims()[mode] as usize;
        let blocks = h.block_groups(mode, split_nnz);
        let mut groups: Vec<Group> = blocks
            .groups
            .iter()
            .map(|g| Group {
                coord: g.coord,
                row_lo: (g.coord as usize) << b,
                row_hi: dim,
                piece_lo: g.piece_lo,
                piece_hi: g.piece_hi,
            })
            .collect();
        let (order, pieces) = (blocks.order, blocks.pieces);
        // Empty groups' rows go to the group before them (or the first one).
        if let Some(first) = groups.first_mut() {
            first.row_lo = 0;
        }
        for g in 1..groups.len() {
            groups[g - 1].row_hi = groups[g].row_lo;
        }
        let split_pieces = groups
            .iter()
            .filter(|g| g.is_split())
            .flat_map(|g| g.piece_lo..g.piece_hi)
            .collect();
        ModeSchedule {
            mode,
            other_modes: (0..h.nmodes()).filter(|&w| w != mode).collect(),
            order,
            groups,
            pieces,
            split_pieces,
        }
    }

    pub fn mode(&self) -> usize {
        self.mode
    }

    /// Number of non-empty groups (distinct block coordinates of the mode).
    pub fn group_count(&self) -> usize {
        self.groups.len()
    }

    /// Number of groups cut into more than one piece.
    pub fn split_groups(&self) -> usize {
        self.groups.iter().filter(|g| g.is_split()).count()
    }

    /// Number of tasks: one per piece (an unsplit group is one piece).
    pub fn piece_count(&self) -> usize {
        self.pieces.len()
    }

    /// Bytes of the schedule.
    pub fn bytes(&self) -> usize {
        self.order.len() * 4
            + self.groups.len() * std::mem::size_of::<Group>()
            + self.pieces.len() * std::mem::size_of::<Piece>()
            + self.split_pieces.len() * std::mem::size_of::<usize>()
    }
}

/// Calls `f(block, nonzeros)` for each block of `piece`, in schedule order.
#[inline(always)]
fn for_each_block(
    piece: &Piece,
    order: &[u32],
    block_ptr: &[u64],
    mut f: impl FnMut(usize, std::ops::Range<usize>),
) {
    let span = piece.pos_lo..piece.pos_hi;
    for (p, &k) in span.clone().zip(&order[span]) {
        let k = k as usize;
        let lo = if p == piece.pos_lo {
            piece.nz_lo
        } else {
            block_ptr[k] as usize
        };
        let hi = if p + 1 == piece.pos_hi {
            piece.nz_hi
        } else {
            block_ptr[k + 1] as usize
        };
        f(k, lo..hi);
    }
}

/// The HiCOO MTTKRP engine: one [`Hicoo`] copy of the tensor (shared by all
/// modes) and one [`ModeSchedule`] per mode.
#[derive(Clone, Debug)]
pub struct HicooMttkrp {
    hicoo: Hicoo,
    split_nnz: usize,
    schedules: Vec<ModeSchedule>,
}

impl HicooMttkrp {
    /// Builds the HiCOO form of `tensor` with `2^block_bits`-wide blocks
    /// ([`Hicoo::DEFAULT_BLOCK_BITS`] is ParTI's choice) and the schedules
    /// of every mode.
    ///
    /// Errors: `block_bits` outside `1..=8` or more than `u32::MAX` blocks.
    /// Memory: the HiCOO tensor plus about 4 bytes per block per mode.
    pub fn new(tensor: &SparseTensor, block_bits: u8) -> Result<Self> {
        Self::with_split_nnz(tensor, block_bits, Self::default_split_nnz(tensor.nnz()))
    }

    /// As [`HicooMttkrp::new`], splitting groups of more than `split_nnz`
    /// nonzeros (at least 1; tests use small values to force splitting).
    pub fn with_split_nnz(tensor: &SparseTensor, block_bits: u8, split_nnz: usize) -> Result<Self> {
        let hicoo = Hicoo::new(tensor, block_bits)?;
        Ok(Self::from_hicoo(hicoo, split_nnz))
    }

    /// Builds the schedules for a HiCOO tensor already built.
    pub fn from_hicoo(hicoo: Hicoo, split_nnz: usize) -> Self {
        let split_nnz = split_nnz.max(1);
        let schedules = (0..hicoo.nmodes())
            .map(|mode| ModeSchedule::new(&hicoo, mode, split_nnz))
            .collect();
        HicooMttkrp {
            hicoo,
            split_nnz,
            schedules,
        }
    }

    /// The split threshold [`HicooMttkrp::new`] uses for `nnz` nonzeros:
    /// `max(nnz / 64, 2^15)`, independent of the thread count.
    pub fn default_split_nnz(nnz: usize) -> usize {
        (nnz / SPLIT_PARTS).max(SPLIT_MIN_NNZ)
    }

    pub fn hicoo(&self) -> &Hicoo {
        &self.hicoo
    }

    pub fn split_nnz(&self) -> usize {
        self.split_nnz
    }

    pub fn schedule(&self, mode: usize) -> &ModeSchedule {
        &self.schedules[mode]
    }

    pub fn dims(&self) -> &[u32] {
        self.hicoo.dims()
    }

    /// Bytes of the HiCOO tensor and the schedules.
    pub fn bytes(&self) -> usize {
        self.hicoo.bytes()
            + self
                .schedules
                .iter()
                .map(ModeSchedule::bytes)
                .sum::<usize>()
    }

    /// Computes the MTTKRP for output `mode` into `out` (overwritten).
    ///
    /// Shapes: `factors[w]` is `dims[w] x rank` for every mode and `out` is
    /// `dims[mode] x rank`, all in standard (row-major, contiguous) layout.
    /// Cost: `nnz * (nmodes - 1) * rank` multiply-adds, parallel over the
    /// pieces, plus `2^b x rank` buffer work per piece.
    pub fn mttkrp(
        &self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<()> {
        let (rank, factors, out) = mttkrp_slices(self.hicoo.dims(), mode, factors, out)?;
        let sched = &self.schedules[mode];
        let width = self.hicoo.block_width();
        let dim = self.hicoo.dims()[mode] as usize;
        // Rows of a group's own 2^b block row (the last is cut at dim).
        let own_rows = |g: &Group| -> (usize, usize) {
            let lo = (g.coord as usize) * width;
            (lo, (lo + width).min(dim))
        };

        let mut owned = Vec::with_capacity(sched.groups.len());
        let mut rest = &mut *out;
        for g in &sched.groups {
            let (mine, tail) = rest.split_at_mut((g.row_hi - g.row_lo) * rank);
            owned.push((g, mine));
            rest = tail;
        }
        // No groups (no nonzeros): nothing owns the rows.
        rest.fill(0.0);

        let kernel = HicooPass {
            h: &self.hicoo,
            sched,
            factors: &factors,
            rank,
        };
        let ((), partials) = rayon::join(
            || {
                owned.into_par_iter().for_each_init(
                    || vec![0f64; width * rank],
                    |acc, (g, mine)| {
                        let (lo, hi) = own_rows(g);
                        let (front, tail) = mine.split_at_mut((lo - g.row_lo) * rank);
                        let (group_rows, back) = tail.split_at_mut((hi - lo) * rank);
                        front.fill(0.0);
                        back.fill(0.0);
                        if g.is_split() {
                            // Written by the fix-up below.
                            return;
                        }
                        let acc = &mut acc[..(hi - lo) * rank];
                        acc.fill(0.0);
                        kernel.accumulate(&sched.pieces[g.piece_lo], acc);
                        for (o, &a) in group_rows.iter_mut().zip(acc.iter()) {
                            *o = a as f32;
                        }
                    },
                );
            },
            || {
                sched
                    .split_pieces
                    .par_iter()
                    .map(|&p| {
                        let mut acc = vec![0f64; width * rank];
                        kernel.accumulate(&sched.pieces[p], &mut acc);
                        acc
                    })
                    .collect::<Vec<_>>()
            },
        );

        // Fix-up: each split group's pieces, added in piece order.
        let mut partials = partials.into_iter();
        for g in sched.groups.iter().filter(|g| g.is_split()) {
            let mut sum = partials
                .next()
                .expect("one partial per piece of a split group");
            for _ in g.piece_lo + 1..g.piece_hi {
                let next = partials
                    .next()
                    .expect("one partial per piece of a split group");
                sum.iter_mut().zip(&next).for_each(|(s, n)| *s += n);
            }
            let (lo, hi) = own_rows(g);
            for (o, &s) in out[lo * rank..hi * rank].iter_mut().zip(&sum) {
                *o = s as f32;
            }
        }
        Ok(())
    }
}

forward_engine!(HicooMttkrp, "hicoo");

/// What every task of one MTTKRP reads.
struct HicooPass<'a> {
    h: &'a Hicoo,
    sched: &'a ModeSchedule,
    /// All factors, row-major (the output mode's is not read).
    factors: &'a [&'a [f32]],
    rank: usize,
}

impl HicooPass<'_> {
    /// Adds the contributions of `piece`'s nonzeros into `acc`, the
    /// `rows x rank` f64 buffer of the piece's group (row = the nonzero's
    /// in-block offset in the output mode).
    ///
    /// Dispatches to a kernel specialized for the rank where one exists, and
    /// to the best instruction set of the running CPU (AVX-512, AVX2+FMA or
    /// the baseline). Every variant adds the same f32 products in the same
    /// order, so results are bit-identical.
    fn accumulate(&self, piece: &Piece, acc: &mut [f64]) {
        by_rank!(
            self.rank,
            accumulate_fixed(self, piece, acc),
            accumulate_any(self, piece, acc)
        )
    }
}

/// The first factor row of block coordinate `coord` (`2^b` rows a block).
#[inline(always)]
fn block_rows(factor: &[f32], coord: u32, b: u8, rank: usize) -> &[f32] {
    &factor[((coord as usize) << b) * rank..]
}

/// A register accumulator for a run of nonzeros with the same output row.
///
/// Inside a block the nonzeros are sorted by their offsets, mode 0 first, so
/// for output mode 0 (and wherever a block's nonzeros share an output row)
/// consecutive nonzeros add into the same row: summing them here and adding
/// the run's sum to the buffer once saves a load and store of the buffer row
/// per nonzero. Runs end at block and piece ends, which depend on the tensor
/// only, so the order of additions is still fixed.
struct RowRun<const R: usize> {
    /// The buffer row being summed (`usize::MAX`: none yet).
    row: usize,
    sum: [f64; R],
}

impl<const R: usize> RowRun<R> {
    #[inline(always)]
    fn new() -> Self {
        RowRun {
            row: usize::MAX,
            sum: [0.0; R],
        }
    }

    /// The accumulator of buffer row `offset`, flushing the previous run
    /// into `acc` if it was another row.
    #[inline(always)]
    fn row(&mut self, offset: u8, acc: &mut [f64]) -> &mut [f64; R] {
        let row = usize::from(offset);
        if row != self.row {
            self.flush(acc);
            self.row = row;
        }
        &mut self.sum
    }

    /// Adds the current run into `acc` and starts an empty one.
    #[inline(always)]
    fn flush(&mut self, acc: &mut [f64]) {
        if self.row != usize::MAX {
            let o = acc[self.row * R..]
                .first_chunk_mut::<R>()
                .expect("output offsets are below the group's rows");
            for (o, s) in o.iter_mut().zip(&self.sum) {
                *o += s;
            }
            self.sum = [0.0; R];
            self.row = usize::MAX;
        }
    }
}

/// [`HicooPass::accumulate`] for a rank known at compile time.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn accumulate_fixed<const R: usize>(kernel: &HicooPass<'_>, piece: &Piece, acc: &mut [f64]) {
    let h = kernel.h;
    let sched = kernel.sched;
    let b = h.block_bits();
    let values = h.values();
    let out_off = &h.offsets()[sched.mode];
    let coords = h.block_coords();
    let offsets = h.offsets();

    if let [ma, mb] = *sched.other_modes.as_slice() {
        // Three modes, the common case: two factor rows per nonzero.
        let (fa, fb) = (kernel.factors[ma], kernel.factors[mb]);
        let (oa, ob) = (&offsets[ma], &offsets[mb]);
        for_each_block(piece, &sched.order, h.block_ptr(), |k, nz| {
            let ya = block_rows(fa, coords[ma][k], b, R);
            let yb = block_rows(fb, coords[mb][k], b, R);
            let mut run = RowRun::<R>::new();
            for j in nz {
                let sum = run.row(out_off[j], acc);
                let v = values[j];
                let a = row_of::<R>(ya, u32::from(oa[j]));
                let c = row_of::<R>(yb, u32::from(ob[j]));
                for r in 0..R {
                    sum[r] += f64::from(v * a[r] * c[r]);
                }
            }
            run.flush(acc);
        });
        return;
    }

    let mut rows: Vec<(&[f32], &[u8])> = Vec::with_capacity(sched.other_modes.len());
    for_each_block(piece, &sched.order, h.block_ptr(), |k, nz| {
        rows.clear();
        rows.extend(sched.other_modes.iter().map(|&w| {
            (
                block_rows(kernel.factors[w], coords[w][k], b, R),
                offsets[w].as_slice(),
            )
        }));
        let mut run = RowRun::<R>::new();
        for j in nz {
            let mut prod = [values[j]; R];
            for &(y, off) in &rows {
                let y = row_of::<R>(y, u32::from(off[j]));
                for r in 0..R {
                    prod[r] *= y[r];
                }
            }
            let sum = run.row(out_off[j], acc);
            for r in 0..R {
                sum[r] += f64::from(prod[r]);
            }
        }
        run.flush(acc);
    });
}

/// [`HicooPass::accumulate`] for any rank.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn accumulate_any(kernel: &HicooPass<'_>, piece: &Piece, acc: &mut [f64]) {
    let h = kernel.h;
    let sched = kernel.sched;
    let rank = kernel.rank;
    let b = h.block_bits();
    let values = h.values();
    let out_off = &h.offsets()[sched.mode];
    let coords = h.block_coords();
    let offsets = h.offsets();
    let mut prod = vec![0f32; rank];
    let mut rows: Vec<(&[f32], &[u8])> = Vec::with_capacity(sched.other_modes.len());
    for_each_block(piece, &sched.order, h.block_ptr(), |k, nz| {
        rows.clear();
        rows.extend(sched.other_modes.iter().map(|&w| {
            (
                block_rows(kernel.factors[w], coords[w][k], b, rank),
                offsets[w].as_slice(),
            )
        }));
        for j in nz {
            prod.fill(values[j]);
            for &(y, off) in &rows {
                let y = &y[usize::from(off[j]) * rank..][..rank];
                for (p, &y) in prod.iter_mut().zip(y) {
                    *p *= y;
                }
            }
            let o = &mut acc[usize::from(out_off[j]) * rank..][..rank];
            for (s, &p) in o.iter_mut().zip(&prod) {
                *s += f64::from(p);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuError;
    use crate::MttkrpEngine;
    use crate::testutil::{check_engine, factors_for, shared_tensors};
    use kruskal_formats::FormatError;
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    fn check_all_modes(t: &SparseTensor, engine: &HicooMttkrp, rank: usize) {
        let modes: Vec<usize> = (0..t.nmodes()).collect();
        check_engine(t, &mut engine.clone(), rank, &modes, 1e-6);
    }

    /// Every nonzero of every group is in exactly one piece of it, in
    /// schedule order, and pieces are non-empty.
    fn check_schedule(engine: &HicooMttkrp) {
        let h = engine.hicoo();
        for mode in 0..h.nmodes() {
            let s = engine.schedule(mode);
            let mut seen = vec![0u32; h.nnz()];
            let mut blocks = 0;
            for g in &s.groups {
                let mut expected: Vec<usize> = Vec::new();
                let group_blocks: Vec<usize> = s.order
                    [s.pieces[g.piece_lo].pos_lo..s.pieces[g.piece_hi - 1].pos_hi]
                    .iter()
                    .map(|&k| k as usize)
                    .collect();
                blocks += group_blocks.len();
                for &k in &group_blocks {
                    assert_eq!(h.block_coords()[mode][k], g.coord);
                    expected.extend(h.block_range(k));
                }
                let mut got = Vec::new();
                for piece in &s.pieces[g.piece_lo..g.piece_hi] {
                    let before = got.len();
                    for_each_block(piece, &s.order, h.block_ptr(), |_, nz| got.extend(nz));
                    assert!(got.len() > before, "empty piece {piece:?}");
                }
                assert_eq!(got, expected, "mode {mode} group {}", g.coord);
                for j in got {
                    seen[j] += 1;
                }
            }
            assert_eq!(blocks, h.nblocks());
            assert!(seen.iter().all(|&c| c == 1), "mode {mode}");
        }
    }

    #[test]
    fn heavy_groups_are_split_and_still_exact() {
        // A third of the nonzeros in one index of every mode, so that
        // index's block row is far over the default threshold (2^15
        // nonzeros here) while most groups are light.
        let t = crate::testutil::hot_rows(&[5_000, 4_000, 3_000], 300_000);
        let engine = HicooMttkrp::new(&t, 4).unwrap();
        assert_eq!(engine.split_nnz(), 1 << 15);
        for mode in 0..3 {
            let s = engine.schedule(mode);
            assert!(s.split_groups() > 0, "mode {mode} split nothing");
            assert!(s.split_groups() < s.group_count(), "mode {mode}");
            assert!(s.piece_count() > s.group_count(), "mode {mode}");
        }
        check_schedule(&engine);
        check_all_modes(&t, &engine, 16);
    }

    #[test]
    fn cut_points_inside_one_heavy_block() {
        // All nonzeros in one block: pieces must cut inside it. Every
        // coordinate of the 10 x 10 x 10 cube once.
        let n = 1_000u32;
        let t = SparseTensor::new(
            vec![10, 10, 10],
            vec![
                (0..n).map(|k| k % 10).collect(),
                (0..n).map(|k| (k / 10) % 10).collect(),
                (0..n).map(|k| (k / 100) % 10).collect(),
            ],
            (0..n).map(|k| (k % 13) as f32 - 6.0).collect(),
        )
        .unwrap();
        let engine = HicooMttkrp::with_split_nnz(&t, 4, 300).unwrap();
        assert_eq!(engine.hicoo().nblocks(), 1);
        assert_eq!(engine.schedule(0).piece_count(), 4);
        check_schedule(&engine);
        check_all_modes(&t, &engine, 5);
    }

    #[test]
    fn equals_reference_on_shared_tensors() {
        let tensors = shared_tensors();
        for (name, t) in &tensors {
            for (bits, split) in [(Hicoo::DEFAULT_BLOCK_BITS, 500), (3, usize::MAX)] {
                let engine = HicooMttkrp::with_split_nnz(t, bits, split).unwrap();
                assert_eq!(engine.hicoo().nnz(), t.nnz(), "{name}");
                check_all_modes(t, &engine, 16);
            }
        }
    }

    #[test]
    fn empty_rows_are_zeroed() {
        // Rows 4 and 300 hold nonzeros; with 4-wide blocks the groups before,
        // between and after them are empty, and so are rows of the two
        // groups themselves.
        let t = SparseTensor::new(
            vec![600, 2, 2],
            vec![vec![4, 4, 300], vec![0, 1, 1], vec![1, 1, 0]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap();
        for split in [1, usize::MAX] {
            let engine = HicooMttkrp::with_split_nnz(&t, 2, split).unwrap();
            check_all_modes(&t, &engine, 3);
            let factors = factors_for(t.dims(), 3, 1);
            let mut out = Array2::from_elem((600, 3), f32::NAN);
            engine.mttkrp(0, &factors, &mut out).unwrap();
            for (i, row) in out.rows().into_iter().enumerate() {
                let nonzero = row.iter().any(|&x| x != 0.0);
                assert_eq!(nonzero, i == 4 || i == 300, "row {i}: {row}");
            }
        }
    }

    #[test]
    fn empty_tensor_gives_zeros() {
        let t = SparseTensor::new(vec![5, 3], vec![vec![], vec![]], vec![]).unwrap();
        let engine = HicooMttkrp::new(&t, 7).unwrap();
        let factors = factors_for(t.dims(), 4, 1);
        let mut out = Array2::from_elem((5, 4), f32::NAN);
        engine.mttkrp(0, &factors, &mut out).unwrap();
        assert!(out.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn result_does_not_depend_on_thread_count() {
        let mut spec = PowerLawSpec::new(vec![300, 200, 100, 50], 40_000).with_draws();
        spec.exponents = vec![1.3; 4];
        let t = power_law(&spec).unwrap();
        let engine = HicooMttkrp::with_split_nnz(&t, 3, 700).unwrap();
        assert!(engine.schedule(0).split_groups() > 0);
        for rank in [7, 16] {
            let factors = factors_for(t.dims(), rank, 3);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    let mut out = Array2::zeros((300, rank));
                    engine.mttkrp(0, &factors, &mut out).unwrap();
                    out
                })
            };
            let one = run(1);
            assert!(one.iter().any(|&x| x != 0.0));
            assert_eq!(one, run(3), "rank {rank}");
        }
    }

    #[test]
    fn shape_errors_are_reported() {
        let t = power_law(&PowerLawSpec::new(vec![5, 4, 3], 20).with_draws()).unwrap();
        let mut engine = HicooMttkrp::new(&t, 2).unwrap();
        let mut factors = factors_for(t.dims(), 2, 1);
        let mut out = Array2::zeros((5, 2));
        assert!(matches!(
            engine.mttkrp(3, &factors, &mut out),
            Err(CpuError::Shape(_))
        ));
        let mut wrong_out = Array2::zeros((4, 2));
        assert!(matches!(
            engine.mttkrp(0, &factors, &mut wrong_out),
            Err(CpuError::Shape(_))
        ));
        assert!(MttkrpEngine::mttkrp(&mut engine, 0, &factors[..2], &mut out).is_err());
        factors[1] = Array2::zeros((4, 3));
        let err = engine.mttkrp(0, &factors, &mut out).unwrap_err();
        assert!(err.to_string().contains("columns"), "{err}");
    }

    #[test]
    fn bad_block_bits_are_errors() {
        let t = power_law(&PowerLawSpec::new(vec![5, 4, 3], 20).with_draws()).unwrap();
        assert!(matches!(
            HicooMttkrp::new(&t, 0),
            Err(CpuError::Format(FormatError::Argument(_)))
        ));
        assert!(matches!(
            HicooMttkrp::new(&t, 9),
            Err(CpuError::Format(FormatError::Capacity { .. }))
        ));
        let engine = HicooMttkrp::new(&t, 8).unwrap();
        assert_eq!(engine.name(), "hicoo");
        assert_eq!(MttkrpEngine::dims(&engine), &[5, 4, 3]);
        assert!(MttkrpEngine::bytes(&engine) >= engine.hicoo().bytes());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn equals_reference_on_random_tensors(
            nmodes in 3usize..=6,
            dim_seed in any::<u64>(),
            nnz in 1usize..3_000,
            rank in prop_oneof![1usize..40, Just(64usize)],
            block_bits in prop_oneof![Just(1u8), Just(8u8), 1u8..=8],
            split in prop_oneof![Just(1usize), Just(7), Just(100), Just(usize::MAX)],
            exponent in 0.0f64..1.6,
        ) {
            let dims: Vec<u32> = (0..nmodes)
                .map(|m| 1 + ((dim_seed >> (m * 9)) % 300) as u32)
                .collect();
            let mut spec = PowerLawSpec::new(dims, nnz).with_draws().with_seed(dim_seed);
            spec.exponents = vec![exponent; nmodes];
            let t = power_law(&spec).unwrap();
            let engine = HicooMttkrp::with_split_nnz(&t, block_bits, split).unwrap();
            check_schedule(&engine);
            check_all_modes(&t, &engine, rank);
        }
    }
}
