"""Configuration of the ``vllm`` rollout engine (:class:`VLLMEngineConfig`) and its translation into ``vllm.LLM``
keyword arguments (:func:`build_llm_kwargs`); private to :mod:`rlhfkit.engines.vllm`, which re-exports both. Needs only
the standard library and rlhfkit's compatibility layer (no vLLM import).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rlhfkit.engines.vllm._compat import VLLMFeatureError, VLLMFeatures, require_feature

__all__ = ["VLLMEngineConfig", "build_llm_kwargs", "lora_rank_slot", "WORKER_EXTENSION"]

WORKER_EXTENSION = "rlhfkit.engines.vllm._worker.WeightSyncExtension"
_DTYPES = ("auto", "bfloat16", "float16", "float32")
_OWN_KWARGS = ("model", "tensor_parallel_size", "gpu_memory_utilization", "enable_sleep_mode", "seed",
               "enable_prefix_caching", "enforce_eager", "max_model_len", "dtype", "logprobs_mode",
               "worker_extension_cls", "distributed_executor_backend", "enable_lora", "max_lora_rank", "max_loras",
               "max_cpu_loras", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes")


def _freeze_pairs(owner: str, name: str, value: Any) -> tuple[tuple[str, Any], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple((key, item) for key, item in items)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{owner}.{name}={value!r}; pass a mapping or a tuple of (name, value) pairs") from error
    for key, _ in pairs:
        if not isinstance(key, str) or not key:
            raise TypeError(f"{owner}.{name} has key {key!r}; keys must be non-empty strings")
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError(f"{owner}.{name}={value!r} repeats a key")
    return pairs


@dataclass(frozen=True, kw_only=True)
class VLLMEngineConfig:
    """How to build vLLM rollout engines.

    Attributes:
        model: path of an HF model folder (or a hub id where the hub is reachable).
        num_engines: engines :func:`create_engines` starts (a single :class:`VLLMEngine` ignores it).
        tensor_parallel_size: GPUs per engine; > 1 uses vLLM's Ray executor inside the engine's actor.
        gpu_memory_utilization: fraction of each GPU vLLM may use (weights + KV cache), in (0, 1].
        gpu_share: fraction of a GPU each engine (TP=1) or TP worker reserves in Ray; < 1 lets trainer actors share
            the GPU (hybrid engine). Ignored where a placement plan gives the share.
        enable_sleep_mode: allow :meth:`VLLMEngine.sleep` (CUDA only; costs a custom allocator).
        seed: engine ``i`` is seeded with ``seed + i``.
        enable_prefix_caching, enforce_eager, max_model_len, dtype: passed to ``vllm.LLM``.
        max_num_seqs: sequences an engine runs at once (``vllm.LLM``'s). It also caps the batch sizes vLLM captures
            CUDA graphs for (``compilation_config.max_cudagraph_capture_size``, at most 512; vLLM's own cap is twice
            ``max_num_seqs``): decode steps never exceed it, and the steps of ``max_num_seqs`` to twice as many
            tokens (prefills and mixed steps of that size) then run compiled without a graph. Graph capture took
            21 s of a 7B LoRA engine's start-up with 128 sequences (70 graphs, half of them above 128). Not applied
            with ``enforce_eager``, or when ``extra_kwargs`` sets ``compilation_config``. None: vLLM's default
            (1024 on large GPUs: 51 sizes per graph kind).
        max_num_batched_tokens: tokens one engine step may process (``vllm.LLM``'s; prompts are prefilled in
            chunks of it). vLLM profiles a forward of this many tokens at start-up and keeps that activation
            memory out of the KV cache of ``gpu_memory_utilization``. None: vLLM's default (16,384 for the ``LLM``
            class on a GPU of 70 GiB or more, 8,192 below). At least ``max_num_seqs`` (one token per running
            sequence and step).
        kv_cache_memory_bytes: the KV cache of each GPU, in bytes (``vllm.LLM``'s): vLLM allocates exactly this
            much and skips its memory profile, instead of filling ``gpu_memory_utilization`` with KV cache (which
            then only has to be free at start-up). It must hold ``max_model_len`` tokens. None: fill the share.
        logprobs_mode: ``"processed_logprobs"`` (temperature applied; the protocol's convention) or
            ``"raw_logprobs"`` (see the module docstring).
        extra_kwargs: more ``vllm.LLM`` keyword arguments, as a mapping or (name, value) pairs (stored as pairs);
            names this config sets are refused.
        env: environment variables for engine actors (e.g. ``VLLM_USE_FLASHINFER_SAMPLER=0``), as pairs or a mapping.
        in_process: with ``tensor_parallel_size=1`` vLLM's engine core runs in the process that builds the engine
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set for that process unless it is set already) instead of a second
            process that imports vLLM again and relays every call (≈ 10-20 s less start-up); ``load_weights``
            needs it on vLLM 0.22 (tensors sent to a separate engine core arrive as lists). False keeps vLLM's
            default.
        worker_extension_cls: the worker extension (a subclass of rlhfkit's may add methods).
        generate_timeout_s, control_timeout_s, health_timeout_s, startup_timeout_s: timeouts of engine groups
            (generate; sleep/wake/weight loads; health checks; engine start-up).
        load_bucket_bytes: :meth:`VLLMEngine.load_weights` sends tensors to the workers in buckets of this size.
        enable_lora: serve LoRA adapters pushed in memory through the weight sync
            (:meth:`VLLMEngine.init_weight_sync` with ``lora=``; see ``docs/lora.md``).
        max_lora_rank: the largest adapter rank; rounded up to the next rank the installed vLLM accepts (1, 8, 16,
            32, 64, ...), which sizes vLLM's adapter buffers.
        max_loras: adapters one batch may use (vLLM's GPU slots). vLLM keeps ``max_loras + 1`` registered, so the
            previous adapter can stay while the generate calls that use it finish.
        pausable: :meth:`VLLMEngine.generate` steps vLLM's engine itself (its in-process core: ``in_process=True``
            and ``tensor_parallel_size=1``), one decode step at a time, so that another thread can
            :meth:`~VLLMEngine.pause_generation` it between two steps, load weights, and
            :meth:`~VLLMEngine.resume_generation`: the running requests go on under the new weights with the KV cache
            they have (an in-flight update), each token stamped with the version that sampled it. Engine actors
            then run calls concurrently (Ray ``max_concurrency``). One generate call steps the engine at a time.
        pause_timeout_s: the longest a paused generate call waits for :meth:`~VLLMEngine.resume_generation`.
    """

    model: str
    num_engines: int = 1
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    gpu_share: float = 1.0
    enable_sleep_mode: bool = False
    seed: int = 0
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    dtype: str = "bfloat16"
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    extra_kwargs: Any = field(default=())
    env: Any = field(default=())
    in_process: bool = True
    worker_extension_cls: str = WORKER_EXTENSION
    generate_timeout_s: float = 600.0
    control_timeout_s: float = 300.0
    health_timeout_s: float = 30.0
    startup_timeout_s: float = 900.0
    load_bucket_bytes: int = 512 * 1024**2
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    pausable: bool = False
    pause_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"VLLMEngineConfig.model={self.model!r}; pass the path of an HF model folder")
        if not isinstance(self.enable_lora, bool):
            raise TypeError(f"VLLMEngineConfig.enable_lora={self.enable_lora!r}; must be True or False")
        for name in ("num_engines", "tensor_parallel_size", "load_bucket_bytes", "max_lora_rank", "max_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VLLMEngineConfig.{name}={value!r}; must be an integer >= 1")
        for name in ("gpu_memory_utilization", "gpu_share"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"VLLMEngineConfig.{name}={value!r}; must be in (0, 1]")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"VLLMEngineConfig.{name}={value!r}; must be None or an int >= 1")
        if (self.max_num_batched_tokens is not None and self.max_num_seqs is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError(f"VLLMEngineConfig.max_num_batched_tokens={self.max_num_batched_tokens} is below "
                             f"max_num_seqs={self.max_num_seqs}: a decode step gives every running sequence a token")
        if self.dtype not in _DTYPES:
            raise ValueError(f"VLLMEngineConfig.dtype={self.dtype!r}; expected one of {_DTYPES}")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"VLLMEngineConfig.logprobs_mode={self.logprobs_mode!r}; expected 'processed_logprobs' "
                             "(temperature applied, the protocol's convention) or 'raw_logprobs'")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"VLLMEngineConfig.seed={self.seed!r}; must be an integer >= 0")
        for name in ("generate_timeout_s", "control_timeout_s", "health_timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"VLLMEngineConfig.{name}={value!r}; must be a number of seconds > 0")
        if not isinstance(self.in_process, bool):
            raise TypeError(f"VLLMEngineConfig.in_process={self.in_process!r}; must be True or False")
        if not isinstance(self.pausable, bool):
            raise TypeError(f"VLLMEngineConfig.pausable={self.pausable!r}; must be True or False")
        if self.pausable and not (self.in_process and self.tensor_parallel_size == 1):
            raise ValueError(f"VLLMEngineConfig.pausable=True steps vLLM's engine core in this process; it needs "
                             f"in_process=True and tensor_parallel_size=1 (got in_process={self.in_process}, "
                             f"tensor_parallel_size={self.tensor_parallel_size})")
        if not isinstance(self.pause_timeout_s, (int, float)) or isinstance(self.pause_timeout_s, bool) \
                or not self.pause_timeout_s > 0:
            raise ValueError(f"VLLMEngineConfig.pause_timeout_s={self.pause_timeout_s!r}; must be a number of "
                             "seconds > 0")
        extra = _freeze_pairs("VLLMEngineConfig", "extra_kwargs", self.extra_kwargs)
        clash = [key for key, _ in extra if key in _OWN_KWARGS]
        if clash:
            raise ValueError(f"VLLMEngineConfig.extra_kwargs sets {clash}; set the config field(s) of the same name "
                             "instead (distributed_executor_backend is chosen from tensor_parallel_size)")
        env = _freeze_pairs("VLLMEngineConfig", "env", self.env)
        bad_env = [key for key, value in env if not isinstance(value, str)]
        if bad_env:
            raise TypeError(f"VLLMEngineConfig.env values must be strings; {bad_env} are not")
        object.__setattr__(self, "extra_kwargs", extra)
        object.__setattr__(self, "env", env)


def lora_rank_slot(rank: int, accepted: tuple[int, ...]) -> int:
    """The smallest rank in ``accepted`` (vLLM's allowed ``max_lora_rank`` values) that is >= ``rank``; ``rank``
    itself when ``accepted`` is empty (unknown). Raises ValueError when every accepted rank is smaller."""
    if not accepted:
        return rank
    fitting = [value for value in sorted(accepted) if value >= rank]
    if not fitting:
        raise ValueError(f"VLLMEngineConfig.max_lora_rank={rank} is above the largest rank the installed vLLM "
                         f"accepts ({max(accepted)}; allowed: {sorted(accepted)}); train adapters of a smaller rank")
    return fitting[0]


def build_llm_kwargs(config: VLLMEngineConfig, features: VLLMFeatures, *, engine_index: int = 0,
                     distributed_executor_backend: str | None = None) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` of engine ``engine_index``; raises :class:`VLLMFeatureError` for a feature the
    installed vLLM lacks."""
    require_feature("collective_rpc", features, purpose="loading and receiving weights")
    require_feature("worker_extension_cls", features, purpose="the rlhfkit weight-sync worker extension")
    kwargs: dict[str, Any] = dict(
        model=config.model, tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization, seed=config.seed + engine_index,
        enable_prefix_caching=config.enable_prefix_caching, enforce_eager=config.enforce_eager, dtype=config.dtype,
        worker_extension_cls=config.worker_extension_cls,
    )
    if config.enable_sleep_mode:
        require_feature("sleep_mode", features, purpose="VLLMEngineConfig.enable_sleep_mode=True")
        kwargs["enable_sleep_mode"] = True
    if features.logprobs_modes:
        if config.logprobs_mode not in features.logprobs_modes:
            raise VLLMFeatureError(f"the installed vLLM {features.version} accepts logprobs_mode in "
                                   f"{features.logprobs_modes}, not {config.logprobs_mode!r}")
        kwargs["logprobs_mode"] = config.logprobs_mode
    elif config.logprobs_mode == "processed_logprobs":
        require_feature("logprobs_mode", features, purpose="logprobs_mode='processed_logprobs'")
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
        if getattr(config, name) is not None:
            kwargs[name] = getattr(config, name)
    if (config.max_num_seqs is not None and not config.enforce_eager and features.cudagraph_capture_cap
            and "compilation_config" not in dict(config.extra_kwargs)):
        kwargs["compilation_config"] = {"max_cudagraph_capture_size": min(config.max_num_seqs, 512)}
    if config.enable_lora:
        require_feature("lora", features, purpose="VLLMEngineConfig.enable_lora=True")
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank_slot(config.max_lora_rank, features.lora_ranks),
                      max_loras=config.max_loras, max_cpu_loras=config.max_loras + 1)
    if distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = distributed_executor_backend
    kwargs.update(dict(config.extra_kwargs))
    return kwargs


