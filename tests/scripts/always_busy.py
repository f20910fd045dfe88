"""A CPU-bound loop a few frames deep (`main` -> `serve` -> `handle` -> `compute`), for the always-on
bench: many of these run side by side while a host-wide profiler samples them.

Usage: python always_busy.py READY_FILE [SECONDS]. Writes READY_FILE once in the loop; stops after
SECONDS (default 1800), so one left behind by a bench that died does not spin forever."""
import sys
import time


def compute(n):
    x = 0
    for i in range(n):
        x += i * i
    return x


def handle(request):
    return compute(2000 + request % 7)


def serve(stop):
    request = 0
    with open(sys.argv[1], "w") as ready:
        ready.write("ready\n")
    while time.monotonic() < stop:
        handle(request)
        request += 1


def main():
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 1800.0
    serve(time.monotonic() + seconds)


main()
