"""Creates a new, uniquely named function with exec, runs it for RUN_S seconds and frees it, over
and over: code objects come and go, and new ones reuse the freed addresses. Each name it ran is
appended to LOG (one per line) before it runs.

Usage: python exec_and_free.py READY_FILE LOG [RUN_S]. Stops after 120 s."""
import gc
import sys
import time

RUN = float(sys.argv[3]) if len(sys.argv) > 3 else 0.15
SOURCE = """
def {name}(run):
    end = perf_counter() + run
    while perf_counter() < end:
        pass
"""


def main():
    with open(sys.argv[1], "w") as ready:
        ready.write("ready\n")
    stop = time.monotonic() + 120
    i = 0
    with open(sys.argv[2], "w") as log:
        while time.monotonic() < stop:
            name = f"fn_{i:04d}"
            log.write(name + "\n")
            log.flush()
            namespace = {"perf_counter": time.perf_counter}
            exec(SOURCE.format(name=name), namespace)
            namespace[name](RUN)
            del namespace
            gc.collect()
            i += 1


main()
