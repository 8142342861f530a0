//! One module per subcommand; `common` holds what they share.

pub mod check;
pub mod common;
pub mod convert;
pub mod cpd;
pub mod generate;
pub mod info;
pub mod mttkrp;
pub mod tune;
