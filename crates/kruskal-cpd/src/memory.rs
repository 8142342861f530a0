//! How much memory a decomposition needs, before anything sized by a
//! dimension is allocated.
//!
//! Dimensions are `u32`, so a three-line file whose largest index is three
//! billion is a legal tensor whose factors alone take 12 GB per column of
//! f32. Allocating first and failing later means the out-of-memory killer
//! ends the process without a word; these estimates let a caller (the
//! program, the Python bindings) refuse with the numbers instead. They are
//! pure functions of the shape, so they cost nothing and are tested here.

use crate::error::CpdError;
use std::fmt;

use kruskal_device::engines::flycoo::element_stride;
use kruskal_formats::SparseTensor;
pub use kruskal_formats::memory::{available_bytes, bytes_text, parse_meminfo};

/// Rows one task of the CPU's dense steps widens to f64 at a time (as in
/// the CPU backend).
const DENSE_BLOCK_ROWS: u64 = 4096;

/// A memory estimate: its parts, largest first when printed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryNeed {
    /// What each part is for, and its bytes.
    pub parts: Vec<(&'static str, u64)>,
}

impl MemoryNeed {
    /// Bytes of all parts.
    pub fn total(&self) -> u64 {
        self.parts
            .iter()
            .map(|&(_, b)| b)
            .fold(0, u64::saturating_add)
    }
}

impl fmt::Display for MemoryNeed {
    /// `48.1 GiB (factors 22.4 GiB, MTTKRP outputs 22.4 GiB, ...)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = self.parts.clone();
        parts.sort_by_key(|p| std::cmp::Reverse(p.1));
        let shown: Vec<String> = parts
            .iter()
            .filter(|&&(_, b)| b > 0)
            .map(|&(name, b)| format!("{name} {}", bytes_text(b)))
            .collect();
        write!(f, "{} ({})", bytes_text(self.total()), shown.join(", "))
    }
}

/// Factor rows of all modes (the sum of the dimensions).
fn rows(dims: &[u32]) -> u64 {
    dims.iter().map(|&d| u64::from(d)).sum()
}

/// What a CPD-ALS run on the CPU allocates besides the tensor it was given
/// (already in memory): the factors (f32, `dims[m] x rank` per mode), one
/// MTTKRP output per mode (the same shape), the returned model (normalized
/// into a copy of the factors while the outputs are still held), the
/// engine's per-mode copies
/// of the tensor (indices of the other modes, value, output row and a
/// segment pointer per nonzero, and the 16-byte sort keys while one copy
/// is built), the dense steps' f64 blocks (one per thread) and, with
/// several starts, the best model kept while the next start runs.
///
/// Cost: O(modes). Every CPU engine stays within the sorted engine's
/// per-mode copies, which this counts.
pub fn cpu_need(
    dims: &[u32],
    nnz: usize,
    rank: usize,
    threads: usize,
    starts: usize,
) -> MemoryNeed {
    let nmodes = dims.len() as u64;
    let nnz = nnz as u64;
    let rank = rank as u64;
    let factor_bytes = rows(dims).saturating_mul(rank).saturating_mul(4);
    let per_copy = nnz.saturating_mul(4 * nmodes + 12);
    let copies = per_copy
        .saturating_mul(nmodes)
        .saturating_add(nnz.saturating_mul(16));
    let dense = (threads.max(1) as u64 * DENSE_BLOCK_ROWS * 16)
        .saturating_mul(rank)
        .saturating_add(
            nmodes
                .saturating_mul(rank)
                .saturating_mul(rank)
                .saturating_mul(8),
        );
    MemoryNeed {
        parts: vec![
            ("factors", factor_bytes),
            ("MTTKRP outputs", factor_bytes),
            ("model copy", factor_bytes),
            ("tensor copies", copies),
            ("dense steps", dense),
            ("best model kept", if starts > 1 { factor_bytes } else { 0 }),
        ],
    }
}

/// What constrained CP (AO-ADMM, [`crate::admm`]) allocates on the CPU
/// beyond [`cpu_need`]: H and U of every mode in f64, kept between
/// iterations; for the mode being updated, its MTTKRP copied to the host
/// and widened to f64 beside the f32 rounding of its new factor; and each
/// thread's two f64 blocks of [`crate::admm`]'s rows per task.
pub fn admm_need(dims: &[u32], rank: usize, threads: usize) -> MemoryNeed {
    let rank = rank as u64;
    let largest = dims.iter().map(|&d| u64::from(d)).max().unwrap_or(0);
    let per_task = crate::admm::ROWS_PER_TASK as u64;
    MemoryNeed {
        parts: vec![
            (
                "ADMM H and U",
                rows(dims).saturating_mul(rank).saturating_mul(16),
            ),
            (
                "ADMM MTTKRP and factor of one mode",
                largest.saturating_mul(rank).saturating_mul(16),
            ),
            (
                "ADMM row blocks",
                (threads.max(1) as u64 * per_task * 16).saturating_mul(rank),
            ),
        ],
    }
}

/// What constrained CP (AO-ADMM) allocates on one GPU beyond
/// [`gpu_need`]: H and U of every mode in f64, kept on the device between
/// iterations, and an f32 copy of the longest mode's rows for the Gram of
/// its rows with data (the inner loop's other buffers are a few R x R
/// matrices and per-block sums, under a megabyte). Every row counted: an
/// upper bound where modes have empty rows.
pub fn admm_gpu_need(dims: &[u32], rank: usize) -> MemoryNeed {
    let longest = dims.iter().copied().max().unwrap_or(0) as u64;
    MemoryNeed {
        parts: vec![
            (
                "ADMM H and U",
                rows(dims).saturating_mul(rank as u64).saturating_mul(16),
            ),
            (
                "ADMM rows with data (f32)",
                longest.saturating_mul(rank as u64).saturating_mul(4),
            ),
        ],
    }
}

impl MemoryNeed {
    /// This estimate with `other`'s parts after its own.
    pub fn and(mut self, other: MemoryNeed) -> MemoryNeed {
        self.parts.extend(other.parts);
        self
    }
}

/// What the single-GPU backend allocates on the device: two FLYCOO copies
/// of the tensor (the largest of its candidate formats), the factors and
/// one MTTKRP output per mode. This is the estimate `--backend auto`
/// compares with the GPU's free memory.
pub fn gpu_need(dims: &[u32], nnz: usize, rank: usize) -> MemoryNeed {
    let factor_bytes = rows(dims).saturating_mul(rank as u64).saturating_mul(4);
    let copies = (nnz as u64).saturating_mul(element_stride(dims.len()) as u64 * 8);
    MemoryNeed {
        parts: vec![
            ("two FLYCOO copies", copies),
            ("factors", factor_bytes),
            ("MTTKRP outputs", factor_bytes),
        ],
    }
}

/// What an MTTKRP of every mode allocates on the CPU: the factors (the
/// first part, also what the host holds for a GPU run), one output (the
/// largest mode's; `kruskal mttkrp` reuses it per mode) and the engine's
/// copies of the tensor.
pub fn mttkrp_need(dims: &[u32], nnz: usize, rank: usize) -> MemoryNeed {
    let cpd = cpu_need(dims, nnz, rank, 1, 1);
    let largest = dims.iter().copied().max().map_or(0, u64::from);
    let output = largest.saturating_mul(rank as u64).saturating_mul(4);
    let factors = cpd.parts[0].1;
    MemoryNeed {
        parts: vec![
            ("factors", factors),
            ("MTTKRP output", output),
            ("tensor copies", cpd.parts[3].1),
        ],
    }
}

/// What CP-APR on the CPU ([`crate::apr::cp_apr`]) allocates besides the
/// tensor it was given: the factors and `Phi` (f64, `dims[m] x rank` per
/// mode), the returned model (a copy of the factors), each mode's sorted
/// copy of the nonzeros (an f64 value and the other modes' u32 indices per
/// nonzero, and a row pointer per index), the sort's scratch while one
/// copy is built (a permutation per nonzero and a cursor per index of the
/// largest mode), and `Pi` (`nnz x rank` f64).
///
/// Cost: O(modes).
pub fn apr_need(dims: &[u32], nnz: usize, rank: usize) -> MemoryNeed {
    let nmodes = dims.len() as u64;
    let nnz = nnz as u64;
    let rank = rank as u64;
    let factor_bytes = rows(dims).saturating_mul(rank).saturating_mul(8);
    let per_copy = nnz.saturating_mul(8 + 4 * nmodes.saturating_sub(1));
    let row_ptrs = rows(dims).saturating_add(nmodes).saturating_mul(8);
    let largest = dims.iter().copied().max().map_or(0, u64::from);
    MemoryNeed {
        parts: vec![
            ("factors", factor_bytes),
            ("Phi", factor_bytes),
            ("model copy", factor_bytes),
            (
                "sorted copies",
                per_copy.saturating_mul(nmodes).saturating_add(row_ptrs),
            ),
            (
                "sort scratch",
                nnz.saturating_add(largest)
                    .saturating_add(1)
                    .saturating_mul(8),
            ),
            ("Pi", nnz.saturating_mul(rank).saturating_mul(8)),
        ],
    }
}

/// What counting the nonzeros of every index of a mode may take for the
/// largest mode: one u64 per index and thread, the most the mode layouts
/// behind `kruskal info --gpus` hold (`SparseTensor::mode_counts` itself
/// takes at most 256 MiB besides its result, or 4 bytes a row on one
/// thread).
pub fn counts_need(dims: &[u32], threads: usize) -> MemoryNeed {
    let largest = dims.iter().copied().max().map_or(0, u64::from);
    MemoryNeed {
        parts: vec![(
            "per-index counts",
            largest
                .saturating_mul(8)
                .saturating_mul(threads.max(1) as u64 + 1),
        )],
    }
}

/// Bytes of the `.npy` files of a model with these dimensions (f32
/// factors, f64 lambda), headers included: what writing it needs on disk.
pub fn model_file_bytes(dims: &[u32], rank: usize) -> u64 {
    const HEADER: u64 = 128;
    let rank = rank as u64;
    rows(dims)
        .saturating_mul(rank)
        .saturating_mul(4)
        .saturating_add(rank.saturating_mul(8))
        .saturating_add(HEADER * (dims.len() as u64 + 1))
}

/// The modes whose dimension is far larger than the number of distinct
/// indices that occur in them (`occurring[m]`): there most factor rows
/// are zero, and relabeling the mode (the `compact` option) saves almost all of
/// its memory. "Far" is more than twice, and at least a million rows
/// saved, so small tensors with a few empty slices are not flagged.
pub fn sparse_modes(dims: &[u32], occurring: &[u64]) -> Vec<usize> {
    dims.iter()
        .zip(occurring)
        .enumerate()
        .filter(|&(_, (&dim, &n))| {
            let dim = u64::from(dim);
            dim > 2 * n && dim - n >= 1 << 20
        })
        .map(|(m, _)| m)
        .collect()
}

/// Why a run that needs `need` of host memory cannot run here: the need
/// with its parts, `MemAvailable`, and, where the caller can relabel modes
/// (`can_compact`) and a mode's dimension dwarfs the indices that occur in
/// it, which modes ([`CpdError::Memory`]'s `sparse_modes`). `None` when it
/// fits, or when the available memory cannot be read.
pub fn host_refusal(need: &MemoryNeed, t: &SparseTensor, can_compact: bool) -> Option<CpdError> {
    let available = available_bytes()?;
    if need.total() <= available {
        return None;
    }
    Some(CpdError::Memory {
        message: format!(
            "the run needs {need} and {} are available (MemAvailable)",
            bytes_text(available)
        ),
        sparse_modes: if can_compact {
            sparse_mode_text(t)
        } else {
            None
        },
    })
}

/// `mode 1 has dimension 3,000,000,000 but 3 indices occur`, or `None`
/// when every mode is dense enough.
fn sparse_mode_text(t: &SparseTensor) -> Option<String> {
    // Per-mode statistics cost no memory sized by a dimension where it
    // dwarfs the nonzeros.
    let occurring: Vec<u64> = t.stats().modes.iter().map(|m| m.nonempty_slices).collect();
    let modes = sparse_modes(t.dims(), &occurring);
    if modes.is_empty() {
        return None;
    }
    let listed: Vec<String> = modes
        .iter()
        .map(|&m| {
            format!(
                "mode {} has dimension {} but {} indices occur",
                m + 1,
                thousands(u64::from(t.dims()[m])),
                thousands(occurring[m])
            )
        })
        .collect();
    Some(listed.join(", "))
}

/// `3,000,000,000`: a count with thousands separators, as every message
/// of the library and the program writes counts.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (k, c) in digits.chars().enumerate() {
        if k > 0 && (digits.len() - k) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `12,092 x 9,184 x 28,818`: a tensor's dimensions, as the library's
/// and the program's messages write them.
pub fn dims_text(dims: &[u32]) -> String {
    dims.iter()
        .map(|&d| thousands(u64::from(d)))
        .collect::<Vec<_>>()
        .join(" x ")
}

/// `1 line`, `4,041 lines`: a count and its noun, singular for one
/// (`noun` is the singular; the plural adds an `s`).
pub fn count_of(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{} {noun}s", thousands(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_singular_for_one() {
        assert_eq!(count_of(1, "line"), "1 line");
        assert_eq!(count_of(0, "thread"), "0 threads");
        assert_eq!(count_of(4041, "line"), "4,041 lines");
    }

    #[test]
    fn factors_and_outputs_scale_with_the_dimensions() {
        // A 3-line file with index 3e9: the factors dominate.
        let need = cpu_need(&[3_000_000_000, 2, 3], 3, 10, 2, 1);
        let factors = (3_000_000_005u64) * 10 * 4;
        assert_eq!(need.parts[0], ("factors", factors));
        assert_eq!(need.parts[1], ("MTTKRP outputs", factors));
        assert_eq!(need.parts[2], ("model copy", factors));
        assert!(need.total() > 3 * factors && need.total() < 3 * factors + (1 << 30));
        let text = need.to_string();
        assert!(
            text.starts_with(
                "335.3 GiB (factors 111.8 GiB, MTTKRP outputs 111.8 GiB, model copy 111.8 GiB"
            ),
            "{text}"
        );
        // Parts of 0 bytes are not printed.
        assert!(!text.contains("best model"), "{text}");
    }

    #[test]
    fn cp_apr_counts_its_f64_factors_copies_and_pi() {
        // 4 x 3 x 2 (9 rows), 5 nonzeros, rank 2.
        let need = apr_need(&[4, 3, 2], 5, 2);
        let factors = 9 * 2 * 8;
        assert_eq!(need.parts[0], ("factors", factors));
        assert_eq!(need.parts[1], ("Phi", factors));
        assert_eq!(need.parts[2], ("model copy", factors));
        // Per mode: an f64 value and two u32 indices per nonzero; a row
        // pointer per index plus one per mode.
        assert_eq!(need.parts[3], ("sorted copies", 3 * 5 * 16 + (9 + 3) * 8));
        assert_eq!(need.parts[4], ("sort scratch", (5 + 4 + 1) * 8));
        assert_eq!(need.parts[5], ("Pi", 5 * 2 * 8));
        // A 3-line file with index 3e9: f64 factors, twice cpu_need's.
        let wide = apr_need(&[3_000_000_000, 2, 3], 3, 10);
        let cpu = cpu_need(&[3_000_000_000, 2, 3], 3, 10, 1, 1);
        assert_eq!(wide.parts[0].1, 2 * cpu.parts[0].1);
    }

    #[test]
    fn admm_counts_h_and_u_one_modes_copies_and_the_row_blocks() {
        // 4 x 3 x 2 (9 rows), rank 2, 3 threads.
        let need = admm_need(&[4, 3, 2], 2, 3);
        assert_eq!(need.parts[0], ("ADMM H and U", 9 * 2 * 16));
        assert_eq!(
            need.parts[1],
            ("ADMM MTTKRP and factor of one mode", 4 * 2 * 16)
        );
        assert_eq!(need.parts[2], ("ADMM row blocks", 3 * 1024 * 2 * 16));
        // Beside ALS's need: a 3-line file with index 3e9 at rank 10 needs
        // four more factors' worth in H and U alone.
        let dims = [3_000_000_000, 2, 3];
        let als = cpu_need(&dims, 3, 10, 1, 1);
        let both = als.clone().and(admm_need(&dims, 10, 1));
        assert_eq!(both.parts.len(), als.parts.len() + 3);
        assert!(both.total() - als.total() >= 4 * als.parts[0].1);
        // On one GPU: H and U of every mode, beside the GPU's own need,
        // which holds one factor's worth per mode: four more, and an f32
        // copy of the longest mode (4 rows).
        let gpu = gpu_need(&[4, 3, 2], 100, 2);
        let with = gpu.clone().and(admm_gpu_need(&[4, 3, 2], 2));
        let n = with.parts.len();
        assert_eq!(with.parts[n - 2], ("ADMM H and U", 9 * 2 * 16));
        assert_eq!(with.parts[n - 1], ("ADMM rows with data (f32)", 4 * 2 * 4));
        assert_eq!(with.total() - gpu.total(), 4 * gpu.parts[1].1 + 4 * 2 * 4);
    }

    #[test]
    fn tensor_copies_scale_with_the_nonzeros() {
        let small = cpu_need(&[100, 100, 100], 1_000, 8, 1, 1);
        let big = cpu_need(&[100, 100, 100], 1_000_000, 8, 1, 1);
        assert_eq!(small.parts[3].1 * 1000, big.parts[3].1);
        // Three copies of 3 x 4 + 12 bytes, plus the sort keys.
        assert_eq!(big.parts[3].1, 1_000_000 * (3 * 24 + 16));
        let starts = cpu_need(&[100, 100, 100], 1_000, 8, 1, 3);
        assert_eq!(starts.total() - small.total(), 300 * 8 * 4);
    }

    #[test]
    fn gpu_need_is_the_backends_estimate() {
        let t = kruskal_formats::generate::power_law(
            &kruskal_formats::generate::PowerLawSpec::new(vec![1000, 2000, 3000], 5_000),
        )
        .unwrap();
        let need = gpu_need(t.dims(), t.nnz(), 16);
        assert_eq!(need.total(), crate::gpu::required_bytes(&t, 16) as u64);
        assert!(need.total() > 2 * 6000 * 16 * 4);
    }

    #[test]
    fn huge_shapes_saturate_instead_of_overflowing() {
        let need = cpu_need(&[u32::MAX; 64], usize::MAX, usize::MAX / 2, 1, 2);
        assert_eq!(need.total(), u64::MAX);
    }

    #[test]
    fn sparse_modes_are_the_ones_compacting_helps() {
        let dims = [3_000_000_000, 2_000_000, 50];
        assert_eq!(sparse_modes(&dims, &[3, 1_500_000, 2]), vec![0]);
        assert!(sparse_modes(&[100, 100], &[1, 1]).is_empty());
    }

    #[test]
    fn meminfo_is_read_in_bytes() {
        let text =
            "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_meminfo(text), Some(20_000_000 * 1024));
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_meminfo("MemAvailable: lots kB\n"), None);
        assert!(available_bytes().is_none_or(|b| b > 0));
    }

    #[test]
    fn counts_take_a_u64_per_index_and_thread() {
        let need = counts_need(&[3_000_000_000, 5], 2);
        assert_eq!(need.total(), 3_000_000_000 * 8 * 3);
        assert!(
            need.to_string().contains("per-index counts 67.1 GiB"),
            "{need}"
        );
    }

    #[test]
    fn model_files_hold_every_row() {
        let bytes = model_file_bytes(&[20_000_000, 3, 4], 2);
        assert!((20_000_007 * 8..20_000_007 * 8 + 1024).contains(&bytes));
        assert_eq!(bytes_text(1536 << 20), "1.5 GiB");
        assert_eq!(bytes_text(3 << 20), "3.0 MiB");
        assert_eq!(bytes_text(100), "100 bytes");
        // The dense steps of a small run, beside parts in GiB.
        assert_eq!(bytes_text(524_672), "512.4 KiB");
    }
}
