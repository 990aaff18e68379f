"""Ray start-up and device selection for :mod:`rlhfkit.workers`: :class:`RayConfig`, :func:`ray_init`,
:func:`select_device`.

Needs the ``ray`` extra for :func:`ray_init` only (imported inside it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from rlhfkit._optional import require

__all__ = ["RayConfig", "ray_init", "select_device", "NOSET_CUDA_VISIBLE_DEVICES", "forwarded_env"]

logger = logging.getLogger(__name__)
# With this variable set to 1 in a worker's environment, Ray leaves CUDA_VISIBLE_DEVICES alone for it.
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def forwarded_env(names: Sequence[str], env_vars: Mapping[str, str]) -> dict[str, str]:
    """``env_vars`` plus the driver's value of each variable in ``names`` that is set (explicit values win)."""
    merged = {name: os.environ[name] for name in names if name in os.environ}
    merged.update(env_vars)
    return merged


def _check_env(owner: str, env_vars: Mapping[str, str], forward_env: Sequence[str]) -> None:
    for key, value in dict(env_vars).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"{owner}.env_vars[{key!r}]={value!r}; keys and values must be strings")
    if isinstance(forward_env, str) or not all(isinstance(name, str) for name in forward_env):
        raise TypeError(f"{owner}.forward_env={forward_env!r}; give a tuple of variable names, e.g. ('PYTHONPATH',)")


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """How :func:`ray_init` starts or joins Ray.

    Attributes:
        address: None starts a local cluster; ``"auto"`` or ``"host:port"`` joins a running one (``ray start``).
        num_cpus, num_gpus, resources, object_store_memory: the local cluster's size (local cluster only). On CPU,
            ``num_gpus`` declares logical GPUs.
        temp_dir: Ray's root for sessions, logs and sockets (default ``/tmp/ray``). Point it at a roomy disk: logs
            and spilled objects fill ``/tmp``. When joining with ``address="auto"``, it must be the ``--temp-dir`` of
            ``ray start``. Keep it short: Ray puts Unix sockets under it (107-byte limit).
        spill_dir: where object spilling writes (local cluster only; default under ``temp_dir``).
        include_dashboard: start the dashboard (needed for ``ray job submit``; local cluster only).
        prestart_workers: let the local cluster start one idle worker process per CPU when the driver connects
            (Ray's own default; local cluster only). Off here: every rlhfkit role is an actor that starts a process
            of its own, and on a 16-core GPU machine ``ray.init`` took ~2 s longer with those idle workers, the
            actors no sooner ready. Turn it on for task-heavy jobs.
        namespace: Ray namespace of the job.
        env_vars: environment of every worker process of the job (Ray ``runtime_env``).
        forward_env: names of driver environment variables to copy into ``env_vars`` (e.g. ``("PYTHONPATH",
            "LD_LIBRARY_PATH")``): Ray workers do not inherit the driver's shell.
        runtime_env: further job-level ``runtime_env`` entries (``working_dir``, ``py_modules``, ...).
    """

    address: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    resources: Mapping[str, float] = field(default_factory=dict)
    object_store_memory: int | None = None
    temp_dir: str | None = None
    spill_dir: str | None = None
    include_dashboard: bool = False
    prestart_workers: bool = False
    namespace: str | None = None
    env_vars: Mapping[str, str] = field(default_factory=dict)
    forward_env: tuple[str, ...] = ()
    runtime_env: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.address is not None:
            local_only = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": self.resources or None,
                          "object_store_memory": self.object_store_memory, "spill_dir": self.spill_dir}
            given = [name for name, value in local_only.items() if value is not None]
            if given:
                raise ValueError(
                    f"RayConfig: {given} only apply when starting a local cluster (address=None), but address="
                    f"{self.address!r}; set them on `ray start` for a running cluster"
                )
        for name in ("temp_dir", "spill_dir"):
            path = getattr(self, name)
            if path is not None and not os.path.isabs(path):
                raise ValueError(f"RayConfig.{name}={path!r}; must be an absolute path")
        for name in ("num_cpus", "num_gpus", "object_store_memory"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"RayConfig.{name}={value!r}; must be an int >= 0 or None")
        _check_env("RayConfig", self.env_vars, self.forward_env)
        object.__setattr__(self, "resources", MappingProxyType(dict(self.resources)))
        object.__setattr__(self, "env_vars", MappingProxyType(dict(self.env_vars)))
        object.__setattr__(self, "runtime_env", MappingProxyType(dict(self.runtime_env)))

    def init_kwargs(self) -> dict[str, Any]:
        """The keyword arguments :func:`ray_init` passes to ``ray.init``."""
        runtime_env = dict(self.runtime_env)
        env = forwarded_env(self.forward_env, {**dict(runtime_env.get("env_vars", {})), **self.env_vars})
        if env:
            runtime_env["env_vars"] = env
        kwargs: dict[str, Any] = {"address": self.address, "namespace": self.namespace,
                                  "runtime_env": runtime_env or None}
        if self.temp_dir is not None:
            kwargs["_temp_dir"] = self.temp_dir
        if self.address is None:
            kwargs.update(num_cpus=self.num_cpus, num_gpus=self.num_gpus, resources=dict(self.resources) or None,
                          object_store_memory=self.object_store_memory, include_dashboard=self.include_dashboard)
            system: dict[str, Any] = {"prestart_worker_first_driver": self.prestart_workers}
            if self.spill_dir is not None:
                import json

                spill = {"type": "filesystem", "params": {"directory_path": self.spill_dir}}
                system["object_spilling_config"] = json.dumps(spill)
            kwargs["_system_config"] = system
        return kwargs


# Set by `ray job submit` in the entrypoint's environment: the job's runtime_env, which ray.init merges with its own.
_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def _without_job_duplicates(runtime_env: Mapping[str, Any], job_config_json: str) -> dict[str, Any] | None:
    """Drop env vars the submitted job already sets to the same value; Ray refuses any key set twice.

    Under ``ray job submit`` the entrypoint inherits the job's ``env_vars``, so forwarding them again would repeat
    them. A key set to a *different* value is a real conflict and raises.
    """
    import json

    job_env = dict((json.loads(job_config_json).get("runtime_env") or {}).get("env_vars") or {})
    runtime_env = dict(runtime_env)
    env_vars = dict(runtime_env.pop("env_vars", {}))
    clash = {key: (value, job_env[key]) for key, value in env_vars.items() if key in job_env and job_env[key] != value}
    if clash:
        raise ValueError(
            f"RayConfig env_vars {clash} (ours, the job's) conflict with the runtime_env given to `ray job submit`; "
            "set each variable in one place"
        )
    env_vars = {key: value for key, value in env_vars.items() if key not in job_env}
    if env_vars:
        runtime_env["env_vars"] = env_vars
    return runtime_env or None


def ray_init(config: RayConfig | None = None) -> Any:
    """Start or join Ray as ``config`` says; if Ray is already initialized, log and reuse it (the config is ignored)."""
    ray = require("ray", user="rlhfkit.workers")
    config = config or RayConfig()
    if not isinstance(config, RayConfig):
        raise TypeError(f"ray_init takes a RayConfig, got {type(config).__name__}")
    if ray.is_initialized():
        logger.info("Ray is already initialized; ray_init reuses it and ignores %s", config)
        return None
    kwargs = config.init_kwargs()
    if _JOB_CONFIG_ENV in os.environ and kwargs.get("runtime_env"):
        kwargs["runtime_env"] = _without_job_duplicates(kwargs["runtime_env"], os.environ[_JOB_CONFIG_ENV])
    logger.info("ray.init(%s)", ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if v is not None))
    return ray.init(**kwargs)


def select_device(
    gpu_ids: Sequence[int | str],
    *,
    cuda_device_count: int,
    cuda_visible_devices: str | None,
    ray_sets_visible_devices: bool,
) -> str:
    """The torch device string for a worker that Ray gave ``gpu_ids`` (``ray.get_gpu_ids()``); ``"cpu"`` without CUDA.

    * Ray sets ``CUDA_VISIBLE_DEVICES`` (the default): the process sees only its GPUs, so its first GPU is
      ``cuda:<position in CUDA_VISIBLE_DEVICES>`` = ``cuda:0``.
    * ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``: the process sees every GPU it inherited. Ray's ids are
      physical ids (already mapped through an inherited ``CUDA_VISIBLE_DEVICES``), so the device is the id's position
      in the inherited ``CUDA_VISIBLE_DEVICES``, or the id itself when that is unset.

    A Ray GPU id is never turned into ``cuda:N`` when torch sees no CUDA device (logical GPUs on a CPU machine).
    """
    if not gpu_ids or cuda_device_count == 0:
        return "cpu"
    first = str(gpu_ids[0])
    visible = [item.strip() for item in cuda_visible_devices.split(",")] if cuda_visible_devices else None
    if visible is not None and first in visible:
        index = visible.index(first)
    elif ray_sets_visible_devices:
        index = 0
    elif visible is None and first.isdigit():
        index = int(first)
    else:
        raise RuntimeError(
            f"Ray GPU id {first!r} is not in CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}; cannot map it to a torch "
            "device (did something change CUDA_VISIBLE_DEVICES after the worker started?)"
        )
    if index >= cuda_device_count:
        raise RuntimeError(
            f"Ray GPU id {first!r} maps to cuda:{index} but torch sees {cuda_device_count} device(s) "
            f"(CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}, Ray sets it: {ray_sets_visible_devices})"
        )
    return f"cuda:{index}"
