//! The native part of the Python package `kruskal` (`kruskal._kruskal`):
//! the sparse tensor, reading files, CPD-ALS through
//! `kruskal_cpd::decompose` (the call `kruskal cpd` makes), CP-APR
//! (`kruskal_cpd::apr`, as `kruskal cp-apr`), one MTTKRP, and
//! the GPUs. The Python layer (`python/kruskal/__init__.py`) adds the model
//! class, the progress bar and the conversions to and from pyttb, TensorLy,
//! pydata `sparse` and scipy.
//!
//! Every long call releases the GIL; errors become `ValueError` (arguments
//! and data), `TypeError` (an object of the wrong kind), `OSError` (files),
//! `MemoryError` (the host's memory), `kruskal.GpuError` (the device) or
//! `RuntimeError` (a run that failed on the CPU), and the command line's
//! warnings `UserWarning`s, all in Python's words: keywords (`kernel="coo"`,
//! `rank`) where the command line names options, modes counted from 0
//! (`words.rs`).

use pyo3::prelude::*;

mod cpd;
mod errors;
mod tensor;
mod words;

pub use errors::GpuError;

#[pymodule]
fn _kruskal(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<tensor::PySparseTensor>()?;
    m.add_function(wrap_pyfunction!(tensor::read, m)?)?;
    m.add_function(wrap_pyfunction!(cpd::cp_als, m)?)?;
    m.add_function(wrap_pyfunction!(cpd::cp_apr, m)?)?;
    m.add_function(wrap_pyfunction!(cpd::mttkrp, m)?)?;
    m.add_function(wrap_pyfunction!(cpd::devices, m)?)?;
    m.add("GpuError", m.py().get_type::<GpuError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
