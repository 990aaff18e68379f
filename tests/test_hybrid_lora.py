"""LoRA in a real hybrid run on CPU (issue 20): Ray with one logical GPU, a DeepSpeed ZeRO-1 actor that trains peft
adapters only, rlhfkit's HF engine receiving adapter-only pushes over gloo; and the LoRA errors raised before Ray
or any actor starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("deepspeed")
ray = pytest.importorskip("ray")

from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
from rlhfkit.hybrid import Hybrid, HybridConfig, TrainerConfig, plan_hybrid
from rlhfkit.lora import LoraConfig

DEEPSPEED = DeepSpeedEngineConfig(zero_stage=1, bf16=False, optimizer="torch_adamw", learning_rate=5e-2)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))


def _config(path, **kwargs) -> HybridConfig:
    return HybridConfig(model=str(path), device="cpu", engine="hf", call_timeout_s=120, sync_timeout_s=60, **kwargs)


def pg_loss(logprobs, micro, *, num_tokens, num_seqs):
    from rlhfkit.losses import policy_loss

    return policy_loss(logprobs, micro.old_logprobs, micro.advantages, micro.batch.loss_mask, micro.batch.cu_seqlens,
                       num_tokens=num_tokens, num_seqs=num_seqs)


def _grpo_step(run, step: int):
    """One GRPO step of examples/grpo_hybrid.py's shape; returns the rollouts' batch and their engine log-probs."""
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.experience import ExperienceConfig, engine_token_logprobs, make_experience
    from rlhfkit.packing import pack_rollouts

    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    rollouts = run.engines.generate(prompts, SamplingConfig(n=4, max_new_tokens=6, seed=step))
    batch = pack_rollouts(rollouts)
    ref = run.trainers["reference"].forward(batch)
    scores = torch.tensor([float(int(r.response_token_ids.sum()) % 3) for r in rollouts])
    experience, _ = make_experience(rollouts, scores, config=ExperienceConfig(estimator="grpo"),
                                    policy_logprobs_fn=lambda b: engine_token_logprobs(rollouts, b),
                                    ref_logprobs_fn=lambda b: ref)
    actor = run.trainers["actor"]
    stats = actor.forward_backward(experience, pg_loss).metrics()
    stats |= actor.optim_step(sleep_after="keep_weights").metrics()
    stats |= run.push_weights()
    return experience, stats


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("overlap, kept", [(False, False), (True, False), (True, True)],
                         ids=["switches", "overlapped-switches", "states-kept"])
def test_hybrid_grpo_with_lora_trains_adapters_and_pushes_only_them(ray_address, tiny_llama_path, overlap, kept):
    """Two GRPO steps with a LoRA actor: each push carries only the adapter (12 tensors, a few KiB, not the model),
    the engine's weight version follows, and after the push the engine samples from the trained policy: its
    log-probs of fresh rollouts equal the actor's (adapter merged on the engine, unmerged on the trainer). The same
    with the trainers' sleeps behind the next wakes (the plan's ``overlap_switches``, on a GPU where it fits), and
    with the actor's weights and optimizer states kept on the device through its sleeps (what the plan chooses for
    a 7B LoRA actor on an 80 GB GPU). The plan gives the engines sleep level 1 (a push carries the adapters only)."""
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.experience import engine_token_logprobs
    from rlhfkit.packing import pack_rollouts

    if ray.is_initialized():
        ray.shutdown()
    config = _config(tiny_llama_path)
    trainers = {"actor": TrainerConfig(deepspeed=DEEPSPEED, lora=LORA), "reference": TrainerConfig(deepspeed=DEEPSPEED)}
    plan = plan_hybrid(config, trainers, gpu_memory_gib=None, host_memory_gib=None)
    assert plan.engine.sleep_level == 1
    plan = dataclasses.replace(plan, overlap_switches=overlap).replace_role("actor", keep_weights=kept,
                                                                             keep_optimizer=kept)
    run = Hybrid.start(config, trainers, plan=plan)
    try:
        adapter_bytes = 2 * 4 * 4 * (64 + 64) + 2 * 4 * 4 * (64 + 32) + 2 * 4 * 4 * (64 + 128)  # fp32 A and B
        for step in range(2):
            run.timer.start_step()
            _, stats = _grpo_step(run, step)
            timed = run.timer.end_step()
            assert stats["actor/grad_norm"] > 0
            assert stats["sync/bytes"] == adapter_bytes and stats["engine/weight_version"] == step + 1
            assert (timed.get("time/overlapped_sleep_s", 0.0) > 0) == overlap  # the sleeps did run behind wakes
        rollouts = run.engines.generate([[5, 6, 7], [12, 13]], SamplingConfig(n=2, max_new_tokens=6, seed=9))
        batch = pack_rollouts(rollouts)
        engine = engine_token_logprobs(rollouts, batch)
        trainer = run.trainers["actor"].forward(batch)
        reference = run.trainers["reference"].forward(batch)
        mask = batch.loss_mask
        assert (trainer[mask] - engine[mask]).abs().max() < 1e-4
        assert (trainer[mask] - reference[mask]).abs().max() > 1e-3  # the adapters trained: not the base policy
        # the actor with its adapters switched off is the reference policy: a LoRA run needs no reference model
        base = run.trainers["actor"].forward(batch, adapters=False)
        assert (base[mask] - reference[mask]).abs().max() < 1e-5
        with pytest.raises(ValueError, match=r"adapters=False.*only a LoRA role"):
            run.trainers["reference"].forward(batch, adapters=False)
    finally:
        run.close()


def test_lora_errors_come_before_ray_starts(tiny_llama_path):
    """Regression (issue 20): an unknown LoRA target, LoRA on a non-actor role and engine sleep level 2 (which would
    drop the base weights an adapter push never rewrites) are ValueErrors raised before any actor starts, with no
    Ray left running."""
    if ray.is_initialized():
        ray.shutdown()
    bad = LoraConfig(rank=4, target_modules=("q_proj", "c_attn"))
    with pytest.raises(ValueError, match=r"\['c_attn'\] match no Linear module.*candidates"):
        Hybrid.start(_config(tiny_llama_path), {"actor": TrainerConfig(deepspeed=DEEPSPEED, lora=bad)})
    with pytest.raises(ValueError, match="trainers\\['reference'\\].lora"):
        Hybrid.start(_config(tiny_llama_path), {"actor": TrainerConfig(deepspeed=DEEPSPEED),
                                                "reference": TrainerConfig(deepspeed=DEEPSPEED, lora=LORA)})
    actor = {"actor": TrainerConfig(deepspeed=DEEPSPEED, lora=LORA)}
    for config in (_config(tiny_llama_path), HybridConfig(model=str(tiny_llama_path), engine="vllm")):  # vLLM too
        level2 = plan_hybrid(config, actor, gpu_memory_gib=None, host_memory_gib=None).replace_engine(sleep_level=2)
        with pytest.raises(ValueError, match="sleep_level=2 discards the engines' base weights"):
            Hybrid.start(config, actor, plan=level2)
    assert not ray.is_initialized()


def test_lora_with_vllm_engine_is_accepted(tiny_llama_path):
    """Regression (issue 20 item 5): Hybrid.start no longer refuses LoRA with engine='vllm' (adapters are pushed into
    vLLM in memory); the checks before Ray still run (an unknown target is still refused)."""
    from rlhfkit.hybrid._launch import _check_lora

    config = HybridConfig(model=str(tiny_llama_path), engine="vllm")
    _check_lora(config, {"actor": TrainerConfig(deepspeed=DEEPSPEED, lora=LORA)})
    with pytest.raises(ValueError, match="c_attn"):
        _check_lora(config, {"actor": TrainerConfig(deepspeed=DEEPSPEED,
                                                     lora=LoraConfig(rank=4, target_modules=("c_attn",)))})


def test_output_layer_target_is_refused_before_ray_starts(tiny_llama_path):
    """Regression (issue 50 item 7): an lm_head target passed Hybrid.start's LoRA check and failed at the first
    push (the engines' adapter manifests leave the output layer out); now the check refuses it, naming the module
    and why, for both engines."""
    from rlhfkit.hybrid._launch import _check_lora

    lora = LoraConfig(rank=4, target_modules=("q_proj", "lm_head"))
    for engine in ("hf", "vllm"):
        config = HybridConfig(model=str(tiny_llama_path), engine=engine)
        with pytest.raises(ValueError, match=r"'lm_head' targets the output layer 'lm_head'.*not supported"):
            _check_lora(config, {"actor": TrainerConfig(deepspeed=DEEPSPEED, lora=lora)})
