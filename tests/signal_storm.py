#!/usr/bin/env python3
"""Stop signals at random moments, checked against the README's policy ("Stop signals").

Runs `pyebpf record -a` again and again beside busy and churning Python processes and sends each
run one SIGINT, SIGTERM or SIGHUP at a random moment from 0 to --max-delay seconds after its start.
pyebpf inherits this script's signal dispositions, so starting the script under `nohup`, as a
background job of a script, or from a shell checks the policy for that start:

- a signal the policy says stops pyebpf: it exits within 10 s, successfully, leaving one whole
  profile; or it was killed by the signal's default action before its first instruction (no
  handler yet at the moment of sending), leaving no file;
- SIGHUP left ignored by the parent: pyebpf still records 1 s later, and then stops on SIGTERM;
- a signal sent before pyebpf's first instruction under an inherited ignore is dropped by the
  kernel: pyebpf must then stop on the next one.

Usage (as root):
    PYEBPF_BIN=target/release/pyebpf PYEBPF_PYTHONS=~/.cache/pyebpf-test-pythons \\
        python3 tests/signal_storm.py --runs 500 --parallel 3
    nohup python3 tests/signal_storm.py ...            # SIGHUP ignored
    sh -c 'python3 tests/signal_storm.py ... & wait'   # SIGINT ignored
Exit status 0 when every run behaved as the policy says.
"""

import argparse
import collections
import concurrent.futures
import gzip
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
STOP_LIMIT = 10.0


def mask(pid, key):
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def bit(sig):
    return 1 << (int(sig) - 1)


def whole(path):
    """A whole profile: gzip pprof that decompresses and `go tool pprof` reads, or collapsed lines
    that all end in a positive count."""
    if path.endswith(".pb.gz"):
        with gzip.open(path) as f:
            f.read()
        out = subprocess.run(["go", "tool", "pprof", "-raw", path], capture_output=True, text=True)
        return out.returncode == 0 and "Samples:" in out.stdout
    with open(path) as f:
        text = f.read()
    if text and not text.endswith("\n"):
        return False
    return all(line.rsplit(" ", 1)[-1].isdigit() and int(line.rsplit(" ", 1)[-1]) > 0 for line in text.splitlines())


def wait(proc, limit):
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        return None


def one_run(n, args, inherited_ignored, rng_seed):
    rng = random.Random(rng_seed)
    sig = rng.choice(SIGNALS)
    delay = rng.uniform(0, args.max_delay)
    name = signal.Signals(sig).name
    with tempfile.TemporaryDirectory(prefix="pyebpf-storm-") as tmp:
        out = os.path.join(tmp, "profile.pb.gz" if n % 4 == 0 else "profile.folded")
        proc = subprocess.Popen(
            [args.pyebpf, "record", "-a", "-F", "199", "-o", out],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        started = time.monotonic()
        time.sleep(max(0.0, delay - (time.monotonic() - started)))
        handled = mask(proc.pid, "SigCgt") & bit(sig) != 0
        sent_ms = (time.monotonic() - started) * 1000
        os.kill(proc.pid, sig)
        label = f"{name} at {sent_ms:.0f} ms"
        outcome = "stopped, whole profile"
        ignored_hup = sig == signal.SIGHUP and inherited_ignored & bit(sig)
        if ignored_hup:
            if wait(proc, 1.0) is not None:
                return "violation", f"{label}: stopped under an ignored SIGHUP ({proc.returncode}): {proc.stderr.read().decode()[-300:]}"
            outcome = "SIGHUP ignored; stopped on SIGTERM, whole profile"
            os.kill(proc.pid, signal.SIGTERM)
            sig, name = signal.SIGTERM, "SIGTERM"
        status = wait(proc, STOP_LIMIT)
        if status is None and not handled and inherited_ignored & bit(sig):
            # Sent during the exec, under the parent's ignore: dropped by the kernel.
            outcome = "dropped at exec; stopped on SIGTERM, whole profile"
            os.kill(proc.pid, signal.SIGTERM)
            status = wait(proc, STOP_LIMIT)
        if status is None:
            threads = []
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                try:
                    comm = open(f"/proc/{proc.pid}/task/{tid}/comm").read().strip()
                    wchan = open(f"/proc/{proc.pid}/task/{tid}/wchan").read().strip()
                    threads.append(f"{tid} {comm} ({wchan})")
                except OSError:
                    pass
            detail = f"SigIgn {mask(proc.pid, 'SigIgn'):x} SigBlk {mask(proc.pid, 'SigBlk'):x} SigCgt {mask(proc.pid, 'SigCgt'):x}; threads: {', '.join(threads)}"
            proc.kill()
            proc.wait()
            return "violation", f"{label}: still running {STOP_LIMIT:.0f} s later; {detail}"
        stderr = proc.stderr.read().decode(errors="replace")
        files = sorted(os.listdir(tmp))
        if "panicked" in stderr:
            return "violation", f"{label}: panicked: {stderr[-500:]}"
        if status == -int(sig) and not files and not handled:
            return "killed before its first instruction", label
        if status != 0:
            return "violation", f"{label}: exit status {status}, files {files}: {stderr[-300:]}"
        if files != [os.path.basename(out)]:
            return "violation", f"{label}: files left {files}"
        if not whole(out):
            return "violation", f"{label}: not a whole profile"
        return outcome, label


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pyebpf", default=os.environ.get("PYEBPF_BIN", "target/release/pyebpf"))
    parser.add_argument("--pythons", default=os.environ.get("PYEBPF_PYTHONS", os.path.expanduser("~/.cache/pyebpf-test-pythons")))
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--parallel", type=int, default=3)
    parser.add_argument("--max-delay", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    args = parser.parse_args()
    inherited_ignored = mask("self", "SigIgn")
    print(f"seed {args.seed}; this start left ignored: {', '.join(signal.Signals(s).name for s in SIGNALS if inherited_ignored & bit(s)) or 'none'}", flush=True)
    python = lambda v: os.path.join(args.pythons, f"usr/bin/python{v}")
    neighbours = [
        subprocess.Popen([python("3.14"), "-c", "def storm_busy():\n    while True: pass\nstorm_busy()"], stdin=subprocess.DEVNULL),
        subprocess.Popen([python("3.15"), "-c", "def storm_busy():\n    while True: pass\nstorm_busy()"], stdin=subprocess.DEVNULL),
        # Churn: short-lived Python processes, one after another.
        subprocess.Popen(["sh", "-c", f"while :; do {python('3.13')} -c 'sum(range(200000))'; done"], stdin=subprocess.DEVNULL),
    ]
    outcomes = collections.Counter()
    violations = []
    lock = threading.Lock()
    try:
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            futures = [pool.submit(one_run, n, args, inherited_ignored, args.seed * 1000003 + n) for n in range(args.runs)]
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                kind, label = future.result()
                with lock:
                    outcomes[kind] += 1
                    if kind == "violation":
                        violations.append(label)
                        print(f"VIOLATION {label}", flush=True)
                if done % 50 == 0:
                    print(f"{done} runs: {dict(outcomes)}", flush=True)
    finally:
        for proc in neighbours:
            proc.kill()
            proc.wait()
    print(f"{args.runs} runs: {dict(outcomes)}")
    for violation in violations:
        print(f"  {violation}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
