//! Runs that are legal but probably not what the user meant: said before
//! the work starts, one line each, by the program and the Python bindings
//! alike. [`warnings`] returns them as data; each front end writes them in
//! its own words ([`Warning::text`]).

use kruskal_formats::SparseTensor;

use crate::error::{OptionName, Spelling, neutral};

/// A run worth a warning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Warning {
    /// The rank is larger than the dimension of `mode` (from 0): the
    /// factor has more columns than rows, so its columns cannot be
    /// independent, and the extra components only fit noise or duplicate
    /// others.
    RankAboveDimension { rank: usize, mode: usize, dim: u32 },
    /// The iteration limit is 0: the output is the initial factors.
    NoIterations,
    /// Every value is zero (`nnz` stored): nothing to fit; the fit is
    /// undefined and reported as 0.
    AllZeros { nnz: usize },
}

impl Warning {
    /// The option the warning is about, where it is one.
    pub fn option(&self) -> Option<OptionName> {
        match self {
            Warning::RankAboveDimension { .. } => Some(OptionName::Rank),
            Warning::NoIterations => Some(OptionName::Iters),
            Warning::AllZeros { .. } => None,
        }
    }

    /// One line, with options written by `spell` and modes counted from
    /// `first_mode` (1 as FROSTT files and the model's `mode-<n>.npy`
    /// files count them, 0 as Python indexes).
    pub fn text(&self, spell: Spelling, first_mode: usize) -> String {
        match self {
            Warning::RankAboveDimension { rank, mode, dim } => format!(
                "rank {rank} is larger than mode {}'s dimension {dim}: its factor has more columns than rows, so some components cannot be independent",
                mode + first_mode
            ),
            Warning::NoIterations => format!(
                "{}: no iteration runs, the output is the initial factors",
                spell(OptionName::Iters, Some("0"))
            ),
            Warning::AllZeros { nnz } => format!(
                "the tensor is all zeros ({nnz} nonzero entries stored, every value 0): there is nothing to fit"
            ),
        }
    }
}

impl std::fmt::Display for Warning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text(&neutral, 1))
    }
}

/// What is worth a warning about decomposing `tensor` at `rank` with at
/// most `iters` iterations (see [`Warning`]), in that order.
///
/// Cost: one pass over the values (only to tell whether all are zero).
pub fn warnings(tensor: &SparseTensor, rank: usize, iters: usize) -> Vec<Warning> {
    let mut out = Vec::new();
    for (mode, &dim) in tensor.dims().iter().enumerate() {
        if rank > dim as usize {
            out.push(Warning::RankAboveDimension { rank, mode, dim });
        }
    }
    if iters == 0 {
        out.push(Warning::NoIterations);
    }
    if tensor.values().iter().all(|&v| v == 0.0) {
        out.push(Warning::AllZeros { nnz: tensor.nnz() });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(values: Vec<f32>) -> SparseTensor {
        let n = values.len();
        SparseTensor::new(
            vec![4, 3, 5],
            vec![
                vec![0; n],
                (0..n as u32).map(|k| k % 3).collect(),
                vec![1; n],
            ],
            values,
        )
        .unwrap()
    }

    #[test]
    fn an_ordinary_run_gets_no_warning() {
        assert!(warnings(&tensor(vec![1.0, 2.0]), 3, 50).is_empty());
    }

    #[test]
    fn each_case_gets_one_line() {
        let lines = |t: &SparseTensor, rank, iters| -> Vec<String> {
            warnings(t, rank, iters)
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        let w = lines(&tensor(vec![1.0]), 4, 50);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with("rank 4 is larger than mode 2's dimension 3"),
            "{w:?}"
        );
        let w = lines(&tensor(vec![1.0]), 6, 0);
        assert_eq!(w.len(), 4, "{w:?}");
        assert!(w[3].contains("initial factors"), "{w:?}");
        let w = lines(&tensor(vec![0.0, 0.0]), 2, 10);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("all zeros"), "{w:?}");
        // No nonzeros at all is all zeros too.
        let w = lines(&tensor(vec![]), 2, 10);
        assert!(w[0].contains("all zeros"), "{w:?}");
        assert!(w.iter().all(|l| !l.contains('\n')));
    }

    #[test]
    fn each_front_end_writes_its_own_words() {
        let w = warnings(&tensor(vec![1.0]), 4, 0);
        assert_eq!(
            w,
            [
                Warning::RankAboveDimension {
                    rank: 4,
                    mode: 1,
                    dim: 3
                },
                Warning::NoIterations
            ]
        );
        let flag = |o: OptionName, v: Option<&str>| format!("--{o} {}", v.unwrap_or(""));
        assert!(
            w[0].text(&flag, 0)
                .starts_with("rank 4 is larger than mode 1's")
        );
        assert!(
            w[0].to_string()
                .starts_with("rank 4 is larger than mode 2's")
        );
        assert!(
            w[1].text(&flag, 1)
                .starts_with("--iters 0: no iteration runs")
        );
        assert!(w[1].to_string().starts_with("iters 0: no iteration runs"));
        assert_eq!(w[1].option(), Some(OptionName::Iters));
    }
}
