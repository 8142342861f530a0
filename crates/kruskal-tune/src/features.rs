//! Tensor features for choosing a GPU engine and its launch parameters
//! (ScalFrag, CLUSTER'24, section IV-B: slices, fibers, their ratios, the
//! largest and mean nonzeros per slice and per fiber, and how skewed the
//! nonzeros are).
//!
//! Definitions, for output mode `n` of a tensor with `nnz` stored nonzeros
//! (duplicates count as stored):
//!
//! - **slice**: an index `i` of mode `n` that holds at least one nonzero
//!   (an output row of the mode's MTTKRP).
//! - **fiber**: a distinct pair `(i_n, i_f)`, where `f` is the mode's *fiber
//!   mode*: the other mode with the smallest dimension (ties go to the lower
//!   mode). This is the second level of a CSF tree rooted at `n` (SPLATT's
//!   fibers) and exactly the run of nonzeros over which `fcoo`, which sorts
//!   by `(i_n, i_f)`, reuses one row of the fiber mode's factor. Counting
//!   pairs instead of the full `(N-1)`-tuples keeps the cost to one 64-bit
//!   key per nonzero, whatever the number of modes. A one-mode tensor's
//!   fibers are its slices.
//! - **skew**: the largest over the mean nonzeros per slice (and per
//!   fiber), their coefficient of variation (standard deviation over mean),
//!   and the Gini coefficient of the slice sizes (0 when every slice holds
//!   as many nonzeros, towards 1 when one slice holds them all). Means,
//!   deviations and Gini are over non-empty slices and fibers; empty slices
//!   show in `slice_ratio`.
//!
//! Every ratio with a zero denominator is 0, so features are always finite.
//!
//! ```
//! use kruskal_formats::SparseTensor;
//! use kruskal_tune::TensorFeatures;
//!
//! // 3 x 2 x 2, four nonzeros.
//! let t = SparseTensor::new(
//!     vec![3, 2, 2],
//!     vec![vec![0, 0, 0, 2], vec![0, 1, 1, 0], vec![0, 0, 1, 1]],
//!     vec![1.0; 4],
//! )
//! .unwrap();
//! let f = TensorFeatures::compute(&t);
//! assert_eq!(f.modes[0].slices, 2); // indices 0 and 2
//! assert_eq!(f.modes[0].fiber_mode, Some(1)); // mode 2 (dim 2, before mode 3)
//! assert_eq!(f.modes[0].fibers, 3); // (0,0), (0,1), (2,0)
//! assert_eq!(f.modes[0].max_nnz_per_fiber, 2); // (0,1) holds two
//! assert_eq!(f.mode_vector(0).len(), TensorFeatures::MODE_VECTOR_NAMES.len());
//! ```

use std::sync::{Mutex, PoisonError};

use rayon::prelude::*;

use kruskal_formats::SparseTensor;

/// The features of one output mode (see the module documentation for the
/// definitions).
#[derive(Clone, Debug, PartialEq)]
pub struct ModeFeatures {
    /// The mode, from 0.
    pub mode: usize,
    pub dim: u32,
    /// The mode paired with this one to form fibers; `None` for a one-mode
    /// tensor.
    pub fiber_mode: Option<usize>,
    /// Non-empty indices of the mode.
    pub slices: u64,
    /// Distinct `(i_mode, i_fiber_mode)` pairs.
    pub fibers: u64,
    /// `slices / dim`: the share of the mode's indices that hold nonzeros.
    pub slice_ratio: f64,
    /// `fibers / slices`: mean fibers per slice.
    pub fibers_per_slice: f64,
    pub max_fibers_per_slice: u64,
    /// `nnz / slices`: mean nonzeros per slice.
    pub nnz_per_slice: f64,
    pub max_nnz_per_slice: u64,
    /// `nnz / fibers`: mean nonzeros per fiber (factor-row reuse in `fcoo`).
    pub nnz_per_fiber: f64,
    pub max_nnz_per_fiber: u64,
    /// `max_nnz_per_slice / nnz_per_slice`.
    pub slice_skew: f64,
    /// Coefficient of variation of the slice sizes.
    pub slice_cv: f64,
    /// Gini coefficient of the slice sizes, in `[0, 1)`.
    pub slice_gini: f64,
    /// `max_nnz_per_fiber / nnz_per_fiber`.
    pub fiber_skew: f64,
    /// Coefficient of variation of the fiber sizes.
    pub fiber_cv: f64,
    /// `max_nnz_per_slice / nnz`: the hottest slice's share of the tensor.
    pub hot_share: f64,
}

/// The features of a tensor: global ones and one [`ModeFeatures`] per mode.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorFeatures {
    pub dims: Vec<u32>,
    /// Stored nonzeros.
    pub nnz: u64,
    /// `nnz / prod(dims)`.
    pub density: f64,
    pub modes: Vec<ModeFeatures>,
}

/// `a / b`, or 0 when `b` is 0.
fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { 0.0 } else { a / b }
}

/// Coefficient of variation from a count, a sum and a sum of squares.
fn cv(count: f64, sum: f64, sum_sq: f64) -> f64 {
    let mean = ratio(sum, count);
    let var = (ratio(sum_sq, count) - mean * mean).max(0.0);
    ratio(var.sqrt(), mean)
}

/// The fiber mode of `mode`: the other mode with the smallest dimension,
/// the lower one on ties (the order `fcoo` sorts by).
pub fn fiber_mode(dims: &[u32], mode: usize) -> Option<usize> {
    (0..dims.len())
        .filter(|&w| w != mode)
        .min_by_key(|&w| (dims[w], w))
}

/// What the features of one mode are computed from.
#[derive(Clone, Debug, Default, PartialEq)]
struct ModeCounts {
    slices: u64,
    max_slice: u64,
    /// Sum of the squared slice sizes.
    slice_sq: f64,
    slice_gini: f64,
    fibers: u64,
    max_fiber: u64,
    /// Sum of the squared fiber sizes.
    fiber_sq: f64,
    max_fibers_per_slice: u64,
}

/// Slice sizes below this are counted in a histogram (for the Gini
/// coefficient); larger ones, at most `nnz / SMALL_SIZES` of them, are
/// listed and sorted.
const SMALL_SIZES: usize = 1024;

/// Slice and fiber statistics of some slices, in exact integers.
#[derive(Clone)]
struct Tally {
    slices: u64,
    nnz: u64,
    max_slice: u64,
    slice_sq: u128,
    /// `small[s]`: slices of `s` nonzeros, for `s < SMALL_SIZES`.
    small: Vec<u64>,
    /// Sizes of the other slices, unordered.
    large: Vec<u64>,
    fibers: u64,
    max_fiber: u64,
    fiber_sq: u128,
    max_fibers_per_slice: u64,
}

impl Tally {
    fn new() -> Self {
        Tally {
            slices: 0,
            nnz: 0,
            max_slice: 0,
            slice_sq: 0,
            small: vec![0; SMALL_SIZES],
            large: Vec::new(),
            fibers: 0,
            max_fiber: 0,
            fiber_sq: 0,
            max_fibers_per_slice: 0,
        }
    }

    /// A non-empty slice of `size` nonzeros in `fibers` fibers.
    fn slice(&mut self, size: u64, fibers: u64) {
        self.slices += 1;
        self.nnz += size;
        self.max_slice = self.max_slice.max(size);
        self.slice_sq += u128::from(size) * u128::from(size);
        match self.small.get_mut(size as usize) {
            Some(count) => *count += 1,
            None => self.large.push(size),
        }
        self.fibers += fibers;
        self.max_fibers_per_slice = self.max_fibers_per_slice.max(fibers);
    }

    /// A fiber of `len` nonzeros (its slice is added by [`Tally::slice`]).
    fn fiber(&mut self, len: u64) {
        self.max_fiber = self.max_fiber.max(len);
        self.fiber_sq += u128::from(len) * u128::from(len);
    }

    fn merge(mut self, mut other: Tally) -> Tally {
        self.slices += other.slices;
        self.nnz += other.nnz;
        self.max_slice = self.max_slice.max(other.max_slice);
        self.slice_sq += other.slice_sq;
        for (a, b) in self.small.iter_mut().zip(&other.small) {
            *a += b;
        }
        self.large.append(&mut other.large);
        self.fibers += other.fibers;
        self.max_fiber = self.max_fiber.max(other.max_fiber);
        self.fiber_sq += other.fiber_sq;
        self.max_fibers_per_slice = self.max_fibers_per_slice.max(other.max_fibers_per_slice);
        self
    }

    /// Gini coefficient of the slice sizes: with the `n` sizes sorted
    /// ascending, `sum_i (2i - n - 1) x_i / (n sum x)` for `i = 1..=n`,
    /// the numerator summed exactly over runs of equal sizes (a run of `c`
    /// sizes `x` after `r` smaller ones adds `x (c r + c (c + 1) / 2)` to
    /// `sum_i i x_i`).
    fn gini(&mut self) -> f64 {
        self.large.sort_unstable();
        let small = self.small.iter().enumerate().filter(|&(_, &c)| c > 0);
        let large = self.large.chunk_by(|a, b| a == b);
        let runs = small
            .map(|(size, &count)| (size as u128, u128::from(count)))
            .chain(large.map(|run| (u128::from(run[0]), run.len() as u128)));
        let (mut rank, mut ranked) = (0u128, 0u128);
        for (size, count) in runs {
            ranked += size * (count * rank + count * (count + 1) / 2);
            rank += count;
        }
        let (n, total) = (i128::from(self.slices), i128::from(self.nnz));
        let weighted = 2 * ranked as i128 - (n + 1) * total;
        ratio(weighted as f64, n as f64 * total as f64)
    }

    fn counts(mut self) -> ModeCounts {
        ModeCounts {
            slices: self.slices,
            max_slice: self.max_slice,
            slice_sq: self.slice_sq as f64,
            slice_gini: self.gini(),
            fibers: self.fibers,
            max_fiber: self.max_fiber,
            fiber_sq: self.fiber_sq as f64,
            max_fibers_per_slice: self.max_fibers_per_slice,
        }
    }
}

/// The most slice ranges (buckets) the nonzeros of a mode are cut into: a
/// chunk of nonzeros writes to this many places at once, few enough to stay
/// in cache and in the TLB.
const MAX_BUCKETS: u64 = 256;

/// One thread's working arrays for [`count_mode`].
struct Scratch {
    /// Nonzeros per fiber-mode index in the current slice; all 0 between
    /// slices (the indices set are listed in `touched`).
    per_fiber: Vec<u32>,
    touched: Vec<u32>,
    /// Per slice of the current bucket: its nonzero count, then its start
    /// in `grouped`, then its end.
    starts: Vec<u32>,
    /// The current bucket's fiber-mode indices, grouped by slice.
    grouped: Vec<u32>,
    tally: Tally,
}

impl Scratch {
    fn new() -> Self {
        Scratch {
            per_fiber: Vec::new(),
            touched: Vec::new(),
            starts: Vec::new(),
            grouped: Vec::new(),
            tally: Tally::new(),
        }
    }

    /// Makes room for counters of `fiber_dim` fiber-mode indices.
    fn ready(&mut self, fiber_dim: usize) {
        if self.per_fiber.len() < fiber_dim {
            self.per_fiber.resize(fiber_dim, 0);
        }
    }

    /// Counts the fibers of one non-empty slice from its nonzeros'
    /// fiber-mode indices (all below `per_fiber.len()`).
    fn count_slice(&mut self, fiber_indices: &[u32]) {
        // Every index is written to the list, which only grows past a new
        // one: no branch to mispredict on fibers seen before. Its writes
        // stay below the distinct indices seen, at most `per_fiber.len()`.
        let room = fiber_indices.len().min(self.per_fiber.len() + 1);
        if self.touched.len() < room {
            self.touched.resize(room, 0);
        }
        let mut fibers = 0;
        for &j in fiber_indices {
            let count = &mut self.per_fiber[j as usize];
            self.touched[fibers] = j;
            fibers += usize::from(*count == 0);
            *count += 1;
        }
        for &j in &self.touched[..fibers] {
            let len = std::mem::take(&mut self.per_fiber[j as usize]);
            self.tally.fiber(u64::from(len));
        }
        self.tally.slice(fiber_indices.len() as u64, fibers as u64);
    }

    /// Counts the slices and fibers of a bucket: `keys` (at most
    /// `u32::MAX` of them) of the slices `first..first + width`, grouped
    /// by slice with a counting sort.
    fn count_bucket(&mut self, keys: &[u64], first: u64, width: usize) {
        let slice_of = |k: u64| ((k >> 32) - first) as usize;
        self.starts.clear();
        self.starts.resize(width + 1, 0);
        for &k in keys {
            self.starts[slice_of(k) + 1] += 1;
        }
        for s in 1..=width {
            self.starts[s] += self.starts[s - 1];
        }
        self.grouped.resize(keys.len(), 0);
        for &k in keys {
            let at = &mut self.starts[slice_of(k)];
            self.grouped[*at as usize] = k as u32;
            *at += 1;
        }
        // `starts[s]` is now the end of slice `s`, the start of `s + 1`.
        let grouped = std::mem::take(&mut self.grouped);
        let mut start = 0;
        for s in 0..width {
            let end = self.starts[s] as usize;
            if end > start {
                self.count_slice(&grouped[start..end]);
            }
            start = end;
        }
        self.grouped = grouped;
    }

    /// Counts the slices and fibers of a bucket by sorting its keys.
    fn sort_bucket(&mut self, keys: &mut [u64]) {
        keys.sort_unstable();
        for slice in keys.chunk_by(|a, b| a >> 32 == b >> 32) {
            let mut fibers = 0;
            for fiber in slice.chunk_by(|a, b| a == b) {
                self.tally.fiber(fiber.len() as u64);
                fibers += 1;
            }
            self.tally.slice(slice.len() as u64, fibers);
        }
    }
}

/// `keys`, shared by the tasks that scatter into it, each to its own
/// positions.
struct Scatter(*mut u64);

// SAFETY: `Scatter::write` is only called at positions that no other task
// writes and nobody reads until the scatter ends (see `partition`).
unsafe impl Sync for Scatter {}

impl Scatter {
    /// # Safety
    /// `at` is in bounds of the array and no other thread accesses it
    /// during the call.
    unsafe fn write(&self, at: usize, key: u64) {
        // SAFETY: as the caller promises.
        unsafe { *self.0.add(at) = key }
    }
}

/// Writes the key of each nonzero (`rows` and `fibers`) at `at[bucket]` of
/// `out`, and advances it.
///
/// # Safety
/// The positions written are in bounds of `out` and no other thread
/// accesses them during the call.
unsafe fn scatter(
    rows: &[u32],
    fibers: impl Iterator<Item = u32>,
    shift: u32,
    at: &mut [usize],
    out: &Scatter,
) {
    for (&i, j) in rows.iter().zip(fibers) {
        let b = (i >> shift) as usize;
        // SAFETY: as the caller promises.
        unsafe { out.write(at[b], (u64::from(i) << 32) | u64::from(j)) };
        at[b] += 1;
    }
}

/// The `(i_mode << 32) | i_fiber` keys of the nonzeros (`i_fiber` 0
/// without a fiber mode), grouped by bucket (`i_mode >> shift`): a
/// parallel counting sort over chunks of nonzeros. Returns the keys and
/// each bucket's key count.
fn partition(
    t: &SparseTensor,
    mode: usize,
    fiber: Option<usize>,
    shift: u32,
    keys: &mut Vec<u64>,
) -> Vec<usize> {
    let rows = t.mode_indices(mode);
    let nnz = rows.len();
    let buckets = (u64::from(t.dims()[mode]) >> shift) as usize + 1;
    let chunk = nnz
        .div_ceil(4 * rayon::current_num_threads().max(1))
        .max(1 << 16);
    // Keys per chunk and bucket, then the position of each chunk's first
    // key in each bucket.
    let mut at: Vec<Vec<usize>> = rows
        .par_chunks(chunk)
        .map(|part| {
            let mut counts = vec![0usize; buckets];
            for &i in part {
                counts[(i >> shift) as usize] += 1;
            }
            counts
        })
        .collect();
    let mut sizes = vec![0usize; buckets];
    let mut next = 0;
    for (b, size) in sizes.iter_mut().enumerate() {
        let first = next;
        for counts in at.iter_mut() {
            let count = counts[b];
            counts[b] = next;
            next += count;
        }
        *size = next - first;
    }
    if keys.len() != nnz {
        // Zeroed by the system as first written, not by a pass.
        *keys = vec![0u64; nnz];
    }
    let out = Scatter(keys.as_mut_ptr());
    let fibers = fiber.map(|f| t.mode_indices(f));
    at.par_iter_mut().enumerate().for_each(|(c, at)| {
        let part = c * chunk..((c + 1) * chunk).min(nnz);
        let rows = &rows[part.clone()];
        // SAFETY: chunk `c` writes bucket `b`'s positions from where the
        // chunks before it end (`at[b]`) to where the chunks after it
        // start: its own, each once, and all below `nnz` (the counts sum
        // to `nnz`).
        unsafe {
            match fibers {
                Some(fibers) => scatter(rows, fibers[part].iter().copied(), shift, at, &out),
                None => scatter(rows, std::iter::repeat(0), shift, at, &out),
            }
        }
    });
    sizes
}

/// Slices and fibers of `mode` (see [`TensorFeatures::compute`]).
fn count_mode(
    t: &SparseTensor,
    mode: usize,
    fiber: Option<usize>,
    keys: &mut Vec<u64>,
) -> ModeCounts {
    let fiber_dim = fiber.map_or(1, |f| t.dims()[f] as usize);
    let threads = rayon::current_num_threads().max(1);
    // Per thread, 4 bytes per fiber-mode index for the counters and 4 for
    // the list of those set.
    let dense = fiber_dim.saturating_mul(8 * threads) <= (64usize << 20).max(2 * t.nnz());
    count_mode_by(t, mode, fiber, dense, keys)
}

/// [`count_mode`], counting fibers with dense counters over the fiber mode
/// where `dense` (and a bucket's slices are not too sparse), by sorting
/// each bucket otherwise.
fn count_mode_by(
    t: &SparseTensor,
    mode: usize,
    fiber: Option<usize>,
    dense: bool,
    keys: &mut Vec<u64>,
) -> ModeCounts {
    let nnz = t.nnz();
    if nnz == 0 {
        return Tally::new().counts();
    }
    let fiber_dim = fiber.map_or(1, |f| t.dims()[f] as usize);
    let rows = t.mode_indices(mode);
    if let Some(f) = fiber.filter(|_| dense && rows.par_windows(2).all(|w| w[0] <= w[1])) {
        // Already grouped by slice (a tensor in coordinate order, mode 0):
        // chunks of whole slices, cut where a nominal start's slice ends.
        let chunks = (nnz >> 16).clamp(1, 4 * rayon::current_num_threads().max(1));
        let mut bounds: Vec<usize> = (0..chunks)
            .map(|c| match c * nnz / chunks {
                0 => 0,
                start => rows.partition_point(|&i| i <= rows[start - 1]),
            })
            .collect();
        bounds.push(nnz);
        bounds.dedup();
        let fibers = t.mode_indices(f);
        return tally_tasks(bounds.par_windows(2), |s, w| {
            s.ready(fiber_dim);
            let mut start = w[0];
            for run in rows[w[0]..w[1]].chunk_by(|a, b| a == b) {
                s.count_slice(&fibers[start..start + run.len()]);
                start += run.len();
            }
        });
    }
    let dim = u64::from(t.dims()[mode]);
    let shift = (0..32).find(|&s| dim >> s < MAX_BUCKETS).unwrap_or(32);
    let width = 1usize << shift;
    let sizes = partition(t, mode, fiber, shift, keys);
    let mut buckets = Vec::new();
    let mut rest = keys.as_mut_slice();
    for (b, &size) in sizes.iter().enumerate() {
        let (bucket, tail) = rest.split_at_mut(size);
        if size > 0 {
            buckets.push(((b as u64) << shift, bucket));
        }
        rest = tail;
    }
    tally_tasks(buckets.into_par_iter(), |s, (first, keys)| {
        if dense && keys.len() <= u32::MAX as usize && width <= keys.len() {
            s.ready(fiber_dim);
            s.count_bucket(keys, first, width);
        } else {
            s.sort_bucket(keys);
        }
    })
}

/// Runs `task` on every item of `tasks` in parallel, each with its
/// thread's [`Scratch`], and sums their tallies.
fn tally_tasks<I: ParallelIterator>(
    tasks: I,
    task: impl Fn(&mut Scratch, I::Item) + Sync,
) -> ModeCounts {
    let threads = rayon::current_num_threads().max(1);
    let scratch: Vec<Mutex<Scratch>> = (0..threads).map(|_| Mutex::new(Scratch::new())).collect();
    tasks.for_each(|item| {
        let slot = rayon::current_thread_index().unwrap_or(0) % scratch.len();
        let mut s = scratch[slot].lock().unwrap_or_else(PoisonError::into_inner);
        task(&mut s, item);
    });
    scratch
        .into_iter()
        .map(|s| s.into_inner().unwrap_or_else(PoisonError::into_inner).tally)
        .reduce(Tally::merge)
        .map_or_else(|| Tally::new().counts(), Tally::counts)
}

impl TensorFeatures {
    /// Names of the columns of [`TensorFeatures::mode_vector`], in order.
    pub const MODE_VECTOR_NAMES: &'static [&'static str] = &[
        "nmodes",
        "nnz",
        "density",
        "dim",
        "slices",
        "fibers",
        "slice_ratio",
        "fibers_per_slice",
        "max_fibers_per_slice",
        "nnz_per_slice",
        "max_nnz_per_slice",
        "nnz_per_fiber",
        "max_nnz_per_fiber",
        "slice_skew",
        "slice_cv",
        "slice_gini",
        "fiber_skew",
        "fiber_cv",
        "hot_share",
        "fiber_dim",
        "other_rows",
        "max_other_dim",
    ];

    /// Computes every feature of `t`.
    ///
    /// How, per mode (no full sort; the counts are exact integers):
    ///
    /// 1. **Grouping by slice.** A mode whose indices are already in
    ///    order (mode 0 of a tensor in coordinate order) is grouped as it
    ///    is, where the dense counters below are used. Otherwise one parallel counting sort over chunks of nonzeros
    ///    cuts the `(i_mode << 32) | i_fiber` keys into at most 256 ranges
    ///    of `width` slices (a power of two), and each range is grouped by
    ///    slice by a counting sort of its own (`width` counters) on the
    ///    thread that takes it.
    /// 2. **Fibers of a slice**: its nonzeros' fiber-mode indices counted
    ///    into one dense counter per fiber-mode index (per thread, reset
    ///    through the list of those set), which gives the slice's fibers,
    ///    their sizes, the largest and the sum of squares.
    /// 3. **Gini coefficient**: from a histogram of the slice sizes below
    ///    1024 and a sort of the larger ones (at most `nnz / 1024`).
    ///
    /// Where the dense counters would take more than the larger of 64 MiB
    /// and 2 bytes per nonzero over all threads (8 bytes per fiber-mode
    /// index and thread: nell-1's 2.1 million on 16 threads take 270 MB),
    /// and for a range of fewer nonzeros than `width` slices (a dimension
    /// larger than the nonzero count), the range's keys are sorted instead
    /// and read as runs.
    ///
    /// Memory: 8 bytes per nonzero for the keys (one array for all modes,
    /// as the sorting this replaced needed), the dense counters above, and
    /// per thread 4 bytes per nonzero of the largest range it has grouped
    /// plus `4 width` bytes (about `threads / 128` of 4 bytes per nonzero
    /// when the nonzeros are spread over the ranges; at most 8 bytes per
    /// nonzero more in all when one range holds them all). A slice is
    /// counted by one thread, so a slice holding much of the tensor is a
    /// sequential pass over its nonzeros. Time measured: see
    /// `docs/performance.md` (the tuning model's features).
    pub fn compute(t: &SparseTensor) -> TensorFeatures {
        let nnz = t.nnz() as u64;
        // One key array for every mode.
        let mut keys = Vec::new();
        let modes = (0..t.nmodes())
            .map(|mode| {
                let fiber_mode = fiber_mode(t.dims(), mode);
                let counts = count_mode(t, mode, fiber_mode, &mut keys);
                Self::mode_features(t, mode, fiber_mode, &counts)
            })
            .collect();
        TensorFeatures {
            dims: t.dims().to_vec(),
            nnz,
            density: t.density(),
            modes,
        }
    }

    /// The features of `mode` from its counts.
    fn mode_features(
        t: &SparseTensor,
        mode: usize,
        fiber_mode: Option<usize>,
        c: &ModeCounts,
    ) -> ModeFeatures {
        let nnz = t.nnz() as f64;
        let dim = t.dims()[mode];
        let slices = c.slices as f64;
        let fibers = c.fibers as f64;
        let nnz_per_slice = ratio(nnz, slices);
        let nnz_per_fiber = ratio(nnz, fibers);
        ModeFeatures {
            mode,
            dim,
            fiber_mode,
            slices: c.slices,
            fibers: c.fibers,
            slice_ratio: ratio(slices, f64::from(dim)),
            fibers_per_slice: ratio(fibers, slices),
            max_fibers_per_slice: c.max_fibers_per_slice,
            nnz_per_slice,
            max_nnz_per_slice: c.max_slice,
            nnz_per_fiber,
            max_nnz_per_fiber: c.max_fiber,
            slice_skew: ratio(c.max_slice as f64, nnz_per_slice),
            slice_cv: cv(slices, nnz, c.slice_sq),
            slice_gini: c.slice_gini,
            fiber_skew: ratio(c.max_fiber as f64, nnz_per_fiber),
            fiber_cv: cv(fibers, nnz, c.fiber_sq),
            hot_share: ratio(c.max_slice as f64, nnz),
        }
    }

    pub fn nmodes(&self) -> usize {
        self.dims.len()
    }

    /// The feature vector of output mode `mode` for a model: the global
    /// features, the mode's own, and three of its context (the fiber mode's
    /// dimension, the factor rows of the other modes, and the largest other
    /// dimension), named by [`TensorFeatures::MODE_VECTOR_NAMES`]. Counts
    /// are given as they are (trees do not care about scale).
    ///
    /// Panics if `mode` is not below the number of modes.
    pub fn mode_vector(&self, mode: usize) -> Vec<f64> {
        let m = &self.modes[mode];
        let others = || {
            self.dims
                .iter()
                .enumerate()
                .filter(move |&(w, _)| w != mode)
                .map(|(_, &d)| f64::from(d))
        };
        vec![
            self.nmodes() as f64,
            self.nnz as f64,
            self.density,
            f64::from(m.dim),
            m.slices as f64,
            m.fibers as f64,
            m.slice_ratio,
            m.fibers_per_slice,
            m.max_fibers_per_slice as f64,
            m.nnz_per_slice,
            m.max_nnz_per_slice as f64,
            m.nnz_per_fiber,
            m.max_nnz_per_fiber as f64,
            m.slice_skew,
            m.slice_cv,
            m.slice_gini,
            m.fiber_skew,
            m.fiber_cv,
            m.hot_share,
            m.fiber_mode.map_or(0.0, |f| f64::from(self.dims[f])),
            others().sum(),
            others().fold(0.0, f64::max),
        ]
    }
}

/// The implementation [`count_mode`] replaced, kept to test it against:
/// one parallel sort of the `(i_mode, i_fiber)` keys per mode and one of
/// the slice sizes.
#[cfg(test)]
mod reference {
    use rayon::prelude::*;

    use kruskal_formats::SparseTensor;

    use super::{ModeCounts, ratio};

    /// Gini coefficient of non-negative sizes: with the sizes sorted
    /// ascending, `sum_i (2i - n - 1) x_i / (n sum x)` for `i = 1..=n`.
    ///
    /// Cost: one parallel sort of the sizes.
    fn gini(mut sizes: Vec<u64>) -> f64 {
        let n = sizes.len();
        if n == 0 {
            return 0.0;
        }
        sizes.par_sort_unstable();
        let total: f64 = sizes.par_iter().map(|&x| x as f64).sum();
        let weighted: f64 = sizes
            .par_iter()
            .enumerate()
            .map(|(i, &x)| (2.0 * (i + 1) as f64 - n as f64 - 1.0) * x as f64)
            .sum();
        ratio(weighted, n as f64 * total)
    }

    /// Slice and fiber statistics of a run of whole slices in the sorted
    /// pair keys.
    #[derive(Clone, Default)]
    struct Scan {
        /// Size of every slice, in key order.
        slice_sizes: Vec<u64>,
        fibers: u64,
        max_fiber: u64,
        fiber_sq: f64,
        max_fibers_per_slice: u64,
    }

    impl Scan {
        /// Scans sorted keys (slice in the high 32 bits); `keys` starts at a
        /// slice boundary and ends at one.
        fn new(keys: &[u64]) -> Self {
            let mut s = Scan::default();
            let mut k = 0;
            while k < keys.len() {
                let (slice, slice_start) = (keys[k] >> 32, k);
                let mut fibers = 0u64;
                while k < keys.len() && keys[k] >> 32 == slice {
                    let (key, start) = (keys[k], k);
                    while k < keys.len() && keys[k] == key {
                        k += 1;
                    }
                    let len = (k - start) as u64;
                    fibers += 1;
                    s.max_fiber = s.max_fiber.max(len);
                    s.fiber_sq += (len as f64) * (len as f64);
                }
                s.fibers += fibers;
                s.max_fibers_per_slice = s.max_fibers_per_slice.max(fibers);
                s.slice_sizes.push((k - slice_start) as u64);
            }
            s
        }

        /// `a` then `b` (slice sizes stay in key order).
        fn merge(mut a: Self, mut b: Self) -> Self {
            a.slice_sizes.append(&mut b.slice_sizes);
            Scan {
                slice_sizes: a.slice_sizes,
                fibers: a.fibers + b.fibers,
                max_fiber: a.max_fiber.max(b.max_fiber),
                fiber_sq: a.fiber_sq + b.fiber_sq,
                max_fibers_per_slice: a.max_fibers_per_slice.max(b.max_fibers_per_slice),
            }
        }
    }

    /// Slices and fibers of `mode`: one parallel sort of `(i_mode, i_fiber)`
    /// keys (`i_fiber` 0 without a fiber mode), then a parallel scan over
    /// chunks cut at slice boundaries. Slice sizes come from the same keys, so
    /// a mode of a huge dimension costs no per-index counters.
    fn scan_mode(t: &SparseTensor, mode: usize, fiber: Option<usize>) -> Scan {
        let rows = t.mode_indices(mode);
        let mut keys: Vec<u64> = match fiber {
            Some(f) => rows
                .par_iter()
                .zip(t.mode_indices(f).par_iter())
                .map(|(&i, &j)| (u64::from(i) << 32) | u64::from(j))
                .collect(),
            None => rows.par_iter().map(|&i| u64::from(i) << 32).collect(),
        };
        keys.par_sort_unstable();
        let nnz = keys.len();
        // Chunk starts moved forward to the next slice boundary (a binary
        // search: keys are sorted), so every chunk holds whole slices.
        let chunks = (nnz >> 16).clamp(1, 4 * rayon::current_num_threads().max(1));
        let mut bounds: Vec<usize> = (0..chunks)
            .map(|c| {
                let start = c * nnz / chunks;
                if start == 0 {
                    return 0;
                }
                let slice = keys[start - 1] >> 32;
                keys.partition_point(|&k| k >> 32 <= slice)
            })
            .collect();
        bounds.push(nnz);
        bounds.dedup();
        bounds
            .par_windows(2)
            .map(|w| Scan::new(&keys[w[0]..w[1]]))
            .reduce(Scan::default, Scan::merge)
    }

    /// The counts of `mode` as the sorting implementation computed them.
    pub(super) fn counts(t: &SparseTensor, mode: usize, fiber: Option<usize>) -> ModeCounts {
        let scan = scan_mode(t, mode, fiber);
        let sizes = scan.slice_sizes;
        ModeCounts {
            slices: sizes.len() as u64,
            max_slice: sizes.par_iter().copied().max().unwrap_or(0),
            slice_sq: sizes.par_iter().map(|&c| (c as f64) * (c as f64)).sum(),
            slice_gini: gini(sizes),
            fibers: scan.fibers,
            max_fiber: scan.max_fiber,
            fiber_sq: scan.fiber_sq,
            max_fibers_per_slice: scan.max_fibers_per_slice,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kruskal_formats::generate::{PowerLawSpec, power_law};

    /// 4 x 3 x 5; mode 1 (dim 3) is the fiber mode of modes 0 and 2, mode 0
    /// that of mode 1.
    fn small() -> SparseTensor {
        // Nonzeros (i, j, k):
        // (0,0,0) (0,0,1) (0,0,2) (0,2,4) (1,1,0) (3,1,2) (3,1,4) (3,2,3)
        SparseTensor::new(
            vec![4, 3, 5],
            vec![
                vec![0, 0, 0, 0, 1, 3, 3, 3],
                vec![0, 0, 0, 2, 1, 1, 1, 2],
                vec![0, 1, 2, 4, 0, 2, 4, 3],
            ],
            vec![1.0; 8],
        )
        .unwrap()
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-12, "{a} != {b}");
    }

    #[test]
    fn hand_computed_features_of_a_small_tensor() {
        let f = TensorFeatures::compute(&small());
        assert_eq!(f.nnz, 8);
        close(f.density, 8.0 / 60.0);

        // Mode 0: slices 0 (4 nonzeros), 1 (1), 3 (3); fiber mode 1.
        // Fibers (i, j): (0,0) x3, (0,2) x1, (1,1) x1, (3,1) x2, (3,2) x1.
        let m = &f.modes[0];
        assert_eq!(m.fiber_mode, Some(1));
        assert_eq!((m.slices, m.fibers), (3, 5));
        close(m.slice_ratio, 0.75);
        close(m.fibers_per_slice, 5.0 / 3.0);
        assert_eq!(m.max_fibers_per_slice, 2);
        close(m.nnz_per_slice, 8.0 / 3.0);
        assert_eq!(m.max_nnz_per_slice, 4);
        close(m.nnz_per_fiber, 1.6);
        assert_eq!(m.max_nnz_per_fiber, 3);
        close(m.slice_skew, 4.0 / (8.0 / 3.0));
        close(m.fiber_skew, 3.0 / 1.6);
        close(m.hot_share, 0.5);
        // Slice sizes 4, 1, 3: mean 8/3, E[x^2] = 26/3.
        let mean: f64 = 8.0 / 3.0;
        close(m.slice_cv, (26.0 / 3.0 - mean * mean).sqrt() / mean);
        // Sorted 1, 3, 4: (-2 * 1 + 0 * 3 + 2 * 4) / (3 * 8) = 6 / 24.
        close(m.slice_gini, 0.25);
        // Fiber sizes 3, 1, 1, 2, 1: E[x^2] = 16/5.
        close(m.fiber_cv, (16.0f64 / 5.0 - 1.6 * 1.6).sqrt() / 1.6);

        // Mode 1: slices j = 0 (3), 1 (3), 2 (2); fiber mode 0.
        // Fibers (j, i): (0,0) x3, (1,1), (1,3) x2, (2,0), (2,3).
        let m = &f.modes[1];
        assert_eq!(m.fiber_mode, Some(0));
        assert_eq!((m.slices, m.fibers, m.max_fibers_per_slice), (3, 5, 2));
        assert_eq!((m.max_nnz_per_slice, m.max_nnz_per_fiber), (3, 3));
        close(m.slice_ratio, 1.0);

        // Mode 2: slices k = 0 (2), 1 (1), 2 (2), 3 (1), 4 (2); fiber mode 1.
        // Fibers (k, j): (0,0), (0,1), (1,0), (2,0), (2,1), (3,2), (4,1),
        // (4,2).
        let m = &f.modes[2];
        assert_eq!(m.fiber_mode, Some(1));
        assert_eq!((m.slices, m.fibers, m.max_fibers_per_slice), (5, 8, 2));
        assert_eq!((m.max_nnz_per_slice, m.max_nnz_per_fiber), (2, 1));
        // Sorted 1, 1, 2, 2, 2: (-4 - 2 + 0 + 4 + 8) / (5 * 8) = 0.15.
        close(m.slice_gini, 0.15);
    }

    #[test]
    fn the_fiber_mode_is_the_smallest_other_mode_lower_on_ties() {
        assert_eq!(fiber_mode(&[5, 3, 3], 0), Some(1));
        assert_eq!(fiber_mode(&[5, 3, 3], 1), Some(2));
        assert_eq!(fiber_mode(&[2, 9, 2], 1), Some(0));
        assert_eq!(fiber_mode(&[7], 0), None);
    }

    #[test]
    fn uniform_slices_have_no_skew_and_one_mode_fibers_are_slices() {
        // Every index of a 1-mode tensor once: no skew at all.
        let t = SparseTensor::new(vec![6], vec![vec![5, 4, 3, 2, 1, 0]], vec![1.0; 6]).unwrap();
        let m = &TensorFeatures::compute(&t).modes[0];
        assert_eq!((m.slices, m.fibers, m.max_fibers_per_slice), (6, 6, 1));
        close(m.slice_cv, 0.0);
        close(m.slice_gini, 0.0);
        close(m.slice_skew, 1.0);
        close(m.fiber_skew, 1.0);
    }

    #[test]
    fn an_empty_tensor_has_finite_features() {
        let t = SparseTensor::new(vec![3, 4], vec![vec![], vec![]], vec![]).unwrap();
        let f = TensorFeatures::compute(&t);
        for mode in 0..2 {
            assert!(f.mode_vector(mode).iter().all(|x| x.is_finite()));
            assert_eq!(f.modes[mode].fibers, 0);
        }
    }

    /// The chunked scan agrees with a direct count on a tensor large enough
    /// to be cut into many chunks, with hot slices crossing nominal chunk
    /// starts.
    #[test]
    fn chunked_fiber_counts_match_a_direct_count() {
        let t = power_law(&PowerLawSpec::new(vec![40, 3000, 70], 300_000).with_seed(5)).unwrap();
        let f = TensorFeatures::compute(&t);
        for mode in 0..3 {
            let fm = fiber_mode(t.dims(), mode).unwrap();
            let mut pairs: Vec<(u32, u32)> = t
                .mode_indices(mode)
                .iter()
                .zip(t.mode_indices(fm))
                .map(|(&a, &b)| (a, b))
                .collect();
            pairs.sort_unstable();
            let mut runs: Vec<(u32, u64)> = Vec::new();
            let mut per_slice = std::collections::HashMap::<u32, u64>::new();
            for (k, p) in pairs.iter().enumerate() {
                if k > 0 && pairs[k - 1] == *p {
                    runs.last_mut().unwrap().1 += 1;
                } else {
                    runs.push((p.0, 1));
                    *per_slice.entry(p.0).or_default() += 1;
                }
            }
            let m = &f.modes[mode];
            assert_eq!(m.fibers, runs.len() as u64, "mode {mode}");
            assert_eq!(m.max_nnz_per_fiber, runs.iter().map(|r| r.1).max().unwrap());
            assert_eq!(m.max_fibers_per_slice, *per_slice.values().max().unwrap());
            let sq: f64 = runs.iter().map(|r| (r.1 * r.1) as f64).sum();
            close(m.fiber_cv, cv(runs.len() as f64, 300_000.0, sq));
        }
    }

    /// Asserts that `a` and `b` agree within 1e-12 relative.
    fn near(a: f64, b: f64, what: &str) {
        assert!(
            a == b || (a - b).abs() <= 1e-12 * a.abs().max(b.abs()),
            "{what}: {a} != {b}"
        );
    }

    /// The counted features of every mode of `t`, by dense counters and by
    /// sorted buckets, equal those of the sorting implementation: counts
    /// exactly, the rest within 1e-12 relative.
    fn matches_the_reference(t: &SparseTensor) {
        let features = TensorFeatures::compute(t);
        for mode in 0..t.nmodes() {
            let fm = fiber_mode(t.dims(), mode);
            let want = reference::counts(t, mode, fm);
            // Dense counters forced only where they are small.
            let small_fiber_mode = fm.is_none_or(|f| t.dims()[f] < 1 << 24);
            let forced =
                small_fiber_mode.then(|| (true, count_mode_by(t, mode, fm, true, &mut Vec::new())));
            let ways = [
                (false, count_mode_by(t, mode, fm, false, &mut Vec::new())),
                (true, count_mode(t, mode, fm, &mut Vec::new())),
            ];
            for (dense, got) in forced.into_iter().chain(ways) {
                let what = format!("dims {:?} mode {mode} dense {dense}", t.dims());
                assert_eq!(
                    (got.slices, got.max_slice, got.fibers),
                    (want.slices, want.max_slice, want.fibers),
                    "{what}"
                );
                assert_eq!(
                    (got.max_fiber, got.max_fibers_per_slice),
                    (want.max_fiber, want.max_fibers_per_slice),
                    "{what}"
                );
                near(got.slice_sq, want.slice_sq, &what);
                near(got.fiber_sq, want.fiber_sq, &what);
                near(got.slice_gini, want.slice_gini, &what);
            }
            let old = TensorFeatures::mode_features(t, mode, fm, &want);
            let new = &features.modes[mode];
            assert_eq!(
                (new.slices, new.fibers, new.max_nnz_per_fiber),
                (old.slices, old.fibers, old.max_nnz_per_fiber)
            );
            let vector = features.mode_vector(mode);
            let names = TensorFeatures::MODE_VECTOR_NAMES;
            let mut reference = features.clone();
            reference.modes[mode] = old;
            for ((a, b), name) in vector.iter().zip(reference.mode_vector(mode)).zip(names) {
                near(*a, b, &format!("dims {:?} mode {mode} {name}", t.dims()));
            }
        }
    }

    fn generated(dims: Vec<u32>, nnz: usize, exponent: f64, seed: u64) -> SparseTensor {
        let mut spec = PowerLawSpec::new(dims, nnz).with_seed(seed);
        spec.exponents.iter_mut().for_each(|s| *s = exponent);
        power_law(&spec).unwrap()
    }

    #[test]
    fn counted_features_match_the_sorting_implementation_on_generated_tensors() {
        for (exponent, seed) in [(1.1, 3), (0.0, 4), (1.6, 5)] {
            // 5000 and 9000 indices: buckets of 2 and 4 slices; 3000 of one.
            matches_the_reference(&generated(vec![5000, 300, 9000], 400_000, exponent, seed));
            matches_the_reference(&generated(vec![60, 7000, 45, 800], 300_000, exponent, seed));
            matches_the_reference(&generated(
                vec![30, 200, 3000, 12, 90],
                200_000,
                exponent,
                seed,
            ));
        }
    }

    #[test]
    fn counted_features_match_on_odd_shapes() {
        // The doc example, the small tensor, a mode of dimension 1, and
        // one mode.
        let example = SparseTensor::new(
            vec![3, 2, 2],
            vec![vec![0, 0, 0, 2], vec![0, 1, 1, 0], vec![0, 0, 1, 1]],
            vec![1.0; 4],
        )
        .unwrap();
        matches_the_reference(&example);
        matches_the_reference(&small());
        matches_the_reference(&generated(vec![1, 3000, 40], 50_000, 1.1, 7));
        matches_the_reference(&generated(vec![700, 1, 1], 600, 1.1, 8));
        let one_mode: Vec<u32> = (0..100_000u32).map(|k| (k * 7919) % 60_000).collect();
        let t = SparseTensor::new(vec![60_000], vec![one_mode.clone()], vec![1.0; 100_000]);
        matches_the_reference(&t.unwrap());
        // Repeated coordinates (summed into one nonzero each).
        let t = SparseTensor::new(
            vec![9, 4, 5],
            vec![
                one_mode.iter().map(|&i| i % 9).collect(),
                one_mode.iter().map(|&i| i % 4).collect(),
                one_mode.iter().map(|&i| i % 5).collect(),
            ],
            vec![1.0; 100_000],
        )
        .unwrap();
        assert!(t.nnz() < 100_000);
        matches_the_reference(&t);
        // Empty.
        matches_the_reference(
            &SparseTensor::new(vec![3, 4], vec![vec![], vec![]], vec![]).unwrap(),
        );
    }

    /// Huge dimensions with few, clustered nonzeros: buckets of many empty
    /// slices (sorted rather than counted), one hot slice in a bucket of
    /// many, and empty slices everywhere.
    #[test]
    fn counted_features_match_with_huge_sparse_dimensions_and_hot_slices() {
        let nnz = 300_000u32;
        let spread =
            |k: u32, step: u32, dim: u32| (u64::from(k) * u64::from(step) % u64::from(dim)) as u32;
        let dims = vec![4_000_000_000, 50_000_000, 7, 3];
        let rows: Vec<u32> = (0..nnz)
            .map(|k| {
                if k % 3 == 0 {
                    123_456_789
                } else {
                    spread(k, 2_654_435_761, dims[0])
                }
            })
            .collect();
        let t = SparseTensor::new(
            dims.clone(),
            vec![
                rows,
                (0..nnz)
                    .map(|k| spread(k, 40_503, dims[1]) % 1000)
                    .collect(),
                (0..nnz).map(|k| k % 7).collect(),
                (0..nnz).map(|k| (k / 7) % 3).collect(),
            ],
            vec![1.0; nnz as usize],
        )
        .unwrap();
        matches_the_reference(&t);
        // A few nonzeros in a dimension of billions.
        let t = SparseTensor::new(
            vec![u32::MAX, 10],
            vec![vec![0, 5, u32::MAX - 1, u32::MAX - 1], vec![1, 1, 2, 3]],
            vec![1.0; 4],
        )
        .unwrap();
        matches_the_reference(&t);
    }

    #[test]
    fn vectors_have_one_value_per_name() {
        let f = TensorFeatures::compute(&small());
        let v = f.mode_vector(2);
        assert_eq!(v.len(), TensorFeatures::MODE_VECTOR_NAMES.len());
        let col = |name: &str| {
            v[TensorFeatures::MODE_VECTOR_NAMES
                .iter()
                .position(|&n| n == name)
                .unwrap()]
        };
        assert_eq!(col("nmodes"), 3.0);
        assert_eq!(col("dim"), 5.0);
        assert_eq!(col("fiber_dim"), 3.0);
        assert_eq!(col("other_rows"), 7.0);
        assert_eq!(col("max_other_dim"), 4.0);
        assert_eq!(col("fibers"), 8.0);
    }
}
