"""Prometheus metrics built fresh from a :class:`~fsdp_sentinel.snapshot.Snapshot`.

:class:`SentinelCollector` is a custom collector: at every scrape its
``collect()`` asks ``snapshot_fn`` for the current snapshot and yields new
metric families from it. Nothing is stored between scrapes and nothing is
registered at import time; the caller passes the registry.

Conventions (docs/daemon.md lists every metric): prefix ``fsdp_sentinel_``,
base units (``_seconds``, ``_bytes_total``, ``_total``), labels only from the
job's shape (``rank``, ``peer_rank``, ``host``, ``op``, ``cause``,
``direction``, ``dev``), never pid, port, step or time. Bandwidth is
``rate(...)`` in PromQL, not an exported figure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from fsdp_sentinel.snapshot import RankView, Snapshot

PREFIX = "fsdp_sentinel_"

#: Every cause a verdict can carry (trace format v1); each rank gets one
#: ``fsdp_sentinel_straggler`` series per cause so alerts can match on it.
CAUSES = ("compute", "network", "rank_lost")

RANK_LABELS = ["rank", "host"]


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    # prometheus_client appends "_total" to counter names itself.
    assert name.endswith("_total"), name
    return CounterMetricFamily(PREFIX + name[: -len("_total")], doc, labels=labels)


#: Per-rank scalar figures: (metric name, help, RankView attribute, divisor, kind).
_RANK_FIGURES: tuple[tuple[str, str, str, float, str], ...] = (
    ("step", "Number of the rank's newest step.", "step", 1.0, "gauge"),
    ("step_seconds", "Duration of the rank's newest step.", "step_seconds", 1.0, "gauge"),
    (
        "compute_seconds",
        "Time of the newest step not spent waiting for collectives.",
        "compute_seconds",
        1.0,
        "gauge",
    ),
    (
        "wait_seconds",
        "Time of the newest step spent waiting for collectives.",
        "wait_seconds",
        1.0,
        "gauge",
    ),
    (
        "srtt_seconds",
        "Smoothed TCP round-trip time over the rank's flows.",
        "srtt_us",
        1e6,
        "gauge",
    ),
    ("steps_total", "Steps the rank completed.", "steps_total", 1.0, "counter"),
    (
        "step_seconds_total",
        "Sum of the rank's step durations.",
        "step_seconds_total",
        1.0,
        "counter",
    ),
    ("retransmits_total", "TCP segments the rank retransmitted.", "retrans_total", 1.0, "counter"),
    (
        "straggler_score",
        "Score of the rank's open verdict (absent when it has none).",
        "score",
        1.0,
        "gauge",
    ),
)

#: Per-rank, per-op collective figures: (metric name, help, RankView dict attribute).
_COLL_FIGURES: tuple[tuple[str, str, str], ...] = (
    ("collectives_total", "Collectives the rank completed, by op.", "coll_count_total"),
    ("collective_bytes_total", "Bytes of the rank's collectives, by op.", "coll_bytes_total"),
    (
        "collective_seconds_total",
        "Time from issue to completion of the rank's collectives, by op.",
        "coll_seconds_total",
    ),
)


class SentinelCollector(Collector):
    """Yields fsdp-sentinel metric families from ``snapshot_fn()`` at each scrape.

    Register it on a registry the caller owns::

        registry = CollectorRegistry()
        registry.register(SentinelCollector(lambda: pipeline_snapshot))
    """

    def __init__(self, snapshot_fn: Callable[[], Snapshot]) -> None:
        self._snapshot_fn = snapshot_fn

    def describe(self) -> list[Metric]:
        # No description up front: registration must not call snapshot_fn.
        return []

    def collect(self) -> Iterator[Metric]:
        yield from families(self._snapshot_fn())


def _rank_labels(r: RankView) -> list[str]:
    return [str(r.rank), r.host or ""]


def families(snap: Snapshot) -> Iterator[Metric]:
    """The metric families for one snapshot (pure; used by the collector)."""
    ranks = sorted(snap.ranks, key=lambda r: r.rank)

    for name, doc, attr, div, kind in _RANK_FIGURES:
        fam: Any = (
            _gauge(name, doc, RANK_LABELS) if kind == "gauge" else _counter(name, doc, RANK_LABELS)
        )
        for r in ranks:
            value = getattr(r, attr)
            if value is not None:
                fam.add_metric(_rank_labels(r), float(value) / div)
        yield fam

    for name, doc, attr in _COLL_FIGURES:
        fam = _counter(name, doc, [*RANK_LABELS, "op"])
        for r in ranks:
            for op, value in sorted(getattr(r, attr).items()):
                fam.add_metric([*_rank_labels(r), op], float(value))
        yield fam

    net = _counter(
        "network_bytes_total",
        "TCP payload bytes the rank's flows sent (tx) and received (rx).",
        [*RANK_LABELS, "direction"],
    )
    for r in ranks:
        net.add_metric([*_rank_labels(r), "tx"], float(r.tx_bytes_total))
        net.add_metric([*_rank_labels(r), "rx"], float(r.rx_bytes_total))
    yield net

    straggler = _gauge(
        "straggler",
        "1 while the rank has an open verdict with this cause, else 0.",
        [*RANK_LABELS, "cause"],
    )
    lost = _gauge("rank_lost", "1 while the rank is considered gone, else 0.", RANK_LABELS)
    for r in ranks:
        for cause in CAUSES:
            on = r.state != "ok" and r.cause == cause
            straggler.add_metric([*_rank_labels(r), cause], 1.0 if on else 0.0)
        lost.add_metric(_rank_labels(r), 1.0 if r.state == "lost" else 0.0)
    yield straggler
    yield lost

    peer_labels = ["rank", "peer_rank"]
    flow_bytes = _counter(
        "flow_bytes_total",
        "TCP payload bytes between a rank and a peer rank, by direction seen from rank.",
        [*peer_labels, "direction"],
    )
    flow_srtt = _gauge(
        "flow_srtt_seconds", "Smoothed round-trip time of rank's flows to a peer.", peer_labels
    )
    flow_retrans = _counter(
        "flow_retransmits_total", "Segments rank retransmitted to a peer.", peer_labels
    )
    for p in sorted(snap.peers, key=lambda p: (p.rank, p.peer_rank)):
        labels = [str(p.rank), str(p.peer_rank)]
        flow_bytes.add_metric([*labels, "tx"], float(p.tx_bytes_total))
        flow_bytes.add_metric([*labels, "rx"], float(p.rx_bytes_total))
        if p.srtt_us is not None:
            flow_srtt.add_metric(labels, p.srtt_us / 1e6)
        flow_retrans.add_metric(labels, float(p.retrans_total))
    yield flow_bytes
    yield flow_srtt
    yield flow_retrans

    verdicts = _counter("verdicts_total", "Flag verdicts the detector issued, by cause.", ["cause"])
    for cause in sorted(set(CAUSES) | set(snap.verdicts_total)):
        verdicts.add_metric([cause], float(snap.verdicts_total.get(cause, 0)))
    yield verdicts

    scalars = (
        ("records_total", "Trace records the pipeline consumed.", sum(snap.records_total.values())),
        (
            "ingest_dropped_total",
            "Datagrams the ingest socket received but did not pass on (any reason).",
            snap.ingest_dropped_total,
        ),
        (
            "ingest_malformed_total",
            "Datagrams dropped because they were not valid trace records.",
            snap.ingest_malformed_total,
        ),
    )
    for name, doc, value in scalars:
        fam = _counter(name, doc, [])
        fam.add_metric([], float(value))
        yield fam

    if snap.world_size is not None:
        ws = _gauge("world_size", "Ranks in the job, as the ranks announced it.", [])
        ws.add_metric([], float(snap.world_size))
        yield ws
    newest = _gauge(
        "last_record_timestamp_seconds", "Time of the newest record seen (Unix seconds).", []
    )
    newest.add_metric([], snap.t)
    yield newest


def build_registry(
    snapshot_fn: Callable[[], Snapshot], *, process: bool = True
) -> CollectorRegistry:
    """A fresh registry holding a :class:`SentinelCollector` (and, with
    ``process``, the standard ``process_*`` metrics of this process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SentinelCollector(snapshot_fn))
    if process:
        from prometheus_client import ProcessCollector

        ProcessCollector(registry=registry)
    return registry
