"""What the detector remembers between summaries and what it answers with (types only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fsdp_sentinel.trace import Verdict

#: Every cause a verdict can name.
CAUSES = ("compute", "network", "rank_lost", "hang")


class RankTrack(NamedTuple):
    """One rank's rolling figures between reports (part of :class:`DetectState`)."""

    rel: tuple[float, ...] = ()
    ind: tuple[float, ...] = ()
    compute_hist: tuple[float, ...] = ()
    bad: int = 0
    clean: int = 0
    cause: str | None = None
    flagged_step: int | None = None
    rel_long: tuple[float, ...] = ()  # the last ``sustained_window`` relative scores
    compute_sorted: tuple[float, ...] = ()  # ``compute_hist`` in ascending order
    rel_trend: tuple[float, ...] = ()  # the last ``trend_window`` relative scores


NEW_TRACK = RankTrack()


@dataclass(frozen=True)
class DetectState:
    """Everything :func:`~fsdp_sentinel.detect.detect` remembers; a new one comes back in each
    :class:`Report`.

    ``lost`` maps a rank flagged ``rank_lost`` to the ``last_t`` it had then;
    ``hung`` a rank flagged ``hang`` to the ``seq`` it never issued.
    """

    tracks: dict[int, RankTrack] = field(default_factory=dict)
    job_recent: tuple[float, ...] = ()
    job_hist: tuple[float, ...] = ()
    stretched: int = 0
    srtt_hist: tuple[float, ...] = ()
    rel_noise: tuple[float, ...] = ()
    rel_lag: tuple[tuple[bool, tuple[float, ...]], ...] = ()
    lost: dict[int, float] = field(default_factory=dict)
    hung: dict[int, int] = field(default_factory=dict)
    # The last flow matrix's network view, reused while the matrix and what it
    # was judged with are unchanged (steps come faster than flow samples).
    net_memo: tuple[Any, ...] = ()
    # Steps of a new attempt (an elastic restart) still to be judged as a
    # warm-up (``restart_warmup``): liveness only, no history (0: none).
    warmup: int = 0


class RankScore(NamedTuple):
    """One rank's scores in one report.

    ``relative``: median over the last ``window`` steps of its lateness beyond
    the median lateness of its peers, divided by the step time without that
    lateness: the share by which this rank alone stretches the step (0.25 =
    the job would be 25 % faster without the wait for it).
    ``individual``: its compute time now minus the median of its own compute
    history, over the baseline step time (how much slower it computes than it
    used to; None without enough history).
    ``network``: lowest srtt of the flows touching it (both directions) over
    the median srtt of flows not touching it (None without flows; with only
    flows touching it, against the job's srtt baseline, and then ambiguous).
    ``retrans_share``: share of the window's retransmits on flows touching it.
    ``candidate``: the cause it looks like in this report before persistence;
    ``state``/``cause``: its open verdict after this report.
    """

    rank: int
    relative: float | None
    individual: float | None
    network: float | None
    retrans_share: float | None
    late_s: float | None
    compute_s: float | None
    wait_s: float | None
    last_frac: float | None
    candidate: str | None
    state: str
    cause: str | None


class Report(NamedTuple):
    """The detector's answer to one summary.

    ``job_step_s``: median step time over ranks in this step;
    ``baseline_step_s``: median job step time of the unstretched history;
    ``stretch``: median job step over the window / baseline - 1 (None without
    a baseline). ``bar``: the relative score a compute flag needs now
    (``min_effect``, or more on a noisy machine; None while warming up).
    ``verdicts``: typed verdicts in rank order (``Verdict.record()`` writes one).
    """

    t: float
    step: int | None
    job_step_s: float | None
    baseline_step_s: float | None
    stretch: float | None
    bar: float | None
    scores: tuple[RankScore, ...]
    verdicts: tuple[Verdict, ...]
    state: DetectState
