//! Checks made before the work starts, so a run that cannot finish fails
//! in its first second rather than after hours: the memory the run needs
//! against what the machine has, the output directory, the disk space for
//! the model, and warnings about legal but doubtful runs.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use kruskal_cpd::memory::{MemoryNeed, bytes_text, host_refusal, model_file_bytes};
use kruskal_formats::memory::{coo_bytes, shortfall};
use kruskal_formats::{FileKind, SparseTensor};

use super::common::InputArgs;

/// Refuses, in one line, a run that needs more host memory than the
/// machine has available (see [`kruskal_cpd::memory::host_refusal`]), naming
/// the modes `--compact` would relabel where the caller offers it
/// (`can_compact`).
pub fn check_host_memory(need: &MemoryNeed, t: &SparseTensor, can_compact: bool) -> Result<()> {
    match host_refusal(need, t, can_compact) {
        Some(refusal) => Err(refusal.into()),
        None => Ok(()),
    }
}

/// The dimensions and nonzero count of the input where they are known
/// before it is read or generated: a `--like` preset (with `--nnz`), or a
/// `.ktns` file's header (read alone). `None` for a text file.
pub fn shape_ahead(input: &InputArgs) -> Result<Option<(Vec<u32>, usize)>> {
    if let Some(name) = &input.like {
        let p = kruskal_formats::generate::preset(name)?;
        let nnz = p.nnz_or(input.nnz)?;
        return Ok(Some((p.dims.to_vec(), nnz)));
    }
    let Some(path) = &input.file else {
        return Ok(None);
    };
    if FileKind::sniff(path)? != FileKind::Binary {
        return Ok(None);
    }
    Ok(Some(kruskal_formats::binary::read_shape(path)?))
}

/// Refuses, before the input is read or generated, a run whose tensor
/// together with `need` (what the run allocates besides the tensor, from
/// its shape) exceeds the memory available. Runs whose input's shape is
/// not known ahead (text files) are checked once it is read.
pub fn check_memory_ahead(
    input: &InputArgs,
    need: impl FnOnce(&[u32], usize) -> MemoryNeed,
) -> Result<()> {
    let Some((dims, nnz)) = shape_ahead(input)? else {
        return Ok(());
    };
    let mut total = need(&dims, nnz);
    total
        .parts
        .insert(0, ("tensor", coo_bytes(dims.len(), nnz as u64)));
    if let Some(available) = shortfall(total.total()) {
        bail!(
            "the run needs {total} and {} are available (MemAvailable); nothing was read or \
             generated",
            bytes_text(available)
        );
    }
    Ok(())
}

/// Whether a run with `--backend auto` would find no GPU and run on the
/// CPU.
pub fn no_gpu_here() -> bool {
    !kruskal_device::Gpu::count_listed().is_ok_and(|n| n > 0)
}

/// Refuses at once a run that asks for a GPU (`--backend gpu`) on a
/// machine without one, before anything is read or generated.
pub fn check_gpu_present() -> Result<()> {
    // From the driver's listing where it has one: the driver then starts
    // on the thread that opens the GPU while the tensor is read.
    let count = kruskal_device::Gpu::count_listed()?;
    if count == 0 {
        return Err(kruskal_device::DeviceError::NoDevice { ordinal: 0, count }.into());
    }
    Ok(())
}

/// The `--out` directory, checked before the run: it is a directory (or
/// can be created as one) where a file can be written, and no model file
/// name in it is taken by a directory. Directories created for the check
/// are removed again unless [`keep`](OutDir::keep) is called, so a run
/// that fails leaves nothing behind.
pub struct OutDir {
    path: PathBuf,
    /// Directories this check created, outermost first.
    created: Vec<PathBuf>,
    kept: bool,
}

impl OutDir {
    /// Checks `path` for a model of `nmodes` modes; creates it (and its
    /// missing parents) if needed.
    pub fn prepare(path: &Path, nmodes: usize) -> Result<OutDir> {
        let shown = path.display();
        if path.exists() && !path.is_dir() {
            bail!("--out {shown}: exists and is not a directory");
        }
        let mut missing = Vec::new();
        let mut p = Some(path);
        while let Some(dir) = p.filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
            missing.push(dir.to_path_buf());
            p = dir.parent();
        }
        missing.reverse();
        let mut out = OutDir {
            path: path.to_path_buf(),
            created: Vec::new(),
            kept: false,
        };
        for dir in missing {
            // Removed by a quit on a signal too, not only on a failure:
            // registered as it is made.
            let made = super::cleanup::creating(|| {
                std::fs::create_dir(&dir)?;
                super::cleanup::track_created(std::slice::from_ref(&dir));
                Ok::<_, std::io::Error>(())
            });
            if let Err(e) = made {
                bail!("--out {shown}: cannot create {}: {e}", dir.display());
            }
            out.created.push(dir);
        }
        for name in model_names(nmodes) {
            if path.join(&name).is_dir() {
                bail!("--out {shown}: {name} is a directory; cannot write the model there");
            }
        }
        // Only writing tells: permissions, read-only mounts, ACLs.
        let probe = path.join(format!(".kruskal-write-check-{}", std::process::id()));
        // Made and removed where no quit runs, which would leave it.
        let probed = super::cleanup::creating(|| {
            let made = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&probe);
            if made.is_ok() {
                let _ = std::fs::remove_file(&probe);
            }
            made
        });
        if let Err(e) = probed {
            bail!("--out {shown}: cannot write there: {e}");
        }
        Ok(out)
    }

    /// [`prepare`](Self::prepare) for a model of these dimensions and
    /// rank, and [`check_space`](Self::check_space) for its files.
    pub fn for_model(path: &Path, dims: &[u32], rank: usize) -> Result<OutDir> {
        let out = OutDir::prepare(path, dims.len())?;
        out.check_space(model_file_bytes(dims, rank))?;
        Ok(out)
    }

    /// The directory (its tests look at it).
    #[cfg(test)]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The run succeeded: keep the directory.
    pub fn keep(mut self) {
        self.kept = true;
        super::cleanup::forget_created(&self.created);
    }

    /// Refuses a model of `bytes` (see
    /// [`kruskal_cpd::memory::model_file_bytes`]) when the file system of
    /// the directory has less free space. Does nothing where the free space
    /// cannot be read.
    pub fn check_space(&self, bytes: u64) -> Result<()> {
        let Some(free) = free_disk_bytes(&self.path) else {
            return Ok(());
        };
        if bytes > free {
            bail!(
                "--out {}: the model needs {} on disk and {} are free there",
                self.path.display(),
                bytes_text(bytes),
                bytes_text(free)
            );
        }
        Ok(())
    }
}

impl Drop for OutDir {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        // Innermost first; `remove_dir` only removes empty directories, so
        // nothing the user put there meanwhile is lost.
        for dir in self.created.iter().rev() {
            let _ = std::fs::remove_dir(dir);
        }
        super::cleanup::forget_created(&self.created);
    }
}

/// The files of a model directory.
fn model_names(nmodes: usize) -> Vec<String> {
    std::iter::once("lambda.npy".to_string())
        .chain((1..=nmodes).map(|m| format!("mode-{m}.npy")))
        .collect()
}

/// Bytes an unprivileged user can still write on the file system holding
/// `path` (statvfs's available blocks).
#[cfg(unix)]
pub fn free_disk_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c_path` is a NUL-terminated string that outlives the call and
    // `stat` points to writable memory of the struct's size; statvfs writes
    // it fully when it returns 0, and only then is it read.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: initialized by the successful call above.
    let stat = unsafe { stat.assume_init() };
    // The field types differ between platforms (u32 on some, u64 here).
    #[allow(clippy::unnecessary_cast)]
    Some((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

#[cfg(not(unix))]
pub fn free_disk_bytes(_path: &Path) -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_directory_is_removed_unless_kept() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("a/b");
        {
            let dir = OutDir::prepare(&out, 3).unwrap();
            assert!(dir.path().is_dir());
        }
        assert!(!root.path().join("a").exists());
        OutDir::prepare(&out, 3).unwrap().keep();
        assert!(out.is_dir());
        // An existing directory is never removed.
        drop(OutDir::prepare(&out, 3).unwrap());
        assert!(out.is_dir());
    }

    #[test]
    fn files_and_taken_names_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let file = root.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = OutDir::prepare(&file, 2).err().unwrap().to_string();
        assert!(e.contains("not a directory"), "{e}");
        std::fs::create_dir_all(root.path().join("m/mode-2.npy")).unwrap();
        let e = OutDir::prepare(&root.path().join("m"), 2)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("mode-2.npy is a directory"), "{e}");
        // Below a file nothing can be created.
        let e = OutDir::prepare(&file.join("sub"), 2)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("cannot create"), "{e}");
    }

    #[test]
    fn free_space_is_read_and_checked() {
        let root = tempfile::tempdir().unwrap();
        let free = free_disk_bytes(root.path()).unwrap();
        assert!(free > 0);
        let dir = OutDir::prepare(root.path(), 2).unwrap();
        assert!(dir.check_space(1).is_ok());
        let e = dir.check_space(u64::MAX).unwrap_err().to_string();
        assert!(e.contains("free there"), "{e}");
    }
}
