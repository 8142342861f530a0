//! Format-independent reading and writing: pick the format of a file, read
//! it with the right reader, and write files atomically.
//!
//! Readers decide the format from the file's content (gzip magic, kruskal's
//! binary magic, else text), so a misnamed file still reads right. Writers
//! decide it from the extension, which is the user's stated intent.

use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;
use std::sync::Arc;

use crate::binary;
use crate::coo::SparseTensor;
use crate::error::{FormatError, ReadWarning, Result};
use crate::tns;

/// A progress callback: `progress(bytes_done, bytes_total)`, where
/// `bytes_total` is the size of the file on disk and `bytes_done` counts
/// bytes of that file consumed so far (compressed bytes for `.tns.gz`).
pub type ProgressFn = dyn Fn(u64, u64) + Send + Sync;

/// How to read a tensor file. `ReadOptions::default()` reads a FROSTT text
/// file with 1-based indices and a value column, inferring the dimensions.
#[derive(Clone, Default)]
pub struct ReadOptions {
    /// Text indices start at 0 instead of FROSTT's 1.
    pub zero_based: bool,
    /// Every text column is an index and every value is 1 (a "pattern"
    /// tensor, such as a knowledge graph's list of facts).
    pub pattern: bool,
    /// The dimensions the tensor must have. Without it they are inferred as
    /// the largest index of each mode plus one. An index beyond a given
    /// dimension is an error, as is a different number of modes.
    pub dims: Option<Vec<u32>>,
    /// Do not warn when a text file's value column looks like one more
    /// index column (see [`crate::tns`]): the values are known to be data.
    pub allow_index_like_values: bool,
    /// Called now and then while reading, and once at the end.
    pub progress: Option<Arc<ProgressFn>>,
}

impl fmt::Debug for ReadOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadOptions")
            .field("zero_based", &self.zero_based)
            .field("pattern", &self.pattern)
            .field("dims", &self.dims)
            .field("allow_index_like_values", &self.allow_index_like_values)
            .field("progress", &self.progress.as_ref().map(|_| "<callback>"))
            .finish()
    }
}

impl ReadOptions {
    pub(crate) fn report(&self, done: u64, total: u64) {
        if let Some(progress) = &self.progress {
            progress(done, total);
        }
    }
}

/// The on-disk formats this crate reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileKind {
    /// FROSTT text, one nonzero per line (`.tns`).
    Tns,
    /// Gzip-compressed FROSTT text (`.tns.gz`, or any `.gz`).
    TnsGz,
    /// kruskal's binary format (`.ktns`), see [`crate::binary`].
    Binary,
}

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

const ACCEPTED_EXTENSIONS: &str = ".tns, .tns.gz (or .gz) and .ktns";

impl FileKind {
    /// The kind named by the file's extension: `.tns`, `.tns.gz` or `.gz`,
    /// `.ktns` (case-insensitive). Anything else is an error that lists the
    /// accepted extensions.
    pub fn from_path(path: &Path) -> Result<FileKind> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("tns") => Ok(FileKind::Tns),
            Some("gz") => Ok(FileKind::TnsGz),
            Some("ktns") => Ok(FileKind::Binary),
            _ => Err(FormatError::file(
                path,
                format!("unknown tensor file extension: expected one of {ACCEPTED_EXTENSIONS}"),
            )),
        }
    }

    /// The kind of an existing file, from its first bytes: gzip magic
    /// `1f 8b` is [`FileKind::TnsGz`], kruskal's binary magic is
    /// [`FileKind::Binary`], anything else (including a file too short to
    /// hold a magic) is [`FileKind::Tns`].
    ///
    /// Only a regular file is opened: a pipe, a device or a directory is
    /// an error that says so (opening a pipe without a writer would wait
    /// for ever, and a stream cannot be read in parallel positional reads).
    pub fn sniff(path: &Path) -> Result<FileKind> {
        regular_file(path)?;
        let mut file = File::open(path).map_err(|e| FormatError::io(path, e))?;
        let mut head = [0u8; 8];
        let mut len = 0;
        // A short read is not the end of the file; keep reading until the
        // magic is complete or the file ends.
        while len < head.len() {
            match file.read(&mut head[len..]) {
                Ok(0) => break,
                Ok(n) => len += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(FormatError::io(path, e)),
            }
        }
        Ok(Self::from_magic(&head[..len]))
    }

    pub(crate) fn from_magic(head: &[u8]) -> FileKind {
        if head.starts_with(&binary::MAGIC) {
            FileKind::Binary
        } else if head.starts_with(&GZIP_MAGIC) {
            FileKind::TnsGz
        } else {
            FileKind::Tns
        }
    }
}

/// Checks, without opening it, that `path` is a regular file (following
/// links) and returns its length. A pipe (a FIFO, or a shell's `<(...)`),
/// a device (`/dev/zero`) or a directory is an error that says the input
/// must be a regular file: kruskal reads a tensor with parallel positional
/// reads of known length, which a stream cannot give.
pub(crate) fn regular_file(path: &Path) -> Result<u64> {
    let meta = std::fs::metadata(path).map_err(|e| FormatError::io(path, e))?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    if meta.is_dir() {
        return Err(FormatError::file(path, "is a directory, not a tensor file"));
    }
    Err(FormatError::file(
        path,
        "a pipe, socket or device, not a regular file: a tensor is read from a regular file \
         (save a stream to a file first, e.g. `cat ... > t.tns`)",
    ))
}

/// What reading a file noticed besides the tensor.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReadReport {
    /// Nonzeros of the file summed into others because they repeat a
    /// coordinate (the file's nonzero count minus the tensor's).
    pub merged: usize,
    /// Seconds spent making sure no coordinate repeats (checking the
    /// order, sorting and summing where needed), included in the read.
    pub coalesce_s: f64,
    /// One line each: what about the file the user should know (a value
    /// column that looks like an index).
    pub warnings: Vec<ReadWarning>,
}

/// Reads a tensor in any supported format, chosen by the file's content (not
/// its name). Text options in `opts` apply to `.tns`/`.tns.gz`; for a binary
/// file, `opts.dims`, when given, must equal the stored dimensions. Repeated
/// coordinates are summed; [`read_tensor_report`] also says how many, and
/// gives the reader's warnings.
pub fn read_tensor(path: &Path, opts: &ReadOptions) -> Result<SparseTensor> {
    read_tensor_report(path, opts).map(|(t, _)| t)
}

/// [`read_tensor`], also returning what the reader noticed.
pub fn read_tensor_report(path: &Path, opts: &ReadOptions) -> Result<(SparseTensor, ReadReport)> {
    match FileKind::sniff(path)? {
        // A text file named `.ktns` is read (the content decides), but one
        // that is not valid text either is most likely a damaged binary
        // file, and the text reader's complaint alone would mislead.
        FileKind::Tns | FileKind::TnsGz
            if FileKind::from_path(path).ok() == Some(FileKind::Binary) =>
        {
            tns::read_tns_report(path, opts).map_err(|e| {
                FormatError::file(
                    path,
                    format!(
                        "not a kruskal binary tensor (bad magic: a .ktns file starts with \
                         KRUSKAL\\0), nor a text tensor ({})",
                        without_path(&e)
                    ),
                )
            })
        }
        FileKind::Tns | FileKind::TnsGz => tns::read_tns_report(path, opts),
        FileKind::Binary => {
            let (t, merged, coalesce_s) = binary::read_binary_merged(path)?;
            if let Some(dims) = &opts.dims {
                if dims.as_slice() != t.dims() {
                    return Err(FormatError::file(
                        path,
                        format!(
                            "the file's dimensions {:?} differ from the requested {:?}",
                            t.dims(),
                            dims
                        ),
                    ));
                }
            }
            let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
            opts.report(size, size);
            let report = ReadReport {
                merged,
                coalesce_s,
                warnings: Vec::new(),
            };
            Ok((t, report))
        }
    }
}

/// The message of `e` without the file name it starts with.
fn without_path(e: &FormatError) -> String {
    match e {
        FormatError::Parse { line, message, .. } => format!("line {line}: {message}"),
        FormatError::File { message, .. } => message.clone(),
        FormatError::Io { error, .. } => error.to_string(),
        other => other.to_string(),
    }
}

/// Writes a tensor in the format named by the extension of `path` (see
/// [`FileKind::from_path`]). The file appears complete or not at all: it is
/// written to a temporary file beside it and renamed over `path`.
pub fn write_tensor(path: &Path, t: &SparseTensor) -> Result<()> {
    match FileKind::from_path(path)? {
        FileKind::Tns => tns::write_tns(path, t, false),
        FileKind::TnsGz => tns::write_tns(path, t, true),
        FileKind::Binary => binary::write_binary(path, t),
    }
}

/// Buffer of the writer handed to `write_atomically`'s callback.
const WRITE_BUFFER: usize = 1 << 20;

/// Writes `path` through a temporary file in the same directory that is
/// flushed, synced and then renamed over `path`, so readers never see a
/// partial file and a failed write leaves the old file (or none) in place.
///
/// `write` gets a buffered writer. If it, or any later step, fails, the
/// temporary file is removed and nothing is created under `path`.
/// How the temporary files this process writes `path` through begin:
/// `.NAME.PID.` (then random characters and `.tmp`), in `path`'s
/// directory. A program ended by a signal while writing removes those of
/// its own pid ([`remove_temporaries`]). `None` when `path` names no file.
pub fn temporary_prefix(path: &Path) -> Option<std::ffi::OsString> {
    let name = path.file_name()?;
    let mut prefix = std::ffi::OsString::from(".");
    prefix.push(name);
    prefix.push(format!(".{}.", std::process::id()));
    Some(prefix)
}

/// Removes the temporary files this process is writing `path` through
/// (see [`temporary_prefix`]); for a signal handler that ends the process
/// while a write may be under way. Best effort: errors are ignored.
pub fn remove_temporaries(path: &Path) {
    let Some(prefix) = temporary_prefix(path) else {
        return;
    };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = prefix.to_string_lossy().into_owned();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(&prefix) && name.ends_with(".tmp") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

pub(crate) fn write_atomically<F>(path: &Path, write: F) -> Result<()>
where
    F: FnOnce(&mut dyn Write) -> Result<()>,
{
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let prefix =
        temporary_prefix(path).ok_or_else(|| FormatError::file(path, "not a file name"))?;
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp");
    // tempfile creates files readable by the owner only; ask for the usual
    // 0666 (less the umask, which open(2) applies) as a plain create would.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut tmp = builder
        .tempfile_in(dir)
        .map_err(|e| FormatError::io(path, e))?;
    {
        let mut w = BufWriter::with_capacity(WRITE_BUFFER, tmp.as_file_mut());
        write(&mut w)?;
        w.flush().map_err(|e| FormatError::io(path, e))?;
    }
    tmp.as_file()
        .sync_all()
        .map_err(|e| FormatError::io(path, e))?;
    // On failure the PersistError owns the temporary file and removes it when
    // dropped.
    tmp.persist(path)
        .map_err(|e| FormatError::io(path, e.error))?;
    Ok(())
}

/// Fills `buf` from `offset` without moving a shared file position, so
/// threads can read different parts of one file at once.
#[cfg(unix)]
pub(crate) fn read_at(
    _path: &Path,
    file: &File,
    buf: &mut [u8],
    offset: u64,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, offset)
}

/// Fills `buf` from `offset` through a handle of its own (the portable way
/// to read several parts of a file at once).
#[cfg(not(unix))]
pub(crate) fn read_at(
    path: &Path,
    _file: &File,
    buf: &mut [u8],
    offset: u64,
) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom};
    let mut f = File::open(path)?;
    f.seek(SeekFrom::Start(offset))?;
    f.read_exact(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> SparseTensor {
        SparseTensor::new(
            vec![3, 2, 4],
            vec![vec![2, 0, 1], vec![1, 0, 1], vec![3, 1, 0]],
            vec![1.5, -2.0, 3.25],
        )
        .unwrap()
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn kind_from_extension() {
        assert_eq!(
            FileKind::from_path(Path::new("a/b.tns")).unwrap(),
            FileKind::Tns
        );
        assert_eq!(
            FileKind::from_path(Path::new("b.tns.gz")).unwrap(),
            FileKind::TnsGz
        );
        assert_eq!(
            FileKind::from_path(Path::new("b.GZ")).unwrap(),
            FileKind::TnsGz
        );
        assert_eq!(
            FileKind::from_path(Path::new("b.ktns")).unwrap(),
            FileKind::Binary
        );
        let err = FileKind::from_path(Path::new("b.csv"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(".tns") && err.contains(".ktns") && err.contains(".tns.gz"),
            "{err}"
        );
        assert!(FileKind::from_path(Path::new("noext")).is_err());
    }

    #[test]
    fn misnamed_files_are_sniffed_by_content() {
        let dir = tempfile::tempdir().unwrap();
        let t = small();
        for (written, misnamed, kind) in [
            ("a.ktns", "a.tns", FileKind::Binary),
            ("b.tns.gz", "b.tns", FileKind::TnsGz),
            ("c.tns", "c.ktns", FileKind::Tns),
        ] {
            let src = dir.path().join(written);
            write_tensor(&src, &t).unwrap();
            let dst = dir.path().join(misnamed);
            std::fs::rename(&src, &dst).unwrap();
            assert_eq!(FileKind::sniff(&dst).unwrap(), kind);
            // A .ktns is written in coordinate order: compare in it.
            let mut back = read_tensor(&dst, &ReadOptions::default()).unwrap();
            let mut want = t.clone();
            back.sort_by_modes(&[0, 1, 2]).unwrap();
            want.sort_by_modes(&[0, 1, 2]).unwrap();
            assert_eq!(back, want);
        }
    }

    #[test]
    fn a_ktns_that_is_neither_binary_nor_text_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("damaged.ktns");
        let mut bytes = b"KRUSKAX\0".to_vec();
        bytes.extend_from_slice(&[0xff, 0x00, 0x13, 0x77, 0x01, 0x02]);
        std::fs::write(&p, &bytes).unwrap();
        let err = read_tensor(&p, &ReadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&p.display().to_string())
                && err.contains("not a kruskal binary tensor (bad magic")
                && err.contains("nor a text tensor"),
            "{err}"
        );
    }

    #[test]
    fn streams_and_special_files_are_refused_in_one_line() {
        // A directory, a device, a FIFO: not regular files. None is
        // opened, so a FIFO without a writer does not hang the reader.
        let dir = tempfile::tempdir().unwrap();
        let mut refused = vec![dir.path().to_path_buf(), "/dev/zero".into()];
        let fifo = dir.path().join("fifo.tns");
        if std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success())
        {
            refused.push(fifo);
        }
        for p in &refused {
            let err = read_tensor(p, &ReadOptions::default())
                .unwrap_err()
                .to_string();
            let want = if p.is_dir() {
                "is a directory"
            } else {
                "not a regular file"
            };
            assert!(err.contains(want), "{}: {err}", p.display());
            let err = crate::MappedBinary::open(p).unwrap_err().to_string();
            assert!(err.contains(want), "{}: {err}", p.display());
        }
        // A /proc file says it is empty and is not.
        let environ = Path::new("/proc/self/environ");
        if environ.is_file() && std::fs::read(environ).is_ok_and(|b| !b.is_empty()) {
            let err = read_tensor(environ, &ReadOptions::default())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("reports a length of 0 but holds data"),
                "{err}"
            );
        }
    }

    #[test]
    fn write_tensor_refuses_unknown_extension() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_tensor(&dir.path().join("x.txt"), &small()).unwrap_err();
        assert!(err.to_string().contains(".ktns"), "{err}");
        assert!(entries(dir.path()).is_empty());
    }

    #[test]
    fn binary_dims_are_checked_against_options() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.ktns");
        write_tensor(&p, &small()).unwrap();
        let opts = ReadOptions {
            dims: Some(vec![3, 2, 5]),
            ..ReadOptions::default()
        };
        let err = read_tensor(&p, &opts).unwrap_err().to_string();
        assert!(err.contains("differ"), "{err}");
    }

    #[test]
    fn failed_write_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out.tns");
        let err = write_atomically(&target, |w| {
            w.write_all(b"1 1 1.0\n")
                .map_err(|e| FormatError::io("x", e))?;
            Err(FormatError::Argument("writer failed".into()))
        })
        .unwrap_err();
        assert!(err.to_string().contains("writer failed"));
        assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));

        // The target directory does not exist.
        let missing = dir.path().join("no/such/dir/out.ktns");
        assert!(write_tensor(&missing, &small()).is_err());
        assert!(entries(dir.path()).is_empty());
    }

    #[test]
    fn temporaries_carry_the_pid_and_can_be_removed() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("t.tns");
        let prefix = temporary_prefix(&out).unwrap();
        let prefix = prefix.to_string_lossy();
        assert_eq!(prefix, format!(".t.tns.{}.", std::process::id()));
        // As a write under way leaves it, beside another process's and a
        // file of the user's.
        std::fs::write(dir.path().join(format!("{prefix}abc123.tmp")), b"x").unwrap();
        std::fs::write(dir.path().join(".t.tns.1.abc123.tmp"), b"x").unwrap();
        std::fs::write(dir.path().join("keep.tns"), b"x").unwrap();
        remove_temporaries(&out);
        assert_eq!(entries(dir.path()), [".t.tns.1.abc123.tmp", "keep.tns"]);
    }

    #[test]
    fn failed_write_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out.tns");
        std::fs::write(&target, b"old").unwrap();
        let res = write_atomically(&target, |_| Err(FormatError::Argument("no".into())));
        assert!(res.is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"old");
        assert_eq!(entries(dir.path()), vec!["out.tns".to_string()]);
    }

    #[test]
    fn written_file_replaces_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out.tns");
        std::fs::write(&target, b"old").unwrap();
        write_atomically(&target, |w| {
            w.write_all(b"new").map_err(|e| FormatError::io("x", e))
        })
        .unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(entries(dir.path()), vec!["out.tns".to_string()]);
    }

    #[cfg(unix)]
    #[test]
    fn written_file_is_not_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out.tns");
        write_tensor(&target, &small()).unwrap();
        let mode = std::fs::metadata(&target).unwrap().permissions().mode();
        // Whatever the umask, the owner can read and write.
        assert_eq!(mode & 0o600, 0o600);
    }

    #[test]
    fn debug_skips_the_callback() {
        let opts = ReadOptions {
            progress: Some(Arc::new(|_, _| {})),
            ..ReadOptions::default()
        };
        let s = format!("{opts:?}");
        assert!(
            s.contains("<callback>") && s.contains("zero_based: false"),
            "{s}"
        );
    }
}
