"""The two ends of a multi-process sync and the in-process path (private to :mod:`rlhfkit.weight_sync`).

Protocol of one sync, version ``v`` (keys in :mod:`rlhfkit.weight_sync._control`):
1. the sender publishes the manifest; each receiver checks it against what it accepts and answers ok or error;
2. the sender answers go (all ok) or abort (someone rejected it or timed out) — so a mismatch fails on every end
   before any weights move;
3. buckets move (a broadcast each for gloo/NCCL; ready/consumed messages for CUDA IPC); a sender-side failure
   mid-stream aborts the receivers (abort status in the bucket tail, or an abort message);
4. each receiver reports done (the version it now holds, or its error) once its copies have run; the sender returns
   when all have.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rlhfkit._store import new_secret
from rlhfkit.weight_sync._buckets import STATUS_OK, BucketSlots
from rlhfkit.weight_sync._collective import (CollectiveLink, CollectiveReceiver, CollectiveSender,
                                             local_address_towards)
from rlhfkit.weight_sync._control import ControlChannel, open_store
from rlhfkit.weight_sync._errors import (ManifestMismatchError, WeightSyncError, WeightSyncRejoinError,
                                         WeightSyncVersionError, error_from_report, error_kind)
from rlhfkit.weight_sync._manifest import Manifest, TensorSpec, compare_manifest, plan_buckets
from rlhfkit.weight_sync._stream import ReceivedStream, call_load_fn, local_stream, pack_bucket

__all__ = ["SenderSide", "ReceiverSide", "load_local"]

logger = logging.getLogger(__name__)


def _mismatch_message(manifest: Manifest, who: str, problems: list[str]) -> str:
    shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
    return f"the manifest of sync {manifest.version} does not match what {who} accepts: {shown}"


class SenderSide:
    """Rank 0 of a multi-process group: owns the control store, the bucket buffers and the version counter."""

    def __init__(self, config: Any, endpoint: Any, device: torch.device) -> None:
        self.config, self.endpoint = config, endpoint
        self.secret = endpoint.secret if endpoint.secret is not None else new_secret()
        self.store = open_store(host=endpoint.host, port=endpoint.port, is_master=True, timeout_s=config.timeout_s,
                                peer=f"group {endpoint.group_name!r}", secret=self.secret)
        self.port = self.store.port
        self.peers = list(range(1, endpoint.world_size))
        self.labels: dict[int, str] = {}
        self.control = ControlChannel(self.store, timeout_s=config.timeout_s, peer_name=self.peer_name)
        self.slots = BucketSlots(device, config.num_buffers)
        self.version = 0
        self.link: CollectiveLink | None = None
        self.transport: Any = None
        self._plan: tuple | None = None  # (specs, buckets, capacity) of the last sync
        self._stale: str | None = None  # the last sync's manifest key (the largest), deleted during the next sync

    def peer_name(self, rank: int) -> str:
        label = self.labels.get(rank)
        return f"receiver rank {rank}" + (f" ({label!r})" if label else "") + f" of group {self.endpoint.group_name!r}"

    def describe_group(self) -> str:
        receivers = ", ".join(self.peer_name(r).split(" of group")[0] for r in self.peers)
        return f"group {self.endpoint.group_name!r} at {self.endpoint.host}:{self.port} ({receivers})"

    def _connect(self) -> None:
        if self.transport is not None:
            return
        hellos = self.control.gather(lambda r: f"hello/{r}", self.peers,
                                     what="its hello (has it called WeightReceiver.receive?)")
        self.labels = {rank: str(hello.get("label", "")) for rank, hello in hellos.items()}
        self.control.put("formed", {"pid": os.getpid()})  # a receiver that comes later (restarted) refuses to join
        if self.config.backend == "cuda_ipc":
            from rlhfkit.weight_sync._ipc import IpcSender

            self.transport = IpcSender(self.control, self.slots, self.peers)
            return
        # joined in send(), after the first manifest is out: receivers waiting for it join then
        self.link = CollectiveLink(self.store, backend=self.config.backend, rank=0,
                                   world_size=self.endpoint.world_size, timeout_s=self.config.timeout_s,
                                   device=self.slots.device, describe_group=self.describe_group,
                                   host=self.endpoint.host)
        self.transport = CollectiveSender(self.link, self.slots)

    def send(self, specs: list[TensorSpec], iterator: Iterator) -> tuple[Manifest, tuple]:
        """One sync: publish the manifest, wait for every receiver's verdict, stream, wait for the done reports."""
        self._connect()
        manifest = self._manifest(tuple(specs))
        self.version = manifest.version  # used even if the sync fails: a version is never reused
        self.control.put_bytes(f"{manifest.version}/start", manifest.to_bytes())
        try:
            if self.link is not None and self.link.group is None:
                self.link.connect()  # receivers waiting for the first manifest join the group once they have it
            self._check(manifest)
            self._stream(manifest, iterator)
            self._delete_stale()  # now that receivers are busy loading
            versions = self._done(manifest)
        finally:
            self._delete_stale()  # (not done above if this sync failed first)
            self._stale = f"{manifest.version}/start"
        return manifest, versions

    def _delete_stale(self) -> None:
        if self._stale is not None:
            self.control.delete(self._stale)
            self._stale = None

    def _manifest(self, specs: tuple[TensorSpec, ...]) -> Manifest:
        """This sync's manifest; the bucket layout is reused while the stream's description stays the same."""
        if self._plan is None or self._plan[0] != specs:
            self._plan = (specs, *plan_buckets(specs, self.config.bucket_bytes))
        specs, buckets, capacity = self._plan
        generation = self.transport.prepare(capacity)
        return Manifest(version=self.version + 1, specs=specs, buckets=buckets, capacity=capacity,
                        num_slots=self.slots.num_slots, generation=generation)

    def _check(self, manifest: Manifest) -> None:
        version = manifest.version
        try:
            checks = self.control.gather(lambda r: f"{version}/check/{r}", self.peers,
                                         what=f"its check of the manifest of sync {version}")
        except WeightSyncError as error:
            self.control.put(f"{version}/go", {"abort": f"the sync was given up: {error}", "kind": "aborted"})
            raise
        refused = {r: c for r, c in checks.items() if "error" in c}
        if refused:
            message = f"sync {version} was not started: " + " | ".join(
                f"{self.peer_name(r)} rejected it: {c['message']}" for r, c in refused.items())
            kinds = [c["error"] for c in refused.values() if c["error"] != "manifest"] or ["manifest"]
            self.control.put(f"{version}/go", {"abort": message, "kind": kinds[0]})
            raise error_from_report(kinds[0], message)
        self.control.put(f"{version}/go", {"go": 1})

    def _stream(self, manifest: Manifest, iterator: Iterator) -> None:
        """Pack and publish every bucket in order."""
        version, transport = manifest.version, self.transport
        for bucket in manifest.buckets:
            try:
                transport.acquire(version, bucket)
            except WeightSyncError as error:
                self._abort(manifest, bucket, f"{error}", peer_failed=True)
                raise
            try:
                self._fill(manifest, bucket, iterator)
            except Exception as error:
                self._abort(manifest, bucket, f"the sender failed while packing bucket {bucket.index}: "
                                              f"{type(error).__name__}: {error}", peer_failed=False)
                raise
            try:
                transport.publish(version, bucket)
            except WeightSyncError as error:
                raise WeightSyncError(f"{error} (while sending to {self.describe_group()})") from error
        try:
            transport.flush(version)
        except WeightSyncError as error:
            raise WeightSyncError(f"{error} (while sending to {self.describe_group()})") from error

    def _fill(self, manifest: Manifest, bucket: Any, iterator: Iterator) -> None:
        """Pack bucket ``bucket`` into its slot, with its tail's status."""
        pack_bucket(manifest, bucket, iterator, self.slots.views(manifest, bucket))
        self.slots.write_status(bucket, STATUS_OK)

    def _abort(self, manifest: Manifest, bucket: Any, message: str, *, peer_failed: bool) -> None:
        """Best effort: tell the receivers that this sync is off, then let the caller raise the real error."""
        try:
            self.control.put(f"{manifest.version}/abort", {"message": message})
            self.transport.abort(manifest.version, bucket, message, peer_failed=peer_failed)
        except (WeightSyncError, RuntimeError, OSError) as error:
            logger.warning("could not tell the receivers of %s that sync %d is aborted: %s",
                           self.describe_group(), manifest.version, error)

    def _done(self, manifest: Manifest) -> tuple[int, ...]:
        version = manifest.version
        reports = self.control.gather(lambda r: f"{version}/done/{r}", self.peers,
                                      what=f"its report on sync {version}")
        for rank, report in reports.items():
            if "error" in report:
                raise error_from_report(report["error"], f"{self.peer_name(rank)} failed sync {version}: "
                                                         f"{report['message']}")
        return tuple(int(reports[rank]["version"]) for rank in self.peers)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.slots.release()
        self.transport = self.link = self.control = self.store = None  # the last reference stops the store


class ReceiverSide:
    """Rank ≥ 1 of a multi-process group; joins the store and the process group at the first receive."""

    def __init__(self, config: Any, endpoint: Any, device: torch.device, hello: dict[str, Any]) -> None:
        self.config, self.endpoint, self.hello = config, endpoint, hello
        self.slots = BucketSlots(device, 1)
        self.seen = 0  # the last sync whose manifest this receiver read
        self.control: ControlChannel | None = None
        self.link: CollectiveLink | None = None
        self.transport: Any = None

    @property
    def who(self) -> str:
        label = f" ({self.endpoint.label!r})" if self.endpoint.label else ""
        return f"receiver rank {self.endpoint.rank}{label} of group {self.endpoint.group_name!r}"

    def _sender_name(self, rank: int) -> str:
        e = self.endpoint
        return f"the sender (rank {rank}) of group {e.group_name!r} at {e.host}:{e.port}"

    def _connect_control(self) -> ControlChannel:
        if self.control is None:
            e = self.endpoint
            store = open_store(host=e.host, port=e.port, is_master=False, timeout_s=self.config.timeout_s,
                               peer=self._sender_name(0), secret=e.secret)
            control = ControlChannel(store, timeout_s=self.config.timeout_s, peer_name=self._sender_name)
            if control.peek("formed") is not None:
                raise WeightSyncRejoinError(
                    f"{self.who} cannot join group {e.group_name!r} at {e.host}:{e.port}: the group has already "
                    "formed (this receiver, or the process it replaces, joined it before — e.g. an engine restarted "
                    "into a running group). A weight-sync group cannot be re-joined: close the sender, open a new "
                    "group (a new WeightSender, with a new group_name or port) and create every receiver for it")
            self.control = control
            self.control.put(f"hello/{e.rank}", {"label": e.label, **self.hello})
        return self.control

    def _connect(self) -> None:
        if self.transport is not None:
            return
        e = self.endpoint
        store = self._connect_control().store
        if self.config.backend == "cuda_ipc":
            from rlhfkit.weight_sync._ipc import IpcReceiver

            self.transport = IpcReceiver(self.control, self.slots, e.rank)
            return
        self.link = CollectiveLink(store, backend=self.config.backend, rank=e.rank, world_size=e.world_size,
                                   timeout_s=self.config.timeout_s, device=self.slots.device,
                                   describe_group=lambda: f"{self.who} and {self._sender_name(0)}",
                                   host=local_address_towards(e.host))
        self.link.connect()
        self.transport = CollectiveReceiver(self.link, self.slots)

    def receive(self, load_fn: Callable, expected: Sequence[TensorSpec] | None,
                held: int, *, by_bucket: bool = False) -> tuple[Manifest, Any]:
        version = self.seen + 1
        data = self._connect_control().get_bytes(f"{version}/start", peer=0, what=f"the manifest of sync {version}")
        self._connect()  # gloo/NCCL: the first sync joins the group here, as the sender does after publishing
        self.seen = version
        try:
            manifest = Manifest.from_bytes(data)
            problems = compare_manifest(manifest, expected)
            if manifest.version <= held:
                raise WeightSyncVersionError(
                    f"{self.who} holds weight version {held} and sync {manifest.version} offers version "
                    f"{manifest.version}; versions must strictly increase (has the sender restarted? open a new "
                    "group for a new sender)")
        except WeightSyncError as error:  # tell the sender, which waits for this receiver's verdict
            self.control.put(f"{version}/check/{self.endpoint.rank}", {"error": error_kind(error),
                                                                         "message": str(error)})
            raise
        self._check(manifest, problems)
        stream = ReceivedStream(manifest, self.transport, self.slots,
                                abort_message=lambda: self._abort_message(version))
        try:
            self.transport.prepare(manifest)
            loaded = call_load_fn(load_fn, stream.by_bucket() if by_bucket else iter(stream), version)
            stream.finish()
        except Exception as error:
            self._report_failure(stream, error, held)
            raise
        if self.slots.device.type == "cuda":
            torch.cuda.current_stream(self.slots.device).synchronize()  # loaded, not just queued
        self.control.put(f"{version}/done/{self.endpoint.rank}", {"version": version})
        return manifest, loaded

    def _check(self, manifest: Manifest, problems: list[str]) -> None:
        """Report this receiver's verdict on the manifest, then wait for the sender's go-ahead."""
        version, rank = manifest.version, self.endpoint.rank
        if problems:
            message = _mismatch_message(manifest, self.who, problems)
            self.control.put(f"{version}/check/{rank}", {"error": "manifest", "message": message})
            raise ManifestMismatchError(message)
        self.control.put(f"{version}/check/{rank}", {"ok": 1})
        go = self.control.get(f"{version}/go", peer=0, what=f"the go-ahead of sync {version}")
        if "abort" in go:
            raise error_from_report(go.get("kind", "aborted"), go["abort"])

    def _abort_message(self, version: int) -> str:
        reason = self.control.get(f"{version}/abort", peer=0, what=f"the reason it aborted sync {version}")
        return f"{self._sender_name(0)} aborted sync {version}: {reason['message']}"

    def _report_failure(self, stream: ReceivedStream, error: Exception, held: int) -> None:
        kind = error_kind(error)
        message = str(error) if isinstance(error, WeightSyncError) else f"{type(error).__name__}: {error}"
        version = stream.manifest.version
        try:
            stream.fail(kind, message)  # CUDA IPC: tell the sender now; gloo/NCCL: take the remaining broadcasts
        except Exception as drain_error:  # best effort; the original error is what the caller raises
            logger.warning("%s could not wind down sync %d after its failure: %s", self.who, version, drain_error)
        try:
            self.control.put(f"{version}/done/{self.endpoint.rank}",
                             {"error": kind, "message": message, "version": held})
        except (RuntimeError, OSError) as report_error:
            logger.warning("%s could not report its failure of sync %d to the sender: %s", self.who, version,
                           report_error)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.slots.release()
        self.transport = self.link = self.control = None


def load_local(manifest: Manifest, expected: Sequence[TensorSpec] | None, iterator: Iterator,
               load_fn: Callable) -> Any:
    """In-process sync: same checks (manifest, full consumption), no copies into buckets."""
    problems = compare_manifest(manifest, expected)
    if problems:
        raise ManifestMismatchError(_mismatch_message(manifest, "the in-process receiver", problems))
    stream = local_stream(manifest, iterator)
    consumed = [0]

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for item in stream:
            consumed[0] += 1
            yield item

    loaded = call_load_fn(load_fn, counted(), manifest.version)
    if consumed[0] < len(manifest.specs):
        raise WeightSyncError(f"load_fn returned after taking {consumed[0]} of the {len(manifest.specs)} tensors of "
                              f"sync {manifest.version}; it must consume the whole iterator")
    next(stream, None)  # runs the source's end-of-stream check when load_fn stopped right at the last tensor
    return loaded
