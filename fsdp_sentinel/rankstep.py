"""One step's figures per rank: a :class:`RankStep` each, or all of them as columns.

The correlator (and cluster mode's leader) summarise a step into one
:class:`RankStep` per rank; the detector scores them. At a few ranks a tuple
of RankSteps is the cheapest form. At thousands of ranks, building,
reading and keeping an object per rank per step is most of a step's cost,
so the step can come as :class:`StepRanks`: one numpy column per figure,
which the detector's columnar path reads without a per-rank object
(``detect.columnar``). StepRanks is a sequence of RankSteps too (made one at
a time, on demand), so every reader of a summary's ranks takes either form.

Missing figures (``step_s`` and ``compute_s`` of a rank whose step record
was lost) are NaN in the columns and None in a RankStep.

:class:`Rows` is what every such columns-as-rows form shares (this one, and
the liveness and score columns of ``correlate`` and ``detect.state``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, TypeVar, overload

import numpy as np

F64 = np.float64
I64 = np.int64


class RankStep(NamedTuple):
    """One rank in one step.

    ``step_s`` is ``end - start`` of its step record (None when that record was
    lost); ``wait_s`` the union of its collective intervals (time blocked);
    ``compute_s`` = ``step_s - wait_s``; ``late_s`` the sum, over the step's
    collectives that at least one other rank also reported, of ``max wait of
    the group - own wait``; ``last_frac`` the share of those collectives where
    this rank waited least (it arrived last); ``matched`` how many there were.
    """

    rank: int
    step_s: float | None
    wait_s: float
    compute_s: float | None
    late_s: float
    last_frac: float
    matched: int
    n_coll: int


def none_if_nan(x: float) -> float | None:
    """A column's NaN as a row's None: the figure was missing."""
    return None if x != x else x


def row_of(ranks: np.ndarray, rank: int) -> int | None:
    """Where ``rank`` sits in ascending ``ranks`` (None when it is not there)."""
    i = int(np.searchsorted(ranks, rank))
    return i if i < len(ranks) and ranks[i] == rank else None


T = TypeVar("T")


class Rows(Sequence[T]):
    """A sequence of rows (tuples) kept as columns, each row made on demand.

    A subclass gives ``__len__`` and ``_row(i)`` (and a faster ``__iter__``
    where it has one); indexing, slices, iteration and equality follow.
    Equality is a tuple's of the same rows, so the columns compare equal to
    the tuple of rows the scalar path would have made (and, like it, are not
    hashable)."""

    __slots__ = ()

    def _row(self, i: int) -> T:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[T]: ...

    def __getitem__(self, i: int | slice) -> T | Sequence[T]:
        if isinstance(i, slice):
            return tuple(self)[i]
        return self._row(i)

    def __iter__(self) -> Iterator[T]:
        return map(self._row, range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]


class StepRanks(Rows[RankStep]):
    """A step's :class:`RankStep`\\ s as columns, in ascending rank order.

    Each attribute is a 1-d numpy array with one entry per rank: ``rank``,
    ``matched`` and ``n_coll`` int64, the rest float64 (``step_s`` and
    ``compute_s`` NaN where a RankStep has None). Indexing or iterating gives
    RankSteps with the very floats the columns hold.
    """

    __slots__ = (
        "rank",
        "step_s",
        "wait_s",
        "compute_s",
        "late_s",
        "last_frac",
        "matched",
        "n_coll",
    )

    def __init__(
        self,
        rank: Any,
        step_s: Any,
        wait_s: Any,
        compute_s: Any,
        late_s: Any,
        last_frac: Any,
        matched: Any,
        n_coll: Any,
    ) -> None:
        self.rank = np.asarray(rank, dtype=I64)
        self.step_s = np.asarray(step_s, dtype=F64)
        self.wait_s = np.asarray(wait_s, dtype=F64)
        self.compute_s = np.asarray(compute_s, dtype=F64)
        self.late_s = np.asarray(late_s, dtype=F64)
        self.last_frac = np.asarray(last_frac, dtype=F64)
        self.matched = np.asarray(matched, dtype=I64)
        self.n_coll = np.asarray(n_coll, dtype=I64)

    @classmethod
    def of(cls, rows: Sequence[RankStep]) -> StepRanks:
        """The columns of ``rows`` (already columns: the same object)."""
        if isinstance(rows, StepRanks):
            return rows
        if not rows:
            empty: list[float] = []
            return cls(empty, empty, empty, empty, empty, empty, empty, empty)
        rank, step_s, wait_s, compute_s, late_s, last_frac, matched, n_coll = zip(
            *rows, strict=True
        )
        nan = math.nan
        return cls(
            rank,
            [nan if x is None else x for x in step_s],
            wait_s,
            [nan if x is None else x for x in compute_s],
            late_s,
            last_frac,
            matched,
            n_coll,
        )

    def __len__(self) -> int:
        return len(self.rank)

    def _row(self, i: int) -> RankStep:
        return RankStep(
            int(self.rank[i]),
            none_if_nan(float(self.step_s[i])),
            float(self.wait_s[i]),
            none_if_nan(float(self.compute_s[i])),
            float(self.late_s[i]),
            float(self.last_frac[i]),
            int(self.matched[i]),
            int(self.n_coll[i]),
        )

    def __iter__(self) -> Iterator[RankStep]:
        cols = (
            self.rank.tolist(),
            [none_if_nan(x) for x in self.step_s.tolist()],
            self.wait_s.tolist(),
            [none_if_nan(x) for x in self.compute_s.tolist()],
            self.late_s.tolist(),
            self.last_frac.tolist(),
            self.matched.tolist(),
            self.n_coll.tolist(),
        )
        return map(RankStep._make, zip(*cols, strict=True))

    def __repr__(self) -> str:
        return f"StepRanks({len(self)} ranks)"
