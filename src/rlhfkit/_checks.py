"""Input validation shared by the core blocks (private): :mod:`rlhfkit.advantages`, :mod:`rlhfkit.experience`,
:mod:`rlhfkit.dynamic_sampling`, and the staleness of weight versions for :mod:`rlhfkit.rollouts` and
:mod:`rlhfkit.losses`.

Every check raises ``ValueError``/``TypeError`` naming the argument, what it got and what was expected. Nothing here
is broadcast or fixed up silently.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlhfkit._cu_seqlens import token_shape_hint

__all__ = [
    "check_overflow",
    "check_float_vector",
    "check_same_length",
    "check_mask",
    "check_cu_seqlens",
    "check_finite",
    "check_group_ids",
    "version_lag",
]


def check_float_vector(name: str, value: object) -> torch.Tensor:
    """``value`` must be a 1-D floating tensor; returns it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.ndim != 1:
        raise ValueError(f"{name} must be 1-D ([T] packed or [N] per sequence), got shape {tuple(value.shape)}."
                         + token_shape_hint(name, value, 0))
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got dtype {value.dtype}; convert it with .float()")
    return value


def check_same_length(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    """Every tensor in ``others`` has the same shape as ``reference``."""
    for name, value in others.items():
        if value.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)} but {reference_name} has shape {tuple(reference.shape)}; "
                "they must match exactly (nothing is broadcast)"
            )


def check_mask(mask: object, num_tokens: int, *, name: str = "mask") -> torch.Tensor:
    """``mask`` is a ``[T]`` bool tensor with ``T == num_tokens``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got dtype {mask.dtype}; use mask.bool()")
    if mask.shape != (num_tokens,):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}; expected ({num_tokens},) like the per-token values."
                         + token_shape_hint(name, mask, num_tokens))
    return mask


def check_cu_seqlens(cu_seqlens: object, num_tokens: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``cu_seqlens`` is ``[N + 1]`` int, starts at 0, strictly increasing, ends at or before ``num_tokens``.

    With ``mask``, also checks that no loss token lies in the padding tail after ``cu_seqlens[-1]``.
    Returns ``cu_seqlens`` as int64 on its device.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    cu = cu_seqlens.long()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths <= 0).any()):
        bad = int(torch.nonzero(lengths <= 0)[0])
        raise ValueError(f"cu_seqlens must be strictly increasing; sequence {bad} has length {int(lengths[bad])}")
    if int(cu[-1]) > num_tokens:
        raise ValueError(f"cu_seqlens[-1]={int(cu[-1])} exceeds the {num_tokens} tokens of the per-token values")
    if mask is not None and bool(mask[int(cu[-1]):].any()):
        raise ValueError(f"mask is True on padding tokens after cu_seqlens[-1]={int(cu[-1])}; padding is never a "
                         "loss token")
    return cu


def _first_non_finite(value: torch.Tensor, mask: torch.Tensor | None) -> tuple[int, int] | None:
    """``(first index, count)`` of the NaN/inf entries of ``value`` inside ``mask``, or None (one host sync)."""
    bad = ~torch.isfinite(value)
    if mask is not None:
        bad &= mask
    if not bool(bad.any()):
        return None
    return int(torch.nonzero(bad)[0]), int(bad.sum())


def check_finite(name: str, value: torch.Tensor, *, unit: str = "sample", mask: torch.Tensor | None = None) -> None:
    """Raise naming the first index (a ``unit``: sample or token) where ``value`` is NaN or inf (inside ``mask``)."""
    found = _first_non_finite(value, mask)
    if found is not None:
        index, count = found
        raise ValueError(
            f"{name} is not finite at {unit} index {index} (value {value[index].item()}); "
            f"{count} non-finite entries in total. Fix or filter these {unit}s before this step."
        )


def check_overflow(name: str, value: torch.Tensor, *, unit: str, mask: torch.Tensor | None = None, fix: str) -> None:
    """Raise when a *result* is NaN/inf (inside ``mask``) although the inputs were checked finite: an overflow.

    Inputs are checked before computing; a finite but huge input (rewards of 1e38) can still overflow the result's
    dtype, which would otherwise flow on silently as inf/NaN advantages.
    """
    found = _first_non_finite(value.detach(), mask)
    if found is not None:
        index, count = found
        raise ValueError(
            f"{name} overflowed {value.dtype} (largest finite {torch.finfo(value.dtype).max:.3g}): it is "
            f"{value[index].item()} at {unit} index {index} although the inputs are finite; {count} "
            f"non-finite entries in total. {fix}"
        )


def check_group_ids(group_ids: object, num_seqs: int) -> torch.Tensor:
    """``group_ids`` is ``[N]`` integer (the prompt index of each sample); returns it as int64."""
    if not isinstance(group_ids, torch.Tensor):
        raise TypeError(f"group_ids must be a torch.Tensor of ints, got {type(group_ids).__name__}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor (prompt indices), got dtype {group_ids.dtype}")
    if group_ids.shape != (num_seqs,):
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}; expected ({num_seqs},), one per reward")
    return group_ids.long()


def version_lag(versions: torch.Tensor, trainer_version: object, *, describe: Callable[[int, int], str],
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Staleness: ``trainer_version - versions`` as int64 (0 where ``mask`` is False), how many weight versions
    each entry lags the trainer. ``ValueError`` when ``trainer_version`` is not an int >= 0, or when an entry (under
    the mask) is newer than the trainer: a bookkeeping error, named by ``describe(index, version)``, the message up
    to "newer than" (e.g. ``"rollout 2 has weight_version=5,"``)."""
    if isinstance(trainer_version, bool) or not isinstance(trainer_version, int) or trainer_version < 0:
        raise ValueError(f"trainer_version={trainer_version!r}; must be an int >= 0 (the version of the weights the "
                         "trainer holds, a count of weight pushes)")
    ages = trainer_version - versions.long()
    if mask is not None:
        ages = torch.where(mask, ages.to(mask.device), 0)
    newer = ages < 0
    if bool(newer.any()):
        index = int(torch.nonzero(newer)[0])
        raise ValueError(f"{describe(index, int(versions[index]))} newer than trainer_version={trainer_version}; "
                         "pass the version of the weights the trainer holds now")
    return ages
