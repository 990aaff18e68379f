"""Validation shared by :mod:`rlhfkit.packing` and :mod:`rlhfkit.losses` (torch only)."""

from __future__ import annotations

import torch

__all__ = ["check_cu_seqlens"]


def check_cu_seqlens(cu_seqlens: object, num_tokens: int | None, *, name: str = "cu_seqlens") -> torch.Tensor:
    """Validate ``cu_seqlens`` ([N + 1] int, from 0, strictly increasing, ends <= num_tokens); return it as int64."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer torch.Tensor of sequence boundaries, got "
                        f"{type(cu_seqlens).__name__}")
    if cu_seqlens.ndim != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got shape {tuple(cu_seqlens.shape)} dtype "
                         f"{cu_seqlens.dtype}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name}={cu_seqlens.tolist()} describes no sequence; an empty batch is invalid")
    cu = cu_seqlens.long()
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0]={int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths <= 0).any()):
        bad = int(torch.nonzero(lengths <= 0)[0])
        raise ValueError(f"{name} must be strictly increasing (no empty sequences); sequence {bad} has length "
                         f"{int(lengths[bad])}")
    if num_tokens is not None and int(cu[-1]) > num_tokens:
        raise ValueError(f"{name}[-1]={int(cu[-1])} exceeds the {num_tokens} tokens of the packed stream")
    return cu
