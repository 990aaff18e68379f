"""GRPO with the hybrid engine: vLLM engines, a DeepSpeed actor and its reference time-share the GPUs, on Ray.

    python examples/grpo_hybrid.py --model /tmp/smollm2-hf                  # 1 GPU, everything sleeping in turn
    python examples/grpo_hybrid.py --model /tmp/smollm2-hf --num-gpus 2     # 2 GPUs: 2 ranks, 2 engines
    python examples/grpo_hybrid.py --model M --num-gpus 4 --engine-gpus 2 --tensor-parallel-size 2  # engines apart
    python examples/grpo_hybrid.py --model /tmp/smollm2-hf --resident true  # memory is plentiful: nothing sleeps
    python examples/grpo_hybrid.py --model /tmp/smollm2-hf --engine sglang --sglang-site /tmp/site/sglang  # SGLang
    python examples/grpo_hybrid.py --device cpu --tiny true                 # CPU: HF engine, logical GPUs
    python examples/grpo_hybrid.py --model M --bf16 true --zero-stage 3 --lora-rank 16   # LoRA: adapters only, the
                                                                     # reference is the actor with adapters off
    python examples/grpo_hybrid.py --model M --bf16 true --zero-stage 3 --gradient-checkpointing true \
        --offload-optimizer true --offload-optimizer-ratio 0.66 --sub-group-elements 100000000 --engine-memory 0.25 \
        --kv-cache share --offload-trainers false --reference false --kl-coef 0 --empty-caches true  # 7B on one H200

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
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhfkit.data import ArithmeticTask, PromptDatasetConfig, arithmetic_accuracy, arithmetic_reward, prompt_batch
from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
from rlhfkit.engines import SamplingConfig
from rlhfkit.experience import ExperienceConfig, engine_token_logprobs, iterate_minibatches, make_experience
from rlhfkit.hybrid import Hybrid, HybridConfig, MetricsLogger, TrainerConfig
from rlhfkit.lora import LoraConfig
from rlhfkit.losses import kl_loss, policy_loss
from rlhfkit.options import parse_options
from rlhfkit.packing import pack_rollouts
from rlhfkit.rewards import apply_reward_function, rollout_texts
from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str | None = None  # folder or hub id (SmolLM2: examples/convert_smollm2.py); CPU: a tiny model is built
    out: str = "runs/grpo_hybrid"  # folder the run writes its metrics (and a CPU run its tiny model) to
    device: str = "cuda"  # "cuda" or "cpu"
    engine: str = "vllm"  # GPU: "vllm" or "sglang" (its server runs from --sglang-site / --sglang-python); CPU: hf
    sglang_python: str = "python3"  # interpreter that runs SGLang's server (--engine sglang)
    sglang_site: str | None = None  # e.g. /tmp/site/sglang (bench/peers/install-sglang.sh)
    num_gpus: int = 1  # GPUs per node
    num_nodes: int = 1  # Ray nodes (join a running cluster: RAY_ADDRESS; examples/launch/multi_node.sh)
    tensor_parallel_size: int = 1  # GPUs per vLLM engine (its TP workers on the actor's GPUs)
    engine_gpus: int = 0  # > 0: the engines on GPUs of their own (of --num-gpus), awake; NCCL carries the weights
    steps: int = 100  # training steps
    prompts_per_step: int = 16  # prompts per step
    samples_per_prompt: int = 8  # samples per prompt (the group GRPO's advantage compares)
    max_new_tokens: int = 64  # most tokens one sample generates
    lr: float = 5e-6  # the actor's learning rate
    kl_coef: float = 0.001  # weight of the KL term to the reference
    resident: bool = False  # nothing sleeps: engine and trainers stay on the GPU (the guard still orders phases)
    offload_trainers: bool = True  # False: only the engine sleeps, the trainers keep their states (TRL's sleep mode)
    zero_stage: int | None = None  # None: 0 in fp32 (no duplicate fp32 weight copies to move), 1 in bf16
    bf16: bool = False  # bf16 trainers and engine (large models); fp32 keeps the engine-trainer gap ~1e-3
    offload_optimizer: bool = False  # Adam states and master weights in host memory (ZeRO-Offload)
    offload_optimizer_ratio: float = 1.0  # ZeRO-3: the share of them in host memory, the rest on the GPU
    sub_group_elements: int = 1_000_000_000  # ZeRO-3 sub-group size (elements): the grain of offload_optimizer_ratio
    reference: bool = True  # False: no reference model and no KL term (needs --kl-coef 0), as DAPO
    gradient_checkpointing: bool = False  # True: recompute activations in backward (large models)
    empty_caches: bool = False  # True: the asleep actor returns its cached GPU blocks too (large models: more room)
    fused_kernels: str | None = None  # "liger": Liger-Kernel's RMSNorm, RoPE, SwiGLU in the trainers (rlhfkit[liger])
    compile_layers: bool | None = None  # torch.compile the trainers' layers; None: on a GPU, full-parameter, ZeRO<3
    lora_rank: int = 0  # > 0: train LoRA adapters (alpha = 2 * rank, attention + MLP projections) and push only them
    engine_memory: float | None = None  # vLLM's share of a GPU (None: 0.15 colocated, 0.85 on GPUs of its own)
    kv_cache: str = "batch"  # vLLM's KV cache: "batch" = (192 + --max-new-tokens) x batch, "share" = --engine-memory
    overlap_switches: bool | None = None  # a role's sleep behind the next one's wake; None: on where all fit resident
    defer_optimizer_wake: bool = True  # the actor's Adam states wake behind its first forward-backward
    micro_batch_tokens: int | None = None  # tokens per trainer forward(-backward); None: the largest that fits
    sleep_optimizer: bool | None = None  # the actor's sleeps move its Adam states too; None: not where they fit
    sleep_weights: bool | None = None  # the actor's sleeps move its weights too; None: not where they fit
    tiny: bool = False  # smoke run: 3 steps of a few short samples


CLIP, MINIBATCHES, SEED, KV_PROMPT_TOKENS = 0.2, 2, 0, 192  # KV room per sequence for its prompt (chat template)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def grpo_loss(logprobs, micro, *, num_tokens, num_seqs, kl_coef):
    """PPO-clip on GRPO advantages + k3 KL to the reference; also the engine-vs-trainer log-prob gap."""
    batch, counts = micro.batch, {"num_tokens": num_tokens, "num_seqs": num_seqs}
    loss, stats = policy_loss(logprobs, micro.old_logprobs, micro.advantages, batch.loss_mask, batch.cu_seqlens,
                              clip_low=CLIP, clip_high=CLIP, **counts)
    gap = (logprobs.detach() - micro.engine_logprobs)[batch.loss_mask].abs()
    if micro.ref_logprobs is None:  # --reference false: no KL term
        return loss, stats | {"engine_gap": float(gap.mean())}
    kl, kl_stats = kl_loss(logprobs, micro.ref_logprobs, batch.loss_mask, batch.cu_seqlens, estimator="k3",
                           **counts)
    return loss + kl_coef * kl, stats | {"kl_loss": kl_stats["kl_mean"], "engine_gap": float(gap.mean())}


def start(options: Options) -> Hybrid:
    if options.kv_cache not in ("batch", "share"):
        raise ValueError(f"--kv-cache {options.kv_cache!r}; expected batch or share")
    cpu = options.device == "cpu"
    tiny = TinyModelConfig(hidden_size=64, num_layers=2, seed=SEED)  # CPU smoke runs: a tiny random Llama
    model = options.model or str(build_tiny_model(Path(options.out) / "tiny_model", tiny, exist_ok=True))
    # ZeRO-0 + bf16 cannot sleep (DeepSpeed's BF16_Optimizer has no offload_states): bf16 takes stage 1
    stage = options.zero_stage if options.zero_stage is not None else (1 if options.bf16 and not cpu else 0)
    compile_layers = (not cpu and stage < 3 and not options.lora_rank) if options.compile_layers is None else (
        options.compile_layers)  # fewer kernel launches for a host-bound step (docs/benchmarks.md, session 20)
    deepspeed = DeepSpeedEngineConfig(zero_stage=stage, bf16=options.bf16, learning_rate=options.lr,
                                      optimizer="torch_adamw" if cpu else "fused_adam", gradient_clipping=1.0,
                                      offload_optimizer=options.offload_optimizer,
                                      offload_optimizer_ratio=options.offload_optimizer_ratio,
                                      sub_group_elements=options.sub_group_elements,
                                      gradient_checkpointing=options.gradient_checkpointing,
                                      empty_cache_on_sleep=options.empty_caches, fused_kernels=options.fused_kernels,
                                      compile_layers=compile_layers)
    separated = options.engine_gpus > 0  # the trainers' GPUs are theirs: the engines need not make room
    offload, rank = options.offload_trainers and not options.resident and not separated, options.lora_rank
    lora = LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=LORA_TARGETS) if rank else None
    if not options.reference and options.kl_coef != 0:
        raise ValueError(f"--reference false with --kl-coef {options.kl_coef}: the KL term needs the reference; "
                         "pass --kl-coef 0")
    trainers = {"actor": TrainerConfig(deepspeed=deepspeed, offload=offload, lora=lora,
                                       micro_batch_tokens=options.micro_batch_tokens,
                                       defer_optimizer_wake=options.defer_optimizer_wake,
                                       sleep_optimizer=options.sleep_optimizer,
                                       sleep_weights=options.sleep_weights)}
    if options.reference and not lora:  # with LoRA the reference is the actor's base (its adapters switched off)
        # its cached blocks are only last step's activations: returned at each sleep (behind the actor's wake), they
        # stay off the GPU while the engine generates, the step's peak
        trainers["reference"] = TrainerConfig(deepspeed=dataclasses.replace(
            deepspeed, offload_optimizer=False, offload_optimizer_ratio=1.0,
            empty_cache_on_sleep=offload or options.empty_caches), offload=offload,
            micro_batch_tokens=options.micro_batch_tokens)
    sleep_level = 0 if options.resident or separated else (1 if lora else 2)  # LoRA pushes adapters: keep the base
    engine_gpus = options.engine_gpus if separated else options.num_gpus * options.num_nodes
    kv_per_seq = KV_PROMPT_TOKENS + options.max_new_tokens if options.kv_cache == "batch" else None  # None: the share
    config = HybridConfig(model=model, device=options.device, engine="hf" if cpu else options.engine, seed=SEED,
                          sglang_python=options.sglang_python, sglang_site=options.sglang_site,
                          num_gpus=options.num_gpus, num_nodes=options.num_nodes,
                          tensor_parallel_size=options.tensor_parallel_size,
                          colocate=not separated, engine_gpus=max(1, options.engine_gpus),
                          engine_sleep_level=sleep_level, engine_memory=options.engine_memory,
                          dtype="bfloat16" if options.bf16 and not cpu else "float32",
                          kv_tokens_per_seq=kv_per_seq, overlap_switches=options.overlap_switches,
                          max_num_seqs=-(-options.prompts_per_step * options.samples_per_prompt
                                         // (engine_gpus // options.tensor_parallel_size)))
    return Hybrid.start(config, trainers)


def main(argv=None) -> list[dict]:
    options = parse_options(Options, argv, description=__doc__)
    if options.tiny:
        options = Options(**{**vars(options), "steps": 3, "prompts_per_step": 4, "samples_per_prompt": 4,
                             "max_new_tokens": 8, "lr": 1e-3})
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    hybrid = start(options)
    actor, reference, engines, timer = hybrid.trainers["actor"], hybrid.trainers.get("reference"), hybrid.engines, \
        hybrid.timer
    from transformers import AutoTokenizer  # after start: its checks import transformers while Ray starts

    tokenizer = AutoTokenizer.from_pretrained(hybrid.config.model)
    task = ArithmeticTask(min_value=0, max_value=9 if options.tiny else 99, ops=("+", "-"), seed=SEED)
    config, chat = ExperienceConfig(estimator="grpo"), PromptDatasetConfig(apply_chat_template=True)
    loss_fn = functools.partial(grpo_loss, kl_coef=options.kl_coef)
    print(f"started in {hybrid.startup['total_s']:.1f} s:", {k: round(v, 1) for k, v in hybrid.startup.items()},
          flush=True)
    print("micro-batch tokens:", {role: group.config.micro_batch_tokens for role, group in hybrid.trainers.items()},
          "| sleeps move optimizer states, weights:", {role: (group.config.sleep_optimizer, group.config.sleep_weights)
                                                      for role, group in hybrid.trainers.items()
                                                      if role in ("actor", "critic")})
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
                if options.reference:
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
                        train |= actor.optim_step(sleep_after="keep_weights" if last else False)
                        if index == 0:  # before any update: the engine-vs-trainer gap of the same weights
                            stats["engine_vs_trainer/mean_abs_logprob_diff"] = train.pop("actor/engine_gap")
                        stats |= {k: v for k, v in train.items() if k != "actor/engine_gap"}
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
