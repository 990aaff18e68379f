"""gloo / NCCL transport of the weight-sync channel (private to :mod:`rlhfkit.weight_sync`). Needs torch.distributed.

A process group of its own — ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` constructed directly on a prefix of the
control store — holds the sender (rank 0) and every receiver; the default process group is never touched. Each bucket
(payload + 16-byte tail) is one ``broadcast`` from rank 0, so every receiver (e.g. each tensor-parallel worker of an
engine) gets every full tensor. The sender keeps ``num_slots`` buckets in flight (broadcasts are asynchronous); a
receiver has one bucket buffer. A receiver that fails mid-stream keeps taking part in the remaining broadcasts without
loading them (so the sender never blocks on it) and reports its error at the end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from rlhfkit._weight_sync_buckets import STATUS_ABORT, BucketSlots
from rlhfkit._weight_sync_errors import WeightSyncError, WeightSyncTimeout
from rlhfkit._weight_sync_manifest import Bucket, Manifest

__all__ = ["CollectiveLink", "CollectiveSender", "CollectiveReceiver"]

logger = logging.getLogger(__name__)


def _nccl_backend_class() -> type:
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        from torch.distributed import distributed_c10d

        nccl = getattr(distributed_c10d, "ProcessGroupNCCL", None)
    if nccl is None:
        raise WeightSyncError("backend='nccl' needs a torch built with NCCL; this one has none (use 'gloo')")
    return nccl


class CollectiveLink:
    """The group's own process group. ``connect()`` is collective: every rank must call it."""

    def __init__(self, store: dist.Store, *, backend: str, rank: int, world_size: int, timeout_s: float,
                 device: torch.device, describe_group: Callable[[], str]) -> None:
        self.store, self.backend, self.rank, self.world_size = store, backend, rank, world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device
        self.describe_group = describe_group
        self.group = None

    def connect(self) -> None:
        if self.group is not None:
            return
        prefix = dist.PrefixStore(f"pg/{self.backend}", self.store)
        started = time.monotonic()
        try:
            if self.backend == "gloo":
                self.group = dist.ProcessGroupGloo(prefix, self.rank, self.world_size, self.timeout)
            else:
                nccl = _nccl_backend_class()
                options = nccl.Options()
                options._timeout = self.timeout
                options.is_high_priority_stream = False
                self.group = nccl(prefix, self.rank, self.world_size, options)
                if hasattr(self.group, "_set_sequence_number_for_group"):
                    self.group._set_sequence_number_for_group()
        except (RuntimeError, OSError) as error:
            if time.monotonic() - started >= self.timeout.total_seconds() - 0.05:
                raise WeightSyncTimeout(f"timed out after {self.timeout.total_seconds():g}s forming the "
                                        f"{self.backend} group of {self.describe_group()}: not every member joined "
                                        f"(each must be in its first send/receive)") from error
            raise WeightSyncError(f"could not form the {self.backend} group of {self.describe_group()}: {error}") \
                from error

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        return self.group.broadcast([tensor], options)

    def wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()
        except (RuntimeError, OSError) as error:
            raise WeightSyncError(f"{self.backend} broadcast of {what} in {self.describe_group()} failed: {error}") \
                from error

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except RuntimeError as error:  # already torn down by a peer failure; nothing left to release
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
        if peer_failed:
            return
        self.acquire(version, bucket)
        self.slots.write_tail(bucket, None, STATUS_ABORT)
        self.publish(version, bucket)
        self.flush(version)

    def flush(self, version: int) -> None:
        for slot in sorted(self._pending):
            work, index = self._pending.pop(slot)
            self.link.wait(work, f"bucket {index} of sync {version}")


class CollectiveReceiver:
    """Receiver half: one bucket buffer; each bucket is one blocking receive."""

    def __init__(self, link: CollectiveLink, slots: BucketSlots) -> None:
        self.link, self.slots = link, slots

    def prepare(self, manifest: Manifest) -> None:
        self.slots.ensure(manifest.capacity)

    def receive(self, version: int, bucket: Bucket) -> None:
        self.link.wait(self.link.broadcast(self.slots.wire(bucket)), f"bucket {bucket.index} of sync {version}")

    def release(self, version: int, bucket: Bucket) -> None:
        """The bucket's tensors were handed over; nothing to signal (the next broadcast is the signal)."""

    def fail(self, version: int, bucket: Bucket, kind: str, message: str) -> None:
        """Nothing to signal here; the caller drains the remaining buckets and reports at the end."""

    status_in_tail = True  # an abort reaches receivers as the tail's status word
    drains = True  # after a local failure, keep receiving (without loading) so the sender never blocks
