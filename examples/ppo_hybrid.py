"""PPO with the hybrid engine: vLLM engines, a DeepSpeed ZeRO-3 actor, critic, reference and reward model all
time-share the same GPUs, on Ray.

    python examples/ppo_hybrid.py --model /tmp/smollm2-hf --out runs/ppo                  # 1 GPU, all colocated
    python examples/ppo_hybrid.py --model /tmp/smollm2-hf --num-gpus 2 --out runs/ppo2    # 2 GPUs: DP 2, 2 engines
    python examples/ppo_hybrid.py --model /tmp/smollm2-hf --num-gpus 2 --colocate false  # engine on GPU 1, NCCL
    python examples/ppo_hybrid.py --engine hf --device cpu --tiny                         # CPU, logical GPUs

One step, in the order the GPU is handed around (a phase guard shared by every actor refuses any other):

    engines generate → engines sleep → reward model wakes, scores, sleeps → reference wakes, forwards, sleeps →
    critic wakes, values, sleeps → actor wakes: old log-probs, KL-shaped rewards and GAE advantages, PPO-clip over
    minibatches → actor sleeps but keeps its weights → critic wakes, clipped value loss, sleeps → engine weights wake
    → weight sync → actor sleeps fully → engine KV cache wakes.

The reward is the built-in arithmetic task's graded rule-based score plus ``--rm-coef`` × the score of a reward
model. By default that reward model is *untrained*: the policy checkpoint's backbone with a freshly initialised
scalar head (``AutoModelForSequenceClassification(num_labels=1)``, std 0.02). It is there to exercise the reward-model
role and its phase (a model with its own memory, sleeping in turn); its score is a fixed random function of the text,
weighted small (0.1), so the learning signal comes from the rule. Pass ``--reward-model PATH`` for a trained one
(any HF ``*ForSequenceClassification`` folder with one label, or a causal LM folder to get a fresh head).
The critic is the policy checkpoint with a fresh value head. Outputs as in grpo_hybrid.py; see docs/hybrid.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers next to this file
import _hybrid_common as hybrid  # noqa: E402

from rlhfkit.data import ArithmeticTask, arithmetic_accuracy, arithmetic_reward  # noqa: E402
from rlhfkit.experience import ExperienceConfig, make_experience  # noqa: E402
from rlhfkit.packing import pack_rollouts  # noqa: E402
from rlhfkit.rewards import apply_reward_function  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hybrid.add_arguments(parser, default_out="runs/ppo_hybrid")
    parser.add_argument("--critic-lr", type=float, default=1e-5)
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--value-clip", type=float, default=0.2)
    parser.add_argument("--reward-model", default=None, help="reward model folder (default: --model with a fresh, "
                        "untrained head; see the module docstring)")
    parser.add_argument("--rm-coef", type=float, default=0.1, help="weight of the reward model's score")
    parser.set_defaults(kl_coef=0.01)  # PPO: a per-token KL penalty in the reward
    return hybrid.parse_arguments(parser, argv, tiny={"critic_lr": 1e-3})


def model_configs(args) -> dict:
    """One DeepSpeed configuration per role; the order is the order they load in."""
    from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig

    gpu = args.device == "cuda"
    common = {"zero_stage": args.zero_stage, "bf16": gpu and args.dtype == "bfloat16",
              "optimizer": "fused_adam" if gpu else "torch_adamw", "attn_implementation": hybrid.attention(args)}
    trained = {"gradient_accumulation_steps": args.grad_accum, "loss_normalization": "global",
               "gradient_clipping": 1.0, "gradient_checkpointing": args.gradient_checkpointing}
    return {"actor": DeepSpeedEngineConfig(**common, **trained, learning_rate=args.lr),
            "critic": DeepSpeedEngineConfig(**common, **trained, learning_rate=args.critic_lr),
            "reference": DeepSpeedEngineConfig(**common),
            "reward": DeepSpeedEngineConfig(**common, value_head_init_std=0.02)}


def rule_scores(rollouts, tokenizer, prompts, labels):
    """Decode the responses and score them with the rule-based arithmetic reward (on the driver's CPU)."""
    responses = tokenizer.batch_decode([r.response_token_ids for r in rollouts], skip_special_tokens=True)
    sample_prompts = [prompts[r.prompt_index] for r in rollouts]
    sample_labels = [labels[r.prompt_index] for r in rollouts]
    scores, _ = apply_reward_function(arithmetic_reward, sample_prompts, responses, sample_labels, on_error="raise")
    return torch.tensor(scores), arithmetic_accuracy(responses, sample_labels)


def main(argv=None) -> dict:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    task = ArithmeticTask(min_value=0, max_value=args.max_value, ops=("+", "-"), seed=args.seed)
    config = ExperienceConfig(estimator="gae", gamma=args.gamma, lam=args.lam, kl_coef=args.kl_coef,
                              kl_in_reward=True)
    common = {"epochs": args.epochs, "minibatches": args.minibatches, "grad_accum": args.grad_accum,
              "seed": args.seed, "profile_step": args.profile_step, "profile_dir": str(args.out.resolve())}
    actor_settings = hybrid.TrainSettings(**common, temperature=args.temperature, clip=args.clip,
                                          measure_mismatch=args.old_logprobs == "engine")
    critic_settings = hybrid.TrainSettings(**common, value_clip=args.value_clip)
    stops = hybrid.stop_tokens(tokenizer, args.model)
    run = hybrid.launch(args, model_configs(args), reward_model=args.reward_model)
    workers = run.workers
    actor, critic = workers["actor"], workers["critic"]
    try:
        for step in range(args.steps):
            clock = hybrid.StepClock(run.sampler)
            prompt_ids, prompts, labels = hybrid.arithmetic_prompts(task, tokenizer, step, args.rollout_batch)
            # 1. Generation: the engines hold the GPUs (weights + KV cache); then they give them up.
            rollouts = hybrid.generate(run, clock, prompt_ids, hybrid.sampling_config(args, stops, step))
            with clock.phase("reward"):
                rule, accuracy = rule_scores(rollouts, tokenizer, prompts, labels)
            batch = pack_rollouts(rollouts)  # the packing make_experience uses, so the forwards line up with it
            # 2. Reward model, reference and critic: each wakes, runs on every data-parallel rank, sleeps.
            model_scores = hybrid.guarded_forward(clock, workers["reward"], "rewards", batch, args)
            ref_logprobs = hybrid.guarded_forward(clock, workers["reference"], "logprobs", batch, args)
            values = hybrid.guarded_forward(clock, critic, "values", batch, args)
            rewards = rule + args.rm_coef * model_scores
            # 3. The actor wakes: its log-probs, then KL-shaped rewards and GAE on CPU, then PPO-clip training; it
            # keeps only its weights for the sync. 4. The critic takes the GPU for its value loss.
            woke = actor.submit("wake", "train")
            old_logprobs = hybrid.behaviour_logprobs(clock, actor, batch, rollouts, args)
            with clock.phase("experience"):
                experience, stats = make_experience(rollouts, rewards, config=config,
                                                    policy_logprobs_fn=hybrid.precomputed(old_logprobs),
                                                    ref_logprobs_fn=hybrid.precomputed(ref_logprobs),
                                                    values_fn=hybrid.precomputed(values))
            stats |= hybrid.guarded_train(clock, actor, experience, actor_settings, step, woke=woke,
                                          sleep_phase="sync", keep_weights=True)
            stats |= hybrid.guarded_train(clock, critic, experience, critic_settings, step, sleep_phase="train")
            # 5. The engines take the actor's weights, then their KV cache.
            stats |= hybrid.sync_to_engines(run, clock)
            stats |= {"reward/rule_mean": float(rule.mean()), "reward/model_mean": float(model_scores.mean()),
                      "reward/model_std": float(model_scores.std())}
            run.record(step, clock, stats, experience, accuracy)
        return run.finish()
    finally:
        run.close()


if __name__ == "__main__":
    main()
