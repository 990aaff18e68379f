"""Peer benchmark: TRL's ``GRPOTrainer`` (vLLM colocate mode, sleep mode on) on the workload of examples/grpo_hybrid.py.

    python bench/peer_trl.py --model /tmp/smollm2-hf --steps 10 --rollout-batch 32 --samples-per-prompt 8 \\
        --max-new-tokens 96 --dtype float32 --out runs/peer_trl.json
    python bench/peer_trl.py --model /tmp/tiny --no-vllm --device cpu --steps 2 --rollout-batch 4 \\
        --samples-per-prompt 4 --max-new-tokens 8 --out /tmp/peer_trl_cpu.json           # CPU plumbing check

One step here is what it is in grpo_hybrid.py: one generation of P x G samples (P = --rollout-batch prompts of the
built-in arithmetic task through the chat template, G = --samples-per-prompt), scored by the same graded rule-based
reward, then --minibatches optimizer steps of P x G / minibatches samples, each in --grad-accum micro-batches, one
pass. The mapping onto GRPOConfig is in ``grpo_config``; bench/peers/README.md lists what differs unavoidably.

Measured per step (a TrainerCallback marks the step boundaries; TRL's ``VLLMGeneration.generate`` and
``VLLMGeneration.sync_weights`` are wrapped with perf_counter + cuda.synchronize): step time, generation time,
weight-sync time, generated completion tokens and tokens/s, reward mean, torch's peak allocated memory of this process
and the device-wide used memory polled through NVML (vLLM runs in this process but allocates through its own pool).
Writes one JSON (--out) with the keys of bench/hybrid.py's ``summarize_run`` where they apply, the config, the TRL
version and every step's row. Needs trl, accelerate, datasets (bench/peers/install-peers.sh on the GPU machine);
offline: a local model folder, no dataset download, report_to="none".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, dtype_default="float32", dtype_help="trainer and vLLM dtype")
    a = parser.add_argument
    a("--no-vllm", action="store_true", help="generate with transformers (CPU plumbing check)")
    a("--no-sleep", action="store_true", help="vLLM sleep mode off")
    a("--device", choices=("cuda", "cpu"), default="cuda")
    a("--work-dir", type=Path, default=None, help="TRL's output_dir (default: a temporary folder)")
    a("--deepspeed", choices=DEEPSPEED_MODES, default="none",
      help="DeepSpeed through TRL's trainer: ZeRO-3, optionally with the optimizer in host memory (large models), "
           "with gradient checkpointing, as bench/scale.py's 7B-8B layout")
    a("--lora-rank", type=int, default=0,
      help="> 0: train peft LoRA adapters of this rank (alpha 2 x rank) on the attention and MLP projections, with "
           "gradient checkpointing, as grpo_hybrid.py --lora-rank; TRL's reference is then the base model with the "
           "adapters disabled, as ours")
    args = parser.parse_args(argv)
    check_workload(parser, args)
    return args


DEEPSPEED_MODES = ("none", "zero3", "zero3-offload")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # grpo_hybrid.py's


def peft_config(args):
    """The peft ``LoraConfig`` TRL's trainer takes as ``peft_config=`` for ``--lora-rank`` > 0 (None: full-parameter
    training)."""
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank {args.lora_rank}; give 0 (full parameters) or a rank > 0")
    if args.lora_rank == 0:
        return None
    from peft import LoraConfig

    return LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                      target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")


def deepspeed_config(mode: str) -> dict | None:
    """The DeepSpeed config TRL's (transformers') trainer takes as ``deepspeed=``: ZeRO-3, and with
    ``zero3-offload`` the optimizer states and fp32 masters in pinned host memory under DeepSpeed's own AdamW (CPU
    Adam; a client torch optimizer is refused with offload). "auto" values are filled from GRPOConfig."""
    if mode not in DEEPSPEED_MODES:
        raise ValueError(f"--deepspeed {mode!r}; choose one of {DEEPSPEED_MODES}")
    if mode == "none":
        return None
    zero = {"stage": 3, "overlap_comm": False, "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True}
    config = {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto"}
    if mode == "zero3-offload":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}}
    return config


def prepare_environment(args) -> None:
    """Offline, no trackers, single-process torch.distributed variables (vLLM's external launcher reads them)."""
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "WANDB_DISABLED": "true", "WANDB_MODE": "disabled", "VLLM_NO_USAGE_STATS": "1",
                       "DO_NOT_TRACK": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0", "TOKENIZERS_PARALLELISM": "false",
                       "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    sys.path.insert(0, str(REPO / "src"))
    if "MASTER_PORT" not in os.environ:  # outside the ephemeral range: nothing takes it before vLLM binds it
        from rlhfkit._ports import free_listen_port

        os.environ["MASTER_PORT"] = str(free_listen_port(host="127.0.0.1"))
    if args.device == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def grpo_config(args, work_dir: Path):
    """The workload mapped onto GRPOConfig. TRL counts batches in samples (completions) and steps_per_generation in
    micro-batches: one generation of P*G samples = minibatches * grad_accum micro-batches of P*G/(minibatches *
    grad_accum), gradient_accumulation_steps = grad_accum, so each generation feeds exactly --minibatches optimizer
    steps, once (num_iterations=1)."""
    import torch
    from trl import GRPOConfig

    micro_steps = args.minibatches * args.grad_accum
    samples = args.rollout_batch * args.samples_per_prompt
    use_vllm = not args.no_vllm
    return GRPOConfig(
        output_dir=str(work_dir), report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
        use_cpu=args.device == "cpu", seed=args.seed, data_seed=args.seed,
        max_steps=args.steps * args.minibatches,
        per_device_train_batch_size=samples // micro_steps, gradient_accumulation_steps=args.grad_accum,
        steps_per_generation=micro_steps, num_generations=args.samples_per_prompt, num_iterations=1,
        shuffle_dataset=False, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=args.kl_coef, epsilon=args.clip, loss_type="dapo", scale_rewards="group",  # dapo = global token mean
        bf16=args.dtype == "bfloat16", fp16=False, tf32=True if args.tf32 else None,
        model_init_kwargs={"dtype": getattr(torch, args.dtype)},
        disable_dropout=True, log_completions=False, dataloader_num_workers=0,
        use_vllm=use_vllm, vllm_mode="colocate", vllm_enable_sleep_mode=use_vllm and not args.no_sleep,
        vllm_gpu_memory_utilization=args.gpu_memory_utilization, vllm_max_model_length=args.max_model_len,
        vllm_importance_sampling_correction=False,  # grpo_hybrid.py applies no engine/trainer IS correction
        deepspeed=deepspeed_config(getattr(args, "deepspeed", "none")),
        **({"gradient_checkpointing": True}
           if getattr(args, "lora_rank", 0) or getattr(args, "deepspeed", "none") != "none" else {}),
    )


def arithmetic_dataset(args):
    """P prompts per step, step k taking problems k*P .. (k+1)*P - 1, as grpo_hybrid.py; conversational, so TRL
    renders them with the tokenizer's chat template and the generation prompt (the same ids as arithmetic_prompts)."""
    from datasets import Dataset

    from rlhfkit.data import ArithmeticTask

    task = ArithmeticTask(min_value=0, max_value=args.max_value, ops=("+", "-"), seed=args.seed)
    rows = []
    for step in range(args.steps):
        rows += [{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                 for r in task.records(args.rollout_batch, start=step * args.rollout_batch)]
    return Dataset.from_list(rows)


class Recorder:
    """Per-step accumulators filled by the wrappers, the reward function and the callback."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.rows, self.current, self.first_step_unix = cuda, [], None, None
        self.nvml = NvmlPeak() if cuda else None

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def begin(self, step: int) -> None:
        if not self.rows and self.current is None:
            self.first_step_unix = time.time()  # launch -> first step is measured from the process launch
        self.sync()
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        if self.nvml:
            self.nvml.reset()
        self.current = {"step": step, "time/generate_s": 0.0, "time/weight_sync_s": 0.0, "time/reward_s": 0.0,
                        "time/experience_s": 0.0, "tokens/generated": 0, "num_seqs": 0, "rewards": [], "exact": 0.0,
                        "_start": time.perf_counter()}

    def add_time(self, key: str, seconds: float) -> None:
        if self.current is not None:
            self.current[key] += seconds

    def end(self, logs: dict) -> dict:
        self.sync()
        row, self.current = self.current, None
        step_s = time.perf_counter() - row.pop("_start")
        rewards = row.pop("rewards")
        row["time/step_s"] = step_s
        row["time/other_s"] = step_s - row["time/generate_s"] - row["time/weight_sync_s"]
        row["time/training_s"] = step_s - row["time/experience_s"]
        row["time/phase_switch_s"] = row["time/weight_sync_s"]
        row["time/phase_switch_fraction"] = row["time/weight_sync_s"] / step_s
        row["tokens/per_s"] = row["tokens/generated"] / step_s
        row["tokens/generate_per_s"] = (row["tokens/generated"] / row["time/generate_s"]
                                        if row["time/generate_s"] else None)
        row["reward/mean"] = sum(rewards) / len(rewards) if rewards else float("nan")
        exact = row.pop("exact")
        row["accuracy"] = exact / len(rewards) if rewards else float("nan")
        if self.cuda:
            import torch

            row["mem_process/step_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            row["mem_process/step_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        if self.nvml and self.nvml.peak is not None:
            row["mem/step_peak_gib"] = self.nvml.peak / GIB
        row |= {f"trl/{k}": v for k, v in logs.items() if isinstance(v, (int, float))}
        self.rows.append(row)
        print(f"step {row['step']}: reward {row['reward/mean']:.3f} | {step_s:.2f} s: generate "
              f"{row['time/generate_s']:.2f}, sync {row['time/weight_sync_s']:.2f}, other {row['time/other_s']:.2f} "
              f"| {row['tokens/per_s']:.0f} tok/s", flush=True)
        return row


class NvmlPeak:
    """Device-wide used memory of GPU 0 (all allocators, vLLM's pool included), polled every 5 ms by a thread."""

    def __init__(self) -> None:
        from rlhfkit.hybrid._timer import _load_nvml, _visible_handles  # CUDA_VISIBLE_DEVICES as indices or UUIDs

        self.peak, self._lock, self._handle, self._nvml = None, threading.Lock(), None, _load_nvml()
        if self._nvml is not None:
            with contextlib.suppress(Exception):  # NVML's own error types: no driver, no GPU, no samples
                self._nvml.nvmlInit()
                self._handle = _visible_handles(self._nvml)[0]
        if self._handle is not None:
            threading.Thread(target=self._loop, daemon=True, name="nvml-peak").start()

    def _loop(self) -> None:
        while True:
            used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            with self._lock:
                self.peak = used if self.peak is None else max(self.peak, used)
            time.sleep(0.005)

    def reset(self) -> None:
        with self._lock:
            self.peak = None


def timed(recorder: Recorder, key: str, function):
    """Wrap a method: its wall time (CUDA synchronized at both ends) is added to the current step's ``key``; a call
    nested in another timed call is subtracted from the outer one (generate() may re-push weights itself)."""
    stack = timed.__dict__.setdefault("stack", [])

    def wrapper(*args, **kwargs):
        recorder.sync()
        stack.append(0.0)
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            recorder.sync()
            elapsed = time.perf_counter() - start
            nested = stack.pop()
            if stack:
                stack[-1] += elapsed
            recorder.add_time(key, elapsed - nested)

    return wrapper


def instrument(recorder: Recorder, args) -> None:
    """Patch TRL's generation and weight-sync entry points (class level, before the trainer is built); give vLLM the
    trainer's dtype (TRL's colocated LLM(...) takes the checkpoint's)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    if args.no_vllm:
        GRPOTrainer._generate_single_turn = timed(recorder, "time/generate_s", GRPOTrainer._generate_single_turn)
    else:
        from trl.generation import vllm_generation

        cls = vllm_generation.VLLMGeneration
        cls.generate = timed(recorder, "time/generate_s", cls.generate)
        cls.sync_weights = timed(recorder, "time/weight_sync_s", cls.sync_weights)
        llm_class = getattr(vllm_generation, "LLM", None)
        if llm_class is None:
            raise RuntimeError("TRL did not import vllm (trl.import_utils.is_vllm_available() is False); check that "
                               "the GPU kit's eval line ran (vllm 0.22.1 on PYTHONPATH), or pass --no-vllm")

        def llm_with_dtype(*a, **kw):
            kw.setdefault("dtype", args.dtype)
            return llm_class(*a, **kw)

        vllm_generation.LLM = llm_with_dtype
    # inclusive time of the whole rollout (generation, sync, reward, old/ref log-prob forwards, advantages)
    GRPOTrainer._generate_and_score_completions = timed(recorder, "time/experience_s",
                                                        GRPOTrainer._generate_and_score_completions)


def make_reward(recorder: Recorder):
    """rlhfkit's graded arithmetic reward as a TRL reward function; records rewards and completion tokens."""
    from rlhfkit.data import arithmetic_accuracy, arithmetic_reward

    def arithmetic(prompts, completions, completion_ids, label, **_):
        start = time.perf_counter()
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        questions = [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
        scores = arithmetic_reward(questions, texts, label)
        if recorder.current is not None:
            recorder.current["rewards"] += scores
            recorder.current["exact"] += arithmetic_accuracy(texts, label) * len(texts)
            recorder.current["tokens/generated"] += sum(len(ids) for ids in completion_ids)
            recorder.current["num_seqs"] += len(scores)
            recorder.add_time("time/reward_s", time.perf_counter() - start)
        return scores

    return arithmetic


def make_callback(recorder: Recorder, minibatches: int):
    from transformers import TrainerCallback

    class StepBoundaries(TrainerCallback):
        """A benchmark step = --minibatches optimizer steps (one generation)."""

        def __init__(self) -> None:
            self.logs = {}

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % minibatches == 0:
                recorder.begin(state.global_step // minibatches)
                self.logs = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs |= logs or {}

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % minibatches == 0 and recorder.current is not None:
                recorder.end(self.logs)

    return StepBoundaries()


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rows: list[dict], warmup: int) -> dict:
    """The keys of bench/hybrid.py's summarize_run that apply to TRL."""
    if not rows:
        return {"steps": 0}
    timed_rows = rows[warmup:] if len(rows) > warmup else rows[-1:]
    med = lambda key: _median([row.get(key) for row in timed_rows])  # noqa: E731
    step = med("time/step_s")
    parts = ("generate", "weight_sync", "reward", "experience", "training", "other")
    return {
        "steps": len(rows), "timed_steps": len(timed_rows), "step_s": step,
        "breakdown_s": {part: med(f"time/{part}_s") for part in parts},
        "phase_switch_fraction": med("time/phase_switch_fraction"),
        "generated_tokens_per_s": med("tokens/per_s"), "generated_tokens_per_step": med("tokens/generated"),
        "generation_tokens_per_s": med("tokens/generate_per_s"),
        "samples_per_s": rows[0]["num_seqs"] / step if step else None,
        "reward": {"first": rows[0]["reward/mean"], "last": rows[-1]["reward/mean"],
                   "max_abs_kl": max(abs(row.get("trl/kl", 0.0)) for row in rows)},
        "peak_memory_gib": {key.removeprefix("mem/"): max(row.get(key, 0.0) for row in rows)
                            for key in sorted({k for row in rows for k in row if k.startswith("mem/")})},
        "peak_process_memory_gib": {key.removeprefix("mem_process/"): max(row.get(key, 0.0) for row in rows)
                                    for key in sorted({k for row in rows for k in row
                                                       if k.startswith("mem_process/")})},
    }


def versions() -> dict:
    out = {}
    for package in ("trl", "transformers", "accelerate", "datasets", "torch", "vllm"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    prepare_environment(args)
    from trl import GRPOTrainer

    recorder = Recorder(cuda=args.device == "cuda")
    instrument(recorder, args)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="peer_trl_"))
    config = grpo_config(args, work_dir)
    started = time.perf_counter()
    trainer = GRPOTrainer(model=args.model, reward_funcs=make_reward(recorder), args=config,
                          train_dataset=arithmetic_dataset(args), peft_config=peft_config(args),
                          callbacks=[make_callback(recorder, args.minibatches)])
    startup_s = time.perf_counter() - started
    trainer.train()
    result = {"peer": "trl", "trl_version": metadata.version("trl"), "versions": versions(),
              "config": vars(args) | {"model": args.model, "out": str(args.out), "work_dir": str(work_dir),
                                      "grpo": {k: getattr(config, k) for k in (
                                          "per_device_train_batch_size", "gradient_accumulation_steps",
                                          "steps_per_generation", "generation_batch_size", "num_generations",
                                          "num_iterations", "max_steps", "loss_type", "scale_rewards", "beta",
                                          "epsilon", "bf16", "use_vllm", "vllm_mode", "vllm_enable_sleep_mode",
                                          "vllm_gpu_memory_utilization", "vllm_importance_sampling_correction")}},
              "startup": {"trainer_init_s": startup_s}, "first_step_unix": recorder.first_step_unix, **summarize(recorder.rows, args.warmup),
              "rows": recorder.rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2, default=str), flush=True)
    return result


if __name__ == "__main__":
    main()
