"""The main thread DEPTH frames deep in pure-Python recursion (`recurse`), its innermost frame
`leaf`, sleeping; a second thread a few frames deep (`shallow`), waiting.

Usage: python deep_stack.py READY_FILE [DEPTH]. Writes READY_FILE once both are in place; stops
after 120 s. Python-to-Python calls use no C stack since 3.11, so the depth is limited by the
recursion limit alone."""
import sys
import threading
import time

DEPTH = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
hold = threading.Event()


def shallow():
    hold.wait(120)


def leaf():
    with open(sys.argv[1], "w") as ready:
        ready.write("ready\n")
    time.sleep(120)


def recurse(remaining):
    if remaining > 1:
        return recurse(remaining - 1)
    return leaf()


threading.Thread(target=shallow, daemon=True).start()
sys.setrecursionlimit(DEPTH + 100)
recurse(DEPTH - 1)
