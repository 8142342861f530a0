//! Greedy LPT and cyclic assignment of weighted units to partitions.
//!
//! FLYCOO-GPU (Algorithm 1) sorts the output indices of a mode by their
//! nonzero counts, largest first, and gives each to the least-loaded of
//! kappa partitions. That is Graham's LPT rule: the largest load is at most
//! 4/3 of the optimum (more precisely `4/3 - 1/(3 kappa)`). The paper's text
//! also describes a cyclic variant (round-robin over the same order), kept
//! here for comparison.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rayon::prelude::*;

/// The partition of every unit and the resulting loads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// `part_of[u]`: the partition unit `u` went to.
    pub part_of: Vec<u32>,
    /// `loads[p]`: the total weight of partition `p`.
    pub loads: Vec<u64>,
}

impl Assignment {
    /// The largest load (the makespan).
    pub fn max_load(&self) -> u64 {
        self.loads.iter().copied().max().unwrap_or(0)
    }

    pub fn balance(&self) -> Balance {
        Balance::of(&self.loads)
    }
}

/// How a policy orders units before assigning them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// Greedy LPT: each unit, largest first, to the least-loaded partition.
    #[default]
    Lpt,
    /// Round-robin over the units, largest first.
    Cyclic,
}

impl Policy {
    pub fn assign(self, weights: &[u64], kappa: usize) -> Assignment {
        match self {
            Policy::Lpt => lpt(weights, kappa),
            Policy::Cyclic => cyclic(weights, kappa),
        }
    }
}

/// Visits every unit with its weight, largest weight first; equal weights
/// by id, so the order (and every assignment built on it) is fully
/// determined.
///
/// Where every weight fits 32 bits (a row's nonzeros: always, below four
/// billion nonzeros), each unit becomes one 64-bit key, its weight's
/// complement above its id, and the keys are sorted as plain integers:
/// the same order, without looking a weight up for every comparison (on
/// nell-1-like's 10 million nonempty rows of one mode, the lookups made
/// the sort most of a plan's time). The visit reads the weight back from
/// the key too: a lookup there would put a cache miss on the path of
/// every LPT step, which waits for the loads the step before updated.
fn each_by_weight_desc(weights: &[u64], mut visit: impl FnMut(u32, u64)) {
    if weights.par_iter().all(|&w| w <= u64::from(u32::MAX)) {
        let mut keys: Vec<u64> = weights
            .par_iter()
            .enumerate()
            .map(|(u, &w)| ((u64::from(u32::MAX) - w) << 32) | u as u64)
            .collect();
        keys.par_sort_unstable();
        for k in keys {
            visit(k as u32, u64::from(u32::MAX) - (k >> 32));
        }
        return;
    }
    let mut order: Vec<u32> = (0..weights.len() as u32).collect();
    order.par_sort_unstable_by_key(|&u| (Reverse(weights[u as usize]), u));
    for u in order {
        visit(u, weights[u as usize]);
    }
}

/// Greedy LPT over `weights` into `kappa` partitions (`kappa >= 1`; 0 is
/// treated as 1). Ties between equally loaded partitions go to the lowest
/// partition id.
///
/// Cost: a parallel sort of the units, then O(units log kappa).
pub fn lpt(weights: &[u64], kappa: usize) -> Assignment {
    let kappa = kappa.max(1);
    if kappa == 1 {
        // Everything goes to the one partition: no order to find.
        return Assignment {
            part_of: vec![0; weights.len()],
            loads: vec![weights.par_iter().sum()],
        };
    }
    if kappa <= SCAN_PARTS {
        lpt_scan(weights, kappa)
    } else {
        lpt_heap(weights, kappa)
    }
}

/// [`lpt`] with the least loaded partition taken from a heap.
fn lpt_heap(weights: &[u64], kappa: usize) -> Assignment {
    let mut part_of = vec![0u32; weights.len()];
    let mut loads = vec![0u64; kappa];
    let mut heap: BinaryHeap<Reverse<(u64, u32)>> =
        (0..kappa as u32).map(|p| Reverse((0, p))).collect();
    each_by_weight_desc(weights, |u, w| {
        let Reverse((load, p)) = heap.pop().expect("the heap holds kappa >= 1 entries");
        let load = load + w;
        part_of[u as usize] = p;
        loads[p as usize] = load;
        heap.push(Reverse((load, p)));
    });
    Assignment { part_of, loads }
}

/// Up to this many partitions (the GPUs of a host), [`lpt`] finds the least
/// loaded one by a scan of the loads instead of a heap: the same choice
/// (the smallest load, ties to the lowest id), about three times faster
/// per unit, and millions of units go through this loop one by one.
const SCAN_PARTS: usize = 8;

/// [`lpt`] with the least loaded partition found by a scan.
fn lpt_scan(weights: &[u64], kappa: usize) -> Assignment {
    let mut part_of = vec![0u32; weights.len()];
    let mut loads = vec![0u64; kappa];
    each_by_weight_desc(weights, |u, w| {
        let mut p = 0;
        for q in 1..kappa {
            if loads[q] < loads[p] {
                p = q;
            }
        }
        loads[p] += w;
        part_of[u as usize] = p as u32;
    });
    Assignment { part_of, loads }
}

/// Cyclic assignment over the LPT order: the k-th largest unit goes to
/// partition `k mod kappa`.
pub fn cyclic(weights: &[u64], kappa: usize) -> Assignment {
    let kappa = kappa.max(1);
    let mut part_of = vec![0u32; weights.len()];
    let mut loads = vec![0u64; kappa];
    let mut k = 0;
    each_by_weight_desc(weights, |u, w| {
        let p = k % kappa;
        part_of[u as usize] = p as u32;
        loads[p] += w;
        k += 1;
    });
    Assignment { part_of, loads }
}

/// The optimal makespan, by exhaustive search (branch and bound). Only for
/// small inputs (tests check LPT against it); exponential in `weights.len()`.
pub fn optimal_makespan(weights: &[u64], kappa: usize) -> u64 {
    let kappa = kappa.max(1);
    let mut w: Vec<u64> = weights.to_vec();
    w.sort_unstable_by(|a, b| b.cmp(a));
    let mut best = lpt(&w, kappa).max_load();
    let mut loads = vec![0u64; kappa];
    fn search(w: &[u64], k: usize, loads: &mut [u64], best: &mut u64) {
        if k == w.len() {
            *best = (*best).min(loads.iter().copied().max().unwrap_or(0));
            return;
        }
        for p in 0..loads.len() {
            // Partitions with equal loads are interchangeable: try one.
            if loads[..p].contains(&loads[p]) || loads[p] + w[k] >= *best {
                continue;
            }
            loads[p] += w[k];
            search(w, k + 1, loads, best);
            loads[p] -= w[k];
        }
    }
    search(&w, 0, &mut loads, &mut best);
    best
}

/// Load balance of a set of partitions (or GPUs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Balance {
    pub parts: usize,
    pub min: u64,
    pub max: u64,
    pub mean: f64,
}

impl Balance {
    pub fn of(loads: &[u64]) -> Balance {
        let total: u64 = loads.iter().sum();
        Balance {
            parts: loads.len(),
            min: loads.iter().copied().min().unwrap_or(0),
            max: loads.iter().copied().max().unwrap_or(0),
            mean: if loads.is_empty() {
                0.0
            } else {
                total as f64 / loads.len() as f64
            },
        }
    }

    /// Largest load over the mean load: 1.0 is perfect balance, and the
    /// slowdown of a parallel step against perfect balance.
    pub fn max_over_mean(&self) -> f64 {
        if self.mean > 0.0 {
            self.max as f64 / self.mean
        } else {
            1.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lpt_places_largest_first_on_least_loaded() {
        let a = lpt(&[5, 4, 3, 3, 3], 2);
        // 5 -> p0, 4 -> p1, 3 -> p1 (4 < 5), 3 -> p0 (5 < 7), 3 -> p0 or p1 (8 vs 7) -> p1.
        assert_eq!(a.part_of, vec![0, 1, 1, 0, 1]);
        assert_eq!(a.loads, vec![8, 10]);
        assert_eq!(optimal_makespan(&[5, 4, 3, 3, 3], 2), 9);
    }

    #[test]
    fn cyclic_goes_round_robin_in_size_order() {
        let a = cyclic(&[1, 9, 5, 7], 2);
        // Order 9, 7, 5, 1 -> p0, p1, p0, p1.
        assert_eq!(a.part_of, vec![1, 0, 0, 1]);
        assert_eq!(a.loads, vec![14, 8]);
    }

    #[test]
    fn more_partitions_than_units_and_empty_input() {
        let a = lpt(&[3, 1], 4);
        assert_eq!(a.loads, vec![3, 1, 0, 0]);
        let e = lpt(&[], 3);
        assert!(e.part_of.is_empty());
        assert_eq!(e.max_load(), 0);
        assert_eq!(Balance::of(&e.loads).max_over_mean(), 1.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn the_scan_and_the_heap_assign_alike(
            weights in proptest::collection::vec(0u64..6, 0..300),
            kappa in 1usize..=SCAN_PARTS,
        ) {
            // Small weights: many ties between units and between loads.
            prop_assert_eq!(lpt_scan(&weights, kappa), lpt_heap(&weights, kappa));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn the_packed_order_is_the_order_by_weight_then_id(
            weights in proptest::collection::vec(
                prop_oneof![0u64..6, Just(u64::from(u32::MAX)), Just(u64::from(u32::MAX) - 1)],
                0..300,
            ),
            huge in any::<bool>(),
        ) {
            // Many ties; the largest weights that pack; and, with `huge`,
            // one that does not (the order then comes from the lookups).
            let mut weights = weights;
            if huge && !weights.is_empty() {
                weights[0] = u64::from(u32::MAX) + 1;
            }
            let mut expect: Vec<u32> = (0..weights.len() as u32).collect();
            expect.sort_by_key(|&u| (Reverse(weights[u as usize]), u));
            let expect: Vec<(u32, u64)> = expect.into_iter().map(|u| (u, weights[u as usize])).collect();
            let mut visited = Vec::new();
            each_by_weight_desc(&weights, |u, w| visited.push((u, w)));
            prop_assert_eq!(visited, expect);
        }

        #[test]
        fn one_partition_takes_every_unit_as_the_scan_would(
            weights in proptest::collection::vec(0u64..1000, 0..300),
        ) {
            prop_assert_eq!(lpt(&weights, 1), lpt_scan(&weights, 1));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn lpt_is_within_four_thirds_of_optimal_and_beats_cyclic(
            weights in proptest::collection::vec(1u64..100, 1..11),
            kappa in 1usize..5,
        ) {
            let a = lpt(&weights, kappa);
            let opt = optimal_makespan(&weights, kappa);
            // Every unit is placed once: loads add up.
            prop_assert_eq!(a.loads.iter().sum::<u64>(), weights.iter().sum::<u64>());
            prop_assert!(a.part_of.iter().all(|&p| (p as usize) < kappa));
            let recomputed = a.part_of.iter().zip(&weights).fold(vec![0u64; kappa], |mut l, (&p, &w)| {
                l[p as usize] += w;
                l
            });
            prop_assert_eq!(&recomputed, &a.loads);
            // Graham: LPT <= (4/3 - 1/(3 kappa)) OPT, in integers.
            prop_assert!(3 * kappa as u64 * a.max_load() <= (4 * kappa as u64 - 1) * opt,
                "lpt {} opt {}", a.max_load(), opt);
            prop_assert!(a.max_load() <= cyclic(&weights, kappa).max_load());
        }
    }
}
