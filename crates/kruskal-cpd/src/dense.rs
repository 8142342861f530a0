//! The small dense algebra of CPD-ALS: R x R Hadamard products and the
//! f64 solve `V^{-1}` (Cholesky) or `V^+` (pseudo-inverse when V is
//! singular), through faer.

use faer::linalg::solvers::DenseSolveCore;
use faer::{Mat, Side};
use ndarray::Array2;

/// How the R x R system of one mode update was solved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SolveKind {
    Cholesky,
    PseudoInverse,
}

/// Below this ratio of smallest to largest squared Cholesky pivot, V is
/// treated as singular: its inverse would amplify rounding by more than
/// 1/ratio, and the pseudo-inverse gives the least-squares answer instead.
const SINGULAR_RATIO: f64 = 1e-13;

/// Element-wise product of the Gram matrices of every mode except `skip`.
///
/// Shapes: every `grams[w]` is `rank x rank`; so is the result.
pub fn hadamard_except(grams: &[Array2<f64>], skip: Option<usize>) -> Array2<f64> {
    let rank = grams[0].nrows();
    let mut v = Array2::<f64>::ones((rank, rank));
    for (w, g) in grams.iter().enumerate() {
        if Some(w) != skip {
            v *= g;
        }
    }
    v
}

/// Returns `W` with `A = M W` solving the normal equations `A V = M`:
/// `W = V^{-1}` through Cholesky when V is positive definite, else the
/// pseudo-inverse `V^+` through a symmetric eigendecomposition.
///
/// Shapes: `v` is `rank x rank`, symmetric; so is the result. Cost: O(rank^3).
pub fn solve_matrix(v: &Array2<f64>) -> (Array2<f64>, SolveKind) {
    let rank = v.nrows();
    let vf = Mat::<f64>::from_fn(rank, rank, |i, j| v[[i, j]]);
    let to_nd = |m: &Mat<f64>| Array2::from_shape_fn((rank, rank), |(i, j)| m[(i, j)]);
    if v.iter().all(|x| x.is_finite()) {
        if let Ok(llt) = vf.llt(Side::Lower) {
            let l = llt.L();
            let pivots = (0..rank).map(|i| l[(i, i)] * l[(i, i)]);
            let (lo, hi) = pivots.fold((f64::INFINITY, 0f64), |(lo, hi), p| (lo.min(p), hi.max(p)));
            if lo > SINGULAR_RATIO * hi {
                return (to_nd(&llt.inverse()), SolveKind::Cholesky);
            }
        }
    }
    match vf.self_adjoint_eigen(Side::Lower) {
        Ok(evd) => (to_nd(&evd.pseudoinverse()), SolveKind::PseudoInverse),
        // Only non-finite input makes the eigensolver fail: the factors have
        // diverged, and zeros keep the run going to report it.
        Err(_) => (Array2::zeros((rank, rank)), SolveKind::PseudoInverse),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cholesky_inverse_of_spd_matrix() {
        let v = ndarray::arr2(&[[4.0, 1.0], [1.0, 3.0]]);
        let (w, kind) = solve_matrix(&v);
        assert_eq!(kind, SolveKind::Cholesky);
        let eye = v.dot(&w);
        assert!((eye[[0, 0]] - 1.0).abs() < 1e-12 && eye[[0, 1]].abs() < 1e-12);
    }

    #[test]
    fn singular_matrix_gets_pseudo_inverse() {
        // Rank one: [1 2; 2 4] = u u^T with u = (1, 2); V^+ = V / |u|^4.
        let v = ndarray::arr2(&[[1.0, 2.0], [2.0, 4.0]]);
        let (w, kind) = solve_matrix(&v);
        assert_eq!(kind, SolveKind::PseudoInverse);
        for (a, b) in w.iter().zip(v.iter()) {
            assert!((a - b / 25.0).abs() < 1e-12, "{w:?}");
        }
    }

    #[test]
    fn hadamard_skips_one_mode() {
        let g = vec![
            ndarray::arr2(&[[2.0, 1.0], [1.0, 2.0]]),
            ndarray::arr2(&[[3.0, 0.5], [0.5, 3.0]]),
            ndarray::arr2(&[[5.0, 2.0], [2.0, 5.0]]),
        ];
        assert_eq!(
            hadamard_except(&g, Some(1)),
            ndarray::arr2(&[[10.0, 2.0], [2.0, 10.0]])
        );
        assert_eq!(hadamard_except(&g, None)[[0, 1]], 1.0);
    }
}
