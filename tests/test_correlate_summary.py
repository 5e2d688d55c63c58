"""Correlator: lateness from wait durations, blocked time, flow and connection attribution.

Oracles are hand-computed from the records each test writes.
"""

from __future__ import annotations

import pytest

from fsdp_sentinel.correlate import Correlator


def rank_rec(rank: int, host: str, pid: int, addrs: list[str], world: int = 3) -> dict:
    return {
        "kind": "rank",
        "t": 100.0,
        "rank": rank,
        "world_size": world,
        "host": host,
        "pid": pid,
        "addrs": addrs,
    }


def coll(rank: int, step: int, seq: int, issue: float, end: float, op: str = "all_gather") -> dict:
    return {
        "kind": "coll",
        "rank": rank,
        "step": step,
        "seq": seq,
        "op": op,
        "bytes": 1000,
        "issue": issue,
        "end": end,
    }


def step_rec(rank: int, step: int, start: float, end: float) -> dict:
    return {"kind": "step", "rank": rank, "step": step, "start": start, "end": end}


def test_lateness_comes_from_wait_durations_so_clock_offsets_cancel() -> None:
    # True times: ranks issue at 0.00, 0.01, 0.05; all complete at 0.06.
    # Host clocks: rank 0 is +20 ms, rank 1 is -20 ms, rank 2 is right.
    c = Correlator()
    offs = {0: 0.020, 1: -0.020, 2: 0.0}
    issue = {0: 0.00, 1: 0.01, 2: 0.05}
    for r in range(3):
        o = 1000.0 + offs[r]
        c.add_coll(coll(r, 0, 0, o + issue[r], o + 0.06))
        c.add_step(step_rec(r, 0, o - 0.1, o + 0.08))
    s = c.step_summary(0, now=1000.1)
    by = {rs.rank: rs for rs in s.ranks}
    # waits 0.06, 0.05, 0.01 -> lateness (max wait - own wait) 0, 0.01, 0.05
    assert by[0].late_s == pytest.approx(0.0, abs=1e-9)
    assert by[1].late_s == pytest.approx(0.01, abs=1e-9)
    assert by[2].late_s == pytest.approx(0.05, abs=1e-9)
    assert (by[2].last_frac, by[0].last_frac) == (1.0, 0.0)
    assert by[2].wait_s == pytest.approx(0.01, abs=1e-9)
    assert by[2].step_s == pytest.approx(0.18, abs=1e-9)
    assert by[2].compute_s == pytest.approx(0.17, abs=1e-9)


def test_blocked_time_is_the_union_of_overlapping_collectives() -> None:
    c = Correlator()
    c.add_coll(coll(0, 0, 0, 10.0, 10.3))
    c.add_coll(coll(0, 0, 1, 10.2, 10.5))  # overlaps the first (prefetch)
    c.add_coll(coll(0, 0, 2, 11.0, 11.1, op="reduce_scatter"))
    c.add_step(step_rec(0, 0, 9.9, 11.2))
    (rs,) = c.step_summary(0, now=11.2).ranks
    assert rs.wait_s == pytest.approx(0.6)  # [10.0, 10.5] + [11.0, 11.1]
    assert rs.compute_s == pytest.approx(1.3 - 0.6)
    assert rs.matched == 0  # nobody else reported these collectives
    assert c.ranks[0].coll_count == {"all_gather": 2, "reduce_scatter": 1}
    assert c.ranks[0].coll_bytes == {"all_gather": 2000, "reduce_scatter": 1000}


def test_per_op_totals_follow_each_step_and_count_bad_fields() -> None:
    # Two steps with the same collectives (FSDP repeats them), then one whose
    # op and byte fields are wrong: those collectives still count in their
    # step's summary, go under str(op) with no bytes, and each bad field is
    # counted as malformed.
    c = Correlator()
    for step in (0, 1):
        t = 10.0 * step
        c.add_coll(coll(0, step, 0, t, t + 0.25))
        c.add_coll(coll(0, step, 1, t + 1.0, t + 1.5, op="reduce_scatter"))
        c.step_summary(step, now=t + 2.0)
    assert c.ranks[0].coll_count == {"all_gather": 2, "reduce_scatter": 2}
    assert c.ranks[0].coll_bytes == {"all_gather": 2000, "reduce_scatter": 2000}
    assert c.ranks[0].coll_seconds == pytest.approx({"all_gather": 0.5, "reduce_scatter": 1.0})
    bad = coll(0, 2, 0, 20.0, 20.5)
    bad["op"], bad["bytes"] = 7, "many"
    nameless = coll(0, 2, 1, 21.0, 21.25)
    del nameless["op"]
    c.add_coll(bad)
    c.add_coll(nameless)
    c.add_step(step_rec(0, 2, 19.9, 21.5))
    (rs,) = c.step_summary(2, now=22.0).ranks
    assert rs.wait_s == pytest.approx(0.75)
    assert c.ranks[0].coll_count == {"all_gather": 2, "reduce_scatter": 2, "7": 1, "None": 1}
    assert c.ranks[0].coll_bytes["7"] == 0 and c.ranks[0].coll_bytes["None"] == 1000
    assert c.malformed_total() == 3  # op 7, bytes "many", no op


def test_group_field_keeps_collectives_of_different_groups_apart() -> None:
    # HSDP: seq 0 on ranks 0,1 is one shard group's all-gather, on 2,3 another's.
    c = Correlator()
    for r, (issue, end) in {0: (0.0, 0.5), 1: (0.4, 0.5), 2: (0.0, 0.1), 3: (0.0, 0.1)}.items():
        rec = coll(r, 0, 0, issue, end)
        rec["group"] = "shard-a" if r < 2 else "shard-b"
        c.add_coll(rec)
    by = {rs.rank: rs for rs in c.step_summary(0, now=1.0).ranks}
    assert by[1].late_s == pytest.approx(0.4)
    assert by[2].late_s == pytest.approx(0.0) and by[3].late_s == pytest.approx(0.0)


def flow(
    host: str, pid: int, src: str, dst: str, t: float, tx: int, srtt: float, **kw: object
) -> dict:
    rec = {
        "kind": "flow",
        "t": t,
        "dt": 1.0,
        "host": host,
        "pid": pid,
        "src": src,
        "dst": dst,
        "tx_bytes": tx,
        "rx_bytes": 10,
        "srtt_us": srtt,
    }
    rec.update(kw)
    return rec


def test_flows_are_attributed_by_addresses_in_a_lab() -> None:
    c = Correlator(flow_window_s=3.0)
    c.add_rank(rank_rec(0, "a", 11, ["198.18.0.1"]))
    c.add_rank(rank_rec(1, "b", 22, ["198.18.0.2"]))
    c.add_flow(flow("a", 11, "198.18.0.1:5000", "198.18.0.2:6000", 10.0, 1000, 2000.0))
    c.add_flow(flow("a", 11, "198.18.0.1:5000", "198.18.0.2:6000", 11.0, 3000, 4000.0, retrans=2))
    c.add_flow(flow("a", 11, "198.18.0.1:5000", "198.18.0.2:6000", 11.5, 0, 4000.0, dsack_dups=1))
    (pf,) = c.flow_matrix(now=11.5)
    assert (pf.rank, pf.peer, pf.tx_bytes, pf.retrans, pf.dsack_dups) == (0, 1, 4000, 2, 1)
    # an idle sample weighs as one byte
    assert pf.srtt_us == pytest.approx((2000 * 1000 + 4000 * 3000 + 4000 * 1) / 4001)
    # Older than the window: gone from the matrix, kept in the totals.
    assert c.flow_matrix(now=20.0) == ()
    assert (c.pairs[(0, 1)].tx_total, c.pairs[(0, 1)].dsack_total) == (4000, 1)


def test_flows_on_one_shared_address_are_attributed_by_endpoint() -> None:
    # Every rank on 127.0.0.1: the peer is whoever owns the far endpoint.
    c = Correlator()
    c.add_rank(rank_rec(0, "vm", 11, ["127.0.0.1"]))
    c.add_rank(rank_rec(1, "vm", 22, ["127.0.0.1"]))
    c.add_rank(rank_rec(2, "vm", 33, ["127.0.0.1"]))
    c.add_flow(flow("vm", 22, "127.0.0.1:7001", "127.0.0.1:7002", 5.0, 1, 1.0))  # teaches 7001 -> 1
    c.add_flow(flow("vm", 33, "127.0.0.1:7002", "127.0.0.1:7001", 5.0, 1, 1.0))  # 7002 -> 2, peer 1
    c.add_flow(flow("vm", 22, "127.0.0.1:7001", "127.0.0.1:7002", 6.0, 1, 1.0))  # now peer 2
    assert sorted(c.pairs) == [(1, 2), (2, 1)]
    assert c.unattributed_flows == 1  # the first, before 7002 was known
    c.add_flow(flow("vm", 99, "127.0.0.1:1", "127.0.0.1:2", 6.0, 1, 1.0))  # not a rank's pid
    assert c.unattributed_flows == 2


def test_flow_rank_fields_win_over_inference() -> None:
    c = Correlator()
    c.add_flow(flow("x", 1, "10.0.0.1:1", "10.0.0.2:2", 1.0, 5, 9.0, rank=4, peer_rank=7))
    assert list(c.pairs) == [(4, 7)]


def test_torn_connections_are_counted_per_rank() -> None:
    c = Correlator()
    for r in range(3):
        c.add_rank(rank_rec(r, f"h{r}", 10 + r, [f"198.18.0.{r + 1}"]))
    for a in range(3):
        for b in range(3):
            if a != b:
                c.add_conn(
                    {
                        "kind": "conn",
                        "t": 1.0,
                        "host": f"h{a}",
                        "pid": 10 + a,
                        "src": f"198.18.0.{a + 1}:{900 + b}",
                        "dst": f"198.18.0.{b + 1}:{900 + a}",
                        "what": "open",
                    }
                )
    for b in (0, 2):  # rank 1 dies: its own sockets close, the others see resets
        c.add_conn(
            {
                "kind": "conn",
                "t": 5.0,
                "host": "h1",
                "pid": 11,
                "src": f"198.18.0.2:{900 + b}",
                "dst": f"198.18.0.{b + 1}:901",
                "what": "close",
            }
        )
        c.add_conn(
            {
                "kind": "conn",
                "t": 5.001,
                "host": f"h{b}",
                "pid": 10 + b,
                "src": f"198.18.0.{b + 1}:901",
                "dst": f"198.18.0.2:{900 + b}",
                "what": "reset",
            }
        )
    lv = {x.rank: x for x in c.liveness()}
    assert (lv[1].torn_peers, lv[1].peers, lv[1].self_closed, lv[1].torn_t) == (2, 2, True, 5.0)
    assert (lv[0].torn_peers, lv[0].peers, lv[0].self_closed) == (1, 2, False)
    c.revive(1)
    assert c.liveness()[1].torn_peers == 0


def test_records_arriving_after_their_step_was_summarised_are_counted_late() -> None:
    c = Correlator()
    c.add_step(step_rec(0, 0, 0.0, 1.0))
    c.add_step(step_rec(0, 1, 1.0, 2.0))
    c.add_coll(coll(0, 0, 0, 0.1, 0.2))  # arrives after step 0's step record: still filed
    c.step_summary(1, now=2.0)  # step 0 never summarised: its records are dropped as late
    assert c.late_records == 2
    assert c.pending_steps() == []


def test_a_bad_field_drops_only_its_record_and_is_counted() -> None:
    c = Correlator()
    for r in (0, 1):
        c.add_coll(coll(r, 0, 0, 1.0, 1.2))
        bad = coll(r, 0, 1, 1.3, 1.4)
        if r == 0:
            bad["issue"] = "soon"  # timing unusable: the record is dropped
        else:
            bad["bytes"] = "lots"  # timing fine, byte count not: counted, no bytes
        c.add_coll(bad)
        c.add_step(step_rec(r, 0, 0.9, 1.5))
    by = {rs.rank: rs for rs in c.step_summary(0, now=1.5).ranks}
    assert (by[0].n_coll, by[1].n_coll) == (1, 2)
    # Seq 1 came from rank 1 only, so the ranks' keys differ: matched per key.
    assert (by[0].matched, by[1].matched) == (1, 1)
    assert c.ranks[1].coll_count == {"all_gather": 2}
    assert c.ranks[1].coll_bytes == {"all_gather": 1000}
    assert c.ranks[0].coll_bytes == {"all_gather": 1000}
    assert c.malformed_total() == 2  # the dropped record and the bad byte count


def test_a_rank_back_from_lost_drops_the_liveness_a_tick_held() -> None:
    # revive() forgets the rank's torn connections, which liveness shows: a
    # step summarised after it in the same tick must read liveness afresh.
    corr = Correlator()
    corr.add_rank(rank_rec(0, "h0", 10, ["198.18.0.1"]))
    corr.held_liveness = corr.liveness()
    corr.mark_lost(0)
    assert corr.held_liveness is not None  # being marked lost changes no figure it shows
    corr.revive(0)
    assert corr.held_liveness is None
