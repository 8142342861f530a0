//! The parallel f32 MTTKRP of the CPU backend.
//!
//! For each output mode a [`ModePlan`] holds a copy of the nonzeros sorted by
//! the output index (then by the most repetitive other mode, so neighbouring
//! nonzeros reuse cached factor rows). The sorted stream is cut into chunks
//! of about equal nonzero count, one rayon task each:
//!
//! - a chunk owns a contiguous range of output rows and writes them directly,
//!   so no atomics or locks are needed;
//! - chunk boundaries fall between rows, except inside a row heavier than a
//!   chunk's fair share (real tensors have rows holding 15% of all nonzeros):
//!   such a row is split, each chunk returns its partial sum of that row, and
//!   the partials are added afterwards in chunk order.
//!
//! Products are computed in f32 and accumulated in f64 per row (or piece),
//! then stored as f32. Chunking depends only on the tensor, not on the thread
//! count, and partials are summed in a fixed order: the result is
//! bit-identical for any number of threads.

use kruskal_formats::SparseTensor;
use kruskal_partition::layout::sort_by_two;
use ndarray::Array2;
use rayon::prelude::*;

use crate::{Result, mttkrp_slices, row_of};

/// Target nonzeros per chunk. Small enough for load balance through work
/// stealing, large enough that the per-chunk overhead (two partial rows) is
/// negligible.
const CHUNK_NNZ: usize = 1 << 13;
/// Upper bound on the number of chunks (bounds the fix-up work).
const MAX_CHUNKS: usize = 1 << 16;

/// One output mode's sorted copy of the tensor and its chunking.
#[derive(Clone, Debug)]
pub struct ModePlan {
    mode: usize,

    /// The other modes, in the order their indices are stored.
    other_modes: Vec<usize>,
    /// `other[k]`: indices of mode `other_modes[k]`, in sorted order.
    other: Vec<Vec<u32>>,
    values: Vec<f32>,
    /// Distinct output indices, ascending; segment `s` is row `rows[s]`.
    rows: Vec<u32>,
    /// Segment `s` holds nonzeros `seg_ptr[s]..seg_ptr[s + 1]`.
    seg_ptr: Vec<usize>,
    chunks: Vec<Chunk>,
}

/// A task's share of one mode's nonzeros.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Chunk {
    /// Segments `seg_lo..=seg_hi` are touched by this chunk (empty chunks
    /// do not exist).
    seg_lo: usize,
    seg_hi: usize,
    /// Nonzeros `nnz_lo..nnz_hi`.
    nnz_lo: usize,
    nnz_hi: usize,
    /// Output rows `row_lo..row_hi` belong to this chunk (it zeroes them and
    /// writes the ones it holds whole).
    row_lo: usize,
    row_hi: usize,
}

impl Chunk {
    /// The first segment started in an earlier chunk.
    fn head_shared(&self, seg_ptr: &[usize]) -> bool {
        seg_ptr[self.seg_lo] < self.nnz_lo
    }
    /// The last segment goes on in a later chunk.
    fn tail_shared(&self, seg_ptr: &[usize]) -> bool {
        seg_ptr[self.seg_hi + 1] > self.nnz_hi
    }
}

impl ModePlan {
    /// Sorts a copy of the tensor for output mode `mode` and cuts it into
    /// chunks of about `chunk_nnz` nonzeros.
    ///
    /// Cost: a parallel sort and one gather of every array; a copy of the
    /// tensor in memory.
    pub fn new(tensor: &SparseTensor, mode: usize, chunk_nnz: usize) -> Self {
        let nnz = tensor.nnz();
        let dims = tensor.dims();
        let mut other_modes: Vec<usize> = (0..tensor.nmodes()).filter(|&w| w != mode).collect();
        // The smallest other mode repeats most: sorting by it second keeps
        // runs of equal factor rows together inside an output row.
        other_modes.sort_by_key(|&w| dims[w]);
        let primary = tensor.mode_indices(mode);
        // A one-mode tensor has no other mode: its rows are its nonzeros.
        let second = other_modes.first().map_or(mode, |&w| w);
        let perm = sort_by_two(primary, tensor.mode_indices(second));
        let gather = |src: &[u32]| -> Vec<u32> { perm.par_iter().map(|&p| src[p]).collect() };
        let other: Vec<Vec<u32>> = other_modes
            .iter()
            .map(|&w| gather(tensor.mode_indices(w)))
            .collect();
        let values: Vec<f32> = perm.par_iter().map(|&p| tensor.values()[p]).collect();
        let out_idx = gather(tensor.mode_indices(mode));
        drop(perm);

        let mut rows = Vec::new();
        let mut seg_ptr = Vec::new();
        for (k, &i) in out_idx.iter().enumerate() {
            if k == 0 || out_idx[k - 1] != i {
                rows.push(i);
                seg_ptr.push(k);
            }
        }
        seg_ptr.push(nnz);
        let chunks = plan_chunks(&rows, &seg_ptr, dims[mode] as usize, chunk_nnz);
        ModePlan {
            mode,

            other_modes,
            other,
            values,
            rows,
            seg_ptr,
            chunks,
        }
    }

    pub fn mode(&self) -> usize {
        self.mode
    }

    /// Number of tasks the mode is cut into.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// Number of output rows split across tasks (heavy rows, or rows that a
    /// chunk boundary had to cut).
    pub fn split_rows(&self) -> usize {
        self.chunks
            .iter()
            .filter(|c| c.tail_shared(&self.seg_ptr))
            .count()
    }

    /// Bytes this plan holds.
    pub fn bytes(&self) -> usize {
        self.values.len() * 4 * (1 + self.other.len())
            + self.rows.len() * 4
            + self.seg_ptr.len() * 8
            + self.chunks.len() * std::mem::size_of::<Chunk>()
    }
}

/// Chooses chunk boundaries: every `chunk_nnz` nonzeros, moved to the nearer
/// row boundary unless the row there is heavier than `chunk_nnz`.
fn plan_chunks(rows: &[u32], seg_ptr: &[usize], dim: usize, chunk_nnz: usize) -> Vec<Chunk> {
    let nnz = *seg_ptr.last().unwrap_or(&0);
    if nnz == 0 {
        return Vec::new();
    }
    let nchunks = nnz.div_ceil(chunk_nnz.max(1)).clamp(1, MAX_CHUNKS);
    let fair = nnz.div_ceil(nchunks);
    // Boundaries in nonzero positions, strictly increasing, 0 and nnz included.
    let mut cuts = vec![0usize];
    for k in 1..nchunks {
        let target = k * nnz / nchunks;
        // Segment holding `target`: last s with seg_ptr[s] <= target.
        let s = seg_ptr.partition_point(|&p| p <= target) - 1;
        let (lo, hi) = (seg_ptr[s], seg_ptr[s + 1]);
        let cut = if lo == target || hi - lo > fair {
            target
        } else if target - lo <= hi - target {
            lo
        } else {
            hi
        };
        if cut > *cuts.last().expect("cuts starts with 0") && cut < nnz {
            cuts.push(cut);
        }
    }
    cuts.push(nnz);

    let seg_of = |pos: usize| seg_ptr.partition_point(|&p| p <= pos) - 1;
    let mut chunks: Vec<Chunk> = cuts
        .windows(2)
        .map(|w| Chunk {
            seg_lo: seg_of(w[0]),
            seg_hi: seg_of(w[1] - 1),
            nnz_lo: w[0],
            nnz_hi: w[1],
            row_lo: rows[seg_of(w[0])] as usize,
            row_hi: 0,
        })
        .collect();
    // Rows before the first nonzero row belong to the first chunk, and each
    // chunk's rows run up to the next chunk's first row (or the end).
    chunks[0].row_lo = 0;
    let n = chunks.len();
    for k in 0..n {
        chunks[k].row_hi = if k + 1 < n { chunks[k + 1].row_lo } else { dim };
    }
    chunks
}

/// A row partial of a split row, returned by a chunk for the fix-up.
struct Partial {
    row: usize,
    sums: Vec<f64>,
}

/// The CPU MTTKRP engine: one [`ModePlan`] per mode, built once per tensor
/// and reused for every MTTKRP of a CPD run.
#[derive(Clone, Debug)]
pub struct CpuMttkrp {
    dims: Vec<u32>,
    plans: Vec<ModePlan>,
}

impl CpuMttkrp {
    /// Builds the plans of every mode (memory: one copy of the tensor per
    /// mode).
    pub fn new(tensor: &SparseTensor) -> Self {
        Self::with_chunk_nnz(tensor, CHUNK_NNZ)
    }

    /// As [`CpuMttkrp::new`] with a given target chunk size (smaller chunks
    /// split more rows; tests use this to force splitting).
    pub fn with_chunk_nnz(tensor: &SparseTensor, chunk_nnz: usize) -> Self {
        let plans = (0..tensor.nmodes())
            .map(|mode| ModePlan::new(tensor, mode, chunk_nnz))
            .collect();
        CpuMttkrp {
            dims: tensor.dims().to_vec(),
            plans,
        }
    }

    pub fn plan(&self, mode: usize) -> &ModePlan {
        &self.plans[mode]
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// Bytes held by all plans.
    pub fn bytes(&self) -> usize {
        self.plans.iter().map(ModePlan::bytes).sum()
    }

    /// Computes the MTTKRP for output `mode` into `out` (overwritten).
    ///
    /// Shapes: `factors[w]` is `dims[w] x rank` for every mode and `out` is
    /// `dims[mode] x rank`, all in standard (row-major, contiguous) layout.
    /// Cost: `nnz * (nmodes - 1) * rank` multiply-adds, parallel over chunks.
    pub fn mttkrp(
        &self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<()> {
        let (rank, factors, out_slice) = mttkrp_slices(&self.dims, mode, factors, out)?;
        let plan = &self.plans[mode];
        let other: Vec<&[f32]> = plan.other_modes.iter().map(|&w| factors[w]).collect();
        if plan.chunks.is_empty() {
            out_slice.fill(0.0);
            return Ok(());
        }

        // Hand each chunk the output rows it owns.
        let mut pieces = Vec::with_capacity(plan.chunks.len());
        let mut rest = &mut *out_slice;
        for chunk in &plan.chunks {
            let (mine, tail) = rest.split_at_mut((chunk.row_hi - chunk.row_lo) * rank);
            pieces.push((chunk, mine));
            rest = tail;
        }

        let partials: Vec<Vec<Partial>> = pieces
            .into_par_iter()
            .map(|(chunk, mine)| run_chunk(plan, chunk, &other, rank, mine))
            .collect();

        // Fix-up: sum the pieces of each split row in chunk order.
        let mut pending: Option<Partial> = None;
        for p in partials.into_iter().flatten() {
            match &mut pending {
                Some(cur) if cur.row == p.row => {
                    cur.sums.iter_mut().zip(&p.sums).for_each(|(a, b)| *a += b);
                }
                _ => {
                    if let Some(done) = pending.replace(p) {
                        store_row(out_slice, rank, &done);
                    }
                }
            }
        }
        if let Some(done) = pending {
            store_row(out_slice, rank, &done);
        }
        Ok(())
    }
}

forward_engine!(CpuMttkrp, "sorted");

fn store_row(out: &mut [f32], rank: usize, p: &Partial) {
    let dst = &mut out[p.row * rank..(p.row + 1) * rank];
    for (d, &s) in dst.iter_mut().zip(&p.sums) {
        *d = s as f32;
    }
}

/// One task: zero the owned rows, accumulate every segment of the chunk, and
/// write whole segments directly; return the partials of split segments.
///
/// Dispatches to a kernel specialized for the rank where one exists (its f64
/// accumulator then lives in registers), and to the best instruction set of
/// the running CPU (AVX-512, AVX2+FMA, or the baseline). Every variant adds
/// the same f32 products in the same order, so results are bit-identical.
fn run_chunk(
    plan: &ModePlan,
    chunk: &Chunk,
    other: &[&[f32]],
    rank: usize,
    mine: &mut [f32],
) -> Vec<Partial> {
    by_rank!(
        rank,
        run_chunk_fixed(plan, chunk, other, mine),
        run_chunk_any(plan, chunk, other, rank, mine)
    )
}

/// Walks the segments of a chunk: `sum_segment(lo, hi, acc)` adds the
/// nonzeros `lo..hi` into `acc` (zeroed by the caller).
#[inline(always)]
fn walk_chunk(
    plan: &ModePlan,
    chunk: &Chunk,
    rank: usize,
    mine: &mut [f32],
    acc: &mut [f64],
    mut sum_segment: impl FnMut(usize, usize, &mut [f64]),
) -> Vec<Partial> {
    mine.fill(0.0);
    let mut partials = Vec::new();
    let head_shared = chunk.head_shared(&plan.seg_ptr);
    let tail_shared = chunk.tail_shared(&plan.seg_ptr);
    for s in chunk.seg_lo..=chunk.seg_hi {
        let lo = plan.seg_ptr[s].max(chunk.nnz_lo);
        let hi = plan.seg_ptr[s + 1].min(chunk.nnz_hi);
        acc.fill(0.0);
        sum_segment(lo, hi, acc);
        let row = plan.rows[s] as usize;
        let split = (s == chunk.seg_lo && head_shared) || (s == chunk.seg_hi && tail_shared);
        if split {
            partials.push(Partial {
                row,
                sums: acc.to_vec(),
            });
        } else {
            let local = row - chunk.row_lo;
            let dst = &mut mine[local * rank..(local + 1) * rank];
            for (d, &a) in dst.iter_mut().zip(acc.iter()) {
                *d = a as f32;
            }
        }
    }
    partials
}

/// [`run_chunk`] for a rank known at compile time.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn run_chunk_fixed<const R: usize>(
    plan: &ModePlan,
    chunk: &Chunk,
    other: &[&[f32]],
    mine: &mut [f32],
) -> Vec<Partial> {
    let mut acc = [0f64; R];
    let values = &plan.values;
    if let ([a_idx, b_idx], [fa, fb]) = (plan.other.as_slice(), other) {
        return walk_chunk(plan, chunk, R, mine, &mut acc, |lo, hi, out| {
            // A local accumulator the compiler can keep in registers.
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
    walk_chunk(plan, chunk, R, mine, &mut acc, |lo, hi, out| {
        let mut sum = [0f64; R];
        for k in lo..hi {
            let mut prod = [values[k]; R];
            for (idx, factor) in plan.other.iter().zip(other) {
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

/// [`run_chunk`] for any rank.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn run_chunk_any(
    plan: &ModePlan,
    chunk: &Chunk,
    other: &[&[f32]],
    rank: usize,
    mine: &mut [f32],
) -> Vec<Partial> {
    let mut acc = vec![0f64; rank];
    let mut prod = vec![0f32; rank];
    let values = &plan.values;
    walk_chunk(plan, chunk, rank, mine, &mut acc, |lo, hi, sum| {
        for k in lo..hi {
            prod.fill(values[k]);
            for (idx, factor) in plan.other.iter().zip(other) {
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
    use crate::testutil::{check_engine, factors_for, shared_tensors};
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    fn check_all_modes(t: &SparseTensor, engine: &CpuMttkrp, rank: usize) {
        let modes: Vec<usize> = (0..t.nmodes()).collect();
        check_engine(t, &mut engine.clone(), rank, &modes, 1e-6);
    }

    #[test]
    fn heavy_rows_are_split_and_still_exact() {
        // Zipf 1.5 puts ~40% of nonzeros in one row of every mode.
        let mut spec = PowerLawSpec::new(vec![200, 150, 100], 50_000).with_draws();
        spec.exponents = vec![1.5; 3];
        let t = power_law(&spec).unwrap();
        let engine = CpuMttkrp::with_chunk_nnz(&t, 1_000);
        for mode in 0..3 {
            assert!(
                engine.plan(mode).split_rows() > 0,
                "mode {mode} split nothing"
            );
        }
        check_all_modes(&t, &engine, 16);
    }

    #[test]
    fn equals_reference_on_shared_tensors() {
        let tensors = shared_tensors();
        for (_, t) in &tensors {
            check_all_modes(t, &CpuMttkrp::with_chunk_nnz(t, 500), 16);
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
        check_all_modes(&t, &CpuMttkrp::with_chunk_nnz(&t, 1), 3);
    }

    #[test]
    fn result_does_not_depend_on_thread_count() {
        let t =
            power_law(&PowerLawSpec::new(vec![300, 200, 100, 50], 40_000).with_draws()).unwrap();
        let engine = CpuMttkrp::with_chunk_nnz(&t, 500);
        let factors = factors_for(t.dims(), 7, 3);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut out = Array2::zeros((300, 7));
                engine.mttkrp(0, &factors, &mut out).unwrap();
                out
            })
        };
        assert_eq!(run(1), run(3));
    }

    #[test]
    fn shape_errors_are_reported() {
        let t = power_law(&PowerLawSpec::new(vec![5, 4, 3], 20).with_draws()).unwrap();
        let engine = CpuMttkrp::new(&t);
        let mut factors = factors_for(t.dims(), 2, 1);
        let mut out = Array2::zeros((5, 2));
        assert!(engine.mttkrp(3, &factors, &mut out).is_err());
        let mut wrong_out = Array2::zeros((4, 2));
        assert!(engine.mttkrp(0, &factors, &mut wrong_out).is_err());
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
            nnz in 1usize..3_000,
            rank in prop_oneof![1usize..40, Just(64usize)],
            chunk in prop_oneof![Just(1usize), Just(7), Just(100), Just(CHUNK_NNZ)],
            exponent in 0.0f64..1.6,
        ) {
            let dims: Vec<u32> = (0..nmodes)
                .map(|m| 1 + ((dim_seed >> (m * 8)) % 60) as u32)
                .collect();
            let mut spec = PowerLawSpec::new(dims, nnz).with_draws().with_seed(dim_seed);
            spec.exponents = vec![exponent; nmodes];
            let t = power_law(&spec).unwrap();
            let engine = CpuMttkrp::with_chunk_nnz(&t, chunk);
            check_all_modes(&t, &engine, rank);
        }
    }
}
