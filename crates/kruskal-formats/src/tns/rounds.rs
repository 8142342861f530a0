//! Summing repeated coordinates while a file is read, so that a file of
//! many repeated lines needs memory for its distinct coordinates rather
//! than for its lines (a few MB of gzip can hold 200 million copies of one
//! line: one nonzero).
//!
//! The parsed lines are copied into columns in file order (`batch.rs`);
//! what becomes of them depends on what the lines so far have shown:
//!
//! - **In coordinate order** (FROSTT's files, everything kruskal writes):
//!   each batch is checked, as it is appended, to continue the strictly
//!   increasing order (the one order check a file gets anyway), and no
//!   coordinate can repeat.
//! - **Out of order**: the lines stay in file order (a file without repeats
//!   keeps its order) until the columns reach a round's size
//!   ([`ROUND_MIN_LINES`] lines, then twice the lines of the last round).
//!   A round estimates the distinct coordinates from a sample: the lines
//!   whose coordinate hashes into 1/64 of the hash range (every line of a
//!   coordinate is in the sample or none is, so the sample's distinct
//!   coordinates, times 64, estimate the lines'). Where that is at most a
//!   quarter of the lines, it sorts them, and where at most half of them
//!   are distinct, they are summed (`summed.rs`) and the columns emptied.
//!   Otherwise they stay as they are; the end sorts them as it would have.
//! - **Summed**: each time the lines read since reach the larger of
//!   [`ROUND_MIN_LINES`] and the distinct coordinates held, they are
//!   sorted and added into the sums.
//!
//! Whatever the rounds, the tensor is the one summing every line at the end
//! gives, bit for bit (`summed.rs` says why), and the lines summed are
//! counted the same. The index-like warning reads a tally of the values
//! kept across rounds (`columns.rs`). Memory, once summed: the sums
//! (`4 * modes + 8` bytes per distinct coordinate), the lines read since
//! (at most the larger of [`ROUND_MIN_LINES`] and the distinct
//! coordinates) and their sort, each checked against the memory available
//! before it is allocated.

use std::path::Path;
use std::time::Instant;

use rayon::prelude::*;

use super::columns::{Columns, ValueTally, index_like_warning};
use crate::coalesce::{self, KeyWidth};
use crate::coo::SparseTensor;
use crate::error::{FormatError, Result};
use crate::io::{ReadOptions, ReadReport};
use crate::memory;
use crate::summed::Summed;

/// The fewest lines out of coordinate order before a round looks for
/// repeats, and the fewest read between two rounds once summing.
pub(super) const ROUND_MIN_LINES: usize = 1 << 22;

/// The sample of a round's estimate: lines whose coordinate's hash has
/// its top `SAMPLE_BITS` bits zero.
const SAMPLE_BITS: u32 = 6;

/// What the reader holds besides the columns of lines not yet summed.
pub(super) struct Held {
    /// [`ROUND_MIN_LINES`], or fewer in tests.
    round_min: usize,
    /// Every line so far is in strictly increasing coordinate order.
    increasing: bool,
    /// Lines known to be in strictly increasing order, from the first.
    increasing_lines: usize,
    /// A round found too few repeats to sum them: the columns may be sized
    /// for the whole file.
    few_repeats: bool,
    /// The sums, once a round found enough repeats.
    summed: Option<Summed>,
    /// Lines added into `summed`.
    summed_lines: u64,
    /// The values of the lines added into `summed`, counted for the
    /// index-like rule while it may apply.
    tally: Option<ValueTally>,
    /// The column length at which the next round runs.
    next_round: usize,
    /// Seconds spent making sure no coordinate repeats.
    seconds: f64,
}

impl Default for Held {
    fn default() -> Held {
        Held::new(ROUND_MIN_LINES)
    }
}

impl Held {
    /// Rounds of at least `round_min` lines (see [`ROUND_MIN_LINES`]).
    pub(super) fn new(round_min: usize) -> Held {
        let round_min = round_min.max(1);
        Held {
            round_min,
            increasing: true,
            increasing_lines: 0,
            few_repeats: false,
            summed: None,
            summed_lines: 0,
            tally: None,
            next_round: round_min,
            seconds: 0.0,
        }
    }

    /// Whether every line so far is in strictly increasing coordinate
    /// order (then nothing needs checking but the next lines' order).
    pub(super) fn increasing(&self) -> bool {
        self.increasing
    }

    /// Records whether the lines appended after the first `lines`, now
    /// `lines + added`, continue the strictly increasing order, which
    /// took `seconds` to check.
    pub(super) fn order_checked(&mut self, added: usize, in_order: bool, seconds: f64) {
        self.seconds += seconds;
        if self.increasing && in_order {
            self.increasing_lines += added;
        } else {
            self.increasing = false;
        }
    }

    /// Bytes of the sums held.
    pub(super) fn bytes(&self) -> u64 {
        self.summed.as_ref().map_or(0, Summed::bytes)
    }

    /// Distinct coordinates summed so far (0 before any round summed).
    pub(super) fn distinct(&self) -> Option<usize> {
        self.summed.as_ref().map(Summed::len)
    }

    /// How many lines the columns should have room for, given `estimate`,
    /// the lines of the whole file at the density read so far: all of them
    /// while the lines are in order or known to repeat little, else no more
    /// than the next round needs.
    pub(super) fn room_for(&self, estimate: usize) -> usize {
        if self.summed.is_some() {
            self.next_round
        } else if self.increasing || self.few_repeats {
            estimate
        } else {
            estimate.min(self.next_round)
        }
    }

    /// Runs a round when the columns' first `*len` lines call for one; a
    /// round that sums them sets `*len` to 0.
    pub(super) fn after_append(
        &mut self,
        path: &Path,
        cols: &mut Columns,
        len: &mut usize,
        opts: &ReadOptions,
    ) -> Result<()> {
        if self.increasing || *len < self.next_round {
            return Ok(());
        }
        let start = Instant::now();
        let done = if self.summed.is_some() {
            self.add_lines(path, cols, *len, opts).map(|()| true)
        } else {
            self.maybe_sum(cols, *len, opts)
        };
        self.seconds += start.elapsed().as_secs_f64();
        if done? {
            *len = 0;
        }
        let held = self.distinct().unwrap_or(0);
        self.next_round = self.round_min.max(if self.summed.is_some() {
            held
        } else {
            2 * *len
        });
        Ok(())
    }

    /// The round of lines out of order, not yet summed: sums them when a
    /// sample, then their sort, find many repeats. Returns whether it did.
    /// A round the memory available cannot hold is not run (the end sorts
    /// the lines, or refuses to, as it would have).
    fn maybe_sum(&mut self, cols: &Columns, len: usize, opts: &ReadOptions) -> Result<bool> {
        let indices: Vec<&[u32]> = cols.indices.iter().map(|c| &c[..len]).collect();
        if estimate_distinct(&indices) > len / 4 {
            self.few_repeats = true;
            return Ok(false);
        }
        let dims = current_dims(cols, opts);
        let sort = (len as u64).saturating_mul(coalesce::order_bytes(KeyWidth::of(&dims)) + 8);
        if memory::shortfall(sort).is_some() {
            return Ok(false);
        }
        let Some(order) = coalesce::repeats_order(&indices, &dims) else {
            self.few_repeats = true;
            return Ok(false);
        };
        let starts = coalesce::run_starts(&indices, &order);
        let runs = starts.len() - 1;
        if runs > len / 2 {
            self.few_repeats = true;
            return Ok(false);
        }
        if memory::shortfall(Summed::round_bytes(indices.len(), runs)).is_some() {
            return Ok(false);
        }
        let mut summed = Summed::new(indices.len());
        let values = cols.has_values.then(|| &cols.values[..len]);
        summed.add(&indices, values, &order, &starts)?;
        if let Some(values) = values.filter(|_| tally_wanted(cols, opts)) {
            let mut tally = ValueTally::default();
            tally.add(values);
            self.tally = Some(tally);
        }
        self.summed = Some(summed);
        self.summed_lines = len as u64;
        Ok(true)
    }

    /// Adds the columns' first `len` lines into the sums.
    fn add_lines(
        &mut self,
        path: &Path,
        cols: &Columns,
        len: usize,
        opts: &ReadOptions,
    ) -> Result<()> {
        let Some(summed) = self.summed.as_mut() else {
            return Ok(());
        };
        let (distinct, before) = (summed.len(), self.summed_lines);
        let in_context = |e: FormatError| match e {
            FormatError::Memory(m) => FormatError::Memory(format!(
                "{}: {m} (adding {len} lines to the {distinct} distinct coordinates of the \
                 {before} lines before them)",
                path.display(),
            )),
            e => e,
        };
        let indices: Vec<&[u32]> = cols.indices.iter().map(|c| &c[..len]).collect();
        let dims = current_dims(cols, opts);
        let sort = (len as u64).saturating_mul(coalesce::order_bytes(KeyWidth::of(&dims)) + 8);
        if let Some(available) = memory::shortfall(sort) {
            return Err(in_context(FormatError::Memory(format!(
                "sorting the lines read needs {}, and {} are available (MemAvailable)",
                memory::bytes_text(sort),
                memory::bytes_text(available)
            ))));
        }
        let order = coalesce::coordinate_order(&indices, &dims);
        let starts = coalesce::run_starts(&indices, &order);
        let values = cols.has_values.then(|| &cols.values[..len]);
        summed
            .add(&indices, values, &order, &starts)
            .map_err(in_context)?;
        self.summed_lines += len as u64;
        match (&mut self.tally, values) {
            (Some(tally), Some(values)) if tally_wanted(cols, opts) => tally.add(values),
            _ => self.tally = None,
        }
        Ok(())
    }

    /// The tensor of the lines read: the columns' first `len` lines and
    /// what the rounds held, with what the reader noticed.
    pub(super) fn into_tensor(
        mut self,
        path: &Path,
        mut cols: Columns,
        len: usize,
        opts: &ReadOptions,
    ) -> Result<(SparseTensor, ReadReport)> {
        let in_context = |e: FormatError| match e {
            FormatError::Memory(m) => FormatError::Memory(format!("{}: {m}", path.display())),
            e => FormatError::file(path, e.to_string()),
        };
        let mut report = ReadReport::default();
        if self.summed.is_none() {
            for col in &mut cols.indices {
                col.truncate(len);
                col.shrink_to_fit();
            }
            cols.values.truncate(len);
            cols.values.shrink_to_fit();
            if len == 0 {
                return Err(no_nonzeros(path));
            }
            let dims = current_dims(&cols, opts);
            let values = if opts.pattern {
                vec![1.0; len]
            } else {
                let tally = tally_wanted(&cols, opts).then(|| {
                    let mut tally = ValueTally::default();
                    tally.add(&cols.values);
                    tally
                });
                report.warnings.extend(index_like_warning(
                    path,
                    &cols,
                    tally.as_ref(),
                    &dims,
                    opts,
                ));
                std::mem::take(&mut cols.values)
            };
            let (t, merged, seconds) =
                SparseTensor::new_timed(dims, cols.indices, values, self.increasing_lines)
                    .map_err(in_context)?;
            report.merged = merged;
            report.coalesce_s = self.seconds + seconds;
            return Ok((t, report));
        }
        if len > 0 {
            let start = Instant::now();
            self.add_lines(path, &cols, len, opts)?;
            self.seconds += start.elapsed().as_secs_f64();
        }
        let dims = current_dims(&cols, opts);
        report.warnings.extend(index_like_warning(
            path,
            &cols,
            self.tally.as_ref(),
            &dims,
            opts,
        ));
        drop(cols);
        let start = Instant::now();
        let Some(summed) = self.summed else {
            return Err(no_nonzeros(path));
        };
        let (indices, values) = summed.finish().map_err(in_context)?;
        let t = SparseTensor::new_distinct(dims, indices, values).map_err(in_context)?;
        report.merged = usize::try_from(self.summed_lines).unwrap_or(usize::MAX) - t.nnz();
        report.coalesce_s = self.seconds + start.elapsed().as_secs_f64();
        Ok((t, report))
    }
}

fn no_nonzeros(path: &Path) -> FormatError {
    FormatError::file(
        path,
        "no nonzeros: the file has only comments and blank lines",
    )
}

/// Whether the values read must be counted for the index-like rule.
fn tally_wanted(cols: &Columns, opts: &ReadOptions) -> bool {
    cols.has_values && cols.integer_tokens && !opts.pattern && !opts.allow_index_like_values
}

/// The dimensions given, or those of the lines read so far (the largest
/// index of each mode plus one).
fn current_dims(cols: &Columns, opts: &ReadOptions) -> Vec<u32> {
    match &opts.dims {
        Some(d) => d.clone(),
        // The parser keeps indices below u32::MAX, so this cannot wrap.
        None => cols.max.iter().map(|&m| m.saturating_add(1)).collect(),
    }
}

/// The distinct coordinates of the lines, estimated from those whose
/// coordinate hashes into the sample (see the module documentation).
///
/// Cost: one parallel pass, and a sort of about 1/64 of the lines.
fn estimate_distinct(indices: &[&[u32]]) -> usize {
    let lines = indices.first().map_or(0, |c| c.len());
    let mut sample: Vec<u64> = (0..lines)
        .into_par_iter()
        .map(|k| coordinate_hash(indices, k))
        .filter(|h| h >> (64 - SAMPLE_BITS) == 0)
        .collect();
    sample.par_sort_unstable();
    let distinct = match sample.len() {
        0 => 0,
        n => {
            1 + (1..n)
                .into_par_iter()
                .filter(|&i| sample[i - 1] != sample[i])
                .count()
        }
    };
    distinct << SAMPLE_BITS
}

/// A 64-bit hash of line `k`'s coordinate (SplitMix64's finalizer applied
/// after each mode's index).
fn coordinate_hash(indices: &[&[u32]], k: usize) -> u64 {
    indices.iter().fold(0x243F_6A88_85A3_08D3, |h, idx| {
        let mut z = (h ^ u64::from(idx[k])).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

#[cfg(test)]
mod tests {
    use crate::io::ReadOptions;
    use crate::tns::test_util::{gzip, write_file};
    use crate::tns::{MAX_BATCH, Tuning, read_tns_tuned};

    /// Bytes per block in the reads with rounds: small, so that a batch
    /// holds few lines.
    const BLOCK: usize = 2048;
    /// Lines per round in the reads with rounds.
    const ROUND: usize = 1000;

    /// Reads `text` (plain and gzipped) with small rounds and with none,
    /// checks that both give the same tensor, to the bit, and the same
    /// report, and returns the most lines the columns held with rounds.
    fn same_with_rounds(name: &str, text: &str, opts: &ReadOptions) -> usize {
        let dir = tempfile::tempdir().unwrap();
        let plain = write_file(dir.path(), &format!("{name}.tns"), text.as_bytes());
        let gz = write_file(
            dir.path(),
            &format!("{name}.tns.gz"),
            &gzip(text.as_bytes()),
        );
        let lines = text.lines().count();
        let mut peak = 0;
        for p in [plain, gz] {
            let whole = Tuning {
                block_size: Some(BLOCK),
                round_min_lines: usize::MAX,
            };
            let (want, want_report, want_room) = read_tns_tuned(&p, opts, whole).unwrap();
            // Without rounds, the columns hold every line.
            assert!(want_room >= lines, "{name}: {want_room} < {lines}");
            let rounds = Tuning {
                block_size: Some(BLOCK),
                round_min_lines: ROUND,
            };
            let (got, report, room) = read_tns_tuned(&p, opts, rounds).unwrap();
            assert_eq!(got, want, "{name}");
            let bits = |t: &crate::coo::SparseTensor| -> Vec<u32> {
                t.values().iter().map(|v| v.to_bits()).collect()
            };
            assert_eq!(bits(&got), bits(&want), "{name}");
            assert_eq!(report.merged, want_report.merged, "{name}");
            assert_eq!(report.warnings, want_report.warnings, "{name}");
            peak = peak.max(room);
        }
        peak
    }

    /// The most lines the columns may hold with rounds of [`ROUND`] lines
    /// once a round has summed: a round, plus one batch of blocks of
    /// lines of at least `min_line` bytes.
    fn bound(min_line: usize) -> usize {
        ROUND + MAX_BATCH * (BLOCK / min_line + 2)
    }

    #[test]
    fn many_copies_of_few_lines_need_memory_for_the_distinct_ones() {
        // Values whose sum depends on the order they are added in, even
        // in f64 (2^60 absorbs the others).
        let values = [
            "1",
            "1152921504606846976",
            "-1152921504606846976",
            "0.1",
            "2.5",
            "-0.7",
        ];
        let coords = ["3 1 4", "1 5 9", "2 6 5", "3 1 4", "5 8 9"];
        let n = 120_000;
        let text: String = (0..n)
            .map(|k| format!("{} {}\n", coords[k % 5], values[k % 6]))
            .collect();
        let peak = same_with_rounds("copies", &text, &ReadOptions::default());
        assert!(peak <= bound(9), "{peak} lines held at once");
        assert!(peak < n / 10, "{peak} lines held at once");
        // Without values.
        let text: String = (0..n).map(|k| format!("{}\n", coords[k % 5])).collect();
        let pattern = ReadOptions {
            pattern: true,
            ..ReadOptions::default()
        };
        let peak = same_with_rounds("pattern", &text, &pattern);
        assert!(peak <= bound(6), "{peak} lines held at once");
    }

    #[test]
    fn rounds_leave_every_tensor_and_report_as_they_were() {
        // No repeats, out of order: the lines keep their file order.
        let shuffle = |n: u64| -> String {
            (0..n)
                .map(|k| {
                    let i = k * 7919 % n;
                    format!("{} {} {}.5\n", i / 100 + 1, i % 100 + 1, i % 13)
                })
                .collect()
        };
        let shuffled = shuffle(20_000);
        let peak = same_with_rounds("shuffled", &shuffled, &ReadOptions::default());
        assert!(peak >= 20_000, "{peak}");
        // Many repeats, then distinct lines, then many repeats again, of
        // some of the distinct coordinates and of new ones: summed from
        // the first round on, new coordinates placed between those held.
        let repeats = |from: u64| -> String {
            (from..from + 30_000)
                .map(|k| {
                    let i = k * 104_729 % 50;
                    let j = if k % 3 == 0 { i + 150 } else { i };
                    format!("{} {} 0.{}\n", j % 7 + 1, i + 1, k % 9)
                })
                .collect()
        };
        let mixed = repeats(0) + &shuffle(2_000) + &repeats(30_000);
        let peak = same_with_rounds("mixed", &mixed, &ReadOptions::default());
        assert!(peak < 62_000 / 4, "{peak}");
        // An index-like value column, its lines repeated: the warning
        // reads every line's value across rounds.
        let n = 100_000u64;
        let index_like: String = (0..n)
            .map(|k| {
                let (i, j, l) = (k % 7 + 1, k % 11 + 1, k % 5 + 1);
                format!("{i} {j} {l} {}\n", (k * 53) % 300 + 1)
            })
            .collect();
        let peak = same_with_rounds("index_like", &index_like, &ReadOptions::default());
        assert!(peak < n as usize / 10, "{peak}");
        let dir = tempfile::tempdir().unwrap();
        let p = write_file(dir.path(), "i.tns", index_like.as_bytes());
        let rounds = Tuning {
            block_size: Some(BLOCK),
            round_min_lines: ROUND,
        };
        let (t, report, _) = read_tns_tuned(&p, &ReadOptions::default(), rounds).unwrap();
        assert_eq!(report.warnings.len(), 1, "{:?}", report.warnings);
        assert!(
            report.warnings[0].text.contains("300 distinct"),
            "{:?}",
            report.warnings
        );
        assert_eq!((t.nnz(), report.merged), (385, n as usize - 385));
    }
}
