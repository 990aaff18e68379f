"""Packing a named-tensor stream into buckets and unpacking it on the receiver (private to :mod:`rlhfkit.weight_sync`).

The sender consumes the source iterator lazily, one tensor at a time, copying each into its bucket slot right away;
so a source that gathers (ZeRO-3) keeps at most what it decides to gather at once alive, never the whole model. The
receiver hands ``load_fn`` one lazy iterator over the whole sync; each bucket is received and verified before its
first tensor is yielded, and released when the iterator moves past its last tensor. Needs only torch.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from rlhfkit.weight_sync._buckets import STATUS_ABORT, BucketSlots, Fingerprinter
from rlhfkit.weight_sync._errors import FingerprintMismatchError, WeightSyncAborted, WeightSyncError
from rlhfkit.weight_sync._manifest import Bucket, Manifest, TensorSpec

__all__ = ["take_tensor", "pack_bucket", "collect_bucket", "ReceivedStream", "local_stream", "call_load_fn",
           "bucket_label"]

_END = object()


def bucket_label(manifest: Manifest, bucket: Bucket, limit: int = 6) -> str:
    names = manifest.tensor_names(bucket)
    shown = ", ".join(repr(n) for n in names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"bucket {bucket.index} of sync {manifest.version} (tensors {shown}{more})"


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


_BATCH_BYTES = 256 * 1024**2  # source tensors held before one batched copy into the bucket


def _copy_batch(views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """Copy ``tensors`` into ``views``: one ``_foreach_copy_`` (a few fused kernels for same-dtype, same-device
    pairs; torch falls back to per-tensor copies otherwise); ``copy_`` one by one where foreach is missing."""
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None and len(views) > 1:
        foreach_copy(views, tensors)
    else:
        for view, tensor in zip(views, tensors, strict=True):
            view.copy_(tensor)
    views.clear()
    tensors.clear()


def pack_bucket(manifest: Manifest, bucket: Bucket, iterator: Iterator, views: Sequence[torch.Tensor]) -> None:
    """Copy the bucket's tensors from the source into its slot (casting floating dtypes); after the last bucket,
    check that the source is exhausted. Tensors are copied in batches of up to 256 MiB of source tensors (one
    batched copy each), so a gathering source keeps at most that much (at most one bucket) alive beyond what it
    gathers itself."""
    pending_views: list[torch.Tensor] = []
    pending: list[torch.Tensor] = []
    held = 0
    for position, view in zip(range(bucket.start, bucket.stop), views, strict=True):
        tensor = take_tensor(iterator, manifest.specs[position], position, len(manifest.specs))
        pending_views.append(view)
        pending.append(tensor)
        held += view.numel() * view.element_size()
        if held >= _BATCH_BYTES:
            _copy_batch(pending_views, pending)
            held = 0
    _copy_batch(pending_views, pending)
    if bucket.index == len(manifest.buckets) - 1:
        _check_exhausted(manifest, iterator)


def _check_exhausted(manifest: Manifest, iterator: Iterator) -> None:
    extra = next(iterator, _END)
    if extra is not _END:
        raise ValueError(f"named_tensors yielded {extra[0]!r} after the {len(manifest.specs)} tensors of the "
                         f"description; describe every tensor the stream yields")


def collect_bucket(manifest: Manifest, bucket: Bucket, iterator: Iterator, device: torch.device, *,
                   trusted: bool = False) -> list[torch.Tensor]:
    """Zero-copy CUDA IPC: the bucket's source tensors themselves (cast where the manifest says), checked to live on
    the sender's GPU, since receivers will read their memory. ``trusted``: the specs were read off these very
    tensors (``describe_parameters`` of the same list), so names, shapes and dtypes are not checked again."""
    tensors = []
    for position in range(bucket.start, bucket.stop):
        spec = manifest.specs[position]
        tensor = next(iterator)[1] if trusted else take_tensor(iterator, spec, position, len(manifest.specs))
        if tensor.device != device:
            raise ValueError(f"tensor {spec.name!r} is on {tensor.device}, not on the sender's {device}; with "
                             f"ipc_zero_copy=True receivers read the source's own memory, so every tensor must live "
                             f"on the sender's GPU (or set WeightSyncConfig.ipc_zero_copy=False)")
        # a parameter stays as it is (no detach: ≈ 5 µs a tensor): only its memory is described and read
        tensors.append(tensor if tensor.dtype == spec.dtype else tensor.detach().to(spec.dtype))
    if bucket.index == len(manifest.buckets) - 1:
        _check_exhausted(manifest, iterator)
    return tensors


class ReceiverTransport(Protocol):
    status_in_tail: bool
    drains: bool

    def receive(self, version: int, bucket: Bucket) -> None: ...
    def release(self, version: int, bucket: Bucket) -> None: ...
    def fail(self, version: int, bucket: Bucket, kind: str, message: str) -> None: ...


class ReceivedStream:
    """The lazy ``(name, tensor view)`` iterator a receiver hands to ``load_fn`` for one sync."""

    def __init__(self, manifest: Manifest, transport: ReceiverTransport, slots: BucketSlots,
                 fingerprinter: Fingerprinter, abort_message: Callable[[], str]) -> None:
        self.manifest, self.transport, self.slots = manifest, transport, slots
        self.fingerprinter, self.abort_message = fingerprinter, abort_message
        self.yielded = 0
        self.next_bucket = 0  # the first bucket not received yet
        self.open_bucket: Bucket | None = None  # received, handed out, not yet released
        self.error: WeightSyncError | None = None  # raised by the iterator (kept in case load_fn swallows it)
        self.stopped = False  # the sender aborted or the transport broke: nothing more will arrive
        self.waited = 0.0  # seconds spent receiving and verifying buckets (the rest of load_fn's time is loading)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.manifest.buckets:
            self._open(bucket)
            views = self._views(bucket)
            for spec, view in zip(self.manifest.specs[bucket.start : bucket.stop], views, strict=True):
                self.yielded += 1
                yield spec.name, view
            self._close()

    def by_bucket(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The same sync, one list of ``(name, view)`` per bucket; a list stays valid until the next is requested."""
        for bucket in self.manifest.buckets:
            self._open(bucket)
            views = self._views(bucket)
            names = self.manifest.tensor_names(bucket)
            self.yielded += len(names)
            yield list(zip(names, views, strict=True))
            self._close()

    def _views(self, bucket: Bucket) -> list[torch.Tensor]:
        views = getattr(self.transport, "views", None)  # CUDA IPC: slot or (zero-copy) source memory
        return views(self.manifest, bucket) if views is not None else self.slots.views(self.manifest, bucket)

    def _open(self, bucket: Bucket) -> None:
        self.next_bucket = bucket.index + 1
        started = time.perf_counter()
        try:
            self.transport.receive(self.manifest.version, bucket)
            self.open_bucket = bucket
            self._verify(bucket)
        except WeightSyncError as error:
            self.error = error
            self.stopped = self.open_bucket is not bucket or isinstance(error, WeightSyncAborted)
            raise
        finally:
            self.waited += time.perf_counter() - started

    def _close(self) -> None:
        bucket, self.open_bucket = self.open_bucket, None
        if bucket is not None:
            self.transport.release(self.manifest.version, bucket)

    def _verify(self, bucket: Bucket) -> None:
        if getattr(self.transport, "verifies_itself", False):
            self.transport.verify(self.manifest, bucket)
            return
        check_status = self.transport.status_in_tail
        if not (check_status or self.manifest.fingerprints):
            return
        tail = self.slots.tail(bucket)
        if self.manifest.fingerprints:
            local = self.fingerprinter.of_payload(self.slots.buffer(bucket), bucket)
            sent, status, got = torch.cat([tail, local.view(1)]).tolist()
        else:
            sent, status, got = 0, int(tail[1].item()), 0
        if check_status and status == STATUS_ABORT:
            raise WeightSyncAborted(self.abort_message())
        if sent != got:
            raise FingerprintMismatchError(
                f"{bucket_label(self.manifest, bucket)} arrived with fingerprint {got:#x} but the sender computed "
                f"{sent:#x}: the bytes changed between packing and loading")

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


def local_stream(manifest: Manifest, iterator: Iterator,
                 fingerprinter: Fingerprinter) -> Iterator[tuple[str, torch.Tensor]]:
    """In-process: the source's tensors (cast when the manifest says so) handed over directly, bucket by bucket,
    with the fingerprint taken when the bucket is assembled checked again just before it is handed over."""
    for bucket in manifest.buckets:
        specs = manifest.specs[bucket.start : bucket.stop]
        tensors = [take_tensor(iterator, spec, bucket.start + i, len(manifest.specs)).to(spec.dtype)
                   for i, spec in enumerate(specs)]
        sent = fingerprinter.of_tensors(tensors) if manifest.fingerprints else None
        if sent is not None:
            got = fingerprinter.of_tensors(tensors)
            if not bool(torch.equal(sent, got)):
                raise FingerprintMismatchError(
                    f"{bucket_label(manifest, bucket)} changed between packing and loading (fingerprint "
                    f"{int(got):#x}, sender computed {int(sent):#x})")
        yield from zip((spec.name for spec in specs), tensors, strict=True)
    extra = next(iterator, _END)
    if extra is not _END:
        raise ValueError(f"named_tensors yielded {extra[0]!r} after the {len(manifest.specs)} tensors of the "
                         f"description; describe every tensor the stream yields")


def call_load_fn(load_fn: Callable[..., Any], weights: Iterator[tuple[str, torch.Tensor]], version: int) -> Any:
    """``load_fn(weights, version=version)`` when it takes a ``version`` keyword, else ``load_fn(weights)``."""
    return load_fn(weights, version=version) if _takes_version(load_fn) else load_fn(weights)


def _takes_version(load_fn: Callable[..., Any]) -> bool:
    code = getattr(load_fn, "__code__", None)
    if code is not None and not hasattr(load_fn, "__wrapped__"):  # a plain function: read its code (≈ 1 µs)
        named = code.co_varnames[code.co_posonlyargcount : code.co_argcount + code.co_kwonlyargcount]
        return "version" in named or bool(code.co_flags & inspect.CO_VARKEYWORDS)
    try:
        parameters = inspect.signature(load_fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any((p.name == "version" and p.kind is not p.POSITIONAL_ONLY) or p.kind is p.VAR_KEYWORD
               for p in parameters)
