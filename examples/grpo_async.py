"""Asynchronous GRPO: the engines keep generating the next batch while the actor trains on this one, on Ray.

    python examples/grpo_async.py --model /tmp/smollm2-hf                        # 1 GPU: engine beside the actor
    python examples/grpo_async.py --model /tmp/smollm2-hf --max-staleness 2 --correction token_mask
    python examples/grpo_async.py --model /tmp/smollm2-hf --mode sync            # the same loop, synchronous
    python examples/grpo_async.py --model /tmp/smollm2-hf --num-gpus 2 --engine-gpus 1  # engine on its own GPU
    python examples/grpo_async.py --model /tmp/smollm2-hf --max-new-tokens 256 --ignore-eos true  # long samples
    python examples/grpo_async.py --model /tmp/smollm2-hf --reference false --kl-coef 0  # no reference, no KL (DAPO)
    python examples/grpo_async.py --device cpu --tiny true                       # CPU: HF engine, logical GPUs

The engines stay resident beside the awake actor (``HybridConfig(overlap=True)``: outside the phase guard, with their
``--engine-memory`` share of the plan), or, with ``--engine-gpus``, on GPUs of their own (``colocate=False``: NCCL
weight sync). A ``RolloutProducer`` thread generates prompt batches into a ``RolloutBuffer`` that hands the trainer
only groups at most ``--max-staleness`` weight versions old (``on_stale="wait"``: the producer is held back rather than
generating what would be thrown away). Each step:

    take a batch from the buffer -> reference log-probs -> the actor's log-probs of the same tokens (the proximal
    policy of decoupled PPO) -> GRPO advantages -> PPO-clip + k3 KL, corrected for the engine's (behaviour) log-probs
    (``--correction``) -> push the weights in flight (the engines pause between two decode steps, take them, and
    continue the unfinished samples with them; each token is stamped with its version; ``--pause-engines false``:
    the push waits for the samples in flight instead).

``--mode sync`` generates each batch after the previous push instead (the same step otherwise); with
``--max-staleness 0`` the asynchronous schedule is the synchronous one, loss for loss. Task: the built-in arithmetic
with its graded reward. Logs (``metrics.jsonl`` under ``--out``) the staleness of each step's rollouts and tokens,
the mismatch KL between engine and trainer per staleness, the buffer's waits and samples/s. See docs/rollouts.md.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhfkit.data import ArithmeticTask, PromptDatasetConfig, arithmetic_accuracy, arithmetic_reward, prompt_batch
from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
from rlhfkit.engines import SamplingConfig
from rlhfkit.experience import ExperienceConfig, iterate_minibatches, make_experience
from rlhfkit.hybrid import Hybrid, HybridConfig, MetricsLogger, TrainerConfig, plan_for_machine
from rlhfkit.losses import kl_loss, mismatch_stats, policy_loss
from rlhfkit.options import parse_options
from rlhfkit.packing import pack_rollouts
from rlhfkit.rewards import apply_reward_function, rollout_texts
from rlhfkit.rollouts import RolloutBuffer, RolloutBufferConfig, RolloutProducer, staleness, token_staleness
from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str | None = None  # folder or hub id (SmolLM2: examples/convert_smollm2.py); CPU: a tiny model is built
    out: str = "runs/grpo_async"  # folder the run writes its metrics (and a CPU run its tiny model) to
    device: str = "cuda"  # "cuda" or "cpu"
    mode: str = "async"  # async: generate beside training; sync: generate, then train
    max_staleness: int = 1  # the most weight versions a rollout may lag the trainer
    correction: str = "tis"  # none, tis, token_mask, seq_mask (engine vs trainer log-probs; rlhfkit.losses)
    steps: int = 100  # training steps
    prompts_per_step: int = 16  # prompts per step
    samples_per_prompt: int = 8  # samples per prompt (the group GRPO's advantage compares)
    max_new_tokens: int = 64  # most tokens one sample generates
    ignore_eos: bool = False  # True: every sample runs to --max-new-tokens (a long-generation workload)
    lr: float = 5e-6  # the actor's learning rate
    kl_coef: float = 0.001  # weight of the KL term to the reference
    reference: bool = True  # False: no reference model and no KL term (needs --kl-coef 0), as DAPO
    engine_memory: float = 0.3  # the engine's resident share of the GPU (weights + KV cache), when colocated
    num_gpus: int = 1  # GPUs the run uses
    engine_gpus: int = 0  # > 0: the engines get GPUs of their own (0.85 of each), the trainers the other ones
    tiny: bool = False  # smoke run: 3 steps of a few short samples
    timeout_s: float = 600.0  # longest wait for a batch, a push or an engine call
    pause_engines: bool = True  # a push parks the engines mid-generation and they go on (False: they finish first)


CLIP, MINIBATCHES, SEED = 0.2, 2, 0


def grpo_loss(logprobs, micro, *, num_tokens, num_seqs, kl_coef, correction):
    """PPO-clip on GRPO advantages against the proximal (trainer) log-probs, corrected for the engine's, + k3 KL."""
    batch, counts = micro.batch, {"num_tokens": num_tokens, "num_seqs": num_seqs}
    loss, stats = policy_loss(logprobs, micro.old_logprobs, micro.advantages, batch.loss_mask, batch.cu_seqlens,
                              clip_low=CLIP, clip_high=CLIP, engine_logprobs=micro.engine_logprobs,
                              mismatch=correction, **counts)
    if micro.ref_logprobs is None:  # --reference false: no KL term
        return loss, stats
    kl, kl_stats = kl_loss(logprobs, micro.ref_logprobs, batch.loss_mask, batch.cu_seqlens, estimator="k3",
                           **counts)
    return loss + kl_coef * kl, stats | {"kl_loss": kl_stats["kl_mean"]}


def start(options: Options) -> Hybrid:
    cpu = options.device == "cpu"
    tiny = TinyModelConfig(hidden_size=64, num_layers=2, seed=SEED)  # CPU smoke runs: a tiny random Llama
    model = options.model or str(build_tiny_model(Path(options.out) / "tiny_model", tiny, exist_ok=True))
    # ZeRO-0 in fp32, as in grpo_hybrid.py: one optimizer step is 1.14x plain torch against ZeRO-1's 1.40x. With
    # the engines on GPUs of their own nothing shares the trainers' GPUs: they stay resident, blocks and all.
    separated = options.engine_gpus > 0
    deepspeed = DeepSpeedEngineConfig(zero_stage=0, bf16=False, optimizer="torch_adamw" if cpu else "fused_adam",
                                      learning_rate=options.lr, gradient_clipping=1.0,
                                      empty_cache_on_sleep=not separated)
    if not options.reference and options.kl_coef != 0:
        raise ValueError(f"--reference false with --kl-coef {options.kl_coef}: the KL term needs the reference; "
                         "pass --kl-coef 0")
    roles = ("actor", "reference") if options.reference else ("actor",)
    trainers = {role: TrainerConfig(deepspeed=deepspeed, offload=not separated) for role in roles}
    engines = options.engine_gpus if separated else options.num_gpus  # one single-GPU engine per engine GPU
    config = HybridConfig(model=model, device=options.device, engine="hf" if cpu else "vllm", overlap=True,
                          num_gpus=options.num_gpus, colocate=not separated, engine_gpus=max(1, options.engine_gpus),
                          max_num_seqs=-(-options.prompts_per_step * options.samples_per_prompt // engines),
                          max_weight_lag=1, seed=SEED, call_timeout_s=options.timeout_s,
                          sync_timeout_s=options.timeout_s, pause_engines=options.pause_engines)
    plan = plan_for_machine(config, trainers)  # overlap: the engines stay resident (sleep level 0)
    if not separated:  # colocated, they keep their share of the GPU the whole run
        plan = plan.replace_engine(memory=max(plan.engine.memory, options.engine_memory))
    print(plan, flush=True)
    return Hybrid.start(config, trainers, plan=plan)


def prompt_source(tokenizer, options: Options):
    """The prompt batches (token ids, what the producer takes) and the ``PromptBatch`` of each, by batch index."""
    task = ArithmeticTask(min_value=0, max_value=9 if options.tiny else 99, ops=("+", "-"), seed=SEED)
    chat, count, made = PromptDatasetConfig(apply_chat_template=True), options.prompts_per_step, {}

    def token_ids():
        for k in itertools.count():
            made[k] = prompt_batch(task.records(count, start=k * count), tokenizer, chat)
            yield made[k].token_ids

    return token_ids(), made


def make_generate(hybrid: Hybrid, options: Options, made: dict):
    """generate_fn(prompts, weight_version) for the producer (and the sync loop): batch k's samples are seeded by
    k, get prompt indices k * P + i (distinct GRPO groups across batches) and carry their text and label."""
    counter = itertools.count()

    def generate(prompts, weight_version):
        index = next(counter)
        batch = made.pop(index)
        sampling = SamplingConfig(n=options.samples_per_prompt, max_new_tokens=options.max_new_tokens,
                                  ignore_eos=options.ignore_eos, seed=SEED * 1_000_003 + index,
                                  seed_scope="call")  # vLLM samples the batch at once
        rollouts = hybrid.engines.generate(prompts, sampling)
        base = index * len(batch.token_ids)
        return [dataclasses.replace(r, prompt_index=base + r.prompt_index, prompt_text=batch.texts[r.prompt_index],
                                    label=batch.labels[r.prompt_index]) for r in rollouts]

    return generate


def train_step(hybrid, rollouts, version, tokenizer, loss_fn, step) -> dict:
    """Rewards, reference and proximal log-probs, GRPO advantages, two minibatch updates; returns the step's stats."""
    actor, reference, timer = hybrid.trainers["actor"], hybrid.trainers.get("reference"), hybrid.timer
    with timer.phase("reward"):
        texts, responses, answers = rollout_texts(rollouts, tokenizer=tokenizer)
        scores, _ = apply_reward_function(arithmetic_reward, texts, responses, answers)
    with timer.phase("forward"):  # the reference, then the actor, which stays awake to train
        ref_logprobs = reference.forward(pack_rollouts(rollouts)) if reference is not None else None
        experience, stats = make_experience(
            rollouts, torch.tensor(scores), config=ExperienceConfig(estimator="grpo"),
            ref_logprobs_fn=None if ref_logprobs is None else lambda b: ref_logprobs,
            policy_logprobs_fn=lambda b: actor.forward(b, sleep_after=False))
    batch = experience.batch  # the engine (behaviour) vs the trainer's weights now, by each token's staleness
    stats |= {f"mismatch/{k}": v for k, v in mismatch_stats(
        experience.old_logprobs, experience.engine_logprobs, batch.loss_mask, batch.cu_seqlens,
        weight_versions=experience.weight_versions, trainer_version=version).items()}
    ages, token_ages = staleness(rollouts, version), token_staleness(rollouts, version)
    stats |= {"staleness/mean": float(ages.float().mean()), "staleness/max": float(ages.max()),
              "staleness/token_mean": float(token_ages.float().mean()), "accuracy": arithmetic_accuracy(responses,
                                                                                                         answers)}
    stats |= {f"staleness/hist_{k}": float(c) for k, c in enumerate(torch.bincount(ages).tolist())}
    # samples a push reached mid-generation (their tokens span two weight versions)
    stats["staleness/spanning"] = sum(r.response_weight_versions is not None for r in rollouts) / len(rollouts)
    stats = {k: v for k, v in stats.items() if not k.startswith("time/")}
    with timer.phase("train_actor"):
        for minibatch in iterate_minibatches(experience, num_minibatches=MINIBATCHES, seed=step):
            stats |= actor.forward_backward(minibatch, loss_fn).metrics()
            stats |= actor.optim_step(sleep_after=False).metrics()
    return stats


def main(argv=None) -> list[dict]:
    options = parse_options(Options, argv, description=__doc__)
    if options.mode not in ("async", "sync"):
        raise SystemExit(f"--mode {options.mode!r}; expected async or sync")
    if options.tiny:
        options = dataclasses.replace(options, steps=3, prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8,
                                      lr=1e-3)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    hybrid = start(options)
    from transformers import AutoTokenizer  # after start: its checks import transformers while Ray starts

    tokenizer = AutoTokenizer.from_pretrained(hybrid.config.model)
    batches, made = prompt_source(tokenizer, options)
    count = options.prompts_per_step
    loss_fn = functools.partial(grpo_loss, kl_coef=options.kl_coef, correction=options.correction)
    generate, pushed = make_generate(hybrid, options, made), [0]  # pushed[0]: the weight version the engines hold
    buffer = RolloutBuffer(RolloutBufferConfig(
        max_staleness=options.max_staleness, capacity=(options.max_staleness + 1) * count, on_stale="wait",
        groups_per_step=count, get_timeout_s=options.timeout_s, put_timeout_s=options.timeout_s))
    producer = RolloutProducer(buffer, generate, batches, current_version=lambda: pushed[0], name="engines")
    print(f"started in {hybrid.startup['total_s']:.1f} s", flush=True)
    start_time, samples = time.perf_counter(), 0
    try:
        with MetricsLogger(out) as metrics:
            if options.mode == "async":
                producer.start()
            for step in range(options.steps):
                hybrid.timer.start_step()
                version = pushed[0]
                with hybrid.timer.phase("wait_rollouts"):
                    if options.mode == "async":
                        groups = buffer.get(count, trainer_version=version)
                        rollouts = [r for group in groups for r in group]
                    else:
                        rollouts = generate(next(batches), version)
                stats = train_step(hybrid, rollouts, version, tokenizer, loss_fn, step)
                stats |= hybrid.push_weights()  # in flight: the producer's engines pause, load, resume
                pushed[0] = int(stats["sync/version"])
                samples += len(rollouts)
                stats |= {f"buffer/{k}": v for k, v in buffer.metrics().items() if "hist" not in k}
                stats |= hybrid.timer.end_step() | {"samples": float(samples),
                                                     "samples_per_s": samples / (time.perf_counter() - start_time)}
                row = metrics.log(step, stats)
                print(f"step {step}: reward {row['reward/mean']:.3f} exact {row['accuracy']:.2f} staleness "
                      f"{row['staleness/mean']:.2f} (tokens {row['staleness/token_mean']:.2f}) mismatch kl "
                      f"{row['mismatch/kl']:.2e} | {row['time/step_s']:.2f} s, {row['samples_per_s']:.1f} samples/s",
                      flush=True)
        return metrics.rows
    finally:
        try:
            producer.stop(timeout_s=options.timeout_s)
        finally:
            buffer.close()
            hybrid.close()


if __name__ == "__main__":
    main()
