"""Rule ``rank_lost``: a rank whose records stopped (pure).

Lost when all its connections were closed or reset while the job was inside
a step (or, between steps, it reset some of them: a process that dies does,
one that exits in order does not), or when it has been silent for a long time
while the others carried on. Heard from again, it is cleared.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from fsdp_sentinel.correlate import LivenessColumns, RankLiveness, Summary
from fsdp_sentinel.detect.config import LostConfig
from fsdp_sentinel.trace import Verdict


def judge_lost(
    summary: Summary, lost_before: dict[int, float], cfg: LostConfig, base: float | None
) -> tuple[dict[int, float], list[Verdict]]:
    """Ranks lost (or back) by this summary's time, and their verdicts.

    ``lost_before`` maps each rank already lost to the ``last_t`` it had then;
    the map returned is the new one (the input is not changed).
    """
    lost = dict(lost_before)
    out: list[Verdict] = []
    t = summary.t
    live = summary.liveness
    for lv in _heard_again(live, lost):
        del lost[lv.rank]
        out.append(
            Verdict(
                t,
                lv.done_step + 1,
                lv.rank,
                "cleared",
                "rank_lost",
                0.0,
                lv.host,
                None,
                {"heard_again_t": round(lv.last_t, 6)},
            )
        )
    silence = max(cfg.lost_silence_s, cfg.lost_silence_steps * (base or 0.0))
    torn: list[RankLiveness] = []
    quiet: list[RankLiveness] = []
    # The two latest-heard ranks not lost: "the latest of the others" for any
    # rank in O(1) (a pass over every other rank per rank was quadratic).
    # Found only when a rank has been silent that long (rarely: most ticks and
    # steps have none), not on every summary.
    top2: list[tuple[float, int]] | None = None
    for lv in _maybe_lost(live, lost, t, silence):
        if lv.rank in lost or lv.last_t <= 0.0:
            continue
        silent = t - lv.last_t
        if (
            lv.torn_peers
            and lv.torn_peers >= lv.peers
            and silent >= cfg.lost_grace_s
            # Torn between steps is how every job ends, unless the rank reset
            # its connections: an orderly exit closes them, a dead process's
            # kernel resets the ones with data in flight.
            and (summary.mid_step or lv.done_step < summary.job_done or lv.reset_peers)
        ):
            torn.append(lv)
        elif t - max(lv.last_t, lv.pending_t) >= silence:
            # A rank still sending pending records is alive, blocked; and the
            # others carry on only by completing work (their last_t), not by
            # waiting: after a job-wide stall the first rank to finish must
            # not make every other look left behind.
            heard = max(lv.last_t, lv.pending_t)
            if top2 is None:
                top2 = _latest_two(live, lost)
            others = [o_t for o_t, o_rank in top2 if o_rank != lv.rank][:1]
            if others and others[0] >= heard + silence:
                quiet.append(lv)
    ambiguous = False
    casualties: list[int] = []
    n_live = len(live) if isinstance(live, LivenessColumns) else 0
    if torn and lost_before:
        torn = []  # the job is already down; later teardown is a consequence
    if len(torn) > 1:
        # A lost rank takes its peers down within milliseconds (their
        # collectives fail and they exit), so several ranks torn in one
        # judgement are one loss and its casualties. Suspects: those that
        # reset their connections (died), then those whose own sockets closed
        # (the probes saw that end go); of them, name the first to go.
        suspects = torn
        for sign in ("reset_peers", "self_closed"):
            marked = [lv for lv in suspects if getattr(lv, sign)]
            if marked and len(marked) < len(suspects):
                suspects = marked
        ambiguous = len(suspects) > 1 and len(torn) >= (
            n_live - sum(1 for r in lost if _has(live, r))
            if isinstance(live, LivenessColumns)
            else len([lv for lv in live if lv.rank not in lost])
        )
        first = min(suspects, key=lambda lv: (lv.torn_t or t, lv.last_t, lv.rank))
        casualties = sorted(lv.rank for lv in torn if lv is not first)
        torn = [first]
    for lv in torn + quiet:
        lost[lv.rank] = lv.last_t
        ev: dict[str, object] = {
            "silent_s": round(t - lv.last_t, 3),
            "last_step": lv.done_step,
            "torn_peers": lv.torn_peers,
            "peers": lv.peers,
        }
        if lv.reset_peers:
            ev["reset_peers"] = lv.reset_peers
        if lv in quiet:
            ev["others_continued"] = True
        elif casualties:
            ev["casualties"] = casualties
        if ambiguous:
            ev["unsure"] = "every rank lost its connections at once: picked the first to go quiet"
        out.append(
            Verdict(
                t,
                lv.done_step + 1,
                lv.rank,
                "flagged",
                "rank_lost",
                t - lv.last_t,
                lv.host,
                None,
                ev,
            )
        )
    return lost, out


# The passes of judge_lost over every rank. A tuple of RankLiveness (a small
# job) is walked; LivenessColumns (thousands of ranks) are screened with array
# operations, and only the ranks a pass could pick are made RankLiveness, in
# rank order, so the judgement reads exactly what it reads of the tuple.


def _heard_again(live: Sequence[RankLiveness], lost: dict[int, float]) -> list[RankLiveness]:
    """Ranks lost before and heard from since, in rank order."""
    if not lost:
        return []
    if isinstance(live, LivenessColumns):
        picked = [live[i] for r in sorted(lost) if (i := live.row_of(r)) is not None]
    else:
        picked = [lv for lv in live if lv.rank in lost]
    return [lv for lv in picked if lv.last_t > lost[lv.rank]]


def _maybe_lost(
    live: Sequence[RankLiveness], lost: dict[int, float], t: float, silence: float
) -> Sequence[RankLiveness]:
    """Every rank judge_lost might call lost now, in rank order: all of a tuple;
    of columns, those with torn connections or silent that long."""
    if not isinstance(live, LivenessColumns):
        return live
    quiet = (live.last_t > 0.0) & (t - np.maximum(live.last_t, live.pending_t) >= silence)
    rows = set(np.flatnonzero(quiet).tolist())
    rows.update(i for r in live.torn if (i := live.row_of(r)) is not None)
    return [live[i] for i in sorted(rows) if int(live.rank[i]) not in lost]


def _latest_two(live: Sequence[RankLiveness], lost: dict[int, float]) -> list[tuple[float, int]]:
    """The two latest ``(last_t, rank)`` of the ranks not lost, latest first."""
    if not isinstance(live, LivenessColumns):
        return heapq.nlargest(2, ((o.last_t, o.rank) for o in live if o.rank not in lost))
    keep = np.flatnonzero(~np.isin(live.rank, np.fromiter(lost, np.int64, len(lost))))
    if not len(keep):
        return []
    last_t, rank = live.last_t[keep], live.rank[keep]
    top = np.lexsort((rank, last_t))[-2:][::-1]  # by last_t, then rank, as tuples compare
    return [(float(last_t[i]), int(rank[i])) for i in top.tolist()]


def _has(live: LivenessColumns, rank: int) -> bool:
    return live.row_of(rank) is not None
