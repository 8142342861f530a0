//! Every kernel specialization the engines compile: each source file with
//! the launch-shape defines its engine uses, over the mode counts and
//! ranks they are checked with (`cargo xtask kernels`, `kruskal check`).
//! Above the engines and the group, whose launch shapes it reads; the
//! sources and their compilation are `kernels.rs`.

use crate::kernels::{BUILD_RANK, KernelSource};

/// One kernel source file and the launch-shape defines its engine compiles
/// it with (besides `NMODES` and `RANK`).
pub struct SourceVariants {
    pub source: KernelSource,
    /// Compiled per mode count (`-DNMODES`); files without it take `RANK`
    /// only.
    pub per_mode: bool,
    /// Each entry is one set of extra defines an engine uses.
    pub variants: &'static [&'static [(&'static str, i64)]],
}

/// Every kernel source file.
pub const SOURCES: &[SourceVariants] = &[
    SourceVariants {
        source: KernelSource::Coo,
        per_mode: true,
        variants: &[&[]],
    },
    SourceVariants {
        source: KernelSource::Fcoo,
        per_mode: true,
        variants: &[
            &[("WARPS", crate::engines::fcoo::WARPS as i64)],
            &[("WARPS", crate::engines::fcoo::WARPS as i64), ("FIBER", 1)],
            &[("WARPS", crate::engines::fcoo::WARPS as i64), ("HALF", 1)],
            &[
                ("WARPS", crate::engines::fcoo::WARPS as i64),
                ("FIBER", 1),
                ("HALF", 2),
            ],
            // Lane teams exist for ranks 16, 32, 64 and 128 only: the
            // default pipeline (options::DEFAULT_PIPELINE) in f32 and bf16,
            // the plainest one, and the widest.
            &[
                ("WARPS", crate::engines::fcoo::WARPS as i64),
                ("TEAMS", 1),
                ("ROUNDS", 2),
                ("GROUP_SUMS", 1),
                ("MINB", 2),
            ],
            &[
                ("WARPS", crate::engines::fcoo::WARPS as i64),
                ("TEAMS", 1),
                ("ROUNDS", 2),
                ("GROUP_SUMS", 1),
                ("MINB", 2),
                ("HALF", 1),
            ],
            &[("WARPS", crate::engines::fcoo::WARPS as i64), ("TEAMS", 1)],
            &[
                ("WARPS", crate::engines::fcoo::WARPS as i64),
                ("TEAMS", 1),
                ("ROUNDS", 8),
                ("PREFETCH", 1),
            ],
        ],
    },
    SourceVariants {
        source: KernelSource::Hicoo,
        per_mode: true,
        variants: &[&[("WARPS", crate::engines::hicoo::WARPS as i64)]],
    },
    SourceVariants {
        source: KernelSource::Flycoo,
        per_mode: true,
        variants: &[
            &[("WARPS", crate::engines::flycoo::WARPS as i64)],
            &[
                ("WARPS", crate::engines::flycoo::WARPS as i64),
                ("DETERMINISTIC", 1),
            ],
        ],
    },
    SourceVariants {
        source: KernelSource::Shard,
        per_mode: true,
        variants: &[
            &[("WARPS", crate::kernels::SHARD_WARPS as i64)],
            &[("WARPS", crate::kernels::SHARD_WARPS as i64), ("TEAMS", 1)],
        ],
    },
    SourceVariants {
        source: KernelSource::Dense,
        per_mode: false,
        variants: &[&[]],
    },
    SourceVariants {
        source: KernelSource::Admm,
        per_mode: false,
        variants: &[&[]],
    },
    SourceVariants {
        source: KernelSource::Probe,
        per_mode: false,
        variants: &[&[]],
    },
    SourceVariants {
        source: KernelSource::FcooBuild,
        per_mode: false,
        variants: &[&[]],
    },
    SourceVariants {
        source: KernelSource::Apr,
        per_mode: false,
        variants: &[&[]],
    },
];

/// Mode counts and ranks every kernel is checked with (`cargo xtask
/// kernels`, `kruskal check`).
pub const CHECK_MODES: [i64; 4] = [3, 4, 5, 6];
pub const CHECK_RANKS: [i64; 6] = [1, 7, 16, 32, 64, 100];
/// [`CHECK_RANKS`] and 128, the largest rank of fcoo's lane teams (which
/// are compiled for the ranks [`crate::engines::fcoo::teams_fit`] accepts only).
const TEAM_RANKS_TOO: [i64; 7] = [1, 7, 16, 32, 64, 100, 128];
/// Ranks the mode-independent kernels (`dense.cu`, `apr.cu`) are checked with: the
/// MTTKRP ranks plus the edges of their launch shapes (2 and 3 columns,
/// W read through the cache above 64, the Gram split over blockIdx.y above
/// 88, the largest rank 256).
pub const CHECK_DENSE_RANKS: [i64; 10] = [1, 2, 3, 7, 16, 32, 64, 100, 128, 256];
/// Ranks AO-ADMM's kernels (`admm.cu`) are checked with: the dense ranks
/// up to its largest, [`crate::admm::MAX_RANK`] (W in registers up to 32,
/// read through the cache above).
pub const CHECK_ADMM_RANKS: [i64; 9] = [1, 2, 3, 7, 16, 32, 64, 100, 128];

/// One compilation: a source file and its complete defines.
#[derive(Clone, Debug)]
pub struct Specialization {
    pub source: KernelSource,
    pub defines: Vec<(&'static str, i64)>,
}

/// Every specialization of every kernel over [`CHECK_MODES`] x
/// [`CHECK_RANKS`] x each file's variants.
pub fn catalog() -> Vec<Specialization> {
    let mut all = Vec::new();
    for src in SOURCES {
        if !src.per_mode {
            // The F-COO build does not use the rank: one compilation.
            let ranks: &[i64] = match src.source {
                KernelSource::FcooBuild => &[BUILD_RANK],
                KernelSource::Admm => &CHECK_ADMM_RANKS,
                _ => &CHECK_DENSE_RANKS,
            };
            for &r in ranks {
                for variant in src.variants {
                    let mut defines = vec![("RANK", r)];
                    defines.extend_from_slice(variant);
                    all.push(Specialization {
                        source: src.source,
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
                        crate::engines::fcoo::teams_fit(r as usize)
                    } else {
                        CHECK_RANKS.contains(&r)
                    };
                    if !wanted {
                        continue;
                    }
                    let mut defines = vec![("NMODES", n), ("RANK", r)];
                    defines.extend_from_slice(variant);
                    if src.source == KernelSource::Flycoo {
                        let stride = crate::engines::flycoo::element_stride(n as usize);
                        defines.push(("STRIDE", stride as i64));
                    }
                    all.push(Specialization {
                        source: src.source,
                        defines,
                    });
                }
            }
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::compile;

    #[test]
    fn the_catalog_lists_every_source_once() {
        let listed: Vec<KernelSource> = SOURCES.iter().map(|s| s.source).collect();
        assert_eq!(listed, KernelSource::ALL);
    }

    /// Needs NVRTC (a GPU machine, or the NVRTC wheel), not a GPU.
    #[test]
    #[ignore = "needs NVRTC"]
    fn every_kernel_compiles() {
        for spec in catalog() {
            let ptx = compile(spec.source, "sm_90", &spec.defines).unwrap();
            assert!(ptx.contains(".entry"), "{spec:?}");
        }
    }
}
