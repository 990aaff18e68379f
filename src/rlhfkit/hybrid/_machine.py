"""The facts of this machine a hybrid run is planned for: the first GPU's memory less what other processes hold on
it, and the host memory Ray lets the run use; :func:`plan_for_machine` plans a run for them
(:func:`rlhfkit.hybrid.plan_hybrid`). Reads CUDA (torch), NVML and ``sysconf``; starts nothing."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from rlhfkit.hybrid._plan import HybridPlan, plan_hybrid
from rlhfkit.hybrid._timer import visible_gpu_memory_used_gib

__all__ = ["HELD_GPU_GIB", "held_by_others_gib", "physical_memory_gib", "plan_for_machine", "ray_memory_threshold"]

logger = logging.getLogger(__name__)


def plan_for_machine(config: Any, trainers: Mapping[str, Any], *, model_shape: Any = None,
                     held_gib: float | None = None) -> HybridPlan:
    """:func:`~rlhfkit.hybrid.plan_hybrid` for this machine, as :meth:`Hybrid.start` plans a run given no plan: on
    CUDA the first visible GPU's memory less ``held_gib`` (default: what other processes hold on the busiest visible
    GPU; the switches then do not overlap: the headroom is not there) and this machine's physical memory times Ray's
    memory-kill threshold; on CPU no sizes (the layout as configured)."""
    gpu_gib = host_gib = None
    held = held_by_others_gib(config) if held_gib is None else held_gib
    if config.device == "cuda":
        if torch.cuda.is_available():
            gpu_gib = torch.cuda.get_device_properties(0).total_memory / 1024**3 - held
        physical = physical_memory_gib()
        host_gib = None if physical is None else physical * ray_memory_threshold()
    plan = plan_hybrid(config, trainers, gpu_memory_gib=gpu_gib, host_memory_gib=host_gib, model_shape=model_shape)
    return dataclasses.replace(plan, overlap_switches=False) if held else plan


# GPU memory in use before a run starts, above which the fit check counts it as held by other processes: below it is
# the driver's own reservation and a stray CUDA context (~0.5 GiB each).
HELD_GPU_GIB = 1.0


def held_by_others_gib(config: Any) -> float:
    """GiB already in use on the busiest of this machine's visible GPUs before the run places anything (another
    job, a process left over from an earlier run), when at least ``HELD_GPU_GIB``; 0.0 otherwise, on CPU, without
    NVML, or when joining a cluster (``ray_address`` / ``$RAY_ADDRESS``: the run's GPUs may be on other
    machines)."""
    if config.device != "cuda":
        return 0.0
    if config.ray_address or os.environ.get("RAY_ADDRESS"):
        return 0.0
    used = visible_gpu_memory_used_gib()
    busiest = max(used) if used else 0.0
    if busiest < HELD_GPU_GIB:
        return 0.0
    logger.warning("%.1f GiB of a GPU this run may use (of %s GiB in use on the visible GPUs) is held by other "
                   "processes before the run starts: the plan counts the GPU as that much smaller (give the run free "
                   "GPUs with CUDA_VISIBLE_DEVICES, or plan it yourself with plan_hybrid)", busiest,
                   [round(gib, 1) for gib in used])
    return busiest


def ray_memory_threshold() -> float:
    """The share of a node's memory past which Ray's memory monitor kills workers (``RAY_memory_usage_threshold``,
    0.95 by default; 1.0 when ``RAY_memory_monitor_refresh_ms=0`` turns the monitor off): the usable host memory."""
    if os.environ.get("RAY_memory_monitor_refresh_ms", "").strip() == "0":
        return 1.0
    raw = os.environ.get("RAY_memory_usage_threshold", "0.95")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"RAY_memory_usage_threshold={raw!r}; Ray expects a number in (0, 1]") from None
    if not 0 < value <= 1:
        raise ValueError(f"RAY_memory_usage_threshold={raw!r}; Ray expects a number in (0, 1]")
    return value


def physical_memory_gib() -> float | None:
    """This machine's physical memory in GiB (``SC_PAGE_SIZE * SC_PHYS_PAGES``); None where sysconf lacks them."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError, AttributeError):
        return None
