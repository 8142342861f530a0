//! `cargo xtask kernels`: compile every kernel specialization for every
//! target architecture and report what `ptxas` makes of it.
//!
//! NVRTC (through `kruskal_device::kernels::compile`) turns each
//! specialization of the catalog into PTX; `ptxas -v --gpu-name ARCH`
//! assembles the PTX and reports, per entry function, the registers a thread
//! uses, the bytes spilled to local memory and the static shared memory of a
//! block. Neither step needs a GPU, so CI runs this on every commit: a kernel
//! that no longer compiles for some `NMODES` x `RANK` x launch shape, or one
//! that starts spilling, shows before anyone reaches a GPU machine.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kruskal_device::catalog::{Specialization, catalog};
use kruskal_device::kernels::compile;

/// The architectures of the GPU machines (A100-class, H100/H200).
const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

const INSTALL_HINT: &str = "install the CUDA 13.0 wheels into a virtual environment and put \
     their libraries on LD_LIBRARY_PATH:\n  python3 -m venv venv && venv/bin/pip install \
     \"nvidia-cuda-nvrtc==13.0.*\" \"nvidia-cuda-nvcc==13.0.*\"\n  export \
     LD_LIBRARY_PATH=$PWD/venv/lib/python3.*/site-packages/nvidia/cu13/lib:$LD_LIBRARY_PATH\n\
     (ptxas is then found next to libnvrtc, in .../nvidia/cu13/bin; --ptxas PATH or \
     KRUSKAL_PTXAS=PATH name another one)";

/// `cargo xtask kernels`.
#[derive(Parser, Debug)]
// As before clap, an option given twice takes its last value.
#[command(name = "kernels", args_override_self = true)]
pub struct KernelsArgs {
    /// A target architecture, e.g. sm_90; repeat for more (default sm_80
    /// and sm_90).
    #[arg(long = "arch", value_name = "ARCH")]
    archs: Vec<String>,
    /// The ptxas to run (default: KRUSKAL_PTXAS, else the one next to a
    /// libnvrtc on LD_LIBRARY_PATH, else the first on PATH).
    #[arg(long, value_name = "PATH")]
    ptxas: Option<PathBuf>,
    /// Compilations at once (default: one per core).
    #[arg(long, value_name = "N", value_parser = positive)]
    jobs: Option<usize>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

fn positive(text: &str) -> Result<usize, String> {
    text.parse()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| "takes a positive number".to_string())
}

struct Options {
    archs: Vec<String>,
    ptxas: Option<PathBuf>,
    jobs: usize,
    json: bool,
}

impl KernelsArgs {
    /// The options with their defaults filled in.
    fn options(self) -> Options {
        let archs = if self.archs.is_empty() {
            ARCHS.iter().map(|s| s.to_string()).collect()
        } else {
            self.archs
        };
        Options {
            archs,
            ptxas: self.ptxas,
            jobs: self
                .jobs
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            json: self.json,
        }
    }
}

/// `ptxas`: `--ptxas`, else `KRUSKAL_PTXAS`, else the one of the
/// `nvidia-cuda-nvcc` wheel next to a libnvrtc on `LD_LIBRARY_PATH` (it
/// matches that NVRTC's PTX version, which a system CUDA on `PATH` may not),
/// else the first on `PATH`.
fn find_ptxas(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        bail!("--ptxas {}: no such file", p.display());
    }
    if let Some(p) = std::env::var_os("KRUSKAL_PTXAS") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("KRUSKAL_PTXAS={}: no such file", p.display());
    }
    let dirs = |var: &str| {
        std::env::var_os(var)
            .map(|v| std::env::split_paths(&v).collect::<Vec<_>>())
            .unwrap_or_default()
    };
    for lib in dirs("LD_LIBRARY_PATH") {
        let has_nvrtc = std::fs::read_dir(&lib).is_ok_and(|entries| {
            entries
                .filter_map(|e| e.ok())
                .any(|e| e.file_name().to_string_lossy().starts_with("libnvrtc.so"))
        });
        let candidate = lib.join("../bin/ptxas");
        if has_nvrtc && candidate.is_file() {
            return Ok(candidate.canonicalize().unwrap_or(candidate));
        }
    }
    for bin in dirs("PATH") {
        let candidate = bin.join("ptxas");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!(
        "ptxas not found (not given by --ptxas or KRUSKAL_PTXAS, not next to a libnvrtc on \
         LD_LIBRARY_PATH, not on PATH); {INSTALL_HINT}"
    )
}

/// What `ptxas -v` reports about one entry function.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FunctionReport {
    pub name: String,
    pub registers: u32,
    pub stack_bytes: u64,
    pub spill_store_bytes: u64,
    pub spill_load_bytes: u64,
    /// Static shared memory per block (dynamic shared memory is set at
    /// launch and not counted).
    pub shared_bytes: u64,
}

/// The number before `unit` in `text` ("40 registers" -> 40).
fn number_before(text: &str, unit: &str) -> Option<u64> {
    let end = text.find(unit)?;
    text[..end].split_whitespace().last()?.parse().ok()
}

/// Reads the entry functions out of `ptxas -v` output (its stderr):
///
/// ```text
/// ptxas info    : Compiling entry function 'mttkrp_coo_atomic' for 'sm_90'
/// ptxas info    : Function properties for mttkrp_coo_atomic
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 30 registers, used 0 barriers, 416 bytes cmem[0]
/// ```
///
/// Properties of non-entry functions (device functions kept as calls) are
/// skipped: their stack and spills show in the entry that calls them.
pub fn parse_ptxas(output: &str) -> Vec<FunctionReport> {
    let mut out: Vec<FunctionReport> = Vec::new();
    // The function the next "bytes stack frame" line belongs to.
    let mut properties_of: Option<String> = None;
    for line in output.lines() {
        let line = line.trim();
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            out.push(FunctionReport {
                name: name.to_string(),
                ..Default::default()
            });
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            properties_of = Some(rest.trim().to_string());
        } else if line.contains("bytes stack frame") {
            let owner = properties_of.take();
            if let Some(f) = out
                .last_mut()
                .filter(|f| owner.as_deref() == Some(&*f.name))
            {
                f.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                f.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
                f.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
            }
        } else if line.contains("Used ") && line.contains(" registers") {
            if let Some(f) = out.last_mut() {
                f.registers = number_before(line, " registers").unwrap_or(0) as u32;
                f.shared_bytes = number_before(line, " bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

/// One compilation: a specialization for one architecture.
struct Job {
    spec: Specialization,
    arch: String,
}

impl Job {
    fn name(&self) -> String {
        format!("{} {}", self.spec.source.file(), defines_text(&self.spec))
    }
}

struct Done {
    functions: Vec<FunctionReport>,
    nvrtc_ms: f64,
    ptxas_ms: f64,
}

fn defines_text(spec: &Specialization) -> String {
    let parts: Vec<String> = spec
        .defines
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    parts.join(" ")
}

/// Compiles and assembles one job; the error carries the NVRTC or ptxas log.
fn run_job(job: &Job, ptxas: &Path, scratch: &Path, index: usize) -> Result<Done> {
    let t = Instant::now();
    let ptx =
        compile(job.spec.source, &job.arch, &job.spec.defines).map_err(anyhow::Error::from)?;
    let nvrtc_ms = t.elapsed().as_secs_f64() * 1e3;

    let ptx_path = scratch.join(format!("{index}.ptx"));
    let cubin_path = scratch.join(format!("{index}.cubin"));
    std::fs::write(&ptx_path, &ptx).with_context(|| format!("writing {}", ptx_path.display()))?;
    let t = Instant::now();
    let out = Command::new(ptxas)
        .arg("-v")
        .args(["--gpu-name", &job.arch])
        .arg("-o")
        .arg(&cubin_path)
        .arg(&ptx_path)
        .output()
        .with_context(|| format!("running {}", ptxas.display()))?;
    let ptxas_ms = t.elapsed().as_secs_f64() * 1e3;
    let _ = std::fs::remove_file(&ptx_path);
    let _ = std::fs::remove_file(&cubin_path);
    let log =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("ptxas failed ({}):\n{log}", out.status);
    }
    let mut functions = parse_ptxas(&log);
    functions.sort_by(|a, b| a.name.cmp(&b.name));
    if functions.is_empty() {
        bail!("ptxas reported no entry function:\n{log}");
    }
    Ok(Done {
        functions,
        nvrtc_ms,
        ptxas_ms,
    })
}

/// The first line of `ptxas --version` that names the release.
fn ptxas_version(ptxas: &Path) -> String {
    Command::new(ptxas)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .find(|l| l.contains("release"))
                .map(|l| l.trim().to_string())
        })
        .unwrap_or_else(|| "unknown version".into())
}

pub fn kernels(args: KernelsArgs) -> Result<()> {
    let opts = args.options();
    for arch in &opts.archs {
        if !arch.starts_with("sm_") {
            bail!("--arch {arch}: expected a name like sm_90");
        }
    }
    let ptxas = find_ptxas(opts.ptxas.as_deref())?;
    if let Err(e) = kruskal_device::probe::check_nvrtc() {
        bail!("{e}\nfor this task: {INSTALL_HINT}");
    }

    let specs = catalog();
    let jobs: Vec<Job> = opts
        .archs
        .iter()
        .flat_map(|arch| {
            specs.iter().map(move |spec| Job {
                spec: spec.clone(),
                arch: arch.clone(),
            })
        })
        .collect();
    let scratch =
        std::env::temp_dir().join(format!("kruskal-xtask-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;

    eprintln!(
        "compiling {} specializations x {} architectures on {} threads; ptxas {} ({})",
        specs.len(),
        opts.archs.len(),
        opts.jobs,
        ptxas.display(),
        ptxas_version(&ptxas)
    );
    let wall = Instant::now();
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<Done>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..opts.jobs.min(jobs.len()) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { break };
                    let r = run_job(job, &ptxas, &scratch, i);
                    results.lock().expect("results lock")[i] = Some(r);
                }
            });
        }
    });
    let wall_s = wall.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&scratch);
    let results = results.into_inner().expect("results lock");

    let mut rows: Vec<Row> = Vec::new();
    let mut failures = Vec::new();
    let (mut nvrtc_total_ms, mut ptxas_total_ms) = (0.0, 0.0);
    for (job, r) in jobs.iter().zip(results) {
        match r {
            Some(Ok(done)) => {
                nvrtc_total_ms += done.nvrtc_ms;
                ptxas_total_ms += done.ptxas_ms;
                rows.extend(done.functions.into_iter().map(|f| Row {
                    job,
                    f,
                    nvrtc_ms: done.nvrtc_ms,
                    ptxas_ms: done.ptxas_ms,
                }));
            }
            Some(Err(e)) => failures.push(format!("{} {}: {e:#}", job.name(), job.arch)),
            None => failures.push(format!("{} {}: not run", job.name(), job.arch)),
        }
    }
    let spilling: Vec<&Row> = rows.iter().filter(|r| r.spill_bytes() > 0).collect();
    let most = rows.iter().max_by_key(|r| r.f.registers);
    let summary = format!(
        "{} compilations ({} specializations x {}), {} functions, {} failed; most registers {}; \
         {} functions spill; NVRTC {:.1} s + ptxas {:.1} s of work, {:.1} s wall on {} threads",
        jobs.len(),
        specs.len(),
        opts.archs.join(", "),
        rows.len(),
        failures.len(),
        most.map_or_else(
            || "-".into(),
            |r| format!("{} ({})", r.f.registers, r.name())
        ),
        spilling.len(),
        nvrtc_total_ms / 1e3,
        ptxas_total_ms / 1e3,
        wall_s,
        opts.jobs
    );
    if opts.json {
        let doc = serde_json::json!({
            "ptxas": ptxas.display().to_string(),
            "archs": opts.archs,
            "compilations": jobs.len(),
            "failed": failures.len(),
            "wall_s": wall_s,
            "functions": rows.iter().map(Row::json).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        eprintln!("{summary}");
    } else {
        print!("{}", table(&rows));
        for r in &spilling {
            println!(
                "spills: {} ({} bytes stored, {} loaded)",
                r.name(),
                r.f.spill_store_bytes,
                r.f.spill_load_bytes
            );
        }
        println!("{summary}");
    }
    if !failures.is_empty() {
        for f in &failures {
            eprintln!("\nFAILED {f}");
        }
        bail!("{} of {} compilations failed", failures.len(), jobs.len());
    }
    Ok(())
}

/// One line of the report: an entry function of one compilation.
struct Row<'a> {
    job: &'a Job,
    f: FunctionReport,
    nvrtc_ms: f64,
    ptxas_ms: f64,
}

impl Row<'_> {
    fn spill_bytes(&self) -> u64 {
        self.f.spill_store_bytes + self.f.spill_load_bytes
    }

    fn name(&self) -> String {
        let (file, defines) = (self.job.spec.source.file(), defines_text(&self.job.spec));
        format!("{file} {} {defines} {}", self.f.name, self.job.arch)
    }

    fn cells(&self) -> [String; 9] {
        [
            self.job.spec.source.file().to_string(),
            self.f.name.clone(),
            defines_text(&self.job.spec),
            self.job.arch.clone(),
            self.f.registers.to_string(),
            format!("{}/{}", self.f.spill_store_bytes, self.f.spill_load_bytes),
            self.f.shared_bytes.to_string(),
            format!("{:.0}", self.nvrtc_ms),
            format!("{:.0}", self.ptxas_ms),
        ]
    }

    fn json(&self) -> serde_json::Value {
        let defines: serde_json::Map<String, serde_json::Value> = self
            .job
            .spec
            .defines
            .iter()
            .map(|(k, v)| (k.to_string(), (*v).into()))
            .collect();
        serde_json::json!({
            "file": self.job.spec.source.file(),
            "function": self.f.name,
            "defines": defines,
            "arch": self.job.arch,
            "registers": self.f.registers,
            "stack_bytes": self.f.stack_bytes,
            "spill_store_bytes": self.f.spill_store_bytes,
            "spill_load_bytes": self.f.spill_load_bytes,
            "shared_bytes": self.f.shared_bytes,
            "nvrtc_ms": self.nvrtc_ms,
            "ptxas_ms": self.ptxas_ms,
        })
    }
}

/// The rows as a table: text columns left-aligned, numbers right-aligned,
/// each as wide as its widest cell.
fn table(rows: &[Row]) -> String {
    const HEADER: [&str; 9] = [
        "file",
        "function",
        "defines",
        "arch",
        "regs",
        "spill st/ld",
        "smem",
        "nvrtc ms",
        "ptxas ms",
    ];
    const TEXT_COLUMNS: usize = 4;
    let cells: Vec<[String; 9]> = rows.iter().map(Row::cells).collect();
    let mut width = HEADER.map(str::len);
    for c in &cells {
        for (w, cell) in width.iter_mut().zip(c) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    let header = HEADER.map(String::from);
    for line in std::iter::once(&header).chain(&cells) {
        for (i, (cell, w)) in line.iter().zip(width).enumerate() {
            let sep = if i == 0 { "" } else { "  " };
            let _ = if i < TEXT_COLUMNS {
                write!(out, "{sep}{cell:<w$}")
            } else {
                write!(out, "{sep}{cell:>w$}")
            };
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ptxas -v --gpu-name sm_90` (CUDA 13.0.88) on the PTX of
    /// `mttkrp_flycoo.cu` with NMODES=5 RANK=1 WARPS=8, captured 2026-11-22:
    /// one function with spills, a barrier and static shared memory, one
    /// without.
    #[test]
    fn parses_real_ptxas_output() {
        let got = parse_ptxas(include_str!("ptxas-v-sample.txt"));
        assert_eq!(
            got,
            [
                FunctionReport {
                    name: "flycoo_remap".into(),
                    registers: 16,
                    ..Default::default()
                },
                FunctionReport {
                    name: "mttkrp_flycoo".into(),
                    registers: 32,
                    stack_bytes: 8,
                    spill_store_bytes: 4,
                    spill_load_bytes: 4,
                    shared_bytes: 192,
                },
            ]
        );
    }

    #[test]
    fn properties_of_called_functions_are_not_taken_for_the_entry() {
        let out = "ptxas info    : Function properties for helper\n    \
                   16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n\
                   ptxas info    : Compiling entry function 'k' for 'sm_80'\n\
                   ptxas info    : Function properties for k\n    \
                   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem, 388 bytes cmem[0]\n";
        let got = parse_ptxas(out);
        assert_eq!(got.len(), 1);
        assert_eq!(
            (
                got[0].registers,
                got[0].shared_bytes,
                got[0].spill_store_bytes
            ),
            (40, 4096, 0)
        );
        assert!(parse_ptxas("ptxas fatal   : Unresolved extern function 'f'").is_empty());
    }

    fn parse_args(args: &[&str]) -> Result<Options, clap::Error> {
        let argv = std::iter::once("kernels").chain(args.iter().copied());
        Ok(KernelsArgs::try_parse_from(argv)?.options())
    }

    #[test]
    fn options_default_to_both_architectures() {
        let o = parse_args(&[]).unwrap();
        assert_eq!(o.archs, ["sm_80", "sm_90"]);
        let o = parse_args(&["--arch", "sm_90", "--json"]).unwrap();
        assert_eq!(o.archs, ["sm_90"]);
        assert!(o.json);
        assert!(parse_args(&["--jobs", "0"]).is_err());
        assert!(parse_args(&["--arch"]).is_err());
    }
}
