"""N functions whose code objects all have their `co_linetable` pointed at one shared 1 MiB bytes
object (done with ctypes, no special rights: the attack of issue 7), running as a chain N deep
whose innermost one spins; the chain is left and entered again every 50 ms, so all N run.

Usage: python shared_linetable.py READY_FILE [N]. Writes READY_FILE once the first chain is N deep;
stops after 120 s."""
import ctypes
import sys
import time

N = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
# A well-formed table CPython itself could read: code-13 entries (line delta 0, no columns), 8 code
# units each.
SHARED = bytes([0x80 | (13 << 3) | 7, 0]) * (1 << 19)
assert len(SHARED) == 1 << 20

source = "".join(f"def f{i}(stop):\n    return f{i + 1}(stop)\n" for i in range(N - 1))
source += f"""def f{N - 1}(stop):
    x = 0
    while time.monotonic() < stop:
        x += 1
    return x
"""
namespace = {"time": time}
exec(compile(source, "shared_linetable_chain.py", "exec"), namespace)
functions = [namespace[f"f{i}"] for i in range(N)]


def point_at_shared(code):
    """Replaces the code object's `co_linetable` pointer, found by the address of its own table in
    the fixed part of the object (the instructions follow it)."""
    count = type(code).__basicsize__ // 8
    words = (ctypes.c_uint64 * count).from_address(id(code))
    own = id(code.co_linetable)
    slots = [i for i in range(count) if words[i] == own]
    if len(slots) != 1:
        raise SystemExit(f"co_linetable of {code.co_name} found {len(slots)} times")
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(SHARED))
    # The code object's reference to its own table is dropped on purpose: that table is leaked.
    words[slots[0]] = id(SHARED)


for function in functions:
    point_at_shared(function.__code__)
assert all(f.__code__.co_linetable is SHARED for f in functions)

sys.setrecursionlimit(N + 200)
end = time.monotonic() + 120
first = True
while time.monotonic() < end:
    functions[0](time.monotonic() + 0.05)
    if first:
        with open(sys.argv[1], "w") as ready:
            ready.write("ready\n")
        first = False
