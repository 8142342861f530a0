//! CP-APR on one GPU: the CPU's algorithm ([`crate::apr`]) step by step,
//! its steps run by `kruskal_device::apr` in f64 on the device.
//!
//! The run is [`crate::apr`]'s own driver (`run_steps`: the same outer
//! and inner iterations, stopping rules and outputs); only where the
//! steps run differs. Each mode's sorted copy of the nonzeros is built on
//! the host as the CPU path builds it and uploaded once; the factors,
//! `Phi` and `Pi` live on the GPU. A mode's inner iterations are queued
//! at once and end on the device (`AprGpu::queue_update`); their KKT
//! violations come back at the end of the mode, with the kappa flag and
//! the R column norms (lambda stays on the host); per outer iteration, the
//! log-likelihood. The factors come back at the end. Results agree with
//! the CPU's to rounding (sums run in another order), not bit for bit.
//!
//! [`cp_apr_on`] chooses where to run (`auto`: the GPU when one is usable,
//! the rank is one its kernels take and the run fits in its free memory,
//! else the CPU, with the reason).
//!
//! On a group of GPUs ([`cp_apr_gpus`], [`cp_apr_on_gpus`]) each GPU owns
//! a range of every mode's rows, cut so that the ranges hold about the
//! same number of nonzeros ([`cut_rows`]), and holds only those rows'
//! sorted copies (so `Pi`, the largest array, is split too) beside every
//! factor whole. A mode's inner iterations run on every GPU at once, each
//! on its own rows (every GPU's step is queued before any is waited
//! for): CP-APR's multiplicative updates treat a mode's rows
//! independently, so this is the one-GPU computation cut up. Only the
//! KKT violation (a max, taken on every GPU from the shares the GPUs copy
//! to each other, [`kruskal_device::apr::share_kkt`]), the column norms
//! and the log-likelihood's sums (added on the host in GPU order) are
//! combined; after each mode, every
//! GPU's rows of its factor are copied to the others by peer copies
//! ([`kruskal_device::apr::share_rows`]). Results agree with one GPU's to
//! rounding (the column norms are summed in parts) and repeat bit for bit
//! on the same GPU count.

use std::ops::{ControlFlow, Range};
use std::sync::Arc;

use kruskal_device::Gpu;
use kruskal_device::apr::{AprGpu, SortedCopy, device_bytes, part_bytes, share_kkt, share_rows};
use kruskal_formats::SparseTensor;
use ndarray::Array2;

use crate::apr::{
    AprIteration, AprModel, AprOptions, AprSteps, Inner, ModeRows, check_run, row_pointer,
    run_steps,
};
use crate::decompose::{BackendChoice, fallback_reason};
use crate::error::{CpdError, Result};
use crate::memory::{MemoryNeed, bytes_text, host_refusal};

/// What GPU CP-APR takes on the device: each mode's sorted copy (an f64
/// value, the other modes' u32 indices and a row pointer), `Pi`
/// (`nnz x rank` f64), the factors and `Phi` (f64, `dims[m] x rank` per
/// mode) and the partial sums.
///
/// Cost: O(modes).
pub fn apr_gpu_need(dims: &[u32], nnz: usize, rank: usize) -> MemoryNeed {
    MemoryNeed {
        parts: device_bytes(dims, nnz, rank),
    }
}

/// What GPU CP-APR takes on the host besides the tensor: the factors
/// three times (the start, the download, the model), and one mode's
/// sorted copy at a time with its sort's scratch and the copy laid out
/// for the upload.
pub fn apr_gpu_host_need(dims: &[u32], nnz: usize, rank: usize) -> MemoryNeed {
    let rows: u64 = dims.iter().map(|&d| u64::from(d)).sum();
    let largest = dims.iter().copied().max().map_or(0, u64::from);
    let nnz = nnz as u64;
    let per_copy = nnz
        .saturating_mul(8 + 4 * (dims.len() as u64).saturating_sub(1))
        .saturating_add(largest.saturating_add(1).saturating_mul(8));
    MemoryNeed {
        parts: vec![
            (
                "factors",
                rows.saturating_mul(rank as u64)
                    .saturating_mul(8)
                    .saturating_mul(3),
            ),
            ("sorted copy", per_copy.saturating_mul(2)),
            (
                "sort scratch",
                nnz.saturating_add(largest)
                    .saturating_add(1)
                    .saturating_mul(8),
            ),
        ],
    }
}

/// Why this GPU cannot take the run (`None` when it can): a rank its
/// kernels do not take, or a need beyond its free memory. One line.
pub fn gpu_refusal(rank: usize, need: &MemoryNeed, free_bytes: u64) -> Option<String> {
    if let Err(e) = kruskal_device::apr::check_rank(rank) {
        return Some(kruskal_device::error_line(&e));
    }
    (need.total() > free_bytes).then(|| {
        format!(
            "CP-APR needs {need} on the GPU and {} are free there",
            bytes_text(free_bytes)
        )
    })
}

/// The scales that give columns of 1-norms `norms` unit norm, the norms
/// multiplied into `lambda` (as the CPU's `normalize_mode`: a zero column
/// stays zero, its weight becomes 0).
fn inverse_norms(norms: &[f64], lambda: &mut [f64]) -> Vec<f64> {
    for (l, &x) in lambda.iter_mut().zip(norms) {
        *l *= x;
    }
    norms
        .iter()
        .map(|&x| if x > 0.0 { 1.0 / x } else { 1.0 })
        .collect()
}

/// The log-likelihood from the nonzeros' sum `sum_nz x log(m)`: minus
/// the model's total, lambda_r times the product of every mode's column
/// sums (the factors are non-negative, so their 1-norms; `column_sums(m)`
/// gives mode m's).
fn minus_model_total(
    sum: f64,
    lambda: &[f64],
    nmodes: usize,
    mut column_sums: impl FnMut(usize) -> Result<Vec<f64>>,
) -> Result<f64> {
    let mut totals = lambda.to_vec();
    for m in 0..nmodes {
        for (t, s) in totals.iter_mut().zip(column_sums(m)?) {
            *t *= s;
        }
    }
    Ok(sum - totals.iter().sum::<f64>())
}

/// The steps on one GPU.
struct GpuSteps {
    apr: AprGpu,
    nmodes: usize,
}

impl GpuSteps {
    /// Allocates the device's arrays (after checking they fit), uploads
    /// the factors and each mode's sorted copy, built on the host one at a
    /// time.
    fn new(
        gpu: Arc<Gpu>,
        tensor: &SparseTensor,
        factors: &[Array2<f64>],
        rank: usize,
    ) -> Result<Self> {
        let mut apr = AprGpu::new(gpu, tensor.dims(), tensor.nnz(), rank)?;
        apr.set_factors(factors)?;
        for m in 0..tensor.nmodes() {
            let rows = ModeRows::new(tensor, m);
            let row_ptr: Vec<u64> = rows.row_ptr.iter().map(|&p| p as u64).collect();
            let other = rows.other.concat();
            apr.upload_copy(
                m,
                &SortedCopy {
                    row_ptr: &row_ptr,
                    values: &rows.values,
                    other: &other,
                },
            )?;
        }
        Ok(GpuSteps {
            apr,
            nmodes: tensor.nmodes(),
        })
    }
}

impl AprSteps for GpuSteps {
    fn kappa_fold(&mut self, n: usize, kappa: Option<(f64, f64)>, lambda: &[f64]) -> Result<bool> {
        Ok(self.apr.kappa_fold(n, kappa, lambda)?)
    }

    fn form_pi(&mut self, n: usize) -> Result<()> {
        Ok(self.apr.form_pi(n)?)
    }

    fn inner(&mut self, n: usize, max_inner: usize, tol: f64, eps_div_zero: f64) -> Result<Inner> {
        // Every iteration queued at once; the device ends the loop.
        self.apr.begin_inner(0, 1, max_inner)?;
        for i in 0..max_inner {
            self.apr.queue_phi(n, i, eps_div_zero)?;
            self.apr.queue_update(n, i, tol)?;
        }
        let kkts = self.apr.read_kkts()?;
        Ok(Inner::from_violations(&[kkts], max_inner, tol))
    }

    fn normalize(&mut self, n: usize, lambda: &mut [f64]) -> Result<()> {
        // As the CPU's normalize_mode: a zero column stays zero, its
        // weight becomes 0.
        let norms = self.apr.column_sums(n)?;
        let inv = inverse_norms(&norms, lambda);
        Ok(self.apr.scale(n, &inv)?)
    }

    fn log_likelihood(&mut self, lambda: &[f64]) -> Result<f64> {
        let sum = self.apr.log_likelihood_sum(lambda)?;
        minus_model_total(sum, lambda, self.nmodes, |m| Ok(self.apr.column_sums(m)?))
    }

    fn factors(&mut self) -> Result<Vec<Array2<f64>>> {
        Ok(self.apr.factors()?)
    }
}

/// Rows `0..row_ptr.len() - 1` cut into `parts` consecutive ranges holding
/// about the same number of nonzeros: cut k falls at the row boundary
/// nearest `k * nnz / parts` (a row is never split, so a row holding more
/// than a part's share leaves a neighbour short, or empty).
pub fn cut_rows(row_ptr: &[usize], parts: usize) -> Vec<Range<usize>> {
    let rows = row_ptr.len().saturating_sub(1);
    let nnz = row_ptr.last().copied().unwrap_or(0);
    let parts = parts.max(1);
    let mut cuts = Vec::with_capacity(parts + 1);
    cuts.push(0usize);
    for k in 1..parts {
        let target = (nnz as u128 * k as u128 / parts as u128) as usize;
        // The first boundary at or past the target, or the one before it
        // when that is nearer.
        let after = row_ptr.partition_point(|&p| p < target).min(rows);
        let at = if after > 0 && target - row_ptr[after - 1] < row_ptr[after] - target {
            after - 1
        } else {
            after
        };
        let last = *cuts.last().expect("starts with 0");
        cuts.push(at.max(last));
    }
    cuts.push(rows);
    cuts.windows(2).map(|w| w[0]..w[1]).collect()
}

/// The steps on a group: one [`AprGpu`] part per GPU, each owning a range
/// of every mode's rows (two parts may share a GPU: the tests run a group
/// on one).
struct GroupSteps {
    parts: Vec<AprGpu>,
    nmodes: usize,
    /// Whether the GPUs reach each other's memory ([`share_kkt`]'s
    /// `direct`).
    direct: bool,
}

/// Queues a step on every part (`queue`), then reads each part's result
/// (`read`, which waits for that part's GPU), in part order: every GPU
/// works at once, from one thread.
fn on_each<T>(
    parts: &mut [AprGpu],
    mut queue: impl FnMut(&mut AprGpu) -> kruskal_device::Result<()>,
    read: impl Fn(&AprGpu) -> kruskal_device::Result<T>,
) -> Result<Vec<T>> {
    for p in parts.iter_mut() {
        queue(p)?;
    }
    Ok(parts
        .iter()
        .map(read)
        .collect::<kruskal_device::Result<_>>()?)
}

/// Element-wise sums of `parts` (column norms of each part), in part
/// order.
fn add_up(parts: Vec<Vec<f64>>, rank: usize) -> Vec<f64> {
    let mut total = vec![0.0; rank];
    for part in parts {
        for (t, x) in total.iter_mut().zip(part) {
            *t += x;
        }
    }
    total
}

/// Each mode's rows cut over `parts` parts, with the nonzeros of each
/// part's rows: `(own[part][mode], nnz[part][mode])`.
type Cuts = (Vec<Vec<Range<usize>>>, Vec<Vec<usize>>);

fn cut_modes(tensor: &SparseTensor, parts: usize) -> Cuts {
    let mut own = vec![Vec::with_capacity(tensor.nmodes()); parts];
    let mut nnz = vec![Vec::with_capacity(tensor.nmodes()); parts];
    for m in 0..tensor.nmodes() {
        let row_ptr = row_pointer(tensor, m);
        for (p, r) in cut_rows(&row_ptr, parts).into_iter().enumerate() {
            nnz[p].push(row_ptr[r.end] - row_ptr[r.start]);
            own[p].push(r);
        }
    }
    (own, nnz)
}

impl GroupSteps {
    /// Cuts the rows, allocates every part (after checking each GPU's free
    /// memory holds its parts), uploads the factors to each, and each
    /// mode's sorted copy, built on the host one mode at a time, cut into
    /// the parts' rows.
    fn new(
        gpus: &[Arc<Gpu>],
        tensor: &SparseTensor,
        factors: &[Array2<f64>],
        rank: usize,
        (own, nnz): &Cuts,
        direct: bool,
    ) -> Result<Self> {
        let mut parts = Vec::with_capacity(gpus.len());
        for ((gpu, own), nnz) in gpus.iter().zip(own).zip(nnz) {
            let mut apr = AprGpu::new_part(gpu.clone(), tensor.dims(), rank, own, nnz)?;
            apr.set_factors(factors)?;
            parts.push(apr);
        }
        let nmodes = tensor.nmodes();
        for m in 0..nmodes {
            let rows = ModeRows::new(tensor, m);
            for part in parts.iter_mut() {
                let r = part.owned(m);
                let (lo, hi) = (rows.row_ptr[r.start], rows.row_ptr[r.end]);
                let row_ptr: Vec<u64> = rows.row_ptr[r.start..=r.end]
                    .iter()
                    .map(|&p| (p - lo) as u64)
                    .collect();
                let other: Vec<u32> = rows
                    .other
                    .iter()
                    .flat_map(|o| o[lo..hi].iter().copied())
                    .collect();
                part.upload_copy(
                    m,
                    &SortedCopy {
                        row_ptr: &row_ptr,
                        values: &rows.values[lo..hi],
                        other: &other,
                    },
                )?;
            }
        }
        Ok(GroupSteps {
            parts,
            nmodes,
            direct,
        })
    }

    fn rank(&self) -> usize {
        self.parts[0].rank()
    }

    /// The 1-norms of mode `mode`'s columns, from every part's rows.
    fn column_sums(&mut self, mode: usize) -> Result<Vec<f64>> {
        let rank = self.rank();
        let parts = on_each(
            &mut self.parts,
            |p| p.queue_column_sums(mode),
            |p| p.read_sums(rank),
        )?;
        Ok(add_up(parts, rank))
    }
}

impl AprSteps for GroupSteps {
    fn kappa_fold(&mut self, n: usize, kappa: Option<(f64, f64)>, lambda: &[f64]) -> Result<bool> {
        // Without the fix there is no flag to wait for.
        let fixed = on_each(
            &mut self.parts,
            |p| p.queue_kappa_fold(n, kappa, lambda),
            |p| match kappa {
                Some(_) => p.read_fixed(),
                None => Ok(false),
            },
        )?;
        Ok(fixed.into_iter().any(|f| f))
    }

    fn form_pi(&mut self, n: usize) -> Result<()> {
        // Queued without waiting: every GPU starts at once.
        for p in self.parts.iter_mut() {
            p.form_pi(n)?;
        }
        Ok(())
    }

    fn inner(&mut self, n: usize, max_inner: usize, tol: f64, eps_div_zero: f64) -> Result<Inner> {
        // Every iteration queued on every GPU at once; the GPUs exchange
        // each iteration's KKT shares and end the loop together.
        let count = self.parts.len();
        for (k, p) in self.parts.iter_mut().enumerate() {
            p.begin_inner(k, count, max_inner)?;
        }
        for i in 0..max_inner {
            for p in self.parts.iter_mut() {
                p.queue_phi(n, i, eps_div_zero)?;
            }
            share_kkt(&mut self.parts, i, self.direct)?;
            for p in self.parts.iter_mut() {
                p.queue_update(n, i, tol)?;
            }
        }
        let kkts = self
            .parts
            .iter()
            .map(AprGpu::read_kkts)
            .collect::<kruskal_device::Result<Vec<_>>>()?;
        Ok(Inner::from_violations(&kkts, max_inner, tol))
    }

    fn normalize(&mut self, n: usize, lambda: &mut [f64]) -> Result<()> {
        let norms = self.column_sums(n)?;
        let inv = inverse_norms(&norms, lambda);
        for p in self.parts.iter_mut() {
            p.scale(n, &inv)?;
        }
        // Every GPU's rows of the mode to every other GPU.
        Ok(share_rows(&mut self.parts, n)?)
    }

    fn log_likelihood(&mut self, lambda: &[f64]) -> Result<f64> {
        let sums = on_each(
            &mut self.parts,
            |p| p.queue_log_likelihood(lambda),
            |p| p.read_sums(1),
        )?;
        let sum: f64 = sums.iter().map(|s| s[0]).sum();
        let nmodes = self.nmodes;
        minus_model_total(sum, lambda, nmodes, |m| self.column_sums(m))
    }

    fn factors(&mut self) -> Result<Vec<Array2<f64>>> {
        // Every part holds every factor whole after the last mode's share.
        Ok(self.parts[0].factors()?)
    }
}

/// `Phi_n` and the KKT violation of every mode n on `gpu` for `factors`
/// as they are (no lambda, no kappa fix), by the GPU's steps: the sorted
/// copies built and uploaded as a run does, then per mode `Pi` and `Phi`,
/// downloaded. For `kruskal check`, which compares them with a naive f64
/// computation.
///
/// Shapes: `factors[m]` is `dims[m] x rank` for every mode, rank 1 to
/// [`kruskal_device::apr::MAX_RANK`].
#[doc(hidden)]
pub fn phi_gpu(
    gpu: Arc<Gpu>,
    tensor: &SparseTensor,
    factors: &[Array2<f64>],
    eps_div_zero: f64,
) -> Result<Vec<(Array2<f64>, f64)>> {
    let rank = crate::apr::check_factor_shapes(tensor, factors)?;
    let mut steps = GpuSteps::new(gpu, tensor, factors, rank)?;
    (0..tensor.nmodes())
        .map(|n| {
            steps.apr.form_pi(n)?;
            let kkt = steps.apr.phi(n, eps_div_zero)?;
            Ok((steps.apr.phi_host(n)?, kkt))
        })
        .collect()
}

/// Runs CP-APR on `gpu`: the same options, stopping rules and outputs as
/// [`crate::apr::cp_apr`]. Refuses, before allocating, a rank above
/// [`kruskal_device::apr::MAX_RANK`] and a run beyond the GPU's free
/// memory ([`apr_gpu_need`]) or the host's ([`apr_gpu_host_need`]).
pub fn cp_apr_gpu(
    gpu: Arc<Gpu>,
    tensor: &SparseTensor,
    opts: &AprOptions,
    on_iteration: &mut dyn FnMut(&AprIteration) -> ControlFlow<()>,
) -> Result<AprModel> {
    check_run(tensor, opts)?;
    let (dims, nnz, rank) = (tensor.dims(), tensor.nnz(), opts.rank);
    let host = apr_gpu_host_need(dims, nnz, rank);
    if let Some(refusal) = host_refusal(&host, tensor, false) {
        return Err(CpdError::memory(format!("CP-APR: {refusal}")));
    }
    let need = apr_gpu_need(dims, nnz, rank);
    if let Some(why) = gpu_refusal(rank, &need, gpu.free_bytes()? as u64) {
        return Err(CpdError::Gpu(why));
    }
    run_steps(
        tensor,
        opts,
        |factors| GpuSteps::new(gpu, tensor, &factors, rank),
        on_iteration,
    )
}

/// Why the group's GPUs cannot take their parts (`None` when they can):
/// per GPU (parts sharing a GPU add up), the parts' arrays
/// ([`part_bytes`]) against its free memory. One line.
fn group_refusal(
    gpus: &[Arc<Gpu>],
    dims: &[u32],
    rank: usize,
    cuts: &Cuts,
) -> Result<Option<String>> {
    let (own, nnz) = cuts;
    let mut seen: Vec<usize> = Vec::new();
    for gpu in gpus {
        let ordinal = gpu.properties().ordinal;
        if seen.contains(&ordinal) {
            continue;
        }
        seen.push(ordinal);
        let mut parts: Vec<(&'static str, u64)> = Vec::new();
        for (k, _) in gpus
            .iter()
            .enumerate()
            .filter(|(_, g)| g.properties().ordinal == ordinal)
        {
            let owned: Vec<(u64, u64)> = own[k]
                .iter()
                .zip(&nnz[k])
                .map(|(r, &n)| (r.len() as u64, n as u64))
                .collect();
            for (name, b) in part_bytes(dims, rank, &owned) {
                match parts.iter_mut().find(|p| p.0 == name) {
                    Some(p) => p.1 = p.1.saturating_add(b),
                    None => parts.push((name, b)),
                }
            }
        }
        let need = MemoryNeed { parts };
        let free = gpu.free_bytes()? as u64;
        if need.total() > free {
            return Ok(Some(format!(
                "CP-APR needs {need} on GPU {ordinal} and {} are free there",
                bytes_text(free)
            )));
        }
    }
    Ok(None)
}

/// Runs CP-APR on a group of GPUs, each owning a range of every mode's
/// rows (see the module's text); one GPU runs [`cp_apr_gpu`]. The same
/// options, stopping rules and outputs as [`crate::apr::cp_apr`]. A GPU
/// may appear more than once (its parts then share it). Refuses, before
/// allocating, a rank the kernels do not take and parts beyond a GPU's
/// free memory.
pub fn cp_apr_gpus(
    gpus: &[Arc<Gpu>],
    tensor: &SparseTensor,
    opts: &AprOptions,
    on_iteration: &mut dyn FnMut(&AprIteration) -> ControlFlow<()>,
) -> Result<AprModel> {
    check_run(tensor, opts)?;
    match gpus {
        [] => {
            return Err(CpdError::option(
                crate::error::OptionName::Gpus,
                "must be at least 1",
            ));
        }
        [one] => return cp_apr_gpu(one.clone(), tensor, opts, on_iteration),
        _ => {}
    }
    let (dims, nnz, rank) = (tensor.dims(), tensor.nnz(), opts.rank);
    let host = apr_gpu_host_need(dims, nnz, rank);
    if let Some(refusal) = host_refusal(&host, tensor, false) {
        return Err(CpdError::memory(format!("CP-APR: {refusal}")));
    }
    if let Err(e) = kruskal_device::apr::check_rank(rank) {
        return Err(CpdError::Gpu(kruskal_device::error_line(&e)));
    }
    let cuts = cut_modes(tensor, gpus.len());
    if let Some(why) = group_refusal(gpus, dims, rank, &cuts)? {
        return Err(CpdError::Gpu(why));
    }
    // Peer access between the distinct GPUs, so the rows travel over
    // NVLink (or PCIe) directly.
    let mut distinct: Vec<Arc<Gpu>> = Vec::new();
    for gpu in gpus {
        if !distinct
            .iter()
            .any(|d| d.properties().ordinal == gpu.properties().ordinal)
        {
            distinct.push(gpu.clone());
        }
    }
    // Whether every GPU reaches every other's memory (parts on one GPU
    // always do).
    let direct = distinct.len() < 2 || kruskal_group::enable_peer_access(&distinct)?;
    run_steps(
        tensor,
        opts,
        |factors| GroupSteps::new(gpus, tensor, &factors, rank, &cuts, direct),
        on_iteration,
    )
}

/// Nonzeros per GPU below which a run asked for every GPU
/// ([`apr_all_gpus`]) takes fewer: each inner iteration waits for the
/// slowest GPU and for the exchange of the KKT shares, a fixed cost that a
/// GPU's share of a smaller tensor does not repay (see docs/performance.md, CP-APR on
/// several GPUs).
pub const APR_MIN_NNZ_PER_GPU: usize = 1_000_000;

/// The GPUs a CP-APR run asked for every GPU uses, of the machine's
/// `count`: one per [`APR_MIN_NNZ_PER_GPU`] nonzeros, at least one, the
/// first ones; with the reason when that is fewer than `count`.
pub fn apr_all_gpus(nnz: usize, count: usize) -> (Vec<usize>, Option<String>) {
    let n = (nnz / APR_MIN_NNZ_PER_GPU).clamp(1, count.max(1));
    let note = (n < count).then(|| {
        format!(
            "{n} of {count} GPUs: CP-APR takes a GPU per {} million nonzeros ({nnz} nonzeros)",
            APR_MIN_NNZ_PER_GPU / 1_000_000
        )
    });
    ((0..n).collect(), note)
}

/// Runs CP-APR on the GPUs `ordinals` (distinct; one or more): the GPUs
/// are opened, and the run goes to [`cp_apr_gpus`]. No fallback: a GPU
/// that does not open, a rank the kernels do not take or too little
/// memory is an error.
pub fn cp_apr_on_gpus(
    tensor: &SparseTensor,
    opts: &AprOptions,
    ordinals: &[usize],
    on_iteration: &mut dyn FnMut(&AprIteration) -> ControlFlow<()>,
) -> Result<AprRun> {
    check_run(tensor, opts)?;
    let gpus = ordinals
        .iter()
        .map(|&o| Gpu::open(o))
        .collect::<kruskal_device::Result<Vec<_>>>()?;
    let device = gpus.first().map(|g| g.properties().name.clone());
    let model = cp_apr_gpus(&gpus, tensor, opts, on_iteration)?;
    Ok(AprRun {
        model,
        backend: "gpu",
        device,
        gpus: gpus.len(),
        note: None,
        fallback: None,
    })
}

/// A CP-APR run and where it ran.
#[derive(Clone, Debug)]
pub struct AprRun {
    pub model: AprModel,
    /// `"cpu"` or `"gpu"`.
    pub backend: &'static str,
    /// The GPU's name, when it ran on one.
    pub device: Option<String>,
    /// GPUs the run used (0 on the CPU).
    pub gpus: usize,
    /// Why a run asked for every GPU used fewer ([`apr_all_gpus`]).
    pub note: Option<String>,
    /// Why `auto` did not use the GPU.
    pub fallback: Option<String>,
}

/// Where a run goes, from the choice and what the GPU said.
#[derive(Debug, PartialEq)]
enum Placement {
    Gpu,
    Cpu { why: Option<String> },
    Refused(String),
}

/// `gpu`: the GPU's free bytes, or why none can be used.
fn place(
    choice: BackendChoice,
    gpu: std::result::Result<u64, String>,
    rank: usize,
    need: &MemoryNeed,
) -> Placement {
    if choice == BackendChoice::Cpu {
        return Placement::Cpu { why: None };
    }
    let why = match gpu {
        Ok(free) => match gpu_refusal(rank, need, free) {
            None => return Placement::Gpu,
            Some(why) => why,
        },
        Err(why) => why,
    };
    match choice {
        BackendChoice::Gpu => Placement::Refused(why),
        _ => Placement::Cpu { why: Some(why) },
    }
}

/// Runs CP-APR where `backend` says: the CPU, the first GPU, or (`Auto`)
/// the GPU when one opens, takes the rank and has the memory, else the CPU
/// with the reason in [`AprRun::fallback`].
pub fn cp_apr_on(
    tensor: &SparseTensor,
    opts: &AprOptions,
    backend: BackendChoice,
    on_iteration: &mut dyn FnMut(&AprIteration) -> ControlFlow<()>,
) -> Result<AprRun> {
    check_run(tensor, opts)?;
    let need = apr_gpu_need(tensor.dims(), tensor.nnz(), opts.rank);
    let (gpu, status) = if backend == BackendChoice::Cpu {
        (None, Ok(0))
    } else {
        match Gpu::open(0) {
            Ok(gpu) => {
                let free = gpu
                    .free_bytes()
                    .map(|b| b as u64)
                    .map_err(|e| kruskal_device::error_line(&e));
                (Some(gpu), free)
            }
            // `gpu`: the device's own error, typed (a missing library
            // says what was tried).
            Err(e) if backend == BackendChoice::Gpu => return Err(e.into()),
            Err(e) => (None, Err(fallback_reason(&e.into()))),
        }
    };
    match (place(backend, status, opts.rank, &need), gpu) {
        (Placement::Gpu, Some(gpu)) => {
            let device = Some(gpu.properties().name.clone());
            let model = cp_apr_gpu(gpu, tensor, opts, on_iteration)?;
            Ok(AprRun {
                model,
                backend: "gpu",
                device,
                gpus: 1,
                note: None,
                fallback: None,
            })
        }
        (Placement::Cpu { why }, _) => Ok(AprRun {
            model: crate::apr::cp_apr(tensor, opts, on_iteration)?,
            backend: "cpu",
            device: None,
            gpus: 0,
            note: None,
            fallback: why,
        }),
        (Placement::Refused(why), _) => Err(CpdError::Gpu(why)),
        (Placement::Gpu, None) => Err(CpdError::Gpu("no GPU was opened".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_need_counts_copies_pi_factors_and_phi() {
        // 3 modes, 10 nonzeros, rank 2: copies 3 x 10 x 16 + (9 + 3) x 8,
        // Pi 160, factors and Phi 144 each, and the partial sums.
        let need = apr_gpu_need(&[4, 3, 2], 10, 2);
        assert!(need.total() >= 576 + 160 + 288);
        assert!(need.to_string().contains("sorted copies"));
        let host = apr_gpu_host_need(&[4, 3, 2], 10, 2);
        // Factors 3 x 144; the copy (160 + 40) twice; scratch (10 + 5) x 8.
        assert_eq!(host.total(), 432 + 400 + 120);
    }

    #[test]
    fn the_backend_choice_says_why() {
        let need = apr_gpu_need(&[100, 100, 100], 10_000, 8);
        let plenty = 1u64 << 40;
        use BackendChoice::*;
        assert_eq!(
            place(Cpu, Ok(plenty), 8, &need),
            Placement::Cpu { why: None }
        );
        assert_eq!(place(Gpu, Ok(plenty), 8, &need), Placement::Gpu);
        assert_eq!(place(Auto, Ok(plenty), 8, &need), Placement::Gpu);
        // No GPU: auto says why, gpu refuses.
        let none = || Err("no CUDA driver library was found".to_string());
        assert_eq!(
            place(Auto, none(), 8, &need),
            Placement::Cpu {
                why: Some("no CUDA driver library was found".into())
            }
        );
        assert!(matches!(
            place(Gpu, none(), 8, &need),
            Placement::Refused(_)
        ));
        // Too little memory: a one-line reason with the need and the free
        // bytes.
        let Placement::Cpu { why: Some(why) } = place(Auto, Ok(1000), 8, &need) else {
            panic!("auto should fall back");
        };
        assert!(
            why.starts_with("CP-APR needs") && why.contains("free there") && !why.contains('\n'),
            "{why}"
        );
        let Placement::Refused(why) = place(Gpu, Ok(1000), 8, &need) else {
            panic!("gpu should refuse");
        };
        assert!(why.contains("Pi"), "{why}");
        // A rank the kernels do not take.
        let big = apr_gpu_need(&[10, 10], 10, 300);
        let Placement::Cpu { why: Some(why) } = place(Auto, Ok(plenty), 300, &big) else {
            panic!("auto should fall back");
        };
        assert!(why.contains("ranks 1 to 256"), "{why}");
    }

    #[test]
    fn rows_are_cut_into_ranges_of_about_equal_nonzeros() {
        // 10 rows of 10 nonzeros: 4 parts cut at the boundaries nearest 25,
        // 50 and 75 (the tie at 25 goes to the later row).
        let even: Vec<usize> = (0..=10).map(|i| i * 10).collect();
        assert_eq!(cut_rows(&even, 4), vec![0..3, 3..5, 5..8, 8..10]);
        assert_eq!(cut_rows(&even, 1), vec![0..10]);
        // One row holding most nonzeros: its neighbours come out short or
        // empty, the ranges still cover every row once, in order.
        let heavy = [0usize, 1, 2, 98, 99, 100];
        for parts in 1..=7 {
            let cuts = cut_rows(&heavy, parts);
            assert_eq!(cuts.len(), parts);
            assert_eq!(cuts[0].start, 0);
            assert_eq!(cuts[parts - 1].end, 5);
            assert!(cuts.windows(2).all(|w| w[0].end == w[1].start));
        }
        assert!(cut_rows(&heavy, 4).iter().any(|r| r.is_empty()));
        // No rows, no nonzeros.
        assert_eq!(cut_rows(&[0], 3), vec![0..0, 0..0, 0..0]);
        assert_eq!(cut_rows(&[0, 0, 0], 2), vec![0..0, 0..2]);
        // Many parts over a power-law row pointer: no part holds more than
        // its share plus the largest row.
        let mut row_ptr = vec![0usize];
        for i in 1..=1000usize {
            row_ptr.push(row_ptr[i - 1] + 10_000 / i);
        }
        let nnz = *row_ptr.last().unwrap();
        for parts in [2, 3, 4, 8] {
            for r in cut_rows(&row_ptr, parts) {
                let held = row_ptr[r.end] - row_ptr[r.start];
                assert!(held <= nnz / parts + 10_000, "{parts}: {r:?} holds {held}");
            }
        }
    }

    #[test]
    fn every_gpu_means_a_gpu_per_share_of_nonzeros() {
        let (gpus, note) = apr_all_gpus(20 * APR_MIN_NNZ_PER_GPU, 4);
        assert_eq!((gpus, note), (vec![0, 1, 2, 3], None));
        let (gpus, note) = apr_all_gpus(2 * APR_MIN_NNZ_PER_GPU + 1, 4);
        assert_eq!(gpus, [0, 1]);
        let note = note.unwrap();
        assert!(
            note.starts_with("2 of 4 GPUs") && !note.contains('\n'),
            "{note}"
        );
        let (gpus, note) = apr_all_gpus(10, 8);
        assert_eq!(gpus, [0]);
        assert!(note.unwrap().contains("1 of 8"));
        assert_eq!(apr_all_gpus(10, 1), (vec![0], None));
    }

    #[test]
    fn the_part_bytes_count_the_parts_rows_and_every_factor() {
        let dims = [4u32, 3, 2];
        // One part of everything is the one-GPU need.
        let whole: Vec<(u64, u64)> = dims.iter().map(|&d| (u64::from(d), 10)).collect();
        assert_eq!(
            kruskal_device::apr::part_bytes(&dims, 2, &whole),
            device_bytes(&dims, 10, 2)
        );
        // Half the rows and nonzeros of each mode: the copies and Pi
        // shrink, the factors and Phi do not.
        let half: Vec<(u64, u64)> = [(2, 5), (2, 5), (1, 5)].to_vec();
        let part = kruskal_device::apr::part_bytes(&dims, 2, &half);
        let full = device_bytes(&dims, 10, 2);
        let get = |v: &[(&str, u64)], n: &str| v.iter().find(|p| p.0 == n).unwrap().1;
        assert!(get(&part, "sorted copies") < get(&full, "sorted copies"));
        assert_eq!(get(&part, "Pi"), get(&full, "Pi") / 2);
        assert_eq!(get(&part, "factors"), get(&full, "factors"));
        assert_eq!(get(&part, "Phi"), get(&full, "Phi"));
    }

    fn tiny() -> SparseTensor {
        SparseTensor::new(
            vec![3, 2, 2],
            vec![vec![0, 1, 2], vec![0, 1, 1], vec![1, 0, 1]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap()
    }

    #[test]
    fn cpu_runs_say_they_ran_on_the_cpu() {
        let t = tiny();
        let mut opts = AprOptions::new(2);
        opts.max_iters = 2;
        let run = cp_apr_on(&t, &opts, BackendChoice::Cpu, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(run.backend, "cpu");
        assert!(run.fallback.is_none() && run.device.is_none());
        let alone = crate::apr::cp_apr(&t, &opts, &mut |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(run.model.factors, alone.factors);
        // Bad input is refused the same way on every backend.
        opts.kappa = -1.0;
        for b in [BackendChoice::Cpu, BackendChoice::Gpu, BackendChoice::Auto] {
            assert!(matches!(
                cp_apr_on(&t, &opts, b, &mut |_| ControlFlow::Continue(())),
                Err(CpdError::Option(_))
            ));
        }
    }

    #[test]
    fn auto_without_a_gpu_runs_on_the_cpu_and_says_why() {
        if Gpu::count().is_ok_and(|n| n > 0) {
            return; // the fallback is for machines without a usable GPU
        }
        let t = tiny();
        let mut opts = AprOptions::new(2);
        opts.max_iters = 1;
        let run = cp_apr_on(&t, &opts, BackendChoice::Auto, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(run.backend, "cpu");
        assert!(run.fallback.unwrap().contains("CUDA"));
        let e = cp_apr_on(&t, &opts, BackendChoice::Gpu, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap_err();
        assert!(matches!(e, CpdError::Device(_)), "{e}");
    }
}
