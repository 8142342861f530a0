// The dense steps of CPD-ALS on the GPU: the factor update A = M W with its
// column statistics, the column scaling, the Gram matrix A^T A, the
// ordered reduction of per-block partials, the copy of listed factor rows
// that a GPU group's sparse exchange runs, and the sum of the partial rows
// a split plan's reduction by copies gathers on their owner.
//
// Compiled with -DRANK only (no NMODES: nothing here depends on the mode
// count). Matrices are row-major, RANK columns: M is the MTTKRP output, A a
// factor matrix, W the R x R solve in f64. Every sum runs in f64; the
// factor stays f32 (as the CPU backend does it).
//
// Determinism: a block walks tiles blockIdx.x, blockIdx.x + gridDim.x, ...;
// each thread sums its rows in row order, the block combines its threads
// in a fixed order and writes one partial row, and cpd_reduce adds the
// partials in block order. For a fixed grid the results are bit-identical
// run to run.

#define RANK_ONLY
#include "common.cuh"

#define THREADS 256
// Rank columns padded to a multiple of 4, so shared rows load as double2 pairs.
#define KP ((RANK + 3) / 4 * 4)

// Thread t's share of tile `tl` (TILE rows, padded to KP columns with zeros)
// of a rows x RANK matrix, into registers: the kernels fetch one tile ahead
// so the loads of the next tile overlap the arithmetic of this one.
template <int TILE, int LOADS>
__device__ __forceinline__ void fetch_tile(
    const float* __restrict__ src, u64 rows, u64 tl, int t, float (&next)[LOADS])
{
    const u64 row0 = tl * TILE;
    const int nrows = (int)min((u64)TILE, rows - row0);
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
        const int e = t + i * THREADS, r = e / KP, c = e % KP;
        next[i] = (e < TILE * KP && r < nrows && c < RANK) ? src[(row0 + r) * RANK + c] : 0.f;
    }
}

// ---------------------------------------------------------------------------
// cpd_update: A = M W and, per column j of the new A (f32 values as stored),
// sum of squares, largest magnitude and sum of M(i, j) * A(i, j).
//
// Thread mapping: THREADS / RANK row slots of RANK threads; thread (slot, j)
// computes column j of the RPT rows slot * RPT .. slot * RPT + RPT of the
// tile. M rows are staged in shared memory as f64 (converted once per
// entry: f32-to-f64 conversion runs at a quarter of the FMA rate, so
// converting per use would bound the kernel) and read as double2
// broadcasts; W's column j sits in registers up to rank 32, in shared
// memory up to rank 64, and comes through the read-only cache above.
// Reads M once and writes A once (8 bytes per entry).
//
// partials: gridDim.x rows of 3 * RANK doubles: [sumsq | max abs | inner].
// ---------------------------------------------------------------------------
#define SLOTS (THREADS / RANK > 0 ? THREADS / RANK : 1)
#define UPDATE_THREADS (SLOTS * RANK)
// Rows per thread: as many as 1536 staged doubles allow, 1 to 8.
#define RPT_FIT (1536 / (SLOTS * KP))
#define RPT (RPT_FIT < 1 ? 1 : RPT_FIT > 8 ? 8 : RPT_FIT)
#define UTILE (SLOTS * RPT)
// (Cutting registers for a third block per SM, with W in shared memory at
// rank 32, measured 5-25% slower on the H100.)
#if RANK <= 32
#define W_REGISTERS 1
#elif RANK <= 64
#define W_SHARED 1
#endif

// Tensor-core path (sm_80 and later, RANK a multiple of 8 up to 32): the
// same results from f64 MMAs (mma.m8n8k4), which read their operands from
// registers: four times fewer shared-memory reads per multiply-add than
// the broadcasts above, which bound that kernel (an H200 profile of rank
// 32: 79% of the L1/shared throughput, 21% of DRAM's).
//
// Warp w of block b takes 8-row groups b * WARPS_U + w, then + gridDim.x *
// WARPS_U, ... in order. Lane l = 4 g + q holds row g of its group; as an
// MMA operand it gives k = q of each k-step, and step s's k = q takes the
// real column q * UKSTEPS + s (any order of the k's is the same product, so
// each lane loads UKSTEPS contiguous floats of its row). W's fragments are
// staged in shared memory, a k-step and 8-column block per 32 doubles, in
// lane order. The result: lane l holds columns 8 nb + 2 q and + 1 of row g
// for every block nb, and keeps those columns' statistics.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && RANK % 8 == 0 && RANK <= 32
#define DENSE_MMA 1
#define WARPS_U (THREADS / 32)
#define UNB (RANK / 8)
#define UKSTEPS (RANK / 4)

// This lane's UKSTEPS floats of group `gi` (row 8 gi + g, columns q UKSTEPS
// ..), zeros past the last row.
__device__ __forceinline__ void load_group(const float* __restrict__ m, u64 rows, u64 gi, int g,
                                           int q, float (&out)[UKSTEPS])
{
    const u64 row = gi * 8 + g;
    if (row < rows) {
        const float2* src = reinterpret_cast<const float2*>(m + row * RANK + q * UKSTEPS);
#pragma unroll
        for (int i = 0; i < UKSTEPS / 2; ++i) {
            const float2 v = __ldg(src + i);
            out[2 * i] = v.x;
            out[2 * i + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < UKSTEPS; ++i) out[i] = 0.f;
    }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS) cpd_update(
    const float* __restrict__ m,
    const double* __restrict__ w,
    float* __restrict__ a,
    u64 rows,
    double* __restrict__ partials)
{
#if defined(DENSE_MMA)
    __shared__ double wfr[UKSTEPS * UNB * 32];
    __shared__ double red[THREADS * UNB * 2];
    const int t = threadIdx.x, lane = t % 32, warp = t / 32;
    const int q = lane % 4, g = lane / 4;
    for (int e = t; e < UKSTEPS * UNB * 32; e += THREADS) {
        const int s = e / (UNB * 32), nb = (e / 32) % UNB, l = e % 32;
        wfr[e] = w[((l % 4) * UKSTEPS + s) * RANK + nb * 8 + l / 4];
    }
    __syncthreads();
    double sumsq[UNB][2], inner[UNB][2];
    float maxabs[UNB][2];
#pragma unroll
    for (int nb = 0; nb < UNB; ++nb)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            sumsq[nb][i] = 0.0;
            inner[nb][i] = 0.0;
            maxabs[nb][i] = 0.f;
        }
    const u64 groups = (rows + 7) / 8;
    const u64 step = (u64)gridDim.x * WARPS_U;
    u64 gi = (u64)blockIdx.x * WARPS_U + warp;
    float cur[UKSTEPS];
    load_group(m, rows, gi, g, q, cur);
    for (; gi < groups; gi += step) {
        float next[UKSTEPS];
        load_group(m, rows, gi + step, g, q, next);
        double d[UNB][2];
#pragma unroll
        for (int nb = 0; nb < UNB; ++nb) d[nb][0] = d[nb][1] = 0.0;
#pragma unroll
        for (int s = 0; s < UKSTEPS; ++s) {
            const double av = (double)cur[s];
#pragma unroll
            for (int nb = 0; nb < UNB; ++nb) mma_884(d[nb], av, wfr[(s * UNB + nb) * 32 + lane]);
        }
        const u64 row = gi * 8 + g;
        if (row < rows) {
#pragma unroll
            for (int nb = 0; nb < UNB; ++nb) {
                const u64 at = row * RANK + nb * 8 + 2 * q;
                const float2 x = make_float2((float)d[nb][0], (float)d[nb][1]);
                *reinterpret_cast<float2*>(a + at) = x;
                const float2 mv = __ldg(reinterpret_cast<const float2*>(m + at));
                sumsq[nb][0] += (double)x.x * (double)x.x;
                sumsq[nb][1] += (double)x.y * (double)x.y;
                maxabs[nb][0] = fmaxf(maxabs[nb][0], fabsf(x.x));
                maxabs[nb][1] = fmaxf(maxabs[nb][1], fabsf(x.y));
                inner[nb][0] += (double)mv.x * (double)x.x;
                inner[nb][1] += (double)mv.y * (double)x.y;
            }
        }
#pragma unroll
        for (int i = 0; i < UKSTEPS; ++i) cur[i] = next[i];
    }
    // Column j = 8 nb + 2 q + i is held by lanes 4 g + q of every warp:
    // thread j sums them warp by warp, row slot by row slot.
    double* out = partials + (u64)blockIdx.x * 3 * RANK;
    for (int stat = 0; stat < 3; ++stat) {
        __syncthreads();
#pragma unroll
        for (int nb = 0; nb < UNB; ++nb)
#pragma unroll
            for (int i = 0; i < 2; ++i)
                red[t * UNB * 2 + nb * 2 + i] = stat == 0   ? sumsq[nb][i]
                                               : stat == 1 ? (double)maxabs[nb][i]
                                                           : inner[nb][i];
        __syncthreads();
        if (t < RANK) {
            const int nb = t / 8, qj = (t % 8) / 2, i = t % 2;
            double acc = 0.0;
            for (int wp = 0; wp < WARPS_U; ++wp)
                for (int gj = 0; gj < 8; ++gj) {
                    const double x = red[(wp * 32 + gj * 4 + qj) * UNB * 2 + nb * 2 + i];
                    acc = stat == 1 ? fmax(acc, x) : acc + x;
                }
            out[stat * RANK + t] = acc;
        }
    }
#else
    __shared__ __align__(16) double tile[UTILE * KP];
    __shared__ double red[UPDATE_THREADS];
    const int t = threadIdx.x;
    const bool active = t < UPDATE_THREADS;
    const int slot = t / RANK;
    const int j = t % RANK;
#if defined(W_REGISTERS)
    double wcol[KP];
#pragma unroll
    for (int k = 0; k < KP; ++k) wcol[k] = (active && k < RANK) ? w[k * RANK + j] : 0.0;
#define W_AT(k) wcol[k]
#elif defined(W_SHARED)
    __shared__ double wsh[KP * RANK];
    for (int e = t; e < KP * RANK; e += blockDim.x)
        wsh[e] = e < RANK * RANK ? w[e] : 0.0;
#define W_AT(k) ((k) < RANK ? wsh[(k) * RANK + j] : 0.0)
#else
#define W_AT(k) ((k) < RANK ? __ldg(w + (k) * RANK + j) : 0.0)
#endif
    double sumsq = 0.0, inner = 0.0;
    float maxabs = 0.f;
    const u64 tiles = (rows + UTILE - 1) / UTILE;
    constexpr int LOADS = (UTILE * KP + THREADS - 1) / THREADS;
    float next[LOADS];
    if ((u64)blockIdx.x < tiles) fetch_tile<UTILE>(m, rows, blockIdx.x, t, next);
    for (u64 tl = blockIdx.x; tl < tiles; tl += gridDim.x) {
        const u64 row0 = tl * UTILE;
        const int nrows = (int)min((u64)UTILE, rows - row0);
        __syncthreads();  // the previous tile is used up (and wsh is ready)
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const int e = t + i * THREADS;
            if (e < UTILE * KP) tile[e] = (double)next[i];
        }
        __syncthreads();
        if (tl + gridDim.x < tiles) fetch_tile<UTILE>(m, rows, tl + gridDim.x, t, next);
        if (!active) continue;
        double acc[RPT];
#pragma unroll
        for (int q = 0; q < RPT; ++q) acc[q] = 0.0;
        const double* mine = tile + slot * RPT * KP;
#pragma unroll
        for (int k = 0; k < KP; k += 4) {
            const double w0 = W_AT(k), w1 = W_AT(k + 1), w2 = W_AT(k + 2), w3 = W_AT(k + 3);
#pragma unroll
            for (int q = 0; q < RPT; ++q) {
                const double2 lo = *reinterpret_cast<const double2*>(mine + q * KP + k);
                const double2 hi = *reinterpret_cast<const double2*>(mine + q * KP + k + 2);
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
            if (r < nrows) {
                const float x = (float)acc[q];
                a[(row0 + r) * RANK + j] = x;
                sumsq += (double)x * (double)x;
                maxabs = fmaxf(maxabs, fabsf(x));
                inner += mine[q * KP + j] * (double)x;
            }
        }
    }
    // Combine the slots of each column in slot order, one statistic at a time.
    double* out = partials + (u64)blockIdx.x * 3 * RANK;
    for (int stat = 0; stat < 3; ++stat) {
        __syncthreads();
        if (active) red[t] = stat == 0 ? sumsq : stat == 1 ? (double)maxabs : inner;
        __syncthreads();
        if (t < RANK) {
            double s = red[t];
            for (int sl = 1; sl < SLOTS; ++sl) {
                const double x = red[sl * RANK + t];
                s = stat == 1 ? fmax(s, x) : s + x;
            }
            out[stat * RANK + t] = s;
        }
    }
#undef W_AT
#endif
}

// ---------------------------------------------------------------------------
// cpd_scale_gram: optionally scales column j of A by inv[j] (in place, f32),
// and sums A^T A (of the scaled values) in f64. At the tensor-core update's
// ranks, on MMAs (below); otherwise as follows.
//
// Thread mapping: the R x R Gram is cut into 4 x 4 sub-blocks; only pairs
// (bj <= bl) are computed (the Gram is symmetric). Up to THREADS pairs per
// block; when there are fewer, the spare threads form more groups and the
// groups split the tile's rows (row g, g + GROUPS, ...). Above THREADS
// pairs (ranks over 88) blockIdx.y picks which THREADS pairs a block
// computes and `inv` must be null (the caller scales first with
// cpd_scale). Rows are staged in shared memory as f64 (converted once per
// entry); each thread reads 2 x 4 doubles per row and does 16 f64 FMAs.
// Reads A once (and writes it once when scaling).
//
// partials: gridDim.x rows of RANK * RANK doubles.
// ---------------------------------------------------------------------------
#define NB (KP / 4)
#define NPAIRS (NB * (NB + 1) / 2)
#define PPB (NPAIRS < THREADS ? NPAIRS : THREADS)
#define GROUPS (THREADS / PPB)
#define GTILE (2048 / KP)

#if defined(DENSE_MMA)
#define GPAIRS (UNB * (UNB + 1) / 2)

// This lane's entries of the two 4-row k-steps from `ks` (rows 4 ks + q
// and 4 ks + 4 + q, columns 8 c + g for every block c), zeros past the
// last row. All loads are issued before any is used.
__device__ __forceinline__ void gram_load(const float* __restrict__ a, u64 rows, u64 ks, int g,
                                          int q, float (&v)[2][UNB])
{
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const u64 row = (ks + s) * 4 + q;
#pragma unroll
        for (int c = 0; c < UNB; ++c) v[s][c] = row < rows ? a[row * RANK + c * 8 + g] : 0.f;
    }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS) cpd_scale_gram(
    float* __restrict__ a,
    const float* __restrict__ inv,
    u64 rows,
    double* __restrict__ partials)
{
#if defined(DENSE_MMA)
    // Tensor-core path (as cpd_update's): A^T A over 4-row k-steps, warp w
    // of block b taking pairs of steps 2 (b * WARPS_U + w), + 1, then
    // + 2 gridDim.x * WARPS_U, ... Lane 4 g + q loads row 4 ks + q's
    // columns 8 c + g, which are both MMA operands: A(g, q) of block row c
    // and B(q, g) of block column c. Only the upper triangle's 8 x 8
    // blocks are summed; lane 4 g + q holds entries (g, 2 q) and (g, 2 q +
    // 1) of each. Each entry is loaded (and scaled) by one lane only.
    __shared__ double red[THREADS * 2];
    const int t = threadIdx.x, lane = t % 32, warp = t / 32;
    const int q = lane % 4, g = lane / 4;
    double acc[GPAIRS][2];
#pragma unroll
    for (int p = 0; p < GPAIRS; ++p) acc[p][0] = acc[p][1] = 0.0;
    float scale[UNB];
#pragma unroll
    for (int c = 0; c < UNB; ++c) scale[c] = inv != nullptr ? inv[c * 8 + g] : 1.f;
    const u64 steps = (rows + 3) / 4;
    const u64 stride = 2 * (u64)gridDim.x * WARPS_U;
    u64 ks = 2 * ((u64)blockIdx.x * WARPS_U + warp);
    float cur[2][UNB];
    gram_load(a, rows, ks, g, q, cur);
    for (; ks < steps; ks += stride) {
        // The next steps' loads first (other rows than the stores below).
        float next[2][UNB];
        gram_load(a, rows, ks + stride, g, q, next);
        double x[2][UNB];
#pragma unroll
        for (int st = 0; st < 2; ++st) {
            const u64 row = (ks + st) * 4 + q;
#pragma unroll
            for (int c = 0; c < UNB; ++c) {
                float v = cur[st][c];
                if (inv != nullptr) {
                    v *= scale[c];
                    if (row < rows) a[row * RANK + c * 8 + g] = v;
                }
                x[st][c] = (double)v;
            }
        }
        int p = 0;
#pragma unroll
        for (int mb = 0; mb < UNB; ++mb)
#pragma unroll
            for (int nb = mb; nb < UNB; ++nb) {
                mma_884(acc[p], x[0][mb], x[0][nb]);
                mma_884(acc[p], x[1][mb], x[1][nb]);
                ++p;
            }
#pragma unroll
        for (int st = 0; st < 2; ++st)
#pragma unroll
            for (int c = 0; c < UNB; ++c) cur[st][c] = next[st][c];
    }
    // Each entry summed over the warps in order; a diagonal block writes
    // its upper half (and the mirror) only, so every entry has one writer.
    double* out = partials + (u64)blockIdx.x * RANK * RANK;
    int p = 0;
#pragma unroll
    for (int mb = 0; mb < UNB; ++mb)
#pragma unroll
        for (int nb = mb; nb < UNB; ++nb) {
            __syncthreads();
            red[t * 2] = acc[p][0];
            red[t * 2 + 1] = acc[p][1];
            __syncthreads();
            if (t < 64) {
                const int ln = t / 2, i = t % 2;
                double s = 0.0;
                for (int wp = 0; wp < WARPS_U; ++wp) s += red[(wp * 32 + ln) * 2 + i];
                const int lr = ln / 4, lc = (ln % 4) * 2 + i;
                if (mb != nb || lr <= lc) {
                    const int row = mb * 8 + lr, col = nb * 8 + lc;
                    out[row * RANK + col] = s;
                    out[col * RANK + row] = s;
                }
            }
            ++p;
        }
#else
    // One buffer: the tile while summing, then the groups' partial sums.
    constexpr int TILE_DOUBLES = GTILE * KP;
    constexpr int RED_DOUBLES = THREADS * 16;
    constexpr int DOUBLES = (TILE_DOUBLES > RED_DOUBLES ? TILE_DOUBLES : RED_DOUBLES);
    __shared__ __align__(16) double smem[DOUBLES];
    double* tile = smem;

    const int t = threadIdx.x;
    const int g = t / PPB;
    const int p = blockIdx.y * PPB + t % PPB;
    const bool active = g < GROUPS && p < NPAIRS;
    // Pair p -> (bj, bl), bj <= bl, row by row of the upper triangle.
    int bj = 0, rest = p;
    while (bj < NB - 1 && rest >= NB - bj) {
        rest -= NB - bj;
        ++bj;
    }
    const int bl = bj + rest;

    double acc[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[e] = 0.0;
    const u64 tiles = (rows + GTILE - 1) / GTILE;
    constexpr int LOADS = (GTILE * KP + THREADS - 1) / THREADS;
    float next[LOADS];
    if ((u64)blockIdx.x < tiles) fetch_tile<GTILE>(a, rows, blockIdx.x, t, next);
    for (u64 tl = blockIdx.x; tl < tiles; tl += gridDim.x) {
        const u64 row0 = tl * GTILE;
        const int nrows = (int)min((u64)GTILE, rows - row0);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const int e = t + i * THREADS, r = e / KP, c = e % KP;
            if (e >= GTILE * KP) continue;
            float x = next[i];
            if (inv != nullptr && r < nrows && c < RANK) {
                x *= inv[c];
                a[(row0 + r) * RANK + c] = x;
            }
            tile[e] = (double)x;
        }
        __syncthreads();
        if (tl + gridDim.x < tiles) fetch_tile<GTILE>(a, rows, tl + gridDim.x, t, next);
        if (!active) continue;
        for (int r = g; r < nrows; r += GROUPS) {
            const double2* xr = reinterpret_cast<const double2*>(tile + r * KP + 4 * bj);
            const double2* yr = reinterpret_cast<const double2*>(tile + r * KP + 4 * bl);
            const double2 x0 = xr[0], x1 = xr[1], y0 = yr[0], y1 = yr[1];
            const double xs[4] = {x0.x, x0.y, x1.x, x1.y};
            const double ys[4] = {y0.x, y0.y, y1.x, y1.y};
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int v = 0; v < 4; ++v) acc[u * 4 + v] = fma(xs[u], ys[v], acc[u * 4 + v]);
        }
    }
    __syncthreads();
    if (active) {
#pragma unroll
        for (int e = 0; e < 16; ++e) smem[(g * PPB + t % PPB) * 16 + e] = acc[e];
    }
    __syncthreads();
    if (t < PPB && p < NPAIRS) {
        double* out = partials + (u64)blockIdx.x * RANK * RANK;
        for (int e = 0; e < 16; ++e) {
            double s = smem[t * 16 + e];
            for (int gg = 1; gg < GROUPS; ++gg) s += smem[(gg * PPB + t) * 16 + e];
            const int row = 4 * bj + e / 4, col = 4 * bl + e % 4;
            if (row < RANK && col < RANK) {
                out[row * RANK + col] = s;
                out[col * RANK + row] = s;
            }
        }
    }
#endif
}

// cpd_scale: column j of A times inv[j], in place (grid-stride, one entry
// per thread); used before cpd_scale_gram when the Gram needs blockIdx.y.
extern "C" __global__ void cpd_scale(float* __restrict__ a, const float* __restrict__ inv, u64 n)
{
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x)
        a[e] *= inv[e % RANK];
}

// cpd_reduce: out[c] = the partials' column c combined over the parts: the
// largest value for columns max_lo <= c < max_hi, the sum otherwise.
//
// Thread mapping: one warp per column (grid-stride); lane l combines parts
// l, l + 32, ... in order, then the lanes combine by a shuffle tree. The
// order is fixed, so the result is bit-identical run to run.
extern "C" __global__ void cpd_reduce(
    const double* __restrict__ partials,
    u32 parts,
    u32 width,
    u32 max_lo,
    u32 max_hi,
    double* __restrict__ out)
{
    const u32 lane = threadIdx.x % WARP;
    const u32 warps = gridDim.x * (blockDim.x / WARP);
    for (u32 c = (blockIdx.x * blockDim.x + threadIdx.x) / WARP; c < width; c += warps) {
        const bool is_max = c >= max_lo && c < max_hi;
        double s = is_max ? -1.0 / 0.0 : 0.0;
        for (u32 p = lane; p < parts; p += WARP) {
            const double x = partials[(u64)p * width + c];
            s = is_max ? fmax(s, x) : s + x;
        }
#pragma unroll
        for (int off = WARP / 2; off > 0; off /= 2) {
            const double x = __shfl_down_sync(0xffffffffu, s, off);
            s = is_max ? fmax(s, x) : s + x;
        }
        if (lane == 0) out[c] = s;
    }
}

// What the row kernels (sum_parts, copy_rows) move per thread: four columns
// (a float4) when RANK is a multiple of 4, else one; and their grid-stride
// loop over (row, piece).
#if RANK % 4 == 0
#define ROW_PIECES (RANK / 4)
#else
#define ROW_PIECES RANK
#endif
#define GRID_STRIDE(e, n) \
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < (n); e += gridDim.x * (u64)blockDim.x)

// sum_parts: rows 0 .. count-1 of out plus the same rows of `parts` blocks
// laid one after another in `parts_at` (`stride` rows apart), added in block
// order: the partial sums of a split plan's rows that the other GPUs copied
// to their owner, summed onto the owner's own. Thread mapping as move_rows'.
extern "C" __global__ void sum_parts(
    float* __restrict__ out,
    const float* __restrict__ parts_at,
    u32 parts,
    u64 stride,
    u64 count)
{
    const u64 per = ROW_PIECES;
    GRID_STRIDE(e, count * per) {
#if RANK % 4 == 0
        float4 acc = reinterpret_cast<float4*>(out)[e];
        for (u32 p = 0; p < parts; ++p) {
            const float4 x = reinterpret_cast<const float4*>(parts_at)[(u64)p * stride * per + e];
            acc.x += x.x;
            acc.y += x.y;
            acc.z += x.z;
            acc.w += x.w;
        }
        reinterpret_cast<float4*>(out)[e] = acc;
#else
        float acc = out[e];
        for (u32 p = 0; p < parts; ++p) acc += parts_at[(u64)p * stride * per + e];
        out[e] = acc;
#endif
    }
}

// move_rows<ADD>: dst row (dst_rows ? dst_rows[i] : i) = (ADD: +=) src row
// (src_rows ? src_rows[i] : i) for i < count, RANK floats a row; the loop
// of copy_rows and add_rows below.
//
// Thread mapping: grid-stride over (row, piece of four columns) when RANK
// is a multiple of 4 (16-byte loads and stores; rows start 16-byte
// aligned), over (row, column) otherwise; consecutive threads take
// consecutive pieces of one row, so every row moves in whole sectors.
template <bool ADD>
__device__ __forceinline__ void move_rows(
    const float* __restrict__ src,
    const u32* __restrict__ src_rows,
    float* __restrict__ dst,
    const u32* __restrict__ dst_rows,
    u64 count)
{
    const u64 per = ROW_PIECES;
    GRID_STRIDE(e, count * per) {
        const u64 i = e / per, c = e % per;
        const u64 s = src_rows ? (u64)src_rows[i] : i;
        const u64 d = dst_rows ? (u64)dst_rows[i] : i;
#if RANK % 4 == 0
        float4 x = reinterpret_cast<const float4*>(src + s * RANK)[c];
        if (ADD) {
            const float4 acc = reinterpret_cast<const float4*>(dst + d * RANK)[c];
            x.x += acc.x;
            x.y += acc.y;
            x.z += acc.z;
            x.w += acc.w;
        }
        reinterpret_cast<float4*>(dst + d * RANK)[c] = x;
#else
        float x = src[s * RANK + c];
        if (ADD) x += dst[d * RANK + c];
        dst[d * RANK + c] = x;
#endif
    }
}

// copy_rows: the sparse exchange's pack (factor rows into a send buffer),
// unpack (a receive buffer into factor rows) and pull (a peer GPU's factor
// rows into this one's, src then lies on the peer: peer access is
// enabled). src and dst never overlap.
extern "C" __global__ void copy_rows(
    const float* __restrict__ src,
    const u32* __restrict__ src_rows,
    float* __restrict__ dst,
    const u32* __restrict__ dst_rows,
    u64 count)
{
    move_rows<false>(src, src_rows, dst, dst_rows, count);
}

// add_rows: a split plan's partial sums of the rows one other GPU reads,
// added onto their owner's (received packed, or pulled straight out of
// that GPU's output: src then lies on the peer). A launch's destination
// rows are distinct; the GPUs' parts are added one launch after another,
// in GPU order.
extern "C" __global__ void add_rows(
    const float* __restrict__ src,
    const u32* __restrict__ src_rows,
    float* __restrict__ dst,
    const u32* __restrict__ dst_rows,
    u64 count)
{
    move_rows<true>(src, src_rows, dst, dst_rows, count);
}

// ---------------------------------------------------------------------------
// cpd_column_stats: per column j of a rows x RANK factor, the sum of squares
// (f64) and the entry of largest magnitude with its row, the first such row
// on a tie: what the final arrangement of a model (unit columns, components
// by weight, signs) needs, read on the device so the host receives the
// factors once, already arranged.
//
// Thread mapping: SLOTS row slots of RANK threads, as in cpd_update; slot s
// of block b takes rows b * SLOTS + s, then + gridDim.x * SLOTS, ... in
// increasing order, so a thread keeps its lowest row of the largest
// magnitude (a later entry replaces it only when strictly larger). Thread j
// of slot 0 combines the slots of column j in slot order: a larger
// magnitude wins, an equal one only from a lower row. NaN never wins (its
// comparisons are false) but makes the sum NaN. A column of zeros keeps
// value 0 and row ~0.
//
// partials: gridDim.x rows of 3 * RANK doubles: [sumsq | value | row].
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS) cpd_column_stats(
    const float* __restrict__ a, u64 rows, double* __restrict__ partials)
{
    __shared__ double s_sum[UPDATE_THREADS];
    __shared__ float s_big[UPDATE_THREADS];
    __shared__ u64 s_row[UPDATE_THREADS];
    const int t = threadIdx.x;
    const int slot = t / RANK, j = t % RANK;
    double sum = 0.0;
    float big = 0.f;
    u64 at = ~0ull;
    if (t < UPDATE_THREADS) {
        for (u64 r = blockIdx.x * (u64)SLOTS + slot; r < rows; r += gridDim.x * (u64)SLOTS) {
            const float x = a[r * RANK + j];
            sum += (double)x * (double)x;
            if (fabsf(x) > fabsf(big)) {
                big = x;
                at = r;
            }
        }
        s_sum[t] = sum;
        s_big[t] = big;
        s_row[t] = at;
    }
    __syncthreads();
    if (t < RANK) {
        for (int s = 1; s < SLOTS; ++s) {
            const int o = s * RANK + t;
            sum += s_sum[o];
            const float x = s_big[o];
            const u64 r = s_row[o];
            if (fabsf(x) > fabsf(big) || (fabsf(x) == fabsf(big) && r < at)) {
                big = x;
                at = r;
            }
        }
        double* p = partials + (u64)blockIdx.x * 3 * RANK;
        p[t] = sum;
        p[RANK + t] = (double)big;
        p[2 * RANK + t] = (double)at;
    }
}

// ---------------------------------------------------------------------------
// uniform_fill: out[e] for e < n, uniform floats in [0, 1) equal bit for bit
// to the host's seeded draw of initial factors (kruskal-cpd's
// random_factors): the entries come in blocks of `block` (a multiple of
// 16), block k from the ChaCha8 keystream of key k0..k7 and 64-bit nonce
// stream | k, block counter from 0, words in order; a word w gives
// (w >> 8) * 2^-24.
//
// Thread mapping: grid-stride over groups of 16 entries; a group is one
// ChaCha block (16 words), so every thread runs the 8 rounds once per
// group and writes 64 contiguous bytes.
// ---------------------------------------------------------------------------
__device__ __forceinline__ u32 rotl32(u32 x, int n) { return (x << n) | (x >> (32 - n)); }

#define CHACHA_QR(a, b, c, d)        \
    a += b; d ^= a; d = rotl32(d, 16); \
    c += d; b ^= c; b = rotl32(b, 12); \
    a += b; d ^= a; d = rotl32(d, 8);  \
    c += d; b ^= c; b = rotl32(b, 7);

extern "C" __global__ void uniform_fill(
    float* __restrict__ out,
    u64 n,
    u64 block,
    u64 stream,
    u32 k0, u32 k1, u32 k2, u32 k3, u32 k4, u32 k5, u32 k6, u32 k7)
{
    const u64 groups = (n + 15) / 16;
    for (u64 g = blockIdx.x * (u64)blockDim.x + threadIdx.x; g < groups; g += gridDim.x * (u64)blockDim.x) {
        const u64 e0 = g * 16;
        const u64 nonce = stream | (e0 / block);
        const u64 counter = (e0 % block) / 16;
        u32 in[16] = {0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u,
                      k0, k1, k2, k3, k4, k5, k6, k7,
                      (u32)counter, (u32)(counter >> 32), (u32)nonce, (u32)(nonce >> 32)};
        u32 x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = in[i];
#pragma unroll
        for (int round = 0; round < 4; ++round) {
            CHACHA_QR(x[0], x[4], x[8], x[12]);
            CHACHA_QR(x[1], x[5], x[9], x[13]);
            CHACHA_QR(x[2], x[6], x[10], x[14]);
            CHACHA_QR(x[3], x[7], x[11], x[15]);
            CHACHA_QR(x[0], x[5], x[10], x[15]);
            CHACHA_QR(x[1], x[6], x[11], x[12]);
            CHACHA_QR(x[2], x[7], x[8], x[13]);
            CHACHA_QR(x[3], x[4], x[9], x[14]);
        }
        const float scale = 1.f / 16777216.f;
        if (e0 + 16 <= n && (reinterpret_cast<u64>(out + e0) & 15) == 0) {
            float4* dst = reinterpret_cast<float4*>(out + e0);
#pragma unroll
            for (int q = 0; q < 4; ++q)
                dst[q] = make_float4((float)((x[4 * q] + in[4 * q]) >> 8) * scale,
                                     (float)((x[4 * q + 1] + in[4 * q + 1]) >> 8) * scale,
                                     (float)((x[4 * q + 2] + in[4 * q + 2]) >> 8) * scale,
                                     (float)((x[4 * q + 3] + in[4 * q + 3]) >> 8) * scale);
        } else {
#pragma unroll
            for (int i = 0; i < 16; ++i)
                if (e0 + i < n) out[e0 + i] = (float)((x[i] + in[i]) >> 8) * scale;
        }
    }
}
