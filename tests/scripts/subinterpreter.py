"""The main thread spins in `sub_spin` inside a subinterpreter, entered from the main
interpreter's `enter_sub`, while a second thread spins in `main_spin` in the main interpreter.
The ready file (argv[1]) is created from inside the subinterpreter."""
import sys
import threading
from concurrent import interpreters


def main_spin():
    while True:
        pass


def enter_sub():
    interpreters.create().exec(
        f"def sub_spin():\n    open({sys.argv[1]!r}, 'w').close()\n    while True: pass\nsub_spin()\n"
    )


threading.Thread(target=main_spin, daemon=True).start()
enter_sub()
