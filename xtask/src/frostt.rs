//! `cargo xtask fetch-frostt`: download FROSTT tensors, check them against
//! the manifest (`xtask/frostt-manifest.json`, see `manifest.rs`) and
//! convert them to kruskal's binary format.
//!
//! For a tensor `NAME` in the folder `DIR`:
//!
//! 1. `DIR/NAME.ktns` already there: nothing to do.
//! 2. `DIR/NAME.tns.gz` already there (an earlier run fetched it but did
//!    not convert it): its size is checked against the manifest, then 4.
//! 3. Otherwise the `.tns.gz` is downloaded into `DIR/NAME.tns.gz.part`,
//!    continuing a `.part` left by an interrupted run (`download.rs`). Its
//!    size and SHA-256 are compared with the manifest's; on a mismatch it is
//!    renamed `DIR/NAME.tns.gz.bad`, kept for inspection, and the run fails.
//! 4. The text is read (decompressed as it is parsed) and written as
//!    `DIR/NAME.ktns` through a temporary file that is renamed into place.
//!    Only then is the `.part` renamed `NAME.tns.gz`, and, when the manifest
//!    had no size or checksum for the tensor, the ones just computed are
//!    recorded in it (and the run says so). A download that no checksum
//!    vouched for and that does not read as a tensor (a truncated gzip
//!    stream, say) is renamed `.bad` rather than recorded.
//!
//! So a final name (`NAME.tns.gz`, `NAME.ktns`) only ever holds a complete,
//! checked file, and running the command again continues where it stopped.
//! Names come only from the manifest, which is checked when read.

mod download;
mod manifest;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{ArgGroup, Parser};
use kruskal_formats::{ReadOptions, read_tensor, write_tensor};

use crate::workspace_root;
use manifest::{Entry, Manifest, check_base_url};

/// The manifest in the repository, relative to the workspace root.
const MANIFEST: &str = "xtask/frostt-manifest.json";

/// Where tensors go without `--dir`, relative to the workspace root.
const DEFAULT_DIR: &str = "frostt";

const DEFAULT_TIMEOUT_S: f64 = 60.0;

/// `cargo xtask fetch-frostt`: tensor names, `--list` or `--all`.
#[derive(Parser, Debug)]
// As before clap, an option given twice takes its last value.
#[command(name = "fetch-frostt", args_override_self = true)]
#[command(group(ArgGroup::new("what").required(true).args(["names", "list", "all"])))]
pub struct FetchArgs {
    /// Tensors to fetch, by FROSTT's name or the short one `kruskal gen
    /// --like` takes (`amazon-reviews` or `amazon`).
    #[arg(value_name = "NAME")]
    names: Vec<String>,
    /// List the tensors the manifest knows.
    #[arg(long)]
    list: bool,
    /// Fetch every tensor of the manifest.
    #[arg(long)]
    all: bool,
    /// Where the tensors go (default frostt/ in the workspace).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Download from this base URL instead of the manifest's.
    #[arg(long, value_name = "URL", value_parser = mirror)]
    mirror: Option<String>,
    /// The manifest (default xtask/frostt-manifest.json in the workspace).
    #[arg(long, value_name = "FILE")]
    manifest: Option<PathBuf>,
    /// Longest wait for the server, seconds.
    #[arg(long, value_name = "S", default_value_t = DEFAULT_TIMEOUT_S, value_parser = seconds)]
    timeout_s: f64,
}

/// `--mirror`: an http(s) base URL, with a final `/`.
fn mirror(text: &str) -> Result<String, String> {
    let mut url = text.to_string();
    if !url.ends_with('/') {
        url.push('/');
    }
    check_base_url(&url).map_err(|e| format!("{e:#}"))?;
    Ok(url)
}

/// `--timeout-s`: seconds above 0 (and below a million).
fn seconds(text: &str) -> Result<f64, String> {
    text.parse()
        .ok()
        .filter(|s: &f64| s.is_finite() && *s > 0.0 && *s < 1e6)
        .ok_or_else(|| format!("takes seconds > 0, not {text:?}"))
}

struct Options {
    names: Vec<String>,
    list: bool,
    all: bool,
    dir: PathBuf,
    mirror: Option<String>,
    manifest: PathBuf,
    timeout: Duration,
}

impl FetchArgs {
    /// The options with the workspace's folders as defaults.
    fn options(self) -> Options {
        Options {
            names: self.names,
            list: self.list,
            all: self.all,
            dir: self
                .dir
                .unwrap_or_else(|| workspace_root().join(DEFAULT_DIR)),
            mirror: self.mirror,
            manifest: self
                .manifest
                .unwrap_or_else(|| workspace_root().join(MANIFEST)),
            timeout: Duration::from_secs_f64(self.timeout_s),
        }
    }
}

pub fn fetch_frostt(args: FetchArgs) -> Result<()> {
    let o = args.options();
    let manifest = Manifest::load(&o.manifest)?;
    if o.list {
        list(&manifest);
        return Ok(());
    }
    // Every name is looked up before anything is fetched, so a typo in the
    // last name does not wait for the first download.
    // A short name (`amazon`) stands for FROSTT's (`amazon-reviews`),
    // which names the files.
    let names: Vec<String> = if o.all {
        manifest.tensors.iter().map(|e| e.name.clone()).collect()
    } else {
        let mut names = Vec::new();
        for name in &o.names {
            let name = &manifest.get(name)?.name;
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        names
    };
    std::fs::create_dir_all(&o.dir).with_context(|| format!("creating {}", o.dir.display()))?;
    let agent = download::agent(o.timeout);
    if let [name] = names.as_slice() {
        return fetch_one(&o, &agent, &manifest, name);
    }
    // One tensor failing (a moved file, a cut connection) does not stop
    // the others: its error is printed and the run fails at the end.
    let mut failed = Vec::new();
    for name in &names {
        if let Err(e) = fetch_one(&o, &agent, &manifest, name) {
            eprintln!("error: {e:#}");
            failed.push(name.as_str());
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} of {} tensors failed: {}",
            failed.len(),
            names.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

fn list(manifest: &Manifest) {
    let width = manifest
        .tensors
        .iter()
        .map(|e| e.name.len())
        .max()
        .unwrap_or(0);
    let recorded = manifest
        .tensors
        .iter()
        .filter(|e| e.bytes.is_some() && e.sha256.is_some())
        .count();
    for e in &manifest.tensors {
        // The shape from the list `kruskal gen --like` shares; a tensor of
        // another manifest may give its own.
        let preset = kruskal_formats::generate::preset(&e.name).ok();
        let dims = match (preset, &e.dims) {
            (Some(p), _) => p.dims.iter().map(u32::to_string).collect::<Vec<_>>(),
            (None, Some(d)) => d.iter().map(u64::to_string).collect(),
            (None, None) => vec!["?".to_string()],
        };
        let nnz = preset
            .map_or(e.nnz, |p| p.nnz)
            .map_or("nonzeros not recorded".to_string(), |n| {
                format!("{n} nonzeros")
            });
        let also = match preset {
            Some(p) if p.name != e.name => format!(" (also {})", p.name),
            _ => String::new(),
        };
        let size = match (e.bytes, &e.sha256) {
            (Some(b), Some(_)) if b >= 1_000_000_000 => {
                format!(", {:.2} GB, checksum recorded", b as f64 / 1e9)
            }
            (Some(b), Some(_)) => format!(", {:.1} MB, checksum recorded", b as f64 / 1e6),
            _ => String::new(),
        };
        println!("{:width$}  {}, {nnz}{size}{also}", e.name, dims.join(" x "));
    }
    // Said once: FROSTT publishes no sizes or checksums, so they are
    // recorded by the first download of each tensor.
    println!(
        "size and SHA-256 recorded for {recorded} of {} tensors (the first download of a tensor records them)",
        manifest.tensors.len()
    );
}

/// The local files of one tensor.
struct Files {
    gz: PathBuf,
    part: PathBuf,
    bad: PathBuf,
    ktns: PathBuf,
}

impl Files {
    fn new(dir: &Path, name: &str) -> Files {
        Files {
            gz: dir.join(format!("{name}.tns.gz")),
            part: dir.join(format!("{name}.tns.gz.part")),
            bad: dir.join(format!("{name}.tns.gz.bad")),
            ktns: dir.join(format!("{name}.ktns")),
        }
    }

    /// Moves the `.part` aside as `.bad` (replacing an older one).
    fn set_aside(&self) -> Result<&Path> {
        std::fs::rename(&self.part, &self.bad).with_context(|| {
            format!("renaming {} to {}", self.part.display(), self.bad.display())
        })?;
        Ok(&self.bad)
    }
}

fn fetch_one(o: &Options, agent: &ureq::Agent, manifest: &Manifest, name: &str) -> Result<()> {
    let entry: Entry = manifest.get(name)?.clone();
    let name = entry.name.as_str();
    let f = Files::new(&o.dir, name);
    if f.ktns.exists() {
        println!("{name}: {} is already there", f.ktns.display());
        return Ok(());
    }
    if f.gz.exists() {
        let bytes = std::fs::metadata(&f.gz)?.len();
        if entry.bytes.is_some_and(|b| b != bytes) {
            bail!(
                "{name}: {} has {bytes} bytes, the manifest says {}; delete it to fetch it again",
                f.gz.display(),
                entry.bytes.unwrap_or(0)
            );
        }
        return convert(name, &f.gz, &f.ktns);
    }
    let url = manifest.url(&entry, o.mirror.as_deref());
    println!("{name}: fetching {url}");
    let got = download::download(agent, &url, &f.part, entry.bytes)?;
    if let Some(expected) = entry.bytes {
        if got.bytes != expected {
            let bad = f.set_aside()?;
            bail!(
                "{name}: the download has {} bytes, the manifest says {expected}; kept as {}",
                got.bytes,
                bad.display()
            );
        }
    }
    let vouched = match &entry.sha256 {
        Some(expected) if *expected != got.sha256 => {
            let bad = f.set_aside()?;
            bail!(
                "{name}: SHA-256 mismatch: the download has {}, the manifest says {expected}; kept as {}",
                got.sha256,
                bad.display()
            );
        }
        Some(_) => true,
        None => false,
    };
    if let Err(e) = convert(name, &f.part, &f.ktns) {
        match e.downcast_ref::<ReadFailed>() {
            Some(read) if !vouched => {
                let bad = f.set_aside()?;
                bail!(
                    "{name}: the download does not read as a tensor and is kept as {}: {read}",
                    bad.display()
                );
            }
            _ => return Err(e),
        }
    }
    std::fs::rename(&f.part, &f.gz)
        .with_context(|| format!("renaming {} to {}", f.part.display(), f.gz.display()))?;
    if entry.bytes.is_none() || entry.sha256.is_none() {
        Manifest::record(&o.manifest, name, got.bytes, &got.sha256)?;
        println!(
            "{name}: recorded size {} bytes and SHA-256 {} in {} (it had none)",
            got.bytes,
            got.sha256,
            o.manifest.display()
        );
    }
    Ok(())
}

/// A conversion that failed while reading the text (as opposed to writing
/// the binary file): the downloaded file itself is bad.
#[derive(Debug)]
struct ReadFailed(kruskal_formats::FormatError);

impl std::fmt::Display for ReadFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ReadFailed {}

/// Reads the `.tns.gz` at `src` and writes it as `ktns` (atomically).
fn convert(name: &str, src: &Path, ktns: &Path) -> Result<()> {
    let began = Instant::now();
    let total = std::fs::metadata(src).map_or(0, |m| m.len());
    let bar = download::bytes_bar(Some(total), 0);
    let b = bar.clone();
    let opts = ReadOptions {
        // Every FROSTT tensor has a value column, whatever it looks like.
        allow_index_like_values: true,
        progress: Some(Arc::new(move |done, _| b.set_position(done))),
        ..ReadOptions::default()
    };
    let read = read_tensor(src, &opts);
    bar.finish_and_clear();
    let t = read
        .map_err(ReadFailed)
        .with_context(|| format!("{name}: converting"))?;
    write_tensor(ktns, &t).with_context(|| format!("{name}: converting"))?;
    let dims: Vec<String> = t.dims().iter().map(u32::to_string).collect();
    println!(
        "{name}: wrote {} ({}, {} nonzeros) in {:.1} s",
        ktns.display(),
        dims.join(" x "),
        t.nnz(),
        began.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &str) -> Result<Options, clap::Error> {
        let argv = std::iter::once("fetch-frostt").chain(args.split_whitespace());
        Ok(FetchArgs::try_parse_from(argv)?.options())
    }

    #[test]
    fn exactly_one_of_names_list_and_all() {
        assert!(parse("").is_err());
        assert!(parse("--list --all").is_err());
        assert!(parse("nell-2 --all").is_err());
        assert!(parse("--list").unwrap().list);
        let o = parse("nell-2 nips --dir d --timeout-s 0.5").unwrap();
        assert_eq!(o.names, ["nell-2", "nips"]);
        assert_eq!(o.dir, PathBuf::from("d"));
        assert_eq!(o.timeout, Duration::from_millis(500));
    }

    #[test]
    fn bad_options_are_errors() {
        for bad in [
            "nell-2 --timeout-s 0",
            "nell-2 --timeout-s x",
            "nell-2 --dir",
            "nell-2 --mirror file:///tmp",
            "nell-2 --frobnicate",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let o = parse("nips --mirror http://127.0.0.1:9/m").unwrap();
        assert_eq!(o.mirror.as_deref(), Some("http://127.0.0.1:9/m/"));
        // Given twice, the last one counts.
        let o = parse("nips --timeout-s 10 --timeout-s 1").unwrap();
        assert_eq!(o.timeout, Duration::from_secs(1));
    }
}
