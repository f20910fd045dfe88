"""Two call paths of equal depth, alternating: a_outer -> a_mid -> a_leaf and b_outer -> b_mid ->
b_leaf, each leaf spinning for SLICE_MS, once each per round in a random order. A stack holding an
a_* and a b_* frame never happened, and each path gets half of the time.

Usage: python alternating.py READY_FILE SLICE_MS [THREADS]. Stops after 120 s. With THREADS, that
many threads alternate at once, each with its own coin (on a free-threaded build, in parallel).
"""
import random
import sys
import threading
import time

SLICE = float(sys.argv[2]) / 1000.0
THREADS = int(sys.argv[3]) if len(sys.argv) > 3 else 1
# Slices vary by up to 20% either way, alike for both paths, and each round runs the two paths in
# a random order: the loop cannot stay in step with the sampling period (which would favour one
# path), and samples a round apart see independent paths. Each round gives both paths one slice.
coins = threading.local()


def spin():
    end = time.perf_counter() + SLICE * coins.jitter.uniform(0.8, 1.2)
    while time.perf_counter() < end:
        pass


def a_leaf():
    spin()


def a_mid():
    a_leaf()


def a_outer():
    a_mid()


def b_leaf():
    spin()


def b_mid():
    b_leaf()


def b_outer():
    b_mid()


def main(seed=7, first=True):
    """The main thread starts the others and says it is ready; every thread then alternates, each
    under its own coin, one call below its entry (`main`), as before threads were added."""
    coins.jitter = random.Random(seed)
    if first:
        for i in range(1, THREADS):
            threading.Thread(target=main, args=(7 + i, False)).start()
        with open(sys.argv[1], "w") as ready:
            ready.write("ready\n")
    stop = time.monotonic() + 120
    while time.monotonic() < stop:
        if coins.jitter.random() < 0.5:
            a_outer()
            b_outer()
        else:
            b_outer()
            a_outer()


main()
