"""Free TCP ports for servers and rendezvous that bind them later (placement's MASTER_PORT, SGLang's server)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_listen_port"]


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to ``bind(0)`` and outgoing connections (Linux; 32768-60999 elsewhere)."""
    try:
        low, high = (int(value) for value in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_listen_port(*, host: str = "", attempts: int = 64) -> int:
    """A TCP port that is free now and lies outside the kernel's ephemeral range, so that no outgoing connection or
    ``bind(0)`` of another process takes it before its user binds it (seconds later for a MASTER_PORT or a server
    that is still starting); a random one of 20,000-32,767 (or above the range), else an ephemeral one. ``host``:
    the address it is checked on ("" for all). The pick draws from the OS's entropy, not the ``random`` module's
    state, which a seeded process (or two processes seeded alike) would repeat: two roles probing at once would
    then get the same port and the second one's rendezvous would fail with EADDRINUSE."""
    low, high = _ephemeral_range()
    candidates = [port for port in range(20000, 32768) if not low <= port <= high] or \
                 [port for port in range(high + 1, 65536)]
    for port in random.SystemRandom().sample(candidates, min(attempts, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
