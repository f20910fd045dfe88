"""A fixed amount of CPU work 100 frames deep; prints the seconds it took.

Usage: python bench_work.py ITERATIONS"""
import sys
import time


def work(n):
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def deep(level, n):
    if level:
        return deep(level - 1, n)
    return work(n)


start = time.perf_counter()
deep(100, int(sys.argv[1]))
print(f"{time.perf_counter() - start:.4f}")
