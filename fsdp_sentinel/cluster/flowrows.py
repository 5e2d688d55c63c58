"""A window's flow records as fixed-width rows, and a round's rows as columns (pure).

A node forwards its probes' ``flow`` records to the leader, which attributes
them to ``(rank, peer)`` across nodes. At 16k ranks that is a record a rank
each probe interval; sent as JSON dicts, one window in four cost the leader
~180 ms instead of ~35 (``bench/leader_scale``): ~30 ms parsing them, ~50
filing them, the rest sorting, collecting and freeing 16k dicts.

So a node packs each *plain* flow record (:func:`plain`: the fields the
probes write, of the types they write) as one :data:`ROW` of 85 bytes, its
strings (host, endpoints) listed once a window (:class:`FlowRows`); any other
flow record travels as JSON as before. The leader joins a round's rows into
one array (:func:`flow_table`), checked in a few array operations, and files
them without a dict (``leader.LeaderPipeline.file_flow_rows``). A row read
back (:meth:`FlowTable.record`) is its record as the correlator reads it:
its absent fields absent. ``snd_wnd``, which no part of the leader reads, is
not sent.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from itertools import chain
from operator import is_
from typing import Any, NamedTuple

import numpy as np

from fsdp_sentinel.flowstore import ABSENT, FLOAT, INT

Record = dict[str, Any]

#: One flow record: its times and srtt, its integers, its strings' indices
#: (into its window's, then its round's, strings) and which optional fields
#: it had (``form``, the bits below). Packed: 85 bytes.
ROW = np.dtype(
    [("t", "<f8"), ("dt", "<f8"), ("srtt", "<f8"), ("pid", "<i8"), ("tx", "<i8"),
     ("rx", "<i8"), ("retrans", "<i8"), ("cwnd", "<i8"), ("dsack", "<i8"),
     ("host", "<u4"), ("src", "<u4"), ("dst", "<u4"), ("form", "u1")]
)  # fmt: skip
_ROW = struct.Struct("<dddqqqqqqIIIB")
assert _ROW.size == ROW.itemsize

#: ``form`` bits: which optional fields the record had; an int srtt (the
#: probes' own, from tcp_info) comes back an int.
HAS_SRTT, SRTT_INT, HAS_RETRANS, HAS_CWND, HAS_DSACK = 1, 2, 4, 8, 16
_FORMS = 32  # every form is below: a row with another is not one

_REQUIRED = frozenset(("kind", "t", "dt", "host", "pid", "src", "dst", "tx_bytes", "rx_bytes"))
#: What a plain record may hold: ``snd_wnd`` is left behind (no part of the
#: leader reads it).
_KNOWN = _REQUIRED | {"retrans", "srtt_us", "cwnd", "dsack_dups", "snd_wnd"}
_OPTIONAL_INTS = (("retrans", HAS_RETRANS), ("cwnd", HAS_CWND), ("dsack_dups", HAS_DSACK))
_I64 = 1 << 63
_EXACT = 1 << 53  # an int srtt within this goes through a float exactly


def _i64(v: Any) -> bool:
    return type(v) is int and -_I64 <= v < _I64


def plain(rec: Record) -> bool:
    """Can flow record ``rec`` travel as a row and come back as the correlator
    reads it: its required fields there, its times finite floats, its byte
    counts, pid and optional counts 64-bit ints (not bools), its strings
    strings, its srtt a finite float or an int, and nothing else but
    ``snd_wnd``."""
    keys = rec.keys()
    if not (keys >= _REQUIRED and keys <= _KNOWN):
        return False
    t, dt = rec["t"], rec["dt"]
    if (
        type(t) is not float
        or type(dt) is not float
        or not (math.isfinite(t) and math.isfinite(dt))
    ):
        return False
    if not (type(rec["host"]) is str and type(rec["src"]) is str and type(rec["dst"]) is str):
        return False
    if not (_i64(rec["pid"]) and _i64(rec["tx_bytes"]) and _i64(rec["rx_bytes"])):
        return False
    if not all(_i64(rec[k]) for k, _bit in _OPTIONAL_INTS if k in rec):
        return False
    if "cwnd" in rec and not -_EXACT <= rec["cwnd"] <= _EXACT:
        return False  # the store keeps a cwnd as a float: the record says why not
    if "srtt_us" in rec:
        srtt = rec["srtt_us"]
        if type(srtt) is float:
            return math.isfinite(srtt)
        return type(srtt) is int and -_EXACT <= srtt <= _EXACT
    return True


class FlowRows(NamedTuple):
    """One window's plain flow records: ``rows`` packed :data:`ROW` rows, in the
    order the node got them; ``strings`` the hosts and endpoints they name."""

    strings: tuple[str, ...]
    rows: bytes

    @property
    def n_rows(self) -> int:
        return len(self.rows) // ROW.itemsize


NO_FLOWS = FlowRows((), b"")


def joined_rows(a: FlowRows, b: FlowRows) -> FlowRows:
    """Two windows' rows as one window's (``a``'s first): ``b``'s string indices
    moved past ``a``'s strings."""
    if not b.rows:
        return a
    if not a.rows:
        return b
    moved = np.frombuffer(b.rows, ROW).copy()
    for name in ("host", "src", "dst"):
        moved[name] += len(a.strings)
    return FlowRows(a.strings + b.strings, a.rows + moved.tobytes())


class FlowRowsBuilder:
    """A node's plain flow records of the window being filled, packed as they come."""

    def __init__(self) -> None:
        self._strings: dict[str, int] = {}
        self._rows: list[bytes] = []

    def _ix(self, s: str) -> int:
        ix = self._strings.get(s)
        if ix is None:
            ix = self._strings[s] = len(self._strings)
        return ix

    def add(self, rec: Record) -> None:
        """Pack ``rec``, a record :func:`plain` accepted."""
        form = 0
        for key, bit in _OPTIONAL_INTS:
            if key in rec:
                form |= bit
        srtt = rec.get("srtt_us", 0.0)
        if "srtt_us" in rec:
            form |= HAS_SRTT | (SRTT_INT if type(srtt) is int else 0)
        self._rows.append(
            _ROW.pack(
                rec["t"], rec["dt"], srtt, rec["pid"], rec["tx_bytes"], rec["rx_bytes"],
                rec.get("retrans", 0), rec.get("cwnd", 0), rec.get("dsack_dups", 0),
                self._ix(rec["host"]), self._ix(rec["src"]), self._ix(rec["dst"]), form,
            )
        )  # fmt: skip

    def take(self) -> FlowRows:
        """The rows packed since the last call (then none)."""
        if not self._rows:
            return NO_FLOWS
        out = FlowRows(tuple(self._strings), b"".join(self._rows))
        self._strings = {}
        self._rows = []
        return out


class FlowTable(NamedTuple):
    """A round's flow rows joined (:func:`flow_table`), in window order; each
    row's ``host``, ``src`` and ``dst`` index ``strings``, the round's."""

    rows: np.ndarray  # of ROW
    strings: np.ndarray  # of str (objects)
    window: np.ndarray  # each row's window's index in the list given

    def __len__(self) -> int:
        return len(self.rows)

    def record(self, i: int) -> Record:
        """Row ``i`` as the record it was (:func:`plain`'s fields; no ``snd_wnd``)."""
        r = self.rows[i]
        form = int(r["form"])
        s = self.strings
        rec: Record = {
            "kind": "flow", "t": float(r["t"]), "dt": float(r["dt"]), "host": s[r["host"]],
            "pid": int(r["pid"]), "src": s[r["src"]], "dst": s[r["dst"]],
            "tx_bytes": int(r["tx"]), "rx_bytes": int(r["rx"]),
        }  # fmt: skip
        if form & HAS_RETRANS:
            rec["retrans"] = int(r["retrans"])
        if form & HAS_DSACK:
            rec["dsack_dups"] = int(r["dsack"])
        one = self.rows[i : i + 1]  # srtt and cwnd read as the leader files them
        if form & HAS_SRTT:
            rec["srtt_us"] = srtt_values(one)[0]
        if form & HAS_CWND:
            rec["cwnd"] = cwnd_values(one)[0]
        return rec


def srtt_values(rows: np.ndarray) -> list[Any]:
    """The srtt of ``rows`` as the correlator files it: an int, a float, None when absent."""
    form = rows["form"]
    srtt = rows["srtt"]
    if len(form) and (form == form[0]).all():  # one form (the probes': most)
        if not form[0] & HAS_SRTT:
            return [None] * len(form)
        return (srtt.astype(np.int64) if form[0] & SRTT_INT else srtt).tolist()  # type: ignore[no-any-return]
    out = srtt.astype(object)
    ints = (form & SRTT_INT) != 0
    if ints.any():
        out[ints] = srtt[ints].astype(np.int64).astype(object)
    out[(form & HAS_SRTT) == 0] = None
    return out.tolist()  # type: ignore[no-any-return]


def cwnd_values(rows: np.ndarray) -> list[Any]:
    """The cwnd of ``rows``: None when absent."""
    has = (rows["form"] & HAS_CWND) != 0
    if has.all():
        return rows["cwnd"].tolist()  # type: ignore[no-any-return]
    if not has.any():
        return [None] * len(has)
    out = rows["cwnd"].astype(object)
    out[~has] = None
    return out.tolist()  # type: ignore[no-any-return]


def sample_columns(rows: np.ndarray, strings: np.ndarray) -> dict[str, np.ndarray]:
    """``rows`` (of a round's ``strings``) as the columns the correlator's flow
    store files (``flowstore.PairStore.add_rows``): absent retransmits and
    D-SACKs 0, an absent srtt or cwnd of kind ``ABSENT``."""
    form = rows["form"]
    srtt_kind = np.where(
        (form & HAS_SRTT) != 0, np.where((form & SRTT_INT) != 0, INT, FLOAT), ABSENT
    ).astype(np.int8)
    return {
        "t": rows["t"], "dt": rows["dt"], "tx": rows["tx"], "rx": rows["rx"],
        "srtt": rows["srtt"], "srtt_kind": srtt_kind, "retrans": rows["retrans"],
        "cwnd": rows["cwnd"].astype(np.float64),
        "cwnd_kind": np.where((form & HAS_CWND) != 0, INT, ABSENT).astype(np.int8),
        "dsack": rows["dsack"], "src": strings[rows["src"]],
    }  # fmt: skip


NO_TABLE = FlowTable(np.zeros(0, ROW), np.zeros(0, object), np.zeros(0, np.int64))


def flow_table(all_flows: Sequence[FlowRows]) -> FlowTable:
    """Every window's rows joined, their strings made the round's; ValueError when
    a window's are not rows: bytes that are not whole rows, a string that is
    not one, an index outside its window's strings, a time or srtt that is not
    finite, an unknown form."""
    have = [(i, f) for i, f in enumerate(all_flows) if f.rows]
    if not have:
        return NO_TABLE
    return joined_table(
        [f.strings for _, f in have], [f.rows for _, f in have], [i for i, _ in have]
    )


def joined_table(
    lists: list[Any], rows_of: list[Any], at: list[int], counts: np.ndarray | None = None
) -> FlowTable:
    """:func:`flow_table` of the windows that have rows: each one's strings (a
    tuple), its rows' bytes (bytes-like, not empty) and its index in the list
    the table's ``window`` column refers to; ``counts``: each one's rows, when
    its bytes were cut to whole rows already."""
    width = ROW.itemsize
    if counts is None:
        if any(len(r) % width for r in rows_of):
            raise ValueError("flow rows cut short")
        counts = np.array([len(r) // width for r in rows_of], np.int64)
    last = _LAST_STRINGS
    if len(lists) == len(last[0]) and all(map(is_, lists, last[0])):
        # The windows' very string tuples of the last round (a leader's
        # nodes' strings are read once: cluster.summary): joined already.
        joined, sizes, firsts = last[1:]
    else:
        strings = list(chain.from_iterable(lists))
        try:
            "".join(strings)  # TypeError at the first that is not a string, in C
        except TypeError as e:
            raise ValueError("a flow's string is not one") from e
        joined = np.array(strings, dtype=object)
        sizes = np.array(list(map(len, lists)), np.int64)
        firsts = np.cumsum(sizes) - sizes
        last[:] = (lists, joined, sizes, firsts)
    rows = np.frombuffer(b"".join(rows_of), ROW).copy()
    which = np.repeat(np.arange(len(rows_of)), counts)
    size, first = sizes[which], firsts[which]
    for name in ("host", "src", "dst"):
        ix = rows[name].astype(np.int64)
        if (ix >= size).any():
            raise ValueError(f"a flow's {name} is not among its window's strings")
        rows[name] = ix + first
    form = rows["form"]
    srtt = rows["srtt"][(form & HAS_SRTT) != 0]
    if (form >= _FORMS).any():
        raise ValueError("a flow row of an unknown form")
    if (np.abs(rows["srtt"][(form & SRTT_INT) != 0]) > _EXACT).any():
        raise ValueError("a flow's int srtt is out of range")
    if not (np.isfinite(rows["t"]).all() and np.isfinite(rows["dt"]).all()
            and np.isfinite(srtt).all()):  # fmt: skip
        raise ValueError("a flow's time or srtt is not finite")
    window = np.array(at, np.int64)[which]
    return FlowTable(rows, joined, window)


#: flow_table's last windows' string tuples, their strings joined, each
#: one's count and where each begins in the joined ones.
_LAST_STRINGS: list[Any] = [[], None, None, None]
