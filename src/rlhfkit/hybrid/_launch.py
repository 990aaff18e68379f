"""Starting and stopping a hybrid run: :class:`HybridConfig` and :class:`Hybrid`.

:meth:`Hybrid.start` starts (or joins) Ray, plans the GPUs (every role and the engines on the same GPUs when
``colocate``), starts the engines and the trainer processes in parallel, reads every trainer's model into host memory
(at once where the host holds the copies) and places them on the GPU one role at a time (each holding the GPU's claim
while it loads), and wires the weight sync (CUDA IPC between the processes sharing a GPU, NCCL to engines on GPUs of
their own, gloo on CPU). :meth:`Hybrid.push_weights` moves the actor's weights into the
engines with every wake and sleep it needs; :meth:`Hybrid.close` stops everything it started.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rlhfkit.hybrid._config import FORWARD_ENV as _FORWARD_ENV
from rlhfkit.hybrid._config import HybridConfig
from rlhfkit.hybrid._engines import (
    HFEngineActor,
    RolloutEngines,
    guarded_sglang_engine_class,
    guarded_vllm_engine_class,
)
from rlhfkit.hybrid._models import resolve_run_models
from rlhfkit.hybrid._machine import held_by_others_gib, plan_for_machine
from rlhfkit.hybrid._plan import HybridPlan, check_plan, check_roles
from rlhfkit.hybrid._timer import GpuMemorySampler, PhaseTimer, process_age_s
from rlhfkit.hybrid._trainer import TrainerConfig, TrainerGroup
from rlhfkit.hybrid._trainer_worker import TrainerWorker, plan_gpu_key

__all__ = ["Hybrid", "HybridConfig", "plan_for_machine"]

logger = logging.getLogger(__name__)



def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    return fn(*args), time.perf_counter() - started


class Hybrid:
    """A started hybrid run: ``config`` (the :class:`HybridConfig` given, unchanged), ``plan`` (the
    :class:`~rlhfkit.hybrid.HybridPlan` it executes), ``trainers`` (role -> :class:`TrainerGroup`), ``engines``
    (:class:`RolloutEngines`), ``timer`` (a :class:`PhaseTimer` every block reports its sleep/wake time to),
    ``startup`` (seconds: ``total_s`` from ``start``'s call; ``checks_s``, the plan and the LoRA checks, first and
    alone; ``ray_init_s``, Ray's start; ``ray_s`` up to the placement being ready; ``<role>_process_s``, up to
    ``processes_s``; ``gate_s``, when the engines were let build (colocated, unless the plan lets them build during
    the loads, after the trainers' loads); ``<role>_load_s`` one role after another, ``models_s`` in all;
    ``engines_s`` from the engines' start to their ready, ``engines_after_models_s`` of it after the last load;
    ``weight_sync_s``; ``wake_s``; and outside ``total_s``: ``before_start_s``, how long the process ran before
    ``start`` was called). Where each process's start went, the slowest rank or engine of each: ``<role>/process_s``,
    ``<role>/import_s``, ``<role>/read_s`` (the model read into host memory), then one role after another
    ``<role>/load_claim_s``, ``load_copy_rates_s``, ``load_model_s``, ``load_sleep_s``; ``engine/process_s``,
    ``engine/import_s``, ``engine/gate_wait_s``, ``engine/build_s``). ``gpu_held_gib``: GiB of a GPU that other
    processes held before the run placed anything (0.0 below ``HELD_GPU_GIB``, or unknown, or with a plan given);
    the plan counted the GPU as that much smaller. While the run is open the driver runs torch's intra-op work on
    one thread (its work is small CPU tensors beside busy engines and trainers); :meth:`close` restores it."""

    def __init__(self, config: HybridConfig, plan: HybridPlan | None = None) -> None:
        self.config, self.plan = config, plan
        self.trainers: dict[str, TrainerGroup] = {}
        self.engines: RolloutEngines | None = None
        self.timer = PhaseTimer(GpuMemorySampler(enabled=config.device == "cuda"))
        self.startup: dict[str, float] = {}
        self.gpu_held_gib = 0.0  # GiB of a GPU other processes held when the plan was made (see HELD_GPU_GIB)
        self._handles: list[Any] = []
        self._workers: dict[str, Any] = {}
        self._placed = self._store = self._group = None
        self._start_gate: str | None = None
        self._started_ray = False
        self._threads_before: int | None = None  # torch's intra-op threads before start

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, config: HybridConfig, trainers: Mapping[str, TrainerConfig], *,
              plan: HybridPlan | None = None) -> Hybrid:
        """Start the run; ``trainers`` maps each role (``actor``, ``critic``, ``reference``, ``reward``) to its
        config, in the order the models load. ``plan``: the :class:`~rlhfkit.hybrid.HybridPlan` to execute (from
        :func:`~rlhfkit.hybrid.plan_hybrid`, perhaps edited; checked against the run and, where it names a GPU size,
        its memory estimate); None: planned here for this machine (:func:`plan_for_machine`). A plan that does not
        fit raises :class:`~rlhfkit.placement.MemoryFitError` before anything starts. The engines are awake when
        this returns."""
        if not isinstance(config, HybridConfig):
            raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
        check_roles(config, trainers)
        for role, trainer in trainers.items():
            if not isinstance(trainer, TrainerConfig):
                raise TypeError(f"trainers[{role!r}] must be a TrainerConfig, got {type(trainer).__name__}")
            if trainer.deepspeed.fused_kernels is not None and config.device != "cuda":
                raise ValueError(f"trainers[{role!r}].deepspeed.fused_kernels={trainer.deepspeed.fused_kernels!r} "
                                 f"needs CUDA (Triton kernels); HybridConfig.device={config.device!r}")
        try:
            require_extras(config)
        except ImportError:
            _planned(config, trainers, plan)  # a bad input explains more than a missing extra
            raise
        began = time.perf_counter()
        before_start_s = process_age_s()
        # hub ids -> folders (rlhfkit.models), here before the plan reads their configs; a folder stays as given
        run_config, run_trainers = resolve_run_models(config, trainers, env=config.worker_env(),
                                                      timeout_s=config.start_timeout_s)
        (plan, held), checks_s = _timed(_planned, run_config, run_trainers, plan)
        started_ray, ray_s = _timed(_start_ray, config)
        if run_config is not config:  # a hub id: every other node of the cluster resolves it too
            try:
                resolve_run_models(config, trainers, env=config.worker_env(), timeout_s=config.start_timeout_s)
            except BaseException:
                if started_ray:
                    import ray

                    ray.shutdown()
                raise
        config, trainers = run_config, run_trainers
        run = cls(config, plan)
        run._started_ray, run.gpu_held_gib = started_ray, held
        run.startup.update(before_start_s=before_start_s, checks_s=checks_s, ray_init_s=ray_s)
        run._threads_before = torch.get_num_threads()  # the driver's small CPU ops stay off an OpenMP team
        torch.set_num_threads(1)
        try:
            run._start(dict(trainers), time.perf_counter())
        except BaseException:
            run.close()
            raise
        run.startup["total_s"] = time.perf_counter() - began
        return run

    def _start(self, trainers: dict[str, TrainerConfig], started: float) -> None:
        from rlhfkit.phase import TCPPhaseStore
        from rlhfkit.placement import materialize

        plan = self.plan
        self._placed = materialize(plan_gpus(self.config, tuple(trainers)), timeout_s=self.config.start_timeout_s,
                                   cpus_per_bundle=0)
        self._store = TCPPhaseStore.serve(host=_store_host(self._placed))
        configs = {role: trainer.for_role(role) for role, trainer in trainers.items()}
        self.startup["ray_s"] = time.perf_counter() - started
        # The engine processes start (creating an actor does not wait for it), import, and wait at the gate: raised
        # at once, or (colocated, unless the plan lets them build during the loads) once the trainers have loaded,
        # one at a time, each claiming the GPU, and gone to sleep, so that vLLM measures its memory on a GPU nobody
        # else is filling and needs no start-up sleep to make room for the trainers.
        self._start_gate = f"engines-build-{uuid.uuid4().hex[:12]}"
        self._handles = self._create_engines(configs["actor"].lora)
        self._engine_group()
        gated = self.config.colocate and not plan.build_during_loads
        if not gated:
            self._open_gate(started)
        pool = ThreadPoolExecutor(1 + len(configs))
        try:
            # every engine's ready() (a failure names the engine), answered once it has built its model
            engines = pool.submit(_timed, functools.partial(self._group.call, "ready",
                                                            timeout_s=self.config.start_timeout_s))
            groups = {role: pool.submit(_timed, self._start_group, role, c.model or self.config.model,
                                        plan.roles[role].optimizer_threads)
                      for role, c in configs.items()}
            for role, future in groups.items():
                self._workers[role], self.startup[f"{role}_process_s"] = future.result()
            self.startup["processes_s"] = time.perf_counter() - started
            mark = self._load_models(configs, engines)
            self.startup["models_s"] = time.perf_counter() - started - self.startup["processes_s"]
            if gated:
                self._open_gate(started)
            self.startup["engines_s"] = engines.result()[1]
            self.startup["engines_after_models_s"] = time.perf_counter() - mark
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # close() kills the actors an engine thread may wait on
            raise
        pool.shutdown(wait=True)
        self.startup.update(_slowest("engine", self._group.call("startup_parts")))
        mark = time.perf_counter()
        self._connect_weight_sync()
        self.startup["weight_sync_s"], mark = time.perf_counter() - mark, time.perf_counter()
        if self.config.colocate and not self.config.overlap:
            self.engines.wake(phase="generate")
        self.startup["wake_s"] = time.perf_counter() - mark

    def _load_models(self, configs: dict[str, TrainerConfig], engines: Future) -> float:
        """Every role reads its model into host memory at once where the plan says the host holds all those copies
        together (``read_ahead``), else each right before its turn; one role at a time claims the GPU and places
        it. Returns when the last load ended."""
        plan, mark = self.plan, time.perf_counter()
        reading = {role: self._workers[role].submit("prefetch", trainer_config, plan.roles[role])
                   for role, trainer_config in configs.items()} if plan.read_ahead else {}
        for role, trainer_config in configs.items():
            if engines.done() and engines.exception() is not None:  # an engine failed while importing
                raise engines.exception()
            role_plan = plan.roles[role]
            pending = reading.get(role) or self._workers[role].submit("prefetch", trainer_config, role_plan)
            read = self._workers[role].gather(pending, timeout_s=self.config.start_timeout_s)
            self.startup[f"{role}/read_s"] = max(rank["read_s"] for rank in read)
            # the actor's process measures its pinned copy rates (the floor of the switches) before its load
            loaded = self._workers[role].call("load", trainer_config, role_plan, measure_copy_rates=role == "actor",
                                              overlap_switches=plan.overlap_switches,
                                              timeout_s=self.config.start_timeout_s)
            if role == "actor":
                self.timer.copy_rates = loaded[0]["copy_rates"]
            self.startup.update(_slowest(role, [rank["startup_parts"] for rank in loaded]))
            self.trainers[role] = TrainerGroup(self._workers[role], trainer_config, role_plan, observer=self.timer)
            self.startup[f"{role}_load_s"], mark = time.perf_counter() - mark, time.perf_counter()
        return mark

    def _open_gate(self, started: float) -> None:
        """Let the engines build their models (their KV-cache size is in their config, from the plan); ``gate_s``:
        when, since the placement began (``started``)."""
        self._store.set_flag(self._start_gate, "{}")
        self.startup["gate_s"] = time.perf_counter() - started

    def _create_engines(self, lora: Any = None) -> list[Any]:
        """Start the engine actors (not waiting for them): each imports its engine library, waits at
        ``self._start_gate`` and then builds its model. ``lora``: the actor's LoraConfig (vLLM engines then serve
        adapters, with ``max_lora_rank`` = its rank)."""
        import ray

        config, placed = self.config, self._placed
        gpus = [[plan_gpu_key(p.node, g) for g in p.gpus] for p in placed.plan.ranks("rollout")]
        env = config.worker_env()
        if config.engine == "vllm":
            from rlhfkit.engines.vllm import VLLMEngineConfig, create_engines

            engine = self.plan.engine
            engine_config = VLLMEngineConfig(
                model=config.model, num_engines=len(gpus), tensor_parallel_size=config.tensor_parallel_size,
                gpu_memory_utilization=engine.memory, enable_sleep_mode=config.colocate, seed=config.seed,
                enforce_eager=config.enforce_eager, max_model_len=config.max_model_len,
                max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                kv_cache_memory_bytes=engine.kv_cache_bytes,
                dtype=config.engine_dtype, env=env, startup_timeout_s=config.start_timeout_s,
                control_timeout_s=config.call_timeout_s,
                enable_lora=lora is not None, max_lora_rank=lora.rank if lora is not None else 16,
                pausable=self._pausable_vllm, pause_timeout_s=config.sync_timeout_s)
            return create_engines(engine_config, placement=placed, role="rollout", wait=False,
                                  engine_cls=guarded_vllm_engine_class(self._store, gpus, start_gate=self._start_gate))
        if config.engine == "sglang":
            return self._create_sglang_engines(gpus, env)
        actor_cls, handles = ray.remote(HFEngineActor), []
        for index, engine_gpus in enumerate(gpus):
            options = placed.actor_options("rollout", index) | {"runtime_env": {"env_vars": env}, "max_restarts": 0}
            if config.overlap:  # pause, receive and resume run beside a generate call
                options["max_concurrency"] = 4
            handles.append(actor_cls.options(**options).remote(
                config.model, engine_index=index, seed=config.seed, device=config.device,
                guard_store=self._store, gpus=engine_gpus, dtype=config.engine_dtype,
                start_gate=self._start_gate, gate_timeout_s=config.start_timeout_s))
        return handles

    def _engine_group(self) -> None:
        """The driver's handles on the started engines: ``self._group`` and ``self.engines``."""
        from rlhfkit.engines.router import EngineGroup, EngineGroupConfig

        config = self.config
        self._group = EngineGroup(self._handles, forward_prompt_indices=True, config=EngineGroupConfig(
            generate_timeout_s=config.call_timeout_s, control_timeout_s=config.call_timeout_s,
            max_weight_lag=config.max_weight_lag))
        self.engines = RolloutEngines(self._group, self._handles, colocated=config.colocate,
                                      sleep_level=self.plan.engine.sleep_level, observer=self.timer,
                                      trainer_version=self.actor_version, overlap=config.overlap,
                                      pausable=config.engine == "hf" or self._pausable_vllm,
                                      update_timeout_s=config.sync_timeout_s,
                                      displace_releasing=self.plan.overlap_switches)

    @property
    def _pausable_vllm(self) -> bool:
        """Overlap with single-GPU vLLM engines: they step their in-process engine core and pause between two
        steps for an in-flight update (``VLLMEngineConfig.pausable``); tensor-parallel ones finish their requests
        first."""
        config = self.config
        return config.engine == "vllm" and config.overlap and config.pause_engines and config.tensor_parallel_size == 1

    def _create_sglang_engines(self, gpus: list[list[str]], env: dict[str, str]) -> list[Any]:
        """One Ray actor per engine, each starting its SGLang server on the actor's GPU(s) once the gate opens."""
        import ray

        from rlhfkit.engines.sglang import SGLangEngineConfig

        config, placed = self.config, self._placed
        server_env = env | ({"PYTHONPATH": config.sglang_site} if config.sglang_site else {})
        engine_config = SGLangEngineConfig(
            model=config.model, python=config.sglang_python, tensor_parallel_size=config.tensor_parallel_size,
            mem_fraction_static=self.plan.engine.memory, seed=config.seed, dtype=config.engine_dtype,
            enable_memory_saver=config.colocate,
            weights_cpu_backup=config.colocate and self.plan.engine.sleep_level == 1,  # level 2 re-sends weights
            context_length=config.max_model_len, enforce_eager=config.enforce_eager, env=server_env,
            startup_timeout_s=config.start_timeout_s, control_timeout_s=config.call_timeout_s,
            generate_timeout_s=config.call_timeout_s)
        actor_cls = ray.remote(guarded_sglang_engine_class(self._store, gpus, start_gate=self._start_gate))
        handles = []
        for index in range(len(gpus)):
            options = placed.actor_options("rollout", index) | {"runtime_env": {"env_vars": env}, "max_restarts": 0}
            handles.append(actor_cls.options(**options).remote(engine_config, engine_index=index))
        return handles

    def _start_group(self, role: str, path: str, threads: int | None = None) -> Any:
        from rlhfkit.workers import WorkerGroup, WorkerGroupConfig

        config = self.config
        env = config.worker_env() | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
        group_config = WorkerGroupConfig(role=role, env_vars=env, forward_env=_FORWARD_ENV,
                                         start_timeout_s=config.start_timeout_s, call_timeout_s=config.call_timeout_s)
        return WorkerGroup(TrainerWorker, self._placed, group_config, self._store, config.device, path)

    def _connect_weight_sync(self) -> None:
        """Colocated: one CUDA-IPC (gloo on CPU) group per GPU, from the actor rank on that GPU to the engine
        worker on it (a TP engine's worker k joins the group of its k-th GPU). Else actor rank 0 broadcasts over NCCL
        (gloo on CPU) to every worker of every engine (TP workers take consecutive ranks)."""
        import ray
        import torch

        from rlhfkit.weight_sync import WeightSyncConfig

        config, actor = self.config, self._workers["actor"]
        cpu, tp = config.device == "cpu", config.tensor_parallel_size
        backend = "gloo" if cpu else ("cuda_ipc" if config.colocate else "nccl")
        sync = WeightSyncConfig(backend=backend, bucket_bytes=config.sync_bucket_mb * 1024**2,
                                dtype=None if cpu else getattr(torch, config.dtype), timeout_s=config.sync_timeout_s)
        lora = {"lora": self.trainers["actor"].config.lora} if self.trainers["actor"].config.lora else {}
        if config.colocate:
            endpoints = actor.call("open_weight_sync", True, config=sync, world_size=2, group_name="weights",
                                   local=True)  # each group's engine shares its sender's GPU: the same node
            per_engine = _colocated_endpoints(self._placed.plan, endpoints)
            refs = [handle.init_weight_sync.remote(sync, endpoint, first_rank=1, **lora)
                    for handle, endpoint in zip(self._handles, per_engine, strict=True)]
        else:
            senders = [rank == 0 for rank in range(actor.world_size)]
            per_engine = 1 if config.engine == "sglang" else tp  # an SGLang engine receives once for all its TP ranks
            world = 1 + len(self._handles) * per_engine
            endpoint = actor.call_scattered("open_weight_sync", senders, config=sync, world_size=world,
                                            group_name="weights", local=config.num_nodes == 1)[0]
            refs = [handle.init_weight_sync.remote(sync, endpoint, first_rank=1 + index * per_engine, **lora)
                    for index, handle in enumerate(self._handles)]
        ray.get(refs, timeout=config.call_timeout_s)

    # ------------------------------------------------------------------ weights
    def actor_version(self) -> int:
        """The weight version the actor holds: the last pushed one, plus one once it has stepped since."""
        actor = self.trainers.get("actor")
        return actor.weight_version if actor is not None else 0

    def push_weights(self, role: str = "actor") -> dict[str, float]:
        """Move ``role``'s weights into every engine: the role keeps only its weights (if awake), the engines wake
        their weights, the weights stream, the role sleeps fully and the engines wake their KV cache. Timed as the
        ``weight_sync`` phase (its sleeps and wakes as ``sleep_wake``). Returns ``sync/*`` and
        ``engine/weight_version``. With ``HybridConfig(overlap=True)`` the engines stay awake and generating: the
        update happens in flight (:meth:`RolloutEngines.in_flight_update`)."""
        engines, timer = self.engines, self.timer
        if role != "actor" or role not in self.trainers:
            raise ValueError(f"push_weights(role={role!r}): only the actor's weights go to the engines "
                             f"(roles of this run: {sorted(self.trainers)})")
        if self.config.overlap:
            with timer.phase("weight_sync"), engines.in_flight_update():
                return self._push(role, colocated=False)
        engines.check_idle("push_weights")
        with timer.phase("weight_sync"):
            return self._push(role, colocated=self.config.colocate)

    def _push(self, role: str, *, colocated: bool) -> dict[str, float]:
        import ray

        engines, trainer, timer = self.engines, self.trainers[role], self.timer
        trainer.sleep(keep_weights=True, phase="sync")
        trainer.check_push(phase="sync")  # a refusal comes before any engine waits for the sync
        if colocated:
            engines.wake(["weights"], phase="sync")
        # every receiver checks the sync's manifest and the sender waits for all verdicts before any byte moves
        receiving = [handle.receive_weights.remote() for handle in self._handles]
        sending = trainer.workers.submit("send_weights", phase="sync")
        sleeping = trainer.start_sleep(phase="sync")
        try:
            sent = trainer.workers.gather(sending)
        except Exception:
            ready, _ = ray.wait(receiving, num_returns=len(receiving), timeout=5.0)
            for ref in ready:  # an engine's own error says more than the sender's
                ray.get(ref)
            raise
        received = ray.get(receiving, timeout=self.config.sync_timeout_s)
        engines.weights_pushed()
        trainer.finish_sleep(sleeping, phase="sync")
        if colocated:
            engines.wake(["kv_cache"], phase="generate")
        report = next(item for item in sent if item)
        timer.count_sync_bytes(float(report["bytes"]))
        trainer.weights_pushed(int(report["version"]))
        versions = [int(worker["version"]) for reports in received for worker in reports]
        return {"sync/version": float(report["version"]), "sync/bytes": float(report["bytes"]),
                "sync/sender_s": float(report["seconds"]), "engine/weight_version": float(min(versions))}

    # ------------------------------------------------------------------ records and shutdown
    def write_phase_log(self, path: str | Path, *, settle: bool = False) -> list[dict[str, Any]]:
        """Every guarded transition of every actor since the last call, in time order, as JSON lines. A trainer's
        sleep still running in the background (``overlap_switches``) is logged by a later call; ``settle=True`` waits
        for it (the last call of a run)."""
        events = [event for group in self.trainers.values() for event in group.guard_events(settle=settle)]
        events += self.engines.guard_events() if self.engines is not None else []
        events.sort(key=lambda event: event["time"])
        with Path(path).open("a") as handle:
            for event in events:
                handle.write(json.dumps(event) + "\n")
        return events

    def close(self) -> None:
        """Stop the actors, the placement groups, the memory sampler, and Ray if this run started it."""
        import ray

        for group in self._workers.values():
            group.shutdown()
        if self.config.engine == "sglang" and self._handles:
            # each SGLang server runs in a process group of its own, which ray.kill would leave behind on the GPU
            pending = [handle.close.remote() for handle in self._handles]
            _, late = ray.wait(pending, num_returns=len(pending), timeout=60.0)
            if late:
                logger.warning("%d SGLang engine(s) did not stop their server within 60 s", len(late))
        for handle in self._handles:
            ray.kill(handle, no_restart=True)
        if self._group is not None:
            self._group.close()
        if self._placed is not None:
            self._placed.remove()
        if self.timer.sampler is not None:
            self.timer.sampler.close()
        if self._started_ray:
            ray.shutdown()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def __enter__(self) -> Hybrid:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def require_extras(config: HybridConfig) -> None:
    """The extras a run needs, checked before anything starts: an ImportError names what to ``pip install``.
    DeepSpeed runs in the trainer processes only: found here, not imported (seconds the driver does not need)."""
    import importlib.util

    from rlhfkit._optional import require

    require("ray", user="rlhfkit.hybrid")
    if importlib.util.find_spec("deepspeed") is None:
        require("deepspeed", user="rlhfkit.hybrid (its trainer processes)")
    if config.engine == "vllm" and config.device == "cuda" and importlib.util.find_spec("vllm") is None:
        require("vllm", user="rlhfkit.hybrid (HybridConfig.engine='vllm')")


def _planned(config: HybridConfig, trainers: Mapping[str, TrainerConfig],
             plan: HybridPlan | None) -> tuple[HybridPlan, float]:
    """The checks before anything starts: the LoRA targets, then ``plan`` checked against the run, or (None) the
    plan for this machine. Returns the plan and the GiB of a GPU other processes hold (counted against it)."""
    from rlhfkit.hybrid._fit import model_shape
    from rlhfkit.lora import meta_model

    built = functools.cache(meta_model)  # each model built on the meta device once, for every check

    def shape(path: str) -> Any:
        return model_shape(path, model=built(path))

    _check_lora(config, trainers, meta_model=built)
    if plan is not None:
        check_plan(config, trainers, plan, model_shape=shape)
        return plan, 0.0
    held = held_by_others_gib(config)
    return plan_for_machine(config, trainers, model_shape=shape, held_gib=held), held


def _start_ray(config: HybridConfig) -> bool:
    """Start a local Ray (or join ``config.ray_address`` / ``RAY_ADDRESS``) unless one is up; True if it started or
    joined one here (``close`` shuts it down then)."""
    import ray

    from rlhfkit.workers import RayConfig, ray_init

    if ray.is_initialized():
        return False
    env = config.worker_env()
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray_init(RayConfig(address=address, env_vars=env, forward_env=_FORWARD_ENV))
    elif config.device == "cpu":
        ray_init(RayConfig(num_gpus=config.total_gpus, num_cpus=max(2, os.cpu_count() or 2),
                           object_store_memory=512 * 1024**2, env_vars=env, forward_env=_FORWARD_ENV))
    else:
        ray_init(RayConfig(env_vars=env, forward_env=_FORWARD_ENV))
    return True


def _check_lora(config: HybridConfig, trainers: Mapping[str, TrainerConfig], *,
                meta_model: Callable[[str], Any] | None = None) -> None:
    """LoRA settings that cannot work, refused before anything starts; ``meta_model``: path -> the model built on
    the meta device (default :func:`rlhfkit.lora.meta_model`)."""
    for role, trainer in trainers.items():
        if trainer.lora is not None and role != "actor":
            raise ValueError(f"trainers[{role!r}].lora is set; LoRA adapters are supported on the actor only")
    lora = trainers["actor"].lora
    if lora is None:
        return
    from rlhfkit.lora import check_target_modules
    from rlhfkit.lora import meta_model as build_meta_model

    path = trainers["actor"].model or config.model
    check_target_modules((meta_model or build_meta_model)(path), lora, where=f"the model at {path!r}")


def plan_gpus(config: HybridConfig, roles: tuple[str, ...]) -> Any:
    """The placement plan of a run: every role and the engines on the same GPUs when ``colocate``."""
    from rlhfkit.hybrid._plan import _placement

    return _placement(config, tuple(roles))


def _store_host(placed: Any) -> str:
    """Where the driver's phase store listens: loopback when every placement group of the run lies on the driver's
    node (all its clients are there), else this node's address, for the other nodes (docs/security.md)."""
    import ray
    from ray.util import placement_group_table

    here = ray.get_runtime_context().get_node_id()
    nodes = {node for group in placed.placement_groups
             for node in placement_group_table(group).get("bundles_to_node_id", {}).values()}
    return "127.0.0.1" if nodes == {here} else ray.util.get_node_ip_address()


def _colocated_endpoints(plan: Any, endpoints: Sequence[Any]) -> list[Any]:
    """Each engine's weight-sync endpoint(s) in a colocated plan: the endpoint of the actor rank on the engine's
    GPU, or for a TP engine a list, worker k's from the actor rank on the engine's k-th GPU."""
    by_gpu = {}
    for rank, endpoint in zip(plan.ranks("actor"), endpoints, strict=True):
        for gpu in rank.gpus:
            by_gpu[(rank.node, gpu)] = endpoint
    out = []
    for engine in plan.ranks("rollout"):
        missing = [gpu for gpu in engine.gpus if (engine.node, gpu) not in by_gpu]
        if missing:
            raise ValueError(f"engine {engine.rank} on node {engine.node} GPU(s) {missing} shares no GPU with an "
                             "actor rank; a colocated plan puts an actor rank on every engine GPU")
        mine = [by_gpu[(engine.node, gpu)] for gpu in engine.gpus]
        out.append(mine[0] if len(mine) == 1 else mine)
    return out


def _slowest(who: str, parts: list[dict[str, float]]) -> dict[str, float]:
    """``{"<who>/<part>": seconds}``: each part's largest value over the ranks or engines (they start in
    parallel)."""
    return {f"{who}/{name}": max(each.get(name, 0.0) for each in parts) for name in sorted(set().union(*parts))}
