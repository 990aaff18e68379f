"""The rollout buffer of :mod:`rlhfkit.rollouts`: its errors, config, the staleness functions and
:class:`RolloutBuffer` itself (groups of rollouts between producers and the trainer, FIFO, under a staleness bound)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlhfkit._checks import version_lag
from rlhfkit._cu_seqlens import repeat_counts
from rlhfkit.types import Rollout

__all__ = ["RolloutBuffer", "RolloutBufferClosedError", "RolloutBufferConfig", "RolloutBufferExhaustedError",
           "RolloutProducerError", "RolloutTimeoutError", "staleness", "token_staleness"]

_POLL_S = 0.02  # how often a waiting producer re-reads current_version() (the trainer bumps it without telling us)


class RolloutBufferClosedError(RuntimeError):
    """The buffer was closed (:meth:`RolloutBuffer.close`) while, or before, a caller waited on it."""


class RolloutBufferExhaustedError(RuntimeError):
    """Every producer started on the buffer has finished (its prompts ran out, or it was stopped) and fewer groups
    than a ``get`` asked for are queued within the staleness bound: no more will come. ``num_groups`` is what was
    asked, ``num_queued`` what is left (``get(num_queued)`` takes them when it is > 0)."""

    def __init__(self, message: str, *, num_groups: int, num_queued: int) -> None:
        super().__init__(message)
        self.num_groups = num_groups
        self.num_queued = num_queued


class RolloutProducerError(RuntimeError):
    """A producer thread failed; ``__cause__`` is its exception. ``producer`` names it, ``batch_index`` is the prompt
    batch it was working on (0-based, counted from its start; -1 before the first batch)."""

    def __init__(self, message: str, *, producer: str, batch_index: int) -> None:
        super().__init__(message)
        self.producer = producer
        self.batch_index = batch_index


class RolloutTimeoutError(TimeoutError):
    """A bounded wait on the buffer (``get``, ``put``, a producer's admission, ``stop``) ran out of time."""


def _check_version(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r}; must be a non-negative int (a count of weight pushes)")
    return value


def _check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r}; must be a number of seconds > 0")
    return float(value)


def staleness(rollouts: Sequence[Rollout], trainer_version: int) -> torch.Tensor:
    """``[N]`` int64: how many weight versions each rollout lags the trainer, ``trainer_version - weight_version``.

    A rollout newer than the trainer is a bookkeeping error (``ValueError`` naming it): pass the version of the
    weights the trainer holds now."""
    versions = torch.tensor([int(r.weight_version) for r in rollouts], dtype=torch.int64)
    return version_lag(versions, trainer_version,
                       describe=lambda index, version: f"rollout {index} has weight_version={version},")


def token_staleness(rollouts: Sequence[Rollout], trainer_version: int) -> torch.Tensor:
    """``[sum R]`` int64: how many weight versions each response token lags the trainer, rollout after rollout
    (``trainer_version - Rollout.token_weight_versions``). Equal to :func:`staleness` repeated over each response
    unless a rollout spans an in-flight weight update, whose later tokens are fresher. A token newer than the trainer
    raises ``ValueError`` naming its rollout."""
    per_rollout = [r.token_weight_versions for r in rollouts]
    versions = torch.cat(per_rollout) if per_rollout else torch.zeros(0, dtype=torch.int64)
    ends = torch.tensor([v.numel() for v in per_rollout], dtype=torch.int64).cumsum(0)

    def describe(index: int, version: int) -> str:
        owner = int(torch.searchsorted(ends, torch.tensor(index), right=True))
        return f"rollout {owner} has a token of weight version {version},"

    return version_lag(versions, trainer_version, describe=describe)


@dataclass(frozen=True, kw_only=True)
class RolloutBufferConfig:
    """A :class:`RolloutBuffer`'s bound, size, policy and default timeouts.

    Attributes:
        max_staleness: the most weight versions a handed-out group may lag the trainer (0: on-policy).
        capacity: the most groups queued plus reserved by producers for generation in flight.
        on_stale: ``"drop"``: producers fill the buffer freely (up to ``capacity``); ``get`` drops groups past the
            bound and counts them (throughput first, generation wasted). ``"wait"``: before generating a batch, a
            producer waits until the batch will be consumed within the bound, assuming the trainer takes
            ``groups_per_step`` groups per version (FIFO order): nothing is generated to be thrown away. A group that
            still goes stale (the trainer skipped versions or took fewer groups) is dropped and counted as in
            ``"drop"``: the bound always holds.
        groups_per_step: groups the trainer takes per weight version (its ``get(num_groups)``); required for
            ``"wait"``, unused for ``"drop"``.
        get_timeout_s: default longest wait of :meth:`RolloutBuffer.get`.
        put_timeout_s: default longest wait of :meth:`RolloutBuffer.put` and of a producer's admission.
    """

    max_staleness: int
    capacity: int
    on_stale: Literal["drop", "wait"] = "drop"
    groups_per_step: int | None = None
    get_timeout_s: float = 600.0
    put_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        value = self.max_staleness
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"RolloutBufferConfig.max_staleness={value!r}; must be an int >= 0 (0 = on-policy)")
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"RolloutBufferConfig.capacity={self.capacity!r}; must be an int >= 1 (groups)")
        if self.on_stale not in ("drop", "wait"):
            raise ValueError(f"RolloutBufferConfig.on_stale={self.on_stale!r}; expected 'drop' or 'wait'")
        steps = self.groups_per_step
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"RolloutBufferConfig.groups_per_step={steps!r}; must be an int >= 1 or None")
        if self.on_stale == "wait" and steps is None:
            raise ValueError("RolloutBufferConfig(on_stale='wait') needs groups_per_step (the trainer's "
                             "get(num_groups) per weight version) to hold producers back")
        for name in ("get_timeout_s", "put_timeout_s"):
            _check_seconds(f"RolloutBufferConfig.{name}", getattr(self, name))


@dataclass
class _Group:
    rollouts: list[Rollout]
    weight_version: int


class RolloutBuffer:
    """Groups of rollouts between producers and the trainer, FIFO, thread-safe (see the module docstring).

    A group is the rollouts of one prompt (all its samples). ``put`` stamps every rollout of a group with the group's
    ``weight_version`` (``Rollout.weight_version`` is replaced where it differs): the version your bookkeeping
    reports is the one the bound uses, so report the version of the weights the engines hold (completed pushes).

    Group ids: every queued group gets a fresh id as the ``prompt_index`` of all its rollouts: its serial number in
    the buffer (0, 1, 2, ... in the order groups are queued, dropped ones included). An engine numbers the prompts
    of each call from 0, so two batches' groups would otherwise share ids and merge in a group estimator
    (:func:`rlhfkit.advantages.grpo_advantages` groups by ``prompt_index``). With one producer, a group's id is its
    prompt's position in the stream of prompts the producer read (batch ``k``'s prompt ``i``: the sizes of batches
    ``0 .. k-1`` plus ``i``); carry labels and texts on the rollouts (``Rollout.label``, ``prompt_text``).

    After :meth:`close`, ``get`` and ``put`` raise; groups still queued are not handed out.
    """

    def __init__(self, config: RolloutBufferConfig) -> None:
        if not isinstance(config, RolloutBufferConfig):
            raise TypeError(f"RolloutBuffer(config) needs a RolloutBufferConfig, got {type(config).__name__}")
        self.config = config
        self._cond = threading.Condition()
        self._queue: deque[_Group] = deque()
        self._reserved = 0
        self._closed = False
        self._error: BaseException | None = None
        self._producers: dict[str, str] = {}  # name -> what it is doing, quoted by timeout errors
        self._num_producers_started = 0
        self._num_producers_running = 0
        self._next_group_id = 0
        self._last_get_version = -1
        self._handed_at_last_version = 0
        self._histogram = torch.zeros(config.max_staleness + 1, dtype=torch.int64)
        self._token_histogram = torch.zeros(config.max_staleness + 1, dtype=torch.int64)
        self._counts = dict.fromkeys(("groups_in", "groups_out", "rollouts_out", "dropped_groups",
                                      "dropped_rollouts", "producer_waits", "trainer_waits"), 0)
        self._seconds = {"producer_wait_s": 0.0, "trainer_wait_s": 0.0}

    def __len__(self) -> int:
        """Groups queued now (stale ones included until a ``get`` drops them)."""
        with self._cond:
            return len(self._queue)

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    # --- producers' side ----------------------------------------------------------------------------------------------
    def put(self, group: Sequence[Rollout], *, weight_version: int | None = None,
            timeout_s: float | None = None) -> None:
        """Queue one group, waiting (at most ``timeout_s``, default ``config.put_timeout_s``) while the buffer is full.

        ``weight_version``: the weight version current when the group's request started; None takes the oldest
        ``Rollout.weight_version`` of the group (the engines' own counts)."""
        stamped = self._stamp(group, weight_version)
        timeout = _check_seconds("timeout_s", self.config.put_timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            self._wait_producer(lambda: len(self._queue) + self._reserved < self.config.capacity, timeout,
                                lambda: f"put() of a group (weight_version={stamped.weight_version}) waited for room: "
                                        f"the buffer holds {len(self._queue)} of capacity={self.config.capacity} "
                                        f"groups ({self._reserved} reserved by producers)")
            self._queue.append(self._number(stamped))
            self._counts["groups_in"] += 1
            self._cond.notify_all()

    def _stamp(self, group: Sequence[Rollout], weight_version: int | None) -> _Group:
        if isinstance(group, Rollout) or not isinstance(group, Sequence) or len(group) == 0:
            raise TypeError(f"group must be a non-empty list of Rollout (one prompt's samples), got {group!r:.80}")
        for index, rollout in enumerate(group):
            if not isinstance(rollout, Rollout):
                raise TypeError(f"group[{index}] is a {type(rollout).__name__}, not a Rollout")
            if rollout.prompt_index != group[0].prompt_index:
                raise ValueError(f"group[{index}].prompt_index={rollout.prompt_index} but group[0].prompt_index="
                                 f"{group[0].prompt_index}; a group holds the samples of one prompt")
        if weight_version is None:
            weight_version = min(int(r.weight_version) for r in group)
        _check_version("weight_version", weight_version)
        return _Group([self._restamp(r, weight_version) for r in group], weight_version)

    def _number(self, group: _Group) -> _Group:
        """``group`` with the next group id as every rollout's ``prompt_index`` (lock held)."""
        group_id, self._next_group_id = self._next_group_id, self._next_group_id + 1
        rollouts = [r if r.prompt_index == group_id else dataclasses.replace(r, prompt_index=group_id)
                    for r in group.rollouts]
        return _Group(rollouts, group.weight_version)

    @staticmethod
    def _restamp(rollout: Rollout, weight_version: int) -> Rollout:
        """The rollout stamped with ``weight_version``; tokens of a newer version (weights pushed between the stamp
        and the generation) keep theirs in ``response_weight_versions``."""
        if rollout.weight_version == weight_version:
            return rollout
        if rollout.weight_version > weight_version and rollout.response_weight_versions is None:
            return dataclasses.replace(rollout, weight_version=weight_version,
                                       response_weight_versions=rollout.token_weight_versions)
        return dataclasses.replace(rollout, weight_version=weight_version)

    def _raise_if_closed(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RolloutBufferClosedError("the RolloutBuffer was closed (close() was called); nothing more goes in "
                                           "or out")

    def _wait_producer(self, ready: Callable[[], bool], timeout_s: float, what: Callable[[], str],
                       stop: threading.Event | None = None) -> bool:
        """Wait (lock held) until ``ready()``; False when ``stop`` was set first. Counted as a producer wait."""
        self._raise_if_closed()
        if ready():
            return True
        start = time.monotonic()
        self._counts["producer_waits"] += 1
        try:
            while not ready():
                if stop is not None and stop.is_set():
                    return False
                remaining = start + timeout_s - time.monotonic()
                if remaining <= 0:
                    raise RolloutTimeoutError(f"{what()}; timed out after {timeout_s:g} s (is the trainer calling "
                                              "get()? raise the timeout if it is only slow)")
                self._cond.wait(min(remaining, _POLL_S) if stop is not None else remaining)
                self._raise_if_closed()
            return True
        finally:
            self._seconds["producer_wait_s"] += time.monotonic() - start

    def _admissible(self, num_groups: int, weight_version: int) -> bool:
        """Room for ``num_groups`` more, and (``"wait"``) all of them consumed within the bound (FIFO, the trainer
        taking ``groups_per_step`` per version)."""
        ahead = len(self._queue) + self._reserved
        if ahead + num_groups > self.config.capacity:
            return False
        if self.config.on_stale == "drop":
            return True
        per_step = self.config.groups_per_step
        assert per_step is not None
        now = max(self._last_get_version, weight_version)
        taken = self._handed_at_last_version if self._last_get_version == now else 0
        worst = (now - weight_version) + (taken + ahead + num_groups - 1) // per_step
        return worst <= self.config.max_staleness

    def _reserve(self, num_groups: int, current_version: Callable[[], int], timeout_s: float, stop: threading.Event,
                 producer: str) -> int | None:
        """Wait until a batch of ``num_groups`` is admitted; returns its stamp (``current_version()`` at admission)
        and reserves room, or None when ``stop`` was set."""
        limit = self.config.capacity
        if self.config.on_stale == "wait":
            limit = min(limit, (self.config.max_staleness + 1) * self.config.groups_per_step)  # type: ignore[operator]
        if num_groups > limit:
            raise ValueError(f"producer {producer!r}: a batch of {num_groups} prompts can never be admitted (at most "
                             f"{limit} groups: capacity={self.config.capacity}, max_staleness="
                             f"{self.config.max_staleness}, groups_per_step={self.config.groups_per_step}); use "
                             "smaller prompt batches or raise the capacity")
        stamp = [_check_version("current_version()", current_version())]

        def ready() -> bool:
            stamp[0] = _check_version("current_version()", current_version())
            return self._admissible(num_groups, stamp[0])

        def what() -> str:
            return (f"producer {producer!r} waited to generate {num_groups} groups at weight_version={stamp[0]}: the "
                    f"buffer holds {len(self._queue)} and {self._reserved} reserved (capacity="
                    f"{self.config.capacity}), the trainer last took groups at version {self._last_get_version} "
                    f"(on_stale={self.config.on_stale!r}, max_staleness={self.config.max_staleness})")

        with self._cond:
            self._producers[producer] = f"waiting to generate {num_groups} groups"
            if not self._wait_producer(ready, timeout_s, what, stop):
                return None
            self._reserved += num_groups
            return stamp[0]

    def _put_reserved(self, groups: list[_Group], num_reserved: int) -> None:
        with self._cond:
            self._reserved -= num_reserved
            self._raise_if_closed()
            self._queue.extend(self._number(group) for group in groups)
            self._counts["groups_in"] += len(groups)
            self._cond.notify_all()

    def _release(self, num_reserved: int) -> None:
        with self._cond:
            self._reserved -= num_reserved
            self._cond.notify_all()

    def _set_status(self, producer: str, status: str) -> None:
        with self._cond:
            self._producers[producer] = status

    def _producer_started(self, producer: str) -> None:
        with self._cond:
            self._producers[producer] = "starting"
            self._num_producers_started += 1
            self._num_producers_running += 1

    def _producer_finished(self) -> None:
        """A producer's thread ends (done, stopped or failed): a ``get`` waiting for more may be unable to fill."""
        with self._cond:
            self._num_producers_running -= 1
            self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        """A producer failed: every waiter (and every later ``get``/``put``) raises ``error``."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    # --- the trainer's side -------------------------------------------------------------------------------------------
    def get(self, num_groups: int, *, trainer_version: int, timeout_s: float | None = None) -> list[list[Rollout]]:
        """The ``num_groups`` oldest groups with ``trainer_version - weight_version <= max_staleness``, FIFO; waits
        (at most ``timeout_s``, default ``config.get_timeout_s``) until that many are queued. Staler groups are dropped
        and counted. Raises a producer's :class:`RolloutProducerError`, :class:`RolloutBufferClosedError` after
        :meth:`close`, :class:`RolloutTimeoutError` naming what it waited for, and (at once, without waiting out the
        timeout) :class:`RolloutBufferExhaustedError` when producers were started on the buffer, all have finished
        and fewer than ``num_groups`` groups are queued. With no producer ever started it waits for ``put``."""
        capacity = self.config.capacity
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or not 1 <= num_groups <= capacity:
            raise ValueError(f"get(num_groups={num_groups!r}); must be an int in [1, capacity={self.config.capacity}]")
        _check_version("trainer_version", trainer_version)
        timeout = _check_seconds("timeout_s", self.config.get_timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            if trainer_version < self._last_get_version:
                raise ValueError(f"get(trainer_version={trainer_version}) after get(trainer_version="
                                 f"{self._last_get_version}); the trainer's version never goes back")
            if trainer_version > self._last_get_version:
                self._last_get_version, self._handed_at_last_version = trainer_version, 0
            self._cond.notify_all()  # a producer held back for this version may go now
            start = time.monotonic()
            waited = False
            try:
                while True:
                    self._raise_if_closed()
                    self._drop_stale(trainer_version)
                    if len(self._queue) >= num_groups:
                        return self._hand_out(num_groups, trainer_version)
                    if self._num_producers_started and not self._num_producers_running:
                        raise RolloutBufferExhaustedError(self._exhausted_message(num_groups, trainer_version),
                                                          num_groups=num_groups, num_queued=len(self._queue))
                    remaining = start + timeout - time.monotonic()
                    if remaining <= 0:
                        raise RolloutTimeoutError(self._get_timeout_message(num_groups, trainer_version, timeout))
                    if not waited:
                        waited = True
                        self._counts["trainer_waits"] += 1
                    self._cond.wait(remaining)
            finally:
                if waited:
                    self._seconds["trainer_wait_s"] += time.monotonic() - start

    def _drop_stale(self, trainer_version: int) -> None:
        oldest = trainer_version - self.config.max_staleness
        kept = deque()
        for group in self._queue:
            if group.weight_version > trainer_version:
                raise ValueError(f"a queued group has weight_version={group.weight_version}, newer than get("
                                 f"trainer_version={trainer_version}); current_version() and trainer_version must "
                                 "count the same weight pushes")
            if group.weight_version < oldest:
                self._counts["dropped_groups"] += 1
                self._counts["dropped_rollouts"] += len(group.rollouts)
            else:
                kept.append(group)
        if len(kept) != len(self._queue):
            self._queue = kept
            self._cond.notify_all()

    def _hand_out(self, num_groups: int, trainer_version: int) -> list[list[Rollout]]:
        handed = [self._queue[index] for index in range(num_groups)]
        groups = [group.rollouts for group in handed]
        # token_staleness raises on a token newer than trainer_version: check before popping, so that the groups
        # stay queued for a get with a consistent version.
        token_ages = token_staleness([r for group in groups for r in group], trainer_version)
        for _ in range(num_groups):
            self._queue.popleft()
        # A group's rollouts all carry its stamp, which _drop_stale checked against trainer_version: each rollout's
        # staleness is its group's, and only the tokens (a version each) go through token_staleness.
        ages = repeat_counts(torch.tensor([trainer_version - group.weight_version for group in handed]),
                             torch.tensor([len(group.rollouts) for group in handed]))
        assert 0 <= int(ages.min()) and int(ages.max()) <= self.config.max_staleness
        self._histogram += torch.bincount(ages, minlength=self.config.max_staleness + 1)
        self._token_histogram += torch.bincount(token_ages, minlength=self.config.max_staleness + 1)
        self._handed_at_last_version += num_groups
        self._counts["groups_out"] += num_groups
        self._counts["rollouts_out"] += int(ages.numel())
        self._cond.notify_all()
        return groups

    def _exhausted_message(self, num_groups: int, trainer_version: int) -> str:
        producers = "; ".join(f"{name!r}: {status}" for name, status in self._producers.items())
        return (f"get(num_groups={num_groups}, trainer_version={trainer_version}): every producer has finished "
                f"({producers}) and {len(self._queue)} groups with weight_version >= "
                f"{trainer_version - self.config.max_staleness} are queued, so no more will come; take the rest "
                f"with get({len(self._queue)}) if any, or start a producer with more prompts")

    def _get_timeout_message(self, num_groups: int, trainer_version: int, timeout_s: float) -> str:
        producers = "; ".join(f"{name!r}: {status}" for name, status in self._producers.items()) or "none started"
        return (f"get(num_groups={num_groups}, trainer_version={trainer_version}) timed out after {timeout_s:g} s "
                f"waiting for {num_groups} groups with weight_version >= "
                f"{trainer_version - self.config.max_staleness} (max_staleness={self.config.max_staleness}): "
                f"{len(self._queue)} queued, {self._reserved} being generated, {self._counts['dropped_groups']} "
                f"dropped as stale so far; producers: {producers}")

    # --- lifecycle and metrics ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wake every waiter with :class:`RolloutBufferClosedError` (a producer's error, if one failed first, stays
        what ``get`` raises). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def metrics(self) -> dict[str, float]:
        """Counters since the buffer was made: ``staleness_mean``/``staleness_max`` and ``staleness_hist_<k>`` (rollouts
        handed out ``k`` versions old, from :func:`staleness`), ``groups_in``, ``groups_out``, ``rollouts_out``,
        ``dropped_groups``, ``dropped_rollouts``, ``producer_waits``/``producer_wait_s`` (puts and admissions that
        waited), ``trainer_waits``/``trainer_wait_s`` (gets that waited), ``queued_groups``, ``reserved_groups`` and
        ``fill`` (queued / capacity); ``token_staleness_mean`` and ``token_staleness_hist_<k>``: the same over response
        tokens at each token's own version (:func:`token_staleness`; fresher than the rollout's stamp after an
        in-flight update)."""
        with self._cond:
            histogram, token_histogram = self._histogram.clone(), self._token_histogram.clone()
            result: dict[str, float] = {key: float(value) for key, value in self._counts.items()}
            result.update(self._seconds)
            result["queued_groups"] = float(len(self._queue))
            result["reserved_groups"] = float(self._reserved)
            result["fill"] = len(self._queue) / self.config.capacity
        total = int(histogram.sum())
        ages = torch.arange(histogram.numel(), dtype=torch.float64)
        result["staleness_mean"] = float((ages * histogram).sum() / total) if total else 0.0
        result["staleness_max"] = float(torch.nonzero(histogram).max()) if total else 0.0
        result.update({f"staleness_hist_{age}": float(count) for age, count in enumerate(histogram.tolist())})
        tokens = int(token_histogram.sum())
        result["token_staleness_mean"] = float((ages * token_histogram).sum() / tokens) if tokens else 0.0
        result.update({f"token_staleness_hist_{age}": float(count)
                       for age, count in enumerate(token_histogram.tolist())})
        return result
