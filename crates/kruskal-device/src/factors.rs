//! The factor matrices on the device, which every engine reads and the
//! dense steps update, and the check of an MTTKRP's operands.

use cudarc::driver::{CudaSlice, CudaViewMut};
use ndarray::Array2;

use crate::{DeviceError, Gpu, Result, driver};

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

    /// Every factor, downloaded (synchronizes the stream).
    pub fn download(&self, gpu: &Gpu) -> Result<Vec<Array2<f32>>> {
        let mut out = Vec::with_capacity(self.dims.len());
        for (mode, &d) in self.dims.iter().enumerate() {
            let first = self.first_row(mode) * self.rank;
            let len = d as usize * self.rank;
            let rows = gpu
                .stream()
                .clone_dtoh(&self.data.slice(first..first + len))
                .map_err(driver("downloading the factor matrices"))?;
            out.push(
                Array2::from_shape_vec((d as usize, self.rank), rows)
                    .map_err(|e| DeviceError::Shape(e.to_string()))?,
            );
        }
        Ok(out)
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
