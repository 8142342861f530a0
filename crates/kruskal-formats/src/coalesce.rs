//! Summing nonzeros that share a coordinate.
//!
//! A coordinate listed on several lines of a file is one entry whose value
//! is the sum, as in MATLAB's Tensor Toolbox and pyttb's `sptensor`. Every
//! `SparseTensor` is coalesced when it is built, so
//! that its norm, and every fit computed from it, are those of the tensor
//! the file describes.
//!
//! # Cost
//!
//! A tensor whose nonzeros are already in strictly increasing coordinate
//! order (FROSTT files and everything kruskal writes) is recognised in one
//! parallel pass and left as it is. Otherwise each coordinate is packed into
//! one integer key, its position in the tensor's cells in row-major order
//! (u64 when the number of cells fits, as for every FROSTT tensor but the
//! 5-mode ones; else u128; beyond that coordinates are compared mode by
//! mode), and the (key, position) pairs are sorted in parallel. Without repeated
//! coordinates the tensor keeps its order; with them, the result is in
//! coordinate order and each entry's value is the f64 sum of its lines, in
//! file order, rounded once to f32. Memory: 16 bytes per nonzero (32 with
//! u128 keys) while sorting, checked against `MemAvailable` first.
//!
//! The text reader sums a file with many repeated lines in rounds while it
//! reads (`summed.rs`), with the same order and rounding, so that the
//! tensor is the one this module would give for all the lines at once.

use std::ops::Range;

use rayon::prelude::*;

use crate::error::{FormatError, Result};
use crate::memory;

/// Nonzeros compared per parallel work item of the order check.
const CHECK_CHUNK: usize = 1 << 16;

/// The coalesced arrays and how many nonzeros were merged away.
pub(crate) struct Coalesced {
    pub(crate) indices: Vec<Vec<u32>>,
    pub(crate) values: Vec<f32>,
    pub(crate) merged: usize,
}

/// Sums the nonzeros of `indices`/`values` that share a coordinate.
/// `dims` bound the indices (the caller has checked them). The first
/// `increasing` nonzeros are known to be in strictly increasing coordinate
/// order (the text reader checks a file's order as it reads; 0 when
/// nothing is known), so only the rest is checked. A sum too large for f32
/// is an error naming the coordinate; a sort that `MemAvailable` cannot
/// hold is refused before it allocates.
pub(crate) fn coalesce(
    dims: &[u32],
    indices: Vec<Vec<u32>>,
    values: Vec<f32>,
    increasing: usize,
) -> Result<Coalesced> {
    let unchanged = |indices, values| {
        Ok(Coalesced {
            indices,
            values,
            merged: 0,
        })
    };
    if values.len() < 2 || increasing_at(&indices, increasing..values.len()) {
        return unchanged(indices, values);
    }
    let width = KeyWidth::of(dims);
    check_memory(width, indices.len(), values.len())?;
    let Some(order) = repeats_order(&indices, dims) else {
        return unchanged(indices, values);
    };
    merge(&indices, &values, &order)
}

/// Bytes per nonzero that [`coordinate_order`] and [`repeats_order`] allocate for the nonzeros
/// of a tensor whose cells number `width`: its sorted (key, position)
/// pairs and the positions collected from them, or the positions and the
/// merge sort's buffer where coordinates are compared mode by mode.
pub(crate) fn order_bytes(width: KeyWidth) -> u64 {
    match width {
        KeyWidth::U64 => 16 + 8,
        KeyWidth::U128 => 32 + 8,
        KeyWidth::Wider => 8 + 8,
    }
}

/// Refuses a search for repeats that the host's memory cannot hold: the
/// sort's (key, position) pairs and, with repeats, the summed arrays.
fn check_memory(width: KeyWidth, nmodes: usize, nnz: usize) -> Result<()> {
    let pair = match width {
        KeyWidth::U64 => 16,
        KeyWidth::U128 => 32,
        KeyWidth::Wider => 8,
    };
    let need = (nnz as u64)
        .saturating_mul(pair)
        .saturating_add(memory::coo_bytes(nmodes, nnz as u64));
    match memory::shortfall(need) {
        Some(available) => Err(FormatError::Memory(format!(
            "the {nnz} nonzeros are not in strictly increasing coordinate order, and searching \
             them for repeated coordinates needs {} (a sort of their coordinates and the summed \
             arrays), and {} are available (MemAvailable)",
            memory::bytes_text(need),
            memory::bytes_text(available)
        ))),
        None => Ok(()),
    }
}

/// Whether the coordinates are in strictly increasing lexicographic order
/// (mode 0 most significant), which rules out repeats.
pub(crate) fn strictly_increasing(indices: &[Vec<u32>]) -> bool {
    let nnz = indices.first().map_or(0, Vec::len);
    increasing_at(indices, 1..nnz)
}

/// Whether nonzero `k - 1` comes strictly before nonzero `k` in
/// coordinate order (mode 0 most significant) for every `k` of `pairs`
/// (`k = 0` is skipped: it has no predecessor). Ranges that tile
/// `0..nnz` together check the whole order, so processes holding parts
/// of a tensor can each check theirs. `pairs` must lie within the arrays.
///
/// Cost: one parallel pass over the range, stopping at the first pair out
/// of order.
pub(crate) fn increasing_at<I: AsRef<[u32]> + Sync>(indices: &[I], pairs: Range<usize>) -> bool {
    let less = |a: usize, b: usize| {
        for idx in indices {
            let idx = idx.as_ref();
            match idx[a].cmp(&idx[b]) {
                std::cmp::Ordering::Less => return true,
                std::cmp::Ordering::Greater => return false,
                std::cmp::Ordering::Equal => {}
            }
        }
        false
    };
    (pairs.start.max(1)..pairs.end)
        .into_par_iter()
        .with_min_len(CHECK_CHUNK)
        .all(|k| less(k - 1, k))
}

/// The narrowest integer that numbers every cell of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyWidth {
    U64,
    U128,
    Wider,
}

impl KeyWidth {
    pub(crate) fn of(dims: &[u32]) -> KeyWidth {
        let cells = dims
            .iter()
            .try_fold(1u128, |c, &d| c.checked_mul(u128::from(d)));
        match cells {
            Some(c) if c <= 1u128 << 64 => KeyWidth::U64,
            Some(_) => KeyWidth::U128,
            None => KeyWidth::Wider,
        }
    }
}

/// An integer wide enough to number a tensor's cells.
pub(crate) trait Key: Ord + Copy + Send + Sync + From<u32> {
    /// `self * dim + index`, which cannot overflow while the key is below
    /// the number of cells.
    fn times_plus(self, dim: u32, index: u32) -> Self;
    /// `(self / dim, self % dim)`.
    fn div_rem(self, dim: u32) -> (Self, u32);
    /// The key's bits folded into 64 (for hashing).
    fn fold64(self) -> u64;
}

impl Key for u64 {
    fn times_plus(self, dim: u32, index: u32) -> Self {
        self.wrapping_mul(u64::from(dim))
            .wrapping_add(u64::from(index))
    }
    fn div_rem(self, dim: u32) -> (Self, u32) {
        let d = u64::from(dim);
        // The remainder is below `dim`, a u32.
        (self / d, (self % d) as u32)
    }
    fn fold64(self) -> u64 {
        self
    }
}

impl Key for u128 {
    fn times_plus(self, dim: u32, index: u32) -> Self {
        self.wrapping_mul(u128::from(dim))
            .wrapping_add(u128::from(index))
    }
    fn div_rem(self, dim: u32) -> (Self, u32) {
        let d = u128::from(dim);
        (self / d, (self % d) as u32)
    }
    fn fold64(self) -> u64 {
        (self as u64) ^ ((self >> 64) as u64).rotate_left(29)
    }
}

/// The coordinate of cell number `key` (the inverse of [`key_of`]), written
/// into `out` (one index per mode).
pub(crate) fn coordinate_of<K: Key>(mut key: K, dims: &[u32], out: &mut [u32]) {
    for (slot, &d) in out.iter_mut().zip(dims).rev() {
        let (rest, index) = key.div_rem(d);
        *slot = index;
        key = rest;
    }
}

/// The row-major cell number of nonzero `k`: keys order as coordinates do.
pub(crate) fn key_of<K: Key, I: AsRef<[u32]>>(indices: &[I], dims: &[u32], k: usize) -> K {
    indices.iter().zip(dims).fold(K::from(0), |key, (idx, &d)| {
        key.times_plus(d, idx.as_ref()[k])
    })
}

/// The positions of the nonzeros in coordinate order, equal coordinates
/// in file order (a stable sort). `dims` bound the indices (any bounds
/// do: the order is the coordinates' lexicographic order, mode 0 most
/// significant).
///
/// Cost: a parallel sort of (cell number, position) pairs, or of
/// positions compared mode by mode past 2^128 cells; memory
/// [`order_bytes`] per nonzero.
pub(crate) fn coordinate_order<I: AsRef<[u32]> + Sync>(indices: &[I], dims: &[u32]) -> Vec<usize> {
    ordered(indices, dims, true).unwrap_or_default()
}

/// [`coordinate_order`] where some coordinate repeats, else `None`.
pub(crate) fn repeats_order<I: AsRef<[u32]> + Sync>(
    indices: &[I],
    dims: &[u32],
) -> Option<Vec<usize>> {
    ordered(indices, dims, false)
}

/// [`coordinate_order`], or `None` when no coordinate repeats and not
/// `always`.
fn ordered<I: AsRef<[u32]> + Sync>(
    indices: &[I],
    dims: &[u32],
    always: bool,
) -> Option<Vec<usize>> {
    match KeyWidth::of(dims) {
        KeyWidth::U64 => sorted_positions::<u64, I>(indices, dims, always),
        KeyWidth::U128 => sorted_positions::<u128, I>(indices, dims, always),
        KeyWidth::Wider => compared_positions(indices, always),
    }
}

/// [`ordered`] with keys of type `K`.
fn sorted_positions<K: Key, I: AsRef<[u32]> + Sync>(
    indices: &[I],
    dims: &[u32],
    always: bool,
) -> Option<Vec<usize>> {
    let nnz = indices.first().map_or(0, |idx| idx.as_ref().len());
    let mut pairs: Vec<(K, usize)> = (0..nnz)
        .into_par_iter()
        .map(|k| (key_of::<K, I>(indices, dims, k), k))
        .collect();
    // The position breaks ties, so the unstable sort gives a stable order.
    pairs.par_sort_unstable();
    let wanted = always || pairs.par_windows(2).any(|w| w[0].0 == w[1].0);
    wanted.then(|| pairs.into_par_iter().map(|(_, k)| k).collect())
}

/// [`ordered`] for coordinates too wide for a u128 key.
fn compared_positions<I: AsRef<[u32]> + Sync>(indices: &[I], always: bool) -> Option<Vec<usize>> {
    let nnz = indices.first().map_or(0, |idx| idx.as_ref().len());
    let mut order: Vec<usize> = (0..nnz).collect();
    order.par_sort_by(|&a, &b| compare(indices, a, indices, b).then(a.cmp(&b)));
    let wanted = always || order.par_windows(2).any(|w| same(indices, w[0], w[1]));
    wanted.then_some(order)
}

/// The coordinate of nonzero `a` of `left` against that of nonzero `b` of
/// `right`, mode 0 most significant.
pub(crate) fn compare<L: AsRef<[u32]>, R: AsRef<[u32]>>(
    left: &[L],
    a: usize,
    right: &[R],
    b: usize,
) -> std::cmp::Ordering {
    left.iter()
        .zip(right)
        .map(|(l, r)| l.as_ref()[a].cmp(&r.as_ref()[b]))
        .find(|o| o.is_ne())
        .unwrap_or(std::cmp::Ordering::Equal)
}

/// Whether nonzeros `a` and `b` share a coordinate.
fn same<I: AsRef<[u32]>>(indices: &[I], a: usize, b: usize) -> bool {
    indices.iter().all(|idx| idx.as_ref()[a] == idx.as_ref()[b])
}

/// Where each run of equal coordinates begins in `order` (positions in
/// coordinate order), followed by `order.len()`: run `g` is
/// `order[starts[g]..starts[g + 1]]`.
pub(crate) fn run_starts<I: AsRef<[u32]> + Sync>(indices: &[I], order: &[usize]) -> Vec<usize> {
    let mut starts: Vec<usize> = (0..order.len())
        .into_par_iter()
        .filter(|&p| p == 0 || !same(indices, order[p - 1], order[p]))
        .collect();
    starts.push(order.len());
    starts
}

/// `sum` plus the values of the nonzeros at `positions`, one at a time in
/// the order given, in f64 (`values` `None`: every value is 1). A new
/// entry starts from -0.0, which adding a value leaves exactly that value:
/// this is the order and rounding of `Iterator::sum`, so a coordinate's
/// lines summed in parts, each part continuing from the sum so far, give
/// the same bits as summed at once.
pub(crate) fn add_in_order(sum: f64, positions: &[usize], values: Option<&[f32]>) -> f64 {
    match values {
        Some(values) => positions.iter().fold(sum, |s, &k| s + f64::from(values[k])),
        None => positions.iter().fold(sum, |s, _| s + 1.0),
    }
}

/// The sum that a new entry starts from (see [`add_in_order`]).
pub(crate) const EMPTY_SUM: f64 = -0.0;

/// The error for `lines` lines (when known) at `coordinate` (0-based)
/// whose values sum to `sum`, beyond f32.
pub(crate) fn sum_beyond_f32(
    coordinate: impl Iterator<Item = u32>,
    lines: Option<usize>,
    sum: f64,
) -> FormatError {
    let coordinate: Vec<String> = coordinate.map(|i| (u64::from(i) + 1).to_string()).collect();
    let which = match lines {
        Some(n) => format!("the {n} nonzeros"),
        None => "the nonzeros".to_string(),
    };
    FormatError::Invalid(format!(
        "{which} at coordinate ({}) (1-based) sum to {sum:.3e}, which f32 cannot hold",
        coordinate.join(", "),
    ))
}

/// Builds the coalesced arrays from the nonzeros in coordinate order.
fn merge(indices: &[Vec<u32>], values: &[f32], order: &[usize]) -> Result<Coalesced> {
    // starts[g]: where entry g's run of equal coordinates begins in `order`.
    let starts = run_starts(indices, order);
    let entries = starts.len() - 1;
    let sums: Vec<f64> = starts
        .par_windows(2)
        .map(|w| add_in_order(EMPTY_SUM, &order[w[0]..w[1]], Some(values)))
        .collect();
    if let Some(g) = sums.iter().position(|&v| !(v as f32).is_finite()) {
        let first = order[starts[g]];
        return Err(sum_beyond_f32(
            indices.iter().map(|idx| idx[first]),
            Some(starts[g + 1] - starts[g]),
            sums[g],
        ));
    }
    let merged_values: Vec<f32> = sums.into_par_iter().map(|v| v as f32).collect();
    let merged_indices = indices
        .iter()
        .map(|idx| {
            starts[..entries]
                .par_iter()
                .map(|&p| idx[order[p]])
                .collect()
        })
        .collect();
    Ok(Coalesced {
        indices: merged_indices,
        values: merged_values,
        merged: order.len() - entries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(dims: &[u32], indices: Vec<Vec<u32>>, values: Vec<f32>) -> Coalesced {
        coalesce(dims, indices, values, 0).unwrap()
    }

    #[test]
    fn sorted_unique_input_is_left_alone() {
        let c = run(
            &[3, 3],
            vec![vec![0, 0, 2], vec![1, 2, 0]],
            vec![1.0, 2.0, 3.0],
        );
        assert_eq!(c.merged, 0);
        assert_eq!(c.indices, vec![vec![0, 0, 2], vec![1, 2, 0]]);
    }

    #[test]
    fn unsorted_unique_input_keeps_its_order() {
        let c = run(
            &[3, 3],
            vec![vec![2, 0, 0], vec![0, 2, 1]],
            vec![3.0, 2.0, 1.0],
        );
        assert_eq!(c.merged, 0);
        assert_eq!(c.indices, vec![vec![2, 0, 0], vec![0, 2, 1]]);
        assert_eq!(c.values, vec![3.0, 2.0, 1.0]);
    }

    #[test]
    fn repeats_are_summed_in_coordinate_order() {
        let c = run(
            &[3, 2, 2],
            vec![
                vec![2, 0, 2, 1, 2],
                vec![1, 0, 1, 1, 1],
                vec![0, 1, 0, 0, 0],
            ],
            vec![1.0, 2.0, 3.0, 4.0, 0.5],
        );
        assert_eq!(c.merged, 2);
        assert_eq!(c.indices, vec![vec![0, 1, 2], vec![0, 1, 1], vec![1, 0, 0]]);
        assert_eq!(c.values, vec![2.0, 4.0, 4.5]);
    }

    /// The three key widths give the same answer as a plain map.
    #[test]
    fn every_key_width_agrees_with_a_map() {
        use std::collections::BTreeMap;
        for dims in [
            vec![5u32, 7, 3],                      // u64
            vec![4_821_207, 1_774_269, 1_805_187], // amazon's 65 bits: u64
            vec![u32::MAX, u32::MAX, 9],           // u128
            vec![u32::MAX, u32::MAX, u32::MAX, 5], // u128
            vec![u32::MAX; 5],                     // compared
        ] {
            let nnz = 500;
            let mut state = 12345u64;
            let mut next = |bound: u32| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                // Few distinct values per mode, so coordinates repeat.
                ((state >> 33) % 3) as u32 * (bound / 3)
            };
            let indices: Vec<Vec<u32>> = {
                let mut cols = vec![Vec::new(); dims.len()];
                for _ in 0..nnz {
                    for (m, col) in cols.iter_mut().enumerate() {
                        col.push(next(dims[m]));
                    }
                }
                cols
            };
            let values: Vec<f32> = (0..nnz).map(|k| k as f32 * 0.25).collect();
            let mut want: BTreeMap<Vec<u32>, f64> = BTreeMap::new();
            for k in 0..nnz {
                let coord: Vec<u32> = indices.iter().map(|idx| idx[k]).collect();
                *want.entry(coord).or_default() += f64::from(values[k]);
            }
            let c = run(&dims, indices, values);
            assert_eq!(c.merged, nnz - want.len(), "dims {dims:?}");
            let got: Vec<(Vec<u32>, f64)> = (0..c.values.len())
                .map(|k| {
                    let coord = c.indices.iter().map(|idx| idx[k]).collect();
                    (coord, f64::from(c.values[k]))
                })
                .collect();
            let want: Vec<(Vec<u32>, f64)> = want
                .into_iter()
                .map(|(c, v)| (c, f64::from(v as f32)))
                .collect();
            assert_eq!(got, want, "dims {dims:?}");
        }
    }

    #[test]
    fn a_sum_beyond_f32_is_an_error_naming_the_coordinate() {
        let err = coalesce(
            &[4, 4],
            vec![vec![0, 3, 3], vec![1, 2, 2]],
            vec![1.0, 3e38, 3e38],
            0,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("the 2 nonzeros at coordinate (4, 3)") && err.contains("6.000e38"),
            "{err}"
        );
    }

    #[test]
    fn key_widths_follow_the_cell_count() {
        assert_eq!(KeyWidth::of(&[5, 7, 3]), KeyWidth::U64);
        assert_eq!(KeyWidth::of(&[u32::MAX, u32::MAX]), KeyWidth::U64);
        assert_eq!(
            KeyWidth::of(&[1 << 16, 1 << 16, 1 << 16, 1 << 16]),
            KeyWidth::U64
        );
        assert_eq!(
            KeyWidth::of(&[1 << 16, 1 << 16, 1 << 16, 1 << 16, 2]),
            KeyWidth::U128
        );
        assert_eq!(KeyWidth::of(&[u32::MAX; 4]), KeyWidth::U128);
        assert_eq!(KeyWidth::of(&[u32::MAX; 5]), KeyWidth::Wider);
        // The largest cell numbers 2^64 - 1 without wrapping.
        let dims = [u32::MAX, u32::MAX];
        let top = vec![vec![u32::MAX - 1], vec![u32::MAX - 1]];
        assert_eq!(
            key_of::<u64, _>(&top, &dims, 0),
            u64::MAX - ((1u64 << 33) - 1)
        );
        // And back.
        let dims = [4_821_207, 1_774_269, 1_805_187];
        let idx = vec![vec![4_821_206], vec![17], vec![1_805_186]];
        let mut out = [0u32; 3];
        coordinate_of(key_of::<u64, _>(&idx, &dims, 0), &dims, &mut out);
        assert_eq!(out, [4_821_206, 17, 1_805_186]);
        coordinate_of(key_of::<u128, _>(&idx, &dims, 0), &dims, &mut out);
        assert_eq!(out, [4_821_206, 17, 1_805_186]);
    }
}
