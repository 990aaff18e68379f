"""Will a hybrid run fit? The plan's memory estimate (:func:`rlhfkit.placement.estimate_memory`) for a
:class:`~rlhfkit.hybrid.HybridConfig` and its trainer roles, checked before Ray or any actor starts.

Phases follow the hybrid engine: ``generating`` (the engines awake), ``training`` (the actor; ``training_critic``),
``forward_<role>`` (reference, reward); a role with ``TrainerConfig.offload=False`` holds its states in every phase.
Counts come from the model's config built on the meta device (no weights read). Activations are a first-order
guess from the micro-batch token budget (layer inputs kept by gradient checkpointing, or every layer's working set
without it, plus float32 logits): the estimate is a floor, so a run it refuses cannot fit, and one it passes may
still run out of memory. An engine share (vLLM, SGLang) that the engine's weights fill, leaving no KV cache, is
refused by the same estimate (:meth:`rlhfkit.placement.MemoryEstimate.check_fit`). Needs transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ModelShape", "estimate_hybrid_memory", "model_shape"]

_GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know of a model: parameter count and the dimensions activations scale with."""

    num_params: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int


def model_shape(path: str, *, model: torch.nn.Module | None = None) -> ModelShape:
    """The :class:`ModelShape` of the HF model saved at ``path``: ``model``, its meta-device build
    (:func:`rlhfkit.lora.meta_model`: config only, no weights), is built here when not given."""
    if model is None:
        from rlhfkit.lora import meta_model

        model = meta_model(path)
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    return ModelShape(num_params=sum(p.numel() for p in model.parameters()), hidden_size=hidden,
                      intermediate_size=int(getattr(text, "intermediate_size", 4 * hidden) or 4 * hidden),
                      num_layers=int(text.num_hidden_layers), vocab_size=int(text.vocab_size))


def _activation_gib(shape: ModelShape, *, tokens: int, bytes_per_value: int, trains: bool, checkpointing: bool) -> float:
    """First-order activation floor of one micro-batch of ``tokens`` tokens."""
    layer = tokens * (6 * shape.hidden_size + 3 * shape.intermediate_size) * bytes_per_value  # one layer's working set
    if not trains:
        kept = layer
    elif checkpointing:
        kept = shape.num_layers * tokens * shape.hidden_size * bytes_per_value + layer
    else:
        kept = shape.num_layers * layer
    logits = tokens * shape.vocab_size * 4  # float32 logits of the log-prob pass
    return (kept + logits) / _GIB


def _trainer_memory(shape: ModelShape, trainer: Any, role: str) -> Any:
    from rlhfkit.lora import LoraConfig
    from rlhfkit.placement import ModelMemory

    ds = trainer.deepspeed
    trains = role in ("actor", "critic")
    trainable = None
    if trainer.lora is not None and isinstance(trainer.lora, LoraConfig):
        # adapters on targeted square-ish projections: 2 * r * (in + out) per module, bounded above by this count
        trainable = min(shape.num_params, shape.num_layers * len(trainer.lora.target_modules) * trainer.lora.rank
                        * (shape.hidden_size + shape.intermediate_size) * 2)
    bytes_per_value = 2 if ds.bf16 else 4
    activations = _activation_gib(shape, tokens=trainer.micro_batch_tokens, bytes_per_value=bytes_per_value,
                                  trains=trains, checkpointing=ds.gradient_checkpointing)
    return ModelMemory(num_params=shape.num_params, kind="trainable" if trains else "frozen",
                       bytes_per_param=bytes_per_value, grad_bytes_per_param=bytes_per_value,
                       optimizer_bytes_per_param=12.0 if ds.bf16 else 8.0, zero_stage=ds.zero_stage,
                       activation_gib=activations, num_trainable_params=trainable,
                       offload_optimizer=ds.offload_optimizer and trains, offload_params=ds.offload_params)


def estimate_hybrid_memory(config: Any, trainers: Mapping[str, Any], *, plan: Any, gpu_memory_gib: float,
                           meta_model: Callable[[str], torch.nn.Module] | None = None) -> Any:
    """The per-GPU, per-phase :class:`~rlhfkit.placement.MemoryEstimate` of a hybrid run (see the module docs);
    ``meta_model``: path -> the model built on the meta device (default :func:`rlhfkit.lora.meta_model`), called
    once per distinct path."""
    from rlhfkit.lora import meta_model as build_meta_model
    from rlhfkit.placement import MemoryConfig, ModelMemory, estimate_memory

    build = meta_model or build_meta_model
    paths = dict.fromkeys([trainer.model or config.model for trainer in trainers.values()] + [config.model])
    shapes = {path: model_shape(path, model=build(path)) for path in paths}
    models = {role: _trainer_memory(shapes[trainer.model or config.model], trainer, role)
              for role, trainer in trainers.items()}
    engine_shape = shapes[config.model]
    dtype_bytes = 2 if config.engine_dtype == "bfloat16" else 4
    engine_gib = engine_shape.num_params * dtype_bytes / _GIB if config.engine == "hf" else None
    models["rollout"] = ModelMemory(num_params=engine_shape.num_params, kind="engine", bytes_per_param=dtype_bytes,
                                    engine_gib=engine_gib)
    resident = tuple(role for role, trainer in trainers.items() if not trainer.offload)
    names = {"actor": "training", "critic": "training_critic"}
    phases = {"generating": ("rollout", *resident)}
    for role in trainers:
        phases[names.get(role, f"forward_{role}")] = tuple(dict.fromkeys((role, *resident)))
    return estimate_memory(plan, models, MemoryConfig(gpu_memory_gib=gpu_memory_gib,
                                                      engine_memory_fraction=config.engine_memory_fraction,
                                                      phases=phases))
