"""Run many user calls (sync or ``async def``) at once, each bounded by a timeout (private to
:mod:`rlhfkit.multiturn`).

Every call runs in a daemon thread of its own; an ``async`` call gets its own event loop in that thread. A call past
the deadline is abandoned: its thread keeps running (a daemon thread never blocks interpreter exit) and its result is
ignored. A coroutine that blocks its loop (``time.sleep`` inside ``async def``) is abandoned the same way, because
the waiting side never depends on the loop. Needs only the standard library.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CallOutcome", "call_all"]


@dataclass(frozen=True)
class CallOutcome:
    """What one call gave: its ``value``, the exception it raised (``error``), or ``timed_out``."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _run(function: Callable[[], Any], future: concurrent.futures.Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = function()
        if inspect.isawaitable(result):
            result = asyncio.run(_await(result))
        future.set_result(result)
    except BaseException as error:  # noqa: BLE001 - handed to the caller as this call's outcome
        future.set_exception(error)


def call_all(functions: Sequence[Callable[[], Any]], *, timeout_s: float, name: str = "call") -> list[CallOutcome]:
    """Start every zero-argument ``function`` at once; wait at most ``timeout_s`` for all of them together (they
    start together, so that is each call's own bound). Returns one outcome per function, in order."""
    futures = [concurrent.futures.Future() for _ in functions]
    for index, (function, future) in enumerate(zip(functions, futures)):
        threading.Thread(target=_run, args=(function, future), name=f"rlhfkit-{name}-{index}", daemon=True).start()
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
