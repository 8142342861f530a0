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
//! small one, and a value written `6.0` is never an index.
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
//! plus about three batches of blocks, whose buffers are reused. Plain files
//! are read with ordinary reads rather than a memory map: a mapped file that
//! another process truncates faults the reader (and mapping needs `unsafe`),
//! while the copy costs little next to parsing.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender, channel, sync_channel};

use flate2::Compression;
use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use rayon::prelude::*;

use crate::coo::SparseTensor;
use crate::error::{FormatError, Result};
use crate::io::{FileKind, ReadOptions, ReadReport, read_at, write_atomically};

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

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

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
    let kind = FileKind::sniff(path)?;
    if kind == FileKind::Binary {
        return Err(FormatError::file(
            path,
            "this is a kruskal binary tensor (.ktns), not text; read it with read_tensor",
        ));
    }
    let file = File::open(path).map_err(|e| FormatError::io(path, e))?;
    let total = file.metadata().map_err(|e| FormatError::io(path, e))?.len();
    if total == 0 {
        return Err(FormatError::file(path, "the file is empty: no nonzeros"));
    }
    let threads = rayon::current_num_threads().max(1);
    let batch = threads.clamp(1, MAX_BATCH);
    let columns = if kind == FileKind::TnsGz {
        read_gzip(path, file, total, block_size, threads, batch, opts)?
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
        parse_batches(path, &mut feed, batch, total, opts)?
    };
    opts.report(total, total);
    columns.into_tensor(path, opts)
}

/// The block size for a plain file: about four blocks per thread, 1-2 MiB
/// each, then cut so that the blocks fill whole batches (one block per
/// thread): a short last batch would leave most threads idle.
fn plain_block_size(total: u64, threads: usize, batch: usize) -> u64 {
    let target = (total / (4 * threads as u64)).clamp(MIN_BLOCK_SIZE as u64, MAX_PLAIN_BLOCK);
    let blocks = total.div_ceil(target).next_multiple_of(batch as u64);
    total.div_ceil(blocks).max(MIN_PLAIN_BLOCK)
}

/// Reads a gzip-compressed file: one thread decompresses into blocks, which
/// are parsed in parallel batches.
fn read_gzip(
    path: &Path,
    file: File,
    total: u64,
    block_size: Option<usize>,
    threads: usize,
    batch: usize,
    opts: &ReadOptions,
) -> Result<Columns> {
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
    let block_size = block_size
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
        let result = parse_batches(path, &mut feed, batch, total, opts);
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
enum Msg {
    Block(Block),
    /// A line longer than [`MAX_LINE`] starts right after the blocks sent.
    LineTooLong,
    /// Reading failed.
    Fail(FormatError),
}

/// Why reading stops after a block's text.
enum Stop {
    /// The next line is longer than [`MAX_LINE`].
    LineTooLong,
    /// Reading failed.
    Fail(FormatError),
}

impl Stop {
    /// The error, for a stop after global line `line - 1`.
    fn into_error(self, path: &Path, line: u64) -> FormatError {
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
struct Block {
    buf: Vec<u8>,
    /// The text is `buf[start..end]`.
    start: usize,
    end: usize,
    /// How far into the file on disk reading has got with this block.
    file_pos: u64,
    /// Set when reading stops after this block's text.
    stop: Option<Stop>,
}

impl Block {
    fn text(&self) -> &[u8] {
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
struct PlainFile<'a> {
    path: &'a Path,
    file: File,
    total: u64,
    block: u64,
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
enum Job<'a> {
    Ready(Block),
    Range {
        file: &'a PlainFile<'a>,
        index: u64,
        buf: Vec<u8>,
    },
}

impl Job<'_> {
    fn load(self) -> Block {
        match self {
            Job::Ready(block) => block,
            Job::Range { file, index, buf } => file.load(index, buf),
        }
    }

    /// How far into the file on disk reading has got once this is read.
    fn file_pos(&self) -> u64 {
        match self {
            Job::Ready(block) => block.file_pos,
            Job::Range { file, index, .. } => file.range_end(*index),
        }
    }
}

/// Where the blocks come from.
enum Feed<'a> {
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
    fn next_jobs(&mut self, n: usize) -> Vec<Job<'a>> {
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
    fn recycle(&mut self, buf: Vec<u8>) {
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

/// Parsing parameters fixed by the first data line.
struct Layout<'a> {
    /// Columns per line.
    ncols: usize,
    /// Index columns per line (`ncols`, or `ncols - 1` with a value column).
    nmodes: usize,
    zero_based: bool,
    dims: Option<&'a [u32]>,
    /// Global line number of the first data line, quoted in messages.
    first_line: u64,
}

/// The parsed nonzeros of one block, or of the whole file.
#[derive(Default)]
struct Columns {
    /// 0-based indices, one vector per mode.
    indices: Vec<Vec<u32>>,
    /// Values; empty for a pattern read.
    values: Vec<f32>,
    /// Largest index per mode.
    max: Vec<u32>,
    /// False for a pattern read.
    has_values: bool,
    /// Every value token so far was written as a plain integer (digits
    /// only), as the last column of a pattern file is.
    integer_tokens: bool,
}

impl Columns {
    fn with_capacity(nmodes: usize, pattern: bool, cap: usize) -> Columns {
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

    fn nnz(&self) -> usize {
        self.indices.first().map_or(0, Vec::len)
    }

    /// Empties the columns for reuse, keeping their capacity.
    fn clear(&mut self) {
        self.indices.iter_mut().for_each(Vec::clear);
        self.values.clear();
        self.max.iter_mut().for_each(|m| *m = 0);
        self.integer_tokens = true;
    }

    /// Reserves room for `additional` more nonzeros (values only when the
    /// columns hold values).
    fn reserve(&mut self, additional: usize) {
        for col in &mut self.indices {
            col.reserve(additional);
        }
        if self.has_values {
            self.values.reserve(additional);
        }
    }

    fn into_tensor(self, path: &Path, opts: &ReadOptions) -> Result<(SparseTensor, ReadReport)> {
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
        let start = std::time::Instant::now();
        let (t, merged) = SparseTensor::new_with_merged(dims, self.indices, values)
            .map_err(|e| FormatError::file(path, e.to_string()))?;
        report.merged = merged;
        report.coalesce_s = start.elapsed().as_secs_f64();
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

/// Parses the blocks of `feed` in parallel batches and concatenates their
/// columns in file order.
fn parse_batches(
    path: &Path,
    feed: &mut Feed,
    batch: usize,
    total: u64,
    opts: &ReadOptions,
) -> Result<Columns> {
    let mut out = Output::default();
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
                append_batch(path, &mut out, p, pos, total, &mut lines_before, &mut spare)?;
            }
            return Ok(out.finish());
        };

        if layout.is_none() {
            // Read the batch first, to find the first data line in it.
            // Nothing was parsed yet, so `lines_before` is exact here.
            let mut blocks: Vec<Block> = jobs.into_par_iter().map(Job::load).collect();
            let mut line = lines_before;
            for b in &mut blocks {
                if let Some((local, ncols)) = first_data_line(b.text()) {
                    layout = Some(make_layout(path, ncols, line + local, opts)?);
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
                        append_batch(path, &mut out, p, pos, total, &mut lines_before, &mut spare)?;
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
                path,
                &mut out,
                parsed,
                reach,
                total,
                &mut lines_before,
                &mut spare,
            )?;
        } else {
            pending = Some((parsed, reach));
        }
    }
}

/// Appends a parsed batch to `out` in file order, or returns the first bad
/// line in it with its global line number (or the stop after it).
fn append_batch(
    path: &Path,
    out: &mut Output,
    mut parsed: Vec<ParsedBlock>,
    file_pos: u64,
    total: u64,
    lines_before: &mut u64,
    spare: &mut Vec<Columns>,
) -> Result<()> {
    for block in &mut parsed {
        if let Some((line, msg)) = block.error.take() {
            return Err(FormatError::parse(path, *lines_before + line, msg));
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
    if end > out.room {
        // Size the output from the density of nonzeros so far, so that it
        // is rarely regrown (and copied).
        let estimate = (end as f64 * total as f64 / file_pos.max(1) as f64 * 1.02) as usize;
        out.grow(estimate.max(end));
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
    Ok(())
}

/// The columns of the whole file, sized ahead and filled in place.
#[derive(Default)]
struct Output {
    /// Every column holds `room` entries, of which the first `len` are
    /// filled.
    cols: Columns,
    len: usize,
    room: usize,
}

impl Output {
    /// Makes room for `room` nonzeros. A new column is allocated zeroed,
    /// which for a large one costs nothing until its pages are filled (in
    /// parallel, by the copies into place).
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

    /// The filled columns.
    fn finish(mut self) -> Columns {
        for col in &mut self.cols.indices {
            col.truncate(self.len);
            col.shrink_to_fit();
        }
        self.cols.values.truncate(self.len);
        self.cols.values.shrink_to_fit();
        self.cols
    }
}

fn grow_zeroed<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
    if v.is_empty() {
        *v = vec![T::default(); len];
    } else {
        v.resize(len, T::default());
    }
}

/// Checks the first data line's shape against the options.
fn make_layout<'a>(
    path: &Path,
    ncols: usize,
    line: u64,
    opts: &'a ReadOptions,
) -> Result<Layout<'a>> {
    if !opts.pattern && ncols < 2 {
        return Err(FormatError::parse(
            path,
            line,
            "found 1 column, but a line needs at least one index and a value (use --pattern if \
             the file lists only indices)",
        ));
    }
    let nmodes = if opts.pattern { ncols } else { ncols - 1 };
    if let Some(dims) = &opts.dims {
        if dims.len() != nmodes {
            return Err(FormatError::parse(
                path,
                line,
                format!(
                    "the line has {nmodes} indices but {} dimensions were given",
                    dims.len()
                ),
            ));
        }
    }
    Ok(Layout {
        ncols,
        nmodes,
        zero_based: opts.zero_based,
        dims: opts.dims.as_deref(),
        first_line: line,
    })
}

#[inline]
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\r' | 0x0b | 0x0c)
}

#[inline]
fn is_delim(b: u8) -> bool {
    is_space(b) || b == b'\n'
}

/// Lines in a block: its newlines, plus a final line without one.
fn count_lines(b: &[u8]) -> u64 {
    let newlines = b.iter().filter(|&&c| c == b'\n').count() as u64;
    newlines + u64::from(b.last().is_some_and(|&c| c != b'\n'))
}

/// End (exclusive, at the newline or the end of the block) of the line that
/// contains `pos`.
fn line_end(b: &[u8], pos: usize) -> usize {
    b[pos..]
        .iter()
        .position(|&c| c == b'\n')
        .map_or(b.len(), |p| pos + p)
}

fn count_tokens(line: &[u8]) -> usize {
    line.split(|&c| is_delim(c))
        .filter(|t| !t.is_empty())
        .count()
}

/// The 1-based line number (within the block) and column count of the first
/// line that is neither blank nor a comment.
fn first_data_line(b: &[u8]) -> Option<(u64, usize)> {
    let mut pos = 0;
    let mut line = 0;
    while pos < b.len() {
        line += 1;
        let end = line_end(b, pos);
        let text = &b[pos..end];
        match text.iter().position(|&c| !is_space(c)) {
            Some(p) if text[p] != b'#' => return Some((line, count_tokens(text))),
            _ => {}
        }
        pos = end + 1;
    }
    None
}

/// One parsed block.
struct ParsedBlock {
    cols: Columns,
    /// Lines in the block (up to the error, if any).
    lines: u64,
    /// The first bad line, numbered from 1 within the block, and why.
    error: Option<(u64, String)>,
    /// Set when reading stopped after the block's text.
    stop: Option<Stop>,
    /// The block's buffer, until it goes back for reuse.
    buf: Vec<u8>,
}

/// Parses block `b` into `cols` (empty, perhaps with capacity from an
/// earlier block).
fn parse_block(b: &[u8], layout: &Layout, mut cols: Columns) -> ParsedBlock {
    // A valid line has at least two bytes per column, which bounds the
    // capacity even when the newline count says otherwise.
    let newlines = b.iter().filter(|&&c| c == b'\n').count() + 1;
    let cap = newlines.min(b.len() / (2 * layout.ncols) + 1);
    cols.reserve(cap);
    let mut pos = 0;
    let mut line = 0;
    while pos < b.len() {
        line += 1;
        let start = pos;
        if let Err(msg) = parse_line(b, &mut pos, layout, &mut cols) {
            let text = &b[start..line_end(b, start)];
            // A wrong column count explains a bad token better than the
            // token itself (a missing value makes an index out of a value).
            let found = count_tokens(text);
            let msg = match not_text(text) {
                Some(why) => why.to_string(),
                None if found != layout.ncols => column_count_message(found, layout),
                None => msg,
            };
            return ParsedBlock {
                cols,
                lines: line,
                error: Some((line, msg)),
                stop: None,
                buf: Vec::new(),
            };
        }
    }
    ParsedBlock {
        cols,
        lines: line,
        error: None,
        stop: None,
        buf: Vec::new(),
    }
}

/// Why a line that failed to parse is not text at all, if it is not.
fn not_text(line: &[u8]) -> Option<&'static str> {
    if line.contains(&0) {
        Some("the line contains a NUL byte: this is not a text .tns file")
    } else if std::str::from_utf8(line).is_err() {
        Some("the line is not valid UTF-8: this is not a text .tns file")
    } else {
        None
    }
}

/// A token for an error message: lossy UTF-8, shortened.
fn show(tok: &[u8]) -> String {
    const MAX: usize = 40;
    let s = String::from_utf8_lossy(&tok[..tok.len().min(MAX)]);
    if tok.len() > MAX {
        format!("{s}...")
    } else {
        s.into_owned()
    }
}

fn column_count_message(found: usize, layout: &Layout) -> String {
    let mut msg = format!(
        "expected {} columns (as on line {}) but found {found}",
        layout.ncols, layout.first_line
    );
    if found + 1 == layout.ncols && layout.nmodes < layout.ncols {
        msg.push_str("; the value may be missing on this line");
    }
    msg
}

/// Parses the line at `*pos`, appending its nonzero (if it is a data line)
/// to `cols`, and moves `*pos` past the line's newline.
#[inline]
fn parse_line(
    b: &[u8],
    pos: &mut usize,
    layout: &Layout,
    cols: &mut Columns,
) -> std::result::Result<(), String> {
    let n = b.len();
    let mut p = *pos;
    while p < n && is_space(b[p]) {
        p += 1;
    }
    if p == n || b[p] == b'\n' || b[p] == b'#' {
        *pos = (line_end(b, p) + 1).min(n);
        return Ok(());
    }
    for c in 0..layout.ncols {
        while p < n && is_space(b[p]) {
            p += 1;
        }
        if p == n || b[p] == b'\n' {
            return Err(column_count_message(c, layout));
        }
        let start = p;
        if c < layout.nmodes {
            let mut v: u64 = 0;
            while p < n && b[p].is_ascii_digit() {
                v = v.saturating_mul(10).saturating_add(u64::from(b[p] - b'0'));
                p += 1;
            }
            if p == start || (p < n && !is_delim(b[p])) {
                let end = start
                    + b[start..]
                        .iter()
                        .position(|&x| is_delim(x))
                        .unwrap_or(n - start);
                return Err(bad_index(&b[start..end], c));
            }
            let idx = to_index(v, &b[start..p], c, layout)?;
            cols.indices[c].push(idx);
            if idx > cols.max[c] {
                cols.max[c] = idx;
            }
        } else {
            while p < n && !is_delim(b[p]) {
                p += 1;
            }
            let tok = &b[start..p];
            if cols.integer_tokens && !tok.iter().all(u8::is_ascii_digit) {
                cols.integer_tokens = false;
            }
            cols.values.push(parse_value(tok)?);
        }
    }
    while p < n && is_space(b[p]) {
        p += 1;
    }
    if p < n && b[p] != b'\n' {
        let end = line_end(b, p);
        let found = count_tokens(&b[*pos..end]);
        return Err(column_count_message(found, layout));
    }
    *pos = (p + 1).min(n);
    Ok(())
}

fn bad_index(tok: &[u8], col: usize) -> String {
    let col = col + 1;
    let digits = |t: &[u8]| !t.is_empty() && t.iter().all(u8::is_ascii_digit);
    if tok.first() == Some(&b'-') && digits(&tok[1..]) {
        format!("negative index {} in column {col}", show(tok))
    } else {
        format!(
            "column {col}: `{}` is not an index (a non-negative integer)",
            show(tok)
        )
    }
}

/// Converts a parsed index to 0-based and checks its range.
#[inline]
fn to_index(v: u64, tok: &[u8], col: usize, layout: &Layout) -> std::result::Result<u32, String> {
    let idx = if layout.zero_based {
        v
    } else if v == 0 {
        return Err(format!(
            "index 0 in column {}, but indices are 1-based; use --zero-based for files whose \
             indices start at 0",
            col + 1
        ));
    } else {
        v - 1
    };
    // Every dimension (largest index + 1) must fit in u32.
    if idx >= u64::from(u32::MAX) {
        let largest = u64::from(u32::MAX) - u64::from(layout.zero_based);
        return Err(format!(
            "index {} in column {} is too large: indices must fit in 32 bits (at most {largest})",
            show(tok),
            col + 1
        ));
    }
    let idx = idx as u32;
    if let Some(dims) = layout.dims {
        if idx >= dims[col] {
            return Err(format!(
                "index {} in column {} is beyond the given dimension {} of mode {}",
                show(tok),
                col + 1,
                dims[col],
                col + 1
            ));
        }
    }
    Ok(idx)
}

/// Powers of ten exactly representable in f32.
const POW10_F32: [f32; 11] = [1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10];

/// Powers of ten exactly representable in f64.
const POW10_F64: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
];

/// Parses a value: plain decimals with at most 17 digits take an exact fast
/// path (see [`fast_value`]); anything else goes to the standard parser.
#[inline]
fn parse_value(tok: &[u8]) -> std::result::Result<f32, String> {
    if let Some(v) = fast_value(tok) {
        return Ok(v);
    }
    let parsed = std::str::from_utf8(tok)
        .ok()
        .and_then(|s| s.parse::<f32>().ok());
    match parsed {
        Some(v) if v.is_finite() => Ok(v),
        Some(_) => Err(format!(
            "value `{}` is not a finite number (NaN and infinity are not allowed, and f32 \
             overflows beyond 3.4e38)",
            show(tok)
        )),
        None => Err(format!("value `{}` is not a number", show(tok))),
    }
}

#[inline]
fn fast_value(tok: &[u8]) -> Option<f32> {
    let (neg, digits) = match tok.first()? {
        b'-' => (true, &tok[1..]),
        b'+' => (false, &tok[1..]),
        _ => (false, tok),
    };
    if digits.is_empty() || digits.len() > 18 {
        return None;
    }
    let mut mantissa: u64 = 0;
    let mut frac: Option<usize> = None;
    let mut ndigits = 0;
    for &c in digits {
        if c.is_ascii_digit() {
            mantissa = mantissa * 10 + u64::from(c - b'0');
            ndigits += 1;
            if let Some(f) = &mut frac {
                *f += 1;
            }
        } else if c == b'.' && frac.is_none() {
            frac = Some(0);
        } else {
            return None;
        }
    }
    let frac = frac.unwrap_or(0);
    if ndigits == 0 {
        return None;
    }
    let v = if mantissa < 1 << 24 && frac < POW10_F32.len() {
        // Both are exact f32s: one correctly rounded f32 division.
        mantissa as f32 / POW10_F32[frac]
    } else if mantissa < 1 << 53 && frac < POW10_F64.len() {
        // Both are exact f64s, so `q` is the quotient correctly rounded to
        // f64. Every boundary between f32 roundings (a midpoint between
        // neighbouring f32s, 25 significant bits) is an f64, and rounding
        // is monotonic, so `q` and the exact quotient round to the same f32
        // unless `q` lies on a boundary: then the quotient may have been
        // just off it, and the standard parser decides. (`q` is 0 or
        // between 1e-22 and 2^53, normal as an f32, so the 29 low bits of
        // its significand are the ones rounding to f32 drops.)
        let q = mantissa as f64 / POW10_F64[frac];
        if q.to_bits() & ((1 << 29) - 1) == 1 << 28 {
            return None;
        }
        q as f32
    } else {
        return None;
    };
    Some(if neg { -v } else { v })
}

/// Nonzeros formatted per parallel work item when writing.
const WRITE_CHUNK: usize = 1 << 16;

/// Writes `t` as FROSTT text with 1-based indices, atomically (see
/// [`crate::io::write_tensor`]).
///
/// Values are printed in the shortest form that reads back as the same f32.
/// The text does not record dimensions: reading it back infers each as the
/// largest index plus one, unless [`ReadOptions::dims`] is given. A tensor
/// without nonzeros gives a file without data lines, which [`read_tns`]
/// refuses.
///
/// With `gzip`, the text is compressed (default level) in independent
/// chunks on all threads, each a gzip member of its own: a multi-member file
/// that `gzip -d`, zlib's `gzread` and this crate's reader all read as one
/// stream, written several times faster than one sequential stream.
pub fn write_tns(path: &Path, t: &SparseTensor, gzip: bool) -> Result<()> {
    write_atomically(path, |w| write_text(path, t, gzip, w))
}

fn write_text(path: &Path, t: &SparseTensor, gzip: bool, w: &mut dyn Write) -> Result<()> {
    let io = |e| FormatError::io(path, e);
    let nnz = t.nnz();
    if nnz == 0 && gzip {
        // An empty file is not valid gzip; write one empty member.
        return w.write_all(&compress(&[]).map_err(io)?).map_err(io);
    }
    let per_batch = WRITE_CHUNK * rayon::current_num_threads().clamp(1, MAX_BATCH);
    let mut start = 0;
    while start < nnz {
        let end = (start + per_batch).min(nnz);
        let pieces: Vec<std::io::Result<Vec<u8>>> = (start..end)
            .into_par_iter()
            .step_by(WRITE_CHUNK)
            .map(|s| {
                let text = format_range(t, s, (s + WRITE_CHUNK).min(end));
                if gzip { compress(&text) } else { Ok(text) }
            })
            .collect();
        for piece in pieces {
            w.write_all(&piece.map_err(io)?).map_err(io)?;
        }
        start = end;
    }
    Ok(())
}

/// One gzip member holding `text`.
fn compress(text: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut enc = GzEncoder::new(
        Vec::with_capacity(text.len() / 3 + 64),
        Compression::default(),
    );
    enc.write_all(text)?;
    enc.finish()
}

fn format_range(t: &SparseTensor, start: usize, end: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity((end - start) * (8 * t.nmodes() + 12));
    let mut digits = [0u8; 20];
    for k in start..end {
        for idx in t.indices() {
            out.extend_from_slice(format_u64(u64::from(idx[k]) + 1, &mut digits));
            out.push(b' ');
        }
        // Writing to a Vec cannot fail.
        let _ = write!(out, "{}", t.values()[k]);
        out.push(b'\n');
    }
    out
}

fn format_u64(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return &buf[i..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::path::PathBuf;
    use std::sync::Mutex;

    fn write_file(dir: &Path, name: &str, content: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, content).unwrap();
        p
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut enc = GzEncoder::new(Vec::new(), Compression::default());
        enc.write_all(bytes).unwrap();
        enc.finish().unwrap()
    }

    fn read(p: &Path) -> Result<SparseTensor> {
        read_tns(p, &ReadOptions::default())
    }

    /// Reads `content` as a .tns and returns the error's line and message.
    fn parse_err(content: &str, opts: &ReadOptions) -> (u64, String) {
        let dir = tempfile::tempdir().unwrap();
        let p = write_file(dir.path(), "bad.tns", content.as_bytes());
        match read_tns(&p, opts).unwrap_err() {
            FormatError::Parse {
                path,
                line,
                message,
            } => {
                assert_eq!(path, p);
                (line, message)
            }
            other => panic!("expected a parse error, got {other}"),
        }
    }

    fn file_err(p: &Path, opts: &ReadOptions) -> String {
        match read_tns(p, opts).unwrap_err() {
            e @ FormatError::File { .. } => {
                let s = e.to_string();
                assert!(s.starts_with(&p.display().to_string()), "{s}");
                s
            }
            other => panic!("expected a file error, got {other}"),
        }
    }

    /// The repository's test tensors; missing, they fail the test.
    fn data_dir() -> PathBuf {
        let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data"));
        assert!(
            dir.is_dir(),
            "{} not found: the repository's test tensors are missing",
            dir.display()
        );
        dir
    }

    #[test]
    fn parses_comments_blank_lines_tabs_crlf_and_value_forms() {
        let dir = tempfile::tempdir().unwrap();
        let text = "\u{feff}# header\r\n\r\n  # indented comment\n1 1 4\r\n2\t3   -1.5e-3\n\
                    \t  3 2 4.000000  \n1 2 +.5\n2 1 7.\n3 3 1E2";
        let p = write_file(dir.path(), "a.tns", text.as_bytes());
        let t = read(&p).unwrap();
        assert_eq!(t.dims(), &[3, 3]);
        assert_eq!(t.mode_indices(0), &[0, 1, 2, 0, 1, 2]);
        assert_eq!(t.mode_indices(1), &[0, 2, 1, 1, 0, 2]);
        assert_eq!(t.values(), &[4.0, -1.5e-3, 4.0, 0.5, 7.0, 100.0]);
    }

    #[test]
    fn fast_value_agrees_with_std() {
        for s in [
            "0",
            "4",
            "-4",
            "4.000000",
            "0.237788",
            "0.845814",
            "123456.7",
            "16777215",
            "16777216",
            "9.999999",
            "0.1",
            "0.3",
            "-0.0",
            "1.",
            ".25",
            "3.4028235e38",
            "0.0000000001",
            "00012.5000",
        ] {
            let want: f32 = s.parse().unwrap();
            assert_eq!(
                parse_value(s.as_bytes()).unwrap().to_bits(),
                want.to_bits(),
                "{s}"
            );
        }
    }

    #[test]
    fn fast_value_agrees_with_std_on_many_values() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let check = |s: &str| {
            let want: f32 = s.parse().unwrap();
            let got = parse_value(s.as_bytes()).unwrap();
            assert_eq!(got.to_bits(), want.to_bits(), "{s}");
        };
        for _ in 0..200_000 {
            // Random digit strings with a random point.
            let n = rng.random_range(1..=18);
            let mut s: String = (0..n)
                .map(|_| char::from(b'0' + rng.random_range(0..10u8)))
                .collect();
            if rng.random_bool(0.8) {
                s.insert(rng.random_range(0..=n), '.');
            }
            check(&s);
            // f32s as the writer prints them.
            let x = f32::from_bits(rng.random_range(0x2000_0000..0x5f00_0000u32));
            check(&x.to_string());
            check(&format!("-{x}"));
        }
        // Decimals near the midpoints between neighbouring f32s, where
        // rounding twice could go wrong.
        for _ in 0..20_000 {
            let a = f32::from_bits(rng.random_range(0x3000_0000..0x5a00_0000u32));
            let b = f32::from_bits(a.to_bits() + 1);
            let mid = (f64::from(a) + f64::from(b)) / 2.0;
            for prec in 0..=22 {
                check(&format!("{mid:.prec$}"));
            }
        }
        for s in [
            "16777217",
            "16777217.00000001",
            "1.000000059604645",
            "33554435",
        ] {
            check(s);
        }
    }

    #[test]
    fn zero_based_file() {
        let data = data_dir();
        let p = data.join("splatt-small4_zeroidx.tns");
        let opts = ReadOptions {
            zero_based: true,
            ..ReadOptions::default()
        };
        let t = read_tns(&p, &opts).unwrap();
        assert_eq!((t.nmodes(), t.nnz()), (4, 8));
        assert_eq!(t.dims(), &[3, 3, 4, 3]);
        // Same nonzeros as the 1-based file, shifted in mode 0 by one.
        let one = read(&data.join("splatt-small4.tns")).unwrap();
        assert_eq!(t.mode_indices(3), &[0, 1, 2, 0, 0, 1, 0, 1]);
        assert_eq!(one.mode_indices(3), &[0, 1, 2, 0, 0, 1, 0, 1]);

        let err = read(&p).unwrap_err().to_string();
        assert!(err.contains("--zero-based"), "{err}");
        assert!(
            err.contains(":2: "),
            "line number of the first 0 index: {err}"
        );
    }

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
            // Read as values, with a warning that names --pattern.
            let (t, report) = read_tns_report(&p, &ReadOptions::default()).unwrap();
            assert_eq!(t.nmodes(), modes - 1, "{name}");
            assert_eq!(report.warnings.len(), 1, "{name}");
            assert!(report.warnings[0].contains("--pattern"), "{name}");
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

    #[test]
    fn column_count_mismatch() {
        let (line, msg) = parse_err(
            "# c\n1 1 1 1.0\n1 2 3 2.0\n2 2 2\n",
            &ReadOptions::default(),
        );
        assert_eq!(line, 4);
        assert!(
            msg.contains("expected 4 columns (as on line 2) but found 3"),
            "{msg}"
        );
        assert!(msg.contains("value may be missing"), "{msg}");

        let (line, msg) = parse_err("1 1 1.0\n1 2 3 2.0 5\n", &ReadOptions::default());
        assert_eq!(line, 2);
        assert!(
            msg.contains("expected 3 columns (as on line 1) but found 5"),
            "{msg}"
        );
        assert!(!msg.contains("missing"), "{msg}");

        let (line, msg) = parse_err("1 1 1 1.0\n1 2.0\n", &ReadOptions::default());
        assert_eq!(line, 2);
        assert!(msg.contains("found 2") && !msg.contains("missing"), "{msg}");
    }

    #[test]
    fn bad_indices() {
        let o = ReadOptions::default();
        let (line, msg) = parse_err("1 1 1.0\n1 x 2.0\n", &o);
        assert_eq!(line, 2);
        assert!(msg.contains("column 2: `x` is not an index"), "{msg}");

        let (line, msg) = parse_err("1 1 1.0\n\n1 1.5 2.0\n", &o);
        assert_eq!(line, 3);
        assert!(msg.contains("`1.5` is not an index"), "{msg}");

        let (line, msg) = parse_err("1 1 1.0\n-3 1 2.0\n", &o);
        assert_eq!(line, 2);
        assert!(msg.contains("negative index -3 in column 1"), "{msg}");

        let (line, msg) = parse_err("1 1 1.0\n1 0 2.0\n", &o);
        assert_eq!(line, 2);
        assert!(
            msg.contains("index 0 in column 2") && msg.contains("use --zero-based"),
            "{msg}"
        );
    }

    #[test]
    fn index_too_large_for_u32() {
        // 1-based: 4294967296 becomes 4294967295 = u32::MAX, whose dimension
        // would not fit.
        let o = ReadOptions::default();
        let (line, msg) = parse_err("1 4294967295 1.0\n1 4294967296 1.0\n", &o);
        assert_eq!(line, 2);
        assert!(
            msg.contains("index 4294967296 in column 2 is too large"),
            "{msg}"
        );
        let (_, msg) = parse_err("1 99999999999999999999999999 1.0\n", &o);
        assert!(msg.contains("too large"), "{msg}");
        let zb = ReadOptions {
            zero_based: true,
            ..ReadOptions::default()
        };
        let (line, msg) = parse_err("0 4294967294 1.0\n0 4294967295 1.0\n", &zb);
        assert_eq!(line, 2);
        assert!(msg.contains("too large"), "{msg}");
    }

    #[test]
    fn the_largest_index_reads() {
        let dir = tempfile::tempdir().unwrap();
        let p = write_file(dir.path(), "big.tns", b"1 4294967295 1.0\n");
        let t = read(&p).unwrap();
        assert_eq!(t.dims(), &[1, u32::MAX]);
        assert_eq!(t.mode_indices(1), &[u32::MAX - 1]);
    }

    #[test]
    fn given_dims_are_enforced() {
        let opts = ReadOptions {
            dims: Some(vec![2, 3]),
            ..ReadOptions::default()
        };
        let (line, msg) = parse_err("1 1 1.0\n2 3 1.0\n3 1 1.0\n", &opts);
        assert_eq!(line, 3);
        assert!(
            msg.contains("beyond the given dimension 2 of mode 1"),
            "{msg}"
        );

        let (line, msg) = parse_err("# x\n1 1 1 1.0\n", &opts);
        assert_eq!(line, 2);
        assert!(msg.contains("3 indices but 2 dimensions"), "{msg}");

        let dir = tempfile::tempdir().unwrap();
        let p = write_file(dir.path(), "ok.tns", b"1 1 1.0\n");
        let t = read_tns(&p, &opts).unwrap();
        assert_eq!(t.dims(), &[2, 3]);
    }

    #[test]
    fn bad_values() {
        let o = ReadOptions::default();
        let (line, msg) = parse_err("1 1 1.0\n1 2 abc\n", &o);
        assert_eq!(line, 2);
        assert!(msg.contains("value `abc` is not a number"), "{msg}");
        for bad in ["nan", "NaN", "inf", "-infinity", "1e39"] {
            let (line, msg) = parse_err(&format!("1 1 1.0\n1 1 2\n1 2 {bad}\n"), &o);
            assert_eq!(line, 3, "{bad}");
            assert!(msg.contains("is not a finite number"), "{bad}: {msg}");
        }
    }

    #[test]
    fn too_few_columns() {
        let (line, msg) = parse_err("# one column\n5\n6\n", &ReadOptions::default());
        assert_eq!(line, 2);
        assert!(msg.contains("at least one index and a value"), "{msg}");
        // As a pattern file it is a 1-mode tensor.
        let dir = tempfile::tempdir().unwrap();
        let p = write_file(dir.path(), "one.tns", b"5\n6\n");
        let opts = ReadOptions {
            pattern: true,
            ..ReadOptions::default()
        };
        let t = read_tns(&p, &opts).unwrap();
        assert_eq!((t.dims(), t.values()), (&[6u32][..], &[1.0f32, 1.0][..]));
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
    fn binary_content_is_not_text() {
        let (line, msg) = parse_err("1 1 1.0\n1 2 3\0\x01\n", &ReadOptions::default());
        assert_eq!(line, 2);
        assert!(msg.contains("NUL byte"), "{msg}");
        let dir = tempfile::tempdir().unwrap();
        let p = write_file(dir.path(), "latin1.tns", b"1 1 1.0\n1 2 \xe9\n");
        let err = read(&p).unwrap_err().to_string();
        assert!(
            err.contains(":2: ") && err.contains("not valid UTF-8"),
            "{err}"
        );
        // Non-ASCII text in comments is fine.
        let p = write_file(dir.path(), "utf8.tns", "# café\n1 1 1.0\n".as_bytes());
        assert_eq!(read(&p).unwrap().nnz(), 1);
    }

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

    #[test]
    fn gzip_output_is_the_plain_text_in_members() {
        let dir = tempfile::tempdir().unwrap();
        let nnz = 3 * WRITE_CHUNK + 17;
        let t = SparseTensor::new(
            vec![1000, 7],
            vec![
                (0..nnz).map(|k| (k % 1000) as u32).collect(),
                (0..nnz).map(|k| (k % 7) as u32).collect(),
            ],
            (0..nnz).map(|k| k as f32 * 0.5).collect(),
        )
        .unwrap();
        let plain = dir.path().join("t.tns");
        let gz = dir.path().join("t.tns.gz");
        write_tns(&plain, &t, false).unwrap();
        write_tns(&gz, &t, true).unwrap();
        let mut text = Vec::new();
        MultiGzDecoder::new(File::open(&gz).unwrap())
            .read_to_end(&mut text)
            .unwrap();
        assert_eq!(text, std::fs::read(&plain).unwrap());
        assert_eq!(read(&gz).unwrap(), t);

        // No nonzeros: still a valid gzip file (of no text).
        let empty = SparseTensor::new(vec![2], vec![vec![]], vec![]).unwrap();
        let p = dir.path().join("e.tns.gz");
        write_tns(&p, &empty, true).unwrap();
        let mut text = Vec::new();
        MultiGzDecoder::new(File::open(&p).unwrap())
            .read_to_end(&mut text)
            .unwrap();
        assert!(text.is_empty());
        assert!(file_err(&p, &ReadOptions::default()).contains("no nonzeros"));
    }

    #[test]
    fn binary_file_is_not_read_as_text() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.ktns");
        let t = SparseTensor::new(vec![2], vec![vec![1]], vec![1.0]).unwrap();
        crate::binary::write_binary(&p, &t).unwrap();
        assert!(file_err(&p, &ReadOptions::default()).contains("read_tensor"));
    }

    #[test]
    fn written_text_is_one_based_and_exact() {
        let dir = tempfile::tempdir().unwrap();
        let t = SparseTensor::new(
            vec![2, 3],
            vec![vec![0, 1], vec![2, 0]],
            vec![0.1, 16777217.0],
        )
        .unwrap();
        let p = dir.path().join("w.tns");
        write_tns(&p, &t, false).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "1 3 0.1\n2 1 16777216\n"
        );
    }

    fn tensor_strategy() -> impl Strategy<Value = SparseTensor> {
        (1usize..=6, 1usize..200).prop_flat_map(|(nmodes, nnz)| {
            (
                proptest::collection::vec(1u32..50, nmodes),
                proptest::collection::vec(proptest::collection::vec(any::<u32>(), nnz), nmodes),
                proptest::collection::vec(
                    prop_oneof![
                        -1e30f32..1e30f32,
                        -10.0f32..10.0,
                        (-100i32..100).prop_map(|i| i as f32),
                        Just(f32::MIN_POSITIVE),
                        Just(f32::MAX),
                        Just(1e-45f32),
                    ],
                    nnz,
                ),
            )
                .prop_filter_map(
                    "repeated coordinates sum beyond f32",
                    |(dims, raw, values)| {
                        let indices = raw
                            .into_iter()
                            .zip(&dims)
                            .map(|(col, &d)| col.into_iter().map(|x| x % d).collect())
                            .collect();
                        SparseTensor::new(dims, indices, values).ok()
                    },
                )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn text_round_trip(t in tensor_strategy(), gz in any::<bool>()) {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join(if gz { "t.tns.gz" } else { "t.tns" });
            write_tns(&p, &t, gz).unwrap();
            let opts = ReadOptions {
                dims: Some(t.dims().to_vec()),
                allow_index_like_values: true,
                ..ReadOptions::default()
            };
            let back = read_tns_with(&p, &opts, Some(97)).unwrap();
            prop_assert_eq!(&back, &t);
            for (a, b) in back.values().iter().zip(t.values()) {
                prop_assert_eq!(a.to_bits(), b.to_bits());
            }
            // Without dims, each is the largest index + 1.
            let inferred = read_tns(&p, &ReadOptions {
                allow_index_like_values: true,
                ..ReadOptions::default()
            }).unwrap();
            let want: Vec<u32> =
                t.indices().iter().map(|c| c.iter().max().unwrap() + 1).collect();
            prop_assert_eq!(inferred.dims(), &want[..]);
        }
    }
}
