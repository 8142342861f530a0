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
    /// Inner iterations of all modes (AO-ADMM; 0 for ALS).
    pub inner_iters: usize,
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
    /// Before the first iteration: the initial factors drawn (or checked),
    /// handed to the backend (uploaded, on a GPU) and their Grams.
    pub setup_s: f64,
    /// After the last iteration: the factors taken back from the backend
    /// (downloaded, on a GPU), normalized, ordered and checked.
    pub finish_s: f64,
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
    /// The files are written into a new staging directory and moved into
    /// place only when every one was written ([`StagedModel`]), so a
    /// failure leaves no model file behind (and never a half-written one).
    /// They get the permissions of any newly created file (0666 less the
    /// umask).
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.stage(dir, &())?.commit()
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
        self.stage_expanded(dir, compaction, &())?.commit()
    }

    /// [`save_expanded`](Self::save_expanded)'s files, staged and not yet
    /// in place (see [`stage`](Self::stage)).
    pub fn stage_expanded(
        &self,
        dir: &Path,
        compaction: &Compaction,
        staging: &dyn Staging,
    ) -> Result<StagedModel> {
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
        self.stage_with(dir, staging, &|m, w| {
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

    /// Writes the model's files into a new staging directory and returns
    /// it, not yet in place: [`StagedModel::commit`] moves them. The
    /// staging directory and each file in it are made inside
    /// [`Staging::creating`], and [`Staging::made`] hears the directory's
    /// path there, before anything is written into it: a caller that may
    /// be ended by a signal removes it then, and never finds it half made
    /// (dropping the [`StagedModel`], or a failure, removes it otherwise).
    pub fn stage(&self, dir: &Path, staging: &dyn Staging) -> Result<StagedModel> {
        self.stage_with(dir, staging, &|m, w| {
            self.factors[m].write_npy(w).map_err(|e| e.to_string())
        })
    }

    /// Writes `lambda.npy`, then each `mode-<n>.npy` through `factor(m, w)`,
    /// into a new staging directory.
    fn stage_with(
        &self,
        dir: &Path,
        staging: &dyn Staging,
        factor: &dyn Fn(usize, &mut dyn Write) -> std::result::Result<(), String>,
    ) -> Result<StagedModel> {
        let names: Vec<String> = std::iter::once("lambda.npy".to_string())
            .chain((1..=self.factors.len()).map(|m| format!("mode-{m}.npy")))
            .collect();
        // Refuse up front what would make a rename fail half way.
        for name in &names {
            let target = dir.join(name);
            if target.is_dir() {
                return Err(CpdError::file(
                    &target,
                    "is a directory; cannot write the model there",
                ));
            }
        }
        let mut created = None;
        staging.creating(&mut || {
            let made = StagedModel::create(dir, names.clone());
            if let Ok(staged) = &made {
                staging.made(&staged.staging);
            }
            created = Some(made);
        });
        let staged = created.expect("Staging::creating runs its closure")?;
        let write =
            |name: &str, body: &dyn Fn(&mut dyn Write) -> std::result::Result<(), String>| {
                let target = dir.join(name);
                let path = staged.staging.join(name);
                // A plain create: 0666 less the umask.
                let mut file = None;
                staging.creating(&mut || file = Some(fs::File::create(&path)));
                let file = file
                    .expect("Staging::creating runs its closure")
                    .map_err(|e| CpdError::file(&target, e))?;
                let mut w = BufWriter::with_capacity(WRITE_BUFFER, &file);
                body(&mut w).map_err(|e| CpdError::file(&target, e))?;
                w.flush().map_err(|e| CpdError::file(&target, e))?;
                drop(w);
                file.sync_all().map_err(|e| CpdError::file(&target, e))
            };
        let lambda = Array1::from(self.lambda.clone());
        write(&staged.names[0], &|w| {
            lambda.write_npy(w).map_err(|e| e.to_string())
        })?;
        for (m, name) in staged.names[1..].iter().enumerate() {
            write(name, &|w| factor(m, w))?;
        }
        Ok(staged)
    }
}

/// How the writing of a model meets a caller that may be ended at any
/// moment and must then remove the staging directory (a signal handler):
/// the directory and each file in it are created inside
/// [`creating`](Staging::creating), which the caller runs where its
/// cleanup cannot run at the same time, so the cleanup never meets a
/// directory it has not heard of or a file appearing while it removes
/// one. `()` is the caller that needs neither.
pub trait Staging {
    /// Runs `make`, which creates the staging directory or a file in it.
    /// By default, just runs it.
    fn creating(&self, make: &mut dyn FnMut()) {
        make()
    }

    /// Hears the staging directory's path as soon as it exists (inside
    /// [`creating`](Staging::creating)). By default, nothing.
    fn made(&self, _staging: &Path) {}
}

impl Staging for () {}

/// A model's files written into a staging directory, not yet in place.
/// Dropped without [`commit`](StagedModel::commit), it removes the
/// staging directory and everything in it.
///
/// Where the destination does not exist or is empty (a directory made
/// for the run), the staging directory sits beside it and
/// [`commit`](StagedModel::commit) is one rename of the whole directory:
/// the model appears at once. Where the destination holds other files
/// (an earlier model, say), the staging directory sits inside it and the
/// files are renamed in one by one, each replacing its namesake.
#[derive(Debug)]
pub struct StagedModel {
    /// Where the files are.
    staging: PathBuf,
    /// Where they go.
    dir: PathBuf,
    /// The files, `lambda.npy` first.
    names: Vec<String>,
    /// Whether the staging directory replaces `dir` whole.
    whole: bool,
    committed: bool,
}

/// Staging directories made by this process so far (for unique names).
static STAGINGS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl StagedModel {
    /// Makes a new, empty staging directory for `dir`'s files (0777 less
    /// the umask, as `mkdir` makes it, so the model directory it may
    /// become has the usual permissions).
    fn create(dir: &Path, names: Vec<String>) -> Result<StagedModel> {
        let empty = match fs::read_dir(dir) {
            Ok(mut entries) => entries.next().is_none(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
            Err(e) => return Err(CpdError::file(dir, e)),
        };
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let mut builder = fs::DirBuilder::new();
        #[cfg(unix)]
        {
            use std::os::unix::fs::DirBuilderExt;
            builder.mode(0o777);
        }
        let base = dir
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
        let try_in = |place: &Path| -> std::io::Result<PathBuf> {
            loop {
                let n = STAGINGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let name = format!(".kruskal-{base}-{}-{n}.tmp", std::process::id());
                let path = place.join(name);
                match builder.create(&path) {
                    Ok(()) => return Ok(path),
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                    Err(e) => return Err(e),
                }
            }
        };
        // Beside an empty destination (one rename), where its parent lets
        // us write; else inside it.
        if empty {
            if let Ok(staging) = try_in(&parent) {
                return Ok(StagedModel {
                    staging,
                    dir: dir.to_path_buf(),
                    names,
                    whole: true,
                    committed: false,
                });
            }
        }
        fs::create_dir_all(dir).map_err(|e| CpdError::file(dir, e))?;
        let staging = try_in(dir).map_err(|e| CpdError::file(dir, e))?;
        Ok(StagedModel {
            staging,
            dir: dir.to_path_buf(),
            names,
            whole: false,
            committed: false,
        })
    }

    /// The staging directory.
    pub fn staging_path(&self) -> &Path {
        &self.staging
    }

    /// Moves the files into place: one rename of the staging directory
    /// over an empty destination, else one rename per file. Cost: renames
    /// only (the files were synced when written).
    pub fn commit(mut self) -> Result<()> {
        let io = |e| CpdError::file(&self.dir, e);
        if self.whole {
            // An empty destination may be replaced; one that became
            // non-empty meanwhile is not, and the files go in one by one.
            match fs::rename(&self.staging, &self.dir) {
                Ok(()) => {
                    self.committed = true;
                    return Ok(());
                }
                Err(_) if self.dir.is_dir() => {}
                Err(e) => return Err(io(e)),
            }
        }
        for name in &self.names {
            fs::rename(self.staging.join(name), self.dir.join(name))
                .map_err(|e| CpdError::file(self.dir.join(name), e))?;
        }
        let _ = fs::remove_dir(&self.staging);
        self.committed = true;
        Ok(())
    }
}

impl Drop for StagedModel {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.staging);
        }
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
///
/// Errors name the file: a missing one, one that is not a float matrix,
/// a value that is not finite (at its row and column), weights that do
/// not match the columns, and a `mode-<nmodes + 1>.npy` beside them
/// (factors of a tensor with more modes).
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
        let factor = read_matrix(&path)?;
        if let Some(((row, col), x)) = factor.indexed_iter().find(|(_, x)| !x.is_finite()) {
            return Err(CpdError::file(
                &path,
                format!(
                    "holds {x} at row {}, column {}: initial factors must be finite",
                    row + 1,
                    col + 1
                ),
            ));
        }
        factors.push(factor);
    }
    let stray = dir.join(format!("mode-{}.npy", nmodes + 1));
    if stray.exists() {
        return Err(CpdError::file(
            &stray,
            format!(
                "a factor beyond the tensor's {nmodes} modes: these factors are for a tensor of \
                 more modes"
            ),
        ));
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
        if let Some((r, l)) = lambda.iter().enumerate().find(|(_, l)| !l.is_finite()) {
            return Err(CpdError::file(
                &lambda_path,
                format!("weight {} is {l}: initial weights must be finite", r + 1),
            ));
        }
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
    fn load_names_the_file_of_a_bad_value_and_a_stray_mode() {
        let dir = tempfile::tempdir().unwrap();
        model().save(dir.path()).unwrap();
        let mut weights = Array1::from(vec![1.0f64, f64::NAN]);
        weights
            .write_npy(fs::File::create(dir.path().join("lambda.npy")).unwrap())
            .unwrap();
        let err = load_factors(dir.path(), 3).unwrap_err().to_string();
        assert!(
            err.contains("lambda.npy: weight 2 is NaN") && !err.contains("mode-1"),
            "{err}"
        );
        weights[1] = 1.0;
        weights
            .write_npy(fs::File::create(dir.path().join("lambda.npy")).unwrap())
            .unwrap();
        let mut f = model().factors[2].clone();
        f[[1, 0]] = f32::INFINITY;
        f.write_npy(fs::File::create(dir.path().join("mode-3.npy")).unwrap())
            .unwrap();
        let err = load_factors(dir.path(), 3).unwrap_err().to_string();
        assert!(
            err.contains("mode-3.npy: holds inf at row 2, column 1"),
            "{err}"
        );
        model().save(dir.path()).unwrap();
        model().factors[0]
            .write_npy(fs::File::create(dir.path().join("mode-4.npy")).unwrap())
            .unwrap();
        let err = load_factors(dir.path(), 3).unwrap_err().to_string();
        assert!(err.contains("mode-4.npy: a factor beyond"), "{err}");
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

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    /// A [`Staging`] that counts the creations and hears the directory.
    #[derive(Default)]
    struct Heard {
        creations: std::cell::Cell<usize>,
        staging: std::cell::RefCell<Option<PathBuf>>,
    }

    impl Staging for Heard {
        fn creating(&self, make: &mut dyn FnMut()) {
            self.creations.set(self.creations.get() + 1);
            make()
        }

        fn made(&self, staging: &Path) {
            *self.staging.borrow_mut() = Some(staging.to_path_buf());
        }
    }

    #[test]
    fn a_new_or_empty_directory_gets_the_model_in_one_rename() {
        let root = tempfile::tempdir().unwrap();
        for made in [false, true] {
            let dir = root.path().join(format!("model-{made}"));
            if made {
                fs::create_dir(&dir).unwrap();
            }
            let heard = Heard::default();
            let staged = model().stage(&dir, &heard).unwrap();
            assert_eq!(heard.creations.get(), 5, "the directory and 4 files");
            let staging = heard.staging.take().unwrap();
            assert_eq!(staging, staged.staging_path());
            // Beside the destination, which holds nothing yet.
            assert_eq!(staging.parent(), Some(root.path()));
            assert!(!dir.exists() || names_in(&dir).is_empty());
            staged.commit().unwrap();
            assert_eq!(
                names_in(&dir),
                ["lambda.npy", "mode-1.npy", "mode-2.npy", "mode-3.npy"]
            );
            assert!(!staging.exists());
        }
        assert_eq!(names_in(root.path()), ["model-false", "model-true"]);
    }

    #[test]
    fn a_directory_with_other_files_gets_them_replaced_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("mode-1.npy"), b"old").unwrap();
        fs::write(dir.path().join("notes.txt"), b"mine").unwrap();
        let staged = model().stage(dir.path(), &()).unwrap();
        assert_eq!(staged.staging_path().parent(), Some(dir.path()));
        assert_eq!(fs::read(dir.path().join("mode-1.npy")).unwrap(), b"old");
        staged.commit().unwrap();
        assert_eq!(
            names_in(dir.path()),
            [
                "lambda.npy",
                "mode-1.npy",
                "mode-2.npy",
                "mode-3.npy",
                "notes.txt"
            ]
        );
        assert_eq!(load_factors(dir.path(), 3).unwrap()[1], model().factors[1]);
    }

    #[test]
    fn a_staged_model_not_committed_leaves_nothing() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("m");
        drop(model().stage(&dir, &()).unwrap());
        assert!(names_in(root.path()).is_empty());
        fs::create_dir(&dir).unwrap();
        fs::write(dir.join("keep"), b"x").unwrap();
        drop(model().stage(&dir, &()).unwrap());
        assert_eq!(names_in(&dir), ["keep"]);
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
