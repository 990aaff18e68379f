"""How each estimator of :class:`rlhfkit.experience.ExperienceConfig` composes :mod:`rlhfkit.advantages` (private).

Every estimator follows the same four steps, so they differ only where the papers differ:

1. a sequence-level baseline on the ``[N]`` rewards (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce++_baseline``;
   the others keep the rewards as they are);
2. per-token rewards: that sequence value on each sequence's last loss token, minus ``kl_coef * kl`` on every loss
   token when the KL is in the reward (:func:`~rlhfkit.advantages.kl_shaped_rewards`);
3. ``gae`` runs GAE with the critic's values; all others take discounted returns as advantages (with ``gamma = 1``
   and no KL in the reward this is the sequence value on every loss token);
4. optional global whitening over all loss tokens (always for ``reinforce++`` / ``reinforce++_baseline``).
"""

from __future__ import annotations

from typing import Literal

import torch

from rlhfkit.advantages import (
    discounted_returns,
    gae,
    grpo_advantages,
    kl_shaped_rewards,
    reinforce_baseline_advantages,
    rloo_advantages,
    whiten,
)

__all__ = ["Estimator", "ESTIMATORS", "GROUP_ESTIMATORS", "WHITENED_BY_DEFAULT", "sequence_baseline",
           "estimate_advantages"]

Estimator = Literal["gae", "reinforce", "reinforce++", "reinforce++_baseline", "rloo", "grpo", "dr_grpo"]
ESTIMATORS = ("gae", "reinforce", "reinforce++", "reinforce++_baseline", "rloo", "grpo", "dr_grpo")
GROUP_ESTIMATORS = ("reinforce++_baseline", "rloo", "grpo", "dr_grpo")
WHITENED_BY_DEFAULT = ("gae", "reinforce++", "reinforce++_baseline")


def sequence_baseline(estimator: str, rewards: torch.Tensor, prompt_index: torch.Tensor, *,
                      grpo_eps: float) -> torch.Tensor:
    """Step 1: ``[N]`` baseline-corrected sequence values (the rewards themselves for non-group estimators)."""
    if estimator == "grpo":
        return grpo_advantages(rewards, prompt_index, scale_by_std=True, eps=grpo_eps)
    if estimator == "dr_grpo":
        return grpo_advantages(rewards, prompt_index, scale_by_std=False)
    if estimator == "rloo":
        return rloo_advantages(rewards, prompt_index)
    if estimator == "reinforce++_baseline":
        return reinforce_baseline_advantages(rewards, prompt_index)
    return rewards.float()


def estimate_advantages(
    estimator: str,
    rewards: torch.Tensor,
    prompt_index: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    kl: torch.Tensor | None,
    kl_coef: float,
    values: torch.Tensor | None,
    gamma: float,
    lam: float,
    whiten_advantages: bool,
    grpo_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1–4 above; returns ``(advantages [T], returns [T])`` float32, 0 outside ``mask``.

    ``kl`` is ``None`` when the KL is not part of the reward. ``returns`` are the value targets for ``gae`` and the
    (unwhitened) discounted returns otherwise.
    """
    seq_values = sequence_baseline(estimator, rewards, prompt_index, grpo_eps=grpo_eps)
    kl_term = kl if kl is not None else torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    token_rewards = kl_shaped_rewards(seq_values.float(), kl_term.float(), mask, cu_seqlens,
                                      kl_coef=kl_coef if kl is not None else 0.0)
    if estimator == "gae":
        assert values is not None, "make_experience checks that gae has values"
        advantages, returns = gae(token_rewards, values, mask, cu_seqlens, gamma=gamma, lam=lam)
    else:
        returns = discounted_returns(token_rewards, mask, cu_seqlens, gamma=gamma)
        advantages = returns
    if whiten_advantages and bool(mask.any()):
        advantages = whiten(advantages, mask)
    return advantages.float(), returns.float()
