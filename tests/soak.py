#!/usr/bin/env python3
"""Soak test of issue 13: `pyebpf record -a -F 999 --rotate PERIOD -d DURATION` while a new
short-lived Python process (Debian's 3.13, 3.14 and 3.15 in turn, each spinning 0.15 s of CPU time in
`soak_short`) starts every 0.2 s. Samples pyebpf's resident memory every 10 s and checks, at the
end, that every rotated file is complete (collapsed lines that all end in a count), how many
samples were lost, and that every short-lived process was resolved (its samples carry the
`soak_short` Python frame).

Usage (as root; the environment as for the end-to-end tests):
    PYEBPF_BIN=target/release/pyebpf PYEBPF_PYTHONS=/root/.cache/pyebpf-test-pythons \
        python3 tests/soak.py [--duration 600] [--rotate 60] [--out DIR]

Prints the RSS curve and the figures, writes them to DIR/soak.json too, and exits 1 if a check
fails (a rotated file incomplete, a short-lived process unresolved or lost samples, RSS growing
after warm-up).
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

# The spin is 0.15 s of the process's own CPU time, not of the clock: on a busy host a clock-timed
# spin is preempted while its start-up is not, and its share of the samples falls for the host's
# sake, not pyebpf's.
SHORT = "import time\ndef soak_short():\n    end = time.thread_time() + 0.15\n    while time.thread_time() < end:\n        pass\nsoak_short()\n"


def rss_kib(pid):
    """(VmRSS, RssAnon, RssFile) in KiB, or None once the process is gone. RssFile is mostly the
    files the symbolizer maps (page cache, shared and reclaimable); RssAnon is pyebpf's own heap."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "RssAnon", "RssFile"):
                    fields[name] = int(value.split()[0])
    except OSError:
        return None
    return (fields.get("VmRSS"), fields.get("RssAnon"), fields.get("RssFile")) if "VmRSS" in fields else None


def timer_clocks_started(pid):
    """CPUs whose timer clock runs in the `TICKS` map pid holds (status 1: started)."""
    map_ids = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fdinfo"):
            try:
                with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                    map_ids.update(line.split()[1] for line in info if line.startswith("map_id:"))
            except OSError:
                pass
    except OSError:
        return 0
    for map_id in map_ids:
        show = subprocess.run(["bpftool", "map", "show", "id", map_id], capture_output=True, text=True).stdout
        if "name TICKS " in show:
            dump = subprocess.run(["bpftool", "map", "dump", "id", map_id], capture_output=True, text=True).stdout
            return dump.count('"status": 1')
    return 0


def perf_events(pid):
    """The perf events pid holds open."""
    events = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                events += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[perf_event]"
            except OSError:
                pass
    except OSError:
        pass
    return events


def wait_until_sampling(recording):
    """Until every CPU's sampling clock runs (the timer clock's timers, or the perf-event clock's
    events): sampling has started; at most 60 s."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and recording.poll() is None:
        cpus = os.cpu_count()
        if perf_events(recording.pid) >= cpus or timer_clocks_started(recording.pid) >= cpus:
            return
        time.sleep(0.05)
    sys.exit(f"pyebpf did not start sampling: exit status {recording.poll()}")


def parse_collapsed(path):
    """{pid: (samples, samples with soak_short)}, or raises ValueError on a malformed line."""
    per_pid = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if text and not text.endswith("\n"):
        raise ValueError(f"{path} ends mid-line")
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or int(count) == 0:
            raise ValueError(f"{path}: malformed line {line[:200]!r}")
        root = stack.split(";", 1)[0]
        match = re.search(r" \((\d+)\)$", root)
        if not match:
            raise ValueError(f"{path}: root frame without a pid: {root!r}")
        pid = int(match.group(1))
        samples, python = per_pid.get(pid, (0, 0))
        n = int(count)
        per_pid[pid] = (samples + n, python + (n if "soak_short (" in stack else 0))
    return per_pid


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=600, help="seconds (default 600)")
    parser.add_argument("--rotate", type=int, default=60, help="rotation period in seconds (default 60)")
    parser.add_argument("--frequency", type=int, default=999)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between short-lived processes")
    parser.add_argument("--rss-interval", type=float, default=10, help="seconds between RSS readings (default 10)")
    parser.add_argument("--out", help="directory for the profiles and soak.json (default: a new temporary one)")
    args = parser.parse_args()

    pyebpf = os.environ["PYEBPF_BIN"]
    prefix = os.environ["PYEBPF_PYTHONS"]
    pythons = [os.path.join(prefix, f"usr/bin/python{v}") for v in ("3.13", "3.14", "3.15")]
    for python in pythons:
        if not os.path.exists(python):
            sys.exit(f"missing test interpreter {python}")
    out = args.out or tempfile.mkdtemp(prefix="pyebpf-soak-")
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, "pyebpf.log")
    with open(log_path, "w") as log:
        recording = subprocess.Popen(
            [pyebpf, "record", "-a", "-F", str(args.frequency), "--rotate", str(args.rotate), "-d", str(args.duration),
             "--stats", "-o", os.path.join(out, "soak.folded")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    wait_until_sampling(recording)
    started = time.monotonic()
    rss = [(0, rss_kib(recording.pid))]
    next_rss = started + args.rss_interval
    spawned = []  # (pid, python, seconds after the start)
    children = []
    i = 0
    # Stop starting processes a little before the end so the last ones finish inside the recording.
    while time.monotonic() - started < args.duration - 3 and recording.poll() is None:
        python = pythons[i % len(pythons)]
        child = subprocess.Popen([python, "-c", SHORT], stdin=subprocess.DEVNULL)
        spawned.append((child.pid, os.path.basename(python), round(time.monotonic() - started, 2)))
        children.append(child)
        children = [c for c in children if c.poll() is None]
        i += 1
        now = time.monotonic()
        if now >= next_rss:
            rss.append((round(now - started), rss_kib(recording.pid)))
            next_rss += args.rss_interval
        time.sleep(max(0.0, started + i * args.interval - time.monotonic()))
    for child in children:
        child.wait()
    try:
        recording.wait(timeout=args.duration + 120)
    except subprocess.TimeoutExpired:
        recording.send_signal(signal.SIGINT)
        recording.wait(timeout=60)
    with open(log_path) as f:
        log_text = f.read()

    failures = []
    if recording.returncode != 0:
        failures.append(f"pyebpf exited with {recording.returncode}")
    files = sorted(f for f in os.listdir(out) if f.startswith("soak.") and f.endswith(".folded"))
    leftovers = sorted(f for f in os.listdir(out) if f.endswith(".tmp"))
    if leftovers:
        failures.append(f"temporaries left: {leftovers}")
    per_pid = {}
    for name in files:
        try:
            for pid, (samples, python) in parse_collapsed(os.path.join(out, name)).items():
                old = per_pid.get(pid, (0, 0))
                per_pid[pid] = (old[0] + samples, old[1] + python)
        except ValueError as err:
            failures.append(str(err))
    expected_files = args.duration // args.rotate
    if len(files) < expected_files:
        failures.append(f"{len(files)} rotated files, expected at least {expected_files}")
    lost = [int(n) for n in re.findall(r"\((\d+) lost\)", log_text)]
    if not lost or max(lost) > 0:
        failures.append(f"lost samples (cumulative, per written file): {lost}")
    unseen = [pid for pid, *_ in spawned if pid not in per_pid]
    unresolved = [pid for pid, *_ in spawned if pid in per_pid and per_pid[pid][1] * 2 < per_pid[pid][0]]
    resolved = len(spawned) - len(unseen) - len(unresolved)
    python_share = sum(per_pid[p][1] for p, *_ in spawned if p in per_pid) / max(1, sum(per_pid[p][0] for p, *_ in spawned if p in per_pid))
    if unseen or unresolved:
        failures.append(f"{len(unseen)} short-lived processes never sampled, {len(unresolved)} without soak_short on most samples")
    # Flat after warm-up (the first third of the run): the last third's peak within 10% (at
    # least 8 MiB) of the first third's, for the whole RSS and for pyebpf's own (anonymous) memory.
    readings = [r for _, r in rss if r]
    if len(readings) >= 6:
        third = len(readings) // 3
        for index, name in ((0, "VmRSS"), (1, "RssAnon")):
            warm = max(r[index] for r in readings[:third + 1])
            late = max(r[index] for r in readings[-third:])
            if late > warm + max(warm // 10, 8 * 1024):
                failures.append(f"{name} grew after warm-up: {warm} KiB -> {late} KiB")
    else:
        failures.append(f"only {len(readings)} RSS readings")

    details = [{"pid": pid, "python": python, "started_s": at, "samples": per_pid.get(pid, (0, 0))[0],
                "soak_short": per_pid.get(pid, (0, 0))[1]} for pid, python, at in spawned if pid in unseen or pid in unresolved]
    report = {
        "duration_s": args.duration, "rotate_s": args.rotate, "frequency_hz": args.frequency,
        "rss_s_vmrss_rssanon_rssfile_kib": rss, "rotated_files": len(files), "short_lived_started": len(spawned),
        "short_lived_resolved": resolved, "short_lived_unseen": len(unseen), "short_lived_unresolved": len(unresolved),
        "soak_short_share_of_their_samples": round(python_share, 4),
        "lost_per_period_cumulative": lost, "failures": failures, "out": out, "unresolved_details": details,
    }
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("RSS (s: VmRSS/RssAnon/RssFile MiB):", " ".join(f"{t}:{r[0] / 1024:.0f}/{r[1] / 1024:.0f}/{r[2] / 1024:.0f}" for t, r in rss if r))
    print(f"rotated files: {len(files)}; short-lived processes: {len(spawned)} started, {resolved} resolved, "
          f"{len(unseen)} never sampled, {len(unresolved)} unresolved; soak_short on {python_share:.1%} of their samples")
    print(f"lost (cumulative, per written file): {lost}")
    print("pyebpf's stderr:", log_text.strip().splitlines()[-12:] if log_text.strip() else "(empty)", sep="\n  ")
    for detail in details[:20]:
        print("unresolved:", detail)
    for failure in failures:
        print("FAIL:", failure)
    print(f"details: {out}/soak.json")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
