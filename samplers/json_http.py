"""The HTTP side shared by the OpenAI-compatible servers of a run: the judge's chat server (samplers/chat_server.py)
and the agents' gateway (gateway/server.py). Stdlib only: a threaded server whose request threads route JSON bodies.

    class Handler(JsonHandler):
        routes = {("GET", "/health"): lambda handler, body: (200, {"status": "ok"}, {})}

    JsonServer(("127.0.0.1", 0), Handler).serve_forever()

A route returns (status, payload, headers); an ``ApiError`` it raises becomes the OpenAI error body with its status,
anything else a 500 whose traceback goes to the log, never to the client.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .chat_api import ApiError, error_body

log = logging.getLogger(__name__)

Route = Callable[["JsonHandler", Any], tuple[int, dict, dict]]


class JsonHandler(BaseHTTPRequestHandler):
    """Routes ``GET`` and ``POST`` requests to ``routes`` {(method, path): route(handler, body)}."""

    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connections
    routes: dict[tuple[str, str], Route] = {}
    name = "this server"  # how a 404 names the server

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def warn(self, status: int) -> bool:
        """Whether an ApiError of ``status`` is logged as a warning (server-side failures)."""
        return status >= 500

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        headers: dict[str, str] = {}
        try:
            body = self._body() if method == "POST" else None
            route = self.routes.get((method, path))
            if route is None:
                known = sorted(p for m, p in self.routes if m == method)
                raise ApiError(404, f"no route {method} {path} ({self.name} has {', '.join(known)})", "NotFoundError")
            status, payload, headers = route(self, body)
        except ApiError as e:
            status, payload = e.status, error_body(e)
            if self.warn(e.status):
                log.warning("%s %s: %d %s", method, path, e.status, e.message)
        except Exception as e:  # never a traceback to the client: the log has it
            log.exception("%s %s failed", method, path)
            status, payload = 500, error_body(ApiError(500, f"{type(e).__name__}: {e}", "InternalServerError"))
        self._send(status, payload, headers)

    def bearer(self) -> str | None:
        """The request's ``Authorization: Bearer`` token."""
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        return token.strip() or None if scheme.lower() == "bearer" else None

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        try:
            return json.loads(raw) if raw else None
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    def _send(self, status: int, payload: dict, headers: dict[str, str]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status, HTTPStatus(status).phrase)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        try:
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on this call: fine
            self.close_connection = True

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        log.debug("%s %s", self.address_string(), format % args)


class JsonServer(ThreadingHTTPServer):
    daemon_threads = True  # a request thread never holds the process up at exit
    # the listen backlog: socketserver's 5 resets the connections of a burst of calls that arrive together
    request_queue_size = 1024

    def handle_error(self, request, client_address) -> None:
        """A client that closed its connection (a cancelled call, a keep-alive socket dropped) is no error: one debug
        line, not socketserver's traceback on stderr; anything else is logged with its traceback."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("%s closed the connection", client_address)
            return
        log.exception("a request from %s failed", client_address)
