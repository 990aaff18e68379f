"""Ragged ⇄ packed token streams, micro-batch partitioning, and packed forwards of HF causal LMs.

A packed stream lays sequences end to end in one ``[T]`` tensor with ``cu_seqlens`` (``[N + 1]`` int32 boundaries),
``position_ids`` that restart at 0 at every sequence start, and a ``loss_mask``; an optional padding tail (to make
``T`` a multiple of some number) follows ``cu_seqlens[-1]``, has its own restarting position ids and is never in the
loss. This module converts between that layout and lists / padded ``[N, L]`` tensors (:func:`pack_padded` takes a
padded HF batch such as ``model.generate`` output, log-probs included; :func:`unpack_to_padded` gives one back), selects
sequences, splits
sequences into balanced micro-batches by token budget (:func:`partition_by_token_budget`), computes the global
token / sequence counts that make losses invariant to data-parallel sharding (:func:`global_counts`), and runs a
HF causal LM on a packed batch with sequence boundaries respected (:func:`packed_logits`).

:func:`register_varlen_attention` adds an attention implementation to transformers that computes only each packed
sequence's own causal block (plain ``scaled_dot_product_attention`` per sequence): the fast exact path on CPU, where
flash-attention does not exist and the dense block-diagonal mask wastes most of the attention work.

It does not compute log-probs or losses (see :mod:`rlhfkit.losses`) and does not move data between processes except
for the optional all-reduce in :func:`global_counts`. It needs only torch; :func:`packed_logits` takes a model object
(the model brings transformers) and :func:`register_varlen_attention` needs ``rlhfkit[hf]``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Literal

import torch

from rlhfkit.packing._attention import PADDED_INDEX_KWARG, VARLEN_ATTENTION, padded_index, register_varlen_attention
from rlhfkit._cu_seqlens import check_cu_seqlens, host_copy, repeat_counts, segment_ids
from rlhfkit.packing._padded import pack_padded, unpack_to_padded
from rlhfkit.packing._partition import global_counts, partition_by_token_budget
from rlhfkit.types import PackedBatch, Rollout

__all__ = [
    "pack_sequences",
    "pack_rollouts",
    "pack_padded",
    "unpack_to_padded",
    "unpack",
    "pad_packed",
    "unpad_to_packed",
    "select_sequences",
    "partition_by_token_budget",
    "global_counts",
    "packed_logits",
    "packed_inputs",
    "register_varlen_attention",
    "VARLEN_ATTENTION",
]

logger = logging.getLogger(__name__)

Side = Literal["right", "left"]

# Attention implementations of transformers that keep packed sequences apart when given restarting position_ids,
# attention_mask=None and no cache: eager/sdpa/flex build a block-diagonal mask (transformers'
# find_packed_sequence_indices); flash-attention and rlhfkit's varlen sdpa take the boundaries as cu_seq_lens.
# tests/test_packing.py checks eager, sdpa and the varlen sdpa on CPU against separate runs.
PACKED_ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                                    VARLEN_ATTENTION)
_VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", VARLEN_ATTENTION)
# a packed row this long under a dense-mask attention (eager, sdpa, flex) builds a T x T mask of >= 256M entries
DENSE_MASK_WARN_TOKENS = 16384


def _check_multiple(pad_to_multiple_of: int) -> None:
    if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r}; must be an int >= 1 (1 = no padding)")


def _check_side(side: str) -> None:
    if side not in ("right", "left"):
        raise ValueError(f"side={side!r}; expected 'right' or 'left'")


def _restarting_positions(lengths: torch.Tensor) -> torch.Tensor:
    """``[sum(lengths)]`` int64 positions 0..len-1 for each length, vectorised."""
    total = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total, device=lengths.device) - repeat_counts(starts, lengths, total=total)


def pack_sequences(
    sequences: Sequence[torch.Tensor],
    *,
    loss_masks: Sequence[torch.Tensor] | None = None,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Lay ``sequences`` end to end in one :class:`~rlhfkit.types.PackedBatch`.

    Args:
        sequences: N non-empty ``[L_i]`` integer tensors (token ids), all on one device.
        loss_masks: N ``[L_i]`` bool tensors, or None for an all-False loss mask. Must be False on each first token.
        pad_to_multiple_of: pad the stream with a tail of ``pad_token_id`` so ``T`` is a multiple of this; the tail
            gets position ids restarting at 0 and is outside every sequence and the loss.
        pad_token_id: token id of the padding tail.
    """
    _check_multiple(pad_to_multiple_of)
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id={pad_token_id!r}; must be a token id >= 0 (the padding tail goes through the "
                         "model's embedding), e.g. the tokenizer's pad_token_id")
    if isinstance(sequences, torch.Tensor) or len(sequences) == 0:
        raise ValueError("sequences must be a non-empty list of 1-D token tensors (an empty batch is invalid)")
    for i, seq in enumerate(sequences):
        if not isinstance(seq, torch.Tensor) or seq.ndim != 1 or seq.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"sequences[{i}] must be a 1-D int64/int32 tensor, got "
                             f"{getattr(seq, 'shape', type(seq).__name__)} {getattr(seq, 'dtype', '')}")
        if seq.numel() == 0:
            raise ValueError(f"sequences[{i}] is empty; every sequence needs at least one token")
    if loss_masks is not None:
        if len(loss_masks) != len(sequences):
            raise ValueError(f"loss_masks has {len(loss_masks)} entries but sequences has {len(sequences)}")
        for i, (mask, seq) in enumerate(zip(loss_masks, sequences)):
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != seq.shape:
                raise ValueError(f"loss_masks[{i}] must be a bool tensor of shape {tuple(seq.shape)} like "
                                 f"sequences[{i}], got {getattr(mask, 'shape', type(mask).__name__)} "
                                 f"{getattr(mask, 'dtype', '')}")
            if bool(mask[0]):
                raise ValueError(f"loss_masks[{i}][0] is True; the first token of a sequence has no log-prob, so it "
                                 "cannot be in the loss")
    device = sequences[0].device
    lengths = torch.tensor([int(s.numel()) for s in sequences], dtype=torch.long, device=device)
    num_real = int(lengths.sum())
    num_padding = (-num_real) % pad_to_multiple_of
    input_ids = torch.cat([s.long() for s in sequences] + [torch.full((num_padding,), pad_token_id,
                                                                      dtype=torch.long, device=device)])
    position_ids = _restarting_positions(torch.cat([lengths, lengths.new_tensor([num_padding])]))
    if loss_masks is None:
        loss_mask = torch.zeros(num_real + num_padding, dtype=torch.bool, device=device)
    else:
        loss_mask = torch.cat(list(loss_masks) + [torch.zeros(num_padding, dtype=torch.bool, device=device)])
    cu_seqlens = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
    return PackedBatch(input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, loss_mask=loss_mask)


def pack_rollouts(rollouts: Sequence[Rollout], *, pad_to_multiple_of: int = 1, pad_token_id: int = 0) -> PackedBatch:
    """Pack each rollout as ``prompt + response``; the loss mask is True exactly on the response tokens the engine
    sampled (``Rollout.loss_mask``: all of them, unless ``response_loss_mask`` marks inserted observation tokens)."""
    if isinstance(rollouts, Rollout) or len(rollouts) == 0:
        raise ValueError("rollouts must be a non-empty list of Rollout (an empty batch is invalid)")
    sequences, masks = [], []
    for i, rollout in enumerate(rollouts):
        if not isinstance(rollout, Rollout):
            raise TypeError(f"rollouts[{i}] must be a rlhfkit.types.Rollout, got {type(rollout).__name__}")
        prompt, response = rollout.prompt_token_ids, rollout.response_token_ids.to(rollout.prompt_token_ids.device)
        sequences.append(torch.cat([prompt.long(), response.long()]))
        masks.append(torch.cat([torch.zeros(prompt.numel(), dtype=torch.bool, device=prompt.device),
                                rollout.loss_mask.to(prompt.device)]))
    return pack_sequences(sequences, loss_masks=masks, pad_to_multiple_of=pad_to_multiple_of,
                          pad_token_id=pad_token_id)


def unpack(values: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split ``values`` (``[T, ...]``) into the N per-sequence slices ``[L_i, ...]`` (views; padding dropped)."""
    if not isinstance(values, torch.Tensor) or values.ndim < 1:
        raise ValueError(f"values must be a tensor of shape [T, ...], got {getattr(values, 'shape', type(values))}")
    cu = check_cu_seqlens(cu_seqlens, values.shape[0]).tolist()
    return [values[start:end] for start, end in zip(cu[:-1], cu[1:])]


def _pad_index(cu: torch.Tensor, *, side: Side) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row and column of every real token of a packed stream in the padded ``[N, max_len]`` layout."""
    lengths = cu[1:] - cu[:-1]
    max_len = int(lengths.max())
    rows = segment_ids(cu)
    cols = _restarting_positions(lengths)
    if side == "left":
        cols = cols + (max_len - lengths)[rows]
    return rows, cols, max_len


def pad_packed(values: torch.Tensor, cu_seqlens: torch.Tensor, *, padding_value: float = 0,
               side: Side = "right") -> torch.Tensor:
    """Scatter a packed ``[T, ...]`` tensor into a padded ``[N, max_len, ...]`` one (differentiable).

    The padding tail after ``cu_seqlens[-1]`` is dropped. ``side="left"`` right-aligns each sequence.
    """
    _check_side(side)
    if not isinstance(values, torch.Tensor) or values.ndim < 1:
        raise ValueError(f"values must be a tensor of shape [T, ...], got {getattr(values, 'shape', type(values))}")
    cu = check_cu_seqlens(cu_seqlens, values.shape[0]).to(values.device)
    rows, cols, max_len = _pad_index(cu, side=side)
    out = values.new_full((cu.numel() - 1, max_len, *values.shape[1:]), padding_value)
    out = out.index_put((rows, cols), values[: int(cu[-1])])
    return out


def unpad_to_packed(padded: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor, *,
                    side: Side = "right") -> torch.Tensor:
    """Gather the real tokens of a padded ``[N, L, ...]`` tensor into a packed ``[sum(seq_lens), ...]`` one.

    ``seq_lens`` gives each row's length; with ``side="left"`` the tokens are the last ``seq_lens[i]`` of row ``i``.
    """
    _check_side(side)
    if not isinstance(padded, torch.Tensor) or padded.ndim < 2:
        raise ValueError(f"padded must be a tensor of shape [N, L, ...], got {getattr(padded, 'shape', padded)}")
    lengths = torch.as_tensor(seq_lens, dtype=torch.long, device=padded.device)
    if lengths.ndim != 1 or lengths.numel() != padded.shape[0]:
        raise ValueError(f"seq_lens has {lengths.numel()} entries but padded has {padded.shape[0]} rows; give one "
                         "length per row")
    if bool((lengths <= 0).any()) or int(lengths.max()) > padded.shape[1]:
        raise ValueError(f"seq_lens={lengths.tolist()} must be in [1, {padded.shape[1]}] (the padded width)")
    cu = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    rows, cols, max_len = _pad_index(cu, side=side)
    if side == "left":
        cols = cols + (padded.shape[1] - max_len)
    return padded[rows, cols]


def select_sequences(batch: PackedBatch, indices: Sequence[int] | torch.Tensor) -> tuple[PackedBatch, torch.Tensor]:
    """Keep the sequences ``indices`` (in that order, each at most once) of ``batch``.

    Returns the new batch (no padding tail) and the ``[T']`` int64 index of its tokens in the original stream, so
    per-token tensors follow with ``x[index]``.
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a PackedBatch, got {type(batch).__name__}")
    device = batch.input_ids.device
    idx = torch.as_tensor(indices, dtype=torch.long, device=device)
    if idx.ndim != 1 or idx.numel() == 0:
        raise ValueError(f"indices must be a non-empty 1-D list of sequence indices, got shape {tuple(idx.shape)}")
    if bool(((idx < 0) | (idx >= batch.num_seqs)).any()):
        raise ValueError(f"indices={idx.tolist()} must be in [0, {batch.num_seqs}) (the batch's sequences)")
    if torch.unique(idx).numel() != idx.numel():
        seen: set[int] = set()
        duplicate = next(i for i in idx.tolist() if i in seen or seen.add(i))
        raise ValueError(f"indices={idx.tolist()} name sequence {duplicate} more than once; each sequence may be "
                         "selected once (a duplicate would count its tokens twice in the loss)")
    cu = batch.cu_seqlens.long()
    lengths = (cu[1:] - cu[:-1])[idx]
    token_index = repeat_counts(cu[:-1][idx], lengths) + _restarting_positions(lengths)
    new_cu = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
    selected = PackedBatch(input_ids=batch.input_ids[token_index], position_ids=batch.position_ids[token_index],
                           cu_seqlens=new_cu, loss_mask=batch.loss_mask[token_index])
    return selected, token_index


def _varlen_kwargs(batch: PackedBatch) -> dict:
    """flash-attention style boundaries covering all T rows (the padding tail is a segment of its own)."""
    cu = batch.cu_seqlens.to(torch.int32)
    padding = batch.num_padding_tokens
    if padding:
        cu = torch.cat([cu, cu.new_tensor([batch.num_tokens])])
    host = host_copy(batch.cu_seqlens)  # the longest segment from the host copy when there is one (no device wait)
    max_length = max(int((host[1:] - host[:-1]).max()), padding) if host is not None else int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_length, "max_length_k": max_length}


def packed_inputs(model: torch.nn.Module, batch: PackedBatch) -> dict:
    """The keyword arguments that run a HF model (or a module forwarding them to one) on a packed batch.

    ``input_ids``/``position_ids`` as one ``[1, T]`` row with positions restarting per sequence,
    ``attention_mask=None`` and ``use_cache=False``. Then transformers builds a block-diagonal causal mask from the
    position ids (eager, sdpa, flex_attention: exact, but attention costs ``T^2`` for the whole row), while
    flash-attention and :data:`VARLEN_ATTENTION` (see :func:`register_varlen_attention`) also get the boundaries
    (``cu_seq_lens_q/k``, ``max_length_q/k``) and only compute each sequence's own block. With an all-ones mask or a
    cache the sequences would silently attend to each other, so neither is ever passed. An attention implementation
    outside :data:`PACKED_ATTENTION_IMPLEMENTATIONS` is refused.
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a PackedBatch, got {type(batch).__name__}")
    # A DeepSpeed engine's own ``config`` is DeepSpeed's; the HF config lives on the wrapped ``module``.
    configs = (getattr(getattr(model, "module", None), "config", None), getattr(model, "config", None))
    attn = next((a for a in (getattr(c, "_attn_implementation", None) for c in configs) if a is not None), None)
    if attn is not None and attn not in PACKED_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"model uses attn_implementation={attn!r}, which is not known to respect packed sequence "
                         f"boundaries; load it with one of {PACKED_ATTENTION_IMPLEMENTATIONS}")
    if attn not in _VARLEN_IMPLEMENTATIONS and batch.num_tokens >= DENSE_MASK_WARN_TOKENS:
        warnings.warn(f"a packed batch of {batch.num_tokens} tokens under attn_implementation={attn!r}: transformers "
                      f"builds a dense {batch.num_tokens} x {batch.num_tokens} mask and attends across it (memory and "
                      "time grow with T^2; this ran an 80 GB GPU out of memory at 51k tokens). Load the model with "
                      "attn_implementation=rlhfkit.packing.register_varlen_attention() (or flash-attention), or pass "
                      "smaller micro-batches (rlhfkit.packing.partition_by_token_budget)", UserWarning,
                      stacklevel=3)
    extra = _varlen_kwargs(batch) if attn in _VARLEN_IMPLEMENTATIONS else {}
    if attn == VARLEN_ATTENTION:  # each token's place in the padded batch, once per forward instead of per layer
        extra[PADDED_INDEX_KWARG] = padded_index(extra["cu_seq_lens_q"], batch.num_tokens)
    return {"input_ids": batch.input_ids[None], "position_ids": batch.position_ids[None], "attention_mask": None,
            "use_cache": False, **extra}


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the HF model (inside a DeepSpeed engine: its ``module``) accepts ``logits_to_keep``."""
    import inspect

    target = getattr(model, "module", model)
    try:
        return "logits_to_keep" in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        return False


def packed_logits(model: torch.nn.Module, batch: PackedBatch, *, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Run a HF causal LM on a packed batch; returns ``[T, V]`` logits, each sequence attending only to itself
    (the model gets :func:`packed_inputs`).

    ``rows``: ``[K]`` int64 positions; only their logits are returned (``[K, V]``). Models that take transformers'
    ``logits_to_keep`` get the positions there, so the LM head (and everything after it) runs on ``K`` rows, not
    ``T``; other models compute every row and the result is indexed."""
    inputs = packed_inputs(model, batch)
    if rows is not None:
        if not isinstance(rows, torch.Tensor) or rows.ndim != 1 or rows.dtype != torch.int64:
            raise ValueError(f"rows must be a [K] int64 tensor of positions, got {getattr(rows, 'shape', rows)!r}")
        if _takes_logits_to_keep(model):
            inputs["logits_to_keep"] = rows.to(batch.input_ids.device)
    output = model(**inputs)
    logits = output.logits if hasattr(output, "logits") else output[0]
    # squeeze, not [0]: select's backward would allocate a zero [1, T, V] tensor, squeeze's is a free view
    logits = logits.squeeze(0)
    if rows is not None and logits.shape[0] != rows.shape[0]:  # the model computed every row (K < T always)
        logits = logits[rows.to(logits.device)]
    return logits
