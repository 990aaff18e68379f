"""Group baselines over the samples of one prompt (private; use :mod:`rlhfkit.advantages`).

Groups are given by ids (the ``prompt_index`` of each sample), never by position: samples of one group may be
anywhere in the batch and groups may have different sizes. Results depend only on each sample's own group, so they are
invariant to permuting samples and groups (up to float summation order).
"""

from __future__ import annotations

import torch

from rlhfkit._checks import check_finite, check_float_vector, check_group_ids, check_overflow

_FIX = "Scale the rewards down (or normalise them before this step), or pass float64 rewards"

__all__ = ["grpo_advantages", "rloo_advantages", "reinforce_baseline_advantages", "group_stats"]


def _check_rewards_and_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    check_float_vector("rewards", rewards)
    if rewards.numel() == 0:
        raise ValueError("rewards is empty; a batch needs at least one sample")
    ids = check_group_ids(group_ids, rewards.numel())
    check_finite("rewards", rewards, unit="sample")
    return ids


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample statistics of the sample's group, in float64.

    Args:
        rewards: ``[N]`` float rewards (finite).
        group_ids: ``[N]`` int64 group (prompt) ids.

    Returns:
        ``(sum [N], count [N], mean [N], std [N], inverse [N], unique_ids [G])``: the sum, size, mean and unbiased
        standard deviation (0 for a group of one) of each sample's group; ``inverse`` maps samples to ``unique_ids``.
    """
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    x = rewards.to(torch.float64)
    sums = torch.zeros(num_groups, dtype=torch.float64, device=x.device).index_add_(0, inverse, x)
    counts = torch.bincount(inverse, minlength=num_groups).to(torch.float64)
    means = sums / counts
    squares = torch.zeros_like(sums).index_add_(0, inverse, (x - means[inverse]).square())
    stds = torch.sqrt(squares / (counts - 1).clamp(min=1.0))
    return sums[inverse], counts[inverse], means[inverse], stds[inverse], inverse, unique_ids


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages: ``(r - mean_g) / (std_g + eps)`` (GRPO; Shao et al. 2024, arXiv:2402.03300).

    ``scale_by_std=False`` gives ``r - mean_g``, Dr.GRPO (Liu et al. 2025, arXiv:2503.20783), which also drops the
    per-sequence length normalisation: pair it with ``aggregation="seq_mean_token_sum"`` in :mod:`rlhfkit.losses`.
    ``std_g`` is the unbiased standard deviation of the group (0 for a group of one, whose advantage is then 0).

    Args:
        rewards: ``[N]`` float scalar reward per sample.
        group_ids: ``[N]`` int prompt index of each sample (any order, any group sizes).
        scale_by_std: divide by the group standard deviation.
        eps: added to the standard deviation (> 0).

    Returns:
        ``[N]`` float32 (float64 if ``rewards`` is float64).
    """
    ids = _check_rewards_and_groups(rewards, group_ids)
    if not eps > 0:
        raise ValueError(f"eps={eps}; must be > 0")
    _, _, mean, std, _, _ = group_stats(rewards, ids)
    advantages = rewards.to(torch.float64) - mean
    if scale_by_std:
        advantages = advantages / (std + eps)
    out = advantages.to(torch.promote_types(rewards.dtype, torch.float32))
    check_overflow("grpo_advantages" if scale_by_std else "reinforce_baseline_advantages (r - group mean)", out,
                   unit="sample", fix=_FIX)
    return out


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: ``r_i - mean of the other samples of i's group`` (Ahmadian et al. 2024,
    arXiv:2402.14740; Kool et al. 2019).

    Args:
        rewards: ``[N]`` float scalar reward per sample.
        group_ids: ``[N]`` int prompt index of each sample; every group needs at least 2 samples.

    Returns:
        ``[N]`` float32 (float64 if ``rewards`` is float64).
    """
    ids = _check_rewards_and_groups(rewards, group_ids)
    sums, counts, _, _, inverse, unique_ids = group_stats(rewards, ids)
    if bool((counts < 2).any()):
        sample = int(torch.nonzero(counts < 2)[0])
        raise ValueError(
            f"rloo_advantages: group {int(unique_ids[inverse[sample]])} (sample index {sample}) has 1 sample; "
            "leave-one-out needs at least 2 samples per prompt (sample n >= 2 per prompt, or use grpo_advantages)"
        )
    x = rewards.to(torch.float64)
    advantages = x - (sums - x) / (counts - 1)
    out = advantages.to(torch.promote_types(rewards.dtype, torch.float32))
    check_overflow("rloo_advantages", out, unit="sample", fix=_FIX)
    return out


def reinforce_baseline_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline's sequence step: ``r - mean_g`` (Hu 2025, arXiv:2501.03262).

    The estimator then whitens the resulting per-token advantages over the whole batch (:func:`whiten`), which is
    what makes it REINFORCE++; :mod:`rlhfkit.experience` does both.

    Args:
        rewards: ``[N]`` float scalar reward per sample.
        group_ids: ``[N]`` int prompt index of each sample.

    Returns:
        ``[N]`` float32 (float64 if ``rewards`` is float64).
    """
    return grpo_advantages(rewards, group_ids, scale_by_std=False)
