"""Two threads spinning in Python code, so both are on CPU in every sample window.

Usage: python two_spinners.py READY_FILE. Writes READY_FILE once both run; stops after 120 s."""
import sys
import threading
import time

STOP = time.monotonic() + 120
started = threading.Barrier(3)


def spin():
    started.wait()
    while time.monotonic() < STOP:
        pass


threads = [threading.Thread(target=spin) for _ in range(2)]
for thread in threads:
    thread.start()
started.wait()
with open(sys.argv[1], "w") as ready:
    ready.write("ready\n")
for thread in threads:
    thread.join()
