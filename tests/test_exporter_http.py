"""The daemon's HTTP endpoint, over real sockets: what a scraper negotiates.

``/metrics`` is served with prometheus-client's negotiation and our writer
(``test_exporter_encode.py`` holds it to prometheus-client's bytes); these
tests check that the server hands it the request as a scraper sends it (``Accept``,
``Accept-Encoding``, ``name[]``), that ``/api/v1/snapshot`` is the snapshot,
that IPv6 works, and that ``promtool check metrics`` passes both formats.
"""

from __future__ import annotations

import gzip
import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families
from test_exporter_prometheus import SNAP

from fsdp_sentinel import daemon, live
from fsdp_sentinel.exporters.http import DEFAULT_ADDR, MetricsServer, parse_addr
from fsdp_sentinel.exporters.prometheus import build_registry
from fsdp_sentinel.snapshot import Snapshot

OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def serve(host: str) -> MetricsServer:
    return MetricsServer((host, 0), build_registry(lambda: SNAP), lambda: SNAP).start()


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    srv = serve("127.0.0.1")
    try:
        yield srv
    finally:
        srv.close()


def get(url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_plain_text_by_default(server: MetricsServer) -> None:
    code, headers, body = get(server.url + "/metrics")
    assert code == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"fsdp_sentinel_step_duration_seconds", "process_cpu_seconds"} <= names


def test_openmetrics_when_asked_as_prometheus_asks(server: MetricsServer) -> None:
    code, headers, body = get(server.url + "/metrics", Accept=OPENMETRICS)
    assert code == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert text.endswith("# EOF\n")
    fams = {f.name: f for f in parse_openmetrics(text)}
    assert fams["fsdp_sentinel_step_duration_seconds"].type == "histogram"


def test_gzip_when_accepted(server: MetricsServer) -> None:
    code, headers, body = get(server.url + "/metrics", **{"Accept-Encoding": "gzip"})
    assert code == 200 and headers.get("Content-Encoding") == "gzip"
    assert b"fsdp_sentinel_straggler{" in gzip.decompress(body)
    _, plain_headers, plain = get(server.url + "/metrics")
    assert "Content-Encoding" not in plain_headers and b"fsdp_sentinel_straggler{" in plain


def test_name_filter(server: MetricsServer) -> None:
    url = server.url + "/metrics?name[]=fsdp_sentinel_straggler&name[]=fsdp_sentinel_build_info"
    _, _, body = get(url)
    names = {s.name for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert names == {"fsdp_sentinel_straggler", "fsdp_sentinel_build_info"}


def test_snapshot_route_and_404(server: MetricsServer) -> None:
    code, headers, body = get(server.url + "/api/v1/snapshot")
    assert code == 200 and headers["Content-Type"] == "application/json"
    assert Snapshot.from_json(json.loads(body)) == SNAP
    assert get(server.url + "/nope")[0] == 404
    assert b"/metrics" in get(server.url + "/")[2]


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_ipv6_loopback() -> None:
    srv = serve("::1")
    try:
        assert srv.url.startswith("http://[::1]:")
        code, _, body = get(srv.url + "/metrics")
        assert code == 200 and b"fsdp_sentinel_build_info" in body
    finally:
        srv.close()


def test_addresses_and_default_port() -> None:
    assert parse_addr("[::1]:18965") == ("::1", 18965)
    assert parse_addr("0.0.0.0:1") == ("0.0.0.0", 1)
    for bad in ("::1:9", "host", "h:99999", ":9"):
        with pytest.raises(ValueError):
            parse_addr(bad)
    # one default everywhere: the daemon, its config, `top`
    assert daemon.DEFAULT_METRICS_ADDR == live.DEFAULT_ADDR == DEFAULT_ADDR
    assert daemon.DaemonConfig().metrics_addr == parse_addr(DEFAULT_ADDR)
    # loopback by default; not 9464 (OpenTelemetry's Prometheus exporter) nor
    # anything in the 9100-9999 range Prometheus's default-port list allots
    host, port = parse_addr(DEFAULT_ADDR)
    assert host == "127.0.0.1" and not 9090 <= port <= 9999


PROMTOOL = shutil.which("promtool")


def promtool_check_metrics(body: bytes) -> tuple[int, list[str]]:
    assert PROMTOOL, "promtool missing: run scripts/setup.sh (Debian package prometheus)"
    res = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True,
                         timeout=30)  # fmt: skip
    out = (res.stdout + res.stderr).decode()
    return res.returncode, [line for line in out.splitlines() if line.strip()]


@pytest.mark.prometheus
def test_promtool_check_metrics_text(server: MetricsServer) -> None:
    _, _, body = get(server.url + "/metrics", Accept="text/plain")
    code, remarks = promtool_check_metrics(body)
    assert (code, remarks) == (0, [])  # not an error, not a lint remark


@pytest.mark.prometheus
def test_promtool_check_metrics_openmetrics(server: MetricsServer) -> None:
    """promtool 2.42 reads only the text format; on OpenMetrics its one remark
    is "no help text" for counters, whose HELP line OpenMetrics writes under
    the family name without ``_total``. Every remark must be exactly that."""
    _, _, body = get(server.url + "/metrics", Accept=OPENMETRICS)
    text = body.decode()
    code, remarks = promtool_check_metrics(body)
    assert not any(line.startswith("error") for line in remarks), remarks
    explained = []
    for line in remarks:
        sample, _, what = line.partition(" ")
        family = sample.removesuffix("_total")
        if what == "no help text" and sample.endswith("_total"):
            assert f"# HELP {family} " in text and f"# TYPE {family} counter" in text, line
            explained.append(line)
    assert explained == remarks and code in (0, 3)  # 3: lint remarks only
