//! The F-COO layout built on the device: the preparation of
//! [`crate::FcooGpu`].
//!
//! The COO is uploaded once ([`DeviceCoo`]); each mode is then sorted and
//! flagged on the GPU ([`sort_mode`], kernels in `kernels/fcoo_build.cu`)
//! into exactly the arrays [`kruskal_formats::Fcoo::for_mttkrp`] builds on
//! the host: the nonzeros ordered by (output row, index of the product
//! mode of smallest dimension, position in the COO), a stable LSD radix
//! sort of `row << bits | second` with 8-bit digits; the product-mode
//! indices and values gathered in that order; the segment-end bits; each
//! segment's row. The chunk-start bits of a threadlen
//! ([`start_flags`]) and the thread blocks' plan ([`super::BlockPlan`],
//! from the bit flags brought back to the host, about `nnz / 8` bytes) are
//! made per engine variant, so the variants of `kruskal cpd --kernel auto`
//! share one sort and one copy of the big arrays.
//!
//! Memory: the COO (`4 (N + 1)` bytes per nonzero), the sort's two key and
//! permutation buffers (`2 (key + 4)` bytes per nonzero, key 4 or 8 bytes,
//! allocated once for every mode: [`SortScratch`]) and the modes' results
//! (`4 N` bytes per nonzero each).

use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use kruskal_formats::SparseTensor;

use crate::gpu::Registered;
use crate::kernels::{BUILD_RANK, Kernel};
use crate::{Gpu, Result, driver, grid_stride};

/// Threads and keys per tile of the radix sort (`SORT_THREADS`,
/// `SORT_TILE` of the kernels).
pub const SORT_THREADS: u32 = 256;
pub const SORT_TILE: usize = 2048;
/// Bits per radix digit, and the digits (`DIGIT_BITS`, `DIGITS`).
const DIGIT_BITS: u32 = 8;
const DIGITS: usize = 256;
/// Threads per block of the scans, and the most blocks a scan uses
/// (`SCAN_THREADS`).
const SCAN_THREADS: u32 = 1024;

/// A tensor's COO on the device, uploaded once for every mode's sort.
pub struct DeviceCoo {
    dims: Vec<u32>,
    nnz: usize,
    /// One index array per mode.
    idx: Vec<CudaSlice<u32>>,
    /// The values' bits.
    vals: CudaSlice<u32>,
}

impl DeviceCoo {
    /// Uploads `t`'s indices and values (checked against free memory).
    /// The arrays are page-locked for the copies and stay so as long as
    /// `t` lives ([`kruskal_formats::Attached`]): unlocking 187 MB costs
    /// about 4 ms and holds the driver, so it happens when the tensor goes,
    /// not during the build, and a later upload of `t` (another engine,
    /// another start) only copies.
    pub fn upload(gpu: &Gpu, t: &SparseTensor) -> Result<Self> {
        let values = t.values();
        // SAFETY: f32 and u32 have the same size and alignment and every
        // bit pattern is a u32; the view lives as long as `values`.
        let bits: &[u32] =
            unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u32>(), values.len()) };
        let mut parts: Vec<&[u32]> = (0..t.nmodes()).map(|w| t.mode_indices(w)).collect();
        parts.push(bits);
        let what = "the COO";
        let mut idx = t.attached().with(|slot| -> Result<Vec<CudaSlice<u32>>> {
            if let Some(locked) = slot.as_ref().and_then(|b| b.downcast_ref::<Registered>())
                && locked.covers(&parts)
            {
                return gpu.upload_registered_again(what, &parts, locked);
            }
            let (out, locked) = gpu.upload_locked(what, &parts)?;
            if !locked.is_empty() {
                // Dropped with the tensor, before its arrays: the
                // registration never outlives them.
                *slot = Some(Box::new(locked));
            }
            Ok(out)
        })?;
        let vals = idx.pop().expect("the values were pushed last");
        Ok(DeviceCoo {
            dims: t.dims().to_vec(),
            nnz: t.nnz(),
            idx,
            vals,
        })
    }

    /// Mode `w`'s indices.
    pub fn indices(&self, w: usize) -> &CudaSlice<u32> {
        &self.idx[w]
    }

    /// The values' bits.
    pub fn value_bits(&self) -> &CudaSlice<u32> {
        &self.vals
    }

    /// Device bytes of the COO of a tensor of `nmodes` modes and `nnz`
    /// nonzeros.
    pub fn bytes(nmodes: usize, nnz: usize) -> usize {
        4 * (nmodes + 1) * nnz
    }
}

/// One mode's sorted F-COO on the device (shared by the variants of
/// different threadlens), and its bit flags on the host for the plans.
pub struct SortedMode {
    pub nnz: usize,
    pub segments: usize,
    /// `(N - 1) x nnz`, the product modes in increasing order.
    pub prod_idx: Arc<CudaSlice<u32>>,
    pub vals: Arc<CudaSlice<f32>>,
    pub bit_flags: Arc<CudaSlice<u32>>,
    pub seg_rows: Arc<CudaSlice<u32>>,
    pub host_flags: Vec<u32>,
}

/// Bits to write the numbers below `dim` (0 for a dimension of 1).
pub fn bits_below(dim: u32) -> u32 {
    u32::BITS - dim.saturating_sub(1).leading_zeros()
}

/// The product mode ordering a segment's nonzeros: the one of smallest
/// dimension, the lower on ties (as the host's [`kruskal_formats::Fcoo`]).
fn second_mode(dims: &[u32], mode: usize) -> Option<usize> {
    (0..dims.len())
        .filter(|&w| w != mode)
        .min_by_key(|&w| dims[w])
}

/// The key width a mode's sort uses: 4 bytes when the row and second-mode
/// bits fit in 32, else 8.
fn key_bytes(dims: &[u32], mode: usize) -> usize {
    let bits = bits_below(dims[mode]) + second_mode(dims, mode).map_or(0, |w| bits_below(dims[w]));
    if bits <= 32 { 4 } else { 8 }
}

/// Bytes of the widest sort key of any mode of a tensor with `dims`.
fn widest_key(dims: &[u32]) -> usize {
    (0..dims.len())
        .map(|m| key_bytes(dims, m))
        .max()
        .unwrap_or(4)
}

/// Device bytes of the sort's buffers ([`SortScratch`]) for a tensor with
/// `dims` and `nnz` nonzeros.
pub fn scratch_bytes(dims: &[u32], nnz: usize) -> usize {
    2 * (widest_key(dims) + 4) * nnz
        + 4 * DIGITS * nnz.div_ceil(SORT_TILE)
        + 4 * (SCAN_THREADS as usize + 1)
}

/// The sort's buffers, allocated once for every mode of a build (a buffer
/// freed and allocated again costs the driver a new mapping): two key
/// buffers wide enough for the widest key of any mode, two permutations,
/// the digit counts and the scans' block sums. None is zeroed: each pass
/// writes what the next reads.
pub struct SortScratch {
    /// 4-byte words: `nnz` per key of 4 bytes, `2 nnz` when a mode needs
    /// 8-byte keys.
    keys: [CudaSlice<u32>; 2],
    perm: [CudaSlice<u32>; 2],
    counts: CudaSlice<u32>,
    partial: CudaSlice<u32>,
    total: CudaSlice<u32>,
}

impl SortScratch {
    /// The buffers for sorting any mode of `coo`.
    pub fn new(gpu: &Gpu, coo: &DeviceCoo) -> Result<Self> {
        let n = coo.nnz.max(1);
        gpu.ensure_free("the F-COO sort", scratch_bytes(&coo.dims, n))?;
        let words = widest_key(&coo.dims) / 4 * n;
        let alloc = |what: &str, len: usize| -> Result<CudaSlice<u32>> {
            // SAFETY: u32 has no invalid bit pattern, and every entry a
            // kernel reads was written by an earlier step of the build.
            unsafe { gpu.stream().alloc::<u32>(len) }
                .map_err(|e| gpu.allocation_error(what, 4 * len, e))
        };
        Ok(SortScratch {
            keys: [
                alloc("the F-COO sort keys", words)?,
                alloc("the F-COO sort keys", words)?,
            ],
            perm: [
                alloc("the F-COO sort permutation", n)?,
                alloc("the F-COO sort permutation", n)?,
            ],
            counts: alloc("the F-COO sort counts", DIGITS * n.div_ceil(SORT_TILE))?,
            partial: alloc("the F-COO scan sums", SCAN_THREADS as usize)?,
            total: alloc("the F-COO scan total", 1)?,
        })
    }
}

/// A key type of the sort and its kernels.
pub trait SortKey: DeviceRepr + ValidAsZeroBits + Unpin {
    const KEYS: Kernel;
    const COUNT: Kernel;
    const SCATTER: Kernel;
    const ENDS: Kernel;
    const ROWS: Kernel;
}

/// Implements [`SortKey`] for a key type with its kernels.
macro_rules! sort_key {
    ($key:ty: $keys:ident, $count:ident, $scatter:ident, $ends:ident, $rows:ident) => {
        impl SortKey for $key {
            const KEYS: Kernel = Kernel::$keys;
            const COUNT: Kernel = Kernel::$count;
            const SCATTER: Kernel = Kernel::$scatter;
            const ENDS: Kernel = Kernel::$ends;
            const ROWS: Kernel = Kernel::$rows;
        }
    };
}

sort_key!(u32: FcooKeys32, RadixCount32, RadixScatter32, FcooEnds32, FcooSegmentRows32);
sort_key!(u64: FcooKeys64, RadixCount64, RadixScatter64, FcooEnds64, FcooSegmentRows64);

/// Exactly `threads` threads (rounded up to whole blocks of 256), for the
/// kernels that take one ballot per 32 threads.
fn exact(threads: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (threads.div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Called after each step of a mode's build with its name (`sort`,
/// `gather`, `segments`), to time it.
pub type Lap<'a> = &'a mut dyn FnMut(&'static str) -> Result<()>;

/// The digit counts and scan sums of a radix sort.
pub struct SortCounts<'a> {
    /// `DIGITS x tiles` words.
    pub counts: &'a mut CudaSlice<u32>,
    /// `SCAN_THREADS` words.
    pub partial: &'a mut CudaSlice<u32>,
    pub total: &'a mut CudaSlice<u32>,
}

/// Words the digit counts of a sort of `n` keys take.
pub fn count_words(n: usize) -> usize {
    DIGITS * n.div_ceil(SORT_TILE)
}

/// Words of a scan's block sums.
pub const SCAN_WORDS: usize = SCAN_THREADS as usize;

/// Stable LSD radix sort of the first `n` keys of `keys[0]` (`key_bits`
/// bits) with their `perm[0]` entries, 8 bits a pass, through `keys[1]`
/// and `perm[1]`; on return `keys[0]` and `perm[0]` are the views that
/// hold the sorted result (the views are swapped after each pass).
/// `sc.counts` holds [`count_words`]`(n)` words.
pub fn radix_sort<K: SortKey>(
    gpu: &Gpu,
    keys: [&mut CudaViewMut<'_, K>; 2],
    perm: [&mut CudaViewMut<'_, u32>; 2],
    n: usize,
    key_bits: u32,
    sc: SortCounts<'_>,
) -> Result<()> {
    let [keys, keys_b] = keys;
    let [perm, perm_b] = perm;
    let SortCounts {
        counts,
        partial,
        total,
    } = sc;
    let stream = gpu.stream().clone();
    let n64 = n as u64;
    let passes = key_bits.div_ceil(DIGIT_BITS);
    if passes == 0 || n == 0 {
        return Ok(());
    }
    let tiles = n.div_ceil(SORT_TILE);
    let tiles32 = tiles as u32;
    let count = function(gpu, K::COUNT)?;
    let scatter = function(gpu, K::SCATTER)?;
    let tile_grid = LaunchConfig {
        grid_dim: (tiles32, 1, 1),
        block_dim: (SORT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    for pass in 0..passes {
        let digit_shift = pass * DIGIT_BITS;
        let (keys_in, perm_in) = (keys.as_view(), perm.as_view());
        let mut launch = stream.launch_builder(&count);
        launch
            .arg(&keys_in)
            .arg(&n64)
            .arg(&digit_shift)
            .arg(&mut *counts)
            .arg(&tiles32);
        // SAFETY: block t reads keys t * 2048 .. below n (keys holds n)
        // and writes counts[d * tiles + t], d < 256 (counts holds
        // 256 x tiles).
        unsafe { launch.launch(tile_grid) }.map_err(driver("launching radix_count"))?;
        scan(gpu, counts, DIGITS * tiles, partial, total)?;
        let mut launch = stream.launch_builder(&scatter);
        launch
            .arg(&keys_in)
            .arg(&perm_in)
            .arg(&mut *keys_b)
            .arg(&mut *perm_b)
            .arg(&n64)
            .arg(&digit_shift)
            .arg(&*counts)
            .arg(&tiles32);
        // SAFETY: block t reads keys and perm t * 2048 .. below n and
        // counts[d * tiles + t]; the scanned counts place tile t's keys
        // of digit d at offsets below the count of keys before the next
        // (digit, tile), so every write lies below n in keys_b and
        // perm_b (n each), each position written once.
        unsafe { launch.launch(tile_grid) }.map_err(driver("launching radix_scatter"))?;
        std::mem::swap(keys, keys_b);
        std::mem::swap(perm, perm_b);
    }
    Ok(())
}

/// Sorts and flags `mode` of `coo`: see the module documentation.
/// `coo` must hold at least one nonzero; `scratch` is [`SortScratch::new`]
/// of `coo`.
pub fn sort_mode(
    gpu: &Gpu,
    coo: &DeviceCoo,
    mode: usize,
    scratch: &mut SortScratch,
    lap: Lap<'_>,
) -> Result<SortedMode> {
    if key_bytes(&coo.dims, mode) == 4 {
        sort_with::<u32>(gpu, coo, mode, scratch, lap)
    } else {
        sort_with::<u64>(gpu, coo, mode, scratch, lap)
    }
}

/// In place: `data[k]` becomes the sum of `data[..k]` for `k < len`; the
/// total goes to `scratch.total`. Three launches: the spans' sums, their
/// scan, the spans rescanned (see `kernels/fcoo_build.cu`).
pub fn scan(
    gpu: &Gpu,
    data: &mut CudaSlice<u32>,
    len: usize,
    partial: &mut CudaSlice<u32>,
    total: &mut CudaSlice<u32>,
) -> Result<()> {
    let n = len as u64;
    let threads = SCAN_THREADS as u64;
    let span = n.div_ceil(threads).max(1).next_multiple_of(32);
    let blocks = n.div_ceil(span).max(1) as u32;
    let grid = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (SCAN_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        ..grid
    };
    let stream = gpu.stream();
    let f = function(gpu, Kernel::ScanReduce)?;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&*data).arg(&n).arg(&span).arg(&mut *partial);
    // SAFETY: block b < blocks reads data[k] for k in its span below n
    // (n at most data's length) and writes partial[b]; blocks is at most
    // SCAN_THREADS, partial's length.
    unsafe { launch.launch(grid) }.map_err(driver("launching scan_reduce"))?;
    let f = function(gpu, Kernel::ScanPartials)?;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&mut *partial).arg(&blocks).arg(&mut *total);
    // SAFETY: one block; thread t < blocks reads and writes partial[t]
    // (blocks <= partial's length), thread 0 writes total[0].
    unsafe { launch.launch(one) }.map_err(driver("launching scan_partials"))?;
    let f = function(gpu, Kernel::ScanApply)?;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&mut *data).arg(&n).arg(&span).arg(&*partial);
    // SAFETY: block b < blocks reads partial[b] and reads and writes
    // data[k] for k in its span below n, spans not overlapping.
    unsafe { launch.launch(grid) }.map_err(driver("launching scan_apply"))?;
    Ok(())
}

/// `out[k] = src[perm[k]]` for `k < n`, 32-bit words (`S` and `T` are
/// u32 or f32).
fn gather<S: DeviceRepr, T: DeviceRepr>(
    gpu: &Gpu,
    src: &CudaSlice<S>,
    perm: &CudaView<'_, u32>,
    n: usize,
    out: &mut cudarc::driver::CudaViewMut<'_, T>,
) -> Result<()> {
    debug_assert_eq!(std::mem::size_of::<S>(), 4);
    debug_assert_eq!(std::mem::size_of::<T>(), 4);
    let f = function(gpu, Kernel::FcooGather)?;
    let n64 = n as u64;
    let mut launch = gpu.stream().launch_builder(&f);
    launch.arg(src).arg(perm).arg(&n64).arg(out);
    // SAFETY: thread k < n reads perm[k] (perm holds at least n entries),
    // then src[perm[k]]: callers pass a permutation of src's indices or
    // indices below src's length; out holds at least n words. S and T are
    // 4 bytes (u32 or f32), moved as u32 words.
    unsafe { launch.launch(grid_stride(n64, 1024)) }.map_err(driver("launching fcoo_gather"))?;
    Ok(())
}

/// Loads the build's kernels (one module: every function of
/// `kernels/fcoo_build.cu`), so the steps after it find them loaded.
pub fn load_kernels(gpu: &Gpu) -> Result<()> {
    function(gpu, Kernel::FcooKeys32).map(drop)
}

pub fn function(gpu: &Gpu, kernel: Kernel) -> Result<cudarc::driver::CudaFunction> {
    gpu.kernels()
        .function(gpu.context(), kernel, &[("RANK", BUILD_RANK)])
}

fn sort_with<K: SortKey>(
    gpu: &Gpu,
    coo: &DeviceCoo,
    mode: usize,
    scratch: &mut SortScratch,
    lap: Lap<'_>,
) -> Result<SortedMode> {
    let n = coo.nnz;
    debug_assert!(n > 0);
    let dims = &coo.dims;
    let stream = gpu.stream().clone();
    let n64 = n as u64;
    let second = second_mode(dims, mode);
    // Without a second mode, key = row | row = row.
    let shift = second.map_or(0, |w| bits_below(dims[w]));
    let key_bits = bits_below(dims[mode]) + shift;

    let SortScratch {
        keys: [keys_a, keys_b],
        perm: [perm_a, perm_b],
        counts,
        partial,
        total,
    } = scratch;
    // SAFETY: the key buffers hold n keys of the widest type of any mode
    // (transmute_mut checks the length); cudarc's allocations are aligned
    // for u64, and u32 and u64 have no invalid bit patterns.
    let mut keys = unsafe { keys_a.transmute_mut::<K>(n) }.expect("the key buffers hold n keys");
    // SAFETY: as for `keys`.
    let mut keys_b = unsafe { keys_b.transmute_mut::<K>(n) }.expect("the key buffers hold n keys");
    let mut perm = perm_a.slice_mut(..n);
    let mut perm_b = perm_b.slice_mut(..n);
    {
        let f = function(gpu, K::KEYS)?;
        let second_idx = &coo.idx[second.unwrap_or(mode)];
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&coo.idx[mode])
            .arg(second_idx)
            .arg(&n64)
            .arg(&shift)
            .arg(&mut keys)
            .arg(&mut perm);
        // SAFETY: thread k < n reads row[k] and second[k] (mode index
        // arrays of n entries) and writes keys[k] and perm[k] (n each).
        unsafe { launch.launch(grid_stride(n64, 1024)) }.map_err(driver("launching fcoo_keys"))?;
    }

    radix_sort::<K>(
        gpu,
        [&mut keys, &mut keys_b],
        [&mut perm, &mut perm_b],
        n,
        key_bits,
        SortCounts {
            counts: &mut *counts,
            partial: &mut *partial,
            total: &mut *total,
        },
    )?;

    lap("sort")?;

    // The product-mode indices and the values in sorted order.
    let (keys, perm) = (keys.as_view(), perm.as_view());
    let products: Vec<usize> = (0..dims.len()).filter(|&w| w != mode).collect();
    let mut prod_idx = gpu.alloc_zeros::<u32>("F-COO indices", products.len() * n)?;
    for (q, &w) in products.iter().enumerate() {
        let mut view = prod_idx.slice_mut(q * n..(q + 1) * n);
        gather(gpu, &coo.idx[w], &perm, n, &mut view)?;
    }
    let mut vals = gpu.alloc_zeros::<f32>("F-COO values", n)?;
    gather(gpu, &coo.vals, &perm, n, &mut vals.slice_mut(..n))?;
    lap("gather")?;

    // Segment ends, their running counts, the segment rows.
    let words = n.div_ceil(32);
    let mut bit_flags = gpu.alloc_zeros::<u32>("F-COO bit flags", words)?;
    {
        let f = function(gpu, K::ENDS)?;
        let mut launch = stream.launch_builder(&f);
        launch.arg(&keys).arg(&n64).arg(&shift).arg(&mut bit_flags);
        // SAFETY: thread k reads keys[k] and keys[k + 1] only below n; the
        // grid has words x 32 threads (rounded up to whole blocks), and the
        // first lane of each warp below n writes bit_flags[k / 32], below
        // words.
        unsafe { launch.launch(exact(words as u64 * 32)) }
            .map_err(driver("launching fcoo_ends"))?;
    }
    let mut prefix = gpu.alloc_zeros::<u32>("F-COO segment counts", words)?;
    {
        let f = function(gpu, Kernel::FcooPopc)?;
        let words64 = words as u64;
        let mut launch = stream.launch_builder(&f);
        launch.arg(&bit_flags).arg(&words64).arg(&mut prefix);
        // SAFETY: thread w < words reads bit_flags[w] and writes prefix[w]
        // (words each).
        unsafe { launch.launch(grid_stride(words64, 1024)) }
            .map_err(driver("launching fcoo_popc"))?;
    }
    scan(gpu, &mut prefix, words, partial, total)?;
    let segments = stream
        .clone_dtoh(&*total)
        .map_err(driver("reading the segment count"))?[0] as usize;
    let mut seg_rows = gpu.alloc_zeros::<u32>("F-COO segment rows", segments)?;
    {
        let f = function(gpu, K::ROWS)?;
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&keys)
            .arg(&n64)
            .arg(&shift)
            .arg(&bit_flags)
            .arg(&prefix)
            .arg(&mut seg_rows);
        // SAFETY: thread k < n reads keys[k], bit_flags of words k / 32 and
        // (k - 1) / 32 and prefix[k / 32], all below words; the segment it
        // writes, the set bits before k, is below the total of set bits,
        // the length of seg_rows.
        unsafe { launch.launch(grid_stride(n64, 1024)) }
            .map_err(driver("launching fcoo_segment_rows"))?;
    }
    let host_flags = stream
        .clone_dtoh(&bit_flags)
        .map_err(driver("reading the F-COO bit flags"))?;
    lap("segments")?;
    Ok(SortedMode {
        nnz: n,
        segments,
        prod_idx: Arc::new(prod_idx),
        vals: Arc::new(vals),
        bit_flags: Arc::new(bit_flags),
        seg_rows: Arc::new(seg_rows),
        host_flags,
    })
}

/// The chunk-start bits of `sorted` for `threadlen` nonzeros per thread.
pub fn start_flags(gpu: &Gpu, sorted: &SortedMode, threadlen: usize) -> Result<CudaSlice<u32>> {
    let chunks = sorted.nnz.div_ceil(threadlen);
    let words = chunks.div_ceil(32);
    let mut out = gpu.alloc_zeros::<u32>("F-COO start flags", words)?;
    let f = function(gpu, Kernel::FcooStartFlags)?;
    let (chunks64, threadlen32) = (chunks as u64, threadlen as u32);
    let mut launch = gpu.stream().launch_builder(&f);
    launch
        .arg(&*sorted.bit_flags)
        .arg(&chunks64)
        .arg(&threadlen32)
        .arg(&mut out);
    // SAFETY: thread c reads the bit of nonzero c * threadlen - 1 < nnz only
    // for 0 < c < chunks (in bit_flags' ceil(nnz / 32) words); the grid has
    // words x 32 threads, and the first lane of each warp below chunks
    // writes out[c / 32], below words.
    unsafe { launch.launch(exact(words as u64 * 32)) }
        .map_err(driver("launching fcoo_start_flags"))?;
    Ok(out)
}

/// The rows of segments `segments` (numbers below `sorted.segments`).
pub fn segment_rows_of(gpu: &Gpu, sorted: &SortedMode, segments: &[u32]) -> Result<CudaSlice<u32>> {
    let numbers = gpu.upload("F-COO edge segments", segments)?;
    let mut rows = gpu.alloc_zeros::<u32>("F-COO edge rows", segments.len())?;
    if !segments.is_empty() {
        gather(
            gpu,
            &sorted.seg_rows,
            &numbers.as_view(),
            segments.len(),
            &mut rows.slice_mut(..segments.len()),
        )?;
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_widths_follow_the_bits_of_row_and_second_mode() {
        assert_eq!(bits_below(1), 0);
        assert_eq!(bits_below(2), 1);
        assert_eq!(bits_below(1 << 20), 20);
        assert_eq!(bits_below((1 << 20) + 1), 21);
        assert_eq!(bits_below(u32::MAX), 32);
        // nell-2's shape: 14 + 14 bits (the second mode is the 9184 one).
        assert_eq!(second_mode(&[12_092, 9_184, 28_818], 0), Some(1));
        assert_eq!(second_mode(&[12_092, 9_184, 28_818], 1), Some(0));
        assert_eq!(key_bytes(&[12_092, 9_184, 28_818], 2), 4);
        // Ties go to the lower mode; a lone mode has no second.
        assert_eq!(second_mode(&[5, 7, 7], 0), Some(1));
        assert_eq!(second_mode(&[5], 0), None);
        assert_eq!(key_bytes(&[1 << 20, 1 << 20, 1 << 13], 0), 8);
        assert_eq!(key_bytes(&[1 << 19, 1 << 20, 1 << 13], 0), 4);
        // The scratch fits the widest mode's keys.
        assert_eq!(widest_key(&[1 << 19, 1 << 20, 1 << 13]), 8);
        assert_eq!(widest_key(&[12_092, 9_184, 28_818]), 4);
        assert_eq!(widest_key(&[]), 4);
    }

    /// Whether the driver holds `p` page-locked.
    fn page_locked(p: &[u32]) -> bool {
        let mut flags = 0u32;
        // SAFETY: the driver only looks the address up.
        let rc = unsafe {
            cudarc::driver::sys::cuMemHostGetFlags(&mut flags, p.as_ptr() as *mut std::ffi::c_void)
        };
        rc == cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS
    }

    #[test]
    fn a_tensor_stays_page_locked_while_it_lives_and_uploads_again_whole() {
        let Some(gpu) = crate::testing::gpu_or_skip(
            "a_tensor_stays_page_locked_while_it_lives_and_uploads_again_whole",
        ) else {
            return;
        };
        // (3 + 1) words per nonzero, above the staging threshold; distinct
        // coordinates.
        let nnz = crate::gpu::STAGE_WORDS / 2 + 777;
        let dims = vec![1000u32, 2000, 3000];
        let indices: Vec<Vec<u32>> = vec![
            (0..nnz as u32).map(|k| k % 1000).collect(),
            (0..nnz as u32).map(|k| (k / 1000) % 2000).collect(),
            (0..nnz as u32).map(|k| k / 2_000_000).collect(),
        ];
        let values: Vec<f32> = (0..nnz).map(|k| k as f32 * 0.5 - 7.0).collect();
        let t = SparseTensor::new(dims, indices, values).unwrap();
        let check = |t: &SparseTensor, coo: &DeviceCoo| {
            for m in 0..3 {
                let back = gpu.stream().clone_dtoh(&coo.idx[m]).unwrap();
                assert_eq!(back, t.mode_indices(m));
            }
            let bits: Vec<u32> = t.values().iter().map(|v| v.to_bits()).collect();
            assert_eq!(gpu.stream().clone_dtoh(&coo.vals).unwrap(), bits);
        };
        assert!(!page_locked(t.mode_indices(0)));
        let first = DeviceCoo::upload(&gpu, &t).unwrap();
        check(&t, &first);
        // Registered whole, and kept with the tensor after the upload.
        let kept = |t: &SparseTensor| {
            t.attached().with(|slot| {
                slot.as_ref()
                    .and_then(|b| b.downcast_ref::<Registered>())
                    .map(Registered::len)
            })
        };
        assert!(kept(&t).unwrap() > 1);
        assert!(page_locked(t.mode_indices(2)) && page_locked(&t.mode_indices(1)[nnz - 1..]));
        // A second upload copies from the same registration.
        let before = kept(&t);
        let second = DeviceCoo::upload(&gpu, &t).unwrap();
        check(&t, &second);
        assert_eq!(kept(&t), before);
        // A clone lies elsewhere: it starts unregistered and gets its own.
        let c = t.clone();
        assert!(kept(&c).is_none() && !page_locked(c.mode_indices(0)));
        check(&c, &DeviceCoo::upload(&gpu, &c).unwrap());
        assert!(kept(&c).is_some() && page_locked(c.mode_indices(0)));
        // Taking the arrays out ends the registration first.
        let (_, indices, values) = t.into_parts();
        assert!(!page_locked(&indices[0]) && !page_locked(&indices[2]));
        // SAFETY: same size and alignment, any bits are a u32.
        let bits =
            unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u32>(), values.len()) };
        assert!(!page_locked(bits));
        assert!(page_locked(c.mode_indices(0)));
    }
}
