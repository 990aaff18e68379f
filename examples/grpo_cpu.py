"""GRPO (or RLOO, REINFORCE++, PPO with a critic) on CPU, assembled from rlhfkit blocks. The loop is yours.

    python examples/grpo_cpu.py                       # tiny model built locally, built-in arithmetic task
    python examples/grpo_cpu.py --estimator ppo       # PPO: a critic (GAE) next to the policy
    python examples/grpo_cpu.py --resume              # continue from the latest complete checkpoint
    python examples/grpo_cpu.py --model PATH          # any HF causal LM folder
    python examples/grpo_cpu.py --dynamic-sampling    # DAPO: drop groups whose rewards are all equal, backfill

One step: engine.generate → reward function → make_experience (policy/reference/critic forwards) → PPO-clip loss
(+ KL loss) over minibatches → AdamW → the new weights into the engine. No Ray, no DeepSpeed, plain torch.
Writes ``metrics.jsonl``, ``curve.png`` and ``checkpoints/step-N`` under ``--output-dir``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from rlhfkit.checkpoint import (checkpoint_name, latest_checkpoint, load_torch_state, prune_checkpoints,
                                save_torch_state)
from rlhfkit.data import ArithmeticTask, PromptDatasetConfig, arithmetic_reward, prompt_batch
from rlhfkit.dynamic_sampling import DynamicSampler, DynamicSamplingConfig
from rlhfkit.engines import SamplingConfig
from rlhfkit.engines.hf import HFEngine
from rlhfkit.experience import ExperienceConfig, iterate_minibatches, make_experience
from rlhfkit.losses import kl_loss, model_logprobs, policy_loss, shift_to_tokens, value_loss
from rlhfkit.packing import global_counts, packed_logits
from rlhfkit.rewards import apply_reward_function, rollout_texts
from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model


def model_values(critic, batch):
    """Critic values token aligned like log-probs: entry t is V(prefix before token t) (the head's output at t-1)."""
    return shift_to_tokens(packed_logits(critic, batch)[:, 0].float(), batch)


ESTIMATORS = {"grpo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo", "reinforce++": "reinforce++",
              "reinforce++_baseline": "reinforce++_baseline", "ppo": "gae"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF causal LM folder; default: build a tiny one locally")
    p.add_argument("--output-dir", type=Path, default=Path("runs/grpo_cpu"))
    p.add_argument("--estimator", choices=sorted(ESTIMATORS), default="grpo")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--critic-lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=1, help="passes over each step's experience")
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--kl-coef", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--max-value", type=int, default=9, help="operands of the arithmetic task lie in [0, max-value]")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--dynamic-sampling", action="store_true",
                   help="DAPO dynamic sampling: train only on groups whose rewards differ, backfilled to a full batch")
    p.add_argument("--oversample-factor", type=float, default=2.0, help="with --dynamic-sampling")
    p.add_argument("--max-rounds", type=int, default=4, help="with --dynamic-sampling: generate calls per step")
    p.add_argument("--tiny", action="store_true", help="smoke run: 3 steps, small batches")
    args = p.parse_args(argv)
    if args.tiny:
        args.steps, args.prompts_per_step, args.samples_per_prompt = 3, 4, 4
    return args


def load_models(args):
    path = args.model
    if path is None:
        path = args.output_dir / "base_model"
        if not (path / "config.json").exists():
            build_tiny_model(path, TinyModelConfig(hidden_size=64, num_layers=2, seed=args.seed))
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    critic = None
    if args.estimator == "ppo":  # the backbone of the policy checkpoint with a fresh scalar head
        critic = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    # the engine owns a copy of the weights and receives the trainer's after every step, like a real rollout engine
    engine = HFEngine.from_model(copy.deepcopy(policy).eval(), tokenizer=tokenizer, seed=args.seed)
    return tokenizer, policy, reference, critic, engine


def dynamic_sample(args, step, engine, task, tokenizer, chat, sampling_kwargs):
    """DAPO dynamic sampling: whole groups whose rewards differ, exactly --prompts-per-step of them, drawn from
    fresh problems over at most --max-rounds generate calls. Returns the kept rollouts and per-group texts/labels."""
    count = args.prompts_per_step
    cursor = [step * args.max_rounds * math.ceil(count * args.oversample_factor)]  # disjoint problems per step
    rounds = [0]

    def next_prompts(num):
        cursor[0] += num
        return prompt_batch(task.records(num, start=cursor[0] - num), tokenizer, chat)

    def generate(prompts):
        rounds[0] += 1   # the seed depends on step and round only, so a resumed run replays the same rollouts
        seed = (args.seed * 1_000_003 + step) * 64 + rounds[0]
        return engine.generate(prompts.token_ids, SamplingConfig(seed=seed, **sampling_kwargs))

    def task_reward(prompts, rollouts):
        texts, responses, labels = rollout_texts(rollouts, prompts=prompts.texts, labels=prompts.labels)
        return apply_reward_function(arithmetic_reward, texts, responses, labels)[0]

    config = DynamicSamplingConfig(num_groups=count, oversample_factor=args.oversample_factor,
                                   max_rounds=args.max_rounds)
    batch = DynamicSampler(config).sample(next_prompts, generate, task_reward)
    texts = [batch.prompts[r].texts[i] for r, i in batch.origins]
    labels = [batch.prompts[r].labels[i] for r, i in batch.origins]
    return batch.rollouts, texts, labels, batch.stats.as_dict()


def train_on(experience, policy, critic, optimizer, critic_optimizer, args, step: int) -> dict[str, float]:
    stats: dict[str, float] = {}
    aggregation = "seq_mean_token_sum" if args.estimator == "dr_grpo" else "token_mean"
    for epoch in range(args.epochs):
        minibatches = list(iterate_minibatches(experience, num_minibatches=args.minibatches,
                                               seed=args.seed * 100_003 + step * 101 + epoch))
        for mb in minibatches:
            batch, mask, cu = mb.batch, mb.batch.loss_mask, mb.batch.cu_seqlens
            num_tokens, num_seqs = global_counts(mask, cu)
            logprobs = model_logprobs(policy, batch)
            loss, pstats = policy_loss(logprobs, mb.old_logprobs, mb.advantages, mask, cu, clip_low=args.clip,
                                       clip_high=args.clip, aggregation=aggregation, num_tokens=num_tokens,
                                       num_seqs=num_seqs)
            if args.kl_coef > 0:
                kloss, kstats = kl_loss(logprobs, mb.ref_logprobs, mask, cu, estimator="k3", aggregation=aggregation,
                                        num_tokens=num_tokens, num_seqs=num_seqs)
                loss = loss + args.kl_coef * kloss
                pstats["kl_loss"] = kstats["kl_mean"]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            pstats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
            optimizer.step()
            pstats["loss"] = float(loss.detach())
            if critic is not None:
                values = model_values(critic, batch)
                vloss, vstats = value_loss(values, mb.values, mb.returns, mask, cu, clip=0.2)
                critic_optimizer.zero_grad(set_to_none=True)
                vloss.backward()
                torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
                critic_optimizer.step()
                pstats["value_loss"] = float(vloss.detach())
            for key, value in pstats.items():  # average over minibatches and epochs
                stats[key] = stats.get(key, 0.0) + value / (len(minibatches) * args.epochs)
    return stats


def save_checkpoint(args, step, policy, critic, optimizer, critic_optimizer):
    state = {"step": step, "policy": policy.state_dict(), "optimizer": optimizer.state_dict()}
    if critic is not None:
        state |= {"critic": critic.state_dict(), "critic_optimizer": critic_optimizer.state_dict()}
    root = args.output_dir / "checkpoints"
    save_torch_state(root / checkpoint_name(step), state)
    prune_checkpoints(root, keep=2)


def plot(metrics_path: Path, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(steps, [r["reward/mean"] for r in rows], label="mean reward")
    ax1.plot(steps, [r["accuracy"] for r in rows], label="exact answers")
    ax1.set_xlabel("step"), ax1.legend(), ax1.set_title("reward")
    ax2.plot(steps, [r.get("kl/mean", 0.0) for r in rows], color="tab:red")
    ax2.set_xlabel("step"), ax2.set_title("KL(policy || reference)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, policy, reference, critic, engine = load_models(args)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr) if critic is not None else None
    task = ArithmeticTask(min_value=0, max_value=args.max_value, ops=("+",), seed=args.seed)
    chat = PromptDatasetConfig(apply_chat_template=True)
    config = ExperienceConfig(estimator=ESTIMATORS[args.estimator], kl_coef=args.kl_coef, kl_in_reward=False)
    sampling_kwargs = dict(n=args.samples_per_prompt, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature)
    start_step, metrics_path = 0, args.output_dir / "metrics.jsonl"
    checkpoint = latest_checkpoint(args.output_dir / "checkpoints") if args.resume else None
    if checkpoint is not None:
        state = load_torch_state(checkpoint)
        policy.load_state_dict(state["policy"])
        optimizer.load_state_dict(state["optimizer"])
        if critic is not None:
            critic.load_state_dict(state["critic"])
            critic_optimizer.load_state_dict(state["critic_optimizer"])
        start_step = state["step"]
        engine.load_weights(policy.named_parameters())
        rows = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] < start_step))
        print(f"resumed from {checkpoint} at step {start_step}")
    elif metrics_path.exists():
        metrics_path.unlink()
    history = []
    for step in tqdm(range(start_step, args.steps), initial=start_step, total=args.steps, desc="GRPO", unit="step"):
        t0 = time.perf_counter()
        if args.dynamic_sampling:
            rollouts, prompt_texts, prompt_labels, sampling_stats = dynamic_sample(
                args, step, engine, task, tokenizer, chat, sampling_kwargs)
        else:
            count = args.prompts_per_step  # problems step * count ... of the task, as chat prompts
            prompts = prompt_batch(task.records(count, start=step * count), tokenizer, chat)
            # every step's sampling seed is a function of the step alone, so a resumed run replays the same rollouts
            rollouts = engine.generate(prompts.token_ids, SamplingConfig(seed=args.seed * 1_000_003 + step,
                                                                         **sampling_kwargs))
            prompt_texts, prompt_labels, sampling_stats = prompts.texts, prompts.labels, {}
        t_generate = time.perf_counter() - t0
        texts, responses, sample_labels = rollout_texts(rollouts, prompts=prompt_texts, labels=prompt_labels)
        scores, report = apply_reward_function(arithmetic_reward, texts, responses, sample_labels)
        with torch.no_grad():
            experience, stats = make_experience(
                rollouts, torch.tensor(scores), config=config,
                policy_logprobs_fn=lambda b: model_logprobs(policy, b),
                ref_logprobs_fn=lambda b: model_logprobs(reference, b),
                values_fn=(lambda b: model_values(critic, b)) if critic is not None else None)
        t_train = time.perf_counter()
        stats |= train_on(experience, policy, critic, optimizer, critic_optimizer, args, step) | sampling_stats
        t_sync = time.perf_counter()
        engine.load_weights(policy.named_parameters())
        exact = sum(str(r).strip() == l for r, l in zip(responses, sample_labels)) / len(responses)
        stats |= {"step": step, "accuracy": exact, "time/generate_s": t_generate,
                  "time/train_s": t_sync - t_train, "time/sync_s": time.perf_counter() - t_sync,
                  "time/step_s": time.perf_counter() - t0, "engine/weight_version": engine.weight_version,
                  "engine_vs_trainer/mean_abs_logprob_diff": _mismatch(experience)}
        history.append(stats)
        with metrics_path.open("a") as handle:
            handle.write(json.dumps({k: v for k, v in stats.items() if isinstance(v, (int, float))}) + "\n")
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            save_checkpoint(args, step + 1, policy, critic, optimizer, critic_optimizer)
    if not args.no_plot and metrics_path.exists():
        plot(metrics_path, args.output_dir / "curve.png")
    return summarize(metrics_path)


def _mismatch(experience) -> float:
    """Mean |engine log-prob − trainer log-prob| over response tokens (0 when both hold the same weights)."""
    mask = experience.batch.loss_mask
    return float((experience.engine_logprobs - experience.old_logprobs)[mask].abs().mean())


def summarize(metrics_path: Path) -> dict:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    k = min(10, max(1, len(rewards) // 2))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    summary = {"steps": len(rows), "first_mean_reward": first, "last_mean_reward": last,
               "relative_gain": (last - first) / max(abs(first), 1e-9),
               "last_accuracy": sum(r["accuracy"] for r in rows[-k:]) / k,
               "max_abs_kl": max(abs(r.get("kl/mean", 0.0)) for r in rows)}
    print(json.dumps(summary, indent=2))
    (metrics_path.parent / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
