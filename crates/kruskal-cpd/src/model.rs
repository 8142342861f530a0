//! The result of a decomposition ([`KruskalModel`]) and its files.
//!
//! A model directory holds `lambda.npy` (f64, length R) and `mode-<n>.npy`
//! (f32, `dims[n-1] x R`) for n = 1..N: modes are numbered from 1 in file
//! names, as in FROSTT's `mode-<n>-*.map` files. numpy reads them with
//! `np.load`.

use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use ndarray::{Array1, Array2};
use ndarray_npy::{ReadNpyExt, WriteNpyExt};
use serde::Serialize;

use kruskal_formats::Compaction;

use crate::error::{CpdError, Result};

/// Time and fit of one ALS iteration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IterationStats {
    /// 1-based iteration number.
    pub iteration: usize,
    pub fit: f64,
    /// Change of the fit since the previous iteration.
    pub delta: f64,
    /// Seconds in MTTKRP (all modes).
    pub mttkrp_s: f64,
    /// Seconds in everything else (solves, normalization, Grams, fit).
    pub other_s: f64,
    /// Seconds in MTTKRP, per mode.
    pub mttkrp_modes_s: Vec<f64>,
    /// Seconds in the dense update of all modes (Hadamard product of the
    /// Grams, the R x R solve, `A = M W`, column norms, scaling, Gram).
    pub update_s: f64,
    /// Seconds computing the fit.
    pub fit_s: f64,
}

/// Iterations a model's history keeps: the last ones. A run of more
/// keeps its totals in [`IterationTotals`] (a history of every iteration
/// grew by about 170 bytes each, without bound).
pub const HISTORY: usize = 10_000;

/// Counts and seconds summed over every iteration of a run, the ones the
/// history dropped included.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct IterationTotals {
    /// Iterations run.
    pub count: usize,
    pub mttkrp_s: f64,
    pub other_s: f64,
    pub update_s: f64,
    pub fit_s: f64,
    /// The first iteration's MTTKRP and other seconds (it also compiles
    /// kernels and, on a GPU with `--kernel auto`, tries the candidates).
    pub first_mttkrp_s: f64,
    pub first_other_s: f64,
}

impl IterationTotals {
    /// Adds one iteration.
    pub fn add(&mut self, s: &IterationStats) {
        if self.count == 0 {
            self.first_mttkrp_s = s.mttkrp_s;
            self.first_other_s = s.other_s;
        }
        self.count += 1;
        self.mttkrp_s += s.mttkrp_s;
        self.other_s += s.other_s;
        self.update_s += s.update_s;
        self.fit_s += s.fit_s;
    }
}

/// A CP model `sum_r lambda_r a_r^(1) o ... o a_r^(N)` and how it was found.
#[derive(Clone, Debug)]
pub struct KruskalModel {
    /// Component weights, largest first.
    pub lambda: Vec<f64>,
    /// One `dims[m] x rank` matrix per mode, columns of unit 2-norm.
    pub factors: Vec<Array2<f32>>,
    /// One entry per iteration run, the last [`HISTORY`] of them.
    pub iterations: Vec<IterationStats>,
    /// Every iteration's count and seconds.
    pub totals: IterationTotals,
    /// The fit changed less than the tolerance before the iteration limit.
    pub converged: bool,
    /// Mode updates whose R x R system was singular (solved by the
    /// pseudo-inverse instead of Cholesky).
    pub pseudo_inverse_solves: usize,
    /// Set when the run was stopped on request before converging.
    pub interrupted: bool,
}

impl KruskalModel {
    pub fn rank(&self) -> usize {
        self.lambda.len()
    }

    /// The fit of the last iteration (0 when none ran).
    pub fn fit(&self) -> f64 {
        self.iterations.last().map_or(0.0, |s| s.fit)
    }

    /// Writes `lambda.npy` and `mode-<n>.npy` into `dir` (created if needed).
    ///
    /// All files are first written under temporary names and renamed only
    /// when every one was written, so a failure leaves no model file behind
    /// (and never a half-written one). They get the permissions of any
    /// newly created file (0666 less the umask).
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.save_with(dir, &|m, w| {
            self.factors[m].write_npy(w).map_err(|e| e.to_string())
        })
    }

    /// Writes the model of a compacted tensor (see
    /// [`kruskal_formats::compact`]) in the original tensor's numbering:
    /// `mode-<n>.npy` has `compaction.dims[n-1]` rows, zero where an index
    /// did not occur. The rows are streamed (the header, then each row or
    /// run of zero rows), so a factor larger than memory can be written;
    /// as with [`save`](Self::save), nothing is left behind on failure.
    ///
    /// Shapes: `factors[m]` has `compaction.compact_dims()[m]` rows.
    pub fn save_expanded(&self, dir: &Path, compaction: &Compaction) -> Result<()> {
        let rank = self.rank();
        let compact_dims = compaction.compact_dims();
        if self.factors.len() != compact_dims.len()
            || self
                .factors
                .iter()
                .zip(&compact_dims)
                .any(|(f, &d)| f.nrows() != d as usize || f.ncols() != rank)
        {
            return Err(CpdError::Shape(
                "the factors do not have the compacted tensor's shape".into(),
            ));
        }
        let zero_chunk = vec![0f32; rank.max(1) * EXPAND_ZERO_ROWS];
        self.save_with(dir, &|m, w| {
            let factor = &self.factors[m];
            let rows = factor.as_slice().ok_or("factor not in standard layout")?;
            write_npy_f32_header(w, compaction.dims[m] as u64, rank).map_err(|e| e.to_string())?;
            let mut bytes = Vec::with_capacity(zero_chunk.len() * 4);
            compaction
                .expand_rows(m, rows, rank, &zero_chunk, |piece| {
                    bytes.clear();
                    bytes.extend(piece.iter().flat_map(|x| x.to_le_bytes()));
                    w.write_all(&bytes)
                })
                .map_err(|e| e.to_string())
        })
    }

    /// Writes `lambda.npy`, then each `mode-<n>.npy` through `factor(m, w)`,
    /// staged as temporary files renamed when all were written.
    fn save_with(
        &self,
        dir: &Path,
        factor: &dyn Fn(usize, &mut dyn Write) -> std::result::Result<(), String>,
    ) -> Result<()> {
        fs::create_dir_all(dir).map_err(|e| CpdError::file(dir, e))?;
        // Refuse up front what would make a rename fail half way.
        let names: Vec<String> = std::iter::once("lambda.npy".to_string())
            .chain((1..=self.factors.len()).map(|m| format!("mode-{m}.npy")))
            .collect();
        for name in &names {
            let target = dir.join(name);
            if target.is_dir() {
                return Err(CpdError::file(
                    &target,
                    "is a directory; cannot write the model there",
                ));
            }
        }
        let mut staged: Vec<(tempfile::NamedTempFile, PathBuf)> = Vec::new();
        let stage =
            |name: &str, write: &dyn Fn(&mut dyn Write) -> std::result::Result<(), String>| {
                let target = dir.join(name);
                let mut builder = tempfile::Builder::new();
                builder.prefix(".kruskal-").suffix(".tmp");
                // tempfile creates files readable by the owner only, and the
                // rename keeps that mode; ask for what a plain create gives
                // (0666, less the umask, which open(2) applies).
                #[cfg(unix)]
                {
                    use std::os::unix::fs::PermissionsExt;
                    builder.permissions(fs::Permissions::from_mode(0o666));
                }
                let tmp = builder
                    .tempfile_in(dir)
                    .map_err(|e| CpdError::file(&target, e))?;
                {
                    let mut w = BufWriter::with_capacity(WRITE_BUFFER, tmp.as_file());
                    write(&mut w).map_err(|e| CpdError::file(&target, e))?;
                    w.flush().map_err(|e| CpdError::file(&target, e))?;
                }
                Ok::<_, CpdError>((tmp, target))
            };
        let lambda = Array1::from(self.lambda.clone());
        staged.push(stage(&names[0], &|w| {
            lambda.write_npy(w).map_err(|e| e.to_string())
        })?);
        for (m, name) in names[1..].iter().enumerate() {
            staged.push(stage(name, &|w| factor(m, w))?);
        }
        for (tmp, target) in staged {
            tmp.as_file()
                .sync_all()
                .map_err(|e| CpdError::file(&target, e))?;
            tmp.persist(&target)
                .map_err(|e| CpdError::file(&target, e.error))?;
        }
        Ok(())
    }
}

/// Buffer of a model file's writer.
const WRITE_BUFFER: usize = 1 << 20;

/// Zero rows written at a time for the absent indices of an expanded
/// factor.
const EXPAND_ZERO_ROWS: usize = 1 << 14;

/// The `.npy` (format 1.0) header of a C-order `rows x cols` f32 matrix,
/// padded so the data starts at a multiple of 64 bytes, as numpy writes it.
fn write_npy_f32_header(w: &mut dyn Write, rows: u64, cols: usize) -> std::io::Result<()> {
    let dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // magic (6) + version (2) + header length (2) + dict + padding + '\n'.
    let unpadded = 10 + dict.len() + 1;
    let padding = (64 - unpadded % 64) % 64;
    let header_len = (dict.len() + padding + 1) as u16;
    w.write_all(b"\x93NUMPY\x01\x00")?;
    w.write_all(&header_len.to_le_bytes())?;
    w.write_all(dict.as_bytes())?;
    w.write_all(&vec![b' '; padding])?;
    w.write_all(b"\n")
}

/// Reads an `.npy` matrix of f32 or f64 as f32.
fn read_matrix(path: &Path) -> Result<Array2<f32>> {
    let open = || fs::File::open(path).map_err(|e| CpdError::file(path, e));
    match Array2::<f32>::read_npy(open()?) {
        Ok(a) => Ok(a),
        Err(first) => match Array2::<f64>::read_npy(open()?) {
            Ok(a) => Ok(a.mapv(|x| x as f32)),
            Err(_) => Err(CpdError::file(
                path,
                format!("not a 2-d float32/float64 .npy matrix ({first})"),
            )),
        },
    }
}

/// Reads starting factors from a model directory: `mode-1.npy` ..
/// `mode-<nmodes>.npy`, and `lambda.npy` if present, whose weights are
/// multiplied into the first mode's factor (ALS recomputes that factor first,
/// so they do not change the iterations; they keep the given model whole).
pub fn load_factors(dir: &Path, nmodes: usize) -> Result<Vec<Array2<f32>>> {
    let mut factors = Vec::with_capacity(nmodes);
    for m in 1..=nmodes {
        let path = dir.join(format!("mode-{m}.npy"));
        if !path.exists() {
            return Err(CpdError::file(
                &path,
                format!("missing: a {nmodes}-mode tensor needs mode-1.npy .. mode-{nmodes}.npy"),
            ));
        }
        factors.push(read_matrix(&path)?);
    }
    let lambda_path = dir.join("lambda.npy");
    if lambda_path.exists() {
        let file = fs::File::open(&lambda_path).map_err(|e| CpdError::file(&lambda_path, e))?;
        let lambda = match Array1::<f64>::read_npy(file) {
            Ok(l) => l,
            Err(_) => {
                let file =
                    fs::File::open(&lambda_path).map_err(|e| CpdError::file(&lambda_path, e))?;
                Array1::<f32>::read_npy(file)
                    .map_err(|e| {
                        CpdError::file(&lambda_path, format!("not a 1-d float .npy vector ({e})"))
                    })?
                    .mapv(f64::from)
            }
        };
        let rank = factors.first().map_or(0, |f| f.ncols());
        if lambda.len() != rank {
            return Err(CpdError::file(
                &lambda_path,
                format!(
                    "has {} weights, the factors have {rank} columns",
                    lambda.len()
                ),
            ));
        }
        if let Some(first) = factors.first_mut() {
            for (mut col, &l) in first.columns_mut().into_iter().zip(lambda.iter()) {
                col.mapv_inplace(|x| (f64::from(x) * l) as f32);
            }
        }
    }
    Ok(factors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> KruskalModel {
        KruskalModel {
            lambda: vec![2.0, 1.0],
            factors: vec![
                Array2::from_shape_fn((3, 2), |(i, j)| (i + j) as f32),
                Array2::from_shape_fn((4, 2), |(i, j)| (i * j) as f32),
                Array2::from_shape_fn((2, 2), |(i, j)| i as f32 - j as f32),
            ],
            iterations: vec![],
            totals: IterationTotals::default(),
            converged: true,
            pseudo_inverse_solves: 0,
            interrupted: false,
        }
    }

    #[test]
    fn save_and_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let m = model();
        m.save(dir.path()).unwrap();
        let mut names: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["lambda.npy", "mode-1.npy", "mode-2.npy", "mode-3.npy"]
        );
        let loaded = load_factors(dir.path(), 3).unwrap();
        // lambda is folded into mode 1.
        assert_eq!(loaded[0][[2, 0]], 2.0 * 2.0);
        assert_eq!(loaded[0][[2, 1]], 3.0);
        assert_eq!(loaded[1], m.factors[1]);
    }

    #[test]
    fn load_reports_missing_and_mismatched_files() {
        let dir = tempfile::tempdir().unwrap();
        model().save(dir.path()).unwrap();
        let err = load_factors(dir.path(), 4).unwrap_err().to_string();
        assert!(
            err.contains("mode-4.npy") && err.contains("missing"),
            "{err}"
        );
        Array1::from(vec![1.0f64; 5])
            .write_npy(fs::File::create(dir.path().join("lambda.npy")).unwrap())
            .unwrap();
        let err = load_factors(dir.path(), 3).unwrap_err().to_string();
        assert!(err.contains("5 weights"), "{err}");
        fs::write(dir.path().join("mode-2.npy"), b"not numpy").unwrap();
        let err = load_factors(dir.path(), 3).unwrap_err().to_string();
        assert!(
            err.contains("mode-2.npy") && err.contains(".npy matrix"),
            "{err}"
        );
    }

    #[test]
    fn failed_save_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where mode-2.npy should go: the save must fail before
        // writing anything.
        fs::create_dir(dir.path().join("mode-2.npy")).unwrap();
        fs::write(dir.path().join("mode-2.npy").join("x"), b"x").unwrap();
        assert!(model().save(dir.path()).is_err());
        let leftovers: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n != "mode-2.npy")
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[cfg(unix)]
    #[test]
    fn model_files_get_the_mode_of_a_plain_new_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        model().save(dir.path()).unwrap();
        // Whatever the umask, a plain create in the same directory shows
        // what the model files must have (tempfile alone gives 0600).
        let plain = dir.path().join("plain");
        fs::File::create(&plain).unwrap();
        let want = fs::metadata(&plain).unwrap().permissions().mode() & 0o777;
        for name in ["lambda.npy", "mode-1.npy", "mode-3.npy"] {
            let mode = fs::metadata(dir.path().join(name))
                .unwrap()
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(mode, want, "{name}");
        }
    }

    #[test]
    fn an_expanded_model_is_in_the_original_numbering() {
        let t = kruskal_formats::SparseTensor::new(
            vec![1000, 5, 3],
            vec![vec![999, 10, 10], vec![4, 0, 2], vec![0, 1, 2]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap();
        let (c, map) = kruskal_formats::compact(&t).unwrap();
        assert_eq!(c.dims(), &[2, 3, 3]);
        let m = KruskalModel {
            factors: vec![
                Array2::from_shape_fn((2, 2), |(i, j)| (10 * i + j + 1) as f32),
                Array2::from_shape_fn((3, 2), |(i, j)| (i + j + 1) as f32),
                Array2::from_shape_fn((3, 2), |(i, j)| (i * j) as f32 + 0.5),
            ],
            ..model()
        };
        let dir = tempfile::tempdir().unwrap();
        m.save_expanded(dir.path(), &map).unwrap();
        let read = |n: usize| {
            Array2::<f32>::read_npy(
                fs::File::open(dir.path().join(format!("mode-{n}.npy"))).unwrap(),
            )
            .unwrap()
        };
        let m1 = read(1);
        assert_eq!(m1.dim(), (1000, 2));
        assert_eq!(m1.row(10).to_vec(), vec![1.0, 2.0]);
        assert_eq!(m1.row(999).to_vec(), vec![11.0, 12.0]);
        assert_eq!(m1.iter().filter(|&&x| x != 0.0).count(), 4);
        let m2 = read(2);
        assert_eq!(m2.dim(), (5, 2));
        assert_eq!(m2.row(4), m.factors[1].row(2));
        assert_eq!(m2.row(1).to_vec(), vec![0.0, 0.0]);
        assert_eq!(read(3), m.factors[2]);
        // The header is padded as numpy pads it: data at a multiple of 64.
        let bytes = fs::read(dir.path().join("mode-1.npy")).unwrap();
        assert_eq!((bytes.len() - 1000 * 2 * 4) % 64, 0);
        // A model of the wrong shape is refused before anything is written.
        let other = tempfile::tempdir().unwrap();
        assert!(model().save_expanded(other.path(), &map).is_err());
        assert_eq!(fs::read_dir(other.path()).unwrap().count(), 0);
    }
}
