"""The report's figures from hand-made records whose answers are worked out by hand,
and from golden traces against the pipeline's own figures (they must agree)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.report.model import Phases, build
from fsdp_sentinel.trace import read_trace, record_time

TRACES = Path(__file__).parent / "traces"

T0 = 1_000.0


def rank(r: int, pid: int, addr: str, host: str = "root") -> dict:
    return {
        "kind": "rank",
        "t": T0,
        "rank": r,
        "world_size": 2,
        "host": host,
        "pid": pid,
        "addrs": [addr],
    }


def step(r: int, s: int, start: float, end: float) -> dict:
    return {"kind": "step", "rank": r, "step": s, "start": start, "end": end}


def coll(r: int, s: int, seq: int, issue: float, end: float) -> dict:
    return {
        "kind": "coll",
        "rank": r,
        "step": s,
        "seq": seq,
        "op": "all_gather",
        "bytes": 8,
        "issue": issue,
        "end": end,
    }


def flow(t: float, pid: int, src: str, dst: str, tx: int, rx: int = 0, **extra: object) -> dict:
    rec = {
        "kind": "flow",
        "t": t,
        "dt": 1.0,
        "host": "root",
        "pid": pid,
        "src": src,
        "dst": dst,
        "tx_bytes": tx,
        "rx_bytes": rx,
    }
    rec.update(extra)
    return rec


def verdict(t: float, r: int, state: str, s: int, cause: str = "network") -> dict:
    return {
        "kind": "verdict",
        "t": t,
        "step": s,
        "rank": r,
        "state": state,
        "cause": cause,
        "score": 2.0,
    }


def test_wait_is_the_union_of_the_steps_collectives_as_the_pipeline_counts_it() -> None:
    recs = [
        # two overlapping collectives 10.5..11.0 and 10.8..11.3 -> 0.8 s of
        # wait, and one of 11.5..11.7 -> 0.2 s more
        coll(0, 1, 0, T0 + 10.5, T0 + 11.0),
        coll(0, 1, 1, T0 + 10.8, T0 + 11.3),
        coll(0, 1, 2, T0 + 11.5, T0 + 11.7),
        step(0, 1, T0 + 10, T0 + 12),
        # a step record for a step already judged comes too late: not shown
        coll(0, 0, 3, T0 + 12.0, T0 + 12.5),
        step(0, 0, T0 + 11.9, T0 + 12.6),
    ]
    (row,) = build(recs).steps
    assert row.seconds == pytest.approx(2.0)
    assert row.wait == pytest.approx(1.0)
    assert row.compute == pytest.approx(1.0)
    assert row.colls == 3


def test_step_without_collectives_is_all_compute() -> None:
    (row,) = build([step(1, 0, T0, T0 + 0.5)]).steps
    assert (row.wait, row.compute) == (0.0, pytest.approx(0.5))


def test_flagged_spans_pair_flagged_with_cleared_and_stay_open_to_trace_end() -> None:
    recs = [
        step(0, 0, T0, T0 + 1),
        verdict(T0 + 2, 1, "flagged", 3),
        verdict(T0 + 2.5, 1, "flagged", 4),  # repeated flag: same span
        verdict(T0 + 5, 1, "cleared", 8),
        verdict(T0 + 6, 0, "flagged", 9, cause="compute"),
        step(0, 9, T0 + 8, T0 + 9),
    ]
    data = build(recs)
    spans = [(s.rank, s.cause, s.start, s.end, s.step, s.open) for s in data.spans]
    assert spans == [
        (1, "network", T0 + 2, T0 + 5, 3, False),
        (0, "compute", T0 + 6, T0 + 9, 9, True),
    ]
    assert [v["rank"] for v in data.first_flags()] == [1, 0]


def test_flows_map_to_rank_pairs_by_pid_and_address() -> None:
    recs = [
        rank(0, 100, "198.18.0.1"),
        rank(1, 101, "198.18.0.2"),
        # two connections 0 -> 1 in one poll: bytes add up (3 MB over 1 s)
        flow(T0 + 1, 100, "198.18.0.1:4000", "198.18.0.2:29500", 1_000_000, srtt_us=2000),
        flow(T0 + 1, 100, "198.18.0.1:4001", "198.18.0.2:29501", 2_000_000, srtt_us=4000),
        flow(T0 + 1, 101, "198.18.0.2:29500", "198.18.0.1:4000", 500_000, rx=7),
        # the flow's own rank fields win over the maps
        flow(T0 + 2, 999, "10.0.0.1:1", "10.0.0.2:2", 100, rank=1, peer_rank=0),
        # to an address no rank owns: cannot be mapped
        flow(T0 + 2, 100, "198.18.0.1:4002", "198.18.9.9:22", 5),
    ]
    data = build(recs)
    assert sorted(data.peers) == [(0, 1), (1, 0)]
    (p01,) = data.peers[(0, 1)]
    assert p01.tx_rate == pytest.approx(3_000_000)
    # weighted by bytes sent, as the detector weighs a pair's samples
    assert p01.srtt_us == pytest.approx((1 * 2000 + 2 * 4000) / 3)
    p10 = data.peers[(1, 0)]
    assert [(p.t, p.tx_rate, p.rx_rate) for p in p10] == [(T0 + 1, 500_000, 7), (T0 + 2, 100, 0)]
    assert data.flows_unmapped == 1


def test_pid_shared_by_two_ranks_maps_by_host_and_pid_only() -> None:
    # Ranks in separate pid namespaces may share a pid: the pid alone must not
    # map, and a flow from a host no rank announced is left out (the detector
    # leaves it out too, and the report shows what the detector saw).
    recs = [
        rank(0, 7, "198.18.0.1", host="a"),
        rank(1, 7, "198.18.0.2", host="b"),
        flow(T0 + 1, 7, "198.18.0.2:5", "198.18.0.1:6", 10, host="c"),
        flow(T0 + 1, 7, "198.18.0.2:5", "198.18.0.1:6", 10, host="b"),
    ]
    data = build(recs)
    assert list(data.peers) == [(1, 0)] and data.flows_unmapped == 1


def test_phases_split_steps_at_fault_onset_and_end() -> None:
    recs = [step(0, i, T0 + i, T0 + i + d) for i, d in enumerate([0.2, 0.2, 0.9, 1.1, 0.3, 0.3])]
    recs.append(
        {
            "kind": "fault",
            "t": T0 + 2,
            "end": T0 + 4,
            "host": "h",
            "rank": 0,
            "what": "x",
            "params": {},
        }
    )
    data = build(sorted(recs, key=record_time))
    # steps ending by 2.0: 0.2, 0.2; overlapping 2..4: 0.9, 1.1; starting at 4+: 0.3, 0.3
    got = data.phases()
    assert (got.before, got.during, got.after) == pytest.approx((0.2, 1.0, 0.3))


def test_empty_trace_builds() -> None:
    data = build([])
    assert data.steps == [] and data.peers == {} and data.world_size is None
    assert data.phases() == Phases(None, None, None)


def test_fault_end_from_end_step() -> None:
    # The trainer's own stall records say when they stop by step number.
    recs = [step(0, i, T0 + i, T0 + i + 0.5) for i in range(6)]
    recs.append(
        {
            "kind": "fault",
            "t": T0 + 2.1,
            "host": "h",
            "rank": 0,
            "what": "compute_stall",
            "params": {},
            "step": 2,
            "end_step": 4,
        }
    )
    data = build(sorted(recs, key=record_time))
    assert data.fault_end(data.faults[0]) == T0 + 4
    got = data.phases()
    assert (got.before, got.during, got.after) == pytest.approx((0.5, 0.5, 0.5))


def test_addresses_shared_by_ranks_do_not_map() -> None:
    # Two ranks on one host share its addresses: a flow's dst cannot name the peer.
    recs = [
        rank(0, 1, "192.0.2.2"),
        rank(1, 2, "192.0.2.2"),
        flow(T0 + 1, 1, "192.0.2.2:4000", "192.0.2.2:29500", 10),
    ]
    data = build(recs)
    assert data.peers == {} and data.flows_unmapped == 1


def test_onset_and_clear_records_of_one_fault_merge() -> None:
    onset = {"kind": "fault", "t": T0, "host": "h", "rank": 1, "what": "slow_link", "params": {}}
    other = {**onset, "rank": 2, "t": T0 + 1}
    cleared = {**onset, "end": T0 + 5, "end_step": 9}
    data = build([onset, other, cleared])
    assert data.faults == [cleared, other]


def test_trace_extent_covers_every_record_and_open_spans_reach_it() -> None:
    # After a rank dies only netdev records go on; an open span runs to the last one.
    recs = [
        step(0, 0, T0 + 1, T0 + 2),
        verdict(T0 + 3, 1, "flagged", 1, cause="rank_lost"),
        {
            "kind": "netdev",
            "t": T0 + 9,
            "dt": 1,
            "host": "h",
            "dev": "d",
            "tx_bytes": 0,
            "rx_bytes": 0,
        },
        {
            "kind": "fault",
            "t": T0 + 2.5,
            "end": T0 + 10,
            "host": "h",
            "rank": 1,
            "what": "x",
            "params": {},
        },
    ]
    data = build(recs)
    assert (data.t0, data.t1) == (T0 + 1, T0 + 10)
    (span,) = data.spans
    assert (span.start, span.end, span.open) == (T0 + 3, T0 + 10, True)


def test_an_open_straggler_span_ends_with_the_last_step_and_time_starts_at_the_first() -> None:
    # Probe samples from before the job and after its end frame the trace;
    # the page's time axis and an open compute span follow the job's steps.
    def netdev(t: float) -> dict:
        return {"kind": "netdev", "t": t, "dt": 1, "host": "h", "dev": "d",
                "tx_bytes": 0, "rx_bytes": 0}  # fmt: skip

    recs = [
        netdev(T0),
        step(0, 0, T0 + 5, T0 + 6),
        step(0, 1, T0 + 6, T0 + 7),
        verdict(T0 + 6.5, 0, "flagged", 1, cause="compute"),
        netdev(T0 + 30),
    ]
    data = build(recs)
    assert (data.t0, data.t1, data.origin, data.job_end()) == (T0, T0 + 30, T0 + 5, T0 + 7)
    (span,) = data.spans
    assert (span.start, span.end, span.open) == (T0 + 6.5, T0 + 7, True)
    from fsdp_sentinel.report import page

    html = page.render(data, ["t"])
    assert "rank 0 (open at end)" in html
    assert "first step (s)</text>" in html and "trace start" not in html


@pytest.mark.parametrize("name", ["slow_compute_4r", "lab-slow-link", "lab-rank-kill"])
def test_report_steps_and_verdicts_are_the_pipelines(name: str) -> None:
    path = TRACES / f"{name}.jsonl.zst"
    data = build(read_trace(path))
    # Independently: the detector's own scores (wait, compute) of each step.
    pipe = Pipeline()
    scored: dict[tuple[int, int], tuple[float | None, float | None]] = {}
    replayed: list[dict] = []
    for rec in read_trace(path):
        out = pipe.feed(rec)
        replayed.extend(out)
        rep = pipe.last_report
        if rep is not None and rep.step is not None:
            for sc in rep.scores:
                scored[(sc.rank, rep.step)] = (sc.wait_s, sc.compute_s)
    assert data.steps, "the trace has steps"
    judged = 0
    for row in data.steps:
        want = scored.get((row.rank, row.step))
        if want is None:
            continue  # a step of a rank the detector had already declared lost
        judged += 1
        assert row.wait == want[0]
        assert row.compute == pytest.approx(want[1], abs=1e-12)
    assert judged >= 0.9 * len(data.steps)
    recorded = [r for r in read_trace(path) if r.get("kind") == "verdict"]
    if recorded:  # a daemon capture: the report shows what the daemon said
        assert data.verdicts == sorted(recorded, key=lambda r: float(r["t"]))
        assert not data.verdicts_replayed
    else:
        assert data.verdicts_replayed and data.verdicts == sorted(
            replayed, key=lambda r: float(r["t"])
        )
