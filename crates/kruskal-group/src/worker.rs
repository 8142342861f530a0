//! One worker thread per GPU of a group. It owns everything on its
//! device (shards, its copy of the factors, outputs, streams), runs the
//! coordinator's commands in order and replies to each: loading the
//! factors, the MTTKRP (the shard kernel over a resident shard, or over
//! segments copied from pinned host memory on several streams, timed with
//! CUDA events), the update of its own rows and their partial Gram matrix,
//! its part of the exchange (in `exchange.rs`) and downloads.

use std::ops::Range;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};

use super::MttkrpTimes;
use super::exchange::{Collective, Shared};
use super::sparse::DeviceLists;
use crate::nccl::Reduce;
use kruskal_device::admm::{AdmmKernels, InnerParams, InnerStats};
use kruskal_device::dense::{DenseKernels, UpdateStats};
use kruskal_device::factors::{DeviceFactors, queue_uniform_fill};
use kruskal_device::gpu::STAGE_WORDS;
use kruskal_device::kernels::Kernel;
use kruskal_device::{DeviceError, Gpu, Result, driver};
use ndarray::Array2;
use rayon::prelude::*;

/// Warps per block of the shard kernel (its P).
pub const WARPS: usize = kruskal_device::kernels::SHARD_WARPS;
/// ISPs per SM a launch aims for: several waves of blocks, so the last,
/// partly filled wave costs little (at 8 per SM, one block per SM slot, a
/// launch just over one wave took nearly two waves' time).
const ISPS_PER_SM: u64 = 32;

/// The coordinator's end of a worker: its command channel and thread.
pub(super) struct WorkerHandle {
    pub(super) tx: Sender<Cmd>,
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
}

/// What the coordinator asks a worker to do.
pub(super) enum Cmd {
    /// One mode's factor rows (relabeled), written into this GPU's copy.
    Load(usize, Arc<Vec<f32>>),
    /// One mode's seeded initial factor (mode, seed, random block), drawn
    /// on this GPU in the original row order and moved to the rows' labels
    /// (the mode's relabeling, one label per original row).
    Draw(usize, u64, usize, Arc<Vec<u32>>),
    Mttkrp(usize),
    Sync,
    Update(usize, Arc<Vec<f64>>),
    /// [`Cmd::Update`], then the Gram of the updated rows before any
    /// scaling (across processes: the coordinator all-reduces it with the
    /// statistics, one collective per mode instead of two).
    UpdateGram(usize, Arc<Vec<f64>>),
    ScaleGram(usize, Option<Arc<Vec<f32>>>),
    /// The scaling of [`Cmd::ScaleGram`] without the Gram (the
    /// coordinator has it from [`Cmd::UpdateGram`]), then the mode's
    /// exchange as [`Cmd::ScaleGramExchange`] queues it.
    ScaleExchange(usize, Arc<Vec<f32>>),
    /// The scaling and Gram of [`Cmd::ScaleGram`], then the mode's
    /// exchange as planned, queued behind them; an exchange by NCCL is
    /// left running (the next MTTKRP queues behind it on the stream, and
    /// its time is read at the next wait).
    ScaleGramExchange(usize, Arc<Vec<f32>>),
    /// The mode's exchange as planned (sparse or all-gather).
    Exchange(usize),
    /// The mode's all-gather, whatever was planned (every GPU then holds
    /// the whole factor).
    ExchangeAll(usize),
    Output(usize),
    /// One mode's factor rows as this GPU holds them, in the original row
    /// order: row `order[k]` of the matrix is relabeled row `k`, and
    /// original row `k` is relabeled row `labels[k]` (the two arrays are
    /// inverse permutations). Put back in order on the GPU into a scratch
    /// copy and downloaded straight into the matrix; where the GPU has no
    /// room for the copy, each row is written where it belongs as the
    /// pieces come down (the host never holds the relabeled copy).
    Factor(usize, Arc<Vec<u32>>, Arc<Vec<u32>>),
    /// AO-ADMM's blocked inner loop of the mode on this GPU's rows, from
    /// W = (G + rho I)^{-1}.
    AdmmInner(usize, Arc<Vec<f64>>, InnerParams),
    /// AO-ADMM's column scaling of the mode (H, U and the factor rows by
    /// the divisors); replies with the partial Gram.
    AdmmScale(usize, Arc<Vec<f64>>),
    /// AO-ADMM's inner loop runs on each GPU's own rows with data only.
    AdmmRows,
}

/// A worker's answer to a [`Cmd`].
pub(super) enum Reply {
    Done,
    Times(MttkrpTimes),
    /// The update's statistics, the times of the MTTKRP it waited for,
    /// and the update's own milliseconds after that wait.
    Stats(UpdateStats, MttkrpTimes, f64),
    /// [`Reply::Stats`] with the partial Gram of the updated rows.
    StatsGram(UpdateStats, Vec<f64>, MttkrpTimes, f64),
    Gram(Vec<f64>),
    /// The partial Gram (across processes, the whole one), the exchange's
    /// milliseconds when the worker waited for it (0 when left running),
    /// and those of the Gram's all-reduce across processes.
    GramExchanged(Vec<f64>, f64, f64),
    Floats(Vec<f32>),
    Factor(Array2<f32>),
    /// [`Cmd::Draw`]: whether the mode was drawn (false: no room on this
    /// GPU for the draw's scratch copy, and nothing was written).
    Drawn(bool),
    Millis(f64),
    Admm(InnerStats),
}

/// AO-ADMM's state on one GPU: the kernels and, per mode, H and U of the
/// GPU's own rows (f64; those with data only, where it has a list of
/// them), kept between outer iterations.
pub(super) struct AdmmState {
    kernels: AdmmKernels,
    h: Vec<Option<CudaSlice<f64>>>,
    u: Vec<Option<CudaSlice<f64>>>,
    /// Per mode, the own rows the loop runs on: every one, or (with
    /// [`Cmd::AdmmRows`]) those with data, the first of them.
    rows: Vec<Range<u32>>,
}

/// A shard on the device, or in pinned host memory.
pub(super) enum Shard {
    Resident {
        elems: CudaSlice<u32>,
        count: u64,
    },
    Streamed {
        host: Arc<PinnedHostSlice<u32>>,
        /// First element of this GPU's shard in `host`.
        first: u64,
        count: u64,
    },
}

/// The events of one MTTKRP, read at the next sync.
pub(super) struct Recorded {
    start: CudaEvent,
    end: CudaEvent,
    /// After the partial sums' reduction onto their owners (a split
    /// plan's partial modes).
    reduced: Option<CudaEvent>,
    /// Per launch: (copy start, copy end, kernel end); copies absent when
    /// resident.
    launches: Vec<(Option<(CudaEvent, CudaEvent)>, CudaEvent)>,
}

/// An exchange left running on the stream: its mode and the events around
/// it, read once the stream has passed them.
pub(super) struct LeftRunning {
    mode: usize,
    start: CudaEvent,
    end: CudaEvent,
}

impl LeftRunning {
    /// Marks the end of mode `mode`'s exchange, begun at `start`, queued
    /// on `stream`.
    pub(super) fn ends_here(stream: &CudaStream, mode: usize, start: CudaEvent) -> Result<Self> {
        // Timed events (the default flags of `record_event` disable
        // timing).
        let end = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("recording an event"))?;
        Ok(LeftRunning { mode, start, end })
    }
}

/// One GPU's worker: owns everything on its device.
pub(super) struct Worker {
    /// Index among this process's GPUs.
    pub(super) slot: usize,
    /// Index in the plan.
    pub(super) g: usize,
    pub(super) gpu: Arc<Gpu>,
    pub(super) shared: Arc<Shared>,
    pub(super) dims: Vec<u32>,
    pub(super) rank: usize,
    pub(super) shards: Vec<Shard>,
    pub(super) segment_elems: u64,
    pub(super) streams: Vec<Arc<CudaStream>>,
    pub(super) segment_bufs: Vec<CudaSlice<u32>>,
    pub(super) factors: Option<DeviceFactors>,
    pub(super) dense: Option<DenseKernels>,
    pub(super) outputs: Vec<Option<CudaSlice<f32>>>,
    pub(super) last: Option<Recorded>,
    /// The last exchange, when it was left running.
    pub(super) running: Option<LeftRunning>,
    /// Per mode, the rows this GPU sends and receives in a sparse
    /// exchange (`None`: the mode is all-gathered).
    pub(super) lists: Vec<Option<DeviceLists>>,
    /// The sparse exchange's packed rows, sent and received.
    pub(super) send_buf: Option<CudaSlice<f32>>,
    pub(super) recv_buf: Option<CudaSlice<f32>>,
    /// Per mode, whether it was updated since the factors were loaded: its
    /// empty rows are zero then, and the update, scaling and Gram skip them.
    pub(super) updated: Vec<bool>,
    /// Per mode, whether it was all-gathered since the factors were
    /// loaded: every GPU's empty rows of it are zero then, and later
    /// all-gathers send the rows with nonzeros only.
    pub(super) exchanged: Vec<bool>,
    /// AO-ADMM's kernels, H and U (made at the first inner loop).
    pub(super) admm: Option<AdmmState>,
    /// AO-ADMM runs on the rows with data ([`Cmd::AdmmRows`]).
    pub(super) admm_rows: bool,
    /// The stream of the copies of a reduction by peer copies.
    pub(super) copy_stream: Option<Arc<CudaStream>>,
    /// Per mode, the receive buffer of its reduction by peer copies.
    pub(super) reduce_bufs: Vec<Option<CudaSlice<f32>>>,
    /// MTTKRPs queued so far.
    pub(super) calls: usize,
    /// The MTTKRP (counted from 0) this GPU traps before.
    pub(super) fault: Option<usize>,
}

impl Worker {
    /// Starts the worker's thread; its replies, tagged with its slot, go
    /// to `replies`.
    pub(super) fn spawn(self, replies: Sender<(usize, Result<Reply>)>) -> Result<WorkerHandle> {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("kruskal-gpu-{}", self.g))
            .spawn(move || self.run(rx, replies))
            .map_err(|e| DeviceError::Shape(format!("starting a worker thread: {e}")))?;
        Ok(WorkerHandle {
            tx,
            thread: Some(thread),
        })
    }

    fn run(mut self, rx: Receiver<Cmd>, tx: Sender<(usize, Result<Reply>)>) {
        while let Ok(cmd) = rx.recv() {
            let result = if self.shared.aborted() {
                Err(DeviceError::Aborted("the group stopped".into()))
            } else {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handle(cmd)))
                    .unwrap_or_else(|p| {
                        let msg = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "unknown panic".into());
                        Err(DeviceError::Aborted(format!("worker panicked: {msg}")))
                    })
            };
            if tx.send((self.slot, result)).is_err() {
                break;
            }
        }
        if self.shared.aborted() {
            // The device may be in an error state or still running an
            // aborted collective: do not wait in destructors.
            std::mem::forget(self);
        }
    }

    fn handle(&mut self, cmd: Cmd) -> Result<Reply> {
        match cmd {
            Cmd::Load(mode, rows) => self.load(mode, &rows).map(|()| Reply::Done),
            Cmd::Draw(mode, seed, block, labels) => {
                self.draw(mode, seed, block, &labels).map(Reply::Drawn)
            }
            Cmd::Mttkrp(mode) => self.mttkrp(mode).map(|()| Reply::Done),
            Cmd::Sync => self.sync().map(Reply::Times),
            Cmd::Update(mode, w) => {
                // The MTTKRP's times ride on the update's reply: no round
                // trip of its own between the two.
                let times = self.sync()?;
                let started = std::time::Instant::now();
                let stats = self.update(mode, &w)?;
                let ms = started.elapsed().as_secs_f64() * 1e3;
                Ok(Reply::Stats(stats, times, ms))
            }
            Cmd::UpdateGram(mode, w) => {
                let times = self.sync()?;
                let started = std::time::Instant::now();
                let stats = self.update(mode, &w)?;
                let gram = self.scale_gram(mode, None)?;
                let ms = started.elapsed().as_secs_f64() * 1e3;
                Ok(Reply::StatsGram(stats, gram, times, ms))
            }
            Cmd::ScaleExchange(mode, inv) => {
                self.scale(mode, &inv)?;
                self.planned_exchange(mode, true).map(Reply::Millis)
            }
            Cmd::ScaleGram(mode, inv) => self
                .scale_gram(mode, inv.as_deref().map(Vec::as_slice))
                .map(Reply::Gram),
            Cmd::ScaleGramExchange(mode, inv) => {
                let mut gram = self.scale_gram(mode, Some(&inv))?;
                // Across processes this GPU is its process's only one: the
                // Gram is all-reduced here, before the exchange is queued,
                // so the exchange can be left running behind it.
                let mut across_ms = 0.0;
                if let Some(Collective::Process(pc)) = &self.shared.collective {
                    let t = std::time::Instant::now();
                    pc.all_reduce(&mut gram, Reduce::Sum)?;
                    across_ms = t.elapsed().as_secs_f64() * 1e3;
                }
                let ms = self.planned_exchange(mode, true)?;
                Ok(Reply::GramExchanged(gram, ms, across_ms))
            }
            Cmd::Exchange(mode) => self.planned_exchange(mode, false).map(Reply::Millis),
            Cmd::ExchangeAll(mode) => self.exchange(mode, false).map(Reply::Millis),
            Cmd::Output(mode) => {
                let stream = self.gpu.stream().clone();
                let out = self.output(mode)?;
                let v = stream
                    .clone_dtoh(out)
                    .map_err(driver("downloading the MTTKRP"))?;
                let own = self.output_rows(mode);
                let r = self.rank;
                Ok(Reply::Floats(
                    v[own.start as usize * r..own.end as usize * r].to_vec(),
                ))
            }
            Cmd::AdmmInner(mode, w, params) => self.admm_inner(mode, &w, &params).map(Reply::Admm),
            Cmd::AdmmScale(mode, divisors) => self.admm_scale(mode, &divisors).map(Reply::Gram),
            Cmd::AdmmRows => {
                self.admm_rows = true;
                // H and U start again, sized by the new rows.
                self.admm = None;
                Ok(Reply::Done)
            }
            Cmd::Factor(mode, order, labels) => {
                self.wait(self.gpu.stream(), "the last update")?;
                let r = self.rank;
                let rows = self.dims[mode] as usize;
                if order.len() != rows || labels.len() != rows {
                    return Err(DeviceError::Shape(format!(
                        "an order of {} rows and {} labels for mode {} of {rows}",
                        order.len(),
                        labels.len(),
                        mode + 1,
                    )));
                }
                let mut out = Array2::<f32>::zeros((rows, r));
                let dst = out.as_slice_mut().expect("standard layout");
                if let Some(scratch) = self.in_original_order(mode, &labels)? {
                    let piece = (STAGE_WORDS / r).max(1) * r;
                    let pieces: Vec<(usize, usize)> = (0..rows * r)
                        .step_by(piece)
                        .map(|at| (at, piece.min(rows * r - at)))
                        .collect();
                    let part = ((1 << 14) / r).max(1) * r;
                    self.gpu.download_through_staging(
                        "a factor matrix",
                        &scratch,
                        &pieces,
                        &mut |i, src| {
                            let at = i * piece;
                            dst[at..at + src.len()]
                                .par_chunks_mut(part)
                                .zip(src.par_chunks(part))
                                .for_each(|(d, s)| d.copy_from_slice(s));
                        },
                    )?;
                } else {
                    let f = self
                        .factors
                        .as_ref()
                        .ok_or_else(|| DeviceError::Shape("no factors loaded".into()))?;
                    f.download_mode_into(&self.gpu, mode, &mut |at, src| {
                        let first = at / r;
                        for (k, row) in src.chunks_exact(r).enumerate() {
                            let to = order[first + k] as usize * r;
                            dst[to..to + r].copy_from_slice(row);
                        }
                    })?;
                }
                Ok(Reply::Factor(out))
            }
        }
    }

    /// The mode's exchange as planned: a split plan's cut mode is read by
    /// its owners alone (no exchange), a sparse mode sends the rows read,
    /// any other is all-gathered. With `leave`, an exchange by NCCL is
    /// left running on the stream (0 ms returned; its time comes with the
    /// next sync); pulls and peer-copy rings wait as always.
    fn planned_exchange(&mut self, mode: usize, leave: bool) -> Result<f64> {
        if self.shared.local[mode] {
            return Ok(0.0);
        }
        match self.shared.sparse[mode].clone() {
            Some(sparse) => self.exchange_read(mode, &sparse, leave),
            None => self.exchange(mode, leave),
        }
    }

    /// Whether an exchange by NCCL may be left running now (`leave`), with
    /// the event that marks its start; `None` when it is waited for.
    pub(super) fn leave_running(&self, leave: bool) -> Result<Option<CudaEvent>> {
        if !leave {
            return Ok(None);
        }
        self.gpu
            .stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map(Some)
            .map_err(driver("recording an event"))
    }

    /// The mode and milliseconds of the exchange left running, once the
    /// stream has passed it (the caller has waited for the stream).
    fn finished_exchange(&mut self) -> Result<Option<(usize, f64)>> {
        let Some(run) = self.running.take() else {
            return Ok(None);
        };
        let ms = run
            .start
            .elapsed_ms(&run.end)
            .map_err(driver("reading an event"))?;
        Ok(Some((run.mode, f64::from(ms).max(0.0))))
    }

    /// Waits for `stream`'s queued work, up to the group's timeout, giving
    /// up early when the group aborts.
    pub(super) fn wait(&self, stream: &Arc<CudaStream>, what: &str) -> Result<()> {
        crate::process::wait_polling(stream, what, self.shared.timeout, || {
            if self.shared.aborted() {
                Err(DeviceError::Aborted("the group stopped".into()))
            } else {
                Ok(())
            }
        })
    }

    pub(super) fn barrier(&self) -> Result<()> {
        self.shared
            .barrier
            .wait(self.shared.timeout)
            .map_err(|e| DeviceError::Timeout(e.to_string()))
    }

    /// The rows of `mode` the dense steps cover: every row this GPU owns
    /// until the mode's first update, its rows with nonzeros after it.
    fn dense_rows(&self, mode: usize) -> Range<u32> {
        if self.updated[mode] {
            self.shared.live[mode][self.g].clone()
        } else {
            self.shared.rows[mode][self.g].clone()
        }
    }

    /// Writes mode `mode`'s rows (relabeled, `dims[mode] x rank`) into
    /// this GPU's factors, allocated zeroed at the first load; the mode's
    /// update, exchange and AO-ADMM state start again.
    fn load(&mut self, mode: usize, rows: &[f32]) -> Result<()> {
        let len = self.dims[mode] as usize * self.rank;
        if rows.len() != len {
            return Err(DeviceError::Shape(format!(
                "{} floats for mode {} of {} rows at rank {}",
                rows.len(),
                mode + 1,
                self.dims[mode],
                self.rank
            )));
        }
        self.begin_load(mode)?;
        let f = self.factors.as_mut().expect("allocated by begin_load");
        if len > 0 {
            self.gpu
                .stream()
                .memcpy_htod(rows, &mut f.mode_mut(mode))
                .map_err(driver("uploading the factors"))?;
        }
        self.end_load("the factor upload")
    }

    /// Draws mode `mode`'s seeded initial factor here: `uniform_fill` into
    /// a scratch copy in the original row order (what the host's draw of
    /// the same seed gives, bit for bit), then each row to its label by
    /// `copy_rows`. No host memory and no upload but the labels'. Returns
    /// false, having written nothing, when the GPU has no room for the
    /// scratch copy and the labels.
    fn draw(&mut self, mode: usize, seed: u64, block: usize, labels: &[u32]) -> Result<bool> {
        let rows = self.dims[mode] as usize;
        if labels.len() != rows {
            return Err(DeviceError::Shape(format!(
                "{} labels for mode {} of {rows} rows",
                labels.len(),
                mode + 1
            )));
        }
        let len = rows * self.rank;
        let Some((mut scratch, on_device)) = self.scratch_with_labels(len, labels)? else {
            return Ok(false);
        };
        self.begin_load(mode)?;
        if len > 0 {
            let stream = self.gpu.stream().clone();
            queue_uniform_fill(
                &self.gpu,
                &mut scratch.slice_mut(..len),
                self.rank,
                seed,
                mode,
                block,
            )?;
            let f = self.factors.as_mut().expect("allocated by begin_load");
            let (src, _s) = scratch.device_ptr(&stream);
            let (to, _t) = on_device.device_ptr(&stream);
            let mut dst_view = f.mode_mut(mode);
            let (dst, _d) = dst_view.device_ptr_mut(&stream);
            // SAFETY: the scratch holds `rows` rows in the original order,
            // the labels are a permutation of 0..rows (the plan's
            // relabeling) and the mode's view holds `rows` rows; the two
            // buffers are distinct allocations.
            unsafe {
                crate::sparse::copy_rows(
                    &self.gpu,
                    &stream,
                    self.rank,
                    (src, 0),
                    (dst, to),
                    rows as u64,
                )?
            };
        }
        self.end_load("the factor draw")?;
        drop((scratch, on_device));
        Ok(true)
    }

    /// Mode `mode`'s factor in the original row order, in a scratch copy
    /// (row `k` of it is the factor's row `labels[k]`), moved on the GPU by
    /// `copy_rows`; `None` when the GPU has no room for the copy and the
    /// labels.
    fn in_original_order(&mut self, mode: usize, labels: &[u32]) -> Result<Option<CudaSlice<f32>>> {
        let rows = labels.len();
        let len = rows * self.rank;
        let Some((mut scratch, on_device)) = self.scratch_with_labels(len, labels)? else {
            return Ok(None);
        };
        let f = self
            .factors
            .as_ref()
            .ok_or_else(|| DeviceError::Shape("no factors loaded".into()))?;
        if len > 0 {
            let stream = self.gpu.stream().clone();
            let view = f.mode(mode);
            let (src, _s) = view.device_ptr(&stream);
            let (from, _f) = on_device.device_ptr(&stream);
            let (dst, _d) = scratch.device_ptr_mut(&stream);
            // SAFETY: the labels are a permutation of 0..rows (the plan's
            // relabeling), the mode's view and the scratch hold `rows` rows
            // each, and they are distinct allocations.
            unsafe {
                crate::sparse::copy_rows(
                    &self.gpu,
                    &stream,
                    self.rank,
                    (src, from),
                    (dst, 0),
                    rows as u64,
                )?
            };
        }
        self.wait(self.gpu.stream(), "the factor put in order")?;
        Ok(Some(scratch))
    }

    /// A scratch buffer of `len` floats and `labels` on this GPU, for a
    /// mode moved between the original row order and the labels'; `None`
    /// when the GPU has no room for them (the caller then does it on the
    /// host).
    fn scratch_with_labels(
        &self,
        len: usize,
        labels: &[u32],
    ) -> Result<Option<(CudaSlice<f32>, CudaSlice<u32>)>> {
        let scratch = match self
            .gpu
            .alloc_zeros::<f32>("a scratch copy of a factor", len)
        {
            Err(DeviceError::OutOfMemory { .. }) => return Ok(None),
            r => r?,
        };
        match self.gpu.upload("the rows' labels", labels) {
            Err(DeviceError::OutOfMemory { .. }) => Ok(None),
            r => Ok(Some((scratch, r?))),
        }
    }

    /// What every load of a mode's factor starts with: the mode's update
    /// and exchange start again, AO-ADMM's H and U too, and the factors
    /// and dense kernels exist.
    fn begin_load(&mut self, mode: usize) -> Result<()> {
        self.updated[mode] = false;
        self.exchanged[mode] = false;
        if let Some(a) = &mut self.admm {
            // H starts again from the new factors.
            a.h[mode] = None;
            a.u[mode] = None;
        }
        if self.factors.is_none() {
            self.factors = Some(DeviceFactors::zeros(&self.gpu, &self.dims, self.rank)?);
        }
        if self.dense.is_none() {
            self.dense = Some(DenseKernels::new(self.gpu.clone(), self.rank)?);
        }
        Ok(())
    }

    /// What every load ends with: the factors' address in the table the
    /// peer copies read, and a wait for the queued writes (`what`).
    fn end_load(&mut self, what: &str) -> Result<()> {
        let f = self.factors.as_ref().expect("allocated by begin_load");
        let (ptr, _sync) = f.data().device_ptr(self.gpu.stream());
        self.shared.factor_ptrs.lock().expect("pointer table")[self.slot] = ptr;
        drop(_sync);
        self.wait(self.gpu.stream(), what)
    }

    /// This GPU's output buffer of `mode`: its rows only, or every row of
    /// a partial mode (a split plan's: several GPUs write each row).
    fn output(&mut self, mode: usize) -> Result<&mut CudaSlice<f32>> {
        if self.outputs[mode].is_none() {
            let rows = if self.shared.partial[mode] {
                self.dims[mode] as usize
            } else {
                self.shared.rows[mode][self.g].len()
            };
            let len = rows * self.rank;
            let out = self.gpu.alloc_zeros::<f32>("an MTTKRP output", len)?;
            let (ptr, _sync) = out.device_ptr(self.gpu.stream());
            self.shared.output_ptrs.lock().expect("pointer table")[mode][self.slot] = ptr;
            drop(_sync);
            self.outputs[mode] = Some(out);
        }
        Ok(self.outputs[mode].as_mut().expect("allocated above"))
    }

    /// Where this GPU's own rows of `mode` lie in its output buffer.
    fn output_rows(&self, mode: usize) -> Range<u32> {
        let own = self.shared.rows[mode][self.g].clone();
        if self.shared.partial[mode] {
            own
        } else {
            0..own.end - own.start
        }
    }

    /// ISP length for a launch over `count` elements.
    fn isp_len(&self, count: u64) -> u64 {
        let target = self.gpu.properties().sms.max(1) as u64 * ISPS_PER_SM;
        count.div_ceil(target).max(256)
    }

    /// The fault-injection hook: before the MTTKRP numbered `fault`
    /// (counted from 0), a trapping kernel puts the GPU into a real CUDA
    /// error. Counts the MTTKRPs.
    fn inject_fault(&mut self, defines: &[(&str, i64)]) -> Result<()> {
        if self.fault == Some(self.calls) {
            let trap =
                self.gpu
                    .kernels()
                    .function(self.gpu.context(), Kernel::ShardFault, defines)?;
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the kernel takes no arguments; it traps on purpose.
            unsafe { self.gpu.stream().launch_builder(&trap).launch(cfg) }
                .map_err(driver("launching the fault kernel"))?;
        }
        self.calls += 1;
        Ok(())
    }

    fn mttkrp(&mut self, mode: usize) -> Result<()> {
        let n = self.dims.len();
        // Lane teams where the rank allows them, as fcoo runs them.
        let mut defines = vec![
            ("NMODES", n as i64),
            ("RANK", self.rank as i64),
            ("WARPS", WARPS as i64),
        ];
        if kruskal_device::engines::fcoo::teams_fit(self.rank) {
            defines.push(("TEAMS", 1));
        }
        let kernel =
            self.gpu
                .kernels()
                .function(self.gpu.context(), Kernel::MttkrpShard, &defines)?;
        self.inject_fault(&defines)?;
        if self.factors.is_none() {
            return Err(DeviceError::Shape("no factors loaded".into()));
        }
        let partial = self.shared.partial[mode];
        // Output rows are written at their label minus `row_lo`.
        let row_lo = self.shared.rows[mode][self.g].start - self.output_rows(mode).start;
        let main = self.gpu.stream().clone();
        let start = self.gpu.timing_event()?;
        let end = self.gpu.timing_event()?;
        {
            // Only the rows with nonzeros (of every owner, for a partial
            // mode): the others are never written and stay zero from the
            // allocation.
            let r = self.rank;
            let owners = if partial {
                0..self.shared.live[mode].len()
            } else {
                self.g..self.g + 1
            };
            let live: Vec<Range<u32>> = owners.map(|b| self.shared.live[mode][b].clone()).collect();
            let out = self.output(mode)?;
            for rows in live.iter().filter(|l| !l.is_empty()) {
                let (lo, hi) = ((rows.start - row_lo) as usize, (rows.end - row_lo) as usize);
                main.memset_zeros(&mut out.slice_mut(lo * r..hi * r))
                    .map_err(driver("zeroing the output"))?;
            }
        }
        start.record(&main).map_err(driver("recording an event"))?;
        let mut launches = Vec::new();
        let at = (row_lo, mode as i32);
        match &self.shards[mode] {
            Shard::Resident { elems, count } => {
                let (base, _sync) = elems.device_ptr(&main);
                let shared = self.shared.clone();
                let bytes = ((n + 1) * 4) as u64;
                match &shared.copy_reduce[mode] {
                    Some(cr) => {
                        // Owner by owner, this GPU's own rows last; each
                        // other owner's partial sums leave on the copy
                        // stream as soon as they are summed.
                        let m = shared.rows[mode].len();
                        let offsets = &cr.offsets[self.g];
                        for k in 1..=m {
                            let o = (self.g + k) % m;
                            let (lo, hi) = (offsets[o], offsets[o + 1]);
                            if hi > lo {
                                let isp = self.isp_len(hi - lo);
                                let factors = self.factors.as_ref().expect("checked above");
                                let out = self.outputs[mode].as_mut().expect("allocated above");
                                // SAFETY: elements `lo .. hi` of the shard
                                // are owner `o`'s rows' (`offsets`).
                                unsafe {
                                    launch_shard(
                                        &main,
                                        &kernel,
                                        base + lo * bytes,
                                        factors,
                                        out,
                                        &at,
                                        hi - lo,
                                        isp,
                                    )
                                }?;
                                let done = self.gpu.timing_event()?;
                                done.record(&main).map_err(driver("recording an event"))?;
                                launches.push((None, done));
                            }
                            if o != self.g {
                                self.send_partial(mode, o, cr.recv[o])?;
                            }
                        }
                    }
                    None => {
                        let (count, isp) = (*count, self.isp_len(*count));
                        if count > 0 {
                            let factors = self.factors.as_ref().expect("checked above");
                            let out = self.outputs[mode].as_mut().expect("allocated above");
                            // SAFETY: `elems` holds the shard's `count`
                            // elements.
                            unsafe {
                                launch_shard(&main, &kernel, base, factors, out, &at, count, isp)
                            }?;
                            let done = self.gpu.timing_event()?;
                            done.record(&main).map_err(driver("recording an event"))?;
                            launches.push((None, done));
                        }
                    }
                }
            }
            Shard::Streamed { host, first, count } => {
                let (host, first, count) = (host.clone(), *first, *count);
                let stride = n + 1;
                let seg = self.segment_elems;
                if self.segment_bufs.is_empty() {
                    for _ in &self.streams {
                        let buf = self
                            .gpu
                            .alloc_zeros::<u32>("a stream segment buffer", seg as usize * stride)?;
                        self.segment_bufs.push(buf);
                    }
                }
                for s in &self.streams {
                    s.wait(&start).map_err(driver("ordering the streams"))?;
                }
                let base = host.as_ptr().map_err(driver("reading pinned memory"))?;
                let segments = count.div_ceil(seg);
                for s in 0..segments {
                    let k = (s as usize) % self.streams.len();
                    let stream = self.streams[k].clone();
                    let len = seg.min(count - s * seg);
                    let lo = (first + s * seg) as usize * stride;
                    // SAFETY: `host` holds the whole mode's elements and
                    // outlives the copy (the Arc is kept in `shards`); the
                    // range lies inside this GPU's shard.
                    let src =
                        unsafe { std::slice::from_raw_parts(base.add(lo), len as usize * stride) };
                    let c0 = self.gpu.timing_event()?;
                    let c1 = self.gpu.timing_event()?;
                    let k1 = self.gpu.timing_event()?;
                    c0.record(&stream).map_err(driver("recording an event"))?;
                    let buf = &mut self.segment_bufs[k];
                    stream
                        .memcpy_htod(src, &mut buf.slice_mut(..len as usize * stride))
                        .map_err(driver("copying a segment"))?;
                    c1.record(&stream).map_err(driver("recording an event"))?;
                    let isp = self.isp_len(len);
                    let factors = self.factors.as_ref().expect("checked above");
                    let out = self.outputs[mode].as_mut().expect("allocated above");
                    let (buf, _sync) = self.segment_bufs[k].device_ptr(&stream);
                    // SAFETY: the buffer holds the segment's `len` elements,
                    // copied just before on the same stream.
                    unsafe { launch_shard(&stream, &kernel, buf, factors, out, &at, len, isp) }?;
                    k1.record(&stream).map_err(driver("recording an event"))?;
                    launches.push((Some((c0, c1)), k1));
                }
                for s in &self.streams {
                    main.join(s).map_err(driver("joining the streams"))?;
                }
            }
        }
        end.record(&main).map_err(driver("recording an event"))?;
        let reduced = if partial {
            if self.shared.copy_reduce[mode].is_some() {
                self.sum_received(mode)?;
            } else if let Some(sparse) = self.shared.sparse[mode].clone() {
                self.reduce_read(mode, &sparse)?;
            } else {
                self.reduce_partial(mode)?;
            }
            let e = self.gpu.timing_event()?;
            e.record(&main).map_err(driver("recording an event"))?;
            Some(e)
        } else {
            None
        };
        self.last = Some(Recorded {
            start,
            end,
            reduced,
            launches,
        });
        Ok(())
    }

    /// Sums every GPU's partial output of `mode` onto the rows' owners:
    /// one grouped NCCL reduction per owner, over its rows with nonzeros
    /// (the others are zero on every GPU), in place on the owner. Queued
    /// on the main stream after the MTTKRP.
    fn reduce_partial(&mut self, mode: usize) -> Result<()> {
        let stream = self.gpu.stream().clone();
        let r = self.rank;
        let live = self.shared.live[mode].clone();
        let out = self.output(mode)?;
        let base = {
            let (ptr, _sync) = out.device_ptr(&stream);
            ptr
        };
        let Some(collective) = &self.shared.collective else {
            return Err(DeviceError::Shape(
                "a split plan sums its partial outputs through NCCL, which this group lacks".into(),
            ));
        };
        let (nccl, comm) = collective.comm(self.slot);
        let nccl_err = |e: crate::nccl::NcclError| DeviceError::Nccl(e.to_string());
        nccl.group_start().map_err(nccl_err)?;
        for (b, rows) in live.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            // SAFETY: a partial mode's output holds every row of the mode
            // (dims x rank floats), so the owner's rows lie inside it; it
            // lives in `outputs` until the stream has run the reduction.
            unsafe {
                nccl.reduce_f32(
                    comm,
                    base + u64::from(rows.start) * r as u64 * 4,
                    rows.len() * r,
                    b,
                    stream.cu_stream() as _,
                )
            }
            .map_err(nccl_err)?;
        }
        nccl.group_end().map_err(nccl_err)
    }

    /// Queues the copy of this GPU's partial sums of owner `o`'s rows with
    /// nonzeros into `o`'s receive buffer (at `recv`), on the copy stream
    /// after the MTTKRP queued so far, and records its end for `o`.
    fn send_partial(&self, mode: usize, o: usize, recv: u64) -> Result<()> {
        let live = self.shared.live[mode][o].clone();
        if live.is_empty() {
            return Ok(());
        }
        let main = self.gpu.stream().clone();
        let copy = self
            .copy_stream
            .clone()
            .ok_or_else(|| DeviceError::Shape("no copy stream for the reduction".into()))?;
        let summed = main
            .record_event(None)
            .map_err(driver("recording an event"))?;
        copy.wait(&summed)
            .map_err(driver("ordering the copy stream"))?;
        let row_bytes = (self.rank * 4) as u64;
        let block = if self.g < o { self.g } else { self.g - 1 } as u64;
        let out = self.outputs[mode]
            .as_ref()
            .expect("allocated by the MTTKRP");
        let (src, _sync) = out.device_ptr(&copy);
        // SAFETY: the rows lie inside this GPU's output (every row of a
        // partial mode), summed before the event the copy stream waits
        // on; the block lies inside `o`'s receive buffer (a block of
        // `live.len()` rows per sender), which lives with the group and
        // is read only by `o`'s sum after the copy's event.
        unsafe {
            cudarc::driver::result::memcpy_peer_async(
                self.shared.contexts[o].cu_ctx(),
                recv + block * live.len() as u64 * row_bytes,
                self.shared.contexts[self.slot].cu_ctx(),
                src + u64::from(live.start) * row_bytes,
                live.len() * self.rank * 4,
                copy.cu_stream(),
            )
        }
        .map_err(driver("copying partial sums to their owner"))?;
        let sent = copy
            .record_event(None)
            .map_err(driver("recording an event"))?;
        self.shared.sent.lock().expect("sent events")[self.g][o] = Some(sent);
        Ok(())
    }

    /// After every GPU queued its copies (a barrier): waits for the blocks
    /// sent to this GPU and adds them to its own rows with nonzeros, in
    /// sender order, on the main stream.
    fn sum_received(&self, mode: usize) -> Result<()> {
        self.barrier()?;
        let live = self.shared.live[mode][self.g].clone();
        if live.is_empty() {
            return Ok(());
        }
        let main = self.gpu.stream().clone();
        let m = self.shared.rows[mode].len();
        let received: Vec<cudarc::driver::CudaEvent> = {
            let mut sent = self.shared.sent.lock().expect("sent events");
            (0..m)
                .filter(|&h| h != self.g)
                .map(|h| sent[h][self.g].take())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| DeviceError::Shape("a GPU sent no partial sums".into()))?
        };
        for e in &received {
            main.wait(e).map_err(driver("waiting for a peer's copy"))?;
        }
        let r = self.rank;
        let f = self.gpu.kernels().function(
            self.gpu.context(),
            Kernel::SumParts,
            &[("RANK", r as i64)],
        )?;
        let parts = self.reduce_bufs[mode]
            .as_ref()
            .ok_or_else(|| DeviceError::Shape("no receive buffer for the reduction".into()))?;
        let out = self.outputs[mode]
            .as_ref()
            .expect("allocated by the MTTKRP");
        let (out_ptr, _s1) = out.device_ptr(&main);
        let (parts_ptr, _s2) = parts.device_ptr(&main);
        let out_at = out_ptr + u64::from(live.start) * (r * 4) as u64;
        let (nparts, stride, count) = ((m - 1) as u32, live.len() as u64, live.len() as u64);
        let per = if r % 4 == 0 { r / 4 } else { r } as u64;
        let mut l = main.launch_builder(&f);
        l.arg(&out_at)
            .arg(&parts_ptr)
            .arg(&nparts)
            .arg(&stride)
            .arg(&count);
        // SAFETY: `out_at` starts this GPU's `count` rows with nonzeros in
        // its output; the receive buffer holds `nparts` blocks of `count`
        // rows, each written by a copy the stream waited for above.
        unsafe { l.launch(kruskal_device::grid_stride(count * per, 256)) }
            .map_err(driver("launching sum_parts"))?;
        Ok(())
    }

    fn sync(&mut self) -> Result<MttkrpTimes> {
        self.wait(&self.gpu.stream().clone(), "the MTTKRP")?;
        let exchanged = self.finished_exchange()?;
        let Some(rec) = self.last.take() else {
            return Ok(MttkrpTimes {
                exchanged,
                ..MttkrpTimes::default()
            });
        };
        let ms = |a: &CudaEvent, b: &CudaEvent| -> Result<f64> {
            Ok(f64::from(
                a.elapsed_ms(b).map_err(driver("reading an event"))?,
            ))
        };
        let total_ms = ms(&rec.start, &rec.end)?;
        let reduce_ms = match &rec.reduced {
            Some(e) => ms(&rec.end, e)?.max(0.0),
            None => 0.0,
        };
        // Busy time of the copies and of the kernels: each interval counts
        // from when it could start (its own start, or the end of the
        // previous one of its kind) so waiting in a queue is not counted.
        let (mut h2d_ms, mut kernel_ms) = (0.0, 0.0);
        let mut prev_copy: Option<&CudaEvent> = None;
        let mut prev_kernel: &CudaEvent = &rec.start;
        for (copy, kernel_end) in &rec.launches {
            let kernel_start = match copy {
                Some((c0, c1)) => {
                    let from = match prev_copy {
                        Some(p) if ms(c0, p)? > 0.0 => p,
                        _ => c0,
                    };
                    h2d_ms += ms(from, c1)?.max(0.0);
                    prev_copy = Some(c1);
                    if ms(c1, prev_kernel)? > 0.0 {
                        prev_kernel
                    } else {
                        c1
                    }
                }
                None => prev_kernel,
            };
            kernel_ms += ms(kernel_start, kernel_end)?.max(0.0);
            prev_kernel = kernel_end;
        }
        Ok(MttkrpTimes {
            total_ms,
            h2d_ms,
            kernel_ms,
            reduce_ms,
            exchanged,
        })
    }

    fn update(&mut self, mode: usize, w: &[f64]) -> Result<UpdateStats> {
        let rows = self.dense_rows(mode);
        let r = self.rank;
        if rows.is_empty() {
            return Ok(UpdateStats {
                sumsq: vec![0.0; r],
                max_abs: vec![0.0; r],
                inner: vec![0.0; r],
            });
        }
        self.wait(&self.gpu.stream().clone(), "the MTTKRP")?;
        self.output(mode)?;
        let at = self.output_rows(mode).start as usize * r;
        let m = self.outputs[mode].as_ref().expect("allocated above");
        let m = m.slice(at..);
        let (dense, mut own) = own_rows(&mut self.factors, &mut self.dense, mode, rows.clone())?;
        let stats = dense.update(&m, w, &mut own, rows.len())?;
        self.updated[mode] = true;
        Ok(stats)
    }

    /// AO-ADMM's inner loop of `mode` on every row this GPU owns, or on
    /// those with data ([`Cmd::AdmmRows`]: the first of its rows under the
    /// plan's labels), in blocks as one GPU runs it; H and U start from 0.
    fn admm_inner(&mut self, mode: usize, w: &[f64], params: &InnerParams) -> Result<InnerStats> {
        let r = self.rank;
        let own = self.shared.rows[mode][self.g].clone();
        let rows = own.len();
        if rows == 0 {
            return Ok(InnerStats::empty(r));
        }
        self.wait(&self.gpu.stream().clone(), "the MTTKRP")?;
        let n = self.dims.len();
        if self.admm.is_none() {
            self.admm = Some(AdmmState {
                kernels: AdmmKernels::new(self.gpu.clone(), r)?,
                h: (0..n).map(|_| None).collect(),
                u: (0..n).map(|_| None).collect(),
                rows: vec![0..0; n],
            });
        }
        self.output(mode)?;
        let at = self.output_rows(mode).start as usize * r;
        let admm = self.admm.as_mut().expect("made above");
        if admm.h[mode].is_none() {
            // A cold start: H = U = 0 (see kruskal_cpd::admm). With rows
            // with data, H and U hold this GPU's such rows only, and its
            // other factor rows are 0 from now on (their solution).
            let mut run = own.clone();
            if self.admm_rows {
                // The rows with data are the first of this GPU's rows.
                run = self.shared.live[mode][self.g].clone();
                let factors = self
                    .factors
                    .as_mut()
                    .ok_or_else(|| DeviceError::Shape("no factors loaded".into()))?;
                if run.end < own.end {
                    self.gpu
                        .stream()
                        .memset_zeros(&mut factors.rows_mut(mode, run.end..own.end))
                        .map_err(driver("zeroing the factor's rows"))?;
                }
            }
            let count = run.len();
            admm.rows[mode] = run;
            admm.h[mode] = Some(self.gpu.alloc_zeros("ADMM's H", count * r)?);
            admm.u[mode] = Some(self.gpu.alloc_zeros("ADMM's U", count * r)?);
        }
        let count = admm.rows[mode].len();
        let k = self.outputs[mode].as_ref().expect("allocated above");
        let k = k.slice(at..);
        let (Some(h), Some(u)) = (admm.h[mode].as_mut(), admm.u[mode].as_mut()) else {
            unreachable!("made together above");
        };
        admm.kernels.inner_loop(&k, w, h, u, count, None, params)
    }

    /// AO-ADMM's scaling of `mode`: H and U divided by `divisors`, the
    /// factor rows written from H, and their partial Gram. The mode's next
    /// all-gather sends every row, or (on the rows with data) the rows with
    /// data once the mode was all-gathered after its first update.
    fn admm_scale(&mut self, mode: usize, divisors: &[f64]) -> Result<Vec<f64>> {
        let r = self.rank;
        let own = self.shared.rows[mode][self.g].clone();
        if self.admm_rows {
            // The rows without data are 0 on every GPU once the first
            // all-gather after the mode's first update has run: the
            // exchanges after it send the rows with data only, as ALS's.
            self.updated[mode] = true;
        } else {
            self.exchanged[mode] = false;
        }
        if own.is_empty() {
            return Ok(vec![0.0; r * r]);
        }
        let admm = self.admm.as_mut().ok_or_else(|| {
            DeviceError::Shape(format!(
                "the ADMM scaling of mode {} needs its inner loop first",
                mode + 1
            ))
        })?;
        let (Some(h), Some(u)) = (admm.h[mode].as_mut(), admm.u[mode].as_mut()) else {
            return Err(DeviceError::Shape(format!(
                "the ADMM scaling of mode {} needs its inner loop first",
                mode + 1
            )));
        };
        let factors = self
            .factors
            .as_mut()
            .ok_or_else(|| DeviceError::Shape("no factors loaded".into()))?;
        admm.kernels.scale(
            h,
            u,
            &mut factors.rows_mut(mode, admm.rows[mode].clone()),
            None,
            divisors,
            admm.rows[mode].len(),
            None,
        )?;
        // The Gram of the rows the loop ran on: the others are 0.
        let run = admm.rows[mode].clone();
        if run.is_empty() {
            return Ok(vec![0.0; r * r]);
        }
        let (dense, mut a) = own_rows(&mut self.factors, &mut self.dense, mode, run.clone())?;
        dense.scale_gram(&mut a, None, run.len())
    }

    /// Scales this GPU's rows of `mode` by `inv` (queued, not waited for).
    fn scale(&mut self, mode: usize, inv: &[f32]) -> Result<()> {
        let rows = self.dense_rows(mode);
        if rows.is_empty() {
            return Ok(());
        }
        let (dense, mut own) = own_rows(&mut self.factors, &mut self.dense, mode, rows.clone())?;
        dense.scale(&mut own, inv, rows.len())
    }

    fn scale_gram(&mut self, mode: usize, inv: Option<&[f32]>) -> Result<Vec<f64>> {
        let rows = self.dense_rows(mode);
        let r = self.rank;
        if rows.is_empty() {
            return Ok(vec![0.0; r * r]);
        }
        let (dense, mut own) = own_rows(&mut self.factors, &mut self.dense, mode, rows.clone())?;
        dense.scale_gram(&mut own, inv, rows.len())
    }
}

/// A worker's rows `rows` of `mode` in its factor buffer, with the dense
/// kernels that update them (fields of the worker, borrowed apart from the
/// MTTKRP output the update reads).
fn own_rows<'a>(
    factors: &'a mut Option<DeviceFactors>,
    dense: &'a mut Option<DenseKernels>,
    mode: usize,
    rows: Range<u32>,
) -> Result<(&'a mut DenseKernels, cudarc::driver::CudaViewMut<'a, f32>)> {
    let factors = factors
        .as_mut()
        .ok_or_else(|| DeviceError::Shape("no factors loaded".into()))?;
    let dense = dense.as_mut().expect("made with the factors");
    Ok((dense, factors.rows_mut(mode, rows)))
}

/// Queues the shard kernel on `stream` over `count` elements of `elems`
/// in ISPs of `isp`, for output rows starting at `at.0` of mode `at.1`.
///
/// # Safety
/// `elems` must hold `count` elements of NMODES + 1 words whose indices
/// are below each mode's dimension (relabeled by the group's RowShards),
/// the output mode's inside this GPU's rows (every row, for a partial
/// mode's whole output), so that every factor read
/// lies inside `factors` and every output write inside `out`.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_shard(
    stream: &Arc<CudaStream>,
    kernel: &cudarc::driver::CudaFunction,
    elems: u64,
    factors: &DeviceFactors,
    out: &mut CudaSlice<f32>,
    at: &(u32, i32),
    count: u64,
    isp: u64,
) -> Result<()> {
    let mut l = stream.launch_builder(kernel);
    l.arg(&elems)
        .arg(&count)
        .arg(&isp)
        .arg(factors.data())
        .arg(factors.row_offsets())
        .arg(out)
        .arg(&at.0)
        .arg(&at.1);
    // SAFETY: the caller's contract.
    unsafe { l.launch(shard_config(count, isp)) }.map_err(driver("launching mttkrp_shard"))?;
    Ok(())
}

fn shard_config(count: u64, isp: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (count.div_ceil(isp).max(1) as u32, 1, 1),
        block_dim: ((WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}
