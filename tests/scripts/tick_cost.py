"""What a sampling clock's timer interrupts take from a busy CPU: a spinner pinned to one CPU reads
the clock in a tight loop and counts the gaps between reads (an interrupt, or anything else that
took the CPU from it) of 2 to 100 us, alone and while a profiler samples the whole host.

Usage (as root): python3 tick_cost.py PYEBPF [SECONDS] [ROUNDS]. Runs, interleaved, ROUNDS rounds
of: the spinner alone; beside `perf record -a -e cpu-clock -F HZ` (a clock ticking at the rate
asked for, what any sampler at that rate pays); beside `PYEBPF record -a -F HZ`, with its timer
clock and with its perf-event clock (`PYEBPF_PERF_CLOCK=1`); at 19 and 99 Hz.
Prints, per case, the median over rounds of the gaps a second and the share of the CPU they took,
and what each adds to the spinner alone. The spinner is not Python code the profilers care about
beyond its samples; it runs on the last CPU, the profilers wherever the scheduler puts them."""
import os
import statistics
import subprocess
import sys
import tempfile
import time

PYEBPF = sys.argv[1]
SECONDS = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
RATES = (19, 99)
SETTLE_S = 2.5


def spin(seconds):
    """(gaps of 2-100 us a second, share of the CPU they took) over `seconds` on the last CPU."""
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    now = time.perf_counter_ns
    end = now() + int(seconds * 1e9)
    prev = now()
    gaps = 0
    lost = 0
    while prev < end:
        t = now()
        d = t - prev
        if 2000 < d < 100000:
            gaps += 1
            lost += d
        prev = t
    return gaps / seconds, 100.0 * lost / (seconds * 1e9)


def beside(command, seconds, env=None):
    with tempfile.TemporaryDirectory() as out:
        profiler = subprocess.Popen(
            command + [os.path.join(out, "out")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=None if env is None else {**os.environ, **env}
        )
        try:
            time.sleep(SETTLE_S)
            if profiler.poll() is not None:
                sys.exit(f"{command[0]} exited at once: {command}")
            return spin(seconds)
        finally:
            profiler.terminate()
            profiler.wait()


def cases():
    yield "alone", None, None
    for hz in RATES:
        yield f"perf cpu-clock {hz} Hz", ["perf", "record", "-q", "-a", "-e", "cpu-clock", "-F", str(hz), "-o"], None
        yield f"pyebpf {hz} Hz", [PYEBPF, "record", "-a", "-F", str(hz), "-o"], None
        yield f"pyebpf perf-event {hz} Hz", [PYEBPF, "record", "-a", "-F", str(hz), "-o"], {"PYEBPF_PERF_CLOCK": "1"}


def main():
    results = {name: [] for name, _, _ in cases()}
    for _ in range(ROUNDS):
        for name, command, env in cases():
            results[name].append(spin(SECONDS) if command is None else beside(command, SECONDS, env))
    alone = [statistics.median(x[i] for x in results["alone"]) for i in (0, 1)]
    print(f"{'case':<28} {'gaps/s':>8} {'% of the CPU':>13} {'added gaps/s':>13} {'added %':>8}")
    for name, runs in results.items():
        gaps, share = (statistics.median(x[i] for x in runs) for i in (0, 1))
        print(f"{name:<28} {gaps:8.0f} {share:13.2f} {gaps - alone[0]:13.0f} {share - alone[1]:8.2f}")


main()
