//! `coo_atomic`: the COO MTTKRP baseline on the GPU.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use kruskal_formats::SparseTensor;

use crate::factors::{DeviceFactors, check_operands};
use crate::kernels::Kernel;
use crate::{Gpu, Result, driver, grid_stride};

/// The COO tensor on the device and the `coo_atomic` kernel.
pub struct CooGpu {
    gpu: Arc<Gpu>,
    dims: Vec<u32>,
    nnz: usize,
    /// NMODES x nnz, mode-major.
    idx: CudaSlice<u32>,
    vals: CudaSlice<f32>,
    /// f64 row sums of the largest mode, reused across calls.
    sums: Option<CudaSlice<f64>>,
}

/// Threads per block of `coo_atomic` (8 warps, one nonzero per warp).
const BLOCK: u32 = 256;

impl CooGpu {
    /// Bytes the tensor takes on the device.
    pub fn device_bytes(tensor: &SparseTensor) -> usize {
        tensor.nnz() * (4 * tensor.nmodes() + 4)
    }

    /// Uploads `tensor` (checked against free memory first).
    pub fn new(gpu: Arc<Gpu>, tensor: &SparseTensor) -> Result<Self> {
        gpu.ensure_free("the COO tensor", Self::device_bytes(tensor))?;
        let mut idx = Vec::with_capacity(tensor.nnz() * tensor.nmodes());
        for m in 0..tensor.nmodes() {
            idx.extend_from_slice(tensor.mode_indices(m));
        }
        let idx = gpu.upload("the COO indices", &idx)?;
        let vals = gpu.upload("the COO values", tensor.values())?;
        Ok(CooGpu {
            dims: tensor.dims().to_vec(),
            nnz: tensor.nnz(),
            idx,
            vals,
            sums: None,
            gpu,
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// `out = MTTKRP(mode)` on the device; `out` holds `dims[mode] x rank`
    /// floats. Asynchronous on the GPU's stream.
    pub fn mttkrp(
        &mut self,
        mode: usize,
        factors: &DeviceFactors,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let n = self.dims.len();
        let rank = check_operands(&self.dims, mode, factors, out.len())?;
        let f = self.gpu.kernels().function(
            self.gpu.context(),
            Kernel::MttkrpCooAtomic,
            &[("NMODES", n as i64), ("RANK", rank as i64)],
        )?;
        let store = self.gpu.kernels().function(
            self.gpu.context(),
            Kernel::StoreF32,
            &[("NMODES", n as i64), ("RANK", rank as i64)],
        )?;
        let stream = self.gpu.stream().clone();
        let len = out.len();
        if self.sums.as_ref().is_none_or(|s| s.len() < len) {
            self.sums = None;
            self.sums = Some(self.gpu.alloc_zeros::<f64>("the f64 row sums", len)?);
        }
        let all_sums = self.sums.as_mut().expect("allocated above");
        let mut sums = all_sums.slice_mut(..len);
        stream
            .memset_zeros(&mut sums)
            .map_err(driver("zeroing the row sums"))?;
        let warps_per_block = u64::from(BLOCK) / 32;
        let blocks = (self.nnz as u64)
            .div_ceil(warps_per_block)
            .min(self.gpu.properties().sms as u64 * 64)
            .max(1) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let nnz = self.nnz as u64;
        let mode = mode as i32;
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&self.idx)
            .arg(&self.vals)
            .arg(&factors.data)
            .arg(&factors.row_offset)
            .arg(&mut sums)
            .arg(&nnz)
            .arg(&mode);
        if self.nnz > 0 {
            // SAFETY: the kernel reads idx[0 .. NMODES * nnz) and
            // vals[0 .. nnz), both uploaded with exactly those lengths;
            // every index is below its mode's dimension (SparseTensor
            // checks it), so factor rows row_offset[w] + idx lie inside
            // `data` (the dims match, checked above) and sum rows inside
            // `sums` (dims[mode] * rank long).
            unsafe { launch.launch(cfg) }.map_err(driver("launching mttkrp_coo_atomic"))?;
        }
        let n_out = len as u64;
        let store_cfg = grid_stride(n_out, 256);
        let mut launch = stream.launch_builder(&store);
        launch.arg(&mut sums).arg(out).arg(&n_out);
        // SAFETY: `sums` and `out` both hold n_out elements.
        unsafe { launch.launch(store_cfg) }.map_err(driver("launching store_f32"))?;
        Ok(())
    }
}

forward_gpu_mttkrp!(CooGpu, "coo");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::factors;
    use crate::{DeviceError, GpuMttkrp};
    use kruskal_cpu::{mttkrp_reference, relative_error};
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use ndarray::Array2;

    #[test]
    fn coo_atomic_equals_the_f64_reference() {
        let Some(gpu) = crate::testing::gpu_or_skip("coo_atomic_equals_the_f64_reference") else {
            return;
        };
        for (nmodes, exponent) in [(3, 1.1), (4, 0.8), (5, 1.3), (6, 0.5)] {
            let dims: Vec<u32> = (0..nmodes).map(|m| 50 + 37 * m as u32).collect();
            let mut spec = PowerLawSpec::new(dims, 30_000)
                .with_draws()
                .with_seed(nmodes as u64);
            spec.exponents = vec![exponent; nmodes];
            let t = power_law(&spec).unwrap();
            let mut engine = CooGpu::new(gpu.clone(), &t).unwrap();
            for rank in [1, 7, 16, 32, 64, 100] {
                let f = factors(t.dims(), rank, rank as u64);
                let views: Vec<_> = f.iter().map(|a| a.view()).collect();
                for mode in 0..nmodes {
                    let mut out = Array2::from_elem((t.dims()[mode] as usize, rank), f32::NAN);
                    engine.mttkrp_host(mode, &f, &mut out).unwrap();
                    let exact = mttkrp_reference(&t, &views, mode).unwrap();
                    let err = relative_error(out.view(), exact.view());
                    assert!(err < 1e-5, "{nmodes} modes rank {rank} mode {mode}: {err}");
                }
            }
        }
    }

    #[test]
    fn no_gpu_is_an_error_not_a_panic() {
        // On a machine with a GPU this opens it; without one it must be a
        // typed error (the program adds advice that fits the command).
        match Gpu::open(0) {
            Ok(gpu) => assert!(gpu.properties().sms > 0),
            Err(e) => assert!(e.to_string().contains("CUDA"), "{e}"),
        }
        assert!(matches!(
            Gpu::open(usize::MAX),
            Err(DeviceError::NoDevice { .. } | DeviceError::MissingLibrary { .. })
        ));
    }
}
