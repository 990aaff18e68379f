"""rlhfkit._calls, the daemon-thread call runner shared by rlhfkit.multiturn and rlhfkit.rewards (review-g item 1:
it existed twice). Outcomes in order, the concurrency bound, the deadline, coroutines and awaitables."""

from __future__ import annotations

import asyncio
import threading
import time

from rlhfkit._calls import call_all, resolve


def test_outcomes_keep_order_and_hold_value_error_or_timeout():
    release = threading.Event()

    def boom():
        raise KeyError("k")

    async def coroutine():
        await asyncio.sleep(0)
        return "async"

    # 2 s: the three quick calls finish within it on a busy machine; the fourth waits for `release` past it
    outcomes = call_all([lambda: 1, boom, coroutine, release.wait], timeout_s=2.0, name="test")
    release.set()
    assert [o.value for o in outcomes] == [1, None, "async", None]
    assert isinstance(outcomes[1].error, KeyError) and outcomes[0].error is None
    assert [o.timed_out for o in outcomes] == [False, False, False, True]


def test_max_workers_bounds_concurrency_and_unstarted_calls_never_start_after_the_deadline():
    """Sync reward functions run at most max_workers at once; a call still queued at the deadline is dropped."""
    lock, running, peak, started = threading.Lock(), [0], [0], []
    pairs = threading.Barrier(2, timeout=30)  # each call returns once two run at once, however slow their start

    def work(index, pair=True):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            started.append(index)
        pairs.wait() if pair else time.sleep(0.05)
        with lock:
            running[0] -= 1
        return index

    outcomes = call_all([lambda i=i: work(i) for i in range(6)], timeout_s=5, max_workers=2)
    assert [o.value for o in outcomes] == list(range(6)) and peak[0] == 2
    started.clear()
    outcomes = call_all([lambda i=i: work(i, pair=False) for i in range(8)], timeout_s=0.03, max_workers=1)
    assert outcomes[0].timed_out and all(o.timed_out for o in outcomes)
    time.sleep(0.15)
    assert started in ([0], [])  # the rest were cancelled before they started (0 too, on a very busy machine)


def test_resolve_awaits_any_awaitable_in_a_loop_of_its_own():
    class Awaitable:
        def __await__(self):
            return (yield from asyncio.sleep(0, result=7).__await__())

    assert resolve(3) == 3
    assert resolve(Awaitable()) == 7
