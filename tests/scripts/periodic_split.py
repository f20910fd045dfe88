"""60/30/10 of every CYCLE_MS cycle in `alpha`, `beta` and `gamma`, the cycle anchored to the clock so
it never drifts: a workload whose period a regular sampling clock can lock on to.

Usage: python periodic_split.py READY_FILE CYCLE_MS REPORT_FILE. SIGUSR1 starts a measured window
and SIGUSR2 ends it: REPORT_FILE then gets the CPU time (`time.thread_time`) each function used
in the window, as JSON (the split as written, less what preemption took from each). Stops after
120 s."""
import json
import os
import signal
import sys
import time

CYCLE = float(sys.argv[2]) / 1000.0
REPORT = sys.argv[3]
spent = {"alpha": 0.0, "beta": 0.0, "gamma": 0.0}
measuring = False


def spin_until(name, end):
    begin = time.thread_time()
    while time.perf_counter() < end:
        pass
    if measuring:
        spent[name] += time.thread_time() - begin


def alpha(end):
    spin_until("alpha", end)


def beta(end):
    spin_until("beta", end)


def gamma(end):
    spin_until("gamma", end)


def start(signum, frame):
    global measuring
    for name in spent:
        spent[name] = 0.0
    measuring = True


def stop(signum, frame):
    global measuring
    measuring = False
    with open(REPORT + ".tmp", "w") as out:
        json.dump(spent, out)
    os.rename(REPORT + ".tmp", REPORT)


signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
with open(sys.argv[1], "w") as ready:
    ready.write("ready\n")
begin = time.perf_counter()
n = 0
while time.perf_counter() - begin < 120:
    base = begin + n * CYCLE
    alpha(base + 0.6 * CYCLE)
    beta(base + 0.9 * CYCLE)
    gamma(base + CYCLE)
    n += 1
