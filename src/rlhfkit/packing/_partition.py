"""Token-budget micro-batch partitioning and global loss-normalisation counts (re-exported by rlhfkit.packing).

Torch only; :func:`global_counts` all-reduces over a ``torch.distributed`` group when one is passed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from rlhfkit._cu_seqlens import check_cu_seqlens, segment_ids
from rlhfkit.types import PackedBatch

__all__ = ["partition_by_token_budget", "global_counts"]


def _check_lengths(seq_lens: Sequence[int] | torch.Tensor) -> list[int]:
    lengths = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    if not lengths:
        raise ValueError("seq_lens is empty; there is nothing to partition")
    for i, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"seq_lens[{i}]={length!r}; every length must be an int >= 1")
    return lengths


def _lpt(lengths: list[int], num_bins: int, capacity: float) -> list[list[int]] | None:
    """Longest-first into the least-loaded bin; None when some sequence fits in no bin under ``capacity``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in order:
        load, b = heapq.heappop(heap)
        if load + lengths[i] > capacity:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return bins


def _best_exchange(heavy: list[int], light: list[int], lengths: list[int], gap: int,
                   room: float) -> tuple[int | None, int | None, int]:
    """The move (light item None) or swap between two bins that most reduces |load difference|; 0 gain if none."""
    best: tuple[int | None, int | None, int] = (None, None, 0)
    best_spread = gap
    candidates = [(a, None, lengths[a]) for a in heavy] if len(heavy) > 1 else []
    candidates += [(a, b, lengths[a] - lengths[b]) for a in heavy for b in light if lengths[a] > lengths[b]]
    for a, b, delta in candidates:
        if 0 < delta < gap and delta <= room and abs(gap - 2 * delta) < best_spread:
            best, best_spread = (a, b, delta), abs(gap - 2 * delta)
    return best


def _refine(bins: list[list[int]], lengths: list[int], capacity: float, rounds: int = 64) -> None:
    """Improve LPT in place: move or swap sequences between the heaviest and the lightest bin while it helps."""
    for _ in range(rounds):
        loads = [sum(lengths[i] for i in b) for b in bins]
        heavy = max(range(len(bins)), key=loads.__getitem__)
        light = min(range(len(bins)), key=loads.__getitem__)
        gap = loads[heavy] - loads[light]
        if gap <= 1:
            return
        a, b, delta = _best_exchange(bins[heavy], bins[light], lengths, gap, capacity - loads[light])
        if a is None:
            return
        bins[heavy].remove(a)
        bins[light].append(a)
        if b is not None:
            bins[light].remove(b)
            bins[heavy].append(b)


def partition_by_token_budget(seq_lens: Sequence[int] | torch.Tensor, *, max_tokens: int | None = None,
                              num_micro_batches: int | None = None) -> list[list[int]]:
    """Split sequences into balanced micro-batches; returns lists of sequence indices (each sorted ascending).

    Longest-first assignment to the least-loaded micro-batch (LPT), then moves/swaps between the heaviest and the
    lightest micro-batch while that lowers the spread.

    Args:
        seq_lens: ``[N]`` sequence lengths (tokens each micro-batch's forward will process).
        max_tokens: token budget per micro-batch; the fewest micro-batches that respect it are used.
        num_micro_batches: exact number of micro-batches when given alone; with ``max_tokens`` it is a minimum
            (use it to give every data-parallel rank the same count). At least one of the two is required.
    """
    lengths = _check_lengths(seq_lens)
    if max_tokens is None and num_micro_batches is None:
        raise ValueError("give max_tokens, num_micro_batches, or both")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r}; must be an int >= 1")
        too_long = [i for i, length in enumerate(lengths) if length > max_tokens]
        if too_long:
            i = too_long[0]
            raise ValueError(f"seq_lens[{i}]={lengths[i]} exceeds max_tokens={max_tokens}; raise max_tokens to at "
                             f"least {max(lengths)} or truncate the sequence")
    if num_micro_batches is not None:
        if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
            raise ValueError(f"num_micro_batches={num_micro_batches!r}; must be an int >= 1")
        if num_micro_batches > len(lengths):
            raise ValueError(f"num_micro_batches={num_micro_batches} exceeds the {len(lengths)} sequences; a "
                             "micro-batch cannot be empty")
    capacity = math.inf if max_tokens is None else max_tokens
    num_bins = max(num_micro_batches or 1, math.ceil(sum(lengths) / capacity) if max_tokens else 1)
    bins = _lpt(lengths, num_bins, capacity)
    while bins is None:  # ends by len(lengths) bins at the latest: every sequence fits alone
        num_bins += 1
        bins = _lpt(lengths, num_bins, capacity)
    _refine(bins, lengths, capacity)
    result = [sorted(b) for b in bins if b]
    return sorted(result, key=lambda b: b[0])


def global_counts(batch_or_mask: PackedBatch | torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
                  group: object | None = None) -> tuple[float, float]:
    """Loss tokens and sequences with at least one loss token, summed over ``group`` when given.

    Pass these as ``num_tokens`` / ``num_seqs`` to :mod:`rlhfkit.losses` on every rank and micro-batch so the summed
    gradients equal the whole-batch gradient.

    Args:
        batch_or_mask: a :class:`PackedBatch` (its ``loss_mask`` and ``cu_seqlens``) or a ``[T]`` bool mask.
        cu_seqlens: ``[N + 1]`` boundaries; required with a mask, not allowed with a batch.
        group: a ``torch.distributed`` process group to all-reduce (sum) over; None counts locally.
    """
    if isinstance(batch_or_mask, PackedBatch):
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens must be None when batch_or_mask is a PackedBatch (it brings its own)")
        mask, cu_seqlens = batch_or_mask.loss_mask, batch_or_mask.cu_seqlens
    else:
        mask = batch_or_mask
        if not isinstance(mask, torch.Tensor) or mask.ndim != 1 or mask.dtype != torch.bool:
            raise ValueError(f"batch_or_mask must be a PackedBatch or a [T] bool tensor, got "
                             f"{getattr(mask, 'shape', type(mask).__name__)} {getattr(mask, 'dtype', '')}")
        if cu_seqlens is None:
            raise ValueError("cu_seqlens is required when batch_or_mask is a mask")
    cu = check_cu_seqlens(cu_seqlens, mask.numel()).to(mask.device)
    end = int(cu[-1])
    if bool(mask[end:].any()):
        raise ValueError(f"batch_or_mask is True after cu_seqlens[-1]={end} (padding); padding is never in the loss")
    seq_ids = segment_ids(cu, total=end)
    per_seq = torch.zeros(cu.numel() - 1, dtype=torch.float64, device=mask.device)
    per_seq.index_add_(0, seq_ids, mask[:end].double())
    counts = torch.stack([per_seq.sum(), (per_seq > 0).double().sum()])
    if group is not None:
        import torch.distributed as dist

        if dist.get_backend(group) == "nccl":
            counts = counts.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return float(counts[0]), float(counts[1])
