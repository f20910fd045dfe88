"""What CFI unwinding (`--unwind dwarf`) costs next to frame pointers (`--unwind fp`), side by
side in one run, at 99 and 999 Hz: the profiled program's time, pyebpf's CPU per sample, the
userspace unwind's CPU per sample, the stack bytes copied per sample, the eBPF time per sample.

Usage: python3 bench_unwind.py PYEBPF PYTHON [ROUNDS]  (as root; the workload is bench_work.py)"""
import os
import re
import statistics
import subprocess
import sys
import tempfile

PYEBPF, PYTHON = sys.argv[1], sys.argv[2]
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
WORK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_work.py")
ITERATIONS = "20000000"


def number(stats, label, pattern):
    line = next(l for l in stats.splitlines() if l.strip().startswith(label))
    return float(re.search(pattern, line).group(1))


def run(hz, mode, out):
    done = subprocess.run(
        [PYEBPF, "record", "-F", str(hz), "--unwind", mode, "--stats", "-o", out, "--", PYTHON, WORK, ITERATIONS],
        capture_output=True, text=True, check=True)
    stats = done.stderr
    return {
        "seconds": float(done.stdout.strip()),
        "cpu_us": number(stats, "pyebpf CPU time:", r"\(([\d.]+) us per sample"),
        "unwind_us": number(stats, "CFI-unwound samples:", r"([\d.]+) us CPU unwinding"),
        "bytes": number(stats, "CFI-unwound samples:", r"\(([\d.]+) stack bytes"),
        "ebpf_us": number(stats, "eBPF program time:", r"\(([\d.]+) us per recorded sample"),
    }


def main():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "p.pb.gz")
        print("| Hz | --unwind | program (s) | pyebpf CPU/sample (us) | of it unwinding (us) | stack bytes/sample | eBPF/sample (us) |")
        print("|---|---|---|---|---|---|---|")
        for hz in (99, 999):
            results = {"fp": [], "dwarf": []}
            for _ in range(ROUNDS):
                for mode in ("fp", "dwarf"):
                    results[mode].append(run(hz, mode, out))
            for mode, runs in results.items():
                med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                print(f"| {hz} | {mode} | {med['seconds']:.3f} | {med['cpu_us']:.1f} | {med['unwind_us']:.1f} | {med['bytes']:.0f} | {med['ebpf_us']:.2f} |")


main()
