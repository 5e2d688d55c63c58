"""One pipeline per job (fsdp_sentinel.jobs): jobs on one node never mix.

A long-running node daemon sees jobs one after another and at once, each with
its own ranks 0..N-1, steps from 0 and pids. Synthetic jobs (fsdp_sentinel.synth)
are stamped the way the ingest socket stamps real ones (``host_pid``, the
sender's pid as the kernel gives it); the node's own records (``clock``,
``netdev``) are one stream shared by every job on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jobs_support import as_job, merged, shifted

from fsdp_sentinel import synth, trace
from fsdp_sentinel.detect import DetectConfig
from fsdp_sentinel.exporters.prometheus import families
from fsdp_sentinel.jobs import JobRouter
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.replay import replay_paths
from fsdp_sentinel.synth import Lost, Scenario, SlowCompute, SlowNetwork
from fsdp_sentinel.truth import judge, load_truth, truth_path

Record = dict[str, Any]
TRACES = Path(__file__).parent / "traces"


def dumps(verdicts: list[Record]) -> list[str]:
    return [json.dumps(v, sort_keys=True) for v in verdicts]


PAIRS = {
    "compute+compute": (
        Scenario(steps=30, faults=(SlowCompute(2, 1.8, 10, 30),), seed=1),
        Scenario(steps=30, faults=(SlowCompute(1, 1.8, 12, 30),), seed=2, compute_s=0.3),
    ),
    "network+clean": (
        Scenario(steps=30, faults=(SlowNetwork(3, 2.0, 10, 30),), seed=3, duplex=True),
        Scenario(steps=40, seed=4),
    ),
    "lost+compute": (
        Scenario(steps=30, faults=(Lost(1, 15),), seed=5, close_at_end=False),
        Scenario(steps=30, faults=(SlowCompute(0, 2.0, 8, 30),), seed=6, ranks=3),
    ),
}


@pytest.mark.parametrize("pair", PAIRS, ids=list(PAIRS))
def test_two_jobs_at_once_on_one_node_are_judged_as_each_alone(pair: str) -> None:
    (sa, sb) = PAIRS[pair]
    recs_a, truth_a = synth.generate(sa)
    recs_b, truth_b = synth.generate(sb)
    a, node_a = as_job(recs_a, "job-a", 20000)
    b, node_b = as_job(recs_b, "job-b", 30000, dt=7.3)  # overlapping in time
    node = merged(node_a, node_b)
    alone_a = JobRouter().feed_many(merged(a, node))
    alone_b = JobRouter().feed_many(merged(b, node))
    both = JobRouter()
    out = both.feed_many(merged(a, b, node))
    assert {v["job"] for v in out} <= {"job-a", "job-b"}
    assert dumps([v for v in out if v["job"] == "job-a"]) == dumps(alone_a)
    assert dumps([v for v in out if v["job"] == "job-b"]) == dumps(alone_b)
    # ... and each alone is judged right (so "the same" is not "equally wrong").
    for verdicts, truth in ((alone_a, truth_a), (alone_b, truth_b)):
        j = judge(verdicts, truth)
        assert not j.missed and not j.false, (j.missed, j.false)
    assert both.stats["late"] == 0 and both.stats["jobs"] == 2
    # Flows were routed by pid to their own job: every one attributed.
    assert both.stats["unattributed_flows"] == 0


def sequential(stamp: bool, ids: bool) -> tuple[list[Record], dict[str, Any]]:
    """The issue's case: a first job, then a second (new pids, steps from 0)."""
    first, _ = synth.generate(Scenario(steps=25, seed=7, close_at_end=True, tail_s=3.0))
    second, truth = synth.generate(Scenario(steps=30, faults=(SlowCompute(2, 1.8, 10, 30),),
                                            seed=8, close_at_end=True))  # fmt: skip
    end = max(trace.record_time(r) for r in first)
    a, node_a = as_job(first, "first" if ids else None, 20000, stamp=stamp)
    b, node_b = as_job(second, "second" if ids else None, 30000, end + 2.0 - 1_700_000_000.0,
                       stamp=stamp)  # fmt: skip
    return merged(a, b, merged(node_a, node_b)), truth


@pytest.mark.parametrize(
    ("stamp", "ids"),
    [(True, True), (False, False)],
    ids=["job-ids-and-host-pids", "old-trace-style-no-ids"],
)
def test_a_second_job_after_a_first_is_judged_right(stamp: bool, ids: bool) -> None:
    stream, truth = sequential(stamp, ids)
    router = JobRouter()
    verdicts = router.feed_many(stream)
    j = judge(verdicts, truth)
    assert not j.missed and not j.false and j.cause_ok == len(j.found), (j.missed, j.false)
    assert not [v for v in verdicts if v["cause"] == "rank_lost"]
    assert router.stats["late"] == 0
    assert [(s.job, s.attempt) for s in router.summaries()] == (
        [("first", 1), ("second", 1)] if ids else [("", 1), ("", 2)]
    )
    # One pipeline for both is the failure the issue reports: the second
    # job's first steps (numbered from 0 again) are dropped as late. (Its
    # ranks used to be called lost too; a late record now counts as its rank
    # heard from, tests/test_late_rank.py, so the straggler in its later
    # steps is found even so: the records lost are the failure left.)
    one = Pipeline()
    one.feed_many(stream)
    assert one.stats["late"] > 100


def concatenated(first: str, second: str) -> tuple[list[Record], dict[str, Any]]:
    a = list(trace.read_trace(TRACES / first))
    b = list(trace.read_trace(TRACES / second))
    gap = (
        max(trace.record_time(r) for r in a)
        + 5.0
        - min(trace.record_time(r) for r in b if r["kind"] != "header")
    )
    b = [shifted(r, gap) for r in b if r["kind"] != "header"]
    return a + b, load_truth(truth_path(TRACES / second))


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("lab-clean.jsonl.zst", "lab-slow-compute.jsonl.zst"),
        ("lab-slow-compute.jsonl.zst", "lab-slow-link.jsonl.zst"),
    ],
)
def test_two_lab_captures_one_after_another_each_judged_on_its_own(first: str, second: str) -> None:
    stream, truth = concatenated(first, second)
    router = JobRouter()
    verdicts = router.feed_many(stream)
    jobs = router.summaries()
    assert [s.attempt for s in jobs] == [1, 2]  # no job ids in these captures: told by pids
    first_flags = {(r, c) for r, c in jobs[0].open}
    alone = Pipeline()
    alone.feed_many(trace.read_trace(TRACES / first))
    assert first_flags == {(r, str(v["cause"])) for r, v in alone.open.items()}
    second_verdicts = [v for v in verdicts if v["t"] >= jobs[1].started_t]
    j = judge(second_verdicts, truth)
    assert not j.missed and not j.false and j.cause_ok == len(j.found)
    assert not [v for v in verdicts if v["cause"] == "rank_lost"]
    assert router.stats["late"] == 0


def test_an_elastic_restart_keeps_history_and_resets_liveness() -> None:
    recs, _ = synth.generate(Scenario(steps=20, seed=9, faults=(Lost(3, 12),)))
    first, node_a = as_job(recs, "elastic", 20000)
    end = max(trace.record_time(r) for r in first)
    again, truth = synth.generate(Scenario(steps=25, faults=(SlowCompute(1, 1.8, 6, 25),),
                                           seed=10))  # fmt: skip
    second, node_b = as_job(again, "elastic", 30000, end + 3.0 - 1_700_000_000.0)
    router = JobRouter()
    verdicts = router.feed_many(merged(first, second, merged(node_a, node_b)))
    lost = [v for v in verdicts if v["cause"] == "rank_lost" and v["state"] == "flagged"]
    assert [v["rank"] for v in lost] == [3]  # the first attempt's loss, once
    s1, s2 = router.summaries()
    assert (s1.job, s1.attempt, s2.job, s2.attempt) == ("elastic", 1, "elastic", 2)
    assert s1.retired_t is not None and s2.open == ((1, "compute"),)  # liveness reset
    after = [v for v in verdicts if v["t"] >= s2.started_t]
    j = judge(after, truth)
    assert not j.missed and not j.false, (j.missed, j.false)
    # History kept: the new attempt judged from its first steps with the old baseline.
    assert router.jobs["elastic"].pipeline.state.job_hist
    assert all(v["job"] == "elastic" for v in verdicts)


def clock(t: float) -> Record:
    return {"kind": "clock", "t": t, "host": "node"}


def test_a_job_silent_for_the_grace_period_is_retired_and_its_series_go() -> None:
    recs_a, _ = synth.generate(Scenario(steps=10, seed=11))
    recs_b, _ = synth.generate(Scenario(steps=40, seed=12))
    a, _ = as_job(recs_a, "short", 20000)
    b, _ = as_job(recs_b, "long", 30000)
    t0 = min(trace.record_time(r) for r in a)
    t1 = max(trace.record_time(r) for r in b)
    ticks = [clock(t0 + 0.5 * i) for i in range(int((t1 - t0) / 0.5) + 1)]
    router = JobRouter(grace_s=5.0)
    router.feed_many(merged(a, b, ticks))
    assert list(router.jobs) == ["long"]
    assert [s.job for s in router.summaries() if s.retired_t is not None] == ["short"]
    snap = router.snapshot()
    assert {r.job for r in snap.ranks} == {"long"} and {p.job for p in snap.peers} == {"long"}
    labelled = {s.labels.get("job") for f in families(snap) for s in f.samples}
    assert "short" not in labelled and "long" in labelled
    # Node-wide counters keep the retired job's records: they never go back.
    assert sum(snap.records_total.values()) == len(a) + len(b) + len(ticks)
    # A quiet spell (a long checkpoint) is not an end: heard again, it is back.
    router.feed({"kind": "step", "rank": 0, "step": 99, "start": t1, "end": t1 + 0.1,
                 "host_pid": 20000})  # fmt: skip
    assert set(router.jobs) == {"short", "long"} and router.revived == 1


def test_the_snapshot_of_two_jobs_labels_every_rank_and_peer_series_by_job() -> None:
    recs_a, _ = synth.generate(Scenario(steps=8, seed=13))
    recs_b, _ = synth.generate(Scenario(steps=8, seed=14))
    a, na = as_job(recs_a, "a", 20000)
    b, nb = as_job(recs_b, "b", 30000)
    router = JobRouter()
    router.feed_many(merged(a, b, na, nb))
    snap = router.snapshot()
    assert sorted((r.job, r.rank) for r in snap.ranks) == [(j, r) for j in "ab" for r in range(4)]
    assert {(j.job, j.world_size) for j in snap.jobs} == {("a", 4), ("b", 4)}
    by_family = {f.name: f.samples for f in families(snap)}
    steps = {(s.labels["job"], s.labels["rank"]) for s in by_family["fsdp_sentinel_step"]}
    assert steps == {(j, str(r)) for j in "ab" for r in range(4)}
    flows = {(s.labels["job"], s.labels["rank"], s.labels["peer_rank"])
             for s in by_family["fsdp_sentinel_flow_bytes"]}  # fmt: skip
    assert {j for j, _, _ in flows} == {"a", "b"}
    sizes = {s.labels["job"]: s.value for s in by_family["fsdp_sentinel_world_size"]}
    assert sizes == {"a": 4.0, "b": 4.0}


def test_replay_of_a_trace_holding_two_jobs_says_so(tmp_path: Path, capsys) -> None:
    from fsdp_sentinel.cli import main

    stream, _ = sequential(stamp=True, ids=True)
    path = tmp_path / "two.jsonl"
    with trace.TraceWriter(path) as w:
        for rec in stream:
            w.write(rec)
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 job(s), each judged on its own:" in out
    assert "job first attempt 1: 4 ranks, 25 steps" in out
    assert "job second attempt 1: 4 ranks, 30 steps" in out
    assert "job=second" in out and "job=first" not in out
    assert [v["job"] for v in replay_paths([path])] == ["second"]


def restarted(second_faults: tuple[Any, ...]) -> tuple[list[Record], float]:
    """A clean 20-step attempt, then a second attempt of the same job (new pids,
    steps from 0 again) with ``second_faults``; the records and when it began."""
    recs, _ = synth.generate(Scenario(steps=20, seed=21))
    first, node_a = as_job(recs, "elastic", 20000)
    end = max(trace.record_time(r) for r in first)
    again, _ = synth.generate(Scenario(steps=30, faults=second_faults, seed=22))
    second, node_b = as_job(again, "elastic", 30000, end + 3.0 - 1_700_000_000.0)
    return merged(first, second, merged(node_a, node_b)), min(map(trace.record_time, second))


def test_a_restarted_attempts_first_steps_are_a_warm_up_as_a_jobs_first_steps_are() -> None:
    # The rank-kill-resume lab: after the restart the fresh connections' first
    # polls carried a high srtt into one host while the first steps ran long,
    # judged against the old attempt's baseline: `network` flags with no fault.
    # Here the new attempt's first 6 steps are slow on rank 0's flows, as then.
    recs, began = restarted((SlowNetwork(0, 1.5, 0, 6),))
    cold = JobRouter(DetectConfig().with_(restart_warmup=0))
    flagged = [v for v in cold.feed_many(recs) if v["state"] == "flagged" and v["t"] >= began]
    assert [(v["rank"], v["cause"]) for v in flagged] == [(0, "network")]  # the old behaviour
    router = JobRouter()
    after = [v for v in router.feed_many(recs) if v["t"] >= began]
    assert after == []  # nothing at all after the resume
    # The warm-up ends: the history goes on from the old attempt's baseline.
    state = router.jobs["elastic"].pipeline.state
    assert state.warmup == 0 and state.job_hist


def test_a_slow_down_after_the_warm_up_is_still_flagged() -> None:
    recs, began = restarted((SlowNetwork(0, 1.5, 10, 30),))
    after = [v for v in JobRouter().feed_many(recs) if v["t"] >= began]
    flags = [(v["rank"], v["cause"], v["step"]) for v in after if v["state"] == "flagged"]
    assert [f[:2] for f in flags] == [(0, "network")] and 10 <= flags[0][2] <= 16, flags
