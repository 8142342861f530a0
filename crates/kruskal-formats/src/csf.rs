//! CSF (compressed sparse fiber), the format of SPLATT (Smith and Karypis,
//! "Tensor-matrix products with a compressed sparse tensor", IA3 2015).
//!
//! A CSF stores the nonzeros as a forest: the modes are taken in a chosen
//! order (`order[0]` at the root, `order[N-1]` at the leaves), and every
//! distinct prefix of coordinates `(i_order[0], .., i_order[d])` is one node
//! at depth `d`. The roots are the nonempty slices of `order[0]`, the nodes
//! at depth 1 their fibers, and so on down to the leaves, one per nonzero.
//! An MTTKRP walking the tree multiplies by the factor row of a node once
//! for all nonzeros below it, instead of once per nonzero.
//!
//! # Layout
//!
//! For `N` modes and `n_d` nodes at depth `d` (`n_{N-1} = nnz`):
//!
//! - `ids[d]`, `n_d` u32: the mode-`order[d]` index of each node at depth
//!   `d`; within one parent the ids are strictly increasing, and so are the
//!   roots;
//! - `ptr[d]`, `n_d + 1` u32 for `d < N - 1`: the children of node `j` at
//!   depth `d` are the nodes `ptr[d][j]..ptr[d][j + 1]` at depth `d + 1`;
//! - `values`, `nnz` f32, in leaf order.
//!
//! Nodes are numbered depth by depth in lexicographic order of their
//! coordinates, so the nonzeros below any node are a contiguous range of
//! leaves.
//!
//! # Storage cost
//!
//! `bytes = 8 nnz + 8 (n_0 + .. + n_{N-2}) + 4 (N - 1)`: 8 bytes per
//! nonzero (leaf index and value) plus 8 per node above the leaves (id and
//! pointer). On a hypersparse tensor every fiber holds one nonzero and a
//! 3-mode CSF takes up to 24 bytes per nonzero; on one whose fibers hold
//! many nonzeros it approaches 8, against 16 for COO.
//!
//! Pointers are 32-bit, so a CSF holds at most `u32::MAX` nonzeros
//! ([`Csf::check_capacity`]).
//!
//! # Mode order
//!
//! SPLATT puts the modes in order of increasing dimension: short modes at
//! the top make few, long fibers, so the factor rows of the upper levels
//! are reused most ([`Csf::shortest_first`]). An MTTKRP computes the mode
//! at the root without writing any row twice, so a CSF per output mode
//! puts that mode at the root and the rest by increasing dimension
//! ([`Csf::root_first`]).

use rayon::prelude::*;

use crate::coo::SparseTensor;
use crate::error::{FormatError, Result};
use crate::fcoo::sort_permutation;

/// A sparse tensor in CSF form; see the [module documentation](self).
#[derive(Clone, Debug, PartialEq)]
pub struct Csf {
    dims: Vec<u32>,
    order: Vec<usize>,
    ids: Vec<Vec<u32>>,
    ptr: Vec<Vec<u32>>,
    values: Vec<f32>,
}

impl Csf {
    /// The modes by increasing dimension (ties to the lower mode): SPLATT's
    /// order for a CSF that serves every mode.
    pub fn shortest_first(dims: &[u32]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..dims.len()).collect();
        order.sort_by_key(|&w| (dims[w], w));
        order
    }

    /// `root` first, then the other modes by increasing dimension: the order
    /// of a CSF built for the MTTKRP of `root`.
    pub fn root_first(dims: &[u32], root: usize) -> Vec<usize> {
        let mut order = vec![root];
        order.extend(
            Self::shortest_first(dims)
                .into_iter()
                .filter(|&w| w != root),
        );
        order
    }

    /// Checks that a CSF can address `nnz` nonzeros (and so every node)
    /// with 32-bit pointers.
    pub fn check_capacity(nnz: u64) -> Result<()> {
        if nnz > u64::from(u32::MAX) {
            return Err(FormatError::Capacity {
                format: "CSF",
                message: format!(
                    "{nnz} nonzeros; 32-bit fiber pointers hold at most {}",
                    u32::MAX
                ),
            });
        }
        Ok(())
    }

    /// Builds the CSF of `tensor` with the modes in `order` (a permutation
    /// of `0..nmodes`, the root first).
    ///
    /// Errors: `order` not a permutation of the modes is
    /// [`FormatError::Argument`]; more than `u32::MAX` nonzeros is
    /// [`FormatError::Capacity`]. Cost: one parallel sort of the nonzeros
    /// by their coordinates in `order`, one gather of every array, and a
    /// parallel pass per level; scratch about 16 bytes per nonzero for the
    /// sort keys and 8 for the permutation.
    pub fn new(tensor: &SparseTensor, order: &[usize]) -> Result<Csf> {
        let nmodes = tensor.nmodes();
        let mut seen = vec![false; nmodes];
        for &w in order {
            if w >= nmodes || std::mem::replace(&mut seen[w], true) {
                return Err(FormatError::Argument(format!(
                    "CSF mode order {order:?} is not a permutation of the {nmodes} modes"
                )));
            }
        }
        if order.len() != nmodes || nmodes == 0 {
            return Err(FormatError::Argument(format!(
                "CSF mode order {order:?} is not a permutation of the {nmodes} modes"
            )));
        }
        Self::check_capacity(tensor.nnz() as u64)?;
        let nnz = tensor.nnz();
        let perm = sort_permutation(tensor, order);
        let sorted: Vec<Vec<u32>> = order
            .iter()
            .map(|&w| {
                let src = tensor.mode_indices(w);
                perm.par_iter().map(|&p| src[p]).collect()
            })
            .collect();
        let values: Vec<f32> = perm.par_iter().map(|&p| tensor.values()[p]).collect();
        drop(perm);

        // first[k]: the shallowest depth whose coordinate differs from the
        // previous nonzero's (0 for the first). Nonzero k starts a node at
        // every depth d >= first[k]. The coordinates are distinct, so every
        // nonzero starts a leaf; a repeat (never in a `SparseTensor`) would
        // be a leaf of its own.
        let leaf = nmodes - 1;
        let first: Vec<u8> = (0..nnz)
            .into_par_iter()
            .map(|k| {
                if k == 0 {
                    return 0;
                }
                sorted
                    .iter()
                    .position(|idx| idx[k] != idx[k - 1])
                    .unwrap_or(leaf) as u8
            })
            .collect();
        // starts[d]: the first nonzero of every node at depth d, ascending.
        let starts: Vec<Vec<u32>> = (0..leaf)
            .map(|d| {
                (0..nnz as u32)
                    .into_par_iter()
                    .filter(|&k| usize::from(first[k as usize]) <= d)
                    .collect()
            })
            .collect();
        drop(first);
        let mut ids: Vec<Vec<u32>> = starts
            .iter()
            .zip(&sorted)
            .map(|(st, idx)| st.par_iter().map(|&k| idx[k as usize]).collect())
            .collect();
        let mut ptr: Vec<Vec<u32>> = Vec::with_capacity(leaf);
        for d in 0..leaf {
            // A node's children begin where it begins; the node numbers of
            // those starts at depth d + 1 are positions in starts[d + 1]
            // (the leaves are the nonzeros themselves).
            let below = starts.get(d + 1);
            let mut p: Vec<u32> = starts[d]
                .par_iter()
                .map(|&k| match below {
                    Some(b) => b.partition_point(|&x| x < k) as u32,
                    None => k,
                })
                .collect();
            p.push(below.map_or(nnz, Vec::len) as u32);
            ptr.push(p);
        }
        drop(starts);
        ids.push(sorted.into_iter().nth(leaf).unwrap_or_default());
        Ok(Csf {
            dims: tensor.dims().to_vec(),
            order: order.to_vec(),
            ids,
            ptr,
            values,
        })
    }

    /// The tensor back in COO form: the same nonzeros in CSF order, with
    /// bit-identical values.
    ///
    /// Cost: one pass over the nodes of every level; memory one copy of the
    /// tensor.
    pub fn to_coo(&self) -> Result<SparseTensor> {
        let nmodes = self.nmodes();
        let nnz = self.nnz();
        let mut indices: Vec<Vec<u32>> = vec![Vec::new(); nmodes];
        // Expand each level to one entry per nonzero: the leaf range of
        // every node, from the bottom up.
        let mut span: Vec<u32> = (0..=nnz as u32).collect();
        for d in (0..nmodes).rev() {
            let ids = &self.ids[d];
            if span.len() != ids.len() + 1 {
                return Err(FormatError::Invalid(format!(
                    "CSF level {d} has {} nodes, its pointers {}",
                    ids.len(),
                    span.len() - 1
                )));
            }
            let mut col = Vec::with_capacity(nnz);
            for (j, &id) in ids.iter().enumerate() {
                let n = span[j + 1].checked_sub(span[j]).ok_or_else(|| {
                    FormatError::Invalid(format!("CSF level {d}: node {j} ends before it starts"))
                })?;
                col.extend(std::iter::repeat_n(id, n as usize));
            }
            indices[self.order[d]] = col;
            if d > 0 {
                span = self.ptr[d - 1]
                    .iter()
                    .map(|&c| span.get(c as usize).copied())
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        FormatError::Invalid(format!("CSF level {}: pointer past the end", d - 1))
                    })?;
            }
        }
        SparseTensor::new(self.dims.clone(), indices, self.values.clone())
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }

    pub fn nmodes(&self) -> usize {
        self.dims.len()
    }

    /// The mode at each depth (`order()[0]` at the root).
    pub fn order(&self) -> &[usize] {
        &self.order
    }

    /// The depth of `mode` in this tree.
    pub fn depth_of(&self, mode: usize) -> Option<usize> {
        self.order.iter().position(|&w| w == mode)
    }

    /// The node ids at `depth`: mode-`order()[depth]` indices.
    pub fn ids(&self, depth: usize) -> &[u32] {
        &self.ids[depth]
    }

    /// The child pointers of the nodes at `depth < nmodes - 1`.
    pub fn ptr(&self, depth: usize) -> &[u32] {
        &self.ptr[depth]
    }

    /// Every level's pointers (`nmodes - 1` of them).
    pub fn ptrs(&self) -> &[Vec<u32>] {
        &self.ptr
    }

    /// Every level's ids (`nmodes` of them).
    pub fn all_ids(&self) -> &[Vec<u32>] {
        &self.ids
    }

    /// The values, in leaf order.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    pub fn nnz(&self) -> usize {
        self.values.len()
    }

    /// Nodes at `depth` (slices at 0, fibers at 1, nonzeros at the leaves).
    pub fn nodes(&self, depth: usize) -> usize {
        self.ids[depth].len()
    }

    /// The leaves below node `node` at `depth`: `lo..hi` in leaf order.
    pub fn leaf_range(&self, depth: usize, node: usize) -> (usize, usize) {
        let (mut lo, mut hi) = (node, node + 1);
        for p in &self.ptr[depth..] {
            lo = p[lo] as usize;
            hi = p[hi] as usize;
        }
        (lo, hi)
    }

    /// Bytes of all arrays (see the module documentation for the formula).
    pub fn bytes(&self) -> usize {
        4 * (self.ids.iter().map(Vec::len).sum::<usize>()
            + self.ptr.iter().map(Vec::len).sum::<usize>()
            + self.values.len())
    }

    /// [`Csf::bytes`] per nonzero (0 for an empty tensor).
    pub fn bytes_per_nnz(&self) -> f64 {
        if self.nnz() == 0 {
            0.0
        } else {
            self.bytes() as f64 / self.nnz() as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{PowerLawSpec, power_law};
    use proptest::prelude::*;

    /// The nonzeros as (coordinates, value bits), sorted.
    fn multiset(t: &SparseTensor) -> Vec<(Vec<u32>, u32)> {
        let mut v: Vec<(Vec<u32>, u32)> = (0..t.nnz())
            .map(|k| {
                let coord = (0..t.nmodes()).map(|w| t.mode_indices(w)[k]).collect();
                (coord, t.values()[k].to_bits())
            })
            .collect();
        v.sort();
        v
    }

    /// Every structural promise of the layout, checked directly.
    fn check_well_formed(c: &Csf) {
        let n = c.nmodes();
        assert_eq!(c.ids(n - 1).len(), c.nnz());
        for d in 0..n - 1 {
            let p = c.ptr(d);
            assert_eq!(p.len(), c.nodes(d) + 1, "depth {d}");
            assert_eq!(p[0], 0);
            assert_eq!(*p.last().unwrap() as usize, c.nodes(d + 1), "depth {d}");
            for j in 0..c.nodes(d) {
                // No empty node; children strictly increasing.
                assert!(p[j] < p[j + 1], "depth {d} node {j} has no children");
                let kids = &c.ids(d + 1)[p[j] as usize..p[j + 1] as usize];
                assert!(kids.windows(2).all(|w| w[0] < w[1]), "depth {d} node {j}");
            }
        }
        assert!(c.ids(0).windows(2).all(|w| w[0] < w[1]), "roots");
        for (d, &w) in c.order().iter().enumerate() {
            assert!(c.ids(d).iter().all(|&i| i < c.dims()[w]));
        }
    }

    #[test]
    fn small_tree_by_hand() {
        // (0,1,0) (0,1,2) (0,2,1) (3,0,0): two slices, three fibers.
        let t = SparseTensor::new(
            vec![4, 3, 3],
            vec![vec![3, 0, 0, 0], vec![0, 1, 2, 1], vec![0, 2, 1, 0]],
            vec![4.0, 2.0, 3.0, 1.0],
        )
        .unwrap();
        let c = Csf::new(&t, &[0, 1, 2]).unwrap();
        assert_eq!(c.ids(0), &[0, 3]);
        assert_eq!(c.ptr(0), &[0, 2, 3]);
        assert_eq!(c.ids(1), &[1, 2, 0]);
        assert_eq!(c.ptr(1), &[0, 2, 3, 4]);
        assert_eq!(c.ids(2), &[0, 2, 1, 0]);
        assert_eq!(c.values(), &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(c.leaf_range(0, 0), (0, 3));
        assert_eq!(c.leaf_range(1, 2), (3, 4));
        // 4 leaves x 8 + 5 upper nodes x 8 + 2 trailing pointers x 4.
        assert_eq!(c.bytes(), 4 * 8 + 5 * 8 + 2 * 4);
        check_well_formed(&c);
    }

    #[test]
    fn orders_put_short_modes_first() {
        assert_eq!(Csf::shortest_first(&[30, 10, 20, 10]), vec![1, 3, 2, 0]);
        assert_eq!(Csf::root_first(&[30, 10, 20, 10], 2), vec![2, 1, 3, 0]);
        assert_eq!(Csf::root_first(&[5], 0), vec![0]);
    }

    #[test]
    fn bad_orders_are_refused() {
        let t = power_law(&PowerLawSpec::new(vec![5, 4, 3], 20)).unwrap();
        for order in [vec![0, 1], vec![0, 1, 1], vec![0, 1, 3], vec![]] {
            let err = Csf::new(&t, &order).unwrap_err();
            assert!(matches!(err, FormatError::Argument(_)), "{order:?}: {err}");
        }
        assert!(matches!(
            Csf::check_capacity(u64::from(u32::MAX) + 1),
            Err(FormatError::Capacity { .. })
        ));
        assert!(Csf::check_capacity(u64::from(u32::MAX)).is_ok());
    }

    #[test]
    fn empty_and_one_mode_tensors() {
        let t = SparseTensor::new(vec![3, 2], vec![vec![], vec![]], vec![]).unwrap();
        let c = Csf::new(&t, &[1, 0]).unwrap();
        assert_eq!(c.nnz(), 0);
        assert_eq!(c.nodes(0), 0);
        assert_eq!(c.bytes_per_nnz(), 0.0);
        assert_eq!(multiset(&c.to_coo().unwrap()), multiset(&t));
        let t = SparseTensor::new(vec![7], vec![vec![3, 1, 6]], vec![1.0, 2.0, 3.0]).unwrap();
        let c = Csf::new(&t, &[0]).unwrap();
        assert_eq!(c.ids(0), &[1, 3, 6]);
        assert_eq!(c.values(), &[2.0, 1.0, 3.0]);
        assert_eq!(multiset(&c.to_coo().unwrap()), multiset(&t));
    }

    #[test]
    fn power_law_fibers_share_upper_nodes() {
        let t = power_law(&PowerLawSpec::new(vec![200, 300, 5_000], 40_000)).unwrap();
        let c = Csf::new(&t, &Csf::shortest_first(t.dims())).unwrap();
        check_well_formed(&c);
        assert_eq!(c.order(), &[0, 1, 2]);
        // Zipf rows: far fewer fibers than nonzeros, so fewer bytes than the
        // 24 per nonzero of a tree without sharing.
        assert!(c.nodes(1) < c.nnz() / 2, "{} fibers", c.nodes(1));
        assert!(c.bytes_per_nnz() < 14.0, "{}", c.bytes_per_nnz());
        for s in 0..c.nodes(0) {
            let (lo, hi) = c.leaf_range(0, s);
            assert!(lo < hi);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Every nonzero appears exactly once, with its value, for any
        /// order; the tree is well formed.
        #[test]
        fn every_nonzero_once_in_any_order(
            nmodes in 2usize..=5,
            dim_seed in any::<u64>(),
            nnz in 1usize..2_000,
            rotate in 0usize..5,
            exponent in 0.0f64..1.6,
        ) {
            let dims: Vec<u32> = (0..nmodes)
                .map(|m| 1 + ((dim_seed >> (m * 8)) % 40) as u32)
                .collect();
            let mut spec = PowerLawSpec::new(dims.clone(), nnz).with_draws().with_seed(dim_seed);
            spec.exponents = vec![exponent; nmodes];
            let t = power_law(&spec).unwrap();
            let mut order: Vec<usize> = (0..nmodes).collect();
            order.rotate_left(rotate % nmodes);
            let c = Csf::new(&t, &order).unwrap();
            if t.nnz() > 0 {
                check_well_formed(&c);
            }
            prop_assert_eq!(c.nnz(), t.nnz());
            prop_assert_eq!(multiset(&c.to_coo().unwrap()), multiset(&t));
            // The leaves are in lexicographic order of the coordinates in
            // `order`.
            let back = c.to_coo().unwrap();
            let key = |k: usize| order.iter().map(|&w| back.mode_indices(w)[k]).collect::<Vec<_>>();
            for k in 1..back.nnz() {
                prop_assert!(key(k - 1) < key(k));
            }
            let upper: usize = (0..nmodes - 1).map(|d| c.nodes(d)).sum();
            prop_assert_eq!(c.bytes(), 8 * c.nnz() + 8 * upper + 4 * (nmodes - 1));
        }
    }
}
