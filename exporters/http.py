"""The daemon's HTTP endpoint: ``/metrics`` (Prometheus) and ``/api/v1/snapshot``.

:class:`MetricsServer` serves, on its own thread, the Prometheus text format
of an injected registry and the JSON of the current snapshot (what
``fsdp-sentinel top`` polls). It only reads: ``snapshot_fn`` returns an
immutable snapshot the daemon published, so no lock is shared with the thread
that owns the pipeline.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from fsdp_sentinel.snapshot import Snapshot

log = logging.getLogger(__name__)

SNAPSHOT_PATH = "/api/v1/snapshot"


def parse_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ValueError when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """HTTP server on ``(host, port)`` (port 0 picks a free one; see ``.port``)."""

    def __init__(
        self,
        addr: tuple[str, int],
        registry: CollectorRegistry,
        snapshot_fn: Callable[[], Snapshot],
    ) -> None:
        handler = _make_handler(registry, snapshot_fn)
        server_cls = _V6Server if ":" in addr[0] else ThreadingHTTPServer
        self._httpd = server_cls(addr, handler)
        self._httpd.daemon_threads = True
        self.host = addr[0]
        self.port = int(self._httpd.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="fsdp-sentinel-http",
            daemon=True,
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()


def _make_handler(
    registry: CollectorRegistry, snapshot_fn: Callable[[], Snapshot]
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "fsdp-sentinel"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            try:
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                elif path == SNAPSHOT_PATH:
                    body = json.dumps(snapshot_fn().to_json(), allow_nan=False).encode()
                    self._send(200, "application/json", body)
                elif path == "/":
                    links = f'<a href="/metrics">/metrics</a> <a href="{SNAPSHOT_PATH}">{SNAPSHOT_PATH}</a>'
                    self._send(200, "text/html; charset=utf-8", links.encode())
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found\n")
            except Exception:  # a scrape must never take the daemon down
                log.exception("error serving %s", path)
                self._send(500, "text/plain; charset=utf-8", b"internal error\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            log.debug("http: " + format, *args)

    return Handler
