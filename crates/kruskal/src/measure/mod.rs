//! What `kruskal mttkrp`, `kruskal cpd` and `kruskal cp-apr` run, as
//! functions with typed options: the command line converts its flags into
//! these options and calls the same functions as tools that measure the
//! program in their own process (`cargo xtask bench`), so both run the
//! same code.
//!
//! - [`mttkrp`]: the MTTKRP of each mode timed on the CPU, one GPU or a
//!   group of GPUs ([`MttkrpOptions`]); one JSON report per engine.
//! - [`cpd`]: a CPD-ALS run ([`CpdRunOptions`]) and its JSON report;
//!   [`decompose`](fn@kruskal_cpd::decompose) and [`cpd_report`] are its
//!   two halves, for a caller that also writes the model or stops on
//!   Ctrl-C; [`ConstraintFlags`], [`parse_nonneg`] and [`parse_weight`]
//!   read its constraint flags (`--nonneg`, `--l1`, `--l2`,
//!   `--admm-blocks`) into AO-ADMM's options.
//! - [`cp_apr`]: a CP-APR run ([`CpAprRunOptions`]) and its JSON report;
//!   [`cp_apr_report`] makes the report of a run the caller made itself
//!   (one it shows as it goes or stops on Ctrl-C).
//!
//! The reports are the JSON objects `--json` prints. Unless told to be
//! quiet the functions print what the commands print (tables, the choices
//! made, a line per iteration) on standard output, and progress bars on
//! standard error when it is a terminal. Error messages name the options
//! as the command line does (`--rank`, `--mode`).

mod constraints;
mod cp_apr;
mod cpd;
mod mttkrp;

pub use constraints::{ConstraintFlags, parse_nonneg, parse_weight};
pub use cp_apr::{
    CpAprOptionsReport, CpAprReport, CpAprRunOptions, cp_apr, cp_apr_report, run_cp_apr,
    seconds_per_iteration_after_first, stopped,
};
pub use cpd::{
    CpdReport, CpdRunOptions, GroupKernelReport, KernelReport, LayoutStep, TensorReport, cpd,
    cpd_report,
};
pub use mttkrp::{
    ChoiceReport, CpuModeRow, CpuMttkrpReport, GpuModeRow, GpuMttkrpReport, GroupModeRow,
    GroupMttkrpReport, MttkrpBackend, MttkrpKernel, MttkrpOptions, MttkrpReport, TensorShape,
    mttkrp,
};

/// The relative error an f32 MTTKRP may show against the f64 reference;
/// a report with a `tolerance` of its own (half-precision gathers) allows
/// that instead.
pub const TOLERANCE: f64 = 1e-5;

/// What can stop a measurement.
#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    /// A kernel that is not one (its value names no option), or options
    /// that do not go together (`--admm-blocks` alone). Options that
    /// cannot work, and a host with too little memory for the run, are
    /// the decomposition's errors ([`MeasureError::Cpd`]:
    /// `CpdError::InvalidOption` and `CpdError::Memory`).
    #[error("{0}")]
    Invalid(String),
    /// The GPU or its libraries failed; reads as the device's error, whose
    /// kind [`MeasureError::device_error`] finds.
    #[error(transparent)]
    Device(#[from] kruskal_device::DeviceError),
    /// A CPU engine failed; reads as the engine's error.
    #[error(transparent)]
    Cpu(#[from] kruskal_cpu::CpuError),
    /// The decomposition, or the group of GPUs it prepares, failed, or an
    /// option cannot work; reads as its error, whose causes follow in the
    /// chain.
    #[error(transparent)]
    Cpd(#[from] kruskal_cpd::CpdError),
    /// A report could not be made into JSON.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

impl MeasureError {
    /// The device's error this one is, directly or as the decomposition's.
    pub fn device_error(&self) -> Option<&kruskal_device::DeviceError> {
        match self {
            MeasureError::Device(e) => Some(e),
            MeasureError::Cpd(e) => e.device_error(),
            _ => None,
        }
    }

    /// The decomposition's error this one is, if it is one (so a front end
    /// can spell the options it names).
    pub fn cpd_error(&self) -> Option<&kruskal_cpd::CpdError> {
        match self {
            MeasureError::Cpd(e) => Some(e),
            _ => None,
        }
    }
}

/// `Result` with [`MeasureError`].
pub type Result<T, E = MeasureError> = std::result::Result<T, E>;

/// The median of `v` (sorted in place); NaN when empty.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v[n / 2],
        _ => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_odd_even_and_empty_lists() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }

    /// The device's error, alone or inside the decomposition's, reads as
    /// itself once and its kind is found where the program's no-GPU advice
    /// looks for it.
    #[test]
    fn a_device_error_reads_as_itself_and_keeps_its_kind() {
        use kruskal_device::DeviceError;
        let no_gpu = || DeviceError::NoDevice {
            ordinal: 0,
            count: 0,
        };
        let cpd = kruskal_cpd::CpdError::from(no_gpu());
        for e in [MeasureError::from(no_gpu()), MeasureError::from(cpd)] {
            assert_eq!(
                e.to_string(),
                "no CUDA GPU 0 (the driver reports 0 device(s))"
            );
            assert_eq!(
                kruskal_device::error_line(&e),
                "no CUDA GPU 0 (the driver reports 0 device(s))"
            );
            assert!(matches!(
                e.device_error(),
                Some(DeviceError::NoDevice { .. })
            ));
        }
    }
}
