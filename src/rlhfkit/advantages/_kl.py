"""KL estimators, KL-shaped per-token rewards and KL coefficient controllers (private; use :mod:`rlhfkit.advantages`).

Estimators of ``KL(pi || pi_ref)`` from samples of ``pi`` (J. Schulman, "Approximating KL Divergence", 2020,
http://joschu.net/blog/kl-approx.html), with ``log_ratio = logprobs - ref_logprobs = log pi(x) - log pi_ref(x)``:

- ``k1 = log_ratio`` — unbiased, high variance, can be negative.
- ``k2 = log_ratio**2 / 2`` — biased, low variance, never negative.
- ``k3 = exp(-log_ratio) - 1 + log_ratio`` — unbiased, low variance, never negative; the exponential can explode,
  so it is clamped.

Controllers follow Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" (arXiv:1909.08593).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlhfkit._checks import (
    check_cu_seqlens,
    check_float_vector,
    check_mask,
    check_overflow,
    check_same_length,
)

__all__ = ["KLEstimator", "kl_estimate", "kl_shaped_rewards", "FixedKLController", "AdaptiveKLController"]

KLEstimator = Literal["k1", "k2", "k3"]
_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    estimator: KLEstimator = "k1",
    clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` for tokens sampled from ``pi``; differentiable in both inputs.

    Args:
        logprobs: ``[T]`` (or any shape) log-probs of the sampled tokens under the policy ``pi``.
        ref_logprobs: same shape, log-probs of the same tokens under the reference ``pi_ref``.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see the module docstring).
        clamp: the estimate is clamped to ``[-clamp, clamp]`` (all estimators); ``None`` disables clamping. For
            ``k3`` the exponent is also limited to ``[-(clamp + 1), clamp + 1]`` so that neither the value nor the
            gradient overflows; this changes nothing inside the clamp range.

    Returns:
        Same shape as ``logprobs``: the per-token estimate (0 where both log-probs are 0, e.g. outside the loss mask).
    """
    if not isinstance(logprobs, torch.Tensor) or not isinstance(ref_logprobs, torch.Tensor):
        raise TypeError(
            f"logprobs and ref_logprobs must be torch.Tensors, got {type(logprobs).__name__} and "
            f"{type(ref_logprobs).__name__}"
        )
    check_same_length("logprobs", logprobs, ref_logprobs=ref_logprobs)
    if not logprobs.is_floating_point() or not ref_logprobs.is_floating_point():
        raise ValueError(f"logprobs and ref_logprobs must be floating, got {logprobs.dtype} and {ref_logprobs.dtype}")
    if estimator not in _ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}; expected one of {_ESTIMATORS}")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp={clamp}; must be > 0, or None to disable clamping")
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        neg = -log_ratio
        if clamp is not None:
            # k3(x) >= clamp for |x| >= clamp + 1, so limiting x first keeps exp finite without changing the result.
            neg = neg.clamp(-(clamp + 1.0), clamp + 1.0)
        kl = torch.expm1(neg) - neg
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return kl


def kl_shaped_rewards(
    seq_rewards: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    kl_coef: float,
) -> torch.Tensor:
    """Per-token rewards: ``-kl_coef * kl`` on every loss token, plus the sequence reward on its last loss token.

    This is the reward of PPO-based RLHF (Ziegler et al. 2019; Ouyang et al. 2022) and of REINFORCE++ (Hu 2025).

    Args:
        seq_rewards: ``[N]`` scalar reward (or advantage-like baseline-corrected reward) of each sequence.
        kl: ``[T]`` per-token KL estimate (see :func:`kl_estimate`), token aligned with the packed stream.
        mask: ``[T]`` bool loss mask (response tokens).
        cu_seqlens: ``[N + 1]`` sequence boundaries of the packed stream.
        kl_coef: penalty weight (>= 0).

    Returns:
        ``[T]`` float32 (or the dtype of ``kl`` if wider), 0 outside ``mask``. A sequence without any loss token
        receives nothing (it has no token to train on).
    """
    check_float_vector("seq_rewards", seq_rewards)
    check_float_vector("kl", kl)
    check_mask(mask, kl.numel())
    cu = check_cu_seqlens(cu_seqlens, kl.numel(), mask)
    if seq_rewards.numel() != cu.numel() - 1:
        raise ValueError(f"seq_rewards has {seq_rewards.numel()} entries but cu_seqlens describes "
                         f"{cu.numel() - 1} sequences")
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef={kl_coef}; must be >= 0")
    dtype = torch.promote_types(kl.dtype, torch.float32)
    rewards = torch.where(mask, -kl_coef * kl.to(dtype), torch.zeros((), dtype=dtype, device=kl.device))
    last, has_token = last_loss_token(mask, cu)
    rewards[last[has_token]] += seq_rewards.to(dtype)[has_token]
    check_overflow("kl_shaped_rewards", rewards, unit="token", mask=mask,
                   fix="Lower kl_coef, keep a clamp in kl_estimate (clamp=10.0), or scale the sequence rewards down")
    return rewards


def last_loss_token(mask: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N] int64 position of each sequence's last loss token, [N] bool: the sequence has a loss token)``."""
    num_seqs = cu_seqlens.numel() - 1
    positions = torch.arange(mask.numel(), device=mask.device)
    seq_of_token = torch.bucketize(positions, cu_seqlens[1:], right=True)  # padding tail gets N
    last = torch.full((num_seqs + 1,), -1, dtype=torch.long, device=mask.device)
    last.scatter_reduce_(0, seq_of_token[mask], positions[mask], reduce="amax")
    last = last[:num_seqs]
    has_token = last >= 0
    return last.clamp(min=0), has_token


@dataclass(kw_only=True)
class FixedKLController:
    """A constant KL coefficient with the controller interface (``value``, ``update``)."""

    value: float

    def __post_init__(self) -> None:
        if not self.value >= 0:
            raise ValueError(f"FixedKLController.value={self.value}; the KL coefficient must be >= 0")

    def update(self, current_kl: float, num_steps: int) -> float:
        """No-op; returns the (unchanged) coefficient."""
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": float(self.value)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@dataclass(kw_only=True)
class AdaptiveKLController:
    """Adapts the KL coefficient toward a target KL (Ziegler et al. 2019, section 2.2).

    ``error = clip(current_kl / target - 1, -0.2, 0.2)``; ``value *= 1 + error * num_steps / horizon``.

    Attributes:
        value: the current coefficient (initially the starting coefficient, > 0).
        target: the KL (nats per sequence or per token, as you measure ``current_kl``) to steer toward (> 0).
        horizon: how many samples (``num_steps``) it takes to move the coefficient by up to 20% (> 0).
    """

    value: float
    target: float
    horizon: float

    def __post_init__(self) -> None:
        if not self.value > 0:
            raise ValueError(f"AdaptiveKLController.value={self.value}; must be > 0 (a 0 coefficient never adapts)")
        if not self.target > 0:
            raise ValueError(f"AdaptiveKLController.target={self.target}; must be > 0")
        if not self.horizon > 0:
            raise ValueError(f"AdaptiveKLController.horizon={self.horizon}; must be > 0")

    def update(self, current_kl: float, num_steps: int) -> float:
        """Move the coefficient given the measured KL of the last ``num_steps`` samples; returns the new value."""
        current_kl = float(current_kl)
        if current_kl != current_kl or current_kl in (float("inf"), float("-inf")):
            raise ValueError(f"current_kl={current_kl} is not finite; the controller cannot adapt to it")
        if num_steps < 0:
            raise ValueError(f"num_steps={num_steps}; must be >= 0")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": float(self.value), "target": float(self.target), "horizon": float(self.horizon)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])
