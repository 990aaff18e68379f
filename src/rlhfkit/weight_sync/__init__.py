"""The weight-sync channel: trainer → rollout engines as a stream of ``(name, tensor)``.

What it does: :class:`WeightSender` takes any iterable of named tensors (a model's ``named_parameters()``, or a ZeRO-3
generator that gathers a bucket at a time), packs it into reusable flat bucket buffers and moves them to every
:class:`WeightReceiver`, which hands one lazy iterator over the whole sync to a ``load_fn`` — e.g.
``HFEngine.load_weights`` or a vLLM worker's loader. Before the first byte moves, a :class:`Manifest` (names, shapes,
dtypes, total bytes, bucket layout, version) is checked by every receiver against the tensors it accepts; a mismatch
fails on both ends with a message naming the tensor. Each sync increments the weight version, and receivers report
the version they hold. Optional per-bucket fingerprints are verified by receivers; every wait has a timeout whose
error names the peer.

Backends (``WeightSyncConfig.backend``):
    ``"inprocess"``: trainer and engine in one process; tensors are handed over directly (no bucket copies).
    ``"gloo"``: CPU process group of the channel's own (tests, CPU users).
    ``"nccl"``: GPU process group of its own; one sender broadcasting to N receivers (each tensor-parallel worker
        of an engine receives every full tensor).
    ``"cuda_ipc"``: receivers on the sender's GPU map its bucket buffers once and copy out of them; with
        ``ipc_zero_copy`` they map the source tensors' own allocations instead (one copy per sync; pays for sources
        in a few allocations: ZeRO-1/2 flat buffers, :func:`flatten_parameters`).

The sender (rank 0) owns a ``torch.distributed.TCPStore`` that carries every control message, so the channel works
between plain processes, Ray actors and vLLM workers alike, and never touches the default process group. It listens
on exactly ``SyncEndpoint.host``; every key on it is hashed and every value signed with the group's per-run secret
(``SyncEndpoint.secret``), and nothing read from it is unpickled (CUDA IPC handles travel as JSON). What the
trainer side and the engine side share is only this module and :class:`SyncEndpoint`, a small picklable dataclass.

Memory: the sender holds ``num_buffers`` bucket buffers of ``max(bucket_bytes, largest tensor) + 16`` bytes (on CPU
for gloo, on its GPU for nccl/cuda_ipc); a gloo/nccl receiver holds one; a cuda_ipc receiver none (it reads the
sender's); zero-copy CUDA IPC none on either side (the sender keeps the last ``num_buffers`` buckets' source
tensors alive until they are consumed); fingerprints add ≈ 2 MB of temporaries. What it does not do: shard tensors for
tensor parallelism (the engine's loader does), gather ZeRO-3 parameters (the DeepSpeed wrapper's stream does), retry
failed syncs. Needs only torch (``torch.distributed``; CUDA for nccl/cuda_ipc).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from rlhfkit._store import check_secret
from rlhfkit.weight_sync._buckets import Fingerprinter
from rlhfkit.weight_sync._errors import (
    ArmedSyncStillReceiving,
    FingerprintMismatchError,
    ManifestMismatchError,
    WeightSyncAborted,
    WeightSyncAuthenticationError,
    WeightSyncError,
    WeightSyncRejoinError,
    WeightSyncTimeout,
    WeightSyncVersionError,
)
from rlhfkit.weight_sync._manifest import Manifest, TensorSpec, describe_parameters, plan_buckets, to_spec
from rlhfkit.weight_sync._peers import ReceiverSide, SenderSide

__all__ = [
    "WeightSyncConfig",
    "SyncEndpoint",
    "SyncReport",
    "WeightSender",
    "WeightReceiver",
    "ArmedReceive",
    "Manifest",
    "describe_parameters",
    "flatten_parameters",
    "WeightSyncError",
    "WeightSyncTimeout",
    "ManifestMismatchError",
    "FingerprintMismatchError",
    "WeightSyncAborted",
    "WeightSyncRejoinError",
    "WeightSyncVersionError",
    "ArmedSyncStillReceiving",
    "WeightSyncAuthenticationError",
]

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
        fingerprints: put a fingerprint of each bucket in its tail and have receivers verify it. Off by default
            (it reads every byte once more on both ends); turn it on to verify a new setup or to debug.
        dtype: cast floating-point tensors to this dtype before sending (e.g. ``torch.bfloat16``); None keeps each.
        ipc_events: cuda_ipc only: order the two processes' GPU work with interprocess CUDA events (no host
            blocking); False synchronizes each side's stream before it signals.
        ipc_zero_copy: cuda_ipc only: receivers read the source tensors' own memory instead of a bucket copy — one
            device copy per sync instead of two, and no bucket buffer. Every tensor must be a CUDA tensor on the
            sender's GPU (a cast to ``dtype`` makes a temporary, held until its bucket is consumed). It pays when the
            tensors live in a few large allocations: ZeRO-1/2 (DeepSpeed's flat parameter buffers) or a model passed
            through :func:`flatten_parameters`; each distinct allocation costs one handle per sync on the receiver.
            The sender holds references to the tensors of the last ``num_buffers`` buckets until receivers consumed
            them, and none after ``send`` returns. ``bucket_bytes`` then bounds only what those references keep
            alive (the cast temporaries, or a gathering source's tensors): for tensors that stay put anyway, a
            ``bucket_bytes`` as large as the model makes a sync one message instead of one round trip per bucket.
        ipc_keep_mapped: with ``ipc_zero_copy``: receivers keep the source's allocations mapped between syncs instead
            of mapping them again at every sync (one ``cudaIpcOpenMemHandle`` per allocation). For sources whose memory stays put between
            syncs (a trainer that does not offload): memory the source frees while a receiver maps it stays
            allocated (torch's CUDA IPC limbo) until the receivers' next sync, where the sender lists what is still
            alive and receivers unmap the rest.
    """

    backend: Backend = "gloo"
    bucket_bytes: int = 512 * 1024**2
    num_buffers: int = 1
    timeout_s: float = 300.0
    fingerprints: bool = False
    dtype: torch.dtype | None = None
    ipc_events: bool = True
    ipc_zero_copy: bool = False
    ipc_keep_mapped: bool = False

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
        if self.ipc_keep_mapped and not self.ipc_zero_copy:
            raise ValueError("WeightSyncConfig.ipc_keep_mapped=True needs ipc_zero_copy=True (bucket buffers are "
                             "mapped once anyway)")
        if self.ipc_zero_copy and self.backend != "cuda_ipc":
            raise ValueError(f"WeightSyncConfig.ipc_zero_copy=True needs backend='cuda_ipc', not {self.backend!r}; "
                             f"leave it False for other backends")


@dataclass(frozen=True, kw_only=True)
class SyncEndpoint:
    """Where a sync group meets, and this process's place in it. Picklable: pass it to Ray actors (or any channel
    you trust: it carries the group's secret).

    Attributes:
        host: the address the sender's control store listens on — exactly that address, no other — and receivers
            connect to. The default loopback suits receivers on the sender's node (colocated engines); give the
            node's address only when receivers on other nodes must reach it. With gloo the sender's pair sockets
            listen there too, and each receiver's on its own address towards it. See docs/security.md.
        port: the store's port; 0 on the sender means "pick a free one" (read it back from ``sender.endpoint``).
        world_size: 1 sender + the number of receivers (for nccl: every engine worker that loads weights).
        rank: 0 for the sender, 1..world_size-1 for receivers.
        group_name: names the group in messages and keys.
        label: who this process is, quoted in the peers' error messages (e.g. ``"engine-0/tp-1"``).
        secret: the group's per-run secret (bytes, at least 16): every key on the control store is hashed and every
            value signed with it, so a process without it can neither read the group's messages by name nor write
            one a peer accepts. A sender without one generates ``secrets.token_bytes(32)``; receivers take it from
            ``sender.endpoint.for_rank(r)``. Never shown in repr or messages.
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
        seconds: wall time of the sync on this end (sender: until every receiver reported done).
        receiver_versions: sender only: the version each receiver reports holding, by rank 1..N.
        loaded: receiver only: what ``load_fn`` returned.
        phases: where this end's time went, ``(name, seconds)`` in order. Sender: ``prepare`` (manifest, bucket 0),
            ``publish``, ``check`` (the receivers' verdicts and the go-ahead), ``stream`` (buckets sent),
            ``wait_done`` (until every receiver reported). Receiver, from its manifest on: ``check``, ``load``
            (inside ``load_fn``), ``wait_buckets`` (bucket messages and checks), ``finish`` (device sync, report).
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
    phases: tuple[tuple[str, float], ...] = ()

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def flatten_parameters(module: torch.nn.Module, *, align_bytes: int = 256) -> list[torch.Tensor]:
    """Re-home ``module``'s parameters as views of one contiguous buffer per (device, dtype), in place.

    What DeepSpeed ZeRO-1/2 does to a module, for a plain one: with ``WeightSyncConfig(backend="cuda_ipc",
    ipc_zero_copy=True)`` a sync then shares one allocation per buffer instead of one per parameter. The
    :class:`torch.nn.Parameter` objects stay the same (only their ``.data`` moves, values copied bit for bit), so
    optimizers, hooks and tied weights are unaffected; call it before creating fused/foreach optimizer state anyway,
    so that state is laid out after the move. Each parameter starts at a multiple of ``align_bytes``. Gradients are not
    flattened. Returns the flat buffers (the parameters' memory; do not resize them).
    """
    if not isinstance(align_bytes, int) or align_bytes < 1:
        raise ValueError(f"align_bytes={align_bytes!r}; use a positive int (256 matches CUDA allocations)")
    groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
    for param in module.parameters():  # each shared (tied) parameter once
        groups.setdefault((param.device, param.dtype), []).append(param)
    buffers = []
    for (device, dtype), params in groups.items():
        step = max(1, align_bytes // dtype.itemsize)
        offsets, total = [], 0
        for param in params:
            offsets.append(total)
            total += -(-param.numel() // step) * step
        flat = torch.zeros(total, dtype=dtype, device=device)
        with torch.no_grad():
            for param, offset in zip(params, offsets, strict=True):
                view = flat[offset : offset + param.numel()].view(param.shape)
                view.copy_(param.data)
                param.data = view
        buffers.append(flat)
    return buffers


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
        self._fingerprinter = Fingerprinter()
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
        self._side = SenderSide(config, endpoint, _resolve_device(config.backend, device), self._fingerprinter)
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
            FingerprintMismatchError: a receiver found a corrupted bucket.
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
            manifest = Manifest(version=self._version, specs=tuple(specs), buckets=buckets, capacity=capacity,
                                fingerprints=self.config.fingerprints)
            receiver._load_local(manifest, iterator, load_fn, self._fingerprinter)
            versions: tuple[int, ...] = (receiver.version,)
        else:
            # described here from the tensors themselves: the stream needs no second check against its specs
            manifest, versions = self._side.send(specs, iterator, trusted=description is None)
        return SyncReport(version=manifest.version, role="sender", backend=self.config.backend,
                          num_tensors=len(manifest.specs), num_bytes=manifest.total_bytes,
                          num_buckets=len(manifest.buckets), seconds=time.perf_counter() - started,
                          receiver_versions=versions, phases=self._side.phases if self._side is not None else ())

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
        self._side = ReceiverSide(config, endpoint, device, self._hello())

    @staticmethod
    def _hello() -> dict[str, object]:
        return {"pid": os.getpid(), "host": socket.gethostname()}

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
        must copy them (``param.copy_(tensor)``), on the current CUDA stream for GPU backends, and consume the
        iterator to the end. ``expected`` overrides the constructor's for this sync.

        ``by_bucket=True``: the iterator yields one ``list[(name, view)]`` per bucket instead, valid until the next
        list is requested — so ``load_fn`` can load a whole bucket with one batched copy, e.g.
        ``torch._foreach_copy_([params[n] for n, _ in bucket], [v for _, v in bucket])``.
        """
        if self._side is None:
            raise RuntimeError("an in-process receiver is driven by its sender's send(), not by receive()")
        specs = self.expected if expected is None else [to_spec(tuple(e), where="expected") for e in expected]
        manifest, loaded, seconds = self._side.receive(load_fn, specs, self._version, by_bucket=by_bucket)
        self._version = manifest.version
        return SyncReport(version=manifest.version, role="receiver", backend=self.config.backend,
                          num_tensors=len(manifest.specs), num_bytes=manifest.total_bytes,
                          num_buckets=len(manifest.buckets), seconds=seconds, loaded=loaded,
                          phases=self._side.phases)

    def wait_for_sync(self, timeout_s: float | None = None) -> bool:
        """Block until the sender starts the next sync — True; :meth:`receive` then takes it without waiting — or
        until :meth:`call_off`, from another thread, ends the wait — False. For receivers armed ahead of the sender
        (a thread in the engine, e.g. ``VLLMEngine.arm_weight_sync``). Raises :class:`WeightSyncTimeout` after
        ``timeout_s`` (default ``config.timeout_s``)."""
        if self._side is None:
            if self.config.backend != "inprocess":
                raise RuntimeError("wait_for_sync() after close(); create a new WeightReceiver")
            raise RuntimeError("an in-process receiver is driven by its sender's send(); it has nothing to wait for")
        if timeout_s is None:
            timeout_s = self.config.timeout_s
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}; must be a number of seconds > 0")
        return self._side.wait_for_sync(float(timeout_s))

    def call_off(self) -> bool:
        """Thread-safe: the next sync will not be received here unless it has already started. True when it is
        called off: a :meth:`wait_for_sync` in progress returns False (a later one returns False once), and the
        sender's ``send`` of that sync fails at once with :class:`WeightSyncAborted` naming this receiver (a version
        is never reused: the next send works). False when the sender started it first: receive it as usual."""
        if self._side is None:
            if self.config.backend != "inprocess":
                raise RuntimeError("call_off() after close(); create a new WeightReceiver")
            raise RuntimeError("an in-process receiver is driven by its sender's send(); it has nothing to call off")
        return self._side.call_off()

    def _load_local(self, manifest: Manifest, iterator, load_fn: LoadFn, fingerprinter: Fingerprinter) -> object:
        from rlhfkit.weight_sync._peers import load_local

        if manifest.version <= self._version:
            raise WeightSyncVersionError(f"the in-process receiver holds weight version {self._version} and was "
                                         f"offered version {manifest.version}; versions must strictly increase")
        loaded = load_local(manifest, self.expected, iterator, load_fn, fingerprinter)
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


class ArmedReceive:
    """One sync received ahead of time: a background thread waits until the sender starts it (re-waiting after each
    ``wait_for_sync`` timeout, so a long training phase is fine, up to ``wait_s`` in all), then runs ``receive()`` —
    e.g. an engine's own receive-and-load. The sender's ``send`` is then the whole sync: nothing has to reach the
    engine first.

    :meth:`settle` ends it: a sync the sender has started is waited for (its result returned, its error raised); one
    it has not is called off (``WeightReceiver.call_off``; the sender's ``send`` of it then fails at once, naming
    the receiver) and None is returned. Nothing may touch what ``receive`` writes until ``settle`` has returned.
    When no sync starts within ``wait_s``, the thread calls the sync off itself and :meth:`settle` raises
    :class:`WeightSyncTimeout`.

    Args:
        receiver: a :class:`WeightReceiver` (anything with ``wait_for_sync()`` and ``call_off()``).
        receive: called in the thread once the sync has started; its return value is :meth:`settle`'s.
        device: a CUDA device to make current in the thread (a new thread starts on device 0).
        wait_s: the longest wait for the sender to start the sync (a training phase is usually far shorter).
    """

    def __init__(self, receiver: Any, receive: Callable[[], Any], *, device: torch.device | str | None = None,
                 name: str = "rlhfkit-armed-receive", wait_s: float = 3600.0) -> None:
        if not (callable(getattr(receiver, "wait_for_sync", None)) and callable(getattr(receiver, "call_off", None))):
            raise TypeError(f"the weight receiver {type(receiver).__name__} has no wait_for_sync()/call_off(), which "
                            "an armed receive needs")
        _check_seconds("wait_s", wait_s)
        self.receiver, self._receive, self.wait_s = receiver, receive, float(wait_s)
        self._device = torch.device(device) if device is not None else None
        self.started = False  # the sender started the sync (set before receive() runs)
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _await_start(self) -> bool:
        """Wait (in bounded steps) until the sender starts the sync: True; called off: False. Past ``wait_s`` the sync
        is called off here and WeightSyncTimeout raised, unless the sender got there first."""
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            try:
                return bool(self.receiver.wait_for_sync(max(0.001, min(deadline - time.monotonic(),
                                                                       _wait_step(self.receiver)))))
            except WeightSyncTimeout:
                continue
        if not self.receiver.call_off():
            return True  # the sender started it just now: receive it
        raise WeightSyncTimeout(f"an armed weight sync waited {self.wait_s:g} s (wait_s) and the sender did not start "
                                "it; it was called off. Is the trainer alive and sending? Arm again before the next "
                                "sync, or pass a larger wait_s")

    def _run(self) -> None:
        try:
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            if not self._await_start():
                return  # called off
            self.started = True
            self._result = self._receive()
        except BaseException as error:  # handed to settle()
            self._error = error

    @property
    def running(self) -> bool:
        """Whether the thread is still waiting or receiving."""
        return self._thread.is_alive()

    def settle(self, timeout_s: float = 600.0) -> Any:
        """Call the sync off if it has not started, else wait for it (up to ``timeout_s``); return ``receive()``'s
        result (None if called off) or raise its error. Raises :class:`ArmedSyncStillReceiving` (a
        :class:`WeightSyncTimeout`), leaving the thread running, when it is still receiving after ``timeout_s``."""
        _check_seconds("timeout_s", timeout_s)
        if not self.started:
            self.receiver.call_off()  # False when the sender got there first: then wait for that sync below
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise ArmedSyncStillReceiving(f"an armed weight sync is still receiving after {timeout_s:g}s; the sender "
                                          "may be stuck (the channel's timeout will end it)")
        if self._error is not None:
            raise self._error
        return self._result


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r}; must be a number of seconds > 0")


def _wait_step(receiver: Any) -> float:
    """One ``wait_for_sync`` step: the receiver's own channel timeout when it has one."""
    config = getattr(receiver, "config", None)
    return float(getattr(config, "timeout_s", 300.0))
