"""The main thread alternates between two interpreters every SLICE_MS: `main_part` spins in the
main interpreter, then `sub_part` in a subinterpreter (entered through `Interpreter.exec`), each for
the same time: far faster than pyebpf re-reads thread lists, so only a thread state chosen at the
sample shows both. The ready file is written once both functions exist.

Usage: python subinterpreter_switching.py READY_FILE SLICE_MS. Stops after 120 s."""
import sys
import time
from concurrent import interpreters

SLICE = float(sys.argv[2]) / 1000.0


def main_part():
    end = time.perf_counter() + SLICE
    while time.perf_counter() < end:
        pass


def main():
    sub = interpreters.create()
    sub.exec(f"import time\ndef sub_part():\n    end = time.perf_counter() + {SLICE}\n    while time.perf_counter() < end:\n        pass\n")
    with open(sys.argv[1], "w") as ready:
        ready.write("ready\n")
    stop = time.monotonic() + 120
    while time.monotonic() < stop:
        main_part()
        sub.exec("sub_part()")


main()
