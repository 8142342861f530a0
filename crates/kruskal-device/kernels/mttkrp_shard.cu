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
//
// Lane teams (-DTEAMS=1, for RANK 16, 32, 64 or 128, as fcoo): one
// nonzero per warp step leaves the warp with a single gather in flight.
// With teams, TL = RANK / 4 lanes hold a nonzero's row as float4s (lane l:
// columns 4 (l % TL) .. + 3) and the warp's chunk is cut into NT = 32 / TL
// contiguous parts, one per team: NT nonzeros in flight per warp step,
// one 16-byte gather per product mode each, and each team takes two
// nonzeros per step (both gathers issued before either is added). A team keeps its run's sums in
// four f64 accumulators per lane and adds them with f32 atomics when the
// row changes, as the plain mapping does per warp.

#include "common.cuh"

#define STRIDE (NMODES + 1)

#ifndef TEAMS
#define TEAMS 0
#endif
#if TEAMS
// Adds a team's run sums (its lane's four columns from tcol) into the
// output row.
__device__ __forceinline__ void flush_run4(float* __restrict__ out, u32 row, u32 row_lo,
                                           const double* acc, u32 tcol)
{
    float* dst = out + (u64)(row - row_lo) * RANK + tcol;
#pragma unroll
    for (int c = 0; c < 4; ++c) atomicAdd(dst + c, (float)acc[c]);
}

// val * prod_{w != mode} of element e's factor rows, this lane's four
// columns (base[w]: mode w's relabeled rows from this lane's column).
__device__ __forceinline__ float4 team_product(const u32* __restrict__ e,
                                               const float* const* base, int mode)
{
    const float v = __uint_as_float(e[NMODES]);
    float4 prod = make_float4(v, v, v, v);
#pragma unroll
    for (int w = 0; w < NMODES; ++w) {
        if (w == mode) continue;
        const float4 y = __ldg(reinterpret_cast<const float4*>(base[w] + (u64)e[w] * RANK));
        prod.x *= y.x;
        prod.y *= y.y;
        prod.z *= y.z;
        prod.w *= y.w;
    }
    return prod;
}

// Adds a product to the team's run of row `row`, first flushing the open
// run when the row changes.
__device__ __forceinline__ void add_to_run(float* __restrict__ out, u32 row_lo, u32 tcol, u32 row,
                                           float4 prod, double* acc, u32& current)
{
    if (row != current) {
        if (current != 0xffffffffu) {
            flush_run4(out, current, row_lo, acc, tcol);
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[c] = 0.0;
        }
        current = row;
    }
    acc[0] += (double)prod.x;
    acc[1] += (double)prod.y;
    acc[2] += (double)prod.z;
    acc[3] += (double)prod.w;
}
#endif

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

#if TEAMS
    const u32 team = lane / TL;
    const u32 tcol = 4 * (lane % TL);
    const u64 len = end > begin ? end - begin : 0;
    const u64 part = (len + NT - 1) / NT;
    const u64 t_begin = min(end, begin + team * part);
    const u64 t_end = min(end, t_begin + part);
    const float* base[NMODES];
#pragma unroll
    for (int w = 0; w < NMODES; ++w) base[w] = factors + offset[w] * RANK + tcol;
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    u32 current = 0xffffffffu;
    // Two nonzeros per step, their gathers issued before either is added.
    u64 k = t_begin;
    for (; k + 1 < t_end; k += 2) {
        const u32* e0 = elems + k * STRIDE;
        const u32* e1 = e0 + STRIDE;
        const float4 p0 = team_product(e0, base, mode);
        const float4 p1 = team_product(e1, base, mode);
        add_to_run(out, row_lo, tcol, e0[mode], p0, acc, current);
        add_to_run(out, row_lo, tcol, e1[mode], p1, acc, current);
    }
    if (k < t_end) {
        const u32* e = elems + k * STRIDE;
        add_to_run(out, row_lo, tcol, e[mode], team_product(e, base, mode), acc, current);
    }
    if (current != 0xffffffffu) flush_run4(out, current, row_lo, acc, tcol);
#else
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
#endif
}

// A kernel that stops with a trap: the group's failure tests use it to put
// one GPU into a real CUDA error mid-run.
extern "C" __global__ void shard_fault()
{
    __trap();
}
