//! MTTKRP on CSF trees ([`Csf`]), with factor rows reused at every level
//! of the tree, as SPLATT computes it.
//!
//! **Root mode** (the output mode at the root of a tree). For a slice `s`
//! with fibers `f` and nonzeros `k` (three modes, order `(a, b, c)`):
//!
//! ```text
//! M(s, :) = sum_f  B(f, :) * (sum_{k in f} v_k C(k, :))
//! ```
//!
//! The leaf rows, scaled by their values, are summed into a fiber buffer
//! first, and the fiber's row of `B` multiplies that sum once per fiber,
//! not once per nonzero. Deeper trees repeat this at every level (a
//! node's buffer is the sum over its children of the child's row times the
//! child's buffer). Each slice is one output row: the slices are cut into
//! chunks of about equal nonzero count, one rayon task each, and a chunk
//! owns a contiguous range of output rows and writes them directly (no
//! atomics, no private copies of the output). A slice heavier than a
//! chunk's share is cut between its fibers; each piece returns its partial
//! row, and the partials are added in chunk order afterwards.
//!
//! **Other modes** (the output mode below the root, when fewer trees than
//! modes are kept). Walking down, each node passes the product of the rows
//! above it to its children; at the output depth a node adds that product
//! times its own subtree's sum to its output row. Rows are written in an
//! order set by the tree, so each of a fixed number of groups of slices
//! (chosen from the tensor, not the threads) accumulates into a private
//! f64 copy of the output, and the copies are added in group order.
//!
//! **Copies** ([`CsfCopies`]): `All` keeps one tree per mode, each with its
//! own mode at the root (every MTTKRP is a root-mode one); `Two` keeps a
//! tree with the modes by increasing dimension and a second with the first
//! one's leaf mode at the root (SPLATT's default: the leaf mode is the
//! costliest to compute from below); `One` keeps a single tree.
//!
//! Precision: products are f32. A fiber's leaves are summed in f32 with
//! fused multiply-adds when it holds at most eight of them (the common case,
//! and what makes the tree fast), in f32 blocks of eight added in f64 when
//! longer (at ranks 8, 16, 32 and 64; other ranks sum in f64 throughout);
//! every sum above the fibers, and the private copies of the other
//! modes, is f64, stored as f32. CPD fits then agree with the sorted
//! engine's as closely as the other engines' do (`kruskal-cpd`'s
//! `cpu_engines` test: within 1e-7 on the repository's tensors). Chunks and
//! groups depend only on the tensor and every sum runs in a fixed order:
//! the result is bit-identical for any number of threads and for every
//! instruction set (a fused multiply-add rounds once on every one).

use kruskal_formats::{Csf, SparseTensor};
use ndarray::Array2;
use rayon::prelude::*;

use crate::fcoo::{BlockPartials, join_edges};
use crate::{CpuError, Result, mttkrp_slices, row_of};

/// Target nonzeros per root-mode chunk (as the sorted engine's chunks).
const CHUNK_NNZ: usize = 1 << 13;
/// Upper bound on root-mode chunks.
const MAX_CHUNKS: usize = 1 << 16;
/// Most groups (private output copies) of a non-root mode.
const MAX_GROUPS: usize = 16;
/// Fewest nonzeros per group of a non-root mode: below it a private copy
/// of the output costs more than its share of the work.
const GROUP_MIN_NNZ: usize = 1 << 16;

/// How many CSF trees the engine keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CsfCopies {
    /// One tree, modes by increasing dimension.
    One,
    /// That tree and one rooted at its leaf mode.
    Two,
    /// One tree per mode, each rooted at its mode (the fastest).
    #[default]
    All,
}

impl CsfCopies {
    pub fn name(self) -> &'static str {
        match self {
            CsfCopies::One => "one",
            CsfCopies::Two => "two",
            CsfCopies::All => "all",
        }
    }

    /// The most copies whose trees fit in `budget` bytes, given an upper
    /// bound on one tree's bytes; `One` when none does (it is the least
    /// there is). `All` is the fastest (every mode a root-mode MTTKRP,
    /// no private output copies), so it is taken whenever it fits.
    pub fn for_budget(nmodes: usize, tree_bytes: u64, budget: u64) -> CsfCopies {
        let fits = |trees: u64| tree_bytes.saturating_mul(trees) <= budget;
        if fits(nmodes as u64) {
            CsfCopies::All
        } else if fits(2) {
            CsfCopies::Two
        } else {
            CsfCopies::One
        }
    }

    /// An upper bound on the bytes of one CSF tree of `nnz` nonzeros and
    /// `nmodes` modes (every node its own fiber): `8 nmodes` per nonzero.
    pub fn tree_bytes_bound(nmodes: usize, nnz: usize) -> u64 {
        (nnz as u64).saturating_mul(8 * nmodes as u64)
    }
}

/// A root-mode task's share of one tree: the children of the roots
/// (depth-1 nodes) `unit_lo..unit_hi`, which belong to the slices
/// `slice_lo..=slice_hi`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Chunk {
    unit_lo: usize,
    unit_hi: usize,
    slice_lo: usize,
    slice_hi: usize,
    /// `slice_lo` began in an earlier chunk.
    head_shared: bool,
    /// `slice_hi` goes on in a later chunk.
    tail_shared: bool,
    /// Output rows `row_lo..row_hi` belong to this chunk: it zeroes them
    /// and writes the slices it holds whole.
    row_lo: usize,
    row_hi: usize,
}

/// One tree and the schedules of the modes it serves.
#[derive(Clone, Debug)]
struct Tree {
    csf: Csf,
    /// Root-mode chunks (empty when the root mode is served elsewhere or
    /// the tree has no nonzeros).
    chunks: Vec<Chunk>,
    /// Non-root groups: depth-1 node boundaries, `groups + 1` entries
    /// (empty when no mode below the root is served by this tree).
    groups: Vec<usize>,
}

/// The CSF MTTKRP engine; see the [module documentation](self).
#[derive(Clone, Debug)]
pub struct CsfMttkrp {
    dims: Vec<u32>,
    copies: CsfCopies,
    trees: Vec<Tree>,
    /// For each mode: the tree that computes it and the mode's depth there.
    route: Vec<(usize, usize)>,
}

impl CsfMttkrp {
    /// Builds `All` copies: one tree per mode, each rooted at its mode.
    pub fn new(tensor: &SparseTensor) -> Result<Self> {
        Self::with_copies(tensor, CsfCopies::All)
    }

    /// Builds the trees `copies` names and the schedule of every mode.
    ///
    /// Errors: more than `u32::MAX` nonzeros (a CSF capacity error). Cost:
    /// one parallel sort per tree; memory per tree 8 bytes per nonzero plus
    /// 8 per node above the leaves (at most `8 nmodes` per nonzero).
    pub fn with_copies(tensor: &SparseTensor, copies: CsfCopies) -> Result<Self> {
        Self::with_chunk_nnz(tensor, copies, CHUNK_NNZ)
    }

    /// As [`CsfMttkrp::with_copies`] with a given root-mode chunk size (tests
    /// use small chunks to force slices to be split).
    pub fn with_chunk_nnz(
        tensor: &SparseTensor,
        copies: CsfCopies,
        chunk_nnz: usize,
    ) -> Result<Self> {
        let dims = tensor.dims();
        let nmodes = dims.len();
        let shortest = Csf::shortest_first(dims);
        let mut orders: Vec<Vec<usize>> = Vec::new();
        let mut route = vec![(0, 0); nmodes];
        match copies {
            CsfCopies::All => {
                for (m, r) in route.iter_mut().enumerate() {
                    orders.push(Csf::root_first(dims, m));
                    *r = (m, 0);
                }
            }
            CsfCopies::One | CsfCopies::Two => {
                for (d, &m) in shortest.iter().enumerate() {
                    route[m] = (0, d);
                }
                let leaf = *shortest.last().ok_or_else(|| {
                    CpuError::Argument("a tensor without modes has no CSF".into())
                })?;
                orders.push(shortest.clone());
                if copies == CsfCopies::Two && nmodes > 1 {
                    orders.push(Csf::root_first(dims, leaf));
                    route[leaf] = (1, 0);
                }
            }
        }
        let mut trees: Vec<Tree> = orders
            .iter()
            .map(|order| {
                Ok(Tree {
                    csf: Csf::new(tensor, order)?,
                    chunks: Vec::new(),
                    groups: Vec::new(),
                })
            })
            .collect::<Result<_>>()?;
        for (m, &(t, depth)) in route.iter().enumerate() {
            let tree = &mut trees[t];
            if depth == 0 {
                tree.chunks = plan_chunks(&tree.csf, dims[m] as usize, chunk_nnz);
            } else if tree.groups.is_empty() {
                tree.groups = plan_groups(&tree.csf);
            }
        }
        Ok(CsfMttkrp {
            dims: dims.to_vec(),
            copies,
            trees,
            route,
        })
    }

    pub fn copies(&self) -> CsfCopies {
        self.copies
    }

    /// The tree that computes `mode` and the mode's depth in it.
    pub fn tree_of(&self, mode: usize) -> Option<(&Csf, usize)> {
        let &(t, depth) = self.route.get(mode)?;
        Some((&self.trees[t].csf, depth))
    }

    /// Root-mode tasks of `mode` (0 when the mode is not at a root).
    pub fn chunk_count(&self, mode: usize) -> usize {
        let (t, depth) = self.route[mode];
        if depth == 0 {
            self.trees[t].chunks.len()
        } else {
            0
        }
    }

    /// Slices of `mode` split between root-mode tasks.
    pub fn split_slices(&self, mode: usize) -> usize {
        let (t, depth) = self.route[mode];
        if depth > 0 {
            return 0;
        }
        self.trees[t]
            .chunks
            .iter()
            .filter(|c| c.tail_shared)
            .count()
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    /// Bytes of all trees.
    pub fn bytes(&self) -> usize {
        self.trees.iter().map(|t| t.csf.bytes()).sum()
    }

    /// Computes the MTTKRP for output `mode` into `out` (overwritten).
    ///
    /// Shapes: `factors[w]` is `dims[w] x rank` for every mode and `out` is
    /// `dims[mode] x rank`, all in standard (row-major, contiguous) layout.
    /// Cost at the root: `nnz + fibers` row multiply-adds of length `rank`
    /// for three modes (every node above the leaves adds one), parallel over
    /// chunks. Below the root, the same plus the private copies: up to
    /// `16 dims[mode] rank` f64 zeroed and added.
    pub fn mttkrp(
        &self,
        mode: usize,
        factors: &[Array2<f32>],
        out: &mut Array2<f32>,
    ) -> Result<()> {
        let (rank, factors, out) = mttkrp_slices(&self.dims, mode, factors, out)?;
        let (t, depth) = self.route[mode];
        let tree = &self.trees[t];
        let by_depth: Vec<&[f32]> = tree.csf.order().iter().map(|&w| factors[w]).collect();
        let view = TreeView {
            csf: &tree.csf,
            factors: &by_depth,
        };
        if depth == 0 {
            root_mode(&view, &tree.chunks, rank, out);
        } else {
            other_mode(&view, &tree.groups, depth, rank, out);
        }
        Ok(())
    }
}

forward_engine!(CsfMttkrp, "csf");

/// The leaves below each depth-1 node: `n_1 + 1` leaf positions (for a
/// one-mode tree, the leaves are the roots and there is no such level).
fn unit_leaves(csf: &Csf) -> Vec<usize> {
    let n = csf.nmodes();
    if n < 2 {
        return (0..=csf.nnz()).collect();
    }
    let ptrs = csf.ptrs();
    (0..=csf.nodes(1))
        .into_par_iter()
        .map(|u| ptrs[1..].iter().fold(u, |j, p| p[j] as usize))
        .collect()
}

/// The depth-1 nodes each root spans (for a one-mode tree, each root is
/// its own unit).
fn root_units(csf: &Csf) -> Vec<usize> {
    if csf.nmodes() < 2 {
        (0..=csf.nnz()).collect()
    } else {
        csf.ptr(0).iter().map(|&p| p as usize).collect()
    }
}

/// Root-mode chunks: cut points every `chunk_nnz` nonzeros, moved to the
/// nearer slice boundary, or, inside a slice heavier than a chunk's share,
/// to the nearer boundary between its depth-1 nodes.
fn plan_chunks(csf: &Csf, dim: usize, chunk_nnz: usize) -> Vec<Chunk> {
    let nnz = csf.nnz();
    if nnz == 0 {
        return Vec::new();
    }
    let leaves = unit_leaves(csf);
    let units = root_units(csf);
    let slices = units.len() - 1;
    let nchunks = nnz.div_ceil(chunk_nnz.max(1)).clamp(1, MAX_CHUNKS);
    let fair = nnz.div_ceil(nchunks);
    let slice_of_unit = |u: usize| units.partition_point(|&x| x <= u) - 1;
    // Cut points as depth-1 node numbers, strictly increasing.
    let mut cuts = vec![0usize];
    for k in 1..nchunks {
        let target = k * nnz / nchunks;
        let u = leaves.partition_point(|&x| x <= target) - 1;
        let s = slice_of_unit(u.min(leaves.len() - 2));
        let (slo, shi) = (units[s], units[s + 1]);
        let (lo, hi) = (leaves[slo], leaves[shi]);
        let cut = if hi - lo <= fair {
            if target - lo <= hi - target { slo } else { shi }
        } else if target - leaves[u] <= leaves[u + 1] - target {
            u
        } else {
            u + 1
        };
        if cut > *cuts.last().unwrap_or(&0) && cut < units[slices] {
            cuts.push(cut);
        }
    }
    cuts.push(units[slices]);
    let ids0 = csf.ids(0);
    let mut chunks: Vec<Chunk> = cuts
        .windows(2)
        .map(|w| {
            let (slice_lo, slice_hi) = (slice_of_unit(w[0]), slice_of_unit(w[1] - 1));
            Chunk {
                unit_lo: w[0],
                unit_hi: w[1],
                slice_lo,
                slice_hi,
                head_shared: units[slice_lo] < w[0],
                tail_shared: units[slice_hi + 1] > w[1],
                row_lo: ids0[slice_lo] as usize,
                row_hi: dim,
            }
        })
        .collect();
    chunks[0].row_lo = 0;
    for k in 1..chunks.len() {
        chunks[k - 1].row_hi = chunks[k].row_lo;
    }
    chunks
}

/// Groups of depth-1 nodes of about equal nonzero count for the modes
/// below the root: as many as the nonzeros allow (`GROUP_MIN_NNZ` each), at
/// most `MAX_GROUPS`; boundaries as depth-1 node numbers.
fn plan_groups(csf: &Csf) -> Vec<usize> {
    let nnz = csf.nnz();
    let leaves = unit_leaves(csf);
    let groups = (nnz / GROUP_MIN_NNZ).clamp(1, MAX_GROUPS);
    let mut cuts = vec![0usize];
    for g in 1..groups {
        let u = leaves.partition_point(|&x| x < g * nnz / groups);
        if u > *cuts.last().unwrap_or(&0) && u < leaves.len() - 1 {
            cuts.push(u);
        }
    }
    cuts.push(leaves.len() - 1);
    cuts
}

/// A tree and its factors, one per depth.
#[derive(Clone, Copy)]
struct TreeView<'a> {
    csf: &'a Csf,
    factors: &'a [&'a [f32]],
}

/// The head and tail partials a chunk leaves in its two slots (as an
/// F-COO block does).
type Partials = BlockPartials;

/// A root-mode MTTKRP: every chunk in parallel, then the split slices.
fn root_mode(view: &TreeView<'_>, chunks: &[Chunk], rank: usize, out: &mut [f32]) {
    if chunks.is_empty() {
        out.fill(0.0);
        return;
    }
    let mut pieces = Vec::with_capacity(chunks.len());
    let mut rest = &mut *out;
    for chunk in chunks {
        let (mine, tail) = rest.split_at_mut((chunk.row_hi - chunk.row_lo) * rank);
        pieces.push(mine);
        rest = tail;
    }
    let mut slots = vec![0f64; chunks.len() * 2 * rank];
    let partials: Vec<Partials> = chunks
        .par_iter()
        .zip(pieces)
        .zip(slots.par_chunks_mut(2 * rank))
        .map(|((chunk, mine), slots)| root_chunk(view, chunk, rank, mine, slots))
        .collect();

    // The pieces of one slice are adjacent in chunk order.
    let ids0 = view.csf.ids(0);
    join_edges(&partials, &slots, rank, |slice, sums| {
        let row = ids0[slice] as usize;
        for (o, &s) in out[row * rank..(row + 1) * rank].iter_mut().zip(sums) {
            *o = s as f32;
        }
    });
}

/// One root-mode chunk. Dispatches to a kernel specialized for the rank
/// where one exists (its buffers then live in registers) and to the best
/// instruction set of the running CPU; every variant adds the same
/// products in the same order, so results are bit-identical.
fn root_chunk(
    view: &TreeView<'_>,
    chunk: &Chunk,
    rank: usize,
    mine: &mut [f32],
    slots: &mut [f64],
) -> Partials {
    by_rank!(
        rank,
        root_chunk_fixed(view, chunk, mine, slots),
        root_chunk_any(view, chunk, rank, mine, slots)
    )
}

/// Walks the slices of a chunk: `sum_units(lo, hi, acc)` overwrites `acc`
/// with the sum over depth-1 nodes `lo..hi` (one slice's, or its piece in
/// this chunk); whole slices go to `mine`, split ones to `slots`.
#[inline(always)]
fn walk_chunk(
    view: &TreeView<'_>,
    chunk: &Chunk,
    rank: usize,
    mine: &mut [f32],
    slots: &mut [f64],
    acc: &mut [f64],
    mut sum_units: impl FnMut(usize, usize, &mut [f64]),
) -> Partials {
    mine.fill(0.0);
    let csf = view.csf;
    let ids0 = csf.ids(0);
    let (head_slot, tail_slot) = slots.split_at_mut(rank);
    let mut partials = Partials::default();
    let unit_of = |s: usize| {
        if csf.nmodes() < 2 {
            s
        } else {
            csf.ptr(0)[s] as usize
        }
    };
    for (s, &row) in (chunk.slice_lo..=chunk.slice_hi).zip(&ids0[chunk.slice_lo..=chunk.slice_hi]) {
        let lo = unit_of(s).max(chunk.unit_lo);
        let hi = unit_of(s + 1).min(chunk.unit_hi);
        if s == chunk.slice_lo && chunk.head_shared {
            sum_units(lo, hi, head_slot);
            partials.head = Some(s);
        } else if s == chunk.slice_hi && chunk.tail_shared {
            sum_units(lo, hi, tail_slot);
            partials.tail = Some(s);
        } else {
            sum_units(lo, hi, acc);
            let local = row as usize - chunk.row_lo;
            for (o, &a) in mine[local * rank..(local + 1) * rank]
                .iter_mut()
                .zip(acc.iter())
            {
                *o = a as f32;
            }
        }
    }
    partials
}

/// Leaves summed in f32 before their sum joins an f64 one. Fibers of
/// hypersparse tensors hold a few nonzeros, and summing those in f32 is
/// what makes the tree fast (one fused multiply-add per rank column and
/// nonzero, where an f64 sum needs a conversion and an add besides); a long
/// fiber (a pattern tensor's popular relation holds thousands) is summed in
/// f32 blocks of this many leaves added in f64, so its rounding stays that
/// of a short one.
const LEAF_BLOCK: usize = 8;

/// `sum_k values[k] * factor(ids[k], :)` over the leaves `lo..hi`, in f32
/// with fused multiply-adds (inlined into its caller, so it is compiled for
/// the caller's instruction set: as a closure it would call the library's
/// `fmaf`).
#[inline(always)]
fn leaf_block<const R: usize>(
    values: &[f32],
    ids: &[u32],
    factor: &[f32],
    lo: usize,
    hi: usize,
) -> [f32; R] {
    let mut part = [0f32; R];
    for (&v, &i) in values[lo..hi].iter().zip(&ids[lo..hi]) {
        let y = row_of::<R>(factor, i);
        for r in 0..R {
            part[r] = v.mul_add(y[r], part[r]);
        }
    }
    part
}

/// `sum_k values[k] * factor(ids[k], :)` over the leaves `lo..hi`: in f32
/// when there are at most [`LEAF_BLOCK`] of them, else in f32 blocks of
/// [`LEAF_BLOCK`] added in f64.
#[inline(always)]
fn leaves_sum<const R: usize>(
    values: &[f32],
    ids: &[u32],
    factor: &[f32],
    lo: usize,
    hi: usize,
) -> LeafSum<R> {
    if hi - lo <= LEAF_BLOCK {
        return LeafSum::Short(leaf_block::<R>(values, ids, factor, lo, hi));
    }
    let mut sum = [0f64; R];
    for start in (lo..hi).step_by(LEAF_BLOCK) {
        let part = leaf_block::<R>(values, ids, factor, start, hi.min(start + LEAF_BLOCK));
        for r in 0..R {
            sum[r] += f64::from(part[r]);
        }
    }
    LeafSum::Long(sum)
}

/// The sum of a node's leaves ([`leaves_sum`]).
enum LeafSum<const R: usize> {
    /// At most [`LEAF_BLOCK`] leaves, summed in f32.
    Short([f32; R]),
    /// More, in f32 blocks added in f64.
    Long([f64; R]),
}

/// `sum += below * y` for a node's buffer from [`leaves_sum`]: the product
/// in f32 for a short node, in f64 for a long one; the sum in f64.
#[inline(always)]
fn add_product<const R: usize>(sum: &mut [f64; R], below: LeafSum<R>, y: &[f32; R]) {
    match below {
        LeafSum::Short(b) => {
            for r in 0..R {
                sum[r] += f64::from(b[r] * y[r]);
            }
        }
        LeafSum::Long(b) => {
            for r in 0..R {
                sum[r] += b[r] * f64::from(y[r]);
            }
        }
    }
}

/// The buffer of a node just above the leaves (`depth = nmodes - 2`):
/// the sum of its leaves' values times their factor rows, in f32.
#[inline(always)]
fn leaf_sum<const R: usize>(view: &TreeView<'_>, depth: usize, node: usize) -> [f64; R] {
    let csf = view.csf;
    let p = csf.ptr(depth);
    let ids = csf.ids(depth + 1);
    let factor = view.factors[depth + 1];
    let values = csf.values();
    match leaves_sum::<R>(values, ids, factor, p[node] as usize, p[node + 1] as usize) {
        LeafSum::Short(part) => part.map(f64::from),
        LeafSum::Long(sum) => sum,
    }
}

/// The buffer of node `node` at `depth < nmodes - 1`: the sum over its
/// children of the child's factor row times the child's buffer (for the
/// leaves, the value), in f32.
#[inline(always)]
fn node_sum<const R: usize>(view: &TreeView<'_>, depth: usize, node: usize) -> [f64; R] {
    let csf = view.csf;
    if depth + 2 == csf.nmodes() {
        return leaf_sum::<R>(view, depth, node);
    }
    let p = csf.ptr(depth);
    let ids = csf.ids(depth + 1);
    let factor = view.factors[depth + 1];
    let (lo, hi) = (p[node] as usize, p[node + 1] as usize);
    let mut sum = [0f64; R];
    let values = csf.values();
    let (pc, leaf_ids, leaf_factor) = (
        csf.ptr(depth + 1),
        csf.ids(depth + 2),
        view.factors[depth + 2],
    );
    for (c, &i) in (lo..hi).zip(&ids[lo..hi]) {
        let y = row_of::<R>(factor, i);
        if depth + 3 == csf.nmodes() {
            // Four modes, the next common case: the children are just
            // above the leaves, and their sums stay inline (in f32 when
            // short, as a fiber's).
            let below = leaves_sum::<R>(
                values,
                leaf_ids,
                leaf_factor,
                pc[c] as usize,
                pc[c + 1] as usize,
            );
            add_product(&mut sum, below, y);
        } else {
            let below = node_sum_deep::<R>(view, depth + 1, c);
            for r in 0..R {
                sum[r] += below[r] * f64::from(y[r]);
            }
        }
    }
    sum
}

/// [`node_sum`] behind a call boundary, so that the recursion of trees of
/// five or more modes ends in the inliner.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn node_sum_deep<const R: usize>(view: &TreeView<'_>, depth: usize, node: usize) -> [f64; R] {
    node_sum::<R>(view, depth, node)
}

/// [`root_chunk`] for a rank known at compile time.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn root_chunk_fixed<const R: usize>(
    view: &TreeView<'_>,
    chunk: &Chunk,
    mine: &mut [f32],
    slots: &mut [f64],
) -> Partials {
    let mut acc = [0f64; R];
    let csf = view.csf;
    let values = csf.values();
    match csf.nmodes() {
        1 => walk_chunk(view, chunk, R, mine, slots, &mut acc, |lo, hi, out| {
            // A one-mode tensor: the product over no other mode is 1.
            let sum: f64 = values[lo..hi].iter().map(|&v| f64::from(v)).sum();
            out.fill(sum);
        }),
        2 => {
            let (ids1, f1) = (csf.ids(1), view.factors[1]);
            walk_chunk(view, chunk, R, mine, slots, &mut acc, |lo, hi, out| {
                let mut sum = [0f64; R];
                for k in lo..hi {
                    let v = values[k];
                    let y = row_of::<R>(f1, ids1[k]);
                    for r in 0..R {
                        sum[r] += f64::from(v * y[r]);
                    }
                }
                out.copy_from_slice(&sum);
            })
        }
        3 => {
            // The common case, written out: fibers of leaves.
            let (p1, ids1, ids2) = (csf.ptr(1), csf.ids(1), csf.ids(2));
            let (f1, f2) = (view.factors[1], view.factors[2]);
            walk_chunk(view, chunk, R, mine, slots, &mut acc, |lo, hi, out| {
                let mut sum = [0f64; R];
                for (bounds, &i) in p1[lo..=hi].windows(2).zip(&ids1[lo..hi]) {
                    let (klo, khi) = (bounds[0] as usize, bounds[1] as usize);
                    let a = row_of::<R>(f1, i);
                    add_product(&mut sum, leaves_sum::<R>(values, ids2, f2, klo, khi), a);
                }
                out.copy_from_slice(&sum);
            })
        }
        _ => {
            let (ids1, f1) = (csf.ids(1), view.factors[1]);
            walk_chunk(view, chunk, R, mine, slots, &mut acc, |lo, hi, out| {
                let mut sum = [0f64; R];
                for (u, &i) in (lo..hi).zip(&ids1[lo..hi]) {
                    let below = node_sum::<R>(view, 1, u);
                    let a = row_of::<R>(f1, i);
                    for r in 0..R {
                        sum[r] += below[r] * f64::from(a[r]);
                    }
                }
                out.copy_from_slice(&sum);
            })
        }
    }
}

/// The buffer of node `node` at `depth` for any rank (see [`node_sum`]),
/// into `sum` (overwritten); `scratch` holds one buffer per deeper level.
fn node_sum_any(
    view: &TreeView<'_>,
    depth: usize,
    node: usize,
    rank: usize,
    sum: &mut [f64],
    scratch: &mut [f64],
) {
    let csf = view.csf;
    let p = csf.ptr(depth);
    let (lo, hi) = (p[node] as usize, p[node + 1] as usize);
    let ids = csf.ids(depth + 1);
    let factor = view.factors[depth + 1];
    sum.fill(0.0);
    if depth + 2 == csf.nmodes() {
        let values = csf.values();
        for (&v, &i) in values[lo..hi].iter().zip(&ids[lo..hi]) {
            let i = i as usize;
            for (s, &y) in sum.iter_mut().zip(&factor[i * rank..(i + 1) * rank]) {
                *s += f64::from(v * y);
            }
        }
    } else {
        let (below, deeper) = scratch.split_at_mut(rank);
        for (c, &i) in (lo..hi).zip(&ids[lo..hi]) {
            node_sum_any(view, depth + 1, c, rank, below, deeper);
            let i = i as usize;
            for ((s, &b), &y) in sum
                .iter_mut()
                .zip(below.iter())
                .zip(&factor[i * rank..(i + 1) * rank])
            {
                *s += b * f64::from(y);
            }
        }
    }
}

/// [`root_chunk`] for any rank: the same sums in the same order as
/// [`root_chunk_fixed`].
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn root_chunk_any(
    view: &TreeView<'_>,
    chunk: &Chunk,
    rank: usize,
    mine: &mut [f32],
    slots: &mut [f64],
) -> Partials {
    let csf = view.csf;
    let nmodes = csf.nmodes();
    let values = csf.values();
    let mut acc = vec![0f64; rank];
    let mut below = vec![0f64; rank * nmodes];
    walk_chunk(view, chunk, rank, mine, slots, &mut acc, |lo, hi, out| {
        out.fill(0.0);
        if nmodes == 1 {
            let sum: f64 = values[lo..hi].iter().map(|&v| f64::from(v)).sum();
            out.fill(sum);
            return;
        }
        let (ids1, f1) = (csf.ids(1), view.factors[1]);
        for (u, &i) in (lo..hi).zip(&ids1[lo..hi]) {
            let i = i as usize;
            let row = &f1[i * rank..(i + 1) * rank];
            if nmodes == 2 {
                let v = values[u];
                for (o, &y) in out.iter_mut().zip(row) {
                    *o += f64::from(v * y);
                }
            } else {
                let (sum, scratch) = below.split_at_mut(rank);
                node_sum_any(view, 1, u, rank, sum, scratch);
                for ((o, &b), &y) in out.iter_mut().zip(sum.iter()).zip(row) {
                    *o += b * f64::from(y);
                }
            }
        }
    })
}

/// A mode below the root: each group of depth-1 nodes adds into its own
/// f64 copy of the output, in parallel; the copies are then added in group
/// order, in parallel over rows.
fn other_mode(view: &TreeView<'_>, groups: &[usize], depth: usize, rank: usize, out: &mut [f32]) {
    let ngroups = groups.len().saturating_sub(1);
    if ngroups == 0 || view.csf.nnz() == 0 {
        out.fill(0.0);
        return;
    }
    let len = out.len();
    let mut copies = vec![0f64; ngroups * len];
    copies
        .par_chunks_mut(len)
        .zip(groups.par_windows(2))
        .for_each(|(copy, w)| other_group(view, w[0], w[1], depth, rank, copy));
    const ROWS: usize = 256;
    out.par_chunks_mut(ROWS * rank)
        .enumerate()
        .for_each(|(b, dst)| {
            let at = b * ROWS * rank;
            for (x, o) in dst.iter_mut().enumerate() {
                let mut s = 0f64;
                for g in 0..ngroups {
                    s += copies[g * len + at + x];
                }
                *o = s as f32;
            }
        });
}

/// One group of a mode below the root, into `copy` (zeroed).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma",))]
fn other_group(
    view: &TreeView<'_>,
    unit_lo: usize,
    unit_hi: usize,
    depth: usize,
    rank: usize,
    copy: &mut [f64],
) {
    let csf = view.csf;
    let nmodes = csf.nmodes();
    let p0 = csf.ptr(0);
    let ids0 = csf.ids(0);
    // above[d]: the product of the rows of depths 0..=d on the current path.
    let mut above = vec![0f32; rank * nmodes];
    let mut below = vec![0f64; rank * nmodes];
    let first = p0.partition_point(|&x| x as usize <= unit_lo) - 1;
    let mut s = first;
    while s + 1 < p0.len() && (p0[s] as usize) < unit_hi {
        let i = ids0[s] as usize;
        above[..rank].copy_from_slice(&view.factors[0][i * rank..(i + 1) * rank]);
        let lo = (p0[s] as usize).max(unit_lo);
        let hi = (p0[s + 1] as usize).min(unit_hi);
        for u in lo..hi {
            descend(view, 1, u, depth, rank, &mut above, &mut below, copy);
        }
        s += 1;
    }
}

/// Node `node` at `d <= depth` on the way to the output depth: `above`
/// holds the product of the rows above it in its first `d` buffers.
#[allow(clippy::too_many_arguments)]
fn descend(
    view: &TreeView<'_>,
    d: usize,
    node: usize,
    depth: usize,
    rank: usize,
    above: &mut [f32],
    below: &mut [f64],
    copy: &mut [f64],
) {
    let csf = view.csf;
    let i = csf.ids(d)[node] as usize;
    let (done, rest) = above.split_at_mut(d * rank);
    let parent = &done[(d - 1) * rank..];
    if d == depth {
        let dst = &mut copy[i * rank..(i + 1) * rank];
        if d + 1 == csf.nmodes() {
            let v = csf.values()[node];
            for (o, &a) in dst.iter_mut().zip(parent) {
                *o += f64::from(v * a);
            }
        } else {
            let (sum, scratch) = below.split_at_mut(rank);
            node_sum_any(view, d, node, rank, sum, scratch);
            for ((o, &a), &b) in dst.iter_mut().zip(parent).zip(sum.iter()) {
                *o += f64::from(a) * b;
            }
        }
        return;
    }
    let row = &view.factors[d][i * rank..(i + 1) * rank];
    for ((h, &a), &y) in rest[..rank].iter_mut().zip(parent).zip(row) {
        *h = a * y;
    }
    let p = csf.ptr(d);
    for c in p[node] as usize..p[node + 1] as usize {
        descend(view, d + 1, c, depth, rank, above, below, copy);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MttkrpEngine;
    use crate::testutil::{check_engine, factors_for, hot_rows, shared_tensors};
    use kruskal_formats::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    const ALL_COPIES: [CsfCopies; 3] = [CsfCopies::One, CsfCopies::Two, CsfCopies::All];

    fn check_all_modes(t: &SparseTensor, copies: CsfCopies, chunk: usize, rank: usize) {
        let modes: Vec<usize> = (0..t.nmodes()).collect();
        let mut engine = CsfMttkrp::with_chunk_nnz(t, copies, chunk).unwrap();
        check_engine(t, &mut engine, rank, &modes, 1e-6);
    }

    #[test]
    fn heavy_slices_are_split_and_still_exact() {
        let t = hot_rows(&[2_000, 1_500, 1_000], 30_000);
        for copies in ALL_COPIES {
            let engine = CsfMttkrp::with_chunk_nnz(&t, copies, 500).unwrap();
            let root = engine.tree_of(0).unwrap().0.order()[0];
            assert!(engine.split_slices(root) > 0, "{copies:?}");
            for rank in [3, 16, 32] {
                check_all_modes(&t, copies, 500, rank);
            }
        }
    }

    #[test]
    fn equals_reference_on_shared_tensors() {
        for (_, t) in &shared_tensors() {
            for copies in ALL_COPIES {
                check_all_modes(t, copies, 500, 16);
            }
        }
    }

    #[test]
    fn routes_follow_the_copies() {
        let t = power_law(&PowerLawSpec::new(vec![40, 10, 30, 20], 3_000)).unwrap();
        let all = CsfMttkrp::new(&t).unwrap();
        for m in 0..4 {
            let (csf, depth) = all.tree_of(m).unwrap();
            assert_eq!((csf.order()[0], depth), (m, 0));
        }
        let two = CsfMttkrp::with_copies(&t, CsfCopies::Two).unwrap();
        assert_eq!(two.tree_of(1).unwrap().0.order(), &[1, 3, 2, 0]);
        assert_eq!(two.tree_of(1).unwrap().1, 0);
        assert_eq!(two.tree_of(3).unwrap().1, 1);
        assert_eq!(two.tree_of(0).unwrap().0.order(), &[0, 1, 3, 2]);
        assert_eq!(two.tree_of(0).unwrap().1, 0);
        let one = CsfMttkrp::with_copies(&t, CsfCopies::One).unwrap();
        assert_eq!(one.tree_of(0).unwrap().1, 3);
        assert!(one.bytes() < two.bytes() && two.bytes() < all.bytes());
        assert_eq!(all.name(), "csf");
    }

    #[test]
    fn copies_follow_the_memory_budget() {
        assert_eq!(CsfCopies::for_budget(3, 100, 300), CsfCopies::All);
        assert_eq!(CsfCopies::for_budget(3, 100, 299), CsfCopies::Two);
        assert_eq!(CsfCopies::for_budget(3, 100, 199), CsfCopies::One);
        assert_eq!(CsfCopies::for_budget(3, 100, 0), CsfCopies::One);
        assert_eq!(CsfCopies::tree_bytes_bound(3, 10), 240);
    }

    #[test]
    fn empty_rows_and_tensors() {
        let t = SparseTensor::new(
            vec![6, 2, 2],
            vec![vec![4, 4, 1], vec![0, 1, 1], vec![1, 1, 0]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap();
        for copies in ALL_COPIES {
            check_all_modes(&t, copies, 1, 3);
        }
        let t = SparseTensor::new(vec![3, 2, 4], vec![vec![], vec![], vec![]], vec![]).unwrap();
        for copies in ALL_COPIES {
            let engine = CsfMttkrp::with_copies(&t, copies).unwrap();
            let factors = factors_for(t.dims(), 5, 1);
            for mode in 0..3 {
                let mut out = Array2::from_elem((t.dims()[mode] as usize, 5), f32::NAN);
                engine.mttkrp(mode, &factors, &mut out).unwrap();
                assert!(out.iter().all(|&x| x == 0.0));
            }
        }
    }

    #[test]
    fn one_and_two_mode_tensors() {
        let t = SparseTensor::new(vec![7], vec![vec![3, 1, 6]], vec![1.0, 2.0, 4.0]).unwrap();
        for copies in ALL_COPIES {
            check_all_modes(&t, copies, 1, 2);
            check_all_modes(&t, copies, 1, 16);
        }
        let mut spec = PowerLawSpec::new(vec![90, 70], 5_000).with_draws();
        spec.exponents = vec![1.3; 2];
        let t = power_law(&spec).unwrap();
        for copies in ALL_COPIES {
            check_all_modes(&t, copies, 100, 8);
            check_all_modes(&t, copies, 100, 5);
        }
    }

    #[test]
    fn result_does_not_depend_on_thread_count() {
        let mut spec = PowerLawSpec::new(vec![300, 200, 100, 50], 200_000).with_draws();
        spec.exponents = vec![1.2; 4];
        let t = power_law(&spec).unwrap();
        for copies in ALL_COPIES {
            let engine = CsfMttkrp::with_chunk_nnz(&t, copies, 1_000).unwrap();
            for rank in [7, 16] {
                let factors = factors_for(t.dims(), rank, 3);
                let run = |threads: usize| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    pool.install(|| {
                        (0..4)
                            .map(|mode| {
                                let mut out = Array2::zeros((t.dims()[mode] as usize, rank));
                                engine.mttkrp(mode, &factors, &mut out).unwrap();
                                out
                            })
                            .collect::<Vec<_>>()
                    })
                };
                assert_eq!(run(1), run(3), "{copies:?} rank {rank}");
            }
        }
    }

    #[test]
    fn shape_errors_are_reported() {
        let t = power_law(&PowerLawSpec::new(vec![5, 4, 3], 20).with_draws()).unwrap();
        let engine = CsfMttkrp::new(&t).unwrap();
        let mut factors = factors_for(t.dims(), 2, 1);
        let mut out = Array2::zeros((5, 2));
        assert!(engine.mttkrp(3, &factors, &mut out).is_err());
        let mut wrong_out = Array2::zeros((4, 2));
        assert!(engine.mttkrp(0, &factors, &mut wrong_out).is_err());
        factors[1] = Array2::zeros((4, 3));
        let err = engine.mttkrp(0, &factors, &mut out).unwrap_err();
        assert!(err.to_string().contains("columns"), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn equals_reference_on_random_tensors(
            nmodes in 2usize..=6,
            dim_seed in any::<u64>(),
            nnz in 1usize..4_000,
            rank in prop_oneof![1usize..40, Just(64usize)],
            chunk in prop_oneof![Just(1usize), Just(7), Just(100), Just(CHUNK_NNZ)],
            copies in prop_oneof![Just(CsfCopies::One), Just(CsfCopies::Two), Just(CsfCopies::All)],
            exponent in 0.0f64..1.6,
        ) {
            let dims: Vec<u32> = (0..nmodes)
                .map(|m| 1 + ((dim_seed >> (m * 8)) % 60) as u32)
                .collect();
            let mut spec = PowerLawSpec::new(dims, nnz).with_draws().with_seed(dim_seed);
            spec.exponents = vec![exponent; nmodes];
            let t = power_law(&spec).unwrap();
            check_all_modes(&t, copies, chunk, rank);
        }
    }
}
