// shard: AMPED's per-GPU MTTKRP (Algorithm 2) on one GPU's shard of a mode.
//
// Elements: NMODES relabeled indices then the value's bits, NMODES + 1
// words each, sorted by the output mode's index (kruskal-partition's
// RowShards), so equal output rows are adjacent. The launch covers
// `count` elements cut into inter-shard partitions (ISPs) of `isp_len`
// elements, one thread block each. Inside a block the ISP is cut into one
// contiguous chunk per warp; a warp walks its chunk, lane l computing rank
// columns l, l + 32, ... of val * prod_{w != mode} Y_w(i_w, :), and sums
// consecutive nonzeros of one output row in f64 registers. When the row
// changes (and at the chunk's end) it adds the sum into the output with
// one f32 atomicAdd per column: atomics only inside this GPU, one per run
// of equal rows rather than one per nonzero.
//
// elems:      count x (NMODES + 1) words.
// factors:    every factor, relabeled rows concatenated, RANK columns;
//             mode w's row i is at row_offset[w] + i.
// out:        this GPU's rows of the output, (row - row_lo) x RANK floats,
//             zeroed by the caller (several launches may add into it).

#include "common.cuh"

#define STRIDE (NMODES + 1)

// Adds a run's f64 sums into its output row (one f32 atomic per column).
__device__ __forceinline__ void flush_run(float* __restrict__ out, u32 row, u32 row_lo,
                                          const double* acc, int lane)
{
    float* dst = out + (u64)(row - row_lo) * RANK;
#pragma unroll
    for (int c = 0; c < COLS_PER_LANE; ++c) {
        const int r = lane + c * WARP;
        if (r < RANK) atomicAdd(dst + r, (float)acc[c]);
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * WARP) mttkrp_shard(
    const u32* __restrict__ elems,
    u64 count,
    u64 isp_len,
    const float* __restrict__ factors,
    const u64* __restrict__ row_offset,
    float* __restrict__ out,
    u32 row_lo,
    int mode)
{
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    const u64 isp_begin = (u64)blockIdx.x * isp_len;
    if (isp_begin >= count) return;
    const u64 isp_end = min(count, isp_begin + isp_len);
    const u64 chunk = (isp_end - isp_begin + WARPS - 1) / WARPS;
    const u64 begin = isp_begin + warp * chunk;
    const u64 end = min(isp_end, begin + chunk);

    u64 offset[NMODES];
#pragma unroll
    for (int w = 0; w < NMODES; ++w) offset[w] = row_offset[w];

    double acc[COLS_PER_LANE];
#pragma unroll
    for (int c = 0; c < COLS_PER_LANE; ++c) acc[c] = 0.0;
    u32 current = 0xffffffffu;

    for (u64 k = begin; k < end; ++k) {
        const u32* e = elems + k * STRIDE;
        const u32 row = e[mode];
        if (row != current) {
            if (current != 0xffffffffu) {
                flush_run(out, current, row_lo, acc, lane);
#pragma unroll
                for (int c = 0; c < COLS_PER_LANE; ++c) acc[c] = 0.0;
            }
            current = row;
        }
        const float v = __uint_as_float(e[NMODES]);
        float prod[COLS_PER_LANE];
#pragma unroll
        for (int c = 0; c < COLS_PER_LANE; ++c) prod[c] = v;
#pragma unroll
        for (int w = 0; w < NMODES; ++w) {
            if (w == mode) continue;
            const float* src = factors + (offset[w] + e[w]) * RANK;
#pragma unroll
            for (int c = 0; c < COLS_PER_LANE; ++c) {
                const int r = lane + c * WARP;
                if (r < RANK) prod[c] *= __ldg(src + r);
            }
        }
#pragma unroll
        for (int c = 0; c < COLS_PER_LANE; ++c) acc[c] += (double)prod[c];
    }
    if (current != 0xffffffffu) flush_run(out, current, row_lo, acc, lane);
}

// A kernel that stops with a trap: the group's failure tests use it to put
// one GPU into a real CUDA error mid-run.
extern "C" __global__ void shard_fault()
{
    __trap();
}
