//! The `flycoo` engine: FLYCOO on the GPU, one thread block per LPT
//! partition, dynamic remap into the next mode's order in the same pass
//! (kernel `mttkrp_flycoo` in `kernels/mttkrp_flycoo.cu`).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use kruskal_formats::flycoo::Flycoo;

use crate::coo::{DeviceFactors, check_operands};
use crate::{DeviceError, Gpu, GpuMttkrp, Result, driver};

/// Warps per thread block (the paper's P).
pub const WARPS: u32 = 8;
/// Largest rank the kernel's shared-memory edge buffers hold.
pub const MAX_RANK: usize = 256;

/// One mode's partition tables on the device.
struct ModeTables {
    kappa: u32,
    part_ptr: CudaSlice<u64>,
    /// Rows split across partitions, per partition (CSR by partition).
    shared_rows: CudaSlice<u32>,
    shared_ptr: CudaSlice<u64>,
}

/// FLYCOO on one GPU: two copies of the elements (ping-pong).
pub struct FlycooGpu {
    gpu: Arc<Gpu>,
    dims: Vec<u32>,
    nnz: usize,
    copies: [CudaSlice<u32>; 2],
    current: usize,
    at: usize,
    modes: Vec<ModeTables>,
    deterministic: bool,
}

impl FlycooGpu {
    /// Bytes the engine needs on the device for `f`.
    pub fn device_bytes(f: &Flycoo) -> usize {
        2 * f.elements().len() * 4
            + f.modes()
                .iter()
                .map(|m| m.part_ptr.len() * 8 * 2)
                .sum::<usize>()
    }

    /// Uploads `f` (checked against free memory first).
    pub fn new(gpu: Arc<Gpu>, f: &Flycoo) -> Result<Self> {
        let n = f.nmodes();
        if Flycoo::words_per_element(n) > 32 {
            return Err(DeviceError::Shape(format!(
                "the flycoo kernel handles up to 15 modes, not {n}"
            )));
        }
        gpu.ensure_free("two FLYCOO copies", Self::device_bytes(f))?;
        let stream = gpu.stream().clone();
        let first = stream
            .clone_htod(f.elements())
            .map_err(driver("uploading FLYCOO"))?;
        let second = stream
            .alloc_zeros::<u32>(f.elements().len().max(1))
            .map_err(driver("allocating the second FLYCOO copy"))?;
        let mut modes = Vec::with_capacity(n);
        for m in f.modes() {
            let kappa = m.kappa();
            let mut per_part: Vec<Vec<u32>> = vec![Vec::new(); kappa];
            for s in &m.shared {
                per_part[s.part as usize].push(s.row);
            }
            let mut rows = Vec::new();
            let mut ptr = vec![0u64];
            for list in per_part {
                rows.extend(list);
                ptr.push(rows.len() as u64);
            }
            // The driver refuses empty allocations; the pad is never read.
            rows.push(u32::MAX);
            modes.push(ModeTables {
                kappa: u32::try_from(kappa)
                    .map_err(|_| DeviceError::Shape(format!("{kappa} partitions")))?,
                part_ptr: stream
                    .clone_htod(&m.part_ptr)
                    .map_err(driver("uploading partitions"))?,
                shared_rows: stream
                    .clone_htod(&rows)
                    .map_err(driver("uploading shared rows"))?,
                shared_ptr: stream
                    .clone_htod(&ptr)
                    .map_err(driver("uploading shared rows"))?,
            });
        }
        Ok(FlycooGpu {
            gpu,
            dims: f.dims().to_vec(),
            nnz: f.nnz(),
            copies: [first, second],
            current: 0,
            at: 0,
            modes,
            deterministic: false,
        })
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// With `on`, pieces of split rows are summed through a scratch buffer
    /// in a fixed order instead of by atomics: bit-identical results run
    /// to run.
    pub fn set_deterministic(&mut self, on: bool) {
        self.deterministic = on;
    }

    pub fn deterministic(&self) -> bool {
        self.deterministic
    }

    /// The mode whose layout the current copy is in.
    pub fn current_mode(&self) -> usize {
        self.at
    }

    /// The current copy's elements, downloaded.
    pub fn current_elements(&self) -> Result<Vec<u32>> {
        self.gpu
            .stream()
            .clone_dtoh(&self.copies[self.current])
            .map_err(driver("downloading FLYCOO"))
    }

    /// Moves every element to its position in `mode`'s layout.
    fn remap_to(&mut self, mode: usize) -> Result<()> {
        let n = self.dims.len();
        let f = self.gpu.kernels().function(
            self.gpu.context(),
            "mttkrp_flycoo.cu",
            "flycoo_remap",
            &[
                ("NMODES", n as i64),
                ("RANK", 1),
                ("WARPS", i64::from(WARPS)),
            ],
        )?;
        let gpu = self.gpu.clone();
        let stream = gpu.stream().clone();
        let nnz = self.nnz as u64;
        let mode_i = mode as i32;
        let blocks = nnz.div_ceil(8).clamp(1, gpu.properties().sms as u64 * 64) as u32;
        let [a, b] = &mut self.copies;
        let (src, dst) = if self.current == 0 {
            (&*a, b)
        } else {
            (&*b, a)
        };
        let mut launch = stream.launch_builder(&f);
        launch.arg(src).arg(dst).arg(&nnz).arg(&mode_i);
        // SAFETY: both copies hold nnz * (2N + 1) words; every remap id is
        // below nnz (checked when the Flycoo was built), so writes stay
        // inside `dst`.
        if nnz > 0 {
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(driver("launching flycoo_remap"))?;
        }
        self.current = 1 - self.current;
        self.at = mode;
        Ok(())
    }

    /// `out = MTTKRP(mode)`, and the tensor copy moves to the next mode's
    /// order. Asynchronous on the GPU's stream.
    pub fn mttkrp(
        &mut self,
        mode: usize,
        factors: &DeviceFactors,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let n = self.dims.len();
        let rank = check_operands(&self.dims, mode, factors, out.len())?;
        if rank > MAX_RANK {
            return Err(DeviceError::Shape(format!(
                "the flycoo kernel handles ranks up to {MAX_RANK}, not {rank}"
            )));
        }
        if self.at != mode {
            self.remap_to(mode)?;
        }
        let f = self.gpu.kernels().function(
            self.gpu.context(),
            "mttkrp_flycoo.cu",
            "mttkrp_flycoo",
            &[
                ("NMODES", n as i64),
                ("RANK", rank as i64),
                ("WARPS", i64::from(WARPS)),
            ],
        )?;
        let gpu = self.gpu.clone();
        let stream = gpu.stream().clone();
        stream
            .memset_zeros(out)
            .map_err(driver("zeroing the output"))?;
        let next = ((mode + 1) % n) as i32;
        let mode_i = mode as i32;
        let kappa = self.modes[mode].kappa;
        // Borrow the tables and the copies separately.
        let [a, b] = &mut self.copies;
        let (src, dst) = if self.current == 0 {
            (&*a, b)
        } else {
            (&*b, a)
        };
        let t = &self.modes[mode];
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(src)
            .arg(dst)
            .arg(&t.part_ptr)
            .arg(&t.shared_rows)
            .arg(&t.shared_ptr)
            .arg(&factors.data)
            .arg(&factors.row_offset)
            .arg(out)
            .arg(&mode_i)
            .arg(&next);
        // SAFETY: the grid has one block per partition (kappa = part_ptr.len()
        // - 1); partition ranges lie in 0..nnz and shared_ptr indexes
        // shared_rows (both built above from a validated Flycoo); remap ids
        // are a permutation of 0..nnz, so element writes stay in `dst`;
        // indices are below their dimensions, so factor rows lie in `data`
        // and output rows in `out` (length checked above); the shared
        // buffers hold 2 * WARPS * RANK doubles with RANK <= MAX_RANK.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (kappa.max(1), 1, 1),
                block_dim: (32, WARPS, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(driver("launching mttkrp_flycoo"))?;
        self.current = 1 - self.current;
        self.at = next as usize;
        Ok(())
    }
}

impl GpuMttkrp for FlycooGpu {
    fn name(&self) -> &'static str {
        "flycoo"
    }

    fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn dims(&self) -> &[u32] {
        &self.dims
    }

    fn mttkrp(
        &mut self,
        mode: usize,
        factors: &DeviceFactors,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        FlycooGpu::mttkrp(self, mode, factors, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::factors;
    use kruskal_cpu::{mttkrp_reference, relative_error};
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use kruskal_partition::flycoo::build_flycoo;
    use kruskal_partition::layout::LayoutOptions;
    use ndarray::Array2;

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn flycoo_equals_the_f64_reference_and_remaps_back() {
        let gpu = Gpu::open(0).expect("a GPU");
        for (nmodes, exponent, kappa) in [(3, 1.3, 7), (4, 0.8, 64), (5, 1.5, 33), (6, 0.5, 1)] {
            let dims: Vec<u32> = (0..nmodes).map(|m| 40 + 31 * m as u32).collect();
            let mut spec = PowerLawSpec::new(dims, 40_000).with_seed(nmodes as u64);
            spec.exponents = vec![exponent; nmodes];
            let t = power_law(&spec).unwrap();
            let (f, summaries) = build_flycoo(&t, &LayoutOptions::new(kappa)).unwrap();
            if kappa > 1 && exponent > 1.0 {
                assert!(
                    summaries.iter().any(|s| s.shared_pieces > 0),
                    "no shared rows"
                );
            }
            let mut engine = FlycooGpu::new(gpu.clone(), &f).unwrap();
            let original = engine.current_elements().unwrap();
            for rank in [1, 7, 16, 32, 64, 100] {
                let fs = factors(t.dims(), rank, rank as u64);
                let views: Vec<_> = fs.iter().map(|a| a.view()).collect();
                for mode in 0..nmodes {
                    let mut out = Array2::from_elem((t.dims()[mode] as usize, rank), f32::NAN);
                    engine.mttkrp_host(mode, &fs, &mut out).unwrap();
                    let exact = mttkrp_reference(&t, &views, mode).unwrap();
                    let err = relative_error(out.view(), exact.view());
                    assert!(
                        err < 1e-5,
                        "{nmodes} modes kappa {kappa} rank {rank} mode {mode}: {err}"
                    );
                }
                // After N modes the copy is back in its original order.
                assert_eq!(engine.current_mode(), 0);
                assert_eq!(engine.current_elements().unwrap(), original);
            }
            // Out of order: the engine remaps first.
            let fs = factors(t.dims(), 16, 3);
            let views: Vec<_> = fs.iter().map(|a| a.view()).collect();
            let mode = nmodes - 1;
            let mut out = Array2::from_elem((t.dims()[mode] as usize, 16), f32::NAN);
            engine.mttkrp_host(mode, &fs, &mut out).unwrap();
            let exact = mttkrp_reference(&t, &views, mode).unwrap();
            assert!(relative_error(out.view(), exact.view()) < 1e-5);
        }
    }
}
