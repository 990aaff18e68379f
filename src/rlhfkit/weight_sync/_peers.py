"""The two ends of a multi-process sync and the in-process path (private to :mod:`rlhfkit.weight_sync`).

Protocol of one sync, version ``v`` (keys in :mod:`rlhfkit.weight_sync._control`):
1. the sender claims the sync (unless a receiver called it off first) and publishes its start: the manifest (left out
   when it repeats the last one, which every receiver accepted) and, over CUDA IPC, bucket 0's ready message; each
   receiver checks the manifest against what it accepts and answers ok or error;
2. the sender answers go (all ok) or abort (someone rejected it or timed out) — so a mismatch fails on every end
   before any weights move (a repeated manifest skips this round: a receiver that now refuses it fails before
   loading, and its report says why);
3. buckets move (a broadcast each for gloo/NCCL; ready/consumed messages for CUDA IPC); a sender-side failure
   mid-stream aborts the receivers (abort status in the bucket tail, or an abort message);
4. each receiver reports done (the version it now holds, or its error) — a CUDA-IPC receiver with events as soon as
   its copies are queued, the sender then waiting on its event; the sender returns when all have, and all ran.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from rlhfkit._store import new_secret
from rlhfkit.weight_sync._buckets import STATUS_OK, BucketSlots, Fingerprinter
from rlhfkit.weight_sync._collective import (
    CollectiveLink,
    CollectiveReceiver,
    CollectiveSender,
    local_address_towards,
)
from rlhfkit.weight_sync._control import ControlChannel, open_store
from rlhfkit.weight_sync._errors import (
    ManifestMismatchError,
    WeightSyncAborted,
    WeightSyncError,
    WeightSyncRejoinError,
    WeightSyncVersionError,
    error_from_report,
    error_kind,
)
from rlhfkit.weight_sync._manifest import Manifest, TensorSpec, compare_manifest, plan_buckets
from rlhfkit.weight_sync._stream import ReceivedStream, call_load_fn, collect_bucket, local_stream, pack_bucket

__all__ = ["SenderSide", "ReceiverSide", "load_local"]

logger = logging.getLogger(__name__)
CALLED_OFF = b"\x00called-off:"  # a sync's manifest and start keys when a receiver called it off before it started
CLAIMED = b"\x00sent"  # a sync's manifest key once the sender has claimed it (the manifest travels in the start key)


def _mismatch_message(manifest: Manifest, who: str, problems: list[str]) -> str:
    shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
    return f"the manifest of sync {manifest.version} does not match what {who} accepts: {shown}"


class _Phases:
    """Where one end's time went in a sync: consecutive marks since creation (``minus`` moves time to another
    phase added with :meth:`add`)."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self._phases: dict[str, float] = {}

    def mark(self, name: str, *, minus: float = 0.0) -> None:
        now = time.perf_counter()
        self.add(name, now - self.last - minus)
        self.last = now

    def add(self, name: str, seconds: float) -> None:
        self._phases[name] = self._phases.get(name, 0.0) + seconds

    @property
    def phases(self) -> tuple[tuple[str, float], ...]:
        return tuple(self._phases.items())

    @property
    def total(self) -> float:
        return self.last - self.started


class SenderSide:
    """Rank 0 of a multi-process group: owns the control store, the bucket buffers and the version counter."""

    def __init__(self, config: Any, endpoint: Any, device: torch.device, fingerprinter: Fingerprinter) -> None:
        self.config, self.endpoint, self.fingerprinter = config, endpoint, fingerprinter
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
        self.phases: tuple[tuple[str, float], ...] = ()  # of the last sync, for SyncReport.phases
        self._accepted: bytes | None = None  # the manifest body every receiver accepted and loaded last time
        self._plan: tuple | None = None  # (specs, buckets, capacity, total bytes) of the last sync
        self._stale: list[str] = []  # the last sync's larger keys (claim, start, zero-copy bucket messages), deleted
        # while the next sync waits for its receivers
        self._encoded: tuple[Manifest, bytes] | None = None  # the last manifest (version 0) and its encoding's tail

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

            self.transport = IpcSender(self.control, self.slots, self.peers, use_events=self.config.ipc_events,
                                       zero_copy=self.config.ipc_zero_copy)
            return
        # joined in send(), after the first manifest is out: receivers waiting for it join then
        self.link = CollectiveLink(self.store, backend=self.config.backend, rank=0,
                                   world_size=self.endpoint.world_size, timeout_s=self.config.timeout_s,
                                   device=self.slots.device, describe_group=self.describe_group,
                                   host=self.endpoint.host)
        self.transport = CollectiveSender(self.link, self.slots)

    def send(self, specs: list[TensorSpec], iterator: Iterator, *,
             trusted: bool = False) -> tuple[Manifest, tuple]:
        """One sync. ``trusted``: ``specs`` were just read off the very tensors ``iterator`` yields (no need to check
        each tensor against its spec again)."""
        clock = _Phases()
        self._connect()
        manifest, data = self._manifest(tuple(specs))
        # bucket 0 is made ready before anyone hears of the sync (its slot is free: the last sync ended with every
        # receiver done), so receivers find it waiting instead of waiting for it — its "ready" message even travels
        # with the start when the transport allows; if that fails, the sync goes on until bucket 0 is due and is
        # aborted there, as if it had failed then (receivers learn it at once)
        first: tuple | Exception | None = None
        first_message: bytes | None = None
        if manifest.buckets:
            bucket = manifest.buckets[0]
            self.transport.acquire(manifest.version, bucket)
            try:
                first = self._fill(manifest, bucket, iterator, trusted=trusted)
                if getattr(self.transport, "inline_first", False):
                    first_message = json.dumps(self.transport.ready(manifest.version, bucket, *first)).encode()
            except Exception as error:  # noqa: BLE001 — re-raised in _stream, after the receivers are told
                first = error
        self.version = manifest.version  # used even if the sync fails: a version is never reused
        body = self._encoded[1] if self._encoded is not None else None
        # the same manifest as the last sync, which every receiver accepted: its verdicts cannot differ, so the
        # check round is skipped (a receiver whose own expectations changed meanwhile still refuses, before loading)
        prechecked = body is not None and body == self._accepted
        self._accepted = None  # until this sync has succeeded
        clock.mark("prepare")
        self._publish(manifest.version, data, prechecked=prechecked, first=first_message)
        clock.mark("publish")
        try:
            if self.link is not None and self.link.group is None:
                self.link.connect()
            if not prechecked:
                self._check(manifest)
                clock.mark("check")
            self._stream(manifest, iterator, first, sent_first=first_message is not None,
                         trusted=trusted)
            clock.mark("stream")
            self._delete_stale()  # now that receivers are busy loading
            versions = self._done(manifest)
            clock.mark("wait_done")
            self.phases = clock.phases
            self._accepted = body
        finally:
            self._delete_stale()  # (not done above if this sync failed first)
            version = manifest.version
            self._stale = [f"{version}/manifest", f"{version}/start"]
            if manifest.zero_copy:  # their messages carry every tensor's placement
                self._stale += [f"{version}/b/{bucket.index}" for bucket in manifest.buckets[1:]]
            end_sync = getattr(self.transport, "end_sync", None)
            if end_sync is not None:
                end_sync()
        return manifest, versions

    def _delete_stale(self) -> None:
        for key in self._stale:
            self.control.delete(key)
        self._stale = []

    def _publish(self, version: int, data: bytes, *, prechecked: bool = False, first: bytes | None = None) -> None:
        """Publish the manifest unless a receiver called this sync off first (see ``ReceiverSide.call_off``), then
        wake the receivers: the start key says whether a check round follows, and may carry bucket 0's message."""
        current = self.store.compare_set(f"{version}/manifest", b"", CLAIMED)
        if current != CLAIMED:
            who = current[len(CALLED_OFF):].decode(errors="replace") if current.startswith(CALLED_OFF) else "?"
            raise WeightSyncAborted(
                f"sync {version} of {self.describe_group()} was called off by {who} before it started: its engine "
                f"settled an armed sync that had not begun (arm the engine again, then send)")
        # a repeated manifest (prechecked: every receiver accepted and loaded it last time, so each has it parsed)
        # is not sent again: an empty body means "the last one, at this version"
        verdict = b"go" if prechecked else b"check"
        self.control.put_bytes(f"{version}/start", b"\n".join((verdict, first or b"", b"" if prechecked else data)))

    def _manifest(self, specs: tuple[TensorSpec, ...]) -> tuple[Manifest, bytes]:
        """This sync's manifest and its bytes; the layout and encoding are reused while the stream's description
        and the buffers stay the same (only the version changes from sync to sync)."""
        if self._plan is None or self._plan[0] != specs:
            self._plan = (specs, *plan_buckets(specs, self.config.bucket_bytes),
                          sum(spec.nbytes for spec in specs))
        specs, buckets, capacity, total = self._plan  # (the same tuple as the last sync's: compared by identity)
        generation = self.transport.prepare(capacity)
        version = self.version + 1
        manifest = Manifest(version=version, specs=specs, buckets=buckets, capacity=capacity,
                            fingerprints=self.config.fingerprints, num_slots=self.slots.num_slots,
                            generation=generation,
                            ipc_events=self.config.backend == "cuda_ipc" and self.config.ipc_events,
                            zero_copy=self.config.backend == "cuda_ipc" and self.config.ipc_zero_copy,
                            keep_mapped=self.config.ipc_keep_mapped, total_bytes=total)
        template = replace(manifest, version=0)
        if self._encoded is None or self._encoded[0] != template:
            self._encoded = (template, template.body_bytes())
        return manifest, Manifest.join_version(version, self._encoded[1])

    def _check(self, manifest: Manifest) -> None:
        version = manifest.version
        try:
            checks = self.control.gather(lambda r: f"{version}/check/{r}", self.peers,
                                         what=f"its check of the manifest of sync {version}")
        except WeightSyncError as error:
            self.control.put(f"{version}/go", {"abort": f"the sync was called off: {error}", "kind": "aborted"})
            raise
        failures = [f"{self.peer_name(r)} rejected it: {c['message']}" for r, c in checks.items() if "error" in c]
        if failures:
            message = f"sync {version} was not started: " + " | ".join(failures)
            self.control.put(f"{version}/go", {"abort": message, "kind": "manifest"})
            raise ManifestMismatchError(message)
        self.control.put(f"{version}/go", {"go": 1})

    def _stream(self, manifest: Manifest, iterator: Iterator,
                first: tuple | Exception | None, *, sent_first: bool = False, trusted: bool = False) -> None:
        """Publish every bucket in order; bucket 0 is ``first``, filled (or failed) before the manifest went out
        (``sent_first``: its message went with the start)."""
        version, transport = manifest.version, self.transport
        for bucket in manifest.buckets:
            try:
                transport.acquire(version, bucket)
            except WeightSyncError as error:
                self._abort(manifest, bucket, f"{error}", peer_failed=True)
                raise
            try:
                if bucket.index == 0 and first is not None:
                    if isinstance(first, Exception):
                        raise first
                    if sent_first:
                        continue
                    published = first
                else:
                    published = self._fill(manifest, bucket, iterator, trusted=trusted)
            except Exception as error:
                self._abort(manifest, bucket, f"the sender failed while packing bucket {bucket.index}: "
                                              f"{type(error).__name__}: {error}", peer_failed=False)
                raise
            try:
                transport.publish(version, bucket, *published)
            except WeightSyncError as error:
                raise WeightSyncError(f"{error} (while sending to {self.describe_group()})") from error
        try:
            transport.flush(version)
        except WeightSyncError as error:
            raise WeightSyncError(f"{error} (while sending to {self.describe_group()})") from error

    def _fill(self, manifest: Manifest, bucket: Any, iterator: Iterator, *,
              trusted: bool = False) -> tuple:
        """Make bucket ``bucket`` ready; returns the extra arguments of the transport's ``publish``."""
        if manifest.zero_copy:  # receivers read the source tensors where they are
            tensors = collect_bucket(manifest, bucket, iterator, self.slots.device, trusted=trusted)
            if manifest.fingerprints:
                return tensors, int(self.fingerprinter.of_tensors([t.detach() for t in tensors]).item())
            return tensors, None
        views = self.slots.views(manifest, bucket)
        pack_bucket(manifest, bucket, iterator, views)
        fingerprint = (self.fingerprinter.of_payload(self.slots.buffer(bucket), bucket) if manifest.fingerprints
                       else None)
        self.slots.write_tail(bucket, fingerprint, STATUS_OK)
        return ()

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
        queued = [rank for rank, report in reports.items() if report.get("queued")]
        if queued:  # reported as soon as their copies were queued: wait for those copies here
            self.transport.await_loaded(manifest.buckets[-1], queued)
        return tuple(int(reports[rank]["version"]) for rank in self.peers)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.slots.release()
        self.transport = self.link = self.control = self.store = None  # the last reference stops the store


class _Parsed(NamedTuple):
    body: bytes  # the encoding after its version
    expected: Sequence[TensorSpec] | None
    manifest: Manifest
    problems: list[str]


class ReceiverSide:
    """Rank ≥ 1 of a multi-process group; joins the store and the process group at the first receive."""

    def __init__(self, config: Any, endpoint: Any, device: torch.device, hello: dict[str, Any]) -> None:
        self.config, self.endpoint, self.hello = config, endpoint, hello
        self.slots = BucketSlots(device, 1)
        self.fingerprinter = Fingerprinter()
        self.seen = 0  # the last sync whose manifest this receiver read
        self._parsed: _Parsed | None = None  # the last manifest read, while its layout and ``expected`` repeat
        self.control: ControlChannel | None = None
        self.link: CollectiveLink | None = None
        self.transport: Any = None
        # waiting ahead of the sender (wait_for_sync / call_off, from two threads): "idle", "awaiting" (version) or
        # "started" (its manifest read, not yet received)
        self._lock = threading.Lock()
        self._phase: tuple[str, int] = ("idle", 0)
        self._started: tuple[int, bytes, bool, bytes] | None = None
        self._called_off = 0  # the last version whose wait ended called off
        self.phases: tuple[tuple[str, float], ...] = ()  # of the last sync, for SyncReport.phases

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

    def _next_manifest(self, deadline: float | None = None) -> tuple[int, bytes, bool, bytes] | None:
        """Wait for the next sync's manifest: ``(version, bytes, prechecked, bucket 0's message or b"")``, or None
        when it was called off. Versions other receivers called off are skipped."""
        control = self._connect_control()
        while True:
            version = self.seen + 1
            start = control.get_bytes(f"{version}/start", peer=0, what=f"the manifest of sync {version}",
                                      deadline=deadline)
            if not start.startswith(CALLED_OFF):
                verdict, first, data = start.split(b"\n", 2)
                return version, data, verdict == b"go", first
            self.seen = version  # the sender fails this version; the next sync is version + 1
            with self._lock:
                if self._phase == ("awaiting", version):
                    return None

    def wait_for_sync(self, timeout_s: float) -> bool:
        """Block until the sender starts the next sync (True) or :meth:`call_off` ends the wait (False)."""
        with self._lock:
            if self._phase[0] != "idle":
                raise RuntimeError(f"{self.who}: wait_for_sync called while {self._phase[0]}")
            self._phase = ("awaiting", self.seen + 1)
        try:
            started = self._next_manifest(time.monotonic() + timeout_s)
        except BaseException:
            with self._lock:
                self._phase = ("idle", 0)
            raise
        with self._lock:
            self._phase = ("started", started[0]) if started is not None else ("idle", 0)
            if started is None:
                self._called_off = self.seen
        self._started = started
        return started is not None

    def call_off(self) -> bool:
        """From another thread: make the next sync (the one after the last received) not happen here unless it has
        already started. Returns False when it has (receive it as usual); True when it is called off — a waiting
        or later :meth:`wait_for_sync` returns False, and the sender's ``send`` of it fails at once, naming this
        receiver."""
        with self._lock:
            phase, version = self._phase
            if phase == "started":
                return False
            if phase == "idle":
                if self._called_off == self.seen > 0:
                    return True  # the last wait already ended called off (by another receiver, perhaps)
                version = self.seen + 1
        # a client of its own: the waiting thread is using the control store's connection
        e = self.endpoint
        store = open_store(host=e.host, port=e.port, is_master=False, timeout_s=self.config.timeout_s,
                           peer=self._sender_name(0), secret=e.secret)
        mark = CALLED_OFF + self.who.encode()
        current = store.compare_set(f"{version}/manifest", b"", mark)
        if current != mark:
            return False  # the sender was first: the sync is under way
        store.set(f"{version}/start", mark)  # wakes the waiting thread (and any other receiver of this group)
        return True

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
                held: int, *, by_bucket: bool = False) -> tuple[Manifest, Any, float]:
        with self._lock:
            phase = self._phase[0]
            self._phase = ("idle", 0)
        if phase == "awaiting":
            raise RuntimeError(f"{self.who}: receive called while another thread waits in wait_for_sync")
        found, self._started = (self._started if phase == "started" else None), None
        while found is None:  # skips versions called off
            found = self._next_manifest()
        version, data, prechecked, first = found
        self._connect()  # gloo/NCCL: the first sync joins the group here, as the sender does after publishing
        clock = _Phases()
        self.seen = version
        try:
            manifest, problems = self._parse(version, data, expected)
            if manifest.version <= held:
                raise WeightSyncVersionError(
                    f"{self.who} holds weight version {held} and sync {manifest.version} offers version "
                    f"{manifest.version}; versions must strictly increase (has the sender restarted? open a new "
                    "group for a new sender)")
        except WeightSyncError as error:  # tell the sender, which waits for this receiver's report
            self.control.put(f"{version}/done/{self.endpoint.rank}",
                             {"error": error_kind(error), "message": str(error), "version": held})
            raise
        if not prechecked:
            self._check(manifest, problems)
        clock.mark("check")
        stream = ReceivedStream(manifest, self.transport, self.slots, self.fingerprinter,
                                abort_message=lambda: self._abort_message(version))
        end_sync = getattr(self.transport, "end_sync", lambda: None)  # CUDA IPC zero-copy: unmap the source
        try:
            self.transport.prepare(manifest)
            if first:
                self.transport.preload(version, 0, json.loads(first))
            if prechecked and problems:  # no check round to refuse in: fail the sync before loading anything
                raise ManifestMismatchError(_mismatch_message(manifest, self.who, problems))
            loaded = call_load_fn(load_fn, stream.by_bucket() if by_bucket else iter(stream), version)
            stream.finish()
        except Exception as error:
            end_sync()
            self._report_failure(stream, error, held)
            raise
        clock.mark("load", minus=stream.waited)
        clock.add("wait_buckets", stream.waited)
        done_key = f"{version}/done/{self.endpoint.rank}"
        # CUDA IPC with events: report while the copies run (the sender waits on the event recorded after them)
        queued = bool(manifest.buckets) and getattr(self.transport, "pipelined_done", False)
        if queued:
            self.control.put(done_key, {"version": version, "queued": 1})
        if self.slots.device.type == "cuda":
            torch.cuda.current_stream(self.slots.device).synchronize()  # receive() returns loaded, not just queued
        end_sync()
        if not queued:
            self.control.put(done_key, {"version": version})
        clock.mark("finish")
        self.phases = clock.phases
        return manifest, loaded, clock.total

    def _parse(self, version: int, data: bytes,
               expected: Sequence[TensorSpec] | None) -> tuple[Manifest, list[str]]:
        """The manifest in ``data`` (empty: the last one again, at ``version``) and its differences from
        ``expected``; parsed and compared once while the sender's layout and ``expected`` stay the same (from sync to
        sync only the version changes)."""
        cached = self._parsed
        if not data:
            if cached is None:
                raise WeightSyncError(f"{self.who}: the sender sent sync {version} as a repeat of a manifest this "
                                      f"receiver has not seen")
            if cached.expected is not expected:
                self._parsed = cached = cached._replace(expected=expected,
                                                        problems=compare_manifest(cached.manifest, expected))
            return replace(cached.manifest, version=version), cached.problems
        split = Manifest.split_version(data)
        if split is not None and cached is not None and cached.body == split[1] and cached.expected is expected:
            return replace(cached.manifest, version=split[0]), cached.problems
        manifest = Manifest.from_bytes(data)
        problems = compare_manifest(manifest, expected)
        self._parsed = None if split is None else _Parsed(split[1], expected, manifest, problems)
        return manifest, problems

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
        unmap = getattr(self.transport, "unmap", None)
        if unmap is not None:
            unmap()
        self.slots.release()
        self.transport = self.link = self.control = None


def load_local(manifest: Manifest, expected: Sequence[TensorSpec] | None, iterator: Iterator, load_fn: Callable,
               fingerprinter: Fingerprinter) -> Any:
    """In-process sync: same checks (manifest, fingerprints, full consumption), no copies into buckets."""
    problems = compare_manifest(manifest, expected)
    if problems:
        raise ManifestMismatchError(_mismatch_message(manifest, "the in-process receiver", problems))
    stream = local_stream(manifest, iterator, fingerprinter)
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
