//! Tensor features for choosing a GPU engine and its launch parameters
//! (ScalFrag, CLUSTER'24, section IV-B: slices, fibers, their ratios, the
//! largest and mean nonzeros per slice and per fiber, and how skewed the
//! nonzeros are).
//!
//! Definitions, for output mode `n` of a tensor with `nnz` stored nonzeros
//! (duplicates count as stored):
//!
//! - **slice**: an index `i` of mode `n` that holds at least one nonzero
//!   (an output row of the mode's MTTKRP).
//! - **fiber**: a distinct pair `(i_n, i_f)`, where `f` is the mode's *fiber
//!   mode*: the other mode with the smallest dimension (ties go to the lower
//!   mode). This is the second level of a CSF tree rooted at `n` (SPLATT's
//!   fibers) and exactly the run of nonzeros over which `fcoo`, which sorts
//!   by `(i_n, i_f)`, reuses one row of the fiber mode's factor. Counting
//!   pairs instead of the full `(N-1)`-tuples keeps the cost to one 64-bit
//!   key per nonzero, whatever the number of modes. A one-mode tensor's
//!   fibers are its slices.
//! - **skew**: the largest over the mean nonzeros per slice (and per
//!   fiber), their coefficient of variation (standard deviation over mean),
//!   and the Gini coefficient of the slice sizes (0 when every slice holds
//!   as many nonzeros, towards 1 when one slice holds them all). Means,
//!   deviations and Gini are over non-empty slices and fibers; empty slices
//!   show in `slice_ratio`.
//!
//! Every ratio with a zero denominator is 0, so features are always finite.
//!
//! ```
//! use kruskal_formats::SparseTensor;
//! use kruskal_tune::TensorFeatures;
//!
//! // 3 x 2 x 2, four nonzeros.
//! let t = SparseTensor::new(
//!     vec![3, 2, 2],
//!     vec![vec![0, 0, 0, 2], vec![0, 1, 1, 0], vec![0, 0, 1, 1]],
//!     vec![1.0; 4],
//! )
//! .unwrap();
//! let f = TensorFeatures::compute(&t);
//! assert_eq!(f.modes[0].slices, 2); // indices 0 and 2
//! assert_eq!(f.modes[0].fiber_mode, Some(1)); // mode 2 (dim 2, before mode 3)
//! assert_eq!(f.modes[0].fibers, 3); // (0,0), (0,1), (2,0)
//! assert_eq!(f.modes[0].max_nnz_per_fiber, 2); // (0,1) holds two
//! assert_eq!(f.mode_vector(0).len(), TensorFeatures::MODE_VECTOR_NAMES.len());
//! ```

use rayon::prelude::*;

use kruskal_formats::SparseTensor;

/// The features of one output mode (see the module documentation for the
/// definitions).
#[derive(Clone, Debug, PartialEq)]
pub struct ModeFeatures {
    /// The mode, from 0.
    pub mode: usize,
    pub dim: u32,
    /// The mode paired with this one to form fibers; `None` for a one-mode
    /// tensor.
    pub fiber_mode: Option<usize>,
    /// Non-empty indices of the mode.
    pub slices: u64,
    /// Distinct `(i_mode, i_fiber_mode)` pairs.
    pub fibers: u64,
    /// `slices / dim`: the share of the mode's indices that hold nonzeros.
    pub slice_ratio: f64,
    /// `fibers / slices`: mean fibers per slice.
    pub fibers_per_slice: f64,
    pub max_fibers_per_slice: u64,
    /// `nnz / slices`: mean nonzeros per slice.
    pub nnz_per_slice: f64,
    pub max_nnz_per_slice: u64,
    /// `nnz / fibers`: mean nonzeros per fiber (factor-row reuse in `fcoo`).
    pub nnz_per_fiber: f64,
    pub max_nnz_per_fiber: u64,
    /// `max_nnz_per_slice / nnz_per_slice`.
    pub slice_skew: f64,
    /// Coefficient of variation of the slice sizes.
    pub slice_cv: f64,
    /// Gini coefficient of the slice sizes, in `[0, 1)`.
    pub slice_gini: f64,
    /// `max_nnz_per_fiber / nnz_per_fiber`.
    pub fiber_skew: f64,
    /// Coefficient of variation of the fiber sizes.
    pub fiber_cv: f64,
    /// `max_nnz_per_slice / nnz`: the hottest slice's share of the tensor.
    pub hot_share: f64,
}

/// The features of a tensor: global ones and one [`ModeFeatures`] per mode.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorFeatures {
    pub dims: Vec<u32>,
    /// Stored nonzeros.
    pub nnz: u64,
    /// `nnz / prod(dims)`.
    pub density: f64,
    pub modes: Vec<ModeFeatures>,
}

/// `a / b`, or 0 when `b` is 0.
fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { 0.0 } else { a / b }
}

/// Coefficient of variation from a count, a sum and a sum of squares.
fn cv(count: f64, sum: f64, sum_sq: f64) -> f64 {
    let mean = ratio(sum, count);
    let var = (ratio(sum_sq, count) - mean * mean).max(0.0);
    ratio(var.sqrt(), mean)
}

/// Gini coefficient of non-negative sizes: with the sizes sorted
/// ascending, `sum_i (2i - n - 1) x_i / (n sum x)` for `i = 1..=n`.
///
/// Cost: one parallel sort of the sizes.
fn gini(mut sizes: Vec<u64>) -> f64 {
    let n = sizes.len();
    if n == 0 {
        return 0.0;
    }
    sizes.par_sort_unstable();
    let total: f64 = sizes.par_iter().map(|&x| x as f64).sum();
    let weighted: f64 = sizes
        .par_iter()
        .enumerate()
        .map(|(i, &x)| (2.0 * (i + 1) as f64 - n as f64 - 1.0) * x as f64)
        .sum();
    ratio(weighted, n as f64 * total)
}

/// The fiber mode of `mode`: the other mode with the smallest dimension,
/// the lower one on ties (the order `fcoo` sorts by).
pub fn fiber_mode(dims: &[u32], mode: usize) -> Option<usize> {
    (0..dims.len())
        .filter(|&w| w != mode)
        .min_by_key(|&w| (dims[w], w))
}

/// Slice and fiber statistics of a run of whole slices in the sorted
/// pair keys.
#[derive(Clone, Default)]
struct Scan {
    /// Size of every slice, in key order.
    slice_sizes: Vec<u64>,
    fibers: u64,
    max_fiber: u64,
    fiber_sq: f64,
    max_fibers_per_slice: u64,
}

impl Scan {
    /// Scans sorted keys (slice in the high 32 bits); `keys` starts at a
    /// slice boundary and ends at one.
    fn new(keys: &[u64]) -> Self {
        let mut s = Scan::default();
        let mut k = 0;
        while k < keys.len() {
            let (slice, slice_start) = (keys[k] >> 32, k);
            let mut fibers = 0u64;
            while k < keys.len() && keys[k] >> 32 == slice {
                let (key, start) = (keys[k], k);
                while k < keys.len() && keys[k] == key {
                    k += 1;
                }
                let len = (k - start) as u64;
                fibers += 1;
                s.max_fiber = s.max_fiber.max(len);
                s.fiber_sq += (len as f64) * (len as f64);
            }
            s.fibers += fibers;
            s.max_fibers_per_slice = s.max_fibers_per_slice.max(fibers);
            s.slice_sizes.push((k - slice_start) as u64);
        }
        s
    }

    /// `a` then `b` (slice sizes stay in key order).
    fn merge(mut a: Self, mut b: Self) -> Self {
        a.slice_sizes.append(&mut b.slice_sizes);
        Scan {
            slice_sizes: a.slice_sizes,
            fibers: a.fibers + b.fibers,
            max_fiber: a.max_fiber.max(b.max_fiber),
            fiber_sq: a.fiber_sq + b.fiber_sq,
            max_fibers_per_slice: a.max_fibers_per_slice.max(b.max_fibers_per_slice),
        }
    }
}

/// Slices and fibers of `mode`: one parallel sort of `(i_mode, i_fiber)`
/// keys (`i_fiber` 0 without a fiber mode), then a parallel scan over
/// chunks cut at slice boundaries. Slice sizes come from the same keys, so
/// a mode of a huge dimension costs no per-index counters.
fn scan_mode(t: &SparseTensor, mode: usize, fiber: Option<usize>) -> Scan {
    let rows = t.mode_indices(mode);
    let mut keys: Vec<u64> = match fiber {
        Some(f) => rows
            .par_iter()
            .zip(t.mode_indices(f).par_iter())
            .map(|(&i, &j)| (u64::from(i) << 32) | u64::from(j))
            .collect(),
        None => rows.par_iter().map(|&i| u64::from(i) << 32).collect(),
    };
    keys.par_sort_unstable();
    let nnz = keys.len();
    // Chunk starts moved forward to the next slice boundary (a binary
    // search: keys are sorted), so every chunk holds whole slices.
    let chunks = (nnz >> 16).clamp(1, 4 * rayon::current_num_threads().max(1));
    let mut bounds: Vec<usize> = (0..chunks)
        .map(|c| {
            let start = c * nnz / chunks;
            if start == 0 {
                return 0;
            }
            let slice = keys[start - 1] >> 32;
            keys.partition_point(|&k| k >> 32 <= slice)
        })
        .collect();
    bounds.push(nnz);
    bounds.dedup();
    bounds
        .par_windows(2)
        .map(|w| Scan::new(&keys[w[0]..w[1]]))
        .reduce(Scan::default, Scan::merge)
}

impl TensorFeatures {
    /// Names of the columns of [`TensorFeatures::mode_vector`], in order.
    pub const MODE_VECTOR_NAMES: &'static [&'static str] = &[
        "nmodes",
        "nnz",
        "density",
        "dim",
        "slices",
        "fibers",
        "slice_ratio",
        "fibers_per_slice",
        "max_fibers_per_slice",
        "nnz_per_slice",
        "max_nnz_per_slice",
        "nnz_per_fiber",
        "max_nnz_per_fiber",
        "slice_skew",
        "slice_cv",
        "slice_gini",
        "fiber_skew",
        "fiber_cv",
        "hot_share",
        "fiber_dim",
        "other_rows",
        "max_other_dim",
    ];

    /// Computes every feature of `t`.
    ///
    /// Cost: per mode, one parallel sort of `nnz` 64-bit keys (slices and
    /// fibers both come from it) and one of the non-empty slice sizes (the
    /// Gini coefficient); memory 8 bytes per nonzero plus 8 per non-empty
    /// slice, freed before the next mode. About 0.4 s per mode of 20
    /// million nonzeros on 2 cores, whatever the dimensions.
    pub fn compute(t: &SparseTensor) -> TensorFeatures {
        let nnz = t.nnz() as u64;
        let modes = (0..t.nmodes())
            .map(|mode| Self::compute_mode(t, mode))
            .collect();
        TensorFeatures {
            dims: t.dims().to_vec(),
            nnz,
            density: t.density(),
            modes,
        }
    }

    fn compute_mode(t: &SparseTensor, mode: usize) -> ModeFeatures {
        let nnz = t.nnz() as f64;
        let dim = t.dims()[mode];
        let fiber_mode = fiber_mode(t.dims(), mode);
        let scan = scan_mode(t, mode, fiber_mode);
        let sizes = scan.slice_sizes;
        let slices = sizes.len() as u64;
        let max_slice = sizes.par_iter().copied().max().unwrap_or(0);
        let slice_sq: f64 = sizes.par_iter().map(|&c| (c as f64) * (c as f64)).sum();
        let fibers = scan.fibers as f64;
        let nnz_per_slice = ratio(nnz, slices as f64);
        let nnz_per_fiber = ratio(nnz, fibers);
        ModeFeatures {
            mode,
            dim,
            fiber_mode,
            slices,
            fibers: scan.fibers,
            slice_ratio: ratio(slices as f64, f64::from(dim)),
            fibers_per_slice: ratio(fibers, slices as f64),
            max_fibers_per_slice: scan.max_fibers_per_slice,
            nnz_per_slice,
            max_nnz_per_slice: max_slice,
            nnz_per_fiber,
            max_nnz_per_fiber: scan.max_fiber,
            slice_skew: ratio(max_slice as f64, nnz_per_slice),
            slice_cv: cv(slices as f64, nnz, slice_sq),
            slice_gini: gini(sizes),
            fiber_skew: ratio(scan.max_fiber as f64, nnz_per_fiber),
            fiber_cv: cv(fibers, nnz, scan.fiber_sq),
            hot_share: ratio(max_slice as f64, nnz),
        }
    }

    pub fn nmodes(&self) -> usize {
        self.dims.len()
    }

    /// The feature vector of output mode `mode` for a model: the global
    /// features, the mode's own, and three of its context (the fiber mode's
    /// dimension, the factor rows of the other modes, and the largest other
    /// dimension), named by [`TensorFeatures::MODE_VECTOR_NAMES`]. Counts
    /// are given as they are (trees do not care about scale).
    ///
    /// Panics if `mode` is not below the number of modes.
    pub fn mode_vector(&self, mode: usize) -> Vec<f64> {
        let m = &self.modes[mode];
        let others = || {
            self.dims
                .iter()
                .enumerate()
                .filter(move |&(w, _)| w != mode)
                .map(|(_, &d)| f64::from(d))
        };
        vec![
            self.nmodes() as f64,
            self.nnz as f64,
            self.density,
            f64::from(m.dim),
            m.slices as f64,
            m.fibers as f64,
            m.slice_ratio,
            m.fibers_per_slice,
            m.max_fibers_per_slice as f64,
            m.nnz_per_slice,
            m.max_nnz_per_slice as f64,
            m.nnz_per_fiber,
            m.max_nnz_per_fiber as f64,
            m.slice_skew,
            m.slice_cv,
            m.slice_gini,
            m.fiber_skew,
            m.fiber_cv,
            m.hot_share,
            m.fiber_mode.map_or(0.0, |f| f64::from(self.dims[f])),
            others().sum(),
            others().fold(0.0, f64::max),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PowerLawSpec, power_law};

    /// 4 x 3 x 5; mode 1 (dim 3) is the fiber mode of modes 0 and 2, mode 0
    /// that of mode 1.
    fn small() -> SparseTensor {
        // Nonzeros (i, j, k):
        // (0,0,0) (0,0,1) (0,0,2) (0,2,4) (1,1,0) (3,1,2) (3,1,4) (3,2,3)
        SparseTensor::new(
            vec![4, 3, 5],
            vec![
                vec![0, 0, 0, 0, 1, 3, 3, 3],
                vec![0, 0, 0, 2, 1, 1, 1, 2],
                vec![0, 1, 2, 4, 0, 2, 4, 3],
            ],
            vec![1.0; 8],
        )
        .unwrap()
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-12, "{a} != {b}");
    }

    #[test]
    fn hand_computed_features_of_a_small_tensor() {
        let f = TensorFeatures::compute(&small());
        assert_eq!(f.nnz, 8);
        close(f.density, 8.0 / 60.0);

        // Mode 0: slices 0 (4 nonzeros), 1 (1), 3 (3); fiber mode 1.
        // Fibers (i, j): (0,0) x3, (0,2) x1, (1,1) x1, (3,1) x2, (3,2) x1.
        let m = &f.modes[0];
        assert_eq!(m.fiber_mode, Some(1));
        assert_eq!((m.slices, m.fibers), (3, 5));
        close(m.slice_ratio, 0.75);
        close(m.fibers_per_slice, 5.0 / 3.0);
        assert_eq!(m.max_fibers_per_slice, 2);
        close(m.nnz_per_slice, 8.0 / 3.0);
        assert_eq!(m.max_nnz_per_slice, 4);
        close(m.nnz_per_fiber, 1.6);
        assert_eq!(m.max_nnz_per_fiber, 3);
        close(m.slice_skew, 4.0 / (8.0 / 3.0));
        close(m.fiber_skew, 3.0 / 1.6);
        close(m.hot_share, 0.5);
        // Slice sizes 4, 1, 3: mean 8/3, E[x^2] = 26/3.
        let mean: f64 = 8.0 / 3.0;
        close(m.slice_cv, (26.0 / 3.0 - mean * mean).sqrt() / mean);
        // Sorted 1, 3, 4: (-2 * 1 + 0 * 3 + 2 * 4) / (3 * 8) = 6 / 24.
        close(m.slice_gini, 0.25);
        // Fiber sizes 3, 1, 1, 2, 1: E[x^2] = 16/5.
        close(m.fiber_cv, (16.0f64 / 5.0 - 1.6 * 1.6).sqrt() / 1.6);

        // Mode 1: slices j = 0 (3), 1 (3), 2 (2); fiber mode 0.
        // Fibers (j, i): (0,0) x3, (1,1), (1,3) x2, (2,0), (2,3).
        let m = &f.modes[1];
        assert_eq!(m.fiber_mode, Some(0));
        assert_eq!((m.slices, m.fibers, m.max_fibers_per_slice), (3, 5, 2));
        assert_eq!((m.max_nnz_per_slice, m.max_nnz_per_fiber), (3, 3));
        close(m.slice_ratio, 1.0);

        // Mode 2: slices k = 0 (2), 1 (1), 2 (2), 3 (1), 4 (2); fiber mode 1.
        // Fibers (k, j): (0,0), (0,1), (1,0), (2,0), (2,1), (3,2), (4,1),
        // (4,2).
        let m = &f.modes[2];
        assert_eq!(m.fiber_mode, Some(1));
        assert_eq!((m.slices, m.fibers, m.max_fibers_per_slice), (5, 8, 2));
        assert_eq!((m.max_nnz_per_slice, m.max_nnz_per_fiber), (2, 1));
        // Sorted 1, 1, 2, 2, 2: (-4 - 2 + 0 + 4 + 8) / (5 * 8) = 0.15.
        close(m.slice_gini, 0.15);
    }

    #[test]
    fn the_fiber_mode_is_the_smallest_other_mode_lower_on_ties() {
        assert_eq!(fiber_mode(&[5, 3, 3], 0), Some(1));
        assert_eq!(fiber_mode(&[5, 3, 3], 1), Some(2));
        assert_eq!(fiber_mode(&[2, 9, 2], 1), Some(0));
        assert_eq!(fiber_mode(&[7], 0), None);
    }

    #[test]
    fn uniform_slices_have_no_skew_and_one_mode_fibers_are_slices() {
        // Every index of a 1-mode tensor once: no skew at all.
        let t = SparseTensor::new(vec![6], vec![vec![5, 4, 3, 2, 1, 0]], vec![1.0; 6]).unwrap();
        let m = &TensorFeatures::compute(&t).modes[0];
        assert_eq!((m.slices, m.fibers, m.max_fibers_per_slice), (6, 6, 1));
        close(m.slice_cv, 0.0);
        close(m.slice_gini, 0.0);
        close(m.slice_skew, 1.0);
        close(m.fiber_skew, 1.0);
    }

    #[test]
    fn an_empty_tensor_has_finite_features() {
        let t = SparseTensor::new(vec![3, 4], vec![vec![], vec![]], vec![]).unwrap();
        let f = TensorFeatures::compute(&t);
        for mode in 0..2 {
            assert!(f.mode_vector(mode).iter().all(|x| x.is_finite()));
            assert_eq!(f.modes[mode].fibers, 0);
        }
    }

    /// The chunked scan agrees with a direct count on a tensor large enough
    /// to be cut into many chunks, with hot slices crossing nominal chunk
    /// starts.
    #[test]
    fn chunked_fiber_counts_match_a_direct_count() {
        let t = power_law(&PowerLawSpec::new(vec![40, 3000, 70], 300_000).with_seed(5)).unwrap();
        let f = TensorFeatures::compute(&t);
        for mode in 0..3 {
            let fm = fiber_mode(t.dims(), mode).unwrap();
            let mut pairs: Vec<(u32, u32)> = t
                .mode_indices(mode)
                .iter()
                .zip(t.mode_indices(fm))
                .map(|(&a, &b)| (a, b))
                .collect();
            pairs.sort_unstable();
            let mut runs: Vec<(u32, u64)> = Vec::new();
            let mut per_slice = std::collections::HashMap::<u32, u64>::new();
            for (k, p) in pairs.iter().enumerate() {
                if k > 0 && pairs[k - 1] == *p {
                    runs.last_mut().unwrap().1 += 1;
                } else {
                    runs.push((p.0, 1));
                    *per_slice.entry(p.0).or_default() += 1;
                }
            }
            let m = &f.modes[mode];
            assert_eq!(m.fibers, runs.len() as u64, "mode {mode}");
            assert_eq!(m.max_nnz_per_fiber, runs.iter().map(|r| r.1).max().unwrap());
            assert_eq!(m.max_fibers_per_slice, *per_slice.values().max().unwrap());
            let sq: f64 = runs.iter().map(|r| (r.1 * r.1) as f64).sum();
            close(m.fiber_cv, cv(runs.len() as f64, 300_000.0, sq));
        }
    }

    #[test]
    fn vectors_have_one_value_per_name() {
        let f = TensorFeatures::compute(&small());
        let v = f.mode_vector(2);
        assert_eq!(v.len(), TensorFeatures::MODE_VECTOR_NAMES.len());
        let col = |name: &str| {
            v[TensorFeatures::MODE_VECTOR_NAMES
                .iter()
                .position(|&n| n == name)
                .unwrap()]
        };
        assert_eq!(col("nmodes"), 3.0);
        assert_eq!(col("dim"), 5.0);
        assert_eq!(col("fiber_dim"), 3.0);
        assert_eq!(col("other_rows"), 7.0);
        assert_eq!(col("max_other_dim"), 4.0);
        assert_eq!(col("fibers"), 8.0);
    }
}
