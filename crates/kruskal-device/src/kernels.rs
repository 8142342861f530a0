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

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use sha2::{Digest, Sha256};

use crate::{DeviceError, Result, driver};

/// The shared header, pasted in place of `#include "common.cuh"` (NVRTC
/// is given one source string).
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// One kernel source file and the launch-shape defines its engine compiles
/// it with (besides `NMODES` and `RANK`).
pub struct KernelSource {
    pub file: &'static str,
    pub text: &'static str,
    /// Compiled per mode count (`-DNMODES`); files without it take `RANK`
    /// only.
    pub per_mode: bool,
    /// Each entry is one set of extra defines an engine uses.
    pub variants: &'static [&'static [(&'static str, i64)]],
}

/// Every kernel source file.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        file: "mttkrp_coo.cu",
        text: include_str!("../kernels/mttkrp_coo.cu"),
        per_mode: true,
        variants: &[&[]],
    },
    KernelSource {
        file: "mttkrp_fcoo.cu",
        text: include_str!("../kernels/mttkrp_fcoo.cu"),
        per_mode: true,
        variants: &[
            &[("WARPS", crate::fcoo::WARPS as i64)],
            &[("WARPS", crate::fcoo::WARPS as i64), ("FIBER", 1)],
            &[("WARPS", crate::fcoo::WARPS as i64), ("HALF", 1)],
            &[
                ("WARPS", crate::fcoo::WARPS as i64),
                ("FIBER", 1),
                ("HALF", 2),
            ],
            // Lane teams exist for ranks 16, 32, 64 and 128 only.
            &[("WARPS", crate::fcoo::WARPS as i64), ("TEAMS", 1)],
            &[
                ("WARPS", crate::fcoo::WARPS as i64),
                ("TEAMS", 1),
                ("HALF", 1),
            ],
        ],
    },
    KernelSource {
        file: "mttkrp_hicoo.cu",
        text: include_str!("../kernels/mttkrp_hicoo.cu"),
        per_mode: true,
        variants: &[&[("WARPS", crate::hicoo::WARPS as i64)]],
    },
    KernelSource {
        file: "mttkrp_flycoo.cu",
        text: include_str!("../kernels/mttkrp_flycoo.cu"),
        per_mode: true,
        variants: &[
            &[("WARPS", crate::flycoo::WARPS as i64)],
            &[("WARPS", crate::flycoo::WARPS as i64), ("DETERMINISTIC", 1)],
        ],
    },
    KernelSource {
        file: "mttkrp_shard.cu",
        text: include_str!("../kernels/mttkrp_shard.cu"),
        per_mode: true,
        variants: &[&[("WARPS", crate::group::WARPS as i64)]],
    },
    KernelSource {
        file: "dense.cu",
        text: include_str!("../kernels/dense.cu"),
        per_mode: false,
        variants: &[&[]],
    },
    KernelSource {
        file: "probe.cu",
        text: include_str!("../kernels/probe.cu"),
        per_mode: false,
        variants: &[&[]],
    },
];

/// Mode counts and ranks every kernel is checked with (`cargo xtask
/// kernels`, `kruskal check`).
pub const CHECK_MODES: [i64; 4] = [3, 4, 5, 6];
pub const CHECK_RANKS: [i64; 6] = [1, 7, 16, 32, 64, 100];
/// [`CHECK_RANKS`] and 128, the largest rank of fcoo's lane teams (which
/// are compiled for the ranks [`crate::fcoo::teams_fit`] accepts only).
const TEAM_RANKS_TOO: [i64; 7] = [1, 7, 16, 32, 64, 100, 128];
/// Ranks the mode-independent kernels (`dense.cu`) are checked with: the
/// MTTKRP ranks plus the edges of their launch shapes (2 and 3 columns,
/// W read through the cache above 64, the Gram split over blockIdx.y above
/// 88, the largest rank 256).
pub const CHECK_DENSE_RANKS: [i64; 10] = [1, 2, 3, 7, 16, 32, 64, 100, 128, 256];

/// One compilation: a source file and its complete defines.
#[derive(Clone, Debug)]
pub struct Specialization {
    pub file: &'static str,
    pub defines: Vec<(&'static str, i64)>,
}

/// Every specialization of every kernel over [`CHECK_MODES`] x
/// [`CHECK_RANKS`] x each file's variants.
pub fn catalog() -> Vec<Specialization> {
    let mut all = Vec::new();
    for src in SOURCES {
        if !src.per_mode {
            for &r in &CHECK_DENSE_RANKS {
                for variant in src.variants {
                    let mut defines = vec![("RANK", r)];
                    defines.extend_from_slice(variant);
                    all.push(Specialization {
                        file: src.file,
                        defines,
                    });
                }
            }
            continue;
        }
        for &n in &CHECK_MODES {
            for &r in &TEAM_RANKS_TOO {
                for variant in src.variants {
                    let teams = variant.iter().any(|&(k, _)| k == "TEAMS");
                    let wanted = if teams {
                        crate::fcoo::teams_fit(r as usize)
                    } else {
                        CHECK_RANKS.contains(&r)
                    };
                    if !wanted {
                        continue;
                    }
                    let mut defines = vec![("NMODES", n), ("RANK", r)];
                    defines.extend_from_slice(variant);
                    if src.file == "mttkrp_flycoo.cu" {
                        let stride = crate::flycoo::element_stride(n as usize);
                        defines.push(("STRIDE", stride as i64));
                    }
                    all.push(Specialization {
                        file: src.file,
                        defines,
                    });
                }
            }
        }
    }
    all
}

/// The complete source of `file`, header included.
pub fn source(file: &str) -> Result<String> {
    let text = SOURCES
        .iter()
        .find(|s| s.file == file)
        .map(|s| s.text)
        .ok_or_else(|| DeviceError::Shape(format!("no kernel source named {file}")))?;
    Ok(text.replace("#include \"common.cuh\"", COMMON))
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

/// Compiles `file` to PTX (no GPU needed, only NVRTC).
pub fn compile(file: &str, arch: &str, defines: &[(&str, i64)]) -> Result<String> {
    crate::probe::check_nvrtc()?;
    let src = source(file)?;
    let opts = CompileOptions {
        options: options(arch, defines),
        name: Some(file.to_string()),
        ..Default::default()
    };
    match compile_ptx_with_opts(&src, opts) {
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
            functions: Mutex::new(HashMap::new()),
        }
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The cache key of a compilation.
    fn key(&self, file: &str, defines: &[(&str, i64)]) -> Result<String> {
        let mut h = Sha256::new();
        h.update(source(file)?.as_bytes());
        h.update(options(&self.arch, defines).join("\n").as_bytes());
        h.update(self.driver_version.to_le_bytes());
        Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// PTX for `file` with `defines`: from disk if an identical compilation
    /// was cached, else compiled and stored (a cache that cannot be written
    /// only costs the next run a compile).
    pub fn ptx(&self, file: &str, defines: &[(&str, i64)]) -> Result<String> {
        let key = self.key(file, defines)?;
        let path = self.disk.as_ref().map(|d| d.join(format!("{key}.ptx")));
        if let Some(ptx) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
            return Ok(ptx);
        }
        let ptx = compile(file, &self.arch, defines)?;
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

    /// The function `name` of `file` compiled with `defines`, loaded into
    /// `ctx` (cached per process).
    pub fn function(
        &self,
        ctx: &Arc<CudaContext>,
        file: &str,
        name: &str,
        defines: &[(&str, i64)],
    ) -> Result<CudaFunction> {
        // Every launch looks its kernel up here: key the in-memory cache by
        // the request itself, and hash the source only on a miss.
        let key = format!("{file}/{name}/{}", options(&self.arch, defines).join(" "));
        if let Some(f) = self.functions.lock().expect("kernel cache lock").get(&key) {
            return Ok(f.clone());
        }
        let ptx = self.ptx(file, defines)?;
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(driver(format!("loading the PTX of {file}")))?;
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
        let src = source("mttkrp_coo.cu").unwrap();
        assert!(src.contains("COLS_PER_LANE") && !src.contains("#include \"common.cuh\""));
        assert!(source("nope.cu").is_err());
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

    /// Needs NVRTC (a GPU machine, or the NVRTC wheel), not a GPU.
    #[test]
    #[ignore = "needs NVRTC"]
    fn every_kernel_compiles_and_errors_show_the_log() {
        for spec in catalog() {
            let ptx = compile(spec.file, "sm_90", &spec.defines).unwrap();
            assert!(ptx.contains(".entry"), "{spec:?}");
        }
        // Without RANK the header's #error fires, and the log says so.
        let err = compile("mttkrp_coo.cu", "sm_90", &[("NMODES", 3)]).unwrap_err();
        assert!(err.to_string().contains("RANK must be defined"), "{err}");
    }
}
