"""GRPO with the hybrid engine: vLLM engines, a DeepSpeed ZeRO-3 actor and its reference time-share the GPUs, on Ray.

    python examples/grpo_hybrid.py --model /tmp/smollm2-hf --out runs/grpo                 # 1 GPU, all colocated
    python examples/grpo_hybrid.py --model /tmp/smollm2-hf --num-gpus 2 --out runs/grpo2   # 2 GPUs: DP 2, 2 engines
    python examples/grpo_hybrid.py --model /tmp/smollm2-hf --num-gpus 2 --colocate false   # engine on GPU 1, NCCL
    python examples/grpo_hybrid.py --engine hf --device cpu --tiny                          # CPU, logical GPUs

The plan puts the engines (one per GPU), the actor and the reference on the same GPUs, and the GPU is handed around
phase by phase; a phase guard shared by every actor refuses any other order (naming both roles and the GPU):

    engines generate → engines sleep → reference wakes, forwards, sleeps → actor wakes: old log-probs, GRPO group
    advantages, PPO-clip + k3 KL loss over minibatches → actor sleeps but keeps its weights → engine weights wake →
    CUDA-IPC weight sync (ZeRO-3 shards gathered a bucket at a time) → actor sleeps fully → engine KV cache wakes.

With ``--colocate false`` the engines keep their own GPUs awake and take the weights over NCCL; on CPU
(``--engine hf --device cpu``) the engine is rlhfkit's HF engine, DeepSpeed runs on CPU and the sync goes over gloo.
Task: the built-in arithmetic with its graded rule-based reward. Writes ``metrics.jsonl`` (per-step timing of every
phase, peak GPU memory per phase, reward, KL, engine-vs-trainer log-prob mismatch), ``phases.jsonl`` (every guarded
transition), ``summary.json`` and ``curve.png`` under ``--out``. See docs/hybrid.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers next to this file
import _hybrid_common as hybrid  # noqa: E402

from rlhfkit.data import ArithmeticTask, arithmetic_accuracy, arithmetic_reward  # noqa: E402
from rlhfkit.experience import ExperienceConfig, make_experience  # noqa: E402
from rlhfkit.packing import pack_rollouts  # noqa: E402
from rlhfkit.rewards import apply_reward_function  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hybrid.add_arguments(parser, default_out="runs/grpo_hybrid")
    parser.add_argument("--dr-grpo", action="store_true", help="Dr.GRPO: no std scaling, sequence-sum aggregation")
    return hybrid.parse_arguments(parser, argv)


def model_configs(args) -> dict:
    """One DeepSpeed configuration per role; the order is the order they load in."""
    from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig

    gpu = args.device == "cuda"
    common = {"zero_stage": args.zero_stage, "bf16": gpu and args.dtype == "bfloat16",
              "optimizer": "fused_adam" if gpu else "torch_adamw", "attn_implementation": hybrid.attention(args)}
    actor = DeepSpeedEngineConfig(**common, learning_rate=args.lr, gradient_accumulation_steps=args.grad_accum,
                                  loss_normalization="global", gradient_clipping=1.0,
                                  gradient_checkpointing=args.gradient_checkpointing)
    return {"actor": actor, "reference": DeepSpeedEngineConfig(**common)}


def score(rollouts, tokenizer, prompts, labels):
    """Decode the responses and score them with the rule-based arithmetic reward (on the driver's CPU)."""
    responses = tokenizer.batch_decode([r.response_token_ids for r in rollouts], skip_special_tokens=True)
    sample_prompts = [prompts[r.prompt_index] for r in rollouts]
    sample_labels = [labels[r.prompt_index] for r in rollouts]
    scores, _ = apply_reward_function(arithmetic_reward, sample_prompts, responses, sample_labels, on_error="raise")
    return scores, arithmetic_accuracy(responses, sample_labels)


def main(argv=None) -> dict:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    task = ArithmeticTask(min_value=0, max_value=args.max_value, ops=("+", "-"), seed=args.seed)
    config = ExperienceConfig(estimator="dr_grpo" if args.dr_grpo else "grpo", kl_coef=args.kl_coef)
    settings = hybrid.TrainSettings(epochs=args.epochs, minibatches=args.minibatches, grad_accum=args.grad_accum,
                                    temperature=args.temperature, clip=args.clip, kl_coef=args.kl_coef,
                                    aggregation="seq_mean_token_sum" if args.dr_grpo else "token_mean",
                                    seed=args.seed, measure_mismatch=args.old_logprobs == "engine",
                                    profile_step=args.profile_step, profile_dir=str(args.out.resolve()))
    stops = hybrid.stop_tokens(tokenizer, args.model)
    run = hybrid.launch(args, model_configs(args))
    actor, reference = run.workers["actor"], run.workers["reference"]
    try:
        for step in range(args.steps):
            clock = hybrid.StepClock(run.sampler)
            prompt_ids, prompts, labels = hybrid.arithmetic_prompts(task, tokenizer, step, args.rollout_batch)
            # 1. Generation: the engines hold the GPUs (weights + KV cache); then they give them up.
            rollouts = hybrid.generate(run, clock, prompt_ids, hybrid.sampling_config(args, stops, step))
            with clock.phase("reward"):
                scores, accuracy = score(rollouts, tokenizer, prompts, labels)
            batch = pack_rollouts(rollouts)  # the packing make_experience uses, so the forwards line up with it
            # 2. The reference wakes, computes its log-probs on every data-parallel rank, and sleeps.
            ref_logprobs = hybrid.guarded_forward(clock, reference, "logprobs", batch, args)
            # 3. The actor wakes (while GRPO advantages are computed here, on CPU) for its own forward and the
            # training, then keeps only the weights the sync reads; 4. the engines take them, then their KV cache.
            woke = actor.submit("wake", "train")
            old_logprobs = hybrid.behaviour_logprobs(clock, actor, batch, rollouts, args)
            with clock.phase("experience"):
                experience, stats = make_experience(rollouts, scores, config=config,
                                                    policy_logprobs_fn=hybrid.precomputed(old_logprobs),
                                                    ref_logprobs_fn=hybrid.precomputed(ref_logprobs))
            stats |= hybrid.guarded_train(clock, actor, experience, settings, step, woke=woke, sleep_phase="sync",
                                          keep_weights=True)
            stats |= hybrid.sync_to_engines(run, clock)
            run.record(step, clock, stats, experience, accuracy)
        return run.finish()
    finally:
        run.close()


if __name__ == "__main__":
    main()
