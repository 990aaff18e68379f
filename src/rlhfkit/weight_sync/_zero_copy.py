"""Zero-copy CUDA IPC: receivers read the source tensors' own memory (private to :mod:`rlhfkit.weight_sync`).

The bucketed CUDA IPC path copies every tensor twice (source → shared bucket → engine parameter). When the source's
tensors already live in a few large allocations — DeepSpeed ZeRO-1/2 keeps a module's parameters as views of flat
buffers; :func:`rlhfkit.weight_sync.flatten_parameters` does the same for a plain module — the sender can share those
allocations instead, and the receiver copies straight out of them: one device copy per sync.

Sender (:class:`SourceHandles`): one CUDA IPC handle per distinct allocation (``untyped_storage()``), cached for as
long as that storage lives (a weak reference tells; torch wraps a storage's memory in its IPC reference counting the
first time it is shared, so sharing it again every sync would nest wrappers). A bucket's message carries the handles
of the allocations it touches and one placement per tensor: allocation id, element offset, shape, strides.

Receiver (:class:`MappedSources`): maps each allocation at its first use, builds typed views, and by default drops
every mapping when the sync ends — so the trainer can free (or offload) that memory between syncs; a mapping kept
open would hold it in torch's IPC limbo. Each allocation then costs one ``cudaIpcOpenMemHandle`` per sync. With
``keep_mapped`` the mappings stay; every message lists the allocations still alive on the sender, and
the receiver drops the others.

Messages are JSON (:func:`encode` / :func:`decode`, checked field by field); nothing is unpickled. Needs only torch
(CUDA for real handles; the protocol tests substitute the CUDA calls).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from rlhfkit.weight_sync._errors import WeightSyncProtocolError
from rlhfkit.weight_sync._handles import check_int
from rlhfkit.weight_sync._manifest import TensorSpec

__all__ = ["SourceHandles", "MappedSources", "encode", "decode"]

Placement = tuple[int, int, tuple[int, ...], tuple[int, ...]]  # allocation id, element offset, shape, strides


def encode(body: dict[str, Any]) -> str:
    """A zero-copy bucket message as JSON text: ``handles`` (allocation id -> what ``CudaOps.share`` returned, itself
    plain JSON), ``placements``, ``fingerprint`` (int or None) and ``live`` (allocation ids)."""
    return json.dumps({"handles": {str(ident): handle for ident, handle in body["handles"].items()},
                       "placements": [[ident, offset, list(shape), list(stride)]
                                      for ident, offset, shape, stride in body["placements"]],
                       "fingerprint": body["fingerprint"], "live": list(body["live"])}, separators=(",", ":"))


def decode(text: Any) -> dict[str, Any]:
    """:func:`encode`'s message back, checked: anything else (another encoding, another shape) raises
    :class:`WeightSyncProtocolError`. The handles are checked where they are opened (``CudaOps.open``)."""
    try:
        body = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        body = None
    if not isinstance(body, dict) or set(body) != {"handles", "placements", "fingerprint", "live"}:
        raise WeightSyncProtocolError("refused a zero-copy bucket message: not the JSON object the sender writes")
    handles, placements, live = body["handles"], body["placements"], body["live"]
    fingerprint = body["fingerprint"]
    if not (isinstance(handles, dict) and isinstance(placements, list) and isinstance(live, list)):
        raise WeightSyncProtocolError("refused a zero-copy bucket message: handles, placements or live of the "
                                      "wrong type")
    if fingerprint is not None:
        fingerprint = check_int(fingerprint, "fingerprint", minimum=-(2**63))
    decoded: list[Placement] = []
    for placement in placements:
        if not (isinstance(placement, list) and len(placement) == 4):
            raise WeightSyncProtocolError("refused a zero-copy bucket message: a placement is not "
                                          "[allocation, offset, shape, stride]")
        ident, offset, shape, stride = placement
        if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride) <= 64):
            raise WeightSyncProtocolError("refused a zero-copy bucket message: a placement's shape and stride differ")
        decoded.append((check_int(ident, "allocation id", minimum=-1), check_int(offset, "offset"),
                        tuple(check_int(d, "shape") for d in shape), tuple(check_int(d, "stride") for d in stride)))
    return {"handles": {_ident(key): handle for key, handle in handles.items()}, "placements": decoded,
            "fingerprint": fingerprint, "live": [check_int(ident, "allocation id") for ident in live]}


def _ident(key: str) -> int:
    if not (key.isascii() and key.isdigit() and len(key) < 19):
        raise WeightSyncProtocolError(f"refused a zero-copy bucket message: allocation id {key[:40]!r}")
    return int(key)


class SourceHandles:
    """The sender's cache of shared allocations: ``data_ptr → (weak ref, id, handle, nbytes)``."""

    def __init__(self, share) -> None:
        self._share = share  # CudaOps.share: tensor -> a handle as plain JSON
        self._entries: dict[int, tuple[Any, int, Any, int]] = {}
        self._next_id = 0

    def describe(self, tensors: Sequence[torch.Tensor]) -> tuple[dict[int, Any], list[Placement]]:
        """Handles of the allocations ``tensors`` live in and one placement per tensor (id -1: an empty tensor)."""
        handles: dict[int, Any] = {}
        placements: list[Placement] = []
        seen: dict[int, int] = {}  # data_ptr -> id, within this call (most tensors share a few allocations)
        for tensor in tensors:
            if tensor.numel() == 0:
                placements.append((-1, 0, tuple(tensor.shape), tuple(tensor.stride())))
                continue
            offset = tensor.storage_offset()
            key = tensor.data_ptr() - offset * tensor.element_size()  # the storage's base, without building it
            ident = seen.get(key)
            if ident is None:
                ident, handles[ident] = self._handle(tensor.untyped_storage(), tensor.device)
                seen[key] = ident
            placements.append((ident, offset, tuple(tensor.shape), tuple(tensor.stride())))
        return handles, placements

    def _handle(self, storage, device: torch.device) -> tuple[int, Any]:
        from torch.multiprocessing.reductions import StorageWeakRef

        key, nbytes = storage.data_ptr(), storage.nbytes()
        entry = self._entries.get(key)
        if entry is not None and entry[3] == nbytes and not entry[0].expired():
            return entry[1], entry[2]
        self._entries = {k: e for k, e in self._entries.items() if not e[0].expired()}
        whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
        ident, handle = self._next_id, self._share(whole)
        self._next_id += 1
        self._entries[key] = (StorageWeakRef(storage), ident, handle, nbytes)
        return ident, handle

    def live_ids(self) -> list[int]:
        """Ids of the shared allocations that are still alive on this side."""
        return sorted(entry[1] for entry in self._entries.values() if not entry[0].expired())

    def clear(self) -> None:
        self._entries = {}


class MappedSources:
    """The receiver's mappings of the sender's allocations, for one sync at a time."""

    def __init__(self, open_handle) -> None:
        self._open = open_handle  # CudaOps.open: (handle, device) -> uint8 tensor over the whole allocation
        self._mapped: dict[int, torch.Tensor] = {}
        self._cached: dict[int, tuple[Any, list[torch.Tensor]]] = {}  # bucket -> (placements, views), while mapped

    def views(self, specs: Sequence[TensorSpec], handles: dict[int, Any], placements: Sequence[Placement],
              device: torch.device, *, bucket: int = -1) -> list[torch.Tensor]:
        """Typed views of one bucket's tensors in the sender's memory (mapping new allocations first). Views of a
        bucket whose placements did not change since the last sync are reused (its allocations stayed mapped)."""
        for ident, handle in handles.items():
            if ident not in self._mapped:
                self._mapped[ident] = self._open(handle, device)
        key = (placements, [spec.dtype for spec in specs])
        cached = self._cached.get(bucket)
        if cached is not None and cached[0] == key:
            return cached[1]
        views = self._build(specs, placements, device)
        if bucket >= 0:
            self._cached[bucket] = (key, views)
        return views

    def _build(self, specs: Sequence[TensorSpec], placements: Sequence[Placement],
               device: torch.device) -> list[torch.Tensor]:
        views = []
        for spec, (ident, offset, shape, stride) in zip(specs, placements, strict=True):
            if tuple(shape) != tuple(spec.shape):
                raise AssertionError(f"placement of {spec.name!r} has shape {shape}, manifest {spec.shape}")
            if ident < 0:
                views.append(torch.empty(spec.shape, dtype=spec.dtype, device=device))
                continue
            storage = self._mapped[ident].untyped_storage()
            views.append(torch.empty(0, dtype=spec.dtype, device=storage.device).set_(storage, offset, shape, stride))
        return views

    def retain(self, live: Sequence[int]) -> None:
        """Unmap the allocations the sender no longer has (so it can really free them)."""
        keep = set(live)
        if not keep.issuperset(self._mapped):
            self._mapped = {ident: tensor for ident, tensor in self._mapped.items() if ident in keep}
            self._cached = {}

    def clear(self) -> None:
        """Unmap everything (the sender may free or move its memory once the sync is over)."""
        self._mapped = {}
        self._cached = {}
