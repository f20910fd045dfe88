"""Holds a known set of thread stacks and writes its own view of them (sys._current_frames) as JSON.

Usage: python dump_state.py VIEW_FILE [SPINNERS]. Every thread, the main one too, is parked before the
view is taken and stays so until the process is killed; the reporting thread ends right after writing
it. With SPINNERS, that many more threads spin in `spinning` all along (in parallel on a
free-threaded build); their native ids go to VIEW_FILE.spinning, as they have no fixed line."""
import json
import os
import sys
import threading

hold = threading.Event()
started = []


def parked():
    started.append(threading.get_native_id())
    hold.wait()


def deep(n):
    if n > 1:
        return deep(n - 1)
    parked()


class Outer:
    def method(self):
        def inner():
            parked()
        inner()


def größe_straße():
    parked()


def 関数_名前():
    parked()


def 𠀀𠀁():
    parked()


lam = lambda: parked()  # noqa: E731


class Constructed:
    """Once its call site is specialized, CPython runs `__init__` above a trampoline frame of its
    own, which Python's view of the stack leaves out."""

    park = False

    def __init__(self):
        if Constructed.park:
            parked()


def construct():
    return Constructed()


for _ in range(200):
    construct()
Constructed.park = True

namespace = {"parked": parked}
exec(compile("def built_by_exec():\n    parked()\n", "<exec-built>", "exec"), namespace)

targets = [lambda: deep(600), Outer().method, größe_straße, 関数_名前, 𠀀𠀁, lam, namespace["built_by_exec"], construct]
sys.setrecursionlimit(2000)
threads = [threading.Thread(target=t, name=f"worker-{i}", daemon=True) for i, t in enumerate(targets)]
for t in threads:
    t.start()


def spinning():
    while True:
        pass


spinners = [threading.Thread(target=spinning, daemon=True) for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 0)]
for t in spinners:
    t.start()


def report():
    while len(started) < len(threads) + 1:
        threading.Event().wait(0.01)
    # The main thread appended its id just before blocking: give it time to block.
    threading.Event().wait(0.2)
    me = threading.get_ident()
    natives = {t.ident: t.native_id for t in threading.enumerate()}
    view = {}
    spinning_ids = {t.ident for t in spinners}
    for ident, frame in sys._current_frames().items():
        if ident == me or ident in spinning_ids:
            continue
        frames = []
        while frame is not None:
            code = frame.f_code
            if hasattr(code, "co_positions"):
                _, end_line, column, end_column = list(code.co_positions())[frame.f_lasti // 2]
            else:  # before 3.11: lines only, and plain names
                end_line = column = end_column = None
            frames.append({
                "qualname": getattr(code, "co_qualname", code.co_name),
                "filename": code.co_filename,
                "line": frame.f_lineno or 0,
                "end_line": end_line,
                "column": column,
                "end_column": end_column,
            })
            frame = frame.f_back
        view[str(natives[ident])] = frames
    with open(sys.argv[1] + ".spinning", "w") as out:
        json.dump([t.native_id for t in spinners], out)
    with open(sys.argv[1] + ".tmp", "w") as out:
        json.dump(view, out)
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])


threading.Thread(target=report).start()
parked()
