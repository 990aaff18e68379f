"""A hybrid run's checkpoint, resume and export on CPU (Ray with one logical GPU, DeepSpeed ZeRO-1 on CPU, the HF
engine): a run resumed from a checkpoint in a fresh Hybrid trains exactly as the run that went on; the exported
folder loads with from_pretrained and gives the trainer's log-probs; a LoRA actor exports a peft adapter and a
merged model that agree."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("deepspeed")
ray = pytest.importorskip("ray")

from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
from rlhfkit.hybrid import (Hybrid, HybridConfig, TrainerConfig, export_model, load_checkpoint, plan_for_machine,
                            save_checkpoint)

DEEPSPEED = DeepSpeedEngineConfig(zero_stage=1, bf16=False, optimizer="torch_adamw", learning_rate=1e-3)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]


def _start(path, trainers, *, sleep_level: int = 2) -> Hybrid:
    if ray.is_initialized():
        ray.shutdown()
    # engine sleep level 2 (the engines drop their weights): a resume only works if the load pushes them
    config = HybridConfig(model=str(path), device="cpu", engine="hf", call_timeout_s=120, sync_timeout_s=60)
    plan = plan_for_machine(config, trainers).replace_engine(sleep_level=sleep_level)
    return Hybrid.start(config, trainers, plan=plan)


def pg_loss(logprobs, micro, *, num_tokens, num_seqs):
    from rlhfkit.losses import policy_loss

    return policy_loss(logprobs, micro.old_logprobs, micro.advantages, micro.batch.loss_mask, micro.batch.cu_seqlens,
                       num_tokens=num_tokens, num_seqs=num_seqs)


def _step(run: Hybrid, step: int, *, reference: bool = True):
    """One GRPO step (seeded sampling, scores from the tokens); returns its experience and numbers."""
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.experience import ExperienceConfig, engine_token_logprobs, make_experience
    from rlhfkit.packing import pack_rollouts

    rollouts = run.engines.generate(PROMPTS, SamplingConfig(n=4, max_new_tokens=6, seed=100 + step))
    batch = pack_rollouts(rollouts)
    ref = run.trainers["reference"].forward(batch) if reference else None
    scores = torch.tensor([float(int(r.response_token_ids.sum()) % 3) for r in rollouts])
    experience, _ = make_experience(rollouts, scores, config=ExperienceConfig(estimator="grpo"),
                                    policy_logprobs_fn=lambda b: engine_token_logprobs(rollouts, b),
                                    ref_logprobs_fn=None if ref is None else lambda b: ref)
    actor = run.trainers["actor"]
    stats = actor.forward_backward(experience, pg_loss).metrics()
    stats |= actor.optim_step(sleep_after="keep_weights").metrics()
    run.push_weights()
    tokens = [r.response_token_ids.tolist() for r in rollouts]
    return experience, {"tokens": tokens, "scores": scores.tolist(), "loss": stats["actor/loss"],
                        "grad_norm": stats["actor/grad_norm"], "drawn": torch.rand(1).item()}


def _exported_logprobs(folder, experience) -> torch.Tensor:
    """The exported model's log-prob of each response token, in the packed batch's order (its loss-mask tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    batch, out = experience.batch, []
    with torch.no_grad():
        for start, end in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
            ids, mask = batch.input_ids[start:end], batch.loss_mask[start:end]
            logits = model(ids[None]).logits[0, :-1].log_softmax(-1)
            token = logits.gather(-1, ids[1:, None])[:, 0]
            out.append(token[mask[1:]])
    return torch.cat(out)


@pytest.mark.slow
@pytest.mark.ray
def test_resume_in_a_fresh_hybrid_trains_exactly_as_the_run_that_went_on_and_exports(tiny_llama_path, tmp_path):
    """Run A: step 0, save (step=1), steps 1-2. Run B: a fresh Hybrid loads the checkpoint (engines asleep, roles
    loaded, weights pushed: load_checkpoint's ordering) and runs steps 1-2: the same tokens, scores, losses and
    gradient norms, bitwise (fp32 on CPU; the same weights, Adam states, seeds and RNG). Then the actor's export
    loads with from_pretrained and gives the trainer's log-probs."""
    trainers = {"actor": TrainerConfig(deepspeed=DEEPSPEED), "reference": TrainerConfig(deepspeed=DEEPSPEED)}
    root = tmp_path / "checkpoints"
    run = _start(tiny_llama_path, trainers)
    try:
        torch.manual_seed(7)
        _step(run, 0)
        path = save_checkpoint(run, root, step=1, state={"note": "after step 0"}, config={"lr": 1e-3})
        straight = [_step(run, step)[1] for step in (1, 2)]
    finally:
        run.close()
    meta = json.loads((path / "run.json").read_text())
    assert meta["step"] == 1 and meta["config"]["run"] == {"lr": 1e-3} and set(meta["roles"]) == {"actor"}
    assert meta["weight_version"] == 1

    run = _start(tiny_llama_path, trainers)
    try:
        torch.manual_seed(1234)  # overwritten by the checkpoint's RNG states
        restored = load_checkpoint(run, path)
        assert (restored.step, restored.state, restored.roles) == (1, {"note": "after step 0"}, ("actor",))
        resumed = []
        for step in (1, 2):
            experience, numbers = _step(run, step)
            resumed.append(numbers)
        assert resumed == straight  # bitwise: tokens, scores, loss, grad norm and the driver's next random draw

        actor = run.trainers["actor"]
        folder = export_model(run, tmp_path / "export")
        for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"):
            assert (folder / name).is_file(), name
        trained = actor.forward(experience.batch)[experience.batch.loss_mask]
        assert torch.allclose(_exported_logprobs(folder, experience), trained, atol=1e-5)
    finally:
        run.close()
    with pytest.raises(ValueError, match="not a complete run checkpoint"):
        load_checkpoint(run, tmp_path)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_lora_export_writes_a_peft_adapter_and_the_merged_model(tiny_llama_path, tmp_path, zero_stage):
    """A LoRA actor after a step (lora_B is no longer 0): the adapter folder loads with peft on the base model, the
    merged folder with from_pretrained, and their logits agree (and differ from the base's); with ZeRO-1 and ZeRO-3
    (the parameters read through the ZeRO-3 partitions)."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhfkit.lora import LoraConfig

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))
    config = DeepSpeedEngineConfig(zero_stage=zero_stage, bf16=False, optimizer="torch_adamw", learning_rate=5e-2)
    run = _start(tiny_llama_path, {"actor": TrainerConfig(deepspeed=config, lora=lora)}, sleep_level=1)
    try:
        _step(run, 0, reference=False)
        folder = export_model(run, tmp_path / "export")
    finally:
        run.close()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (folder / "adapter").iterdir()}
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_path), dtype=torch.float32)
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, str(folder / "adapter"))(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)(ids).logits
    assert torch.allclose(merged, adapted, atol=1e-5)
    assert not torch.allclose(merged, base_logits, atol=1e-4)
