"""Pipeline: the snapshot it publishes, its stream clock, and its counters.

Totals are checked against sums computed here straight from the records.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from fsdp_sentinel import synth, trace
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.snapshot import Snapshot


def test_snapshot_totals_match_the_records() -> None:
    scn = synth.Scenario(ranks=4, steps=30, faults=(synth.SlowCompute(3, 1.6, 10, 30),))
    recs, _ = synth.generate(scn)
    pipe = Pipeline()
    pipe.feed_many(recs)
    snap = pipe.snapshot()

    steps: dict[int, int] = defaultdict(int)
    coll_n: dict[int, int] = defaultdict(int)
    tx: dict[int, int] = defaultdict(int)
    for rec in recs:
        if rec["kind"] == "step":
            steps[rec["rank"]] += 1
        elif rec["kind"] == "coll":
            coll_n[rec["rank"]] += 1
        elif rec["kind"] == "flow":
            tx[int(rec["host"].rsplit("h", 1)[1])] += rec["tx_bytes"]
    by = {rv.rank: rv for rv in snap.ranks}
    assert sorted(by) == [0, 1, 2, 3]
    for r in range(4):
        assert by[r].steps_total == steps[r]
        assert sum(by[r].coll_count_total.values()) == coll_n[r]
        assert by[r].tx_bytes_total == tx[r]
        assert by[r].host == f"synth-h{r}" and by[r].pid == 10000 + r
    assert (by[3].state, by[3].cause) == ("flagged", "compute")
    assert by[0].state == "ok" and by[0].cause is None
    assert snap.verdicts_total == {"compute": 1}
    assert snap.world_size == 4
    assert snap.records_total["coll"] == sum(coll_n.values())
    assert snap.t == max(trace.record_time(rec) for rec in recs)
    # Peers: ring flows r -> r+1 carry the data.
    pairs = {(p.rank, p.peer_rank): p for p in snap.peers}
    assert pairs[(0, 1)].tx_bytes_total > 0 and pairs[(0, 1)].srtt_us is not None
    # It survives the JSON round trip the HTTP API does.
    assert Snapshot.from_json(snap.to_json()) == snap


def test_stream_clock_is_the_newest_record_time_only() -> None:
    pipe = Pipeline()
    pipe.feed(
        {
            "kind": "netdev",
            "t": 50.0,
            "dt": 1,
            "host": "h",
            "dev": "d",
            "tx_bytes": 0,
            "rx_bytes": 0,
        }
    )
    pipe.feed(
        {
            "kind": "netdev",
            "t": 40.0,
            "dt": 1,
            "host": "h",
            "dev": "d",
            "tx_bytes": 0,
            "rx_bytes": 0,
        }
    )
    assert pipe.now == 50.0
    assert pipe.snapshot().t == 50.0
    for k in range(10):
        pipe.feed(
            {
                "kind": "netdev",
                "t": 51.0 + k,
                "dt": 1,
                "host": "h",
                "dev": "d",
                "tx_bytes": 0,
                "rx_bytes": 0,
            }
        )
    assert (
        pipe.stats["ticks"] == 10
    )  # one liveness check per tick_s (0.5 s) of stream time, at most


def test_empty_pipeline_snapshot_is_empty() -> None:
    snap = Pipeline().snapshot()
    assert snap.ranks == () and snap.peers == () and snap.world_size is None


def test_records_delivered_twice_change_nothing() -> None:
    recs, _ = synth.generate(synth.Scenario(faults=(synth.SlowCompute(1, 1.5, 10, 30),)))
    twice = [r for rec in recs for r in (rec, dict(rec))]
    once = Pipeline()
    dup = Pipeline()
    a = once.feed_many(recs)
    b = dup.feed_many(twice)
    assert a and a == b
    sa, sb = once.snapshot(), dup.snapshot()
    assert [r.coll_count_total for r in sa.ranks] == [r.coll_count_total for r in sb.ranks]
    assert [r.steps_total for r in sa.ranks] == [r.steps_total for r in sb.ranks]


def test_a_step_summarised_at_a_tick_sees_liveness_as_read_then() -> None:
    """A tick hands its liveness to the steps it summarises at the same instant
    (``Correlator.held_liveness``): each such summary's liveness must be what a
    fresh read gives then, through lost ranks coming back (which forget their
    torn connections) too. Every golden capture, and the check must have run."""
    held = 0
    for path in sorted((Path(__file__).parent / "traces").glob("*.jsonl.zst")):
        pipe = Pipeline()
        corr = pipe.corr
        summarise = corr.step_summary

        def checked(
            step: int,
            now: float,
            corr: Any = corr,
            summarise: Any = summarise,
            name: str = path.name,
        ) -> Any:
            nonlocal held
            summary = summarise(step, now)
            if corr.held_liveness is not None:
                held += 1
                kept, corr.held_liveness = corr.held_liveness, None
                assert tuple(summary.liveness) == tuple(corr.liveness()), (name, step)
                corr.held_liveness = kept
            return summary

        corr.step_summary = checked  # type: ignore[method-assign]
        pipe.feed_many(list(trace.read_trace(path)))
        pipe.end()
    assert held >= 10, f"only {held} steps were summarised at a tick: the check barely ran"
