// probe: a micro-benchmark of the memory hierarchy, for the floors that
// `kruskal mttkrp --backend gpu` compares the engines with.
//
// l2_gather: every warp gathers `iters` rows of RANK floats from `buf`, at
// row numbers drawn by a per-warp linear congruential sequence below `rows`
// (a power of two), the way an MTTKRP engine gathers factor rows: one row
// per warp load, lane l reading columns l, l + 32, ... The loads bypass L1
// (ld.global.cg), and `buf` is sized by the caller to fit in L2 with room
// to spare and warmed by a first launch, so the rows come from L2: rows x
// RANK x 4 bytes over the time is the L2 gather bandwidth. UNROLL rows are
// in flight per warp; each lane's sum is stored so the loads stay.
//
// Launch: blockDim = 256 (8 warps), any grid. Requires -DRANK.

#define RANK_ONLY
#include "common.cuh"

#define UNROLL 8

extern "C" __global__ void l2_gather(
    const float* __restrict__ buf, // rows x RANK
    u32 rows,                      // a power of two
    u32 iters,                     // a multiple of UNROLL
    float* __restrict__ out)       // one per thread
{
    const u32 lane = threadIdx.x % WARP;
    const u32 warp = (blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    u32 state = warp * 2654435761u + 12345u;
    float sum = 0.0f;
    for (u32 i = 0; i < iters; i += UNROLL) {
        float v[UNROLL][COLS_PER_LANE];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            state = state * 1664525u + 1013904223u;
            const float* row = buf + (u64)((state >> 7) & (rows - 1)) * RANK;
#pragma unroll
            for (int c = 0; c < COLS_PER_LANE; ++c) {
                const u32 col = lane + c * WARP;
                v[u][c] = col < RANK ? __ldcg(row + col) : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int c = 0; c < COLS_PER_LANE; ++c) sum += v[u][c];
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}
