//! Relabeling each mode to the indices that occur (as SPLATT does with
//! empty slices).
//!
//! A tensor whose ids are sparse (user ids, hashes: a dimension of
//! billions, a few million distinct values) needs factor rows only for the
//! indices that occur; every other row of a CP factor is zero, since no
//! nonzero pulls on it. [`compact`] renumbers each mode densely, in the
//! order of the original ids, and returns the [`Compaction`] that maps the
//! new numbers back, so a model of the compact tensor can be written in the
//! file's own numbering.

use rayon::prelude::*;

use crate::coo::SparseTensor;
use crate::error::Result;

/// How [`compact`] renumbered each mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compaction {
    /// The original tensor's dimensions.
    pub dims: Vec<u32>,
    /// Per mode, the original ids that occur, sorted: new index `i` of mode
    /// `m` is original index `ids[m][i]`.
    pub ids: Vec<Vec<u32>>,
}

impl Compaction {
    /// The compact tensor's dimensions (at least 1 per mode: a tensor
    /// without nonzeros keeps one row so it stays a valid tensor).
    pub fn compact_dims(&self) -> Vec<u32> {
        self.ids
            .iter()
            .map(|ids| (ids.len() as u32).max(1))
            .collect()
    }

    /// Writes the rows of a compact factor (`compact_dims()[mode] x rank`,
    /// row-major in `rows`) in the original numbering: `emit` is called
    /// with consecutive pieces that together are the `dims[mode] x rank`
    /// expanded factor, zero rows for absent ids given as runs of zeros no
    /// longer than `zero_chunk.len()` elements. Nothing of the original
    /// size is allocated, so a 3e9-row factor can be streamed to a file.
    ///
    /// `zero_chunk` must hold only zeros and a whole number of rows (at
    /// least one).
    pub fn expand_rows<E>(
        &self,
        mode: usize,
        rows: &[f32],
        rank: usize,
        zero_chunk: &[f32],
        mut emit: impl FnMut(&[f32]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let rows_per_chunk = (zero_chunk.len() / rank.max(1)).max(1) as u64;
        let zeros = |mut count: u64,
                     emit: &mut dyn FnMut(&[f32]) -> std::result::Result<(), E>|
         -> std::result::Result<(), E> {
            while count > 0 {
                let n = count.min(rows_per_chunk);
                emit(&zero_chunk[..n as usize * rank])?;
                count -= n;
            }
            Ok(())
        };
        let mut next: u64 = 0;
        for (i, &id) in self.ids[mode].iter().enumerate() {
            zeros(u64::from(id) - next, &mut emit)?;
            emit(&rows[i * rank..(i + 1) * rank])?;
            next = u64::from(id) + 1;
        }
        zeros(u64::from(self.dims[mode]) - next, &mut emit)
    }

    /// The expanded factor of `mode` in memory (`dims[mode] x rank`,
    /// row-major): for modest dimensions; see [`expand_rows`](Self::expand_rows)
    /// for huge ones.
    pub fn expand(&self, mode: usize, rows: &[f32], rank: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.dims[mode] as usize * rank);
        let zero_chunk = vec![0f32; rank.max(1) * 4096];
        let done =
            self.expand_rows::<std::convert::Infallible>(mode, rows, rank, &zero_chunk, |piece| {
                out.extend_from_slice(piece);
                Ok(())
            });
        match done {
            Ok(()) => out,
            Err(never) => match never {},
        }
    }
}

/// Renumbers every mode of `t` to the indices that occur in it, keeping
/// their order; returns the compact tensor and the map back.
///
/// Cost: one parallel sort of each mode's indices and a binary search per
/// nonzero and mode; memory: one more copy of the indices. Nothing is
/// sized by a dimension.
pub fn compact(t: &SparseTensor) -> Result<(SparseTensor, Compaction)> {
    let mut ids = Vec::with_capacity(t.nmodes());
    let mut indices = Vec::with_capacity(t.nmodes());
    for mode in 0..t.nmodes() {
        let idx = t.mode_indices(mode);
        let mut occurring = idx.to_vec();
        occurring.par_sort_unstable();
        occurring.dedup();
        occurring.shrink_to_fit();
        let renumbered: Vec<u32> = idx
            .par_iter()
            .map(|i| occurring.partition_point(|&o| o < *i) as u32)
            .collect();
        ids.push(occurring);
        indices.push(renumbered);
    }
    let compaction = Compaction {
        dims: t.dims().to_vec(),
        ids,
    };
    let tensor = SparseTensor::new(compaction.compact_dims(), indices, t.values().to_vec())?;
    Ok((tensor, compaction))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sparse_ids() -> SparseTensor {
        SparseTensor::new(
            vec![3_000_000_000, 10],
            vec![vec![2_999_999_999, 7, 7, 0], vec![9, 0, 3, 3]],
            vec![1.0, 2.0, 3.0, 4.0],
        )
        .unwrap()
    }

    #[test]
    fn modes_are_renumbered_in_the_order_of_their_ids() {
        let (c, map) = compact(&sparse_ids()).unwrap();
        assert_eq!(c.dims(), &[3, 3]);
        assert_eq!(map.ids, vec![vec![0, 7, 2_999_999_999], vec![0, 3, 9]]);
        assert_eq!(c.mode_indices(0), &[2, 1, 1, 0]);
        assert_eq!(c.mode_indices(1), &[2, 0, 1, 1]);
        assert_eq!(c.values(), sparse_ids().values());
    }

    #[test]
    fn expansion_puts_rows_back_and_zeros_elsewhere() {
        let (_, map) = compact(&sparse_ids()).unwrap();
        let rows = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let full = map.expand(1, &rows, 2);
        let mut expected = vec![0f32; 20];
        expected[0..2].copy_from_slice(&[1.0, 2.0]);
        expected[6..8].copy_from_slice(&[3.0, 4.0]);
        expected[18..20].copy_from_slice(&[5.0, 6.0]);
        assert_eq!(full, expected);
    }

    #[test]
    fn streaming_a_huge_mode_allocates_nothing_of_its_size() {
        let (_, map) = compact(&sparse_ids()).unwrap();
        let rows = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let zero_chunk = vec![0f32; 2 << 20];
        let (mut elements, mut pieces, mut nonzero) = (0u64, 0u64, 0f32);
        map.expand_rows::<()>(0, &rows, 2, &zero_chunk, |piece| {
            elements += piece.len() as u64;
            pieces += 1;
            if piece.as_ptr() == zero_chunk.as_ptr() {
                // A run of zero rows is (a prefix of) the zero chunk itself:
                // no copy, nothing to scan.
            } else {
                assert_eq!(piece.len(), 2);
                nonzero += piece.iter().sum::<f32>();
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(elements, 3_000_000_000 * 2);
        assert_eq!(nonzero, 21.0);
        // Zero runs come in chunks of 2^20 rows.
        assert!(pieces < 3_000_000_000 / (1 << 20) + 10, "{pieces}");
    }

    #[test]
    fn an_error_from_the_writer_stops_the_expansion() {
        let (_, map) = compact(&sparse_ids()).unwrap();
        let mut calls = 0;
        let r = map.expand_rows(0, &[0.0; 6], 2, &[0.0; 8], |_| {
            calls += 1;
            if calls == 2 { Err("disk full") } else { Ok(()) }
        });
        assert_eq!(r, Err("disk full"));
        assert_eq!(calls, 2);
    }

    #[test]
    fn an_empty_tensor_keeps_one_row_per_mode() {
        let t = SparseTensor::new(vec![5, 6], vec![vec![], vec![]], vec![]).unwrap();
        let (c, map) = compact(&t).unwrap();
        assert_eq!(c.dims(), &[1, 1]);
        assert_eq!(map.expand(0, &[7.0], 1), vec![0.0; 5]);
    }

    proptest! {
        #[test]
        fn expanding_the_compact_indices_gives_the_original(
            entries in proptest::collection::vec((0u32..50, 0u32..1000, 0u32..7), 1..60)
        ) {
            let t = SparseTensor::new(
                vec![50, 1000, 7],
                (0..3).map(|m| entries.iter().map(|e| [e.0, e.1, e.2][m]).collect()).collect(),
                vec![1.0; entries.len()],
            ).unwrap();
            let (c, map) = compact(&t).unwrap();
            for m in 0..3 {
                // Dense and in order: every new index is used, ids sorted.
                prop_assert!(map.ids[m].windows(2).all(|w| w[0] < w[1]));
                for (k, &i) in c.mode_indices(m).iter().enumerate() {
                    prop_assert_eq!(map.ids[m][i as usize], t.mode_indices(m)[k]);
                }
                // A factor whose row i holds the new index i expands to rows
                // holding their own original index where it occurs.
                let rows: Vec<f32> = (0..c.dims()[m]).map(|i| i as f32 + 1.0).collect();
                let full = map.expand(m, &rows, 1);
                prop_assert_eq!(full.len(), t.dims()[m] as usize);
                for (new, &id) in map.ids[m].iter().enumerate() {
                    prop_assert_eq!(full[id as usize], new as f32 + 1.0);
                }
                prop_assert_eq!(full.iter().filter(|&&x| x != 0.0).count(), map.ids[m].len());
            }
        }
    }
}
