//! A `.ktns` file read through a memory map, for processes that each hold
//! only part of a tensor.
//!
//! [`MappedBinary::open`] checks the header as [`read_binary`] does and
//! reads nothing else; the arrays are then zero-copy views into the map, so
//! a process touches (and the operating system pages in) only the parts it
//! reads. The payload checksum and the per-row summary a row plan needs can
//! be computed over ranges, so that P processes each do 1/P of the work and
//! combine the results:
//!
//! - [`MappedBinary::payload_crc_part`] and [`MappedBinary::verify_payload`]:
//!   the payload CRC split over equal byte ranges;
//! - [`MappedBinary::count_range`]: nonzeros per row of every mode and the
//!   squared norm of a range of nonzeros, with the same validity checks
//!   [`SparseTensor::new`](crate::SparseTensor::new) makes.
//!
//! [`read_binary`]: super::read_binary

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crc32fast::Hasher;
use memmap2::{Mmap, MmapOptions};
use rayon::prelude::*;

use super::{DEFAULT_CHUNK, Header, read_header};
use crate::error::{FormatError, Result};

/// Bytes checksummed per parallel work item.
const CRC_CHUNK: usize = 4 * DEFAULT_CHUNK;

/// Nonzeros summed per work item of the squared norm (as in
/// [`SparseTensor::norm_sq`](crate::SparseTensor::norm_sq)).
const NORM_CHUNK: usize = 1 << 16;

/// Largest integer below which every integer is exact in f64 (2^53).
const F64_EXACT: u64 = 1 << 53;

/// A `.ktns` file mapped into memory, its header checked.
///
/// The file must not be changed (written, truncated, replaced in place)
/// while it is mapped: the views would change under their borrowers, and a
/// truncation turns reads into a bus error. kruskal writes `.ktns` files
/// atomically (a new file renamed over the old one), which leaves a mapped
/// old file intact.
#[derive(Debug)]
pub struct MappedBinary {
    path: PathBuf,
    map: Mmap,
    dims: Vec<u32>,
    nnz: usize,
    payload_crc: u32,
    /// Offset of the payload in the file.
    payload: usize,
    /// Bytes from one array to the next.
    stride: usize,
    /// The header records distinct coordinates.
    distinct: bool,
}

/// The CRC-32 of one contiguous part of the payload, and the part's length
/// in bytes. Parts combine in order (see [`MappedBinary::verify_payload`]).
///
/// Both fields are exact as f64 ([`CrcPart::to_f64s`]), so processes can
/// exchange their parts through a sum all-reduce of f64 values: each
/// writes its part into its own slots of a zeroed vector, and the sum,
/// which adds only zeros to each value, gives every process every part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrcPart {
    /// CRC-32 (IEEE) of the part's bytes.
    pub crc: u32,
    /// The part's length in bytes, below 2^53.
    pub len: u64,
}

impl CrcPart {
    /// The part as two f64 values, `[crc, len]`, both exact.
    pub fn to_f64s(&self) -> [f64; 2] {
        [f64::from(self.crc), self.len as f64]
    }

    /// The part back from [`CrcPart::to_f64s`]'s values; an error when
    /// they are not integers in the fields' ranges (a length must be below
    /// 2^53).
    pub fn from_f64s(values: [f64; 2]) -> Result<CrcPart> {
        let [crc, len] = values;
        let whole =
            |x: f64, max: u64| x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x <= max as f64;
        if !whole(crc, u64::from(u32::MAX)) || !whole(len, F64_EXACT - 1) {
            return Err(FormatError::Argument(format!(
                "[{crc}, {len}] is not a checksum part (a CRC-32 and a length below 2^53)"
            )));
        }
        Ok(CrcPart {
            crc: crc as u32,
            len: len as u64,
        })
    }
}

/// What a range of nonzeros contributes to a row plan and to the fit.
#[derive(Clone, Debug, PartialEq)]
pub struct RangeCounts {
    /// Per mode, the nonzeros of the range in each row (original index),
    /// length `dims[mode]`.
    pub counts: Vec<Vec<u64>>,
    /// Sum of the squared values of the range, in f64.
    pub norm_sq: f64,
    /// The largest `|value|` of the range, in f64 (0 for no nonzeros).
    pub max_abs: f64,
}

impl RangeCounts {
    /// Adds the counts and squared norm of `other` (another range of the
    /// same tensor) to these.
    ///
    /// # Panics
    /// When `other` has other dimensions.
    pub fn add(&mut self, other: &RangeCounts) {
        assert_eq!(self.counts.len(), other.counts.len(), "mode counts differ");
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            assert_eq!(a.len(), b.len(), "dimensions differ");
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
        self.norm_sq += other.norm_sq;
        self.max_abs = self.max_abs.max(other.max_abs);
    }
}

impl MappedBinary {
    /// Opens the `.ktns` file at `path` and maps it, checking the header
    /// exactly as [`read_binary`](super::read_binary) does (magic, version,
    /// modes, nonzero count, header CRC, exact file length), with the same
    /// errors. The payload is not read: its checksum is checked by
    /// [`MappedBinary::verify_payload`], its indices and values by
    /// [`MappedBinary::count_range`].
    ///
    /// The file must not be changed while the returned value lives (see
    /// [`MappedBinary`]). On a big-endian machine this is an error: the
    /// views would need converting, which `read_binary` does.
    ///
    /// Cost: reads the header only.
    pub fn open(path: &Path) -> Result<MappedBinary> {
        if cfg!(target_endian = "big") {
            return Err(FormatError::file(
                path,
                "a .ktns file is little-endian and cannot be mapped on this big-endian \
                 machine; read it instead",
            ));
        }
        crate::io::regular_file(path)?;
        let mut file = File::open(path).map_err(|e| FormatError::io(path, e))?;
        let Header {
            dims,
            nnz,
            payload_crc,
            payload,
            stride,
            total,
            distinct,
        } = read_header(path, &mut file)?;
        // SAFETY: the map is only read, through byte slices and the u32/f32
        // views below, which are sound as long as the file keeps its
        // contents and length; that the file is not changed while mapped is
        // this type's documented precondition.
        let map = unsafe { MmapOptions::new().len(total).map(&file) }
            .map_err(|e| FormatError::io(path, e))?;
        if map.len() != total {
            return Err(FormatError::file(
                path,
                format!(
                    "the file changed while being opened: expected {total} bytes, mapped {}",
                    map.len()
                ),
            ));
        }
        // Maps start on a page boundary; the views rely on it.
        if map.as_ptr() as usize % 8 != 0 {
            return Err(FormatError::file(path, "the map is not 8-byte aligned"));
        }
        Ok(MappedBinary {
            path: path.to_path_buf(),
            map,
            dims,
            nnz,
            payload_crc,
            payload,
            stride,
            distinct,
        })
    }

    /// Whether the header claims that no two of its nonzeros share a
    /// coordinate and that they are in coordinate order (every `.ktns`
    /// kruskal writes). A claim only: [`MappedBinary::in_order`] verifies
    /// it.
    pub fn distinct(&self) -> bool {
        self.distinct
    }

    /// Whether every nonzero `k` of `range` (but nonzero 0) comes strictly
    /// after nonzero `k - 1` in coordinate order (mode 0 most
    /// significant). Over ranges that tile `0..nnz()` these checks
    /// together verify that the coordinates are distinct, which a process
    /// that reads only part of the file needs: it cannot sum repeats that
    /// fall in other parts. An argument error when `range` is not within
    /// `0..nnz()`.
    ///
    /// Cost: one parallel pass over the range's indices (and the one
    /// nonzero before it), stopping at the first pair out of order.
    pub fn in_order(&self, range: Range<usize>) -> Result<bool> {
        self.check_range(&range)?;
        let indices: Vec<&[u32]> = (0..self.nmodes()).map(|m| self.indices(m)).collect();
        Ok(crate::coalesce::increasing_at(&indices, range))
    }

    /// The file this maps.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The dimensions, one per mode.
    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// Number of modes.
    pub fn nmodes(&self) -> usize {
        self.dims.len()
    }

    /// Number of stored nonzeros.
    pub fn nnz(&self) -> usize {
        self.nnz
    }

    /// The mode-`mode` index of every nonzero, as stored (not yet checked
    /// against the dimension: [`MappedBinary::count_range`] checks).
    ///
    /// # Panics
    /// When `mode >= nmodes()`.
    pub fn indices(&self, mode: usize) -> &[u32] {
        assert!(mode < self.nmodes(), "mode {mode} of {}", self.nmodes());
        let ptr = self.array_start(mode).cast::<u32>();
        // SAFETY: array `mode` holds `nnz` little-endian u32 words inside
        // the map (the header check fixed the file's length to hold every
        // array), starts 8-byte aligned (an aligned map plus a multiple of
        // 8), this is a little-endian machine (checked in `open`), every
        // bit pattern is a u32, and the map lives and is unchanged as long
        // as `self` is borrowed (the type's precondition).
        unsafe { std::slice::from_raw_parts(ptr, self.nnz) }
    }

    /// Every nonzero's value, as stored (not yet checked for finiteness:
    /// [`MappedBinary::count_range`] checks).
    pub fn values(&self) -> &[f32] {
        let ptr = self.array_start(self.nmodes()).cast::<f32>();
        // SAFETY: as in `indices`: the values array holds `nnz` f32 words
        // inside the map, 8-byte aligned, little-endian on a little-endian
        // machine, every bit pattern is an f32, and the map outlives the
        // borrow unchanged.
        unsafe { std::slice::from_raw_parts(ptr, self.nnz) }
    }

    /// The start of array `array` (modes, then the values) in the map.
    fn array_start(&self, array: usize) -> *const u8 {
        let offset = self.payload + array * self.stride;
        // `offset + 4 nnz <= map.len()` for every array, so this is in
        // bounds (or one past the end when nnz is 0).
        self.map[offset..].as_ptr()
    }

    /// The payload: every array with its padding, as one byte stream.
    fn payload_bytes(&self) -> &[u8] {
        &self.map[self.payload..]
    }

    /// The CRC-32 of part `part` of `parts` equal byte ranges of the
    /// payload (the first `len * part / parts` bytes belong to the parts
    /// before it). Every process of a group computes its own part; the
    /// parts, in order, are then checked by
    /// [`MappedBinary::verify_payload`].
    ///
    /// Cost: one parallel pass over `1/parts` of the payload.
    pub fn payload_crc_part(&self, part: usize, parts: usize) -> Result<CrcPart> {
        if part >= parts {
            return Err(FormatError::Argument(format!(
                "checksum part {part} of {parts}"
            )));
        }
        let bytes = self.payload_bytes();
        let len = bytes.len() as u128;
        // Each bound is at most `len`, which fits in usize.
        let lo = (len * part as u128 / parts as u128) as usize;
        let hi = (len * (part as u128 + 1) / parts as u128) as usize;
        let part_len = (hi - lo) as u64;
        if part_len >= F64_EXACT {
            return Err(FormatError::file(
                &self.path,
                format!("a checksum part of {part_len} bytes is too long to exchange"),
            ));
        }
        let hashers: Vec<Hasher> = bytes[lo..hi]
            .par_chunks(CRC_CHUNK)
            .map(|chunk| {
                let mut h = Hasher::new();
                h.update(chunk);
                h
            })
            .collect();
        let mut crc = Hasher::new();
        for h in &hashers {
            crc.combine(h);
        }
        Ok(CrcPart {
            crc: crc.finalize(),
            len: part_len,
        })
    }

    /// Combines `parts` (every part of the payload, in order, as
    /// [`MappedBinary::payload_crc_part`] made them) and compares the result
    /// with the payload CRC the header stores: an error naming the file when
    /// they differ, and an argument error when the parts do not cover the
    /// payload.
    pub fn verify_payload(&self, parts: &[CrcPart]) -> Result<()> {
        let mut crc = Hasher::new();
        let mut covered: u128 = 0;
        for p in parts {
            crc.combine(&Hasher::new_with_initial_len(p.crc, p.len));
            covered += u128::from(p.len);
        }
        let len = self.payload_bytes().len();
        if covered != len as u128 {
            return Err(FormatError::Argument(format!(
                "the checksum parts cover {covered} bytes of the {len}-byte payload of {}",
                self.path.display()
            )));
        }
        if crc.finalize() != self.payload_crc {
            return Err(FormatError::file(
                &self.path,
                "checksum mismatch: file is corrupt",
            ));
        }
        Ok(())
    }

    /// The nonzeros per row of every mode, the squared norm and the
    /// largest `|value|` of the nonzeros in `range`, checking each as
    /// [`SparseTensor::new`](crate::SparseTensor::new) does: an index not
    /// below its dimension or a value that is not finite is an error naming
    /// the file and the nonzero. Summed over ranges that tile `0..nnz()`
    /// (see [`RangeCounts::add`]), the counts are the tensor's
    /// [`mode_counts`](crate::SparseTensor::mode_counts).
    ///
    /// Cost: one parallel pass over the range's indices and values; memory
    /// is the result (`sum(dims)` counts) plus, while a mode is counted,
    /// at most 256 MiB of per-thread counters or 128 MiB of its indices
    /// put in buckets of rows (see `row_counts`).
    pub fn count_range(&self, range: Range<usize>) -> Result<RangeCounts> {
        self.check_range(&range)?;
        // The counts are sized by the header's dimensions, which a damaged
        // or hostile file may make huge: checked before they are allocated
        // (every mode's counts, and as much again as the widest mode's
        // for counting it).
        let rows: u64 = self.dims.iter().map(|&d| u64::from(d)).sum();
        let widest = self.dims.iter().map(|&d| u64::from(d)).max().unwrap_or(0);
        let need = 8 * (rows + widest);
        if let Some(available) = crate::memory::shortfall(need) {
            return Err(FormatError::Memory(format!(
                "{}: counting the nonzeros of its {rows} rows needs {}, and {} are available \
                 (MemAvailable)",
                self.path.display(),
                crate::memory::bytes_text(need),
                crate::memory::bytes_text(available)
            )));
        }
        let counts = (0..self.nmodes())
            .map(|mode| self.count_mode(mode, range.clone()))
            .collect::<Result<Vec<_>>>()?;
        let values = &self.values()[range.clone()];
        // Chunk sums added in chunk order, so the result does not depend on
        // the number of threads.
        let partials = values
            .par_chunks(NORM_CHUNK)
            .enumerate()
            .map(|(c, chunk)| {
                let (mut sum, mut max) = (0.0f64, 0.0f64);
                for (j, &v) in chunk.iter().enumerate() {
                    if !v.is_finite() {
                        let k = range.start + c * NORM_CHUNK + j;
                        return Err(self.invalid(format!("nonzero {k}: value {v} is not finite")));
                    }
                    sum += f64::from(v) * f64::from(v);
                    max = max.max(f64::from(v.abs()));
                }
                Ok((sum, max))
            })
            .collect::<Result<Vec<(f64, f64)>>>()?;
        Ok(RangeCounts {
            counts,
            norm_sq: partials.iter().map(|p| p.0).sum(),
            max_abs: partials.iter().map(|p| p.1).fold(0.0, f64::max),
        })
    }

    /// An argument error when `range` is not a range of `0..nnz()`.
    fn check_range(&self, range: &Range<usize>) -> Result<()> {
        if range.start > range.end || range.end > self.nnz {
            return Err(FormatError::Argument(format!(
                "nonzeros {}..{} of {} in {}",
                range.start,
                range.end,
                self.nnz,
                self.path.display()
            )));
        }
        Ok(())
    }

    /// Nonzeros per row of `mode` in `range` (which is in bounds).
    fn count_mode(&self, mode: usize, range: Range<usize>) -> Result<Vec<u64>> {
        let dim = self.dims[mode] as usize;
        let idx = &self.indices(mode)[range.clone()];
        crate::row_counts::count_rows(idx, dim).map_err(|j| {
            let k = range.start + j;
            self.invalid(format!(
                "nonzero {k}: mode-{mode} index {} is not below the dimension {dim}",
                idx[j]
            ))
        })
    }

    /// The error for a file whose nonzeros break a tensor invariant, worded
    /// as [`read_binary`](super::read_binary) words it.
    fn invalid(&self, message: String) -> FormatError {
        FormatError::file(
            &self.path,
            format!("the file holds an {}", FormatError::Invalid(message)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::{read_binary, write_binary};
    use super::*;
    use crate::SparseTensor;
    use crate::generate::{PowerLawSpec, power_law};

    fn written(nnz: usize) -> (tempfile::TempDir, PathBuf, SparseTensor) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.ktns");
        let t = power_law(&PowerLawSpec::new(vec![90, 40, 7, 300], nnz).with_seed(5)).unwrap();
        write_binary(&p, &t).unwrap();
        (dir, p, t)
    }

    /// The message of a file error, checking that it names `p`.
    fn file_err(e: FormatError, p: &Path) -> String {
        match e {
            e @ FormatError::File { .. } => {
                let s = e.to_string();
                assert!(s.starts_with(&p.display().to_string()), "{s}");
                s
            }
            other => panic!("expected a file error, got {other}"),
        }
    }

    fn all_parts(m: &MappedBinary, parts: usize) -> Vec<CrcPart> {
        (0..parts)
            .map(|p| m.payload_crc_part(p, parts).unwrap())
            .collect()
    }

    #[test]
    fn views_equal_the_read_tensor() {
        let (_dir, p, t) = written(20_001);
        let m = MappedBinary::open(&p).unwrap();
        let read = read_binary(&p).unwrap();
        assert_eq!(read, t);
        assert_eq!(m.path(), p.as_path());
        assert_eq!(m.dims(), read.dims());
        assert_eq!(m.nnz(), read.nnz());
        assert_eq!(m.nmodes(), read.nmodes());
        for mode in 0..m.nmodes() {
            assert_eq!(m.indices(mode), read.mode_indices(mode));
            assert_eq!(m.indices(mode).as_ptr() as usize % 8, 0);
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(m.values()), bits(read.values()));
        assert_eq!(m.values().as_ptr() as usize % 8, 0);
    }

    #[test]
    fn empty_tensor_maps() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("e.ktns");
        let t = SparseTensor::new(vec![4, 2], vec![vec![], vec![]], vec![]).unwrap();
        write_binary(&p, &t).unwrap();
        let m = MappedBinary::open(&p).unwrap();
        assert_eq!(m.nnz(), 0);
        assert!(m.indices(1).is_empty() && m.values().is_empty());
        m.verify_payload(&all_parts(&m, 3)).unwrap();
        let c = m.count_range(0..0).unwrap();
        assert_eq!(c.counts, vec![vec![0; 4], vec![0; 2]]);
        assert_eq!(c.norm_sq, 0.0);
    }

    #[test]
    fn counts_over_split_ranges_sum_to_the_tensor_counts() {
        let (_dir, p, t) = written(150_007);
        let m = MappedBinary::open(&p).unwrap();
        let whole = m.count_range(0..t.nnz()).unwrap();
        let cuts = [0, 1, 999, 70_000, 70_001, 150_007];
        let mut sum = m.count_range(0..0).unwrap();
        for w in cuts.windows(2) {
            sum.add(&m.count_range(w[0]..w[1]).unwrap());
        }
        for mode in 0..t.nmodes() {
            assert_eq!(whole.counts[mode], t.mode_counts(mode));
            assert_eq!(sum.counts[mode], t.mode_counts(mode));
        }
        let want = t.norm_sq();
        assert_eq!(whole.norm_sq, want);
        assert_eq!(whole.max_abs, t.max_abs());
        assert_eq!(sum.max_abs, t.max_abs());
        assert!(
            (sum.norm_sq - want).abs() <= 1e-12 * want,
            "{} {want}",
            sum.norm_sq
        );
        // Single-threaded, the same numbers.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        assert_eq!(pool.install(|| m.count_range(0..t.nnz()).unwrap()), whole);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(8)
            .build()
            .unwrap();
        assert_eq!(pool.install(|| m.count_range(0..t.nnz()).unwrap()), whole);
        let (start, end) = (5, 4);
        assert!(m.count_range(start..end).is_err());
        assert!(m.count_range(0..t.nnz() + 1).is_err());
    }

    #[test]
    fn order_checks_over_tiles_verify_distinct_coordinates() {
        let (_dir, p, t) = written(20_001);
        let m = MappedBinary::open(&p).unwrap();
        assert!(m.distinct());
        let nnz = t.nnz();
        assert!(m.in_order(0..nnz).unwrap());
        assert!(m.in_order(0..0).unwrap() && m.in_order(nnz..nnz).unwrap());
        assert!(m.in_order(0..nnz + 1).is_err());
        drop(m);

        // Nonzero `k` made to repeat nonzero `k - 1`, the claim kept: the
        // tile that holds the pair (k - 1, k), that is the one starting at
        // or before k and ending after it, says so; the others do not.
        let k = 10_000;
        let mut bytes = std::fs::read(&p).unwrap();
        // M = 4: D = 48, H = 56, S = align8(4 nnz).
        let stride = (4 * nnz).div_ceil(8) * 8;
        for mode in 0..4 {
            let at = 56 + mode * stride + 4 * k;
            let before: [u8; 4] = bytes[at - 4..at].try_into().unwrap();
            bytes[at..at + 4].copy_from_slice(&before);
        }
        std::fs::write(&p, &bytes).unwrap();
        let m = MappedBinary::open(&p).unwrap();
        assert!(m.distinct());
        assert!(!m.in_order(0..nnz).unwrap());
        assert!(m.in_order(0..k).unwrap());
        assert!(!m.in_order(k..nnz).unwrap());
        assert!(!m.in_order(k..k + 1).unwrap());
        assert!(m.in_order(k + 1..nnz).unwrap());
    }

    #[test]
    fn checksum_parts_verify_and_a_flipped_byte_fails() {
        let (_dir, p, _) = written(50_000);
        let m = MappedBinary::open(&p).unwrap();
        let payload = m.payload_bytes().len() as u64;
        for parts in [1, 2, 3, 7] {
            let got = all_parts(&m, parts);
            assert_eq!(got.iter().map(|c| c.len).sum::<u64>(), payload);
            m.verify_payload(&got).unwrap();
            // Through f64 and back, as an all-reduce carries them.
            let back: Vec<CrcPart> = got
                .iter()
                .map(|c| CrcPart::from_f64s(c.to_f64s()).unwrap())
                .collect();
            assert_eq!(back, got);
        }
        let mut two = all_parts(&m, 2);
        two.swap(0, 1);
        assert!(m.verify_payload(&two).is_err());
        assert!(matches!(
            m.verify_payload(&all_parts(&m, 3)[..2]),
            Err(FormatError::Argument(_))
        ));
        assert!(m.payload_crc_part(3, 3).is_err());
        assert!(m.payload_crc_part(0, 0).is_err());
        drop(m);

        let mut bytes = std::fs::read(&p).unwrap();
        let k = bytes.len() - 1000;
        bytes[k] ^= 0x01;
        std::fs::write(&p, &bytes).unwrap();
        let m = MappedBinary::open(&p).unwrap();
        for parts in [1, 2, 3, 7] {
            let err = file_err(m.verify_payload(&all_parts(&m, parts)).unwrap_err(), &p);
            assert!(err.contains("checksum mismatch: file is corrupt"), "{err}");
        }
    }

    #[test]
    fn crc_parts_round_trip_through_f64_exactly() {
        for (crc, len) in [(0, 0), (u32::MAX, F64_EXACT - 1), (0x8000_0001, 12_345)] {
            let c = CrcPart { crc, len };
            assert_eq!(CrcPart::from_f64s(c.to_f64s()).unwrap(), c);
        }
        for bad in [
            [-1.0, 0.0],
            [0.5, 0.0],
            [f64::from(u32::MAX) + 1.0, 0.0],
            [0.0, F64_EXACT as f64],
            [f64::NAN, 0.0],
            [0.0, f64::INFINITY],
        ] {
            assert!(CrcPart::from_f64s(bad).is_err(), "{bad:?}");
        }
    }

    /// Both readers fail on `bytes` with the same file error; returns it.
    fn same_error(p: &Path, bytes: &[u8]) -> String {
        std::fs::write(p, bytes).unwrap();
        let read = file_err(read_binary(p).unwrap_err(), p);
        let mapped = file_err(MappedBinary::open(p).unwrap_err(), p);
        assert_eq!(mapped, read);
        mapped
    }

    #[test]
    fn counts_the_header_makes_too_large_are_refused_before_allocating() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("wide.ktns");
        let t =
            SparseTensor::new(vec![4, 4, 4], vec![vec![1], vec![2], vec![3]], vec![1.0]).unwrap();
        write_binary(&p, &t).unwrap();
        let mut bytes = std::fs::read(&p).unwrap();
        // M = 3: the dimensions at 32..44, the header CRC at 48.
        for m in 0..3 {
            bytes[32 + 4 * m..36 + 4 * m].copy_from_slice(&u32::MAX.to_le_bytes());
        }
        let crc = crc32fast::hash(&bytes[..48]);
        bytes[48..52].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        // 3 x 2^32 rows of counts and one histogram: 128 GiB.
        let m = MappedBinary::open(&p).unwrap();
        let err = m.count_range(0..1).unwrap_err();
        assert!(matches!(err, FormatError::Memory(_)), "{err}");
        let text = err.to_string();
        assert!(
            text.starts_with(&p.display().to_string()) && text.contains("MemAvailable"),
            "{text}"
        );
    }

    #[test]
    fn header_errors_are_those_of_read_binary() {
        let (_dir, p, _) = written(5000);
        let bytes = std::fs::read(&p).unwrap();
        let full = bytes.len();
        let err = same_error(&p, &bytes[..full - 10]);
        assert!(
            err.contains(&format!(
                "truncated: expected {full} bytes, file has {}",
                full - 10
            )),
            "{err}"
        );
        assert!(same_error(&p, &bytes[..20]).contains("truncated"));
        assert!(same_error(&p, b"").contains("not a kruskal binary tensor (bad magic)"));
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0; 8]);
        assert!(same_error(&p, &longer).contains("unexpected trailing data"));

        let mut magic = bytes.clone();
        magic[0] = b'k';
        assert!(same_error(&p, &magic).contains("not a kruskal binary tensor (bad magic)"));
        let mut header = bytes.clone();
        header[33] ^= 0x10;
        assert!(same_error(&p, &header).contains("header checksum mismatch: file is corrupt"));
        let mut version = bytes.clone();
        version[8..12].copy_from_slice(&7u32.to_le_bytes());
        assert!(same_error(&p, &version).contains("written by a newer kruskal: version 7"));

        let missing = p.with_extension("none");
        assert!(matches!(
            MappedBinary::open(&missing),
            Err(FormatError::Io { .. })
        ));
    }

    #[test]
    fn invalid_nonzeros_are_errors_naming_the_file_and_the_nonzero() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.ktns");
        let t = SparseTensor::new(
            vec![3, 5],
            vec![vec![0, 1, 2, 2], vec![4, 4, 0, 1]],
            vec![1.0, 2.0, 3.0, 4.0],
        )
        .unwrap();
        write_binary(&p, &t).unwrap();
        let mut bytes = std::fs::read(&p).unwrap();
        // Shrink the mode-1 dimension below nonzeros 0 and 1's index 4 and
        // re-seal the header: M = 2, so D = 40.
        bytes[36..40].copy_from_slice(&4u32.to_le_bytes());
        let crc = crc32fast::hash(&bytes[..40]);
        bytes[40..44].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        let m = MappedBinary::open(&p).unwrap();
        m.verify_payload(&all_parts(&m, 2)).unwrap();
        let err = file_err(m.count_range(0..4).unwrap_err(), &p);
        assert!(
            err.contains("invalid tensor: nonzero 1: mode-1 index 4 is not below the dimension 4")
                || err.contains(
                    "invalid tensor: nonzero 0: mode-1 index 4 is not below the dimension 4"
                ),
            "{err}"
        );
        let err = file_err(m.count_range(1..2).unwrap_err(), &p);
        assert!(err.contains("nonzero 1: mode-1 index 4"), "{err}");
        // Nonzeros 2 and 3 are fine.
        let c = m.count_range(2..4).unwrap();
        assert_eq!(c.counts, vec![vec![0, 0, 2], vec![1, 1, 0, 0]]);
        assert_eq!(c.norm_sq, 25.0);
        assert_eq!(c.max_abs, 4.0);
        // The same file through read_binary names the same problem.
        let read = file_err(read_binary(&p).unwrap_err(), &p);
        assert!(
            read.contains("mode-1 index 4 is not below the dimension 4"),
            "{read}"
        );

        // A value that is not finite (the payload CRC no longer matches,
        // which count_range does not check).
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[36..40].copy_from_slice(&5u32.to_le_bytes());
        let crc = crc32fast::hash(&bytes[..40]);
        bytes[40..44].copy_from_slice(&crc.to_le_bytes());
        // Values start at H + 2 S = 48 + 2 * 16; nonzero 2 is 8 bytes on.
        bytes[80 + 8..80 + 12].copy_from_slice(&f32::NAN.to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        let m = MappedBinary::open(&p).unwrap();
        let err = file_err(m.count_range(0..4).unwrap_err(), &p);
        assert!(err.contains("nonzero 2: value NaN is not finite"), "{err}");
        assert!(m.count_range(0..2).is_ok());
    }
}
