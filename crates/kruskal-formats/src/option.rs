//! The options a library message names, by names no front end owns.
//!
//! A message that tells the user which option to change (`use the
//! pattern option`, `rank must be at least 1`) names it by an
//! [`OptionName`]; each front end spells it in its own words through a
//! [`Spelling`]: the command line as its flag (`--pattern`, `--rank`),
//! Python as its keyword (`pattern=True`, `rank`). The library's own text
//! (its `Display`) uses [`neutral`].

/// An option of a run, a reader or a generator, by a name no front end
/// owns. The command line writes [`OptionName::ZeroBased`] as
/// `--zero-based`, the Python package as `zero_based=True`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OptionName {
    Rank,
    Iters,
    Tol,
    Seed,
    Starts,
    Init,
    Backend,
    Kernel,
    Gpus,
    /// Relabeling each mode to the indices that occur in it.
    Compact,
    Nonneg,
    L1,
    L2,
    /// The mode an MTTKRP is measured for.
    Mode,
    /// How many times a measurement is repeated.
    Repeat,
    /// A text file lists only indices; every value is 1.
    Pattern,
    /// A text file's indices start at 0.
    ZeroBased,
    /// The nonzero count a generator makes.
    Nnz,
    /// The engine's launch parameters from their fixed defaults, not from
    /// the tuning model.
    NoModel,
    /// F-COO's nonzeros per thread.
    Threadlen,
    /// FLYCOO's partitions per mode.
    Kappa,
    /// HiCOO's block size, as bits of each index.
    BlockBits,
}

impl OptionName {
    /// The neutral name: lower case, words joined by `_`.
    pub fn name(self) -> &'static str {
        match self {
            OptionName::Rank => "rank",
            OptionName::Iters => "iters",
            OptionName::Tol => "tol",
            OptionName::Seed => "seed",
            OptionName::Starts => "starts",
            OptionName::Init => "init",
            OptionName::Backend => "backend",
            OptionName::Kernel => "kernel",
            OptionName::Gpus => "gpus",
            OptionName::Compact => "compact",
            OptionName::Nonneg => "nonneg",
            OptionName::L1 => "l1",
            OptionName::L2 => "l2",
            OptionName::Mode => "mode",
            OptionName::Repeat => "repeat",
            OptionName::Pattern => "pattern",
            OptionName::ZeroBased => "zero_based",
            OptionName::Nnz => "nnz",
            OptionName::NoModel => "no_model",
            OptionName::Threadlen => "threadlen",
            OptionName::Kappa => "kappa",
            OptionName::BlockBits => "block_bits",
        }
    }
}

impl std::fmt::Display for OptionName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a front end writes an option, with the value given where the
/// message names one (`--gpus 3`, `gpus=3`).
pub type Spelling<'a> = &'a dyn Fn(OptionName, Option<&str>) -> String;

/// The library's own spelling: the neutral name, then the value
/// (`kernel coo`, `zero_based`).
pub fn neutral(option: OptionName, value: Option<&str>) -> String {
    match value {
        Some(v) => format!("{option} {v}"),
        None => option.name().to_string(),
    }
}

/// Options and their values, each spelled by `spell`, joined by spaces
/// (`--kernel fcoo --threadlen 8`).
pub fn spell_all(options: &[(OptionName, Option<String>)], spell: Spelling) -> String {
    options
        .iter()
        .map(|(o, v)| spell(*o, v.as_deref()))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neutral_names_are_lower_case_words() {
        for o in [
            OptionName::ZeroBased,
            OptionName::BlockBits,
            OptionName::NoModel,
        ] {
            assert!(o.name().chars().all(|c| c.is_ascii_lowercase() || c == '_'));
        }
        assert_eq!(neutral(OptionName::Kernel, Some("coo")), "kernel coo");
        assert_eq!(neutral(OptionName::ZeroBased, None), "zero_based");
        let dashed = |o: OptionName, v: Option<&str>| match v {
            Some(v) => format!("--{} {v}", o.name()),
            None => format!("--{}", o.name()),
        };
        assert_eq!(
            spell_all(
                &[
                    (OptionName::Kernel, Some("fcoo".into())),
                    (OptionName::Threadlen, Some("8".into()))
                ],
                &dashed
            ),
            "--kernel fcoo --threadlen 8"
        );
    }
}
