"""The launcher's observation port (``--metrics-port``): the dashboard page, ``/metrics`` for
Prometheus and the JSON API behind both. Plain HTTP from the standard library; the page and its
script are files of this package (no build step, nothing fetched from elsewhere)."""

from __future__ import annotations

import json
import logging
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Final

from prometheus_client import CONTENT_TYPE_LATEST

from launcher.observe.observer import JobObserver

log = logging.getLogger(__name__)

_STATIC: Final = {
    "/": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


class _ThreadingHTTPServer6(ThreadingHTTPServer):
    """The same server on an IPv6 address (the standard one binds IPv4 only)."""

    address_family = socket.AF_INET6


class DashboardServer:
    """Serves one observer on ``host:port`` (port 0: a free one) from a thread of its own."""

    def __init__(self, observer: JobObserver, host: str, port: int) -> None:
        self.observer = observer
        server = _ThreadingHTTPServer6 if ":" in host else ThreadingHTTPServer
        self._server = server((host, port), _handler(observer))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="dashboard", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> int:
        """Start serving; return the port."""
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Stop serving and join the thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def _handler(observer: JobObserver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(HTTPStatus.OK, CONTENT_TYPE_LATEST, observer.metrics.exposition())
            elif path == "/api/status":
                self._json(observer.status())
            elif path == "/api/events":
                self._json(observer.events())
            elif path in _STATIC:
                name, content_type = _STATIC[path]
                body = resources.files("launcher.observe").joinpath("static", name).read_bytes()
                self._send(HTTPStatus.OK, content_type, body)
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found\n")

        def _json(self, value: object) -> None:
            body = json.dumps(value, separators=(",", ":")).encode()
            self._send(HTTPStatus.OK, "application/json", body)

        def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("dashboard: " + format, *args)

    return Handler
