"""The two flow stores (``fsdp_sentinel.flowstore``) against each other (pure).

Until session 28 each pair kept its samples in a deque, dropped from the
front on filing (older than twice the window before the sample filed) and on
every matrix (older than its horizon, or begun before the floor), with a
Python loop a pair for the matrix: that code is :class:`DequeStore` (a
daemon's). :class:`TableStore` (a leader's) keeps every sample as a row of
one table and sums by segment. Random filings (one at a time and as rows,
out of order, NaN times among them), matrices with a lagging clock, sweeps
and stall reads must leave the two with the same samples, totals and
figures, to the bit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fsdp_sentinel.flowstore import (
    DequeStore,
    FlowMatrix,
    PairStore,
    TableStore,
    number_kind,
)

WINDOW = 2.0


def _state(pairs: Any) -> list[Any]:
    return [
        (k, p.tx_total, p.rx_total, p.retrans_total, p.dsack_total, p.srtt_us, p.tx_rate,
         p.rx_rate, p.loopback, p.last_t, repr(list(p.samples)))
        for k, p in sorted(pairs.items())
    ]  # fmt: skip


_KEYS = [(0, 1), (1, 0), (1, 2), (2, 3), (3, 0)]
_times = st.one_of(
    st.integers(min_value=0, max_value=24).map(lambda v: v / 2),
    st.just(math.nan),
)
_samples = st.tuples(
    st.sampled_from(range(len(_KEYS))),
    _times,
    st.sampled_from([0.0, 0.5, 1.0, 3.0]),  # dt
    st.integers(min_value=0, max_value=5000),  # tx
    st.integers(min_value=0, max_value=50),  # rx
    st.one_of(
        st.none(),
        st.integers(min_value=1, max_value=900),
        st.floats(min_value=1.0, max_value=900.0),
    ),  # fmt: skip
    st.integers(min_value=0, max_value=3),  # retrans
    st.one_of(st.none(), st.integers(min_value=1, max_value=90)),  # cwnd
    st.integers(min_value=0, max_value=2),  # dsack
    st.sampled_from(["127.0.0.1:5", "198.18.0.1:5"]),
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), _samples),
        st.tuples(st.just("rows"), st.lists(_samples, min_size=1, max_size=9)),
        st.tuples(st.just("matrix"), _times, st.sampled_from([-math.inf, 1.0, 4.0])),
        st.tuples(st.just("sweep"), _times),
        st.tuples(st.just("stall"), _times),
    ),
    max_size=40,
)


def _rows_source(samples: list[Any]) -> dict[str, np.ndarray]:
    """Samples as the columns ``TableStore.add_rows`` takes (as a leader's round)."""
    srtt = [number_kind(s[5], "srtt") for s in samples]
    cwnd = [number_kind(s[7], "cwnd") for s in samples]
    return {
        "t": np.array([s[1] for s in samples]), "dt": np.array([s[2] for s in samples]),
        "tx": np.array([s[3] for s in samples]), "rx": np.array([s[4] for s in samples]),
        "srtt": np.array([v for v, _ in srtt]), "srtt_kind": np.array([k for _, k in srtt], np.int8),
        "retrans": np.array([s[6] for s in samples]), "cwnd": np.array([v for v, _ in cwnd]),
        "cwnd_kind": np.array([k for _, k in cwnd], np.int8),
        "dsack": np.array([s[8] for s in samples]),
        "src": np.array([s[9] for s in samples], object),
    }  # fmt: skip


_S = (1.0, 10, 0, None, 0, None, 0, "198.18.0.1:5")  # a sample's fields after its time


@settings(max_examples=400, deadline=None)
@given(_ops, st.sampled_from([4096, 4]), st.booleans())
# A pair emptied by a matrix whose next samples are older than its newest
# less twice the window: the second drops the first (the walked path).
@example([("rows", [(0, 12.0, *_S)]), ("matrix", 20.0, -math.inf),
          ("add", (0, 0.0, *_S)), ("add", (0, 4.5, *_S))],
         4096, False)  # fmt: skip
# The same, the first sample just on the bound: kept.
@example([("rows", [(0, 12.0, *_S)]), ("matrix", 20.0, -math.inf),
          ("add", (0, 0.0, *_S)), ("add", (0, 4.0, *_S))],
         4096, False)  # fmt: skip
# A matrix read with a clock behind the samples leaves an old front.
@example([("rows", [(0, 1.0, *_S), (0, 3.0, *_S), (0, 4.0, *_S)]), ("matrix", 4.0, -math.inf),
          ("add", (0, 8.5, *_S)), ("add", (0, 4.0, *_S)), ("add", (0, 9.0, *_S))],
         4096, False)  # fmt: skip
def test_the_table_keeps_what_a_deque_a_pair_keeps(
    ops: list[Any], compact_rows: int, every_op: bool
) -> None:
    # ``every_op``: the state read (so the pending samples filed) after every
    # operation; else only at reads, so filings pile up between them.
    ref, store = DequeStore(WINDOW, max_pairs=64), TableStore(WINDOW, max_pairs=64)
    store.compact_rows = compact_rows  # 4: its dead rows dropped all along

    def slot(store: PairStore, key: tuple[int, int]) -> int:
        got = store.slots.get(key)
        return got if got is not None else store.make(key)  # type: ignore[return-value]

    for op, *args in ops:
        if op in ("add", "rows"):
            batch = [args[0]] if op == "add" else args[0]
            if op == "add":  # the daemon's way into both
                k, *fig, src = args[0]
                for st_ in (ref, store):
                    st_.add(slot(st_, _KEYS[k]), src, tuple(fig))  # type: ignore[arg-type]
            else:  # the leader's way into both
                source = _rows_source(batch)
                # One run of rows, two runs of one round (a range each), or a
                # range then a list of rows, by the batch's length.
                cut = len(batch) // 2 if len(batch) % 3 else len(batch)
                parts: list[Any] = [range(cut), range(cut, len(batch))]
                if len(batch) % 3 == 2:
                    parts[1] = list(parts[1])
                for st_ in (ref, store):
                    for rows in parts:
                        st_.add_rows(source, rows, [slot(st_, _KEYS[batch[i][0]]) for i in rows])
        elif op == "matrix":
            now, floor = args
            want, want_oldest = ref.matrix(now - WINDOW, floor)
            got, oldest = store.matrix(now - WINDOW, floor)
            assert isinstance(want, tuple) and isinstance(got, FlowMatrix)
            if not any(math.isnan(x[0]) for p in want for x in p.samples):  # NaN != NaN
                assert got == want  # FlowMatrix against the tuple
            assert repr(tuple(got)) == repr(want)  # to the bit, ints as ints
            assert repr(oldest) == repr(want_oldest)
        elif op == "sweep":
            assert sorted(k for _s, k in store.sweep(args[0])) == sorted(
                k for _s, k in ref.sweep(args[0])
            )
        else:
            assert store.stall_figures(args[0]) == ref.stall_figures(args[0])
        if every_op or op not in ("add", "rows"):
            assert _state(store.pairs) == _state(ref.pairs)
    assert _state(store.pairs) == _state(ref.pairs)


def _matrix_of(samples: list[tuple[Any, ...]]) -> FlowMatrix:
    store = TableStore(WINDOW, max_pairs=8)
    for key, sample in samples:
        s = store.slots.get(key)
        store.add(s if s is not None else store.make(key), "198.18.0.1:5", sample)  # type: ignore[arg-type]
    m, _ = store.matrix(-math.inf, -math.inf)
    assert isinstance(m, FlowMatrix)
    return m


def test_two_matrices_are_equal_as_their_flows_are() -> None:
    # The detector's memo compares a new matrix with the last one: on the
    # columns, never making either's flows, and as the tuples would compare.
    base: list[Any] = [
        ((0, 1), (1.0, 1.0, 10, 0, 500, 0, 9, 0)),
        ((1, 0), (1.0, 1.0, 7, 0, None, 0, None, 0)),
    ]
    a, b = _matrix_of(base), _matrix_of(base)
    assert a == b and a._flows is None and b._flows is None
    for i, j, v in ((0, 2, 11), (0, 4, 501.0), (0, 4, None), (0, 6, 8), (1, 6, 3), (0, 0, 1.5)):
        key, sample = base[i]
        other = list(base)
        other[i] = (key, sample[:j] + (v,) + sample[j + 1 :])
        c = _matrix_of(other)
        assert (a == c) == (tuple(a) == tuple(c)), (i, j, v)
    # an int srtt equals the same float, as in the tuples
    key, sample = base[0]
    c = _matrix_of([(key, sample[:4] + (500.0,) + sample[5:]), base[1]])
    assert a == c and tuple(a) == tuple(c)


def test_a_count_a_float_cannot_carry_is_refused_before_filing() -> None:
    store = TableStore(WINDOW, max_pairs=8)
    s = store.make((0, 1))
    assert s is not None
    for bad in ((1.0, 1.0, 1 << 63, 0, None, 0, None, 0), (1.0, 1.0, 1, 0, "9", 0, None, 0),
                (1.0, 1.0, 1, 0, (1 << 53) + 1, 0, None, 0), (1.0, 1.0, 1, 0, None, 0, 2.5j, 0)):  # fmt: skip
        try:
            store.add(s, "198.18.0.1:5", bad)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"filed {bad}")
    assert store.filed == 0 and store.pairs[(0, 1)].samples == ()
