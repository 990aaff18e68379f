"""Rollout engines of a hybrid run: engine actors whose sleep and wake go through the phase guard, and
:class:`RolloutEngines`, the driver's handle on them (generate, sleep/wake, weight versions).

The engine actors are rlhfkit's own (:class:`rlhfkit.engines.vllm.VLLMEngineActor`,
:class:`rlhfkit.engines.sglang.SGLangEngineActor`, or the HF engine in a Ray actor for CPU runs) with
:class:`GuardedEngineMixin` added: ``guarded_sleep(level)`` releases the engine's GPUs in the guard, ``guarded_wake(tags)`` claims them first. Level 0 keeps the engine resident (weights and KV cache stay); the
guard still orders the phases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rlhfkit.hybrid._errors import EnginesBusyError, HybridCallError, sleep_hint
from rlhfkit.hybrid._results import CallCost, CallObserver, CallRecord
from rlhfkit.hybrid._timer import StartupClock
from rlhfkit.hybrid._trainer_worker import transition_record
from rlhfkit.phase import PhaseGuard

__all__ = [
    "GuardedEngineMixin",
    "HFEngineActor",
    "RolloutEngines",
    "guarded_sglang_engine_class",
    "guarded_vllm_engine_class",
]


def pass_start_gate(guard_store: Any, start_gate: str | None, config: Any, *, timeout_s: float) -> Any:
    """Wait (``timeout_s``) until ``start_gate`` is raised in ``guard_store``; returns ``config`` with the settings
    the gate carries applied (its value: a JSON object of ``config``'s fields, e.g. the KV-cache bytes
    :meth:`~rlhfkit.hybrid.Hybrid.start`'s checks worked out while this process started). No gate: ``config``."""
    if start_gate is None:
        return config
    guard_store.wait_flag(start_gate, timeout_s=timeout_s)
    settings = json.loads(guard_store.flag_value(start_gate) or "{}")
    if not isinstance(settings, dict) or not settings:
        return config
    return dataclasses.replace(config, **settings)


class GuardedEngineMixin:
    """Adds guarded ``guarded_sleep``/``guarded_wake`` to an engine actor (``sleep``/``wake_up`` methods), and
    :meth:`startup_parts`."""

    role = "rollout"

    def startup_parts(self) -> dict[str, float]:
        """Where this engine's start went, in seconds: ``process_s`` (its process's age when the actor began: spawn,
        Ray's worker set-up), ``import_s`` (the engine library), ``gate_wait_s`` (waiting for the trainers' loads,
        colocated), ``build_s`` (the engine and its model)."""
        return dict(getattr(self, "_startup", {}))

    def _guard_setup(self, store: Any, gpus: Sequence[str]) -> None:
        self._guard, self._gpus, self._events = PhaseGuard(store, sleep_hint=sleep_hint), tuple(gpus), []
        self._resident = False

    def guarded_sleep(self, level: int, phase: str) -> CallCost:
        """Sleep at ``level`` (0: stay resident, only the guard's claim is released); returns its seconds and
        ``bytes_d2h`` (what the engine's ``sleep`` reports it copied to host; 0 when it reports nothing)."""
        self._resident = level == 0
        seconds, moved = 0.0, 0.0
        for index, gpu in enumerate(self._gpus):
            model, kwargs = (self, {"level": level}) if index == 0 and level else (None, {})
            transition = self._guard.sleep(self.role, model, gpu=gpu, phase=phase, **kwargs)
            self._events.append(transition_record(transition, rank=self.engine_index))
            seconds += transition.seconds
            moved += _bytes_moved(transition.result)
        return CallCost(switch_s=seconds, bytes_d2h=moved)

    def guarded_wake(self, tags: Sequence[str] | None, phase: str,
                     displace_releasing: bool = False) -> CallCost:
        """Claim every GPU of the engine, then wake ``tags`` (None: everything); returns its seconds and
        ``bytes_h2d`` (what the engine's ``wake_up`` reports it copied back). ``displace_releasing``: take a GPU
        from a trainer role still going to sleep (``HybridPlan.overlap_switches``)."""
        seconds, moved = 0.0, 0.0
        for index, gpu in reversed(list(enumerate(self._gpus))):
            model, kwargs = (self, {"tags": tags}) if index == 0 and not self._resident else (None, {})
            transition = self._guard.wake(self.role, model, gpu=gpu, phase=phase,
                                          displace_releasing=displace_releasing, **kwargs)
            self._events.append(transition_record(transition, rank=self.engine_index))
            seconds += transition.seconds
            moved += _bytes_moved(transition.result)
        return CallCost(switch_s=seconds, bytes_h2d=moved)

    def guard_events(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events


def _bytes_moved(result: Any) -> float:
    """The ``bytes_moved`` an engine's sleep/wake_up returned (vLLM's does; engines that return None moved 0 that
    they can tell of)."""
    return float(result.get("bytes_moved", 0.0)) if isinstance(result, dict) else 0.0


class HFEngineActor(GuardedEngineMixin):
    """:class:`rlhfkit.engines.hf.HFEngine` as a Ray actor with the vLLM engine actor's surface (generate,
    sleep/wake, ``init_weight_sync``/``receive_weights`` through :mod:`rlhfkit.weight_sync`, versions)."""

    def __init__(self, model_path: str, *, engine_index: int, seed: int, device: str, guard_store: Any,
                 gpus: Sequence[str], dtype: str = "float32", start_gate: str | None = None,
                 gate_timeout_s: float = 900.0) -> None:
        clock = StartupClock()
        from rlhfkit.engines.hf import HFEngine, HFEngineConfig

        clock.lap("import_s")
        if start_gate is not None:  # the checks passed (colocated: the trainers loaded and went to sleep too)
            guard_store.wait_flag(start_gate, timeout_s=gate_timeout_s)
        clock.lap("gate_wait_s")
        self.engine_index = engine_index
        self.engine = HFEngine(HFEngineConfig(model=model_path, device=device, dtype=dtype, seed=seed + engine_index))
        self._startup = clock.lap("build_s")
        self.receiver: Any = None
        self.lora: Any = None
        self._guard_setup(guard_store, gpus)

    def ready(self) -> dict[str, Any]:
        return {"engine_index": self.engine_index, "pid": os.getpid()}

    def generate(self, prompts: Any, sampling: Any, prompt_indices: Any = None) -> Any:
        return self.engine.generate(prompts, sampling, prompt_indices=prompt_indices)  # global: seeds per prompt

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def pause_generation(self, timeout_s: float = 60.0) -> int:
        """In-flight update, step 1: park running generate calls (the actor runs calls concurrently in overlap)."""
        return self.engine.pause_generation(timeout_s=timeout_s)

    def resume_generation(self) -> None:
        self.engine.resume_generation()

    def wake_up(self, tags: Any = None) -> None:
        self.engine.wake_up(tags)

    def get_weight_version(self) -> int:
        return self.engine.weight_version

    def init_weight_sync(self, sync_config: Any, endpoint: Any, *, first_rank: int, expected: Any = None,
                         lora: Any = None) -> list:
        """Join the weight-sync group; with ``lora`` (a :class:`rlhfkit.lora.LoraConfig`) every sync carries only
        the adapter, checked against the shapes this engine's model gives it (a rank mismatch fails the manifest
        check before any byte moves)."""
        from rlhfkit.lora import describe_adapter
        from rlhfkit.weight_sync import WeightReceiver, describe_parameters

        self.lora = lora
        if expected is None and lora is not None:
            dtype = sync_config.dtype or next(self.engine.model.parameters()).dtype
            expected = describe_adapter(self.engine.model, lora, dtype=dtype)
        expected = expected or describe_parameters(self.engine.model.named_parameters(), dtype=sync_config.dtype)
        device = self.engine.device if sync_config.backend == "nccl" else None
        self.receiver = WeightReceiver(sync_config, endpoint.for_rank(first_rank, f"engine-{self.engine_index}"),
                                       expected=expected, device=device)
        return [{"rank": first_rank}]

    def receive_weights(self, *, version: int | None = None) -> list[dict[str, Any]]:
        """Receive one sync (blocks until the sender has sent it, within the channel's timeout)."""
        lora = self.lora
        if lora is None:
            report = self.receiver.receive(self.engine.load_weights)
        else:
            def load_adapter(tensors: Any, version: int | None = None) -> int:
                return self.engine.load_adapter(tensors, lora=lora, version=version)

            report = self.receiver.receive(load_adapter)
        return [{"version": report.version, "seconds": report.seconds, "bytes": report.num_bytes}]


def guarded_vllm_engine_class(guard_store: Any, gpus_by_engine: Sequence[Sequence[str]], *,
                              start_gate: str | None = None) -> type:
    """rlhfkit's vLLM engine actor with guarded sleep/wake, as ``create_engines(engine_cls=...)`` builds it.
    ``start_gate``: a flag of ``guard_store`` (:meth:`~rlhfkit.phase.TCPPhaseStore.wait_flag`) the actor waits for,
    after importing vLLM and before building its model (:meth:`~rlhfkit.hybrid.Hybrid.start` raises it once its
    checks passed, and in colocated runs that measure vLLM's memory once the trainers have loaded, so that vLLM
    profiles a GPU nobody else is filling); the settings it carries replace the config's (:func:`pass_start_gate`)."""
    from rlhfkit.engines.vllm import VLLMEngineActor

    class GuardedVLLMEngine(GuardedEngineMixin, VLLMEngineActor):
        def __init__(self, config: Any, *, engine_index: int = 0, distributed_executor_backend: Any = None) -> None:
            clock = StartupClock()
            # the slow imports (vLLM's entry points, transformers) while the gate is closed: the checks run, the
            # trainers load
            from vllm import LLM, EngineArgs  # noqa: F401

            clock.lap("import_s")
            config = pass_start_gate(guard_store, start_gate, config, timeout_s=config.startup_timeout_s)
            clock.lap("gate_wait_s")
            super().__init__(config, engine_index=engine_index,
                             distributed_executor_backend=distributed_executor_backend)
            self._guard_setup(guard_store, gpus_by_engine[engine_index])
            self._startup = clock.lap("build_s")

    return GuardedVLLMEngine


def guarded_sglang_engine_class(guard_store: Any, gpus_by_engine: Sequence[Sequence[str]], *,
                                start_gate: str | None = None) -> type:
    """rlhfkit's SGLang engine actor with guarded sleep/wake (the Ray actor class body; wrap it with ``ray.remote``);
    ``start_gate`` as for :func:`guarded_vllm_engine_class` (the server starts once it is raised)."""
    from rlhfkit.engines.sglang import SGLangEngineActor

    class GuardedSGLangEngine(GuardedEngineMixin, SGLangEngineActor):
        def __init__(self, config: Any, *, engine_index: int = 0) -> None:
            clock = StartupClock()  # the server is a process of its own: its imports are part of build_s
            clock.lap("import_s")
            config = pass_start_gate(guard_store, start_gate, config, timeout_s=config.startup_timeout_s)
            clock.lap("gate_wait_s")
            super().__init__(config, engine_index=engine_index)
            self._guard_setup(guard_store, gpus_by_engine[engine_index])
            self._startup = clock.lap("build_s")

    return GuardedSGLangEngine


class RolloutEngines:
    """The driver's handle on a hybrid run's engines: :meth:`generate` (waking them if asleep, and putting them to
    sleep after when they share GPUs with trainers), :meth:`sleep`/:meth:`wake` under the guard, versions.

    With ``overlap`` (``HybridConfig(overlap=True)``) the engines stay awake outside the guard: :meth:`generate` may
    run in a producer thread while the trainers train, and :meth:`in_flight_update` brackets a weight push."""

    def __init__(self, group: Any, handles: Sequence[Any], *, colocated: bool, sleep_level: int,
                 observer: CallObserver | None = None, trainer_version: Callable[[], int] | None = None,
                 overlap: bool = False,
                 pausable: bool = False, update_timeout_s: float = 300.0, displace_releasing: bool = False) -> None:
        self.group, self.handles = group, list(handles)
        self.displace_releasing = displace_releasing  # wakes take the GPU from a trainer still going to sleep
        self.trainer_version = trainer_version  # checked against the rollouts' weight versions (max_weight_lag)
        self.colocated, self.sleep_level, self.observer = colocated, sleep_level, observer
        self.overlap, self.pausable, self.update_timeout_s = overlap, pausable, update_timeout_s
        self.asleep = False
        self.weights_discarded = False  # slept at level 2 since the last push: the engines hold no weights
        self._generating = 0
        self._updating = False
        self._lock = threading.Condition()

    @property
    def num_engines(self) -> int:
        return len(self.handles)

    @property
    def generating(self) -> bool:
        return self._generating > 0

    def _switch(self, method: str, phase: str, *args: Any, **kwargs: Any) -> None:
        """Call ``method`` on every engine and show the observer what it cost."""
        started = time.perf_counter()
        costs = self.group.call(method, *args, phase, **kwargs)
        if self.observer is not None:
            self.observer.observe_call(CallRecord(role="rollout", method=method, phase=phase, costs=tuple(costs),
                                                  seconds=time.perf_counter() - started))

    def wake(self, tags: Sequence[str] | None = None, *, phase: str = "generate") -> None:
        self._switch("guarded_wake", phase, list(tags) if tags else None, displace_releasing=self.displace_releasing)
        self.asleep = False

    def sleep(self, level: int | None = None, *, phase: str = "generate") -> None:
        level = self.sleep_level if level is None else level
        self._switch("guarded_sleep", phase, level)
        self.asleep = True
        self.weights_discarded = self.weights_discarded or level >= 2

    def weights_pushed(self) -> None:
        """Record that a push loaded the actor's weights into every engine."""
        self.weights_discarded = False

    def _check_weights(self) -> None:
        """Refuse to generate from engines whose weights a level-2 sleep discarded and no push has loaded since:
        :class:`~rlhfkit.engines.protocol.WeightLagError` when the actor has stepped past the engines' version (a
        forgotten ``push_weights``), else a :class:`HybridCallError`; before any engine is woken."""
        from rlhfkit.engines.protocol import WeightLagError

        trainer = self.trainer_version() if self.trainer_version is not None else None
        held = min(self.weight_versions())
        if trainer is not None and trainer > held:
            raise WeightLagError(f"the engines hold weight version {held} but the actor is at version {trainer}, and "
                                 f"their sleep at level 2 discarded those weights; call hybrid.push_weights() before "
                                 "generate()")
        raise HybridCallError("the engines' weights were discarded by their sleep at level 2 and no push has loaded "
                              "them since; call hybrid.push_weights() before generate()", role="rollout", rank=None,
                              phase="generate")

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Any, *,
                 sleep_after: bool | None = None) -> list:
        """Rollouts of every prompt (``sampling.n`` each), spread over the engines. Asleep engines are woken first;
        ``sleep_after`` (default: when the engines share their GPUs with trainers) puts them to sleep after. Rollouts
        of weights older than the actor's by more than ``HybridConfig.max_weight_lag`` versions raise
        :class:`~rlhfkit.engines.protocol.WeightLagError` (the engines stay awake: push, then generate again)."""
        if self.overlap:
            return self._generate_beside_training(prompt_token_ids, sampling)
        if self.weights_discarded:
            self._check_weights()
        if self.asleep:
            self.wake(phase="generate")
        with self._lock:
            self._generating += 1
        try:
            version = self.trainer_version() if self.trainer_version is not None else None
            rollouts = self.group.generate(prompt_token_ids, sampling, trainer_version=version)
        finally:
            with self._lock:
                self._generating -= 1
        if self.colocated if sleep_after is None else sleep_after:
            self.sleep(phase="generate")
        return rollouts

    sample = generate

    def _generate_beside_training(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Any) -> list:
        with self._lock:  # a call that arrives during a weight push starts after it, with the new weights
            if not self._lock.wait_for(lambda: not self._updating, timeout=self.update_timeout_s):
                raise EnginesBusyError(f"generate waited {self.update_timeout_s:g} s for a weight push to end",
                                       role="rollout", rank=None, phase="weight_sync")
            self._generating += 1
        try:
            version = self.trainer_version() if self.trainer_version is not None else None
            return self.group.generate(prompt_token_ids, sampling, trainer_version=version)
        finally:
            with self._lock:
                self._generating -= 1
                self._lock.notify_all()

    @contextlib.contextmanager
    def in_flight_update(self) -> Iterator[None]:
        """Bracket a weight push while the engines generate (overlap mode). New ``generate`` calls wait for the
        block to end. Pausable engines park their running requests for the block: HF engines then resubmit the
        unfinished part under the new weights, single-GPU vLLM engines go on stepping the same requests (their KV
        cache kept); each token is stamped with its version. Other engines first finish the calls in flight, waited
        for at most ``update_timeout_s`` (:class:`EnginesBusyError` names them)."""
        if not self.overlap:
            raise RuntimeError("in_flight_update() is for engines in overlap mode (HybridConfig(overlap=True)); "
                               "otherwise push weights between generate calls")
        with self._lock:
            if self._updating:
                raise RuntimeError("in_flight_update() is already in progress; push weights from one thread")
            self._updating = True
        paused = False
        try:
            if self.pausable:
                self.group.call("pause_generation", self.update_timeout_s, timeout_s=self.update_timeout_s + 30)
                paused = True
            else:
                self._drain()
            yield
        finally:
            try:
                if paused:
                    self.group.call("resume_generation")
            finally:
                with self._lock:
                    self._updating = False
                    self._lock.notify_all()

    def _drain(self) -> None:
        start = time.monotonic()
        with self._lock:
            if not self._lock.wait_for(lambda: self._generating == 0, timeout=self.update_timeout_s):
                raise EnginesBusyError(f"push_weights waited {time.monotonic() - start:.0f} s for {self._generating} "
                                       "generate call(s) in flight to finish (engines without pause/resume finish "
                                       "their requests before a push)", role="rollout", rank=None, phase="generate")

    def check_idle(self, what: str) -> None:
        if self.generating:
            raise EnginesBusyError(f"{what}: the engines are generating (phase 'generate'); wait for generate() to "
                                   "return before pushing weights", role="rollout", rank=None, phase="generate")

    def weight_versions(self) -> list[int]:
        return self.group.weight_versions()

    def guard_events(self) -> list[dict[str, Any]]:
        return [event for engine in self.group.call("guard_events") for event in engine]
