//! Which GPUs read which factor rows: the plan of the sparse exchange.
//!
//! After mode `n`'s update, the plain exchange all-gathers the whole
//! factor: every GPU receives every row it does not own. But GPU `h` reads
//! mode-`n` rows only through the nonzeros of its shards of the other
//! modes, and on real tensors many rows are read by few GPUs or by none
//! (a row with no nonzero by none at all). [`RowReaders`] records, per
//! mode and row, the GPUs whose shards read it, marked from the shards'
//! elements as [`RowShards::fill_elements`] writes them; [`ExchangeLists`]
//! turns that into, per mode and pair (owner, reader), the rows the owner
//! sends, and says per mode whether sending only those moves fewer bytes
//! than the all-gather ([`ModeLists::cheaper_than_all_gather`]).
//!
//! Across processes each process marks its own GPU's reads only; the
//! marks travel as one bitmap per GPU ([`RowReaders::bitmap`],
//! [`RowReaders::merge_bitmap`]), so every process derives the same lists.

use std::sync::atomic::{AtomicU32, Ordering};

use rayon::prelude::*;

use crate::rows::RowShards;
use crate::{PartitionError, Result};

/// The most GPUs a sparse exchange plans for (one bit each in a row's
/// mask); larger groups use the all-gather.
pub const MAX_GPUS: usize = 32;

/// Elements per rayon task when marking.
const MARK_CHUNK: usize = 1 << 15;

/// A sparse exchange must receive at most this share of the all-gather's
/// rows (on the GPU that receives most) to be used. Measured on 4 H100s
/// (2026-11-26, docs/performance.md): a sparse exchange moved rows at
/// about two thirds of the all-gather's rate (packing, scattering and
/// smaller messages), so at 76% and 79% of the all-gather's bytes it was
/// slower (1.07 against 0.94 ms, 8.45 against 7.30 ms) and at 19% far
/// faster (2.36 against 7.16 ms).
pub const CHEAPER_SHARE: f64 = 0.6;

/// Per mode and row (new labels of a [`RowShards`]), the GPUs that read it.
#[derive(Debug)]
pub struct RowReaders {
    gpus: usize,
    dims: Vec<u32>,
    /// The modes whose reads are recorded (the others' masks are empty).
    wanted: Vec<bool>,
    /// Per mode, per new label: bit `g` set when GPU `g`'s shards read the
    /// row (the owner's own bit may be set; the lists leave it out).
    masks: Vec<Vec<AtomicU32>>,
}

impl RowReaders {
    /// No row read yet, for the plan's modes and GPUs.
    ///
    /// Errors: more than [`MAX_GPUS`] GPUs.
    ///
    /// Memory: four bytes per row of every mode.
    pub fn new(plan: &RowShards) -> Result<Self> {
        Self::for_modes(plan, &vec![true; plan.dims().len()])
    }

    /// As [`RowReaders::new`], recording the reads of the modes `wanted`
    /// says only (the others are never marked and have empty lists).
    ///
    /// Errors: more than [`MAX_GPUS`] GPUs, or a `wanted` of another
    /// length than the modes.
    pub fn for_modes(plan: &RowShards, wanted: &[bool]) -> Result<Self> {
        if wanted.len() != plan.dims().len() {
            return Err(PartitionError::Argument(format!(
                "{} modes wanted of a plan of {}",
                wanted.len(),
                plan.dims().len()
            )));
        }
        if plan.gpus() > MAX_GPUS {
            return Err(PartitionError::Argument(format!(
                "a sparse exchange plans for at most {MAX_GPUS} GPUs, not {}",
                plan.gpus()
            )));
        }
        let masks = plan
            .dims()
            .iter()
            .zip(wanted)
            .map(|(&d, &w)| {
                let rows = if w { d } else { 0 };
                (0..rows).map(|_| AtomicU32::new(0)).collect()
            })
            .collect();
        Ok(RowReaders {
            gpus: plan.gpus(),
            dims: plan.dims().to_vec(),
            wanted: wanted.to_vec(),
            masks,
        })
    }

    /// Marks every row that GPU `g`'s shard of `mode` reads: for each
    /// element (relabeled indices, then the value's bits, as
    /// [`RowShards::fill_elements`] writes them), its index in every
    /// wanted mode but `mode`.
    ///
    /// Errors: a GPU or mode out of range, a buffer that is not whole
    /// elements, or an index not below its dimension.
    ///
    /// Cost: one parallel pass over the elements.
    pub fn mark(&self, g: usize, mode: usize, elems: &[u32]) -> Result<()> {
        let n = self.dims.len();
        let stride = n + 1;
        if g >= self.gpus || mode >= n {
            return Err(PartitionError::Argument(format!(
                "GPU {g}, mode {mode} of a plan of {} modes over {} GPUs",
                n, self.gpus
            )));
        }
        if elems.len() % stride != 0 {
            return Err(PartitionError::Argument(format!(
                "{} words are not whole elements of {stride} words",
                elems.len()
            )));
        }
        if !self.wanted.iter().enumerate().any(|(w, &x)| x && w != mode) {
            return Ok(());
        }
        let bit = 1u32 << g;
        let wanted = &self.wanted;
        elems
            .par_chunks(MARK_CHUNK * stride)
            .try_for_each(|chunk| -> Result<()> {
                for e in chunk.chunks_exact(stride) {
                    for (w, &label) in e[..n].iter().enumerate() {
                        if w == mode || !wanted[w] {
                            continue;
                        }
                        let slot = self.masks[w].get(label as usize).ok_or_else(|| {
                            PartitionError::Argument(format!(
                                "an element's mode-{w} index {label} is not below the dimension {}",
                                self.dims[w]
                            ))
                        })?;
                        // Most rows are read many times: look before
                        // writing, so hot rows stay shared in cache.
                        if slot.load(Ordering::Relaxed) & bit == 0 {
                            slot.fetch_or(bit, Ordering::Relaxed);
                        }
                    }
                }
                Ok(())
            })
    }

    /// GPU `g`'s marks as a bitmap: per wanted mode,
    /// `dims[mode].div_ceil(32)` words (row `i` is bit `i % 32` of word
    /// `i / 32`), modes one after another. What one process sends the
    /// others.
    pub fn bitmap(&self, g: usize) -> Vec<u32> {
        let bit = 1u32 << g;
        let mut out = Vec::with_capacity(self.bitmap_words());
        for masks in &self.masks {
            out.extend(
                masks
                    .par_chunks(32)
                    .map(|rows| {
                        rows.iter().enumerate().fold(0u32, |word, (i, m)| {
                            word | (u32::from(m.load(Ordering::Relaxed) & bit != 0) << i)
                        })
                    })
                    .collect::<Vec<_>>(),
            );
        }
        out
    }

    /// Words of one GPU's [`RowReaders::bitmap`].
    pub fn bitmap_words(&self) -> usize {
        self.masks.iter().map(|m| m.len().div_ceil(32)).sum()
    }

    /// Adds GPU `g`'s marks from its bitmap (as [`RowReaders::bitmap`]
    /// writes it, made by another process from the same plan).
    ///
    /// Errors: a GPU out of range or a bitmap of another length.
    pub fn merge_bitmap(&mut self, g: usize, bitmap: &[u32]) -> Result<()> {
        if g >= self.gpus || bitmap.len() != self.bitmap_words() {
            return Err(PartitionError::Argument(format!(
                "a bitmap of {} words for GPU {g}; the plan's is {} words for {} GPUs",
                bitmap.len(),
                self.bitmap_words(),
                self.gpus
            )));
        }
        let bit = 1u32 << g;
        let mut first = 0;
        for masks in &mut self.masks {
            let words = &bitmap[first..first + masks.len().div_ceil(32)];
            first += words.len();
            masks
                .par_chunks_mut(32)
                .zip(words.par_iter())
                .for_each(|(rows, &word)| {
                    for (i, m) in rows.iter_mut().enumerate() {
                        if word >> i & 1 == 1 {
                            *m.get_mut() |= bit;
                        }
                    }
                });
        }
        Ok(())
    }

    /// Per mode and pair (owner, reader), the rows the owner must send.
    ///
    /// Errors: a plan of other modes or GPUs than these marks'. Modes not
    /// wanted have empty lists.
    ///
    /// Cost: one pass over every row of every mode, parallel over owners.
    pub fn lists(&self, plan: &RowShards) -> Result<ExchangeLists> {
        if plan.dims() != self.dims.as_slice() || plan.gpus() != self.gpus {
            return Err(PartitionError::Argument(format!(
                "marks of dims {:?} over {} GPUs for a plan of dims {:?} over {} GPUs",
                self.dims,
                self.gpus,
                plan.dims(),
                plan.gpus()
            )));
        }
        let m = self.gpus;
        let modes = self
            .masks
            .iter()
            .enumerate()
            .map(|(mode, masks)| {
                let pairs = (0..m)
                    .into_par_iter()
                    .map(|o| {
                        let mut to: Vec<Vec<u32>> = vec![Vec::new(); m];
                        if !self.wanted[mode] {
                            return to;
                        }
                        let own = 1u32 << o;
                        for label in plan.rows(mode, o) {
                            let mut readers = masks[label as usize].load(Ordering::Relaxed) & !own;
                            while readers != 0 {
                                let h = readers.trailing_zeros() as usize;
                                readers &= readers - 1;
                                to[h].push(label);
                            }
                        }
                        to
                    })
                    .collect();
                ModeLists { pairs }
            })
            .collect();
        Ok(ExchangeLists { modes })
    }
}

/// Per mode, the rows each owner sends each reader.
#[derive(Clone, Debug)]
pub struct ExchangeLists {
    modes: Vec<ModeLists>,
}

impl ExchangeLists {
    /// The lists of `mode`.
    pub fn mode(&self, mode: usize) -> &ModeLists {
        &self.modes[mode]
    }

    /// Modes planned.
    pub fn modes(&self) -> usize {
        self.modes.len()
    }
}

/// One mode's rows to send, per pair (owner, reader).
#[derive(Clone, Debug)]
pub struct ModeLists {
    /// `pairs[o][h]`: new labels of the rows owner `o` sends reader `h`,
    /// increasing; empty for `h == o`.
    pairs: Vec<Vec<Vec<u32>>>,
}

impl ModeLists {
    /// GPUs of the plan.
    pub fn gpus(&self) -> usize {
        self.pairs.len()
    }

    /// The rows (new labels, increasing) `owner` sends `reader`.
    pub fn rows(&self, owner: usize, reader: usize) -> &[u32] {
        &self.pairs[owner][reader]
    }

    /// Rows `reader` receives from every owner.
    pub fn received(&self, reader: usize) -> u64 {
        self.pairs.iter().map(|to| to[reader].len() as u64).sum()
    }

    /// Rows `owner` sends to every reader.
    pub fn sent(&self, owner: usize) -> u64 {
        self.pairs[owner].iter().map(|l| l.len() as u64).sum()
    }

    /// Rows sent in all.
    pub fn total(&self) -> u64 {
        (0..self.gpus()).map(|o| self.sent(o)).sum()
    }

    /// Whether sending only the rows read is cheaper than all-gathering
    /// mode `mode` of `plan`: the GPU that receives most receives at most
    /// [`CHEAPER_SHARE`] of what it receives in the all-gather.
    pub fn cheaper_than_all_gather(&self, plan: &RowShards, mode: usize) -> bool {
        self.cheaper_by(plan, mode, CHEAPER_SHARE)
    }

    /// Whether the GPU that receives most rows of mode `mode` receives at
    /// most `share` of what it receives in the all-gather (a way of
    /// sending rows that costs what the all-gather does per row takes
    /// the rows read where `share` is near 1).
    pub fn cheaper_by(&self, plan: &RowShards, mode: usize, share: f64) -> bool {
        let m = self.gpus();
        let sparse = (0..m).map(|h| self.received(h)).max().unwrap_or(0);
        let all = (0..m)
            .map(|h| all_gather_received(plan, mode, h))
            .max()
            .unwrap_or(0);
        all > 0 && (sparse as f64) <= share * all as f64
    }
}

/// Rows GPU `h` receives per iteration when mode `mode` of `plan` is
/// all-gathered: every row with nonzeros it does not own (after the first
/// all-gather, the empty rows are zero on every GPU and stay home).
pub fn all_gather_received(plan: &RowShards, mode: usize, h: usize) -> u64 {
    (0..plan.gpus())
        .filter(|&b| b != h)
        .map(|b| plan.rows_with_nonzeros(mode, b).len() as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::SparseTensor;
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    /// Every GPU's elements of every mode, as the group builds them.
    fn shards(t: &SparseTensor, plan: &RowShards) -> Vec<Vec<Vec<u32>>> {
        let stride = plan.stride();
        (0..t.nmodes())
            .map(|mode| {
                let mut buf = vec![0u32; t.nnz() * stride];
                let offsets = plan.fill_elements(t, mode, &mut buf).unwrap();
                (0..plan.gpus())
                    .map(|g| {
                        buf[offsets[g] as usize * stride..offsets[g + 1] as usize * stride].to_vec()
                    })
                    .collect()
            })
            .collect()
    }

    /// The rows GPU `h` reads in `mode`, found the slow way: the mode's
    /// index of every nonzero whose row in some other mode `h` owns.
    fn read_by(t: &SparseTensor, plan: &RowShards, mode: usize, h: usize) -> Vec<bool> {
        let mut read = vec![false; t.dims()[mode] as usize];
        for k in 0..t.nnz() {
            let holds = (0..t.nmodes()).any(|w| {
                w != mode
                    && plan
                        .rows(w, h)
                        .contains(&plan.relabel(w)[t.indices()[w][k] as usize])
            });
            if holds {
                read[plan.relabel(mode)[t.indices()[mode][k] as usize] as usize] = true;
            }
        }
        read
    }

    fn check(t: &SparseTensor, gpus: usize) {
        let plan = RowShards::new(t, gpus).unwrap();
        let readers = RowReaders::new(&plan).unwrap();
        for (mode, per_gpu) in shards(t, &plan).iter().enumerate() {
            for (g, elems) in per_gpu.iter().enumerate() {
                readers.mark(g, mode, elems).unwrap();
            }
        }
        let lists = readers.lists(&plan).unwrap();
        for mode in 0..t.nmodes() {
            let l = lists.mode(mode);
            for h in 0..gpus {
                let read = read_by(t, &plan, mode, h);
                // Exactly the rows h reads and does not own, each once,
                // from its owner, in increasing order.
                let mut got = vec![false; read.len()];
                for o in 0..gpus {
                    let rows = l.rows(o, h);
                    assert!(rows.windows(2).all(|w| w[0] < w[1]));
                    for &row in rows {
                        assert_ne!(o, h);
                        assert!(plan.rows(mode, o).contains(&row));
                        assert!(!got[row as usize]);
                        got[row as usize] = true;
                    }
                }
                for (row, (&r, &g)) in read.iter().zip(&got).enumerate() {
                    let owned = plan.rows(mode, h).contains(&(row as u32));
                    assert_eq!(g, r && !owned, "mode {mode} row {row} GPU {h}");
                }
                assert_eq!(l.received(h), got.iter().filter(|&&x| x).count() as u64);
            }
            assert_eq!(l.total(), (0..gpus).map(|h| l.received(h)).sum::<u64>());
        }
        // The bitmaps carry the same marks.
        let mut again = RowReaders::new(&plan).unwrap();
        for g in 0..gpus {
            again.merge_bitmap(g, &readers.bitmap(g)).unwrap();
        }
        let relisted = again.lists(&plan).unwrap();
        for mode in 0..t.nmodes() {
            for o in 0..gpus {
                for h in 0..gpus {
                    assert_eq!(relisted.mode(mode).rows(o, h), lists.mode(mode).rows(o, h));
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn the_lists_hold_exactly_the_rows_each_gpu_reads_and_does_not_own(
            d0 in 1u32..40, d1 in 1u32..40, d2 in 1u32..300,
            nnz in 1usize..400, gpus in 1usize..6, seed in any::<u64>(),
        ) {
            let t = power_law(&PowerLawSpec::new(vec![d0, d1, d2], nnz).with_seed(seed).with_draws())
                .unwrap();
            check(&t, gpus);
        }
    }

    #[test]
    fn rows_no_gpu_reads_are_never_sent_and_a_sparse_mode_is_cheaper() {
        // A long third mode of which few rows hold nonzeros: most rows are
        // read by no GPU, so the sparse exchange is chosen for it.
        let t = power_law(&PowerLawSpec::new(vec![30, 20, 5000], 600).with_seed(3)).unwrap();
        let plan = RowShards::new(&t, 4).unwrap();
        let readers = RowReaders::new(&plan).unwrap();
        for (mode, per_gpu) in shards(&t, &plan).iter().enumerate() {
            for (g, elems) in per_gpu.iter().enumerate() {
                readers.mark(g, mode, elems).unwrap();
            }
        }
        let lists = readers.lists(&plan).unwrap();
        let used = {
            let mut seen = vec![false; 5000];
            for &i in &t.indices()[2] {
                seen[i as usize] = true;
            }
            seen.iter().filter(|&&s| s).count() as u64
        };
        assert!(lists.mode(2).total() <= 3 * used);
        assert!(lists.mode(2).cheaper_than_all_gather(&plan, 2));
        check(&t, 4);
    }

    #[test]
    fn a_split_plans_cut_mode_is_read_by_its_owners_alone() {
        let t = power_law(&PowerLawSpec::new(vec![30, 20, 5000], 3000).with_seed(9)).unwrap();
        let mut plan = RowShards::new(&t, 3).unwrap();
        plan.split_by(2).unwrap();
        let readers = RowReaders::new(&plan).unwrap();
        for (mode, per_gpu) in shards(&t, &plan).iter().enumerate() {
            for (g, elems) in per_gpu.iter().enumerate() {
                readers.mark(g, mode, elems).unwrap();
            }
        }
        let lists = readers.lists(&plan).unwrap();
        // The cut mode never travels; the short modes are read by several
        // GPUs each.
        assert_eq!(lists.mode(2).total(), 0);
        assert!(lists.mode(0).total() > 0 && lists.mode(1).total() > 0);
    }

    #[test]
    fn modes_not_wanted_are_not_marked() {
        let t = power_law(&PowerLawSpec::new(vec![30, 20, 500], 900).with_seed(5)).unwrap();
        let plan = RowShards::new(&t, 3).unwrap();
        let all = RowReaders::new(&plan).unwrap();
        let some = RowReaders::for_modes(&plan, &[false, true, false]).unwrap();
        for (mode, per_gpu) in shards(&t, &plan).iter().enumerate() {
            for (g, elems) in per_gpu.iter().enumerate() {
                all.mark(g, mode, elems).unwrap();
                some.mark(g, mode, elems).unwrap();
            }
        }
        let (all, some_lists) = (all.lists(&plan).unwrap(), some.lists(&plan).unwrap());
        assert_eq!(some_lists.mode(0).total(), 0);
        assert_eq!(some_lists.mode(2).total(), 0);
        assert!(all.mode(0).total() > 0);
        for o in 0..3 {
            for h in 0..3 {
                assert_eq!(some_lists.mode(1).rows(o, h), all.mode(1).rows(o, h));
            }
        }
        assert_eq!(some.bitmap_words(), 1);
        assert!(RowReaders::for_modes(&plan, &[true]).is_err());
    }

    #[test]
    fn bad_arguments_are_errors() {
        let t = power_law(&PowerLawSpec::new(vec![10, 10, 10], 50)).unwrap();
        let plan = RowShards::new(&t, 2).unwrap();
        let mut readers = RowReaders::new(&plan).unwrap();
        assert!(readers.mark(2, 0, &[]).is_err());
        assert!(readers.mark(0, 3, &[]).is_err());
        assert!(readers.mark(0, 0, &[1, 2, 3]).is_err());
        assert!(readers.mark(0, 0, &[0, 10, 0, 0]).is_err());
        assert!(readers.merge_bitmap(0, &[0]).is_err());
        let other = RowShards::new(&t, 3).unwrap();
        assert!(readers.lists(&other).is_err());
        let big = RowShards::new(&t, MAX_GPUS + 1).unwrap();
        assert!(RowReaders::new(&big).is_err());
    }
}
