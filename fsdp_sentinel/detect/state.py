"""What the detector remembers between summaries and what it answers with (types only).

A job's tracks are a dict of :class:`RankTrack` while it is small, and
:class:`TrackColumns` (the same figures, a numpy column each) once it has
thousands of ranks (``detect.columnar``); a report's scores likewise come
as a tuple of :class:`RankScore` or as :class:`ScoreColumns`. Either form
reads the same, rank by rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from fsdp_sentinel.rankstep import Rows, none_if_nan, row_of
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

#: A track's open cause as a column code (0: none), and back.
CAUSE_CODE = {None: 0, "compute": 1, "network": 2}
CODE_CAUSE: tuple[str | None, ...] = (None, "compute", "network")
#: ``flagged_step`` None in a column.
NO_STEP = -(1 << 62)


class Hist(NamedTuple):
    """One bounded history per row: row ``i``'s ``n[i]`` values sit left-aligned in
    ``vals[i]``, oldest first (``vals`` is rows x the history's length)."""

    vals: np.ndarray
    n: np.ndarray

    @classmethod
    def empty(cls, rows: int, width: int) -> Hist:
        return cls(np.zeros((rows, width)), np.zeros(rows, dtype=np.int64))

    def row(self, i: int) -> tuple[float, ...]:
        return tuple(self.vals[i, : self.n[i]].tolist())

    def put(self, i: int, values: Sequence[float]) -> None:
        k = len(values)
        self.vals[i, :k] = values
        self.n[i] = k

    def copy(self) -> Hist:
        return Hist(self.vals.copy(), self.n.copy())


@dataclass(frozen=True, eq=False)
class TrackColumns:
    """Every rank's :class:`RankTrack` as columns, rows in ascending rank order.

    ``rel``, ``ind``, ``rel_long``, ``rel_trend`` and ``compute`` are the
    tracks' histories (:class:`Hist`), ``widths`` their lengths (the
    config's ``window``, ``sustained_window``, ``trend_window`` and
    ``history`` they were made for); ``cause`` is a :data:`CAUSE_CODE`,
    ``flagged_step`` :data:`NO_STEP` for None. A track's ``compute_sorted``
    is its compute history sorted, made when a row is read. Never changed
    once made: ``detect`` makes the next one.
    """

    ranks: np.ndarray
    rel: Hist
    ind: Hist
    rel_long: Hist
    rel_trend: Hist
    compute: Hist
    bad: np.ndarray
    clean: np.ndarray
    cause: np.ndarray
    flagged_step: np.ndarray
    widths: tuple[int, int, int, int]

    @classmethod
    def empty(cls, widths: tuple[int, int, int, int], rows: int = 0) -> TrackColumns:
        w, sw, tw, hist = widths
        zeros = np.zeros(rows, dtype=np.int64)
        return cls(
            np.zeros(rows, dtype=np.int64),
            Hist.empty(rows, w),
            Hist.empty(rows, w),
            Hist.empty(rows, sw),
            Hist.empty(rows, tw),
            Hist.empty(rows, hist),
            zeros.copy(),
            zeros.copy(),
            np.zeros(rows, dtype=np.int8),
            np.full(rows, NO_STEP, dtype=np.int64),
            widths,
        )

    @classmethod
    def of(
        cls, tracks: Mapping[int, RankTrack], widths: tuple[int, int, int, int]
    ) -> TrackColumns | None:
        """``tracks`` as columns; None when a history is longer than its width (the
        config's windows shrank: such a track is shortened only by its next push)."""
        w, sw, tw, hist = widths
        limits = (w, w, sw, tw, hist)
        for t in tracks.values():
            if any(
                len(h) > k
                for h, k in zip(
                    (t.rel, t.ind, t.rel_long, t.rel_trend, t.compute_hist), limits, strict=True
                )
            ):
                return None
        out = cls.empty(widths, len(tracks))
        out.ranks[:] = sorted(tracks)
        for i, r in enumerate(out.ranks.tolist()):
            out.set_row(i, tracks[r])
        return out

    def __len__(self) -> int:
        return len(self.ranks)

    def slot(self, rank: int) -> int | None:
        return row_of(self.ranks, rank)

    def row(self, i: int) -> RankTrack:
        """Row ``i`` as a :class:`RankTrack` (the very tuples the scalar path keeps)."""
        comp = self.compute.row(i)
        step = int(self.flagged_step[i])
        return RankTrack(
            self.rel.row(i),
            self.ind.row(i),
            comp,
            int(self.bad[i]),
            int(self.clean[i]),
            CODE_CAUSE[int(self.cause[i])],
            None if step == NO_STEP else step,
            self.rel_long.row(i),
            tuple(sorted(comp)),
            self.rel_trend.row(i),
        )

    def set_row(self, i: int, t: RankTrack) -> None:
        """Write ``t`` into row ``i`` (of a TrackColumns being made)."""
        self.rel.put(i, t.rel)
        self.ind.put(i, t.ind)
        self.rel_long.put(i, t.rel_long)
        self.rel_trend.put(i, t.rel_trend)
        self.compute.put(i, t.compute_hist)
        self.bad[i] = t.bad
        self.clean[i] = t.clean
        self.cause[i] = CAUSE_CODE[t.cause]
        self.flagged_step[i] = NO_STEP if t.flagged_step is None else t.flagged_step

    def get(self, rank: int) -> RankTrack | None:
        i = self.slot(rank)
        return None if i is None else self.row(i)

    def items(self) -> Iterator[tuple[int, RankTrack]]:
        for i, r in enumerate(self.ranks.tolist()):
            yield r, self.row(i)

    def as_dict(self) -> dict[int, RankTrack]:
        return dict(self.items())

    def open_causes(self) -> dict[int, str]:
        """Rank -> cause of every open verdict."""
        idx = np.flatnonzero(self.cause)
        return {
            int(r): str(CODE_CAUSE[int(c)])
            for r, c in zip(self.ranks[idx].tolist(), self.cause[idx].tolist(), strict=True)
        }

    def including(
        self, ranks: np.ndarray, copy_hists: bool = True
    ) -> tuple[TrackColumns, np.ndarray]:
        """A copy with a fresh row for each of ``ranks`` (ascending) it lacks, and
        each of ``ranks``' row in it (the copy is the next state's, to change).
        ``copy_hists`` False: when no row is new, the histories are this one's
        own, not copies (the caller replaces each before changing it:
        :meth:`with_hists`)."""
        have = self.ranks
        if len(ranks) == len(have) and np.array_equal(ranks, have):
            new, rows = ranks[:0], np.arange(len(have))  # the usual step: every rank
        else:
            rows = np.searchsorted(have, ranks)
            known = rows < len(have)
            known[known] = have[rows[known]] == ranks[known]
            new = ranks[~known]
        if not len(new):
            h = [self.rel, self.ind, self.rel_long, self.rel_trend, self.compute]
            if copy_hists:
                h = [x.copy() for x in h]
            out = TrackColumns(
                have,
                h[0],
                h[1],
                h[2],
                h[3],
                h[4],
                self.bad.copy(),
                self.clean.copy(),
                self.cause.copy(),
                self.flagged_step.copy(),
                self.widths,
            )
            return out, rows
        merged = np.union1d(have, new)
        at = np.searchsorted(merged, have)  # where each old row goes
        out = TrackColumns.empty(self.widths, len(merged))
        out.ranks[:] = merged
        for mine, theirs in (
            (out.rel, self.rel),
            (out.ind, self.ind),
            (out.rel_long, self.rel_long),
            (out.rel_trend, self.rel_trend),
            (out.compute, self.compute),
        ):
            mine.vals[at] = theirs.vals
            mine.n[at] = theirs.n
        out.bad[at] = self.bad
        out.clean[at] = self.clean
        out.cause[at] = self.cause
        out.flagged_step[at] = self.flagged_step
        return out, np.searchsorted(merged, ranks)

    def with_hists(
        self,
        rel: Hist,
        ind: Hist,
        rel_long: Hist,
        rel_trend: Hist,
        compute: Hist,
        before: TrackColumns,
    ) -> TrackColumns:
        """These tracks with these histories, each one still ``before``'s copied
        (it is the last state's: never changed)."""
        mine = [
            h.copy() if h is b else h
            for h, b in zip(
                (rel, ind, rel_long, rel_trend, compute),
                (before.rel, before.ind, before.rel_long, before.rel_trend, before.compute),
                strict=True,
            )
        ]
        return dataclasses.replace(
            self, rel=mine[0], ind=mine[1], rel_long=mine[2], rel_trend=mine[3], compute=mine[4]
        )

    def restarted(self) -> TrackColumns:
        """The tracks of a new attempt of the job: each rank's compute history only."""
        out = TrackColumns.empty(self.widths, len(self.ranks))
        out.ranks[:] = self.ranks
        out.compute.vals[:] = self.compute.vals
        out.compute.n[:] = self.compute.n
        return out


Tracks = dict[int, RankTrack] | TrackColumns


def restart_tracks(tracks: Tracks) -> Tracks:
    """A new attempt's tracks: each rank's own compute history, nothing else."""
    if isinstance(tracks, TrackColumns):
        return tracks.restarted()
    return {
        r: NEW_TRACK._replace(compute_hist=t.compute_hist, compute_sorted=t.compute_sorted)
        for r, t in tracks.items()
    }


@dataclass(frozen=True)
class DetectState:
    """Everything :func:`~fsdp_sentinel.detect.detect` remembers; a new one comes back in each
    :class:`Report`.

    ``lost`` maps a rank flagged ``rank_lost`` to the ``last_t`` it had then;
    ``hung`` a rank flagged ``hang`` to the ``seq`` it never issued.
    """

    tracks: Tracks = field(default_factory=dict)
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
    scores: Sequence[RankScore]
    verdicts: tuple[Verdict, ...]
    state: DetectState


class ScoreColumns(Rows[RankScore]):
    """A report's scores at thousands of ranks: columns for the ranks judged at
    once (``detect.columnar``), whose candidate is None and state ``ok``, and the
    :class:`RankScore` of each rank judged one at a time (``special``). A
    sequence of RankScores in rank order, made on demand. NaN in a column is
    None in a RankScore."""

    def __init__(
        self,
        ranks: np.ndarray,
        relative: np.ndarray,
        individual: np.ndarray,
        late: np.ndarray,
        compute: np.ndarray,
        wait: np.ndarray,
        last_frac: np.ndarray,
        ratio: Mapping[int, float],
        share: Mapping[int, float],
        special: Mapping[int, RankScore],
    ) -> None:
        self.ranks = ranks
        self._cols = (relative, individual, late, compute, wait, last_frac)
        self._ratio = ratio
        self._share = share
        self.special = special

    def __len__(self) -> int:
        return len(self.ranks)

    def _make(
        self, rank: int, rel: float, ind: float, late: float, comp: float, wait: float, frac: float
    ) -> RankScore:
        hit = self.special.get(rank)
        if hit is not None:
            return hit
        return RankScore(
            rank,
            none_if_nan(rel),
            none_if_nan(ind),
            self._ratio.get(rank),
            self._share.get(rank),
            none_if_nan(late),
            none_if_nan(comp),
            wait,
            none_if_nan(frac),
            None,
            "ok",
            None,
        )

    def _row(self, i: int) -> RankScore:
        return self._make(int(self.ranks[i]), *(float(c[i]) for c in self._cols))

    def __iter__(self) -> Iterator[RankScore]:
        lists = [c.tolist() for c in self._cols]
        return (self._make(*row) for row in zip(self.ranks.tolist(), *lists, strict=True))
