// flycoo: MTTKRP on FLYCOO with the dynamic remap (FLYCOO-GPU section 4).
//
// Launch: one thread block per LPT partition of the output mode
// (gridDim.x = kappa), blockDim = (32, P): P warps. The partition's
// elements (sorted by output row) are cut into P contiguous sub-ranges,
// one per warp. Per element a warp
//   - loads the element's 2N+1 words (lane j holds word j) and shares the
//     indices and value by shuffles;
//   - writes the element to `dst` at its remap id for the next mode (lane j
//     writes word j): the tensor arrives in the next mode's order, with no
//     atomics because remap ids are a permutation (Observation 1);
//   - computes val * prod_{w != mode} Y_w(i_w, :) (lane l: columns l,
//     l + 32, ...; f32 products) and adds it to an f64 accumulator of the
//     current output row.
// When the row changes, the finished row is stored as f32 (the block owns
// it: no global atomics, Observation 2), except
//   - the first and last row of each warp's sub-range, which may continue
//     in a neighbouring warp: their f64 partials go to shared memory and
//     one warp adds them in warp order after a barrier (deterministic);
//   - rows listed as shared pieces (heavy rows split across partitions):
//     one f32 atomicAdd per rank column per piece.
// Reads per element: 2N+1 words, N-1 factor rows. Writes: 2N+1 words, and
// one output row per run of equal rows.
//
// Requires -DNMODES, -DRANK, -DWARPS (= P).

#include "common.cuh"

#ifndef WARPS
#error "WARPS must be defined (-DWARPS=...)"
#endif

#define WORDS (2 * NMODES + 1)
#define NO_ROW 0xffffffffu

__device__ __forceinline__ bool is_shared(u32 row, const u32* __restrict__ rows, u64 lo, u64 hi)
{
    for (u64 s = lo; s < hi; ++s)
        if (rows[s] == row) return true;
    return false;
}

extern "C" __global__ void __launch_bounds__(32 * WARPS) mttkrp_flycoo(
    const u32* __restrict__ src,
    u32* __restrict__ dst,
    const u64* __restrict__ part_ptr,
    const u32* __restrict__ shared_rows,
    const u64* __restrict__ shared_ptr,
    const float* __restrict__ factors,
    const u64* __restrict__ row_offset,
    float* __restrict__ out,
    int mode,
    int next)
{
    __shared__ double edge_sum[2 * WARPS][RANK];
    __shared__ u32 edge_row[2 * WARPS];

    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const u64 p_lo = part_ptr[blockIdx.x];
    const u64 p_hi = part_ptr[blockIdx.x + 1];
    const u64 s_lo = shared_ptr[blockIdx.x];
    const u64 s_hi = shared_ptr[blockIdx.x + 1];
    const u64 len = p_hi - p_lo;
    const u64 lo = p_lo + len * warp / WARPS;
    const u64 hi = p_lo + len * (warp + 1) / WARPS;

    if (lane == 0) {
        edge_row[2 * warp] = NO_ROW;
        edge_row[2 * warp + 1] = NO_ROW;
    }

    double acc[COLS_PER_LANE];
    u32 row = NO_ROW;
    bool first_run = true;

    for (u64 k = lo; k <= hi; ++k) {
        u32 word = 0;
        u32 r_k = NO_ROW;
        if (k < hi) {
            if (lane < WORDS) word = src[k * WORDS + lane];
            r_k = __shfl_sync(0xffffffffu, word, NMODES + mode);
        }
        if (r_k != row) {
            // Close the run of `row` (if any).
            if (row != NO_ROW) {
                const bool last_run = (k == hi);
                if (first_run || last_run) {
                    const int slot = 2 * warp + (first_run ? 0 : 1);
                    // A run that is both first and last fills the first slot only.
#pragma unroll
                    for (int c = 0; c < COLS_PER_LANE; ++c) {
                        const int r = lane + c * WARP;
                        if (r < RANK) edge_sum[slot][r] = acc[c];
                    }
                    if (lane == 0) edge_row[slot] = row;
                } else {
                    float* o = out + (u64)row * RANK;
                    const bool shared = is_shared(row, shared_rows, s_lo, s_hi);
#pragma unroll
                    for (int c = 0; c < COLS_PER_LANE; ++c) {
                        const int r = lane + c * WARP;
                        if (r < RANK) {
                            if (shared) atomicAdd(o + r, (float)acc[c]);
                            else o[r] = (float)acc[c];
                        }
                    }
                }
                first_run = false;
            }
            row = r_k;
#pragma unroll
            for (int c = 0; c < COLS_PER_LANE; ++c) acc[c] = 0.0;
        }
        if (k == hi) break;

        // Dynamic remap: lane j writes word j at the next mode's position.
        const u32 to = __shfl_sync(0xffffffffu, word, next);
        if (lane < WORDS) dst[(u64)to * WORDS + lane] = word;

        const float v = __uint_as_float(__shfl_sync(0xffffffffu, word, 2 * NMODES));
        float prod[COLS_PER_LANE];
#pragma unroll
        for (int c = 0; c < COLS_PER_LANE; ++c) prod[c] = v;
#pragma unroll
        for (int w = 0; w < NMODES; ++w) {
            const u32 i = __shfl_sync(0xffffffffu, word, NMODES + w);
            if (w == mode) continue;
            const float* y = factors + (row_offset[w] + i) * RANK;
#pragma unroll
            for (int c = 0; c < COLS_PER_LANE; ++c) {
                const int r = lane + c * WARP;
                if (r < RANK) prod[c] *= __ldg(y + r);
            }
        }
#pragma unroll
        for (int c = 0; c < COLS_PER_LANE; ++c) acc[c] += (double)prod[c];
    }

    __syncthreads();
    // Warp 0 adds the edge partials in slot order: equal neighbouring rows
    // are one row split between warps.
    if (warp == 0) {
        u32 cur = NO_ROW;
        double sum[COLS_PER_LANE];
        for (int s = 0; s <= 2 * WARPS; ++s) {
            const u32 r_s = (s < 2 * WARPS) ? edge_row[s] : NO_ROW;
            if (s < 2 * WARPS && r_s == NO_ROW) continue;
            if (r_s != cur || s == 2 * WARPS) {
                if (cur != NO_ROW) {
                    float* o = out + (u64)cur * RANK;
                    const bool shared = is_shared(cur, shared_rows, s_lo, s_hi);
#pragma unroll
                    for (int c = 0; c < COLS_PER_LANE; ++c) {
                        const int r = lane + c * WARP;
                        if (r < RANK) {
                            if (shared) atomicAdd(o + r, (float)sum[c]);
                            else o[r] = (float)sum[c];
                        }
                    }
                }
                cur = r_s;
#pragma unroll
                for (int c = 0; c < COLS_PER_LANE; ++c) sum[c] = 0.0;
            }
            if (s == 2 * WARPS) break;
#pragma unroll
            for (int c = 0; c < COLS_PER_LANE; ++c) {
                const int r = lane + c * WARP;
                if (r < RANK) sum[c] += edge_sum[s][r];
            }
        }
    }
}

// Moves every element to its position in the layout of `mode` (used when a
// mode is asked for out of order). One warp per element.
extern "C" __global__ void flycoo_remap(const u32* __restrict__ src, u32* __restrict__ dst, u64 nnz, int mode)
{
    const int lane = threadIdx.x % WARP;
    const u64 warps = (gridDim.x * (u64)blockDim.x) / WARP;
    for (u64 k = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / WARP; k < nnz; k += warps) {
        u32 word = 0;
        if (lane < WORDS) word = src[k * WORDS + lane];
        const u32 to = __shfl_sync(0xffffffffu, word, mode);
        if (lane < WORDS) dst[(u64)to * WORDS + lane] = word;
    }
}
