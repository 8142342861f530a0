//! Mutation fuzzing of the tensor readers: valid `.tns`, `.tns.gz` and
//! `.ktns` files of small random tensors, damaged by random mutations
//! (bit flips, bytes set, inserted, deleted, duplicated, the end cut off,
//! and, for `.ktns`, the checksums sealed again so that damage reaches
//! the checks behind them), then read. Whatever the bytes, a reader must
//! return a valid tensor or one error naming the file, and never panic or
//! hang; an undamaged file must read back as written.
//!
//! Bounded for CI: `KRUSKAL_FUZZ_CASES` cases per property (default 256;
//! a few seconds). A longer run: `KRUSKAL_FUZZ_CASES=100000 cargo test
//! --release -p kruskal-formats --test fuzz_readers`. A failing case is
//! kept by proptest in `proptest-regressions/fuzz_readers.txt` (commit
//! it: it is replayed first on every run), and deserves a plain test of
//! its own beside the code it found wrong.

use std::collections::HashSet;
use std::path::Path;

use kruskal_formats::binary::write_binary;
use kruskal_formats::tns::write_tns;
use kruskal_formats::{FormatError, MappedBinary, ReadOptions, SparseTensor, read_tensor};
use proptest::prelude::*;
use proptest::sample::Index;

fn cases() -> u32 {
    std::env::var("KRUSKAL_FUZZ_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(256)
}

/// Values that stress the text and binary forms: whole numbers, tiny and
/// huge ones, negative zero, subnormals.
fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        (0u32..6).prop_map(|v| v as f32),
        -1e3f32..1e3f32,
        Just(-0.0f32),
        Just(f32::MAX),
        Just(-3.4e38f32),
        Just(1e-40f32),
        Just(f32::MIN_POSITIVE),
    ]
}

/// A small tensor of 1 to 4 modes (repeated coordinates summed).
fn tensor() -> impl Strategy<Value = SparseTensor> {
    (1usize..=4, 0usize..=40).prop_flat_map(|(nmodes, nnz)| {
        (
            proptest::collection::vec(1u32..=12, nmodes),
            proptest::collection::vec(proptest::collection::vec(any::<u32>(), nnz), nmodes),
            proptest::collection::vec(value(), nnz),
        )
            .prop_filter_map("repeats summed beyond f32", |(dims, raw, values)| {
                let indices = raw
                    .into_iter()
                    .zip(&dims)
                    .map(|(col, &d)| col.into_iter().map(|x| x % d).collect())
                    .collect();
                SparseTensor::new(dims, indices, values).ok()
            })
    })
}

/// One change to a file's bytes; positions are fractions of the length.
#[derive(Clone, Debug)]
enum Mutation {
    Flip(Index, u8),
    Set(Index, u8),
    Insert(Index, Vec<u8>),
    Delete(Index, usize),
    Duplicate(Index, usize),
    Truncate(Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    // Bytes that mean something to the readers.
    let byte = prop_oneof![
        any::<u8>(),
        Just(b' '),
        Just(b'\n'),
        Just(b'\r'),
        Just(b'#'),
        Just(b'-'),
        Just(b'.'),
        Just(b'e'),
        Just(b'0'),
        Just(b'9'),
        Just(0u8),
        Just(0xff),
    ];
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<Index>(), byte.clone()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<Index>(), proptest::collection::vec(byte, 1..8))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<Index>(), 1usize..16).prop_map(|(i, n)| Mutation::Delete(i, n)),
        (any::<Index>(), 1usize..64).prop_map(|(i, n)| Mutation::Duplicate(i, n)),
        any::<Index>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(bytes: &mut Vec<u8>, mutations: &[Mutation]) {
    for m in mutations {
        let len = bytes.len();
        let at = |i: &Index| if len == 0 { 0 } else { i.index(len) };
        match m {
            Mutation::Flip(i, bit) if len > 0 => bytes[at(i)] ^= 1 << bit,
            Mutation::Set(i, b) if len > 0 => bytes[at(i)] = *b,
            Mutation::Insert(i, new) => {
                let p = at(i);
                bytes.splice(p..p, new.iter().copied());
            }
            Mutation::Delete(i, n) if len > 0 => {
                let p = at(i);
                bytes.drain(p..(p + n).min(len));
            }
            Mutation::Duplicate(i, n) if len > 0 => {
                let p = at(i);
                let piece = bytes[p..(p + n).min(len)].to_vec();
                bytes.splice(p..p, piece);
            }
            Mutation::Truncate(i) => bytes.truncate(at(i)),
            _ => {}
        }
    }
}

/// A change that knows the `.ktns` layout: it edits nonzeros (their
/// coordinates, order and values) rather than bytes, to reach what the
/// checksums, once sealed again, no longer guard.
#[derive(Clone, Debug)]
enum Edit {
    /// Nonzero `to` takes nonzero `from`'s coordinate (a repeat).
    CopyCoordinate { from: Index, to: Index },
    /// Two nonzeros change places (out of coordinate order).
    Swap(Index, Index),
    /// One index set to a small number (perhaps beyond its dimension).
    SetIndex { mode: Index, k: Index, value: u32 },
    /// One value set to something a tensor cannot hold, or to a subnormal.
    SetValue { k: Index, value: f32 },
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<Index>(), any::<Index>()).prop_map(|(from, to)| Edit::CopyCoordinate { from, to }),
        (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Edit::Swap(a, b)),
        (any::<Index>(), any::<Index>(), 0u32..16).prop_map(|(mode, k, value)| Edit::SetIndex {
            mode,
            k,
            value
        }),
        (
            any::<Index>(),
            prop_oneof![
                Just(f32::NAN),
                Just(f32::INFINITY),
                Just(-f32::INFINITY),
                Just(1e-45f32),
                Just(f32::MAX),
            ]
        )
            .prop_map(|(k, value)| Edit::SetValue { k, value }),
    ]
}

/// Applies `edits` to the bytes of a `.ktns` of `nmodes` modes and `nnz`
/// nonzeros, as written (layout in `kruskal_formats::binary`).
fn apply_edits(bytes: &mut [u8], nmodes: usize, nnz: usize, edits: &[Edit]) {
    if nnz == 0 {
        return;
    }
    let payload = (32 + 4 * nmodes).div_ceil(8) * 8 + 8;
    let stride = (4 * nnz).div_ceil(8) * 8;
    let at = |array: usize, k: usize| payload + array * stride + 4 * k;
    for e in edits {
        match e {
            Edit::CopyCoordinate { from, to } => {
                let (from, to) = (from.index(nnz), to.index(nnz));
                for m in 0..nmodes {
                    let word: [u8; 4] = bytes[at(m, from)..at(m, from) + 4].try_into().unwrap();
                    bytes[at(m, to)..at(m, to) + 4].copy_from_slice(&word);
                }
            }
            Edit::Swap(a, b) => {
                let (a, b) = (a.index(nnz), b.index(nnz));
                for array in 0..=nmodes {
                    for j in 0..4 {
                        bytes.swap(at(array, a) + j, at(array, b) + j);
                    }
                }
            }
            Edit::SetIndex { mode, k, value } => {
                let (m, k) = (mode.index(nmodes), k.index(nnz));
                bytes[at(m, k)..at(m, k) + 4].copy_from_slice(&value.to_le_bytes());
            }
            Edit::SetValue { k, value } => {
                let k = k.index(nnz);
                bytes[at(nmodes, k)..at(nmodes, k) + 4].copy_from_slice(&value.to_le_bytes());
            }
        }
    }
}

/// Seals a damaged `.ktns`'s checksums again where its header still
/// allows (so damage behind them reaches the later checks).
fn reseal(bytes: &mut [u8]) {
    if bytes.len() < 16 {
        return;
    }
    let nmodes = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let crc_at = (32 + 4 * nmodes.min(1 << 20)).div_ceil(8) * 8;
    if crc_at + 8 > bytes.len() {
        return;
    }
    let payload = crc32fast::hash(&bytes[crc_at + 8..]);
    bytes[24..28].copy_from_slice(&payload.to_le_bytes());
    let header = crc32fast::hash(&bytes[..crc_at]);
    bytes[crc_at..crc_at + 4].copy_from_slice(&header.to_le_bytes());
}

/// A tensor the readers returned must keep the invariants every tensor
/// has: indices below their dimensions, finite values, no coordinate
/// twice, at most 64 modes.
fn assert_valid(t: &SparseTensor) {
    assert!((1..=64).contains(&t.nmodes()));
    let mut seen = HashSet::new();
    for k in 0..t.nnz() {
        let coord: Vec<u32> = (0..t.nmodes()).map(|m| t.mode_indices(m)[k]).collect();
        for (m, &i) in coord.iter().enumerate() {
            assert!(
                i < t.dims()[m],
                "nonzero {k}: mode {m} index {i} of {:?}",
                t.dims()
            );
        }
        assert!(t.values()[k].is_finite());
        assert!(seen.insert(coord), "nonzero {k} repeats a coordinate");
    }
}

/// An error must be one line that names the file (or say that memory is
/// short, which names it too).
fn assert_names(e: &FormatError, path: &Path) {
    let text = e.to_string();
    assert!(!text.contains('\n'), "{text}");
    assert!(
        text.starts_with(&path.display().to_string()),
        "an error that does not name the file: {text}"
    );
}

/// Reads `bytes` as the file `name` in `dir`, with `opts`.
fn read_bytes(dir: &Path, name: &str, bytes: &[u8], opts: &ReadOptions) {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    match read_tensor(&path, opts) {
        Ok(t) => assert_valid(&t),
        Err(e) => assert_names(&e, &path),
    }
}

/// The same tensor, in coordinate order (as `.ktns` stores it).
fn sorted(t: &SparseTensor) -> SparseTensor {
    let mut t = t.clone();
    let modes: Vec<usize> = (0..t.nmodes()).collect();
    t.sort_by_modes(&modes).unwrap();
    t
}

/// `cases()` cases; a failing one is kept in
/// `proptest-regressions/fuzz_readers.txt` and replayed first.
fn config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::Direct(
                "proptest-regressions/fuzz_readers.txt",
            ),
        )),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn text_files_survive_mutation(
        t in tensor(),
        mutations in proptest::collection::vec(mutation(), 0..5),
        zero_based in any::<bool>(),
        pattern in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let clean = dir.path().join("clean.tns");
        write_tns(&clean, &t, false).unwrap();
        let mut bytes = std::fs::read(&clean).unwrap();
        // (A tensor without nonzeros is an empty file, which is refused.)
        if mutations.is_empty() && t.nnz() > 0 {
            let back = read_tensor(&clean, &ReadOptions::default()).unwrap();
            prop_assert_eq!(back.nnz(), t.nnz());
            prop_assert_eq!(back.values(), t.values());
        }
        mutate(&mut bytes, &mutations);
        let opts = ReadOptions { zero_based, pattern, ..ReadOptions::default() };
        read_bytes(dir.path(), "t.tns", &bytes, &opts);
        // The same text through the gzip reader.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &bytes).unwrap();
        read_bytes(dir.path(), "t.tns.gz", &gz.finish().unwrap(), &opts);
    }

    #[test]
    fn gzip_streams_survive_mutation(
        t in tensor(),
        mutations in proptest::collection::vec(mutation(), 1..4),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let clean = dir.path().join("clean.tns.gz");
        write_tns(&clean, &t, true).unwrap();
        let mut bytes = std::fs::read(&clean).unwrap();
        mutate(&mut bytes, &mutations);
        read_bytes(dir.path(), "t.tns.gz", &bytes, &ReadOptions::default());
    }

    #[test]
    fn binary_files_survive_mutation(
        t in tensor(),
        edits in proptest::collection::vec(edit(), 0..3),
        mutations in proptest::collection::vec(mutation(), 0..3),
        sealed in any::<bool>(),
        parts in 1usize..4,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.ktns");
        write_binary(&path, &t).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        apply_edits(&mut bytes, t.nmodes(), t.nnz(), &edits);
        mutate(&mut bytes, &mutations);
        let mutations = [mutations.len(), edits.len()].iter().sum::<usize>();
        let mutations = vec![(); mutations];
        if sealed {
            reseal(&mut bytes);
        }
        std::fs::write(&path, &bytes).unwrap();
        let read = read_tensor(&path, &ReadOptions::default());
        match &read {
            Ok(back) => {
                assert_valid(back);
                if mutations.is_empty() {
                    prop_assert_eq!(back, &sorted(&t));
                }
            }
            Err(e) => {
                prop_assert!(!mutations.is_empty(), "an undamaged file failed: {}", e);
                assert_names(e, &path);
            }
        }
        // The mapped reader, as --distributed uses it: in parts.
        match MappedBinary::open(&path) {
            Ok(m) => {
                let nnz = m.nnz();
                let tiles: Vec<usize> = (0..=parts).map(|p| nnz * p / parts).collect();
                let mut ordered = true;
                let mut counted = Ok(());
                for w in tiles.windows(2) {
                    ordered &= m.in_order(w[0]..w[1]).unwrap();
                    if let Err(e) = m.count_range(w[0]..w[1]) {
                        assert_names(&e, &path);
                        counted = Err(());
                    }
                }
                let crcs: Vec<_> = (0..parts).map(|p| m.payload_crc_part(p, parts).unwrap()).collect();
                let verified = m.verify_payload(&crcs);
                if let Err(e) = &verified {
                    assert_names(e, &path);
                }
                // What the parts accept, the whole-file reader accepts,
                // with no repeat to sum.
                if ordered && counted.is_ok() && verified.is_ok() && m.distinct() {
                    let back = read.as_ref().expect("the parts accepted the file");
                    prop_assert_eq!(back.nnz(), nnz);
                }
            }
            Err(e) => assert_names(&e, &path),
        }
    }
}
