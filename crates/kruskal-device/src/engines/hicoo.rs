//! The `hicoo` engine: one HiCOO copy of the tensor on the GPU (offsets
//! `u8`, block coordinates `u32`), serving every mode (kernel
//! `mttkrp_hicoo` in `kernels/mttkrp_hicoo.cu`, whose header states the
//! thread mapping).
//!
//! As in the CPU engine, the blocks are grouped per output mode by their
//! block coordinate in that mode: a group's nonzeros all land in the same
//! `2^b` output rows, which one thread block accumulates in shared memory
//! (f64) and stores without global atomics. Groups holding more than
//! `split_nnz` nonzeros (power-law tensors put a large part of the tensor
//! in the block row of a hot index) are cut into pieces of about equal
//! size, one thread block each; the pieces of such a *split group* add their
//! rows into an f64 buffer with atomics, and a second kernel stores it.
//! The host builds the per-mode [`Schedule`].

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use kruskal_formats::{Hicoo, SparseTensor};

use crate::factors::{DeviceFactors, check_operands};
use crate::kernels::Kernel;
use crate::{DeviceError, Gpu, Result, driver, grid_stride};

/// Warps per thread block.
pub const WARPS: u32 = 8;
/// No slot: the piece is its whole group (the kernel's `NONE`).
const NONE: u32 = u32::MAX;

/// Width of the column tile one thread block computes for `rank` (the
/// kernel's `TILE`); `ceil(rank / tile)` tiles.
pub fn column_tile(rank: usize) -> usize {
    rank.clamp(1, 32)
}

/// Dynamic shared memory of `mttkrp_hicoo`: `2^block_bits` rows of a
/// column tile, in f64.
pub fn shared_bytes(block_bits: u8, rank: usize) -> usize {
    (1usize << block_bits) * column_tile(rank) * 8
}

/// Groups are cut into pieces of at most this many nonzeros by default:
/// `max(nnz / 4096, 1024)`, so a large tensor gives a few thousand thread
/// blocks (several waves on a GPU of 132 SMs) whatever its rows are.
pub fn default_split_nnz(nnz: usize) -> usize {
    (nnz / 4096).max(1024)
}

/// The work of one output mode: blocks grouped by their block coordinate
/// in the mode, and groups cut into pieces (one thread block each).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Block ids sorted by (mode coordinate, id): each group is a run.
    pub order: Vec<u32>,
    /// Four words per piece: positions `pos_lo..pos_hi` in `order`, the
    /// piece starting at nonzero `nz_lo` of the first block and ending
    /// before nonzero `nz_hi` of the last.
    pub pieces: Vec<u64>,
    /// Per piece: the slot of its group if the group is split, else
    /// `u32::MAX` (the piece owns its group's rows).
    pub piece_slot: Vec<u32>,
    /// Per split group (slot): its first output row (`coord << b`).
    pub slot_rows: Vec<u32>,
}

impl Schedule {
    /// Groups the blocks of `h` for output `mode` and cuts groups of more
    /// than `split_nnz` (at least 1) nonzeros into `ceil(nnz / split_nnz)`
    /// pieces of about equal nonzero count.
    ///
    /// Cost: [`Hicoo::block_groups`].
    pub fn new(h: &Hicoo, mode: usize, split_nnz: usize) -> Self {
        let b = u32::from(h.block_bits());
        let blocks = h.block_groups(mode, split_nnz.max(1));
        let mut sched = Schedule {
            order: blocks.order,
            pieces: Vec::with_capacity(4 * blocks.pieces.len()),
            piece_slot: Vec::with_capacity(blocks.pieces.len()),
            slot_rows: Vec::new(),
        };
        for g in &blocks.groups {
            let slot = if g.is_split() {
                sched.slot_rows.push(g.coord << b);
                (sched.slot_rows.len() - 1) as u32
            } else {
                NONE
            };
            for p in &blocks.pieces[g.piece_lo..g.piece_hi] {
                sched
                    .pieces
                    .extend([p.pos_lo, p.pos_hi, p.nz_lo, p.nz_hi].map(|x| x as u64));
                sched.piece_slot.push(slot);
            }
        }
        sched
    }

    /// Number of pieces (thread blocks per column tile).
    pub fn piece_count(&self) -> usize {
        self.piece_slot.len()
    }

    /// Number of split groups.
    pub fn slots(&self) -> usize {
        self.slot_rows.len()
    }

    /// Bytes of the schedule on the device.
    pub fn bytes(&self) -> usize {
        4 * self.order.len()
            + 8 * self.pieces.len()
            + 4 * self.piece_slot.len()
            + 4 * self.slot_rows.len()
    }
}

/// One mode's schedule on the device.
struct ModeTables {
    pieces: usize,
    slots: usize,
    order: CudaSlice<u32>,
    piece: CudaSlice<u64>,
    piece_slot: CudaSlice<u32>,
    slot_rows: CudaSlice<u32>,
}

/// HiCOO on one GPU: one copy of the tensor and a schedule per mode.
pub struct HicooGpu {
    gpu: Arc<Gpu>,
    dims: Vec<u32>,
    nnz: usize,
    nblocks: usize,
    block_bits: u8,
    split_nnz: usize,
    block_ptr: CudaSlice<u64>,
    /// `nmodes x nblocks`, mode-major.
    block_coords: CudaSlice<u32>,
    /// `nmodes x nnz`, mode-major.
    offsets: CudaSlice<u8>,
    vals: CudaSlice<f32>,
    modes: Vec<ModeTables>,
    resident_bytes: usize,
    /// f64 sums of split groups, sized for the largest call so far.
    split_sums: Option<CudaSlice<f64>>,
}

impl HicooGpu {
    /// Bytes the engine takes on the device for `h` cut at `split_nnz`:
    /// the HiCOO arrays plus every mode's [`Schedule`] (not counting the
    /// split-group sums, `slots x 2^b x rank` doubles allocated at the
    /// first call). Cost: builds the schedules.
    pub fn device_bytes(h: &Hicoo, split_nnz: usize) -> usize {
        h.bytes()
            + (0..h.nmodes())
                .map(|m| Schedule::new(h, m, split_nnz).bytes())
                .sum::<usize>()
    }

    /// Builds the HiCOO form of `tensor` with `2^block_bits`-wide blocks
    /// ([`Hicoo::DEFAULT_BLOCK_BITS`] is ParTI's choice) and uploads it
    /// with the schedules of every mode, cut at [`default_split_nnz`].
    pub fn new(gpu: Arc<Gpu>, tensor: &SparseTensor, block_bits: u8) -> Result<Self> {
        let h = Hicoo::new(tensor, block_bits).map_err(|e| DeviceError::Prepare {
            format: "HiCOO",
            message: e.to_string(),
        })?;
        Self::from_hicoo(gpu, &h, default_split_nnz(tensor.nnz()))
    }

    /// Uploads `h` with schedules cut at `split_nnz` nonzeros per piece
    /// (tests use small values to force splitting), checked against free
    /// memory first.
    pub fn from_hicoo(gpu: Arc<Gpu>, h: &Hicoo, split_nnz: usize) -> Result<Self> {
        let split_nnz = split_nnz.max(1);
        let schedules: Vec<Schedule> = (0..h.nmodes())
            .map(|m| Schedule::new(h, m, split_nnz))
            .collect();
        let resident_bytes = h.bytes() + schedules.iter().map(Schedule::bytes).sum::<usize>();
        gpu.ensure_free("the HiCOO tensor and schedules", resident_bytes)?;
        let mut coords = Vec::with_capacity(h.nblocks() * h.nmodes());
        for c in h.block_coords() {
            coords.extend_from_slice(c);
        }
        let mut offsets = Vec::with_capacity(h.nnz() * h.nmodes());
        for o in h.offsets() {
            offsets.extend_from_slice(o);
        }
        let modes = schedules
            .iter()
            .map(|s| {
                Ok(ModeTables {
                    pieces: s.piece_count(),
                    slots: s.slots(),
                    order: gpu.upload("the HiCOO block order", &s.order)?,
                    piece: gpu.upload("the HiCOO pieces", &s.pieces)?,
                    piece_slot: gpu.upload("the HiCOO piece slots", &s.piece_slot)?,
                    slot_rows: gpu.upload("the HiCOO slot rows", &s.slot_rows)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(HicooGpu {
            dims: h.dims().to_vec(),
            nnz: h.nnz(),
            nblocks: h.nblocks(),
            block_bits: h.block_bits(),
            split_nnz,
            block_ptr: gpu.upload("the HiCOO block pointers", h.block_ptr())?,
            block_coords: gpu.upload("the HiCOO block coordinates", &coords)?,
            offsets: gpu.upload("the HiCOO offsets", &offsets)?,
            vals: gpu.upload("the HiCOO values", h.values())?,
            modes,
            resident_bytes,
            split_sums: None,
            gpu,
        })
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    pub fn block_bits(&self) -> u8 {
        self.block_bits
    }

    pub fn split_nnz(&self) -> usize {
        self.split_nnz
    }

    /// Bytes of the tensor and schedules on the device.
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
        let shared = shared_bytes(self.block_bits, rank);
        let props = self.gpu.properties();
        if shared > props.shared_per_block_optin.max(props.shared_per_block) {
            return Err(DeviceError::Shape(format!(
                "hicoo with 2^{} rows needs {shared} bytes of shared memory per block, the GPU allows {}",
                self.block_bits, props.shared_per_block_optin
            )));
        }
        let defines = [
            ("NMODES", n as i64),
            ("RANK", rank as i64),
            ("WARPS", i64::from(WARPS)),
        ];
        let ctx = self.gpu.context();
        let main = self
            .gpu
            .kernels()
            .function(ctx, Kernel::MttkrpHicoo, &defines)?;
        let store = self
            .gpu
            .kernels()
            .function(ctx, Kernel::HicooStoreSplit, &defines)?;
        if shared > props.shared_per_block {
            main.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared as i32,
            )
            .map_err(driver("allowing mttkrp_hicoo more shared memory"))?;
        }
        let stream = self.gpu.stream().clone();
        stream
            .memset_zeros(out)
            .map_err(driver("zeroing the output"))?;
        let t = &self.modes[mode];
        if self.nnz == 0 {
            return Ok(());
        }
        let (pieces, tiles) = match (u32::try_from(t.pieces), u32::try_from(tiles)) {
            (Ok(p), Ok(y)) if p <= i32::MAX as u32 && y <= 65_535 => (p, y),
            _ => {
                return Err(DeviceError::Shape(format!(
                    "{} pieces x {tiles} column tiles exceed the launch grid",
                    t.pieces
                )));
            }
        };

        let len = (t.slots << self.block_bits) * rank;
        if self
            .split_sums
            .as_ref()
            .is_none_or(|s| s.len() < len.max(1))
        {
            self.split_sums = None;
            self.split_sums = Some(self.gpu.alloc_zeros::<f64>("the HiCOO split sums", len)?);
        }
        let all_sums = self.split_sums.as_mut().expect("allocated above");
        let mut sums = all_sums.slice_mut(..len.max(1));
        stream
            .memset_zeros(&mut sums)
            .map_err(driver("zeroing the HiCOO split sums"))?;

        let nnz = self.nnz as u64;
        let nblocks = self.nblocks as u64;
        let bits = u32::from(self.block_bits);
        let dim = self.dims[mode];
        let mode_i = mode as i32;
        let mut launch = stream.launch_builder(&main);
        launch
            .arg(&self.block_ptr)
            .arg(&self.block_coords)
            .arg(&self.offsets)
            .arg(&self.vals)
            .arg(&t.order)
            .arg(&t.piece)
            .arg(&t.piece_slot)
            .arg(&factors.data)
            .arg(&factors.row_offset)
            .arg(&mut *out)
            .arg(&mut sums)
            .arg(&nnz)
            .arg(&nblocks)
            .arg(&bits)
            .arg(&dim)
            .arg(&mode_i);
        // SAFETY: the grid has one block per piece (pieces holds 4 words and
        // piece_slot one per piece); piece positions lie in 0..nblocks of
        // `order`, a permutation of the block ids, and piece nonzero ranges
        // inside their blocks' block_ptr ranges (Schedule::new), so offsets
        // (nmodes x nnz) and vals (nnz) are read in bounds, block_coords
        // (nmodes x nblocks) and block_ptr (nblocks + 1) too. A nonzero's
        // index (coord << bits) + offset is below its mode's dimension
        // (Hicoo checks it), and the factors' dims match (checked above), so
        // factor rows lie in `data` and output rows (< dim, guarded) in
        // `out`. Offsets are below 2^bits, the shared rows (dynamic shared
        // memory of 2^bits x TILE doubles, allowed above when past the default limit);
        // slots are below `slots`, and `sums` holds slots x 2^bits x rank
        // doubles.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (pieces, tiles, 1),
                block_dim: (32, WARPS, 1),
                shared_mem_bytes: shared as u32,
            })
        }
        .map_err(driver("launching mttkrp_hicoo"))?;

        if len > 0 {
            let n_sums = len as u64;
            let mut launch = stream.launch_builder(&store);
            launch
                .arg(&mut sums)
                .arg(&t.slot_rows)
                .arg(&mut *out)
                .arg(&bits)
                .arg(&dim)
                .arg(&n_sums);
            // SAFETY: sums holds slots x 2^bits x rank doubles and slot_rows
            // one row per slot; rows at or past dim are skipped, so every
            // write lies inside `out` (dim x rank).
            unsafe { launch.launch(grid_stride(n_sums, 256)) }
                .map_err(driver("launching hicoo_store_split"))?;
        }
        Ok(())
    }
}

forward_gpu_mttkrp!(HicooGpu, "hicoo");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GpuMttkrp;
    use crate::testutil::{check_engine, factors, hot_tensors, model_error};
    use kruskal_cpu::mttkrp_reference;
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use ndarray::Array2;
    use proptest::prelude::*;

    /// Every invariant the kernel relies on.
    fn check_schedule(h: &Hicoo, mode: usize, split_nnz: usize) -> Schedule {
        let s = Schedule::new(h, mode, split_nnz);
        let coords = &h.block_coords()[mode];
        let b = h.block_bits();
        // `order` is a permutation of the blocks, sorted by coordinate.
        let mut sorted = s.order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..h.nblocks() as u32).collect::<Vec<_>>());
        assert!(
            s.order
                .windows(2)
                .all(|w| coords[w[0] as usize] <= coords[w[1] as usize])
        );
        // Every nonzero in exactly one piece; pieces of one group only.
        let mut hits = vec![0u8; h.nnz()];
        let mut slot_pieces = vec![0usize; s.slots()];
        assert_eq!(s.pieces.len(), 4 * s.piece_count());
        for (p, w) in s.pieces.chunks(4).enumerate() {
            let [pos_lo, pos_hi, nz_lo, nz_hi] = [w[0], w[1], w[2], w[3]].map(|x| x as usize);
            assert!(pos_lo < pos_hi && pos_hi <= h.nblocks(), "piece {p}");
            let coord = coords[s.order[pos_lo] as usize];
            let mut count = 0;
            for pos in pos_lo..pos_hi {
                let k = s.order[pos] as usize;
                assert_eq!(coords[k], coord, "piece {p} spans groups");
                let range = h.block_range(k);
                let lo = if pos == pos_lo { nz_lo } else { range.start };
                let hi = if pos + 1 == pos_hi { nz_hi } else { range.end };
                assert!(range.start <= lo && lo < hi && hi <= range.end, "piece {p}");
                hits[lo..hi].iter_mut().for_each(|x| *x += 1);
                count += hi - lo;
            }
            let slot = s.piece_slot[p];
            if slot == NONE {
                assert!(count <= split_nnz.max(1), "piece {p}: {count}");
            } else {
                assert_eq!(s.slot_rows[slot as usize], coord << b);
                slot_pieces[slot as usize] += 1;
                // Pieces of a split group are about equal.
                assert!(count <= split_nnz.max(1) + 1, "piece {p}: {count}");
            }
        }
        assert!(hits.iter().all(|&x| x == 1));
        assert!(slot_pieces.iter().all(|&n| n > 1));
        s
    }

    #[test]
    fn schedule_splits_hot_groups_only() {
        let mut spec = PowerLawSpec::new(vec![300, 200, 100], 30_000).with_draws();
        spec.exponents = vec![1.3; 3];
        let t = power_law(&spec).unwrap();
        let h = Hicoo::new(&t, 4).unwrap();
        for mode in 0..3 {
            let s = check_schedule(&h, mode, 1000);
            assert!(s.slots() > 0, "mode {mode}: the hot group is split");
            let unsplit = check_schedule(&h, mode, usize::MAX);
            assert_eq!(unsplit.slots(), 0);
        }
        assert_eq!(
            HicooGpu::device_bytes(&h, 1000),
            h.bytes()
                + (0..3)
                    .map(|m| Schedule::new(&h, m, 1000).bytes())
                    .sum::<usize>()
        );
    }

    #[test]
    fn empty_tensor_has_an_empty_schedule() {
        let t = SparseTensor::new(vec![3, 4, 5], vec![vec![], vec![], vec![]], vec![]).unwrap();
        let h = Hicoo::new(&t, 7).unwrap();
        let s = Schedule::new(&h, 1, 10);
        assert_eq!((s.piece_count(), s.slots(), s.bytes()), (0, 0, 0));
    }

    #[test]
    fn tiles_and_shared_memory() {
        assert_eq!(column_tile(1), 1);
        assert_eq!(column_tile(100), 32);
        assert_eq!(shared_bytes(7, 32), 32 * 1024);
        assert_eq!(shared_bytes(8, 100), 64 * 1024);
        assert_eq!(default_split_nnz(10), 1024);
        assert_eq!(default_split_nnz(20_000_000), 4882);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn schedule_covers_every_nonzero(
            nmodes in 3usize..=5,
            nnz in 0usize..4_000,
            exponent in 0.0f64..1.6,
            bits in 1u8..=8,
            split in prop_oneof![Just(1usize), 2usize..50, Just(usize::MAX)],
            seed in any::<u64>(),
        ) {
            let dims: Vec<u32> = (0..nmodes).map(|m| 20 + 97 * m as u32).collect();
            // The generator refuses a count of 0; an empty tensor of the
            // same shape stands in for it.
            let mut spec = PowerLawSpec::new(dims.clone(), nnz.max(1)).with_draws().with_seed(seed);
            spec.exponents = vec![exponent; nmodes];
            let mut t = power_law(&spec).unwrap();
            if nnz == 0 {
                t = SparseTensor::new(dims, vec![vec![]; nmodes], vec![]).unwrap();
            }
            let h = Hicoo::new(&t, bits).unwrap();
            for mode in 0..nmodes {
                check_schedule(&h, mode, split);
            }
        }
    }

    /// `mttkrp_hicoo` and `hicoo_store_split` step by step on the CPU (a
    /// warp's lanes become a loop over all columns; warps run one after
    /// the other, which only reorders the f64 shared atomics): checks the
    /// schedule and the kernel's chunk dealing and runs without a GPU. Rows
    /// the model never writes stay NaN, where the engine's memset leaves 0.
    fn model(h: &Hicoo, split_nnz: usize, factors: &[Array2<f32>], mode: usize) -> Array2<f32> {
        let rank = factors[0].ncols();
        let warps = WARPS as usize;
        let s = Schedule::new(h, mode, split_nnz);
        let b = h.block_bits();
        let rows = 1usize << b;
        let dim = h.dims()[mode] as usize;
        let bp = h.block_ptr();
        let mut out = Array2::from_elem((dim, rank), f32::NAN);
        let mut split_sums = vec![0f64; (s.slots() << b) * rank];
        for (p, piece) in s.pieces.chunks(4).enumerate() {
            let [pos_lo, pos_hi, nz_lo, nz_hi] = [0, 1, 2, 3].map(|i| piece[i] as usize);
            let mut acc = vec![0f64; rows * rank];
            for warp in 0..warps {
                let mut run_row = NONE;
                let mut run = vec![0f64; rank];
                let mut chunk_base = 0;
                for pos in pos_lo..pos_hi {
                    let blk = s.order[pos] as usize;
                    let lo = if pos == pos_lo {
                        nz_lo
                    } else {
                        bp[blk] as usize
                    };
                    let hi = if pos + 1 == pos_hi {
                        nz_hi
                    } else {
                        bp[blk + 1] as usize
                    };
                    let chunks = (hi - lo).div_ceil(32);
                    let first = (warp + warps - chunk_base % warps) % warps;
                    chunk_base += chunks;
                    for c in (first..chunks).step_by(warps) {
                        for k in lo + 32 * c..hi.min(lo + 32 * c + 32) {
                            let mut o = 0;
                            let mut prod = vec![h.values()[k]; rank];
                            for (w, factor) in factors.iter().enumerate() {
                                let off = u32::from(h.offsets()[w][k]);
                                if w == mode {
                                    o = off;
                                    continue;
                                }
                                let i = ((h.block_coords()[w][blk] << b) + off) as usize;
                                for (r, x) in prod.iter_mut().enumerate() {
                                    *x *= factor[[i, r]];
                                }
                            }
                            if o != run_row {
                                if run_row != NONE {
                                    let a = &mut acc[run_row as usize * rank..][..rank];
                                    a.iter_mut().zip(&run).for_each(|(a, x)| *a += x);
                                }
                                run_row = o;
                                run.fill(0.0);
                            }
                            run.iter_mut()
                                .zip(&prod)
                                .for_each(|(a, &x)| *a += f64::from(x));
                        }
                    }
                }
                if run_row != NONE {
                    let a = &mut acc[run_row as usize * rank..][..rank];
                    a.iter_mut().zip(&run).for_each(|(a, x)| *a += x);
                }
            }
            let slot = s.piece_slot[p];
            let first_row = (h.block_coords()[mode][s.order[pos_lo] as usize] as usize) << b;
            for r in 0..rows {
                if first_row + r >= dim {
                    continue;
                }
                for c in 0..rank {
                    let a = acc[r * rank + c];
                    if slot == NONE {
                        out[[first_row + r, c]] = a as f32;
                    } else if a != 0.0 {
                        split_sums[(((slot as usize) << b) + r) * rank + c] += a;
                    }
                }
            }
        }
        for (e, &x) in split_sums.iter().enumerate() {
            let row = s.slot_rows[e / (rank << b)] as usize + (e / rank) % rows;
            if row < dim {
                out[[row, e % rank]] = x as f32;
            }
        }
        out
    }

    #[test]
    fn kernel_model_equals_the_f64_reference() {
        let mut spec = PowerLawSpec::new(vec![300, 90, 60], 20_000).with_draws();
        spec.exponents = vec![1.3; 3];
        let hot = power_law(&spec).unwrap();
        let mut spec = PowerLawSpec::new(vec![400, 30, 50, 20], 6_000)
            .with_draws()
            .with_seed(5);
        spec.exponents = vec![0.7; 4];
        let cold = power_law(&spec).unwrap();
        for t in [&hot, &cold] {
            for (bits, split) in [(2, 100), (4, 1000), (7, usize::MAX), (8, 50)] {
                let h = Hicoo::new(t, bits).unwrap();
                for rank in [1, 3] {
                    let fs = factors(t.dims(), rank, 7);
                    let views: Vec<_> = fs.iter().map(|a| a.view()).collect();
                    for mode in 0..t.nmodes() {
                        let out = model(&h, split, &fs, mode);
                        let exact = mttkrp_reference(t, &views, mode).unwrap();
                        let err = model_error(out, &exact);
                        assert!(
                            err < 1e-6,
                            "bits {bits} split {split} rank {rank} mode {mode}: {err}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn hicoo_equals_the_f64_reference() {
        let Some(gpu) = crate::testing::gpu_or_skip("hicoo_equals_the_f64_reference") else {
            return;
        };
        for t in hot_tensors(137) {
            let mut engine = HicooGpu::new(gpu.clone(), &t, Hicoo::DEFAULT_BLOCK_BITS).unwrap();
            for rank in [1, 7, 16, 32, 64, 100] {
                check_engine(&mut engine, &t, rank, &format!("{} modes", t.nmodes()));
            }
        }
    }

    #[test]
    fn hicoo_block_bits_splits_and_edge_cases() {
        let Some(gpu) = crate::testing::gpu_or_skip("hicoo_block_bits_splits_and_edge_cases")
        else {
            return;
        };
        let tensors = hot_tensors(137);
        for bits in 1..=8u8 {
            for t in &tensors[..2] {
                let h = Hicoo::new(t, bits).unwrap();
                for split in [64, usize::MAX] {
                    let mut engine = HicooGpu::from_hicoo(gpu.clone(), &h, split).unwrap();
                    for rank in [7, 32, 40] {
                        check_engine(&mut engine, t, rank, &format!("bits {bits} split {split}"));
                    }
                }
            }
        }
        // Empty rows, one- and two-mode tensors, and an empty tensor:
        // unwritten rows must come back 0, not NaN.
        let t = SparseTensor::new(
            vec![600, 2, 2],
            vec![vec![4, 4, 300], vec![0, 1, 1], vec![1, 1, 0]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap();
        check_engine(
            &mut HicooGpu::new(gpu.clone(), &t, 2).unwrap(),
            &t,
            3,
            "small",
        );
        let t =
            SparseTensor::new(vec![7], vec![vec![3, 1, 3, 6]], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        check_engine(
            &mut HicooGpu::new(gpu.clone(), &t, 1).unwrap(),
            &t,
            5,
            "one mode",
        );
        let mut spec = PowerLawSpec::new(vec![90, 70], 5_000).with_draws();
        spec.exponents = vec![1.3; 2];
        let t = power_law(&spec).unwrap();
        check_engine(
            &mut HicooGpu::new(gpu.clone(), &t, 3).unwrap(),
            &t,
            33,
            "two modes",
        );
        let t = SparseTensor::new(vec![3, 2, 4], vec![vec![], vec![], vec![]], vec![]).unwrap();
        let mut engine = HicooGpu::new(gpu.clone(), &t, 7).unwrap();
        let f = factors(t.dims(), 4, 1);
        let mut out = Array2::from_elem((2, 4), f32::NAN);
        engine.mttkrp_host(1, &f, &mut out).unwrap();
        assert!(out.iter().all(|&x| x == 0.0));
        assert!(matches!(
            HicooGpu::new(gpu, &t, 9),
            Err(DeviceError::Prepare { .. })
        ));
    }
}
