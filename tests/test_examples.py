"""The CPU main job (examples/grpo_cpu.py) runs end to end for every estimator, and resumes exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import load_example

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_cpu.py"


@pytest.fixture(scope="module")
def grpo_cpu():
    return load_example("grpo_cpu")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce++", "reinforce++_baseline", "ppo"])
def test_every_estimator_runs_a_few_steps(grpo_cpu, tiny_llama_path, tmp_path, estimator):
    summary = grpo_cpu.main(["--model", str(tiny_llama_path), "--output-dir", str(tmp_path), "--tiny",
                             "--estimator", estimator, "--no-plot"])
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert summary["steps"] == 3
    for row in rows:
        assert row["engine/weight_version"] == row["step"] + 1      # one sync per step
        assert row["engine_vs_trainer/mean_abs_logprob_diff"] < 1e-4  # engine and trainer hold the same weights
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["grad_norm"] > 0
        if estimator == "ppo":
            assert row["value_loss"] > 0
    assert (tmp_path / "checkpoints" / "step-000003" / "COMPLETE").exists()


def test_resume_gives_the_same_next_step_loss(grpo_cpu, tiny_llama_path, tmp_path):
    common = ["--model", str(tiny_llama_path), "--no-plot", "--prompts-per-step", "4", "--samples-per-prompt", "4",
              "--checkpoint-every", "2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    grpo_cpu.main(common + ["--output-dir", str(straight), "--steps", "4"])
    grpo_cpu.main(common + ["--output-dir", str(resumed), "--steps", "2"])
    # a crash while writing step 3's checkpoint left files but no COMPLETE marker: it must be ignored
    partial = resumed / "checkpoints" / "step-000003"
    shutil.copytree(resumed / "checkpoints" / "step-000002", partial)
    (partial / "COMPLETE").unlink()
    (partial / "state.pt").write_bytes(b"truncated")
    grpo_cpu.main(common + ["--output-dir", str(resumed), "--steps", "4", "--resume"])
    a, b = _rows(straight), _rows(resumed)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for step in (2, 3):
        assert abs(a[step]["loss"] - b[step]["loss"]) <= 1e-6, (step, a[step]["loss"], b[step]["loss"])
        assert a[step]["reward/mean"] == b[step]["reward/mean"]
    assert a[1]["loss"] != a[2]["loss"]  # the comparison is not vacuous


def test_dynamic_sampling_keeps_the_batch_size(grpo_cpu, tiny_llama_path, tmp_path):
    """--dynamic-sampling (DAPO): every step trains on exactly --prompts-per-step whole informative groups."""
    grpo_cpu.main(["--model", str(tiny_llama_path), "--output-dir", str(tmp_path), "--tiny", "--no-plot",
                   "--dynamic-sampling"])
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["dynamic_sampling/kept"] == 4 and row["dynamic_sampling/fill"] == 1.0
        assert row["num_seqs"] == 16                                  # 4 groups x 4 samples
        assert 1 <= row["dynamic_sampling/rounds"] <= 4
        assert row["engine_vs_trainer/mean_abs_logprob_diff"] < 1e-4
