"""One thread whose busy time is 60% / 30% / 10% in three functions that each spin in their own
frame (no callee), so their own time is 60/30/10% of the process's samples.

Usage: python own_time.py READY_FILE. Writes READY_FILE once running; stops after 120 s."""
import sys
import time


def sixty_percent():
    end = time.perf_counter() + 0.010
    while time.perf_counter() < end:
        pass


def thirty_percent():
    end = time.perf_counter() + 0.010
    while time.perf_counter() < end:
        pass


def ten_percent():
    end = time.perf_counter() + 0.010
    while time.perf_counter() < end:
        pass


# Spread each function's slices over the cycle so that no sampling phase favours one of them.
CYCLE = [sixty_percent, thirty_percent, sixty_percent, sixty_percent, ten_percent,
         sixty_percent, thirty_percent, sixty_percent, sixty_percent, thirty_percent]


def main():
    stop = time.monotonic() + 120
    with open(sys.argv[1], "w") as ready:
        ready.write("ready\n")
    while time.monotonic() < stop:
        for work in CYCLE:
            work()


main()
