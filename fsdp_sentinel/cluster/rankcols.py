"""The leader's per-rank progress as columns (pure).

Every round the leader notes, for every rank of the job, the figures a
digest carries about its progress: when it was last heard of, its first
step, its newest step with collectives and with a step record, its newest
collective's seq. Kept as attributes of each rank's state that was a Python
loop over 16k objects a round, three times over (filing the digest, its step
records, the liveness view): about 7 ms of a 16k-rank leader's 30.

So a :class:`ProgressColumns` holds those figures as arrays, a slot a rank,
and a :class:`ColumnRank` (the correlator's rank state) reads and writes its
own through properties: every per-rank path of the correlator works as it
did, while the leader files a round's digest and reads the liveness view as
a few array operations over the slots.

A rank the correlator forgets is *detached*: its figures move to columns of
its own, so a state still held somewhere can never write into the slot a new
rank is given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fsdp_sentinel.correlate import _Rank

#: A first step not yet known (the attribute's None). No real step is this
#: large: records' steps are C ints (``trace.MAX_INT``).
NO_STEP = np.iinfo(np.int64).max

#: The columns: their type and a new rank's value.
_FIELDS: dict[str, tuple[Any, Any]] = {
    "last_t": (np.float64, 0.0),
    "first_step": (np.int64, NO_STEP),
    "done_step": (np.int64, -1),
    "max_coll_step": (np.int64, -1),
    "top_seq": (np.int64, -1),
}


class ProgressColumns:
    """The progress figures of up to ``cap`` ranks (grown as needed), a slot a rank."""

    def __init__(self, cap: int = 64) -> None:
        self.last_t = np.zeros(0, np.float64)
        self.first_step = self.done_step = self.max_coll_step = self.top_seq = np.zeros(0, np.int64)
        self._cap = 0
        self._used = 0
        self._free: list[int] = []
        self._grow(cap)
        # A slot no rank is given: where a state forgotten while a list of them
        # was being made writes (slots_of), as it would have into its own.
        self.scratch = self.take()

    def _grow(self, cap: int) -> None:
        for name, (dtype, blank) in _FIELDS.items():
            new = np.full(cap, blank, dtype)
            new[: self._cap] = getattr(self, name)
            setattr(self, name, new)
        self._cap = cap

    def take(self) -> int:
        """A free slot, its figures a new rank's."""
        if self._free:
            slot = self._free.pop()
        else:
            if self._used == self._cap:
                self._grow(2 * self._cap)
            slot = self._used
            self._used += 1
        for name, (_dtype, blank) in _FIELDS.items():
            getattr(self, name)[slot] = blank
        return slot

    def release(self, slot: int) -> ProgressColumns:
        """Free ``slot``; a column set of one slot that holds its figures."""
        own = ProgressColumns(1)  # its one slot is its scratch: it is this rank's
        for name in _FIELDS:
            getattr(own, name)[own.scratch] = getattr(self, name)[slot]
        self._free.append(slot)
        return own


def _int_field(name: str, none: int | None = None) -> property:
    """A rank state's int attribute kept in its column (``none``: the value that
    reads as None)."""

    def get(rs: ColumnRank) -> int | None:
        v: int = getattr(rs.cols, name).item(rs.slot)
        return None if v == none else v

    def put(rs: ColumnRank, value: int | None) -> None:
        try:
            getattr(rs.cols, name)[rs.slot] = none if value is None else value
        except OverflowError:  # past int64: a malformed figure, refused as one
            raise ValueError(f"{name} {value} out of range") from None

    return property(get, put)


def _float_field(name: str) -> property:
    def get(rs: ColumnRank) -> float:
        v: float = getattr(rs.cols, name).item(rs.slot)
        return v

    def put(rs: ColumnRank, value: float) -> None:
        getattr(rs.cols, name)[rs.slot] = value

    return property(get, put)


class ColumnRank(_Rank):
    """A rank state whose progress figures live in :class:`ProgressColumns`."""

    __slots__ = ("cols", "slot")

    last_t = _float_field("last_t")
    first_step = _int_field("first_step", none=NO_STEP)
    done_step = _int_field("done_step")
    max_coll_step = _int_field("max_coll_step")
    top_seq = _int_field("top_seq")

    def __init__(self, rank: int, cols: ProgressColumns) -> None:
        self.cols = cols
        self.slot = cols.take()
        super().__init__(rank)

    def detach(self) -> None:
        """Keep this state's figures apart and free its slot (it was forgotten)."""
        self.cols = self.cols.release(self.slot)
        self.slot = self.cols.scratch


def slots_of(states: list[Any], cols: ProgressColumns) -> np.ndarray:
    """The slots of ``states`` (each a :class:`ColumnRank`) in ``cols``, in order;
    a state no longer there (forgotten since it was looked up) has the
    scratch slot."""
    scratch = cols.scratch
    return np.fromiter(
        (rs.slot if rs.cols is cols else scratch for rs in states), np.int64, len(states)
    )
