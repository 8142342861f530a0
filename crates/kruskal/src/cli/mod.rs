//! The `kruskal` subcommands, one module each; `common` holds what they
//! share. Each module's `run` is what the program calls; `mttkrp` turns
//! its flags into the options of [`kruskal::measure`] and calls it, as
//! `cargo xtask bench` does; `cpd` calls [`kruskal_cpd::decompose`], shown
//! as it runs by `show`, and prints [`kruskal::measure::cpd_report`].

pub mod check;
pub mod cleanup;
pub mod common;
pub mod compact;
pub mod convert;
pub mod cp_apr;
pub mod cpd;
pub mod distributed;
pub mod errors;
pub mod generate;
pub mod info;
pub mod mttkrp;
pub mod preflight;
pub mod show;
pub mod tune;
