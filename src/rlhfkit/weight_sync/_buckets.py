"""Bucket buffers and fingerprints of the weight-sync channel (private to :mod:`rlhfkit.weight_sync`). torch only.

Fingerprint: the payload is read as integer words (``int64`` for a bucket, whose payload is a multiple of 256 bytes;
the widest integer view for a lone tensor), grouped in rows of 32 words; the fingerprint is
``sum_r rowsum_r * (2r + 1)`` in wrap-around ``int64`` arithmetic. Integer sums are exact modulo 2**64 whatever the
reduction order, so sender and receiver agree bit for bit on the same device type. It catches any single changed
word (so any bit flip, and any swap of two different elements that share a word), data shifted by a row or more (a
wrong offset) and a swap of two different words in different rows; it does not catch a swap of two whole 8-byte words
inside one 256-byte row. Cost: one read of the payload by one row-sum kernel per bucket (up to 64M words, 512 MiB, in
one step) plus two tiny kernels; temporaries are 1/32 of the payload (16 MiB for a 512 MiB bucket) plus a cached
row-weight vector of the same size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhfkit.weight_sync._manifest import TAIL_BYTES, Bucket, Manifest, TensorSpec

__all__ = ["Fingerprinter", "BucketSlots", "as_words", "STATUS_OK", "STATUS_ABORT"]

STATUS_OK = 0
STATUS_ABORT = 1
_ROW = 32
_CHUNK = 1 << 26  # int64 words per step (512 MiB); a multiple of _ROW
_CHUNK_CONVERTED = 1 << 22  # narrower words per step (their int64 copy is a temporary); a multiple of _ROW
_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def as_words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a 1-D integer tensor of the widest word size that divides its byte count."""
    flat = tensor.detach().contiguous().reshape(-1)
    raw = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    nbytes = raw.numel()
    for size, dtype in _WORD_DTYPES:
        if nbytes % size == 0:
            return raw.view(dtype)
    raise AssertionError("unreachable: every byte count is divisible by 1")


class Fingerprinter:
    """Computes fingerprints on the payload's device; caches the row-weight vector per device (1/32 of the largest
    payload, at least 1 MiB)."""

    def __init__(self) -> None:
        self._weights: dict[torch.device, torch.Tensor] = {}

    def _row_weights(self, count: int, device: torch.device) -> torch.Tensor:
        cached = self._weights.get(device)
        if cached is None or cached.numel() < count:
            size = max(count, 1 << 17)
            cached = torch.arange(1, 2 * size, 2, dtype=torch.int64, device=device)
            self._weights[device] = cached
        return cached[:count]

    def of_words(self, words_list: Sequence[torch.Tensor]) -> torch.Tensor:
        """Fingerprint of the concatenation of 1-D integer tensors (rows never straddle two of them)."""
        device = words_list[0].device if words_list else torch.device("cpu")
        total = None
        row_offset = 0
        for words in words_list:
            step = _CHUNK if words.dtype == torch.int64 else _CHUNK_CONVERTED
            for start in range(0, words.numel(), step):
                chunk = words[start : start + step]
                if chunk.dtype != torch.int64:
                    chunk = chunk.to(torch.int64)
                full = chunk.numel() - chunk.numel() % _ROW
                rows = chunk[:full].view(-1, _ROW).sum(dim=1)
                if full < chunk.numel():
                    rows = torch.cat([rows, chunk[full:].sum().view(1)])
                weights = self._row_weights(rows.numel(), rows.device)
                part = (rows * weights).sum()
                if row_offset:
                    part += rows.sum() * (2 * row_offset)
                total = part if total is None else total + part
                row_offset += rows.numel()
        return torch.zeros((), dtype=torch.int64, device=device) if total is None else total

    def of_payload(self, buffer: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return self.of_words([buffer[: bucket.payload_bytes].view(torch.int64)])

    def of_tensors(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.of_words([as_words(t) for t in tensors if t.numel()])


def _views(buffer: torch.Tensor, specs: Sequence[TensorSpec], bucket: Bucket) -> list[torch.Tensor]:
    views = []
    for spec, offset in zip(specs[bucket.start : bucket.stop], bucket.offsets, strict=True):
        views.append(buffer.narrow(0, offset, spec.nbytes).view(spec.dtype).view(spec.shape))
    return views


class BucketSlots:
    """``num_slots`` flat ``uint8`` buffers of one capacity, and cached typed views of each bucket into them.

    Bucket ``k`` always lives in slot ``k % num_slots``. Buffers are allocated (zeroed) or adopted (CUDA IPC
    receiver) once and reused across syncs until a larger capacity is needed.
    """

    def __init__(self, device: torch.device, num_slots: int) -> None:
        self.device = device
        self.num_slots = num_slots
        self.buffers: list[torch.Tensor] = []
        self._layout: tuple | None = None
        self._views: dict[int, list[torch.Tensor]] = {}

    @property
    def capacity(self) -> int:
        return self.buffers[0].numel() if self.buffers else 0

    def ensure(self, capacity: int) -> bool:
        """Make sure the buffers hold ``capacity`` bytes; returns True when they were (re)allocated."""
        if self.buffers and self.capacity >= capacity:
            return False
        self.release()
        self.buffers = [torch.zeros(capacity, dtype=torch.uint8, device=self.device) for _ in range(self.num_slots)]
        return True

    def adopt(self, buffers: list[torch.Tensor]) -> None:
        self.release()
        self.buffers = list(buffers)
        self.num_slots = len(buffers)

    def release(self) -> None:
        self.buffers = []
        self._layout = None
        self._views = {}

    def views(self, manifest: Manifest, bucket: Bucket) -> list[torch.Tensor]:
        """Typed views of ``bucket``'s tensors in its slot (valid until the slot is refilled)."""
        layout = (manifest.specs, manifest.buckets, self.capacity, self.num_slots)
        if self._layout != layout:
            self._layout, self._views = layout, {}
        views = self._views.get(bucket.index)
        if views is None:
            buffer = self.buffers[bucket.index % self.num_slots]
            views = self._views[bucket.index] = _views(buffer, manifest.specs, bucket)
        return views

    def buffer(self, bucket: Bucket) -> torch.Tensor:
        return self.buffers[bucket.index % self.num_slots]

    def wire(self, bucket: Bucket) -> torch.Tensor:
        """The bytes that travel for ``bucket``: payload then tail."""
        return self.buffer(bucket)[: bucket.payload_bytes + TAIL_BYTES]

    def tail(self, bucket: Bucket) -> torch.Tensor:
        """``int64[2]``: fingerprint, status."""
        start = bucket.payload_bytes
        return self.buffer(bucket)[start : start + TAIL_BYTES].view(torch.int64)

    def write_tail(self, bucket: Bucket, fingerprint: torch.Tensor | None, status: int) -> None:
        tail = self.tail(bucket)
        tail[1:].fill_(status)
        if fingerprint is None:
            tail[:1].zero_()
        else:
            tail[:1].copy_(fingerprint.view(1))
