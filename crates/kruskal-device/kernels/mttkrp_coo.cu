// coo_atomic: the COO baseline (ParTI's COO MTTKRP).
//
// Thread mapping: one warp per nonzero at a time (grid-stride over the
// nonzeros); lane l computes rank columns l, l + 32, ... of
//   val * prod_{w != mode} Y_w(i_w, :)
// and adds each into M(i_mode, :) with one global double-precision
// atomicAdd per (nonzero, column): products are f32, sums f64 (hot rows of
// millions of terms lose three digits when summed in f32), and a second
// kernel stores the sums as f32.
// Reads per nonzero: NMODES indices (4 B each), the value, and one factor
// row (RANK floats) per input mode. Writes: RANK atomics.
//
// idx:        NMODES x nnz indices, mode-major (idx[w * nnz + k]).
// factors:    every factor matrix, rows concatenated, RANK columns;
//             mode w's row i is at row_offset[w] + i.
// out64:      dims[mode] x RANK doubles, zeroed by the caller.

#include "common.cuh"

extern "C" __global__ void mttkrp_coo_atomic(
    const u32* __restrict__ idx,
    const float* __restrict__ vals,
    const float* __restrict__ factors,
    const u64* __restrict__ row_offset,
    double* __restrict__ out64,
    u64 nnz,
    int mode)
{
    const int lane = threadIdx.x % WARP;
    const u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / WARP;
    const u64 warps = (gridDim.x * (u64)blockDim.x) / WARP;
    for (u64 k = warp; k < nnz; k += warps) {
        const float v = vals[k];
        float prod[COLS_PER_LANE];
#pragma unroll
        for (int c = 0; c < COLS_PER_LANE; ++c) prod[c] = v;
#pragma unroll
        for (int w = 0; w < NMODES; ++w) {
            if (w == mode) continue;
            const float* row = factors + (row_offset[w] + idx[(u64)w * nnz + k]) * RANK;
#pragma unroll
            for (int c = 0; c < COLS_PER_LANE; ++c) {
                const int r = lane + c * WARP;
                if (r < RANK) prod[c] *= __ldg(row + r);
            }
        }
        double* dst = out64 + (u64)idx[(u64)mode * nnz + k] * RANK;
#pragma unroll
        for (int c = 0; c < COLS_PER_LANE; ++c) {
            const int r = lane + c * WARP;
            if (r < RANK) atomicAdd(dst + r, (double)prod[c]);
        }
    }
}

// Stores f64 sums as the f32 output (grid-stride, one element per thread).
extern "C" __global__ void store_f32(const double* __restrict__ in, float* __restrict__ out, u64 n)
{
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += gridDim.x * (u64)blockDim.x)
        out[i] = (float)in[i];
}
