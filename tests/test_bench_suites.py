"""bench/run.py (``python -m bench SUITE``): every suite's command line parses and lists its steps (CPU, no timing).

Covers the replacement of the 69-stage bench/gpu_session.sh by named suites: a suite whose step names a missing
script, or passes a flag its script does not define, fails here rather than on a GPU machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# bench scripts that run each configuration in a process of its own: its hang guard (a busy 2-core machine starts
# a DeepSpeed process in tens of seconds)
CONFIG_TIMEOUT_S = 300
sys.path.insert(0, str(ROOT))

from bench import run  # noqa: E402

_FLAG = re.compile(r"""["'](--[a-z0-9][a-z0-9-]*)["']""")


def _defined_flags(script: Path) -> set[str]:
    """Every "--flag" literal of the script and of the helpers it shares (bench/peers/workload.py)."""
    sources = [script.read_text()]
    if "add_workload_arguments" in sources[0]:
        sources.append((ROOT / "bench" / "peers" / "workload.py").read_text())
    return {flag for source in sources for flag in _FLAG.findall(source)}


@pytest.mark.parametrize("suite", sorted(run.SUITES))
def test_suite_dry_run_lists_its_steps(suite, tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench", suite, "--dry-run", "--num-gpus", "2", "--results",
                          str(tmp_path / "results"), "--model", str(tmp_path / "no-model")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    listed = [line.split(" ", 1)[0] for line in out.stdout.splitlines()]
    expected = [f"{suite}/{step.name}" for step in run.SUITES[suite]]
    if any(step.needs_model for step in run.SUITES[suite]):
        expected.insert(0, f"{suite}/convert_model")        # the model folder is missing: converted first
    assert listed == expected
    assert not (tmp_path / "results").exists()              # a dry run writes nothing


@pytest.mark.parametrize("suite", sorted(run.SUITES))
def test_suite_steps_name_existing_scripts_and_flags(suite, tmp_path):
    plan = run.plan_suite(suite, num_gpus=8, only=None, model_exists=False)
    for step in plan.steps:
        command = run.expand(step, python="python", results=tmp_path, model="/m", work=tmp_path, num_gpus=2)
        assert "{" not in " ".join(command[2:]) or command[1] == "-c", command   # every placeholder filled
        if command[1] == "-c":
            continue
        script = ROOT / command[1]
        assert script.is_file(), f"{suite}/{step.name}: {command[1]} does not exist"
        flags = _defined_flags(script)  # "--flag=value" names its flag before the "="
        unknown = [a for a in command[2:] if a.startswith("--") and a.split("=", 1)[0] not in flags]
        assert not unknown, f"{suite}/{step.name}: {command[1]} defines no {unknown}"


def test_gpu_count_skips_steps_and_only_picks_steps():
    plan = run.plan_suite("weight_sync", num_gpus=1, only=None, model_exists=True)
    assert [s.name for s in plan.steps] == ["weight_sync_ipc"]
    assert plan.skipped == {"weight_sync_nccl": "needs 2 GPUs, --num-gpus is 1"}
    plan = run.plan_suite("peers", num_gpus=1, only=["peer_trl"], model_exists=True)
    assert [s.name for s in plan.steps] == ["peer_trl"]
    with pytest.raises(ValueError, match=r"--only \['nope'\]: no such step in suite 'peers'"):
        run.plan_suite("peers", num_gpus=1, only=["nope"], model_exists=True)
    with pytest.raises(ValueError, match="suite='gpu_session'"):
        run.plan_suite("gpu_session", num_gpus=1, only=None, model_exists=True)


def test_run_without_results_dir_is_refused():
    out = subprocess.run([sys.executable, "-m", "bench", "vllm", "--num-gpus", "1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--results DIR is required" in out.stderr


def test_run_writes_a_summary_per_suite(tmp_path, monkeypatch):
    """A real (tiny) run: the steps' commands are replaced by quick Python ones; rc, log and summary are written."""
    steps = (run.Step(name="ok", argv=("{python}", "-c", "print('fine')"), timeout_s=30, num_gpus=0),
             run.Step(name="bad", argv=("{python}", "-c", "raise SystemExit(3)"), timeout_s=30, num_gpus=0))
    monkeypatch.setitem(run.SUITES, "demo", steps)
    rc = run.main(["demo", "--results", str(tmp_path), "--num-gpus", "0"])
    assert rc == 1
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert [(s["name"], s["rc"]) for s in summary["steps"]] == [("ok", 0), ("bad", 3)]
    assert (tmp_path / "logs" / "ok.log").read_text().strip() == "fine"
    assert "torch" in summary["environment"]["versions"]
    assert set(summary["environment"]["bytecode"]) == {"writes", "torch_cached"}  # compiled imports or not


def _stand_in_run(commands, *, fail_with=None):
    """A stand-in for bench.hybrid.run_logged: notes the command, writes the example's metrics.jsonl (2 steps; the
    sync bytes say which mode ran) to its --out and returns (0, wall); or, with ``fail_with``, logs that line and
    returns (1, wall) with no metrics."""

    def run_logged(command, log, timeout, env=None):
        commands.append(command)
        out = Path(command[command.index("--out") + 1])
        if fail_with is not None:
            log.write_text(f"starting\n{fail_with}\n")
            return 1, 0.5
        lora = "--lora-rank" in command
        rows = [{"step": step, "time/step_s": 2.0 + step, "time/train_actor_s": 0.5, "time/weight_sync_s": 0.1 * step,
                 "sync/bytes": 1e3 if lora else 1e5, "reward/mean": 0.1 * step} for step in range(2)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        log.write_text("done\n")
        return 0, 1.5

    return run_logged


def test_scale_bench_tiny_builds_the_toy_and_reports_each_mode(tmp_path, monkeypatch):
    """bench/scale.py --tiny (issue 20) with stand-in runs: builds the toy Qwen2 shape (a fresh tokenizer and random
    weights, loadable), gives each mode its command (--example-args last, LoRA's rank), writes per-mode step time,
    phases, sync time and bytes to the JSON it returns, and deletes the model after its runs (no --keep). The
    example itself runs in test_scale_bench_tiny_runs_the_toy_qwen2_through_the_hybrid_on_cpu."""
    from bench import scale

    transformers = pytest.importorskip("transformers")
    commands, built = [], []
    monkeypatch.setattr(scale, "run_logged", _stand_in_run(commands))
    build = scale.build_model_apart
    monkeypatch.setattr(scale, "build_model_apart", lambda *a, **k: built.append(
        transformers.AutoConfig.from_pretrained(build(*a, **k))) or built[-1])
    out = tmp_path / "scale.json"
    result = scale.main(["--tiny", "--steps", "5", "--out", str(out), "--work-dir", str(tmp_path / "work"),
                         "--plan", "actor.keep_optimizer=false"])
    assert json.loads(out.read_text()) == result and result["steps"] == 2 and result["workload"] == scale.TINY_WORKLOAD
    assert (built[0].model_type, built[0].vocab_size, built[0].hidden_size) == ("qwen2", 384, 64)
    runs = result["runs"]["toy"]
    assert all("actor.keep_optimizer=false" in command for command in commands)  # (an A/B's second arm: a plan edit)
    full, lora = commands
    assert "--lora-rank" not in full and lora[lora.index("--lora-rank") + 1] == "4"
    assert full[full.index("--model") + 1] == str(tmp_path / "work" / "toy") and "--device" in full
    for mode in ("full", "lora"):
        assert runs[mode]["returncode"] == 0 and runs[mode]["command"] == " ".join(commands[mode == "lora"])
        assert runs[mode]["steps"] == 2 and runs[mode]["step_s"] == 3.0 and runs[mode]["sync_s"] == 0.1
        assert runs[mode]["median"]["time/train_actor_s"] == 0.5
    assert (runs["full"]["sync_bytes"], runs["lora"]["sync_bytes"]) == (1e5, 1e3)
    assert not (tmp_path / "work" / "toy").exists()  # the model is deleted after its runs (no --keep)


def test_scale_bench_keeps_a_failed_runs_memory_error_and_log_tail(tmp_path, monkeypatch):
    """A run that fails keeps its exit code, the plan's MemoryFitError line and its log's tail; --keep keeps the
    built model and a later command reuses it; without --tiny, --tokenizer is required."""
    from bench import scale

    commands = []
    error = "rlhfkit.hybrid.MemoryFitError: the plan needs 93.1 GiB of an 80 GiB GPU"
    monkeypatch.setattr(scale, "run_logged", _stand_in_run(commands, fail_with=error))
    work = tmp_path / "work"
    result = scale.main(["--tiny", "--modes", "full", "--keep", "--out", str(tmp_path / "a.json"), "--work-dir",
                         str(work)])
    run = result["runs"]["toy"]["full"]
    assert run["returncode"] == 1 and run["error"] == error and run["log_tail"] == ["starting", error]
    assert "steps" not in run and run["sync_s"] is None
    assert (work / "toy" / "config.json").exists()
    monkeypatch.setattr(scale, "build_model_apart", lambda *a, **k: pytest.fail("the kept model was rebuilt"))
    scale.main(["--tiny", "--modes", "lora", "--out", str(tmp_path / "b.json"), "--work-dir", str(work)])
    assert len(commands) == 2 and not (work / "toy").exists()
    with pytest.raises(SystemExit):
        scale.main(["--out", str(tmp_path / "c.json")])  # --tokenizer (or --tiny)


@pytest.mark.slow
@pytest.mark.ray
def test_scale_bench_tiny_runs_the_toy_qwen2_through_the_hybrid_on_cpu(ray_address, tmp_path):
    """bench/scale.py --tiny --modes full: the one hybrid run on CPU of a Qwen2 model (q/k/v biases, untied
    embeddings, a freshly trained tokenizer): examples/grpo_hybrid.py trains it 2 steps and pushes its weights; the
    bench reads the run's own metrics. (LoRA on the Llama: tests/test_hybrid_examples.py.) The run joins the
    session's Ray cluster ($RAY_ADDRESS)."""
    pytest.importorskip("deepspeed")
    from bench import scale

    out = tmp_path / "scale.json"
    result = scale.main(["--tiny", "--modes", "full", "--out", str(out), "--work-dir", str(tmp_path / "work"),
                         "--timeout", "280"])
    run = result["runs"]["toy"]["full"]
    assert run["returncode"] == 0, run.get("log_tail")
    assert run["steps"] == 2 and run["step_s"] > 0 and run["sync_s"] > 0 and run["sync_bytes"] > 0
    assert "time/train_actor_s" in run["median"]


def test_scale_runs_leave_the_layout_to_the_examples_plan():
    """bench/scale.py's runs give the example its workload and LoRA rank and nothing of the layout (the plan picks
    it); an A/B's setting is a plan edit, applied by bench/hybrid.py --run-example before the run starts."""
    from bench import scale
    from bench.hybrid import edit_plan

    command = scale.ours_command(Path("/models/qwen2.5-7b"), "lora", Path("/runs/x"), steps=10, tiny=False,
                                 lora_rank=16)
    assert command[1].endswith("examples/grpo_hybrid.py") and command[command.index("--lora-rank") + 1] == "16"
    edited = scale.ours_command(Path("/models/qwen2.5-7b"), "full", Path("/runs/x"), steps=10, tiny=False,
                                lora_rank=16, plan_edits="*.offload=false engine.memory=0.3")
    assert edited[1].endswith("bench/hybrid.py") and edited[2:5] == ["--run-example", "*.offload=false "
                                                                     "engine.memory=0.3", "--"]
    from rlhfkit.hybrid import EnginePlan, HybridPlan, RolePlan

    plan = HybridPlan(roles={"actor": RolePlan(zero_stage=1), "reference": RolePlan(zero_stage=1)},
                      engine=EnginePlan(sleep_level=2, memory=0.15))
    changed = edit_plan(plan, "*.offload=false actor.micro_batch_tokens=8192 engine.memory=0.3 "
                              "overlap_switches=true engine.kv_cache_tokens=none")
    assert not any(role.offload for role in changed.roles.values()) and changed.overlap_switches
    assert changed.roles["actor"].micro_batch_tokens == 8192 and changed.engine.memory == 0.3


@pytest.mark.slow
@pytest.mark.ray
def test_sglang_bench_runs_its_cpu_sections_against_the_test_server(ray_address, tmp_path):
    """bench/sglang_engine.py --fake (issue 23): the throughput section (an SGLang engine Ray actor and raw requests
    to the same server: the same tokens) and the sync section (rlhfkit.weight_sync over gloo into the engine actor,
    every sync a new version) run on CPU against tests/_fake_sglang, so the script's calls keep working between GPU
    sessions. Each section's process joins the session's Ray cluster ($RAY_ADDRESS)."""
    from bench import sglang_engine

    out = tmp_path / "sglang.json"
    result = sglang_engine.main(["--fake", "--num-prompts", "6", "--max-new-tokens", "5", "--repeats", "2",
                                 "--warmup", "1", "--work", str(tmp_path / "work"), "--out", str(out)])
    sections = json.loads(out.read_text())["sections"]
    assert sections == result["sections"] and set(sections) == {"throughput", "sync"}
    assert sections["throughput"]["ok"] and sections["throughput"]["same_tokens_as_raw"], sections["throughput"]
    assert sections["throughput"]["tokens_per_run"] == 30 and len(sections["throughput"]["pair_ratios"]) == 2
    sync = sections["sync"]
    assert sync["ok"], sync
    assert [s["version"] for s in sync["sglang"]["syncs"]] == [1, 2, 3] and sync["sglang"]["median_s"] > 0
    with pytest.raises(SystemExit):
        sglang_engine.parse_args(["--fake", "--only", "model"])  # needs a GPU
    with pytest.raises(SystemExit):
        sglang_engine.parse_args(["--out", "x.json"])  # --model or --fake


# A stand-in for examples/grpo_async.py: its options, a start-up outside train_step, and 3 steps of metrics rows with
# the keys the example logs (tests/test_grpo_async_example.py checks the real rows carry them).
_ASYNC_EXAMPLE = """
import argparse, json, time
from pathlib import Path

def start():
    time.sleep(0.2)

def train_step(step, mode):
    time.sleep(0.1)
    lagged = 4.0 * (mode == "async" and step > 0)
    return {"staleness/hist_0": 16.0 - lagged, **({"staleness/hist_1": lagged} if lagged else {}),
            "staleness/mean": lagged / 16, "staleness/token_mean": lagged / 32, "staleness/spanning": lagged / 16,
            "time/step_s": 1.0, "time/wait_rollouts_s": 0.25 if mode == "sync" else 0.05, "time/train_actor_s": 0.5,
            "time/forward_s": 0.2, "reward/mean": 0.1 * step, "accuracy": 0.0, "mismatch/kl": lagged * 1e-3,
            "buffer/dropped_groups": 0.0}

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path)
parser.add_argument("--mode")
args, _ = parser.parse_known_args()
start()
args.out.mkdir(parents=True, exist_ok=True)
with (args.out / "metrics.jsonl").open("w") as handle:
    for step in range(3):
        row = train_step(step, args.mode) | {"step": step, "samples": 16.0 * (step + 1),
                                               "samples_per_s": 16.0 if args.mode == "sync" else 20.0}
        handle.write(json.dumps(row) + "\\n")
"""


def test_async_bench_runs_tiny_on_cpu(tmp_path, monkeypatch):
    """bench/async_grpo.py --tiny --profile-driver, with a stand-in for the example (the real one runs in
    tests/test_grpo_async_example.py): both modes run under the driver's stack sampler, the JSON has the throughput,
    curves and staleness the lead reads on the GPU and where the driver's main thread spent its steps, and the PNG is
    written."""
    from bench import async_grpo

    example = tmp_path / "grpo_async.py"
    example.write_text(_ASYNC_EXAMPLE)
    commands, run_logged = [], async_grpo.run_logged

    def stand_in(command, log, timeout, env=None):
        commands.append(command)
        real = str(ROOT / "examples" / "grpo_async.py")
        return run_logged([str(example) if arg == real else arg for arg in command], log, timeout, env)

    monkeypatch.setattr(async_grpo, "run_logged", stand_in)
    out = tmp_path / "async.json"
    result = async_grpo.main(["--tiny", "--profile-driver", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    for mode, command in zip(("sync", "async"), commands, strict=True):
        assert command[command.index("--mode") + 1] == mode and command[-6:-4] == ["--tiny", "true"]
        assert command[1].endswith("driver_profile.py") and str(ROOT / "examples" / "grpo_async.py") in command
        assert result[mode]["steps"] == 3 and result[mode]["samples_per_s_after_first"] == 16.0
        assert result[mode]["curve"]["samples"] == [16.0, 32.0, 48.0]
    assert result["sync"]["staleness_hist"] == {"0": 48.0}
    assert result["async"]["staleness_hist"] == {"0": 40.0, "1": 8.0}
    assert result["async"]["spanning_per_step"] == [0.0, 0.25, 0.25] and not any(result["sync"]["spanning_per_step"])
    assert result["speedup"] == pytest.approx(1.0) and result["speedup_ceiling"] == pytest.approx(1 / 0.75)
    assert (tmp_path / "async.png").stat().st_size > 0
    phases = result["async"]["phases_median"]  # where an async step's time goes
    assert phases == {"time/step_s": 1.0, "time/wait_rollouts_s": 0.05, "time/forward_s": 0.2,
                      "time/train_actor_s": 0.5}
    for mode in ("sync", "async"):  # sampled from the first train_step on: the step's functions are on the stack
        driver = result[mode]["driver_profile_s_per_step"]
        assert driver.get("grpo_async.py:train_step", 0) > 0 and "grpo_async.py:start" not in driver


def test_async_bench_overlap_ceiling():
    """Generation hidden entirely behind training: a 1.0 s sync step that waited 0.2 s for rollouts can at most
    become 0.8 s (1.25x); no wait, or no step, gives no bound."""
    from bench.async_grpo import overlap_ceiling

    assert overlap_ceiling({"step_s_median": 1.0, "wait_rollouts_s_median": 0.2}) == pytest.approx(1.25)
    assert overlap_ceiling({"step_s_median": 1.0, "wait_rollouts_s_median": 1.0}) is None
    assert overlap_ceiling({"returncode": 1}) is None


def test_lora_vllm_bench_tiny_on_cpu(tmp_path):
    """bench/lora_vllm.py --tiny (issue 20 item 5): the adapter push of the GPU check, into the HF engine on CPU: timed
    adapter-only syncs, greedy output equal to the peft and the merged trainer model; and the GPU command's shape."""
    pytest.importorskip("peft")
    from bench import lora_vllm

    out = tmp_path / "lora.json"
    result = lora_vllm.main(["--tiny", "--out", str(out), "--syncs", "2", "--rank", "4", "--adapter-std", "0.3"])
    assert json.loads(out.read_text())["greedy"] == result["greedy"] and "adapter_push_error" not in result
    assert len(result["syncs"]) == 2 and result["sync_s_median"] > 0 and result["engine_version"] == 4
    assert result["syncs"][0]["tensors"] == result["adapter_tensors"] == 2 * 7 * 2  # 2 layers x 7 projections
    greedy = result["greedy"]
    assert all(greedy["vs_peft"]["equal"]) and all(greedy["vs_merged"]["equal"]) and all(greedy["base_floor"]["equal"])
    assert greedy["adapter_changes_output"]  # the check can fail: the adapter moved the greedy tokens
    gap = result["logprob_gap"]  # teacher-forced: the engine computes what the peft model computes, not the base
    assert gap["engine_vs_peft"] < 1e-4 and gap["base_floor"] < 1e-4 and gap["engine_vs_base"] > 1e-2, gap
    with pytest.raises(SystemExit):
        lora_vllm.parse_args(["--arch", "qwen2.5-7b", "--out", "x.json"])  # --arch needs --tokenizer
    built = lora_vllm.parse_args(["--arch", "qwen2.5-7b", "--tokenizer", "/tok", "--out", "x.json"])
    assert built.arch == "qwen2.5-7b" and built.model is None
    gpu = lora_vllm.parse_args(["--model", "/models/qwen7b", "--out", "x.json"])
    assert (gpu.rank, gpu.grpo_steps, gpu.dtype, gpu.tiny) == (16, 3, "bfloat16", False)
    command = lora_vllm.grpo_command(gpu, tmp_path)
    assert command[command.index("--lora-rank") + 1] == "16" and "/models/qwen7b" in command
    with pytest.raises(SystemExit):
        lora_vllm.parse_args(["--out", "x.json"])  # the GPU mode needs --model


def test_a_run_past_its_timeout_is_exit_124_not_a_crash(monkeypatch, tmp_path):
    """bench/hybrid.py and bench/async_grpo.py used to let subprocess.TimeoutExpired escape, losing the whole JSON; every
    bench script now runs its children through run_logged."""
    from bench import hybrid
    from bench.hybrid import read_metrics, run_logged

    # the run ends with `ray stop --force`, which would stop every Ray on this machine (other tests' too): a stand-in
    monkeypatch.setattr(hybrid, "_ray_stop_command", lambda: [sys.executable, "-c", "print('ray stopped')"])
    # the child sleeps far past the timeout: 124 (not its own exit 0) says it was stopped; 5 s lets a busy machine
    # start the interpreter and print first
    code, _ = run_logged([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)"],
                         tmp_path / "run.log", timeout=5.0)
    assert code == 124
    assert "started" in (log := (tmp_path / "run.log").read_text()) and "ray stopped" in log, log
    assert read_metrics(tmp_path) == []


def test_hybrid_bench_summary_carries_the_switch_medians():
    """Issue 18 item 2: bench/hybrid.py's summary puts the median switch/* values (bytes, floor, over_floor) next to
    phase_switch_fraction; the first step (compiles, pins buffers) is left out like the times."""
    from bench.hybrid import summarize

    rows = [{"time/step_s": 9.0, "time/phase_switch_fraction": 0.5, "switch/over_floor": 99.0, "reward/mean": 0.0},
            *({"time/step_s": 1.0, "time/phase_switch_fraction": 0.2, "switch/over_floor": ratio,
               "switch/bytes_d2h": 8.0, "reward/mean": 0.0} for ratio in (3.0, 5.0, 4.0))]
    summary = summarize(rows)
    assert summary["phase_switch_fraction"] == 0.2
    assert summary["switch"] == {"over_floor": 4.0, "bytes_d2h": 8.0}


def test_hybrid_bench_compares_equal_windows_of_two_runs(tmp_path):
    """Both sides run slower for their first ~10 steps, so bench/hybrid.py gives the median step from steps 1, 10 and
    20 on for each side and their ratios; --compare takes them from a --no-peer and a --peer-only run's JSONs."""
    from bench.hybrid import main, step_windows, summarize

    assert step_windows([9.0, 3.0, 1.0]) == {"from_1": 2.0}
    ours_times = [9.0] + [2.0] * 9 + [1.0] * 30
    ours = {"rlhfkit": summarize([{"time/step_s": t, "reward/mean": 0.0} for t in ours_times])}
    assert ours["rlhfkit"]["step_s_windows"] == {"from_1": 1.0, "from_10": 1.0, "from_20": 1.0}
    peer_rows = [{"time/step_s": t} for t in [9.0] + [4.0] * 9 + [2.0] * 30]
    peer = {"trl": {"step_s": 2.0, "rows": peer_rows, "step_s_windows": step_windows([4.0] * 10 + [2.0] * 30)}}
    (tmp_path / "ours.json").write_text(json.dumps(ours))
    (tmp_path / "trl.json").write_text(json.dumps(peer))
    result = main(["--compare", str(tmp_path / "ours.json"), str(tmp_path / "trl.json"), "--out",
                   str(tmp_path / "ratio.json")])
    assert result["ratio_vs_trl"]["step_time_windows"] == {"from_1": 0.5, "from_10": 0.5, "from_20": 0.5}
    assert json.loads((tmp_path / "ratio.json").read_text())["ratio_vs_trl"]["step_time"] == 0.5
    # a longer run of ours (100 steps, the must-show curve) is compared over the 40 steps both sides ran
    longer = {"rlhfkit": summarize([{"time/step_s": t, "reward/mean": 0.0} for t in ours_times + [5.0] * 60])}
    (tmp_path / "ours100.json").write_text(json.dumps(longer))
    result = main(["--compare", str(tmp_path / "ours100.json"), str(tmp_path / "trl.json"), "--out",
                   str(tmp_path / "ratio100.json")])
    assert result["ratio_vs_trl"]["equal_steps"] == 40
    assert result["ratio_vs_trl"]["step_time_windows"] == {"from_1": 0.5, "from_10": 0.5, "from_20": 0.5}
    assert result["ratio_vs_trl"]["step_time"] == 0.5  # over the equal steps too, not the 100 against the 40
    # peak memory: the device-wide NVML peak the bench sampled for each side alike (TRL's own peaks are a dict of
    # its phases without a "device" entry)
    longer["rlhfkit"]["process_memory"] = {"device_peak_gib": 15.0}
    peer["trl"] |= {"process_memory": {"device_peak_gib": 20.0}, "peak_memory_gib": {"step_peak_gib": 19.0}}
    (tmp_path / "ours100.json").write_text(json.dumps(longer))
    (tmp_path / "trl.json").write_text(json.dumps(peer))
    result = main(["--compare", str(tmp_path / "ours100.json"), str(tmp_path / "trl.json"), "--out",
                   str(tmp_path / "ratio100.json")])
    assert result["ratio_vs_trl"]["peak_memory"] == 0.75


def test_peer_trl_deepspeed_configs_for_large_models(monkeypatch, tmp_path):
    """Issue 20 (TRL's largest model on one GPU): the peer's --deepspeed modes give the transformers-trainer DeepSpeed
    config; with the optimizer offloaded DeepSpeed's own AdamW is named (a client torch optimizer is refused then),
    and bench/scale.py passes it, with no reference, for 7B-8B shapes only."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("peer_trl", ROOT / "bench" / "peer_trl.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    assert peer.deepspeed_config("none") is None
    zero3 = peer.deepspeed_config("zero3")
    assert zero3["zero_optimization"]["stage"] == 3 and "offload_optimizer" not in zero3["zero_optimization"]
    offload = peer.deepspeed_config("zero3-offload")
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and offload["optimizer"]["type"]
    assert peer.parse_args(["--model", "M", "--out", "o.json", "--deepspeed", "zero3-offload"]).deepspeed == \
        "zero3-offload"
    with pytest.raises(ValueError, match="--deepspeed 'zero2'"):
        peer.deepspeed_config("zero2")
    import argparse

    from bench import scale

    commands = []
    monkeypatch.setattr(scale, "run_logged", lambda command, log, timeout: (commands.append(command), (1, 0.0))[1])
    args = argparse.Namespace(tiny=False, steps=2, engine_memory=0.35, timeout=10.0)
    for arch in ("qwen2.5-1.5b", "qwen2.5-7b"):
        scale.run_trl(args, tmp_path / arch, tmp_path / f"{arch}.json")
    small, large = commands
    assert "--deepspeed" not in small
    assert large[large.index("--deepspeed") + 1] == "zero3-offload" and large[large.index("--kl-coef") + 1] == "0"
    # LoRA against TRL + peft: the same rank and targets as ours, no DeepSpeed offload and the KL kept (the
    # reference is the base model with the adapters off) even at 7B
    args.lora_rank = 16
    scale.run_trl(args, tmp_path / "qwen2.5-7b", tmp_path / "lora.json", "lora")
    lora = commands[-1]
    assert lora[lora.index("--lora-rank") + 1] == "16" and "--deepspeed" not in lora and "--kl-coef" not in lora
    config = peer.peft_config(peer.parse_args(["--model", "M", "--out", "o.json", "--lora-rank", "16"]))
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (16, 32, sorted(peer.LORA_TARGETS))
    from conftest import load_example

    assert peer.LORA_TARGETS == load_example("grpo_hybrid").LORA_TARGETS  # the same modules on both sides
    assert peer.peft_config(peer.parse_args(["--model", "M", "--out", "o.json"])) is None


def test_train_step_counts_the_operators_a_step_dispatches(tmp_path):
    """bench/train_step.py --arch toy --count-ops: the actor's optimizer step of a scale run's shape (the CPU toy of
    bench/scale.py's architectures), timed in a fresh process per configuration like the GPU runs, and the aten
    operators of one more step (a device-independent count of the host's work), per parameter and micro-batch;
    DeepSpeed's ZeRO-1 (real, on CPU) dispatches more of them than plain torch on the same model and batches (its
    per-parameter gradient bookkeeping)."""
    out, extensions = tmp_path / "ops.json", tmp_path / "torch_extensions"  # an empty JIT cache, as on a fresh clone
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "train_step.py"), "--arch", "toy", "--configs",
                           "zero1_tf32_varlen", "torch_fp32_varlen", "--seqs", "4", "--prompt-len", "12",
                           "--response-len", "6", "--repeats", "1", "--warmup", "1", "--count-ops",
                           "--config-timeout-s", str(CONFIG_TIMEOUT_S), "--out", str(out)],
                          timeout=3 * CONFIG_TIMEOUT_S, capture_output=True, text=True, check=False,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert not [run["error"] for run in runs.values() if "error" in run], runs
    assert result["args"]["arch"] == "toy"
    for run in runs.values():
        assert run["optimizer_step_s"] > 0 and run["tokens"] > 4 * 12, run
    # a configuration's process compiled nothing: DeepSpeed's shared-memory CPU collective, which one process does
    # not use, took a minute to build on an empty cache (past --config-timeout-s on a busy machine)
    assert not list(extensions.glob("**/*.so")), sorted(extensions.rglob("*"))
    ds, plain = runs["zero1_tf32_varlen"]["ops"], runs["torch_fp32_varlen"]["ops"]
    assert ds["num_params"] == plain["num_params"] > 0
    assert plain["dispatched"] > 0 and ds["dispatched"] > plain["dispatched"], (ds, plain)
    assert ds["per_param_per_micro_batch"] == ds["dispatched"] / ds["num_params"] / 2  # --micro's default: 2
    assert {name for name, _ in plain["top"]} >= {"aten.mm"}


def test_train_step_times_a_wake_before_each_step_deferred_or_not(tmp_path):
    """bench/train_step.py --sleep: each timed step of a DeepSpeed configuration starts asleep and wakes (everything
    first, or the optimizer's states behind the micro-batches as the hybrid's worker does); real DeepSpeed on CPU.
    Each mode runs its configuration's process directly (``--one``: the process the script starts per configuration;
    that start is test_train_step_counts_the_operators_a_step_dispatches's)."""
    for mode in ("sync", "deferred"):
        out = tmp_path / f"ts_{mode}.json"
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "train_step.py"), "--one", "zero1_tf32_varlen",
                               "--arch", "toy", "--seqs", "4", "--prompt-len", "12", "--response-len", "6",
                               "--repeats", "2", "--warmup", "0", "--sleep", mode, "--chunk-mib", "1",
                               "--loss-tokens-only", "--out", str(out)],
                              timeout=CONFIG_TIMEOUT_S, capture_output=True, text=True, check=False,
                              env={**os.environ, "DS_ACCELERATOR": "cpu"})
        assert done.returncode == 0, done.stderr[-3000:]
        run = json.loads(out.read_text())
        assert run["config"] == "zero1_tf32_varlen", run
        assert run["sleep"] == mode and run["sleep_s"] > 0 and len(run["optimizer_steps_s"]) == 2, run


def test_cpu_adam_bench_shows_rays_one_thread_and_times_both(tmp_path):
    """bench/cpu_adam.py on CPU: a Ray actor that reserves no CPU gets OMP_NUM_THREADS=1 and one torch thread unless
    its runtime_env sets it (what RolePlan.optimizer_threads does for the trainer ranks); DeepSpeed's CPU Adam
    steps in a fresh process per thread count."""
    out = tmp_path / "cpu_adam.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/cpu_adam.py"), "--params", "1e5", "--steps", "1",
                           "--threads", "1", "2", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ray_actor"]["default"] == {"OMP_NUM_THREADS": "1", "torch_threads": 1}
    cores = str(result["cores"])
    assert result["ray_actor"]["optimizer_threads"] == {"OMP_NUM_THREADS": cores, "torch_threads": int(cores)}
    assert [run["threads"] for run in result["runs"]] == [1, 2]
    assert [run["torch_threads"] for run in result["runs"]] == [1, 2]
    assert all(run["median_step_s"] > 0 for run in result["runs"])
