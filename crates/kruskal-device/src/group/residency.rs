//! Where each GPU's shard of each mode lives: on the device, or in pinned
//! host memory, copied in segments during every MTTKRP (ScalFrag,
//! AMPED's out-of-memory case).

use kruskal_partition::RowShards;

use super::GroupOptions;
use crate::{DeviceError, Gpu, Result};

/// Device memory kept free besides the plan (NCCL buffers, modules).
const MARGIN_BYTES: usize = 1 << 30;

/// When shards are streamed from host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamPolicy {
    /// Resident when it fits in free memory, streamed otherwise.
    #[default]
    Auto,
    /// Every shard streamed (to measure streaming on a tensor that fits).
    Always,
    /// Every shard resident; not fitting is an error.
    Never,
}

/// Where one GPU's shard of one mode lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    /// On the device for the whole run.
    Resident,
    /// Copied from pinned host memory in this many segments per MTTKRP.
    Streamed { segments: u64 },
}

/// Where GPU `g`'s shard of each mode lives: resident when everything fits
/// in its free memory, else (policy allowing) the largest shards streamed
/// until the rest fits.
pub(super) fn decide_residency(
    gpu: &Gpu,
    plan: &RowShards,
    g: usize,
    rank: usize,
    opts: &GroupOptions,
) -> Result<Vec<Residency>> {
    let n = plan.dims().len();
    let stride = plan.stride();
    let rows_total: usize = plan.dims().iter().map(|&d| d as usize).sum();
    let free = gpu.free_bytes()?;
    let fixed = rows_total * rank * 4
        + (0..n)
            .map(|mode| plan.rows(mode, g).len() * rank * 4)
            .sum::<usize>()
        + MARGIN_BYTES;
    let need: Vec<usize> = (0..n)
        .map(|mode| plan.nnz(mode, g) as usize * stride * 4)
        .collect();
    let stream_buffers = opts.streams * opts.segment_bytes;
    let segments = |mode: usize| {
        let per = (opts.segment_bytes / (stride * 4)).max(1) as u64;
        plan.nnz(mode, g).div_ceil(per).max(1)
    };
    let resident_total = fixed + need.iter().sum::<usize>();
    let streamed: Vec<usize> = match opts.stream {
        StreamPolicy::Never => {
            if resident_total > free {
                return Err(DeviceError::OutOfMemory {
                    what: format!(
                        "GPU {}'s resident shards (streaming was turned off)",
                        gpu.properties().ordinal
                    ),
                    needed: resident_total,
                    free,
                });
            }
            Vec::new()
        }
        StreamPolicy::Always => (0..n).collect(),
        StreamPolicy::Auto => {
            if resident_total <= free {
                Vec::new()
            } else {
                // Stream the largest shards until the rest fits.
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by_key(|&mode| std::cmp::Reverse(need[mode]));
                let mut kept = resident_total + stream_buffers;
                let mut out = Vec::new();
                for mode in order {
                    if kept <= free {
                        break;
                    }
                    kept -= need[mode];
                    out.push(mode);
                }
                out
            }
        }
    };
    let needed = fixed
        + (0..n)
            .filter(|mode| !streamed.contains(mode))
            .map(|mode| need[mode])
            .sum::<usize>()
        + if streamed.is_empty() {
            0
        } else {
            stream_buffers
        };
    if needed > free {
        return Err(DeviceError::OutOfMemory {
            what: format!(
                "GPU {}'s factors, outputs and stream buffers",
                gpu.properties().ordinal
            ),
            needed,
            free,
        });
    }
    let mut residency = vec![Residency::Resident; n];
    for mode in streamed {
        residency[mode] = Residency::Streamed {
            segments: segments(mode),
        };
    }
    Ok(residency)
}
