"""Busy in much of the interpreter's C code at once (JSON, regular expressions, decimals, pickling,
compression, the compiler...), so that a host-wide profiler meets many distinct native addresses:
what the symbolizer's memory grows with, where a homogeneous loop such as `always_busy.py` touches
a few.

Usage: python varied_stdlib.py [SECONDS] (default 60). Measured in the README ("Always on"):
five of these, one each on 3.11 to 3.15, under `pyebpf record -a -F 99`, RSS read from
/proc/PID/status."""
import ast
import collections
import csv
import decimal
import difflib
import fractions
import hashlib
import io
import json
import pickle
import random
import re
import statistics
import sys
import textwrap
import time
import zlib


def round_of_work():
    data = {str(i): [i, i * 1.5, str(i) * 3] for i in range(200)}
    text = json.dumps(data)
    json.loads(text)
    re.findall(r"(\d+)\.(\d+)", text)
    decimal.Decimal(1) / decimal.Decimal(7)
    pickle.loads(pickle.dumps(data))
    sorted(random.random() for _ in range(500))
    statistics.mean(range(1, 300))
    fractions.Fraction(3, 7) ** 5
    textwrap.fill(text[:2000], 40)
    list(difflib.unified_diff(text[:300].split(","), text[100:400].split(",")))
    zlib.compress(text.encode())
    hashlib.sha256(text.encode()).hexdigest()
    compile("def f(x):\n    return [y * 2 for y in x if y]\n", "<generated>", "exec")
    ast.dump(ast.parse("a = [1, 2, 3]\nfor i in a:\n    print(i)\n"))
    csv.writer(io.StringIO()).writerows([[1, "a", 2.5]] * 50)
    "{:>10} {:.3f} {}".format("x", 3.14159, [1, 2])
    collections.Counter(text).most_common(5)
    set(range(1000)) & set(range(500, 1500))


def main():
    stop = time.monotonic() + (float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
    while time.monotonic() < stop:
        round_of_work()


main()
