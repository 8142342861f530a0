//! Whole output rows per GPU, relabeled so that each GPU's rows are one
//! contiguous range: the multi-GPU plan of `kruskal-device`'s group.
//!
//! For each mode, the output rows go to GPUs by greedy LPT on their nonzero
//! counts (AMPED's tensor sharding): every nonzero of a row lands on one
//! GPU, so no two GPUs write the same output row. The rows are then given
//! new labels, GPU by GPU (inside a GPU the rows holding nonzeros first,
//! then the empty ones, each in their old order), so that GPU `g` owns rows
//! `rows(mode, g)` of the relabeled factor, and its rows with nonzeros are
//! the first [`RowShards::rows_with_nonzeros`] of them: an empty row's
//! MTTKRP output is zero, so after its first update its factor row is zero
//! for good, and the update can skip it. That turns the
//! exchange after each mode into an all-gather of contiguous blocks, and
//! the per-GPU factor update into a dense update of one slice.
//!
//! Rows are never split across GPUs. A row holding more than `1/gpus` of a
//! mode's nonzeros therefore caps the balance; [`RowShards::balance`]
//! reports it. (A Zipf(1.1) tensor's hottest row holds about 15%, so this
//! matters only beyond 6 GPUs.)
//!
//! The elements of a mode (see [`RowShards::fill_elements`]) are the
//! relabeled indices of every mode and the value's bits, `nmodes + 1`
//! words per nonzero, sorted by the mode's relabeled index, so GPU `g`'s
//! shard is one contiguous range and equal rows are adjacent.
//!
//! A process that holds only its own shards never builds the whole
//! tensor: it makes the plan from per-row nonzero counts
//! ([`RowShards::from_counts`], the counts summed over every process's
//! range of the file) and picks its GPU's elements out of the file's
//! arrays ([`RowShards::local_elements`]), in memory proportional to its
//! own elements.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use kruskal_formats::SparseTensor;
use rayon::prelude::*;

use crate::lpt::{Balance, lpt};
use crate::{PartitionError, Result};

/// Nonzeros per rayon task when scattering elements.
const SCATTER_CHUNK: usize = 1 << 16;

/// How far above the mean load [`RowShards::prefer_readers`] lets a GPU's
/// nonzeros of a mode grow to give a row to a GPU that reads it.
pub const PREFER_SLACK: f64 = 0.01;

/// The row plan of every mode over `gpus` GPUs.
#[derive(Clone, Debug)]
pub struct RowShards {
    gpus: usize,
    dims: Vec<u32>,
    /// Per mode, the new label of each old row index.
    relabel: Vec<Vec<u32>>,
    /// Per mode, `gpus + 1` boundaries of the GPUs' row ranges (new labels).
    row_ptr: Vec<Vec<u32>>,
    /// Per mode, the nonzeros of each GPU.
    loads: Vec<Vec<u64>>,
    /// Per mode, nonzeros per new row label.
    counts: Vec<Vec<u64>>,
    /// Per mode, each GPU's rows that hold nonzeros (the first of its
    /// range).
    nonempty: Vec<Vec<u32>>,
    /// The mode whose owners take every mode's nonzeros (a split plan,
    /// [`RowShards::split_by`]); `None`: each mode's own owners.
    split: Option<usize>,
}

impl RowShards {
    /// Plans every mode of `t` over `gpus` GPUs.
    ///
    /// Cost: counting the nonzeros per row of every mode (one parallel
    /// pass per mode), then [`RowShards::from_counts`].
    pub fn new(t: &SparseTensor, gpus: usize) -> Result<Self> {
        let counts = (0..t.nmodes()).map(|mode| t.mode_counts(mode)).collect();
        Self::from_counts(t.dims(), counts, gpus)
    }

    /// Plans every mode over `gpus` GPUs from the nonzeros per row of each
    /// mode (`counts[mode][row]`, original row indices, `dims[mode]` rows),
    /// as a process that holds only part of the tensor knows them (summed
    /// over every process's range). [`RowShards::new`] is this applied to
    /// the tensor's own counts, so both give the same plan.
    ///
    /// Errors: no GPU, no mode, a count list whose length is not its
    /// dimension, or modes whose counts add up to different nonzero totals.
    ///
    /// Cost: greedy LPT per mode, `O(dims[mode] log dims[mode])`, the modes
    /// at once.
    pub fn from_counts(dims: &[u32], counts: Vec<Vec<u64>>, gpus: usize) -> Result<Self> {
        if gpus == 0 {
            return Err(PartitionError::Argument(
                "a row plan needs at least one GPU".into(),
            ));
        }
        if dims.is_empty() || counts.len() != dims.len() {
            return Err(PartitionError::Argument(format!(
                "{} modes of counts for dims {dims:?}",
                counts.len()
            )));
        }
        let mut total = None;
        for (mode, (c, &dim)) in counts.iter().zip(dims).enumerate() {
            if c.len() != dim as usize {
                return Err(PartitionError::Argument(format!(
                    "{} row counts for mode {mode} of dimension {dim}",
                    c.len()
                )));
            }
            let sum: u64 = c.iter().sum();
            match total {
                None => total = Some(sum),
                Some(t) if t != sum => {
                    return Err(PartitionError::Argument(format!(
                        "the row counts of mode {mode} add up to {sum} nonzeros, \
                         those of mode 0 to {t}"
                    )));
                }
                Some(_) => {}
            }
        }
        let n = dims.len();
        let mut relabel = Vec::with_capacity(n);
        let mut row_ptr = Vec::with_capacity(n);
        let mut loads = Vec::with_capacity(n);
        let mut new_counts_all = Vec::with_capacity(n);
        let mut nonempty_all = Vec::with_capacity(n);
        // The modes at once: each one's LPT walks its rows one by one.
        let planned: Vec<(crate::lpt::Assignment, Labels)> = counts
            .into_par_iter()
            .map(|old_counts| {
                let assignment = assign_rows(&old_counts, gpus);
                let l = Labels::of(&old_counts, &assignment.part_of, gpus);
                (assignment, l)
            })
            .collect();
        for (assignment, l) in planned {
            nonempty_all.push(l.nonempty);
            relabel.push(l.labels);
            row_ptr.push(l.ptr);
            loads.push(assignment.loads);
            new_counts_all.push(l.counts);
        }
        Ok(RowShards {
            gpus,
            dims: dims.to_vec(),
            relabel,
            row_ptr,
            loads,
            counts: new_counts_all,
            nonempty: nonempty_all,
            split: None,
        })
    }

    /// Makes this a split plan: GPU `g`'s shard of *every* mode holds the
    /// nonzeros whose `mode` row it owns (a grid of `1 x .. x gpus` blocks
    /// with `mode` cut, SPLATT's medium-grained decomposition with one
    /// mode split). `mode`'s rows are then read by their owner alone, so
    /// they never travel; the output rows of every other mode are written
    /// by several GPUs ([`RowShards::partial`]) and summed onto their owner
    /// before its update. The row ownership of every mode is unchanged.
    ///
    /// Errors: a mode out of range. [`RowShards::prefer_readers`] may run
    /// before (on a rows plan's owners) or after (on the partial modes).
    pub fn split_by(&mut self, mode: usize) -> Result<()> {
        if mode >= self.dims.len() {
            return Err(PartitionError::Argument(format!(
                "mode {mode} of a plan of {} modes",
                self.dims.len()
            )));
        }
        self.split = Some(mode);
        Ok(())
    }

    /// The mode a split plan cuts (see [`RowShards::split_by`]).
    pub fn split(&self) -> Option<usize> {
        self.split
    }

    /// Whether several GPUs write rows of `mode`'s MTTKRP output (a split
    /// plan's modes other than the one cut): each GPU computes a partial
    /// sum over the whole mode, to be reduced onto the rows' owners.
    pub fn partial(&self, mode: usize) -> bool {
        self.split.is_some_and(|s| s != mode)
    }

    /// The mode whose owners decide which GPU's shard of `mode` holds a
    /// nonzero: `mode` itself, or the mode a split plan cuts.
    pub fn shard_mode(&self, mode: usize) -> usize {
        self.split.unwrap_or(mode)
    }

    /// Gives each row of `mode` to a GPU that reads it where that keeps
    /// the balance: only the GPUs that read a row receive it in a sparse
    /// exchange (and, in a split plan, send their partial sums of it to its
    /// owner), so owned by one of them the row travels to one GPU fewer
    /// each way. Who reads a row: in a rows plan, the GPUs whose shards of
    /// the other modes hold one of its nonzeros (the other modes' owners);
    /// in a split plan, where `mode` is partial, the owners of its
    /// nonzeros' rows of the cut mode (every shard of a nonzero lies
    /// there). Rows go largest first (as LPT) to their least loaded reader
    /// while its load stays within [`PREFER_SLACK`] of the mean (or of the
    /// plan's largest load, if that is larger), else to the least loaded
    /// GPU; empty rows are dealt out as before. The load is the owner's
    /// nonzeros of the mode in a rows plan (its MTTKRP), its rows with
    /// nonzeros in a split plan (its update; the MTTKRP follows the cut
    /// mode). Only worth it for a mode whose rows are read by few GPUs.
    ///
    /// Errors: a tensor of other dimensions, a mode out of range, or a
    /// split plan's cut mode (read by its owners alone).
    ///
    /// Cost: one parallel pass over the nonzeros, then a sort of the rows.
    pub fn prefer_readers(&mut self, t: &SparseTensor, mode: usize) -> Result<()> {
        let n = self.dims.len();
        if t.dims() != self.dims.as_slice() || mode >= n {
            return Err(PartitionError::Argument(format!(
                "a tensor of dims {:?} (mode {mode}) for a plan of dims {:?}",
                t.dims(),
                self.dims
            )));
        }
        if self.split == Some(mode) {
            return Err(PartitionError::Argument(format!(
                "mode {mode} is the split plan's cut mode: its rows are read by their owners alone"
            )));
        }
        let gpus = self.gpus;
        if gpus == 1 || gpus > 32 {
            return Ok(());
        }
        // The modes whose owners read a nonzero's row of `mode`.
        let reading: Vec<usize> = match self.split {
            Some(cut) => vec![cut],
            None => (0..n).filter(|&m| m != mode).collect(),
        };
        // The GPU of every old row of the reading modes.
        let part_of: Vec<Vec<u8>> = (0..n)
            .map(|m| {
                if !reading.contains(&m) {
                    return Vec::new();
                }
                let ptr = &self.row_ptr[m];
                self.relabel[m]
                    .par_iter()
                    .map(|&label| (ptr.partition_point(|&p| p <= label) - 1) as u8)
                    .collect()
            })
            .collect();
        // Readers of every row of `mode`.
        let masks: Vec<AtomicU64> = (0..self.dims[mode])
            .into_par_iter()
            .map(|_| AtomicU64::new(0))
            .collect();
        let indices = t.indices();
        (0..t.nnz())
            .into_par_iter()
            .with_min_len(SCATTER_CHUNK)
            .for_each(|k| {
                let mut bits = 0u64;
                for &m in &reading {
                    bits |= 1 << part_of[m][indices[m][k] as usize];
                }
                let slot = &masks[indices[mode][k] as usize];
                if slot.load(Ordering::Relaxed) & bits != bits {
                    slot.fetch_or(bits, Ordering::Relaxed);
                }
            });
        // Old counts of the mode, and LPT with preferences.
        let old_counts: Vec<u64> = self.relabel[mode]
            .par_iter()
            .map(|&label| self.counts[mode][label as usize])
            .collect();
        let mut order: Vec<u32> = (0..self.dims[mode])
            .filter(|&i| old_counts[i as usize] > 0)
            .collect();
        // What a row weighs, and the plan's largest load now.
        let split = self.split.is_some();
        let weight = |c: u64| if split { 1 } else { c };
        let (total, now_max) = if split {
            let rows = self.nonempty[mode].iter().copied();
            (order.len() as u64, rows.max().unwrap_or(0) as u64)
        } else {
            let loads = self.loads[mode].iter().copied();
            (old_counts.iter().sum(), loads.max().unwrap_or(0))
        };
        let mean = total as f64 / gpus as f64;
        let cap = (mean * (1.0 + PREFER_SLACK)).max(now_max as f64);
        order.par_sort_unstable_by_key(|&i| (std::cmp::Reverse(old_counts[i as usize]), i));
        let mut loads = vec![0u64; gpus];
        let mut nonzeros = vec![0u64; gpus];
        let mut new_part = vec![0u32; self.dims[mode] as usize];
        for &row in &order {
            let c = old_counts[row as usize];
            let w = weight(c);
            let readers = masks[row as usize].load(Ordering::Relaxed);
            let least = |allowed: u64| -> Option<usize> {
                (0..gpus)
                    .filter(|&g| allowed >> g & 1 == 1)
                    .min_by_key(|&g| (loads[g], g))
            };
            let g = match least(readers) {
                Some(g) if (loads[g] + w) as f64 <= cap => g,
                _ => least(u64::MAX).expect("at least one GPU"),
            };
            loads[g] += w;
            nonzeros[g] += c;
            new_part[row as usize] = g as u32;
        }
        spread_empty_rows(&old_counts, &mut new_part, gpus);
        let l = Labels::of(&old_counts, &new_part, gpus);
        self.relabel[mode] = l.labels;
        self.row_ptr[mode] = l.ptr;
        self.counts[mode] = l.counts;
        self.nonempty[mode] = l.nonempty;
        self.loads[mode] = nonzeros;
        Ok(())
    }

    pub fn gpus(&self) -> usize {
        self.gpus
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// `relabel(mode)[old]`: the new label of row `old` of `mode`.
    pub fn relabel(&self, mode: usize) -> &[u32] {
        &self.relabel[mode]
    }

    /// The rows GPU `g` owns in `mode` (new labels).
    pub fn rows(&self, mode: usize, g: usize) -> Range<u32> {
        self.row_ptr[mode][g]..self.row_ptr[mode][g + 1]
    }

    /// The rows GPU `g` owns in `mode` that hold nonzeros: the first of
    /// [`RowShards::rows`] (the others are empty).
    pub fn rows_with_nonzeros(&self, mode: usize, g: usize) -> Range<u32> {
        let start = self.row_ptr[mode][g];
        start..start + self.nonempty[mode][g]
    }

    /// Nonzeros of GPU `g`'s shard of `mode` (of a split plan: its
    /// nonzeros of the mode cut, the same for every mode).
    pub fn nnz(&self, mode: usize, g: usize) -> u64 {
        self.loads[self.shard_mode(mode)][g]
    }

    /// Nonzeros per row of `mode`, in new-label order.
    pub fn row_nnz(&self, mode: usize) -> &[u64] {
        &self.counts[mode]
    }

    /// Nonzeros per GPU in `mode`'s shards.
    pub fn balance(&self, mode: usize) -> Balance {
        Balance::of(&self.loads[self.shard_mode(mode)])
    }

    /// The GPU that owns row `label` (new label) of `mode`.
    pub fn owner(&self, mode: usize, label: u32) -> usize {
        self.row_ptr[mode].partition_point(|&p| p <= label) - 1
    }

    /// Words per element: one index per mode and the value's bits.
    pub fn stride(&self) -> usize {
        self.dims.len() + 1
    }

    /// Writes mode `mode`'s elements into `out` (`nnz * stride()` words):
    /// relabeled indices of every mode, then the value's bits, sorted by
    /// the relabeled index of `mode` (a parallel counting sort; the order
    /// of the nonzeros inside one row is unspecified). GPU `g`'s shard is
    /// elements `offsets[g]..offsets[g + 1]` of the returned offsets.
    ///
    /// Errors: a tensor of other dimensions, a mode out of range, an `out`
    /// of another length, or a tensor whose rows hold other counts than
    /// the plan's (a tensor the plan was not made for).
    pub fn fill_elements(
        &self,
        t: &SparseTensor,
        mode: usize,
        out: &mut [u32],
    ) -> Result<Vec<u64>> {
        let stride = self.stride();
        if t.dims() != self.dims.as_slice() || mode >= self.dims.len() {
            return Err(PartitionError::Argument(format!(
                "a tensor of dims {:?} (mode {mode}) for a plan of dims {:?}",
                t.dims(),
                self.dims
            )));
        }
        if out.len() != t.nnz() * stride {
            return Err(PartitionError::Argument(format!(
                "{} words for {} elements of {stride} words",
                out.len(),
                t.nnz()
            )));
        }
        let indices: Vec<&[u32]> = t.indices().iter().map(Vec::as_slice).collect();
        if self.partial(mode) {
            return self.fill_split(mode, &indices, t.values(), out);
        }
        let counts = &self.counts[mode];
        self.scatter(
            mode,
            counts,
            |k| Ok(Some(self.label_of(&indices, mode, k)? as usize)),
            &|slot| format!("row {slot} (new label)"),
            &indices,
            t.values(),
            out,
        )?;
        // The first element of each GPU: the nonzeros of the rows before.
        let mut offsets = Vec::with_capacity(self.gpus + 1);
        let mut first = 0u64;
        offsets.push(first);
        for g in 0..self.gpus {
            first += self.row_counts(mode, g).iter().sum::<u64>();
            offsets.push(first);
        }
        Ok(offsets)
    }

    /// [`RowShards::fill_elements`] of a partial mode of a split plan:
    /// sorted by the owner of the cut mode's row, then by `mode`'s row.
    /// The nonzeros per (GPU, row) are counted first (one parallel pass).
    fn fill_split(
        &self,
        mode: usize,
        indices: &[&[u32]],
        values: &[f32],
        out: &mut [u32],
    ) -> Result<Vec<u64>> {
        let cut = self.shard_mode(mode);
        let dim = self.dims[mode] as usize;
        let slot_of = |k: usize| -> Result<usize> {
            let g = self.owner(cut, self.label_of(indices, cut, k)?);
            Ok(g * dim + self.label_of(indices, mode, k)? as usize)
        };
        let counts = tally(self.gpus * dim, values.len(), |k| slot_of(k).map(Some))?;
        let mut offsets = vec![0u64; self.gpus + 1];
        for g in 0..self.gpus {
            let own: u64 = counts[g * dim..(g + 1) * dim].iter().sum();
            if own != self.nnz(mode, g) {
                return Err(PartitionError::Argument(format!(
                    "the nonzeros do not match the plan: GPU {g} owns {own} nonzeros of \
                     mode {cut}'s rows, the plan counted {}",
                    self.nnz(mode, g)
                )));
            }
            offsets[g + 1] = offsets[g] + own;
        }
        self.scatter(
            mode,
            &counts,
            |k| slot_of(k).map(Some),
            &|slot| format!("row {} (new label) on GPU {}", slot % dim, slot / dim),
            indices,
            values,
            out,
        )?;
        Ok(offsets)
    }

    /// Nonzero `k`'s new label in mode `m`.
    fn label_of(&self, indices: &[&[u32]], m: usize, k: usize) -> Result<u32> {
        let i = indices[m][k];
        self.relabel[m].get(i as usize).copied().ok_or_else(|| {
            PartitionError::Argument(format!(
                "nonzero {k}: mode-{m} index {i} is not below the dimension {}",
                self.dims[m]
            ))
        })
    }

    /// GPU `g`'s elements of mode `mode`: exactly the elements
    /// [`RowShards::fill_elements`] puts in its shard (between `offsets[g]`
    /// and `offsets[g + 1]`), `nnz(mode, g) * stride()` words, sorted by the
    /// relabeled index of `mode` (the order inside a row is unspecified).
    /// They are picked out of the nonzeros of the whole tensor:
    /// `indices[m][k]` is nonzero `k`'s original mode-`m` index and
    /// `values[k]` its value, for instance the views of a memory-mapped
    /// file.
    ///
    /// Errors: a mode or GPU out of range, index arrays of the wrong number
    /// or lengths, an index not below its dimension, or nonzeros whose rows
    /// hold other counts than the plan's (a file that is not the one the
    /// counts came from).
    ///
    /// Cost: one parallel pass over every nonzero's `mode` index, and over
    /// all of the indices of the nonzeros kept; memory is the result plus
    /// a cursor per row of `g`. A split plan's partial mode (GPU `g`'s
    /// nonzeros are those whose cut-mode row it owns) first counts them per
    /// row of `mode` in a pass over the two modes' indices, and keeps a
    /// count and a cursor per row of `mode`.
    pub fn local_elements(
        &self,
        mode: usize,
        g: usize,
        indices: &[&[u32]],
        values: &[f32],
    ) -> Result<Vec<u32>> {
        if mode >= self.dims.len() || g >= self.gpus {
            return Err(PartitionError::Argument(format!(
                "mode {mode}, GPU {g} of a plan of {} modes over {} GPUs",
                self.dims.len(),
                self.gpus
            )));
        }
        if indices.len() != self.dims.len() || indices.iter().any(|i| i.len() != values.len()) {
            let lens: Vec<usize> = indices.iter().map(|i| i.len()).collect();
            return Err(PartitionError::Argument(format!(
                "index arrays of lengths {lens:?} and {} values for a plan of {} modes",
                values.len(),
                self.dims.len()
            )));
        }
        if self.partial(mode) {
            return self.local_split(mode, g, indices, values);
        }
        let own: u64 = self.row_counts(mode, g).iter().sum();
        let mut out = self.element_buffer(own)?;
        let rows = self.rows(mode, g);
        self.scatter(
            mode,
            self.row_counts(mode, g),
            |k| {
                let label = self.label_of(indices, mode, k)?;
                Ok(rows.contains(&label).then(|| (label - rows.start) as usize))
            },
            &|slot| format!("row {} (new label)", rows.start as usize + slot),
            indices,
            values,
            &mut out,
        )?;
        Ok(out)
    }

    /// Nonzeros of each GPU's shard of `mode` per owner of their `mode`
    /// row: `counts[g * gpus + o]`. A shard is sorted by `mode`'s row and
    /// each owner's rows are one range of labels, so GPU `g`'s elements of
    /// owner `o`'s rows are one range of its shard, after those of owners
    /// `0 .. o`. (Rows by owner: only `g == o` counts; a split plan's
    /// partial mode spreads every GPU's shard over every owner.)
    ///
    /// Cost: one parallel pass over the nonzeros' indices of `mode` and of
    /// the mode the shards follow.
    pub fn owner_counts(&self, t: &SparseTensor, mode: usize) -> Result<Vec<u64>> {
        if mode >= self.dims.len() || t.dims() != self.dims.as_slice() {
            return Err(PartitionError::Argument(format!(
                "mode {mode} of a tensor of dims {:?} for a plan of dims {:?}",
                t.dims(),
                self.dims
            )));
        }
        let indices: Vec<&[u32]> = t.indices().iter().map(Vec::as_slice).collect();
        let shard = self.shard_mode(mode);
        let m = self.gpus;
        tally(m * m, t.nnz(), |k| {
            let g = self.owner(shard, self.label_of(&indices, shard, k)?);
            let o = self.owner(mode, self.label_of(&indices, mode, k)?);
            Ok(Some(g * m + o))
        })
    }

    /// [`RowShards::local_elements`] of a partial mode of a split plan:
    /// the nonzeros whose row of the cut mode GPU `g` owns, sorted by
    /// `mode`'s row. Their count per row of `mode` is tallied first (one
    /// parallel pass over the cut mode's and `mode`'s indices).
    fn local_split(
        &self,
        mode: usize,
        g: usize,
        indices: &[&[u32]],
        values: &[f32],
    ) -> Result<Vec<u32>> {
        let cut = self.shard_mode(mode);
        let dim = self.dims[mode] as usize;
        let mine = |k: usize| -> Result<Option<usize>> {
            if self.owner(cut, self.label_of(indices, cut, k)?) != g {
                return Ok(None);
            }
            Ok(Some(self.label_of(indices, mode, k)? as usize))
        };
        let counts = tally(dim, values.len(), mine)?;
        let own: u64 = counts.iter().sum();
        if own != self.nnz(mode, g) {
            return Err(PartitionError::Argument(format!(
                "the nonzeros do not match the plan: GPU {g} owns {own} nonzeros of mode \
                 {cut}'s rows, the plan counted {}",
                self.nnz(mode, g)
            )));
        }
        let mut out = self.element_buffer(own)?;
        self.scatter(
            mode,
            &counts,
            mine,
            &|slot| format!("row {slot} (new label) on GPU {g}"),
            indices,
            values,
            &mut out,
        )?;
        Ok(out)
    }

    /// A zeroed buffer for `elements` elements of [`RowShards::stride`]
    /// words, or an error where that many do not fit in memory.
    fn element_buffer(&self, elements: u64) -> Result<Vec<u32>> {
        let words = usize::try_from(elements)
            .ok()
            .and_then(|n| n.checked_mul(self.stride()))
            .ok_or_else(|| {
                PartitionError::Argument(format!("{elements} elements do not fit in memory"))
            })?;
        Ok(vec![0u32; words])
    }

    /// Nonzeros per row of GPU `g` in `mode`, in new-label order.
    fn row_counts(&self, mode: usize, g: usize) -> &[u64] {
        let rows = self.rows(mode, g);
        &self.counts[mode][rows.start as usize..rows.end as usize]
    }

    /// Writes the elements of the nonzeros `slot_of` places into `out`,
    /// sorted by slot (a counting sort: slot `s` holds `counts[s]`
    /// elements, after those of the slots before): the sort behind
    /// [`RowShards::fill_elements`] and [`RowShards::local_elements`],
    /// whose slots are rows (or, for a split plan's partial mode, pairs
    /// of GPU and row). `slot_of(k)` is `None` for a nonzero left out.
    /// A nonzero beyond its slot's count, a slot left short, or an index
    /// out of range is an error (`name` names a slot), and nothing is
    /// ever written outside `out`.
    ///
    /// The caller checks that `mode` is a mode and that there is one index
    /// array per mode, each as long as `values`.
    #[allow(clippy::too_many_arguments)]
    fn scatter(
        &self,
        mode: usize,
        counts: &[u64],
        slot_of: impl Fn(usize) -> Result<Option<usize>> + Sync,
        name: &(dyn Fn(usize) -> String + Sync),
        indices: &[&[u32]],
        values: &[f32],
        out: &mut [u32],
    ) -> Result<()> {
        let stride = self.stride();
        // One past the last element of each slot, and a cursor per slot
        // that starts at the slot's first element and that the scatter
        // advances.
        let ends: Vec<u64> = counts
            .iter()
            .scan(0u64, |acc, &c| {
                *acc += c;
                Some(*acc)
            })
            .collect();
        let total = ends.last().copied().unwrap_or(0);
        if total.checked_mul(stride as u64) != Some(out.len() as u64) {
            return Err(PartitionError::Argument(format!(
                "{} words for the plan's {total} elements of {stride} words",
                out.len()
            )));
        }
        let cursors: Vec<AtomicU64> = ends
            .par_iter()
            .zip(counts)
            .map(|(&end, &c)| AtomicU64::new(end - c))
            .collect();
        let mismatch = |slot: usize, got: String| {
            PartitionError::Argument(format!(
                "the nonzeros do not match the plan: {} of mode {mode} holds {got} nonzeros, \
                 the plan counted {}",
                name(slot),
                counts[slot]
            ))
        };
        let out_ptr = SharedOut(out.as_mut_ptr());
        let nnz = values.len();
        (0..nnz.div_ceil(SCATTER_CHUNK))
            .into_par_iter()
            .try_for_each(|chunk| -> Result<()> {
                let out_ptr = &out_ptr;
                let lo = chunk * SCATTER_CHUNK;
                let hi = (lo + SCATTER_CHUNK).min(nnz);
                for (k, value) in (lo..hi).zip(&values[lo..hi]) {
                    let Some(slot) = slot_of(k)? else {
                        continue;
                    };
                    let pos = cursors[slot].fetch_add(1, Ordering::Relaxed);
                    if pos >= ends[slot] {
                        return Err(mismatch(slot, "more".into()));
                    }
                    // SAFETY: `pos` is below the slot's end, hence below
                    // `total`, and `out` holds `total * stride` words
                    // (checked above). The slots' ranges are disjoint and
                    // each cursor hands out each position of its range
                    // once, so no other task writes this element.
                    let e = unsafe { out_ptr.element(pos as usize, stride) };
                    for (m, slot) in e[..stride - 1].iter_mut().enumerate() {
                        *slot = self.label_of(indices, m, k)?;
                    }
                    e[stride - 1] = value.to_bits();
                }
                Ok(())
            })?;
        for (slot, (cursor, &end)) in cursors.iter().zip(&ends).enumerate() {
            let got = cursor.load(Ordering::Relaxed);
            if got != end {
                let c = counts[slot];
                return Err(mismatch(slot, (got + c - end).to_string()));
            }
        }
        Ok(())
    }
}

/// Up to this many slots, [`tally`] counts per task instead of with shared
/// atomics.
const FEW_SLOTS: usize = 4096;

/// Nonzeros per slot of `slots`: `slot_of(k)` is nonzero `k`'s slot, or
/// `None` for a nonzero not counted (one parallel pass over `nnz`
/// nonzeros; its first error is returned).
fn tally(
    slots: usize,
    nnz: usize,
    slot_of: impl Fn(usize) -> Result<Option<usize>> + Sync,
) -> Result<Vec<u64>> {
    if slots <= FEW_SLOTS {
        // Few slots (pairs of GPUs): a count per task, added up after, as
        // atomics on a handful of counters would serialize every thread.
        return (0..nnz.div_ceil(SCATTER_CHUNK))
            .into_par_iter()
            .try_fold(
                || vec![0u64; slots],
                |mut acc, chunk| -> Result<Vec<u64>> {
                    let lo = chunk * SCATTER_CHUNK;
                    for k in lo..(lo + SCATTER_CHUNK).min(nnz) {
                        if let Some(slot) = slot_of(k)? {
                            acc[slot] += 1;
                        }
                    }
                    Ok(acc)
                },
            )
            .try_reduce(
                || vec![0u64; slots],
                |mut a, b| {
                    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                    Ok(a)
                },
            );
    }
    let tally: Vec<AtomicU64> = (0..slots)
        .into_par_iter()
        .map(|_| AtomicU64::new(0))
        .collect();
    (0..nnz.div_ceil(SCATTER_CHUNK))
        .into_par_iter()
        .try_for_each(|chunk| -> Result<()> {
            let lo = chunk * SCATTER_CHUNK;
            for k in lo..(lo + SCATTER_CHUNK).min(nnz) {
                if let Some(slot) = slot_of(k)? {
                    tally[slot].fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(())
        })?;
    Ok(tally.into_par_iter().map(AtomicU64::into_inner).collect())
}

/// Rows to GPUs: LPT over the rows that hold nonzeros (exactly what LPT
/// over every row gives them: an empty row weighs nothing and sorts last),
/// then the empty rows dealt out. A long sparse mode (nell-1's third: 15.3M
/// of 25.5M rows empty) sorts and walks only its rows with nonzeros. One
/// GPU takes every row, with nothing to sort or deal out.
fn assign_rows(counts: &[u64], gpus: usize) -> crate::lpt::Assignment {
    if gpus <= 1 {
        return crate::lpt::Assignment {
            part_of: vec![0; counts.len()],
            loads: vec![counts.par_iter().sum()],
        };
    }
    let full: Vec<u32> = (0..counts.len() as u32)
        .into_par_iter()
        .filter(|&i| counts[i as usize] > 0)
        .collect();
    let weights: Vec<u64> = full.par_iter().map(|&i| counts[i as usize]).collect();
    let a = lpt(&weights, gpus);
    let mut part_of = vec![0u32; counts.len()];
    for (&i, &g) in full.iter().zip(&a.part_of) {
        part_of[i as usize] = g;
    }
    spread_empty_rows(counts, &mut part_of, gpus);
    crate::lpt::Assignment {
        part_of,
        loads: a.loads,
    }
}

/// Rows without nonzeros weigh nothing to LPT, which would give them all
/// to one GPU; they still cost a row of the exchange, so they are dealt
/// out to even the GPUs' row counts: in their old order, each GPU in turn
/// takes empty rows until it holds `ceil(rows / gpus)` rows, the last GPU
/// the rest. In parallel: each empty row's rank among the empty rows
/// picks its GPU from the GPUs' running capacities.
fn spread_empty_rows(counts: &[u64], part_of: &mut [u32], gpus: usize) {
    let full: Vec<usize> = counts
        .par_chunks(LABEL_CHUNK)
        .zip(part_of.par_chunks(LABEL_CHUNK))
        .map(|(c, p)| {
            let mut rows = vec![0usize; gpus];
            for (&c, &g) in c.iter().zip(p) {
                if c > 0 {
                    rows[g as usize] += 1;
                }
            }
            rows
        })
        .reduce(
            || vec![0usize; gpus],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                a
            },
        );
    let target = counts.len().div_ceil(gpus);
    // ends[g]: empty rows GPU g and those before it take in all (the last
    // takes the rest).
    let mut ends = Vec::with_capacity(gpus);
    let mut acc = 0usize;
    for (g, &rows) in full.iter().enumerate() {
        acc += if g + 1 < gpus {
            target.saturating_sub(rows)
        } else {
            usize::MAX / 2
        };
        ends.push(acc);
    }
    // Empty rows before each chunk.
    let before: Vec<usize> = counts
        .par_chunks(LABEL_CHUNK)
        .map(|c| c.iter().filter(|&&c| c == 0).count())
        .collect::<Vec<_>>()
        .into_iter()
        .scan(0usize, |acc, n| {
            let this = *acc;
            *acc += n;
            Some(this)
        })
        .collect();
    part_of
        .par_chunks_mut(LABEL_CHUNK)
        .zip(counts.par_chunks(LABEL_CHUNK))
        .zip(before.par_iter())
        .for_each(|((p, c), &first)| {
            let mut rank = first;
            for (slot, &c) in p.iter_mut().zip(c) {
                if c == 0 {
                    *slot = ends.partition_point(|&end| end <= rank) as u32;
                    rank += 1;
                }
            }
        });
}

/// Rows per task when labelling.
const LABEL_CHUNK: usize = 1 << 16;

/// One mode's new labels from the GPU of every old row.
struct Labels {
    /// `labels[old]`: the new label of row `old`.
    labels: Vec<u32>,
    /// `gpus + 1` boundaries of the GPUs' ranges.
    ptr: Vec<u32>,
    /// Nonzeros per new label.
    counts: Vec<u64>,
    /// Each GPU's rows with nonzeros (the first of its range).
    nonempty: Vec<u32>,
}

impl Labels {
    /// GPU by GPU; inside a GPU its rows with nonzeros, then its empty
    /// rows, each in their old order. In parallel: per chunk of rows, how
    /// many of each kind each GPU takes, then each chunk labels its rows
    /// from the cursors the chunks before it leave.
    fn of(old_counts: &[u64], part_of: &[u32], gpus: usize) -> Self {
        // Per chunk and GPU: rows with nonzeros, empty rows.
        let per_chunk: Vec<Vec<[u32; 2]>> = part_of
            .par_chunks(LABEL_CHUNK)
            .zip(old_counts.par_chunks(LABEL_CHUNK))
            .map(|(p, c)| {
                let mut n = vec![[0u32; 2]; gpus];
                for (&g, &c) in p.iter().zip(c) {
                    n[g as usize][usize::from(c == 0)] += 1;
                }
                n
            })
            .collect();
        let mut nonempty = vec![0u32; gpus];
        let mut ptr = vec![0u32; gpus + 1];
        for chunk in &per_chunk {
            for (g, n) in chunk.iter().enumerate() {
                nonempty[g] += n[0];
                ptr[g + 1] += n[0] + n[1];
            }
        }
        for g in 0..gpus {
            ptr[g + 1] += ptr[g];
        }
        // Each chunk's first label of each kind on each GPU.
        let mut cursor: Vec<[u32; 2]> = (0..gpus).map(|g| [ptr[g], ptr[g] + nonempty[g]]).collect();
        let starts: Vec<Vec<[u32; 2]>> = per_chunk
            .iter()
            .map(|chunk| {
                let this = cursor.clone();
                for (c, n) in cursor.iter_mut().zip(chunk) {
                    c[0] += n[0];
                    c[1] += n[1];
                }
                this
            })
            .collect();
        // The counts by new label: empty rows' stay 0; a chunk's rows with
        // nonzeros on GPU g take the next labels of g's rows with nonzeros,
        // so each chunk writes its own piece of each GPU's range.
        let mut counts = vec![0u64; old_counts.len()];
        let mut pieces: Vec<Vec<&mut [u64]>> = per_chunk.iter().map(|_| Vec::new()).collect();
        let mut rest: &mut [u64] = &mut counts;
        for g in 0..gpus {
            let (range, tail) = rest.split_at_mut((ptr[g + 1] - ptr[g]) as usize);
            rest = tail;
            let mut full = range.split_at_mut(nonempty[g] as usize).0;
            for (chunk, into) in per_chunk.iter().zip(pieces.iter_mut()) {
                let (piece, tail) = std::mem::take(&mut full).split_at_mut(chunk[g][0] as usize);
                into.push(piece);
                full = tail;
            }
        }
        let mut labels = vec![0u32; old_counts.len()];
        labels
            .par_chunks_mut(LABEL_CHUNK)
            .zip(part_of.par_chunks(LABEL_CHUNK))
            .zip(old_counts.par_chunks(LABEL_CHUNK))
            .zip(starts.into_par_iter())
            .zip(pieces.into_par_iter())
            .for_each(|((((out, p), c), mut next), mut pieces)| {
                let mut filled = vec![0usize; gpus];
                for ((slot, &g), &c) in out.iter_mut().zip(p).zip(c) {
                    let g = g as usize;
                    let at = &mut next[g][usize::from(c == 0)];
                    *slot = *at;
                    *at += 1;
                    if c > 0 {
                        pieces[g][filled[g]] = c;
                        filled[g] += 1;
                    }
                }
            });
        Labels {
            labels,
            ptr,
            counts,
            nonempty,
        }
    }
}

/// The element buffer, shared by the scatter's tasks (each writes
/// positions no other task writes).
struct SharedOut(*mut u32);

// SAFETY: tasks write disjoint elements (see `RowShards::scatter`).
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Element `pos` (`stride` words).
    ///
    /// # Safety
    /// `pos` must be in bounds and written by this caller only.
    #[allow(clippy::mut_from_ref)]
    unsafe fn element(&self, pos: usize, stride: usize) -> &mut [u32] {
        // SAFETY: the caller promises that element `pos` lies within the
        // buffer, so the `stride` words from `pos * stride` are in one
        // allocation, and that no other task touches them while the slice
        // lives, so the `&mut` aliases nothing.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(pos * stride), stride) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn every_gpu_owns_a_contiguous_range_and_its_shard_holds_exactly_its_rows(
            seed in any::<u64>(),
            nnz in 1usize..4_000,
            gpus in 1usize..6,
            exponent in 0.0f64..1.6,
        ) {
            let mut spec = PowerLawSpec::new(vec![70, 40, 25, 9], nnz).with_draws().with_seed(seed);
            spec.exponents = vec![exponent; 4];
            let t = power_law(&spec).unwrap();
            let plan = RowShards::new(&t, gpus).unwrap();
            let stride = plan.stride();
            for mode in 0..4 {
                // The relabeling is a permutation of the rows.
                let mut seen = plan.relabel(mode).to_vec();
                seen.sort_unstable();
                prop_assert_eq!(seen, (0..t.dims()[mode]).collect::<Vec<_>>());
                prop_assert_eq!(plan.rows(mode, gpus - 1).end, t.dims()[mode]);
                // Inside a GPU, the rows with nonzeros come first.
                let counts = plan.row_nnz(mode);
                for g in 0..gpus {
                    let full = plan.rows_with_nonzeros(mode, g);
                    let all = plan.rows(mode, g);
                    prop_assert!(full.start == all.start && full.end <= all.end);
                    for row in all {
                        prop_assert_eq!(counts[row as usize] > 0, full.contains(&row));
                    }
                }
                let mut elems = vec![0u32; t.nnz() * stride];
                let offsets = plan.fill_elements(&t, mode, &mut elems).unwrap();
                prop_assert_eq!(offsets.len(), gpus + 1);
                prop_assert_eq!(*offsets.last().unwrap(), t.nnz() as u64);
                for g in 0..gpus {
                    prop_assert_eq!(offsets[g + 1] - offsets[g], plan.nnz(mode, g));
                    let rows = plan.rows(mode, g);
                    for k in offsets[g]..offsets[g + 1] {
                        let row = elems[k as usize * stride + mode];
                        prop_assert!(rows.contains(&row));
                    }
                }
                // Sorted by the mode's label.
                prop_assert!(elems.chunks(stride).is_sorted_by_key(|e| e[mode]));
                // The same nonzeros, relabeled: compare sorted tuples.
                let mut want: Vec<Vec<u32>> = (0..t.nnz())
                    .map(|k| {
                        let mut e: Vec<u32> = (0..4)
                            .map(|w| plan.relabel(w)[t.mode_indices(w)[k] as usize])
                            .collect();
                        e.push(t.values()[k].to_bits());
                        e
                    })
                    .collect();
                let mut got: Vec<Vec<u32>> = elems.chunks(stride).map(<[u32]>::to_vec).collect();
                want.sort_unstable();
                got.sort_unstable();
                prop_assert_eq!(got, want);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]
        #[test]
        fn a_split_plan_gives_every_gpu_the_nonzeros_of_its_rows_of_the_cut_mode(
            seed in any::<u64>(),
            nnz in 0usize..3_000,
            gpus in 1usize..5,
            cut in 0usize..3,
        ) {
            let t = if nnz == 0 {
                SparseTensor::new(vec![30, 20, 50], vec![Vec::new(); 3], Vec::new()).unwrap()
            } else {
                power_law(&PowerLawSpec::new(vec![30, 20, 50], nnz).with_draws().with_seed(seed))
                    .unwrap()
            };
            let rows_plan = RowShards::new(&t, gpus).unwrap();
            let mut plan = rows_plan.clone();
            plan.split_by(cut).unwrap();
            prop_assert_eq!(plan.split(), Some(cut));
            let stride = plan.stride();
            for mode in 0..3 {
                prop_assert_eq!(plan.partial(mode), mode != cut);
                // Ownership of rows is the rows plan's.
                for g in 0..gpus {
                    prop_assert_eq!(plan.rows(mode, g), rows_plan.rows(mode, g));
                    prop_assert_eq!(plan.nnz(mode, g), rows_plan.nnz(cut, g));
                }
                let mut elems = vec![0u32; t.nnz() * stride];
                let offsets = plan.fill_elements(&t, mode, &mut elems).unwrap();
                prop_assert_eq!(*offsets.last().unwrap(), t.nnz() as u64);
                for g in 0..gpus {
                    let shard = &elems[offsets[g] as usize * stride..offsets[g + 1] as usize * stride];
                    prop_assert_eq!(offsets[g + 1] - offsets[g], plan.nnz(mode, g));
                    for e in shard.chunks(stride) {
                        prop_assert_eq!(plan.owner(cut, e[cut]), g);
                        prop_assert!(plan.rows(cut, g).contains(&e[cut]));
                    }
                    prop_assert!(shard.chunks(stride).is_sorted_by_key(|e| e[mode]));
                }
                // The same elements as the rows plan's fill, as a multiset.
                let mut want = vec![0u32; t.nnz() * stride];
                rows_plan.fill_elements(&t, mode, &mut want).unwrap();
                prop_assert_eq!(sorted_elements(&elems, stride), sorted_elements(&want, stride));
            }
            // Each GPU's shards picked out alone are its slices of the fill.
            check_local_elements(&t, &plan);
            // Each GPU's elements of each owner's rows are one range of its
            // shard, as `owner_counts` counts them.
            for mode in 0..3 {
                let counts = plan.owner_counts(&t, mode).unwrap();
                let mut elems = vec![0u32; t.nnz() * stride];
                let offsets = plan.fill_elements(&t, mode, &mut elems).unwrap();
                for g in 0..gpus {
                    let shard = &elems[offsets[g] as usize * stride..offsets[g + 1] as usize * stride];
                    let mut at = 0usize;
                    for o in 0..gpus {
                        let c = counts[g * gpus + o] as usize;
                        for e in shard[at * stride..(at + c) * stride].chunks(stride) {
                            prop_assert_eq!(plan.owner(mode, e[mode]), o);
                        }
                        at += c;
                    }
                    prop_assert_eq!(at as u64, plan.nnz(mode, g));
                }
            }
            prop_assert!(plan.split_by(3).is_err());
            // The cut mode's rows are read by their owners alone; a
            // partial mode's may go to their readers, the shards unchanged.
            prop_assert!(plan.prefer_readers(&t, cut).is_err());
            let partial = (cut + 1) % 3;
            plan.prefer_readers(&t, partial).unwrap();
            for g in 0..gpus {
                prop_assert_eq!(plan.nnz(partial, g), rows_plan.nnz(cut, g));
            }
            check_local_elements(&t, &plan);
        }
    }

    #[test]
    fn a_tally_counts_alike_with_few_slots_and_with_many() {
        let nnz = 3 * SCATTER_CHUNK + 17;
        for slots in [1, 7, FEW_SLOTS, FEW_SLOTS + 1, 20_000] {
            // Every third nonzero is left out; the others go to slots by a
            // hash, so the counts differ from slot to slot.
            let slot_of = |k: usize| -> Result<Option<usize>> {
                Ok((k % 3 != 0).then(|| (k.wrapping_mul(2_654_435_761) >> 7) % slots))
            };
            let mut want = vec![0u64; slots];
            for k in 0..nnz {
                if let Some(s) = slot_of(k).unwrap() {
                    want[s] += 1;
                }
            }
            assert_eq!(tally(slots, nnz, slot_of).unwrap(), want, "{slots} slots");
        }
        // The first error comes back, with either way of counting.
        for slots in [4, 20_000] {
            let bad = |k: usize| -> Result<Option<usize>> {
                if k == 12_345 {
                    Err(PartitionError::Argument("nonzero 12345".into()))
                } else {
                    Ok(Some(k % slots))
                }
            };
            assert!(tally(slots, nnz, bad).is_err());
        }
    }

    /// The elements in `words`, sorted, for comparing as multisets.
    fn sorted_elements(words: &[u32], stride: usize) -> Vec<Vec<u32>> {
        let mut e: Vec<Vec<u32>> = words.chunks(stride).map(<[u32]>::to_vec).collect();
        e.sort_unstable();
        e
    }

    /// Checks that every GPU's `local_elements` of every mode are its
    /// slice of `fill_elements` (as a multiset), sorted by the mode's
    /// label, and that together they are all the elements.
    fn check_local_elements(t: &SparseTensor, plan: &RowShards) {
        let stride = plan.stride();
        let indices: Vec<&[u32]> = t.indices().iter().map(Vec::as_slice).collect();
        for mode in 0..t.nmodes() {
            let mut elems = vec![0u32; t.nnz() * stride];
            let offsets = plan.fill_elements(t, mode, &mut elems).unwrap();
            let mut all = Vec::with_capacity(elems.len());
            for g in 0..plan.gpus() {
                let local = plan.local_elements(mode, g, &indices, t.values()).unwrap();
                assert_eq!(local.len() as u64, plan.nnz(mode, g) * stride as u64);
                assert!(local.chunks(stride).is_sorted_by_key(|e| e[mode]));
                let slice = &elems[offsets[g] as usize * stride..offsets[g + 1] as usize * stride];
                assert_eq!(
                    sorted_elements(&local, stride),
                    sorted_elements(slice, stride),
                    "mode {mode}, GPU {g}"
                );
                all.extend_from_slice(&local);
            }
            assert_eq!(
                sorted_elements(&all, stride),
                sorted_elements(&elems, stride)
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]
        #[test]
        fn a_plan_from_counts_is_the_plan_and_local_elements_are_each_gpus_slice(
            seed in any::<u64>(),
            nnz in 0usize..2_000,
            gpus in 1usize..5,
            exponent in 0.0f64..1.6,
        ) {
            let mut spec = PowerLawSpec::new(vec![30, 17, 6], nnz.max(1)).with_draws().with_seed(seed);
            spec.exponents = vec![exponent; 3];
            let mut t = power_law(&spec).unwrap();
            if nnz == 0 {
                t = SparseTensor::new(t.dims().to_vec(), vec![vec![]; 3], vec![]).unwrap();
            }
            let plan = RowShards::new(&t, gpus).unwrap();
            let counts = (0..3).map(|m| t.mode_counts(m)).collect();
            let from_counts = RowShards::from_counts(t.dims(), counts, gpus).unwrap();
            prop_assert_eq!(from_counts.dims(), plan.dims());
            for mode in 0..3 {
                prop_assert_eq!(from_counts.relabel(mode), plan.relabel(mode));
                for g in 0..gpus {
                    prop_assert_eq!(from_counts.rows(mode, g), plan.rows(mode, g));
                    prop_assert_eq!(from_counts.nnz(mode, g), plan.nnz(mode, g));
                }
            }
            check_local_elements(&t, &from_counts);
        }
    }

    /// The labels and the spread of empty rows, one row after another.
    fn labels_one_by_one(counts: &[u64], part_of: &[u32], gpus: usize) -> (Vec<u32>, Vec<u32>) {
        let mut spread = part_of.to_vec();
        let mut rows = vec![0usize; gpus];
        for (&c, &g) in counts.iter().zip(part_of) {
            rows[g as usize] += usize::from(c > 0);
        }
        let target = counts.len().div_ceil(gpus);
        let mut g = 0;
        for (&c, slot) in counts.iter().zip(spread.iter_mut()) {
            if c > 0 {
                continue;
            }
            while g + 1 < gpus && rows[g] >= target {
                g += 1;
            }
            *slot = g as u32;
            rows[g] += 1;
        }
        let mut per_gpu: Vec<Vec<usize>> = vec![Vec::new(); gpus];
        for full in [true, false] {
            for (old, (&c, &g)) in counts.iter().zip(&spread).enumerate() {
                if (c > 0) == full {
                    per_gpu[g as usize].push(old);
                }
            }
        }
        let mut labels = vec![0u32; counts.len()];
        let mut next = 0u32;
        for rows in per_gpu {
            for old in rows {
                labels[old] = next;
                next += 1;
            }
        }
        (spread, labels)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn labels_in_parallel_are_the_labels_one_by_one(
            rows in 1usize..300_000,
            gpus in 1usize..6,
            empty_every in 1u64..5,
            seed in any::<u64>(),
        ) {
            let counts: Vec<u64> = (0..rows as u64)
                .map(|i| if (i ^ seed) % empty_every == 0 { 0 } else { 1 + (i * 7 + seed) % 5 })
                .collect();
            let part_of: Vec<u32> = (0..rows as u64)
                .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % gpus as u64) as u32)
                .collect();
            let (want_spread, want_labels) = labels_one_by_one(&counts, &part_of, gpus);
            let mut spread = part_of.clone();
            spread_empty_rows(&counts, &mut spread, gpus);
            prop_assert_eq!(&spread, &want_spread);
            let l = Labels::of(&counts, &spread, gpus);
            prop_assert_eq!(&l.labels, &want_labels);
            for (old, &label) in l.labels.iter().enumerate() {
                prop_assert_eq!(l.counts[label as usize], counts[old]);
            }
        }
    }

    /// Rows of `mode` a sparse exchange sends under `plan`: every GPU's
    /// shards marked as the group marks them, then the lists' total.
    fn rows_sent(t: &SparseTensor, plan: &RowShards, mode: usize) -> u64 {
        let readers = crate::readers::RowReaders::new(plan).unwrap();
        let stride = plan.stride();
        for m in 0..t.nmodes() {
            let mut buf = vec![0u32; t.nnz() * stride];
            let offsets = plan.fill_elements(t, m, &mut buf).unwrap();
            for g in 0..plan.gpus() {
                let part = &buf[offsets[g] as usize * stride..offsets[g + 1] as usize * stride];
                readers.mark(g, m, part).unwrap();
            }
        }
        readers.lists(plan).unwrap().mode(mode).total()
    }

    #[test]
    fn rows_given_to_their_readers_stay_balanced_and_travel_less() {
        // A long third mode of light rows, read by few GPUs.
        let t = power_law(&PowerLawSpec::new(vec![300, 200, 40_000], 30_000).with_seed(4)).unwrap();
        let volume = |plan: &RowShards| rows_sent(&t, plan, 2);
        for gpus in [2, 3, 4] {
            let lpt = RowShards::new(&t, gpus).unwrap();
            let mut preferred = lpt.clone();
            preferred.prefer_readers(&t, 2).unwrap();
            // Still a plan: a permutation of the rows, every nonzero in the
            // shard of its row's GPU (fill_elements checks the counts).
            let mut seen = preferred.relabel(2).to_vec();
            seen.sort_unstable();
            assert_eq!(seen, (0..40_000).collect::<Vec<u32>>());
            let mut buf = vec![0u32; t.nnz() * preferred.stride()];
            preferred.fill_elements(&t, 2, &mut buf).unwrap();
            let loads: Vec<u64> = (0..gpus).map(|g| preferred.nnz(2, g)).collect();
            assert_eq!(loads.iter().sum::<u64>(), t.nnz() as u64);
            let mean = t.nnz() as f64 / gpus as f64;
            let lpt_max = (0..gpus).map(|g| lpt.nnz(2, g)).max().unwrap() as f64;
            let max = *loads.iter().max().unwrap() as f64;
            assert!(
                max <= (mean * (1.0 + PREFER_SLACK)).max(lpt_max) + 1.0,
                "{loads:?}"
            );
            let (before, after) = (volume(&lpt), volume(&preferred));
            assert!(
                after * 10 < before * 9,
                "{gpus} GPUs: {before} rows sent, then {after}"
            );
        }
    }

    #[test]
    fn a_split_plans_partial_rows_go_to_their_readers_and_stay_balanced() {
        // Two long modes of light rows, split by the short third: a light
        // row's nonzeros fall on one or two GPUs.
        let t =
            power_law(&PowerLawSpec::new(vec![40_000, 30_000, 300], 30_000).with_seed(5)).unwrap();
        let volume = |plan: &RowShards, mode: usize| rows_sent(&t, plan, mode);
        for gpus in [2, 3, 4] {
            let mut split = RowShards::new(&t, gpus).unwrap();
            split.split_by(2).unwrap();
            let mut preferred = split.clone();
            // The cut mode is read by its owners alone: refused.
            assert!(preferred.prefer_readers(&t, 2).is_err());
            for mode in [0, 1] {
                preferred.prefer_readers(&t, mode).unwrap();
                let dim = t.dims()[mode];
                let mut seen = preferred.relabel(mode).to_vec();
                seen.sort_unstable();
                assert_eq!(seen, (0..dim).collect::<Vec<u32>>());
                // The shards still follow the cut mode.
                for g in 0..gpus {
                    assert_eq!(preferred.nnz(mode, g), split.nnz(2, g));
                }
                // Rows with nonzeros per owner within the slack of the
                // mean (or of the plan before, if that was worse).
                let rows: Vec<u64> = (0..gpus)
                    .map(|g| preferred.rows_with_nonzeros(mode, g).len() as u64)
                    .collect();
                let before = (0..gpus)
                    .map(|g| split.rows_with_nonzeros(mode, g).len())
                    .max()
                    .unwrap() as f64;
                let mean = rows.iter().sum::<u64>() as f64 / gpus as f64;
                let max = *rows.iter().max().unwrap() as f64;
                assert!(
                    max <= (mean * (1.0 + PREFER_SLACK)).max(before) + 1.0,
                    "{gpus} GPUs, mode {mode}: {rows:?}"
                );
                let (lpt, after) = (volume(&split, mode), volume(&preferred, mode));
                assert!(
                    after * 10 < lpt * 7,
                    "{gpus} GPUs, mode {mode}: {lpt} rows sent, then {after}"
                );
            }
            let mut buf = vec![0u32; t.nnz() * preferred.stride()];
            for mode in 0..t.nmodes() {
                preferred.fill_elements(&t, mode, &mut buf).unwrap();
            }
        }
    }

    #[test]
    fn local_elements_across_many_scatter_chunks() {
        let t = power_law(
            &PowerLawSpec::new(vec![500, 300, 40], 3 * SCATTER_CHUNK + 17)
                .with_draws()
                .with_seed(3),
        )
        .unwrap();
        check_local_elements(&t, &RowShards::new(&t, 3).unwrap());
    }

    #[test]
    fn nonzeros_other_than_the_plans_are_errors() {
        let t = SparseTensor::new(
            vec![4, 3],
            vec![vec![0, 0, 1, 2, 3, 3], vec![0, 1, 2, 0, 1, 2]],
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        )
        .unwrap();
        let plan = RowShards::new(&t, 2).unwrap();
        let values = t.values();
        let idx = |rows: &[u32]| -> Vec<u32> { rows.to_vec() };
        let mode0 = idx(t.mode_indices(0));
        let mode1 = idx(t.mode_indices(1));
        assert!(plan.local_elements(0, 0, &[&mode0, &mode1], values).is_ok());

        // One nonzero moved to another row of mode 0: for every GPU, some
        // row holds more or fewer nonzeros than the plan counted.
        let mut moved = mode0.clone();
        moved[0] = 3;
        for g in 0..2 {
            let err = plan
                .local_elements(0, g, &[&moved, &mode1], values)
                .unwrap_err()
                .to_string();
            assert!(err.contains("do not match the plan"), "{err}");
        }
        // The same for the whole-tensor fill: no write past a row's range.
        let other = SparseTensor::new(
            vec![4, 3],
            vec![moved.clone(), mode1.clone()],
            values.to_vec(),
        )
        .unwrap();
        let mut out = vec![0u32; 6 * 3];
        let err = plan
            .fill_elements(&other, 0, &mut out)
            .unwrap_err()
            .to_string();
        assert!(err.contains("do not match the plan"), "{err}");
        // Its mode-1 rows are unchanged, so that fill works.
        assert!(plan.fill_elements(&other, 1, &mut out).is_ok());

        // An index out of range, in the scanned mode and in another.
        let mut far = mode0.clone();
        far[5] = 4;
        let err = plan
            .local_elements(0, 1, &[&far, &mode1], values)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nonzero 5: mode-0 index 4 is not below the dimension 4"),
            "{err}"
        );
        let mut far1 = mode1.clone();
        far1[2] = 9;
        let errs: Vec<String> = (0..2)
            .filter_map(|g| plan.local_elements(0, g, &[&mode0, &far1], values).err())
            .map(|e| e.to_string())
            .collect();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(errs[0].contains("mode-1 index 9"), "{}", errs[0]);

        // Arguments.
        assert!(
            plan.local_elements(2, 0, &[&mode0, &mode1], values)
                .is_err()
        );
        assert!(
            plan.local_elements(0, 2, &[&mode0, &mode1], values)
                .is_err()
        );
        assert!(plan.local_elements(0, 0, &[&mode0], values).is_err());
        assert!(
            plan.local_elements(0, 0, &[&mode0, &mode1[..5]], values)
                .is_err()
        );
        // A nonzero fewer: the GPU that owns its row finds the row short.
        let short = (0..2)
            .filter(|&g| {
                plan.local_elements(0, g, &[&mode0[..5], &mode1[..5]], &values[..5])
                    .is_err()
            })
            .count();
        assert_eq!(short, 1);
    }

    #[test]
    fn counts_that_cannot_be_a_tensors_are_errors() {
        let ok = || vec![vec![1, 0, 2], vec![3, 0]];
        assert!(RowShards::from_counts(&[3, 2], ok(), 2).is_ok());
        assert!(RowShards::from_counts(&[3, 2], ok(), 0).is_err());
        assert!(RowShards::from_counts(&[3, 2, 1], ok(), 2).is_err());
        assert!(RowShards::from_counts(&[3, 3], ok(), 2).is_err());
        assert!(RowShards::from_counts(&[], vec![], 2).is_err());
        let err = RowShards::from_counts(&[3, 2], vec![vec![1, 0, 2], vec![3, 1]], 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("add up to 4"), "{err}");
    }

    #[test]
    fn rows_go_to_gpus_by_lpt_and_bad_arguments_are_errors() {
        let t = SparseTensor::new(
            vec![4, 2, 2],
            vec![
                vec![0, 0, 0, 0, 1, 1, 2, 3],
                vec![0, 1, 0, 1, 0, 1, 0, 0],
                vec![0, 0, 1, 1, 0, 0, 0, 0],
            ],
            vec![1.0; 8],
        )
        .unwrap();
        let plan = RowShards::new(&t, 2).unwrap();
        // Row 0 (4 nonzeros) alone on one GPU, rows 1-3 (4) on the other.
        let mut loads: Vec<u64> = (0..2).map(|g| plan.nnz(0, g)).collect();
        loads.sort_unstable();
        assert_eq!(loads, [4, 4]);
        assert!((plan.balance(0).max_over_mean() - 1.0).abs() < 1e-12);
        assert!(RowShards::new(&t, 0).is_err());
        // Empty rows are dealt out evenly: 1,000 rows, 10 with nonzeros.
        let t = SparseTensor::new(
            vec![1_000, 2, 2],
            vec![(0..10).collect(), vec![0; 10], vec![1; 10]],
            vec![1.0; 10],
        )
        .unwrap();
        let plan = RowShards::new(&t, 3).unwrap();
        let rows: Vec<usize> = (0..3).map(|g| plan.rows(0, g).len()).collect();
        assert!(rows.iter().all(|&r| (332..=334).contains(&r)), "{rows:?}");
        let mut short = vec![0u32; 3];
        assert!(plan.fill_elements(&t, 0, &mut short).is_err());
        let mut ok = vec![0u32; 8 * 4];
        assert!(plan.fill_elements(&t, 3, &mut ok).is_err());
    }
}
