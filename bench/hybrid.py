"""Benchmark harness of the hybrid-engine examples: runs examples/grpo_hybrid.py and examples/ppo_hybrid.py for a few
steps in the layouts a device kind allows, each in a fresh process (its own Ray), and collects the per-step timing
breakdown, the phase-switch overhead, throughput, peak GPU memory per phase and the engine-vs-trainer log-prob
mismatch into one JSON. One command per device kind:

    python bench/hybrid.py --kind h100     --model /tmp/smollm2-hf --out hybrid-h100.json      # 1 GPU
    python bench/hybrid.py --kind h200     --model /tmp/smollm2-hf --out hybrid-h200.json      # 1 GPU
    python bench/hybrid.py --kind h200-x2  --model /tmp/smollm2-hf --out hybrid-h200x2.json    # 2 GPUs
    python bench/hybrid.py --kind cpu      --out hybrid-cpu.json                                # plumbing, logical GPUs
    python bench/hybrid.py --summarize runs/grpo100 --out grpo100.json    # summarise a run dir (+ its curve.png)

Runs per kind (``--runs a,b`` picks a subset, ``--list`` shows them): 1 GPU: GRPO and PPO, everything colocated.
2 GPUs: GRPO on 1 GPU (the scaling baseline), GRPO on 2 GPUs colocated (2 engines, DP 2, CUDA IPC) with the same
global batch and with twice the prompts (the same batch per GPU), GRPO with the engine on its own GPU (NCCL sync);
``ppo_2gpu`` on request. Runs go one after another, so none shares the host with another (a host-bound step slows
down beside a second run). ``--preset round9`` runs round 9's benchmark configuration (docs/benchmarks.md), and
``--extra "..."`` adds arguments to every run:

    python bench/hybrid.py --kind h200-x2 --preset round9 --steps 16 --out scaling.json

The JSON is rewritten after every
run, so a harness cut short still leaves the runs it finished. A missing ``--model`` folder is converted from the
SmolLM2 GGUF first (examples/convert_smollm2.py). Step statistics are medians over the steps after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3

# name -> (example script, its arguments); "{model}" is filled in
RUNS = {
    "cpu": {
        "grpo_1gpu": ("grpo_hybrid", ["--engine", "hf", "--device", "cpu", "--tiny", "--steps", "5"]),
        "ppo_1gpu": ("ppo_hybrid", ["--engine", "hf", "--device", "cpu", "--tiny", "--steps", "5"]),
        "grpo_2gpu_separate": ("grpo_hybrid", ["--engine", "hf", "--device", "cpu", "--tiny", "--steps", "5",
                                               "--num-gpus", "2", "--colocate", "false"]),
        "grpo_2gpu_per_gpu_batch": ("grpo_hybrid", ["--engine", "hf", "--device", "cpu", "--tiny", "--steps", "5",
                                                    "--num-gpus", "2", "--rollout-batch", "8"]),  # (--tiny: 4)
    },
    "1gpu": {
        "grpo_1gpu": ("grpo_hybrid", ["--model", "{model}"]),
        "ppo_1gpu": ("ppo_hybrid", ["--model", "{model}"]),
    },
    "2gpu": {
        "grpo_1gpu": ("grpo_hybrid", ["--model", "{model}", "--num-gpus", "1"]),
        "grpo_2gpu_colocated": ("grpo_hybrid", ["--model", "{model}", "--num-gpus", "2"]),
        # twice the prompts: each GPU has the batch of grpo_1gpu
        "grpo_2gpu_per_gpu_batch": ("grpo_hybrid", ["--model", "{model}", "--num-gpus", "2",
                                                    "--rollout-batch", "{rollout_batch_x2}"]),
        "grpo_2gpu_separate": ("grpo_hybrid", ["--model", "{model}", "--num-gpus", "2", "--colocate", "false"]),
        "ppo_2gpu": ("ppo_hybrid", ["--model", "{model}", "--num-gpus", "2"]),
    },
}
# --preset: the example options of a measured configuration, before --extra and the run's own
PRESETS = {
    "default": "",  # the examples' defaults (ZeRO-3, offloading, engine sleeping at level 2)
    # round 9's benchmark configuration (docs/benchmarks.md): everything resident, armed sync, the engine's log-probs
    # as the old ones, ZeRO-0, TF32 only in the actor's backward and the reference's forward
    "round9": "--rollout-batch 16 --samples-per-prompt 8 --max-new-tokens 64 --lr 1e-5 --zero-stage 0 "
              "--offload-trainers false --attn varlen --weight-loading planned --grad-accum 1 --engine-sleep-level 0 "
              "--old-logprobs engine --sync-mode armed --tf32 backward,reference",
}
KINDS = {"cpu": ("cpu", ["grpo_1gpu", "ppo_1gpu"]), "h100": ("1gpu", ["grpo_1gpu", "ppo_1gpu"]),
         "h200": ("1gpu", ["grpo_1gpu", "ppo_1gpu"]),
         "h200-x2": ("2gpu", ["grpo_1gpu", "grpo_2gpu_colocated", "grpo_2gpu_per_gpu_batch", "grpo_2gpu_separate"])}
DEFAULT_ROLLOUT_BATCH = 32  # examples/_hybrid_common.py's --rollout-batch
PARTS = ("generate", "reward", "experience_forwards", "experience", "training", "sleep_wake", "weight_sync")


def environment() -> dict:
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
            "host": platform.node()}
    for package in ("torch", "vllm", "deepspeed", "ray", "transformers"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = None
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        info["gpus"] = subprocess.run(query, capture_output=True, text=True, timeout=30,
                                      check=False).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    return info


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize_run(out: Path, *, warmup: int) -> dict:
    """Medians of the per-step metrics (after ``warmup`` steps), peaks of memory, and the learning signals."""
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not rows:
        return {"steps": 0}
    timed = rows[warmup:] if len(rows) > warmup else rows[-1:]
    med = lambda key: _median([row[key] for row in timed if key in row])  # noqa: E731
    step = med("time/step_s")
    result = {
        "steps": len(rows), "timed_steps": len(timed), "step_s": step,
        "breakdown_s": {part: med(f"time/{part}_s") for part in PARTS if med(f"time/{part}_s") is not None},
        "phase_switch_fraction": med("time/phase_switch_fraction"),
        "generated_tokens_per_s": med("tokens/per_s"), "generated_tokens_per_step": med("tokens/generated"),
        "samples_per_s": (rows[0]["num_seqs"] / step) if step else None,
        "mismatch_mean_abs": {"median": med("engine_vs_trainer/mean_abs_logprob_diff"),
                              "max": max(row["engine_vs_trainer/mean_abs_logprob_diff"] for row in rows)},
        "reward": {"first": rows[0]["reward/mean"], "last": rows[-1]["reward/mean"],
                   "max_abs_kl": max(abs(row.get("kl/mean", 0.0)) for row in rows)},
        "peak_memory_gib": {key.removeprefix("mem/"): max(row.get(key, 0.0) for row in rows)
                            for key in sorted({k for row in rows for k in row if k.startswith("mem/")})},
        "peak_process_memory_gib": {
            key.removeprefix("mem_process/"): max(row.get(key, 0.0) for row in rows)
            for key in sorted({k for row in rows for k in row if k.startswith("mem_process/")})},
        "weight_sync_bytes": rows[-1].get("sync/bytes"),
    }
    summary_path = out / "summary.json"
    if summary_path.exists():
        result["startup"] = json.loads(summary_path.read_text()).get("startup")
    return result


def run_argv(argv: list[str], args) -> list[str]:
    """A run's example arguments: the preset's, then ``--extra`` (later ones win where both set an option; the run's
    own win over both), placeholders filled in."""
    extra = shlex.split(PRESETS[getattr(args, "preset", "default")]) + shlex.split(args.extra or "")
    rollout = DEFAULT_ROLLOUT_BATCH
    for flag, value in zip(extra, extra[1:]):
        if flag == "--rollout-batch":
            rollout = int(value)
    fill = {"{model}": args.model, "{rollout_batch_x2}": str(2 * rollout)}
    return extra + [fill.get(a, a) for a in argv]


def run_one(name: str, script: str, argv: list[str], args, results_dir: Path) -> dict:
    out = results_dir / name
    command = [sys.executable, str(REPO / "examples" / f"{script}.py"), *argv, "--out", str(out), "--no-plot"]
    if args.steps and "--steps" not in argv:
        command += ["--steps", str(args.steps)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    out.mkdir(parents=True, exist_ok=True)
    print(f"== {name}: {' '.join(command)}", flush=True)
    started = time.perf_counter()
    with (out / "log.txt").open("w") as log:
        try:
            code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                  timeout=args.run_timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = {"command": command, "exit": code, "wall_s": time.perf_counter() - started}
    result |= summarize_run(out, warmup=args.warmup)
    if code != 0:
        result["log_tail"] = (out / "log.txt").read_text()[-4000:]
    return result


def derived(runs: dict) -> dict:
    """Scaling 1 → 2 GPUs in samples per second: the ratio of step times at the same global batch, twice that ratio
    with twice the prompts."""
    out = {}
    one, two = runs.get("grpo_1gpu", {}), runs.get("grpo_2gpu_colocated", {})
    if one.get("step_s") and two.get("step_s"):
        out["scaling_1_to_2_gpus_colocated"] = one["step_s"] / two["step_s"]
    per_gpu = runs.get("grpo_2gpu_per_gpu_batch", {})
    if one.get("step_s") and per_gpu.get("step_s"):
        out["scaling_1_to_2_gpus_same_per_gpu_batch"] = 2 * one["step_s"] / per_gpu["step_s"]
    separate = runs.get("grpo_2gpu_separate", {})
    if one.get("step_s") and separate.get("step_s"):
        out["scaling_1_to_2_gpus_separate_engine"] = one["step_s"] / separate["step_s"]
    return out


def print_table(results: dict) -> None:
    header = f"{'run':<22}{'exit':>6}{'step s':>9}{'gen':>7}{'fwd':>7}{'train':>7}{'s/w':>7}{'sync':>7}" \
             f"{'switch%':>9}{'tok/s':>9}{'|dlogp|':>9}{'peak GiB':>10}"
    print(header)
    for name, run in results["runs"].items():
        parts = run.get("breakdown_s", {})
        cell = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-"  # noqa: E731
        peak = max(run.get("peak_memory_gib", {}).values(), default=None)
        switch = run.get("phase_switch_fraction")
        print(f"{name:<22}{run.get('exit', '-')!s:>6}{cell(run.get('step_s'), '.2f'):>9}"
              f"{cell(parts.get('generate'), '.2f'):>7}{cell(parts.get('experience_forwards'), '.2f'):>7}"
              f"{cell(parts.get('training'), '.2f'):>7}{cell(parts.get('sleep_wake'), '.2f'):>7}"
              f"{cell(parts.get('weight_sync'), '.2f'):>7}{cell(switch and 100 * switch, '.1f'):>9}"
              f"{cell(run.get('generated_tokens_per_s'), '.0f'):>9}"
              f"{cell(run.get('mismatch_mean_abs', {}).get('median'), '.4f'):>9}{cell(peak, '.1f'):>10}")
    for key, value in results.get("derived", {}).items():
        print(f"{key}: {value:.2f}x")


def plot_run(out: Path) -> None:
    """Redraw ``curve.png`` from metrics.jsonl (a run cut short by a time limit never drew it)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return
    sys.path.insert(0, str(REPO / "examples"))
    from _hybrid_common import plot

    plot([json.loads(line) for line in path.read_text().splitlines()], out / "curve.png")
    print(f"wrote {out / 'curve.png'}")


def ensure_model(path: str | None, kind: str) -> None:
    if kind == "cpu" or path is None or (Path(path) / "config.json").exists():
        return
    print(f"{path} has no config.json: converting SmolLM2 from its GGUF", flush=True)
    subprocess.run([sys.executable, str(REPO / "examples" / "convert_smollm2.py"), "--out", path], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=sorted(KINDS), help="device kind (decides the runs)")
    parser.add_argument("--model", default="/tmp/smollm2-hf")
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    parser.add_argument("--runs", default=None, help="comma-separated subset of the kind's runs (see --list)")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (GPU kinds)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--run-timeout", type=float, default=420.0, help="seconds per run")
    parser.add_argument("--results-dir", type=Path, default=None, help="run folders (default: next to --out)")
    parser.add_argument("--summarize", type=Path, default=None, help="only summarise this finished run folder")
    parser.add_argument("--extra", default=None, help="arguments added to every run (one quoted string)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default", help="a measured configuration's "
                        "example options, added to every run before --extra (round9: the round 9 benchmark)")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.summarize is not None:
        result = {"environment": environment(), "runs": {args.summarize.name: summarize_run(args.summarize,
                                                                                         warmup=args.warmup)}}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print_table(result)
        plot_run(args.summarize)
        return
    if args.kind is None:
        parser.error("--kind is required (or --summarize)")
    table, default = KINDS[args.kind]
    if args.list:
        for name, (script, argv) in RUNS[table].items():
            print(f"{name}{' (default)' if name in default else ''}: {script} {' '.join(argv)}")
        return
    names = args.runs.split(",") if args.runs else default
    unknown = [name for name in names if name not in RUNS[table]]
    if unknown:
        parser.error(f"unknown run(s) {unknown} for --kind {args.kind}; choose from {sorted(RUNS[table])}")
    if args.kind == "cpu":
        args.steps = 0  # the CPU runs carry their own --steps
    ensure_model(args.model, args.kind)
    results_dir = args.results_dir or args.out.with_suffix("").with_name(args.out.stem + "-runs")
    results = {"kind": args.kind, "environment": environment(), "settings": vars(args) | {"runs": names},
               "runs": {}}
    for name in names:
        script, argv = RUNS[table][name]
        results["runs"][name] = run_one(name, script, run_argv(argv, args), args, results_dir)
        results["derived"] = derived(results["runs"])
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print_table(results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
