//! HiCOO: the tensor cut into `2^b`-wide blocks per mode, with short in-block
//! offsets per nonzero (Li, Sun and Vuduc, SC'18; the format of the ParTI-GPU
//! baseline).
//!
//! # Layout
//!
//! The index space is tiled by blocks of `2^b` indices in every mode
//! (`b = block_bits`, 1 to 8). A nonzero with index `i_m` in mode `m` lies in
//! the block with coordinate `i_m >> b` and at offset `i_m & (2^b - 1)` inside
//! it. For `nblocks` non-empty blocks and `N` modes:
//!
//! | array                | length            | type  | holds                              |
//! |----------------------|-------------------|-------|------------------------------------|
//! | `block_ptr`          | `nblocks + 1`     | `u64` | block `k` is nonzeros `block_ptr[k]..block_ptr[k + 1]` |
//! | `block_coords[m]`    | `nblocks`, per mode | `u32` | the block's coordinate `i_m >> b` |
//! | `offsets[m]`         | `nnz`, per mode   | `u8`  | `i_m & (2^b - 1)`                  |
//! | `values`             | `nnz`             | `f32` | the value                          |
//!
//! So a HiCOO tensor takes `N + 4` bytes per nonzero plus `4N + 8` bytes per
//! block (and 8 more for the last `block_ptr` entry), against `4N + 4` bytes
//! per nonzero for COO: it is smaller when blocks hold more than
//! `(4N + 8) / (3N)` nonzeros on average (2.2 for three modes). For three
//! modes that is 7 + 20 / 3 = 13.7 bytes per nonzero at 3 nonzeros per block
//! and 7 + 1 = 8 at 20, against 16 for COO.
//!
//! # Order
//!
//! Blocks are in Morton (Z-curve) order of their block coordinates, mode 0
//! most significant at each bit level, so blocks near each other in space are
//! near each other in memory (factor rows stay in cache from one block to
//! the next). Inside a block, nonzeros are sorted lexicographically by their
//! offsets (mode 0 first), ties by their position in the source tensor, so
//! the layout is fully determined by the input.
//!
//! One copy serves every mode: unlike the per-mode sorted formats, HiCOO
//! does not prefer an output mode.

use std::cmp::Ordering;
use std::ops::Range;

use rayon::prelude::*;

use crate::coo::SparseTensor;
use crate::error::{FormatError, Result};

/// Nonzeros per parallel work item of the linear passes.
const PASS_CHUNK: usize = 1 << 16;
/// Runs of equal sort-key prefix longer than this are sorted in parallel.
const PAR_RUN: usize = 1 << 16;

/// A sparse tensor in HiCOO form (see the module documentation for the
/// layout and order).
#[derive(Clone, Debug, PartialEq)]
pub struct Hicoo {
    dims: Vec<u32>,
    block_bits: u8,
    block_ptr: Vec<u64>,
    block_coords: Vec<Vec<u32>>,
    offsets: Vec<Vec<u8>>,
    values: Vec<f32>,
}

impl Hicoo {
    /// The block width ParTI uses by default: `2^7 = 128` indices per mode.
    pub const DEFAULT_BLOCK_BITS: u8 = 7;
    /// In-block offsets are `u8`, so blocks are at most `2^8` wide.
    pub const MAX_BLOCK_BITS: u8 = 8;

    /// Checks that a HiCOO tensor with `2^block_bits`-wide blocks and
    /// `nblocks` non-empty blocks can be stored: `block_bits` in `1..=8`
    /// (0 is an [`FormatError::Argument`], more than 8 does not fit the `u8`
    /// offsets and is a [`FormatError::Capacity`]) and at most `u32::MAX`
    /// blocks (the GPU kernel numbers blocks with 32-bit ids).
    ///
    /// Cost: O(1); it allocates nothing, so it can be asked about any count.
    pub fn check_capacity(block_bits: u8, nblocks: u64) -> Result<()> {
        if block_bits == 0 {
            return Err(FormatError::Argument(
                "HiCOO block bits must be at least 1 (blocks 2^b wide)".into(),
            ));
        }
        if block_bits > Self::MAX_BLOCK_BITS {
            return Err(FormatError::Capacity {
                format: "HiCOO",
                message: format!(
                    "blocks 2^{block_bits} wide need in-block offsets of {block_bits} bits, \
                     but offsets are u8 (block bits at most {})",
                    Self::MAX_BLOCK_BITS
                ),
            });
        }
        if nblocks > u64::from(u32::MAX) {
            return Err(FormatError::Capacity {
                format: "HiCOO",
                message: format!(
                    "{nblocks} non-empty blocks, but block ids are 32-bit (at most {})",
                    u32::MAX
                ),
            });
        }
        Ok(())
    }

    /// Builds the HiCOO form of `tensor` with `2^block_bits`-wide blocks.
    /// Duplicate coordinates are kept as separate nonzeros.
    ///
    /// Errors: `block_bits` outside `1..=8`, or more than `u32::MAX` blocks
    /// (see [`Hicoo::check_capacity`]).
    ///
    /// Cost: one parallel sort of `nnz` 128-bit keys (the top 64 bits of
    /// each nonzero's Morton-then-offsets key, and its position), plus a
    /// comparison sort inside runs of equal keys when 64 bits do not hold the
    /// whole key (more than 64 bits of coordinates); then linear parallel
    /// passes. Scratch: 24 bytes per nonzero.
    pub fn new(tensor: &SparseTensor, block_bits: u8) -> Result<Self> {
        Self::check_capacity(block_bits, 0)?;
        let b = u32::from(block_bits);
        let idx = tensor.indices();
        let nnz = tensor.nnz();
        let perm = hicoo_permutation(tensor, b);

        // Sorted position i starts a block where its block differs from the
        // previous nonzero's.
        let starts: Vec<usize> = (0..nnz)
            .into_par_iter()
            .filter(|&i| {
                i == 0
                    || idx
                        .iter()
                        .any(|col| (col[perm[i - 1]] ^ col[perm[i]]) >> b != 0)
            })
            .collect();
        Self::check_capacity(block_bits, starts.len() as u64)?;

        let mask = (1u32 << b) - 1;
        let block_ptr: Vec<u64> = starts
            .iter()
            .map(|&s| s as u64)
            .chain(std::iter::once(nnz as u64))
            .collect();
        let block_coords: Vec<Vec<u32>> = idx
            .iter()
            .map(|col| starts.par_iter().map(|&s| col[perm[s]] >> b).collect())
            .collect();
        let offsets: Vec<Vec<u8>> = idx
            .iter()
            .map(|col| perm.par_iter().map(|&p| (col[p] & mask) as u8).collect())
            .collect();
        let values: Vec<f32> = perm.par_iter().map(|&p| tensor.values()[p]).collect();
        Ok(Hicoo {
            dims: tensor.dims().to_vec(),
            block_bits,
            block_ptr,
            block_coords,
            offsets,
            values,
        })
    }

    /// Converts back to COO: nonzeros in HiCOO order, values bit-identical.
    ///
    /// Cost: one parallel pass; memory of a COO copy.
    pub fn to_coo(&self) -> Result<SparseTensor> {
        let b = u32::from(self.block_bits);
        let nnz = self.nnz();
        let indices: Vec<Vec<u32>> = self
            .block_coords
            .iter()
            .zip(&self.offsets)
            .map(|(coords, offs)| {
                let mut col = vec![0u32; nnz];
                col.par_chunks_mut(PASS_CHUNK)
                    .enumerate()
                    .for_each(|(c, out)| {
                        let lo = c * PASS_CHUNK;
                        let mut k = self.block_of(lo);
                        for (i, slot) in (lo..).zip(out.iter_mut()) {
                            while self.block_ptr[k + 1] as usize <= i {
                                k += 1;
                            }
                            *slot = (coords[k] << b) | u32::from(offs[i]);
                        }
                    });
                col
            })
            .collect();
        SparseTensor::new(self.dims.clone(), indices, self.values.clone())
    }

    /// The block holding nonzero `i` (`i < nnz`).
    fn block_of(&self, i: usize) -> usize {
        self.block_ptr.partition_point(|&p| p as usize <= i) - 1
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// Number of modes.
    pub fn nmodes(&self) -> usize {
        self.dims.len()
    }

    /// `b`: blocks are `2^b` indices wide in every mode.
    pub fn block_bits(&self) -> u8 {
        self.block_bits
    }

    /// `2^b`, the number of indices a block spans in each mode.
    pub fn block_width(&self) -> usize {
        1 << self.block_bits
    }

    /// Number of stored nonzeros.
    pub fn nnz(&self) -> usize {
        self.values.len()
    }

    /// Number of non-empty blocks (the only ones stored).
    pub fn nblocks(&self) -> usize {
        self.block_ptr.len() - 1
    }

    /// `nblocks + 1` entries: block `k` holds nonzeros
    /// `block_ptr[k]..block_ptr[k + 1]`.
    pub fn block_ptr(&self) -> &[u64] {
        &self.block_ptr
    }

    /// The nonzeros of block `k` (`k < nblocks`).
    pub fn block_range(&self, k: usize) -> Range<usize> {
        self.block_ptr[k] as usize..self.block_ptr[k + 1] as usize
    }

    /// Block coordinates (`index >> b`), one vector per mode, one entry per
    /// block.
    pub fn block_coords(&self) -> &[Vec<u32>] {
        &self.block_coords
    }

    /// In-block offsets (`index & (2^b - 1)`), one vector per mode, one
    /// entry per nonzero.
    pub fn offsets(&self) -> &[Vec<u8>] {
        &self.offsets
    }

    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// Bytes of the format's arrays: `(N + 4) * nnz + (4N + 8) * nblocks + 8`
    /// for `N` modes.
    pub fn bytes(&self) -> usize {
        let n = self.nmodes();
        self.block_ptr.len() * 8 + self.nblocks() * 4 * n + self.nnz() * (n + 4)
    }

    /// [`Hicoo::bytes`] divided by the nonzero count (0 for an empty tensor).
    pub fn bytes_per_nnz(&self) -> f64 {
        if self.nnz() == 0 {
            0.0
        } else {
            self.bytes() as f64 / self.nnz() as f64
        }
    }

    /// Mean nonzeros per non-empty block (0 for an empty tensor).
    pub fn mean_block_nnz(&self) -> f64 {
        if self.nblocks() == 0 {
            0.0
        } else {
            self.nnz() as f64 / self.nblocks() as f64
        }
    }

    /// Most nonzeros in one block (0 for an empty tensor).
    pub fn max_block_nnz(&self) -> usize {
        self.block_ptr
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
    }
}

/// A share of one group of blocks (see [`Hicoo::block_groups`]): the blocks
/// at positions `pos_lo..pos_hi` of [`BlockGroups::order`], starting at
/// nonzero `nz_lo` of the first and ending before nonzero `nz_hi` of the
/// last. An unsplit group is one piece whose ends are its blocks' ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockPiece {
    pub pos_lo: usize,
    pub pos_hi: usize,
    pub nz_lo: usize,
    pub nz_hi: usize,
}

/// The non-empty blocks sharing block coordinate `coord` in one mode (every
/// nonzero of theirs lands in rows `coord * 2^b .. (coord + 1) * 2^b`), and
/// their pieces `pieces[piece_lo..piece_hi]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockGroup {
    pub coord: u32,
    pub piece_lo: usize,
    pub piece_hi: usize,
}

impl BlockGroup {
    /// Cut into more than one piece.
    pub fn is_split(&self) -> bool {
        self.piece_hi - self.piece_lo > 1
    }
}

/// The blocks of a [`Hicoo`] grouped by their block coordinate in one mode,
/// heavy groups cut into pieces: the work list of an MTTKRP of that mode
/// (one task or thread block per piece).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockGroups {
    /// Block ids sorted by (block coordinate in the mode, id): each group is
    /// a run.
    pub order: Vec<u32>,
    /// Groups by increasing coordinate.
    pub groups: Vec<BlockGroup>,
    /// Pieces in group order.
    pub pieces: Vec<BlockPiece>,
}

impl Hicoo {
    /// Groups the blocks by their block coordinate in `mode` (`mode <
    /// nmodes`) and cuts every group of more than `split_nnz` (at least 1)
    /// nonzeros into `ceil(nnz / split_nnz)` pieces of about equal nonzero
    /// count, cut points inside blocks allowed. Every piece holds a nonzero.
    ///
    /// Cost: a parallel sort of `nblocks` 64-bit keys and one pass over the
    /// blocks.
    pub fn block_groups(&self, mode: usize, split_nnz: usize) -> BlockGroups {
        let coords = &self.block_coords[mode];
        let mut keys: Vec<u64> = coords
            .par_iter()
            .enumerate()
            .map(|(k, &c)| (u64::from(c) << 32) | k as u64)
            .collect();
        keys.par_sort_unstable();
        // Block ids fit 32 bits: `new` checks there are at most u32::MAX.
        let order: Vec<u32> = keys.into_par_iter().map(|key| key as u32).collect();
        let mut groups = Vec::new();
        let mut pieces = Vec::new();
        let mut lo = 0;
        while lo < order.len() {
            let coord = coords[order[lo] as usize];
            let hi = lo + order[lo..].partition_point(|&k| coords[k as usize] == coord);
            let piece_lo = pieces.len();
            cut_group(&order, lo..hi, &self.block_ptr, split_nnz, &mut pieces);
            groups.push(BlockGroup {
                coord,
                piece_lo,
                piece_hi: pieces.len(),
            });
            lo = hi;
        }
        BlockGroups {
            order,
            groups,
            pieces,
        }
    }
}

/// Appends the pieces of the group made of the blocks `order[span]`: one
/// piece if it holds at most `split_nnz` nonzeros, otherwise
/// `ceil(nnz / split_nnz)` pieces of about equal nonzero count.
fn cut_group(
    order: &[u32],
    span: Range<usize>,
    block_ptr: &[u64],
    split_nnz: usize,
    pieces: &mut Vec<BlockPiece>,
) {
    let start = |p: usize| block_ptr[order[p] as usize] as usize;
    let end = |p: usize| block_ptr[order[p] as usize + 1] as usize;
    let nnz: usize = span.clone().map(|p| end(p) - start(p)).sum();
    // At most nnz pieces (split_nnz >= 1), so the cut targets below are
    // strictly increasing and every piece holds a nonzero.
    let npieces = nnz.div_ceil(split_nnz.max(1)).max(1);
    let mut cur = BlockPiece {
        pos_lo: span.start,
        pos_hi: span.end,
        nz_lo: start(span.start),
        nz_hi: end(span.end - 1),
    };
    let mut cut = 1;
    // Nonzeros of the group before block position p.
    let mut before = 0;
    for p in span.clone() {
        let len = end(p) - start(p);
        while cut < npieces {
            let target = cut * nnz / npieces;
            if target >= before + len {
                break;
            }
            // The cut falls at nonzero `target - before` of block p (> 0 for
            // the first block: targets are at least 1).
            let at = start(p) + (target - before);
            if target == before {
                (cur.pos_hi, cur.nz_hi) = (p, end(p - 1));
            } else {
                (cur.pos_hi, cur.nz_hi) = (p + 1, at);
            }
            pieces.push(cur);
            cur = BlockPiece {
                pos_lo: p,
                pos_hi: span.end,
                nz_lo: at,
                nz_hi: end(span.end - 1),
            };
            cut += 1;
        }
        before += len;
    }
    pieces.push(cur);
}

/// Morton (Z-curve) order of two points given by their coordinates (same
/// length, any number of dimensions, 32-bit coordinates), mode 0 most
/// significant at each bit level.
///
/// Compares without building the interleaved key: the mode whose
/// coordinates differ in the highest bit decides (Chan's XOR trick: `x`
/// has a lower most significant bit than `y` iff `x < y && x < x ^ y`).
pub fn morton_cmp(a: &[u32], b: &[u32]) -> Ordering {
    let mut decider = None;
    let mut top = 0u32;
    for (m, (&x, &y)) in a.iter().zip(b).enumerate() {
        let diff = x ^ y;
        if msb_below(top, diff) {
            top = diff;
            decider = Some(m);
        }
    }
    decider.map_or(Ordering::Equal, |m| a[m].cmp(&b[m]))
}

/// Whether the most significant set bit of `x` is below that of `y`
/// (0 has none).
#[inline]
fn msb_below(x: u32, y: u32) -> bool {
    x < y && x < (x ^ y)
}

/// [`morton_cmp`] of the blocks of nonzeros `x` and `y` (coordinates
/// `index >> b`), read column by column.
fn block_cmp(idx: &[Vec<u32>], b: u32, x: usize, y: usize) -> Ordering {
    let mut decider = None;
    let mut top = 0u32;
    for (m, col) in idx.iter().enumerate() {
        let diff = (col[x] >> b) ^ (col[y] >> b);
        if msb_below(top, diff) {
            top = diff;
            decider = Some(m);
        }
    }
    decider.map_or(Ordering::Equal, |m| (idx[m][x] >> b).cmp(&(idx[m][y] >> b)))
}

/// The HiCOO order of two nonzeros: Morton order of their blocks, then
/// their offsets lexicographically, then their position.
fn nonzero_cmp(idx: &[Vec<u32>], b: u32, x: usize, y: usize) -> Ordering {
    let mask = (1u32 << b) - 1;
    block_cmp(idx, b, x, y)
        .then_with(|| {
            idx.iter()
                .map(|col| (col[x] & mask).cmp(&(col[y] & mask)))
                .find(|o| o.is_ne())
                .unwrap_or(Ordering::Equal)
        })
        .then(x.cmp(&y))
}

/// The first 64 bits of nonzero `k`'s HiCOO sort key: the Morton code of
/// its block coordinates over `levels` bit levels (mode 0 first at each
/// level), then its offsets of `b` bits, mode 0 first. Keys compare as the
/// HiCOO order does, except that equal prefixes may hide a difference
/// further on (when the key is longer than 64 bits).
fn key_prefix(idx: &[Vec<u32>], k: usize, b: u32, levels: u32) -> u64 {
    let mut key = 0u64;
    let mut left = 64u32;
    for level in (0..levels).rev() {
        for col in idx {
            if left == 0 {
                return key;
            }
            left -= 1;
            key |= u64::from((col[k] >> (b + level)) & 1) << left;
        }
    }
    let mask = (1u32 << b) - 1;
    for col in idx {
        let off = u64::from(col[k] & mask);
        if left >= b {
            left -= b;
            key |= off << left;
        } else {
            return key | (off >> (b - left));
        }
    }
    key
}

/// The permutation that puts the nonzeros of `tensor` in HiCOO order for
/// `2^b`-wide blocks (see the module documentation).
fn hicoo_permutation(tensor: &SparseTensor, b: u32) -> Vec<usize> {
    let idx = tensor.indices();
    let nnz = tensor.nnz();
    // Bit levels of the largest block coordinate: higher levels are 0 for
    // every nonzero and need no key bits.
    let levels = tensor
        .dims()
        .iter()
        .map(|&d| 32 - (d.saturating_sub(1) >> b).leading_zeros())
        .max()
        .unwrap_or(0);
    let key_bits = u64::from(levels + b) * idx.len() as u64;

    let mut keys: Vec<u128> = (0..nnz)
        .into_par_iter()
        .map(|k| (u128::from(key_prefix(idx, k, b, levels)) << 64) | k as u128)
        .collect();
    keys.par_sort_unstable();
    let mut perm: Vec<usize> = keys.par_iter().map(|&key| key as u64 as usize).collect();
    if key_bits <= 64 {
        // The prefix is the whole key; ties are already in position order.
        return perm;
    }

    // Sort runs of equal prefix by the whole key.
    let run_starts: Vec<usize> = (1..nnz)
        .into_par_iter()
        .filter(|&i| keys[i] >> 64 != keys[i - 1] >> 64)
        .collect();
    drop(keys);
    let mut runs: Vec<&mut [usize]> = Vec::with_capacity(run_starts.len() + 1);
    let mut rest = perm.as_mut_slice();
    let mut at = 0;
    for &s in &run_starts {
        let (run, tail) = rest.split_at_mut(s - at);
        runs.push(run);
        rest = tail;
        at = s;
    }
    runs.push(rest);
    runs.into_par_iter()
        .filter(|run| run.len() > 1)
        .for_each(|run| {
            let cmp = |x: &usize, y: &usize| nonzero_cmp(idx, b, *x, *y);
            if run.len() > PAR_RUN {
                run.par_sort_unstable_by(cmp);
            } else {
                run.sort_unstable_by(cmp);
            }
        });
    perm
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Morton key by explicit bit interleaving (up to 4 modes of 32 bits).
    fn interleaved(coords: &[u32]) -> u128 {
        let mut key = 0u128;
        for level in (0..32).rev() {
            for &c in coords {
                key = (key << 1) | u128::from((c >> level) & 1);
            }
        }
        key
    }

    /// Sorts a tensor's nonzeros by all modes, then value bits, so two
    /// tensors holding the same multiset of nonzeros compare equal.
    fn canonical(t: &SparseTensor) -> (Vec<Vec<u32>>, Vec<u32>) {
        let mut perm: Vec<usize> = (0..t.nnz()).collect();
        perm.sort_by_key(|&k| {
            let coords: Vec<u32> = t.indices().iter().map(|col| col[k]).collect();
            (coords, t.values()[k].to_bits())
        });
        let idx = t
            .indices()
            .iter()
            .map(|col| perm.iter().map(|&k| col[k]).collect())
            .collect();
        (idx, perm.iter().map(|&k| t.values()[k].to_bits()).collect())
    }

    /// A pseudo-random tensor with about a third of its nonzeros repeating
    /// an earlier coordinate.
    fn random_tensor(dims: Vec<u32>, nnz: usize, seed: u64) -> SparseTensor {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut indices = vec![Vec::with_capacity(nnz); dims.len()];
        let mut values = Vec::with_capacity(nnz);
        for k in 0..nnz {
            let dup = k > 0 && next() % 3 == 0;
            let src = (next() % k.max(1) as u64) as usize;
            for (col, &d) in indices.iter_mut().zip(&dims) {
                let i = if dup {
                    col[src]
                } else {
                    (next() % u64::from(d)) as u32
                };
                col.push(i);
            }
            values.push((next() % 1000) as f32 / 7.0 - 50.0);
        }
        SparseTensor::new(dims, indices, values).unwrap()
    }

    fn check_invariants(h: &Hicoo) {
        let width = h.block_width() as u32;
        assert_eq!(h.block_ptr()[0], 0);
        assert_eq!(*h.block_ptr().last().unwrap(), h.nnz() as u64);
        for k in 0..h.nblocks() {
            assert!(!h.block_range(k).is_empty(), "block {k} is empty");
            let coords: Vec<u32> = h.block_coords().iter().map(|c| c[k]).collect();
            if k > 0 {
                let prev: Vec<u32> = h.block_coords().iter().map(|c| c[k - 1]).collect();
                assert_eq!(morton_cmp(&prev, &coords), Ordering::Less, "block {k}");
            }
            let range = h.block_range(k);
            for i in range.clone() {
                for ((&c, offs), &dim) in coords.iter().zip(h.offsets()).zip(h.dims()) {
                    assert!(u32::from(offs[i]) < width);
                    let index = u64::from(c) * u64::from(width) + u64::from(offs[i]);
                    assert!(index < u64::from(dim));
                }
                if i > range.start {
                    let off = |j: usize| -> Vec<u8> { h.offsets().iter().map(|o| o[j]).collect() };
                    assert!(off(i - 1) <= off(i), "offsets out of order in block {k}");
                }
            }
        }
    }

    #[test]
    fn morton_cmp_matches_interleaved_keys() {
        let pts: [&[u32]; 8] = [
            &[0, 0, 0],
            &[1, 0, 0],
            &[0, 1, 0],
            &[0, 0, 1],
            &[1, 1, 1],
            &[2, 0, 0],
            &[0, 3, 7],
            &[u32::MAX, 0, 5],
        ];
        for a in pts {
            for b in pts {
                assert_eq!(
                    morton_cmp(a, b),
                    interleaved(a).cmp(&interleaved(b)),
                    "{a:?} vs {b:?}"
                );
            }
        }
        // Mode 0 is the most significant at a level: (1, 0) > (0, 1).
        assert_eq!(morton_cmp(&[1, 0], &[0, 1]), Ordering::Greater);
        assert_eq!(morton_cmp(&[], &[]), Ordering::Equal);
    }

    #[test]
    fn small_tensor_layout() {
        // Blocks of width 2: block coords (0,0) (1,0) (0,1) (1,1) in Morton
        // order are (0,0) < (0,1) < (1,0) < (1,1) with mode 0 leading.
        let t = SparseTensor::new(
            vec![4, 3],
            vec![vec![3, 0, 2, 1, 0, 1], vec![2, 1, 0, 2, 0, 0]],
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        )
        .unwrap();
        let h = Hicoo::new(&t, 1).unwrap();
        assert_eq!(h.nblocks(), 4);
        assert_eq!(h.block_coords()[0], vec![0, 0, 1, 1]);
        assert_eq!(h.block_coords()[1], vec![0, 1, 0, 1]);
        assert_eq!(h.block_ptr(), &[0, 3, 4, 5, 6]);
        // Block (0,0) holds (0,1), (0,0), (1,0): sorted by offsets.
        assert_eq!(h.offsets()[0], vec![0, 0, 1, 1, 0, 1]);
        assert_eq!(h.offsets()[1], vec![0, 1, 0, 0, 0, 0]);
        assert_eq!(h.values(), &[5.0, 2.0, 6.0, 4.0, 3.0, 1.0]);
        assert_eq!(h.max_block_nnz(), 3);
        assert!((h.mean_block_nnz() - 1.5).abs() < 1e-12);
        // (2 + 4) * 6 + (8 + 8) * 4 + 8
        assert_eq!(h.bytes(), 36 + 64 + 8);
        assert!((h.bytes_per_nnz() - 108.0 / 6.0).abs() < 1e-12);
        check_invariants(&h);
    }

    #[test]
    fn block_bits_are_checked() {
        let t = random_tensor(vec![10, 10, 10], 20, 3);
        assert!(matches!(Hicoo::new(&t, 0), Err(FormatError::Argument(_))));
        let err = Hicoo::new(&t, 9).unwrap_err();
        assert!(matches!(err, FormatError::Capacity { .. }), "{err}");
        assert!(err.to_string().contains("u8"), "{err}");
        assert!(Hicoo::new(&t, 8).is_ok());
    }

    #[test]
    fn more_than_u32_blocks_is_a_capacity_error() {
        assert!(Hicoo::check_capacity(7, u64::from(u32::MAX)).is_ok());
        let err = Hicoo::check_capacity(7, u64::from(u32::MAX) + 1).unwrap_err();
        assert!(
            matches!(
                err,
                FormatError::Capacity {
                    format: "HiCOO",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("32-bit"), "{err}");
        assert!(Hicoo::check_capacity(7, u64::MAX).is_err());
    }

    #[test]
    fn empty_tensor() {
        let t = SparseTensor::new(vec![5, 6], vec![vec![], vec![]], vec![]).unwrap();
        let h = Hicoo::new(&t, 7).unwrap();
        assert_eq!((h.nnz(), h.nblocks(), h.max_block_nnz()), (0, 0, 0));
        assert_eq!(h.bytes_per_nnz(), 0.0);
        assert_eq!(h.to_coo().unwrap(), t);
    }

    #[test]
    fn wide_coordinates_use_the_comparison_sort() {
        // 4 modes of 2^32 - 1 indices: 4 * 32 key bits, more than the 64-bit
        // prefix holds, so runs of equal prefix are sorted by comparison.
        let t = random_tensor(vec![u32::MAX, u32::MAX, 3, u32::MAX], 400, 11);
        for b in [1, 8] {
            let h = Hicoo::new(&t, b).unwrap();
            check_invariants(&h);
            assert_eq!(canonical(&h.to_coo().unwrap()), canonical(&t));
        }
    }

    #[test]
    fn one_mode_tensor() {
        let t = random_tensor(vec![1000], 300, 5);
        let h = Hicoo::new(&t, 4).unwrap();
        check_invariants(&h);
        let back = h.to_coo().unwrap();
        assert_eq!(canonical(&back), canonical(&t));
        // Sorted by index: in one mode Morton order is numeric order.
        assert!(back.mode_indices(0).windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn layout_does_not_depend_on_thread_count() {
        let t = random_tensor(vec![3000, 200, 5000, 70], 50_000, 9);
        let build = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| Hicoo::new(&t, 3).unwrap())
        };
        assert_eq!(build(1), build(3));
    }

    proptest! {
        #[test]
        fn morton_cmp_matches_interleaving_on_random_points(
            a in prop::collection::vec(prop_oneof![0u32..8, any::<u32>()], 1..=4),
            b_seed in prop::collection::vec(prop_oneof![0u32..8, any::<u32>()], 4),
        ) {
            let b = &b_seed[..a.len()];
            prop_assert_eq!(morton_cmp(&a, b), interleaved(&a).cmp(&interleaved(b)));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn round_trip_keeps_every_nonzero(
            dims in prop::collection::vec(1u32..700, 3..=6),
            wide_mode in any::<prop::sample::Index>(),
            wide in prop_oneof![Just(None), Just(Some(100_003u32)), Just(Some(u32::MAX))],
            nnz in 0usize..600,
            block_bits in prop_oneof![Just(1u8), Just(8u8), 1u8..=8],
            seed in any::<u64>(),
        ) {
            let mut dims = dims;
            if let Some(w) = wide {
                let m = wide_mode.index(dims.len());
                dims[m] = w;
            }
            let t = random_tensor(dims, nnz, seed);
            let h = Hicoo::new(&t, block_bits).unwrap();
            check_invariants(&h);
            prop_assert_eq!(h.nnz(), t.nnz());
            prop_assert!(h.nblocks() <= t.nnz());
            let back = h.to_coo().unwrap();
            prop_assert_eq!(back.dims(), t.dims());
            prop_assert_eq!(canonical(&back), canonical(&t));
            // to_coo lists the nonzeros in HiCOO order, so building again
            // from it gives the same HiCOO tensor, values bit for bit.
            prop_assert_eq!(Hicoo::new(&back, block_bits).unwrap(), h);
        }
    }
}
