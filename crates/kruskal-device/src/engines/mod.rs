//! The GPU MTTKRP engines, one per format: `coo` (the COO baseline with
//! atomics), `hicoo`, `flycoo` and `fcoo` (the default; its layout can be
//! built on the GPU, `fcoo/build.rs`). Each reads the factors of
//! `factors.rs` and its options from `options.rs`; `engine.rs`, above
//! them, builds one by name.

pub mod coo;
pub mod fcoo;
pub mod flycoo;
pub mod hicoo;
