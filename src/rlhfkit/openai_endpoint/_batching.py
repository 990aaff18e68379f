"""Dynamic batching for the endpoint: requests that arrive together become one engine call (private; use
:mod:`rlhfkit.openai_endpoint`).

Each HTTP request thread hands ``(prompt ids, SamplingConfig)`` to one :class:`RequestBatcher`, whose thread groups
the queued requests by equal ``SamplingConfig`` (an engine call takes one) and sends each group as one
``generate(prompts, sampling)`` call on a daemon thread of its own, at most ``max_in_flight`` calls at a time. A group
is sent once no request has joined it for ``window_s`` (a quiet gap: a burst of agents that connect over a few hundred
milliseconds becomes one call, not one per window), at the latest ``max_wait_s`` after its oldest request arrived,
or at once when it holds ``max_batch_prompts`` requests; while every call slot is busy, requests keep queueing and go
out together when a slot frees. Groups go out oldest first.

A request with a ``seed`` is sent alone: the engines derive each prompt's generator from ``(seed, prompt position in
the call)``, so in a shared call its samples would depend on what else arrived with it, and the same seeded request
would not give the same answer twice.

What it does not do: split one request's ``n`` samples over calls, cancel a call that is running (a request that
times out is answered 504 by its own thread and its result is dropped), or retry. Pure Python.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlhfkit.engines.protocol import SamplingConfig
from rlhfkit.types import Rollout

__all__ = ["BatchFailedError", "BatchTimeoutError", "BatcherClosedError", "RequestBatcher"]

logger = logging.getLogger("rlhfkit.openai_endpoint")

Generate = Callable[[list[list[int]], SamplingConfig], list[Rollout]]


class BatchFailedError(RuntimeError):
    """The engine call of a request's batch raised; ``error`` is what it raised (shared by the batch's requests)."""

    def __init__(self, error: BaseException, batch_size: int) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error, self.batch_size = error, batch_size


class BatchTimeoutError(TimeoutError):
    """A request was not answered within its timeout (queued behind busy calls, or its call did not return)."""


class BatcherClosedError(RuntimeError):
    """The batcher was closed before the request was sent to the engine."""


@dataclass(eq=False)
class _Pending:
    prompt: list[int]
    sampling: SamplingConfig
    arrived: float
    done: threading.Event = field(default_factory=threading.Event)
    rollouts: list[Rollout] | None = None
    error: BaseException | None = None
    batch_size: int = 0   # requests in the call that carried it


class RequestBatcher:
    """Collects concurrent requests into engine calls (see the module docstring).

    Args:
        generate: the engine call, ``generate(prompts, sampling) -> rollouts`` (prompt-major, ``n`` per prompt); it
            must bound its own wait (the endpoint passes ``EngineGroup.generate`` with a timeout).
        window_s: the quiet gap: a group's call is sent once no request joined it for this long (0: at once).
        max_wait_s: the longest its oldest request waits for others (>= window_s).
        max_batch_prompts: most requests (prompts) in one call.
        max_in_flight: most calls running at once (the number of engines behind ``generate``).
        name: names the threads.
    """

    def __init__(self, generate: Generate, *, window_s: float, max_batch_prompts: int, max_in_flight: int,
                 max_wait_s: float | None = None, name: str = "rlhfkit-openai-batcher") -> None:
        max_wait_s = window_s if max_wait_s is None else max_wait_s
        if max_batch_prompts < 1 or max_in_flight < 1 or not window_s >= 0 or not max_wait_s >= window_s:
            raise ValueError(f"RequestBatcher(window_s={window_s!r}, max_wait_s={max_wait_s!r}, max_batch_prompts="
                             f"{max_batch_prompts!r}, max_in_flight={max_in_flight!r}); need 0 <= window_s <= "
                             "max_wait_s and counts >= 1")
        self._generate = generate
        self.window_s, self.max_batch_prompts, self.max_in_flight = float(window_s), max_batch_prompts, max_in_flight
        self.max_wait_s = float(max_wait_s)
        self._name = name
        self._cond = threading.Condition()
        self._queue: list[_Pending] = []
        self._in_flight = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ request side
    def generate(self, prompt: list[int], sampling: SamplingConfig, *, timeout_s: float) -> list[Rollout]:
        """The ``sampling.n`` rollouts of ``prompt``, sampled in a call shared with other requests of equal
        ``sampling``. Raises :class:`BatchTimeoutError` past ``timeout_s`` (counted from now, queueing included),
        :class:`BatchFailedError` when its call raised, :class:`BatcherClosedError` when closed before it was sent."""
        pending = _Pending(prompt=prompt, sampling=sampling, arrived=time.monotonic())
        with self._cond:
            if self._closed:
                raise BatcherClosedError("the batcher is closed")
            self._queue.append(pending)
            self._cond.notify_all()
        if not pending.done.wait(timeout_s):
            with self._cond:
                if pending in self._queue:   # never sent: take it out so that no call carries it
                    self._queue.remove(pending)
            if not pending.done.is_set():
                raise BatchTimeoutError(f"no answer within {timeout_s:g} s")
        if pending.error is not None:
            if isinstance(pending.error, BatcherClosedError):
                raise BatcherClosedError(str(pending.error))
            raise BatchFailedError(pending.error, batch_size=pending.batch_size) from pending.error
        assert pending.rollouts is not None
        return pending.rollouts

    def close(self, timeout_s: float = 1.0) -> None:
        """Answer every request not yet sent with :class:`BatcherClosedError` and stop the thread (calls already
        running finish on their own daemon threads). Idempotent; returns within ``timeout_s``."""
        with self._cond:
            self._closed = True
            queued, self._queue = self._queue, []
            self._cond.notify_all()
        for pending in queued:
            pending.error = BatcherClosedError("the endpoint closed before this request reached the engine")
            pending.done.set()
        self._thread.join(timeout=timeout_s)

    # ------------------------------------------------------------------ batcher thread
    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                batch, wait_s = self._next_batch(time.monotonic())
                if batch is None:
                    self._cond.wait(timeout=wait_s)
                    continue
                self._in_flight += 1
                threading.Thread(target=self._call, args=(batch,), name=f"{self._name}-call", daemon=True).start()

    def _next_batch(self, now: float) -> tuple[list[_Pending] | None, float | None]:
        """The oldest group that is ready (full, quiet for ``window_s``, or its oldest request waited ``max_wait_s``),
        taken off the queue;
        else ``(None, seconds until the next group is ready)`` (None: until notified). Called under the lock."""
        if self._in_flight >= self.max_in_flight or not self._queue:
            return None, None
        groups: dict[SamplingConfig, list[_Pending]] = {}
        for pending in self._queue:   # arrival order, so each group's first entry is its oldest
            groups.setdefault(pending.sampling, []).append(pending)
        earliest = None
        for sampling, members in groups.items():
            limit = 1 if sampling.seed is not None else self.max_batch_prompts
            ready_at = min(members[-1].arrived + self.window_s, members[0].arrived + self.max_wait_s)
            if len(members) >= limit or ready_at <= now:
                batch = members[:limit]
                taken = set(map(id, batch))
                self._queue = [pending for pending in self._queue if id(pending) not in taken]
                return batch, None
            earliest = ready_at if earliest is None else min(earliest, ready_at)
        return None, max(0.0, earliest - now)

    def _call(self, batch: list[_Pending]) -> None:
        sampling = batch[0].sampling
        for pending in batch:
            pending.batch_size = len(batch)
        try:
            rollouts = self._generate([pending.prompt for pending in batch], sampling)
            if len(rollouts) != len(batch) * sampling.n:
                raise RuntimeError(f"the engine returned {len(rollouts)} rollouts for {len(batch)} prompts x "
                                   f"n={sampling.n}")
            for position, pending in enumerate(batch):
                pending.rollouts = rollouts[position * sampling.n:(position + 1) * sampling.n]
        except Exception as error:  # noqa: BLE001 - every request of this batch fails with it; the next proceeds
            logger.error("openai endpoint: an engine call of %d request(s) failed: %s: %s", len(batch),
                         type(error).__name__, error)
            for pending in batch:
                pending.error = error
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()
            for pending in batch:
                pending.done.set()
