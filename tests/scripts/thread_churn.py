"""Heap-corruption canary: starts 4 short threads at a time (each ~2 ms of work) while keeping
pattern-filled bytearrays of 700-4,200 bytes, which it checks now and then. A write into a freed
thread state lands in memory malloc has handed out again, such as these buffers.

Writes the main thread's PyThreadState address to READY_FILE, then runs until SIGTERM or 120 s and
writes "corrupted N checked M" to REPORT.

Usage: python thread_churn.py READY_FILE REPORT"""
import ctypes
import os
import random
import signal
import sys
import threading
import time

stopping = False


def stop(*_):
    global stopping
    stopping = True


def work():
    end = time.perf_counter() + 0.002
    x = 0
    while time.perf_counter() < end:
        x += 1


def fill(size, seed):
    return bytearray(((seed + i) * 7) & 0xFF for i in range(size))


def main():
    signal.signal(signal.SIGTERM, stop)
    get_tstate = ctypes.pythonapi.PyThreadState_Get
    get_tstate.restype = ctypes.c_void_p
    # Named only once written: the test reads it as soon as it appears.
    with open(sys.argv[1] + ".tmp", "w") as ready:
        ready.write(f"{get_tstate()}\n")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    rng = random.Random(1)
    buffers = []
    corrupted = checked = 0
    started = time.monotonic()
    rounds = 0
    while not stopping and time.monotonic() - started < 120:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for _ in range(8):
            size, seed = rng.randint(700, 4200), rng.randint(0, 255)
            buffers.append((seed, fill(size, seed)))
        for t in threads:
            t.join()
        if len(buffers) > 400:
            buffers = buffers[200:]
        rounds += 1
        if rounds % 10 == 0:
            for seed, buf in buffers:
                checked += 1
                if buf != fill(len(buf), seed):
                    corrupted += 1
    for seed, buf in buffers:
        checked += 1
        if buf != fill(len(buf), seed):
            corrupted += 1
    with open(sys.argv[2], "w") as report:
        report.write(f"corrupted {corrupted} checked {checked}\n")


main()
