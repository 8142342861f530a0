//! Nonzeros per row of a mode: how often each value below a dimension
//! occurs in a mode's indices, on every thread, without atomics.
//!
//! A short mode is counted into one array of counters per thread, summed
//! row range by row range: each array stays in a core's cache. A long mode
//! (nell-1's 25.5M rows) would need an array per thread far larger than
//! the caches, and more memory than the tensor's indices: there each task
//! first sorts its chunk of indices by bucket (a range of
//! `1 << BUCKET_SHIFT` rows), and then each bucket's counters are added up by one task from
//! every chunk's part of that bucket, so each task writes only the rows of
//! its bucket, which stay in its cache. The buckets are filled a segment of
//! indices at a time, so the extra memory is bounded whatever the tensor.

use rayon::prelude::*;

/// A mode is counted by parts where each thread's counters take at most
/// this many bytes (nell-1's 2.9M-row mode: 11.6 MB, 0.04 s on 16 cores
/// against 0.14 s by buckets; its 25.5M-row mode, 102 MB a thread, takes
/// 0.12 s by buckets against 0.35 s by parts)...
const PART_BYTES: usize = 16 << 20;
/// ... and all threads' counters at most this many.
const PARTS_BYTES: usize = 256 << 20;
/// Rows per bucket, as a power of two: a bucket's `u64` counters (256 KiB)
/// stay in a core's L2 cache while its task adds them up.
const BUCKET_SHIFT: u32 = 15;
/// Indices put in buckets by one task.
const CHUNK: usize = 1 << 18;
/// Indices put in buckets before their counts are added up: the copy is 4
/// bytes per index, so at most 128 MiB.
const SEGMENT: usize = 1 << 25;

/// Occurrences of each value below `dim` in `indices` (length `dim`), or
/// the position in `indices` of the first value not below `dim`.
///
/// Cost: for a short mode one pass over `indices` and `dim` counters per
/// thread (at most 16 MiB each, 256 MiB in all; on one thread a single
/// array of `dim` counters, whatever its size); for a long one, two
/// passes over each chunk and one over its copy, the copy 4 bytes per
/// index of a segment (at most 128 MiB).
pub(crate) fn count_rows(indices: &[u32], dim: usize) -> Result<Vec<u64>, usize> {
    let threads = rayon::current_num_threads().max(1);
    let part = dim.saturating_mul(4);
    if threads == 1 || (part <= PART_BYTES && part.saturating_mul(threads) <= PARTS_BYTES) {
        by_parts(indices, dim, threads)
    } else {
        by_buckets(indices, dim)
    }
}

/// One `u32` counter array per part, summed row range by row range.
fn by_parts(indices: &[u32], dim: usize, parts: usize) -> Result<Vec<u64>, usize> {
    // A part shorter than `u32::MAX` cannot overflow its counters.
    let part_len = indices
        .len()
        .div_ceil(parts.max(1))
        .clamp(1, u32::MAX as usize);
    let counted = indices
        .par_chunks(part_len)
        .enumerate()
        .map(|(p, part)| {
            let mut counts = vec![0u32; dim];
            for (j, &i) in part.iter().enumerate() {
                match counts.get_mut(i as usize) {
                    Some(c) => *c += 1,
                    None => return Err(p * part_len + j),
                }
            }
            Ok(counts)
        })
        .collect::<Result<Vec<Vec<u32>>, usize>>()?;
    let mut total = vec![0u64; dim];
    total
        .par_chunks_mut(1 << 14)
        .enumerate()
        .for_each(|(c, out)| {
            let (lo, len) = (c << 14, out.len());
            for part in &counted {
                for (t, &x) in out.iter_mut().zip(&part[lo..lo + len]) {
                    *t += u64::from(x);
                }
            }
        });
    Ok(total)
}

/// A chunk's indices ordered by bucket: bucket `b`'s are
/// `sorted[starts[b]..starts[b + 1]]`. Kept from segment to segment, so
/// each segment writes into memory already mapped.
#[derive(Default)]
struct Bucketed {
    sorted: Vec<u32>,
    starts: Vec<usize>,
}

/// Each chunk's indices put in buckets, then each bucket's counters added
/// up by one task, a segment of indices at a time.
fn by_buckets(indices: &[u32], dim: usize) -> Result<Vec<u64>, usize> {
    let buckets = dim.div_ceil(1 << BUCKET_SHIFT).max(1);
    let mut total = vec![0u64; dim];
    let chunks = indices.len().min(SEGMENT).div_ceil(CHUNK);
    let mut bucketed: Vec<Bucketed> = (0..chunks).map(|_| Bucketed::default()).collect();
    for (s, segment) in indices.chunks(SEGMENT).enumerate() {
        let used = segment.len().div_ceil(CHUNK);
        segment
            .par_chunks(CHUNK)
            .zip(bucketed.par_iter_mut())
            .enumerate()
            .try_for_each(|(c, (chunk, into))| {
                bucket(chunk, dim, buckets, into).map_err(|j| s * SEGMENT + c * CHUNK + j)
            })?;
        let bucketed = &bucketed[..used];
        total
            .par_chunks_mut(1 << BUCKET_SHIFT)
            .enumerate()
            .for_each(|(b, out)| {
                let mask = (1u32 << BUCKET_SHIFT) - 1;
                for chunk in bucketed {
                    for &i in &chunk.sorted[chunk.starts[b]..chunk.starts[b + 1]] {
                        out[(i & mask) as usize] += 1;
                    }
                }
            });
    }
    Ok(total)
}

/// `chunk` ordered by bucket into `into` (a counting sort on
/// `index >> BUCKET_SHIFT`), or the position of its first index not below
/// `dim` (`into` is then left part written).
fn bucket(chunk: &[u32], dim: usize, buckets: usize, into: &mut Bucketed) -> Result<(), usize> {
    let starts = &mut into.starts;
    starts.clear();
    starts.resize(buckets + 1, 0);
    for (j, &i) in chunk.iter().enumerate() {
        if i as usize >= dim {
            return Err(j);
        }
        starts[(i >> BUCKET_SHIFT) as usize + 1] += 1;
    }
    for b in 0..buckets {
        starts[b + 1] += starts[b];
    }
    let mut next = starts[..buckets].to_vec();
    into.sorted.resize(chunk.len(), 0);
    for &i in chunk {
        let b = (i >> BUCKET_SHIFT) as usize;
        into.sorted[next[b]] = i;
        next[b] += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn naive(indices: &[u32], dim: usize) -> Vec<u64> {
        let mut c = vec![0u64; dim];
        for &i in indices {
            c[i as usize] += 1;
        }
        c
    }

    #[test]
    fn buckets_count_a_long_mode_across_segments_and_chunks() {
        // Longer than a segment, so two segments add into the same rows;
        // a dimension that is not a whole number of buckets; a hot row.
        let dim = 3 * (1 << BUCKET_SHIFT) + 17;
        let n = SEGMENT + CHUNK + 5;
        let mut x = 0x9e37_79b9_u64;
        let indices: Vec<u32> = (0..n)
            .map(|k| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if k % 5 == 0 {
                    7
                } else {
                    (x % dim as u64) as u32
                }
            })
            .collect();
        let want = naive(&indices, dim);
        assert_eq!(by_buckets(&indices, dim).unwrap(), want);
        assert_eq!(by_parts(&indices, dim, 3).unwrap(), want);
        assert_eq!(count_rows(&indices, dim).unwrap(), want);
    }

    #[test]
    fn an_index_past_the_dimension_is_found_at_its_position() {
        let dim = 5 * (1 << BUCKET_SHIFT);
        let mut indices = vec![3u32; SEGMENT + 2 * CHUNK];
        let bad = SEGMENT + CHUNK + 11;
        indices[bad] = dim as u32;
        indices[bad + 5] = u32::MAX;
        assert_eq!(by_buckets(&indices, dim), Err(bad));
        assert_eq!(by_parts(&indices, dim, 4), Err(bad));
        assert_eq!(by_parts(&indices[..40], 3, 2), Err(0));
    }

    proptest! {
        #[test]
        fn both_ways_count_what_a_loop_counts(
            dim in 1usize..(3 << BUCKET_SHIFT),
            raw in proptest::collection::vec(any::<u32>(), 0..3000),
            parts in 1usize..6,
        ) {
            let indices: Vec<u32> = raw.iter().map(|&r| r % dim as u32).collect();
            let want = naive(&indices, dim);
            prop_assert_eq!(by_buckets(&indices, dim).unwrap(), want.clone());
            prop_assert_eq!(by_parts(&indices, dim, parts).unwrap(), want.clone());
            prop_assert_eq!(count_rows(&indices, dim).unwrap(), want);
        }
    }
}
