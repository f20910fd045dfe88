"""Four threads, each spinning in its own function (`alpha`, `beta`, `gamma`, `delta`; `delta` does
twice the work per loop), with a short sleep per loop so each thread's CPU share follows its work.
On a free-threaded build they run in parallel on every CPU.

Usage: python parallel_threads.py READY_FILE REPORT_FILE. SIGUSR1 starts the measured window and
SIGUSR2 ends it: each thread then notes its own CPU time (`time.thread_time`) spent in the window,
and REPORT_FILE gets {function: seconds} as JSON. Stops after 120 s."""
import json
import os
import signal
import sys
import threading
import time

epoch = 0
spent = {}
noted = threading.Condition()


def work(loops):
    x = 0
    for i in range(loops):
        x += i
    return x


def worker(name, loops):
    seen, start = 0, None
    stop = time.monotonic() + 120
    while time.monotonic() < stop:
        work(loops)
        time.sleep(0.001)
        if epoch != seen:
            seen = epoch
            if seen == 1:
                start = time.thread_time()
            elif seen == 2:
                with noted:
                    spent[name] = time.thread_time() - start
                    noted.notify()


def alpha():
    worker("alpha", 20000)


def beta():
    worker("beta", 20000)


def gamma():
    worker("gamma", 20000)


def delta():
    worker("delta", 40000)


def next_epoch(signum, frame):
    global epoch
    epoch += 1


signal.signal(signal.SIGUSR1, next_epoch)
signal.signal(signal.SIGUSR2, next_epoch)
for target in (alpha, beta, gamma, delta):
    threading.Thread(target=target, daemon=True).start()
with open(sys.argv[1], "w") as ready:
    ready.write("ready\n")
with noted:
    while len(spent) < 4:
        noted.wait(1)
with open(sys.argv[2] + ".tmp", "w") as out:
    json.dump(spent, out)
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
time.sleep(120)
