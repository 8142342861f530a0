//! The FROSTT manifest (`xtask/frostt-manifest.json`): the tensors
//! `cargo xtask fetch-frostt` knows, where each one is, and the size and
//! SHA-256 of its `.tns.gz` once a download has recorded them.
//!
//! The manifest is the only source of names, URL paths and local file
//! names, so everything in it is checked when it is read: a tensor name is
//! lower-case letters, digits and `-` (it names local files), a path is
//! `/`-separated segments of letters, digits, `.`, `_` and `-` that do not
//! start with `.` and it ends in `.tns.gz`.
//!
//! It is written one tensor a line, so recording a checksum changes one line.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Manifest {
    /// Base URLs by key; every one ends in `/`.
    pub base_urls: BTreeMap<String, String>,
    pub tensors: Vec<Entry>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Entry {
    /// The name on the command line and of the local files (`NAME.tns.gz`,
    /// `NAME.ktns`).
    pub name: String,
    /// Key into [`Manifest::base_urls`].
    pub base: String,
    /// The `.tns.gz` under the base URL.
    pub path: String,
    /// Dimensions and nonzeros (for `--list`), for a tensor that is not
    /// one of `kruskal_formats::generate::PRESETS`, whose shapes the
    /// repository's manifest leaves to that list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dims: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nnz: Option<u64>,
    /// Size of the `.tns.gz`, once recorded.
    #[serde(default)]
    pub bytes: Option<u64>,
    /// SHA-256 of the `.tns.gz`, lower-case hex, once recorded.
    #[serde(default)]
    pub sha256: Option<String>,
}

impl Manifest {
    /// Reads and checks a manifest file.
    pub fn load(path: &Path) -> Result<Manifest> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the manifest {}", path.display()))?;
        let manifest: Manifest = serde_json::from_str(&text)
            .with_context(|| format!("parsing the manifest {}", path.display()))?;
        manifest
            .check()
            .with_context(|| format!("in the manifest {}", path.display()))?;
        Ok(manifest)
    }

    fn check(&self) -> Result<()> {
        for (key, url) in &self.base_urls {
            check_base_url(url).with_context(|| format!("base URL {key:?}"))?;
        }
        let mut seen = std::collections::HashSet::new();
        for e in &self.tensors {
            if !is_name(&e.name) {
                bail!(
                    "tensor name {:?} is not lower-case letters, digits and '-'",
                    e.name
                );
            }
            if !seen.insert(e.name.as_str()) {
                bail!("tensor {:?} is listed twice", e.name);
            }
            if !self.base_urls.contains_key(&e.base) {
                bail!("tensor {:?}: no base URL {:?}", e.name, e.base);
            }
            if !is_url_path(&e.path) {
                bail!(
                    "tensor {:?}: path {:?} is not a relative .tns.gz path of plain segments",
                    e.name,
                    e.path
                );
            }
            if let Some(sha) = &e.sha256 {
                if !is_sha256(sha) {
                    bail!(
                        "tensor {:?}: sha256 {sha:?} is not 64 lower-case hex digits",
                        e.name
                    );
                }
            }
        }
        Ok(())
    }

    /// The entry called `name`, by FROSTT's name or the short one `kruskal
    /// gen --like` also knows (`amazon` for `amazon-reviews`: one list of
    /// names, `kruskal_formats::generate::PRESETS`); the error says how to
    /// see the known names.
    pub fn get(&self, name: &str) -> Result<&Entry> {
        let frostt = kruskal_formats::generate::preset(name).map_or(name, |p| p.frostt);
        self.tensors
            .iter()
            .find(|e| e.name == frostt)
            .with_context(|| {
                format!(
                    "unknown tensor {name:?}; cargo xtask fetch-frostt --list shows the known names"
                )
            })
    }

    /// The URL of `entry`: its path under `mirror` when given (which ends
    /// in `/`), else under its base URL.
    pub fn url(&self, entry: &Entry, mirror: Option<&str>) -> String {
        let base = mirror.unwrap_or_else(|| &self.base_urls[&entry.base]);
        format!("{base}{}", entry.path)
    }

    /// Sets the size and SHA-256 of `name` in the manifest file at `path`,
    /// read afresh (another run may have recorded another tensor since),
    /// and rewrites it atomically (a temporary file beside it, renamed over
    /// it).
    pub fn record(path: &Path, name: &str, bytes: u64, sha256: &str) -> Result<()> {
        let mut manifest = Manifest::load(path)?;
        let entry = manifest
            .tensors
            .iter_mut()
            .find(|e| e.name == name)
            .with_context(|| format!("no tensor {name:?} in the manifest"))?;
        entry.bytes = Some(bytes);
        entry.sha256 = Some(sha256.to_string());
        let text = manifest.to_json()?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let write = || -> std::io::Result<()> {
            let mut tmp = tempfile::Builder::new()
                .prefix(".frostt-manifest.")
                .suffix(".tmp")
                .tempfile_in(dir)?;
            tmp.write_all(text.as_bytes())?;
            tmp.as_file().sync_all()?;
            tmp.persist(path)?;
            Ok(())
        };
        write().with_context(|| format!("writing the manifest {}", path.display()))
    }

    /// The manifest as written to its file: the base URLs, then one tensor
    /// a line.
    pub fn to_json(&self) -> Result<String> {
        let mut s = String::from("{\n  \"base_urls\": {\n");
        for (i, (key, url)) in self.base_urls.iter().enumerate() {
            let comma = if i + 1 < self.base_urls.len() {
                ","
            } else {
                ""
            };
            let (key, url) = (serde_json::to_string(key)?, serde_json::to_string(url)?);
            writeln!(s, "    {key}: {url}{comma}")?;
        }
        s.push_str("  },\n  \"tensors\": [\n");
        for (i, e) in self.tensors.iter().enumerate() {
            let comma = if i + 1 < self.tensors.len() { "," } else { "" };
            writeln!(s, "    {}{comma}", serde_json::to_string(e)?)?;
        }
        s.push_str("  ]\n}\n");
        Ok(s)
    }
}

fn is_name(s: &str) -> bool {
    s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn is_url_path(s: &str) -> bool {
    s.ends_with(".tns.gz")
        && s.split('/').all(|seg| {
            !seg.is_empty()
                && !seg.starts_with('.')
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        })
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// An `http://` or `https://` URL ending in `/`, with no query or fragment
/// for a path to be appended to.
pub fn check_base_url(url: &str) -> Result<()> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"));
    match rest {
        None => bail!("{url:?} is not an http:// or https:// URL"),
        Some(r) if r.is_empty() || r.starts_with('/') => bail!("{url:?} has no host"),
        Some(_) if url.contains(['?', '#', ' ']) || !url.ends_with('/') => {
            bail!("{url:?} must end in '/' and have no query, fragment or spaces")
        }
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo_manifest() -> std::path::PathBuf {
        crate::workspace_root().join(super::super::MANIFEST)
    }

    #[test]
    fn the_repository_manifest_is_valid_and_written_as_the_writer_writes_it() {
        let path = repo_manifest();
        let m = Manifest::load(&path).unwrap();
        assert!(m.get("nell-2").is_ok());
        assert!(m.get("lanl2").is_ok());
        // One list of names with `kruskal gen --like`: every FROSTT tensor
        // kruskal knows, in its order, found by either of its names, and
        // its shape kept there alone.
        let names: Vec<&str> = m.tensors.iter().map(|e| e.name.as_str()).collect();
        let presets: Vec<&str> = kruskal_formats::generate::PRESETS
            .iter()
            .map(|p| p.frostt)
            .collect();
        assert_eq!(names, presets);
        for p in kruskal_formats::generate::PRESETS {
            assert_eq!(m.get(p.name).unwrap().name, p.frostt);
            assert_eq!(m.get(p.frostt).unwrap().name, p.frostt);
        }
        assert!(
            m.tensors
                .iter()
                .all(|e| e.dims.is_none() && e.nnz.is_none())
        );
        // Recording a checksum rewrites the file; it must change only the
        // tensor's own line.
        assert_eq!(
            m.to_json().unwrap(),
            std::fs::read_to_string(&path).unwrap()
        );
    }

    #[test]
    fn names_and_paths_that_could_leave_their_folder_are_refused() {
        for bad in ["../etc/passwd", "a/b", ".hidden", "", "-x", "Nell", "a b"] {
            assert!(!is_name(bad), "{bad:?}");
        }
        assert!(is_name("nell-2") && is_name("1998darpa"));
        for bad in [
            "../x.tns.gz",
            "/x.tns.gz",
            "a//x.tns.gz",
            "a/./x.tns.gz",
            "a/.x.tns.gz",
            "a/x.tns",
            "a/x?.tns.gz",
            "a\\x.tns.gz",
        ] {
            assert!(!is_url_path(bad), "{bad:?}");
        }
        assert!(is_url_path("chicago-crime/comm/chicago-crime-comm.tns.gz"));
    }

    #[test]
    fn an_unsafe_entry_makes_the_manifest_an_error() {
        let m: Manifest = serde_json::from_str(
            r#"{"base_urls": {"b": "https://x/"},
                "tensors": [{"name": "t", "base": "b", "path": "../../t.tns.gz"}]}"#,
        )
        .unwrap();
        let err = m.check().unwrap_err().to_string();
        assert!(err.contains("../../t.tns.gz"), "{err}");
    }

    #[test]
    fn base_urls_must_be_http_and_end_in_a_slash() {
        assert!(check_base_url("https://example.org/frostt/").is_ok());
        assert!(check_base_url("http://127.0.0.1:8080/").is_ok());
        for bad in [
            "file:///etc/",
            "https://",
            "https:///x/",
            "https://x/y",
            "https://x/?a=/",
            "ftp://x/",
        ] {
            assert!(check_base_url(bad).is_err(), "{bad:?}");
        }
    }
}
