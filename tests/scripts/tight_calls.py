"""One thread calling an empty function in a loop: a good share of its samples land in a call
just made, before the callee ran its first instruction.

Usage: python tight_calls.py READY_FILE. Writes READY_FILE once running; stops after 120 s."""
import sys
import time


def callee():
    pass


def caller(stop):
    with open(sys.argv[1], "w") as ready:
        ready.write("ready\n")
    while time.monotonic() < stop:
        for _ in range(10000):
            callee()


caller(time.monotonic() + 120)
