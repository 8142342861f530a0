//! Writing FROSTT text, in parallel chunks (each its own gzip member when
//! compressed).

use std::io::Write;
use std::path::Path;

use flate2::Compression;
use flate2::write::GzEncoder;
use rayon::prelude::*;

use super::MAX_BATCH;
use crate::coo::SparseTensor;
use crate::error::{FormatError, Result};
use crate::io::write_atomically;

/// Nonzeros formatted per parallel work item when writing.
const WRITE_CHUNK: usize = 1 << 16;

/// Writes `t` as FROSTT text with 1-based indices, atomically (see
/// [`crate::io::write_tensor`]).
///
/// Values are printed in the shortest form that reads back as the same f32.
/// The text does not record dimensions: reading it back infers each as the
/// largest index plus one, unless
/// [`ReadOptions::dims`](crate::io::ReadOptions::dims) is given. A tensor
/// without nonzeros gives a file without data lines, which
/// [`read_tns`](super::read_tns) refuses.
///
/// With `gzip`, the text is compressed (default level) in independent
/// chunks on all threads, each a gzip member of its own: a multi-member file
/// that `gzip -d`, zlib's `gzread` and this crate's reader all read as one
/// stream, written several times faster than one sequential stream.
pub fn write_tns(path: &Path, t: &SparseTensor, gzip: bool) -> Result<()> {
    write_atomically(path, |w| write_text(path, t, gzip, w))
}

fn write_text(path: &Path, t: &SparseTensor, gzip: bool, w: &mut dyn Write) -> Result<()> {
    let io = |e| FormatError::io(path, e);
    let nnz = t.nnz();
    if nnz == 0 && gzip {
        // An empty file is not valid gzip; write one empty member.
        return w.write_all(&compress(&[]).map_err(io)?).map_err(io);
    }
    let per_batch = WRITE_CHUNK * rayon::current_num_threads().clamp(1, MAX_BATCH);
    let mut start = 0;
    while start < nnz {
        let end = (start + per_batch).min(nnz);
        let pieces: Vec<std::io::Result<Vec<u8>>> = (start..end)
            .into_par_iter()
            .step_by(WRITE_CHUNK)
            .map(|s| {
                let text = format_range(t, s, (s + WRITE_CHUNK).min(end));
                if gzip { compress(&text) } else { Ok(text) }
            })
            .collect();
        for piece in pieces {
            w.write_all(&piece.map_err(io)?).map_err(io)?;
        }
        start = end;
    }
    Ok(())
}

/// One gzip member holding `text`.
fn compress(text: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut enc = GzEncoder::new(
        Vec::with_capacity(text.len() / 3 + 64),
        Compression::default(),
    );
    enc.write_all(text)?;
    enc.finish()
}

/// The text of nonzeros `start..end`: 1-based indices, then the value.
fn format_range(t: &SparseTensor, start: usize, end: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity((end - start) * (8 * t.nmodes() + 12));
    // Indices are most of the text; itoa writes their digits into a stack
    // buffer without going through the formatting machinery.
    let mut digits = itoa::Buffer::new();
    for k in start..end {
        for idx in t.indices() {
            // Plus one in u64: index u32::MAX - 1 is written as 4294967295.
            out.extend_from_slice(digits.format(u64::from(idx[k]) + 1).as_bytes());
            out.push(b' ');
        }
        // Writing to a Vec cannot fail.
        let _ = write!(out, "{}", t.values()[k]);
        out.push(b'\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::Read;

    use flate2::read::MultiGzDecoder;
    use proptest::prelude::*;

    use super::*;
    use crate::io::ReadOptions;
    use crate::tns::test_util::{file_err, read};
    use crate::tns::{read_tns, read_tns_with};

    #[test]
    fn gzip_output_is_the_plain_text_in_members() {
        let dir = tempfile::tempdir().unwrap();
        let nnz = 3 * WRITE_CHUNK + 17;
        let t = SparseTensor::new(
            vec![1000, 7],
            vec![
                (0..nnz).map(|k| (k % 1000) as u32).collect(),
                (0..nnz).map(|k| (k % 7) as u32).collect(),
            ],
            (0..nnz).map(|k| k as f32 * 0.5).collect(),
        )
        .unwrap();
        let plain = dir.path().join("t.tns");
        let gz = dir.path().join("t.tns.gz");
        write_tns(&plain, &t, false).unwrap();
        write_tns(&gz, &t, true).unwrap();
        let mut text = Vec::new();
        MultiGzDecoder::new(File::open(&gz).unwrap())
            .read_to_end(&mut text)
            .unwrap();
        assert_eq!(text, std::fs::read(&plain).unwrap());
        assert_eq!(read(&gz).unwrap(), t);

        // No nonzeros: still a valid gzip file (of no text).
        let empty = SparseTensor::new(vec![2], vec![vec![]], vec![]).unwrap();
        let p = dir.path().join("e.tns.gz");
        write_tns(&p, &empty, true).unwrap();
        let mut text = Vec::new();
        MultiGzDecoder::new(File::open(&p).unwrap())
            .read_to_end(&mut text)
            .unwrap();
        assert!(text.is_empty());
        assert!(file_err(&p, &ReadOptions::default()).contains("no nonzeros"));
    }

    #[test]
    fn written_text_is_one_based_and_exact() {
        let dir = tempfile::tempdir().unwrap();
        let t = SparseTensor::new(
            vec![2, 3],
            vec![vec![0, 1], vec![2, 0]],
            vec![0.1, 16777217.0],
        )
        .unwrap();
        let p = dir.path().join("w.tns");
        write_tns(&p, &t, false).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "1 3 0.1\n2 1 16777216\n"
        );
    }

    #[test]
    fn written_indices_are_plain_decimals() {
        // Every digit count, the ends of each, and the largest index: the
        // same text as Rust's own formatting of the 1-based index.
        let mut idx: Vec<u32> = (0..10u32)
            .flat_map(|e| {
                let p = 10u64.pow(e);
                [p - 1, p, p + 1]
            })
            .filter_map(|v| u32::try_from(v).ok())
            .collect();
        idx.extend([u32::MAX - 2, u32::MAX - 1]);
        let n = idx.len();
        let t = SparseTensor::new(vec![u32::MAX], vec![idx.clone()], vec![1.0; n]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("i.tns");
        write_tns(&p, &t, false).unwrap();
        let want: String = t
            .mode_indices(0)
            .iter()
            .map(|&i| format!("{} 1\n", u64::from(i) + 1))
            .collect();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), want);
    }

    fn tensor_strategy() -> impl Strategy<Value = SparseTensor> {
        (1usize..=6, 1usize..200).prop_flat_map(|(nmodes, nnz)| {
            (
                proptest::collection::vec(1u32..50, nmodes),
                proptest::collection::vec(proptest::collection::vec(any::<u32>(), nnz), nmodes),
                proptest::collection::vec(
                    prop_oneof![
                        -1e30f32..1e30f32,
                        -10.0f32..10.0,
                        (-100i32..100).prop_map(|i| i as f32),
                        Just(f32::MIN_POSITIVE),
                        Just(f32::MAX),
                        Just(1e-45f32),
                    ],
                    nnz,
                ),
            )
                .prop_map(|(dims, raw, values)| {
                    let indices: Vec<Vec<u32>> = raw
                        .into_iter()
                        .zip(&dims)
                        .map(|(col, &d)| col.into_iter().map(|x| x % d).collect())
                        .collect();
                    // Repeated coordinates may sum beyond f32 (f32::MAX
                    // twice); clamped to 1e30, no 200 of them can. (Rejecting
                    // such draws instead could reject a whole shape's.)
                    SparseTensor::new(dims.clone(), indices.clone(), values.clone()).unwrap_or_else(
                        |_| {
                            let clamped = values.iter().map(|v| v.clamp(-1e30, 1e30)).collect();
                            SparseTensor::new(dims, indices, clamped).expect("sums within f32")
                        },
                    )
                })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn text_round_trip(t in tensor_strategy(), gz in any::<bool>()) {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join(if gz { "t.tns.gz" } else { "t.tns" });
            write_tns(&p, &t, gz).unwrap();
            let opts = ReadOptions {
                dims: Some(t.dims().to_vec()),
                allow_index_like_values: true,
                ..ReadOptions::default()
            };
            let back = read_tns_with(&p, &opts, Some(97)).unwrap();
            prop_assert_eq!(&back, &t);
            for (a, b) in back.values().iter().zip(t.values()) {
                prop_assert_eq!(a.to_bits(), b.to_bits());
            }
            // Without dims, each is the largest index + 1.
            let inferred = read_tns(&p, &ReadOptions {
                allow_index_like_values: true,
                ..ReadOptions::default()
            }).unwrap();
            let want: Vec<u32> =
                t.indices().iter().map(|c| c.iter().max().unwrap() + 1).collect();
            prop_assert_eq!(inferred.dims(), &want[..]);
        }
    }
}
