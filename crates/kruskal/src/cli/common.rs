//! Options and helpers shared by several subcommands: where the tensor comes
//! from, the GPU options, thread count, dimensions.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use kruskal_formats::ReadOptions;

use kruskal::input::{Loaded, TensorSource, parse_count};

/// How to read a tensor file.
#[derive(Args, Clone, Debug, Default)]
pub struct ReadArgs {
    /// Text indices start at 0 (FROSTT files start at 1).
    #[arg(long)]
    pub zero_based: bool,
    /// Every column is an index and every value is 1 (files with no value
    /// column, e.g. knowledge-graph facts).
    #[arg(long)]
    pub pattern: bool,
    /// The last column is data: do not warn when it looks like an index.
    #[arg(long)]
    pub values_are_data: bool,
    /// The tensor's dimensions, e.g. 1000,800,600 (default: the largest
    /// index of each mode); an index beyond them is an error.
    #[arg(long, value_name = "D1,D2,...", value_parser = parse_dims_arg)]
    pub dims: Option<Dims>,
}

/// A `--dims` list (a newtype so clap takes it as one value).
#[derive(Clone, Debug)]
pub struct Dims(pub Vec<u32>);

impl ReadArgs {
    pub fn options(&self) -> ReadOptions {
        ReadOptions {
            zero_based: self.zero_based,
            pattern: self.pattern,
            allow_index_like_values: self.values_are_data,
            dims: self.dims.as_ref().map(|d| d.0.clone()),
            ..ReadOptions::default()
        }
    }
}

fn parse_dims_arg(text: &str) -> Result<Dims, String> {
    parse_dims(text).map(Dims).map_err(|e| e.to_string())
}

/// A tensor from a file, or generated in memory with `--like`.
#[derive(Args, Clone, Debug, Default)]
pub struct InputArgs {
    /// Tensor file: FROSTT text (.tns, .tns.gz) or kruskal binary (.ktns).
    pub file: Option<PathBuf>,
    /// Instead of a file, generate a power-law tensor shaped like a FROSTT
    /// tensor (nell-2, nell-1, delicious-4d, flickr-4d, enron, vast-5d, ...).
    #[arg(long, value_name = "NAME", conflicts_with = "file")]
    pub like: Option<String>,
    /// Nonzeros of the generated tensor (default: the real tensor's count).
    #[arg(long, requires = "like", value_parser = parse_count)]
    pub nnz: Option<usize>,
    /// Seed of the generated tensor.
    #[arg(long, default_value_t = 1, requires = "like", allow_negative_numbers = true, value_parser = parse_seed)]
    pub gen_seed: u64,
    #[command(flatten)]
    pub read: ReadArgs,
}

impl InputArgs {
    /// Where the tensor comes from: `--like` wins over a file; `None`
    /// when neither is given.
    pub fn source(&self) -> Option<TensorSource> {
        if let Some(name) = &self.like {
            return Some(TensorSource::Like {
                name: name.clone(),
                nnz: self.nnz,
                seed: self.gen_seed,
            });
        }
        let path = self.file.clone()?;
        Some(TensorSource::File {
            path,
            read: self.read.options(),
        })
    }

    /// Reads or generates the tensor ([`TensorSource::load`]).
    pub fn load(&self) -> Result<Loaded> {
        let source = self
            .source()
            .context("give a tensor FILE, or --like NAME to generate one")?;
        Ok(source.load()?)
    }
}

/// Launch options of the GPU engines (`kruskal cpd` and `kruskal mttkrp`).
#[derive(Args, Clone, Debug, Default)]
pub struct GpuArgs {
    /// GPU flycoo: sum pieces of split rows in a fixed order (bit-identical
    /// results run to run) instead of by atomics.
    #[arg(long)]
    pub deterministic: bool,
    /// GPU flycoo: LPT partitions (thread blocks) per mode (default 4 per SM).
    #[arg(long)]
    pub kappa: Option<usize>,
    /// GPU fcoo: nonzeros per thread, a power of two from 1 to 256
    /// (default 8).
    #[arg(long)]
    pub threadlen: Option<usize>,
    /// GPU hicoo: blocks 2^b indices wide, b from 1 to 8 (default 7).
    #[arg(long)]
    pub block_bits: Option<u32>,
    /// GPU fcoo: fiber reuse, a fiber's factor row gathered once per fiber
    /// of an output row instead of once per nonzero (default off).
    #[arg(long, value_enum)]
    pub fiber: Option<OnOff>,
    /// GPU fcoo: gather factor rows from a 16-bit copy, bf16 or f16
    /// (half the bytes; products and sums keep f32/f64; the relative error
    /// grows to about 1e-3 for bf16, 1e-4 for f16; f16 holds values up to
    /// 65504).
    #[arg(long, default_value = "f32", value_parser = parse_precision)]
    pub factor_precision: kruskal_device::FactorPrecision,
    /// GPU fcoo at ranks 16, 32, 64 and 128: lane teams, rank / 4 lanes per
    /// nonzero with 16-byte gathers, 128 / rank nonzeros per warp step
    /// (default on).
    #[arg(long, value_enum)]
    pub teams: Option<OnOff>,
    /// GPU fcoo with lane teams: rounds of gathers issued before the first
    /// is added, 1, 2, 4 or 8 (more loads in flight per warp, more
    /// registers; default 1).
    #[arg(long)]
    pub rounds: Option<u32>,
    /// GPU fcoo with lane teams: load the next 32 nonzeros' indices before
    /// gathering the current ones' rows (default off).
    #[arg(long, value_enum)]
    pub prefetch: Option<OnOff>,
    /// GPU fcoo: thread blocks per SM the kernel's registers must leave
    /// room for, 1 to 4 (higher occupancy, possible spills; default 1).
    #[arg(long)]
    pub min_blocks: Option<u32>,
    /// GPU fcoo with lane teams: sum each 32 nonzeros' products in f32
    /// (at most 128 / rank per lane) before adding them to the f64 sums
    /// (default off).
    #[arg(long, value_enum)]
    pub group_sums: Option<OnOff>,
    /// GPU fcoo: where the F-COO layout is built, gpu (radix sort on the
    /// device from one upload of the tensor) or host (sorted here, each
    /// mode uploaded). gpu falls back to host for fiber reuse or when the
    /// GPU lacks memory for the sort. With --gpus, where the shards are
    /// built: gpu (each GPU its own, where they all stay resident and the
    /// build fits) or host.
    #[arg(long, default_value = "gpu")]
    pub fcoo_build: kruskal_device::FcooBuild,
    /// GPU: ignore the tuning model; `auto` is the fixed default and every
    /// parameter not given is the fixed default.
    #[arg(long)]
    pub no_model: bool,
}

impl GpuArgs {
    /// The GPU launch options given, by flag (empty when none).
    pub fn given(&self) -> Vec<&'static str> {
        use kruskal_device::{FactorPrecision, FcooBuild};
        [
            ("--deterministic", self.deterministic),
            ("--kappa", self.kappa.is_some()),
            ("--threadlen", self.threadlen.is_some()),
            ("--block-bits", self.block_bits.is_some()),
            ("--fiber", self.fiber.is_some()),
            (
                "--factor-precision",
                self.factor_precision != FactorPrecision::F32,
            ),
            ("--teams", self.teams.is_some()),
            ("--rounds", self.rounds.is_some()),
            ("--prefetch", self.prefetch.is_some()),
            ("--min-blocks", self.min_blocks.is_some()),
            ("--group-sums", self.group_sums.is_some()),
            ("--fcoo-build", self.fcoo_build != FcooBuild::Device),
            ("--no-model", self.no_model),
        ]
        .into_iter()
        .filter(|&(_, on)| on)
        .map(|(flag, _)| flag)
        .collect()
    }

    /// Refuses GPU launch options out of their ranges, whatever the
    /// backend, and any of them for a run that is on the CPU (`on_cpu`),
    /// where they would be ignored.
    pub fn check(&self, on_cpu: bool) -> Result<()> {
        if let Some(t) = self
            .threadlen
            .filter(|t| !(1..=256).contains(t) || !t.is_power_of_two())
        {
            bail!("--threadlen {t}: a power of two from 1 to 256");
        }
        if let Some(b) = self.block_bits.filter(|b| !(1..=8).contains(b)) {
            bail!("--block-bits {b}: from 1 to 8");
        }
        if self.kappa == Some(0) {
            bail!("--kappa 0: at least 1 partition per mode");
        }
        use kruskal_device::options::TeamPipeline;
        if let Some(r) = self.rounds.filter(|&r| !TeamPipeline::rounds_ok(r)) {
            bail!("--rounds {r}: 1, 2, 4 or 8");
        }
        if let Some(b) = self.min_blocks.filter(|&b| !TeamPipeline::min_blocks_ok(b)) {
            bail!("--min-blocks {b}: from 1 to 4");
        }
        let given = self.given();
        if on_cpu && !given.is_empty() {
            bail!(
                "{}: options of the GPU engines, and this run is on the CPU (--backend cpu, or no \
                 GPU here)",
                given.join(", ")
            );
        }
        Ok(())
    }

    pub fn options(&self) -> kruskal_device::GpuOptions {
        kruskal_device::GpuOptions {
            kappa: self.kappa,
            deterministic: self.deterministic,
            threadlen: self.threadlen,
            block_bits: self.block_bits,
            fiber: self.fiber.map(|f| f == OnOff::On),
            precision: self.factor_precision,
            teams: self.teams.map(|t| t == OnOff::On),
            fcoo_build: self.fcoo_build,
            rounds: self.rounds,
            prefetch: self.prefetch.map(|p| p == OnOff::On),
            min_blocks: self.min_blocks,
            group_sums: self.group_sums.map(|g| g == OnOff::On),
        }
    }
}

fn parse_precision(s: &str) -> std::result::Result<kruskal_device::FactorPrecision, String> {
    s.parse()
}

/// A switch given as `on` or `off`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnOff {
    On,
    Off,
}

/// Defaults of the several-GPU options (also what [`MultiGpuArgs::check_used`]
/// compares with).
const DEFAULT_STREAM: &str = "auto";
const DEFAULT_EXCHANGE_ROWS: &str = "auto";
const DEFAULT_GPU_PLAN: &str = "auto";
const DEFAULT_PARTIAL_REDUCE: &str = "nccl";
const DEFAULT_STREAMS: usize = 3;
const DEFAULT_SEGMENT_MB: usize = 256;
const DEFAULT_GPU_TIMEOUT_S: u64 = 300;

/// Several GPUs (`kruskal cpd` and `kruskal mttkrp`).
#[derive(Args, Clone, Debug, Default)]
pub struct MultiGpuArgs {
    /// Run on several GPUs of this host: a count (the first N) or `all`
    /// (for `cpd`: as many as pay for the tensor, predicted from its size
    /// and the exchange; a small tensor stays on one GPU, and the output
    /// says why). Each GPU gets whole output rows of every mode (AMPED
    /// shards); rows are exchanged after every mode.
    #[arg(long, value_name = "N|all")]
    pub gpus: Option<String>,
    /// How factor rows travel between GPUs: nccl (default when NCCL
    /// loads) or p2p (peer-to-peer copies around the ring).
    #[arg(long, value_name = "nccl|p2p")]
    pub exchange: Option<String>,
    /// Which factor rows travel after each mode: auto (per mode, the
    /// cheaper of the two), all (every row to every GPU, an all-gather) or
    /// read (only the rows each GPU's shards read).
    #[arg(long, value_name = "auto|all|read", default_value = DEFAULT_EXCHANGE_ROWS)]
    pub exchange_rows: String,
    /// How the tensor is cut over the GPUs: rows (each mode's output rows
    /// by owner, AMPED), split (every mode's nonzeros by the owners of one
    /// mode, whose rows then never travel; the other modes' partial sums
    /// are reduced through NCCL; split:MODE names the mode), or auto (the
    /// plan that sends fewer rows per iteration, counted from the tensor's
    /// rows; the output says which and why).
    #[arg(long, value_name = "auto|rows|split[:MODE]", default_value = DEFAULT_GPU_PLAN)]
    pub gpu_plan: String,
    /// How a split plan's partial sums reach their owners in one process:
    /// nccl (NCCL after the MTTKRP: reductions, or sends of the rows read
    /// where the exchange sends only those), pull (where only the rows
    /// read are exchanged, each owner reads the partial sums of its rows
    /// out of the GPUs that read them, and the rows travel back by peer
    /// reads too; needs peer access between every pair) or copies (peer
    /// copies on the copy engines while the MTTKRP goes on, where every
    /// pair has peer access and every shard is resident); NCCL where the
    /// choice cannot run.
    #[arg(long, value_name = "nccl|pull|copies", default_value = DEFAULT_PARTIAL_REDUCE)]
    pub partial_reduce: String,
    /// Stream shards from pinned host memory: auto (only what does not
    /// fit), always, never.
    #[arg(long, value_name = "auto|always|never", default_value = DEFAULT_STREAM)]
    pub stream: String,
    /// CUDA streams a streamed shard is copied on.
    #[arg(long, default_value_t = DEFAULT_STREAMS)]
    pub streams: usize,
    /// Size of a streamed segment, MiB.
    #[arg(long, default_value_t = DEFAULT_SEGMENT_MB)]
    pub segment_mb: usize,
    /// Longest wait for a GPU operation before the run stops with an error
    /// naming the GPU, seconds.
    #[arg(long, default_value_t = DEFAULT_GPU_TIMEOUT_S)]
    pub gpu_timeout_s: u64,
}

impl MultiGpuArgs {
    /// An error when an option of several GPUs is given to a run on one
    /// (`several`: `--gpus` or `--distributed` was given).
    pub fn check_used(&self, several: bool) -> Result<()> {
        let changed = self.exchange.is_some()
            || self.exchange_rows != DEFAULT_EXCHANGE_ROWS
            || self.gpu_plan != DEFAULT_GPU_PLAN
            || self.partial_reduce != DEFAULT_PARTIAL_REDUCE
            || self.stream != DEFAULT_STREAM
            || self.streams != DEFAULT_STREAMS
            || self.segment_mb != DEFAULT_SEGMENT_MB
            || self.gpu_timeout_s != DEFAULT_GPU_TIMEOUT_S;
        if changed && !several && self.gpus.is_none() {
            bail!(
                "--exchange, --exchange-rows, --gpu-plan, --partial-reduce, --stream, --streams, --segment-mb and --gpu-timeout-s apply to runs on several GPUs (--gpus or --distributed)"
            );
        }
        Ok(())
    }

    /// `--gpus all`: every GPU may be used, and the run takes as many as
    /// pay for the tensor (fewer, or one, when more would be slower).
    pub fn all(&self) -> bool {
        self.gpus.as_deref() == Some("all")
    }

    /// The GPU ordinals `--gpus` names (`None` without `--gpus`).
    pub fn ordinals(&self) -> Result<Option<Vec<usize>>> {
        let Some(text) = &self.gpus else {
            return Ok(None);
        };
        let n = if text == "all" {
            kruskal_device::Gpu::count()?
        } else {
            text.parse::<usize>()
                .map_err(|_| anyhow::anyhow!("--gpus takes a count or 'all', not '{text}'"))?
        };
        Ok(Some(kruskal_cpd::decompose::first_gpus(n)?))
    }

    /// The group's options (`--exchange`, `--stream`, ...), checked.
    pub fn options(&self) -> Result<kruskal_group::GroupOptions> {
        use kruskal_group::{Exchange, StreamPolicy};
        let exchange = match self.exchange.as_deref() {
            None => None,
            Some("nccl") => Some(Exchange::Nccl),
            Some("p2p") => Some(Exchange::P2p),
            Some(other) => bail!("--exchange takes nccl or p2p, not '{other}'"),
        };
        let rows = self
            .exchange_rows
            .parse::<kruskal_group::RowExchange>()
            .map_err(|e| anyhow::anyhow!("--exchange-rows {e}"))?;
        let plan = self
            .gpu_plan
            .parse::<kruskal_group::PlanChoice>()
            .map_err(|e| anyhow::anyhow!("--gpu-plan {e}"))?;
        let reduce = self
            .partial_reduce
            .parse::<kruskal_group::PartialReduce>()
            .map_err(|e| anyhow::anyhow!("--partial-reduce {e}"))?;
        let stream = match self.stream.as_str() {
            "auto" => StreamPolicy::Auto,
            "always" => StreamPolicy::Always,
            "never" => StreamPolicy::Never,
            other => bail!("--stream takes auto, always or never, not '{other}'"),
        };
        if self.streams == 0 || self.segment_mb == 0 || self.gpu_timeout_s == 0 {
            bail!("--streams, --segment-mb and --gpu-timeout-s must be at least 1");
        }
        // The rest is the failure tests' fault-injection hook: off.
        let options = kruskal_group::GroupOptions {
            exchange,
            rows,
            plan,
            reduce,
            stream,
            streams: self.streams,
            segment_bytes: self.segment_mb << 20,
            timeout: std::time::Duration::from_secs(self.gpu_timeout_s),
            ..Default::default()
        };
        Ok(options)
    }

    /// The GPUs `--gpus` names and, with them, the group's options (the
    /// defaults without `--gpus`).
    pub fn group(&self) -> Result<(Option<Vec<usize>>, kruskal_group::GroupOptions)> {
        let gpus = self.ordinals()?;
        let group = match gpus {
            Some(_) => self.options()?,
            None => Default::default(),
        };
        Ok((gpus, group))
    }
}

/// The most worker threads per core `--threads` takes: more only adds
/// switching (and a pool of 100,000 threads takes minutes to start).
pub const MAX_THREADS_PER_CORE: usize = 4;

/// Sets the size of rayon's global pool (0: one thread per core). More
/// than [`MAX_THREADS_PER_CORE`] per core is refused.
pub fn set_threads(threads: usize) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads > MAX_THREADS_PER_CORE * cores {
        bail!(
            "--threads {threads}: at most {} on this machine ({MAX_THREADS_PER_CORE} per core, \
             {cores} cores)",
            MAX_THREADS_PER_CORE * cores
        );
    }
    if threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()
            .context("could not set the thread count")?;
    }
    Ok(())
}

/// Parses a whole-number option that is at least `min`, so that a
/// negative or fractional value gets the program's own rule (`rule`) as
/// its message rather than the number parser's ("invalid digit").
fn whole_number<T: TryFrom<i128>>(text: &str, min: i128, rule: &str) -> Result<T, String> {
    text.trim()
        .parse::<i128>()
        .ok()
        .filter(|&n| n >= min)
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| rule.to_string())
}

/// `--rank` (0 reaches the program's own check, which names the option).
pub fn parse_rank(text: &str) -> Result<usize, String> {
    whole_number(text, 0, "the rank is a whole number of at least 1")
}

/// `--threads`.
pub fn parse_threads(text: &str) -> Result<usize, String> {
    whole_number(
        text,
        0,
        "--threads is 0 (one thread per core) or a whole number of threads",
    )
}

/// `--seed` and `--gen-seed`.
pub fn parse_seed(text: &str) -> Result<u64, String> {
    whole_number(
        text,
        0,
        "a seed is a whole number from 0 to 18446744073709551615",
    )
}

/// Parses a comma-separated list of positive dimensions.
pub fn parse_dims(text: &str) -> Result<Vec<u32>> {
    let dims: Vec<u32> = text
        .split([',', 'x'])
        .map(|d| {
            d.trim()
                .parse::<u32>()
                .ok()
                .filter(|&d| d > 0)
                .with_context(|| format!("'{d}' in '{text}' is not a positive dimension"))
        })
        .collect::<Result<_>>()?;
    if dims.len() < 2 {
        bail!("--dims needs at least 2 dimensions, e.g. 1000,800,600");
    }
    Ok(dims)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal::console::{dims_text, thousands};

    #[test]
    fn dims_parse_and_print() {
        assert_eq!(parse_dims("10,20x30").unwrap(), vec![10, 20, 30]);
        assert!(parse_dims("10").is_err());
        assert!(parse_dims("10,0").is_err());
        assert_eq!(dims_text(&[12_092, 9]), "12,092 x 9");
        assert_eq!(thousands(1_000_000), "1,000,000");
    }

    #[test]
    fn whole_numbers_say_the_rule_for_negatives() {
        assert_eq!(parse_rank("3"), Ok(3));
        assert_eq!(parse_rank("0"), Ok(0));
        assert!(parse_rank("-3").unwrap_err().contains("at least 1"));
        assert!(parse_rank("2.5").is_err());
        assert!(parse_threads("-1").unwrap_err().contains("--threads is 0"));
        assert_eq!(parse_seed("18446744073709551615"), Ok(u64::MAX));
        assert!(parse_seed("-1").unwrap_err().contains("from 0"));
        assert!(parse_seed("18446744073709551616").is_err());
    }
}
