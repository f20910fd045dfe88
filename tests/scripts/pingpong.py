"""Two processes bounce a byte over a pair of pipes, switching CPU at every hop: a switch-heavy
program for what off-CPU profiling costs. Usage: python pingpong.py [SECONDS]; prints round trips
per second."""
import os
import sys
import time

seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
a_r, a_w = os.pipe()
b_r, b_w = os.pipe()
if os.fork() == 0:
    os.close(a_w)
    os.close(b_r)
    while True:
        if not os.read(a_r, 1):
            os._exit(0)
        os.write(b_w, b"x")
os.close(a_r)
os.close(b_w)
n = 0
end = time.perf_counter() + seconds
while time.perf_counter() < end:
    os.write(a_w, b"x")
    os.read(b_r, 1)
    n += 1
os.close(a_w)
print(f"{n / seconds:.0f}")
