"""Checkpoint, resume and export of a whole hybrid run, in one call each.

:func:`save_checkpoint` writes ``root/step-N`` atomically (:func:`rlhfkit.checkpoint.atomic_directory`: complete or
invisible, even under SIGKILL):

- ``<role>/step-G/``: each trained role (actor, critic) through :meth:`TrainerGroup.save` (DeepSpeed: weights,
  optimizer, LR schedule, its global step ``G``; every rank writes its shards);
- ``driver.pt``: the driver's Python and torch RNG states and your ``state`` (anything picklable);
- ``run.json``: the step, the engines' weight version, the roles and a small JSON of the run's config.

``N`` is the step the run resumes at (the number of steps done): data position (``PromptDataset.stream(start_step=
N)``) and metrics offset (``MetricsLogger(resume_step=N)``) both come from it.

:func:`load_checkpoint` restores a freshly started :class:`Hybrid` in the order the phase guard and the weight sync
need, so that your loop never has to: the engines go to sleep first (a trainer's load wakes it on the GPU they
share); the critic loads, then the actor (each sleeps after its load, the actor keeping its weights for the push);
then :meth:`Hybrid.push_weights` gives the engines the loaded weights. :func:`export_model` writes a role's
weights as an HF folder (:meth:`TrainerGroup.export`) with the engines asleep. What it does not do: restore the
engines' weight-version counter (after a resume it restarts from the push that follows the load; the saved version is
in :attr:`RunCheckpoint.weight_version`) or the workers' RNG states (the losses here draw none; seed sampling per
step). Needs what the run needs (torch, ray, deepspeed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhfkit.checkpoint import (COMPLETE_MARKER, atomic_directory, checkpoint_name, prune_checkpoints,
                                restore_rng_state, rng_state)

__all__ = ["RunCheckpoint", "export_model", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)
RUN_FILE, DRIVER_FILE = "run.json", "driver.pt"
TRAINED_ROLES = ("critic", "actor")  # the order of a load: the actor last, so that it sleeps keeping its weights


@dataclass(frozen=True, kw_only=True)
class RunCheckpoint:
    """What :func:`load_checkpoint` restored.

    Attributes:
        path: the checkpoint directory.
        step: the step to resume at (the number of steps the saved run had done).
        state: the ``state`` given to :func:`save_checkpoint`.
        config: the ``config`` given to :func:`save_checkpoint` (JSON values).
        weight_version: the engines' weight version when the checkpoint was saved.
        roles: the trained roles restored, in load order.
    """

    path: Path
    step: int
    state: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    weight_version: int = 0
    roles: tuple[str, ...] = ()


def _trained_roles(hybrid: Any) -> list[str]:
    return [role for role in TRAINED_ROLES if role in hybrid.trainers]


def _quiet_engines(hybrid: Any, phase: str) -> None:
    """Put engines that share the trainers' GPUs to sleep (keeping their weights), so a trainer may wake."""
    engines = hybrid.engines
    if engines is None or not engines.colocated or engines.overlap or engines.asleep:
        return
    engines.sleep(level=min(engines.sleep_level, 1), phase=phase)


def _json_config(hybrid: Any, config: Mapping[str, Any] | None) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        return json.loads(json.dumps(value, default=repr))

    return {"run": plain(dict(config or {})), "hybrid": plain(dataclasses.asdict(hybrid.config)),
            "trainers": {role: repr(group.config) for role, group in hybrid.trainers.items()}}


def save_checkpoint(hybrid: Any, root: str | Path, *, step: int, state: Mapping[str, Any] | None = None,
                    config: Mapping[str, Any] | None = None, keep: int | None = None) -> Path:
    """Write ``root/step-<step>`` atomically (see the module docstring); returns its path.

    Args:
        hybrid: the running :class:`Hybrid`; call between steps (after ``push_weights``).
        root: the run's checkpoint folder.
        step: the step a resume starts at (steps done so far).
        state: your own driver state (picklable), returned by :func:`load_checkpoint`.
        config: the run's options, saved as JSON in ``run.json`` (values JSON cannot hold are saved as ``repr``).
        keep: after saving, keep only this many newest checkpoints (:func:`rlhfkit.checkpoint.prune_checkpoints`).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_checkpoint(step={step!r}); pass the number of steps done, an int >= 0")
    roles = _trained_roles(hybrid)
    if not roles:
        raise ValueError(f"save_checkpoint: the run has no trained role (roles: {sorted(hybrid.trainers)}); "
                         "checkpoints hold the actor's and critic's states")
    path = Path(root) / checkpoint_name(step)
    _quiet_engines(hybrid, "save")
    with atomic_directory(path) as tmp:
        saved = {}
        for role in roles:
            group = hybrid.trainers[role]
            saved[role] = str(group.save(tmp / role).relative_to(tmp))
            group.sleep(phase=f"save_{role}")
        torch.save({"rng": rng_state(), "state": dict(state or {})}, tmp / DRIVER_FILE)
        versions = hybrid.engines.weight_versions() if hybrid.engines is not None else [0]
        meta = {"step": step, "weight_version": min(versions), "roles": saved,
                "config": _json_config(hybrid, config)}
        (tmp / RUN_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    if keep is not None:
        prune_checkpoints(root, keep=keep)
    logger.info("saved run checkpoint %s", path)
    return path


def load_checkpoint(hybrid: Any, path: str | Path) -> RunCheckpoint:
    """Restore a freshly started :class:`Hybrid` from ``path`` (a directory :func:`save_checkpoint` wrote, e.g.
    ``latest_checkpoint(root)``), in the order the run needs (see the module docstring): every trained role's
    weights, optimizer and schedule, the driver's RNG states, and the engines hold the loaded actor's weights."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file() or not (path / RUN_FILE).is_file():
        raise ValueError(f"load_checkpoint(path={str(path)!r}): not a complete run checkpoint (no {COMPLETE_MARKER} "
                         f"or {RUN_FILE}); pass a directory from save_checkpoint() or latest_checkpoint(root)")
    meta = json.loads((path / RUN_FILE).read_text())
    roles = _trained_roles(hybrid)
    if sorted(meta["roles"]) != sorted(roles):
        raise ValueError(f"load_checkpoint: {path} holds the roles {sorted(meta['roles'])} but this run trains "
                         f"{sorted(roles)}; start the run with the same trained roles")
    _quiet_engines(hybrid, "load")
    for role in roles:
        group = hybrid.trainers[role]
        group.load(path / meta["roles"][role])
        group.sleep(keep_weights=role == "actor", phase=f"load_{role}")
    driver = torch.load(path / DRIVER_FILE, map_location="cpu", weights_only=False)
    if "actor" in roles and hybrid.engines is not None:
        hybrid.push_weights()
    restore_rng_state(driver["rng"])
    return RunCheckpoint(path=path, step=int(meta["step"]), state=driver["state"], config=meta["config"]["run"],
                         weight_version=int(meta["weight_version"]), roles=tuple(roles))


def export_model(hybrid: Any, path: str | Path, *, role: str = "actor") -> Path:
    """Write ``role``'s weights as an HF folder (:meth:`TrainerGroup.export`: from_pretrained / vllm serve; LoRA:
    merged, with the adapter in ``path/adapter``) with the engines asleep; the role sleeps after. Returns ``path``."""
    if role not in hybrid.trainers:
        raise ValueError(f"export_model(role={role!r}); the run's roles are {sorted(hybrid.trainers)}")
    _quiet_engines(hybrid, "export")
    group = hybrid.trainers[role]
    out = group.export(path)
    group.sleep(phase=f"export_{role}")
    return out

