"""The per-rank rules over columns: ``detect()`` at thousands of ranks (pure).

A small job's ranks are judged one at a time (:func:`~fsdp_sentinel.detect.judge.judge_rank`).
At thousands of ranks that loop, and a track, a score and a few tuples made
per rank per step, are most of a step's cost (cluster mode's leader judges
16k ranks a window). So a job of :data:`COLUMNAR_RANKS` ranks or more keeps
its tracks as columns (:class:`~fsdp_sentinel.detect.state.TrackColumns`)
and :func:`judge` judges a step in two parts:

* every rank's figures at once, as array operations that give the scalar
  rules' floats to the last bit: the same ``compute.score`` arithmetic, the
  same medians of the same values (:func:`~fsdp_sentinel.detect.stats.row_medians`),
  the same bounded histories;
* the few ranks whose step is more than pushing histories through
  ``judge_rank`` itself, their tracks read out of the columns and written
  back: a rank with an open verdict, a candidate cause, one the network view
  names (a node, or a link's carrier), or one whose trend is worth fitting.

For every other rank the step's outcome is known without the scalar path:
no candidate, no verdict, persistence's clean count moves on, and its compute
history grows when the step was ordinary. ``tests/test_detect_columnar.py``
holds the two paths to the same reports, state and verdicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from fsdp_sentinel.detect.config import DetectConfig
from fsdp_sentinel.detect.judge import StepContext, judge_rank
from fsdp_sentinel.detect.state import (
    NEW_TRACK,
    Hist,
    RankScore,
    RankTrack,
    ScoreColumns,
    TrackColumns,
    Tracks,
)
from fsdp_sentinel.detect.stats import row_medians
from fsdp_sentinel.rankstep import StepRanks
from fsdp_sentinel.trace import Verdict

#: A step of at least this many ranks is judged over columns (and the job's
#: tracks stay columns from then on): below it numpy's calls cost more than
#: the per-rank loop they replace.
COLUMNAR_RANKS = 64


class ColumnsJudged(NamedTuple):
    """:func:`judge`'s answer: the next tracks, the scores, the verdicts, every
    relative score now in rank order (the noise pool's), whether any rank's
    window was suspect, and whether any rank was a candidate."""

    tracks: TrackColumns
    scores: ScoreColumns
    verdicts: list[Verdict]
    rel_seen: list[float]
    suspect: bool
    any_candidate: bool


def widths_of(cfg: DetectConfig) -> tuple[int, int, int, int]:
    """The history lengths a config keeps (``TrackColumns.widths``)."""
    return (
        cfg.persistence.window,
        cfg.compute.sustained_window,
        cfg.compute.trend_window,
        cfg.baseline.history,
    )


def tracks_for(tracks: Tracks, n_ranks: int, cfg: DetectConfig) -> TrackColumns | None:
    """The tracks as columns when this step is judged over columns, else None.

    A job's tracks become columns on its first step of ``COLUMNAR_RANKS``
    ranks and stay so. When the config's history lengths changed, or a
    track's history is still longer than the new length, the step is judged
    one rank at a time, as it would have been (a shorter window shortens a
    history only at its next push).
    """
    widths = widths_of(cfg)
    if isinstance(tracks, TrackColumns):
        return tracks if tracks.widths == widths else None
    if n_ranks >= COLUMNAR_RANKS:
        return TrackColumns.of(tracks, widths)
    return None


def opened(tracks: Tracks, rank: int, cause: str, step: int, cfg: DetectConfig) -> Tracks | None:
    """New tracks with ``rank``'s verdict for ``cause`` open as of ``step``, as
    persistence leaves a flagged one (``flag_after`` bad windows, none clean);
    None when the rank has an open verdict already (the tracks are not changed)."""
    tr = tracks.get(rank)
    if tr is not None and tr.cause is not None:
        return None
    now = (tr or NEW_TRACK)._replace(
        bad=cfg.persistence.flag_after, clean=0, cause=cause, flagged_step=step
    )
    if isinstance(tracks, TrackColumns):
        cols, rows = tracks.including(np.array([rank], dtype=np.int64))
        cols.set_row(int(rows[0]), now)
        return cols
    out = dict(tracks)
    out[rank] = now
    return out


def as_dict(tracks: Tracks) -> dict[int, RankTrack]:
    """The tracks as a dict of :class:`RankTrack` (a new one, to change)."""
    return tracks.as_dict() if isinstance(tracks, TrackColumns) else dict(tracks)


def present(ranks: StepRanks, lost: Mapping[int, float]) -> np.ndarray:
    """Which of a step's ranks are judged: every one not lost."""
    keep = np.ones(len(ranks), dtype=bool)
    if lost:
        keep &= ~np.isin(ranks.rank, np.fromiter(lost, dtype=np.int64, count=len(lost)))
    return keep


def in_order(ranks: StepRanks) -> bool:
    """Each rank once, ascending (what the columnar path needs; the correlator's
    and the leader's summaries always are)."""
    return bool((ranks.rank[1:] > ranks.rank[:-1]).all())


def _push(h: Hist, rows: np.ndarray, values: np.ndarray) -> None:
    """``stats.push`` of ``values[k]`` onto row ``rows[k]`` of ``h`` (in place: ``h``
    is the next state's copy); the oldest value goes once a row is full.
    ``rows`` are distinct and ascending (rows of a step's ranks, or a subset)."""
    width = h.vals.shape[1]
    if not width or not len(rows):
        return
    if len(rows) == len(h.n) and (h.n >= width).all():
        # Every row, each full (a steady big job): shifted as one block.
        h.vals[:, :-1] = h.vals[:, 1:]
        h.vals[:, -1] = values
        return
    n = h.n[rows]
    full = n >= width
    if full.any():
        f = rows[full]
        h.vals[f, :-1] = h.vals[f, 1:]
        h.vals[f, -1] = values[full]
    part = ~full
    if part.any():
        p = rows[part]
        h.vals[p, n[part]] = values[part]
        h.n[p] = n[part] + 1


def _pushed(h: Hist, rows: np.ndarray, values: np.ndarray) -> Hist:
    """:func:`_push` onto a new history, ``h`` left as it was (it is the last
    state's); ``h`` itself when nothing is pushed. Every row, each full (a
    steady big job), is shifted as it is copied: one pass, not a copy and
    then a shift over itself."""
    width = h.vals.shape[1]
    if not width or not len(rows):
        return h
    if len(rows) == len(h.n) and (h.n >= width).all():
        vals = np.empty_like(h.vals)
        vals[:, :-1] = h.vals[:, 1:]
        vals[:, -1] = values
        return Hist(vals, h.n.copy())
    out = h.copy()
    _push(out, rows, values)
    return out


def _medians(h: Hist, rows: np.ndarray) -> np.ndarray:
    if len(rows) == len(h.n):  # every row (rows are distinct): no copy to take
        return row_medians(h.vals, h.n)
    return row_medians(h.vals[rows], h.n[rows])


def judge(
    ranks: StepRanks, keep: np.ndarray, before: TrackColumns, ctx: StepContext
) -> ColumnsJudged:
    """Judge every rank of one step kept in ``keep``, as ``judge_rank`` would each
    (see the module docstring): ``compute.score``, the candidate, persistence."""
    cfg = ctx.cfg
    c = cfg.compute
    need = (cfg.persistence.window + 1) // 2  # scores in the window before it has a median
    idx = np.flatnonzero(keep)
    rank = ranks.rank[idx]
    # The histories are the state's own until pushed (_pushed makes the next
    # state's); the rest of the tracks is a copy, changed in place.
    tracks, rows = before.including(rank, copy_hists=False)
    n = len(idx)
    late = ranks.late_s[idx]
    matched = ranks.matched[idx] > 0
    comp = ranks.compute_s[idx]
    has_comp = comp == comp  # NaN: no step record
    nan = np.nan

    # The relative score now: lateness beyond the median of the others'.
    rel_now = np.full(n, nan)
    has_now = np.zeros(n, dtype=bool)
    ref = ctx.ref_step
    if ref and ctx.n_lates >= 2:
        has_now = matched
        lates = ctx.lates_array if ctx.lates_array is not None else np.asarray(ctx.lates_sorted)
        v = late[has_now]
        # stats.median_without, per rank: the median of the others' lateness
        # is the sorted lateness's middle, moved one on where the rank's own
        # (its place: the count of values below it) lies at or before it.
        m = ctx.n_lates - 1
        mid = m // 2
        past_mid: np.ndarray
        past_before: np.ndarray | bool
        if np.isnan(v).any() or np.isnan(lates).any():  # NaN has no place by comparison
            at = np.searchsorted(lates, v, side="left")
            past_mid, past_before = mid < at, mid - 1 < at
        else:  # a place past i is lates[i] < v: two comparisons, not a search
            past_mid = lates[mid] < v
            past_before = lates[mid - 1] < v if mid else True
        upper = np.where(past_mid, lates[mid], lates[mid + 1])
        if m % 2:
            med = upper
        else:
            lower = np.where(past_before, lates[mid - 1], lates[mid])
            med = (lower + upper) / 2.0
        rel_now[has_now] = (v - med) / np.maximum(np.maximum(ref - v, 0.1 * ref), 1e-9)
    now_rows, now_vals = rows[has_now], rel_now[has_now]
    rel = _pushed(tracks.rel, now_rows, now_vals)
    rel_long = _pushed(tracks.rel_long, now_rows, now_vals)
    rel_trend = _pushed(tracks.rel_trend, now_rows, now_vals)
    relative = _medians(rel, rows)
    relative[rel.n[rows] < need] = nan
    has_rel = relative == relative

    # The individual score: compute now against the rank's own history.
    ind_now = np.full(n, nan)
    has_ind = np.zeros(n, dtype=bool)
    base = ctx.base
    if base:
        has_ind = has_comp & (tracks.compute.n[rows] >= cfg.baseline.min_history)
        own = _medians(tracks.compute, rows[has_ind])
        ind_now[has_ind] = (comp[has_ind] - own) / base
    ind = _pushed(tracks.ind, rows[has_ind], ind_now[has_ind])
    individual = _medians(ind, rows)
    individual[(ind.n[rows] < need) | ~has_ind] = nan

    # Slow, by the bar or by the sustained rule, for a rank with no open verdict
    # (one with a verdict goes through judge_rank: its hysteresis differs).
    sustained = np.zeros(n, dtype=bool)
    sw = c.sustained_window
    if sw:
        full = rel_long.n[rows] >= sw
        long_med = _medians(rel_long, rows[full])
        ok = long_med >= ctx.low
        mine = ctx.attributed if ctx.n_flagged == 0 else None
        if mine is not None:
            ok |= long_med >= mine
        sustained[full] = ok
    slow = has_rel & ((relative >= ctx.bar) | sustained)
    # compute.is_candidate (and a compute flag needs a warm noise pool)
    candidate = slow & ctx.warm & (~has_ind | (individual >= c.individual_share * ctx.bar))
    special = candidate | (tracks.cause[rows] != 0)
    tw = c.trend_window
    if tw:  # a rise the trend rule would fit a line to (compute.score's first tests)
        special |= (
            ~slow
            & has_rel
            & (relative >= c.trend_level)
            & (relative >= c.trend_bar_share * ctx.bar)
            & (rel_trend.n[rows] >= tw)
        )
    named = [*ctx.net.node, *ctx.net.links]
    if named:
        special |= np.isin(rank, np.asarray(named, dtype=np.int64))

    # Every other rank: no candidate, no verdict; its compute history grows by
    # an ordinary step, and persistence counts a clean window when the step
    # said anything about it.
    plain = ~special
    grow = plain & has_comp & (~has_now | (rel_now < ctx.bar))
    compute = _pushed(tracks.compute, rows[grow], comp[grow])
    tracks = tracks.with_hists(rel, ind, rel_long, rel_trend, compute, before)
    said = plain if ctx.stretch is not None else plain & has_now  # persistence's "informative"
    said_rows = rows[said]
    tracks.bad[said_rows] = 0
    tracks.clean[said_rows] += 1

    verdicts: list[Verdict] = []
    scores: dict[int, RankScore] = {}
    suspect = bool((relative[plain] >= cfg.baseline.min_effect).any())
    any_candidate = False
    for j in np.flatnonzero(special).tolist():
        r = int(rank[j])
        old = before.slot(r)
        one = judge_rank(ranks[int(idx[j])], NEW_TRACK if old is None else before.row(old), ctx)
        tracks.set_row(int(rows[j]), one.track)
        scores[r] = one.score
        if one.verdict is not None:
            verdicts.append(one.verdict)
        suspect = suspect or one.suspect
        any_candidate = any_candidate or one.score.candidate is not None
    return ColumnsJudged(
        tracks,
        ScoreColumns(
            rank,
            relative,
            individual,
            np.where(matched, late, nan),
            comp,
            ranks.wait_s[idx],
            np.where(matched, ranks.last_frac[idx], nan),
            ctx.net.ratio,
            ctx.net.share,
            scores,
        ),
        verdicts,
        rel_now[has_now].tolist(),
        suspect,
        any_candidate,
    )
