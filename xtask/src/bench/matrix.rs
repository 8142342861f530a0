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
//!
//! [[mttkrp]]           # per-mode MTTKRP times of single-device engines
//! backend = "gpu"      # cpu | gpu
//! tensors = ["nell-2"]
//! engines = ["coo", "fcoo", "auto"]
//! ranks = [32]
//! flags = ["--no-model"]   # more `kruskal mttkrp` flags
//! tag = "fixed defaults"   # shown after the engine's name
//!
//! [[cpd]]              # CPD-ALS time per iteration
//! backend = "gpus"     # cpu | gpu | gpus (a group of GPUs)
//! tensors = ["nell-2"]
//! gpus = [1, 2]        # group sizes (backend gpus)
//! exchange = ["nccl", "p2p"]
//! ranks = [32]
//! iters = 6            # the first iteration is not counted
//! ```
//!
//! Unknown keys are errors (a misspelt key would otherwise be ignored
//! silently), as are names of tensors the file does not define.

use std::collections::HashSet;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Matrix {
    #[serde(default)]
    pub settings: Settings,
    #[serde(default, rename = "tensor")]
    pub tensors: Vec<TensorSpec>,
    #[serde(default)]
    pub mttkrp: Vec<MttkrpEntry>,
    #[serde(default)]
    pub cpd: Vec<CpdEntry>,
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
pub struct TensorSpec {
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
    #[serde(default)]
    pub flags: Vec<String>,
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
                kruskal::cli::common::parse_count(nnz)
                    .map_err(|e| anyhow::anyhow!("tensor '{}': nnz: {e}", t.name))?;
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
        }
        Ok(())
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

impl TensorSpec {
    /// `kruskal` input arguments for this tensor: the FROSTT file when it
    /// is wanted and present, else the generated stand-in.
    pub fn input_args(&self, data_dir: &Path) -> Vec<String> {
        let file = data_dir.join(format!("{}.ktns", self.like.to_lowercase()));
        if self.frostt && file.is_file() {
            return vec![file.display().to_string()];
        }
        let mut args = vec!["--like".to_string(), self.like.clone()];
        if let Some(nnz) = &self.nnz {
            args.extend(["--nnz".to_string(), nnz.clone()]);
        }
        args.extend(["--gen-seed".to_string(), self.seed.to_string()]);
        args
    }
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
        assert_eq!(
            t.input_args(Path::new("/nonexistent")),
            ["--like", "nell-2", "--nnz", "2k", "--gen-seed", "1"]
        );
    }

    #[test]
    fn a_present_frostt_file_is_used_only_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("nell-2.ktns"), b"x").unwrap();
        let mut m = Matrix::parse(GOOD).unwrap();
        assert_eq!(m.tensors[0].input_args(dir.path())[0], "--like");
        m.tensors[0].frostt = true;
        let args = m.tensors[0].input_args(dir.path());
        assert_eq!(args.len(), 1);
        assert!(args[0].ends_with("nell-2.ktns"), "{args:?}");
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
        ];
        for (text, want) in cases {
            let e = format!("{:#}", Matrix::parse(&text).unwrap_err());
            assert!(e.contains(want), "{e:?} should contain {want:?}");
            assert!(!e.contains('\n'), "one line: {e:?}");
        }
    }

    /// The matrices in the repository parse.
    #[test]
    fn the_repository_matrices_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench");
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
