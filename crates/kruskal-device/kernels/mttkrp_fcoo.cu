// fcoo: MTTKRP on F-COO with a segmented reduction (F-COO, Liu et al.,
// Cluster 2017, section IV-D; the CPU twin is kruskal-cpu's fcoo.rs).
//
// The F-COO of output mode `mode` lists the nonzeros sorted by output row;
// each row is a *segment*, whose last nonzero has its bit flag set. Only
// the NMODES - 1 product-mode indices and the value are stored per
// nonzero; seg_rows[s] is the output row of segment s.
//
// Launch: gridDim = (thread blocks, column tiles), blockDim = (32, WARPS).
// Thread block b takes nonzeros [b * WARPS * 32 * threadlen, +WARPS * 32 *
// threadlen): threadlen nonzeros per thread as in the paper, but a warp's
// 32 * threadlen nonzeros are walked 32 at a time by the whole warp, so
// that every load is coalesced:
//   - lane j loads nonzero g + j of the group (its product indices and
//     value); the warp reads the group's one bit-flag word, finds segment
//     ends with __ffs, and walks the nonzeros in order, sharing each one's
//     indices and value by shuffles;
//   - lane l computes rank columns tile * TILE + l + 32 c (c < TILE_CPL) of
//     val * prod_{w != mode} Y_w(i_w, :): f32 products, gathered one
//     coalesced factor row segment per product mode, added into f64
//     accumulators (one per column) of the current segment.
// A segment that ends inside the warp and began there (or at a chunk whose
// start flag is set) is stored as f32 straight into its row: no atomics.
// The warp's first segment, when the warp's start flag says it began in an
// earlier warp, and its last, when it runs on past the warp, go to the
// warp's two f64 slots in shared memory. After a barrier the warps add the
// slots of each segment in warp order (pieces of one segment are adjacent:
// deterministic; one warp per segment) and store the segment, unless it
// crosses an edge of the thread
// block: then its sum goes to edge_sums[slot] with one f64 atomicAdd per
// column (slots numbered on the host, one per crossing segment), and
// fcoo_store_edges writes those rows afterwards (and zeroes the sums it
// read, so the next call finds them zero). Every segment's row is written
// whole, so the output is zeroed first only where some row of the mode
// holds no nonzero (those rows are 0).
// Reads per nonzero: NMODES - 1 indices and the value (4 B each), 1/8 B of
// bit flags, and NMODES - 1 factor row segments of TILE floats. Writes: one
// output row (TILE floats) per segment.
//
// Fiber reuse (-DFIBER=1). Within a segment the F-COO orders nonzeros by
// the index of one product mode, the *fiber mode* (product number
// `fiber`), so nonzeros sharing it are adjacent: a fiber. Their products
// share the fiber mode's factor row, so the kernel sums
//   part = sum over the fiber of val * prod_{w != mode, fiber} Y_w(i_w, :)
// (f32 products, f64 sum) and multiplies the fiber mode's row in once, when
// the fiber ends: acc += part * Y_fiber(j, :). A fiber ends where the next
// nonzero has another fiber index, where a segment ends, and at the end of
// the warp's range (whose partial sums leave through the slots). The warp
// finds fiber ends for 32 nonzeros at once by comparing each lane's fiber
// index with its right neighbour's (one ballot); the row of a fiber end is
// loaded beside the other gathers of its UNROLL group, and not at all for
// the other nonzeros (the condition is the same on every lane). Gathers per
// nonzero drop from NMODES - 1 to NMODES - 2 + fibers / nnz.
//
// Lane teams (-DTEAMS=1, for RANK 16, 32, 64 or 128): at rank 32 the plain
// mapping spends a whole warp instruction on one nonzero's one column per
// lane, and `ncu` shows the kernel bound by instruction issue, not by L1 or
// L2. With teams, TL = RANK / 4 lanes hold one nonzero's row as float4s
// (lane l: columns 4 (l % TL) .. + 3), so NT = 32 / TL teams take NT
// consecutive nonzeros in one *round*: one shuffle per index and value, one
// 16-byte gather per product mode, for NT nonzeros. Each lane sums its
// team's products of the open segment in four f64 accumulators. Where a
// segment ends inside a round, the teams holding its nonzeros add them,
// the segment's sum is reduced across the teams (shuffles), and team 0
// stores it (or hands it to the warp's slot as above); then every
// accumulator restarts. The slots and the block epilogue are as above.
//
// The lane-team pipeline (TeamPipeline on the host; measured in
// docs/performance.md). A warp step is latency-bound: its gathers depend on
// the shuffled indices, and each product was added before the next gather
// was issued. -DROUNDS=R issues the gathers of R rounds before adding the
// first; -DPREFETCH=1 loads the next group's indices and values before this
// group's gathers; -DGROUP_SUMS=1 sums a lane's products of one group of 32
// nonzeros (at most 32 / NT) in f32 and adds that sum to the f64
// accumulators once per group and at each segment end (f32-to-f64
// conversions run at a quarter of the f32 rate, and were one per product);
// -DMINB=B asks the compiler for registers that let B blocks share an SM
// (B = 2: 64 registers, half the SM's warps resident instead of a quarter).
//
// Half-precision gathers (-DHALF=1 bf16, -DHALF=2 f16): the factor rows
// are read from a 16-bit copy (made by fcoo_to_half before each MTTKRP),
// halving the bytes gathered; each value becomes f32 before the products,
// which, like the sums, keep their precision.
//
// Requires -DNMODES, -DRANK, -DWARPS; -DFIBER=1 needs NMODES >= 2.

#include "common.cuh"

#ifndef WARPS
#error "WARPS must be defined (-DWARPS=...)"
#endif
#if 2 * WARPS > 32
#error "the block epilogue gives each warp slot a lane: WARPS must be at most 16"
#endif

#define NPROD (NMODES - 1)
// Arrays of product modes need at least one element (one-mode tensors).
#define NPROD_ARR (NPROD > 0 ? NPROD : 1)
// Columns one lane handles in one column tile (at most 4: more would only
// add registers), and the tile's width; gridDim.y = ceil(RANK / TILE).
#define TILE_CPL (COLS_PER_LANE < 4 ? COLS_PER_LANE : 4)
#define TILE (TILE_CPL * WARP)
#define NONE 0xffffffffu
#define FULL 0xffffffffu
// Nonzeros whose factor rows are gathered before any is added.
#define UNROLL 4
#ifndef FIBER
#define FIBER 0
#endif
#if FIBER && NPROD < 1
#error "FIBER needs a product mode (NMODES >= 2)"
#endif
#ifndef HALF
#define HALF 0
#endif

// A factor value as gathered: f32, or the 16 bits of a bf16 or f16 (PTX
// conversions, so NVRTC needs no CUDA headers).
#if HALF
typedef unsigned short factor_t;
__device__ __forceinline__ float load_factor(const factor_t* p)
{
    const unsigned short h = __ldg(p);
#if HALF == 1
    return __uint_as_float((u32)h << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}
#else
typedef float factor_t;
__device__ __forceinline__ float load_factor(const factor_t* p) { return __ldg(p); }
#endif

#ifndef TEAMS
#define TEAMS 0
#endif
// Thread blocks per SM the compiler must leave registers for
// (__launch_bounds__'s second argument; 1 leaves it free).
#ifndef MINB
#define MINB 1
#endif
#if TEAMS
// Lane teams: rounds whose gathers are issued before the first of them is
// added (at most a group's 32 / NT rounds), and whether the next group's
// indices are loaded before this group's gathers.
#ifndef ROUNDS
#define ROUNDS 1
#endif
#define RPB (ROUNDS < WARP / NT ? ROUNDS : WARP / NT)
#ifndef PREFETCH
#define PREFETCH 0
#endif
// f32 sums of each group's products before they join the f64 accumulators.
#ifndef GROUP_SUMS
#define GROUP_SUMS 0
#endif
#if FIBER
#error "TEAMS and FIBER do not combine"
#endif

// Four consecutive factor values (16-byte aligned as f32, 8 as 16-bit).
__device__ __forceinline__ float4 load_factor4(const factor_t* p)
{
#if HALF
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
#if HALF == 1
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
#else
    float a, b, c, d;
    asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"((unsigned short)(u.x & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(b) : "h"((unsigned short)(u.x >> 16)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(c) : "h"((unsigned short)(u.y & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(d) : "h"((unsigned short)(u.y >> 16)));
    return make_float4(a, b, c, d);
#endif
#else
    return __ldg(reinterpret_cast<const float4*>(p));
#endif
}

// acc, summed over the teams of the warp (every lane gets its columns' sum).
__device__ __forceinline__ void team_sum(const double (&acc)[4], double (&sum)[4])
{
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        sum[c] = acc[c];
#pragma unroll
        for (int d = TL; d < WARP; d *= 2) sum[c] += __shfl_xor_sync(FULL, sum[c], d);
    }
}

// Adds one product to the open segment's sum: straight into the f64
// accumulators, or (GROUP_SUMS) into the f32 sum of the current group,
// which flush_part adds to them once per group and at each segment end:
// one f32-to-f64 conversion per column per group instead of per product
// (conversions run at a quarter of the f32 rate).
__device__ __forceinline__ void add_product(double (&acc)[4], float4& part, const float4& prod)
{
#if GROUP_SUMS
    part.x += prod.x;
    part.y += prod.y;
    part.z += prod.z;
    part.w += prod.w;
#else
    acc[0] += (double)prod.x;
    acc[1] += (double)prod.y;
    acc[2] += (double)prod.z;
    acc[3] += (double)prod.w;
#endif
}

__device__ __forceinline__ void flush_part(double (&acc)[4], float4& part)
{
    acc[0] += (double)part.x;
    acc[1] += (double)part.y;
    acc[2] += (double)part.z;
    acc[3] += (double)part.w;
    part = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// The group of 32 nonzeros at g (below w_hi): lane l's product indices and
// value, zeros past w_hi, and the group's bit-flag word.
__device__ __forceinline__ void load_group(const u32* __restrict__ prod_idx, const float* __restrict__ vals,
                                           const u32* __restrict__ bit_flags, u64 nnz, u64 g, u64 w_hi, int lane,
                                           u32 (&idx)[NPROD_ARR], float& val, u32& bits)
{
    const u32 n = (u32)min((u64)WARP, w_hi - g);
#pragma unroll
    for (int p = 0; p < NPROD_ARR; ++p) idx[p] = 0;
    val = 0.0f;
    if ((u32)lane < n) {
#pragma unroll
        for (int p = 0; p < NPROD; ++p) idx[p] = prod_idx[(u64)p * nnz + g + lane];
        val = vals[g + lane];
    }
    bits = bit_flags[g / 32];
}
#endif

extern "C" __global__ void __launch_bounds__(32 * WARPS, MINB) mttkrp_fcoo(
    const u32* __restrict__ prod_idx,    // NPROD x nnz, product modes in increasing order
    const float* __restrict__ vals,      // nnz
    const u32* __restrict__ bit_flags,   // ceil(nnz / 32): bit set = last nonzero of its segment
    const u32* __restrict__ start_flags, // ceil(chunks / 32): bit set = chunk starts a segment
    const u32* __restrict__ seg_rows,    // segments: output row of each
    const u32* __restrict__ block_seg,   // thread blocks + 1: segment of each block's first nonzero
    const u32* __restrict__ edge_slot,   // 2 x thread blocks: slot of the head / tail segment, or NONE
    const factor_t* __restrict__ factors,
    const u64* __restrict__ row_offset,
    float* __restrict__ out,             // dims[mode] x RANK, zeroed by the caller
    double* __restrict__ edge_sums,      // slots x RANK, zeroed by the caller
    u64 nnz,
    u32 threadlen,
    int mode,
    int fiber)                           // FIBER: the fiber mode's product number
{
    __shared__ double slot_sum[2 * WARPS][TILE];
    __shared__ u32 slot_seg[2 * WARPS];
    __shared__ u32 warp_ends[WARPS];

    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const u64 warp_nnz = (u64)threadlen * WARP;
    const u64 w_lo = (blockIdx.x * (u64)WARPS + warp) * warp_nnz;
    const u64 w_hi = w_lo < nnz ? min(w_lo + warp_nnz, nnz) : w_lo;
    const u32 col0 = blockIdx.y * TILE + lane;

    // Segments ending in each warp's range, to number this warp's first
    // segment. Bits past nnz are 0, so whole words can be counted.
    u32 ends = 0;
    for (u64 q = w_lo / 32 + lane; q < (w_hi + 31) / 32; q += WARP) ends += __popc(bit_flags[q]);
#pragma unroll
    for (int d = WARP / 2; d > 0; d /= 2) ends += __shfl_xor_sync(FULL, ends, d);
    if (lane == 0) {
        warp_ends[warp] = ends;
        slot_seg[2 * warp] = NONE;
        slot_seg[2 * warp + 1] = NONE;
    }
    __syncthreads();

    if (w_lo < w_hi) {
        u32 seg = block_seg[blockIdx.x];
        for (int v = 0; v < warp; ++v) seg += warp_ends[v];
        // The warp's first chunk is chunk w_lo / threadlen, bit 0 of its
        // start-flag word: 0 means the first segment began in an earlier warp.
        const bool head_shared = !(start_flags[w_lo / warp_nnz] & 1u);

#if TEAMS
        const u32 team = lane / TL;
        const u32 tcol = 4 * (lane % TL);
        const factor_t* base[NPROD_ARR];
#pragma unroll
        for (int p = 0; p < NPROD; ++p) {
            const int w = p < mode ? p : p + 1;
            base[p] = factors + row_offset[w] * RANK + tcol;
        }
        double acc[4] = {0.0, 0.0, 0.0, 0.0};
        float4 part = make_float4(0.0f, 0.0f, 0.0f, 0.0f); // GROUP_SUMS: this group's f32 sum
        bool first = true; // the next segment to close is the warp's first
        bool open = false; // acc holds part of an unfinished segment

        // The group of 32 nonzeros at g: lane l's product indices and value
        // (zeros past the range) and the group's bit-flag word. With
        // PREFETCH the next group's are loaded before this group's gathers,
        // so their latency hides behind them.
        u32 idx[NPROD_ARR];
        float val;
        u32 bits;
        load_group(prod_idx, vals, bit_flags, nnz, w_lo, w_hi, lane, idx, val, bits);
        for (u64 g = w_lo; g < w_hi; g += WARP) {
            const u32 n = (u32)min((u64)WARP, w_hi - g);
            u32 cur_idx[NPROD_ARR];
#pragma unroll
            for (int p = 0; p < NPROD_ARR; ++p) cur_idx[p] = idx[p];
            const float cur_val = val;
            const u32 cur_bits = bits;
#if PREFETCH
            if (g + WARP < w_hi) load_group(prod_idx, vals, bit_flags, nnz, g + WARP, w_hi, lane, idx, val, bits);
#endif

            // ROUNDS rounds at a time: their gathers are issued before any
            // product is added (independent loads in flight per lane).
            for (u32 j0 = 0; j0 < n; j0 += NT * RPB) {
                float4 prods[RPB];
#pragma unroll
                for (int r = 0; r < RPB; ++r) {
                    // Team t takes nonzero j + t of the group (a repeat of
                    // the last one past n, never added).
                    const u32 src = min(j0 + r * NT + team, n - 1);
                    const float v = __shfl_sync(FULL, cur_val, src);
                    float4 prod = make_float4(v, v, v, v);
#pragma unroll
                    for (int p = 0; p < NPROD; ++p) {
                        const float4 y = load_factor4(base[p] + (u64)__shfl_sync(FULL, cur_idx[p], src) * RANK);
                        prod.x *= y.x;
                        prod.y *= y.y;
                        prod.z *= y.z;
                        prod.w *= y.w;
                    }
                    prods[r] = prod;
                }
#pragma unroll
                for (int r = 0; r < RPB; ++r) {
                    const u32 j = j0 + r * NT;
                    if (j >= n) break;
                    const float4 prod = prods[r];
                    const bool live = j + team < n;
                    // Segment ends among this round's nonzeros (NT < 32;
                    // bits past nnz, the only place a group is short, are 0).
                    u32 e = (cur_bits >> j) & ((1u << NT) - 1);
                    u32 from = 0; // first team of the open segment in this round
                    while (e) {
                        const u32 end = __ffs(e) - 1;
                        e &= e - 1;
                        if (team >= from && team <= end) add_product(acc, part, prod);
#if GROUP_SUMS
                        flush_part(acc, part);
#endif
                        double sum[4];
                        team_sum(acc, sum);
                        if (first && head_shared) {
                            if (team == 0) {
#pragma unroll
                                for (int c = 0; c < 4; ++c) slot_sum[2 * warp][tcol + c] = sum[c];
                            }
                            if (lane == 0) slot_seg[2 * warp] = seg;
                        } else if (team == 0) {
                            float4* o = reinterpret_cast<float4*>(out + (u64)seg_rows[seg] * RANK + tcol);
                            *o = make_float4((float)sum[0], (float)sum[1], (float)sum[2], (float)sum[3]);
                        }
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[c] = 0.0;
                        ++seg;
                        first = false;
                        from = end + 1;
                    }
                    if (live && team >= from) add_product(acc, part, prod);
                }
            }
            open = !((cur_bits >> (n - 1)) & 1u);
#if GROUP_SUMS
            // At most 32 / NT products in f32 before they join the f64 sum.
            flush_part(acc, part);
#endif
#if !PREFETCH
            if (g + WARP < w_hi) load_group(prod_idx, vals, bit_flags, nnz, g + WARP, w_hi, lane, idx, val, bits);
#endif
        }
        // The last segment runs on past the warp.
        if (open) {
            double sum[4];
            team_sum(acc, sum);
            const int s = (first && head_shared) ? 2 * warp : 2 * warp + 1;
            if (team == 0) {
#pragma unroll
                for (int c = 0; c < 4; ++c) slot_sum[s][tcol + c] = sum[c];
            }
            if (lane == 0) slot_seg[s] = seg;
        }
#else
        // Factor rows of product mode p start at base[p]; lane l reads
        // columns col[c] (clamped below RANK: lanes past RANK load a valid
        // column and never store it, so no load is predicated).
        const factor_t* base[NPROD_ARR];
#pragma unroll
        for (int p = 0; p < NPROD; ++p) {
            const int w = p < mode ? p : p + 1;
            base[p] = factors + row_offset[w] * RANK;
        }
        u32 col[TILE_CPL];
#pragma unroll
        for (int c = 0; c < TILE_CPL; ++c) col[c] = min(col0 + c * WARP, (u32)RANK - 1);

        double acc[TILE_CPL];
#pragma unroll
        for (int c = 0; c < TILE_CPL; ++c) acc[c] = 0.0;
#if FIBER
        // The open fiber's sum, not yet multiplied by its row.
        double part[TILE_CPL];
#pragma unroll
        for (int c = 0; c < TILE_CPL; ++c) part[c] = 0.0;
#endif
        bool first = true; // the current segment is the warp's first
        bool open = false; // acc holds part of an unfinished segment

        for (u64 g = w_lo; g < w_hi; g += WARP) {
            const u32 n = (u32)min((u64)WARP, w_hi - g);
            u32 idx[NPROD_ARR];
            float val = 0.0f;
#pragma unroll
            for (int p = 0; p < NPROD_ARR; ++p) idx[p] = 0;
            if ((u32)lane < n) {
#pragma unroll
                for (int p = 0; p < NPROD; ++p) idx[p] = prod_idx[(u64)p * nnz + g + lane];
                val = vals[g + lane];
            }
            const u32 bits = bit_flags[g / 32];
#if FIBER
            // This lane's fiber index (a select, not a dynamic register
            // index), and the fiber ends of the 32 nonzeros.
            u32 fidx = 0;
#pragma unroll
            for (int p = 0; p < NPROD; ++p)
                if (p == fiber) fidx = idx[p];
            u32 next = __shfl_down_sync(FULL, fidx, 1);
            if ((u32)lane == n - 1) next = g + n < w_hi ? prod_idx[(u64)fiber * nnz + g + n] : ~fidx;
            const u32 fends = __ballot_sync(FULL, (u32)lane < n && next != fidx) | bits;
#endif

            for (u32 j = 0; j < n; j += UNROLL) {
                // UNROLL nonzeros' products first (their gathers are
                // independent), then added in order, closing segments at
                // set flags. Past n a nonzero is repeated and not added.
                float prod[UNROLL][TILE_CPL];
#if FIBER
                float frow[UNROLL][TILE_CPL];
#endif
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const u32 src = min(j + u, n - 1);
                    const float v = __shfl_sync(FULL, val, src);
#pragma unroll
                    for (int c = 0; c < TILE_CPL; ++c) prod[u][c] = v;
#pragma unroll
                    for (int p = 0; p < NPROD; ++p) {
                        const u32 i = __shfl_sync(FULL, idx[p], src);
#if FIBER
                        if (p == fiber) {
                            // Only a fiber's last nonzero loads the row.
                            const bool end = j + u < n && ((fends >> (j + u)) & 1u);
                            const factor_t* y = base[p] + (u64)i * RANK;
#pragma unroll
                            for (int c = 0; c < TILE_CPL; ++c) frow[u][c] = 0.0f;
                            if (end) {
#pragma unroll
                                for (int c = 0; c < TILE_CPL; ++c) frow[u][c] = load_factor(y + col[c]);
                            }
                            continue;
                        }
#endif
                        const factor_t* y = base[p] + (u64)i * RANK;
#pragma unroll
                        for (int c = 0; c < TILE_CPL; ++c) prod[u][c] *= load_factor(y + col[c]);
                    }
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    if (j + u >= n) break;
#if FIBER
#pragma unroll
                    for (int c = 0; c < TILE_CPL; ++c) part[c] += (double)prod[u][c];
                    if ((fends >> (j + u)) & 1u) {
#pragma unroll
                        for (int c = 0; c < TILE_CPL; ++c) {
                            acc[c] += part[c] * (double)frow[u][c];
                            part[c] = 0.0;
                        }
                    }
#else
#pragma unroll
                    for (int c = 0; c < TILE_CPL; ++c) acc[c] += (double)prod[u][c];
#endif
                    open = !((bits >> (j + u)) & 1u);
                    if (open) continue;
                    // Nonzero j + u ends segment `seg`.
                    if (first && head_shared) {
#pragma unroll
                        for (int c = 0; c < TILE_CPL; ++c) slot_sum[2 * warp][lane + c * WARP] = acc[c];
                        if (lane == 0) slot_seg[2 * warp] = seg;
                    } else {
                        float* o = out + (u64)seg_rows[seg] * RANK;
#pragma unroll
                        for (int c = 0; c < TILE_CPL; ++c)
                            if (col0 + c * WARP < RANK) o[col0 + c * WARP] = (float)acc[c];
                    }
#pragma unroll
                    for (int c = 0; c < TILE_CPL; ++c) acc[c] = 0.0;
                    ++seg;
                    first = false;
                }
            }
        }
        // The last segment runs on past the warp.
        if (open) {
            const int s = (first && head_shared) ? 2 * warp : 2 * warp + 1;
#pragma unroll
            for (int c = 0; c < TILE_CPL; ++c) slot_sum[s][lane + c * WARP] = acc[c];
            if (lane == 0) slot_seg[s] = seg;
        }
#endif
    }
    __syncthreads();

    // The slots' segments, one slot per lane. A run is the slots of one
    // segment (a segment split between warps fills neighbouring slots;
    // empty slots between them are skipped). Every warp finds the runs'
    // first slots the same way and takes runs warp, warp + WARPS, ...; a
    // run is added in slot order, so the sums are those of one warp
    // walking every slot, and no warp idles while one walks 2 * WARPS.
    const u32 seg_l = lane < 2 * WARPS ? slot_seg[lane] : NONE;
    const u32 valid = __ballot_sync(FULL, seg_l != NONE);
    const u32 before = valid & ((1u << lane) - 1u);
    const int prev = before ? 31 - __clz(before) : 0;
    const u32 prev_seg = __shfl_sync(FULL, seg_l, prev);
    const u32 heads = __ballot_sync(FULL, seg_l != NONE && (before == 0 || prev_seg != seg_l));
    const u32 head_slot = edge_slot[2 * blockIdx.x];
    const u32 tail_slot = edge_slot[2 * blockIdx.x + 1];
    const u32 head_seg = block_seg[blockIdx.x];
    const u32 tail_seg = block_seg[blockIdx.x + 1];
    int run = 0;
    for (u32 h = heads; h != 0; h &= h - 1, ++run) {
        if (run % WARPS != (int)warp) continue;
        const int s0 = __ffs(h) - 1;
        const u32 rest = h & (h - 1);
        const int s1 = rest ? __ffs(rest) - 1 : 2 * WARPS;
        const u32 cur = slot_seg[s0];
        double sum[TILE_CPL];
#pragma unroll
        for (int c = 0; c < TILE_CPL; ++c) sum[c] = 0.0;
        for (int s = s0; s < s1; ++s) {
            if (slot_seg[s] != cur) continue;
#pragma unroll
            for (int c = 0; c < TILE_CPL; ++c) sum[c] += slot_sum[s][lane + c * WARP];
        }
        // Crossing a block edge: the head or tail slot; else the block
        // holds the whole segment.
        const u32 slot = (head_slot != NONE && cur == head_seg) ? head_slot
            : (tail_slot != NONE && cur == tail_seg)            ? tail_slot
                                                                : NONE;
        if (slot != NONE) {
            double* d = edge_sums + (u64)slot * RANK + col0;
#pragma unroll
            for (int c = 0; c < TILE_CPL; ++c)
                if (col0 + c * WARP < RANK) atomicAdd(d + c * WARP, sum[c]);
        } else {
            float* o = out + (u64)seg_rows[cur] * RANK + col0;
#pragma unroll
            for (int c = 0; c < TILE_CPL; ++c)
                if (col0 + c * WARP < RANK) o[c * WARP] = (float)sum[c];
        }
    }
}

// Stores the f64 sums of the segments crossing thread-block edges as f32
// rows (grid-stride, one element per thread): slot s is output row rows[s].
extern "C" __global__ void fcoo_store_edges(
    double* __restrict__ sums, const u32* __restrict__ rows, float* __restrict__ out, u64 n)
{
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x) {
        out[(u64)rows[e / RANK] * RANK + e % RANK] = (float)sums[e];
        sums[e] = 0.0;
    }
}

#if HALF
// The 16-bit copy of n factor values, rounded to nearest even (grid-stride,
// one value per thread). bf16 keeps NaN a NaN; f16 turns values beyond
// 65504 into infinities (the MTTKRP then holds them: `--verify` shows it).
extern "C" __global__ void fcoo_to_half(const float* __restrict__ src, factor_t* __restrict__ dst, u64 n)
{
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x) {
        const float f = src[e];
#if HALF == 1
        const u32 x = __float_as_uint(f);
        dst[e] = (x & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((x >> 16) | 0x40u)
                                                 : (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
#else
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        dst[e] = h;
#endif
    }
}
#endif
