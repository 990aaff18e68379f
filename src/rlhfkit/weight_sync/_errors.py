"""Errors of the weight-sync channel (private to :mod:`rlhfkit.weight_sync`, which re-exports them). torch-free."""

from __future__ import annotations

__all__ = ["WeightSyncError", "WeightSyncTimeout", "ManifestMismatchError", "WeightSyncAborted",
           "WeightSyncRejoinError", "WeightSyncVersionError", "WeightSyncAuthenticationError",
           "WeightSyncProtocolError", "error_from_report", "error_kind"]


class WeightSyncError(RuntimeError):
    """A sync failed: a peer reported an error, vanished, or the transport broke. The message names the peer."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A wait on a peer (rendezvous, manifest check, bucket, acknowledgement) ran past ``timeout_s``."""


class ManifestMismatchError(WeightSyncError, ValueError):
    """The sender's manifest and what a receiver accepts differ (missing/extra name, shape or dtype); raised on every
    end before the first byte of weights moves, naming the tensor(s)."""


class WeightSyncAborted(WeightSyncError):
    """The other side gave up mid-sync (its error is quoted in the message)."""


class WeightSyncRejoinError(WeightSyncError):
    """A receiver tried to join a group that has already formed (e.g. a restarted engine): open a new group (a new
    sender, new ``group_name``/port) and have every receiver join that one."""


class WeightSyncVersionError(WeightSyncError, ValueError):
    """A sync offered a weight version that is not newer than the one the receiver holds."""


class WeightSyncAuthenticationError(WeightSyncError):
    """A value on the group's control store is not signed with the group's secret: a process without it (another
    host that reached the port, or another run) wrote it. It is refused, never parsed; the message names the key."""


class WeightSyncProtocolError(WeightSyncError, ValueError):
    """A control message does not have the shape the protocol allows (e.g. a CUDA IPC handle naming a class outside
    the allow-list, or anything that is not the expected JSON); refused before anything in it is used."""


_KINDS: dict[str, type[WeightSyncError]] = {
    "error": WeightSyncError,
    "timeout": WeightSyncTimeout,
    "manifest": ManifestMismatchError,
    "aborted": WeightSyncAborted,
    "rejoin": WeightSyncRejoinError,
    "version": WeightSyncVersionError,
}


def error_kind(error: BaseException) -> str:
    """The wire name of ``error``'s class (or of its nearest known base), so the peer can raise the same kind."""
    for kind, cls in reversed(_KINDS.items()):
        if isinstance(error, cls):
            return kind
    return "error"


def error_from_report(kind: str, message: str) -> WeightSyncError:
    """Rebuild an error a peer reported as ``(kind, message)``."""
    return _KINDS.get(kind, WeightSyncError)(message)
