"""A bounded JSON-over-HTTP client of one SGLang server and the errors it raises; private to
:mod:`rlhfkit.engines.sglang`. Standard library only (``urllib``), so the engine actor needs no HTTP package.

Every request has a timeout. What goes wrong is told apart by exception type: the server is gone (connection refused
or closed mid-request: :class:`SGLangServerDied`), it did not answer in time (:class:`SGLangTimeout`), it answered
something that is not the JSON we expect (:class:`SGLangProtocolError`), or it refused the request with an HTTP error
(:class:`SGLangRequestError`, carrying the status and the server's message).
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

__all__ = [
    "SGLangClient",
    "SGLangProtocolError",
    "SGLangRequestError",
    "SGLangServerDied",
    "SGLangServerError",
    "SGLangStartError",
    "SGLangTimeout",
]


class SGLangServerError(RuntimeError):
    """Something went wrong with engine ``engine_index``'s SGLang server."""

    def __init__(self, message: str, *, engine_index: int) -> None:
        super().__init__(message)
        self.engine_index = engine_index


class SGLangServerDied(SGLangServerError):
    """The server process exited, or its connection was refused or closed mid-request."""


class SGLangTimeout(SGLangServerError, TimeoutError):
    """The server did not answer within the request's timeout (hung or overloaded)."""


class SGLangProtocolError(SGLangServerError):
    """The server answered something that is not the JSON this backend expects (a different SGLang version?)."""


class SGLangRequestError(SGLangServerError):
    """The server refused a request (an HTTP error status, or ``success: false``); ``status`` is the HTTP status."""

    def __init__(self, message: str, *, engine_index: int, status: int) -> None:
        super().__init__(message, engine_index=engine_index)
        self.status = status


class SGLangStartError(SGLangServerError):
    """The server did not come up: it exited during start-up or did not answer ``/health`` in time."""


class SGLangClient:
    """POST/GET JSON to one server. ``describe_death`` (optional) returns what is known about the server process
    (e.g. its exit code and log tail), appended to :class:`SGLangServerDied` messages."""

    def __init__(self, url: str, *, engine_index: int, describe_death: Callable[[], str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.engine_index = engine_index
        self._describe_death = describe_death

    def _where(self, path: str) -> str:
        return f"engine {self.engine_index}: SGLang server {self.url}{path}"

    def request(self, path: str, payload: Any = None, *, timeout_s: float, method: str = "POST",
                expect_json: bool = True) -> Any:
        """Send ``payload`` as JSON (GET when ``method="GET"``) and return the decoded JSON answer (the raw text when
        ``expect_json`` is False); raise one of this module's errors otherwise."""
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")[:2000]
            raise SGLangRequestError(f"{self._where(path)} refused the request with HTTP {error.code}: {text}",
                                     engine_index=self.engine_index, status=error.code) from error
        except TimeoutError as error:
            raise SGLangTimeout(f"{self._where(path)} did not answer within {timeout_s:g} s; it is hung or overloaded "
                                "(raise the timeout in SGLangEngineConfig if it is only slow)",
                                engine_index=self.engine_index) from error
        except (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead) as error:
            raise self._died(path, error) from error
        except urllib.error.URLError as error:
            if isinstance(error.reason, (TimeoutError, socket.timeout)):
                raise SGLangTimeout(f"{self._where(path)} did not answer within {timeout_s:g} s",
                                    engine_index=self.engine_index) from error
            raise self._died(path, error) from error
        if not expect_json:
            return body.decode(errors="replace")
        try:
            return json.loads(body) if body.strip() else None
        except ValueError as error:
            raise SGLangProtocolError(f"{self._where(path)} answered with something that is not JSON: "
                                      f"{body[:200]!r}", engine_index=self.engine_index) from error

    def _died(self, path: str, error: BaseException) -> SGLangServerDied:
        known = self._describe_death() if self._describe_death is not None else ""
        return SGLangServerDied(f"{self._where(path)} is gone ({type(error).__name__}: {error})"
                                + (f"; {known}" if known else ""), engine_index=self.engine_index)

    def check_success(self, path: str, answer: Any) -> Any:
        """Weight-update endpoints answer ``{"success": bool, "message": str}``: raise unless it succeeded."""
        if not isinstance(answer, dict) or "success" not in answer:
            raise SGLangProtocolError(f"{self._where(path)} answered {answer!r}; expected {{'success': ..., "
                                      "'message': ...}", engine_index=self.engine_index)
        if not answer["success"]:
            raise SGLangRequestError(f"{self._where(path)} failed: {answer.get('message')}",
                                     engine_index=self.engine_index, status=200)
        return answer
