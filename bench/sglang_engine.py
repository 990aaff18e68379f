#!/usr/bin/env python3
"""Benchmark of rlhfkit.engines.sglang on the GPU machine (issue 23), next to the vLLM engine on the same card.

    eval "$(bash .carry/sglang-tools/install-sglang.sh)"      # prints RLHFKIT_SGLANG_SITE (SGLang's own site dir)
    python bench/sglang_engine.py --model SMOLLM2 --sglang-site "$RLHFKIT_SGLANG_SITE" --out sglang.json [--only ...]
    python bench/sglang_engine.py --fake --only throughput sync --out fake.json   # CPU: the test server (CI)

Each section runs in its own subprocess (GPU memory comes back between sections; one crash does not stop the rest)
and prints ``RESULT {json}``; the parent writes all of them to ``--out`` and prints a summary. Sections:

  model       an fp32 SGLang server on --model: greedy tokens against HF transformers' fp32 greedy decoding of the
              same prompts (goal: equal), and the engine's log-probs against HF fp32 on the engine's own sampled
              tokens at T = 1 (mean |delta|, goal <= 0.02 nats).
  throughput  tokens/s through an SGLang engine Ray actor (EngineGroup, packed results) / the same requests posted
              straight to the same server ("raw SGLang"), --repeats interleaved pairs with the order flipped every
              pair (goal >= 0.97 on the median pair); then the vLLM engine actor on the same prompts and sampling,
              CUDA graphs on for both (SGLang actor / vLLM actor tokens/s).
  sleep       a random-weight Llama of >= 1.5B parameters served by SGLang: level 1 (weights backed up on the host)
              and level 2 (discarded, then rewritten through load_weights) — the fraction of the server's GPU memory
              released (device-wide free memory, goal >= 95%), sleep and wake times against the pinned-copy floor
              measured here, greedy tokens identical after each wake.
  sync        a 1.54B random Llama held by this process (the trainer): rlhfkit.weight_sync CUDA-IPC syncs into an
              SGLang engine actor, then into a vLLM engine actor on the same GPU, the same sender settings; median of
              --repeats after --warmup, each against the floor of one device copy of the same bytes.

--fake runs the sections that need no GPU (throughput, sync) against tests/_fake_sglang (a real HTTP server with
SGLang's endpoints and deterministic tokens), on CPU (Ray without GPUs, gloo instead of CUDA IPC), without the vLLM
halves: CI runs it to keep this script's SGLang calls working between GPU sessions.

Env: VLLM_USE_FLASHINFER_SAMPLER=0 is set (flashinfer is not in the GPU kit). BENCH_SECTION_TIMEOUT (s, default 420).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.abspath(__file__)
BENCH = os.path.dirname(HERE)
FAKE = os.path.join(os.path.dirname(BENCH), "tests", "_fake_sglang")
GiB = 1 << 30
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)


from vllm_engine import _median, _timed, emit, run_in_this_process, run_section  # the vLLM bench's helpers


def sglang_config(model: str, args, **overrides):
    """The engine config every section starts from: the real server from ``--sglang-python`` with ``--sglang-site``
    on its PYTHONPATH, or (``--fake``) the test server under this interpreter."""
    from rlhfkit.engines.sglang import SGLangEngineConfig

    if args.fake:
        python, env = sys.executable, {"PYTHONPATH": FAKE}
    else:
        python, env = args.sglang_python, ({"PYTHONPATH": args.sglang_site} if args.sglang_site else {})
    settings = dict(model=model, python=python, env=env, dtype="bfloat16", mem_fraction_static=0.3,
                    context_length=1024, seed=0, startup_timeout_s=600.0, generate_timeout_s=300.0,
                    control_timeout_s=300.0, log_path=os.path.join(args.work, f"sglang-{args.section}.log"))
    settings.update(overrides)
    return SGLangEngineConfig(**settings)


def start_sglang_actor(config, *, gpu_share: float):
    """An SGLang engine Ray actor (its server on the actor's GPU) and its ``ready()`` answer."""
    import ray

    from rlhfkit.engines.sglang import SGLangEngineActor

    handle = ray.remote(SGLangEngineActor).options(num_gpus=gpu_share, num_cpus=0, max_restarts=0).remote(config)
    return handle, ray.get(handle.ready.remote(), timeout=config.startup_timeout_s)


def stop_actor(handle) -> None:
    """Close the engine (its server runs in a session of its own and would outlive a killed actor), then kill."""
    import ray

    try:
        ray.get(handle.close.remote(), timeout=120)
    finally:
        ray.kill(handle)


def _ray_init(args) -> None:
    """A local Ray for the section, or the cluster ``$RAY_ADDRESS`` names (a test session's, a running one)."""
    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=False)
        return
    ray.init(num_gpus=0 if args.fake else 1, num_cpus=4, include_dashboard=False, log_to_driver=False)


# ------------------------------------------------------------------------------------------------- sections
def section_model(args) -> None:
    import torch
    from ipc_to_vllm import hf_greedy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm_engine import chat_ids, logprob_delta, prompts_for

    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.sglang import SGLangEngine

    started = time.perf_counter()
    # float32 needs SGLang's Triton attention (FlashAttention 3, its default on Hopper, has no fp32 kernels)
    engine = SGLangEngine(sglang_config(args.model, args, dtype="float32",
                                        extra_args=("--attention-backend", "triton")))
    start_s = time.perf_counter() - started
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).cuda().eval()
        eos = reference.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        prompts = prompts_for(args.model, 16, tokenizer.vocab_size)
        greedy = SamplingConfig(max_new_tokens=32, temperature=0.0)
        got = [r.response_token_ids.tolist() for r in engine.generate(prompts, greedy)]
        expected = hf_greedy(reference, prompts, 32, eos)
        equal = [g == e for g, e in zip(got, expected, strict=True)]
        diverged = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
                    for g, e, same in zip(got, expected, equal) if not same]
        question = chat_ids(tokenizer, "What is the capital of France?")
        answer = engine.generate([question], SamplingConfig(max_new_tokens=24, temperature=0.0))[0]
        delta = logprob_delta(engine, None, prompts_for(args.model, 48, tokenizer.vocab_size), 1.0, 64, reference)
    finally:
        engine.close()
    emit(section="model", ok=all(equal) and delta["mean_abs"] <= 0.02, engine_start_s=round(start_s, 1),
         greedy_equal=sum(equal), greedy_prompts=len(equal), first_divergence=diverged,
         answer=tokenizer.decode(answer.response_token_ids), logprobs=delta)


def section_throughput(args) -> None:
    import ray

    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.router import EngineGroup, EngineGroupConfig
    from rlhfkit.engines.sglang import generate_payload
    from rlhfkit.engines.sglang._http import SGLangClient

    _ray_init(args)
    if args.fake:
        prompts = [[1 + (i * 7 + j) % 300 for j in range(8 + i % 24)] for i in range(args.num_prompts)]
    else:
        from vllm_engine import prompts_for

        prompts = prompts_for(args.model, args.num_prompts, 30000)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, ignore_eos=True)
    config = sglang_config(args.model or "unused-by-the-fake", args, mem_fraction_static=0.35)
    started = time.perf_counter()
    handle, info = start_sglang_actor(config, gpu_share=0 if args.fake else 0.5)
    start_s = time.perf_counter() - started
    group = EngineGroup([handle], forward_prompt_indices=True,
                        config=EngineGroupConfig(generate_timeout_s=300.0, control_timeout_s=300.0))
    # the very body the engine posts: the raw side differs only by the actor and the result's unpacking
    client, payload = SGLangClient(info["url"], engine_index=0), generate_payload(prompts, range(len(prompts)),
                                                                                  sampling)
    run_raw = lambda: client.request("/generate", payload, timeout_s=300.0)
    run_actor = lambda: group.generate(prompts, sampling)
    try:
        raw_answer, actor_rollouts = run_raw(), run_actor()  # full-size warm-up of both
        same_tokens = [item["output_ids"] for item in raw_answer] == [r.response_token_ids.tolist()
                                                                       for r in actor_rollouts]
        raw_times, actor_times = [], []
        for pair in range(args.repeats):  # interleaved, the order flipped every pair: drift hits both alike
            first, second = (run_raw, run_actor) if pair % 2 == 0 else (run_actor, run_raw)
            a, b = _timed(first), _timed(second)
            raw_times.append(a if pair % 2 == 0 else b)
            actor_times.append(b if pair % 2 == 0 else a)
    finally:
        stop_actor(handle)
    tokens = len(prompts) * args.max_new_tokens
    pair_ratios = [raw / actor for raw, actor in zip(raw_times, actor_times)]
    out = {"section": "throughput", "tokens_per_run": tokens, "actor_start_s": round(start_s, 1),
           "ratio_actor_over_raw": round(_median(pair_ratios), 4), "pair_ratios": [round(r, 4) for r in pair_ratios],
           "raw_tok_per_s": round(tokens / _median(raw_times)), "actor_tok_per_s": round(tokens / _median(actor_times)),
           "raw_times": [round(t, 3) for t in raw_times], "actor_times": [round(t, 3) for t in actor_times]}
    if not args.fake:  # the vLLM engine actor on the same prompts, sampling and card (CUDA graphs on, as SGLang's)
        from vllm_engine import engine_config

        from rlhfkit.engines.vllm import create_engine_group

        vllm_group = create_engine_group(engine_config(args.model, enforce_eager=False, gpu_memory_utilization=0.35,
                                                       gpu_share=0.5, generate_timeout_s=300))
        vllm_group.generate(prompts, sampling)  # warm-up
        vllm_times = [_timed(lambda: vllm_group.generate(prompts, sampling)) for _ in range(args.repeats)]
        for engine in vllm_group.engines:
            ray.kill(engine)
        out |= {"vllm_actor_tok_per_s": round(tokens / _median(vllm_times)),
                "vllm_times": [round(t, 3) for t in vllm_times],
                "ratio_sglang_actor_over_vllm_actor": round(_median(vllm_times) / _median(actor_times), 4)}
    if args.fake:  # deterministic tokens: the actor's results must be the raw requests' own
        out |= {"same_tokens_as_raw": same_tokens, "ok": same_tokens}
    else:  # sampled tokens differ between runs; the goal is the speed
        out["ok"] = out["ratio_actor_over_raw"] >= 0.97
    emit(**out)


def section_sleep(args) -> None:
    from vllm_engine import _sleep_cycle, build_random_llama, free_bytes, pinned_bandwidth, prompts_for

    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.sglang import SGLangEngine

    started = time.perf_counter()
    path, weight_bytes, vocab = build_random_llama(args.model, large=True)
    build_s = time.perf_counter() - started
    bandwidth = pinned_bandwidth()
    free_before = free_bytes()
    engine = SGLangEngine(sglang_config(path, args, enable_memory_saver=True, weights_cpu_backup=True,
                                        mem_fraction_static=args.sleep_mem_fraction, context_length=512))
    try:
        free_awake = free_bytes()
        engine_bytes = free_before - free_awake
        greedy = SamplingConfig(max_new_tokens=32, temperature=0.0, ignore_eos=True)
        prompts = prompts_for(None, 8, min(vocab, 1000))  # ids below both vocabularies (model and tokenizer)
        before = [r.response_token_ids.tolist() for r in engine.generate(prompts, greedy)]
        out = {"section": "sleep", "params": weight_bytes // 2, "weight_gib": round(weight_bytes / GiB, 3),
               "engine_gib": round(engine_bytes / GiB, 3), "build_s": round(build_s, 1), **bandwidth}
        for level in (1, 2):
            out[f"level{level}"] = _sleep_cycle(engine, level, path, free_awake, engine_bytes, prompts, greedy,
                                                before)
    finally:
        engine.close()
    floor_sleep = weight_bytes / (bandwidth["d2h_gb_per_s"] * 1e9)
    floor_wake = weight_bytes / (bandwidth["h2d_gb_per_s"] * 1e9)
    level1, level2 = out["level1"], out["level2"]
    level1.update(sleep_over_floor=round(level1["sleep_s"] / floor_sleep, 2),
                  wake_over_floor=round((level1["wake_weights_s"] + level1["wake_kv_s"]) / floor_wake, 2),
                  floor_sleep_s=round(floor_sleep, 3), floor_wake_s=round(floor_wake, 3))
    level2.update(load_over_d2d_floor=round(level2["load_weights_s"] / (weight_bytes / (bandwidth["d2d_gb_per_s"]
                                                                                         * 1e9 / 2)), 2))
    out["ok"] = all(out[f"level{k}"]["released_fraction"] >= 0.95 and out[f"level{k}"]["greedy_identical"]
                    for k in (1, 2)) and weight_bytes // 2 >= 1_500_000_000
    emit(**out)


def _syncs_into(engine, named, sync_config, device, args) -> dict:
    import ray
    from ipc_to_vllm import sync_once

    from rlhfkit.weight_sync import SyncEndpoint, WeightSender

    with WeightSender(sync_config, SyncEndpoint(world_size=2, rank=0, port=0), device=device) as sender:
        ray.get(engine.init_weight_sync.remote(sync_config, sender.endpoint, first_rank=1), timeout=120)
        syncs = [sync_once(engine, sender, named, ray) for _ in range(args.warmup + args.repeats)]
        version = ray.get(engine.get_weight_version.remote(), timeout=60)
        ray.get(engine.close_weight_sync.remote(), timeout=60)
    timed = [s["seconds"] for s in syncs[args.warmup:]]
    return {"median_s": round(_median(timed), 5), "sender_median_s": round(_median(
        [s["sender_seconds"] for s in syncs[args.warmup:]]), 5), "engine_weight_version": version,
        "syncs": syncs}


def section_sync(args) -> None:
    import torch

    from rlhfkit.weight_sync import WeightSyncConfig

    _ray_init(args)
    if args.fake:
        from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model

        path = str(build_tiny_model(os.path.join(args.work, "tiny"), TinyModelConfig(), exist_ok=True))
        device, backend, floor_s = torch.device("cpu"), "gloo", None
    else:
        from ipc_to_vllm import build_random_model
        from weight_sync import copy_bandwidth

        path, device, backend = build_random_model(30), torch.device("cuda:0"), "cuda_ipc"
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    named = list(trainer.state_dict().items())
    model_bytes = sum(t.numel() * t.element_size() for _, t in named)
    if not args.fake:
        floor_s = model_bytes / copy_bandwidth(device, device, min(model_bytes, 2 * GiB))
    sync_config = WeightSyncConfig(backend=backend, timeout_s=120)
    out = {"section": "sync", "params": sum(t.numel() for _, t in named), "bytes": model_bytes,
           "bucket_bytes": sync_config.bucket_bytes, "floor_s": None if floor_s is None else round(floor_s, 5)}
    handle, _ = start_sglang_actor(sglang_config(path, args, mem_fraction_static=0.3),
                                   gpu_share=0 if args.fake else 0.5)
    try:
        out["sglang"] = _syncs_into(handle, named, sync_config, device, args)
    finally:
        stop_actor(handle)
    if not args.fake:
        import ray
        from vllm_engine import engine_config

        from rlhfkit.engines.vllm import create_engines

        (engine,) = create_engines(engine_config(path, gpu_memory_utilization=0.3, gpu_share=0.5))
        try:
            out["vllm"] = _syncs_into(engine, named, sync_config, device, args)
        finally:
            ray.kill(engine)
        for name in ("sglang", "vllm"):
            out[name]["over_floor"] = round(out[name]["median_s"] / floor_s, 2)
        out["sglang_over_vllm"] = round(out["sglang"]["median_s"] / out["vllm"]["median_s"], 3)
    out["ok"] = out["sglang"]["engine_weight_version"] == args.warmup + args.repeats
    emit(**out)


SECTIONS = {"model": section_model, "throughput": section_throughput, "sleep": section_sleep, "sync": section_sync}
FAKE_SECTIONS = ("throughput", "sync")


# ------------------------------------------------------------------------------------------------- driver
def summary(results: dict) -> str:
    keys = {"model": ("greedy_equal", "greedy_prompts", "engine_start_s"),
            "throughput": ("ratio_actor_over_raw", "actor_tok_per_s", "raw_tok_per_s", "vllm_actor_tok_per_s",
                           "ratio_sglang_actor_over_vllm_actor"),
            "sleep": ("params", "engine_gib", "h2d_gb_per_s", "d2h_gb_per_s"),
            "sync": ("params", "floor_s", "sglang_over_vllm")}
    lines = []
    for name, result in results.items():
        detail = ", ".join(f"{k}={result.get(k)}" for k in keys.get(name, ()))
        lines.append(f"[{'ok ' if result.get('ok') else 'BAD'}] {name:10s} {result.get('wall_s')} s  {detail}  "
                     f"{result.get('error', '')}")
        if "logprobs" in result:
            lines.append(f"       log-probs T=1 vs HF fp32: mean {result['logprobs']['mean_abs']:.4f}")
        for key in ("level1", "level2", "sglang", "vllm"):
            if isinstance(result.get(key), dict):
                lines.append(f"       {key}: " + json.dumps({k: v for k, v in result[key].items() if k != "syncs"}))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF folder of a real model (SmolLM2-135M-Instruct); not with --fake")
    parser.add_argument("--out", help="JSON results path")
    parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="run only these sections")
    parser.add_argument("--fake", action="store_true",
                        help="CPU: the test server, sections " + ", ".join(FAKE_SECTIONS))
    parser.add_argument("--sglang-python", default="python3", help="the interpreter that starts the SGLang server")
    parser.add_argument("--sglang-site", default=os.environ.get("RLHFKIT_SGLANG_SITE"),
                        help="SGLang's site directory, put on the server's PYTHONPATH (default: $RLHFKIT_SGLANG_SITE)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=6, help="interleaved pairs (throughput); timed syncs (sync)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed syncs before the timed ones (sync)")
    parser.add_argument("--sleep-mem-fraction", type=float, default=0.3)
    parser.add_argument("--work", default=os.environ.get("BENCH_DIR", "/tmp/rlhfkit-bench-sglang"))
    parser.add_argument("--section", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fake:
        wrong = sorted(set(args.only or ()) - set(FAKE_SECTIONS))
        if wrong:
            parser.error(f"--fake runs only {', '.join(FAKE_SECTIONS)} (asked for {', '.join(wrong)})")
    elif not args.model:
        parser.error("--model is required (or --fake on CPU)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    if args.section:
        run_in_this_process(SECTIONS, args)
        return {}
    names = args.only or (list(FAKE_SECTIONS) if args.fake else list(SECTIONS))
    argv_out = [*(["--model", args.model] if args.model else []), *(["--fake"] if args.fake else []),
                "--sglang-python", args.sglang_python,
                *(["--sglang-site", args.sglang_site] if args.sglang_site else []),
                "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
                "--repeats", str(args.repeats), "--warmup", str(args.warmup),
                "--sleep-mem-fraction", str(args.sleep_mem_fraction), "--work", args.work]
    timeout_s = float(os.environ.get("BENCH_SECTION_TIMEOUT", "420"))
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "fake": args.fake}
    sections = {}
    for name in names:
        sections[name] = run_section(name, argv_out, timeout_s, script=HERE)
        print(f"{name}: {json.dumps(sections[name], default=str)[:600]}", flush=True)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({**results, "sections": sections}, handle, indent=1, default=str)
    print("\n" + summary(sections))
    return {**results, "sections": sections}


if __name__ == "__main__":
    main()
