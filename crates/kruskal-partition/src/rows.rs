//! Whole output rows per GPU, relabeled so that each GPU's rows are one
//! contiguous range: the multi-GPU plan of `kruskal-device`'s group.
//!
//! For each mode, the output rows go to GPUs by greedy LPT on their nonzero
//! counts (AMPED's tensor sharding): every nonzero of a row lands on one
//! GPU, so no two GPUs write the same output row. The rows are then given
//! new labels, GPU by GPU (inside a GPU in their old order), so that GPU
//! `g` owns rows `rows(mode, g)` of the relabeled factor. That turns the
//! exchange after each mode into an all-gather of contiguous blocks, and
//! the per-GPU factor update into a dense update of one slice.
//!
//! Rows are never split across GPUs. A row holding more than `1/gpus` of a
//! mode's nonzeros therefore caps the balance; [`RowShards::balance`]
//! reports it. (A Zipf(1.1) tensor's hottest row holds about 15%, so this
//! matters only beyond 6 GPUs.)
//!
//! The elements of a mode (see [`RowShards::fill_elements`]) are the
//! relabeled indices of every mode and the value's bits, `nmodes + 1`
//! words per nonzero, sorted by the mode's relabeled index, so GPU `g`'s
//! shard is one contiguous range and equal rows are adjacent.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use kruskal_formats::SparseTensor;
use rayon::prelude::*;

use crate::lpt::{Balance, lpt};
use crate::{PartitionError, Result};

/// Nonzeros per rayon task when scattering elements.
const SCATTER_CHUNK: usize = 1 << 16;

/// The row plan of every mode over `gpus` GPUs.
#[derive(Clone, Debug)]
pub struct RowShards {
    gpus: usize,
    dims: Vec<u32>,
    /// Per mode, the new label of each old row index.
    relabel: Vec<Vec<u32>>,
    /// Per mode, `gpus + 1` boundaries of the GPUs' row ranges (new labels).
    row_ptr: Vec<Vec<u32>>,
    /// Per mode, the nonzeros of each GPU.
    loads: Vec<Vec<u64>>,
    /// Per mode, nonzeros per new row label.
    counts: Vec<Vec<u64>>,
}

impl RowShards {
    /// Plans every mode of `t` over `gpus` GPUs.
    pub fn new(t: &SparseTensor, gpus: usize) -> Result<Self> {
        if gpus == 0 {
            return Err(PartitionError::Argument(
                "a row plan needs at least one GPU".into(),
            ));
        }
        let n = t.nmodes();
        let mut relabel = Vec::with_capacity(n);
        let mut row_ptr = Vec::with_capacity(n);
        let mut loads = Vec::with_capacity(n);
        let mut counts = Vec::with_capacity(n);
        for mode in 0..n {
            let old_counts = t.mode_counts(mode);
            let mut assignment = lpt(&old_counts, gpus);
            spread_empty_rows(&old_counts, &mut assignment.part_of, gpus);
            // New labels: GPU by GPU, old order inside a GPU.
            let mut ptr = vec![0u32; gpus + 1];
            for &g in &assignment.part_of {
                ptr[g as usize + 1] += 1;
            }
            for g in 0..gpus {
                ptr[g + 1] += ptr[g];
            }
            let mut next = ptr.clone();
            let mut labels = vec![0u32; old_counts.len()];
            let mut new_counts = vec![0u64; old_counts.len()];
            for (old, &g) in assignment.part_of.iter().enumerate() {
                let label = next[g as usize];
                next[g as usize] += 1;
                labels[old] = label;
                new_counts[label as usize] = old_counts[old];
            }
            relabel.push(labels);
            row_ptr.push(ptr);
            loads.push(assignment.loads);
            counts.push(new_counts);
        }
        Ok(RowShards {
            gpus,
            dims: t.dims().to_vec(),
            relabel,
            row_ptr,
            loads,
            counts,
        })
    }

    pub fn gpus(&self) -> usize {
        self.gpus
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// `relabel(mode)[old]`: the new label of row `old` of `mode`.
    pub fn relabel(&self, mode: usize) -> &[u32] {
        &self.relabel[mode]
    }

    /// The rows GPU `g` owns in `mode` (new labels).
    pub fn rows(&self, mode: usize, g: usize) -> Range<u32> {
        self.row_ptr[mode][g]..self.row_ptr[mode][g + 1]
    }

    /// Nonzeros of GPU `g`'s shard of `mode`.
    pub fn nnz(&self, mode: usize, g: usize) -> u64 {
        self.loads[mode][g]
    }

    /// Nonzeros per GPU in `mode`.
    pub fn balance(&self, mode: usize) -> Balance {
        Balance::of(&self.loads[mode])
    }

    /// Words per element: one index per mode and the value's bits.
    pub fn stride(&self) -> usize {
        self.dims.len() + 1
    }

    /// Writes mode `mode`'s elements into `out` (`nnz * stride()` words):
    /// relabeled indices of every mode, then the value's bits, sorted by
    /// the relabeled index of `mode` (a parallel counting sort; the order
    /// of the nonzeros inside one row is unspecified). GPU `g`'s shard is
    /// elements `offsets[g]..offsets[g + 1]` of the returned offsets.
    pub fn fill_elements(
        &self,
        t: &SparseTensor,
        mode: usize,
        out: &mut [u32],
    ) -> Result<Vec<u64>> {
        let stride = self.stride();
        if t.dims() != self.dims.as_slice() || mode >= self.dims.len() {
            return Err(PartitionError::Argument(format!(
                "a tensor of dims {:?} (mode {mode}) for a plan of dims {:?}",
                t.dims(),
                self.dims
            )));
        }
        if out.len() != t.nnz() * stride {
            return Err(PartitionError::Argument(format!(
                "{} words for {} elements of {stride} words",
                out.len(),
                t.nnz()
            )));
        }
        // First element of each new row (and the end), then a cursor per
        // row that the scatter advances.
        let first: Vec<u64> = std::iter::once(0)
            .chain(self.counts[mode].iter().scan(0u64, |acc, &c| {
                *acc += c;
                Some(*acc)
            }))
            .collect();
        let start: Vec<AtomicU64> = first[..first.len() - 1]
            .iter()
            .map(|&f| AtomicU64::new(f))
            .collect();
        let labels = &self.relabel;
        let out_ptr = SharedOut(out.as_mut_ptr());
        let nnz = t.nnz();
        (0..nnz.div_ceil(SCATTER_CHUNK))
            .into_par_iter()
            .for_each(|chunk| {
                let out_ptr = &out_ptr;
                let lo = chunk * SCATTER_CHUNK;
                let hi = (lo + SCATTER_CHUNK).min(nnz);
                let own = t.mode_indices(mode);
                for k in lo..hi {
                    let row = labels[mode][own[k] as usize] as usize;
                    let pos = start[row].fetch_add(1, Ordering::Relaxed) as usize;
                    // SAFETY: the cursors hand out every position in
                    // 0..nnz exactly once (each row's range has its count's
                    // length and the ranges tile 0..nnz), so no two writes
                    // touch the same element, and `out` holds nnz * stride
                    // words (checked above).
                    let e = unsafe { out_ptr.element(pos, stride) };
                    for (w, slot) in e[..stride - 1].iter_mut().enumerate() {
                        *slot = labels[w][t.mode_indices(w)[k] as usize];
                    }
                    e[stride - 1] = t.values()[k].to_bits();
                }
            });
        Ok(self.row_ptr[mode]
            .iter()
            .map(|&r| first[r as usize])
            .collect())
    }
}

/// Rows without nonzeros weigh nothing to LPT, which would give them all
/// to one GPU; they still cost a row of the dense update and of the
/// exchange, so they are dealt out to even the GPUs' row counts.
fn spread_empty_rows(counts: &[u64], part_of: &mut [u32], gpus: usize) {
    let mut rows = vec![0usize; gpus];
    for (&c, &g) in counts.iter().zip(part_of.iter()) {
        if c > 0 {
            rows[g as usize] += 1;
        }
    }
    let target = counts.len().div_ceil(gpus);
    let mut g = 0;
    for (&c, slot) in counts.iter().zip(part_of.iter_mut()) {
        if c > 0 {
            continue;
        }
        while g + 1 < gpus && rows[g] >= target {
            g += 1;
        }
        *slot = g as u32;
        rows[g] += 1;
    }
}

/// The element buffer, shared by the scatter's tasks (each writes
/// positions no other task writes).
struct SharedOut(*mut u32);

// SAFETY: tasks write disjoint elements (see `fill_elements`).
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Element `pos` (`stride` words).
    ///
    /// # Safety
    /// `pos` must be in bounds and written by this caller only.
    #[allow(clippy::mut_from_ref)]
    unsafe fn element(&self, pos: usize, stride: usize) -> &mut [u32] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(pos * stride), stride) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn every_gpu_owns_a_contiguous_range_and_its_shard_holds_exactly_its_rows(
            seed in any::<u64>(),
            nnz in 1usize..4_000,
            gpus in 1usize..6,
            exponent in 0.0f64..1.6,
        ) {
            let mut spec = PowerLawSpec::new(vec![70, 40, 25, 9], nnz).with_seed(seed);
            spec.exponents = vec![exponent; 4];
            let t = power_law(&spec).unwrap();
            let plan = RowShards::new(&t, gpus).unwrap();
            let stride = plan.stride();
            for mode in 0..4 {
                // The relabeling is a permutation of the rows.
                let mut seen = plan.relabel(mode).to_vec();
                seen.sort_unstable();
                prop_assert_eq!(seen, (0..t.dims()[mode]).collect::<Vec<_>>());
                prop_assert_eq!(plan.rows(mode, gpus - 1).end, t.dims()[mode]);
                let mut elems = vec![0u32; t.nnz() * stride];
                let offsets = plan.fill_elements(&t, mode, &mut elems).unwrap();
                prop_assert_eq!(offsets.len(), gpus + 1);
                prop_assert_eq!(*offsets.last().unwrap(), t.nnz() as u64);
                for g in 0..gpus {
                    prop_assert_eq!(offsets[g + 1] - offsets[g], plan.nnz(mode, g));
                    let rows = plan.rows(mode, g);
                    for k in offsets[g]..offsets[g + 1] {
                        let row = elems[k as usize * stride + mode];
                        prop_assert!(rows.contains(&row));
                    }
                }
                // Sorted by the mode's label.
                prop_assert!(elems.chunks(stride).is_sorted_by_key(|e| e[mode]));
                // The same nonzeros, relabeled: compare sorted tuples.
                let mut want: Vec<Vec<u32>> = (0..t.nnz())
                    .map(|k| {
                        let mut e: Vec<u32> = (0..4)
                            .map(|w| plan.relabel(w)[t.mode_indices(w)[k] as usize])
                            .collect();
                        e.push(t.values()[k].to_bits());
                        e
                    })
                    .collect();
                let mut got: Vec<Vec<u32>> = elems.chunks(stride).map(<[u32]>::to_vec).collect();
                want.sort_unstable();
                got.sort_unstable();
                prop_assert_eq!(got, want);
            }
        }
    }

    #[test]
    fn rows_go_to_gpus_by_lpt_and_bad_arguments_are_errors() {
        let t = SparseTensor::new(
            vec![4, 2, 2],
            vec![vec![0, 0, 0, 0, 1, 1, 2, 3], vec![0; 8], vec![1; 8]],
            vec![1.0; 8],
        )
        .unwrap();
        let plan = RowShards::new(&t, 2).unwrap();
        // Row 0 (4 nonzeros) alone on one GPU, rows 1-3 (4) on the other.
        let mut loads: Vec<u64> = (0..2).map(|g| plan.nnz(0, g)).collect();
        loads.sort_unstable();
        assert_eq!(loads, [4, 4]);
        assert!((plan.balance(0).max_over_mean() - 1.0).abs() < 1e-12);
        assert!(RowShards::new(&t, 0).is_err());
        // Empty rows are dealt out evenly: 1,000 rows, 10 with nonzeros.
        let t = SparseTensor::new(
            vec![1_000, 2, 2],
            vec![(0..10).collect(), vec![0; 10], vec![1; 10]],
            vec![1.0; 10],
        )
        .unwrap();
        let plan = RowShards::new(&t, 3).unwrap();
        let rows: Vec<usize> = (0..3).map(|g| plan.rows(0, g).len()).collect();
        assert!(rows.iter().all(|&r| (332..=334).contains(&r)), "{rows:?}");
        let mut short = vec![0u32; 3];
        assert!(plan.fill_elements(&t, 0, &mut short).is_err());
        let mut ok = vec![0u32; 8 * 4];
        assert!(plan.fill_elements(&t, 3, &mut ok).is_err());
    }
}
