//! `kruskal.SparseTensor` (built from numpy arrays, or from pyttb, pydata
//! `sparse` and scipy objects) and `kruskal.read`.

use std::path::PathBuf;
use std::sync::Arc;

use ndarray::ArrayView2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use rayon::prelude::*;

use crate::errors::{format_error, type_error, value_error};
use crate::words::{keyword, python_words};

/// A sparse tensor in coordinate form, held by kruskal (indices as
/// unsigned 32-bit integers per mode, values as float32).
///
/// Parameters
/// ----------
/// indices : array_like of int, shape (nnz, N)
///     0-based coordinates of the nonzeros, one row per nonzero.
/// values : array_like of float, shape (nnz,) or (nnz, 1)
///     The nonzeros' values (stored as float32; NaN and infinity refused).
/// shape : sequence of int
///     The tensor's dimensions (N of them, each at least 1).
///
/// Notes
/// -----
/// Repeated coordinates are summed, as pyttb does (with repeats the
/// nonzeros come out in coordinate order; without, they keep their order). The indices are
/// converted to kruskal's layout (one array per mode), which is one copy of
/// the data.
///
/// Raises
/// ------
/// ValueError
///     Indices that are not integers, negative or beyond `shape`; values
///     that are not real numbers or not finite; lengths that disagree.
#[pyclass(module = "kruskal", name = "SparseTensor", frozen)]
pub struct PySparseTensor {
    pub inner: Arc<kruskal_formats::SparseTensor>,
}

/// One column of `indices` per mode as u32, checking every index against
/// its dimension (no negative index survives `try_from`).
fn mode_columns<T>(indices: ArrayView2<'_, T>, dims: &[u32]) -> PyResult<Vec<Vec<u32>>>
where
    T: Copy + Sync + Send + std::fmt::Display,
    u32: TryFrom<T>,
{
    let nnz = indices.nrows();
    (0..dims.len())
        .map(|mode| {
            let column = indices.column(mode);
            let dim = dims[mode];
            let bad = (0..nnz)
                .into_par_iter()
                .find_first(|&k| u32::try_from(column[k]).map_or(true, |i| i >= dim));
            if let Some(k) = bad {
                return Err(value_error(format!(
                    "indices[{k}, {mode}] is {}, outside range({dim}) for shape[{mode}] = {dim} \
                     (indices count from 0)",
                    column[k]
                )));
            }
            Ok(column
                .iter()
                .map(|&i| u32::try_from(i).unwrap_or(u32::MAX))
                .collect())
        })
        .collect()
}

/// The indices of `obj` as one u32 array per mode, for any integer dtype.
fn index_columns(obj: &Bound<'_, PyAny>, dims: &[u32]) -> PyResult<Vec<Vec<u32>>> {
    let ndim: usize = obj.getattr("ndim")?.extract()?;
    let shape: Vec<usize> = obj.getattr("shape")?.extract()?;
    if ndim != 2 || shape[1] != dims.len() {
        return Err(value_error(format!(
            "indices must have shape (nnz, {}) for a {}-mode tensor, not {}",
            dims.len(),
            dims.len(),
            tuple_text(&shape)
        )));
    }
    macro_rules! try_dtype {
        ($($t:ty),*) => {
            $(if let Ok(a) = obj.extract::<PyReadonlyArray2<'_, $t>>() {
                return mode_columns(a.as_array(), dims);
            })*
        };
    }
    try_dtype!(i64, i32, u32, u64, i16, u16, i8, u8);
    let dtype = obj.getattr("dtype")?.str()?.to_string();
    Err(value_error(format!(
        "indices must be integers, not {dtype}"
    )))
}

/// `(3, 2)` or `(3,)`: a shape as Python writes it.
fn tuple_text(shape: &[usize]) -> String {
    let parts: Vec<String> = shape.iter().map(usize::to_string).collect();
    let comma = if parts.len() == 1 { "," } else { "" };
    format!("({}{comma})", parts.join(", "))
}

/// The values as f32, refusing (with the first one's position) a value
/// that is not finite or that float32 cannot hold.
fn checked_f32<T: Copy + Into<f64>>(values: ndarray::ArrayView1<'_, T>) -> PyResult<Vec<f32>> {
    let bad = |v: f64| !(v.is_finite() && v.abs() <= f64::from(f32::MAX));
    if let Some(k) = values.iter().position(|&v| bad(v.into())) {
        let v: f64 = values[k].into();
        return Err(value_error(if v.is_finite() {
            format!(
                "values[{k}] is {v:e}, beyond float32's range (at most 3.4e38 in magnitude): \
                 kruskal keeps values as float32, so rescale them"
            )
        } else {
            // As Python writes them: nan, inf, -inf.
            let text = if v.is_nan() {
                "nan"
            } else if v > 0.0 {
                "inf"
            } else {
                "-inf"
            };
            format!("values[{k}] is {text}: values must be finite")
        }));
    }
    Ok(values
        .iter()
        .map(|&v| Into::<f64>::into(v) as f32)
        .collect())
}

/// The values of `obj` as f32, for any real dtype.
fn values_f32(obj: &Bound<'_, PyAny>) -> PyResult<Vec<f32>> {
    let shape: Vec<usize> = obj.getattr("shape")?.extract()?;
    let flat = match shape.as_slice() {
        [_] => obj.clone(),
        [_, 1] => obj.call_method1("reshape", (-1,))?,
        _ => {
            return Err(value_error(format!(
                "values must have shape (nnz,), not {}",
                tuple_text(&shape)
            )));
        }
    };
    if let Ok(a) = flat.extract::<PyReadonlyArray1<'_, f32>>() {
        return checked_f32(a.as_array());
    }
    if let Ok(a) = flat.extract::<PyReadonlyArray1<'_, f64>>() {
        return checked_f32(a.as_array());
    }
    // Integers: always finite; the largest (2^64) is within float32's range.
    macro_rules! try_dtype {
        ($($t:ty),*) => {
            $(if let Ok(a) = flat.extract::<PyReadonlyArray1<'_, $t>>() {
                return Ok(a.as_array().iter().map(|&v| v as f32).collect());
            })*
        };
    }
    try_dtype!(i64, i32, u32, u64, i16, u16, i8, u8);
    let dtype = obj.getattr("dtype")?.str()?.to_string();
    Err(value_error(format!(
        "values must be real numbers, not {dtype}"
    )))
}

/// `shape` (or `dims`, named `what` in the messages) as dimensions.
fn dims_of(shape: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    let shape: Vec<i64> = shape
        .extract()
        .map_err(|_| value_error(format!("{what} must be a sequence of integers")))?;
    if shape.is_empty() {
        return Err(value_error(format!(
            "{what} must have at least one dimension"
        )));
    }
    shape
        .iter()
        .enumerate()
        .map(|(m, &d)| {
            u32::try_from(d).ok().filter(|&d| d > 0).ok_or_else(|| {
                value_error(format!(
                    "{what}[{m}] is {d}; a dimension must be between 1 and 4294967295"
                ))
            })
        })
        .collect()
}

/// A `TypeError` naming what `method` takes, unless `x` has every one of
/// `attributes`.
fn require(x: &Bound<'_, PyAny>, attributes: &[&str], method: &str, takes: &str) -> PyResult<()> {
    for name in attributes {
        if !x.hasattr(*name)? {
            let kind = x.get_type().name()?.to_string();
            return Err(type_error(format!(
                "SparseTensor.{method} takes {takes}, not {kind} (it has no .{name})"
            )));
        }
    }
    Ok(())
}

impl PySparseTensor {
    pub fn from_parts(
        py: Python<'_>,
        indices: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        shape: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let np = py.import("numpy")?;
        let indices = np.call_method1("asarray", (indices,))?;
        let values = np.call_method1("asarray", (values,))?;
        let dims = dims_of(shape, "shape")?;
        let columns = index_columns(&indices, &dims)?;
        let values = values_f32(&values)?;
        if columns.first().is_some_and(|c| c.len() != values.len()) {
            return Err(value_error(format!(
                "{} index rows but {} values",
                columns[0].len(),
                values.len()
            )));
        }
        // `new` sums repeated coordinates (in f64, rounded once).
        let tensor = py.detach(move || kruskal_formats::SparseTensor::new(dims, columns, values));
        Ok(PySparseTensor {
            inner: Arc::new(tensor.map_err(format_error)?),
        })
    }
}

#[pymethods]
impl PySparseTensor {
    #[new]
    fn new(
        py: Python<'_>,
        indices: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        shape: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        Self::from_parts(py, indices, values, shape)
    }

    /// A tensor from a `pyttb.sptensor` (its `subs`, `vals` and `shape`).
    #[staticmethod]
    fn from_pyttb(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<Self> {
        require(
            x,
            &["subs", "vals", "shape"],
            "from_pyttb",
            "a pyttb.sptensor",
        )?;
        Self::from_parts(
            py,
            &x.getattr("subs")?,
            &x.getattr("vals")?,
            &x.getattr("shape")?,
        )
    }

    /// A tensor from a pydata `sparse.COO` array (its `coords`, `data` and
    /// `shape`).
    #[staticmethod]
    fn from_sparse(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<Self> {
        require(
            x,
            &["coords", "data", "shape"],
            "from_sparse",
            "a sparse.COO array",
        )?;
        let coords = x.getattr("coords")?.getattr("T")?;
        Self::from_parts(py, &coords, &x.getattr("data")?, &x.getattr("shape")?)
    }

    /// A 2-mode tensor from a scipy.sparse matrix or array (any format;
    /// converted to COO first).
    #[staticmethod]
    fn from_scipy(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<Self> {
        require(
            x,
            &["tocoo"],
            "from_scipy",
            "a scipy.sparse matrix or array",
        )?;
        let coo = x.call_method0("tocoo")?;
        let np = py.import("numpy")?;
        let indices = np.call_method1("stack", ((coo.getattr("row")?, coo.getattr("col")?), 1))?;
        Self::from_parts(py, &indices, &coo.getattr("data")?, &coo.getattr("shape")?)
    }

    /// The dimensions.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.dims())
    }

    /// The number of modes.
    #[getter]
    fn ndim(&self) -> usize {
        self.inner.nmodes()
    }

    /// The number of stored nonzeros (after repeated coordinates were
    /// summed).
    #[getter]
    fn nnz(&self) -> usize {
        self.inner.nnz()
    }

    /// The coordinates, shape (nnz, N), int64, 0-based (a new array).
    #[getter]
    fn indices<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray2<i64>> {
        let t = &self.inner;
        let (nnz, n) = (t.nnz(), t.nmodes());
        let mut out = ndarray::Array2::<i64>::zeros((nnz, n));
        for (mode, idx) in t.indices().iter().enumerate() {
            out.column_mut(mode)
                .iter_mut()
                .zip(idx)
                .for_each(|(o, &i)| *o = i64::from(i));
        }
        out.into_pyarray(py)
    }

    /// The values, shape (nnz,), float32 (a new array).
    #[getter]
    fn values<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f32>> {
        self.inner.values().to_vec().into_pyarray(py)
    }

    /// The Frobenius norm.
    fn norm(&self) -> f64 {
        self.inner
            .values()
            .par_iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            .sqrt()
    }

    fn __repr__(&self) -> String {
        let dims: Vec<String> = self.inner.dims().iter().map(|d| d.to_string()).collect();
        format!(
            "kruskal.SparseTensor(shape=({}{}), nnz={})",
            dims.join(", "),
            if dims.len() == 1 { "," } else { "" },
            self.inner.nnz()
        )
    }
}

/// Reads a tensor file: FROSTT text (`.tns`, `.tns.gz`) or kruskal's binary
/// `.ktns`, as `kruskal cpd FILE` does (repeated coordinates summed).
///
/// Parameters
/// ----------
/// path : str or os.PathLike
///     The file.
/// zero_based : bool, default False
///     Text indices start at 0 (FROSTT files start at 1).
/// pattern : bool, default False
///     Every column is an index and every value is 1.
/// values_are_data : bool, default False
///     The last column is values even though it looks like an index: no
///     warning. (Without it such a file is still read with values, and a
///     ``UserWarning`` suggests ``pattern=True``.)
/// dims : sequence of int, optional
///     The dimensions (default: the largest index of each mode); an index
///     beyond them is an error.
///
/// Returns
/// -------
/// SparseTensor
///
/// Raises
/// ------
/// OSError
///     The file cannot be read (`FileNotFoundError` when it does not exist).
/// ValueError
///     The file's content is not a tensor.
#[pyfunction]
#[pyo3(signature = (path, *, zero_based=false, pattern=false, values_are_data=false, dims=None))]
pub fn read(
    py: Python<'_>,
    path: PathBuf,
    zero_based: bool,
    pattern: bool,
    values_are_data: bool,
    dims: Option<Bound<'_, PyAny>>,
) -> PyResult<PySparseTensor> {
    let dims = dims.as_ref().map(|d| dims_of(d, "dims")).transpose()?;
    let opts = kruskal_formats::ReadOptions {
        zero_based,
        pattern,
        allow_index_like_values: values_are_data,
        dims,
        ..kruskal_formats::ReadOptions::default()
    };
    let (tensor, report) = py
        .detach(|| kruskal_formats::read_tensor_report(&path, &opts))
        .map_err(format_error)?;
    // The reader's warnings (a value column that looks like an index) as
    // Python warnings, which the caller can filter or turn into errors.
    // Each names the file already.
    for w in report.warnings {
        crate::cpd::warn(py, &python_words(&w.message(&keyword)))?;
    }
    Ok(PySparseTensor {
        inner: Arc::new(tensor),
    })
}
