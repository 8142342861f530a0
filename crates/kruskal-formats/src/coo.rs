//! The COO sparse tensor: the canonical form every other format is built from.

use rayon::prelude::*;

use crate::attached::Attached;
use crate::coalesce;
use crate::error::{FormatError, Result};

/// The most modes a tensor may have. The engines keep one copy of the
/// tensor per mode, each with every mode's indices, so preparing grows
/// with the square of the mode count (2,000 modes took a minute on a few
/// nonzeros); FROSTT's tensors have 3 to 5.
pub const MAX_MODES: usize = 64;

/// A sparse tensor in coordinate form, stored as a structure of arrays.
/// No coordinate appears twice: building one sums repeated coordinates.
///
/// `indices[m][k]` is the 0-based mode-`m` index of nonzero `k` and
/// `values[k]` its value. Nonzero counts are `usize` (64-bit on every
/// supported target): FROSTT's largest tensors exceed 2^32 nonzeros.
/// Dimensions are `u32`, which holds every FROSTT tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct SparseTensor {
    /// First, so it is dropped before the arrays it may concern.
    attached: Attached,
    dims: Vec<u32>,
    indices: Vec<Vec<u32>>,
    values: Vec<f32>,
}

impl SparseTensor {
    /// Builds a tensor, checking that every mode has `values.len()` indices,
    /// that every index is below its dimension and every value is finite,
    /// and summing the nonzeros that share a coordinate into one (the f64
    /// sum of their values, rounded once): a tensor never holds a
    /// coordinate twice, so its norm is that of the tensor a file means.
    ///
    /// Cost: one parallel pass when the coordinates are in strictly
    /// increasing order or unique; a parallel sort otherwise.
    pub fn new(dims: Vec<u32>, indices: Vec<Vec<u32>>, values: Vec<f32>) -> Result<Self> {
        Self::new_with_merged(dims, indices, values).map(|(t, _)| t)
    }

    /// [`SparseTensor::new`], also returning how many nonzeros were merged
    /// into others (lines of a file minus the tensor's nonzeros).
    pub fn new_with_merged(
        dims: Vec<u32>,
        indices: Vec<Vec<u32>>,
        values: Vec<f32>,
    ) -> Result<(Self, usize)> {
        Self::new_timed(dims, indices, values, 0).map(|(t, merged, _)| (t, merged))
    }

    /// [`SparseTensor::new_with_merged`] of nonzeros whose first
    /// `increasing` the caller has found in strictly increasing coordinate
    /// order (so only the rest is checked), also returning the seconds
    /// spent on repeated coordinates (the order check, and the sort where
    /// needed), not counting the other checks.
    pub(crate) fn new_timed(
        dims: Vec<u32>,
        indices: Vec<Vec<u32>>,
        values: Vec<f32>,
        increasing: usize,
    ) -> Result<(Self, usize, f64)> {
        check(&dims, &indices, &values)?;
        let start = std::time::Instant::now();
        let c = coalesce::coalesce(&dims, indices, values, increasing)?;
        let seconds = start.elapsed().as_secs_f64();
        let t = SparseTensor {
            attached: Attached::default(),
            dims,
            indices: c.indices,
            values: c.values,
        };
        Ok((t, c.merged, seconds))
    }

    /// Builds a tensor whose coordinates the caller has verified to be
    /// distinct (a `.ktns` file whose coordinates were checked to be in
    /// strictly increasing order): the checks of
    /// [`SparseTensor::new`] without the search for repeats.
    pub(crate) fn new_distinct(
        dims: Vec<u32>,
        indices: Vec<Vec<u32>>,
        values: Vec<f32>,
    ) -> Result<Self> {
        check(&dims, &indices, &values)?;
        Ok(SparseTensor {
            attached: Attached::default(),
            dims,
            indices,
            values,
        })
    }

    /// Number of modes (the tensor's order).
    pub fn nmodes(&self) -> usize {
        self.dims.len()
    }

    /// Number of stored nonzeros.
    pub fn nnz(&self) -> usize {
        self.values.len()
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// The index arrays, one per mode.
    pub fn indices(&self) -> &[Vec<u32>] {
        &self.indices
    }

    /// The mode-`mode` index of every nonzero.
    pub fn mode_indices(&self, mode: usize) -> &[u32] {
        &self.indices[mode]
    }

    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// What another crate keeps with this tensor's arrays (the device
    /// crate's page-lock registration): see [`Attached`].
    pub fn attached(&self) -> &Attached {
        &self.attached
    }

    /// Gives the arrays back: `(dims, indices, values)`. What was attached
    /// is dropped first.
    pub fn into_parts(mut self) -> (Vec<u32>, Vec<Vec<u32>>, Vec<f32>) {
        self.attached.clear();
        (self.dims, self.indices, self.values)
    }

    /// Multiplies every value by `2^exponent`. A power of two changes
    /// only a value's exponent, so the result is exact wherever it is a
    /// normal f32, which includes a subnormal value scaled up; scaled down
    /// below the normal range a value loses low bits or becomes 0. A
    /// result that is not finite is an error, and then no value has
    /// changed.
    ///
    /// Cost: two parallel passes over the values.
    pub fn scale_values_pow2(&mut self, exponent: i32) -> Result<()> {
        let factor = 2f64.powi(exponent);
        let scaled = |v: f32| (f64::from(v) * factor) as f32;
        if let Some((k, &v)) = self
            .values
            .par_iter()
            .enumerate()
            .find_any(|&(_, &v)| !scaled(v).is_finite())
        {
            return Err(FormatError::Invalid(format!(
                "nonzero {k}: value {v} times 2^{exponent} is beyond f32"
            )));
        }
        self.values.par_iter_mut().for_each(|v| *v = scaled(*v));
        Ok(())
    }

    /// The largest absolute value, in f64 (0 for a tensor without
    /// nonzeros).
    ///
    /// Cost: one parallel pass over the values.
    pub fn max_abs(&self) -> f64 {
        self.values
            .par_iter()
            .map(|v| f64::from(v.abs()))
            .reduce(|| 0.0, f64::max)
    }

    /// Squared Frobenius norm, summed in f64 in a fixed order (chunk sums
    /// added in chunk order), so the result does not depend on threads.
    pub fn norm_sq(&self) -> f64 {
        let partials: Vec<f64> = self
            .values
            .par_chunks(1 << 16)
            .map(|c| c.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>())
            .collect();
        partials.iter().sum()
    }

    /// Number of cells, `prod(dims)`, as f64 (it overflows every integer type
    /// for the large FROSTT tensors).
    pub fn cells(&self) -> f64 {
        self.dims.iter().map(|&d| f64::from(d)).product()
    }

    /// Fraction of cells that hold a nonzero.
    pub fn density(&self) -> f64 {
        self.nnz() as f64 / self.cells()
    }

    /// The permutation that sorts the nonzeros lexicographically by the
    /// modes in `order` (first entry most significant). Stable.
    ///
    /// Cost: O(nnz log nnz) comparisons, parallel.
    pub fn sort_permutation(&self, order: &[usize]) -> Vec<usize> {
        let mut perm: Vec<usize> = (0..self.nnz()).collect();
        let cols: Vec<&[u32]> = order.iter().map(|&m| self.indices[m].as_slice()).collect();
        perm.par_sort_by(|&a, &b| {
            for col in &cols {
                match col[a].cmp(&col[b]) {
                    std::cmp::Ordering::Equal => continue,
                    other => return other,
                }
            }
            std::cmp::Ordering::Equal
        });
        perm
    }

    /// Reorders the nonzeros by `perm` (nonzero `k` of the result is nonzero
    /// `perm[k]` of the input). `perm` must be a permutation of `0..nnz`.
    pub fn permute(&mut self, perm: &[usize]) {
        assert_eq!(perm.len(), self.nnz(), "permutation length must equal nnz");
        self.attached.clear();
        for idx in &mut self.indices {
            *idx = perm.par_iter().map(|&p| idx[p]).collect();
        }
        self.values = perm.par_iter().map(|&p| self.values[p]).collect();
    }

    /// Sorts the nonzeros lexicographically by the modes in `order`, which
    /// must name distinct modes. Modes left out keep their relative order.
    pub fn sort_by_modes(&mut self, order: &[usize]) -> Result<()> {
        let mut seen = vec![false; self.nmodes()];
        for &m in order {
            if m >= self.nmodes() || std::mem::replace(&mut seen[m], true) {
                return Err(FormatError::Argument(format!(
                    "sort order {order:?} must name distinct modes below {}",
                    self.nmodes()
                )));
            }
        }
        let perm = self.sort_permutation(order);
        self.permute(&perm);
        Ok(())
    }

    /// Nonzeros per index of `mode` (the slice degrees), length `dims[mode]`.
    ///
    /// Cost: one parallel pass over the mode's indices with a counter array
    /// per thread for a short mode; for a long one (whose arrays would be
    /// far larger than the caches) indices are first put in buckets of row
    /// ranges, each bucket counted by one task. See `row_counts`.
    pub fn mode_counts(&self, mode: usize) -> Vec<u64> {
        crate::row_counts::count_rows(&self.indices[mode], self.dims[mode] as usize).unwrap_or_else(
            |k| panic!("nonzero {k}: a mode-{mode} index of a built tensor is past its dimension"),
        )
    }

    /// Per-mode statistics (slice degrees, empty slices, hottest index).
    pub fn stats(&self) -> TensorStats {
        // Without counters sized by a dimension where it dwarfs the
        // nonzeros (see `mode_stats`).
        let modes = (0..self.nmodes())
            .map(|mode| crate::mode_stats::mode_stats(self, mode))
            .collect();
        TensorStats {
            nnz: self.nnz() as u64,
            density: self.density(),
            norm: self.norm_sq().sqrt(),
            modes,
        }
    }
}

/// The checks of the dimensions alone (a mode at least, at most
/// [`MAX_MODES`], none of them 0): [`SparseTensor::new`]'s first, and a
/// `.ktns` header's.
pub(crate) fn check_dims(dims: &[u32]) -> Result<()> {
    if dims.is_empty() {
        return Err(FormatError::Invalid(
            "a tensor needs at least one mode".into(),
        ));
    }
    if dims.len() > MAX_MODES {
        return Err(FormatError::Invalid(format!(
            "{} modes: kruskal takes at most {MAX_MODES}",
            dims.len()
        )));
    }
    if let Some(m) = dims.iter().position(|&d| d == 0) {
        return Err(FormatError::Invalid(format!(
            "the dimension of mode {} is 0: every mode needs at least one index",
            m + 1
        )));
    }
    Ok(())
}

/// The checks of [`SparseTensor::new`]: matching lengths, indices below
/// their dimensions, finite values.
fn check(dims: &[u32], indices: &[Vec<u32>], values: &[f32]) -> Result<()> {
    check_dims(dims)?;
    if indices.len() != dims.len() {
        return Err(FormatError::Invalid(format!(
            "{} dimensions but {} index arrays",
            dims.len(),
            indices.len()
        )));
    }
    for (mode, (idx, &dim)) in indices.iter().zip(dims).enumerate() {
        if idx.len() != values.len() {
            return Err(FormatError::Invalid(format!(
                "mode {mode} has {} indices but there are {} values",
                idx.len(),
                values.len()
            )));
        }
        if let Some((k, &i)) = idx.par_iter().enumerate().find_any(|&(_, &i)| i >= dim) {
            return Err(FormatError::Invalid(format!(
                "nonzero {k}: mode-{mode} index {i} is not below the dimension {dim}"
            )));
        }
    }
    if let Some((k, v)) = values
        .par_iter()
        .enumerate()
        .find_any(|(_, v)| !v.is_finite())
    {
        return Err(FormatError::Invalid(format!(
            "nonzero {k}: value {v} is not finite"
        )));
    }
    Ok(())
}

/// Summary statistics of a tensor, as printed by `kruskal info`.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorStats {
    pub nnz: u64,
    pub density: f64,
    /// Frobenius norm.
    pub norm: f64,
    pub modes: Vec<ModeStats>,
}

/// Statistics of one mode: how the nonzeros spread over its indices.
#[derive(Clone, Debug, PartialEq)]
pub struct ModeStats {
    pub dim: u32,
    /// Indices that hold at least one nonzero.
    pub nonempty_slices: u64,
    pub empty_slices: u64,
    /// Fewest nonzeros of a non-empty slice.
    pub degree_min: u64,
    /// Mean nonzeros per non-empty slice.
    pub degree_mean: f64,
    /// Most nonzeros of one slice.
    pub degree_max: u64,
    /// The index that holds `degree_max` nonzeros.
    pub hottest_index: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> SparseTensor {
        SparseTensor::new(
            vec![3, 2, 2],
            vec![vec![2, 0, 2, 1], vec![1, 0, 1, 1], vec![0, 1, 1, 0]],
            vec![1.0, 2.0, 3.0, 4.0],
        )
        .unwrap()
    }

    #[test]
    fn mode_counts_are_the_slice_degrees() {
        // Hot indices (a third of the nonzeros on one) and a spread of
        // others over a long mode (see `row_counts` for each way of
        // counting).
        let nnz = 300_000u32;
        let dim = 5_000_000usize;
        let idx: Vec<u32> = (0..nnz)
            .map(|k| {
                if k % 3 == 0 {
                    5
                } else {
                    k.wrapping_mul(2_654_435_761) % dim as u32
                }
            })
            .collect();
        let mut want = vec![0u64; dim];
        for &x in &idx {
            want[x as usize] += 1;
        }
        let t = SparseTensor::new(
            vec![7, dim as u32, nnz],
            vec![
                (0..nnz).map(|k| k % 7).collect(),
                idx.clone(),
                (0..nnz).collect(),
            ],
            vec![1.0; nnz as usize],
        )
        .unwrap();
        assert_eq!(t.mode_counts(1), want);
        assert_eq!(
            t.mode_counts(0)[3],
            u64::from(nnz / 7 + u32::from(nnz % 7 > 3))
        );
    }

    #[test]
    fn new_rejects_out_of_range_index() {
        let err = SparseTensor::new(vec![2, 2], vec![vec![0, 2], vec![0, 1]], vec![1.0, 1.0]);
        assert!(err.unwrap_err().to_string().contains("mode-0 index 2"));
    }

    #[test]
    fn new_rejects_length_mismatch_and_nan() {
        assert!(SparseTensor::new(vec![2, 2], vec![vec![0], vec![0, 1]], vec![1.0, 1.0]).is_err());
        assert!(SparseTensor::new(vec![2], vec![vec![0]], vec![f32::NAN]).is_err());
        assert!(SparseTensor::new(vec![], vec![], vec![]).is_err());
    }

    #[test]
    fn new_sums_repeated_coordinates() {
        let (t, merged) = SparseTensor::new_with_merged(
            vec![3, 2, 2],
            vec![vec![2, 0, 2, 1], vec![1, 0, 1, 1], vec![0, 1, 0, 0]],
            vec![1.0, 2.0, 3.0, 4.0],
        )
        .unwrap();
        assert_eq!(merged, 1);
        assert_eq!(t.nnz(), 3);
        assert_eq!(t.mode_indices(0), &[0, 1, 2]);
        assert_eq!(t.values(), &[2.0, 4.0, 4.0]);
        // The norm is the summed tensor's: 2^2 + 4^2 + 4^2, not 1 + 4 + 9 + 16.
        assert_eq!(t.norm_sq(), 36.0);
    }

    #[test]
    fn values_scale_by_powers_of_two_exactly() {
        let mut t = SparseTensor::new(
            vec![2, 2],
            vec![vec![0, 1, 1], vec![0, 0, 1]],
            vec![3.4e38, -1e-40, 0.75],
        )
        .unwrap();
        assert_eq!(t.max_abs(), f64::from(3.4e38f32));
        // Beyond f32: refused, nothing changed.
        assert!(t.scale_values_pow2(1).is_err());
        assert_eq!(t.values()[0], 3.4e38);
        t.scale_values_pow2(-127).unwrap();
        assert_eq!(t.values()[0], 3.4e38 / 2f32.powi(127));
        assert_eq!(t.values()[2], 0.75 / 2f32.powi(127));
        // A subnormal scaled up is exact: back down, the same bits.
        let mut d =
            SparseTensor::new(vec![3], vec![vec![0, 1, 2]], vec![1e-40, -1e-45, 1e-39]).unwrap();
        assert!(d.values().iter().all(|v| v.is_subnormal()));
        let before: Vec<u32> = d.values().iter().map(|v| v.to_bits()).collect();
        d.scale_values_pow2(140).unwrap();
        assert!(d.values().iter().all(|v| v.is_normal()));
        d.scale_values_pow2(-140).unwrap();
        let after: Vec<u32> = d.values().iter().map(|v| v.to_bits()).collect();
        assert_eq!(after, before);
    }

    #[test]
    fn sort_by_second_mode_is_stable() {
        let mut t = small();
        t.sort_by_modes(&[1]).unwrap();
        assert_eq!(t.mode_indices(1), &[0, 1, 1, 1]);
        assert_eq!(t.values(), &[2.0, 1.0, 3.0, 4.0]);
        assert!(t.sort_by_modes(&[0, 0]).is_err());
        assert!(t.sort_by_modes(&[3]).is_err());
    }

    #[test]
    fn norm_is_summed_in_a_fixed_order() {
        // Chunk sums 1e16, 1, 1 (chunks of 65536 values): added left to
        // right each 1 is lost to rounding (ulp of 1e16 is 2); any other
        // grouping, such as 1e16 + (1 + 1), gives 1e16 + 2.
        let n = 3 << 16;
        let mut values = vec![0f32; n];
        values[0] = 1e8;
        values[1 << 16] = 1.0;
        values[2 << 16] = 1.0;
        let t = SparseTensor::new(vec![n as u32], vec![(0..n as u32).collect()], values).unwrap();
        for threads in [1, 2, 3, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            assert_eq!(pool.install(|| t.norm_sq()), 1e16, "{threads} threads");
        }
    }

    #[test]
    fn stats_count_slices() {
        let s = small().stats();
        assert_eq!(s.nnz, 4);
        assert_eq!(s.modes[0].degree_max, 2);
        assert_eq!(s.modes[0].hottest_index, 2);
        assert_eq!(s.modes[0].empty_slices, 0);
        assert_eq!(s.modes[2].degree_min, 2);
        assert!((s.density - 4.0 / 12.0).abs() < 1e-12);
        assert!((s.norm - 30f64.sqrt()).abs() < 1e-12);
    }
}
