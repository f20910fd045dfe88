"""asyncio tasks whose tree is known, for `dump --async` and `record --async-aware`.

Usage: python async_tree.py READY_FILE [tree | many N]

tree: the main task (unnamed: Task-1) gathers three named tasks:
  parent   gathers busy-1 (spins in crunch, never yielding) and idle-1 (sleeps);
  chain-1  awaits chain-2, which awaits chain-3, which sleeps;
  group    runs worker-1 and worker-2 in a TaskGroup, both waiting on an Event.
READY_FILE is written once every task is suspended but busy-1, which then spins for good.

many N: the main task starts N tasks named sleeper-I, each sleeping, and writes READY_FILE.
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


async def busy_child():
    # Every other task is suspended by now.
    await asyncio.sleep(0.2)
    ready()
    while True:
        crunch()


async def idle_child():
    await asyncio.sleep(3600)


async def parent():
    busy = asyncio.create_task(busy_child(), name="busy-1")
    idle = asyncio.create_task(idle_child(), name="idle-1")
    await asyncio.gather(busy, idle)


async def chain(n):
    if n < 3:
        await asyncio.create_task(chain(n + 1), name=f"chain-{n + 1}")
    else:
        await asyncio.sleep(3600)


async def worker(event):
    await event.wait()


async def group():
    event = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(worker(event), name="worker-1")
        tg.create_task(worker(event), name="worker-2")


async def sleeper():
    await asyncio.sleep(3600)


async def main():
    if mode == "many":
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
