"""Known splits of wall-clock time, for --mode wall, off-cpu and gil.

Usage: python waits.py READY_FILE [gil]

Without `gil`: a serving thread sleeps 7 ms in `wait_io`, then spins 3 ms in `compute`, every 10 ms
(70% and 30% of its time), beside a thread blocked on a lock throughout (`lock_waiter`).

With `gil`: two threads take turns holding the GIL, `quarter` for 1 ms, `three_quarters` for 3 ms
(25% and 75% of the time the GIL is held by either), beside a thread that spins in `hashlib`
without the GIL (`no_gil`), which `--mode gil` leaves out.

READY_FILE receives `TID NAME` lines, one per thread, once every thread runs."""
import hashlib
import os
import sys
import threading
import time

ready_file = sys.argv[1]
gil = len(sys.argv) > 2 and sys.argv[2] == "gil"
tids = {}
started = threading.Barrier(3)


def announce(name):
    tids[name] = threading.get_native_id()
    started.wait()


def spin_for(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def wait_io():
    time.sleep(0.007)


def compute():
    spin_for(0.003)


def serve():
    announce("serve")
    while True:
        wait_io()
        compute()


lock = threading.Lock()
lock.acquire()


def lock_waiter():
    announce("lock_waiter")
    lock.acquire()


turn = [threading.Event(), threading.Event()]


def quarter():
    announce("quarter")
    while True:
        turn[0].wait()
        turn[0].clear()
        spin_for(0.001)
        turn[1].set()


def three_quarters():
    announce("three_quarters")
    turn[0].set()
    while True:
        turn[1].wait()
        turn[1].clear()
        spin_for(0.003)
        turn[0].set()


def no_gil():
    # sha256 of a large buffer releases the GIL while it hashes.
    data = b"x" * (8 << 20)
    while True:
        hashlib.sha256(data).digest()


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
