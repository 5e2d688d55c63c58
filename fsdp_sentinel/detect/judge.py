"""One rank's judgement in one step: the per-rank rules in order (pure).

:func:`judge_rank` scores a rank against its track (``compute``), picks its
candidate cause (compute before network), applies persistence, and says
what its next track, score and verdict are. ``detect()`` calls it for
every rank of a small job, and ``detect.columnar`` for the few ranks of a
large one whose step is more than pushing histories.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from fsdp_sentinel.correlate import LivenessColumns, Summary
from fsdp_sentinel.detect import compute, network, persistence
from fsdp_sentinel.detect.config import DetectConfig
from fsdp_sentinel.detect.state import RankScore, RankTrack
from fsdp_sentinel.detect.stats import rnd
from fsdp_sentinel.rankstep import RankStep
from fsdp_sentinel.trace import Verdict


def host_of(summary: Summary, rank: int) -> str:
    """The host a rank runs on, for a verdict (looked up only when one is made)."""
    live = summary.liveness
    if isinstance(live, LivenessColumns):  # a big job: by row, not a RankLiveness each
        row = live.row_of(rank)
        return "" if row is None else live.host[row]
    return next((lv.host for lv in live if lv.rank == rank), "")


class StepContext(NamedTuple):
    """What every rank's judgement in one step reads (:func:`_judge_rank`)."""

    summary: Summary
    step: int
    cfg: DetectConfig
    n_lates: int
    lates_sorted: list[float]
    ref_step: float | None
    base: float | None
    bar: float
    low: float
    attributed: float | None
    n_flagged: int
    warm: bool
    stretched_now: bool
    stall_explained: bool
    net: network.NetView
    explainers: frozenset[int]
    job_step: float | None
    stretch: float | None
    #: ``lates_sorted`` as an array, for the columnar judge (None: made from it)
    lates_array: Any = None


class Judged(NamedTuple):
    """One rank's judgement in one step: its next track, its score, the verdict it
    raised (None: none), its relative score now (for the noise pool) and whether
    its window's score was suspect (at least ``min_effect``)."""

    track: RankTrack
    score: RankScore
    verdict: Verdict | None
    rel_now: float | None
    suspect: bool


def judge_rank(rs: RankStep, tr: RankTrack, ctx: StepContext) -> Judged:
    """Score one rank against its track, pick its candidate cause, and apply persistence."""
    (
        summary, step, cfg, n_lates, lates_sorted, ref_step, base, bar, low, attributed,
        n_flagged, warm, stretched_now, stall_explained, net, explainers, job_step, stretch,
        _lates_array,
    ) = ctx  # fmt: skip
    verdict: Verdict | None = None
    mine = attributed if n_flagged == (1 if tr.cause else 0) else None
    (
        rel_now,
        rel_hist,
        relative,
        ind_hist,
        individual,
        rel_long,
        slow,
        rel_trend,
        aging,
    ) = compute.score(rs, tr, n_lates, lates_sorted, ref_step, base, bar, low, cfg, mine)

    # One candidate cause per rank: compute (it arrives last) before
    # network (the job is slow while nobody is late).
    candidate: str | None = None
    if warm and compute.is_candidate(slow, relative, individual, bar, cfg):
        candidate = "compute"
    elif (
        stretched_now
        and (tr.cause == "network" or not stall_explained)
        and network.is_candidate(rs.rank, net, tr.cause == "network", cfg.network)
        and (
            tr.cause == "network"
            or not (explainers - {rs.rank})
            or network.stands_beside(rs.rank, net, cfg.network)
        )
    ):
        candidate = "network"
    # A quick step between slow ones, while the flows still name the rank (a
    # lossy host: TCP recovers some steps' losses quickly, others only after
    # timeouts), says nothing either way: the run of bad windows waits for the
    # next judged step instead of starting over. Else a host losing 10 % of
    # its packets, the job 2x slower, was never flagged when its slow steps
    # alternated with quick ones (each quick step counted clean).
    waiting_case = (
        candidate is None
        and tr.cause is None
        and tr.bad > 0
        and not stretched_now
        and network.is_candidate(rs.rank, net, False, cfg.network)
    )

    cause, flagged_step = tr.cause, tr.flagged_step
    compute_hist, compute_sorted = compute.own_history(
        tr, rs, candidate is None and cause is None, rel_now, bar, cfg.baseline.history
    )
    bad, clean, action = persistence.step(
        tr.bad,
        tr.clean,
        cause,
        candidate,
        (rel_now is not None or stretch is not None) and not waiting_case,
        cfg.persistence,
    )
    if action is persistence.FLAG and candidate is not None:
        cause, flagged_step = candidate, step
        peer = None
        if candidate == "compute":
            ratio = net.ratio.get(rs.rank, 1.0)
            score, evidence = compute.evidence(
                rs,
                relative,
                individual,
                ratio if ratio >= 1.5 else None,
                rel_long if relative is not None and relative < bar else None,
                bar,
                rel_trend if aging is not None or relative is not None else (),
                compute.attributed_by(rel_long, relative, bar, low, mine, stretch),
            )
        else:
            score, evidence, peer = network.evidence(rs, relative, net, stretch)
        evidence["job_step_s"] = rnd(job_step)
        evidence["baseline_step_s"] = rnd(base)
        verdict = Verdict(
            summary.t,
            step,
            rs.rank,
            "flagged",
            cause,
            score,
            host_of(summary, rs.rank),
            peer,
            evidence,
        )
    elif action is persistence.CLEAR and cause is not None:
        verdict = Verdict(
            summary.t,
            step,
            rs.rank,
            "cleared",
            cause,
            (relative or 0.0) if cause == "compute" else net.ratio.get(rs.rank, 0.0),
            host_of(summary, rs.rank),
            None,
            {"clean_steps": clean, "flagged_step": flagged_step},
        )
        cause, flagged_step = None, None
    # Positional, in field order: a NamedTuple called with keywords takes
    # twice as long, and this runs for every rank of every step.
    track = RankTrack(
        rel_hist,
        ind_hist,
        compute_hist,
        bad,
        clean,
        cause,
        flagged_step,
        rel_long,
        compute_sorted,
        rel_trend,
    )
    matched = rs.matched
    return Judged(
        track,
        RankScore(
            rs.rank,
            relative,
            individual,
            net.ratio.get(rs.rank),  # network
            net.share.get(rs.rank),  # retrans_share
            rs.late_s if matched else None,
            rs.compute_s,
            rs.wait_s,
            rs.last_frac if matched else None,
            candidate,
            "flagged" if cause else "ok",  # state
            cause,
        ),
        verdict,
        rel_now,
        relative is not None and relative >= cfg.baseline.min_effect,
    )
