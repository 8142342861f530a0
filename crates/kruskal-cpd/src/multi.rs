//! The several-GPU backend: CPD-ALS over a [`GpuGroup`] (AMPED). Each GPU
//! computes the MTTKRP of its shard, updates its own rows, and after the
//! mode's scaling the rows are all-gathered so every GPU holds the whole
//! factor for the next mode. Only R x R matrices and length-R vectors reach
//! the host, as with one GPU.

use std::sync::Arc;
use std::time::Instant;

use kruskal_group::{GpuGroup, MttkrpTimes};
use ndarray::Array2;
use serde::Serialize;

use crate::admm::DataRows;
use crate::backend::{Backend, ColumnNorms};
use crate::error::{CpdError, Result};
use crate::gpu::{InnerSums, square};

/// Where one mode's time went, summed over the iterations measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ModeBreakdown {
    /// MTTKRP calls measured.
    pub calls: usize,
    /// Host-to-device copy time, slowest GPU (ms, summed over calls).
    pub h2d_ms: f64,
    /// Kernel time, slowest GPU (ms).
    pub kernel_ms: f64,
    /// MTTKRP from first copy or kernel to last, slowest GPU (ms).
    pub mttkrp_ms: f64,
    /// Dense update and Gram, host wall time (ms).
    pub update_ms: f64,
    /// Of `update_ms`, the all-reduces of the column statistics and the
    /// Gram across processes (ms; 0 in one process).
    pub all_reduce_ms: f64,
    /// Row exchange, slowest GPU (ms).
    pub exchange_ms: f64,
    /// Which rows the exchange sends: `read` (only those each GPU reads),
    /// `all` (the all-gather) or `none` (a split plan's cut mode).
    pub exchange_rows: &'static str,
    /// Bytes the exchange moves per call, over all GPUs.
    pub exchange_bytes: u64,
    /// Bytes the all-gather would move per call.
    pub all_gather_bytes: u64,
    /// Reduction of the partial sums onto their owners after the MTTKRP
    /// (a split plan's partial modes), slowest GPU (ms).
    pub reduce_ms: f64,
    /// Bytes that reduction sends per call, over all GPUs.
    pub reduce_bytes: u64,
    /// Per GPU, MTTKRP time (ms), to show imbalance.
    pub per_gpu_mttkrp_ms: Vec<f64>,
}

/// The multi-GPU backend.
pub struct GroupBackend {
    group: GpuGroup,
    dims: Vec<u32>,
    norm_sq: f64,
    inner: Vec<Option<InnerSums>>,
    breakdown: Vec<ModeBreakdown>,
    /// Calls to skip before the breakdown starts counting (the first
    /// iteration compiles kernels).
    skip: Vec<usize>,
    /// The mode of the last queued MTTKRP.
    current: usize,
    /// Whether `sync` left the wait for the last MTTKRP to the next call
    /// (the update waits for it on the GPUs, with no round trip of its
    /// own).
    deferred: bool,
    /// The last MTTKRP's time (s, slowest GPU, its reduction included)
    /// when the update waited for it, until the driver takes it.
    waited_s: Option<f64>,
    /// Per mode, whether its exchange left running is to be counted when
    /// its time arrives.
    exchange_counted: Vec<bool>,
}

impl GroupBackend {
    /// Wraps a group built for `t` (its norm and dims).
    pub fn new(group: GpuGroup, t: &kruskal_formats::SparseTensor) -> Self {
        Self::with_norm(group, t.norm_sq())
    }

    /// Wraps a group whose tensor has squared norm `norm_sq` (across
    /// processes, where no process holds the whole tensor).
    pub fn with_norm(group: GpuGroup, norm_sq: f64) -> Self {
        let dims = group.plan().dims().to_vec();
        let n = dims.len();
        let breakdown = (0..n)
            .map(|mode| {
                let v = group.exchange_volume(mode);
                ModeBreakdown {
                    exchange_rows: v.rows_name(),
                    exchange_bytes: v.bytes,
                    all_gather_bytes: v.all_gather_bytes,
                    reduce_bytes: v.reduce_bytes,
                    ..ModeBreakdown::default()
                }
            })
            .collect();
        GroupBackend {
            group,
            dims,
            norm_sq,
            inner: vec![None; n],
            breakdown,
            skip: vec![1; n],
            current: 0,
            deferred: false,
            waited_s: None,
            exchange_counted: vec![false; n],
        }
    }

    pub fn group(&self) -> &GpuGroup {
        &self.group
    }

    /// The per-mode time split from the second iteration on.
    pub fn breakdown(&self) -> &[ModeBreakdown] {
        &self.breakdown
    }

    fn counting(&self, mode: usize) -> bool {
        self.skip[mode] == 0
    }

    /// After a mode's scaling (ALS's or AO-ADMM's, begun at `started`,
    /// giving the Gram `g`): the inner products scaled by `inv`, the rows
    /// exchanged (unless `exchanged` gives the milliseconds of an exchange
    /// already run or left running), the breakdown counted; returns the
    /// Gram as a matrix.
    fn finish_mode(
        &mut self,
        mode: usize,
        g: Vec<f64>,
        inv: &[f32],
        started: Instant,
        exchanged: Option<f64>,
    ) -> Result<Array2<f64>> {
        if let Some(inner) = &mut self.inner[mode] {
            inner.scale(inv);
        }
        let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
        let (update_ms, exchange_ms) = match exchanged {
            Some(ms) => ((elapsed_ms - ms).max(0.0), ms),
            None => (elapsed_ms, self.group.exchange_rows(mode)?),
        };
        let across_ms = self.group.take_across_ms();
        self.exchange_counted[mode] = self.counting(mode);
        if self.counting(mode) {
            let b = &mut self.breakdown[mode];
            b.update_ms += update_ms;
            b.all_reduce_ms += across_ms;
            b.exchange_ms += exchange_ms;
        } else {
            self.skip[mode] -= 1;
        }
        square(g, self.group.rank())
    }

    /// Counts one MTTKRP of the current mode from each GPU's times.
    fn count_mttkrp(&mut self, times: &[MttkrpTimes]) {
        let mode = self.current;
        if !self.counting(mode) {
            return;
        }
        let b = &mut self.breakdown[mode];
        let slowest = |f: fn(&MttkrpTimes) -> f64| times.iter().map(f).fold(0.0, f64::max);
        b.calls += 1;
        b.h2d_ms += slowest(|t| t.h2d_ms);
        b.kernel_ms += slowest(|t| t.kernel_ms);
        b.mttkrp_ms += slowest(|t| t.total_ms);
        b.reduce_ms += slowest(|t| t.reduce_ms);
        b.per_gpu_mttkrp_ms.resize(times.len(), 0.0);
        for (acc, t) in b.per_gpu_mttkrp_ms.iter_mut().zip(times) {
            *acc += t.total_ms;
        }
    }

    /// Counts the exchange left running that the GPUs' times report (the
    /// slowest GPU's).
    fn count_exchanges(&mut self, times: &[MttkrpTimes]) {
        let mut slowest: Option<(usize, f64)> = None;
        for (mode, ms) in times.iter().filter_map(|t| t.exchanged) {
            let ms = slowest.map_or(ms, |(_, s)| s.max(ms));
            slowest = Some((mode, ms));
        }
        if let Some((mode, ms)) = slowest {
            if self.exchange_counted[mode] {
                self.breakdown[mode].exchange_ms += ms;
            }
        }
    }

    /// Waits for the MTTKRP whose wait `sync` deferred, if any.
    fn settle(&mut self) -> Result<()> {
        if std::mem::take(&mut self.deferred) {
            let times: Vec<MttkrpTimes> = self.group.sync()?;
            self.count_mttkrp(&times);
            self.count_exchanges(&times);
        }
        Ok(())
    }
}

impl Backend for GroupBackend {
    fn describe(&self) -> String {
        let gpus = self.group.gpus();
        let names: Vec<String> = gpus
            .iter()
            .map(|g| g.properties().ordinal.to_string())
            .collect();
        let exchange = match self.group.exchange() {
            Some(e) => format!(", {} exchange", e.name()),
            None => String::new(),
        };
        if let Some((rank, world)) = self.group.process() {
            return format!(
                "rank {rank} of {world} processes: GPU {} ({}), shard kernel{exchange} across processes",
                names.join(","),
                gpus[0].properties().name
            );
        }
        format!(
            "{} GPUs ({}: {}), shard kernel{exchange}",
            gpus.len(),
            names.join(","),
            gpus[0].properties().name
        )
    }

    fn dims(&self) -> &[u32] {
        &self.dims
    }

    fn tensor_norm_sq(&self) -> f64 {
        self.norm_sq
    }

    fn load_factors(&mut self, factors: Vec<Array2<f32>>) -> Result<()> {
        self.settle()?;
        crate::check_factor_shapes(&self.dims, &factors)?;
        // Each mode dropped once it is uploaded.
        for (mode, f) in factors.into_iter().enumerate() {
            self.group.load_mode(mode, f)?;
        }
        self.inner = vec![None; self.dims.len()];
        Ok(())
    }

    /// [`crate::random_factors`], one mode at a time, drawn on the GPUs
    /// ([`GpuGroup::draw_mode`]) or, where a GPU lacks the room, on the
    /// host and uploaded: the host never holds every factor.
    fn load_random(&mut self, rank: usize, seed: u64) -> Result<()> {
        self.settle()?;
        if rank != self.group.rank() {
            return Err(CpdError::Shape(format!(
                "factors of rank {rank} for a group built for rank {}",
                self.group.rank()
            )));
        }
        for (mode, &dim) in self.dims.iter().enumerate() {
            // Drawn on the GPUs where they have room for a scratch copy of
            // the mode, else on the host and uploaded (the same numbers).
            if !self.group.draw_mode(mode, seed, crate::als::RANDOM_BLOCK)? {
                let f = crate::als::random_factor(mode, dim, rank, seed);
                self.group.load_mode(mode, f)?;
            }
        }
        self.inner = vec![None; self.dims.len()];
        Ok(())
    }

    fn gram(&mut self, mode: usize) -> Result<Array2<f64>> {
        self.settle()?;
        let g = self.group.scale_gram(mode, None)?;
        square(g, self.group.rank())
    }

    fn mttkrp(&mut self, mode: usize) -> Result<()> {
        self.settle()?;
        self.inner[mode] = None;
        self.current = mode;
        self.group.mttkrp(mode).map_err(CpdError::from)
    }

    /// Leaves the wait to the next call: the driver calls `solve_update`
    /// right after, whose command waits for the MTTKRP on each GPU and
    /// brings its times back (one round trip fewer per mode); any other
    /// call waits first ([`GroupBackend::settle`]).
    fn sync(&mut self) -> Result<()> {
        self.deferred = true;
        Ok(())
    }

    fn solve_update(&mut self, mode: usize, w: &Array2<f64>) -> Result<ColumnNorms> {
        let t = Instant::now();
        let w = w.as_standard_layout();
        let stats = self
            .group
            .update(mode, w.as_slice().expect("standard layout"))?;
        let waited = self.group.take_waited();
        // An exchange left running is reported by the first wait after it,
        // whichever call made that wait.
        self.count_exchanges(&waited.times);
        let update_ms = if std::mem::take(&mut self.deferred) {
            self.count_mttkrp(&waited.times);
            let slowest = waited
                .times
                .iter()
                .map(|t| t.total_ms + t.reduce_ms)
                .fold(0.0, f64::max);
            self.waited_s = Some(slowest / 1e3);
            waited.update_ms
        } else {
            t.elapsed().as_secs_f64() * 1e3
        };
        if self.counting(mode) {
            self.breakdown[mode].update_ms += update_ms;
        }
        self.inner[mode] = Some(InnerSums::new(stats.inner));
        Ok(ColumnNorms {
            two: stats.sumsq.into_iter().map(f64::sqrt).collect(),
            max_abs: stats.max_abs,
        })
    }

    fn take_waited_mttkrp_s(&mut self) -> Option<f64> {
        self.waited_s.take()
    }

    /// The scaling, the Gram and the exchange in one command: an exchange
    /// by NCCL is left running behind the Gram, and the next MTTKRP
    /// queues behind it.
    fn scale_and_gram(&mut self, mode: usize, divisors: &[f64]) -> Result<Array2<f64>> {
        self.settle()?;
        let t = Instant::now();
        let inv: Vec<f32> = divisors.iter().map(|&d| (1.0 / d) as f32).collect();
        let (g, exchange_ms) = self.group.scale_gram_exchange(mode, &inv)?;
        self.finish_mode(mode, g, &inv, t, Some(exchange_ms))
    }

    /// AO-ADMM on the group: each GPU runs the one-GPU blocked inner loop
    /// on its own rows (one process only).
    fn runs_admm(&self) -> bool {
        self.group.process().is_none()
    }

    fn admm_inner(
        &mut self,
        mode: usize,
        w: &Array2<f64>,
        params: &kruskal_device::admm::InnerParams,
    ) -> Result<kruskal_device::admm::InnerStats> {
        self.settle()?;
        let t = Instant::now();
        let w = w.as_standard_layout();
        let stats = self
            .group
            .admm_inner(mode, w.as_slice().expect("standard layout"), params)?;
        if self.counting(mode) {
            self.breakdown[mode].update_ms += t.elapsed().as_secs_f64() * 1e3;
        }
        self.inner[mode] = Some(InnerSums::new(stats.inner.clone()));
        Ok(stats)
    }

    /// Each GPU runs on its own rows with data, which the group's plan
    /// knows already (the first of its rows under the plan's labels; the
    /// lists themselves are not needed). Several processes run the host's
    /// loop on every row.
    fn set_data_rows(&mut self, rows: Arc<DataRows>) -> Result<()> {
        self.settle()?;
        rows.check(self.dims())?;
        if self.group.process().is_some() {
            return Ok(());
        }
        self.group.admm_on_rows_with_data().map_err(CpdError::from)
    }

    fn admm_scale(&mut self, mode: usize, divisors: &[f64]) -> Result<Array2<f64>> {
        self.settle()?;
        let t = Instant::now();
        let g = self.group.admm_scale(mode, divisors)?;
        let inv: Vec<f32> = divisors.iter().map(|&d| (1.0 / d) as f32).collect();
        self.finish_mode(mode, g, &inv, t, None)
    }

    fn inner_products(&mut self, mode: usize) -> Result<Vec<f64>> {
        InnerSums::of(&self.inner, mode)
    }

    fn take_factors(&mut self) -> Result<Vec<Array2<f32>>> {
        // The last exchange left running is counted before the factors
        // come down: by the owed wait, or by a wait of its own.
        if self.deferred {
            self.settle()?;
        } else {
            let times: Vec<MttkrpTimes> = self.group.sync()?;
            self.count_exchanges(&times);
        }
        self.group.factors().map_err(CpdError::from)
    }
}
