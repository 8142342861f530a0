//! The dense steps of CPD-ALS on the device (`kernels/dense.cu`): the
//! factor update `A = M W` with its column statistics, the column scaling
//! and the Gram matrix `A^T A`.
//!
//! Only R x R matrices and length-R vectors cross to the host: `W` goes up,
//! the statistics and the Gram come back (each step ends with one small
//! download, which is also its only synchronization). Every sum is f64 and
//! reduced in a fixed order, so results are bit-identical run to run.
//!
//! Why not cuBLAS: cuBLAS has no GEMM with f32 inputs and f64 sums, and an
//! f32 Gram summed over millions of rows loses digits (a running f32 sum
//! stops growing once its terms fall below half an ulp). The update and the
//! Gram are also fused with the column statistics and the scaling, so the
//! dense part of a mode reads and writes each factor twice (four passes),
//! where GEMM + statistics + scaling + Gram would take seven.
//!
//! At ranks 8, 16, 24 and 32 on sm_80 and later, the products of the update
//! and of the Gram run on the f64 tensor cores (`mma.m8n8k4`), elsewhere
//! on the FMA units. On an H200 at rank 32 (3M rows) that took the update
//! from 740 to 387 us and the scaling with the Gram from 595 to 218 us.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use crate::kernels::Kernel;
use crate::{DeviceError, Gpu, Result, driver, grid_stride};

/// The largest rank the dense kernels take (one thread per column of a
/// 256-thread block).
pub const MAX_RANK: usize = 256;

/// Threads per block of every dense kernel (`THREADS` in `dense.cu`).
const THREADS: u32 = 256;

/// Rank padded to a multiple of 4 (`KP`).
fn padded(rank: usize) -> usize {
    rank.div_ceil(4) * 4
}

/// Rows per tile of `cpd_update` (`UTILE`: row slots x rows per thread,
/// as many rows as 1536 staged doubles hold, 1 to 8).
fn update_tile(rank: usize) -> usize {
    let slots = (THREADS as usize / rank).max(1);
    slots * (1536 / (slots * padded(rank))).clamp(1, 8)
}

/// Rows per tile of `cpd_scale_gram` (`GTILE`).
fn gram_tile(rank: usize) -> usize {
    2048 / padded(rank)
}

/// Groups of `THREADS` sub-block pairs of the Gram (`blockIdx.y` extent).
fn gram_groups(rank: usize) -> usize {
    let nb = padded(rank) / 4;
    (nb * (nb + 1) / 2).div_ceil(THREADS as usize)
}

/// The defines of the dense kernels at `rank`.
fn defines(rank: usize) -> Vec<(&'static str, i64)> {
    vec![("RANK", rank as i64)]
}

/// `cpd_reduce` of the first `parts` rows of `partials` (`width` doubles
/// each; columns `max.0..max.1` by maximum, the others summed, parts in
/// order) into `reduced`, downloaded. `reduced` holds at least `width`
/// doubles. Synchronizes the stream (the download).
pub(crate) fn reduce_partials(
    gpu: &Gpu,
    rank: usize,
    partials: &CudaSlice<f64>,
    parts: u32,
    width: usize,
    max: (usize, usize),
    reduced: &mut CudaSlice<f64>,
) -> Result<Vec<f64>> {
    if partials.len() < parts as usize * width || reduced.len() < width {
        return Err(DeviceError::Shape(format!(
            "{parts} partial rows of {width} doubles into {} and {}",
            partials.len(),
            reduced.len()
        )));
    }
    let f = gpu
        .kernels()
        .function(gpu.context(), Kernel::CpdReduce, &defines(rank))?;
    let stream = gpu.stream().clone();
    let (width_u, lo, hi) = (width as u32, max.0 as u32, max.1 as u32);
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(partials)
        .arg(&parts)
        .arg(&width_u)
        .arg(&lo)
        .arg(&hi)
        .arg(&mut *reduced);
    // SAFETY: `partials` holds at least `parts` rows of `width` doubles,
    // and `reduced` at least `width` (checked above).
    unsafe { launch.launch(grid_stride(width as u64, 8)) }
        .map_err(driver("launching cpd_reduce"))?;
    let mut all = stream
        .clone_dtoh(&*reduced)
        .map_err(driver("downloading the CPD sums"))?;
    all.truncate(width);
    Ok(all)
}

/// Errors unless the dense kernels take `rank`.
pub fn check_rank(rank: usize) -> Result<()> {
    if rank == 0 || rank > MAX_RANK {
        return Err(DeviceError::Shape(format!(
            "the GPU CPD kernels take ranks 1 to {MAX_RANK}, not {rank}"
        )));
    }
    Ok(())
}

/// Statistics of the columns of a freshly updated factor (f32 values as
/// stored), each of length `rank`.
#[derive(Clone, Debug, PartialEq)]
pub struct UpdateStats {
    /// Sum of squares.
    pub sumsq: Vec<f64>,
    /// Largest magnitude.
    pub max_abs: Vec<f64>,
    /// `sum_i M(i, r) A(i, r)`.
    pub inner: Vec<f64>,
}

/// Each column's sum of squares and its entry of largest magnitude, the
/// first such row's on a tie (0 for a column of zeros), f32 values as
/// stored: what arranging a model's columns needs.
#[derive(Clone, Debug, PartialEq)]
pub struct ColumnExtremes {
    pub sumsq: Vec<f64>,
    pub largest: Vec<f32>,
}

/// The dense kernels of one rank on one GPU, with their small buffers.
pub struct DenseKernels {
    gpu: Arc<Gpu>,
    rank: usize,
    /// `W`, rank x rank f64.
    w: CudaSlice<f64>,
    /// Column scales, rank f32.
    inv: CudaSlice<f32>,
    /// Per-block partials (the larger of 3 x rank and rank^2 per block).
    partials: CudaSlice<f64>,
    /// The reduced result.
    reduced: CudaSlice<f64>,
    /// Blocks of `cpd_update` and `cpd_scale_gram` that fit on the GPU at
    /// once (one full wave: every block walks the same number of tiles).
    wave: [usize; 2],
}

impl DenseKernels {
    /// Allocates the buffers for `rank` (1 to [`MAX_RANK`]).
    pub fn new(gpu: Arc<Gpu>, rank: usize) -> Result<Self> {
        check_rank(rank)?;
        let defines = defines(rank);
        let sms = gpu.properties().sms.max(1);
        let mut wave = [0; 2];
        for (slot, kernel) in wave
            .iter_mut()
            .zip([Kernel::CpdUpdate, Kernel::CpdScaleGram])
        {
            let f = gpu.kernels().function(gpu.context(), kernel, &defines)?;
            let name = kernel.name();
            let per_sm = f
                .occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)
                .map_err(driver(format!("reading the occupancy of {name}")))?;
            *slot = sms * (per_sm as usize).max(1);
        }
        let width = (3 * rank).max(rank * rank);
        let max_blocks = wave[0].max(wave[1]);
        Ok(DenseKernels {
            w: gpu.alloc_zeros("the CPD solve matrix", rank * rank)?,
            inv: gpu.alloc_zeros("the CPD column scales", rank)?,
            partials: gpu.alloc_zeros("the CPD partial sums", max_blocks * width)?,
            reduced: gpu.alloc_zeros("the CPD sums", width)?,
            gpu,
            rank,
            wave,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    fn defines(&self) -> Vec<(&'static str, i64)> {
        defines(self.rank)
    }

    /// Blocks for `rows` in tiles of `tile`: at most one wave.
    fn blocks(&self, rows: usize, tile: usize, wave: usize) -> u32 {
        rows.div_ceil(tile).clamp(1, wave) as u32
    }

    fn check(&self, what: &str, len: usize, rows: usize) -> Result<()> {
        if len != rows * self.rank {
            return Err(DeviceError::Shape(format!(
                "{what} holds {len} floats, {rows} rows of rank {} need {}",
                self.rank,
                rows * self.rank
            )));
        }
        Ok(())
    }

    /// Sums the first `parts` partial rows (`width` wide; columns
    /// `max_lo..max_hi` by maximum) and downloads the result.
    fn reduce(&mut self, parts: u32, width: usize, max: (usize, usize)) -> Result<Vec<f64>> {
        reduce_partials(
            &self.gpu,
            self.rank,
            &self.partials,
            parts,
            width,
            max,
            &mut self.reduced,
        )
    }

    /// `a = m w` (`m`, `a`: `rows x rank`; `w`: rank x rank, row-major,
    /// f64), with the new columns' statistics. Synchronizes the stream.
    pub fn update(
        &mut self,
        m: &CudaView<f32>,
        w: &[f64],
        a: &mut CudaViewMut<f32>,
        rows: usize,
    ) -> Result<UpdateStats> {
        let r = self.rank;
        // The output may hold more rows than are updated (a GPU group's
        // empty rows at its end); the update reads the first `rows`.
        if m.len() < rows * r {
            self.check("the MTTKRP output", m.len(), rows)?;
        }
        self.check("the factor", a.len(), rows)?;
        if w.len() != r * r {
            return Err(DeviceError::Shape(format!(
                "W has {} entries, rank {r} needs {}",
                w.len(),
                r * r
            )));
        }
        let stream = self.gpu.stream().clone();
        stream
            .memcpy_htod(w, &mut self.w)
            .map_err(driver("uploading W"))?;
        let f =
            self.gpu
                .kernels()
                .function(self.gpu.context(), Kernel::CpdUpdate, &self.defines())?;
        let blocks = self.blocks(rows, update_tile(r), self.wave[0]);
        let rows_u = rows as u64;
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(m)
            .arg(&self.w)
            .arg(a)
            .arg(&rows_u)
            .arg(&mut self.partials);
        // SAFETY: `m` and `a` hold rows x rank floats (checked above) and
        // the kernel touches rows below `rows` only; `w` holds rank^2
        // doubles; block b writes partial row b < blocks <= wave[0], and
        // `partials` holds that many rows of at least 3 x rank doubles.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(driver("launching cpd_update"))?;
        let all = self.reduce(blocks, 3 * r, (r, 2 * r))?;
        Ok(UpdateStats {
            sumsq: all[..r].to_vec(),
            max_abs: all[r..2 * r].to_vec(),
            inner: all[2 * r..].to_vec(),
        })
    }

    /// The column statistics of `a` (`rows x rank`): kernel
    /// `cpd_column_stats`, then the blocks' partials combined on the host
    /// in block order. Synchronizes the stream.
    pub fn column_extremes(&mut self, a: &CudaView<f32>, rows: usize) -> Result<ColumnExtremes> {
        let r = self.rank;
        self.check("the factor", a.len(), rows)?;
        let stream = self.gpu.stream().clone();
        let f = self.gpu.kernels().function(
            self.gpu.context(),
            Kernel::CpdColumnStats,
            &self.defines(),
        )?;
        let slots = (THREADS as usize / r).max(1);
        let blocks = self.blocks(rows, slots, self.wave[0]);
        let rows_u = rows as u64;
        let mut launch = stream.launch_builder(&f);
        launch.arg(a).arg(&rows_u).arg(&mut self.partials);
        // SAFETY: `a` holds rows x rank floats (checked) and the kernel
        // reads rows below `rows` only; block b writes partial row b <
        // blocks <= wave[0] of 3 x rank doubles, and `partials` holds that
        // many rows of at least 3 x rank doubles.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(driver("launching cpd_column_stats"))?;
        let parts = stream
            .clone_dtoh(&self.partials.slice(..blocks as usize * 3 * r))
            .map_err(driver("downloading the column statistics"))?;
        let mut out = ColumnExtremes {
            sumsq: vec![0.0; r],
            largest: vec![0.0; r],
        };
        let mut at = vec![f64::INFINITY; r];
        for part in parts.chunks_exact(3 * r) {
            for j in 0..r {
                out.sumsq[j] += part[j];
                let (x, row) = (part[r + j] as f32, part[2 * r + j]);
                let big = out.largest[j].abs();
                if x.abs() > big || (x.abs() == big && row < at[j]) {
                    out.largest[j] = x;
                    at[j] = row;
                }
            }
        }
        Ok(out)
    }

    /// Scales column j of `a` (`rows x rank`) by `inv[j]`: queued on the
    /// GPU's stream, which it does not wait for.
    pub fn scale(&mut self, a: &mut CudaViewMut<f32>, inv: &[f32], rows: usize) -> Result<()> {
        let r = self.rank;
        self.check("the factor", a.len(), rows)?;
        if inv.len() != r {
            return Err(DeviceError::Shape(format!(
                "{} column scales for rank {r}",
                inv.len()
            )));
        }
        let stream = self.gpu.stream().clone();
        stream
            .memcpy_htod(inv, &mut self.inv)
            .map_err(driver("uploading the column scales"))?;
        let f =
            self.gpu
                .kernels()
                .function(self.gpu.context(), Kernel::CpdScale, &self.defines())?;
        let n = (rows * r) as u64;
        let mut launch = stream.launch_builder(&f);
        launch.arg(&mut *a).arg(&self.inv).arg(&n);
        // SAFETY: `a` holds n floats (checked) and `inv` rank floats; the
        // kernel reads inv[e % RANK] only.
        unsafe { launch.launch(grid_stride(n, 256)) }.map_err(driver("launching cpd_scale"))?;
        Ok(())
    }

    /// Scales column j of `a` (`rows x rank`) by `inv[j]` when given, and
    /// returns `a^T a` (rank x rank, row-major, f64) of the result.
    /// Synchronizes the stream.
    pub fn scale_gram(
        &mut self,
        a: &mut CudaViewMut<f32>,
        inv: Option<&[f32]>,
        rows: usize,
    ) -> Result<Vec<f64>> {
        let r = self.rank;
        self.check("the factor", a.len(), rows)?;
        let stream = self.gpu.stream().clone();
        let groups = gram_groups(r);
        let mut fused_scale = false;
        if let Some(inv) = inv {
            if inv.len() != r {
                return Err(DeviceError::Shape(format!(
                    "{} column scales for rank {r}",
                    inv.len()
                )));
            }
            if groups == 1 {
                stream
                    .memcpy_htod(inv, &mut self.inv)
                    .map_err(driver("uploading the column scales"))?;
                fused_scale = true;
            } else {
                // Blocks of different blockIdx.y read the same rows: scale
                // first, in a pass of its own.
                self.scale(a, inv, rows)?;
            }
        }
        let f = self.gpu.kernels().function(
            self.gpu.context(),
            Kernel::CpdScaleGram,
            &self.defines(),
        )?;
        let blocks = self.blocks(rows, gram_tile(r), self.wave[1]);
        let rows_u = rows as u64;
        let null: u64 = 0;
        let mut launch = stream.launch_builder(&f);
        launch.arg(&mut *a);
        if fused_scale {
            launch.arg(&self.inv);
        } else {
            launch.arg(&null);
        }
        launch.arg(&rows_u).arg(&mut self.partials);
        // SAFETY: `a` holds rows x rank floats (checked) and the kernel
        // touches rows below `rows` only; `inv` is rank floats or a null
        // pointer (then the kernel does not scale); block (b, y) writes
        // entries of partial row b < blocks <= wave[1], and `partials`
        // holds that many rows of at least rank^2 doubles. With more than
        // one y group `inv` is null (scaled above), so no block reads rows
        // another block is rewriting.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (blocks, groups as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(driver("launching cpd_scale_gram"))?;
        self.reduce(blocks, r * r, (0, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::factors;
    use ndarray::Array2;

    #[test]
    fn launch_shapes_mirror_the_kernel() {
        // 8 slots x 6 rows; 256 slots x 1 row; 1 slot x 6 rows.
        assert_eq!(update_tile(32), 48);
        assert_eq!(update_tile(1), 256);
        assert_eq!(update_tile(256), 6);
        assert_eq!(gram_tile(32), 64);
        assert_eq!(gram_tile(7), 256);
        // 22 sub-blocks per side: 253 pairs fit one group; 23 do not.
        assert_eq!(gram_groups(88), 1);
        assert_eq!(gram_groups(92), 2);
        assert_eq!(gram_groups(256), 9);
    }

    /// The f64 host reference of `update` and `scale_gram`.
    fn reference(
        m: &Array2<f32>,
        w: &Array2<f64>,
        inv: &[f32],
    ) -> (Array2<f32>, UpdateStats, Array2<f64>) {
        let a = m.mapv(f64::from).dot(w).mapv(|x| x as f32);
        let r = w.nrows();
        let col = |j: usize| a.column(j).to_owned();
        let stats = UpdateStats {
            sumsq: (0..r)
                .map(|j| col(j).iter().map(|&x| f64::from(x).powi(2)).sum())
                .collect(),
            max_abs: (0..r)
                .map(|j| col(j).iter().fold(0f64, |s, &x| s.max(f64::from(x.abs()))))
                .collect(),
            inner: (0..r)
                .map(|j| {
                    m.column(j)
                        .iter()
                        .zip(col(j).iter())
                        .map(|(&x, &y)| f64::from(x) * f64::from(y))
                        .sum()
                })
                .collect(),
        };
        let scaled = Array2::from_shape_fn(a.dim(), |(i, j)| a[[i, j]] * inv[j]);
        let s64 = scaled.mapv(f64::from);
        let gram = s64.t().dot(&s64);
        (scaled, stats, gram)
    }

    fn close(a: &[f64], b: &[f64], tol: f64, what: &str) {
        let scale = b.iter().fold(0f64, |s, x| s.max(x.abs())).max(1e-300);
        for (k, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol * scale, "{what}[{k}]: {x} vs {y}");
        }
    }

    #[test]
    fn update_and_gram_equal_the_f64_reference() {
        let Some(gpu) = crate::testing::gpu_or_skip("update_and_gram_equal_the_f64_reference")
        else {
            return;
        };
        // Row counts around the tile sizes, and one spanning many blocks.
        // 8, 16, 24 and 32 take the tensor-core kernels on sm_80 and later.
        for rank in [1usize, 2, 3, 7, 8, 16, 24, 32, 64, 100, 128, 256] {
            let mut dense = DenseKernels::new(gpu.clone(), rank).unwrap();
            for rows in [1usize, 63, 64, 65, 1000, 70_001] {
                let m = factors(&[rows as u32], rank, (rank * 31 + rows) as u64).remove(0);
                let w = Array2::from_shape_fn((rank, rank), |(i, j)| {
                    if i == j {
                        2.0
                    } else {
                        ((i * 7 + j * 3) % 11) as f64 / 11.0 - 0.5
                    }
                });
                let inv: Vec<f32> = (0..rank).map(|j| 1.0 / (1.0 + j as f32)).collect();
                let (scaled, stats, gram) = reference(&m, &w, &inv);
                let d_m = gpu.upload("m", m.as_slice().unwrap()).unwrap();
                let mut d_a = gpu.upload("a", &vec![f32::NAN; rows * rank]).unwrap();
                let what = format!("rank {rank}, {rows} rows");
                let got = dense
                    .update(
                        &d_m.as_view(),
                        w.as_slice().unwrap(),
                        &mut d_a.slice_mut(..),
                        rows,
                    )
                    .unwrap();
                // The f64 sums of M W may round to a neighbouring f32 in
                // rare entries (a different summation order), so allow a
                // few ulps of f32 everywhere.
                close(&got.sumsq, &stats.sumsq, 1e-6, &format!("{what} sumsq"));
                close(&got.max_abs, &stats.max_abs, 1e-6, &format!("{what} max"));
                close(&got.inner, &stats.inner, 1e-6, &format!("{what} inner"));
                let g = dense
                    .scale_gram(&mut d_a.slice_mut(..), Some(&inv), rows)
                    .unwrap();
                close(&g, gram.as_slice().unwrap(), 1e-6, &format!("{what} gram"));
                let a: Vec<f64> = gpu
                    .stream()
                    .clone_dtoh(&d_a)
                    .unwrap()
                    .into_iter()
                    .map(f64::from)
                    .collect();
                let expect: Vec<f64> = scaled.iter().map(|&x| f64::from(x)).collect();
                close(&a, &expect, 1e-6, &format!("{what} scaled factor"));
                // Without scales: the Gram only, the factor unchanged.
                let g2 = dense
                    .scale_gram(&mut d_a.slice_mut(..), None, rows)
                    .unwrap();
                assert_eq!(g, g2, "{what}: Gram without scaling");
                // Bit-identical when repeated.
                let again = dense
                    .update(
                        &d_m.as_view(),
                        w.as_slice().unwrap(),
                        &mut d_a.slice_mut(..),
                        rows,
                    )
                    .unwrap();
                assert_eq!(got, again, "{what}: repeat");
                // The scaling alone, on the rows as the update wrote them.
                dense.scale(&mut d_a.slice_mut(..), &inv, rows).unwrap();
                let a: Vec<f64> = gpu
                    .stream()
                    .clone_dtoh(&d_a)
                    .unwrap()
                    .into_iter()
                    .map(f64::from)
                    .collect();
                close(&a, &expect, 1e-6, &format!("{what} scaled alone"));
            }
        }
    }

    #[test]
    fn ranks_outside_the_kernels_are_refused() {
        assert!(check_rank(1).is_ok() && check_rank(MAX_RANK).is_ok());
        for bad in [0, MAX_RANK + 1] {
            let e = check_rank(bad).unwrap_err().to_string();
            assert!(e.contains("ranks 1 to 256"), "{e}");
        }
    }
}
