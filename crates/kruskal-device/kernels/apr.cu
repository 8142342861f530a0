// CP-APR (Poisson CP by multiplicative updates) on the GPU: the steps of
// kruskal-cpd's CPU `cp_apr`, in f64, over each mode's copy of the
// nonzeros sorted by that mode's index (rows as in CSR).
//
// Compiled with -DRANK only (no NMODES: the other modes are a loop over
// `nother`). Layouts, all row-major with RANK columns:
//   factors  every mode's factor, concatenated; mode m starts at element
//            offsets[m] (the per-copy `offsets` list the other modes'
//            starts, ascending mode order);
//   other    a sorted copy's other-mode indices, mode-major: the index in
//            its k-th other mode of sorted nonzero j is other[k * nnz + j];
//   values   the sorted copy's counts (f64); row i's nonzeros are
//            row_ptr[i] .. row_ptr[i + 1];
//   pi       nnz x RANK: row j is the product of the other modes' factor
//            rows at nonzero j's indices, in ascending mode order.
//
// Determinism: every sum runs in a fixed order for a given size (a piece's
// nonzeros in stored order, a row's pieces in order, lanes combined by a
// fixed butterfly, blocks' partials added in block order by
// apr_sum_partials); the KKT violation is a maximum, which no order
// changes. So a run is bit-identical run to run.

#define RANK_ONLY
#include "common.cuh"

#define THREADS 256
#define WARPS (THREADS / WARP)

// Sum over the warp, the same butterfly for every lane (all lanes end with
// the same bits).
__device__ __forceinline__ double warp_sum(double v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_max(double v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The product of the other modes' factor entries in column c at sorted
// nonzero j, times `start`, multiplied in ascending mode order.
__device__ __forceinline__ double other_product(
    double start, const u32* __restrict__ other, u64 nnz, u32 nother,
    const double* __restrict__ factors, const u64* __restrict__ offsets, u64 j, int c)
{
    double p = start;
    for (u32 k = 0; k < nother; ++k)
        p *= factors[offsets[k] + (u64)other[k * nnz + j] * RANK + c];
    return p;
}

// ---------------------------------------------------------------------------
// apr_pi: Pi of one mode's sorted copy.
//
// Thread mapping: grid-stride over the nnz x RANK entries, one per thread
// (consecutive threads take consecutive columns of a nonzero, so the factor
// rows are read coalesced). Per nonzero: reads its nother indices and
// nother factor rows, writes one row of Pi.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS) apr_pi(
    double* __restrict__ pi,
    const u32* __restrict__ other,
    u64 nnz,
    u32 nother,
    const double* __restrict__ factors,
    const u64* __restrict__ offsets)
{
    const u64 n = nnz * RANK;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x) {
        const u64 j = e / RANK;
        const int c = (int)(e % RANK);
        pi[e] = other_product(1.0, other, nnz, nother, factors, offsets, j, c);
    }
}

// ---------------------------------------------------------------------------
// apr_phi: the pieces' sums of Phi of one mode, for the current factor A
// (rows x RANK).
//
// A row's nonzeros are cut into pieces of at most the host's `PIECE_NNZ`
// consecutive nonzeros, so a row holding a large share of the
// nonzeros is spread over many warps: piece k covers sorted nonzeros
// piece_begin[k] .. piece_begin[k + 1] of row piece_row[k], and its sum,
// over those nonzeros in stored order, of (x_j / max(<a_i, pi_j>, eps)) pi_j
// goes to row k of `sums` (npieces x RANK); apr_phi_rows adds a row's
// pieces in order.
//
// Thread mapping: a warp per piece (grid-stride over pieces); lane l holds
// columns l, l + 32, ... of a_i and of the piece's sum in registers. Per
// nonzero: reads its value and its row of Pi (coalesced), one warp sum for
// the model's value. The nonzeros go PHI_GROUP at a time: their rows of Pi
// are loaded before any is used and their warp sums interleave, so a warp
// has several loads in flight instead of one (the kernel is bound by the
// latency of those loads, not by bandwidth); each is then added to the
// sums in stored order, so the result is the one-at-a-time loop's, bit
// for bit.
//
// Nothing runs once `*stop` is set: the mode's inner loop has ended (see
// apr_update).
// ---------------------------------------------------------------------------
#define PHI_GROUP (COLS_PER_LANE <= 2 ? 4 : 2)

// Loads nonzero j's row of Pi (lane's columns) into p and returns the
// lane's part of <a_i, pi_j>.
__device__ __forceinline__ double phi_load(
    double (&p)[COLS_PER_LANE], const double (&ai)[COLS_PER_LANE], const double* __restrict__ pi,
    u64 j, int lane)
{
    double dot = 0.0;
#pragma unroll
    for (int q = 0; q < COLS_PER_LANE; ++q) {
        const int c = lane + q * WARP;
        p[q] = c < RANK ? pi[j * RANK + c] : 0.0;
        dot += ai[q] * p[q];
    }
    return dot;
}

extern "C" __global__ void __launch_bounds__(THREADS) apr_phi(
    double* __restrict__ sums,
    const double* __restrict__ a,
    const double* __restrict__ pi,
    const double* __restrict__ values,
    const u64* __restrict__ piece_begin,
    const u32* __restrict__ piece_row,
    u64 npieces,
    double eps,
    const u32* __restrict__ stop)
{
    if (*stop) return;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    for (u64 k = blockIdx.x * (u64)WARPS + warp; k < npieces; k += gridDim.x * (u64)WARPS) {
        const u64 i = piece_row[k];
        double ai[COLS_PER_LANE], sum[COLS_PER_LANE];
#pragma unroll
        for (int q = 0; q < COLS_PER_LANE; ++q) {
            const int c = lane + q * WARP;
            ai[q] = c < RANK ? a[i * RANK + c] : 0.0;
            sum[q] = 0.0;
        }
        const u64 end = piece_begin[k + 1];
        u64 j = piece_begin[k];
        for (; j + PHI_GROUP <= end; j += PHI_GROUP) {
            double p[PHI_GROUP][COLS_PER_LANE], dot[PHI_GROUP], x[PHI_GROUP];
#pragma unroll
            for (int g = 0; g < PHI_GROUP; ++g) {
                x[g] = values[j + g];
                dot[g] = phi_load(p[g], ai, pi, j + g, lane);
            }
            // The PHI_GROUP butterflies step by step together: the same
            // shuffles as warp_sum, in the same order per value.
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
                for (int g = 0; g < PHI_GROUP; ++g) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
            }
#pragma unroll
            for (int g = 0; g < PHI_GROUP; ++g) {
                const double w = x[g] / fmax(dot[g], eps);
#pragma unroll
                for (int q = 0; q < COLS_PER_LANE; ++q) sum[q] += w * p[g][q];
            }
        }
        for (; j < end; ++j) {
            double p[COLS_PER_LANE];
            const double dot = warp_sum(phi_load(p, ai, pi, j, lane));
            const double w = values[j] / fmax(dot, eps);
#pragma unroll
            for (int q = 0; q < COLS_PER_LANE; ++q) sum[q] += w * p[q];
        }
#pragma unroll
        for (int q = 0; q < COLS_PER_LANE; ++q) {
            const int c = lane + q * WARP;
            if (c < RANK) sums[k * RANK + c] = sum[q];
        }
    }
}

// ---------------------------------------------------------------------------
// apr_phi_rows: Phi of one mode from its pieces' sums, and the KKT
// violation max |min(A, 1 - Phi)|.
//
// Phi(i, c) is the sum of column c of row i's pieces (piece_ptr[i] ..
// piece_ptr[i + 1], consecutive rows of `sums`) in piece order; an empty
// row has no piece and is zero. A row of more than CHUNK pieces has been
// summed by apr_phi_chunks into runs of CHUNK pieces first, each run's
// sum over its first piece: such a row's Phi is the sum of its runs, in
// order. (A power-law tensor's hottest row can hold a tenth of the
// nonzeros: thousands of pieces, which one thread summing them one by one
// made the tail of the launch, 0.3-0.4 ms of a 1.1-1.4 ms inner
// iteration on a GPU of a group.)
//
// Thread mapping: grid-stride over the rows x RANK entries, one per
// thread. The sums it adds are loaded ROWS_GROUP at a time before any is
// added (in order: the same sum as one at a time), so a thread has
// several loads in flight. The violation: a maximum
// per thread, then per block in shared
// memory, then one atomicMax per block on the bits of a non-negative
// double (ordered as its bits), into `kkt_bits`, which the caller zeroes
// first. Nothing runs once `*stop` is set.
// ---------------------------------------------------------------------------
#define ROWS_GROUP 16
// Pieces per run of a long row (apr_phi_chunks).
#define CHUNK 32

// ---------------------------------------------------------------------------
// apr_phi_chunks: for each row of more than CHUNK pieces, the sum of each
// run of CHUNK consecutive pieces (the last run shorter), in piece order,
// written over the run's first piece in `sums` (apr_phi_rows then adds the
// runs). Launched only for a copy that has such a row.
//
// Thread mapping: grid-stride over the npieces x RANK entries, one per
// thread; the thread of a run's first piece sums the run's column (its
// loads ROWS_GROUP at a time), every other thread does nothing. Runs are
// disjoint, so no thread reads what another writes. Nothing runs once
// `*stop` is set.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS) apr_phi_chunks(
    double* __restrict__ sums,
    const u32* __restrict__ piece_row,
    const u64* __restrict__ piece_ptr,
    u64 npieces,
    const u32* __restrict__ stop)
{
    if (*stop) return;
    const u64 n = npieces * RANK;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x) {
        const u64 k = e / RANK;
        const int c = (int)(e % RANK);
        const u32 i = piece_row[k];
        const u64 first = piece_ptr[i], end = piece_ptr[i + 1];
        if (end - first <= CHUNK || (k - first) % CHUNK != 0) continue;
        const u64 last = min(k + CHUNK, end);
        double f = sums[k * RANK + c];
        u64 q = k + 1;
        for (; q + ROWS_GROUP <= last; q += ROWS_GROUP) {
            double v[ROWS_GROUP];
#pragma unroll
            for (int g = 0; g < ROWS_GROUP; ++g) v[g] = sums[(q + g) * RANK + c];
#pragma unroll
            for (int g = 0; g < ROWS_GROUP; ++g) f += v[g];
        }
        for (; q < last; ++q) f += sums[q * RANK + c];
        sums[k * RANK + c] = f;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) apr_phi_rows(
    double* __restrict__ phi,
    u64* __restrict__ kkt_bits,
    const double* __restrict__ a,
    const double* __restrict__ sums,
    const u64* __restrict__ piece_ptr,
    u64 rows,
    const u32* __restrict__ stop)
{
    __shared__ double s_max[THREADS];
    // The same value in every thread, so no thread skips the barrier alone.
    if (*stop) return;
    double worst = 0.0;
    const u64 n = rows * RANK;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x) {
        const u64 i = e / RANK;
        const int c = (int)(e % RANK);
        double f = 0.0;
        const u64 first = piece_ptr[i], end = piece_ptr[i + 1];
        const u64 step = end - first > CHUNK ? CHUNK : 1;
        u64 k = first;
        for (; k + (ROWS_GROUP - 1) * step < end; k += ROWS_GROUP * step) {
            double v[ROWS_GROUP];
#pragma unroll
            for (int g = 0; g < ROWS_GROUP; ++g) v[g] = sums[(k + g * step) * RANK + c];
#pragma unroll
            for (int g = 0; g < ROWS_GROUP; ++g) f += v[g];
        }
        for (; k < end; k += step) f += sums[k * RANK + c];
        phi[e] = f;
        worst = fmax(worst, fabs(fmin(a[e], 1.0 - f)));
    }
    s_max[threadIdx.x] = worst;
    __syncthreads();
    if (threadIdx.x == 0) {
        double m = s_max[0];
        for (int t = 1; t < THREADS; ++t) m = fmax(m, s_max[t]);
        atomicMax(kkt_bits, (u64)__double_as_longlong(m));
    }
}

// ---------------------------------------------------------------------------
// apr_update: the multiplicative update A *= Phi, entry by entry, unless
// the inner loop has ended.
//
// It is one inner iteration's decision, taken on the device so that the
// host need not wait for the KKT violation: nothing runs once `*stop` is
// set; the violation is the largest of kkt[p * stride], p < parts (the
// bits of non-negative doubles, each part's share of this iteration's
// violation); below `tol` the loop ends here: `*stop` is set and A is left
// as it is, as the host's loop breaks before its update. Every thread takes the
// same decision from the same values, so it does not matter which of
// them sees the flag set by another.
// Thread mapping: grid-stride, one entry per thread.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS) apr_update(
    double* __restrict__ a,
    const double* __restrict__ phi,
    u64 n,
    const u64* __restrict__ kkt,
    u32 parts,
    u32 stride,
    double tol,
    u32* stop)
{
    if (*stop) return;
    u64 worst = 0;
    for (u32 p = 0; p < parts; ++p) worst = max(worst, kkt[(u64)p * stride]);
    if (__longlong_as_double((long long)worst) < tol) {
        if (blockIdx.x == 0 && threadIdx.x == 0) *stop = 1u;
        return;
    }
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x)
        a[e] *= phi[e];
}

// ---------------------------------------------------------------------------
// apr_share_kkt: this part's share of an inner iteration's KKT violation,
// kkt[slot], stored into slot `slot` of every other part's KKT array
// (peers[t] is part t's array, on its GPU: peer stores over NVLink, peer
// access enabled). The other parts read it only after waiting for an
// event recorded after this launch. One thread.
// ---------------------------------------------------------------------------
extern "C" __global__ void apr_share_kkt(
    const u64* __restrict__ kkt,
    u64 slot,
    const u64* __restrict__ peers,
    u32 parts,
    u32 part)
{
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const u64 v = kkt[slot];
    for (u32 t = 0; t < parts; ++t)
        if (t != part) reinterpret_cast<u64*>(peers[t])[slot] = v;
    __threadfence_system();
}

// ---------------------------------------------------------------------------
// apr_kappa_fold: with `fix`, entries of A below kappa_tol whose Phi (of the
// previous outer iteration) is positive are raised by kappa, and `fixed` is
// set to 1; then lambda is folded in (column c times lambda[c]).
// Thread mapping: grid-stride, one entry per thread.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS) apr_kappa_fold(
    double* __restrict__ a,
    const double* __restrict__ phi,
    const double* __restrict__ lambda,
    u64 n,
    u32 fix,
    double kappa_tol,
    double kappa,
    u32* __restrict__ fixed)
{
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x) {
        double x = a[e];
        if (fix && phi[e] > 0.0 && x < kappa_tol) {
            x += kappa;
            *fixed = 1u;
        }
        a[e] = x * lambda[e % RANK];
    }
}

// ---------------------------------------------------------------------------
// apr_column_sums: per block, the 1-norm of each column of its rows.
//
// Thread mapping: THREADS / RANK row slots of RANK threads (one slot of the
// first RANK threads when RANK > THREADS / 2); thread (slot, c) sums column
// c of rows blockIdx.x * SLOTS + slot, + gridDim.x * SLOTS, ..., in row
// order; the block adds its slots in slot order and writes partial row
// blockIdx.x (RANK doubles). RANK is at most THREADS.
// ---------------------------------------------------------------------------
#define SLOTS (THREADS / RANK > 0 ? THREADS / RANK : 1)

extern "C" __global__ void __launch_bounds__(THREADS) apr_column_sums(
    const double* __restrict__ a,
    u64 rows,
    double* __restrict__ partials)
{
    __shared__ double s_sum[SLOTS * RANK];
    const int t = threadIdx.x, slot = t / RANK, c = t % RANK;
    const bool active = t < SLOTS * RANK;
    double sum = 0.0;
    if (active)
        for (u64 i = blockIdx.x * (u64)SLOTS + slot; i < rows; i += gridDim.x * (u64)SLOTS)
            sum += fabs(a[i * RANK + c]);
    if (active) s_sum[t] = sum;
    __syncthreads();
    if (t < RANK) {
        for (int s = 1; s < SLOTS; ++s) sum += s_sum[s * RANK + t];
        partials[(u64)blockIdx.x * RANK + t] = sum;
    }
}

// ---------------------------------------------------------------------------
// apr_sum_partials: out[c] = sum over b < parts, in block order, of
// partials[b * width + c]. Thread mapping: grid-stride, one column per
// thread.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS) apr_sum_partials(
    const double* __restrict__ partials,
    u32 parts,
    u32 width,
    double* __restrict__ out)
{
    for (u32 c = blockIdx.x * blockDim.x + threadIdx.x; c < width; c += gridDim.x * blockDim.x) {
        double s = 0.0;
        for (u32 b = 0; b < parts; ++b) s += partials[(u64)b * width + c];
        out[c] = s;
    }
}

// ---------------------------------------------------------------------------
// apr_scale: column c of A times inv[c] (the 1-norm normalization).
// Thread mapping: grid-stride, one entry per thread.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS) apr_scale(
    double* __restrict__ a,
    const double* __restrict__ inv,
    u64 n)
{
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += gridDim.x * (u64)blockDim.x)
        a[e] = inv[e % RANK] * a[e];
}

// ---------------------------------------------------------------------------
// apr_log_likelihood: per block, the sum of x log(m) over the nonzeros of
// its pieces of one sorted copy (that of mode 1, as apr_phi cuts it; m =
// sum_c lambda[c] times the product of every mode's factor entry in column
// c, this mode's first, then the others ascending); terms with x = 0 count
// as 0.
//
// Thread mapping: a warp per piece (grid-stride over pieces); lanes over
// the columns, one warp sum per nonzero; lane 0 adds its pieces' terms in
// order, the block adds its warps in warp order and writes partials
// [blockIdx.x]. Reads each nonzero's indices and N factor rows.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS) apr_log_likelihood(
    double* __restrict__ partials,
    const double* __restrict__ a,
    const double* __restrict__ lambda,
    const double* __restrict__ values,
    const u64* __restrict__ piece_begin,
    const u32* __restrict__ piece_row,
    u64 npieces,
    const u32* __restrict__ other,
    u64 nnz,
    u32 nother,
    const double* __restrict__ factors,
    const u64* __restrict__ offsets)
{
    __shared__ double s_sum[WARPS];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    double total = 0.0;
    for (u64 k = blockIdx.x * (u64)WARPS + warp; k < npieces; k += gridDim.x * (u64)WARPS) {
        const u64 i = piece_row[k];
        const u64 end = piece_begin[k + 1];
        for (u64 j = piece_begin[k]; j < end; ++j) {
            const double x = values[j];
            if (x == 0.0) continue;
            double m = 0.0;
#pragma unroll
            for (int q = 0; q < COLS_PER_LANE; ++q) {
                const int c = lane + q * WARP;
                if (c < RANK)
                    m += other_product(lambda[c] * a[i * RANK + c], other, nnz, nother, factors,
                                       offsets, j, c);
            }
            m = warp_sum(m);
            total += x * log(m);
        }
    }
    if (lane == 0) s_sum[warp] = total;
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = s_sum[0];
        for (int w = 1; w < WARPS; ++w) s += s_sum[w];
        partials[blockIdx.x] = s;
    }
}
