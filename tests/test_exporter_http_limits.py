"""HTTP a client can't hold: 300 half-sent requests hold a bounded pool (no root).

Before, the exporter started a thread per connection and waited for ever
for each request line: 300 clients that sent half a request held 300
threads for good. Now at most ``max_connections`` are served at once (the
rest closed at once, counted) and each has a timeout, after which a real
scrape is answered again.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

from fsdp_sentinel.exporters.http import MetricsServer
from fsdp_sentinel.exporters.prometheus import build_registry
from fsdp_sentinel.snapshot import Snapshot


def test_300_half_sent_requests_hold_a_bounded_pool_and_time_out() -> None:
    snap = Snapshot(records_total={"step": 1})
    srv = MetricsServer(("127.0.0.1", 0), build_registry(lambda: snap, process=False),
                        lambda: snap, max_connections=8, timeout_s=1.0).start()  # fmt: skip
    base = threading.active_count()
    socks = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never the blank line
            socks.append(s)
        for _ in range(10):  # while they are held, and as the server works through them
            time.sleep(0.1)
            assert threading.active_count() - base <= 8
        assert srv.refused > 0
        # once the held connections time out, a scrape is answered
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(srv.url + "/metrics", timeout=2) as r:
                    assert r.status == 200 and b"fsdp_sentinel_records_total" in r.read()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        # every one of the 300 was refused at once or dropped at its timeout
        while srv.refused + srv.timed_out < 300 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.refused + srv.timed_out >= 300 and srv.timed_out >= 1
        assert threading.active_count() - base <= 8
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_a_dead_serving_loop_is_started_again() -> None:
    snap = Snapshot()
    srv = MetricsServer(("127.0.0.1", 0), build_registry(lambda: snap, process=False), lambda: snap)
    calls = {"n": 0}
    real = srv._httpd.serve_forever

    def dies_once(poll_interval: float = 0.5) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        real(poll_interval)

    srv._httpd.serve_forever = dies_once  # type: ignore[method-assign]
    srv.start()
    try:
        with urllib.request.urlopen(srv.url + "/metrics", timeout=5) as r:
            assert r.status == 200
        assert srv.restarts == 1
    finally:
        srv.close()


def test_healthz_reports_the_thread_restarts() -> None:
    snap = Snapshot(t=12.5, thread_restarts_total={"ingest": 1, "pipeline": 0})
    srv = MetricsServer(("127.0.0.1", 0), build_registry(lambda: snap, process=False),
                        lambda: snap).start()  # fmt: skip
    try:
        with urllib.request.urlopen(srv.url + "/healthz", timeout=5) as r:
            got = json.loads(r.read())
        assert got == {"status": "ok", "t": 12.5, "thread_restarts": {"ingest": 1, "pipeline": 0}}
    finally:
        srv.close()
