//! F-COO (flagged coordinate), the format of "A Unified Optimization Approach
//! for Sparse Tensor Operations on GPUs" (Liu et al., Cluster 2017).
//!
//! An F-COO is built for one operation on one mode. The modes split into
//! *index modes*, whose indices say where a result goes, and *product modes*,
//! whose indices select the factor rows a nonzero is multiplied with:
//!
//! | operation          | index modes          | product modes        |
//! |--------------------|----------------------|----------------------|
//! | MTTKRP on mode `d` | `[d]`                | the others, in order |
//! | SpTTM on mode `n`  | the others, in order | `[n]`                |
//!
//! The nonzeros are sorted so that nonzeros with equal index-mode coordinates
//! are adjacent; each run of them is a *segment* (an output row of an
//! MTTKRP, a mode-`n` fiber of an SpTTM). Only the product-mode indices are
//! stored per nonzero; where a segment ends is one bit per nonzero. A kernel
//! then reduces segments with a segmented scan over the nonzeros, which keeps
//! every thread busy however uneven the segments are.
//!
//! # Layout
//!
//! For `nnz` nonzeros, `S` segments, `P` product modes and `I` index modes:
//!
//! - `product_idx[p][k]`, `P x nnz` u32: mode-`product_modes[p]` index of
//!   nonzero `k` (in F-COO order);
//! - `values[k]`, `nnz` f32;
//! - `bit_flags`, `ceil(nnz / 32)` u32 words: bit `k % 32` of word `k / 32`
//!   is 1 iff nonzero `k` is the **last** nonzero of its segment. (The paper
//!   marks the last nonzero with a 0 and every other with a 1; we store the
//!   complement so that counting set bits counts segments and bits past
//!   `nnz` are 0.) Segment `s` of nonzero `k` is the number of set bits
//!   before `k`;
//! - `start_flags`, `ceil(ceil(nnz / threadlen) / 32)` u32 words: bit `c` is
//!   1 iff *thread chunk* `c` (nonzeros `c * threadlen ..`) begins a new
//!   segment, that is `c == 0` or nonzero `c * threadlen - 1` ended one. A
//!   GPU thread reads its start flag to know whether it must carry a partial
//!   sum in from its left neighbour;
//! - `segment_idx[i][s]`, `I x S` u32: the mode-`index_modes[i]` coordinate
//!   of segment `s`. This list is our deviation from the paper, which numbers
//!   output rows by counting segments and so assumes no empty slices; real
//!   tensors have empty slices.
//!
//! # Storage cost
//!
//! `bytes = 4 * nnz * (P + 1) + 4 * ceil(nnz / 32)
//!        + 4 * ceil(nnz / (32 * threadlen)) + 4 * S * I`,
//! about `(4 (P + 1) + 1/8 + 1/(8 * threadlen)) * nnz + 4 * I * S`. For a
//! 3-mode MTTKRP this is the paper's `(12 + 1/8 + 1/(8 * threadlen))` bytes
//! per nonzero (Table II) plus 4 bytes per nonempty output row; COO takes 16.
//!
//! Nonzeros and segments are addressed with 32-bit integers on the GPU, so
//! an F-COO holds at most `u32::MAX` nonzeros ([`Fcoo::check_capacity`]).

use rayon::prelude::*;

use crate::coo::SparseTensor;

/// Chunk-start bits for chunks of `threadlen` nonzeros: bit `c` is set iff
/// chunk `c` is the first or nonzero `c * threadlen - 1` ends a segment.
fn chunk_starts(bit_flags: &[u32], nnz: usize, threadlen: usize) -> Vec<u32> {
    let ends_at = |k: usize| bit_flags[k / 32] >> (k % 32) & 1 == 1;
    let chunks = nnz.div_ceil(threadlen);
    (0..chunks.div_ceil(32))
        .into_par_iter()
        .map(|w| {
            (w * 32..chunks.min(w * 32 + 32))
                .filter(|&c| c == 0 || ends_at(c * threadlen - 1))
                .fold(0u32, |word, c| word | 1 << (c % 32))
        })
        .collect()
}
use crate::error::{FormatError, Result};

/// The operation an [`Fcoo`] was built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FcooOp {
    /// MTTKRP with output mode `mode` ([`Fcoo::for_mttkrp`]).
    Mttkrp { mode: usize },
    /// Tensor-times-matrix along `mode` ([`Fcoo::for_ttm`]).
    Ttm { mode: usize },
}

/// A sparse tensor in F-COO form for one operation on one mode; see the
/// [module documentation](self) for the layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Fcoo {
    dims: Vec<u32>,
    op: FcooOp,
    index_modes: Vec<usize>,
    product_modes: Vec<usize>,
    threadlen: usize,
    product_idx: Vec<Vec<u32>>,
    values: Vec<f32>,
    bit_flags: Vec<u32>,
    start_flags: Vec<u32>,
    segment_idx: Vec<Vec<u32>>,
    segments: usize,
    /// The product mode ordering nonzeros within a segment (MTTKRP only).
    fiber_mode: Option<usize>,
}

impl Fcoo {
    /// The largest accepted `threadlen` (nonzeros per GPU thread).
    pub const MAX_THREADLEN: usize = 256;

    /// F-COO for an MTTKRP with output mode `mode`: index modes `[mode]`,
    /// product modes the others in natural order.
    ///
    /// Nonzeros are sorted by the mode-`mode` index, then by the index of the
    /// other mode with the smallest dimension (it repeats most, so
    /// neighbouring nonzeros reuse factor rows; ties go to the lower mode),
    /// then by their position in `tensor`, so the order is fully determined.
    ///
    /// Errors: `mode` out of range or a bad `threadlen` (a power of two in
    /// `1..=256`) is [`FormatError::Argument`]; more than `u32::MAX`
    /// nonzeros is [`FormatError::Capacity`]. Cost: one parallel sort, one
    /// gather of every array; memory about one copy of the tensor plus 16
    /// bytes per nonzero of scratch.
    pub fn for_mttkrp(tensor: &SparseTensor, mode: usize, threadlen: usize) -> Result<Fcoo> {
        check_mode(tensor, mode)?;
        let dims = tensor.dims();
        let product_modes: Vec<usize> = (0..tensor.nmodes()).filter(|&w| w != mode).collect();
        let mut key_modes = vec![mode];
        // min_by_key keeps the first of equal dimensions: the lower mode.
        if let Some(&second) = product_modes.iter().min_by_key(|&&w| dims[w]) {
            key_modes.push(second);
        }
        Self::build(
            tensor,
            FcooOp::Mttkrp { mode },
            vec![mode],
            product_modes,
            &key_modes,
            threadlen,
        )
    }

    /// F-COO for a tensor-times-matrix along `mode`: product modes `[mode]`,
    /// index modes the others in natural order. Nonzeros are sorted
    /// lexicographically by the index modes, then by position, so segments
    /// are the mode-`mode` fibers in lexicographic order.
    ///
    /// Errors and cost as [`Fcoo::for_mttkrp`].
    pub fn for_ttm(tensor: &SparseTensor, mode: usize, threadlen: usize) -> Result<Fcoo> {
        check_mode(tensor, mode)?;
        let index_modes: Vec<usize> = (0..tensor.nmodes()).filter(|&w| w != mode).collect();
        let key_modes = index_modes.clone();
        Self::build(
            tensor,
            FcooOp::Ttm { mode },
            index_modes,
            vec![mode],
            &key_modes,
            threadlen,
        )
    }

    /// Checks that an F-COO can address `nnz` nonzeros with 32-bit integers
    /// (segments never outnumber nonzeros).
    pub fn check_capacity(nnz: u64) -> Result<()> {
        if nnz > u64::from(u32::MAX) {
            return Err(FormatError::Capacity {
                format: "F-COO",
                message: format!(
                    "{nnz} nonzeros; 32-bit nonzero and segment numbers hold at most {}",
                    u32::MAX
                ),
            });
        }
        Ok(())
    }

    /// Checks that `threadlen` is a power of two in `1..=256`.
    pub fn check_threadlen(threadlen: usize) -> Result<()> {
        if !threadlen.is_power_of_two() || threadlen > Self::MAX_THREADLEN {
            return Err(FormatError::Argument(format!(
                "F-COO threadlen {threadlen} must be a power of two from 1 to {}",
                Self::MAX_THREADLEN
            )));
        }
        Ok(())
    }

    fn build(
        tensor: &SparseTensor,
        op: FcooOp,
        index_modes: Vec<usize>,
        product_modes: Vec<usize>,
        key_modes: &[usize],
        threadlen: usize,
    ) -> Result<Fcoo> {
        Self::check_threadlen(threadlen)?;
        Self::check_capacity(tensor.nnz() as u64)?;
        let nnz = tensor.nnz();
        let perm = sort_permutation(tensor, key_modes);
        let gather = |src: &[u32]| -> Vec<u32> { perm.par_iter().map(|&p| src[p]).collect() };
        let product_idx: Vec<Vec<u32>> = product_modes
            .iter()
            .map(|&w| gather(tensor.mode_indices(w)))
            .collect();
        let values: Vec<f32> = perm.par_iter().map(|&p| tensor.values()[p]).collect();
        let index_idx: Vec<Vec<u32>> = index_modes
            .iter()
            .map(|&w| gather(tensor.mode_indices(w)))
            .collect();
        drop(perm);

        // Nonzero k ends a segment iff it is the last or its successor has
        // other index-mode coordinates.
        let ends = |k: usize| k + 1 == nnz || index_idx.iter().any(|idx| idx[k] != idx[k + 1]);
        let bit_flags: Vec<u32> = (0..nnz.div_ceil(32))
            .into_par_iter()
            .map(|w| {
                (w * 32..nnz.min(w * 32 + 32))
                    .filter(|&k| ends(k))
                    .fold(0u32, |word, k| word | 1 << (k % 32))
            })
            .collect();
        let ends_at = |k: usize| bit_flags[k / 32] >> (k % 32) & 1 == 1;
        let start_flags = chunk_starts(&bit_flags, nnz, threadlen);

        // A segment's coordinates are those of its first nonzero.
        let firsts: Vec<usize> = (0..nnz)
            .into_par_iter()
            .filter(|&k| k == 0 || ends_at(k - 1))
            .collect();
        let segment_idx: Vec<Vec<u32>> = index_idx
            .iter()
            .map(|idx| firsts.par_iter().map(|&k| idx[k]).collect())
            .collect();

        Ok(Fcoo {
            dims: tensor.dims().to_vec(),
            op,
            index_modes,
            product_modes,
            threadlen,
            product_idx,
            values,
            bit_flags,
            start_flags,
            segment_idx,
            segments: firsts.len(),
            fiber_mode: match op {
                FcooOp::Mttkrp { .. } => key_modes.get(1).copied(),
                FcooOp::Ttm { .. } => None,
            },
        })
    }

    /// The tensor back in COO form: the same nonzeros in F-COO order, with
    /// bit-identical values.
    ///
    /// Cost: one pass over the nonzeros; memory one copy of the tensor.
    pub fn to_coo(&self) -> Result<SparseTensor> {
        let nmodes = self.dims.len();
        let nnz = self.nnz();
        let mut indices: Vec<Vec<u32>> = vec![Vec::new(); nmodes];
        for (&w, idx) in self.product_modes.iter().zip(&self.product_idx) {
            indices[w] = idx.clone();
        }
        let segment_of = self.segment_numbers();
        for (&w, seg_idx) in self.index_modes.iter().zip(&self.segment_idx) {
            indices[w] = segment_of
                .iter()
                .map(|&s| {
                    seg_idx.get(s as usize).copied().ok_or_else(|| {
                        FormatError::Invalid(format!(
                            "bit flags name segment {s}, the segment list has {}",
                            seg_idx.len()
                        ))
                    })
                })
                .collect::<Result<_>>()?;
        }
        debug_assert!(indices.iter().all(|idx| idx.len() == nnz));
        SparseTensor::new(self.dims.clone(), indices, self.values.clone())
    }

    /// The segment number of every nonzero (set bit flags before it).
    fn segment_numbers(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.nnz());
        let mut seg = 0u32;
        for k in 0..self.nnz() {
            out.push(seg);
            if self.ends_segment(k) {
                seg += 1;
            }
        }
        out
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    pub fn nmodes(&self) -> usize {
        self.dims.len()
    }

    /// The operation and mode this F-COO was built for.
    pub fn op(&self) -> FcooOp {
        self.op
    }

    /// Modes whose change starts a new segment.
    pub fn index_modes(&self) -> &[usize] {
        &self.index_modes
    }

    /// Modes whose indices are stored per nonzero.
    pub fn product_modes(&self) -> &[usize] {
        &self.product_modes
    }

    /// For an MTTKRP F-COO of two or more modes, the product mode whose
    /// index orders the nonzeros of a segment (the one of smallest
    /// dimension): nonzeros of a segment sharing its index are adjacent,
    /// a *fiber*, and share its factor row.
    pub fn fiber_mode(&self) -> Option<usize> {
        self.fiber_mode
    }

    /// The position of [`Fcoo::fiber_mode`] among the product modes.
    pub fn fiber_product(&self) -> Option<usize> {
        let w = self.fiber_mode?;
        self.product_modes.iter().position(|&m| m == w)
    }

    /// Fibers when the nonzeros are walked in runs of `run` (a GPU warp's
    /// range; a fiber is also cut where a run ends): the nonzeros ending a
    /// segment, a run, or a stretch of one fiber-mode index. An engine with
    /// fiber reuse gathers `fibers` rows of the fiber mode where one
    /// without gathers `nnz`. `None` without a fiber mode.
    ///
    /// Cost: one parallel pass over the nonzeros.
    pub fn fibers(&self, run: usize) -> Option<usize> {
        let idx = &self.product_idx[self.fiber_product()?];
        let nnz = self.nnz();
        let run = run.max(1);
        Some(
            (0..nnz)
                .into_par_iter()
                .filter(|&k| {
                    k + 1 == nnz
                        || (k + 1) % run == 0
                        || self.ends_segment(k)
                        || idx[k] != idx[k + 1]
                })
                .count(),
        )
    }

    /// The chunk-start bits ([`Fcoo::start_flags`]) this F-COO would have
    /// with `threadlen` nonzeros per thread: the only part of the layout
    /// that depends on it, so engines of several threadlens can share one
    /// sort. Errors: a bad `threadlen`, as [`Fcoo::for_mttkrp`].
    pub fn start_flags_for(&self, threadlen: usize) -> Result<Vec<u32>> {
        Self::check_threadlen(threadlen)?;
        Ok(chunk_starts(&self.bit_flags, self.nnz(), threadlen))
    }

    /// Nonzeros per GPU thread (a power of two in `1..=256`).
    pub fn threadlen(&self) -> usize {
        self.threadlen
    }

    /// One index array per product mode, in F-COO order.
    pub fn product_idx(&self) -> &[Vec<u32>] {
        &self.product_idx
    }

    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// Segment-end bits, 32 nonzeros per word (bit set: last of its segment).
    pub fn bit_flags(&self) -> &[u32] {
        &self.bit_flags
    }

    /// Chunk-start bits, 32 thread chunks per word (bit set: the chunk
    /// begins a new segment).
    pub fn start_flags(&self) -> &[u32] {
        &self.start_flags
    }

    /// One coordinate array per index mode, one entry per segment.
    pub fn segment_idx(&self) -> &[Vec<u32>] {
        &self.segment_idx
    }

    pub fn nnz(&self) -> usize {
        self.values.len()
    }

    /// Number of segments (output rows of an MTTKRP, fibers of an SpTTM).
    pub fn segments(&self) -> usize {
        self.segments
    }

    /// Number of thread chunks, `ceil(nnz / threadlen)`.
    pub fn chunks(&self) -> usize {
        self.nnz().div_ceil(self.threadlen)
    }

    /// Whether nonzero `k` is the last of its segment (false past `nnz`).
    pub fn ends_segment(&self, k: usize) -> bool {
        self.bit_flags
            .get(k / 32)
            .is_some_and(|w| w >> (k % 32) & 1 == 1)
    }

    /// Whether thread chunk `chunk` begins a new segment (false past the
    /// last chunk).
    pub fn chunk_starts_segment(&self, chunk: usize) -> bool {
        self.start_flags
            .get(chunk / 32)
            .is_some_and(|w| w >> (chunk % 32) & 1 == 1)
    }

    /// The segment holding nonzero `k` (`k < nnz`): the set bit flags before
    /// it. Cost: `k / 32` word popcounts.
    pub fn segment_of(&self, k: usize) -> usize {
        let whole: usize = self.bit_flags[..k / 32]
            .iter()
            .map(|w| w.count_ones() as usize)
            .sum();
        let part = self
            .bit_flags
            .get(k / 32)
            .map_or(0, |w| (w & ((1u32 << (k % 32)) - 1)).count_ones() as usize);
        whole + part
    }

    /// The segment holding the first nonzero of thread chunk `chunk`.
    pub fn segment_of_chunk(&self, chunk: usize) -> usize {
        self.segment_of(chunk * self.threadlen)
    }

    /// Bytes of all arrays (see the module documentation for the formula).
    pub fn bytes(&self) -> usize {
        4 * (self.product_idx.iter().map(Vec::len).sum::<usize>()
            + self.values.len()
            + self.bit_flags.len()
            + self.start_flags.len()
            + self.segment_idx.iter().map(Vec::len).sum::<usize>())
    }

    /// [`Fcoo::bytes`] per nonzero (0 for an empty tensor).
    pub fn bytes_per_nnz(&self) -> f64 {
        if self.nnz() == 0 {
            0.0
        } else {
            self.bytes() as f64 / self.nnz() as f64
        }
    }
}

fn check_mode(tensor: &SparseTensor, mode: usize) -> Result<()> {
    if mode >= tensor.nmodes() {
        return Err(FormatError::Argument(format!(
            "mode {mode} of a {}-mode tensor",
            tensor.nmodes()
        )));
    }
    Ok(())
}

/// Bits needed for the indices `0..dim`.
fn index_bits(dim: u32) -> u32 {
    u32::BITS - dim.saturating_sub(1).leading_zeros()
}

/// The permutation that sorts the nonzeros lexicographically by `modes`,
/// then by position.
///
/// When the indices and the position fit in 128 bits (always for two modes)
/// this is one parallel sort of packed keys, which scales with cores;
/// otherwise a stable comparison sort over the index columns.
pub(crate) fn sort_permutation(tensor: &SparseTensor, modes: &[usize]) -> Vec<usize> {
    let nnz = tensor.nnz();
    let pos_bits = u64::BITS - (nnz as u64).leading_zeros();
    let widths: Vec<u32> = modes
        .iter()
        .map(|&w| index_bits(tensor.dims()[w]))
        .collect();
    if widths.iter().sum::<u32>() + pos_bits > u128::BITS {
        return tensor.sort_permutation(modes);
    }
    let cols: Vec<&[u32]> = modes.iter().map(|&w| tensor.mode_indices(w)).collect();
    let mut keys: Vec<u128> = (0..nnz)
        .into_par_iter()
        .map(|k| {
            let mut key = 0u128;
            for (col, &bits) in cols.iter().zip(&widths) {
                key = (key << bits) | u128::from(col[k]);
            }
            (key << pos_bits) | k as u128
        })
        .collect();
    keys.par_sort_unstable();
    let pos_mask = (1u128 << pos_bits) - 1;
    keys.into_par_iter()
        .map(|key| (key & pos_mask) as usize)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The nonzeros as (coordinates, value bits), sorted, for multiset
    /// comparison.
    fn multiset(t: &SparseTensor) -> Vec<(Vec<u32>, u32)> {
        let mut v: Vec<(Vec<u32>, u32)> = (0..t.nnz())
            .map(|k| {
                let coord = (0..t.nmodes()).map(|w| t.mode_indices(w)[k]).collect();
                (coord, t.values()[k].to_bits())
            })
            .collect();
        v.sort();
        v
    }

    /// Random tensors with small dimensions (duplicates are likely) and
    /// dimensions larger than the indices used (empty slices).
    fn tensor_strategy() -> impl Strategy<Value = SparseTensor> {
        (3usize..=6, 0usize..400, any::<u64>()).prop_map(|(nmodes, nnz, seed)| {
            let mut x = seed | 1;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let dims: Vec<u32> = (0..nmodes).map(|_| 1 + (next() % 12) as u32).collect();
            // Indices use only the lower part of each mode: empty slices.
            let indices = dims
                .iter()
                .map(|&d| {
                    let used = u64::from(d.div_ceil(2).max(1));
                    (0..nnz).map(|_| (next() % used) as u32).collect()
                })
                .collect();
            let values = (0..nnz)
                .map(|_| (next() % 2001) as f32 / 7.0 - 100.0)
                .collect();
            SparseTensor::new(dims, indices, values).unwrap()
        })
    }

    /// Everything a kernel relies on, checked against the definitions.
    fn check_invariants(t: &SparseTensor, f: &Fcoo) {
        assert_eq!(f.nnz(), t.nnz());
        assert_eq!(f.bit_flags().len(), f.nnz().div_ceil(32));
        assert_eq!(f.start_flags().len(), f.chunks().div_ceil(32));
        let set_bits: usize = f.bit_flags().iter().map(|w| w.count_ones() as usize).sum();
        assert_eq!(set_bits, f.segments());
        for idx in f.segment_idx() {
            assert_eq!(idx.len(), f.segments());
        }
        for c in 0..f.chunks() {
            let derived = c == 0 || f.ends_segment(c * f.threadlen() - 1);
            assert_eq!(f.chunk_starts_segment(c), derived, "chunk {c}");
        }
        assert!(!f.chunk_starts_segment(f.chunks()));
        if f.nnz() > 0 {
            assert!(f.ends_segment(f.nnz() - 1));
        }
        // Segment coordinates strictly increase (lexicographically).
        for s in 1..f.segments() {
            let a: Vec<u32> = f.segment_idx().iter().map(|idx| idx[s - 1]).collect();
            let b: Vec<u32> = f.segment_idx().iter().map(|idx| idx[s]).collect();
            assert!(a < b, "segments {} and {s}: {a:?} then {b:?}", s - 1);
        }
        // An MTTKRP's segments are sorted by the smallest other mode.
        if let (FcooOp::Mttkrp { .. }, Some(second)) = (
            f.op(),
            (0..f.product_modes().len()).min_by_key(|&p| t.dims()[f.product_modes()[p]]),
        ) {
            let idx = &f.product_idx()[second];
            for k in 1..f.nnz() {
                if !f.ends_segment(k - 1) {
                    assert!(
                        idx[k - 1] <= idx[k],
                        "nonzeros {} and {k} out of order",
                        k - 1
                    );
                }
            }
        }
        let mut modes: Vec<usize> = f.index_modes().to_vec();
        modes.extend(f.product_modes());
        modes.sort();
        assert_eq!(modes, (0..t.nmodes()).collect::<Vec<_>>());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn round_trip_and_flags(
            t in tensor_strategy(),
            log_threadlen in 0u32..=8,
            mode_seed in any::<usize>(),
        ) {
            let threadlen = 1usize << log_threadlen;
            let mode = mode_seed % t.nmodes();
            for f in [
                Fcoo::for_mttkrp(&t, mode, threadlen).unwrap(),
                Fcoo::for_ttm(&t, mode, threadlen).unwrap(),
            ] {
                check_invariants(&t, &f);
                let back = f.to_coo().unwrap();
                prop_assert_eq!(back.dims(), t.dims());
                prop_assert_eq!(multiset(&back), multiset(&t));
            }
            // Start flags for another threadlen match a fresh build's.
            let other = 1usize << ((log_threadlen + 3) % 9);
            let f = Fcoo::for_mttkrp(&t, mode, threadlen).unwrap();
            let g = Fcoo::for_mttkrp(&t, mode, other).unwrap();
            prop_assert_eq!(f.start_flags_for(other).unwrap(), g.start_flags().to_vec());
        }
    }

    #[test]
    fn mttkrp_order_and_segments() {
        // dims: mode 2 is the smallest other mode for mode 0.
        let t = SparseTensor::new(
            vec![5, 4, 3],
            vec![
                vec![3, 1, 3, 1, 3, 1],
                vec![0, 2, 1, 3, 0, 0],
                vec![2, 1, 0, 1, 1, 2],
            ],
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        )
        .unwrap();
        let f = Fcoo::for_mttkrp(&t, 0, 1).unwrap();
        assert_eq!(f.op(), FcooOp::Mttkrp { mode: 0 });
        assert_eq!(f.index_modes(), &[0]);
        assert_eq!(f.product_modes(), &[1, 2]);
        // Row 1: (k=1 @1, k=1 @3, k=2 @5); row 3: (k=0 @2, k=1 @4, k=2 @0).
        assert_eq!(f.values(), &[2.0, 4.0, 6.0, 3.0, 5.0, 1.0]);
        assert_eq!(f.product_idx()[1], vec![1, 1, 2, 0, 1, 2]);
        assert_eq!(f.segment_idx(), &[vec![1, 3]]);
        // Fibers: the nonzeros of row 1 with k = 1 share one; every other
        // nonzero is a fiber of its own. Runs of 1 cut every fiber.
        assert_eq!((f.fiber_mode(), f.fiber_product()), (Some(2), Some(1)));
        assert_eq!(f.fibers(1 << 20), Some(5));
        assert_eq!(f.fibers(3), Some(5));
        assert_eq!(f.fibers(1), Some(6));
        assert_eq!(Fcoo::for_ttm(&t, 0, 1).unwrap().fibers(32), None);
        assert_eq!(f.bit_flags(), &[0b100100]);
        // One nonzero per chunk: chunks 0 and 3 start rows.
        assert_eq!(f.start_flags(), &[0b001001]);
        assert_eq!(f.segment_of_chunk(2), 0);
        assert_eq!(f.segment_of_chunk(3), 1);
        // Two per chunk: chunk 1 (nonzeros 2, 3) starts inside row 1.
        let one = f.clone();
        let f = Fcoo::for_mttkrp(&t, 0, 2).unwrap();
        assert_eq!(f.start_flags(), &[0b001]);
        // Another threadlen's flags from a built F-COO are that F-COO's.
        assert_eq!(one.start_flags_for(2).unwrap(), f.start_flags());
        assert_eq!(f.start_flags_for(1).unwrap(), one.start_flags());
        assert!(f.start_flags_for(3).is_err());
        assert_eq!(f.segment_of_chunk(2), 1);
    }

    #[test]
    fn ttm_segments_are_fibers() {
        let t = SparseTensor::new(
            vec![2, 2, 3],
            vec![vec![1, 0, 1, 0], vec![0, 1, 0, 1], vec![2, 0, 1, 1]],
            vec![1.0, 2.0, 3.0, 4.0],
        )
        .unwrap();
        let f = Fcoo::for_ttm(&t, 2, 1).unwrap();
        assert_eq!(f.index_modes(), &[0, 1]);
        assert_eq!(f.product_modes(), &[2]);
        assert_eq!(f.segments(), 2);
        assert_eq!(f.segment_idx(), &[vec![0, 1], vec![1, 0]]);
        assert_eq!(f.product_idx(), &[vec![0, 1, 2, 1]]);
        assert_eq!(f.values(), &[2.0, 4.0, 1.0, 3.0]);
    }

    #[test]
    fn bad_threadlen_and_mode_are_rejected() {
        let t =
            SparseTensor::new(vec![2, 2, 2], vec![vec![0], vec![1], vec![0]], vec![1.0]).unwrap();
        for threadlen in [0, 3, 12, 512] {
            let err = Fcoo::for_mttkrp(&t, 0, threadlen).unwrap_err();
            assert!(matches!(err, FormatError::Argument(_)), "{err}");
            let err = Fcoo::for_ttm(&t, 0, threadlen).unwrap_err();
            assert!(matches!(err, FormatError::Argument(_)), "{err}");
        }
        assert!(matches!(
            Fcoo::for_mttkrp(&t, 3, 8),
            Err(FormatError::Argument(_))
        ));
        assert!(matches!(
            Fcoo::for_ttm(&t, 3, 8),
            Err(FormatError::Argument(_))
        ));
    }

    #[test]
    fn capacity_is_checked() {
        assert!(Fcoo::check_capacity(u64::from(u32::MAX)).is_ok());
        let err = Fcoo::check_capacity(5_000_000_000).unwrap_err();
        assert!(
            matches!(
                err,
                FormatError::Capacity {
                    format: "F-COO",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn empty_tensor_has_no_segments() {
        let t = SparseTensor::new(vec![3, 4, 5], vec![vec![], vec![], vec![]], vec![]).unwrap();
        let f = Fcoo::for_mttkrp(&t, 1, 8).unwrap();
        assert_eq!(f.segments(), 0);
        assert_eq!(f.bytes(), 0);
        assert_eq!(f.to_coo().unwrap(), t);
        assert_eq!(Fcoo::for_ttm(&t, 1, 8).unwrap().segments(), 0);
    }

    #[test]
    fn bytes_per_nnz_matches_the_formula() {
        // 3 modes, nnz a multiple of 32 * threadlen so no word is partial.
        for threadlen in [1usize, 8, 32] {
            let nnz = 32 * threadlen * 4;
            let rows = 10u32;
            let t = SparseTensor::new(
                vec![rows, nnz as u32, 5],
                vec![
                    (0..nnz).map(|k| (k % 10) as u32).collect(),
                    (0..nnz).map(|k| k as u32).collect(),
                    (0..nnz).map(|k| (k % 5) as u32).collect(),
                ],
                vec![1.0; nnz],
            )
            .unwrap();
            let f = Fcoo::for_mttkrp(&t, 0, threadlen).unwrap();
            assert_eq!(f.segments(), rows as usize);
            let paper = 12.0 + 1.0 / 8.0 + 1.0 / (8.0 * threadlen as f64);
            let expected = paper + 4.0 * f64::from(rows) / nnz as f64;
            assert!(
                (f.bytes_per_nnz() - expected).abs() < 1e-12,
                "threadlen {threadlen}: {} vs {expected}",
                f.bytes_per_nnz()
            );
        }
    }

    #[test]
    fn order_is_deterministic_with_equal_keys() {
        // Equal sort keys (row, then the smallest other mode, 1) keep their
        // input order: the position breaks ties.
        let t = SparseTensor::new(
            vec![2, 2, 3],
            vec![vec![1, 1, 1], vec![0, 0, 0], vec![2, 0, 1]],
            vec![3.0, 1.0, 2.0],
        )
        .unwrap();
        let f = Fcoo::for_mttkrp(&t, 0, 1).unwrap();
        assert_eq!(f.values(), &[3.0, 1.0, 2.0]);
        assert_eq!(f.segments(), 1);
    }

    #[test]
    fn wide_keys_fall_back_to_the_comparison_sort() {
        // Four index modes of 2^32 - 1 need 128 bits, more than fit with
        // the position: the comparison sort must give the same order.
        let big = u32::MAX;
        let t = SparseTensor::new(
            vec![big, big, big, big, 3],
            vec![
                vec![5, 5, 1, 5],
                vec![big - 1, 0, 2, big - 1],
                vec![0, 0, 0, 0],
                vec![9, 9, 9, 8],
                vec![0, 1, 2, 0],
            ],
            vec![1.0, 2.0, 3.0, 4.0],
        )
        .unwrap();
        let f = Fcoo::for_ttm(&t, 4, 4).unwrap();
        assert_eq!(f.values(), &[3.0, 2.0, 4.0, 1.0]);
        assert_eq!(f.segments(), 4);
        check_invariants(&t, &f);
    }
}
