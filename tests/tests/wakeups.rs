//! pyebpf's reader is woken by the kernel when records are due, not at every sample: a known
//! process's samples wait in the ring buffer up to the latency bound (100 sampling periods, at most
//! 2 s: 2 s at 49 Hz), so the reader wakes far less often than samples come.

use pyebpf_tests::{pyenv_python, reader_wakes_at_49_hz, start_ready};

/// A Python 3.12 process five frames deep (deeper than the walk a 3.15 marker would shorten, so
/// this fails where any Python process's deep samples are taken as urgent).
#[test]
fn the_reader_sleeps_through_samples_of_a_known_process() {
    let (busy, _dir) = start_ready(&pyenv_python("3.12.1"), "always_busy.py", &["60"]);
    let (woken, samples, stderr) = reader_wakes_at_49_hz(busy.pid());
    // 49 Hz on the one CPU the process runs on: about 290 samples in 6 s.
    assert!(samples >= 150, "too few samples to judge ({samples}): {stderr}");
    // Woken by the latency bound (every 2 s) and the reader's own look two bounds after a batch
    // at most, and its switches while it runs; a sample waking it would be about 150 in these 3 s.
    assert!(woken <= 60, "the reader was woken {woken} times in 3 s at 49 Hz ({samples} samples in all): {stderr}");
}
