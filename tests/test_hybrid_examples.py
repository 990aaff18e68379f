"""The hybrid-engine examples (examples/grpo_hybrid.py, examples/ppo_hybrid.py) end to end.

On CPU each example runs its ``main()`` in this process with ``--device cpu --tiny true``: a real local Ray with
logical GPUs (the placement plan, its bundles and fractional GPU shares are real), rlhfkit's HF engine in a Ray actor,
DeepSpeed ZeRO-1 on CPU in one Ray actor per role, gloo weight sync, and the phase guard over a TCP store shared by
every actor. Checked from the files the examples write: every step ran, the engines' weight version rises by one per
step, the engine's and the trainer's log-probs agree (both fp32), and the guarded transitions never leave two roles
awake on one GPU and follow the documented order. The ``gpu`` test runs both with vLLM on one GPU.
"""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest

from conftest import EXAMPLES, load_example


def replay_guard(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Replay the guarded transitions in time order: a role may wake only on a GPU where no other role is awake, or
    where the role it names as ``displaced`` is going to sleep (``overlap_switches``: that role's sleep event may come
    after the wake). Returns each GPU's sequence of (action, role) after start-up."""
    holder: dict[str, str | None] = {}
    sequences: dict[str, list[tuple[str, str]]] = {}
    events = [json.loads(line) for line in path.read_text().splitlines()]
    for event in sorted(events, key=lambda e: e["time"]):
        gpu, role = event["gpu"], event["role"]
        if event["action"] == "wake":
            allowed = (None, role, event.get("displaced"))
            assert holder.get(gpu) in allowed, f"{role} woke on {gpu} while {holder[gpu]} was awake: {event}"
            holder[gpu] = role
        elif holder.get(gpu) == role:
            holder[gpu] = None
        if event["phase"] not in ("load", "startup"):
            sequences.setdefault(gpu, []).append((event["action"], role))
    return sequences


def test_replay_guard_lets_a_wake_displace_only_the_role_it_names(tmp_path):
    """The replay's own rule, on hand-written logs: overlapped switches log the next role's wake (naming the role it
    displaced) before that role's background sleep; any other role still awake is an error."""
    def log(*events):
        path = tmp_path / "phases.jsonl"
        path.write_text("\n".join(json.dumps({"time": t, "action": a, "role": r, "gpu": "g0", "phase": "p",
                                               "displaced": d}) for t, a, r, d in events))
        return path

    ok = log((1, "wake", "critic", None), (2, "wake", "rollout", "critic"), (3, "sleep", "critic", None),
             (4, "sleep", "rollout", None), (5, "wake", "actor", None))
    assert replay_guard(ok)["g0"][-1] == ("wake", "actor")
    with pytest.raises(AssertionError, match="rollout woke on g0 while critic was awake"):
        replay_guard(log((1, "wake", "critic", None), (2, "wake", "rollout", "reference")))


def check_rows(rows: list[dict], steps: int) -> None:
    assert [row["step"] for row in rows] == list(range(steps))
    for row in rows:
        # one push per step: the sender's version and every engine's version go up by one
        assert row["sync/version"] == row["engine/weight_version"] == row["step"] + 1
        # the engine generated with the weights the trainer holds (both fp32 on CPU): log-probs agree
        assert row["engine_vs_trainer/mean_abs_logprob_diff"] < 1e-4, row
        assert row["actor/grad_norm"] > 0 and row["actor/global_step"] == 2 * (row["step"] + 1)
        parts = sum(v for k, v in row.items() if k.startswith("time/") and k.endswith("_s")
                    and k not in ("time/step_s", "time/phase_switch_s", "time/overlapped_sleep_s",
                                  "time/overlapped_wake_s"))
        assert 0 < parts <= row["time/step_s"] + 1e-6, row  # the phases are disjoint parts of the step
        # (sleeps behind the next wake, overlap_switches, and the optimizer states' wake behind the actor's
        # forward-backward run beside the phases: not a part)
        assert row["time/phase_switch_s"] == pytest.approx(row["time/sleep_wake_s"] + row["time/weight_sync_s"])
    assert rows[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6)  # step 0: the policy is the reference
    assert rows[-1]["kl/mean"] > 1e-6  # after training it is not


@pytest.mark.slow
@pytest.mark.ray
def test_grpo_hybrid_on_cpu(ray_address, tiny_llama_path, tmp_path, capsys):
    rows = load_example("grpo_hybrid").main(["--model", str(tiny_llama_path), "--out", str(tmp_path), "--device", "cpu",
                                      "--tiny", "true"])
    check_rows(rows, steps=3)
    # the example prints its plan before it starts: on CPU the layout as configured, the smallest micro-batch budget,
    # nothing kept on the device through the sleeps
    out = capsys.readouterr().out
    assert "hybrid plan (as configured) for unknown GPU" in out
    assert any(line.startswith("actor") and line.split()[4:6] == ["-", "4096"] for line in out.splitlines())
    assert any(line.startswith("reference") and "4096" in line for line in out.splitlines())
    assert all(0.0 <= row["reward/min"] <= row["reward/max"] <= 1.0 for row in rows)
    assert {"time/generate_s", "time/forward_reference_s", "time/train_actor_s", "time/weight_sync_s",
            "time/sleep_wake_s"} <= set(rows[0])
    for row in rows:  # issue 18: the bytes each step's switches copied (the floor needs a GPU's copy rates)
        assert row["switch/bytes_d2h"] > 0 and row["switch/bytes_h2d"] > 0, row
        assert row["switch/bytes_sync"] == row["sync/bytes"] > 0, row
        assert "switch/floor_s" not in row
    one_step = [("sleep", "rollout"), ("wake", "reference"), ("sleep", "reference"), ("wake", "actor"),
                ("sleep", "actor"), ("wake", "rollout"), ("sleep", "actor"), ("wake", "rollout")]
    assert replay_guard(tmp_path / "phases.jsonl") == {"node0/gpu0": [("wake", "rollout")] + one_step * 3}


@pytest.mark.slow
@pytest.mark.ray
def test_grpo_hybrid_with_compiled_layers_on_cpu(ray_address, tiny_llama_path, tmp_path, monkeypatch):
    """Compiled layers (the example's GPU default) in the trainers' Ray workers: the run trains and its trainers'
    log-probs still equal the HF engine's (fp32) at every step, across the sleeps between them."""
    grpo = load_example("grpo_hybrid")
    real = grpo.DeepSpeedEngineConfig
    monkeypatch.setattr(grpo, "DeepSpeedEngineConfig", lambda **fields: real(**(fields | {"compile_layers": True})))
    rows = grpo.main(["--model", str(tiny_llama_path), "--out", str(tmp_path), "--device", "cpu", "--tiny", "true"])
    check_rows(rows, steps=3)


@pytest.mark.slow
@pytest.mark.ray
def test_grpo_hybrid_with_the_engines_on_gpus_of_their_own_on_cpu(ray_address, tiny_llama_path, tmp_path):
    """Issue 24's separated layout in the example (--engine-gpus): 2 logical GPUs for the trainers (2 actor ranks and
    the reference), 1 for the engine, which never sleeps; rank 0 broadcasts the weights (gloo here, NCCL on GPUs)
    and the engine generates with them: its weight version follows every push."""
    rows = load_example("grpo_hybrid").main(["--model", str(tiny_llama_path), "--out", str(tmp_path), "--device", "cpu",
                                             "--tiny", "true", "--num-gpus", "3", "--engine-gpus", "1"])
    check_rows(rows, steps=3)
    assert [row["engine/weight_version"] for row in rows] == [1.0, 2.0, 3.0]
    assert all(row["sync/bytes"] > 0 for row in rows)
    events = [json.loads(line) for line in (tmp_path / "phases.jsonl").read_text().splitlines()]
    assert not [event for event in events if event["role"] == "rollout" and event["action"] == "sleep"]
    assert {event["gpu"] for event in events if event["role"] == "actor"} == {"node0/gpu0", "node0/gpu1"}


@pytest.mark.slow
@pytest.mark.ray
def test_grpo_hybrid_with_lora_on_cpu(ray_address, tiny_llama_path, tmp_path):
    """Issue 20: the example's --lora-rank trains adapters only and pushes only them (a few KiB a step, versions
    follow), with the engine's log-probs equal to the trainer's after every push."""
    pytest.importorskip("peft")
    rows = load_example("grpo_hybrid").main(["--model", str(tiny_llama_path), "--out", str(tmp_path), "--device", "cpu",
                                      "--tiny", "true", "--lora-rank", "4"])
    check_rows(rows, steps=3)
    # r * (in + out) per module: q 64+64, k 64+32, v 64+32, o 64+64, gate 64+128, up 64+128, down 128+64
    adapter = 2 * 4 * 4 * 1024  # 2 layers, rank 4, fp32
    assert all(row["sync/bytes"] == adapter for row in rows)
    # no reference model: the KL is to the actor's base, its adapters switched off for that forward
    assert all("time/forward_reference_s" in row and row["kl/mean"] >= 0 for row in rows)
    assert "reference" not in {role for _, role in replay_guard(tmp_path / "phases.jsonl")["node0/gpu0"]}


@pytest.mark.slow
@pytest.mark.ray
def test_ppo_hybrid_on_cpu(ray_address, tiny_llama_path, tmp_path):
    rows = load_example("ppo_hybrid").main(["--model", str(tiny_llama_path), "--out", str(tmp_path), "--device", "cpu",
                                     "--tiny", "true"])
    check_rows(rows, steps=3)
    for row in rows:
        assert row["critic/loss"] > 0 and "critic/explained_variance" in row and row["critic/grad_norm"] > 0
        assert {"time/forward_reward_s", "time/forward_critic_s", "time/train_critic_s"} <= set(row)
    one_step = [("sleep", "rollout"), ("wake", "reward"), ("sleep", "reward"), ("wake", "reference"),
                ("sleep", "reference"), ("wake", "critic"), ("sleep", "critic"), ("wake", "actor"), ("sleep", "actor"),
                ("wake", "critic"), ("sleep", "critic"), ("wake", "rollout"), ("sleep", "actor"), ("wake", "rollout")]
    assert replay_guard(tmp_path / "phases.jsonl") == {"node0/gpu0": [("wake", "rollout")] + one_step * 3}


@pytest.mark.slow
@pytest.mark.ray
def test_ppo_hybrid_on_cpu_with_overlapped_switches(ray_address, tiny_llama_path, tmp_path, monkeypatch):
    """All four trainer roles with the plan's ``overlap_switches`` on (the GPU default where the estimate fits; on CPU
    off unless the plan is edited): every role's sleep runs behind the next wake, the loop trains and the guard's log
    replays."""
    example = load_example("ppo_hybrid")
    start = example.Hybrid.start
    monkeypatch.setattr(example.Hybrid, "start", lambda config, trainers, plan: start(
        config, trainers, plan=dataclasses.replace(plan, overlap_switches=True)))
    rows = example.main(["--model", str(tiny_llama_path), "--out", str(tmp_path), "--device", "cpu", "--tiny", "true"])
    check_rows(rows, steps=3)
    for row in rows:
        assert row["time/overlapped_sleep_s"] > 0 and row["critic/loss"] > 0 and row["critic/grad_norm"] > 0
    replay_guard(tmp_path / "phases.jsonl")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("example", ["grpo_hybrid", "ppo_hybrid"])
def test_hybrid_example_on_one_gpu_with_vllm(example, ray_not_started, tiny_model_factory, tmp_path):
    """The real thing, small: vLLM with sleep mode, DeepSpeed with FusedAdam, CUDA-IPC push, all on one GPU."""
    pytest.importorskip("vllm")
    model = tiny_model_factory("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    rows = load_example(example).main(["--model", str(model), "--out", str(tmp_path), "--tiny", "true"])
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["sync/version"] == row["engine/weight_version"] == row["step"] + 1
        assert row["engine_vs_trainer/mean_abs_logprob_diff"] < 0.01, row
        assert row["mem/generate_peak_gib"] > 0 and row["time/phase_switch_s"] > 0
    replay_guard(tmp_path / "phases.jsonl")


@pytest.mark.gpu
@pytest.mark.slow
def test_the_docs_hybrid_script_on_one_gpu_with_vllm(ray_not_started, tiny_model_factory, tmp_path, monkeypatch):
    """Issue 18 item 4: docs/hybrid.md's complete script, as written, called the way the page says for a GPU
    (``train(model=..., device="cuda", ...)``): vLLM, DeepSpeed with FusedAdam, the CUDA-IPC push, on one GPU."""
    pytest.importorskip("vllm")
    from test_doc_snippets import python_blocks

    block = next(block for block in python_blocks(EXAMPLES.parent / "docs" / "hybrid.md") if "def train(" in block.code)
    definitions = block.code.split("\nrows = train()")[0]  # the page's own CPU run and its checks are left out
    namespace: dict = {}
    monkeypatch.chdir(tmp_path)
    exec(compile(definitions, "docs/hybrid.md", "exec"), namespace)  # noqa: S102 - the page's code is the test
    model = tiny_model_factory("llama", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    rows = namespace["train"](model=str(model), device="cuda", steps=3, out=str(tmp_path / "run"))
    assert [row["engine/weight_version"] for row in rows] == [1.0, 2.0, 3.0]
    assert all(row["time/phase_switch_s"] > 0 and row["mem/generate_peak_gib"] > 0 for row in rows)


def test_options_refuse_bad_values_before_anything_starts(capsys):
    grpo = load_example("grpo_hybrid")
    with pytest.raises(SystemExit):
        grpo.main(["--tiny", "maybe"])
    assert "expected true or false, got 'maybe'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        grpo.main(["--steps", "many"])
    assert "--steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        grpo.main(["--help"])
    help_text = capsys.readouterr().out
    for field in dataclasses.fields(grpo.Options):  # every option says what it is for
        assert field.metadata.get("help"), field.name
    assert len(dataclasses.fields(grpo.Options)) <= 18 and "--kl-coef" in help_text


def test_examples_are_single_files_of_at_most_250_lines():
    assert not list(EXAMPLES.glob("_*.py"))
    for name in ("grpo_hybrid.py", "ppo_hybrid.py"):
        assert len((EXAMPLES / name).read_text().splitlines()) <= 250, name


@pytest.mark.parametrize(("argv", "compiled"), [
    (["--device", "cuda"], True),  # the GPU default: bf16 ZeRO-1, full parameters
    (["--device", "cuda", "--lora-rank", "8"], False),  # not measured with adapters
    (["--device", "cpu"], False),  # CPU smoke runs would spend their time compiling
])
def test_grpo_hybrid_compiles_the_trainers_layers_by_default_on_a_gpu(argv, compiled, tmp_path):
    """The example's compiled layers: on for a full-parameter run on a GPU, off on CPU and with LoRA. Read from the
    configs the example plans and starts (nothing starts here); the plan turns them off where it picks ZeRO-3."""
    from rlhfkit.options import parse_options

    grpo = load_example("grpo_hybrid")
    _, trainers = grpo.configs(parse_options(grpo.Options, [*argv, "--out", str(tmp_path)]))
    assert {trainer.deepspeed.compile_layers for trainer in trainers.values()} == {compiled}
