"""A list at a time or one at a time: the same records give the same verdicts.

Replay feeds a pipeline (or the job router) each decompressed piece of a
trace as one list (``feed_batch``), which files runs of ``coll`` records in
one call (``Correlator.add_coll_run``), runs of ``flow`` records in another
(``Pipeline.file_flows``), and hands every other record to ``feed``. These tests hold it to exactly what ``feed`` does record by record:
verdicts, counters and per-rank state, on every golden trace and on streams
built to leave the fast path at every turn (the stream guard, ill-typed and
late records, the per-step cap, two jobs at once, a job's restart).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fsdp_sentinel import trace
from fsdp_sentinel.correlate import StateLimits
from fsdp_sentinel.jobs import JobRouter
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.stream import StreamConfig
from fsdp_sentinel.synth import Scenario, SlowCompute, generate

Record = dict[str, Any]
TRACES = Path(__file__).parent / "traces"
GOLDEN = sorted(TRACES.glob("*.jsonl*"))


def one_at_a_time(feeder: Any, recs: list[Record]) -> list[Record]:
    out: list[Record] = []
    for rec in recs:
        out.extend(feeder.feed(rec))
    out.extend(feeder.end())
    return out


def in_lists(feeder: Any, recs: list[Record], size: int) -> list[Record]:
    out: list[Record] = []
    for i in range(0, len(recs), size):
        out.extend(feeder.feed_batch(recs[i : i + size]))
    out.extend(feeder.end())
    return out


def state(feeder: Any) -> str:
    """What a consumer can read of a feeder afterwards, as one comparable text."""
    pipes = [j.pipeline for j in feeder.all_jobs()] if isinstance(feeder, JobRouter) else [feeder]
    per_rank = [
        (r, rs.last_t, rs.done_step, rs.max_coll_step, dict(rs.coll_count), rs.steps_total)
        for p in pipes
        for r, rs in sorted(p.corr.ranks.items())
    ]
    pairs = [
        (k, pf.tx_total, pf.rx_total, pf.retrans_total, list(pf.samples), pf.last_t)
        for p in pipes
        for k, pf in sorted(p.corr.pairs.items())
    ]
    hosts = [(sorted(p.corr.hosts_heard.items()), p.corr.unattributed_flows) for p in pipes]
    return json.dumps(
        [
            feeder.stats,
            feeder.records_total,
            per_rank,
            pairs,
            hosts,
            [(p.now, p.corr.evicted) for p in pipes],
        ],
        sort_keys=True,
        default=str,
    )


def same_both_ways(make: Any, recs: list[Record], sizes: tuple[int, ...] = (1, 7, 4096)) -> None:
    a = make()
    want = json.dumps(one_at_a_time(a, [dict(r) for r in recs]), sort_keys=True)
    for size in sizes:
        b = make()
        got = json.dumps(in_lists(b, [dict(r) for r in recs], size), sort_keys=True)
        assert got == want, f"verdicts differ in lists of {size}"
        assert state(b) == state(a), f"state differs in lists of {size}"


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.name)
def test_every_golden_trace_gives_the_same_verdicts_in_lists(path: Path) -> None:
    recs = list(trace.TraceReader(path))
    assert any(r.get("kind") == "coll" for r in recs)
    same_both_ways(JobRouter, recs, sizes=(4096,))
    same_both_ways(Pipeline, recs, sizes=(4096,))


def job(**kw: Any) -> list[Record]:
    faults = (SlowCompute(rank=2, factor=3.0, start=8, end=30),)
    return generate(Scenario(steps=30, faults=faults, daemon_clock=True, **kw))[0]


def colls_at(recs: list[Record], step: int) -> list[int]:
    return [i for i, r in enumerate(recs) if r["kind"] == "coll" and r["step"] == step]


def hostile(recs: list[Record]) -> list[Record]:
    """``recs`` with a record of every kind that must leave the fast path."""
    out = [dict(r) for r in recs]
    i = colls_at(out, 12)[5]
    bad = [
        {**out[i], "end": "soon"},  # ill-typed time
        {**out[i], "rank": [1]},  # unhashable rank
        {k: v for k, v in out[i].items() if k != "step"},  # no step
        {**out[i], "end": out[i]["end"] + 3600.0},  # an hour ahead: the guard holds it
        {**out[i], "step": out[i]["step"] + 10**6},  # a step far ahead: refused
        {**out[i], "rank": 99},  # a rank nobody announced
        dict(out[i]),  # delivered twice
    ]
    late = {**out[colls_at(out, 3)[0]]}  # step 3 is long summarised by step 20
    j = colls_at(out, 20)[0]
    return out[:i] + bad + out[i:j] + [late] + out[j:]


@pytest.mark.parametrize("make", [Pipeline, JobRouter], ids=["pipeline", "router"])
def test_records_that_leave_the_fast_path_give_the_same_verdicts(make: Any) -> None:
    recs = hostile(job())
    same_both_ways(make, recs)
    # The straggler is still found through all of it (the stream is still judged).
    verdicts = in_lists(make(), [dict(r) for r in recs], 512)
    assert (2, "compute") in {(v["rank"], v["cause"]) for v in verdicts if v["state"] == "flagged"}
    pipe = make()
    pipe.feed_batch([dict(r) for r in recs])
    assert pipe.stats["malformed"] >= 3 and pipe.stats["late"] >= 1


def test_flows_that_leave_the_fast_path_give_the_same_verdicts() -> None:
    # Flow records come in runs (Pipeline.file_flows): each bad one, one due
    # a tick or the guard, is left to feed, or counted as feed counts it.
    recs = [dict(r) for r in job()]
    flows = [i for i, r in enumerate(recs) if r["kind"] == "flow"]
    f = recs[flows[40]]
    bad = [
        {**f, "t": "soon"},  # ill-typed time
        {**f, "t": True},  # a bool is not a time here
        {**f, "tx_bytes": "many"},  # its host heard, then malformed
        {k: v for k, v in f.items() if k != "src"},  # no source
        {**f, "t": f["t"] + 3600.0},  # an hour ahead: the guard holds it
        {**f, "pid": 4242},  # a process of no rank: unattributed
        {**f, "dst": "203.0.113.9:1"},  # a peer of no rank
        dict(f),  # delivered twice
    ]
    recs = recs[: flows[40]] + bad + recs[flows[40] :]
    # A guard horizon nearer than the next tick (3 s is the default, a tick
    # 0.5 s): the horizon then stops a run too.
    near = StreamConfig(ahead_s=0.2)
    for make in (Pipeline, JobRouter, lambda: Pipeline(stream=near)):
        same_both_ways(make, recs)
    pipe = Pipeline()
    pipe.feed_batch([dict(r) for r in recs])
    assert pipe.stats["malformed"] >= 3 and pipe.corr.unattributed_flows >= 2
    assert pipe.corr.pairs


def test_the_per_step_cap_is_kept_in_lists() -> None:
    limits = StateLimits(max_colls_per_step=5)
    recs = job(n_coll=12)
    same_both_ways(lambda: Pipeline(limits=limits), recs)
    pipe = Pipeline(limits=limits)
    pipe.feed_batch([dict(r) for r in recs])
    assert pipe.corr.evicted["coll"] > 0


def test_two_jobs_and_a_restart_through_the_router_in_lists() -> None:
    a = job(seed=1)
    b = job(seed=2)
    for rec in b:
        if "pid" in rec:
            rec["pid"] += 5000
        if rec["kind"] == "rank":
            rec["job"] = "b"
    # Job b's ranks carry host_pid (as through the ingest socket); a's do not.
    pids = {r["rank"]: r["pid"] for r in b if r["kind"] == "rank"}
    for rec in b:
        if rec["kind"] in ("rank", "step", "coll", "pending"):
            rec["host_pid"] = pids[rec["rank"]]
    both = sorted(a + b, key=trace.record_time)
    # A restart of job a halfway: its ranks announce themselves again with new pids.
    half = len(both) // 2
    again = [
        {**r, "pid": r["pid"] + 100, "t": trace.record_time(both[half])}
        for r in a
        if r["kind"] == "rank"
    ]
    stream = both[:half] + again + both[half:]
    same_both_ways(JobRouter, stream)
    router = JobRouter()
    router.feed_batch([dict(r) for r in stream])
    assert router.stats["jobs"] >= 3


def test_a_strict_reader_gives_the_records_before_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = [trace.header(), *job()[:50]]
    lines = [json.dumps(r) for r in good]
    path.write_text("\n".join([*lines[:30], "{not json", *lines[30:]]) + "\n")
    seen: list[Record] = []
    with pytest.raises(trace.TraceError, match=r"bad\.jsonl:31: invalid JSON"):
        for rec in trace.TraceReader(path):
            seen.append(rec)
    assert seen == good[:30]
    # Lenient: the bad line skipped and counted, the rest read, in pieces or not.
    lenient = trace.TraceReader(path, strict=False)
    assert [r for b in lenient.batches() for r in b] == good
    assert lenient.skipped == 1 and lenient.skipped_lines == [31]


def test_wait_histogram_counts_by_bucket_as_by_value() -> None:
    """The per-op wait histogram adds a step's waits bucket by bucket
    (``correlate._count_into``); each wait lands where ``bisect_left`` puts it."""
    import random
    from bisect import bisect_left

    from fsdp_sentinel import buckets, correlate

    bounds = correlate._WAIT_BOUNDS
    rnd = random.Random(7)
    for _ in range(2000):
        values = [
            rnd.choice([rnd.expovariate(20.0), rnd.choice(bounds), -rnd.random(), 99.0, 0.0])
            for _ in range(rnd.randint(0, 40))
        ]
        by_value = buckets.empty(bounds)
        for x in values:
            by_value[bisect_left(bounds, x)] += 1
        by_bucket = buckets.empty(bounds)
        correlate._count_into(by_bucket, values)
        assert by_bucket == by_value
