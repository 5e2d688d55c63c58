"""The leader's per-rank progress as columns (``cluster.rankcols``): each rank's
figures read and written as attributes, and a round's digest filed over the
columns at once, are what noting it a rank at a time leaves (pure)."""

from __future__ import annotations

import math
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sentinel.cluster.leader import LeaderCorrelator
from fsdp_sentinel.cluster.rankcols import ColumnRank, ProgressColumns
from fsdp_sentinel.cluster.summary import KeyGroup, StepDigest
from fsdp_sentinel.correlate import LivenessColumns, StateLimits


def test_a_rank_state_in_columns_reads_and_writes_as_its_attributes() -> None:
    cols = ProgressColumns(2)
    a = ColumnRank(5, cols)
    assert (a.last_t, a.first_step, a.done_step, a.max_coll_step, a.top_seq) == (
        0.0,
        None,
        -1,
        -1,
        -1,
    )
    a.last_t, a.first_step, a.done_step, a.max_coll_step, a.top_seq = 7.5, 3, 4, 5, 60
    more = [ColumnRank(r, cols) for r in range(6, 16)]  # the columns grow past 2
    got = (a.last_t, a.first_step, a.done_step, a.max_coll_step, a.top_seq)
    assert got == (7.5, 3, 4, 5, 60)
    assert [type(v) for v in got] == [float, int, int, int, int]  # not numpy scalars
    assert all(r.done_step == -1 and r.first_step is None for r in more)
    a.first_step = None
    assert a.first_step is None
    with pytest.raises(ValueError, match="out of range"):
        a.done_step = 1 << 70
    # Forgotten, its figures stay its own; the slot it freed starts blank for
    # the next rank, and what the forgotten state is told never reaches it.
    a.first_step = 3
    a.detach()
    b = ColumnRank(99, cols)
    assert (b.last_t, b.first_step, b.done_step, b.top_seq) == (0.0, None, -1, -1)
    assert (a.last_t, a.first_step, a.done_step, a.top_seq) == (7.5, 3, 4, 60)
    a.done_step, a.last_t = 1000, 1e9
    assert (b.done_step, b.last_t) == (-1, 0.0)
    assert all(r.done_step == -1 for r in more)


def _digest(
    step: int, rows: list[tuple[int, int, int, float]], tops: list[int], as_array: bool
) -> StepDigest:
    """A digest of ``rows`` (rank, collectives, group, end: NaN without a step
    record), its groups' keys ending at ``tops``."""
    groups = tuple(KeyGroup(tuple(range(t - 2, t + 1)), (0.1,) * 3, (0.0,) * 3, 1) for t in tops)
    ranks = [r for r, _, _, _ in rows]
    n = [c for _, c, _, _ in rows]
    group = [g if c else -1 for _, c, g, _ in rows]
    end = [e for _, _, _, e in rows]
    zeros = [0.0] * len(rows)
    col: Any = (lambda code, v: array(code, v)) if as_array else (lambda _code, v: v)
    return StepDigest(
        step, groups, col("i", ranks), col("d", zeros), col("d", zeros), col("i", n),
        col("i", group), col("d", [e - 1.0 for e in end]), col("d", end),
        col("i", [0] * len(rows)), col("i", []),
    )  # fmt: skip


class _Reference:
    """Each rank noted one at a time, as the leader did before the columns."""

    def __init__(self) -> None:
        self.r: dict[int, list[Any]] = {}  # rank -> [last_t, first, done, max_coll, top]
        self.idle: set[int] = set()
        self.job_done = self.max_coll_step = -1

    def of(self, rank: int) -> list[Any]:
        return self.r.setdefault(rank, [0.0, None, -1, -1, -1])

    def add_digest(
        self, step: int, rows: list[tuple[int, int, int, float]], tops: list[int]
    ) -> None:
        busy = False
        for rank, n, g, _ in rows:
            s = self.of(rank)
            if s[1] is None or step < s[1]:
                s[1] = step
            if n:
                busy = True
                s[3] = max(s[3], step)
                s[4] = max(s[4], tops[g])
        if busy:
            self.max_coll_step = max(self.max_coll_step, step)

    def note_digest(self, step: int, rows: list[tuple[int, int, int, float]]) -> None:
        timed = [(rank, end) for rank, _, _, end in rows if end == end]
        for rank, end in timed:
            s = self.of(rank)
            s[0] = max(s[0], end)
            if s[1] is None or step < s[1]:
                s[1] = step
            if step > s[2]:
                if s[2] < 0:
                    self.idle.discard(rank)
                s[2] = step
        if timed:
            self.job_done = max(self.job_done, step)


_row = st.tuples(
    st.integers(0, 11),  # rank: a dozen, so digests repeat and share them
    st.integers(0, 3),  # collectives
    st.integers(0, 2),  # group
    st.one_of(st.just(math.nan), st.floats(1.0, 1e4, allow_nan=False)),  # end
)
_op = st.one_of(
    st.tuples(
        st.just("digest"),
        st.integers(0, 40),
        st.lists(_row, min_size=1, max_size=14),
        st.lists(st.integers(3, 500), min_size=3, max_size=3),
        st.booleans(),
    ),
    st.tuples(st.just("again"), st.integers(0, 40)),  # the last digest's ranks, another step
    st.tuples(st.just("forget"), st.integers(0, 11)),
    st.tuples(st.just("announce"), st.integers(0, 11)),
)


@settings(max_examples=150, deadline=None)
@given(story=st.lists(_op, min_size=1, max_size=25))
def test_a_digest_filed_over_the_columns_leaves_each_rank_as_noting_it_a_rank_at_a_time(
    story: list[Any],
) -> None:
    # Steps out of order, ranks named twice, ranks without collectives or a
    # step record, ranks announced (idle until a step record) and forgotten
    # between digests (a forgotten rank comes back blank but for its newest
    # seq), the same ranks' bytes again (the looked-up states serve again).
    corr, ref = LeaderCorrelator(), _Reference()
    last: tuple[Any, Any, bool] | None = None
    for op in story:
        if op[0] == "announce":
            rank = op[1]
            corr.add_rank({"kind": "rank", "t": 1.0, "rank": rank, "world_size": 12,
                           "host": "h", "pid": 100 + rank, "addrs": []})  # fmt: skip
            s = ref.of(rank)
            s[0] = max(s[0], 1.0)  # heard from at its record's time
            if s[2] < 0 and s[3] < 0:
                ref.idle.add(rank)
        elif op[0] == "forget":
            rank = op[1]
            corr.forget_rank(rank)
            gone = ref.r.pop(rank, None)
            if gone is not None and gone[4] >= 0:
                ref.r[rank] = [0.0, None, -1, -1, gone[4]]
            ref.idle.discard(rank)
        elif op[0] != "again" or last is not None:
            if op[0] == "again":
                (rows, tops, as_array), step = last, op[1]  # type: ignore[misc]
            else:
                _, step, rows, tops, as_array = op
                last = (rows, tops, as_array)
            d = _digest(step, rows, tops, as_array)
            corr.add_digest(d)
            corr.note_digest(d)
            ref.add_digest(step, rows, tops)
            ref.note_digest(step, rows)
        for rank, s in ref.r.items():
            rs = corr.ranks.get(rank)
            if rs is None:  # forgotten, never named since: only its seq is kept
                assert s[:4] == [0.0, None, -1, -1]
                continue
            got = [rs.last_t, rs.first_step, rs.done_step, rs.max_coll_step, corr.newest_seq(rs)]
            assert got == s, (rank, op)
        assert set(corr._idle) == ref.idle
        assert (corr.job_done, corr.max_coll_step) == (ref.job_done, ref.max_coll_step)


def test_a_big_jobs_liveness_view_reads_each_ranks_figures_from_the_columns() -> None:
    # 100 ranks: the liveness view is columns (COLUMNAR_RANKS), read through
    # the slots of the ranks in order, which change as ranks go and come.
    corr = LeaderCorrelator()
    rows = [(r, 1, 0, 50.0 + r) for r in range(100)]
    for step in (0, 1):
        d = _digest(step, rows, [9], True)
        corr.add_digest(d)
        corr.note_digest(d)
    assert len(corr.liveness()) == 100
    corr.forget_rank(7)
    corr.forget_rank(9)
    # Step 2 names every third rank: 9 comes back (its slot another's), 7 not.
    d = _digest(2, [(r, 1, 0, 60.0 + r) for r in range(0, 100, 3)], [12], True)
    corr.add_digest(d)
    corr.note_digest(d)
    live = corr.liveness()
    assert isinstance(live, LivenessColumns)
    assert len(live) == 99 and live.row_of(7) is None
    for lv in live:
        rs = corr.ranks[lv.rank]
        assert (lv.last_t, lv.done_step) == (rs.last_t, rs.done_step)
    by_rank = {lv.rank: lv for lv in live}
    assert (by_rank[9].done_step, by_rank[9].last_t, corr.ranks[9].first_step) == (2, 69.0, 2)
    assert (by_rank[3].done_step, by_rank[3].last_t) == (2, 63.0)
    assert (by_rank[4].done_step, by_rank[4].last_t) == (1, 54.0)


def test_a_rank_forgotten_while_a_digests_ranks_are_looked_up_never_writes_into_a_new_ones_slot() -> (
    None
):
    # The rank map full: looking up rank 7 evicts rank 0, the idle rank
    # looked up first, and rank 7 is given the slot rank 0 freed. What the
    # digest's collectives say of rank 0 goes nowhere (as into a forgotten
    # state), not into rank 7's figures. Its step records are noted after the
    # lookup is made again (an eviction since), which brings rank 0 back and
    # evicts rank 1, the idle one left.
    corr = LeaderCorrelator(limits=StateLimits(max_ranks=4))
    for rank in (0, 1):
        corr.add_rank({"kind": "rank", "t": 1.0, "rank": rank, "world_size": 8,
                       "host": "h", "pid": 100 + rank, "addrs": []})  # fmt: skip
    d = _digest(3, [(0, 1, 0, 90.0), (5, 1, 0, 20.0), (6, 1, 0, 20.0), (7, 1, 1, 10.0)],
                [40, 9], True)  # fmt: skip
    corr.add_digest(d)
    corr.note_digest(d)
    assert sorted(corr.ranks) == [0, 5, 6, 7] and corr.evicted["rank"] == 2
    r7, r0 = corr.ranks[7], corr.ranks[0]
    assert (r7.last_t, r7.done_step, r7.first_step, r7.max_coll_step) == (10.0, 3, 3, 3)
    assert corr.newest_seq(r7) == 9
    assert (r0.last_t, r0.done_step, r0.max_coll_step, corr.newest_seq(r0)) == (90.0, 3, -1, -1)
    # The next digest of the same ranks finds every one: all are noted.
    corr.add_digest(d._replace(step=4))
    corr.note_digest(d._replace(step=4))
    assert (r0.max_coll_step, corr.newest_seq(r0), r7.last_t, r7.done_step) == (4, 40, 10.0, 4)
