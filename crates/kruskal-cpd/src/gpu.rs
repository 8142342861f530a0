//! The one-GPU backend: the tensor is uploaded once, and factors, Gram
//! inputs and MTTKRP outputs stay on the device for the whole run; only
//! R x R matrices and length-R vectors cross to the host (see
//! `kruskal_device::dense`).
//!
//! With several candidate engines (`--kernel auto`), the first iteration
//! times each candidate once per mode (after one untimed sweep that
//! compiles their kernels), keeps the fastest result of each mode, and
//! then settles on a plan: the fastest engine per mode, except that
//! `flycoo` is taken for every mode or none (its tensor copy moves from one
//! mode's order to the next, so it must run the modes in turn). Engines the
//! plan does not use are dropped, freeing their memory.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DriverError};
use kruskal_device::DeviceFactors;
use kruskal_device::admm::{AdmmKernels, InnerParams, InnerStats, RowList};

use crate::admm::DataRows;
use kruskal_device::dense::{DenseKernels, check_rank};
use kruskal_device::engines::flycoo::element_stride;
use kruskal_device::{DeviceError, Gpu, GpuEngine, GpuMttkrp, GpuOptions, build_engines};
use kruskal_formats::SparseTensor;
use ndarray::Array2;
use serde::Serialize;

use crate::als::Arrangement;
use crate::backend::{Backend, ColumnNorms};
use crate::error::{CpdError, Result};

/// A failed driver call of this backend, as the device crate reports its
/// own: `CUDA {what}: {the driver's error}`.
fn driver(what: &'static str) -> impl Fn(DriverError) -> CpdError + Copy {
    move |error| {
        CpdError::Device(DeviceError::Driver {
            what: what.to_string(),
            error,
        })
    }
}

/// One candidate engine: what it is, and the engine while it is kept.
struct Candidate {
    label: String,
    kernel: GpuEngine,
    engine: Option<Box<dyn GpuMttkrp>>,
}

/// What the first iteration measured and chose (for `kruskal cpd`'s
/// output).
#[derive(Clone, Debug, Serialize)]
pub struct KernelPlan {
    /// The candidates, as `--kernel` spells them (with launch options).
    pub candidates: Vec<String>,
    /// Milliseconds of each candidate (outer) on each mode (inner), from
    /// the timed run of the first iteration; empty with one candidate.
    pub trial_ms: Vec<Vec<f32>>,
    /// The engine chosen for each mode.
    pub per_mode: Vec<String>,
    /// Seconds the choice cost the first iteration: the warm-up sweep of
    /// every candidate (kernel compilation included) and the timed runs of
    /// the candidates that were not the fastest; 0 with one candidate.
    pub choice_s: f64,
}

/// Device bytes a run needs at `rank` with the engine that needs the most
/// (two FLYCOO copies), plus the factors and the MTTKRP outputs: what
/// `--backend auto` checks against free memory before it uploads anything.
pub fn required_bytes(t: &SparseTensor, rank: usize) -> usize {
    let rows: usize = t.dims().iter().map(|&d| d as usize).sum();
    2 * t.nnz() * element_stride(t.nmodes()) * 4 + 2 * rows * rank * 4
}

/// The GPU backend.
pub struct GpuBackend {
    gpu: Arc<Gpu>,
    dims: Vec<u32>,
    norm_sq: f64,
    candidates: Vec<Candidate>,
    /// Candidate index per mode, once chosen.
    plan: Option<Vec<usize>>,
    /// Trial milliseconds, candidate x mode (NaN until measured).
    trial_ms: Vec<Vec<f32>>,
    warmed: bool,
    /// What choosing cost so far ([`KernelPlan::choice_s`]).
    choice_s: f64,
    factors: Option<DeviceFactors>,
    dense: Option<DenseKernels>,
    outputs: Vec<Option<CudaSlice<f32>>>,
    /// Per mode, the fit's inner product as the last update left it.
    inner: Vec<Option<InnerSums>>,
    /// AO-ADMM's H and U, once a constrained run's first inner loop ran.
    admm: Option<DeviceAdmm>,
    /// AO-ADMM's rows with data ([`Backend::set_data_rows`]).
    data_rows: Option<Arc<DataRows>>,
}

/// AO-ADMM on the device: the kernels, and H and U (f64, `dims[m] x
/// rank`, or a row per row with data) of every mode with its list of rows,
/// made at the mode's first inner loop and kept until the factors are
/// loaded again or handed back.
struct DeviceAdmm {
    kernels: AdmmKernels,
    h: Vec<Option<CudaSlice<f64>>>,
    u: Vec<Option<CudaSlice<f64>>>,
    lists: Vec<Option<RowList>>,
    /// The f32 rows with data of the last mode scaled that has a list
    /// (`admm_scale` writes them): their Gram is the factor's, at a
    /// fraction of its rows. Sized for the longest list so far.
    compact: Option<CudaSlice<f32>>,
}

/// `sum_i M(i, r) A(i, r)` from a mode's update, and the column scales
/// applied to A since: gives the fit's inner products without another pass
/// over M and A (equal to the sums over the scaled factor up to the
/// rounding of the scaled entries).
#[derive(Clone)]
pub(crate) struct InnerSums {
    sums: Vec<f64>,
    scales: Option<Vec<f32>>,
}

impl InnerSums {
    pub(crate) fn new(sums: Vec<f64>) -> Self {
        InnerSums { sums, scales: None }
    }

    /// Records that A's columns were multiplied by `inv`.
    pub(crate) fn scale(&mut self, inv: &[f32]) {
        let s = self.scales.get_or_insert_with(|| vec![1.0; inv.len()]);
        s.iter_mut().zip(inv).for_each(|(s, &i)| *s *= i);
    }

    /// `sum_i M(i, r) A(i, r)` for the current A.
    pub(crate) fn products(&self) -> Vec<f64> {
        match &self.scales {
            Some(s) => self
                .sums
                .iter()
                .zip(s)
                .map(|(&x, &s)| x * f64::from(s))
                .collect(),
            None => self.sums.clone(),
        }
    }

    /// The inner products of `mode`, or the error saying what must come
    /// first.
    pub(crate) fn of(inner: &[Option<InnerSums>], mode: usize) -> Result<Vec<f64>> {
        inner
            .get(mode)
            .and_then(Option::as_ref)
            .map(InnerSums::products)
            .ok_or_else(|| {
                CpdError::Backend(format!(
                    "the inner products of mode {mode} need its MTTKRP and update first"
                ))
            })
    }
}

impl GpuBackend {
    /// Builds every candidate engine's device copy of `t` on `gpu`. One
    /// candidate fixes the engine; several are tried on the first
    /// iteration. A candidate that does not fit in memory is skipped while
    /// others remain (the error is returned when none fits).
    pub fn new(
        gpu: Arc<Gpu>,
        t: &SparseTensor,
        candidates: &[(GpuEngine, GpuOptions)],
    ) -> Result<Self> {
        if candidates.is_empty() {
            return Err(CpdError::Option("no GPU kernel to run".into()));
        }
        let mut built = Vec::new();
        let mut last_err = None;
        let engines = build_engines(gpu.clone(), t, candidates);
        for ((kernel, opts), engine) in candidates.iter().zip(engines) {
            let kernel = kernel.resolve();
            match engine {
                Ok(engine) => built.push(Candidate {
                    label: label(kernel, opts),
                    kernel,
                    engine: Some(engine),
                }),
                Err(e @ DeviceError::OutOfMemory { .. }) if candidates.len() > 1 => {
                    last_err = Some(e)
                }
                Err(e) => return Err(e.into()),
            }
        }
        if built.is_empty() {
            return Err(last_err.expect("an error per candidate").into());
        }
        let n = t.nmodes();
        let plan = (built.len() == 1).then(|| vec![0; n]);
        Ok(GpuBackend {
            trial_ms: vec![vec![f32::NAN; n]; built.len()],
            warmed: plan.is_some(),
            choice_s: 0.0,
            candidates: built,
            plan,
            gpu,
            dims: t.dims().to_vec(),
            norm_sq: t.norm_sq(),
            factors: None,
            dense: None,
            outputs: (0..n).map(|_| None).collect(),
            inner: vec![None; n],
            admm: None,
            data_rows: None,
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The steps of building the layout on the device, with their seconds
    /// (see `GpuMttkrp::preparation`; the candidates built together share
    /// them); empty when the host built it.
    pub fn layout_steps(&self) -> &[(&'static str, f64)] {
        self.candidates
            .iter()
            .filter_map(|c| c.engine.as_ref())
            .map(|e| e.preparation())
            .find(|p| !p.is_empty())
            .unwrap_or(&[])
    }

    /// The candidates and, once the first iteration ran, the choice.
    pub fn plan(&self) -> KernelPlan {
        let n = self.dims.len();
        let per_mode = match &self.plan {
            Some(p) => p
                .iter()
                .map(|&c| self.candidates[c].label.clone())
                .collect(),
            None => vec!["(not chosen yet)".to_string(); n],
        };
        KernelPlan {
            candidates: self.candidates.iter().map(|c| c.label.clone()).collect(),
            trial_ms: if self.candidates.len() > 1 {
                self.trial_ms.clone()
            } else {
                Vec::new()
            },
            per_mode,
            choice_s: self.choice_s,
        }
    }

    fn rank(&self) -> Result<usize> {
        self.factors
            .as_ref()
            .map(DeviceFactors::rank)
            .ok_or(CpdError::NoFactors)
    }

    fn factors(&self) -> Result<&DeviceFactors> {
        self.factors.as_ref().ok_or(CpdError::NoFactors)
    }

    /// The output buffer of `mode`, allocated on first use.
    fn ensure_output(&mut self, mode: usize) -> Result<()> {
        let len = self.dims[mode] as usize * self.rank()?;
        if self.outputs[mode].as_ref().is_none_or(|o| o.len() != len) {
            self.outputs[mode] = None;
            self.outputs[mode] = Some(self.gpu.alloc_zeros("an MTTKRP output", len)?);
        }
        Ok(())
    }

    /// One untimed sweep of every candidate over every mode: compiles the
    /// kernels (NVRTC, or the disk cache), so the trial times only runs.
    fn warm_up(&mut self) -> Result<()> {
        let start = std::time::Instant::now();
        for m in 0..self.dims.len() {
            self.ensure_output(m)?;
        }
        let factors = self.factors.as_ref().expect("checked by the caller");
        for c in &mut self.candidates {
            let engine = c.engine.as_mut().expect("all kept before the plan");
            for (m, out) in self.outputs.iter_mut().enumerate() {
                engine.mttkrp(m, factors, out.as_mut().expect("allocated above"))?;
            }
        }
        self.gpu
            .stream()
            .synchronize()
            .map_err(driver("waiting for the warm-up"))?;
        self.warmed = true;
        self.choice_s += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// Times every candidate once on `mode`, keeping the fastest result in
    /// the mode's output; after the last mode, settles the plan.
    fn trial(&mut self, mode: usize) -> Result<()> {
        if !self.warmed {
            self.warm_up()?;
        }
        self.ensure_output(mode)?;
        let len = self.dims[mode] as usize * self.rank()?;
        let mut spare = self.gpu.alloc_zeros::<f32>("a trial MTTKRP output", len)?;
        let stream = self.gpu.stream().clone();
        let (start, end) = (self.gpu.timing_event()?, self.gpu.timing_event()?);
        let event = driver("timing a trial");
        let mut best = f32::INFINITY;
        let factors = self.factors.as_ref().expect("checked by the caller");
        for (k, c) in self.candidates.iter_mut().enumerate() {
            let engine = c.engine.as_mut().expect("all kept before the plan");
            let out = if k == 0 {
                self.outputs[mode].as_mut().expect("allocated above")
            } else {
                &mut spare
            };
            start.record(&stream).map_err(event)?;
            engine.mttkrp(mode, factors, out)?;
            end.record(&stream).map_err(event)?;
            end.synchronize().map_err(event)?;
            let ms = start.elapsed_ms(&end).map_err(event)?;
            self.trial_ms[k][mode] = ms;
            if ms < best {
                best = ms;
                if k > 0 {
                    std::mem::swap(self.outputs[mode].as_mut().expect("allocated"), &mut spare);
                }
            }
        }
        // The runs of this mode beyond the fastest were the choice's cost.
        let runs: f64 = self.trial_ms.iter().map(|t| f64::from(t[mode])).sum();
        self.choice_s += (runs - f64::from(best)) * 1e-3;
        if self.trial_ms.iter().all(|t| t.iter().all(|x| !x.is_nan())) {
            self.settle();
        }
        Ok(())
    }

    /// Chooses the plan from the trial times and drops unused engines.
    fn settle(&mut self) {
        let n = self.dims.len();
        let total = |c: usize| self.trial_ms[c].iter().map(|&x| f64::from(x)).sum::<f64>();
        let others: Vec<usize> = (0..self.candidates.len())
            .filter(|&c| self.candidates[c].kernel != GpuEngine::Flycoo)
            .collect();
        let per_mode: Option<Vec<usize>> = (!others.is_empty()).then(|| {
            (0..n)
                .map(|m| {
                    *others
                        .iter()
                        .min_by(|&&a, &&b| self.trial_ms[a][m].total_cmp(&self.trial_ms[b][m]))
                        .expect("not empty")
                })
                .collect()
        });
        let flycoo = (0..self.candidates.len())
            .filter(|&c| self.candidates[c].kernel == GpuEngine::Flycoo)
            .min_by(|&a, &b| total(a).total_cmp(&total(b)));
        let plan = match (per_mode, flycoo) {
            (Some(p), Some(f)) => {
                let mixed: f64 = p
                    .iter()
                    .enumerate()
                    .map(|(m, &c)| f64::from(self.trial_ms[c][m]))
                    .sum();
                if total(f) < mixed { vec![f; n] } else { p }
            }
            (Some(p), None) => p,
            (None, Some(f)) => vec![f; n],
            (None, None) => unreachable!("at least one candidate"),
        };
        for (c, cand) in self.candidates.iter_mut().enumerate() {
            if !plan.contains(&c) {
                cand.engine = None;
            }
        }
        self.plan = Some(plan);
    }
}

/// `fcoo`, or `fcoo threadlen=16` when options differ from the defaults.
fn label(kernel: GpuEngine, opts: &GpuOptions) -> String {
    let mut s = kernel.name().to_string();
    match kernel {
        GpuEngine::Fcoo => {
            if let Some(t) = opts.threadlen {
                s += &format!(" threadlen={t}");
            }
        }
        GpuEngine::Hicoo => {
            if let Some(b) = opts.block_bits {
                s += &format!(" block-bits={b}");
            }
        }
        GpuEngine::Flycoo => {
            if let Some(k) = opts.kappa {
                s += &format!(" kappa={k}");
            }
            if opts.deterministic {
                s += " deterministic";
            }
        }
        _ => {}
    }
    s
}

impl Backend for GpuBackend {
    fn describe(&self) -> String {
        let p = self.gpu.properties();
        let plan = self.plan();
        let kernels = if self.candidates.len() == 1 {
            format!("{} kernel", plan.candidates[0])
        } else {
            format!("kernel auto over {}", plan.candidates.join(", "))
        };
        format!("gpu {} ({}), {kernels}", p.ordinal, p.name)
    }

    fn dims(&self) -> &[u32] {
        &self.dims
    }

    fn tensor_norm_sq(&self) -> f64 {
        self.norm_sq
    }

    fn load_factors(&mut self, factors: Vec<Array2<f32>>) -> Result<()> {
        let rank = crate::check_factor_shapes(&self.dims, &factors)?;
        check_rank(rank)?;
        self.factors = None;
        self.factors = Some(DeviceFactors::upload(&self.gpu, &factors)?);
        self.ready_dense(rank)
    }

    /// Draws the factors on the device: the host's [`crate::random_factors`]
    /// bit for bit, without the host's draw and the upload.
    fn load_random(&mut self, rank: usize, seed: u64) -> Result<()> {
        check_rank(rank)?;
        self.factors = None;
        self.factors = Some(DeviceFactors::random(
            &self.gpu,
            &self.dims,
            rank,
            seed,
            crate::als::RANDOM_BLOCK,
        )?);
        self.ready_dense(rank)
    }

    fn gram(&mut self, mode: usize) -> Result<Array2<f64>> {
        let rows = self.dims[mode] as usize;
        let rank = self.rank()?;
        let dense = self.dense.as_mut().expect("made with the factors");
        let factors = self.factors.as_mut().expect("checked by rank()");
        let g = dense.scale_gram(&mut factors.mode_mut(mode), None, rows)?;
        square(g, rank)
    }

    fn mttkrp(&mut self, mode: usize) -> Result<()> {
        self.factors()?;
        self.inner[mode] = None;
        let Some(plan) = &self.plan else {
            return self.trial(mode);
        };
        let c = plan[mode];
        self.ensure_output(mode)?;
        let factors = self.factors.as_ref().expect("checked above");
        let engine = self.candidates[c]
            .engine
            .as_mut()
            .expect("the plan's engines are kept");
        engine
            .mttkrp(
                mode,
                factors,
                self.outputs[mode].as_mut().expect("allocated"),
            )
            .map_err(CpdError::from)
    }

    fn sync(&mut self) -> Result<()> {
        self.gpu
            .stream()
            .synchronize()
            .map_err(driver("synchronizing the stream"))
    }

    fn solve_update(&mut self, mode: usize, w: &Array2<f64>) -> Result<ColumnNorms> {
        let rows = self.dims[mode] as usize;
        self.rank()?;
        let m = self.outputs[mode]
            .as_ref()
            .ok_or_else(|| CpdError::Backend(format!("no MTTKRP computed for mode {mode}")))?;
        let w = w.as_standard_layout();
        let dense = self.dense.as_mut().expect("made with the factors");
        let factors = self.factors.as_mut().expect("checked by rank()");
        let stats = dense.update(
            &m.as_view(),
            w.as_slice().expect("standard layout"),
            &mut factors.mode_mut(mode),
            rows,
        )?;
        self.inner[mode] = Some(InnerSums::new(stats.inner));
        Ok(ColumnNorms {
            two: stats.sumsq.into_iter().map(f64::sqrt).collect(),
            max_abs: stats.max_abs,
        })
    }

    fn scale_and_gram(&mut self, mode: usize, divisors: &[f64]) -> Result<Array2<f64>> {
        let rows = self.dims[mode] as usize;
        let rank = self.rank()?;
        // The same f32 scales as the CPU backend.
        let inv: Vec<f32> = divisors.iter().map(|&d| (1.0 / d) as f32).collect();
        let dense = self.dense.as_mut().expect("made with the factors");
        let factors = self.factors.as_mut().expect("checked by rank()");
        let g = dense.scale_gram(&mut factors.mode_mut(mode), Some(&inv), rows)?;
        if let Some(inner) = &mut self.inner[mode] {
            inner.scale(&inv);
        }
        square(g, rank)
    }

    /// From the update's `sum_i M(i, r) A(i, r)` times the scales applied
    /// since: equal to the sum over the scaled factor up to the rounding of
    /// the scaled entries, without another pass over M and A.
    fn inner_products(&mut self, mode: usize) -> Result<Vec<f64>> {
        InnerSums::of(&self.inner, mode)
    }

    /// The inner loop runs on the device ([`AdmmKernels`]), one launch per
    /// mode, each row stopping on its own: H and U stay there.
    fn runs_admm(&self) -> bool {
        true
    }

    fn admm_inner(
        &mut self,
        mode: usize,
        w: &Array2<f64>,
        params: &InnerParams,
    ) -> Result<InnerStats> {
        let rows = self.dims[mode] as usize;
        let rank = self.rank()?;
        let n = self.dims.len();
        let k = self.outputs[mode]
            .as_ref()
            .ok_or_else(|| CpdError::Backend(format!("no MTTKRP computed for mode {mode}")))?;
        if self.admm.as_ref().is_none_or(|a| a.kernels.rank() != rank) {
            self.admm = None;
            self.admm = Some(DeviceAdmm {
                kernels: AdmmKernels::new(self.gpu.clone(), rank)?,
                h: (0..n).map(|_| None).collect(),
                u: (0..n).map(|_| None).collect(),
                lists: (0..n).map(|_| None).collect(),
                compact: None,
            });
        }
        let admm = self.admm.as_mut().expect("made above");
        if admm.h[mode].is_none() {
            // A cold start: H = U = 0 (see kruskal_cpd::admm). With rows
            // with data, H and U hold those rows only, and the factor's
            // other rows are 0 from now on (their solution; no launch
            // writes them again).
            let list = self.data_rows.as_deref().and_then(|d| d.mode(mode));
            let count = list.map_or(rows, <[u32]>::len);
            if let Some(list) = list {
                admm.lists[mode] = Some(RowList::upload(&self.gpu, list, rows)?);
                let factors = self.factors.as_mut().ok_or(CpdError::NoFactors)?;
                self.gpu
                    .stream()
                    .memset_zeros(&mut factors.mode_mut(mode))
                    .map_err(|e| CpdError::Gpu(format!("zeroing the factor: {e}")))?;
            }
            admm.h[mode] = Some(self.gpu.alloc_zeros("ADMM's H", count * rank)?);
            admm.u[mode] = Some(self.gpu.alloc_zeros("ADMM's U", count * rank)?);
        }
        let (h, u) = match (admm.h[mode].as_mut(), admm.u[mode].as_mut()) {
            (Some(h), Some(u)) => (h, u),
            _ => unreachable!("made together above"),
        };
        let w = w.as_standard_layout();
        let stats = admm.kernels.inner_loop(
            &k.as_view(),
            w.as_slice().expect("standard layout"),
            h,
            u,
            rows,
            admm.lists[mode].as_ref(),
            params,
        )?;
        self.inner[mode] = Some(InnerSums::new(stats.inner.clone()));
        Ok(stats)
    }

    fn admm_scale(&mut self, mode: usize, divisors: &[f64]) -> Result<Array2<f64>> {
        let rows = self.dims[mode] as usize;
        let rank = self.rank()?;
        let (admm, factors) = (self.admm.as_mut(), self.factors.as_mut());
        let (Some(admm), Some(factors)) = (admm, factors) else {
            return Err(CpdError::Backend(format!(
                "the ADMM scaling of mode {} needs its inner loop first",
                mode + 1
            )));
        };
        let (Some(h), Some(u)) = (admm.h[mode].as_mut(), admm.u[mode].as_mut()) else {
            return Err(CpdError::Backend(format!(
                "the ADMM scaling of mode {} needs its inner loop first",
                mode + 1
            )));
        };
        // With a list, the Gram is taken over the rows with data only (a
        // compact copy that admm_scale writes beside the factor).
        let count = admm.lists[mode].as_ref().map(RowList::len);
        if let Some(count) = count {
            if admm.compact.as_ref().is_none_or(|c| c.len() < count * rank) {
                admm.compact = None;
                admm.compact = Some(
                    self.gpu
                        .alloc_zeros("ADMM's rows with data", count * rank)?,
                );
            }
        }
        admm.kernels.scale(
            h,
            u,
            &mut factors.mode_mut(mode),
            count.and(admm.compact.as_mut()),
            divisors,
            rows,
            admm.lists[mode].as_ref(),
        )?;
        // The inner products as the ALS path keeps them: the update's sums
        // times the f32 scales.
        let inv: Vec<f32> = divisors.iter().map(|&d| (1.0 / d) as f32).collect();
        if let Some(inner) = &mut self.inner[mode] {
            inner.scale(&inv);
        }
        let dense = self.dense.as_mut().expect("made with the factors");
        let g = match (count, admm.compact.as_mut()) {
            (Some(count), Some(c)) if count > 0 => {
                dense.scale_gram(&mut c.slice_mut(..count * rank), None, count)?
            }
            (Some(_), _) => vec![0.0; rank * rank],
            (None, _) => dense.scale_gram(&mut factors.mode_mut(mode), None, rows)?,
        };
        square(g, rank)
    }

    fn set_data_rows(&mut self, rows: Arc<DataRows>) -> Result<()> {
        rows.check(&self.dims)?;
        self.data_rows = Some(rows);
        self.admm = None;
        Ok(())
    }

    fn take_factors(&mut self) -> Result<Vec<Array2<f32>>> {
        self.admm = None;
        let factors = self.factors.take().ok_or(CpdError::NoFactors)?;
        factors.download(&self.gpu).map_err(CpdError::from)
    }

    /// The column statistics on the device, then one download that
    /// arranges the rows as they arrive: the host makes no pass of its own
    /// over the factors.
    fn take_arranged(
        &mut self,
        lambda: Vec<f64>,
        keep_sign: &[bool],
    ) -> Result<(Vec<f64>, Vec<Array2<f32>>)> {
        self.rank()?;
        self.admm = None;
        let factors = self.factors.take().ok_or(CpdError::NoFactors)?;
        let dense = self.dense.as_mut().expect("made with the factors");
        let stats = (0..self.dims.len())
            .map(|m| {
                let s = dense.column_extremes(&factors.mode(m), self.dims[m] as usize)?;
                Ok((s.sumsq, s.largest))
            })
            .collect::<Result<Vec<_>>>()?;
        let plan = Arrangement::plan(lambda, &stats, keep_sign);
        let scales: Vec<Vec<f32>> = (0..self.dims.len()).map(|m| plan.scales(m)).collect();
        let arranged = factors
            .download_with(&self.gpu, |mode, src, dst| {
                plan.rows(&scales[mode], src, dst)
            })
            .map_err(CpdError::from)?;
        Ok((plan.lambda, arranged))
    }
}

impl GpuBackend {
    /// The dense kernels for `rank` (kept when the rank is the same) and
    /// no inner products: the tail of loading factors.
    fn ready_dense(&mut self, rank: usize) -> Result<()> {
        if self.dense.as_ref().is_none_or(|d| d.rank() != rank) {
            self.dense = None;
            self.dense = Some(DenseKernels::new(self.gpu.clone(), rank)?);
        }
        self.inner = vec![None; self.dims.len()];
        // A new start: H and U start again from the new factors.
        self.admm = None;
        Ok(())
    }
}

pub(crate) fn square(g: Vec<f64>, rank: usize) -> Result<Array2<f64>> {
    Array2::from_shape_vec((rank, rank), g).map_err(|e| CpdError::Backend(e.to_string()))
}
