"""One thread spins in Python code (so it holds the GIL nearly all the time) while others wait.

Usage: python gil_spinner.py READY_FILE. READY_FILE receives the spinning thread's native id."""
import os
import sys
import threading

hold = threading.Event()


def spin():
    ready = sys.argv[1]
    with open(ready + ".tmp", "w") as out:
        out.write(str(threading.get_native_id()))
    os.rename(ready + ".tmp", ready)
    n = 0
    while True:
        n += 1


for _ in range(3):
    threading.Thread(target=hold.wait, daemon=True).start()
threading.Thread(target=spin, daemon=True).start()
hold.wait()
