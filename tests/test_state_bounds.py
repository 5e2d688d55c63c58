"""Bounded state: no stream grows the correlator without end (no root).

Rows of the hardening issue's table: 10^6 distinct flows, 10^5 step-less
collectives, 10^5 ops or kinds, 8,000 bogus ranks each grew the daemon for
good. Here each is fed (scaled down, the caps lowered to match) beside a
job with a known slow rank: the state stays under its cap, what went is
counted by kind, and the slow rank is still the one flagged. The memory and
rate figures at full size are bench/memory's (BENCHMARKS.md).
"""

from __future__ import annotations

from fsdp_sentinel.correlate import OTHER_OP, StateLimits
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.synth import Scenario, SlowCompute, generate
from fsdp_sentinel.trace import record_time

SLOW = 2
LIMITS = StateLimits(
    max_ranks=64, max_pending_steps=8, max_colls_per_step=256, max_ops=4, max_pairs=64,
    max_endpoints=128, max_hosts=16, ttl_s=60.0,
)  # fmt: skip


def job() -> tuple[list[dict], int]:
    """A 4-rank job with rank 2 slow from step 10, and where step 20 begins."""
    recs, _ = generate(
        Scenario(
            steps=40,
            faults=(SlowCompute(rank=SLOW, factor=3.0, start=10, end=40),),
            daemon_clock=True,
        )  # fmt: skip
    )
    return recs, next(j for j, r in enumerate(recs) if r["kind"] == "coll" and r["step"] == 20)


def with_flood(flood: list[dict], limits: StateLimits = LIMITS) -> tuple[Pipeline, list[dict]]:
    """The job with ``flood`` (made by the caller at :func:`t_split`) fed in at step 20."""
    recs, i = job()
    pipe = Pipeline(limits=limits)
    out = list(pipe.feed_many(recs[:i]))
    out += pipe.feed_many(flood)
    out += pipe.feed_many(recs[i:])
    return pipe, out


def t_split() -> float:
    recs, i = job()
    return max(map(record_time, recs[:i]))


def flagged(out: list[dict]) -> set[tuple[int, str]]:
    return {(v["rank"], v["cause"]) for v in out if v["state"] == "flagged"}


def test_bogus_ranks_fill_no_more_than_the_cap() -> None:
    t = t_split()
    flood = [
        {"kind": "rank", "t": t, "rank": 100 + i, "world_size": 101 + i, "host": f"b{i}",
         "pid": 10_000 + i, "addrs": [f"10.0.{i // 256}.{i % 256}"]}
        for i in range(1000)
    ]  # fmt: skip
    outside = [{**flood[0], "rank": 7, "world_size": 4}]  # a rank past its own world
    pipe, out = with_flood(flood + outside)
    assert len(pipe.corr.ranks) <= LIMITS.max_ranks
    assert {0, 1, 2, 3} <= set(pipe.corr.ranks)  # the job's ranks stay
    assert pipe.corr.evicted["rank"] >= 1000 - LIMITS.max_ranks
    assert pipe.stats["malformed"] >= 1  # the rank outside its world
    assert (SLOW, "compute") in flagged(out)
    # the bogus ranks that only announced themselves are never judged lost
    assert not any(v["cause"] == "rank_lost" and v["rank"] < 100 for v in out)


def test_ops_past_the_cap_add_up_as_other() -> None:
    t = t_split()
    flood = [
        {"kind": "coll", "rank": 0, "step": 20, "seq": 10_000 + i, "op": f"op{i}", "bytes": 8,
         "issue": t - 0.001, "end": t}
        for i in range(100)
    ]  # fmt: skip
    pipe, out = with_flood(flood)
    ops = pipe.snapshot().ranks[0].coll_count_total
    assert len(ops) <= LIMITS.max_ops + 1 and OTHER_OP in ops
    assert pipe.corr.evicted["op"] >= 100 - LIMITS.max_ops
    assert flagged(out) == {(SLOW, "compute")}


def test_step_less_collectives_keep_a_few_steps_a_rank() -> None:
    t = t_split()
    # rank 3 files collectives of 5,000 steps to come that it never completes
    flood = [
        {"kind": "coll", "rank": 3, "step": 21 + i, "seq": i, "op": "all_gather", "bytes": 8,
         "issue": t - 0.001, "end": t}
        for i in range(5000)
    ]  # fmt: skip
    one_step = [{**flood[0], "step": 20, "seq": 50_000 + i} for i in range(1000)]
    pipe, out = with_flood(flood + one_step)
    assert all(len(rs.colls) <= LIMITS.max_pending_steps for rs in pipe.corr.ranks.values())
    assert pipe.corr.evicted["coll"] >= 5000 - LIMITS.max_pending_steps
    assert pipe.stats["steps"] >= 38
    assert flagged(out) == {(SLOW, "compute")}


def test_distinct_flows_keep_bounded_maps() -> None:
    t = t_split()
    flood = [
        {"kind": "flow", "t": t, "dt": 1.0, "host": "synth-h0", "pid": 1, "rank": 0,
         "peer_rank": i % 4, "src": f"198.18.0.1:{i}", "dst": f"198.18.1.{i % 250}:{i}",
         "tx_bytes": 1, "rx_bytes": 1}
        for i in range(2000)
    ] + [
        {"kind": "flow", "t": t, "dt": 1.0, "host": f"h{i}", "pid": 1, "rank": 0,
         "peer_rank": 5000 + i, "src": "198.18.0.1:1", "dst": "198.18.0.2:1",
         "tx_bytes": 1, "rx_bytes": 1}
        for i in range(100)
    ]  # fmt: skip
    pipe, out = with_flood(flood)
    c = pipe.corr
    assert len(c._endpoint_rank) <= LIMITS.max_endpoints
    assert len(c.hosts_heard) <= LIMITS.max_hosts
    assert all(a < 4 and b < 4 for a, b in c.pairs)  # no pair outside the world
    assert c.evicted["endpoint"] > 0 and c.evicted["host"] > 0
    assert snap_evictions(pipe)["endpoint"] == c.evicted["endpoint"]
    assert flagged(out) == {(SLOW, "compute")}


def snap_evictions(pipe: Pipeline) -> dict[str, int]:
    return pipe.snapshot().evictions_total


def test_quiet_state_goes_after_its_time_to_live() -> None:
    pipe = Pipeline(limits=LIMITS)
    pipe.feed({"kind": "rank", "t": 1000.0, "rank": 0, "world_size": 2, "host": "a", "pid": 1,
               "addrs": ["198.18.0.1"]})  # fmt: skip
    pipe.feed({"kind": "rank", "t": 1000.0, "rank": 1, "world_size": 2, "host": "b", "pid": 2,
               "addrs": ["198.18.0.2"]})  # fmt: skip
    pipe.feed({"kind": "flow", "t": 1000.0, "dt": 1.0, "host": "a", "pid": 1, "src": "198.18.0.1:5",
               "dst": "198.18.0.2:6", "tx_bytes": 10, "rx_bytes": 1})  # fmt: skip
    assert pipe.corr.pairs and pipe.corr.hosts_heard
    for k in range(1, 200):  # the daemon's clock goes on; nothing else
        pipe.feed({"kind": "clock", "t": 1000.0 + k, "host": "d"})
    assert not pipe.corr.pairs and "a" not in pipe.corr.hosts_heard
    assert set(pipe.corr.ranks) == set()  # announced, never a step: forgotten
    assert pipe.corr.evicted["pair"] == 1 and pipe.corr.evicted["rank"] == 2


def two_ranks(limits: StateLimits) -> Pipeline:
    """Ranks 0 (host a, 198.18.0.1) and 1 (host b, 198.18.0.2), each with a step
    filed: busy ranks, never forgotten for being quiet."""
    pipe = Pipeline(limits=limits)
    for r in (0, 1):
        pipe.feed({"kind": "rank", "t": 1000.0, "rank": r, "world_size": 2, "host": "ab"[r],
                   "pid": r + 1, "addrs": [f"198.18.0.{r + 1}"]})  # fmt: skip
        pipe.feed({"kind": "step", "rank": r, "step": 0, "start": 1000.0, "end": 1000.5})
    return pipe


def flow(t: float, src_rank: int, tx: int) -> dict:
    a, b = src_rank + 1, 2 - src_rank
    return {"kind": "flow", "t": t, "dt": 1.0, "host": "ab"[src_rank], "pid": a,
            "src": f"198.18.0.{a}:5", "dst": f"198.18.0.{b}:6", "tx_bytes": tx, "rx_bytes": 0}  # fmt: skip


def test_a_swept_pair_is_made_anew_when_its_flow_comes_back() -> None:
    # The flow stays known (its ranks live on) while its pair is swept: its
    # next sample starts a new pair, not the swept one's samples and totals.
    pipe = two_ranks(LIMITS)
    pipe.feed(flow(1001.0, 0, 10))
    old = pipe.corr.pairs[(0, 1)]
    for k in range(2, 200):
        pipe.feed({"kind": "clock", "t": 1000.0 + k, "host": "d"})
    assert not pipe.corr.pairs and pipe.corr.evicted["pair"] == 1
    assert set(pipe.corr.ranks) == {0, 1}
    pipe.feed(flow(1200.0, 0, 7))
    new = pipe.corr.pairs[(0, 1)]
    assert new is not old and new.tx_total == 7 and len(new.samples) == 1
    assert old.tx_total == 10
    (pf,) = pipe.corr.flow_matrix(1200.0)
    assert (pf.rank, pf.peer, pf.tx_bytes) == (0, 1, 7)


def test_a_flow_with_no_room_for_its_pair_is_counted_each_sample() -> None:
    limits = StateLimits(max_pairs=1, ttl_s=60.0)
    pipe = two_ranks(limits)
    pipe.feed(flow(1001.0, 0, 10))  # (0, 1): the one pair there is room for
    for k in range(3):
        assert pipe.corr.add_flow(flow(1001.0 + k, 1, 5)) is None  # (1, 0): no room
    assert set(pipe.corr.pairs) == {(0, 1)} and pipe.corr.evicted["pair"] == 3
    for k in range(2, 200):  # (0, 1) goes quiet and is swept: room again
        pipe.feed({"kind": "clock", "t": 1000.0 + k, "host": "d"})
    assert pipe.corr.add_flow(flow(1200.0, 1, 5)) == (1, 0)
    assert set(pipe.corr.pairs) == {(1, 0)} and pipe.corr.evicted["pair"] == 4
