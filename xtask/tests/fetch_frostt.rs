//! `cargo xtask fetch-frostt` against a small HTTP/1.1 server on 127.0.0.1
//! that this test runs itself (no internet): a download that succeeds,
//! one cut in the middle and resumed with a Range request, a server that
//! ignores ranges, wrong checksums, a truncated gzip stream, 404, servers
//! that stall, names that are not in the manifest, `--list`, and the
//! manifest copy that a first download records its checksum in.
//!
//! Every run goes through the built `xtask` binary, with a manifest of its
//! own (`--manifest`), so the repository's manifest is never written.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flate2::Compression;
use flate2::write::GzEncoder;
use kruskal_formats::{ReadOptions, SparseTensor, read_tensor};
use sha2::{Digest, Sha256};

/// Where the manifest says the test tensor is, under the mirror.
const URL_PATH: &str = "tiny/tiny.tns.gz";

/// A 3-mode tensor of 400 nonzeros (distinct coordinates) with integer and
/// fractional values, and its FROSTT text gzipped.
fn tensor() -> (SparseTensor, Vec<u8>) {
    let nnz = 400u32;
    // i = 30 q + r gives (r, (31 q + r) mod 40): distinct for q < 40.
    let idx: Vec<Vec<u32>> = vec![
        (0..nnz).map(|i| i % 30).collect(),
        (0..nnz).map(|i| (i / 30 + i) % 40).collect(),
        (0..nnz).map(|i| (7 * i + 2) % 50).collect(),
    ];
    let values: Vec<f32> = (0..nnz).map(|i| (i % 9) as f32 * 0.5 + 1.0).collect();
    let mut text = String::from("# a test tensor\n");
    for i in 0..nnz as usize {
        let v = values[i];
        text += &format!(
            "{} {} {} {v}\n",
            idx[0][i] + 1,
            idx[1][i] + 1,
            idx[2][i] + 1
        );
    }
    let dims = idx
        .iter()
        .map(|col| col.iter().max().unwrap() + 1)
        .collect();
    let t = SparseTensor::new(dims, idx, values).unwrap();
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(text.as_bytes()).unwrap();
    (t, gz.finish().unwrap())
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What the server does with a request for the file.
#[derive(Clone, Copy)]
enum Mode {
    /// 200, or 206 for `Range: bytes=N-` (416 past the end).
    Serve,
    /// Always 200 with the whole file.
    IgnoreRange,
    /// The first answer promises the whole file, sends this many bytes and
    /// closes the connection; later ones are as [`Mode::Serve`].
    CutFirstAfter(usize),
    /// Sends the headers and this many bytes, then nothing more.
    StallAfter(usize),
    /// Reads the request and never answers.
    StallBeforeHeaders,
}

/// A request the server saw: its path and its Range header.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    range: Option<String>,
}

struct Server {
    /// `http://127.0.0.1:PORT/`, for `--mirror`.
    url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    /// Serves `body` at `/URL_PATH`; anything else is 404.
    fn start(body: Vec<u8>, mode: Mode) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let body = Arc::new(body);
        let count = Arc::new(AtomicUsize::new(0));
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (log, body, count) = (log.clone(), body.clone(), count.clone());
                std::thread::spawn(move || {
                    let _ = answer(stream, &body, mode, &log, &count);
                });
            }
        });
        Server { url, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn answer(
    stream: TcpStream,
    body: &[u8],
    mode: Mode,
    log: &Mutex<Vec<Seen>>,
    count: &AtomicUsize,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .to_string();
    let mut range = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("range") {
                range = Some(value.trim().to_string());
            }
        }
    }
    log.lock().unwrap().push(Seen {
        path: path.clone(),
        range: range.clone(),
    });
    let nth = count.fetch_add(1, Ordering::SeqCst);
    let mut out = stream;
    let stall = || std::thread::sleep(Duration::from_secs(60));
    if path != format!("/{URL_PATH}") {
        let msg = b"no such file";
        write!(
            out,
            "HTTP/1.1 404 Not Found\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            msg.len()
        )?;
        return out.write_all(msg);
    }
    let from = match (mode, &range) {
        (Mode::IgnoreRange, _) | (_, None) => 0,
        (_, Some(r)) => r
            .strip_prefix("bytes=")
            .and_then(|r| r.strip_suffix('-'))
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(0),
    };
    let len = body.len();
    if from >= len && from > 0 {
        return write!(
            out,
            "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{len}\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
    }
    if from > 0 {
        write!(
            out,
            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {from}-{}/{len}\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            len - 1,
            len - from
        )?;
    } else if let Mode::StallBeforeHeaders = mode {
        stall();
        return Ok(());
    } else {
        write!(
            out,
            "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
        )?;
    }
    match mode {
        Mode::CutFirstAfter(n) if nth == 0 => out.write_all(&body[from..n]),
        Mode::StallAfter(n) => {
            out.write_all(&body[from..n])?;
            out.flush()?;
            stall();
            Ok(())
        }
        _ => out.write_all(&body[from..]),
    }
}

/// A folder for the tensors and a manifest that lists `tiny` under a base
/// URL nobody can reach (every run gives `--mirror`).
struct Case {
    tmp: tempfile::TempDir,
    manifest: PathBuf,
}

impl Case {
    fn new(bytes: Option<usize>, sha256: Option<&str>) -> Case {
        let tmp = tempfile::tempdir().unwrap();
        let manifest = tmp.path().join("manifest.json");
        let json = serde_json::json!({
            "base_urls": {"frostt": "https://frostt.invalid/data/"},
            "tensors": [{
                "name": "tiny", "base": "frostt", "path": URL_PATH,
                "dims": [30, 40, 50], "nnz": 400,
                "bytes": bytes, "sha256": sha256,
            }],
        });
        std::fs::write(&manifest, json.to_string()).unwrap();
        Case { tmp, manifest }
    }

    fn dir(&self) -> PathBuf {
        self.tmp.path().join("data")
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir().join(name)
    }

    fn manifest_entry(&self) -> serde_json::Value {
        let text = std::fs::read_to_string(&self.manifest).unwrap();
        let m: serde_json::Value = serde_json::from_str(&text).unwrap();
        m["tensors"][0].clone()
    }

    /// `cargo xtask fetch-frostt --timeout-s 10 ARGS --dir DIR --manifest
    /// FILE --mirror URL`, with the server's URL.
    fn fetch(&self, server: &Server, args: &[&str]) -> Output {
        self.fetch_from(&server.url, args)
    }

    fn fetch_from(&self, mirror: &str, args: &[&str]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_xtask"));
        // Generous, so a loaded machine does not time out; the tests of
        // stalling servers give a short one after it, which wins.
        cmd.args(["fetch-frostt", "--timeout-s", "10"])
            .args(args)
            .arg("--dir")
            .arg(self.dir())
            .arg("--manifest")
            .arg(&self.manifest)
            .args(["--mirror", mirror]);
        // A proxy from the environment must not stand between the test
        // and its own server.
        for var in [
            "http_proxy",
            "HTTP_PROXY",
            "https_proxy",
            "HTTPS_PROXY",
            "all_proxy",
            "ALL_PROXY",
        ] {
            cmd.env_remove(var);
        }
        cmd.output().unwrap()
    }

    /// Which of the tensor's files exist.
    fn files(&self) -> Vec<&'static str> {
        [
            "tiny.tns.gz",
            "tiny.tns.gz.part",
            "tiny.tns.gz.bad",
            "tiny.ktns",
        ]
        .into_iter()
        .filter(|f| self.file(f).exists())
        .collect()
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The run failed with one line on standard error that contains `what`.
fn assert_fails_with(o: &Output, what: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "succeeded:\n{}", stdout(o));
    assert!(err.contains(what), "no {what:?} in: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

fn assert_converted(case: &Case, expected: &SparseTensor) {
    let t = read_tensor(&case.file("tiny.ktns"), &ReadOptions::default()).unwrap();
    assert_eq!(t.nnz(), 400);
    // A .ktns holds its nonzeros in coordinate order.
    let mut expected = expected.clone();
    expected.sort_by_modes(&[0, 1, 2]).unwrap();
    assert_eq!(t, expected);
    assert_eq!(case.files(), ["tiny.tns.gz", "tiny.ktns"]);
}

#[test]
fn a_first_download_converts_and_records_its_checksum_in_the_manifest() {
    let (expected, gz) = tensor();
    let server = Server::start(gz.clone(), Mode::Serve);
    let case = Case::new(None, None);
    let o = case.fetch(&server, &["tiny"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_converted(&case, &expected);
    assert_eq!(std::fs::read(case.file("tiny.tns.gz")).unwrap(), gz);
    // The mirror replaced the manifest's base URL.
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].path, format!("/{URL_PATH}"));
    assert!(seen[0].range.is_none());
    let entry = case.manifest_entry();
    assert_eq!(entry["bytes"], gz.len());
    assert_eq!(entry["sha256"], sha256(&gz));
    assert!(stdout(&o).contains("recorded size"), "{}", stdout(&o));
    // Again: nothing to fetch.
    let o = case.fetch(&server, &["tiny"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("already there"));
    assert_eq!(server.seen().len(), 1);
}

#[test]
fn a_download_matching_the_manifest_records_nothing() {
    let (expected, gz) = tensor();
    let server = Server::start(gz.clone(), Mode::Serve);
    let case = Case::new(Some(gz.len()), Some(&sha256(&gz)));
    let before = std::fs::read(&case.manifest).unwrap();
    let o = case.fetch(&server, &["tiny"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_converted(&case, &expected);
    assert!(!stdout(&o).contains("recorded"));
    assert_eq!(std::fs::read(&case.manifest).unwrap(), before);
}

#[test]
fn a_cut_connection_is_resumed_with_a_range_request() {
    let (expected, gz) = tensor();
    let half = gz.len() / 2;
    let server = Server::start(gz.clone(), Mode::CutFirstAfter(half));
    let case = Case::new(Some(gz.len()), Some(&sha256(&gz)));
    let o = case.fetch(&server, &["tiny"]);
    assert_fails_with(&o, "run again to continue");
    assert_eq!(case.files(), ["tiny.tns.gz.part"]);
    assert_eq!(
        std::fs::read(case.file("tiny.tns.gz.part")).unwrap(),
        gz[..half]
    );

    let o = case.fetch(&server, &["tiny"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].range.as_deref(), Some(&*format!("bytes={half}-")));
    assert_converted(&case, &expected);
}

#[test]
fn a_server_that_ignores_the_range_is_read_from_the_start() {
    let (expected, gz) = tensor();
    let server = Server::start(gz.clone(), Mode::IgnoreRange);
    let case = Case::new(None, None);
    std::fs::create_dir_all(case.dir()).unwrap();
    std::fs::write(case.file("tiny.tns.gz.part"), &gz[..100]).unwrap();
    let o = case.fetch(&server, &["tiny"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(server.seen()[0].range.is_some());
    assert!(stdout(&o).contains("ignored the range"), "{}", stdout(&o));
    assert_converted(&case, &expected);
    assert_eq!(case.manifest_entry()["sha256"], sha256(&gz));
}

#[test]
fn a_complete_part_is_checked_and_converted_without_downloading_it_again() {
    let (expected, gz) = tensor();
    let server = Server::start(gz.clone(), Mode::Serve);
    // Without a size in the manifest the server is asked from the part's
    // end, and its 416 says the part is the whole file.
    for known in [false, true] {
        let case = if known {
            Case::new(Some(gz.len()), Some(&sha256(&gz)))
        } else {
            Case::new(None, None)
        };
        std::fs::create_dir_all(case.dir()).unwrap();
        std::fs::write(case.file("tiny.tns.gz.part"), &gz).unwrap();
        let o = case.fetch(&server, &["tiny"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_converted(&case, &expected);
    }
    let seen = server.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        seen[0].range.as_deref(),
        Some(&*format!("bytes={}-", gz.len()))
    );
}

#[test]
fn a_wrong_checksum_is_an_error_and_the_file_is_kept_aside() {
    let (_, gz) = tensor();
    let server = Server::start(gz.clone(), Mode::Serve);
    let case = Case::new(Some(gz.len()), Some(&"0".repeat(64)));
    let before = std::fs::read(&case.manifest).unwrap();
    let o = case.fetch(&server, &["tiny"]);
    assert_fails_with(&o, "SHA-256 mismatch");
    assert!(stderr(&o).contains("tiny.tns.gz.bad"));
    assert_eq!(case.files(), ["tiny.tns.gz.bad"]);
    assert_eq!(std::fs::read(case.file("tiny.tns.gz.bad")).unwrap(), gz);
    assert_eq!(std::fs::read(&case.manifest).unwrap(), before);
}

#[test]
fn a_wrong_size_is_an_error_and_the_file_is_kept_aside() {
    let (_, gz) = tensor();
    let server = Server::start(gz.clone(), Mode::Serve);
    let case = Case::new(Some(gz.len() + 1), None);
    let o = case.fetch(&server, &["tiny"]);
    assert_fails_with(&o, "the manifest says");
    assert_eq!(case.files(), ["tiny.tns.gz.bad"]);
}

#[test]
fn a_truncated_gzip_stream_is_an_error_and_is_not_recorded() {
    let (_, gz) = tensor();
    let cut = gz[..gz.len() * 2 / 3].to_vec();
    let server = Server::start(cut, Mode::Serve);
    let case = Case::new(None, None);
    let o = case.fetch(&server, &["tiny"]);
    assert_fails_with(&o, "truncated or corrupt");
    assert_eq!(case.files(), ["tiny.tns.gz.bad"]);
    assert!(case.manifest_entry()["sha256"].is_null());
}

#[test]
fn not_found_names_the_url_and_the_status() {
    let (_, gz) = tensor();
    let server = Server::start(gz, Mode::Serve);
    let case = Case::new(None, None);
    let mirror = format!("{}missing/", server.url);
    let o = case.fetch_from(&mirror, &["tiny"]);
    assert_fails_with(&o, "HTTP 404 Not Found");
    let url = format!("{mirror}{URL_PATH}");
    assert!(stderr(&o).contains(&url), "no {url} in {}", stderr(&o));
    assert!(case.files().is_empty(), "{:?}", case.files());
}

#[test]
fn with_several_names_one_failing_does_not_stop_the_others() {
    let (expected, gz) = tensor();
    let server = Server::start(gz, Mode::Serve);
    let case = Case::new(None, None);
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&case.manifest).unwrap()).unwrap();
    let mut gone = m["tensors"][0].clone();
    gone["name"] = "gone".into();
    gone["path"] = "gone/gone.tns.gz".into();
    m["tensors"].as_array_mut().unwrap().insert(0, gone);
    std::fs::write(&case.manifest, m.to_string()).unwrap();
    let o = case.fetch(&server, &["--all"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("HTTP 404"), "{err}");
    assert!(err.contains("1 of 2 tensors failed: gone"), "{err}");
    assert_converted(&case, &expected);
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&case.manifest).unwrap()).unwrap();
    assert!(m["tensors"][0]["sha256"].is_null());
    assert!(m["tensors"][1]["sha256"].is_string());
    assert!(!case.file("gone.tns.gz.part").exists());
}

/// A run with a one-second timeout against a server that stalls in
/// `mode`: it fails, and well within the bound. Returns the case, the run
/// and the file served.
fn fetch_stalled(mode: Mode) -> (Case, Output, Vec<u8>) {
    let (_, gz) = tensor();
    let server = Server::start(gz.clone(), mode);
    let case = Case::new(None, None);
    let start = Instant::now();
    let o = case.fetch(&server, &["tiny", "--timeout-s", "1"]);
    let elapsed = start.elapsed();
    assert!(!o.status.success());
    assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
    (case, o, gz)
}

#[test]
fn a_server_that_stops_sending_times_out_and_keeps_what_arrived() {
    let (case, o, gz) = fetch_stalled(Mode::StallAfter(100));
    assert_fails_with(&o, "timeout");
    assert!(stderr(&o).contains("run again to continue"));
    assert_eq!(case.files(), ["tiny.tns.gz.part"]);
    assert_eq!(
        std::fs::read(case.file("tiny.tns.gz.part")).unwrap(),
        gz[..100]
    );
}

#[test]
fn a_server_that_never_answers_times_out() {
    let (case, o, _) = fetch_stalled(Mode::StallBeforeHeaders);
    assert_fails_with(&o, "timeout");
    assert!(case.files().is_empty(), "{:?}", case.files());
}

#[test]
fn names_outside_the_manifest_are_refused_before_anything_is_fetched() {
    let (_, gz) = tensor();
    let server = Server::start(gz, Mode::Serve);
    let case = Case::new(None, None);
    for name in ["../etc/passwd", "nell-2", "tiny/../../x", "/tmp/x"] {
        let o = case.fetch(&server, &["tiny", name]);
        assert_fails_with(&o, "unknown tensor");
    }
    assert!(server.seen().is_empty());
    assert!(!case.dir().exists());
}

#[test]
fn list_prints_the_known_names() {
    let (_, gz) = tensor();
    let server = Server::start(gz, Mode::Serve);
    let case = Case::new(None, None);
    let o = case.fetch(&server, &["--list"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("tiny "), "{}", stdout(&o));
    // The repository's manifest.
    let o = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["fetch-frostt", "--list"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    for name in ["nell-1", "nell-2", "delicious-4d", "flickr-4d", "lanl2"] {
        assert!(stdout(&o).contains(name), "no {name} in {}", stdout(&o));
    }
    // FROSTT's names with the short ones `kruskal gen --like` also takes,
    // and what is recorded said as it is.
    let amazon = stdout(&o)
        .lines()
        .find(|l| l.starts_with("amazon-reviews "))
        .map(str::to_string)
        .unwrap_or_default();
    assert!(
        amazon.ends_with("4821207 x 1774269 x 1805187, 1741809018 nonzeros (also amazon)"),
        "{}",
        stdout(&o)
    );
    // A count FROSTT does not give is said to be missing, not guessed.
    assert!(
        stdout(&o).contains("delicious-3d") && stdout(&o).contains("nonzeros not recorded"),
        "{}",
        stdout(&o)
    );
    assert!(
        stdout(&o).contains("size and SHA-256 recorded for "),
        "{}",
        stdout(&o)
    );
}

#[test]
fn a_short_name_fetches_the_tensor_under_frostts_name() {
    let (expected, gz) = tensor();
    let server = Server::start(gz, Mode::Serve);
    let case = Case::new(None, None);
    // The same manifest, its tensor now called by FROSTT's name of one
    // whose short name is `amazon`.
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&case.manifest).unwrap()).unwrap();
    m["tensors"][0]["name"] = "amazon-reviews".into();
    std::fs::write(&case.manifest, m.to_string()).unwrap();
    let o = case.fetch(&server, &["amazon"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let t = read_tensor(&case.file("amazon-reviews.ktns"), &ReadOptions::default()).unwrap();
    assert_eq!(t.nnz(), expected.nnz());
    assert!(case.file("amazon-reviews.tns.gz").exists());
    // Both spellings again: already there, and nothing fetched twice.
    let o = case.fetch(&server, &["amazon-reviews", "amazon"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        stdout(&o).matches("is already there").count(),
        1,
        "{}",
        stdout(&o)
    );
    assert_eq!(server.seen().len(), 1);
}
