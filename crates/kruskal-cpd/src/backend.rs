//! The `Backend` trait: what CPD-ALS asks of the hardware, and its CPU
//! implementation.
//!
//! The trait is cut so that large arrays never have to leave a backend: the
//! driver in `als.rs` only sends and receives R x R matrices and length-R
//! vectors. A GPU backend keeps the tensor, factors and MTTKRP output on the
//! device; the CPU backend keeps them in host memory.

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use kruskal_cpu::{CpuEngine, CpuMttkrp, MttkrpEngine};
use kruskal_device::admm::{InnerParams, InnerStats};
use kruskal_formats::SparseTensor;
use ndarray::Array2;
use rayon::prelude::*;

use std::sync::Arc;

use crate::admm::DataRows;
use crate::error::{CpdError, Result};

/// Rows handled by one task of the dense row-wise kernels.
const ROWS_PER_TASK: usize = 4096;

/// Per-column norms of a freshly solved factor, for lambda.
#[derive(Clone, Debug, PartialEq)]
pub struct ColumnNorms {
    /// 2-norms.
    pub two: Vec<f64>,
    /// Largest absolute values.
    pub max_abs: Vec<f64>,
}

/// The operations of one CPD-ALS iteration.
///
/// Contract: `load_factors` comes first; `solve_update(n)` uses the MTTKRP
/// output of the last `mttkrp(n)`; `inner_products(n)` uses the MTTKRP of
/// the last `mttkrp(n)` and the current factor `n`.
pub trait Backend {
    /// A short description for logs ("cpu, 16 threads").
    fn describe(&self) -> String;
    fn dims(&self) -> &[u32];
    /// Squared Frobenius norm of the tensor.
    fn tensor_norm_sq(&self) -> f64;
    /// Takes every factor (`dims[m] x rank`).
    fn load_factors(&mut self, factors: Vec<Array2<f32>>) -> Result<()>;
    /// `A_m^T A_m` in f64.
    fn gram(&mut self, mode: usize) -> Result<Array2<f64>>;
    /// `M = MTTKRP(X, mode)` with the current factors, kept by the backend.
    /// May return before the work is done (a GPU queues it); see `sync`.
    fn mttkrp(&mut self, mode: usize) -> Result<()>;
    /// Waits until the queued work is done (for timing); a no-op where
    /// every call completes before returning.
    fn sync(&mut self) -> Result<()> {
        Ok(())
    }
    /// The last MTTKRP's time (s) where `sync` left the wait to
    /// `solve_update` (a backend whose update waits for the MTTKRP on the
    /// devices, with no round trip of its own); `None` elsewhere. The
    /// driver then splits the host's time of the two by it.
    fn take_waited_mttkrp_s(&mut self) -> Option<f64> {
        None
    }
    /// `A_mode = M W` (W: rank x rank); returns the new columns' norms.
    fn solve_update(&mut self, mode: usize, w: &Array2<f64>) -> Result<ColumnNorms>;
    /// Divides column r of `A_mode` by `divisors[r]`; returns its new Gram.
    fn scale_and_gram(&mut self, mode: usize, divisors: &[f64]) -> Result<Array2<f64>>;
    /// `sum_i M(i, r) A_mode(i, r)` for every r.
    fn inner_products(&mut self, mode: usize) -> Result<Vec<f64>>;
    /// Loads seeded uniform factors in [0, 1): [`crate::random_factors`]
    /// of `dims()`, `rank` and `seed`. The default draws them on the host
    /// and calls `load_factors`; a GPU draws the same numbers itself.
    fn load_random(&mut self, rank: usize, seed: u64) -> Result<()> {
        let factors = crate::random_factors(self.dims(), rank, seed);
        self.load_factors(factors)
    }
    /// Hands the factors back (the backend needs `load_factors` again
    /// before further use).
    fn take_factors(&mut self) -> Result<Vec<Array2<f32>>>;
    /// Hands the factors back arranged with weights `lambda`, as
    /// [`crate::arrange`] does, never flipping the modes marked in
    /// `keep_sign`; returns the new weights and the factors. The default
    /// arranges on the host after `take_factors`; a GPU computes the
    /// column statistics on the device and arranges the rows as they
    /// arrive.
    fn take_arranged(
        &mut self,
        lambda: Vec<f64>,
        keep_sign: &[bool],
    ) -> Result<(Vec<f64>, Vec<Array2<f32>>)> {
        let factors = self.take_factors()?;
        Ok(crate::als::arrange_keeping_signs(
            lambda, factors, keep_sign,
        ))
    }
    /// The output of the last `mttkrp(mode)`, copied to the host
    /// (`dims[mode] x rank`), for updates computed on the host (AO-ADMM).
    /// The default is an error: the GPU backends do not provide it yet.
    fn mttkrp_output(&mut self, mode: usize) -> Result<Array2<f32>> {
        Err(CpdError::Backend(format!(
            "the {} backend cannot copy the mode-{} MTTKRP to the host",
            self.describe(),
            mode + 1
        )))
    }
    /// Whether AO-ADMM's inner loop runs in the backend
    /// ([`Backend::admm_inner`], [`Backend::admm_scale`]), which then keeps
    /// each mode's H and U itself; otherwise the update runs on the host
    /// through [`Backend::mttkrp_output`] and [`Backend::set_factor`].
    fn runs_admm(&self) -> bool {
        false
    }
    /// AO-ADMM's inner loop of `mode`, each row to its own stopping rule
    /// ([`crate::admm::BLOCK_ROWS`] = 1), from
    /// the last `mttkrp(mode)` and `w = (G + rho I)^{-1}` (rank x rank);
    /// H starts from the current factor at the mode's first call (U from
    /// 0) and is kept between calls. Returns the column statistics of the
    /// f32 rounding of the new H. The default is an error: only backends
    /// that [`Backend::runs_admm`] provide it.
    fn admm_inner(
        &mut self,
        mode: usize,
        w: &Array2<f64>,
        params: &InnerParams,
    ) -> Result<InnerStats> {
        let _ = (w, params);
        Err(CpdError::Backend(format!(
            "the {} backend does not run the ADMM of mode {}",
            self.describe(),
            mode + 1
        )))
    }
    /// Divides column r of `mode`'s H and U by `divisors[r]` and makes the
    /// f32 rounding of the scaled H the factor; returns its Gram. Follows
    /// [`Backend::admm_inner`] of the same mode; the default is an error,
    /// as for it.
    fn admm_scale(&mut self, mode: usize, divisors: &[f64]) -> Result<Array2<f64>> {
        let _ = divisors;
        Err(CpdError::Backend(format!(
            "the {} backend does not run the ADMM of mode {}",
            self.describe(),
            mode + 1
        )))
    }
    /// Gives AO-ADMM the rows of each mode that hold a nonzero: its inner
    /// loop then runs on those rows only (every other row's solution is
    /// 0). The default keeps
    /// nothing: the loop runs on every row. Set before the run starts.
    fn set_data_rows(&mut self, rows: Arc<DataRows>) -> Result<()> {
        let _ = rows;
        Ok(())
    }
    /// The rows [`Backend::set_data_rows`] gave, where the backend keeps
    /// them for the host's inner loop.
    fn data_rows(&self) -> Option<Arc<DataRows>> {
        None
    }
    /// Replaces factor `mode` with `factor` (`dims[mode] x rank`), computed
    /// on the host. The default is an error, as for `mttkrp_output`.
    fn set_factor(&mut self, mode: usize, factor: Array2<f32>) -> Result<()> {
        let _ = factor;
        Err(CpdError::Backend(format!(
            "the {} backend cannot take the mode-{} factor from the host",
            self.describe(),
            mode + 1
        )))
    }
}

/// The CPU backend: an MTTKRP engine (by default [`CpuMttkrp`]) plus rayon
/// row-parallel dense kernels.
pub struct CpuBackend {
    engine: Box<dyn MttkrpEngine>,
    norm_sq: f64,
    factors: Vec<Array2<f32>>,
    /// MTTKRP output, one per mode (allocated on first use).
    mttkrp_out: Vec<Option<Array2<f32>>>,
    /// AO-ADMM's rows with data ([`Backend::set_data_rows`]).
    data_rows: Option<Arc<DataRows>>,
}

impl CpuBackend {
    /// Prepares the tensor for the default engine (one sorted copy per
    /// mode).
    pub fn new(tensor: &SparseTensor) -> Self {
        Self::with_engine(tensor, Box::new(CpuMttkrp::new(tensor)))
    }

    /// Prepares the tensor for the engine `kernel` names.
    pub fn with_kernel(tensor: &SparseTensor, kernel: CpuEngine) -> Result<Self> {
        let engine = kernel.build(tensor)?;
        Ok(Self::with_engine(tensor, engine))
    }

    fn with_engine(tensor: &SparseTensor, engine: Box<dyn MttkrpEngine>) -> Self {
        CpuBackend {
            engine,
            norm_sq: tensor.norm_sq(),
            factors: Vec::new(),
            mttkrp_out: vec![None; tensor.nmodes()],
            data_rows: None,
        }
    }

    /// The MTTKRP engine's name (`sorted`, `fcoo`, `flycoo`, `hicoo`).
    pub fn kernel_name(&self) -> &'static str {
        self.engine.name()
    }

    /// Bytes held for the tensor's per-mode copies.
    pub fn tensor_bytes(&self) -> usize {
        self.engine.bytes()
    }

    fn rank(&self) -> usize {
        self.factors.first().map_or(0, |f| f.ncols())
    }

    fn output(&self, mode: usize) -> Result<&Array2<f32>> {
        self.mttkrp_out
            .get(mode)
            .and_then(Option::as_ref)
            .ok_or_else(|| CpdError::Backend(format!("no MTTKRP computed for mode {mode}")))
    }
}

/// Elementwise sum of two equal-length vectors.
///
/// Every floating-point reduction here collects one partial per block, in
/// block order, and adds them sequentially: rayon's `reduce` combines in an
/// order set by work stealing, and f64 addition is not associative, so runs
/// with the same seed would differ in their last bits.
fn add_vecs(mut a: Vec<f64>, b: Vec<f64>) -> Vec<f64> {
    a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
    a
}

/// The row-major storage of a factor-shaped matrix.
fn rows_of(a: &Array2<f32>) -> &[f32] {
    a.as_slice().expect("factors are kept in standard layout")
}

/// A block of f32 rows widened to f64 (the dense kernels run in f64).
fn widen(block: &[f32]) -> Vec<f64> {
    block.iter().map(|&x| f64::from(x)).collect()
}

/// Gram `A^T A` of a row-major matrix in f64: per row block a faer matrix
/// product (blocked and vectorized), blocks in parallel, partial Grams
/// summed. Cost: rows * rank^2 multiply-adds.
fn gram_of(a: &Array2<f32>) -> Array2<f64> {
    let rank = a.ncols();
    if rank == 0 {
        return Array2::zeros((0, 0));
    }
    let g = rows_of(a)
        .par_chunks(ROWS_PER_TASK * rank)
        .map(|block| {
            let rows = block.len() / rank;
            let wide = widen(block);
            let x = MatRef::from_row_major_slice(&wide, rows, rank);
            let mut g = vec![0f64; rank * rank];
            matmul(
                MatMut::from_row_major_slice_mut(&mut g, rank, rank),
                Accum::Replace,
                x.transpose(),
                x,
                1.0,
                Par::Seq,
            );
            g
        })
        .collect::<Vec<_>>()
        .into_iter()
        .fold(vec![0f64; rank * rank], add_vecs);
    Array2::from_shape_vec((rank, rank), g).expect("rank * rank entries")
}

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        format!(
            "cpu, {}, {} kernel",
            crate::memory::count_of(rayon::current_num_threads() as u64, "thread"),
            self.engine.name()
        )
    }

    fn dims(&self) -> &[u32] {
        self.engine.dims()
    }

    fn tensor_norm_sq(&self) -> f64 {
        self.norm_sq
    }

    fn load_factors(&mut self, factors: Vec<Array2<f32>>) -> Result<()> {
        crate::check_factor_shapes(self.dims(), &factors)?;
        // Moved, not copied: at tens of millions of rows a copy of the
        // factors costs seconds. Only a non-standard layout is rewritten.
        self.factors = factors
            .into_iter()
            .map(|f| {
                if f.is_standard_layout() {
                    f
                } else {
                    f.as_standard_layout().into_owned()
                }
            })
            .collect();
        Ok(())
    }

    fn gram(&mut self, mode: usize) -> Result<Array2<f64>> {
        Ok(gram_of(&self.factors[mode]))
    }

    fn mttkrp(&mut self, mode: usize) -> Result<()> {
        let rank = self.rank();
        let mut out = match self.mttkrp_out[mode].take() {
            Some(out) => out,
            None => Array2::zeros((self.dims()[mode] as usize, rank)),
        };
        self.engine.mttkrp(mode, &self.factors, &mut out)?;
        self.mttkrp_out[mode] = Some(out);
        Ok(())
    }

    fn solve_update(&mut self, mode: usize, w: &Array2<f64>) -> Result<ColumnNorms> {
        let rank = self.rank();
        let m = self
            .mttkrp_out
            .get(mode)
            .and_then(Option::as_ref)
            .ok_or_else(|| CpdError::Backend(format!("no MTTKRP computed for mode {mode}")))?;
        let w = w.as_standard_layout();
        let w = w.as_slice().expect("standard layout");
        let m = rows_of(m);
        let a = self.factors[mode]
            .as_slice_mut()
            .expect("factors are kept in standard layout");
        let w = MatRef::from_row_major_slice(w, rank, rank);
        let (sumsq, maxabs) = a
            .par_chunks_mut(ROWS_PER_TASK * rank)
            .zip(m.par_chunks(ROWS_PER_TASK * rank))
            .map(|(a_block, m_block)| {
                let rows = m_block.len() / rank;
                let wide = widen(m_block);
                let mut out = vec![0f64; rows * rank];
                matmul(
                    MatMut::from_row_major_slice_mut(&mut out, rows, rank),
                    Accum::Replace,
                    MatRef::from_row_major_slice(&wide, rows, rank),
                    w,
                    1.0,
                    Par::Seq,
                );
                let mut sumsq = vec![0f64; rank];
                let mut maxabs = vec![0f64; rank];
                for (a_row, o_row) in a_block.chunks_exact_mut(rank).zip(out.chunks_exact(rank)) {
                    for (r, (dst, &x)) in a_row.iter_mut().zip(o_row).enumerate() {
                        let x32 = x as f32;
                        *dst = x32;
                        let x = f64::from(x32);
                        sumsq[r] += x * x;
                        maxabs[r] = maxabs[r].max(x.abs());
                    }
                }
                (sumsq, maxabs)
            })
            .collect::<Vec<_>>()
            .into_iter()
            .fold(
                (vec![0f64; rank], vec![0f64; rank]),
                |(s, mut m), (s2, m2)| {
                    m.iter_mut().zip(&m2).for_each(|(a, b)| *a = a.max(*b));
                    (add_vecs(s, s2), m)
                },
            );
        Ok(ColumnNorms {
            two: sumsq.into_iter().map(f64::sqrt).collect(),
            max_abs: maxabs,
        })
    }

    fn scale_and_gram(&mut self, mode: usize, divisors: &[f64]) -> Result<Array2<f64>> {
        let inv: Vec<f32> = divisors.iter().map(|&d| (1.0 / d) as f32).collect();
        let a = self.factors[mode]
            .as_slice_mut()
            .expect("factors are kept in standard layout");
        a.par_chunks_mut(ROWS_PER_TASK * inv.len())
            .for_each(|block| {
                for row in block.chunks_exact_mut(inv.len()) {
                    row.iter_mut().zip(&inv).for_each(|(x, &s)| *x *= s);
                }
            });
        self.gram(mode)
    }

    fn inner_products(&mut self, mode: usize) -> Result<Vec<f64>> {
        let rank = self.rank();
        let m = self.output(mode)?;
        let a = rows_of(&self.factors[mode]);
        Ok(a.par_chunks(ROWS_PER_TASK * rank)
            .zip(rows_of(m).par_chunks(ROWS_PER_TASK * rank))
            .map(|(a, m)| {
                let mut s = vec![0f64; rank];
                for (a_row, m_row) in a.chunks_exact(rank).zip(m.chunks_exact(rank)) {
                    for ((acc, &x), &y) in s.iter_mut().zip(a_row).zip(m_row) {
                        *acc += f64::from(x) * f64::from(y);
                    }
                }
                s
            })
            .collect::<Vec<_>>()
            .into_iter()
            .fold(vec![0f64; rank], add_vecs))
    }

    fn take_factors(&mut self) -> Result<Vec<Array2<f32>>> {
        Ok(std::mem::take(&mut self.factors))
    }

    fn mttkrp_output(&mut self, mode: usize) -> Result<Array2<f32>> {
        Ok(self.output(mode)?.clone())
    }

    fn set_data_rows(&mut self, rows: Arc<DataRows>) -> Result<()> {
        rows.check(self.engine.dims())?;
        self.data_rows = Some(rows);
        Ok(())
    }

    fn data_rows(&self) -> Option<Arc<DataRows>> {
        self.data_rows.clone()
    }

    fn set_factor(&mut self, mode: usize, factor: Array2<f32>) -> Result<()> {
        let (rows, rank) = (self.dims()[mode] as usize, self.rank());
        if factor.dim() != (rows, rank) {
            return Err(CpdError::Shape(format!(
                "factor of mode {} is {} x {}, expected {rows} x {rank}",
                mode + 1,
                factor.nrows(),
                factor.ncols()
            )));
        }
        self.factors[mode] = factor.as_standard_layout().into_owned();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gram_is_summed_in_a_fixed_order() {
        // Block Grams 1e16, 1, 1 (blocks of 4096 rows): see the norm test in
        // kruskal-formats; any order but left to right gives 1e16 + 2.
        let mut a = Array2::<f32>::zeros((3 * ROWS_PER_TASK, 1));
        a[[0, 0]] = 1e8;
        a[[ROWS_PER_TASK, 0]] = 1.0;
        a[[2 * ROWS_PER_TASK, 0]] = 1.0;
        for threads in [1, 2, 3, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            assert_eq!(
                pool.install(|| gram_of(&a))[[0, 0]],
                1e16,
                "{threads} threads"
            );
        }
    }

    #[test]
    fn gram_matches_matrix_product() {
        let a = Array2::from_shape_fn((5000, 3), |(i, j)| ((i * 7 + j * 3) % 11) as f32 - 5.0);
        let g = gram_of(&a);
        let a64 = a.mapv(f64::from);
        let expect = a64.t().dot(&a64);
        assert!(
            g.iter()
                .zip(expect.iter())
                .all(|(x, y)| (x - y).abs() < 1e-9)
        );
    }
}
