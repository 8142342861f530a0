//! MTTKRP on FLYCOO following its GPU algorithm (FLYCOO-GPU, section 4).
//!
//! The engine keeps two copies of the FLYCOO elements; the current one is
//! in the layout of the mode about to be computed. For mode `d` every
//! partition is one rayon task (a thread block on the GPU):
//!
//! - it walks its elements, which are sorted by the mode-`d` index, and sums
//!   `val * prod_{w != d} Y_w(i_w, :)` per output row (f32 products, f64
//!   sums);
//! - a row held by this partition alone is written directly: no other task
//!   touches it (FLYCOO-GPU Observation 2);
//! - a row split across partitions (a [`SharedPiece`]) is returned as a
//!   partial, and partials are added per row in a fixed order afterwards:
//!   the CPU form of the GPU's deterministic scratch buffer;
//! - every element is written to the other copy at its remap id for mode
//!   `d + 1` (the dynamic remap, Observation 1: remap ids of a mode are a
//!   permutation, so writes never collide).
//!
//! Then the copies swap. Asked for a mode other than the one the current
//! copy is laid out for, the engine first moves every element to its remap
//! id of that mode (one scatter, no compute).

use std::sync::atomic::{AtomicU32, Ordering};

use kruskal_formats::flycoo::{Flycoo, FlycooMode, SharedPiece};
use kruskal_formats::{FormatError, SparseTensor};
use kruskal_partition::flycoo::{LayoutSummary, build_flycoo};
use kruskal_partition::layout::LayoutOptions;
use ndarray::Array2;
use rayon::prelude::*;

use crate::{CpuError, Result, mttkrp_slices, row_of};

/// The FLYCOO engine. See the module documentation.
#[derive(Debug)]
pub struct FlycooMttkrp {
    dims: Vec<u32>,
    nnz: usize,
    modes: Vec<FlycooMode>,
    /// `pieces[d][p]`: (start position, index into `modes[d].shared`) of the
    /// shared pieces of partition `p`, by start.
    pieces: Vec<Vec<Vec<(u64, usize)>>>,
    copies: [Vec<AtomicU32>; 2],
    /// `copies[current]` is laid out for mode `at`.
    current: usize,
    at: usize,
    summaries: Vec<LayoutSummary>,
}

/// A partial sum of one shared piece.
struct Partial {
    piece: usize,
    sums: Vec<f64>,
}

/// Where a partition task writes rows it owns. Rows are disjoint between
/// tasks by the ownership check in [`FlycooMttkrp::from_flycoo`].
struct RowWriter {
    ptr: *mut f32,
    rows: usize,
    rank: usize,
}

// SAFETY: a RowWriter is only used while the output slice it points to is
// mutably borrowed by `mttkrp`, and tasks write disjoint rows (see
// `write_row`), so sharing it between threads cannot create a data race.
unsafe impl Sync for RowWriter {}

impl RowWriter {
    /// Stores `sums` (as f32) into output row `row`.
    ///
    /// # Safety
    /// No other thread may access row `row` during the call.
    unsafe fn write_row(&self, row: usize, sums: &[f64]) {
        assert!(
            row < self.rows && sums.len() == self.rank,
            "row {row} out of range"
        );
        // SAFETY: in bounds by the assert; exclusive by the caller's contract.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(self.ptr.add(row * self.rank), self.rank) };
        for (d, &s) in dst.iter_mut().zip(sums) {
            *d = s as f32;
        }
    }
}

impl FlycooMttkrp {
    /// The partition count used when none is given: about 8K nonzeros per
    /// partition, at most 8192 partitions. It depends only on the tensor,
    /// so results do not depend on the thread count.
    pub fn default_kappa(nnz: usize) -> usize {
        nnz.div_ceil(1 << 13).clamp(1, 1 << 13)
    }

    /// Partitions `tensor` (greedy LPT, heavy rows split) and builds the
    /// engine. `kappa = None` uses [`FlycooMttkrp::default_kappa`].
    pub fn new(tensor: &SparseTensor, kappa: Option<usize>) -> Result<Self> {
        let kappa = kappa.unwrap_or_else(|| Self::default_kappa(tensor.nnz()));
        let (flycoo, summaries) = build_flycoo(tensor, &LayoutOptions::new(kappa))?;
        let mut engine = Self::from_flycoo(flycoo)?;
        engine.summaries = summaries;
        Ok(engine)
    }

    /// Builds the engine from a FLYCOO tensor, checking what the kernel
    /// relies on: inside each partition the elements are sorted by the
    /// mode's index, and a row that is not a listed shared piece lies in
    /// one partition only.
    pub fn from_flycoo(flycoo: Flycoo) -> Result<Self> {
        let n = flycoo.nmodes();
        let w = Flycoo::words_per_element(n);
        let nnz = flycoo.nnz();
        let pieces: Vec<Vec<Vec<(u64, usize)>>> = flycoo
            .modes()
            .iter()
            .map(|m| {
                let mut per_part = vec![Vec::new(); m.kappa()];
                for (k, s) in m.shared.iter().enumerate() {
                    per_part[s.part as usize].push((s.start, k));
                }
                for list in &mut per_part {
                    list.sort_unstable();
                }
                per_part
            })
            .collect();
        for (d, per_part) in pieces.iter().enumerate() {
            check_ownership(&flycoo, d, per_part)?;
        }
        let first: Vec<AtomicU32> = flycoo
            .elements()
            .par_iter()
            .map(|&x| AtomicU32::new(x))
            .collect();
        let second: Vec<AtomicU32> = (0..nnz * w)
            .into_par_iter()
            .map(|_| AtomicU32::new(0))
            .collect();
        Ok(FlycooMttkrp {
            dims: flycoo.dims().to_vec(),
            nnz,
            modes: flycoo.modes().to_vec(),
            pieces,
            copies: [first, second],
            current: 0,
            at: 0,
            summaries: Vec::new(),
        })
    }

    /// Partition statistics per mode (empty when built by `from_flycoo`).
    pub fn summaries(&self) -> &[LayoutSummary] {
        &self.summaries
    }

    /// The mode whose layout the current copy is in.
    pub fn current_mode(&self) -> usize {
        self.at
    }

    /// The current copy's elements (`2 N + 1` words each).
    pub fn current_elements(&self) -> Vec<u32> {
        self.copies[self.current]
            .par_iter()
            .map(|x| x.load(Ordering::Relaxed))
            .collect()
    }

    /// Moves every element to its position in the layout of `mode`.
    fn remap_to(&mut self, mode: usize) {
        let w = Flycoo::words_per_element(self.dims.len());
        let [a, b] = &self.copies;
        let (src, dst) = if self.current == 0 { (a, b) } else { (b, a) };
        src.par_chunks(w).for_each(|e| {
            let q = e[mode].load(Ordering::Relaxed) as usize;
            for (k, x) in e.iter().enumerate() {
                dst[q * w + k].store(x.load(Ordering::Relaxed), Ordering::Relaxed);
            }
        });
        self.current = 1 - self.current;
        self.at = mode;
    }
}

/// Checks the kernel's contract for one mode (see
/// [`FlycooMttkrp::from_flycoo`]).
fn check_ownership(f: &Flycoo, d: usize, pieces: &[Vec<(u64, usize)>]) -> Result<()> {
    let n = f.nmodes();
    let w = Flycoo::words_per_element(n);
    let row_at: Vec<AtomicU32> = (0..f.nnz())
        .into_par_iter()
        .map(|_| AtomicU32::new(0))
        .collect();
    f.elements().par_chunks(w).for_each(|e| {
        row_at[e[d] as usize].store(e[n + d], Ordering::Relaxed);
    });
    let row_at: Vec<u32> = row_at.into_par_iter().map(AtomicU32::into_inner).collect();
    let m = f.mode(d);
    let owner: Vec<AtomicU32> = (0..f.dims()[d])
        .into_par_iter()
        .map(|_| AtomicU32::new(u32::MAX))
        .collect();
    (0..m.kappa()).into_par_iter().try_for_each(|p| {
        let (lo, hi) = (m.part_ptr[p] as usize, m.part_ptr[p + 1] as usize);
        // Shared pieces of this partition, by start; each must be one whole
        // run of its row.
        let mut next_piece = pieces[p].iter().peekable();
        let mut q = lo;
        while q < hi {
            let row = row_at[q];
            let end = q + row_at[q..hi].iter().take_while(|&&r| r == row).count();
            if end < hi && row_at[end] < row {
                return Err(format!("mode {d} partition {p} is not sorted by index"));
            }
            let piece = next_piece.next_if(|&&(start, _)| start == q as u64);
            if let Some(&(_, k)) = piece {
                let s: &SharedPiece = &m.shared[k];
                if s.row != row || s.len != (end - q) as u64 {
                    return Err(format!("mode {d} shared piece {s:?} is not a whole run of its row"));
                }
            } else {
                let prev = owner[row as usize]
                    .compare_exchange(u32::MAX, p as u32, Ordering::Relaxed, Ordering::Relaxed);
                if let Err(other) = prev {
                    return Err(format!(
                        "mode {d} row {row} is in partitions {other} and {p} but not listed as shared"
                    ));
                }
            }
            q = end;
        }
        match next_piece.next() {
            Some(&(_, k)) => Err(format!(
                "mode {d} shared piece {:?} does not start a run of its row",
                m.shared[k]
            )),
            None => Ok(()),
        }
    })
    .map_err(|m| CpuError::Format(FormatError::Invalid(format!("FLYCOO layout: {m}"))))
}

impl FlycooMttkrp {
    /// The dimensions of the tensor.
    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// Bytes of tensor data held: the two element copies.
    pub fn bytes(&self) -> usize {
        2 * self.copies[0].len() * 4
    }

    /// The MTTKRP of `mode` into `out` (overwritten); see
    /// [`MttkrpEngine::mttkrp`](crate::MttkrpEngine::mttkrp).
    pub fn mttkrp(
        &mut self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<()> {
        let (rank, factors, out) = mttkrp_slices(&self.dims, mode, factors, out)?;
        if self.at != mode {
            self.remap_to(mode);
        }
        out.fill(0.0);
        if self.nnz == 0 {
            return Ok(());
        }
        let n = self.dims.len();
        let writer = RowWriter {
            ptr: out.as_mut_ptr(),
            rows: self.dims[mode] as usize,
            rank,
        };
        let m = &self.modes[mode];
        let [a, b] = &self.copies;
        let (src, dst) = if self.current == 0 { (a, b) } else { (b, a) };
        let task = Task {
            n,
            mode,
            next: (mode + 1) % n,
            src,
            dst,
            factors: &factors,
            writer: &writer,
        };
        let partials: Vec<Vec<Partial>> = (0..m.kappa())
            .into_par_iter()
            .map(|p| {
                let range = m.part_ptr[p] as usize..m.part_ptr[p + 1] as usize;
                let pieces = &self.pieces[mode][p];
                by_rank!(
                    rank,
                    run_partition_fixed(&task, range, pieces),
                    run_partition_any(&task, range, pieces, rank)
                )
            })
            .collect();

        // Pieces of each split row, summed in the order of the shared list.
        let mut by_piece: Vec<Option<Vec<f64>>> = vec![None; m.shared.len()];
        for p in partials.into_iter().flatten() {
            by_piece[p.piece] = Some(p.sums);
        }
        let mut k = 0;
        while k < m.shared.len() {
            let row = m.shared[k].row;
            let mut sums = vec![0f64; rank];
            while k < m.shared.len() && m.shared[k].row == row {
                let part = by_piece[k]
                    .as_ref()
                    .expect("every piece's partition reports it");
                sums.iter_mut().zip(part).for_each(|(s, x)| *s += x);
                k += 1;
            }
            // SAFETY: the parallel tasks have finished; this thread alone
            // writes now.
            unsafe { writer.write_row(row as usize, &sums) };
        }
        self.current = 1 - self.current;
        self.at = task.next;
        Ok(())
    }
}

forward_engine!(FlycooMttkrp, "flycoo");

/// What every partition task of one MTTKRP shares.
struct Task<'a> {
    n: usize,
    mode: usize,
    next: usize,
    src: &'a [AtomicU32],
    dst: &'a [AtomicU32],
    factors: &'a [&'a [f32]],
    writer: &'a RowWriter,
}

impl Task<'_> {
    #[inline(always)]
    fn word(&self, q: usize, k: usize) -> u32 {
        self.src[q * (2 * self.n + 1) + k].load(Ordering::Relaxed)
    }

    /// Writes element `q` of the current copy to its next-mode position.
    #[inline(always)]
    fn remap(&self, q: usize) {
        let w = 2 * self.n + 1;
        let e = &self.src[q * w..(q + 1) * w];
        let to = e[self.next].load(Ordering::Relaxed) as usize;
        for (k, x) in e.iter().enumerate() {
            self.dst[to * w + k].store(x.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    /// Walks one partition: `sum_element(q, acc)` adds element `q` into the
    /// row accumulator; finished rows are written or returned as partials.
    #[inline(always)]
    fn walk(
        &self,
        range: std::ops::Range<usize>,
        pieces: &[(u64, usize)],
        acc: &mut [f64],
        mut sum_element: impl FnMut(usize, &mut [f64]),
    ) -> Vec<Partial> {
        let mut partials = Vec::new();
        let mut next_piece = pieces.iter().peekable();
        let mut q = range.start;
        while q < range.end {
            let row = self.word(q, self.n + self.mode);
            let start = q;
            acc.fill(0.0);
            while q < range.end && self.word(q, self.n + self.mode) == row {
                sum_element(q, acc);
                self.remap(q);
                q += 1;
            }
            match next_piece.peek() {
                Some(&&(s, piece)) if s == start as u64 => {
                    next_piece.next();
                    partials.push(Partial {
                        piece,
                        sums: acc.to_vec(),
                    });
                }
                // SAFETY: a row not listed as shared belongs to this
                // partition only (checked in `from_flycoo`), and a
                // partition's rows are contiguous runs, so no other task
                // writes this row.
                _ => unsafe { self.writer.write_row(row as usize, acc) },
            }
        }
        partials
    }
}

/// One partition for a rank known at compile time.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn run_partition_fixed<const R: usize>(
    task: &Task<'_>,
    range: std::ops::Range<usize>,
    pieces: &[(u64, usize)],
) -> Vec<Partial> {
    let n = task.n;
    let mut acc = [0f64; R];
    task.walk(range, pieces, &mut acc, |q, sum| {
        let mut prod = [f32::from_bits(task.word(q, 2 * n)); R];
        for w in (0..n).filter(|&w| w != task.mode) {
            let y = row_of::<R>(task.factors[w], task.word(q, n + w));
            for r in 0..R {
                prod[r] *= y[r];
            }
        }
        for r in 0..R {
            sum[r] += f64::from(prod[r]);
        }
    })
}

/// One partition for any rank.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn run_partition_any(
    task: &Task<'_>,
    range: std::ops::Range<usize>,
    pieces: &[(u64, usize)],
    rank: usize,
) -> Vec<Partial> {
    let n = task.n;
    let mut acc = vec![0f64; rank];
    let mut prod = vec![0f32; rank];
    task.walk(range, pieces, &mut acc, |q, sum| {
        prod.fill(f32::from_bits(task.word(q, 2 * n)));
        for w in (0..n).filter(|&w| w != task.mode) {
            let i = task.word(q, n + w) as usize;
            for (p, &y) in prod
                .iter_mut()
                .zip(&task.factors[w][i * rank..(i + 1) * rank])
            {
                *p *= y;
            }
        }
        for (s, &p) in sum.iter_mut().zip(prod.iter()) {
            *s += f64::from(p);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_engine, factors_for, shared_tensors};
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    fn tensor(dims: Vec<u32>, nnz: usize, exponent: f64, seed: u64) -> SparseTensor {
        let nmodes = dims.len();
        let mut spec = PowerLawSpec::new(dims, nnz).with_draws().with_seed(seed);
        spec.exponents = vec![exponent; nmodes];
        power_law(&spec).unwrap()
    }

    #[test]
    fn cycles_through_modes_and_returns_to_the_original_order() {
        let t = tensor(vec![120, 90, 60, 30], 20_000, 1.4, 5);
        let mut e = FlycooMttkrp::new(&t, Some(24)).unwrap();
        assert!(
            e.summaries().iter().any(|s| s.shared_pieces > 0),
            "no split rows"
        );
        let original = e.current_elements();
        // Two full CPD-like sweeps in mode order.
        check_engine(&t, &mut e, 16, &[0, 1, 2, 3, 0, 1, 2, 3], 1e-6);
        assert_eq!(e.current_mode(), 0);
        assert_eq!(e.current_elements(), original);
        // Out of order: the engine remaps first.
        check_engine(&t, &mut e, 5, &[2, 0, 3, 3, 1], 1e-6);
    }

    #[test]
    fn equals_reference_on_shared_tensors() {
        let tensors = shared_tensors();
        for (_, t) in &tensors {
            let modes: Vec<usize> = (0..t.nmodes()).collect();
            let mut e = FlycooMttkrp::new(t, Some(13)).unwrap();
            check_engine(t, &mut e, 16, &modes, 1e-6);
        }
    }

    #[test]
    fn result_does_not_depend_on_thread_count() {
        let t = tensor(vec![300, 200, 100], 30_000, 1.3, 2);
        let factors = factors_for(t.dims(), 32, 3);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut e = FlycooMttkrp::new(&t, Some(40)).unwrap();
                let mut out = Array2::zeros((300, 32));
                e.mttkrp(0, &factors, &mut out).unwrap();
                out
            })
        };
        assert_eq!(run(1), run(3));
    }

    #[test]
    fn refuses_a_layout_that_breaks_ownership() {
        let t = SparseTensor::new(
            vec![2, 2, 2],
            vec![vec![0, 1, 0], vec![0, 1, 1], vec![1, 0, 0]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap();
        // Mode 0 split as [nonzero 0], [1, 2]: row 0 in both partitions,
        // not listed as shared.
        let p0 = [0u32, 1, 2];
        let one = |nnz| FlycooMode {
            part_ptr: vec![0, nnz],
            shared: Vec::new(),
        };
        let modes = vec![
            FlycooMode {
                part_ptr: vec![0, 1, 3],
                shared: Vec::new(),
            },
            one(3),
            one(3),
        ];
        let f = Flycoo::from_layouts(&t, &[&p0, &[0, 2, 1], &[2, 0, 1]], modes).unwrap();
        let err = FlycooMttkrp::from_flycoo(f).unwrap_err();
        assert!(
            err.to_string().contains("not sorted") || err.to_string().contains("row 0"),
            "{err}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn equals_reference_on_random_tensors(
            nmodes in 3usize..=6,
            seed in any::<u64>(),
            nnz in 1usize..3_000,
            rank in prop_oneof![1usize..40, Just(64usize)],
            kappa in 1usize..50,
            exponent in 0.0f64..1.7,
        ) {
            let dims: Vec<u32> = (0..nmodes).map(|m| 1 + ((seed >> (m * 8)) % 60) as u32).collect();
            let t = tensor(dims, nnz, exponent, seed);
            let mut e = FlycooMttkrp::new(&t, Some(kappa)).unwrap();
            let modes: Vec<usize> = (0..nmodes).chain(0..nmodes).collect();
            check_engine(&t, &mut e, rank, &modes, 1e-6);
        }
    }
}
