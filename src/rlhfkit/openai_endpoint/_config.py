"""The settings of :class:`~rlhfkit.openai_endpoint.OpenAIEndpoint`: :class:`OpenAIEndpointConfig`, validated when
made (address, bearer key, allowed host names, limits, timeouts, batching)."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field

__all__ = ["OpenAIEndpointConfig"]


@dataclass(frozen=True, kw_only=True)
class OpenAIEndpointConfig:
    """How an :class:`OpenAIEndpoint` serves.

    Attributes:
        model_name: the id ``GET /v1/models`` lists; a request naming another model gets a 404.
        host: the IP address the server binds, exactly (``"0.0.0.0"``/``"::"``: every interface). Beyond loopback
            every request needs the bearer key (``api_key``, generated when not given).
        port: port on ``host``; 0 picks a free ephemeral port (read it from :attr:`OpenAIEndpoint.url`).
        api_key: when set, every request must send ``Authorization: Bearer <api_key>`` (401 otherwise). None: no key
            on a loopback ``host``; beyond loopback, a random key the endpoint makes (:attr:`OpenAIEndpoint.api_key`).
            Visible ASCII, no spaces; never shown in the config's repr or in logs.
        allowed_hosts: more names a request's ``Host`` (and ``Origin``) may give for this server, e.g. its DNS
            name when ``host`` is beyond loopback. Always accepted: ``host`` itself; ``localhost`` for a loopback or
            wildcard ``host``; any IP address for a wildcard ``host``.
        default_max_tokens: ``max_tokens`` of a request that gives none.
        max_tokens_limit: the largest ``max_tokens`` accepted.
        max_n: the largest ``n`` accepted.
        max_model_len: when set, a request whose prompt tokens plus ``max_tokens`` exceed it gets a 400
            (``context_length_exceeded``) before it reaches the engine.
        request_timeout_s: longest wait for the engine's answer to one request, queueing for a batch included (504
            after it).
        read_timeout_s: socket timeout while reading a request.
        shutdown_timeout_s: how long :meth:`OpenAIEndpoint.close` waits for requests in flight.
        max_request_bytes: the largest request body accepted (413 beyond).
        session_header: the header that names a request's session (before the body's ``user`` field).
        default_session_id: the session of a request that names none.
        batch_window_s: the quiet gap: waiting requests with the same sampling parameters are sent as one engine
            call once no other such request has arrived for this long (0: as soon as the engine is free; while it is
            busy, requests keep collecting anyway). See "Batching" in :class:`OpenAIEndpoint`.
        max_batch_wait_s: the longest a request waits for others before its call is sent (never less than
            ``batch_window_s``).
        max_batch_prompts: most requests (prompts) in one engine call; a full batch is sent without waiting.
    """

    model_name: str = "rlhfkit"
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = field(default=None, repr=False)
    allowed_hosts: tuple[str, ...] = ()
    default_max_tokens: int = 256
    max_tokens_limit: int = 4096
    max_n: int = 64
    max_model_len: int | None = None
    request_timeout_s: float = 300.0
    read_timeout_s: float = 30.0
    shutdown_timeout_s: float = 10.0
    max_request_bytes: int = 8 * 1024 * 1024
    session_header: str = "X-Session-Id"
    default_session_id: str = "default"
    batch_window_s: float = 0.01
    max_batch_wait_s: float = 0.25
    max_batch_prompts: int = 256

    def __post_init__(self) -> None:
        for name in ("model_name", "session_header", "default_session_id"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"OpenAIEndpointConfig.{name}={getattr(self, name)!r}; must be a non-empty string")
        self._check_network()
        port = self.port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"OpenAIEndpointConfig.port={port!r}; must be an int in [0, 65535] (0: ephemeral)")
        for name in ("default_max_tokens", "max_tokens_limit", "max_n", "max_request_bytes", "max_batch_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"OpenAIEndpointConfig.{name}={value!r}; must be an int >= 1")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"OpenAIEndpointConfig.default_max_tokens={self.default_max_tokens} exceeds "
                             f"max_tokens_limit={self.max_tokens_limit}; lower it or raise the limit")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"OpenAIEndpointConfig.max_model_len={self.max_model_len!r}; must be an int >= 2 or None")
        for name in ("request_timeout_s", "read_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"OpenAIEndpointConfig.{name}={value!r}; must be a finite number of seconds > 0")
        window = self.batch_window_s
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 <= window < math.inf:
            raise ValueError(f"OpenAIEndpointConfig.batch_window_s={window!r}; must be a finite number of seconds "
                             ">= 0 (0: send each batch as soon as the engine is free)")
        wait = self.max_batch_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < math.inf:
            raise ValueError(f"OpenAIEndpointConfig.max_batch_wait_s={wait!r}; must be a finite number of seconds "
                             ">= 0 (a batch waits at least batch_window_s anyway)")

    def _check_network(self) -> None:
        try:
            ipaddress.ip_address(self.host if isinstance(self.host, str) else "")
        except ValueError:
            raise ValueError(f"OpenAIEndpointConfig.host={self.host!r}; must be an IP address literal "
                             "('127.0.0.1', '::1', this machine's address, or '0.0.0.0' for every interface): the "
                             "server binds exactly this address") from None
        key = self.api_key
        if key is not None and (not isinstance(key, str) or not key
                                or not all(33 <= ord(character) <= 126 for character in key)):
            # the value itself is a secret: name its type and length, never the value
            raise ValueError(f"OpenAIEndpointConfig.api_key (a {type(key).__name__} of length "
                             f"{len(key) if isinstance(key, str) else '?'}, not shown) must be a non-empty string of "
                             "visible ASCII characters without spaces, or None")
        names = self.allowed_hosts
        if not isinstance(names, tuple) or not all(isinstance(name, str) and name and name.isascii()
                                                   and not any(c in name for c in " /:[]@") for name in names):
            raise ValueError(f"OpenAIEndpointConfig.allowed_hosts={names!r:.200}; must be a tuple of host names "
                             "(e.g. ('trainer-0.cluster',)), without ports or schemes")
