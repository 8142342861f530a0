//! Every MTTKRP engine against the f64 reference, one body per case run on
//! each device (`test_device!`): the CPU engines of `kruskal-cpu`
//! everywhere, and the GPU engines of this crate where a CUDA GPU is
//! present. Without a GPU (CI) each `_gpu` test says so on stderr and
//! passes; on a machine with one it runs in a plain `cargo test`, no
//! `--include-ignored` needed. A GPU that is present but fails to open is
//! a failure, not a skip.
//!
//! The cases are those of `kruskal check` (3 to 6 modes with hot rows, the
//! ranks the GPU kernels are compiled for, outputs filled with NaN before
//! every run so an unwritten row fails) and FLYCOO's two properties on a
//! layout whose hot rows are split between partitions: the dynamic remap
//! returns the tensor copy to its original order after modes `0..N`, and
//! with split rows summed in a fixed order two sweeps agree bit for bit.

use std::sync::Arc;

use kruskal_cpu::flycoo::FlycooMttkrp;
use kruskal_cpu::{CpuEngine, mttkrp_reference, relative_error};
use kruskal_device::catalog::{CHECK_MODES, CHECK_RANKS};
use kruskal_device::testing::factors;
use kruskal_device::{FlycooGpu, Gpu, GpuEngine, GpuMttkrp, GpuOptions, build_engine};
use kruskal_formats::SparseTensor;
use kruskal_formats::generate::{PowerLawSpec, power_law};
use kruskal_partition::flycoo::build_flycoo;
use kruskal_partition::layout::LayoutOptions;
use ndarray::Array2;

/// Relative Frobenius error an engine may have against the reference.
const TOLERANCE: f64 = 1e-5;

/// FLYCOO partitions few enough that the hot rows are split between them.
const SPLIT_KAPPA: usize = 7;

/// Where a case runs.
enum Device {
    /// The CPU engines (`kruskal-cpu`).
    Cpu,
    /// The GPU engines of this crate on GPU 0.
    Gpu(Arc<Gpu>),
}

impl Device {
    fn name(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Gpu(_) => "gpu",
        }
    }

    /// Every engine of this device for `t`, with its label: the CPU's five,
    /// or the GPU's four as `build_engine` makes them plus fcoo's other
    /// kernels (fiber reuse; the plain mapping where lane teams are the
    /// default).
    fn engines(&self, t: &SparseTensor) -> Vec<(String, Box<dyn Engine>)> {
        match self {
            Device::Cpu => CpuEngine::ENGINES
                .iter()
                .map(|&k| {
                    let e: Box<dyn Engine> = Box::new(CpuBuilt(k.build(t).expect("a CPU engine")));
                    (format!("cpu {k}"), e)
                })
                .collect(),
            Device::Gpu(gpu) => {
                let mut all: Vec<(String, GpuEngine, GpuOptions)> = GpuEngine::ENGINES
                    .iter()
                    .map(|&k| (format!("gpu {k}"), k, GpuOptions::default()))
                    .collect();
                for (label, fiber, teams) in [("fiber", true, false), ("no teams", false, false)] {
                    let opts = GpuOptions {
                        fiber: Some(fiber),
                        teams: Some(teams),
                        ..GpuOptions::default()
                    };
                    all.push((format!("gpu fcoo {label}"), GpuEngine::Fcoo, opts));
                }
                all.into_iter()
                    .map(|(label, k, opts)| {
                        let e = build_engine(k, gpu.clone(), t, &opts)
                            .unwrap_or_else(|e| panic!("{label}: {e}"));
                        let e: Box<dyn Engine> = Box::new(GpuBuilt(e));
                        (label, e)
                    })
                    .collect()
            }
        }
    }

    /// FLYCOO with split rows summed in a fixed order (the GPU's
    /// deterministic mode; the CPU's is always), and the layout it starts
    /// in.
    fn split_flycoo(&self, t: &SparseTensor) -> Box<dyn Layout> {
        match self {
            Device::Cpu => {
                let e = FlycooMttkrp::new(t, Some(SPLIT_KAPPA)).expect("CPU FLYCOO");
                assert!(
                    e.summaries().iter().any(|s| s.shared_pieces > 0),
                    "no split rows: the case would prove little"
                );
                Box::new(e)
            }
            Device::Gpu(gpu) => {
                let (f, summaries) =
                    build_flycoo(t, &LayoutOptions::new(SPLIT_KAPPA)).expect("FLYCOO layout");
                assert!(
                    summaries.iter().any(|s| s.shared_pieces > 0),
                    "no split rows: the case would prove little"
                );
                let mut e = FlycooGpu::new(gpu.clone(), &f).expect("GPU FLYCOO");
                e.set_deterministic(true);
                Box::new(e)
            }
        }
    }
}

/// One MTTKRP with host operands, whatever the device.
trait Engine {
    fn run(&mut self, mode: usize, factors: &[Array2<f32>], out: &mut Array2<f32>);
}

struct CpuBuilt(Box<dyn kruskal_cpu::MttkrpEngine>);

impl Engine for CpuBuilt {
    fn run(&mut self, mode: usize, factors: &[Array2<f32>], out: &mut Array2<f32>) {
        self.0.mttkrp(mode, factors, out).expect("CPU MTTKRP");
    }
}

struct GpuBuilt(Box<dyn GpuMttkrp>);

impl Engine for GpuBuilt {
    fn run(&mut self, mode: usize, factors: &[Array2<f32>], out: &mut Array2<f32>) {
        self.0.mttkrp_host(mode, factors, out).expect("GPU MTTKRP");
    }
}

/// A FLYCOO engine, whose tensor copy is visible.
trait Layout: Engine + Send {
    /// The mode the copy is arranged for, and its elements in order.
    fn layout(&mut self) -> (usize, Vec<u32>);
}

impl Engine for FlycooMttkrp {
    fn run(&mut self, mode: usize, factors: &[Array2<f32>], out: &mut Array2<f32>) {
        self.mttkrp(mode, factors, out).expect("CPU FLYCOO");
    }
}

impl Layout for FlycooMttkrp {
    fn layout(&mut self) -> (usize, Vec<u32>) {
        (self.current_mode(), self.current_elements())
    }
}

impl Engine for FlycooGpu {
    fn run(&mut self, mode: usize, factors: &[Array2<f32>], out: &mut Array2<f32>) {
        self.mttkrp_host(mode, factors, out).expect("GPU FLYCOO");
    }
}

impl Layout for FlycooGpu {
    fn layout(&mut self) -> (usize, Vec<u32>) {
        let elements = self.current_elements().expect("the GPU's layout");
        (self.current_mode(), elements)
    }
}

/// Runs `$case(&Device)` as two tests: `$cpu` on the CPU, `$gpu` on GPU 0
/// where there is one.
macro_rules! test_device {
    ($case:ident, $cpu:ident, $gpu:ident) => {
        #[test]
        fn $cpu() {
            $case(&Device::Cpu);
        }

        #[test]
        fn $gpu() {
            if let Some(gpu) = kruskal_device::testing::gpu_or_skip(stringify!($gpu)) {
                $case(&Device::Gpu(gpu));
            }
        }
    };
}

/// The check's power-law tensor of `nmodes` modes: every mode's Zipf
/// exponent is above 1, so the hottest row of each holds 10% to 30% of
/// the nonzeros, as in FROSTT's tensors.
fn hot_tensor(nmodes: usize, nnz: usize) -> SparseTensor {
    const DIMS: [u32; 6] = [3_000, 1_700, 900, 400, 150, 60];
    const EXPONENTS: [f64; 6] = [1.3, 1.1, 1.5, 1.2, 1.4, 1.1];
    let mut spec = PowerLawSpec::new(DIMS[..nmodes].to_vec(), nnz).with_seed(nmodes as u64);
    spec.exponents = EXPONENTS[..nmodes].to_vec();
    power_law(&spec).expect("a power-law tensor")
}

/// An output of `rows x rank` NaNs: a row the engine does not write fails.
fn poisoned(rows: u32, rank: usize) -> Array2<f32> {
    Array2::from_elem((rows as usize, rank), f32::NAN)
}

fn every_engine_equals_the_f64_reference(device: &Device) {
    for &nmodes in &CHECK_MODES {
        let t = hot_tensor(nmodes as usize, 40_000);
        let mut engines = device.engines(&t);
        for &rank in &CHECK_RANKS {
            let rank = rank as usize;
            let f = factors(t.dims(), rank, rank as u64);
            let views: Vec<_> = f.iter().map(|a| a.view()).collect();
            for mode in 0..t.nmodes() {
                let exact = mttkrp_reference(&t, &views, mode).expect("the reference");
                for (label, engine) in &mut engines {
                    let mut out = poisoned(t.dims()[mode], rank);
                    engine.run(mode, &f, &mut out);
                    let err = relative_error(out.view(), exact.view());
                    assert!(
                        err < TOLERANCE,
                        "{label}: {nmodes} modes, rank {rank}, mode {mode}: error {err:e}"
                    );
                }
            }
        }
    }
}

test_device!(
    every_engine_equals_the_f64_reference,
    every_cpu_engine_equals_the_f64_reference,
    every_gpu_engine_equals_the_f64_reference
);

fn split_rows_remap_back_and_sum_in_a_fixed_order(device: &Device) {
    for nmodes in [3, 4] {
        let t = hot_tensor(nmodes, 40_000);
        let mut engine = device.split_flycoo(&t);
        let start = engine.layout();
        let rank = 16;
        let f = factors(t.dims(), rank, 5);
        let views: Vec<_> = f.iter().map(|a| a.view()).collect();
        let mut first = Vec::with_capacity(nmodes);
        for mode in 0..nmodes {
            let mut out = poisoned(t.dims()[mode], rank);
            engine.run(mode, &f, &mut out);
            let exact = mttkrp_reference(&t, &views, mode).expect("the reference");
            let err = relative_error(out.view(), exact.view());
            assert!(
                err < TOLERANCE,
                "{} flycoo: {nmodes} modes, mode {mode}: error {err:e}",
                device.name()
            );
            first.push(out);
        }
        // Modes 0..N in order: the copy is back where it started.
        assert_eq!(engine.layout(), start, "{} flycoo: remap", device.name());
        // The CPU's second sweep runs on one thread: its sums must not
        // depend on the thread count either.
        let one_thread = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("a pool of one thread");
        for (mode, before) in first.iter().enumerate() {
            let mut again = poisoned(t.dims()[mode], rank);
            match device {
                Device::Cpu => one_thread.install(|| engine.run(mode, &f, &mut again)),
                Device::Gpu(_) => engine.run(mode, &f, &mut again),
            }
            let same = again
                .iter()
                .zip(before.iter())
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{} flycoo: {nmodes} modes, mode {mode}: two sweeps differ",
                device.name()
            );
        }
    }
}

test_device!(
    split_rows_remap_back_and_sum_in_a_fixed_order,
    cpu_flycoo_remaps_back_and_sums_in_a_fixed_order,
    gpu_flycoo_remaps_back_and_sums_in_a_fixed_order
);
