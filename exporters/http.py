"""The daemon's HTTP endpoint: ``/metrics`` (Prometheus) and ``/api/v1/snapshot``.

``/metrics`` does what prometheus-client's ``make_wsgi_app`` does, with its
helpers: it negotiates the format from ``Accept`` (``choose_encoder``: the
Prometheus text format, or OpenMetrics 1.0 when the scraper asks for it, as
Prometheus does), serves only the families named by ``?name[]=...``
(``restricted_registry``) and gzips when ``Accept-Encoding`` allows
(``gzip_accepted``). Two things differ, neither in what a scraper reads: the
text is written by ``encode.py`` (prometheus-client's output byte for byte,
several times faster), and gzip runs at level :data:`GZIP_LEVEL`, not 9. ``/api/v1/snapshot`` is the JSON of the current snapshot
(what ``fsdp-sentinel top`` polls). Both only read: ``snapshot_fn`` returns an
immutable snapshot the daemon published, so no lock is shared with the thread
that owns the pipeline.

:class:`MetricsServer` binds IPv4 or IPv6 (``[::1]:PORT``; ``[::]:PORT``
takes IPv4 too where the kernel allows dual-stack sockets).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder, gzip_accepted
from prometheus_client.registry import CollectorRegistry

from fsdp_sentinel.exporters.encode import fast_encoder
from fsdp_sentinel.exporters.sanitize import sanitize
from fsdp_sentinel.snapshot import Snapshot

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
SNAPSHOT_PATH = "/api/v1/snapshot"
HEALTH_PATH = "/healthz"

#: What ``--metrics-addr`` defaults to: loopback only (metrics name hosts and
#: ranks), on a port that no exporter in Prometheus's default-port list takes
#: (docs/metrics.md says why this one).
DEFAULT_PORT = 18965
DEFAULT_ADDR = f"127.0.0.1:{DEFAULT_PORT}"

#: gzip level for ``/metrics``. prometheus-client uses 9 (the default): 14 ms
#: for a 64-rank job's 594 KiB, 23 KiB out. Level 1 takes about 1.5 ms for
#: 34 KiB: a scrape body is read once, on loopback or the cluster network,
#: so the daemon's CPU counts more than 11 KiB (BENCHMARKS.md, bench/scrape).
GZIP_LEVEL = 1


def parse_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ValueError when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"write an IPv6 address in brackets, [{host}]:{port}, got {text!r}")
    return host.strip("[]"), int(port)


#: Connections served at once; more are closed at once (counted). A thread
#: each, so 300 clients that never finish a request hold at most this many.
MAX_CONNECTIONS = 16

#: Seconds a connection may take to send its request (and read the reply)
#: before it is dropped: a client that sends half a request holds nothing long.
CONNECTION_TIMEOUT_S = 10.0


class _Server(ThreadingWSGIServer):
    """A thread per connection, at most ``max_connections`` of them."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    # socketserver's default listen backlog is 5: a burst of clients beyond it
    # waits out TCP's 1 s SYN retry (300 at once took 43 s to connect, most of
    # it in retries) before it can even be refused.
    request_queue_size = 128

    def server_activate(self) -> None:
        self.slots = threading.BoundedSemaphore(self.max_connections)
        self.refused = 0  # connections closed because every slot was taken
        self.timed_out = 0  # connections dropped by the per-connection timeout
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out or went away: counted, not a traceback on stderr.
        if isinstance(sys.exc_info()[1], OSError):
            self.timed_out += 1
            return
        log.exception("http: error serving %s", client_address)


class _V6Server(_Server):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        # "::" serves IPv4 too (dual stack) unless the host forbids it.
        if self.server_address[0] == "::":
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class _QuietHandler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S  # StreamRequestHandler: set on the socket

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("http: " + format, *args)


def make_app(
    registry: CollectorRegistry, snapshot_fn: Callable[[], Snapshot]
) -> Callable[..., Iterable[bytes]]:
    """The WSGI app: ``/metrics``, ``/api/v1/snapshot``, an index."""
    metrics = metrics_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        try:
            if path == METRICS_PATH:
                return metrics(environ, start_response)  # type: ignore[no-any-return]
            if path == HEALTH_PATH:
                snap = sanitize(snapshot_fn())
                restarts = dict(snap.thread_restarts_total)
                health = {"status": "ok", "t": snap.t, "thread_restarts": restarts}
                body = json.dumps(health, allow_nan=False).encode()
                return _reply(start_response, "200 OK", "application/json", body)
            if path == SNAPSHOT_PATH:
                # Sanitised like /metrics: inf or a lone surrogate is no 500.
                body = json.dumps(sanitize(snapshot_fn()).to_json(), allow_nan=False).encode()
                return _reply(start_response, "200 OK", "application/json", body)
            if path == "/":
                links = f'<a href="{METRICS_PATH}">{METRICS_PATH}</a> <a href="{SNAPSHOT_PATH}">{SNAPSHOT_PATH}</a>'
                return _reply(start_response, "200 OK", "text/html; charset=utf-8", links.encode())
            return _reply(
                start_response, "404 Not Found", "text/plain; charset=utf-8", b"not found\n"
            )
        except Exception:  # a scrape must never take the daemon down
            log.exception("error serving %s", path)
            return _reply(
                start_response, "500 Internal Server Error", "text/plain; charset=utf-8",
                b"internal error\n",
            )  # fmt: skip

    return app


def metrics_app(
    registry: CollectorRegistry, gzip_level: int = GZIP_LEVEL
) -> Callable[..., Iterable[bytes]]:
    """``prometheus_client.make_wsgi_app(registry)`` with our encoder and gzip
    level: the same status, headers and (uncompressed) body for every request."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        if method == "OPTIONS":
            start_response("200 OK", [("Allow", "OPTIONS,GET")])
            return [b""]
        if method != "GET":
            status = "405 Method Not Allowed"
            start_response(status, [("Allow", "OPTIONS,GET")])
            return [f"# HTTP {status}: {method}; use OPTIONS or GET\n".encode()]
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        params = parse_qs(environ.get("QUERY_STRING", ""))
        target = registry.restricted_registry(params["name[]"]) if "name[]" in params else registry
        output = fast_encoder(encoder)(target)
        headers = [("Content-Type", content_type)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
            output = gzip.compress(output, compresslevel=gzip_level)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [output]

    return app


def _reply(start_response: Callable[..., Any], status: str, ctype: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
    return [body]


class MetricsServer:
    """HTTP server on ``(host, port)`` (port 0 picks a free one; see ``.port``)."""

    def __init__(
        self,
        addr: tuple[str, int],
        registry: CollectorRegistry,
        snapshot_fn: Callable[[], Snapshot],
        *,
        max_connections: int = MAX_CONNECTIONS,
        timeout_s: float = CONNECTION_TIMEOUT_S,
    ) -> None:
        base = _V6Server if ":" in addr[0] else _Server
        server_cls = type("Server", (base,), {"max_connections": max_connections})
        handler = type("Handler", (_QuietHandler,), {"timeout": timeout_s})
        self._httpd: Any = make_server(
            addr[0], addr[1], make_app(registry, snapshot_fn), server_cls, handler
        )
        self.host = addr[0]
        self.port = int(self._httpd.server_address[1])
        self._thread: threading.Thread | None = None
        self.restarts = 0  # times the serving loop died and was started again
        self._closing = False

    @property
    def refused(self) -> int:
        """Connections closed at once because ``max_connections`` were being served."""
        return int(self._httpd.refused)

    @property
    def timed_out(self) -> int:
        """Connections dropped by the per-connection timeout (or a client gone)."""
        return int(self._httpd.timed_out)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self._serve, name="fsdp-sentinel-http", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        # Supervised: a serving loop that dies is logged, counted and started again.
        while not self._closing:
            try:
                self._httpd.serve_forever(poll_interval=0.5)
                return  # shutdown() asked
            except Exception:
                self.restarts += 1
                log.exception("http server loop died; starting it again")

    def close(self) -> None:
        self._closing = True
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()
