"""Reward shaping: running mean/std normalisation, clipping, and DAPO's soft overlong punishment.

Part of :mod:`rlhfkit.rewards` (re-exported there). Needs only torch; :meth:`RunningMeanStd.update` all-gathers over a
``torch.distributed`` group when one is given.

References: Chan, Golub and LeVeque, "Updating formulae and a pairwise algorithm for computing sample variances"
(1979) for the parallel merge; Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
(arXiv:2503.14476), eq. 13, for the overlong penalty.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["RunningMeanStd", "clip_rewards", "overlong_penalty"]


def _local_moments(values: torch.Tensor) -> tuple[float, float, float]:
    x = values.detach().reshape(-1).double().cpu()
    if x.numel() == 0:
        return 0.0, 0.0, 0.0
    mean = x.mean()
    return float(x.numel()), float(mean), float(((x - mean) ** 2).sum())


class RunningMeanStd:
    """Running count, mean and population variance of a scalar stream (float64, exact parallel merge).

    Attributes:
        count: values seen.
        mean: their mean.
        m2: sum of squared deviations from the mean (``var = m2 / count``).
    """

    def __init__(self) -> None:
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def _merge(self, count: float, mean: float, m2: float) -> None:
        if count == 0:
            return
        total = self.count + count
        delta = mean - self.mean
        self.mean += delta * count / total
        self.m2 += m2 + delta * delta * self.count * count / total
        self.count = total

    def merge(self, other: RunningMeanStd) -> None:
        """Fold in another tracker's statistics (as if its values had been passed to :meth:`update`)."""
        self._merge(other.count, other.mean, other.m2)

    def update(self, values: torch.Tensor | Sequence[float], *, group=None) -> None:
        """Add ``values`` (any shape). With ``group`` (a ``torch.distributed`` process group; every rank of it must
        call), the values of all ranks are added, in rank order, so every rank ends with the same statistics."""
        values = values if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=torch.float64)
        moments = _local_moments(values)
        if not all(math.isfinite(m) for m in moments):
            raise ValueError("RunningMeanStd.update: values contain NaN or inf; filter them out first")
        if group is None:
            self._merge(*moments)
            return
        distributed = torch.distributed
        device = torch.device("cpu")
        if distributed.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        local = torch.tensor(moments, dtype=torch.float64, device=device)
        gathered = [torch.empty_like(local) for _ in range(distributed.get_world_size(group))]
        distributed.all_gather(gathered, local, group=group)
        for stats in gathered:
            self._merge(*stats.cpu().tolist())

    def normalize(self, values: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8,
                  clip: float | None = None) -> torch.Tensor:
        """``(values - mean) / (std + eps)`` (no mean shift if ``shift_mean=False``), optionally clipped to
        ``[-clip, clip]``. Returns float32 on the input's device."""
        if self.count == 0:
            raise RuntimeError("RunningMeanStd.normalize() called before any update(); update it with rewards first")
        if clip is not None and not clip > 0:
            raise ValueError(f"RunningMeanStd.normalize(clip={clip}); must be > 0 or None")
        out = values.double()
        if shift_mean:
            out = out - self.mean
        out = out / (self.std + eps)
        if clip is not None:
            out = out.clamp(-clip, clip)
        return out.float()

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        missing = {"count", "mean", "m2"} - set(state)
        if missing:
            raise ValueError(f"RunningMeanStd.load_state_dict: missing keys {sorted(missing)}")
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


def clip_rewards(rewards: torch.Tensor, *, min_value: float | None = None,
                 max_value: float | None = None) -> torch.Tensor:
    """Clamp ``rewards [N]`` to ``[min_value, max_value]`` (either bound may be None)."""
    if min_value is not None and max_value is not None and min_value > max_value:
        raise ValueError(f"clip_rewards(min_value={min_value}, max_value={max_value}); min_value must be <= max_value")
    return rewards.clamp(min=min_value, max=max_value)


def overlong_penalty(response_lengths: torch.Tensor | Sequence[int], *, max_length: int, buffer_length: int,
                     penalty: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment, to be added to the rewards.

    With ``expected = max_length - buffer_length``: 0 for ``length <= expected``; ``-penalty * (length -
    expected) / buffer_length`` inside the buffer (linear from 0 to ``-penalty`` at ``max_length``);
    ``-penalty`` beyond ``max_length``.

    Args:
        response_lengths: ``[N]`` response tokens per sample.
        max_length: the generation limit (``max_new_tokens``).
        buffer_length: the last tokens before ``max_length`` that are punished, ``1 <= buffer_length <= max_length``.
        penalty: the largest punishment (DAPO uses 1).

    Returns:
        ``[N]`` float32, values in ``[-penalty, 0]``.
    """
    if not 1 <= buffer_length <= max_length:
        raise ValueError(f"overlong_penalty(buffer_length={buffer_length}, max_length={max_length}); need "
                         "1 <= buffer_length <= max_length")
    if penalty < 0:
        raise ValueError(f"overlong_penalty(penalty={penalty}); must be >= 0 (it is subtracted)")
    lengths = torch.as_tensor(response_lengths).float()
    expected = max_length - buffer_length
    return (-penalty * (lengths - expected).clamp(min=0, max=buffer_length) / buffer_length).float()
