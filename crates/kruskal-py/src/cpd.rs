//! CPD-ALS (`kruskal_cpd::decompose`, the call `kruskal cpd` makes), one
//! MTTKRP, and the GPUs.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};

use kruskal_cpd::{
    BackendChoice, CpdError, CpdOptions, DecomposeOptions, EngineRequest, Event, Init, OptionName,
};
use kruskal_device::{Gpu, GpuOptions};
use ndarray::Array2;
use numpy::{IntoPyArray, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::{cpd_error, device_error, library_value_error, value_error};
use crate::tensor::PySparseTensor;
use crate::words::{keyword, python_words};

/// Issues `text` as a Python `UserWarning` (which the caller can filter or
/// turn into an error), pointing at the caller's line.
pub fn warn(py: Python<'_>, text: &str) -> PyResult<()> {
    let message = std::ffi::CString::new(text).map_err(|e| value_error(e.to_string()))?;
    PyErr::warn(
        py,
        &py.get_type::<pyo3::exceptions::PyUserWarning>(),
        &message,
        2,
    )
}

/// A model's weights and factors as numpy arrays (the factors moved, not
/// copied), in a new dict under `weights` and `factors`.
fn model_dict<T: numpy::Element>(
    py: Python<'_>,
    weights: Vec<f64>,
    factors: Vec<Array2<T>>,
) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("weights", weights.into_pyarray(py))?;
    let list = PyList::empty(py);
    for f in factors {
        list.append(f.into_pyarray(py))?;
    }
    out.set_item("factors", list)?;
    Ok(out)
}

/// Owned row-major copies of the factors (the backends take ownership of
/// them: one copy, the layout kruskal computes in).
fn owned_factors(factors: &[PyReadonlyArray2<'_, f32>]) -> Vec<Array2<f32>> {
    factors
        .iter()
        .map(|f| f.as_array().as_standard_layout().into_owned())
        .collect()
}

/// What a decomposition leaves for Python.
struct Finished {
    model: kruskal_cpd::KruskalModel,
    name: &'static str,
    describe: String,
    fallback: Option<String>,
    prep_s: f64,
    prepare: kruskal_cpd::PrepareTimes,
    /// The GPU layout build's steps, with seconds (empty elsewhere).
    layout_steps: Vec<(&'static str, f64)>,
    /// A constrained run's method and inner loop, as `kruskal cpd`'s
    /// `method` line gives them.
    method: Option<String>,
    cpd_s: f64,
    summaries: Vec<kruskal_cpd::StartSummary>,
}

/// What the Python layer's `cp_als` passes down; see its docstring.
#[pyfunction]
#[pyo3(signature = (tensor, rank, *, backend, gpus, pick_gpus, iters, tol, init, seed, starts, kernel, callback, nonneg_all=false, nonneg_modes=None, l1=None, l2=None))]
#[allow(clippy::too_many_arguments)]
pub fn cp_als<'py>(
    py: Python<'py>,
    tensor: &PySparseTensor,
    rank: usize,
    backend: &str,
    gpus: usize,
    pick_gpus: bool,
    iters: usize,
    tol: f64,
    init: Option<Vec<PyReadonlyArray2<'py, f32>>>,
    seed: u64,
    starts: usize,
    kernel: &str,
    callback: Option<Py<PyAny>>,
    nonneg_all: bool,
    nonneg_modes: Option<Vec<usize>>,
    l1: Option<f64>,
    l2: Option<f64>,
) -> PyResult<Bound<'py, PyDict>> {
    let backend: BackendChoice = backend.parse().map_err(|e| cpd_error(e, false))?;
    // Constrained CP (AO-ADMM) when any of its keywords is given.
    let constraints =
        (nonneg_all || nonneg_modes.is_some() || l1.is_some() || l2.is_some()).then(|| {
            kruskal_cpd::AdmmOptions {
                nonneg: match (nonneg_all, nonneg_modes) {
                    (true, _) => kruskal_cpd::NonNeg::All,
                    (false, Some(modes)) => kruskal_cpd::NonNeg::Modes(modes),
                    (false, None) => kruskal_cpd::NonNeg::None,
                },
                l1: l1.unwrap_or(0.0),
                l2: l2.unwrap_or(0.0),
                ..kruskal_cpd::AdmmOptions::default()
            }
        });
    let init = match init {
        None => Init::Random { seed },
        Some(factors) => Init::Given(owned_factors(&factors)),
    };
    // A group (gpus >= 2 or "all") is checked by `validate` before the
    // GPUs are counted, so an option that cannot work says so first; two
    // ordinals stand for it until then.
    let group = pick_gpus || gpus >= 2;
    let mut opts = DecomposeOptions {
        cpd: CpdOptions {
            rank,
            max_iters: iters,
            tol,
            init,
            constraints,
        },
        starts,
        seed,
        backend,
        kernel: kernel.parse().map_err(|e| cpd_error(e, false))?,
        gpu: GpuOptions::default(),
        no_model: false,
        gpus: match gpus {
            // No GPU at all: refused by `DecomposeOptions::validate`.
            0 if !pick_gpus => Some(Vec::new()),
            _ if group => Some(vec![0, 1]),
            // One GPU is the single-GPU backend (all engines, kernel
            // auto); a group only from two on.
            _ => None,
        },
        pick_gpus,
        group: Default::default(),
        // `cp_als` has no keyword that relabels modes.
        can_compact: false,
    };
    // Refused before any warning (`decompose` checks the same).
    opts.validate().map_err(|e| cpd_error(e, false))?;
    if group {
        opts.gpus = Some(if pick_gpus {
            // gpus="all": every GPU of the machine, as many used as pay.
            let n = kruskal_device::Gpu::count().map_err(|e| cpd_error(e.into(), true))?;
            kruskal_cpd::decompose::first_gpus(n).map_err(|e| cpd_error(e, true))?
        } else {
            kruskal_cpd::decompose::first_gpus(gpus).map_err(|e| cpd_error(e, true))?
        });
    }
    let t = tensor.inner.clone();
    // What `kruskal cpd` warns of (a rank above a dimension, no iteration,
    // an all-zero tensor), as Python warnings.
    for w in kruskal_cpd::warnings(&t, rank, iters) {
        warn(py, &w.text(&keyword, 0))?;
    }
    let stop = AtomicBool::new(false);
    // (topic, text): a continuation line takes the topic before it.
    let mut notes: Vec<(String, String)> = Vec::new();
    let mut on_gpu = opts.gpus.is_some() || backend == BackendChoice::Gpu;
    let mut raised: Option<PyErr> = None;
    let mut start_index = 0usize;
    let done = py.detach(|| {
        let mut progress = |event: Event<'_>| -> ControlFlow<()> {
            match event {
                Event::Note { topic, text } => {
                    let topic = match (topic, notes.last()) {
                        ("", Some((last, _))) => last.clone(),
                        _ => topic.to_string(),
                    };
                    notes.push((topic, python_words(text)));
                }
                Event::Choice { choice, sms } => {
                    for line in choice.notes(sms, &keyword) {
                        notes.push(("kernels".into(), python_words(&line)));
                    }
                }
                Event::Ready {
                    backend, fallback, ..
                } => {
                    on_gpu = !backend.starts_with("cpu");
                    if let Some(why) = fallback {
                        notes.push((
                            "GPU not used".into(),
                            python_words(&format!("{why}; running on the CPU")),
                        ));
                    }
                    notes.push(("backend".into(), backend.to_string()));
                }
                Event::Start { index, .. } => start_index = index,
                Event::Step(_) => {}
                Event::Iteration(s) => {
                    // Back into Python for a moment: Ctrl-C and the
                    // callback are heard once per iteration.
                    let keep_going = Python::attach(|py| -> PyResult<bool> {
                        py.check_signals()?;
                        match &callback {
                            Some(f) => f
                                .call1(
                                    py,
                                    (start_index, s.iteration, s.fit, s.mttkrp_s + s.other_s),
                                )?
                                .is_truthy(py),
                            None => Ok(true),
                        }
                    });
                    match keep_going {
                        Ok(true) => {}
                        Ok(false) => return ControlFlow::Break(()),
                        Err(e) => {
                            raised = Some(e);
                            stop.store(true, Ordering::SeqCst);
                            return ControlFlow::Break(());
                        }
                    }
                }
            }
            ControlFlow::Continue(())
        };
        // The backend (not `Send`: it holds GPU handles) is dropped here,
        // still without the GIL; what Python needs comes out.
        kruskal_cpd::decompose(&t, &opts, &mut progress, &stop).map(|d| Finished {
            name: d.backend.name(),
            describe: d.backend.describe(),
            layout_steps: match &d.backend {
                kruskal_cpd::Chosen::Gpu(b) => b.layout_steps().to_vec(),
                _ => Vec::new(),
            },
            method: opts.cpd.constraints.as_ref().map(|c| {
                format!(
                    "AO-ADMM, {} (inner loop: {})",
                    c.describe(),
                    d.backend.admm_inner(c.inner).describe()
                )
            }),
            model: d.model,
            fallback: d.fallback,
            prep_s: d.prep_s,
            prepare: d.prepare,
            cpd_s: d.cpd_s,
            summaries: d.summaries,
        })
    });
    if let Some(e) = raised {
        // The run stopped after the iteration that heard the signal or
        // the exception; its backend is already released.
        return Err(e);
    }
    let done = done.map_err(|e| cpd_error(e, on_gpu))?;
    if let Some(method) = &done.method {
        notes.push(("method".into(), python_words(method)));
    }
    let model = done.model;
    let out = model_dict(py, model.lambda.clone(), model.factors)?;
    let iterations = PyList::empty(py);
    for s in &model.iterations {
        let d = PyDict::new(py);
        d.set_item("iteration", s.iteration)?;
        d.set_item("fit", s.fit)?;
        d.set_item("delta", s.delta)?;
        d.set_item("mttkrp_s", s.mttkrp_s)?;
        d.set_item("other_s", s.other_s)?;
        d.set_item("mttkrp_modes_s", s.mttkrp_modes_s.clone())?;
        d.set_item("update_s", s.update_s)?;
        d.set_item("fit_s", s.fit_s)?;
        iterations.append(d)?;
    }
    out.set_item("iterations", iterations)?;
    out.set_item("iterations_run", model.totals.count)?;
    out.set_item("converged", model.converged)?;
    out.set_item("interrupted", model.interrupted)?;
    out.set_item("pseudo_inverse_solves", model.pseudo_inverse_solves)?;
    out.set_item("backend", done.name)?;
    out.set_item("describe", done.describe)?;
    out.set_item("fallback", done.fallback)?;
    out.set_item("prepare_s", done.prep_s)?;
    let prepare = PyDict::new(py);
    prepare.set_item("open_s", done.prepare.open_s)?;
    prepare.set_item("choose_s", done.prepare.choose_s)?;
    prepare.set_item("build_s", done.prepare.build_s)?;
    out.set_item("prepare", prepare)?;
    out.set_item("layout_steps", done.layout_steps)?;
    out.set_item("cpd_s", done.cpd_s)?;
    let summaries = PyList::empty(py);
    for s in &done.summaries {
        summaries.append((s.seed, s.fit, s.iterations))?;
    }
    out.set_item("starts", summaries)?;
    out.set_item("notes", notes)?;
    Ok(out)
}

/// One MTTKRP; see the Python layer's docstring.
#[pyfunction]
#[pyo3(signature = (tensor, factors, mode, *, backend, kernel))]
pub fn mttkrp<'py>(
    py: Python<'py>,
    tensor: &PySparseTensor,
    factors: Vec<PyReadonlyArray2<'py, f32>>,
    mode: usize,
    backend: &str,
    kernel: &str,
) -> PyResult<Bound<'py, numpy::PyArray2<f32>>> {
    let backend: BackendChoice = backend.parse().map_err(|e| cpd_error(e, false))?;
    // Parsed once, as `cp_als` and the command line parse it.
    let request: EngineRequest = kernel.parse().map_err(|e| cpd_error(e, false))?;
    let t = tensor.inner.clone();
    let dims = t.dims().to_vec();
    if mode >= dims.len() {
        return Err(value_error(format!(
            "mode={mode} is out of range for a {}-mode tensor (modes count from 0, so mode \
             is at most {})",
            dims.len(),
            dims.len() - 1
        )));
    }
    if factors.len() != dims.len() {
        return Err(value_error(format!(
            "factors holds {} matrices for a {}-mode tensor (one per mode)",
            factors.len(),
            dims.len()
        )));
    }
    let factors = owned_factors(&factors);
    let rank = factors[0].ncols();
    for (m, (f, &d)) in factors.iter().zip(&dims).enumerate() {
        if f.nrows() != d as usize || f.ncols() != rank || rank == 0 {
            return Err(value_error(format!(
                "factors[{m}] is {} x {}, expected {d} x {rank} (shape[{m}] rows, the rank of \
                 factors[0] columns, at least 1)",
                f.nrows(),
                f.ncols()
            )));
        }
    }
    let mut out = Array2::<f32>::zeros((dims[mode] as usize, rank));
    let cpu = |out: &mut Array2<f32>| -> PyResult<()> {
        let kernel = request.cpu().ok_or_else(|| {
            cpd_error(
                CpdError::option_value(
                    OptionName::Kernel,
                    request,
                    "runs on the GPU only, and this call runs on the CPU (on the CPU: auto, \
                     sorted, fcoo, flycoo, hicoo, csf)",
                ),
                false,
            )
        })?;
        let mut engine = kernel.build(&t).map_err(|e| library_value_error(&e))?;
        engine
            .mttkrp(mode, &factors, out)
            .map_err(|e| library_value_error(&e))
    };
    let gpu = |out: &mut Array2<f32>| -> PyResult<()> {
        let kernel = request.gpu().ok_or_else(|| {
            cpd_error(
                CpdError::option_value(
                    OptionName::Kernel,
                    request,
                    "runs on the CPU only (on the GPU: auto, coo, fcoo, flycoo, hicoo)",
                ),
                false,
            )
        })?;
        let gpu = Gpu::open(0).map_err(device_error)?;
        let mut engine = kruskal_device::build_engine(kernel, gpu, &t, &GpuOptions::default())
            .map_err(device_error)?;
        engine
            .mttkrp_host(mode, &factors, out)
            .map_err(device_error)
    };
    py.detach(|| match backend {
        BackendChoice::Cpu => cpu(&mut out),
        BackendChoice::Gpu => gpu(&mut out),
        BackendChoice::Auto => gpu(&mut out).or_else(|_| cpu(&mut out)),
    })?;
    Ok(out.into_pyarray(py))
}

/// The CUDA GPUs: a list of dicts (ordinal, name, arch, sms, total_bytes,
/// free_bytes), and the reason none can be used (None when some can).
#[pyfunction]
pub fn devices(py: Python<'_>) -> PyResult<(Vec<Bound<'_, PyDict>>, Option<String>)> {
    let found = py.detach(|| -> Result<Vec<kruskal_device::GpuProperties>, String> {
        let count = Gpu::count().map_err(|e| e.to_string())?;
        if count == 0 {
            return Err("the CUDA driver reports no GPU".into());
        }
        (0..count)
            .map(|o| Gpu::open(o).map(|g| g.properties().clone()))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())
    });
    match found {
        Err(why) => Ok((Vec::new(), Some(why))),
        Ok(props) => {
            let list = props
                .iter()
                .map(|p| {
                    let d = PyDict::new(py);
                    d.set_item("ordinal", p.ordinal)?;
                    d.set_item("name", &p.name)?;
                    d.set_item("arch", p.arch())?;
                    d.set_item("sms", p.sms)?;
                    d.set_item("total_bytes", p.total_bytes)?;
                    d.set_item("free_bytes", p.free_bytes)?;
                    Ok(d)
                })
                .collect::<PyResult<Vec<_>>>()?;
            Ok((list, None))
        }
    }
}

/// What the Python layer's `cp_apr` passes down; see its docstring.
#[pyfunction]
#[pyo3(signature = (tensor, rank, *, iters, inner_iters, tol, kappa, kappa_tol, eps_div_zero, time_limit, init, weights, seed, callback, backend, gpus=1, pick_gpus=false))]
#[allow(clippy::too_many_arguments)]
pub fn cp_apr<'py>(
    py: Python<'py>,
    tensor: &PySparseTensor,
    rank: usize,
    iters: usize,
    inner_iters: usize,
    tol: f64,
    kappa: f64,
    kappa_tol: f64,
    eps_div_zero: f64,
    time_limit: Option<f64>,
    init: Option<Vec<PyReadonlyArray2<'py, f64>>>,
    weights: Option<Vec<f64>>,
    seed: u64,
    callback: Option<Py<PyAny>>,
    backend: &str,
    gpus: usize,
    pick_gpus: bool,
) -> PyResult<Bound<'py, PyDict>> {
    use kruskal_cpd::apr::{AprInit, AprOptions, non_integer_values};
    let choice: kruskal_cpd::BackendChoice = backend.parse().map_err(|e| cpd_error(e, false))?;
    if (pick_gpus || gpus >= 2) && choice == kruskal_cpd::BackendChoice::Cpu {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "gpus runs on GPUs; it does not go with backend='cpu'",
        ));
    }
    // A group: gpus >= 2, or "all" (a GPU per share of the nonzeros).
    let group = if pick_gpus {
        let n = kruskal_device::Gpu::count().map_err(|e| cpd_error(e.into(), true))?;
        Some(kruskal_cpd::apr_all_gpus(tensor.inner.nnz(), n))
    } else if gpus >= 2 {
        let ordinals = kruskal_cpd::decompose::first_gpus(gpus).map_err(|e| cpd_error(e, true))?;
        Some((ordinals, None))
    } else {
        None
    };

    let init = match init {
        None => AprInit::Random { seed },
        Some(factors) => AprInit::Given {
            factors: factors
                .iter()
                .map(|f| f.as_array().as_standard_layout().into_owned())
                .collect(),
            weights,
        },
    };
    let opts = AprOptions {
        rank,
        max_iters: iters,
        max_inner_iters: inner_iters,
        tol,
        kappa,
        kappa_tol,
        eps_div_zero,
        time_limit_s: time_limit,
        init,
    };
    let t = tensor.inner.clone();
    let mut raised: Option<PyErr> = None;
    let on_gpus = group.is_some();
    let done = py.detach(|| {
        let mut on_iteration = |s: &kruskal_cpd::apr::AprIteration| {
            // Back into Python once per outer iteration: Ctrl-C and the
            // callback are heard there.
            let keep_going = Python::attach(|py| -> PyResult<bool> {
                py.check_signals()?;
                match &callback {
                    Some(f) => f
                        .call1(py, (s.iteration, s.log_likelihood, s.kkt_violation))?
                        .is_truthy(py),
                    None => Ok(true),
                }
            });
            match keep_going {
                Ok(true) => ControlFlow::Continue(()),
                Ok(false) => ControlFlow::Break(()),
                Err(e) => {
                    raised = Some(e);
                    ControlFlow::Break(())
                }
            }
        };
        match group {
            Some((ordinals, note)) => {
                kruskal_cpd::cp_apr_on_gpus(&t, &opts, &ordinals, &mut on_iteration).map(
                    |mut run| {
                        run.note = note;
                        run
                    },
                )
            }
            None => kruskal_cpd::cp_apr_on(&t, &opts, choice, &mut on_iteration),
        }
        .map(|m| (m, non_integer_values(&t)))
    });
    if let Some(e) = raised {
        return Err(e);
    }
    let (run, non_integer) =
        done.map_err(|e| cpd_error(e, on_gpus || choice == kruskal_cpd::BackendChoice::Gpu))?;
    let model = run.model;
    let out = model_dict(py, model.lambda.clone(), model.factors)?;
    out.set_item("backend", run.backend)?;
    out.set_item("device", run.device)?;
    out.set_item("gpus", run.gpus)?;
    out.set_item("gpus_note", run.note)?;
    out.set_item("fallback", run.fallback)?;
    let iterations = PyList::empty(py);
    for s in &model.iterations {
        let d = PyDict::new(py);
        d.set_item("iteration", s.iteration)?;
        d.set_item("log_likelihood", s.log_likelihood)?;
        d.set_item("kkt_violation", s.kkt_violation)?;
        d.set_item("inner_iters", s.inner_iters)?;
        d.set_item("kappa_fixes", s.kappa_fixes)?;
        d.set_item("elapsed_s", s.elapsed_s)?;
        iterations.append(d)?;
    }
    out.set_item("iterations", iterations)?;
    out.set_item("log_likelihood", model.log_likelihood)?;
    out.set_item("converged", model.converged)?;
    out.set_item("timed_out", model.timed_out)?;
    out.set_item("interrupted", model.interrupted)?;
    out.set_item("non_integer_values", non_integer)?;
    Ok(out)
}
