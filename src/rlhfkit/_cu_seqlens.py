"""Validation shared by :mod:`rlhfkit.packing` and :mod:`rlhfkit.losses` (torch only)."""

from __future__ import annotations

import torch

__all__ = ["check_cu_seqlens", "token_shape_hint", "check_logprob_values", "CONVENTION", "LOGPROB_TOLERANCE"]

# Log-probs are <= 0; rounding in a float32 log_softmax can give a hair above 0, never more than this.
LOGPROB_TOLERANCE = 1e-3


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


CONVENTION = ("rlhfkit aligns a token's log-prob at the token's own position: log p(token_t | tokens_<t) is stored at "
              "index t, and index 0 of each sequence is unused (0; the first token is a prompt token)")


def token_shape_hint(name: str, value: object, num_tokens: int, num_seqs: int | None = None) -> str:
    """Why ``value`` (meant to be a packed ``[T]`` per-token tensor) has the wrong shape, and how to convert it.

    Recognises the two common mistakes of people coming from HF: a padded ``[B, L]`` (or shifted ``[B, L - 1]``)
    tensor, and HF-style shifted log-probs one entry shorter per sequence (``T - N`` entries). "" when neither fits.
    """
    shape = tuple(getattr(value, "shape", ()))
    if len(shape) == 2:
        return (f" {name} looks like a padded [B, L] batch {shape}; rlhfkit takes packed [T] tensors (all sequences "
                "end to end) with cu_seqlens [N + 1]. Flatten with rlhfkit.packing.pack_padded(input_ids, "
                "attention_mask, prompt_lengths=..., logprobs=...) -> (PackedBatch, packed log-probs), or "
                "rlhfkit.packing.unpad_to_packed(x, seq_lens, side=...) for any other per-token tensor; a [B, L - 1] "
                f"tensor of HF-style shifted log-probs is accepted by pack_padded's logprobs= ({CONVENTION}).")
    if len(shape) == 1 and num_seqs is not None and shape[0] == num_tokens - num_seqs:
        return (f" {name} has {num_tokens} - {num_seqs} entries, one fewer per sequence: HF-style shifted log-probs "
                f"(entry j = log p(token j+1)). {CONVENTION}. Insert a 0 at each sequence start, e.g. "
                "torch.cat([torch.cat([x.new_zeros(1), s]) for s in x.split((seq_lens - 1).tolist())]), or let "
                "rlhfkit compute them (rlhfkit.losses.packed_logprobs / model_logprobs) or convert a padded batch "
                "with rlhfkit.packing.pack_padded(..., logprobs=...).")
    return ""


def check_logprob_values(what: str, values: torch.Tensor, *, where: str) -> None:
    """Raise when a 1-D tensor of log-probs has an entry ``> LOGPROB_TOLERANCE``; ``where`` names its owner."""
    above = values.detach() > LOGPROB_TOLERANCE
    if bool(above.any()):
        position = int(torch.nonzero(above)[0])
        raise ValueError(f"{what}[{position}]={values[position].item():.4g} > 0 ({where}); log-probs are <= 0 "
                         f"({int(above.sum())} positive entries). Pass log-probabilities (log_softmax at the sampled "
                         "token), not probabilities or logits")
