"""The Ray actors of the hybrid-engine examples (see ``_hybrid_common.py`` for the driver side): one DeepSpeed model
per role and rank (:class:`ModelWorker`), and rollout engines (:class:`HFEngineActor`, :func:`vllm_engine_class`),
every sleep/wake of each through the phase guard. Ray ships this module to its workers by value (``examples/`` is not
installed), so it imports nothing heavy at module level.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from rlhfkit.experience import iterate_minibatches, select_experience
from rlhfkit.packing import global_counts, partition_by_token_budget
from rlhfkit.phase import PhaseGuard
from rlhfkit.workers import Worker

GIB = 1024**3


def gpu_key(node: int, gpu: int) -> str:
    """The phase guard's name of a plan GPU (the plan, not CUDA, knows which roles share it)."""
    return f"node{node}/gpu{gpu}"


# ------------------------------------------------------------------------------------------------ trainer models
@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """How a worker trains on its shard of one step's experience (see ModelWorker.train)."""

    epochs: int = 1
    minibatches: int = 2
    grad_accum: int = 1
    temperature: float = 1.0
    clip: float = 0.2
    kl_coef: float = 0.0
    aggregation: str = "token_mean"
    mismatch: str = "none"
    value_clip: float | None = 0.2
    seed: int = 0
    measure_mismatch: bool = False  # |Δ| engine vs trainer log-probs in the first minibatch (before any update)
    profile_step: int = -1  # this step's training runs under torch.profiler (see ModelWorker.train)
    profile_dir: str | None = None  # where each rank writes its table of the ops that took the most device time


class ResidentModel:
    """The sleep of a model that stays on its GPU: the guard still orders the phases; sleeping only returns the
    cached activation memory to the device (``torch.cuda.empty_cache``) so the next role can allocate it — unless
    ``empty_cache=False`` (every role stays resident: the blocks are reused at the next phase, not allocated anew)."""

    def __init__(self, empty_cache: bool = True) -> None:
        self.empty_cache = empty_cache

    def sleep(self, **kwargs) -> None:
        if self.empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake_up(self, **kwargs) -> None:
        pass


class ModelWorker(Worker):
    """One DeepSpeed model (ZeRO-1/2/3) of one role on one GPU, a rank of that role's WorkerGroup.

    Every sleep/wake goes through a :class:`~rlhfkit.phase.PhaseGuard` whose store is shared by every actor of the
    run, keyed by the plan's GPU: waking a model while another role is awake on that GPU raises, naming both.
    """

    def __init__(self, guard_store, device_kind: str, model_path: str) -> None:
        # Nothing touches the GPU here (vLLM may be profiling its memory right now); only imports, which are slow
        # and run in parallel across roles this way instead of one after another in load().
        if device_kind == "cpu":
            # skip a ≈ 50 s JIT build of a CPU op (import_module: a plain `deepspeed.ops` would make Ray's pickler
            # ship `torch.ops` along with this class)
            importlib.import_module("deepspeed.ops").__compatible_ops__["deepspeed_shm_comm"] = False
        import torch._dynamo  # noqa: F401 — DeepSpeed imports it lazily while checking the optimizer
        import transformers

        import rlhfkit.deepspeed_engine  # noqa: F401

        transformers.AutoConfig.from_pretrained(model_path)  # imports the model's configuration module
        self.device_kind = device_kind
        bundle = int(os.environ["RLHFKIT_BUNDLE_INDICES"].split(",")[0])
        self.gpu = gpu_key(int(os.environ["RLHFKIT_PLAN_NODE"]), bundle)
        self.guard = PhaseGuard(guard_store, gpu=self.gpu)
        self.events: list[dict] = []
        self.model = self.sender = None
        self.offload = True  # load(offload=False): the model stays on its GPU and its sleep only empties the cache
        self.tf32 = "off"
        self.resident = ResidentModel()

    def load(self, path: str, config, seed: int, offload: bool = True, empty_cache: bool = True,
             tf32: str = "off") -> dict:
        """Build the model while holding the GPU's claim, then put it to sleep. ``offload=False``: its sleep keeps
        every state on the GPU and only empties the CUDA cache (for models small enough to stay resident), or not
        even that with ``empty_cache=False``. ``tf32``: where this process's float32 matmuls use TF32 tensor cores
        ("off", "backward": only inside ``train``'s backward passes, "all")."""
        from rlhfkit.deepspeed_engine import DeepSpeedEngine

        self.tf32 = tf32
        torch.set_float32_matmul_precision("high" if tf32 == "all" else "highest")  # "high": TF32 tensor cores
        self.offload = offload
        self.resident = ResidentModel(empty_cache)
        self._transition("wake", "load")  # claim only: the model does not exist yet
        if self.device_kind == "cuda":
            device = self.device()
            # WorkerGroup already made LOCAL_RANK this device's index (DeepSpeed reads it)
            torch.cuda.set_device(device)
        torch.manual_seed(seed)
        self.model = DeepSpeedEngine.from_pretrained(path, role=self.role, config=config)
        gc.collect()
        gc.freeze()  # DeepSpeed's offload_states calls gc.collect(); frozen long-lived objects make that cheap
        self._transition("sleep", "load")
        return {"parameters": sum(getattr(p, "ds_numel", p.numel()) for p in self.model.module.parameters())}

    def _transition(self, action: str, phase: str, **kwargs) -> float:
        guard_call = self.guard.wake if action == "wake" else self.guard.sleep
        model = self.model if self.offload or self.model is None else self.resident
        transition = guard_call(self.role, model, phase=phase, **kwargs)
        self.events.append(event_record(transition, rank=self.rank))
        return transition.seconds

    def wake(self, phase: str) -> float:
        return self._transition("wake", phase)

    def sleep(self, phase: str, keep_weights: bool = False) -> float:
        return self._transition("sleep", phase, keep_weights=keep_weights)

    def guard_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    def forward(self, batches: list, *, kind: str, temperature: float = 1.0) -> dict:
        """No-grad forwards over this rank's micro-batches: ``[T]`` log-probs or values, or ``[N]`` rewards each."""
        _reset_peak()
        # log-probs of the response tokens only (all the losses read): the LM head runs on those rows alone
        run = {"logprobs": lambda b: self.model.forward_logprobs(b, temperature=temperature,
                                                                 loss_tokens_only=True),
               "values": self.model.forward_values, "rewards": self.model.forward_rewards}[kind]
        with torch.no_grad():
            outputs = [run(batch).float().cpu() for batch in batches]
        return {"outputs": outputs, "peak_gib": _peak_gib()}

    def train(self, shard, *, settings: TrainSettings, step: int) -> dict:
        """Epochs × minibatches optimizer steps over this rank's shard, each of ``grad_accum`` micro-batches.

        Losses are normalised by the minibatch's token/sequence counts summed over all ranks, so the gradients the
        ranks sum are exactly the whole minibatch's (``loss_normalization="global"``). Every rank makes the same
        number of forward/backward/step calls, as ZeRO's collectives require.
        """
        if step == settings.profile_step:
            return self._profiled(lambda: self._train(shard, settings, step), settings, step)
        return self._train(shard, settings, step)

    def _train(self, shard, settings: TrainSettings, step: int) -> dict:
        _reset_peak()
        device = self.model.device
        group = torch.distributed.group.WORLD if self.world_size > 1 else None
        sums, counts, losses = defaultdict(float), defaultdict(int), []
        mismatch: list = []  # per micro-batch of the first minibatch: [sum |Δ|, tokens, max |Δ|] on the GPU
        for epoch in range(settings.epochs):
            seed = settings.seed * 100_003 + step * 101 + epoch
            minibatches = iterate_minibatches(shard, num_minibatches=settings.minibatches, seed=seed)
            for index, minibatch in enumerate(minibatches):
                num_tokens, num_seqs = global_counts(minibatch.batch.to(device), group=group)
                if minibatch.num_seqs < settings.grad_accum:  # DeepSpeed counts backward calls per optimizer step
                    raise ValueError(f"rank {self.rank}: a minibatch of {minibatch.num_seqs} sequences cannot make "
                                     f"grad_accum={settings.grad_accum} micro-batches; lower --grad-accum or "
                                     "--minibatches, or raise --rollout-batch")
                parts = partition_by_token_budget(minibatch.batch.seq_lens.tolist(),
                                                  num_micro_batches=settings.grad_accum)
                minibatch_loss = 0.0
                for part in parts:
                    micro = select_experience(minibatch, part).to(device)
                    measure = settings.measure_mismatch and epoch == 0 and index == 0
                    loss, stats = self._loss(micro, settings, num_tokens, num_seqs, mismatch if measure else None)
                    with tf32_matmuls(self.tf32 == "backward"):
                        self.model.backward(loss)
                    minibatch_loss += float(loss.detach())
                    stats |= {k: v for k, v in self.model.step().items() if k in ("grad_norm", "lr")}
                    for key, value in stats.items():
                        sums[key] += float(value)
                        counts[key] += 1
                losses.append(minibatch_loss)
        result = {f"{self.role}/{key}": sums[key] / counts[key] for key in sums if key != "loss"}
        if mismatch:  # one transfer at the end: a sync between a forward and its backward would stall the launches
            total, tokens, largest = torch.stack([torch.stack(m) for m in mismatch]).cpu().unbind(1)
            if tokens.sum() > 0:
                result |= {"engine_vs_trainer/mean_abs_logprob_diff": float(total.sum() / tokens.sum()),
                           "engine_vs_trainer/max_abs_logprob_diff": float(largest.max())}
        return result | {f"{self.role}/loss": sum(losses) / len(losses), "peak_gib": _peak_gib()}

    def _profiled(self, run, settings: TrainSettings, step: int) -> dict:
        """``run()`` under torch.profiler: adds its wall time, the device time of its kernels and copies (summed: one
        stream rarely overlaps them), and how many there were; writes the top ops to ``profile_dir``."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            result = run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - started
        device_events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.device_time_total for e in device_events) / 1e6
        if settings.profile_dir:
            table = prof.key_averages().table(sort_by="device_time_total" if device_events else "cpu_time_total",
                                              row_limit=25, max_name_column_width=70)
            path = os.path.join(settings.profile_dir, f"profile_{self.role}_step{step}_rank{self.rank}.txt")
            with open(path, "w") as file:
                file.write(f"wall {wall:.4f} s, device busy {busy:.4f} s, {len(device_events)} device ops\n{table}")
        return result | {f"{self.role}/profile_wall_s": wall, f"{self.role}/profile_device_busy_s": busy,
                         f"{self.role}/profile_device_ops": float(len(device_events))}

    def _loss(self, micro, s: TrainSettings, num_tokens: float, num_seqs: float, mismatch: list | None = None):
        from rlhfkit.losses import kl_loss, policy_loss, value_loss

        batch = micro.batch
        mask, cu = batch.loss_mask, batch.cu_seqlens
        counts = {"aggregation": s.aggregation, "num_tokens": num_tokens, "num_seqs": num_seqs}
        if self.role == "critic":
            values = self.model.forward_values(batch)
            return value_loss(values, micro.values, micro.returns, mask, cu, clip=s.value_clip, **counts)
        logprobs = self.model.forward_logprobs(batch, temperature=s.temperature, loss_tokens_only=True)
        if mismatch is not None and micro.engine_logprobs is not None:  # the weights the engine generated with
            delta = torch.where(mask, (logprobs.detach().float() - micro.engine_logprobs.float()).abs(), 0.0)
            mismatch.append([delta.sum(), mask.sum().to(delta.dtype), delta.max()])
        loss, stats = policy_loss(logprobs, micro.old_logprobs, micro.advantages, mask, cu, clip_low=s.clip,
                                  clip_high=s.clip, engine_logprobs=micro.engine_logprobs, mismatch=s.mismatch,
                                  **counts)
        if s.kl_coef > 0 and micro.ref_logprobs is not None:
            kl, kl_stats = kl_loss(logprobs, micro.ref_logprobs, mask, cu, estimator="k3", **counts)
            loss = loss + s.kl_coef * kl
            stats["kl_loss"] = kl_stats["kl_mean"]
        return loss, stats

    def open_weight_sync(self, sender: bool, *, backend: str, world_size: int, group_name: str, bucket_bytes: int,
                         dtype: str | None, sync_timeout_s: float, zero_copy: bool = False,
                         keep_mapped: bool = False):
        """Bind this rank's WeightSender (if it is one) and return its endpoint for the engines; None otherwise.
        Every rank streams its parameters at each sync: under ZeRO-3 the gathers are collective."""
        import ray

        from rlhfkit.weight_sync import SyncEndpoint, WeightSender, WeightSyncConfig

        self.sync_dtype = getattr(torch, dtype) if dtype else None
        self.sync_bucket_bytes = bucket_bytes
        if not sender:
            return None
        config = WeightSyncConfig(backend=backend, bucket_bytes=bucket_bytes, dtype=self.sync_dtype,
                                  timeout_s=sync_timeout_s, ipc_zero_copy=zero_copy, ipc_keep_mapped=keep_mapped)
        endpoint = SyncEndpoint(host=ray.util.get_node_ip_address(), world_size=world_size, group_name=group_name,
                                label=f"actor-{self.rank}")
        device = self.model.device if backend in ("nccl", "cuda_ipc") else None
        self.sender = WeightSender(config, endpoint, device=device)
        # described from the (partitioned) parameters, so the lazy ZeRO-3 stream below is walked once
        self.description = self.model.describe_parameters_for_sync(dtype=self.sync_dtype)
        return self.sender.endpoint

    def sync_weights(self) -> dict:
        stream = self.model.named_parameters_for_sync(bucket_bytes=self.sync_bucket_bytes, dtype=self.sync_dtype)
        if self.sender is None:
            for _ in stream:  # take part in the ZeRO-3 gathers; rank 0 sends
                pass
            return {}
        report = self.sender.send(stream, description=self.description)
        return {"version": report.version, "bytes": report.num_bytes, "seconds": report.seconds,
                "receiver_versions": list(report.receiver_versions)}


@contextlib.contextmanager
def tf32_matmuls(enabled: bool):
    """float32 matmuls on TF32 tensor cores inside the block (a process-wide setting: autograd's threads see it)."""
    if not enabled:
        yield
        return
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision("highest")


def event_record(transition, **extra) -> dict:
    """A guarded transition as a plain dict with a wall-clock time (for phases.jsonl and the order checks)."""
    record = {"time": time.time(), "action": transition.action, "role": transition.role, "gpu": transition.gpu,
              "phase": transition.phase, "seconds": transition.seconds}
    for name in ("allocated", "reserved", "free"):
        value = getattr(transition, name)
        record[f"{name}_gib"] = None if value is None else value / GIB
    return record | extra


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0


# ------------------------------------------------------------------------------------------------ rollout engines
class GuardedEngine:
    """Mixin for engine actors: ``guarded_sleep``/``guarded_wake`` claim and release the engine's GPUs."""

    role = "rollout"

    def _guard_setup(self, store, gpus) -> None:
        self._guard, self._gpus, self._events = PhaseGuard(store), tuple(gpus), []
        self._resident = False  # set by a level-0 sleep: the engine kept everything, so the wake has nothing to do

    def guarded_sleep(self, level: int, phase: str) -> None:
        """``level`` 0: the engine stays resident (weights and KV cache kept); only the guard's claim is released."""
        self._resident = level == 0
        for index, gpu in enumerate(self._gpus):
            model, kwargs = (self, {"level": level}) if index == 0 and level else (None, {})
            self._events.append(event_record(self._guard.sleep(self.role, model, gpu=gpu, phase=phase, **kwargs),
                                             rank=self.engine_index))

    def guarded_wake(self, tags, phase: str, arm_sync: bool = False) -> None:
        """``arm_sync``: then arm the weight sync (``arm_weight_sync``) in the same call, so the sync that follows is
        the actor's send alone."""
        resident = self._resident
        for index, gpu in reversed(list(enumerate(self._gpus))):  # claim every GPU before waking the model
            model, kwargs = (self, {"tags": tags}) if index == 0 and not resident else (None, {})
            self._events.append(event_record(self._guard.wake(self.role, model, gpu=gpu, phase=phase, **kwargs),
                                             rank=self.engine_index))
        if arm_sync:
            self.arm_weight_sync()

    def guard_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events


class HFEngineActor(GuardedEngine):
    """:class:`rlhfkit.engines.hf.HFEngine` as a Ray actor with the surface of the vLLM engine actor: generate,
    sleep/wake, ``init_weight_sync``/``receive_weights`` through :mod:`rlhfkit.weight_sync`, versions."""

    def __init__(self, model_path: str, *, engine_index: int, seed: int, device: str, guard_store, gpus,
                 dtype: str = "float32") -> None:
        from rlhfkit.engines.hf import HFEngine, HFEngineConfig

        self.engine_index = engine_index
        self.engine = HFEngine(HFEngineConfig(model=model_path, device=device, dtype=dtype, seed=seed + engine_index))
        self.receiver = None
        self.armed = None  # an ArmedReceive between arm_weight_sync and the next operation
        self._guard_setup(guard_store, gpus)

    def ready(self) -> dict:
        return {"engine_index": self.engine_index, "pid": os.getpid()}

    def generate(self, prompts, sampling, prompt_indices=None):
        self.settle_weight_sync()
        return self.engine.generate(prompts, sampling)  # the EngineGroup maps prompt indices back

    def sleep(self, level: int = 1) -> None:
        self.settle_weight_sync()
        self.engine.sleep(level)

    def wake_up(self, tags=None) -> None:
        self.settle_weight_sync()
        self.engine.wake_up(tags)

    def get_weight_version(self) -> int:
        return self.engine.weight_version

    def init_weight_sync(self, sync_config, endpoint, *, first_rank: int, expected=None) -> list[dict]:
        from rlhfkit.weight_sync import WeightReceiver, describe_parameters

        expected = expected or describe_parameters(self.engine.model.named_parameters(), dtype=sync_config.dtype)
        device = self.engine.device if sync_config.backend == "nccl" else None
        self.receiver = WeightReceiver(sync_config, endpoint.for_rank(first_rank, f"engine-{self.engine_index}"),
                                       expected=expected, device=device)
        return [{"rank": first_rank}]

    def receive_weights(self, *, version=None) -> list[dict]:
        self.settle_weight_sync()
        report = self.receiver.receive(self.engine.load_weights)
        return [{"version": report.version, "seconds": report.seconds, "bytes": report.num_bytes}]

    def arm_weight_sync(self, *, version=None) -> list[dict]:
        """Wait for the next sync in a thread (rlhfkit.weight_sync.ArmedReceive); settled by the next operation."""
        from rlhfkit.weight_sync import ArmedReceive

        self.settle_weight_sync()
        self.armed = ArmedReceive(self.receiver, lambda: self.receiver.receive(self.engine.load_weights))
        return [{"armed": True}]

    def settle_weight_sync(self) -> list[dict] | None:
        armed, self.armed = self.armed, None
        report = armed.settle() if armed is not None else None
        return None if report is None else [{"version": report.version, "seconds": report.seconds,
                                             "bytes": report.num_bytes}]


def vllm_engine_class(guard_store, gpus_by_engine):
    """rlhfkit's vLLM engine actor with guarded sleep/wake; ``create_engines`` builds it as ``cls(config, ...)``."""
    from rlhfkit.engines.vllm import VLLMEngineActor

    class GuardedVLLMEngine(GuardedEngine, VLLMEngineActor):
        def __init__(self, config, *, engine_index: int = 0, distributed_executor_backend=None) -> None:
            super().__init__(config, engine_index=engine_index,
                             distributed_executor_backend=distributed_executor_backend)
            self._guard_setup(guard_store, gpus_by_engine[engine_index])

    return GuardedVLLMEngine
