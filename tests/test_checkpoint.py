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
