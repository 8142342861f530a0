//! The evaluation matrix: a TOML file naming the tensors and what to
//! measure on each (see `bench/gpu.toml` for a commented example).
//!
//! ```toml
//! [settings]
//! repeat = 10          # timed sweeps per mode (median reported)
//! data_dir = "frostt"  # where `cargo xtask fetch-frostt` puts .ktns files
//! torch = true         # PyTorch baseline for GPU MTTKRP tensors
//!
//! [[tensor]]
//! name = "nell-2"      # label in tables and plots
//! like = "nell-2"      # the FROSTT tensor it is (or is shaped like)
//! nnz = "20M"          # size of the generated stand-in (default: real count)
//! frostt = true        # use DATA_DIR/nell-2.ktns when it is there
//! counts = false       # values of the stand-in as counts (for CP-APR)
//!
//! [[tensor]]
//! name = "t3"
//! like = "nell-2"      # still required: the shape it has
//! path = "anchors/t3.ktns"   # a tensor file (relative to where the bench runs)
//! make = "python3 bench/gen_anchor.py t3 anchors/t3.ktns"  # how to make it
//!
//! [[mttkrp]]           # per-mode MTTKRP times of single-device engines
//! backend = "gpu"      # cpu | gpu
//! tensors = ["nell-2"]
//! engines = ["coo", "fcoo", "auto"]
//! ranks = [32]
//! flags = ["--no-model"]   # more `kruskal mttkrp` flags (see flags.rs)
//! tag = "fixed defaults"   # shown after the engine's name
//!
//! [[cpd]]              # CPD-ALS time per iteration
//! backend = "gpus"     # cpu | gpu | gpus (a group of GPUs)
//! tensors = ["nell-2"]
//! gpus = [1, 2]        # group sizes (backend gpus)
//! exchange = ["nccl", "p2p"]
//! ranks = [32]
//! iters = 6            # the first iteration is not counted
//!
//! [[cpd]]              # the same with constraints: AO-ADMM
//! backend = "gpu"      # cpu | gpu | gpus (a group, as for ALS)
//! tensors = ["nell-2"]
//! flags = ["--nonneg"] # also --l1 W, --l2 W, --admm-blocks
//! tag = "nonneg"       # default: derived from the flags (`ao-admm nonneg`)
//!
//! [[cp_apr]]           # CP-APR (Poisson), time per outer iteration
//! backend = "gpu"      # cpu | gpu
//! tensors = ["counts"] # non-negative values (see `counts` below)
//! ranks = [16]
//! iters = 6            # outer iterations; the first is not counted
//! flags = ["--inner-iters", "10"]  # more `kruskal cp-apr` flags (flags.rs)
//!
//! [[reference]]        # a figure measured elsewhere, shown beside ours
//! tool = "BLCO f32 (-k 10)"
//! tensor = "t3"        # a [[tensor]] of this file
//! rank = 32
//! ms = 3.91            # all-mode MTTKRP time
//! date = "2026-11-22"
//! machine = "one H100 80GB HBM3"
//! source = "mean of 20 after warm-up; ANCHORS.md"
//! ```
//!
//! Unknown keys are errors (a misspelt key would otherwise be ignored
//! silently), as are names of tensors the file does not define and
//! entries' `flags` their command would refuse (checked when the file is
//! read, before anything is measured). A tensor
//! with a `path` must have its file when the bench runs: the bench stops
//! before measuring anything and shows the `make` command.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use kruskal::cpd::AprOptions;
use kruskal::input::{TensorSource, parse_count};
use kruskal::measure::{CpdRunOptions, MttkrpOptions};
use kruskal_formats::{ReadOptions, SparseTensor};
use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Matrix {
    #[serde(default)]
    pub settings: Settings,
    #[serde(default, rename = "tensor")]
    pub tensors: Vec<BenchTensor>,
    #[serde(default)]
    pub mttkrp: Vec<MttkrpEntry>,
    #[serde(default)]
    pub cpd: Vec<CpdEntry>,
    #[serde(default)]
    pub cp_apr: Vec<CpAprEntry>,
    /// Figures measured elsewhere (another tool, another day), carried
    /// into the results and shown in the report beside ours.
    #[serde(default, rename = "reference")]
    pub references: Vec<Reference>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// Timed sweeps per mode after a warm-up (the median is reported).
    pub repeat: usize,
    /// Where FROSTT `.ktns` files are looked for (relative to the
    /// directory the bench runs in).
    pub data_dir: String,
    /// Run the PyTorch baseline on the tensors of GPU MTTKRP entries when
    /// `python3` with torch and a CUDA GPU is there.
    pub torch: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            repeat: 10,
            data_dir: "frostt".into(),
            torch: true,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BenchTensor {
    pub name: String,
    /// FROSTT name (one of `kruskal gen`'s presets).
    pub like: String,
    /// Nonzeros of the generated stand-in, e.g. `100M` (default: the real
    /// tensor's count).
    pub nnz: Option<String>,
    /// Seed of the generated stand-in.
    #[serde(default = "one")]
    pub seed: u64,
    /// Use `DATA_DIR/<like>.ktns` when it exists.
    #[serde(default)]
    pub frostt: bool,
    /// Check every MTTKRP against the f64 reference (slow on big tensors).
    #[serde(default)]
    pub verify: bool,
    /// A tensor file to read instead of generating one (relative to the
    /// directory the bench runs in); `like` still names its shape.
    pub path: Option<String>,
    /// The command that makes `path`, shown when the file is missing.
    pub make: Option<String>,
    /// Turn the generated stand-in's values (uniform in [0, 1)) into
    /// counts ([`as_counts`]), for CP-APR, whose Poisson model is meant for
    /// counts. A file (`path`, or the FROSTT file) is read as it is.
    #[serde(default)]
    pub counts: bool,
}

/// An all-mode MTTKRP time measured elsewhere (by another tool, on
/// another day), for the report to set beside this run's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reference {
    /// The tool and how it ran, e.g. `BLCO f32 (-k 10)`.
    pub tool: String,
    /// A tensor name of the matrix.
    pub tensor: String,
    pub rank: usize,
    /// All modes, ms.
    pub ms: f64,
    /// When it was measured.
    pub date: String,
    /// What it was measured on.
    pub machine: String,
    /// Where the figure comes from (free text).
    pub source: String,
}

fn one() -> u64 {
    1
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MttkrpEntry {
    pub backend: String,
    pub tensors: Vec<String>,
    pub engines: Vec<String>,
    #[serde(default = "rank_32")]
    pub ranks: Vec<usize>,
    /// More `kruskal mttkrp` flags, those `flags.rs` takes.
    #[serde(default)]
    pub flags: Vec<String>,
    /// Shown after the engine in tables and plots, e.g. `deterministic`
    /// for an entry with `flags = ["--deterministic"]`.
    pub tag: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpdEntry {
    #[serde(default = "gpus_backend")]
    pub backend: String,
    pub tensors: Vec<String>,
    #[serde(default = "one_gpu")]
    pub gpus: Vec<usize>,
    #[serde(default)]
    pub exchange: Vec<String>,
    #[serde(default = "rank_32")]
    pub ranks: Vec<usize>,
    #[serde(default = "six")]
    pub iters: usize,
    /// More `kruskal cpd` flags, those `flags.rs` takes.
    #[serde(default)]
    pub flags: Vec<String>,
    /// Shown after the engine; without one, a constrained entry's is
    /// derived from its flags (`ao-admm nonneg`), so that its rows stand
    /// apart from the ALS rows of the same engine.
    pub tag: Option<String>,
}

/// CP-APR (`kruskal cp-apr`): seconds per outer iteration and the final
/// log-likelihood.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpAprEntry {
    /// `cpu`, `gpu` (one GPU) or `gpus` (a group: `kruskal cp-apr --gpus N`).
    pub backend: String,
    pub tensors: Vec<String>,
    /// Group sizes (backend `gpus`).
    #[serde(default = "one_gpu")]
    pub gpus: Vec<usize>,
    #[serde(default = "rank_32")]
    pub ranks: Vec<usize>,
    /// Outer iterations at most (`--iters`); the first is not counted.
    #[serde(default = "six")]
    pub iters: usize,
    /// More `kruskal cp-apr` flags, those `flags.rs` takes.
    #[serde(default)]
    pub flags: Vec<String>,
    /// Shown after `cp-apr` in tables.
    pub tag: Option<String>,
}

fn rank_32() -> Vec<usize> {
    vec![32]
}

fn gpus_backend() -> String {
    "gpus".into()
}

fn one_gpu() -> Vec<usize> {
    vec![1]
}

fn six() -> usize {
    6
}

impl Matrix {
    /// Reads and checks a matrix file; errors name the file (and, for
    /// syntax and type errors, the line).
    pub fn load(path: &Path) -> Result<Matrix> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the matrix {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("matrix {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Matrix> {
        let m: Matrix = toml::from_str(text).map_err(|e| {
            // toml's message spans several lines with a source excerpt;
            // keep it to one line with the line number.
            let line = e
                .span()
                .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
            let msg = e.message().to_string();
            match line {
                Some(l) => anyhow::anyhow!("line {l}: {msg}"),
                None => anyhow::anyhow!("{msg}"),
            }
        })?;
        m.check()?;
        Ok(m)
    }

    fn check(&self) -> Result<()> {
        if self.settings.repeat == 0 {
            bail!("settings.repeat must be at least 1");
        }
        let mut names = HashSet::new();
        for t in &self.tensors {
            if !names.insert(t.name.as_str()) {
                bail!("tensor '{}' is defined twice", t.name);
            }
            kruskal_formats::generate::preset(&t.like)
                .with_context(|| format!("tensor '{}'", t.name))?;
            if let Some(nnz) = &t.nnz {
                parse_count(nnz).map_err(|e| anyhow::anyhow!("tensor '{}': nnz: {e}", t.name))?;
            }
            // A file is read as it is: the keys of the generated stand-in
            // (or of the FROSTT file) would be silently ignored.
            if t.path.is_some() && (t.nnz.is_some() || t.frostt) {
                bail!(
                    "tensor '{}': path reads a file; nnz and frostt do not apply",
                    t.name
                );
            }
            if t.counts && t.path.is_some() {
                bail!(
                    "tensor '{}': counts applies to a generated stand-in, not to a file (path)",
                    t.name
                );
            }
            if t.make.is_some() && t.path.is_none() {
                bail!(
                    "tensor '{}': make says how to make path, but there is no path",
                    t.name
                );
            }
        }
        let known = |what: &str, list: &[String]| -> Result<()> {
            if list.is_empty() {
                bail!("a [[{what}]] entry names no tensors");
            }
            for n in list {
                if !names.contains(n.as_str()) {
                    bail!("[[{what}]] names tensor '{n}', which no [[tensor]] defines");
                }
            }
            Ok(())
        };
        for e in &self.mttkrp {
            known("mttkrp", &e.tensors)?;
            super::flags::mttkrp(&e.flags, &mut MttkrpOptions::default())
                .context("[[mttkrp]] flags")?;
            if !["cpu", "gpu"].contains(&e.backend.as_str()) {
                bail!("[[mttkrp]] backend must be cpu or gpu, not '{}'", e.backend);
            }
            if e.engines.is_empty() || e.ranks.is_empty() || e.ranks.contains(&0) {
                bail!("[[mttkrp]] needs at least one engine and ranks of at least 1");
            }
        }
        for e in &self.cpd {
            known("cpd", &e.tensors)?;
            if !["cpu", "gpu", "gpus"].contains(&e.backend.as_str()) {
                bail!(
                    "[[cpd]] backend must be cpu, gpu or gpus, not '{}'",
                    e.backend
                );
            }
            if e.ranks.is_empty() || e.ranks.contains(&0) || e.iters < 2 {
                bail!("[[cpd]] needs ranks of at least 1 and iters of at least 2");
            }
            if e.backend == "gpus" && (e.gpus.is_empty() || e.gpus.contains(&0)) {
                bail!("[[cpd]] gpus must list group sizes of at least 1");
            }
            for x in &e.exchange {
                if !["nccl", "p2p"].contains(&x.as_str()) {
                    bail!("[[cpd]] exchange takes nccl or p2p, not '{x}'");
                }
            }
            let mut opts = CpdRunOptions::default();
            super::flags::cpd(&e.flags, &mut opts).context("[[cpd]] flags")?;
        }
        for e in &self.cp_apr {
            known("cp_apr", &e.tensors)?;
            if !["cpu", "gpu", "gpus"].contains(&e.backend.as_str()) {
                bail!(
                    "[[cp_apr]] backend must be cpu, gpu or gpus, not '{}'",
                    e.backend
                );
            }
            if e.ranks.is_empty() || e.ranks.contains(&0) || e.iters < 2 {
                bail!("[[cp_apr]] needs ranks of at least 1 and iters of at least 2");
            }
            if e.backend == "gpus" && (e.gpus.is_empty() || e.gpus.contains(&0)) {
                bail!("[[cp_apr]] gpus must list group sizes of at least 1");
            }
            super::flags::cp_apr(&e.flags, &mut AprOptions::new(1)).context("[[cp_apr]] flags")?;
        }
        for r in &self.references {
            if !names.contains(r.tensor.as_str()) {
                bail!(
                    "[[reference]] '{}' names tensor '{}', which no [[tensor]] defines",
                    r.tool,
                    r.tensor
                );
            }
            // `!(ms > 0)` also refuses NaN.
            if !(r.ms > 0.0 && r.ms.is_finite()) || r.rank == 0 {
                bail!(
                    "[[reference]] '{}' on '{}': ms must be above 0 and rank at least 1",
                    r.tool,
                    r.tensor
                );
            }
        }
        Ok(())
    }

    pub fn tensor(&self, name: &str) -> Option<&BenchTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

impl BenchTensor {
    /// Where this tensor comes from: its own file when it has a `path`,
    /// the FROSTT file when it is wanted and present, else the generated
    /// stand-in.
    pub fn source(&self, data_dir: &Path) -> Result<TensorSource> {
        let file = |path: PathBuf| TensorSource::File {
            path,
            read: ReadOptions::default(),
        };
        if let Some(path) = &self.path {
            return Ok(file(PathBuf::from(path)));
        }
        let ktns = data_dir.join(format!("{}.ktns", self.like.to_lowercase()));
        if self.frostt && ktns.is_file() {
            return Ok(file(ktns));
        }
        let nnz = match &self.nnz {
            Some(text) => Some(
                parse_count(text)
                    .map_err(|e| anyhow::anyhow!("tensor '{}': nnz: {e}", self.name))?,
            ),
            None => None,
        };
        Ok(TensorSource::Like {
            name: self.like.clone(),
            nnz,
            seed: self.seed,
        })
    }

    /// Fails when the tensor has a `path` and no file is there, with
    /// the command that makes it (relative paths from `base`, the
    /// directory the bench runs in).
    pub fn check_file(&self, base: &Path) -> Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        if base.join(path).is_file() {
            return Ok(());
        }
        match &self.make {
            Some(make) => bail!(
                "tensor '{}': {path} not found; the matrix says to make it with `{make}`",
                self.name
            ),
            None => bail!(
                "tensor '{}': {path} not found (the matrix gives no `make` command for it)",
                self.name
            ),
        }
    }
}

/// A generated stand-in's values, uniform in [0, 1), as counts: `v`
/// becomes `floor(1 / (1 - v))`, so that a count is at least `k` with
/// probability `1 / k` (half are 1, with the long tail of real counts:
/// words, clicks, packets), always a whole number of at least 1.
pub fn as_counts(tensor: SparseTensor) -> Result<SparseTensor> {
    let (dims, indices, values) = tensor.into_parts();
    let counts = values
        .into_iter()
        .map(|v| (1.0 / (1.0 - v.clamp(0.0, 1.0 - f32::EPSILON))).floor())
        .collect();
    Ok(SparseTensor::new(dims, indices, counts)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[settings]
repeat = 3

[[tensor]]
name = "small"
like = "nell-2"
nnz = "2k"

[[mttkrp]]
backend = "cpu"
tensors = ["small"]
engines = ["sorted", "fcoo"]

[[cpd]]
backend = "cpu"
tensors = ["small"]
iters = 3
"#;

    #[test]
    fn a_good_matrix_parses_with_defaults() {
        let m = Matrix::parse(GOOD).unwrap();
        assert_eq!(m.settings.repeat, 3);
        assert_eq!(m.settings.data_dir, "frostt");
        assert_eq!(m.mttkrp[0].ranks, vec![32]);
        assert_eq!(m.cpd[0].gpus, vec![1]);
        let t = m.tensor("small").unwrap();
        assert_eq!(t.seed, 1);
        assert!(
            matches!(
                t.source(Path::new("/nonexistent")).unwrap(),
                TensorSource::Like { name, nnz: Some(2_000), seed: 1 } if name == "nell-2"
            ),
            "{:?}",
            t.source(Path::new("/nonexistent"))
        );
    }

    #[test]
    fn a_present_frostt_file_is_used_only_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("nell-2.ktns"), b"x").unwrap();
        let mut m = Matrix::parse(GOOD).unwrap();
        let source = m.tensors[0].source(dir.path()).unwrap();
        assert!(matches!(source, TensorSource::Like { .. }), "{source:?}");
        m.tensors[0].frostt = true;
        let source = m.tensors[0].source(dir.path()).unwrap();
        assert!(
            matches!(&source, TensorSource::File { path, .. } if path.ends_with("nell-2.ktns")),
            "{source:?}"
        );
    }

    /// A tensor read from a file, and a figure measured elsewhere on it.
    const WITH_FILE: &str = r#"
[[tensor]]
name = "t3"
like = "nell-2"
path = "anchors/t3.ktns"
make = "python3 bench/gen_anchor.py t3 anchors/t3.ktns"

[[mttkrp]]
backend = "gpu"
tensors = ["t3"]
engines = ["fcoo"]

[[reference]]
tool = "BLCO f32 (-k 10)"
tensor = "t3"
rank = 32
ms = 3.91
date = "2026-11-22"
machine = "one H100"
source = "ANCHORS.md"
"#;

    #[test]
    fn a_tensor_file_and_its_make_command_parse_and_are_used() {
        let m = Matrix::parse(WITH_FILE).unwrap();
        let t = m.tensor("t3").unwrap();
        assert_eq!(t.path.as_deref(), Some("anchors/t3.ktns"));
        assert_eq!(
            t.make.as_deref(),
            Some("python3 bench/gen_anchor.py t3 anchors/t3.ktns")
        );
        // The file, whatever the data folder; `like` only names the shape.
        let source = t.source(Path::new("frostt")).unwrap();
        assert!(
            matches!(&source, TensorSource::File { path, .. } if path == Path::new("anchors/t3.ktns")),
            "{source:?}"
        );
        assert_eq!(
            m.references,
            [Reference {
                tool: "BLCO f32 (-k 10)".into(),
                tensor: "t3".into(),
                rank: 32,
                ms: 3.91,
                date: "2026-11-22".into(),
                machine: "one H100".into(),
                source: "ANCHORS.md".into(),
            }]
        );
        // Tensors without a path are left as they were.
        assert_eq!(Matrix::parse(GOOD).unwrap().tensors[0].path, None);
    }

    #[test]
    fn a_missing_tensor_file_is_one_line_with_its_make_command() {
        let dir = tempfile::tempdir().unwrap();
        let m = Matrix::parse(WITH_FILE).unwrap();
        let t = m.tensor("t3").unwrap();
        let e = format!("{:#}", t.check_file(dir.path()).unwrap_err());
        assert_eq!(
            e,
            "tensor 't3': anchors/t3.ktns not found; the matrix says to make it with \
             `python3 bench/gen_anchor.py t3 anchors/t3.ktns`"
        );
        let mut bare = t.clone();
        bare.make = None;
        let e = format!("{:#}", bare.check_file(dir.path()).unwrap_err());
        assert!(e.contains("no `make` command"), "{e}");
        std::fs::create_dir(dir.path().join("anchors")).unwrap();
        std::fs::write(dir.path().join("anchors/t3.ktns"), b"x").unwrap();
        t.check_file(dir.path()).unwrap();
        // Generated tensors have no file to check.
        Matrix::parse(GOOD).unwrap().tensors[0]
            .check_file(dir.path())
            .unwrap();
    }

    #[test]
    fn mistakes_are_one_line_errors() {
        let cases = [
            (
                GOOD.replace("repeat = 3", "repeats = 3"),
                "line 3: unknown field `repeats`",
            ),
            (
                GOOD.replace("nnz = \"2k\"", "nnz = 2000"),
                "line 8: invalid type",
            ),
            (
                GOOD.replace("like = \"nell-2\"", "like = \"nell-3\""),
                "nell-3",
            ),
            (
                GOOD.replace("nnz = \"2k\"", "nnz = \"lots\""),
                "tensor 'small': nnz",
            ),
            (
                GOOD.replace("tensors = [\"small\"]\niters", "tensors = [\"big\"]\niters"),
                "'big'",
            ),
            (
                GOOD.replace(
                    "backend = \"cpu\"\ntensors = [\"small\"]\neng",
                    "backend = \"tpu\"\ntensors = [\"small\"]\neng",
                ),
                "'tpu'",
            ),
            (
                GOOD.replace("iters = 3", "iters = 1"),
                "iters of at least 2",
            ),
            (
                GOOD.replace("repeat = 3", "repeat = 0"),
                "repeat must be at least 1",
            ),
            (
                format!("{GOOD}\n[[tensor]]\nname = \"small\"\nlike = \"enron\"\n"),
                "defined twice",
            ),
            (
                format!("{GOOD}\n[[cpd]]\ntensors = [\"small\"]\nexchange = [\"mpi\"]\n"),
                "'mpi'",
            ),
            (
                GOOD.replace("nnz = \"2k\"", "nnz = \"2k\"\npath = \"small.ktns\""),
                "nnz and frostt do not apply",
            ),
            (
                GOOD.replace("nnz = \"2k\"", "make = \"true\""),
                "there is no path",
            ),
            (
                WITH_FILE.replace("tensor = \"t3\"", "tensor = \"t5\""),
                "names tensor 't5'",
            ),
            (
                WITH_FILE.replace("ms = 3.91", "ms = 0.0"),
                "ms must be above 0",
            ),
            (
                WITH_FILE.replace("ms = 3.91", "ms = nan"),
                "ms must be above 0",
            ),
            (
                WITH_FILE.replace("source = \"ANCHORS.md\"", ""),
                "missing field `source`",
            ),
        ];
        for (text, want) in cases {
            let e = format!("{:#}", Matrix::parse(&text).unwrap_err());
            assert!(e.contains(want), "{e:?} should contain {want:?}");
            assert!(!e.contains('\n'), "one line: {e:?}");
        }
    }

    /// A count tensor, ALS and AO-ADMM CPD, and CP-APR.
    const BEYOND: &str = r#"
[[tensor]]
name = "counts"
like = "nell-2"
nnz = "2k"
counts = true

[[cpd]]
backend = "cpu"
tensors = ["counts"]
flags = ["--nonneg"]

[[cp_apr]]
backend = "gpu"
tensors = ["counts"]
ranks = [8, 16]
iters = 4
flags = ["--inner-iters", "5", "--kappa", "0.02"]
tag = "mu"
"#;

    #[test]
    fn cp_apr_entries_and_constraint_flags_parse() {
        let m = Matrix::parse(BEYOND).unwrap();
        assert!(m.tensors[0].counts);
        assert!(!Matrix::parse(GOOD).unwrap().tensors[0].counts);
        assert_eq!(m.cpd[0].flags, ["--nonneg"]);
        let e = &m.cp_apr[0];
        assert_eq!(e.backend, "gpu");
        assert_eq!(e.tensors, ["counts"]);
        assert_eq!(e.ranks, [8, 16]);
        assert_eq!(e.iters, 4);
        assert_eq!(e.tag.as_deref(), Some("mu"));
        // Defaults: rank 32, 6 outer iterations, no flags.
        let bare = Matrix::parse(
            "[[tensor]]\nname = \"c\"\nlike = \"enron\"\n\
             [[cp_apr]]\nbackend = \"cpu\"\ntensors = [\"c\"]\n",
        )
        .unwrap();
        let e = &bare.cp_apr[0];
        assert_eq!((e.ranks.as_slice(), e.iters), (&[32][..], 6));
        assert_eq!(e.gpus, [1]);
        let group = Matrix::parse(
            &BEYOND.replace("backend = \"gpu\"", "backend = \"gpus\"\ngpus = [2, 4]"),
        )
        .unwrap();
        assert_eq!(group.cp_apr[0].gpus, [2, 4]);
        assert!(e.flags.is_empty() && e.tag.is_none());
    }

    #[test]
    fn bad_cp_apr_entries_and_flags_are_one_line_errors() {
        let cases = [
            (
                BEYOND.replace("\"--inner-iters\", \"5\"", "\"--frobnicate\""),
                "[[cp_apr]] flags: `kruskal cp-apr --frobnicate --kappa 0.02`",
            ),
            (
                BEYOND.replace("\"--inner-iters\", \"5\"", "\"--inner-iters\", \"0\""),
                "[[cp_apr]] flags",
            ),
            (
                BEYOND.replace("\"--kappa\", \"0.02\"", "\"--kappa\", \"-1\""),
                "[[cp_apr]] flags",
            ),
            (
                BEYOND.replace("ranks = [8, 16]", "ranks = [0]"),
                "[[cp_apr]] needs ranks of at least 1",
            ),
            (
                BEYOND.replace("iters = 4", "iters = 1"),
                "iters of at least 2",
            ),
            (
                BEYOND.replace("backend = \"gpu\"", "backend = \"tpu\""),
                "[[cp_apr]] backend must be cpu, gpu or gpus, not 'tpu'",
            ),
            (
                BEYOND.replace("backend = \"gpu\"", "backend = \"gpus\"\ngpus = [2, 0]"),
                "[[cp_apr]] gpus must list group sizes of at least 1",
            ),
            (
                BEYOND.replace(
                    "backend = \"gpu\"\ntensors = [\"counts\"]",
                    "backend = \"gpu\"\ntensors = [\"tally\"]",
                ),
                "[[cp_apr]] names tensor 'tally', which no [[tensor]] defines",
            ),
            (
                BEYOND.replace(
                    "backend = \"gpu\"\ntensors = [\"counts\"]",
                    "backend = \"gpu\"\ntensors = []",
                ),
                "a [[cp_apr]] entry names no tensors",
            ),
            (
                BEYOND.replace(
                    "backend = \"gpu\"\ntensors = [\"counts\"]",
                    "backend = \"gpu\"",
                ),
                "missing field `tensors`",
            ),
            (
                BEYOND.replace("tag = \"mu\"", "tags = \"mu\""),
                "unknown field `tags`",
            ),
            (
                BEYOND.replace("[\"--nonneg\"]", "[\"--nonneg\", \"0\"]"),
                "[[cpd]] flags: `kruskal cpd --nonneg 0`",
            ),
            (
                BEYOND.replace("[\"--nonneg\"]", "[\"--l1\", \"-0.1\"]"),
                "[[cpd]] flags",
            ),
            (
                BEYOND.replace("[\"--nonneg\"]", "[\"--admm-blocks\"]"),
                "--admm-blocks is for AO-ADMM",
            ),
            (
                BEYOND
                    .replace("counts = true", "counts = true\npath = \"c.ktns\"")
                    .replace("nnz = \"2k\"\n", ""),
                "counts applies to a generated stand-in",
            ),
            (
                GOOD.replace(
                    "engines = [\"sorted\", \"fcoo\"]",
                    "engines = [\"sorted\"]\nflags = [\"--nonneg\"]",
                ),
                "[[mttkrp]] flags",
            ),
        ];
        for (text, want) in cases {
            let e = format!("{:#}", Matrix::parse(&text).unwrap_err());
            assert!(e.contains(want), "{e:?} should contain {want:?}");
            assert!(!e.contains('\n'), "one line: {e:?}");
        }
    }

    #[test]
    fn counts_are_whole_numbers_of_at_least_one_with_a_long_tail() {
        let t = SparseTensor::new(
            vec![4, 3],
            vec![vec![0, 1, 2, 3], vec![0, 1, 2, 0]],
            vec![0.0, 0.5, 0.75, 0.999],
        )
        .unwrap();
        let c = as_counts(t).unwrap();
        assert_eq!(c.values(), [1.0, 2.0, 4.0, 1000.0]);
        assert_eq!(c.dims(), [4, 3]);
        let g = TensorSource::Like {
            name: "enron".into(),
            nnz: Some(5_000),
            seed: 1,
        }
        .load()
        .unwrap();
        let c = as_counts(g.tensor).unwrap();
        assert!(c.values().iter().all(|v| v.fract() == 0.0 && *v >= 1.0));
        let ones = c.values().iter().filter(|v| **v == 1.0).count() as f64;
        // P(count = 1) = 1/2.
        assert!((ones / c.nnz() as f64 - 0.5).abs() < 0.05, "{ones}");
        assert!(c.values().iter().any(|v| *v >= 10.0));
    }

    /// The matrices in the repository parse.
    #[test]
    fn the_repository_matrices_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                Matrix::load(&p).unwrap();
                n += 1;
            }
        }
        assert!(n >= 3, "{n} matrices in {}", dir.display());
    }
}
