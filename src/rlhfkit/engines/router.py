"""Spread generate requests over several rollout engines and broadcast control calls to all of them.

:class:`EngineGroup` takes engines of two kinds, mixed freely: plain in-process objects implementing
:class:`~rlhfkit.engines.protocol.RolloutEngine` (each gets one worker thread, so one engine runs one call at a time,
as a Ray actor does, and different engines run concurrently) and Ray actor handles of such engines (e.g. those of
:func:`rlhfkit.engines.vllm.create_engines`).

What it does: assigns each prompt (with its ``n`` samples, which stay together: a GRPO group shares one engine and its
prefix cache) to the engine with the least outstanding work — tokens in flight, ``(prompt length + max_new_tokens) ×
n``, counted across concurrent calls until each engine's part returns — largest prompts first; returns rollouts in
input order (prompt-major, then sample) with global ``prompt_index``; gives every call a timeout. An engine that dies
(Ray actor death) or does not answer in time raises :class:`EngineDiedError` / :class:`EngineTimeoutError` naming the
engine index; an engine that raises is reported as :class:`EngineError` with its index. ``sleep``, ``wake_up``,
``load_weights``, ``health_check`` and any method (:meth:`EngineGroup.call`) go to every engine. Session affinity:
:meth:`EngineGroup.assign_sessions` picks an engine per conversation and ``generate(engine_indices=...)`` pins
prompts to engines, so the turns of a multi-turn conversation reuse one engine's prefix cache.

What it does not do: retry, reroute work away from a failed engine, cancel the other engines' parts after a failure
(they finish and are dropped), or create engines. Pure Python; ``ray`` is imported only when a Ray handle is used.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import logging
import queue
import re
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlhfkit._optional import require
from rlhfkit.engines.protocol import WAKE_TAGS, SamplingConfig, check_weight_lag, next_weight_version
from rlhfkit.types import Rollout

__all__ = ["EngineGroupConfig", "EngineGroup", "EngineError", "EngineTimeoutError", "EngineDiedError",
           "pack_generate_result", "unpack_generate_result"]

logger = logging.getLogger(__name__)

PACKED_FINISH_REASONS = ("stop", "length", "abort")


def pack_generate_result(responses: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]] | None,
                         finish_reasons: Sequence[str], *, n: int, weight_version: int,
                         versions: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """The compact form of one engine's ``generate`` result that Ray actors return (``generate_packed``): numpy arrays
    instead of one :class:`~rlhfkit.types.Rollout` (three tensors) per sample, which Ray would pickle one by one.
    Prompts are not sent back: the caller has them.

    Args:
        responses: per sample (prompt-major, then sample index), its response token ids.
        logprobs: per sample, the response tokens' log-probs; None when not requested.
        finish_reasons: per sample, one of :data:`PACKED_FINISH_REASONS`.
        n: samples per prompt.
        weight_version: the engine's weight version.
        versions: per sample, the weight version of each response token, when weights changed during the call
            (an in-flight update of a pausable engine); None: every token is of ``weight_version``.

    Returns:
        ``{"tokens": int64 [sum R], "logprobs": float32 [sum R] or None, "lengths": int64 [N], "finish": uint8 [N]
        (index into PACKED_FINISH_REASONS), "n": n, "weight_version": weight_version}``, and ``"versions"``: int64
        [sum R] when ``versions`` is given.
    """
    import numpy as np

    lengths = np.fromiter((len(r) for r in responses), dtype=np.int64, count=len(responses))
    tokens = np.fromiter((int(t) for r in responses for t in r), dtype=np.int64, count=int(lengths.sum()))
    values = None
    if logprobs is not None:
        values = np.fromiter((float(v) for r in logprobs for v in r), dtype=np.float32, count=int(lengths.sum()))
    bad = sorted({str(f) for f in finish_reasons} - set(PACKED_FINISH_REASONS))
    if bad:
        raise ValueError(f"finish_reasons contains {bad}; each must be one of {PACKED_FINISH_REASONS}")
    finish = np.fromiter((PACKED_FINISH_REASONS.index(f) for f in finish_reasons), dtype=np.uint8,
                         count=len(finish_reasons))
    packed = {"tokens": tokens, "logprobs": values, "lengths": lengths, "finish": finish, "n": int(n),
              "weight_version": int(weight_version)}
    if versions is not None:
        if [len(v) for v in versions] != lengths.tolist():
            raise ValueError("versions must hold one weight version per response token of each sample")
        packed["versions"] = np.fromiter((int(v) for sample in versions for v in sample), dtype=np.int64,
                                         count=int(lengths.sum()))
    return packed


def unpack_generate_result(packed: dict[str, Any], prompts: Sequence[Sequence[int]],
                           prompt_indices: Sequence[int]) -> list[Rollout]:
    """Rebuild the :class:`~rlhfkit.types.Rollout` list from :func:`pack_generate_result` on the caller's side.

    ``prompts`` are the token ids the engine was sent, ``prompt_indices`` their global indices (one per prompt).
    Each rollout owns its tensors (copies, not views into one buffer: pickling a view would carry the whole buffer).
    """
    import numpy as np
    import torch

    n, lengths = int(packed["n"]), np.asarray(packed["lengths"], dtype=np.int64)
    if len(lengths) != len(prompts) * n or len(prompt_indices) != len(prompts):
        raise ValueError(f"packed result has {len(lengths)} samples for {len(prompts)} prompts × n={n} and "
                         f"{len(prompt_indices)} prompt indices; they must agree")
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    # np.array copies: arrays that come out of Ray's object store are read-only
    tokens = torch.from_numpy(np.array(packed["tokens"], dtype=np.int64))
    values = packed.get("logprobs")
    values = None if values is None else torch.from_numpy(np.array(values, dtype=np.float32))
    versions = packed.get("versions")
    versions = None if versions is None else torch.from_numpy(np.array(versions, dtype=np.int64))
    rollouts = []
    for position, (prompt, global_index) in enumerate(zip(prompts, prompt_indices)):
        prompt_tensor = torch.tensor(list(prompt), dtype=torch.int64)
        for sample in range(n):
            k = position * n + sample
            start, stop = bounds[k], bounds[k + 1]
            stamps = None if versions is None or stop == start else versions[start:stop]
            spans = stamps is not None and int(stamps[0]) != int(stamps[-1])
            rollouts.append(Rollout(
                prompt_token_ids=prompt_tensor, response_token_ids=tokens[start:stop].clone(),
                response_logprobs=None if values is None else values[start:stop].clone(),
                finish_reason=PACKED_FINISH_REASONS[int(packed["finish"][k])],  # type: ignore[arg-type]
                prompt_index=int(global_index), sample_index=sample,
                weight_version=int(stamps[0]) if stamps is not None else int(packed["weight_version"]),
                response_weight_versions=stamps.clone() if spans else None))
    return rollouts


class EngineError(RuntimeError):
    """A call to one engine of a group failed. ``engine_index`` names the engine, ``method`` the call."""

    def __init__(self, message: str, *, engine_index: int, method: str) -> None:
        super().__init__(message)
        self.engine_index = engine_index
        self.method = method


class EngineTimeoutError(EngineError, TimeoutError):
    """An engine did not answer within the call's timeout (hung, overloaded, or waiting for resources)."""


class EngineDiedError(EngineError):
    """An engine's Ray actor died (killed, crashed, or its node was lost)."""


@dataclass(frozen=True, kw_only=True)
class EngineGroupConfig:
    """Timeouts and balancing of an :class:`EngineGroup`.

    Attributes:
        generate_timeout_s: longest wait for an engine's share of one ``generate`` call.
        control_timeout_s: longest wait for ``sleep``, ``wake_up``, ``load_weights`` and :meth:`EngineGroup.call`.
        health_timeout_s: longest wait for ``health_check``.
        balance: ``"tokens"`` weighs a prompt by ``(len(prompt) + max_new_tokens) × n``; ``"prompts"`` by ``n``.
        max_weight_lag: when ``generate`` is given ``trainer_version``, the most weight versions an engine's
            rollouts may lag it (0: on-policy; see :func:`~rlhfkit.engines.protocol.check_weight_lag`).
        on_weight_lag: ``"raise"`` (:class:`~rlhfkit.engines.protocol.WeightLagError`) or ``"warn"`` past the bound.
    """

    generate_timeout_s: float = 600.0
    control_timeout_s: float = 300.0
    health_timeout_s: float = 30.0
    balance: Literal["tokens", "prompts"] = "tokens"
    max_weight_lag: int = 0
    on_weight_lag: Literal["raise", "warn"] = "raise"

    def __post_init__(self) -> None:
        for name in ("generate_timeout_s", "control_timeout_s", "health_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"EngineGroupConfig.{name}={value!r}; must be a number of seconds > 0")
        if self.balance not in ("tokens", "prompts"):
            raise ValueError(f"EngineGroupConfig.balance={self.balance!r}; expected 'tokens' or 'prompts'")
        lag = self.max_weight_lag
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise ValueError(f"EngineGroupConfig.max_weight_lag={lag!r}; must be an int >= 0 (0 = on-policy)")
        if self.on_weight_lag not in ("raise", "warn"):
            raise ValueError(f"EngineGroupConfig.on_weight_lag={self.on_weight_lag!r}; expected 'raise' or 'warn'")


def assign_prompts(work: Sequence[float], outstanding: Sequence[float]) -> list[list[int]]:
    """Longest-processing-time assignment: prompts by decreasing ``work`` (ties: lower index first), each to the
    engine whose ``outstanding`` work plus what it was assigned so far is smallest (ties: lower engine index).

    Returns, per engine, the indices of its prompts in increasing order.
    """
    if not outstanding:
        raise ValueError("assign_prompts needs at least one engine (outstanding is empty)")
    load = [float(value) for value in outstanding]
    shards: list[list[int]] = [[] for _ in load]
    for index in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        engine = min(range(len(load)), key=lambda e: (load[e], e))
        shards[engine].append(index)
        load[engine] += float(work[index])
    return [sorted(shard) for shard in shards]


class _ThreadEngine:
    """One daemon thread serving calls to one in-process engine in order (a hung call cannot block interpreter
    exit, unlike a ThreadPoolExecutor worker)."""

    def __init__(self, engine: Any, index: int) -> None:
        self.engine = engine
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=f"rlhfkit-engine-{index}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, function = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function())
            except BaseException as error:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(error)

    def submit(self, method: str, args: tuple, kwargs: dict) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        engine = self.engine

        def function() -> Any:
            attribute = getattr(engine, method)
            return attribute(*args, **kwargs) if callable(attribute) else attribute

        self._queue.put((future, function))
        return future

    def close(self) -> None:
        self._queue.put(None)


def _is_ray_handle(engine: Any) -> bool:
    ray = sys.modules.get("ray")  # no Ray handle can exist unless ray was imported
    actor = getattr(ray, "actor", None)
    return actor is not None and isinstance(engine, actor.ActorHandle)


class EngineGroup:
    """Several rollout engines behind one ``generate`` (see the module docstring).

    Args:
        engines: in-process engines and/or Ray actor handles of engines.
        config: timeouts and balancing.
        forward_prompt_indices: pass ``prompt_indices=`` (global indices of the prompts in an engine's share) to the
            engines' ``generate``, which :class:`rlhfkit.engines.vllm.VLLMEngine` uses to seed each prompt
            independently of the sharding. None: yes for in-process engines whose ``generate`` accepts it, no for
            Ray handles (``create_engine_group`` sets it for vLLM actors).
        packed_results: call ``generate_packed`` (see :func:`pack_generate_result`) instead of ``generate`` on Ray
            handles and build the rollouts here — one compact object through Ray instead of three tensors per
            sample. None: for Ray handles that have a ``generate_packed`` method. In-process engines always use
            ``generate``.
    """

    def __init__(self, engines: Sequence[Any], *, config: EngineGroupConfig | None = None,
                 forward_prompt_indices: bool | None = None, packed_results: bool | None = None) -> None:
        if isinstance(engines, (str, bytes)) or not isinstance(engines, Sequence) or len(engines) == 0:
            raise ValueError(f"engines={engines!r}; pass a non-empty sequence of engines or Ray actor handles")
        self.config = config or EngineGroupConfig()
        self._engines = list(engines)
        self._ray_flags = [_is_ray_handle(engine) for engine in self._engines]
        self._threads = [None if ray else _ThreadEngine(engine, i)
                         for i, (engine, ray) in enumerate(zip(self._engines, self._ray_flags))]
        self._forward = [self._accepts_prompt_indices(i, forward_prompt_indices) for i in range(len(engines))]
        self._packed = [ray and (hasattr(engine, "generate_packed") if packed_results is None else bool(packed_results))
                        for engine, ray in zip(self._engines, self._ray_flags)]
        self._lock = threading.Lock()
        self._outstanding = [0.0] * len(self._engines)

    def _accepts_prompt_indices(self, index: int, forward: bool | None) -> bool:
        if forward is not None:
            return bool(forward)
        if self._ray_flags[index]:
            return False
        try:
            return "prompt_indices" in inspect.signature(self._engines[index].generate).parameters
        except (AttributeError, TypeError, ValueError):
            return False

    @property
    def num_engines(self) -> int:
        return len(self._engines)

    @property
    def engines(self) -> list[Any]:
        return list(self._engines)

    @property
    def outstanding(self) -> list[float]:
        """Work units (see ``EngineGroupConfig.balance``) each engine has in flight now."""
        with self._lock:
            return list(self._outstanding)

    # --- calls and waiting --------------------------------------------------------------------------------------------
    def _submit(self, index: int, method: str, args: tuple = (), kwargs: dict | None = None
                ) -> concurrent.futures.Future:
        kwargs = kwargs or {}
        if self._ray_flags[index]:
            return getattr(self._engines[index], method).remote(*args, **kwargs).future()
        return self._threads[index].submit(method, args, kwargs)  # type: ignore[union-attr]

    def _failure(self, index: int, method: str, error: BaseException) -> EngineError:
        where = f"engine {index} (of {self.num_engines})"
        exceptions = getattr(sys.modules.get("ray"), "exceptions", None)  # only Ray handles raise Ray's errors
        if exceptions is not None:
            if isinstance(error, (exceptions.RayActorError, exceptions.ActorUnschedulableError)):
                return EngineDiedError(f"{where} died during {method}: {_summary(error)}", engine_index=index,
                                       method=method)
            if isinstance(error, exceptions.RayTaskError) and getattr(error, "cause", None) is not None:
                error = error.cause
            elif isinstance(error, exceptions.UnserializableException):
                from rlhfkit.workers import original_exception

                return EngineError(f"{where} failed in {method}: {original_exception(error)} (its exception class "
                                   "could not be re-created here; make it picklable to catch it by type)",
                                   engine_index=index, method=method)
        return EngineError(f"{where} failed in {method}: {type(error).__name__}: {error}",
                           engine_index=index, method=method)

    def _wait(self, futures: dict[int, concurrent.futures.Future], method: str, timeout_s: float) -> dict[int, Any]:
        """Results by engine index; the first failure (or the timeout) raises, naming the engine(s)."""
        deadline = time.monotonic() + timeout_s
        pending = set(futures.values())
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                                    return_when=concurrent.futures.FIRST_EXCEPTION)
            for index, future in futures.items():
                if future in done and future.exception() is not None:
                    raise self._failure(index, method, future.exception()) from future.exception()
            if pending and time.monotonic() >= deadline:
                late = sorted(index for index, future in futures.items() if future in pending)
                names = ", ".join(str(index) for index in late)
                raise EngineTimeoutError(
                    f"engine {names} (of {self.num_engines}) did not finish {method} within {timeout_s:g} s; it is "
                    "hung, overloaded or waiting for resources (raise the timeout in EngineGroupConfig if it is only "
                    "slow)",
                    engine_index=late[0], method=method)
        return {index: future.result() for index, future in futures.items()}

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every engine; returns the results in engine order. An attribute that is
        not callable on an in-process engine (e.g. the ``weight_version`` property) is read instead."""
        futures = {index: self._submit(index, method, args, kwargs) for index in range(self.num_engines)}
        results = self._wait(futures, method, timeout_s or self.config.control_timeout_s)
        return [results[index] for index in range(self.num_engines)]

    # --- generate -----------------------------------------------------------------------------------------------------
    def _work(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[float]:
        if self.config.balance == "prompts":
            return [float(sampling.n)] * len(prompts)
        return [float((len(prompt) + sampling.max_new_tokens) * sampling.n) for prompt in prompts]

    def _start_shard(self, index: int, shard: list[int], prompts: list[list[int]], sampling: SamplingConfig,
                     work: float) -> concurrent.futures.Future:
        kwargs = {"prompt_indices": list(shard)} if self._forward[index] else {}
        method = "generate_packed" if self._packed[index] else "generate"
        with self._lock:
            self._outstanding[index] += work
        try:
            future = self._submit(index, method, ([prompts[i] for i in shard], sampling), kwargs)
        except BaseException:
            with self._lock:
                self._outstanding[index] -= work
            raise

        def release(_: concurrent.futures.Future) -> None:
            with self._lock:
                self._outstanding[index] -= work

        future.add_done_callback(release)
        return future

    def assign_sessions(self, work: Sequence[float]) -> list[int]:
        """The engine each new session (a conversation, or a GRPO group of them) should stay on: sessions by
        decreasing ``work`` go to the engine with the least outstanding work plus what it was given so far. Pass
        the result as ``generate(..., engine_indices=...)`` on every turn so a conversation keeps its engine (and
        that engine's prefix cache)."""
        values = [float(value) for value in work]
        if any(not value >= 0 for value in values):
            raise ValueError(f"assign_sessions(work={list(work)!r}); every entry must be a number >= 0")
        engines = [0] * len(values)
        for engine, shard in enumerate(assign_prompts(values, self.outstanding)):
            for session in shard:
                engines[session] = engine
        return engines

    def _pinned_shards(self, engine_indices: Any, num_prompts: int) -> list[list[int]]:
        if isinstance(engine_indices, (str, bytes)) or not isinstance(engine_indices, Sequence) \
                or len(engine_indices) != num_prompts:
            raise ValueError(f"engine_indices={engine_indices!r}; pass one engine index per prompt ({num_prompts})")
        shards: list[list[int]] = [[] for _ in range(self.num_engines)]
        for position, engine in enumerate(engine_indices):
            if isinstance(engine, bool) or not isinstance(engine, int) or not 0 <= engine < self.num_engines:
                raise ValueError(f"engine_indices[{position}]={engine!r}; must be an engine index in "
                                 f"[0, {self.num_engines})")
            shards[engine].append(position)
        return shards

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 timeout_s: float | None = None, trainer_version: int | None = None,
                 engine_indices: Sequence[int] | None = None) -> list[Rollout]:
        """Sample ``sampling.n`` responses per prompt across the engines; ``len(result) == len(prompts) * n``, in
        input order with global ``prompt_index``.

        ``engine_indices``: one engine per prompt (session affinity, e.g. from :meth:`assign_sessions`): prompt ``i``
        goes to engine ``engine_indices[i]`` instead of the least loaded one.

        ``trainer_version``: the weight version the trainer holds now. When given, the rollouts' ``weight_version``
        is checked against it (``config.max_weight_lag``, ``config.on_weight_lag``): an engine the trainer's weights
        were not pushed to raises :class:`~rlhfkit.engines.protocol.WeightLagError` naming it and both versions."""
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if trainer_version is not None and (isinstance(trainer_version, bool) or not isinstance(trainer_version, int)
                                            or trainer_version < 0):
            raise ValueError(f"trainer_version={trainer_version!r}; must be a non-negative int or None")
        prompts = _as_prompt_lists(prompt_token_ids)
        if not prompts:
            return []
        work = self._work(prompts, sampling)
        shards = (assign_prompts(work, self.outstanding) if engine_indices is None
                  else self._pinned_shards(engine_indices, len(prompts)))
        futures = {index: self._start_shard(index, shard, prompts, sampling, sum(work[i] for i in shard))
                   for index, shard in enumerate(shards) if shard}
        results = self._wait(futures, "generate", timeout_s or self.config.generate_timeout_s)
        ordered: list[list[Rollout] | None] = [None] * len(prompts)
        for index, rollouts in results.items():
            if self._packed[index]:
                rollouts = self._unpack(index, rollouts, prompts, shards[index])
            for position, rollout_group in enumerate(self._split(index, rollouts, shards[index], sampling.n)):
                ordered[shards[index][position]] = rollout_group
        if trainer_version is not None:
            engines = sorted(results)
            oldest = [min(r.weight_version for p in shards[i] for r in ordered[p]) for i in engines]  # type: ignore
            check_weight_lag(oldest, trainer_version=trainer_version, max_lag=self.config.max_weight_lag,
                             on_lag=self.config.on_weight_lag,
                             sources=[f"engine {i} (of {self.num_engines})" for i in engines])
        return [rollout for group in ordered for rollout in group]  # type: ignore[union-attr]

    def _unpack(self, index: int, packed: Any, prompts: list[list[int]], shard: list[int]) -> list[Rollout]:
        try:
            return unpack_generate_result(packed, [prompts[i] for i in shard], shard)
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise EngineError(f"engine {index} (of {self.num_engines}) returned a malformed packed result: "
                              f"{type(error).__name__}: {error}", engine_index=index, method="generate") from error

    def _split(self, index: int, rollouts: Any, shard: list[int], n: int) -> list[list[Rollout]]:
        if not isinstance(rollouts, list) or len(rollouts) != len(shard) * n:
            got = len(rollouts) if isinstance(rollouts, list) else type(rollouts).__name__
            raise EngineError(f"engine {index} (of {self.num_engines}) returned {got} rollouts for {len(shard)} "
                              f"prompts × n={n}; expected {len(shard) * n}", engine_index=index, method="generate")
        groups = []
        for position, global_index in enumerate(shard):
            group = rollouts[position * n:(position + 1) * n]
            groups.append([r if r.prompt_index == global_index else dataclasses.replace(r, prompt_index=global_index)
                           for r in group])
        return groups

    # --- broadcasts ---------------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1, *, timeout_s: float | None = None) -> None:
        if level not in (1, 2):
            raise ValueError(f"level={level!r}; expected 1 (keep weights in host memory) or 2 (discard them)")
        self.call("sleep", level, timeout_s=timeout_s)

    def wake_up(self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None) -> None:
        if tags is not None:
            bad = [tag for tag in tags if tag not in WAKE_TAGS]
            if isinstance(tags, str) or bad:
                raise ValueError(f"tags={tags!r}; expected None or a list drawn from {list(WAKE_TAGS)}")
            tags = list(tags)
        self.call("wake_up", tags, timeout_s=timeout_s)

    def load_weights(self, weights: Iterable[tuple[str, Any]], *, version: int | None = None,
                     timeout_s: float | None = None) -> list[int]:
        """Send the same named tensors to every engine (Ray engines share one object-store copy). For large models
        use the weight-sync channel instead. An explicit ``version`` must be newer than every engine's
        (:class:`~rlhfkit.engines.protocol.WeightVersionError`, before anything is sent)."""
        if version is not None:  # refused before anything is sent: every engine must move forward
            for index, current in enumerate(self.weight_versions(timeout_s=timeout_s)):
                next_weight_version(f"engine {index} (of {self.num_engines})", current, version)
        pairs = [(str(name), tensor) for name, tensor in weights]
        payload: Any = pairs
        if any(self._ray_flags):
            payload = require("ray", user="rlhfkit.engines.router").put(pairs)
        futures = {index: self._submit(index, "load_weights", (pairs if not self._ray_flags[index] else payload,),
                                       {"version": version}) for index in range(self.num_engines)}
        results = self._wait(futures, "load_weights", timeout_s or self.config.control_timeout_s)
        return [results[index] for index in range(self.num_engines)]

    def health_check(self, *, timeout_s: float | None = None) -> list[Any]:
        """Ask every engine ``health_check()`` (in-process engines without it report their ``weight_version``)."""
        timeout_s = timeout_s or self.config.health_timeout_s
        futures = {}
        for index, engine in enumerate(self._engines):
            method = "health_check" if self._ray_flags[index] or hasattr(engine, "health_check") else "weight_version"
            futures[index] = self._submit(index, method)
        results = self._wait(futures, "health_check", timeout_s)
        return [results[index] for index in range(self.num_engines)]

    def weight_versions(self, *, timeout_s: float | None = None) -> list[int]:
        """Each engine's weight version (Ray engines answer ``get_weight_version()``)."""
        futures = {index: self._submit(index, "get_weight_version" if ray else "weight_version")
                   for index, ray in enumerate(self._ray_flags)}
        results = self._wait(futures, "weight_version", timeout_s or self.config.health_timeout_s)
        return [int(results[index]) for index in range(self.num_engines)]

    def close(self) -> None:
        """Stop the worker threads of in-process engines (engines and actors themselves are left alone)."""
        for thread in self._threads:
            if thread is not None:
                thread.close()

    def __enter__(self) -> EngineGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _summary(error: BaseException) -> str:
    """First and last lines of a (Ray) error without terminal colour codes: what happened, and the root cause."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _as_prompt_lists(prompt_token_ids: Any) -> list[list[int]]:
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
        raise TypeError(f"prompt_token_ids must be a sequence of token-id sequences, got "
                        f"{type(prompt_token_ids).__name__}")
    prompts = []
    for index, prompt in enumerate(prompt_token_ids):
        ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or len(ids) == 0:
            raise ValueError(f"prompt_token_ids[{index}]={prompt!r}; each prompt must be a non-empty sequence of "
                             "token ids")
        prompts.append([int(token) for token in ids])
    return prompts

