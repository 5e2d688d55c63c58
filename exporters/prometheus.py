"""Prometheus metrics built fresh from a :class:`~fsdp_sentinel.snapshot.Snapshot`.

:class:`SentinelCollector` is a custom collector: at every scrape its
``collect()`` asks ``snapshot_fn`` for the current snapshot and yields new
metric families from it (:func:`families`, pure). Nothing is stored between
scrapes and nothing is registered at import time; the caller passes the
registry. ``exporters/http.py`` serves it with prometheus-client's
negotiation (text or OpenMetrics, gzip, ``name[]``) and ``encode.py``'s writer.

The family names, types, labels and units are a contract: docs/metrics.md
lists each with the number of series it makes. Conventions: prefix
``fsdp_sentinel_``, base units, every rank series labelled ``job``, ``rank``,
``host``; labels only from the job's shape, never pid, port, step or time.
No two families share a name once OpenMetrics suffixes (``_total``,
``_count``, ``_sum``, ``_bucket``, ``_info``) are taken off: a test checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from fsdp_sentinel import __version__, buckets
from fsdp_sentinel.exporters.sanitize import FOLDED_RANK, OTHER, fold_ranks, sanitize
from fsdp_sentinel.snapshot import RankView, Snapshot

PREFIX = "fsdp_sentinel_"

#: Every cause a verdict can carry (trace format v1); each rank gets one
#: ``fsdp_sentinel_straggler`` series per cause so alerts can match on it.
CAUSES = ("compute", "network", "rank_lost", "hang")

#: One score family per unit: the open verdict's ``score`` goes to the family
#: of its cause. (``hang`` has its 0/1 series; its score's unit is not settled.)
SCORE_FAMILIES: dict[str, tuple[str, str]] = {
    "compute": (
        "straggler_relative_slowdown_ratio",
        "Open compute verdict: the rank's step time over the job's median (1 = typical).",
    ),
    "network": (
        "straggler_srtt_ratio",
        "Open network verdict: the rank's flows' srtt over the job's median srtt.",
    ),
    "rank_lost": (
        "rank_silent_seconds",
        "Open rank_lost verdict: seconds since the rank was last heard from.",
    ),
}

RANK_LABELS = ["job", "rank", "host"]


def _gauge(name: str, doc: str, labels: Sequence[str], unit: str = "") -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels), unit=unit)


def _counter(name: str, doc: str, labels: Sequence[str], unit: str = "") -> CounterMetricFamily:
    # prometheus_client appends "_total" to counter names itself.
    assert name.endswith("_total"), name
    return CounterMetricFamily(PREFIX + name[: -len("_total")], doc, labels=list(labels), unit=unit)


def _histogram(name: str, doc: str, labels: Sequence[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(PREFIX + name, doc, labels=list(labels), unit="seconds")


def _le(bounds: tuple[float, ...]) -> list[str]:
    return [floatToGoString(b) for b in bounds] + ["+Inf"]


_STEP_LE = _le(buckets.STEP_DURATION_BOUNDS)
_WAIT_LE = _le(buckets.COLLECTIVE_WAIT_BOUNDS)


def _add_histogram(
    fam: HistogramMetricFamily,
    names: Sequence[str],
    labels: Sequence[str],
    les: list[str],
    counts: Sequence[int],
    total: float,
) -> None:
    """``fam.add_metric(labels, cumulative buckets, total)``, the same samples in
    the same order, built with one label dict a series instead of two lists a
    bucket: a 64-rank job has 192 histograms and 4,000 bucket samples a scrape."""
    base = dict(zip(names, labels, strict=True))
    bucket = fam.name + "_bucket"
    run = 0
    add = fam.samples.append
    for le, n in zip(les, counts, strict=True):
        run += n
        add(Sample(bucket, {**base, "le": le}, float(run)))
    add(Sample(fam.name + "_count", base, float(run)))
    add(Sample(fam.name + "_sum", dict(base), total))


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
    return [r.job, _rank_label(r.rank), r.host]


def _rank_label(rank: int | None) -> str:
    return "" if rank is None else OTHER if rank == FOLDED_RANK else str(rank)


def families(snap: Snapshot) -> Iterator[Metric]:
    """The metric families for one snapshot (pure; used by the collector).

    The snapshot is sanitised first (``sanitize.py``): no value that reached
    the pipeline can make a scrape fail, or the series grow without bound."""
    snap, folded = fold_ranks(sanitize(snap))
    # Keyed by (job, rank): a node daemon judges several jobs, each with its rank 0.
    ranks = sorted(snap.ranks, key=lambda r: (r.job, r.rank))
    labels = {(r.job, r.rank): _rank_labels(r) for r in ranks}
    yield from _step_families(ranks, labels)
    yield from _verdict_families(ranks, labels, snap)
    yield from _network_families(ranks, labels, snap)
    yield from _fabric_families(labels, snap)
    yield from _daemon_families(snap)
    gauge = _gauge(
        "rank_series_folded",
        "Ranks exported together under the rank label other (past the per-rank series cap;"
        " ranks with an open verdict are always their own).",
        [],
    )
    gauge.add_metric([], float(folded))
    yield gauge


def _step_families(
    ranks: list[RankView], labels: dict[tuple[str, int], list[str]]
) -> Iterator[Metric]:
    newest = _gauge("step", "Number of the rank's newest summarised step.", RANK_LABELS)
    steps = _histogram(
        "step_duration_seconds", "Duration of the rank's optimizer steps.", RANK_LABELS
    )
    compute = _counter(
        "compute_seconds_total",
        "Time of the rank's steps not spent blocked in collectives.",
        RANK_LABELS,
        "seconds",
    )
    wait = _counter(
        "wait_seconds_total",
        "Time of the rank's steps spent blocked in collectives.",
        RANK_LABELS,
        "seconds",
    )
    coll_labels = [*RANK_LABELS, "op"]
    coll_wait = _histogram(
        "collective_wait_seconds",
        "Time the rank waited for each collective, from issue to completion, by op.",
        coll_labels,
    )
    coll_bytes = _counter(
        "collective_bytes_total", "Bytes of the rank's collectives, by op.", coll_labels, "bytes"
    )
    for r in ranks:
        lab = labels[r.job, r.rank]
        if r.step is not None:
            newest.add_metric(lab, float(r.step))
        if len(r.step_buckets) == len(_STEP_LE):
            _add_histogram(steps, RANK_LABELS, lab, _STEP_LE, r.step_buckets, r.step_seconds_total)
            compute.add_metric(lab, max(0.0, r.step_seconds_total - r.wait_seconds_total))
            wait.add_metric(lab, r.wait_seconds_total)
        for op, counts in sorted(r.coll_wait_buckets.items()):
            if len(counts) == len(_WAIT_LE):
                total = r.coll_seconds_total.get(op, 0.0)
                _add_histogram(coll_wait, coll_labels, [*lab, op], _WAIT_LE, counts, total)
        for op, nbytes in sorted(r.coll_bytes_total.items()):
            coll_bytes.add_metric([*lab, op], float(nbytes))
    yield from (newest, steps, compute, wait, coll_wait, coll_bytes)


def _verdict_families(
    ranks: list[RankView], labels: dict[tuple[str, int], list[str]], snap: Snapshot
) -> Iterator[Metric]:
    straggler = _gauge(
        "straggler",
        "1 while the rank has an open verdict with this cause, else 0.",
        [*RANK_LABELS, "cause"],
    )
    scores = {
        c: _gauge(n, doc, RANK_LABELS, "seconds" if n.endswith("_seconds") else "")
        for c, (n, doc) in SCORE_FAMILIES.items()
    }
    # What the open verdict costs the job (fsdp_sentinel.cost): a rank-hours
    # rate, so sum() over ranks is the job's loss and a user can weigh
    # evicting the node against letting the job run.
    cost = _gauge(
        "straggler_cost_idle_ranks",
        "Open verdict: ranks the job keeps idle on average waiting for this one (= rank-hours an hour).",
        RANK_LABELS,
    )
    cost_step = _gauge(
        "straggler_cost_step_seconds",
        "Open verdict: seconds the rank adds to every step of the job.",
        RANK_LABELS,
        "seconds",
    )
    for r in ranks:
        lab = labels[r.job, r.rank]
        for cause in CAUSES:
            on = r.state != "ok" and r.cause == cause
            straggler.add_metric([*lab, cause], 1.0 if on else 0.0)
        fam = scores.get(r.cause or "") if r.state != "ok" else None
        if fam is not None and r.score is not None:
            fam.add_metric(lab, float(r.score))
        if r.state != "ok" and r.cost:
            rh, secs = r.cost.get("rank_hours_per_hour"), r.cost.get("seconds_per_step")
            if isinstance(rh, (int, float)):
                cost.add_metric(lab, float(rh))
            if isinstance(secs, (int, float)):
                cost_step.add_metric(lab, float(secs))
    yield straggler
    yield from scores.values()
    yield cost
    yield cost_step
    verdicts = _counter("verdicts_total", "Flag verdicts the detector issued, by cause.", ["cause"])
    for cause in sorted(set(CAUSES) | set(snap.verdicts_total)):
        verdicts.add_metric([cause], float(snap.verdicts_total.get(cause, 0)))
    yield verdicts


def _network_families(
    ranks: list[RankView], labels: dict[tuple[str, int], list[str]], snap: Snapshot
) -> Iterator[Metric]:
    srtt = _gauge(
        "srtt_seconds",
        "Smoothed TCP round-trip time over the rank's flows.",
        RANK_LABELS,
        "seconds",
    )
    retrans = _counter(
        "retransmits_total", "TCP segments the rank's flows retransmitted.", RANK_LABELS
    )
    spurious = _counter(
        "retransmits_spurious_total",
        "Of the rank's retransmits, segments the receiver reported it already had "
        "(D-SACK): late ACKs, not losses.",
        RANK_LABELS,
    )
    net = _counter(
        "network_bytes_total",
        "TCP payload bytes the rank's flows sent (tx) and received (rx).",
        [*RANK_LABELS, "direction"],
        "bytes",
    )
    for r in ranks:
        lab = labels[r.job, r.rank]
        if r.srtt_us is not None:
            srtt.add_metric(lab, r.srtt_us / 1e6)
        retrans.add_metric(lab, float(r.retrans_total))
        spurious.add_metric(lab, float(r.retrans_spurious_total))
        net.add_metric([*lab, "tx"], float(r.tx_bytes_total))
        net.add_metric([*lab, "rx"], float(r.rx_bytes_total))
    yield from (srtt, retrans, spurious, net)

    peer_labels = [*RANK_LABELS, "peer_rank"]
    flow_bytes = _counter(
        "flow_bytes_total",
        "TCP payload bytes between a rank and a peer rank, by direction seen from rank.",
        [*peer_labels, "direction"],
        "bytes",
    )
    flow_srtt = _gauge(
        "flow_srtt_seconds",
        "Smoothed round-trip time of rank's flows to a peer.",
        peer_labels,
        "seconds",
    )
    flow_retrans = _counter(
        "flow_retransmits_total", "Segments rank retransmitted to a peer.", peer_labels
    )
    flow_spurious = _counter(
        "flow_retransmits_spurious_total",
        "Of those, segments the peer reported it already had (D-SACK).",
        peer_labels,
    )
    rank_job = _rank_jobs(labels)
    for p in sorted(snap.peers, key=lambda p: (p.job, p.rank, p.peer_rank)):
        job = p.job or rank_job.get(p.rank, "")
        lab = [*labels.get((job, p.rank), [job, _rank_label(p.rank), ""]), _rank_label(p.peer_rank)]
        flow_bytes.add_metric([*lab, "tx"], float(p.tx_bytes_total))
        flow_bytes.add_metric([*lab, "rx"], float(p.rx_bytes_total))
        if p.srtt_us is not None:
            flow_srtt.add_metric(lab, p.srtt_us / 1e6)
        flow_retrans.add_metric(lab, float(p.retrans_total))
        flow_spurious.add_metric(lab, float(p.retrans_spurious_total))
    yield from (flow_bytes, flow_srtt, flow_retrans, flow_spurious)


def _rank_jobs(labels: dict[tuple[str, int], list[str]]) -> dict[int | None, str]:
    """rank -> its job, for views a bare pipeline's snapshot leaves without one
    (``PeerView.job``, ``NcclView.job`` are filled by :class:`~fsdp_sentinel.jobs.JobRouter`)."""
    return {r: job for job, r in labels}


def _fabric_families(labels: dict[tuple[str, int], list[str]], snap: Snapshot) -> Iterator[Metric]:
    port_labels = ["host", "dev", "rdma_port"]
    rdma_bytes = _counter(
        "rdma_port_bytes_total",
        "Bytes an RDMA port sent (tx) and received (rx), from its sysfs counters.",
        [*port_labels, "direction"],
        "bytes",
    )
    rdma_errors = _counter(
        "rdma_port_errors_total",
        "Error, discard and retransmission counters of an RDMA port, by sysfs name.",
        [*port_labels, "counter"],
    )
    for p in snap.rdma_ports:
        lab = [p.host, p.dev, str(p.port)]
        rdma_bytes.add_metric([*lab, "tx"], float(p.tx_bytes_total))
        rdma_bytes.add_metric([*lab, "rx"], float(p.rx_bytes_total))
        for name, n in sorted(p.errors.items()):
            rdma_errors.add_metric([*lab, name], float(n))
    yield from (rdma_bytes, rdma_errors)

    nccl_labels = [*RANK_LABELS, "op"]
    calls = _counter("nccl_calls_total", "NCCL collective calls (libnccl uprobes).", nccl_labels)
    nbytes = _counter(
        "nccl_bytes_total",
        "Bytes of NCCL collective calls (libnccl uprobes).",
        nccl_labels,
        "bytes",
    )
    rank_job = _rank_jobs(labels)
    for nv in snap.nccl:
        rank = _rank_label(nv.rank)
        lab = [nv.job or rank_job.get(nv.rank, ""), rank, nv.host, nv.op]
        calls.add_metric(lab, float(nv.calls_total))
        nbytes.add_metric(lab, float(nv.bytes_total))
    yield from (calls, nbytes)

    active = _gauge(
        "remediation_active",
        "1 while the remediator's change to this device is in place, else 0.",
        ["host", "dev"],
    )
    for rv in sorted(snap.remediation, key=lambda v: (v.host, v.dev)):
        active.add_metric([rv.host, rv.dev], 1.0 if rv.active else 0.0)
    yield active


def _daemon_families(snap: Snapshot) -> Iterator[Metric]:
    def by_key(name: str, doc: str, label: str, values: dict[str, int]) -> Metric:
        fam = _counter(name, doc, [label])
        for key, n in sorted(values.items()):
            fam.add_metric([key], float(n))
        return fam

    yield by_key(
        "records_total", "Trace records the pipeline consumed, by kind.", "kind", snap.records_total
    )
    yield by_key(
        "ingest_messages_total",
        "Records the ingest socket received (one a datagram line): accepted, or why dropped.",
        "result",
        snap.ingest_messages_total,
    )
    yield by_key(
        "stream_refused_total",
        "Records the stream guard refused: far ahead of the stream clock, or a step far ahead.",
        "result",
        snap.stream_refused_total,
    )
    resets = _counter(
        "clock_resets_total", "Ranks or hosts whose clock jump was taken off their records.", []
    )
    resets.add_metric([], float(snap.clock_resets_total))
    yield resets
    yield by_key(
        "thread_restarts_total",
        "Times one of the daemon's threads died and was started again, by thread.",
        "thread",
        snap.thread_restarts_total,
    )
    yield by_key(
        "trace_write_errors_total",
        "Write errors on the daemon's output files (each switched that file off), by output.",
        "output",
        snap.trace_write_errors_total,
    )
    yield by_key(
        "trace_records_lost_total",
        "Records not written to an output file after its write error, by output.",
        "output",
        snap.trace_records_lost_total,
    )
    yield by_key(
        "state_evictions_total",
        "What the correlator's caps and time-to-live dropped or folded, by kind of state.",
        "kind",
        snap.evictions_total,
    )
    yield by_key(
        "events_lost_total",
        "Probe events lost in the kernel or on the way, by source.",
        "source",
        snap.events_lost_total,
    )
    runs = _counter("bpf_program_runs_total", "Times the kernel ran the BPF program.", ["program"])
    run_s = _counter(
        "bpf_program_run_seconds_total",
        "CPU time the kernel spent in the BPF program (counted while BPF stats are on).",
        ["program"],
        "seconds",
    )
    for prog in sorted(snap.bpf_programs, key=lambda p: p.program):
        runs.add_metric([prog.program], float(prog.runs_total))
        run_s.add_metric([prog.program], prog.run_ns_total / 1e9)
    yield from (runs, run_s)

    # One sample per live job (fsdp_sentinel.jobs); a bare pipeline's snapshot has one.
    bare = {r.job for r in snap.ranks}
    sizes = [(j.job, j.world_size) for j in snap.jobs] or [
        (bare.pop() if len(bare) == 1 else "", snap.world_size)
    ]
    if any(n is not None for _, n in sizes):
        ws = _gauge("world_size", "Ranks in the job, as the ranks announced it.", ["job"])
        for job, n in sizes:
            if n is not None:
                ws.add_metric([job], float(n))
        yield ws
    yield from _cluster_families(snap)
    newest = _gauge(
        "last_record_timestamp_seconds",
        "Time of the newest record seen (Unix seconds).",
        [],
        "seconds",
    )
    newest.add_metric([], snap.t)
    yield newest
    # A gauge, not the OpenMetrics info type: promtool's text parser (and so
    # `promtool check metrics`) knows no "info" type.
    build = _gauge("build_info", "The running fsdp-sentinel: always 1.", ["version"])
    build.add_metric([__version__], 1.0)
    yield build


#: The values of ``cluster_view``: every one is exported, 1 for the node's view now.
CLUSTER_VIEWS = ("cluster", "node")


def _cluster_families(snap: Snapshot) -> Iterator[Metric]:
    """Cluster mode only (``run --cluster``): which view this node detects with."""
    if not snap.cluster:
        return
    view = _gauge(
        "cluster_view",
        "1 for the view this node daemon acts on: cluster (the leader's verdicts, the job's "
        "store answers) or node (its own ranks only, the store is out of reach).",
        ["job", "view"],
    )
    leading = _gauge("cluster_leading", "1 while this node daemon leads the job.", ["job"])
    takeovers = _counter(
        "cluster_takeovers_total", "Times this node daemon began to lead the job.", ["job"]
    )
    for c in sorted(snap.cluster, key=lambda c: c.job):
        for v in CLUSTER_VIEWS:
            view.add_metric([c.job, v], 1.0 if c.view == v else 0.0)
        leading.add_metric([c.job], 1.0 if c.leading else 0.0)
        takeovers.add_metric([c.job], float(c.takeovers))
    yield from (view, leading, takeovers)


def build_registry(
    snapshot_fn: Callable[[], Snapshot], *, process: bool = True
) -> CollectorRegistry:
    """A fresh registry holding a :class:`SentinelCollector` (and, with
    ``process``, the standard ``process_*`` metrics of this process)."""
    # Our collector describes nothing up front (registration must not build a
    # snapshot); "without names" keeps it in ``?name[]=`` filtered scrapes.
    registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
    registry.register(SentinelCollector(snapshot_fn))
    if process:
        from prometheus_client import ProcessCollector

        ProcessCollector(registry=registry)
    return registry
