// AO-ADMM's inner loop of one mode on the GPU, every row to its own
// stopping rule, and the column scaling that follows it.
//
// Compiled with -DRANK. Matrices are row-major, RANK columns: K the mode's
// MTTKRP (f32), H the factor and U its scaled dual (f64, kept on the
// device between outer iterations), W = (G + rho I)^-1 (f64, R x R). Every
// operation of the inner loop is f64, as on the CPU.
//
// The rows the loop runs on: every row of the mode (list == nullptr), or
// the rows of `list` (`count` row numbers, in order: the rows that hold a
// nonzero of the tensor, a tenth of a long sparse mode's). With a list, H
// and U are compact (`count x RANK`, entry i for row list[i]); K and the
// factor are indexed by row. A row outside the list has K = 0 and the
// solution H = 0: the caller zeroes the factor's other rows once.
//
// A row whose K is all zero (no nonzero of the tensor in it) gets H = U = 0
// before the loop: its exact solution and dual, and a fixed point of the
// loop (kruskal_cpd::admm's rule, which the CPU applies too).
//
// Per row, up to max_inner times:
//   Ht = (K + rho (H + U)) W,  H_prev = H,  H = prox(Ht - U),  U += H - Ht,
// stopping once ||H - Ht||^2 <= eps ||H||^2 and ||H - H_prev||^2 <= eps
// ||U||^2 over the row. The rows never meet, so a row's result does not
// depend on the launch shape or on which rows run beside it.
//
// Scheduling: a warp runs SLOTS rows at once, one per slot of lanes, over
// its own contiguous range of the rows (the ranges split the rows evenly
// over the launch's warps). When a slot's row stops, the slot writes it
// back and takes the warp's next row, so a warp's work is the sum of its
// rows' iterations over SLOTS, not a block's slowest row times its rows.
// Rows are handed out in the order they stop (a ballot of the finished
// slots, lowest slot first), which depends on the data only.
//
// Determinism: every row's iterations are its own; the column statistics
// are summed per lane in the order its rows stop, then over the lanes and
// warps in a fixed order, and cpd_reduce (dense.cu) adds the thread blocks'
// partials in block order.

#define RANK_ONLY
#include "common.cuh"

#define FULL 0xffffffffu

// Tensor-core path (sm_80 and later; RANK 8, 16 or 32): a warp runs 8 rows
// at once, Ht = rhs W on f64 MMAs (mma.m8n8k4) with W's fragments in
// registers. Lane l = 4 g + q is slot g's: it holds row g's columns
// 8 nb + 2q and 8 nb + 2q + 1 of every 8 x 8 tile nb (NBLK tiles): K, H, U
// and the products in registers. Per iteration the warp stages its right-
// hand side in its own rows of shared memory (__syncwarp only), and each
// lane reads as the MMA's A operand its row's UK = RANK / 4 columns q UK
// .. q UK + UK - 1, in a rotated order (pair (i + q) mod (UK / 2) in round
// i) that spreads the quarter-warps' 16-byte reads over the banks; its W
// fragment of step s is W's row of the same k (any order of the k's is
// the same product). A row's residuals are summed over its four lanes by
// shuffles.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && (RANK == 8 || RANK == 16 || RANK == 32)
#define ADMM_MMA 1
#define NBLK (RANK / 8)
#define UK (RANK / 4)
// Row stride of the staged right-hand side (doubles): half of it is 4
// modulo 8 16-byte units, so rows g and g + 1 of a quarter-warp's writes
// fall in other banks.
#define SROW (RANK == 8 ? 24 : RANK + 8)
// Warps per thread block: kruskal_device::admm's MMA_THREADS / 32.
#define WARPS 2
#define LANES 4
#define SLOTS 8
#else
// Scalar path (other ranks, or before sm_80): a slot of LANES lanes (the
// power of two at or above RANK, at most 32) runs a row, lane c of the
// slot holding columns c, c + LANES, ... (COLS of them); W's column in
// registers up to rank 32, through the read-only cache above.
#define WARPS 8
#if RANK <= 1
#define LANES 1
#elif RANK <= 2
#define LANES 2
#elif RANK <= 4
#define LANES 4
#elif RANK <= 8
#define LANES 8
#elif RANK <= 16
#define LANES 16
#else
#define LANES 32
#endif
#define SLOTS (WARP / LANES)
#define COLS ((RANK + LANES - 1) / LANES)
#endif
#define THREADS (WARPS * WARP)

// The lanes that lead a slot (lane 0 of each): a ballot's bits of slots.
__device__ __forceinline__ u32 admm_leaders()
{
    u32 m = 0;
#pragma unroll
    for (int l = 0; l < WARP; l += LANES) m |= 1u << l;
    return m;
}

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

// The sum of v over a slot's LANES lanes, in each of them (a butterfly).
__device__ __forceinline__ double admm_slot_sum(double v)
{
#pragma unroll
    for (int off = LANES / 2; off > 0; off /= 2) v += __shfl_xor_sync(FULL, v, off);
    return v;
}

// The warp's first row and the end of its range: the rows split evenly
// over the launch's warps.
__device__ __forceinline__ void admm_range(u64 rows, u64& beg, u64& end)
{
    const u64 warps = (u64)gridDim.x * WARPS;
    const u64 per = (rows + warps - 1) / warps;
    const u64 w = (u64)blockIdx.x * WARPS + threadIdx.x / WARP;
    beg = min(rows, w * per);
    end = min(rows, beg + per);
}

// ---------------------------------------------------------------------------
// admm_blocks: the whole inner loop of every row of one mode.
//
// partials: gridDim.x rows of 3 * RANK + 1 doubles: per column the sum of
// squares of the f32 rounding of the new H, the sum of K(i, j) times that
// rounding, its largest magnitude; then the most inner iterations a row of
// this thread block ran.
// ---------------------------------------------------------------------------
#if defined(ADMM_MMA)
// At rank 32 a lane keeps 32 W fragments, its row's K, H, U, operands and
// products and its columns' statistics: about 200 registers. Six blocks an
// SM (170 at most) spilled 392 bytes (ptxas, sm_90, blocks of 8 rows); four
// leave it the registers it needs.
#define LAUNCH_BLOCKS (RANK == 32 ? 4 : 6)
#else
#define LAUNCH_BLOCKS 2
#endif
extern "C" __global__ void __launch_bounds__(THREADS, LAUNCH_BLOCKS) admm_blocks(
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
    __shared__ double fin[WARPS][3 * RANK];
    __shared__ u32 fin_most[WARPS];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int slot = lane / LANES, c0 = lane % LANES;
    const u32 below = admm_leaders() & ((1u << (slot * LANES)) - 1);
    u64 beg, end;
    admm_range(rows, beg, end);
    u64 next = beg + SLOTS, cur = beg + slot;
    bool live = cur < end;
    u32 it = 0, most = 0;
#if defined(ADMM_MMA)
    __shared__ __align__(16) double rhs[WARPS][8 * SROW];
    const int q = c0, g = slot;
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
#define NV (2 * NBLK)
    // Entry v = 2 nb + c of a lane is column 8 nb + 2 q + c.
#define COL(v) (((v) / 2) * 8 + 2 * q + (v) % 2)
#define HAS(v) true
#else
    __shared__ double rhs[WARPS][SLOTS][RANK];
    double* const rw = rhs[warp][slot];
#if RANK <= 32
    double wcol[RANK];
#pragma unroll
    for (int kk = 0; kk < RANK; ++kk) wcol[kk] = c0 < RANK ? w[kk * RANK + c0] : 0.0;
#endif
#define NV COLS
#define COL(v) (c0 + (v) * LANES)
#define HAS(v) (COL(v) < RANK)
#endif
    double sumsq[NV], inner[NV];
    float maxabs[NV];
    float kv[NV];
    double hv[NV], uv[NV];
#pragma unroll
    for (int v = 0; v < NV; ++v) {
        sumsq[v] = inner[v] = 0.0;
        maxabs[v] = 0.f;
    }
    // Loads row `cur` into the lanes of the slots that take one (`take`),
    // zeroes those of slots left without a row (`drop`); every lane runs
    // it (the shuffles of the zero rule).
    auto load = [&](bool take, bool drop) {
        bool data = false;
        const u64 ek = take ? admm_row(list, cur) * RANK : 0, e = cur * RANK;
#pragma unroll
        for (int v = 0; v < NV; ++v) {
            if (take && HAS(v)) {
                kv[v] = k[ek + COL(v)];
                hv[v] = h[e + COL(v)];
                uv[v] = u[e + COL(v)];
                data = data || kv[v] != 0.f;
            } else if (drop || take) {
                kv[v] = 0.f;
                hv[v] = uv[v] = 0.0;
            }
        }
        // A row whose K is all zero gets H = U = 0.
#pragma unroll
        for (int off = LANES / 2; off > 0; off /= 2) data = __shfl_xor_sync(FULL, (int)data, off) != 0 || data;
        if (take && !data) {
#pragma unroll
            for (int v = 0; v < NV; ++v) hv[v] = uv[v] = 0.0;
        }
    };
    load(live, !live);
    while (__any_sync(FULL, live)) {
        ++it;
        // The right-hand side, rounded step by step (no fused multiply-
        // add) as the host's loop does; a slot without a row stages 0s.
        double ht[NV];
#if defined(ADMM_MMA)
#pragma unroll
        for (int nb = 0; nb < NBLK; ++nb) {
            double2 x;
            x.x = __dadd_rn((double)kv[2 * nb], __dmul_rn(rho, __dadd_rn(hv[2 * nb], uv[2 * nb])));
            x.y = __dadd_rn((double)kv[2 * nb + 1], __dmul_rn(rho, __dadd_rn(hv[2 * nb + 1], uv[2 * nb + 1])));
            *reinterpret_cast<double2*>(rw + g * SROW + nb * 8 + 2 * q) = x;
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
        {
            double d[NBLK][2];
#pragma unroll
            for (int nb = 0; nb < NBLK; ++nb) d[nb][0] = d[nb][1] = 0.0;
#pragma unroll
            for (int st = 0; st < UK; ++st)
#pragma unroll
                for (int nb = 0; nb < NBLK; ++nb) mma_884(d[nb], av[st], wfr[st][nb]);
#pragma unroll
            for (int nb = 0; nb < NBLK; ++nb) {
                ht[2 * nb] = d[nb][0];
                ht[2 * nb + 1] = d[nb][1];
            }
        }
#else
#pragma unroll
        for (int v = 0; v < NV; ++v)
            if (HAS(v)) rw[COL(v)] = __dadd_rn((double)kv[v], __dmul_rn(rho, __dadd_rn(hv[v], uv[v])));
        __syncwarp();
#pragma unroll
        for (int v = 0; v < NV; ++v) ht[v] = 0.0;
#if RANK <= 32
#pragma unroll
        for (int kk = 0; kk < RANK; ++kk) ht[0] = fma(rw[kk], wcol[kk], ht[0]);
#else
#pragma unroll 4
        for (int kk = 0; kk < RANK; ++kk) {
            const double x = rw[kk];
#pragma unroll
            for (int v = 0; v < NV; ++v)
                if (HAS(v)) ht[v] = fma(x, __ldg(w + kk * RANK + COL(v)), ht[v]);
        }
#endif
        __syncwarp();
#endif
        double res[4] = {0.0, 0.0, 0.0, 0.0};  // primal, dual, |H|^2, |U|^2
#pragma unroll
        for (int v = 0; v < NV; ++v) {
            if (!HAS(v)) continue;
            const double fresh = admm_prox(ht[v] - uv[v], nonneg, threshold, shrink);
            uv[v] += fresh - ht[v];
            const double dp = fresh - ht[v], dd = fresh - hv[v];
            res[0] = fma(dp, dp, res[0]);
            res[1] = fma(dd, dd, res[1]);
            res[2] = fma(fresh, fresh, res[2]);
            res[3] = fma(uv[v], uv[v], res[3]);
            hv[v] = fresh;
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) res[r] = admm_slot_sum(res[r]);
        const bool done = live && ((res[0] <= eps * res[2] && res[1] <= eps * res[3]) || it >= max_inner);
        if (done) {
            most = max(most, it);
            const u64 e = cur * RANK;
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                if (!HAS(v)) continue;
                h[e + COL(v)] = hv[v];
                u[e + COL(v)] = uv[v];
                // The statistics of the factor as stored (f32), as the CPU's.
                const float x = (float)hv[v];
                sumsq[v] += (double)x * (double)x;
                inner[v] += (double)kv[v] * (double)x;
                maxabs[v] = fmaxf(maxabs[v], fabsf(x));
            }
        }
        // The finished slots take the next rows, lowest slot first.
        const u32 fin_slots = __ballot_sync(FULL, done) & admm_leaders();
        if (fin_slots) {
            if (done) {
                cur = next + __popc(fin_slots & below);
                live = cur < end;
                it = 0;
            }
            next += __popc(fin_slots);
            load(done && live, done && !live);
        }
    }
    // Per column: the slots' lanes of a column summed by shuffles (a fixed
    // butterfly over the lanes LANES apart), then the warps in order.
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int off = WARP / 2; off >= LANES; off /= 2) {
            sumsq[v] += __shfl_xor_sync(FULL, sumsq[v], off);
            inner[v] += __shfl_xor_sync(FULL, inner[v], off);
            maxabs[v] = fmaxf(maxabs[v], __shfl_xor_sync(FULL, maxabs[v], off));
        }
#pragma unroll
    for (int off = WARP / 2; off > 0; off /= 2) most = max(most, __shfl_xor_sync(FULL, most, off));
    if (slot == 0) {
#pragma unroll
        for (int v = 0; v < NV; ++v) {
            if (!HAS(v)) continue;
            fin[warp][COL(v)] = sumsq[v];
            fin[warp][RANK + COL(v)] = inner[v];
            fin[warp][2 * RANK + COL(v)] = (double)maxabs[v];
        }
    }
    if (lane == 0) fin_most[warp] = most;
    __syncthreads();
    double* out = partials + (u64)blockIdx.x * (3 * RANK + 1);
    for (int x = threadIdx.x; x < 3 * RANK; x += blockDim.x) {
        double acc = fin[0][x];
        for (int wp = 1; wp < WARPS; ++wp) acc = x >= 2 * RANK ? fmax(acc, fin[wp][x]) : acc + fin[wp][x];
        out[x] = acc;
    }
    if (threadIdx.x == 0) {
        u32 m = 0;
        for (int wp = 0; wp < WARPS; ++wp) m = max(m, fin_most[wp]);
        out[3 * RANK] = (double)m;
    }
#undef NV
#undef COL
#undef HAS
}

// admm_scale: column j of H and U times inv[j] (f64, in place), and the
// factor A = the f32 rounding of the scaled H (row list[i] of A from entry
// i of H with a list, as in admm_blocks): the normalization that follows
// the inner loop. Where `compact` is not null, the same f32 rows go there
// too, entry i for entry i of H: the factor's rows with data, whose Gram
// is the factor's (its other rows are 0) at a fraction of the rows.
// Grid-stride, one entry per thread.
extern "C" __global__ void admm_scale(
    double* __restrict__ h,
    double* __restrict__ u,
    float* __restrict__ a,
    float* __restrict__ compact,
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
        if (compact) compact[e] = (float)x;
    }
}
