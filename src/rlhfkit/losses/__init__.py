"""Token log-probs, PPO-family policy losses, value loss, KL loss and DP-invariant aggregation on packed streams.

What it does:
  - memory-bounded token log-probs and entropy from ``[T, V]`` logits (:func:`token_logprobs`,
    :func:`packed_logprobs`, :func:`model_logprobs`, :func:`entropy_from_logits`): rows are processed in float32
    chunks in forward *and* backward, so no float32 copy of the ``[T, V]`` logits is ever made;
  - the clipped PPO policy loss (Schulman et al. 2017, arXiv:1707.06347) with asymmetric clip ranges (“clip-higher”,
    DAPO, Yu et al. 2025, arXiv:2503.14476), dual clip for negative advantages (Ye et al. 2020, arXiv:1912.09729),
    a sequence-level ratio (GSPO, Zheng et al. 2025, arXiv:2507.18071), and rollout-engine/trainer mismatch
    correction with the engine's log-probs: truncated importance sampling (Yao et al. 2025, “Your efficient RL
    framework secretly brings you off-policy RL training”) or token / sequence masking of outlying ratios;
  - those off-policy corrections as pure functions (:func:`importance_weights`, :func:`mismatch_stats`: token,
    sequence and geometric-mean levels, truncation or masking; ``_offpolicy.py``), which ``policy_loss`` calls;
  - the (optionally clipped) value loss of PPO2, a KL loss with the k1/k2/k3 estimators of
    :func:`rlhfkit.advantages.kl_estimate`;
  - aggregation (:func:`aggregate`) by token mean, sequence mean of token means (GRPO) or sequence mean of token sums
    (Dr.GRPO), normalised by *global* counts so micro-batches and data-parallel ranks sum to the whole-batch gradient.

Every loss returns ``(scalar tensor, stats)`` with stats as plain Python floats (computed on this batch only, not
all-reduced). It does not compute advantages (:mod:`rlhfkit.advantages`), run optimisers, or talk to other processes.
Per-token inputs are ``[T]`` token-aligned with a :class:`~rlhfkit.types.PackedBatch` (entry ``t`` is about token
``input_ids[t]``); ``mask`` is the ``[T]`` bool loss mask and ``cu_seqlens`` the ``[N + 1]`` boundaries. Torch only.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from rlhfkit._cu_seqlens import attach_host_copy, cu_end, host_copy
from rlhfkit.advantages import kl_estimate
from rlhfkit.losses._aggregate import (
    AGGREGATIONS,
    Aggregation,
    aggregate,
    check_token_inputs,
    masked_mean,
    masked_stats,
    reduce_tokens,
    seq_mean_per_token,
)
from rlhfkit.losses._logprobs import check_logits, entropy_from_logits, token_logprobs
from rlhfkit.losses._offpolicy import (
    MAX_LOG_RATIO,
    clamped_log_ratio,
    importance_weights,
    mismatch_stats,
    token_mismatch_specs,
    weights_from_log_ratio,
)
from rlhfkit.packing import packed_logits
from rlhfkit.types import PackedBatch

__all__ = [
    "MAX_LOG_RATIO",
    "Aggregation",
    "aggregate",
    "entropy_from_logits",
    "importance_weights",
    "kl_loss",
    "mismatch_stats",
    "model_logprobs",
    "packed_logprobs",
    "policy_loss",
    "shift_to_tokens",
    "token_logprobs",
    "value_loss",
]

RatioLevel = Literal["token", "sequence"]
Mismatch = Literal["none", "tis", "token_mask", "seq_mask"]
_MISMATCH = ("none", "tis", "token_mask", "seq_mask")
# policy_loss's mismatch options as importance_weights' (level, mode); the threshold C gives [1/C, C].
_MISMATCH_WEIGHTS = {"tis": ("token", "truncate"), "token_mask": ("token", "mask"), "seq_mask": ("geometric", "mask")}
_LOGPROB_NAMES = ("engine_logprobs",)  # the engine's own log-probs: a wrong field (probabilities) is a common slip


def shift_to_tokens(per_row: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Token-align a per-position output of a packed forward: ``[T]`` → ``[T]``, entry ``t`` = ``per_row[t - 1]``.

    Row ``t`` of a causal LM's output predicts (or values the state before) token ``t + 1``; after the shift entry
    ``t`` is about token ``t``, like every per-token tensor of rlhfkit. 0 at sequence starts and on the padding tail.
    Use it for critic values (``shift_to_tokens(value_head_output[:, 0], batch)``) or any per-row statistic.
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a PackedBatch, got {type(batch).__name__}")
    if not isinstance(per_row, torch.Tensor) or per_row.ndim != 1 or per_row.shape[0] != batch.num_tokens:
        raise ValueError(f"per_row must be a [T] tensor with T={batch.num_tokens} (the batch's tokens), got "
                         f"{getattr(per_row, 'shape', type(per_row).__name__)}")
    out = torch.cat([per_row.new_zeros(1), per_row[:-1]])
    valid = torch.ones_like(batch.loss_mask)
    valid[batch.cu_seqlens[:-1].long()] = False
    valid[cu_end(batch.cu_seqlens):] = False
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))




def packed_logprobs(logits: torch.Tensor, batch: PackedBatch, *, temperature: float = 1.0,
                    chunk_size: int | None = None, inplace_backward: bool = False) -> torch.Tensor:
    """Token-aligned log-probs of a packed stream: entry ``t`` is ``log p(input_ids[t] | its sequence before t)``.

    Args:
        logits: ``[T, V]`` logits of the packed forward (row ``t`` predicts token ``t + 1``).
        batch: the packed batch the logits came from.
        temperature, chunk_size, inplace_backward: as in :func:`token_logprobs`.

    Returns:
        ``[T]`` float32; 0 at each sequence's first token and on the padding tail.
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a PackedBatch, got {type(batch).__name__}")
    check_logits(logits, temperature)
    if logits.shape[0] != batch.num_tokens:
        raise ValueError(f"logits has {logits.shape[0]} rows but batch has {batch.num_tokens} tokens; they must match")
    # Labels are the next token of every row (the last row's label is a dummy). Running on all T rows, not
    # logits[:-1], keeps the gradient free of a slice-backward copy of the whole [T, V] tensor.
    labels = torch.roll(batch.input_ids, -1)
    labels[-1] = 0
    shifted = token_logprobs(logits, labels, temperature=temperature, chunk_size=chunk_size,
                             inplace_backward=inplace_backward)
    return shift_to_tokens(shifted, batch)


def model_logprobs(model: torch.nn.Module, batch: PackedBatch, *, temperature: float = 1.0,
                   chunk_size: int | None = None, return_entropy: bool = False, loss_tokens_only: bool = False
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`rlhfkit.packing.packed_logits` then :func:`packed_logprobs`: ``[T]`` float32 log-probs of a model.

    The logits never leave this function, so their backward writes the gradient into the logits' own memory
    (``inplace_backward``): the peak is the model's logits plus one float32 chunk. With ``return_entropy=True`` it
    returns ``(logprobs, entropy)``, entropy ``[T]`` token aligned like the log-probs (the entropy of the
    distribution that predicted token ``t``; 0 at sequence starts and padding) — the gradient then needs its own
    buffer.

    ``loss_tokens_only=True``: log-probs (and entropy) only of the tokens in ``batch.loss_mask`` (the responses), 0
    elsewhere — what every rlhfkit loss and estimator reads. The LM head, the softmax and their backward then run
    on those rows only (through transformers' ``logits_to_keep``; see :func:`rlhfkit.packing.packed_logits`):
    with a 49k vocabulary and prompts as long as the responses, about a tenth of a small model's forward and
    backward.
    """
    if loss_tokens_only:
        return _loss_token_logprobs(model, batch, temperature, chunk_size, return_entropy)
    logits = packed_logits(model, batch)
    logprobs = packed_logprobs(logits, batch, temperature=temperature, chunk_size=chunk_size,
                               inplace_backward=not return_entropy)
    if not return_entropy:
        return logprobs
    entropy = entropy_from_logits(logits, temperature=temperature, chunk_size=chunk_size)
    return logprobs, shift_to_tokens(entropy, batch)


def _loss_token_logprobs(model, batch: PackedBatch, temperature: float, chunk_size: int | None,
                         return_entropy: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a PackedBatch, got {type(batch).__name__}")
    device = batch.input_ids.device
    host_mask, host_ids = host_copy(batch.loss_mask), host_copy(batch.input_ids)
    if host_mask is not None and host_ids is not None:  # the positions and labels from the host: no device wait
        host_tokens = torch.nonzero(host_mask).squeeze(1)  # never a sequence's first token (PackedBatch checks it)
        tokens = host_tokens.to(device, non_blocking=True)
        labels = attach_host_copy(batch.input_ids[tokens], host_ids[host_tokens])
    else:
        tokens = torch.nonzero(batch.loss_mask).squeeze(1)
        labels = batch.input_ids[tokens]
    logits = packed_logits(model, batch, rows=tokens - 1)  # row t - 1 predicts token t
    values = token_logprobs(logits, labels, temperature=temperature, chunk_size=chunk_size,
                            inplace_backward=not return_entropy)
    logprobs = values.new_zeros(batch.num_tokens).index_copy(0, tokens, values)
    if not return_entropy:
        return logprobs
    entropy = entropy_from_logits(logits, temperature=temperature, chunk_size=chunk_size)
    return logprobs, entropy.new_zeros(batch.num_tokens).index_copy(0, tokens, entropy)


def _check_policy_scalars(clip_low, clip_high, dual_clip, ratio_level, mismatch, mismatch_threshold,
                          engine_logprobs, aggregation) -> None:
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low={clip_low!r}; must be in [0, 1) (the ratio is clipped below at 1 - clip_low)")
    if not 0 <= clip_high < math.inf:
        raise ValueError(f"clip_high={clip_high!r}; must be a finite number >= 0")
    if dual_clip is not None and not 1 < dual_clip < math.inf:
        raise ValueError(f"dual_clip={dual_clip!r}; must be a finite number > 1 (Ye et al. use 3), or None")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level={ratio_level!r}; expected 'token' or 'sequence' (GSPO)")
    if mismatch not in _MISMATCH:
        raise ValueError(f"mismatch={mismatch!r}; expected one of {_MISMATCH}")
    if mismatch != "none" and engine_logprobs is None:
        raise ValueError(f"mismatch={mismatch!r} needs engine_logprobs (the rollout engine's [T] log-probs)")
    if not 1 < mismatch_threshold < math.inf:
        raise ValueError(f"mismatch_threshold={mismatch_threshold!r}; must be a finite number > 1")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {AGGREGATIONS}")


def _magnitude(tensor: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest ``|tensor|`` on loss tokens (0 with none); used only to explain an overflow, so the sync is fine."""
    if not mask.any():
        return 0.0
    return float(torch.where(mask, tensor.detach().abs(), torch.zeros_like(tensor.detach())).max())


def _check_loss(name: str, stats: dict[str, float], dtype: torch.dtype, causes: str, fix: str) -> dict[str, float]:
    """Raise when a loss came out inf/NaN although its inputs were finite: an overflow inside the loss itself.

    The inputs are checked on loss tokens before anything is computed; this checks the *result*, so a finite but huge
    input (e.g. advantages of 1e38) cannot silently produce a ``-inf`` loss and a NaN update.
    """
    if math.isfinite(stats["loss"]):
        return stats
    raise ValueError(f"{name} is {stats['loss']} although its inputs are finite: the loss overflowed "
                     f"{dtype} (largest finite {torch.finfo(dtype).max:.3g}); {causes}. {fix}")


def _policy_ratio(logprobs, old_logprobs, mask, cu, ratio_level):
    """Returns ``(log_ratio used by the loss, token log-ratio)``, both ``[T]`` and clamped to ±MAX_LOG_RATIO."""
    token_log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if ratio_level == "token":
        return token_log_ratio, token_log_ratio
    # GSPO-token (Zheng et al. 2025, eq. 13): value = the sequence's geometric-mean ratio s_i, gradient
    # s_i * grad log pi(y_t). With a sequence-level advantage and seq_mean_token_mean this is exactly GSPO.
    seq_log_ratio = seq_mean_per_token(logprobs - old_logprobs, mask, cu).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return seq_log_ratio + (logprobs - logprobs.detach()), token_log_ratio


def _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip):
    """Per-token PPO loss ``max(-A r, -A clip(r))``, dual-clipped at ``-A c`` for ``A < 0``; and its stat specs."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {"clip_fraction": ("mean", clipped > unclipped)}
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual_active, cap, per_token)
        stats["dual_clip_fraction"] = ("mean", dual_active)
    return per_token, stats


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: RatioLevel = "token",
    engine_logprobs: torch.Tensor | None = None,
    mismatch: Mismatch = "none",
    mismatch_threshold: float = 2.0,
    aggregation: Aggregation = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` per token, then aggregated.

    Args:
        logprobs: ``[T]`` current policy log-probs (differentiable). old_logprobs: ``[T]`` the trainer's log-probs
            of the policy that generated the data. advantages: ``[T]``. Old log-probs, advantages and engine log-probs
            are treated as constants (detached).
        mask, cu_seqlens: ``[T]`` bool loss mask, ``[N + 1]`` boundaries.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]`` (DAPO raises clip_high).
        dual_clip: ``c > 1``: for negative advantages the loss is also capped at ``-A * c`` (Ye et al. 2020).
        ratio_level: ``"token"`` (PPO) or ``"sequence"`` (GSPO: every token of a sequence uses the geometric mean of
            its token ratios; pair it with ``aggregation="seq_mean_token_mean"`` and much smaller clip ranges).
        engine_logprobs: ``[T]`` the rollout engine's log-probs of the same tokens (e.g. vLLM's), for ``mismatch``
            and the mismatch stats.
        mismatch: with ``w = exp(old_logprobs - engine_logprobs)`` and ``C = mismatch_threshold``: ``"tis"``
            multiplies each token's loss by ``min(w, C)``; ``"token_mask"`` drops tokens with ``w`` outside
            ``[1/C, C]``; ``"seq_mask"`` drops sequences whose geometric-mean ``w`` is outside ``[1/C, C]``. Dropped
            tokens still count in the normalisers, so the result stays DP invariant. These are
            :func:`importance_weights` with ``target_logprobs=old_logprobs``, ``behaviour_logprobs=engine_logprobs``
            and ``(level, mode)`` = ``("token", "truncate")``, ``("token", "mask")``, ``("geometric", "mask")``,
            ``high=C`` (and ``low=1/C`` for the masks); for other combinations multiply ``advantages`` by the weights
            yourself (``mismatch="none"``).
        aggregation, num_tokens, num_seqs: see :func:`aggregate`.

    Returns:
        ``(loss, stats)``: stats ``loss``, ``clip_fraction`` (tokens where the clipped term is active),
        ``dual_clip_fraction``, ``approx_kl`` (k3 estimate of KL(old || new)), ``ratio_mean/min/max``, with engine
        log-probs ``mismatch_kl`` (k3 of KL(engine || old)), ``mismatch_ratio_mean/min/max``,
        ``mismatch_affected_fraction`` (truncated or dropped tokens), and ``num_loss_tokens``. Means over this
        batch's loss tokens; NaN when it has none.
    """
    _check_policy_scalars(clip_low, clip_high, dual_clip, ratio_level, mismatch, mismatch_threshold,
                          engine_logprobs, aggregation)
    cu = check_token_inputs(mask, cu_seqlens, logprob_names=_LOGPROB_NAMES, logprobs=logprobs,
                            old_logprobs=old_logprobs, advantages=advantages,
                            engine_logprobs=engine_logprobs)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    logprobs = torch.where(mask, logprobs.to(dtype), zero)
    old = torch.where(mask, old_logprobs.detach().to(dtype), zero)
    adv = torch.where(mask, advantages.detach().to(dtype), zero)
    log_ratio, token_log_ratio = _policy_ratio(logprobs, old, mask, cu, ratio_level)
    ratio = torch.exp(log_ratio)
    per_token, stats = _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    if engine_logprobs is not None:
        engine = torch.where(mask, engine_logprobs.detach().to(dtype), zero)
        engine_log_ratio = clamped_log_ratio(old, engine, mask)
        affected = torch.zeros_like(mask)
        if mismatch != "none":
            level, mode = _MISMATCH_WEIGHTS[mismatch]
            low = None if mode == "truncate" else 1 / mismatch_threshold
            weights, affected = weights_from_log_ratio(engine_log_ratio, mask, cu, level=level, mode=mode, low=low,
                                                       high=mismatch_threshold)
            per_token = per_token * weights
        specs = token_mismatch_specs(engine_log_ratio)
        stats.update({f"mismatch_{name}": specs[name] for name in ("kl", "ratio_mean", "ratio_min", "ratio_max")})
        stats.update(mismatch_affected_fraction=("mean", affected))
    loss = reduce_tokens(per_token, mask, cu, mode=aggregation, num_tokens=num_tokens, num_seqs=num_seqs)
    token_ratio = torch.exp(token_log_ratio)
    stats.update(approx_kl=("mean", token_ratio - 1 - token_log_ratio), ratio_mean=("mean", ratio),
                 ratio_min=("min", ratio), ratio_max=("max", ratio))
    result = masked_stats(mask, loss=("value", loss), **stats)
    if math.isfinite(result["loss"]):
        return loss, result
    causes = (f"the per-token loss -A * ratio, or its sum, is too large: max |advantages| on loss tokens = "
              f"{_magnitude(adv, mask):.3g}, ratio max = {result['ratio_max']:.3g}")
    if engine_logprobs is not None and mismatch != "none":
        causes += f", mismatch weight max = {_magnitude(weights, mask):.3g}"
    fix = ("Normalise or clip the advantages (e.g. rlhfkit.advantages.whiten; check the reward scale), or pass "
           "float64 tensors")
    return loss, _check_loss("policy_loss", result, dtype, causes, fix)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cu_seqlens: torch.Tensor, *, clip: float | None = None, aggregation: Aggregation = "token_mean",
               num_tokens: float | None = None, num_seqs: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic loss ``0.5 (V - R)^2``; with ``clip`` the PPO2 form ``0.5 max((V - R)^2, (V_clip - R)^2)`` where
    ``V_clip = V_old + clamp(V - V_old, -clip, clip)``.

    Args:
        values: ``[T]`` current critic values (differentiable). old_values: ``[T]`` values at rollout time.
        returns: ``[T]`` targets. Old values and returns are constants. mask, cu_seqlens, aggregation, num_tokens,
            num_seqs: as in :func:`policy_loss`.

    Returns:
        ``(loss, stats)``: ``loss``, ``value_clip_fraction`` (tokens where the clipped error is larger),
        ``values_mean``, ``returns_mean``, ``explained_variance`` (1 - Var(R - V) / Var(R) over loss tokens),
        ``num_loss_tokens``.
    """
    if clip is not None and not 0 < clip < math.inf:
        raise ValueError(f"clip={clip!r}; must be a finite number > 0, or None for the unclipped loss")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {AGGREGATIONS}")
    cu = check_token_inputs(mask, cu_seqlens, values=values, old_values=old_values, returns=returns)
    dtype = torch.promote_types(values.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    values = torch.where(mask, values.to(dtype), zero)
    old = torch.where(mask, old_values.detach().to(dtype), zero)
    target = torch.where(mask, returns.detach().to(dtype), zero)
    error = (values - target).square()
    clipped_active = torch.zeros_like(mask)
    if clip is not None:
        clipped_error = (old + (values - old).clamp(-clip, clip) - target).square()
        clipped_active = clipped_error > error
        error = torch.maximum(error, clipped_error)
    loss = reduce_tokens(0.5 * error, mask, cu, mode=aggregation, num_tokens=num_tokens, num_seqs=num_seqs)
    residual = target - values.detach()
    variance = masked_mean((target - masked_mean(target, mask)).square(), mask)
    residual_variance = masked_mean((residual - masked_mean(residual, mask)).square(), mask)
    explained = 1 - residual_variance / variance.clamp(min=1e-12)
    result = masked_stats(mask, loss=("value", loss), value_clip_fraction=("mean", clipped_active),
                    values_mean=("mean", values), returns_mean=("mean", target),
                    explained_variance=("value", explained))
    if math.isfinite(result["loss"]):
        return loss, result
    causes = (f"the squared error 0.5 (V - R)^2, or its sum, is too large: max |values| = "
              f"{_magnitude(values, mask):.3g}, max |returns| = {_magnitude(target, mask):.3g}, max |old_values| = "
              f"{_magnitude(old, mask):.3g} on loss tokens")
    fix = "Scale the rewards/returns down (or normalise them), check the critic's output head, or pass float64 tensors"
    return loss, _check_loss("value_loss", result, dtype, causes, fix)


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, *,
            estimator: Literal["k1", "k2", "k3"] = "k3", clamp: float | None = 10.0,
            aggregation: Aggregation = "token_mean", num_tokens: float | None = None,
            num_seqs: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """KL(pi || pi_ref) as a loss term (GRPO, Shao et al. 2024 use k3), per token by
    :func:`rlhfkit.advantages.kl_estimate`, aggregated like :func:`policy_loss`.

    Args:
        logprobs: ``[T]`` current policy log-probs (differentiable). ref_logprobs: ``[T]`` reference log-probs
            (constant). estimator, clamp: passed to ``kl_estimate``. The rest as in :func:`policy_loss`.

    Returns:
        ``(loss, stats)``: ``loss``, ``kl_mean``, ``kl_max`` (of the estimate over loss tokens), ``num_loss_tokens``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {AGGREGATIONS}")
    cu = check_token_inputs(mask, cu_seqlens, logprob_names=_LOGPROB_NAMES, logprobs=logprobs,
                            ref_logprobs=ref_logprobs)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    logprobs = torch.where(mask, logprobs.to(dtype), zero)
    ref = torch.where(mask, ref_logprobs.detach().to(dtype), zero)
    kl = kl_estimate(logprobs, ref, estimator=estimator, clamp=clamp)
    loss = reduce_tokens(kl, mask, cu, mode=aggregation, num_tokens=num_tokens, num_seqs=num_seqs)
    result = masked_stats(mask, loss=("value", loss), kl_mean=("mean", kl), kl_max=("max", kl))
    if math.isfinite(result["loss"]):
        return loss, result
    gap = _magnitude(logprobs - ref, mask)
    causes = (f"the per-token {estimator} estimate, or its sum, is too large: max |logprobs - ref_logprobs| on loss "
              f"tokens = {gap:.3g}, clamp={clamp!r}")
    fix = ("Keep a clamp on the log-ratio (clamp=10.0, the default) or check that ref_logprobs come from the same "
           "tokens and temperature as logprobs")
    return loss, _check_loss("kl_loss", result, dtype, causes, fix)
