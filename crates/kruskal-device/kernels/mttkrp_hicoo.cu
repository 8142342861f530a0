// hicoo: MTTKRP on HiCOO (Li, Sun and Vuduc, SC'18; the CPU twin is
// kruskal-cpu's hicoo.rs).
//
// HiCOO cuts the index space into blocks 2^bits wide in every mode; a
// nonzero stores one u8 offset per mode, its block the block coordinates.
// For output mode `mode` the host groups the blocks by their mode-`mode`
// block coordinate (a *group*: every block whose nonzeros land in the same
// 2^bits output rows) and cuts groups of many nonzeros into *pieces* of
// about equal size (cut points inside blocks allowed).
//
// Launch: gridDim = (pieces, column tiles), blockDim = (32, WARPS), dynamic
// shared memory 2^bits x TILE doubles: the piece's output rows, column
// tile blockIdx.y (TILE = min(RANK, 32) columns).
//   - The piece's nonzeros are dealt to the warps 32 at a time (chunk c of
//     the piece to warp c % WARPS, chunks never straddle blocks), so a
//     piece of one big block is shared as evenly as one of many small ones.
//   - Per chunk, lane j loads nonzero j's offsets (u8, packed four to a
//     word) and value; the warp walks the chunk's nonzeros in order,
//     sharing them by shuffles. Lane l computes column tile * TILE + l of
//     val * prod_{w != mode} Y_w((coord_w << bits) + off_w, :) (f32
//     products; one coalesced factor row segment per input mode) and adds
//     it to an f64 register sum of the current output row. When the
//     output offset changes, the sum is added to the shared row with one
//     shared atomicAdd per column (inside a block nonzeros are sorted by
//     offsets, mode 0 first, so runs are long for mode 0).
//   - After a barrier the piece's rows leave shared memory: a piece that is
//     its whole group owns the rows and stores them as f32 (zeros
//     included, no atomics); a piece of a split group adds its non-zero
//     sums to split_sums[slot] (2^bits x RANK doubles per split group) with
//     f64 atomics, and hicoo_store_split writes those rows afterwards.
// The output is zeroed first, so rows of no group are 0.
// Reads per nonzero: NMODES offsets (1 B each), the value, NMODES - 1 factor
// row segments of TILE floats. Writes: one shared atomic per column per run
// of equal output rows; per piece, its 2^bits x TILE output tile.
//
// Requires -DNMODES, -DRANK, -DWARPS.

#include "common.cuh"

#ifndef WARPS
#error "WARPS must be defined (-DWARPS=...)"
#endif

#define TILE (RANK < WARP ? RANK : WARP)
#define PACKED ((NMODES + 3) / 4)
#define NONE 0xffffffffu
#define FULL 0xffffffffu
// Nonzeros whose factor rows are gathered before any is added.
#define UNROLL 4

// Byte w of the packed offsets (w known at compile time when unrolled).
__device__ __forceinline__ u32 offset_of(const u32 (&packed)[PACKED], int w)
{
    return (packed[w / 4] >> (8 * (w % 4))) & 0xffu;
}

extern "C" __global__ void __launch_bounds__(32 * WARPS) mttkrp_hicoo(
    const u64* __restrict__ block_ptr,          // blocks + 1
    const u32* __restrict__ block_coords,       // NMODES x blocks
    const unsigned char* __restrict__ offsets,  // NMODES x nnz
    const float* __restrict__ vals,             // nnz
    const u32* __restrict__ order,              // blocks, grouped by mode-`mode` coordinate
    const u64* __restrict__ pieces,             // 4 per piece: pos_lo, pos_hi, nz_lo, nz_hi
    const u32* __restrict__ piece_slot,         // per piece: split-group slot or NONE
    const float* __restrict__ factors,
    const u64* __restrict__ row_offset,
    float* __restrict__ out,                    // dims[mode] x RANK, zeroed by the caller
    double* __restrict__ split_sums,            // slots x 2^bits x RANK, zeroed by the caller
    u64 nnz,
    u64 nblocks,
    u32 bits,
    u32 dim,
    int mode)
{
    extern __shared__ double acc[]; // 2^bits x TILE

    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int tid = warp * WARP + lane;
    const u32 rows = 1u << bits;
    const u32 col = blockIdx.y * TILE + lane;
    const bool active = lane < TILE && col < RANK;
    // Lanes without a column load a valid one (never stored), so no load
    // is predicated.
    const u32 col_ld = min(col, (u32)RANK - 1);
    const u64* piece = pieces + 4 * (u64)blockIdx.x;
    const u64 pos_lo = piece[0], pos_hi = piece[1], nz_lo = piece[2], nz_hi = piece[3];

    for (u32 e = tid; e < rows * TILE; e += WARP * WARPS) acc[e] = 0.0;
    __syncthreads();

    u64 row0[NMODES];
#pragma unroll
    for (int w = 0; w < NMODES; ++w) row0[w] = row_offset[w];

    u32 run_row = NONE;
    double run = 0.0;
    u64 chunk_base = 0; // chunks of the piece before block position p
    for (u64 p = pos_lo; p < pos_hi; ++p) {
        const u32 blk = order[p];
        const u64 lo = p == pos_lo ? nz_lo : block_ptr[blk];
        const u64 hi = p + 1 == pos_hi ? nz_hi : block_ptr[blk + 1];
        const u64 chunks = (hi - lo + WARP - 1) / WARP;
        u64 c = (warp + WARPS - chunk_base % WARPS) % WARPS;
        chunk_base += chunks;
        if (c >= chunks) continue;

        // This lane's column of each factor's first row of the block.
        const float* base[NMODES];
#pragma unroll
        for (int w = 0; w < NMODES; ++w)
            base[w] = factors + (row0[w] + ((u64)block_coords[(u64)w * nblocks + blk] << bits)) * RANK + col_ld;

        for (; c < chunks; c += WARPS) {
            const u64 k0 = lo + c * WARP;
            const u32 n = (u32)min((u64)WARP, hi - k0);
            u32 packed[PACKED];
#pragma unroll
            for (int q = 0; q < PACKED; ++q) packed[q] = 0;
            float val = 0.0f;
            if ((u32)lane < n) {
#pragma unroll
                for (int w = 0; w < NMODES; ++w)
                    packed[w / 4] |= (u32)offsets[(u64)w * nnz + k0 + lane] << (8 * (w % 4));
                val = vals[k0 + lane];
            }
            for (u32 j = 0; j < n; j += UNROLL) {
                // UNROLL nonzeros' products first (their gathers are
                // independent), then added in order. Past n a nonzero is
                // repeated and not added.
                float prod[UNROLL];
                u32 o[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const u32 src = min(j + u, n - 1);
                    u32 pk[PACKED];
#pragma unroll
                    for (int q = 0; q < PACKED; ++q) pk[q] = __shfl_sync(FULL, packed[q], src);
                    prod[u] = __shfl_sync(FULL, val, src);
                    o[u] = 0;
#pragma unroll
                    for (int w = 0; w < NMODES; ++w) {
                        const u32 off = offset_of(pk, w);
                        if (w == mode) o[u] = off;
                        else prod[u] *= __ldg(base[w] + (u64)off * RANK);
                    }
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    if (j + u >= n) break;
                    if (o[u] != run_row) {
                        if (run_row != NONE && active) atomicAdd(&acc[run_row * TILE + lane], run);
                        run_row = o[u];
                        run = 0.0;
                    }
                    run += (double)prod[u];
                }
            }
        }
    }
    if (run_row != NONE && active) atomicAdd(&acc[run_row * TILE + lane], run);
    __syncthreads();

    const u32 slot = piece_slot[blockIdx.x];
    const u64 first_row = (u64)block_coords[(u64)mode * nblocks + order[pos_lo]] << bits;
    for (u32 e = tid; e < rows * TILE; e += WARP * WARPS) {
        const u32 r = e / TILE;
        const u32 cc = blockIdx.y * TILE + e % TILE;
        if (cc >= RANK || first_row + r >= dim) continue;
        const double a = acc[e];
        if (slot == NONE)
            out[(first_row + r) * RANK + cc] = (float)a;
        else if (a != 0.0)
            atomicAdd(split_sums + (((u64)slot << bits) + r) * RANK + cc, a);
    }
}

// Stores the f64 sums of split groups as f32 rows (grid-stride, one element
// per thread): slot s holds output rows rows[s] .. rows[s] + 2^bits (those
// below dim).
extern "C" __global__ void hicoo_store_split(
    const double* __restrict__ sums, const u32* __restrict__ rows, float* __restrict__ out,
    u32 bits, u32 dim, u64 n)
{
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x) {
        const u64 row = (u64)rows[e / ((u64)RANK << bits)] + (e / RANK) % (1u << bits);
        if (row < dim) out[row * RANK + e % RANK] = (float)sums[e];
    }
}
