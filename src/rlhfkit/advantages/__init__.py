"""Advantage estimators, returns, whitening, KL estimators and KL-shaped rewards on packed token streams.

Pure torch functions over the packed convention of :mod:`rlhfkit.types`: per-token tensors are ``[T]`` and token
aligned with ``input_ids``, ``mask`` is the ``[T]`` bool loss mask (response tokens), ``cu_seqlens`` the
``[N + 1]`` sequence boundaries; per-sequence tensors are ``[N]``; group estimators take the ``[N]`` group id
(``prompt_index``) of every sample and never assume that a group's samples are contiguous.

The building blocks, and how the estimators of :class:`rlhfkit.experience.ExperienceConfig` compose them:

- PPO with a critic: :func:`kl_shaped_rewards` → :func:`gae` (Schulman et al. 2016) → :func:`whiten`.
- REINFORCE: :func:`kl_shaped_rewards` → :func:`discounted_returns`.
- REINFORCE++ (Hu 2025): REINFORCE, then :func:`whiten` over all tokens of the batch.
- REINFORCE++-baseline: :func:`reinforce_baseline_advantages` on the rewards first, then as REINFORCE++.
- RLOO (Ahmadian et al. 2024): :func:`rloo_advantages`; GRPO (Shao et al. 2024) and Dr.GRPO (Liu et al. 2025):
  :func:`grpo_advantages`; then :func:`broadcast_to_tokens` (or the KL-shaped path with ``gamma = 1``).
- KL: :func:`kl_estimate` (k1/k2/k3), :class:`FixedKLController`, :class:`AdaptiveKLController` (Ziegler et al. 2019).

What it does not do: compute log-probs or values (see :mod:`rlhfkit.losses`, your critic) or all-reduce across
data-parallel ranks (whitening is over the tensors you pass). Needs only torch.
"""

from __future__ import annotations

import torch

from rlhfkit._checks import check_cu_seqlens, check_finite, check_float_vector, check_mask, check_overflow
from rlhfkit._cu_seqlens import repeat_counts
from rlhfkit.advantages._group import grpo_advantages, reinforce_baseline_advantages, rloo_advantages
from rlhfkit.advantages._kl import (
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    kl_estimate,
    kl_shaped_rewards,
)
from rlhfkit.advantages._scan import discounted_returns, gae

__all__ = [
    "KLEstimator",
    "kl_estimate",
    "kl_shaped_rewards",
    "gae",
    "discounted_returns",
    "whiten",
    "grpo_advantages",
    "rloo_advantages",
    "reinforce_baseline_advantages",
    "broadcast_to_tokens",
    "FixedKLController",
    "AdaptiveKLController",
]


def whiten(values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening: ``(x - mean) / sqrt(var + eps)`` with mean and (biased) variance over ``mask`` only.

    Args:
        values: ``[T]`` (or any shape) float values, e.g. per-token advantages.
        mask: bool, same shape; entries outside it neither enter the statistics nor keep their value (they are 0).
        shift_mean: when False the mean is added back (scale only), as for rewards whose sign matters.
        eps: added to the variance (> 0); a single masked entry (variance 0) whitens to 0.

    Returns:
        Same shape and dtype as ``values`` (computed in at least float32), 0 outside ``mask``. Differentiable.
    """
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError(f"values must be a floating torch.Tensor, got {getattr(values, 'dtype', type(values))}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != values.shape:
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a bool tensor of the shape of values {tuple(values.shape)}, got {got}")
    if not eps > 0:
        raise ValueError(f"eps={eps}; must be > 0")
    count = int(mask.sum())
    if count == 0:
        raise ValueError("mask selects no entry; whitening needs at least one value (is the batch empty?)")
    check_finite("values", values.flatten(), unit="token", mask=mask.flatten())
    x = values.to(torch.promote_types(values.dtype, torch.float32))
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    # Every masked-out entry is replaced by 0 *before* any arithmetic: with ``torch.where`` only at the end, a NaN
    # outside the mask is ignored by the forward but its 0 * NaN reaches the variance's gradient, making the whole
    # gradient NaN.
    masked = torch.where(mask, x, zero)
    mean = masked.sum() / count
    centered = torch.where(mask, masked - mean, zero)
    var = centered.square().sum() / count
    whitened = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    out = torch.where(mask, whitened, zero).to(values.dtype)
    if not bool(torch.isfinite(var.detach())):
        # (x - mean)^2 overflowed: rsqrt(inf) = 0 would silently whiten everything to 0 (or NaN).
        raise ValueError(f"whiten: the variance of values overflowed {x.dtype} (max |values| on the mask = "
                         f"{float(masked.detach().abs().max()):.3g}); scale the values down or pass float64")
    check_overflow("whiten", out.flatten(), unit="token", mask=mask.flatten(),
                   fix="Scale the values down or pass float64")
    return out


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Give every loss token of sequence ``i`` the value ``seq_values[i]``; 0 elsewhere (prompt, padding).

    Args:
        seq_values: ``[N]`` float, one value per sequence (e.g. GRPO advantages).
        mask: ``[T]`` bool loss mask.
        cu_seqlens: ``[N + 1]`` sequence boundaries.

    Returns:
        ``[T]`` in the dtype of ``seq_values``.
    """
    check_float_vector("seq_values", seq_values)
    if not isinstance(mask, torch.Tensor) or mask.ndim != 1:
        raise ValueError(f"mask must be a [T] bool tensor, got {getattr(mask, 'shape', type(mask).__name__)}")
    check_mask(mask, mask.numel())
    cu = check_cu_seqlens(cu_seqlens, mask.numel(), mask)
    if seq_values.numel() != cu.numel() - 1:
        raise ValueError(f"seq_values has {seq_values.numel()} entries but cu_seqlens describes {cu.numel() - 1} "
                         "sequences")
    lengths = cu[1:] - cu[:-1]
    per_token = repeat_counts(seq_values, lengths)
    out = torch.zeros(mask.shape, dtype=seq_values.dtype, device=seq_values.device)
    out[: per_token.numel()] = per_token
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))
