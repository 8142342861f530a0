//! AMPED plans: each mode's output rows spread over GPUs (tensor shards),
//! each shard cut into inter-shard partitions (ISPs) of equal size.
//!
//! A shard is a [`ModeLayout`] partition with one partition per GPU: all
//! nonzeros of an output row go to one GPU (no coherence between GPUs),
//! assigned by greedy LPT on nonzero counts, except rows heavier than the
//! split threshold, whose pieces may land on different GPUs and join in the
//! exchange step. Inside a GPU the shard is cut into ISPs of equal nonzero
//! count (the last one smaller), one thread block each; ISPs that share an
//! output row combine by atomics on that GPU.

use std::ops::Range;

use kruskal_formats::SparseTensor;

use crate::layout::{LayoutOptions, ModeLayout};
use crate::lpt::{Balance, Policy};
use crate::{PartitionError, Result};

/// Options of a shard plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardOptions {
    pub gpus: usize,
    /// ISPs each GPU's shard is cut into (e.g. a few per SM).
    pub isps_per_gpu: usize,
    /// Rows heavier than this are split across GPUs; `None` means
    /// `ceil(nnz / gpus)`.
    pub split_threshold: Option<u64>,
    pub policy: Policy,
}

impl ShardOptions {
    pub fn new(gpus: usize, isps_per_gpu: usize) -> Self {
        ShardOptions {
            gpus,
            isps_per_gpu,
            split_threshold: None,
            policy: Policy::Lpt,
        }
    }
}

/// One mode's shards and ISPs.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    layout: ModeLayout,
    /// `isp_ptr[g]`: ISP boundaries of GPU `g`'s shard, as layout positions
    /// (ISP `i` holds `isp_ptr[g][i]..isp_ptr[g][i + 1]`).
    isp_ptr: Vec<Vec<u64>>,
}

impl ShardPlan {
    /// Plans `mode` over `opts.gpus` GPUs.
    pub fn new(tensor: &SparseTensor, mode: usize, opts: &ShardOptions) -> Result<Self> {
        if opts.isps_per_gpu == 0 {
            return Err(PartitionError::Argument(
                "a shard needs at least one ISP per GPU".into(),
            ));
        }
        if opts.gpus == 0 {
            return Err(PartitionError::Argument(
                "a shard plan needs at least one GPU".into(),
            ));
        }
        let layout_opts = LayoutOptions {
            kappa: opts.gpus,
            split_threshold: opts.split_threshold,
            policy: opts.policy,
        };
        let layout = ModeLayout::new(tensor, mode, &layout_opts)?;
        let isp_ptr = layout
            .part_ptr()
            .windows(2)
            .map(|w| {
                let (lo, hi) = (w[0], w[1]);
                let size = (hi - lo).div_ceil(opts.isps_per_gpu as u64).max(1);
                let mut ptr: Vec<u64> = (lo..hi).step_by(size as usize).collect();
                ptr.push(hi);
                ptr
            })
            .collect();
        Ok(ShardPlan { layout, isp_ptr })
    }

    /// Plans every mode.
    pub fn for_all_modes(tensor: &SparseTensor, opts: &ShardOptions) -> Result<Vec<ShardPlan>> {
        (0..tensor.nmodes())
            .map(|mode| ShardPlan::new(tensor, mode, opts))
            .collect()
    }

    pub fn mode(&self) -> usize {
        self.layout.mode()
    }

    pub fn gpus(&self) -> usize {
        self.layout.kappa()
    }

    /// The layout behind the plan (positions of every nonzero, shared
    /// pieces of rows split across GPUs).
    pub fn layout(&self) -> &ModeLayout {
        &self.layout
    }

    /// Layout positions of GPU `g`'s shard.
    pub fn shard(&self, g: usize) -> Range<u64> {
        self.layout.part_ptr()[g]..self.layout.part_ptr()[g + 1]
    }

    /// ISP boundaries of GPU `g`'s shard (layout positions).
    pub fn isp_ptr(&self, g: usize) -> &[u64] {
        &self.isp_ptr[g]
    }

    /// Nonzeros per GPU.
    pub fn gpu_balance(&self) -> Balance {
        self.layout.balance()
    }

    /// Nonzeros per ISP, over all GPUs.
    pub fn isp_balance(&self) -> Balance {
        let loads: Vec<u64> = self
            .isp_ptr
            .iter()
            .flat_map(|p| p.windows(2).map(|w| w[1] - w[0]))
            .collect();
        Balance::of(&loads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn shards_and_isps_cover_every_nonzero_once(
            seed in any::<u64>(),
            nnz in 1usize..3_000,
            gpus in 1usize..9,
            isps in 1usize..50,
            exponent in 0.0f64..1.8,
        ) {
            let mut spec = PowerLawSpec::new(vec![60, 50, 40, 30], nnz).with_draws().with_seed(seed);
            spec.exponents = vec![exponent; 4];
            let t = power_law(&spec).unwrap();
            for plan in ShardPlan::for_all_modes(&t, &ShardOptions::new(gpus, isps)).unwrap() {
                prop_assert_eq!(plan.gpus(), gpus);
                let mut covered = 0u64;
                for g in 0..gpus {
                    let shard = plan.shard(g);
                    let ptr = plan.isp_ptr(g);
                    prop_assert_eq!(ptr[0], shard.start);
                    prop_assert_eq!(*ptr.last().unwrap(), shard.end);
                    prop_assert!(ptr.len() - 1 <= isps.max(1));
                    // Equal ISPs, the last one no larger.
                    let sizes: Vec<u64> = ptr.windows(2).map(|w| w[1] - w[0]).collect();
                    if let Some((last, rest)) = sizes.split_last() {
                        prop_assert!(rest.iter().all(|&s| s == sizes[0]));
                        prop_assert!(*last <= sizes[0] && *last > 0);
                    }
                    covered += shard.end - shard.start;
                }
                prop_assert_eq!(covered, t.nnz() as u64);
                // A row lives on one GPU unless it was split.
                let rows = t.mode_indices(plan.mode());
                let mut gpu_of = vec![usize::MAX; t.dims()[plan.mode()] as usize];
                for (k, &q) in plan.layout().positions().iter().enumerate() {
                    let g = plan.layout().part_ptr().partition_point(|&x| x <= u64::from(q)) - 1;
                    let r = rows[k] as usize;
                    if gpu_of[r] == usize::MAX {
                        gpu_of[r] = g;
                    } else if gpu_of[r] != g {
                        prop_assert!(plan.layout().shared().iter().any(|s| s.row as usize == r));
                    }
                }
            }
        }
    }

    #[test]
    fn rejects_zero_gpus_or_isps() {
        let t = power_law(&PowerLawSpec::new(vec![5, 5, 5], 30).with_draws()).unwrap();
        assert!(ShardPlan::new(&t, 0, &ShardOptions::new(0, 4)).is_err());
        assert!(ShardPlan::new(&t, 0, &ShardOptions::new(2, 0)).is_err());
    }
}
