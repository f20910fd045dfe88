"""Threads a C library starts in a Python process, for tests of threads without a thread state of
their own, or with a new one at each call into Python.

Usage: python c_threads.py READY_FILE LIBRARY SECONDS MODE

LIBRARY is the C library of tests/tests/c_threads.rs. MODE:
  spin   one C thread spins in C for SECONDS and never calls Python;
  churn  C threads call into Python through ctypes callbacks until SECONDS: each call takes a new
         thread state (PyGILState_Ensure) and frees it on return (PyGILState_Release). Thread a
         runs churn_a, thread b churn_b; thread c first spins 2 s in C, then runs churn_c.

Writes READY_FILE once every thread runs, with a line `NAME TID` for each thread; exits once they
are done.
"""
import ctypes
import sys
import time

ready_file, library, seconds, mode = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
lib = ctypes.CDLL(library)
CALLBACK = ctypes.CFUNCTYPE(None)
lib.start.argtypes = [CALLBACK, ctypes.c_double, ctypes.c_double]
lib.tid_of.argtypes = [ctypes.c_int]


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# Each call's own work (a new thread state and its data stack, the GIL taken, all given back on
# return) has no Python frame: the callback runs long enough that its frames are most of a call.
CALL_SECONDS = 0.005


def churn_a():
    spin(CALL_SECONDS)


def churn_b():
    spin(CALL_SECONDS)


def churn_c():
    spin(CALL_SECONDS)


callbacks = {"a": CALLBACK(churn_a), "b": CALLBACK(churn_b), "c": CALLBACK(churn_c)}
if mode == "spin":
    threads = {"spinner": lib.start(CALLBACK(), seconds, seconds)}
else:
    threads = {name: lib.start(callback, 2.0 if name == "c" else 0.0, seconds) for name, callback in callbacks.items()}
while not all(lib.tid_of(index) for index in threads.values()):
    time.sleep(0.01)
with open(ready_file, "w") as ready:
    ready.writelines(f"{name} {lib.tid_of(index)}\n" for name, index in threads.items())
# ctypes lets the GIL go for the call: the C threads call into Python meanwhile.
lib.join_all()
