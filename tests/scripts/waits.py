"""Known splits of wall-clock time, for --mode wall, off-cpu and gil.

Usage: python waits.py READY_FILE [gil | SLEEP_MS SPIN_MS [PIECES]]

Without `gil`: a serving thread sleeps 7 ms (SLEEP_MS) in `wait_io`, then spins 3 ms (SPIN_MS) in
`compute`, every 10 ms (70% and 30% of its time), beside a thread blocked on a lock throughout
(`lock_waiter`). With PIECES, `wait_io` sleeps that many times, for SLEEP_MS in all: waits far
shorter than `--off-cpu-min`.

With `gil`: two threads take turns holding the GIL, `quarter` for 1 ms of its CPU time,
`three_quarters` for 3 ms (25% and 75% of the time the GIL is held by either), beside a thread
that hashes in `hashlib` without the GIL half of the time (`no_gil`), which `--mode gil` leaves
out.

READY_FILE receives `TID NAME` lines, one per thread, once every thread runs. READY_FILE.truth
holds the seconds the serving thread has spent in `wait_io` and in `compute` so far (with `gil`:
the CPU seconds `quarter` and `three_quarters` have run holding the GIL), rewritten every 20
rounds: on a busy host a sleep ends late, work waits for a CPU and a hand-off of the GIL costs CPU
time of its own, so this is the split to compare with."""
import hashlib
import os
import sys
import threading
import time

ready_file = sys.argv[1]
gil = len(sys.argv) > 2 and sys.argv[2] == "gil"
sleep_ms, spin_ms = (float(sys.argv[2]), float(sys.argv[3])) if len(sys.argv) > 3 else (7.0, 3.0)
pieces = int(sys.argv[4]) if len(sys.argv) > 4 else 1
tids = {}
started = threading.Barrier(3)


def announce(name):
    tids[name] = threading.get_native_id()
    started.wait()


def write_truth(first, second):
    with open(ready_file + ".truth.tmp", "w") as out:
        out.write(f"{first} {second}\n")
    os.replace(ready_file + ".truth.tmp", ready_file + ".truth")


def spin_for(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def spin_cpu(seconds):
    """Spins until this thread has run `seconds` of CPU time: time the hypervisor or another thread
    takes from it lengthens the turn, not shortens the work."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def wait_io():
    for _ in range(pieces):
        time.sleep(sleep_ms / 1000 / pieces)


def compute():
    spin_for(spin_ms / 1000)


def serve():
    announce("serve")
    waited = computed = 0.0
    rounds = 0
    while True:
        start = time.perf_counter()
        wait_io()
        woke = time.perf_counter()
        compute()
        waited += woke - start
        computed += time.perf_counter() - woke
        rounds += 1
        if rounds % 20 == 0:
            write_truth(waited, computed)


lock = threading.Lock()
lock.acquire()


def lock_waiter():
    announce("lock_waiter")
    lock.acquire()


turn = [threading.Event(), threading.Event()]


held = [0.0, 0.0]


def hold_turn(mine, seconds):
    """Waits for turn `mine`, spins `seconds` holding the GIL and hands the turn on, counting the CPU
    time it ran holding the GIL: what `--mode gil` samples, less the hand-offs around it."""
    turn[mine].wait()
    start = time.thread_time()
    turn[mine].clear()
    spin_cpu(seconds)
    turn[1 - mine].set()
    held[mine] += time.thread_time() - start


def quarter():
    announce("quarter")
    rounds = 0
    while True:
        hold_turn(0, 0.001)
        rounds += 1
        if rounds % 20 == 0:
            write_truth(*held)


def three_quarters():
    announce("three_quarters")
    turn[0].set()
    while True:
        hold_turn(1, 0.003)


def no_gil():
    # sha256 of a large buffer releases the GIL while it hashes; the pauses leave the two GIL
    # holders a CPU (a holder preempted holds the GIL off CPU, where no sample sees it).
    data = b"x" * (4 << 20)
    while True:
        hashlib.sha256(data).digest()
        time.sleep(0.01)


if gil:
    threads = [threading.Thread(target=quarter, daemon=True), threading.Thread(target=three_quarters, daemon=True)]
    threading.Thread(target=no_gil, daemon=True).start()
else:
    threads = [threading.Thread(target=serve, daemon=True), threading.Thread(target=lock_waiter, daemon=True)]
for thread in threads:
    thread.start()
started.wait()
with open(ready_file + ".tmp", "w") as out:
    for name, tid in tids.items():
        out.write(f"{tid} {name}\n")
os.rename(ready_file + ".tmp", ready_file)
threading.Event().wait()
