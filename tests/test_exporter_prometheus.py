"""The Prometheus collector over a fixed Snapshot: a table of expected samples.

The exposition is produced by prometheus_client and parsed back with its own
parsers (the text format and OpenMetrics), so the tests check what a scraper
would read. Histogram counts are also checked end to end: records through the
real pipeline, buckets worked out here from the records themselves.
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families

from fsdp_sentinel import __version__
from fsdp_sentinel.buckets import COLLECTIVE_WAIT_BOUNDS, STEP_DURATION_BOUNDS
from fsdp_sentinel.exporters.prometheus import SentinelCollector, build_registry
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.snapshot import (
    BpfProgramView,
    NcclView,
    PeerView,
    RankView,
    RdmaPortView,
    RemediationView,
    Snapshot,
)
from fsdp_sentinel.synth import Scenario, generate

#: Two steps, of 1.0 s (the le="1.0" bucket) and 29 s (le="30.0"): 30 s in all.
STEP_BUCKETS = tuple(1 if i in (8, 17) else 0 for i in range(21))
assert len(STEP_BUCKETS) == len(STEP_DURATION_BOUNDS) + 1

SNAP = Snapshot(
    t=1_700_000_123.5,
    world_size=2,
    ranks=(
        RankView(
            rank=1,
            host="fss-h1",
            job="run-7",
            pid=4242,
            step=17,
            steps_total=2,
            step_seconds_total=30.0,
            wait_seconds_total=20.0,
            step_buckets=STEP_BUCKETS,
            tx_bytes_total=5_000,
            rx_bytes_total=7_000,
            srtt_us=3500.0,
            retrans_total=4,
            retrans_spurious_total=3,
            state="flagged",
            cause="network",
            score=3.25,
            coll_count_total={"all_gather": 3},
            coll_bytes_total={"all_gather": 3_600},
            coll_seconds_total={"all_gather": 1.5},
            # waits of 0.4 ms, 0.75 s and 0.7496 s
            coll_wait_buckets={"all_gather": (1,) + (0,) * 9 + (2,) + (0,) * 5},
        ),
        RankView(rank=0, host="fss-h0", job="run-7", pid=4241),
    ),
    peers=(
        PeerView(rank=0, peer_rank=1, tx_bytes_total=100, rx_bytes_total=200, srtt_us=2000.0),
        PeerView(
            rank=1,
            peer_rank=0,
            tx_bytes_total=300,
            rx_bytes_total=400,
            retrans_total=2,
            retrans_spurious_total=1,
        ),
    ),
    verdicts_total={"network": 1},
    records_total={"step": 36, "coll": 108},
    ingest_messages_total={"accepted": 144, "malformed_json": 3, "refused": 2},
    stream_refused_total={"clock_ahead": 3, "step_ahead": 1},
    clock_resets_total=2,
    evictions_total={"pair": 5, "op": 0},
    thread_restarts_total={"ingest": 1},
    trace_write_errors_total={"trace": 1, "verdicts": 0},
    trace_records_lost_total={"trace": 40, "verdicts": 0},
    events_lost_total={"map_eviction": 7, "tracepoint_miss": 0},
    bpf_programs=(BpfProgramView("tracepoint__sock__sock_send_length", 1000, 2_500_000),),
    rdma_ports=(RdmaPortView("fss-h1", "mlx5_0", 1, 4096, 8192, {"symbol_error": 2}),),
    nccl=(NcclView("fss-h1", 1, "all_reduce", 12, 4800), NcclView("fss-h9", None, "send", 1, 8)),
    remediation=(RemediationView("fss-h1", "eth0", True), RemediationView("fss-h0", "eth0", False)),
)

H0 = {"job": "run-7", "rank": "0", "host": "fss-h0"}
H1 = {"job": "run-7", "rank": "1", "host": "fss-h1"}


def _le_rows(name: str, labels: dict[str, str], bounds: tuple[float, ...], counts: tuple[int, ...]):
    run = 0
    rows = []
    for b, n in zip([*bounds, float("inf")], counts, strict=True):
        run += n
        le = "+Inf" if b == float("inf") else repr(float(b))
        rows.append((name + "_bucket", {**labels, "le": le}, float(run)))
    return rows


#: (sample name, labels, value), each worked out by hand from SNAP.
EXPECTED = [
    ("fsdp_sentinel_step", H1, 17.0),
    *_le_rows("fsdp_sentinel_step_duration_seconds", H1, STEP_DURATION_BOUNDS, STEP_BUCKETS),
    ("fsdp_sentinel_step_duration_seconds_count", H1, 2.0),
    ("fsdp_sentinel_step_duration_seconds_sum", H1, 30.0),
    ("fsdp_sentinel_compute_seconds_total", H1, 10.0),
    ("fsdp_sentinel_wait_seconds_total", H1, 20.0),
    *_le_rows(
        "fsdp_sentinel_collective_wait_seconds",
        {**H1, "op": "all_gather"},
        COLLECTIVE_WAIT_BOUNDS,
        (1,) + (0,) * 9 + (2,) + (0,) * 5,
    ),
    ("fsdp_sentinel_collective_wait_seconds_count", {**H1, "op": "all_gather"}, 3.0),
    ("fsdp_sentinel_collective_wait_seconds_sum", {**H1, "op": "all_gather"}, 1.5),
    ("fsdp_sentinel_collective_bytes_total", {**H1, "op": "all_gather"}, 3600.0),
    *[
        ("fsdp_sentinel_straggler", {**h, "cause": c}, 1.0 if (h is H1 and c == "network") else 0.0)
        for h in (H0, H1)
        for c in ("compute", "network", "rank_lost", "hang")
    ],
    ("fsdp_sentinel_straggler_srtt_ratio", H1, 3.25),
    ("fsdp_sentinel_verdicts_total", {"cause": "compute"}, 0.0),
    ("fsdp_sentinel_verdicts_total", {"cause": "network"}, 1.0),
    ("fsdp_sentinel_verdicts_total", {"cause": "rank_lost"}, 0.0),
    ("fsdp_sentinel_verdicts_total", {"cause": "hang"}, 0.0),
    ("fsdp_sentinel_srtt_seconds", H1, 0.0035),
    ("fsdp_sentinel_retransmits_total", H0, 0.0),
    ("fsdp_sentinel_retransmits_total", H1, 4.0),
    ("fsdp_sentinel_retransmits_spurious_total", H0, 0.0),
    ("fsdp_sentinel_retransmits_spurious_total", H1, 3.0),
    ("fsdp_sentinel_network_bytes_total", {**H0, "direction": "tx"}, 0.0),
    ("fsdp_sentinel_network_bytes_total", {**H0, "direction": "rx"}, 0.0),
    ("fsdp_sentinel_network_bytes_total", {**H1, "direction": "tx"}, 5000.0),
    ("fsdp_sentinel_network_bytes_total", {**H1, "direction": "rx"}, 7000.0),
    ("fsdp_sentinel_flow_bytes_total", {**H0, "peer_rank": "1", "direction": "tx"}, 100.0),
    ("fsdp_sentinel_flow_bytes_total", {**H0, "peer_rank": "1", "direction": "rx"}, 200.0),
    ("fsdp_sentinel_flow_bytes_total", {**H1, "peer_rank": "0", "direction": "tx"}, 300.0),
    ("fsdp_sentinel_flow_bytes_total", {**H1, "peer_rank": "0", "direction": "rx"}, 400.0),
    ("fsdp_sentinel_flow_srtt_seconds", {**H0, "peer_rank": "1"}, 0.002),
    ("fsdp_sentinel_flow_retransmits_total", {**H0, "peer_rank": "1"}, 0.0),
    ("fsdp_sentinel_flow_retransmits_total", {**H1, "peer_rank": "0"}, 2.0),
    ("fsdp_sentinel_flow_retransmits_spurious_total", {**H0, "peer_rank": "1"}, 0.0),
    ("fsdp_sentinel_flow_retransmits_spurious_total", {**H1, "peer_rank": "0"}, 1.0),
    *[
        (
            "fsdp_sentinel_rdma_port_bytes_total",
            {"host": "fss-h1", "dev": "mlx5_0", "rdma_port": "1", "direction": d},
            v,
        )  # fmt: skip
        for d, v in (("tx", 4096.0), ("rx", 8192.0))
    ],
    (
        "fsdp_sentinel_rdma_port_errors_total",
        {"host": "fss-h1", "dev": "mlx5_0", "rdma_port": "1", "counter": "symbol_error"},
        2.0,
    ),  # fmt: skip
    ("fsdp_sentinel_nccl_calls_total", {**H1, "op": "all_reduce"}, 12.0),
    ("fsdp_sentinel_nccl_bytes_total", {**H1, "op": "all_reduce"}, 4800.0),
    (
        "fsdp_sentinel_nccl_calls_total",
        {"job": "", "rank": "", "host": "fss-h9", "op": "send"},
        1.0,
    ),
    (
        "fsdp_sentinel_nccl_bytes_total",
        {"job": "", "rank": "", "host": "fss-h9", "op": "send"},
        8.0,
    ),
    ("fsdp_sentinel_remediation_active", {"host": "fss-h0", "dev": "eth0"}, 0.0),
    ("fsdp_sentinel_remediation_active", {"host": "fss-h1", "dev": "eth0"}, 1.0),
    ("fsdp_sentinel_records_total", {"kind": "coll"}, 108.0),
    ("fsdp_sentinel_records_total", {"kind": "step"}, 36.0),
    ("fsdp_sentinel_ingest_messages_total", {"result": "accepted"}, 144.0),
    ("fsdp_sentinel_ingest_messages_total", {"result": "malformed_json"}, 3.0),
    ("fsdp_sentinel_ingest_messages_total", {"result": "refused"}, 2.0),
    ("fsdp_sentinel_stream_refused_total", {"result": "clock_ahead"}, 3.0),
    ("fsdp_sentinel_stream_refused_total", {"result": "step_ahead"}, 1.0),
    ("fsdp_sentinel_clock_resets_total", {}, 2.0),
    ("fsdp_sentinel_thread_restarts_total", {"thread": "ingest"}, 1.0),
    ("fsdp_sentinel_trace_write_errors_total", {"output": "trace"}, 1.0),
    ("fsdp_sentinel_trace_write_errors_total", {"output": "verdicts"}, 0.0),
    ("fsdp_sentinel_trace_records_lost_total", {"output": "trace"}, 40.0),
    ("fsdp_sentinel_trace_records_lost_total", {"output": "verdicts"}, 0.0),
    ("fsdp_sentinel_state_evictions_total", {"kind": "op"}, 0.0),
    ("fsdp_sentinel_state_evictions_total", {"kind": "pair"}, 5.0),
    ("fsdp_sentinel_events_lost_total", {"source": "map_eviction"}, 7.0),
    ("fsdp_sentinel_events_lost_total", {"source": "tracepoint_miss"}, 0.0),
    (
        "fsdp_sentinel_bpf_program_runs_total",
        {"program": "tracepoint__sock__sock_send_length"},
        1000.0,
    ),
    (
        "fsdp_sentinel_bpf_program_run_seconds_total",
        {"program": "tracepoint__sock__sock_send_length"},
        0.0025,
    ),  # fmt: skip
    ("fsdp_sentinel_world_size", {"job": "run-7"}, 2.0),
    ("fsdp_sentinel_rank_series_folded", {}, 0.0),
    ("fsdp_sentinel_last_record_timestamp_seconds", {}, 1_700_000_123.5),
    ("fsdp_sentinel_build_info", {"version": __version__}, 1.0),
]


def text_of(snap: Snapshot) -> str:
    return generate_latest(build_registry(lambda: snap, process=False)).decode()


def scrape(snap: Snapshot) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text_of(snap))
        for s in fam.samples
    ]


def _key(x: tuple[str, dict[str, str], float]) -> tuple[str, list[tuple[str, str]]]:
    return (x[0], sorted(x[1].items()))


def test_every_sample_matches_the_table() -> None:
    assert sorted(scrape(SNAP), key=_key) == sorted(EXPECTED, key=_key)


def test_openmetrics_reads_back_the_same_samples() -> None:
    text = generate_openmetrics(build_registry(lambda: SNAP, process=False)).decode()
    assert text.endswith("# EOF\n")
    fams = list(parse_openmetrics(text))  # raises on clashing names, bad units, bad buckets
    got = [(s.name, dict(s.labels), s.value) for f in fams for s in f.samples]
    # OpenMetrics adds nothing but names counters' samples the same way.
    assert sorted(got, key=_key) == sorted(EXPECTED, key=_key)
    types = {f.name: f.type for f in fams}
    assert types["fsdp_sentinel_step_duration_seconds"] == "histogram"
    assert types["fsdp_sentinel_build_info"] == "gauge"
    units = {f.name: f.unit for f in fams}
    assert units["fsdp_sentinel_collective_wait_seconds"] == "seconds"


def test_absent_figures_give_no_sample() -> None:
    names = {(n, tuple(sorted(lab.items()))) for n, lab, _ in scrape(SNAP)}
    # rank 0 has no step, srtt, histogram or score yet: no sample rather than a fake 0.
    for name in ("step", "srtt_seconds", "step_duration_seconds_count", "wait_seconds_total"):
        assert ("fsdp_sentinel_" + name, tuple(sorted(H0.items()))) not in names


def test_names_units_and_labels_follow_the_conventions() -> None:
    allowed = {"job", "rank", "peer_rank", "host", "op", "cause", "direction", "dev", "le",
               "kind", "result", "source", "program", "rdma_port", "counter", "version", "thread",
               "output"}  # fmt: skip
    fams = list(text_string_to_metric_families(text_of(SNAP)))
    for fam in fams:
        assert fam.name.startswith("fsdp_sentinel_")
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples)
        for s in fam.samples:
            assert set(s.labels) <= allowed, s
            if "rank" in s.labels:
                assert {"job", "host"} <= set(s.labels), s
    assert not re.search(r"\b(pid|port|step|time)=", text_of(SNAP))


def test_one_score_family_per_cause() -> None:
    def scores(cause: str) -> set[str]:
        snap = Snapshot(ranks=(RankView(rank=0, state="flagged", cause=cause, score=2.0),))
        return {n for n, _, _ in scrape(snap) if n.endswith(("_ratio", "_silent_seconds"))}

    assert scores("compute") == {"fsdp_sentinel_straggler_relative_slowdown_ratio"}
    assert scores("network") == {"fsdp_sentinel_straggler_srtt_ratio"}
    assert scores("rank_lost") == {"fsdp_sentinel_rank_silent_seconds"}
    assert scores("hang") == set()


def test_collect_reads_a_fresh_snapshot_each_scrape() -> None:
    current = [Snapshot(records_total={"step": 1})]
    collector = SentinelCollector(lambda: current[0])

    def value() -> set[float]:
        return {s.value for f in collector.collect() if f.name == "fsdp_sentinel_records"
                for s in f.samples}  # fmt: skip

    first = value()
    current[0] = Snapshot(records_total={"step": 2})
    assert (first, value()) == ({1.0}, {2.0})


def test_registry_with_process_metrics() -> None:
    text = generate_latest(build_registry(Snapshot, process=True)).decode()
    assert "process_cpu_seconds_total" in text
    assert 'fsdp_sentinel_build_info{version="' in text


@pytest.mark.parametrize("state,cause", [("lost", "rank_lost"), ("flagged", "compute"),
                                         ("flagged", "hang")])  # fmt: skip
def test_straggler_series_follow_state(state: str, cause: str) -> None:
    snap = Snapshot(ranks=(RankView(rank=3, host="h", state=state, cause=cause),))
    on = {lab["cause"] for n, lab, v in scrape(snap) if n == "fsdp_sentinel_straggler" and v == 1}
    assert on == {cause}


def test_histograms_from_the_pipeline_match_the_records() -> None:
    recs, _ = generate(Scenario(steps=12))
    pipe = Pipeline()
    pipe.feed_many(recs)
    snap = pipe.snapshot()
    got = scrape(snap)
    summarised = {r.rank: r.step for r in snap.ranks}
    # Oracle: the step and coll records themselves, for the steps summarised.
    step_s: dict[int, list[float]] = defaultdict(list)
    for r in recs:
        if r["kind"] == "step" and r["step"] <= summarised[r["rank"]]:
            step_s[r["rank"]].append(r["end"] - r["start"])
    assert step_s
    for rank, durations in step_s.items():
        labels = {n: lab for n, lab, _ in got if lab.get("rank") == str(rank)}
        base = {k: v for k, v in labels["fsdp_sentinel_step_duration_seconds_count"].items()}
        count = dict(((n, lab.get("le")), v) for n, lab, v in got if lab.get("rank") == str(rank)
                     and n.startswith("fsdp_sentinel_step_duration"))  # fmt: skip
        assert count[("fsdp_sentinel_step_duration_seconds_count", None)] == len(durations)
        assert count[("fsdp_sentinel_step_duration_seconds_sum", None)] == pytest.approx(
            sum(durations)
        )
        for b in STEP_DURATION_BOUNDS:
            want = sum(1 for d in durations if d <= b)
            assert count[("fsdp_sentinel_step_duration_seconds_bucket", repr(b))] == want, b
        assert base["host"] and "job" in base
    # Every summarised collective is in exactly one wait bucket of its op.
    colls = sum(r.coll_count_total.get(op, 0) for r in snap.ranks for op in r.coll_count_total)
    inf = sum(v for n, lab, v in got
              if n == "fsdp_sentinel_collective_wait_seconds_bucket" and lab["le"] == "+Inf")  # fmt: skip
    assert colls > 0 and inf == colls
