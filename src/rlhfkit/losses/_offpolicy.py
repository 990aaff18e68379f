"""Off-policy corrections between a behaviour policy and a target policy on packed streams (pure torch).

What it does: importance weights for tokens sampled by a *behaviour* policy (the rollout engine, e.g. vLLM) but
trained as if sampled by a *target* policy (the trainer's log-probs of the same tokens), and the statistics of their
mismatch:

  - :func:`importance_weights`: truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training") at token or sequence level, and masked importance sampling that
    drops tokens whose ratio leaves ``[low, high]`` (token masking as in IcePop, inclusionAI 2025, "Small leak can
    sink a great ship: boost RL training on MoE with IcePop") or whole sequences, by their product or geometric-mean
    ratio (MIS; Liu, Li et al. 2025, "When speed kills stability: demystifying RL collapse from the
    training-inference mismatch");
  - :func:`mismatch_stats`: the behaviour-vs-target statistics worth logging every step (k3 KL, ratio range, the
    fraction of outlying tokens, the per-sequence worst token), and, given each token's weight version
    (``Experience.weight_versions``, asynchronous rollouts), the token staleness and the KL per staleness.

The weights are constants (no gradient); multiply a per-token loss by them. :func:`rlhfkit.losses.policy_loss`'s
``mismatch=`` options call the same functions. It does not compute log-probs, losses or advantages. Torch only.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from rlhfkit._checks import version_lag
from rlhfkit._cu_seqlens import segment_ids
from rlhfkit.losses._aggregate import (
    broadcast_seq,
    check_token_inputs,
    masked_stats,
    segment_sum,
    seq_mean_per_token,
)

__all__ = [
    "MAX_LOG_RATIO",
    "WeightLevel",
    "WeightMode",
    "check_weight_options",
    "clamped_log_ratio",
    "importance_weights",
    "mismatch_stats",
    "token_mismatch_specs",
    "weights_from_log_ratio",
]

WeightLevel = Literal["token", "sequence", "geometric"]
WeightMode = Literal["truncate", "mask"]
_LEVELS = ("token", "sequence", "geometric")
_MODES = ("truncate", "mask")
# exp(20) ≈ 4.9e8: log-ratios are clamped to ±MAX_LOG_RATIO so a diverged policy gives a huge, finite ratio.
MAX_LOG_RATIO = 20.0
_LOGPROB_NAMES = ("target_logprobs", "behaviour_logprobs")


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    return float(value)


def check_weight_options(level: str, mode: str, low: float | None, high: float) -> tuple[float | None, float]:
    """Validate :func:`importance_weights`' options; return ``(low, high)`` with ``low`` defaulted to ``1 / high``."""
    if level not in _LEVELS:
        raise ValueError(f"level={level!r}; expected one of {_LEVELS}")
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r}; expected one of {_MODES}")
    high = _check_number("high", high)
    if not 1 < high < math.inf:
        raise ValueError(f"high={high!r}; must be a finite number > 1 (the ratio's upper threshold, e.g. 2.0)")
    if mode == "truncate":
        if low is not None:
            raise ValueError(f"low={low!r} applies to mode='mask' only; truncation clamps the ratio above at high "
                             "(pass low=None)")
        return None, high
    low = 1 / high if low is None else _check_number("low", low)
    if not 0 < low < 1:
        raise ValueError(f"low={low!r}; must be in (0, 1) (the ratio's lower threshold; default 1 / high)")
    return low, high


def _check_inputs(target_logprobs, behaviour_logprobs, mask, cu_seqlens) -> torch.Tensor:
    for name, value in (("target_logprobs", target_logprobs), ("behaviour_logprobs", behaviour_logprobs)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a [T] floating torch.Tensor of log-probs, got {type(value).__name__}")
    return check_token_inputs(mask, cu_seqlens, logprob_names=_LOGPROB_NAMES, target_logprobs=target_logprobs,
                              behaviour_logprobs=behaviour_logprobs)


def clamped_log_ratio(target: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[T]`` ``log(target / behaviour)`` on loss tokens, clamped to ±MAX_LOG_RATIO; exactly 0 elsewhere (no NaN)."""
    zero = torch.zeros((), dtype=target.dtype, device=target.device)
    return torch.where(mask, target - behaviour, zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor, level: str) -> torch.Tensor:
    """The log-ratio each token is judged by: its own, its sequence's sum, or its sequence's mean (``[T]``)."""
    if level == "token":
        return log_ratio
    if level == "geometric":
        return seq_mean_per_token(log_ratio, mask, cu)  # a mean of clamped values: already within ±MAX_LOG_RATIO
    per_seq = segment_sum(log_ratio, cu).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return broadcast_seq(per_seq, cu, log_ratio.shape[0])


def weights_from_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor, *, level: str, mode: str,
                           low: float | None, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`importance_weights` from a :func:`clamped_log_ratio` and checked options: ``(weights, affected)``."""
    ratio = torch.exp(_level_log_ratio(log_ratio, mask, cu, level))
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    if mode == "truncate":
        affected = (ratio > high) & mask
        return torch.where(mask, ratio.clamp(max=high), one), affected
    affected = ((ratio > high) | (ratio < low)) & mask
    return (~affected).to(ratio.dtype), affected


def importance_weights(target_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                       cu_seqlens: torch.Tensor, *, level: WeightLevel = "token", mode: WeightMode = "truncate",
                       low: float | None = None, high: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weights correcting for tokens sampled by the behaviour policy, judged by the ratio
    ``r = exp(target_logprobs - behaviour_logprobs)`` (log-ratios clamped to ±MAX_LOG_RATIO).

    ``level`` — which ratio each token is judged by:
      - ``"token"``: its own ``r_t``.
      - ``"sequence"``: its sequence's ``exp(Σ_t log r_t)`` over the loss tokens — the exact sequence likelihood
        ratio ``π_target(y) / π_behaviour(y)`` (sequence-level TIS; untruncated it is unbiased for a sequence-level
        objective). Its variance grows exponentially with length, so use it with ``mode="truncate"`` and a
        generous ``high``.
      - ``"geometric"``: its sequence's geometric mean ``exp(mean_t log r_t)`` — length normalised (GSPO's ratio,
        Zheng et al. 2025, arXiv:2507.18071), so one threshold means the same for 10 and 10,000 tokens. The right
        statistic for masking whole sequences: a product over hundreds of tokens each off by 0.5 % already exceeds
        any sensible threshold.

    ``mode``:
      - ``"truncate"`` (TIS, Yao et al. 2025): weight ``min(r, high)``; ``low`` must be None.
      - ``"mask"`` (masked IS: IcePop's token masking; MIS of Liu, Li et al. 2025 at a sequence level): weight 1 if
        ``low <= r <= high`` else 0 — the token (or, at a sequence level, the whole sequence) is dropped; ``low``
        defaults to ``1 / high``.

    Args:
        target_logprobs: ``[T]`` log-probs of the policy being trained for (the trainer's, e.g. ``old_logprobs``).
        behaviour_logprobs: ``[T]`` log-probs of the policy that sampled the tokens (the rollout engine's).
        mask: ``[T]`` bool loss mask. cu_seqlens: ``[N + 1]`` boundaries.
        low, high: thresholds with ``0 < low < 1 < high``.

    Returns:
        ``(weights, affected)``: ``weights`` ``[T]`` float (at least float32), detached constants, exactly 1 outside
        the mask; ``affected`` ``[T]`` bool, the loss tokens truncated (ratio > high) or dropped. Values outside the
        mask — even NaN — never affect anything. Dropped tokens should still count in a loss's normaliser (as
        :func:`rlhfkit.losses.policy_loss` does), which keeps micro-batches and DP ranks invariant.
    """
    low, high = check_weight_options(level, mode, low, high)
    cu = _check_inputs(target_logprobs, behaviour_logprobs, mask, cu_seqlens)
    log_ratio = _log_ratio(target_logprobs, behaviour_logprobs, mask)
    return weights_from_log_ratio(log_ratio, mask, cu, level=level, mode=mode, low=low, high=high)


def _log_ratio(target_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    dtype = torch.promote_types(torch.promote_types(target_logprobs.dtype, behaviour_logprobs.dtype), torch.float32)
    return clamped_log_ratio(target_logprobs.detach().to(dtype), behaviour_logprobs.detach().to(dtype), mask)


def token_mismatch_specs(log_ratio: torch.Tensor) -> dict[str, tuple[str, torch.Tensor]]:
    """The per-token ``(reduction, tensor)`` specs of :func:`mismatch_stats` for
    :func:`~rlhfkit.losses._aggregate.masked_stats`, which reduces them with one device sync (shared with a loss's
    own stats in :func:`rlhfkit.losses.policy_loss`). ``log_ratio`` from :func:`clamped_log_ratio`."""
    ratio = torch.exp(log_ratio)
    return {
        "kl": ("mean", ratio - 1 - log_ratio),
        "log_ratio_mean": ("mean", log_ratio),
        "ratio_mean": ("mean", ratio),
        "ratio_min": ("min", ratio),
        "ratio_max": ("max", ratio),
        "abs_log_ratio_max": ("max", log_ratio.abs()),
    }


def _sequence_mismatch_specs(log_ratio: torch.Tensor, mask: torch.Tensor, cu: torch.Tensor,
                             threshold: float) -> dict[str, tuple[str, torch.Tensor]]:
    ratio = torch.exp(log_ratio)
    abs_log_ratio = log_ratio.abs()  # 0 outside the mask
    seq_ids = segment_ids(cu)
    end = int(cu[-1])
    seq_max = abs_log_ratio.new_zeros(cu.numel() - 1).scatter_reduce(0, seq_ids, abs_log_ratio[:end], "amax")
    has_loss = segment_sum(mask.to(log_ratio.dtype), cu) > 0
    seq_max_mean = torch.where(has_loss, seq_max, torch.zeros_like(seq_max)).sum() / has_loss.sum().clamp(min=1)
    geometric = torch.exp(seq_mean_per_token(log_ratio, mask, cu))
    return {
        "seq_abs_log_ratio_max_mean": ("scalar", seq_max_mean),
        "geometric_ratio_min": ("min", geometric),
        "geometric_ratio_max": ("max", geometric),
        "outside_fraction": ("mean", (ratio > threshold) | (ratio < 1 / threshold)),
        "num_seqs": ("value", has_loss.sum()),
    }


def _staleness_specs(log_ratio: torch.Tensor, mask: torch.Tensor, weight_versions: object,
                     trainer_version: object) -> dict[str, tuple[str, torch.Tensor]]:
    """Token staleness ``trainer_version - weight_versions`` and the k3 KL of the tokens of each staleness."""
    if not isinstance(weight_versions, torch.Tensor) or weight_versions.dtype not in (torch.int64, torch.int32) \
            or weight_versions.shape != mask.shape:
        raise TypeError(f"weight_versions must be a [T] int64 tensor like the mask {tuple(mask.shape)} (e.g. "
                        f"Experience.weight_versions), got {getattr(weight_versions, 'shape', weight_versions)!r}")
    ages = version_lag(weight_versions, trainer_version, mask=mask,
                       describe=lambda token, version: f"weight_versions[{token}]={version} is")
    kl = torch.exp(log_ratio) - 1 - log_ratio
    specs: dict[str, tuple[str, torch.Tensor]] = {"staleness_mean": ("mean", ages), "staleness_max": ("max", ages)}
    for age in range(int(ages.max()) + 1 if ages.numel() else 0):
        selected = mask & (ages == age)
        count = selected.sum()
        mean = torch.where(selected, kl, 0).sum() / count.clamp(min=1)
        specs[f"kl_staleness_{age}"] = ("value", torch.where(count > 0, mean, torch.full_like(mean, math.nan)))
        specs[f"tokens_staleness_{age}"] = ("value", count)
    return specs


def mismatch_stats(target_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                   cu_seqlens: torch.Tensor, *, threshold: float = 2.0, weight_versions: torch.Tensor | None = None,
                   trainer_version: int | None = None) -> dict[str, float]:
    """Behaviour-vs-target mismatch statistics of one batch, as plain floats (one device sync; not all-reduced).

    With ``log r_t = target_logprobs - behaviour_logprobs`` on loss tokens (clamped to ±MAX_LOG_RATIO):

      - ``kl``: mean of ``r - 1 - log r`` — the k3 estimate (Schulman 2020, http://joschu.net/blog/kl-approx.html)
        of KL(behaviour ‖ target), as the tokens were sampled by the behaviour policy; 0 for identical policies.
      - ``log_ratio_mean``: mean ``log r`` (k1; ``-KL`` in expectation, its sign shows the direction of drift).
      - ``ratio_mean``, ``ratio_min``, ``ratio_max``; ``abs_log_ratio_max``: the worst token.
      - ``seq_abs_log_ratio_max_mean``: each sequence's largest ``|log r|``, averaged over the sequences.
      - ``geometric_ratio_min`` / ``geometric_ratio_max``: range of the sequences' geometric-mean ratios (what a
        ``level="geometric"`` mask compares with its thresholds).
      - ``outside_fraction``: fraction of loss tokens with ``r`` outside ``[1 / threshold, threshold]``, i.e.
        ``|log r| > log(threshold)`` (what a token mask with ``high=threshold`` drops).
      - ``num_loss_tokens``; ``num_seqs`` (sequences with a loss token).
      - with ``weight_versions`` (``[T]`` int64, the version that generated each token; ``Experience.weight_versions``)
        and ``trainer_version``: ``staleness_mean`` / ``staleness_max`` over loss tokens (``trainer_version -
        weight_versions``), and for each staleness ``k`` up to the maximum ``tokens_staleness_<k>`` (count) and
        ``kl_staleness_<k>`` (the k3 KL of those tokens, NaN when none): how the mismatch grows with the lag.

    Means, minima and maxima are NaN when the batch has no loss token.

    Args:
        target_logprobs, behaviour_logprobs, mask, cu_seqlens: as in :func:`importance_weights`.
        threshold: ``> 1``, the ratio bound for ``outside_fraction``.
    """
    threshold = _check_number("threshold", threshold)
    if not 1 < threshold < math.inf:
        raise ValueError(f"threshold={threshold!r}; must be a finite number > 1 (tokens with a ratio outside "
                         "[1/threshold, threshold] count as outliers)")
    cu = _check_inputs(target_logprobs, behaviour_logprobs, mask, cu_seqlens)
    log_ratio = _log_ratio(target_logprobs, behaviour_logprobs, mask)
    specs = token_mismatch_specs(log_ratio) | _sequence_mismatch_specs(log_ratio, mask, cu, threshold)
    if weight_versions is not None or trainer_version is not None:
        specs |= _staleness_specs(log_ratio, mask, weight_versions, trainer_version)
    return masked_stats(mask, **specs)
