//! The factor matrices on the device, which every engine reads and the
//! dense steps update, and the check of an MTTKRP's operands.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};
use ndarray::Array2;
use rayon::prelude::*;

use crate::gpu::STAGE_WORDS;
use crate::kernels::Kernel;
use crate::random::{chacha_key, mode_stream};
use crate::{DeviceError, Gpu, Result, driver, grid_stride};

/// Every factor matrix on the device: rows of all modes concatenated in one
/// buffer (`rank` floats each), and each mode's first row.
pub struct DeviceFactors {
    dims: Vec<u32>,
    rank: usize,
    pub(crate) data: CudaSlice<f32>,
    pub(crate) row_offset: CudaSlice<u64>,
}

impl DeviceFactors {
    /// The factors' floats: every mode's rows in mode order, row-major.
    pub fn data(&self) -> &CudaSlice<f32> {
        &self.data
    }

    /// The factors' floats, to be written in place (the group's exchange
    /// and reload).
    pub fn data_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.data
    }

    /// Each mode's first row in [`Self::data`] (rows of `rank` floats).
    pub fn row_offsets(&self) -> &CudaSlice<u64> {
        &self.row_offset
    }

    /// Uploads `factors` (`dims[w] x rank`, standard layout).
    pub fn upload(gpu: &Gpu, factors: &[Array2<f32>]) -> Result<Self> {
        let rank = factors.first().map_or(0, |f| f.ncols());
        if rank == 0 || factors.iter().any(|f| f.ncols() != rank) {
            return Err(DeviceError::Shape(
                "factors need one common rank >= 1".into(),
            ));
        }
        let dims: Vec<u32> = factors.iter().map(|f| f.nrows() as u32).collect();
        // Each mode's rows go straight into their place in one device
        // buffer: at tens of millions of rows a host copy of all the
        // factors, made only to be uploaded, costs seconds.
        let total: usize = factors.iter().map(|f| f.len()).sum();
        let mut data = gpu.alloc_zeros::<f32>("the factor matrices", total)?;
        let mut first = 0;
        for f in factors {
            let len = f.len();
            let copied: Vec<f32>;
            let rows = match f.as_slice() {
                Some(rows) => rows,
                None => {
                    copied = f.iter().copied().collect();
                    &copied
                }
            };
            if len > 0 {
                gpu.stream()
                    .memcpy_htod(rows, &mut data.slice_mut(first..first + len))
                    .map_err(driver("uploading the factor matrices"))?;
            }
            first += len;
        }
        Ok(DeviceFactors {
            row_offset: gpu.upload("the factor offsets", &row_offsets(&dims))?,
            dims,
            rank,
            data,
        })
    }

    /// Seeded uniform factors in [0, 1), `dims[m] x rank` each, drawn on
    /// the device in blocks of `block` floats (a multiple of 16): equal bit
    /// for bit to the host's draw of the same seed and blocks (see
    /// [`crate::random`]), without a host copy or an upload.
    pub fn random(gpu: &Gpu, dims: &[u32], rank: usize, seed: u64, block: usize) -> Result<Self> {
        crate::dense::check_rank(rank)?;
        if block == 0 || block % 16 != 0 {
            return Err(DeviceError::Shape(format!(
                "random blocks of {block} floats (a positive multiple of 16 is needed)"
            )));
        }
        let total: usize = dims.iter().map(|&d| d as usize * rank).sum();
        let mut data = gpu.alloc_zeros::<f32>("the factor matrices", total)?;
        let mut first = 0;
        for (mode, &d) in dims.iter().enumerate() {
            let n = d as usize * rank;
            let mut out = data.slice_mut(first..first + n);
            queue_uniform_fill(gpu, &mut out, rank, seed, mode, block)?;
            first += n;
        }
        Ok(DeviceFactors {
            row_offset: gpu.upload("the factor offsets", &row_offsets(dims))?,
            dims: dims.to_vec(),
            rank,
            data,
        })
    }

    /// Uploads factors given as one buffer: the rows of every mode in mode
    /// order (`sum(dims) x rank` floats, row-major), as [`Self::upload`]
    /// concatenates them. Saves a copy of large factors.
    pub fn upload_rows(gpu: &Gpu, dims: &[u32], rank: usize, rows: &[f32]) -> Result<Self> {
        let total: usize = dims.iter().map(|&d| d as usize).sum();
        if rank == 0 || rows.len() != total * rank {
            return Err(DeviceError::Shape(format!(
                "{} floats for factors of dims {dims:?} at rank {rank}",
                rows.len()
            )));
        }
        Ok(DeviceFactors {
            dims: dims.to_vec(),
            rank,
            data: gpu.upload("the factor matrices", rows)?,
            row_offset: gpu.upload("the factor offsets", &row_offsets(dims))?,
        })
    }

    /// Zeroed factors of `dims` at `rank`, to be written mode by mode
    /// (the group's reload, one mode's rows at a time).
    pub fn zeros(gpu: &Gpu, dims: &[u32], rank: usize) -> Result<Self> {
        let total: usize = dims.iter().map(|&d| d as usize).sum();
        if rank == 0 {
            return Err(DeviceError::Shape("factors need a rank >= 1".into()));
        }
        Ok(DeviceFactors {
            dims: dims.to_vec(),
            rank,
            data: gpu.alloc_zeros("the factor matrices", total * rank)?,
            row_offset: gpu.upload("the factor offsets", &row_offsets(dims))?,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// Bytes of the factor matrices on the device.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    /// The first row of `mode` in the concatenated buffer.
    fn first_row(&self, mode: usize) -> usize {
        self.dims[..mode].iter().map(|&d| d as usize).sum()
    }

    /// Mode `mode`'s factor, `dims[mode] x rank` floats, to be read.
    pub fn mode(&self, mode: usize) -> CudaView<'_, f32> {
        let first = self.first_row(mode) * self.rank;
        self.data
            .slice(first..first + self.dims[mode] as usize * self.rank)
    }

    /// Mode `mode`'s factor, `dims[mode] x rank` floats, for the dense
    /// kernels to update in place.
    pub fn mode_mut(&mut self, mode: usize) -> CudaViewMut<'_, f32> {
        self.rows_mut(mode, 0..self.dims[mode])
    }

    /// Rows `rows` of mode `mode`'s factor (`rows.len() x rank` floats).
    pub fn rows_mut(&mut self, mode: usize, rows: std::ops::Range<u32>) -> CudaViewMut<'_, f32> {
        let first = (self.first_row(mode) + rows.start as usize) * self.rank;
        self.data.slice_mut(first..first + rows.len() * self.rank)
    }

    /// One mode's factor rows, in this buffer's row order, handed to
    /// `sink(at, piece)` piece by piece (`at`: the piece's first float
    /// within the mode; whole rows, at most [`STAGE_WORDS`] floats) as
    /// they come through the page-locked staging buffers: the caller
    /// writes them where they belong without a copy of the whole mode.
    /// Synchronizes the stream.
    pub fn download_mode_into(
        &self,
        gpu: &Gpu,
        mode: usize,
        sink: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<()> {
        let len = self.dims[mode] as usize * self.rank;
        let first = self.first_row(mode) * self.rank;
        let piece = (STAGE_WORDS / self.rank).max(1) * self.rank;
        let pieces: Vec<(usize, usize)> = (0..len)
            .step_by(piece.max(1))
            .map(|at| (first + at, piece.min(len - at)))
            .collect();
        gpu.download_through_staging("a factor matrix", &self.data, &pieces, &mut |i, src| {
            sink(i * piece, src)
        })
    }

    /// Every factor, downloaded (synchronizes the stream).
    pub fn download(&self, gpu: &Gpu) -> Result<Vec<Array2<f32>>> {
        self.download_with(gpu, |_, src, dst| dst.copy_from_slice(src))
    }

    /// Every factor, downloaded through [`Gpu::download_through_staging`],
    /// with `map(mode, rows, out)` writing each piece's rows into the
    /// result (`rows` and `out` hold the same whole rows, `rank` floats
    /// each): an arrangement of the columns costs no pass of its own.
    /// `map` runs on the host's threads, on pieces of a few thousand rows.
    /// Synchronizes the stream.
    pub fn download_with<F>(&self, gpu: &Gpu, map: F) -> Result<Vec<Array2<f32>>>
    where
        F: Fn(usize, &[f32], &mut [f32]) + Sync,
    {
        let rank = self.rank;
        let mut out: Vec<Vec<f32>> = self
            .dims
            .iter()
            .map(|&d| vec![0f32; d as usize * rank])
            .collect();
        // (mode, first float in the mode) of each piece, and the piece as
        // a range of the one buffer.
        let piece = (STAGE_WORDS / rank).max(1) * rank;
        let mut owner = Vec::new();
        let mut pieces = Vec::new();
        for (mode, &d) in self.dims.iter().enumerate() {
            let first = self.first_row(mode) * rank;
            let len = d as usize * rank;
            for at in (0..len).step_by(piece) {
                owner.push((mode, at));
                pieces.push((first + at, piece.min(len - at)));
            }
        }
        // Pieces of the copy on the host's threads: whole rows.
        let part = ((1 << 14) / rank).max(1) * rank;
        gpu.download_through_staging("the factor matrices", &self.data, &pieces, &mut |i, src| {
            let (mode, at) = owner[i];
            let dst = &mut out[mode][at..at + src.len()];
            src.par_chunks(part)
                .zip(dst.par_chunks_mut(part))
                .for_each(|(s, d)| map(mode, s, d));
        })?;
        out.into_iter()
            .zip(&self.dims)
            .map(|(rows, &d)| {
                Array2::from_shape_vec((d as usize, rank), rows)
                    .map_err(|e| DeviceError::Shape(e.to_string()))
            })
            .collect()
    }
}

/// The first row of each mode in the factors' one buffer.
fn row_offsets(dims: &[u32]) -> Vec<u64> {
    dims.iter()
        .scan(0u64, |first, &d| {
            let this = *first;
            *first += u64::from(d);
            Some(this)
        })
        .collect()
}

/// Checks an MTTKRP's operands: factors for a tensor of `dims`, an existing
/// `mode`, and an output of `dims[mode] x rank` floats. Returns the rank.
pub(crate) fn check_operands(
    dims: &[u32],
    mode: usize,
    factors: &DeviceFactors,
    out_len: usize,
) -> Result<usize> {
    if factors.dims() != dims || mode >= dims.len() {
        return Err(DeviceError::Shape(format!(
            "factors of dims {:?} (or mode {mode}) for a tensor of dims {dims:?}",
            factors.dims()
        )));
    }
    let rank = factors.rank();
    if out_len != dims[mode] as usize * rank {
        return Err(DeviceError::Shape(format!(
            "output holds {out_len} floats, mode {mode} needs {}",
            dims[mode] as usize * rank
        )));
    }
    Ok(rank)
}

/// Queues mode `mode`'s seeded uniform draw into `out` (all of it: `rows x
/// rank` floats in the original row order), in blocks of `block` floats (a
/// multiple of 16): what [`DeviceFactors::random`] writes for that mode,
/// bit for bit. The group draws a mode into a scratch buffer with it and
/// moves the rows to their labels.
pub fn queue_uniform_fill(
    gpu: &Gpu,
    out: &mut CudaViewMut<'_, f32>,
    rank: usize,
    seed: u64,
    mode: usize,
    block: usize,
) -> Result<()> {
    if block == 0 || block % 16 != 0 {
        return Err(DeviceError::Shape(format!(
            "random blocks of {block} floats (a positive multiple of 16 is needed)"
        )));
    }
    let n = out.len();
    if n == 0 {
        return Ok(());
    }
    let f = gpu
        .kernels()
        .function(gpu.context(), Kernel::UniformFill, &[("RANK", rank as i64)])?;
    let key = chacha_key(seed);
    let (n_u, block_u, stream_u) = (n as u64, block as u64, mode_stream(mode));
    let mut launch = gpu.stream().launch_builder(&f);
    launch.arg(out).arg(&n_u).arg(&block_u).arg(&stream_u);
    for k in &key {
        launch.arg(k);
    }
    // SAFETY: `out` holds n floats and the kernel writes entries below n
    // only; the other arguments are plain values.
    unsafe { launch.launch(grid_stride(n.div_ceil(16) as u64, 256)) }
        .map_err(driver("launching uniform_fill"))?;
    Ok(())
}
