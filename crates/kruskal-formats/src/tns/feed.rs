//! Where the text comes from: a plain file cut into byte ranges that the
//! parsing threads read themselves, or a gzip stream decompressed by one
//! reader thread into blocks cut at line ends. Either way the parser gets
//! blocks of whole lines, in file order.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender, channel, sync_channel};

use flate2::read::MultiGzDecoder;

use super::batch::{Output, parse_batches};
use super::{MAX_LINE, Tuning};
use crate::error::{FormatError, Result};
use crate::io::{ReadOptions, read_at};

/// Most bytes of decompressed text parsed as one unit of parallel work.
const MAX_BLOCK_SIZE: usize = 8 << 20;

/// Fewest bytes per unit of work; smaller blocks cost more than they share.
const MIN_BLOCK_SIZE: usize = 1 << 20;

/// Most bytes per unit of work of a plain file: its threads read their
/// blocks themselves, and a smaller block is still in the core's cache when
/// it is parsed.
const MAX_PLAIN_BLOCK: u64 = 2 << 20;

/// Fewest bytes per unit of work of a plain file, whose blocks may be cut
/// below [`MIN_BLOCK_SIZE`] so that every batch is full.
const MIN_PLAIN_BLOCK: u64 = 64 << 10;

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// The block size for a plain file: about four blocks per thread, 1-2 MiB
/// each, then cut so that the blocks fill whole batches (one block per
/// thread): a short last batch would leave most threads idle.
pub(super) fn plain_block_size(total: u64, threads: usize, batch: usize) -> u64 {
    let target = (total / (4 * threads as u64)).clamp(MIN_BLOCK_SIZE as u64, MAX_PLAIN_BLOCK);
    let blocks = total.div_ceil(target).next_multiple_of(batch as u64);
    total.div_ceil(blocks).max(MIN_PLAIN_BLOCK)
}

/// Reads a gzip-compressed file: one thread decompresses into blocks, which
/// are parsed in parallel batches.
pub(super) fn read_gzip(
    path: &Path,
    file: File,
    total: u64,
    tuning: Tuning,
    threads: usize,
    batch: usize,
    opts: &ReadOptions,
) -> Result<Output> {
    let consumed = Arc::new(AtomicU64::new(0));
    let counting = CountingReader {
        inner: file,
        count: Arc::clone(&consumed),
    };
    let source: Box<dyn Read + Send> = Box::new(MultiGzDecoder::new(BufReader::with_capacity(
        1 << 18,
        counting,
    )));
    // Give every thread about four blocks, so that smaller files are parsed
    // in parallel too and batches pipeline (gzip text is typically 3-5
    // times the file).
    let block_size = tuning
        .block_size
        .unwrap_or_else(|| {
            (total.saturating_mul(4) / (4 * threads as u64))
                .clamp(MIN_BLOCK_SIZE as u64, MAX_BLOCK_SIZE as u64) as usize
        })
        .max(1);
    let consumed: &AtomicU64 = &consumed;
    std::thread::scope(|scope| {
        // The channel holds one more batch, so reading overlaps parsing.
        let (tx, rx) = sync_channel(batch);
        let (free_tx, free_rx) = channel();
        let reader =
            scope.spawn(move || produce_blocks(path, source, block_size, consumed, tx, free_rx));
        let mut feed = Feed::Gzip {
            rx,
            free: free_tx,
            consumed,
            ended: false,
        };
        let result = parse_batches(path, &mut feed, batch, total, tuning.round_min_lines, opts);
        // With the receiver gone, the reader stops at its next send.
        drop(feed);
        match reader.join() {
            Ok(()) => result,
            Err(_) => Err(FormatError::file(path, "the reader thread failed")),
        }
    })
}

/// Counts the bytes read from the file on disk, for progress reports.
struct CountingReader {
    inner: File,
    count: Arc<AtomicU64>,
}

impl Read for CountingReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// What the gzip reader thread sends to the parser.
pub(super) enum Msg {
    Block(Block),
    /// A line longer than [`MAX_LINE`] starts right after the blocks sent.
    LineTooLong,
    /// Reading failed.
    Fail(FormatError),
}

/// Why reading stops after a block's text.
pub(super) enum Stop {
    /// The next line is longer than [`MAX_LINE`].
    LineTooLong,
    /// Reading failed.
    Fail(FormatError),
}

impl Stop {
    /// The error, for a stop after global line `line - 1`.
    pub(super) fn into_error(self, path: &Path, line: u64) -> FormatError {
        match self {
            Stop::LineTooLong => FormatError::parse(
                path,
                line,
                format!(
                    "line longer than {} MiB: this is not a .tns text file",
                    MAX_LINE >> 20
                ),
            ),
            Stop::Fail(e) => e,
        }
    }
}

/// Whole lines of text (the last block of the file may lack a final
/// newline). The buffer goes back to its reader for reuse.
pub(super) struct Block {
    pub(super) buf: Vec<u8>,
    /// The text is `buf[start..end]`.
    start: usize,
    end: usize,
    /// How far into the file on disk reading has got with this block.
    file_pos: u64,
    /// Set when reading stops after this block's text.
    pub(super) stop: Option<Stop>,
}

impl Block {
    pub(super) fn text(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// A block of no text after which reading stops.
    fn stopped(stop: Stop, file_pos: u64) -> Block {
        Block {
            buf: Vec::new(),
            start: 0,
            end: 0,
            file_pos,
            stop: Some(stop),
        }
    }
}

/// A plain text file cut into byte ranges of `block` bytes, read in
/// parallel with positional reads.
///
/// Range `k` is `[k * block, (k + 1) * block)`, and its block is the lines
/// that start in it: from the first line start in the range (byte 0, or
/// after a newline at or after the byte before the range) to the end of
/// the line holding the range's last byte. So every line is in exactly one
/// block, whatever the block size.
pub(super) struct PlainFile<'a> {
    pub(super) path: &'a Path,
    pub(super) file: File,
    pub(super) total: u64,
    pub(super) block: u64,
}

impl PlainFile<'_> {
    fn blocks(&self) -> u64 {
        self.total.div_ceil(self.block)
    }

    /// The end of range `index` in the file.
    fn range_end(&self, index: u64) -> u64 {
        index
            .saturating_add(1)
            .saturating_mul(self.block)
            .min(self.total)
    }

    /// Reads block `index` into `buf`.
    fn load(&self, index: u64, mut buf: Vec<u8>) -> Block {
        let file_pos = self.range_end(index);
        match self.load_into(index, &mut buf) {
            Ok((start, end, too_long)) => Block {
                buf,
                start,
                end,
                file_pos,
                stop: too_long.then_some(Stop::LineTooLong),
            },
            Err(e) => {
                let mut block = Block::stopped(Stop::Fail(FormatError::io(self.path, e)), file_pos);
                block.buf = buf;
                block
            }
        }
    }

    /// Reads block `index` into `buf`; returns where its text is in `buf`,
    /// and whether a line longer than [`MAX_LINE`] follows that text.
    fn load_into(&self, index: u64, buf: &mut Vec<u8>) -> std::io::Result<(usize, usize, bool)> {
        let start_pos = index.saturating_mul(self.block);
        let end_pos = self.range_end(index);
        // The buffer starts at `lo`: the byte before the range (which says
        // whether a line starts at the range's first byte), or the file's
        // start. It holds the range and a little past it, usually enough
        // to finish the last line.
        let lo = start_pos.saturating_sub(1);
        let extra = self.block.clamp(64, 16 << 10);
        let mut hi = end_pos.saturating_add(extra).min(self.total);
        self.read(buf, 0, lo, hi)?;
        // Buffer index of the range's last byte; every offset in the buffer
        // is below `MAX_LINE` plus two blocks, so it fits in usize.
        let last_byte = (end_pos - 1 - lo) as usize;
        let start = if start_pos == 0 {
            if buf[..(hi - lo) as usize].starts_with(UTF8_BOM) {
                UTF8_BOM.len()
            } else {
                0
            }
        } else {
            match buf[..last_byte].iter().position(|&c| c == b'\n') {
                Some(p) => p + 1,
                // No line starts in this range.
                None => return Ok((0, 0, false)),
            }
        };
        // The last line that starts in the range.
        let last_line = buf[..last_byte]
            .iter()
            .rposition(|&c| c == b'\n')
            .map_or(start, |p| (p + 1).max(start));
        let mut from = last_byte;
        loop {
            let len = (hi - lo) as usize;
            if let Some(p) = buf[from..len].iter().position(|&c| c == b'\n') {
                let newline = from + p;
                return Ok(if newline - last_line > MAX_LINE {
                    (start, last_line, true)
                } else {
                    (start, newline + 1, false)
                });
            }
            if len - last_line > MAX_LINE {
                return Ok((start, last_line, true));
            }
            if hi == self.total {
                // The last line of the file, without a newline.
                return Ok((start, len, false));
            }
            // Read on, doubling, up to the first byte past the longest line.
            from = len;
            let limit = lo + (last_line + MAX_LINE + 1) as u64;
            let grow = ((len - last_line) as u64).max(extra);
            let next = hi.saturating_add(grow).min(limit).min(self.total);
            self.read(buf, len, hi, next)?;
            hi = next;
        }
    }

    /// Reads the file's bytes `[from, to)` into `buf[at..]`, growing `buf`
    /// as needed (buffers are reused at their full length, so only growth
    /// is zero-filled).
    fn read(&self, buf: &mut Vec<u8>, at: usize, from: u64, to: u64) -> std::io::Result<()> {
        let end = at + (to - from) as usize;
        if buf.is_empty() {
            // Zeroed allocation: pages are mapped as the read fills them.
            *buf = vec![0; end];
        } else if buf.len() < end {
            buf.resize(end, 0);
        }
        read_at(self.path, &self.file, &mut buf[at..end], from)
    }
}

/// One unit of parallel work: a block to read, or one already read.
pub(super) enum Job<'a> {
    Ready(Block),
    Range {
        file: &'a PlainFile<'a>,
        index: u64,
        buf: Vec<u8>,
    },
}

impl Job<'_> {
    pub(super) fn load(self) -> Block {
        match self {
            Job::Ready(block) => block,
            Job::Range { file, index, buf } => file.load(index, buf),
        }
    }

    /// How far into the file on disk reading has got once this is read.
    pub(super) fn file_pos(&self) -> u64 {
        match self {
            Job::Ready(block) => block.file_pos,
            Job::Range { file, index, .. } => file.range_end(*index),
        }
    }
}

/// Where the blocks come from.
pub(super) enum Feed<'a> {
    /// Ranges of a plain file, read by the parsing threads.
    Plain {
        file: &'a PlainFile<'a>,
        /// The next range to hand out.
        next: u64,
        /// Buffers to reuse.
        bufs: Vec<Vec<u8>>,
    },
    /// Blocks from the gzip reader thread.
    Gzip {
        rx: Receiver<Msg>,
        /// Buffers back to the reader thread, for reuse.
        free: Sender<Vec<u8>>,
        consumed: &'a AtomicU64,
        ended: bool,
    },
}

impl<'a> Feed<'a> {
    /// Up to `n` jobs in file order; none at the end.
    pub(super) fn next_jobs(&mut self, n: usize) -> Vec<Job<'a>> {
        match self {
            Feed::Plain { file, next, bufs } => {
                let file: &'a PlainFile<'a> = file;
                let end = next.saturating_add(n as u64).min(file.blocks());
                let jobs = (*next..end)
                    .map(|index| Job::Range {
                        file,
                        index,
                        buf: bufs.pop().unwrap_or_default(),
                    })
                    .collect();
                *next = end;
                jobs
            }
            Feed::Gzip {
                rx,
                consumed,
                ended,
                ..
            } => {
                let mut jobs = Vec::with_capacity(n);
                while !*ended && jobs.len() < n {
                    let stop = match rx.recv() {
                        Ok(Msg::Block(b)) => {
                            jobs.push(Job::Ready(b));
                            continue;
                        }
                        Ok(Msg::LineTooLong) => Some(Stop::LineTooLong),
                        Ok(Msg::Fail(e)) => Some(Stop::Fail(e)),
                        Err(_) => None,
                    };
                    if let Some(stop) = stop {
                        let pos = consumed.load(Ordering::Relaxed);
                        jobs.push(Job::Ready(Block::stopped(stop, pos)));
                    }
                    *ended = true;
                }
                jobs
            }
        }
    }

    /// Takes back a block's buffer for reuse.
    pub(super) fn recycle(&mut self, buf: Vec<u8>) {
        match self {
            Feed::Plain { bufs, .. } => bufs.push(buf),
            // The reader may have stopped; then the buffer is just dropped.
            Feed::Gzip { free, .. } => {
                let _ = free.send(buf);
            }
        }
    }
}

/// Reads from `source` until `buf[start..start + want]` is full or the input
/// ends; returns the end of the data. Buffers are reused at their full
/// length, so only growth is zero-filled.
fn fill(
    source: &mut dyn Read,
    buf: &mut Vec<u8>,
    start: usize,
    want: usize,
) -> std::io::Result<usize> {
    let end = start + want;
    if buf.len() < end {
        buf.resize(end, 0);
    }
    let mut filled = start;
    while filled < end {
        match source.read(&mut buf[filled..end]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Reads decompressed text from `source` into blocks of at least
/// `block_size` bytes (unless the text ends) cut after a newline, and sends
/// them in order, taking buffers back from `free`. Stops when the receiver
/// hangs up.
fn produce_blocks(
    path: &Path,
    mut source: Box<dyn Read + Send>,
    block_size: usize,
    consumed: &AtomicU64,
    tx: SyncSender<Msg>,
    free: Receiver<Vec<u8>>,
) {
    // The unfinished line at the end of the previous block.
    let mut carry: Vec<u8> = Vec::new();
    let mut first = true;
    loop {
        let mut buf = free.try_recv().unwrap_or_default();
        let start = carry.len();
        if buf.len() < start {
            buf.resize(start, 0);
        }
        buf[..start].copy_from_slice(&carry);
        carry.clear();
        // Normally fill up to one block; while inside a line longer than a
        // block, grow by a whole block per read.
        let want = if start < block_size {
            block_size - start
        } else {
            block_size
        };
        let mut len = match fill(&mut source, &mut buf, start, want) {
            Ok(end) => end,
            Err(e) => {
                let err = FormatError::file(
                    path,
                    format!("the gzip stream is truncated or corrupt: {e}"),
                );
                let _ = tx.send(Msg::Fail(err));
                return;
            }
        };
        let eof = len < start + want;
        if first {
            first = false;
            if buf[..len].starts_with(UTF8_BOM) {
                buf.copy_within(UTF8_BOM.len()..len, 0);
                len -= UTF8_BOM.len();
            }
        }
        if !eof {
            match buf[..len].iter().rposition(|&b| b == b'\n') {
                Some(p) => {
                    carry.extend_from_slice(&buf[p + 1..len]);
                    len = p + 1;
                }
                None => {
                    // No line end yet: keep reading into the same line.
                    if len > MAX_LINE {
                        let _ = tx.send(Msg::LineTooLong);
                        return;
                    }
                    carry.extend_from_slice(&buf[..len]);
                    continue;
                }
            }
        }
        let block = Block {
            buf,
            start: 0,
            end: len,
            file_pos: consumed.load(Ordering::Relaxed),
            stop: None,
        };
        if len > 0 && tx.send(Msg::Block(block)).is_err() {
            return;
        }
        if eof {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::coo::SparseTensor;
    use crate::tns::test_util::{data_dir, file_err, gzip, read, write_file};
    use crate::tns::{MAX_BATCH, read_tns_with};

    #[test]
    fn gzip_reads_and_progress_reaches_the_end() {
        let data = data_dir();
        let gz = data.join("splatt-med4.tns.gz");
        let mut text = Vec::new();
        MultiGzDecoder::new(File::open(&gz).unwrap())
            .read_to_end(&mut text)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let plain = write_file(dir.path(), "m.tns", &text);
        let want = read(&plain).unwrap();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&calls);
        let opts = ReadOptions {
            progress: Some(Arc::new(move |d, t| sink.lock().unwrap().push((d, t)))),
            ..ReadOptions::default()
        };
        assert_eq!(read_tns_with(&gz, &opts, Some(1 << 16)).unwrap(), want);
        let size = std::fs::metadata(&gz).unwrap().len();
        let calls = calls.lock().unwrap();
        assert!(calls.len() >= 2, "{calls:?}");
        assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0));
        assert!(calls.iter().all(|&(d, t)| t == size && d <= size));
        assert_eq!(*calls.last().unwrap(), (size, size));
    }

    #[test]
    fn multi_member_gzip() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = gzip(b"1 1 1.0\n2 2 2.0\n");
        bytes.extend(gzip(b"3 3 3.0\n"));
        let p = write_file(dir.path(), "m.tns.gz", &bytes);
        assert_eq!(read(&p).unwrap().values(), &[1.0, 2.0, 3.0]);
    }

    #[test]
    fn truncated_or_corrupt_gzip_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let text: String = (1..=20_000)
            .map(|i| format!("{} {} {}.5\n", i, i % 7 + 1, i))
            .collect();
        let gz = gzip(text.as_bytes());
        for cut in [gz.len() / 2, gz.len() - 4, gz.len() - 1, 12] {
            let p = write_file(dir.path(), "cut.tns.gz", &gz[..cut]);
            let err = file_err(&p, &ReadOptions::default());
            assert!(
                err.contains("gzip stream is truncated or corrupt"),
                "cut {cut}: {err}"
            );
        }
        let mut bad = gz.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0x55;
        let p = write_file(dir.path(), "bad.tns.gz", &bad);
        // Either the deflate data or the trailer's CRC catches it.
        let err = read(&p).unwrap_err().to_string();
        assert!(err.contains("gzip") || err.contains("bad.tns.gz"), "{err}");
    }

    /// The read with every block size from 1 to 64 bytes (and a few more),
    /// on 1 to 3 threads, against a read in one block: same tensor, or the
    /// same error.
    fn check_every_block_size(
        p: &Path,
        opts: &ReadOptions,
    ) -> std::result::Result<SparseTensor, String> {
        let want = read_tns_with(p, opts, Some(1 << 20)).map_err(|e| e.to_string());
        for threads in 1..=3 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                for block in (1..=64).chain([65, 97, 128, 1000]) {
                    let got = read_tns_with(p, opts, Some(block)).map_err(|e| e.to_string());
                    assert_eq!(got, want, "block size {block}, {threads} threads");
                }
            });
        }
        want
    }

    /// Comments, blank lines, CRLF, tabs, trailing blanks, a BOM, and no
    /// final newline.
    const AWKWARD: &str = "\u{feff}# header\r\n\r\n  # indented\n1 1 4\r\n2\t3   -1.5e-3\n\
                           \t  3 2 4.000000  \n\n# mid\r\n1 2 +.5\r\n2 1 7.\n\
                           10 20 3\n\r\n3 3 1E2";

    #[test]
    fn every_block_size_reads_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let p = write_file(dir.path(), "a.tns", AWKWARD.as_bytes());
        let t = check_every_block_size(&p, &ReadOptions::default()).unwrap();
        assert_eq!(t.mode_indices(0), &[0, 1, 2, 0, 1, 9, 2]);
        assert_eq!(t.values(), &[4.0, -1.5e-3, 4.0, 0.5, 7.0, 3.0, 100.0]);

        // With a final newline, with LF only, without the BOM, and with a
        // BOM before a data line.
        for text in [
            format!("{AWKWARD}\n"),
            format!("{AWKWARD}\r\n"),
            AWKWARD.replace("\r\n", "\n"),
            AWKWARD.trim_start_matches('\u{feff}').to_string(),
            "\u{feff}1 1 1.5\n2 2 2.5".to_string(),
            "\u{feff}1 1 1.5".to_string(),
            "1 1 1.5".to_string(),
            "1 1 1.5\n".to_string(),
        ] {
            let p = write_file(dir.path(), "b.tns", text.as_bytes());
            assert!(
                check_every_block_size(&p, &ReadOptions::default()).is_ok(),
                "{text:?}"
            );
        }

        // Pattern reads.
        let p = write_file(dir.path(), "p.tns", b"# x\n1 2\r\n\n3 4\n5 6");
        let opts = ReadOptions {
            pattern: true,
            ..ReadOptions::default()
        };
        let t = check_every_block_size(&p, &opts).unwrap();
        assert_eq!(t.mode_indices(1), &[1, 3, 5]);
    }

    #[test]
    fn every_block_size_reports_the_same_error() {
        let dir = tempfile::tempdir().unwrap();
        let lines: Vec<&str> = AWKWARD.split('\n').collect();
        let mut cases = Vec::new();
        // A bad line at each place, and a second bad line after it that
        // must not win.
        for bad in 0..lines.len() {
            let mut l = lines.clone();
            l[bad] = "1 x 1\r";
            let mut text = l.join("\n");
            text.push_str("\n1 2 3 4\n");
            cases.push((text, bad as u64 + 1));
        }
        // A bad last line without a newline, and a short last line.
        cases.push((format!("{AWKWARD}\n1 1 z"), lines.len() as u64 + 1));
        cases.push((format!("{AWKWARD}\n1 1"), lines.len() as u64 + 1));
        // The first data line is bad (the layout comes from it).
        cases.push(("# c\n\n7\n1 1 1\n".to_string(), 3));
        for (text, line) in cases {
            let p = write_file(dir.path(), "bad.tns", text.as_bytes());
            let err = check_every_block_size(&p, &ReadOptions::default()).unwrap_err();
            assert!(
                err.contains(&format!("bad.tns:{line}: ")),
                "{text:?}: {err}"
            );
        }
    }

    #[test]
    fn tiny_and_blank_files() {
        let dir = tempfile::tempdir().unwrap();
        for text in [
            &b"\n"[..],
            b"\r\n",
            b" ",
            b"#",
            b"# x\n\n",
            b"\xEF\xBB\xBF",
            b"\xEF\xBB\xBF\n",
        ] {
            let p = write_file(dir.path(), "blank.tns", text);
            let err = check_every_block_size(&p, &ReadOptions::default()).unwrap_err();
            assert!(err.contains("no nonzeros"), "{text:?}: {err}");
        }
        // A BOM is only skipped at the start of the file.
        let p = write_file(dir.path(), "bom.tns", b"1 1 1\n\xEF\xBB\xBF2 2 2\n");
        let err = check_every_block_size(&p, &ReadOptions::default()).unwrap_err();
        assert!(err.contains("bom.tns:2: "), "{err}");
        let p = write_file(dir.path(), "one.tns", b"1 2 3");
        let t = check_every_block_size(&p, &ReadOptions::default()).unwrap();
        assert_eq!((t.dims(), t.values()), (&[1u32, 2][..], &[3.0f32][..]));
    }

    #[test]
    fn plain_progress_reaches_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let text: String = (1..=2000)
            .map(|i| format!("{i} {} 1.5\n", i % 7 + 1))
            .collect();
        let p = write_file(dir.path(), "p.tns", text.as_bytes());
        let calls = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&calls);
        let opts = ReadOptions {
            progress: Some(Arc::new(move |d, t| sink.lock().unwrap().push((d, t)))),
            ..ReadOptions::default()
        };
        assert_eq!(read_tns_with(&p, &opts, Some(1000)).unwrap().nnz(), 2000);
        let size = text.len() as u64;
        let calls = calls.lock().unwrap();
        assert!(calls.len() >= 2, "{calls:?}");
        assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0));
        assert!(calls.iter().all(|&(d, t)| t == size && d <= size));
        assert_eq!(*calls.last().unwrap(), (size, size));
    }

    #[test]
    fn plain_block_sizes_fill_batches() {
        for threads in [1, 2, 3, 4, 16, 64] {
            let batch = threads.clamp(1, MAX_BATCH);
            for total in [1u64, 1000, 5 << 20, 100 << 20, 527_000_000, 10 << 30] {
                let block = plain_block_size(total, threads, batch);
                assert!(
                    (MIN_PLAIN_BLOCK..=MAX_PLAIN_BLOCK).contains(&block),
                    "{total} {threads}: {block}"
                );
                let blocks = total.div_ceil(block);
                if total >= (MIN_PLAIN_BLOCK + 1) * batch as u64 {
                    assert_eq!(blocks % batch as u64, 0, "{total} {threads}: {block}");
                }
            }
        }
    }

    #[test]
    fn lines_longer_than_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let long = |n: usize, end: &str| {
            let mut v = b"# c\n1 1 1.0\n".to_vec();
            v.resize(v.len() + n, b'7');
            v.extend_from_slice(end.as_bytes());
            v
        };
        let too_long = format!("line longer than {} MiB", MAX_LINE >> 20);
        // Too long, with or without a line after it; as the first line;
        // and the last line without a newline.
        let mut first = vec![b'1'; MAX_LINE + 1];
        first.extend_from_slice(b"\n1 1 1\n");
        for (name, text, line) in [
            ("a.tns", long(MAX_LINE + 1, "\n1 1 1.0\n"), 3),
            ("b.tns", long(MAX_LINE + 1, ""), 3),
            ("c.tns", first, 1),
        ] {
            let p = write_file(dir.path(), name, &text);
            for block in [None, Some(1000), Some(MAX_LINE), Some(usize::MAX)] {
                match read_tns_with(&p, &ReadOptions::default(), block).unwrap_err() {
                    FormatError::Parse {
                        line: l, message, ..
                    } => {
                        assert_eq!(l, line, "{name} {block:?}");
                        assert!(message.contains(&too_long), "{message}");
                    }
                    other => panic!("{other}"),
                }
            }
            std::fs::remove_file(&p).unwrap();
        }
        // The longest line is read (and is not an index).
        let p = write_file(dir.path(), "d.tns", &long(MAX_LINE, "\n"));
        for block in [None, Some(1000)] {
            let err = read_tns_with(&p, &ReadOptions::default(), block)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(":3: expected 3 columns (as on line 2) but found 1"),
                "{err}"
            );
        }
    }
}
