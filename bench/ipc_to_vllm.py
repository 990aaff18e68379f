"""CUDA IPC weight sync from a trainer process into a vLLM engine actor on the same GPU, end to end (GPU only).

The trainer (this process) holds an HF model on cuda:0 with perturbed weights; a vLLM engine (a Ray actor with a
fractional GPU share on the same GPU) starts from the original checkpoint. One ``rlhfkit.weight_sync`` CUDA-IPC sync
later, the engine's greedy generations must equal the trainer model's (fp32 on both sides, so numerics agree) and
the engine must report the new weight version. The timed syncs repeat the same weights; then the trainer's weights
change in place and one more sync (``final_sync``) delivers what the greedy check compares. Also times the syncs against the floor measured in the same run (one
device-to-device copy of the model's bytes).

    python bench/ipc_to_vllm.py --model /tmp/smollm2-hf --out ipc_to_vllm.json
    python bench/ipc_to_vllm.py --random-layers 30 --dtype bfloat16 --no-greedy --out big.json  # 1.54B

``--random-layers N`` builds a random-weight Llama (hidden 2048, intermediate 5632, 16 heads, N layers; a locally
trained tokenizer) with ``rlhfkit.tiny_models`` first; greedy equality is only meaningful on a real checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch
from weight_sync import copy_bandwidth  # bench/weight_sync.py: the same floor as the channel benchmark


def hf_greedy(model, prompts: list[list[int]], steps: int, eos: set[int]) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, attention_mask=torch.ones_like(ids))
        tokens = out[0, len(prompt):].tolist()
        for i, token in enumerate(tokens):  # vLLM stops at EOS and includes it; HF pads after it
            if token in eos:
                tokens = tokens[: i + 1]
                break
        outputs.append(tokens)
    return outputs


def logprob_gap(model, rollouts) -> float:
    """Mean |engine log-prob − trainer log-prob| over the response tokens (fp32 on both sides)."""
    from rlhfkit.losses import model_logprobs
    from rlhfkit.packing import pack_rollouts

    batch = pack_rollouts(rollouts).to("cuda")
    with torch.no_grad():
        trainer_logprobs = model_logprobs(model, batch)
    engine_logprobs = torch.cat([torch.cat([torch.zeros(r.prompt_length), r.response_logprobs.float()])
                                 for r in rollouts]).cuda()
    mask = batch.loss_mask
    return float((trainer_logprobs[mask] - engine_logprobs[mask]).abs().mean())


def build_random_model(layers: int) -> str:
    from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model

    path = f"/tmp/ipc-random-llama-{layers}"
    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_model(path, TinyModelConfig(hidden_size=2048, intermediate_size=5632, num_layers=layers,
                                               num_heads=16, num_kv_heads=16, vocab_size=384))
    return path


def sync_once(engine, sender, named, ray) -> dict:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(report=sender.send(named)))
    start = time.perf_counter()
    thread.start()
    worker_reports = ray.get(engine.receive_weights.remote(), timeout=300)
    thread.join(300)
    if "report" not in result:
        raise RuntimeError("sender thread did not finish")
    report = result["report"]
    worker = worker_reports[0] if worker_reports and isinstance(worker_reports[0], dict) else {}
    return {"seconds": time.perf_counter() - start, "sender_seconds": report.seconds, "version": report.version,
            **{f"worker_{k}": worker[k] for k in ("begin_s", "receive_s", "load_s", "finish_s", "layerwise", "seconds")
               if k in worker},
            "bytes": report.num_bytes, "buckets": report.num_buckets, "worker_reports": len(worker_reports)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--random-layers", type=int, default=0, help="build a random 2048-wide Llama of N layers")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--noise", type=float, default=0.02, help="perturbation, in units of each weight's std")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--bucket-mb", type=int, default=256, help="weight-sync bucket size")
    parser.add_argument("--in-process", action="store_true", help="vLLM's engine core in the engine actor's "
                        "process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a collective_rpc is a call, not a ZMQ round trip")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="untimed syncs first")
    parser.add_argument("--no-greedy", action="store_true", help="skip the greedy and log-prob comparisons")
    args = parser.parse_args()
    if bool(args.model) == bool(args.random_layers):
        parser.error("give exactly one of --model and --random-layers")
    args.model = args.model or build_random_model(args.random_layers)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.vllm import VLLMEngineConfig, create_engines
    from rlhfkit.weight_sync import SyncEndpoint, WeightSender, WeightSyncConfig

    dtype = getattr(torch, args.dtype)
    results: dict = {"model": args.model, "device": torch.cuda.get_device_name(0), "dtype": args.dtype,
                     "bucket_mb": args.bucket_mb, "in_process": args.in_process}
    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False)
    pg = ray.util.placement_group([{"GPU": 1, "CPU": 1}])
    ray.get(pg.ready(), timeout=60)
    config = VLLMEngineConfig(model=args.model, dtype=args.dtype, gpu_memory_utilization=0.3, gpu_share=0.5,
                              enforce_eager=True, max_model_len=1024, seed=0,
                              env={"VLLM_USE_FLASHINFER_SAMPLER": "0",
                                   **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if args.in_process else {})})
    (engine,) = create_engines(config, placement_group=pg, bundle_indices=[[0]])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).cuda().eval()
    eos = set(trainer.generation_config.eos_token_id if isinstance(trainer.generation_config.eos_token_id, list)
              else [trainer.generation_config.eos_token_id])
    texts = ["What is 12 + 7?", "The capital of France is", "Write a haiku about GPUs.", "1, 2, 3, 4,"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for t in texts]
    prompts = [list(p["input_ids"] if isinstance(p, dict) else p) for p in prompts]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=args.steps)
    rollouts_before = ray.get(engine.generate.remote(prompts, greedy), timeout=300)
    before = [r.response_token_ids.tolist() for r in rollouts_before]
    named = list(trainer.state_dict().items())
    model_bytes = sum(t.numel() * t.element_size() for _, t in named)
    copy_bps = copy_bandwidth(torch.device("cuda"), torch.device("cuda"), min(model_bytes, 2 * 1024**3))
    results |= {"num_params": sum(t.numel() for _, t in named), "bytes": model_bytes, "d2d_copy_GBps": copy_bps / 1e9,
                "floor_s": model_bytes / copy_bps}
    generator = torch.Generator(device="cuda").manual_seed(0)

    def train_step() -> None:  # a small perturbation of every weight, in place (the model stays coherent)
        with torch.no_grad():
            for param in trainer.parameters():
                param.add_(torch.randn(param.shape, device="cuda", generator=generator) * param.std() * args.noise)

    train_step()
    sync_config = WeightSyncConfig(backend="cuda_ipc", bucket_bytes=args.bucket_mb * 1024**2, timeout_s=120,
                                   num_buffers=2)
    with WeightSender(sync_config, SyncEndpoint(world_size=2, rank=0, port=0), device=torch.device("cuda:0")) as sender:
        ray.get(engine.init_weight_sync.remote(sync_config, sender.endpoint, first_rank=1), timeout=120)
        syncs = [sync_once(engine, sender, named, ray) for _ in range(args.warmup + args.repeats)]
        # then new weights in the same tensors, and one more sync: the greedy check sees what a later sync
        # delivered, not the first sync's values
        train_step()
        if not args.no_greedy:  # the engine's log-probs of its own tokens vs the trainer's, stale and after the sync
            results["logprob_mean_abs_diff_before_sync"] = logprob_gap(trainer, rollouts_before)
            expected = hf_greedy(trainer, prompts, args.steps, eos)
        results["final_sync"] = sync_once(engine, sender, named, ray)
        rollouts_after = ray.get(engine.generate.remote(prompts, greedy), timeout=300)
        after = [r.response_token_ids.tolist() for r in rollouts_after]
        if not args.no_greedy:
            results["logprob_mean_abs_diff_after_sync"] = logprob_gap(trainer, rollouts_after)
        ray.get(engine.close_weight_sync.remote(), timeout=60)
    timed = sorted(s["seconds"] for s in syncs[args.warmup:])
    sender_timed = sorted(s["sender_seconds"] for s in syncs[args.warmup:])
    results |= {
        "syncs": syncs,
        "median_s": timed[len(timed) // 2], "sender_median_s": sender_timed[len(timed) // 2],
        "median_over_floor": timed[len(timed) // 2] / results["floor_s"],
        "sender_median_over_floor": sender_timed[len(timed) // 2] / results["floor_s"],
        "engine_weight_version": ray.get(engine.get_weight_version.remote(), timeout=60),
        "greedy_changed_by_sync": after != before,
    }
    if not args.no_greedy:
        results |= {"greedy_equal_after_sync": after == expected,
                    "per_prompt_equal": [a == e for a, e in zip(after, expected)], "after": after,
                    "expected": expected}
    print(json.dumps({k: v for k, v in results.items() if k not in ("after", "expected")}, indent=2))
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=2)
    ray.shutdown()


if __name__ == "__main__":
    main()
