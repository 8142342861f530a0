//! Load-balanced partitioning for kruskal.
//!
//! - [`lpt`]: greedy LPT (FLYCOO-GPU Algorithm 1) and cyclic assignment of
//!   weighted units to partitions, with balance statistics.
//! - [`layout`]: one mode's layout of the nonzeros, partition by partition:
//!   output rows assigned by LPT on their nonzero counts, rows heavier than a
//!   threshold split into pieces, and the position (remap id) of every
//!   nonzero in that layout.
//! - [`flycoo`]: the FLYCOO tensor built from the layouts of every mode.
//! - [`shard`]: AMPED plans: per mode, output rows to GPUs (shards), each
//!   shard cut into equal inter-shard partitions (ISPs).
//! - [`rows`]: the multi-GPU group's plan: whole rows per GPU by LPT,
//!   relabeled so each GPU owns one contiguous range, and the per-mode
//!   elements its shards are cut from.
//! - [`readers`]: which GPUs read which factor rows, and the rows each
//!   owner sends each reader in the sparse exchange.
//!
//! ```
//! use kruskal_formats::generate::{power_law, PowerLawSpec};
//! use kruskal_partition::layout::{LayoutOptions, ModeLayout};
//!
//! let t = power_law(&PowerLawSpec::new(vec![200, 100, 50], 10_000)).unwrap();
//! let layout = ModeLayout::new(&t, 0, &LayoutOptions::new(8)).unwrap();
//! // Every nonzero has one position, and the partitions cover them all.
//! assert_eq!(layout.part_ptr().last(), Some(&10_000));
//! assert!(layout.balance().max_over_mean() < 1.5);
//! ```

pub mod flycoo;
pub mod layout;
pub mod lpt;
pub mod readers;
pub mod rows;
pub mod shard;

pub use layout::{LayoutOptions, ModeLayout};
pub use lpt::{Assignment, Balance, Policy, cyclic, lpt};
pub use readers::{ExchangeLists, ModeLists, RowReaders};
pub use rows::RowShards;
pub use shard::{ShardOptions, ShardPlan};

use kruskal_formats::FormatError;

/// Errors of partitioning.
#[derive(Debug, thiserror::Error)]
pub enum PartitionError {
    /// An option (kappa, threshold, GPU count, mode) cannot be used.
    #[error("invalid argument: {0}")]
    Argument(String),

    #[error(transparent)]
    Format(#[from] FormatError),
}

pub type Result<T, E = PartitionError> = std::result::Result<T, E>;
