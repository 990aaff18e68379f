"""The weight-sync channel: trainer → rollout engines as a stream of ``(name, tensor)``.

What it does: :class:`WeightSender` takes any iterable of named tensors (``named_parameters()``, or a ZeRO-3 generator
that gathers a bucket at a time), packs it into reusable flat bucket buffers and moves them to every
:class:`WeightReceiver`, which hands one lazy iterator over the whole sync to a ``load_fn`` (e.g.
``HFEngine.load_weights``). Before the first byte moves, every receiver checks the :class:`Manifest` (names, shapes,
dtypes, bucket layout, version) against the tensors it accepts; a mismatch fails on every end, naming the tensor.
Each sync increments the weight version; every wait has a timeout whose error names the peer.

Backends (``WeightSyncConfig.backend``):
    ``"inprocess"``: trainer and engine in one process; tensors are handed over directly (no bucket copies).
    ``"gloo"``: CPU process group of the channel's own (tests, CPU users).
    ``"nccl"``: GPU process group of its own; one sender broadcasting to N receivers (each tensor-parallel worker
        of an engine receives every full tensor).
    ``"cuda_ipc"``: receivers on the sender's GPU map its bucket buffers once and copy out of them.

The sender (rank 0) owns a ``torch.distributed.TCPStore`` for every control message (plain processes, Ray actors and
vLLM workers alike; the default process group is never touched). It listens on exactly ``SyncEndpoint.host``; keys
are hashed and values signed with the group's per-run secret, and nothing read from it is unpickled (CUDA IPC handles
travel as JSON). Trainer and engine share only this module and :class:`SyncEndpoint`, a small picklable dataclass.

Memory: the sender holds ``num_buffers`` bucket buffers of ``max(bucket_bytes, largest tensor) + 8`` bytes (on CPU
for gloo, on its GPU for nccl/cuda_ipc); a gloo/nccl receiver holds one; a cuda_ipc receiver none (it reads the
sender's). What it does not do: shard tensors for tensor parallelism (the engine's loader does), gather ZeRO-3 parameters (the DeepSpeed wrapper's stream does), retry
failed syncs. Needs only torch (``torch.distributed``; CUDA for nccl/cuda_ipc).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from rlhfkit._store import check_secret
from rlhfkit.weight_sync._errors import (ManifestMismatchError, WeightSyncAborted, WeightSyncAuthenticationError,
                                         WeightSyncError, WeightSyncRejoinError, WeightSyncTimeout,
                                         WeightSyncVersionError)
from rlhfkit.weight_sync._manifest import Manifest, TensorSpec, describe_parameters, plan_buckets, to_spec
from rlhfkit.weight_sync._peers import ReceiverSide, SenderSide

__all__ = ["WeightSyncConfig", "SyncEndpoint", "SyncReport", "WeightSender", "WeightReceiver", "Manifest",
           "describe_parameters", "WeightSyncError", "WeightSyncTimeout", "ManifestMismatchError", "WeightSyncAborted",
           "WeightSyncRejoinError", "WeightSyncVersionError", "WeightSyncAuthenticationError"]

logger = logging.getLogger(__name__)

Backend = Literal["inprocess", "gloo", "nccl", "cuda_ipc"]
_BACKENDS = ("inprocess", "gloo", "nccl", "cuda_ipc")
LoadFn = Callable[[Iterable[tuple[str, torch.Tensor]]], int]


@dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
    """How weights travel. Sender and receivers use the same ``backend``; the rest is the sender's choice and
    travels in the manifest (a receiver's ``timeout_s`` governs its own waits).

    Attributes:
        backend: ``"inprocess"``, ``"gloo"``, ``"nccl"`` or ``"cuda_ipc"`` (see the module docstring).
        bucket_bytes: target payload of one bucket; a larger tensor gets a bucket of its own.
        num_buffers: 1, or 2 to pack bucket k+1 while bucket k is in flight (costs a second bucket buffer).
        timeout_s: limit of every wait on a peer (rendezvous, manifest check, bucket, acknowledgement).
        dtype: cast floating-point tensors to this dtype before sending (e.g. ``torch.bfloat16``); None keeps each.
    """

    backend: Backend = "gloo"
    bucket_bytes: int = 512 * 1024**2
    num_buffers: int = 1
    timeout_s: float = 300.0
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"WeightSyncConfig.backend={self.backend!r}; expected one of {_BACKENDS}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1024:
            raise ValueError(f"WeightSyncConfig.bucket_bytes={self.bucket_bytes!r}; use an int >= 1024 "
                             f"(hundreds of MiB on GPUs)")
        if self.num_buffers not in (1, 2):
            raise ValueError(f"WeightSyncConfig.num_buffers={self.num_buffers!r}; use 1, or 2 for overlap")
        if not self.timeout_s > 0:
            raise ValueError(f"WeightSyncConfig.timeout_s={self.timeout_s!r}; must be > 0 seconds")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"WeightSyncConfig.dtype={self.dtype!r}; use a floating torch.dtype such as "
                             f"torch.bfloat16, or None to keep each tensor's dtype")


@dataclass(frozen=True, kw_only=True)
class SyncEndpoint:
    """Where a sync group meets, and this process's place in it. Picklable: pass it to Ray actors (or any channel
    you trust: it carries the group's secret).

    Attributes:
        host: the address the sender's control store (and, with gloo, its pair sockets) listens on, exactly, and
            receivers connect to: loopback for receivers on the sender's node, the node's address only when receivers
            on other nodes must reach it. See docs/security.md.
        port: the store's port; 0 on the sender means "pick a free one" (read it back from ``sender.endpoint``).
        world_size: 1 sender + the number of receivers (for nccl: every engine worker that loads weights).
        rank: 0 for the sender, 1..world_size-1 for receivers.
        group_name: names the group in messages and keys.
        label: who this process is, quoted in the peers' error messages (e.g. ``"engine-0/tp-1"``).
        secret: the group's per-run secret (bytes, at least 16) that hashes every key and signs every value on the
            control store. A sender without one generates it; receivers take it from ``sender.endpoint.for_rank(r)``.
            Never shown in repr or messages.
    """

    host: str = "127.0.0.1"
    port: int = 0
    world_size: int = 2
    rank: int = 0
    group_name: str = "weights"
    label: str = ""
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(f"SyncEndpoint.world_size={self.world_size!r}; need 1 sender + at least 1 receiver")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"SyncEndpoint.rank={self.rank!r}; must be in [0, world_size={self.world_size})")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"SyncEndpoint.port={self.port!r}; must be in [0, 65535] (0: sender picks one)")
        if not self.group_name or "/" in self.group_name:
            raise ValueError(f"SyncEndpoint.group_name={self.group_name!r}; use a non-empty name without '/'")
        if self.secret is not None:
            object.__setattr__(self, "secret", check_secret(self.secret, where="SyncEndpoint.secret"))

    def for_rank(self, rank: int, label: str = "") -> SyncEndpoint:
        """The endpoint a receiver of this group uses (pass the sender's ``endpoint`` so the port is known)."""
        return replace(self, rank=rank, label=label)


@dataclass(frozen=True, kw_only=True)
class SyncReport:
    """What one sync did, as seen by one end.

    Attributes:
        version: the weight version of this sync.
        role: ``"sender"`` or ``"receiver"``.
        backend: the backend used.
        num_tensors, num_bytes, num_buckets: what moved (bytes in the travel dtype).
        seconds: wall time of the sync on this end (sender: until every receiver reported done; receiver: from
            the call, its wait for the sender included).
        receiver_versions: sender only: the version each receiver reports holding, by rank 1..N.
        loaded: receiver only: what ``load_fn`` returned.
    """

    version: int
    role: Literal["sender", "receiver"]
    backend: str
    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float
    receiver_versions: tuple[int, ...] = ()
    loaded: object = None

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _resolve_device(backend: str, device: torch.device | str | None) -> torch.device:
    if backend in ("gloo", "inprocess"):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"backend={backend!r} needs CUDA, which this process does not have; use backend='gloo'")
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device={device}; backend={backend!r} needs a CUDA device")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class WeightSender:
    """The trainer's end (rank 0 of the group). One instance per group; ``send`` once per weight update.

    Args:
        config: the channel configuration.
        endpoint: required unless ``backend="inprocess"``; its ``rank`` must be 0. The store is bound here, on
            exactly ``endpoint.host`` (cheap, non-blocking); receivers are awaited at the first ``send``. Without
            ``endpoint.secret`` the sender generates one; ``sender.endpoint`` carries it to the receivers.
        local_receiver: ``backend="inprocess"`` only: ``(receiver, load_fn)`` living in this process.
        device: nccl/cuda_ipc: the GPU of the bucket buffers (default: the current CUDA device).
    """

    def __init__(self, config: WeightSyncConfig, endpoint: SyncEndpoint | None = None, *,
                 local_receiver: tuple[WeightReceiver, LoadFn] | None = None,
                 device: torch.device | str | None = None) -> None:
        self.config = config
        self._version = 0
        self._local = None
        self._side: SenderSide | None = None
        if config.backend == "inprocess":
            if endpoint is not None or local_receiver is None:
                raise ValueError("backend='inprocess' takes local_receiver=(receiver, load_fn) and no endpoint")
            self._local = local_receiver
            self._endpoint = None
            return
        if endpoint is None or local_receiver is not None:
            raise ValueError(f"backend={config.backend!r} needs endpoint=SyncEndpoint(rank=0, ...) and no "
                             f"local_receiver")
        if endpoint.rank != 0:
            raise ValueError(f"endpoint.rank={endpoint.rank}; the sender is rank 0 (use endpoint.for_rank(0))")
        self._side = SenderSide(config, endpoint, _resolve_device(config.backend, device))
        self._endpoint = replace(endpoint, port=self._side.port, secret=self._side.secret)
        logger.info("weight-sync sender of group %r (%s) listening on %s:%d for %d receiver(s)",
                    endpoint.group_name, config.backend, endpoint.host, self._side.port, endpoint.world_size - 1)

    @property
    def endpoint(self) -> SyncEndpoint:
        """This group's endpoint with the real port; give ``endpoint.for_rank(r)`` to receiver ``r``."""
        if self._endpoint is None:
            raise RuntimeError("an in-process sender has no endpoint")
        return self._endpoint

    @property
    def version(self) -> int:
        """The version of the last sync whose manifest was published (failed syncs count: a version is never
        reused)."""
        return self._side.version if self._side is not None else self._version

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
             description: Sequence[tuple[str, Sequence[int], torch.dtype]] | None = None) -> SyncReport:
        """Move one complete set of weights to every receiver; returns when all have loaded them.

        Args:
            named_tensors: ``(name, tensor)`` pairs, consumed lazily and in order, once. Tensors may live on any
                device; floating ones are cast to ``config.dtype`` when it is set.
            description: ``(name, shape, dtype)`` of every tensor the stream will yield, in order, with the dtype
                it travels in — needed for lazy sources (a ZeRO-3 gathering generator), which must not be walked
                twice. Without it, the stream is materialized into a list of references first.
        Raises:
            ManifestMismatchError: a receiver does not accept the manifest (nothing was transferred).
            WeightSyncTimeout / WeightSyncError: a peer vanished, timed out or failed; the message names it.
            ValueError / TypeError: the stream does not match its description (receivers are aborted).
        """
        if self._side is None and self._local is None:
            raise RuntimeError("send() after close(); create a new WeightSender")
        started = time.perf_counter()
        named_tensors, specs = self._describe(named_tensors, description)
        iterator = iter(named_tensors)
        if self._local is not None:
            receiver, load_fn = self._local
            buckets, capacity = plan_buckets(specs, self.config.bucket_bytes)
            self._version += 1
            manifest = Manifest(version=self._version, specs=tuple(specs), buckets=buckets, capacity=capacity)
            receiver._load_local(manifest, iterator, load_fn)
            versions: tuple[int, ...] = (receiver.version,)
        else:
            manifest, versions = self._side.send(specs, iterator)
        return SyncReport(version=manifest.version, role="sender", backend=self.config.backend,
                          num_tensors=len(manifest.specs), num_bytes=manifest.total_bytes,
                          num_buckets=len(manifest.buckets), seconds=time.perf_counter() - started,
                          receiver_versions=versions)

    def _describe(self, named_tensors, description) -> tuple[Iterable[tuple[str, torch.Tensor]], list[TensorSpec]]:
        if description is None:
            if isinstance(named_tensors, dict):
                named_tensors = named_tensors.items()
            named_tensors = list(named_tensors)
            return named_tensors, describe_parameters(named_tensors, dtype=self.config.dtype)
        specs = [to_spec(tuple(item)) for item in description]
        if self.config.dtype is not None:
            specs = [s._replace(dtype=self.config.dtype) if s.dtype.is_floating_point else s for s in specs]
        return named_tensors, specs

    def close(self) -> None:
        """Release the bucket buffers, the process group and the store (receivers then fail their next wait)."""
        if self._side is not None:
            self._version = self._side.version
            self._side.close()
            self._side = None
        self._local = None

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class WeightReceiver:
    """An engine's end (rank ≥ 1 of the group, or the local half of an in-process pair).

    Args:
        config: the channel configuration (same ``backend`` as the sender's).
        endpoint: required unless ``backend="inprocess"``: ``sender.endpoint.for_rank(r, label)``. The control
            store and process group are joined at the first ``receive``.
        expected: ``(name, shape, dtype)`` of the tensors this receiver accepts (e.g.
            ``describe_parameters(model.named_parameters())``); the sender's manifest must match it exactly.
            None accepts any manifest.
        device: nccl only: the GPU of the receive buffer (default: the current CUDA device).
    """

    def __init__(self, config: WeightSyncConfig, endpoint: SyncEndpoint | None = None, *,
                 expected: Sequence[tuple[str, Sequence[int], torch.dtype]] | None = None,
                 device: torch.device | str | None = None) -> None:
        self.config = config
        self.expected = None if expected is None else [to_spec(tuple(e), where="expected") for e in expected]
        self._version = 0
        self._side: ReceiverSide | None = None
        if config.backend == "inprocess":
            if endpoint is not None:
                raise ValueError("backend='inprocess' takes no endpoint; give (receiver, load_fn) to the sender")
            return
        if endpoint is None or endpoint.rank == 0:
            raise ValueError(f"backend={config.backend!r} needs endpoint=sender.endpoint.for_rank(r) with r >= 1, "
                             f"got {endpoint!r}")
        if endpoint.port == 0:
            raise ValueError("endpoint.port=0; use the sender's endpoint (sender.endpoint.for_rank(r)), which "
                             "carries the port it bound")
        if endpoint.secret is None:
            raise ValueError("endpoint.secret is None; use the sender's endpoint (sender.endpoint.for_rank(r)), "
                             "which carries the group's secret (its control store accepts nothing unsigned)")
        device = _resolve_device(config.backend, device) if config.backend == "nccl" else torch.device("cpu")
        self._side = ReceiverSide(config, endpoint, device, {"pid": os.getpid(), "host": socket.gethostname()})

    @property
    def version(self) -> int:
        """The weight version this receiver holds (0 before the first successful sync)."""
        return self._version

    def receive(self, load_fn: LoadFn, *,
                expected: Sequence[tuple[str, Sequence[int], torch.dtype]] | None = None,
                by_bucket: bool = False) -> SyncReport:
        """Take part in the next sync: check its manifest, then call ``load_fn`` once with a lazy iterator of
        ``(name, tensor)`` over all its tensors (and ``version=`` when ``load_fn`` accepts that keyword).

        Yielded tensors are views into a bucket buffer, valid until the iterator moves past their bucket: ``load_fn``
        must copy them (on the current CUDA stream for GPU backends) and consume the iterator to the end.
        ``expected`` overrides the constructor's for this sync. ``by_bucket=True``: one ``list[(name, view)]`` per
        bucket instead, valid until the next is requested (for one batched copy per bucket).
        """
        if self._side is None:
            raise RuntimeError("an in-process receiver is driven by its sender's send(), not by receive()")
        specs = self.expected if expected is None else [to_spec(tuple(e), where="expected") for e in expected]
        started = time.perf_counter()
        manifest, loaded = self._side.receive(load_fn, specs, self._version, by_bucket=by_bucket)
        self._version = manifest.version
        return SyncReport(version=manifest.version, role="receiver", backend=self.config.backend,
                          num_tensors=len(manifest.specs), num_bytes=manifest.total_bytes,
                          num_buckets=len(manifest.buckets), seconds=time.perf_counter() - started, loaded=loaded)

    def _load_local(self, manifest: Manifest, iterator, load_fn: LoadFn) -> object:
        from rlhfkit.weight_sync._peers import load_local

        if manifest.version <= self._version:
            raise WeightSyncVersionError(f"the in-process receiver holds weight version {self._version} and was "
                                         f"offered version {manifest.version}; versions must strictly increase")
        loaded = load_local(manifest, self.expected, iterator, load_fn)
        self._version = manifest.version
        return loaded

    def close(self) -> None:
        """Drop the mapped/allocated bucket buffers and leave the group."""
        if self._side is not None:
            self._side.close()
            self._side = None

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

