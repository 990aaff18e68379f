"""Bucket buffers of the weight-sync channel (private to :mod:`rlhfkit.weight_sync`). Needs only torch.

A bucket buffer is a flat ``uint8`` tensor: the bucket's tensors at the manifest's offsets, then an 8-byte tail
(``int64`` status: :data:`STATUS_OK`, or :data:`STATUS_ABORT` when the sender gave up mid-stream, so that a broadcast
tells gloo/NCCL receivers to stop).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhfkit.weight_sync._manifest import TAIL_BYTES, Bucket, Manifest, TensorSpec

__all__ = ["BucketSlots", "STATUS_OK", "STATUS_ABORT"]

STATUS_OK = 0
STATUS_ABORT = 1


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

    def status(self, bucket: Bucket) -> int:
        start = bucket.payload_bytes
        return int(self.buffer(bucket)[start : start + TAIL_BYTES].view(torch.int64).item())

    def write_status(self, bucket: Bucket, status: int) -> None:
        start = bucket.payload_bytes
        self.buffer(bucket)[start : start + TAIL_BYTES].view(torch.int64).fill_(status)
