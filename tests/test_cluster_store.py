"""Cluster mode through a real torch TCPStore on loopback (what torchrun runs).

One :class:`~fsdp_sentinel.cluster.agent.ClusterAgent` per host of a real lab
capture, each fed only its host's records, all meeting in one TCPStore
server; the stream is driven in its own time, every agent stepping once per
window. The single daemon's verdicts over the whole capture are the oracle.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path

import pytest

from fsdp_sentinel import trace
from fsdp_sentinel.cluster.agent import ClusterAgent
from fsdp_sentinel.cluster.split import split_by_host
from fsdp_sentinel.cluster.store import ClusterStore, StoreUnreachable, tcp_store
from fsdp_sentinel.pipeline import Pipeline

torch_dist = pytest.importorskip("torch.distributed")

TRACES = Path(__file__).parent / "traces"
WINDOW_S = 0.5


@pytest.fixture
def server():  # type: ignore[no-untyped-def]
    store = torch_dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=5),
    )  # fmt: skip
    yield store


def _flags(verdicts: list[dict]) -> list[tuple[int, int, str]]:
    return [(v["step"], v["rank"], v["cause"]) for v in verdicts if v["state"] == "flagged"]


def _unflagged_clears(verdicts: list[dict]) -> list[dict]:
    """Clears of a (rank, cause) with no open flag: what a user sees out of nowhere."""
    opened: set[tuple[int, str]] = set()
    out = []
    for v in verdicts:
        key = (v["rank"], v["cause"])
        if v["state"] == "flagged":
            opened.add(key)
        elif key in opened:
            opened.discard(key)
        else:
            out.append(v)
    return out


def _drive(
    recs: list[dict],
    port: int,
    stop: Callable[[str, float], bool] = lambda node, t: False,
) -> tuple[
    dict[str, ClusterAgent], dict[str, list[dict]], list[tuple[float, dict[str, str | None]]]
]:
    """Every host's agent over ``recs``; ``stop(node, t)``: that node's daemon is gone by then.
    Returns the agents, the verdicts each heard, and who each thought led, per window."""
    agents: dict[str, ClusterAgent] = {}
    heard: dict[str, list[dict]] = {}
    leaders: list[tuple[float, dict[str, str | None]]] = []
    due: float | None = None
    now = 0.0

    def window(t: float) -> None:
        for name, ag in agents.items():
            if not stop(name, t):
                heard[name].extend(ag.step(t))
        leaders.append((t, {n: a.leader for n, a in agents.items() if not stop(n, t)}))

    for hosts, r in split_by_host(recs):
        t = trace.record_time(r)
        now = max(now, t)
        for h in hosts:
            if h not in agents:
                agents[h] = ClusterAgent(h, address=f"127.0.0.1:{port}", job="j1")
                heard[h] = []
            if not stop(h, now):
                agents[h].feed(r)
        if due is None:
            due = now + WINDOW_S
        elif now >= due:
            window(now)
            due = now + WINDOW_S
    for i in range(3):  # the last windows reach the leader, its verdicts everyone
        window(now + i * WINDOW_S)
    return agents, heard, leaders


@pytest.mark.parametrize("name", ["lab-slow-compute", "lab-slow-path", "lab-rank-kill"])
def test_node_daemons_through_a_real_tcpstore_agree_with_one_daemon(server, name: str) -> None:  # type: ignore[no-untyped-def]
    recs = list(trace.read_trace(TRACES / f"{name}.jsonl.zst"))
    single = Pipeline().feed_many(recs)
    agents, heard, leaders = _drive(recs, server.port)
    assert len(agents) == 4
    lead = {led for _, who in leaders for led in who.values()}
    rank0_node = next(r["host"] for r in recs if r.get("kind") == "rank" and r["rank"] == 0)
    assert lead - {None} == {rank0_node}  # the node holding rank 0 led throughout
    want = _flags(single)
    assert want
    for node, got in heard.items():  # every node heard the leader's verdicts
        g = _flags(got)
        assert [(r, c) for _, r, c in g] == [(r, c) for _, r, c in want], (node, g, want)
        assert all(abs(a[0] - b[0]) <= 1 for a, b in zip(g, want, strict=True))
        assert all(v["evidence"]["view"] == "cluster" for v in got)
        assert _unflagged_clears(got) == [], node
    # Read windows and verdict batches are deleted: nothing piles up.
    left = [k for k in server.list_keys() if k.startswith("fsdp-sentinel/j1/w/")]
    assert len(left) <= len(agents), left
    assert not [k for k in server.list_keys() if k.startswith("fsdp-sentinel/j1/v/") and
                k != "fsdp-sentinel/j1/v/n"]  # fmt: skip
    sent = sum(a.store.sent for a in agents.values() if a.store is not None)
    windows = sum(a.stats["windows"] for a in agents.values())
    ranks = len({r["rank"] for r in recs if r.get("kind") == "rank"})
    # Bytes per window per rank: the figure docs/cluster.md states for lab jobs.
    assert 0 < sent / windows / (ranks / len(agents)) < 8000


@pytest.mark.parametrize("name", ["lab-clean", "lab-slow-link"])
def test_leader_killed_mid_run_another_takes_over_within_3_windows(server, name: str) -> None:  # type: ignore[no-untyped-def]
    recs = list(trace.read_trace(TRACES / f"{name}.jsonl.zst"))
    steps = sorted(r["end"] for r in recs if r.get("kind") == "step")
    kill_t = steps[len(steps) // 3]
    rank_host = {r["rank"]: r["host"] for r in recs if r.get("kind") == "rank"}
    leader0 = rank_host[0]
    agents, heard, leaders = _drive(
        recs, server.port, stop=lambda n, t: n == leader0 and t >= kill_t
    )
    after = [who for t, who in leaders if t >= kill_t]
    assert after and all(leader0 not in who for who in after)
    # Within 3 windows every surviving node follows one new leader: rank 1's node.
    for who in after[2:]:
        assert set(who.values()) == {rank_host[1]}, who
    assert agents[rank_host[1]].stats["takeovers"] == 1
    truth = {(v["rank"], v["cause"]) for v in Pipeline().feed_many(recs) if v["state"] == "flagged"}
    for node, got in heard.items():
        wrong = [v for v in got if v["state"] == "flagged" and (v["rank"], v["cause"]) not in truth]
        assert not wrong, (node, wrong)  # rank 0 (whose daemon died) is not called lost


def test_an_unreachable_store_leaves_the_node_detecting_alone(server) -> None:  # type: ignore[no-untyped-def]
    port = server.port
    # Nothing listens on port 1: the client is refused (or times out).
    ag = ClusterAgent("h0", address="127.0.0.1:1", job="j1",
                      connect=lambda a: tcp_store(a, timeout_s=0.5))  # fmt: skip
    ag.feed({"kind": "rank", "t": 1.0, "rank": 0, "world_size": 1, "host": "h0", "pid": 1,
             "addrs": []})  # fmt: skip
    assert ag.step(2.0) == []
    assert ag.view == "node" and ag.stats["store_errors"] == 1
    v = {"kind": "verdict", "rank": 0, "state": "flagged", "cause": "compute", "evidence": {}}
    assert ag.local([v])[0]["evidence"]["view"] == "node"
    # Once the store answers, the node's own verdicts give way to the leader's.
    ag.address, ag._retry_at = f"127.0.0.1:{port}", 0.0
    ag.step(3.0)
    assert ag.view == "cluster" and ag.local([dict(v)]) == []
    with pytest.raises(StoreUnreachable):
        tcp_store("no-port-here")


def test_store_keys_are_namespaced_per_job(server) -> None:  # type: ignore[no-untyped-def]
    a = ClusterStore(tcp_store(f"127.0.0.1:{server.port}"), "job-a")
    b = ClusterStore(tcp_store(f"127.0.0.1:{server.port}"), "job-b")
    a.join("n0", 0, [])
    b.join("n9", 0, [])
    a.publish("n0", 0, b"w")
    assert a.roster() == [(0, "n0")] and b.roster() == [(0, "n9")]
    assert b.take_windows("n0", 0) == [] and a.take_windows("n0", 0) == [b"w"]
    assert a.take_windows("n0", 0) == []  # deleted once read
    n = a.publish_verdicts([{"rank": 1}])
    assert a.read_verdicts(0, live_nodes=2) == (n, [{"rank": 1}])
    assert a.read_verdicts(0, live_nodes=2) == (n, [{"rank": 1}])  # the second reader...
    assert a.read_verdicts(n - 1, live_nodes=2) == (n - 1, [])  # ...deleted it


def test_the_daemons_cluster_pipeline_hands_back_the_leaders_verdicts(server) -> None:  # type: ignore[no-untyped-def]
    import time

    from fsdp_sentinel.cluster.agent import ClusterPipeline

    recs = list(trace.read_trace(TRACES / "lab-slow-compute.jsonl.zst"))
    # One node holding every rank: it leads, and its verdicts come back
    # through the store on the agent's own thread.
    for r in recs:
        if r.get("kind") == "rank":
            r["store"] = f"127.0.0.1:{server.port}"
            r["job"] = "jp"
    cp = ClusterPipeline(Pipeline(), ClusterAgent("vm"), interval_s=0.05).start()
    try:
        first = [r for r in recs if r.get("kind") == "rank"]
        for r in first:
            cp.feed(r)
        deadline = time.monotonic() + 10.0
        while cp.agent.view != "cluster" and time.monotonic() < deadline:
            time.sleep(0.02)
        # The store answers: the node's own verdicts give way to the leader's.
        local = [v for r in recs if r.get("kind") != "rank" for v in cp.feed(r)]
        assert not [v for v in local if v["evidence"].get("view") == "node"]
        got: list[dict] = []
        deadline = time.monotonic() + 10.0
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
            got.extend(cp.feed({"kind": "clock", "t": recs[-1].get("t", 0.0)}))
    finally:
        cp.close()
    want = _flags(Pipeline().feed_many(recs))
    assert [(r, c) for _, r, c in _flags(local + got)] == [(r, c) for _, r, c in want]
    assert cp.agent.view == "cluster" and cp.agent.stats["takeovers"] == 1


Sample = tuple[str, tuple[tuple[str, str], ...]]


def _cluster_samples(snap) -> dict[Sample, float]:  # type: ignore[no-untyped-def]
    from fsdp_sentinel.exporters.prometheus import families

    out = {}
    for fam in families(snap):
        if fam.name.startswith("fsdp_sentinel_cluster_"):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_a_node_without_its_store_detects_alone_and_says_so_in_a_metric(server) -> None:  # type: ignore[no-untyped-def]
    from fsdp_sentinel.cluster.agent import ClusterPipeline

    recs = list(trace.read_trace(TRACES / "lab-slow-compute.jsonl.zst"))
    for r in recs:
        if r.get("kind") == "rank":
            r["store"], r["job"] = "127.0.0.1:1", "jv"  # nothing listens there
    agent = ClusterAgent("vm", connect=lambda a: tcp_store(a, timeout_s=0.5), retry_s=3600)
    cp = ClusterPipeline(Pipeline(), agent)  # stepped here, not on its thread
    got: list[dict] = []
    for r in recs:
        got.extend(cp.feed(r))
        if r.get("kind") == "rank":
            agent.step(trace.record_time(r))
    # Detection within the node goes on, and every verdict says whose view it is.
    want = _flags(Pipeline().feed_many(recs))
    assert [(r, c) for _, r, c in _flags(got)] == [(r, c) for _, r, c in want] and want
    assert {v["evidence"]["view"] for v in got} == {"node"}
    assert agent.stats["store_errors"] >= 1
    view = {
        ("fsdp_sentinel_cluster_view", (("job", "jv"), ("view", v))) for v in ("cluster", "node")
    }
    samples = _cluster_samples(cp.snapshot())
    assert {k: samples[k] for k in view} == {
        ("fsdp_sentinel_cluster_view", (("job", "jv"), ("view", "node"))): 1.0,
        ("fsdp_sentinel_cluster_view", (("job", "jv"), ("view", "cluster"))): 0.0,
    }
    # The store comes back: the leader's view, and this node leads it.
    agent.address, agent._retry_at, agent.store = f"127.0.0.1:{server.port}", 0.0, None
    agent.step(trace.record_time(recs[-1]))
    samples = _cluster_samples(cp.snapshot())
    assert samples[("fsdp_sentinel_cluster_view", (("job", "jv"), ("view", "cluster")))] == 1.0
    assert samples[("fsdp_sentinel_cluster_leading", (("job", "jv"),))] == 1.0
    assert samples[("fsdp_sentinel_cluster_takeovers_total", (("job", "jv"),))] == 1.0
    # A daemon not in cluster mode exports none of these.
    assert _cluster_samples(Pipeline().snapshot()) == {}
