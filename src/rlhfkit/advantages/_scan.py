"""GAE and discounted returns on packed token streams (private; use :mod:`rlhfkit.advantages`).

Both are the reverse linear recurrence ``y[t] = x[t] + c * y[t + 1]`` over the loss tokens of each sequence
(``c = gamma`` for returns, ``c = gamma * lam`` for GAE). The loss tokens of every sequence are gathered into a
right-padded ``[N, L]`` matrix (zeros after each sequence's last loss token, so the recurrence restarts at 0 there)
and the recurrence is solved without a Python loop over time: blocks of ``C`` steps are a matmul with the
``[C, C]`` upper-triangular matrix of powers of ``c``, and the carry between blocks is the same recurrence with
``c**C``, solved by one ``[B, B]`` matmul (``B = L / C`` blocks). Work is ``O(N L (C + B))``; the computation runs in
float64 so that TF32 matmul settings and long sums cannot cost precision. ``bench/gae.py`` compares this to the
per-token loop and the per-step scan.
"""

from __future__ import annotations

import torch

from rlhfkit._checks import (
    check_cu_seqlens,
    check_finite,
    check_float_vector,
    check_mask,
    check_overflow,
    check_same_length,
)

__all__ = ["gae", "discounted_returns", "reverse_discounted_cumsum", "gather_loss_tokens"]

_BLOCK = 64


def _discount_matrix(size: int, discount: float, *, device: torch.device) -> torch.Tensor:
    """``[size, size]`` float64 with ``M[i, j] = discount ** (j - i)`` for ``j >= i``, else 0."""
    steps = torch.arange(size, device=device, dtype=torch.float64)
    exponent = steps[None, :] - steps[:, None]
    base = torch.tensor(discount, dtype=torch.float64, device=device)
    powers = torch.pow(base, exponent.clamp(min=0))  # 0 ** 0 == 1 keeps the diagonal for discount == 0
    return torch.where(exponent >= 0, powers, torch.zeros((), dtype=torch.float64, device=device))


def reverse_discounted_cumsum(values: torch.Tensor, discount: float, *, block: int = _BLOCK) -> torch.Tensor:
    """``y[:, t] = sum_{k >= t} discount**(k - t) * values[:, k]`` for a ``[N, L]`` tensor, in float64.

    Rows are independent; a row that should stop early must be zero-padded after its end.
    """
    num_rows, length = values.shape
    x = values.to(torch.float64)
    if length == 0:
        return x
    if length <= block:
        return x @ _discount_matrix(length, discount, device=x.device).T
    num_blocks = -(-length // block)
    x = torch.nn.functional.pad(x, (0, num_blocks * block - length)).view(num_rows, num_blocks, block)
    local = x @ _discount_matrix(block, discount, device=x.device).T  # [N, B, C] recurrence inside each block
    # y at the first step of every block: the same recurrence over blocks with discount**block.
    heads = local[:, :, 0] @ _discount_matrix(num_blocks, discount**block, device=x.device).T  # [N, B]
    carry = torch.nn.functional.pad(heads[:, 1:], (0, 1))  # y at the first step of the next block
    tail_powers = discount ** torch.arange(block, 0, -1, device=x.device, dtype=torch.float64)  # discount**(C - i)
    y = local + carry[:, :, None] * tail_powers
    return y.reshape(num_rows, num_blocks * block)[:, :length]


def gather_loss_tokens(mask: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each loss token goes in a right-padded ``[N, L]`` matrix of loss tokens only.

    Returns ``(row [M], column [M], L)`` for the ``M`` loss tokens in stream order: ``row`` is the sequence,
    ``column`` the token's rank among its sequence's loss tokens, ``L`` the most loss tokens of any sequence.
    """
    positions = torch.nonzero(mask).flatten()
    row = torch.bucketize(positions, cu_seqlens[1:], right=True)
    ranks = torch.arange(positions.numel(), device=mask.device)
    first_rank = torch.zeros(cu_seqlens.numel() - 1, dtype=torch.long, device=mask.device)
    counts = torch.bincount(row, minlength=cu_seqlens.numel() - 1)
    first_rank[1:] = torch.cumsum(counts, 0)[:-1]
    column = ranks - first_rank[row]
    width = int(counts.max()) if counts.numel() else 0
    return row, column, width


def _to_matrix(values: torch.Tensor, row: torch.Tensor, column: torch.Tensor, shape: tuple[int, int],
               mask: torch.Tensor) -> torch.Tensor:
    matrix = torch.zeros(shape, dtype=torch.float64, device=values.device)
    matrix[row, column] = values[mask].to(torch.float64)
    return matrix


def _check_token_inputs(mask: torch.Tensor, cu_seqlens: torch.Tensor, **values: torch.Tensor) -> torch.Tensor:
    (first_name, first), *_ = values.items()
    for name, value in values.items():
        check_float_vector(name, value)
    check_same_length(first_name, first, **values)
    check_mask(mask, first.numel())
    cu = check_cu_seqlens(cu_seqlens, first.numel(), mask)
    for name, value in values.items():
        check_finite(name, value, unit="token", mask=mask)
    return cu


def _check_discount(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value}; must be in [0, 1]")


def discounted_returns(
    token_rewards: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, *, gamma: float
) -> torch.Tensor:
    """Discounted reward-to-go over the loss tokens of each sequence (REINFORCE; Williams 1992).

    ``G[t] = r[t] + gamma * G[t']`` where ``t'`` is the next loss token of the same sequence (``G = r`` at the last).
    Tokens outside ``mask`` are not steps: their rewards are ignored and their returns are 0.

    Args:
        token_rewards: ``[T]`` per-token rewards (e.g. from :func:`kl_shaped_rewards`).
        mask: ``[T]`` bool loss mask.
        cu_seqlens: ``[N + 1]`` sequence boundaries.
        gamma: discount in ``[0, 1]``.

    Returns:
        ``[T]`` in the dtype of ``token_rewards`` (at least float32).
    """
    cu = _check_token_inputs(mask, cu_seqlens, token_rewards=token_rewards)
    _check_discount("gamma", gamma)
    row, column, width = gather_loss_tokens(mask, cu)
    rewards = _to_matrix(token_rewards, row, column, (cu.numel() - 1, width), mask)
    returns = reverse_discounted_cumsum(rewards, gamma)
    out_dtype = torch.promote_types(token_rewards.dtype, torch.float32)
    out = torch.zeros(token_rewards.shape, dtype=out_dtype, device=token_rewards.device)
    out[mask] = returns[row, column].to(out_dtype)
    check_overflow("discounted_returns", out, unit="token", mask=mask,
                   fix="Scale the token rewards down, or pass float64 token_rewards")
    return out


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438) on a packed stream.

    Over the loss tokens of each sequence, with ``t'`` the next loss token of the same sequence and ``V[t'] = 0``
    after the last one (the episode ends): ``delta[t] = r[t] + gamma * V[t'] - V[t]``,
    ``A[t] = delta[t] + gamma * lam * A[t']``, ``returns = A + V``. Tokens outside ``mask`` are not steps.

    Args:
        token_rewards: ``[T]`` per-token rewards (e.g. from :func:`kl_shaped_rewards`).
        values: ``[T]`` critic values, token aligned: ``values[t]`` estimates the return from the state just before
            token ``t`` is generated (the critic's output at position ``t - 1``).
        mask: ``[T]`` bool loss mask.
        cu_seqlens: ``[N + 1]`` sequence boundaries.
        gamma: discount in ``[0, 1]``; lam: GAE lambda in ``[0, 1]``.

    Returns:
        ``(advantages [T], returns [T])`` in the wider of the input dtypes (at least float32), 0 outside ``mask``.
        Neither carries gradient to ``values``.
    """
    cu = _check_token_inputs(mask, cu_seqlens, token_rewards=token_rewards, values=values)
    _check_discount("gamma", gamma)
    _check_discount("lam", lam)
    row, column, width = gather_loss_tokens(mask, cu)
    shape = (cu.numel() - 1, width)
    rewards = _to_matrix(token_rewards, row, column, shape, mask)
    value_matrix = _to_matrix(values.detach(), row, column, shape, mask)
    next_values = torch.nn.functional.pad(value_matrix[:, 1:], (0, 1))  # zero after each sequence's last step
    deltas = rewards + gamma * next_values - value_matrix
    advantages = reverse_discounted_cumsum(deltas, gamma * lam)
    out_dtype = torch.promote_types(torch.promote_types(token_rewards.dtype, values.dtype), torch.float32)
    adv_out = torch.zeros(values.shape, dtype=out_dtype, device=values.device)
    ret_out = torch.zeros(values.shape, dtype=out_dtype, device=values.device)
    adv_out[mask] = advantages[row, column].to(out_dtype)
    ret_out[mask] = (advantages + value_matrix)[row, column].to(out_dtype)
    fix = "Scale the token rewards (and so the critic's values) down, or pass float64 tensors"
    check_overflow("gae advantages", adv_out, unit="token", mask=mask, fix=fix)
    check_overflow("gae returns", ret_out, unit="token", mask=mask, fix=fix)
    return adv_out, ret_out
