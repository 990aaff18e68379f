"""Worker side of a trained role's export: a folder that ``transformers.AutoModelForCausalLM.from_pretrained`` and
``vllm serve`` load.

- Full-parameter models: :meth:`rlhfkit.deepspeed_engine.DeepSpeedEngine.export_hf` (ZeRO-3 shards gathered a
  bucket at a time with ``deepspeed.zero.GatheredParameters``; rank 0 writes safetensors, ``config.json`` and
  ``generation_config.json``).
- LoRA actors: the same export of the peft model, read back on rank 0 and written twice: a peft adapter folder in
  ``<path>/adapter`` (``adapter_config.json`` + ``adapter_model.safetensors``, names as peft saves them) and the
  merged model in ``<path>`` itself, each targeted weight ``W0 + (alpha / r) * B @ A`` computed in float32 as peft's
  ``merge_and_unload`` does (Hu et al., 2021, arXiv:2106.09685).
- Either way the tokenizer files (and ``generation_config.json``) are copied from the model's source folder, or
  saved from its tokenizer when the source is a hub id.

What it does not do: make the write atomic (:meth:`rlhfkit.hybrid.TrainerGroup.export` writes into an
:func:`rlhfkit.checkpoint.atomic_directory`), or export critics' value heads for serving. Runs inside a
:class:`~rlhfkit.hybrid._trainer_worker.TrainerWorker`; needs deepspeed, transformers, safetensors (peft for LoRA).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch

from rlhfkit._optional import require

__all__ = ["ADAPTER_SUBDIR", "copy_tokenizer", "export_model", "merge_lora"]

ADAPTER_SUBDIR = "adapter"
_PREFIX = "base_model.model."
_BASE_LAYER = ".base_layer."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


def copy_tokenizer(source: str, directory: Path) -> None:
    """The tokenizer files (and ``generation_config.json``) of ``source``: copied from its folder, or saved from its
    tokenizer when it is a hub id."""
    folder = Path(source)
    if folder.is_dir():
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copy2(folder / name, directory / name)
        return
    transformers = require("transformers", user="rlhfkit.hybrid export")
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(str(directory))


def merge_lora(tensors: dict[str, torch.Tensor], *, scaling: float) -> dict[str, torch.Tensor]:
    """The plain model's weights from a peft model's named parameters (``base_model.model.<module>.base_layer.weight``
    and its ``lora_A``/``lora_B``): ``W0 + scaling * B @ A`` in float32, cast back to ``W0``'s dtype; every other
    parameter renamed only. ``scaling`` is ``alpha / r``."""
    from rlhfkit.lora import adapter_name

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        saved = adapter_name(name)
        if saved is not None:
            module, _, part = saved.removeprefix(_PREFIX).rpartition(".lora_")
            pairs.setdefault(module, {})[part.split(".")[0]] = tensor
    merged = {}
    for name, tensor in tensors.items():
        if adapter_name(name) is not None:
            continue
        plain = name.removeprefix(_PREFIX)
        module, base, leaf = plain.partition(_BASE_LAYER)
        if not base:
            merged[plain] = tensor
            continue
        if leaf == "weight" and module in pairs:
            lora_a, lora_b = pairs[module]["A"].float(), pairs[module]["B"].float()
            tensor = (tensor.float() + scaling * lora_b @ lora_a).to(tensor.dtype)
        merged[f"{module}.{leaf}"] = tensor
    return merged


def _write_merged(merged: dict[str, torch.Tensor], base: torch.nn.Module, directory: Path) -> None:
    """``merged`` as ``model.safetensors`` with ``base``'s config (its architecture, the weights' dtype) and
    generation config."""
    safetensors_torch = require("safetensors.torch", user="rlhfkit.hybrid export")
    safetensors_torch.save_file({name: tensor.contiguous() for name, tensor in merged.items()},
                                str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(base.config)
    config.architectures = [type(base).__name__]
    config.dtype = next(tensor.dtype for tensor in merged.values() if tensor.is_floating_point())
    config.save_pretrained(str(directory))
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(str(directory))


def _export_lora(model: Any, directory: Path, *, source: str) -> None:
    """The peft model's parameters through :meth:`DeepSpeedEngine.export_hf` (gathered; rank 0 writes them to a
    staging folder), read back on rank 0 and written as the adapter folder and the merged model."""
    from rlhfkit.lora import adapter_name

    staging = directory / ".peft-parameters"
    model.export_hf(staging)  # collective
    if model.rank != 0:
        return
    safetensors_torch = require("safetensors.torch", user="rlhfkit.hybrid export")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(staging.glob("*.safetensors")):
        tensors |= safetensors_torch.load_file(str(shard))
    shutil.rmtree(staging)
    adapter_dir = directory / ADAPTER_SUBDIR
    adapter_dir.mkdir(parents=True, exist_ok=True)
    adapter = {adapter_name(name): tensor.contiguous() for name, tensor in tensors.items() if adapter_name(name)}
    safetensors_torch.save_file(adapter, str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config = copy.deepcopy(next(iter(model.module.peft_config.values())))
    peft_config.base_model_name_or_path = source
    peft_config.save_pretrained(str(adapter_dir))
    merged = merge_lora(tensors, scaling=model.lora.alpha / model.lora.rank)
    del tensors
    _write_merged(merged, model.module.get_base_model(), directory)


def export_model(model: Any, directory: str | Path, *, source: str) -> None:
    """Write ``model`` (a :class:`rlhfkit.deepspeed_engine.DeepSpeedEngine`, awake) as an HF folder in ``directory``
    (LoRA: merged, with the peft adapter in ``directory/adapter``), tokenizer files copied from ``source``.
    Collective: every rank calls it; rank 0 writes."""
    directory = Path(directory)
    if model.lora is None:
        model.export_hf(directory)
    else:
        _export_lora(model, directory, source=source)
    if model.rank == 0:
        copy_tokenizer(source, directory)
