//! Which plan a group of GPUs takes, by the rows each would send per
//! iteration, counted from the tensor's own row counts.
//!
//! - **Rows by owner** (AMPED): each mode's shards follow that mode's row
//!   owners, every GPU writes only its own output rows, and after each
//!   mode's update its rows travel to the GPUs that read them (all-gather,
//!   or only the rows read: `sparse.rs`).
//! - **Split by one mode** (SPLATT's medium-grained decomposition with a
//!   grid of `1 x .. x gpus` blocks): every mode's shards follow the owners
//!   of one mode, the cut mode. Its rows are read by their owner alone and
//!   never travel; each other mode's MTTKRP is a partial sum over all of
//!   its rows on every GPU, reduced onto the owners (NCCL) before their
//!   update, whose rows then travel as in the rows plan. A long mode whose
//!   rows nearly every GPU reads (the all-gather of 26M rows of 32 floats
//!   after every update) costs nothing there, for the price of a
//!   reduction of the short modes.
//!
//! The count per plan: per mode, the all-gather's rows (every row with
//! nonzeros to every GPU but its owner), or the predicted rows read
//! (weighted by [`SPARSE_WEIGHT`]: the sparse exchange moves rows at about
//! two thirds of the all-gather's rate), whichever the exchange would
//! take; plus, in a split plan, as many again per partial mode for the
//! reduction (which sends each row's partial sums from the GPUs the
//! exchange sends it to). The split plan of the mode that saves most is taken
//! where it sends at most [`SPLIT_SHARE`] of the rows plan's rows and its
//! shards stay within [`SPLIT_BALANCE`] of the mean nonzeros.

use kruskal_partition::RowShards;
use kruskal_partition::readers::{CHEAPER_SHARE, all_gather_received};

use crate::sparse::{RowExchange, predicted_share_by};

/// A row sent by the sparse exchange costs about this many all-gathered
/// rows (packing, scattering and smaller messages; measured on 4 x H100,
/// 2026-11-26).
pub const SPARSE_WEIGHT: f64 = 1.5;

/// The split plan is taken where it sends at most this share of the rows
/// plan's (weighted) rows: a reduction is slower than an all-gather of the
/// same rows, and the partial MTTKRP writes more atomics.
pub const SPLIT_SHARE: f64 = 0.9;

/// Largest nonzeros of a GPU over the mean for a split plan (its shards of
/// every mode are the cut mode's, so that mode's balance is the MTTKRP's).
pub const SPLIT_BALANCE: f64 = 1.05;

/// Which plan a group takes (`--gpu-plan`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlanChoice {
    /// The plan that sends fewer rows, by the counts.
    #[default]
    Auto,
    /// Rows by owner in every mode.
    Rows,
    /// Split by a mode: the given one (0-based), or the one that saves
    /// most.
    Split(Option<usize>),
}

impl PlanChoice {
    /// How `--gpu-plan` spells it (modes counted from 1).
    pub fn name(self) -> String {
        match self {
            PlanChoice::Auto => "auto".into(),
            PlanChoice::Rows => "rows".into(),
            PlanChoice::Split(None) => "split".into(),
            PlanChoice::Split(Some(m)) => format!("split:{}", m + 1),
        }
    }
}

impl std::str::FromStr for PlanChoice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(PlanChoice::Auto),
            "rows" => Ok(PlanChoice::Rows),
            "split" => Ok(PlanChoice::Split(None)),
            other => match other.strip_prefix("split:").map(str::parse::<usize>) {
                Some(Ok(m)) if m >= 1 => Ok(PlanChoice::Split(Some(m - 1))),
                _ => Err(format!(
                    "takes auto, rows, split or split:MODE (a mode from 1), not '{other}'"
                )),
            },
        }
    }
}

/// The rows one plan sends per iteration, as counted.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanCount {
    /// `None`: rows by owner; else the cut mode.
    pub split: Option<usize>,
    /// Per mode: rows exchanged after the update (weighted) and rows
    /// reduced after the MTTKRP (weighted alike).
    pub per_mode: Vec<(f64, f64)>,
    /// Largest nonzeros of a GPU over the mean, in the MTTKRP of the
    /// mode whose shards are least balanced.
    pub balance: f64,
}

impl PlanCount {
    /// Rows sent per iteration, in all.
    pub fn total(&self) -> f64 {
        self.per_mode.iter().map(|(x, r)| x + r).sum()
    }
}

/// What the counts of every plan need of one mode: the all-gather's rows
/// per iteration and the predicted share of them a sparse exchange sends,
/// with the rows plan's shards and with a split plan's.
struct ModeFacts {
    all: f64,
    share_rows: f64,
    share_split: f64,
}

/// [`ModeFacts`] of every mode; `split` says whether split plans are
/// counted (else their share is left at 1 and not predicted).
fn facts(plan: &RowShards, split: bool) -> Vec<ModeFacts> {
    let n = plan.dims().len();
    (0..n)
        .map(|mode| ModeFacts {
            all: (0..plan.gpus())
                .map(|h| all_gather_received(plan, mode, h) as f64)
                .sum(),
            // Rows plan: a nonzero's other modes are on random GPUs; split:
            // every mode's shard of a nonzero is on one GPU.
            share_rows: predicted_share_by(plan, mode, n as u64 - 1),
            share_split: if split {
                predicted_share_by(plan, mode, 1)
            } else {
                1.0
            },
        })
        .collect()
}

/// Rows an exchange of a mode sends: the all-gather's `all`, or the rows
/// read (`share` of them, weighted), as `rows` chooses.
fn exchanged(all: f64, share: f64, rows: RowExchange) -> f64 {
    let read = share * all * SPARSE_WEIGHT;
    match rows {
        RowExchange::All => all,
        RowExchange::Read => read,
        RowExchange::Auto if share <= CHEAPER_SHARE => read.min(all),
        RowExchange::Auto => all,
    }
}

/// The count of the plan `split` (`None`: rows by owner) over `plan`'s
/// rows (a rows plan; its ownership is every plan's).
fn count_with(
    plan: &RowShards,
    facts: &[ModeFacts],
    split: Option<usize>,
    rows: RowExchange,
) -> PlanCount {
    let n = plan.dims().len();
    let one = plan.gpus() == 1;
    let per_mode = (0..n)
        .map(|mode| {
            let f = &facts[mode];
            match split {
                _ if one => (0.0, 0.0),
                Some(cut) if cut == mode => (0.0, 0.0),
                Some(_) => {
                    // The reduction sends back what the exchange sends:
                    // every row, or each row read from its readers.
                    let x = exchanged(f.all, f.share_split, rows);
                    (x, x)
                }
                None => (exchanged(f.all, f.share_rows, rows), 0.0),
            }
        })
        .collect();
    let balance = match split {
        Some(cut) => plan.balance(cut).max_over_mean(),
        None => (0..n)
            .map(|mode| plan.balance(mode).max_over_mean())
            .fold(1.0, f64::max),
    };
    PlanCount {
        split,
        per_mode,
        balance,
    }
}

/// The rows `plan` (rows by owner, or split: its cut mode) sends per
/// iteration with `rows` as the exchange's choice of rows.
pub fn count(plan: &RowShards, rows: RowExchange) -> PlanCount {
    count_with(
        plan,
        &facts(plan, plan.split().is_some()),
        plan.split(),
        rows,
    )
}

/// What [`choose`] decided, with the counts behind it.
#[derive(Clone, Debug)]
pub struct PlanDecision {
    /// The cut mode, or `None` for rows by owner.
    pub split: Option<usize>,
    /// The rows plan's count and every split plan's considered.
    pub counts: Vec<PlanCount>,
    /// One line for the output: the plan taken and why.
    pub note: String,
}

/// Chooses the plan for `plan` (a rows plan, not yet split) under
/// `choice`. `split_ok` is `Err(why)` where a split plan cannot run (one
/// GPU, peer-to-peer copies, several processes); asking for one there is
/// an error, `auto` then keeps rows by owner.
pub fn choose(
    plan: &RowShards,
    choice: PlanChoice,
    rows: RowExchange,
    split_ok: Result<(), String>,
) -> Result<PlanDecision, String> {
    let n = plan.dims().len();
    if let PlanChoice::Split(Some(mode)) = choice {
        if mode >= n {
            return Err(format!(
                "split:{} names a mode of a {n}-mode tensor",
                mode + 1
            ));
        }
    }
    let candidates: Vec<usize> = match (choice, &split_ok) {
        (PlanChoice::Rows, _) => Vec::new(),
        (PlanChoice::Split(_), Err(why)) => {
            return Err(format!("a split plan cannot run here: {why}"));
        }
        (PlanChoice::Auto, Err(_)) => Vec::new(),
        (PlanChoice::Split(Some(mode)), Ok(())) => vec![mode],
        (_, Ok(())) => (0..n).collect(),
    };
    let facts = facts(plan, !candidates.is_empty());
    let rows_count = count_with(plan, &facts, None, rows);
    let mut counts = vec![rows_count.clone()];
    for cut in candidates {
        counts.push(count_with(plan, &facts, Some(cut), rows));
    }
    let rows_total = rows_count.total();
    let best = counts[1..]
        .iter()
        .filter(|c| choice != PlanChoice::Auto || c.balance <= SPLIT_BALANCE)
        .min_by(|a, b| a.total().total_cmp(&b.total()));
    let mb = |rows: f64| rows * 1e-6;
    let (split, note) = match (choice, best) {
        (PlanChoice::Rows, _) => (None, "rows by owner (asked for)".to_string()),
        (PlanChoice::Auto, Some(b)) if b.total() <= SPLIT_SHARE * rows_total => {
            let cut = b.split.expect("a split count");
            (
                Some(cut),
                format!(
                    "split by mode {} (its rows stay on their GPU): {:.2}M rows sent per \
                     iteration against {:.2}M by owner, nonzeros within {:.1}% of the mean",
                    cut + 1,
                    mb(b.total()),
                    mb(rows_total),
                    (b.balance - 1.0) * 100.0
                ),
            )
        }
        (PlanChoice::Auto, Some(b)) => (
            None,
            format!(
                "rows by owner: {:.2}M rows sent per iteration; split by mode {} would send \
                 {:.2}M",
                mb(rows_total),
                b.split.expect("a split count") + 1,
                mb(b.total())
            ),
        ),
        (PlanChoice::Auto, None) => (
            None,
            match &split_ok {
                Err(why) => format!("rows by owner (no split plan: {why})"),
                Ok(()) => format!(
                    "rows by owner: {:.2}M rows sent per iteration; no split plan keeps the \
                     nonzeros within {:.0}% of the mean",
                    mb(rows_total),
                    (SPLIT_BALANCE - 1.0) * 100.0
                ),
            },
        ),
        (PlanChoice::Split(_), _) => {
            let b = counts[1..]
                .iter()
                .min_by(|a, b| a.total().total_cmp(&b.total()))
                .expect("at least one mode");
            let cut = b.split.expect("a split count");
            (
                Some(cut),
                format!(
                    "split by mode {} (asked for): {:.2}M rows sent per iteration against \
                     {:.2}M by owner",
                    cut + 1,
                    mb(b.total()),
                    mb(rows_total)
                ),
            )
        }
    };
    Ok(PlanDecision {
        split,
        counts,
        note,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PowerLawSpec, power_law};

    #[test]
    fn plan_choices_parse_and_print() {
        for s in ["auto", "rows", "split", "split:3"] {
            assert_eq!(s.parse::<PlanChoice>().unwrap().name(), s);
        }
        assert_eq!(
            "split:2".parse::<PlanChoice>().unwrap(),
            PlanChoice::Split(Some(1))
        );
        for bad in ["", "grid", "split:0", "split:x", "split:"] {
            assert!(bad.parse::<PlanChoice>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_long_mode_read_everywhere_is_split_and_short_dense_modes_are_not() {
        // A long third mode whose rows hold many nonzeros each: every GPU
        // reads nearly all of them, so the rows plan all-gathers it.
        let mut spec = PowerLawSpec::new(vec![200, 150, 20_000], 400_000).with_seed(4);
        spec.exponents = vec![0.5; 3];
        let t = power_law(&spec).unwrap();
        let plan = RowShards::new(&t, 4).unwrap();
        let d = choose(&plan, PlanChoice::Auto, RowExchange::Auto, Ok(())).unwrap();
        assert_eq!(d.split, Some(2), "{}", d.note);
        assert_eq!(d.counts.len(), 4);
        let rows = d.counts[0].total();
        let split = d.counts[3].total();
        assert!(split < SPLIT_SHARE * rows, "{split} against {rows}");
        // Its cut mode sends nothing; the others are reduced.
        assert_eq!(d.counts[3].per_mode[2], (0.0, 0.0));
        assert!(d.counts[3].per_mode[0].1 > 0.0);
        assert!(d.note.starts_with("split by mode 3"), "{}", d.note);

        // Where a split plan cannot run, auto keeps rows and says why;
        // asking for one is an error.
        let d = choose(
            &plan,
            PlanChoice::Auto,
            RowExchange::Auto,
            Err("p2p".into()),
        )
        .unwrap();
        assert_eq!(d.split, None);
        assert!(d.note.contains("p2p"), "{}", d.note);
        assert!(
            choose(
                &plan,
                PlanChoice::Split(None),
                RowExchange::Auto,
                Err("p2p".into())
            )
            .is_err()
        );
        assert!(choose(&plan, PlanChoice::Split(Some(3)), RowExchange::Auto, Ok(())).is_err());
        let d = choose(&plan, PlanChoice::Split(Some(0)), RowExchange::Auto, Ok(())).unwrap();
        assert_eq!(d.split, Some(0));
        let d = choose(&plan, PlanChoice::Rows, RowExchange::Auto, Ok(())).unwrap();
        assert_eq!(d.split, None);
        assert_eq!(d.counts.len(), 1);
    }

    #[test]
    fn cubic_tensors_keep_rows_by_owner() {
        // Three short modes of equal length: a split saves one mode's
        // exchange and adds two reductions.
        let t = power_law(&PowerLawSpec::new(vec![500, 500, 500], 200_000).with_seed(2)).unwrap();
        let plan = RowShards::new(&t, 4).unwrap();
        let d = choose(&plan, PlanChoice::Auto, RowExchange::Auto, Ok(())).unwrap();
        assert_eq!(d.split, None, "{}", d.note);
        assert!(d.note.starts_with("rows by owner"), "{}", d.note);
    }
}
