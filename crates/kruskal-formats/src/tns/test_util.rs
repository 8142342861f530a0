//! Helpers shared by the reader's and writer's tests.

use std::io::Write;
use std::path::{Path, PathBuf};

use flate2::Compression;
use flate2::write::GzEncoder;

use super::read_tns;
use crate::coo::SparseTensor;
use crate::error::{FormatError, Result};
use crate::io::ReadOptions;
use crate::option::OptionName;

pub(super) fn write_file(dir: &Path, name: &str, content: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    p
}

pub(super) fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

pub(super) fn read(p: &Path) -> Result<SparseTensor> {
    read_tns(p, &ReadOptions::default())
}

/// An option as the command line spells it (`--zero-based`), for the
/// tests' messages.
pub(crate) fn dashed(option: OptionName, value: Option<&str>) -> String {
    let name = option.name().replace('_', "-");
    match value {
        Some(v) => format!("--{name} {v}"),
        None => format!("--{name}"),
    }
}

/// Reads `content` as a .tns and returns the error's line and message
/// (with its advice, options spelled as the command line does).
pub(super) fn parse_err(content: &str, opts: &ReadOptions) -> (u64, String) {
    let dir = tempfile::tempdir().unwrap();
    let p = write_file(dir.path(), "bad.tns", content.as_bytes());
    let (e, advice) = match read_tns(&p, opts).unwrap_err() {
        FormatError::Advised { error, advice } => (*error, advice.text(&dashed)),
        e => (e, String::new()),
    };
    match e {
        FormatError::Parse {
            path,
            line,
            message,
        } => {
            assert_eq!(path, p);
            (line, message + &advice)
        }
        other => panic!("expected a parse error, got {other}"),
    }
}

pub(super) fn file_err(p: &Path, opts: &ReadOptions) -> String {
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
pub(super) fn data_dir() -> PathBuf {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data"));
    assert!(
        dir.is_dir(),
        "{} not found: the repository's test tensors are missing",
        dir.display()
    );
    dir
}
