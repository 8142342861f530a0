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

// Tensor-core path (sm_80 and later; RANK 8, 16 or 32; blocks of 32
// rows): Ht = rhs W on f64 MMAs (mma.m8n8k4), whose operands come from
// registers, instead of each thread's broadcast reads of every
// right-hand-side row from shared memory, which bound the scalar path
// (Nsight Compute, an H200, nell-1's 25.5M-row mode at rank 32: L1/shared
// 72% busy, the FP64 pipe 42%).
//
// The block's 32 x RANK output is cut into 8 x 8 tiles, tile t = (row
// group t / NBLK, column block t % NBLK); warp w takes tiles w, w + 8, ...:
// NBLK divides 8, so all of a warp's tiles share its column block, whose W
// fragments it keeps in registers. Lane l = 4 g + q holds, of each of its
// tiles, row g and columns 2q, 2q + 1 of the block (K, H, U and the
// products in registers, as the scalar path's thread holds a column). The
// right-hand side goes through shared memory once per iteration: each
// lane writes its entries, and reads as the MMA's A operand its row's
// UKSTEPS contiguous columns q UKSTEPS .. (step s gives k = q UKSTEPS +
// s: any order of the k's is the same product).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && (RANK == 8 || RANK == 16 || RANK == 32) && \
    BLOCK_ROWS == 32
#define ADMM_MMA 1
#define NBLK (RANK / 8)
#define UKSTEPS (RANK / 4)
#define TILES ((BLOCK_ROWS / 8) * NBLK)
#define TPW ((TILES + WARPS - 1) / WARPS)
// Row stride of the staged right-hand side (doubles): two more than the
// rank, so the lanes' 16-byte reads of different rows fall in other banks.
#define SROW (RANK + 2)
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
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) admm_blocks(
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
    __shared__ __align__(16) double rhs[BLOCK_ROWS * SROW];
    __shared__ double red[WARPS * 4];
    __shared__ double fin[THREADS * 2];
    // tag[r] == b: row r of row block b holds a nonzero of K.
    __shared__ u64 tag[BLOCK_ROWS];
    const int t = threadIdx.x, lane = t % WARP, warp = t / WARP;
    if (t < BLOCK_ROWS) tag[t] = ~(u64)0;
    __syncthreads();
    const int q = lane % 4, g = lane / 4;
    const int nb = warp % NBLK;
    // This warp's W fragments: B(q, g) of step s is W(q UKSTEPS + s, 8 nb + g).
    double wfr[UKSTEPS];
#pragma unroll
    for (int st = 0; st < UKSTEPS; ++st) wfr[st] = w[(q * UKSTEPS + st) * RANK + nb * 8 + g];
    double sumsq[2] = {0.0, 0.0}, inner[2] = {0.0, 0.0};
    float maxabs[2] = {0.f, 0.f};
    u32 most = 0;
    const u64 blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
    for (u64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        const u64 row0 = b * BLOCK_ROWS;
        const int nrows = (int)min((u64)BLOCK_ROWS, rows - row0);
        // Tile i of this warp: rows 8 rg .. of the block, rg = (warp + 8 i) / NBLK.
        float kv[TPW][2];
        double hv[TPW][2], uv[TPW][2];
        bool mine[TPW];
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
            const int tile = warp + i * WARPS;
            const int r = (tile / NBLK) * 8 + g;
            mine[i] = tile < TILES && r < nrows;
            const u64 e = (row0 + r) * RANK + nb * 8 + 2 * q;
            const u64 ek = mine[i] ? admm_row(list, row0 + r) * RANK + nb * 8 + 2 * q : 0;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                kv[i][c] = mine[i] ? k[ek + c] : 0.f;
                hv[i][c] = mine[i] ? h[e + c] : 0.0;
                uv[i][c] = mine[i] ? u[e + c] : 0.0;
            }
            if (mine[i] && (kv[i][0] != 0.f || kv[i][1] != 0.f)) tag[(tile / NBLK) * 8 + g] = b;
        }
        // The tags of the previous row block were read an iteration's
        // barrier ago, so they could be replaced above.
        __syncthreads();
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
            const int tile = warp + i * WARPS;
            if (mine[i] && tag[(tile / NBLK) * 8 + g] != b) {
                hv[i][0] = hv[i][1] = 0.0;
                uv[i][0] = uv[i][1] = 0.0;
            }
        }
        u32 it = 0;
        while (true) {
            ++it;
            // Every lane has read the previous right-hand side (the
            // residual sum's barrier came after), so it can be replaced.
            // Rows past the block's end are written as zeros.
#pragma unroll
            for (int i = 0; i < TPW; ++i) {
                const int tile = warp + i * WARPS;
                if (tile >= TILES) continue;
                const int r = (tile / NBLK) * 8 + g;
                double2 v;
                // Rounded step by step (no fused multiply-add), as the
                // host's loop does.
                v.x = __dadd_rn((double)kv[i][0], __dmul_rn(rho, __dadd_rn(hv[i][0], uv[i][0])));
                v.y = __dadd_rn((double)kv[i][1], __dmul_rn(rho, __dadd_rn(hv[i][1], uv[i][1])));
                *reinterpret_cast<double2*>(rhs + r * SROW + nb * 8 + 2 * q) = v;
            }
            __syncthreads();
            double res[4] = {0.0, 0.0, 0.0, 0.0};  // primal, dual, |H|^2, |U|^2
#pragma unroll
            for (int i = 0; i < TPW; ++i) {
                const int tile = warp + i * WARPS;
                if (tile >= TILES) continue;  // the same for the whole warp
                const int r = (tile / NBLK) * 8 + g;
                double av[UKSTEPS];
#pragma unroll
                for (int st = 0; st < UKSTEPS; st += 2) {
                    const double2 x = *reinterpret_cast<const double2*>(rhs + r * SROW + q * UKSTEPS + st);
                    av[st] = x.x;
                    av[st + 1] = x.y;
                }
                double d[2] = {0.0, 0.0};
#pragma unroll
                for (int st = 0; st < UKSTEPS; ++st) mma_884(d, av[st], wfr[st]);
                if (!mine[i]) continue;
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const double ht = d[c];
                    const double fresh = admm_prox(ht - uv[i][c], nonneg, threshold, shrink);
                    uv[i][c] += fresh - ht;
                    const double dp = fresh - ht, dd = fresh - hv[i][c];
                    res[0] = __dadd_rn(res[0], __dmul_rn(dp, dp));
                    res[1] = __dadd_rn(res[1], __dmul_rn(dd, dd));
                    res[2] = __dadd_rn(res[2], __dmul_rn(fresh, fresh));
                    res[3] = __dadd_rn(res[3], __dmul_rn(uv[i][c], uv[i][c]));
                    hv[i][c] = fresh;
                }
            }
            admm_block_sum4(res, red);
            if ((res[0] <= eps * res[2] && res[1] <= eps * res[3]) || it >= max_inner) break;
        }
        most = max(most, it);
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
            if (!mine[i]) continue;
            const int tile = warp + i * WARPS;
            const int r = (tile / NBLK) * 8 + g;
            const u64 e = (row0 + r) * RANK + nb * 8 + 2 * q;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                h[e + c] = hv[i][c];
                u[e + c] = uv[i][c];
                // The statistics of the factor as stored (f32), as the CPU's.
                const float x = (float)hv[i][c];
                sumsq[c] += (double)x * (double)x;
                inner[c] += (double)kv[i][c] * (double)x;
                maxabs[c] = fmaxf(maxabs[c], fabsf(x));
            }
        }
    }
    // Column j = 8 nb + 2 q + c is held by lanes 4 g + q (g = 0..7) of the
    // warps w with w % NBLK = nb: thread j adds them warp by warp, g by g.
    double* out = partials + (u64)blockIdx.x * (3 * RANK + 1);
    for (int stat = 0; stat < 3; ++stat) {
        __syncthreads();
#pragma unroll
        for (int c = 0; c < 2; ++c)
            fin[t * 2 + c] = stat == 0 ? sumsq[c] : stat == 1 ? inner[c] : (double)maxabs[c];
        __syncthreads();
        if (t < RANK) {
            const int jb = t / 8, jq = (t % 8) / 2, c = t % 2;
            double acc = 0.0;
            for (int wp = jb; wp < WARPS; wp += NBLK)
                for (int gj = 0; gj < 8; ++gj) {
                    const double x = fin[(wp * WARP + gj * 4 + jq) * 2 + c];
                    acc = stat == 2 ? fmax(acc, x) : acc + x;
                }
            out[stat * RANK + t] = acc;
        }
    }
    if (t == 0) out[3 * RANK] = (double)most;
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
