//! The parsed nonzeros as columns, and the warning for a value column that
//! looks like an index (with the tally of values it reads).

use std::collections::HashMap;
use std::path::Path;

use rayon::prelude::*;

use super::{INDEX_LIKE_MAX_MODE_SHARE, INDEX_LIKE_MIN_DISTINCT};
use crate::error::{Advice, ReadWarning};
use crate::io::ReadOptions;

/// The parsed nonzeros of one block, or of the whole file.
#[derive(Default)]
pub(super) struct Columns {
    /// 0-based indices, one vector per mode.
    pub(super) indices: Vec<Vec<u32>>,
    /// Values; empty for a pattern read.
    pub(super) values: Vec<f32>,
    /// Largest index per mode.
    pub(super) max: Vec<u32>,
    /// False for a pattern read.
    pub(super) has_values: bool,
    /// Every value token so far was written as a plain integer (digits
    /// only), as the last column of a pattern file is.
    pub(super) integer_tokens: bool,
}

impl Columns {
    pub(super) fn with_capacity(nmodes: usize, pattern: bool, cap: usize) -> Columns {
        Columns {
            indices: (0..nmodes).map(|_| Vec::with_capacity(cap)).collect(),
            values: if pattern {
                Vec::new()
            } else {
                Vec::with_capacity(cap)
            },
            max: vec![0; nmodes],
            has_values: !pattern,
            integer_tokens: true,
        }
    }

    pub(super) fn nnz(&self) -> usize {
        self.indices.first().map_or(0, Vec::len)
    }

    /// Empties the columns for reuse, keeping their capacity.
    pub(super) fn clear(&mut self) {
        self.indices.iter_mut().for_each(Vec::clear);
        self.values.clear();
        self.max.iter_mut().for_each(|m| *m = 0);
        self.integer_tokens = true;
    }

    /// Reserves room for `additional` more nonzeros (values only when the
    /// columns hold values).
    pub(super) fn reserve(&mut self, additional: usize) {
        for col in &mut self.indices {
            col.reserve(additional);
        }
        if self.has_values {
            self.values.reserve(additional);
        }
    }
}

/// Distinct values counted across rounds of summing, at most: a value
/// first seen in a round that begins with this many already counted is
/// not counted (see [`ValueTally::add`]).
const TALLY_MAX_DISTINCT: usize = 1 << 22;

/// How often each value occurs among the lines, for the index-like rule
/// (see the module documentation of `tns`): what the rule needs of the
/// values, kept while the lines themselves are summed away in rounds.
#[derive(Default)]
pub(super) struct ValueTally {
    /// Occurrences of each value (by its bits).
    counts: HashMap<u32, u64>,
    lines: u64,
    /// Some value is below 1: not an index, whatever the rest.
    below_one: bool,
    /// Some values were not counted (see [`ValueTally::add`]).
    partial: bool,
}

impl ValueTally {
    /// Counts `values`, the next lines of the file. The values of one call
    /// are counted exactly; those of a call that finds
    /// [`TALLY_MAX_DISTINCT`] values already counted only add to values
    /// already counted (the counts stay bounded while a file is summed in
    /// rounds). One call is all the lines of a file read without rounds.
    pub(super) fn add(&mut self, values: &[f32]) {
        self.lines += values.len() as u64;
        if self.below_one {
            return;
        }
        if !values.par_iter().all(|&v| v >= 1.0) {
            self.below_one = true;
            self.counts = HashMap::new();
            return;
        }
        let counts = values
            .par_chunks(1 << 16)
            .fold(HashMap::new, |mut counts: HashMap<u32, u64>, chunk| {
                for v in chunk {
                    *counts.entry(v.to_bits()).or_insert(0) += 1;
                }
                counts
            })
            .reduce(HashMap::new, |a, b| {
                // Merge the smaller map into the larger.
                let (mut big, small) = if a.len() >= b.len() { (a, b) } else { (b, a) };
                for (k, c) in small {
                    *big.entry(k).or_insert(0) += c;
                }
                big
            });
        if self.counts.is_empty() {
            self.counts = counts;
            return;
        }
        let room = self.counts.len() < TALLY_MAX_DISTINCT;
        for (k, c) in counts {
            match self.counts.get_mut(&k) {
                Some(held) => *held += c,
                None if room => {
                    self.counts.insert(k, c);
                }
                None => self.partial = true,
            }
        }
    }

    /// Why the values counted, all written as plain integers, look like
    /// one more index column of a tensor whose index modes have dimensions
    /// `dims`, or `None` if they do not (see the module documentation for
    /// the rule).
    pub(super) fn index_like(&self, dims: &[u32]) -> Option<String> {
        if self.below_one || self.lines == 0 {
            return None;
        }
        let distinct = self.counts.len();
        let smallest_dim = dims.iter().copied().min().unwrap_or(0) as usize;
        let needed = INDEX_LIKE_MIN_DISTINCT.min(smallest_dim).max(2);
        if distinct < needed {
            return None;
        }
        let top = self.counts.values().copied().max().unwrap_or(0);
        let top_share = top as f64 / self.lines as f64;
        if top_share > INDEX_LIKE_MAX_MODE_SHARE.max(1.0 / distinct as f64) {
            return None;
        }
        let at_least = if self.partial { "at least " } else { "" };
        Some(format!(
            "every value is a whole number written without a decimal point, {at_least}{distinct} \
             distinct, the most frequent in {:.1}% of the lines",
            100.0 * top_share
        ))
    }
}

/// The warning for a value column that looks like an index, when `tally`
/// (of every line's value) says so and the reader was not told otherwise.
pub(super) fn index_like_warning(
    path: &Path,
    cols: &Columns,
    tally: Option<&ValueTally>,
    dims: &[u32],
    opts: &ReadOptions,
) -> Option<ReadWarning> {
    if opts.pattern || !cols.integer_tokens || opts.allow_index_like_values {
        return None;
    }
    let why = tally?.index_like(dims)?;
    Some(ReadWarning {
        text: format!(
            "{}: the last column looks like an index, not a value ({why}); it is read as values \
             of a {}-mode tensor",
            path.display(),
            dims.len()
        ),
        advice: Some(Advice::PatternIfEveryLineIsIndices),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coo::SparseTensor;
    use crate::tns::read_tns_report;
    use crate::tns::test_util::{dashed, file_err, write_file};

    #[test]
    fn index_like_values_are_read_as_values_with_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        // Each warning as the command line spells it.
        let warnings = |name: &str, text: &str| -> (SparseTensor, Vec<String>) {
            let p = write_file(dir.path(), name, text.as_bytes());
            let (t, report) = read_tns_report(&p, &ReadOptions::default()).unwrap();
            let w = report.warnings.iter().map(|w| w.message(&dashed)).collect();
            (t, w)
        };
        // 1000 lines whose last column is a scattered index: read as values
        // of a 1-mode tensor, with one warning that names the pattern
        // option.
        let pattern: String = (0..1000u32)
            .map(|i| format!("{} {}\n", i % 13 + 1, (i * 7919) % 997 + 2))
            .collect();
        let (t, w) = warnings("pattern.tns", &pattern);
        assert_eq!(t.nmodes(), 1);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("pattern.tns")
                && w[0].contains("looks like an index")
                && w[0].contains("--pattern"),
            "{w:?}"
        );
        // The same rule on two lines: `1 1 1` / `2 2 2` is a 2-mode tensor
        // with values 1 and 2, or a 3-mode pattern; the reader says so.
        let (t, w) = warnings("tiny.tns", "1 1 1\n2 2 2\n");
        assert_eq!((t.nmodes(), t.values()), (2, &[1.0f32, 2.0][..]));
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].ends_with("if every line is only indices, use --pattern"),
            "{w:?}"
        );
        // A value written with a decimal point is never an index.
        let (_, w) = warnings("tiny-point.tns", "1 1 1.0\n2 2 2.0\n");
        assert!(w.is_empty(), "{w:?}");
        let point: String = pattern.replace('\n', ".0\n");
        assert!(warnings("point.tns", &point).1.is_empty());
        // Asked for, the warning is not given.
        let p = write_file(dir.path(), "pattern.tns", pattern.as_bytes());
        let quiet = ReadOptions {
            allow_index_like_values: true,
            ..ReadOptions::default()
        };
        assert!(read_tns_report(&p, &quiet).unwrap().1.warnings.is_empty());

        // Counts, mostly 1s: data, without a word.
        let counts: String = (0..1000u32)
            .map(|i| format!("{} {}\n", i + 1, if i % 3 == 0 { i + 2 } else { 1 }))
            .collect();
        let (t, w) = warnings("counts.tns", &counts);
        assert_eq!((t.nnz(), w.len()), (1000, 0));
        // Few distinct values (ratings).
        let ratings: String = (0..1000u32)
            .map(|i| format!("{} {}\n", i + 1, i % 5 + 2))
            .collect();
        let (t, w) = warnings("ratings.tns", &ratings);
        assert_eq!((t.nnz(), w.len()), (1000, 0));
        // One dominant value.
        let dominant: String = (0..1000u32)
            .map(|i| format!("{} {}\n", i + 1, if i % 4 == 0 { 7 } else { i + 2 }))
            .collect();
        let (t, w) = warnings("dominant.tns", &dominant);
        assert_eq!((t.nnz(), w.len()), (1000, 0));
    }

    #[test]
    fn repeated_coordinates_are_summed_once() {
        let dir = tempfile::tempdir().unwrap();
        let text = "1 1 1 1.5\n2 1 1 1.0\n1 1 1 2.0\n1 2 1 4.0\n1 1 1 0.25\n";
        let p = write_file(dir.path(), "r.tns", text.as_bytes());
        let (t, report) = read_tns_report(&p, &ReadOptions::default()).unwrap();
        assert_eq!(report.merged, 2);
        assert_eq!(t.nnz(), 3);
        // Coordinate order; (1,1,1) holds 1.5 + 2 + 0.25.
        assert_eq!(t.mode_indices(0), &[0, 0, 1]);
        assert_eq!(t.mode_indices(1), &[0, 1, 0]);
        assert_eq!(t.values(), &[3.75, 4.0, 1.0]);
        assert_eq!(t.norm_sq(), 3.75 * 3.75 + 16.0 + 1.0);
        // Sums that f32 cannot hold are an error, not an infinity.
        let p = write_file(dir.path(), "big.tns", b"1 1 3e38\n1 1 3e38\n");
        let err = file_err(&p, &ReadOptions::default());
        assert!(err.contains("sum to 6.0") && err.contains("f32"), "{err}");
    }
}
