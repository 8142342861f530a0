//! AO-ADMM's inner loop on the device (`kernels/admm.cu`): for one mode,
//! the ADMM iterations of the factor H and its scaled dual U run row by
//! row, each row to its own stopping rule (the blocked variant of Smith,
//! Beri and Karypis, ICPP 2017, with blocks of [`BLOCK_ROWS`] = one row).
//! One launch runs every row's whole inner loop: a warp runs several rows
//! at once (8 on the tensor cores), keeps their MTTKRP, H and U in
//! registers across the inner iterations, and when a row stops writes it
//! back and takes the next row of its range.
//!
//! The CPU runs the same variant when asked
//! (`kruskal_cpd::InnerStop::RowBlocks`), so the two can be compared.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use crate::kernels::Kernel;
use crate::{DeviceError, Gpu, Result, driver, grid_stride};

/// Rows of one ADMM block: the unit that stops on its own, on the GPU and
/// in the CPU's blocked variant alike. One: every row runs to its own
/// rule. (Blocks of 32, then 8 rows: a block's rows all ran as long as
/// its slowest; on nell-1's shape at rank 32 single rows take a quarter
/// fewer row-iterations than blocks of 8, at a slightly higher fit, see
/// docs/performance.md. The GPU still runs 8 rows per warp, each to its
/// own rule.)
pub const BLOCK_ROWS: usize = 1;

/// The largest rank the inner loop takes (the scalar path's static shared
/// memory: 8 warps' staged rows and column sums, 33 KB at rank 128, under
/// the 48 KB a kernel may declare).
pub const MAX_RANK: usize = 128;

/// Threads per block of `admm_blocks`' scalar path (`THREADS` in
/// `admm.cu`).
const THREADS: u32 = 256;

/// Threads per block of its tensor-core path (`WARPS` warps of
/// `admm.cu`'s `ADMM_MMA`, each running its own rows).
const MMA_THREADS: u32 = 64;

/// The threads per block `admm_blocks` is compiled for at `rank` on a GPU
/// of compute capability `cc`: the tensor-core path's (sm_80 and later,
/// ranks 8, 16 and 32; `ADMM_MMA` in `admm.cu`) or the scalar path's.
fn launch_threads(rank: usize, cc: (i32, i32)) -> u32 {
    if cc.0 >= 8 && matches!(rank, 8 | 16 | 32) {
        MMA_THREADS
    } else {
        THREADS
    }
}

/// Rows one warp of `admm_blocks` runs at once: 8 on the tensor-core
/// path, else one per slot of lanes (the power of two at or above the
/// rank, at most 32; `SLOTS` in `admm.cu`).
fn rows_per_warp(rank: usize, threads: u32) -> usize {
    if threads == MMA_THREADS {
        8
    } else {
        32 / rank.next_power_of_two().min(32)
    }
}

/// Waves of thread blocks one launch of `admm_blocks` takes at most: the
/// rows stop after different numbers of iterations, and thread blocks
/// that start as others finish even out what each SM runs.
const WAVES: usize = 4;

/// The defines of `admm.cu` at `rank`.
fn defines(rank: usize) -> Vec<(&'static str, i64)> {
    vec![("RANK", rank as i64)]
}

/// Errors unless the inner loop takes `rank`.
pub fn check_rank(rank: usize) -> Result<()> {
    if rank == 0 || rank > MAX_RANK {
        return Err(DeviceError::Shape(format!(
            "constrained CP (AO-ADMM) on the GPU takes ranks 1 to {MAX_RANK}, not {rank}"
        )));
    }
    Ok(())
}

/// One mode's inner loop: its proximal step at `rho` and its stopping
/// rule (see `kruskal_cpd::admm`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InnerParams {
    pub rho: f64,
    /// The mode is kept non-negative.
    pub nonneg: bool,
    /// `l1 / rho`.
    pub threshold: f64,
    /// `1 / (1 + 2 l2 / rho)`.
    pub shrink: f64,
    /// Inner iterations at most (at least 1).
    pub max_inner: u32,
    /// Bound on both relative residuals.
    pub eps: f64,
}

/// What the inner loop leaves, per column of the f32 rounding of the new
/// H (each of length `rank`), and how long it ran.
#[derive(Clone, Debug, PartialEq)]
pub struct InnerStats {
    /// Sum of squares.
    pub sumsq: Vec<f64>,
    /// `sum_i K(i, r) H(i, r)`.
    pub inner: Vec<f64>,
    /// Largest magnitude.
    pub max_abs: Vec<f64>,
    /// Inner iterations of the row that ran most.
    pub iters: usize,
}

impl InnerStats {
    /// The statistics of no rows at `rank`: zeros, no iteration.
    pub fn empty(rank: usize) -> Self {
        InnerStats {
            sumsq: vec![0.0; rank],
            inner: vec![0.0; rank],
            max_abs: vec![0.0; rank],
            iters: 0,
        }
    }
}

/// The rows of a mode the inner loop runs on (see `admm.cu`): row numbers
/// in increasing order below a bound (the mode's length), on the device.
/// With a list, H and U are compact (`len() x rank`, entry i for row
/// `list[i]`).
pub struct RowList {
    rows: CudaSlice<u32>,
    len: usize,
    bound: usize,
}

impl RowList {
    /// Uploads `rows` (strictly increasing, each below `bound`).
    pub fn upload(gpu: &Gpu, rows: &[u32], bound: usize) -> Result<Self> {
        if let Some(w) = rows.windows(2).find(|w| w[0] >= w[1]) {
            return Err(DeviceError::Shape(format!(
                "the ADMM's rows are not in increasing order: {} before {}",
                w[0], w[1]
            )));
        }
        if let Some(&last) = rows.last()
            && last as usize >= bound
        {
            return Err(DeviceError::Shape(format!(
                "the ADMM's row {last} is past the mode's {bound} rows"
            )));
        }
        Ok(RowList {
            rows: gpu.upload("the ADMM's rows", rows)?,
            len: rows.len(),
            bound,
        })
    }

    /// Rows in the list.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The mode's rows, which every entry is below.
    pub fn bound(&self) -> usize {
        self.bound
    }
}

/// AO-ADMM's kernels of one rank on one GPU, with their small buffers.
pub struct AdmmKernels {
    gpu: Arc<Gpu>,
    rank: usize,
    /// `W`, rank x rank.
    w: CudaSlice<f64>,
    /// Column scales.
    inv: CudaSlice<f64>,
    /// Per thread block `3 * rank + 1` partials.
    partials: CudaSlice<f64>,
    reduced: CudaSlice<f64>,
    /// Thread blocks of one launch at most.
    grid: usize,
    /// Threads per block of `admm_blocks` ([`launch_threads`]).
    threads: u32,
}

impl AdmmKernels {
    /// Compiles the kernels for `rank` (1 to [`MAX_RANK`]) and allocates
    /// their buffers.
    pub fn new(gpu: Arc<Gpu>, rank: usize) -> Result<Self> {
        check_rank(rank)?;
        let f = gpu
            .kernels()
            .function(gpu.context(), Kernel::AdmmBlocks, &defines(rank))?;
        let threads = launch_threads(rank, gpu.properties().compute_capability);
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .map_err(driver("reading the occupancy of admm_blocks"))?;
        let grid = WAVES * gpu.properties().sms.max(1) * (per_sm as usize).max(1);
        let width = 3 * rank + 1;
        Ok(AdmmKernels {
            w: gpu.alloc_zeros("the ADMM solve matrix", rank * rank)?,
            inv: gpu.alloc_zeros("the ADMM column scales", rank)?,
            partials: gpu.alloc_zeros("the ADMM partial sums", grid * width)?,
            reduced: gpu.alloc_zeros("the ADMM sums", width)?,
            gpu,
            rank,
            grid,
            threads,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    fn check(&self, what: &str, len: usize, rows: usize) -> Result<()> {
        if len != rows * self.rank {
            return Err(DeviceError::Shape(format!(
                "{what} holds {len} values, {rows} rows of rank {} need {}",
                self.rank,
                rows * self.rank
            )));
        }
        Ok(())
    }

    fn function(&self, kernel: Kernel) -> Result<cudarc::driver::CudaFunction> {
        self.gpu
            .kernels()
            .function(self.gpu.context(), kernel, &defines(self.rank))
    }

    /// Rows of H and U for a mode of `rows` rows under `list`, after
    /// checking that the list is the mode's.
    fn loop_rows(rows: usize, list: Option<&RowList>) -> Result<usize> {
        match list {
            None => Ok(rows),
            Some(l) if l.bound == rows => Ok(l.len),
            Some(l) => Err(DeviceError::Shape(format!(
                "a list of rows below {} for a mode of {rows} rows",
                l.bound
            ))),
        }
    }

    /// The inner loop of one mode on `h` and `u` (f64, in place; `rows x
    /// rank`, or `list.len() x rank` with a list) from its MTTKRP `k` (at
    /// least `rows x rank`; the first `rows` rows are read) and `w = (G +
    /// rho I)^{-1}` (rank x rank, row-major): every row (of the list's
    /// rows, with one) to its own stopping rule. Returns the new H's
    /// column statistics. Synchronizes the stream.
    ///
    /// Cost per inner iteration of a row: `rank^2` f64 multiply-adds; K, H
    /// and U are read once and H and U written once.
    #[allow(clippy::too_many_arguments)]
    pub fn inner_loop(
        &mut self,
        k: &CudaView<f32>,
        w: &[f64],
        h: &mut CudaSlice<f64>,
        u: &mut CudaSlice<f64>,
        rows: usize,
        list: Option<&RowList>,
        params: &InnerParams,
    ) -> Result<InnerStats> {
        let r = self.rank;
        if k.len() < rows * r {
            self.check("the MTTKRP output", k.len(), rows)?;
        }
        let count = Self::loop_rows(rows, list)?;
        if count == 0 {
            // No row to run (H and U hold the device's one-entry stand-in
            // for an empty buffer): the statistics of an empty factor.
            return Ok(InnerStats::empty(r));
        }
        self.check("H", h.len(), count)?;
        self.check("U", u.len(), count)?;
        if w.len() != r * r {
            return Err(DeviceError::Shape(format!(
                "W has {} entries, rank {r} needs {}",
                w.len(),
                r * r
            )));
        }
        if params.max_inner == 0 {
            return Err(DeviceError::Shape(
                "the inner loop needs at least one iteration".into(),
            ));
        }
        let stream = self.gpu.stream().clone();
        stream
            .memcpy_htod(w, &mut self.w)
            .map_err(driver("uploading W"))?;
        let f = self.function(Kernel::AdmmBlocks)?;
        // At least a warp's rows for every warp of a thread block.
        let per_block = (self.threads / 32) as usize * rows_per_warp(r, self.threads);
        let blocks = count.div_ceil(per_block).clamp(1, self.grid) as u32;
        let count_u = count as u64;
        let nonneg = i32::from(params.nonneg);
        let null = 0u64;
        let mut launch = stream.launch_builder(&f);
        launch.arg(k).arg(&self.w).arg(&mut *h).arg(&mut *u);
        match list {
            Some(l) => launch.arg(&l.rows),
            None => launch.arg(&null),
        };
        launch
            .arg(&count_u)
            .arg(&params.rho)
            .arg(&params.threshold)
            .arg(&params.shrink)
            .arg(&nonneg)
            .arg(&params.max_inner)
            .arg(&params.eps)
            .arg(&mut self.partials);
        // SAFETY: `k` holds at least rows x rank floats and `h`, `u` count
        // x rank doubles (checked); the kernel touches entries below
        // `count` of H and U, and rows of K that are below `count` or (with
        // a list of `count` entries, the null pointer otherwise) list
        // entries, each below `rows` (checked by RowList::upload and
        // loop_rows); `w` holds rank^2 doubles; thread block b writes partial
        // row b < blocks <= grid of 3 x rank + 1 doubles, and `partials`
        // holds grid such rows.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (self.threads, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(driver("launching admm_blocks"))?;
        let all = crate::dense::reduce_partials(
            &self.gpu,
            r,
            &self.partials,
            blocks,
            3 * r + 1,
            (2 * r, 3 * r + 1),
            &mut self.reduced,
        )?;
        Ok(InnerStats {
            sumsq: all[..r].to_vec(),
            inner: all[r..2 * r].to_vec(),
            max_abs: all[2 * r..3 * r].to_vec(),
            iters: all[3 * r] as usize,
        })
    }

    /// [`AdmmKernels::inner_loop`] on host arrays: uploads `k`, `h` and
    /// `u` (row-major `rows x rank`, `rows = h.len() / rank`), runs the
    /// launch and downloads the new H and U into `h` and `u`. For checks
    /// against a host computation; a run keeps its arrays on the device.
    pub fn inner_loop_host(
        &mut self,
        k: &[f32],
        w: &[f64],
        h: &mut [f64],
        u: &mut [f64],
        params: &InnerParams,
    ) -> Result<InnerStats> {
        let rows = h.len() / self.rank;
        if rows == 0 {
            return Err(DeviceError::Shape(
                "the inner loop needs at least one row".into(),
            ));
        }
        self.check("the MTTKRP output", k.len(), rows)?;
        self.check("H", h.len(), rows)?;
        self.check("U", u.len(), rows)?;
        let d_k = self.gpu.upload("the ADMM's MTTKRP", k)?;
        let mut d_h = self.gpu.upload("the ADMM's H", h)?;
        let mut d_u = self.gpu.upload("the ADMM's U", u)?;
        let stats = self.inner_loop(&d_k.as_view(), w, &mut d_h, &mut d_u, rows, None, params)?;
        let stream = self.gpu.stream().clone();
        let new_h = stream
            .clone_dtoh(&d_h)
            .map_err(driver("downloading the ADMM's H"))?;
        let new_u = stream
            .clone_dtoh(&d_u)
            .map_err(driver("downloading the ADMM's U"))?;
        h.copy_from_slice(&new_h);
        u.copy_from_slice(&new_u);
        Ok(stats)
    }

    /// Divides column r of `h` and `u` by `divisors[r]` (f64, in place) and
    /// writes the f32 rounding of the scaled H into the factor `a` (`rows x
    /// rank`; H and U as [`AdmmKernels::inner_loop`] has them: with a list,
    /// only its rows of `a` are written), and into `compact` where given
    /// (at least H's length; entry i of H to entry i: with a list, the
    /// factor's rows with data in the list's order). Queued on the stream.
    #[allow(clippy::too_many_arguments)]
    pub fn scale(
        &mut self,
        h: &mut CudaSlice<f64>,
        u: &mut CudaSlice<f64>,
        a: &mut CudaViewMut<f32>,
        compact: Option<&mut CudaSlice<f32>>,
        divisors: &[f64],
        rows: usize,
        list: Option<&RowList>,
    ) -> Result<()> {
        let r = self.rank;
        let count = Self::loop_rows(rows, list)?;
        if count == 0 {
            return Ok(());
        }
        self.check("H", h.len(), count)?;
        self.check("U", u.len(), count)?;
        self.check("the factor", a.len(), rows)?;
        if let Some(c) = &compact {
            if c.len() < count * r {
                return Err(DeviceError::Shape(format!(
                    "a compact copy of {} values for {count} rows at rank {r}",
                    c.len()
                )));
            }
        }
        if divisors.len() != r {
            return Err(DeviceError::Shape(format!(
                "{} column divisors for rank {r}",
                divisors.len()
            )));
        }
        let inv: Vec<f64> = divisors.iter().map(|d| 1.0 / d).collect();
        let stream = self.gpu.stream().clone();
        stream
            .memcpy_htod(&inv, &mut self.inv)
            .map_err(driver("uploading the ADMM column scales"))?;
        let f = self.function(Kernel::AdmmScale)?;
        let n = (count * r) as u64;
        let null = 0u64;
        let mut launch = stream.launch_builder(&f);
        launch.arg(&mut *h).arg(&mut *u).arg(&mut *a);
        match compact {
            Some(c) => launch.arg(c),
            None => launch.arg(&null),
        };
        launch.arg(&self.inv);
        match list {
            Some(l) => launch.arg(&l.rows),
            None => launch.arg(&null),
        };
        launch.arg(&n);
        // SAFETY: `h` and `u` hold n values and `a` rows x rank (checked),
        // `compact` (where not null) at least n, `inv` rank doubles; the
        // kernel reads inv[e % RANK], touches entries below n of H, U and
        // `compact`, and writes row e / RANK of `a` or
        // (with a list of n / rank entries, each below `rows`: checked)
        // row list[e / RANK].
        unsafe { launch.launch(grid_stride(n, 256)) }.map_err(driver("launching admm_scale"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::factors;

    /// The inner loop of `admm.cu` on the host, in f64: every block of
    /// [`BLOCK_ROWS`] rows (one: every row) to its own rule. Returns the
    /// most iterations.
    fn host_inner(
        k: &[f32],
        w: &[f64],
        h: &mut [f64],
        u: &mut [f64],
        rank: usize,
        p: &InnerParams,
    ) -> usize {
        let prox = |v: f64| {
            let t = if p.nonneg {
                (v - p.threshold).max(0.0)
            } else if v > p.threshold {
                v - p.threshold
            } else if v < -p.threshold {
                v + p.threshold
            } else {
                0.0
            };
            t * p.shrink
        };
        // Rows whose K is all zero start (and stay) at H = U = 0.
        for ((k, h), u) in k
            .chunks(rank)
            .zip(h.chunks_mut(rank))
            .zip(u.chunks_mut(rank))
        {
            if k.iter().all(|&x| x == 0.0) {
                h.fill(0.0);
                u.fill(0.0);
            }
        }
        let block = BLOCK_ROWS * rank;
        let mut most = 0;
        for ((k, h), u) in k
            .chunks(block)
            .zip(h.chunks_mut(block))
            .zip(u.chunks_mut(block))
        {
            let rows = k.len() / rank;
            let mut it = 0;
            loop {
                it += 1;
                let rhs: Vec<f64> = (0..k.len())
                    .map(|e| f64::from(k[e]) + p.rho * (h[e] + u[e]))
                    .collect();
                let mut sums = [0f64; 4];
                for r in 0..rows {
                    for j in 0..rank {
                        // The kernel's order and rounding: one fused
                        // multiply-add per term, columns in order.
                        let ht = (0..rank)
                            .fold(0f64, |s, c| rhs[r * rank + c].mul_add(w[c * rank + j], s));
                        let e = r * rank + j;
                        let fresh = prox(ht - u[e]);
                        u[e] += fresh - ht;
                        sums[0] += (fresh - ht).powi(2);
                        sums[1] += (fresh - h[e]).powi(2);
                        sums[2] += fresh * fresh;
                        sums[3] += u[e] * u[e];
                        h[e] = fresh;
                    }
                }
                let done = sums[0] <= p.eps * sums[2] && sums[1] <= p.eps * sums[3];
                if done || it >= p.max_inner as usize {
                    break;
                }
            }
            most = most.max(it);
        }
        most
    }

    /// Non-negative, no weights, rho 1, five iterations at most.
    fn plain_params() -> InnerParams {
        InnerParams {
            rho: 1.0,
            nonneg: true,
            threshold: 0.0,
            shrink: 1.0,
            max_inner: 5,
            eps: 1e-4,
        }
    }

    fn largest(v: &[f64]) -> f64 {
        v.iter().fold(0f64, |s, x| s.max(x.abs()))
    }

    /// Every entry within `tol` of `want`'s largest magnitude.
    fn close(got: &[f64], want: &[f64], tol: f64, what: &str) {
        close_to(got, want, tol * largest(want).max(1e-300), what);
    }

    /// Every entry finite and within `bound` of `want`'s.
    fn close_to(got: &[f64], want: &[f64], bound: f64, what: &str) {
        for (e, (x, y)) in got.iter().zip(want).enumerate() {
            assert!(x.is_finite(), "{what}[{e}] = {x}");
            assert!((x - y).abs() <= bound, "{what}[{e}]: {x} vs {y}");
        }
    }

    #[test]
    fn the_inner_loop_equals_the_f64_host_loop() {
        let Some(gpu) = crate::testing::gpu_or_skip("the_inner_loop_equals_the_f64_host_loop")
        else {
            return;
        };
        for rank in [1usize, 3, 7, 8, 16, 32, 33, 64, 100, 128] {
            let mut kernels = AdmmKernels::new(gpu.clone(), rank).unwrap();
            // Row counts around a warp's rows, and (up to rank 32) more
            // rows than one launch has warps' rows at once: warps take
            // rows as their earlier rows stop.
            let mut row_counts = vec![1usize, 7, 31, 32, 33, 1000];
            if rank <= 32 {
                row_counts.push(100_001);
            }
            for rows in row_counts {
                let seed = (rank * 131 + rows) as u64;
                let k = factors(&[rows as u32], rank, seed).remove(0);
                // Rows without data, as most rows of a long sparse mode
                // are: every fifth row, rows 32..64, and every seventh,
                // which the list variant leaves out.
                let k: Vec<f32> = k
                    .iter()
                    .enumerate()
                    .map(|(e, &x)| {
                        let row = e / rank;
                        if row % 5 == 3 || row % 7 == 6 || (32..64).contains(&row) {
                            0.0
                        } else {
                            4.0 * x
                        }
                    })
                    .collect();
                let h0: Vec<f64> = factors(&[rows as u32], rank, seed + 1)[0]
                    .iter()
                    .map(|&x| f64::from(x) + 0.5)
                    .collect();
                // The list keeps rows with K = 0 (every fifth, 32..64):
                // the kernel's zero rule runs on listed rows too.
                let listed: Vec<u32> = (0..rows as u32).filter(|r| r % 7 != 6).collect();
                let gather = |v: &[f64]| -> Vec<f64> {
                    listed
                        .iter()
                        .flat_map(|&r| &v[r as usize * rank..(r as usize + 1) * rank])
                        .copied()
                        .collect()
                };
                let k_listed: Vec<f32> = listed
                    .iter()
                    .flat_map(|&r| &k[r as usize * rank..(r as usize + 1) * rank])
                    .copied()
                    .collect();
                let d_list = RowList::upload(&gpu, &listed, rows).unwrap();
                // Not the inverse of a G + rho I: any W under which the
                // loop stays bounded checks the arithmetic.
                let rho = 1.5;
                let w: Vec<f64> = (0..rank * rank)
                    .map(|e| {
                        let (i, j) = (e / rank, e % rank);
                        if i == j {
                            0.4
                        } else {
                            0.1 / rank as f64 * (((i + j) % 5) as f64 - 2.0)
                        }
                    })
                    .collect();
                let d_k = gpu.upload("k", &k).unwrap();
                for (nonneg, threshold, shrink, max_inner) in [
                    (true, 0.0, 1.0, 1u32),
                    (true, 0.05, 0.9, 50),
                    (false, 0.02, 0.8, 50),
                    (false, 0.0, 1.0, 7),
                ] {
                    let p = InnerParams {
                        rho,
                        nonneg,
                        threshold,
                        shrink,
                        max_inner,
                        eps: 1e-4,
                    };
                    for list in [None, Some(&d_list)] {
                        let what =
                            format!("rank {rank}, {rows} rows, list {}, {p:?}", list.is_some());
                        // H and U start warm (as after an outer iteration),
                        // the same on both sides; compact with a list.
                        let h0 = if list.is_some() {
                            gather(&h0)
                        } else {
                            h0.clone()
                        };
                        let k_host = if list.is_some() { &k_listed } else { &k };
                        let u0: Vec<f64> = h0.iter().map(|&x| 0.01 * (x - 1.0)).collect();
                        let mut d_h = gpu.upload("h", &h0).unwrap();
                        let mut d_u = gpu.upload("u", &u0).unwrap();
                        let (mut h, mut u_host) = (h0.clone(), u0.clone());
                        let most = host_inner(k_host, &w, &mut h, &mut u_host, rank, &p);
                        let stats = kernels
                            .inner_loop(&d_k.as_view(), &w, &mut d_h, &mut d_u, rows, list, &p)
                            .unwrap();
                        assert_eq!(stats.iters, most, "{what}: iterations");
                        let got_h = gpu.stream().clone_dtoh(&d_h).unwrap();
                        let got_u = gpu.stream().clone_dtoh(&d_u).unwrap();
                        close(&got_h, &h, 1e-11, &format!("{what}: H"));
                        // U's rounding is H's: where U is 0 on the host (no
                        // threshold, no clamp: U goes to exactly 0 there),
                        // the kernel's products in another order leave
                        // 1e-19s.
                        let scale = largest(&h).max(largest(&u_host)).max(1e-300);
                        close_to(&got_u, &u_host, 1e-11 * scale, &format!("{what}: U"));
                        if nonneg {
                            assert!(got_h.iter().all(|&x| x >= 0.0), "{what}: H < 0");
                        }
                        // The statistics of the f32 rounding of H.
                        let (hr, n) = (&h, h.len() / rank);
                        let col = |j: usize| (0..n).map(move |r| hr[r * rank + j] as f32);
                        let sumsq: Vec<f64> = (0..rank)
                            .map(|j| col(j).map(|x| f64::from(x).powi(2)).sum())
                            .collect();
                        let max_abs: Vec<f64> = (0..rank)
                            .map(|j| col(j).fold(0f64, |s, x| s.max(f64::from(x.abs()))))
                            .collect();
                        let inner: Vec<f64> = (0..rank)
                            .map(|j| {
                                (0..n)
                                    .map(|r| {
                                        f64::from(k_host[r * rank + j])
                                            * f64::from(h[r * rank + j] as f32)
                                    })
                                    .sum()
                            })
                            .collect();
                        close(&stats.sumsq, &sumsq, 1e-6, &format!("{what}: sumsq"));
                        close(&stats.max_abs, &max_abs, 1e-6, &format!("{what}: max"));
                        close(&stats.inner, &inner, 1e-6, &format!("{what}: inner"));
                        // The scaling: H and U divided in f64, the factor
                        // their f32 rounding; with a list, only its rows
                        // of the factor are written.
                        let divisors: Vec<f64> = (0..rank).map(|j| 1.0 + j as f64 / 3.0).collect();
                        let mut d_f = gpu.upload("a", &vec![7f32; rows * rank]).unwrap();
                        // With a list, the compact copy too.
                        let mut d_c = gpu.upload("c", &vec![7f32; got_h.len() + 3]).unwrap();
                        kernels
                            .scale(
                                &mut d_h,
                                &mut d_u,
                                &mut d_f.slice_mut(..),
                                list.map(|_| &mut d_c),
                                &divisors,
                                rows,
                                list,
                            )
                            .unwrap();
                        let scaled = gpu.stream().clone_dtoh(&d_h).unwrap();
                        let f = gpu.stream().clone_dtoh(&d_f).unwrap();
                        let c = gpu.stream().clone_dtoh(&d_c).unwrap();
                        let n = got_h.len();
                        if list.is_some() {
                            for (e, &x) in c[..n].iter().enumerate() {
                                let row = listed[e / rank] as usize;
                                assert_eq!(x, f[row * rank + e % rank], "{what}: compact[{e}]");
                            }
                        } else {
                            assert!(c[..n].iter().all(|&x| x == 7.0), "{what}: compact written");
                        }
                        assert!(
                            c[n..].iter().all(|&x| x == 7.0),
                            "{what}: past the compact rows"
                        );
                        let row_of = |i: usize| {
                            if list.is_some() {
                                listed[i] as usize
                            } else {
                                i
                            }
                        };
                        let mut written = vec![false; rows];
                        for (e, (&x, &y)) in got_h.iter().zip(&scaled).enumerate() {
                            let want = x * (1.0 / divisors[e % rank]);
                            assert_eq!(y, want, "{what}: scaled H[{e}]");
                            let row = row_of(e / rank);
                            written[row] = true;
                            assert_eq!(
                                f[row * rank + e % rank],
                                want as f32,
                                "{what}: factor[{e}]"
                            );
                        }
                        for (row, _) in written.iter().enumerate().filter(|(_, w)| !**w) {
                            assert!(
                                f[row * rank..(row + 1) * rank].iter().all(|&x| x == 7.0),
                                "{what}: unlisted row {row} written"
                            );
                        }
                    }
                }
            }
            // An empty list runs nothing and writes nothing.
            let empty = RowList::upload(&gpu, &[], 40).unwrap();
            let (mut d_h, mut d_u) = (
                gpu.alloc_zeros::<f64>("h", 0).unwrap(),
                gpu.alloc_zeros::<f64>("u", 0).unwrap(),
            );
            let d_k = gpu.upload("k", &vec![1f32; 40 * rank]).unwrap();
            let w = vec![0.5; rank * rank];
            let p = plain_params();
            let stats = kernels
                .inner_loop(&d_k.as_view(), &w, &mut d_h, &mut d_u, 40, Some(&empty), &p)
                .unwrap();
            assert_eq!(stats.iters, 0);
            assert!(stats.sumsq.iter().all(|&x| x == 0.0));
        }
    }

    #[test]
    fn row_lists_must_be_increasing_and_below_the_mode() {
        let Some(gpu) =
            crate::testing::gpu_or_skip("row_lists_must_be_increasing_and_below_the_mode")
        else {
            return;
        };
        assert!(RowList::upload(&gpu, &[0, 3, 9], 10).is_ok());
        let e = RowList::upload(&gpu, &[0, 3, 3], 10)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("increasing"), "{e}");
        let e = RowList::upload(&gpu, &[0, 10], 10)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("past the mode"), "{e}");
        let mut kernels = AdmmKernels::new(gpu.clone(), 4).unwrap();
        let list = RowList::upload(&gpu, &[1, 2], 10).unwrap();
        let k = gpu.alloc_zeros::<f32>("k", 20 * 4).unwrap();
        let (mut h, mut u) = (
            gpu.alloc_zeros::<f64>("h", 8).unwrap(),
            gpu.alloc_zeros::<f64>("u", 8).unwrap(),
        );
        let p = plain_params();
        // A list for a mode of 10 rows does not serve one of 20.
        let e = kernels
            .inner_loop(
                &k.as_view(),
                &[0.0; 16],
                &mut h,
                &mut u,
                20,
                Some(&list),
                &p,
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("below 10"), "{e}");
    }

    #[test]
    fn ranks_beyond_the_inner_loop_are_refused() {
        assert!(check_rank(1).is_ok() && check_rank(MAX_RANK).is_ok());
        for bad in [0, MAX_RANK + 1] {
            let e = check_rank(bad).unwrap_err().to_string();
            assert!(e.contains("ranks 1 to 128"), "{e}");
        }
    }
}
