//! Factor match score (FMS): how well a computed model recovers a known one.

use ndarray::Array2;

/// Factor match score of `(lambda_a, a)` against the true `(lambda_b, b)`,
/// in [0, 1] (1: the same components up to scaling and permutation).
///
/// For a pair of components the score is
/// `(1 - |l_a - l_b| / max(l_a, l_b)) * prod_m |cos(a_m, b_m)|`, with the
/// weights `l` including the column norms; components are matched greedily,
/// best pair first, and the score is the mean over the true components.
///
/// Shapes: both models have one `dims[m] x rank` matrix per mode; the ranks
/// may differ (unmatched true components score 0). Cost: O(rank_a * rank_b *
/// sum(dims)).
pub fn factor_match_score(
    lambda_a: &[f64],
    a: &[Array2<f32>],
    lambda_b: &[f64],
    b: &[Array2<f32>],
) -> f64 {
    let (ra, rb) = (lambda_a.len(), lambda_b.len());
    if rb == 0 {
        return 0.0;
    }
    let norms = |f: &Array2<f32>, r: usize| {
        f.column(r)
            .iter()
            .map(|&x| f64::from(x).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let weight = |lambda: &[f64], fs: &[Array2<f32>], r: usize| {
        lambda[r].abs() * fs.iter().map(|f| norms(f, r)).product::<f64>()
    };
    let mut pairs = Vec::with_capacity(ra * rb);
    for i in 0..ra {
        for j in 0..rb {
            let mut score = 1f64;
            for (fa, fb) in a.iter().zip(b) {
                let dot: f64 = fa
                    .column(i)
                    .iter()
                    .zip(fb.column(j))
                    .map(|(&x, &y)| f64::from(x) * f64::from(y))
                    .sum();
                let denom = norms(fa, i) * norms(fb, j);
                score *= if denom > 0.0 {
                    (dot / denom).abs()
                } else {
                    0.0
                };
            }
            let (wa, wb) = (weight(lambda_a, a, i), weight(lambda_b, b, j));
            let top = wa.max(wb);
            score *= if top > 0.0 {
                1.0 - (wa - wb).abs() / top
            } else {
                1.0
            };
            pairs.push((score, i, j));
        }
    }
    pairs.sort_by(|x, y| y.0.total_cmp(&x.0));
    let (mut used_a, mut used_b) = (vec![false; ra], vec![false; rb]);
    let mut total = 0f64;
    for (score, i, j) in pairs {
        if !used_a[i] && !used_b[j] {
            used_a[i] = true;
            used_b[j] = true;
            total += score;
        }
    }
    total / rb as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_models_score_one_and_permutation_does_not_matter() {
        let f = vec![
            ndarray::arr2(&[[1.0f32, 0.0], [0.5, 1.0], [0.0, 2.0]]),
            ndarray::arr2(&[[3.0f32, 1.0], [0.0, 1.0]]),
        ];
        let swapped: Vec<Array2<f32>> = f
            .iter()
            .map(|m| Array2::from_shape_fn(m.dim(), |(i, j)| m[[i, 1 - j]]))
            .collect();
        assert!((factor_match_score(&[1.0, 2.0], &f, &[1.0, 2.0], &f) - 1.0).abs() < 1e-12);
        assert!((factor_match_score(&[2.0, 1.0], &swapped, &[1.0, 2.0], &f) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn different_models_score_less() {
        let a = vec![
            ndarray::arr2(&[[1.0f32], [0.0]]),
            ndarray::arr2(&[[1.0f32], [0.0]]),
        ];
        let b = vec![
            ndarray::arr2(&[[1.0f32], [1.0]]),
            ndarray::arr2(&[[1.0f32], [0.0]]),
        ];
        let s = factor_match_score(&[1.0], &a, &[2f64.sqrt().recip()], &b);
        // cos = 1/sqrt(2); weights 1 and 1/sqrt(2) * sqrt(2) = 1.
        assert!((s - 0.5f64.sqrt()).abs() < 1e-6, "{s}");
        assert!(factor_match_score(&[1.0], &a, &[4.0], &a) < 0.3);
    }
}
