//! The constraints of `kruskal cpd` (`--nonneg`, `--l1`, `--l2`,
//! `--admm-blocks`), read as the command reads them, for every front end
//! that takes them as flags (the program, `cargo xtask bench`'s `flags`):
//! the values' parsers and the AO-ADMM options they ask for.

use kruskal_cpd::{AdmmOptions, InnerStop, NonNeg};

use super::{MeasureError, Result};

/// `--nonneg`'s value: `all` (what a bare `--nonneg` stands for), or a
/// comma list of modes numbered from 1 (`1,3`), which becomes the sorted
/// modes numbered from 0 without repeats. The error says what the value
/// is not.
///
/// ```
/// use kruskal::cpd::NonNeg;
/// use kruskal::measure::parse_nonneg;
///
/// assert_eq!(parse_nonneg("all"), Ok(NonNeg::All));
/// assert_eq!(parse_nonneg("3, 1,3"), Ok(NonNeg::Modes(vec![0, 2])));
/// assert!(parse_nonneg("0").is_err());
/// ```
pub fn parse_nonneg(text: &str) -> std::result::Result<NonNeg, String> {
    if text == "all" {
        return Ok(NonNeg::All);
    }
    let bad = || format!("'{text}' is not a comma list of modes numbered from 1");
    let mut modes = Vec::new();
    for part in text.split(',') {
        let mode: usize = part.trim().parse().map_err(|_| bad())?;
        if mode == 0 {
            return Err(bad());
        }
        if !modes.contains(&(mode - 1)) {
            modes.push(mode - 1);
        }
    }
    modes.sort_unstable();
    Ok(NonNeg::Modes(modes))
}

/// `--l1`'s and `--l2`'s value: a finite weight >= 0.
///
/// ```
/// use kruskal::measure::parse_weight;
///
/// assert_eq!(parse_weight("0.5"), Ok(0.5));
/// assert!(parse_weight("-1").is_err() && parse_weight("inf").is_err());
/// ```
pub fn parse_weight(text: &str) -> std::result::Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(w) if w.is_finite() && w >= 0.0 => Ok(w),
        _ => Err(format!("'{text}' is not a finite weight >= 0")),
    }
}

/// The constraint flags of `kruskal cpd`, as given (`None`, `false`: not
/// given). With none of `nonneg`, `l1` and `l2` the decomposition is plain
/// ALS; with any, AO-ADMM ([`ConstraintFlags::admm_options`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConstraintFlags {
    /// `--nonneg [MODES]` ([`parse_nonneg`]).
    pub nonneg: Option<NonNeg>,
    /// `--l1 W` ([`parse_weight`]).
    pub l1: Option<f64>,
    /// `--l2 W` ([`parse_weight`]).
    pub l2: Option<f64>,
    /// `--admm-blocks`: AO-ADMM's inner loop with each row stopping on
    /// its own ([`InnerStop::RowBlocks`]).
    pub admm_blocks: bool,
}

impl ConstraintFlags {
    /// The AO-ADMM options the flags ask for; `None` (plain ALS) when none
    /// of `--nonneg`, `--l1` and `--l2` is given. A lone `--admm-blocks`
    /// asks for nothing: [`ConstraintFlags::check`] refuses it.
    pub fn admm_options(&self) -> Option<AdmmOptions> {
        if self.nonneg.is_none() && self.l1.is_none() && self.l2.is_none() {
            return None;
        }
        Some(AdmmOptions {
            nonneg: self.nonneg.clone().unwrap_or(NonNeg::None),
            l1: self.l1.unwrap_or(0.0),
            l2: self.l2.unwrap_or(0.0),
            inner: if self.admm_blocks {
                InnerStop::RowBlocks
            } else {
                InnerStop::AllRows
            },
            ..AdmmOptions::default()
        })
    }

    /// An error ([`MeasureError::Invalid`]) when `--admm-blocks` is given
    /// without a constraint to run AO-ADMM for.
    pub fn check(&self) -> Result<()> {
        if self.admm_blocks && self.admm_options().is_none() {
            return Err(MeasureError::Invalid(
                "--admm-blocks is for AO-ADMM: give it with --nonneg, --l1 or --l2".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonneg_takes_all_or_modes_numbered_from_one() {
        assert_eq!(parse_nonneg("all"), Ok(NonNeg::All));
        assert_eq!(parse_nonneg("2"), Ok(NonNeg::Modes(vec![1])));
        assert_eq!(parse_nonneg("3,1, 3"), Ok(NonNeg::Modes(vec![0, 2])));
        for bad in ["0", "x", "1,x", "1,,2", "", "-1", "All"] {
            assert_eq!(
                parse_nonneg(bad),
                Err(format!(
                    "'{bad}' is not a comma list of modes numbered from 1"
                ))
            );
        }
    }

    #[test]
    fn a_weight_is_finite_and_not_negative() {
        assert_eq!(parse_weight("0"), Ok(0.0));
        assert_eq!(parse_weight(" 0.25"), Ok(0.25));
        for bad in ["-1", "nan", "inf", "x", ""] {
            assert_eq!(
                parse_weight(bad),
                Err(format!("'{bad}' is not a finite weight >= 0"))
            );
        }
    }

    #[test]
    fn constraints_ask_for_ao_admm_and_blocks_need_one() {
        let none = ConstraintFlags::default();
        assert!(none.admm_options().is_none() && none.check().is_ok());
        let blocks = ConstraintFlags {
            admm_blocks: true,
            ..ConstraintFlags::default()
        };
        assert!(blocks.admm_options().is_none());
        assert_eq!(
            blocks.check().unwrap_err().to_string(),
            "--admm-blocks is for AO-ADMM: give it with --nonneg, --l1 or --l2"
        );
        let a = ConstraintFlags {
            l2: Some(0.5),
            ..blocks
        };
        a.check().unwrap();
        let o = a.admm_options().unwrap();
        assert_eq!((o.nonneg, o.l1, o.l2), (NonNeg::None, 0.0, 0.5));
        assert_eq!(o.inner, InnerStop::RowBlocks);
        let o = ConstraintFlags {
            nonneg: Some(NonNeg::All),
            ..ConstraintFlags::default()
        }
        .admm_options()
        .unwrap();
        assert_eq!((o.nonneg, o.inner), (NonNeg::All, InnerStop::AllRows));
    }
}
