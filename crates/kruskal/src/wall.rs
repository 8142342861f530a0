//! The wall time of a run, in parts: how long the process took to reach
//! `main` (the loader, the binary's start), then the run's own steps as
//! the caller times them, and whatever is left over.
//!
//! ```
//! use kruskal::wall::{self, WallParts};
//!
//! wall::mark_main();
//! let parts = WallParts::now(&[("load", 0.0), ("iterations", 0.0)]);
//! assert!(parts.total_s >= parts.other_s && parts.other_s >= 0.0);
//! assert_eq!(parts.parts.len(), 3); // the start, then the two given
//! ```

use std::sync::OnceLock;
use std::time::Instant;

use serde::Serialize;

/// When `main` began, and the seconds from the process's start to then
/// (where the system says).
static MAIN: OnceLock<(Instant, Option<f64>)> = OnceLock::new();

/// Marks the start of `main`; the first call counts. Cost: two small
/// reads of `/proc` on Linux.
pub fn mark_main() {
    MAIN.get_or_init(|| (Instant::now(), process_age_s()));
}

/// Seconds since this process was started, from `/proc/self/stat`'s start
/// time and `/proc/uptime` (both in hundredths of a second, so within
/// about 10 ms); `None` where they cannot be read.
fn process_age_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name (which may hold spaces) are
    // space-separated; the start time is field 22 of the whole line.
    let after_name = &stat[stat.rfind(')')? + 1..];
    let ticks: f64 = after_name.split_whitespace().nth(19)?.parse().ok()?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    // /proc counts in USER_HZ, 100 per second on Linux.
    Some((uptime - ticks / 100.0).max(0.0))
}

/// A run's wall time in parts, in seconds: the process's start (to
/// `main`), each part the caller timed, and the rest (`other_s`: option
/// checks, printing, what no part covers).
#[derive(Clone, Debug, Serialize)]
pub struct WallParts {
    /// From the process's start to now.
    pub total_s: f64,
    /// `("start", s)` first, then the parts given, in order.
    pub parts: Vec<(&'static str, f64)>,
    /// `total_s` less every part (never below 0).
    pub other_s: f64,
}

impl WallParts {
    /// The wall time so far, with `parts` (name, seconds) as timed by the
    /// caller. Before [`mark_main`], "now" stands for `main`'s start.
    pub fn now(parts: &[(&'static str, f64)]) -> WallParts {
        let (main, before) = *MAIN.get_or_init(|| (Instant::now(), process_age_s()));
        let before = before.unwrap_or(0.0);
        let total_s = before + main.elapsed().as_secs_f64();
        let mut all = vec![("start", before)];
        all.extend_from_slice(parts);
        let covered: f64 = all.iter().map(|&(_, s)| s).sum();
        WallParts {
            total_s,
            other_s: (total_s - covered).max(0.0),
            parts: all,
        }
    }

    /// One line: `1.812 s: start 0.021, load 0.310, ..., other 0.120`.
    pub fn line(&self) -> String {
        let parts: Vec<String> = self
            .parts
            .iter()
            .map(|(name, s)| format!("{name} {s:.3}"))
            .collect();
        format!(
            "{:.3} s: {}, other {:.3}",
            self.total_s,
            parts.join(", "),
            self.other_s
        )
    }

    /// As JSON: `{"total_s": .., "start_s": .., "<part>_s": .., "other_s": ..}`.
    pub fn json(&self) -> serde_json::Value {
        let mut map = serde_json::Map::new();
        map.insert("total_s".into(), self.total_s.into());
        for (name, s) in &self.parts {
            map.insert(format!("{}_s", name.replace(' ', "_")), (*s).into());
        }
        map.insert("other_s".into(), self.other_s.into());
        serde_json::Value::Object(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_started_before_main_and_the_parts_add_up() {
        mark_main();
        let age = process_age_s().expect("/proc on Linux");
        // A test process has run for less than an hour, and the start
        // took a little time.
        assert!((0.0..3600.0).contains(&age), "{age}");
        std::thread::sleep(std::time::Duration::from_millis(30));
        let w = WallParts::now(&[("load", 0.01), ("model written", 0.005)]);
        assert!(w.total_s >= 0.03, "{w:?}");
        let sum: f64 = w.parts.iter().map(|p| p.1).sum::<f64>() + w.other_s;
        assert!((sum - w.total_s).abs() < 1e-9, "{w:?}");
        let j = w.json();
        assert_eq!(j["load_s"], 0.01);
        assert_eq!(j["model_written_s"], 0.005);
        assert!(w.line().contains("load 0.010, model written 0.005, other"));
    }

    #[test]
    fn parts_longer_than_the_wall_leave_no_negative_rest() {
        let w = WallParts::now(&[("iterations", 1e9)]);
        assert_eq!(w.other_s, 0.0);
    }
}
