"""PPO with the hybrid engine: vLLM engines and DeepSpeed actor, critic, reference and reward model time-share the
GPUs, on Ray.

    python examples/ppo_hybrid.py --model /tmp/smollm2-hf                  # 1 GPU, everything sleeping in turn
    python examples/ppo_hybrid.py --model /tmp/smollm2-hf --num-gpus 2     # 2 GPUs: 2 ranks, 2 engines
    python examples/ppo_hybrid.py --device cpu --tiny true                 # CPU: HF engine, logical GPUs

One step, in the order the GPU is handed around (the phase guard refuses any other):

    engines generate, then sleep -> reward model scores, sleeps -> reference forwards, sleeps -> critic values,
    sleeps -> KL-shaped rewards and GAE advantages (here, on CPU) -> actor: PPO-clip over minibatches, keeps only its
    weights -> critic: clipped value loss, sleeps -> engines take the actor's weights, then their KV cache.

The reward is the built-in arithmetic task's graded rule plus ``rm_coef`` x a reward model's score. The reward model
is the policy checkpoint with a fresh, untrained scalar head (``--reward-model PATH`` for a trained one): it exercises
the role and its memory; the learning signal comes from the rule. The critic is the policy with a fresh value head.
Writes ``metrics.jsonl`` and ``phases.jsonl`` under ``--out``; see docs/hybrid.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhfkit.data import ArithmeticTask, PromptDatasetConfig, arithmetic_accuracy, arithmetic_reward, prompt_batch
from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
from rlhfkit.engines import SamplingConfig
from rlhfkit.experience import ExperienceConfig, engine_token_logprobs, iterate_minibatches, make_experience
from rlhfkit.hybrid import Hybrid, HybridConfig, MetricsLogger, TrainerConfig, plan_for_machine
from rlhfkit.losses import policy_loss, value_loss
from rlhfkit.options import parse_options
from rlhfkit.packing import pack_rollouts
from rlhfkit.rewards import apply_reward_function, rollout_texts
from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str | None = None  # folder or hub id (SmolLM2: examples/convert_smollm2.py); CPU: a tiny model is built
    reward_model: str | None = None  # default: the policy checkpoint with a fresh scalar head
    out: str = "runs/ppo_hybrid"  # folder the run writes its metrics (and a CPU run its tiny model) to
    device: str = "cuda"  # "cuda" or "cpu"
    num_gpus: int = 1  # GPUs the run uses
    steps: int = 100  # training steps
    prompts_per_step: int = 16  # prompts per step
    samples_per_prompt: int = 4  # samples per prompt
    max_new_tokens: int = 64  # most tokens one sample generates
    lr: float = 5e-6  # the actor's learning rate
    critic_lr: float = 1e-5  # the critic's learning rate
    kl_coef: float = 0.01  # per-token KL penalty in the reward
    rm_coef: float = 0.1  # weight of the reward model's score in the reward (the rule gives the rest)
    resident: bool = False  # nothing sleeps: engine and trainers stay on the GPU (the guard still orders phases)
    tiny: bool = False  # smoke run: a few steps of a few short samples


CLIP, VALUE_CLIP, MINIBATCHES, SEED = 0.2, 0.2, 2, 0


def actor_loss(logprobs, micro, *, num_tokens, num_seqs):
    batch = micro.batch
    loss, stats = policy_loss(logprobs, micro.old_logprobs, micro.advantages, batch.loss_mask, batch.cu_seqlens,
                              clip_low=CLIP, clip_high=CLIP, num_tokens=num_tokens, num_seqs=num_seqs)
    gap = (logprobs.detach() - micro.engine_logprobs)[batch.loss_mask].abs()
    return loss, stats | {"engine_gap": float(gap.mean())}


def critic_loss(values, micro, *, num_tokens, num_seqs):
    batch = micro.batch
    return value_loss(values, micro.values, micro.returns, batch.loss_mask, batch.cu_seqlens, clip=VALUE_CLIP,
                      num_tokens=num_tokens, num_seqs=num_seqs)


def start(options: Options) -> Hybrid:
    cpu = options.device == "cpu"
    tiny = TinyModelConfig(hidden_size=64, num_layers=2, seed=SEED)  # CPU smoke runs: a tiny random Llama
    model = options.model or str(build_tiny_model(Path(options.out) / "tiny_model", tiny, exist_ok=True))
    frozen = DeepSpeedEngineConfig(zero_stage=1, bf16=False, optimizer="torch_adamw" if cpu else "fused_adam",
                                   gradient_clipping=1.0)
    trainers = {
        "actor": TrainerConfig(deepspeed=dataclasses.replace(frozen, learning_rate=options.lr)),
        "critic": TrainerConfig(deepspeed=dataclasses.replace(frozen, learning_rate=options.critic_lr)),
        "reference": TrainerConfig(deepspeed=frozen),
        "reward": TrainerConfig(deepspeed=dataclasses.replace(frozen, value_head_init_std=0.02),
                                model=options.reward_model)}
    config = HybridConfig(model=model, device=options.device, engine="hf" if cpu else "vllm",
                          num_gpus=options.num_gpus, seed=SEED,
                          max_num_seqs=-(-options.prompts_per_step * options.samples_per_prompt // options.num_gpus))
    plan = plan_for_machine(config, trainers)  # what stays on the GPU in which phase, decided once
    if options.resident:  # an edited plan: every role and the engines stay on the GPU (the guard still orders)
        resident = {role: dataclasses.replace(role_plan, offload=False) for role, role_plan in plan.roles.items()}
        plan = dataclasses.replace(plan, roles=resident).replace_engine(sleep_level=0)
    print(plan, flush=True)
    return Hybrid.start(config, trainers, plan=plan)


def main(argv=None) -> list[dict]:
    options = parse_options(Options, argv, description=__doc__)
    if options.tiny:
        options = dataclasses.replace(options, steps=3, prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8,
                                      lr=1e-3, critic_lr=1e-3)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    hybrid = start(options)
    roles, engines, timer = hybrid.trainers, hybrid.engines, hybrid.timer
    actor, critic = roles["actor"], roles["critic"]
    from transformers import AutoTokenizer  # after start: its checks import transformers while Ray starts

    tokenizer = AutoTokenizer.from_pretrained(hybrid.config.model)
    task = ArithmeticTask(min_value=0, max_value=9 if options.tiny else 99, ops=("+", "-"), seed=SEED)
    config = ExperienceConfig(estimator="gae", gamma=1.0, lam=0.95, kl_coef=options.kl_coef, kl_in_reward=True)
    chat = PromptDatasetConfig(apply_chat_template=True)
    print(f"started in {hybrid.startup['total_s']:.1f} s", flush=True)
    try:
        with MetricsLogger(out) as metrics:
            for step in range(options.steps):
                timer.start_step()
                count = options.prompts_per_step  # problems step * count ... of the task, as chat prompts
                prompts = prompt_batch(task.records(count, start=step * count), tokenizer, chat)
                # one random stream per engine and step: vLLM samples the batch at once, not sample by sample
                sampling = SamplingConfig(n=options.samples_per_prompt, max_new_tokens=options.max_new_tokens,
                                          seed=SEED * 1_000_003 + step, seed_scope="call")
                with timer.phase("generate"):
                    rollouts = engines.generate(prompts.token_ids, sampling)
                with timer.phase("reward"):
                    texts, responses, answers = rollout_texts(rollouts, prompts=prompts.texts, labels=prompts.labels,
                                                              tokenizer=tokenizer)
                    rule, _ = apply_reward_function(arithmetic_reward, texts, responses, answers)
                batch = pack_rollouts(rollouts)
                # Reward model, reference and critic: each wakes, runs on every rank, sleeps.
                with timer.phase("forward_reward"):
                    model_scores = roles["reward"].forward(batch, output="rewards")
                with timer.phase("forward_reference"):
                    ref_logprobs = roles["reference"].forward(batch)
                with timer.phase("forward_critic"):
                    values = critic.forward(batch, output="values")
                with timer.phase("experience"):
                    rewards = torch.tensor(rule) + options.rm_coef * model_scores
                    experience, stats = make_experience(
                        rollouts, rewards, config=config, policy_logprobs_fn=lambda b: engine_token_logprobs(
                            rollouts, b), ref_logprobs_fn=lambda b: ref_logprobs, values_fn=lambda b: values)
                    stats = {k: v for k, v in stats.items() if not k.startswith("time/")}  # timer has the phases
                minibatches = list(iterate_minibatches(experience, num_minibatches=MINIBATCHES, seed=step))
                with timer.phase("train_actor"):
                    for index, minibatch in enumerate(minibatches):
                        train = actor.forward_backward(minibatch, actor_loss).metrics()
                        keep = "keep_weights" if index == len(minibatches) - 1 else False
                        train |= actor.optim_step(sleep_after=keep).metrics()
                        gap = train.pop("actor/engine_gap")
                        if index == 0:  # before any update: the engine-vs-trainer gap of the same weights
                            stats["engine_vs_trainer/mean_abs_logprob_diff"] = gap
                        stats |= train
                with timer.phase("train_critic"):
                    for index, minibatch in enumerate(minibatches):
                        stats |= critic.forward_backward(minibatch, critic_loss, output="values").metrics()
                        stats |= critic.optim_step(sleep_after=index == len(minibatches) - 1).metrics()
                stats |= hybrid.push_weights()
                stats |= timer.end_step() | {"accuracy": arithmetic_accuracy(responses, answers),
                                             "reward/model_mean": float(model_scores.mean())}
                row = metrics.log(step, stats)
                print(f"step {step}: reward {row['reward/mean']:.3f} exact {row['accuracy']:.2f} "
                      f"gap {row['engine_vs_trainer/mean_abs_logprob_diff']:.4f} | {row['time/step_s']:.2f} s, "
                      f"switches {row['time/phase_switch_fraction']:.1%}", flush=True)
                hybrid.write_phase_log(out / "phases.jsonl")
        hybrid.write_phase_log(out / "phases.jsonl", settle=True)  # a sleep still running behind the last wake
        return metrics.rows
    finally:
        hybrid.close()


if __name__ == "__main__":
    main()
