"""The control channel of the weight-sync channel (private to :mod:`rlhfkit.weight_sync`). Needs torch.distributed.

Small messages (hello, manifest, check results, go/abort, per-bucket readiness and acknowledgements for CUDA IPC,
completion reports) travel as keys of a ``torch.distributed.TCPStore`` owned by the sender (rank 0): it works the
same between plain processes, Ray actors and vLLM workers, and never touches the default process group. Every wait
has a deadline; a timeout or a lost connection raises an error that names the peer and what was awaited.

Key layout under the group's prefix: ``hello/{rank}``, ``{version}/manifest`` (a claim, set with compare-and-set:
the sender's token, or a receiver's call-off mark if it came first), ``{version}/start`` (what receivers wait on,
since a compare-and-set wakes no waiter: three lines — ``check``, or ``go`` when the manifest repeats one every
receiver accepted (no check round); bucket 0's CUDA-IPC ready message or nothing; the manifest, or nothing when it
repeats — or a call-off mark), ``{version}/check/{rank}``, ``{version}/go``, ``{version}/b/{bucket}``,
``{version}/ack/{bucket}/{rank}``, ``{version}/done/{rank}``, ``ipc/{generation}`` and
``ipc/{generation}/recv/{rank}``. The previous sync's claim, start and zero-copy bucket messages (which carry
every tensor's placement) are deleted during the next sync, while the sender waits for its receivers; the other keys
are a few dozen bytes each and stay until the sender closes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from rlhfkit.weight_sync._errors import WeightSyncError, WeightSyncTimeout

__all__ = ["ControlChannel", "open_store"]

logger = logging.getLogger(__name__)


def open_store(*, host: str, port: int, is_master: bool, timeout_s: float, peer: str) -> dist.Store:
    """Bind (sender) or connect to (receiver) the group's TCPStore. The libuv server is avoided: on loopback its
    blocking ``get`` answers an order of magnitude more slowly than the classic server's."""
    kwargs: dict[str, Any] = dict(is_master=is_master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    try:
        try:
            return dist.TCPStore(host, port, None, use_libuv=False, **kwargs)
        except TypeError:  # a torch without the use_libuv keyword
            return dist.TCPStore(host, port, None, **kwargs)
    except (RuntimeError, OSError) as error:
        verb = "bind the control store on" if is_master else "connect to the control store of"
        raise WeightSyncError(f"could not {verb} {peer} at {host}:{port} within {timeout_s}s: {error}") from error


class ControlChannel:
    """JSON messages over a store, with deadlines. ``peer_name(rank)`` says who a rank is in error messages."""

    def __init__(self, store: dist.Store, *, timeout_s: float, peer_name: Callable[[int], str]) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.peer_name = peer_name

    def put(self, key: str, message: dict[str, Any]) -> None:
        self.store.set(key, json.dumps(message))

    def put_bytes(self, key: str, data: bytes) -> None:
        self.store.set(key, data)

    def get_bytes(self, key: str, *, peer: int, what: str, deadline: float | None = None) -> bytes:
        """Wait for ``key`` (set by rank ``peer``) until ``deadline`` (``time.monotonic()``; default now+timeout) and
        return its value. (The store's ``get`` waits for its key, up to the store's timeout, then reads it: one
        request fewer than ``wait`` then ``get``. Only a ``set`` wakes a waiter, never a ``compare_set``.)"""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        remaining = deadline - time.monotonic()
        started = time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            self.store.set_timeout(timedelta(seconds=remaining))
            return self.store.get(key)
        except (RuntimeError, OSError, TimeoutError) as error:
            waited = time.monotonic() - started
            if isinstance(error, TimeoutError) or waited >= remaining - 0.05:
                raise WeightSyncTimeout(
                    f"timed out after {self.timeout_s:g}s waiting for {what} from {self.peer_name(peer)}; "
                    f"is it alive and in the same sync? (raise WeightSyncConfig.timeout_s if it is just slow)"
                ) from None
            raise WeightSyncError(
                f"lost the control channel while waiting for {what} from {self.peer_name(peer)}: {error}"
            ) from error

    def get(self, key: str, *, peer: int, what: str, deadline: float | None = None) -> dict[str, Any]:
        return json.loads(self.get_bytes(key, peer=peer, what=what, deadline=deadline))

    def gather(self, key_of: Callable[[int], str], ranks: Iterable[int], *, what: str) -> dict[int, dict[str, Any]]:
        """Wait for one message from each of ``ranks`` under a shared deadline."""
        deadline = time.monotonic() + self.timeout_s
        return {rank: self.get(key_of(rank), peer=rank, what=what, deadline=deadline) for rank in ranks}

    def peek(self, key: str) -> dict[str, Any] | None:
        """The message under ``key`` if it is already there, else None (never waits)."""
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except (RuntimeError, OSError) as error:  # best effort: only used to enrich another error's message
            logger.debug("could not read %s from the control store: %s", key, error)
            return None

    def delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except (RuntimeError, OSError) as error:  # the store is gone: nothing left to clean
            logger.debug("could not delete %s from the control store: %s", key, error)
