"""Memory-bounded token log-probs and entropy from logits (private; use :mod:`rlhfkit.losses`).

The naive ``log_softmax(logits.float())`` materialises a ``[T, V]`` float32 tensor, keeps it for backward, and its
backward allocates two more ``[T, V]`` float32 tensors; at V ≈ 150k that dominates a training step's memory. Here a
custom autograd Function works on chunks of rows: forward upcasts one chunk at a time and keeps only the ``[T]``
log-sum-exp; backward recomputes the softmax of each chunk and writes its gradient straight into a ``[T, V]`` buffer
of the logits' dtype (or, with ``inplace_backward=True``, into the logits themselves). Peak extra memory is one
float32 chunk in forward and the gradient buffer plus one float32 chunk in backward. A row whose output gradient is
zero (a masked-out prompt or padding row) gets an exactly zero gradient even when its logits hold NaN or inf: its
softmax is not used there, so a non-finite logit outside the loss mask never reaches the parameters. Torch only.
"""

from __future__ import annotations

import math

import torch

from rlhfkit._cu_seqlens import host_copy

__all__ = ["token_logprobs", "entropy_from_logits", "DEFAULT_CHUNK_ELEMENTS"]

# Rows per chunk default to about this many logits. On CPU a float32 chunk of 2 MiB stays in L2 cache, so the
# several passes over it (upcast, exp, sum, scale, downcast) cost about one trip through DRAM: measured faster than
# the unchunked log_softmax. On GPUs the chunk is larger (64 MiB) to keep kernel launches few.
DEFAULT_CHUNK_ELEMENTS = {"cpu": 1 << 19, "other": 1 << 24}


def _rows_per_chunk(chunk_size: int | None, logits: torch.Tensor) -> int:
    if chunk_size is None:
        budget = DEFAULT_CHUNK_ELEMENTS["cpu" if logits.device.type == "cpu" else "other"]
        return max(1, budget // max(logits.shape[1], 1))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r}; must be an int >= 1 (rows per chunk) or None for automatic")
    return chunk_size


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 logits, float64 for float64 ones."""
    return torch.promote_types(logits.dtype, torch.float32)


def _scaled_chunk(logits: torch.Tensor, start: int, stop: int, temperature: float) -> torch.Tensor:
    """A fresh float32 (float64 for float64 logits) copy of ``logits[start:stop] / temperature``, safe to modify."""
    chunk = logits[start:stop].to(_compute_dtype(logits), copy=True)
    if temperature != 1.0:
        chunk.div_(temperature)
    return chunk


def check_logits(logits: object, temperature: float) -> None:
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating [T, V] tensor, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)} {getattr(logits, 'dtype', '')}")
    if logits.shape[1] == 0:
        raise ValueError("logits has a vocabulary of size 0; expected [T, V] with V >= 1")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
            or not math.isfinite(temperature):
        raise ValueError(f"temperature={temperature!r}; must be a finite number > 0 (greedy sampling has "
                         "no log-probs; use 1.0)")


class _ChunkedLogProbs(torch.autograd.Function):
    """``log_softmax(logits / temperature)[t, labels[t]]`` chunk by chunk; backward recomputes per chunk."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, rows, inplace_backward):  # noqa: D102
        out = torch.empty(logits.shape[0], dtype=_compute_dtype(logits), device=logits.device)
        lse = torch.empty_like(out)
        for start in range(0, logits.shape[0], rows):
            stop = min(start + rows, logits.shape[0])
            chunk = _scaled_chunk(logits, start, stop, temperature)
            lse[start:stop] = torch.logsumexp(chunk, dim=-1)
            out[start:stop] = chunk.gather(1, labels[start:stop, None]).squeeze(1) - lse[start:stop]
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.rows, ctx.inplace_backward = temperature, rows, inplace_backward
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        logits, labels, lse = ctx.saved_tensors
        grad = logits.detach() if ctx.inplace_backward else torch.empty_like(logits)
        grad_out = grad_out.to(_compute_dtype(logits))
        for start in range(0, logits.shape[0], ctx.rows):
            stop = min(start + ctx.rows, logits.shape[0])
            g = grad_out[start:stop, None]
            # d logp[label] / d x = onehot(label) - softmax(x); x = logits / temperature
            probs = _scaled_chunk(logits, start, stop, ctx.temperature).sub_(lse[start:stop, None]).exp_()
            # rows with no gradient (outside the loss mask) must give 0, not 0 * NaN from a non-finite logit; a
            # finite row's softmax times a zero gradient is the same signed zero as 0 times it, so finite inputs
            # give the same bits as without this fill
            probs.masked_fill_(g == 0, 0.0)
            probs.mul_(-g).scatter_add_(1, labels[start:stop, None], g)
            if ctx.temperature != 1.0:
                probs.div_(ctx.temperature)
            grad[start:stop].copy_(probs)
        return grad, None, None, None, None


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy of ``softmax(logits / temperature)`` per row, chunk by chunk; backward recomputes per chunk."""

    @staticmethod
    def forward(ctx, logits, temperature, rows):  # noqa: D102
        out = torch.empty(logits.shape[0], dtype=_compute_dtype(logits), device=logits.device)
        for start in range(0, logits.shape[0], rows):
            stop = min(start + rows, logits.shape[0])
            chunk = _scaled_chunk(logits, start, stop, temperature)
            lse = torch.logsumexp(chunk, dim=-1)
            # H = lse - sum(p * x); computed as sum(p * (lse - x)) without a second [rows, V] buffer
            mean_x = torch.softmax(chunk, dim=-1).mul_(chunk).sum(-1)
            out[start:stop] = lse - mean_x
        ctx.save_for_backward(logits)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        (logits,) = ctx.saved_tensors
        grad = torch.empty_like(logits)
        grad_out = grad_out.to(_compute_dtype(logits))
        for start in range(0, logits.shape[0], ctx.rows):
            stop = min(start + ctx.rows, logits.shape[0])
            chunk = _scaled_chunk(logits, start, stop, ctx.temperature)
            probs = torch.softmax(chunk, dim=-1)
            mean_x = (probs * chunk).sum(-1, keepdim=True)
            # dH/dx_j = -p_j (x_j - E_p[x]); chain rule through x = logits / temperature
            g = grad_out[start:stop, None]
            chunk.sub_(mean_x).mul_(probs).mul_(-g / ctx.temperature)
            # a row with no gradient (outside the loss mask) gives 0 even with a non-finite logit (0 * NaN there);
            # finite rows never hold NaN here, so their bits are unchanged
            chunk.masked_fill_(chunk.isnan() & (g == 0), 0.0)
            grad[start:stop].copy_(chunk)
        return grad, None, None


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                   chunk_size: int | None = None, inplace_backward: bool = False) -> torch.Tensor:
    """``log softmax(logits[t] / temperature)[labels[t]]`` for every row, without a ``[T, V]`` float32 tensor.

    Args:
        logits: ``[T, V]`` float (any float dtype; each chunk is upcast to float32).
        labels: ``[T]`` int64 token ids in ``[0, V)``.
        temperature: divide the logits by this before the softmax (match the sampler's temperature).
        chunk_size: rows per chunk; None picks about 512K logits per chunk on CPU, 16M on GPUs.
        inplace_backward: write the gradient into ``logits`` during backward instead of a new buffer (saves a
            ``[T, V]`` tensor). Only when nothing else needs the logits afterwards; autograd raises if a saved copy
            of them is used later.

    Returns:
        ``[T]`` float32 log-probs (float64 for float64 logits), differentiable with respect to ``logits``.
    """
    check_logits(logits, temperature)
    if not isinstance(labels, torch.Tensor) or labels.ndim != 1 or labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be a [T] int64 tensor, got {getattr(labels, 'shape', type(labels).__name__)} "
                         f"{getattr(labels, 'dtype', '')}")
    if labels.shape[0] != logits.shape[0]:
        raise ValueError(f"labels has {labels.shape[0]} entries but logits has {logits.shape[0]} rows; they must match")
    if labels.numel():
        host = host_copy(labels)  # the bounds from the host copy when there is one, else one device sync for both
        low, high = (int(value) for value in torch.aminmax(host if host is not None else labels))
        if low < 0 or high >= logits.shape[1]:
            raise ValueError(f"labels must be token ids in [0, {logits.shape[1]}) (the vocabulary of logits), got "
                             f"range [{low}, {high}]")
    rows = _rows_per_chunk(chunk_size, logits)
    return _ChunkedLogProbs.apply(logits, labels.long(), float(temperature), rows, bool(inplace_backward))


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0,
                        chunk_size: int | None = None) -> torch.Tensor:
    """``[T]`` entropy of ``softmax(logits / temperature)`` per row, chunked like :func:`token_logprobs`.

    float32 (float64 for float64 logits), differentiable with respect to ``logits``.
    """
    check_logits(logits, temperature)
    return _ChunkedEntropy.apply(logits, float(temperature), _rows_per_chunk(chunk_size, logits))
