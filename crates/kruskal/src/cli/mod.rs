//! The `kruskal` subcommands, one module each; `common` holds what they
//! share. Each module's `run` is what the program calls; `mttkrp::measure`
//! and `cpd::measure` return the `--json` report without printing.

pub mod check;
pub mod common;
pub mod compact;
pub mod convert;
pub mod cpd;
pub mod distributed;
pub mod errors;
pub mod generate;
pub mod info;
pub mod mttkrp;
pub mod preflight;
pub mod tune;
