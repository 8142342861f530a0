//! CP-APR on one GPU: the CPU's algorithm ([`crate::apr`]) step by step,
//! its steps run by `kruskal_device::apr` in f64 on the device.
//!
//! The run is [`crate::apr`]'s own driver (`run_steps`: the same outer
//! and inner iterations, stopping rules and outputs); only where the
//! steps run differs. Each mode's sorted copy of the nonzeros is built on
//! the host as the CPU path builds it and uploaded once; the factors,
//! `Phi` and `Pi` live on the GPU. Per inner iteration only the KKT
//! violation comes back; per mode, the kappa flag and the R column
//! norms (lambda stays on the host); per outer iteration, the
//! log-likelihood. The factors come back at the end. Results agree with
//! the CPU's to rounding (sums run in another order), not bit for bit.
//!
//! [`cp_apr_on`] chooses where to run (`auto`: the GPU when one is usable,
//! the rank is one its kernels take and the run fits in its free memory,
//! else the CPU, with the reason).

use std::ops::ControlFlow;
use std::sync::Arc;

use kruskal_device::Gpu;
use kruskal_device::apr::{AprGpu, SortedCopy, device_bytes};
use kruskal_formats::SparseTensor;
use ndarray::Array2;

use crate::apr::{AprIteration, AprModel, AprOptions, AprSteps, ModeRows, check_run, run_steps};
use crate::decompose::{BackendChoice, fallback_reason};
use crate::error::{CpdError, Result};
use crate::memory::{MemoryNeed, bytes_text, host_refusal};

/// What GPU CP-APR takes on the device: each mode's sorted copy (an f64
/// value, the other modes' u32 indices and a row pointer), `Pi`
/// (`nnz x rank` f64), the factors and `Phi` (f64, `dims[m] x rank` per
/// mode) and the partial sums.
///
/// Cost: O(modes).
pub fn apr_gpu_need(dims: &[u32], nnz: usize, rank: usize) -> MemoryNeed {
    MemoryNeed {
        parts: device_bytes(dims, nnz, rank),
    }
}

/// What GPU CP-APR takes on the host besides the tensor: the factors
/// three times (the start, the download, the model), and one mode's
/// sorted copy at a time with its sort's scratch and the copy laid out
/// for the upload.
pub fn apr_gpu_host_need(dims: &[u32], nnz: usize, rank: usize) -> MemoryNeed {
    let rows: u64 = dims.iter().map(|&d| u64::from(d)).sum();
    let largest = dims.iter().copied().max().map_or(0, u64::from);
    let nnz = nnz as u64;
    let per_copy = nnz
        .saturating_mul(8 + 4 * (dims.len() as u64).saturating_sub(1))
        .saturating_add(largest.saturating_add(1).saturating_mul(8));
    MemoryNeed {
        parts: vec![
            (
                "factors",
                rows.saturating_mul(rank as u64)
                    .saturating_mul(8)
                    .saturating_mul(3),
            ),
            ("sorted copy", per_copy.saturating_mul(2)),
            (
                "sort scratch",
                nnz.saturating_add(largest)
                    .saturating_add(1)
                    .saturating_mul(8),
            ),
        ],
    }
}

/// Why this GPU cannot take the run (`None` when it can): a rank its
/// kernels do not take, or a need beyond its free memory. One line.
pub fn gpu_refusal(rank: usize, need: &MemoryNeed, free_bytes: u64) -> Option<String> {
    if let Err(e) = kruskal_device::apr::check_rank(rank) {
        return Some(kruskal_device::error_line(&e));
    }
    (need.total() > free_bytes).then(|| {
        format!(
            "CP-APR needs {need} on the GPU and {} are free there",
            bytes_text(free_bytes)
        )
    })
}

/// The steps on one GPU.
struct GpuSteps {
    apr: AprGpu,
    nmodes: usize,
}

impl GpuSteps {
    /// Allocates the device's arrays (after checking they fit), uploads
    /// the factors and each mode's sorted copy, built on the host one at a
    /// time.
    fn new(
        gpu: Arc<Gpu>,
        tensor: &SparseTensor,
        factors: &[Array2<f64>],
        rank: usize,
    ) -> Result<Self> {
        let mut apr = AprGpu::new(gpu, tensor.dims(), tensor.nnz(), rank)?;
        apr.set_factors(factors)?;
        for m in 0..tensor.nmodes() {
            let rows = ModeRows::new(tensor, m);
            let row_ptr: Vec<u64> = rows.row_ptr.iter().map(|&p| p as u64).collect();
            let other = rows.other.concat();
            apr.upload_copy(
                m,
                &SortedCopy {
                    row_ptr: &row_ptr,
                    values: &rows.values,
                    other: &other,
                },
            )?;
        }
        Ok(GpuSteps {
            apr,
            nmodes: tensor.nmodes(),
        })
    }
}

impl AprSteps for GpuSteps {
    fn kappa_fold(&mut self, n: usize, kappa: Option<(f64, f64)>, lambda: &[f64]) -> Result<bool> {
        Ok(self.apr.kappa_fold(n, kappa, lambda)?)
    }

    fn form_pi(&mut self, n: usize) -> Result<()> {
        Ok(self.apr.form_pi(n)?)
    }

    fn phi(&mut self, n: usize, eps_div_zero: f64) -> Result<f64> {
        Ok(self.apr.phi(n, eps_div_zero)?)
    }

    fn update(&mut self, n: usize) -> Result<()> {
        Ok(self.apr.update(n)?)
    }

    fn normalize(&mut self, n: usize, lambda: &mut [f64]) -> Result<()> {
        // As the CPU's normalize_mode: a zero column stays zero, its
        // weight becomes 0.
        let norms = self.apr.column_sums(n)?;
        let inv: Vec<f64> = norms
            .iter()
            .map(|&x| if x > 0.0 { 1.0 / x } else { 1.0 })
            .collect();
        for (l, &x) in lambda.iter_mut().zip(&norms) {
            *l *= x;
        }
        Ok(self.apr.scale(n, &inv)?)
    }

    fn log_likelihood(&mut self, lambda: &[f64]) -> Result<f64> {
        let sum = self.apr.log_likelihood_sum(lambda)?;
        // The whole model's sum: lambda_r times the product of column sums
        // (the factors are non-negative, so the 1-norms).
        let mut totals = lambda.to_vec();
        for m in 0..self.nmodes {
            for (t, s) in totals.iter_mut().zip(self.apr.column_sums(m)?) {
                *t *= s;
            }
        }
        Ok(sum - totals.iter().sum::<f64>())
    }

    fn factors(&mut self) -> Result<Vec<Array2<f64>>> {
        Ok(self.apr.factors()?)
    }
}

/// `Phi_n` and the KKT violation of every mode n on `gpu` for `factors`
/// as they are (no lambda, no kappa fix), by the GPU's steps: the sorted
/// copies built and uploaded as a run does, then per mode `Pi` and `Phi`,
/// downloaded. For `kruskal check`, which compares them with a naive f64
/// computation.
///
/// Shapes: `factors[m]` is `dims[m] x rank` for every mode, rank 1 to
/// [`kruskal_device::apr::MAX_RANK`].
#[doc(hidden)]
pub fn phi_gpu(
    gpu: Arc<Gpu>,
    tensor: &SparseTensor,
    factors: &[Array2<f64>],
    eps_div_zero: f64,
) -> Result<Vec<(Array2<f64>, f64)>> {
    let rank = crate::apr::check_factor_shapes(tensor, factors)?;
    let mut steps = GpuSteps::new(gpu, tensor, factors, rank)?;
    (0..tensor.nmodes())
        .map(|n| {
            steps.apr.form_pi(n)?;
            let kkt = steps.apr.phi(n, eps_div_zero)?;
            Ok((steps.apr.phi_host(n)?, kkt))
        })
        .collect()
}

/// Runs CP-APR on `gpu`: the same options, stopping rules and outputs as
/// [`crate::apr::cp_apr`]. Refuses, before allocating, a rank above
/// [`kruskal_device::apr::MAX_RANK`] and a run beyond the GPU's free
/// memory ([`apr_gpu_need`]) or the host's ([`apr_gpu_host_need`]).
pub fn cp_apr_gpu(
    gpu: Arc<Gpu>,
    tensor: &SparseTensor,
    opts: &AprOptions,
    on_iteration: &mut dyn FnMut(&AprIteration) -> ControlFlow<()>,
) -> Result<AprModel> {
    check_run(tensor, opts)?;
    let (dims, nnz, rank) = (tensor.dims(), tensor.nnz(), opts.rank);
    let host = apr_gpu_host_need(dims, nnz, rank);
    if let Some(refusal) = host_refusal(&host, tensor, false) {
        return Err(CpdError::memory(format!("CP-APR: {refusal}")));
    }
    let need = apr_gpu_need(dims, nnz, rank);
    if let Some(why) = gpu_refusal(rank, &need, gpu.free_bytes()? as u64) {
        return Err(CpdError::Gpu(why));
    }
    run_steps(
        tensor,
        opts,
        |factors| GpuSteps::new(gpu, tensor, &factors, rank),
        on_iteration,
    )
}

/// A CP-APR run and where it ran.
#[derive(Clone, Debug)]
pub struct AprRun {
    pub model: AprModel,
    /// `"cpu"` or `"gpu"`.
    pub backend: &'static str,
    /// The GPU's name, when it ran on one.
    pub device: Option<String>,
    /// Why `auto` did not use the GPU.
    pub fallback: Option<String>,
}

/// Where a run goes, from the choice and what the GPU said.
#[derive(Debug, PartialEq)]
enum Placement {
    Gpu,
    Cpu { why: Option<String> },
    Refused(String),
}

/// `gpu`: the GPU's free bytes, or why none can be used.
fn place(
    choice: BackendChoice,
    gpu: std::result::Result<u64, String>,
    rank: usize,
    need: &MemoryNeed,
) -> Placement {
    if choice == BackendChoice::Cpu {
        return Placement::Cpu { why: None };
    }
    let why = match gpu {
        Ok(free) => match gpu_refusal(rank, need, free) {
            None => return Placement::Gpu,
            Some(why) => why,
        },
        Err(why) => why,
    };
    match choice {
        BackendChoice::Gpu => Placement::Refused(why),
        _ => Placement::Cpu { why: Some(why) },
    }
}

/// Runs CP-APR where `backend` says: the CPU, the first GPU, or (`Auto`)
/// the GPU when one opens, takes the rank and has the memory, else the CPU
/// with the reason in [`AprRun::fallback`].
pub fn cp_apr_on(
    tensor: &SparseTensor,
    opts: &AprOptions,
    backend: BackendChoice,
    on_iteration: &mut dyn FnMut(&AprIteration) -> ControlFlow<()>,
) -> Result<AprRun> {
    check_run(tensor, opts)?;
    let need = apr_gpu_need(tensor.dims(), tensor.nnz(), opts.rank);
    let (gpu, status) = if backend == BackendChoice::Cpu {
        (None, Ok(0))
    } else {
        match Gpu::open(0) {
            Ok(gpu) => {
                let free = gpu
                    .free_bytes()
                    .map(|b| b as u64)
                    .map_err(|e| kruskal_device::error_line(&e));
                (Some(gpu), free)
            }
            // `gpu`: the device's own error, typed (a missing library
            // says what was tried).
            Err(e) if backend == BackendChoice::Gpu => return Err(e.into()),
            Err(e) => (None, Err(fallback_reason(&e.into()))),
        }
    };
    match (place(backend, status, opts.rank, &need), gpu) {
        (Placement::Gpu, Some(gpu)) => {
            let device = Some(gpu.properties().name.clone());
            let model = cp_apr_gpu(gpu, tensor, opts, on_iteration)?;
            Ok(AprRun {
                model,
                backend: "gpu",
                device,
                fallback: None,
            })
        }
        (Placement::Cpu { why }, _) => Ok(AprRun {
            model: crate::apr::cp_apr(tensor, opts, on_iteration)?,
            backend: "cpu",
            device: None,
            fallback: why,
        }),
        (Placement::Refused(why), _) => Err(CpdError::Gpu(why)),
        (Placement::Gpu, None) => Err(CpdError::Gpu("no GPU was opened".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_need_counts_copies_pi_factors_and_phi() {
        // 3 modes, 10 nonzeros, rank 2: copies 3 x 10 x 16 + (9 + 3) x 8,
        // Pi 160, factors and Phi 144 each, and the partial sums.
        let need = apr_gpu_need(&[4, 3, 2], 10, 2);
        assert!(need.total() >= 576 + 160 + 288);
        assert!(need.to_string().contains("sorted copies"));
        let host = apr_gpu_host_need(&[4, 3, 2], 10, 2);
        // Factors 3 x 144; the copy (160 + 40) twice; scratch (10 + 5) x 8.
        assert_eq!(host.total(), 432 + 400 + 120);
    }

    #[test]
    fn the_backend_choice_says_why() {
        let need = apr_gpu_need(&[100, 100, 100], 10_000, 8);
        let plenty = 1u64 << 40;
        use BackendChoice::*;
        assert_eq!(
            place(Cpu, Ok(plenty), 8, &need),
            Placement::Cpu { why: None }
        );
        assert_eq!(place(Gpu, Ok(plenty), 8, &need), Placement::Gpu);
        assert_eq!(place(Auto, Ok(plenty), 8, &need), Placement::Gpu);
        // No GPU: auto says why, gpu refuses.
        let none = || Err("no CUDA driver library was found".to_string());
        assert_eq!(
            place(Auto, none(), 8, &need),
            Placement::Cpu {
                why: Some("no CUDA driver library was found".into())
            }
        );
        assert!(matches!(
            place(Gpu, none(), 8, &need),
            Placement::Refused(_)
        ));
        // Too little memory: a one-line reason with the need and the free
        // bytes.
        let Placement::Cpu { why: Some(why) } = place(Auto, Ok(1000), 8, &need) else {
            panic!("auto should fall back");
        };
        assert!(
            why.starts_with("CP-APR needs") && why.contains("free there") && !why.contains('\n'),
            "{why}"
        );
        let Placement::Refused(why) = place(Gpu, Ok(1000), 8, &need) else {
            panic!("gpu should refuse");
        };
        assert!(why.contains("Pi"), "{why}");
        // A rank the kernels do not take.
        let big = apr_gpu_need(&[10, 10], 10, 300);
        let Placement::Cpu { why: Some(why) } = place(Auto, Ok(plenty), 300, &big) else {
            panic!("auto should fall back");
        };
        assert!(why.contains("ranks 1 to 256"), "{why}");
    }

    fn tiny() -> SparseTensor {
        SparseTensor::new(
            vec![3, 2, 2],
            vec![vec![0, 1, 2], vec![0, 1, 1], vec![1, 0, 1]],
            vec![1.0, 2.0, 3.0],
        )
        .unwrap()
    }

    #[test]
    fn cpu_runs_say_they_ran_on_the_cpu() {
        let t = tiny();
        let mut opts = AprOptions::new(2);
        opts.max_iters = 2;
        let run = cp_apr_on(&t, &opts, BackendChoice::Cpu, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(run.backend, "cpu");
        assert!(run.fallback.is_none() && run.device.is_none());
        let alone = crate::apr::cp_apr(&t, &opts, &mut |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(run.model.factors, alone.factors);
        // Bad input is refused the same way on every backend.
        opts.kappa = -1.0;
        for b in [BackendChoice::Cpu, BackendChoice::Gpu, BackendChoice::Auto] {
            assert!(matches!(
                cp_apr_on(&t, &opts, b, &mut |_| ControlFlow::Continue(())),
                Err(CpdError::Option(_))
            ));
        }
    }

    #[test]
    fn auto_without_a_gpu_runs_on_the_cpu_and_says_why() {
        if Gpu::count().is_ok_and(|n| n > 0) {
            return; // the fallback is for machines without a usable GPU
        }
        let t = tiny();
        let mut opts = AprOptions::new(2);
        opts.max_iters = 1;
        let run = cp_apr_on(&t, &opts, BackendChoice::Auto, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(run.backend, "cpu");
        assert!(run.fallback.unwrap().contains("CUDA"));
        let e = cp_apr_on(&t, &opts, BackendChoice::Gpu, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap_err();
        assert!(matches!(e, CpdError::Device(_)), "{e}");
    }
}
