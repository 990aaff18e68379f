"""GRPO recipe: your model, your prompts, your reward; evaluation, checkpoints, resume and export included.

    python examples/grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset prompts.jsonl --reward my_rewards:reward
    python examples/grpo.py --model M --dataset prompts.jsonl --reward arithmetic --resume true  # go on after a kill
    python examples/grpo.py --device cpu --dataset prompts.jsonl --steps 4 --export runs/grpo/final  # CPU smoke run

``--dataset``: a ``.jsonl``/``.parquet`` file, a folder or a hub dataset id (``--subset``, ``--split``), with a prompt
column of text or chat messages (``--input-key``) and a label column (``--label-key``); the held-out set is
``--eval-dataset`` (a file, or a split of the same hub dataset) or ``--eval-size`` records held out by seed. Every
column reaches the reward. ``--reward``: a built-in name (``gsm8k``: math-verify on the answer after ``####``, its
lenient score logged too; ``math``; ``arithmetic``) or ``module:function`` / ``file.py:function``: rlhfkit's
``fn(prompts, responses, labels)``, TRL's ``fn(prompts, completions, **columns)`` or verl's ``compute_score(
data_source, solution_str, ground_truth, extra_info)``, used unchanged. On CUDA the engines are vLLM's; ``--device
cpu`` uses rlhfkit's HF engine (a tiny random model unless ``--model`` is given).

Every ``--eval-every`` steps the held-out prompts are answered greedily (accuracy, response length) and sampled
(pass@k); the numbers go to ``metrics.jsonl`` with the training ones, a few completions to ``samples.jsonl``. Every
``--save-every`` steps and at the end the run is checkpointed atomically under ``<out>/checkpoints``: ``--resume``
picks up from the newest complete one (data position, optimizer, RNG, metrics). ``--export DIR`` writes the actor as
a folder that ``from_pretrained`` and ``vllm serve`` load. See docs/checkpoint.md and docs/evaluation.md.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rlhfkit.checkpoint import latest_checkpoint
from rlhfkit.data import PromptDatasetConfig, arithmetic_reward, load_prompts
from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
from rlhfkit.engines import SamplingConfig
from rlhfkit.evaluation import EvalConfig, evaluate, should_evaluate
from rlhfkit.experience import ExperienceConfig, engine_token_logprobs, iterate_minibatches, make_experience
from rlhfkit.hybrid import (Hybrid, HybridConfig, MetricsLogger, TrainerConfig, export_model, load_checkpoint,
                            save_checkpoint)
from rlhfkit.losses import kl_loss, policy_loss
from rlhfkit.options import parse_options
from rlhfkit.packing import pack_rollouts
from rlhfkit.rewards import (RewardFunctionConfig, apply_reward_functions, gsm8k_lenient_reward, gsm8k_strict_reward,
                             load_reward_function, math_reward, rollout_columns, rollout_texts, trl_reward,
                             verl_reward)
from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str | None = None  # hub id or HF folder; --device cpu without it: a tiny random Llama
    dataset: str | None = None  # .jsonl / .parquet file, folder or hub dataset id
    subset: str | None = None  # the hub dataset's configuration (GSM8K: "main")
    split: str = "train"  # the hub dataset's training split
    eval_dataset: str | None = None  # held-out prompts: a file, or a split name of the hub dataset ("test")
    eval_size: int = 64  # without --eval-dataset: this many records held out (by --seed)
    reward: str = "arithmetic"  # built-in (gsm8k, math, arithmetic) or module:function / file.py:function
    input_key: str = "prompt"  # the prompt column (text or chat messages)
    label_key: str = "label"  # the label column (GSM8K: "answer")
    chat_template: bool = True  # format prompts with the tokenizer's chat template
    system_prompt: str | None = None  # a system message before each prompt (chat template)
    prompt_suffix: str | None = None  # text after each prompt, e.g. "End with #### <number>."
    out: str = "runs/grpo"  # the run folder: metrics.jsonl, samples.jsonl, checkpoints/
    device: str = "cuda"  # "cuda" (vLLM engines) or "cpu" (rlhfkit's HF engine, DeepSpeed on CPU)
    num_gpus: int = 1  # GPUs the run shares (engines and trainers colocated)
    steps: int = 100  # training steps
    prompts_per_step: int = 16  # prompts per step
    samples_per_prompt: int = 8  # samples per prompt (the group GRPO compares)
    max_new_tokens: int = 256  # most tokens one response generates
    lr: float = 1e-6  # the actor's learning rate
    kl_coef: float = 0.001  # weight of the k3 KL term to the reference
    bf16: bool = True  # CUDA: bf16 trainers and engine (CPU: fp32)
    eval_every: int = 10  # evaluate the held-out prompts before every N-th step (0: never)
    eval_samples: int = 4  # samples per held-out prompt for pass@k (0: greedy only)
    eval_k: int = 1  # the k of pass@k
    save_every: int = 50  # checkpoint every N steps (and at the end)
    keep: int = 2  # newest checkpoints kept
    resume: bool = False  # go on from the newest complete checkpoint under <out>/checkpoints
    export: str | None = None  # folder for the final model
    seed: int = 0  # data order, held-out split, sampling


CLIP, MINIBATCHES = 0.2, 2
BUILTIN_REWARDS = {"arithmetic": arithmetic_reward, "gsm8k": gsm8k_strict_reward, "math": math_reward}
ALSO_LOGGED = {"gsm8k": {"strict": gsm8k_strict_reward, "lenient": gsm8k_lenient_reward}}


def reward_function(spec: str):
    """A built-in reward by name, or ``module:function``: rlhfkit's, TRL's or verl's signature, used unchanged."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"--reward {spec!r}: expected one of {sorted(BUILTIN_REWARDS)} or module:function")
    fn = load_reward_function(spec)
    parameters = inspect.signature(fn).parameters
    if "completions" in parameters:
        return trl_reward(fn)
    if "solution_str" in parameters:
        return verl_reward(fn)
    return fn


def grpo_loss(logprobs, micro, *, num_tokens, num_seqs, kl_coef):
    """PPO-clip on GRPO advantages + k3 KL to the reference."""
    batch, counts = micro.batch, {"num_tokens": num_tokens, "num_seqs": num_seqs}
    loss, stats = policy_loss(logprobs, micro.old_logprobs, micro.advantages, batch.loss_mask, batch.cu_seqlens,
                              clip_low=CLIP, clip_high=CLIP, **counts)
    kl, kl_stats = kl_loss(logprobs, micro.ref_logprobs, batch.loss_mask, batch.cu_seqlens, estimator="k3", **counts)
    return loss + kl_coef * kl, stats | {"kl_loss": kl_stats["kl_mean"]}


def start(options: Options) -> Hybrid:
    cpu = options.device == "cpu"
    model = options.model or str(build_tiny_model(Path(options.out) / "tiny_model", TinyModelConfig(
        hidden_size=64, num_layers=2, seed=options.seed), exist_ok=True))
    bf16 = options.bf16 and not cpu
    deepspeed = DeepSpeedEngineConfig(zero_stage=1 if bf16 else 0, bf16=bf16, learning_rate=options.lr,
                                      optimizer="torch_adamw" if cpu else "fused_adam", gradient_clipping=1.0)
    trainers = {"actor": TrainerConfig(deepspeed=deepspeed), "reference": TrainerConfig(deepspeed=deepspeed)}
    config = HybridConfig(model=model, device=options.device, engine="hf" if cpu else "vllm", seed=options.seed,
                          num_gpus=options.num_gpus, dtype="bfloat16" if bf16 else "float32",
                          max_num_seqs=options.prompts_per_step * options.samples_per_prompt)
    return Hybrid.start(config, trainers)


def main(argv=None) -> list[dict]:
    options = parse_options(Options, argv, description=__doc__)
    if options.dataset is None:
        raise ValueError("--dataset is required: a .jsonl/.parquet file or a hub dataset id")
    out, checkpoints = Path(options.out), Path(options.out) / "checkpoints"
    resume_from = latest_checkpoint(checkpoints) if options.resume else None
    hybrid = start(options)
    actor, reference, engines, timer = (hybrid.trainers["actor"], hybrid.trainers["reference"], hybrid.engines,
                                        hybrid.timer)
    from transformers import AutoTokenizer  # after start: its checks import transformers while Ray starts

    tokenizer = AutoTokenizer.from_pretrained(hybrid.config.model)
    data_config = PromptDatasetConfig(input_key=options.input_key, label_key=options.label_key,
                                      apply_chat_template=options.chat_template, system_prompt=options.system_prompt,
                                      prompt_suffix=options.prompt_suffix)
    eval_file = options.eval_dataset if options.eval_dataset and Path(options.eval_dataset).exists() else None
    train, held_out = load_prompts(options.dataset, tokenizer, data_config, split=options.split, subset=options.subset,
                                   eval_source=eval_file, eval_split=None if eval_file else options.eval_dataset,
                                   eval_size=None if options.eval_dataset else options.eval_size, seed=options.seed)
    rewards = [RewardFunctionConfig(fn=reward_function(options.reward), name=options.reward.rpartition(":")[2])]
    eval_config = EvalConfig(every_steps=options.eval_every, max_new_tokens=options.max_new_tokens,
                             num_samples=options.eval_samples, k=options.eval_k, seed=options.seed)
    eval_prompts = next(held_out.batches(len(held_out), seed=options.seed, shuffle=False))
    experience_config = ExperienceConfig(estimator="grpo")
    loss_fn = functools.partial(grpo_loss, kl_coef=options.kl_coef)
    try:
        # resume: the actor's weights and Adam states, the driver's RNG, and the step (data position, metrics)
        first = load_checkpoint(hybrid, resume_from).step if resume_from is not None else 0
        if resume_from is not None:
            print(f"resumed from {resume_from} at step {first}", flush=True)
        batches = train.stream(options.prompts_per_step, seed=options.seed, start_step=first)
        with MetricsLogger(out, resume_step=first if resume_from is not None else None) as metrics:
            for step in range(first, options.steps):
                timer.start_step()
                stats = {}
                if should_evaluate(step, eval_config):  # the held-out set, through the same engines
                    with timer.phase("evaluate"):
                        result = evaluate(engines, eval_prompts, rewards, eval_config, tokenizer=tokenizer,
                                          generate_options={"sleep_after": False},
                                          also=ALSO_LOGGED.get(options.reward))
                    stats |= result.as_metrics()
                    metrics.log_samples(step, result.samples)
                prompts = next(batches)
                sampling = SamplingConfig(n=options.samples_per_prompt, max_new_tokens=options.max_new_tokens,
                                          seed=options.seed * 1_000_003 + step, seed_scope="call")
                with timer.phase("generate"):
                    rollouts = engines.generate(prompts.token_ids, sampling)
                with timer.phase("reward"):
                    texts, responses, labels = rollout_texts(rollouts, prompts=prompts.texts, labels=prompts.labels,
                                                             tokenizer=tokenizer)
                    scores, reports = apply_reward_functions(rewards, texts, responses, labels,
                                                             columns=rollout_columns(rollouts, prompts.columns))
                    stats |= {key: value for report in reports for key, value in report.as_dict().items()}
                batch = pack_rollouts(rollouts)
                with timer.phase("forward_reference"):
                    ref_logprobs = reference.forward(batch)
                with timer.phase("experience"):
                    experience, experience_stats = make_experience(
                        rollouts, torch.tensor(scores), config=experience_config,
                        policy_logprobs_fn=lambda b: engine_token_logprobs(rollouts, b),
                        ref_logprobs_fn=lambda b: ref_logprobs)
                    stats |= {k: v for k, v in experience_stats.items() if not k.startswith("time/")}
                with timer.phase("train_actor"):
                    minibatches = list(iterate_minibatches(experience, num_minibatches=MINIBATCHES, seed=step))
                    for index, minibatch in enumerate(minibatches):
                        stats |= actor.forward_backward(minibatch, loss_fn).metrics()
                        last = index == len(minibatches) - 1
                        stats |= actor.optim_step(sleep_after="keep_weights" if last else False).metrics()
                stats |= hybrid.push_weights()
                row = metrics.log(step, stats | timer.end_step())
                print(f"step {step}: reward {row['reward/mean']:.3f} loss {row['actor/loss']:.4f}"
                      + (f" | eval accuracy {row['eval/accuracy']:.2f}" if "eval/accuracy" in row else ""),
                      flush=True)
                if (step + 1) % options.save_every == 0 or step + 1 == options.steps:
                    path = save_checkpoint(hybrid, checkpoints, step=step + 1, config=asdict(options),
                                           keep=options.keep)
                    print(f"saved {path}", flush=True)
        if options.export:
            print(f"exported {export_model(hybrid, options.export)}", flush=True)
        return metrics.rows
    finally:
        hybrid.close()


if __name__ == "__main__":
    main()
