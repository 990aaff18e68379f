"""Validation shared by :mod:`rlhfkit.packing` and :mod:`rlhfkit.losses` (torch only)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_cu_seqlens", "token_shape_hint", "check_logprob_values", "CONVENTION", "LOGPROB_TOLERANCE",
           "attach_host_copy", "host_copy", "host_values", "cu_end", "repeat_counts", "segment_ids"]

# Log-probs are <= 0; rounding in a float32 log_softmax can give a hair above 0, never more than this.
LOGPROB_TOLERANCE = 1e-3


# Host copies of device tensors. A batch moved to the GPU (``PackedBatch.to`` / ``Experience.to``) keeps the host
# tensor it came from on each moved tensor, so the checks and shapes that need values (sequence boundaries, the
# loss-token positions, token-id bounds) read them there instead of waiting for the GPU: every such read of a device
# tensor is a synchronisation that stalls the host until all queued kernels have run.
_HOST_ATTR = "_rlhfkit_host_copy"


def repeat_counts(values: torch.Tensor, counts: torch.Tensor, *, total: int | None = None) -> torch.Tensor:
    """``torch.repeat_interleave(values, counts)`` for 1-D tensors (``total``: the output's length, when known).

    On the CPU it goes through NumPy's ``repeat``, which runs on the calling thread: torch's CPU kernel starts an
    OpenMP team whatever the size, and on a machine whose cores the engines and trainers keep busy each call waited
    milliseconds for it (the packing helpers call it per micro-batch in the driver). Tensors that need gradients,
    devices other than the CPU, and a process without NumPy take torch's kernel.
    """
    if values.device.type == "cpu" and counts.device.type == "cpu" and not values.requires_grad:
        np = _numpy()
        if np is not None and values.dtype in _NUMPY_DTYPES:
            return torch.from_numpy(np.repeat(values.numpy(), counts.numpy()))
    return torch.repeat_interleave(values, counts, output_size=total)


def segment_ids(cu_seqlens: torch.Tensor, *, total: int | None = None) -> torch.Tensor:
    """``[cu[-1]]`` int64: the sequence of each token of the packed stream ``cu_seqlens`` describes."""
    cu = cu_seqlens.long()
    return repeat_counts(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1], total=total)


_NUMPY_DTYPES = (torch.int64, torch.int32, torch.float32, torch.float64, torch.bool)


def _numpy() -> Any:  # the numpy module, or None: rlhfkit's core needs torch only
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def attach_host_copy(tensor: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """Record ``host`` (same values, on the CPU) as the host copy of ``tensor``; returns ``tensor``. Valid until
    either is modified in place (its version counter moves on)."""
    if tensor.device.type != "cpu":
        setattr(tensor, _HOST_ATTR, (host, host._version, tensor._version))
    return tensor


def host_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s values on the CPU without a device synchronisation, or None when not known: the tensor itself on
    the CPU, else the copy recorded by :func:`attach_host_copy` if the tensor was not modified since."""
    if tensor.device.type == "cpu":
        return tensor
    recorded = getattr(tensor, _HOST_ATTR, None)
    if recorded is not None and recorded[1] == recorded[0]._version and recorded[2] == tensor._version:
        return recorded[0]
    return None


def host_values(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values on the CPU: :func:`host_copy` when known, else one copy from the device."""
    host = host_copy(tensor)
    return host if host is not None else tensor.detach().cpu()


def cu_end(cu_seqlens: torch.Tensor) -> int:
    """``cu_seqlens[-1]`` (the real tokens of a packed stream), read from the host copy when there is one."""
    host = host_copy(cu_seqlens)
    return int(host[-1]) if host is not None else int(cu_seqlens[-1])


def check_cu_seqlens(cu_seqlens: object, num_tokens: int | None, *, name: str = "cu_seqlens") -> torch.Tensor:
    """Validate ``cu_seqlens`` ([N + 1] int, from 0, strictly increasing, ends <= num_tokens); return it as int64
    (a device tensor keeps its host copy: see :func:`host_copy`). Reads the values once, from the host copy when
    there is one."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer torch.Tensor of sequence boundaries, got "
                        f"{type(cu_seqlens).__name__}")
    if cu_seqlens.ndim != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got shape {tuple(cu_seqlens.shape)} dtype "
                         f"{cu_seqlens.dtype}")
    values = host_values(cu_seqlens).tolist()
    if len(values) < 2:
        raise ValueError(f"{name}={values} describes no sequence; an empty batch is invalid")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0]={values[0]}")
    bad = next((i for i in range(len(values) - 1) if values[i + 1] <= values[i]), None)
    if bad is not None:
        raise ValueError(f"{name} must be strictly increasing (no empty sequences); sequence {bad} has length "
                         f"{values[bad + 1] - values[bad]}")
    if num_tokens is not None and values[-1] > num_tokens:
        raise ValueError(f"{name}[-1]={values[-1]} exceeds the {num_tokens} tokens of the packed stream")
    cu = cu_seqlens.long()
    if cu.device.type != "cpu" and host_copy(cu) is None:  # the next reads of these boundaries need no wait
        attach_host_copy(cu, torch.tensor(values, dtype=torch.long))
    return cu


CONVENTION = ("rlhfkit aligns a token's log-prob at the token's own position: log p(token_t | tokens_<t) is stored at "
              "index t, and index 0 of each sequence is unused (0; the first token is a prompt token)")


def token_shape_hint(name: str, value: object, num_tokens: int, num_seqs: int | None = None) -> str:
    """Why ``value`` (meant to be a packed ``[T]`` per-token tensor) has the wrong shape, and how to convert it.

    Recognises the two common mistakes of people coming from HF: a padded ``[B, L]`` (or shifted ``[B, L - 1]``)
    tensor, and HF-style shifted log-probs one entry shorter per sequence (``T - N`` entries). "" when neither fits.
    """
    shape = tuple(getattr(value, "shape", ()))
    if len(shape) == 2:
        return (f" {name} looks like a padded [B, L] batch {shape}; rlhfkit takes packed [T] tensors (all sequences "
                "end to end) with cu_seqlens [N + 1]. Flatten with rlhfkit.packing.pack_padded(input_ids, "
                "attention_mask, prompt_lengths=..., logprobs=...) -> (PackedBatch, packed log-probs), or "
                "rlhfkit.packing.unpad_to_packed(x, seq_lens, side=...) for any other per-token tensor; a [B, L - 1] "
                f"tensor of HF-style shifted log-probs is accepted by pack_padded's logprobs= ({CONVENTION}).")
    if len(shape) == 1 and num_seqs is not None and shape[0] == num_tokens - num_seqs:
        return (f" {name} has {num_tokens} - {num_seqs} entries, one fewer per sequence: HF-style shifted log-probs "
                f"(entry j = log p(token j+1)). {CONVENTION}. Insert a 0 at each sequence start, e.g. "
                "torch.cat([torch.cat([x.new_zeros(1), s]) for s in x.split((seq_lens - 1).tolist())]), or let "
                "rlhfkit compute them (rlhfkit.losses.packed_logprobs / model_logprobs) or convert a padded batch "
                "with rlhfkit.packing.pack_padded(..., logprobs=...).")
    return ""


def check_logprob_values(what: str, values: torch.Tensor, *, where: str) -> None:
    """Raise when a 1-D tensor of log-probs has an entry ``> LOGPROB_TOLERANCE``; ``where`` names its owner."""
    above = values.detach() > LOGPROB_TOLERANCE
    if bool(above.any()):
        position = int(torch.nonzero(above)[0])
        raise ValueError(f"{what}[{position}]={values[position].item():.4g} > 0 ({where}); log-probs are <= 0 "
                         f"({int(above.sum())} positive entries). Pass log-probabilities (log_softmax at the sampled "
                         "token), not probabilities or logits")
