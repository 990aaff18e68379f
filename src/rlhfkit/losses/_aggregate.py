"""Input checks and DP-invariant aggregation of per-token losses (private; use :mod:`rlhfkit.losses`). Torch only."""

from __future__ import annotations

import math
from typing import Literal

import torch

from rlhfkit._cu_seqlens import (
    CONVENTION,
    LOGPROB_TOLERANCE,
    check_cu_seqlens,
    cu_end,
    host_copy,
    repeat_counts,
    segment_ids,
    token_shape_hint,
)

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "aggregate",
    "broadcast_seq",
    "check_count",
    "check_token_inputs",
    "masked_mean",
    "masked_stats",
    "reduce_tokens",
    "segment_sum",
    "seq_mean_per_token",
]

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def check_token_inputs(mask: object, cu_seqlens: object, *, logprob_names: tuple[str, ...] = (),
                       **tensors: torch.Tensor | None) -> torch.Tensor:
    """Validate per-token float tensors, the bool loss mask and ``cu_seqlens``; return ``cu_seqlens`` as int64.

    Every tensor must be ``[T]`` floating with the mask's length, and finite wherever the mask is True; the mask is
    never True on a sequence's first token (it has no log-prob); the tensors named in ``logprob_names`` are
    log-probabilities, so ``<= LOGPROB_TOLERANCE`` on loss tokens. One device sync for all of it.
    """
    if not isinstance(mask, torch.Tensor) or mask.ndim != 1 or mask.dtype != torch.bool:
        hint = token_shape_hint("mask", mask, 0) if isinstance(mask, torch.Tensor) else ""
        raise ValueError(f"mask must be a [T] bool tensor (the loss mask), got "
                         f"{getattr(mask, 'shape', type(mask).__name__)} {getattr(mask, 'dtype', '')}.{hint}")
    num_tokens = mask.shape[0]
    cu = check_cu_seqlens(cu_seqlens, num_tokens).to(mask.device)
    num_seqs, num_real = cu.numel() - 1, cu_end(cu)
    for name, value in tensors.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.ndim != 1 or not value.is_floating_point():
            hint = token_shape_hint(name, value, num_real, num_seqs) if isinstance(value, torch.Tensor) else ""
            raise ValueError(f"{name} must be a [T] floating tensor, got "
                             f"{getattr(value, 'shape', type(value).__name__)} {getattr(value, 'dtype', '')}.{hint}")
        if value.shape[0] != num_tokens:
            raise ValueError(f"{name} has {value.shape[0]} entries but mask has {num_tokens}; per-token tensors "
                             "must share the packed stream's length (nothing is broadcast)."
                             + token_shape_hint(name, value, num_real, num_seqs))
        if value.device != mask.device:
            raise ValueError(f"{name} is on {value.device} but mask is on {mask.device}")
    present = {n: v.detach() for n, v in tensors.items() if v is not None}
    flags = [mask[num_real:].any(), mask[cu[:-1]].any()]
    flags += [~torch.isfinite(v[mask]).all() for v in present.values()]
    flags += [(v[mask] > LOGPROB_TOLERANCE).any() for n, v in present.items() if n in logprob_names]
    bad = torch.stack(flags).tolist()
    if bad[0]:
        raise ValueError(f"mask is True after cu_seqlens[-1]={num_real}; padding is never in the loss")
    if bad[1]:
        seq = int(torch.nonzero(mask[cu[:-1]])[0])
        raise ValueError(f"mask is True on the first token of sequence {seq} (packed position {int(cu[seq])}); the "
                         f"first token of a sequence is a prompt token and has no log-prob ({CONVENTION}). Set the "
                         "loss mask on response tokens only (rlhfkit.packing.pack_rollouts / pack_padded do)")
    nonfinite = [n for n, flag in zip(present, bad[2:2 + len(present)]) if flag]
    if nonfinite:
        raise ValueError(f"{', '.join(nonfinite)} contain NaN or inf on loss tokens (where mask is True); check the "
                         "forward pass that produced them")
    positive = [n for n, flag in zip([n for n in present if n in logprob_names], bad[2 + len(present):]) if flag]
    if positive:
        name = positive[0]
        token = int(torch.nonzero((present[name] > LOGPROB_TOLERANCE) & mask)[0])
        seq = int(torch.searchsorted(cu[1:], torch.tensor(token, device=cu.device), right=True))
        raise ValueError(f"{name} is {present[name][token].item():.4g} > 0 at sequence {seq}, position "
                         f"{token - int(cu[seq])} (packed position {token}); log-probs are <= 0. Pass "
                         "log-probabilities (log_softmax of the logits at the sampled token), not probabilities, logits "
                         "or rewards")
    return cu


def check_count(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}; must be a finite number > 0 (use rlhfkit.packing.global_counts), or "
                         "None to normalise by this batch alone")
    return float(value)


def segment_sum(values: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``[N]`` sums of ``values[cu[i]:cu[i+1]]`` (differentiable); entries after ``cu[-1]`` are ignored."""
    end = cu_end(cu)
    seq_ids = segment_ids(cu.to(values.device), total=end)
    return values.new_zeros(cu.numel() - 1).index_add(0, seq_ids, values[:end])


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, *,
              mode: Aggregation = "token_mean", num_tokens: float | None = None,
              num_seqs: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss over the loss tokens to a scalar.

    Modes (``m`` the mask, ``i`` a sequence, ``n_i`` its loss tokens):
      - ``token_mean``: ``sum_t m_t x_t / num_tokens``.
      - ``seq_mean_token_mean``: ``sum_i (sum_{t in i} m_t x_t / n_i) / num_seqs`` (GRPO, Shao et al. 2024).
      - ``seq_mean_token_sum``: ``sum_i sum_{t in i} m_t x_t / num_seqs`` — no length normalisation (Dr.GRPO,
        Liu et al. 2025; divide by a constant such as the max response length yourself if you want its scale).

    ``num_tokens`` / ``num_seqs`` default to this batch's own counts (tokens in the mask; sequences with at least one
    loss token). Pass the global counts of the whole batch (:func:`rlhfkit.packing.global_counts`) on every
    micro-batch and data-parallel rank: the summed gradients then equal the whole-batch gradient. A batch with no
    loss token gives a zero that still carries a graph.

    Args:
        per_token: ``[T]`` float, token aligned with the packed stream (values outside the mask are ignored, even
            NaN).
        mask: ``[T]`` bool loss mask. cu_seqlens: ``[N + 1]`` boundaries.
    """
    cu = check_token_inputs(mask, cu_seqlens, per_token=per_token)
    result = reduce_tokens(per_token, mask, cu, mode=mode, num_tokens=num_tokens, num_seqs=num_seqs)
    if not bool(torch.isfinite(result.detach())):
        # Inputs on loss tokens are finite (checked above), so only the sum can have overflowed.
        largest = float(torch.where(mask, per_token.detach().abs(), torch.zeros_like(per_token.detach())).max())
        raise ValueError(f"aggregate: the {mode} of per_token is {float(result)} although per_token is finite on loss "
                         f"tokens: the sum overflowed {result.dtype} (max |per_token| = {largest:.3g}); scale the "
                         "per-token loss down or pass float64")
    return result


def reduce_tokens(per_token: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor, *, mode: str,
                  num_tokens: float | None, num_seqs: float | None) -> torch.Tensor:
    """:func:`aggregate` on inputs already checked by :func:`check_token_inputs` (``cu`` from it)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"mode={mode!r}; expected one of {AGGREGATIONS}")
    num_tokens, num_seqs = check_count("num_tokens", num_tokens), check_count("num_seqs", num_seqs)
    dtype = torch.promote_types(per_token.dtype, torch.float32)
    values = torch.where(mask, per_token.to(dtype), torch.zeros((), dtype=dtype, device=per_token.device))
    host_mask = host_copy(mask)
    if mode == "token_mean":
        local = mask.sum()
        if num_tokens is not None:  # the check reads the host copy of the mask when there is one (no device wait)
            count = int(host_mask.sum()) if host_mask is not None else int(local)
            if num_tokens < count:
                raise ValueError(f"num_tokens={num_tokens} is less than the {count} loss tokens of this batch alone; "
                                 "pass the global count (rlhfkit.packing.global_counts)")
        denominator = num_tokens if num_tokens is not None else local.clamp(min=1).to(dtype)
        return values.sum() / denominator
    seq_totals = segment_sum(values, cu)
    seq_tokens = segment_sum(mask.to(dtype), cu)
    if mode == "seq_mean_token_mean":
        seq_totals = seq_totals / seq_tokens.clamp(min=1)
    local = (seq_tokens > 0).sum()
    if num_seqs is not None:
        host_cu = host_copy(cu)
        if host_mask is not None and host_cu is not None:
            count = int((segment_sum(host_mask.long(), host_cu.long()) > 0).sum())
        else:
            count = int(local)
        if num_seqs < count:
            raise ValueError(f"num_seqs={num_seqs} is less than the {count} sequences with loss tokens in this batch "
                             "alone; pass the global count (rlhfkit.packing.global_counts)")
    denominator = num_seqs if num_seqs is not None else local.clamp(min=1).to(dtype)
    return seq_totals.sum() / denominator


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (0 with no True entry); values outside the mask are ignored, even NaN."""
    return torch.where(mask, values, torch.zeros_like(values)).sum() / mask.sum().clamp(min=1)


def broadcast_seq(per_seq: torch.Tensor, cu: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[N]`` → ``[T]``: every token gets its sequence's value; the padding tail gets 0."""
    out = per_seq.new_zeros(num_tokens)
    end = cu_end(cu)
    out[:end] = repeat_counts(per_seq, cu[1:] - cu[:-1], total=end)
    return out


def seq_mean_per_token(values: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """``[T]`` → ``[T]``: each token gets the mean of ``values`` over its sequence's loss tokens (differentiable)."""
    masked = torch.where(mask, values, torch.zeros_like(values))
    per_seq = segment_sum(masked, cu) / segment_sum(mask.to(values.dtype), cu).clamp(min=1)
    return broadcast_seq(per_seq, cu, values.shape[0])


def masked_stats(mask: torch.Tensor, **named: tuple[str, torch.Tensor]) -> dict[str, float]:
    """Reduce masked tensors to floats with one device sync: ``name=(reduction, tensor)``.

    Reductions: ``"mean"``/``"min"``/``"max"`` of a ``[T]`` tensor over ``mask``; ``"scalar"``, a ready 0-d tensor;
    all four are NaN when ``mask`` has no True entry. ``"value"``: a 0-d tensor reported as is (a loss). Adds
    ``num_loss_tokens``.
    """
    count = mask.sum()
    values = []
    for reduction, tensor in named.values():
        tensor = tensor.detach().to(torch.float64)
        if reduction == "mean":
            values.append(masked_mean(tensor, mask))
        elif reduction == "min":
            values.append(torch.where(mask, tensor, torch.full_like(tensor, math.inf)).min())
        elif reduction == "max":
            values.append(torch.where(mask, tensor, torch.full_like(tensor, -math.inf)).max())
        else:
            assert reduction in ("value", "scalar"), reduction
            values.append(tensor.reshape(()))
    floats = torch.stack(values + [count.to(torch.float64)]).tolist()
    empty = floats[-1] == 0
    result = {}
    for (name, (reduction, _)), value in zip(named.items(), floats):
        result[name] = math.nan if empty and reduction != "value" else value
    result["num_loss_tokens"] = floats[-1]
    return result
