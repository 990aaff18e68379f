"""Ray actor helpers of :mod:`rlhfkit.engines.vllm`: start vLLM engines as Ray actors on a placement plan, a shared
placement group, or plain GPU requests, and group them behind an :class:`~rlhfkit.engines.router.EngineGroup`.

Placement facts this follows (vLLM 0.22 / 0.32, Ray 2.60):
  * TP = 1: the actor itself runs the model; it takes its GPU share (``num_gpus`` < 1 to colocate) on its bundle.
  * TP > 1: the actor only drives vLLM (``num_gpus=0``); vLLM's Ray executor starts one worker actor per TP rank in
    the placement group the engine actor runs in (``ray.util.get_current_placement_group()``), on the bundles listed
    in ``VLLM_RAY_BUNDLE_INDICES``, each taking ``VLLM_RAY_PER_WORKER_GPUS`` of its GPU. Without a placement group
    vLLM creates one of its own. The actor drops ``CUDA_VISIBLE_DEVICES`` (older Ray set it to "" for zero-GPU
    actors), since its workers pick their devices themselves.

Needs ``rlhfkit[ray]``; imported lazily. Does not import vLLM (the actors do).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from rlhfkit._optional import require

__all__ = ["EngineLaunch", "plan_launches", "create_engines", "create_engine_group", "wait_ready", "kill_engines"]

logger = logging.getLogger(__name__)
_USER = "rlhfkit.engines.vllm"


class EngineLaunch:
    """Where and how one engine actor starts: Ray ``.options`` (minus the strategy), its placement group and bundles,
    and the extra environment of the actor."""

    def __init__(self, *, engine_index: int, num_gpus: float, placement_group: Any, bundle_indices: tuple[int, ...],
                 env: dict[str, str]) -> None:
        self.engine_index = engine_index
        self.num_gpus = num_gpus
        self.placement_group = placement_group
        self.bundle_indices = bundle_indices
        self.env = env

    def __repr__(self) -> str:
        return (f"EngineLaunch(engine_index={self.engine_index}, num_gpus={self.num_gpus}, "
                f"bundle_indices={self.bundle_indices}, env={self.env})")


def _bundles_from_plan(config: Any, placement: Any, role: str) -> list[tuple[Any, tuple[int, ...], float]]:
    from rlhfkit.placement import ray_share

    ranks = placement.plan.ranks(role)
    if len(ranks) != config.num_engines:
        raise ValueError(f"the placement plan's role {role!r} has {len(ranks)} rank(s) but VLLMEngineConfig."
                         f"num_engines={config.num_engines}; plan it with engines({config.num_engines}, "
                         f"{config.tensor_parallel_size})")
    out = []
    for rank in ranks:
        if len(rank.gpus) != config.tensor_parallel_size:
            raise ValueError(f"role {role!r} rank {rank.rank} has {len(rank.gpus)} GPU(s) but VLLMEngineConfig."
                             f"tensor_parallel_size={config.tensor_parallel_size}")
        share = ray_share(rank.share)
        out.append((placement.placement_group(role, rank.rank), tuple(placement.tp_bundle_indices(role, rank.rank)),
                    share))
    return out


def _bundles_from_group(config: Any, placement_group: Any,
                        bundle_indices: Sequence[Sequence[int]] | None) -> list[tuple[Any, tuple[int, ...], float]]:
    tp = config.tensor_parallel_size
    if bundle_indices is None:
        bundle_indices = [tuple(range(i * tp, (i + 1) * tp)) for i in range(config.num_engines)]
    groups = [tuple(int(b) for b in group) for group in bundle_indices]
    if len(groups) != config.num_engines or any(len(group) != tp for group in groups):
        raise ValueError(f"bundle_indices={bundle_indices!r}; need {config.num_engines} group(s) of "
                         f"tensor_parallel_size={tp} bundle indices, one per engine")
    count = getattr(placement_group, "bundle_count", None)
    flat = [b for group in groups for b in group]
    if count is not None and any(not 0 <= b < count for b in flat):
        raise ValueError(f"bundle_indices={bundle_indices!r} out of range for a placement group of {count} bundles")
    return [(placement_group, group, config.gpu_share) for group in groups]


def plan_launches(config: Any, *, placement: Any = None, role: str = "rollout", placement_group: Any = None,
                  bundle_indices: Sequence[Sequence[int]] | None = None) -> list[EngineLaunch]:
    """Decide, without starting anything, where each engine goes (see the module docstring)."""
    if placement is not None and placement_group is not None:
        raise ValueError("pass either placement (a materialized rlhfkit.placement plan) or placement_group, not both")
    if bundle_indices is not None and placement_group is None:
        raise ValueError("bundle_indices needs placement_group (with a placement plan, the plan gives the bundles)")
    tp = config.tensor_parallel_size
    if placement is not None:
        slots = _bundles_from_plan(config, placement, role)
    elif placement_group is not None:
        slots = _bundles_from_group(config, placement_group, bundle_indices)
    else:
        slots = [(None, (), config.gpu_share)] * config.num_engines
    launches = []
    for index, (group, bundles, share) in enumerate(slots):
        env = dict(config.env)
        if tp > 1:
            env["VLLM_RAY_PER_WORKER_GPUS"] = repr(float(share))
            if bundles:
                env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in bundles)
        launches.append(EngineLaunch(engine_index=index, num_gpus=0.0 if tp > 1 else float(share),
                                     placement_group=group, bundle_indices=bundles, env=env))
    return launches


def _actor_options(launch: EngineLaunch) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": launch.num_gpus, "max_restarts": 0}
    if launch.placement_group is not None:
        strategies = require("ray.util.scheduling_strategies", user=_USER)
        options["scheduling_strategy"] = strategies.PlacementGroupSchedulingStrategy(
            placement_group=launch.placement_group, placement_group_bundle_index=launch.bundle_indices[0],
            placement_group_capture_child_tasks=True)
    if launch.env:
        options["runtime_env"] = {"env_vars": dict(launch.env)}
    return options


def create_engines(config: Any, *, placement: Any = None, role: str = "rollout", placement_group: Any = None,
                   bundle_indices: Sequence[Sequence[int]] | None = None, engine_cls: Any = None,
                   wait: bool = True) -> list[Any]:
    """Start ``config.num_engines`` engine actors; returns their Ray handles (engine ``i`` seeded ``seed + i``).

    Args:
        config: a :class:`~rlhfkit.engines.vllm.VLLMEngineConfig`.
        placement: a :class:`rlhfkit.placement.MaterializedPlan` whose role ``role`` has one rank per engine of
            ``tensor_parallel_size`` GPUs (the plan's share per GPU is used).
        placement_group, bundle_indices: a shared placement group (hybrid engine) and, per engine, its TP bundle
            indices (default: engine ``i`` gets bundles ``i*TP .. (i+1)*TP-1``); the share is ``config.gpu_share``.
        engine_cls: the class each actor runs (default :class:`~rlhfkit.engines.vllm.VLLMEngineActor`); it is called
            as ``engine_cls(config, engine_index=i, distributed_executor_backend=...)`` and needs ``ready()``.
        wait: wait until every engine answers ``ready()`` (``config.startup_timeout_s``); a failure names the engine.
    """
    ray = require("ray", user=_USER)
    if engine_cls is None:
        from rlhfkit.engines.vllm import VLLMEngineActor

        engine_cls = VLLMEngineActor
    launches = plan_launches(config, placement=placement, role=role, placement_group=placement_group,
                             bundle_indices=bundle_indices)
    remote_cls = ray.remote(engine_cls)
    backend = "ray" if config.tensor_parallel_size > 1 else None
    handles = []
    for launch in launches:
        logger.info("starting engine %s", launch)
        options = _actor_options(launch)
        if config.pausable:  # pause_generation, the weight load and resume_generation run beside a generate call
            options["max_concurrency"] = 4
        handles.append(remote_cls.options(**options).remote(
            config, engine_index=launch.engine_index, distributed_executor_backend=backend))
    if wait:
        try:
            wait_ready(handles, timeout_s=config.startup_timeout_s)
        except BaseException:
            kill_engines(handles)
            raise
    return handles


def wait_ready(handles: Sequence[Any], *, timeout_s: float) -> list[Any]:
    """Wait for every engine's ``ready()``; raises an :class:`~rlhfkit.engines.router.EngineError` naming the engine
    that failed to start or did not start in time."""
    from rlhfkit.engines.router import EngineGroup, EngineGroupConfig

    group = EngineGroup(handles, config=EngineGroupConfig(control_timeout_s=timeout_s))
    return group.call("ready", timeout_s=timeout_s)


def create_engine_group(config: Any, **create_kwargs: Any) -> Any:
    """:func:`create_engines` then an :class:`~rlhfkit.engines.router.EngineGroup` over the handles, with the
    config's timeouts and per-prompt seeding across engines."""
    from rlhfkit.engines.router import EngineGroup, EngineGroupConfig

    handles = create_engines(config, **create_kwargs)
    group_config = EngineGroupConfig(generate_timeout_s=config.generate_timeout_s,
                                     control_timeout_s=config.control_timeout_s,
                                     health_timeout_s=config.health_timeout_s)
    return EngineGroup(handles, config=group_config, forward_prompt_indices=True)


def kill_engines(handles: Sequence[Any]) -> None:
    """Kill engine actors (their vLLM processes exit with them)."""
    ray = require("ray", user=_USER)
    for handle in handles:
        try:
            ray.kill(handle)
        except Exception as error:  # noqa: BLE001 - already dead is fine; anything else is logged, not hidden
            logger.warning("could not kill engine actor %s: %s", handle, error)
