"""Peer benchmark: OpenRLHF 0.10.4's hybrid engine (train_ppo_ray, everything colocated on 1 GPU, vLLM and DeepSpeed
sleep) on the workload of examples/grpo_hybrid.py; writes one JSON, also when OpenRLHF cannot run.

    python bench/peer_openrlhf.py --model /tmp/smollm2-hf --steps 10 --rollout-batch 32 --samples-per-prompt 8 \\
        --max-new-tokens 96 --out runs/peer_openrlhf.json --timeout 540

What it does: writes the arithmetic prompts (rendered with the tokenizer's chat template here, exactly as
``arithmetic_prompts`` renders them) with their labels to a jsonl, a ``reward_func`` file that scores with
rlhfkit's graded arithmetic reward, and a stub ``flash_attn`` package (below); launches
``python -m openrlhf.cli.train_ppo_ray`` in its own process group under ``--timeout``; polls device-wide GPU memory
through NVML meanwhile; parses OpenRLHF's per-step ``Global step N: {...}`` log lines (timing/generation,
timing/make_experience, timing/ppo_train, timing/broadcast, rollout/*) into rows; summarizes them with the keys of
bench/hybrid.py's ``summarize_run``. Without a single parsed step the JSON is ``{"ran": false, "blocked_by": ...}``
with the error line and the log's tail.

flash-attn (a hard requirement of the openrlhf wheel, no wheel for torch 2.11): OpenRLHF 0.10.4 imports it at module
level only in ``openrlhf/models/ring_attn_utils.py`` (``flash_attn.bert_padding``: index_first_axis, pad_input,
rearrange, unpad_input; ``flash_attn.utils.distributed``: all_gather), which models/actor.py, models/model.py and
utils/deepspeed/deepspeed.py import. Those functions are called only from ``unpad_and_slice_tensor`` /
``gather_and_pad_tensor``, i.e. only with ``--ds.packing_samples`` (or ring attention), which this run leaves off.
The only other use, ``flash_attn.ops.triton.cross_entropy`` in models/utils.py, sits in try/except ImportError and the
stub has no such module, so the torch fallback runs. The stub's functions raise if ever called; attention is ``sdpa``.
The stub has no dist-info, so transformers does not consider flash-attn installed. vLLM's engine core, though, finds
the stub with ``find_spec("flash_attn")`` and imports ``flash_attn.ops.triton.rotary.apply_rotary`` (its ROCm rotary
path; CUDA uses vLLM's vendored kernel): the stub re-exports that function from vLLM's vendored copy of the same
flash-attn Triton kernel (``vllm.vllm_flash_attn.ops.triton.rotary``).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
sys.path.insert(0, str(REPO / "bench" / "peers"))
from workload import add_workload_arguments, check_workload  # noqa: E402
STEP_LINE = re.compile(r"Global step (\d+): (\{.*\})\s*$")

STUB_BERT_PADDING = '''"""flash_attn stub (rlhfkit bench/peer_openrlhf.py): never called without packing_samples."""


def _refuse(name):
    def function(*args, **kwargs):
        raise RuntimeError(f"flash_attn stub: {name} was called; this benchmark runs OpenRLHF without "
                           "--ds.packing_samples / ring attention, where it should never be")
    return function


index_first_axis = _refuse("bert_padding.index_first_axis")
pad_input = _refuse("bert_padding.pad_input")
rearrange = _refuse("bert_padding.rearrange")
unpad_input = _refuse("bert_padding.unpad_input")
'''
STUB_DISTRIBUTED = STUB_BERT_PADDING.replace('index_first_axis = _refuse("bert_padding.index_first_axis")\n'
                                             'pad_input = _refuse("bert_padding.pad_input")\n'
                                             'rearrange = _refuse("bert_padding.rearrange")\n'
                                             'unpad_input = _refuse("bert_padding.unpad_input")\n',
                                             'all_gather = _refuse("utils.distributed.all_gather")\n')

REWARD_FILE = '''"""reward_func for OpenRLHF's --reward.remote_url: rlhfkit's graded arithmetic reward (written by
bench/peer_openrlhf.py). OpenRLHF 0.10.4 calls reward_func(queries, prompts, labels) per sample, queries being the
decoded prompt + response with special tokens."""
import sys

import torch

sys.path.insert(0, {src!r})
from rlhfkit.data import arithmetic_reward  # noqa: E402

QUESTIONS = {questions!r}  # rendered prompt text -> the bare question rlhfkit scores against


def reward_func(queries, prompts, labels):
    responses = [q.split(p, 1)[1] if p in q else q[len(p):] for q, p in zip(queries, prompts)]
    scores = arithmetic_reward([QUESTIONS.get(p, p) for p in prompts], responses, labels)
    scores = torch.tensor(scores, dtype=torch.float32)
    return {{"rewards": scores, "scores": scores, "extra_logs": {{}}}}
'''


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, dtype_default="bfloat16",
                           dtype_help="OpenRLHF 0.10.4 offers bf16/fp16 only (and hard-codes vLLM to bfloat16): "
                                      "float32 runs as bfloat16 and the JSON says so")
    a = parser.add_argument
    a("--zero-stage", type=int, default=3)
    a("--timeout", type=float, default=540.0, help="seconds before the run is killed (JSON still written)")
    a("--work-dir", type=Path, default=None)
    a("--dry-run", action="store_true", help="write the inputs and print the command; do not launch")
    args = parser.parse_args(argv)
    check_workload(parser, args)
    return args


def write_inputs(args, work: Path) -> tuple[Path, Path, Path]:
    """prompts.jsonl (pre-rendered chat prompts + labels), reward.py, stub/flash_attn."""
    sys.path.insert(0, str(REPO / "src"))
    from transformers import AutoTokenizer

    from rlhfkit.data import ArithmeticTask

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    task = ArithmeticTask(min_value=0, max_value=args.max_value, ops=("+", "-"), seed=args.seed)
    rows, questions = [], {}
    for step in range(args.steps):
        for record in task.records(args.rollout_batch, start=step * args.rollout_batch):
            text = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True)
            rows.append({"prompt": text, "label": record["label"]})
            questions[text] = record["prompt"]
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    reward = work / "reward.py"
    reward.write_text(REWARD_FILE.format(src=str(REPO / "src"), questions=questions))
    stub = work / "stub"
    (stub / "flash_attn" / "utils").mkdir(parents=True, exist_ok=True)
    (stub / "flash_attn" / "__init__.py").write_text('"""flash_attn stub (rlhfkit bench/peer_openrlhf.py)."""\n')
    (stub / "flash_attn" / "bert_padding.py").write_text(STUB_BERT_PADDING)
    (stub / "flash_attn" / "utils" / "__init__.py").write_text("")
    (stub / "flash_attn" / "utils" / "distributed.py").write_text(STUB_DISTRIBUTED)
    (stub / "flash_attn" / "ops" / "triton").mkdir(parents=True, exist_ok=True)
    (stub / "flash_attn" / "ops" / "__init__.py").write_text("")
    (stub / "flash_attn" / "ops" / "triton" / "__init__.py").write_text("")
    (stub / "flash_attn" / "ops" / "triton" / "rotary.py").write_text(
        '"""flash_attn stub: vLLM imports this when it finds flash_attn; vLLM ships the same kernel."""\n'
        "from vllm.vllm_flash_attn.ops.triton.rotary import apply_rotary  # noqa: F401\n")
    return prompts, reward, stub


def command(args, work: Path, prompts: Path, reward: Path) -> list[str]:
    """The workload on OpenRLHF's flags: P prompts x G samples per step, train.batch_size = P*G/minibatches samples
    per optimizer step, micro-batches of P*G/(minibatches*grad_accum), one epoch, GRPO = group_norm advantages + k3
    KL loss, constant learning rate."""
    samples = args.rollout_batch * args.samples_per_prompt
    micro = samples // (args.minibatches * args.grad_accum)
    flags = {
        "actor.model_name_or_path": args.model, "reward.remote_url": str(reward),
        "data.prompt_dataset": str(prompts), "data.input_key": "prompt", "data.label_key": "label",
        "data.max_samples": args.steps * args.rollout_batch, "data.max_len": args.max_model_len,
        "actor.num_nodes": 1, "actor.num_gpus_per_node": 1, "ref.num_nodes": 1, "ref.num_gpus_per_node": 1,
        "vllm.num_engines": 1, "vllm.tensor_parallel_size": 1,
        "vllm.gpu_memory_utilization": args.gpu_memory_utilization,
        "algo.advantage.estimator": "group_norm", "algo.kl.estimator": "k3", "algo.kl.init_coef": args.kl_coef,
        "actor.eps_clip": args.clip, "actor.adam.lr": args.lr, "actor.lr_scheduler": "constant",
        "actor.lr_warmup_ratio": 0.0, "actor.max_norm": 1.0,
        "rollout.batch_size": args.rollout_batch, "rollout.n_samples_per_prompt": args.samples_per_prompt,
        "rollout.max_new_tokens": args.max_new_tokens, "rollout.temperature": args.temperature,
        "rollout.micro_batch_size": micro, "train.batch_size": samples // args.minibatches,
        "train.micro_batch_size": micro, "train.max_epochs": 1, "train.num_episodes": 1, "train.seed": args.seed,
        "ds.zero_stage": args.zero_stage, "ds.param_dtype": "bf16", "ds.attn_implementation": "sdpa",
        "ckpt.save_steps": -1, "ckpt.path": str(work / "ckpt"), "ckpt.output_dir": str(work / "out"),
        "eval.steps": -1, "logger.logging_steps": 1,
    }
    argv = [sys.executable, "-m", "openrlhf.cli.train_ppo_ray"]
    for key, value in flags.items():
        argv += [f"--{key}", str(value)]
    return argv + ["--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep", "--algo.kl.use_loss"]


def environment(stub: Path) -> dict:
    env = dict(os.environ)
    # the stub goes last: a real flash_attn, if one were installed, would win
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO / "src"), str(stub)) if p)
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                       "VLLM_USE_FLASHINFER_SAMPLER": "0", "TORCH_CUDA_ARCH_LIST": "9.0"}.items():
        env.setdefault(key, value)
    if env.get("TORCH_CUDA_ARCH_LIST") == "9.0a":  # DeepSpeed 0.19.8 cannot parse it (see shared/gpu/README.md)
        env["TORCH_CUDA_ARCH_LIST"] = "9.0"
    return env


class NvmlPeak:
    """Device-wide used memory (all processes: Ray actors, vLLM, DeepSpeed) of every GPU, polled by a thread."""

    def __init__(self) -> None:
        self.peak, self.baseline, self._stop, self._handles = None, None, threading.Event(), []
        for name in ("pynvml", "vllm.third_party.pynvml"):
            try:
                nvml = __import__(name, fromlist=["nvmlInit"])
                nvml.nvmlInit()
                self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
                self._nvml = nvml
                break
            except Exception:  # noqa: BLE001 - no NVML: memory is not reported
                continue
        if self._handles:
            self.baseline = self._used()
            threading.Thread(target=self._loop, daemon=True).start()

    def _used(self) -> int:
        return max(self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles)

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            used = self._used()
            self.peak = used if self.peak is None else max(self.peak, used)

    def close(self) -> None:
        self._stop.set()


def parse_step(line: str) -> dict | None:
    match = STEP_LINE.search(line)
    if not match:
        return None
    text = re.sub(r"(?:np\.float\d+|np\.int\d+|tensor)\(([^()]*)\)", r"\1", match.group(2))
    try:
        status = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return {"step": int(match.group(1))} | {k: v for k, v in status.items() if isinstance(v, (int, float))}


def to_row(status: dict, wall_s: float | None) -> dict:
    """OpenRLHF's status dict -> the row keys of the other harnesses."""
    get = lambda key: float(status.get(key, 0.0))  # noqa: E731
    step = get("timing/step_total") or (wall_s or 0.0)
    tokens = get("rollout/response_length_mean") * get("rollout/num_samples")
    other = step - get("timing/generation") - get("timing/broadcast")
    return {"step": status["step"], "time/step_s": step, "time/step_wall_s": wall_s,
            "time/generate_s": get("timing/generation"), "time/weight_sync_s": get("timing/broadcast"),
            "time/experience_s": get("timing/make_experience"), "time/training_s": get("timing/ppo_train"),
            "time/other_s": other, "time/phase_switch_fraction": get("timing/broadcast") / step if step else None,
            "tokens/generated": tokens, "tokens/per_s": tokens / step if step else None,
            "num_seqs": get("rollout/num_samples"), "reward/mean": get("rollout/reward_mean"),
            "kl/mean": status.get("kl"), **{f"openrlhf/{k}": v for k, v in status.items() if k != "step"}}


def summarize(rows: list[dict], warmup: int) -> dict:
    timed = rows[warmup:] if len(rows) > warmup else rows[-1:]
    med = lambda key: statistics.median([r[key] for r in timed if r.get(key) is not None])  # noqa: E731
    step = med("time/step_s")
    return {"steps": len(rows), "timed_steps": len(timed), "step_s": step, "step_wall_s": med("time/step_wall_s")
            if any(r.get("time/step_wall_s") for r in timed) else None,
            "breakdown_s": {p: med(f"time/{p}_s") for p in ("generate", "weight_sync", "experience", "training",
                                                             "other")},
            "phase_switch_fraction": med("time/phase_switch_fraction"),
            "generated_tokens_per_s": med("tokens/per_s"), "generated_tokens_per_step": med("tokens/generated"),
            "samples_per_s": rows[0]["num_seqs"] / step if step else None,
            "reward": {"first": rows[0]["reward/mean"], "last": rows[-1]["reward/mean"],
                       "max_abs_kl": max(abs(r.get("kl/mean") or 0.0) for r in rows)}}


def blocked_reason(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for pattern in (r"ModuleNotFoundError.*", r"ImportError.*", r"\w+Error: .*", r"Traceback.*"):
        hits = [line for line in lines if re.search(pattern, line)]
        if hits:
            return hits[-1][:500]
    return lines[-1][:500] if lines else "no output"


def run(argv: list[str], env: dict, log_path: Path, timeout: float) -> tuple[int | str, list[dict]]:
    """Launch in a new process group; stream its output to the log, parsing step lines as they come."""
    rows, last = [], time.perf_counter()
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   cwd=REPO, start_new_session=True, bufsize=1)
        deadline = time.monotonic() + timeout
        timer = threading.Timer(timeout, lambda: os.killpg(process.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in process.stdout:
                log.write(line)
                status = parse_step(line)
                if status is not None:
                    now = time.perf_counter()
                    rows.append(to_row(status, now - last))
                    last = now
            code = process.wait()
        finally:
            timer.cancel()
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        if time.monotonic() >= deadline:
            code = "timeout"
    return code, rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="peer_openrlhf_"))
    work.mkdir(parents=True, exist_ok=True)
    prompts, reward, stub = write_inputs(args, work)
    argv_run = command(args, work, prompts, reward)
    try:
        version = metadata.version("openrlhf")
    except metadata.PackageNotFoundError:
        version = None
    result = {"peer": "openrlhf", "openrlhf_version": version, "command": argv_run,
              "config": vars(args) | {"out": str(args.out), "model": args.model, "work_dir": str(work),
                                      "dtype_run": "bfloat16", "flash_attn": "stub (module-level imports only)"}}
    if args.dry_run:
        print(" ".join(argv_run))
        return result
    if version is None:
        result |= {"ran": False, "blocked_by": "openrlhf is not installed (bash bench/peers/install-peers.sh)"}
    else:
        memory, started = NvmlPeak(), time.perf_counter()
        code, rows = run(argv_run, environment(stub), work / "log.txt", args.timeout)
        memory.close()
        log = (work / "log.txt").read_text(errors="replace")
        result |= {"exit": code, "wall_s": time.perf_counter() - started, "log": str(work / "log.txt")}
        if rows:
            result |= {"ran": True, **summarize(rows, args.warmup), "rows": rows}
            if memory.peak is not None:
                result["peak_memory_gib"] = {"device_run_peak": memory.peak / GIB,
                                             "device_baseline": memory.baseline / GIB}
        else:
            result |= {"ran": False, "blocked_by": blocked_reason(log)}
        if code != 0:
            result["log_tail"] = log[-4000:]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "command")}, indent=2, default=str),
          flush=True)
    return result


if __name__ == "__main__":
    main()
