"""Atomic checkpoint directories: a checkpoint is either complete or invisible, even under SIGKILL at any point.

A checkpoint is written into ``<name>.tmp-<pid>``; once every file is written (and fsynced) a ``COMPLETE`` marker is
written last, and the directory is renamed into place with ``os.replace`` (atomic on one file system). Replacing an
existing ``step-N`` takes two renames (the old copy to ``step-N.trash-*``, then the new one into place); a process
killed between them leaves ``step-N.tmp-<pid>`` *with* its marker, which :func:`latest_checkpoint` recognises as the
complete copy of step N and :func:`prune_checkpoints` (or the next save of that step) moves into place. Directories are
deleted by first renaming them to a ``.trash-*`` name, so a kill mid-delete never leaves a marked but half-deleted
checkpoint; leftovers are removed by :func:`prune_checkpoints`. :func:`latest_checkpoint` only ever returns directories
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
import uuid
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
# A finished write whose final rename did not happen (``.old-*``: the pre-0.x protocol's displaced copy).
_ORPHAN = re.compile(r"^step-(\d+)\.(?:tmp|old)-\d+$")
_TRASH = re.compile(r"^step-\d+\.trash-[0-9a-f]+$")


def checkpoint_name(step: int) -> str:
    """``step-000042``: zero-padded so names sort by step."""
    if step < 0:
        raise ValueError(f"step={step}; checkpoint steps must be >= 0")
    return f"step-{step:06d}"


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory; on success mark it complete and move it to ``path`` (replacing an old one).

    On an exception the temporary directory is removed and ``path`` is left as it was. Under SIGKILL at any point,
    :func:`latest_checkpoint` sees either the previous complete copy of ``path`` or the new one, never neither.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    if (tmp / COMPLETE_MARKER).is_file() and not (path / COMPLETE_MARKER).is_file():
        _move_into_place(tmp, path)         # a killed save's complete copy (the same pid, e.g. in a container)
    _remove_directory(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)                     # the data is durable before the marker says so
        marker = tmp / COMPLETE_MARKER
        marker.write_text("ok\n")
        _fsync_file(marker)
    except BaseException:
        _remove_directory(tmp)
        raise
    # From here on ``tmp`` is a complete checkpoint that latest_checkpoint() recognises, so nothing below (a kill,
    # an error) may delete it: the old copy is moved to a trash name, then the new one into place.
    _move_into_place(tmp, path)


def _move_into_place(source: Path, path: Path) -> None:
    """Replace ``path`` (if any) by the complete directory ``source``; a kill in between leaves ``source`` visible."""
    _remove_directory(path)
    os.replace(source, path)
    _fsync_directory(path.parent)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    if os.name != "posix":                  # Windows cannot open a directory to fsync it
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(path: Path) -> None:
    for directory, _, files in os.walk(path):
        for name in files:
            _fsync_file(Path(directory, name))


def _remove_directory(path: Path) -> None:
    """Rename ``path`` to a ``.trash-*`` name (atomic), then delete it: a kill mid-delete leaves only trash."""
    if not path.exists():
        return
    trash = path.with_name(f"{_step_prefix(path.name)}.trash-{uuid.uuid4().hex}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _step_prefix(name: str) -> str:
    return name.split(".", 1)[0]


def _complete_copies(root: Path) -> dict[int, Path]:
    """Step -> its complete copy: ``step-N`` with the marker, else a marked orphan ``step-N.tmp-*``/``.old-*``."""
    found: dict[int, Path] = {}
    orphans: dict[int, Path] = {}
    for child in sorted(root.iterdir(), key=lambda p: p.name):
        match = _NAME.match(child.name)
        orphan = _ORPHAN.match(child.name)
        if not (match or orphan) or not child.is_dir() or not (child / COMPLETE_MARKER).is_file():
            continue
        (found if match else orphans).setdefault(int((match or orphan).group(1)), child)
    for step, child in orphans.items():
        if step not in found:
            found[step] = child
    return found


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint under ``root`` with the largest step, or None. Incomplete ones are skipped.

    Usually ``root/step-N``. If a save was killed between its two renames, the only complete copy of step N is
    ``root/step-N.tmp-<pid>`` (it carries the marker): that path is returned, load it as it is;
    :func:`prune_checkpoints` moves it into place. Never renames or deletes anything, so every rank of a job that
    calls it on a shared file system gets the same answer.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    copies = _complete_copies(root)
    if not copies:
        return None
    best = copies[max(copies)]
    if not _NAME.match(best.name):
        logger.warning("checkpoint step %s exists only as %s (a save was killed between its renames); using it",
                       best.name.split(".")[0], best)
    return best


def prune_checkpoints(root: str | Path, *, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints; returns what was removed.

    Also moves a complete orphan (see :func:`latest_checkpoint`) into place as ``step-N``, and deletes leftovers of
    killed saves and deletes: unmarked ``step-N`` and ``step-N.tmp-*`` directories, stale ``.old-*`` copies and
    ``.trash-*`` directories. Do not run it while another process saves into ``root``.
    """
    if keep < 1:
        raise ValueError(f"keep={keep}; keep at least one checkpoint")
    root = Path(root)
    if not root.is_dir():
        return []
    copies = _complete_copies(root)
    for step, copy in copies.items():
        if not _NAME.match(copy.name):      # recover: finish the rename the killed save did not do
            target = root / _step_prefix(copy.name)
            _move_into_place(copy, target)  # replaces an unmarked leftover of the same step, if any
            logger.warning("moved the complete orphan %s into place as %s", copy, target)
            copies[step] = target
    kept = {copies[step] for step in sorted(copies)[-keep:]}
    removed = [copies[step] for step in sorted(copies)[:-keep]]
    removed += [child for child in sorted(root.iterdir(), key=lambda p: p.name)
                if child.is_dir() and child not in kept and child not in removed
                and (_NAME.match(child.name) or _ORPHAN.match(child.name) or _TRASH.match(child.name))]
    for path in removed:
        if _TRASH.match(path.name):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _remove_directory(path)
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
