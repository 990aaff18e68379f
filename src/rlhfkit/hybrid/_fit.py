"""Will a hybrid run fit? The memory estimate (:func:`rlhfkit.placement.estimate_memory`) of a
:class:`~rlhfkit.hybrid.HybridConfig`, its trainer roles and a :class:`~rlhfkit.hybrid.HybridPlan` that places them,
which :func:`rlhfkit.hybrid.plan_hybrid` uses to choose the plan before anything starts.

Phases follow the hybrid engine: ``generating`` (the engines awake), ``training`` (the actor; ``training_critic``),
``forward_<role>`` (reference, reward) and, colocated, ``syncing``: the engines' wake after the weight push, the
actor still holding what it held while training (its states, and the blocks its allocator cached, which a sleep
returns only at its end, if at all) beside the awake engines. A role that stays on the GPU
(``RolePlan.offload=False``) holds its weights, gradients and optimizer states on the GPU in every phase (its
activations only in its own). Counts come from the model's config built on the meta device (no weights read).
Activations are counted from the micro-batch token budget (layer inputs kept by gradient checkpointing, or every
layer's working set without it, a compiled layer's about half of it, plus the logits of every token).

The estimate is an upper bound with a stated margin: every trainer's bytes are multiplied by
``TRAINER_RESERVE_FACTOR`` (what its caching allocator reserves over what it allocates), every process on a GPU
counts ``CONTEXT_GIB`` of CUDA context, and an engine counts what it holds outside its share (CUDA graphs). A run it
passes fits with that margin; one it refuses may still fit without it, and the refusal names the phase and the
shortfall (:func:`rlhfkit.hybrid.plan_hybrid` then tries other layouts). An engine share (vLLM,
SGLang) that the engine's weights fill, leaving no KV cache, is refused by the same estimate
(:meth:`rlhfkit.placement.MemoryEstimate.check_fit`); with a sized KV cache (``EnginePlan.kv_cache_tokens``) a
vLLM engine is counted as what it holds instead (:func:`engine_awake_gib`), else as its memory share
(``EnginePlan.memory``) of the whole GPU plus ``ENGINE_ASLEEP_GIB``. An asleep vLLM / SGLang engine keeps
``ENGINE_ASLEEP_GIB`` on its GPU; a trainer with ``empty_cache_on_sleep=False`` keeps everything it held awake (the
blocks its sleep freed stay cached; not where its sleep goes through DeepSpeed's ``offload_states``, which empties the
cache), one with ``RolePlan.keep_optimizer`` its optimizer's states, one with ``RolePlan.keep_weights`` its weights.

Host memory (with a node size): what DeepSpeed's optimizer offload keeps there (``offload_optimizer_ratio`` of the
fp32 masters, fp32 gradients and Adam moments, placed by whole sub-groups as DeepSpeed does; ZeRO-3's bf16 gradient
partitions), the pinned buffers of roles that sleep to host memory (``RolePlan.offload``), the engine's
level-1 weight backup (the start-up sleep of a colocated engine makes one, and the pinned-memory cache keeps it),
:class:`~rlhfkit.placement.MemoryConfig`'s per-process and per-node reserves, and each model's whole host copy
while it loads (roles load in the order given). Needs transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ModelShape", "engine_awake_gib", "engines_may_build_during_loads", "estimate_hybrid_memory",
           "kv_cache_bytes", "model_shape", "offloaded_fraction"]

_GIB = 1024**3
# the float32 chunk of rlhfkit.losses' log-prob pass on a GPU (its DEFAULT_CHUNK_ELEMENTS["other"]), in elements
LOGPROB_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know of a model: parameter count and the dimensions activations scale with."""

    num_params: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    param_sizes: tuple[int, ...] = ()  # element count of each parameter, in ``model.parameters()`` order
    num_kv_heads: int = 0  # key/value heads of each attention layer (0: unknown)
    head_dim: int = 0


def model_shape(path: str, *, model: torch.nn.Module | None = None) -> ModelShape:
    """The :class:`ModelShape` of the HF model saved at ``path``: ``model``, its meta-device build
    (:func:`rlhfkit.lora.meta_model`: config only, no weights), is built here when not given."""
    if model is None:
        from rlhfkit.lora import meta_model

        model = meta_model(path)
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    sizes = tuple(p.numel() for p in model.parameters())
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or (hidden // heads if heads else 0))
    return ModelShape(num_params=sum(sizes), param_sizes=sizes, hidden_size=hidden,
                      intermediate_size=int(getattr(text, "intermediate_size", 4 * hidden) or 4 * hidden),
                      num_layers=int(text.num_hidden_layers), vocab_size=int(text.vocab_size),
                      num_kv_heads=kv_heads, head_dim=head_dim)


KV_BLOCK_TOKENS = 16  # vLLM's default KV-cache block (page) size in tokens


def kv_cache_bytes(shape: ModelShape, *, tokens: int, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """Bytes of KV cache one GPU of an engine needs to hold ``tokens`` tokens (rounded up to whole 16-token blocks):
    every layer's keys and values, ``num_kv_heads / tensor_parallel_size`` heads (at least one) of ``head_dim``
    values of ``dtype_bytes``. For standard attention layers; a model whose config does not give its heads raises."""
    if not (shape.num_kv_heads > 0 and shape.head_dim > 0):
        raise ValueError(f"the model's config gives no attention heads (num_kv_heads={shape.num_kv_heads}, "
                         f"head_dim={shape.head_dim}): its KV cache size cannot be computed; set the plan's "
                         "engine.kv_cache_tokens to None")
    heads = max(1, shape.num_kv_heads // tensor_parallel_size)
    blocks = -(-tokens // KV_BLOCK_TOKENS)
    return blocks * KV_BLOCK_TOKENS * shape.num_layers * 2 * heads * shape.head_dim * dtype_bytes


def _activation_gib(shape: ModelShape, *, tokens: int, bytes_per_value: int, trains: bool, checkpointing: bool,
                    compiled: bool = False) -> float:
    """First-order activation floor of one micro-batch of ``tokens`` tokens. An eager decoder layer keeps about 10
    hidden- and 4 intermediate-sized values per token for its backward (norm inputs and outputs, q, k, v before and
    after the rotary embedding, the attention output, the residual; gate, up, their activation and product). A
    compiled layer (``DeepSpeedEngineConfig.compile_layers``) keeps about half: the partitioner of torch.compile saves
    the matmuls' inputs and recomputes the elementwise work in the backward (5 hidden- and 2 intermediate-sized).
    The logits are the model's, in its dtype, for every token of the micro-batch (an upper bound: the losses need
    only the responses'), plus one float32 chunk of the log-prob pass."""
    hidden, intermediate = (5, 2) if compiled else (10, 4)
    layer = tokens * (hidden * shape.hidden_size + intermediate * shape.intermediate_size) * bytes_per_value
    if not trains:
        kept = layer
    elif checkpointing:
        kept = shape.num_layers * tokens * shape.hidden_size * bytes_per_value + layer
    else:
        kept = shape.num_layers * layer
    chunk = min(tokens * shape.vocab_size, LOGPROB_CHUNK_ELEMENTS) * 4
    logits = tokens * shape.vocab_size * bytes_per_value + chunk
    return (kept + logits) / _GIB


def offloaded_fraction(sizes: tuple[int, ...], *, ratio: float, sub_group_elements: int, world: int = 1) -> float:
    """The share of the parameters whose optimizer DeepSpeed ZeRO-3 keeps in host memory at
    ``offload_optimizer.ratio=ratio``: each rank's partitions (``ceil(size / world)``) are cut, in order, into
    sub-groups that close once they reach ``sub_group_elements`` elements; the first ``int((1 - ratio) * n)`` of the
    ``n`` sub-groups stay on the GPU (DeepSpeed 0.19's ``_create_fp16_sub_groups`` and ``_create_fp32_partitions``).
    Whole sub-groups move, so a large embedding at the front can put far more than ``1 - ratio`` on the GPU."""
    if ratio >= 1 or not sizes:
        return 1.0 if ratio >= 1 else ratio
    groups, current = [], 0
    for size in sizes:
        current += -(-size // world)
        if current >= sub_group_elements:
            groups.append(current)
            current = 0
    if current:
        groups.append(current)
    return 1.0 - sum(groups[:int((1 - ratio) * len(groups))]) / sum(groups)


def _trainer_memory(shape: ModelShape, trainer: Any, role_plan: Any, role: str, *, world: int, device: str) -> Any:
    """One trainer role as the plan places it: ``trainer`` (its :class:`~rlhfkit.hybrid.TrainerConfig`) with
    ``role_plan`` (its :class:`~rlhfkit.hybrid.RolePlan`: ZeRO stage, optimizer share in host memory, what its
    sleeps keep on the GPU, micro-batch budget)."""
    from rlhfkit.lora import LoraConfig
    from rlhfkit.placement import ModelMemory

    ds = role_plan.deepspeed_config(trainer.deepspeed, device=device)
    trains = role in ("actor", "critic")
    trainable = None
    if trainer.lora is not None and isinstance(trainer.lora, LoraConfig):
        # adapters on targeted square-ish projections: 2 * r * (in + out) per module, bounded above by this count
        trainable = min(shape.num_params, shape.num_layers * len(trainer.lora.target_modules) * trainer.lora.rank
                        * (shape.hidden_size + shape.intermediate_size) * 2)
    bytes_per_value = 2 if ds.bf16 else 4
    activations = _activation_gib(shape, tokens=role_plan.micro_batch_tokens, bytes_per_value=bytes_per_value,
                                  trains=trains, checkpointing=ds.gradient_checkpointing,
                                  compiled=ds.compile_layers)
    ratio = ds.offload_optimizer_ratio
    if ratio < 1 and trainable is None:
        ratio = offloaded_fraction(shape.param_sizes, ratio=ratio, sub_group_elements=ds.sub_group_elements,
                                   world=world)
    optimizer_bytes = 12.0 if ds.bf16 else 8.0
    offload = role_plan.offload
    # empty_cache_on_sleep=False: asleep it holds what it held awake (its freed blocks stay cached), unless its sleep
    # goes through DeepSpeed's offload_states (a trained role that sleeps to host memory under ZeRO-1/2/3), which
    # empties the cache at its end whatever rlhfkit asks
    emptied_by_deepspeed = offload and trains and (ds.zero_stage >= 1 or ds.offload_params)
    keeps_blocks = not ds.empty_cache_on_sleep and not emptied_by_deepspeed
    kept = 0.0  # the states a sleep leaves on the GPU (RolePlan.keep_optimizer / keep_weights)
    if trains and offload and role_plan.keep_optimizer:
        on_gpu = 1.0 - ratio if ds.offload_optimizer else 1.0
        per_rank = (trainable or shape.num_params) / (world if ds.zero_stage >= 1 else 1)
        kept = on_gpu * per_rank * optimizer_bytes / 1024**3
    if trains and offload and role_plan.keep_weights and not ds.offload_params:
        kept += shape.num_params / (world if ds.zero_stage >= 3 else 1) * bytes_per_value / 1024**3
    # (their pinned host buffers are counted as if they slept: an estimate of host memory that errs high)
    return ModelMemory(num_params=shape.num_params, kind="trainable" if trains else "frozen",
                       bytes_per_param=bytes_per_value, grad_bytes_per_param=bytes_per_value,
                       optimizer_bytes_per_param=optimizer_bytes, zero_stage=ds.zero_stage,
                       activation_gib=activations, num_trainable_params=trainable,
                       offload_optimizer=ds.offload_optimizer and trains, offload_params=ds.offload_params,
                       offload_optimizer_ratio=ratio, asleep="host" if offload else "gpu",
                       asleep_gib=0.0 if keeps_blocks else kept, keeps_blocks=keeps_blocks,
                       step_group_params=max(sum(shape.param_sizes[i] for i in group)
                                             for group in ds.param_group_ranges(shape.param_sizes))
                       if trains and trainable is None and ds.zero_stage < 3 and shape.param_sizes else None)


# The upper bound's margin. Every trainer's bytes times this: its caching allocator reserves more than the estimate's
# allocations (fragmentation of the activations' and the optimizer step's blocks): the hybrid actor's reserved peak
# runs above its allocated peak, and this factor keeps the estimate above both (tests/test_hybrid_fit.py checks it
# against the peaks of layouts that ran).
TRAINER_RESERVE_FACTOR = 1.25
# CUDA context, NCCL and cuBLAS state of each process on a GPU, outside its allocator's blocks.
CONTEXT_GIB = 1.0

# GPU memory a vLLM / SGLang engine keeps while asleep besides its CUDA context: CUDA graphs and buffers outside its
# sleep pool.
ENGINE_ASLEEP_GIB = {"graphs": 1.5, "eager": 0.5}


# vLLM's working memory besides weights and KV cache, for a KV cache of a given size: its memory profile runs a
# forward of max_num_batched_tokens tokens (EnginePlan.max_num_batched_tokens, which the engines get); the sampler
# holds float32 logits and log-probs of every running sequence (max_num_seqs; unset, vLLM 0.22's LLM class takes
# 1,024 on a GPU of 70 GiB or more).
ENGINE_DEFAULT_SEQS = 1024


def _engine_workspace_gib(config: Any, engine: Any, shape: ModelShape, dtype_bytes: int) -> float:
    forward = engine.max_num_batched_tokens * (4 * shape.hidden_size + 2 * shape.intermediate_size) * dtype_bytes
    sampler = (engine.max_num_seqs or ENGINE_DEFAULT_SEQS) * shape.vocab_size * 4 * 2
    return (forward / config.tensor_parallel_size + sampler) / _GIB


def engine_awake_gib(config: Any, engine: Any, shape: ModelShape) -> float | None:
    """GiB one GPU of an awake vLLM engine holds with a sized KV cache (``EnginePlan.kv_cache_tokens``): its
    weights (``1 / tensor_parallel_size``), the KV cache, its working memory and what stays outside the sleep pool
    (CUDA graphs). None when the cache fills the engine's memory share (the share is the footprint)."""
    kv = engine.kv_cache_bytes
    if kv is None:
        return None
    dtype_bytes = _dtype_bytes(config.engine_dtype)
    weights = shape.num_params * dtype_bytes / config.tensor_parallel_size / _GIB
    outside = ENGINE_ASLEEP_GIB["eager" if config.enforce_eager else "graphs"]
    return weights + kv / _GIB + _engine_workspace_gib(config, engine, shape, dtype_bytes) + outside


def _dtype_bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def _engine_memory(config: Any, engine: Any, shape: ModelShape) -> Any:
    """The engine role: a share of the GPU (vLLM, SGLang), or what it holds (HF: its weights; vLLM with
    a sized KV cache: :func:`engine_awake_gib`); in host memory its weights whenever it may sleep at level 1
    (colocated engines are counted so: the 7B runs' host peaks were measured with it)."""
    from rlhfkit.placement import ModelMemory

    dtype_bytes = _dtype_bytes(config.engine_dtype)
    weights_gib = shape.num_params * dtype_bytes / _GIB
    backs_up = engine.sleep_level == 1 or (config.colocate and not config.overlap)
    asleep = 0.0 if config.engine == "hf" else ENGINE_ASLEEP_GIB["eager" if config.enforce_eager else "graphs"]
    sized = engine_awake_gib(config, engine, shape)
    engine_gib = weights_gib if config.engine == "hf" else (
        None if sized is None else sized * config.tensor_parallel_size)
    return ModelMemory(num_params=shape.num_params, kind="engine", bytes_per_param=dtype_bytes, engine_gib=engine_gib,
                       host_gib=weights_gib / config.tensor_parallel_size if backs_up else 0.0,
                       asleep_gib=asleep if config.colocate else 0.0)


def estimate_hybrid_memory(config: Any, trainers: Mapping[str, Any], roles: Mapping[str, Any], engine: Any, *,
                           placement: Any, shapes: Mapping[str, ModelShape], gpu_memory_gib: float,
                           host_memory_gib: float | None = None, read_ahead: bool = False,
                           log_warnings: bool = True) -> Any:
    """The per-GPU, per-phase :class:`~rlhfkit.placement.MemoryEstimate` of a hybrid run (see the module docs):
    ``trainers`` (role -> :class:`~rlhfkit.hybrid.TrainerConfig`) placed as ``roles`` (role -> ``RolePlan``) say,
    the engines as ``engine`` (an ``EnginePlan``) says, on ``placement`` (the run's
    :class:`~rlhfkit.placement.PlacementPlan`); ``shapes``: model path -> :class:`ModelShape`. Host memory per node
    when ``host_memory_gib`` is given (load phases in the order of ``trainers``; ``read_ahead``: every role has read
    its model into host memory before the first places its own, ``MemoryConfig.read_ahead``); ``log_warnings``: as
    for :func:`~rlhfkit.placement.estimate_memory`."""
    from rlhfkit.placement import MemoryConfig, estimate_memory

    models = {role: _trainer_memory(shapes[trainer.model or config.model], trainer, roles[role], role,
                                    world=len(placement.ranks(role)), device=config.device)
              for role, trainer in trainers.items()}
    models["rollout"] = _engine_memory(config, engine, shapes[config.model])
    names = {"actor": "training", "critic": "training_critic"}
    phases = {"generating": ("rollout",)}  # an asleep trainer that stays on the GPU keeps its states (asleep="gpu")
    for role in trainers:
        phases[names.get(role, f"forward_{role}")] = (role,)
    if config.colocate and "actor" in trainers:
        # the push and the engines' wake after it: the actor as it trained (its states, its cached blocks: its sleep
        # after the step runs beside or after the push), the engines awake
        phases["syncing"] = ("actor", "rollout")
    return estimate_memory(placement, models, MemoryConfig(gpu_memory_gib=gpu_memory_gib,
                                                           engine_memory_fraction=engine.memory,
                                                           context_gib=CONTEXT_GIB,
                                                           reserve_factor=TRAINER_RESERVE_FACTOR, phases=phases,
                                                           host_memory_gib=host_memory_gib,
                                                           load_order=tuple(trainers), read_ahead=read_ahead),
                           log_warnings=log_warnings)


def engines_may_build_during_loads(config: Any, engine: Any, estimate: Any) -> bool:
    """Whether colocated vLLM engines may build their models while the trainers load (no start gate): only with
    a sized KV cache (``EnginePlan.kv_cache_tokens``; vLLM then skips the memory profile that another process's
    allocations would spoil) and when every role's largest footprint in the plan's estimate (``estimate``) fits each
    GPU at once — the engines' counted as at least their memory share, which vLLM wants free at start-up."""
    if not (config.colocate and engine.kv_cache_bytes is not None) or estimate is None:
        return False
    share = engine.memory * estimate.gpu_memory_gib
    for phases in estimate.breakdown.values():
        largest: dict[str, float] = {"rollout": share}
        for roles in phases.values():
            for role, gib in roles.items():
                largest[role] = max(largest.get(role, 0.0), gib)
        if sum(largest.values()) > estimate.gpu_memory_gib:
            return False
    return True
