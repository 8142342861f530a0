// The dense steps of CPD-ALS on the GPU: the factor update A = M W with its
// column statistics, the column scaling, the Gram matrix A^T A, the
// ordered reduction of per-block partials, and the copy of listed factor
// rows that a GPU group's sparse exchange runs.
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

extern "C" __global__ void __launch_bounds__(THREADS) cpd_update(
    const float* __restrict__ m,
    const double* __restrict__ w,
    float* __restrict__ a,
    u64 rows,
    double* __restrict__ partials)
{
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
}

// ---------------------------------------------------------------------------
// cpd_scale_gram: optionally scales column j of A by inv[j] (in place, f32),
// and sums A^T A (of the scaled values) in f64.
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

extern "C" __global__ void __launch_bounds__(THREADS) cpd_scale_gram(
    float* __restrict__ a,
    const float* __restrict__ inv,
    u64 rows,
    double* __restrict__ partials)
{
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

// copy_rows: dst row (dst_rows ? dst_rows[i] : i) = src row (src_rows ?
// src_rows[i] : i) for i < count, RANK floats a row: the sparse exchange's
// pack (factor rows into a send buffer), unpack (a receive buffer into
// factor rows) and pull (a peer GPU's factor rows into this one's, src
// then lies on the peer: peer access is enabled). src and dst never
// overlap.
//
// Thread mapping: grid-stride over (row, piece of four columns) when RANK
// is a multiple of 4 (16-byte loads and stores; rows start 16-byte
// aligned), over (row, column) otherwise; consecutive threads take
// consecutive pieces of one row, so every row moves in whole sectors.
extern "C" __global__ void copy_rows(
    const float* __restrict__ src,
    const u32* __restrict__ src_rows,
    float* __restrict__ dst,
    const u32* __restrict__ dst_rows,
    u64 count)
{
#if RANK % 4 == 0
    const u64 per = RANK / 4;
#else
    const u64 per = RANK;
#endif
    const u64 n = count * per;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x) {
        const u64 i = e / per, c = e % per;
        const u64 s = src_rows ? (u64)src_rows[i] : i;
        const u64 d = dst_rows ? (u64)dst_rows[i] : i;
#if RANK % 4 == 0
        reinterpret_cast<float4*>(dst + d * RANK)[c] = reinterpret_cast<const float4*>(src + s * RANK)[c];
#else
        dst[d * RANK + c] = src[s * RANK + c];
#endif
    }
}
