"""GRPO with the hybrid engine: vLLM engines, a DeepSpeed actor and its reference time-share the GPUs, on Ray.

    python examples/grpo_hybrid.py --model /tmp/smollm2-hf                  # 1 GPU, everything sleeping in turn
    python examples/grpo_hybrid.py --model /tmp/smollm2-hf --num-gpus 2     # 2 GPUs: 2 ranks, 2 engines
    python examples/grpo_hybrid.py --model M --num-gpus 4 --engine-gpus 2 --tensor-parallel-size 2  # engines apart
    python examples/grpo_hybrid.py --model /tmp/smollm2-hf --engine sglang --sglang-site /tmp/site/sglang  # SGLang
    python examples/grpo_hybrid.py --device cpu --tiny true                 # CPU: HF engine, logical GPUs
    python examples/grpo_hybrid.py --model M --lora-rank 16   # LoRA: adapters only; the reference is the actor with
                                                              # its adapters off
    python examples/grpo_hybrid.py --model Qwen2.5-7B-Instruct  # 7B on one H200: the plan picks the layout

What stays on the GPU in which phase (ZeRO stage, the optimizer's share in host memory, what each role's sleeps
keep, the engines' memory and KV cache, micro-batch sizes) is not an option: :func:`rlhfkit.hybrid.plan_hybrid`
decides it from the model, the GPU and the host before anything starts, and the script prints that plan (or the
phase and shortfall where nothing fits). ``bench/hybrid.py`` runs this script with plan edits for A/B comparisons.

One step, in the order the GPU is handed around (the phase guard refuses any other):

    engines generate, then sleep -> reference wakes, forwards, sleeps -> actor wakes: GRPO group advantages,
    PPO-clip + k3 KL loss over minibatches, then it keeps only its weights -> engines take them -> engines' KV cache
    wakes.

The PPO ratio's "old" log-probs are the engine's own log-probs of its tokens (one forward fewer); the gap between
them and the trainer's log-probs of the same tokens, before any update, is logged every step. Task: the built-in
arithmetic with its graded rule-based reward. Writes ``metrics.jsonl`` (reward, KL, gap, the time and peak GPU
memory of every phase) and ``phases.jsonl`` (every guarded transition) under ``--out``. See docs/hybrid.md.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhfkit.data import ArithmeticTask, PromptDatasetConfig, arithmetic_accuracy, arithmetic_reward, prompt_batch
from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
from rlhfkit.engines import SamplingConfig
from rlhfkit.experience import ExperienceConfig, engine_token_logprobs, iterate_minibatches, make_experience
from rlhfkit.hybrid import Hybrid, HybridConfig, MetricsLogger, TrainerConfig, plan_for_machine
from rlhfkit.lora import LoraConfig
from rlhfkit.losses import kl_loss, policy_loss
from rlhfkit.options import parse_options
from rlhfkit.packing import pack_rollouts
from rlhfkit.rewards import apply_reward_function, rollout_texts
from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model


def option(default, help):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str | None = option(None, "folder or hub id (SmolLM2: examples/convert_smollm2.py); CPU: a tiny model")
    out: str = option("runs/grpo_hybrid", "where metrics.jsonl and phases.jsonl go")
    device: str = option("cuda", "cuda, or cpu (DeepSpeed on CPU, the HF engine, logical GPUs)")
    engine: str = option("vllm", "GPU: vllm or sglang (its server runs from --sglang-site); CPU: always hf")
    sglang_site: str | None = option(None, "site directory of SGLang (bench/peers/install-sglang.sh)")
    num_gpus: int = option(1, "GPUs per node")
    num_nodes: int = option(1, "Ray nodes (join a running cluster: RAY_ADDRESS; examples/launch/multi_node.sh)")
    tensor_parallel_size: int = option(1, "GPUs per vLLM engine (its TP workers on the actor's GPUs)")
    engine_gpus: int = option(0, "> 0: the engines on GPUs of their own (of --num-gpus), awake; NCCL carries weights")
    steps: int = option(100, "GRPO steps")
    prompts_per_step: int = option(16, "prompts per step")
    samples_per_prompt: int = option(8, "samples per prompt (the GRPO group)")
    max_new_tokens: int = option(64, "tokens per response")
    lr: float = option(5e-6, "learning rate")
    kl_coef: float = option(0.001, "k3 KL to the reference (0: no reference model, as DAPO)")
    lora_rank: int = option(0, "> 0: train LoRA adapters (alpha = 2 * rank, attention + MLP) and push only them")
    dtype: str = option("auto", "bfloat16 or float32 (trainers and engines; float32 keeps the engine-trainer gap "
                                "~1e-3); auto: bfloat16 on a GPU, float32 on CPU")
    tiny: bool = option(False, "smoke run: 3 steps of a few short samples")


CLIP, MINIBATCHES, SEED = 0.2, 2, 0
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def grpo_loss(logprobs, micro, *, num_tokens, num_seqs, kl_coef):
    """PPO-clip on GRPO advantages + k3 KL to the reference; also the engine-vs-trainer log-prob gap."""
    batch, counts = micro.batch, {"num_tokens": num_tokens, "num_seqs": num_seqs}
    loss, stats = policy_loss(logprobs, micro.old_logprobs, micro.advantages, batch.loss_mask, batch.cu_seqlens,
                              clip_low=CLIP, clip_high=CLIP, **counts)
    gap = (logprobs.detach() - micro.engine_logprobs)[batch.loss_mask].abs()
    if micro.ref_logprobs is None:  # --kl-coef 0: no reference, no KL term
        return loss, stats | {"engine_gap": float(gap.mean())}
    kl, kl_stats = kl_loss(logprobs, micro.ref_logprobs, batch.loss_mask, batch.cu_seqlens, estimator="k3",
                           **counts)
    return loss + kl_coef * kl, stats | {"kl_loss": kl_stats["kl_mean"], "engine_gap": float(gap.mean())}


def configs(options: Options) -> tuple[HybridConfig, dict[str, TrainerConfig]]:
    """The run's config and its trainer roles (what the plan is made for)."""
    cpu = options.device == "cpu"
    tiny = TinyModelConfig(hidden_size=64, num_layers=2, seed=SEED)  # CPU smoke runs: a tiny random Llama
    model = options.model or str(build_tiny_model(Path(options.out) / "tiny_model", tiny, exist_ok=True))
    if options.dtype not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"--dtype {options.dtype!r}; expected auto, bfloat16 or float32")
    bf16 = options.dtype == "bfloat16" or (options.dtype == "auto" and not cpu)
    # ZeRO-0 + bf16 cannot sleep (DeepSpeed's BF16_Optimizer has no offload_states): bf16 takes stage 1
    rank, stage = options.lora_rank, 1 if bf16 and not cpu else 0
    deepspeed = DeepSpeedEngineConfig(zero_stage=stage, bf16=bf16, learning_rate=options.lr,
                                      optimizer="torch_adamw" if cpu else "fused_adam", gradient_clipping=1.0,
                                      compile_layers=not cpu and not rank)  # fewer launches in a host-bound step
    lora = LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=LORA_TARGETS) if rank else None
    trainers = {"actor": TrainerConfig(deepspeed=deepspeed, lora=lora)}
    if options.kl_coef and not lora:  # with LoRA the reference is the actor's base (its adapters switched off)
        trainers["reference"] = TrainerConfig(deepspeed=deepspeed)
    separated = options.engine_gpus > 0  # the trainers' GPUs are theirs: the engines need not make room
    engine_gpus = options.engine_gpus if separated else options.num_gpus * options.num_nodes
    config = HybridConfig(model=model, device=options.device, engine="hf" if cpu else options.engine, seed=SEED,
                          sglang_site=options.sglang_site, num_gpus=options.num_gpus, num_nodes=options.num_nodes,
                          tensor_parallel_size=options.tensor_parallel_size, colocate=not separated,
                          engine_gpus=max(1, options.engine_gpus), dtype="bfloat16" if bf16 and not cpu else "float32",
                          max_num_seqs=-(-options.prompts_per_step * options.samples_per_prompt
                                         // (engine_gpus // options.tensor_parallel_size)))
    return config, trainers


def start(options: Options, edit_plan=None) -> Hybrid:
    """The run's plan for this machine, printed (``edit_plan``: plan -> plan, for A/B runs), then started."""
    config, trainers = configs(options)
    plan = plan_for_machine(config, trainers)  # what stays on the GPU in which phase; MemoryFitError if nothing fits
    plan = edit_plan(plan) if edit_plan is not None else plan
    print(plan, flush=True)
    return Hybrid.start(config, trainers, plan=plan)


def main(argv=None, edit_plan=None) -> list[dict]:
    options = parse_options(Options, argv, description=__doc__)
    if options.tiny:
        options = Options(**{**vars(options), "steps": 3, "prompts_per_step": 4, "samples_per_prompt": 4,
                             "max_new_tokens": 8, "lr": 1e-3})
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    hybrid = start(options, edit_plan)
    actor, reference, engines, timer = hybrid.trainers["actor"], hybrid.trainers.get("reference"), hybrid.engines, \
        hybrid.timer
    from transformers import AutoTokenizer  # after start: its checks import transformers while Ray starts

    tokenizer = AutoTokenizer.from_pretrained(hybrid.config.model)
    task = ArithmeticTask(min_value=0, max_value=9 if options.tiny else 99, ops=("+", "-"), seed=SEED)
    config, chat = ExperienceConfig(estimator="grpo"), PromptDatasetConfig(apply_chat_template=True)
    loss_fn = functools.partial(grpo_loss, kl_coef=options.kl_coef)
    print(f"started in {hybrid.startup['total_s']:.1f} s:", {k: round(v, 1) for k, v in hybrid.startup.items()},
          flush=True)
    try:
        with MetricsLogger(out) as metrics:
            for step in range(options.steps):
                timer.start_step()
                count = options.prompts_per_step  # problems step * count ... of the task, as chat prompts
                prompts = prompt_batch(task.records(count, start=step * count), tokenizer, chat)
                # one random stream per engine and step: vLLM samples the batch at once, not sample by sample
                sampling = SamplingConfig(n=options.samples_per_prompt, max_new_tokens=options.max_new_tokens,
                                          seed=SEED * 1_000_003 + step, seed_scope="call")
                # 1. The engines generate holding the GPU, then sleep.
                with timer.phase("generate"):
                    rollouts = engines.generate(prompts.token_ids, sampling)
                with timer.phase("reward"):
                    texts, responses, answers = rollout_texts(rollouts, prompts=prompts.texts, labels=prompts.labels,
                                                              tokenizer=tokenizer)
                    scores, _ = apply_reward_function(arithmetic_reward, texts, responses, answers)
                batch = pack_rollouts(rollouts)
                # 2. The reference wakes, computes its log-probs on every rank, and sleeps (LoRA: the actor wakes
                #    and stays awake to train; its base model, adapters off, is the reference).
                ref_logprobs = None
                if options.kl_coef:
                    with timer.phase("forward_reference"):
                        ref_logprobs = (reference.forward(batch) if reference is not None else
                                        actor.forward(batch, adapters=False, sleep_after=False))
                # 3. GRPO advantages; the engine's log-probs are the behaviour policy's.
                with timer.phase("experience"):
                    experience, stats = make_experience(
                        rollouts, torch.tensor(scores), config=config,
                        policy_logprobs_fn=lambda b: engine_token_logprobs(rollouts, b),
                        ref_logprobs_fn=None if ref_logprobs is None else lambda b: ref_logprobs)
                    stats = {k: v for k, v in stats.items() if not k.startswith("time/")}  # timer has the phases
                # 4. The actor wakes and trains over minibatches; then it keeps only its weights for the push.
                with timer.phase("train_actor"):
                    minibatches = list(iterate_minibatches(experience, num_minibatches=MINIBATCHES, seed=step))
                    for index, minibatch in enumerate(minibatches):
                        train = actor.forward_backward(minibatch, loss_fn)
                        last = index == len(minibatches) - 1
                        step_result = actor.optim_step(sleep_after="keep_weights" if last else False)
                        if index == 0:  # before any update: the engine-vs-trainer gap of the same weights
                            stats["engine_vs_trainer/mean_abs_logprob_diff"] = train.stats["engine_gap"]
                        stats |= {k: v for k, v in train.metrics().items() if k != "actor/engine_gap"}
                        stats |= step_result.metrics()
                # 5. The engines take the new weights, then wake their KV cache.
                stats |= hybrid.push_weights()
                stats |= timer.end_step() | {"accuracy": arithmetic_accuracy(responses, answers)}
                row = metrics.log(step, stats)
                print(f"step {step}: reward {row['reward/mean']:.3f} exact {row['accuracy']:.2f} "
                      f"kl {row.get('kl/mean', 0.0):.4f} gap {row['engine_vs_trainer/mean_abs_logprob_diff']:.4f} "
                      f"| {row['time/step_s']:.2f} s, switches {row['time/phase_switch_fraction']:.1%}", flush=True)
                hybrid.write_phase_log(out / "phases.jsonl")
        hybrid.write_phase_log(out / "phases.jsonl", settle=True)  # a sleep still running behind the last wake
        return metrics.rows
    except BaseException:
        with contextlib.suppress(Exception):  # the memory each role held up to the failure; the failure is the error
            hybrid.write_phase_log(out / "phases.jsonl")
        raise
    finally:
        hybrid.close()


if __name__ == "__main__":
    main()
