//! Repeated coordinates summed in rounds, while the lines that hold them
//! are still being read, so that the memory a file with many repeated
//! lines needs follows its distinct coordinates rather than its lines.
//!
//! [`Summed`] holds the distinct coordinates of the lines added so far, in
//! coordinate order, each with the f64 sum of its values so far. Each
//! round adds lines that come after all those added before, in file order:
//! they are sorted by coordinate (ties in file order), and each run of
//! equal coordinates continues the sum of its coordinate one value at a
//! time ([`coalesce::add_in_order`]). That is the order and rounding of
//! summing every line at once (`coalesce.rs`), so the f32 each sum is
//! finally rounded to is the same, bit for bit, however the lines were cut
//! into rounds. A sum is checked against f32 only at the end: a sum on
//! its way may leave f32's range and come back.
//!
//! Cost of a round of `n` lines whose `g` distinct coordinates meet `d`
//! held ones, `f` of them new: the sort of the `n` lines, a linear merge
//! walk (`g + d`), and, when `f > 0`, one move of every held entry per
//! column, the columns in parallel. Memory: the held arrays
//! ([`Summed::entry_bytes`] per entry), the sort's
//! ([`coalesce::order_bytes`] per line) and the round's
//! ([`Summed::round_bytes`]), each checked before it is allocated.

use std::cmp::Ordering;

use rayon::prelude::*;

use crate::coalesce::{self, EMPTY_SUM};
use crate::error::{FormatError, Result};
use crate::memory;

/// Runs of equal coordinates placed per parallel work item of a merge.
const MERGE_CHUNK: usize = 1 << 14;

/// Distinct coordinates and the f64 sums of their values so far, in
/// coordinate order (mode 0 most significant).
pub(crate) struct Summed {
    indices: Vec<Vec<u32>>,
    sums: Vec<f64>,
}

impl Summed {
    pub(crate) fn new(nmodes: usize) -> Summed {
        Summed {
            indices: vec![Vec::new(); nmodes],
            sums: Vec::new(),
        }
    }

    /// Distinct coordinates held.
    pub(crate) fn len(&self) -> usize {
        self.sums.len()
    }

    /// Bytes of one held entry of a tensor of `nmodes` modes: an index per
    /// mode and an f64 sum.
    pub(crate) fn entry_bytes(nmodes: usize) -> u64 {
        4 * nmodes as u64 + 8
    }

    /// Bytes of the held arrays.
    pub(crate) fn bytes(&self) -> u64 {
        (self.len() as u64).saturating_mul(Self::entry_bytes(self.indices.len()))
    }

    /// Most bytes a round that adds `runs` distinct coordinates allocates
    /// besides the sort: where each run goes and its sum (16 bytes a run),
    /// and, were every run new, the list of new ones and the held arrays'
    /// growth.
    pub(crate) fn round_bytes(nmodes: usize, runs: usize) -> u64 {
        (runs as u64).saturating_mul(16 + 8 + Self::entry_bytes(nmodes))
    }

    /// Adds the lines of `indices` (one column per mode) with `values`
    /// (`None`: every value is 1), all of which come after the lines added
    /// before in file order. `order` is their positions in coordinate
    /// order with ties in file order, and `starts` its runs of equal
    /// coordinates ([`coalesce::coordinate_order`] and
    /// [`coalesce::run_starts`]). What the round allocates is checked
    /// against the memory available first; when it does not fit, nothing
    /// has changed and the error is [`FormatError::Memory`].
    pub(crate) fn add<I: AsRef<[u32]> + Sync>(
        &mut self,
        indices: &[I],
        values: Option<&[f32]>,
        order: &[usize],
        starts: &[usize],
    ) -> Result<()> {
        let runs = starts.len().saturating_sub(1);
        if runs == 0 {
            return Ok(());
        }
        let nmodes = self.indices.len();
        let held = self.len();
        check(runs as u64 * 16)?;
        let first = |run: usize| order[starts[run]];
        let held_vs =
            |p: usize, run: usize| coalesce::compare(&self.indices, p, indices, first(run));
        // at[run]: where the run's coordinate is held, or would go: the
        // first held entry not below it. Runs and held entries are both in
        // coordinate order, so each work item walks its stretch of the
        // held entries once, from a binary search for its first run.
        let mut at = vec![0usize; runs];
        at.par_chunks_mut(MERGE_CHUNK)
            .enumerate()
            .for_each(|(c, out)| {
                let base = c * MERGE_CHUNK;
                let (mut lo, mut hi) = (0, held);
                while lo < hi {
                    let mid = lo + (hi - lo) / 2;
                    if held_vs(mid, base) == Ordering::Less {
                        lo = mid + 1;
                    } else {
                        hi = mid;
                    }
                }
                for (i, slot) in out.iter_mut().enumerate() {
                    while lo < held && held_vs(lo, base + i) == Ordering::Less {
                        lo += 1;
                    }
                    *slot = lo;
                }
            });
        let found = |run: usize| at[run] < held && held_vs(at[run], run) == Ordering::Equal;
        let sums: Vec<f64> = (0..runs)
            .into_par_iter()
            .map(|run| {
                let so_far = if found(run) {
                    self.sums[at[run]]
                } else {
                    EMPTY_SUM
                };
                coalesce::add_in_order(so_far, &order[starts[run]..starts[run + 1]], values)
            })
            .collect();
        let new: Vec<usize> = (0..runs)
            .into_par_iter()
            .filter(|&run| !found(run))
            .collect();
        check((new.len() as u64).saturating_mul(Self::entry_bytes(nmodes)))?;
        for (run, &sum) in sums.iter().enumerate() {
            if found(run) {
                self.sums[at[run]] = sum;
            }
        }
        if new.is_empty() {
            return Ok(());
        }
        let place = |r: usize| at[new[r]];
        let (indices_out, sums_out) = (&mut self.indices, &mut self.sums);
        rayon::join(
            || {
                indices_out
                    .par_iter_mut()
                    .zip(indices)
                    .for_each(|(col, idx)| {
                        let idx = idx.as_ref();
                        insert(col, new.len(), place, |r| idx[first(new[r])]);
                    })
            },
            || insert(sums_out, new.len(), place, |r| sums[new[r]]),
        );
        Ok(())
    }

    /// The held coordinates and their sums rounded to f32, or the error
    /// for the first coordinate (in coordinate order) whose sum f32 cannot
    /// hold.
    pub(crate) fn finish(self) -> Result<(Vec<Vec<u32>>, Vec<f32>)> {
        if let Some(p) = self
            .sums
            .par_iter()
            .position_first(|&s| !(s as f32).is_finite())
        {
            return Err(coalesce::sum_beyond_f32(
                self.indices.iter().map(|idx| idx[p]),
                None,
                self.sums[p],
            ));
        }
        let values = self.sums.par_iter().map(|&s| s as f32).collect();
        Ok((self.indices, values))
    }
}

/// Refuses `bytes` more that the memory available cannot hold.
fn check(bytes: u64) -> Result<()> {
    match memory::shortfall(bytes) {
        Some(available) => Err(FormatError::Memory(format!(
            "summing repeated coordinates needs {} more, and {} are available (MemAvailable)",
            memory::bytes_text(bytes),
            memory::bytes_text(available)
        ))),
        None => Ok(()),
    }
}

/// Inserts `count` new entries into `col`, which is in coordinate order:
/// entry `r` (in coordinate order too) holds `value(r)` and goes before
/// the held entry `place(r)` (after every held entry when that is the
/// length). Moves each held entry once, from the back, in place.
fn insert<T: Copy + Default>(
    col: &mut Vec<T>,
    count: usize,
    place: impl Fn(usize) -> usize,
    value: impl Fn(usize) -> T,
) {
    let held = col.len();
    col.reserve_exact(count);
    col.resize(held + count, T::default());
    // Held entries from `place(r)` on are preceded by new entries 0..=r.
    let mut end = held;
    for r in (0..count).rev() {
        let at = place(r);
        col.copy_within(at..end, at + r + 1);
        col[at + r] = value(r);
        end = at;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coalesce::{coalesce, coordinate_order, run_starts};

    /// Sums `lines` (coordinates and values) in rounds cut at `cuts`.
    fn in_rounds(
        dims: &[u32],
        lines: &[(Vec<u32>, f32)],
        cuts: &[usize],
    ) -> Result<(Vec<Vec<u32>>, Vec<f32>)> {
        let nmodes = dims.len();
        let mut summed = Summed::new(nmodes);
        let mut bounds = vec![0];
        bounds.extend(cuts.iter().copied().filter(|&c| c < lines.len()));
        bounds.push(lines.len());
        for w in bounds.windows(2) {
            let part = &lines[w[0]..w[1]];
            let indices: Vec<Vec<u32>> = (0..nmodes)
                .map(|m| part.iter().map(|(c, _)| c[m]).collect())
                .collect();
            let values: Vec<f32> = part.iter().map(|(_, v)| *v).collect();
            let order = coordinate_order(&indices, dims);
            let starts = run_starts(&indices, &order);
            summed.add(&indices, Some(&values), &order, &starts)?;
        }
        summed.finish()
    }

    #[test]
    fn rounds_continue_each_sum_in_file_order() {
        // 1 + 2^-30 + 2^-30 ... : each tiny value would be lost against 1
        // in f32, but the sums are f64.
        let tiny = 2f32.powi(-30);
        let mut lines = vec![(vec![1, 1], 1.0f32)];
        for _ in 0..64 {
            lines.push((vec![1, 1], tiny));
        }
        lines.push((vec![0, 2], 5.0));
        lines.push((vec![1, 1], -1.0));
        // 1 + 2^60 - 2^60 is 0 in f64, in this order; 1 + (2^60 - 2^60)
        // would be 1.
        let big = 2f32.powi(60);
        lines.extend([(vec![0, 0], 1.0), (vec![0, 0], big), (vec![0, 0], -big)]);
        let dims = [2, 3];
        let whole = in_rounds(&dims, &lines, &[]).unwrap();
        for cuts in [vec![1], vec![2, 3, 40], vec![10, 60, 65, 66, 68]] {
            assert_eq!(in_rounds(&dims, &lines, &cuts).unwrap(), whole, "{cuts:?}");
        }
        assert_eq!(whole.0, vec![vec![0, 0, 1], vec![0, 2, 1]]);
        assert_eq!(whole.1, vec![0.0, 5.0, (64.0 * f64::from(tiny)) as f32]);
    }

    #[test]
    fn new_coordinates_are_placed_between_held_ones() {
        let lines: Vec<(Vec<u32>, f32)> = [5u32, 1, 9, 3, 7, 0, 9, 4, 8, 2, 6, 1]
            .iter()
            .enumerate()
            .map(|(k, &i)| (vec![i % 5, i], k as f32))
            .collect();
        let dims = [5, 10];
        let got = in_rounds(&dims, &lines, &[3, 5, 9]).unwrap();
        let indices: Vec<Vec<u32>> = (0..2)
            .map(|m| lines.iter().map(|(c, _)| c[m]).collect())
            .collect();
        let values = lines.iter().map(|(_, v)| *v).collect();
        let want = coalesce(&dims, indices, values, 0).unwrap();
        assert_eq!(got, (want.indices, want.values));
    }

    #[test]
    fn a_sum_beyond_f32_is_an_error_at_the_end_only() {
        // On its way the sum leaves f32's range and comes back.
        let lines = vec![
            (vec![3, 3], 3e38f32),
            (vec![1, 2], 1.0),
            (vec![3, 3], 3e38),
            (vec![3, 3], -3e38),
        ];
        let got = in_rounds(&[4, 4], &lines, &[1, 3]).unwrap();
        assert_eq!(got.1, vec![1.0, 3e38]);
        let err = in_rounds(&[4, 4], &lines[..3], &[2])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("the nonzeros at coordinate (4, 4) (1-based) sum to 6.000e38"),
            "{err}"
        );
    }
}
