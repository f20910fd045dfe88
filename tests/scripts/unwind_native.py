"""Spends its time in native code called from two Python functions: `hash_caller` hashes 8 MB
buffers with hashlib (OpenSSL or HACL*), `regex_caller` runs a slow (backtracking) `re` match.

Usage: python unwind_native.py READY_FILE. Writes READY_FILE once running; stops after 120 s."""
import hashlib
import re
import sys
import time

DATA = b"\x5a" * (8 << 20)
# Nested quantifiers that fail at the end: the match backtracks through every split of the a's.
PATTERN = re.compile(r"(a|aa)+c")
TEXT = "a" * 24 + "b"


def hash_caller():
    return hashlib.sha256(DATA).digest()


def regex_caller():
    return PATTERN.match(TEXT)


def main():
    stop = time.monotonic() + 120
    with open(sys.argv[1], "w") as ready:
        ready.write("ready\n")
    while time.monotonic() < stop:
        hash_caller()
        regex_caller()


main()
