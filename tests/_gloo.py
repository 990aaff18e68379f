"""Run a function on N real processes joined by a gloo process group (spawned, file rendezvous, bounded waits)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from typing import Any


def _entry(fn: Callable[[int, int], Any], rank: int, world: int, init_file: str, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        queue.put((rank, fn(rank, world)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable[[int, int], Any], world: int = 2, *, timeout_s: float = 60) -> list[Any]:
    """``fn(rank, world)`` on ``world`` spawned processes inside a gloo default group; returns results by rank.

    ``fn`` must be a module-level function (it is pickled for ``spawn``). Every wait is bounded; a process that does
    not exit is killed, and a non-zero exit code fails the caller's test.
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [context.Process(target=_entry, args=(fn, rank, world, init_file, queue)) for rank in range(world)]
        for proc in procs:
            proc.start()
        try:
            results = dict(queue.get(timeout=timeout_s) for _ in procs)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    codes = [proc.exitcode for proc in procs]
    if any(code != 0 for code in codes):
        raise AssertionError(f"gloo worker exit codes {codes}")
    return [results[rank] for rank in range(world)]
