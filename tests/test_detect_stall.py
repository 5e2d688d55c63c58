"""The hang and silent-loss rules (detect/stall.py) on synthetic jobs and small summaries.

Synthetic jobs (fsdp_sentinel.synth) give exact onsets: a rank that stops
before a collective, a host cut off, a normal end, a slow job whose
collectives wait long and complete. The truth comes from the scenario, the
delay is measured from the fault's own time. Real captures of a SIGSTOPped
rank and a downed switch port are golden traces (test_detect_golden.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_sentinel import synth as S
from fsdp_sentinel.correlate import Pending, RankLiveness, Stall, Summary
from fsdp_sentinel.detect import DetectConfig, DetectState, detect
from fsdp_sentinel.detect.stall import judge_stall
from fsdp_sentinel.detect.state import NEW_TRACK
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.truth import judge

Record = dict[str, Any]


def run(scn: S.Scenario) -> tuple[list[Record], dict[str, Any], list[Record]]:
    recs, truth = S.generate(scn)
    return recs, truth, Pipeline().feed_many(recs)


def flagged(verdicts: list[Record], cause: str | None = None) -> list[Record]:
    return [v for v in verdicts if v["state"] == "flagged" and cause in (None, v["cause"])]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("coll", [0, 1, 5])
def test_a_hung_rank_is_named_within_3_s_with_its_collective(seed: int, coll: int) -> None:
    scn = S.Scenario(seed=seed, jitter=0.08, faults=(S.Hang(2, 15, coll=coll),))
    recs, truth, verdicts = run(scn)
    assert judge(verdicts, truth).ok
    (v,) = flagged(verdicts)
    assert (v["rank"], v["cause"], v["step"]) == (2, "hang", 15)
    assert v["t"] - truth["stragglers"][0]["onset_t"] <= 3.0
    # The evidence names the collective the others wait in, as their records say.
    waiting = [r for r in recs if r["kind"] == "pending" and r["t"] <= v["t"]]
    assert {r["rank"] for r in waiting} == set(v["evidence"]["waiting_ranks"]) == {0, 1, 3}
    assert {(r["op"], r["seq"], r["step"]) for r in waiting} == {
        (v["evidence"]["op"], v["evidence"]["seq"], v["evidence"]["step"])
    }
    assert v["evidence"]["newest_seq"] < v["evidence"]["seq"]


def test_a_hang_that_ends_is_cleared_when_the_rank_issues_again() -> None:
    _, truth, verdicts = run(S.Scenario(seed=4, jitter=0.08, faults=(S.Hang(1, 12, 6.0),)))
    assert [(v["rank"], v["state"], v["cause"]) for v in verdicts] == [
        (1, "flagged", "hang"),
        (1, "cleared", "hang"),
    ]
    onset = truth["stragglers"][0]["onset_t"]
    assert verdicts[0]["t"] - onset <= 3.0
    assert verdicts[1]["t"] - onset >= 6.0  # not before it went on


def test_without_probes_the_daemon_clock_alone_lets_a_hang_be_named() -> None:
    # --no-probes: no netdev/flow records. Once the rank hangs, the waiting
    # ranks' pending records and the daemon's clock records are all there is.
    scn = S.Scenario(seed=5, jitter=0.08, probes=False, daemon_clock=True, faults=(S.Hang(3, 10),))
    recs, truth, verdicts = run(scn)
    assert not [r for r in recs if r["kind"] in ("netdev", "flow")]
    assert judge(verdicts, truth).ok
    v = flagged(verdicts)[0]
    assert v["t"] - truth["stragglers"][0]["onset_t"] <= 3.0
    # Without any pending record (hooks of an older release) time still passes
    # on the clock records, but a hang has nothing to show it.
    no_pending = [r for r in recs if r["kind"] != "pending"]
    assert not flagged(Pipeline().feed_many(no_pending), "hang")


@pytest.mark.parametrize("seed", [1, 2])
def test_a_silent_host_loses_every_rank_on_it_without_a_close_or_reset(seed: int) -> None:
    scn = S.Scenario(seed=seed, ranks=8, ranks_per_host=2, jitter=0.08,
                     faults=(S.SilentHost(5, 12),))  # fmt: skip
    recs, truth, verdicts = run(scn)
    onset = truth["stragglers"][0]["onset_t"]
    assert not [r for r in recs if r["kind"] == "conn" and r["what"] != "open"]
    assert judge(verdicts, truth).ok
    lost = flagged(verdicts)
    assert sorted(v["rank"] for v in lost) == [4, 5]  # both ranks of host synth-h2
    assert {v["cause"] for v in lost} == {"rank_lost"}
    assert all(v["t"] - onset <= 3.0 for v in lost)
    assert all(v["evidence"]["others_heard"] for v in lost)


def test_one_rank_gone_records_and_all_is_lost_not_hung() -> None:
    recs, truth, verdicts = run(S.Scenario(seed=3, jitter=0.08, faults=(S.SilentHost(1, 20),)))
    assert [(v["rank"], v["cause"]) for v in flagged(verdicts)] == [(1, "rank_lost")]
    assert judge(verdicts, truth).ok


@pytest.mark.parametrize("probes", [True, False])
def test_a_normal_end_is_never_lost_or_hung(probes: bool) -> None:
    scn = S.Scenario(seed=6, jitter=0.08, close_at_end=True, tail_s=10.0, probes=probes,
                     daemon_clock=not probes)  # fmt: skip
    recs, _, verdicts = run(scn)
    assert [r for r in recs if r["kind"] == "conn" and r["what"] == "close"]
    assert verdicts == []


def test_a_slow_job_whose_collectives_wait_long_and_complete_never_hangs() -> None:
    # Rank 1 computes 2.2x slower for 12 steps: every collective keeps the
    # others waiting ~1.2 s, long enough for pending records, and completes.
    scn = S.Scenario(seed=7, jitter=0.08, compute_s=3.0, n_coll=2, steps=20,
                     faults=(S.SlowCompute(1, 2.2, 8, 20),))  # fmt: skip
    recs, truth, verdicts = run(scn)
    assert sum(r["kind"] == "pending" for r in recs) > 20
    assert not flagged(verdicts, "hang") and not flagged(verdicts, "rank_lost")
    assert judge(verdicts, truth).ok  # the compute straggler itself is found


# ----------------------------------------------------------------- the rule on hand-made summaries


def summary(
    t: float,
    pending: list[Pending],
    newest: dict[int, int],
    heard: dict[int, float] | None = None,
    **stall: Any,
) -> Summary:
    """A clock tick's summary; ``heard``: a rank's newest hook record (default 100.0)."""
    last = heard or {}
    live = tuple(
        RankLiveness(r, f"h{r}", last.get(r, 100.0), 9, 0, 3, None, False, 0) for r in sorted(newest)
    )  # fmt: skip
    st = Stall(tuple(pending), tuple(sorted(newest.items())), **stall)
    return Summary(t, None, (), (), live, 9, True, st)


CFG = DetectConfig().stall


def waiting(rank: int, seq: int = 40, issue: float = 100.0, t: float = 102.0) -> Pending:
    return Pending(rank, seq, 10, "all_gather", issue, t)


def test_the_stall_must_outlast_a_few_of_the_jobs_steps() -> None:
    s = summary(102.1, [waiting(0), waiting(1)], {0: 39, 1: 39, 2: 39})
    _, hung, out = judge_stall(s, {}, {}, CFG, 0.3)
    assert hung == {2: 40} and [v.cause for v in out] == ["hang"]
    # A job of 1 s steps: 2.1 s pending is two steps, no stall yet.
    _, hung, out = judge_stall(s, {}, {}, CFG, 1.0)
    assert hung == {} and out == []


def test_a_rank_behind_that_is_still_completing_collectives_is_catching_up_not_hung() -> None:
    # A cut healed (regress-one-way-cut-healed-called-hang): rank 0 got through
    # the stalled collective first and waits on the next (seq 41, issued before
    # the cut); ranks 1 and 2 are still finishing seq 40, their records coming in.
    pend = [waiting(0, seq=41, issue=95.0, t=101.9)]
    newest = {0: 41, 1: 40, 2: 40}
    s = summary(102.1, pend, newest, heard={0: 101.5, 1: 101.9, 2: 101.4})
    assert judge_stall(s, {}, {}, CFG, 0.3) == ({}, {}, [])
    # Once they fall silent behind it, they are hung.
    s2 = summary(102.5, pend, newest, heard={0: 101.5, 1: 101.9, 2: 101.4})
    _, hung, out = judge_stall(s2, {}, {}, CFG, 0.3)
    assert hung == {2: 41} and [(v.rank, v.cause) for v in out] == [(2, "hang")]


def test_stale_pending_records_say_nothing() -> None:
    s = summary(110.0, [waiting(0, t=102.0), waiting(1, t=102.0)], {0: 39, 1: 39, 2: 39})
    assert judge_stall(s, {}, {}, CFG, 0.3)[2] == []


def test_everyone_waiting_and_every_retransmit_touching_one_rank_is_a_cut_off_host() -> None:
    pend = [waiting(r) for r in range(4)]
    newest = {r: 40 for r in range(4)}
    s = summary(102.1, pend, newest, retrans=((1, 2, 3), (2, 1, 2), (2, 3, 3), (3, 2, 1)))
    lost, hung, out = judge_stall(s, {}, {}, CFG, 0.3)
    assert hung == {} and list(lost) == [2]
    (v,) = out
    assert (v.rank, v.cause, v.evidence["unreachable"]) == (2, "rank_lost", True)
    # Two ranks share every such flow: either end could be the one cut off.
    s2 = summary(102.1, pend[:2], {0: 40, 1: 40}, retrans=((0, 1, 3), (1, 0, 3)))
    assert judge_stall(s2, {}, {}, CFG, 0.3)[2] == []
    # Retransmits on flows that do not share a rank: no single host to blame.
    s3 = summary(102.1, pend, newest, retrans=((0, 1, 3), (2, 3, 3)))
    assert judge_stall(s3, {}, {}, CFG, 0.3)[2] == []


@pytest.mark.parametrize("reader", [(1, 2), (2, 3)])
def test_a_link_that_still_carries_bytes_while_tcp_resends_is_lossy_not_cut(
    reader: tuple[int, int],
) -> None:
    # 10 % loss out of rank 2 (a lab capture, regress-packet-loss-stall-called-lost):
    # the first slow reduce-scatter waits 4 s with every retransmit on rank 2's
    # flows, as a cut-off host's would, but its peers go on reading its bytes.
    pend = [waiting(r) for r in range(4)]
    newest = {r: 40 for r in range(4)}
    retrans = ((2, 1, 69), (2, 3, 45))
    got = ((*reader, 37_648),)
    s = summary(102.1, pend, newest, retrans=retrans, delivered=got)
    lost, hung, out = judge_stall(s, {}, {}, CFG, 0.3)
    assert lost == {} and hung == {}
    # The link is the stall's cause: network on rank 2, priced by the stall.
    (v,) = out
    assert (v.rank, v.state, v.cause, v.step) == (2, "flagged", "network", 10)
    ev = v.evidence
    assert ev["lossy"] and ev["scope"] == "node" and ev["delivered"] == [[*reader, 37_648]]
    assert (ev["job_step_s"], ev["baseline_step_s"]) == (2.1, 0.3)
    # Bytes that crossed other ranks' links say nothing about rank 2's.
    s2 = summary(102.1, pend, newest, retrans=retrans, delivered=((0, 1, 37_648),))
    assert [(v.rank, v.cause) for v in judge_stall(s2, {}, {}, CFG, 0.3)[2]] == [(2, "rank_lost")]


def test_a_lossy_stall_opens_the_ranks_network_track_once() -> None:
    # Through detect(): the verdict opens rank 2's network track (as the
    # network rule's own flag would), and the next tick of the same stall
    # says nothing more; an open verdict of another cause is not replaced.
    pend = [waiting(r) for r in range(4)]
    newest = {r: 40 for r in range(4)}
    s = summary(102.1, pend, newest, retrans=((2, 1, 69), (2, 3, 45)), delivered=((1, 2, 9),))
    cfg = DetectConfig()
    rep = detect(s, DetectState(), cfg)
    assert [(v.rank, v.cause) for v in rep.verdicts] == [(2, "network")]
    tr = rep.state.tracks.get(2)
    assert tr is not None and (tr.cause, tr.flagged_step, tr.bad, tr.clean) == (
        "network", 10, cfg.persistence.flag_after, 0
    )  # fmt: skip
    again = detect(s._replace(t=102.6), rep.state, cfg)
    assert again.verdicts == () and again.state.tracks.get(2) == tr
    busy = DetectState(tracks={2: NEW_TRACK._replace(cause="compute", flagged_step=9)})
    assert detect(s, busy, cfg).verdicts == ()


def test_a_silent_host_needs_another_host_still_heard() -> None:
    pend = [waiting(0), waiting(1)]
    newest = {0: 40, 1: 40, 2: 39}
    heard = (("h0", 102.0, 1.0), ("h1", 102.0, 1.0), ("h2", 99.5, 1.0))
    lost, hung, out = judge_stall(summary(102.1, pend, newest, hosts_heard=heard), {}, {}, CFG, 0.3)
    assert list(lost) == [2] and hung == {} and out[0].cause == "rank_lost"
    # Every host quiet (the daemon itself stalled): nobody is singled out, and
    # the rank that is behind is hung, not lost.
    quiet = tuple((h, 99.5, 1.0) for h, _, _ in heard)
    lost, hung, out = judge_stall(summary(102.1, pend, newest, hosts_heard=quiet), {}, {}, CFG, 0.3)
    assert lost == {} and hung == {2: 40}
