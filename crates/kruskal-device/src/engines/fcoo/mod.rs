//! The `fcoo` engine: F-COO on the GPU, one [`Fcoo::for_mttkrp`] per mode
//! uploaded once, and a segmented reduction over the nonzeros (kernel
//! `mttkrp_fcoo` in `kernels/mttkrp_fcoo.cu`, whose header states the
//! thread mapping).
//!
//! Thread blocks take `threadlen * 32 * WARPS` consecutive nonzeros each,
//! whatever the rows are, so a row holding a large part of the tensor is
//! spread over many blocks. Segments (output rows) wholly inside a block are
//! stored directly; only the at most one segment crossing each block edge
//! is summed with f64 atomics into a small buffer of *edge slots*, which a
//! second kernel stores as f32. The host numbers the slots and each
//! block's first segment ([`BlockPlan`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use kruskal_formats::{Fcoo, FcooOp, SparseTensor};

use crate::factors::{DeviceFactors, check_operands};
pub use crate::options::{
    DEFAULT_FIBER, DEFAULT_PIPELINE, DEFAULT_TEAMS, DEFAULT_THREADLEN, FactorPrecision, FcooBuild,
    TeamPipeline,
};
use build::{DeviceCoo, SortedMode};

#[doc(hidden)]
pub mod build;
use crate::kernels::Kernel;
use crate::{DeviceError, Gpu, Result, driver, grid_stride};

/// Warps per thread block: a block holds `threadlen * 32 * WARPS`
/// nonzeros (the CPU engine's `BLOCK_THREADS = 512` threads).
pub const WARPS: u32 = 16;
/// Whether the lane-team kernel exists for `rank` (a team of `rank / 4`
/// lanes holds a row as float4s).
pub fn teams_fit(rank: usize) -> bool {
    matches!(rank, 16 | 32 | 64 | 128)
}
/// No slot (the kernel's `NONE`).
const NONE: u32 = u32::MAX;

/// Width of the column tile one thread block computes for `rank` (the
/// kernel's `TILE`: up to 4 columns per lane); `ceil(rank / tile)` tiles.
pub fn column_tile(rank: usize) -> usize {
    32 * rank.div_ceil(32).clamp(1, 4)
}

/// Nonzeros per thread block for `threadlen`.
pub fn block_nnz(threadlen: usize) -> usize {
    threadlen * 32 * WARPS as usize
}

/// The host-side tables of one mode: where each thread block's segments
/// start, and the edge slots of segments crossing block edges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockPlan {
    /// `blocks + 1` entries: the segment of block `b`'s first nonzero (the
    /// set bit flags before it); the last entry is the segment count.
    pub block_seg: Vec<u32>,
    /// `2 x blocks`: the edge slot of block `b`'s first segment (`2b`) if it
    /// began in an earlier block, and of its last segment (`2b + 1`) if it
    /// goes on in the next block; `u32::MAX` otherwise. A segment spanning
    /// several edges has one slot.
    pub edge_slot: Vec<u32>,
    /// The output row of each edge slot.
    pub edge_rows: Vec<u32>,
}

impl BlockPlan {
    /// Plans `f` with blocks of `block_nnz` nonzeros (a multiple of 32).
    ///
    /// Cost: one popcount per bit-flag word and one pass over the blocks.
    pub fn new(f: &Fcoo, block_nnz: usize) -> Self {
        Self::from_flags(f.bit_flags(), f.nnz(), block_nnz, f.segment_idx().first())
    }

    /// Plans `nnz` nonzeros with segment-end bits `bit_flags` (as
    /// [`Fcoo::bit_flags`]) and segment rows `rows`; without `rows`, the
    /// edge rows hold the segments' numbers (the device build gathers the
    /// rows from them).
    pub fn from_flags(
        bit_flags: &[u32],
        nnz: usize,
        block_nnz: usize,
        rows: Option<&Vec<u32>>,
    ) -> Self {
        debug_assert!(block_nnz > 0 && block_nnz % 32 == 0);
        let ends_segment = |k: usize| {
            bit_flags
                .get(k / 32)
                .is_some_and(|w| w >> (k % 32) & 1 == 1)
        };
        let blocks = nnz.div_ceil(block_nnz);
        let mut block_seg = Vec::with_capacity(blocks + 1);
        let mut seg = 0u32;
        block_seg.push(0);
        for words in bit_flags.chunks(block_nnz / 32) {
            // At most nnz <= u32::MAX segments (Fcoo checks the capacity).
            seg += words.iter().map(|w| w.count_ones()).sum::<u32>();
            block_seg.push(seg);
        }
        let mut edge_slot = vec![NONE; 2 * blocks];
        let mut edge_rows = Vec::new();
        let mut last_seg = None;
        for b in 1..blocks {
            if ends_segment(b * block_nnz - 1) {
                continue;
            }
            let s = block_seg[b];
            if last_seg != Some(s) {
                edge_rows.push(rows.map_or(s, |r| r[s as usize]));
                last_seg = Some(s);
            }
            let slot = (edge_rows.len() - 1) as u32;
            edge_slot[2 * (b - 1) + 1] = slot;
            edge_slot[2 * b] = slot;
        }
        BlockPlan {
            block_seg,
            edge_slot,
            edge_rows,
        }
    }

    pub fn blocks(&self) -> usize {
        self.block_seg.len() - 1
    }

    /// Number of edge slots (segments crossing a block edge).
    pub fn slots(&self) -> usize {
        self.edge_rows.len()
    }

    /// Bytes of the tables.
    pub fn bytes(&self) -> usize {
        4 * (self.block_seg.len() + self.edge_slot.len() + self.edge_rows.len())
    }
}

/// One mode's F-COO and plan on the device.
struct ModeTables {
    nnz: usize,
    /// Segments: the rows that hold a nonzero.
    segments: usize,
    blocks: usize,
    slots: usize,
    /// With fiber reuse: the fiber mode's product number and the fibers
    /// (rows of it gathered); `None` without.
    fiber: Option<(i32, usize)>,
    /// `(nmodes - 1) x nnz`, product modes in increasing order. This and
    /// the values, bit flags and segment rows do not depend on the
    /// threadlen: engines built together share them.
    prod_idx: Arc<CudaSlice<u32>>,
    vals: Arc<CudaSlice<f32>>,
    bit_flags: Arc<CudaSlice<u32>>,
    start_flags: CudaSlice<u32>,
    seg_rows: Arc<CudaSlice<u32>>,
    block_seg: CudaSlice<u32>,
    edge_slot: CudaSlice<u32>,
    edge_rows: CudaSlice<u32>,
}

impl ModeTables {
    /// Uploads `f` with the chunk-start bits of `threadlen` (`start_flags`:
    /// `f`'s own, or [`Fcoo::start_flags_for`] another threadlen).
    fn upload(
        gpu: &Gpu,
        f: &Fcoo,
        plan: &BlockPlan,
        fiber: bool,
        threadlen: usize,
        start_flags: &[u32],
    ) -> Result<Self> {
        gpu.ensure_free("an F-COO mode", FcooGpu::mode_bytes(f, plan))?;
        // A warp walks threadlen * 32 nonzeros; its fibers end with them.
        let fiber = match (fiber, f.fiber_product()) {
            (true, Some(p)) => f.fibers(threadlen * 32).map(|fibers| (p as i32, fibers)),
            _ => None,
        };
        let mut prod = Vec::with_capacity(f.nnz() * f.product_idx().len());
        for idx in f.product_idx() {
            prod.extend_from_slice(idx);
        }
        let seg_rows = f.segment_idx().first().map_or(&[][..], Vec::as_slice);
        Ok(ModeTables {
            nnz: f.nnz(),
            segments: seg_rows.len(),
            blocks: plan.blocks(),
            slots: plan.slots(),
            fiber,
            prod_idx: Arc::new(gpu.upload("F-COO indices", &prod)?),
            vals: Arc::new(gpu.upload("F-COO values", f.values())?),
            bit_flags: Arc::new(gpu.upload("F-COO bit flags", f.bit_flags())?),
            start_flags: gpu.upload("F-COO start flags", start_flags)?,
            seg_rows: Arc::new(gpu.upload("F-COO segment rows", seg_rows)?),
            block_seg: gpu.upload("F-COO block segments", &plan.block_seg)?,
            edge_slot: gpu.upload("F-COO edge slots", &plan.edge_slot)?,
            edge_rows: gpu.upload("F-COO edge rows", &plan.edge_rows)?,
        })
    }

    /// The tables of a mode sorted on the device, for `threadlen`: the
    /// sorted arrays shared, the start bits and the plan of their own.
    /// Returns them with the bytes they take (shared arrays counted).
    fn from_sorted(gpu: &Gpu, sorted: &SortedMode, threadlen: usize) -> Result<(Self, usize)> {
        let plan =
            BlockPlan::from_flags(&sorted.host_flags, sorted.nnz, block_nnz(threadlen), None);
        debug_assert_eq!(plan.block_seg.last(), Some(&(sorted.segments as u32)));
        let start_flags = build::start_flags(gpu, sorted, threadlen)?;
        let edge_rows = build::segment_rows_of(gpu, sorted, &plan.edge_rows)?;
        let bytes = 4
            * (sorted.prod_idx.len()
                + sorted.vals.len()
                + sorted.bit_flags.len()
                + start_flags.len()
                + sorted.seg_rows.len())
            + plan.bytes();
        let tables = ModeTables {
            nnz: sorted.nnz,
            segments: sorted.segments,
            blocks: plan.blocks(),
            slots: plan.slots(),
            fiber: None,
            prod_idx: sorted.prod_idx.clone(),
            vals: sorted.vals.clone(),
            bit_flags: sorted.bit_flags.clone(),
            start_flags,
            seg_rows: sorted.seg_rows.clone(),
            block_seg: gpu.upload("F-COO block segments", &plan.block_seg)?,
            edge_slot: gpu.upload("F-COO edge slots", &plan.edge_slot)?,
            edge_rows,
        };
        Ok((tables, bytes))
    }
}

/// F-COO on one GPU: every mode's F-COO, resident.
pub struct FcooGpu {
    gpu: Arc<Gpu>,
    dims: Vec<u32>,
    threadlen: usize,
    fiber: bool,
    teams: bool,
    pipeline: TeamPipeline,
    precision: FactorPrecision,
    /// The 16-bit copy of the factors (half precision), sized at first use.
    half: Option<CudaSlice<u16>>,
    modes: Vec<ModeTables>,
    resident_bytes: usize,
    /// f64 sums of edge slots, sized for the largest call so far.
    edge_sums: Option<CudaSlice<f64>>,
    /// Whether `edge_sums` holds zeros (the edge store leaves it so).
    sums_zero: bool,
    /// The steps of the device build and their seconds (empty when built
    /// on the host).
    preparation: Vec<(&'static str, f64)>,
}

impl FcooGpu {
    /// Bytes one mode's F-COO `f` and its [`BlockPlan`] take on the device.
    pub fn device_bytes(f: &Fcoo) -> usize {
        Self::mode_bytes(f, &BlockPlan::new(f, block_nnz(f.threadlen())))
    }

    fn mode_bytes(f: &Fcoo, plan: &BlockPlan) -> usize {
        f.bytes() + plan.bytes()
    }

    /// Builds the F-COO of every mode with `threadlen` nonzeros per thread
    /// (a power of two from 1 to 256) and uploads each, checked against
    /// free memory first. One mode's host copy exists at a time. With
    /// `fiber`, the kernel reuses each fiber's factor row (see
    /// `kernels/mttkrp_fcoo.cu`; the layout is the same).
    pub fn new(
        gpu: Arc<Gpu>,
        tensor: &SparseTensor,
        threadlen: usize,
        fiber: bool,
    ) -> Result<Self> {
        Self::new_variants(gpu, tensor, &[(threadlen, fiber)], FcooBuild::default())
            .pop()
            .expect("one engine per variant")
    }

    /// One engine per `(threadlen, fiber)` of `variants`, all of `tensor`,
    /// from one sort per mode: the F-COO layout depends on the threadlen
    /// only through its chunk-start bits ([`Fcoo::start_flags_for`]), so
    /// the candidates that `kruskal cpd --kernel auto` times cost one
    /// preparation. Each entry is that variant's engine or its error.
    ///
    /// With [`FcooBuild::Device`] the layout is built on the GPU
    /// (`kernels/fcoo_build.cu`) and the variants share its arrays; the host
    /// builds it instead for fiber reuse, an empty tensor, or when the GPU
    /// lacks the memory for the sort. On the host, one mode's F-COO exists
    /// at a time and a variant that does not fit in memory leaves the
    /// others be.
    pub fn new_variants(
        gpu: Arc<Gpu>,
        tensor: &SparseTensor,
        variants: &[(usize, bool)],
        build: FcooBuild,
    ) -> Vec<Result<Self>> {
        let on_device = build == FcooBuild::Device
            && tensor.nnz() > 0
            && variants.iter().all(|&(_, fiber)| !fiber);
        if on_device {
            match Self::device_variants(gpu.clone(), tensor, variants) {
                Ok(engines) => return engines,
                // The host build needs no sort buffers on the device.
                Err(DeviceError::OutOfMemory { .. }) => {}
                Err(e) => {
                    let message = e.to_string();
                    let mut out = vec![Err(e)];
                    out.extend((1..variants.len()).map(|_| {
                        Err(DeviceError::Prepare {
                            format: "F-COO",
                            message: message.clone(),
                        })
                    }));
                    return out;
                }
            }
        }
        Self::host_variants(gpu, tensor, variants)
    }

    /// [`FcooGpu::new_variants`] built on the device. An error of the
    /// build (memory included) is returned whole; a bad threadlen is that
    /// variant's error.
    fn device_variants(
        gpu: Arc<Gpu>,
        tensor: &SparseTensor,
        variants: &[(usize, bool)],
    ) -> Result<Vec<Result<Self>>> {
        let prepare = |e: kruskal_formats::FormatError| DeviceError::Prepare {
            format: "F-COO",
            message: e.to_string(),
        };
        Fcoo::check_capacity(tensor.nnz() as u64).map_err(prepare)?;
        let checked: Vec<Result<()>> = variants
            .iter()
            .map(|&(threadlen, _)| Fcoo::check_threadlen(threadlen).map_err(prepare))
            .collect();
        gpu.ensure_free(
            "the COO for the F-COO build",
            DeviceCoo::bytes(tensor.nmodes(), tensor.nnz()),
        )?;
        // Each step ends with the stream idle and adds its seconds to the
        // step's total.
        let mut clock = std::time::Instant::now();
        let mut times: Vec<(&'static str, f64)> = Vec::new();
        let mut lap = |step: &'static str| -> Result<()> {
            gpu.stream()
                .synchronize()
                .map_err(driver("waiting for the F-COO build"))?;
            let now = std::time::Instant::now();
            let s = (now - clock).as_secs_f64();
            match times.iter_mut().find(|(name, _)| *name == step) {
                Some((_, t)) => *t += s,
                None => times.push((step, s)),
            }
            clock = now;
            Ok(())
        };
        build::load_kernels(&gpu)?;
        lap("kernels")?;
        let coo = DeviceCoo::upload(&gpu, tensor)?;
        lap("upload")?;
        let mut modes: Vec<(Vec<ModeTables>, usize)> =
            variants.iter().map(|_| (Vec::new(), 0)).collect();
        let mut scratch = build::SortScratch::new(&gpu, &coo)?;
        lap("buffers")?;
        for mode in 0..tensor.nmodes() {
            let sorted = build::sort_mode(&gpu, &coo, mode, &mut scratch, &mut lap)?;
            for ((tables, bytes), (&(threadlen, _), ok)) in
                modes.iter_mut().zip(variants.iter().zip(&checked))
            {
                if ok.is_ok() {
                    let (t, b) = ModeTables::from_sorted(&gpu, &sorted, threadlen)?;
                    tables.push(t);
                    *bytes += b;
                }
            }
            lap("tables")?;
        }
        Ok(checked
            .into_iter()
            .zip(modes)
            .zip(variants)
            .map(|((ok, (modes, resident_bytes)), &(threadlen, fiber))| {
                ok.map(|()| {
                    let mut e = Self::assemble(
                        &gpu,
                        tensor.dims(),
                        threadlen,
                        fiber,
                        modes,
                        resident_bytes,
                    );
                    e.preparation = times.clone();
                    e
                })
            })
            .collect())
    }

    /// An engine of `modes`' tables, the kernel options at their defaults.
    fn assemble(
        gpu: &Arc<Gpu>,
        dims: &[u32],
        threadlen: usize,
        fiber: bool,
        modes: Vec<ModeTables>,
        resident_bytes: usize,
    ) -> Self {
        FcooGpu {
            gpu: gpu.clone(),
            dims: dims.to_vec(),
            threadlen,
            fiber,
            teams: DEFAULT_TEAMS,
            pipeline: DEFAULT_PIPELINE,
            precision: FactorPrecision::F32,
            half: None,
            modes,
            resident_bytes,
            edge_sums: None,
            sums_zero: true,
            preparation: Vec::new(),
        }
    }

    /// The steps of building this engine on the device, with their seconds
    /// (`kernels` loaded, `upload`, the sort's `buffers`, then summed over
    /// the modes `sort`, `gather`, `segments` and `tables`; each ends with
    /// the stream idle); empty when the host built it.
    pub fn preparation(&self) -> &[(&'static str, f64)] {
        &self.preparation
    }

    /// [`FcooGpu::new_variants`] built on the host.
    fn host_variants(
        gpu: Arc<Gpu>,
        tensor: &SparseTensor,
        variants: &[(usize, bool)],
    ) -> Vec<Result<Self>> {
        let prepare = |e: kruskal_formats::FormatError| DeviceError::Prepare {
            format: "F-COO",
            message: e.to_string(),
        };
        let mut built: Vec<Result<(Vec<ModeTables>, usize)>> = variants
            .iter()
            .map(|&(threadlen, _)| {
                Fcoo::check_threadlen(threadlen)
                    .map(|()| (Vec::with_capacity(tensor.nmodes()), 0))
                    .map_err(prepare)
            })
            .collect();
        // Sorted with the first valid threadlen; the others take their
        // start bits from it.
        let sort_threadlen = variants
            .iter()
            .zip(&built)
            .find(|(_, b)| b.is_ok())
            .map(|(&(threadlen, _), _)| threadlen);
        if let Some(sort_threadlen) = sort_threadlen {
            for mode in 0..tensor.nmodes() {
                let f = match Fcoo::for_mttkrp(tensor, mode, sort_threadlen) {
                    Ok(f) => f,
                    Err(e) => {
                        let message = e.to_string();
                        for b in built.iter_mut().filter(|b| b.is_ok()) {
                            *b = Err(DeviceError::Prepare {
                                format: "F-COO",
                                message: message.clone(),
                            });
                        }
                        break;
                    }
                };
                for (b, &(threadlen, fiber)) in built.iter_mut().zip(variants) {
                    let Ok((modes, bytes)) = b else { continue };
                    let plan = BlockPlan::new(&f, block_nnz(threadlen));
                    let tables = f
                        .start_flags_for(threadlen)
                        .map_err(prepare)
                        .and_then(|start| {
                            // This threadlen's start bits in place of the sort's.
                            let size = Self::mode_bytes(&f, &plan) + 4 * start.len()
                                - 4 * f.start_flags().len();
                            ModeTables::upload(&gpu, &f, &plan, fiber, threadlen, &start)
                                .map(|t| (t, size))
                        });
                    match tables {
                        Ok((t, size)) => {
                            *bytes += size;
                            modes.push(t);
                        }
                        Err(e) => *b = Err(e),
                    }
                }
            }
        }
        built
            .into_iter()
            .zip(variants)
            .map(|(b, &(threadlen, fiber))| {
                b.map(|(modes, resident_bytes)| {
                    Self::assemble(&gpu, tensor.dims(), threadlen, fiber, modes, resident_bytes)
                })
            })
            .collect()
    }

    /// Uploads F-COOs already built: `fcoos[m]` must be the MTTKRP F-COO
    /// of mode `m`, all of one tensor and one `threadlen`.
    pub fn from_fcoos(gpu: Arc<Gpu>, fcoos: &[Fcoo], fiber: bool) -> Result<Self> {
        let first = fcoos
            .first()
            .ok_or_else(|| DeviceError::Shape("no F-COO given".into()))?;
        let (dims, threadlen) = (first.dims().to_vec(), first.threadlen());
        let mut modes = Vec::with_capacity(fcoos.len());
        let mut resident_bytes = 0;
        for (m, f) in fcoos.iter().enumerate() {
            if f.op() != (FcooOp::Mttkrp { mode: m })
                || f.dims() != dims
                || f.threadlen() != threadlen
                || fcoos.len() != dims.len()
            {
                return Err(DeviceError::Shape(format!(
                    "F-COO {m} is not the MTTKRP F-COO of mode {m} of one tensor and threadlen"
                )));
            }
            let plan = BlockPlan::new(f, block_nnz(threadlen));
            resident_bytes += Self::mode_bytes(f, &plan);
            modes.push(ModeTables::upload(
                &gpu,
                f,
                &plan,
                fiber,
                threadlen,
                f.start_flags(),
            )?);
        }
        Ok(Self::assemble(
            &gpu,
            &dims,
            threadlen,
            fiber,
            modes,
            resident_bytes,
        ))
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    pub fn threadlen(&self) -> usize {
        self.threadlen
    }

    /// Gathers factor rows from a 16-bit copy made before each MTTKRP
    /// (`F32`: from the factors themselves).
    pub fn set_precision(&mut self, precision: FactorPrecision) {
        self.precision = precision;
    }

    pub fn precision(&self) -> FactorPrecision {
        self.precision
    }

    /// Runs the lane-team kernel where the rank allows it (and fiber reuse
    /// is off); else the plain one.
    pub fn set_teams(&mut self, teams: bool) {
        self.teams = teams;
    }

    /// How the lane-team kernel keeps loads in flight (its register bound
    /// applies to the plain kernel too).
    pub fn set_pipeline(&mut self, pipeline: TeamPipeline) {
        self.pipeline = pipeline;
    }

    pub fn pipeline(&self) -> TeamPipeline {
        self.pipeline
    }

    /// Whether an MTTKRP of `mode` at `rank` runs the lane-team kernel.
    pub fn uses_teams(&self, mode: usize, rank: usize) -> bool {
        self.teams && teams_fit(rank) && self.modes[mode].fiber.is_none()
    }

    /// Whether the kernel reuses fiber rows.
    pub fn fiber(&self) -> bool {
        self.fiber
    }

    /// Factor rows gathered per nonzero of `mode`: `nmodes - 1`, less the
    /// rows fiber reuse saves.
    pub fn gathers_per_nonzero(&self, mode: usize) -> f64 {
        let t = &self.modes[mode];
        let n = self.dims.len().saturating_sub(1) as f64;
        match t.fiber {
            Some((_, fibers)) if t.nnz > 0 => n - 1.0 + fibers as f64 / t.nnz as f64,
            _ => n,
        }
    }

    /// Bytes of every mode's tables on the device (not counting the edge
    /// sums, `slots x rank` doubles allocated at the first call).
    pub fn resident_bytes(&self) -> usize {
        self.resident_bytes
    }

    /// `out = MTTKRP(mode)` on the device; `out` holds `dims[mode] x rank`
    /// floats. Asynchronous on the GPU's stream.
    pub fn mttkrp(
        &mut self,
        mode: usize,
        factors: &DeviceFactors,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let n = self.dims.len();
        let rank = check_operands(&self.dims, mode, factors, out.len())?;
        let tiles = rank.div_ceil(column_tile(rank));
        let fiber = self.modes[mode].fiber;
        let mut defines = vec![
            ("NMODES", n as i64),
            ("RANK", rank as i64),
            ("WARPS", i64::from(WARPS)),
        ];
        // Only what differs from the plain kernel is defined, so the plain
        // kernel keeps its cache key.
        if fiber.is_some() {
            defines.push(("FIBER", 1));
        }
        // Only what differs from the first kernel's shape is defined, for
        // the same reason.
        let pipe = self.pipeline;
        if self.uses_teams(mode, rank) {
            defines.push(("TEAMS", 1));
            if pipe.rounds != 1 {
                defines.push(("ROUNDS", i64::from(pipe.rounds)));
            }
            if pipe.prefetch {
                defines.push(("PREFETCH", 1));
            }
            if pipe.group_sums {
                defines.push(("GROUP_SUMS", 1));
            }
            if pipe.min_blocks != 1 {
                defines.push(("MINB", i64::from(pipe.min_blocks)));
            }
        }
        let half = self.precision.half_define();
        if half != 0 {
            defines.push(("HALF", half));
        }
        let defines = &defines[..];
        let ctx = self.gpu.context();
        let main = self
            .gpu
            .kernels()
            .function(ctx, Kernel::MttkrpFcoo, defines)?;
        let store = self
            .gpu
            .kernels()
            .function(ctx, Kernel::FcooStoreEdges, defines)?;
        let stream = self.gpu.stream().clone();
        // Every segment's row is written whole (by the kernel or the edge
        // store): only a mode with rows that hold no nonzero needs zeros.
        if self.modes[mode].segments < self.dims[mode] as usize {
            stream
                .memset_zeros(out)
                .map_err(driver("zeroing the output"))?;
        }
        if self.modes[mode].nnz == 0 {
            return Ok(());
        }
        if half != 0 {
            self.convert_factors(mode, factors, defines)?;
        }
        let t = &self.modes[mode];
        let (blocks, tiles) = match (u32::try_from(t.blocks), u32::try_from(tiles)) {
            (Ok(b), Ok(y)) if b <= i32::MAX as u32 && y <= 65_535 => (b, y),
            _ => {
                return Err(DeviceError::Shape(format!(
                    "{} thread blocks x {tiles} column tiles exceed the launch grid",
                    t.blocks
                )));
            }
        };

        let len = t.slots * rank;
        if self.edge_sums.as_ref().is_none_or(|s| s.len() < len.max(1)) {
            self.edge_sums = None;
            self.edge_sums = Some(self.gpu.alloc_zeros::<f64>("the F-COO edge sums", len)?);
            self.sums_zero = true;
        }
        let all_sums = self.edge_sums.as_mut().expect("allocated above");
        let mut sums = all_sums.slice_mut(..len.max(1));
        // The edge store zeroes the sums it reads; they are zeroed here
        // only after a call that did not reach it.
        if !self.sums_zero {
            stream
                .memset_zeros(&mut sums)
                .map_err(driver("zeroing the F-COO edge sums"))?;
            self.sums_zero = true;
        }

        let nnz = t.nnz as u64;
        let threadlen = self.threadlen as u32;
        let mode_i = mode as i32;
        let fiber_p = fiber.map_or(0, |(p, _)| p);
        let mut launch = stream.launch_builder(&main);
        launch
            .arg(&*t.prod_idx)
            .arg(&*t.vals)
            .arg(&*t.bit_flags)
            .arg(&t.start_flags)
            .arg(&*t.seg_rows)
            .arg(&t.block_seg)
            .arg(&t.edge_slot);
        match &self.half {
            Some(h) if half != 0 => launch.arg(h),
            _ => launch.arg(&factors.data),
        };
        launch
            .arg(&factors.row_offset)
            .arg(&mut *out)
            .arg(&mut sums)
            .arg(&nnz)
            .arg(&threadlen)
            .arg(&mode_i)
            .arg(&fiber_p);
        // The kernel adds into the sums of the edge slots (none when len
        // is 0): they are zero again once the edge store has run.
        self.sums_zero = len == 0;
        // SAFETY: block b reads nonzeros [b * block_nnz, (b + 1) * block_nnz)
        // clipped to nnz, with blocks = ceil(nnz / block_nnz) for this
        // threadlen: prod_idx holds (N - 1) x nnz indices and vals nnz
        // values (uploaded from the same Fcoo), bit_flags ceil(nnz / 32)
        // words and start_flags one bit per chunk of threadlen; block_seg has
        // blocks + 1 entries and edge_slot 2 x blocks. Segment numbers are
        // below the segment count, the length of seg_rows; edge slots are
        // below `slots`, and `sums` holds slots x rank doubles. Every index
        // is below its mode's dimension (SparseTensor checks it), and the
        // factors' dims match (checked above), so factor rows lie in `data`
        // and output rows in `out` (dims[mode] x rank, checked). Columns are
        // guarded by `< RANK`; the shared slots hold 2 x WARPS x TILE
        // doubles, TILE = column_tile(rank) (at most 32 KiB); with TEAMS
        // (rank 16, 32, 64 or 128, one column tile) lanes write columns
        // below RANK <= TILE, and float4 accesses are 16-byte aligned (rows
        // of RANK floats, a multiple of 4, in buffers allocated whole;
        // 8-byte for the 16-bit copy). With FIBER,
        // fiber_p is a product number below N - 1 (Fcoo::fiber_product) and
        // the extra read of a fiber index (nonzero g + n of the warp's
        // range) happens only below the range's end, so below nnz.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (blocks, tiles, 1),
                block_dim: (32, WARPS, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(driver("launching mttkrp_fcoo"))?;

        if len > 0 {
            let n_sums = len as u64;
            let mut launch = stream.launch_builder(&store);
            launch
                .arg(&mut sums)
                .arg(&t.edge_rows)
                .arg(&mut *out)
                .arg(&n_sums);
            // SAFETY: sums holds slots x rank doubles (thread e reads and
            // zeroes sums[e] alone), edge_rows `slots` rows, each an output
            // row below dims[mode] (segment rows of the Fcoo), so
            // out[row * rank + col] lies inside `out`.
            unsafe { launch.launch(grid_stride(n_sums, 256)) }
                .map_err(driver("launching fcoo_store_edges"))?;
            self.sums_zero = true;
        }
        Ok(())
    }
}

impl FcooGpu {
    /// Rounds the rows of every product mode of `mode` into the 16-bit
    /// copy (kernel `fcoo_to_half`), allocating it at first use.
    fn convert_factors(
        &mut self,
        mode: usize,
        factors: &DeviceFactors,
        defines: &[(&str, i64)],
    ) -> Result<()> {
        let len = factors.data.len();
        if self.half.as_ref().is_none_or(|h| h.len() < len) {
            self.half = None;
            self.half = Some(self.gpu.alloc_zeros::<u16>("the 16-bit factor copy", len)?);
        }
        let convert =
            self.gpu
                .kernels()
                .function(self.gpu.context(), Kernel::FcooToHalf, defines)?;
        let stream = self.gpu.stream().clone();
        let rank = factors.rank();
        let half = self.half.as_mut().expect("allocated above");
        let mut first = 0usize;
        for (w, &d) in factors.dims().iter().enumerate() {
            let rows = d as usize;
            if w != mode && rows > 0 {
                let (lo, hi) = (first * rank, (first + rows) * rank);
                let src = factors.data.slice(lo..hi);
                let mut dst = half.slice_mut(lo..hi);
                let n = (hi - lo) as u64;
                let mut launch = stream.launch_builder(&convert);
                launch.arg(&src).arg(&mut dst).arg(&n);
                // SAFETY: src and dst are views of n = rows x rank elements
                // of the factors and of the copy (as long as the factors,
                // checked above), and each thread touches element e < n.
                unsafe { launch.launch(grid_stride(n, 256)) }
                    .map_err(driver("launching fcoo_to_half"))?;
            }
            first += rows;
        }
        Ok(())
    }
}

forward_gpu_mttkrp!(FcooGpu, "fcoo", gathers);

#[cfg(test)]
impl FcooGpu {
    /// Mode `mode`'s device tables brought back: product indices, value
    /// bits, bit flags, start flags, segment rows, block segments, edge
    /// slots, edge rows.
    fn tables_on_host(&self, mode: usize) -> Vec<Vec<u32>> {
        let t = &self.modes[mode];
        let s = self.gpu.stream();
        let down = |d: &CudaSlice<u32>| s.clone_dtoh(d).unwrap();
        let vals: Vec<u32> = s
            .clone_dtoh(&*t.vals)
            .unwrap()
            .iter()
            .map(|v: &f32| v.to_bits())
            .collect();
        vec![
            down(&t.prod_idx),
            vals,
            down(&t.bit_flags),
            down(&t.start_flags),
            down(&t.seg_rows),
            down(&t.block_seg),
            down(&t.edge_slot),
            down(&t.edge_rows),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GpuMttkrp;
    use crate::testutil::{check_engine, factors, hot_tensors, model_error};
    use kruskal_cpu::mttkrp_reference;
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use ndarray::Array2;
    use proptest::prelude::*;

    /// The plan, derived nonzero by nonzero.
    fn check_plan(f: &Fcoo, block: usize) {
        let plan = BlockPlan::new(f, block);
        let nnz = f.nnz();
        let blocks = nnz.div_ceil(block);
        assert_eq!(plan.blocks(), blocks);
        assert_eq!(plan.edge_slot.len(), 2 * blocks);
        assert_eq!(plan.block_seg[blocks] as usize, f.segments());
        for b in 0..blocks {
            assert_eq!(
                plan.block_seg[b] as usize,
                f.segment_of(b * block),
                "block {b}"
            );
        }
        // Every segment crossing a block edge has one slot, named by both
        // blocks of every edge it crosses, holding its output row.
        let mut seen = Vec::new();
        for b in 0..blocks {
            let head = b > 0 && !f.ends_segment(b * block - 1);
            let hi = nnz.min((b + 1) * block);
            let tail = hi < nnz && !f.ends_segment(hi - 1);
            assert_eq!(plan.edge_slot[2 * b] != NONE, head, "block {b}");
            assert_eq!(plan.edge_slot[2 * b + 1] != NONE, tail, "block {b}");
            if tail {
                let slot = plan.edge_slot[2 * b + 1];
                assert_eq!(plan.edge_slot[2 * (b + 1)], slot);
                let seg = f.segment_of(hi - 1);
                assert_eq!(plan.edge_rows[slot as usize], f.segment_idx()[0][seg]);
                if seen.last() != Some(&seg) {
                    seen.push(seg);
                }
            }
        }
        assert_eq!(seen.len(), plan.slots());
        assert!(plan.slots() < blocks.max(1));
    }

    #[test]
    fn plan_of_a_hot_row_spanning_blocks() {
        // Zipf 1.5 puts a large part of each mode in one row.
        let mut spec = PowerLawSpec::new(vec![200, 150, 100], 50_000).with_draws();
        spec.exponents = vec![1.5; 3];
        let t = power_law(&spec).unwrap();
        for threadlen in [1, 8] {
            for mode in 0..3 {
                let f = Fcoo::for_mttkrp(&t, mode, threadlen).unwrap();
                check_plan(&f, block_nnz(threadlen));
                let plan = BlockPlan::new(&f, block_nnz(threadlen));
                if threadlen == 1 {
                    // The hot row crosses many edges but has one slot.
                    let shared = plan.edge_slot.iter().filter(|&&s| s != NONE).count();
                    assert!(shared > 2 * plan.slots(), "mode {mode}");
                }
            }
        }
    }

    #[test]
    fn plan_of_an_empty_tensor_and_bytes() {
        let t = SparseTensor::new(vec![3, 4, 5], vec![vec![], vec![], vec![]], vec![]).unwrap();
        let f = Fcoo::for_mttkrp(&t, 1, 8).unwrap();
        let plan = BlockPlan::new(&f, block_nnz(8));
        assert_eq!(plan.blocks(), 0);
        assert_eq!(plan.block_seg, vec![0]);
        assert_eq!(plan.slots(), 0);
        assert_eq!(FcooGpu::device_bytes(&f), 4);

        let t = power_law(&PowerLawSpec::new(vec![50, 40, 30], 10_000).with_draws()).unwrap();
        let f = Fcoo::for_mttkrp(&t, 0, 1).unwrap();
        let plan = BlockPlan::new(&f, block_nnz(1));
        assert_eq!(
            FcooGpu::device_bytes(&f),
            f.bytes() + 4 * (plan.blocks() + 1 + 2 * plan.blocks() + plan.slots())
        );
    }

    #[test]
    fn column_tiles_cover_every_rank() {
        assert_eq!(column_tile(1), 32);
        assert_eq!(column_tile(32), 32);
        assert_eq!(column_tile(33), 64);
        assert_eq!(column_tile(100), 128);
        assert_eq!(column_tile(256), 128);
        for rank in 1..600 {
            let tile = column_tile(rank);
            assert!(tile * rank.div_ceil(tile) >= rank && tile <= 128);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn plan_matches_the_flags(
            nnz in 1usize..3_000,
            rows in 1u32..40,
            exponent in 0.0f64..1.6,
            log_threadlen in 0u32..=3,
            seed in any::<u64>(),
        ) {
            let mut spec = PowerLawSpec::new(vec![rows, 30, 20], nnz).with_draws().with_seed(seed);
            spec.exponents = vec![exponent; 3];
            let t = power_law(&spec).unwrap();
            let threadlen = 1 << log_threadlen;
            let f = Fcoo::for_mttkrp(&t, 0, threadlen).unwrap();
            // Small blocks, so that many edges are crossed.
            for block in [32, 64, block_nnz(threadlen)] {
                check_plan(&f, block);
            }
        }
    }

    /// `mttkrp_fcoo` and `fcoo_store_edges` step by step on the CPU (a
    /// warp's lanes become a loop over all columns; warps run in order,
    /// which the kernel's barrier makes equivalent): checks the plan and
    /// the kernel's segment logic without a GPU. Rows the model never
    /// writes stay NaN, where the engine's memset leaves 0; so a NaN row
    /// must be a row without nonzeros.
    fn model(f: &Fcoo, factors: &[Array2<f32>], mode: usize) -> Array2<f32> {
        let rank = factors[0].ncols();
        let warps = WARPS as usize;
        let plan = BlockPlan::new(f, block_nnz(f.threadlen()));
        let warp_nnz = f.threadlen() * 32;
        let prod_modes: Vec<usize> = (0..f.nmodes()).filter(|&w| w != mode).collect();
        let seg_rows = &f.segment_idx()[0];
        let mut out = Array2::from_elem((f.dims()[mode] as usize, rank), f32::NAN);
        let mut edge_sums = vec![0f64; plan.slots() * rank];
        let flags = f.bit_flags();
        for b in 0..plan.blocks() {
            let mut slot_sum = vec![vec![0f64; rank]; 2 * warps];
            let mut slot_seg = vec![NONE; 2 * warps];
            let range = |w: usize| {
                let lo = (b * warps + w) * warp_nnz;
                (
                    lo,
                    if lo < f.nnz() {
                        (lo + warp_nnz).min(f.nnz())
                    } else {
                        lo
                    },
                )
            };
            let warp_ends: Vec<u32> = (0..warps)
                .map(|w| {
                    let (lo, hi) = range(w);
                    let words = (lo / 32..hi.div_ceil(32)).filter_map(|q| flags.get(q));
                    words.map(|x| x.count_ones()).sum()
                })
                .collect();
            for w in 0..warps {
                let (w_lo, w_hi) = range(w);
                if w_lo >= w_hi {
                    continue;
                }
                let mut seg = plan.block_seg[b] + warp_ends[..w].iter().sum::<u32>();
                let head_shared = f.start_flags()[w_lo / warp_nnz] & 1 == 0;
                let mut acc = vec![0f64; rank];
                let (mut first, mut open) = (true, false);
                for g in (w_lo..w_hi).step_by(32) {
                    let bits = flags[g / 32];
                    for j in 0..(w_hi - g).min(32) {
                        let k = g + j;
                        for (r, a) in acc.iter_mut().enumerate() {
                            let mut prod = f.values()[k];
                            for (p, &m) in prod_modes.iter().enumerate() {
                                prod *= factors[m][[f.product_idx()[p][k] as usize, r]];
                            }
                            *a += f64::from(prod);
                        }
                        open = (bits >> j) & 1 == 0;
                        if open {
                            continue;
                        }
                        if first && head_shared {
                            slot_sum[2 * w].copy_from_slice(&acc);
                            slot_seg[2 * w] = seg;
                        } else {
                            let row = seg_rows[seg as usize] as usize;
                            for r in 0..rank {
                                out[[row, r]] = acc[r] as f32;
                            }
                        }
                        acc.fill(0.0);
                        seg += 1;
                        first = false;
                    }
                }
                if open {
                    let s = if first && head_shared {
                        2 * w
                    } else {
                        2 * w + 1
                    };
                    slot_sum[s].copy_from_slice(&acc);
                    slot_seg[s] = seg;
                }
            }
            // Warp 0's combine.
            let (head_slot, tail_slot) = (plan.edge_slot[2 * b], plan.edge_slot[2 * b + 1]);
            let (head_seg, tail_seg) = (plan.block_seg[b], plan.block_seg[b + 1]);
            let mut cur = NONE;
            let mut sum = vec![0f64; rank];
            for s in 0..=2 * warps {
                let seg = if s < 2 * warps { slot_seg[s] } else { NONE };
                if s < 2 * warps && seg == NONE {
                    continue;
                }
                if seg != cur {
                    if cur != NONE {
                        let slot = if head_slot != NONE && cur == head_seg {
                            head_slot
                        } else if tail_slot != NONE && cur == tail_seg {
                            tail_slot
                        } else {
                            NONE
                        };
                        if slot != NONE {
                            let d = &mut edge_sums[slot as usize * rank..][..rank];
                            d.iter_mut().zip(&sum).for_each(|(d, s)| *d += s);
                        } else {
                            let row = seg_rows[cur as usize] as usize;
                            for r in 0..rank {
                                out[[row, r]] = sum[r] as f32;
                            }
                        }
                    }
                    cur = seg;
                    sum.fill(0.0);
                }
                if s == 2 * warps {
                    break;
                }
                sum.iter_mut().zip(&slot_sum[s]).for_each(|(a, x)| *a += x);
            }
        }
        for (slot, &row) in plan.edge_rows.iter().enumerate() {
            for r in 0..rank {
                out[[row as usize, r]] = edge_sums[slot * rank + r] as f32;
            }
        }
        out
    }

    #[test]
    fn kernel_model_equals_the_f64_reference() {
        let mut spec = PowerLawSpec::new(vec![120, 90, 60], 30_000).with_draws();
        spec.exponents = vec![1.3; 3];
        let hot = power_law(&spec).unwrap();
        let mut spec = PowerLawSpec::new(vec![400, 30, 50, 20], 9_000)
            .with_draws()
            .with_seed(5);
        spec.exponents = vec![0.7; 4];
        let cold = power_law(&spec).unwrap();
        for (t, threadlens) in [(&hot, &[1usize, 2, 8][..]), (&cold, &[1, 4][..])] {
            for &threadlen in threadlens {
                for rank in [1, 5] {
                    let fs = factors(t.dims(), rank, 7);
                    let views: Vec<_> = fs.iter().map(|a| a.view()).collect();
                    for mode in 0..t.nmodes() {
                        let f = Fcoo::for_mttkrp(t, mode, threadlen).unwrap();
                        let out = model(&f, &fs, mode);
                        let exact = mttkrp_reference(t, &views, mode).unwrap();
                        let err = model_error(out, &exact);
                        assert!(
                            err < 1e-6,
                            "threadlen {threadlen} rank {rank} mode {mode}: {err}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn fcoo_equals_the_f64_reference() {
        let Some(gpu) = crate::testing::gpu_or_skip("fcoo_equals_the_f64_reference") else {
            return;
        };
        for t in hot_tensors(37) {
            for (fiber, teams) in [(false, true), (false, false), (true, false)] {
                let mut engine = FcooGpu::new(gpu.clone(), &t, DEFAULT_THREADLEN, fiber).unwrap();
                engine.set_teams(teams);
                for rank in [1, 7, 16, 32, 64, 100, 128, 256, 300] {
                    let what = format!("{} modes, fiber {fiber}, teams {teams}", t.nmodes());
                    check_engine(&mut engine, &t, rank, &what);
                }
            }
        }
    }

    #[test]
    fn every_team_pipeline_equals_the_f64_reference() {
        let Some(gpu) = crate::testing::gpu_or_skip("every_team_pipeline_equals_the_f64_reference")
        else {
            return;
        };
        // Hot rows (long segments crossing warps and blocks), and many short
        // rows with a nonzero count that leaves the last group short.
        let hot = hot_tensors(37);
        let mut spec = PowerLawSpec::new(vec![5_000, 300, 40], 40_001).with_seed(9);
        spec.exponents = vec![0.3; 3];
        let short = power_law(&spec).unwrap();
        assert_eq!(short.nnz() % 32, 1);
        let pipelines = [
            (1, false, 1, false),
            (
                DEFAULT_PIPELINE.rounds,
                DEFAULT_PIPELINE.prefetch,
                DEFAULT_PIPELINE.min_blocks,
                DEFAULT_PIPELINE.group_sums,
            ),
            (4, true, 1, true),
            (8, true, 1, false),
            (8, false, 2, true),
        ];
        for t in [&hot[0], &hot[1], &short] {
            for threadlen in [1, 8] {
                let mut engine = FcooGpu::new(gpu.clone(), t, threadlen, false).unwrap();
                for (rounds, prefetch, min_blocks, group_sums) in pipelines {
                    let pipe = TeamPipeline {
                        rounds,
                        prefetch,
                        min_blocks,
                        group_sums,
                    };
                    pipe.check().unwrap();
                    engine.set_pipeline(pipe);
                    for rank in [16, 32, 128] {
                        let what = format!("{} modes, threadlen {threadlen}, {pipe:?}", t.nmodes());
                        check_engine(&mut engine, t, rank, &what);
                    }
                }
            }
        }
    }

    #[test]
    fn variants_from_one_sort_equal_engines_built_alone() {
        let Some(gpu) =
            crate::testing::gpu_or_skip("variants_from_one_sort_equal_engines_built_alone")
        else {
            return;
        };
        let t = &hot_tensors(37)[0];
        let variants = [(8, false), (4, false), (16, true), (3, false)];
        let built = FcooGpu::new_variants(gpu.clone(), t, &variants, FcooBuild::default());
        assert!(matches!(built[3], Err(DeviceError::Prepare { .. })));
        let f = factors(t.dims(), 32, 5);
        for (engine, &(threadlen, fiber)) in built.into_iter().zip(&variants).take(3) {
            let mut shared = engine.unwrap();
            let mut alone = FcooGpu::new(gpu.clone(), t, threadlen, fiber).unwrap();
            assert_eq!(shared.resident_bytes(), alone.resident_bytes());
            for mode in 0..t.nmodes() {
                let mut a = Array2::from_elem((t.dims()[mode] as usize, 32), f32::NAN);
                let mut b = a.clone();
                shared.mttkrp_host(mode, &f, &mut a).unwrap();
                alone.mttkrp_host(mode, &f, &mut b).unwrap();
                // Same layout, same kernel: the same bits.
                assert_eq!(a, b, "threadlen {threadlen} fiber {fiber} mode {mode}");
            }
            check_engine(&mut shared, t, 32, "shared sort");
        }
    }

    /// Tensors for the device build: hot rows over several tiles, keys of
    /// 64 bits, dimensions of 1, repeated second-mode indices.
    fn build_tensors() -> Vec<SparseTensor> {
        let mut all = hot_tensors(37);
        for (dims, nnz, exponent, seed) in [
            (vec![3_000_000, 5_000, 2_000_000], 120_000, 0.4, 1),
            (vec![1, 60, 7], 300, 0.0, 2),
            (vec![9, 1, 1, 5], 40, 0.0, 3),
            (vec![20_000, 300, 40_000], 700_000, 1.2, 4),
        ] {
            let n = dims.len();
            let mut spec = PowerLawSpec::new(dims, nnz).with_draws().with_seed(seed);
            spec.exponents = vec![exponent; n];
            all.push(power_law(&spec).unwrap());
        }
        all
    }

    #[test]
    fn device_build_equals_the_host_build_bit_for_bit() {
        let Some(gpu) =
            crate::testing::gpu_or_skip("device_build_equals_the_host_build_bit_for_bit")
        else {
            return;
        };
        for t in build_tensors() {
            let variants = [(8, false), (1, false), (32, false), (256, false)];
            let on_device = FcooGpu::new_variants(gpu.clone(), &t, &variants, FcooBuild::Device);
            let on_host = FcooGpu::new_variants(gpu.clone(), &t, &variants, FcooBuild::Host);
            for ((d, h), &(threadlen, _)) in on_device.into_iter().zip(on_host).zip(&variants) {
                let (mut d, h) = (d.unwrap(), h.unwrap());
                assert_eq!(d.resident_bytes(), h.resident_bytes());
                for mode in 0..t.nmodes() {
                    let what = format!("dims {:?} threadlen {threadlen} mode {mode}", t.dims());
                    let (dt, ht) = (d.tables_on_host(mode), h.tables_on_host(mode));
                    for (k, (a, b)) in dt.iter().zip(&ht).enumerate() {
                        assert!(a == b, "{what}: table {k} differs");
                    }
                    let m = &d.modes[mode];
                    assert_eq!(
                        (m.blocks, m.slots),
                        (h.modes[mode].blocks, h.modes[mode].slots)
                    );
                }
                check_engine(&mut d, &t, 16, "built on the device");
            }
        }
    }

    #[test]
    fn half_precision_gathers_err_within_their_rounding() {
        use crate::options::FactorPrecision;
        let Some(gpu) =
            crate::testing::gpu_or_skip("half_precision_gathers_err_within_their_rounding")
        else {
            return;
        };
        let t = &hot_tensors(37)[1];
        for (precision, tol) in [(FactorPrecision::Bf16, 1e-2), (FactorPrecision::F16, 2e-3)] {
            for teams in [true, false] {
                let mut engine = FcooGpu::new(gpu.clone(), t, DEFAULT_THREADLEN, false).unwrap();
                engine.set_precision(precision);
                engine.set_teams(teams);
                for rank in [7, 32] {
                    let f = factors(t.dims(), rank, 3);
                    let views: Vec<_> = f.iter().map(|a| a.view()).collect();
                    for mode in 0..t.nmodes() {
                        let mut out = Array2::from_elem((t.dims()[mode] as usize, rank), f32::NAN);
                        engine.mttkrp_host(mode, &f, &mut out).unwrap();
                        let exact = mttkrp_reference(t, &views, mode).unwrap();
                        let err = kruskal_cpu::relative_error(out.view(), exact.view());
                        // Above f32's error (the copy is what was read), within
                        // what the rounding of the factors allows.
                        let what = format!("{precision:?} teams {teams} rank {rank} mode {mode}");
                        assert!(err > 1e-6 && err < tol, "{what}: {err}");
                    }
                }
            }
        }
    }

    #[test]
    fn fiber_reuse_gathers_fewer_rows_and_matches_plain_fcoo() {
        let Some(gpu) =
            crate::testing::gpu_or_skip("fiber_reuse_gathers_fewer_rows_and_matches_plain_fcoo")
        else {
            return;
        };
        for t in hot_tensors(37) {
            let plain = FcooGpu::new(gpu.clone(), &t, DEFAULT_THREADLEN, false).unwrap();
            let mut fiber = FcooGpu::new(gpu.clone(), &t, DEFAULT_THREADLEN, true).unwrap();
            let n = t.nmodes() as f64 - 1.0;
            for mode in 0..t.nmodes() {
                assert_eq!(plain.gathers_per_nonzero(mode), n);
                // Hot rows of small modes repeat their fiber index often.
                let g = fiber.gathers_per_nonzero(mode);
                assert!(g > n - 1.0 && g < n - 0.1, "mode {mode}: {g}");
            }
            // Fibers cut at every nonzero (threadlen 1 still has fibers
            // within a warp's 32 nonzeros) still give the same result.
            let mut one = FcooGpu::new(gpu.clone(), &t, 1, true).unwrap();
            check_engine(&mut one, &t, 32, "fiber, threadlen 1");
            check_engine(&mut fiber, &t, 33, "fiber");
        }
    }

    #[test]
    fn fcoo_threadlens_and_edge_cases() {
        let Some(gpu) = crate::testing::gpu_or_skip("fcoo_threadlens_and_edge_cases") else {
            return;
        };
        let tensors = hot_tensors(37);
        for threadlen in [1, 2, 4, 16, 64, 256] {
            for t in &tensors[..2] {
                for fiber in [false, true] {
                    let mut engine = FcooGpu::new(gpu.clone(), t, threadlen, fiber).unwrap();
                    for rank in [7, 32] {
                        let what = format!("threadlen {threadlen}, fiber {fiber}");
                        check_engine(&mut engine, t, rank, &what);
                    }
                }
            }
        }
        // Empty rows (half of each mode unused), one- and two-mode tensors,
        // and an empty tensor: unwritten rows must come back 0, not NaN.
        let small = SparseTensor::new(
            vec![6, 2, 2],
            vec![vec![4, 4, 1], vec![0, 1, 1], vec![1, 1, 0]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap();
        let one_mode =
            SparseTensor::new(vec![7], vec![vec![3, 1, 3, 6]], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let mut spec = PowerLawSpec::new(vec![90, 70], 5_000).with_draws();
        spec.exponents = vec![1.3; 2];
        let two_modes = power_law(&spec).unwrap();
        let empty = SparseTensor::new(vec![3, 2, 4], vec![vec![], vec![], vec![]], vec![]).unwrap();
        for fiber in [false, true] {
            let mut engine = FcooGpu::new(gpu.clone(), &small, 1, fiber).unwrap();
            check_engine(&mut engine, &small, 3, "small");
            check_engine(
                &mut FcooGpu::new(gpu.clone(), &one_mode, 1, fiber).unwrap(),
                &one_mode,
                5,
                "one mode",
            );
            check_engine(
                &mut FcooGpu::new(gpu.clone(), &two_modes, 2, fiber).unwrap(),
                &two_modes,
                33,
                "two modes",
            );
            let mut engine = FcooGpu::new(gpu.clone(), &empty, 8, fiber).unwrap();
            let f = factors(empty.dims(), 4, 1);
            let mut out = Array2::from_elem((2, 4), f32::NAN);
            engine.mttkrp_host(1, &f, &mut out).unwrap();
            assert!(out.iter().all(|&x| x == 0.0));
        }
        // Bad threadlen is a typed error.
        assert!(matches!(
            FcooGpu::new(gpu, &empty, 3, false),
            Err(DeviceError::Prepare { .. })
        ));
    }
}
