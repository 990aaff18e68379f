"""The pieces of :mod:`rlhfkit.workers` that run inside the actors: :class:`Worker`, and the group's config and errors.

Imports Ray and torch only inside the methods that need them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from rlhfkit.workers._env import NOSET_CUDA_VISIBLE_DEVICES, _check_env, select_device

__all__ = ["Worker", "WorkerError", "WorkerTimeoutError", "WorkerInfo", "WorkerGroupConfig", "launchable"]

_BUNDLE_RE = re.compile(r"^[A-Za-z]+_group_(\d+)_([0-9a-f]+)$")
_RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RLHFKIT_ROLE")


class WorkerError(RuntimeError):
    """A rank of a worker group died or raised; ``role``, ``rank`` and ``method`` say which."""

    def __init__(self, message: str, *, role: str, rank: int | None, method: str) -> None:
        super().__init__(message)
        self.role, self.rank, self.method = role, rank, method


class WorkerTimeoutError(WorkerError, TimeoutError):
    """Ranks of a worker group did not answer in time; ``pending`` lists them."""

    def __init__(self, message: str, *, role: str, pending: Sequence[int], method: str) -> None:
        super().__init__(message, role=role, rank=pending[0] if pending else None, method=method)
        self.pending = tuple(pending)


def _env_int(name: str) -> int:
    if name not in os.environ:
        raise RuntimeError(f"{name} is not set: this process was not started by rlhfkit.workers.WorkerGroup")
    return int(os.environ[name])


class Worker:
    """Base class of the actor classes a :class:`WorkerGroup` runs. It has no ``__init__``: yours needs no super().

    The environment (``RANK``, ``MASTER_ADDR``, ...) is complete when your ``__init__`` runs.
    """

    @property
    def role(self) -> str:
        return os.environ.get("RLHFKIT_ROLE", "")

    @property
    def rank(self) -> int:
        return _env_int("RANK")

    @property
    def world_size(self) -> int:
        return _env_int("WORLD_SIZE")

    @property
    def local_rank(self) -> int:
        return _env_int("LOCAL_RANK")

    @property
    def local_world_size(self) -> int:
        return _env_int("LOCAL_WORLD_SIZE")

    def device(self) -> Any:
        """This rank's ``torch.device``: its Ray GPU as a CUDA device, or CPU when torch has no CUDA."""
        import ray
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        name = select_device(
            ray.get_gpu_ids(), cuda_device_count=count, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            ray_sets_visible_devices=os.environ.get(NOSET_CUDA_VISIBLE_DEVICES, "0") in ("", "0"),
        )
        return torch.device(name)

    def init_process_group(self, *, backend: str | None = None, timeout_s: float = 600.0) -> None:
        """``torch.distributed.init_process_group`` over this group's ranks (env://); nccl on CUDA, else gloo."""
        import datetime

        import torch.distributed as dist

        device = self.device()
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)
        dist.init_process_group(
            backend or ("nccl" if device.type == "cuda" else "gloo"), init_method="env://",
            rank=self.rank, world_size=self.world_size, timeout=datetime.timedelta(seconds=timeout_s),
        )

    def _rlhfkit_ping(self) -> int:
        return self.rank

    def _rlhfkit_info(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        assigned = context.get_assigned_resources()
        # The public API folds placement-group resources into plain ones; the raw ids (what ray.get_gpu_ids()
        # reads) keep "GPU_group_<bundle>_<pg>", the only place a process can read its bundle index from.
        core_worker = getattr(ray._private.worker.global_worker, "core_worker", None)
        raw = core_worker.resource_ids() if core_worker is not None else {}
        bundles = sorted({int(m.group(1)) for key in raw if (m := _BUNDLE_RE.match(key))})
        return {
            "node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
            "gpu_ids": tuple(str(i) for i in ray.get_gpu_ids()), "num_gpus": float(assigned.get("GPU", 0.0)),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "bundle_indices": tuple(bundles),
            "placement_group_id": context.get_placement_group_id(),
        }


@dataclass(frozen=True)
class WorkerInfo:
    """What a rank reported at start-up: where it runs and what Ray gave it."""

    role: str
    rank: int
    node_id: str
    ip: str
    pid: int
    gpu_ids: tuple[str, ...]
    num_gpus: float
    cuda_visible_devices: str | None
    bundle_indices: tuple[int, ...]
    placement_group_id: str | None


@dataclass(frozen=True, kw_only=True)
class WorkerGroupConfig:
    """How to launch one role.

    Attributes:
        role: the plan role whose ranks to launch.
        env_vars: environment of every rank (through Ray ``runtime_env``); may not override the rank variables.
        forward_env: driver environment variables copied into ``env_vars`` (e.g. ``("PYTHONPATH",)``).
        runtime_env: further per-actor ``runtime_env`` entries (``py_executable``, ``nsight``, ...).
        num_cpus: CPUs each actor reserves from its bundle (colocated actors share the bundle's ``cpus_per_bundle``).
        num_gpus: GPU fraction each actor requests; None = the plan's share (0 for a rank spanning several GPUs,
            whose TP workers take the share of each bundle).
        set_cuda_visible_devices: False sets ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``: the actor sees every GPU
            and :meth:`Worker.device` picks its own from ``ray.get_gpu_ids()``.
        start_timeout_s: limit for all ranks to be scheduled and constructed.
        call_timeout_s: default limit of ``call``/``gather``/``barrier``.
        max_concurrency: Ray ``max_concurrency`` of each actor (1: calls run one at a time, in order).
    """

    role: str
    env_vars: Mapping[str, str] = field(default_factory=dict)
    forward_env: tuple[str, ...] = ()
    runtime_env: Mapping[str, Any] = field(default_factory=dict)
    num_cpus: float = 0.0
    num_gpus: float | None = None
    set_cuda_visible_devices: bool = True
    start_timeout_s: float = 300.0
    call_timeout_s: float = 600.0
    max_concurrency: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role:
            raise ValueError(f"WorkerGroupConfig.role={self.role!r}; give the plan role to launch")
        _check_env("WorkerGroupConfig", self.env_vars, self.forward_env)
        clash = sorted(set(self.env_vars) & set(_RESERVED_ENV))
        if clash:
            raise ValueError(f"WorkerGroupConfig.env_vars sets {clash}; WorkerGroup sets those per rank")
        for name in ("start_timeout_s", "call_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkerGroupConfig.{name}={getattr(self, name)}; must be > 0 seconds")
        if not self.num_cpus >= 0:
            raise ValueError(f"WorkerGroupConfig.num_cpus={self.num_cpus}; must be >= 0")
        if self.num_gpus is not None and not 0 <= self.num_gpus <= 1:
            raise ValueError(f"WorkerGroupConfig.num_gpus={self.num_gpus}; must be in [0, 1] or None (plan share)")
        concurrency = self.max_concurrency
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"WorkerGroupConfig.max_concurrency={self.max_concurrency!r}; must be an int >= 1")
        object.__setattr__(self, "env_vars", MappingProxyType(dict(self.env_vars)))
        object.__setattr__(self, "runtime_env", MappingProxyType(dict(self.runtime_env)))



def _align_local_rank_with_device() -> None:
    """On CUDA, make ``LOCAL_RANK`` the index of this rank's CUDA device, as DeepSpeed and accelerate read it.

    When Ray sets ``CUDA_VISIBLE_DEVICES`` every actor sees its own GPU as ``cuda:0``, so the node-local rank (1, 2,
    ...) would point DeepSpeed at a device the process cannot see. The node-local rank stays available as
    ``RLHFKIT_NODE_LOCAL_RANK``. Without CUDA (logical GPUs on CPU) nothing changes.
    """
    os.environ["RLHFKIT_NODE_LOCAL_RANK"] = os.environ.get("LOCAL_RANK", "0")
    # No NVIDIA driver on this node: nothing to align, and no reason to pay torch's import in every actor start.
    if not any(os.path.exists(path) for path in ("/proc/driver/nvidia/version", "/dev/nvidiactl")):
        return
    import torch

    if not torch.cuda.is_available():
        return
    import ray

    from rlhfkit.workers._env import NOSET_CUDA_VISIBLE_DEVICES, select_device

    name = select_device(
        ray.get_gpu_ids(), cuda_device_count=torch.cuda.device_count(),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        ray_sets_visible_devices=os.environ.get(NOSET_CUDA_VISIBLE_DEVICES, "0") in ("", "0"),
    )
    if name.startswith("cuda"):
        os.environ["LOCAL_RANK"] = name.partition(":")[2] or "0"


def launchable(worker_cls: type) -> type:
    """``worker_cls`` with a constructor that first takes the rank's environment and sets it in ``os.environ``.

    The per-rank variables (RANK, MASTER_PORT, ...) differ for every actor; giving each actor its own Ray
    ``runtime_env`` for them costs a runtime-env set-up per actor (about 2x the start-up time), so they are set
    in-process before your ``__init__`` runs. Group-wide variables still travel in ``runtime_env``.
    """

    class Launched(worker_cls):  # type: ignore[misc, valid-type]
        def __init__(self, rlhfkit_env: Mapping[str, str], *args: Any, **kwargs: Any) -> None:
            os.environ.update(rlhfkit_env)
            _align_local_rank_with_device()
            super().__init__(*args, **kwargs)

    Launched.__name__ = worker_cls.__name__
    Launched.__qualname__ = worker_cls.__qualname__
    Launched.__doc__ = worker_cls.__doc__
    return Launched
