"""Atomic checkpoint directories: a checkpoint is either complete or invisible.

A checkpoint is written into ``<name>.tmp-<pid>``, a ``COMPLETE`` marker is written last, and the directory is renamed
into place with ``os.replace`` (atomic on one file system). :func:`latest_checkpoint` only ever returns directories
that carry the marker, so a run killed mid-write resumes from the previous checkpoint. What goes inside is the
caller's business (torch state dicts, DeepSpeed state, HF exports); :func:`save_torch_state` / :func:`load_torch_state`
cover the plain-torch case (models, optimizers, RNG states). Needs only torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "COMPLETE_MARKER",
    "atomic_directory",
    "checkpoint_name",
    "latest_checkpoint",
    "prune_checkpoints",
    "rng_state",
    "restore_rng_state",
    "save_torch_state",
    "load_torch_state",
]

logger = logging.getLogger(__name__)
COMPLETE_MARKER = "COMPLETE"
_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_name(step: int) -> str:
    """``step-000042``: zero-padded so names sort by step."""
    if step < 0:
        raise ValueError(f"step={step}; checkpoint steps must be >= 0")
    return f"step-{step:06d}"


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory; on success mark it complete and move it to ``path`` (replacing an old one).

    On an exception the temporary directory is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        _fsync_dir(tmp)
        if path.exists():
            old = path.with_name(f"{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(path: Path) -> None:
    for child in path.iterdir():
        if child.is_file():
            with open(child, "rb") as handle:
                os.fsync(handle.fileno())


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete ``step-N`` directory under ``root`` with the largest N, or None. Incomplete ones are skipped."""
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if not match or not child.is_dir():
            continue
        if not (child / COMPLETE_MARKER).exists():
            logger.warning("ignoring incomplete checkpoint %s (no %s marker)", child, COMPLETE_MARKER)
            continue
        step = int(match.group(1))
        if best is None or step > best[0]:
            best = (step, child)
    return None if best is None else best[1]


def prune_checkpoints(root: str | Path, *, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (and stale ``.tmp-*`` dirs); returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep={keep}; keep at least one checkpoint")
    root = Path(root)
    complete = sorted((p for p in root.glob("step-*") if _NAME.match(p.name) and (p / COMPLETE_MARKER).exists()),
                      key=lambda p: p.name)
    removed = complete[:-keep] + [p for p in root.glob("step-*.tmp-*") if p.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def rng_state() -> dict[str, Any]:
    """Python and torch (CPU, and CUDA when available) RNG states, for exact resume."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_torch_state(path: str | Path, state: Mapping[str, Any]) -> Path:
    """Atomically write ``state`` (state dicts, numbers, RNG states) as ``<path>/state.pt``; returns ``path``."""
    with atomic_directory(path) as tmp:
        torch.save(dict(state), tmp / "state.pt")
    return Path(path)


def load_torch_state(path: str | Path, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load what :func:`save_torch_state` wrote; refuses a directory without the completion marker."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).exists():
        raise ValueError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker); refusing to load it")
    return torch.load(path / "state.pt", map_location=map_location, weights_only=False)
