"""The HTTP side of the endpoint: a stdlib ``ThreadingHTTPServer`` bound to exactly the address it is given, in a
daemon thread (private; use :mod:`rlhfkit.openai_endpoint`).

Plain ``http.server`` because rlhfkit has no web-framework dependency (no fastapi/uvicorn in its extras) and the
endpoint serves a training job's agent processes, not the internet. Each request's headers pass a
:class:`~rlhfkit.openai_endpoint._guard.RequestGuard` (Host, Origin, bearer key, Content-Type) before its body is
read; the body is read bounded, with a socket timeout, and ``(method, path, headers, body)`` goes to the service,
which returns ``(status, JSON object)``.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlhfkit.openai_endpoint._guard import RequestGuard

__all__ = ["Reply", "start_server"]

logger = logging.getLogger("rlhfkit.openai_endpoint")

Reply = tuple[int, dict[str, Any]]
Service = Callable[[str, str, dict[str, str], bytes], Reply]


def _error(status: int, message: str, type: str = "invalid_request_error") -> Reply:
    return status, {"error": {"message": message, "type": type, "param": None, "code": None}}


class _Server(ThreadingHTTPServer):
    daemon_threads = True          # a hung request never blocks interpreter exit
    allow_reuse_address = False    # an ephemeral port is never shared
    # listen() backlog: socketserver's default of 5 resets connections when an agent loop opens 100+ at once
    request_queue_size = 1024

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the bound address up in DNS (getfqdn) for a CGI variable nobody reads here
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def handle_error(self, request, client_address) -> None:   # default prints a traceback to stderr
        logger.exception("openai endpoint: unhandled error while serving %s", client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _handler_class(service: Service, *, guard: RequestGuard, read_timeout_s: float, max_request_bytes: int) -> type:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"   # keep-alive, as OpenAI clients expect; every reply has a Content-Length
        server_version = "rlhfkit-openai-endpoint"
        timeout = read_timeout_s        # socket timeout: a client that stops sending is dropped

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("openai endpoint: %s - %s", self.address_string(), format % args)

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="rlhfkit-openai-endpoint"')
            if status >= 400:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes | None:
            length = self.headers.get("Content-Length")
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked" or length is None:
                self._reply(*_error(411, "send the JSON body with a Content-Length header (no chunked encoding)"))
                return None
            if not (length.isascii() and length.isdigit()):
                self._reply(*_error(400, f"Content-Length {length!r:.40} is not a number of bytes"))
                return None
            if int(length) > max_request_bytes:
                self._reply(*_error(413, f"Content-Length {length!r:.40} exceeds the limit of {max_request_bytes} "
                                         "bytes (OpenAIEndpointConfig.max_request_bytes)"))
                return None
            try:
                return self.rfile.read(int(length))
            except TimeoutError:
                self._reply(*_error(408, f"the request body did not arrive within {read_timeout_s:g} s"))
                return None

        def _dispatch(self, method: str) -> None:
            values: dict[str, list[str]] = {}
            for key, value in self.headers.items():
                values.setdefault(key.lower(), []).append(value)
            refusal = guard.check(method, values, port=int(self.server.server_address[1]))
            if refusal is not None:   # before the body is read: a refused client cannot make the server wait on it
                self._reply(*_error(refusal.status, refusal.message, type=refusal.type))
                return
            body = b""
            if method == "POST":
                body = self._body()
                if body is None:
                    return
            headers = {key.lower(): value for key, value in self.headers.items()}
            try:
                reply = service(method, self.path, headers, body)
            except Exception as error:   # a defect here: logged with its traceback, the client gets a JSON 500
                logger.exception("openai endpoint: %s %s failed", method, self.path)
                reply = _error(500, f"internal error: {type(error).__name__}: {error}", type="server_error")
            self._reply(*reply)

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def do_DELETE(self) -> None:
            self._dispatch("DELETE")

    return Handler


def start_server(service: Service, *, host: str, port: int, guard: RequestGuard, read_timeout_s: float,
                 max_request_bytes: int) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Bind exactly ``host:port`` (an IP literal; port 0: an ephemeral port) and serve in a daemon thread."""
    handler = _handler_class(service, guard=guard, read_timeout_s=read_timeout_s, max_request_bytes=max_request_bytes)
    server = (_Server6 if ":" in host else _Server)((host, port), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name=f"rlhfkit-openai-endpoint-{server.server_address[1]}", daemon=True)
    thread.start()
    return server, thread
