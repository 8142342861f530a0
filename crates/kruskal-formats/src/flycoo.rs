//! FLYCOO: one array of elements that carry their own position in every
//! mode's layout (FLYCOO-GPU, section 3).
//!
//! Each element is `<remap ids (one per mode), indices (one per mode),
//! value>`, stored as `2 N + 1` consecutive 32-bit words (the value as its
//! f32 bits):
//!
//! ```text
//! word:  0 .. N-1          N .. 2N-1         2N
//!        remap_0..remap_   index_0..index_   value bits
//! ```
//!
//! For each mode `d` the nonzeros are laid out partition by partition
//! (kappa partitions chosen by greedy LPT on output-row nonzero counts, see
//! `kruskal-partition`), each partition sorted by the mode-`d` index. The
//! remap id `remap_d` of an element is its position in that layout, so the
//! remap ids of one mode are a permutation of `0..nnz`. While computing the
//! MTTKRP of mode `d` a kernel writes each element to position
//! `remap_{d+1}` of a second copy: the tensor arrives in the next mode's
//! order without atomics (the "dynamic remap").
//!
//! A [`Flycoo`] holds the elements in the layout of mode 0, plus per mode the
//! partition offsets and the [`SharedPiece`]s: pieces of heavy rows split
//! across partitions, the only output rows two partitions write.
//!
//! Storage: `4 (2 N + 1)` bytes per nonzero (28 for three modes) plus
//! `8 (kappa + 1)` bytes per mode. Remap ids are 32-bit, so at most
//! `u32::MAX` nonzeros.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use rayon::prelude::*;

use crate::{FormatError, Result, SparseTensor};

/// A piece of a split row: positions `start..start + len` of partition
/// `part`'s range in one mode's layout all have output index `row`, and
/// other partitions hold the rest of that row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedPiece {
    pub row: u32,
    pub part: u32,
    pub start: u64,
    pub len: u64,
}

/// One mode's partitioning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlycooMode {
    /// Partition `p` holds positions `part_ptr[p]..part_ptr[p + 1]`.
    pub part_ptr: Vec<u64>,
    /// Pieces of rows split across partitions, sorted by (row, start).
    pub shared: Vec<SharedPiece>,
}

impl FlycooMode {
    pub fn kappa(&self) -> usize {
        self.part_ptr.len().saturating_sub(1)
    }
}

/// A tensor in FLYCOO form. See the module documentation for the layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Flycoo {
    dims: Vec<u32>,
    nnz: usize,
    /// `nnz * (2 N + 1)` words, elements in the layout of mode 0.
    elements: Vec<u32>,
    modes: Vec<FlycooMode>,
}

impl Flycoo {
    /// 32-bit words per element for `nmodes` modes.
    pub const fn words_per_element(nmodes: usize) -> usize {
        2 * nmodes + 1
    }

    /// Errors if `nnz` nonzeros exceed what 32-bit remap ids can number.
    pub fn check_capacity(nnz: u64) -> Result<()> {
        if nnz > u64::from(u32::MAX) {
            return Err(FormatError::Capacity {
                format: "FLYCOO",
                message: format!(
                    "{nnz} nonzeros exceed the {} that its 32-bit remap ids can number",
                    u32::MAX
                ),
            });
        }
        Ok(())
    }

    /// Builds the elements from a tensor and each mode's layout:
    /// `positions[d][k]` is the position of nonzero `k` in the layout of mode
    /// `d`, and `modes[d]` its partitioning.
    ///
    /// Checks that every `positions[d]` is a permutation of `0..nnz`, and
    /// that partition offsets and shared pieces lie inside `0..nnz`. That a
    /// layout is sorted inside its partitions is the caller's contract
    /// (`kruskal-partition` builds and tests it).
    ///
    /// Cost: O(N nnz), parallel.
    pub fn from_layouts(
        tensor: &SparseTensor,
        positions: &[&[u32]],
        modes: Vec<FlycooMode>,
    ) -> Result<Flycoo> {
        let n = tensor.nmodes();
        let nnz = tensor.nnz();
        Self::check_capacity(nnz as u64)?;
        if positions.len() != n || modes.len() != n {
            return Err(FormatError::Invalid(format!(
                "{} position arrays and {} mode partitionings for a {n}-mode tensor",
                positions.len(),
                modes.len()
            )));
        }
        for (d, (pos, m)) in positions.iter().zip(&modes).enumerate() {
            check_permutation(pos, nnz)
                .map_err(|e| FormatError::Invalid(format!("mode {d} positions: {e}")))?;
            check_mode(m, nnz).map_err(|e| FormatError::Invalid(format!("mode {d}: {e}")))?;
        }
        // order0[q]: the nonzero at position q of mode 0's layout.
        let order0 = invert_permutation(positions[0]);
        let w = Self::words_per_element(n);
        let mut elements = vec![0u32; nnz * w];
        elements
            .par_chunks_mut(w)
            .zip(order0.par_iter())
            .for_each(|(e, &k)| {
                let k = k as usize;
                for d in 0..n {
                    e[d] = positions[d][k];
                    e[n + d] = tensor.mode_indices(d)[k];
                }
                e[2 * n] = tensor.values()[k].to_bits();
            });
        Ok(Flycoo {
            dims: tensor.dims().to_vec(),
            nnz,
            elements,
            modes,
        })
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    pub fn nmodes(&self) -> usize {
        self.dims.len()
    }

    pub fn nnz(&self) -> usize {
        self.nnz
    }

    /// The elements, `2 N + 1` words each, in the layout of mode 0.
    pub fn elements(&self) -> &[u32] {
        &self.elements
    }

    /// The partitioning of `mode`.
    pub fn mode(&self, mode: usize) -> &FlycooMode {
        &self.modes[mode]
    }

    pub fn modes(&self) -> &[FlycooMode] {
        &self.modes
    }

    /// Bytes of the elements and partition tables.
    pub fn bytes(&self) -> usize {
        self.elements.len() * 4
            + self
                .modes
                .iter()
                .map(|m| m.part_ptr.len() * 8 + m.shared.len() * std::mem::size_of::<SharedPiece>())
                .sum::<usize>()
    }

    pub fn bytes_per_nnz(&self) -> f64 {
        self.bytes() as f64 / self.nnz.max(1) as f64
    }

    /// The tensor back in COO form, nonzeros in the layout of mode 0
    /// (exactly the input's nonzeros, reordered).
    pub fn to_coo(&self) -> Result<SparseTensor> {
        let n = self.nmodes();
        let w = Self::words_per_element(n);
        let indices: Vec<Vec<u32>> = (0..n)
            .map(|d| self.elements.par_chunks(w).map(|e| e[n + d]).collect())
            .collect();
        let values = self
            .elements
            .par_chunks(w)
            .map(|e| f32::from_bits(e[2 * n]))
            .collect();
        SparseTensor::new(self.dims.clone(), indices, values)
    }
}

/// The inverse of a permutation of `0..len` (the caller guarantees it is
/// one; a non-permutation gives an unspecified result, never a crash).
///
/// Cost: one parallel scatter.
pub fn invert_permutation(perm: &[u32]) -> Vec<u32> {
    let inv: Vec<AtomicU32> = (0..perm.len())
        .into_par_iter()
        .map(|_| AtomicU32::new(0))
        .collect();
    perm.par_iter().enumerate().for_each(|(k, &p)| {
        if let Some(slot) = inv.get(p as usize) {
            slot.store(k as u32, Ordering::Relaxed);
        }
    });
    inv.into_par_iter().map(AtomicU32::into_inner).collect()
}

/// Checks in parallel that `pos` is a permutation of `0..nnz`: one bit per
/// position, set with an atomic OR, so a repeat is seen by whichever thread
/// sets the bit second.
fn check_permutation(pos: &[u32], nnz: usize) -> std::result::Result<(), String> {
    if pos.len() != nnz {
        return Err(format!("{} entries for {nnz} nonzeros", pos.len()));
    }
    let bits: Vec<AtomicU64> = (0..nnz.div_ceil(64))
        .into_par_iter()
        .map(|_| AtomicU64::new(0))
        .collect();
    pos.par_iter().try_for_each(|&p| {
        let p = p as usize;
        if p >= nnz {
            return Err(format!("position {p} beyond {nnz} nonzeros"));
        }
        let bit = 1u64 << (p % 64);
        if bits[p / 64].fetch_or(bit, Ordering::Relaxed) & bit != 0 {
            return Err(format!("position {p} used twice"));
        }
        Ok(())
    })
}

fn check_mode(m: &FlycooMode, nnz: usize) -> std::result::Result<(), String> {
    let ptr = &m.part_ptr;
    if ptr.len() < 2 || ptr[0] != 0 || *ptr.last().expect("len >= 2") != nnz as u64 {
        return Err(format!(
            "partition offsets must run from 0 to {nnz} over at least one partition"
        ));
    }
    if ptr.windows(2).any(|w| w[0] > w[1]) {
        return Err("partition offsets decrease".into());
    }
    for s in &m.shared {
        let p = s.part as usize;
        if p + 1 >= ptr.len() || s.len == 0 || s.start < ptr[p] || s.start + s.len > ptr[p + 1] {
            return Err(format!("shared piece {s:?} lies outside its partition"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> SparseTensor {
        SparseTensor::new(
            vec![3, 2, 2],
            vec![vec![2, 0, 2, 1], vec![0, 1, 1, 0], vec![1, 1, 0, 0]],
            vec![1.0, 2.0, 3.0, 4.0],
        )
        .unwrap()
    }

    fn one_partition(nnz: u64) -> FlycooMode {
        FlycooMode {
            part_ptr: vec![0, nnz],
            shared: Vec::new(),
        }
    }

    #[test]
    fn elements_carry_remap_ids_indices_and_values() {
        let t = small();
        // Mode 0 layout by row: nonzeros 1 (row 0), 3 (row 1), 0, 2 (row 2).
        let p0 = [2u32, 0, 3, 1];
        let p1 = [0u32, 1, 2, 3];
        let p2 = [3u32, 2, 1, 0];
        let modes = vec![one_partition(4), one_partition(4), one_partition(4)];
        let f = Flycoo::from_layouts(&t, &[&p0, &p1, &p2], modes).unwrap();
        assert_eq!(Flycoo::words_per_element(3), 7);
        // First element is nonzero 1: remap (0, 1, 2), index (0, 1, 1), 2.0.
        assert_eq!(&f.elements()[..7], &[0, 1, 2, 0, 1, 1, 2.0f32.to_bits()]);
        let back = f.to_coo().unwrap();
        assert_eq!(back.mode_indices(0), &[0, 1, 2, 2]);
        assert_eq!(back.values(), &[2.0, 4.0, 1.0, 3.0]);
        assert_eq!(f.bytes(), 4 * 7 * 4 + 3 * 16);
    }

    #[test]
    fn rejects_broken_layouts() {
        let t = small();
        let id = [0u32, 1, 2, 3];
        let modes = || vec![one_partition(4), one_partition(4), one_partition(4)];
        let dup = [0u32, 1, 1, 3];
        let err = Flycoo::from_layouts(&t, &[&id, &dup, &id], modes()).unwrap_err();
        assert!(err.to_string().contains("used twice"), "{err}");
        let far = [0u32, 1, 2, 9];
        assert!(Flycoo::from_layouts(&t, &[&far, &id, &id], modes()).is_err());
        assert!(Flycoo::from_layouts(&t, &[&id, &id], modes()).is_err());
        let mut bad = modes();
        bad[1].part_ptr = vec![0, 3];
        assert!(Flycoo::from_layouts(&t, &[&id, &id, &id], bad).is_err());
        let mut bad = modes();
        bad[2].shared.push(SharedPiece {
            row: 0,
            part: 0,
            start: 3,
            len: 2,
        });
        let err = Flycoo::from_layouts(&t, &[&id, &id, &id], bad).unwrap_err();
        assert!(err.to_string().contains("outside"), "{err}");
    }

    #[test]
    fn capacity_is_checked() {
        assert!(Flycoo::check_capacity(u64::from(u32::MAX)).is_ok());
        let err = Flycoo::check_capacity(1 << 33).unwrap_err();
        assert!(
            matches!(
                err,
                FormatError::Capacity {
                    format: "FLYCOO",
                    ..
                }
            ),
            "{err}"
        );
    }
}
