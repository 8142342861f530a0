//! Building a [`Flycoo`] tensor: one LPT layout per mode, then the elements.

use kruskal_formats::SparseTensor;
use kruskal_formats::flycoo::{Flycoo, FlycooMode};

use crate::Result;
use crate::layout::{LayoutOptions, ModeLayout};
use crate::lpt::Balance;

/// What partitioning did to one mode, for reports (`kruskal info`).
#[derive(Clone, Debug, PartialEq)]
pub struct LayoutSummary {
    pub mode: usize,
    pub kappa: usize,
    pub threshold: u64,
    /// Nonempty output rows.
    pub rows: usize,
    /// Rows heavier than the threshold.
    pub split_rows: usize,
    /// Pieces of rows that span partitions.
    pub shared_pieces: usize,
    pub balance: Balance,
}

impl ModeLayout {
    pub fn summary(&self) -> LayoutSummary {
        LayoutSummary {
            mode: self.mode(),
            kappa: self.kappa(),
            threshold: self.threshold(),
            rows: self.rows(),
            split_rows: self.split_rows(),
            shared_pieces: self.shared().len(),
            balance: self.balance(),
        }
    }
}

/// Builds the FLYCOO form of `tensor` with the same options for every mode.
///
/// Cost: one [`ModeLayout`] per mode (a parallel sort each) and one pass
/// writing the elements; peak memory about 4 (2 N + 1) + 28 bytes per
/// nonzero on top of the tensor.
pub fn build_flycoo(
    tensor: &SparseTensor,
    opts: &LayoutOptions,
) -> Result<(Flycoo, Vec<LayoutSummary>)> {
    Flycoo::check_capacity(tensor.nnz() as u64)?;
    let mut positions = Vec::with_capacity(tensor.nmodes());
    let mut modes = Vec::with_capacity(tensor.nmodes());
    let mut summaries = Vec::with_capacity(tensor.nmodes());
    for mode in 0..tensor.nmodes() {
        let layout = ModeLayout::new(tensor, mode, opts)?;
        summaries.push(layout.summary());
        modes.push(FlycooMode {
            part_ptr: layout.part_ptr().to_vec(),
            shared: layout.shared().to_vec(),
        });
        positions.push(layout.into_positions());
    }
    let views: Vec<&[u32]> = positions.iter().map(Vec::as_slice).collect();
    let flycoo = Flycoo::from_layouts(tensor, &views, modes)?;
    Ok((flycoo, summaries))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    /// Sorted (indices..., value bits) of every nonzero: a multiset key.
    fn multiset(t: &SparseTensor) -> Vec<Vec<u32>> {
        let mut rows: Vec<Vec<u32>> = (0..t.nnz())
            .map(|k| {
                let mut r: Vec<u32> = t.indices().iter().map(|idx| idx[k]).collect();
                r.push(t.values()[k].to_bits());
                r
            })
            .collect();
        rows.sort_unstable();
        rows
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn round_trips_and_remaps_every_mode(
            nmodes in 3usize..=6,
            seed in any::<u64>(),
            nnz in 1usize..1_500,
            kappa in 1usize..24,
            exponent in 0.0f64..1.8,
        ) {
            let dims: Vec<u32> = (0..nmodes).map(|m| 1 + ((seed >> (m * 8)) % 40) as u32).collect();
            let mut spec = PowerLawSpec::new(dims, nnz).with_draws().with_seed(seed);
            spec.exponents = vec![exponent; nmodes];
            let t = power_law(&spec).unwrap();
            let (f, summaries) = build_flycoo(&t, &LayoutOptions::new(kappa)).unwrap();
            prop_assert_eq!(summaries.len(), nmodes);
            prop_assert_eq!(multiset(&f.to_coo().unwrap()), multiset(&t));
            prop_assert_eq!(f.bytes_per_nnz().floor() as usize >= 4 * (2 * nmodes + 1), true);

            // Follow the dynamic remap through every mode: writing each
            // element at its next-mode remap id gives a copy sorted by that
            // mode inside each partition, and after N modes the original.
            let w = Flycoo::words_per_element(nmodes);
            let mut cur = f.elements().to_vec();
            for step in 0..nmodes {
                let next_mode = (step + 1) % nmodes;
                let mut next = vec![0u32; cur.len()];
                for e in cur.chunks(w) {
                    let q = e[next_mode] as usize;
                    next[q * w..(q + 1) * w].copy_from_slice(e);
                }
                let m = f.mode(next_mode);
                for p in 0..m.kappa() {
                    let (lo, hi) = (m.part_ptr[p] as usize, m.part_ptr[p + 1] as usize);
                    for q in lo + 1..hi {
                        prop_assert!(next[(q - 1) * w + nmodes + next_mode] <= next[q * w + nmodes + next_mode]);
                    }
                }
                cur = next;
            }
            prop_assert_eq!(&cur[..], f.elements());
        }
    }
}
