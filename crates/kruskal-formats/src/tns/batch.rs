//! Parsing in parallel batches: blocks are parsed a batch at a time (one
//! per thread), and each parsed batch is copied into place in the output
//! while the next one is parsed. The first error in file order wins.

use std::path::Path;

use rayon::prelude::*;

use super::columns::Columns;
use super::feed::{Block, Feed, Job};
use super::parse::{
    Layout, ParsedBlock, count_lines, first_data_line, make_layout, parse_block, with_cr_hint,
};
use super::rounds::Held;
use crate::coalesce;
use crate::coo::SparseTensor;
use crate::error::{FormatError, Result};
use crate::io::{ReadOptions, ReadReport};
use crate::memory;

/// Parses the blocks of `feed` in parallel batches and appends their
/// columns in file order, summing repeated coordinates in rounds where
/// they are many (`rounds.rs`) in rounds of at least `round_min` lines.
pub(super) fn parse_batches(
    path: &Path,
    feed: &mut Feed,
    batch: usize,
    total: u64,
    round_min: usize,
    opts: &ReadOptions,
) -> Result<Output> {
    let reading = Reading { path, total, opts };
    let mut out = Output {
        held: Held::new(round_min),
        ..Output::default()
    };
    let mut layout: Option<Layout> = None;
    // Lines in the blocks already appended (or skipped before the first
    // data line).
    let mut lines_before: u64 = 0;
    // Parse outputs kept for later batches, so their memory is reused.
    let mut spare: Vec<Columns> = Vec::new();
    // The batch parsed last round, not yet appended, and how far into the
    // file it reaches. Appending it overlaps parsing the next batch.
    let mut pending: Option<(Vec<ParsedBlock>, u64)> = None;
    loop {
        let mut jobs = feed.next_jobs(batch);
        let Some(reach) = jobs.last().map(Job::file_pos) else {
            if let Some((p, pos)) = pending.take() {
                append_batch(reading, &mut out, p, pos, &mut lines_before, &mut spare)?;
            }
            return Ok(out);
        };

        if layout.is_none() {
            // Read the batch first, to find the first data line in it.
            // Nothing was parsed yet, so `lines_before` is exact here.
            let mut blocks: Vec<Block> = jobs.into_par_iter().map(Job::load).collect();
            let mut line = lines_before;
            for b in &mut blocks {
                if let Some((local, ncols)) = first_data_line(b.text()) {
                    let made = make_layout(path, ncols, line + local, opts);
                    layout = Some(made.map_err(|e| match e {
                        FormatError::Parse {
                            path,
                            line,
                            message,
                        } => FormatError::Parse {
                            path,
                            line,
                            message: with_cr_hint(message, b.text()),
                        },
                        other => other,
                    })?);
                    break;
                }
                line += count_lines(b.text());
                if let Some(stop) = b.stop.take() {
                    return Err(stop.into_error(path, line + 1));
                }
            }
            if layout.is_none() {
                lines_before = line;
            }
            jobs = blocks.into_iter().map(Job::Ready).collect();
        }
        let Some(layout) = layout.as_ref() else {
            // Only comments and blank lines so far.
            for job in jobs {
                if let Job::Ready(b) = job {
                    feed.recycle(b.buf);
                }
            }
            continue;
        };
        let cols: Vec<Columns> = jobs
            .iter()
            .map(|_| {
                spare
                    .pop()
                    .unwrap_or_else(|| Columns::with_capacity(layout.nmodes, opts.pattern, 0))
            })
            .collect();
        let previous = pending.take();
        let (appended, mut parsed) = rayon::join(
            || -> Result<Option<u64>> {
                match previous {
                    Some((p, pos)) => {
                        append_batch(reading, &mut out, p, pos, &mut lines_before, &mut spare)?;
                        Ok(Some(pos))
                    }
                    None => Ok(None),
                }
            },
            || {
                jobs.into_par_iter()
                    .zip(cols)
                    .map(|(job, cols)| {
                        let block = job.load();
                        let mut parsed = parse_block(block.text(), layout, cols);
                        parsed.stop = block.stop;
                        parsed.buf = block.buf;
                        parsed
                    })
                    .collect::<Vec<ParsedBlock>>()
            },
        );
        if let Some(pos) = appended? {
            opts.report(pos.min(total), total);
        }
        for p in &mut parsed {
            feed.recycle(std::mem::take(&mut p.buf));
        }
        let failed = parsed.iter().any(|p| p.error.is_some() || p.stop.is_some());
        if failed {
            // Appending returns the first error in file order; reading on
            // would be wasted.
            append_batch(
                reading,
                &mut out,
                parsed,
                reach,
                &mut lines_before,
                &mut spare,
            )?;
        } else {
            pending = Some((parsed, reach));
        }
    }
}

/// The file being read: its path and length, and how to read it.
#[derive(Clone, Copy)]
struct Reading<'a> {
    path: &'a Path,
    total: u64,
    opts: &'a ReadOptions,
}

/// Appends a parsed batch to `out` in file order, or returns the first bad
/// line in it with its global line number (or the stop after it); then
/// runs a round of summing when one is due.
fn append_batch(
    reading: Reading,
    out: &mut Output,
    mut parsed: Vec<ParsedBlock>,
    file_pos: u64,
    lines_before: &mut u64,
    spare: &mut Vec<Columns>,
) -> Result<()> {
    let Reading { path, total, opts } = reading;
    for block in &mut parsed {
        if let Some((line, e)) = block.error.take() {
            return Err(e.into_error(path, *lines_before + line));
        }
        *lines_before += block.lines;
        if let Some(stop) = block.stop.take() {
            return Err(stop.into_error(path, *lines_before + 1));
        }
    }
    let Some(first) = parsed.first() else {
        return Ok(());
    };
    let cols = &mut out.cols;
    if cols.indices.is_empty() {
        cols.indices = vec![Vec::new(); first.cols.indices.len()];
        cols.max = vec![0; first.cols.indices.len()];
        cols.has_values = first.cols.has_values;
        cols.integer_tokens = true;
    }
    let start = out.len;
    let end = start + parsed.iter().map(|b| b.cols.nnz()).sum::<usize>();
    if out.held.increasing() {
        let timer = std::time::Instant::now();
        let in_order = continues_order(&out.cols, start, &parsed);
        out.held
            .order_checked(end - start, in_order, timer.elapsed().as_secs_f64());
    }
    if end > out.room {
        // What is held must fit in the memory that was available when
        // reading began (the columns and sums are filled as reading goes
        // on, so the memory available now no longer counts them).
        let nmodes = out.cols.indices.len();
        let budget = *out.budget.get_or_insert_with(memory::available_bytes);
        let held = out.held.bytes();
        let need = memory::coo_bytes(nmodes, end as u64).saturating_add(held);
        if let Some(budget) = budget.filter(|&b| need > b) {
            let what = match out.held.distinct() {
                Some(distinct) => format!(
                    "the sums of the {distinct} distinct coordinates read so far and the {end} \
                     lines read since"
                ),
                None => format!("the first {end} nonzeros of the file"),
            };
            return Err(FormatError::Memory(format!(
                "{}: {what} need {} in memory, and {} were available (MemAvailable) when \
                 reading began",
                path.display(),
                memory::bytes_text(need),
                memory::bytes_text(budget)
            )));
        }
        // Size the columns from the density of nonzeros so far, so that
        // they are rarely regrown (and copied), within the memory
        // available and no larger than the next round of summing needs.
        let estimate = (end as f64 * total as f64 / file_pos.max(1) as f64 * 1.02) as usize;
        let affordable = budget.map_or(usize::MAX, |b| {
            usize::try_from((b - held) / (4 * nmodes as u64 + 4)).unwrap_or(usize::MAX)
        });
        out.grow(out.held.room_for(estimate).min(affordable).max(end));
    }
    // Copy the blocks into place, in parallel over blocks and columns.
    let mut indices: Vec<(&mut [u32], &[u32])> = Vec::new();
    let mut values: Vec<(&mut [f32], &[f32])> = Vec::new();
    for (m, dst) in out.cols.indices.iter_mut().enumerate() {
        let mut rest = &mut dst[start..end];
        for b in &parsed {
            let (here, after) = rest.split_at_mut(b.cols.indices[m].len());
            indices.push((here, &b.cols.indices[m]));
            rest = after;
        }
    }
    if out.cols.has_values {
        let mut rest = &mut out.cols.values[start..end];
        for b in &parsed {
            let (here, after) = rest.split_at_mut(b.cols.values.len());
            values.push((here, &b.cols.values));
            rest = after;
        }
    }
    rayon::join(
        || {
            indices
                .into_par_iter()
                .for_each(|(dst, src)| dst.copy_from_slice(src))
        },
        || {
            values
                .into_par_iter()
                .for_each(|(dst, src)| dst.copy_from_slice(src))
        },
    );
    out.len = end;
    for b in &parsed {
        for (m, &x) in out.cols.max.iter_mut().zip(&b.cols.max) {
            *m = (*m).max(x);
        }
        out.cols.integer_tokens &= b.cols.integer_tokens;
    }
    for mut block in parsed {
        block.cols.clear();
        spare.push(block.cols);
    }
    out.held
        .after_append(path, &mut out.cols, &mut out.len, opts)
}

/// Whether the lines of `parsed` continue the strictly increasing
/// coordinate order of the first `len` lines of `cols` (which are in that
/// order), within each block and across the blocks' ends.
fn continues_order(cols: &Columns, len: usize, parsed: &[ParsedBlock]) -> bool {
    let within = parsed.par_iter().all(|b| {
        let n = b.cols.nnz();
        coalesce::increasing_at(&b.cols.indices, 0..n)
    });
    let mut last: Option<(&[Vec<u32>], usize)> = (len > 0).then(|| (&cols.indices[..], len - 1));
    within
        && parsed.iter().filter(|b| b.cols.nnz() > 0).all(|b| {
            let before = match last {
                Some((idx, k)) => coalesce::compare(idx, k, &b.cols.indices, 0).is_lt(),
                None => true,
            };
            last = Some((&b.cols.indices[..], b.cols.nnz() - 1));
            before
        })
}

/// The columns of the lines not yet summed (every line, unless a round
/// summed them), sized ahead and filled in place, and what the rounds
/// hold.
#[derive(Default)]
pub(super) struct Output {
    /// Every column holds `room` entries, of which the first `len` are
    /// filled.
    cols: Columns,
    len: usize,
    room: usize,
    /// `MemAvailable` when the output was first sized (`None` inside: it
    /// cannot be read).
    budget: Option<Option<u64>>,
    held: Held,
}

impl Output {
    /// Makes room for `room` nonzeros. A new column is allocated zeroed,
    /// which for a large one costs nothing until its pages are filled (in
    /// parallel, by the copies into place); a column grown is zeroed in
    /// parallel.
    fn grow(&mut self, room: usize) {
        let has_values = self.cols.has_values;
        let values = has_values.then_some(&mut self.cols.values);
        for col in self.cols.indices.iter_mut() {
            grow_zeroed(col, room);
        }
        if let Some(v) = values {
            grow_zeroed(v, room);
        }
        self.room = room;
    }

    /// The tensor of the lines read, what the reader noticed, and the
    /// most lines the columns had room for (they never shrink).
    pub(super) fn into_tensor(
        self,
        path: &Path,
        opts: &ReadOptions,
    ) -> Result<(SparseTensor, ReadReport, usize)> {
        let room = self.room;
        let (t, report) = self.held.into_tensor(path, self.cols, self.len, opts)?;
        Ok((t, report, room))
    }
}

fn grow_zeroed<T: Copy + Default + Send + Sync>(v: &mut Vec<T>, len: usize) {
    if v.is_empty() {
        *v = vec![T::default(); len];
    } else if len > v.len() {
        let extra = len - v.len();
        v.reserve_exact(extra);
        v.par_extend(rayon::iter::repeat_n(T::default(), extra));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tns::read_tns_with;
    use crate::tns::test_util::{gzip, read, write_file};

    #[test]
    fn errors_in_later_blocks_have_global_line_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let mut text = String::from("# header\n");
        for i in 0..5000 {
            if i % 100 == 0 {
                text.push_str("# comment\n\n");
            }
            text.push_str(&format!("{} {} {}\n", i + 1, i % 31 + 1, i % 17 + 2));
        }
        let p = write_file(dir.path(), "ok.tns", text.as_bytes());
        let want = read(&p).unwrap();
        assert_eq!(want.nnz(), 5000);
        for block in [1, 7, 64, 1000, 4096] {
            assert_eq!(
                read_tns_with(&p, &ReadOptions::default(), Some(block)).unwrap(),
                want
            );
        }

        let lines: Vec<&str> = text.lines().collect();
        let total = lines.len();
        for bad_line in [total - 3, total / 2, 40] {
            let mut bad = lines.clone();
            bad[bad_line - 1] = "3 x 1.0";
            // A second error later must not win.
            bad[total - 1] = "1 1";
            let content = bad.join("\n");
            let p = write_file(dir.path(), "bad.tns", content.as_bytes());
            for block in [64, 1000, 1 << 20] {
                match read_tns_with(&p, &ReadOptions::default(), Some(block)).unwrap_err() {
                    FormatError::Parse { line, .. } => {
                        assert_eq!(line, bad_line as u64, "block {block}")
                    }
                    other => panic!("{other}"),
                }
            }
            let gz = write_file(dir.path(), "bad.tns.gz", &gzip(content.as_bytes()));
            match read_tns_with(&gz, &ReadOptions::default(), Some(64)).unwrap_err() {
                FormatError::Parse { line, .. } => assert_eq!(line, bad_line as u64),
                other => panic!("{other}"),
            }
        }
    }

    #[test]
    fn default_blocks_on_a_multi_mib_file() {
        // Several default-sized (>= 1 MiB) blocks, bad line near the end.
        let dir = tempfile::tempdir().unwrap();
        let n = 300_000;
        let mut text = String::with_capacity(n * 20);
        for i in 0..n {
            text.push_str(&format!("{} {} {}.25\n", i / 13 + 1, i % 13 + 1, i % 101));
        }
        let p = write_file(dir.path(), "ok.tns", text.as_bytes());
        let t = read(&p).unwrap();
        assert_eq!((t.nnz(), t.dims()), (n, &[23_077u32, 13][..]));
        let bad_line = n - 5;
        text.push_str("1 2\n");
        let mut lines: Vec<&str> = text.lines().collect();
        lines[bad_line - 1] = "1 2 3 4";
        let p = write_file(dir.path(), "bad.tns", lines.join("\n").as_bytes());
        match read(&p).unwrap_err() {
            FormatError::Parse { line, message, .. } => {
                assert_eq!(line, bad_line as u64);
                assert!(message.contains("expected 3 columns (as on line 1) but found 4"));
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn header_longer_than_a_block() {
        let dir = tempfile::tempdir().unwrap();
        let mut text: String = (0..200).map(|i| format!("# comment {i}\n")).collect();
        text.push_str("1 2 3.0\n2 1 x\n");
        let p = write_file(dir.path(), "h.tns", text.as_bytes());
        match read_tns_with(&p, &ReadOptions::default(), Some(32)).unwrap_err() {
            FormatError::Parse { line, message, .. } => {
                assert_eq!(line, 202);
                assert!(message.contains("`x`"), "{message}");
            }
            other => panic!("{other}"),
        }
    }
}
