//! Per-mode statistics ([`ModeStats`]) without arrays sized by a
//! dimension when the dimension dwarfs the nonzeros.
//!
//! Counting nonzeros per index takes one counter per index: 24 GB for a
//! dimension of three billion, even when the file has three lines. When a
//! dimension is much larger than the nonzero count, the statistics come
//! instead from a sorted copy of the mode's indices (runs of equal
//! indices are the non-empty slices), whose size is the nonzero count.
//! Both ways give identical results, ties included.

use rayon::prelude::*;

use crate::coo::{ModeStats, SparseTensor};

/// Above this many indices per nonzero, sorting is cheaper than counters.
const SORT_ABOVE_DIM_PER_NNZ: u64 = 4;

/// The statistics of `mode` of `t`, by counters per index or, for a
/// dimension more than 4 times the nonzero count, by sorting the mode's
/// indices.
pub(crate) fn mode_stats(t: &SparseTensor, mode: usize) -> ModeStats {
    let dim = u64::from(t.dims()[mode]);
    if dim > SORT_ABOVE_DIM_PER_NNZ * t.nnz() as u64 {
        by_sorting(t, mode)
    } else {
        by_counting(t, mode)
    }
}

/// One counter per index.
pub(crate) fn by_counting(t: &SparseTensor, mode: usize) -> ModeStats {
    let counts = t.mode_counts(mode);
    let nonempty: Vec<u64> = counts.iter().copied().filter(|&c| c > 0).collect();
    // max_by_key keeps the last of equal maxima: the largest such index.
    let (argmax, &max) = counts
        .iter()
        .enumerate()
        .max_by_key(|&(_, c)| *c)
        .unwrap_or((0, &0));
    finish(t, mode, &nonempty, max, argmax as u32)
}

/// Runs of a sorted copy of the indices.
pub(crate) fn by_sorting(t: &SparseTensor, mode: usize) -> ModeStats {
    let mut sorted = t.mode_indices(mode).to_vec();
    sorted.par_sort_unstable();
    let mut nonempty = Vec::new();
    // Every index of an empty mode has count 0; the largest is the hottest,
    // as with counters.
    let (mut max, mut argmax) = (0u64, t.dims()[mode].saturating_sub(1));
    for run in sorted.chunk_by(|a, b| a == b) {
        let n = run.len() as u64;
        if n >= max {
            (max, argmax) = (n, run[0]);
        }
        nonempty.push(n);
    }
    finish(t, mode, &nonempty, max, argmax)
}

fn finish(t: &SparseTensor, mode: usize, nonempty: &[u64], max: u64, argmax: u32) -> ModeStats {
    let dim = t.dims()[mode];
    ModeStats {
        dim,
        nonempty_slices: nonempty.len() as u64,
        empty_slices: u64::from(dim) - nonempty.len() as u64,
        degree_min: nonempty.iter().copied().min().unwrap_or(0),
        degree_mean: if nonempty.is_empty() {
            0.0
        } else {
            t.nnz() as f64 / nonempty.len() as f64
        },
        degree_max: max,
        hottest_index: argmax,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_huge_dimension_is_not_allocated() {
        let t = SparseTensor::new(
            vec![3_000_000_000, 4],
            vec![vec![2_999_999_999, 5, 5], vec![0, 1, 2]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap();
        // By counters this would take 24 GB; it returns at once.
        let s = mode_stats(&t, 0);
        assert_eq!(s.nonempty_slices, 2);
        assert_eq!(s.empty_slices, 2_999_999_998);
        assert_eq!((s.degree_min, s.degree_max, s.hottest_index), (1, 2, 5));
        assert_eq!(s.degree_mean, 1.5);
    }

    #[test]
    fn an_empty_tensor_agrees() {
        let t = SparseTensor::new(vec![5, 6], vec![vec![], vec![]], vec![]).unwrap();
        assert_eq!(by_sorting(&t, 1), by_counting(&t, 1));
        assert_eq!(by_sorting(&t, 1).hottest_index, 5);
    }

    proptest! {
        #[test]
        fn sorting_and_counting_agree(
            entries in proptest::collection::vec((0u32..6, 0u32..300), 1..80)
        ) {
            let t = SparseTensor::new(
                vec![6, 300],
                vec![entries.iter().map(|e| e.0).collect(), entries.iter().map(|e| e.1).collect()],
                vec![1.0; entries.len()],
            ).unwrap();
            for mode in 0..2 {
                prop_assert_eq!(by_sorting(&t, mode), by_counting(&t, mode));
            }
        }
    }
}
