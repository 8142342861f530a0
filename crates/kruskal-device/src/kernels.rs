//! The CUDA sources and their run-time compilation.
//!
//! Sources live in this crate's `kernels/` folder (inside the crate, so the
//! packaged crate carries them) and are embedded with `include_str!`.
//! NVRTC compiles them for the device's architecture with `-DNMODES`,
//! `-DRANK` and whatever launch-shape defines a kernel takes.
//! Compiled PTX is cached in memory (per [`KernelCache`]) and on disk under
//! the user's cache directory (`KRUSKAL_CACHE_DIR` overrides it), keyed by a
//! SHA-256 of the source, the options and the driver version, so a new
//! driver or an edited kernel never picks up stale PTX.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use sha2::{Digest, Sha256};

use crate::{DeviceError, Result, driver};

/// Warps per block of the shard kernel (its P), the launch shape the
/// several-GPU group (`kruskal-group`) runs it with and the catalog
/// compiles.
pub const SHARD_WARPS: usize = 8;

/// The shared header, pasted in place of `#include "common.cuh"` (NVRTC
/// is given one source string).
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// One kernel source file of `kernels/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelSource {
    /// `mttkrp_coo.cu`: the `coo_atomic` baseline and the f64-to-f32 store.
    Coo,
    /// `mttkrp_fcoo.cu`: segmented reduction over F-COO.
    Fcoo,
    /// `mttkrp_hicoo.cu`: HiCOO blocks grouped per output mode.
    Hicoo,
    /// `mttkrp_flycoo.cu`: one thread block per FLYCOO partition.
    Flycoo,
    /// `mttkrp_shard.cu`: a GPU group's shard of the elements.
    Shard,
    /// `dense.cu`: the dense steps of CPD-ALS.
    Dense,
    /// `admm.cu`: AO-ADMM's blocked inner loop.
    Admm,
    /// `probe.cu`: the L2 gather micro-benchmark.
    Probe,
    /// `fcoo_build.cu`: the F-COO layout built on the device, and a GPU
    /// group's shards.
    FcooBuild,
    /// `apr.cu`: the steps of CP-APR (Poisson CP), in f64.
    Apr,
}

impl KernelSource {
    /// Every source file, in the order of [`SOURCES`](crate::catalog::SOURCES).
    pub const ALL: [KernelSource; 10] = [
        KernelSource::Coo,
        KernelSource::Fcoo,
        KernelSource::Hicoo,
        KernelSource::Flycoo,
        KernelSource::Shard,
        KernelSource::Dense,
        KernelSource::Admm,
        KernelSource::Probe,
        KernelSource::FcooBuild,
        KernelSource::Apr,
    ];

    /// The file's name in `kernels/` (also NVRTC's name of the program and
    /// what errors and `cargo xtask kernels` print).
    pub const fn file(self) -> &'static str {
        match self {
            KernelSource::Coo => "mttkrp_coo.cu",
            KernelSource::Fcoo => "mttkrp_fcoo.cu",
            KernelSource::Hicoo => "mttkrp_hicoo.cu",
            KernelSource::Flycoo => "mttkrp_flycoo.cu",
            KernelSource::Shard => "mttkrp_shard.cu",
            KernelSource::Dense => "dense.cu",
            KernelSource::Admm => "admm.cu",
            KernelSource::Probe => "probe.cu",
            KernelSource::FcooBuild => "fcoo_build.cu",
            KernelSource::Apr => "apr.cu",
        }
    }

    /// The file's text as written, `#include "common.cuh"` not yet
    /// replaced (see [`source`] for what NVRTC compiles).
    pub const fn text(self) -> &'static str {
        match self {
            KernelSource::Coo => include_str!("../kernels/mttkrp_coo.cu"),
            KernelSource::Fcoo => include_str!("../kernels/mttkrp_fcoo.cu"),
            KernelSource::Hicoo => include_str!("../kernels/mttkrp_hicoo.cu"),
            KernelSource::Flycoo => include_str!("../kernels/mttkrp_flycoo.cu"),
            KernelSource::Shard => include_str!("../kernels/mttkrp_shard.cu"),
            KernelSource::Dense => include_str!("../kernels/dense.cu"),
            KernelSource::Admm => include_str!("../kernels/admm.cu"),
            KernelSource::Probe => include_str!("../kernels/probe.cu"),
            KernelSource::FcooBuild => include_str!("../kernels/fcoo_build.cu"),
            KernelSource::Apr => include_str!("../kernels/apr.cu"),
        }
    }
}

/// One entry function (`extern "C" __global__`) of a kernel source: what
/// an engine asks [`KernelCache::function`] for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    MttkrpCooAtomic,
    StoreF32,
    MttkrpFcoo,
    FcooStoreEdges,
    FcooToHalf,
    MttkrpHicoo,
    HicooStoreSplit,
    MttkrpFlycoo,
    FlycooCombine,
    FlycooRemap,
    MttkrpShard,
    ShardFault,
    CpdUpdate,
    CpdScaleGram,
    CpdScale,
    CpdReduce,
    CopyRows,
    AddRows,
    SumParts,
    CpdColumnStats,
    UniformFill,
    AdmmBlocks,
    AdmmScale,
    L2Gather,
    FcooKeys32,
    FcooKeys64,
    RadixCount32,
    RadixCount64,
    RadixScatter32,
    RadixScatter64,
    ScanReduce,
    ScanPartials,
    ScanApply,
    FcooGather,
    FcooEnds32,
    FcooEnds64,
    FcooPopc,
    FcooSegmentRows32,
    FcooSegmentRows64,
    FcooStartFlags,
    ShardTileCounts,
    ShardSelect,
    ShardElements,
    ShardMark,
    AprPi,
    AprPhi,
    AprPhiRows,
    AprPhiChunks,
    AprUpdate,
    AprShareKkt,
    AprKappaFold,
    AprColumnSums,
    AprSumPartials,
    AprScale,
    AprLogLikelihood,
}

impl Kernel {
    /// Every entry function of every source.
    pub const ALL: [Kernel; 55] = [
        Kernel::MttkrpCooAtomic,
        Kernel::StoreF32,
        Kernel::MttkrpFcoo,
        Kernel::FcooStoreEdges,
        Kernel::FcooToHalf,
        Kernel::MttkrpHicoo,
        Kernel::HicooStoreSplit,
        Kernel::MttkrpFlycoo,
        Kernel::FlycooCombine,
        Kernel::FlycooRemap,
        Kernel::MttkrpShard,
        Kernel::ShardFault,
        Kernel::CpdUpdate,
        Kernel::CpdScaleGram,
        Kernel::CpdScale,
        Kernel::CpdReduce,
        Kernel::CopyRows,
        Kernel::AddRows,
        Kernel::SumParts,
        Kernel::CpdColumnStats,
        Kernel::UniformFill,
        Kernel::AdmmBlocks,
        Kernel::AdmmScale,
        Kernel::L2Gather,
        Kernel::FcooKeys32,
        Kernel::FcooKeys64,
        Kernel::RadixCount32,
        Kernel::RadixCount64,
        Kernel::RadixScatter32,
        Kernel::RadixScatter64,
        Kernel::ScanReduce,
        Kernel::ScanPartials,
        Kernel::ScanApply,
        Kernel::FcooGather,
        Kernel::FcooEnds32,
        Kernel::FcooEnds64,
        Kernel::FcooPopc,
        Kernel::FcooSegmentRows32,
        Kernel::FcooSegmentRows64,
        Kernel::FcooStartFlags,
        Kernel::ShardTileCounts,
        Kernel::ShardSelect,
        Kernel::ShardElements,
        Kernel::ShardMark,
        Kernel::AprPi,
        Kernel::AprPhi,
        Kernel::AprPhiRows,
        Kernel::AprPhiChunks,
        Kernel::AprUpdate,
        Kernel::AprShareKkt,
        Kernel::AprKappaFold,
        Kernel::AprColumnSums,
        Kernel::AprSumPartials,
        Kernel::AprScale,
        Kernel::AprLogLikelihood,
    ];

    /// The source file that defines the function, and the function's name
    /// in it.
    const fn entry(self) -> (KernelSource, &'static str) {
        match self {
            Kernel::MttkrpCooAtomic => (KernelSource::Coo, "mttkrp_coo_atomic"),
            Kernel::StoreF32 => (KernelSource::Coo, "store_f32"),
            Kernel::MttkrpFcoo => (KernelSource::Fcoo, "mttkrp_fcoo"),
            Kernel::FcooStoreEdges => (KernelSource::Fcoo, "fcoo_store_edges"),
            Kernel::FcooToHalf => (KernelSource::Fcoo, "fcoo_to_half"),
            Kernel::MttkrpHicoo => (KernelSource::Hicoo, "mttkrp_hicoo"),
            Kernel::HicooStoreSplit => (KernelSource::Hicoo, "hicoo_store_split"),
            Kernel::MttkrpFlycoo => (KernelSource::Flycoo, "mttkrp_flycoo"),
            Kernel::FlycooCombine => (KernelSource::Flycoo, "flycoo_combine"),
            Kernel::FlycooRemap => (KernelSource::Flycoo, "flycoo_remap"),
            Kernel::MttkrpShard => (KernelSource::Shard, "mttkrp_shard"),
            Kernel::ShardFault => (KernelSource::Shard, "shard_fault"),
            Kernel::CpdUpdate => (KernelSource::Dense, "cpd_update"),
            Kernel::CpdScaleGram => (KernelSource::Dense, "cpd_scale_gram"),
            Kernel::CpdScale => (KernelSource::Dense, "cpd_scale"),
            Kernel::CpdReduce => (KernelSource::Dense, "cpd_reduce"),
            Kernel::CopyRows => (KernelSource::Dense, "copy_rows"),
            Kernel::AddRows => (KernelSource::Dense, "add_rows"),
            Kernel::SumParts => (KernelSource::Dense, "sum_parts"),
            Kernel::CpdColumnStats => (KernelSource::Dense, "cpd_column_stats"),
            Kernel::UniformFill => (KernelSource::Dense, "uniform_fill"),
            Kernel::AdmmBlocks => (KernelSource::Admm, "admm_blocks"),
            Kernel::AdmmScale => (KernelSource::Admm, "admm_scale"),
            Kernel::L2Gather => (KernelSource::Probe, "l2_gather"),
            Kernel::FcooKeys32 => (KernelSource::FcooBuild, "fcoo_keys32"),
            Kernel::FcooKeys64 => (KernelSource::FcooBuild, "fcoo_keys64"),
            Kernel::RadixCount32 => (KernelSource::FcooBuild, "radix_count32"),
            Kernel::RadixCount64 => (KernelSource::FcooBuild, "radix_count64"),
            Kernel::RadixScatter32 => (KernelSource::FcooBuild, "radix_scatter32"),
            Kernel::RadixScatter64 => (KernelSource::FcooBuild, "radix_scatter64"),
            Kernel::ScanReduce => (KernelSource::FcooBuild, "scan_reduce"),
            Kernel::ScanPartials => (KernelSource::FcooBuild, "scan_partials"),
            Kernel::ScanApply => (KernelSource::FcooBuild, "scan_apply"),
            Kernel::FcooGather => (KernelSource::FcooBuild, "fcoo_gather"),
            Kernel::FcooEnds32 => (KernelSource::FcooBuild, "fcoo_ends32"),
            Kernel::FcooEnds64 => (KernelSource::FcooBuild, "fcoo_ends64"),
            Kernel::FcooPopc => (KernelSource::FcooBuild, "fcoo_popc"),
            Kernel::FcooSegmentRows32 => (KernelSource::FcooBuild, "fcoo_segment_rows32"),
            Kernel::FcooSegmentRows64 => (KernelSource::FcooBuild, "fcoo_segment_rows64"),
            Kernel::FcooStartFlags => (KernelSource::FcooBuild, "fcoo_start_flags"),
            Kernel::ShardTileCounts => (KernelSource::FcooBuild, "shard_tile_counts"),
            Kernel::ShardSelect => (KernelSource::FcooBuild, "shard_select"),
            Kernel::ShardElements => (KernelSource::FcooBuild, "shard_elements"),
            Kernel::ShardMark => (KernelSource::FcooBuild, "shard_mark"),
            Kernel::AprPi => (KernelSource::Apr, "apr_pi"),
            Kernel::AprPhi => (KernelSource::Apr, "apr_phi"),
            Kernel::AprPhiRows => (KernelSource::Apr, "apr_phi_rows"),
            Kernel::AprPhiChunks => (KernelSource::Apr, "apr_phi_chunks"),
            Kernel::AprUpdate => (KernelSource::Apr, "apr_update"),
            Kernel::AprShareKkt => (KernelSource::Apr, "apr_share_kkt"),
            Kernel::AprKappaFold => (KernelSource::Apr, "apr_kappa_fold"),
            Kernel::AprColumnSums => (KernelSource::Apr, "apr_column_sums"),
            Kernel::AprSumPartials => (KernelSource::Apr, "apr_sum_partials"),
            Kernel::AprScale => (KernelSource::Apr, "apr_scale"),
            Kernel::AprLogLikelihood => (KernelSource::Apr, "apr_log_likelihood"),
        }
    }

    /// The source file that defines the function.
    pub const fn source(self) -> KernelSource {
        self.entry().0
    }

    /// The function's name in its source (and in the PTX).
    pub const fn name(self) -> &'static str {
        self.entry().1
    }
}

/// The `RANK` the F-COO build kernels (`fcoo_build.cu`, which do not use
/// it) are compiled with.
pub const BUILD_RANK: i64 = 1;

/// The complete source of `src`, header included: what NVRTC compiles.
pub fn source(src: KernelSource) -> String {
    src.text().replace("#include \"common.cuh\"", COMMON)
}

/// NVRTC options for `defines` on `arch`, in a fixed order.
pub fn options(arch: &str, defines: &[(&str, i64)]) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
    ];
    opts.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    opts
}

/// Compiles `src` to PTX (no GPU needed, only NVRTC).
pub fn compile(src: KernelSource, arch: &str, defines: &[(&str, i64)]) -> Result<String> {
    crate::probe::check_nvrtc()?;
    let file = src.file();
    let text = source(src);
    let opts = CompileOptions {
        options: options(arch, defines),
        name: Some(file.to_string()),
        ..Default::default()
    };
    match compile_ptx_with_opts(&text, opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(CompileError::CompileError { log, options, .. }) => Err(DeviceError::Compile {
            kernel: file.to_string(),
            options: options.join(" "),
            log: log.to_string_lossy().into_owned(),
        }),
        Err(e) => Err(DeviceError::Compile {
            kernel: file.to_string(),
            options: options(arch, defines).join(" "),
            log: e.to_string(),
        }),
    }
}

/// Compiled kernels of one device.
pub struct KernelCache {
    arch: String,
    driver_version: i32,
    disk: Option<PathBuf>,
    /// Loaded modules by source and options: every entry function of a
    /// source comes from one load (loading PTX runs the driver's JIT).
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

impl KernelCache {
    pub fn new(arch: String, driver_version: i32) -> Self {
        let disk = std::env::var_os("KRUSKAL_CACHE_DIR")
            .map(PathBuf::from)
            .or_else(|| dirs::cache_dir().map(|d| d.join("kruskal")))
            .map(|d| d.join("kernels"));
        KernelCache {
            arch,
            driver_version,
            disk,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        }
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The cache key of a compilation: the complete source text, the
    /// options and the driver version (not the file's name, so an edited
    /// kernel gets a new key).
    fn key(&self, src: KernelSource, defines: &[(&str, i64)]) -> String {
        let mut h = Sha256::new();
        h.update(source(src).as_bytes());
        h.update(options(&self.arch, defines).join("\n").as_bytes());
        h.update(self.driver_version.to_le_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// PTX for `src` with `defines`: from disk if an identical compilation
    /// was cached, else compiled and stored (a cache that cannot be written
    /// only costs the next run a compile).
    pub fn ptx(&self, src: KernelSource, defines: &[(&str, i64)]) -> Result<String> {
        let key = self.key(src, defines);
        let path = self.disk.as_ref().map(|d| d.join(format!("{key}.ptx")));
        if let Some(ptx) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
            return Ok(ptx);
        }
        let ptx = compile(src, &self.arch, defines)?;
        if let Some(p) = &path {
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            let stored = p
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|_| std::fs::write(&tmp, &ptx))
                .and_then(|_| std::fs::rename(&tmp, p));
            if stored.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
        }
        Ok(ptx)
    }

    /// `kernel` compiled with `defines`, loaded into `ctx` (cached per
    /// process).
    pub fn function(
        &self,
        ctx: &Arc<CudaContext>,
        kernel: Kernel,
        defines: &[(&str, i64)],
    ) -> Result<CudaFunction> {
        let (file, name) = (kernel.source().file(), kernel.name());
        // Every launch looks its kernel up here: key the in-memory cache by
        // the request itself, and hash the source only on a miss.
        let module_key = format!("{file}/{}", options(&self.arch, defines).join(" "));
        let key = format!("{module_key}/{name}");
        if let Some(f) = self.functions.lock().expect("kernel cache lock").get(&key) {
            return Ok(f.clone());
        }
        let loaded = self
            .modules
            .lock()
            .expect("kernel cache lock")
            .get(&module_key)
            .cloned();
        let module = match loaded {
            Some(m) => m,
            None => {
                let ptx = self.ptx(kernel.source(), defines)?;
                let m = ctx
                    .load_module(Ptx::from_src(ptx))
                    .map_err(driver(format!("loading the PTX of {file}")))?;
                self.modules
                    .lock()
                    .expect("kernel cache lock")
                    .insert(module_key, m.clone());
                m
            }
        };
        let f = module
            .load_function(name)
            .map_err(driver(format!("finding {name} in {file}")))?;
        self.functions
            .lock()
            .expect("kernel cache lock")
            .insert(key, f.clone());
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_embed_the_header_and_options_carry_defines() {
        let src = source(KernelSource::Coo);
        assert!(src.contains("COLS_PER_LANE") && !src.contains("#include \"common.cuh\""));
        let o = options("sm_90", &[("NMODES", 3), ("RANK", 32)]);
        assert_eq!(
            o,
            [
                "--gpu-architecture=sm_90",
                "-std=c++17",
                "-DNMODES=3",
                "-DRANK=32"
            ]
        );
    }

    /// The entry functions a source defines: the name after each
    /// `extern "C" __global__ void`, a `__launch_bounds__(..)` skipped.
    fn entry_functions(text: &str) -> Vec<&str> {
        const OPEN: &str = "extern \"C\" __global__ void ";
        text.match_indices(OPEN)
            .map(|(at, _)| {
                let mut rest = text[at + OPEN.len()..].trim_start();
                if let Some(bounds) = rest.strip_prefix("__launch_bounds__(") {
                    // Past the parenthesis that closes the bounds.
                    let mut depth = 1;
                    let close = bounds
                        .find(|c| {
                            match c {
                                '(' => depth += 1,
                                ')' => depth -= 1,
                                _ => {}
                            }
                            depth == 0
                        })
                        .expect("__launch_bounds__ is closed");
                    rest = bounds[close + 1..].trim_start();
                }
                let len = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(rest.len());
                &rest[..len]
            })
            .collect()
    }

    #[test]
    fn every_kernel_is_an_entry_function_of_its_source_and_every_entry_a_kernel() {
        for k in Kernel::ALL {
            let src = k.source();
            assert!(
                entry_functions(src.text()).contains(&k.name()),
                "{k:?}: no entry function {} in {}",
                k.name(),
                src.file()
            );
        }
        for src in KernelSource::ALL {
            let entries = entry_functions(src.text());
            assert!(
                !entries.is_empty(),
                "{} defines no entry function",
                src.file()
            );
            for name in entries {
                assert!(
                    Kernel::ALL
                        .iter()
                        .any(|k| k.source() == src && k.name() == name),
                    "{name} of {} is in no Kernel",
                    src.file()
                );
            }
        }
    }

    /// Needs NVRTC (a GPU machine, or the NVRTC wheel), not a GPU.
    #[test]
    #[ignore = "needs NVRTC"]
    fn a_kernel_without_its_rank_shows_the_log() {
        // Without RANK the header's #error fires, and the log says so.
        let err = compile(KernelSource::Coo, "sm_90", &[("NMODES", 3)]).unwrap_err();
        assert!(err.to_string().contains("RANK must be defined"), "{err}");
    }
}
