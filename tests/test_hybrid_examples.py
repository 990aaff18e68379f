"""The hybrid-engine examples (examples/grpo_hybrid.py, examples/ppo_hybrid.py) end to end on CPU.

Each test runs an example's ``main()`` in this process with ``--engine hf --device cpu --tiny``: a real local Ray
with logical GPUs (so the placement plan, its bundles and fractional GPU shares are real), rlhfkit's HF engine in a
Ray actor, DeepSpeed ZeRO-3 on CPU with torch AdamW in one Ray actor per role and rank, gloo weight sync, and the
phase guard over a TCP store shared by every actor. Checked from the files the examples write: every step ran, the
engines' weight version rises by one per step, the engine's and the trainer's log-probs agree after every sync
(both fp32), the guarded transitions never leave two roles awake on one GPU and follow the documented order, and
data-parallel training on two ranks matches one rank. Each run spends most of its ≈ 35 s starting processes
(imports of torch, transformers and DeepSpeed on 2 cores), hence ``slow``; the file takes ≈ 110 s on 2 idle cores.
The ``gpu`` test runs both examples with vLLM, FusedAdam and CUDA IPC on one GPU (a tiny model).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CPU = ["--engine", "hf", "--device", "cpu", "--tiny", "--start-timeout", "300", "--call-timeout", "120",
       "--sync-timeout", "60"]
LOGICAL_GPUS = 3


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    pytest.importorskip("deepspeed")
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, num_gpus=LOGICAL_GPUS, include_dashboard=False, object_store_memory=256 * 1024**2,
                 log_to_driver=False)
    elif ray.cluster_resources().get("GPU", 0) < LOGICAL_GPUS:
        pytest.skip(f"a Ray cluster with fewer than {LOGICAL_GPUS} (logical) GPUs is already running")
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def own_ray():
    """The example starts its own Ray, which sees the real GPUs (a cluster of logical GPUs would mislead it)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    yield


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()]


def _replay_guard(events: list[dict]) -> dict[str, list[tuple[str, str]]]:
    """Replay the guarded transitions in time order: a role may wake only on a GPU where no other role is awake.
    Returns each GPU's sequence of (action, role) after start-up."""
    holder: dict[str, str | None] = {}
    sequences: dict[str, list[tuple[str, str]]] = {}
    for event in sorted(events, key=lambda e: e["time"]):
        gpu, role = event["gpu"], event["role"]
        if event["action"] == "wake":
            assert holder.get(gpu) in (None, role), f"{role} woke on {gpu} while {holder[gpu]} was awake: {event}"
            holder[gpu] = role
        elif holder.get(gpu) == role:
            holder[gpu] = None
        if event["phase"] not in ("load", "startup"):
            sequences.setdefault(gpu, []).append((event["action"], role))
    return sequences


def _check_common(out: Path, summary: dict, steps: int) -> list[dict]:
    rows = _rows(out)
    assert [row["step"] for row in rows] == list(range(steps)) and summary["steps"] == steps
    for row in rows:
        # one sync per step: the sender's version and every engine's version go up by one
        assert row["sync/version"] == row["engine/weight_version"] == row["step"] + 1
        # the engine generated with the weights the trainer holds (both fp32): log-probs agree after every sync
        assert row["engine_vs_trainer/mean_abs_logprob_diff"] < 1e-5, row
        assert row["engine_vs_trainer/max_abs_logprob_diff"] < 1e-4, row
        assert row["actor/grad_norm"] > 0
        parts = sum(row[k] for k in row if k.startswith("time/") and k.endswith("_s") and k.count("/") == 1
                    and k not in ("time/step_s", "time/experience_forwards_s", "time/training_s",
                                  "time/phase_switch_s"))
        assert 0 < parts <= row["time/step_s"] + 1e-6, row  # the phases are disjoint parts of the step
        assert row["time/phase_switch_s"] == pytest.approx(row["time/sleep_wake_s"] + row["time/weight_sync_s"])
    assert rows[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6)  # step 0: the policy is the reference
    assert rows[-1]["kl/mean"] > 1e-6                         # after training it is not
    return rows


@pytest.fixture(scope="module")
def grpo_one_rank(ray_cluster, tiny_llama_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-colocated")
    summary = _load("grpo_hybrid").main(["--model", str(tiny_llama_path), "--out", str(out), *CPU,
                                         "--minibatches", "1", "--grad-accum", "2"])
    return out, summary


@pytest.mark.slow
@pytest.mark.ray
def test_grpo_hybrid_colocated_on_cpu(grpo_one_rank):
    out, summary = grpo_one_rank
    rows = _check_common(out, summary, steps=3)
    assert summary["startup"]["guard_refused_wrong_order"] is True
    assert all(0.0 <= row["reward/min"] <= row["reward/max"] <= 1.0 for row in rows)  # the graded rule, in [0, 1]
    assert (out / "curve.png").stat().st_size > 1000 and (out / "summary.json").exists()
    assert {"time/generate_s", "time/forward_reference_s", "time/forward_actor_s", "time/train_actor_s",
            "time/weight_sync_s", "time/sleep_wake_s"} <= set(rows[0])
    # the order docs/hybrid.md gives, on the one GPU every role shares
    sequences = _replay_guard(_events(out))
    assert list(sequences) == ["node0/gpu0"]
    first_wake = [("wake", "rollout")]  # the start-up check left the engine awake for step 0
    one_step = [("sleep", "rollout"), ("wake", "reference"), ("sleep", "reference"), ("wake", "actor"),
                ("sleep", "actor"), ("wake", "rollout"), ("sleep", "actor"), ("wake", "rollout")]
    assert sequences["node0/gpu0"] == first_wake + one_step * 3


@pytest.mark.slow
@pytest.mark.ray
def test_grpo_two_data_parallel_ranks_match_one(grpo_one_rank, ray_cluster, tiny_llama_path, tmp_path):
    """Engine on its own logical GPU (broadcast sync, the engine armed before each: the first sync joins the gloo
    group from the engine's waiting thread), actor and reference on two ranks each: with one minibatch per step the
    two ranks' summed gradients are the whole batch's, so losses, gradient norms and the next step's KL equal the
    single-rank run's."""
    one_rank_out, _ = grpo_one_rank
    summary = _load("grpo_hybrid").main(["--model", str(tiny_llama_path), "--out", str(tmp_path), *CPU,
                                         "--minibatches", "1", "--grad-accum", "2", "--steps", "2", "--no-plot",
                                         "--num-gpus", "3", "--colocate", "false", "--engine-gpus", "1",
                                         "--sync-mode", "armed"])
    rows = _check_common(tmp_path, summary, steps=2)
    assert summary["startup"]["guard_refused_wrong_order"] is False  # the engine does not share a GPU
    single = _rows(one_rank_out)[:2]
    for two, one in zip(rows, single, strict=True):
        assert two["reward/mean"] == one["reward/mean"]  # same engine, same seeds: the same rollouts
        for key in ("actor/loss", "actor/grad_norm", "kl/mean"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
    assert single[0]["actor/loss"] != single[1]["actor/loss"]  # the comparison is not vacuous
    sequences = _replay_guard(_events(tmp_path))
    assert sorted(sequences) == ["node0/gpu0", "node0/gpu1"]  # the engine's GPU (2) sees no guarded transition
    for gpu in sequences:
        assert set(sequences[gpu]) == {("wake", "reference"), ("sleep", "reference"), ("wake", "actor"),
                                       ("sleep", "actor")}


@pytest.mark.slow
@pytest.mark.ray
def test_ppo_hybrid_colocated_on_cpu(ray_cluster, tiny_llama_path, tmp_path):
    summary = _load("ppo_hybrid").main(["--model", str(tiny_llama_path), "--out", str(tmp_path), *CPU,
                                        "--no-plot"])
    rows = _check_common(tmp_path, summary, steps=3)
    assert summary["startup"]["guard_refused_wrong_order"] is True
    for row in rows:
        assert 0.0 <= row["reward/rule_mean"] <= 1.0
        assert row["critic/loss"] > 0 and "critic/explained_variance" in row
        assert row["reward/model_std"] > 0  # the (untrained) reward model scores samples differently
        # the reward is the rule-based score plus 0.1 x the reward model's score
        assert row["reward/mean"] == pytest.approx(row["reward/rule_mean"] + 0.1 * row["reward/model_mean"],
                                                   abs=1e-5)
        assert {"time/forward_reward_s", "time/forward_critic_s", "time/train_critic_s"} <= set(row)
    one_step = [("sleep", "rollout"), ("wake", "reward"), ("sleep", "reward"), ("wake", "reference"),
                ("sleep", "reference"), ("wake", "critic"), ("sleep", "critic"), ("wake", "actor"), ("sleep", "actor"),
                ("wake", "critic"), ("sleep", "critic"), ("wake", "rollout"), ("sleep", "actor"), ("wake", "rollout")]
    assert _replay_guard(_events(tmp_path)) == {"node0/gpu0": [("wake", "rollout")] + one_step * 3}


@pytest.mark.slow
@pytest.mark.ray
def test_grpo_hybrid_resident_trainers_zero2_on_cpu(grpo_one_rank, ray_cluster, tiny_llama_path, tmp_path):
    """--offload-trainers false and --engine-sleep-level 0: the guard still orders every phase, the trainers' sleep
    only empties the cache and the engine keeps everything; with ZeRO-2 the same seeds give the same first step as
    the ZeRO-3 run that offloads. With --old-logprobs engine the actor's forward is skipped (the engine's log-probs
    are the behaviour policy's) and the mismatch is measured on the first minibatch's training forward instead.
    With --sync-mode armed the engine waits for each sync from its wake-up call: the sync is the actor's send."""
    summary = _load("grpo_hybrid").main(["--model", str(tiny_llama_path), "--out", str(tmp_path), *CPU,
                                         "--minibatches", "1", "--grad-accum", "2", "--steps", "2", "--no-plot",
                                         "--zero-stage", "2", "--offload-trainers", "false",
                                         "--engine-sleep-level", "0", "--old-logprobs", "engine",
                                         "--sync-mode", "armed"])
    rows = _check_common(tmp_path, summary, steps=2)
    one_rows = _rows(grpo_one_rank[0])
    one = one_rows[0]
    assert rows[0]["reward/mean"] == one["reward/mean"]
    assert rows[0]["actor/loss"] == pytest.approx(one["actor/loss"], rel=1e-4, abs=1e-7)
    for row, reference in zip(rows, one_rows, strict=False):
        assert "time/forward_actor_s" not in row and "time/forward_actor_s" in reference
        # the same quantity both ways (engine vs trainer log-probs with the engine's weights), from the training
        # forward here and from the old-log-prob forward there: HF engine and trainer agree to float32 rounding
        assert row["engine_vs_trainer/mean_abs_logprob_diff"] < 1e-3
        assert row["engine_vs_trainer/max_abs_logprob_diff"] >= row["engine_vs_trainer/mean_abs_logprob_diff"]
    one_step = [("sleep", "rollout"), ("wake", "reference"), ("sleep", "reference"), ("wake", "actor"),
                ("sleep", "actor"), ("wake", "rollout"), ("sleep", "actor"), ("wake", "rollout")]
    assert _replay_guard(_events(tmp_path)) == {"node0/gpu0": [("wake", "rollout")] + one_step * 2}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("example, extra", [
    ("grpo_hybrid", []), ("ppo_hybrid", []),
    ("grpo_hybrid", ["--zero-stage", "2", "--offload-trainers", "false"]),  # zero-copy CUDA-IPC sync from ZeRO-2
    ("grpo_hybrid", ["--zero-stage", "2", "--offload-trainers", "false", "--engine-sleep-level", "0"]),
    ("grpo_hybrid", ["--zero-stage", "2", "--offload-trainers", "false", "--engine-sleep-level", "0",
                     "--old-logprobs", "engine"]),
    ("grpo_hybrid", ["--zero-stage", "2", "--offload-trainers", "false", "--engine-sleep-level", "0",
                     "--old-logprobs", "engine", "--sync-mode", "armed"]),
    ("grpo_hybrid", ["--sync-mode", "armed"]),  # ZeRO-3, engine at sleep level 2: armed when its weights wake
    ("grpo_hybrid", ["--zero-stage", "0", "--offload-trainers", "false", "--engine-sleep-level", "0",
                     "--old-logprobs", "engine", "--sync-mode", "armed", "--weight-loading", "planned",
                     "--tf32", "backward,reference"]),  # the benchmark's configuration
], ids=["grpo", "ppo", "grpo-zero2-resident", "grpo-zero2-all-resident", "grpo-engine-old-logprobs", "grpo-armed",
        "grpo-zero3-armed", "grpo-zero0-bench"])
def test_hybrid_example_on_one_gpu_with_vllm(example, extra, own_ray, tiny_model_factory, tmp_path):
    """The real thing on one GPU, small: vLLM engine with sleep mode, DeepSpeed ZeRO-3 (fp32, the default --dtype) with
    FusedAdam, CUDA-IPC sync, everything colocated (a tiny Llama with head_dim 64, which vLLM's kernels accept)."""
    pytest.importorskip("vllm")
    model = tiny_model_factory("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    summary = _load(example).main(["--model", str(model), "--out", str(tmp_path), "--tiny", "--no-plot",
                                   "--gpu-memory-utilization", "0.3", "--enforce-eager", *extra])
    rows = _rows(tmp_path)
    assert [row["step"] for row in rows] == [0, 1, 2] and summary["startup"]["guard_refused_wrong_order"]
    for row in rows:
        assert row["sync/version"] == row["engine/weight_version"] == row["step"] + 1
        assert row["engine_vs_trainer/mean_abs_logprob_diff"] < 0.01, row  # fp32 engine vs fp32 trainer
        assert row["mem/generate_peak_gib"] > 0 and row["time/phase_switch_s"] > 0
    _replay_guard(_events(tmp_path))


def test_bad_combinations_are_refused_before_anything_starts(capsys):
    grpo = _load("grpo_hybrid")
    for argv, message in ([["--device", "cpu"], "--device cpu needs --engine hf"],
                          [["--engine", "hf", "--device", "cpu", "--tensor-parallel-size", "2"],
                           "--tensor-parallel-size 2 needs --colocate false"],
                          [["--engine", "hf", "--device", "cpu", "--colocate", "false", "--num-gpus", "1"],
                           "--colocate false needs 0 < --engine-gpus < 1 GPUs"],
                          [["--model", "x", "--colocate", "maybe"], "expected true or false"],
                          [["--model", "x", "--tf32", "backward,forward"], "--tf32 'backward,forward': expected"]):
        with pytest.raises(SystemExit):
            grpo.parse_args(argv)
        assert message in capsys.readouterr().err


def test_tf32_scopes_per_role():
    common = _load("_hybrid_common")
    assert common.parse_tf32("reference, backward") == "backward,reference"
    assert [common.parse_tf32(text) for text in ("off", "all", "backward")] == ["off", "all", "backward"]
    roles = ("actor", "critic", "reference", "reward")
    assert [common.role_tf32("backward,reference", r) for r in roles] == ["backward", "backward", "all", "all"]
    assert [common.role_tf32("reference", r) for r in roles] == ["off", "off", "all", "all"]
    assert [common.role_tf32("backward", r) for r in roles] == ["backward", "backward", "off", "off"]
    assert {common.role_tf32(text, r) for text in ("off",) for r in roles} == {"off"}
    assert {common.role_tf32(text, r) for text in ("all",) for r in roles} == {"all"}


def test_benchmark_harness_presets_are_valid_example_options(tmp_path):
    """bench/hybrid.py: a preset's options come first, --extra's next, the run's own last (argparse keeps the last),
    the per-GPU-batch run doubles the final --rollout-batch, and every preset parses as grpo_hybrid options."""
    spec = importlib.util.spec_from_file_location("hybrid_bench", EXAMPLES.parent / "bench" / "hybrid.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    args = SimpleNamespace(extra="--rollout-batch 8", model="/m", preset="round9")
    argv = harness.run_argv(harness.RUNS["2gpu"]["grpo_2gpu_per_gpu_batch"][1], args)
    assert argv[-6:] == ["--model", "/m", "--num-gpus", "2", "--rollout-batch", "16"]
    assert argv.index("--zero-stage") < argv.index("--rollout-batch", argv.index("--zero-stage"))
    grpo = _load("grpo_hybrid")
    for name in harness.PRESETS:
        parsed = grpo.parse_args(["--model", "x", "--out", str(tmp_path), *harness.PRESETS[name].split()])
        if name == "round9":
            assert (parsed.zero_stage, parsed.tf32, parsed.sync_mode) == (0, "backward,reference", "armed")
