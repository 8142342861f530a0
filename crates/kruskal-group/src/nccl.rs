//! NCCL, loaded by kruskal itself.
//!
//! cudarc's NCCL module opens the library under names such as
//! `libnccl.so` or `libnccl.so.13`, and panics when none loads. NCCL ships
//! as `libnccl.so.2` (the `nvidia-nccl-cu13` wheel, Debian's `libnccl2`),
//! so this module finds the library itself: `$NCCL_HOME/lib`, the
//! dynamic loader's search path, then the usual install places (system
//! library folders, CUDA, Python environments with the NCCL wheel). When
//! none loads, [`Nccl::load`] returns the list of what it tried, and the
//! group falls back to peer-to-peer copies.
//!
//! Only the calls kruskal makes are bound; the types come from cudarc's
//! NCCL bindings.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};

type GetVersion = unsafe extern "C" fn(*mut c_int) -> ncclResult_t;
type GetErrorString = unsafe extern "C" fn(ncclResult_t) -> *const c_char;
type CommInitAll = unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> ncclResult_t;
type CommFn = unsafe extern "C" fn(ncclComm_t) -> ncclResult_t;
type GroupFn = unsafe extern "C" fn() -> ncclResult_t;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> ncclResult_t;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    cudaStream_t,
) -> ncclResult_t;
type ReduceTo = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> ncclResult_t;
type SendRecv = unsafe extern "C" fn(
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> ncclResult_t;
type GetUniqueId = unsafe extern "C" fn(*mut ncclUniqueId) -> ncclResult_t;
type CommInitRank =
    unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> ncclResult_t;

/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// A reduction of [`Nccl::all_reduce_f64`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Max,
}

/// The way of a [`Nccl::transfer_f32`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transfer {
    Send,
    Recv,
}

/// The loaded library and the entry points kruskal uses.
pub struct Nccl {
    /// Where it was loaded from.
    pub path: String,
    /// e.g. 22807 for 2.28.7.
    pub version: i32,
    get_error_string: GetErrorString,
    comm_init_all: CommInitAll,
    comm_abort: CommFn,
    comm_destroy: CommFn,
    group_start: GroupFn,
    group_end: GroupFn,
    broadcast: Broadcast,
    all_reduce: AllReduce,
    reduce: ReduceTo,
    send: SendRecv,
    recv: SendRecv,
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    _lib: libloading::Library,
}

/// An NCCL call that failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("NCCL {call}: {message}")]
pub struct NcclError {
    pub call: &'static str,
    pub message: String,
}

/// NCCL could not be loaded: the candidates tried.
#[derive(Debug, Clone)]
pub struct NcclMissing {
    pub tried: Vec<String>,
}

impl std::fmt::Display for NcclMissing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "no NCCL library could be loaded (tried {}); set NCCL_HOME to the folder \
             holding lib/libnccl.so.2",
            self.tried.join(", ")
        )
    }
}

/// Candidate library paths, most specific first.
fn candidates() -> Vec<String> {
    let mut out = Vec::new();
    if let Some(home) = std::env::var_os("NCCL_HOME") {
        let lib = PathBuf::from(home).join("lib");
        for name in ["libnccl.so.2", "libnccl.so"] {
            out.push(lib.join(name).display().to_string());
        }
    }
    // The loader's own search (LD_LIBRARY_PATH, ld.so.cache).
    out.push("libnccl.so.2".into());
    out.push("libnccl.so".into());
    for dir in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/local/cuda/lib64",
        "/usr/local/nccl/lib",
        "/opt/nccl/lib",
    ] {
        out.push(format!("{dir}/libnccl.so.2"));
    }
    // Python environments with the NCCL wheel (e.g. PyTorch's).
    let mut roots: Vec<PathBuf> = ["/opt/torch/.venv/lib", "/usr/lib", "/usr/local/lib"]
        .iter()
        .map(PathBuf::from)
        .collect();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        roots.insert(0, PathBuf::from(venv).join("lib"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for py in pythons {
            for site in ["site-packages", "dist-packages"] {
                out.push(
                    py.join(site)
                        .join("nvidia/nccl/lib/libnccl.so.2")
                        .display()
                        .to_string(),
                );
            }
        }
    }
    out
}

impl Nccl {
    /// The library, loaded once per process.
    pub fn load() -> Result<&'static Nccl, NcclMissing> {
        static CELL: OnceLock<Result<Nccl, NcclMissing>> = OnceLock::new();
        CELL.get_or_init(Self::open).as_ref().map_err(Clone::clone)
    }

    fn open() -> Result<Nccl, NcclMissing> {
        let tried = candidates();
        for path in &tried {
            if path.starts_with('/') && !std::path::Path::new(path).exists() {
                continue;
            }
            // SAFETY: loading NCCL runs its initializers, nothing else.
            let Ok(lib) = (unsafe { libloading::Library::new(path) }) else {
                continue;
            };
            if let Ok(nccl) = Self::bind(lib, path) {
                return Ok(nccl);
            }
        }
        Err(NcclMissing { tried })
    }

    fn bind(lib: libloading::Library, path: &str) -> Result<Nccl, libloading::Error> {
        // SAFETY: the symbols are NCCL's documented C entry points, with the
        // signatures of nccl.h (2.18 and later), copied out as plain
        // function pointers while `lib` stays alive in the struct.
        unsafe {
            let get_version: GetVersion = *lib.get(b"ncclGetVersion\0")?;
            let mut version = 0;
            get_version(&mut version);
            Ok(Nccl {
                path: path.to_string(),
                version,
                get_error_string: *lib.get(b"ncclGetErrorString\0")?,
                comm_init_all: *lib.get(b"ncclCommInitAll\0")?,
                comm_abort: *lib.get(b"ncclCommAbort\0")?,
                comm_destroy: *lib.get(b"ncclCommDestroy\0")?,
                group_start: *lib.get(b"ncclGroupStart\0")?,
                group_end: *lib.get(b"ncclGroupEnd\0")?,
                broadcast: *lib.get(b"ncclBroadcast\0")?,
                all_reduce: *lib.get(b"ncclAllReduce\0")?,
                reduce: *lib.get(b"ncclReduce\0")?,
                // ncclSend takes a const buffer; the pointer's constness
                // does not change the C calling convention.
                send: *lib.get(b"ncclSend\0")?,
                recv: *lib.get(b"ncclRecv\0")?,
                get_unique_id: *lib.get(b"ncclGetUniqueId\0")?,
                comm_init_rank: *lib.get(b"ncclCommInitRank\0")?,
                _lib: lib,
            })
        }
    }

    /// "2.28.7" from the version number.
    pub fn version_string(&self) -> String {
        let v = self.version;
        if v >= 10000 {
            format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
        } else {
            format!("{}.{}.{}", v / 1000, (v / 100) % 10, v % 100)
        }
    }

    fn check(&self, call: &'static str, r: ncclResult_t) -> Result<(), NcclError> {
        if r == ncclResult_t::ncclSuccess {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static C string for any code.
        let message = unsafe { CStr::from_ptr((self.get_error_string)(r)) }
            .to_string_lossy()
            .into_owned();
        Err(NcclError { call, message })
    }

    /// One communicator per device of `ordinals`, all in this process.
    pub fn comm_init_all(&self, ordinals: &[usize]) -> Result<Vec<Comm>, NcclError> {
        let mut comms = vec![std::ptr::null_mut(); ordinals.len()];
        let devs: Vec<c_int> = ordinals.iter().map(|&o| o as c_int).collect();
        // SAFETY: `comms` has room for one handle per device.
        let r =
            unsafe { (self.comm_init_all)(comms.as_mut_ptr(), devs.len() as c_int, devs.as_ptr()) };
        self.check("ncclCommInitAll", r)?;
        Ok(comms.into_iter().map(Comm).collect())
    }

    /// A new unique id (rank 0 of a multi-process group creates it and
    /// hands its bytes to the others).
    pub fn unique_id(&self) -> Result<[u8; UNIQUE_ID_BYTES], NcclError> {
        let mut id = ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: writes one id through a valid pointer.
        let r = unsafe { (self.get_unique_id)(&mut id) };
        self.check("ncclGetUniqueId", r)?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// This process's communicator in a group of `nranks` sharing the id
    /// `id` (the bytes of [`Nccl::unique_id`] on rank 0). The calling
    /// thread's current CUDA device is used. Blocks until every rank has
    /// called it.
    pub fn comm_init_rank(
        &self,
        nranks: usize,
        id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
    ) -> Result<Comm, NcclError> {
        let id = ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut comm = std::ptr::null_mut();
        // SAFETY: writes one handle through a valid pointer.
        let r = unsafe { (self.comm_init_rank)(&mut comm, nranks as c_int, id, rank as c_int) };
        self.check("ncclCommInitRank", r)?;
        Ok(Comm(comm))
    }

    pub fn group_start(&self) -> Result<(), NcclError> {
        // SAFETY: no arguments.
        self.check("ncclGroupStart", unsafe { (self.group_start)() })
    }

    pub fn group_end(&self) -> Result<(), NcclError> {
        // SAFETY: no arguments.
        self.check("ncclGroupEnd", unsafe { (self.group_end)() })
    }

    /// In-place broadcast of `count` f32 at device address `ptr` from
    /// `root`, queued on `stream`.
    ///
    /// # Safety
    /// `ptr` must address `count` floats on the communicator's device that
    /// stay valid until the stream has run the broadcast.
    pub unsafe fn broadcast_f32(
        &self,
        comm: &Comm,
        ptr: u64,
        count: usize,
        root: usize,
        stream: cudaStream_t,
    ) -> Result<(), NcclError> {
        // SAFETY: see the function's contract.
        let r = unsafe {
            (self.broadcast)(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                ncclDataType_t::ncclFloat32,
                root as c_int,
                comm.0,
                stream,
            )
        };
        self.check("ncclBroadcast", r)
    }

    /// Sends `count` f32 at device address `ptr` to rank `peer`, or
    /// receives them from it there, queued on `stream` (inside a group with
    /// the matching calls of the peers, so that pairs exchanging both ways
    /// do not wait on each other).
    ///
    /// # Safety
    /// As [`Nccl::broadcast_f32`].
    pub unsafe fn transfer_f32(
        &self,
        way: Transfer,
        comm: &Comm,
        ptr: u64,
        count: usize,
        peer: usize,
        stream: cudaStream_t,
    ) -> Result<(), NcclError> {
        let (call, f) = match way {
            Transfer::Send => ("ncclSend", self.send),
            Transfer::Recv => ("ncclRecv", self.recv),
        };
        // SAFETY: see the function's contract; a send only reads the
        // buffer.
        let r = unsafe {
            f(
                ptr as *mut c_void,
                count,
                ncclDataType_t::ncclFloat32,
                peer as c_int,
                comm.0,
                stream,
            )
        };
        self.check(call, r)
    }

    /// In-place sum of `count` f32 at device address `ptr` over all ranks
    /// onto rank `root` (the other ranks' buffers are only read), queued on
    /// `stream`.
    ///
    /// # Safety
    /// As [`Nccl::broadcast_f32`].
    pub unsafe fn reduce_f32(
        &self,
        comm: &Comm,
        ptr: u64,
        count: usize,
        root: usize,
        stream: cudaStream_t,
    ) -> Result<(), NcclError> {
        // SAFETY: see the function's contract.
        let r = unsafe {
            (self.reduce)(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                ncclDataType_t::ncclFloat32,
                ncclRedOp_t::ncclSum,
                root as c_int,
                comm.0,
                stream,
            )
        };
        self.check("ncclReduce", r)
    }

    /// In-place reduction `op` of `count` f64 at device address `ptr`
    /// over all ranks; every rank receives the same result.
    ///
    /// # Safety
    /// As [`Nccl::broadcast_f32`].
    pub unsafe fn all_reduce_f64(
        &self,
        comm: &Comm,
        ptr: u64,
        count: usize,
        op: Reduce,
        stream: cudaStream_t,
    ) -> Result<(), NcclError> {
        let op = match op {
            Reduce::Sum => ncclRedOp_t::ncclSum,
            Reduce::Max => ncclRedOp_t::ncclMax,
        };
        // SAFETY: see the function's contract.
        let r = unsafe {
            (self.all_reduce)(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                ncclDataType_t::ncclFloat64,
                op,
                comm.0,
                stream,
            )
        };
        self.check("ncclAllReduce", r)
    }

    /// Aborts `comm`: pending operations stop, waiting peers are released.
    pub fn abort(&self, comm: &Comm) -> Result<(), NcclError> {
        // SAFETY: a handle from ncclCommInit*, not yet destroyed.
        self.check("ncclCommAbort", unsafe { (self.comm_abort)(comm.0) })
    }

    /// Frees `comm` after its operations have finished.
    pub fn destroy(&self, comm: &Comm) -> Result<(), NcclError> {
        // SAFETY: a handle from ncclCommInit*, not yet destroyed.
        self.check("ncclCommDestroy", unsafe { (self.comm_destroy)(comm.0) })
    }
}

/// A communicator handle. NCCL handles may be used from any thread, one
/// thread at a time; the group gives each to one worker thread. It is
/// freed explicitly ([`Nccl::destroy`] or [`Nccl::abort`]), never on drop,
/// so a failed run cannot block in a destructor.
#[derive(Debug)]
pub struct Comm(ncclComm_t);

// SAFETY: an NCCL communicator is not tied to the thread that made it;
// the group uses each from one thread at a time (its worker, or the
// coordinator once the workers have stopped).
unsafe impl Send for Comm {}
// SAFETY: a shared `&Comm` only hands the raw handle to NCCL calls, and
// the group never calls NCCL on one communicator from two threads at once
// (the discipline above), so sharing the reference races on nothing.
unsafe impl Sync for Comm {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_start_with_nccl_home_and_include_the_wheel_layout() {
        let c = candidates();
        assert!(c.iter().any(|p| p == "libnccl.so.2"));
        assert!(
            c.iter()
                .any(|p| p.ends_with("/usr/local/cuda/lib64/libnccl.so.2"))
        );
        // Loading either works or reports every candidate; never panics.
        match Nccl::load() {
            Ok(n) => assert!(n.version > 0 && !n.path.is_empty()),
            Err(e) => {
                assert!(!e.tried.is_empty());
                assert!(e.to_string().contains("NCCL_HOME"), "{e}");
            }
        }
    }
}
