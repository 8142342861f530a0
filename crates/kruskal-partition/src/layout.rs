//! One mode's layout of the nonzeros: partition by partition, each
//! partition sorted by the mode's index.
//!
//! The output rows of the mode (its distinct indices) are the units of work:
//! all nonzeros of a row go to one partition, so the partition's thread
//! block owns that output row and needs no global atomics (FLYCOO-GPU
//! Observation 2). Rows are assigned by greedy LPT on their nonzero counts.
//!
//! Real tensors have rows that no whole-row assignment can balance (the
//! hottest index of a nell-2-shaped tensor holds 15% of all nonzeros), so a
//! row with more nonzeros than a threshold (default `ceil(nnz / kappa)`) is
//! split into pieces of near-equal size, each a unit of its own for LPT.
//! Pieces that land in different partitions are listed as
//! [`SharedPiece`]s: the only places where two partitions write one output
//! row. Pieces of one row that land in the same partition are adjacent in
//! the layout and merged.
//!
//! Inside a partition nonzeros are ordered by the mode's index, then by the
//! other mode with the smallest dimension (it repeats most, so neighbouring
//! nonzeros reuse factor rows), then by their original position: the layout
//! is fully determined by the tensor and the options.

use std::sync::atomic::{AtomicU32, Ordering};

use kruskal_formats::flycoo::{SharedPiece, invert_permutation};
use kruskal_formats::{FormatError, SparseTensor};
use rayon::prelude::*;

use crate::lpt::{Balance, Policy};
use crate::{PartitionError, Result};

/// Options of a mode layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutOptions {
    /// Number of partitions (GPU thread blocks, or GPUs for a shard plan).
    pub kappa: usize,
    /// Rows with more nonzeros than this are split into pieces; `None`
    /// means `ceil(nnz / kappa)`, `Some(u64::MAX)` never splits.
    pub split_threshold: Option<u64>,
    pub policy: Policy,
}

impl LayoutOptions {
    /// `kappa` partitions, the default threshold, greedy LPT.
    pub fn new(kappa: usize) -> Self {
        LayoutOptions {
            kappa,
            split_threshold: None,
            policy: Policy::Lpt,
        }
    }

    /// The threshold used for a tensor of `nnz` nonzeros.
    pub fn threshold(&self, nnz: usize) -> u64 {
        self.split_threshold
            .unwrap_or_else(|| (nnz as u64).div_ceil(self.kappa.max(1) as u64))
            .max(1)
    }
}

/// The permutation that sorts nonzeros by `primary`, then `secondary`, then
/// position (so the order is fully determined): one parallel sort of packed
/// 128-bit keys (32 + 32 bits of indices, 64 of position), which scales with
/// cores where a counting sort would not.
///
/// Cost: O(nnz log nnz) / threads; 16 bytes per nonzero of scratch.
pub fn sort_by_two(primary: &[u32], secondary: &[u32]) -> Vec<usize> {
    let mut keys: Vec<u128> = primary
        .par_iter()
        .zip(secondary)
        .enumerate()
        .map(|(k, (&p, &s))| (u128::from(p) << 96) | (u128::from(s) << 64) | k as u128)
        .collect();
    keys.par_sort_unstable();
    keys.into_par_iter()
        .map(|key| key as u64 as usize)
        .collect()
}

/// The other mode a layout of `mode` sorts by second: the one with the
/// smallest dimension (the mode itself for a one-mode tensor).
pub fn secondary_mode(dims: &[u32], mode: usize) -> usize {
    (0..dims.len())
        .filter(|&w| w != mode)
        .min_by_key(|&w| (dims[w], w))
        .unwrap_or(mode)
}

/// The units of work of a mode with the given row nonzero counts: each
/// nonempty row whole, or, if heavier than `threshold`, its pieces (near
/// equal, the first ones one larger). The same units [`ModeLayout`] builds,
/// without sorting the tensor: enough to predict the balance.
pub fn unit_weights(counts: &[u64], threshold: u64) -> Vec<u64> {
    let threshold = threshold.max(1);
    counts
        .iter()
        .filter(|&&c| c > 0)
        .flat_map(|&c| {
            let pieces = c.div_ceil(threshold);
            (0..pieces).map(move |k| c / pieces + u64::from(k < c % pieces))
        })
        .collect()
}

/// A unit of work: a whole row or a piece of a split row, as a range of the
/// sorted order.
#[derive(Clone, Copy, Debug)]
struct Unit {
    sorted_start: u64,
    len: u64,
    row: u32,
    split: bool,
}

/// The layout of one mode. See the module documentation.
#[derive(Clone, Debug)]
pub struct ModeLayout {
    mode: usize,
    threshold: u64,
    /// Partition `p` holds layout positions `part_ptr[p]..part_ptr[p + 1]`.
    part_ptr: Vec<u64>,
    /// `positions[k]`: the layout position (remap id) of nonzero `k`.
    positions: Vec<u32>,
    /// Pieces of rows split across partitions, sorted by (row, start).
    shared: Vec<SharedPiece>,
    split_rows: usize,
    rows: usize,
}

impl ModeLayout {
    /// Builds the layout of `mode`.
    ///
    /// Errors: a mode that does not exist, `kappa == 0`, or more than
    /// `u32::MAX` nonzeros (positions are 32-bit, as the GPU's remap ids).
    /// Cost: one parallel sort of the nonzeros, LPT over the rows, and one
    /// parallel pass writing positions; 28 bytes per nonzero of scratch.
    pub fn new(tensor: &SparseTensor, mode: usize, opts: &LayoutOptions) -> Result<Self> {
        if mode >= tensor.nmodes() {
            return Err(PartitionError::Argument(format!(
                "mode {mode} of a {}-mode tensor",
                tensor.nmodes()
            )));
        }
        if opts.kappa == 0 || opts.kappa > u32::MAX as usize {
            return Err(PartitionError::Argument(format!(
                "kappa must be between 1 and {}, got {}",
                u32::MAX,
                opts.kappa
            )));
        }
        let nnz = tensor.nnz();
        check_positions_fit(nnz as u64)?;
        let kappa = opts.kappa;
        let threshold = opts.threshold(nnz);
        let rows_of = tensor.mode_indices(mode);
        let second = secondary_mode(tensor.dims(), mode);
        let perm = sort_by_two(rows_of, tensor.mode_indices(second));

        // Runs of equal rows in the sorted order.
        let run_starts: Vec<usize> = (0..nnz)
            .into_par_iter()
            .filter(|&s| s == 0 || rows_of[perm[s]] != rows_of[perm[s - 1]])
            .collect();
        let mut units = Vec::with_capacity(run_starts.len());
        let mut split_rows = 0;
        for (r, &start) in run_starts.iter().enumerate() {
            let end = run_starts.get(r + 1).copied().unwrap_or(nnz);
            let len = (end - start) as u64;
            let row = rows_of[perm[start]];
            if len <= threshold {
                units.push(Unit {
                    sorted_start: start as u64,
                    len,
                    row,
                    split: false,
                });
                continue;
            }
            split_rows += 1;
            let pieces = len.div_ceil(threshold);
            let (base, extra) = (len / pieces, len % pieces);
            let mut at = start as u64;
            for k in 0..pieces {
                let piece_len = base + u64::from(k < extra);
                units.push(Unit {
                    sorted_start: at,
                    len: piece_len,
                    row,
                    split: true,
                });
                at += piece_len;
            }
        }

        let weights: Vec<u64> = units.iter().map(|u| u.len).collect();
        let assignment = opts.policy.assign(&weights, kappa);
        let mut part_ptr = Vec::with_capacity(kappa + 1);
        part_ptr.push(0u64);
        for &load in &assignment.loads {
            part_ptr.push(part_ptr.last().expect("starts with 0") + load);
        }

        // Units keep their sorted order inside a partition, so a partition
        // is sorted by (row, secondary index, position).
        let mut cursor = part_ptr[..kappa].to_vec();
        let dest: Vec<u64> = units
            .iter()
            .zip(&assignment.part_of)
            .map(|(u, &p)| {
                let d = cursor[p as usize];
                cursor[p as usize] += u.len;
                d
            })
            .collect();

        let positions: Vec<AtomicU32> = (0..nnz)
            .into_par_iter()
            .map(|_| AtomicU32::new(0))
            .collect();
        const BLOCK: usize = 1 << 16;
        (0..nnz.div_ceil(BLOCK)).into_par_iter().for_each(|b| {
            let (lo, hi) = (b * BLOCK, ((b + 1) * BLOCK).min(nnz));
            let mut u = units.partition_point(|unit| unit.sorted_start <= lo as u64) - 1;
            for (s, &k) in perm.iter().enumerate().take(hi).skip(lo) {
                let s = s as u64;
                while s >= units[u].sorted_start + units[u].len {
                    u += 1;
                }
                let pos = dest[u] + (s - units[u].sorted_start);
                // Every sorted position maps to one nonzero and one layout
                // position, so each slot is written exactly once.
                positions[k].store(pos as u32, Ordering::Relaxed);
            }
        });
        let positions: Vec<u32> = positions
            .into_par_iter()
            .map(AtomicU32::into_inner)
            .collect();

        let shared = shared_pieces(&units, &assignment.part_of, &dest);
        Ok(ModeLayout {
            mode,
            threshold,
            part_ptr,
            positions,
            shared,
            split_rows,
            rows: run_starts.len(),
        })
    }

    pub fn mode(&self) -> usize {
        self.mode
    }

    pub fn kappa(&self) -> usize {
        self.part_ptr.len() - 1
    }

    pub fn nnz(&self) -> usize {
        self.positions.len()
    }

    /// The split threshold used.
    pub fn threshold(&self) -> u64 {
        self.threshold
    }

    /// Partition `p` holds positions `part_ptr[p]..part_ptr[p + 1]`.
    pub fn part_ptr(&self) -> &[u64] {
        &self.part_ptr
    }

    /// `positions()[k]`: the layout position (remap id) of nonzero `k` of
    /// the tensor the layout was built from.
    pub fn positions(&self) -> &[u32] {
        &self.positions
    }

    pub fn into_positions(self) -> Vec<u32> {
        self.positions
    }

    /// Pieces of rows split across partitions, sorted by (row, start).
    pub fn shared(&self) -> &[SharedPiece] {
        &self.shared
    }

    /// Rows heavier than the threshold (split into pieces, whether or not
    /// the pieces ended up in different partitions).
    pub fn split_rows(&self) -> usize {
        self.split_rows
    }

    /// Distinct output rows (nonempty slices) of the mode.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Nonzeros per partition.
    pub fn loads(&self) -> Vec<u64> {
        self.part_ptr.windows(2).map(|w| w[1] - w[0]).collect()
    }

    pub fn balance(&self) -> Balance {
        Balance::of(&self.loads())
    }

    /// The inverse of [`ModeLayout::positions`]: the nonzero at each layout
    /// position.
    pub fn order(&self) -> Vec<u32> {
        invert_permutation(&self.positions)
    }
}

/// Errors if `nnz` nonzeros cannot be numbered by 32-bit positions.
pub fn check_positions_fit(nnz: u64) -> Result<()> {
    if nnz > u64::from(u32::MAX) {
        return Err(FormatError::Capacity {
            format: "a partitioned layout",
            message: format!(
                "{nnz} nonzeros exceed the {} that 32-bit remap ids can number",
                u32::MAX
            ),
        }
        .into());
    }
    Ok(())
}

/// The pieces of split rows that ended up in more than one partition, with
/// pieces of one row in one partition merged (they are adjacent).
fn shared_pieces(units: &[Unit], part_of: &[u32], dest: &[u64]) -> Vec<SharedPiece> {
    let mut shared = Vec::new();
    let mut u = 0;
    while u < units.len() {
        if !units[u].split {
            u += 1;
            continue;
        }
        let row = units[u].row;
        let end = u + units[u..]
            .iter()
            .take_while(|x| x.split && x.row == row)
            .count();
        let mut pieces: Vec<SharedPiece> = Vec::new();
        for k in u..end {
            let part = part_of[k];
            match pieces.iter_mut().find(|p| p.part == part) {
                Some(p) => p.len += units[k].len,
                None => pieces.push(SharedPiece {
                    row,
                    part,
                    start: dest[k],
                    len: units[k].len,
                }),
            }
        }
        if pieces.len() > 1 {
            pieces.sort_by_key(|p| p.start);
            shared.extend(pieces);
        }
        u = end;
    }
    shared
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lpt::optimal_makespan;
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    /// Checks every invariant of a layout against its tensor.
    fn check_layout(t: &SparseTensor, l: &ModeLayout) {
        let nnz = t.nnz();
        let kappa = l.kappa();
        assert_eq!(l.part_ptr()[kappa], nnz as u64);
        // Positions are a permutation.
        let order = l.order();
        let mut seen = vec![false; nnz];
        for &p in l.positions() {
            assert!(
                !std::mem::replace(&mut seen[p as usize], true),
                "position {p} twice"
            );
        }
        let rows = t.mode_indices(l.mode());
        let part_of_pos = |q: u64| l.part_ptr().partition_point(|&x| x <= q) - 1;
        // Inside a partition, sorted by row; rows owned by one partition
        // unless listed as shared.
        let mut owner = vec![u32::MAX; t.dims()[l.mode()] as usize];
        for p in 0..kappa {
            let (lo, hi) = (l.part_ptr()[p] as usize, l.part_ptr()[p + 1] as usize);
            for q in lo..hi {
                let r = rows[order[q] as usize];
                if q > lo {
                    assert!(rows[order[q - 1] as usize] <= r, "partition {p} unsorted");
                }
                if owner[r as usize] == u32::MAX {
                    owner[r as usize] = p as u32;
                } else if owner[r as usize] != p as u32 {
                    let listed = |part: usize| {
                        l.shared()
                            .iter()
                            .any(|s| s.row == r && s.part as usize == part)
                    };
                    assert!(
                        listed(p) && listed(owner[r as usize] as usize),
                        "row {r} in two partitions"
                    );
                }
            }
        }
        // Shared pieces cover exactly the positions of their row in their
        // partition.
        for s in l.shared() {
            let range = s.start..s.start + s.len;
            assert_eq!(part_of_pos(s.start), s.part as usize);
            assert_eq!(part_of_pos(s.start + s.len - 1), s.part as usize);
            for q in range.clone() {
                assert_eq!(rows[order[q as usize] as usize], s.row);
            }
            let (lo, hi) = (
                l.part_ptr()[s.part as usize],
                l.part_ptr()[s.part as usize + 1],
            );
            let count = (lo..hi)
                .filter(|&q| rows[order[q as usize] as usize] == s.row)
                .count() as u64;
            assert_eq!(count, s.len, "row {} has nonzeros outside its piece", s.row);
        }
    }

    fn tensor(dims: Vec<u32>, nnz: usize, exponent: f64, seed: u64) -> SparseTensor {
        let nmodes = dims.len();
        let mut spec = PowerLawSpec::new(dims, nnz).with_draws().with_seed(seed);
        spec.exponents = vec![exponent; nmodes];
        power_law(&spec).unwrap()
    }

    #[test]
    fn rejects_bad_options() {
        let t = tensor(vec![5, 4, 3], 50, 0.5, 1);
        assert!(ModeLayout::new(&t, 3, &LayoutOptions::new(2)).is_err());
        assert!(ModeLayout::new(&t, 0, &LayoutOptions::new(0)).is_err());
        let err = check_positions_fit(5_000_000_000).unwrap_err();
        assert!(err.to_string().contains("cannot hold"), "{err}");
        assert!(check_positions_fit(u64::from(u32::MAX)).is_ok());
    }

    #[test]
    fn heavy_rows_are_split_and_shared() {
        let t = tensor(vec![300, 200, 100], 40_000, 1.5, 3);
        let l = ModeLayout::new(&t, 0, &LayoutOptions::new(16)).unwrap();
        assert!(l.split_rows() > 0);
        assert!(!l.shared().is_empty());
        check_layout(&t, &l);
        // Without splitting, the hottest row alone sets the makespan.
        let whole = LayoutOptions {
            split_threshold: Some(u64::MAX),
            ..LayoutOptions::new(16)
        };
        let lw = ModeLayout::new(&t, 0, &whole).unwrap();
        assert_eq!(lw.split_rows(), 0);
        assert!(lw.shared().is_empty());
        check_layout(&t, &lw);
        let hottest = *t.mode_counts(0).iter().max().unwrap();
        assert_eq!(lw.balance().max, hottest);
        assert!(l.balance().max < hottest / 2);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn layouts_keep_their_invariants(
            nmodes in 2usize..=6,
            seed in any::<u64>(),
            nnz in 1usize..2_000,
            kappa in 1usize..40,
            exponent in 0.0f64..1.8,
            threshold in prop_oneof![Just(None), (1u64..300).prop_map(Some)],
            cyclic in any::<bool>(),
        ) {
            let dims: Vec<u32> = (0..nmodes).map(|m| 1 + ((seed >> (m * 8)) % 50) as u32).collect();
            let t = tensor(dims, nnz, exponent, seed);
            let policy = if cyclic { Policy::Cyclic } else { Policy::Lpt };
            let opts = LayoutOptions { kappa, split_threshold: threshold, policy };
            for mode in 0..nmodes {
                let l = ModeLayout::new(&t, mode, &opts).unwrap();
                check_layout(&t, &l);
                // Graham's bound for list scheduling: no partition exceeds
                // the mean by more than one unit (a unit is at most a row
                // of `threshold` nonzeros or an unsplit row).
                let biggest_unit = t.mode_counts(mode).into_iter().map(|c| c.min(l.threshold())).max().unwrap();
                let b = l.balance();
                prop_assert!(b.max as f64 <= b.mean + biggest_unit as f64 + 1e-9);
            }
        }

        /// On small cases, the LPT layout's largest partition is within 4/3
        /// of the optimal placement of its units plus one piece.
        #[test]
        fn lpt_layout_is_near_optimal(
            seed in any::<u64>(),
            nnz in 1usize..120,
            kappa in 1usize..4,
            exponent in 0.5f64..2.0,
        ) {
            let t = tensor(vec![9, 7, 5], nnz, exponent, seed);
            let l = ModeLayout::new(&t, 0, &LayoutOptions::new(kappa)).unwrap();
            let units = unit_weights(&t.mode_counts(0), l.threshold());
            // The prediction from counts alone matches the built layout.
            prop_assert_eq!(crate::lpt::lpt(&units, kappa).balance().max, l.balance().max);
            prop_assume!(units.len() <= 10);
            let opt = optimal_makespan(&units, kappa);
            let piece = units.iter().copied().max().unwrap();
            prop_assert!(3 * l.balance().max <= 4 * opt, "max {} opt {}", l.balance().max, opt);
            prop_assert!(l.balance().max <= (t.nnz() as u64).div_ceil(kappa as u64) * 4 / 3 + piece);
        }
    }
}
