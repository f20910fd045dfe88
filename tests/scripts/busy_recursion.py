"""A busy recursive loop: `fib(22)` over and over, so the stack changes all the time.

Usage: python busy_recursion.py READY_FILE. Stops after 120 s."""
import sys
import time


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


with open(sys.argv[1], "w") as ready:
    ready.write("ready\n")
stop = time.monotonic() + 120
while time.monotonic() < stop:
    fib(22)
