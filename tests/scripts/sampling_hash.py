"""Spends its time in hashlib.sha256 called from the Python function `hash_caller`.

Usage: python sampling_hash.py READY_FILE. Writes READY_FILE once running; stops after 120 s."""
import hashlib
import sys
import time

DATA = b"\x5a" * (4 << 20)


def hash_caller():
    return hashlib.sha256(DATA).digest()


def main():
    stop = time.monotonic() + 120
    with open(sys.argv[1], "w") as ready:
        ready.write("ready\n")
    while time.monotonic() < stop:
        hash_caller()


main()
