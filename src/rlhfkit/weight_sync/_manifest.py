"""Tensor specs, the sync manifest and its bucket layout (private to :mod:`rlhfkit.weight_sync`). Needs only torch.

A manifest is computed on the sender from a cheap *description* of the stream — ``(name, shape, dtype)`` per tensor,
in stream order — before any tensor is gathered. It fixes the bucket layout: tensors are laid end to end in a flat
``uint8`` bucket, each at a 256-byte aligned offset, and a new bucket starts when the next tensor would overflow
``bucket_bytes``. Every bucket ends with an 8-byte tail (an ``int64`` status). A tensor larger than
``bucket_bytes`` gets a bucket of its own, so a bucket buffer holds ``max(bucket_bytes, largest tensor) + 8`` bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["ALIGN", "TAIL_BYTES", "TensorSpec", "Bucket", "Manifest", "to_spec", "describe_parameters", "plan_buckets",
           "compare_manifest", "dtype_name", "dtype_from_name"]

ALIGN = 256
TAIL_BYTES = 8


class TensorSpec(NamedTuple):
    """One tensor of a sync stream: its name, shape and the dtype it travels in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        return f"{tuple(self.shape)} {dtype_name(self.dtype)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in a weight-sync manifest")
    return dtype


def to_spec(item: object, *, where: str = "description") -> TensorSpec:
    """Validate ``(name, shape, dtype)`` (a tuple or a :class:`TensorSpec`) and return a :class:`TensorSpec`."""
    if not isinstance(item, tuple) or len(item) != 3:
        raise TypeError(f"{where}: each entry must be a (name, shape, dtype) tuple, got {item!r}")
    name, shape, dtype = item
    if not isinstance(name, str) or not name:
        raise TypeError(f"{where}: tensor name must be a non-empty str, got {name!r}")
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError as error:
        raise TypeError(f"{where}: shape of {name!r} must be a sequence of ints, got {shape!r}") from error
    if any(d < 0 for d in dims):
        raise ValueError(f"{where}: shape of {name!r} has a negative dimension: {dims}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{where}: dtype of {name!r} must be a torch.dtype, got {dtype!r}")
    return TensorSpec(name, dims, dtype)


def describe_parameters(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None = None
) -> list[TensorSpec]:
    """Describe a model's named parameters (or any named tensors) without gathering them.

    Uses ``tensor.ds_shape`` when present (DeepSpeed ZeRO-3 partitioned parameters report their full shape there).
    ``dtype``: floating-point tensors are described in this dtype (what the sender casts them to); others keep theirs.
    """
    specs = []
    for name, tensor in named_tensors:
        full = getattr(tensor, "ds_shape", None)
        shape = tuple(int(d) for d in full) if full else tuple(tensor.shape)
        travel = dtype if dtype is not None and tensor.dtype.is_floating_point else tensor.dtype
        specs.append(TensorSpec(name, shape, travel))
    return specs


@dataclass(frozen=True)
class Bucket:
    """Tensors ``[start, stop)`` of the manifest, at byte ``offsets`` in the bucket; the tail sits at
    ``payload_bytes`` (a multiple of 256)."""

    index: int
    start: int
    stop: int
    offsets: tuple[int, ...]
    payload_bytes: int


def _align(value: int) -> int:
    return (value + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> tuple[tuple[Bucket, ...], int]:
    """Greedy layout in stream order; returns the buckets and the buffer capacity in bytes (payload + tail)."""
    buckets: list[Bucket] = []
    start, offsets, cursor = 0, [], 0
    for i, spec in enumerate(specs):
        size = _align(spec.nbytes)
        if offsets and cursor + size > bucket_bytes:
            buckets.append(Bucket(len(buckets), start, i, tuple(offsets), cursor))
            start, offsets, cursor = i, [], 0
        offsets.append(cursor)
        cursor += size
    if offsets:
        buckets.append(Bucket(len(buckets), start, len(specs), tuple(offsets), cursor))
    payload = max((b.payload_bytes for b in buckets), default=0)
    return tuple(buckets), payload + TAIL_BYTES


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What one sync will move, agreed on by both ends before the first byte of weights.

    Attributes:
        version: the weight version this sync installs (the sender's counter; +1 per sync).
        specs: the tensors in stream order.
        buckets: the bucket layout (see the module docstring).
        capacity: bytes of one bucket buffer.
        num_slots: how many bucket buffers the sender cycles through (1, or 2 for overlap).
        generation: CUDA IPC only: which shared-buffer generation the buckets live in.
    """

    version: int
    specs: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    capacity: int
    num_slots: int = 1
    generation: int = 0

    @property
    def total_bytes(self) -> int:
        """The specs' bytes in their travel dtypes."""
        return sum(spec.nbytes for spec in self.specs)

    def tensor_names(self, bucket: Bucket) -> list[str]:
        return [spec.name for spec in self.specs[bucket.start : bucket.stop]]

    def to_bytes(self) -> bytes:
        body = {"version": self.version, "specs": [[s.name, list(s.shape), dtype_name(s.dtype)] for s in self.specs],
                "buckets": [[b.start, b.stop, list(b.offsets), b.payload_bytes] for b in self.buckets],
                "capacity": self.capacity, "num_slots": self.num_slots, "generation": self.generation}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        body = json.loads(data)
        specs = tuple(TensorSpec(n, tuple(s), dtype_from_name(d)) for n, s, d in body.pop("specs"))
        buckets = tuple(Bucket(i, a, b, tuple(o), p) for i, (a, b, o, p) in enumerate(body.pop("buckets")))
        return cls(specs=specs, buckets=buckets, **body)


def compare_manifest(manifest: Manifest, expected: Sequence[TensorSpec] | None) -> list[str]:
    """Differences between what the sender will send and what a receiver accepts, one line per tensor."""
    if expected is None:
        return []
    sent = {spec.name: spec for spec in manifest.specs}
    accepted = {spec.name: spec for spec in expected}
    problems = []
    if len(sent) != len(manifest.specs):
        problems.append("the sender's stream names some tensor more than once")
    for name, spec in sent.items():
        want = accepted.get(name)
        if want is None:
            problems.append(f"tensor {name!r} ({spec.describe()}) is sent but the receiver has no such tensor")
        elif tuple(want.shape) != tuple(spec.shape):
            problems.append(f"tensor {name!r} has shape {tuple(spec.shape)} on the sender but the receiver expects "
                            f"{tuple(want.shape)}")
        elif want.dtype != spec.dtype:
            problems.append(f"tensor {name!r} travels as {dtype_name(spec.dtype)} but the receiver expects "
                            f"{dtype_name(want.dtype)} (set WeightSyncConfig.dtype or describe it correctly)")
    for name, want in accepted.items():
        if name not in sent:
            problems.append(f"tensor {name!r} ({want.describe()}) is expected by the receiver but not sent")
    return problems
