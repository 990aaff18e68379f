"""Run user calls (sync, or returning an awaitable) in daemon threads, bounded by a timeout (private; shared by
:mod:`rlhfkit.multiturn` and :mod:`rlhfkit.rewards`).

Calls run in daemon threads of our own, not a ``ThreadPoolExecutor``: ``concurrent.futures`` joins its workers at
interpreter exit, so one hung call would keep the process from ever exiting. A call past the deadline is abandoned:
its thread keeps running until the call returns (a daemon thread never blocks interpreter exit) and its result is
ignored. A call that returns an awaitable gets its own event loop in its thread, so a coroutine that blocks its loop
(``time.sleep`` inside ``async def``) is abandoned the same way: the waiting side never depends on that loop. Needs
only the standard library.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CallOutcome", "call_all", "resolve"]


@dataclass(frozen=True)
class CallOutcome:
    """What one call gave: its ``value``, the exception it raised (``error``), or ``timed_out``."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


async def _await(awaitable: Any) -> Any:
    return await awaitable


def resolve(value: Any) -> Any:
    """``value``, or what it gives when awaited in an event loop of its own (``asyncio.run`` takes only coroutines,
    so any awaitable is wrapped in one)."""
    if inspect.isawaitable(value):
        return asyncio.run(_await(value))
    return value


def _work(jobs: queue.SimpleQueue) -> None:
    while True:
        try:
            function, future = jobs.get_nowait()
        except queue.Empty:
            return
        if not future.set_running_or_notify_cancel():  # cancelled at the deadline before it started
            continue
        try:
            future.set_result(resolve(function()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller as this call's outcome
            future.set_exception(error)


def call_all(functions: Sequence[Callable[[], Any]], *, timeout_s: float | None, name: str = "call",
             max_workers: int | None = None) -> list[CallOutcome]:
    """Run every zero-argument ``function``, at most ``max_workers`` at once (None: all at once), each in a daemon
    thread; wait at most ``timeout_s`` (None: no bound) for all of them together. A call not finished by then is
    ``timed_out`` (one not yet started never starts). Returns one outcome per function, in order."""
    futures = [concurrent.futures.Future() for _ in functions]
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for job in zip(functions, futures):
        jobs.put(job)
    num_threads = len(futures) if max_workers is None else min(max_workers, len(futures))
    for number in range(num_threads):
        threading.Thread(target=_work, args=(jobs,), name=f"rlhfkit-{name}-{number}", daemon=True).start()
    done, _ = concurrent.futures.wait(futures, timeout=timeout_s)
    outcomes = []
    for future in futures:
        if future not in done:
            future.cancel()
            outcomes.append(CallOutcome(timed_out=True))
        elif future.exception() is not None:
            outcomes.append(CallOutcome(error=future.exception()))
        else:
            outcomes.append(CallOutcome(value=future.result()))
    return outcomes
