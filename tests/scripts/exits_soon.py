"""Holds 30 threads 300 frames deep, then exits abruptly while a reader may be walking them.

Usage: python exits_soon.py READY_FILE [SECONDS]. READY_FILE is written once every thread is parked."""
import os
import sys
import threading
import time

hold = threading.Event()
parked = threading.Semaphore(0)


def deep(n):
    if n > 1:
        return deep(n - 1)
    parked.release()
    hold.wait()


for _ in range(30):
    threading.Thread(target=deep, args=(300,), daemon=True).start()
for _ in range(30):
    parked.acquire()
open(sys.argv[1], "w").close()
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0.5)
os._exit(0)
