// flycoo: MTTKRP on FLYCOO with the dynamic remap (FLYCOO-GPU section 4).
//
// Launch: one thread block per LPT partition of the output mode
// (gridDim.x = kappa), blockDim = (32, P): P warps. A warp is split into
// teams of TL lanes, TL the smallest power of two that covers a factor row
// in VEC-wide vector loads (rank 32: VEC = 4, TL = 8, four teams per
// warp); lane t of a team owns columns [(t + p TL) VEC, ... + VEC) for each
// pass p. The partition's elements (sorted by output row) are cut into one
// contiguous sub-range per team. A team walks its sub-range UNROLL
// elements at a time:
//   - lane t loads words t, t + TL, ... of each element (one coalesced
//     load of the 2N+1 words) and writes them to `dst` at the element's
//     remap id for the next mode: the tensor arrives in the next mode's
//     order, with no atomics because remap ids are a permutation
//     (Observation 1);
//   - indices and value reach every lane of the team by shuffles; the N-1
//     factor rows of all UNROLL elements are gathered (vector loads) before
//     any is used, and val * prod_{w != mode} Y_w(i_w, :) is added to the
//     f64 accumulators of the current output row.
// When the row changes, the finished row is stored as f32 (the block owns
// it: no global atomics, Observation 2), except
//   - the first and last row of each team's sub-range, which may continue
//     in a neighbouring team: their f64 partials go to shared memory and
//     warp 0 adds them in team order after a barrier;
//   - rows listed as shared pieces (heavy rows split across partitions):
//     one f32 atomicAdd per rank column per piece, or with -DDETERMINISTIC
//     the piece's f64 partial is stored in `scratch` at the piece's index
//     and `flycoo_combine` adds the pieces of each row in a fixed order.
// Reads per element: 2N+1 words, N-1 factor rows. Writes: 2N+1 words, and
// one output row per run of equal rows.
//
// Requires -DNMODES, -DRANK, -DWARPS (= P); optional -DDETERMINISTIC=1.

#include "common.cuh"

#ifndef WARPS
#error "WARPS must be defined (-DWARPS=...)"
#endif
#ifndef DETERMINISTIC
#define DETERMINISTIC 0
#endif

// Elements are streamed once per mode: evict-first loads and stores keep
// factor rows in L2.
#define LOAD_E(p) __ldcs(p)
#define STORE_E(p, v) __stcs(p, v)

#define WORDS (2 * NMODES + 1)
// Words from one element to the next: padding a 7-word element to 8 makes
// every remap write one whole 32-byte sector (a partial sector costs the
// memory a read-modify-write).
#ifndef STRIDE
#define STRIDE WORDS
#endif
#define NO_ROW 0xffffffffu

// Vector width of factor-row loads (rows must stay aligned to it).
#if RANK % 4 == 0
#define VEC 4
#elif RANK % 2 == 0
#define VEC 2
#else
#define VEC 1
#endif
#define VCOLS ((RANK + VEC - 1) / VEC)
#define TL (VCOLS > 16 ? 32 : VCOLS > 8 ? 16 : VCOLS > 4 ? 8 : VCOLS > 2 ? 4 : VCOLS > 1 ? 2 : 1)
#define PASSES ((VCOLS + TL - 1) / TL)
#define TEAMS (WARPS * (WARP / TL))
// Element words per lane.
#define WPL ((STRIDE + TL - 1) / TL)
// Elements whose factor rows are in flight together, and the blocks per SM
// the register budget is fitted to (3 modes, rank 32 on the H100: 8
// elements and 2 blocks, 3.73 ms for all modes; 4 and 1, 3.80 ms).
#if PASSES > 1
#define UNROLL 1
#define MINBLOCKS 1
#elif NMODES <= 3
#define UNROLL 8
#define MINBLOCKS 2
#elif NMODES <= 4
#define UNROLL 4
#define MINBLOCKS 1
#else
#define UNROLL 2
#define MINBLOCKS 1
#endif

// Index of `row` among the partition's shared pieces, or -1.
__device__ __forceinline__ long long shared_slot(u32 row, const u32* __restrict__ rows, u64 lo, u64 hi)
{
    for (u64 s = lo; s < hi; ++s)
        if (rows[s] == row) return (long long)s;
    return -1;
}

// Stores column `col` of a finished row: owned rows directly, shared pieces
// by atomics or (deterministic) into their scratch slot.
__device__ __forceinline__ void store_col(
    u32 row, int col, double v, long long slot, float* __restrict__ out, double* __restrict__ scratch)
{
    if (slot < 0) {
        out[(u64)row * RANK + col] = (float)v;
    } else {
#if DETERMINISTIC
        scratch[(u64)slot * RANK + col] = v;
#else
        atomicAdd(out + (u64)row * RANK + col, (float)v);
#endif
    }
}

__device__ __forceinline__ void load_vec(const float* __restrict__ p, float* x)
{
#if VEC == 4
    const float4 v = __ldg(reinterpret_cast<const float4*>(p));
    x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
#elif VEC == 2
    const float2 v = __ldg(reinterpret_cast<const float2*>(p));
    x[0] = v.x; x[1] = v.y;
#else
    x[0] = __ldg(p);
#endif
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, MINBLOCKS) mttkrp_flycoo(
    const u32* __restrict__ src,
    u32* __restrict__ dst,
    const u64* __restrict__ part_ptr,
    const u32* __restrict__ shared_rows,
    const u64* __restrict__ shared_ptr,
    const float* __restrict__ factors,
    const u64* __restrict__ row_offset,
    float* __restrict__ out,
    double* __restrict__ scratch,
    int mode,
    int next)
{
    __shared__ double edge_sum[2 * TEAMS][RANK];
    __shared__ u32 edge_row[2 * TEAMS];

    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int t = lane % TL;
    const int team = (warp * WARP + lane) / TL;
    const u32 tmask = TL == 32 ? 0xffffffffu : (((1u << TL) - 1u) << (lane / TL * TL));
    const u64 p_lo = part_ptr[blockIdx.x];
    const u64 p_hi = part_ptr[blockIdx.x + 1];
    const u64 s_lo = shared_ptr[blockIdx.x];
    const u64 s_hi = shared_ptr[blockIdx.x + 1];
    const u64 len = p_hi - p_lo;
    const u64 lo = p_lo + len * team / TEAMS;
    const u64 hi = p_lo + len * (team + 1) / TEAMS;

    if (t == 0) {
        edge_row[2 * team] = NO_ROW;
        edge_row[2 * team + 1] = NO_ROW;
    }

    u64 base[NMODES];
#pragma unroll
    for (int w = 0; w < NMODES; ++w) base[w] = row_offset[w];
    // The runtime word indices (output row, next remap id) live in word
    // register (index / TL) of lane (index % TL).
    const int row_word = NMODES + mode;

    double acc[PASSES][VEC];
#pragma unroll
    for (int p = 0; p < PASSES; ++p)
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[p][v] = 0.0;
    u32 row = NO_ROW;
    bool first_run = true;

    for (u64 k0 = lo; k0 < hi; k0 += UNROLL) {
        const int nb = (int)min((u64)UNROLL, hi - k0);
        u32 word[UNROLL][WPL];
        // Load and remap UNROLL elements (lane t: words t, t + TL, ...).
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int q = 0; q < WPL; ++q) {
                const int j = t + q * TL;
                word[u][q] = (u < nb && j < WORDS) ? LOAD_E(src + (k0 + u) * STRIDE + j) : 0u;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            // The element's next-mode position, from the lane that holds it.
            u32 mine = word[u][0];
#pragma unroll
            for (int q = 1; q < WPL; ++q)
                if (q == next / TL) mine = word[u][q];
            const u32 to = __shfl_sync(tmask, mine, next % TL, TL);
            if (u < nb) {
#pragma unroll
                for (int q = 0; q < WPL; ++q) {
                    const int j = t + q * TL;
                    if (j < STRIDE) STORE_E(dst + (u64)to * STRIDE + j, word[u][q]);
                }
            }
        }

        // Gather every factor row of the UNROLL elements first.
        float prod[UNROLL][PASSES][VEC];
        u32 rows[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const float val = __uint_as_float(
                __shfl_sync(tmask, word[u][(2 * NMODES) / TL], (2 * NMODES) % TL, TL));
            u32 mine = word[u][0];
#pragma unroll
            for (int q = 1; q < WPL; ++q)
                if (q == row_word / TL) mine = word[u][q];
            rows[u] = __shfl_sync(tmask, mine, row_word % TL, TL);
#pragma unroll
            for (int p = 0; p < PASSES; ++p)
#pragma unroll
                for (int v = 0; v < VEC; ++v) prod[u][p][v] = val;
#pragma unroll
            for (int w = 0; w < NMODES; ++w) {
                const u32 i = __shfl_sync(tmask, word[u][(NMODES + w) / TL], (NMODES + w) % TL, TL);
                if (w == mode) continue;
                const float* y = factors + (base[w] + (u < nb ? i : 0)) * RANK;
#pragma unroll
                for (int p = 0; p < PASSES; ++p) {
                    const int c = (t + p * TL) * VEC;
                    if (c < RANK) {
                        float x[VEC];
                        load_vec(y + c, x);
#pragma unroll
                        for (int v = 0; v < VEC; ++v) prod[u][p][v] *= x[v];
                    }
                }
            }
        }
        // Then accumulate them in order.
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (u >= nb) break;
            if (rows[u] != row) {
                if (row != NO_ROW) {
                    if (first_run) {
#pragma unroll
                        for (int p = 0; p < PASSES; ++p)
#pragma unroll
                            for (int v = 0; v < VEC; ++v) {
                                const int c = (t + p * TL) * VEC + v;
                                if (c < RANK) edge_sum[2 * team][c] = acc[p][v];
                            }
                        if (t == 0) edge_row[2 * team] = row;
                        first_run = false;
                    } else {
                        const long long slot = shared_slot(row, shared_rows, s_lo, s_hi);
#pragma unroll
                        for (int p = 0; p < PASSES; ++p)
#pragma unroll
                            for (int v = 0; v < VEC; ++v) {
                                const int c = (t + p * TL) * VEC + v;
                                if (c < RANK) store_col(row, c, acc[p][v], slot, out, scratch);
                            }
                    }
                }
                row = rows[u];
#pragma unroll
                for (int p = 0; p < PASSES; ++p)
#pragma unroll
                    for (int v = 0; v < VEC; ++v) acc[p][v] = 0.0;
            }
#pragma unroll
            for (int p = 0; p < PASSES; ++p)
#pragma unroll
                for (int v = 0; v < VEC; ++v) acc[p][v] += (double)prod[u][p][v];
        }
    }
    // The last run of the sub-range (the first slot if it is also the first).
    if (row != NO_ROW) {
        const int slot = 2 * team + (first_run ? 0 : 1);
#pragma unroll
        for (int p = 0; p < PASSES; ++p)
#pragma unroll
            for (int v = 0; v < VEC; ++v) {
                const int c = (t + p * TL) * VEC + v;
                if (c < RANK) edge_sum[slot][c] = acc[p][v];
            }
        if (t == 0) edge_row[slot] = row;
    }

    __syncthreads();
    // Warp 0 adds the edge partials in slot order: equal neighbouring rows
    // are one row split between teams. Lane l: columns l, l + 32, ...
    if (warp == 0) {
        u32 cur = NO_ROW;
        double sum[COLS_PER_LANE];
#pragma unroll
        for (int c = 0; c < COLS_PER_LANE; ++c) sum[c] = 0.0;
        for (int s = 0; s <= 2 * TEAMS; ++s) {
            const u32 r_s = (s < 2 * TEAMS) ? edge_row[s] : NO_ROW;
            if (s < 2 * TEAMS && r_s == NO_ROW) continue;
            if (r_s != cur || s == 2 * TEAMS) {
                if (cur != NO_ROW) {
                    const long long slot = shared_slot(cur, shared_rows, s_lo, s_hi);
#pragma unroll
                    for (int c = 0; c < COLS_PER_LANE; ++c) {
                        const int r = lane + c * WARP;
                        if (r < RANK) store_col(cur, r, sum[c], slot, out, scratch);
                    }
                }
                cur = r_s;
#pragma unroll
                for (int c = 0; c < COLS_PER_LANE; ++c) sum[c] = 0.0;
            }
            if (s == 2 * TEAMS) break;
#pragma unroll
            for (int c = 0; c < COLS_PER_LANE; ++c) {
                const int r = lane + c * WARP;
                if (r < RANK) sum[c] += edge_sum[s][r];
            }
        }
    }
}

// Deterministic mode: out[row] = sum of the row's pieces in `scratch`, in
// the fixed order of `piece` (CSR by split row). One warp per split row.
extern "C" __global__ void flycoo_combine(
    const double* __restrict__ scratch,
    const u32* __restrict__ split_rows,
    const u64* __restrict__ piece_ptr,
    const u32* __restrict__ piece,
    float* __restrict__ out,
    u64 nrows)
{
    const int lane = threadIdx.x % WARP;
    const u64 warps = (gridDim.x * (u64)blockDim.x) / WARP;
    for (u64 k = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / WARP; k < nrows; k += warps) {
        double sum[COLS_PER_LANE];
#pragma unroll
        for (int c = 0; c < COLS_PER_LANE; ++c) sum[c] = 0.0;
        for (u64 p = piece_ptr[k]; p < piece_ptr[k + 1]; ++p) {
            const double* s = scratch + (u64)piece[p] * RANK;
#pragma unroll
            for (int c = 0; c < COLS_PER_LANE; ++c) {
                const int r = lane + c * WARP;
                if (r < RANK) sum[c] += s[r];
            }
        }
        float* o = out + (u64)split_rows[k] * RANK;
#pragma unroll
        for (int c = 0; c < COLS_PER_LANE; ++c) {
            const int r = lane + c * WARP;
            if (r < RANK) o[r] = (float)sum[c];
        }
    }
}

// Moves every element to its position in the layout of `mode` (used when a
// mode is asked for out of order). One thread per element.
extern "C" __global__ void flycoo_remap(const u32* __restrict__ src, u32* __restrict__ dst, u64 nnz, int mode)
{
    const u64 threads = gridDim.x * (u64)blockDim.x;
    for (u64 k = blockIdx.x * (u64)blockDim.x + threadIdx.x; k < nnz; k += threads) {
        u32 word[STRIDE];
#pragma unroll
        for (int j = 0; j < STRIDE; ++j) word[j] = __ldcs(src + k * STRIDE + j);
        u32* d = dst + (u64)word[mode] * STRIDE;
#pragma unroll
        for (int j = 0; j < STRIDE; ++j) STORE_E(d + j, word[j]);
    }
}
