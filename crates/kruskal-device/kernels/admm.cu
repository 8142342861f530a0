// AO-ADMM's inner loop of one mode on the GPU, in blocks of BLOCK_ROWS rows
// that each run to their own stopping rule, and the column scaling that
// follows it.
//
// Compiled with -DRANK and -DBLOCK_ROWS (kruskal_device::admm::BLOCK_ROWS;
// the CPU's blocked variant uses the same). Matrices are row-major, RANK
// columns: K the mode's MTTKRP (f32), H the factor and U its scaled dual
// (f64, kept on the device between outer iterations), W = (G + rho I)^-1
// (f64, R x R). Every operation of the inner loop is f64, as on the CPU.
//
// The rows the loop runs on: every row of the mode (list == nullptr), or
// the rows of `list` (`count` row numbers, in order: the rows that hold a
// nonzero of the tensor, a tenth of a long sparse mode's). With a list, H
// and U are compact (`count x RANK`, entry i for row list[i]) and the row
// blocks are blocks of list entries; K and the factor are indexed by row.
// A row outside the list has K = 0 and the solution H = 0: the caller
// zeroes the factor's other rows once.
//
// A row whose K is all zero (no nonzero of the tensor in it) gets H = U = 0
// before the loop: its exact solution and dual, and a fixed point of the
// loop (kruskal_cpd::admm's rule, which the CPU applies too).
//
// Per block of rows, up to max_inner times:
//   Ht = (K + rho (H + U)) W,  H_prev = H,  H = prox(Ht - U),  U += H - Ht,
// stopping once ||H - Ht||^2 <= eps ||H||^2 and ||H - H_prev||^2 <= eps
// ||U||^2 over the block's rows. The rows of different blocks never meet,
// so a block's result does not depend on the launch shape.
//
// Determinism: a thread block walks row blocks blockIdx.x, blockIdx.x +
// gridDim.x, ...; every sum runs in a fixed order, and cpd_reduce (dense.cu)
// adds the thread blocks' partials in block order.

#define RANK_ONLY
#include "common.cuh"

#ifndef BLOCK_ROWS
#error "BLOCK_ROWS must be defined (-DBLOCK_ROWS=...)"
#endif

#define THREADS 256
#define WARPS (THREADS / WARP)
// Rank columns padded to a multiple of 4, so staged rows load as double2 pairs.
#define KP ((RANK + 3) / 4 * 4)
// THREADS / RANK row slots of RANK threads; RPT rows per slot.
#define SLOTS (THREADS / RANK > 0 ? THREADS / RANK : 1)
#define USED (SLOTS * RANK)
#define RPT ((BLOCK_ROWS + SLOTS - 1) / SLOTS)
#if RANK <= 32
#define W_REGISTERS 1
#endif
// Two thread blocks per SM up to rank 32 (at most 128 registers a thread;
// ptxas for sm_90 spills 16 bytes at 32): their barriers and residual sums
// overlap each other's arithmetic. Above, the rows' registers need more
// (two blocks spilled 200 bytes at rank 48; one spills none up to 128).
#if RANK <= 32
#define MIN_BLOCKS 2
#else
#define MIN_BLOCKS 1
#endif

// Tensor-core path (sm_80 and later; RANK 8, 16 or 32; blocks of 8
// rows): one warp runs a row block's whole inner loop on its own, Ht =
// rhs W on f64 MMAs (mma.m8n8k4) with W's fragments in registers; no
// barrier of the thread block inside the loop. (The earlier path, blocks
// of 32 rows over the 8 warps of a thread block, spent its time in two
// barriers and a cross-warp sum per inner iteration and in staging the
// right-hand side for every warp: Nsight Compute, an H200, nell-1's third
// mode: L1/shared 77% busy, occupancy 24%.)
//
// The block's 8 x RANK output is NBLK tiles of 8 x 8 (column block nb).
// Lane l = 4 g + q holds row g, columns 8 nb + 2q and 8 nb + 2q + 1 of
// every tile: K, H, U and the products in registers. Per iteration the
// warp stages its right-hand side in its own rows of shared memory
// (__syncwarp only), and each lane reads as the MMA's A operand its row's
// UK = RANK / 4 columns q UK .. q UK + UK - 1, in a rotated order (pair
// (i + q) mod (UK / 2) in round i) that spreads the quarter-warps' 16-byte
// reads over the banks; its W fragment of step s is W's row of the same k
// (any order of the k's is the same product). The residuals are summed
// over the warp by shuffles: every lane takes the same decision.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && (RANK == 8 || RANK == 16 || RANK == 32) && \
    BLOCK_ROWS == 8
#define ADMM_MMA 1
#define NBLK (RANK / 8)
#define UK (RANK / 4)
// Row stride of the staged right-hand side (doubles): half of it is 4
// modulo 8 16-byte units, so rows g and g + 1 of a quarter-warp's writes
// fall in other banks.
#define SROW (RANK == 8 ? 24 : RANK + 8)
// Warps (row blocks at a time) per thread block: kruskal_device::admm's
// MMA_THREADS / 32.
#define MMA_WARPS 2
#endif

// The row of K and of the factor that entry i of the loop's rows is.
__device__ __forceinline__ u64 admm_row(const u32* __restrict__ list, u64 i)
{
    return list ? (u64)list[i] : i;
}

// The proximal step of the mode's penalty at rho: the soft threshold by
// `threshold` (l1 / rho; on a non-negative mode, the shift and the clamp
// at 0), times `shrink` (1 / (1 + 2 l2 / rho)).
__device__ __forceinline__ double admm_prox(double v, int nonneg, double threshold, double shrink)
{
    double t;
    if (nonneg) {
        t = fmax(v - threshold, 0.0);
    } else if (v > threshold) {
        t = v - threshold;
    } else if (v < -threshold) {
        t = v + threshold;
    } else {
        t = 0.0;
    }
    return t * shrink;
}

// The sums of v[0..4] over the thread block, in every thread: each warp by
// a butterfly of shuffles (every lane ends with the warp's sum), then the
// warps in order. One __syncthreads; `red` (WARPS * 4 doubles) may be
// written again only after the next __syncthreads.
__device__ __forceinline__ void admm_block_sum4(double (&v)[4], double* red)
{
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int off = WARP / 2; off > 0; off /= 2) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off);
        if (lane == 0) red[warp * 4 + i] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        double s = 0.0;
        for (int w = 0; w < WARPS; ++w) s += red[w * 4 + i];
        v[i] = s;
    }
}

// ---------------------------------------------------------------------------
// admm_blocks: the whole inner loop of every row block of one mode.
//
// Thread mapping: SLOTS row slots of RANK threads; thread (slot, j) owns
// column j of rows slot * RPT .. slot * RPT + RPT - 1 of the row block and
// keeps their K (f32), H and U (f64) in registers for the whole inner loop:
// K, H and U are read once and H and U written once per row block. Per
// inner iteration the right-hand side K + rho (H + U) is staged in shared
// memory (f64) and read as double2 broadcasts against column j of W (in
// registers up to rank 32, through the read-only cache above; each entry
// of W once per iteration for all the thread's rows); the
// residuals are summed over the thread block (admm_block_sum4), so every
// thread takes the same decision to stop.
//
// partials: gridDim.x rows of 3 * RANK + 1 doubles: per column the sum of
// squares of the f32 rounding of the new H, the sum of K(i, j) times that
// rounding, its largest magnitude; then the most inner iterations a row
// block of this thread block ran.
// ---------------------------------------------------------------------------
#if defined(ADMM_MMA)
#define LAUNCH_THREADS (MMA_WARPS * WARP)
// At rank 32 a lane keeps 32 W fragments, its rows' K, H, U, operands and
// products and its columns' statistics: about 190 registers. Six blocks an
// SM (170 at most) spilled 392 bytes (ptxas, sm_90); four leave it the
// registers it needs (five blocks, ten warps, an SM).
#define LAUNCH_BLOCKS (RANK == 32 ? 4 : 6)
#else
#define LAUNCH_THREADS THREADS
#define LAUNCH_BLOCKS MIN_BLOCKS
#endif
extern "C" __global__ void __launch_bounds__(LAUNCH_THREADS, LAUNCH_BLOCKS) admm_blocks(
    const float* __restrict__ k,
    const double* __restrict__ w,
    double* __restrict__ h,
    double* __restrict__ u,
    const u32* __restrict__ list,
    u64 rows,
    double rho,
    double threshold,
    double shrink,
    int nonneg,
    u32 max_inner,
    double eps,
    double* __restrict__ partials)
{
#if defined(ADMM_MMA)
    __shared__ __align__(16) double rhs[MMA_WARPS][8 * SROW];
    __shared__ double fin[MMA_WARPS][3 * RANK];
    __shared__ u32 fin_most[MMA_WARPS];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int q = lane % 4, g = lane / 4;
    double* const rw = rhs[warp];
    // W's fragments: step s = 2 i + c of tile nb is B(q, g) = W(k, 8 nb + g),
    // k = q UK + 2 ((i + q) mod (UK / 2)) + c, the column this lane reads
    // as A in that step.
    double wfr[UK][NBLK];
#pragma unroll
    for (int i = 0; i < UK / 2; ++i)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int kk = q * UK + 2 * ((i + q) % (UK / 2)) + c;
#pragma unroll
            for (int nb = 0; nb < NBLK; ++nb) wfr[2 * i + c][nb] = w[kk * RANK + nb * 8 + g];
        }
    double sumsq[NBLK][2], inner[NBLK][2];
    float maxabs[NBLK][2];
#pragma unroll
    for (int nb = 0; nb < NBLK; ++nb)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            sumsq[nb][c] = inner[nb][c] = 0.0;
            maxabs[nb][c] = 0.f;
        }
    u32 most = 0;
    const u64 blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const u64 stride = (u64)gridDim.x * MMA_WARPS;
    for (u64 b = (u64)blockIdx.x * MMA_WARPS + warp; b < blocks; b += stride) {
        const u64 row0 = b * BLOCK_ROWS;
        const bool mine = (u64)g < rows - row0;
        float kv[NBLK][2];
        double hv[NBLK][2], uv[NBLK][2];
        const u64 ek = mine ? admm_row(list, row0 + g) * RANK + 2 * q : 0;
        const u64 e = (row0 + g) * RANK + 2 * q;
        bool data = false;
#pragma unroll
        for (int nb = 0; nb < NBLK; ++nb)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                kv[nb][c] = mine ? k[ek + nb * 8 + c] : 0.f;
                hv[nb][c] = mine ? h[e + nb * 8 + c] : 0.0;
                uv[nb][c] = mine ? u[e + nb * 8 + c] : 0.0;
                data = data || kv[nb][c] != 0.f;
            }
        // Row g's K is spread over the lanes 4 g .. 4 g + 3: a row whose K
        // is all zero gets H = U = 0.
        data = __shfl_xor_sync(0xffffffffu, (int)data, 1) != 0 || data;
        data = __shfl_xor_sync(0xffffffffu, (int)data, 2) != 0 || data;
        if (!data) {
#pragma unroll
            for (int nb = 0; nb < NBLK; ++nb) hv[nb][0] = hv[nb][1] = uv[nb][0] = uv[nb][1] = 0.0;
        }
        u32 it = 0;
        while (true) {
            ++it;
            // Rounded step by step (no fused multiply-add), as the host's
            // loop does. Rows past the block's end are written as zeros.
#pragma unroll
            for (int nb = 0; nb < NBLK; ++nb) {
                double2 v;
                v.x = __dadd_rn((double)kv[nb][0], __dmul_rn(rho, __dadd_rn(hv[nb][0], uv[nb][0])));
                v.y = __dadd_rn((double)kv[nb][1], __dmul_rn(rho, __dadd_rn(hv[nb][1], uv[nb][1])));
                *reinterpret_cast<double2*>(rw + g * SROW + nb * 8 + 2 * q) = v;
            }
            __syncwarp();
            double av[UK];
#pragma unroll
            for (int i = 0; i < UK / 2; ++i) {
                const int ii = (i + q) % (UK / 2);
                const double2 x = *reinterpret_cast<const double2*>(rw + g * SROW + q * UK + 2 * ii);
                av[2 * i] = x.x;
                av[2 * i + 1] = x.y;
            }
            // Every lane has its operands before the next iteration's
            // right-hand side replaces them.
            __syncwarp();
            double d[NBLK][2];
#pragma unroll
            for (int nb = 0; nb < NBLK; ++nb) d[nb][0] = d[nb][1] = 0.0;
#pragma unroll
            for (int st = 0; st < UK; ++st)
#pragma unroll
                for (int nb = 0; nb < NBLK; ++nb) mma_884(d[nb], av[st], wfr[st][nb]);
            double res[4] = {0.0, 0.0, 0.0, 0.0};  // primal, dual, |H|^2, |U|^2
            if (mine) {
#pragma unroll
                for (int nb = 0; nb < NBLK; ++nb)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const double ht = d[nb][c];
                        const double fresh = admm_prox(ht - uv[nb][c], nonneg, threshold, shrink);
                        uv[nb][c] += fresh - ht;
                        const double dp = fresh - ht, dd = fresh - hv[nb][c];
                        // Fused: the sums are in another order than the
                        // host's anyway, and the FP64 pipe is this path's
                        // bound (Nsight Compute: SM 73% busy).
                        res[0] = fma(dp, dp, res[0]);
                        res[1] = fma(dd, dd, res[1]);
                        res[2] = fma(fresh, fresh, res[2]);
                        res[3] = fma(uv[nb][c], uv[nb][c], res[3]);
                        hv[nb][c] = fresh;
                    }
            }
            // The warp's sums, the same in every lane (a butterfly).
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int off = WARP / 2; off > 0; off /= 2) res[r] += __shfl_xor_sync(0xffffffffu, res[r], off);
            if ((res[0] <= eps * res[2] && res[1] <= eps * res[3]) || it >= max_inner) break;
        }
        most = max(most, it);
        if (mine) {
#pragma unroll
            for (int nb = 0; nb < NBLK; ++nb)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    h[e + nb * 8 + c] = hv[nb][c];
                    u[e + nb * 8 + c] = uv[nb][c];
                    // The statistics of the factor as stored (f32), as the CPU's.
                    const float x = (float)hv[nb][c];
                    sumsq[nb][c] += (double)x * (double)x;
                    inner[nb][c] += (double)kv[nb][c] * (double)x;
                    maxabs[nb][c] = fmaxf(maxabs[nb][c], fabsf(x));
                }
        }
    }
    // Column 8 nb + 2 q + c: summed over the rows g by shuffles (lanes q,
    // q + 4, ..., a fixed butterfly), then over the warps in order.
#pragma unroll
    for (int nb = 0; nb < NBLK; ++nb)
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int off = WARP / 2; off >= 4; off /= 2) {
                sumsq[nb][c] += __shfl_xor_sync(0xffffffffu, sumsq[nb][c], off);
                inner[nb][c] += __shfl_xor_sync(0xffffffffu, inner[nb][c], off);
                maxabs[nb][c] = fmaxf(maxabs[nb][c], __shfl_xor_sync(0xffffffffu, maxabs[nb][c], off));
            }
    if (g == 0) {
#pragma unroll
        for (int nb = 0; nb < NBLK; ++nb)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = nb * 8 + 2 * q + c;
                fin[warp][col] = sumsq[nb][c];
                fin[warp][RANK + col] = inner[nb][c];
                fin[warp][2 * RANK + col] = (double)maxabs[nb][c];
            }
    }
    if (lane == 0) fin_most[warp] = most;
    __syncthreads();
    double* out = partials + (u64)blockIdx.x * (3 * RANK + 1);
    for (int x = threadIdx.x; x < 3 * RANK; x += blockDim.x) {
        double acc = fin[0][x];
        for (int wp = 1; wp < MMA_WARPS; ++wp) acc = x >= 2 * RANK ? fmax(acc, fin[wp][x]) : acc + fin[wp][x];
        out[x] = acc;
    }
    if (threadIdx.x == 0) {
        u32 m = 0;
        for (int wp = 0; wp < MMA_WARPS; ++wp) m = max(m, fin_most[wp]);
        out[3 * RANK] = (double)m;
    }
#else
    __shared__ __align__(16) double rhs[BLOCK_ROWS * KP];
    __shared__ double red[WARPS * 4];
    __shared__ double fin[THREADS];
    // tag[r] == b: row r of row block b holds a nonzero of K.
    __shared__ u64 tag[BLOCK_ROWS];
    const int t = threadIdx.x;
    const bool active = t < USED;
    const int slot = t / RANK;
    const int j = t % RANK;
#if defined(W_REGISTERS)
    double wcol[KP];
#pragma unroll
    for (int q = 0; q < KP; ++q) wcol[q] = (active && q < RANK) ? w[q * RANK + j] : 0.0;
#define W_AT(q) wcol[q]
#else
#define W_AT(q) ((q) < RANK ? __ldg(w + (q) * RANK + j) : 0.0)
#endif
    // The padding columns stay 0 (only columns below RANK are written), so
    // they add nothing, not even a NaN of uninitialized memory.
    for (int e = t; e < BLOCK_ROWS * KP; e += THREADS) rhs[e] = 0.0;
    for (int r = t; r < BLOCK_ROWS; r += THREADS) tag[r] = ~(u64)0;
    __syncthreads();

    double sumsq = 0.0, inner = 0.0;
    float maxabs = 0.f;
    u32 most = 0;
    const u64 blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
    for (u64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        const u64 row0 = b * BLOCK_ROWS;
        const int nrows = (int)min((u64)BLOCK_ROWS, rows - row0);
        float kv[RPT];
        double hv[RPT], uv[RPT];
#pragma unroll
        for (int q = 0; q < RPT; ++q) {
            const int r = slot * RPT + q;
            const bool mine = active && r < nrows;
            const u64 e = (row0 + r) * RANK + j;
            kv[q] = mine ? k[admm_row(list, row0 + r) * RANK + j] : 0.f;
            hv[q] = mine ? h[e] : 0.0;
            uv[q] = mine ? u[e] : 0.0;
            if (mine && kv[q] != 0.f) tag[r] = b;
        }
        // The tags of the previous row block were read an iteration's
        // barrier ago, so they could be replaced above.
        __syncthreads();
#pragma unroll
        for (int q = 0; q < RPT; ++q) {
            const int r = slot * RPT + q;
            if (active && r < nrows && tag[r] != b) hv[q] = uv[q] = 0.0;
        }
        u32 it = 0;
        while (true) {
            ++it;
            // Every thread has read the previous right-hand side (the
            // residual sum's barrier came after), so it can be replaced.
#pragma unroll
            for (int q = 0; q < RPT; ++q) {
                const int r = slot * RPT + q;
                // Rounded step by step (no fused multiply-add), as the
                // host's loop does: where H is clamped at 0 the loop can
                // stop only when this is exactly 0.
                if (active && r < BLOCK_ROWS)
                    rhs[r * KP + j] = __dadd_rn((double)kv[q], __dmul_rn(rho, __dadd_rn(hv[q], uv[q])));
            }
            __syncthreads();
            double res[4] = {0.0, 0.0, 0.0, 0.0};  // primal, dual, |H|^2, |U|^2
            if (active) {
                // Ht's column j for the thread's rows: each four entries of
                // W's column loaded once for all of them. A slot's rows
                // past the block (when BLOCK_ROWS is not a multiple of
                // RPT) read row 0 and are not used.
                double acc[RPT];
#pragma unroll
                for (int q = 0; q < RPT; ++q) acc[q] = 0.0;
#if defined(W_REGISTERS)
#pragma unroll
#else
#pragma unroll 2  // fully unrolled, W's cached loads took 212 registers at 64
#endif
                for (int c = 0; c < KP; c += 4) {
                    const double w0 = W_AT(c), w1 = W_AT(c + 1), w2 = W_AT(c + 2), w3 = W_AT(c + 3);
#pragma unroll
                    for (int q = 0; q < RPT; ++q) {
                        const int r = slot * RPT + q;
                        const double* row = rhs + (r < BLOCK_ROWS ? r : 0) * KP + c;
                        const double2 lo = *reinterpret_cast<const double2*>(row);
                        const double2 hi = *reinterpret_cast<const double2*>(row + 2);
                        double s = acc[q];
                        s = fma(lo.x, w0, s);
                        s = fma(lo.y, w1, s);
                        s = fma(hi.x, w2, s);
                        s = fma(hi.y, w3, s);
                        acc[q] = s;
                    }
                }
#pragma unroll
                for (int q = 0; q < RPT; ++q) {
                    const int r = slot * RPT + q;
                    if (r >= nrows) continue;
                    const double ht = acc[q];
                    const double fresh = admm_prox(ht - uv[q], nonneg, threshold, shrink);
                    uv[q] += fresh - ht;
                    const double dp = fresh - ht, dd = fresh - hv[q];
                    res[0] = __dadd_rn(res[0], __dmul_rn(dp, dp));
                    res[1] = __dadd_rn(res[1], __dmul_rn(dd, dd));
                    res[2] = __dadd_rn(res[2], __dmul_rn(fresh, fresh));
                    res[3] = __dadd_rn(res[3], __dmul_rn(uv[q], uv[q]));
                    hv[q] = fresh;
                }
            }
            admm_block_sum4(res, red);
            if ((res[0] <= eps * res[2] && res[1] <= eps * res[3]) || it >= max_inner) break;
        }
        most = max(most, it);
#pragma unroll
        for (int q = 0; q < RPT; ++q) {
            const int r = slot * RPT + q;
            if (!active || r >= nrows) continue;
            const u64 e = (row0 + r) * RANK + j;
            h[e] = hv[q];
            u[e] = uv[q];
            // The statistics of the factor as stored (f32), as the CPU's.
            const float x = (float)hv[q];
            sumsq += (double)x * (double)x;
            inner += (double)kv[q] * (double)x;
            maxabs = fmaxf(maxabs, fabsf(x));
        }
    }
#undef W_AT
    // Combine the slots of each column in slot order, one statistic at a time.
    double* out = partials + (u64)blockIdx.x * (3 * RANK + 1);
    for (int stat = 0; stat < 3; ++stat) {
        __syncthreads();
        if (active) fin[t] = stat == 0 ? sumsq : stat == 1 ? inner : (double)maxabs;
        __syncthreads();
        if (t < RANK) {
            double s = fin[t];
            for (int sl = 1; sl < SLOTS; ++sl) {
                const double x = fin[sl * RANK + t];
                s = stat == 2 ? fmax(s, x) : s + x;
            }
            out[stat * RANK + t] = s;
        }
    }
    if (t == 0) out[3 * RANK] = (double)most;
#endif
}

// admm_scale: column j of H and U times inv[j] (f64, in place), and the
// factor A = the f32 rounding of the scaled H (row list[i] of A from entry
// i of H with a list, as in admm_blocks): the normalization that follows
// the inner loop. Grid-stride, one entry per thread.
extern "C" __global__ void admm_scale(
    double* __restrict__ h,
    double* __restrict__ u,
    float* __restrict__ a,
    const double* __restrict__ inv,
    const u32* __restrict__ list,
    u64 n)
{
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x) {
        const u64 j = e % RANK;
        const double s = inv[j];
        const double x = h[e] * s;
        h[e] = x;
        u[e] *= s;
        a[admm_row(list, e / RANK) * RANK + j] = (float)x;
    }
}
