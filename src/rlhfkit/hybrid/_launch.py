"""Starting and stopping a hybrid run: :class:`HybridConfig` and :class:`Hybrid`.

:meth:`Hybrid.start` starts (or joins) Ray, plans the GPUs (every role and the engines on the same GPUs when
``colocate``), starts the engines and the trainer processes in parallel, reads every trainer's model into host memory
(at once where the host holds the copies) and places them on the GPU one role at a time (each holding the GPU's claim
while it loads), and wires the weight sync (CUDA IPC between the processes sharing a GPU, NCCL to engines on GPUs of
their own, gloo on CPU). :meth:`Hybrid.push_weights` moves the actor's weights into the
engines with every wake and sleep it needs; :meth:`Hybrid.close` stops everything it started.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhfkit.hybrid._engines import (
    HFEngineActor,
    RolloutEngines,
    guarded_sglang_engine_class,
    guarded_vllm_engine_class,
)
from rlhfkit.hybrid._models import resolve_run_models
from rlhfkit.hybrid._timer import GpuMemorySampler, PhaseTimer, process_age_s, visible_gpu_memory_used_gib
from rlhfkit.hybrid._trainer import TrainerConfig, TrainerGroup
from rlhfkit.hybrid._trainer_worker import TrainerWorker, plan_gpu_key

__all__ = ["Hybrid", "HybridConfig"]

logger = logging.getLogger(__name__)

_FORWARD_ENV = ("PYTHONPATH", "LD_LIBRARY_PATH", "PATH", "CUDA_HOME", "HF_HOME", "TORCH_EXTENSIONS_DIR")
_DTYPES = ("float32", "bfloat16")
ENGINE_BATCHED_TOKENS = 4096  # HybridConfig.max_num_batched_tokens's default (TRL's colocated vLLM uses the same)


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """Where and how the engines and trainers of one run live.

    Attributes:
        model: folder or hub id of the policy (engines and, by default, every trainer role): :meth:`Hybrid.start`
            resolves a hub id once on each node (:func:`rlhfkit.models.resolve_model`); the workers load the folder.
        device: ``"cuda"``, or ``"cpu"`` (DeepSpeed on CPU, logical GPUs, gloo sync; needs ``engine="hf"``).
        engine: ``"vllm"``, ``"sglang"`` (an SGLang server per engine, driven by its engine actor; see
            docs/engines-sglang.md) or ``"hf"`` (rlhfkit's transformers engine, for CPU runs and tests).
        sglang_python, sglang_site: the interpreter that runs SGLang's server, and a site directory put on its
            ``PYTHONPATH`` (e.g. ``/tmp/site/sglang`` from ``bench/peers/install-sglang.sh``); ``engine="sglang"`` only.
        num_gpus, num_nodes: GPUs per node the plan uses, and nodes.
        colocate: engines share the trainers' GPUs (the hybrid engine) or get ``engine_gpus`` GPUs of their own.
        engine_gpus, tensor_parallel_size: engine GPUs when not colocated; GPUs per vLLM engine.
        engine_memory: vLLM's share of GPU memory (default 0.15 colocated, 0.85 on its own GPUs): weights + KV cache,
            woken at every step, so an oversized share costs wake time and peak memory.
        engine_sleep_level: 2 (default) drops the engine's weights while asleep, as the push rewrites them; 1 keeps
            them in host memory; 0 keeps the engine resident (the guard still orders the phases). With
            ``TrainerConfig.lora`` only 1 or 0: a push carries the adapters alone and never rewrites the base weights.
        max_model_len, enforce_eager: vLLM settings.
        max_num_seqs: sequences a vLLM engine runs at once; give the rollout batch of one engine (prompts x samples
            / engines): vLLM captures CUDA graphs for batch sizes up to it (at most 512), and its default (1024 on
            large GPUs) captures 51 sizes of each graph kind at start-up, twice that with LoRA (41 s at 7B on an
            H100). None: vLLM's default.
        max_num_batched_tokens: vLLM only: tokens one engine step may process (prompts prefill in chunks of it).
            vLLM sets this much activation memory aside in the engine's share; vLLM's own default on a GPU of 70 GiB
            or more is 16,384 tokens, ≈ 1.7 GiB of a 7B engine's share that stays reserved, unused, while it
            sleeps. Rollout steps are decodes of at most ``max_num_seqs`` tokens. None (default): 4,096 (what TRL's
            colocated vLLM uses), or ``max_num_seqs`` when that is larger (:attr:`engine_batched_tokens`). The
            plan's memory estimate counts the same number.
        kv_cache_tokens: vLLM only: the tokens each engine's KV cache holds. The cache is then sized to them
            (``kv_cache_memory_bytes``: every layer's keys and values in ``dtype``, from the model's config) instead
            of filling what ``engine_memory`` leaves after the weights, and vLLM skips its memory profile. A cache
            sized to the rollout batch is mapped and unmapped at every wake and sleep in less time, and the
            generating phase's peak shrinks with it (the fit check counts weights + cache + vLLM's working memory).
            At least ``max_model_len``; ``engine_memory`` then only has to be free when the engine starts (vLLM
            checks it). Colocated engines then build their models while the trainers load, when every role's largest
            footprint fits the GPU at once (:func:`rlhfkit.hybrid._fit.engines_may_build_during_loads`). None: the
            size comes from ``kv_tokens_per_seq`` (:attr:`engine_kv_tokens`).
        kv_tokens_per_seq: vLLM only, when ``kv_cache_tokens`` is None and ``max_num_seqs`` is set: the cache holds
            ``max_num_seqs * kv_tokens_per_seq`` tokens (at least ``max_model_len``). The default 256 covers a
            prompt and its response on average (vLLM allocates 16-token blocks as sequences grow, and preempts
            rather than fails when they run out). None, or ``max_num_seqs`` None: the cache fills ``engine_memory``
            (the behaviour before 0.x; slower switches, higher peak: docs/benchmarks.md).
        dtype: engine and weight-sync dtype (float32 keeps engine and trainer log-probs within ~1e-3 on small models).
        sync_bucket_mb: weight-sync bucket size.
        weight_loading: vLLM only: how the engines apply pushed weights (``VLLMEngineConfig.weight_loading``).
            ``"planned"`` (default): the first push runs vLLM's own ``load_weights`` and records where each tensor's
            copies land; later pushes replay them with one batched copy per bucket instead of a Python loader call
            per tensor (a parameter that moved makes it record again; tensors whose loader does more than copy stay
            on ``load_weights``). Into a 1.54B bf16 model on an H200, syncs took 11.8-13.2 ms planned and 23-28 ms
            through the loaders (bench/results/HISTORY.md, rounds 5-6); in the hybrid loop not yet measured.
            ``"auto"``: the loaders every time.
        overlap: the engines stay resident beside the awake trainers, outside the phase guard, so that a
            :class:`~rlhfkit.rollouts.RolloutProducer` can generate while the actor trains (asynchronous RL; on one
            GPU the engines keep their ``engine_memory`` share the whole run). :meth:`Hybrid.push_weights` then
            updates weights in flight: HF engines pause their running requests, take the weights and resubmit the
            unfinished part under them; single-GPU vLLM engines (``VLLMEngineConfig.pausable``) stop stepping
            between two decode steps, take the weights and go on with the same requests and their KV cache (tokens
            stamped per version either way); other engines (SGLang, tensor-parallel vLLM) finish the requests in
            flight first (new ones wait for the push). Needs ``engine_sleep_level=0`` when colocated and
            ``max_weight_lag >= 1`` (the actor steps while the engines generate).
        max_weight_lag: how many weight versions rollouts may lag the actor (0: on-policy). The actor is one version
            ahead of the engines from its first ``optim_step`` after a push until the next push; generating past the
            bound raises :class:`~rlhfkit.engines.protocol.WeightLagError` (a forgotten ``push_weights``).
        seed: engine sampling seed (engine ``i`` uses ``seed + i``).
        ray_address: join a running cluster (default ``$RAY_ADDRESS``, else start a local one).
        start_timeout_s, call_timeout_s, sync_timeout_s: bounds of start-up, of each call, of each sync wait.
        gpu_memory_gib: memory of one GPU for the fit check that :meth:`Hybrid.start` runs before anything starts
            (:class:`~rlhfkit.placement.MemoryFitError` naming the phase, the shortfall and a layout that fits;
            the estimate is an upper bound with a margin, :mod:`rlhfkit.hybrid._fit`). None: the driver's
            first CUDA device when ``device="cuda"`` and it sees one, else no check.
        host_memory_gib: host memory of one node for the same check (the host phases: DeepSpeed's optimizer
            offload, trainers asleep in host memory, the engine's level-1 backup, process footprints, each model's
            host copy while it loads). None: this machine's physical memory times Ray's memory-kill threshold
            (``RAY_memory_usage_threshold``, 0.95: Ray kills workers past it) when ``device="cuda"``, else no check.
        pause_engines: overlap mode, single-GPU vLLM engines: a push parks the generate calls in flight between two
            decode steps and they go on under the new weights (``VLLMEngineConfig.pausable``: the engine is stepped
            one decode step at a time, a per-step output that cost +20% of the generate time on the CPU backend;
            not yet measured on a GPU). False: a push waits for the calls in flight to finish (the HF engine always
            pauses; SGLang and tensor-parallel vLLM engines always wait).
        driver_threads: torch's intra-op threads in this process (the driver) while the run is open: set by
            :meth:`Hybrid.start`, restored by :meth:`Hybrid.close`. The driver only keeps books on small CPU tensors
            (packing, selecting micro-batches, advantages); under torch's default of one thread per core, many of
            those small ops (``repeat_interleave``, indexing, ``expm1``) start an OpenMP team whose threads wait on
            cores the engines and trainers keep busy, and the asynchronous loop's driver work took 3.4x longer
            while an engine generated (docs/benchmarks.md). 1 (default) runs them on the calling thread; None
            leaves torch's setting alone (a script that does heavy CPU work of its own in this process).
        overlap_switches: a trainer role's sleep runs in the background, behind the next role's wake (the phase
            guard lets that wake take the GPU from a role marked as going to sleep): the reference's sleep behind
            the actor's wake, the actor's sleeps behind the engines' wakes. Both models are on the GPU for a moment,
            so it needs room for every role resident at once in the plan's memory estimate. None (default): on
            for a GPU run where that estimate (an upper bound) fits with 3% to spare (``OVERLAP_HEADROOM``;
            :meth:`Hybrid.start` decides and ``hybrid.config`` then holds the choice) and no other process holds
            memory on the GPUs (``Hybrid.gpu_held_gib``), off otherwise; True:
            on, and :meth:`Hybrid.start` refuses a run that does not fit; False: off. The background sleeps'
            seconds are ``time/overlapped_sleep_s``, outside the step's switch time. A push right after
            ``optim_step(sleep_after="keep_weights")`` streams the weights beside the sleep that moves the
            optimizer's states (ZeRO-0/1/2), and the weights' own sleep is queued behind it.
        optimizer_threads: CPU threads (``OMP_NUM_THREADS``) of each rank of a trainer role whose optimizer steps in
            host memory (``DeepSpeedEngineConfig.offload_optimizer``: DeepSpeed's CPU Adam, an OpenMP loop, and
            ZeRO's gradient norm and clipping in torch on the host). Ray gives an actor that reserves no CPU, as the
            trainer ranks are, one thread. None (default): on CUDA, this machine's cores divided among the role's
            ranks on a node; other roles keep Ray's one thread. An int: that many, on any device.
    """

    model: str
    device: str = "cuda"
    engine: str = "vllm"
    sglang_python: str = "python3"
    sglang_site: str | None = None
    num_gpus: int = 1
    num_nodes: int = 1
    colocate: bool = True
    engine_gpus: int = 1
    tensor_parallel_size: int = 1
    engine_memory: float | None = None
    engine_sleep_level: int = 2
    max_model_len: int = 1024
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_tokens: int | None = None
    kv_tokens_per_seq: int | None = 256
    enforce_eager: bool = False
    dtype: str = "float32"
    sync_bucket_mb: int = 128
    weight_loading: str = "planned"
    overlap: bool = False
    max_weight_lag: int = 0
    seed: int = 0
    ray_address: str | None = None
    start_timeout_s: float = 900.0
    call_timeout_s: float = 900.0
    sync_timeout_s: float = 300.0
    gpu_memory_gib: float | None = None
    host_memory_gib: float | None = None
    pause_engines: bool = True
    driver_threads: int | None = 1
    overlap_switches: bool | None = None
    optimizer_threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"HybridConfig.model={self.model!r}; give an HF model folder")
        for name, choices in (("device", ("cuda", "cpu")), ("engine", ("vllm", "sglang", "hf")), ("dtype", _DTYPES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"HybridConfig.{name}={getattr(self, name)!r}; expected one of {choices}")
        for name in ("num_gpus", "num_nodes", "engine_gpus", "tensor_parallel_size", "sync_bucket_mb", "seed",
                     "max_model_len", "max_weight_lag"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name in ("seed",
                                                                                            "max_weight_lag") else 1):
                raise ValueError(f"HybridConfig.{name}={value!r}; must be a positive int")
        if self.max_num_seqs is not None and (isinstance(self.max_num_seqs, bool)
                                              or not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1):
            raise ValueError(f"HybridConfig.max_num_seqs={self.max_num_seqs!r}; must be None or a positive int")
        if self.max_num_batched_tokens is not None:
            if (isinstance(self.max_num_batched_tokens, bool) or not isinstance(self.max_num_batched_tokens, int)
                    or self.max_num_batched_tokens < 1):
                raise ValueError(f"HybridConfig.max_num_batched_tokens={self.max_num_batched_tokens!r}; must be "
                                 "None or a positive int")
            if self.max_num_seqs is not None and self.max_num_batched_tokens < self.max_num_seqs:
                raise ValueError(f"HybridConfig.max_num_batched_tokens={self.max_num_batched_tokens} is below "
                                 f"max_num_seqs={self.max_num_seqs}: a decode step gives every running sequence a "
                                 "token; raise it or lower max_num_seqs")
        if self.kv_cache_tokens is not None:
            if isinstance(self.kv_cache_tokens, bool) or not isinstance(self.kv_cache_tokens, int):
                raise ValueError(f"HybridConfig.kv_cache_tokens={self.kv_cache_tokens!r}; must be None or an int")
            if self.engine != "vllm":
                raise ValueError(f"HybridConfig.kv_cache_tokens={self.kv_cache_tokens} sizes vLLM's KV cache; "
                                 f"engine={self.engine!r} has no such setting (leave kv_cache_tokens None)")
            if self.kv_cache_tokens < self.max_model_len:
                raise ValueError(f"HybridConfig.kv_cache_tokens={self.kv_cache_tokens} is below max_model_len="
                                 f"{self.max_model_len}: vLLM needs room for one whole sequence; raise it or lower "
                                 "max_model_len")
        if self.kv_tokens_per_seq is not None and (isinstance(self.kv_tokens_per_seq, bool)
                                                   or not isinstance(self.kv_tokens_per_seq, int)
                                                   or self.kv_tokens_per_seq < 1):
            raise ValueError(f"HybridConfig.kv_tokens_per_seq={self.kv_tokens_per_seq!r}; must be None or a "
                             "positive int")
        if self.engine_sleep_level not in (0, 1, 2):
            raise ValueError(f"HybridConfig.engine_sleep_level={self.engine_sleep_level!r}; expected 0, 1 or 2")
        if self.engine_memory is not None and not 0 < self.engine_memory < 1:
            raise ValueError(f"HybridConfig.engine_memory={self.engine_memory!r}; must be in (0, 1) or None")
        for name in ("start_timeout_s", "call_timeout_s", "sync_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HybridConfig.{name}={getattr(self, name)!r}; must be > 0 seconds")
        for name, what in (("gpu_memory_gib", "one GPU"), ("host_memory_gib", "one node's host memory")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0):
                raise ValueError(f"HybridConfig.{name}={value!r}; GiB of {what} (> 0) or None")
        if not isinstance(self.pause_engines, bool):
            raise TypeError(f"HybridConfig.pause_engines={self.pause_engines!r}; must be True or False")
        if self.overlap_switches is not None and not isinstance(self.overlap_switches, bool):
            raise TypeError(f"HybridConfig.overlap_switches={self.overlap_switches!r}; must be None (on where the "
                            "memory estimate fits every role resident), True or False")
        for name in ("driver_threads", "optimizer_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"HybridConfig.{name}={value!r}; must be None or a positive int")
        from rlhfkit.engines.vllm import WEIGHT_LOADINGS

        if self.weight_loading not in WEIGHT_LOADINGS:
            raise ValueError(f"HybridConfig.weight_loading={self.weight_loading!r}; expected one of {WEIGHT_LOADINGS}")
        if self.device == "cpu" and self.engine in ("vllm", "sglang"):
            raise ValueError(f"HybridConfig(device='cpu') needs engine='hf' (engine={self.engine!r} is CUDA-only)")
        total, tp = self.num_gpus * self.num_nodes, self.tensor_parallel_size
        if self.colocate and tp != 1 and total % tp:
            raise ValueError(f"HybridConfig.tensor_parallel_size={tp} must divide the {total} GPU(s) of a colocated "
                             "run (each engine takes tensor_parallel_size of the actor's GPUs)")
        if self.engine == "sglang" and tp != 1:
            raise ValueError(f"HybridConfig(engine='sglang', tensor_parallel_size={tp}): the hybrid run places one GPU "
                             "per SGLang engine actor; use tensor_parallel_size=1 (SGLangEngine itself takes "
                             "tensor_parallel_size > 1 when its process sees that many GPUs)")
        if self.engine == "hf" and tp != 1:
            raise ValueError("HybridConfig(engine='hf') has no tensor parallelism; use tensor_parallel_size=1")
        if not self.colocate and not (0 < self.engine_gpus < total and self.engine_gpus % tp == 0):
            raise ValueError(f"HybridConfig(colocate=False) needs 0 < engine_gpus < {total} GPUs and a multiple of "
                             f"tensor_parallel_size={tp}; got engine_gpus={self.engine_gpus}")

        if not isinstance(self.overlap, bool):
            raise TypeError(f"HybridConfig.overlap={self.overlap!r}; must be True or False")
        if self.overlap and self.colocate and self.engine_sleep_level != 0:
            raise ValueError(f"HybridConfig(overlap=True, colocate=True) keeps the engines resident beside the "
                             f"trainers; engine_sleep_level={self.engine_sleep_level} would put them to sleep: set "
                             "engine_sleep_level=0")
        if self.overlap and self.max_weight_lag < 1:
            raise ValueError(f"HybridConfig(overlap=True) with max_weight_lag={self.max_weight_lag}: the actor steps "
                             "while the engines generate, so their rollouts lag it by a version; set "
                             "max_weight_lag >= 1 (bound the staleness with rlhfkit.rollouts.RolloutBuffer)")

    @property
    def total_gpus(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def trainer_gpus(self) -> int:
        return self.total_gpus if self.colocate else self.total_gpus - self.engine_gpus

    @property
    def engine_batched_tokens(self) -> int:
        """The ``max_num_batched_tokens`` each vLLM engine gets: the field, or 4,096 (``max_num_seqs`` if larger)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(ENGINE_BATCHED_TOKENS, self.max_num_seqs or 0)

    @property
    def engine_kv_tokens(self) -> int | None:
        """The tokens each vLLM engine's KV cache is sized to: ``kv_cache_tokens``, else ``max_num_seqs *
        kv_tokens_per_seq`` (at least ``max_model_len``), else None (the cache fills ``engine_memory``)."""
        if self.engine != "vllm":
            return None
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens
        if self.max_num_seqs is None or self.kv_tokens_per_seq is None:
            return None
        return max(self.max_model_len, self.max_num_seqs * self.kv_tokens_per_seq)

    @property
    def engine_memory_fraction(self) -> float:
        """The engines' share of GPU memory: ``engine_memory``, else 0.15 colocated and 0.85 on their own GPUs."""
        if self.engine_memory is not None:
            return self.engine_memory
        return 0.15 if self.colocate else 0.85

    @property
    def engine_dtype(self) -> str:
        """The dtype the engines run in (and the memory estimate counts): ``dtype`` on CUDA, float32 on CPU."""
        return self.dtype if self.device == "cuda" else "float32"

    def worker_env(self) -> dict[str, str]:
        """Environment of every Ray actor (Ray workers do not inherit the driver's shell)."""
        from rlhfkit.models import hf_environment  # the user's Hugging Face cache, token, endpoint, offline flag

        env = {"TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0",
               "PYTHONWARNINGS": "ignore::FutureWarning"} | hf_environment()
        if self.device == "cpu":
            return env | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        # DeepSpeed 0.19 cannot parse the '9.0a' some images set; FusedAdam's JIT build needs an arch it can parse.
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0").replace("9.0a", "9.0")
        return env | {"TORCH_CUDA_ARCH_LIST": arch, "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    return fn(*args), time.perf_counter() - started


class Hybrid:
    """A started hybrid run: ``trainers`` (role -> :class:`TrainerGroup`), ``engines`` (:class:`RolloutEngines`),
    ``timer`` (a :class:`PhaseTimer` every block reports its sleep/wake time to), ``startup`` (seconds: ``total_s`` from
    ``start``'s call; ``ray_init_s``, Ray's start, first and alone; ``checks_s``, the LoRA and memory-fit checks,
    which then run beside the placement and the engine processes' start; ``ray_s`` up to Ray and the placement being
    ready; the engine processes start before the checks end, the trainer processes once they passed:
    ``<role>_process_s``, up to ``processes_s``; ``gate_s``, when the engines were let build (after the checks;
    colocated, with a measured KV cache, after the trainers' loads); ``<role>_load_s`` one role after another,
    ``models_s`` in all; ``engines_s`` from the engines' start to their ready, which colocated engines reach after
    building their models behind the trainers' loads, ``engines_after_models_s`` of it after the last load;
    ``weight_sync_s``; ``wake_s``; and outside ``total_s``: ``before_start_s``, how long the process ran before
    ``start`` was called: interpreter, imports, the script). Where each process's start went, the slowest rank or
    engine of each: ``<role>/process_s`` (the process's age when its actor began: spawn, Ray's set-up),
    ``<role>/import_s``, ``<role>/read_s`` (the model read into host memory, every role at once), then one role after
    another ``<role>/load_claim_s``, ``load_copy_rates_s``, ``load_model_s`` (DeepSpeed's set-up, the move to the GPU),
    ``load_sleep_s``; ``engine/process_s``, ``engine/import_s``, ``engine/gate_wait_s`` (waiting for the checks, or the
    trainers' loads), ``engine/build_s``). ``gpu_held_gib``: GiB of a GPU that other processes held before the run
    placed anything (0.0 below ``HELD_GPU_GIB``, or unknown); the fit check counted the GPU as that much smaller."""

    def __init__(self, config: HybridConfig) -> None:
        self.config = config
        self.trainers: dict[str, TrainerGroup] = {}
        self.engines: RolloutEngines | None = None
        self.timer = PhaseTimer(GpuMemorySampler(enabled=config.device == "cuda"))
        self.startup: dict[str, float] = {}
        self.gpu_held_gib = 0.0  # GiB of a GPU other processes held when the checks ran (see HELD_GPU_GIB)
        self._handles: list[Any] = []
        self._workers: dict[str, Any] = {}
        self._placed = self._store = self._group = None
        self._start_gate: str | None = None
        self._kv_cache_bytes: int | None = None
        self._build_during_loads = False
        self._read_ahead = False  # every trainer role reads its model into host memory at once (start)
        self._started_ray = False
        self._pushed_version = 0
        self._threads_before: int | None = None  # torch's intra-op threads before start (driver_threads)

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, config: HybridConfig, trainers: Mapping[str, TrainerConfig]) -> Hybrid:
        """Start the run; ``trainers`` maps each role (``actor``, ``critic``, ``reference``, ``reward``) to its
        config, in the order the models load. The engines are awake when this returns."""
        if not isinstance(config, HybridConfig):
            raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
        if "actor" not in trainers:
            raise ValueError(f"trainers={list(trainers)}; a hybrid run needs an 'actor' role (its weights go to the "
                             "engines)")
        for role, trainer in trainers.items():
            if role not in ("actor", "critic", "reference", "reward"):
                raise ValueError(f"trainer role {role!r}; expected actor, critic, reference or reward")
            if not isinstance(trainer, TrainerConfig):
                raise TypeError(f"trainers[{role!r}] must be a TrainerConfig, got {type(trainer).__name__}")
            if trainer.deepspeed.fused_kernels is not None and config.device != "cuda":
                raise ValueError(f"trainers[{role!r}].deepspeed.fused_kernels={trainer.deepspeed.fused_kernels!r} "
                                 f"needs CUDA (Triton kernels); HybridConfig.device={config.device!r}")
        try:
            require_extras(config)
        except ImportError:
            _checks(config, trainers)  # a bad input explains more than a missing extra
            raise
        began = time.perf_counter()
        before_start_s = process_age_s()
        # Ray starts first, alone: the engines' chain (Ray, their processes' spawn and imports, their build) is the
        # launch, and a local Ray's start also polls from this process, which a thread importing transformers beside
        # it slowed by seconds. The checks import transformers and build each model on the meta device: they run in a
        # thread beside the placement and the engine processes' start (spawn, imports); the trainer processes and
        # all GPU work (a trainer's load, an engine's build) wait for them. A failed check is the error reported; it
        # stops whatever had started, Ray included if started here.
        with ThreadPoolExecutor(1) as pool:
            try:
                started_ray, ray_s = _timed(_start_ray, config)
            except BaseException:
                _checks(config, trainers)  # a bad input explains more than Ray's failure to start
                raise
            try:  # hub ids -> folders, once on each node, before anything reads a model (rlhfkit.models)
                config, trainers = resolve_run_models(config, trainers, env=config.worker_env(),
                                                      timeout_s=config.start_timeout_s)
            except BaseException:
                if started_ray:
                    import ray

                    ray.shutdown()
                raise
            checks = pool.submit(_timed, _checks, config, trainers)
            run = cls(config)
            run._started_ray = started_ray
            run.startup.update(before_start_s=before_start_s, ray_init_s=ray_s)
            try:
                run._start(dict(trainers), began, checks)
            except BaseException:
                run.close()
                raise
        run.startup["total_s"] = time.perf_counter() - began
        return run

    def _start(self, trainers: dict[str, TrainerConfig], started: float, checks: Future) -> None:
        import ray

        from rlhfkit.phase import TCPPhaseStore
        from rlhfkit.placement import materialize

        if checks.done():
            checks.result()  # refused already: start nothing
        self._placed = materialize(self._plan(tuple(trainers)), timeout_s=self.config.start_timeout_s,
                                   cpus_per_bundle=0)
        self._store = TCPPhaseStore.serve(host=_store_host(self._placed))
        configs = {role: trainer.for_role(role) for role, trainer in trainers.items()}
        self.startup["ray_s"] = time.perf_counter() - started
        # The engine processes start (creating an actor does not wait for it), import, and wait at the gate: raised
        # once the checks passed (with the KV-cache size they worked out) and, colocated, once the trainers have
        # loaded (one at a time, each claiming the GPU) and gone to sleep, so that vLLM measures its memory on a GPU
        # nobody else is filling and needs no start-up sleep to make room for the trainers. A KV cache of a given size
        # needs no measuring: then the engines build during the loads when all of it fits. Nothing waits on a Ray
        # call before the checks passed, so a refusal stops the actors and Ray with no thread still inside Ray.
        self._start_gate = f"engines-build-{uuid.uuid4().hex[:12]}"
        self._handles = self._create_engines(configs["actor"].lora)
        configs = self._pass_checks(checks.result(), configs)
        self._engine_group()
        gated = self.config.colocate and not self._build_during_loads
        if not gated:
            self._open_gate(started)
        pool = ThreadPoolExecutor(1 + len(configs))
        try:
            # every engine's ready() (a failure names the engine), answered once it has built its model
            engines = pool.submit(_timed, functools.partial(self._group.call, "ready",
                                                            timeout_s=self.config.start_timeout_s))
            groups = {role: pool.submit(_timed, self._start_group, role, c.model or self.config.model,
                                        optimizer_threads(self.config, c, self._placed.plan, role))
                      for role, c in configs.items()}
            for role, future in groups.items():
                self._workers[role], self.startup[f"{role}_process_s"] = future.result()
            mark = time.perf_counter()
            self.startup["processes_s"] = mark - started
            # Every role reads its model into host memory at once when the host holds all those copies together (the
            # estimate says so), else each right before its turn; one role at a time claims the GPU and places it.
            reading = {role: self._workers[role].submit("prefetch", trainer_config)
                       for role, trainer_config in configs.items()} if self._read_ahead else {}
            for role, trainer_config in configs.items():
                if engines.done() and engines.exception() is not None:  # an engine failed while importing
                    raise engines.exception()
                pending = reading.get(role) or self._workers[role].submit("prefetch", trainer_config)
                read = self._workers[role].gather(pending, timeout_s=self.config.start_timeout_s)
                self.startup[f"{role}/read_s"] = max(rank["read_s"] for rank in read)
                # the actor's process measures its pinned copy rates (the floor of the switches) before its load
                loaded = self._workers[role].call("load", trainer_config, measure_copy_rates=role == "actor",
                                                  overlap_switches=self.config.overlap_switches,
                                                  timeout_s=self.config.start_timeout_s)
                if role == "actor":
                    self.timer.copy_rates = loaded[0]["copy_rates"]
                self.startup.update(_slowest(role, [rank["startup_parts"] for rank in loaded]))
                self.trainers[role] = TrainerGroup(self._workers[role], trainer_config, timer=self.timer)
                self.startup[f"{role}_load_s"], mark = time.perf_counter() - mark, time.perf_counter()
            self.startup["models_s"] = time.perf_counter() - started - self.startup["processes_s"]
            if gated:
                self._open_gate(started)
            self.startup["engines_s"] = engines.result()[1]
            self.startup["engines_after_models_s"] = time.perf_counter() - mark
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # close() kills the actors an engine thread may wait on
            raise
        pool.shutdown(wait=True)
        self.startup.update(_slowest("engine", self._group.call("startup_parts")))
        mark = time.perf_counter()
        self._connect_weight_sync()
        self.startup["weight_sync_s"], mark = time.perf_counter() - mark, time.perf_counter()
        if self.config.colocate and not self.config.overlap:
            self.engines.wake(phase="generate")
        self.startup["wake_s"] = time.perf_counter() - mark

    def _pass_checks(self, outcome: tuple[_Checked, float],
                     configs: dict[str, TrainerConfig]) -> dict[str, TrainerConfig]:
        """Take the checks' outcome (they passed): the config with ``overlap_switches`` resolved, the engines'
        KV-cache size, whether the roles read ahead and the engines may build during the loads; returns the roles'
        ``configs`` with their micro-batch budgets sized and their state sleeps decided."""
        checked, self.startup["checks_s"] = outcome
        self.gpu_held_gib = checked.gpu_held_gib
        self.config, self._read_ahead = checked.config, checked.read_ahead
        self._kv_cache_bytes, self._build_during_loads = checked.kv_cache_bytes, checked.build_during_loads
        if self.config.driver_threads is not None:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(self.config.driver_threads)
        return {role: dataclasses.replace(
            trainer, micro_batch_tokens=checked.micro_batch_tokens.get(role, trainer.micro_batch_tokens),
            sleep_optimizer=checked.sleep_optimizer.get(role, trainer.sleep_optimizer),
            sleep_weights=checked.sleep_weights.get(role, trainer.sleep_weights))
            for role, trainer in configs.items()}

    def _open_gate(self, started: float) -> None:
        """Let the engines build their models, with the KV-cache size the checks worked out (vLLM); ``gate_s``:
        when, since ``start``'s call (``started``)."""
        settings = {"kv_cache_memory_bytes": self._kv_cache_bytes} if self.config.engine == "vllm" else {}
        self._store.set_flag(self._start_gate, json.dumps(settings))
        self.startup["gate_s"] = time.perf_counter() - started

    def _plan(self, roles: tuple[str, ...]) -> Any:
        return plan_gpus(self.config, roles)

    def _create_engines(self, lora: Any = None) -> list[Any]:
        """Start the engine actors (not waiting for them): each imports its engine library, waits at
        ``self._start_gate`` and then builds its model. ``lora``: the actor's LoraConfig (vLLM engines then serve
        adapters, with ``max_lora_rank`` = its rank)."""
        import ray

        config, placed = self.config, self._placed
        gpus = [[plan_gpu_key(p.node, g) for g in p.gpus] for p in placed.plan.ranks("rollout")]
        env = config.worker_env()
        if config.engine == "vllm":
            from rlhfkit.engines.vllm import VLLMEngineConfig, create_engines

            engine_config = VLLMEngineConfig(  # kv_cache_memory_bytes: the checks' size comes through the gate
                model=config.model, num_engines=len(gpus), tensor_parallel_size=config.tensor_parallel_size,
                gpu_memory_utilization=config.engine_memory_fraction, enable_sleep_mode=config.colocate,
                seed=config.seed, enforce_eager=config.enforce_eager, max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.engine_batched_tokens,
                weight_loading=config.weight_loading,
                dtype=config.engine_dtype, env=env, startup_timeout_s=config.start_timeout_s,
                control_timeout_s=config.call_timeout_s,
                enable_lora=lora is not None, max_lora_rank=lora.rank if lora is not None else 16,
                pausable=self._pausable_vllm, pause_timeout_s=config.sync_timeout_s)
            return create_engines(engine_config, placement=placed, role="rollout", wait=False,
                                  engine_cls=guarded_vllm_engine_class(self._store, gpus, start_gate=self._start_gate))
        if config.engine == "sglang":
            return self._create_sglang_engines(gpus, env)
        actor_cls, handles = ray.remote(HFEngineActor), []
        for index, engine_gpus in enumerate(gpus):
            options = placed.actor_options("rollout", index) | {"runtime_env": {"env_vars": env}, "max_restarts": 0}
            if config.overlap:  # pause, receive and resume run beside a generate call
                options["max_concurrency"] = 4
            handles.append(actor_cls.options(**options).remote(
                config.model, engine_index=index, seed=config.seed, device=config.device,
                guard_store=self._store, gpus=engine_gpus, dtype=config.engine_dtype,
                start_gate=self._start_gate, gate_timeout_s=config.start_timeout_s))
        return handles

    def _engine_group(self) -> None:
        """The driver's handles on the started engines: ``self._group`` and ``self.engines``."""
        from rlhfkit.engines.router import EngineGroup, EngineGroupConfig

        config = self.config
        self._group = EngineGroup(self._handles, forward_prompt_indices=True, config=EngineGroupConfig(
            generate_timeout_s=config.call_timeout_s, control_timeout_s=config.call_timeout_s,
            max_weight_lag=config.max_weight_lag))
        self.engines = RolloutEngines(self._group, self._handles, colocated=config.colocate,
                                      sleep_level=config.engine_sleep_level, timer=self.timer,
                                      trainer_version=self.actor_version, overlap=config.overlap,
                                      pausable=config.engine == "hf" or self._pausable_vllm,
                                      update_timeout_s=config.sync_timeout_s,
                                      displace_releasing=config.overlap_switches)

    @property
    def _pausable_vllm(self) -> bool:
        """Overlap with single-GPU vLLM engines: they step their in-process engine core and pause between two
        steps for an in-flight update (``VLLMEngineConfig.pausable``); tensor-parallel ones finish their requests
        first."""
        config = self.config
        return config.engine == "vllm" and config.overlap and config.pause_engines and config.tensor_parallel_size == 1

    def _create_sglang_engines(self, gpus: list[list[str]], env: dict[str, str]) -> list[Any]:
        """One Ray actor per engine, each starting its SGLang server on the actor's GPU(s) once the gate opens."""
        import ray

        from rlhfkit.engines.sglang import SGLangEngineConfig

        config, placed = self.config, self._placed
        server_env = env | ({"PYTHONPATH": config.sglang_site} if config.sglang_site else {})
        engine_config = SGLangEngineConfig(
            model=config.model, python=config.sglang_python, tensor_parallel_size=config.tensor_parallel_size,
            mem_fraction_static=config.engine_memory_fraction, seed=config.seed, dtype=config.engine_dtype,
            enable_memory_saver=config.colocate,
            weights_cpu_backup=config.colocate and config.engine_sleep_level == 1,  # level 2 re-sends weights
            context_length=config.max_model_len, enforce_eager=config.enforce_eager, env=server_env,
            startup_timeout_s=config.start_timeout_s, control_timeout_s=config.call_timeout_s,
            generate_timeout_s=config.call_timeout_s)
        actor_cls = ray.remote(guarded_sglang_engine_class(self._store, gpus, start_gate=self._start_gate))
        handles = []
        for index in range(len(gpus)):
            options = placed.actor_options("rollout", index) | {"runtime_env": {"env_vars": env}, "max_restarts": 0}
            handles.append(actor_cls.options(**options).remote(engine_config, engine_index=index))
        return handles

    def _start_group(self, role: str, path: str, threads: int | None = None) -> Any:
        from rlhfkit.workers import WorkerGroup, WorkerGroupConfig

        config = self.config
        env = config.worker_env() | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
        group_config = WorkerGroupConfig(role=role, env_vars=env, forward_env=_FORWARD_ENV,
                                         start_timeout_s=config.start_timeout_s, call_timeout_s=config.call_timeout_s)
        return WorkerGroup(TrainerWorker, self._placed, group_config, self._store, config.device, path)

    def _connect_weight_sync(self) -> None:
        """Colocated: one CUDA-IPC (gloo on CPU) group per GPU, from the actor rank on that GPU to the engine
        worker on it (a TP engine's worker k joins the group of its k-th GPU). Else actor rank 0 broadcasts over NCCL
        (gloo on CPU) to every worker of every engine (TP workers take consecutive ranks)."""
        import ray
        import torch

        from rlhfkit.weight_sync import WeightSyncConfig

        config, actor = self.config, self._workers["actor"]
        cpu, tp = config.device == "cpu", config.tensor_parallel_size
        backend = "gloo" if cpu else ("cuda_ipc" if config.colocate else "nccl")
        sync = WeightSyncConfig(backend=backend, bucket_bytes=config.sync_bucket_mb * 1024**2,
                                dtype=None if cpu else getattr(torch, config.dtype), timeout_s=config.sync_timeout_s)
        lora = {"lora": self.trainers["actor"].config.lora} if self.trainers["actor"].config.lora else {}
        if config.colocate:
            endpoints = actor.call("open_weight_sync", True, config=sync, world_size=2, group_name="weights",
                                   local=True)  # each group's engine shares its sender's GPU: the same node
            per_engine = _colocated_endpoints(self._placed.plan, endpoints)
            refs = [handle.init_weight_sync.remote(sync, endpoint, first_rank=1, **lora)
                    for handle, endpoint in zip(self._handles, per_engine, strict=True)]
        else:
            senders = [rank == 0 for rank in range(actor.world_size)]
            per_engine = 1 if config.engine == "sglang" else tp  # an SGLang engine receives once for all its TP ranks
            world = 1 + len(self._handles) * per_engine
            endpoint = actor.call_scattered("open_weight_sync", senders, config=sync, world_size=world,
                                            group_name="weights", local=config.num_nodes == 1)[0]
            refs = [handle.init_weight_sync.remote(sync, endpoint, first_rank=1 + index * per_engine, **lora)
                    for index, handle in enumerate(self._handles)]
        ray.get(refs, timeout=config.call_timeout_s)

    # ------------------------------------------------------------------ weights
    def actor_version(self) -> int:
        """The weight version the actor holds: the last pushed one, plus one once it has stepped since."""
        actor = self.trainers.get("actor")
        return self._pushed_version + (1 if actor is not None and actor.steps_since_push else 0)

    def push_weights(self, role: str = "actor") -> dict[str, float]:
        """Move ``role``'s weights into every engine: the role keeps only its weights (if awake), the engines wake
        their weights, the weights stream, the role sleeps fully and the engines wake their KV cache. Timed as the
        ``weight_sync`` phase (its sleeps and wakes as ``sleep_wake``). Returns ``sync/*`` and
        ``engine/weight_version``. With ``HybridConfig(overlap=True)`` the engines stay awake and generating: the
        update happens in flight (:meth:`RolloutEngines.in_flight_update`)."""
        engines, timer = self.engines, self.timer
        if role != "actor" or role not in self.trainers:
            raise ValueError(f"push_weights(role={role!r}): only the actor's weights go to the engines "
                             f"(roles of this run: {sorted(self.trainers)})")
        if self.config.overlap:
            with timer.phase("weight_sync"), engines.in_flight_update():
                return self._push(role, colocated=False)
        engines.check_idle("push_weights")
        with timer.phase("weight_sync"):
            return self._push(role, colocated=self.config.colocate)

    def _push(self, role: str, *, colocated: bool) -> dict[str, float]:
        import ray

        engines, trainer, timer = self.engines, self.trainers[role], self.timer
        trainer.sleep(keep_weights=True, phase="sync")
        trainer.check_push(phase="sync")  # a refusal comes before any engine waits for the sync
        if colocated:
            engines.wake(["weights"], phase="sync")
        # vLLM and HF engines wait for the sync in the background (armed): a push that fails before the sender
        # starts the sync calls it off, and the engines answer their next call at once. SGLang engines receive in
        # a blocking call.
        armed = self.config.engine != "sglang"
        if armed:
            engines.arm_weight_sync()
        else:
            receiving = [handle.receive_weights.remote() for handle in self._handles]
        sending = trainer._submit("send_weights", phase="sync")
        sleeping = trainer._submit("sleep", "sync", False)
        try:
            sent = trainer.workers.gather(sending)
        except Exception as error:
            if armed:  # called off where the sync never started; an engine's own error says more than the sender's
                try:
                    engines.settle_weight_sync(timeout_s=self.config.sync_timeout_s + 30.0)
                except Exception as engine_error:
                    raise engine_error from error
            else:
                ready, _ = ray.wait(receiving, num_returns=len(receiving), timeout=5.0)
                for ref in ready:
                    ray.get(ref)
            raise
        if armed:
            received = engines.settle_weight_sync(timeout_s=self.config.sync_timeout_s + 30.0)
        else:
            received = ray.get(receiving, timeout=self.config.sync_timeout_s)
        engines.weights_pushed()
        trainer._account(trainer._note(trainer.workers.gather(sleeping)))
        if colocated:
            engines.wake(["kv_cache"], phase="generate")
        report = next(item for item in sent if item)
        timer.count_sync_bytes(float(report["bytes"]))
        self._pushed_version, trainer.steps_since_push = int(report["version"]), 0
        versions = [int(worker["version"]) for reports in received for worker in reports]
        return {"sync/version": float(report["version"]), "sync/bytes": float(report["bytes"]),
                "sync/sender_s": float(report["seconds"]), "engine/weight_version": float(min(versions))}

    # ------------------------------------------------------------------ records and shutdown
    def write_phase_log(self, path: str | Path, *, settle: bool = False) -> list[dict[str, Any]]:
        """Every guarded transition of every actor since the last call, in time order, as JSON lines. A trainer's
        sleep still running in the background (``overlap_switches``) is logged by a later call; ``settle=True`` waits
        for it (the last call of a run)."""
        events = [event for group in self.trainers.values() for event in group.guard_events(settle=settle)]
        events += self.engines.guard_events() if self.engines is not None else []
        events.sort(key=lambda event: event["time"])
        with Path(path).open("a") as handle:
            for event in events:
                handle.write(json.dumps(event) + "\n")
        return events

    def close(self) -> None:
        """Stop the actors, the placement groups, the memory sampler, and Ray if this run started it."""
        import ray

        for group in self._workers.values():
            group.shutdown()
        if self.config.engine == "sglang" and self._handles:
            # each SGLang server runs in a process group of its own, which ray.kill would leave behind on the GPU
            pending = [handle.close.remote() for handle in self._handles]
            _, late = ray.wait(pending, num_returns=len(pending), timeout=60.0)
            if late:
                logger.warning("%d SGLang engine(s) did not stop their server within 60 s", len(late))
        for handle in self._handles:
            ray.kill(handle, no_restart=True)
        if self._group is not None:
            self._group.close()
        if self._placed is not None:
            self._placed.remove()
        if self.timer.sampler is not None:
            self.timer.sampler.close()
        if self._started_ray:
            ray.shutdown()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def __enter__(self) -> Hybrid:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def require_extras(config: HybridConfig) -> None:
    """The extras a run needs, checked before anything starts: an ImportError names what to ``pip install``.
    DeepSpeed runs in the trainer processes only: found here, not imported (seconds the driver does not need)."""
    import importlib.util

    from rlhfkit._optional import require

    require("ray", user="rlhfkit.hybrid")
    if importlib.util.find_spec("deepspeed") is None:
        require("deepspeed", user="rlhfkit.hybrid (its trainer processes)")
    if config.engine == "vllm" and config.device == "cuda" and importlib.util.find_spec("vllm") is None:
        require("vllm", user="rlhfkit.hybrid (HybridConfig.engine='vllm')")


@dataclass(frozen=True)
class _Checked:
    """What :meth:`Hybrid.start` takes from the checks: the config (``overlap_switches=None`` resolved), whether every
    role reads its model ahead, the engines' KV-cache bytes, whether the engines may build while the trainers load,
    and each role's micro-batch token budget and state sleeps (``TrainerConfig.micro_batch_tokens=None`` sized,
    ``sleep_optimizer`` and ``sleep_weights`` None decided)."""

    config: HybridConfig
    read_ahead: bool
    kv_cache_bytes: int | None
    build_during_loads: bool
    gpu_held_gib: float = 0.0
    micro_batch_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)
    sleep_optimizer: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    sleep_weights: Mapping[str, bool] = dataclasses.field(default_factory=dict)


def _checks(config: HybridConfig, trainers: Mapping[str, TrainerConfig]) -> _Checked:
    """The checks before any GPU work: LoRA targets, the memory fit, and the overlap's fit."""
    from rlhfkit.hybrid._fit import engines_may_build_during_loads, hybrid_kv_cache_bytes, model_shape
    from rlhfkit.lora import meta_model

    built = functools.cache(meta_model)  # each model built on the meta device once, for every check
    _check_lora(config, trainers, meta_model=built)
    held = _held_by_others_gib(config)
    trainers = size_micro_batches(config, trainers, meta_model=built, held_gib=held)
    trainers = size_state_sleeps(config, trainers, meta_model=built, held_gib=held)
    estimate = check_fit(config, trainers, meta_model=built, held_gib=held)
    if config.overlap_switches is None:  # not beside another process's memory: the overlap's headroom is not there
        config = dataclasses.replace(config, overlap_switches=not held and _overlap_fits(config, trainers,
                                                                                         meta_model=built))
    elif config.overlap_switches:
        _check_overlap_fits(config, trainers, meta_model=built)
    kv_cache_bytes = None
    if config.engine_kv_tokens is not None:
        kv_cache_bytes = hybrid_kv_cache_bytes(config, model_shape(config.model, model=built(config.model)))
    return _Checked(config=config, read_ahead=_reads_ahead(config, trainers, meta_model=built),
                    kv_cache_bytes=kv_cache_bytes, gpu_held_gib=held,
                    build_during_loads=kv_cache_bytes is not None and engines_may_build_during_loads(config, estimate),
                    micro_batch_tokens={role: trainer.micro_batch_tokens for role, trainer in trainers.items()},
                    sleep_optimizer={role: trainer.sleep_optimizer for role, trainer in trainers.items()},
                    sleep_weights={role: trainer.sleep_weights for role, trainer in trainers.items()})


# GPU memory in use before a run starts, above which the fit check counts it as held by other processes: below it is
# the driver's own reservation and a stray CUDA context (~0.5 GiB each).
HELD_GPU_GIB = 1.0


def _held_by_others_gib(config: HybridConfig) -> float:
    """GiB already in use on the busiest of this machine's visible GPUs before the run places anything (another
    job, a process left over from an earlier run), when at least ``HELD_GPU_GIB``; 0.0 otherwise, and when the
    GPU size is given (``gpu_memory_gib``: the user's own budget), on CPU, without NVML, or when joining a cluster
    (``ray_address`` / ``$RAY_ADDRESS``: the run's GPUs may be on other machines)."""
    if config.device != "cuda" or config.gpu_memory_gib is not None:
        return 0.0
    if config.ray_address or os.environ.get("RAY_ADDRESS"):
        return 0.0
    used = visible_gpu_memory_used_gib()
    busiest = max(used) if used else 0.0
    if busiest < HELD_GPU_GIB:
        return 0.0
    logger.warning("%.1f GiB of a GPU this run may use (of %s GiB in use on the visible GPUs) is held by other "
                   "processes before the run starts: the fit check counts the GPU as that much smaller", busiest,
                   [round(gib, 1) for gib in used])
    return busiest


def _start_ray(config: HybridConfig) -> bool:
    """Start a local Ray (or join ``config.ray_address`` / ``RAY_ADDRESS``) unless one is up; True if it started or
    joined one here (``close`` shuts it down then)."""
    import ray

    from rlhfkit.workers import RayConfig, ray_init

    if ray.is_initialized():
        return False
    env = config.worker_env()
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray_init(RayConfig(address=address, env_vars=env, forward_env=_FORWARD_ENV))
    elif config.device == "cpu":
        ray_init(RayConfig(num_gpus=config.total_gpus, num_cpus=max(2, os.cpu_count() or 2),
                           object_store_memory=512 * 1024**2, env_vars=env, forward_env=_FORWARD_ENV))
    else:
        ray_init(RayConfig(env_vars=env, forward_env=_FORWARD_ENV))
    return True


def _check_lora(config: HybridConfig, trainers: Mapping[str, TrainerConfig], *,
                meta_model: Callable[[str], Any] | None = None) -> None:
    """LoRA settings that cannot work, refused before any GPU work (once Ray is up, beside the engine processes'
    start, which a refusal stops again, with the Ray started here); ``meta_model``: path -> the model built on the
    meta device (default :func:`rlhfkit.lora.meta_model`)."""
    for role, trainer in trainers.items():
        if trainer.lora is not None and role != "actor":
            raise ValueError(f"trainers[{role!r}].lora is set; LoRA adapters are supported on the actor only")
    lora = trainers["actor"].lora
    if lora is None:
        return
    if config.engine_sleep_level == 2:
        raise ValueError("HybridConfig.engine_sleep_level=2 discards the engines' base weights, which a LoRA push "
                         "(adapters only) does not rewrite; use engine_sleep_level=1 (or 0) with TrainerConfig.lora")
    from rlhfkit.lora import check_target_modules
    from rlhfkit.lora import meta_model as build_meta_model

    path = trainers["actor"].model or config.model
    check_target_modules((meta_model or build_meta_model)(path), lora, where=f"the model at {path!r}")


def optimizer_threads(config: HybridConfig, trainer: TrainerConfig, plan: Any, role: str) -> int | None:
    """``OMP_NUM_THREADS`` for the ranks of ``role`` (see ``HybridConfig.optimizer_threads``); None: Ray's default
    (one thread: an actor that reserves no CPU)."""
    if not trainer.deepspeed.offload_optimizer:
        return None
    if config.optimizer_threads is not None:
        return config.optimizer_threads
    if config.device != "cuda":
        return None
    ranks_per_node = Counter(rank.node for rank in plan.ranks(role))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(ranks_per_node.values(), default=1))


def plan_gpus(config: HybridConfig, roles: tuple[str, ...]) -> Any:
    """The placement plan of a run: every role and the engines on the same GPUs when ``colocate``."""
    from rlhfkit.placement import plan_layout

    return plan_layout(num_nodes=config.num_nodes, gpus_per_node=config.num_gpus, colocate=config.colocate,
                       engine_gpus=None if config.colocate else config.engine_gpus,
                       tensor_parallel_size=config.tensor_parallel_size, trainer_roles=tuple(roles))


def _store_host(placed: Any) -> str:
    """Where the driver's phase store listens: loopback when every placement group of the run lies on the driver's
    node (all its clients are there), else this node's address, for the other nodes (docs/security.md)."""
    import ray
    from ray.util import placement_group_table

    here = ray.get_runtime_context().get_node_id()
    nodes = {node for group in placed.placement_groups
             for node in placement_group_table(group).get("bundles_to_node_id", {}).values()}
    return "127.0.0.1" if nodes == {here} else ray.util.get_node_ip_address()


def _colocated_endpoints(plan: Any, endpoints: Sequence[Any]) -> list[Any]:
    """Each engine's weight-sync endpoint(s) in a colocated plan: the endpoint of the actor rank on the engine's
    GPU, or for a TP engine a list, worker k's from the actor rank on the engine's k-th GPU."""
    by_gpu = {}
    for rank, endpoint in zip(plan.ranks("actor"), endpoints, strict=True):
        for gpu in rank.gpus:
            by_gpu[(rank.node, gpu)] = endpoint
    out = []
    for engine in plan.ranks("rollout"):
        missing = [gpu for gpu in engine.gpus if (engine.node, gpu) not in by_gpu]
        if missing:
            raise ValueError(f"engine {engine.rank} on node {engine.node} GPU(s) {missing} shares no GPU with an "
                             "actor rank; a colocated plan puts an actor rank on every engine GPU")
        mine = [by_gpu[(engine.node, gpu)] for gpu in engine.gpus]
        out.append(mine[0] if len(mine) == 1 else mine)
    return out


def _slowest(who: str, parts: list[dict[str, float]]) -> dict[str, float]:
    """``{"<who>/<part>": seconds}``: each part's largest value over the ranks or engines (they start in
    parallel)."""
    return {f"{who}/{name}": max(each.get(name, 0.0) for each in parts) for name in sorted(set().union(*parts))}


def check_fit(config: HybridConfig, trainers: Mapping[str, TrainerConfig], *,
              meta_model: Callable[[str], Any] | None = None, read_ahead: bool = False, held_gib: float = 0.0,
              log_warnings: bool = True, suggest: bool = True) -> Any:
    """Raise :class:`~rlhfkit.placement.MemoryFitError` when the plan's memory estimate says a phase cannot fit one
    GPU of ``config.gpu_memory_gib`` or one node's ``config.host_memory_gib`` of host memory (``error.memory`` says
    which), or the engines' share leaves no room for a KV cache (see :mod:`rlhfkit.hybrid._fit`); returns the
    :class:`~rlhfkit.placement.MemoryEstimate` (None when the GPU size is unknown: no check). ``meta_model`` and
    ``read_ahead``: as for :func:`~rlhfkit.hybrid._fit.estimate_hybrid_memory`. ``held_gib``: GiB of each GPU that
    other processes hold: the phases must fit in what is left (the engines' share stays a share of the whole GPU,
    as vLLM and SGLang size it). ``log_warnings=False``: a probe (the estimate's shortfalls are not logged).
    ``suggest``: a refusal names a layout the same estimate accepts (:func:`suggest_fit`; the error's
    ``suggestion``), or says that none of those it tries does.

    The estimate is an upper bound with a margin (:mod:`rlhfkit.hybrid._fit`): a run it passes fits the GPU."""
    from rlhfkit.hybrid._fit import estimate_hybrid_memory
    from rlhfkit.placement import MemoryFitError

    if any(trainer.micro_batch_tokens is None for trainer in trainers.values()):
        trainers = size_micro_batches(config, trainers, meta_model=meta_model, held_gib=held_gib)
    gpu_gib, host_gib = _gpu_memory_gib(config), config.host_memory_gib
    if host_gib is None and config.device == "cuda":
        physical = physical_memory_gib()
        host_gib = None if physical is None else physical * ray_memory_threshold()
    if gpu_gib is None:
        return None
    estimate = estimate_hybrid_memory(config, trainers, plan=plan_gpus(config, tuple(trainers)),
                                      gpu_memory_gib=gpu_gib, host_memory_gib=host_gib, meta_model=meta_model,
                                      read_ahead=read_ahead, log_warnings=log_warnings)
    what = f"the hybrid run of {config.model!r} on {config.total_gpus} GPU(s)"
    if held_gib > 0:
        what += (f", beside {held_gib:.1f} GiB of a {gpu_gib:.1f} GiB GPU held by other processes (give the run free "
                 "GPUs with CUDA_VISIBLE_DEVICES, or set HybridConfig.gpu_memory_gib to budget it yourself),")
    try:
        dataclasses.replace(estimate, gpu_memory_gib=gpu_gib - held_gib).check_fit(what=what)
    except MemoryFitError as error:
        if not suggest:
            raise
        found = suggest_fit(config, trainers, meta_model=meta_model, held_gib=held_gib)
        hint = (f" A layout this estimate accepts: {found.change}." if found is not None else
                " None of the layouts the plan tries fits (ZeRO-3 with the optimizer offloaded, every role asleep "
                "in host memory): LoRA, more GPUs or a bigger GPU.")
        raise MemoryFitError(f"{error}{hint}", phase=error.phase, shortfall_gib=error.shortfall_gib,
                             memory=error.memory, suggestion=found) from error
    return estimate


@dataclass(frozen=True)
class FitSuggestion:
    """A layout the plan's memory estimate accepts, offered by a refusal: the run's ``config`` and ``trainers`` with
    ``change`` (the fields that differ, by role) applied; budgets and state sleeps as :meth:`Hybrid.start` decides
    them."""

    config: HybridConfig
    trainers: Mapping[str, TrainerConfig]
    change: str


# The optimizer shares a refusal tries to put in host memory (DeepSpeed ZeRO-3's offload_optimizer.ratio, the
# trainers resident), the least first: the less the optimizer steps on the host, the faster the step.
SUGGESTED_OFFLOAD_RATIOS = (0.25, 0.5, 0.66, 1.0)
SUGGESTED_SUB_GROUP_ELEMENTS = 100_000_000  # the grain of the ratio: whole sub-groups move


def suggest_fit(config: HybridConfig, trainers: Mapping[str, TrainerConfig], *,
                meta_model: Callable[[str], Any] | None = None,
                held_gib: float = 0.0) -> FitSuggestion | None:
    """The first layout the memory estimate accepts (every phase, GPU and host) among: every role asleep in host
    memory between its phases with gradient checkpointing; then the trained roles resident with ZeRO-3, gradient
    checkpointing and ``SUGGESTED_OFFLOAD_RATIOS`` of their optimizer in host memory. The engines and the other
    roles stay as given. None when none fits (or the layout given is the only one that would)."""
    from rlhfkit.lora import meta_model as build_meta_model
    from rlhfkit.placement import MemoryFitError

    build = meta_model or functools.cache(build_meta_model)
    trained = ("actor", "critic")

    def asleep() -> dict[str, TrainerConfig]:
        out = {}
        for role, trainer in trainers.items():
            ds = trainer.deepspeed
            ds = dataclasses.replace(ds, offload_optimizer_ratio=1.0,
                                     gradient_checkpointing=ds.gradient_checkpointing or role in trained)
            out[role] = dataclasses.replace(trainer, deepspeed=ds, offload=True, sleep_optimizer=None,
                                            sleep_weights=None)
        return out

    def resident(ratio: float) -> dict[str, TrainerConfig]:
        out = dict(trainers)
        for role in trained:
            if role in trainers and trainers[role].lora is None:
                # DeepSpeed keeps part of the optimizer on the GPU with its fused Adam only (CUDA)
                optimizer = trainers[role].deepspeed.optimizer
                optimizer = "fused_adam" if ratio < 1 and config.device == "cuda" else optimizer
                ds = dataclasses.replace(trainers[role].deepspeed, zero_stage=3, compile_layers=False,
                                         offload_optimizer=True, offload_optimizer_ratio=ratio,
                                         sub_group_elements=SUGGESTED_SUB_GROUP_ELEMENTS,
                                         gradient_checkpointing=True, optimizer=optimizer)
                out[role] = dataclasses.replace(trainers[role], deepspeed=ds, offload=False, micro_batch_tokens=None,
                                                sleep_optimizer=None, sleep_weights=None)
        return out

    for build_candidate in [asleep, *(functools.partial(resident, ratio) for ratio in SUGGESTED_OFFLOAD_RATIOS)]:
        try:
            candidate = build_candidate()
        except (ValueError, TypeError):  # a layout the configs refuse here (partial offload on CPU): not a choice
            continue
        if candidate == dict(trainers):
            continue
        sized = size_state_sleeps(config, size_micro_batches(config, candidate, meta_model=build, held_gib=held_gib),
                                  meta_model=build, held_gib=held_gib)
        try:
            check_fit(config, sized, meta_model=build, held_gib=held_gib, log_warnings=False, suggest=False)
        except MemoryFitError:
            continue
        return FitSuggestion(config=config, trainers=sized, change=_describe_change(trainers, sized))
    return None


def _describe_change(before: Mapping[str, TrainerConfig], after: Mapping[str, TrainerConfig]) -> str:
    """``trainers['actor']: offload=False, deepspeed.zero_stage=3, ...`` for each role whose config differs."""
    parts = []
    for role, trainer in after.items():
        changed = []
        for field in dataclasses.fields(trainer):
            old, new = getattr(before[role], field.name), getattr(trainer, field.name)
            if field.name == "deepspeed":
                changed += [f"deepspeed.{f.name}={getattr(new, f.name)!r}" for f in dataclasses.fields(new)
                            if getattr(old, f.name) != getattr(new, f.name)]
            elif old != new:
                changed.append(f"{field.name}={new!r}")
        if changed:
            parts.append(f"trainers[{role!r}]: " + ", ".join(changed))
    return "; ".join(parts)


def _reads_ahead(config: HybridConfig, trainers: Mapping[str, TrainerConfig], *,
                 meta_model: Callable[[str], Any] | None = None) -> bool:
    """Whether every trainer role may read its model into host memory at once (before the first places its own on
    the GPU): with more than one role, when the memory estimate with those copies held together still fits."""
    from rlhfkit.placement import MemoryFitError

    if len(trainers) < 2:
        return False
    try:
        check_fit(config, trainers, meta_model=meta_model, read_ahead=True, log_warnings=False, suggest=False)
    except MemoryFitError:
        return False
    return True


def _check_overlap_fits(config: HybridConfig, trainers: Mapping[str, TrainerConfig], *,
                        meta_model: Callable[[str], Any] | None = None) -> None:
    """``overlap_switches`` puts two roles on a GPU for a moment: refuse it (before anything starts) unless the
    memory estimate fits the run with every role resident, the most two roles' states can take together."""
    from rlhfkit.placement import MemoryFitError

    try:
        _check_resident_fit(config, trainers, meta_model=meta_model)
    except MemoryFitError as error:
        raise ValueError(f"HybridConfig.overlap_switches=True needs room for every role resident at once (two "
                         f"roles share the GPU while one goes to sleep), and the memory estimate says: {error}. "
                         "Turn overlap_switches off (or leave it None: on only where it fits)") from error


# The share of the GPU the plan keeps free, beyond its estimate, for a choice it makes for the user (the overlap of
# switches, micro-batch budgets, state sleeps). The estimate is itself an upper bound (its margin:
# rlhfkit.hybrid._fit.TRAINER_RESERVE_FACTOR, CONTEXT_GIB), so this only keeps a chosen layout off the card's edge;
# the choices it leaves at 1.5B and 3B on an H100 are the layouts measured to run (docs/benchmarks.md, Scale).
# A speed-up chosen for the user must not cost an OOM.
OVERLAP_HEADROOM = 1.03


# TrainerConfig.micro_batch_tokens=None: the largest of these budgets with which the run keeps the overlap's headroom
# (and the overlap of switches, where the smallest keeps it on). Fewer, larger micro-batches launch fewer kernels and
# run DeepSpeed's per-gradient work fewer times in a host-bound step (docs/benchmarks.md, sessions 21-23).
MICRO_BATCH_LADDER = (16384, 12288, 8192, 4096)


def size_micro_batches(config: HybridConfig, trainers: Mapping[str, TrainerConfig], *,
                       meta_model: Callable[[str], Any] | None = None,
                       held_gib: float = 0.0) -> dict[str, TrainerConfig]:
    """``trainers`` with every ``micro_batch_tokens=None`` sized (the others as given): the largest budget of
    ``MICRO_BATCH_LADDER`` whose memory estimate fits every phase within ``1 / OVERLAP_HEADROOM`` of the GPU and, when
    the switches overlap (``overlap_switches=True``, or None where it fits at the smallest budget), fits every role
    resident there too; the smallest where none does, on CPU and where the GPU size is unknown (the fit check then
    decides as for a given budget). Every unsized role gets the same budget."""
    unsized = [role for role, trainer in trainers.items() if trainer.micro_batch_tokens is None]

    def sized(tokens: int) -> dict[str, TrainerConfig]:
        return {role: dataclasses.replace(trainer, micro_batch_tokens=tokens) if role in unsized else trainer
                for role, trainer in trainers.items()}

    smallest = sized(MICRO_BATCH_LADDER[-1])
    gpu_gib = _gpu_memory_gib(config)
    if not unsized or config.device != "cuda" or gpu_gib is None:
        return smallest
    overlap = config.overlap_switches
    if overlap is None:
        overlap = not held_gib and _overlap_fits(config, smallest, meta_model=meta_model)
    for tokens in MICRO_BATCH_LADDER[:-1]:
        candidate = sized(tokens)
        if overlap and not _overlap_fits(config, candidate, meta_model=meta_model):
            continue
        if _fits_with_headroom(config, candidate, gpu_gib, meta_model=meta_model, held_gib=held_gib):
            return candidate
    return smallest


# TrainerConfig.sleep_weights / sleep_optimizer None: what a trained role that sleeps to host memory keeps on the GPU
# through its sleeps, in the order tried: (weights, optimizer states) kept. The weights first among the partial
# choices: they are few bytes (2 a parameter against 12) and their wake is on the step's path, before the forward,
# where the optimizer's states come back behind the compute (defer_optimizer_wake).
STATE_SLEEP_LADDER = ((True, True), (False, True), (True, False))


def size_state_sleeps(config: HybridConfig, trainers: Mapping[str, TrainerConfig], *,
                      meta_model: Callable[[str], Any] | None = None,
                      held_gib: float = 0.0) -> dict[str, TrainerConfig]:
    """``trainers`` with every ``sleep_weights=None`` and ``sleep_optimizer=None`` decided (the others as given): for
    the trained roles that sleep to host memory, the first of ``STATE_SLEEP_LADDER`` (weights and optimizer's states
    kept on the GPU through sleeps; the optimizer's alone; the weights alone) whose memory estimate, with them held
    in every phase, fits within ``1 / OVERLAP_HEADROOM`` of the GPU; everything sleeps (True) otherwise, for the
    roles without an optimizer, on CPU and where the GPU size is unknown. The budget the micro-batches were sized to
    comes first (:func:`size_micro_batches`)."""
    if all(trainer.sleep_weights is not None and trainer.sleep_optimizer is not None
           for trainer in trainers.values()):
        return dict(trainers)

    def decided(keep_weights: bool, keep_optimizer: bool) -> dict[str, TrainerConfig]:
        out = {}
        for role, trainer in trainers.items():
            keeps = trainer.offload and role in ("actor", "critic")
            out[role] = dataclasses.replace(
                trainer,
                sleep_weights=(not (keep_weights and keeps) if trainer.sleep_weights is None
                               else trainer.sleep_weights),
                sleep_optimizer=(not (keep_optimizer and keeps) if trainer.sleep_optimizer is None
                                 else trainer.sleep_optimizer))
        return out

    gpu_gib = _gpu_memory_gib(config)
    if config.device == "cuda" and gpu_gib is not None:
        for keep in STATE_SLEEP_LADDER:
            candidate = decided(*keep)
            if _fits_with_headroom(config, candidate, gpu_gib, meta_model=meta_model, held_gib=held_gib):
                return candidate
    return decided(False, False)


def _fits_with_headroom(config: HybridConfig, trainers: Mapping[str, TrainerConfig], gpu_gib: float, *,
                        meta_model: Callable[[str], Any] | None = None, held_gib: float = 0.0) -> bool:
    """Whether the memory estimate of ``trainers`` fits every phase within ``1 / OVERLAP_HEADROOM`` of a GPU of
    ``gpu_gib`` (less ``held_gib``): the margin the plan keeps for a choice it makes for the user."""
    from rlhfkit.placement import MemoryFitError

    try:
        check_fit(dataclasses.replace(config, gpu_memory_gib=gpu_gib / OVERLAP_HEADROOM), trainers,
                  meta_model=meta_model, held_gib=held_gib, log_warnings=False, suggest=False)
    except MemoryFitError:
        return False
    return True


def _gpu_memory_gib(config: HybridConfig) -> float | None:
    """``config.gpu_memory_gib``, else (on CUDA) the size of this process's first GPU; None when unknown."""
    if config.gpu_memory_gib is not None or config.device != "cuda":
        return config.gpu_memory_gib
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 1024**3 if torch.cuda.is_available() else None


def _overlap_fits(config: HybridConfig, trainers: Mapping[str, TrainerConfig], *,
                  meta_model: Callable[[str], Any] | None = None) -> bool:
    """``overlap_switches=None``: on for a GPU run whose memory estimate fits every role resident at once within
    ``1 / OVERLAP_HEADROOM`` of the GPU; off on CPU (nothing to gain: no copies between device and host) and where
    the GPU size is unknown or the estimate does not fit."""
    from rlhfkit.placement import MemoryFitError

    gpu_gib = _gpu_memory_gib(config)
    if config.device != "cuda" or gpu_gib is None:
        return False
    try:
        _check_resident_fit(dataclasses.replace(config, gpu_memory_gib=gpu_gib / OVERLAP_HEADROOM), trainers,
                            meta_model=meta_model, log_warnings=False)
    except MemoryFitError:
        return False
    return True


def _check_resident_fit(config: HybridConfig, trainers: Mapping[str, TrainerConfig], *,
                        meta_model: Callable[[str], Any] | None = None, log_warnings: bool = True) -> Any:
    """:func:`check_fit` of ``config`` with every role resident (engine level 0, no trainer offloaded)."""
    resident = {role: dataclasses.replace(trainer, offload=False) for role, trainer in trainers.items()}
    return check_fit(dataclasses.replace(config, engine_sleep_level=0), resident, meta_model=meta_model,
                     log_warnings=log_warnings, suggest=False)


def ray_memory_threshold() -> float:
    """The share of a node's memory past which Ray's memory monitor kills workers (``RAY_memory_usage_threshold``,
    0.95 by default; 1.0 when ``RAY_memory_monitor_refresh_ms=0`` turns the monitor off): the usable host memory."""
    if os.environ.get("RAY_memory_monitor_refresh_ms", "").strip() == "0":
        return 1.0
    raw = os.environ.get("RAY_memory_usage_threshold", "0.95")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"RAY_memory_usage_threshold={raw!r}; Ray expects a number in (0, 1]") from None
    if not 0 < value <= 1:
        raise ValueError(f"RAY_memory_usage_threshold={raw!r}; Ray expects a number in (0, 1]")
    return value


def physical_memory_gib() -> float | None:
    """This machine's physical memory in GiB (``SC_PAGE_SIZE * SC_PHYS_PAGES``); None where sysconf lacks them."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError, AttributeError):
        return None
