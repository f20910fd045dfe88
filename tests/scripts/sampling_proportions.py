"""One thread whose busy time is 60% / 30% / 10% in three functions, interleaved in 10 ms slices.

Usage: python sampling_proportions.py READY_FILE. Writes READY_FILE once running; stops after 120 s."""
import sys
import time


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def sixty_percent():
    spin(0.010)


def thirty_percent():
    spin(0.010)


def ten_percent():
    spin(0.010)


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
