"""CUDA IPC transport of the weight-sync channel (private to :mod:`rlhfkit.weight_sync`). Needs a CUDA torch.

For engines on the same GPU as the trainer rank. The sender owns ``num_slots`` bucket buffers on its GPU and shares
each one's CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``) once, when the buffers are allocated —
not per parameter, not per bucket. A receiver maps them once (the handle names the GPU by UUID, so logical device
indices may differ between processes) and copies out of them. Per bucket only a tiny control message moves:
"bucket k is ready" (sender → receivers) and "bucket k is consumed" (receivers → sender).

GPU ordering: with ``ipc_events`` each side records an interprocess CUDA event after its work on a slot and the other
side makes its stream wait on it, so neither host blocks on the GPU; without it each side synchronizes its stream
before signalling. The receiver's ``load_fn`` must copy on the current CUDA stream (transformers and vLLM do).

Memory: ``num_slots`` buckets on the sender's GPU; receivers allocate nothing (they read the sender's buffers).

Zero-copy mode (``WeightSyncConfig.ipc_zero_copy``, :mod:`rlhfkit.weight_sync._zero_copy`): no bucket buffers; each
bucket's "ready" message carries CUDA IPC handles of the source tensors' own allocations and where each tensor lies in
them. Events, acknowledgements and slot cycling are the same: a slot then bounds the source tensors the sender keeps
alive (``num_slots`` buckets), not a buffer.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from rlhfkit.weight_sync._buckets import BucketSlots, Fingerprinter
from rlhfkit.weight_sync._control import ControlChannel
from rlhfkit.weight_sync._errors import (
    FingerprintMismatchError,
    WeightSyncAborted,
    WeightSyncError,
    WeightSyncProtocolError,
    error_from_report,
)
from rlhfkit.weight_sync._handles import decode_bytes, decode_tensor_args, encode_bytes, encode_tensor_args
from rlhfkit.weight_sync._manifest import Bucket, Manifest
from rlhfkit.weight_sync._zero_copy import MappedSources, SourceHandles, decode, encode

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
    def new_events(count: int, device: torch.device) -> list:
        events = [torch.cuda.Event(interprocess=True) for _ in range(count)]
        for event in events:
            event.record(torch.cuda.current_stream(device))  # creates the event on this device before sharing it
        return events

    @staticmethod
    def event_handle(event: torch.cuda.Event) -> bytes:
        return event.ipc_handle()

    @staticmethod
    def open_event(handle: bytes, device: torch.device) -> torch.cuda.Event:
        return torch.cuda.Event.from_ipc_handle(device, handle)

    @staticmethod
    def record(event: torch.cuda.Event, device: torch.device) -> None:
        event.record(torch.cuda.current_stream(device))

    @staticmethod
    def wait(event: torch.cuda.Event, device: torch.device) -> None:
        torch.cuda.current_stream(device).wait_event(event)

    @staticmethod
    def synchronize(device: torch.device) -> None:
        torch.cuda.current_stream(device).synchronize()

    @staticmethod
    def event_synchronize(event: torch.cuda.Event) -> None:
        event.synchronize()


def _event_handles(message: Any) -> list[bytes]:
    """CUDA IPC event handles from their JSON form (a list of base64 strings)."""
    if not isinstance(message, list) or not 0 < len(message) <= 64:
        raise WeightSyncProtocolError("refused a CUDA IPC event-handles message: not a list of 1 to 64 handles")
    return [decode_bytes(handle, "event handle") for handle in message]


class IpcSender:
    """Sender half. ``peers``: the receiver ranks."""

    inline_first = True  # bucket 0's "ready" message may travel with the sync's start (see SenderSide.send)

    def __init__(self, control: ControlChannel, slots: BucketSlots, peers: list[int], *, use_events: bool,
                 zero_copy: bool = False) -> None:
        self.control, self.slots, self.peers, self.use_events = control, slots, peers, use_events
        self.cuda = CudaOps()
        self.generation = 0
        self.zero_copy = zero_copy
        self._send_events: list = []
        self._recv_events: dict[int, list] | None = None
        self._sources = SourceHandles(self.cuda.share) if zero_copy else None
        self._held: dict[int, list[torch.Tensor]] = {}  # zero-copy: source tensors of the buckets in flight, by slot
        # zero-copy, per bucket: (weak refs to its tensors, their data pointers, fingerprint, live ids, encoded
        # message) of the last sync; the same tensors where they were reuse the message (no describe, no pickling)
        self._messages: dict[int, tuple] = {}

    def prepare(self, capacity: int) -> int:
        if self.zero_copy:
            if self.generation:
                return self.generation
        elif not self.slots.ensure(capacity):
            return self.generation
        self.generation += 1
        device = self.slots.device
        self._send_events = self.cuda.new_events(self.slots.num_slots, device)
        self._recv_events = None
        self.cuda.synchronize(device)  # buffers are zeroed before anyone maps them
        shared = {
            "uuid": self.cuda.uuid(device),
            "buffers": [self.cuda.share(buffer) for buffer in self.slots.buffers],
            "events": [encode_bytes(self.cuda.event_handle(event)) for event in self._send_events],
        }
        self.control.put(f"ipc/{self.generation}", shared)
        return self.generation

    def _receiver_events(self) -> dict[int, list]:
        if self._recv_events is None:
            events = {}
            for rank in self.peers:
                handles = _event_handles(self.control.get(f"ipc/{self.generation}/recv/{rank}", peer=rank,
                                                          what="its CUDA IPC event handles"))
                events[rank] = [self.cuda.open_event(h, self.slots.device) for h in handles]
            self._recv_events = events
        return self._recv_events

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
        slot = bucket.index % self.slots.num_slots
        if self.use_events:
            for events in self._receiver_events().values():
                self.cuda.wait(events[slot], self.slots.device)
        self._held.pop(slot, None)  # the receivers' reads are ordered before anything the source does next

    def ready(self, version: int, bucket: Bucket, tensors: list[torch.Tensor] | None = None,
              fingerprint: int | None = None) -> dict:
        """Bucket ``bucket`` is ready — packed in its slot, or (zero-copy) these source ``tensors``: order the
        receivers' reads after this stream's work so far and return its "ready" message (not sent yet)."""
        message: dict = {"ok": 1}
        if self.zero_copy:
            assert self._sources is not None and tensors is not None
            self._held[bucket.index % self.slots.num_slots] = tensors
            message["source"] = self._describe(bucket.index, tensors, fingerprint)
        if self.use_events:
            self.cuda.record(self._send_events[bucket.index % self.slots.num_slots], self.slots.device)
        else:
            self.cuda.synchronize(self.slots.device)
        return message

    def publish(self, version: int, bucket: Bucket, tensors: list[torch.Tensor] | None = None,
                fingerprint: int | None = None) -> None:
        """:meth:`ready`, then send its message."""
        self.control.put(f"{version}/b/{bucket.index}", self.ready(version, bucket, tensors, fingerprint))

    def await_loaded(self, last: Bucket, ranks: list[int]) -> None:
        """For receivers that reported done as soon as their copies were queued (``IpcReceiver.pipelined_done``):
        order this stream after their reads (the event each recorded after its last bucket) and wait for them."""
        slot = last.index % self.slots.num_slots
        events = self._receiver_events()
        for rank in ranks:
            self.cuda.wait(events[rank][slot], self.slots.device)
            self.cuda.event_synchronize(events[rank][slot])

    def _describe(self, index: int, tensors: list[torch.Tensor], fingerprint: int | None) -> str:
        """Bucket ``index``'s zero-copy message: where each tensor lies in which shared allocation. Reused while
        the bucket's tensors are the same objects at the same addresses (a parameter updated in place) and the
        sender's shared allocations have not changed."""
        assert self._sources is not None
        pointers = [t.data_ptr() for t in tensors]
        live = self._sources.live_ids()
        cached = self._messages.get(index)
        if (cached is not None and cached[1] == pointers and cached[2] == fingerprint and cached[3] == live
                and all(ref() is t for ref, t in zip(cached[0], tensors, strict=True))):
            return cached[4]
        handles, placements = self._sources.describe(tensors)
        live = self._sources.live_ids()  # describe may have shared a new allocation
        text = encode({"handles": handles, "placements": placements, "fingerprint": fingerprint, "live": live})
        self._messages[index] = ([weakref.ref(t) for t in tensors], pointers, fingerprint, live, text)
        return text

    def end_sync(self) -> None:
        """After every receiver reported done (or the sync failed): keep no source tensor alive."""
        self._held.clear()

    def abort(self, version: int, bucket: Bucket, message: str, *, peer_failed: bool) -> None:
        self.control.put(f"{version}/b/{bucket.index}", {"abort": message})

    def flush(self, version: int) -> None:
        """Nothing in flight on this side: receivers' completion is awaited through their reports."""


class IpcReceiver:
    """Receiver half: maps the sender's buffers once per buffer generation."""

    status_in_tail = False  # aborts arrive as control messages
    drains = False  # a failure is reported in the acknowledgement; the sender stops publishing

    def __init__(self, control: ControlChannel, slots: BucketSlots, rank: int) -> None:
        self.control, self.slots, self.rank = control, slots, rank
        self.cuda = CudaOps()
        self.generation = 0
        self.use_events = False
        self.num_slots = 1
        self._send_events: list = []
        self._recv_events: list = []
        self._manifest: Manifest | None = None
        self._sources = MappedSources(self.cuda.open)
        self._views: list[torch.Tensor] = []
        self._source: dict | None = None
        self._decoded: dict[int, tuple[str, dict]] = {}  # bucket -> (message text, its body), the last sync's
        self._early: tuple[int, int, dict] | None = None  # (version, bucket, message) that came with the start
        self._fingerprinter = Fingerprinter()

    @property
    def zero_copy(self) -> bool:
        """Whether the current sync reads the sender's source tensors (the sender's choice, in the manifest)."""
        return self._manifest is not None and self._manifest.zero_copy

    @property
    def verifies_itself(self) -> bool:
        """Zero-copy buckets have no tail: their fingerprint travels in the message and is checked here."""
        return self.zero_copy

    @property
    def pipelined_done(self) -> bool:
        """Whether this receiver may report a sync done once its copies are queued, before they ran: with events
        the last bucket's release records one after every copy, and the sender waits on it
        (:meth:`IpcSender.await_loaded`). Not when zero-copy mappings are dropped after the sync: that waits for the
        copies here."""
        manifest = self._manifest
        return self.use_events and manifest is not None and not (manifest.zero_copy and not manifest.keep_mapped)

    def preload(self, version: int, index: int, message: dict) -> None:
        """Bucket ``index``'s "ready" message, which came with the sync's start: :meth:`receive` takes it from here."""
        self._early = (version, index, message)

    def prepare(self, manifest: Manifest) -> None:
        self.use_events = manifest.ipc_events
        self._manifest = manifest
        if manifest.generation == self.generation:
            return
        shared = self.control.get(f"ipc/{manifest.generation}", peer=0,
                                  what="the CUDA IPC handles of its bucket buffers")
        if not (isinstance(shared, dict) and isinstance(shared.get("uuid"), str)
                and isinstance(shared.get("buffers"), list)):
            raise WeightSyncProtocolError("refused the sender's CUDA IPC buffers message: not a JSON object with "
                                          "a GPU uuid, buffer handles and event handles")
        send_events = _event_handles(shared.get("events"))
        device = self.cuda.device_of_uuid(shared["uuid"])
        self.slots.release()  # unmap the old generation first: torch caches mappings by (handle, offset)
        self.slots.device = device
        self.slots.adopt([self.cuda.open(handle, device) for handle in shared["buffers"]])
        self._send_events = [self.cuda.open_event(h, device) for h in send_events]
        self.num_slots = len(send_events)
        self._recv_events = self.cuda.new_events(self.num_slots, device)
        self.control.put(f"ipc/{manifest.generation}/recv/{self.rank}",
                         [encode_bytes(self.cuda.event_handle(event)) for event in self._recv_events])
        self.generation = manifest.generation

    def receive(self, version: int, bucket: Bucket) -> None:
        early, self._early = self._early, None
        if early is not None and early[:2] == (version, bucket.index):
            message = early[2]
        else:
            message = self.control.get(f"{version}/b/{bucket.index}", peer=0,
                                       what=f"bucket {bucket.index} of sync {version}")
        if "abort" in message:
            raise WeightSyncAborted(f"{self.control.peer_name(0)} aborted sync {version}: {message['abort']}")
        if self.use_events:
            self.cuda.wait(self._send_events[bucket.index % self.num_slots], self.slots.device)
        self._source = self._decode(bucket.index, message["source"]) if self.zero_copy else None

    def _decode(self, index: int, text: str) -> dict:
        """A zero-copy message's body; the sender resends the same text while its tensors stay put."""
        cached = self._decoded.get(index)
        if cached is not None and cached[0] == text:
            return cached[1]
        body = decode(text)
        self._decoded[index] = (text, body)
        return body

    def verify(self, manifest: Manifest, bucket: Bucket) -> None:
        """Zero-copy: map the bucket's source allocations, build its views and check its fingerprint (a failure
        here is reported to the sender like any load failure)."""
        from rlhfkit.weight_sync._stream import bucket_label

        body, self._source = self._source, None
        assert body is not None, "verify() without a received zero-copy bucket"
        specs = manifest.specs[bucket.start : bucket.stop]
        self._sources.retain(body["live"])
        self._views = self._sources.views(specs, body["handles"], body["placements"], self.slots.device,
                                          bucket=bucket.index)
        sent = body["fingerprint"]
        if manifest.fingerprints:
            got = int(self._fingerprinter.of_tensors(self._views).item())
            if got != sent:
                raise FingerprintMismatchError(
                    f"{bucket_label(manifest, bucket)} reads with fingerprint {got:#x} but the sender computed "
                    f"{sent:#x}: the source changed between publishing and loading")

    def views(self, manifest: Manifest, bucket: Bucket) -> list[torch.Tensor]:
        """Typed views of ``bucket``'s tensors: in the sender's bucket slot, or (zero-copy) its source memory."""
        return self._views if self.zero_copy else self.slots.views(manifest, bucket)

    def release(self, version: int, bucket: Bucket) -> None:
        self._views = []
        if self.use_events:
            self.cuda.record(self._recv_events[bucket.index % self.num_slots], self.slots.device)
        else:
            self.cuda.synchronize(self.slots.device)
        # the sender waits for bucket k's acknowledgement before reusing its slot for bucket k + num_slots; the last
        # num_slots buckets' slots are not reused in this sync (the done report covers them)
        assert self._manifest is not None
        if bucket.index < len(self._manifest.buckets) - self.num_slots:
            self.control.put(f"{version}/ack/{bucket.index}/{self.rank}", {"ok": 1})

    def end_sync(self) -> None:
        """After the sync (loaded or failed): unmap the sender's source memory so it can free or move it, unless
        the sender asked receivers to keep it mapped."""
        self._views = []
        if not (self._manifest is not None and self._manifest.keep_mapped):
            self._sources.clear()

    def unmap(self) -> None:
        """On close: drop every mapping of the sender's memory."""
        self._views = []
        self._sources.clear()

    def fail(self, version: int, bucket: Bucket, kind: str, message: str) -> None:
        self.control.put(f"{version}/ack/{bucket.index}/{self.rank}", {"error": kind, "message": message})
