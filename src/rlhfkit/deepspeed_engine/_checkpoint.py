"""Checkpoints, HF export and the gathered named-parameter stream of :mod:`rlhfkit.deepspeed_engine`.

- :func:`iter_named_parameters`: ``(hf_name, tensor)`` for every parameter; under ZeRO-3 the shards are gathered a
  bucket at a time (``deepspeed.zero.GatheredParameters``), so the extra memory is one bucket; a parameter whose
  partition group is one rank is its own partition (:func:`whole_partition`) and is not gathered.
- :func:`export_hf`: the same stream written as ``save_pretrained``-compatible safetensors shards + config, by rank 0,
  holding at most one shard in host memory.
- :func:`save_checkpoint` / :func:`load_checkpoint`: DeepSpeed state (+ optional HF export) in one atomic
  ``step-N`` directory of :mod:`rlhfkit.checkpoint` (complete marker last, then an atomic rename), written by all
  ranks into the directory rank 0 created. Needs a file system shared by all ranks.

Internal to :mod:`rlhfkit.deepspeed_engine`; needs deepspeed, transformers' config objects and safetensors.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rlhfkit._optional import require
from rlhfkit.checkpoint import COMPLETE_MARKER, atomic_directory, checkpoint_name

__all__ = ["iter_named_parameters", "whole_partition", "export_hf", "save_checkpoint", "load_checkpoint",
           "DEEPSPEED_TAG"]

logger = logging.getLogger(__name__)
DEEPSPEED_TAG = "deepspeed"
HF_SUBDIR = "hf"
# Wrappers that insert a component into parameter names (torch.compile, activation checkpointing, FSDP).
_WRAPPER_COMPONENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """Strip wrapper components anywhere in a dotted parameter name and DDP-style leading ``module.``."""
    for component in _WRAPPER_COMPONENTS:
        name = name.replace(component, "")
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _buckets(named: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int, zero3: bool):
    bucket: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, param in named:
        numel = param.ds_numel if zero3 and hasattr(param, "ds_numel") else param.numel()
        nbytes = numel * param.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, param))
        size += nbytes
    if bucket:
        yield bucket


def iter_named_parameters(module: torch.nn.Module, *, zero3: bool, bucket_bytes: int, dtype: torch.dtype | None,
                          exclude: Callable[[str], bool] = lambda name: False,
                          rename: Callable[[str], str | None] = hf_name) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for each parameter of ``module`` (tied parameters once).

    Under ZeRO-3 this is a collective (every rank must iterate it to the end) and each tensor is only valid until
    the next one is requested: copy what you keep. ``dtype`` casts (None keeps the parameter dtype). ``rename``
    maps a parameter name to the name it is yielded under (None: not yielded; e.g. only LoRA adapters).
    """
    named = [(rename(name), param) for name, param in module.named_parameters()]
    named = [(name, param) for name, param in named if name is not None and not exclude(name)]
    if not zero3:
        for name, param in named:
            data = param.detach()
            yield name, data if dtype is None or data.dtype == dtype else data.to(dtype)
        return
    deepspeed = require("deepspeed", user="rlhfkit.deepspeed_engine")
    device_type = require("deepspeed.accelerator", user="rlhfkit.deepspeed_engine").get_accelerator().device_name()
    for bucket in _buckets(named, bucket_bytes, zero3):
        wholes = [whole_partition(param, device_type) for _, param in bucket]
        gather = [param for (_, param), whole in zip(bucket, wholes) if whole is None]
        with deepspeed.zero.GatheredParameters(gather, modifier_rank=None) if gather else contextlib.nullcontext():
            for (name, param), whole in zip(bucket, wholes):
                data = param.data if whole is None else whole
                yield name, data if dtype is None or data.dtype == dtype else data.to(dtype)


def whole_partition(param: torch.nn.Parameter, device_type: str) -> torch.Tensor | None:
    """The value of a ZeRO-3 parameter as a view of its own partition, when that partition is the whole tensor on
    the compute device: a partition group of one rank (ZeRO-3 on one GPU), so a gather would only copy it. None when
    it must be gathered: partitioned over several ranks, or the partition is in host memory or on NVMe."""
    partition = getattr(param, "ds_tensor", None)
    numel = getattr(param, "ds_numel", None)
    if partition is None or numel is None or partition.device.type != device_type or partition.numel() < numel:
        return None
    group = getattr(param, "ds_process_group", None)
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group=group) != 1:
        return None
    return partition.data.view(-1)[:numel].view(param.ds_shape)


def _hf_config(module: torch.nn.Module, dtype: torch.dtype | None):
    config = copy.deepcopy(module.config)
    config.architectures = [getattr(module, "architecture", type(module).__name__)]
    if dtype is not None:  # the dtype the weights were written in, so from_pretrained(dtype="auto") keeps it
        config.dtype = dtype
    return config


def export_hf(stream: Iterator[tuple[str, torch.Tensor]], module: torch.nn.Module, directory: str | Path, *,
              rank: int, max_shard_bytes: int = 5 * 1024**3, tokenizer=None) -> None:
    """Write ``stream`` as HF safetensors (sharded beyond ``max_shard_bytes``) plus config on rank 0.

    Every rank must call this (the stream may be a collective); only rank 0 writes.
    """
    safetensors_torch = require("safetensors.torch", user="rlhfkit.deepspeed_engine")
    directory = Path(directory)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_files, weight_map, total = 0, [], {}, 0
    dtype = None

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = directory / f".shard-{len(shard_files)}.safetensors"
        safetensors_torch.save_file(shard, str(name), metadata={"format": "pt"})
        shard_files.append((name, list(shard)))
        shard, shard_bytes = {}, 0

    for name, tensor in stream:
        if rank != 0:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        dtype = dtype or (tensor.dtype if tensor.is_floating_point() else None)
        shard_bytes += nbytes
        total += nbytes
    if rank != 0:
        return
    if shard or not shard_files:
        flush()
    count = len(shard_files)
    for index, (tmp_name, names) in enumerate(shard_files):
        final = "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        os.replace(tmp_name, directory / final)
        weight_map.update({name: final for name in names})
    if count > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2, sort_keys=True))
    _hf_config(module, dtype).save_pretrained(str(directory))
    generation_config = getattr(module, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(directory))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


@contextlib.contextmanager
def _without_offload_buffers(ds_engine) -> Iterator[None]:
    """Hide the ``*_offload_buffer`` host copies DeepSpeed's ZeRO-3 offload keeps in the Adam state: saved, they
    would double the optimizer checkpoint and, loaded back, land on the GPU (torch moves state to the param device)."""
    optimizer = getattr(ds_engine.optimizer, "optimizer", ds_engine.optimizer)
    removed = []
    for state in getattr(optimizer, "state", {}).values():
        for key in [key for key in state if isinstance(key, str) and key.endswith("_offload_buffer")]:
            removed.append((state, key, state.pop(key)))
    try:
        yield
    finally:
        for state, key, value in removed:
            state[key] = value


def save_checkpoint(ds_engine, root: str | Path, *, step: int, hf_export: Callable[[Path], None] | None,
                    client_state: dict[str, Any]) -> Path:
    """Write ``root/step-<step>`` atomically on all ranks; returns its path. See the module docstring."""
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = Path(root) / checkpoint_name(step)

    def write(tmp: Path) -> None:
        with _without_offload_buffers(ds_engine):
            ds_engine.save_checkpoint(str(tmp), tag=DEEPSPEED_TAG, client_state=client_state, save_latest=False)
        if hf_export is not None:
            hf_dir = tmp / HF_SUBDIR
            if rank == 0:
                hf_dir.mkdir(exist_ok=True)
            hf_export(hf_dir)
        if dist.is_initialized():
            dist.barrier()

    if rank == 0:
        with atomic_directory(path) as tmp:
            _broadcast_path(tmp, rank)
            write(tmp)
    else:
        write(_broadcast_path(None, rank))
    if dist.is_initialized():
        dist.barrier()
    logger.info("saved checkpoint %s", path)
    return path


def _broadcast_path(path: Path | None, rank: int) -> Path:
    dist = torch.distributed
    if not dist.is_initialized():
        assert path is not None
        return path
    holder = [str(path) if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def load_checkpoint(ds_engine, path: str | Path, *, load_optimizer_states: bool = True) -> dict[str, Any]:
    """Load DeepSpeed state saved by :func:`save_checkpoint`; returns its ``client_state``."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).exists():
        raise ValueError(f"checkpoint path={str(path)!r} is incomplete or not a checkpoint (no {COMPLETE_MARKER} "
                         "marker); pass a directory returned by save_checkpoint() or latest_checkpoint()")
    load_path, client_state = ds_engine.load_checkpoint(
        str(path), tag=DEEPSPEED_TAG, load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_optimizer_states)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no state under {path / DEEPSPEED_TAG}")
    return client_state or {}
