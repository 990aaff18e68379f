#!/usr/bin/env python3
"""Benchmark of rlhfkit.engines.vllm on the GPU machine (vLLM 0.22.1, Ray 2.60, one H100/H200).

    python bench/vllm_engine.py --model PATH_TO_SmolLM2-135M-Instruct --out results.json [--large] [--only NAME ...]

Each section runs in its own subprocess (GPU memory is returned between sections; one crash does not stop the rest)
and prints ``RESULT {json}``; the parent writes all of them to ``--out`` and prints a summary. Sections:

  tiny        a tiny random Llama (built here): generation, greedy tokens and log-probs vs HF transformers (bf16).
  model       --model: generation, greedy answer text, engine log-probs vs HF transformers bf16 on the same sampled
              tokens (mean |delta|, goal <= 0.02 nats) at temperature 1.0 and 0.7.
  throughput  --model: tokens/s through an engine Ray actor (EngineGroup) / raw vllm.LLM.generate on the same prompts,
              same process group, alternating runs (goal >= 0.97); then ray.kill of the engine actor and a call
              through the group: the error must come within the timeout.
  sleep       a random-weight Llama (>= 1.5B parameters with --large, else --model): level 1 and 2 sleep — fraction
              of the engine's GPU memory released (goal >= 95%), sleep/wake time / floor (weight bytes / pinned
              host<->device bandwidth measured here), greedy tokens identical after wake (level 2: after reloading
              the weights through load_weights).
  tp2         only with >= 2 GPUs: a TP=2 engine actor through vLLM's Ray executor in a placement group.

Env: VLLM_USE_FLASHINFER_SAMPLER=0 is set (flashinfer is not in the GPU kit). BENCH_SECTION_TIMEOUT (s, default 300).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

GiB = 1 << 30
HERE = os.path.abspath(__file__)
WORK = os.environ.get("BENCH_DIR", "/tmp/rlhfkit-bench-vllm")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def emit(**values) -> None:
    print("RESULT " + json.dumps(values, default=str), flush=True)


def free_bytes() -> int:
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a one-turn chat prompt (plain text where the tokenizer has no chat template)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    return [int(t) for t in tokenizer(text)["input_ids"]]


def prompts_for(tokenizer_path: str | None, count: int, vocab: int) -> list[list[int]]:
    """Token-id prompts: chat-formatted questions when a tokenizer is there, else random ids."""
    import random

    rng = random.Random(0)
    if tokenizer_path and os.path.exists(os.path.join(tokenizer_path, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        topics = ["the moon", "rivers", "prime numbers", "bread", "volcanoes", "music", "chess", "glaciers"]
        out = []
        for i in range(count):
            text = f"Write a short story about {topics[i % len(topics)]} number {i}."
            out.append(chat_ids(tokenizer, text))
        return out
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(8, 48))] for _ in range(count)]


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    import torch

    ids = torch.tensor([prompt + response], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    scaled = torch.log_softmax(logits / temperature, -1)
    return scaled.gather(1, ids[0, len(prompt):, None]).squeeze(1).tolist()


def logprob_delta(engine, model, prompts, temperature: float, max_new_tokens: int) -> dict:
    from rlhfkit.engines.protocol import SamplingConfig

    rollouts = engine.generate(prompts, SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                                                       seed=1))
    deltas = []
    for rollout in rollouts:
        reference = hf_logprobs(model, rollout.prompt_token_ids.tolist(), rollout.response_token_ids.tolist(),
                                temperature)
        deltas.extend(abs(a - b) for a, b in zip(rollout.response_logprobs.tolist(), reference))
    deltas.sort()
    return {"temperature": temperature, "tokens": len(deltas), "mean_abs": sum(deltas) / len(deltas),
            "p99_abs": deltas[int(0.99 * (len(deltas) - 1))], "max_abs": deltas[-1]}


def engine_config(model: str, **overrides):
    from rlhfkit.engines.vllm import VLLMEngineConfig

    settings = dict(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
                    gpu_memory_utilization=0.3, env={"VLLM_USE_FLASHINFER_SAMPLER": "0"})
    settings.update(overrides)
    return VLLMEngineConfig(**settings)


# ------------------------------------------------------------------------------------------------- sections
def section_tiny(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.vllm import VLLMEngine
    from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model

    path = build_tiny_model(os.path.join(WORK, "tiny"), TinyModelConfig(hidden_size=256, num_heads=4, num_kv_heads=2,
                                                                        intermediate_size=688, num_layers=4))
    t0 = time.perf_counter()
    engine = VLLMEngine(engine_config(str(path), gpu_memory_utilization=0.2))
    start_s = time.perf_counter() - t0
    prompts = prompts_for(None, 256, 300)
    sampling = SamplingConfig(max_new_tokens=128, temperature=1.0, ignore_eos=True)
    engine.generate(prompts[:8], sampling)
    t0 = time.perf_counter()
    rollouts = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - t0
    tokens = sum(r.response_length for r in rollouts)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    emit(section="tiny", ok=True, engine_start_s=round(start_s, 1), tokens=tokens,
         tokens_per_s=round(tokens / seconds), logprobs=logprob_delta(engine, model, prompts[:32], 1.0, 32))


def section_model(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.vllm import VLLMEngine

    t0 = time.perf_counter()
    engine = VLLMEngine(engine_config(args.model))
    start_s = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    question = chat_ids(tokenizer, "What is the capital of France?")
    answer = engine.generate([question], SamplingConfig(max_new_tokens=24, temperature=0.0))[0]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    prompts = prompts_for(args.model, 48, tokenizer.vocab_size)
    deltas = [logprob_delta(engine, model, prompts, t, 64) for t in (1.0, 0.7)]
    emit(section="model", ok=deltas[0]["mean_abs"] <= 0.02, engine_start_s=round(start_s, 1),
         answer=tokenizer.decode(answer.response_token_ids), finish=answer.finish_reason, logprobs=deltas)


def _time_generate(call, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def section_throughput(args) -> None:
    import ray
    import vllm

    from rlhfkit.engines._vllm_compat import detect_features
    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.router import EngineDiedError
    from rlhfkit.engines.vllm import build_llm_kwargs, create_engine_group

    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=False)
    config = engine_config(args.model, gpu_memory_utilization=0.35, gpu_share=0.5, generate_timeout_s=60)
    t0 = time.perf_counter()
    group = create_engine_group(config)
    actor_start_s = time.perf_counter() - t0
    raw = vllm.LLM(**build_llm_kwargs(config, detect_features(vllm)))
    prompts = prompts_for(args.model, args.num_prompts, 30000)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, ignore_eos=True)
    params = vllm.SamplingParams(max_tokens=args.max_new_tokens, temperature=1.0, ignore_eos=True, logprobs=0,
                                 detokenize=False)
    requests = [vllm.TokensPrompt(prompt_token_ids=p) for p in prompts]
    group.generate(prompts[:16], sampling)
    raw.generate(requests[:16], params, use_tqdm=False)
    raw_times, actor_times = [], []
    for _ in range(args.repeats):  # alternate, so drift (clocks, other load) hits both alike
        raw_times += _time_generate(lambda: raw.generate(requests, params, use_tqdm=False), 1)
        actor_times += _time_generate(lambda: group.generate(prompts, sampling), 1)
    tokens = len(prompts) * args.max_new_tokens
    raw_best, actor_best = min(raw_times), min(actor_times)
    ratio = raw_best / actor_best
    handle = group.engines[0]
    ray.kill(handle)
    t0 = time.perf_counter()
    try:
        group.generate(prompts[:4], sampling)
        killed = {"error": None}
    except EngineDiedError as error:
        killed = {"error": str(error)[:300], "type": type(error).__name__, "engine_index": error.engine_index}
    killed.update(seconds=round(time.perf_counter() - t0, 3), timeout_s=config.generate_timeout_s)
    emit(section="throughput", ok=ratio >= 0.97 and killed.get("type") == "EngineDiedError",
         tokens_per_run=tokens, raw_tok_per_s=round(tokens / raw_best), actor_tok_per_s=round(tokens / actor_best),
         ratio_actor_over_raw=round(ratio, 4), raw_times=[round(t, 3) for t in raw_times],
         actor_times=[round(t, 3) for t in actor_times], actor_start_s=round(actor_start_s, 1), killed_engine=killed)


def pinned_bandwidth(num_bytes: int = 2 * GiB, repeats: int = 3) -> dict:
    import torch

    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    result = {}
    for name, (dst, src) in {"h2d": (device, host), "d2h": (host, device), "d2d": (device, device.clone())}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        result[f"{name}_gb_per_s"] = num_bytes / best / 1e9 * (2 if name == "d2d" else 1)  # d2d counts read+write
    del host, device
    torch.cuda.empty_cache()
    return result


def build_random_llama(source: str | None, large: bool) -> tuple[str, int]:
    """A random-weight bf16 Llama written as an HF folder (weights drawn on the GPU, saved with safetensors); reuses
    the tokenizer of ``source`` when it has one. Returns (path, parameter bytes)."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path = os.path.join(WORK, "random-llama-large" if large else "random-llama-small")
    vocab = 32000
    if source and os.path.exists(os.path.join(source, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(source))
    shape = (dict(hidden_size=2048, num_hidden_layers=28, intermediate_size=5632, num_attention_heads=16,
                  num_key_value_heads=16) if large else
             dict(hidden_size=768, num_hidden_layers=8, intermediate_size=2048, num_attention_heads=12,
                  num_key_value_heads=4))
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=False,
                         torch_dtype="bfloat16", **shape)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    if source and os.path.exists(os.path.join(source, "tokenizer_config.json")):
        for name in os.listdir(source):
            if name.startswith("tokenizer") or name in ("special_tokens_map.json", "vocab.json", "merges.txt"):
                shutil.copy(os.path.join(source, name), path)
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        shapes.update({prefix + "self_attn.q_proj.weight": (h, h), prefix + "self_attn.k_proj.weight": (kv, h),
                       prefix + "self_attn.v_proj.weight": (kv, h), prefix + "self_attn.o_proj.weight": (h, h),
                       prefix + "mlp.gate_proj.weight": (i, h), prefix + "mlp.up_proj.weight": (i, h),
                       prefix + "mlp.down_proj.weight": (h, i), prefix + "input_layernorm.weight": (h,),
                       prefix + "post_attention_layernorm.weight": (h,)})
    generator = torch.Generator(device="cuda").manual_seed(0)
    state, total = {}, 0
    for name, size in shapes.items():
        tensor = (torch.ones(size, device="cuda") if name.endswith("norm.weight") else
                  torch.randn(size, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
        state[name] = tensor.cpu()
        total += tensor.numel() * 2
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path, total


def _sleep_cycle(engine, level: int, path: str, free_awake: int, engine_bytes: int, prompts, greedy,
                 before) -> dict:
    """sleep(level) -> wake weights -> (level 2: load_weights from the checkpoint) -> wake KV cache -> generate."""
    import torch
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    engine.sleep(level)
    sleep_s = time.perf_counter() - t0
    released = (free_bytes() - free_awake) / engine_bytes
    t0 = time.perf_counter()
    engine.wake_up(["weights"])
    wake_weights_s = time.perf_counter() - t0
    load_s = None
    if level == 2:
        state = load_file(os.path.join(path, "model.safetensors"), device="cuda")
        t0 = time.perf_counter()
        engine.load_weights(state.items())
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        del state
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    engine.wake_up(["kv_cache"])
    wake_kv_s = time.perf_counter() - t0
    after = [r.response_token_ids.tolist() for r in engine.generate(prompts, greedy)]
    return {"released_fraction": round(released, 4), "sleep_s": round(sleep_s, 3),
            "wake_weights_s": round(wake_weights_s, 3), "wake_kv_s": round(wake_kv_s, 3),
            "greedy_identical": after == before, "load_weights_s": None if load_s is None else round(load_s, 3)}


def section_sleep(args) -> None:
    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.vllm import VLLMEngine

    # In-process engine core: load_weights hands CUDA tensors to the worker without serializing them.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.perf_counter()
    path, weight_bytes = build_random_llama(args.model, args.large)
    build_s = time.perf_counter() - t0
    bandwidth = pinned_bandwidth()
    free_before = free_bytes()
    engine = VLLMEngine(engine_config(path, enable_sleep_mode=True, gpu_memory_utilization=args.sleep_gpu_util,
                                      max_model_len=512))
    free_awake = free_bytes()
    engine_bytes = free_before - free_awake
    greedy = SamplingConfig(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = prompts_for(None, 8, 1000)
    before = [r.response_token_ids.tolist() for r in engine.generate(prompts, greedy)]
    out = {"section": "sleep", "params": weight_bytes // 2, "weight_gib": round(weight_bytes / GiB, 3),
           "engine_gib": round(engine_bytes / GiB, 3), "build_s": round(build_s, 1), **bandwidth}
    floors = {"sleep1": weight_bytes / (bandwidth["d2h_gb_per_s"] * 1e9),
              "wake1": weight_bytes / (bandwidth["h2d_gb_per_s"] * 1e9),
              "load": weight_bytes / (bandwidth["d2d_gb_per_s"] * 1e9 / 2)}
    for level in (1, 2):
        out[f"level{level}"] = _sleep_cycle(engine, level, path, free_awake, engine_bytes, prompts, greedy, before)
    level1, level2 = out["level1"], out["level2"]
    level1.update(sleep_over_floor=round(level1["sleep_s"] / floors["sleep1"], 2),
                  wake_over_floor=round((level1["wake_weights_s"] + level1["wake_kv_s"]) / floors["wake1"], 2),
                  floor_sleep_s=round(floors["sleep1"], 3), floor_wake_s=round(floors["wake1"], 3))
    level2.update(load_over_d2d_floor=round(level2["load_weights_s"] / floors["load"], 2),
                  floor_load_s=round(floors["load"], 4))
    out["ok"] = all(out[f"level{k}"]["released_fraction"] >= 0.95 and out[f"level{k}"]["greedy_identical"]
                    for k in (1, 2))
    emit(**out)


def section_tp2(args) -> None:
    import ray
    from ray.util.placement_group import placement_group

    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.vllm import create_engine_group

    ray.init(num_gpus=2, include_dashboard=False, log_to_driver=False)
    group_pg = placement_group([{"GPU": 1, "CPU": 1}] * 2, strategy="PACK")
    ray.get(group_pg.ready(), timeout=120)
    from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model

    # SmolLM2-135M has 9 attention heads, which 2 GPUs cannot split: a tiny Llama with 4 heads / 2 KV heads instead.
    path = build_tiny_model(os.path.join(WORK, "tiny-tp2"), TinyModelConfig(hidden_size=256, num_heads=4,
                                                                            num_kv_heads=2, intermediate_size=688))
    config = engine_config(str(path), tensor_parallel_size=2, enable_sleep_mode=True, gpu_share=1.0)
    t0 = time.perf_counter()
    group = create_engine_group(config, placement_group=group_pg)
    start_s = time.perf_counter() - t0
    greedy = SamplingConfig(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = prompts_for(None, 8, 300)
    before = [r.response_token_ids.tolist() for r in group.generate(prompts, greedy)]
    group.sleep(1)
    group.wake_up(["weights"])
    group.wake_up(["kv_cache"])
    after = [r.response_token_ids.tolist() for r in group.generate(prompts, greedy)]
    health = group.health_check()
    emit(section="tp2", ok=before == after, start_s=round(start_s, 1), greedy_identical=before == after,
         workers=[w["rank"] for w in health[0]["workers"]])


SECTIONS = {"tiny": section_tiny, "model": section_model, "throughput": section_throughput, "sleep": section_sleep,
            "tp2": section_tp2}


# ------------------------------------------------------------------------------------------------- driver
def run_section(name: str, argv: list[str], timeout_s: float) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, HERE, "--section", name, *argv], capture_output=True, text=True,
                              timeout=timeout_s)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else \
            (error.stdout or "")
        code = "timeout"
    results = [json.loads(line[7:]) for line in output.splitlines() if line.startswith("RESULT ")]
    result = results[-1] if results else {"section": name, "ok": False, "error": f"exit {code}",
                                          "tail": output[-2500:]}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def summary(results: dict) -> str:
    lines = []
    for name, r in results.items():
        status = "ok " if r.get("ok") else "BAD"
        keys = {"tiny": ("tokens_per_s", "engine_start_s"), "model": ("answer", "engine_start_s"),
                "throughput": ("ratio_actor_over_raw", "raw_tok_per_s", "actor_tok_per_s"),
                "sleep": ("params", "engine_gib", "h2d_gb_per_s", "d2h_gb_per_s"), "tp2": ("greedy_identical",)}
        detail = ", ".join(f"{k}={r.get(k)}" for k in keys.get(name, ()))
        lines.append(f"[{status}] {name:10s} {r.get('wall_s')} s  {detail}  {r.get('error', '')}")
        if name in ("tiny", "model") and "logprobs" in r:
            deltas = r["logprobs"] if isinstance(r["logprobs"], list) else [r["logprobs"]]
            lines += [f"       log-prob |delta| T={d['temperature']}: mean {d['mean_abs']:.4f}, p99 {d['p99_abs']:.4f}"
                      for d in deltas]
        if name == "throughput" and "killed_engine" in r:
            lines.append(f"       killed engine -> {r['killed_engine'].get('type')} in {r['killed_engine']['seconds']}"
                         f" s (timeout {r['killed_engine']['timeout_s']} s)")
        for level in ("level1", "level2"):
            if level in r:
                lines.append(f"       {level}: {r[level]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF folder of a real model (SmolLM2-135M-Instruct)")
    parser.add_argument("--out", help="JSON results path")
    parser.add_argument("--large", action="store_true", help="sleep section on a >= 1.5B-parameter random Llama")
    parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="run only these sections")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sleep-gpu-util", type=float, default=0.3)
    args = parser.parse_args()
    os.makedirs(WORK, exist_ok=True)
    if args.section:
        try:
            SECTIONS[args.section](args)
        except Exception as error:  # noqa: BLE001 - reported as the section's result
            emit(section=args.section, ok=False, error=f"{type(error).__name__}: {error}",
                 traceback=traceback.format_exc()[-2500:])
        return
    import torch

    names = args.only or [n for n in SECTIONS if n != "tp2" or torch.cuda.device_count() >= 2]
    argv = ["--model", args.model, "--num-prompts", str(args.num_prompts), "--max-new-tokens",
            str(args.max_new_tokens), "--repeats", str(args.repeats), "--sleep-gpu-util", str(args.sleep_gpu_util),
            *(["--large"] if args.large else [])]
    timeout_s = float(os.environ.get("BENCH_SECTION_TIMEOUT", "300"))
    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    try:
        import vllm

        results["vllm"] = vllm.__version__
    except ImportError as error:
        results["vllm"] = f"not importable: {error}"
    sections = {}
    for name in names:
        sections[name] = run_section(name, argv, timeout_s)
        print(f"{name}: {json.dumps(sections[name], default=str)[:600]}", flush=True)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({**results, "sections": sections}, handle, indent=1, default=str)
    print("\n" + summary(sections))


if __name__ == "__main__":
    main()
