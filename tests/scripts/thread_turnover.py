"""Threads that come and go slowly enough to be seen: rounds of 3 threads, each spinning 150-400 ms,
then exiting; the main thread starts the next round once they are joined.

Usage: python thread_turnover.py READY_FILE [SECONDS]. Writes READY_FILE once the first round runs;
stops after SECONDS (default 60)."""
import random
import sys
import threading
import time


def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def main():
    stop = time.monotonic() + (float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)
    rng = random.Random(1)
    ready = False
    while time.monotonic() < stop:
        threads = [threading.Thread(target=spin, args=(rng.uniform(0.15, 0.4),)) for _ in range(3)]
        for thread in threads:
            thread.start()
        if not ready:
            with open(sys.argv[1], "w") as f:
                f.write("ready\n")
            ready = True
        for thread in threads:
            thread.join()


main()
