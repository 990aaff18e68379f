"""examples/grpo.py on CPU (Ray with a logical GPU, the HF engine, DeepSpeed on CPU, a tiny random Llama): a run
from a JSONL file with a TRL-style reward module, evaluated every 2 steps, killed with SIGKILL after its first
checkpoint and resumed, logs the same metrics as an uninterrupted run; its export loads with from_pretrained."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
# numbers that depend on time, on the machine or on the process (the engines' weight version restarts at the push
# that follows a resume's load)
VARYING = ("time", "_s", "seconds", "bytes", "peak", "gib", "switch", "worker", "version", "startup")
REWARD_MODULE = '''
def reward(prompts, completions, **columns):
    """TRL's signature: 1 for a response of even length (something a random model gets right half the time)."""
    return [float(len(completion) % 2 == 0) for completion in completions]
'''


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not any(part in k for part in VARYING)} for row in rows]


def _kill_session(pid: int) -> None:
    """SIGKILL the driver's whole session (the driver, and the Ray processes it started), each by its id."""
    listed = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True, check=True).stdout.split()
    for member, session in zip(listed[::2], listed[1::2]):
        if int(session) == pid:
            try:
                os.kill(int(member), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
@pytest.mark.ray
def test_grpo_recipe_killed_and_resumed_logs_what_an_uninterrupted_run_logs(tiny_llama_path, tmp_path):
    from transformers import AutoModelForCausalLM

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {a + 1}?", "label": str(2 * a + 1)}) + "\n"
                            for a in range(12)))
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(ROOT / "examples" / "grpo.py"), "--device", "cpu", "--model", str(tiny_llama_path),
               "--dataset", str(data), "--reward", "my_rewards:reward", "--eval-size", "4", "--eval-every", "2",
               "--eval-samples", "2", "--steps", "4", "--prompts-per-step", "2", "--samples-per-prompt", "2",
               "--max-new-tokens", "4", "--save-every", "2", "--lr", "1e-3"]

    straight = tmp_path / "straight"
    subprocess.run(command + ["--out", str(straight)], env=env, check=True, timeout=600)

    killed = tmp_path / "killed"
    driver = subprocess.Popen(command + ["--out", str(killed)], env=env, start_new_session=True)
    try:
        marker = killed / "checkpoints" / "step-000002" / "COMPLETE"
        deadline = time.monotonic() + 600
        while not marker.exists() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists() and driver.poll() is None, "the run ended or stalled before its first checkpoint"
    finally:
        _kill_session(driver.pid)
        driver.wait(timeout=60)
    assert not (killed / "checkpoints" / "step-000004").exists()  # killed mid-run, before its last checkpoint
    subprocess.run(command + ["--out", str(killed), "--resume", "true", "--export", str(killed / "final")], env=env,
                   check=True, timeout=600)

    expected, resumed = _rows(straight), _rows(killed)
    assert [row["step"] for row in resumed] == [0.0, 1.0, 2.0, 3.0]  # each step once: the killed run's step 2 dropped
    assert resumed == expected
    assert {"reward/mean", "actor/loss", "actor/grad_norm", "eval/accuracy", "eval/pass@1",
            "eval/mean_response_tokens"} <= set(resumed[2])
    assert "eval/accuracy" not in resumed[1]  # every 2 steps
    samples = [json.loads(line) for line in (killed / "samples.jsonl").read_text().splitlines()]
    assert [sample["step"] for sample in samples].count(2) == 4  # step 2's evaluation once
    model = AutoModelForCausalLM.from_pretrained(str(killed / "final"))
    assert model.config.num_hidden_layers >= 1 and (killed / "final" / "tokenizer_config.json").is_file()


@pytest.mark.slow
@pytest.mark.ray
def test_grpo_recipe_on_gsm8k_rows_evaluates_and_exports(tiny_llama_path, tmp_path):
    """The GSM8K recipe of docs/recipes/gsm8k.md on a handful of its rows (tests/fixtures/gsm8k): the built-in
    math-verify reward, the strict and lenient scores of the held-out file, an export that loads."""
    pytest.importorskip("math_verify")
    from transformers import AutoModelForCausalLM

    fixtures = ROOT / "tests" / "fixtures" / "gsm8k"
    out = tmp_path / "gsm8k"
    subprocess.run([sys.executable, str(ROOT / "examples" / "grpo.py"), "--device", "cpu",
                    "--model", str(tiny_llama_path), "--dataset", str(fixtures / "train.jsonl"),
                    "--eval-dataset", str(fixtures / "test.jsonl"), "--input-key", "question", "--label-key", "answer",
                    "--reward", "gsm8k", "--prompt-suffix", " End with: #### <number>", "--steps", "2",
                    "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "4",
                    "--eval-every", "1", "--eval-samples", "0", "--out", str(out), "--export", str(out / "final")],
                   env=os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                                    os.environ.get("PYTHONPATH", "")])},
                   check=True, timeout=600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0.0, 1.0]
    for row in rows:
        assert row["eval/num_prompts"] == 4.0
        assert 0.0 <= row["eval/strict_accuracy"] <= 1.0 and 0.0 <= row["eval/lenient_accuracy"] <= 1.0
        assert row["eval/accuracy"] == row["eval/strict_accuracy"]
        assert "reward/gsm8k/mean" in row
    assert (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
    assert AutoModelForCausalLM.from_pretrained(str(out / "final")).config.num_hidden_layers >= 1
