"""Where a hybrid GRPO step's training time goes, on one GPU: the actor's optimizer step on the grpo_hybrid workload
(128 packed sequences, 2 micro-batches per optimizer step) through rlhfkit's DeepSpeedEngine at ZeRO-3/2 in
fp32/bf16, with transformers' sdpa (dense block-diagonal mask) or rlhfkit's varlen attention (one padded causal sdpa
per layer) — against plain torch (the model on the GPU, fused torch AdamW, the same packed forward), the floor of
what DeepSpeed adds, and against plain torch on right-padded rows with an attention mask (``torch_fp32_padded``: the
layout TRL trains on).

    python bench/train_step.py --out train_step.json                       # SmolLM2-135M shape, random weights
    python bench/train_step.py --arch qwen2.5-1.5b --configs zero1_bf16_varlen torch_bf16_varlen \
        --prompt-len 45 --response-len 128 --profile --out ts15.json     # the 1.5B scale run's default trainer
    python bench/train_step.py --arch qwen2.5-1.5b --configs zero1_bf16_varlen --seqs 64 --micro 3 --prompt-len 40 \
        --response-len 128 --loss-tokens-only --sleep deferred --out ts15d.json   # a hybrid step's actor, waking
    DS_ACCELERATOR=cpu python bench/train_step.py --arch smollm2 --configs zero1_bf16_varlen torch_bf16_varlen \
        --seqs 16 --repeats 2 --warmup 1 --count-ops --out ops.json      # the operators a step dispatches (CPU too)

Each configuration runs in a fresh process (ZeRO-3 leaves hooks and partitioned parameters behind). Per
configuration: median wall time of one optimizer step (2 micro-batches: packed forward, token-mean loss on the
response tokens, backward; then step) and of one no-grad forward of the whole batch, after warm-up steps, with
``torch.cuda.synchronize()`` around each. ``--sleep sync|deferred``: each timed step starts with the engine asleep
(every state in pinned host memory; the sleep is untimed, its median reported) and wakes it, everything first or the
optimizer's states behind the micro-batches (``DeepSpeedEngine.wake_up(defer_optimizer=True)``), so the time
against ``--sleep none`` is what the wake adds to a step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench.scale's architectures
CONFIGS = {  # name -> (kind, zero stage, dtype, attention)
    "torch_fp32_sdpa": ("torch", None, "float32", "sdpa"),
    "torch_fp32_varlen": ("torch", None, "float32", "varlen"),
    "zero3_fp32_sdpa": ("deepspeed", 3, "float32", "sdpa"),
    "zero3_fp32_varlen": ("deepspeed", 3, "float32", "varlen"),
    "zero2_fp32_sdpa": ("deepspeed", 2, "float32", "sdpa"),
    "zero2_fp32_varlen": ("deepspeed", 2, "float32", "varlen"),
    "torch_fp32_padded": ("torch", None, "float32", "padded"),
    "zero3_bf16_sdpa": ("deepspeed", 3, "bfloat16", "sdpa"),
    "torch_bf16_sdpa": ("torch", None, "bfloat16", "sdpa"),
    # fp32 weights and activations with TF32 tensor-core matmuls (torch.backends.cuda.matmul.allow_tf32)
    "torch_tf32_varlen": ("torch", None, "tf32", "varlen"),
    "zero2_tf32_varlen": ("deepspeed", 2, "tf32", "varlen"),
    "zero2_bf16_varlen": ("deepspeed", 2, "bfloat16", "varlen"),
    "zero1_tf32_varlen": ("deepspeed", 1, "tf32", "varlen"),
    "zero0_tf32_varlen": ("deepspeed", 0, "tf32", "varlen"),
    "zero1_bf16_varlen": ("deepspeed", 1, "bfloat16", "varlen"),  # grpo_hybrid.py --bf16 true (1.5B and up)
    "torch_bf16_varlen": ("torch", None, "bfloat16", "varlen"),
}


def build_model(arch: str, dtype: torch.dtype, attn: str, device: torch.device):
    """A random-weight model of ``arch`` ("smollm2", or one of ``bench/scale.py``'s architectures), built on
    ``device``."""
    if arch == "smollm2":
        return smollm2_shaped(dtype, attn).to(device)
    import transformers

    from bench.scale import ARCHITECTURES

    config = transformers.AutoConfig.for_model(**ARCHITECTURES[arch])
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)


def vocab_size(arch: str) -> int:
    if arch == "smollm2":
        return 49152
    from bench.scale import ARCHITECTURES

    return ARCHITECTURES[arch]["vocab_size"]


def smollm2_shaped(dtype: torch.dtype, attn: str):
    """A random-weight Llama with SmolLM2-135M's shape (tied embeddings, vocabulary 49,152)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)


def make_batches(args, device):
    from rlhfkit.packing import pack_sequences

    gen = torch.Generator().manual_seed(0)
    seqs, masks = [], []
    for _ in range(args.seqs):
        prompt = args.prompt_len + int(torch.randint(-8, 9, (1,), generator=gen))
        response = max(2, args.response_len + int(torch.randint(-6, 7, (1,), generator=gen)))
        seqs.append(torch.randint(0, min(49152, vocab_size(args.arch)), (prompt + response,), generator=gen))
        masks.append(torch.cat([torch.zeros(prompt, dtype=torch.bool), torch.ones(response, dtype=torch.bool)]))
    per = args.seqs // args.micro
    micro = [pack_sequences(seqs[i * per:(i + 1) * per], loss_masks=masks[i * per:(i + 1) * per]).to(device)
             for i in range(args.micro)]
    return micro, pack_sequences(seqs, loss_masks=masks).to(device)


def as_padded(batch) -> dict:
    """TRL's layout of a packed batch: right-padded rows, an attention mask, the loss mask aligned with the ids."""
    from rlhfkit.packing import pad_packed

    return {"ids": pad_packed(batch.input_ids, batch.cu_seqlens, padding_value=0),
            "mask": pad_packed(torch.ones_like(batch.input_ids), batch.cu_seqlens),
            "loss_mask": pad_packed(batch.loss_mask, batch.cu_seqlens)}


def padded_logprobs(model, rows: dict) -> torch.Tensor:
    """Token log-probs on padded rows (entry t of a row scores ids[t] given ids[:t]; entry 0 is 0), flattened over
    the real tokens so the training loss below reads them like packed ones."""
    logits = model(input_ids=rows["ids"], attention_mask=rows["mask"], use_cache=False).logits[:, :-1].float()
    chosen = torch.log_softmax(logits, -1).gather(-1, rows["ids"][:, 1:, None])[..., 0]
    lp = torch.cat([chosen.new_zeros(chosen.shape[0], 1), chosen], dim=1)
    return lp[rows["mask"].bool()]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int, warmup: int, before=None) -> list[float]:
    """Wall times of ``fn`` (``before``, untimed, ahead of each call)."""
    out = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        if i >= warmup:
            out.append(time.perf_counter() - start)
    return out


def run_one(name: str, args) -> dict:
    from rlhfkit.losses import model_logprobs
    from rlhfkit.packing import register_varlen_attention

    kind, stage, dtype_name, attn = CONFIGS[name]
    if dtype_name == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        dtype_name = "float32"
    dtype = getattr(torch, dtype_name)
    attn_impl = register_varlen_attention() if attn == "varlen" else "sdpa"
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")  # cpu: plumbing only
    if device.type == "cuda":
        torch.cuda.set_device(0)
    micro, whole = make_batches(args, device)
    model = build_model(args.arch, dtype, attn_impl, device)
    if args.fused_kernels:  # for both kinds: the engine applies them only to a model it loads (read_pretrained)
        from rlhfkit.deepspeed_engine._models import apply_fused_kernels

        apply_fused_kernels(model, args.fused_kernels)
    if args.compile_layers and kind == "torch":  # DeepSpeedEngineConfig.compile_layers does it for the engine
        from rlhfkit.deepspeed_engine._models import compile_decoder_layers

        compile_decoder_layers(model)
    if kind == "torch":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

        def logprobs(batch):
            if attn == "padded":
                return padded_logprobs(model, padded[id(batch)])
            return model_logprobs(model, batch)

        padded = {id(b): as_padded(b) for b in (*micro, whole)}

        def train_step():
            for batch in micro:
                lp = logprobs(batch)
                loss = -(lp * batch.loss_mask).sum() / batch.loss_mask.sum() / len(micro)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def forward():
            with torch.no_grad():
                logprobs(whole)
    else:
        import importlib

        if device.type == "cpu":  # one process needs no shared-memory collective: skip the JIT build of DeepSpeed's
            # (a minute of compiling where the extension cache is empty, minutes on a busy machine: past the timeout)
            importlib.import_module("deepspeed.ops").__compatible_ops__["deepspeed_shm_comm"] = False
        from rlhfkit.deepspeed_engine import DeepSpeedEngine, DeepSpeedEngineConfig

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
            os.environ.setdefault(key, value)
        config = DeepSpeedEngineConfig(zero_stage=stage, bf16=dtype == torch.bfloat16,
                                       optimizer="fused_adam" if device.type == "cuda" else "torch_adamw",
                                       learning_rate=1e-6, gradient_clipping=1.0,
                                       gradient_accumulation_steps=len(micro), compile_layers=args.compile_layers)
        engine = DeepSpeedEngine(model, role="actor", config=config)

        def compute():
            for batch in micro:
                lp = engine.forward_logprobs(batch, loss_tokens_only=args.loss_tokens_only)
                loss = -(lp * batch.loss_mask).sum() / batch.loss_mask.sum() / len(micro)
                engine.backward(loss)
                engine.step()  # the boundary's optimizer step first finishes a deferred wake

        def train_step():
            if args.sleep == "none":
                return compute()
            engine.wake_up(defer_optimizer=args.sleep == "deferred")  # the sleep itself is outside the time
            if not engine.optimizer_states_away:
                return compute()
            # as the hybrid's trainer worker: the optimizer's states come back in another thread, on a CUDA stream
            # of its own, in pieces, while this thread computes; the optimizer step waits for them
            behind = engine.finish_wake_behind(chunk_bytes=args.chunk_mib * 2**20)
            compute()
            behind.result()  # a failure surfaces (the step would otherwise finish the wake itself and hide it)

        def forward():
            with torch.no_grad():
                engine.forward_logprobs(whole)

    sleeps: list[float] = []
    asleep = kind != "torch" and args.sleep != "none"  # each timed step starts asleep, as the hybrid's actor does
    before = (lambda: sleeps.append(engine.sleep()["seconds"])) if asleep else None
    steps = timed(train_step, args.repeats, args.warmup, before)
    forwards = timed(forward, args.repeats, 1)
    result = {"config": name, "kind": kind, "zero_stage": stage, "dtype": CONFIGS[name][2], "attention": attn,
              "optimizer_step_s": statistics.median(steps), "optimizer_steps_s": steps,
              "forward_s": statistics.median(forwards), "tokens": int(whole.num_tokens), "sleep": args.sleep,
              "fused_kernels": args.fused_kernels, "compile_layers": args.compile_layers,
              **({"sleep_s": statistics.median(sleeps)} if sleeps else {}),
              "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    if args.compile_layers:
        from torch._dynamo.utils import counters

        result["dynamo"] = {"unique_graphs": counters["stats"]["unique_graphs"],
                            "graph_breaks": sum(counters["graph_break"].values()),
                            "break_reasons": sorted(counters["graph_break"])[:5]}
    if args.profile and device.type == "cuda":
        if before is not None:
            before()
        result["profile"] = profile(train_step)
    if args.count_ops:
        if before is not None:
            before()
        result["ops"] = count_ops(train_step, num_params=sum(1 for _ in model.parameters()), micro=len(micro))
    return result


def count_ops(fn, *, num_params: int, micro: int) -> dict:
    """The aten operators one more call of ``fn`` dispatches (each is a kernel launch or a host-side tensor op on a
    GPU): a device-independent count of the host's work, which runs on CPU too. Per parameter and micro-batch, and the
    ten most frequent, so that a configuration's per-parameter bookkeeping shows against plain torch."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    counter = Count()
    with counter:
        fn()
    total = sum(counter.ops.values())
    return {"dispatched": total, "per_param_per_micro_batch": total / num_params / micro, "num_params": num_params,
            "top": counter.ops.most_common(10)}


def profile(fn) -> dict:
    """One more call of ``fn`` under torch.profiler: its wall time, the device time of its kernels and memory
    operations (their sum: they rarely overlap on one stream), how many there were, and the ops that took the most
    device time. wall − device is the time the GPU waited for the host."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    _sync()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        _sync()
        wall = time.perf_counter() - start
    device_events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time_total for e in device_events) / 1e6  # (microseconds)
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=15, max_name_column_width=60)
    return {"wall_s": wall, "device_busy_s": busy, "device_ops": len(device_events),
            "host_bound_share": max(0.0, 1 - busy / wall), "top": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--arch", default="smollm2", help="smollm2 (135M) or one of bench/scale.py's architectures "
                        "(qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, llama-3.1-8b; toy on CPU), random weights")
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=50)
    parser.add_argument("--response-len", type=int, default=12)
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--config-timeout-s", type=float, default=120.0)
    parser.add_argument("--profile", action="store_true", help="profile one more optimizer step per configuration "
                        "(torch.profiler): device busy time against wall time, and the top ops")
    parser.add_argument("--sleep", choices=("none", "sync", "deferred"), default="none",
                        help="DeepSpeed configurations: before each timed step the engine sleeps (every state to "
                        "pinned host memory, untimed) and the step starts with its wake: 'sync' wakes everything "
                        "first; 'deferred' wakes the weights and gradients, and the optimizer's states in another "
                        "thread behind the micro-batches (DeepSpeedEngine.wake_up(defer_optimizer=True))")
    parser.add_argument("--chunk-mib", type=int, default=64, help="--sleep deferred: the wake's copy pieces (MiB)")
    parser.add_argument("--loss-tokens-only", action="store_true",
                        help="DeepSpeed configurations: logits only at the response tokens (the hybrid's training)")
    parser.add_argument("--fused-kernels", choices=("liger",), default=None,
                        help="the trainers' DeepSpeedEngineConfig.fused_kernels: Liger-Kernel's RMSNorm, RoPE and "
                        "SwiGLU (CUDA, rlhfkit[liger])")
    parser.add_argument("--compile-layers", action="store_true",
                        help="torch.compile each decoder layer (dynamic shapes) before the engine wraps the model: "
                        "what compiling would save against the host-bound eager step; the first steps compile")
    parser.add_argument("--count-ops", action="store_true", help="count the operators one more optimizer step "
                        "dispatches (kernel launches and host-side tensor ops; on CPU too)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.out.write_text(json.dumps(run_one(args.one, args)))
        return
    results = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for name in args.configs:
        part = args.out.with_suffix(f".{name}.json")
        argv = [sys.executable, __file__, "--one", name, "--out", str(part)] + [
            f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("seqs", "prompt_len", "response_len", "micro",
                                                                     "repeats", "warmup", "arch", "sleep",
                                                                     "chunk_mib")] + (
            ["--profile"] if args.profile else []) + (["--loss-tokens-only"] if args.loss_tokens_only else []) + (
            [f"--fused-kernels={args.fused_kernels}"] if args.fused_kernels else []) + (
            ["--compile-layers"] if args.compile_layers else []) + (["--count-ops"] if args.count_ops else [])
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, timeout=args.config_timeout_s, capture_output=True, text=True, check=False)
            result = json.loads(part.read_text()) if done.returncode == 0 and part.exists() else {
                "error": (done.stderr or done.stdout)[-1500:]}
        except subprocess.TimeoutExpired:
            result = {"error": f"timed out after {args.config_timeout_s} s"}
        result["wall_s"] = time.perf_counter() - start
        results["runs"][name] = result
        print(name, {k: v for k, v in result.items() if k in ("optimizer_step_s", "forward_s", "error")},
              {k: v for k, v in result.get("ops", {}).items() if k != "top"}, flush=True)
        if "profile" in result:
            summary = {k: v for k, v in result["profile"].items() if k != "top"}
            print(summary, "\n" + result["profile"]["top"], flush=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
