"""Rule ``compute``: the rank that arrives last at its collectives (pure).

Its lateness beyond the median of its peers, as a share of the step it would
take without it (the *relative* score), is at least the bar over a rolling
window; or, for a smaller effect that lasts, the median over
``sustained_window`` steps reaches a lower bar; or, for hardware that ages
(a throttling GPU, a failing DIMM), the score rises steadily (:func:`trend`:
a robust line over ``trend_window`` steps) and has reached ``trend_level``.
Scores are against the rank's peers in the same step, so a job-wide drift
(every rank slower together) moves nobody's. Hysteresis: a flag holds while
the window stays above the lower bar, or the trend holds.
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_sentinel.correlate import RankStep
from fsdp_sentinel.detect.config import DetectConfig
from fsdp_sentinel.detect.state import RankTrack
from fsdp_sentinel.detect.stats import median, median_sorted, median_without, push, push_sorted, rnd

#: What :func:`score` returns, as a plain tuple (built for every rank of every
#: step; a NamedTuple costs twice as much to build): ``(rel_now, rel_hist,
#: relative, ind_hist, individual, rel_long, slow, rel_trend, aging)``;
#: ``aging`` is :func:`trend`'s answer when the trend rule found the rank.
Scored = tuple[
    float | None,
    tuple[float, ...],
    float | None,
    tuple[float, ...],
    float | None,
    tuple[float, ...],
    bool,
    tuple[float, ...],
    tuple[float, float, float] | None,
]


def trend(scores: tuple[float, ...]) -> tuple[float, float, float]:
    """A robust line through ``scores`` (one a step, oldest first): ``(slope per step,
    level now, concordance)``. Theil-Sen: the slope is the median of every
    pair's slope, the level the median of the points lowered onto it, read at
    the newest step; concordance the share of pairs in which the later score
    is the higher. One odd step moves none of them much."""
    n = len(scores)
    slopes = []
    up = 0
    for i in range(n - 1):
        a = scores[i]
        for j in range(i + 1, n):
            d = scores[j] - a
            slopes.append(d / (j - i))
            up += d > 0
    slope = median(slopes)
    level = median([y - slope * i for i, y in enumerate(scores)]) + slope * (n - 1)
    return slope, level, up / len(slopes)


def score(
    rs: RankStep,
    tr: RankTrack,
    n_lates: int,
    lates_sorted: list[float],
    ref_step: float | None,
    base: float | None,
    bar: float,
    low: float,
    cfg: DetectConfig,
    attributed: float | None = None,
) -> Scored:
    """The rank's relative and individual scores this step, and whether it looks slow.

    ``lates_sorted``: every matched rank's lateness, ascending; ``low``: the
    sustained rule's (and the hysteresis') bar; ``attributed``: the bar of
    :func:`attribution_bar` when the job is stretched and nothing else explains
    it (None otherwise).
    """
    window = cfg.persistence.window
    need = (window + 1) // 2  # scores in the window before it has a median
    rel_now: float | None = None
    if ref_step and rs.matched and n_lates >= 2:
        excess = rs.late_s - median_without(lates_sorted, rs.late_s)
        rel_now = excess / max(ref_step - rs.late_s, 0.1 * ref_step, 1e-9)
    rel_hist = push(tr.rel, rel_now, window) if rel_now is not None else tr.rel
    relative = median(rel_hist) if len(rel_hist) >= need else None
    ind_now = None
    if rs.compute_s is not None and len(tr.compute_hist) >= cfg.baseline.min_history and base:
        ind_now = (rs.compute_s - median_sorted(tr.compute_sorted)) / base
    ind_hist = push(tr.ind, ind_now, window) if ind_now is not None else tr.ind
    individual = median(ind_hist) if len(ind_hist) >= need and ind_now is not None else None

    # A smaller effect counts when it lasts: the median over a longer window
    # (robust to dips and to bursts alike) against a lower bar.
    sw = cfg.compute.sustained_window
    rel_long = tr.rel_long
    sustained = False
    if sw:
        if rel_now is not None:
            rel_long = push(rel_long, rel_now, sw)
        if len(rel_long) >= sw:
            long_med = median(rel_long)
            sustained = long_med >= low or (attributed is not None and long_med >= attributed)
    # Hysteresis: a compute flag holds while the window stays above the lower
    # bar, and clears once under it (the long median would hold a recovered
    # rank for half its window).
    if relative is None:
        slow = False
    elif tr.cause == "compute":
        slow = relative >= (low if sw else bar) or (sustained and attributed is not None)
    else:
        slow = relative >= bar or sustained
    # Slow ageing: a score that rises steadily, found before it is large. The
    # line is fitted only when the recent scores are already up (the long
    # window's median, or this one, at the trend's level): rarely, so cheaply.
    c = cfg.compute
    tw = c.trend_window
    rel_trend = tr.rel_trend
    aging = None
    if tw:
        if rel_now is not None:
            rel_trend = push(rel_trend, rel_now, tw)
        # The level must clear the machine's own noise too: half the bar
        # (the bar is noise_k single-step deviations; a 20-step line's level
        # spreads about half of one). Cheapest tests first: most ranks of
        # most steps stop at the first.
        if (
            not slow
            and relative is not None
            and relative >= c.trend_level
            and relative >= c.trend_bar_share * bar
            and len(rel_trend) >= tw
            and (
                not sw
                or len(rel_long) < sw
                or median(rel_long) >= max(c.trend_level, c.trend_bar_share * bar)
            )
        ):
            level = max(c.trend_level, c.trend_bar_share * bar)
            fit = trend(rel_trend)
            if (
                fit[0] * 100.0 >= c.trend_slope
                and fit[1] >= level
                and fit[2] >= c.trend_concordance
            ):
                aging, slow = fit, True
    return rel_now, rel_hist, relative, ind_hist, individual, rel_long, slow, rel_trend, aging


def is_candidate(
    slow: bool, relative: float | None, individual: float | None, bar: float, cfg: DetectConfig
) -> bool:
    return (
        relative is not None
        and slow
        and (individual is None or individual >= cfg.compute.individual_share * bar)
    )


def own_history(
    tr: RankTrack, rs: RankStep, quiet: bool, rel_now: float | None, bar: float, keep: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The rank's own compute history, grown by this step when it was an ordinary one
    (``quiet``: no candidate, no open verdict; and its score under the bar)."""
    if quiet and rs.compute_s is not None and (rel_now is None or rel_now < bar):
        return push_sorted(tr.compute_hist, tr.compute_sorted, rs.compute_s, keep)
    return tr.compute_hist, tr.compute_sorted


def evidence(
    rs: RankStep,
    relative: float | None,
    individual: float | None,
    also_network: float | None,
    sustained: tuple[float, ...] | None,
    bar: float,
    rel_trend: tuple[float, ...] = (),
    attributed: tuple[float, float] | None = None,
) -> tuple[float, dict[str, Any]]:
    """Score and evidence of a new ``compute`` verdict.

    ``also_network``: the rank's srtt ratio when its flows look slow too;
    ``sustained``: the long window, when the sustained rule found it;
    ``rel_trend``: its recent scores, whose line (``trend``: slope per 100
    steps, level now) is given when it rises; ``attributed``: ``(bar,
    stretch)`` when the job's stretch was attributed to it
    (:func:`attribution_bar`), as ``attributed``: its long median cleared
    ``bar`` while the job was ``stretch`` slower and nothing else explained it.
    """
    ev: dict[str, Any] = {
        "relative": rnd(relative),
        "individual": rnd(individual),
        "late_s": rnd(rs.late_s),
        "arrived_last_frac": rnd(rs.last_frac, 3),
        "compute_s": rnd(rs.compute_s),
        "wait_s": rnd(rs.wait_s),
    }
    if rs.last_frac == 0.0:
        ev["unsure"] = "late in sum, yet never the last to arrive at a collective"
    if also_network is not None:
        ev["also_network"] = rnd(also_network)
    if sustained is not None:
        # Found by the sustained or the trend rule: say so, with what it compared.
        ev["sustained"] = rnd(median(sustained))
        ev["bar"] = rnd(bar)
    if attributed is not None:
        ev["attributed"] = {"bar": rnd(attributed[0]), "stretch": rnd(attributed[1])}
    if len(rel_trend) >= 3:
        slope, level, concord = trend(rel_trend)
        if slope > 0 and concord >= 0.5:
            ev["trend"] = {
                "slope_per_100_steps": rnd(slope * 100.0),
                "level": rnd(level),
                "concordance": rnd(concord, 3),
                "steps": len(rel_trend),
            }
    return relative or 0.0, ev


#: A median of ``n`` draws spreads sqrt(pi / (2 n)) of one draw's standard deviation.
_MEDIAN_SPREAD = math.pi / 2.0


def attribution_bar(stretch: float, sigma: float, cfg: DetectConfig) -> float:
    """The sustained bar for a rank when the job is stretched by ``stretch`` and no other
    rule explains it: its long-window median lateness must be a real share of the
    stretch (``attributed_share``) and stand ``noise_k`` spreads of such a median
    above the machine's noise (``sigma``: one step's relative score)."""
    sw = cfg.compute.sustained_window
    spread = sigma * math.sqrt(_MEDIAN_SPREAD / sw) if sw else sigma
    return max(cfg.compute.attributed_share * stretch, cfg.noise.noise_k * spread)


def attributed_by(
    rel_long: tuple[float, ...],
    relative: float | None,
    bar: float,
    low: float,
    attributed: float | None,
    stretch: float | None,
) -> tuple[float, float] | None:
    """``(bar, stretch)`` for the evidence when the attribution, neither the bar nor the
    sustained bar ``low``, is what found the rank (None otherwise)."""
    if attributed is None or stretch is None or not rel_long or relative is None:
        return None
    long_med = median(rel_long)
    if relative >= bar or long_med >= low or long_med < attributed:
        return None
    return attributed, stretch
