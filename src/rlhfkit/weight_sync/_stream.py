"""Packing a named-tensor stream into buckets and unpacking it on the receiver (private to :mod:`rlhfkit.weight_sync`).

The sender consumes the source iterator lazily, one tensor at a time, copying each into its bucket slot right away;
so a source that gathers (ZeRO-3) keeps at most what it decides to gather at once alive, never the whole model. The
receiver hands ``load_fn`` one lazy iterator over the whole sync; each bucket is received (and its status checked)
before its first tensor is yielded, and released when the iterator moves past its last tensor. Needs only torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rlhfkit.weight_sync._buckets import STATUS_ABORT, BucketSlots
from rlhfkit.weight_sync._errors import WeightSyncAborted, WeightSyncError
from rlhfkit.weight_sync._manifest import Bucket, Manifest, TensorSpec

__all__ = ["take_tensor", "pack_bucket", "ReceivedStream", "local_stream", "call_load_fn"]

_END = object()


def take_tensor(iterator: Iterator[tuple[str, torch.Tensor]], spec: TensorSpec, position: int,
                total: int) -> torch.Tensor:
    """Next tensor of the source, checked against the manifest entry it must match."""
    item = next(iterator, _END)
    if item is _END:
        raise ValueError(f"named_tensors ended after {position} tensors but the description lists {total} "
                         f"(next expected {spec.name!r}); pass a description that matches the stream")
    name, tensor = item
    if name != spec.name:
        raise ValueError(f"named_tensors yielded {name!r} at position {position} where the description has "
                         f"{spec.name!r}; the stream must follow the description's order")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"named_tensors yielded {type(tensor).__name__} for {name!r}; expected a torch.Tensor")
    if tensor.shape != spec.shape:  # (torch.Size compares with the spec's tuple as a tuple)
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} but the description says "
                         f"{tuple(spec.shape)}")
    if tensor.dtype != spec.dtype and not (tensor.dtype.is_floating_point and spec.dtype.is_floating_point):
        raise ValueError(f"tensor {name!r} has dtype {tensor.dtype} but the description says {spec.dtype}; only "
                         f"floating-point tensors are cast")
    return tensor


def pack_bucket(manifest: Manifest, bucket: Bucket, iterator: Iterator, views: Sequence[torch.Tensor]) -> None:
    """Copy the bucket's tensors from the source into its slot (casting floating dtypes), one at a time, so a
    gathering source keeps no more alive than it gathers itself; after the last bucket, check that the source is
    exhausted."""
    for position, view in zip(range(bucket.start, bucket.stop), views, strict=True):
        view.copy_(take_tensor(iterator, manifest.specs[position], position, len(manifest.specs)))
    if bucket.index == len(manifest.buckets) - 1:
        _check_exhausted(manifest, iterator)


def _check_exhausted(manifest: Manifest, iterator: Iterator) -> None:
    extra = next(iterator, _END)
    if extra is not _END:
        raise ValueError(f"named_tensors yielded {extra[0]!r} after the {len(manifest.specs)} tensors of the "
                         f"description; describe every tensor the stream yields")


class ReceivedStream:
    """The lazy ``(name, tensor view)`` iterator a receiver hands to ``load_fn`` for one sync. ``transport``: a
    ``CollectiveReceiver`` or ``IpcReceiver`` (``receive``, ``release``, ``fail``, ``status_in_tail``, ``drains``)."""

    def __init__(self, manifest: Manifest, transport: Any, slots: BucketSlots,
                 abort_message: Callable[[], str]) -> None:
        self.manifest, self.transport, self.slots, self.abort_message = manifest, transport, slots, abort_message
        self.yielded = 0
        self.next_bucket = 0  # the first bucket not received yet
        self.open_bucket: Bucket | None = None  # received, handed out, not yet released
        self.error: WeightSyncError | None = None  # raised by the iterator (kept in case load_fn swallows it)
        self.stopped = False  # the sender aborted or the transport broke: nothing more will arrive

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.manifest.buckets:
            self._open(bucket)
            views = self.slots.views(self.manifest, bucket)
            for spec, view in zip(self.manifest.specs[bucket.start : bucket.stop], views, strict=True):
                self.yielded += 1
                yield spec.name, view
            self._close()

    def by_bucket(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The same sync, one list of ``(name, view)`` per bucket; a list stays valid until the next is requested."""
        for bucket in self.manifest.buckets:
            self._open(bucket)
            views = self.slots.views(self.manifest, bucket)
            names = self.manifest.tensor_names(bucket)
            self.yielded += len(names)
            yield list(zip(names, views, strict=True))
            self._close()

    def _open(self, bucket: Bucket) -> None:
        self.next_bucket = bucket.index + 1
        try:
            self.transport.receive(self.manifest.version, bucket)
            self.open_bucket = bucket
            if self.transport.status_in_tail and self.slots.status(bucket) == STATUS_ABORT:
                raise WeightSyncAborted(self.abort_message())
        except WeightSyncError as error:
            self.error = error
            self.stopped = self.open_bucket is not bucket or isinstance(error, WeightSyncAborted)
            raise

    def _close(self) -> None:
        bucket, self.open_bucket = self.open_bucket, None
        if bucket is not None:
            self.transport.release(self.manifest.version, bucket)

    def finish(self) -> None:
        """After ``load_fn`` returned: every tensor must have been consumed."""
        if self.error is not None:
            raise self.error
        total = len(self.manifest.specs)
        if self.yielded < total:
            raise WeightSyncError(f"load_fn returned after taking {self.yielded} of the {total} tensors of sync "
                                  f"{self.manifest.version}; it must consume the whole iterator")
        self._close()

    def fail(self, kind: str, message: str) -> None:
        """A local failure: tell the sender (CUDA IPC) or drain the remaining broadcasts (gloo/NCCL)."""
        version = self.manifest.version
        if self.stopped:
            return
        if not self.transport.drains:
            pending = self.open_bucket or (self.manifest.buckets[self.next_bucket]
                                           if self.next_bucket < len(self.manifest.buckets) else None)
            if pending is not None:
                self.transport.fail(version, pending, kind, message)
            return
        for bucket in self.manifest.buckets[self.next_bucket :]:
            self.transport.receive(version, bucket)


def local_stream(manifest: Manifest, iterator: Iterator) -> Iterator[tuple[str, torch.Tensor]]:
    """In-process: the source's tensors (cast when the manifest says so) handed over directly."""
    for position, spec in enumerate(manifest.specs):
        yield spec.name, take_tensor(iterator, spec, position, len(manifest.specs)).to(spec.dtype)
    _check_exhausted(manifest, iterator)


def call_load_fn(load_fn: Callable[..., Any], weights: Iterator[tuple[str, torch.Tensor]], version: int) -> Any:
    """``load_fn(weights, version=version)`` when it takes a ``version`` keyword, else ``load_fn(weights)``."""
    try:
        parameters = inspect.signature(load_fn).parameters.values()
    except (TypeError, ValueError):
        parameters = ()
    takes = any((p.name == "version" and p.kind is not p.POSITIONAL_ONLY) or p.kind is p.VAR_KEYWORD
                for p in parameters)
    return load_fn(weights, version=version) if takes else load_fn(weights)
