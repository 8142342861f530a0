//! The scale of a tensor's values during a decomposition.
//!
//! CPD-ALS is invariant to the scale of the values: the tensor times `c`
//! has the same factors and fit, with every weight times `c`. f32 is not:
//! the MTTKRP's output and the factors are f32, so values near the f32
//! maximum overflow them (lambda NaN), and tiny values underflow once a
//! factor that carries their scale meets them in a product (every factor
//! entry of 1e-23 times a value of 1e-23 is below the smallest f32). So a
//! decomposition whose largest `|value|` lies outside
//! [`SAFE_MIN`, `SAFE_MAX`] runs on the values times `2^k`, which puts the
//! largest in `[1, 2)`, and the weights are multiplied back by `2^-k`.
//!
//! A power of two changes only a value's exponent: the scaled values are
//! the same numbers, exactly (subnormal f32 values scaled up included), so
//! the run sees the tensor the file describes. A tensor inside the window
//! is not scaled at all, and its results are bit-identical to what they
//! were without this module.

use kruskal_formats::SparseTensor;
use rayon::prelude::*;

use crate::model::KruskalModel;

/// The smallest largest-`|value|` used as it is: `2^-24`. A factor that
/// carries the values' scale `s` meets them in the MTTKRP's products, of
/// order `s^2` times factor entries; at `s >= 2^-24` these stay far above
/// the smallest normal f32 (`2^-126`).
pub const SAFE_MIN: f64 = 1.0 / (1u64 << 24) as f64;

/// The largest largest-`|value|` used as it is: `2^40`. An MTTKRP output
/// entry sums a slice's nonzeros (up to some `2^34` of them) times factor
/// entries of at most 1, and the solve may enlarge it by the conditioning
/// of the Gram product; from `2^40` that stays below the f32 maximum
/// (`2^128`).
pub const SAFE_MAX: f64 = (1u64 << 40) as f64;

/// What a decomposition multiplies the values by: `2^exponent`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ValueScale {
    exponent: i32,
}

impl ValueScale {
    /// No scaling.
    pub const NONE: ValueScale = ValueScale { exponent: 0 };

    /// The scale for values whose largest magnitude is `max_abs`: none
    /// inside [`SAFE_MIN`, `SAFE_MAX`] (and for 0, or a value that is not
    /// finite, which the tensor's own checks refuse), else the power of
    /// two that puts `max_abs` in `[1, 2)`.
    pub fn for_max_abs(max_abs: f64) -> ValueScale {
        if !max_abs.is_normal() || (SAFE_MIN..=SAFE_MAX).contains(&max_abs) {
            return ValueScale::NONE;
        }
        // The binary exponent of a normal f64 (every f32 value, subnormal
        // ones included, is a normal f64): exact, unlike a logarithm.
        let biased = ((max_abs.abs().to_bits() >> 52) & 0x7ff) as i32;
        ValueScale {
            exponent: 1023 - biased,
        }
    }

    /// The scale for `t`'s values ([`ValueScale::for_max_abs`] of its
    /// largest `|value|`). Cost: one parallel pass over the values.
    pub fn of_tensor(t: &SparseTensor) -> ValueScale {
        ValueScale::for_max_abs(t.max_abs())
    }

    /// The values are multiplied by `2^exponent()`.
    pub fn exponent(&self) -> i32 {
        self.exponent
    }

    /// Whether the values are used as they are.
    pub fn is_none(&self) -> bool {
        self.exponent == 0
    }

    /// `2^exponent()` as f64 (exact).
    pub fn factor(&self) -> f64 {
        2f64.powi(self.exponent)
    }

    /// `value * 2^exponent()`, rounded once to f32 (exact unless it falls
    /// below the normal f32 range).
    pub fn apply(&self, value: f32) -> f32 {
        (f64::from(value) * self.factor()) as f32
    }

    /// `values`, each scaled by [`ValueScale::apply`]. Cost: one parallel
    /// pass, and a copy of the values.
    pub fn applied(&self, values: &[f32]) -> Vec<f32> {
        values.par_iter().map(|&v| self.apply(v)).collect()
    }

    /// A squared norm of the unscaled values, as the scaled values have it
    /// (times `2^(2 exponent())`, exact in f64).
    pub fn norm_sq(&self, norm_sq: f64) -> f64 {
        norm_sq * self.factor() * self.factor()
    }

    /// Puts the model of the scaled values back in the tensor's own scale:
    /// every weight times `2^-exponent()` (the factors have unit columns
    /// and the fit does not depend on the scale).
    pub fn restore(&self, model: &mut KruskalModel) {
        let back = 2f64.powi(-self.exponent);
        model.lambda.iter_mut().for_each(|l| *l *= back);
    }

    /// `values multiplied by 2^-100 for the computation (largest |value|
    /// 3.4e38); the weights are scaled back`, for the user.
    pub fn describe(&self, max_abs: f64) -> String {
        format!(
            "multiplied by 2^{} for the computation (largest |value| {max_abs:.3e}, outside \
             2^-24 .. 2^40); the weights are scaled back",
            self.exponent
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_inside_the_window_are_left_alone() {
        for m in [SAFE_MIN, 1e-7, 0.5, 1.0, 5.0, 12_251.0, 1e12, SAFE_MAX] {
            assert!(ValueScale::for_max_abs(m).is_none(), "{m}");
        }
        for m in [0.0, f64::NAN, f64::INFINITY] {
            assert!(ValueScale::for_max_abs(m).is_none(), "{m}");
        }
    }

    #[test]
    fn values_outside_are_brought_to_one_or_two() {
        for m in [
            f64::from(f32::MAX),
            3.4e38,
            1e30,
            SAFE_MAX * 2.0,
            SAFE_MIN / 2.0,
            1e-23,
            1e-30,
            f64::from(f32::MIN_POSITIVE),
            1e-40,
            f64::from(f32::from_bits(1)), // the smallest subnormal, 2^-149
        ] {
            let s = ValueScale::for_max_abs(m);
            assert!(!s.is_none(), "{m}");
            let scaled = m * s.factor();
            assert!((1.0..2.0).contains(&scaled), "{m}: {scaled}");
            // In f32 too, and exactly.
            let v = m as f32;
            let back = f64::from(s.apply(v)) / s.factor();
            assert_eq!(back, f64::from(v), "{m}");
        }
        assert_eq!(ValueScale::for_max_abs(4.0 * SAFE_MAX).exponent(), -42);
        assert_eq!(
            ValueScale::for_max_abs(f64::from(f32::from_bits(1))).exponent(),
            149
        );
    }

    #[test]
    fn restore_multiplies_the_weights_back() {
        let s = ValueScale::for_max_abs(1e-30);
        let mut m = KruskalModel {
            lambda: vec![3.0 * s.factor(), 0.5 * s.factor()],
            factors: Vec::new(),
            iterations: Vec::new(),
            totals: Default::default(),
            converged: true,
            pseudo_inverse_solves: 0,
            interrupted: false,
        };
        s.restore(&mut m);
        assert_eq!(m.lambda, vec![3.0, 0.5]);
        assert_eq!(s.norm_sq(4.0), 4.0 * s.factor() * s.factor());
        assert_eq!(
            s.applied(&[1e-30, -2e-30]),
            vec![s.apply(1e-30), s.apply(-2e-30)]
        );
    }
}
