"""asyncio tasks whose tree is known, for `dump --async` and `record --async-aware`.

Usage: python async_tree.py READY_FILE [tree | alternate | many N | deep N]

tree: the main task (unnamed: Task-1) gathers three named tasks:
  parent   gathers busy-1 (spins in crunch, never yielding) and idle-1 (sleeps);
  chain-1  awaits chain-2, which awaits chain-3, which sleeps;
  group    runs worker-1 and worker-2 in a TaskGroup, both waiting on an Event.
READY_FILE is written once every task is suspended but busy-1, which then spins for good.

alternate: the same tree, but busy-1 runs crunch and chain-3 runs grind in turn, each yielding to
the loop after every call (about a millisecond), so a task read late is read wrong.

many N: the main task starts N tasks named sleeper-I, each sleeping, and writes READY_FILE.

deep N: a chain of N tasks, deep-1 awaiting deep-2 and so on; deep-N writes READY_FILE and spins
in crunch.
"""
import asyncio
import sys

ready_file = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "tree"


def ready():
    with open(ready_file + ".tmp", "w") as f:
        f.write("ready")
    import os
    os.rename(ready_file + ".tmp", ready_file)


def crunch():
    total = 0
    for i in range(10_000):
        total += i * i
    return total


def grind():
    total = 0
    for i in range(10_000):
        total += i * i
    return total


async def busy_child():
    # Every other task is suspended by now.
    await asyncio.sleep(0.2)
    ready()
    while True:
        crunch()
        if mode == "alternate":
            await asyncio.sleep(0)


async def idle_child():
    await asyncio.sleep(3600)


async def parent():
    busy = asyncio.create_task(busy_child(), name="busy-1")
    idle = asyncio.create_task(idle_child(), name="idle-1")
    await asyncio.gather(busy, idle)


async def chain(n):
    if n < 3:
        await asyncio.create_task(chain(n + 1), name=f"chain-{n + 1}")
    elif mode == "alternate":
        while True:
            grind()
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(3600)


async def worker(event):
    await event.wait()


async def group():
    event = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(worker(event), name="worker-1")
        tg.create_task(worker(event), name="worker-2")


async def deep(n, last):
    if n < last:
        await asyncio.create_task(deep(n + 1, last), name=f"deep-{n + 1}")
    else:
        ready()
        while True:
            crunch()


async def sleeper():
    await asyncio.sleep(3600)


async def main():
    if mode == "deep":
        await asyncio.create_task(deep(1, int(sys.argv[3])), name="deep-1")
    elif mode == "many":
        tasks = [asyncio.create_task(sleeper(), name=f"sleeper-{i}") for i in range(int(sys.argv[3]))]
        await asyncio.sleep(0.2)
        ready()
        await asyncio.gather(*tasks)
    else:
        await asyncio.gather(
            asyncio.create_task(parent(), name="parent"),
            asyncio.create_task(chain(1), name="chain-1"),
            asyncio.create_task(group(), name="group"),
        )


asyncio.run(main())
