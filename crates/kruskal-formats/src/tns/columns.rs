//! The parsed nonzeros as columns, and the tensor made from them (with the
//! warning for a value column that looks like an index).

use std::collections::HashMap;
use std::path::Path;

use rayon::prelude::*;

use super::{INDEX_LIKE_MAX_MODE_SHARE, INDEX_LIKE_MIN_DISTINCT};
use crate::coo::SparseTensor;
use crate::error::{FormatError, Result};
use crate::io::{ReadOptions, ReadReport};

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

    pub(super) fn into_tensor(
        self,
        path: &Path,
        opts: &ReadOptions,
    ) -> Result<(SparseTensor, ReadReport)> {
        let nnz = self.nnz();
        if nnz == 0 {
            return Err(FormatError::file(
                path,
                "no nonzeros: the file has only comments and blank lines",
            ));
        }
        let mut report = ReadReport::default();
        let dims = match &opts.dims {
            Some(d) => d.clone(),
            // The parser keeps indices below u32::MAX, so this cannot wrap.
            None => self.max.iter().map(|&m| m.saturating_add(1)).collect(),
        };
        let values = if opts.pattern {
            vec![1.0; nnz]
        } else {
            if self.integer_tokens && !opts.allow_index_like_values {
                if let Some(why) = index_like(&self.values, &dims) {
                    report.warnings.push(format!(
                        "{}: the last column looks like an index, not a value ({why}); it is \
                         read as values of a {}-mode tensor: if every line is only indices, \
                         use --pattern",
                        path.display(),
                        dims.len()
                    ));
                }
            }
            self.values
        };
        let (t, merged, seconds) =
            SparseTensor::new_timed(dims, self.indices, values).map_err(|e| match e {
                FormatError::Memory(m) => FormatError::Memory(format!("{}: {m}", path.display())),
                e => FormatError::file(path, e.to_string()),
            })?;
        report.merged = merged;
        report.coalesce_s = seconds;
        Ok((t, report))
    }
}

/// Why `values`, all written as plain integers, look like one more index
/// column of a tensor whose index modes have dimensions `dims`, or `None`
/// if they do not (see the module documentation for the rule).
fn index_like(values: &[f32], dims: &[u32]) -> Option<String> {
    let n = values.len();
    if !values.par_iter().all(|&v| v >= 1.0) {
        return None;
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
    let distinct = counts.len();
    let smallest_dim = dims.iter().copied().min().unwrap_or(0) as usize;
    let needed = INDEX_LIKE_MIN_DISTINCT.min(smallest_dim).max(2);
    if distinct < needed {
        return None;
    }
    let top = counts.values().copied().max().unwrap_or(0);
    let top_share = top as f64 / n as f64;
    if top_share > INDEX_LIKE_MAX_MODE_SHARE.max(1.0 / distinct as f64) {
        return None;
    }
    Some(format!(
        "every value is a whole number written without a decimal point, {distinct} distinct, \
         the most frequent in {:.1}% of the lines",
        100.0 * top_share
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tns::read_tns_report;
    use crate::tns::test_util::{file_err, write_file};

    #[test]
    fn index_like_values_are_read_as_values_with_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        let warnings = |name: &str, text: &str| -> (SparseTensor, Vec<String>) {
            let p = write_file(dir.path(), name, text.as_bytes());
            let (t, report) = read_tns_report(&p, &ReadOptions::default()).unwrap();
            (t, report.warnings)
        };
        // 1000 lines whose last column is a scattered index: read as values
        // of a 1-mode tensor, with one warning that names --pattern.
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
        assert!(w[0].contains("--pattern"), "{w:?}");
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
