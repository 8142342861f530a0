// fcoo_build: the F-COO layout of one MTTKRP mode, built on the device from
// the COO (the preparation of FcooGpu; the host builds the same layout in
// kruskal_formats::Fcoo, and the two are equal bit for bit).
//
// Steps, each a launch (src/fcoo_build.rs drives them):
//   fcoo_keys{32,64}      key = row << shift | second-mode index, perm = k
//   radix_count{32,64}    per tile: how many keys have each 4-bit digit
//   scan_exclusive        the digit-major counts become output offsets
//   radix_scatter{32,64}  keys and perm to their place, stably
//   (count, scan, scatter once per 4 bits of key: an LSD radix sort; stable,
//   so equal keys keep the order of the COO, as the host sort does)
//   fcoo_gather           product-mode indices and values in sorted order
//   fcoo_ends{32,64}      the segment-end bits (ballot per 32 nonzeros)
//   fcoo_popc, scan       set bits before each word: segment numbers
//   fcoo_segment_rows     each segment's output row
//   fcoo_start_flags      the chunk-start bits of one threadlen
//
// Keys are u32 when the row and second-mode bits fit in 32, else u64.
// Requires -DRANK (any; these kernels do not use it).

#define RANK_ONLY
#include "common.cuh"

#define SORT_THREADS 256
#define SORT_ITEMS 8
#define SORT_TILE (SORT_THREADS * SORT_ITEMS)
#define DIGIT_BITS 4
#define DIGITS (1 << DIGIT_BITS)
#define PAIRS (DIGITS / 2)
#define FULL 0xffffffffu

// The output row of a key: its bits from `shift` up (none left: row 0).
template <typename K>
__device__ __forceinline__ u32 row_of(K key, u32 shift)
{
    return shift >= 8 * sizeof(K) ? 0u : (u32)(key >> shift);
}

template <typename K>
__device__ __forceinline__ void make_keys(
    const u32* __restrict__ row, const u32* __restrict__ second, u64 n, u32 shift,
    K* __restrict__ keys, u32* __restrict__ perm)
{
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        const K high = shift >= 8 * sizeof(K) ? (K)0 : ((K)row[k] << shift);
        keys[k] = high | (K)second[k];
        perm[k] = (u32)k;
    }
}

// Keys of n nonzeros: row[k] above `shift` bits, second[k] below (a tensor
// without a second mode passes second = row and shift 0). perm[k] = k.
// Launch: any grid-stride shape.
extern "C" __global__ void fcoo_keys32(
    const u32* __restrict__ row, const u32* __restrict__ second, u64 n, u32 shift,
    u32* __restrict__ keys, u32* __restrict__ perm)
{
    make_keys<u32>(row, second, n, shift, keys, perm);
}

extern "C" __global__ void fcoo_keys64(
    const u32* __restrict__ row, const u32* __restrict__ second, u64 n, u32 shift,
    u64* __restrict__ keys, u32* __restrict__ perm)
{
    make_keys<u64>(row, second, n, shift, keys, perm);
}

// counts[d * tiles + t]: keys of tile t (SORT_TILE keys) whose digit at
// `shift` is d. Each thread counts its items into 4-bit fields of one u64
// (at most SORT_ITEMS = 8 per digit), the warp sums each field, and lane 0
// adds the warp's sums to the block's.
template <typename K>
__device__ __forceinline__ void count_digits(
    const K* __restrict__ keys, u64 n, u32 shift, u32* __restrict__ counts, u32 tiles)
{
    __shared__ u32 hist[DIGITS];
    if (threadIdx.x < DIGITS) hist[threadIdx.x] = 0;
    __syncthreads();
    const u64 base = (u64)blockIdx.x * SORT_TILE;
    u64 fields = 0;
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
        const u64 k = base + (u64)i * SORT_THREADS + threadIdx.x;
        if (k < n) fields += 1ull << (4 * ((u32)(keys[k] >> shift) & (DIGITS - 1)));
    }
#pragma unroll
    for (int d = 0; d < DIGITS; ++d) {
        const u32 sum = __reduce_add_sync(FULL, (u32)(fields >> (4 * d)) & 0xfu);
        if (threadIdx.x % WARP == 0 && sum) atomicAdd(&hist[d], sum);
    }
    __syncthreads();
    if (threadIdx.x < DIGITS) counts[(u64)threadIdx.x * tiles + blockIdx.x] = hist[threadIdx.x];
}

// Launch: grid = tiles = ceil(n / SORT_TILE), blockDim = SORT_THREADS.
extern "C" __global__ void __launch_bounds__(SORT_THREADS) radix_count32(
    const u32* __restrict__ keys, u64 n, u32 shift, u32* __restrict__ counts, u32 tiles)
{
    count_digits<u32>(keys, n, shift, counts, tiles);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS) radix_count64(
    const u64* __restrict__ keys, u64 n, u32 shift, u32* __restrict__ counts, u32 tiles)
{
    count_digits<u64>(keys, n, shift, counts, tiles);
}

// Moves the keys of tile t (and their perm entries) to their sorted place:
// offsets[d * tiles + t] (the exclusive scan of radix_count's counts) plus
// the key's rank among the tile's keys of digit d. Thread i holds the tile's
// keys i * SORT_ITEMS .. + SORT_ITEMS - 1, so ranks follow the order of the
// input and the sort is stable. Ranks are counted in 16-bit halves of
// PAIRS u32 (two digits each; a tile has at most 2048 keys of a digit):
// a warp scan, then the sums of the warps before. The tile is then staged
// in shared memory in digit order, so consecutive threads write
// consecutive places of one digit's run.
template <typename K>
__device__ __forceinline__ void scatter_digits(
    const K* __restrict__ keys_in, const u32* __restrict__ perm_in,
    K* __restrict__ keys_out, u32* __restrict__ perm_out,
    u64 n, u32 shift, const u32* __restrict__ offsets, u32 tiles)
{
    __shared__ u32 warp_sums[SORT_THREADS / WARP][PAIRS];
    __shared__ u32 tile_offset[DIGITS];
    __shared__ u32 digit_start[DIGITS]; // first place of digit d in the tile
    __shared__ K staged_keys[SORT_TILE];
    __shared__ u32 staged_perm[SORT_TILE];
    const u32 lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const u64 tile_first = (u64)blockIdx.x * SORT_TILE;
    const u64 first = tile_first + (u64)threadIdx.x * SORT_ITEMS;
    const u32 in_tile = (u32)min((u64)SORT_TILE, n - tile_first);

    K key[SORT_ITEMS];
    u32 val[SORT_ITEMS];
    u32 digit[SORT_ITEMS];
    u32 mine[PAIRS];
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) mine[j] = 0;
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
        const u64 k = first + i;
        digit[i] = DIGITS; // past the end: no digit
        if (k < n) {
            key[i] = keys_in[k];
            val[i] = perm_in[k];
            digit[i] = (u32)(key[i] >> shift) & (DIGITS - 1);
        }
#pragma unroll
        for (int j = 0; j < PAIRS; ++j)
            if (digit[i] >> 1 == (u32)j) mine[j] += 1u << (16 * (digit[i] & 1));
    }

    // Inclusive warp scan of the packed counts.
    u32 incl[PAIRS];
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) {
        u32 x = mine[j];
#pragma unroll
        for (int off = 1; off < WARP; off *= 2) {
            const u32 y = __shfl_up_sync(FULL, x, off);
            if (lane >= (u32)off) x += y;
        }
        incl[j] = x;
    }
    if (lane == WARP - 1) {
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) warp_sums[warp][j] = incl[j];
    }
    if (threadIdx.x < DIGITS)
        tile_offset[threadIdx.x] = offsets[(u64)threadIdx.x * tiles + blockIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        // The tile's keys of each digit, then where each digit starts.
        u32 at = 0;
        for (u32 d = 0; d < DIGITS; ++d) {
            u32 count = 0;
            for (u32 w = 0; w < SORT_THREADS / WARP; ++w)
                count += (warp_sums[w][d >> 1] >> (16 * (d & 1))) & 0xffffu;
            digit_start[d] = at;
            at += count;
        }
    }
    __syncthreads();

    // Keys of each digit before this thread's: the earlier warps' and the
    // earlier lanes'.
    u32 rank[PAIRS];
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) {
        u32 before = incl[j] - mine[j];
        for (u32 w = 0; w < warp; ++w) before += warp_sums[w][j];
        rank[j] = before;
    }
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
        const u32 d = digit[i];
        if (d >= DIGITS) continue;
        const u32 half = 16 * (d & 1);
        u32 r = 0;
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            if (d >> 1 == (u32)j) {
                r = (rank[j] >> half) & 0xffffu;
                rank[j] += 1u << half;
            }
        }
        const u32 place = digit_start[d] + r;
        staged_keys[place] = key[i];
        staged_perm[place] = val[i];
    }
    __syncthreads();

    // Place p of the staged tile holds a key of digit d with rank
    // p - digit_start[d]: consecutive threads, consecutive places.
    for (u32 p = threadIdx.x; p < in_tile; p += SORT_THREADS) {
        const K k = staged_keys[p];
        const u32 d = (u32)(k >> shift) & (DIGITS - 1);
        const u64 at = (u64)tile_offset[d] + (p - digit_start[d]);
        keys_out[at] = k;
        perm_out[at] = staged_perm[p];
    }
}

// Launch: grid = tiles, blockDim = SORT_THREADS.
extern "C" __global__ void __launch_bounds__(SORT_THREADS) radix_scatter32(
    const u32* __restrict__ keys_in, const u32* __restrict__ perm_in,
    u32* __restrict__ keys_out, u32* __restrict__ perm_out,
    u64 n, u32 shift, const u32* __restrict__ offsets, u32 tiles)
{
    scatter_digits<u32>(keys_in, perm_in, keys_out, perm_out, n, shift, offsets, tiles);
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS) radix_scatter64(
    const u64* __restrict__ keys_in, const u32* __restrict__ perm_in,
    u64* __restrict__ keys_out, u32* __restrict__ perm_out,
    u64 n, u32 shift, const u32* __restrict__ offsets, u32 tiles)
{
    scatter_digits<u64>(keys_in, perm_in, keys_out, perm_out, n, shift, offsets, tiles);
}

// In place: data[k] becomes the sum of data[0 .. k) (which must fit in u32),
// and *total the sum of all. One block, in rounds of SCAN_ITEMS x 1024
// entries: thread i scans entries i * SCAN_ITEMS .. of the round, the block
// scans the threads' sums, and a carry goes from round to round.
// Launch: grid = 1, blockDim = 1024.
#define SCAN_ITEMS 16
extern "C" __global__ void __launch_bounds__(1024) scan_exclusive(
    u32* __restrict__ data, u64 n, u32* __restrict__ total)
{
    __shared__ u32 sums[WARP];
    __shared__ u32 carry_in;
    const u32 lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const u32 warps = blockDim.x / WARP;
    const u64 round = (u64)blockDim.x * SCAN_ITEMS;
    if (threadIdx.x == 0) carry_in = 0;
    __syncthreads();
    for (u64 base = 0; base < n; base += round) {
        const u64 lo = base + (u64)threadIdx.x * SCAN_ITEMS;
        u32 v[SCAN_ITEMS];
        u32 own = 0;
#pragma unroll
        for (int i = 0; i < SCAN_ITEMS; ++i) {
            v[i] = lo + i < n ? data[lo + i] : 0u;
            own += v[i];
        }
        u32 x = own;
#pragma unroll
        for (int off = 1; off < WARP; off *= 2) {
            const u32 y = __shfl_up_sync(FULL, x, off);
            if (lane >= (u32)off) x += y;
        }
        if (lane == WARP - 1) sums[warp] = x;
        __syncthreads();
        if (warp == 0) {
            u32 s = lane < warps ? sums[lane] : 0;
#pragma unroll
            for (int off = 1; off < WARP; off *= 2) {
                const u32 y = __shfl_up_sync(FULL, s, off);
                if (lane >= (u32)off) s += y;
            }
            sums[lane] = s;
        }
        __syncthreads();
        const u32 carry = carry_in;
        u32 run = carry + x - own + (warp > 0 ? sums[warp - 1] : 0);
#pragma unroll
        for (int i = 0; i < SCAN_ITEMS; ++i) {
            if (lo + i < n) data[lo + i] = run;
            run += v[i];
        }
        __syncthreads(); // every thread has read carry_in and sums
        if (threadIdx.x == 0) carry_in = carry + sums[warps - 1];
        __syncthreads();
    }
    if (threadIdx.x == 0) *total = carry_in;
}

// out[k] = src[perm[k]] for k < n (32-bit words: indices, or the bits of
// f32 values). Launch: any grid-stride shape.
extern "C" __global__ void fcoo_gather(
    const u32* __restrict__ src, const u32* __restrict__ perm, u64 n, u32* __restrict__ out)
{
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride)
        out[k] = src[perm[k]];
}

// Bit k % 32 of bit_flags[k / 32]: nonzero k (sorted) is the last of its
// row's run. Launch: exactly ceil(n / 32) * 32 threads, blockDim a multiple
// of 32.
template <typename K>
__device__ __forceinline__ void segment_ends(
    const K* __restrict__ keys, u64 n, u32 shift, u32* __restrict__ bit_flags)
{
    const u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    bool end = false;
    if (k + 1 == n) end = true;
    else if (k + 1 < n) end = row_of(keys[k], shift) != row_of(keys[k + 1], shift);
    const u32 word = __ballot_sync(FULL, end);
    if (threadIdx.x % WARP == 0 && k < n) bit_flags[k / WARP] = word;
}

extern "C" __global__ void fcoo_ends32(
    const u32* __restrict__ keys, u64 n, u32 shift, u32* __restrict__ bit_flags)
{
    segment_ends<u32>(keys, n, shift, bit_flags);
}

extern "C" __global__ void fcoo_ends64(
    const u64* __restrict__ keys, u64 n, u32 shift, u32* __restrict__ bit_flags)
{
    segment_ends<u64>(keys, n, shift, bit_flags);
}

// out[w] = set bits of words[w], w < count. Launch: any grid-stride shape.
extern "C" __global__ void fcoo_popc(const u32* __restrict__ words, u64 count, u32* __restrict__ out)
{
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 w = (u64)blockIdx.x * blockDim.x + threadIdx.x; w < count; w += stride)
        out[w] = __popc(words[w]);
}

// seg_rows[s] = the row of segment s, from the first nonzero of each: its
// segment is word_prefix[k / 32] (set bits in the words before) plus the set
// bits below k in its own word. Launch: any grid-stride shape.
template <typename K>
__device__ __forceinline__ void segment_rows(
    const K* __restrict__ keys, u64 n, u32 shift, const u32* __restrict__ bit_flags,
    const u32* __restrict__ word_prefix, u32* __restrict__ seg_rows)
{
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        const bool starts = k == 0 || (bit_flags[(k - 1) / WARP] >> ((k - 1) % WARP) & 1u);
        if (!starts) continue;
        const u32 below = bit_flags[k / WARP] & ((1u << (k % WARP)) - 1u);
        seg_rows[word_prefix[k / WARP] + __popc(below)] = row_of(keys[k], shift);
    }
}

extern "C" __global__ void fcoo_segment_rows32(
    const u32* __restrict__ keys, u64 n, u32 shift, const u32* __restrict__ bit_flags,
    const u32* __restrict__ word_prefix, u32* __restrict__ seg_rows)
{
    segment_rows<u32>(keys, n, shift, bit_flags, word_prefix, seg_rows);
}

extern "C" __global__ void fcoo_segment_rows64(
    const u64* __restrict__ keys, u64 n, u32 shift, const u32* __restrict__ bit_flags,
    const u32* __restrict__ word_prefix, u32* __restrict__ seg_rows)
{
    segment_rows<u64>(keys, n, shift, bit_flags, word_prefix, seg_rows);
}

// Bit c % 32 of start_flags[c / 32]: chunk c (nonzeros c * threadlen ..)
// begins a segment, c == 0 or nonzero c * threadlen - 1 ends one.
// Launch: exactly ceil(chunks / 32) * 32 threads, blockDim a multiple of 32.
extern "C" __global__ void fcoo_start_flags(
    const u32* __restrict__ bit_flags, u64 chunks, u32 threadlen, u32* __restrict__ start_flags)
{
    const u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    bool start = false;
    if (c == 0) start = true;
    else if (c < chunks) {
        const u64 k = c * threadlen - 1;
        start = bit_flags[k / WARP] >> (k % WARP) & 1u;
    }
    const u32 word = __ballot_sync(FULL, start);
    if (threadIdx.x % WARP == 0 && c < chunks) start_flags[c / WARP] = word;
}
