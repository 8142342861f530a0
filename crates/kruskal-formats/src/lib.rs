//! Sparse tensor formats for kruskal.
//!
//! The canonical form is [`SparseTensor`], a COO tensor stored as a structure
//! of arrays (u32 indices per mode, f32 values). This crate reads and writes
//! it as FROSTT text (`.tns`, `.tns.gz`) and as kruskal's binary format
//! (`.ktns`, memory-mapped), and generates synthetic tensors shaped like the
//! FROSTT collection. It contains no GPU code.
//!
//! ```
//! use kruskal_formats::{generate, SparseTensor};
//!
//! let t: SparseTensor = generate::power_law(&generate::PowerLawSpec::new(vec![50, 40, 30], 1_000)).unwrap();
//! assert_eq!(t.nmodes(), 3);
//! let stats = t.stats();
//! assert!(stats.modes[0].degree_max >= 1);
//! ```

pub mod attached;
pub mod binary;
mod coalesce;
pub mod compact;
pub mod coo;
pub mod csf;
pub mod error;
pub mod fcoo;
pub mod flycoo;
pub mod generate;
pub mod hicoo;
pub mod io;
pub mod memory;
mod mode_stats;
pub mod option;
mod row_counts;
mod summed;
pub mod tns;

pub use attached::{Attached, AttachedSlot};
pub use binary::{CrcPart, MappedBinary, RangeCounts};
pub use compact::{Compaction, compact};
pub use coo::{MAX_MODES, ModeStats, SparseTensor, TensorStats};
pub use csf::Csf;
pub use error::{Advice, FormatError, ReadWarning, Result};
pub use fcoo::{Fcoo, FcooOp};
pub use hicoo::Hicoo;
pub use io::{FileKind, ReadOptions, ReadReport, read_tensor, read_tensor_report, write_tensor};
pub use option::{OptionName, Spelling};
