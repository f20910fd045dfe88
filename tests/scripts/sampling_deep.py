"""One thread spinning 400 frames deep in recursion (`recurse` 400 times, the innermost spinning).

Usage: python sampling_deep.py READY_FILE [DEPTH]. Writes READY_FILE once at depth; stops after 120 s."""
import sys
import time

DEPTH = int(sys.argv[2]) if len(sys.argv) > 2 else 400


def recurse(remaining, stop):
    if remaining > 1:
        return recurse(remaining - 1, stop)
    with open(sys.argv[1], "w") as ready:
        ready.write("ready\n")
    x = 0
    while time.monotonic() < stop:
        for _ in range(10000):
            x += 1
    return x


sys.setrecursionlimit(DEPTH + 100)
recurse(DEPTH, time.monotonic() + 120)
