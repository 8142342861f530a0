//! FROSTT text tensors (`.tns`, and gzip-compressed `.tns.gz`).
//!
//! One nonzero per line: the indices (1-based unless
//! [`ReadOptions::zero_based`]), then the value, separated by spaces or tabs.
//! Lines whose first non-blank character is `#`, and blank lines, are
//! skipped; Windows line endings and a leading UTF-8 byte-order mark are
//! accepted. The number of modes comes from the first data line, and each
//! dimension is the largest index seen plus one unless
//! [`ReadOptions::dims`] gives them. A [`ReadOptions::pattern`] file has no
//! value column: every column is an index and every value is 1.
//!
//! # Pattern files read as valued files
//!
//! The last column is the value, whatever it holds: counts (whole numbers,
//! often large) are the most common values in real tensors. A pattern file
//! read without `pattern` would become a tensor with one mode fewer, whose
//! "values" are the last mode's indices, so the reader warns (in
//! [`ReadReport::warnings`], unless
//! [`ReadOptions::allow_index_like_values`]) when the value column looks
//! like an index column. One rule, whatever the file's size: every value
//! token is digits only (no sign, point or exponent), at least
//! min([`INDEX_LIKE_MIN_DISTINCT`], the smallest index mode's dimension)
//! values are distinct (and at least 2), and the most frequent value holds
//! no more than the larger of [`INDEX_LIKE_MAX_MODE_SHARE`] and a uniform
//! share of the lines. Ratings have few distinct values, counts a frequent
//! small one, and a value written `6.0` is never an index. Where repeated
//! coordinates are summed while reading (below), the values are counted as
//! the lines go; past 2^22 distinct values, a value first seen in a later
//! round is not counted, and the warning says "at least" that many.
//!
//! # How it reads fast
//!
//! A plain file is cut into byte ranges of up to 2 MiB (sized so that every
//! thread gets work and every batch is full). Batches of ranges, one per
//! worker thread, are read with positional reads and parsed by the same
//! threads, with a hand-written byte parser, into per-block column vectors.
//! A range's block is the lines that start in it: it begins after the first
//! newline at or after the byte before the range, and ends at the first
//! newline at or after the range's last byte, so every line is parsed once
//! and no thread reads the whole file. A `.gz` file is decompressed (as
//! multi-member gzip) by one reader thread into blocks cut at line ends,
//! filling the next batch while one is parsed. Each parsed batch is copied
//! into place in the output, in parallel, while the next batch is parsed.
//! Each block reports its line count, so error line numbers are global, and
//! the first error in file order is the one reported. Memory is the output
//! plus about three batches of blocks, whose buffers are reused.
//!
//! Lines that repeat coordinates are summed as they are read, where they
//! are many (`rounds.rs`): a file of many copies of few lines needs memory
//! for its distinct coordinates and a round of lines, not for every line.
//! The tensor is the one summing every line at the end would give, bit for
//! bit. Plain files
//! are read with ordinary reads rather than a memory map: a mapped file that
//! another process truncates faults the reader (and mapping needs `unsafe`),
//! while the copy costs little next to parsing.
//!
//! # Where the code is
//!
//! This file holds the entry points; the submodules hold one concern each:
//! `feed` cuts the input into blocks of whole lines (positional reads of a
//! plain file, or a gzip reader thread), `batch` parses blocks in parallel
//! batches and copies them into the output, `parse` turns lines into
//! indices and values, `numbers` parses the values, `rounds` sums repeated
//! coordinates while reading and makes the tensor out of what was read,
//! `columns` holds the parsed columns and the index-like warning (with the
//! tally of values it reads), and `write` writes text.

mod batch;
mod columns;
mod feed;
mod numbers;
mod parse;
mod rounds;
#[cfg(test)]
pub(crate) mod test_util;
mod write;

use std::fs::File;
use std::path::Path;

use crate::coo::SparseTensor;
use crate::error::{FormatError, Result};
use crate::io::{FileKind, ReadOptions, ReadReport};

use batch::parse_batches;
use feed::{Feed, PlainFile, plain_block_size, read_gzip};
use rounds::ROUND_MIN_LINES;

pub use write::write_tns;

/// The longest line accepted; a longer one means the file is not a tensor
/// (and bounds the memory a newline-free file can make the reader use).
const MAX_LINE: usize = 64 << 20;

/// Most blocks parsed at once, whatever the thread count, to bound memory.
const MAX_BATCH: usize = 32;

/// Index-like value detection: the fewest distinct values (or the smallest
/// index mode's dimension, if that is smaller).
pub const INDEX_LIKE_MIN_DISTINCT: usize = 256;
/// Index-like value detection: the largest share of lines holding the most
/// frequent value (or a uniform share, if that is larger). Knowledge-graph
/// entity columns reach 11% (JF17K), so this is well above that; counts,
/// mostly small, hold far more in their most frequent value.
pub const INDEX_LIKE_MAX_MODE_SHARE: f64 = 0.2;

/// Reads a FROSTT text tensor, plain or gzip-compressed (decided by the
/// file's first bytes, not its name).
///
/// Errors name the file and, for a bad line, its 1-based line number: a
/// line with a different column count than the first data line, an index
/// that is not a non-negative integer, an index 0 in a 1-based read, an
/// index too large for 32 bits or beyond `opts.dims`, a value that is not a
/// finite number, a file that is not text, a truncated or corrupt gzip
/// stream, and a file with no nonzeros. Lines that repeat a coordinate are
/// summed into one nonzero.
pub fn read_tns(path: &Path, opts: &ReadOptions) -> Result<SparseTensor> {
    read_tns_with(path, opts, None)
}

/// [`read_tns`], also returning what the reader noticed: repeated
/// coordinates summed, and a value column that looks like an index (see the
/// module documentation).
pub fn read_tns_report(path: &Path, opts: &ReadOptions) -> Result<(SparseTensor, ReadReport)> {
    read_tns_report_with(path, opts, None)
}

/// [`read_tns`] with a chosen block size (small in tests, to exercise block
/// boundaries); `None` picks one from the file size.
pub(crate) fn read_tns_with(
    path: &Path,
    opts: &ReadOptions,
    block_size: Option<usize>,
) -> Result<SparseTensor> {
    read_tns_report_with(path, opts, block_size).map(|(t, _)| t)
}

/// [`read_tns_report`] with a chosen block size.
pub(crate) fn read_tns_report_with(
    path: &Path,
    opts: &ReadOptions,
    block_size: Option<usize>,
) -> Result<(SparseTensor, ReadReport)> {
    let tuning = Tuning {
        block_size,
        round_min_lines: ROUND_MIN_LINES,
    };
    read_tns_tuned(path, opts, tuning).map(|(t, report, _)| (t, report))
}

/// How a read cuts its work (chosen in tests, to exercise the cuts).
#[derive(Clone, Copy)]
pub(crate) struct Tuning {
    /// Bytes per block; `None` picks them from the file size.
    pub(crate) block_size: Option<usize>,
    /// The fewest lines out of coordinate order before a round of summing
    /// repeated coordinates, and between two rounds ([`ROUND_MIN_LINES`]
    /// outside tests).
    pub(crate) round_min_lines: usize,
}

/// [`read_tns_report`] cut as `tuning` says, also returning the most
/// lines the reader's columns had room for at once (the memory of the
/// lines not yet summed).
pub(crate) fn read_tns_tuned(
    path: &Path,
    opts: &ReadOptions,
    tuning: Tuning,
) -> Result<(SparseTensor, ReadReport, usize)> {
    let block_size = tuning.block_size;
    let kind = FileKind::sniff(path)?;
    if kind == FileKind::Binary {
        return Err(FormatError::file(
            path,
            "this is a kruskal binary tensor (.ktns), not text; read it with read_tensor",
        ));
    }
    let mut file = File::open(path).map_err(|e| FormatError::io(path, e))?;
    let total = file.metadata().map_err(|e| FormatError::io(path, e))?.len();
    if total == 0 {
        // Files of /proc and /sys say they have no length and yet hold
        // bytes: their length cannot be known before reading them whole.
        let mut byte = [0u8; 1];
        if std::io::Read::read(&mut file, &mut byte).is_ok_and(|n| n > 0) {
            return Err(FormatError::file(
                path,
                "the file reports a length of 0 but holds data (a /proc or /sys file?): a \
                 tensor is read from a regular file of known length (copy it to one first)",
            ));
        }
        return Err(FormatError::file(path, "the file is empty: no nonzeros"));
    }
    let threads = rayon::current_num_threads().max(1);
    let batch = threads.clamp(1, MAX_BATCH);
    let output = if kind == FileKind::TnsGz {
        read_gzip(path, file, total, tuning, threads, batch, opts)?
    } else {
        // A range is no longer than the longest line, so only a block's last
        // line can be too long (see `PlainFile::load_into`).
        let block = match block_size {
            Some(b) => (b as u64).clamp(1, MAX_LINE as u64),
            None => plain_block_size(total, threads, batch),
        };
        let plain = PlainFile {
            path,
            file,
            total,
            block,
        };
        let mut feed = Feed::Plain {
            file: &plain,
            next: 0,
            bufs: Vec::new(),
        };
        parse_batches(path, &mut feed, batch, total, tuning.round_min_lines, opts)?
    };
    opts.report(total, total);
    output.into_tensor(path, opts)
}

#[cfg(test)]
mod tests {
    use super::test_util::{data_dir, file_err, gzip, read, write_file};
    use super::*;

    #[test]
    fn repository_data_files() {
        let data = data_dir();
        // The SPLATT README lists splatt-small4* as 6 nonzeros; they hold 8.
        for (name, modes, nnz) in [
            ("splatt-small.tns", 3, 6),
            ("splatt-small4.tns", 4, 8),
            ("splatt-med.tns.gz", 3, 100_000),
            ("splatt-med4.tns.gz", 4, 100_000),
            ("splatt-med5.tns.gz", 5, 100_000),
        ] {
            let (t, report) = read_tns_report(&data.join(name), &ReadOptions::default()).unwrap();
            assert_eq!((t.nmodes(), t.nnz()), (modes, nnz), "{name}");
            assert_eq!((report.merged, report.warnings.len()), (0, 0), "{name}");
        }
        let med = read(&data.join("splatt-med.tns.gz")).unwrap();
        assert_eq!(med.dims(), &[2425, 10816, 29567]);
        assert_eq!((med.mode_indices(1)[0], med.values()[0]), (200, 4.0));
        let small = read(&data.join("splatt-small.tns")).unwrap();
        assert_eq!(small.values(), &[6.0, 2.0, 1.0, 5.0, 3.0, 4.0]);
        assert_eq!(small.dims(), &[2, 3, 2]);

        // The same tensor with repeated coordinates, shuffled: summed, it
        // is splatt-med to the bit.
        let (repeats, report) = read_tns_report(
            &data.join("splatt-med-repeats.tns.gz"),
            &ReadOptions::default(),
        )
        .unwrap();
        assert_eq!(report.merged, 1_979 + 2 * 1_031);
        assert_eq!(repeats, med);

        for (name, modes, nnz) in [
            ("kg-jf17k-4mode-novalues.tns.gz", 4, 34544),
            ("kg-jf17k-5mode-novalues.tns.gz", 5, 9509),
            ("kg-wikipeople-4mode-novalues.tns.gz", 4, 25820),
        ] {
            let p = data.join(name);
            // Read as values, with a warning whose advice is the pattern
            // option.
            let (t, report) = read_tns_report(&p, &ReadOptions::default()).unwrap();
            assert_eq!(t.nmodes(), modes - 1, "{name}");
            assert_eq!(report.warnings.len(), 1, "{name}");
            assert_eq!(
                report.warnings[0].advice,
                Some(crate::Advice::PatternIfEveryLineIsIndices),
                "{name}"
            );
            let pattern = ReadOptions {
                pattern: true,
                ..ReadOptions::default()
            };
            let (t, report) = read_tns_report(&p, &pattern).unwrap();
            assert_eq!((t.nmodes(), t.nnz()), (modes, nnz), "{name}");
            assert_eq!((report.merged, report.warnings.len()), (0, 0), "{name}");
            assert!(t.values().iter().all(|&v| v == 1.0));
        }
    }

    #[test]
    fn empty_and_missing_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = write_file(dir.path(), "empty.tns", b"");
        assert!(file_err(&p, &ReadOptions::default()).contains("empty"));
        let p = write_file(dir.path(), "comments.tns", b"# only\n\n   \n# comments\n");
        assert!(file_err(&p, &ReadOptions::default()).contains("no nonzeros"));
        let p = write_file(dir.path(), "comments.tns.gz", &gzip(b"# only\n"));
        assert!(file_err(&p, &ReadOptions::default()).contains("no nonzeros"));
        let p = write_file(dir.path(), "empty.tns.gz", &gzip(b""));
        assert!(file_err(&p, &ReadOptions::default()).contains("no nonzeros"));
        let missing = dir.path().join("missing.tns");
        let err = read(&missing).unwrap_err();
        assert!(matches!(err, FormatError::Io { .. }));
        assert!(err.to_string().contains("missing.tns"), "{err}");
    }

    #[test]
    fn binary_file_is_not_read_as_text() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.ktns");
        let t = SparseTensor::new(vec![2], vec![vec![1]], vec![1.0]).unwrap();
        crate::binary::write_binary(&p, &t).unwrap();
        assert!(file_err(&p, &ReadOptions::default()).contains("read_tensor"));
    }
}
