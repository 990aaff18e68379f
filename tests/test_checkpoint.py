import os
import random

import pytest
import torch

from rlhfkit.checkpoint import (COMPLETE_MARKER, atomic_directory, checkpoint_name, latest_checkpoint,
                                load_torch_state, prune_checkpoints, restore_rng_state, rng_state, save_torch_state)


def test_latest_skips_incomplete_and_orders_by_step(tmp_path):
    save_torch_state(tmp_path / checkpoint_name(2), {"x": torch.tensor([2.0])})
    save_torch_state(tmp_path / checkpoint_name(10), {"x": torch.tensor([10.0])})
    half = tmp_path / checkpoint_name(12)          # a crash mid-write: files but no marker
    half.mkdir()
    torch.save({"x": torch.tensor([12.0])}, half / "state.pt")
    latest = latest_checkpoint(tmp_path)
    assert latest == tmp_path / "step-000010"
    assert load_torch_state(latest)["x"].item() == 10.0
    with pytest.raises(ValueError, match="incomplete"):
        load_torch_state(half)


def test_failed_write_leaves_previous_checkpoint(tmp_path):
    target = tmp_path / checkpoint_name(1)
    save_torch_state(target, {"v": 1})
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_directory(target) as tmp:
            (tmp / "partial").write_text("x")
            raise RuntimeError("disk full")
    assert load_torch_state(target)["v"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]
    assert (target / COMPLETE_MARKER).exists()


def test_prune_keeps_newest(tmp_path):
    for step in range(5):
        save_torch_state(tmp_path / checkpoint_name(step), {"s": step})
    removed = prune_checkpoints(tmp_path, keep=2)
    assert len(removed) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]
    with pytest.raises(ValueError, match="keep=0"):
        prune_checkpoints(tmp_path, keep=0)


def test_rng_state_roundtrip():
    state = rng_state()
    expected = (torch.rand(3), random.random())
    restore_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


# --- SIGKILL at every rename / delete: "complete or invisible", and the last complete checkpoint stays visible ---

_KILLER = r"""
import os, shutil, signal, sys
from pathlib import Path
import torch
from rlhfkit import checkpoint
action, root, kill_at = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
function, count = kill_at.split(":")
calls = {"replace": 0, "rmtree": 0}
real_replace, real_rmtree = os.replace, shutil.rmtree

def replace(source, target):
    calls["replace"] += 1
    if function == "replace" and calls["replace"] == int(count):
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(source, target)

def rmtree(path, *args, **kwargs):
    calls["rmtree"] += 1
    if function == "rmtree" and calls["rmtree"] == int(count):
        for child in sorted(Path(path).iterdir()):   # half-way: one file gone, then killed
            child.unlink()
            break
        os.kill(os.getpid(), signal.SIGKILL)
    real_rmtree(path, *args, **kwargs)

os.replace, shutil.rmtree = replace, rmtree
if action == "save":      # re-save step 2 (which already exists) with new contents
    checkpoint.save_torch_state(root / checkpoint.checkpoint_name(2), {"step": 2, "version": "new"})
else:
    checkpoint.prune_checkpoints(root, keep=1)
print("finished without being killed")
"""


def _run_killed(tmp_path, action, root, kill_at):
    import subprocess
    import sys
    script = tmp_path / "killer.py"
    script.write_text(_KILLER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))    # the rlhfkit under test, however it is found
    return subprocess.Popen([sys.executable, str(script), action, str(root), kill_at], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _assert_visible_complete(root):
    """Every directory latest_checkpoint/prune may pick carries the marker AND its state; none is half-deleted."""
    latest = latest_checkpoint(root)
    assert latest is not None, sorted(p.name for p in root.iterdir())
    for path in root.iterdir():
        if (path / COMPLETE_MARKER).exists():
            assert (path / "state.pt").exists(), f"{path.name} carries the marker but its state is gone"
    return latest


@pytest.mark.parametrize("kill_at", ["replace:1", "rmtree:1", "replace:2"])
def test_sigkill_while_replacing_a_step_keeps_a_complete_copy_visible(tmp_path, kill_at):
    """Review defect 1: a kill between the two renames of a re-save left no visible complete copy of the step (it sat
    in ``step-N.old-PID``, seen neither by latest_checkpoint nor prune_checkpoints); a kill mid-delete left a marked,
    half-deleted directory."""
    root = tmp_path / "ckpt"
    save_torch_state(root / checkpoint_name(1), {"step": 1, "version": "old"})
    save_torch_state(root / checkpoint_name(2), {"step": 2, "version": "old"})
    process = _run_killed(tmp_path, "save", root, kill_at)
    out, err = process.communicate(timeout=120)
    assert process.returncode == -9, (process.returncode, out, err)
    latest = _assert_visible_complete(root)
    assert load_torch_state(latest)["step"] == 2           # step 2 never became invisible (old or new copy)
    prune_checkpoints(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002"]
    assert latest_checkpoint(root) == root / "step-000002"
    assert load_torch_state(root / "step-000002")["step"] == 2


@pytest.mark.parametrize("kill_at", ["replace:1", "rmtree:1", "replace:2", "rmtree:2"])
def test_sigkill_inside_prune_leaves_no_half_deleted_checkpoint(tmp_path, kill_at):
    """Review defect 2: a kill inside prune_checkpoints' rmtree left directories that still carried COMPLETE without
    ``state.pt``, and empty ``step-N`` directories that no later prune removed."""
    root = tmp_path / "ckpt"
    for step in range(4):
        save_torch_state(root / checkpoint_name(step), {"step": step})
    process = _run_killed(tmp_path, "prune", root, kill_at)
    out, err = process.communicate(timeout=120)
    assert process.returncode == -9, (process.returncode, out, err)
    latest = _assert_visible_complete(root)
    assert load_torch_state(latest)["step"] == 3
    prune_checkpoints(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-000003"]


def test_prune_recovers_orphans_and_removes_leftovers(tmp_path):
    """Review defects 1-2, the leftovers older code left behind: a complete ``step-N.old-PID`` is recognised and moved
    into place; an empty ``step-N`` (half-deleted), a marked ``.old`` beside its step and trash dirs are removed."""
    save_torch_state(tmp_path / checkpoint_name(1), {"step": 1})
    save_torch_state(tmp_path / checkpoint_name(3), {"step": 3})
    os.replace(tmp_path / "step-000003", tmp_path / "step-000003.old-4242")   # killed between the old renames
    save_torch_state(tmp_path / "step-000001.old-7", {"step": -1})            # a stale displaced copy
    (tmp_path / checkpoint_name(2)).mkdir()                                   # emptied by a killed rmtree
    (tmp_path / "step-000002.trash-abc123").mkdir()
    (tmp_path / "notes.txt").write_text("not ours")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000003.old-4242"
    assert load_torch_state(latest_checkpoint(tmp_path))["step"] == 3
    prune_checkpoints(tmp_path, keep=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step-000001", "step-000003"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000003"
    assert load_torch_state(tmp_path / "step-000001")["step"] == 1


def test_resave_after_a_killed_save_with_the_same_pid_keeps_the_step(tmp_path, monkeypatch):
    """Review defect 1, sibling: in a container a restarted process often has the killed one's pid; its save of the
    same step must not delete the killed save's complete ``.tmp-<pid>`` before its own copy is complete."""
    target = tmp_path / checkpoint_name(5)
    with atomic_directory(target) as tmp:
        torch.save({"step": 5}, tmp / "state.pt")
    os.replace(target, target.with_name(f"{target.name}.tmp-{os.getpid()}"))   # killed before the final rename
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_directory(target) as tmp:
            assert load_torch_state(latest_checkpoint(tmp_path))["step"] == 5
            raise RuntimeError("killed mid-write")
    assert latest_checkpoint(tmp_path) == target
