"""The Prometheus collector over a fixed Snapshot: a table of expected samples.

The exposition text is produced by prometheus_client and parsed back with its
own text parser, so the test checks what a scraper would read.
"""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fsdp_sentinel.exporters.prometheus import SentinelCollector, build_registry
from fsdp_sentinel.snapshot import PeerView, RankView, Snapshot

SNAP = Snapshot(
    t=1_700_000_123.5,
    world_size=2,
    ranks=(
        RankView(
            rank=1,
            host="fss-h1",
            pid=4242,
            step=17,
            step_seconds=2.5,
            compute_seconds=0.5,
            wait_seconds=2.0,
            steps_total=18,
            step_seconds_total=30.0,
            tx_bytes_total=5_000,
            rx_bytes_total=7_000,
            tx_rate=1e6,
            srtt_us=3500.0,
            retrans_total=4,
            state="flagged",
            cause="network",
            score=3.25,
            coll_count_total={"all_gather": 36, "reduce_scatter": 18},
            coll_bytes_total={"all_gather": 3_600, "reduce_scatter": 1_800},
            coll_seconds_total={"all_gather": 12.0, "reduce_scatter": 6.0},
        ),
        RankView(rank=0, host="fss-h0", pid=4241, steps_total=18, step_seconds_total=29.0),
    ),
    peers=(
        PeerView(rank=0, peer_rank=1, tx_bytes_total=100, rx_bytes_total=200, srtt_us=2000.0),
        PeerView(rank=1, peer_rank=0, tx_bytes_total=300, rx_bytes_total=400, retrans_total=2),
    ),
    verdicts_total={"network": 1},
    records_total={"step": 36, "coll": 108},
    ingest_dropped_total=5,
    ingest_malformed_total=3,
)

H0 = {"rank": "0", "host": "fss-h0"}
H1 = {"rank": "1", "host": "fss-h1"}

#: (sample name, labels, value), each independently worked out from SNAP.
EXPECTED = [
    ("fsdp_sentinel_step", H1, 17.0),
    ("fsdp_sentinel_step_seconds", H1, 2.5),
    ("fsdp_sentinel_compute_seconds", H1, 0.5),
    ("fsdp_sentinel_wait_seconds", H1, 2.0),
    ("fsdp_sentinel_srtt_seconds", H1, 0.0035),
    ("fsdp_sentinel_steps_total", H0, 18.0),
    ("fsdp_sentinel_steps_total", H1, 18.0),
    ("fsdp_sentinel_step_seconds_total", H0, 29.0),
    ("fsdp_sentinel_step_seconds_total", H1, 30.0),
    ("fsdp_sentinel_retransmits_total", H0, 0.0),
    ("fsdp_sentinel_retransmits_total", H1, 4.0),
    ("fsdp_sentinel_straggler_score", H1, 3.25),
    ("fsdp_sentinel_collectives_total", {**H1, "op": "all_gather"}, 36.0),
    ("fsdp_sentinel_collectives_total", {**H1, "op": "reduce_scatter"}, 18.0),
    ("fsdp_sentinel_collective_bytes_total", {**H1, "op": "all_gather"}, 3600.0),
    ("fsdp_sentinel_collective_bytes_total", {**H1, "op": "reduce_scatter"}, 1800.0),
    ("fsdp_sentinel_collective_seconds_total", {**H1, "op": "all_gather"}, 12.0),
    ("fsdp_sentinel_collective_seconds_total", {**H1, "op": "reduce_scatter"}, 6.0),
    ("fsdp_sentinel_network_bytes_total", {**H0, "direction": "tx"}, 0.0),
    ("fsdp_sentinel_network_bytes_total", {**H0, "direction": "rx"}, 0.0),
    ("fsdp_sentinel_network_bytes_total", {**H1, "direction": "tx"}, 5000.0),
    ("fsdp_sentinel_network_bytes_total", {**H1, "direction": "rx"}, 7000.0),
    ("fsdp_sentinel_straggler", {**H0, "cause": "compute"}, 0.0),
    ("fsdp_sentinel_straggler", {**H0, "cause": "network"}, 0.0),
    ("fsdp_sentinel_straggler", {**H0, "cause": "rank_lost"}, 0.0),
    ("fsdp_sentinel_straggler", {**H1, "cause": "compute"}, 0.0),
    ("fsdp_sentinel_straggler", {**H1, "cause": "network"}, 1.0),
    ("fsdp_sentinel_straggler", {**H1, "cause": "rank_lost"}, 0.0),
    ("fsdp_sentinel_rank_lost", H0, 0.0),
    ("fsdp_sentinel_rank_lost", H1, 0.0),
    ("fsdp_sentinel_flow_bytes_total", {"rank": "0", "peer_rank": "1", "direction": "tx"}, 100.0),
    ("fsdp_sentinel_flow_bytes_total", {"rank": "0", "peer_rank": "1", "direction": "rx"}, 200.0),
    ("fsdp_sentinel_flow_bytes_total", {"rank": "1", "peer_rank": "0", "direction": "tx"}, 300.0),
    ("fsdp_sentinel_flow_bytes_total", {"rank": "1", "peer_rank": "0", "direction": "rx"}, 400.0),
    ("fsdp_sentinel_flow_srtt_seconds", {"rank": "0", "peer_rank": "1"}, 0.002),
    ("fsdp_sentinel_flow_retransmits_total", {"rank": "0", "peer_rank": "1"}, 0.0),
    ("fsdp_sentinel_flow_retransmits_total", {"rank": "1", "peer_rank": "0"}, 2.0),
    ("fsdp_sentinel_verdicts_total", {"cause": "compute"}, 0.0),
    ("fsdp_sentinel_verdicts_total", {"cause": "network"}, 1.0),
    ("fsdp_sentinel_verdicts_total", {"cause": "rank_lost"}, 0.0),
    ("fsdp_sentinel_records_total", {}, 144.0),
    ("fsdp_sentinel_ingest_dropped_total", {}, 5.0),
    ("fsdp_sentinel_ingest_malformed_total", {}, 3.0),
    ("fsdp_sentinel_world_size", {}, 2.0),
    ("fsdp_sentinel_last_record_timestamp_seconds", {}, 1_700_000_123.5),
]


def scrape(snap: Snapshot) -> list[tuple[str, dict[str, str], float]]:
    text = generate_latest(build_registry(lambda: snap, process=False)).decode()
    return [
        (s.name, dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def test_every_sample_matches_the_table() -> None:
    got = scrape(SNAP)
    key = lambda x: (x[0], sorted(x[1].items()))  # noqa: E731
    assert sorted(got, key=key) == sorted(EXPECTED, key=key)


def test_absent_figures_give_no_sample() -> None:
    names = {(n, tuple(sorted(lab.items()))) for n, lab, _ in scrape(SNAP)}
    # rank 0 has no step, srtt or score yet: no sample rather than a fake 0.
    for name in ("step_seconds", "srtt_seconds", "straggler_score", "step"):
        assert ("fsdp_sentinel_" + name, tuple(sorted(H0.items()))) not in names
    # the 1 -> 0 peer has no srtt yet
    assert not any(
        n == "fsdp_sentinel_flow_srtt_seconds" and dict(lab)["rank"] == "1" for n, lab in names
    )


def test_names_units_and_labels_follow_the_conventions() -> None:
    allowed = {"rank", "peer_rank", "host", "op", "cause", "direction", "dev"}
    text = generate_latest(build_registry(lambda: SNAP, process=False)).decode()
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("fsdp_sentinel_")
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples)
        for s in fam.samples:
            assert set(s.labels) <= allowed, s
    assert not re.search(r"pid|port|step=", text.split("# HELP")[0])


def test_collect_reads_a_fresh_snapshot_each_scrape() -> None:
    current = [Snapshot(ranks=(RankView(rank=0, steps_total=1),))]
    collector = SentinelCollector(lambda: current[0])
    first = {
        s.value for f in collector.collect() if f.name == "fsdp_sentinel_steps" for s in f.samples
    }
    current[0] = Snapshot(ranks=(RankView(rank=0, steps_total=2),))
    second = {
        s.value for f in collector.collect() if f.name == "fsdp_sentinel_steps" for s in f.samples
    }
    assert (first, second) == ({1.0}, {2.0})


def test_registry_with_process_metrics() -> None:
    text = generate_latest(build_registry(Snapshot, process=True)).decode()
    assert "process_cpu_seconds_total" in text
    assert "fsdp_sentinel_records_total 0.0" in text


@pytest.mark.parametrize("state,cause", [("lost", "rank_lost"), ("flagged", "compute")])
def test_straggler_series_follow_state(state: str, cause: str) -> None:
    snap = Snapshot(ranks=(RankView(rank=3, host="h", state=state, cause=cause),))
    on = {lab["cause"] for n, lab, v in scrape(snap) if n == "fsdp_sentinel_straggler" and v == 1}
    assert on == {cause}
    lost = [v for n, _, v in scrape(snap) if n == "fsdp_sentinel_rank_lost"]
    assert lost == [1.0 if state == "lost" else 0.0]
