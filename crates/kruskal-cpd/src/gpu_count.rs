//! How many GPUs pay for a tensor (`--gpus all`): a prediction of one
//! CPD-ALS iteration on 1, 2, ... GPUs, and the count that is fastest.
//!
//! On one GPU an iteration is the MTTKRP of every mode and the dense
//! update. A group splits both over its GPUs, but adds per mode the
//! exchange of the updated rows and a fixed cost: the host's round trips
//! to every worker (MTTKRP, update, scaling, exchange) and the collective
//! launches. A tensor whose iteration takes a few milliseconds on one GPU
//! gains less from the split than the fixed cost takes, and stays on one
//! GPU; the output says why.
//!
//! The exchange counted is the cheaper of the group's plans (see
//! `kruskal-group`'s `plan.rs`): rows by owner (each mode's rows
//! all-gathered, or only those read), or, where a split plan may run, the
//! split by the mode that saves most, whose rows never travel while every
//! other mode's rows are reduced onto their owners and then all-gathered.
//!
//! The constants are measured on H100s joined by NVLink (four to a host,
//! docs/performance.md, "How many GPUs"); the prediction only has to rank
//! the counts, not to time them.

use kruskal_formats::SparseTensor;
// A sparse exchange is used where it moves at most this share of the
// all-gather's rows, as the group decides.
use kruskal_partition::readers::CHEAPER_SHARE;

/// MTTKRP on one GPU (fcoo), picoseconds per nonzero and mode: when the
/// factors fit in the L2 cache (t3u: 2.0 ms for 20M nonzeros of 3 modes),
/// and when they do not (nell-1: 24.9 ms for 144M).
const MTTKRP_PS_CACHED: f64 = 34.0;
const MTTKRP_PS: f64 = 60.0;
/// Factors up to this many bytes count as cached (the H100's L2 is 50 MB).
const CACHED_BYTES: f64 = 40e6;
/// The group's shard kernel against fcoo on the same work: 1.22x on t3u;
/// on nell-1 the shards' smaller working sets make up for it.
const SHARD_SLOWER_CACHED: f64 = 1.22;
const SHARD_SLOWER: f64 = 1.0;
/// Dense update and Gram, picoseconds per factor row and column (nell-1
/// on an H200 with the tensor-core kernels, 2026-11-27: 5.2 ms of a 23.8 ms
/// iteration besides the MTTKRP, for 30.5M rows at rank 32).
const UPDATE_PS: f64 = 5.5;
/// What a group adds per mode whatever the tensor (host round trips to
/// the workers for the MTTKRP, update, scaling and exchange, collective
/// launches), milliseconds: t3u's all-mode MTTKRP alone took 1.78 ms on
/// four GPUs against 0.6 ms of split work.
const GROUP_MODE_MS: f64 = 0.8;
/// Rows one GPU receives per second from the others, in bytes.
const LINK_BYTES_PER_S: f64 = 300e9;

/// The count [`pick`] chose and why.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuCount {
    /// GPUs to use (1: the one-GPU backend).
    pub gpus: usize,
    /// Predicted milliseconds per iteration on 1, 2, ... `available` GPUs.
    pub predicted_ms: Vec<f64>,
    /// One line for the user.
    pub reason: String,
}

/// The predicted iteration time of `t` at `rank` on each count from 1 to
/// `available`, and the fastest count. `one_fits`: whether the one-GPU
/// backend fits one GPU's memory (if not, at least two GPUs are used);
/// `split`: whether the group may take a split plan (NCCL, one process,
/// no plan of rows by owner asked for).
///
/// Cost: nothing beyond the dimensions when the all-gather bound already
/// favours the most GPUs; otherwise one pass over each mode's indices (the
/// rows each mode uses, for the sparse exchange's volume).
pub fn pick(
    t: &SparseTensor,
    rank: usize,
    available: usize,
    one_fits: bool,
    split: bool,
) -> GpuCount {
    let available = available.max(1);
    let upper: Vec<f64> = (1..=available)
        .map(|g| {
            let rows = exchanged_rows(t, g, split, &|mode| all_gather_rows(t, mode, g));
            predict(t, rank, g, rows)
        })
        .collect();
    let predicted = if fastest(&upper, one_fits) == available {
        upper
    } else {
        let counts: Vec<Vec<u64>> = (0..t.nmodes()).map(|m| t.mode_counts(m)).collect();
        (1..=available)
            .map(|g| {
                let rows = exchanged_rows(t, g, split, &|mode| {
                    let all = all_gather_rows(t, mode, g);
                    let read = read_rows(&counts[mode], t.nmodes(), g);
                    if read <= CHEAPER_SHARE * all {
                        read
                    } else {
                        all
                    }
                });
                predict(t, rank, g, rows)
            })
            .collect()
    };
    let gpus = fastest(&predicted, one_fits);
    let reason = if gpus == 1 {
        format!(
            "1 of {available}: predicted {:.2} ms per iteration on one GPU, {:.2} ms on {available} \
             (the exchange and the group's per-mode round trips cost more than splitting saves)",
            predicted[0],
            predicted[available - 1]
        )
    } else {
        format!(
            "{gpus} of {available}: predicted {:.2} ms per iteration on one GPU, {:.2} ms on {gpus}",
            predicted[0],
            predicted[gpus - 1]
        )
    };
    GpuCount {
        gpus,
        predicted_ms: predicted,
        reason,
    }
}

/// The count (from 1) with the smallest prediction; ties go to fewer GPUs.
fn fastest(predicted: &[f64], one_fits: bool) -> usize {
    let first = if one_fits || predicted.len() == 1 {
        0
    } else {
        1
    };
    let mut best = first;
    for (i, &ms) in predicted.iter().enumerate().skip(first) {
        if ms < predicted[best] {
            best = i;
        }
    }
    best + 1
}

/// Rows one GPU receives per iteration on `g` GPUs in the cheaper plan:
/// rows by owner (`by_owner(mode)` after each mode's update), or, when
/// `split` allows it, the best split plan, which all-gathers and reduces
/// every mode but the cut one (a reduction moves about an all-gather's
/// rows).
fn exchanged_rows(t: &SparseTensor, g: usize, split: bool, by_owner: &dyn Fn(usize) -> f64) -> f64 {
    let n = t.nmodes();
    let rows: f64 = (0..n).map(by_owner).sum();
    if !split || g == 1 {
        return rows;
    }
    let every: f64 = (0..n).map(|m| 2.0 * all_gather_rows(t, m, g)).sum();
    let best_split = (0..n)
        .map(|cut| every - 2.0 * all_gather_rows(t, cut, g))
        .fold(f64::INFINITY, f64::min);
    rows.min(best_split)
}

/// One iteration on `g` GPUs; `exchanged` is the rows one GPU receives
/// per iteration (every mode's).
fn predict(t: &SparseTensor, rank: usize, g: usize, exchanged: f64) -> f64 {
    let n = t.nmodes();
    let nnz = t.nnz() as f64;
    let rows: f64 = t.dims().iter().map(|&d| f64::from(d)).sum();
    let cached = rows * rank as f64 * 4.0 <= CACHED_BYTES;
    let (ps, slower) = if cached {
        (MTTKRP_PS_CACHED, SHARD_SLOWER_CACHED)
    } else {
        (MTTKRP_PS, SHARD_SLOWER)
    };
    let mttkrp_ms = nnz * n as f64 * ps * 1e-9;
    let update_ms = rows * rank as f64 * UPDATE_PS * 1e-9;
    if g == 1 {
        return mttkrp_ms + update_ms;
    }
    let split = (mttkrp_ms * slower + update_ms) / g as f64;
    let exchange_ms = exchanged * (rank * 4) as f64 / LINK_BYTES_PER_S * 1e3;
    split + exchange_ms + GROUP_MODE_MS * n as f64
}

/// Rows one GPU receives when a mode is all-gathered over `g` GPUs.
fn all_gather_rows(t: &SparseTensor, mode: usize, g: usize) -> f64 {
    f64::from(t.dims()[mode]) * (g - 1) as f64 / g as f64
}

/// Rows one GPU is expected to receive when only the rows read are sent:
/// a row it does not own (`(g - 1) / g` of them) is read when one of the
/// `c (n - 1)` factor reads its `c` nonzeros make falls on it.
fn read_rows(counts: &[u64], n: usize, g: usize) -> f64 {
    let miss = 1.0 - 1.0 / g as f64;
    let read: f64 = counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| 1.0 - miss.powf((c * (n as u64 - 1)) as f64))
        .sum();
    read * miss
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PowerLawSpec, power_law};

    #[test]
    fn a_small_tensor_stays_on_one_gpu_and_says_why() {
        let t = power_law(&PowerLawSpec::new(vec![300, 200, 100], 20_000)).unwrap();
        let c = pick(&t, 32, 4, true, true);
        assert_eq!(c.gpus, 1, "{c:?}");
        assert_eq!(c.predicted_ms.len(), 4);
        assert!(c.reason.starts_with("1 of 4"), "{}", c.reason);
        // Unless one GPU cannot hold it.
        assert!(pick(&t, 32, 4, false, true).gpus >= 2);
        // One GPU available: one GPU.
        assert_eq!(pick(&t, 32, 1, true, true).gpus, 1);
    }

    #[test]
    fn a_tensor_of_nell_1s_size_goes_to_every_gpu_and_one_of_t3s_stays_on_one() {
        // Shapes only (the prediction reads dimensions and nonzero counts;
        // the rows read are estimated from the index counts).
        // nell-1's shape with 1M nonzeros: the update of 30.5M rows alone
        // takes about 5 ms on one GPU, and splits over four.
        let big = power_law(
            &PowerLawSpec::new(vec![2_902_330, 2_143_368, 25_495_389], 1_000_000).with_seed(1),
        )
        .unwrap();
        let c = pick(&big, 32, 4, true, true);
        assert_eq!(c.gpus, 4, "{c:?}");
        assert!(c.predicted_ms[0] > 5.0, "{c:?}");
        let small = power_law(&PowerLawSpec::new(vec![12_092, 9_184, 28_818], 2_000_000)).unwrap();
        let c = pick(&small, 32, 4, true, true);
        assert_eq!(c.gpus, 1, "{c:?}");
    }

    #[test]
    fn the_prediction_splits_the_work_and_adds_the_exchange() {
        let t = power_law(&PowerLawSpec::new(vec![300, 200, 100], 20_000)).unwrap();
        let one = predict(&t, 32, 1, 0.0);
        let four = predict(&t, 32, 4, 0.0);
        assert!(
            (four - (one * SHARD_SLOWER_CACHED / 4.0 + 3.0 * GROUP_MODE_MS)).abs()
                < 0.01 * one + 1e-9
        );
        assert!(predict(&t, 32, 4, 3e6) > four);
        // A row read by many nonzeros is expected on every GPU; an empty
        // row on none.
        assert!((read_rows(&[1_000_000], 3, 4) - 0.75).abs() < 1e-9);
        assert_eq!(read_rows(&[0, 0], 3, 4), 0.0);
        assert_eq!(fastest(&[3.0, 2.0, 2.0, 2.5], true), 2);
        assert_eq!(fastest(&[1.0, 2.0], false), 2);
    }

    #[test]
    fn a_long_mode_costs_nothing_where_a_split_plan_may_run() {
        // One mode of 26M rows against two of 3M and 2M: by owner every
        // GPU receives three quarters of every mode; split by the long
        // mode, twice the short modes' (reduced, then all-gathered).
        let t = power_law(
            &PowerLawSpec::new(vec![3_000_000, 2_000_000, 26_000_000], 100_000).with_seed(2),
        )
        .unwrap();
        let all = |mode: usize| all_gather_rows(&t, mode, 4);
        let by_owner = exchanged_rows(&t, 4, false, &all);
        assert!((by_owner - 0.75 * 31e6).abs() < 1.0, "{by_owner}");
        let split = exchanged_rows(&t, 4, true, &all);
        assert!((split - 2.0 * 0.75 * 5e6).abs() < 1.0, "{split}");
        // On one GPU nothing travels, and a cubic tensor keeps rows by
        // owner (a split would send more).
        assert_eq!(exchanged_rows(&t, 1, true, &|_| 0.0), 0.0);
        let cube = power_law(&PowerLawSpec::new(vec![1000, 1000, 1000], 10_000)).unwrap();
        let all = |mode: usize| all_gather_rows(&cube, mode, 4);
        assert_eq!(
            exchanged_rows(&cube, 4, true, &all),
            exchanged_rows(&cube, 4, false, &all)
        );
        // The predictions follow, on a tensor of the same shape whose
        // rows are read by every GPU.
        let dense = power_law(&PowerLawSpec::new(vec![3000, 2000, 26_000], 2_000_000)).unwrap();
        let with = pick(&dense, 32, 4, true, true);
        let without = pick(&dense, 32, 4, true, false);
        assert!(
            with.predicted_ms[3] < without.predicted_ms[3],
            "{with:?} {without:?}"
        );
        assert_eq!(with.predicted_ms[0], without.predicted_ms[0]);
    }
}
