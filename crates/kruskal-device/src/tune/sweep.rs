//! Timing every configuration of one tensor on the GPU: each engine is
//! built once per configuration and timed at every rank (building the
//! format on the host is the slow part), all modes in mode order as CPD-ALS
//! calls them, with CUDA events ([`GpuMttkrp::time_sweeps`]); the median of
//! each mode is kept.

use std::sync::Arc;
use std::time::Instant;

use kruskal_formats::SparseTensor;
use kruskal_tune::{Config, Failure, Run};

use super::ConfigEngine;
use crate::factors::DeviceFactors;
use crate::{Gpu, GpuMttkrp, Result, build_engine};

/// What to time.
#[derive(Clone, Debug, PartialEq)]
pub struct SweepOptions {
    pub ranks: Vec<usize>,
    pub configs: Vec<Config>,
    /// Timed sweeps over all modes after one warm-up sweep.
    pub repeat: usize,
}

impl Default for SweepOptions {
    fn default() -> Self {
        SweepOptions {
            ranks: vec![16, 32, 64],
            configs: Config::space(),
            repeat: 5,
        }
    }
}

/// Median of a non-empty slice (the mean of the middle two for even
/// lengths).
pub fn median(v: &[f32]) -> f64 {
    let mut s: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => s[n / 2],
        _ => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

/// Factor rows for timing: every mode's rows in one buffer, values in
/// `[0.25, 0.72]` from a cheap hash (the engines' speed does not depend on
/// them; zeros are avoided so no path can skip work). Filled in parallel:
/// the huge FROSTT dimensions make gigabytes of them.
fn timing_factors(dims: &[u32], rank: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let len = dims.iter().map(|&d| d as usize).sum::<usize>() * rank;
    (0..len)
        .into_par_iter()
        .map(|k| 0.25 + ((k as u32).wrapping_mul(2_654_435_761) >> 28) as f32 / 32.0)
        .collect()
}

/// Times every configuration of `opts` on `t` at every rank. A
/// configuration that cannot be built, or a rank that cannot be timed
/// (out of memory, a format's capacity), is recorded as a [`Failure`] and
/// the sweep goes on. `progress` gets one line per configuration.
///
/// Errors: only uploading the factors.
pub fn sweep_tensor(
    gpu: &Arc<Gpu>,
    t: &SparseTensor,
    opts: &SweepOptions,
    progress: &mut dyn FnMut(String),
) -> Result<(Vec<Run>, Vec<Failure>)> {
    let modes: Vec<usize> = (0..t.nmodes()).collect();
    let sms = gpu.properties().sms;
    let mut factors = Vec::with_capacity(opts.ranks.len());
    for &rank in &opts.ranks {
        let rows = timing_factors(t.dims(), rank);
        factors.push(DeviceFactors::upload_rows(gpu, t.dims(), rank, &rows)?);
    }
    let mut runs = Vec::new();
    let mut failures = Vec::new();
    for &config in &opts.configs {
        let start = Instant::now();
        let built =
            build_engine(config.kernel(), gpu.clone(), t, &config.options(sms)).and_then(|e| {
                gpu.stream()
                    .synchronize()
                    .map(|()| e)
                    .map_err(crate::driver("building an engine"))
            });
        let mut engine: Box<dyn GpuMttkrp> = match built {
            Ok(e) => e,
            Err(e) => {
                progress(format!("  {config}: not built: {e}"));
                failures.push(Failure {
                    config,
                    rank: None,
                    message: e.to_string(),
                });
                continue;
            }
        };
        let prepare_s = start.elapsed().as_secs_f64();
        let mut line = format!("  {config:<22} prepared in {prepare_s:6.2} s;");
        for (&rank, f) in opts.ranks.iter().zip(&factors) {
            match engine.time_sweeps(f, &modes, opts.repeat.max(1)) {
                Ok(times) => {
                    let mode_ms: Vec<f64> = times.iter().map(|v| median(v)).collect();
                    let total_ms = mode_ms.iter().sum();
                    line += &format!(" r{rank} {total_ms:.3} ms");
                    runs.push(Run {
                        config,
                        rank,
                        prepare_s,
                        mode_ms,
                        total_ms,
                    });
                }
                Err(e) => {
                    line += &format!(" r{rank} failed");
                    failures.push(Failure {
                        config,
                        rank: Some(rank),
                        message: e.to_string(),
                    });
                }
            }
        }
        progress(line);
    }
    Ok((runs, failures))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_timing_factors() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        let f = timing_factors(&[3, 2], 4);
        assert_eq!(f.len(), 20);
        assert!(f.iter().all(|&x| (0.25..0.75).contains(&x)));
    }

    /// Needs a GPU: every configuration of a small tensor is timed.
    #[test]
    fn every_configuration_is_timed_on_a_gpu() {
        let Some(gpu) = crate::testing::gpu_or_skip("every_configuration_is_timed_on_a_gpu") else {
            return;
        };
        let t = kruskal_formats::generate::power_law(
            &kruskal_formats::generate::PowerLawSpec::new(vec![300, 200, 100], 20_000),
        )
        .unwrap();
        let opts = SweepOptions {
            ranks: vec![16, 33],
            repeat: 2,
            ..SweepOptions::default()
        };
        let (runs, failures) = sweep_tensor(&gpu, &t, &opts, &mut |_| {}).unwrap();
        assert!(failures.is_empty(), "{failures:?}");
        assert_eq!(runs.len(), 2 * Config::space().len());
        assert!(
            runs.iter()
                .all(|r| r.total_ms > 0.0 && r.mode_ms.len() == 3)
        );
    }
}
