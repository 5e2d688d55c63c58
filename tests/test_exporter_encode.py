"""Our exposition writer (``exporters/encode.py``) against prometheus-client's.

The oracle is prometheus-client itself: for every snapshot and every format
and escaping a scraper can negotiate, ``fast_encoder(choose_encoder(accept))``
must return exactly the bytes prometheus-client's own encoder returns, and
prometheus-client's OpenMetrics parser must read ours back. The snapshots
cover the test table's, a 64-rank job, an empty one, the pipeline's own,
label values that need escaping, NaN/Inf/-0 values; hand-made families cover
what our writer hands to prometheus-client (timestamps, exemplars, ``_created``,
info/stateset/gaugehistogram types, names with ``:`` or unicode).
"""

from __future__ import annotations

import dataclasses
import gzip
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.util import setup_testing_defaults

import pytest
from prometheus_client import make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    StateSetMetricFamily,
    SummaryMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.registry import CollectorRegistry
from prometheus_client.samples import Exemplar, Sample, Timestamp
from test_exporter_cardinality import snapshot_of
from test_exporter_prometheus import SNAP

from fsdp_sentinel.exporters import encode
from fsdp_sentinel.exporters.encode import encode_openmetrics, encode_text, fast_encoder
from fsdp_sentinel.exporters.http import make_app
from fsdp_sentinel.exporters.prometheus import build_registry
from fsdp_sentinel.snapshot import PeerView, Snapshot

#: What scrapers send: Prometheus 2.x, Prometheus 3 (allow-utf-8), curl, and
#: every escaping prometheus-client knows (ours writes two; the rest are its).
ACCEPTS = [
    "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8,text/plain;q=0.5",
    "application/openmetrics-text;version=1.0.0;escaping=underscores",
    "application/openmetrics-text;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=1.0.0;escaping=values",
    "application/openmetrics-text;version=2.0.0",
    "application/openmetrics-text",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=dots",
    "text/plain;version=0.0.4",
    "",
]


def job(ranks: int, peers: int) -> Snapshot:
    """SNAP's flagged rank copied ``ranks`` times, ``peers`` peers each."""
    model = SNAP.ranks[0]
    views = tuple(
        dataclasses.replace(
            model, rank=r, host=f"node-{r // 8:03d}", state="ok" if r else "flagged"
        )
        for r in range(ranks)
    )
    pairs = tuple(
        PeerView(rank=r, peer_rank=(r + k + 1) % ranks, tx_bytes_total=10**11 + k, srtt_us=2e3 + k)
        for r in range(ranks)
        for k in range(peers)
    )
    return dataclasses.replace(SNAP, world_size=ranks, ranks=views, peers=pairs)


def odd_values() -> Snapshot:
    """Label values needing every escape, unicode, and values Go writes specially."""
    r0, r1 = SNAP.ranks
    ranks = (
        dataclasses.replace(r0, host='h"quoted"', job="run\\back\\slash", srtt_us=math.inf),
        dataclasses.replace(
            r1,
            host="line\nbreak",
            job="jöb-ünïcode",
            score=math.nan,
            wait_seconds_total=-0.0,
            tx_bytes_total=10**21,
        ),  # fmt: skip
    )
    return dataclasses.replace(SNAP, t=math.nan, ranks=ranks,
                               verdicts_total={"network": 1, 'we"ird\\\n': 2})  # fmt: skip


SNAPSHOTS = {
    "table": SNAP,
    "job_64x4": job(64, 4),
    "empty": Snapshot(),
    "pipeline": snapshot_of(5, steps=14),
    "odd_values": odd_values(),
}


class Frozen:
    """A collector yielding the same families every time."""

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterator[Metric]:
        return iter(self.metrics)


def hand_made() -> list[Metric]:
    """Families our writer leaves to prometheus-client, beside plain ones."""
    plain = GaugeMetricFamily("plain", 'help with "quotes", \\ and\nnewline', labels=["a"])
    plain.add_metric(["x"], 1.5)
    # Values Go writes its own way, zero's two signs (one dict key), ints.
    values = GaugeMetricFamily("values", "Go-style floats", labels=["i"])
    for i, v in enumerate([0.0, -0.0, 0, -0.0, 0.0, math.nan, math.nan, math.inf, -math.inf,
                           1e21, 10**21, 5e-324, 123456789.0, 1234567.0, 0.1, True, -2.5]):  # fmt: skip
        values.add_metric([str(i)], v)
    stamped = GaugeMetricFamily("stamped", "a timestamp", labels=["a"])
    stamped.add_metric(["x"], 2.0, timestamp=Timestamp(1_700_000_000, 5))
    created = CounterMetricFamily("created", "with _created", labels=["a"], unit="bytes")
    created.add_metric(["x"], 3.0, created=1_700_000_000.25)
    exemplar = CounterMetricFamily("exemplar", "an exemplar")
    exemplar.samples.append(
        Sample("exemplar_total", {}, 4.0, None, Exemplar({"trace_id": "abc"}, 1.0))
    )
    colon = GaugeMetricFamily("with:colon", "a colon", labels=["a"])
    colon.add_metric(["x"], 5.0)
    utf8 = GaugeMetricFamily("ünï.code", "a unicode name", labels=["lä.bel"])
    utf8.add_metric(["x"], 6.0)
    reserved = GaugeMetricFamily("reserved", "a reserved label", labels=["__r", "a"])
    reserved.add_metric(["x", "y"], 7.0)
    info = InfoMetricFamily("an", "an info", value={"version": "1"})
    states = StateSetMetricFamily("states", "a stateset", value={"on": True, "off": False})
    ghist = GaugeHistogramMetricFamily("ghist", "a gauge histogram", buckets=[("+Inf", 2.0)],
                                       gsum_value=3.0)  # fmt: skip
    hist = HistogramMetricFamily("hist", "a histogram", labels=["a"], unit="seconds")
    hist.add_metric(["x"], [("0.5", 1.0), ("1e+06", 2.0), ("+Inf", 3.0)], 4.5)
    summary = SummaryMetricFamily("summ", "a summary", count_value=3, sum_value=1.5)
    unknown = UnknownMetricFamily("unk", "an unknown", value=math.inf)
    empty = GaugeMetricFamily("nothing_yet", "no samples", labels=["a"])
    return [plain, values, stamped, created, exemplar, colon, utf8, reserved, info, states, ghist,
            hist, summary, unknown, empty]  # fmt: skip


def registry_of(snap: Snapshot) -> CollectorRegistry:
    return build_registry(lambda: snap, process=False)


def registries() -> Iterator[tuple[str, Any]]:
    for name, snap in SNAPSHOTS.items():
        yield name, registry_of(snap)
    yield "hand_made", Frozen(hand_made())
    yield "all_together", Frozen([*hand_made()[:3], *build_registry(lambda: SNAP).collect()])


@pytest.mark.parametrize("accept", ACCEPTS)
@pytest.mark.parametrize(("name", "registry"), list(registries()), ids=lambda x: str(x)[:20])
def test_byte_for_byte_as_prometheus_client(name: str, registry: Any, accept: str) -> None:
    theirs, _ = choose_encoder(accept)
    ours = fast_encoder(theirs)
    assert ours is not theirs  # every format negotiated here gets our writer
    want = theirs(registry)
    assert ours(registry) == want
    assert want.count(b"\n") > 1


@pytest.mark.parametrize("name", ["table", "job_64x4", "empty", "pipeline", "odd_values"])
def test_openmetrics_parser_reads_ours_back(name: str) -> None:
    snap = SNAPSHOTS[name]
    registry = build_registry(lambda: snap, process=False)
    text = encode_openmetrics(registry).decode()
    fams = list(parse_openmetrics(text))  # raises on anything malformed
    got = sorted((s.name, sorted(s.labels.items()), repr(s.value)) for f in fams for s in f.samples)
    want = sorted(
        (s.name, sorted(s.labels.items()), repr(float(s.value)))
        for f in registry.collect()
        for s in f.samples
    )
    assert got == want
    if name == "odd_values":
        hosts = {dict(lab).get("host") for _, lab, _ in got}
        # A newline (a control character) is replaced by the exporter's
        # sanitiser before any writer sees it; quotes and backslashes are escaped.
        assert {'h"quoted"', "line\ufffdbreak"} <= hosts


def test_plain_families_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the families that need it go to prometheus-client's writer."""
    handed: list[str] = []
    real = encode._One

    def spy(metric: Metric) -> Any:
        handed.append(metric.name)
        return real(metric)

    monkeypatch.setattr(encode, "_One", spy)
    encode_text(build_registry(lambda: SNAPSHOTS["job_64x4"], process=False))
    assert handed == []
    encode_openmetrics(Frozen(hand_made()))
    assert sorted(handed) == sorted(
        [
            "stamped",
            "created_bytes",
            "exemplar",
            "with:colon",
            "ünï.code",
            "reserved",
            "an",
            "states",
            "ghist",
        ]  # fmt: skip
    )
    handed.clear()
    encode_text(build_registry(lambda: SNAPSHOTS["odd_values"], process=False))
    assert "fsdp_sentinel_straggler" in handed and "fsdp_sentinel_build_info" not in handed


def test_other_encoders_are_left_alone() -> None:
    def mine(registry: Any) -> bytes:
        return b""

    assert fast_encoder(mine) is mine
    assert fast_encoder(encode_text) is encode_text


def call(app: Callable[..., Iterable[bytes]], **environ: str) -> tuple[str, dict[str, str], bytes]:
    env: dict[str, Any] = dict(environ)
    setup_testing_defaults(env)
    got: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        got["status"], got["headers"] = status, dict(headers)

    body = b"".join(app(env, start_response))
    return got["status"], got["headers"], body


@pytest.mark.parametrize("accept", ACCEPTS[:3] + ACCEPTS[-3:])
@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize(
    "query", ["", "name[]=fsdp_sentinel_straggler&name[]=process_cpu_seconds_total"]
)
@pytest.mark.parametrize("method", ["GET", "OPTIONS", "POST"])
def test_served_as_make_wsgi_app_serves(accept: str, gz: bool, query: str, method: str) -> None:
    """Our /metrics app answers exactly as prometheus-client's ``make_wsgi_app``
    (gzip aside, whose level differs: the bodies once decompressed)."""
    registry = build_registry(lambda: SNAP, process=False)
    ours, theirs = make_app(registry, lambda: SNAP), make_wsgi_app(registry)
    env = {"PATH_INFO": "/metrics", "QUERY_STRING": query, "REQUEST_METHOD": method,
           "HTTP_ACCEPT": accept, **({"HTTP_ACCEPT_ENCODING": "gzip"} if gz else {})}  # fmt: skip
    got, want = call(ours, **env), call(theirs, **env)
    assert got[:2] == want[:2]
    if gz and method == "GET":
        assert got[2][:2] == b"\x1f\x8b" and gzip.decompress(got[2]) == gzip.decompress(want[2])
    else:
        assert got[2] == want[2]


def test_a_failing_collector_is_a_500_not_a_crash() -> None:
    class Broken:
        def collect(self) -> Iterator[Metric]:
            raise RuntimeError("boom")

    registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
    registry.register(Broken())  # type: ignore[arg-type]
    status, _, body = call(make_app(registry, Snapshot), PATH_INFO="/metrics")
    assert status.startswith("500") and body == b"internal error\n"


def test_generate_latest_is_the_oracle() -> None:
    """Guard: the oracle above is prometheus-client's own writer, not ours."""
    assert generate_latest.__module__ == "prometheus_client.exposition"
    assert generate_openmetrics.__module__ == "prometheus_client.openmetrics.exposition"
