"""A Python process that corrupts, with ctypes, what a profiler reading it follows, then spins.

Usage: hostile.py READY_FILE MODE, MODE one of
- frame_loop: the spinning function's _PyInterpreterFrame.previous points at itself;
- long_name: the spinning function's co_qualname claims a length of 2**40;
- thread_cycle: the only thread state's `next` points at itself;
- unmapped_previous: the spinning function's _PyInterpreterFrame.previous points into unmapped memory;
- endless_linetable: the spinning function's co_linetable (bytes) claims a length of 2**40;
- bad_cookie: _PyRuntime's debug-offsets cookie and version are overwritten.
READY_FILE is written just before the corruption; from then on the process only spins (no
allocation, no call that would follow what was corrupted: the interpreter itself would loop or crash).
"""
import ctypes
import os
import sys

# CPython 3.13-3.15 (not free-threaded): PyFrameObject.f_frame follows PyObject_HEAD and f_back;
# _PyInterpreterFrame.previous follows f_executable; PyThreadState starts with prev, next;
# PyASCIIObject.length follows PyObject_HEAD.
FRAME_OBJECT_F_FRAME = 24
INTERPRETER_FRAME_PREVIOUS = 8
THREAD_STATE_NEXT = 8
STR_LENGTH = 16


def pointer_at(address):
    return ctypes.c_void_p.from_address(address)


def interpreter_frame(frame):
    return pointer_at(id(frame) + FRAME_OBJECT_F_FRAME).value


def spin_looped(ready):
    here = interpreter_frame(sys._getframe())
    caller = interpreter_frame(sys._getframe(1))
    previous = pointer_at(here + INTERPRETER_FRAME_PREVIOUS)
    assert previous.value == caller, "unexpected _PyInterpreterFrame layout"
    open(ready, "w").close()
    previous.value = here
    while True:
        pass


def spin_unmapped(ready):
    here = interpreter_frame(sys._getframe())
    previous = pointer_at(here + INTERPRETER_FRAME_PREVIOUS)
    assert previous.value == interpreter_frame(sys._getframe(1)), "unexpected _PyInterpreterFrame layout"
    open(ready, "w").close()
    previous.value = 0xDEAD0000  # below any mapping of a 64-bit process
    while True:
        pass


def spin_named():
    while True:
        pass


def spin_cycled(ready):
    get_tstate = ctypes.pythonapi.PyThreadState_Get
    get_tstate.restype = ctypes.c_void_p
    tstate = get_tstate()
    following = pointer_at(tstate + THREAD_STATE_NEXT)
    assert following.value is None, "not the only thread"
    open(ready, "w").close()
    following.value = tstate
    while True:
        pass


def main():
    ready, mode = sys.argv[1], sys.argv[2]
    if mode == "frame_loop":
        spin_looped(ready)
    elif mode == "long_name":
        name = "".join(["hostile_qualname_", str(os.getpid())])
        spin_named.__code__ = spin_named.__code__.replace(co_qualname=name)
        qualname = spin_named.__code__.co_qualname
        length = ctypes.c_ssize_t.from_address(id(qualname) + STR_LENGTH)
        assert length.value == len(qualname), "unexpected str layout"
        open(ready, "w").close()
        length.value = 1 << 40
        spin_named()
    elif mode == "thread_cycle":
        spin_cycled(ready)
    elif mode == "unmapped_previous":
        spin_unmapped(ready)
    elif mode == "endless_linetable":
        table = spin_named.__code__.co_linetable
        size = ctypes.c_ssize_t.from_address(id(table) + STR_LENGTH)  # PyVarObject.ob_size
        assert size.value == len(table), "unexpected bytes layout"
        open(ready, "w").close()
        size.value = 1 << 40
        spin_named()
    elif mode == "bad_cookie":
        runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
        assert ctypes.string_at(runtime, 8) == b"xdebugpy", "unexpected _Py_DebugOffsets cookie"
        ctypes.memmove(runtime, b"hostile!", 8)
        ctypes.c_uint64.from_address(runtime + 8).value = 0xFFFFFFFF
        open(ready, "w").close()
        spin_named()
    else:
        raise SystemExit(f"unknown mode {mode}")


main()
