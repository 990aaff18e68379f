"""CUDA IPC transport of the weight-sync channel (private to :mod:`rlhfkit.weight_sync`). Needs a CUDA torch.

For engines on the same GPU as the trainer rank. The sender owns ``num_slots`` bucket buffers on its GPU and shares
each one's CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``) once, when the buffers are allocated —
not per parameter, not per bucket. A receiver maps them once (the handle names the GPU by UUID, so logical device
indices may differ between processes) and copies out of them. Per bucket only a tiny control message moves:
"bucket k is ready" (sender → receivers) and "bucket k is consumed" (receivers → sender).

GPU ordering: each side synchronizes its current CUDA stream before it signals (the sender before "ready", a receiver
before "consumed"). The receiver's ``load_fn`` must copy on the current CUDA stream (transformers and vLLM do).

Memory: ``num_slots`` buckets on the sender's GPU; receivers allocate nothing (they read the sender's buffers).
Handles travel as strict JSON (:mod:`rlhfkit.weight_sync._handles`); nothing read from the store is unpickled.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.weight_sync._buckets import BucketSlots
from rlhfkit.weight_sync._control import ControlChannel
from rlhfkit.weight_sync._errors import (WeightSyncAborted, WeightSyncError, WeightSyncProtocolError, error_from_report)
from rlhfkit.weight_sync._handles import decode_tensor_args, encode_tensor_args
from rlhfkit.weight_sync._manifest import Bucket, Manifest

__all__ = ["IpcSender", "IpcReceiver", "CudaOps"]


class CudaOps:
    """The CUDA calls this transport makes, in one place (tests of the protocol on CPU substitute fakes)."""

    @staticmethod
    def uuid(device: torch.device) -> str:
        return str(torch.cuda.get_device_properties(device).uuid)

    def device_of_uuid(self, uuid: str) -> torch.device:
        """This process's ``cuda:i`` for the GPU with ``uuid``; raises when it is not visible here."""
        for index in range(torch.cuda.device_count()):
            if self.uuid(torch.device("cuda", index)) == uuid:
                return torch.device("cuda", index)
        raise WeightSyncError(
            f"the sender's bucket buffers live on GPU {uuid}, which this process cannot see "
            f"({torch.cuda.device_count()} visible GPUs); backend='cuda_ipc' needs the receiver on the sender's GPU "
            f"(or that GPU visible to it) — use backend='nccl' for engines on other GPUs")

    @staticmethod
    def share(tensor: torch.Tensor) -> dict[str, Any]:
        """A CUDA IPC handle of ``tensor`` as plain JSON (:mod:`rlhfkit.weight_sync._handles`)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        function, args = reduce_tensor(tensor)
        if function is not rebuild_cuda_tensor:
            raise WeightSyncError(f"cannot share a {tensor.device} tensor over CUDA IPC ({function.__name__})")
        return encode_tensor_args(args)

    @staticmethod
    def open(handle: Any, device: torch.device) -> torch.Tensor:
        """Map a :meth:`share` handle in this process, pointing it at our index of the sender's GPU. The handle is
        checked field by field; only ``rebuild_cuda_tensor`` is ever called on it."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(decode_tensor_args(handle))
        args[6] = device.index  # rebuild_cuda_tensor's storage_device
        return rebuild_cuda_tensor(*args)

    @staticmethod
    def synchronize(device: torch.device) -> None:
        torch.cuda.current_stream(device).synchronize()


class IpcSender:
    """Sender half. ``peers``: the receiver ranks."""

    def __init__(self, control: ControlChannel, slots: BucketSlots, peers: list[int]) -> None:
        self.control, self.slots, self.peers = control, slots, peers
        self.cuda = CudaOps()
        self.generation = 0

    def prepare(self, capacity: int) -> int:
        """(Re)allocate the buffers when they are too small, and share the new ones: a new generation."""
        if not self.slots.ensure(capacity):
            return self.generation
        self.generation += 1
        device = self.slots.device
        self.cuda.synchronize(device)  # buffers are zeroed before anyone maps them
        shared = {"uuid": self.cuda.uuid(device), "buffers": [self.cuda.share(b) for b in self.slots.buffers]}
        self.control.put(f"ipc/{self.generation}", shared)
        return self.generation

    def acquire(self, version: int, bucket: Bucket) -> None:
        """Wait until every receiver is done with the slot ``bucket`` will be written to."""
        previous = bucket.index - self.slots.num_slots
        if previous < 0:
            return
        acks = self.control.gather(lambda r: f"{version}/ack/{previous}/{r}", self.peers,
                                   what=f"its acknowledgement of bucket {previous} of sync {version}")
        for rank, ack in acks.items():
            if "error" in ack:
                raise error_from_report(ack["error"], f"{self.control.peer_name(rank)} failed sync {version}: "
                                                      f"{ack['message']}")

    def publish(self, version: int, bucket: Bucket) -> None:
        """Bucket ``bucket`` is packed in its slot: once the copies have run, tell the receivers."""
        self.cuda.synchronize(self.slots.device)
        self.control.put(f"{version}/b/{bucket.index}", {"ok": 1})

    def abort(self, version: int, bucket: Bucket, message: str, *, peer_failed: bool) -> None:
        self.control.put(f"{version}/b/{bucket.index}", {"abort": message})

    def flush(self, version: int) -> None:
        """Nothing in flight on this side: each receiver synchronizes before it reports done."""


class IpcReceiver:
    """Receiver half: maps the sender's buffers once per buffer generation."""

    status_in_tail = False  # aborts arrive as control messages
    drains = False  # a failure is reported in the acknowledgement; the sender stops publishing

    def __init__(self, control: ControlChannel, slots: BucketSlots, rank: int) -> None:
        self.control, self.slots, self.rank = control, slots, rank
        self.cuda = CudaOps()
        self.generation = 0
        self.num_buckets = 0

    def prepare(self, manifest: Manifest) -> None:
        self.num_buckets = len(manifest.buckets)
        if manifest.generation == self.generation:
            return
        shared = self.control.get(f"ipc/{manifest.generation}", peer=0,
                                  what="the CUDA IPC handles of its bucket buffers")
        if not (isinstance(shared, dict) and set(shared) == {"uuid", "buffers"} and isinstance(shared["uuid"], str)
                and isinstance(shared["buffers"], list) and 0 < len(shared["buffers"]) <= 2):
            raise WeightSyncProtocolError("refused the sender's CUDA IPC buffers message: not a JSON object with "
                                          "a GPU uuid and one or two buffer handles")
        device = self.cuda.device_of_uuid(shared["uuid"])
        self.slots.release()  # unmap the old generation first: torch caches mappings by (handle, offset)
        self.slots.device = device
        self.slots.adopt([self.cuda.open(handle, device) for handle in shared["buffers"]])
        self.generation = manifest.generation

    def receive(self, version: int, bucket: Bucket) -> None:
        message = self.control.get(f"{version}/b/{bucket.index}", peer=0,
                                   what=f"bucket {bucket.index} of sync {version}")
        if "abort" in message:
            raise WeightSyncAborted(f"{self.control.peer_name(0)} aborted sync {version}: {message['abort']}")

    def release(self, version: int, bucket: Bucket) -> None:
        self.cuda.synchronize(self.slots.device)
        # the sender waits for bucket k's acknowledgement before reusing its slot for bucket k + num_slots; the last
        # num_slots buckets' slots are not reused in this sync (the done report covers them)
        if bucket.index < self.num_buckets - self.slots.num_slots:
            self.control.put(f"{version}/ack/{bucket.index}/{self.rank}", {"ok": 1})

    def fail(self, version: int, bucket: Bucket, kind: str, message: str) -> None:
        self.control.put(f"{version}/ack/{bucket.index}/{self.rank}", {"error": kind, "message": message})
