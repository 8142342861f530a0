//! The sparse exchange: after a mode's update, each owner sends each
//! reader only the rows of that mode the reader's shards read
//! (kruskal-partition's [`RowReaders`] and [`ExchangeLists`]), instead of
//! all-gathering the whole factor. Rows no GPU reads never travel.
//!
//! - **With NCCL**: the owner packs the rows it sends into one buffer
//!   (`copy_rows`, reader after reader), the GPUs exchange them with
//!   grouped `ncclSend`/`ncclRecv` pairs, and each reader scatters what it
//!   received into its copy of the factor.
//! - **Peer-to-peer** (one process, peer access between every pair): each
//!   reader pulls its rows straight out of every owner's factor with one
//!   `copy_rows` launch per owner, between two barriers.
//!
//! Chosen per mode ([`RowExchange`]): `auto` sends only the rows read
//! where that moves at most [`kruskal_partition::readers::CHEAPER_SHARE`]
//! (by NCCL) or [`PULL_SHARE`] (by peer reads) of the all-gather's rows
//! to the GPU that receives most; a mode whose
//! rows nearly every GPU reads (a short, dense mode) keeps the all-gather.
//! The rows each GPU reads are marked from its shards while they are
//! built; under `auto`, a mode whose row counts predict nearly every row
//! to be read by every GPU is not marked at all.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, PushKernelArg};
use kruskal_partition::RowShards;
use kruskal_partition::readers::{ExchangeLists, MAX_GPUS, RowReaders, all_gather_received};

use super::exchange::Collective;
use super::worker::{LeftRunning, Worker};
use crate::nccl::Transfer;
use kruskal_device::kernels::Kernel;
use kruskal_device::{DeviceError, Gpu, Result, driver, grid_stride};

/// Which rows the exchange after a mode sends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowExchange {
    /// Per mode, the cheaper of the two.
    #[default]
    Auto,
    /// Every row to every GPU (all-gather).
    All,
    /// Only the rows each GPU reads.
    Read,
}

impl RowExchange {
    /// The name `--exchange-rows` spells.
    pub fn name(self) -> &'static str {
        match self {
            RowExchange::Auto => "auto",
            RowExchange::All => "all",
            RowExchange::Read => "read",
        }
    }
}

impl std::str::FromStr for RowExchange {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(RowExchange::Auto),
            "all" => Ok(RowExchange::All),
            "read" => Ok(RowExchange::Read),
            other => Err(format!("takes auto, all or read, not '{other}'")),
        }
    }
}

/// Under `auto`, a mode is not marked when its row counts predict the
/// sparse exchange to receive more than this share of the all-gather's
/// rows (it would not be chosen).
const PREDICTED_SHARE: f64 = 0.95;

/// What one mode's exchange moves, for the reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExchangeVolume {
    /// Whether only the rows read are sent.
    pub read_only: bool,
    /// Whether nothing is sent: only the rows' owners read them (a split
    /// plan's cut mode).
    pub local: bool,
    /// Bytes the exchange moves per call, over all GPUs (after the first
    /// call, which also sends the empty rows).
    pub bytes: u64,
    /// Bytes the all-gather would move.
    pub all_gather_bytes: u64,
    /// Bytes the reduction of a partial mode's sums onto their owners
    /// sends per MTTKRP (a split plan; 0 otherwise): each owner's rows
    /// with nonzeros from every other GPU, or, where only the rows read
    /// are exchanged, each row from the GPUs that read it.
    pub reduce_bytes: u64,
}

impl ExchangeVolume {
    /// What the report calls the rows sent: `none`, `read` or `all`.
    pub fn rows_name(&self) -> &'static str {
        if self.local {
            "none"
        } else if self.read_only {
            "read"
        } else {
            "all"
        }
    }
}

/// One mode's sparse exchange, as every worker knows it.
#[derive(Clone, Debug)]
pub(super) struct SparseMode {
    /// `counts[o][h]`: rows owner `o` sends reader `h`.
    pub(super) counts: Vec<Vec<u64>>,
}

impl SparseMode {
    /// Rows `g` sends, in all.
    pub(super) fn sent(&self, g: usize) -> u64 {
        self.counts[g].iter().sum()
    }

    /// Rows `g` receives, in all.
    pub(super) fn received(&self, g: usize) -> u64 {
        self.counts.iter().map(|to| to[g]).sum()
    }

    /// Where each reader's rows start in `g`'s send list (readers in
    /// order).
    fn send_offsets(&self, g: usize) -> Vec<u64> {
        prefix(self.counts[g].iter().copied())
    }

    /// Where each owner's rows start in `g`'s receive list (owners in
    /// order).
    fn recv_offsets(&self, g: usize) -> Vec<u64> {
        prefix(self.counts.iter().map(|to| to[g]))
    }
}

fn prefix(counts: impl Iterator<Item = u64>) -> Vec<u64> {
    let mut out = vec![0];
    let mut acc = 0;
    for c in counts {
        acc += c;
        out.push(acc);
    }
    out
}

/// One GPU's lists of one mode: the rows it sends (readers in order, each
/// reader's rows increasing) and the rows it receives (owners in order).
pub(super) struct HostLists {
    pub(super) send: Vec<u32>,
    pub(super) recv: Vec<u32>,
}

/// The lists on the device.
pub(super) struct DeviceLists {
    send: CudaSlice<u32>,
    recv: CudaSlice<u32>,
}

impl DeviceLists {
    pub(super) fn upload(gpu: &Gpu, lists: &HostLists) -> Result<Self> {
        Ok(DeviceLists {
            send: gpu.upload("the rows a GPU sends", &lists.send)?,
            recv: gpu.upload("the rows a GPU receives", &lists.recv)?,
        })
    }
}

/// Which modes are worth marking: all under `read`, none under `all` or
/// with one GPU (or more than the readers' masks hold), and under `auto`
/// those whose row counts predict that the sparse exchange could be
/// chosen.
pub(super) fn modes_to_mark(plan: &RowShards, rows: RowExchange) -> Vec<bool> {
    let n = plan.dims().len();
    let m = plan.gpus();
    if m == 1 || m > MAX_GPUS {
        return vec![false; n];
    }
    (0..n)
        .map(|mode| {
            plan.split() != Some(mode)
                && match rows {
                    RowExchange::All => false,
                    RowExchange::Read => true,
                    RowExchange::Auto => predicted_share(plan, mode) <= PREDICTED_SHARE,
                }
        })
        .collect()
}

/// The modes whose rows go to a GPU that reads them where that keeps the
/// balance ([`RowShards::prefer_readers`]): those a sparse exchange may
/// send (not under `all`) whose row counts predict at most
/// [`PREFER_SHARE`] of the all-gather's rows (a long sparse mode: the pass
/// over the nonzeros it takes pays only there); in a split plan, the
/// partial modes that are marked where the rows read are asked for or
/// pulled (`pull`: [`crate::PartialReduce::Pull`]; their reduction sends
/// the same rows again, so the pass pays twice).
pub(super) fn modes_to_prefer(plan: &RowShards, rows: RowExchange, pull: bool) -> Vec<bool> {
    let n = plan.dims().len();
    let m = plan.gpus();
    if m == 1 || m > MAX_GPUS || rows == RowExchange::All {
        return vec![false; n];
    }
    // A split plan's partial modes, where their rows read are likely to
    // travel alone: asked for, or pulled (`auto` then takes them up to
    // PULL_SHARE). By NCCL under `auto` the busiest GPU's share stayed
    // above CHEAPER_SHARE on nell-1-like 144M (0.60 and 0.70 of the
    // all-gather on 4 GPUs), so the pass over the nonzeros would be lost.
    let split_read = rows == RowExchange::Read || pull;
    (0..n)
        .map(|mode| match plan.split() {
            Some(cut) => {
                split_read && mode != cut && predicted_share(plan, mode) <= PREDICTED_SHARE
            }
            None => predicted_share(plan, mode) <= PREFER_SHARE,
        })
        .collect()
}

/// See [`modes_to_prefer`].
const PREFER_SHARE: f64 = 0.5;

/// The share of the all-gather's rows the GPU that receives most would
/// receive from a sparse exchange, predicted from the row counts alone: a
/// row of `c` nonzeros has `c (N - 1)` factor reads in the other modes'
/// shards, each on a GPU that is, for the prediction, drawn at random.
pub(super) fn predicted_share(plan: &RowShards, mode: usize) -> f64 {
    let draws = if plan.split().is_some() {
        // Every mode's shards follow the cut mode's owners: a nonzero is
        // on one GPU, whichever mode reads it.
        1
    } else {
        plan.dims().len() as u64 - 1
    };
    predicted_share_by(plan, mode, draws)
}

/// [`predicted_share`] with `draws` GPUs drawn per nonzero (in parallel
/// over the rows).
pub(super) fn predicted_share_by(plan: &RowShards, mode: usize, draws: u64) -> f64 {
    use rayon::prelude::*;
    let m = plan.gpus();
    let miss = 1.0 - 1.0 / m as f64;
    let counts = plan.row_nnz(mode);
    // Per owner, its rows' expected readers other than itself.
    let per_owner: Vec<f64> = (0..m)
        .map(|o| {
            let rows = plan.rows_with_nonzeros(mode, o);
            counts[rows.start as usize..rows.end as usize]
                .par_iter()
                .with_min_len(1 << 14)
                .map(|&c| 1.0 - miss.powf((c * draws) as f64))
                .sum::<f64>()
        })
        .collect();
    let total: f64 = per_owner.iter().sum();
    let (mut sparse, mut all) = (0.0f64, 0u64);
    for (h, own) in per_owner.iter().enumerate() {
        sparse = sparse.max(total - own);
        all = all.max(all_gather_received(plan, mode, h));
    }
    if all == 0 { 1.0 } else { sparse / all as f64 }
}

/// Where rows travel by peer reads ([`crate::PartialReduce::Pull`]), `auto`
/// sends only the rows read of a mode where the GPU that receives most
/// receives at most this share of the all-gather's rows: pulled rows
/// moved at the all-gather's rate on 2 x H200 (nell-1-like 144M: 272 MB
/// in 0.45 ms against 356 MB all-gathered in 0.58 ms; on 4 x H200 at about
/// half of it per GPU), and the barrier before the pulls costs a little.
pub const PULL_SHARE: f64 = 0.9;

/// The sparse exchange of a group, as planned.
pub(super) struct SparsePlan {
    /// Per mode, its counts (`None`: all-gathered).
    pub(super) modes: Vec<Option<SparseMode>>,
    /// Per local GPU and mode, its lists.
    pub(super) lists: Vec<Vec<Option<HostLists>>>,
}

/// Which modes of a group are exchanged sparsely (from `rows` and the
/// lists' volumes; `auto`: the cheaper), and each local GPU's lists.
/// `members` are the local GPUs' indices in the plan.
pub(super) fn plan_modes(
    plan: &RowShards,
    readers: &RowReaders,
    marked: &[bool],
    rows: RowExchange,
    members: &[usize],
    pull: bool,
) -> Result<SparsePlan> {
    let n = plan.dims().len();
    let m = plan.gpus();
    let mut modes = vec![None; n];
    let mut per_slot: Vec<Vec<Option<HostLists>>> = members
        .iter()
        .map(|_| (0..n).map(|_| None).collect())
        .collect();
    if !marked.iter().any(|&x| x) {
        return Ok(SparsePlan {
            modes,
            lists: per_slot,
        });
    }
    let lists: ExchangeLists = readers.lists(plan).map_err(|e| DeviceError::Prepare {
        format: "exchange lists",
        message: e.to_string(),
    })?;
    for mode in 0..n {
        if !marked[mode] {
            continue;
        }
        let l = lists.mode(mode);
        let chosen = match rows {
            RowExchange::Read => true,
            RowExchange::All => false,
            RowExchange::Auto if pull => l.cheaper_by(plan, mode, PULL_SHARE),
            RowExchange::Auto => l.cheaper_than_all_gather(plan, mode),
        };
        if !chosen {
            continue;
        }
        let counts = (0..m)
            .map(|o| (0..m).map(|h| l.rows(o, h).len() as u64).collect())
            .collect();
        modes[mode] = Some(SparseMode { counts });
        for (slot, &g) in members.iter().enumerate() {
            let send = (0..m).flat_map(|h| l.rows(g, h).iter().copied()).collect();
            let recv = (0..m).flat_map(|o| l.rows(o, g).iter().copied()).collect();
            per_slot[slot][mode] = Some(HostLists { send, recv });
        }
    }
    Ok(SparsePlan {
        modes,
        lists: per_slot,
    })
}

/// What mode `mode`'s exchange moves with `sparse` (or the all-gather).
pub(super) fn volume(
    plan: &RowShards,
    mode: usize,
    rank: usize,
    sparse: Option<&SparseMode>,
) -> ExchangeVolume {
    let m = plan.gpus();
    let row_bytes = (rank * 4) as u64;
    let all: u64 = (0..m).map(|h| all_gather_received(plan, mode, h)).sum();
    let all_gather_bytes = if m > 1 { all * row_bytes } else { 0 };
    let local = plan.split() == Some(mode) && m > 1;
    // A partial mode's reduction sends back what its exchange sends.
    let reduce_bytes = match sparse {
        _ if !plan.partial(mode) => 0,
        Some(s) => (0..m).map(|h| s.received(h)).sum::<u64>() * row_bytes,
        None => all * row_bytes,
    };
    let (read_only, bytes) = match sparse {
        _ if local => (false, 0),
        Some(s) => (true, (0..m).map(|h| s.received(h)).sum::<u64>() * row_bytes),
        None => (false, all_gather_bytes),
    };
    ExchangeVolume {
        read_only,
        local,
        bytes,
        all_gather_bytes,
        reduce_bytes,
    }
}

/// Queues `copy_rows` on `stream`: `count` rows of `rank` floats from
/// `src` (rows `src_rows[i]`, or `i` when 0) to `dst` (rows `dst_rows[i]`,
/// or `i`).
///
/// # Safety
/// Every row read must lie inside the memory at `src` and every row
/// written inside the memory at `dst` (device addresses this GPU can reach,
/// a peer's with peer access), both alive until the stream has run the
/// copy; the lists, when not 0, must hold `count` u32 each.
pub(crate) unsafe fn copy_rows(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    rank: usize,
    src: (u64, u64),
    dst: (u64, u64),
    count: u64,
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { move_rows(gpu, stream, Kernel::CopyRows, rank, src, dst, count) }
}

/// [`copy_rows`] adding the rows onto the destination's (`add_rows`)
/// instead of overwriting them.
///
/// # Safety
/// As [`copy_rows`]; the destination rows must be distinct.
unsafe fn add_rows(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    rank: usize,
    src: (u64, u64),
    dst: (u64, u64),
    count: u64,
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { move_rows(gpu, stream, Kernel::AddRows, rank, src, dst, count) }
}

/// Queues `kernel` (`copy_rows` or `add_rows`, one argument list).
///
/// # Safety
/// As [`copy_rows`].
unsafe fn move_rows(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    kernel: Kernel,
    rank: usize,
    src: (u64, u64),
    dst: (u64, u64),
    count: u64,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let f = gpu
        .kernels()
        .function(gpu.context(), kernel, &[("RANK", rank as i64)])?;
    let per = if rank % 4 == 0 { rank / 4 } else { rank } as u64;
    let mut l = stream.launch_builder(&f);
    l.arg(&src.0)
        .arg(&src.1)
        .arg(&dst.0)
        .arg(&dst.1)
        .arg(&count);
    // SAFETY: the caller's contract.
    unsafe { l.launch(grid_stride(count * per, 256)) }.map_err(driver("launching a row copy"))?;
    Ok(())
}

/// One grouped NCCL round on `stream` over `peers` GPUs: to each peer, the
/// rows `send(peer)` gives (a count of rows of `rank` floats and the
/// address of the first) sent, then those `recv(peer)` gives received;
/// a count of 0 moves nothing.
///
/// # Safety
/// Every address must hold its rows on this GPU, and stay allocated and
/// untouched until the stream has run the transfers.
#[allow(clippy::too_many_arguments)]
unsafe fn send_and_receive(
    collective: &Collective,
    slot: usize,
    stream: &Arc<CudaStream>,
    rank: usize,
    peers: usize,
    send: impl Fn(usize) -> (u64, u64),
    recv: impl Fn(usize) -> (u64, u64),
) -> Result<()> {
    let (nccl, comm) = collective.comm(slot);
    let nccl_err = |e: crate::nccl::NcclError| DeviceError::Nccl(e.to_string());
    nccl.group_start().map_err(nccl_err)?;
    for peer in 0..peers {
        for (way, (rows, at)) in [(Transfer::Send, send(peer)), (Transfer::Recv, recv(peer))] {
            if rows == 0 {
                continue;
            }
            // SAFETY: the caller's contract.
            unsafe {
                nccl.transfer_f32(
                    way,
                    comm,
                    at,
                    (rows * rank as u64) as usize,
                    peer,
                    stream.cu_stream() as _,
                )
            }
            .map_err(nccl_err)?;
        }
    }
    nccl.group_end().map_err(nccl_err)
}

/// The device address of element `at` of `list`.
fn element_ptr(list: &CudaSlice<u32>, stream: &Arc<CudaStream>, at: u64) -> u64 {
    let (ptr, _sync) = list.device_ptr(stream);
    ptr + at * 4
}

impl Worker {
    /// Sends and receives the rows of `mode` that `sparse` lists; returns
    /// the milliseconds it took. With `leave`, an exchange by NCCL is left
    /// running on the stream and 0 is returned ([`Worker::leave_running`]);
    /// pulls are waited for.
    pub(super) fn exchange_read(
        &mut self,
        mode: usize,
        sparse: &SparseMode,
        leave: bool,
    ) -> Result<f64> {
        let started = std::time::Instant::now();
        let stream = self.gpu.stream().clone();
        let r = self.rank;
        let g = self.g;
        let row_bytes = (r * 4) as u64;
        let own_ptr = self.shared.factor_ptrs.lock().expect("pointer table")[self.slot];
        let mode_at = self.shared.first_row[mode] * row_bytes;
        let lists = self.lists[mode]
            .as_ref()
            .ok_or_else(|| DeviceError::Shape(format!("no exchange lists for mode {mode}")))?;
        let recv_at = sparse.recv_offsets(g);
        let collective = self
            .shared
            .collective
            .as_ref()
            .filter(|_| !self.shared.pull);
        match collective {
            Some(collective) => {
                let left = self.leave_running(leave)?;
                let (sent, received) = (sparse.sent(g), sparse.received(g));
                ensure(&self.gpu, &mut self.send_buf, sent * r as u64)?;
                ensure(&self.gpu, &mut self.recv_buf, received * r as u64)?;
                let send_buf = self.send_buf.as_ref().expect("made above");
                let recv_buf = self.recv_buf.as_ref().expect("made above");
                let (send_ptr, _s) = send_buf.device_ptr(&stream);
                let (recv_ptr, _r) = recv_buf.device_ptr(&stream);
                let send_list = element_ptr(&lists.send, &stream, 0);
                let recv_list = element_ptr(&lists.recv, &stream, 0);
                // SAFETY: the send list holds `sent` row labels of this
                // mode (below its dimension, so inside this GPU's factor
                // buffer at `mode_at`), and the send buffer `sent` rows.
                unsafe {
                    copy_rows(
                        &self.gpu,
                        &stream,
                        r,
                        (own_ptr + mode_at, send_list),
                        (send_ptr, 0),
                        sent,
                    )
                }?;
                let send_at = sparse.send_offsets(g);
                // SAFETY: reader `peer`'s rows lie inside the send buffer,
                // owner `peer`'s inside the receive buffer, both kept in
                // this worker until the stream has run the transfers (the
                // wait below, or the next one when left running).
                unsafe {
                    send_and_receive(
                        collective,
                        self.slot,
                        &stream,
                        r,
                        sparse.counts.len(),
                        |peer| (sparse.counts[g][peer], send_ptr + send_at[peer] * row_bytes),
                        |peer| (sparse.counts[peer][g], recv_ptr + recv_at[peer] * row_bytes),
                    )
                }?;
                // SAFETY: the receive list holds `received` labels of this
                // mode, the receive buffer as many rows.
                unsafe {
                    copy_rows(
                        &self.gpu,
                        &stream,
                        r,
                        (recv_ptr, 0),
                        (own_ptr + mode_at, recv_list),
                        received,
                    )
                }?;
                if let Some(start) = left {
                    // The lists and packed buffers live with the worker,
                    // and every later use of them (a larger buffer frees
                    // the old one in stream order) is queued behind on
                    // this stream.
                    self.running = Some(LeftRunning::ends_here(&stream, mode, start)?);
                    return Ok(0.0);
                }
                self.wait(&stream, "the sparse NCCL exchange")?;
            }
            None => {
                // Every owner's rows must be final before anyone pulls.
                self.wait(&stream, "the update before the exchange")?;
                self.barrier()?;
                let ptrs = self
                    .shared
                    .factor_ptrs
                    .lock()
                    .expect("pointer table")
                    .clone();
                for (o, &owner_ptr) in ptrs.iter().enumerate() {
                    let count = sparse.counts[o][g];
                    if o == g || count == 0 {
                        continue;
                    }
                    let rows = element_ptr(&lists.recv, &stream, recv_at[o]);
                    // SAFETY: the labels (`count` of them from `rows`) are
                    // rows of this mode, inside both factor buffers, which
                    // have one layout; the owner's buffer is reachable
                    // (peer access between every pair, checked when the
                    // sparse exchange was chosen) and nobody writes these
                    // rows until the barrier below.
                    unsafe {
                        copy_rows(
                            &self.gpu,
                            &stream,
                            r,
                            (owner_ptr + mode_at, rows),
                            (own_ptr + mode_at, rows),
                            count,
                        )
                    }?;
                }
                self.wait(&stream, "pulling rows from the other GPUs")?;
                self.barrier()?;
            }
        }
        Ok(started.elapsed().as_secs_f64() * 1e3)
    }
}

impl Worker {
    /// Sums a partial mode's sums of the rows read onto their owners, the
    /// sparse exchange run backwards: GPU `g` holds partial sums of the
    /// rows its shards read (its receive list, owners in order) and owns
    /// the rows its send list gives to each reader. Each owner adds each
    /// reader's part in reader order (`add_rows`, one launch per reader),
    /// so the sums are the same on every run. Rows no other GPU reads
    /// never travel. With NCCL the parts are packed and exchanged by
    /// grouped sends and receives, queued on the main stream after the
    /// MTTKRP; with pulls (one process, peer access) each owner reads them
    /// straight out of the readers' outputs once every GPU's MTTKRP is done
    /// (the host waits for its own and meets the others at a barrier).
    pub(super) fn reduce_read(&mut self, mode: usize, sparse: &SparseMode) -> Result<()> {
        let stream = self.gpu.stream().clone();
        let r = self.rank;
        let g = self.g;
        let row_bytes = (r * 4) as u64;
        if self.lists[mode].is_none() {
            return Err(DeviceError::Shape(format!(
                "no exchange lists for mode {mode}"
            )));
        }
        let out_ptr = {
            let out = self.outputs[mode]
                .as_ref()
                .ok_or_else(|| DeviceError::Shape("no MTTKRP output to reduce".into()))?;
            out.device_ptr(&stream).0
        };
        // Reader h's rows of this GPU: send list from send_at[h].
        let send_at = sparse.send_offsets(g);
        let collective = self
            .shared
            .collective
            .as_ref()
            .filter(|_| !self.shared.pull);
        match collective {
            Some(collective) => {
                // Parts out: the rows this GPU reads (its receive list),
                // to their owners; parts in: its own rows, from each reader.
                let (out_rows, in_rows) = (sparse.received(g), sparse.sent(g));
                ensure(&self.gpu, &mut self.send_buf, out_rows * r as u64)?;
                ensure(&self.gpu, &mut self.recv_buf, in_rows * r as u64)?;
                let lists = self.lists[mode].as_ref().expect("checked above");
                let send_buf = self.send_buf.as_ref().expect("made above");
                let recv_buf = self.recv_buf.as_ref().expect("made above");
                let (pack_ptr, _s) = send_buf.device_ptr(&stream);
                let (parts_ptr, _r) = recv_buf.device_ptr(&stream);
                let read_list = element_ptr(&lists.recv, &stream, 0);
                // SAFETY: the receive list holds `out_rows` labels of this
                // mode, rows of the partial output (every row of the
                // mode); the pack buffer holds as many rows.
                unsafe {
                    copy_rows(
                        &self.gpu,
                        &stream,
                        r,
                        (out_ptr, read_list),
                        (pack_ptr, 0),
                        out_rows,
                    )
                }?;
                let recv_at = sparse.recv_offsets(g);
                // SAFETY: owner `peer`'s rows lie inside the pack buffer,
                // reader `peer`'s inside the parts buffer, both kept in
                // this worker until the stream has run the transfers (the
                // next sync waits for it).
                unsafe {
                    send_and_receive(
                        collective,
                        self.slot,
                        &stream,
                        r,
                        sparse.counts.len(),
                        |peer| (sparse.counts[peer][g], pack_ptr + recv_at[peer] * row_bytes),
                        |peer| {
                            (
                                sparse.counts[g][peer],
                                parts_ptr + send_at[peer] * row_bytes,
                            )
                        },
                    )
                }?;
                for (h, &count) in sparse.counts[g].iter().enumerate() {
                    let rows = element_ptr(&lists.send, &stream, send_at[h]);
                    // SAFETY: reader h's part (`count` rows) lies in the
                    // parts buffer at its offset; its labels (distinct
                    // rows this GPU owns) in the send list.
                    unsafe {
                        add_rows(
                            &self.gpu,
                            &stream,
                            r,
                            (parts_ptr + send_at[h] * row_bytes, 0),
                            (out_ptr, rows),
                            count,
                        )
                    }?;
                }
            }
            None => {
                self.wait(&stream, "the MTTKRP before the reduction")?;
                self.barrier()?;
                let outputs = self.shared.output_ptrs.lock().expect("pointer table")[mode].clone();
                let lists = self.lists[mode].as_ref().expect("checked above");
                for (h, &count) in sparse.counts[g].iter().enumerate() {
                    if h == g || count == 0 {
                        continue;
                    }
                    let rows = element_ptr(&lists.send, &stream, send_at[h]);
                    // SAFETY: every GPU's partial output of this mode holds
                    // every row (one layout); reader h's is reachable (peer
                    // access between every pair, checked when pulls were
                    // chosen) and final (the barrier above), and h writes it
                    // again only at this mode's next MTTKRP, after this
                    // GPU's sync has waited for these reads. The labels are
                    // distinct rows this GPU owns.
                    unsafe {
                        add_rows(
                            &self.gpu,
                            &stream,
                            r,
                            (outputs[h], rows),
                            (out_ptr, rows),
                            count,
                        )
                    }?;
                }
            }
        }
        Ok(())
    }
}

/// Grows `buf` to at least `len` floats (never shrinks it).
fn ensure(gpu: &Gpu, buf: &mut Option<CudaSlice<f32>>, len: u64) -> Result<()> {
    let len = len.max(1) as usize;
    if buf.as_ref().is_none_or(|b| b.len() < len) {
        *buf = None;
        *buf = Some(gpu.alloc_zeros("an exchange buffer", len)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_follow_the_counts() {
        let s = SparseMode {
            counts: vec![vec![0, 3, 1], vec![2, 0, 0], vec![5, 4, 0]],
        };
        assert_eq!(s.sent(0), 4);
        assert_eq!(s.received(0), 7);
        assert_eq!(s.send_offsets(2), vec![0, 5, 9, 9]);
        assert_eq!(s.recv_offsets(1), vec![0, 3, 3, 7]);
    }

    #[test]
    fn row_exchange_names_parse_back() {
        for r in [RowExchange::Auto, RowExchange::All, RowExchange::Read] {
            assert_eq!(r.name().parse::<RowExchange>(), Ok(r));
        }
        assert!("some".parse::<RowExchange>().is_err());
    }

    #[test]
    fn a_long_mode_of_empty_rows_is_marked_and_a_dense_one_is_not() {
        let t = kruskal_formats::generate::power_law(
            &kruskal_formats::generate::PowerLawSpec::new(vec![20, 30, 20_000], 5_000).with_seed(9),
        )
        .unwrap();
        let plan = RowShards::new(&t, 4).unwrap();
        let marked = modes_to_mark(&plan, RowExchange::Auto);
        assert_eq!(marked, vec![false, false, true]);
        assert_eq!(modes_to_mark(&plan, RowExchange::Read), vec![true; 3]);
        assert_eq!(modes_to_mark(&plan, RowExchange::All), vec![false; 3]);
        let one = RowShards::new(&t, 1).unwrap();
        assert_eq!(modes_to_mark(&one, RowExchange::Read), vec![false; 3]);
    }

    #[test]
    fn a_split_plan_prefers_readers_in_its_light_partial_modes_only() {
        // Two long modes of light rows and a short dense third.
        let t = kruskal_formats::generate::power_law(
            &kruskal_formats::generate::PowerLawSpec::new(vec![40_000, 30_000, 300], 30_000)
                .with_seed(5),
        )
        .unwrap();
        let mut plan = RowShards::new(&t, 4).unwrap();
        plan.split_by(2).unwrap();
        assert_eq!(
            modes_to_prefer(&plan, RowExchange::Read, false),
            vec![true, true, false]
        );
        assert_eq!(
            modes_to_prefer(&plan, RowExchange::Auto, true),
            vec![true, true, false]
        );
        // By NCCL under auto, and with every row sent, none.
        assert_eq!(
            modes_to_prefer(&plan, RowExchange::Auto, false),
            vec![false; 3]
        );
        assert_eq!(
            modes_to_prefer(&plan, RowExchange::All, true),
            vec![false; 3]
        );
        // Split by a light mode, the dense one is read by every GPU.
        let mut plan = RowShards::new(&t, 4).unwrap();
        plan.split_by(0).unwrap();
        assert_eq!(
            modes_to_prefer(&plan, RowExchange::Read, false),
            vec![false, true, false]
        );
    }
}
