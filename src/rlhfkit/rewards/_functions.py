"""Apply Python reward functions ``fn(prompts, responses, labels) -> scores`` in batches, reporting every failure.

A function that also takes a ``columns`` keyword (``fn(prompts, responses, labels, *, columns)``, or ``**kwargs``)
receives each sample's dataset columns, a list of dicts aligned with the responses.

Part of :mod:`rlhfkit.rewards` (re-exported there). Sync functions run in daemon worker threads, async ones
(``async def``) as concurrent asyncio tasks in a daemon thread's event loop, so a hung call never blocks interpreter
exit. A batch that raises is re-run one sample at a time, so a failure names the sample(s) that cause it; a
non-finite or non-numeric score (a string such as ``"0.5"``, None, a dict) fails its sample. The caller chooses:
``on_error="raise"`` raises :class:`RewardError`, ``"assign"`` gives failed samples ``error_score`` and lists them in
the :class:`RewardReport`. A function returning the wrong number of scores (or a dict or set) always raises. Needs only the standard library.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Literal

from rlhfkit._calls import call_all

__all__ = ["RewardFailure", "RewardReport", "RewardError", "apply_reward_function", "accepts_columns",
           "check_field_type", "function_name"]

logger = logging.getLogger(__name__)

FailureKind = Literal["exception", "non_finite", "invalid", "timeout"]
_CANCEL_GRACE_S = 2.0  # how long past timeout_s an async call's loop may take to cancel its tasks


@dataclass(frozen=True)
class RewardFailure:
    """One sample a reward function could not score: its index in the request, the function, what went wrong."""

    index: int
    function: str
    kind: FailureKind
    message: str


@dataclass(frozen=True, kw_only=True)
class RewardReport:
    """What happened when one function scored a request. ``failures`` is empty when every sample was scored;
    otherwise each failed sample appears once (and got ``error_score`` under ``on_error="assign"``)."""

    function: str
    num_samples: int
    failures: tuple[RewardFailure, ...] = ()
    elapsed_s: float = 0.0
    mean_score: float = 0.0
    std_score: float = 0.0

    @property
    def num_failed(self) -> int:
        return len(self.failures)

    @property
    def failed_indices(self) -> list[int]:
        return [failure.index for failure in self.failures]

    def as_dict(self, prefix: str = "reward") -> dict[str, float]:
        """Flat stats for logging, e.g. ``{"reward/fn/num_failed": 2.0, ...}`` (mean, std, num_failed, seconds)."""
        base = f"{prefix}/{self.function}"
        return {f"{base}/mean": self.mean_score, f"{base}/std": self.std_score,
                f"{base}/num_failed": float(self.num_failed), f"{base}/seconds": self.elapsed_s}


class RewardError(RuntimeError):
    """A reward function failed on some samples (``on_error="raise"``) or broke its contract (wrong length)."""

    def __init__(self, function: str, failures: Sequence[RewardFailure] = (), message: str | None = None) -> None:
        self.function = function
        self.failures = tuple(failures)
        if message is None:
            shown = "; ".join(f"sample {f.index}: {f.message}" for f in self.failures[:5])
            more = f" (and {len(self.failures) - 5} more)" if len(self.failures) > 5 else ""
            message = (f"reward function {function!r} failed on {len(self.failures)} sample(s) "
                       f"{self.indices[:20]}: {shown}{more}. Fix the function, or pass on_error='assign' to give "
                       "failed samples error_score")
        super().__init__(message)

    @property
    def indices(self) -> list[int]:
        return [failure.index for failure in self.failures]


def function_name(fn: Callable) -> str:
    """A readable name for ``fn`` (functions, partials, callable objects)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return name.rsplit("<locals>.", 1)[-1]  # a function defined inside another: keep its own name


def accepts_columns(fn: Callable) -> bool:
    """Whether ``fn`` takes a ``columns`` keyword (a parameter of that name, or ``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):                 # a builtin without a signature: the three-list protocol
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == "columns" and p.kind is not p.VAR_POSITIONAL
                                           and p.kind is not p.POSITIONAL_ONLY) for p in parameters)


def _call(fn: Callable, wants_columns: bool, prompts, responses, labels, columns):
    """``fn``'s call on one batch (a coroutine for an async ``fn``)."""
    if wants_columns:
        return fn(prompts, responses, labels, columns=columns)
    return fn(prompts, responses, labels)


def _is_async(fn: Callable) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


@dataclass
class _Outcome:
    """Result of one call over samples ``[start, stop)``: values, an exception, or a timeout."""

    start: int
    stop: int
    values: Any = None
    error: BaseException | None = None
    timed_out: bool = False


def _run_sync(fn, slices, inputs, max_workers: int, timeout_s: float | None) -> list[_Outcome]:
    # Daemon threads (see rlhfkit._calls): a hung call is abandoned at timeout_s and never blocks interpreter exit.
    wants_columns = accepts_columns(fn)
    calls = [functools.partial(_call, fn, wants_columns, *(x[start:stop] for x in inputs)) for start, stop in slices]
    results = call_all(calls, timeout_s=timeout_s, name="reward", max_workers=max_workers)
    return [_Outcome(start, stop, result.value, result.error, result.timed_out)
            for (start, stop), result in zip(slices, results)]


async def _gather_async(fn, outcomes: list[_Outcome], inputs, max_workers: int, timeout_s: float | None) -> None:
    semaphore = asyncio.Semaphore(max_workers)
    wants_columns = accepts_columns(fn)

    async def one(outcome: _Outcome):
        async with semaphore:
            return await _call(fn, wants_columns, *(x[outcome.start:outcome.stop] for x in inputs))

    tasks = {asyncio.ensure_future(one(o)): o for o in outcomes}
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
        tasks[task].timed_out = True
    for task in done:
        if task.exception() is not None:
            tasks[task].error = task.exception()
        else:
            tasks[task].values = task.result()


def _run_async(fn, slices, inputs, max_workers: int, timeout_s: float | None) -> list[_Outcome]:
    # The loop runs in a daemon thread of its own (also when the caller is inside a running loop): a coroutine that
    # blocks the loop with synchronous code, or ignores cancellation, cannot stall the caller past timeout_s (plus a
    # grace for cancelling) nor keep the interpreter from exiting.
    outcomes = [_Outcome(start, stop) for start, stop in slices]
    finished = concurrent.futures.Future()

    def loop() -> None:
        try:
            asyncio.run(_gather_async(fn, outcomes, inputs, max_workers, timeout_s))
        except BaseException as error:                     # re-raised in the caller below
            finished.set_exception(error)
        else:
            finished.set_result(None)

    threading.Thread(target=loop, name="reward-asyncio", daemon=True).start()
    try:
        finished.result(timeout=None if timeout_s is None else timeout_s + _CANCEL_GRACE_S)
    except concurrent.futures.TimeoutError:
        logger.warning("reward function's event loop still blocked %.1f s past timeout_s=%s; abandoning it",
                       _CANCEL_GRACE_S, timeout_s)
        for outcome in outcomes:
            if outcome.values is None and outcome.error is None:
                outcome.timed_out = True
    return [_Outcome(o.start, o.stop, o.values, o.error, o.timed_out) for o in outcomes]  # a snapshot


def _check_values(name: str, outcome: _Outcome) -> list[tuple[int, float | RewardFailure]]:
    """Per-sample scores or failures of a finished call; a wrong count or a non-sequence raises RewardError."""
    expected = outcome.stop - outcome.start
    values = outcome.values
    if (isinstance(values, (str, bytes, Mapping, Set)) or not hasattr(values, "__len__")
            or not hasattr(values, "__getitem__") or len(values) != expected):
        got = (f"a {type(values).__name__}" if isinstance(values, (str, bytes, Mapping, Set))
               or not hasattr(values, "__len__") else f"{len(values)} values")
        raise RewardError(name, message=f"reward function {name!r} returned {got} for samples {outcome.start}.."
                                        f"{outcome.stop - 1} ({expected} samples); it must return a list with one "
                                        "score per sample, in order")
    checked: list[tuple[int, float | RewardFailure]] = []
    for offset in range(expected):
        index = outcome.start + offset
        value = values[offset]
        score = _as_score(value)
        if score is None:
            checked.append((index, RewardFailure(
                index, name, "invalid", f"score {value!r:.80} ({type(value).__name__}) is not a number; return an "
                                        "int or float per sample")))
        elif not math.isfinite(score):
            checked.append((index, RewardFailure(index, name, "non_finite", f"non-finite score {score}")))
        else:
            checked.append((index, score))
    return checked


def _as_score(value: Any) -> float | None:
    """``value`` as a float if it is a real number (bool, int, float, numpy scalars, one-element tensors), else None.

    Deliberately not ``float(value)`` alone: that parses strings ("0.5") and would let a function that returns text
    pass unnoticed."""
    if isinstance(value, (str, bytes, bytearray, Mapping, complex)) or value is None:
        return None
    if not isinstance(value, numbers.Real) and not hasattr(type(value), "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):                    # e.g. a tensor of several elements, a complex one
        return None


def check_field_type(owner: str, field: str, value: Any, kind: str) -> None:
    """TypeError naming ``<owner>.<field>``, its value and what to pass. ``kind``: ``"int"``, ``"real"`` (int or
    float), ``"str"``, ``"bool"``, each optionally ``"|None"``. A bool is never taken for an int or a real."""
    base, _, optional = kind.partition("|")
    if optional and value is None:
        return
    fits = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "real": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
            "str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool)}[base](value)
    if not fits:
        wanted = {"int": "an int", "real": "a number (int or float)", "str": "a string", "bool": "True or False"}[base]
        raise TypeError(f"{owner}.{field}={value!r} is a {type(value).__name__}; pass {wanted}"
                        f"{' or None' if optional else ''}")


def _validate_args(prompts, responses, labels, columns, batch_size, on_error, error_score, max_workers, timeout_s):
    if isinstance(responses, str) or isinstance(prompts, str):
        raise TypeError("apply_reward_function(prompts, responses, ...) take lists of strings, got a single string")
    if labels is not None and len(labels) != len(responses):
        raise ValueError(f"apply_reward_function: {len(labels)} labels for {len(responses)} responses")
    if columns is not None and (isinstance(columns, Mapping) or len(columns) != len(responses)):
        got = "a dict" if isinstance(columns, Mapping) else f"{len(columns)} entries"
        raise ValueError(f"apply_reward_function(columns=...) got {got} for {len(responses)} responses; pass one dict "
                         "of columns per response (e.g. rollout_columns(rollouts, batch.columns))")
    if len(prompts) != len(responses):
        raise ValueError(f"apply_reward_function: {len(prompts)} prompts for {len(responses)} responses")
    for field, value, kind in (("batch_size", batch_size, "int"), ("error_score", error_score, "real"),
                               ("max_workers", max_workers, "int"), ("timeout_s", timeout_s, "real|None")):
        check_field_type("apply_reward_function", field, value, kind)
    if batch_size < 1:
        raise ValueError(f"apply_reward_function(batch_size={batch_size!r}); must be a positive int")
    if on_error not in ("raise", "assign"):
        raise ValueError(f"apply_reward_function(on_error={on_error!r}); choose 'raise' or 'assign'")
    if not math.isfinite(error_score):
        raise ValueError(f"apply_reward_function(error_score={error_score}); must be finite")
    if max_workers < 1:
        raise ValueError(f"apply_reward_function(max_workers={max_workers!r}); must be a positive int")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"apply_reward_function(timeout_s={timeout_s}); must be > 0 or None")


def _collect(name: str, outcomes: list[_Outcome], run_singles) -> tuple[dict[int, float], list[RewardFailure],
                                                                           BaseException | None]:
    scores: dict[int, float] = {}
    failures: list[RewardFailure] = []
    first_error = None
    to_isolate = []
    for outcome in outcomes:
        if outcome.timed_out:
            failures += [RewardFailure(i, name, "timeout", "did not finish within timeout_s")
                         for i in range(outcome.start, outcome.stop)]
        elif outcome.error is not None:
            first_error = first_error or outcome.error
            if outcome.stop - outcome.start == 1:
                failures.append(RewardFailure(outcome.start, name, "exception", _describe(outcome.error)))
            else:
                to_isolate += [(i, i + 1) for i in range(outcome.start, outcome.stop)]
        else:
            for index, value in _check_values(name, outcome):
                if isinstance(value, RewardFailure):
                    failures.append(value)
                else:
                    scores[index] = value
    if to_isolate:
        single_scores, single_failures, _ = _collect(name, run_singles(to_isolate), run_singles)
        scores.update(single_scores)
        failures += single_failures
    return scores, sorted(failures, key=lambda f: f.index), first_error


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def apply_reward_function(fn: Callable, prompts: Sequence[str], responses: Sequence[str],
                          labels: Sequence[str | None] | None = None, *,
                          columns: Sequence[Mapping[str, Any]] | None = None, batch_size: int = 64,
                          on_error: Literal["raise", "assign"] = "raise", error_score: float = 0.0,
                          max_workers: int = 4, timeout_s: float | None = None,
                          name: str | None = None) -> tuple[list[float], RewardReport]:
    """Score every sample with ``fn(prompts, responses, labels) -> list[float]`` (sync or ``async def``).

    Args:
        fn: the reward function; called on consecutive batches of at most ``batch_size`` samples. A function that
            takes a ``columns`` keyword (or ``**kwargs``) is called as ``fn(prompts, responses, labels,
            columns=columns)``.
        prompts, responses, labels: aligned lists (``labels`` None → a list of None).
        columns: per-sample dicts of dataset columns, aligned with ``responses`` (None → empty dicts).
        on_error: ``"raise"`` → :class:`RewardError` naming the function and failed sample indices; ``"assign"`` →
            failed samples score ``error_score`` and are listed in the report.
        max_workers: batches in flight at once (threads for sync functions, tasks for async ones).
        timeout_s: deadline for all batches together (and again for re-running a failed batch per sample);
            unfinished samples fail as ``"timeout"``. Async calls are cancelled; a sync call cannot be killed and
            keeps its (daemon) worker thread until it returns, which never delays interpreter exit.
        name: name used in reports and errors (default: the function's name).

    Returns:
        ``scores`` (one float per sample) and a :class:`RewardReport`.
    """
    _validate_args(prompts, responses, labels, columns, batch_size, on_error, error_score, max_workers, timeout_s)
    name = name or function_name(fn)
    inputs = (list(prompts), list(responses), list(labels) if labels is not None else [None] * len(responses),
              [dict(c) for c in columns] if columns is not None else [{} for _ in responses])
    runner = _run_async if _is_async(fn) else _run_sync
    started = time.perf_counter()

    def run(slices):
        return runner(fn, slices, inputs, max_workers, timeout_s)

    slices = [(start, min(start + batch_size, len(responses))) for start in range(0, len(responses), batch_size)]
    scores, failures, first_error = _collect(name, run(slices), run)
    if failures and on_error == "raise":
        raise RewardError(name, failures) from first_error
    if failures:
        logger.warning("reward function %r failed on %d of %d samples; assigned error_score=%s", name,
                       len(failures), len(responses), error_score)
    result = [scores.get(index, error_score) for index in range(len(responses))]
    mean = sum(result) / len(result) if result else 0.0
    report = RewardReport(function=name, num_samples=len(responses), failures=tuple(failures),
                          elapsed_s=time.perf_counter() - started, mean_score=mean,
                          std_score=math.sqrt(sum((x - mean) ** 2 for x in result) / len(result)) if result else 0.0)
    return result, report
