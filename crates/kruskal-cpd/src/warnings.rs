//! Runs that are legal but probably not what the user meant: said before
//! the work starts, one line each, by the program and the Python bindings
//! alike.

use kruskal_formats::SparseTensor;

/// One line per thing worth a warning about decomposing `tensor` at
/// `rank` with at most `iters` iterations:
///
/// - a rank larger than a mode's dimension (the factor has more columns
///   than rows, so its columns cannot be independent: the extra
///   components only fit noise or duplicate others);
/// - `iters` 0 (no iteration runs: the output is the initial factors);
/// - an all-zero tensor (nothing to fit; the fit is undefined and
///   reported as 0).
///
/// Cost: one pass over the values (only to tell whether all are zero).
pub fn warnings(tensor: &SparseTensor, rank: usize, iters: usize) -> Vec<String> {
    let mut out = Vec::new();
    for (mode, &dim) in tensor.dims().iter().enumerate() {
        if rank > dim as usize {
            out.push(format!(
                "rank {rank} is larger than mode {}'s dimension {dim}: its factor has more columns than rows, so some components cannot be independent",
                mode + 1
            ));
        }
    }
    if iters == 0 {
        out.push("--iters 0: no iteration runs, the output is the initial factors".to_string());
    }
    if tensor.values().iter().all(|&v| v == 0.0) {
        out.push(format!(
            "the tensor is all zeros ({} nonzero entries stored, every value 0): there is nothing to fit",
            tensor.nnz()
        ));
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
        let w = warnings(&tensor(vec![1.0]), 4, 50);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with("rank 4 is larger than mode 2's dimension 3"),
            "{w:?}"
        );
        let w = warnings(&tensor(vec![1.0]), 6, 0);
        assert_eq!(w.len(), 4, "{w:?}");
        assert!(w[3].contains("initial factors"), "{w:?}");
        let w = warnings(&tensor(vec![0.0, 0.0]), 2, 10);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("all zeros"), "{w:?}");
        // No nonzeros at all is all zeros too.
        let w = warnings(&tensor(vec![]), 2, 10);
        assert!(w[0].contains("all zeros"), "{w:?}");
        assert!(w.iter().all(|l| !l.contains('\n')));
    }
}
