//! Lines into nonzeros: the layout fixed by the first data line, the
//! hand-written line and index parser, and the messages for bad lines.

use std::path::Path;

use super::columns::Columns;
use super::feed::Stop;
use super::numbers::parse_value;
use crate::coo::MAX_MODES;
use crate::error::{Advice, FormatError, Result};
use crate::io::ReadOptions;
/// Parsing parameters fixed by the first data line.
pub(super) struct Layout<'a> {
    /// Columns per line.
    ncols: usize,
    /// Index columns per line (`ncols`, or `ncols - 1` with a value column).
    pub(super) nmodes: usize,
    zero_based: bool,
    dims: Option<&'a [u32]>,
    /// Global line number of the first data line, quoted in messages.
    first_line: u64,
}

/// Checks the first data line's shape against the options.
pub(super) fn make_layout<'a>(
    path: &Path,
    ncols: usize,
    line: u64,
    opts: &'a ReadOptions,
) -> Result<Layout<'a>> {
    if !opts.pattern && ncols < 2 {
        return Err(FormatError::parse(
            path,
            line,
            "found 1 column, but a line needs at least one index and a value",
        )
        .advise(Advice::PatternIfIndicesOnly));
    }
    let nmodes = if opts.pattern { ncols } else { ncols - 1 };
    if nmodes > MAX_MODES {
        return Err(FormatError::parse(
            path,
            line,
            format!(
                "{ncols} columns make a tensor of {nmodes} modes, and kruskal takes at most \
                 {MAX_MODES}"
            ),
        ));
    }
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
pub(super) fn count_lines(b: &[u8]) -> u64 {
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
pub(super) fn first_data_line(b: &[u8]) -> Option<(u64, usize)> {
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

/// Why a line failed to parse, with advice where an option would help.
pub(super) struct LineError {
    msg: String,
    advice: Option<Advice>,
}

impl From<String> for LineError {
    fn from(msg: String) -> Self {
        LineError { msg, advice: None }
    }
}

impl LineError {
    /// The error of line `line` of `path`.
    pub(super) fn into_error(self, path: &Path, line: u64) -> FormatError {
        let e = FormatError::parse(path, line, self.msg);
        match self.advice {
            Some(a) => e.advise(a),
            None => e,
        }
    }
}

/// One parsed block.
pub(super) struct ParsedBlock {
    pub(super) cols: Columns,
    /// Lines in the block (up to the error, if any).
    pub(super) lines: u64,
    /// The first bad line, numbered from 1 within the block, and why.
    pub(super) error: Option<(u64, LineError)>,
    /// Set when reading stopped after the block's text.
    pub(super) stop: Option<Stop>,
    /// The block's buffer, until it goes back for reuse.
    pub(super) buf: Vec<u8>,
}

/// Parses block `b` into `cols` (empty, perhaps with capacity from an
/// earlier block).
pub(super) fn parse_block(b: &[u8], layout: &Layout, mut cols: Columns) -> ParsedBlock {
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
        if let Err(e) = parse_line(b, &mut pos, layout, &mut cols) {
            let text = &b[start..line_end(b, start)];
            // A wrong column count explains a bad token better than the
            // token itself (a missing value makes an index out of a value).
            let found = count_tokens(text);
            let e = match not_text(text) {
                Some(why) => LineError::from(why.to_string()),
                None if found != layout.ncols => column_count_message(found, layout).into(),
                None => e,
            };
            let msg = LineError {
                msg: with_cr_hint(e.msg, text),
                advice: e.advice,
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

/// `msg`, with a hint when `text` holds a carriage return that ends no
/// line: a file whose lines end in CR alone (as old Mac editors wrote
/// them) reads as one long line, and its errors make no sense without it.
pub(super) fn with_cr_hint(msg: String, text: &[u8]) -> String {
    let lone_cr = text.windows(2).any(|w| w[0] == b'\r' && w[1] != b'\n');
    if lone_cr {
        format!(
            "{msg} (the text holds carriage returns that end no line: if its lines end in CR \
             alone, convert them first, e.g. `tr '\\r' '\\n' < IN > OUT`)"
        )
    } else {
        msg
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
pub(super) fn show(tok: &[u8]) -> String {
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
) -> std::result::Result<(), LineError> {
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
            return Err(column_count_message(c, layout).into());
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
                return Err(bad_index(&b[start..end], c).into());
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
        return Err(column_count_message(found, layout).into());
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
fn to_index(
    v: u64,
    tok: &[u8],
    col: usize,
    layout: &Layout,
) -> std::result::Result<u32, LineError> {
    let idx = if layout.zero_based {
        v
    } else if v == 0 {
        return Err(LineError {
            msg: format!("index 0 in column {}, but indices are 1-based", col + 1),
            advice: Some(Advice::ZeroBased),
        });
    } else {
        v - 1
    };
    // Every dimension (largest index + 1) must fit in u32.
    if idx >= u64::from(u32::MAX) {
        let largest = u64::from(u32::MAX) - u64::from(layout.zero_based);
        return Err(LineError::from(format!(
            "index {} in column {} is too large: indices must fit in 32 bits (at most {largest})",
            show(tok),
            col + 1
        )));
    }
    let idx = idx as u32;
    if let Some(dims) = layout.dims {
        if idx >= dims[col] {
            return Err(LineError::from(format!(
                "index {} in column {} is beyond the given dimension {} of mode {}",
                show(tok),
                col + 1,
                dims[col],
                col + 1
            )));
        }
    }
    Ok(idx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tns::read_tns;
    use crate::tns::test_util::{data_dir, parse_err, read, write_file};

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
    fn lines_ending_in_cr_alone_get_a_hint() {
        let dir = tempfile::tempdir().unwrap();
        for lines in [3, 30] {
            let text: String = (1..=lines).map(|i| format!("{i} {i} {i} 1.0\r")).collect();
            let p = write_file(dir.path(), "mac.tns", text.as_bytes());
            let err = read(&p).unwrap_err().to_string();
            assert!(
                err.contains("carriage returns that end no line") && err.contains("tr '\\r'"),
                "{lines} lines: {err}"
            );
        }
        // CRLF files read as they are, and other errors get no hint.
        let p = write_file(dir.path(), "dos.tns", b"1 1 x\r\n");
        let err = read(&p).unwrap_err().to_string();
        assert!(!err.contains("carriage"), "{err}");
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

        let err = read(&p).unwrap_err();
        assert!(
            err.to_string()
                .ends_with("; use zero_based for files whose indices start at 0"),
            "{err}"
        );
        let err = err.message(&crate::tns::test_util::dashed);
        assert!(err.contains("use --zero-based"), "{err}");
        assert!(
            err.contains(":2: "),
            "line number of the first 0 index: {err}"
        );
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
}
