"""Where the correlator files each directed pair's flow samples (pure).

The correlator attributes each flow sample to a directed pair of ranks
(``rank -> peer``) and files it into a :class:`PairStore`; the flow matrix
(each pair's figures over the latest window) is read from it once a step.
Two kinds, one behaviour (``tests/test_flowstore.py`` holds them to each
other, to the bit):

* :class:`DequeStore` (a daemon's): a deque of sample tuples a pair, a
  Python loop a pair for the matrix (a tuple of ``PairFlow``). For a few
  pairs, nothing is cheaper.
* :class:`TableStore` (a leader's): a big job's leader files a sample a rank
  every probe interval (16k a second at 16k ranks) and rebuilds the matrix
  as often; kept as deques, one window in four cost it ~0.12 s instead of
  ~30 ms (``bench/leader_scale``, session 26). Here a sample is a row of one
  table (its pair's slot and its filing number, ``seq``, with it), a pair's
  totals a slot of a few arrays, and the matrix sums by segment
  (:class:`FlowMatrix`: a pair's ``PairFlow`` is made only when a rule
  iterates it).

A table's samples, one at a time (:meth:`TableStore.add`) or as rows of a
round's columns (:meth:`TableStore.add_rows`), wait in a pending list and are
folded in, in filing order, when anything reads the table. What a pair keeps
is exactly what its deque keeps: its live samples are its rows from its
``front`` on, and only the front moves, as ``popleft`` does:
- on filing, past samples older than ``2 * window_s`` before the one filed
  (memory stays flat when no step ever completes);
- on a matrix, past samples older than its horizon, or begun before the
  floor (``Correlator.drop_flows_before``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

_LOOPBACK_PREFIXES = ("127.", "[::1]", "[::ffff:127.")

#: ``new_tuple(Cls, fields)``: a named tuple made from its fields' tuple in C,
#: skipping the Python-level constructor each NamedTuple class has (for those
#: made per pair here, per node in ``cluster.summary``).
new_tuple = tuple.__new__

#: A flow sample as filed: (t, dt, tx, rx, srtt_us or None, retrans, cwnd or
#: None, dsack_dups).
FlowSample = tuple[float, float, int, int, Any, int, Any, int]


def loopback_endpoint(endpoint: object) -> bool:
    """Is ``endpoint`` (``addr:port``) on a loopback address?"""
    return isinstance(endpoint, str) and endpoint.startswith(_LOOPBACK_PREFIXES)


class PairFlow(NamedTuple):
    """Traffic ``rank`` -> ``peer`` as ``rank``'s sockets saw it over ``dt`` seconds.

    ``srtt_us`` is weighted by bytes sent (None when no flow reported one);
    ``samples`` are the window's own samples, for figures only some steps need
    (the network rule's medians, ``detect.network.figures``).
    """

    rank: int
    peer: int
    tx_bytes: int
    rx_bytes: int
    dt: float
    srtt_us: float | None
    retrans: int
    # The window's samples, ``(t, dt, tx, rx, srtt_us, retrans, cwnd,
    # dsack_dups)``: the network rule takes its medians from them, only when
    # it needs them.
    samples: tuple[tuple[Any, ...], ...] = ()
    # Every sample's source was a loopback address (:func:`loopback_endpoint`):
    # no wire and no queue between the ends, so its srtt and retransmits say
    # how promptly the two processes ran, nothing about a network.
    loopback: bool = False
    # Of ``retrans``, segments the receiver reported it already had (D-SACK):
    # spurious retransmits, of data that had arrived (its ACK was late).
    dsack_dups: int = 0


class PairState(NamedTuple):
    """One pair's totals and live samples at the moment it was read
    (:attr:`TableStore.pairs`): a copy, not a handle on the store."""

    key: tuple[int, int]
    tx_total: int
    rx_total: int
    retrans_total: int
    dsack_total: int  # of them, D-SACKed: spurious
    srtt_us: float | None  # the newest sample's that had one
    tx_rate: float | None  # the newest sample's with an interval, bytes/s
    rx_rate: float | None
    last_t: float  # its newest sample's time (the sweep's time-to-live)
    loopback: bool  # every sample's source was a loopback address
    samples: tuple[FlowSample, ...]


# A sample's columns. ``srtt`` and ``cwnd`` are kept as float64 with a kind
# (0 absent, 1 float, 2 int) so a sample reads back as it was filed; an int
# beyond 2**53 does not pass through a float exactly and is refused.
_COLS = (
    ("seq", np.int64), ("slot", np.int64), ("t", np.float64), ("dt", np.float64),
    ("tx", np.int64), ("rx", np.int64), ("srtt", np.float64), ("srtt_kind", np.int8),
    ("retrans", np.int64), ("cwnd", np.float64), ("cwnd_kind", np.int8),
    ("dsack", np.int64),
)  # fmt: skip
_SAMPLE = ("t", "dt", "tx", "rx", "srtt", "srtt_kind", "retrans", "cwnd", "cwnd_kind", "dsack")
_DTYPE = dict(_COLS)
#: What a filed sample brings: its columns, and its local endpoint (read only
#: while its pair's flows all came from loopback).
_FILED = (*_SAMPLE, "src")
ABSENT, FLOAT, INT = 0, 1, 2
_EXACT = 1 << 53
_I64 = 1 << 63


def _column(values: Sequence[Any], name: str) -> np.ndarray:
    if name == "src":  # objects, whatever they are (a tuple is one too)
        return np.fromiter(values, object, len(values))
    return np.array(values, _DTYPE[name])


def number_kind(v: Any, what: str) -> tuple[float, int]:
    """An optional srtt or cwnd as filed: (value, kind); TypeError for anything
    but None, an int within 2**53 or a float."""
    if v is None:
        return 0.0, ABSENT
    if type(v) is float:
        return v, FLOAT
    if isinstance(v, int) and -_EXACT <= v <= _EXACT:
        return float(v), INT
    raise TypeError(f"a flow's {what} is not a number")


def run_bounds(keys: np.ndarray) -> np.ndarray:
    """Where each run of equal values in ``keys`` (grouped) begins, then ``len(keys)``:
    run ``i`` is ``bounds[i] .. bounds[i + 1] - 1``."""
    return (
        np.flatnonzero(np.r_[True, keys[1:] != keys[:-1], True])
        if len(keys)
        else np.zeros(1, np.int64)
    )


def _read(value: float, kind: int) -> Any:
    return None if kind == ABSENT else (int(value) if kind == INT else value)


class PairStore(ABC):
    """Where the correlator files each directed pair's flow samples; a pair is a
    ``slot`` (an int), made by :meth:`make` and kept in :attr:`slots`.

    Two kinds, one behaviour (``tests/test_flowstore.py`` holds them to each
    other): :class:`DequeStore`, a deque of tuples a pair (a daemon's: a few
    pairs, a matrix a step, no array set up for it), and :class:`TableStore`,
    one table (a leader's: 16k pairs a window).
    """

    def __init__(self, window_s: float, max_pairs: int) -> None:
        self.window_s = window_s
        self.max_pairs = max_pairs
        self.slots: dict[tuple[int, int], int] = {}  # (rank, peer) -> slot, in making order
        self.filed = 0  # samples filed

    @abstractmethod
    def make(self, key: tuple[int, int]) -> int | None:
        """A new pair's slot (None when there is no room)."""

    @abstractmethod
    def key_of(self, slot: int) -> tuple[int, int]: ...

    @abstractmethod
    def add(self, slot: int, src: str, sample: FlowSample) -> None:
        """File one sample into ``slot`` (from local endpoint ``src``); TypeError or
        ValueError, before anything is filed, for a figure it cannot keep
        (:func:`number_kind`, counts beyond 64 bits)."""

    @abstractmethod
    def add_rows(
        self, source: Mapping[str, np.ndarray], rows: Sequence[int], slots: Sequence[int]
    ) -> None:
        """File rows ``rows`` of ``source`` (columns named as :data:`_SAMPLE`, and
        ``src``: each row's local endpoint, an object array; srtt and cwnd as
        :func:`number_kind` gives them) into ``slots``, in order."""

    @abstractmethod
    def matrix(self, horizon: float, floor: float) -> tuple[Sequence[PairFlow], float]:
        """Each pair's figures (by key) over the samples from ``horizon`` on that
        began at ``floor`` or later (those before leave the pair's front for
        good); and the oldest of the pairs' first samples' times."""

    @abstractmethod
    def sweep(self, horizon: float) -> list[tuple[int, tuple[int, int]]]:
        """Forget the pairs with no sample since ``horizon``: their slots and keys."""

    @abstractmethod
    def states(self) -> dict[tuple[int, int], PairState]:
        """Every pair's :class:`PairState`, in making order (all at once: a
        table's live samples are grouped in one pass)."""

    @abstractmethod
    def stall_figures(
        self, since: float
    ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """What ``Correlator.stall`` reads of the flows: per pair (by key), the
        retransmits of its live samples wholly after ``since``; then, when any,
        the bytes each read in samples begun after ``since`` and half over once
        the first resending sample ended."""

    @property
    def pairs(self) -> PairMap:
        """Every pair's :class:`PairState`, by key (read when looked up)."""
        return PairMap(self)


def _checked(sample: FlowSample) -> tuple[float, int, float, int]:
    """A sample's srtt and cwnd as :func:`number_kind` gives them; ValueError for a
    count beyond 64 bits."""
    _t, _dt, tx, rx, srtt, retrans, cwnd, dsack = sample
    if not (-_I64 <= tx < _I64 and -_I64 <= rx < _I64 and -_I64 <= retrans < _I64
            and -_I64 <= dsack < _I64):  # fmt: skip
        raise ValueError("a flow's count is out of range")
    return (*number_kind(srtt, "srtt"), *number_kind(cwnd, "cwnd"))


class _Pair:
    """A :class:`DequeStore` pair: its live samples and totals."""

    __slots__ = ("key", "samples", "tx_total", "rx_total", "retrans_total", "dsack_total",
                 "srtt_us", "tx_rate", "rx_rate", "last_t", "loopback")  # fmt: skip

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = key
        self.samples: deque[FlowSample] = deque()
        self.tx_total = self.rx_total = self.retrans_total = self.dsack_total = 0
        self.srtt_us: float | None = None
        self.tx_rate: float | None = None
        self.rx_rate: float | None = None
        self.last_t = 0.0  # its newest sample's time (the sweep's time-to-live)
        self.loopback = True  # until a sample from a routable address comes


class DequeStore(PairStore):
    """A deque of sample tuples a pair, a Python loop a pair for the matrix: for a
    daemon's few pairs, where setting arrays up would cost more than it saves.
    A pair's matrix figures are kept until its samples change."""

    def __init__(self, window_s: float, max_pairs: int) -> None:
        super().__init__(window_s, max_pairs)
        self._pairs: list[_Pair | None] = []
        self._free: list[int] = []
        self._views: dict[int, PairFlow] = {}  # slot -> its figures, while its samples last
        self._order: list[int] | None = None  # the slots by key; None when they change

    def make(self, key: tuple[int, int]) -> int | None:
        if len(self.slots) >= self.max_pairs:
            return None
        pair = _Pair(key)
        if self._free:
            slot = self._free.pop()
            self._pairs[slot] = pair
        else:
            slot = len(self._pairs)
            self._pairs.append(pair)
        self.slots[key] = slot
        self._order = None
        return slot

    def key_of(self, slot: int) -> tuple[int, int]:
        return self._pairs[slot].key  # type: ignore[union-attr]

    def add(self, slot: int, src: str, sample: FlowSample) -> None:
        _checked(sample)
        pair: _Pair = self._pairs[slot]  # type: ignore[assignment]
        t, dt, tx, rx, srtt, retrans, _cwnd, dsack = sample
        samples = pair.samples
        samples.append(sample)
        self.filed += 1
        if t > pair.last_t:
            pair.last_t = t
        self._views.pop(slot, None)
        # Keep memory flat when no step ever completes (probes, no trainer).
        while samples[0][0] < t - 2 * self.window_s:
            samples.popleft()
        pair.tx_total += tx
        pair.rx_total += rx
        pair.retrans_total += retrans
        pair.dsack_total += dsack
        if pair.loopback and not loopback_endpoint(src):
            pair.loopback = False
        if srtt is not None:
            pair.srtt_us = float(srtt)
        if dt > 0:
            pair.tx_rate = tx / dt
            pair.rx_rate = rx / dt

    def add_rows(
        self, source: Mapping[str, np.ndarray], rows: Sequence[int], slots: Sequence[int]
    ) -> None:
        take = np.asarray(rows, np.int64)
        cols = {name: source[name][take] for name in _SAMPLE}
        for slot, sample, src in zip(slots, sample_tuples(cols), source["src"][take].tolist(),
                                     strict=True):  # fmt: skip
            self.add(slot, src, sample)

    def _by_key(self) -> list[int]:
        if self._order is None:
            self._order = [self.slots[k] for k in sorted(self.slots)]
        return self._order

    def matrix(self, horizon: float, floor: float) -> tuple[tuple[PairFlow, ...], float]:
        out: list[PairFlow] = []
        oldest = math.inf
        views = self._views
        for slot in self._by_key():
            pair: _Pair = self._pairs[slot]  # type: ignore[assignment]
            samples = pair.samples
            while samples and (samples[0][0] < horizon or samples[0][0] - samples[0][1] < floor):
                samples.popleft()
                views.pop(slot, None)
            if not samples:
                continue
            if samples[0][0] < oldest:
                oldest = samples[0][0]
            # Pairs report about once a second, steps come faster: the same
            # samples give the same figures, so reuse them until they change.
            view = views.get(slot)
            if view is None:
                tx = rx = retrans = dsack = wbytes = 0
                dt = wsum = 0.0
                for _t, sdt, stx, srx, srtt, sre, _cwnd, sdup in samples:
                    tx += stx
                    rx += srx
                    dt += sdt
                    retrans += sre
                    dsack += sdup
                    if srtt is not None:
                        w = stx if stx > 0 else 1
                        wsum += srtt * w
                        wbytes += w
                key = pair.key
                view = views[slot] = new_tuple(
                    PairFlow,
                    (key[0], key[1], tx, rx, dt, (wsum / wbytes) if wbytes else None, retrans,
                     tuple(samples), pair.loopback, dsack),
                )  # fmt: skip
            out.append(view)
        return tuple(out), oldest

    def sweep(self, horizon: float) -> list[tuple[int, tuple[int, int]]]:
        stale = [(s, k) for k, s in self.slots.items() if self._pairs[s].last_t < horizon]  # type: ignore[union-attr]
        for slot, key in stale:
            del self.slots[key]
            self._pairs[slot] = None
            self._views.pop(slot, None)
            self._free.append(slot)
        if stale:
            self._order = None
        return stale

    def states(self) -> dict[tuple[int, int], PairState]:
        out = {}
        for key, slot in self.slots.items():
            p: _Pair = self._pairs[slot]  # type: ignore[assignment]
            out[key] = PairState(
                key, p.tx_total, p.rx_total, p.retrans_total, p.dsack_total, p.srtt_us,
                p.tx_rate, p.rx_rate, p.last_t, p.loopback, tuple(p.samples),
            )  # fmt: skip
        return out

    def stall_figures(
        self, since: float
    ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        pairs: list[_Pair] = [self._pairs[s] for s in self._by_key()]  # type: ignore[misc]
        retrans: list[tuple[int, int, int]] = []
        delivered: list[tuple[int, int, int]] = []
        resent = math.inf  # when the first resending sample inside it ended
        for pair in pairs:
            n = 0
            for x in pair.samples:
                if x[5] and x[0] - x[1] >= since:
                    n += x[5]
                    if x[0] < resent:
                        resent = x[0]
            if n:
                retrans.append((*pair.key, n))
        if retrans:
            for pair in pairs:
                got: int = sum(
                    x[3] for x in pair.samples if x[0] - x[1] >= since and x[0] - x[1] / 2 >= resent
                )
                if got:
                    delivered.append((*pair.key, got))
        return retrans, delivered


class _Table:
    """Columns of rows with room to grow (appended in blocks, compacted in place)."""

    def __init__(self) -> None:
        self.n = 0
        self._cap = 0
        self.c: dict[str, np.ndarray] = {name: np.zeros(0, dt) for name, dt in _COLS}

    def col(self, name: str) -> np.ndarray:
        return self.c[name][: self.n]

    def extend(self, block: dict[str, np.ndarray]) -> None:
        k = len(block["seq"])
        if self.n + k > self._cap:
            cap = max(1024, 2 * (self.n + k))
            for name, dt in _COLS:
                new = np.zeros(cap, dt)
                new[: self.n] = self.c[name][: self.n]
                self.c[name] = new
            self._cap = cap
        for name, _dt in _COLS:
            self.c[name][self.n : self.n + k] = block[name]
        self.n += k

    def keep(self, mask: np.ndarray) -> None:
        k = int(mask.sum())
        for name, _dt in _COLS:
            col = self.c[name]
            col[:k] = col[: self.n][mask]
        self.n = k


class TableStore(PairStore):
    """Every pair's samples as rows of one table, its totals a slot of arrays:
    for a leader's thousands of pairs (see the module's docstring).

    ``window_s`` is the matrix's window (samples are kept twice as long while
    no matrix is read); ``max_pairs`` how many pairs there is room for.
    """

    #: Below this many rows the table is never compacted.
    compact_rows = 4096

    def __init__(self, window_s: float, max_pairs: int) -> None:
        super().__init__(window_s, max_pairs)  # filed: the next sample's seq
        self._free: list[int] = []
        self._n_slots = 0
        # Per slot: its key, totals, newest figures (NaN: none), newest time,
        # whether every sample came from loopback, the seq of its oldest live
        # sample (any row of its slot from there on is live).
        i8, f8 = np.zeros(0, np.int64), np.zeros(0, np.float64)
        self.rank, self.peer = i8, i8
        self.tx_total, self.rx_total, self.retrans_total, self.dsack_total = i8, i8, i8, i8
        self.srtt_us, self.tx_rate, self.rx_rate, self.last_t = f8, f8, f8, f8
        self.loopback = np.zeros(0, np.bool_)
        self.front = i8
        self._cap = 0
        self._grow(64)
        self._table = _Table()
        # Not yet in the table, in filing order: runs of (source, rows,
        # slots); a ``None`` source is a run of single samples (rows: tuples).
        self._pending: list[tuple[Any, Any, list[int]]] = []  # rows: a list, or a range
        self._order: np.ndarray | None = None  # the slots in use by key; None when they change

    # ------------------------------------------------------------ slots

    _SLOT_ARRAYS = (
        "rank", "peer", "tx_total", "rx_total", "retrans_total", "dsack_total", "srtt_us",
        "tx_rate", "rx_rate", "last_t", "loopback", "front",
    )  # fmt: skip

    def _grow(self, cap: int) -> None:
        for name in self._SLOT_ARRAYS:
            old = getattr(self, name)
            new = np.zeros(cap, old.dtype)
            new[: self._cap] = old[: self._cap]
            setattr(self, name, new)
        self._cap = cap

    def make(self, key: tuple[int, int]) -> int | None:
        if len(self.slots) >= self.max_pairs:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            if self._n_slots >= self._cap:
                self._grow(2 * self._cap)
            slot = self._n_slots
            self._n_slots += 1
        for name in ("tx_total", "rx_total", "retrans_total", "dsack_total"):
            getattr(self, name)[slot] = 0
        for name in ("srtt_us", "tx_rate", "rx_rate"):
            getattr(self, name)[slot] = math.nan
        self.rank[slot], self.peer[slot] = key
        self.last_t[slot] = 0.0
        self.loopback[slot] = True  # until a sample from a routable address comes
        self.front[slot] = self.filed  # no sample yet: the next filed is its first
        self.slots[key] = slot
        self._order = None
        return slot

    def key_of(self, slot: int) -> tuple[int, int]:
        return (int(self.rank[slot]), int(self.peer[slot]))

    # ------------------------------------------------------------ filing

    def add(self, slot: int, src: str, sample: FlowSample) -> None:
        t, dt, tx, rx, _srtt, retrans, _cwnd, dsack = sample
        sv, sk, cv, ck = _checked(sample)
        row = (t, dt, tx, rx, sv, sk, retrans, cv, ck, dsack, src)
        pending = self._pending
        if pending and pending[-1][0] is None:
            pending[-1][1].append(row)
            pending[-1][2].append(slot)
        else:
            pending.append((None, [row], [slot]))
        self.filed += 1

    def add_rows(
        self, source: Mapping[str, np.ndarray], rows: Sequence[int], slots: Sequence[int]
    ) -> None:
        pending = self._pending
        if pending and pending[-1][0] is source:
            last = pending[-1]
            was = last[1]
            if (type(was) is range and type(rows) is range and was.step == rows.step == 1
                    and was.stop == rows.start):  # fmt: skip
                last[2].extend(slots)
                pending[-1] = (source, range(was.start, rows.stop), last[2])
            else:
                if type(was) is range:
                    pending[-1] = last = (source, list(was), last[2])
                last[1].extend(rows)
                last[2].extend(slots)
        else:
            # A run of rows stays a range: cut from the columns, not gathered.
            pending.append((source, rows if type(rows) is range else list(rows), list(slots)))
        self.filed += len(rows)

    def _flush(self) -> None:
        """Fold the pending samples into the table and the totals."""
        if not self._pending:
            return
        parts: list[dict[str, np.ndarray]] = []
        for source, rows, slots in self._pending:
            part: dict[str, np.ndarray]
            if source is None:
                cols = zip(*rows, strict=True)
                part = {name: _column(col, name) for name, col in zip(_FILED, cols,
                                                                                strict=True)}  # fmt: skip
            elif type(rows) is range:
                part = {name: source[name][rows.start : rows.stop : rows.step] for name in _FILED}
            else:
                take = np.array(rows, np.int64)
                part = {name: source[name][take] for name in _FILED}
            part["slot"] = np.array(slots, np.int64)
            parts.append(part)
        self._pending = []
        block = {name: np.concatenate([p[name] for p in parts]).astype(dt, copy=False)
                 for name, dt in _COLS if name != "seq"}  # fmt: skip
        block["src"] = np.concatenate([p["src"] for p in parts])
        n = len(block["slot"])
        block["seq"] = np.arange(self.filed - n, self.filed, dtype=np.int64)
        self._fold_totals(block)
        self._table.extend(block)
        self._drop_on_filing(block)
        self._compact()

    def _fold_totals(self, b: dict[str, np.ndarray]) -> None:
        s = b["slot"]
        for total, col in (("tx_total", "tx"), ("rx_total", "rx"), ("retrans_total", "retrans"),
                           ("dsack_total", "dsack")):  # fmt: skip
            np.add.at(getattr(self, total), s, b[col])
        # The newest (in filing order) sample's figures: the last row of each slot.
        has = b["srtt_kind"] != ABSENT
        _set_last(self.srtt_us, s[has], b["srtt"][has])
        timed = b["dt"] > 0
        dt = b["dt"][timed]
        _set_last(self.tx_rate, s[timed], b["tx"][timed] / dt)
        _set_last(self.rx_rate, s[timed], b["rx"][timed] / dt)
        # Still loopback: its new samples' sources say (a pair's flag, once
        # down, stays down: only those pairs' endpoints are read).
        ask = np.flatnonzero(self.loopback[s])
        if len(ask):
            lo = np.fromiter(map(loopback_endpoint, b["src"][ask].tolist()), bool, len(ask))
            self.loopback[s[ask[~lo]]] = False

    def _drop_on_filing(self, b: dict[str, np.ndarray]) -> None:
        """Each filed sample drops, from its pair's front, the samples older than
        ``2 * window_s`` before it, in filing order (as the deque's popleft).

        Only a sample newer than every one its pair filed before (a *raising*
        one) can drop any, while the front is no older than that bound of the
        newest (true after every raising sample); so the front ends at the
        pair's first live sample, up to its last raising one, within the bound
        of that one. A pair whose front breaks that (a matrix left it older,
        or its first new sample is old) is walked sample by sample.
        """
        s, t, seq = b["slot"], b["t"], b["seq"]
        two = 2 * self.window_s
        order = np.argsort(s, kind="stable")
        ss, ts, qs = s[order], t[order], seq[order]
        bounds = run_bounds(ss)
        starts, lengths = bounds[:-1], np.diff(bounds)
        seg_slot = ss[starts]
        # before the block: each slot's newest time; its first live sample's
        # time (the block's first, when the pair had none left)
        m0 = self.last_t[seg_slot].copy()
        tab = self._table
        sl_all, sq_all = tab.col("slot"), tab.col("seq")
        live = sq_all >= self.front[sl_all]
        first = np.full(self._n_slots, np.iinfo(np.int64).max)
        np.minimum.at(first, sl_all[live], sq_all[live])
        first_t = tab.col("t")[np.searchsorted(sq_all, first[seg_slot])]
        slow = first_t < m0 - two  # the front breaks the bound
        # The raising samples: a running max a segment, position by position.
        cur = m0.copy()
        last_raise = np.full(len(starts), -1, np.int64)
        raise_t = np.zeros(len(starts))
        for k in range(int(lengths.max())):
            seg = np.flatnonzero(lengths > k)
            at = starts[seg] + k
            up = ts[at] > cur[seg]
            cur[seg[up]] = ts[at[up]]
            last_raise[seg[up]] = qs[at[up]]
            raise_t[seg[up]] = ts[at[up]]
        self.last_t[seg_slot] = cur
        fast = ~slow & (last_raise >= 0)
        if fast.any():
            fs, j, thr = seg_slot[fast], last_raise[fast], raise_t[fast] - two
            lim = np.full(self._n_slots, -1, np.int64)
            lim[fs] = j
            bound = np.zeros(self._n_slots)
            bound[fs] = thr
            ts_all = tab.col("t")
            cand = live & (sq_all <= lim[sl_all])
            cand &= ~(ts_all < bound[sl_all])
            new = np.full(self._n_slots, np.iinfo(np.int64).max)
            np.minimum.at(new, sl_all[cand], sq_all[cand])
            self.front[fs] = new[fs]
        for slot in seg_slot[slow].tolist():
            self._walk_filing(slot, b)

    def _walk_filing(self, slot: int, b: dict[str, np.ndarray]) -> None:
        """:meth:`_drop_on_filing` for one pair, sample by sample."""
        tab = self._table
        mine = (tab.col("slot") == slot) & (tab.col("seq") >= self.front[slot])
        ts = tab.col("t")[mine].tolist()
        qs = tab.col("seq")[mine].tolist()
        new = set(b["seq"][b["slot"] == slot].tolist())
        two = 2 * self.window_s
        f = 0
        for i, q in enumerate(qs):
            if q not in new:
                continue
            while f < i and ts[f] < ts[i] - two:
                f += 1
        self.front[slot] = qs[f] if qs else self.filed

    def _compact(self) -> None:
        """Drop the table's dead rows once they outnumber the live ones."""
        tab = self._table
        if tab.n < self.compact_rows:
            return
        alive = tab.col("seq") >= self.front[tab.col("slot")]
        if 2 * int(alive.sum()) < tab.n:
            tab.keep(alive)

    # ------------------------------------------------------------ reading

    def _live(self) -> tuple[np.ndarray, np.ndarray]:
        """The live rows' table indices grouped by slot, in key order (each slot's
        in filing order), and each one's slot."""
        tab = self._table
        sl = tab.col("slot")
        alive = np.flatnonzero(tab.col("seq") >= self.front[sl])
        order = self.order()
        rank_of = np.zeros(self._n_slots, np.int64)
        rank_of[order] = np.arange(len(order))
        idx = alive[np.argsort(rank_of[sl[alive]], kind="stable")]
        return idx, sl[idx]

    def order(self) -> np.ndarray:
        """The slots in use, by key."""
        if self._order is None:
            used = np.array(list(self.slots.values()), np.int64)
            self._order = used[np.lexsort((self.peer[used], self.rank[used]))]
        return self._order

    def matrix(self, horizon: float, floor: float) -> tuple[FlowMatrix, float]:
        """Each pair's figures over the samples from ``horizon`` on that began at
        ``floor`` or later (those before leave the pair's front for good); and
        the oldest sample's time in it."""
        self._flush()
        tab = self._table
        idx, sl = self._live()
        t, dt = tab.col("t")[idx], tab.col("dt")[idx]
        gone = (t < horizon) | (t - dt < floor)
        # The front moves past every sample before a pair's first kept one.
        kept = ~gone
        n = self._n_slots
        first = np.full(n, np.iinfo(np.int64).max)
        seq = tab.col("seq")[idx]
        np.minimum.at(first, sl[kept], seq[kept])
        touched = sl[run_bounds(sl)[:-1]]  # each slot once (sl is grouped by slot)
        empty = first[touched] == np.iinfo(np.int64).max
        self.front[touched] = np.where(empty, self.filed, first[touched])
        live = seq >= self.front[sl]
        idx, sl = idx[live], sl[live]
        m = FlowMatrix.of(self, idx, sl)
        # the oldest of the pairs' first samples (a NaN time is never the oldest)
        firsts = m.samples["t"][m.bounds[:-1]]
        firsts = firsts[~np.isnan(firsts)]
        return m, (float(firsts.min()) if len(firsts) else math.inf)

    def sweep(self, horizon: float) -> list[tuple[int, tuple[int, int]]]:
        """Forget the pairs with no sample since ``horizon``: their slots and keys."""
        self._flush()
        stale = [(s, k) for k, s in self.slots.items() if self.last_t[s] < horizon]
        for slot, key in stale:
            del self.slots[key]
            self.front[slot] = self.filed  # its rows are dead
            self._free.append(slot)
        if stale:
            self._order = None
        return stale

    def states(self) -> dict[tuple[int, int], PairState]:
        self._flush()
        idx, sl = self._live()
        samples = sample_tuples({n: self._table.c[n][idx] for n in _SAMPLE})
        mine: dict[int, tuple[FlowSample, ...]] = {}
        bounds = run_bounds(sl).tolist()
        for a, b in zip(bounds, bounds[1:], strict=False):
            mine[int(sl[a])] = tuple(samples[a:b])
        out = {}
        for key, slot in self.slots.items():
            out[key] = PairState(
                key, int(self.tx_total[slot]), int(self.rx_total[slot]),
                int(self.retrans_total[slot]), int(self.dsack_total[slot]),
                _opt(self.srtt_us[slot]), _opt(self.tx_rate[slot]), _opt(self.rx_rate[slot]),
                float(self.last_t[slot]), bool(self.loopback[slot]), mine.get(slot, ()),
            )  # fmt: skip
        return out

    def stall_figures(
        self, since: float
    ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        self._flush()
        tab = self._table
        idx, sl = self._live()
        t, dt = tab.col("t")[idx], tab.col("dt")[idx]
        re, rx = tab.col("retrans")[idx], tab.col("rx")[idx]
        inside = t - dt >= since
        resending = (re != 0) & inside
        retrans = _per_pair(self, sl[resending], re[resending])
        if not retrans:
            return [], []
        resent = float(np.min(t[resending]))
        got = inside & (t - dt / 2 >= resent)
        return retrans, _per_pair(self, sl[got], rx[got])


def _per_pair(
    store: TableStore, slots: np.ndarray, values: np.ndarray
) -> list[tuple[int, int, int]]:
    """``values`` summed by slot, as (rank, peer, sum) by key, the zero sums left out."""
    if not len(slots):
        return []
    sums = np.zeros(store._n_slots, np.int64)
    np.add.at(sums, slots, values)
    order = store.order()
    hit = order[sums[order] != 0]
    return list(zip(store.rank[hit].tolist(), store.peer[hit].tolist(), sums[hit].tolist(),
                    strict=True))  # fmt: skip


def _set_last(target: np.ndarray, slots: np.ndarray, values: np.ndarray) -> None:
    """``target[slot] = value`` for each slot's last row."""
    if not len(slots):
        return
    rev = slots[::-1]
    uniq, first = np.unique(rev, return_index=True)
    target[uniq] = values[::-1][first]


def _opt(v: float) -> float | None:
    return None if math.isnan(v) else float(v)


class PairMap(Mapping[tuple[int, int], PairState]):
    """:attr:`PairStore.pairs`: keys in making order; the values read, all of them,
    at the first lookup (a snapshot of the store then)."""

    def __init__(self, store: PairStore) -> None:
        self._store = store
        self._states: dict[tuple[int, int], PairState] | None = None

    def __getitem__(self, key: tuple[int, int]) -> PairState:
        if self._states is None:
            self._states = self._store.states()
        return self._states[key]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(list(self._store.slots))

    def __len__(self) -> int:
        return len(self._store.slots)

    def __contains__(self, key: object) -> bool:
        return key in self._store.slots


class FlowMatrix(Sequence[PairFlow]):
    """The flow matrix: each pair's :class:`PairFlow`, by key, as columns.

    ``cols`` holds the pairs' figures (``srtt_us`` NaN where ``has_srtt`` is
    not), summed by segment over ``samples`` (the live samples' columns,
    copied: the store's table moves on); a pair's ``PairFlow`` (and its
    samples' tuple) is made only when the matrix is iterated or indexed, once.
    Equal to a tuple of the same ``PairFlow``.
    """

    def __init__(
        self, cols: dict[str, np.ndarray], samples: dict[str, np.ndarray], bounds: np.ndarray
    ) -> None:
        self.cols = cols
        self.samples = samples
        self.bounds = bounds  # pair i's samples: bounds[i] .. bounds[i + 1] - 1
        self._flows: tuple[PairFlow, ...] | None = None

    @classmethod
    def of(cls, store: TableStore, idx: np.ndarray, sl: np.ndarray) -> FlowMatrix:
        """The matrix of table rows ``idx`` (grouped by slot in key order; ``sl``
        their slots)."""
        c = store._table.c
        smp = {name: c[name][idx] for name in _SAMPLE}
        bounds = run_bounds(sl)
        starts = bounds[:-1]
        slots = sl[starts]
        n = len(starts)

        def sums(col: np.ndarray) -> np.ndarray:
            return np.add.reduceat(col, starts) if len(col) else np.zeros(0, np.int64)

        tx = smp["tx"]
        has = smp["srtt_kind"] != ABSENT
        w = np.where(tx > 0, tx, 1)
        # Float sums a sample at a time, in filing order, as a Python loop adds
        # them (numpy's own sums pair them up): the figures come out the same.
        lengths = np.diff(bounds)
        wsum, dsum = np.zeros(n), np.zeros(n)
        srtt, dts = smp["srtt"], smp["dt"]
        for k in range(int(lengths.max()) if n else 0):
            seg = np.flatnonzero(lengths > k)
            at = starts[seg] + k
            dsum[seg] += dts[at]
            h = has[at]
            wsum[seg[h]] += srtt[at[h]] * w[at[h]]
        wbytes = sums(np.where(has, w, 0))
        cols = {
            "rank": store.rank[slots], "peer": store.peer[slots], "tx_bytes": sums(tx),
            "rx_bytes": sums(smp["rx"]), "dt": dsum,
            "srtt_us": np.divide(wsum, wbytes, out=np.full(n, np.nan), where=wbytes > 0),
            "has_srtt": wbytes > 0, "retrans": sums(smp["retrans"]),
            "loopback": store.loopback[slots], "dsack_dups": sums(smp["dsack"]),
        }  # fmt: skip
        return cls(cols, smp, bounds)

    def __len__(self) -> int:
        return len(self.cols["rank"])

    def flows(self) -> tuple[PairFlow, ...]:
        """Every pair's :class:`PairFlow` (made once)."""
        if self._flows is None:
            c = self.cols
            samples = sample_tuples(self.samples)
            b = self.bounds.tolist()
            srtt = [v if h else None for v, h in zip(c["srtt_us"].tolist(), c["has_srtt"].tolist(),
                                                      strict=True)]  # fmt: skip
            self._flows = tuple(
                new_tuple(PairFlow, (r, p, tx, rx, dt, s, re, tuple(samples[b[i]:b[i + 1]]), lo, dup))
                for i, (r, p, tx, rx, dt, s, re, lo, dup) in enumerate(zip(
                    c["rank"].tolist(), c["peer"].tolist(), c["tx_bytes"].tolist(),
                    c["rx_bytes"].tolist(), c["dt"].tolist(), srtt, c["retrans"].tolist(),
                    c["loopback"].tolist(), c["dsack_dups"].tolist(), strict=True))
            )  # fmt: skip
        return self._flows

    def __iter__(self) -> Iterator[PairFlow]:
        return iter(self.flows())

    def __getitem__(self, i: Any) -> Any:
        return self.flows()[i]

    def _same(self, other: FlowMatrix) -> bool:
        """Equal as tuples of ``PairFlow`` (compared on the columns)."""
        if len(self) != len(other) or not np.array_equal(self.bounds, other.bounds):
            return False
        a, b = self.cols, other.cols
        for name in ("rank", "peer", "tx_bytes", "rx_bytes", "dt", "has_srtt", "retrans",
                     "loopback", "dsack_dups"):  # fmt: skip
            if not np.array_equal(a[name], b[name]):
                return False
        if not np.array_equal(a["srtt_us"][a["has_srtt"]], b["srtt_us"][b["has_srtt"]]):
            return False
        x, y = self.samples, other.samples
        for name in ("t", "dt", "tx", "rx", "retrans", "dsack"):
            if not np.array_equal(x[name], y[name]):
                return False
        for value, kind in (("srtt", "srtt_kind"), ("cwnd", "cwnd_kind")):
            has = x[kind] != ABSENT
            if not np.array_equal(has, y[kind] != ABSENT):
                return False
            if not np.array_equal(x[value][has], y[value][has]):
                return False
        return True

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, FlowMatrix):
            return self._same(other)
        if isinstance(other, tuple):
            return self.flows() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.flows())

    def __repr__(self) -> str:
        return f"FlowMatrix({self.flows()!r})"


def sample_tuples(cols: Mapping[str, np.ndarray]) -> list[FlowSample]:
    """Sample columns (:data:`_SAMPLE`'s) as filed samples."""
    t, dt, tx, rx, sv, sk, re, cv, ck, dup = (cols[name].tolist() for name in _SAMPLE)
    return [
        (a, b, x, y, _read(v, k), r, _read(w, m), d)
        for a, b, x, y, v, k, r, w, m, d in zip(t, dt, tx, rx, sv, sk, re, cv, ck, dup,
                                                strict=True)
    ]  # fmt: skip


def routed_srtts(flows: Sequence[PairFlow], min_bytes: int) -> Sequence[float]:
    """The srtt of every routed (not loopback) flow that carried ``min_bytes`` or
    more and reported one, in order: read from the columns of a
    :class:`FlowMatrix` (and sorted there: an array), without making its flows."""
    if isinstance(flows, FlowMatrix):
        c = flows.cols
        ok = ~c["loopback"] & c["has_srtt"] & (c["tx_bytes"] >= min_bytes)
        out: Any = np.sort(c["srtt_us"][ok], kind="stable")  # as sorted(): equal ones in order
        return out
    return sorted(
        p.srtt_us for p in flows if not p.loopback and p.srtt_us is not None
        and p.tx_bytes >= min_bytes
    )  # fmt: skip
