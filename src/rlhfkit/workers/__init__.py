"""Workers: run one role of a :class:`~rlhfkit.placement.PlacementPlan` as a group of Ray actors.

What it does:
  * :class:`WorkerGroup` starts one actor of your class per rank of a role, each pinned to the bundle the plan gave it
    with the plan's fractional ``num_gpus``. ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` (rank 0's node) and ``MASTER_PORT`` (a free port found there; 0 for a one-rank group, whose
    ``env://`` rendezvous then binds a port the system picks as it starts) are in ``os.environ`` before your
    ``__init__`` runs; your ``env_vars`` / ``forward_env`` (library paths, NCCL settings) travel explicitly in Ray's
    ``runtime_env``, because Ray workers do not inherit the driver's shell.
  * ``call`` (same arguments on every rank), ``call_scattered`` (one item per rank), ``submit`` + ``gather``,
    ``barrier``: every wait has a timeout; a dead actor, an exception or a timeout raises :class:`WorkerError` /
    :class:`WorkerTimeoutError` naming the role, rank and method.
  * :class:`Worker`: a small base class for your actor class: ``rank``, ``world_size``, ``local_rank``, ``device()``
    (CUDA_VISIBLE_DEVICES set by Ray, or not with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``; CPU when torch
    has no CUDA), ``init_process_group()``.
  * :class:`RayConfig` + :func:`ray_init`: start or join Ray with an explicit temp/spill directory and worker env.

What it does not do: decide placement (:mod:`rlhfkit.placement`), remove placement groups (colocated groups share them:
``MaterializedPlan.remove()``), restart dead actors.

Needs the ``ray`` extra (``pip install 'rlhfkit[ray]'``), imported inside the functions that use it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhfkit._optional import require
from rlhfkit.placement import MaterializedPlan
from rlhfkit.workers._base import Worker, WorkerError, WorkerGroupConfig, WorkerInfo, WorkerTimeoutError, launchable
from rlhfkit.workers._env import NOSET_CUDA_VISIBLE_DEVICES, RayConfig, forwarded_env, ray_init, select_device

__all__ = [
    "PendingCall",
    "RayConfig",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "WorkerGroupConfig",
    "WorkerInfo",
    "WorkerTimeoutError",
    "ray_init",
    "select_device",
]

logger = logging.getLogger(__name__)
_USER = "rlhfkit.workers"


@dataclass(frozen=True)
class PendingCall:
    """Calls submitted to every rank (``refs[i]`` is rank i's), to collect with :meth:`WorkerGroup.gather`."""

    method: str
    refs: tuple[Any, ...]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _short(error: BaseException) -> str:
    """First and last line of a Ray error (the last one is usually the cause), without terminal colours."""
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= 800 else text[:800] + " ..."


def original_exception(error: BaseException) -> str:
    """``"Type: message"`` of the exception a Ray task raised, for one that reached the driver only as Ray's
    ``UnserializableException`` (its class could not be unpickled here): the last line of the traceback Ray kept."""
    trace = getattr(error, "_original_stack_trace", None)
    lines = [line.strip() for line in _ANSI.sub("", str(trace if trace else error)).splitlines() if line.strip()]
    text = lines[-1] if lines else type(error).__name__
    return text if len(text) <= 800 else text[:800] + " ..."


class WorkerGroup:
    """The ranks of one plan role as Ray actors of ``worker_cls`` (a :class:`Worker` subclass).

    ``WorkerGroup(MyWorker, materialized, WorkerGroupConfig(role="actor"), *args, **kwargs)`` starts one actor per
    rank, constructed with ``*args, **kwargs``, and waits (``start_timeout_s``) until all are up. A failure at start
    kills the actors already started and raises.
    """

    def __init__(
        self, worker_cls: type, placement: MaterializedPlan, config: WorkerGroupConfig, *args: Any, **kwargs: Any
    ) -> None:
        ray = require("ray", user=_USER)
        if not isinstance(worker_cls, type) or not issubclass(worker_cls, Worker):
            raise TypeError(
                f"worker_cls={worker_cls!r} must be a plain class deriving from rlhfkit.workers.Worker (not a "
                "@ray.remote class: WorkerGroup applies ray.remote itself)"
            )
        if not isinstance(placement, MaterializedPlan):
            raise TypeError(
                f"placement must be a MaterializedPlan (from materialize()), got {type(placement).__name__}"
            )
        if not isinstance(config, WorkerGroupConfig):
            raise TypeError(f"config must be a WorkerGroupConfig, got {type(config).__name__}")
        self.role, self.config, self.placement, self.worker_cls = config.role, config, placement, worker_cls
        self.world_size = len(placement.plan.ranks(config.role))
        self._actors: list[Any] = []
        self._closed = False
        self.infos: tuple[WorkerInfo, ...] = ()
        deadline = time.monotonic() + config.start_timeout_s
        try:
            envs = self._rank_envs(deadline)
            actor_cls = ray.remote(launchable(worker_cls))
            runtime_env = self._runtime_env()
            for rank, env in enumerate(envs):
                options = placement.actor_options(
                    self.role, rank, num_gpus=config.num_gpus, num_cpus=config.num_cpus
                )
                self._actors.append(
                    actor_cls.options(
                        **options, runtime_env=runtime_env, max_concurrency=config.max_concurrency
                    ).remote(env, *args, **kwargs)
                )
            refs = tuple(actor._rlhfkit_info.remote() for actor in self._actors)
            raw = self._gather(refs, "__init__", max(0.0, deadline - time.monotonic()), starting=True)
            self.infos = tuple(WorkerInfo(role=self.role, rank=rank, **info) for rank, info in enumerate(raw))
            self._check_infos()
        except BaseException:
            self.shutdown()
            raise
        logger.info("role %r: %d rank(s) up on %d node(s)", self.role, self.world_size,
                    len({info.node_id for info in self.infos}))

    def _rank_envs(self, deadline: float) -> list[dict[str, str]]:
        """Per-rank RANK/WORLD_SIZE/LOCAL_*/MASTER_* from probes of the nodes that hold the role's bundles."""
        plan, role = self.placement.plan, self.role

        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeoutError(
                    f"role {role!r}: start_timeout_s={self.config.start_timeout_s:g} s passed while probing nodes",
                    role=role, pending=list(range(self.world_size)), method="__init__",
                )
            return left

        # one rank: nobody else connects to its rendezvous, so it binds whatever port is free when it starts (0);
        # a probed port is only free when probed, and a role that loads later may find it taken (EADDRINUSE)
        port = 0 if self.world_size == 1 else self.placement.free_port(role, 0, timeout_s=remaining())
        addresses = [self.placement.node_address(role, rank, timeout_s=remaining()) for rank in range(self.world_size)]
        envs = []
        for rank, address in enumerate(addresses):
            same_node = [r for r, other in enumerate(addresses) if other.node_id == address.node_id]
            placement = plan.rank(role, rank)
            envs.append({
                "RLHFKIT_ROLE": role, "RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(same_node.index(rank)), "LOCAL_WORLD_SIZE": str(len(same_node)),
                "MASTER_ADDR": addresses[0].ip, "MASTER_PORT": str(port),
                "RLHFKIT_PLAN_NODE": str(placement.node),
                "RLHFKIT_BUNDLE_INDICES": ",".join(str(g) for g in placement.bundle_indices),
            })
        return envs

    def _runtime_env(self) -> dict[str, Any] | None:
        """The group-wide ``runtime_env`` (None when there is nothing to add to the job's)."""
        runtime_env = dict(self.config.runtime_env)
        env_vars = forwarded_env(
            self.config.forward_env, {**dict(runtime_env.get("env_vars", {})), **self.config.env_vars}
        )
        if not self.config.set_cuda_visible_devices:
            # Must be in the process environment before Ray assigns the GPU: runtime_env, not os.environ.
            env_vars[NOSET_CUDA_VISIBLE_DEVICES] = "1"
        if env_vars:
            runtime_env["env_vars"] = env_vars
        return runtime_env or None

    def _check_infos(self) -> None:
        for info in self.infos:
            planned = self.placement.plan.rank(self.role, info.rank)
            expected_node = self.placement.node_address(self.role, info.rank).node_id
            if info.node_id != expected_node:
                raise RuntimeError(
                    f"role {self.role!r} rank {info.rank} runs on node {info.node_id}, not on {expected_node} that "
                    f"holds its bundle {planned.gpus[0]}"
                )
            if info.bundle_indices and info.bundle_indices != (planned.gpus[0],):
                raise RuntimeError(
                    f"role {self.role!r} rank {info.rank} got bundle(s) {info.bundle_indices}, plan says "
                    f"{planned.gpus[0]}"
                )

    @property
    def actors(self) -> tuple[Any, ...]:
        """The Ray actor handles, indexed by rank."""
        return tuple(self._actors)

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(f"role {self.role!r}: '{method}' called after shutdown(); start a new WorkerGroup")
        if not isinstance(method, str) or not callable(getattr(self.worker_cls, method, None)):
            raise AttributeError(f"{self.worker_cls.__name__} (role {self.role!r}) has no method {method!r}")

    def submit(self, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        """Start ``method(*args, **kwargs)`` on every rank without waiting; collect with :meth:`gather`."""
        self._check_open(method)
        return PendingCall(method, tuple(getattr(a, method).remote(*args, **kwargs) for a in self._actors))

    def submit_scattered(self, method: str, items: Sequence[Any], **kwargs: Any) -> PendingCall:
        """Start ``method(items[rank], **kwargs)`` on each rank without waiting."""
        self._check_open(method)
        if len(items) != self.world_size:
            raise ValueError(
                f"call_scattered('{method}') got {len(items)} items for the {self.world_size} ranks of role "
                f"{self.role!r}; give exactly one per rank"
            )
        return PendingCall(
            method,
            tuple(getattr(a, method).remote(item, **kwargs) for a, item in zip(self._actors, items, strict=True)),
        )

    def gather(self, pending: PendingCall, *, timeout_s: float | None = None) -> list[Any]:
        """Results of a :class:`PendingCall` by rank; raises WorkerError / WorkerTimeoutError naming the ranks."""
        if not isinstance(pending, PendingCall):
            raise TypeError(f"gather takes the PendingCall returned by submit(), got {type(pending).__name__}")
        timeout = self.config.call_timeout_s if timeout_s is None else timeout_s
        return self._gather(pending.refs, pending.method, timeout)

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank; the results by rank."""
        return self.gather(self.submit(method, *args, **kwargs), timeout_s=timeout_s)

    def call_scattered(
        self, method: str, items: Sequence[Any], *, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """``method(items[rank], **kwargs)`` on each rank; the results by rank."""
        return self.gather(self.submit_scattered(method, items, **kwargs), timeout_s=timeout_s)

    def barrier(self, *, timeout_s: float | None = None) -> None:
        """Return once every rank has finished all calls submitted before (actors run calls in order)."""
        self.call("_rlhfkit_ping", timeout_s=timeout_s)

    def _where(self, rank: int) -> str:
        if rank < len(self.infos):
            return f"{self.infos[rank].ip}, pid {self.infos[rank].pid}"
        return "starting"

    def _gather(self, refs: Sequence[Any], method: str, timeout_s: float, *, starting: bool = False) -> list[Any]:
        ray = require("ray", user=_USER)
        if not timeout_s > 0 and not starting:
            raise ValueError(f"timeout_s={timeout_s}; must be > 0 seconds")
        deadline = time.monotonic() + timeout_s
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = sorted(rank_of[ref] for ref in pending)
                hint = (" (not scheduled? check the bundle's free GPU share and CPUs, or a slow constructor)"
                        if starting else "")
                raise WorkerTimeoutError(
                    f"role {self.role!r}: '{method}' did not finish within {timeout_s:g} s on rank(s) {ranks} of "
                    f"{len(refs)}{hint}",
                    role=self.role, pending=ranks, method=method,
                )
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as error:
                    how = "raised in its constructor" if getattr(error, "actor_init_failed", False) else "died"
                    raise WorkerError(
                        f"role {self.role!r} rank {rank} ({self._where(rank)}) {how} during '{method}': "
                        f"{_short(error)}",
                        role=self.role, rank=rank, method=method,
                    ) from error
                except ray.exceptions.RayTaskError as error:
                    cause = error.cause if getattr(error, "cause", None) is not None else error
                    raise WorkerError(
                        f"role {self.role!r} rank {rank} raised in '{method}': {type(cause).__name__}: {cause}",
                        role=self.role, rank=rank, method=method,
                    ) from error
                except ray.exceptions.UnserializableException as error:
                    raise WorkerError(
                        f"role {self.role!r} rank {rank} raised in '{method}': {original_exception(error)} (its "
                        "exception class could not be re-created here; make it picklable to catch it by type)",
                        role=self.role, rank=rank, method=method,
                    ) from error
                except ray.exceptions.RayError as error:  # object lost, system error, ...: still name who
                    raise WorkerError(
                        f"role {self.role!r} rank {rank} ({self._where(rank)}) failed during '{method}': "
                        f"{type(error).__name__}: {_short(error)}",
                        role=self.role, rank=rank, method=method,
                    ) from error
        return results

    def shutdown(self) -> None:
        """Kill every actor of the group (idempotent). The placement groups stay: ``MaterializedPlan.remove()``."""
        if self._actors:
            ray = require("ray", user=_USER)
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
        self._actors = []
        self._closed = True

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
