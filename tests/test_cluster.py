"""Cluster mode, pure parts: node digests, the leader's detection, the election.

The oracle is the single daemon: the same records through one
:class:`~fsdp_sentinel.pipeline.Pipeline` (what `fsdp-sentinel replay` runs).
Cut by host into node windows and judged by the leader, every golden capture
and every synthetic job must give the same flagged ranks and causes, within
one step of the single daemon's.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest

from fsdp_sentinel import synth as S
from fsdp_sentinel import trace
from fsdp_sentinel.cluster import summary as CS
from fsdp_sentinel.cluster.flowrows import FlowRowsBuilder
from fsdp_sentinel.cluster.leader import (
    LeaderDetector,
    Liveness,
    decode_round,
    leader_of,
    seed_windows,
)
from fsdp_sentinel.cluster.node import NodeWindows
from fsdp_sentinel.cluster.split import run_split, split_by_host
from fsdp_sentinel.cluster.summary import Window
from fsdp_sentinel.correlate import Correlator
from fsdp_sentinel.detect.config import LostConfig
from fsdp_sentinel.pipeline import Pipeline

TRACES = Path(__file__).parent / "traces"
GOLDEN = sorted(TRACES.glob("*.jsonl.zst"))


def _flags(verdicts: list[dict]) -> list[tuple[int, int, str]]:
    return [(v["step"], v["rank"], v["cause"]) for v in verdicts if v["state"] == "flagged"]


def _same_within_a_step(single: list[dict], cluster: list[dict]) -> None:
    a, b = _flags(single), _flags(cluster)
    assert [(r, c) for _, r, c in a] == [(r, c) for _, r, c in b], (a, b)
    for (sa, _, _), (sb, _, _) in zip(a, b, strict=True):
        assert abs(sa - sb) <= 1, (a, b)


def _colls(rng: random.Random, rank: int, step: int, keys: list, skew: float) -> list[dict]:
    out, t = [], 100.0 + step
    for k in keys:
        issue = t + rng.random() * 0.01 + skew
        end = t + 0.05 + rng.random() * 0.01
        rec = {"kind": "coll", "rank": rank, "step": step, "op": "all_gather", "bytes": 8}
        if isinstance(k, tuple):
            rec["group"], rec["seq"] = k
        else:
            rec["seq"] = k
        rec.update(issue=issue, end=end)
        out.append(rec)
        t = end + 0.001
    return out


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("per_node", [1, 2, 3])
def test_digests_rebuild_the_correlators_rank_steps(
    aligned: bool, per_node: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(per_node * 2 + aligned)
    ranks = 6
    corr = Correlator()
    by_node: dict[int, dict[int, list[dict]]] = {}
    steps_of: dict[int, dict[int, dict]] = {}
    for r in range(ranks):
        keys: list = list(range(10, 18))
        if not aligned:  # two process groups, and one rank missing a collective
            keys = [("dp", i) for i in range(4)] + [(f"tp{r % 2}", i) for i in range(3)]
            if r == 4:
                keys = keys[:-1]
        colls = _colls(rng, r, 3, keys, skew=0.03 if r == 2 else 0.0)
        for c in colls:
            corr.add_coll(c)
        srec = {"rank": r, "step": 3, "start": 99.0, "end": 103.5 + r * 0.01}
        corr.add_step(srec)
        by_node.setdefault(r // per_node, {})[r] = colls
        steps_of.setdefault(r // per_node, {})[r] = srec
    # A rank with a step record and no collectives, as the correlator sees it.
    lone = {"rank": ranks, "step": 3, "start": 99.5, "end": 103.0}
    corr.add_step(lone)
    steps_of[ranks // per_node + 1] = {ranks: lone}
    want = corr.step_summary(3, 110.0).ranks
    digests = [CS.digest_step(3, by_node.get(n, {}), steps_of[n]) for n in steps_of]
    # Through the wire form too: what the leader reads is what was sent.
    w = CS.Window("n", 0, 1.0, (), tuple(digests), (), ())
    got = CS.rank_steps(CS.decode(CS.encode(w)).digests)
    if aligned:
        assert got == want  # to the last bit
    else:
        assert [g[:2] + g[6:] for g in got] == [w[:2] + w[6:] for w in want]
        for g, e in zip(got, want, strict=True):
            assert g.late_s == pytest.approx(e.late_s, abs=1e-12)
            assert g.last_frac == e.last_frac and g.wait_s == e.wait_s
    assert max(got, key=lambda rs: rs.late_s).rank == 2
    assert got[-1].rank == ranks and got[-1].n_coll == 0 and got[-1].step_s == 3.5
    # A round read at once (each step's columns for every node together) is
    # every window read alone, joined; and the leader's summary is the same.
    blobs = [CS.encode(CS.Window(f"n{i}", 0, 1.0, (), (d,), (), ())) for i, d in enumerate(digests)]
    rnd = CS.decode_round(blobs)
    alone = CS.join_digests([CS.decode(b).digests[0] for b in blobs])
    assert rnd.bad == 0 and list(rnd.steps) == [3]
    assert _as_lists(rnd.steps[3]) == _as_lists(alone)
    assert CS.rank_steps([rnd.steps[3]]) == CS.rank_steps([alone]) == got
    # As columns (a big job's path: the round's extremes read as one array, or
    # each group's tuples), the same figures.
    monkeypatch.setattr(CS.correlate, "COLUMNAR_RANKS", 2)
    if aligned:
        assert rnd.steps[3].extremes is not None
        assert list(CS.rank_steps([rnd.steps[3]])) == list(CS.rank_steps([alone])) == list(got)


def _as_lists(d: CS.StepDigest) -> tuple:
    if d.extremes is not None:  # the groups' own extremes, as one array
        want = [[g.longest, g.shortest] for g in d.groups]
        assert d.extremes.tolist() == [[list(a), list(b)] for a, b in want]
    return tuple(f if isinstance(f, (int, tuple)) else list(f) for f in d._replace(extremes=()))


def test_window_bytes_grow_with_ranks_not_with_collectives_per_node() -> None:
    rng = random.Random(1)
    one = CS.digest_step(0, {0: _colls(rng, 0, 0, list(range(40)), 0.0)})
    eight = CS.digest_step(0, {r: _colls(rng, r, 0, list(range(40)), 0.0) for r in range(8)})
    b1 = len(CS.encode(CS.Window("n", 0, 0.0, (), (one,), (), ())))
    b8 = len(CS.encode(CS.Window("n", 0, 0.0, (), (eight,), (), ())))
    # Per rank: its own figures and the keys where it arrived last; the
    # group's 40 maxima and minima are sent once per node, not per rank.
    assert (b8 - b1) / 7 < b1 / 2


def test_a_node_holds_step_records_back_until_their_digest_goes() -> None:
    nw = NodeWindows("h0")
    nw.feed({"kind": "rank", "t": 1.0, "rank": 0, "world_size": 2, "host": "h0", "pid": 1,
             "addrs": []})  # fmt: skip
    nw.feed({"kind": "rank", "t": 1.0, "rank": 1, "world_size": 2, "host": "h0", "pid": 2,
             "addrs": []})  # fmt: skip
    for r in (0, 1):
        for c in _colls(random.Random(r), r, 0, [0, 1], 0.0):
            nw.feed(c)
    nw.feed({"kind": "step", "rank": 0, "step": 0, "start": 99.0, "end": 101.0})
    w = nw.window()
    assert not w.digests and not [r for r in w.records if r["kind"] == "step"]
    nw.feed({"kind": "step", "rank": 1, "step": 0, "start": 99.0, "end": 101.5})
    w = nw.window()
    assert [d.step for d in w.digests] == [0]
    # The step records travel inside the digest, as its columns.
    assert not [r for r in w.records if r["kind"] == "step"]
    assert list(CS.step_times(w.digests[0])) == [(0, 99.0, 101.0), (1, 99.0, 101.5)]
    # A record of a step already sent is late: dropped and counted.
    nw.feed({"kind": "step", "rank": 1, "step": 0, "start": 99.0, "end": 101.0})
    assert nw.late == 1


def test_a_poll_its_flow_rows_show_is_not_sent_again_as_heard() -> None:
    # h0's poll at 5.0 carries a flow: the row says h0 was heard (the leader
    # notes every row's host), so no heard entry repeats it; h1's poll has
    # only its device, and h2's flow has another interval than its poll.
    nw = NodeWindows("node-a")
    flow = {"kind": "flow", "t": 5.0, "dt": 1.0, "host": "h0", "pid": 7,
            "src": "198.18.0.1:40000", "dst": "198.18.0.2:29500", "tx_bytes": 10,
            "rx_bytes": 0}  # fmt: skip
    nw.feed({"kind": "netdev", "t": 5.0, "dt": 1.0, "host": "h0", "dev": "eth0",
             "tx_bytes": 0, "rx_bytes": 0})  # fmt: skip
    nw.feed(flow)
    nw.feed({**flow, "t": 5.01})  # the same poll, a little later: its first stands
    nw.feed({"kind": "netdev", "t": 5.0, "dt": 1.0, "host": "h1", "dev": "eth0",
             "tx_bytes": 0, "rx_bytes": 0})  # fmt: skip
    nw.feed({**flow, "host": "h2", "dt": 2.0})
    nw.feed({"kind": "netdev", "t": 5.0, "dt": 1.0, "host": "h2", "dev": "eth0",
             "tx_bytes": 0, "rx_bytes": 0})  # fmt: skip
    w = nw.window()
    assert w.heard == (("h1", 5.0, 1.0), ("h2", 5.0, 1.0)) and w.flows.n_rows == 3
    # The leader still learns each host of the node from its rows.
    det = LeaderDetector()
    det.ingest([CS.decode(CS.encode(w))])
    assert det.node_hosts["node-a"] == {"h0", "h1", "h2"}
    assert det.corr.hosts_heard["h0"] == [5.01, 1.0]
    det.set_dark(["node-a"])
    assert det.corr.dark_hosts == {"h0", "h1", "h2"}


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.name.split(".")[0])
def test_golden_capture_cut_by_host_gives_the_single_daemons_verdicts(path: Path) -> None:
    recs = list(trace.read_trace(path))
    single = Pipeline().feed_many(recs)
    cluster = run_split(recs)
    _same_within_a_step(single, cluster)
    assert all(v["evidence"]["view"] == "cluster" for v in cluster)
    # A link told from a node: the same scope and ends as the single daemon.
    scope = [
        (v["rank"], v.get("peer_rank")) for v in single if v["evidence"].get("scope") == "link"
    ]
    assert scope == [
        (v["rank"], v.get("peer_rank")) for v in cluster if v["evidence"].get("scope") == "link"
    ]
    # Read back from the store's bytes (run_split's default) or handed over
    # as the nodes made them: the leader says the very same.
    assert run_split(recs, wire=False) == cluster


def test_a_leader_elected_long_after_the_daemons_began_calls_nobody_lost_unheard() -> None:
    # Node daemons begin before the job: their windows reach back 8 s before
    # any rank announces, and a first leader elected 6 s after the ranks did
    # holds all of them. Seeded at its oldest window, every rank but the first
    # to announce looked silent for 8 s, was called lost in the seed (whose
    # verdicts are not said) and cleared aloud in the next round: "rank 1
    # cleared at step 0" in a per-host demo. Seeded at the newest: nothing.
    recs = [r for r in trace.read_trace(TRACES / "lab-clean.jsonl.zst") if r["kind"] != "header"]
    ranks = [r for r in recs if r["kind"] == "rank"]
    hosts = sorted({r["host"] for r in ranks})
    announced = max(r["t"] for r in ranks)
    t_first = min(trace.record_time(r) for r in recs)
    early = [
        {"kind": "netdev", "t": t_first - 8.0 + k * 0.5, "dt": 0.5, "host": h, "dev": "eth0",
         "tx_bytes": 0, "rx_bytes": 0}
        for k in range(16) for h in hosts
    ]  # fmt: skip
    nodes = {h: NodeWindows(h) for h in hosts}
    windows: list[Any] = []
    due = t_first - 8.0 + 0.5
    for hs, r in split_by_host(early + recs):
        if trace.record_time(r) > announced + 6.0:
            break
        for h in hs:
            nodes[h].feed(r)
        if trace.record_time(r) >= due:
            windows += [nw.window() for nw in nodes.values()]
            due += 0.5
    by_node = {h: [r for r in ranks if r["host"] == h] for h in hosts}

    det = LeaderDetector()
    assert det.ingest(seed_windows(by_node, max(w.t for w in windows))) == []
    assert det.ingest(windows) == []

    old = LeaderDetector()  # the former seed: every rank alive at the oldest window
    t0 = min(w.t for w in windows)
    seeded = [
        Window(h, -1, t0, tuple(rs), (), tuple((r["rank"], t0, -1, -1) for r in rs), ())
        for h, rs in by_node.items()
    ]
    unheard = [v for v in old.ingest(seeded) if v["state"] == "flagged"]
    assert len(unheard) == len(ranks) - 1  # all but the first to announce
    assert {v["state"] for v in old.ingest(windows)} == {"cleared"}


def _suite() -> list[tuple[str, S.Scenario]]:
    out = []
    for i, fault in enumerate(
        [
            S.SlowCompute(rank=3, factor=1.6, start=12, end=30),
            S.SlowNetwork(rank=5, factor=3.0, start=12, end=30),
            S.SlowLink(a=2, b=3, factor=4.0, start=12, end=30),
            S.Lost(rank=6, step=14),
            S.Hang(rank=1, step=14),
            None,
        ]
    ):
        for per_host in (1, 2, 4):
            scn = S.Scenario(ranks=8, steps=30, seed=i, ranks_per_host=per_host, duplex=True)
            if fault is not None:
                scn = dataclasses.replace(scn, faults=(fault,))
            out.append((f"{type(fault).__name__}-{per_host}", scn))
    return out


@pytest.mark.parametrize("scn", [s for _, s in _suite()], ids=[n for n, _ in _suite()])
def test_synthetic_job_cut_by_host_gives_the_single_daemons_verdicts(scn: S.Scenario) -> None:
    recs, _ = S.generate(scn)
    single = Pipeline().feed_many(recs)
    _same_within_a_step(single, run_split(recs))
    if scn.faults:
        assert _flags(single), "the fault was not found at all: the comparison says nothing"


def test_a_dark_nodes_ranks_are_not_called_lost() -> None:
    recs, _ = S.generate(S.Scenario(ranks=4, steps=120, seed=3))
    assert not Pipeline().feed_many(recs)  # a clean job
    cut = next(r["end"] for r in recs if r.get("kind") == "step" and r["step"] == 20)
    # Rank 3's node daemon stops publishing at ``cut``; its rank goes on, unseen.
    nodes: dict[str, NodeWindows] = {}
    det = LeaderDetector()
    out: list[dict] = []
    due = None
    dark: str | None = None
    for hosts, r in split_by_host(recs):
        for h in hosts:
            nodes.setdefault(h, NodeWindows(h)).feed(r)
        if r.get("kind") == "rank" and r["rank"] == 3:
            dark = r["host"]
        now = max(nw.now for nw in nodes.values())
        due = now + 0.5 if due is None else due
        if now >= due:
            windows = [nw.window() for h, nw in nodes.items() if h != dark or now < cut]
            if now >= cut and dark is not None:
                det.set_dark([dark])
            out.extend(det.ingest(windows))
            due = now + 0.5
    silence = LostConfig().lost_silence_s
    assert now > cut + 2 * silence  # long past the silence that calls a rank lost
    assert not [v for v in out if v["state"] == "flagged"], out
    assert det.pipeline.stats["steps"] >= 110  # the other ranks' steps were judged
    # The single daemon, its records cut the same way, does call it lost:
    # what keeps the leader quiet is knowing the daemon, not the rank, went.
    host = {r["rank"]: r["host"] for r in recs if r.get("kind") == "rank"}[3]
    gone = [r for r in recs if not (r.get("rank") == 3 and r.get("kind") in ("coll", "step")
            and trace.record_time(r) > cut) and not (r.get("host") == host and r.get("kind")
            == "flow" and r["t"] > cut)]  # fmt: skip
    assert "rank_lost" in {v["cause"] for v in Pipeline().feed_many(gone)}


def test_a_late_nodes_backlog_says_every_one_of_its_ranks_lives() -> None:
    rng = random.Random(5)

    def window(node: str, ranks: list[int], steps: range, seq: int) -> CS.Window:
        digests = tuple(
            CS.digest_step(
                s,
                {r: _colls(rng, r, s, [2 * s, 2 * s + 1], 0.0) for r in ranks},
                {
                    r: {
                        "kind": "step",
                        "rank": r,
                        "step": s,
                        "start": 100.0 + s,
                        "end": 100.5 + s + r / 100,
                    }
                    for r in ranks
                },
            )
            for s in steps
        )
        return CS.Window(node, seq, 100.5 + steps[-1] + 0.1, (), digests, (), ())

    det = LeaderDetector()
    det.ingest([window("a", [0, 1], range(0, 6), 0)])
    corr = det.corr
    assert corr.summarised >= 3
    # Node b's daemon reached the store late: its whole backlog in one window,
    # steps the leader already judged. Too late to judge, but each of its
    # ranks (not only the digest's first) lives and got to step 3.
    det.ingest([window("b", [2, 3], range(0, 4), 0)])
    for r in (2, 3):
        rs = corr.ranks[r]
        assert (rs.done_step, rs.first_step) == (3, 0)
        # Heard from at its step 3 record's end at least (a late collective of
        # it may have ended later: heard_late counts that too).
        assert 103.5 + r / 100 <= rs.last_t <= 103.6 + r / 100


def test_election_rank_zeros_node_leads_then_the_next_by_lowest_rank() -> None:
    roster = [(4, "b"), (0, "a"), (8, "c")]
    assert leader_of(roster, []) == "a"
    assert leader_of(roster, ["a"]) == "b"
    assert leader_of(roster, ["a", "b", "c"]) is None
    live = Liveness(miss=2)
    assert live.observe({"a": 0, "b": 0}) == frozenset()
    assert live.observe({"a": 0, "b": 1}) == frozenset()
    assert live.observe({"a": 0, "b": 2}) == frozenset({"a"})  # two windows without a beat
    assert live.observe({"a": 1, "b": 3}) == frozenset()  # back


def test_a_window_that_is_not_one_is_a_clear_error() -> None:
    for bad in (b"", b"[]", b'{"node": 1}', b"\xff"):
        with pytest.raises(ValueError, match="not a cluster window"):
            CS.decode(bad)
    rng = random.Random(3)
    d = CS.digest_step(0, {r: _colls(rng, r, 0, [0, 1, 2], 0.0) for r in range(3)})
    good = CS.encode(CS.Window("n", 0, 0.0, (), (d,), (), ()))
    assert list(CS.decode(good).digests[0].ranks) == [0, 1, 2]
    # Cut short, one byte too many, a rank's group out of range.
    wrong_group = CS.encode(CS.Window("n", 0, 0.0, (), (d._replace(group=[0, 0, 5]),), (), ()))
    for bad in (good[:-1], good + b"\0", wrong_group):
        with pytest.raises(ValueError, match="not a cluster window"):
            CS.decode(bad)
    # The leader's round: a bad window is left out alone and counted.
    rnd = decode_round([good, good[:-1], b"\xff", good])
    assert rnd.bad == 2 and [w.node for w in rnd.windows] == ["n", "n"]
    assert list(rnd.steps) == [0] and list(rnd.steps[0].ranks) == [0, 1, 2] * 2
    # Columns that do not agree are found in the round too (read window by
    # window then): a group out of range, a count its group does not have, last
    # positions that do not add up or lie outside the keys.
    ix = list(d.last_ix)
    wrongs: list[dict[str, Any]] = [
        {"group": [0, 0, 5]},
        {"group": [0, 0, -2]},
        {"n_coll": [3, 3, 2]},
        {"last_n": [n + 1 for n in d.last_n]},
        {"last_ix": ix[:-1] + [7]},
        {"last_ix": ix[:-1] + [-1]},
    ]
    for wrong in wrongs:
        bad = CS.encode(CS.Window("n", 0, 0.0, (), (d._replace(**wrong),), (), ()))
        with pytest.raises(ValueError, match="not a cluster window"):
            CS.decode(bad)
        rnd = decode_round([good, bad, good])
        assert rnd.bad == 1 and list(rnd.steps[0].ranks) == [0, 1, 2] * 2, wrong


def test_rank_records_name_the_jobs_store_from_torchruns_environment() -> None:
    from fsdp_sentinel.hooks import store_address

    assert store_address({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == "10.0.0.1:29500"
    assert store_address({"MASTER_ADDR": "fd00::1", "MASTER_PORT": "29500"}) == "[fd00::1]:29500"
    assert store_address({"MASTER_ADDR": "10.0.0.1"}) == ""
    assert store_address({"MASTER_ADDR": "h", "MASTER_PORT": "x"}) == ""


def test_a_steady_round_is_read_for_every_node_at_once() -> None:
    # The leader's usual round: every window one digest of the same run of
    # keys, alone. Read at once (one numpy read a field for every node), it is
    # what reading it window by window gives; a round with anything else in
    # it is read window by window.
    rng = random.Random(3)
    keys = list(range(40, 48))
    digests = [
        CS.digest_step(
            7,
            {r: _colls(rng, r, 7, keys, 0.0) for r in range(4 * i, 4 * i + 4)},
            {r: {"start": 40.0, "end": 49.0 + r / 10} for r in range(4 * i, 4 * i + 3)},
        )
        for i in range(5)
    ]
    blobs = [
        CS.encode(CS.Window(f"node-{i}", 9, 50.0 + i, (), (d,), (), ()))
        for i, d in enumerate(digests)
    ]
    fast = CS._uniform_round(blobs)
    assert fast is not None and fast.plain  # digests alone: each window its clock alone
    assert _as_text(CS.decode_round(blobs).steps[7]) == _as_text(fast.steps[7])
    slow = CS._round_of_windows(blobs)
    assert fast.windows == slow.windows and fast.bad == slow.bad == 0
    assert _as_text(fast.steps[7]) == _as_text(slow.steps[7])
    assert fast.steps[7].extremes is not None and len(fast.steps[7].groups) == 5
    assert all(g.keys is fast.steps[7].groups[0].keys for g in fast.steps[7].groups)
    # Windows that carry records, progress, probe polls or flow rows beside
    # such a digest are read at once too (a job whose steps outlast the probe
    # interval: every round), each as read alone.
    rows, y_rows = FlowRowsBuilder(), FlowRowsBuilder()
    for rec in _flows(3, "node-x", 50.5):
        rows.add(rec)
    for rec in _flows(3, "node-y", 50.5):
        y_rows.add(rec)
    with_more = [
        *blobs,
        CS.encode(
            CS.Window(
                "node-x",
                9,
                51.0,
                ({"kind": "conn", "t": 50.5, "what": "open"},),
                (digests[0],),
                ((0, 50.2, 7, 47),),
                (("host-x", 50.5, 1.0),),
                rows.take(),
            )
        ),  # fmt: skip
        CS.encode(CS.Window("node-y", 9, 51.0, (), (digests[1],), (), (), y_rows.take())),
    ]
    fast = CS._uniform_round(with_more)
    slow = CS._round_of_windows(with_more)
    assert fast is not None and fast.windows == slow.windows and not fast.plain
    assert fast.windows[5].heard == (("host-x", 50.5, 1.0),) and len(fast.flows) == 6
    assert _as_text(fast.steps[7]) == _as_text(slow.steps[7])
    assert fast.flows.rows.tobytes() == slow.flows.rows.tobytes()
    assert fast.flows.strings.tolist() == slow.flows.strings.tolist()
    # Read again, node-y's JSON (its rows' strings alone) is known: its rows
    # are cut from the blob, not read through a window; the same round.
    again = CS._uniform_round(with_more)
    assert again is not None and again.windows == slow.windows
    assert again.flows.rows.tobytes() == slow.flows.rows.tobytes()
    assert again.flows.strings.tolist() == slow.flows.strings.tolist()
    assert again.flows.window.tolist() == slow.flows.window.tolist() == [5] * 3 + [6] * 3
    # Not such a round: two steps, or other keys.
    other = CS.digest_step(8, {99: _colls(rng, 99, 8, keys, 0.0)})
    shifted = CS.digest_step(7, {99: _colls(rng, 99, 7, [k + 1 for k in keys], 0.0)})
    for odd in (
        CS.Window("x", 9, 51.0, (), (other,), (), ()),
        CS.Window("x", 9, 51.0, (), (shifted,), (), ()),
        CS.Window("x", 9, 51.0, (), (digests[0], other), (), ()),
    ):
        mixed = [*blobs, CS.encode(odd)]
        assert CS._uniform_round(mixed) is None
        assert _as_text(CS.decode_round(mixed).steps[7]) == _as_text(
            CS._round_of_windows(mixed).steps[7]
        )
    # A blob whose group's fixed fields lie (its key count one short, so 16
    # bytes are left past its columns; keys sent in another form) is left out
    # and counted, as when read window by window.
    form_at = CS._HEAD.size + len("node-1") + CS._DIGEST.size
    for at, value in ((form_at, b"\x01"), (form_at, b"\x07"), (form_at + 9, b"\x07")):
        lying = bytearray(blobs[1])
        lying[at : at + 1] = value
        rnd = CS.decode_round([blobs[0], bytes(lying), blobs[2]])
        assert rnd.bad == 1 and [w.node for w in rnd.windows] == ["node-0", "node-2"]


def _flows(n: int, host: str, t: float) -> list[dict]:
    """``n`` plain flow records of ``host`` at ``t``, in the probes' forms (int
    srtt, float srtt, none; a cwnd or not; D-SACKs or not)."""
    out = []
    for i in range(n):
        rec = {"kind": "flow", "t": t, "dt": 1.0, "host": host, "pid": 100 + i,
               "src": f"198.18.0.{i}:4000", "dst": f"198.18.1.{i}:29500",
               "tx_bytes": 1000 * i, "rx_bytes": 7, "retrans": i % 2}  # fmt: skip
        if i % 3 != 2:
            rec["srtt_us"] = 250 + i if i % 3 == 0 else 250.5 + i
        if i % 2:
            rec["cwnd"] = 10 + i
            rec["dsack_dups"] = 1
        out.append(rec)
    return out


def _as_text(d: CS.StepDigest) -> str:
    return repr(_as_lists(d))  # NaN (no step record) equal to NaN


def test_a_nodes_strings_kept_are_bounded_in_count_and_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nodes whose flows change every round send new strings every round: the
    # strings read once are kept up to a count and a byte budget, then begun
    # again; every window still reads back as it was sent.
    monkeypatch.setattr(CS, "_STRINGS_ONLY", {})
    monkeypatch.setattr(CS, "_strings_bytes", [0])
    monkeypatch.setattr(CS, "_STRINGS_KEPT_BYTES", 4096)
    for i in range(40):
        rows = FlowRowsBuilder()
        for rec in _flows(3, f"host-{i}", 50.5):
            rows.add(rec)
        w = CS.Window(f"node-{i}", 9, 51.0, (), (), (), (), rows.take())
        back = CS.decode(CS.encode(w))
        assert back.flows == w.flows
        assert sum(map(len, CS._STRINGS_ONLY)) == CS._strings_bytes[0] <= 4096
    assert 0 < len(CS._STRINGS_ONLY) < 40


def test_a_steady_rounds_flow_windows_held_as_last_round_read_as_alone() -> None:
    # Every node's window a digest and flow rows alone, round after round: the
    # third read finds each JSON where it was (checked in place, not hashed);
    # a node whose JSON changed (one byte, the same length) or a window that
    # moved is not read as last round's, and every read is each window alone.
    rng = random.Random(5)
    keys = list(range(40, 48))

    def blobs_of(hosts: list[str], t: float) -> list[bytes]:
        out = []
        for i, host in enumerate(hosts):
            d = CS.digest_step(7, {r: _colls(rng, r, 7, keys, 0.0) for r in (2 * i, 2 * i + 1)})
            rows = FlowRowsBuilder()
            for rec in _flows(3, host, t):
                rows.add(rec)
            out.append(CS.encode(CS.Window(f"node-{i}", 9, t + 0.5, (), (d,), (), (), rows.take())))
        return out

    def same(fast: CS.Round | None, blobs: list[bytes]) -> None:
        slow = CS._round_of_windows(blobs)
        assert fast is not None and fast.windows == slow.windows
        assert fast.flows.rows.tobytes() == slow.flows.rows.tobytes()
        assert fast.flows.strings.tolist() == slow.flows.strings.tolist()
        assert fast.flows.window.tolist() == slow.flows.window.tolist()

    hosts = ["host-a", "host-b", "host-c"]
    steady = blobs_of(hosts, 50.5)
    for _ in range(3):
        same(CS._uniform_round(steady), steady)
    assert len(CS._LAST_FLOWS[1]) == 3  # kept for the next round
    changed = blobs_of(["host-a", "host-x", "host-c"], 50.5)  # host-b's JSON, a byte off
    got = CS._uniform_round(changed)
    same(got, changed)
    assert got is not None and any("host-x" in s for s in got.flows.strings.tolist())
    moved = blobs_of(["host-c", "host-a", "host-x"], 50.5)
    same(CS._uniform_round(moved), moved)
    fewer = blobs_of(["host-a", "host-x"], 50.5)
    same(CS._uniform_round(fewer), fewer)


def test_a_node_is_given_every_host_its_rows_name_round_after_round() -> None:
    # The leader notes a round's (window, host)s once while rounds repeat
    # them: a host a node's rows name later is still the node's, and so are
    # the same rows' hosts when other nodes send them (nodes in other places).
    det = LeaderDetector()

    def ingest(t: float, spec: list[tuple[str, list[str]]]) -> None:
        blobs = []
        for node, hosts in spec:
            rows = FlowRowsBuilder()
            for host in hosts:
                for rec in _flows(2, host, t):
                    rows.add(rec)
            blobs.append(CS.encode(CS.Window(node, 9, t + 0.5, (), (), (), (), rows.take())))
        det.ingest(decode_round(blobs))

    ingest(10.0, [("node-a", ["h0"]), ("node-b", ["h1"])])
    ingest(11.0, [("node-a", ["h0"]), ("node-b", ["h1"])])
    ingest(12.0, [("node-a", ["h0", "h2"]), ("node-b", ["h1"])])
    assert det.node_hosts == {"node-a": {"h0", "h2"}, "node-b": {"h1"}}
    ingest(13.0, [("node-a", ["h0", "h2"]), ("node-b", ["h1"])])
    ingest(14.0, [("node-b", ["h0", "h2"]), ("node-a", ["h1"])])
    assert det.node_hosts == {"node-a": {"h0", "h1", "h2"}, "node-b": {"h0", "h1", "h2"}}
