"""Padded HF batches ⇄ packed streams: :func:`pack_padded` and :func:`unpack_to_padded` (torch only).

People arrive with what ``model.generate`` gives: ``[B, L]`` rows of left-padded prompts followed by right-padded
responses, an ``attention_mask``, and log-probs either per generated token (``[B, R]``, e.g. from
``compute_transition_scores``) or HF-style shifted from a forward (``[B, L - 1]``, entry ``j`` = log p(token
``j + 1``)).
rlhfkit's convention differs: a token's log-prob is stored at the token's *own* position of a packed ``[T]`` stream
(index 0 of each sequence unused). These two functions convert both ways.
"""

from __future__ import annotations

import torch

from rlhfkit._cu_seqlens import CONVENTION, LOGPROB_TOLERANCE, check_cu_seqlens
from rlhfkit.types import PackedBatch, PaddedBatch

__all__ = ["pack_padded", "unpack_to_padded"]


def _check_2d(name: str, value: object, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.ndim != 2:
        raise ValueError(f"{name} must be a padded [B, L] tensor, got {getattr(value, 'shape', type(value).__name__)}")
    if shape is not None and tuple(value.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)} but input_ids has {shape}; they must match")
    return value


def _real_spans(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, length)`` of each row's real tokens; they must be one contiguous run (left and/or right padding)."""
    real = attention_mask.bool()
    lengths = real.sum(1)
    if bool((lengths == 0).any()):
        row = int(torch.nonzero(lengths == 0)[0])
        raise ValueError(f"attention_mask row {row} has no real token; drop empty rows before packing")
    columns = torch.arange(real.shape[1], device=real.device).expand_as(real)
    start = torch.where(real, columns, real.shape[1]).min(1).values
    end = torch.where(real, columns, -1).max(1).values + 1
    holes = end - start != lengths
    if bool(holes.any()):
        row = int(torch.nonzero(holes)[0])
        raise ValueError(f"attention_mask row {row} has padding between real tokens (columns {int(start[row])}.."
                         f"{int(end[row]) - 1} hold {int(lengths[row])} real tokens); only left and right padding "
                         "can be packed")
    return start, lengths


def _response_columns(shape: tuple[int, int], prompt_length: int | None, response_mask: torch.Tensor | None,
                      device: torch.device) -> torch.Tensor:
    if prompt_length is not None and response_mask is not None:
        raise ValueError("give prompt_length or response_mask, not both")
    if response_mask is not None:
        _check_2d("response_mask", response_mask, shape)
        if response_mask.dtype != torch.bool:
            raise ValueError(f"response_mask must be bool, got {response_mask.dtype}; use response_mask.bool()")
        return response_mask.to(device)
    columns = torch.zeros(shape, dtype=torch.bool, device=device)
    if prompt_length is not None:
        if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or not 1 <= prompt_length <= shape[1]:
            raise ValueError(f"prompt_length={prompt_length!r}; must be an int in [1, {shape[1]}]: the padded prompt "
                             "width, i.e. the column where responses start (inputs['input_ids'].shape[1] for "
                             "model.generate output)")
        columns[:, prompt_length:] = True
    return columns


def _aligned_logprobs(logprobs: torch.Tensor, shape: tuple[int, int], prompt_length: int | None) -> torch.Tensor:
    """``logprobs`` as ``[B, L]`` with entry ``[b, t]`` = log p(token t of row b | the tokens before it)."""
    batch, width = shape
    if not isinstance(logprobs, torch.Tensor) or logprobs.ndim != 2 or logprobs.shape[0] != batch \
            or not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a floating [B, L], [B, L - 1] or [B, L - prompt_length] tensor with "
                         f"B={batch}, L={width}; got {getattr(logprobs, 'shape', type(logprobs).__name__)} "
                         f"{getattr(logprobs, 'dtype', '')}")
    columns = logprobs.shape[1]
    if columns == width:  # already at each token's own position
        return logprobs
    if columns == width - 1:  # HF-style shifted: entry j is about token j + 1
        return torch.nn.functional.pad(logprobs, (1, 0))
    if prompt_length is not None and columns == width - prompt_length:  # one per generated token
        return torch.nn.functional.pad(logprobs, (prompt_length, 0))
    accepted = f"{width}, {width - 1}" + (f" or {width - prompt_length}" if prompt_length is not None else "")
    raise ValueError(f"logprobs has {columns} columns; expected {accepted} (token-aligned [B, L], HF-style shifted "
                     f"[B, L - 1], or one per generated token [B, L - prompt_length]). {CONVENTION}")


def pack_padded(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    prompt_length: int | None = None,
    response_mask: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
) -> tuple[PackedBatch, torch.Tensor | None]:
    """Pack a padded HF batch (``[B, L]``, left and/or right padded, e.g. ``model.generate`` output).

    Args:
        input_ids: ``[B, L]`` int token ids; padding columns (``attention_mask == 0``) are dropped.
        attention_mask: ``[B, L]``, 1 on real tokens; each row's real tokens must be contiguous.
        prompt_length: the padded prompt width — the column where responses start, the same for every row
            (``inputs["input_ids"].shape[1]`` for ``model.generate``). The loss mask is True on real tokens from
            there on.
        response_mask: ``[B, L]`` bool, instead of ``prompt_length``: True on response tokens. Neither: no loss token.
        logprobs: ``[B, L]`` token aligned (entry ``t`` = log p(token t | tokens < t)), ``[B, L - 1]`` HF-style shifted
            (from ``log_softmax(logits[:, :-1]).gather(-1, input_ids[:, 1:, None])``), or ``[B, L - prompt_length]``
            one per generated token (``model.compute_transition_scores``).
        pad_to_multiple_of, pad_token_id: as in :func:`rlhfkit.packing.pack_sequences`.

    Returns:
        ``(batch, packed_logprobs)``: row ``b`` becomes sequence ``b``; ``packed_logprobs`` is ``[T]`` token aligned
        (0 at each sequence's first token, on tokens without a given log-prob and on the padding tail), or None.
        Log-probs are checked finite and ``<= 0`` where kept.
    """
    from rlhfkit.packing import pack_sequences

    _check_2d("input_ids", input_ids)
    shape = tuple(input_ids.shape)
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be int64/int32 token ids, got {input_ids.dtype}")
    _check_2d("attention_mask", attention_mask, shape)
    start, lengths = _real_spans(attention_mask.to(input_ids.device))
    responses = _response_columns(shape, prompt_length, response_mask, input_ids.device)
    loss = responses & attention_mask.to(input_ids.device).bool()
    first_loss = loss[torch.arange(shape[0], device=loss.device), start]
    if bool(first_loss.any()):
        row = int(torch.nonzero(first_loss)[0])
        raise ValueError(f"row {row}: its first real token (column {int(start[row])}) is a response token; a sequence "
                         f"needs at least one prompt token, as the first token has no log-prob ({CONVENTION})")
    spans = list(zip(start.tolist(), lengths.tolist()))
    sequences = [input_ids[b, s : s + n] for b, (s, n) in enumerate(spans)]
    masks = [loss[b, s : s + n] for b, (s, n) in enumerate(spans)]
    batch = pack_sequences(sequences, loss_masks=masks, pad_to_multiple_of=pad_to_multiple_of,
                           pad_token_id=pad_token_id)
    if logprobs is None:
        return batch, None
    aligned = _aligned_logprobs(logprobs, shape, prompt_length).to(input_ids.device)
    known = attention_mask.to(input_ids.device).bool().clone()
    known[torch.arange(shape[0], device=known.device), start] = False  # the first token has no log-prob
    if logprobs.shape[1] not in (shape[1], shape[1] - 1):  # one per generated token: nothing before the responses
        known[:, : shape[1] - logprobs.shape[1]] = False
    values = torch.where(known, aligned, torch.zeros((), dtype=aligned.dtype, device=aligned.device))
    _check_kept(values, known)
    packed = torch.zeros(batch.num_tokens, dtype=aligned.dtype, device=aligned.device)
    packed[: int(batch.cu_seqlens[-1])] = torch.cat([values[b, s : s + n] for b, (s, n) in enumerate(spans)])
    return batch, packed


def _check_kept(values: torch.Tensor, known: torch.Tensor) -> None:
    bad = known & (~torch.isfinite(values) | (values > LOGPROB_TOLERANCE))
    if bool(bad.any()):
        row, column = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"logprobs at row {row}, token column {column} is {values[row, column].item():.4g}; log-probs "
                         "of real tokens must be finite and <= 0 (pass log-probabilities, not probabilities or logits)")


def unpack_to_padded(batch: PackedBatch, *per_token: torch.Tensor, side: str = "right", pad_token_id: int = 0,
                     padding_value: float = 0.0) -> PaddedBatch:
    """A packed batch (and any ``[T]`` per-token tensors, e.g. log-probs) as padded ``[N, L_max]`` rows.

    Args:
        batch: the packed batch; its padding tail is dropped.
        per_token: ``[T]`` (or ``[T, ...]``) tensors token aligned with ``batch``; returned padded in
            ``PaddedBatch.values`` in the same order (they keep rlhfkit's alignment: entry ``[i, t]`` is about token
            ``t`` of row ``i``).
        side: ``"right"`` (padding after each sequence) or ``"left"`` (before: the layout ``generate`` expects).
        pad_token_id: the token id of padding columns. padding_value: the value of padding in ``values``.
    """
    from rlhfkit.packing import pad_packed

    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a PackedBatch, got {type(batch).__name__}")
    if side not in ("right", "left"):
        raise ValueError(f"side={side!r}; expected 'right' or 'left'")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id={pad_token_id!r}; must be a token id >= 0")
    cu = check_cu_seqlens(batch.cu_seqlens, batch.num_tokens)
    for index, values in enumerate(per_token):
        if not isinstance(values, torch.Tensor) or values.ndim < 1 or values.shape[0] != batch.num_tokens:
            raise ValueError(f"per_token[{index}] must be a [T] tensor with T={batch.num_tokens} (the batch's tokens), "
                             f"got {getattr(values, 'shape', type(values).__name__)}")
    ones = torch.ones(batch.num_tokens, dtype=torch.long, device=batch.input_ids.device)
    return PaddedBatch(
        input_ids=pad_packed(batch.input_ids, cu, padding_value=pad_token_id, side=side),
        attention_mask=pad_packed(ones, cu, padding_value=0, side=side),
        loss_mask=pad_packed(batch.loss_mask, cu, padding_value=False, side=side),
        values=tuple(pad_packed(v, cu, padding_value=padding_value, side=side) for v in per_token),
        side=side,
    )
