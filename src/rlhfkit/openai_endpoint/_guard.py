"""Who may talk to the endpoint: the ``Host``, ``Origin``, ``Authorization`` and ``Content-Type`` checks made on a
request's headers before its body is read (private; use :mod:`rlhfkit.openai_endpoint`).

Why each check: a web page open in a browser on the training host can send a "simple" cross-origin request (a
``text/plain`` POST, which needs no CORS preflight) to a loopback port, so ``Content-Type: application/json`` is
required and a request carrying a foreign ``Origin`` is refused; DNS rebinding (a page whose name resolves to
127.0.0.1 after it loaded) makes the browser send same-origin requests under a foreign ``Host``, so ``Host`` must name
this server; and anything beyond loopback needs a bearer key.
"""

from __future__ import annotations

import hmac
import ipaddress
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RequestGuard", "Refusal", "is_loopback", "url_host"]


def is_loopback(host: str) -> bool:
    """Whether the IP literal ``host`` is a loopback address (127.0.0.0/8, ::1)."""
    return ipaddress.ip_address(host).is_loopback


def url_host(host: str) -> str:
    """``host`` as it appears in a URL or a ``Host`` header (an IPv6 literal in brackets)."""
    return f"[{host}]" if ":" in host else host


def _normal(name: str) -> str:
    """A host name compared case-insensitively without a trailing dot; an IP literal in its canonical form."""
    name = name.strip().lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: HTTP ``status``, an OpenAI-style error ``message`` and ``type``."""

    status: int
    message: str
    type: str = "invalid_request_error"


@dataclass(frozen=True, kw_only=True)
class RequestGuard:
    """The header checks for a server bound to ``bind_host`` (an IP literal).

    ``Host`` (and the host of an ``Origin``) must be the bound address, ``localhost`` when that is a loopback or
    wildcard address, any IP literal when it is a wildcard (``0.0.0.0``, ``::``: the client addressed this machine
    directly, which DNS rebinding cannot do), or one of ``allowed_hosts``; a port, when given, must be the server's.
    ``api_key`` (None: no key asked) must come as ``Authorization: Bearer <api_key>``.
    """

    bind_host: str
    allowed_hosts: Sequence[str] = ()
    api_key: str | None = None

    def _names(self) -> frozenset[str]:
        bound = ipaddress.ip_address(self.bind_host)
        names = {str(bound), *(_normal(name) for name in self.allowed_hosts)}
        if bound.is_loopback or bound.is_unspecified:
            names.add("localhost")
        return frozenset(names)

    def _known(self, name: str) -> bool:
        name = _normal(name)
        return name in self._names() or (ipaddress.ip_address(self.bind_host).is_unspecified and _is_ip(name))

    def _host_refusal(self, values: list[str], port: int) -> Refusal | None:
        if len(values) != 1:
            return Refusal(400, f"send exactly one Host header (got {len(values)})")
        value = values[0].strip()
        if value.startswith("["):
            name, _, rest = value[1:].partition("]")
            given_port = rest[1:] if rest.startswith(":") else (None if not rest else "?")
        else:
            name, colon, given_port = value.partition(":")
            given_port = given_port if colon else None
        if not name or not self._known(name) or (given_port is not None and given_port != str(port)):
            return Refusal(421, f"Host {value!r:.80} does not name this server (port {port}); use the address it "
                           "is bound to (OpenAIEndpoint.url) or add the name to OpenAIEndpointConfig.allowed_hosts")
        return None

    def _origin_refusal(self, values: list[str], port: int) -> Refusal | None:
        if not values:
            return None   # not a browser: nothing cross-origin to refuse
        why = (f"Origin {values[0]!r:.80} is not this server; cross-origin requests (from a web page) are refused"
               if len(values) == 1 else f"send at most one Origin header (got {len(values)})")
        try:
            parts = urllib.parse.urlsplit(values[0].strip()) if len(values) == 1 else None
            origin_port = parts.port if parts is not None else None
        except ValueError:   # a port that is no number
            return Refusal(403, why)
        if (parts is None or parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/")
                or (origin_port or 80) != port or not self._known(parts.hostname)):
            return Refusal(403, why)
        return None

    def _auth_refusal(self, values: list[str]) -> Refusal | None:
        if self.api_key is None:
            return None
        scheme, _, given = values[0].strip().partition(" ") if len(values) == 1 else ("", "", "")
        # compare_digest: the time a comparison takes says nothing about how much of the key matched
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"),
                                                                 self.api_key.encode("ascii")):
            return Refusal(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>' with the "
                           "endpoint's key (OpenAIEndpoint.api_key; an OpenAI client's api_key=...)",
                           type="authentication_error")
        return None

    def check(self, method: str, headers: dict[str, list[str]], *, port: int) -> Refusal | None:
        """The first reason to refuse a request, else None. ``headers``: each lower-cased name's values, in order."""
        refusal = (self._host_refusal(headers.get("host", []), port)
                   or self._origin_refusal(headers.get("origin", []), port)
                   or self._auth_refusal(headers.get("authorization", [])))
        if refusal is not None or method != "POST":
            return refusal
        return _content_type_refusal(headers.get("content-type", []))


def _content_type_refusal(values: list[str]) -> Refusal | None:
    """A POST body must be declared ``application/json`` (UTF-8): a browser sends no such request cross-origin
    without a CORS preflight, which this server never grants."""
    value = values[0] if len(values) == 1 else ""
    media, *parameters = [part.strip().lower() for part in value.split(";")]
    charset = next((p.partition("=")[2].strip('"') for p in parameters if p.partition("=")[0].strip() == "charset"),
                   "utf-8")
    if media != "application/json" or charset not in ("utf-8", "utf8"):
        return Refusal(415, f"Content-Type {value!r:.80} is not supported; send the body as JSON with the header "
                       "'Content-Type: application/json' (UTF-8)")
    return None
