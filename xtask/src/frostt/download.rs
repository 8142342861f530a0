//! Resumable HTTP(S) download into a `.part` file, hashing as it goes.
//!
//! A `.part` file that already exists is continued with `Range: bytes=N-`.
//! The server may answer 206 from byte N (appended), 200 (it ignored the
//! range: the file is written again from byte 0), or 416 (nothing left: the
//! `.part` is complete when its length is the size the server reports,
//! otherwise it is discarded and fetched again). The SHA-256 covers the
//! bytes already on disk, read once, and then every byte as it arrives, so
//! a resumed download is read no more than once in all.
//!
//! Whatever goes wrong, what has arrived stays in the `.part` file for the
//! next run to continue: this module never writes under any other name.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, ErrorKind, Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use ureq::tls::{RootCerts, TlsConfig};

/// What a finished download holds.
pub struct Fetched {
    pub bytes: u64,
    pub sha256: String,
}

/// An HTTP agent that verifies certificates with the operating system's
/// verifier, reports HTTP errors as statuses (not as transport errors), and
/// gives up after `timeout` on connecting, on waiting for the response
/// headers, and on any single read of the body. There is no limit on the
/// whole download, which may take hours; a server that stops sending is
/// caught by the per-read limit.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .tls_config(
            TlsConfig::builder()
                .root_certs(RootCerts::PlatformVerifier)
                .build(),
        )
        .http_status_as_error(false)
        .timeout_resolve(Some(timeout))
        .timeout_connect(Some(timeout))
        .timeout_send_request(Some(timeout))
        .timeout_recv_response(Some(timeout))
        .timeout_per_read(Some(timeout))
        .build()
        .into()
}

/// Downloads `url` into `part`, continuing what is there. `expected_bytes`
/// (from the manifest) lets a complete `.part` be taken without asking the
/// server, and a longer one be discarded.
pub fn download(
    agent: &ureq::Agent,
    url: &str,
    part: &Path,
    expected_bytes: Option<u64>,
) -> Result<Fetched> {
    let mut have = std::fs::metadata(part).map_or(0, |m| m.len());
    if expected_bytes.is_some_and(|n| have > n) {
        println!(
            "{} is longer than the manifest's size; fetching it again",
            part.display()
        );
        have = 0;
    }
    if have > 0 && expected_bytes == Some(have) {
        return hash_part(part, have);
    }
    let answer = match request(agent, url, have)? {
        Answer::NothingLeft { total } if total == Some(have) => return hash_part(part, have),
        Answer::NothingLeft { .. } | Answer::WrongRange => {
            println!(
                "the server cannot continue {}; fetching it again",
                part.display()
            );
            request(agent, url, 0)?
        }
        answer @ Answer::Body { start: 0, .. } if have > 0 => {
            println!("the server ignored the range request; fetching from byte 0");
            answer
        }
        answer => answer,
    };
    let Answer::Body { start, len, body } = answer else {
        bail!("GET {url}: the server refused a request for the whole file");
    };
    receive(url, part, start, len, body)
}

enum Answer {
    /// The body, from byte `start`, `len` bytes long when the server says.
    Body {
        start: u64,
        len: Option<u64>,
        body: ureq::Body,
    },
    /// 416: the range starts at or past the end; `total` is the file's size
    /// when the server says.
    NothingLeft { total: Option<u64> },
    /// 206 from another byte than asked for.
    WrongRange,
}

fn request(agent: &ureq::Agent, url: &str, from: u64) -> Result<Answer> {
    let mut req = agent.get(url);
    if from > 0 {
        req = req.header("Range", format!("bytes={from}-"));
    }
    let resp = req.call().with_context(|| format!("GET {url}"))?;
    let status = resp.status();
    let content_range = resp
        .headers()
        .get("content-range")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let (_, body) = resp.into_parts();
    match status.as_u16() {
        200 => Ok(Answer::Body {
            start: 0,
            len: body.content_length(),
            body,
        }),
        206 if from > 0 => match content_range.as_deref().and_then(range_start) {
            Some(start) if start == from => Ok(Answer::Body {
                start,
                len: body.content_length(),
                body,
            }),
            _ => Ok(Answer::WrongRange),
        },
        416 if from > 0 => Ok(Answer::NothingLeft {
            total: content_range.as_deref().and_then(range_total),
        }),
        _ => bail!(
            "GET {url}: HTTP {} {}",
            status.as_u16(),
            status.canonical_reason().unwrap_or("")
        ),
    }
}

/// The first byte of `Content-Range: bytes FIRST-LAST/TOTAL`.
fn range_start(v: &str) -> Option<u64> {
    v.strip_prefix("bytes ")?
        .split('-')
        .next()?
        .trim()
        .parse()
        .ok()
}

/// The total of `Content-Range: bytes .../TOTAL` (`*` when unknown).
fn range_total(v: &str) -> Option<u64> {
    v.rsplit('/').next()?.trim().parse().ok()
}

const CHUNK: usize = 1 << 20;

/// Writes `body` into `part` from byte `start`, after hashing the bytes
/// before it.
fn receive(
    url: &str,
    part: &Path,
    start: u64,
    len: Option<u64>,
    body: ureq::Body,
) -> Result<Fetched> {
    let open = || -> std::io::Result<File> {
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(part)?;
        file.set_len(start)?;
        file.seek(SeekFrom::Start(0))?;
        Ok(file)
    };
    let mut file = open().with_context(|| format!("opening {}", part.display()))?;
    let mut hasher = Sha256::new();
    if start > 0 {
        hash_into(&mut hasher, &mut file, start, part)?;
    }
    let bar = bytes_bar(len.map(|l| start + l), start);
    let began = Instant::now();
    let mut out = BufWriter::with_capacity(CHUNK, file);
    let mut reader = body.into_reader();
    let mut buf = vec![0u8; CHUNK];
    let mut done = start;
    let result = loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => break Err(e),
        };
        out.write_all(&buf[..n])
            .with_context(|| format!("writing {}", part.display()))?;
        hasher.update(&buf[..n]);
        done += n as u64;
        bar.set_position(done);
    };
    bar.finish_and_clear();
    // Keep what arrived, even after an error, for the next run to continue.
    let file = out
        .into_inner()
        .map_err(|e| e.into_error())
        .with_context(|| format!("writing {}", part.display()))?;
    file.sync_all()
        .with_context(|| format!("writing {}", part.display()))?;
    if let Err(e) = result {
        bail!(
            "GET {url}: the download stopped after {done} of {} bytes ({e}); \
             run again to continue it",
            len.map_or("?".to_string(), |l| (start + l).to_string())
        );
    }
    let secs = began.elapsed().as_secs_f64();
    println!(
        "downloaded {:.1} MB in {secs:.1} s ({:.1} MB/s)",
        (done - start) as f64 / 1e6,
        (done - start) as f64 / 1e6 / secs.max(1e-9)
    );
    Ok(Fetched {
        bytes: done,
        sha256: hex(&hasher.finalize()),
    })
}

/// The size and SHA-256 of a `.part` that holds `bytes` bytes already.
fn hash_part(part: &Path, bytes: u64) -> Result<Fetched> {
    println!("{} is complete; checking it", part.display());
    let mut file = File::open(part).with_context(|| format!("opening {}", part.display()))?;
    let mut hasher = Sha256::new();
    hash_into(&mut hasher, &mut file, bytes, part)?;
    Ok(Fetched {
        bytes,
        sha256: hex(&hasher.finalize()),
    })
}

/// Feeds the first `bytes` bytes of `file` (at its current position, the
/// start) to `hasher`, with a progress bar.
fn hash_into(hasher: &mut Sha256, file: &mut File, bytes: u64, path: &Path) -> Result<()> {
    let bar = bytes_bar(Some(bytes), 0);
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    while done < bytes {
        let want = (bytes - done).min(CHUNK as u64) as usize;
        file.read_exact(&mut buf[..want])
            .with_context(|| format!("reading {}", path.display()))?;
        hasher.update(&buf[..want]);
        done += want as u64;
        bar.set_position(done);
    }
    bar.finish_and_clear();
    Ok(())
}

/// A byte-count progress bar on standard error (hidden when it is not a
/// terminal).
pub(super) fn bytes_bar(total: Option<u64>, position: u64) -> ProgressBar {
    let bar = ProgressBar::new(total.unwrap_or(0));
    let template = if total.is_some() {
        "[{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}"
    } else {
        "{spinner} {bytes} {bytes_per_sec}"
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_position(position);
    bar
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        use std::fmt::Write as _;
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range_headers_are_read() {
        assert_eq!(range_start("bytes 100-199/200"), Some(100));
        assert_eq!(range_total("bytes 100-199/200"), Some(200));
        assert_eq!(range_total("bytes */200"), Some(200));
        assert_eq!(range_total("bytes 0-9/*"), None);
        assert_eq!(range_start("items 1-2/3"), None);
    }

    #[test]
    fn sha256_is_lower_case_hex() {
        assert_eq!(
            hex(&Sha256::digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
