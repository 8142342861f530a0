//! Where each GPU's shard of each mode lives: on the device, or in pinned
//! host memory, copied in segments during every MTTKRP (ScalFrag,
//! AMPED's out-of-memory case). Decided per GPU from the free memory the
//! caller measured, so the decision itself needs no GPU.

use kruskal_partition::RowShards;

use super::GroupOptions;
use kruskal_device::{DeviceError, Result};

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

/// Where GPU `g`'s shard of each mode lives, given `free`, the bytes free
/// on that GPU (the caller measures them; `ordinal`, the GPU's device
/// number, names it in errors): resident when everything fits, else
/// (policy allowing) the largest shards streamed until the rest fits.
///
/// Everything resident needs the whole factor copy, this GPU's output
/// rows of every mode, [`MARGIN_BYTES`] and every shard; streaming a shard
/// takes it off that sum and adds the stream buffers (`streams` segments
/// of `segment_bytes`) once.
/// Device bytes GPU `g` needs with every shard resident: the whole factor
/// copy, its output rows of every mode, [`MARGIN_BYTES`] and its shards.
pub(super) fn resident_bytes(plan: &RowShards, g: usize, rank: usize) -> usize {
    let n = plan.dims().len();
    let stride = plan.stride();
    let rows_total: usize = plan.dims().iter().map(|&d| d as usize).sum();
    rows_total * rank * 4
        + (0..n)
            .map(|mode| {
                output_rows(plan, mode, g) * rank * 4 + plan.nnz(mode, g) as usize * stride * 4
            })
            .sum::<usize>()
        + MARGIN_BYTES
}

/// Rows of GPU `g`'s MTTKRP output of `mode`: its own, or every row of a
/// split plan's partial mode.
fn output_rows(plan: &RowShards, mode: usize, g: usize) -> usize {
    if plan.partial(mode) {
        plan.dims()[mode] as usize
    } else {
        plan.rows(mode, g).len()
    }
}

pub(super) fn decide_residency(
    plan: &RowShards,
    g: usize,
    ordinal: usize,
    free: usize,
    rank: usize,
    opts: &GroupOptions,
) -> Result<Vec<Residency>> {
    let n = plan.dims().len();
    let stride = plan.stride();
    let rows_total: usize = plan.dims().iter().map(|&d| d as usize).sum();
    let fixed = rows_total * rank * 4
        + (0..n)
            .map(|mode| output_rows(plan, mode, g) * rank * 4)
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
                    what: format!("GPU {ordinal}'s resident shards (streaming was turned off)"),
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
            what: format!("GPU {ordinal}'s factors, outputs and stream buffers"),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes of one element (3 indices and the value, 4 bytes each).
    const ELEM: usize = 16;
    /// The stream buffers of [`options`]: 2 streams of 3200 bytes.
    const BUFFERS: usize = 2 * 3200;
    /// What every GPU of [`plan`] needs besides its shards at rank 8: the
    /// whole factor copy (8 rows of 32 bytes), its own output rows (4 of
    /// 32 bytes) and the margin.
    const FIXED: usize = 8 * 32 + 4 * 32 + MARGIN_BYTES;
    /// GPU 0's shards: 700, 900 and 500 elements.
    const RESIDENT_0: usize = FIXED + (700 + 900 + 500) * ELEM;
    /// GPU 1's shards: 300, 100 and 500 elements.
    const RESIDENT_1: usize = FIXED + (300 + 100 + 500) * ELEM;

    /// 1000 nonzeros of dims (2, 2, 4) over 2 GPUs. LPT gives GPU 0 the
    /// row of 700 in mode 0, the row of 900 in mode 1 and two rows of 250
    /// in mode 2; GPU 1 the rest.
    fn plan() -> RowShards {
        let plan = RowShards::from_counts(
            &[2, 2, 4],
            vec![vec![700, 300], vec![100, 900], vec![250; 4]],
            2,
        )
        .unwrap();
        let nnz = |g| (0..3).map(|mode| plan.nnz(mode, g)).collect::<Vec<_>>();
        assert_eq!(nnz(0), [700, 900, 500]);
        assert_eq!(nnz(1), [300, 100, 500]);
        for g in 0..2 {
            let rows: Vec<usize> = (0..3).map(|mode| plan.rows(mode, g).len()).collect();
            assert_eq!(rows, [1, 1, 2]);
        }
        plan
    }

    /// Segments of 3200 bytes (200 elements) on 2 streams.
    fn options(stream: StreamPolicy) -> GroupOptions {
        GroupOptions {
            stream,
            streams: 2,
            segment_bytes: 3200,
            ..GroupOptions::default()
        }
    }

    /// GPU `g` of `plan` (device number `10 + g`) at rank 8 with `free`
    /// bytes free.
    fn decide(
        plan: &RowShards,
        g: usize,
        free: usize,
        stream: StreamPolicy,
    ) -> Result<Vec<Residency>> {
        decide_residency(plan, g, 10 + g, free, 8, &options(stream))
    }

    fn streamed(segments: u64) -> Residency {
        Residency::Streamed { segments }
    }

    /// The out-of-memory error's message, bytes needed and bytes free.
    fn out_of_memory(r: Result<Vec<Residency>>) -> (String, usize, usize) {
        match r {
            Err(DeviceError::OutOfMemory { what, needed, free }) => (what, needed, free),
            other => panic!("expected out of memory, got {other:?}"),
        }
    }

    #[test]
    fn everything_fits_so_every_shard_is_resident() {
        let plan = plan();
        let resident = vec![Residency::Resident; 3];
        for policy in [StreamPolicy::Auto, StreamPolicy::Never] {
            assert_eq!(decide(&plan, 0, 80 << 30, policy).unwrap(), resident);
            // Exactly enough is enough.
            assert_eq!(decide(&plan, 0, RESIDENT_0, policy).unwrap(), resident);
            assert_eq!(decide(&plan, 1, RESIDENT_1, policy).unwrap(), resident);
        }
    }

    #[test]
    fn one_byte_short_streams_the_largest_shard() {
        let plan = plan();
        // Mode 1's 900 elements go, in segments of 200; the stream
        // buffers join what stays.
        let one = vec![Residency::Resident, streamed(5), Residency::Resident];
        assert_eq!(
            decide(&plan, 0, RESIDENT_0 - 1, StreamPolicy::Auto).unwrap(),
            one
        );
        let rest = RESIDENT_0 - 900 * ELEM + BUFFERS;
        assert_eq!(decide(&plan, 0, rest, StreamPolicy::Auto).unwrap(), one);
        // A byte less and the next largest (mode 0's 700) goes too.
        assert_eq!(
            decide(&plan, 0, rest - 1, StreamPolicy::Auto).unwrap(),
            [streamed(4), streamed(5), Residency::Resident]
        );
    }

    #[test]
    fn too_little_free_memory_streams_everything_or_fails() {
        let plan = plan();
        // With every shard streamed, the factors, outputs, margin and
        // stream buffers remain.
        let least = FIXED + BUFFERS;
        assert_eq!(
            decide(&plan, 0, least, StreamPolicy::Auto).unwrap(),
            [streamed(4), streamed(5), streamed(3)]
        );
        let (what, needed, free) = out_of_memory(decide(&plan, 0, least - 1, StreamPolicy::Auto));
        assert_eq!((needed, free), (least, least - 1));
        assert_eq!(what, "GPU 10's factors, outputs and stream buffers");
    }

    #[test]
    fn never_streaming_is_an_error_when_the_shards_do_not_fit() {
        let plan = plan();
        let (what, needed, free) =
            out_of_memory(decide(&plan, 1, RESIDENT_1 - 1, StreamPolicy::Never));
        assert_eq!((needed, free), (RESIDENT_1, RESIDENT_1 - 1));
        assert_eq!(what, "GPU 11's resident shards (streaming was turned off)");
    }

    #[test]
    fn always_streaming_streams_every_shard_even_an_empty_one() {
        let plan = plan();
        assert_eq!(
            decide(&plan, 0, 80 << 30, StreamPolicy::Always).unwrap(),
            [streamed(4), streamed(5), streamed(3)]
        );
        assert_eq!(
            decide(&plan, 1, 80 << 30, StreamPolicy::Always).unwrap(),
            [streamed(2), streamed(1), streamed(3)]
        );
        // The stream buffers must still fit.
        let least = FIXED + BUFFERS;
        let (_, needed, _) = out_of_memory(decide(&plan, 1, least - 1, StreamPolicy::Always));
        assert_eq!(needed, least);
        // GPU 1 owns no nonzero of a one-row mode: one (empty) segment.
        let lopsided = RowShards::from_counts(&[1, 2], vec![vec![10], vec![4, 6]], 2).unwrap();
        assert_eq!(lopsided.nnz(0, 1), 0);
        assert_eq!(
            decide_residency(&lopsided, 1, 0, 80 << 30, 8, &options(StreamPolicy::Always)).unwrap()
                [0],
            streamed(1)
        );
    }

    #[test]
    fn each_gpu_decides_from_its_own_free_memory() {
        let plan = plan();
        // The same free memory: GPU 0's larger shards do not all fit
        // (modes 1 and 0 go), GPU 1's do.
        let free = MARGIN_BYTES + 20_000;
        assert_eq!(
            decide(&plan, 0, free, StreamPolicy::Auto).unwrap(),
            [streamed(4), streamed(5), Residency::Resident]
        );
        assert_eq!(
            decide(&plan, 1, free, StreamPolicy::Auto).unwrap(),
            [Residency::Resident; 3]
        );
        // Plenty on GPU 0, a byte short on GPU 1: only GPU 1 streams, its
        // own largest shard (mode 2's 500 elements).
        assert_eq!(
            decide(&plan, 0, 80 << 30, StreamPolicy::Auto).unwrap(),
            [Residency::Resident; 3]
        );
        assert_eq!(
            decide(&plan, 1, RESIDENT_1 - 1, StreamPolicy::Auto).unwrap(),
            [Residency::Resident, Residency::Resident, streamed(3)]
        );
    }

    #[test]
    fn equal_shards_stream_in_mode_order() {
        // One GPU holds every nonzero of every mode: equal shards.
        let plan = RowShards::from_counts(&[1, 1, 1], vec![vec![1000]; 3], 1).unwrap();
        // Factors and outputs: 3 rows of 32 bytes, twice.
        let resident = 6 * 32 + MARGIN_BYTES + 3 * 1000 * ELEM;
        let opts = options(StreamPolicy::Auto);
        assert_eq!(
            decide_residency(&plan, 0, 0, resident - 1, 8, &opts).unwrap(),
            [streamed(5), Residency::Resident, Residency::Resident]
        );
    }
}
