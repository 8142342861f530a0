//! The steps of CP-APR (Poisson CP by multiplicative updates) on one GPU
//! (`kernels/apr.cu`), in f64: `Pi` of a mode, `Phi` with the KKT
//! violation, the multiplicative update, the kappa fix with lambda folded
//! in, column 1-norms and scaling, and the log-likelihood's sum over the
//! nonzeros. The driver (the outer and inner iterations, the stopping
//! rules) is `kruskal_cpd::apr_gpu`, which builds each mode's sorted copy
//! of the nonzeros on the host and hands it to [`AprGpu::upload_copy`].
//!
//! A mode's inner loop runs without the host: every inner iteration is
//! queued at once ([`AprGpu::begin_inner`], [`AprGpu::queue_phi`],
//! [`AprGpu::queue_update`]); the update of an iteration whose KKT
//! violation is below the tolerance is not done and sets a flag on the
//! device that turns the iterations queued after it into empty launches.
//! The violations of every iteration come back once, at the end of the
//! mode ([`AprGpu::read_kkts`]); per mode also the kappa flag and the R
//! column norms; per outer iteration, the log-likelihood. Every sum runs
//! in a fixed order, so a run is bit-identical run to run on one GPU.
//!
//! A GPU may hold a *part* of the work ([`AprGpu::new_part`]): for each
//! mode, a range of rows it owns and the sorted copy of those rows'
//! nonzeros only, beside every factor whole. Its steps then read and write
//! its own rows of the mode's factor and `Phi`; [`share_rows`] copies each
//! part's rows of a mode to every other part (peer copies) once the mode
//! is done. CP-APR updates a mode's rows independently of one another, so
//! parts on several GPUs compute what one GPU does. The one thing they
//! decide together is when a mode's inner loop ends: [`share_kkt`] copies
//! each part's share of an iteration's KKT violation to every other part,
//! and each part's update waits for the copies (events, not the host).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, LaunchConfig, PushKernelArg};
use ndarray::Array2;

use crate::kernels::Kernel;
use crate::{DeviceError, Gpu, Result, driver, grid_stride};

/// The largest rank the kernels take (the column sums give each column a
/// thread of a 256-thread block).
pub const MAX_RANK: usize = 256;

/// Threads per block (`THREADS` in `apr.cu`); a warp per row.
const THREADS: u32 = 256;
const WARPS_PER_BLOCK: usize = THREADS as usize / 32;

/// Blocks of the warp-per-row kernels at most: enough warps to fill any
/// GPU, and few enough partial sums of the log-likelihood to add in one
/// thread. Fixed, so sums come out the same on every GPU.
const ROW_BLOCKS: usize = 4096;
/// Blocks of the column sums at most.
const COLUMN_BLOCKS: usize = 1024;

/// Nonzeros of a piece at most: `Phi` and the log-likelihood give each
/// piece of a row, not each row, to a warp, so a row holding a large share
/// of the nonzeros is spread over many warps.
pub const PIECE_NNZ: usize = 256;

/// Pieces per run of a row of more pieces than this (`CHUNK` in
/// `apr.cu`): `apr_phi_chunks` sums such a row's runs of this many pieces
/// first, then `apr_phi_rows` the runs, so the row's sum is spread over
/// threads.
pub const CHUNK_PIECES: u64 = 32;

/// A sorted copy's rows cut into pieces of at most [`PIECE_NNZ`]
/// consecutive nonzeros (an empty row has none).
#[derive(Debug, PartialEq)]
pub struct Pieces {
    /// `npieces + 1` entries: piece k is nonzeros `begin[k]..begin[k + 1]`.
    pub begin: Vec<u64>,
    /// The row of each piece.
    pub row: Vec<u32>,
    /// `rows + 1` entries: row i's pieces are `ptr[i]..ptr[i + 1]`.
    pub ptr: Vec<u64>,
}

impl Pieces {
    /// The pieces of the rows of `row_ptr` (nondecreasing, from 0), at most
    /// `most` nonzeros each. Cost: O(rows + pieces).
    pub fn new(row_ptr: &[u64], most: usize) -> Self {
        let most = most.max(1) as u64;
        let rows = row_ptr.len().saturating_sub(1);
        let mut begin = Vec::new();
        let mut row = Vec::new();
        let mut ptr = Vec::with_capacity(rows + 1);
        ptr.push(0);
        for (i, w) in row_ptr.windows(2).enumerate() {
            let mut at = w[0];
            while at < w[1] {
                begin.push(at);
                row.push(i as u32);
                at = (at + most).min(w[1]);
            }
            ptr.push(begin.len() as u64);
        }
        begin.push(row_ptr.last().copied().unwrap_or(0));
        Pieces { begin, row, ptr }
    }

    pub fn len(&self) -> usize {
        self.row.len()
    }

    pub fn is_empty(&self) -> bool {
        self.row.is_empty()
    }
}

/// Pieces of a mode of `rows` rows at most: one per nonempty row and one
/// per [`PIECE_NNZ`] nonzeros beyond.
fn pieces_bound(rows: u64, nnz: u64) -> u64 {
    rows.min(nnz).saturating_add(nnz / PIECE_NNZ as u64)
}

/// Errors unless the kernels take `rank`.
pub fn check_rank(rank: usize) -> Result<()> {
    if rank == 0 || rank > MAX_RANK {
        return Err(DeviceError::Shape(format!(
            "GPU CP-APR takes ranks 1 to {MAX_RANK}, not {rank}"
        )));
    }
    Ok(())
}

/// One mode's copy of the nonzeros, sorted by that mode's index.
pub struct SortedCopy<'a> {
    /// `dims[mode] + 1` entries: row i's nonzeros are `row_ptr[i]..row_ptr[i + 1]`.
    pub row_ptr: &'a [u64],
    /// `nnz` counts.
    pub values: &'a [f64],
    /// The other modes' indices, ascending mode order, mode-major:
    /// `(nmodes - 1) * nnz` entries.
    pub other: &'a [u32],
}

/// A sorted copy on the device.
struct DeviceCopy {
    /// [`Pieces`]: `begin`, `row`, `ptr` and their count.
    piece_begin: CudaSlice<u64>,
    piece_row: CudaSlice<u32>,
    piece_ptr: CudaSlice<u64>,
    npieces: usize,
    /// Whether a row has more than [`CHUNK_PIECES`] pieces.
    long_rows: bool,
    values: CudaSlice<f64>,
    other: CudaSlice<u32>,
    /// Where each other mode's factor starts in the factor buffer.
    offsets: CudaSlice<u64>,
}

/// What [`AprGpu::new`] and the sorted copies take on the device, by part
/// (bytes): the copies (`nnz * (8 + 4 (N-1))` and a row pointer of 8 bytes
/// per index, per mode), their pieces (12 bytes each, at most one per
/// nonempty row and one per [`PIECE_NNZ`] nonzeros beyond), `Pi`
/// (`nnz * R * 8`), the factors and `Phi` (`rows * R * 8` each), the
/// pieces' sums of `Phi` (`R * 8` per piece of the mode with the most)
/// and the partial sums.
pub fn device_bytes(dims: &[u32], nnz: usize, rank: usize) -> Vec<(&'static str, u64)> {
    let parts: Vec<(u64, u64)> = dims.iter().map(|&d| (u64::from(d), nnz as u64)).collect();
    part_bytes(dims, rank, &parts)
}

/// [`device_bytes`] of a part ([`AprGpu::new_part`]): `owned[m]` is
/// (rows owned, their nonzeros) of mode m. The factors and `Phi` are whole
/// on every part; the copies, their pieces and `Pi` are the part's.
pub fn part_bytes(dims: &[u32], rank: usize, owned: &[(u64, u64)]) -> Vec<(&'static str, u64)> {
    let nmodes = dims.len() as u64;
    let r = rank as u64;
    let rows: u64 = dims.iter().map(|&d| u64::from(d)).sum();
    let copies = owned
        .iter()
        .map(|&(rows, nnz)| {
            nnz.saturating_mul(8 + 4 * nmodes.saturating_sub(1))
                .saturating_add(rows.saturating_add(1).saturating_mul(8))
        })
        .fold(0, u64::saturating_add);
    let pieces: u64 = owned
        .iter()
        .map(|&(rows, nnz)| pieces_bound(rows, nnz).saturating_add(1))
        .fold(0, u64::saturating_add);
    let most = max_pieces(owned);
    let most_nnz = owned.iter().map(|p| p.1).max().unwrap_or(0);
    let matrix = rows.saturating_mul(r).saturating_mul(8);
    vec![
        ("sorted copies", copies),
        ("pieces", pieces.saturating_mul(12)),
        ("Pi", most_nnz.saturating_mul(r).saturating_mul(8)),
        ("factors", matrix),
        ("Phi", matrix),
        ("pieces' sums", most.saturating_mul(r).saturating_mul(8)),
        ("partial sums", partials_len(rank) as u64 * 8),
    ]
}

/// Pieces of the mode with the most, at most (`owned`: rows and nonzeros
/// per mode).
fn max_pieces(owned: &[(u64, u64)]) -> u64 {
    owned
        .iter()
        .map(|&(rows, nnz)| pieces_bound(rows, nnz))
        .max()
        .unwrap_or(0)
}

fn partials_len(rank: usize) -> usize {
    ROW_BLOCKS.max(COLUMN_BLOCKS * rank)
}

/// Blocks of a warp-per-row kernel over `rows`.
fn row_blocks(rows: usize) -> u32 {
    rows.div_ceil(WARPS_PER_BLOCK).clamp(1, ROW_BLOCKS) as u32
}

/// Blocks of `apr_phi`: a warp per piece, uncapped (each piece's sum is
/// its own, so the grid does not change a result), so the hardware's block
/// scheduler balances pieces of unequal length. Against a grid capped at
/// [`ROW_BLOCKS`]: 2.70 against 2.80 ms for 20M nonzeros on an H200 (see
/// docs/performance.md, CP-APR on several GPUs).
fn piece_blocks(npieces: usize) -> u32 {
    npieces
        .div_ceil(WARPS_PER_BLOCK)
        .clamp(1, i32::MAX as usize) as u32
}

/// Blocks of the column sums over `rows` (`SLOTS` rows per block pass).
fn column_blocks(rows: usize, rank: usize) -> u32 {
    let slots = (THREADS as usize / rank).max(1);
    rows.div_ceil(slots).clamp(1, COLUMN_BLOCKS) as u32
}

/// Mode `mode`'s sorted copy (a function of the field alone, so the other
/// buffers can be borrowed mutably beside it).
fn copy_of(copies: &[Option<DeviceCopy>], mode: usize) -> Result<&DeviceCopy> {
    copies
        .get(mode)
        .and_then(Option::as_ref)
        .ok_or_else(|| DeviceError::Shape(format!("no sorted copy of mode {mode} uploaded")))
}

fn blocks(n: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// CP-APR's arrays on one GPU and the launches of its steps.
pub struct AprGpu {
    gpu: Arc<Gpu>,
    rank: usize,
    dims: Vec<u32>,
    /// The rows of each mode this GPU owns (all of them on one GPU).
    own: Vec<Range<usize>>,
    /// The nonzeros of each mode's sorted copy (those of the owned rows).
    nnz: Vec<usize>,
    /// Element offset of each mode's factor (and Phi) in the buffers.
    starts: Vec<usize>,
    copies: Vec<Option<DeviceCopy>>,
    factors: CudaSlice<f64>,
    phi: CudaSlice<f64>,
    pi: CudaSlice<f64>,
    /// The pieces' sums of `Phi` (pieces x rank).
    piece_sums: CudaSlice<f64>,
    lambda: CudaSlice<f64>,
    inv: CudaSlice<f64>,
    partials: CudaSlice<f64>,
    sums: CudaSlice<f64>,
    /// The KKT violation of each inner iteration of the mode under way, as
    /// the bits of a non-negative double: `parts` rows of `max_inner`
    /// slots, this part's shares in row `part`, the other parts' copied
    /// into theirs ([`AprGpu::begin_inner`]).
    kkt: CudaSlice<u64>,
    inner: InnerLayout,
    /// Set on the device when the mode's inner loop has ended.
    stop: CudaSlice<u32>,
    /// Recorded after this part's KKT shares go out ([`share_kkt`]).
    shared: CudaEvent,
    /// The device address of every part's KKT array, as `apr_share_kkt`
    /// reads them, and the host's copy of what was uploaded.
    peers: CudaSlice<u64>,
    peer_bases: Vec<u64>,
    fixed: CudaSlice<u32>,
}

/// How [`AprGpu::begin_inner`] laid out the KKT slots: which row is this
/// part's, of how many, and slots per row.
#[derive(Clone, Copy, Debug, PartialEq)]
struct InnerLayout {
    part: usize,
    parts: usize,
    max_inner: usize,
}

impl AprGpu {
    /// Allocates the factors, `Phi`, `Pi` and the small buffers for a
    /// tensor of `dims` with `nnz` nonzeros at `rank`, after checking that
    /// these and the sorted copies ([`device_bytes`]) fit in free memory.
    pub fn new(gpu: Arc<Gpu>, dims: &[u32], nnz: usize, rank: usize) -> Result<Self> {
        let own: Vec<Range<usize>> = dims.iter().map(|&d| 0..d as usize).collect();
        Self::new_part(gpu, dims, rank, &own, &vec![nnz; dims.len()])
    }

    /// [`AprGpu::new`] for a part of the work: rows `own[m]` of each mode m,
    /// whose sorted copy will hold `nnz[m]` nonzeros. Every factor is held
    /// whole; the steps touch only the owned rows of the mode they act on.
    pub fn new_part(
        gpu: Arc<Gpu>,
        dims: &[u32],
        rank: usize,
        own: &[Range<usize>],
        nnz: &[usize],
    ) -> Result<Self> {
        check_rank(rank)?;
        if own.len() != dims.len()
            || nnz.len() != dims.len()
            || own
                .iter()
                .zip(dims)
                .any(|(r, &d)| r.start > r.end || r.end > d as usize)
        {
            return Err(DeviceError::Shape(format!(
                "owned rows {own:?} and nonzeros {nnz:?} do not fit dims {dims:?}"
            )));
        }
        let owned: Vec<(u64, u64)> = own
            .iter()
            .zip(nnz)
            .map(|(r, &n)| (r.len() as u64, n as u64))
            .collect();
        let need: u64 = part_bytes(dims, rank, &owned).iter().map(|p| p.1).sum();
        let most_nnz = nnz.iter().copied().max().unwrap_or(0);
        gpu.ensure_free(
            "CP-APR's sorted copies, Pi, factors and Phi",
            usize::try_from(need).unwrap_or(usize::MAX),
        )?;
        let mut starts = Vec::with_capacity(dims.len() + 1);
        let mut at = 0usize;
        for &d in dims {
            starts.push(at);
            at += d as usize * rank;
        }
        starts.push(at);
        Ok(AprGpu {
            factors: gpu.alloc_zeros("the CP-APR factors", at)?,
            phi: gpu.alloc_zeros("CP-APR's Phi", at)?,
            pi: gpu.alloc_zeros("CP-APR's Pi", most_nnz * rank)?,
            piece_sums: gpu.alloc_zeros(
                "CP-APR's pieces of Phi",
                usize::try_from(max_pieces(&owned))
                    .unwrap_or(usize::MAX)
                    .saturating_mul(rank),
            )?,
            lambda: gpu.alloc_zeros("the CP-APR weights", rank)?,
            inv: gpu.alloc_zeros("the CP-APR column scales", rank)?,
            partials: gpu.alloc_zeros("the CP-APR partial sums", partials_len(rank))?,
            sums: gpu.alloc_zeros("the CP-APR sums", rank)?,
            kkt: gpu.alloc_zeros("the KKT violations", 1)?,
            inner: InnerLayout {
                part: 0,
                parts: 1,
                max_inner: 1,
            },
            stop: gpu.alloc_zeros("the inner loop's flag", 1)?,
            shared: gpu
                .context()
                .new_event(None)
                .map_err(driver("creating an event"))?,
            peers: gpu.alloc_zeros("the KKT arrays' addresses", 1)?,
            peer_bases: Vec::new(),
            fixed: gpu.alloc_zeros("the kappa flag", 1)?,
            copies: (0..dims.len()).map(|_| None).collect(),
            gpu,
            rank,
            dims: dims.to_vec(),
            own: own.to_vec(),
            nnz: nnz.to_vec(),
            starts,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The rows of mode `mode` this GPU owns.
    pub fn owned(&self, mode: usize) -> Range<usize> {
        self.own[mode].clone()
    }

    fn rows(&self, mode: usize) -> usize {
        self.own[mode].len()
    }

    /// Where the owned rows of mode `mode` lie in the factor and `Phi`
    /// buffers (elements).
    fn range(&self, mode: usize) -> Range<usize> {
        let own = &self.own[mode];
        self.starts[mode] + own.start * self.rank..self.starts[mode] + own.end * self.rank
    }

    fn len(&self, mode: usize) -> usize {
        self.range(mode).len()
    }

    fn defines(&self) -> Vec<(&'static str, i64)> {
        vec![("RANK", self.rank as i64)]
    }

    fn function(&self, kernel: Kernel) -> Result<cudarc::driver::CudaFunction> {
        self.gpu
            .kernels()
            .function(self.gpu.context(), kernel, &self.defines())
    }

    /// Uploads mode `mode`'s sorted copy (checked against the shapes).
    pub fn upload_copy(&mut self, mode: usize, copy: &SortedCopy) -> Result<()> {
        let nmodes = self.dims.len();
        if mode >= nmodes {
            return Err(DeviceError::Shape(format!(
                "mode {mode} of a {nmodes}-mode tensor"
            )));
        }
        let rows = self.rows(mode);
        let nnz = self.nnz[mode];
        if copy.row_ptr.len() != rows + 1
            || copy.values.len() != nnz
            || copy.other.len() != (nmodes - 1) * nnz
            || copy.row_ptr.first() != Some(&0)
            || copy.row_ptr.last() != Some(&(nnz as u64))
            || copy.row_ptr.windows(2).any(|w| w[0] > w[1])
        {
            return Err(DeviceError::Shape(format!(
                "the sorted copy of mode {mode} does not fit {rows} rows and {nnz} nonzeros"
            )));
        }
        for (k, idx) in copy.other.chunks(nnz.max(1)).enumerate() {
            let m = if k < mode { k } else { k + 1 };
            if let Some(bad) = idx.iter().find(|&&i| i >= self.dims[m]) {
                return Err(DeviceError::Shape(format!(
                    "index {bad} of mode {m} in the sorted copy of mode {mode} is past {}",
                    self.dims[m]
                )));
            }
        }
        let offsets: Vec<u64> = (0..nmodes)
            .filter(|&m| m != mode)
            .map(|m| self.starts[m] as u64)
            .collect();
        let pieces = Pieces::new(copy.row_ptr, PIECE_NNZ);
        if pieces.len() * self.rank > self.piece_sums.len() {
            return Err(DeviceError::Shape(format!(
                "{} pieces of mode {mode} exceed the bound",
                pieces.len()
            )));
        }
        self.copies[mode] = Some(DeviceCopy {
            piece_begin: self.gpu.upload("CP-APR's pieces", &pieces.begin)?,
            piece_row: self.gpu.upload("CP-APR's pieces", &pieces.row)?,
            piece_ptr: self.gpu.upload("CP-APR's pieces", &pieces.ptr)?,
            npieces: pieces.len(),
            long_rows: pieces.ptr.windows(2).any(|w| w[1] - w[0] > CHUNK_PIECES),
            values: self
                .gpu
                .upload("a CP-APR sorted copy's values", copy.values)?,
            other: self
                .gpu
                .upload("a CP-APR sorted copy's indices", copy.other)?,
            offsets: self.gpu.upload("the CP-APR factor offsets", &offsets)?,
        });
        Ok(())
    }

    /// Uploads the factors (one `dims[m] x rank` matrix per mode).
    pub fn set_factors(&mut self, factors: &[Array2<f64>]) -> Result<()> {
        if factors.len() != self.dims.len() {
            return Err(DeviceError::Shape(format!(
                "{} factors for {} modes",
                factors.len(),
                self.dims.len()
            )));
        }
        let stream = self.gpu.stream().clone();
        for (m, f) in factors.iter().enumerate() {
            if f.dim() != (self.dims[m] as usize, self.rank) {
                return Err(DeviceError::Shape(format!(
                    "factor {m} is {:?}, expected {} x {}",
                    f.dim(),
                    self.dims[m],
                    self.rank
                )));
            }
            let host = f.as_standard_layout();
            let host = host.as_slice().unwrap_or(&[]);
            if host.is_empty() {
                continue;
            }
            let mut dst = self.factors.slice_mut(self.starts[m]..self.starts[m + 1]);
            stream
                .memcpy_htod(host, &mut dst)
                .map_err(driver("uploading a CP-APR factor"))?;
        }
        Ok(())
    }

    /// Rows `range` (elements) of `buf`, `rows x rank`.
    fn download(
        &self,
        what: &str,
        buf: &CudaSlice<f64>,
        range: Range<usize>,
    ) -> Result<Array2<f64>> {
        let (rows, r) = (range.len() / self.rank, self.rank);
        let host = if range.is_empty() {
            Vec::new()
        } else {
            self.read(&buf.slice(range), what)?
        };
        Array2::from_shape_vec((rows, r), host).map_err(|e| DeviceError::Shape(e.to_string()))
    }

    /// The factors, one `dims[m] x rank` matrix per mode (whole: on a part,
    /// as last shared).
    pub fn factors(&self) -> Result<Vec<Array2<f64>>> {
        (0..self.dims.len())
            .map(|m| {
                self.download(
                    "the CP-APR factors",
                    &self.factors,
                    self.starts[m]..self.starts[m + 1],
                )
            })
            .collect()
    }

    /// Mode `mode`'s `Phi` as last computed, of the owned rows (`dims[mode]
    /// x rank` on one GPU).
    pub fn phi_host(&self, mode: usize) -> Result<Array2<f64>> {
        self.download("CP-APR's Phi", &self.phi, self.range(mode))
    }

    /// With `kappa = Some((kappa_tol, kappa))`, raises the entries of
    /// `A_mode` below `kappa_tol` whose `Phi` is positive by `kappa`; then
    /// multiplies column r by `lambda[r]`. Returns whether an entry was
    /// raised (synchronizes only when `kappa` is given).
    pub fn kappa_fold(
        &mut self,
        mode: usize,
        kappa: Option<(f64, f64)>,
        lambda: &[f64],
    ) -> Result<bool> {
        self.queue_kappa_fold(mode, kappa, lambda)?;
        match kappa {
            Some(_) => self.read_fixed(),
            None => Ok(false),
        }
    }

    /// Whether the last [`AprGpu::queue_kappa_fold`] raised an entry
    /// (synchronizes).
    pub fn read_fixed(&self) -> Result<bool> {
        let flag = self.read(&self.fixed, "the kappa flag")?;
        Ok(flag.first().is_some_and(|&x| x != 0))
    }

    /// `buf` on the host, after the work queued before (synchronizes).
    fn read<T: cudarc::driver::DeviceRepr>(
        &self,
        buf: &impl cudarc::driver::DevicePtr<T>,
        what: &str,
    ) -> Result<Vec<T>> {
        self.gpu
            .stream()
            .clone_dtoh(buf)
            .map_err(driver(format!("downloading {what}")))
    }

    /// [`AprGpu::kappa_fold`] queued on the GPU's stream, without waiting;
    /// [`AprGpu::read_fixed`] then tells whether an entry was raised.
    pub fn queue_kappa_fold(
        &mut self,
        mode: usize,
        kappa: Option<(f64, f64)>,
        lambda: &[f64],
    ) -> Result<()> {
        self.check_weights(lambda)?;
        let stream = self.gpu.stream().clone();
        stream
            .memcpy_htod(lambda, &mut self.lambda)
            .map_err(driver("uploading the CP-APR weights"))?;
        stream
            .memset_zeros(&mut self.fixed)
            .map_err(driver("clearing the kappa flag"))?;
        let n = self.len(mode) as u64;
        if n == 0 {
            return Ok(());
        }
        let (fix, (tol, kappa_add)) = match kappa {
            Some(k) => (1u32, k),
            None => (0u32, (0.0, 0.0)),
        };
        let f = self.function(Kernel::AprKappaFold)?;
        let range = self.range(mode);
        let mut a = self.factors.slice_mut(range.clone());
        let phi = self.phi.slice(range);
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&mut a)
            .arg(&phi)
            .arg(&self.lambda)
            .arg(&n)
            .arg(&fix)
            .arg(&tol)
            .arg(&kappa_add)
            .arg(&mut self.fixed);
        // SAFETY: `a` and `phi` hold n doubles (one mode's range of
        // buffers of the same layout); `lambda` holds rank doubles and the
        // kernel reads lambda[e % RANK]; `fixed` is one u32.
        unsafe { launch.launch(grid_stride(n, 256)) }
            .map_err(driver("launching apr_kappa_fold"))?;
        Ok(())
    }

    fn check_weights(&self, v: &[f64]) -> Result<()> {
        if v.len() != self.rank {
            return Err(DeviceError::Shape(format!(
                "{} weights for rank {}",
                v.len(),
                self.rank
            )));
        }
        Ok(())
    }

    /// `Pi` of mode `mode` from the current factors.
    pub fn form_pi(&mut self, mode: usize) -> Result<()> {
        let n = (self.nnz[mode] * self.rank) as u64;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(Kernel::AprPi)?;
        let copy = copy_of(&self.copies, mode)?;
        let nnz = self.nnz[mode] as u64;
        let nother = (self.dims.len() - 1) as u32;
        let stream = self.gpu.stream().clone();
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&mut self.pi)
            .arg(&copy.other)
            .arg(&nnz)
            .arg(&nother)
            .arg(&self.factors)
            .arg(&copy.offsets);
        // SAFETY: `pi` holds nnz x rank doubles; `other` holds nother x nnz
        // indices, each below its mode's dimension (checked at upload), so
        // offsets[k] + index x rank + c stays inside mode k's factor in
        // `factors`; `offsets` holds nother entries.
        unsafe { launch.launch(grid_stride(n, 256)) }.map_err(driver("launching apr_pi"))?;
        Ok(())
    }

    /// `Phi` of mode `mode` for the current `A_mode` and `Pi` (which must be
    /// this mode's: [`AprGpu::form_pi`]), and the KKT violation
    /// `max |min(A, 1 - Phi)|` (downloaded: synchronizes). Two kernels:
    /// the pieces' sums, then each row's.
    pub fn phi(&mut self, mode: usize, eps_div_zero: f64) -> Result<f64> {
        self.begin_inner(0, 1, 1)?;
        self.queue_phi(mode, 0, eps_div_zero)?;
        Ok(self.read_kkts()?[0])
    }

    /// Starts a mode's inner loop of at most `max_inner` iterations as part
    /// `part` of `parts` (0 of 1 on one GPU): clears the flag that ends the
    /// loop and this part's row of KKT slots (the other parts' rows are
    /// written whole by [`share_kkt`] before they are read). Queued.
    pub fn begin_inner(&mut self, part: usize, parts: usize, max_inner: usize) -> Result<()> {
        if part >= parts || max_inner == 0 {
            return Err(DeviceError::Shape(format!(
                "part {part} of {parts}, {max_inner} inner iterations"
            )));
        }
        let slots = parts * max_inner;
        if self.kkt.len() < slots {
            self.kkt = self.gpu.alloc_zeros("the KKT violations", slots)?;
            // Other parts copy into it from their streams: the allocation
            // (ordered on this stream) must be done first. Once per run.
            self.gpu
                .stream()
                .synchronize()
                .map_err(driver("allocating the KKT violations"))?;
        }
        self.inner = InnerLayout {
            part,
            parts,
            max_inner,
        };
        let stream = self.gpu.stream().clone();
        let row = part * max_inner;
        let mut own = self.kkt.slice_mut(row..row + max_inner);
        stream
            .memset_zeros(&mut own)
            .map_err(driver("clearing the KKT violations"))?;
        stream
            .memset_zeros(&mut self.stop)
            .map_err(driver("clearing the inner loop's flag"))
    }

    /// This part's slot of inner iteration `iteration`.
    fn slot(&self, iteration: usize) -> Result<usize> {
        let l = self.inner;
        if iteration >= l.max_inner {
            return Err(DeviceError::Shape(format!(
                "inner iteration {iteration} of {}",
                l.max_inner
            )));
        }
        Ok(l.part * l.max_inner + iteration)
    }

    /// This part's KKT violation of each inner iteration since
    /// [`AprGpu::begin_inner`] (synchronizes): `max_inner` values, 0 for
    /// the iterations the loop did not reach and for a part without rows.
    pub fn read_kkts(&self) -> Result<Vec<f64>> {
        let row = self.slot(0)?;
        let len = self.inner.max_inner;
        let bits = self.read(&self.kkt.slice(row..row + len), "the KKT violations")?;
        Ok(bits.into_iter().map(f64::from_bits).collect())
    }

    /// `Phi` of mode `mode` for inner iteration `iteration` (after
    /// [`AprGpu::begin_inner`]) and this part's KKT violation into its
    /// slot, queued: nothing waits, and nothing runs on the device once
    /// the loop has ended.
    pub fn queue_phi(&mut self, mode: usize, iteration: usize, eps_div_zero: f64) -> Result<()> {
        let slot = self.slot(iteration)?;
        let rows = self.rows(mode);
        if rows == 0 {
            return Ok(());
        }
        let stream = self.gpu.stream().clone();
        let pieces_f = self.function(Kernel::AprPhi)?;
        let rows_f = self.function(Kernel::AprPhiRows)?;
        let copy = copy_of(&self.copies, mode)?;
        let range = self.range(mode);
        let a = self.factors.slice(range.clone());
        if copy.npieces > 0 {
            let npieces = copy.npieces as u64;
            let mut launch = stream.launch_builder(&pieces_f);
            launch
                .arg(&mut self.piece_sums)
                .arg(&a)
                .arg(&self.pi)
                .arg(&copy.values)
                .arg(&copy.piece_begin)
                .arg(&copy.piece_row)
                .arg(&npieces)
                .arg(&eps_div_zero)
                .arg(&self.stop);
            // SAFETY: `piece_sums` holds at least npieces x rank doubles
            // (checked at upload); the pieces cover nonzeros below nnz
            // (built from a row pointer checked to run from 0 to nnz), where
            // `values` and `pi` (nnz x rank) are in bounds, and name rows
            // below rows, inside `a` (rows x rank); `stop` is one u32.
            unsafe { launch.launch(blocks(piece_blocks(copy.npieces))) }
                .map_err(driver("launching apr_phi"))?;
            if copy.long_rows {
                let f = self.function(Kernel::AprPhiChunks)?;
                let mut launch = stream.launch_builder(&f);
                launch
                    .arg(&mut self.piece_sums)
                    .arg(&copy.piece_row)
                    .arg(&copy.piece_ptr)
                    .arg(&npieces)
                    .arg(&self.stop);
                // SAFETY: as for apr_phi: npieces x rank sums; each piece
                // names a row below rows, whose piece_ptr entries bound
                // pieces below npieces.
                unsafe { launch.launch(grid_stride(npieces * self.rank as u64, 256)) }
                    .map_err(driver("launching apr_phi_chunks"))?;
            }
        }
        let mut phi = self.phi.slice_mut(range);
        let mut kkt = self.kkt.slice_mut(slot..slot + 1);
        let rows_u = rows as u64;
        let mut launch = stream.launch_builder(&rows_f);
        launch
            .arg(&mut phi)
            .arg(&mut kkt)
            .arg(&a)
            .arg(&self.piece_sums)
            .arg(&copy.piece_ptr)
            .arg(&rows_u)
            .arg(&self.stop);
        // SAFETY: `phi` and `a` hold rows x rank doubles; `piece_ptr` holds
        // rows + 1 nondecreasing entries up to npieces, so the pieces' sums
        // read are inside `piece_sums`; `kkt` is one u64, `stop` one u32.
        unsafe { launch.launch(grid_stride(rows_u * self.rank as u64, 256)) }
            .map_err(driver("launching apr_phi_rows"))?;
        Ok(())
    }

    /// The update of inner iteration `iteration`, queued: on the device,
    /// unless the loop has ended; where the iteration's KKT violation (the
    /// largest of every part's share, [`share_kkt`] having brought them
    /// here) is below `tol` the loop ends instead, without the update.
    pub fn queue_update(&mut self, mode: usize, iteration: usize, tol: f64) -> Result<()> {
        self.slot(iteration)?;
        let n = self.len(mode) as u64;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(Kernel::AprUpdate)?;
        let range = self.range(mode);
        let mut a = self.factors.slice_mut(range.clone());
        let phi = self.phi.slice(range);
        let l = self.inner;
        let parts = l.parts as u32;
        let kkt = self.kkt.slice(iteration..);
        let stride = l.max_inner as u32;
        let stream = self.gpu.stream().clone();
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&mut a)
            .arg(&phi)
            .arg(&n)
            .arg(&kkt)
            .arg(&parts)
            .arg(&stride)
            .arg(&tol)
            .arg(&mut self.stop);
        // SAFETY: `a` and `phi` hold n doubles each; the kernel reads
        // kkt[p * max_inner] for p < parts from slot
        // `iteration` < max_inner on, inside the parts x max_inner slots
        // begin_inner allocated; `stop` is one u32.
        unsafe { launch.launch(grid_stride(n, 256)) }.map_err(driver("launching apr_update"))?;
        Ok(())
    }

    /// Adds the first `parts` partial rows of `width` in block order into
    /// `sums` (queued; [`AprGpu::read_sums`] downloads them).
    fn sum_partials(&mut self, parts: u32, width: usize) -> Result<()> {
        let f = self.function(Kernel::AprSumPartials)?;
        let stream = self.gpu.stream().clone();
        let width_u = width as u32;
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&self.partials)
            .arg(&parts)
            .arg(&width_u)
            .arg(&mut self.sums);
        // SAFETY: `partials` holds at least parts x width doubles (parts is
        // at most ROW_BLOCKS at width 1 or COLUMN_BLOCKS at width rank) and
        // `sums` rank >= width.
        unsafe { launch.launch(grid_stride(width as u64, 256)) }
            .map_err(driver("launching apr_sum_partials"))?;
        Ok(())
    }

    /// The first `width` sums of the last [`AprGpu::queue_column_sums`]
    /// (`rank`) or [`AprGpu::queue_log_likelihood`] (1) (synchronizes).
    pub fn read_sums(&self, width: usize) -> Result<Vec<f64>> {
        let mut all = self.read(&self.sums, "the CP-APR sums")?;
        all.truncate(width.min(self.rank));
        Ok(all)
    }

    /// Zero sums (what a part without rows reports).
    fn zero_sums(&mut self) -> Result<()> {
        self.gpu
            .stream()
            .clone()
            .memset_zeros(&mut self.sums)
            .map_err(driver("clearing the CP-APR sums"))
    }

    /// The 1-norm of each column of `A_mode`'s owned rows (synchronizes).
    pub fn column_sums(&mut self, mode: usize) -> Result<Vec<f64>> {
        self.queue_column_sums(mode)?;
        self.read_sums(self.rank)
    }

    /// [`AprGpu::column_sums`] queued, without waiting; read them with
    /// [`AprGpu::read_sums`]`(rank)`.
    pub fn queue_column_sums(&mut self, mode: usize) -> Result<()> {
        let rows = self.rows(mode);
        let parts = column_blocks(rows, self.rank);
        if rows > 0 {
            let f = self.function(Kernel::AprColumnSums)?;
            let range = self.range(mode);
            let a = self.factors.slice(range);
            let rows_u = rows as u64;
            let stream = self.gpu.stream().clone();
            let mut launch = stream.launch_builder(&f);
            launch.arg(&a).arg(&rows_u).arg(&mut self.partials);
            // SAFETY: `a` holds rows x rank doubles; block b writes partial
            // row b < parts <= COLUMN_BLOCKS of rank doubles, inside
            // `partials`.
            unsafe { launch.launch(blocks(parts)) }.map_err(driver("launching apr_column_sums"))?;
        } else {
            return self.zero_sums();
        }
        self.sum_partials(parts, self.rank)
    }

    /// Column r of `A_mode` times `inv[r]`.
    pub fn scale(&mut self, mode: usize, inv: &[f64]) -> Result<()> {
        self.check_weights(inv)?;
        let n = self.len(mode) as u64;
        if n == 0 {
            return Ok(());
        }
        let stream = self.gpu.stream().clone();
        stream
            .memcpy_htod(inv, &mut self.inv)
            .map_err(driver("uploading the CP-APR column scales"))?;
        let f = self.function(Kernel::AprScale)?;
        let range = self.range(mode);
        let mut a = self.factors.slice_mut(range);
        let mut launch = stream.launch_builder(&f);
        launch.arg(&mut a).arg(&self.inv).arg(&n);
        // SAFETY: `a` holds n doubles; `inv` rank doubles, read at e % RANK.
        unsafe { launch.launch(grid_stride(n, 256)) }.map_err(driver("launching apr_scale"))?;
        Ok(())
    }

    /// `sum_nz x log(m)` of the model `(lambda, factors)` (terms with
    /// `x = 0` count as 0) over the nonzeros of mode 0's sorted copy (on a
    /// part, those of its rows of mode 0), summed in a fixed order
    /// (synchronizes).
    pub fn log_likelihood_sum(&mut self, lambda: &[f64]) -> Result<f64> {
        self.queue_log_likelihood(lambda)?;
        Ok(self.read_sums(1)?[0])
    }

    /// [`AprGpu::log_likelihood_sum`] queued, without waiting; read it with
    /// [`AprGpu::read_sums`]`(1)`.
    pub fn queue_log_likelihood(&mut self, lambda: &[f64]) -> Result<()> {
        self.check_weights(lambda)?;
        let rows = self.rows(0);
        let stream = self.gpu.stream().clone();
        stream
            .memcpy_htod(lambda, &mut self.lambda)
            .map_err(driver("uploading the CP-APR weights"))?;
        let f = self.function(Kernel::AprLogLikelihood)?;
        let copy = copy_of(&self.copies, 0)?;
        if rows == 0 || copy.npieces == 0 {
            return self.zero_sums();
        }
        let parts = row_blocks(copy.npieces);
        let a = self.factors.slice(self.range(0));
        let (npieces, nnz) = (copy.npieces as u64, self.nnz[0] as u64);
        let nother = (self.dims.len() - 1) as u32;
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&mut self.partials)
            .arg(&a)
            .arg(&self.lambda)
            .arg(&copy.values)
            .arg(&copy.piece_begin)
            .arg(&copy.piece_row)
            .arg(&npieces)
            .arg(&copy.other)
            .arg(&nnz)
            .arg(&nother)
            .arg(&self.factors)
            .arg(&copy.offsets);
        // SAFETY: block b writes partials[b], b < parts <= ROW_BLOCKS; the
        // pieces cover nonzeros below nnz and rows below rows (built from a
        // row pointer checked to run from 0 to nnz) and the other
        // modes' indices are below their dimensions (checked at upload), so
        // every factor read is inside its mode's range; `a` holds rows x
        // rank doubles and `lambda` rank.
        unsafe { launch.launch(blocks(parts)) }.map_err(driver("launching apr_log_likelihood"))?;
        self.sum_partials(parts, 1)
    }
}

/// Copies `bytes` bytes at byte `offset` of part `s`'s buffer (device
/// address `bases[s]`) to the same place in part `t`'s, on part `s`'s
/// stream: a peer copy between GPUs, a device copy between parts on one.
///
/// # Safety
///
/// Both ranges must lie inside their buffers, and nothing may write
/// either until the copy has run.
unsafe fn copy_to_part(
    contexts: &[Arc<cudarc::driver::CudaContext>],
    streams: &[Arc<cudarc::driver::CudaStream>],
    bases: &[u64],
    (s, t): (usize, usize),
    offset: u64,
    bytes: usize,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    contexts[s].bind_to_thread()?;
    let (src, dst) = (bases[s] + offset, bases[t] + offset);
    // SAFETY: the caller's.
    unsafe {
        if contexts[s].cu_ctx() == contexts[t].cu_ctx() {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, streams[s].cu_stream())
        } else {
            cudarc::driver::result::memcpy_peer_async(
                contexts[t].cu_ctx(),
                dst,
                contexts[s].cu_ctx(),
                src,
                bytes,
                streams[s].cu_stream(),
            )
        }
    }
}

/// Brings every part's share of inner iteration `iteration`'s KKT
/// violation to every other part, without the host waiting: each part's
/// slot goes to the same slot of every other part (on the sender's stream,
/// after its `Phi`), the sender records its event, and every part's
/// stream waits for the others' events, so the updates queued next
/// ([`AprGpu::queue_update`]) see all shares. The parts must have begun
/// the loop as parts `0..parts.len()` of `parts.len()`.
///
/// `direct`: the GPUs reach each other's memory (peer access enabled, as
/// `kruskal_group::enable_peer_access` reports it, or one GPU): one
/// launch per part stores its share into the others' arrays
/// (`apr_share_kkt`). Otherwise a copy per pair of parts (the driver
/// stages them through the host).
pub fn share_kkt(parts: &mut [AprGpu], iteration: usize, direct: bool) -> Result<()> {
    let count = parts.len();
    let max_inner = parts.first().map_or(1, |p| p.inner.max_inner);
    for (k, p) in parts.iter().enumerate() {
        let want = InnerLayout {
            part: k,
            parts: count,
            max_inner,
        };
        if p.inner != want {
            return Err(DeviceError::Shape(format!(
                "part {k} began its inner loop as {:?}, not {want:?}",
                p.inner
            )));
        }
    }
    if count < 2 {
        return Ok(());
    }
    parts[0].slot(iteration)?;
    // Every part's KKT array's address.
    let streams: Vec<_> = parts.iter().map(|p| p.gpu.stream().clone()).collect();
    let contexts: Vec<_> = parts.iter().map(|p| p.gpu.context().clone()).collect();
    let mut bases = Vec::with_capacity(count);
    let mut guards = Vec::with_capacity(count);
    for (p, stream) in parts.iter_mut().zip(&streams) {
        let (base, guard) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut p.kkt, stream);
        bases.push(base);
        guards.push(guard);
    }
    if direct {
        drop(guards);
        store_kkt(parts, iteration, &bases)?;
    } else {
        let bytes = std::mem::size_of::<u64>();
        for s in 0..count {
            let at = ((s * max_inner + iteration) * bytes) as u64;
            for t in (0..count).filter(|&t| t != s) {
                // SAFETY: every part holds parts x max_inner slots (checked
                // layouts; begin_inner allocated them), so the slot lies in
                // each; part t writes only its own row (this slot is in
                // row s), and part s's kernels that write it are queued
                // before, on this stream.
                unsafe { copy_to_part(&contexts, &streams, &bases, (s, t), at, bytes) }
                    .map_err(driver("copying a KKT violation to another GPU"))?;
            }
        }
        drop(guards);
    }
    for (p, stream) in parts.iter().zip(&streams) {
        p.shared
            .record(stream)
            .map_err(driver("recording an event"))?;
    }
    for (t, stream) in streams.iter().enumerate() {
        for (s, p) in parts.iter().enumerate() {
            if s != t {
                stream
                    .wait(&p.shared)
                    .map_err(driver("waiting for another GPU's KKT violation"))?;
            }
        }
    }
    Ok(())
}

/// [`share_kkt`]'s direct stores: part k's share of `iteration` into slot
/// (k, iteration) of every other part's KKT array (`bases`, their device
/// addresses, uploaded to each part where they changed: once per run).
fn store_kkt(parts: &mut [AprGpu], iteration: usize, bases: &[u64]) -> Result<()> {
    let count = parts.len();
    let max_inner = parts[0].inner.max_inner;
    for (k, p) in parts.iter_mut().enumerate() {
        if p.peer_bases != bases {
            let stream = p.gpu.stream().clone();
            if p.peers.len() < count {
                p.peers = p.gpu.alloc_zeros("the KKT arrays' addresses", count)?;
            }
            stream
                .memcpy_htod(bases, &mut p.peers)
                .map_err(driver("uploading the KKT arrays' addresses"))?;
            p.peer_bases = bases.to_vec();
        }
        let f = p.function(Kernel::AprShareKkt)?;
        let at = (k * max_inner + iteration) as u64;
        let (parts_u, part_u) = (count as u32, k as u32);
        let stream = p.gpu.stream().clone();
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&p.kkt)
            .arg(&at)
            .arg(&p.peers)
            .arg(&parts_u)
            .arg(&part_u);
        // SAFETY: every part's KKT array holds parts x max_inner slots
        // (the layouts checked above; begin_inner allocated them and
        // synchronized), so slot `at` (row k) lies in each; `peers` holds
        // their addresses, every one reachable from this GPU (peer access
        // is enabled for a group); only part k writes row k of the other
        // parts' arrays, and its kernels that write its own slot are
        // queued before, on this stream.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(driver("launching apr_share_kkt"))?;
    }
    Ok(())
}

/// Copies each part's owned rows of mode `mode`'s factor into every other
/// part (a peer copy per pair, on the sender's stream after the steps it
/// queued; a device copy between parts on one GPU), then waits for all of
/// them. The parts hold the same dims and rank and own disjoint rows of
/// the mode; after this every part holds the mode's factor whole.
pub fn share_rows(parts: &mut [AprGpu], mode: usize) -> Result<()> {
    let Some(first) = parts.first() else {
        return Ok(());
    };
    let (dims, rank) = (first.dims.clone(), first.rank);
    if mode >= dims.len() || parts.iter().any(|p| p.dims != dims || p.rank != rank) {
        return Err(DeviceError::Shape(format!(
            "sharing mode {mode} between parts of other shapes"
        )));
    }
    let mut owned: Vec<Range<usize>> = parts.iter().map(|p| p.owned(mode)).collect();
    owned.sort_by_key(|r| r.start);
    if owned.windows(2).any(|w| w[0].end > w[1].start) {
        return Err(DeviceError::Shape(format!(
            "parts own overlapping rows of mode {mode}: {owned:?}"
        )));
    }
    if parts.len() < 2 {
        return Ok(());
    }
    let ranges: Vec<Range<usize>> = parts.iter().map(|p| p.range(mode)).collect();
    let contexts: Vec<_> = parts.iter().map(|p| p.gpu.context().clone()).collect();
    let streams: Vec<_> = parts.iter().map(|p| p.gpu.stream().clone()).collect();
    let mut bases = Vec::with_capacity(parts.len());
    let mut guards = Vec::with_capacity(parts.len());
    for (p, stream) in parts.iter_mut().zip(&streams) {
        let (base, guard) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut p.factors, stream);
        bases.push(base);
        guards.push(guard);
    }
    for (s, rows) in ranges.iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        let offset = (rows.start * std::mem::size_of::<f64>()) as u64;
        let bytes = rows.len() * std::mem::size_of::<f64>();
        for t in (0..ranges.len()).filter(|&t| t != s) {
            // SAFETY: both buffers hold the whole factor layout (the same
            // dims and rank, checked), so the owned rows of part s lie
            // inside each; nothing else writes them until the copies end
            // (part s's steps on them are queued before, on its stream;
            // part t's steps touch only its own rows, disjoint, checked).
            unsafe { copy_to_part(&contexts, &streams, &bases, (s, t), offset, bytes) }
                .map_err(driver("copying CP-APR factor rows to another GPU"))?;
        }
    }
    drop(guards);
    for stream in &streams {
        stream
            .synchronize()
            .map_err(driver("waiting for the CP-APR factor rows"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_bytes_count_every_array() {
        // 3 modes, 10 nonzeros, rank 2: copies 10 x 16 x 3 + (9 + 3) x 8;
        // Pi 10 x 2 x 8; factors and Phi 9 x 2 x 8.
        let parts = device_bytes(&[4, 3, 2], 10, 2);
        let get = |name: &str| parts.iter().find(|p| p.0 == name).unwrap().1;
        assert_eq!(get("sorted copies"), 480 + 96);
        // At most one piece per row (10 nonzeros), and one more entry each.
        assert_eq!(get("pieces"), (5 + 4 + 3) * 12);
        assert_eq!(get("pieces' sums"), 4 * 2 * 8);
        assert_eq!(get("Pi"), 160);
        assert_eq!(get("factors"), 144);
        assert_eq!(get("Phi"), 144);
        // Large shapes saturate instead of wrapping.
        let huge = device_bytes(&[u32::MAX; 3], usize::MAX, MAX_RANK);
        assert!(huge.iter().all(|p| p.1 > 0));
    }

    #[test]
    fn rows_are_cut_into_pieces_in_order() {
        // Rows of 0, 5, 0, 2 and 7 nonzeros, pieces of at most 3.
        let p = Pieces::new(&[0, 0, 5, 5, 7, 14], 3);
        assert_eq!(p.begin, [0, 3, 5, 7, 10, 13, 14]);
        assert_eq!(p.row, [1, 1, 3, 4, 4, 4]);
        assert_eq!(p.ptr, [0, 0, 2, 2, 3, 6]);
        assert_eq!(p.len(), 6);
        // The bound holds for any split of the nonzeros into rows.
        for row_ptr in [vec![0u64, 0, 5, 5, 7, 14], vec![0, 14], vec![0; 6]] {
            let rows = row_ptr.len() as u64 - 1;
            let nnz = *row_ptr.last().unwrap();
            let p = Pieces::new(&row_ptr, PIECE_NNZ);
            assert!(p.len() as u64 <= pieces_bound(rows, nnz));
        }
        let hot: Vec<u64> = vec![0, 1, 1000 * PIECE_NNZ as u64 + 1];
        let p = Pieces::new(&hot, PIECE_NNZ);
        assert_eq!(p.len(), 1 + 1000);
        assert!(p.len() as u64 <= pieces_bound(2, *hot.last().unwrap()));
        assert!(Pieces::new(&[0], PIECE_NNZ).is_empty());
    }

    #[test]
    fn launch_shapes_stay_inside_the_partials() {
        assert_eq!(row_blocks(0), 1);
        assert_eq!(row_blocks(9), 2);
        assert_eq!(row_blocks(usize::MAX / 2), ROW_BLOCKS as u32);
        assert_eq!(piece_blocks(0), 1);
        assert_eq!(piece_blocks(90_001), 11_251);
        assert_eq!(piece_blocks(usize::MAX / 2), i32::MAX as u32);
        // Rank 33: 7 slots per block.
        assert_eq!(column_blocks(14, 33), 2);
        assert_eq!(column_blocks(1 << 30, 256), COLUMN_BLOCKS as u32);
        for rank in [1, 33, MAX_RANK] {
            assert!(partials_len(rank) >= ROW_BLOCKS);
            assert!(partials_len(rank) >= COLUMN_BLOCKS * rank);
        }
        assert!(check_rank(MAX_RANK).is_ok());
        for bad in [0, MAX_RANK + 1] {
            let e = check_rank(bad).unwrap_err().to_string();
            assert!(e.contains("ranks 1 to 256"), "{e}");
        }
    }

    #[test]
    fn the_run_length_is_the_kernels() {
        let source = include_str!("../kernels/apr.cu");
        assert!(
            source.contains(&format!("#define CHUNK {CHUNK_PIECES}\n")),
            "CHUNK in apr.cu differs from CHUNK_PIECES"
        );
    }

    /// Parts of a group (on the first GPU) bring their KKT shares to each
    /// other, by stores and by copies, and decide alike on the largest.
    #[test]
    fn parts_share_their_kkt_violations_and_decide_on_the_largest() {
        let Some(gpu) = crate::testing::gpu_or_skip(
            "parts_share_their_kkt_violations_and_decide_on_the_largest",
        ) else {
            return;
        };
        let dims = [6u32, 3, 2];
        let rank = 2;
        let own = [[0..2, 0..1, 0..1], [2..5, 1..3, 1..2], [5..6, 3..3, 2..2]];
        let factors: Vec<Array2<f64>> = dims
            .iter()
            .map(|&d| Array2::from_elem((d as usize, rank), 0.5))
            .collect();
        let shares = [0.5f64, 0.25, 0.75];
        for direct in [true, false] {
            for (tol, stops) in [(0.8, true), (0.7, false)] {
                let mut parts: Vec<AprGpu> = own
                    .iter()
                    .map(|o| {
                        let mut p =
                            AprGpu::new_part(gpu.clone(), &dims, rank, o, &[4, 4, 4]).unwrap();
                        p.set_factors(&factors).unwrap();
                        p
                    })
                    .collect();
                let (max_inner, iteration) = (4, 1);
                for (k, p) in parts.iter_mut().enumerate() {
                    p.begin_inner(k, own.len(), max_inner).unwrap();
                    let at = p.slot(iteration).unwrap();
                    let mut slot = p.kkt.slice_mut(at..at + 1);
                    p.gpu
                        .stream()
                        .memcpy_htod(&[shares[k].to_bits()], &mut slot)
                        .unwrap();
                }
                share_kkt(&mut parts, iteration, direct).unwrap();
                for p in parts.iter_mut() {
                    // Phi is still zero: an update zeroes the owned rows.
                    p.queue_update(0, iteration, tol).unwrap();
                }
                for (k, p) in parts.iter().enumerate() {
                    let what = format!("direct {direct}, tol {tol}, part {k}");
                    let all = p.gpu.stream().clone_dtoh(&p.kkt).unwrap();
                    for (s, &share) in shares.iter().enumerate() {
                        assert_eq!(
                            f64::from_bits(all[s * max_inner + iteration]),
                            share,
                            "{what}: the share of part {s}"
                        );
                    }
                    let stop = p.gpu.stream().clone_dtoh(&p.stop).unwrap();
                    assert_eq!(stop[0] == 1, stops, "{what}: the flag");
                    let a = &p.factors().unwrap()[0];
                    for i in 0..dims[0] as usize {
                        let zeroed = !stops && p.owned(0).contains(&i);
                        let want = if zeroed { 0.0 } else { 0.5 };
                        assert!(a.row(i).iter().all(|&x| x == want), "{what}: row {i}");
                    }
                }
            }
        }
    }

    /// Phi and the KKT violation of every mode against a naive f64
    /// computation straight from the coordinates.
    #[test]
    fn apr_phi_matches_a_naive_f64_computation() {
        let Some(gpu) = crate::testing::gpu_or_skip("apr_phi_matches_a_naive_f64_computation")
        else {
            return;
        };
        // 4 modes, repeated rows, an empty row (index 5 of mode 0 never
        // occurs), a row of mode 0 cut into three pieces (row 2: six of
        // every seven nonzeros), rank 33 (two columns per lane for one
        // lane); with 12,000 nonzeros row 2 has 41 pieces, more than
        // CHUNK_PIECES (two runs for apr_phi_chunks, one short).
        let dims = [7u32, 5, 4, 3];
        for (nnz, ranks) in [(700, vec![3usize, 33]), (12_000, vec![8])] {
            phi_case(&gpu, dims, nnz, &ranks);
        }
    }

    fn phi_case(gpu: &Arc<Gpu>, dims: [u32; 4], nnz: usize, ranks: &[usize]) {
        let mut x = 12345u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let idx: Vec<Vec<u32>> = dims
            .iter()
            .enumerate()
            .map(|(m, &d)| {
                (0..nnz)
                    .enumerate()
                    .map(|(k, _)| {
                        let i = next(u64::from(d)) as u32;
                        match (m, i) {
                            (0, _) if k % 7 != 0 => 2,
                            (0, 5) => 6,
                            _ => i,
                        }
                    })
                    .collect()
            })
            .collect();
        let values: Vec<f64> = (0..nnz).map(|_| (next(5) + 1) as f64).collect();
        for &rank in ranks {
            let factors: Vec<Array2<f64>> = dims
                .iter()
                .map(|&d| {
                    Array2::from_shape_fn((d as usize, rank), |_| 0.05 + next(1000) as f64 / 1000.0)
                })
                .collect();
            let mut apr = AprGpu::new(gpu.clone(), &dims, nnz, rank).unwrap();
            apr.set_factors(&factors).unwrap();
            for n in 0..dims.len() {
                // The sorted copy: a stable counting sort by mode n's index.
                let mut order: Vec<usize> = (0..nnz).collect();
                order.sort_by_key(|&k| idx[n][k]);
                let mut row_ptr = vec![0u64; dims[n] as usize + 1];
                for &k in &order {
                    row_ptr[idx[n][k] as usize + 1] += 1;
                }
                for i in 0..dims[n] as usize {
                    row_ptr[i + 1] += row_ptr[i];
                }
                let vals: Vec<f64> = order.iter().map(|&k| values[k]).collect();
                let idx = &idx;
                let other: Vec<u32> = (0..dims.len())
                    .filter(|&m| m != n)
                    .flat_map(|m| order.iter().map(move |&k| idx[m][k]))
                    .collect();
                apr.upload_copy(
                    n,
                    &SortedCopy {
                        row_ptr: &row_ptr,
                        values: &vals,
                        other: &other,
                    },
                )
                .unwrap();
                // Row 2 of mode 0 holds six sevenths of the nonzeros.
                let long = nnz * 6 / 7 > CHUNK_PIECES as usize * PIECE_NNZ;
                assert_eq!(
                    apr.copies[n].as_ref().unwrap().long_rows,
                    long && n == 0,
                    "mode {n}"
                );
                apr.form_pi(n).unwrap();
                let kkt = apr.phi(n, 1e-10).unwrap();
                let got = apr.phi_host(n).unwrap();
                let mut want = Array2::<f64>::zeros((dims[n] as usize, rank));
                for k in 0..nnz {
                    let krp: Vec<f64> = (0..rank)
                        .map(|r| {
                            (0..dims.len())
                                .filter(|&m| m != n)
                                .map(|m| factors[m][[idx[m][k] as usize, r]])
                                .product()
                        })
                        .collect();
                    let i = idx[n][k] as usize;
                    let model: f64 = (0..rank).map(|r| factors[n][[i, r]] * krp[r]).sum();
                    for r in 0..rank {
                        want[[i, r]] += values[k] / model * krp[r];
                    }
                }
                let mut want_kkt = 0f64;
                for ((ix, &g), &w) in got.indexed_iter().zip(want.iter()) {
                    assert!(
                        (g - w).abs() <= 1e-12 * w.abs().max(1.0),
                        "rank {rank} mode {n} entry {ix:?}: {g} vs {w}"
                    );
                    want_kkt = want_kkt.max(factors[n][ix].min(1.0 - w).abs());
                }
                if n == 0 {
                    assert!(got.row(5).iter().all(|&v| v == 0.0), "the empty row");
                }
                assert!(
                    (kkt - want_kkt).abs() <= 1e-12 * want_kkt.max(1.0),
                    "rank {rank} mode {n}: {kkt} vs {want_kkt}"
                );
            }
        }
    }
}
