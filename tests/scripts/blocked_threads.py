"""Two threads stopped at known depths until killed: the main thread in `main_leaf` under
`main_mid` and `main_top`, a worker in `worker_leaf` under `worker_mid`.

Usage: blocked_threads.py READY_FILE (created once both wait).
"""
import sys
import threading

hold = threading.Event()
worker_waiting = threading.Event()


def worker_leaf():
    worker_waiting.set()
    hold.wait()


def worker_mid():
    worker_leaf()


def main_leaf(ready):
    worker_waiting.wait()
    open(ready, "w").close()
    hold.wait()


def main_mid(ready):
    main_leaf(ready)


def main_top(ready):
    main_mid(ready)


threading.Thread(target=worker_mid, daemon=True).start()
main_top(sys.argv[1])
