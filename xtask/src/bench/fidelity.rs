//! Fidelity on workloads whose true answer is known: a 60/30/10 split of CPU time in 10 ms slices,
//! and two call paths that alternate (a stack holding frames of both never happened).

use anyhow::Result;
use serde_json::{json, Value};

use super::measure::median;
use super::{Bench, PROFILERS};

pub const RUNS: usize = 3;
pub const SECONDS: u32 = 4;
const HZ: u32 = 999;
/// 3.15, the one version all three profilers can attach to, the two read with pyebpf's own
/// tables (beside py-spy), and the free-threaded 3.13 (pyebpf alone).
pub const VERSIONS: [&str; 4] = ["3.11", "3.12", "3.13t", "3.15"];
const SPLIT: [(&str, f64); 3] = [("sixty_percent", 60.0), ("thirty_percent", 30.0), ("ten_percent", 10.0)];
const PATH_A: [&str; 3] = ["a_outer", "a_mid", "a_leaf"];
const PATH_B: [&str; 3] = ["b_outer", "b_mid", "b_leaf"];

pub fn fidelity(bench: &Bench) -> Result<Value> {
    let mut rows = Vec::new();
    for version in VERSIONS.into_iter().filter(|v| bench.versions.contains(v)) {
        let split = bench.spawn_ready(version, "sampling_proportions.py", &[])?;
        let alternating = bench.spawn_ready(version, "alternating.py", &["10"])?;
        for profiler in PROFILERS.into_iter().filter(|p| p.supports(version)) {
            let mut errors = Vec::new();
            let mut mixed = Vec::new();
            for _ in 0..RUNS {
                let run = bench.attach(profiler, split.pid(), HZ, SECONDS, &[])?;
                errors.push(split_error(&run.collapsed));
                let run = bench.attach(profiler, alternating.pid(), HZ, SECONDS, &[])?;
                mixed.push(mixed_share(&run.collapsed));
            }
            let worst = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
            let row = json!({
                "version": version, "profiler": profiler.name(),
                "split_error_pp_median": median(&mut errors.clone()), "split_error_pp_worst": worst(&errors),
                "mixed_percent_median": median(&mut mixed.clone()), "mixed_percent_worst": worst(&mixed),
            });
            eprintln!("  {row}");
            rows.push(row);
        }
    }
    Ok(Value::Array(rows))
}

/// Samples per collapsed line, as (frames, count).
fn stacks(collapsed: &str) -> impl Iterator<Item = (Vec<&str>, f64)> {
    collapsed.lines().filter_map(|l| {
        let (stack, count) = l.rsplit_once(' ')?;
        Some((stack.split(';').collect(), count.trim().parse().ok()?))
    })
}

pub fn holds(frames: &[&str], function: &str) -> bool {
    frames.iter().any(|f| f.split(|c: char| !(c.is_alphanumeric() || c == '_')).any(|w| w == function))
}

/// The largest error, in percentage points, of the three functions' shares of the split.
fn split_error(collapsed: &str) -> f64 {
    let mut counts = [0.0; 3];
    for (frames, count) in stacks(collapsed) {
        if let Some(i) = SPLIT.iter().position(|(f, _)| holds(&frames, f)) {
            counts[i] += count;
        }
    }
    let total: f64 = counts.iter().sum();
    SPLIT.iter().zip(counts).map(|((_, want), got)| (got * 100.0 / total - want).abs()).fold(0.0, f64::max)
}

/// The share of the alternating workload's path samples whose stack holds frames of both paths.
fn mixed_share(collapsed: &str) -> f64 {
    let (mut on_paths, mut mixed) = (0.0, 0.0);
    for (frames, count) in stacks(collapsed) {
        let a = PATH_A.iter().any(|f| holds(&frames, f));
        let b = PATH_B.iter().any(|f| holds(&frames, f));
        if a || b {
            on_paths += count;
        }
        if a && b {
            mixed += count;
        }
    }
    mixed * 100.0 / on_paths
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_error_is_the_worst_function() {
        let collapsed = "m;sixty_percent (x.py:3);spin 55\nm;thirty_percent (x.py:9) 35\nx.py:ten_percent:12 10\nm 7\n";
        assert!((split_error(collapsed) - 5.0).abs() < 1e-9);
    }

    #[test]
    fn mixed_stacks_hold_both_paths() {
        let collapsed = "a_outer;a_mid;a_leaf 3\nb_outer;a_mid;a_leaf 1\nb_outer;b_mid 4\nmain 9\n";
        assert!((mixed_share(collapsed) - 12.5).abs() < 1e-9);
    }
}
