"""LoRA adapter push into a colocated vLLM engine (issue 20 item 5): adapter sync time, greedy equality with the
trainer's merged model, and a few hybrid GRPO steps with LoRA. One command, bounded, writes one JSON.

    python bench/lora_vllm.py --model /tmp/rlhfkit-scale/qwen2.5-7b --rank 16 --out lora_vllm.json   # GPU
    python bench/lora_vllm.py --arch qwen2.5-7b --tokenizer /tmp/smollm2-hf --out lora_vllm.json  # builds it first
    python bench/lora_vllm.py --tiny --out lora_tiny.json    # CPU (CI): a tiny Llama, rlhfkit's HF engine, no vLLM

GPU: the trainer is this process (the HF model on cuda:0 wrapped with peft, adapters set to random values as a
stand-in for training); the engine a vLLM Ray actor sharing the GPU (``VLLMEngineConfig(enable_lora=True)``). Each
sync sends the adapter alone through ``rlhfkit.weight_sync`` over CUDA IPC and registers it in vLLM under a new id;
``syncs`` lists each one's wall time (send + receive + registration, Ray round trip included) and the workers'
timings; ``sync_s_median`` is the number to hold against the 50 ms goal. ``greedy``: the engine's greedy tokens after
the last sync against the peft model (base + adapter, as vLLM computes it) and against ``merge_and_unload()``; the
engine's base-model tokens against HF's base model give the floor (random-weight models have flat logits, so bf16
kernels may flip an argmax with or without an adapter: compare with the floor, or pass ``--dtype float32``).
``grpo``: ``examples/grpo_hybrid.py --lora-rank`` for ``--grpo-steps`` steps in its own process (0: skip), its
per-phase medians and peaks as bench/hybrid.py summarizes them.

CPU (``--tiny``): the same adapter push into rlhfkit's HF engine (gloo), the same greedy checks; no GRPO steps unless
``--grpo-steps`` (tests/test_bench_suites.py runs the hybrid LoRA example through bench/scale.py --tiny).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hybrid import _device, read_metrics, run_logged, summarize  # noqa: E402
from bench.scale import ARCHITECTURES, build_model, ours_command, sync_summary  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TEXTS = ("What is 12 + 7?", "The capital of France is", "Write a haiku about GPUs.", "1, 2, 3, 4,")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model folder (e.g. one bench/scale.py --keep built)")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), help="instead of --model: build this random-weight "
                        "shape of bench/scale.py (with --tokenizer) in --work-dir, and delete it after")
    parser.add_argument("--tokenizer", help="with --arch: HF folder with the SmolLM2 tokenizer")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/rlhfkit-scale"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank), attention + MLP")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--syncs", type=int, default=8, help="timed adapter syncs (after 2 untimed ones)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--adapter-std", type=float, default=0.02, help="std of the random adapter values")
    parser.add_argument("--engine-memory", type=float, default=0.3, help="vLLM's share of the GPU")
    parser.add_argument("--grpo-steps", type=int, default=None, help="hybrid GRPO steps (default 3; --tiny: 0)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="limit of the GRPO run (s)")
    parser.add_argument("--tiny", action="store_true", help="CPU: a tiny Llama, the HF engine, no vLLM")
    args = parser.parse_args(argv)
    if args.grpo_steps is None:
        args.grpo_steps = 0 if args.tiny else 3
    if args.tiny:
        args.dtype = "float32"  # the tiny model and the HF engine on CPU
    if not args.tiny and bool(args.model) == bool(args.arch):
        parser.error("give --model (an HF folder) or --arch (with --tokenizer), except with --tiny")
    if args.arch and not args.tokenizer:
        parser.error("--arch needs --tokenizer (an HF folder with the SmolLM2 tokenizer)")
    if args.rank < 1 or args.syncs < 1:
        parser.error(f"--rank={args.rank} and --syncs={args.syncs} must be >= 1")
    return args


def grpo_command(args, out: Path) -> list[str]:
    """examples/grpo_hybrid.py with LoRA, exactly as bench/scale.py's ``lora`` mode runs it."""
    return ours_command(None if args.tiny else args.model, "lora", out, steps=args.grpo_steps, tiny=args.tiny,
                        lora_rank=args.rank)


def run_grpo(args) -> dict:
    out = args.out.with_suffix(".grpo")
    out.mkdir(parents=True, exist_ok=True)
    command = grpo_command(args, out)
    code, wall = run_logged(command, out / "run.log", args.timeout)
    rows = read_metrics(out)
    result = {"command": " ".join(command), "returncode": code, "wall_s": wall, **(summarize(rows) if rows else {}),
              **sync_summary(rows)}
    if code:
        result["log_tail"] = (out / "run.log").read_text(errors="replace").splitlines()[-15:]
    return result


def greedy_tokens(model, prompts, steps: int, device: str) -> list[list[int]]:
    import torch

    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(steps):
                ids.append(int(model(torch.tensor([ids], device=device), use_cache=False).logits[0, -1].argmax()))
            tokens.append(ids[len(prompt):])
    return tokens


def forced_logprob_gap(model, prompts, rollouts, device: str) -> float:
    """Mean |engine log-prob − ``model``'s| over the engine's response tokens, ``model`` teacher-forced on them: where
    greedy tokens cannot be compared (a random-weight model's flat logits in bf16), this still tells whether the
    engine computes what ``model`` computes."""
    import torch

    gaps = []
    with torch.no_grad():
        for prompt, rollout in zip(prompts, rollouts):
            response = rollout.response_token_ids.tolist()
            ids = torch.tensor([list(prompt) + response], device=device)
            logits = model(ids, use_cache=False).logits[0, len(prompt) - 1:-1].float()
            ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, device=device)[:, None])[:, 0]
            gaps.append((ours.cpu() - rollout.response_logprobs.float()).abs())
    return float(torch.cat(gaps).mean())


def compare(engine_tokens, reference) -> dict:
    """Per prompt: equal, and the length of the common prefix."""
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y in zip(engine_tokens, reference)]
    return {"equal": [x == y for x, y in zip(engine_tokens, reference)], "common_prefix": prefix}


def build_trainer(args, path: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    from rlhfkit.lora import LoraConfig, apply_lora

    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, target_modules=TARGETS)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(device).eval()
    return apply_lora(base, lora), lora


def new_adapter(trainer, generator, std: float) -> None:
    """A stand-in for an optimizer step: every adapter weight gets new random values."""
    import torch

    from rlhfkit.lora import lora_parameters

    with torch.no_grad():
        for _, param in lora_parameters(trainer):
            param.copy_(torch.randn(param.shape, generator=generator, device=param.device) * std)


def timed_sync(sender, named, receive) -> dict:
    """Send ``named`` from a thread while ``receive()`` (the engine side) runs; wall time of both."""
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(report=sender.send(named)))
    started = time.perf_counter()
    thread.start()
    reports = receive()
    thread.join(300)
    seconds = time.perf_counter() - started
    if "report" not in outcome:
        raise RuntimeError("the adapter sender did not finish within 300 s")
    report, worker = outcome["report"], (reports[0] if reports and isinstance(reports[0], dict) else {})
    return {"seconds": seconds, "sender_s": report.seconds, "version": report.version, "bytes": report.num_bytes,
            "tensors": report.num_tensors, **{f"worker_{k}": worker[k] for k in ("receive_s", "register_s",
                                                                                 "adapter_id", "adapters")
                                              if k in worker}}


def adapter_push_gpu(args, result: dict) -> None:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import torch
    from transformers import AutoTokenizer

    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.vllm import VLLMEngineConfig, create_engines
    from rlhfkit.lora import lora_parameters
    from rlhfkit.weight_sync import SyncEndpoint, WeightSender, WeightSyncConfig

    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False)
    try:
        pg = ray.util.placement_group([{"GPU": 1, "CPU": 1}])
        ray.get(pg.ready(), timeout=60)
        config = VLLMEngineConfig(model=args.model, dtype=args.dtype, gpu_memory_utilization=args.engine_memory,
                                  gpu_share=0.5, enforce_eager=True, max_model_len=1024, seed=0, enable_lora=True,
                                  max_lora_rank=args.rank, env={"VLLM_USE_FLASHINFER_SAMPLER": "0"})
        started = time.perf_counter()
        (engine,) = create_engines(config, placement_group=pg, bundle_indices=[[0]])
        result["engine_start_s"] = time.perf_counter() - started
        trainer, lora = build_trainer(args, args.model, "cuda")
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for t in TEXTS]
        prompts = [list(p["input_ids"] if isinstance(p, dict) else p) for p in prompts]
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)

        def engine_rollouts() -> list:
            return ray.get(engine.generate.remote(prompts, greedy), timeout=300)

        with trainer.disable_adapter():
            base_rollouts = engine_rollouts()
            base_tokens = [r.response_token_ids.tolist() for r in base_rollouts]
            base_floor = compare(base_tokens, greedy_tokens(trainer, prompts, args.max_new_tokens, "cuda"))
            base_gap = forced_logprob_gap(trainer, prompts, base_rollouts, "cuda")
        named = lora_parameters(trainer)
        result |= {"rank": lora.rank, "adapter_params": sum(p.numel() for _, p in named),
                   "adapter_tensors": len(named)}
        sync_config = WeightSyncConfig(backend="cuda_ipc", timeout_s=120, dtype=getattr(torch, args.dtype))
        generator = torch.Generator(device="cuda").manual_seed(0)
        with WeightSender(sync_config, SyncEndpoint(world_size=2, rank=0, port=0),
                          device=torch.device("cuda:0")) as sender:
            ray.get(engine.init_weight_sync.remote(sync_config, sender.endpoint, first_rank=1, lora=lora),
                    timeout=120)
            syncs = []
            for _ in range(2 + args.syncs):
                new_adapter(trainer, generator, args.adapter_std)
                syncs.append(timed_sync(sender, named, lambda: ray.get(engine.receive_weights.remote(),
                                                                       timeout=300)))
        result |= {"syncs": syncs[2:], "sync_s_median": statistics.median(s["seconds"] for s in syncs[2:]),
                   "sync_goal_s": 0.05, "engine_health": ray.get(engine.health_check.remote(), timeout=60)}
        rollouts = engine_rollouts()
        tokens = [r.response_token_ids.tolist() for r in rollouts]
        peft_tokens = greedy_tokens(trainer, prompts, args.max_new_tokens, "cuda")
        result["logprob_gap"] = {"engine_vs_peft": forced_logprob_gap(trainer, prompts, rollouts, "cuda")}
        with trainer.disable_adapter():  # the engine's adapted log-probs against the base: what the adapter moves
            result["logprob_gap"]["engine_vs_base"] = forced_logprob_gap(trainer, prompts, rollouts, "cuda")
        result["logprob_gap"]["base_floor"] = base_gap  # the engine's base against HF's base, before any push
        merged_tokens = greedy_tokens(trainer.merge_and_unload(), prompts, args.max_new_tokens, "cuda")
        result["greedy"] = {"vs_peft": compare(tokens, peft_tokens), "vs_merged": compare(tokens, merged_tokens),
                            "base_floor": base_floor, "max_new_tokens": args.max_new_tokens,
                            "adapter_changes_output": tokens != base_tokens}
    finally:
        ray.shutdown()


def adapter_push_cpu(args, result: dict) -> None:
    """--tiny: the adapter push into rlhfkit's HF engine (gloo channel), the same checks, no vLLM."""
    import torch

    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.hf import HFEngine, HFEngineConfig
    from rlhfkit.lora import describe_adapter, lora_parameters
    from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model
    from rlhfkit.weight_sync import SyncEndpoint, WeightReceiver, WeightSender, WeightSyncConfig

    path = str(build_tiny_model(args.out.with_suffix(".model"), TinyModelConfig(hidden_size=64, num_layers=2),
                                exist_ok=True))
    trainer, lora = build_trainer(args, path, "cpu")
    engine = HFEngine(HFEngineConfig(model=path, dtype="float32"))
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)

    with trainer.disable_adapter():
        base_rollouts = engine.generate(prompts, greedy)
        base_tokens = [r.response_token_ids.tolist() for r in base_rollouts]
        base_floor = compare(base_tokens, greedy_tokens(trainer, prompts, args.max_new_tokens, "cpu"))
        base_gap = forced_logprob_gap(trainer, prompts, base_rollouts, "cpu")
    named = lora_parameters(trainer)
    result |= {"rank": lora.rank, "adapter_params": sum(p.numel() for _, p in named), "adapter_tensors": len(named)}
    sync_config = WeightSyncConfig(backend="gloo", timeout_s=60)
    generator = torch.Generator().manual_seed(0)
    with WeightSender(sync_config, SyncEndpoint(world_size=2, rank=0, port=0)) as sender:
        receiver = WeightReceiver(sync_config, sender.endpoint.for_rank(1, "engine"),
                                  expected=describe_adapter(engine.model, lora, dtype=torch.float32))

        def receive() -> list[dict]:
            report = receiver.receive(lambda tensors, version=None: engine.load_adapter(tensors, lora=lora,
                                                                                         version=version))
            return [{"version": report.version}]

        syncs = []
        for _ in range(2 + args.syncs):
            new_adapter(trainer, generator, args.adapter_std)
            syncs.append(timed_sync(sender, named, receive))
        receiver.close()
    result |= {"syncs": syncs[2:], "sync_s_median": statistics.median(s["seconds"] for s in syncs[2:]),
               "engine_version": engine.weight_version}
    rollouts = engine.generate(prompts, greedy)
    tokens = [r.response_token_ids.tolist() for r in rollouts]
    result["logprob_gap"] = {"engine_vs_peft": forced_logprob_gap(trainer, prompts, rollouts, "cpu")}
    with trainer.disable_adapter():
        result["logprob_gap"]["engine_vs_base"] = forced_logprob_gap(trainer, prompts, rollouts, "cpu")
    result["logprob_gap"]["base_floor"] = base_gap
    result["greedy"] = {"vs_peft": compare(tokens, greedy_tokens(trainer, prompts, args.max_new_tokens, "cpu")),
                        "vs_merged": compare(tokens, greedy_tokens(copy.deepcopy(trainer).merge_and_unload(),
                                                                   prompts, args.max_new_tokens, "cpu")),
                        "base_floor": base_floor, "max_new_tokens": args.max_new_tokens,
                        "adapter_changes_output": tokens != base_tokens}


def main(argv=None) -> dict:
    args = parse_args(argv)
    built = None
    if args.arch:
        started = time.time()
        built = args.model = str(build_model(args.arch, args.work_dir / f"{args.arch}-lora", args.tokenizer,
                                             device="cuda"))
        print(f"built {args.arch} in {time.time() - started:.0f} s", flush=True)
    try:
        return _main(args)
    finally:
        if built:
            shutil.rmtree(built, ignore_errors=True)


def _main(args) -> dict:
    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": _device(), "model": args.model or "tiny",
                    "arch": args.arch, "rank": args.rank,
                    "dtype": args.dtype, "engine": "hf" if args.tiny else "vllm"}
    try:
        (adapter_push_cpu if args.tiny else adapter_push_gpu)(args, result)
    except Exception as error:  # noqa: BLE001 - recorded, then the GRPO part still runs; the exit code says it
        result["adapter_push_error"] = f"{type(error).__name__}: {error}"
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if args.grpo_steps:
        result["grpo"] = run_grpo(args)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: result.get(k) for k in ("sync_s_median", "logprob_gap", "greedy", "adapter_push_error")},
                     default=str))
    if "adapter_push_error" in result or result.get("grpo", {}).get("returncode"):
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
