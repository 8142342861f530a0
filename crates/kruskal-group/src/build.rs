//! Each GPU of a group builds its own shards from one upload of the COO,
//! with the sort of the one-GPU layout build (`kernels/fcoo_build.cu`):
//! per mode, the nonzeros whose relabeled row the GPU owns are selected in
//! COO order (`shard_tile_counts`, a scan, `shard_select`), sorted by that
//! row with the stable radix sort, and written as elements
//! (`shard_elements`), exactly what [`RowShards::fill_elements`] gives the
//! GPU up to the order inside a row. The rows of the other modes each
//! shard reads are marked on the device too (`shard_mark`), as the bitmap
//! [`kruskal_partition::RowReaders::merge_bitmap`] takes, so the host never
//! holds the elements: it only counts rows for the plan.
//!
//! The GPUs build at once, one thread each (the COO's page lock, kept with
//! the tensor, serves every GPU's upload). Used where every shard of every
//! GPU stays resident and the build's transient buffers fit beside them
//! ([`fits`]); elsewhere the host builds the shards.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use kruskal_formats::SparseTensor;
use kruskal_partition::RowShards;

use kruskal_device::engines::fcoo::build::{
    DeviceCoo, SCAN_WORDS, SORT_THREADS, SORT_TILE, SortCounts, bits_below, count_words, function,
    radix_sort, scan,
};
use kruskal_device::kernels::Kernel;
use kruskal_device::{DeviceError, Gpu, Result, driver, grid_stride};

/// Device bytes GPU `g`'s build takes besides its shards: the COO, every
/// mode's relabeling, the keys and permutations of its largest shard (two
/// of each) and the sort's counts.
pub(super) fn transient_bytes(plan: &RowShards, g: usize, nnz: usize) -> usize {
    let n = plan.dims().len();
    let most = (0..n).map(|m| plan.nnz(m, g) as usize).max().unwrap_or(0);
    let relabels: usize = plan.dims().iter().map(|&d| d as usize * 4).sum();
    DeviceCoo::bytes(n, nnz)
        + relabels
        + 4 * 4 * most
        + 4 * count_words(most).max(nnz.div_ceil(SORT_TILE))
        + 4 * SCAN_WORDS
}

/// Whether GPU `g` builds on the device: `resident` (every shard, the
/// factors, the outputs and the margin, as the residency decided) and the
/// build's transient buffers fit in `free` bytes together, and the
/// permutations' 32-bit entries can number the nonzeros.
pub(super) fn fits(plan: &RowShards, g: usize, nnz: usize, resident: usize, free: usize) -> bool {
    nnz < u32::MAX as usize && resident + transient_bytes(plan, g, nnz) <= free
}

/// What one GPU's build gives.
pub(super) struct Built {
    /// Per mode, the shard's elements and their count.
    pub(super) shards: Vec<(CudaSlice<u32>, u64)>,
    /// With marked modes: the rows this GPU's shards read, in the layout
    /// of [`kruskal_partition::RowReaders::bitmap`].
    pub(super) bitmap: Option<Vec<u32>>,
}

/// Tiles of the selection over `n` nonzeros.
fn tile_grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(SORT_TILE).max(1) as u32, 1, 1),
        block_dim: (SORT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Builds GPU `g`'s shard of every mode of `t` under `plan`, and marks the
/// rows of the `marked` modes they read.
pub(super) fn build(
    gpu: &Gpu,
    t: &SparseTensor,
    plan: &RowShards,
    g: usize,
    marked: &[bool],
) -> Result<Built> {
    let n = t.nnz();
    let nm = t.nmodes();
    let stride = nm + 1;
    if t.dims() != plan.dims() {
        return Err(DeviceError::Shape(format!(
            "a tensor of dims {:?} for a plan of dims {:?}",
            t.dims(),
            plan.dims()
        )));
    }
    let stream = gpu.stream().clone();
    let coo = DeviceCoo::upload(gpu, t)?;
    let relabels = (0..nm)
        .map(|w| gpu.upload("a mode's relabeling", plan.relabel(w)))
        .collect::<Result<Vec<_>>>()?;
    let address = |s: &CudaSlice<u32>| -> u64 {
        let (ptr, _sync) = s.device_ptr(&stream);
        ptr
    };
    let idx_addr: Vec<u64> = (0..nm).map(|w| address(coo.indices(w))).collect();
    let relabel_addr: Vec<u64> = relabels.iter().map(address).collect();
    let idx_ptrs = gpu.upload("the COO's addresses", &idx_addr)?;
    let relabel_ptrs = gpu.upload("the relabelings' addresses", &relabel_addr)?;
    let most = (0..nm)
        .map(|m| plan.nnz(m, g) as usize)
        .max()
        .unwrap_or(0)
        .max(1);
    let mut keys = [
        gpu.alloc_zeros::<u32>("the shard sort keys", most)?,
        gpu.alloc_zeros::<u32>("the shard sort keys", most)?,
    ];
    let mut perm = [
        gpu.alloc_zeros::<u32>("the shard sort permutation", most)?,
        gpu.alloc_zeros::<u32>("the shard sort permutation", most)?,
    ];
    let tiles = n.div_ceil(SORT_TILE).max(1);
    let mut counts =
        gpu.alloc_zeros::<u32>("the shard sort counts", count_words(most).max(tiles))?;
    let mut partial = gpu.alloc_zeros::<u32>("the shard scan sums", SCAN_WORDS)?;
    let mut total = gpu.alloc_zeros::<u32>("the shard scan total", 1)?;
    // The bitmap of the rows read: per marked mode, one bit per row.
    let marking = marked.iter().any(|&m| m);
    let mut first = vec![u64::MAX; nm];
    let mut words = 0u64;
    for w in (0..nm).filter(|&w| marked[w]) {
        first[w] = words;
        words += u64::from(plan.dims()[w].div_ceil(32));
    }
    let first_dev = gpu.upload("the bitmap offsets", &first)?;
    let mut bitmap = gpu.alloc_zeros::<u32>("the rows read", words as usize)?;

    let (n64, nm32) = (n as u64, nm as u32);
    let mut shards = Vec::with_capacity(nm);
    for (mode, relabel) in relabels.iter().enumerate() {
        // The nonzeros of the rows this GPU owns in `own` (the mode
        // itself, or a split plan's cut mode), sorted by `mode`'s row.
        let own = plan.shard_mode(mode);
        let rows = plan.rows(own, g);
        let count = plan.nnz(mode, g);
        if count == 0 {
            shards.push((gpu.alloc_zeros::<u32>("a shard", 1)?, 0));
            continue;
        }
        let (lo, hi) = (rows.start, rows.end);
        // Keys: the row minus `key_lo`, below `key_span`.
        let (key_lo, key_span) = if own == mode {
            (lo, hi - lo)
        } else {
            (0, plan.dims()[mode])
        };
        let f = function(gpu, Kernel::ShardTileCounts)?;
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(coo.indices(own))
            .arg(&relabels[own])
            .arg(&n64)
            .arg(&lo)
            .arg(&hi)
            .arg(&mut counts);
        // SAFETY: block t reads nonzeros t * SORT_TILE .. below n of the
        // mode's indices (n entries) and their relabeling (indices below
        // the dimension, the relabeling's length), and writes counts[t],
        // t < tiles <= counts' length.
        unsafe { launch.launch(tile_grid(n)) }.map_err(driver("launching shard_tile_counts"))?;
        scan(gpu, &mut counts, tiles, &mut partial, &mut total)?;
        let found = stream
            .clone_dtoh(&total)
            .map_err(driver("reading a shard's size"))?[0];
        if u64::from(found) != count {
            return Err(DeviceError::Shape(format!(
                "mode {}: GPU {g} found {found} nonzeros of its rows of mode {}, the plan \
                 counted {count}",
                mode + 1,
                own + 1
            )));
        }
        let f = function(gpu, Kernel::ShardSelect)?;
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(coo.indices(own))
            .arg(&relabels[own])
            .arg(&n64)
            .arg(&lo)
            .arg(&hi)
            .arg(coo.indices(mode))
            .arg(relabel)
            .arg(&key_lo)
            .arg(&counts)
            .arg(&mut keys[0])
            .arg(&mut perm[0]);
        // SAFETY: as shard_tile_counts for the reads (the key mode's
        // index and relabeling likewise: n indices below its dimension);
        // the scanned counts place tile t's own nonzeros below their
        // total, `count` (checked above), at most the keys' and
        // permutations' length.
        unsafe { launch.launch(tile_grid(n)) }.map_err(driver("launching shard_select"))?;
        let c = count as usize;
        let [ka, kb] = &mut keys;
        let [pa, pb] = &mut perm;
        let (mut ka, mut kb) = (ka.slice_mut(..c), kb.slice_mut(..c));
        let (mut pa, mut pb) = (pa.slice_mut(..c), pb.slice_mut(..c));
        radix_sort::<u32>(
            gpu,
            [&mut ka, &mut kb],
            [&mut pa, &mut pb],
            c,
            bits_below(key_span),
            SortCounts {
                counts: &mut counts,
                partial: &mut partial,
                total: &mut total,
            },
        )?;
        let mut elems = gpu.alloc_zeros::<u32>("a shard", c * stride)?;
        let f = function(gpu, Kernel::ShardElements)?;
        let sorted = pa.as_view();
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&idx_ptrs)
            .arg(&relabel_ptrs)
            .arg(coo.value_bits())
            .arg(&nm32)
            .arg(&sorted)
            .arg(&count)
            .arg(&mut elems);
        // SAFETY: thread j < count reads perm[j] (the sorted view holds
        // count entries), a nonzero below n, its index in every mode (nm
        // arrays of n entries whose addresses idx_ptrs holds, alive in
        // `coo`) and their relabelings (alive in `relabels`), and writes
        // element j of count x stride words.
        unsafe { launch.launch(grid_stride(count, 256)) }
            .map_err(driver("launching shard_elements"))?;
        if marking {
            let f = function(gpu, Kernel::ShardMark)?;
            let mode32 = mode as u32;
            let mut launch = stream.launch_builder(&f);
            launch
                .arg(&elems)
                .arg(&count)
                .arg(&nm32)
                .arg(&mode32)
                .arg(&first_dev)
                .arg(&mut bitmap);
            // SAFETY: thread j < count reads element j (count x stride
            // words) and, for each marked mode w, sets a bit of word
            // first[w] + row / 32 with row below dims[w]: inside that
            // mode's dims[w] / 32 (rounded up) words of the bitmap.
            unsafe { launch.launch(grid_stride(count, 256)) }
                .map_err(driver("launching shard_mark"))?;
        }
        shards.push((elems, count));
    }
    let bitmap = if marking {
        Some(
            stream
                .clone_dtoh(&bitmap)
                .map_err(driver("downloading the rows read"))?,
        )
    } else {
        stream
            .synchronize()
            .map_err(driver("building the shards"))?;
        None
    };
    Ok(Built { shards, bitmap })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use kruskal_partition::RowReaders;

    /// Elements of `words` (`stride` words each), sorted, for comparing
    /// shards whose order inside a row may differ.
    fn sorted_elements(words: &[u32], stride: usize) -> Vec<Vec<u32>> {
        let mut out: Vec<Vec<u32>> = words.chunks_exact(stride).map(<[u32]>::to_vec).collect();
        out.sort();
        out
    }

    #[test]
    fn the_fit_check_counts_the_build_beside_the_shards() {
        let t = power_law(&PowerLawSpec::new(vec![50, 60, 70], 5_000)).unwrap();
        let plan = RowShards::new(&t, 2).unwrap();
        let transient = transient_bytes(&plan, 0, t.nnz());
        assert!(transient >= DeviceCoo::bytes(3, t.nnz()));
        assert!(fits(&plan, 0, t.nnz(), 1000, 1000 + transient));
        assert!(!fits(&plan, 0, t.nnz(), 1000, 999 + transient));
    }

    #[test]
    fn shards_built_on_the_gpu_are_the_hosts_and_mark_the_same_rows() {
        let Some(gpu) = kruskal_device::testing::gpu_or_skip(
            "shards_built_on_the_gpu_are_the_hosts_and_mark_the_same_rows",
        ) else {
            return;
        };
        for (dims, nnz, gpus) in [
            (vec![1u32, 300, 9_000], 20_000usize, 3usize),
            (vec![40, 50, 60, 7], 30_000, 4),
            (vec![3_000, 2_000, 100_000], 200_000, 2),
            (vec![20, 30, 40], 5_000, 1),
        ] {
            let t = power_law(
                &PowerLawSpec::new(dims.clone(), nnz)
                    .with_draws()
                    .with_seed(7),
            )
            .unwrap();
            let rows_plan = RowShards::new(&t, gpus).unwrap();
            // The rows plan, and the split plan that cuts the last mode.
            for split in [None, Some(t.nmodes() - 1)] {
                let mut plan = rows_plan.clone();
                if let Some(cut) = split {
                    plan.split_by(cut).unwrap();
                }
                let stride = plan.stride();
                let marked: Vec<bool> = (0..t.nmodes()).map(|w| w % 2 == 0 || gpus > 2).collect();
                let readers = RowReaders::for_modes(&plan, &marked).unwrap();
                let mut host = Vec::new();
                for mode in 0..t.nmodes() {
                    let mut buf = vec![0u32; t.nnz() * stride];
                    let offsets = plan.fill_elements(&t, mode, &mut buf).unwrap();
                    for g in 0..gpus {
                        let slice =
                            &buf[offsets[g] as usize * stride..offsets[g + 1] as usize * stride];
                        readers.mark(g, mode, slice).unwrap();
                    }
                    host.push((buf, offsets));
                }
                for g in 0..gpus {
                    let what = format!("dims {dims:?} over {gpus} GPUs (split {split:?}), GPU {g}");
                    let built = build(&gpu, &t, &plan, g, &marked).unwrap();
                    for (mode, (elems, count)) in built.shards.iter().enumerate() {
                        let (buf, offsets) = &host[mode];
                        let want =
                            &buf[offsets[g] as usize * stride..offsets[g + 1] as usize * stride];
                        assert_eq!(*count, plan.nnz(mode, g), "{what} mode {mode}");
                        let got = gpu.stream().clone_dtoh(elems).unwrap();
                        let got = &got[..*count as usize * stride];
                        // Sorted by the mode's row, and the same elements.
                        let rows: Vec<u32> = got.chunks_exact(stride).map(|e| e[mode]).collect();
                        assert!(rows.windows(2).all(|w| w[0] <= w[1]), "{what} mode {mode}");
                        assert_eq!(
                            sorted_elements(got, stride),
                            sorted_elements(want, stride),
                            "{what} mode {mode}"
                        );
                    }
                    let want = readers.bitmap(g);
                    match &built.bitmap {
                        Some(bits) => assert_eq!(bits, &want, "{what}: rows read"),
                        None => assert!(!marked.iter().any(|&m| m), "{what}"),
                    }
                }
            }
        }
    }
}
