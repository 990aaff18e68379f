"""Machinery shared by the hybrid-engine examples ``grpo_hybrid.py`` and ``ppo_hybrid.py``; read those first.

The loop of each example lives in the example. This file (the driver's side) and ``_hybrid_actors.py`` (the Ray
actors: one DeepSpeed model per role and rank, the rollout engines, every sleep/wake through the phase guard) hold
what a user would otherwise paste into every script:

- :func:`add_arguments`/:func:`parse_arguments`: the shared command line;
- :func:`launch` / :class:`Run`: Ray, the placement plan, engines, workers, the sync wiring, step records, tear-down;
- :func:`guarded_forward`, :func:`guarded_train`, :func:`sync_weights`: fan work out over the data-parallel ranks,
  with each role's wake and sleep sent along with its work (an actor runs its calls in order: one round trip);
- :class:`StepClock` (+ an NVML sampler): per-phase wall time and device-wide peak GPU memory; the metrics files.

Not part of the library: ``examples/`` is not installed, so Ray ships these classes to its workers by value.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _hybrid_actors as actors
import torch
from _hybrid_actors import TrainSettings, gpu_key

from rlhfkit.experience import engine_token_logprobs, select_experience
from rlhfkit.packing import partition_by_token_budget, select_sequences
from rlhfkit.phase import TCPPhaseStore

GIB = 1024**3
FORWARD_ENV = ("PYTHONPATH", "LD_LIBRARY_PATH", "PATH", "CUDA_HOME", "HF_HOME", "TORCH_EXTENSIONS_DIR")


def parse_bool(text: str) -> bool:
    import argparse

    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


TF32_SCOPES = ("backward", "reference")


def parse_tf32(text: str) -> str:
    """``--tf32``: ``off``, ``all``, or a comma-separated set of scopes (``backward``, ``reference``)."""
    import argparse

    scopes = [part.strip() for part in text.split(",") if part.strip()]
    if scopes in (["off"], ["all"]):
        return scopes[0]
    unknown = [scope for scope in scopes if scope not in TF32_SCOPES]
    if not scopes or unknown:
        raise argparse.ArgumentTypeError(f"--tf32 {text!r}: expected off, all, or a comma-separated set of "
                                         f"{', '.join(TF32_SCOPES)}")
    return ",".join(scope for scope in TF32_SCOPES if scope in scopes)


def role_tf32(tf32: str, role: str) -> str:
    """What ``ModelWorker.load(tf32=...)`` gets for ``role`` under ``--tf32``: "all", "backward" or "off"."""
    scopes = set(tf32.split(","))
    if "all" in scopes:
        return "all"
    if role in ("reference", "reward"):  # frozen models: forwards only
        return "all" if "reference" in scopes else "off"
    return "backward" if "backward" in scopes else "off"


def add_arguments(parser, *, default_out: str) -> None:
    """The options both examples share (model, engine, placement, batch sizes, optimisation, timeouts)."""
    a = parser.add_argument
    a("--model", default=None, help="HF model folder (SmolLM2 from examples/convert_smollm2.py); CPU default: a "
      "tiny model built with rlhfkit.tiny_models")
    a("--out", type=Path, default=Path(default_out), help="output directory")
    a("--engine", choices=("vllm", "hf"), default="vllm", help="rollout engine backend")
    a("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: DeepSpeed on CPU, gloo sync, logical GPUs")
    a("--num-gpus", type=int, default=1, help="GPUs per node the plan uses (logical GPUs on CPU)")
    a("--nodes", type=int, default=1)
    a("--colocate", type=parse_bool, default=True, help="true: engines share the trainers' GPUs (CUDA-IPC sync); "
      "false: engines on --engine-gpus GPUs of their own (NCCL sync)")
    a("--engine-gpus", type=int, default=1, help="GPUs of the engines when --colocate false")
    a("--tensor-parallel-size", type=int, default=1, help="GPUs per vLLM engine (only with --colocate false)")
    a("--steps", type=int, default=100)
    a("--rollout-batch", type=int, default=32, help="prompts per step")
    a("--samples-per-prompt", type=int, default=8)
    a("--max-new-tokens", type=int, default=96)
    a("--temperature", type=float, default=1.0)
    a("--max-value", type=int, default=99, help="arithmetic operands lie in [0, max-value]")
    a("--lr", type=float, default=5e-6, help="actor learning rate")
    a("--kl-coef", type=float, default=0.001)
    a("--clip", type=float, default=0.2)
    a("--epochs", type=int, default=1, help="passes over each step's experience")
    a("--minibatches", type=int, default=2, help="optimizer steps per epoch")
    a("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    a("--old-logprobs", choices=("trainer", "engine"), default="trainer", help="the behaviour log-probs of the PPO "
      "ratio: trainer (the actor's forward before training, as TRL and OpenRLHF do) or engine (the rollout engine's "
      "own log-probs of its tokens: one forward fewer; the engine-vs-trainer mismatch is then measured on the first "
      "minibatch's training forward, before any update)")
    a("--forward-tokens", type=int, default=8192, help="token budget of one no-grad forward micro-batch")
    a("--zero-stage", type=int, default=3)
    a("--dtype", choices=("float32", "bfloat16"), default="float32", help="trainer, engine and sync dtype on GPU "
      "(CPU: float32). float32 keeps the engine's log-probs within ~1e-3 of the trainer's on a 135M model; "
      "bfloat16 halves memory and sync bytes but both sides round logits to 8 bits (|Δ| ≈ 0.04 nats on SmolLM2)")
    a("--attn", choices=("varlen", "sdpa"), default="varlen", help="trainer attention on packed micro-batches: "
      "varlen (rlhfkit.packing.VARLEN_ATTENTION: one padded causal sdpa per layer, cost N*L^2) or sdpa "
      "(transformers' block-diagonal mask over the whole micro-batch, cost T^2)")
    a("--tf32", type=parse_tf32, default="off", help="float32 trainers' matmuls on TF32 tensor cores "
      "(torch.set_float32_matmul_precision('high'); the engine keeps full float32): off, all, or a comma-separated "
      "set of scopes — 'backward': the actor's and critic's backward passes (their forwards, log-probs and the "
      "engine-vs-trainer gap stay float32); 'reference': the frozen models' forwards (reference and reward model: "
      "the KL term's reference log-probs, the rewards). 'all' is everywhere (on SmolLM2 the engine-vs-trainer gap "
      "grows from ~0.002 to 0.03-0.06 nats)")
    a("--profile-step", type=int, default=-1, help="run this step's training under torch.profiler: device busy "
      "time against wall time in the metrics, each rank's top ops in --out/profile_*.txt (on that rank's node)")
    a("--gradient-checkpointing", action="store_true")
    a("--offload-trainers", type=parse_bool, default=True, help="true: DeepSpeed models sleep to pinned host "
      "memory between their phases; false: they stay on the GPU (their sleep only empties the CUDA cache) — for "
      "models small enough to share the GPU with the engine's pool, it saves the offload round trips")
    a("--gpu-memory-utilization", type=float, default=None, help="vLLM's share of GPU memory (default 0.15 "
      "colocated, 0.85 on its own GPU); the KV cache it leaves is woken at every step, so do not oversize it")
    a("--max-model-len", type=int, default=1024)
    a("--enforce-eager", action="store_true", help="no CUDA graphs in vLLM")
    a("--engine-sleep-level", type=int, choices=(0, 1, 2), default=2, help="2 (default) discards engine weights "
      "while asleep: the sync rewrites them all; 1 keeps them in host memory (vLLM 0.22 pins a fresh host buffer at "
      "every level-1 sleep, ≈ 1 GB/s); 0 keeps the engine resident (weights and KV cache stay on the GPU, the guard "
      "still orders the phases) — for small models, with --offload-trainers false")
    a("--sync-bucket-mb", type=int, default=None, help="weight-sync bucket size (default 128; with a zero-copy "
      "sync, whose buckets are only lists of the actor's own tensors, one bucket for the whole model)")
    a("--weight-loading", choices=("auto", "direct", "layerwise", "planned"), default="auto", help="how vLLM workers "
      "apply synced weights (VLLMEngineConfig.weight_loading; 'planned' replays the copies recorded at the first "
      "sync)")
    a("--sync-zero-copy", choices=("auto", "true", "false"), default="auto", help="colocated CUDA-IPC sync: the "
      "engine copies straight out of the actor's parameters (one copy, no bucket); auto: with ZeRO-1/2, whose flat "
      "parameter buffers make it pay")
    a("--sync-mode", choices=("rpc", "armed"), default="rpc", help="how engines take a weight sync: rpc (a "
      "receive call to every engine, concurrent with the actor's send) or armed (the engines start waiting when "
      "they wake for the sync, in the same call; the sync is then the actor's send alone, and each engine settles "
      "it before its next operation)")
    a("--seed", type=int, default=0)
    a("--ray-address", default=None, help="join a running cluster (default: $RAY_ADDRESS, else a new local one)")
    a("--start-timeout", type=float, default=900.0)
    a("--call-timeout", type=float, default=900.0, help="limit of every call to an actor")
    a("--sync-timeout", type=float, default=300.0, help="limit of every wait inside a weight sync")
    a("--tiny", action="store_true", help="smoke run: 3 steps of a few samples")
    a("--no-plot", action="store_true")


def attention(args) -> str:
    """The trainers' ``attn_implementation`` for ``--attn``."""
    from rlhfkit.packing import VARLEN_ATTENTION

    return VARLEN_ATTENTION if args.attn == "varlen" else "sdpa"


TINY = {"steps": 3, "rollout_batch": 4, "samples_per_prompt": 4, "max_new_tokens": 8, "forward_tokens": 512,
        "grad_accum": 1, "max_value": 9, "lr": 1e-3}


def parse_arguments(parser, argv, *, tiny: dict | None = None):
    """Parse; with ``--tiny`` the smoke-run defaults (``TINY`` | ``tiny``) replace the usual ones — flags given on
    the command line still win. Then fill mode-dependent defaults and refuse impossible combinations early."""
    args = parser.parse_args(argv)
    if args.tiny:
        parser.set_defaults(**{**TINY, **(tiny or {})})
        args = parser.parse_args(argv)
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.15 if args.colocate else 0.85
    if args.device == "cpu" and args.engine == "vllm":
        parser.error("--device cpu needs --engine hf (the vLLM engine here is CUDA-only)")
    if args.model is None and args.device == "cuda":
        parser.error("--model is required on GPU (convert SmolLM2 with examples/convert_smollm2.py)")
    tp, total = args.tensor_parallel_size, args.num_gpus * args.nodes
    if args.colocate and tp != 1:
        parser.error(f"--tensor-parallel-size {tp} needs --colocate false: colocated CUDA-IPC sync pairs one "
                     "trainer rank with one single-GPU engine per GPU")
    if args.engine == "hf" and tp != 1:
        parser.error("--engine hf has no tensor parallelism; use --tensor-parallel-size 1")
    if not args.colocate and not (0 < args.engine_gpus < total and args.engine_gpus % tp == 0):
        parser.error(f"--colocate false needs 0 < --engine-gpus < {total} GPUs and a multiple of TP {tp}; got "
                     f"{args.engine_gpus}")
    ranks = total if args.colocate else total - args.engine_gpus
    per_minibatch = args.rollout_batch * args.samples_per_prompt // (ranks * args.minibatches)
    if per_minibatch < 2 * args.grad_accum:  # shards are balanced by tokens, so sequence counts vary a little
        parser.error(f"{args.rollout_batch} prompts x {args.samples_per_prompt} samples over {ranks} rank(s) x "
                     f"{args.minibatches} minibatches leave ~{per_minibatch} sequences per minibatch, too few for "
                     f"--grad-accum {args.grad_accum} micro-batches; lower --grad-accum or --minibatches")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model is None:  # CPU smoke runs: a tiny random Llama with a locally trained tokenizer
        from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model

        path = args.out / "tiny_model"
        if not (path / "config.json").exists():
            build_tiny_model(path, TinyModelConfig(hidden_size=64, num_layers=2, seed=args.seed))
        args.model = str(path)
    return args


def worker_env(args) -> dict[str, str]:
    """Environment of every Ray actor, passed explicitly (Ray workers do not inherit the driver's shell)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONWARNINGS": "ignore::FutureWarning"}  # torch.distributed deprecations DeepSpeed hits every step
    if args.device == "cpu":
        return env | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    # DeepSpeed 0.19.8 cannot parse the '9.0a' some images set; FusedAdam's JIT build needs an arch it can parse.
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0").replace("9.0a", "9.0")
    return env | {"TORCH_CUDA_ARCH_LIST": arch, "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def arithmetic_prompts(task, tokenizer, step: int, count: int):
    """Problems ``step * count ...`` of the arithmetic task as chat prompts (rlhfkit's PromptDataset applies the
    template): token ids, prompt texts, labels."""
    from rlhfkit.data import PromptDataset, PromptDatasetConfig

    data = PromptDataset(task.records(count, start=step * count), tokenizer,
                         PromptDatasetConfig(apply_chat_template=True))
    batch = next(data.batches(count, seed=0, shuffle=False))
    return batch.token_ids, batch.texts, batch.labels


def sampling_config(args, stops: tuple[int, ...], step: int):
    """The step's sampling: ``--samples-per-prompt`` samples per prompt, a seed per step."""
    from rlhfkit.engines import SamplingConfig

    return SamplingConfig(n=args.samples_per_prompt, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, stop_token_ids=stops, seed=args.seed * 1_000_003 + step)


def stop_tokens(tokenizer, model_path: str) -> tuple[int, ...]:
    """The model's end-of-turn tokens (generation config and tokenizer), stop tokens of every sample."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return tuple(sorted(set(eos) | {tokenizer.eos_token_id} - {None}))


# ------------------------------------------------------------------------------------------------ launching
class Run:
    """Everything :func:`launch` started, and the step records; :meth:`close` stops it all (actors, placement groups,
    Ray if it started it)."""

    def __init__(self, args) -> None:
        self.args, self.workers, self.engine_handles, self.history = args, {}, [], []
        self.engines = self.placed = self.store = self.sampler = None
        self.started_ray, self.startup = False, {}
        self._metrics = (args.out / "metrics.jsonl").open("w")

    def record(self, step: int, clock: StepClock, stats: dict, experience, accuracy: float) -> dict:
        """Add the step's timing, memory, mismatch and throughput to ``stats``; append it to metrics.jsonl."""
        generated = float(experience.response_lengths.sum())
        stats = {k: v for k, v in stats.items() if not k.startswith("time/")}  # make_experience's own sub-timings
        if "engine_vs_trainer/mean_abs_logprob_diff" not in stats:  # (--old-logprobs engine: measured in training)
            stats |= mismatch_metrics(experience)
        stats |= clock.metrics()
        stats |= {"step": step, "accuracy": accuracy, "tokens/generated": generated,
                  "tokens/per_s": generated / stats["time/step_s"]}
        row = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        self.history.append(row)
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        print(f"step {step}: reward {row['reward/mean']:.3f} exact {accuracy:.2f} kl {row.get('kl/mean', 0):.4f} "
              f"|Δlogp| {row['engine_vs_trainer/mean_abs_logprob_diff']:.4f} | {row['time/step_s']:.2f} s: generate "
              f"{row['time/generate_s']:.2f}, forwards {row['time/experience_forwards_s']:.2f}, train "
              f"{row['time/training_s']:.2f}, sleep/wake {row['time/sleep_wake_s']:.2f}, sync "
              f"{row['time/weight_sync_s']:.2f}", flush=True)
        return row

    def finish(self) -> dict:
        """phases.jsonl, summary.json and curve.png from what the run recorded; returns the summary."""
        return write_outputs(self, self.history)

    def close(self) -> None:
        import ray

        self._metrics.close()
        for group in self.workers.values():
            group.shutdown()
        for handle in self.engine_handles:
            ray.kill(handle, no_restart=True)
        if self.engines is not None:
            self.engines.close()
        if self.placed is not None:
            self.placed.remove()
        if self.sampler is not None:
            self.sampler.close()
        if self.started_ray:
            ray.shutdown()


def start_ray(args) -> bool:
    """Start a local Ray (logical GPUs on CPU) or join ``--ray-address``/``$RAY_ADDRESS``; reuse one already up."""
    import ray

    from rlhfkit.workers import RayConfig, ray_init

    for module in (actors, sys.modules[__name__]):  # examples/ is not importable on the workers: ship by value
        ray.cloudpickle.register_pickle_by_value(module)
    if ray.is_initialized():
        return False
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        config = RayConfig(address=address, env_vars=worker_env(args), forward_env=FORWARD_ENV)
    else:
        cpu = args.device == "cpu"
        config = RayConfig(num_gpus=args.num_gpus if cpu else None, num_cpus=max(2, os.cpu_count() or 2) if cpu
                           else None, object_store_memory=512 * 1024**2 if cpu else None,
                           env_vars=worker_env(args), forward_env=FORWARD_ENV)
    ray_init(config)
    return True


def make_plan(args, roles: tuple[str, ...]):
    """Colocated: every role and the engines on the same GPUs (hybrid). Else: trainers share GPUs, engines apart."""
    from rlhfkit.placement import Inventory, PlacementConfig, RoleSpec, engines, plan_placement

    inventory = Inventory.uniform(num_nodes=args.nodes, gpus_per_node=args.num_gpus)
    total, tp = inventory.num_gpus, args.tensor_parallel_size
    engine_gpus = total if args.colocate else args.engine_gpus
    trainers = tuple(RoleSpec(name=role, num_gpus=total if args.colocate else total - engine_gpus) for role in roles)
    all_roles = trainers + (engines(engine_gpus // tp, tp),)
    if args.colocate:
        return plan_placement(PlacementConfig(roles=all_roles, inventory=inventory, hybrid=True))
    groups = (roles,) if len(roles) > 1 else ()
    return plan_placement(PlacementConfig(roles=all_roles, inventory=inventory, colocate=groups))


def launch(args, configs: dict, *, reward_model: str | None = None) -> Run:
    """Ray → plan → engines, and the trainer processes in parallel (they only import until told to load) → trainer
    models loaded one role at a time, each holding the GPU's claim → weight-sync wiring → a check that the guard
    refuses a wrong order → engines awake for the first step."""
    from rlhfkit.placement import materialize

    run, started = Run(args), time.perf_counter()
    paths = {role: (reward_model if role == "reward" and reward_model else args.model) for role in configs}
    try:
        run.started_ray = start_ray(args)
        plan = make_plan(args, tuple(configs))
        print(plan, flush=True)
        run.placed = materialize(plan, timeout_s=args.start_timeout, cpus_per_bundle=0)
        import ray

        run.store = TCPPhaseStore.serve(host=ray.util.get_node_ip_address())
        with ThreadPoolExecutor(1 + len(configs)) as pool:
            engines = pool.submit(_start_engines, run)
            groups = {role: pool.submit(_start_group, run, role, paths[role]) for role in configs}
            for role, future in groups.items():
                run.workers[role] = future.result()
            engines.result()
        run.startup["processes_s"] = time.perf_counter() - started
        for role, config in configs.items():  # one role at a time: each claims the GPU while it loads
            # resident trainers next to a resident engine: nobody needs their cached blocks back between phases
            info = run.workers[role].call("load", paths[role], config, args.seed, args.offload_trainers,
                                          empty_cache=args.engine_sleep_level > 0 or not args.colocate,
                                          tf32=role_tf32(args.tf32, role), timeout_s=args.start_timeout)
            print(f"{role}: {info[0]['parameters'] / 1e6:.1f}M parameters on {len(info)} rank(s)", flush=True)
        run.startup["models_s"] = time.perf_counter() - started - run.startup["processes_s"]
        _connect_weight_sync(run)
        run.startup["guard_refused_wrong_order"] = _check_guard(run)
        run.sampler = GpuMemorySampler(enabled=args.device == "cuda")
    except BaseException:
        run.close()
        raise
    run.startup["total_s"] = time.perf_counter() - started
    print(f"started in {run.startup['total_s']:.1f} s", flush=True)
    return run


def _start_engines(run: Run) -> None:
    from rlhfkit.engines.router import EngineGroup, EngineGroupConfig

    args, placed = run.args, run.placed
    gpus = [[gpu_key(p.node, g) for g in p.gpus] for p in placed.plan.ranks("rollout")]
    if args.engine == "vllm":
        from rlhfkit.engines.vllm import VLLMEngineConfig, create_engines

        config = VLLMEngineConfig(
            model=args.model, num_engines=len(gpus), tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=args.colocate, seed=args.seed,
            enforce_eager=args.enforce_eager, max_model_len=args.max_model_len, dtype=args.dtype,
            env=worker_env(args), startup_timeout_s=args.start_timeout, control_timeout_s=args.call_timeout,
            weight_loading=args.weight_loading)
        run.engine_handles = create_engines(config, placement=placed, role="rollout",
                                            engine_cls=actors.vllm_engine_class(run.store, gpus))
    else:
        import ray

        actor_cls = ray.remote(actors.HFEngineActor)
        for index, engine_gpus in enumerate(gpus):
            options = placed.actor_options("rollout", index) | {"runtime_env": {"env_vars": worker_env(args)},
                                                                  "max_restarts": 0}
            run.engine_handles.append(actor_cls.options(**options).remote(
                args.model, engine_index=index, seed=args.seed, device=args.device, guard_store=run.store,
                gpus=engine_gpus, dtype=args.dtype if args.device == "cuda" else "float32"))
        ray.get([handle.ready.remote() for handle in run.engine_handles], timeout=args.start_timeout)
    run.engines = EngineGroup(run.engine_handles, forward_prompt_indices=True, config=EngineGroupConfig(
        generate_timeout_s=args.call_timeout, control_timeout_s=args.call_timeout))
    if args.colocate:  # the trainers load next; level 1 keeps the weights for the first generation
        run.engines.call("guarded_sleep", 1, "startup")


def _start_group(run: Run, role: str, path: str):
    from rlhfkit.workers import WorkerGroup, WorkerGroupConfig

    args = run.args
    config = WorkerGroupConfig(role=role, env_vars=worker_env(args), forward_env=FORWARD_ENV,
                               start_timeout_s=args.start_timeout, call_timeout_s=args.call_timeout)
    return WorkerGroup(actors.ModelWorker, run.placed, config, run.store, args.device, path)


def _connect_weight_sync(run: Run) -> None:
    """Colocated: one CUDA-IPC (gloo on CPU) group per GPU, actor rank r → engine r. Else actor rank 0 broadcasts
    over NCCL (gloo on CPU) to every worker of every engine (TP workers take consecutive ranks)."""
    import ray

    from rlhfkit.weight_sync import WeightSyncConfig

    args, actor = run.args, run.workers["actor"]
    cpu, tp = args.device == "cpu", args.tensor_parallel_size
    backend = "gloo" if cpu else ("cuda_ipc" if args.colocate else "nccl")
    dtype = None if cpu else args.dtype
    zero_copy = backend == "cuda_ipc" and (args.sync_zero_copy == "true" or
                                           (args.sync_zero_copy == "auto" and args.zero_stage < 3))
    keep_mapped = zero_copy and not args.offload_trainers  # the actor's parameters never move: map them once
    # zero-copy from ZeRO-1/2's resident buffers: 1 TiB = a single bucket (ZeRO-3 gathers a bucket at a time)
    bucket_mb = args.sync_bucket_mb or (1 << 20 if zero_copy and args.zero_stage < 3 else 128)
    config = WeightSyncConfig(backend=backend, bucket_bytes=bucket_mb * 1024**2,
                              dtype=getattr(torch, dtype) if dtype else None, timeout_s=args.sync_timeout,
                              ipc_zero_copy=zero_copy, ipc_keep_mapped=keep_mapped)
    common = {"backend": backend, "bucket_bytes": config.bucket_bytes, "dtype": dtype,
              "sync_timeout_s": args.sync_timeout, "zero_copy": zero_copy,
              "keep_mapped": keep_mapped}
    plan = run.placed.plan
    if args.colocate:
        for rank, engine in zip(plan.ranks("actor"), plan.ranks("rollout"), strict=True):
            assert (rank.node, rank.gpus) == (engine.node, engine.gpus), "plan pairs actor rank r with engine r"
        endpoints = actor.call("open_weight_sync", True, world_size=2, group_name="weights", **common)
        refs = [handle.init_weight_sync.remote(config, endpoint, first_rank=1)
                for handle, endpoint in zip(run.engine_handles, endpoints, strict=True)]
    else:
        senders = [rank == 0 for rank in range(actor.world_size)]
        world = 1 + len(run.engine_handles) * tp
        endpoint = actor.call_scattered("open_weight_sync", senders, world_size=world, group_name="weights",
                                        **common)[0]
        refs = [handle.init_weight_sync.remote(config, endpoint, first_rank=1 + index * tp)
                for index, handle in enumerate(run.engine_handles)]
    ray.get(refs, timeout=args.call_timeout)


def _check_guard(run: Run) -> bool:
    """Colocated: wake the engines, then try to wake the actor on their GPUs; every rank's guard must refuse it."""
    import ray

    if not run.args.colocate:
        return False
    run.engines.call("guarded_wake", None, "generate")
    refused = []
    for ref in run.workers["actor"].submit("wake", "wrong-order-check").refs:
        try:
            ray.get(ref, timeout=run.args.call_timeout)
        except ray.exceptions.RayTaskError as error:
            refused.append("'rollout' is awake there" in str(error))
    if not refused or not all(refused) or len(refused) != run.workers["actor"].world_size:
        raise RuntimeError(f"the phase guard let an actor rank wake while the engines were awake on its GPU "
                           f"(refusals by rank: {refused})")
    print(f"phase guard check: every actor rank was refused while the engines were awake ({len(refused)})",
          flush=True)
    return True


# ------------------------------------------------------------------------------------------------ data-parallel fan-out
def precomputed(values: torch.Tensor):
    """A forward function for ``make_experience`` that hands back values the actors computed already for the same
    packing of the same rollouts (the loop packs with ``pack_rollouts``, as ``make_experience`` does)."""

    def forward(batch) -> torch.Tensor:
        if values.shape[0] != batch.num_tokens:
            raise ValueError(f"precomputed values have {values.shape[0]} entries but make_experience packed "
                             f"{batch.num_tokens} tokens; pack the rollouts with rlhfkit.packing.pack_rollouts")
        return values

    return forward


def submit_forward(group, kind: str, batch, *, max_tokens: int, temperature: float = 1.0):
    """Start a no-grad forward of ``batch`` on every rank of ``group``: balanced shards, each cut into the same number
    of micro-batches on every rank (ZeRO-3 gathers are collective). Collect it with :func:`collect_forward`."""
    lengths = batch.seq_lens.tolist()
    shards = partition_by_token_budget(lengths, num_micro_batches=group.world_size)
    count = max(math.ceil(sum(lengths[i] for i in shard) / max_tokens) for shard in shards)
    count = min(count, min(len(shard) for shard in shards))
    items, places = [], []
    for shard in shards:
        parts = partition_by_token_budget([lengths[i] for i in shard], num_micro_batches=count)
        selected = [[shard[i] for i in part] for part in parts]
        micro = [select_sequences(batch, indices) for indices in selected]
        items.append([sub for sub, _ in micro])
        places.append(selected if kind == "rewards" else [index for _, index in micro])
    size = batch.num_seqs if kind == "rewards" else batch.num_tokens
    return group.submit_scattered("forward", items, kind=kind, temperature=temperature), places, size


def collect_forward(group, started) -> tuple[torch.Tensor, float]:
    """The ``[T]`` result (``[N]`` for ``kind="rewards"``) of :func:`submit_forward` in the batch's order, and the
    ranks' peak allocated GiB."""
    pending, places, size = started
    results = group.gather(pending)
    out = torch.zeros(size)
    for result, rank_places in zip(results, places, strict=True):
        for values, place in zip(result["outputs"], rank_places, strict=True):
            out[torch.as_tensor(place)] = values
    return out, max(result["peak_gib"] for result in results)


def dp_forward(group, kind: str, batch, *, max_tokens: int, temperature: float = 1.0) -> tuple[torch.Tensor, float]:
    """:func:`submit_forward` then :func:`collect_forward`."""
    return collect_forward(group, submit_forward(group, kind, batch, max_tokens=max_tokens, temperature=temperature))


def behaviour_logprobs(clock, actor, batch, rollouts, args) -> torch.Tensor:
    """``[T]`` log-probs of the policy that generated ``rollouts`` (packed as ``batch``): the awake actor's forward,
    or with ``--old-logprobs engine`` the engine's own log-probs of its tokens (0 off the responses)."""
    if args.old_logprobs == "trainer":
        with clock.phase("forward_actor"):
            values, clock.extra["mem_process/forward_actor_peak_gib"] = dp_forward(
                actor, "logprobs", batch, max_tokens=args.forward_tokens, temperature=args.temperature)
        return values
    values = engine_token_logprobs(rollouts, batch)
    if values is None:
        raise ValueError("--old-logprobs engine: the rollouts carry no engine log-probs")
    return values


def submit_train(group, experience, settings: TrainSettings, step: int):
    """Start training every rank on its token-balanced shard of the step's experience; collect it with
    :func:`collect_train` (ranks' stats averaged; loss summed: each rank's is its share of the global objective)."""
    shards = partition_by_token_budget(experience.batch.seq_lens.tolist(), num_micro_batches=group.world_size)
    return group.submit_scattered("train", [select_experience(experience, shard) for shard in shards],
                                  settings=settings, step=step)


def collect_train(group, pending) -> dict:
    results = group.gather(pending)
    merged = {}
    for key in results[0]:
        values = [result[key] for result in results]
        merged[key] = sum(values) if key.endswith("/loss") else (max(values) if key == "peak_gib" or "/max_" in key
                                                                   else sum(values) / len(values))
    role = group.role
    merged[f"mem_process/train_{role}_peak_gib"] = merged.pop("peak_gib")
    return merged


def guarded_forward(clock, group, kind: str, batch, args) -> torch.Tensor:
    """Wake a model, run its forward over the data-parallel ranks, put it back to sleep (the reference and reward
    model, and the critic's value forward in PPO). The three calls go out together (each actor runs its calls in
    order): one round trip instead of three; the ranks' own transition times count as sleep/wake."""
    phase = f"forward_{group.role}"
    with clock.phase(phase):
        woke = group.submit("wake", phase)
        started = submit_forward(group, kind, batch, max_tokens=args.forward_tokens, temperature=args.temperature)
        slept = group.submit("sleep", phase)
        switch = max(group.gather(woke))
        values, peak = collect_forward(group, started)
        switch += max(group.gather(slept))
    clock.move(phase, "sleep_wake", switch)
    clock.extra[f"mem_process/{phase}_peak_gib"] = peak
    return values


def guarded_train(clock, group, experience, settings: TrainSettings, step: int, *, sleep_phase: str,
                  keep_weights: bool = False, woke=None) -> dict:
    """Train ``group`` and put it to sleep for ``sleep_phase``, its wake (``woke``: a ``group.submit("wake", ...)``
    sent earlier, so that it overlapped with the driver's work; else sent here), training and sleep in one round
    trip; the ranks' own transition times count as sleep/wake, the rest as ``train_{role}``."""
    phase = f"train_{group.role}"
    with clock.phase(phase):
        woke = group.submit("wake", "train") if woke is None else woke
        training = submit_train(group, experience, settings, step)
        slept = group.submit("sleep", sleep_phase, keep_weights=keep_weights)
        switch = max(group.gather(woke))
        stats = collect_train(group, training)
        switch += max(group.gather(slept))
    clock.move(phase, "sleep_wake", switch)
    return stats


def generate(run: Run, clock, prompt_ids, sampling):
    """The engines generate holding their GPUs (weights + KV cache); colocated, they then sleep and give them up."""
    with clock.phase("generate"):
        rollouts = run.engines.generate(prompt_ids, sampling)
    if run.args.colocate:
        with clock.phase("sleep_wake"):
            run.engines.call("guarded_sleep", run.args.engine_sleep_level, "generate")
    return rollouts


def sync_to_engines(run: Run, clock) -> dict:
    """With the actor asleep but for its weights (``sleep(keep_weights=True)``) and no other role awake: the engines
    wake their weights, take the actor's, the actor sleeps fully and the engines wake their KV cache."""
    armed = run.args.sync_mode == "armed"
    if run.args.colocate:
        with clock.phase("sleep_wake"):
            run.engines.call("guarded_wake", ["weights"], "sync", arm_sync=armed)
    elif armed:
        with clock.phase("sleep_wake"):
            run.engines.call("arm_weight_sync")
    with clock.phase("weight_sync"):
        stats, slept = sync_weights(run, armed=armed, sleep_after="sync")
    clock.move("weight_sync", "sleep_wake", slept)
    if run.args.colocate:
        with clock.phase("sleep_wake"):
            run.engines.call("guarded_wake", ["kv_cache"], "generate")
    return stats


def sync_weights(run: Run, armed: bool = False, sleep_after: str | None = None) -> tuple[dict, float]:
    """One weight sync: every engine starts receiving (unless armed already: then each settles the sync before its
    next operation), every actor rank streams (rank(s) with a sender send). ``sleep_after``: the actor then sleeps
    fully for that phase, sent with the sync (one round trip); returns the stats and that sleep's seconds."""
    import ray

    actor = run.workers["actor"]
    receiving = [] if armed else [handle.receive_weights.remote() for handle in run.engine_handles]
    try:
        sending = actor.submit("sync_weights")
        sleeping = actor.submit("sleep", sleep_after) if sleep_after else None
        sent = actor.gather(sending)
    except Exception:
        ready, _ = ray.wait(receiving, num_returns=len(receiving), timeout=5.0)
        for ref in ready:
            ray.get(ref)  # an engine's own error, if it has one, says more than the sender's timeout
        raise
    report = next(item for item in sent if item)
    if armed:  # the sender returned once every engine had loaded the weights, with the versions they hold
        versions = list(report["receiver_versions"])
    else:
        received = ray.get(receiving, timeout=run.args.sync_timeout)
        versions = [int(worker_report["version"]) for reports in received for worker_report in reports]
    slept = max(actor.gather(sleeping)) if sleeping is not None else 0.0
    return {"sync/version": report["version"], "sync/bytes": report["bytes"], "sync/sender_s": report["seconds"],
            "engine/weight_version": min(versions)}, slept


# ------------------------------------------------------------------------------------------------ timing and memory
def _load_nvml():
    for name in ("pynvml", "vllm.third_party.pynvml"):
        with contextlib.suppress(ImportError):
            return __import__(name, fromlist=["nvmlInit"])
    return None


def _visible_nvml_handles(nvml) -> list:
    """NVML handles of the GPUs this run may use: ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) when set, else all —
    so that a second job on another GPU of the machine does not show up in this run's peaks."""
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return handles
    uuids = []
    for handle in handles:
        uuid = nvml.nvmlDeviceGetUUID(handle)
        uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
    chosen = []
    for item in (part.strip() for part in visible.split(",") if part.strip()):
        if item.isdigit() and int(item) < count:
            chosen.append(handles[int(item)])
        else:
            chosen += [h for h, u in zip(handles, uuids, strict=True) if u.startswith(item) or item.startswith(u)]
    return chosen


class GpuMemorySampler:
    """Device-wide used memory of every GPU (NVML: all processes, vLLM's pool included), polled by a thread; the
    peak per named phase. Disabled (reports nothing) without NVML or GPUs."""

    def __init__(self, *, interval_s: float = 0.005, enabled: bool = True) -> None:
        self._nvml, self._handles = (_load_nvml() if enabled else None), []
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlInit()
                self._handles = _visible_nvml_handles(self._nvml)
        self._phase, self._peaks, self._lock = None, {}, threading.Lock()
        self._stop = threading.Event()
        if self._handles:
            threading.Thread(target=self._loop, args=(interval_s,), daemon=True, name="gpu-memory").start()

    def _sample(self) -> None:  # with the lock held
        if self._phase is None or not self._handles:
            return
        used = [self._nvml.nvmlDeviceGetMemoryInfo(handle).used for handle in self._handles]
        peak = self._peaks.setdefault(self._phase, used)
        self._peaks[self._phase] = [max(a, b) for a, b in zip(peak, used, strict=True)]

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with self._lock:
                self._sample()

    def set_phase(self, name: str | None) -> None:
        with self._lock:
            self._sample()
            self._phase = name
            self._sample()

    def take(self) -> dict[str, list[int]]:
        with self._lock:
            peaks, self._peaks = self._peaks, {}
        return peaks

    def close(self) -> None:
        self._stop.set()


class StepClock:
    """Wall time per phase of one step (a phase may repeat: times add up) and the peak device memory in each."""

    def __init__(self, sampler: GpuMemorySampler) -> None:
        self.sampler, self.times, self.extra = sampler, defaultdict(float), {}
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.sampler.set_phase(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] += time.perf_counter() - start
            self.sampler.set_phase(None)

    def move(self, source: str, target: str, seconds: float) -> None:
        """Count ``seconds`` of phase ``source`` as ``target`` (transitions measured by the workers inside a call
        that also did other work)."""
        seconds = min(seconds, self.times[source])
        self.times[source] -= seconds
        self.times[target] += seconds

    def metrics(self) -> dict[str, float]:
        step = time.perf_counter() - self.started
        out = {f"time/{name}_s": seconds for name, seconds in self.times.items()} | {"time/step_s": step}
        pick = lambda prefix: sum(s for n, s in self.times.items() if n.startswith(prefix))  # noqa: E731
        switch = self.times["sleep_wake"] + self.times["weight_sync"]
        out |= {"time/experience_forwards_s": pick("forward_"), "time/training_s": pick("train_"),
                "time/phase_switch_s": switch, "time/phase_switch_fraction": switch / step}
        for phase, per_gpu in self.sampler.take().items():
            out[f"mem/{phase}_peak_gib"] = max(per_gpu) / GIB
            if len(per_gpu) > 1:
                out |= {f"mem/gpu{i}/{phase}_peak_gib": used / GIB for i, used in enumerate(per_gpu)}
        return out | self.extra


# ------------------------------------------------------------------------------------------------ outputs
def mismatch_metrics(experience) -> dict[str, float]:
    """Engine vs trainer log-probs of the same tokens (mean and max |Δ| over response tokens)."""
    mask = experience.batch.loss_mask
    delta = (experience.engine_logprobs - experience.old_logprobs)[mask].abs()
    return {"engine_vs_trainer/mean_abs_logprob_diff": float(delta.mean()),
            "engine_vs_trainer/max_abs_logprob_diff": float(delta.max())}


def write_outputs(run: Run, history: list[dict]) -> dict:
    """phases.jsonl (every guarded transition of every actor, by time), summary.json and the curve."""
    args = run.args
    events = [e for group in run.workers.values() for rank in group.call("guard_events") for e in rank]
    events += [e for engine in run.engines.call("guard_events") for e in engine]
    with (args.out / "phases.jsonl").open("w") as handle:
        for event in sorted(events, key=lambda e: e["time"]):
            handle.write(json.dumps(event) + "\n")
    summary = summarize(history, run.startup)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not args.no_plot and history:
        plot(history, args.out / "curve.png")
    print(json.dumps(summary, indent=2), flush=True)
    return summary


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def summarize(history: list[dict], startup: dict) -> dict:
    rewards = [row["reward/mean"] for row in history]
    k = min(10, max(1, len(rewards) // 2))
    timed = history[1:] or history  # the first step pays one-off costs (CUDA graphs, allocator warm-up, JIT)
    summary = {"steps": len(history), "startup": startup,
               "first_mean_reward": sum(rewards[:k]) / k, "last_mean_reward": sum(rewards[-k:]) / k,
               "last_accuracy": sum(row["accuracy"] for row in history[-k:]) / k,
               "max_abs_kl": max(abs(row.get("kl/mean", 0.0)) for row in history),
               "max_mismatch": max(row["engine_vs_trainer/mean_abs_logprob_diff"] for row in history)}
    keys = sorted({key for row in timed for key in row if key.startswith(("time/", "tokens/"))})
    summary["median"] = {key: _median([row[key] for row in timed if key in row]) for key in keys}
    mem_keys = sorted({key for row in history for key in row if key.startswith(("mem/", "mem_process/"))})
    summary["peak_memory_gib"] = {key: max(row.get(key, 0.0) for row in history) for key in mem_keys}
    return summary


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    axes[0].plot(steps, [row["reward/mean"] for row in history], label="mean reward")
    axes[0].plot(steps, [row["accuracy"] for row in history], label="exact answers")
    axes[0].legend(), axes[0].set_title("reward")
    axes[1].plot(steps, [row.get("kl/mean", 0.0) for row in history], color="tab:red")
    axes[1].set_title("KL(policy || reference)")
    axes[2].plot(steps, [row["engine_vs_trainer/mean_abs_logprob_diff"] for row in history], color="tab:green")
    axes[2].set_title("engine vs trainer mean |Δ log-prob|")
    for axis in axes:
        axis.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
