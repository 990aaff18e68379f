"""rlhfkit.hybrid on several (logical) GPUs, on CPU: the actor on two data-parallel ranks takes the same optimizer
step as on one (its loss is normalised by the whole minibatch's counts, so the ranks' summed gradients are the whole
minibatch's), and with the engine on a GPU of its own the push is a gloo broadcast to it."""

from __future__ import annotations

import pytest
import torch


def _start(model: str, **config):
    from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
    from rlhfkit.hybrid import Hybrid, HybridConfig, TrainerConfig, plan_hybrid

    deepspeed = DeepSpeedEngineConfig(zero_stage=1, bf16=False, optimizer="torch_adamw", learning_rate=1e-3)
    hybrid = HybridConfig(model=model, device="cpu", engine="hf", call_timeout_s=120, sync_timeout_s=60, **config)
    trainers = {"actor": TrainerConfig(deepspeed=deepspeed)}
    plan = plan_hybrid(hybrid, trainers, gpu_memory_gib=None, host_memory_gib=None)
    plan = plan.replace_engine(sleep_level=1).replace_role("actor", micro_batch_tokens=64)
    return Hybrid.start(hybrid, trainers, plan=plan)


def pg_loss(logprobs, micro, *, num_tokens, num_seqs):
    from rlhfkit.losses import policy_loss

    return policy_loss(logprobs, micro.old_logprobs, micro.advantages, micro.batch.loss_mask, micro.batch.cu_seqlens,
                       num_tokens=num_tokens, num_seqs=num_seqs)


@pytest.mark.slow
@pytest.mark.ray
def test_two_data_parallel_ranks_take_the_one_rank_step_and_push_by_broadcast(ray_address, tiny_llama_path):
    ray = pytest.importorskip("ray")
    pytest.importorskip("deepspeed")
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.experience import ExperienceConfig, engine_token_logprobs, make_experience

    if ray.is_initialized():
        ray.shutdown()
    one = _start(str(tiny_llama_path))
    try:
        rollouts = one.engines.generate([[5, 6, 7], [8, 9, 10, 11], [12, 13]], SamplingConfig(n=4, max_new_tokens=8,
                                                                                              seed=0))
        scores = torch.arange(len(rollouts), dtype=torch.float32) % 3
        experience, _ = make_experience(rollouts, scores, config=ExperienceConfig(estimator="grpo"),
                                        policy_logprobs_fn=lambda b: engine_token_logprobs(rollouts, b))
        single = one.trainers["actor"].forward_backward(experience, pg_loss).metrics()
        single |= one.trainers["actor"].optim_step().metrics()
    finally:
        one.close()
    assert not ray.is_initialized()
    two = _start(str(tiny_llama_path), num_gpus=3, colocate=False, engine_gpus=1)
    try:
        actor = two.trainers["actor"]
        assert actor.world_size == 2
        double = actor.forward_backward(experience, pg_loss).metrics()
        double |= actor.optim_step(sleep_after="keep_weights").metrics()
        for key in ("actor/loss", "actor/grad_norm"):
            assert double[key] == pytest.approx(single[key], rel=1e-4, abs=1e-7), key
        assert single["actor/loss"] != 0 and single["actor/grad_norm"] > 0
        pushed = two.push_weights()  # rank 0 broadcasts to the engine on its own (logical) GPU over gloo
        assert pushed["engine/weight_version"] == 1
        after = two.engines.generate([[5, 6, 7]], SamplingConfig(n=2, max_new_tokens=4, seed=1))
        assert {r.weight_version for r in after} == {1}
    finally:
        two.close()
