//! The `flycoo` engine: FLYCOO on the GPU, one thread block per LPT
//! partition, dynamic remap into the next mode's order in the same pass
//! (kernel `mttkrp_flycoo` in `kernels/mttkrp_flycoo.cu`).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use kruskal_formats::flycoo::Flycoo;

use crate::factors::{DeviceFactors, check_operands};
use crate::kernels::Kernel;
use crate::{DeviceError, Gpu, Result, driver, grid_stride};

/// Warps per thread block (the paper's P).
pub const WARPS: u32 = 8;
/// Largest rank the kernel's shared-memory edge buffers hold.
pub const MAX_RANK: usize = 256;

/// Words from one element to the next on the device: `2N + 1` rounded up
/// to a multiple of 8, so that every remap write fills whole 32-byte
/// sectors. A partial sector costs the memory a read-modify-write; on the
/// H100 (2026-11-22, 20M nonzeros, rank 32) padding took the nell-2 shape
/// from 5.85 to 3.80 ms for all modes (7 to 8 words) and the enron shape
/// from 10.45 to 7.67 ms (9 to 16 words).
pub fn element_stride(nmodes: usize) -> usize {
    (2 * nmodes + 1).next_multiple_of(8)
}

/// One mode's partition tables on the device.
struct ModeTables {
    kappa: u32,
    part_ptr: CudaSlice<u64>,
    /// Rows split across partitions, per partition (CSR by partition); a
    /// piece's index in this list is its scratch slot.
    shared_rows: CudaSlice<u32>,
    shared_ptr: CudaSlice<u64>,
    /// Pieces in all partitions.
    pieces: usize,
    /// Deterministic combine: each split row once, and its pieces' slots
    /// in partition order (CSR by split row).
    split_rows: CudaSlice<u32>,
    split_count: usize,
    piece_ptr: CudaSlice<u64>,
    piece: CudaSlice<u32>,
}

impl ModeTables {
    fn upload(gpu: &Gpu, m: &kruskal_formats::flycoo::FlycooMode) -> Result<Self> {
        let kappa = m.kappa();
        let mut per_part: Vec<Vec<u32>> = vec![Vec::new(); kappa];
        for piece in &m.shared {
            per_part[piece.part as usize].push(piece.row);
        }
        // Slot of each (part, row) piece in the CSR-by-partition list.
        let mut rows = Vec::with_capacity(m.shared.len());
        let mut ptr = vec![0u64];
        let mut slots: Vec<(u32, u32, u32)> = Vec::with_capacity(m.shared.len());
        for (part, list) in per_part.into_iter().enumerate() {
            for row in list {
                slots.push((row, part as u32, rows.len() as u32));
                rows.push(row);
            }
            ptr.push(rows.len() as u64);
        }
        // Group the slots by row, partitions ascending: the fixed order in
        // which deterministic mode adds a row's pieces.
        slots.sort_unstable();
        let mut split_rows = Vec::new();
        let mut piece_ptr = vec![0u64];
        let mut piece = Vec::with_capacity(slots.len());
        for (k, &(row, _, slot)) in slots.iter().enumerate() {
            if k > 0 && slots[k - 1].0 != row {
                piece_ptr.push(piece.len() as u64);
            }
            if k == 0 || slots[k - 1].0 != row {
                split_rows.push(row);
            }
            piece.push(slot);
        }
        if !piece.is_empty() {
            piece_ptr.push(piece.len() as u64);
        }
        Ok(ModeTables {
            kappa: u32::try_from(kappa)
                .map_err(|_| DeviceError::Shape(format!("{kappa} partitions")))?,
            part_ptr: gpu.upload("FLYCOO partitions", &m.part_ptr)?,
            pieces: rows.len(),
            shared_rows: gpu.upload("FLYCOO shared rows", &rows)?,
            shared_ptr: gpu.upload("FLYCOO shared rows", &ptr)?,
            split_count: split_rows.len(),
            split_rows: gpu.upload("FLYCOO split rows", &split_rows)?,
            piece_ptr: gpu.upload("FLYCOO split rows", &piece_ptr)?,
            piece: gpu.upload("FLYCOO split rows", &piece)?,
        })
    }
}

/// FLYCOO on one GPU: two copies of the elements (ping-pong).
pub struct FlycooGpu {
    gpu: Arc<Gpu>,
    dims: Vec<u32>,
    nnz: usize,
    /// Words per element on the device (see [`element_stride`]).
    stride: usize,
    copies: [CudaSlice<u32>; 2],
    current: usize,
    at: usize,
    modes: Vec<ModeTables>,
    deterministic: bool,
    /// f64 partials of the pieces of split rows (deterministic mode),
    /// sized for the largest mode's pieces at the current rank.
    scratch: CudaSlice<f64>,
}

impl FlycooGpu {
    /// Bytes the engine needs on the device for `f` (the element copies
    /// and the partition tables).
    pub fn device_bytes(f: &Flycoo) -> usize {
        2 * f.nnz() * element_stride(f.nmodes()) * 4
            + f.modes()
                .iter()
                .map(|m| m.part_ptr.len() * 16 + m.shared.len() * 32)
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
        let words = Flycoo::words_per_element(n);
        let stride = element_stride(n);
        let first = if stride == words {
            gpu.upload("FLYCOO elements", f.elements())?
        } else {
            let mut padded = vec![0u32; f.nnz() * stride];
            for (to, from) in padded
                .chunks_exact_mut(stride)
                .zip(f.elements().chunks_exact(words))
            {
                to[..words].copy_from_slice(from);
            }
            gpu.upload("FLYCOO elements", &padded)?
        };
        let second = gpu.alloc_zeros::<u32>("the second FLYCOO copy", f.nnz() * stride)?;
        let modes = f
            .modes()
            .iter()
            .map(|m| ModeTables::upload(&gpu, m))
            .collect::<Result<Vec<_>>>()?;
        let scratch = gpu.alloc_zeros::<f64>("the FLYCOO scratch buffer", 1)?;
        Ok(FlycooGpu {
            gpu,
            dims: f.dims().to_vec(),
            nnz: f.nnz(),
            stride,
            copies: [first, second],
            current: 0,
            at: 0,
            modes,
            deterministic: false,
            scratch,
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
        let all = self
            .gpu
            .stream()
            .clone_dtoh(&self.copies[self.current])
            .map_err(driver("downloading FLYCOO"))?;
        let words = Flycoo::words_per_element(self.dims.len());
        Ok(all
            .chunks_exact(self.stride)
            .take(self.nnz)
            .flat_map(|e| &e[..words])
            .copied()
            .collect())
    }

    /// Moves every element to its position in `mode`'s layout.
    fn remap_to(&mut self, mode: usize) -> Result<()> {
        let n = self.dims.len();
        let f = self.gpu.kernels().function(
            self.gpu.context(),
            Kernel::FlycooRemap,
            &defines(n, 1, false),
        )?;
        let gpu = self.gpu.clone();
        let stream = gpu.stream().clone();
        let nnz = self.nnz as u64;
        let mode_i = mode as i32;
        let blocks = nnz.div_ceil(256).clamp(1, gpu.properties().sms as u64 * 16) as u32;
        let [a, b] = &mut self.copies;
        let (src, dst) = if self.current == 0 {
            (&*a, b)
        } else {
            (&*b, a)
        };
        let mut launch = stream.launch_builder(&f);
        launch.arg(src).arg(dst).arg(&nnz).arg(&mode_i);
        if nnz > 0 {
            // SAFETY: both copies hold nnz * stride words; every remap id
            // is below nnz (checked when the Flycoo was built), so writes
            // stay inside `dst`.
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
            Kernel::MttkrpFlycoo,
            &defines(n, rank, self.deterministic),
        )?;
        let gpu = self.gpu.clone();
        let stream = gpu.stream().clone();
        stream
            .memset_zeros(out)
            .map_err(driver("zeroing the output"))?;
        let next = ((mode + 1) % n) as i32;
        let mode_i = mode as i32;
        let kappa = self.modes[mode].kappa;
        let det = self.deterministic;
        let pieces = self.modes[mode].pieces;
        if det && self.scratch.len() < pieces * rank {
            let most = self.modes.iter().map(|m| m.pieces).max().unwrap_or(0);
            self.scratch = gpu.alloc_zeros::<f64>("the FLYCOO scratch buffer", most * rank)?;
        }
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
            .arg(&mut *out)
            .arg(&mut self.scratch)
            .arg(&mode_i)
            .arg(&next);
        // SAFETY: the grid has one block per partition (kappa = part_ptr.len()
        // - 1); partition ranges lie in 0..nnz and shared_ptr indexes
        // shared_rows (both built above from a validated Flycoo); remap ids
        // are a permutation of 0..nnz, so element writes stay in `dst`;
        // indices are below their dimensions, so factor rows lie in `data`
        // and output rows in `out` (length checked above); the shared
        // buffers hold 2 * WARPS * RANK doubles with RANK <= MAX_RANK; in
        // deterministic mode slots are below `pieces` and scratch holds
        // pieces * rank doubles (grown above).
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (kappa.max(1), 1, 1),
                block_dim: (32, WARPS, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(driver("launching mttkrp_flycoo"))?;
        if det && t.split_count > 0 {
            let combine = self.gpu.kernels().function(
                self.gpu.context(),
                Kernel::FlycooCombine,
                &defines(n, rank, true),
            )?;
            let rows = t.split_count as u64;
            let mut launch = stream.launch_builder(&combine);
            launch
                .arg(&self.scratch)
                .arg(&t.split_rows)
                .arg(&t.piece_ptr)
                .arg(&t.piece)
                .arg(out)
                .arg(&rows);
            // SAFETY: one warp per split row (k < rows = split_rows.len());
            // piece_ptr has rows + 1 entries indexing `piece`, whose slots
            // are below `pieces` (scratch holds pieces * rank doubles);
            // split rows are rows of this mode, inside `out`.
            unsafe { launch.launch(grid_stride(rows, 8)) }
                .map_err(driver("launching flycoo_combine"))?;
        }
        self.current = 1 - self.current;
        self.at = next as usize;
        Ok(())
    }
}

/// The defines of the flycoo kernels.
fn defines(nmodes: usize, rank: usize, deterministic: bool) -> Vec<(&'static str, i64)> {
    let mut d = vec![
        ("NMODES", nmodes as i64),
        ("RANK", rank as i64),
        ("WARPS", i64::from(WARPS)),
        ("STRIDE", element_stride(nmodes) as i64),
    ];
    if deterministic {
        d.push(("DETERMINISTIC", 1));
    }
    d
}

forward_gpu_mttkrp!(FlycooGpu, "flycoo");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GpuMttkrp;
    use crate::testutil::factors;
    use kruskal_cpu::{mttkrp_reference, relative_error};
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use kruskal_partition::flycoo::build_flycoo;
    use kruskal_partition::layout::LayoutOptions;
    use ndarray::Array2;

    #[test]
    fn flycoo_equals_the_f64_reference_and_remaps_back() {
        let Some(gpu) =
            crate::testing::gpu_or_skip("flycoo_equals_the_f64_reference_and_remaps_back")
        else {
            return;
        };
        for (nmodes, exponent, kappa) in [(3, 1.3, 7), (4, 0.8, 64), (5, 1.5, 33), (6, 0.5, 1)] {
            let dims: Vec<u32> = (0..nmodes).map(|m| 40 + 31 * m as u32).collect();
            let mut spec = PowerLawSpec::new(dims, 40_000)
                .with_draws()
                .with_seed(nmodes as u64);
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

            // Deterministic: two sweeps give the same bits, and the same
            // accuracy.
            engine.set_deterministic(true);
            for rank in [7, 32, 100] {
                let fs = factors(t.dims(), rank, 11);
                let views: Vec<_> = fs.iter().map(|a| a.view()).collect();
                for mode in 0..nmodes {
                    let mut first = Array2::from_elem((t.dims()[mode] as usize, rank), f32::NAN);
                    let mut second = first.clone();
                    engine.mttkrp_host(mode, &fs, &mut first).unwrap();
                    // Back to `mode` (the engine remaps when asked out of order).
                    engine.mttkrp_host(mode, &fs, &mut second).unwrap();
                    let bits = |a: &Array2<f32>| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&first),
                        bits(&second),
                        "{nmodes} modes rank {rank} mode {mode}"
                    );
                    let exact = mttkrp_reference(&t, &views, mode).unwrap();
                    assert!(relative_error(first.view(), exact.view()) < 1e-5);
                }
            }
        }
    }
}
