// fcoo_build: the F-COO layout of one MTTKRP mode, built on the device from
// the COO (the preparation of FcooGpu; the host builds the same layout in
// kruskal_formats::Fcoo, and the two are equal bit for bit), and, with the
// same sort, a GPU group's shards (at the end of this file).
//
// Steps, each a launch (src/fcoo_build.rs drives them):
//   fcoo_keys{32,64}      key = row << shift | second-mode index, perm = k
//   radix_count{32,64}    per tile: how many keys have each 8-bit digit
//   scan_*                the digit-major counts become output offsets
//   radix_scatter{32,64}  keys and perm to their place, stably
//   (count, scan, scatter once per 8 bits of key: an LSD radix sort; stable,
//   so equal keys keep the order of the COO, as the host sort does)
//   fcoo_gather           product-mode indices and values in sorted order
//   fcoo_ends{32,64}      the segment-end bits (ballot per 32 nonzeros)
//   fcoo_popc, scan_*     set bits before each word: segment numbers
//
// scan_reduce, scan_partials and scan_apply are an exclusive scan of many
// blocks: each block sums its span, one block scans the sums, each block
// rescans its span from its sum's place.
//   fcoo_segment_rows     each segment's output row
//   fcoo_start_flags      the chunk-start bits of one threadlen
//
// Keys are u32 when the row and second-mode bits fit in 32, else u64.
// Requires -DRANK (any; these kernels do not use it).

#define RANK_ONLY
#include "common.cuh"

#define SORT_THREADS 256
#define SORT_WARPS (SORT_THREADS / WARP)
#define SORT_ITEMS 8
#define SORT_TILE (SORT_THREADS * SORT_ITEMS)
#define WARP_KEYS (WARP * SORT_ITEMS) // a warp's consecutive keys in a tile
#define DIGIT_BITS 8
#define DIGITS (1 << DIGIT_BITS)
#define FULL 0xffffffffu
#define SCAN_THREADS 1024

#if DIGITS != SORT_THREADS
#error "the sort kernels give each thread one digit"
#endif

// Exclusive scan of one u32 per thread over the block (blockDim a multiple
// of 32, at most 1024); *total gets the sum. `sums` is shared scratch of
// 32 words; every thread must call it.
__device__ __forceinline__ u32 block_exclusive_scan(u32 x, u32* sums, u32* total)
{
    const u32 lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const u32 warps = blockDim.x / WARP;
    u32 incl = x;
#pragma unroll
    for (int off = 1; off < WARP; off *= 2) {
        const u32 y = __shfl_up_sync(FULL, incl, off);
        if (lane >= (u32)off) incl += y;
    }
    if (lane == WARP - 1) sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        u32 s = lane < warps ? sums[lane] : 0u;
#pragma unroll
        for (int off = 1; off < WARP; off *= 2) {
            const u32 y = __shfl_up_sync(FULL, s, off);
            if (lane >= (u32)off) s += y;
        }
        sums[lane] = s;
    }
    __syncthreads();
    const u32 before = warp > 0 ? sums[warp - 1] : 0u;
    *total = sums[warps - 1];
    __syncthreads(); // sums may be reused at once
    return before + incl - x;
}

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
// `shift` is d. The lanes of a warp holding the same digit are matched and
// their leader adds their number, so a hot digit costs one atomic per warp
// step.
template <typename K>
__device__ __forceinline__ void count_digits(
    const K* __restrict__ keys, u64 n, u32 shift, u32* __restrict__ counts, u32 tiles)
{
    __shared__ u32 hist[DIGITS];
    hist[threadIdx.x] = 0;
    __syncthreads();
    const u32 lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const u64 base = (u64)blockIdx.x * SORT_TILE + (u64)warp * WARP_KEYS + lane;
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
        const u64 k = base + (u64)i * WARP;
        const u32 d = k < n ? (u32)(keys[k] >> shift) & (DIGITS - 1) : DIGITS;
        const u32 peers = __match_any_sync(FULL, d);
        if (d < DIGITS && lane == (u32)__ffs(peers) - 1) atomicAdd(&hist[d], __popc(peers));
    }
    __syncthreads();
    counts[(u64)threadIdx.x * tiles + blockIdx.x] = hist[threadIdx.x];
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
// the key's rank among the tile's keys of digit d. Warp w holds the tile's
// keys w * WARP_KEYS .. + WARP_KEYS - 1, step i of lane l the key
// i * WARP + l of those, so walking the steps in order and ranking lanes by
// number follows the input's order and the sort is stable: the lanes of one
// digit are matched, the leader reads and advances the warp's count of that
// digit, and each lane's rank is that count plus its peers below it. The
// tile is then staged in shared memory in digit order, so consecutive
// threads write consecutive places of one digit's run.
template <typename K>
__device__ __forceinline__ void scatter_digits(
    const K* __restrict__ keys_in, const u32* __restrict__ perm_in,
    K* __restrict__ keys_out, u32* __restrict__ perm_out,
    u64 n, u32 shift, const u32* __restrict__ offsets, u32 tiles)
{
    // warp_count[w][d]: keys of digit d in warp w's steps so far; then the
    // tile place where warp w's keys of digit d begin.
    __shared__ u32 warp_count[SORT_WARPS][DIGITS];
    __shared__ u32 tile_offset[DIGITS];
    __shared__ u32 digit_start[DIGITS]; // first place of digit d in the tile
    __shared__ u32 sums[WARP];
    __shared__ K staged_keys[SORT_TILE];
    __shared__ u32 staged_perm[SORT_TILE];
    const u32 lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const u64 tile_first = (u64)blockIdx.x * SORT_TILE;
    const u64 first = tile_first + (u64)warp * WARP_KEYS + lane;
    const u32 in_tile = (u32)min((u64)SORT_TILE, n - tile_first);
    const u32 below = (1u << lane) - 1u;

#pragma unroll
    for (int w = 0; w < SORT_WARPS; ++w) warp_count[w][threadIdx.x] = 0;
    tile_offset[threadIdx.x] = offsets[(u64)threadIdx.x * tiles + blockIdx.x];
    __syncthreads();

    K key[SORT_ITEMS];
    u32 val[SORT_ITEMS];
    u32 digit[SORT_ITEMS];
    u32 rank[SORT_ITEMS];
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
        const u64 k = first + (u64)i * WARP;
        digit[i] = DIGITS; // past the end: no digit
        if (k < n) {
            key[i] = keys_in[k];
            val[i] = perm_in[k];
            digit[i] = (u32)(key[i] >> shift) & (DIGITS - 1);
        }
        const u32 peers = __match_any_sync(FULL, digit[i]);
        const u32 leader = (u32)__ffs(peers) - 1;
        u32 seen = 0;
        if (lane == leader && digit[i] < DIGITS) {
            seen = warp_count[warp][digit[i]];
            warp_count[warp][digit[i]] = seen + __popc(peers);
        }
        rank[i] = __shfl_sync(FULL, seen, leader) + __popc(peers & below);
        __syncwarp();
    }
    __syncthreads();

    // Thread d: the tile's keys of digit d before each warp's, then where
    // digit d starts in the tile.
    {
        const u32 d = threadIdx.x;
        u32 run = 0;
#pragma unroll
        for (int w = 0; w < SORT_WARPS; ++w) {
            const u32 c = warp_count[w][d];
            warp_count[w][d] = run;
            run += c;
        }
        u32 tile_keys;
        const u32 start = block_exclusive_scan(run, sums, &tile_keys);
        digit_start[d] = start;
#pragma unroll
        for (int w = 0; w < SORT_WARPS; ++w) warp_count[w][d] += start;
    }
    __syncthreads();

#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
        if (digit[i] >= DIGITS) continue;
        const u32 place = warp_count[warp][digit[i]] + rank[i];
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

// The exclusive scan of data[0 .. n) in place (the sums must fit in u32),
// by blocks of SCAN_THREADS over spans of `span` entries: scan_reduce,
// then scan_partials, then scan_apply, with the same grid of
// ceil(n / span) blocks (at most SCAN_THREADS) for the first and last.

// partial[b] = the sum of data[b * span .. min(n, (b + 1) * span)).
extern "C" __global__ void __launch_bounds__(SCAN_THREADS) scan_reduce(
    const u32* __restrict__ data, u64 n, u64 span, u32* __restrict__ partial)
{
    __shared__ u32 sums[WARP];
    const u64 lo = (u64)blockIdx.x * span;
    const u64 hi = min(n, lo + span);
    u32 own = 0;
    for (u64 k = lo + threadIdx.x; k < hi; k += blockDim.x) own += data[k];
    u32 total;
    block_exclusive_scan(own, sums, &total);
    if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

// partial[0 .. blocks) becomes its exclusive scan, *total its sum.
// Launch: grid = 1, blockDim = SCAN_THREADS (blocks <= SCAN_THREADS).
extern "C" __global__ void __launch_bounds__(SCAN_THREADS) scan_partials(
    u32* __restrict__ partial, u32 blocks, u32* __restrict__ total)
{
    __shared__ u32 sums[WARP];
    const u32 x = threadIdx.x < blocks ? partial[threadIdx.x] : 0u;
    u32 all;
    const u32 before = block_exclusive_scan(x, sums, &all);
    if (threadIdx.x < blocks) partial[threadIdx.x] = before;
    if (threadIdx.x == 0) *total = all;
}

// data[k] for k in block b's span becomes partial[b] plus the sum of the
// span's entries before k.
extern "C" __global__ void __launch_bounds__(SCAN_THREADS) scan_apply(
    u32* __restrict__ data, u64 n, u64 span, const u32* __restrict__ partial)
{
    __shared__ u32 sums[WARP];
    const u64 lo = (u64)blockIdx.x * span;
    const u64 hi = min(n, lo + span);
    u32 carry = partial[blockIdx.x];
    for (u64 base = lo; base < hi; base += blockDim.x) {
        const u64 k = base + threadIdx.x;
        const u32 x = k < hi ? data[k] : 0u;
        u32 round;
        const u32 before = block_exclusive_scan(x, sums, &round);
        if (k < hi) data[k] = carry + before;
        carry += round;
    }
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

// ---------------------------------------------------------------------------
// The shards of a GPU group, built by each GPU from the COO (src/group/
// build.rs drives them): GPU g's shard of mode m holds the nonzeros whose
// relabeled mode-m row lies in [lo, hi), as elements (every mode's
// relabeled index, then the value's bits) sorted by that row, stably (equal
// rows keep the COO's order).
//   shard_tile_counts   per tile of SORT_TILE nonzeros: how many are g's
//   scan_*              the tiles' first places
//   shard_select        key = row - lo (of the mode sorted by) and perm = k of g's
//                       nonzeros, in order
//   radix_count32, scan_*, radix_scatter32   sort (key, perm) as above
//   shard_elements      the elements, in sorted order
//   shard_mark          the other modes' rows the shard reads, as bitmaps
//
// Tile t holds nonzeros t * SORT_TILE ..; step i of thread x takes nonzero
// t * SORT_TILE + i * SORT_THREADS + x, so the steps in order and the threads
// by number walk the tile in increasing k.

// Whether nonzero k's relabeled mode row lies in [lo, hi); its row in *row.
__device__ __forceinline__ bool shard_owns(
    const u32* __restrict__ idx, const u32* __restrict__ relabel, u64 k, u32 lo, u32 hi, u32* row)
{
    const u32 r = relabel[idx[k]];
    *row = r;
    return r >= lo && r < hi;
}

// counts[t]: nonzeros of tile t whose relabeled row lies in [lo, hi).
// Launch: grid = ceil(n / SORT_TILE), blockDim = SORT_THREADS.
extern "C" __global__ void __launch_bounds__(SORT_THREADS) shard_tile_counts(
    const u32* __restrict__ idx, const u32* __restrict__ relabel, u64 n, u32 lo, u32 hi,
    u32* __restrict__ counts)
{
    __shared__ u32 sums[WARP];
    const u64 base = (u64)blockIdx.x * SORT_TILE + threadIdx.x;
    u32 own = 0, row;
#pragma unroll
    for (int i = 0; i < SORT_ITEMS; ++i) {
        const u64 k = base + (u64)i * SORT_THREADS;
        if (k < n && shard_owns(idx, relabel, k, lo, hi, &row)) ++own;
    }
    u32 total;
    block_exclusive_scan(own, sums, &total);
    if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

// For the r-th of tile t's own nonzeros in increasing k: keys[offsets[t] +
// r] = key_relabel[key_idx[k]] - key_lo (the row of the mode sorted by, the
// owning mode itself or, in a split plan, another), perm[offsets[t] + r] =
// k. offsets: the exclusive scan of shard_tile_counts' counts (so every
// place is below their total). Launch: as shard_tile_counts.
extern "C" __global__ void __launch_bounds__(SORT_THREADS) shard_select(
    const u32* __restrict__ idx, const u32* __restrict__ relabel, u64 n, u32 lo, u32 hi,
    const u32* __restrict__ key_idx, const u32* __restrict__ key_relabel, u32 key_lo,
    const u32* __restrict__ offsets, u32* __restrict__ keys, u32* __restrict__ perm)
{
    __shared__ u32 sums[WARP];
    const u64 base = (u64)blockIdx.x * SORT_TILE + threadIdx.x;
    u32 at = offsets[blockIdx.x];
    for (int i = 0; i < SORT_ITEMS; ++i) {
        const u64 k = base + (u64)i * SORT_THREADS;
        u32 row = 0;
        const bool mine = k < n && shard_owns(idx, relabel, k, lo, hi, &row);
        u32 step;
        const u32 before = block_exclusive_scan(mine ? 1u : 0u, sums, &step);
        if (mine) {
            keys[at + before] = key_relabel[key_idx[k]] - key_lo;
            perm[at + before] = (u32)k;
        }
        at += step;
    }
}

// Element j < count of the shard, from nonzero perm[j]: its index in every
// mode w relabeled (relabel[w][idx[w][k]]), then the value's bits. idx and
// relabel are device arrays of nmodes device addresses (the COO's index
// arrays, the modes' relabelings). Launch: any grid-stride shape.
extern "C" __global__ void shard_elements(
    const u64* __restrict__ idx, const u64* __restrict__ relabel, const u32* __restrict__ vals,
    u32 nmodes, const u32* __restrict__ perm, u64 count, u32* __restrict__ out)
{
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < count; j += stride) {
        const u64 k = perm[j];
        u32* e = out + j * (nmodes + 1);
        for (u32 w = 0; w < nmodes; ++w) {
            const u32* iw = reinterpret_cast<const u32*>(idx[w]);
            const u32* rw = reinterpret_cast<const u32*>(relabel[w]);
            e[w] = rw[iw[k]];
        }
        e[nmodes] = vals[k];
    }
}

// For every element j < count of a shard of mode `mode`, and every other
// mode w with first[w] != ~0: bit row % 32 of bitmap[first[w] + row / 32],
// row = the element's mode-w index (the rows this shard reads). Launch:
// any grid-stride shape.
extern "C" __global__ void shard_mark(
    const u32* __restrict__ elems, u64 count, u32 nmodes, u32 mode,
    const u64* __restrict__ first, u32* __restrict__ bitmap)
{
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < count; j += stride) {
        const u32* e = elems + j * (nmodes + 1);
        for (u32 w = 0; w < nmodes; ++w) {
            const u64 at = first[w];
            if (w == mode || at == ~0ull) continue;
            const u32 row = e[w];
            u32* word = bitmap + at + row / 32;
            const u32 bit = 1u << (row % 32);
            // Hot rows are read by many elements: look before writing.
            if ((*word & bit) == 0) atomicOr(word, bit);
        }
    }
}
