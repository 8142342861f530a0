//! kruskal's binary tensor format (`.ktns`): the COO arrays as they are in
//! memory, little-endian, with checksums, so loading runs at disk speed.
//!
//! # Layout (version 2)
//!
//! All integers are little-endian. `M` is the number of modes, `N` the
//! number of nonzeros, `align8(x)` rounds `x` up to a multiple of 8, and
//! `S = align8(4 N)` is the stride of one array.
//!
//! | offset            | size  | field                                          |
//! |-------------------|-------|------------------------------------------------|
//! | 0                 | 8     | magic `b"KRUSKAL\0"` ([`MAGIC`])               |
//! | 8                 | 4     | format version, u32 ([`VERSION`])              |
//! | 12                | 4     | `M`, u32, at least 1                           |
//! | 16                | 8     | `N`, u64                                       |
//! | 24                | 4     | payload CRC-32 (of bytes `H..` to the end)     |
//! | 28                | 4     | flags, u32 ([`FLAG_DISTINCT`]); 0 in version 1 |
//! | 32                | 4 M   | dimensions, u32 each                           |
//! | 32 + 4 M          |       | zero padding up to `D = align8(32 + 4 M)`      |
//! | D                 | 4     | header CRC-32 (of bytes `0..D`)                |
//! | D + 4             | 4     | zero                                           |
//! | H = D + 8         | 4 N   | mode-0 indices, u32, 0-based; zero pad to `S`  |
//! | H + m S           | 4 N   | mode-`m` indices, for `m` in `1..M`            |
//! | H + M S           | 4 N   | values, f32; zero pad to `S`                   |
//! | H + (M + 1) S     |       | end of file                                    |
//!
//! Every array starts at an 8-byte-aligned offset. The CRCs are CRC-32
//! (IEEE, as computed by `crc32fast`). The payload CRC covers the arrays and
//! their padding as one byte stream; readers compute it in parallel over
//! chunks and combine the chunk CRCs, which gives the same value as a
//! sequential pass. The version field comes before anything whose meaning a
//! later version may change, so an old reader can always say that the file
//! is newer than it understands.
//!
//! Version 2 added the flags. kruskal writes only tensors whose
//! coordinates are distinct (repeated coordinates are summed when a tensor
//! is built), in strictly increasing coordinate order (mode 0 most
//! significant), and says so with [`FLAG_DISTINCT`]. A file is input like
//! any other, so readers verify the claim: one parallel pass checks the
//! order, and loading such a file then costs no search for repeats. A file
//! whose flag is set but whose coordinates are out of order (an older
//! kruskal wrote distinct coordinates in any order) or repeat (a damaged
//! or hand-made file) has its repeats searched for and summed, as has a
//! version 1 file (same layout, flags 0).
//!
//! [`read_binary`] loads a whole tensor; [`MappedBinary`] maps the file and
//! lets a process read, checksum and count only the parts it needs.

use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::time::Instant;

use crc32fast::Hasher;
use rayon::prelude::*;

use crate::coalesce;
use crate::coo::SparseTensor;
use crate::error::{FormatError, Result};
use crate::io::{read_at, write_atomically};
use crate::memory;

mod mapped;

pub use mapped::{CrcPart, MappedBinary, RangeCounts};

/// The first eight bytes of every `.ktns` file.
pub const MAGIC: [u8; 8] = *b"KRUSKAL\0";

/// The format version this code writes; it also reads version 1.
pub const VERSION: u32 = 2;

/// Flag bit: the writer says that no two nonzeros of the file share a
/// coordinate and that they are in strictly increasing coordinate order.
/// Readers check the order before relying on it.
pub const FLAG_DISTINCT: u32 = 1;

/// Bytes before the dimensions.
const FIXED_HEADER: usize = 32;

/// Array elements converted and checksummed per parallel work item.
pub(crate) const DEFAULT_CHUNK: usize = 1 << 20;

fn align8(x: u64) -> u64 {
    x.div_ceil(8) * 8
}

/// Sizes derived from `M` and `N`, in u128 so that no corrupt header can
/// overflow them.
struct Sizes {
    /// Offset of the header CRC (`D`).
    crc_offset: u128,
    /// Offset of the payload (`H`).
    payload: u128,
    /// Stride of one array (`S`).
    stride: u128,
    /// Length of the whole file.
    total: u128,
}

impl Sizes {
    fn new(nmodes: u32, nnz: u64) -> Sizes {
        let crc_offset = u128::from(align8(FIXED_HEADER as u64 + 4 * u64::from(nmodes)));
        let payload = crc_offset + 8;
        let stride = u128::from(nnz) * 4;
        let stride = stride.div_ceil(8) * 8;
        let total = payload + (u128::from(nmodes) + 1) * stride;
        Sizes {
            crc_offset,
            payload,
            stride,
            total,
        }
    }
}

/// Writes `t` as a `.ktns` file (see the module documentation for the
/// layout), atomically: the file appears complete or not at all. The
/// nonzeros are written in coordinate order, so that a reader can verify
/// the header's [`FLAG_DISTINCT`] with one pass over the order.
///
/// Cost: two parallel passes over the arrays (checksum, then writing); a
/// tensor not yet in coordinate order is first sorted through a
/// permutation (8 bytes per nonzero).
pub fn write_binary(path: &Path, t: &SparseTensor) -> Result<()> {
    let nmodes = u32::try_from(t.nmodes()).map_err(|_| {
        FormatError::Argument(format!("{} modes do not fit the header", t.nmodes()))
    })?;
    let nnz = t.nnz() as u64;
    let sizes = Sizes::new(nmodes, nnz);
    let pad = (sizes.stride - u128::from(nnz) * 4) as usize;
    let order: Option<Vec<usize>> = if coalesce::strictly_increasing(t.indices()) {
        None
    } else {
        let modes: Vec<usize> = (0..t.nmodes()).collect();
        Some(t.sort_permutation(&modes))
    };
    let order = order.as_deref();

    // The payload CRC goes in the header, so it is computed first, in
    // parallel; the arrays are then converted again while writing, which
    // costs far less than a second pass over the disk would.
    let mut payload_crc = Hasher::new();
    for idx in t.indices() {
        payload_crc.combine(&crc_of(idx, order, |x| x.to_le_bytes()));
        payload_crc.update(&[0; 4][..pad]);
    }
    payload_crc.combine(&crc_of(t.values(), order, |x| x.to_le_bytes()));
    payload_crc.update(&[0; 4][..pad]);

    let mut header = Vec::with_capacity(sizes.payload as usize);
    header.extend_from_slice(&MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&nmodes.to_le_bytes());
    header.extend_from_slice(&nnz.to_le_bytes());
    header.extend_from_slice(&payload_crc.finalize().to_le_bytes());
    // Every SparseTensor has distinct coordinates, written in order.
    header.extend_from_slice(&FLAG_DISTINCT.to_le_bytes());
    for &d in t.dims() {
        header.extend_from_slice(&d.to_le_bytes());
    }
    header.resize(sizes.crc_offset as usize, 0);
    let header_crc = crc32fast::hash(&header);
    header.extend_from_slice(&header_crc.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());

    write_atomically(path, |w| {
        let io = |e| FormatError::io(path, e);
        w.write_all(&header).map_err(io)?;
        let mut buf = Vec::with_capacity(4 * WRITE_CHUNK);
        let mut put = |bytes: &mut dyn Iterator<Item = [u8; 4]>| -> Result<()> {
            buf.clear();
            for b in bytes {
                buf.extend_from_slice(&b);
            }
            w.write_all(&buf).map_err(io)
        };
        let n = t.nnz();
        for idx in t.indices() {
            for start in (0..n).step_by(WRITE_CHUNK) {
                let end = (start + WRITE_CHUNK).min(n);
                put(&mut (start..end).map(|k| in_order(idx, order, k).to_le_bytes()))?;
            }
            put(&mut std::iter::repeat_n([0u8; 4], pad / 4))?;
        }
        for start in (0..n).step_by(WRITE_CHUNK) {
            let end = (start + WRITE_CHUNK).min(n);
            put(&mut (start..end).map(|k| in_order(t.values(), order, k).to_le_bytes()))?;
        }
        put(&mut std::iter::repeat_n([0u8; 4], pad / 4))
    })
}

/// Elements converted per write.
const WRITE_CHUNK: usize = 1 << 16;

/// Element `k` of `xs` in the written order: `xs[order[k]]`, or `xs[k]`
/// when the tensor is in coordinate order already.
fn in_order<T: Copy>(xs: &[T], order: Option<&[usize]>, k: usize) -> T {
    match order {
        Some(order) => xs[order[k]],
        None => xs[k],
    }
}

/// CRC of the little-endian bytes of `xs` in the written order (see
/// [`in_order`]), computed in parallel chunks.
fn crc_of<T: Copy + Sync>(xs: &[T], order: Option<&[usize]>, le: fn(&T) -> [u8; 4]) -> Hasher {
    let n = xs.len();
    let parts: Vec<Hasher> = (0..n.div_ceil(DEFAULT_CHUNK))
        .into_par_iter()
        .map_init(Vec::new, |buf: &mut Vec<u8>, c| {
            buf.clear();
            for k in c * DEFAULT_CHUNK..((c + 1) * DEFAULT_CHUNK).min(n) {
                buf.extend_from_slice(&le(&in_order(xs, order, k)));
            }
            let mut h = Hasher::new();
            h.update(buf);
            h
        })
        .collect();
    let mut crc = Hasher::new();
    for p in &parts {
        crc.combine(p);
    }
    crc
}

/// Reads a `.ktns` file, checking its magic, version, length and both
/// checksums, then that the tensor is valid (indices below the dimensions,
/// finite values). Every failure is an error naming the file.
///
/// Cost: one parallel pass that reads, checksums and converts the arrays;
/// memory is the tensor plus one chunk buffer per thread.
pub fn read_binary(path: &Path) -> Result<SparseTensor> {
    read_binary_with(path, DEFAULT_CHUNK).map(|(t, _, _)| t)
}

/// [`read_binary`], also returning how many nonzeros were merged (0 for a
/// file whose distinct coordinates are verified in order) and the seconds
/// that the order check and the search for repeats took.
pub(crate) fn read_binary_merged(path: &Path) -> Result<(SparseTensor, usize, f64)> {
    read_binary_with(path, DEFAULT_CHUNK)
}

/// The dimensions and nonzero count of the `.ktns` file at `path`, from
/// its header alone, checked as [`read_binary`] checks it (magic, version,
/// header CRC, exact file length). Reads the header only, and maps
/// nothing: what a caller needs to size a run before reading the file.
pub fn read_shape(path: &Path) -> Result<(Vec<u32>, usize)> {
    crate::io::regular_file(path)?;
    let mut file = File::open(path).map_err(|e| FormatError::io(path, e))?;
    let header = read_header(path, &mut file)?;
    Ok((header.dims, header.nnz))
}

/// What a valid header says, with the sizes derived from it.
pub(crate) struct Header {
    pub(crate) dims: Vec<u32>,
    pub(crate) nnz: usize,
    /// The payload CRC the header stores.
    pub(crate) payload_crc: u32,
    /// Offset of the payload (`H`); fits in usize.
    pub(crate) payload: usize,
    /// Stride of one array in bytes (`S`); fits in usize.
    pub(crate) stride: usize,
    /// Length of the whole file; fits in usize.
    pub(crate) total: usize,
    /// The file claims that its coordinates are distinct and in order
    /// (not yet verified).
    pub(crate) distinct: bool,
}

/// Reads and checks the header of the `.ktns` file `file` (opened from
/// `path`): magic, version, modes, nonzero count, header CRC and the exact
/// file length. Reads the header only, never the payload.
pub(crate) fn read_header(path: &Path, file: &mut File) -> Result<Header> {
    let corrupt = |msg: String| FormatError::file(path, msg);
    let file_len = file.metadata().map_err(|e| FormatError::io(path, e))?.len();

    let mut fixed = [0u8; FIXED_HEADER];
    let got = read_up_to(file, &mut fixed).map_err(|e| FormatError::io(path, e))?;
    if got < MAGIC.len() || fixed[..8] != MAGIC {
        return Err(corrupt("not a kruskal binary tensor (bad magic)".into()));
    }
    if got < FIXED_HEADER {
        return Err(corrupt(format!(
            "truncated: expected at least {FIXED_HEADER} bytes, file has {file_len}"
        )));
    }
    let u32_at =
        |o: usize| u32::from_le_bytes([fixed[o], fixed[o + 1], fixed[o + 2], fixed[o + 3]]);
    let version = u32_at(8);
    if version > VERSION {
        return Err(corrupt(format!(
            "written by a newer kruskal: version {version}, this reads {VERSION}"
        )));
    }
    if version == 0 {
        return Err(corrupt(format!(
            "unknown format version {version}, this reads 1 to {VERSION}: file is corrupt"
        )));
    }
    let nmodes = u32_at(12);
    let mut nnz_bytes = [0u8; 8];
    nnz_bytes.copy_from_slice(&fixed[16..24]);
    let nnz = u64::from_le_bytes(nnz_bytes);
    let payload_crc = u32_at(24);
    let flags = u32_at(28);
    let sizes = Sizes::new(nmodes, nnz);

    if sizes.payload > u128::from(file_len) || sizes.total > u128::from(file_len) {
        return Err(corrupt(format!(
            "truncated: expected {} bytes, file has {file_len}",
            sizes.total
        )));
    }
    // The whole file must fit in memory, so every offset fits in usize.
    let too_big = |_| corrupt(format!("{} bytes do not fit in memory", sizes.total));
    let header_len = usize::try_from(sizes.payload).map_err(too_big)?;
    let total = usize::try_from(sizes.total).map_err(too_big)?;
    let mut header = vec![0u8; header_len];
    read_at(path, file, &mut header, 0).map_err(|e| FormatError::io(path, e))?;
    let crc_at = sizes.crc_offset as usize;
    let stored = u32::from_le_bytes([
        header[crc_at],
        header[crc_at + 1],
        header[crc_at + 2],
        header[crc_at + 3],
    ]);
    if crc32fast::hash(&header[..crc_at]) != stored {
        return Err(corrupt("header checksum mismatch: file is corrupt".into()));
    }
    if sizes.total != u128::from(file_len) {
        return Err(corrupt(format!(
            "unexpected trailing data: expected {} bytes, file has {file_len}",
            sizes.total
        )));
    }
    if nmodes == 0 {
        return Err(corrupt("the header says 0 modes: file is corrupt".into()));
    }
    if nmodes as usize > crate::coo::MAX_MODES {
        return Err(corrupt(format!(
            "the header says {nmodes} modes, and kruskal takes at most {}",
            crate::coo::MAX_MODES
        )));
    }
    let known = if version == 1 { 0 } else { FLAG_DISTINCT };
    if flags & !known != 0 {
        return Err(corrupt(format!(
            "unknown flags {flags:#x} in a version {version} header: file is corrupt"
        )));
    }
    let nnz = usize::try_from(nnz).map_err(|_| {
        corrupt(format!(
            "{nnz} nonzeros do not fit in memory on this machine"
        ))
    })?;
    let dims: Vec<u32> = header[FIXED_HEADER..FIXED_HEADER + 4 * nmodes as usize]
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    // The mapped reader never builds a tensor, so the header refuses what
    // the tensor's own check would.
    crate::coo::check_dims(&dims).map_err(|e| corrupt(format!("the file holds an {e}")))?;
    // Both are below `total`, which fits in usize.
    Ok(Header {
        dims,
        nnz,
        payload_crc,
        payload: header_len,
        stride: sizes.stride as usize,
        total,
        distinct: flags & FLAG_DISTINCT != 0,
    })
}

/// [`read_binary_merged`] with a chosen chunk length (small in tests).
pub(crate) fn read_binary_with(path: &Path, chunk: usize) -> Result<(SparseTensor, usize, f64)> {
    let chunk = chunk.max(1);
    let corrupt = |msg: String| FormatError::file(path, msg);
    crate::io::regular_file(path)?;
    let mut file = File::open(path).map_err(|e| FormatError::io(path, e))?;
    let Header {
        dims,
        nnz,
        payload_crc,
        payload,
        stride,
        distinct,
        ..
    } = read_header(path, &mut file)?;
    let nmodes = dims.len() as u32;
    // The header may promise more than the disk holds (a sparse file of
    // the right length): the arrays are sized by it, so they must fit.
    let need = memory::coo_bytes(dims.len(), nnz as u64);
    if let Some(available) = memory::shortfall(need) {
        return Err(FormatError::Memory(format!(
            "{}: the header says {nnz} nonzeros of {} modes, which need {} in memory, and {} are \
             available (MemAvailable)",
            path.display(),
            dims.len(),
            memory::bytes_text(need),
            memory::bytes_text(available)
        )));
    }

    let pad = stride - 4 * nnz;
    let offset_of = |array: u32| (payload + array as usize * stride) as u64;
    // Each array's zero padding is part of the checksummed stream.
    let read_padding = |crc: &mut Hasher, array: u32| -> Result<()> {
        let mut padding = [0u8; 4];
        read_at(
            path,
            &file,
            &mut padding[..pad],
            offset_of(array) + 4 * nnz as u64,
        )
        .map_err(|e| FormatError::io(path, e))?;
        crc.update(&padding[..pad]);
        Ok(())
    };
    let mut crc = Hasher::new();
    let mut indices = Vec::with_capacity(nmodes as usize);
    for m in 0..nmodes {
        let (idx, h) = read_array(path, &file, offset_of(m), nnz, chunk, u32::from_le_bytes)?;
        indices.push(idx);
        crc.combine(&h);
        read_padding(&mut crc, m)?;
    }
    let (values, h) = read_array(
        path,
        &file,
        offset_of(nmodes),
        nnz,
        chunk,
        f32::from_le_bytes,
    )?;
    crc.combine(&h);
    read_padding(&mut crc, nmodes)?;
    if crc.finalize() != payload_crc {
        return Err(corrupt("checksum mismatch: file is corrupt".into()));
    }
    let holds = |e: FormatError| match e {
        FormatError::Memory(m) => FormatError::Memory(format!("{}: {m}", path.display())),
        e => corrupt(format!("the file holds an {e}")),
    };
    // The flag is a claim like any other content of a file: it is trusted
    // only when the coordinates are in strictly increasing order (as
    // kruskal writes them), which rules out repeats. Otherwise repeats are
    // searched for and summed.
    let start = Instant::now();
    if distinct && coalesce::strictly_increasing(&indices) {
        let t = SparseTensor::new_distinct(dims, indices, values).map_err(holds)?;
        Ok((t, 0, start.elapsed().as_secs_f64()))
    } else {
        let checked_s = start.elapsed().as_secs_f64();
        let (t, merged, s) = SparseTensor::new_timed(dims, indices, values, 0).map_err(holds)?;
        Ok((t, merged, checked_s + s))
    }
}

/// Reads `n` four-byte elements starting at `offset`, in parallel chunks,
/// and returns them with the CRC of their bytes.
fn read_array<T: Copy + Default + Send>(
    path: &Path,
    file: &File,
    offset: u64,
    n: usize,
    chunk: usize,
    from_le: fn([u8; 4]) -> T,
) -> Result<(Vec<T>, Hasher)> {
    let mut out = vec![T::default(); n];
    let parts: Vec<std::io::Result<Hasher>> = out
        .par_chunks_mut(chunk)
        .enumerate()
        .map_init(Vec::new, |buf: &mut Vec<u8>, (i, dst)| {
            buf.resize(4 * dst.len(), 0);
            read_at(path, file, buf, offset + 4 * (i * chunk) as u64)?;
            let mut h = Hasher::new();
            h.update(buf);
            for (d, b) in dst.iter_mut().zip(buf.chunks_exact(4)) {
                *d = from_le([b[0], b[1], b[2], b[3]]);
            }
            Ok(h)
        })
        .collect();
    let mut crc = Hasher::new();
    for p in parts {
        crc.combine(&p.map_err(|e| FormatError::io(path, e))?);
    }
    Ok((out, crc))
}

/// Reads into `buf` until it is full or the file ends; returns the count.
fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(nnz: usize) -> SparseTensor {
        let dims = vec![7, 300, 5];
        let indices = dims
            .iter()
            .enumerate()
            .map(|(m, &d)| {
                (0..nnz)
                    .map(|k| ((k * (m + 3) * 7919) % d as usize) as u32)
                    .collect()
            })
            .collect();
        let values = (0..nnz).map(|k| k as f32 * 0.25 - 3.0).collect();
        SparseTensor::new(dims, indices, values).unwrap()
    }

    /// `t` in coordinate order, as the writer writes it.
    fn sorted(t: &SparseTensor) -> SparseTensor {
        let mut t = t.clone();
        let modes: Vec<usize> = (0..t.nmodes()).collect();
        t.sort_by_modes(&modes).unwrap();
        t
    }

    fn err_of(p: &Path) -> String {
        match read_binary(p).unwrap_err() {
            e @ FormatError::File { .. } => {
                let s = e.to_string();
                assert!(s.starts_with(&p.display().to_string()), "{s}");
                s
            }
            other => panic!("expected a file error, got {other}"),
        }
    }

    fn written(nnz: usize) -> (tempfile::TempDir, std::path::PathBuf, SparseTensor) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.ktns");
        let t = sample(nnz);
        write_binary(&p, &t).unwrap();
        (dir, p, t)
    }

    #[test]
    fn layout_matches_the_documentation() {
        let (_dir, p, t) = written(3);
        assert!(!coalesce::strictly_increasing(t.indices()));
        let t = sorted(&t);
        let bytes = std::fs::read(&p).unwrap();
        // M = 3: D = align8(32 + 12) = 48, H = 56, S = align8(12) = 16.
        assert_eq!(bytes.len(), 56 + 4 * 16);
        assert_eq!(&bytes[..8], b"KRUSKAL\0");
        assert_eq!(&bytes[8..12], &2u32.to_le_bytes());
        assert_eq!(&bytes[12..16], &3u32.to_le_bytes());
        assert_eq!(&bytes[16..24], &3u64.to_le_bytes());
        assert_eq!(&bytes[28..32], &FLAG_DISTINCT.to_le_bytes());
        assert_eq!(&bytes[32..36], &7u32.to_le_bytes());
        assert_eq!(&bytes[48..52], &crc32fast::hash(&bytes[..48]).to_le_bytes());
        assert_eq!(&bytes[24..28], &crc32fast::hash(&bytes[56..]).to_le_bytes());
        let mode1 = &bytes[56 + 16..56 + 16 + 12];
        let want: Vec<u8> = t
            .mode_indices(1)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(mode1, &want[..]);
        let values = &bytes[56 + 48..56 + 48 + 12];
        let want: Vec<u8> = t.values().iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(values, &want[..]);
    }

    #[test]
    fn the_shape_comes_from_the_header_alone() {
        let (_dir, p, t) = written(1000);
        assert_eq!(read_shape(&p).unwrap(), (t.dims().to_vec(), t.nnz()));
        let mut bytes = std::fs::read(&p).unwrap();
        let k = bytes.len() - 100;
        bytes[k] ^= 1; // the payload: not read
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(read_shape(&p).unwrap().1, t.nnz());
        bytes[33] ^= 1; // the header: checked
        std::fs::write(&p, &bytes).unwrap();
        assert!(read_shape(&p).is_err());
    }

    #[test]
    fn round_trip_across_chunks() {
        let (_dir, p, t) = written(10_001);
        let t = sorted(&t);
        assert_eq!(read_binary(&p).unwrap(), t);
        for chunk in [1, 7, 4096] {
            assert_eq!(read_binary_with(&p, chunk).unwrap().0, t);
        }
    }

    #[test]
    fn empty_tensor_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("e.ktns");
        let t = SparseTensor::new(vec![4, 2], vec![vec![], vec![]], vec![]).unwrap();
        write_binary(&p, &t).unwrap();
        assert_eq!(read_binary(&p).unwrap(), t);
    }

    #[test]
    fn corrupt_payload_byte_fails_the_checksum() {
        let (_dir, p, _) = written(5000);
        let mut bytes = std::fs::read(&p).unwrap();
        let k = bytes.len() - 1000;
        bytes[k] ^= 0x01;
        std::fs::write(&p, &bytes).unwrap();
        let err = err_of(&p);
        assert!(err.contains("checksum mismatch: file is corrupt"), "{err}");
        assert!(read_binary_with(&p, 64).is_err());
    }

    #[test]
    fn corrupt_header_fails_the_header_checksum() {
        let (_dir, p, _) = written(50);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[33] ^= 0x10; // a dimension
        std::fs::write(&p, &bytes).unwrap();
        let err = err_of(&p);
        assert!(err.contains("header checksum mismatch"), "{err}");
    }

    #[test]
    fn truncated_and_padded_files() {
        let (_dir, p, _) = written(5000);
        let bytes = std::fs::read(&p).unwrap();
        let full = bytes.len();
        std::fs::write(&p, &bytes[..full - 10]).unwrap();
        let err = err_of(&p);
        assert!(
            err.contains(&format!(
                "truncated: expected {full} bytes, file has {}",
                full - 10
            )),
            "{err}"
        );
        std::fs::write(&p, &bytes[..20]).unwrap();
        assert!(err_of(&p).contains("truncated"));
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0; 8]);
        std::fs::write(&p, &longer).unwrap();
        assert!(err_of(&p).contains("trailing data"));
    }

    #[test]
    fn bad_magic_and_newer_version() {
        let (dir, p, _) = written(5);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[8..12].copy_from_slice(&7u32.to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        let err = err_of(&p);
        assert!(
            err.contains("written by a newer kruskal: version 7, this reads 2"),
            "{err}"
        );

        let text = dir.path().join("x.ktns");
        std::fs::write(&text, b"1 1 1.0\n").unwrap();
        assert!(err_of(&text).contains("not a kruskal binary tensor"));
        std::fs::write(&text, b"").unwrap();
        assert!(err_of(&text).contains("not a kruskal binary tensor"));
    }

    /// Rewrites the header of `bytes` (M = 3) with `version` and `flags`
    /// and seals both checksums again.
    fn reseal(bytes: &mut [u8], version: u32, flags: u32) {
        bytes[8..12].copy_from_slice(&version.to_le_bytes());
        bytes[28..32].copy_from_slice(&flags.to_le_bytes());
        let payload = crc32fast::hash(&bytes[56..]);
        bytes[24..28].copy_from_slice(&payload.to_le_bytes());
        let crc = crc32fast::hash(&bytes[..48]);
        bytes[48..52].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn a_version_1_file_has_its_repeats_summed() {
        let (_dir, p, t) = written(50);
        let t = sorted(&t);
        let mut bytes = std::fs::read(&p).unwrap();
        // Make nonzero 1 repeat nonzero 0's coordinate: copy its indices.
        let stride = 4 * 50usize.div_ceil(2) * 2;
        for m in 0..3 {
            let at = 56 + m * stride;
            let first: [u8; 4] = bytes[at..at + 4].try_into().unwrap();
            bytes[at + 4..at + 8].copy_from_slice(&first);
        }
        reseal(&mut bytes, 1, 0);
        std::fs::write(&p, &bytes).unwrap();
        let (back, merged, _) = read_binary_merged(&p).unwrap();
        assert_eq!(merged, 1);
        assert_eq!(back.nnz(), 49);
        let want = f64::from(t.values()[0]) + f64::from(t.values()[1]);
        let k = (0..back.nnz())
            .find(|&k| (0..3).all(|m| back.mode_indices(m)[k] == t.mode_indices(m)[0]))
            .unwrap();
        assert_eq!(back.values()[k], want as f32);

        // The same bytes claiming distinct coordinates in version 1, or an
        // unknown flag in version 2, are refused.
        reseal(&mut bytes, 1, FLAG_DISTINCT);
        std::fs::write(&p, &bytes).unwrap();
        assert!(err_of(&p).contains("unknown flags 0x1 in a version 1 header"));
        reseal(&mut bytes, 2, 4);
        std::fs::write(&p, &bytes).unwrap();
        assert!(err_of(&p).contains("unknown flags 0x4"));
    }

    /// Makes nonzero 1 of a written 50-nonzero, 3-mode file repeat
    /// nonzero 0's coordinate, keeping the header's claim of distinct
    /// coordinates, and seals the checksums again.
    fn repeat_first_coordinate(bytes: &mut [u8]) {
        let stride = 4 * 50usize.div_ceil(2) * 2;
        for m in 0..3 {
            let at = 56 + m * stride;
            let first: [u8; 4] = bytes[at..at + 4].try_into().unwrap();
            bytes[at + 4..at + 8].copy_from_slice(&first);
        }
        reseal(bytes, 2, FLAG_DISTINCT);
    }

    #[test]
    fn a_false_claim_of_distinct_coordinates_is_caught_and_summed() {
        let (_dir, p, t) = written(50);
        let t = sorted(&t);
        let mut bytes = std::fs::read(&p).unwrap();
        repeat_first_coordinate(&mut bytes);
        std::fs::write(&p, &bytes).unwrap();
        let (back, merged, _) = read_binary_merged(&p).unwrap();
        assert_eq!(merged, 1);
        assert_eq!(back.nnz(), 49);
        // The norm is that of the summed tensor, not of the two lines.
        let (a, b) = (f64::from(t.values()[0]), f64::from(t.values()[1]));
        let summed = ((a + b) as f32) as f64;
        let want = t.norm_sq() - a * a - b * b + summed * summed;
        assert!(
            (back.norm_sq() - want).abs() <= 1e-9 * want,
            "{} {want}",
            back.norm_sq()
        );
        // The whole file is checked: a repeat at the end is caught too.
        let (_dir2, p2, _) = written(50);
        let mut bytes = std::fs::read(&p2).unwrap();
        let stride = 4 * 50usize.div_ceil(2) * 2;
        for m in 0..3 {
            let at = 56 + m * stride + 4 * 48;
            let last: [u8; 4] = bytes[at..at + 4].try_into().unwrap();
            bytes[at + 4..at + 8].copy_from_slice(&last);
        }
        reseal(&mut bytes, 2, FLAG_DISTINCT);
        std::fs::write(&p2, &bytes).unwrap();
        assert_eq!(read_binary_merged(&p2).unwrap().1, 1);
    }

    #[test]
    fn distinct_coordinates_out_of_order_are_read_as_they_are() {
        // What an older writer made: distinct coordinates in any order,
        // flagged. The claim fails the order check; the search for
        // repeats finds none and keeps the file's order.
        let (_dir, p, t) = written(50);
        let t = sorted(&t);
        let mut bytes = std::fs::read(&p).unwrap();
        let stride = 4 * 50usize.div_ceil(2) * 2;
        // Swap nonzeros 0 and 49 in every array.
        for a in 0..4 {
            let at = 56 + a * stride;
            let first: [u8; 4] = bytes[at..at + 4].try_into().unwrap();
            let last: [u8; 4] = bytes[at + 196..at + 200].try_into().unwrap();
            bytes[at..at + 4].copy_from_slice(&last);
            bytes[at + 196..at + 200].copy_from_slice(&first);
        }
        reseal(&mut bytes, 2, FLAG_DISTINCT);
        std::fs::write(&p, &bytes).unwrap();
        let (back, merged, _) = read_binary_merged(&p).unwrap();
        assert_eq!(merged, 0);
        assert_eq!(sorted(&back), t);
        assert_eq!(back.values()[0], t.values()[49]);
    }

    #[test]
    fn invalid_tensor_with_valid_checksums_is_refused() {
        let (_dir, p, _) = written(50);
        let mut bytes = std::fs::read(&p).unwrap();
        // Shrink the mode-1 dimension below the stored indices and re-seal
        // the header, as a buggy writer might.
        bytes[36..40].copy_from_slice(&2u32.to_le_bytes());
        let crc = crc32fast::hash(&bytes[..48]);
        bytes[48..52].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        let err = err_of(&p);
        assert!(
            err.contains("invalid tensor") && err.contains("mode-1 index"),
            "{err}"
        );
    }

    #[test]
    fn a_dimension_of_zero_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("e.ktns");
        let t = SparseTensor::new(vec![4, 2], vec![vec![], vec![]], vec![]).unwrap();
        write_binary(&p, &t).unwrap();
        let mut bytes = std::fs::read(&p).unwrap();
        // M = 2: the dimensions at 32..40, the header CRC at 40.
        bytes[32..36].copy_from_slice(&0u32.to_le_bytes());
        let crc = crc32fast::hash(&bytes[..40]);
        bytes[40..44].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        let err = err_of(&p);
        assert!(err.contains("the dimension of mode 1 is 0"), "{err}");
        // The mapped reader (--distributed) refuses it in the same words.
        let Err(err) = MappedBinary::open(&p) else {
            panic!("the mapped reader accepted a zero dimension")
        };
        let err = err.to_string();
        assert!(err.contains("the dimension of mode 1 is 0"), "{err}");
    }

    #[test]
    fn failed_write_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("missing").join("t.ktns");
        assert!(write_binary(&p, &sample(10)).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    fn tensor_strategy() -> impl Strategy<Value = SparseTensor> {
        (1usize..=6, 0usize..300).prop_flat_map(|(nmodes, nnz)| {
            (
                proptest::collection::vec(1u32..=u32::MAX, nmodes),
                proptest::collection::vec(proptest::collection::vec(any::<u32>(), nnz), nmodes),
                proptest::collection::vec(
                    any::<f32>().prop_filter("finite", |v| v.is_finite()),
                    nnz,
                ),
            )
                .prop_filter_map(
                    "repeated coordinates sum beyond f32",
                    |(dims, raw, values)| {
                        let indices = raw
                            .into_iter()
                            .zip(&dims)
                            .map(|(col, &d)| col.into_iter().map(|x| x % d).collect())
                            .collect();
                        SparseTensor::new(dims, indices, values).ok()
                    },
                )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn binary_round_trip(t in tensor_strategy(), chunk in 1usize..100) {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("t.ktns");
            write_binary(&p, &t).unwrap();
            let (back, merged, _) = read_binary_with(&p, chunk).unwrap();
            let t = sorted(&t);
            prop_assert_eq!(merged, 0);
            prop_assert_eq!(&back, &t);
            for (a, b) in back.values().iter().zip(t.values()) {
                prop_assert_eq!(a.to_bits(), b.to_bits());
            }
        }
    }
}
