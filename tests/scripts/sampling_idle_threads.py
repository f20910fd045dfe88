"""A busy main thread plus sleeping threads, for checks that must see several thread states.

Usage: python sampling_idle_threads.py READY_FILE. Writes READY_FILE once running; stops after 120 s."""
import sys
import threading
import time

stop = time.monotonic() + 120


def sleeper():
    while time.monotonic() < stop:
        time.sleep(0.05)


def busy_main():
    x = 0
    while time.monotonic() < stop:
        for _ in range(10000):
            x += 1


for _ in range(3):
    threading.Thread(target=sleeper, daemon=True).start()
with open(sys.argv[1], "w") as ready:
    ready.write("ready\n")
busy_main()
