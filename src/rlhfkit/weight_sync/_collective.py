"""gloo / NCCL transport of the weight-sync channel (private to :mod:`rlhfkit.weight_sync`). Needs torch.distributed.

A process group of its own — ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` constructed directly on a prefix of the
(signed) control store — holds the sender (rank 0) and every receiver; the default process group is never touched. Each bucket
(payload + 8-byte status tail) is one ``broadcast`` from rank 0, so every receiver (e.g. each tensor-parallel worker of an
engine) gets every full tensor. The sender keeps ``num_slots`` buckets in flight (broadcasts are asynchronous); a
receiver has one bucket buffer. A receiver that fails mid-stream keeps taking part in the remaining broadcasts without
loading them (so the sender never blocks on it) and reports its error at the end.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from rlhfkit.weight_sync._buckets import STATUS_ABORT, BucketSlots
from rlhfkit.weight_sync._errors import WeightSyncError, WeightSyncTimeout
from rlhfkit.weight_sync._manifest import Bucket, Manifest

__all__ = ["CollectiveLink", "CollectiveSender", "CollectiveReceiver", "run_bounded", "poll_until",
           "local_address_towards"]

logger = logging.getLogger(__name__)


def _nccl_backend_class() -> type:
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise WeightSyncError("backend='nccl' needs a torch built with NCCL; this one has none (use 'gloo')")
    return nccl


def local_address_towards(host: str) -> str:
    """The address of this machine that reaches ``host``: ``host`` itself when it is a loopback address (every peer
    is on this node), else the source address the kernel picks to route to it (a UDP ``connect`` sends nothing)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    except OSError:
        return host  # gloo will report the unresolvable name itself
    if ipaddress.ip_address(address[0].split("%")[0]).is_loopback:
        return address[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(address)
            return probe.getsockname()[0]
        except OSError:
            return host


def run_bounded(call: Callable[[], object], timeout_s: float, on_timeout: Callable[[], Exception]) -> object:
    """``call()`` in a helper thread, waited for at most ``timeout_s``; raises ``on_timeout()`` past it.

    For blocking C calls that have no deadline of their own (NCCL communicator creation inside torch, which releases
    the GIL): the thread is left behind when it times out — the caller must treat the group as broken."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name="rlhfkit-weight-sync-bounded", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise on_timeout()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome.get("value")


def poll_until(done: Callable[[], bool], deadline: float) -> bool:
    """Poll ``done()`` until it is True (returns True) or ``time.monotonic()`` passes ``deadline`` (returns False).
    Spins briefly, then sleeps in growing steps up to 1 ms, so a GPU wait costs little latency and no busy core."""
    pause = 0.0
    while not done():
        if time.monotonic() >= deadline:
            return False
        if pause:
            time.sleep(pause)
        pause = min(max(pause * 2, 2e-5), 1e-3)
    return True


class CollectiveLink:
    """The group's own process group. ``connect()`` is collective: every rank must call it.

    NCCL: the communicator is created eagerly in ``connect()`` and checked with an 8-byte broadcast, each bounded by
    ``timeout_s``; ``wait(..., host=True)`` polls a CUDA event against the deadline (an NCCL ``Work.wait()`` only
    makes the stream wait); after a timeout the communicator is aborted, so nothing later blocks on it. The NCCL
    watchdog's timeout is set past ``timeout_s``, so our error, which names the peer, comes first.

    The rendezvous goes through the group's signed control store. gloo's pair sockets listen on ``host`` (a
    receiver's own address towards the sender); pin NCCL's sockets with ``NCCL_SOCKET_IFNAME`` (docs/security.md).
    """

    def __init__(self, store: dist.Store, *, backend: str, rank: int, world_size: int, timeout_s: float,
                 device: torch.device, describe_group: Callable[[], str], host: str = "127.0.0.1") -> None:
        self.store, self.backend, self.rank, self.world_size = store, backend, rank, world_size
        self.host = host
        self.timeout_s = timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device
        self.describe_group = describe_group
        self.group = None
        self.broken = False

    def _timeout_error(self, what: str) -> WeightSyncTimeout:
        return WeightSyncTimeout(f"timed out after {self.timeout_s:g}s {what} in {self.describe_group()}: the peer "
                                 f"did not take part (dead, stuck, or not in the same sync)")

    def connect(self) -> None:
        if self.group is not None:
            return
        prefix = dist.PrefixStore(f"pg/{self.backend}", self.store)
        started = time.monotonic()
        try:
            if self.backend == "gloo":
                self.group = self._gloo_group(prefix)
            else:
                self.group = self._nccl_group(prefix)
        except WeightSyncError:
            self.abort()
            raise
        except (RuntimeError, OSError) as error:
            self.abort()
            if time.monotonic() - started >= self.timeout_s - 0.05:
                raise WeightSyncTimeout(f"timed out after {self.timeout_s:g}s forming the "
                                        f"{self.backend} group of {self.describe_group()}: not every member joined "
                                        f"(each must be in its first send/receive)") from error
            raise WeightSyncError(f"could not form the {self.backend} group of {self.describe_group()}: {error}") \
                from error

    def _gloo_group(self, prefix: dist.Store) -> object:
        """gloo's pair sockets listen on ``host`` (this rank's address towards the sender), not on whatever the
        machine's hostname resolves to."""
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        return dist.ProcessGroupGloo(prefix, self.rank, self.world_size, options)

    def _nccl_group(self, prefix: dist.Store) -> object:
        nccl = _nccl_backend_class()
        options = nccl.Options()
        options._timeout = timedelta(seconds=2 * self.timeout_s + 30)  # the watchdog fires after our deadline
        options.is_high_priority_stream = False
        group = nccl(prefix, self.rank, self.world_size, options)
        self.group = group
        deadline = time.monotonic() + self.timeout_s
        with torch.cuda.device(self.device):
            if hasattr(group, "eager_connect_single_device"):
                run_bounded(lambda: group.eager_connect_single_device(self.device), self.timeout_s,
                            lambda: self._timeout_error("creating the NCCL communicator"))
            probe = torch.zeros(1, dtype=torch.int64, device=self.device)
            work = run_bounded(lambda: self.broadcast(probe), max(deadline - time.monotonic(), 1.0),
                               lambda: self._timeout_error("creating the NCCL communicator"))
            self.wait(work, "the connection check", host=True, deadline=deadline)
        return group

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        return self.group.broadcast([tensor], options)

    def wait(self, work: dist.Work, what: str, *, host: bool = False, deadline: float | None = None) -> None:
        """Wait for ``work``. gloo: on the host (gloo's own timeout bounds it). NCCL: the current stream waits;
        with ``host=True`` the host also waits, until ``deadline`` (default: now + timeout)."""
        try:
            work.wait()
        except (RuntimeError, OSError) as error:
            self.broken = True
            raise WeightSyncError(f"{self.backend} broadcast of {what} in {self.describe_group()} failed: {error}") \
                from error
        if not host or self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        if not poll_until(event.query, deadline):
            self.abort()
            raise self._timeout_error(f"waiting for the {self.backend} broadcast of {what}")

    def abort(self) -> None:
        """Tear the communicator down without waiting for anything in flight (after a timeout or failure)."""
        self.broken = True
        group = self.group
        if group is not None and self.backend == "nccl" and hasattr(group, "abort"):
            try:
                run_bounded(group.abort, 10.0, lambda: WeightSyncError("ncclCommAbort did not return in 10 s"))
            except (WeightSyncError, RuntimeError) as error:  # best effort: the caller raises the real error
                logger.warning("aborting the NCCL group of %s failed: %s", self.describe_group(), error)

    def close(self) -> None:
        group, self.group = self.group, None
        if group is None or self.broken:
            return  # an aborted group has nothing left to release, and a shutdown could block on it
        if hasattr(group, "shutdown"):
            try:
                run_bounded(group.shutdown, 30.0, lambda: WeightSyncError("shutdown did not return in 30 s"))
            except (WeightSyncError, RuntimeError) as error:  # already torn down by a peer failure, or stuck
                logger.debug("shutdown of the %s group failed: %s", self.backend, error)


class CollectiveSender:
    """Sender half: buckets are broadcast asynchronously; slot reuse waits for that slot's previous broadcast."""

    def __init__(self, link: CollectiveLink, slots: BucketSlots) -> None:
        self.link, self.slots = link, slots
        self._pending: dict[int, tuple[dist.Work, int]] = {}

    def prepare(self, capacity: int) -> int:
        self.slots.ensure(capacity)
        return 0

    def acquire(self, version: int, bucket: Bucket) -> None:
        entry = self._pending.pop(bucket.index % self.slots.num_slots, None)
        if entry is not None:
            self.link.wait(entry[0], f"bucket {entry[1]} of sync {version}")

    def publish(self, version: int, bucket: Bucket) -> None:
        self._pending[bucket.index % self.slots.num_slots] = (self.link.broadcast(self.slots.wire(bucket)),
                                                              bucket.index)

    def abort(self, version: int, bucket: Bucket, message: str, *, peer_failed: bool) -> None:
        """Tell receivers (blocked in this bucket's broadcast) to stop: broadcast it with an abort status. Skipped
        when a peer already broke the group — another broadcast would only fail or hang."""
        if peer_failed or self.link.broken:
            return
        self.acquire(version, bucket)
        self.slots.write_status(bucket, STATUS_ABORT)
        self.publish(version, bucket)
        self.flush(version)

    def flush(self, version: int) -> None:
        """Wait on the host (bounded) until every broadcast in flight has finished."""
        deadline = time.monotonic() + self.link.timeout_s
        for slot in sorted(self._pending):
            work, index = self._pending.pop(slot)
            self.link.wait(work, f"bucket {index} of sync {version}", host=True, deadline=deadline)


class CollectiveReceiver:
    """Receiver half: one bucket buffer; each bucket is one blocking receive."""

    def __init__(self, link: CollectiveLink, slots: BucketSlots) -> None:
        self.link, self.slots = link, slots

    def prepare(self, manifest: Manifest) -> None:
        self.slots.ensure(manifest.capacity)

    def receive(self, version: int, bucket: Bucket) -> None:
        if self.link.broken:
            raise WeightSyncError(f"the {self.link.backend} group of {self.link.describe_group()} was aborted after "
                                  f"an earlier failure; bucket {bucket.index} of sync {version} cannot arrive")
        self.link.wait(self.link.broadcast(self.slots.wire(bucket)), f"bucket {bucket.index} of sync {version}",
                       host=True)

    def release(self, version: int, bucket: Bucket) -> None:
        """The bucket's tensors were handed over; nothing to signal (the next broadcast is the signal)."""

    def fail(self, version: int, bucket: Bucket, kind: str, message: str) -> None:
        """Nothing to signal here; the caller drains the remaining buckets and reports at the end."""

    status_in_tail = True  # an abort reaches receivers as the tail's status word
    drains = True  # after a local failure, keep receiving (without loading) so the sender never blocks
