"""The key-value stores rlhfkit opens between processes: bound to one address, every value signed (private).

Two pieces, shared by :mod:`rlhfkit.weight_sync` (the control store) and :mod:`rlhfkit.phase` (``TCPPhaseStore``):

- :func:`listen_store` starts a ``torch.distributed.TCPStore`` server that listens on exactly the address it is given.
  (torch's own server ignores its host argument and listens on every interface; here a socket bound to
  ``(host, port)`` is handed to it instead.)
- :class:`SignedStore` wraps a store so that a process that can reach the port but lacks the run's secret can neither
  find nor forge anything: keys become ``HMAC-SHA256(secret, "k" || key)`` in hex, values become
  ``mac || payload`` with ``mac = HMAC-SHA256(secret, "v" || len(key) || key || payload)``; a read whose mac does not
  verify raises :class:`StoreAuthenticationError` naming the logical key. The empty value stays empty (it means
  "absent or cleared" to ``compare_set``); counters of ``add`` are hashed by key but not signed (the server
  increments them). It subclasses ``torch.distributed.Store``, so process groups (gloo, NCCL) rendezvous through it.

Not encrypted: a host that sees the traffic reads values and hashed key names, but cannot write a value that verifies,
nor move one to another key. Needs only torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

__all__ = ["StoreAuthenticationError", "SignedStore", "listen_store", "new_secret", "check_secret"]

_MAC_BYTES = 32
_BACKLOG = 2048  # the kernel caps it at somaxconn; many engine workers may connect at once


class StoreAuthenticationError(RuntimeError):
    """A value read from a store does not carry the run's signature: written by a process without the secret."""


def new_secret() -> bytes:
    """A per-run secret: 32 random bytes."""
    import secrets

    return secrets.token_bytes(32)


def check_secret(secret: object, *, where: str) -> bytes:
    """``secret`` as bytes (at least 16 of them); ValueError/TypeError naming ``where`` otherwise. Never echoes it."""
    if isinstance(secret, (bytearray, memoryview)):
        secret = bytes(secret)
    if not isinstance(secret, bytes):
        raise TypeError(f"{where} must be bytes (e.g. secrets.token_bytes(32)), not {type(secret).__name__}")
    if len(secret) < 16:
        raise ValueError(f"{where} has {len(secret)} bytes; use at least 16 (secrets.token_bytes(32))")
    return secret


def listen_store(host: str, port: int, timeout_s: float, *, use_libuv: bool = False) -> dist.TCPStore:
    """A TCPStore server listening on exactly ``host`` (IPv4 or IPv6 address, or a name resolving to one) and
    ``port`` (0: a free one, read it from ``.port``). ``use_libuv=False``: the classic server, whose blocking
    ``get`` answers fastest on loopback, but which answers a request that writes or reads an empty value only after
    a delayed ACK (about 0.2 s on Linux); stores that use empty values (the phase store's released claims) take the
    libuv server."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host!r} resolves to no address")
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(_BACKLOG)
        bound = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    # The store's daemon owns the descriptor from here and closes it when the store goes: the Python socket object
    # must not (closing a listening socket under the running daemon aborts the process).
    fd = sock.detach()
    try:
        return dist.TCPStore(host, bound, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                             master_listen_fd=fd, use_libuv=use_libuv)
    except TypeError as error:  # a torch without master_listen_fd: refuse rather than listen on every interface
        os.close(fd)
        raise RuntimeError(f"this torch cannot serve a TCPStore on one address only (no master_listen_fd): "
                           f"{error}; upgrade torch") from error


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SignedStore(dist.Store):
    """``inner`` with hashed keys and signed values (see the module docstring). ``error`` is the
    :class:`StoreAuthenticationError` subclass raised on a value that does not verify."""

    def __init__(self, inner: dist.Store, secret: bytes, *,
                 error: type[StoreAuthenticationError] = StoreAuthenticationError) -> None:
        super().__init__()
        self.inner = inner
        self._secret = check_secret(secret, where="the store's secret")
        self._error = error

    def __getstate__(self) -> None:
        raise TypeError("a SignedStore does not pickle (it would carry its secret); pass the secret through a "
                        "trusted channel and connect again")

    @property
    def port(self) -> int:
        return self.inner.port

    @property
    def host(self) -> str:
        return self.inner.host

    # ------------------------------------------------------------------ keys and values
    def _key(self, key: str) -> str:
        return hmac.new(self._secret, b"k" + key.encode(), hashlib.sha256).hexdigest()

    def _mac(self, key: str, payload: bytes) -> bytes:
        name = key.encode()
        return hmac.new(self._secret, b"v" + len(name).to_bytes(4, "big") + name + payload, hashlib.sha256).digest()

    def _sign(self, key: str, value: str | bytes) -> bytes:
        payload = _as_bytes(value)
        return self._mac(key, payload) + payload if payload else b""

    def _open(self, key: str, raw: bytes) -> bytes:
        if not raw:
            return b""
        mac, payload = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
        if len(raw) <= _MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, payload)):
            raise self._error(f"the value of store key {key!r} is not signed with this run's secret: a process "
                              "without the secret wrote it (another host on the network, or a process of another "
                              "run); it was refused")
        return payload

    # ------------------------------------------------------------------ the Store interface
    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(self._key(key), self._sign(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self.inner.get(self._key(key)))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        desired = self._sign(key, desired_value)
        raw = self.inner.compare_set(self._key(key), self._sign(key, expected_value), desired)
        if raw == desired:  # (the common answer: skip the verification of what we just signed)
            return _as_bytes(desired_value)
        return self._open(key, raw)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self._key(key), amount)

    def check(self, keys: Sequence[str]) -> bool:
        return self.inner.check([self._key(key) for key in keys])

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        hashed = [self._key(key) for key in keys]
        if timeout is None:
            self.inner.wait(hashed)
        else:
            self.inner.wait(hashed, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self.inner.set_timeout(timeout)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        raws = self.inner.multi_get([self._key(key) for key in keys])
        return [self._open(key, raw) for key, raw in zip(keys, raws, strict=True)]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self.inner.multi_set([self._key(key) for key in keys],
                             [self._sign(key, value) for key, value in zip(keys, values, strict=True)])

    def has_extended_api(self) -> bool:
        return False  # no append/queues: callers use set/get/wait/check, each signed

    def clone(self) -> SignedStore:
        return SignedStore(self.inner.clone(), self._secret, error=self._error)
