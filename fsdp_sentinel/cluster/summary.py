"""What a node daemon publishes per window, and how the leader reads it back (pure).

A node correlates its own ranks' collectives and never ships them: per step
it publishes a :class:`StepDigest`, which is all the leader needs to rebuild
each rank's :class:`~fsdp_sentinel.correlate.RankStep` exactly as one daemon
watching the whole job would (:func:`rank_steps`).

Why this is enough. A rank's lateness is ``sum over collectives c of
(longest wait in c's group - own wait)``. The longest wait at ``c`` is the
maximum over nodes of each node's longest wait at ``c``, and the shortest
(who arrived last) the minimum of the nodes' shortest, so a node sends, per
collective key, its longest and shortest wait (once per node, not per rank),
and per rank only its total wait, its time blocked, and the positions where
it was the node's last to arrive. Ranks with the same collectives in the
same order (FSDP's usual case) share one :class:`KeyGroup`.

A digest is *columnar*: one sequence per figure, one entry per rank, and it
carries the ranks' ``step`` records too (their start and end), so the
leader files a node's whole step at once and never sees a per-rank record
or dict for it (``bench/leader_scale``: the leader's cost per window is
linear in ranks).

A :class:`Window` is what one node publishes at one interval: the digests of
the steps it completed, its ranks' few other records (``rank``, ``conn``,
``pending``), its probes' ``flow`` records as fixed-width rows
(:mod:`~fsdp_sentinel.cluster.flowrows`; the leader resolves flows to
peers by their endpoints, across nodes, with the ranks' own ``addrs`` and
local endpoints), each host's newest probe time, and each rank's progress
(last heard, newest step and seq with collectives), for liveness.
:func:`encode` packs it: a binary head, JSON for what has no fixed form,
the flow rows, then every digest's columns as raw little-endian 64-bit
floats and 32-bit integers; its length is the store traffic
(``bench/leader_scale`` prints it).
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import reduce
from itertools import chain, repeat
from operator import add, attrgetter, itemgetter, le
from typing import Any, NamedTuple

import numpy as np
import orjson

from fsdp_sentinel import correlate
from fsdp_sentinel.cluster.flowrows import (
    NO_FLOWS,
    NO_TABLE,
    ROW,
    FlowRows,
    FlowTable,
    flow_table,
    joined_table,
)
from fsdp_sentinel.correlate import RankStep, blocked_s, step_columns, top_seq
from fsdp_sentinel.flowstore import new_tuple
from fsdp_sentinel.rankstep import StepRanks

Record = dict[str, Any]

#: A step record's start and end when a rank sent none (its digest entry holds
#: only collectives): NaN, which compares unequal to itself.
NO_TIME = math.nan


class KeyGroup(NamedTuple):
    """Ranks of one node that issued the same collectives (``keys``) in one step.

    ``longest`` / ``shortest``: per key, the longest and shortest wait among
    its ``size`` ranks (the node's share of the group-wide extremes).
    """

    keys: tuple[Any, ...]
    longest: tuple[float, ...]
    shortest: tuple[float, ...]
    size: int


class StepDigest(NamedTuple):
    """A node's collectives and step records of one step, one column per figure.

    Entry ``i`` of each column is rank ``ranks[i]`` (ascending): ``wait_s``
    its time blocked (union of intervals), ``total_wait`` the plain sum of
    its waits, ``n_coll`` its collectives (0: it sent only a step record),
    ``group`` its :class:`KeyGroup`'s index (-1 without collectives),
    ``start`` / ``end`` its step record's (:data:`NO_TIME` without one);
    ``last_n[i]`` key positions at which it waited least on its node, all of
    them in ``last_ix`` one rank after another. ``malformed`` counts records
    dropped for a bad field (as the correlator would).
    """

    step: int
    groups: tuple[KeyGroup, ...]
    ranks: Sequence[int]
    wait_s: Sequence[float]
    total_wait: Sequence[float]
    n_coll: Sequence[int]
    group: Sequence[int]
    start: Sequence[float]
    end: Sequence[float]
    last_n: Sequence[int]
    last_ix: Sequence[int]
    malformed: int = 0
    #: Every group's extremes as one float64 array of (groups, 2, keys):
    #: longest then shortest, when read from the wire with every group as
    #: wide (:func:`decode_round`), else None. The groups' own tuples hold the
    #: same values; this spares the leader reading 2,048 of them a step.
    extremes: Any = None


class Window(NamedTuple):
    """What one node publishes at one interval (see the module docstring).

    ``progress``: ``(rank, t, step, top_seq)`` per rank and step it sent
    collectives of in the window (``t`` its newest record's); ``heard``:
    ``(host, t, dt)`` of each probe poll in the window; ``t``: the node's clock;
    ``flows``: its plain flow records as rows (``records`` holds any other).
    """

    node: str
    seq: int
    t: float
    records: tuple[Record, ...]
    digests: tuple[StepDigest, ...]
    progress: tuple[tuple[int, float, int, int], ...]
    heard: tuple[tuple[str, float, float], ...]
    flows: FlowRows = NO_FLOWS


def _time(v: Any) -> float | None:
    # A step record's start or end as the correlator takes it: a number.
    return float(v) if type(v) is float or type(v) is int else None


def digest_step(
    step: int,
    colls_by_rank: Mapping[int, list[Record]],
    steps_by_rank: Mapping[int, Record] | None = None,
) -> StepDigest:
    """Digest one node's ``coll`` and ``step`` records of ``step`` (rank -> its records)."""
    bad = 0
    cols_of: dict[int, Any] = {}
    for rank in sorted(colls_by_rank):
        colls = colls_by_rank[rank]
        if colls:
            cols, dropped = step_columns(colls)
            bad += dropped
            if cols is not None:
                cols_of[rank] = cols
    times: dict[int, tuple[float, float]] = {}
    for rank, rec in (steps_by_rank or {}).items():
        t0, t1 = _time(rec.get("start")), _time(rec.get("end"))
        if t0 is None or t1 is None:
            bad += 1  # the single daemon refuses it as malformed too
        else:
            times[rank] = (t0, t1)
    by_keys: dict[tuple[Any, ...], list[int]] = {}
    for rank, cols in cols_of.items():
        by_keys.setdefault(tuple(cols.keys), []).append(rank)
    groups: list[KeyGroup] = []
    # rank -> (wait_s, total_wait, n_coll, group, last positions)
    figures: dict[int, tuple[float, float, int, int, list[int]]] = {}
    for gi, (keys, members) in enumerate(by_keys.items()):
        by_coll = list(zip(*[cols_of[r].waits for r in members], strict=True))
        shortest = tuple(map(min, by_coll))
        groups.append(KeyGroup(keys, tuple(map(max, by_coll)), shortest, len(members)))
        for r in members:
            cols = cols_of[r]
            last = [i for i, hit in enumerate(map(le, cols.waits, shortest)) if hit]
            figures[r] = (blocked_s(cols), cols.total_wait, len(cols.waits), gi, last)
    ranks = sorted(set(figures) | set(times))
    wait: list[float] = []
    total: list[float] = []
    n_coll: list[int] = []
    group: list[int] = []
    start: list[float] = []
    end: list[float] = []
    last_n: list[int] = []
    last_ix: list[int] = []
    none: tuple[float, float, int, int, list[int]] = (0.0, 0.0, 0, -1, [])
    for r in ranks:
        w, tw, n, g, last = figures.get(r, none)
        s, e = times.get(r, (NO_TIME, NO_TIME))
        wait.append(w)
        total.append(tw)
        n_coll.append(n)
        group.append(g)
        start.append(s)
        end.append(e)
        last_n.append(len(last))
        last_ix.extend(last)
    return StepDigest(
        step, tuple(groups), ranks, wait, total, n_coll, group, start, end, last_n, last_ix, bad
    )


def join_digests(digests: Sequence[StepDigest]) -> StepDigest:
    """Several nodes' digests of one step as one: their columns end to end,
    every node's key groups kept and a rank's group index moved past the
    groups of the nodes before its own.

    :func:`rank_steps` of the joined digest is :func:`rank_steps` of the list
    (the same groups, the same figures); the leader files a round's step in
    one go this way rather than a node at a time (2,048 nodes a round at 16k
    ranks). Its ranks are in node order, each node's ascending.
    """
    if len(digests) == 1:
        return digests[0]
    sizes = [len(d.ranks) for d in digests]
    offsets = _starts([len(d.groups) for d in digests])
    group = _joined(digests, "group", np.int64)
    group = np.where(group >= 0, group + np.repeat(offsets, sizes), -1)
    floats = {n: _column(_joined(digests, n, np.float64), "d") for n in _FLOAT_COLUMNS}
    ints = {n: _column(_joined(digests, n, np.int64), "i") for n in _INT_COLUMNS}
    return StepDigest(
        step=digests[0].step,
        groups=tuple(g for d in digests for g in d.groups),
        group=_column(group, "i"),
        malformed=sum(d.malformed for d in digests),
        **floats,
        **ints,
    )


def _starts(counts: Any) -> np.ndarray:
    """Where each of consecutive runs of ``counts`` items begins, laid end to end."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.cumsum(counts) - counts


_FLOAT_COLUMNS = ("wait_s", "total_wait", "start", "end")
_INT_COLUMNS = ("ranks", "n_coll", "last_n", "last_ix")


def _joined(digests: Sequence[StepDigest], name: str, kind: type) -> np.ndarray:
    """Every digest's column ``name`` end to end as ``kind``, in one conversion
    (per digest, a node's few ranks, numpy's call would cost more than its
    values). Decoded digests hold arrays, whose bytes join; a node's own hold
    lists."""
    cols = list(map(attrgetter(name), digests))
    types = set(map(type, cols))
    if len(types) == 1 and (array in types or memoryview in types):
        codes = set(map(_TYPECODE if array in types else _FORMAT, cols))
        if len(codes) == 1:
            raw = np.frombuffer(b"".join(cols), dtype=_NP_OF[codes.pop()])
            return raw.astype(kind, copy=False)
    return np.array(list(chain.from_iterable(cols)), dtype=kind)


_TYPECODE, _FORMAT = attrgetter("typecode"), attrgetter("format")


def _column(values: np.ndarray, code: str) -> array:  # type: ignore[type-arg]
    """A joined column as a decoded digest holds one (an array of Python
    numbers: ``"d"`` float64 or ``"i"`` int32), so every reader takes it alike."""
    out = array(code)
    out.frombytes(values.astype(_NP_OF[code], copy=False).tobytes())
    return out


def newest_end(d: StepDigest) -> float | None:
    """The newest end among ``d``'s step records (None: it has none)."""
    end = np.asarray(d.end, dtype=np.float64)
    timed = end[end == end]  # NaN: no step record
    return float(timed.max()) if len(timed) else None


def step_times(d: StepDigest) -> Iterable[tuple[int, float, float]]:
    """``(rank, start, end)`` of every step record in ``d``."""
    return ((r, s, e) for r, s, e in zip(d.ranks, d.start, d.end, strict=True) if e == e)


_FIRST = itemgetter(0)


def rank_steps(digests: Sequence[StepDigest]) -> Sequence[RankStep]:
    """Every rank's :class:`RankStep` of one step, from every node's digest of it.

    A rank's step time comes from its step record in the digest (a rank with
    collectives but no step record gets None, as in the correlator). When
    every rank issued the same keys (FSDP's usual case) the figures are the
    correlator's to the last bit: the same maxima, summed in the same order;
    then a step of :data:`~fsdp_sentinel.correlate.COLUMNAR_RANKS` ranks or
    more comes as columns (:class:`~fsdp_sentinel.rankstep.StepRanks`), as the
    correlator's does.
    """
    groups = [g for d in digests for g in d.groups]
    with_colls = sum(g.size for g in groups)
    out: list[RankStep] = []
    keys0 = groups[0].keys if groups else None
    if with_colls >= 2 and all(g.keys == keys0 for g in groups):
        big = sum(len(d.ranks) for d in digests) >= correlate.COLUMNAR_RANKS
        ext = _extremes_of(digests) if big else None
        if ext is not None:
            # Every group's extremes as arrays: the same maxima and minima.
            longest = ext[:, 0, :].max(axis=0).tolist()
            low = ext[:, 1, :].min(axis=0)
            # A row a group: its keys where its last-to-arrive arrived last job-wide.
            return _aligned_columns(digests, ext[:, 1, :] <= low, reduce(add, longest, 0.0))
        longest = list(map(max, zip(*[g.longest for g in groups], strict=True)))
        shortest = list(map(min, zip(*[g.shortest for g in groups], strict=True)))
        top = reduce(add, longest, 0.0)
        if big:
            table = np.array([g.shortest for g in groups]) <= np.array(shortest)
            return _aligned_columns(digests, table, top)
        # Per key: did a node's last-to-arrive arrive last job-wide too?
        hits = [[list(map(le, g.shortest, shortest)) for g in d.groups] for d in digests]
        for d, hit in zip(digests, hits, strict=True):
            _aligned(d, hit, top, out)
    else:
        _unaligned(digests, groups, out)
    out.sort(key=_FIRST)
    return tuple(out)


def _extremes_of(digests: Sequence[StepDigest]) -> np.ndarray | None:
    """Every digest's groups' extremes as one (groups, 2, keys) array, in group
    order, when each digest carries them and none is NaN (whose maximum
    depends on the order it is met in); else None."""
    got = [d.extremes for d in digests]
    if any(e is None for e in got):
        return None
    ext = got[0] if len(got) == 1 else np.concatenate(got)
    return None if np.isnan(ext).any() else ext


#: The numpy type of an array's typecode, as the wire form packs it.
_NP_OF: dict[str, Any] = {"d": np.float64, "i": np.int32, "q": np.int64}


def _aligned_columns(digests: Sequence[StepDigest], table: np.ndarray, top: float) -> StepRanks:
    """:func:`_aligned` over every node's digest at once, as columns: the same
    subtractions, ``max(0.0, x)`` and divisions, and each rank's count of
    collectives it arrived last at is an integer sum."""

    def col(name: str, kind: type) -> np.ndarray:
        return _joined(digests, name, kind)

    ranks = col("ranks", np.int64)
    wait = col("wait_s", np.float64)
    total = col("total_wait", np.float64)
    n = col("n_coll", np.int64)
    start, end = col("start", np.float64), col("end", np.float64)
    last_n = col("last_n", np.int64)
    # Each rank's "last" positions, looked up in its node group's hits (every
    # group has the same keys here, so the hits are one table, a row a group).
    offsets = _starts([len(d.groups) for d in digests])
    group = col("group", np.int64) + np.repeat(offsets, [len(d.ranks) for d in digests])
    owner = np.repeat(np.arange(len(ranks)), last_n)
    ix = col("last_ix", np.int64)
    last = np.bincount(owner, weights=table[group[owner], ix], minlength=len(ranks))
    has = n > 0
    step_s = end - start  # NaN where no step record (NaN - x is NaN)
    x = step_s - wait  # as _aligned: a rank without collectives has a wait of 0.0 there
    compute = np.where(x > 0.0, x, 0.0)
    compute[step_s != step_s] = np.nan
    late = top - total
    late = np.where(has & (late > 0.0), late, 0.0)
    frac = np.where(has, last / np.maximum(n, 1), 0.0)
    order = np.argsort(ranks, kind="stable")
    return StepRanks(
        ranks[order],
        step_s[order],
        np.where(has, wait, 0.0)[order],
        compute[order],
        late[order],
        frac[order],
        n[order],
        n[order],
    )


def _aligned(d: StepDigest, hits: list[list[bool]], top: float, out: list[RankStep]) -> None:
    """:func:`rank_steps` of one node's ranks when every group's keys are the same."""
    at = 0
    ix = d.last_ix
    for r, w, tw, n, g, s, e, k in zip(
        d.ranks, d.wait_s, d.total_wait, d.n_coll, d.group, d.start, d.end, d.last_n, strict=True
    ):
        st = (e - s) if e == e else None
        compute = None if st is None else max(0.0, st - w)
        if n:
            hit = hits[g]
            last = sum(hit[i] for i in ix[at : at + k]) if k else 0
            at += k
            late = top - tw
            out.append(RankStep(r, st, w, compute, late if late > 0.0 else 0.0, last / n, n, n))
        else:
            out.append(RankStep(r, st, 0.0, compute, 0.0, 0.0, 0, 0))


def _unaligned(digests: Sequence[StepDigest], groups: list[KeyGroup], out: list[RankStep]) -> None:
    """:func:`rank_steps` when ranks issued different keys (process groups, a
    collective missing): each key's extremes over every node's groups."""
    span: dict[Any, list[float]] = {}  # key -> [longest, shortest, ranks]
    for g in groups:
        n = float(g.size)
        for k, hi, lo in zip(g.keys, g.longest, g.shortest, strict=True):
            sp = span.get(k)
            if sp is None:
                span[k] = [hi, lo, n]
            else:
                sp[0] = max(sp[0], hi)
                sp[1] = min(sp[1], lo)
                sp[2] += n
    for d in digests:
        tops = [reduce(add, g.longest, 0.0) for g in d.groups]
        at = 0
        for r, w, tw, n, gi, s, e, k in zip(
            d.ranks, d.wait_s, d.total_wait, d.n_coll, d.group, d.start, d.end, d.last_n,
            strict=True,
        ):  # fmt: skip
            st = (e - s) if e == e else None
            compute = None if st is None else max(0.0, st - w)
            if not n:
                out.append(RankStep(r, st, 0.0, compute, 0.0, 0.0, 0, 0))
                continue
            g = d.groups[gi]
            late = (tops[gi] - tw) if g.size >= 2 else 0.0
            matched = last = 0
            ix = set(d.last_ix[at : at + k])
            at += k
            for i, (key, hi, lo) in enumerate(zip(g.keys, g.longest, g.shortest, strict=True)):
                sp = span[key]
                if sp[2] < 2:
                    continue
                matched += 1
                late += sp[0] - hi
                if i in ix and lo <= sp[1]:
                    last += 1
            out.append(
                RankStep(r, st, w, compute, late, (last / matched) if matched else 0.0, matched, n)
            )


def group_top_seqs(d: StepDigest) -> list[int]:
    """Each group's newest seq (every member's, as they issued the same keys)."""
    out = []
    keys: Any = None
    top = -1
    for g in d.groups:
        if g.keys is not keys:  # a round's nodes share one keys tuple (a run): one max
            keys, top = g.keys, top_seq(g.keys)
        out.append(top)
    return out


# ------------------------------------------------------------ wire form

#: The first bytes of a packed window (a version: a format change is a new magic).
#: FSW4: the head in fixed binary fields, JSON only for what has no fixed
#: form (the small records, progress points, probe times, keys that are not a
#: run of seqs) and none when there is none: parsing a JSON head was half of
#: the leader's cost of reading a node's window (``bench/leader_scale``:
#: 2,048 nodes a window). FSW3 had a JSON head; each digest's per-rank
#: columns are in two blocks since then (its floats, then its integers).
#: FSW5: plain flow records as rows (``flowrows``) after the JSON, which
#: lists their strings.
MAGIC = b"FSW5"
#: magic, JSON bytes, node-name bytes, window seq, clock, digests, flow rows
_HEAD = struct.Struct("<4sIHqdII")
#: step, records dropped, ranks, last positions, key groups
_DIGEST = struct.Struct("<qIIII")
#: how its keys are sent (_RUN: ``first`` and the count; _LISTED: the next
#: list of the JSON's ``keys``), first, how many keys (and extremes), ranks
_GROUP = struct.Struct("<BqII")
_RUN, _LISTED = 0, 1
_SWAP = sys.byteorder != "little"


def _run_start(keys: Sequence[Any], n_extremes: int) -> int | None:
    """The first seq when ``keys`` are consecutive seqs (FSDP's usual case, sent
    as first and count), else None."""
    if not keys or len(keys) != n_extremes or not all(type(k) is int for k in keys):
        return None
    k0 = keys[0]
    if not -(1 << 63) <= k0 < (1 << 63) - len(keys):
        return None
    return k0 if all(k == k0 + i for i, k in enumerate(keys)) else None


def _keys_in(obj: Any) -> tuple[Any, ...]:
    return tuple(tuple(k) if isinstance(k, list) else k for k in obj)


def _run(first: int, n: int) -> tuple[int, ...]:
    """The keys ``first .. first + n - 1``, one tuple for every node that sends them."""
    span = (first, n)
    keys = _RUNS.get(span)
    if keys is None:
        if len(_RUNS) >= 4096:
            _RUNS.clear()
        keys = _RUNS[span] = tuple(range(first, first + n))
    return keys


#: Runs of consecutive seqs already read, as tuples (every node of a round
#: sends the same run: one tuple serves them all, and compares by identity).
_RUNS: dict[tuple[int, int], tuple[int, ...]] = {}


def _pack(code: str, values: Iterable[Any]) -> bytes:
    a = array(code, values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _values(view: memoryview, code: str) -> Sequence[Any]:
    """The values of a column's bytes (``code``: ``"d"`` float64, ``"i"`` int32):
    a view of the window's bytes (its values Python numbers, its bytes joined
    with the other nodes' columns by the leader without a value each); a
    swapped copy on a big-endian machine."""
    if not _SWAP:
        return view.cast(code)  # type: ignore[call-overload]
    a = array(code)
    a.frombytes(view)
    a.byteswap()
    return a


#: struct.Struct of n little-endian float64s, by n (a group's extremes).
_EXTREMES: dict[int, struct.Struct] = {}


def _extremes_struct(n: int) -> struct.Struct:
    if len(_EXTREMES) >= 1024:  # widths are few; a hostile stream's are not kept
        _EXTREMES.clear()
    s = _EXTREMES[n] = struct.Struct(f"<{n}d")
    return s


def _check(
    groups: Sequence[KeyGroup],
    n_coll: Any,
    group: Sequence[int],
    last_n: Sequence[int],
    ix: Sequence[int],
) -> None:
    """ValueError unless a digest's columns agree: a rank has a group exactly
    when it has collectives, and its last positions are keys of its group."""
    if sum(last_n) != len(ix) or (n_coll and (min(group) < -1 or max(group) >= len(groups))):
        raise ValueError("a digest's columns do not agree")
    sizes = [len(g.keys) for g in groups]
    # Each rank's group's size (index -1, no group: the 0 at the end), in C.
    if list(map((sizes + [0]).__getitem__, group)) != n_coll.tolist():
        raise ValueError("a rank's collectives and its group do not agree")
    if ix and (min(ix) < 0 or max(ix) >= max(sizes)):
        raise ValueError("a last position outside its group's keys")


def encode(w: Window) -> bytes:
    """The window packed for the store: a binary head, JSON for what has no fixed
    form (if any), then each digest: its counts, its key groups with their
    extremes, its columns."""
    listed: list[Any] = []
    body: list[bytes] = []
    for d in w.digests:
        body.append(_DIGEST.pack(d.step, d.malformed, len(d.ranks), len(d.last_ix), len(d.groups)))
        for g in d.groups:
            first = _run_start(g.keys, len(g.longest))
            if first is None:
                listed.append([list(k) if isinstance(k, tuple) else k for k in g.keys])
                body.append(_GROUP.pack(_LISTED, 0, len(g.longest), g.size))
            else:
                body.append(_GROUP.pack(_RUN, first, len(g.longest), g.size))
            body.append(_pack("d", g.longest))
            body.append(_pack("d", g.shortest))
        body += [
            _pack("d", chain(d.wait_s, d.total_wait, d.start, d.end)),
            _pack("i", chain(d.ranks, d.n_coll, d.group, d.last_n)),
            _pack("i", d.last_ix),
        ]
    extra = {
        "records": w.records, "progress": w.progress, "heard": w.heard, "keys": listed,
        "strings": w.flows.strings,
    }  # fmt: skip
    tail = orjson.dumps(extra) if any(extra.values()) else b""
    node = w.node.encode()
    head = _HEAD.pack(MAGIC, len(tail), len(node), w.seq, w.t, len(w.digests), w.flows.n_rows)
    return b"".join([head, node, tail, w.flows.rows, *body])


#: What reading a damaged blob can raise (JSON's errors are ValueErrors).
_NOT_A_WINDOW = (ValueError, struct.error, KeyError, TypeError, IndexError, OverflowError)


def decode(data: bytes) -> Window:
    """A window back from :func:`encode`'s bytes; ValueError when they are not one.

    Its digests' columns are views of ``data`` (no value copied)."""
    try:
        w, found = _head_and_parts(data)
        flow_table([w.flows])  # its rows checked
        return w._replace(digests=tuple(_digest(step, part) for step, part in found))
    except _NOT_A_WINDOW as e:
        raise ValueError(f"not a cluster window: {e}") from e


def _digest(step: int, p: _Part) -> StepDigest:
    """One node's digest from its place in the window, its columns checked."""
    n = p.n
    f, i = _values(p.floats, "d"), _values(p.ints, "i")
    n_coll, group, last_n, last_ix = i[n : 2 * n], i[2 * n : 3 * n], i[3 * n : 4 * n], i[4 * n :]
    _check(p.groups, n_coll, group, last_n, last_ix)
    return StepDigest(
        step, p.groups, i[:n], f[:n], f[n : 2 * n], n_coll, group, f[2 * n : 3 * n], f[3 * n :],
        last_n, last_ix, p.malformed,
    )  # fmt: skip


# ------------------------------------------------------------ a round at once


class Round(NamedTuple):
    """One round of packed windows read together (:func:`decode_round`).

    ``windows``: each node's window without its digests or flow rows; ``steps``: per step,
    every node's digest of it joined (:func:`join_digests`: node order, a
    rank's group index past the nodes' before); ``bad``: blobs that were not
    windows, each left out alone; ``flows``: the windows' flow rows joined
    (:func:`~fsdp_sentinel.cluster.flowrows.flow_table`).
    """

    windows: list[Window]
    steps: dict[int, StepDigest]
    bad: int
    flows: FlowTable = NO_TABLE
    #: Every window holds digests and flow rows alone (no records, progress
    #: or heard entries), each its clock a float: a steady round, read at once.
    plain: bool = False


class _Part(NamedTuple):
    """One node's digest of a step as found in its blob, its columns unread."""

    groups: tuple[KeyGroup, ...]
    n: int
    n_ix: int
    floats: memoryview  # its four float columns, one after another
    ints: memoryview  # its four int columns, then its last positions
    malformed: int
    extremes: list[memoryview]  # per group: its longest, then its shortest waits


def decode_round(blobs: Iterable[bytes]) -> Round:
    """Every packed window of one round, as :func:`decode` reads each, with each
    step's digests joined (what the leader files).

    A steady round (every window one digest of one step alone) is read for
    every node at once (:func:`_uniform_round`). Otherwise a node's window is
    read for its head and its digests' place only, and each step's columns
    for every node at once: their bytes joined, and checked as :func:`decode`
    checks them, in a few array operations (a node at a time, reading and
    checking them cost 2,048 nodes' worth of Python a round at 16k ranks). A blob that is not a window is left out
    alone; when a step's columns fail a check, the round is read window by
    window (:func:`decode`) to find the blob at fault.
    """
    blobs = list(blobs)
    if _SWAP:  # the joined views assume little-endian columns
        return _round_of_windows(blobs)
    uniform = _uniform_round(blobs)
    if uniform is not None:
        return uniform
    windows: list[Window] = []
    parts: dict[int, list[_Part]] = {}
    bad = 0
    for data in blobs:
        try:
            w, found = _head_and_parts(data)
        except _NOT_A_WINDOW:
            bad += 1
            continue
        windows.append(w)
        for step, part in found:
            parts.setdefault(step, []).append(part)
    steps: dict[int, StepDigest] = {}
    for step, got in parts.items():
        joined = _joined_parts(step, got)
        if joined is None:  # a column check failed: find the blob at fault
            return _round_of_windows(blobs)
        steps[step] = joined
    try:
        flows = flow_table([w.flows for w in windows])
    except ValueError:  # as a column check: find the blob at fault
        return _round_of_windows(blobs)
    return Round(_without_rows(windows), steps, bad, flows)


#: The packed head, a digest's and a key group's fixed fields as numpy reads
#: them for every node of a round at once (the very layouts of _HEAD,
#: _DIGEST and _GROUP).
_HEAD_DT = np.dtype(
    [("magic", "S4"), ("n_json", "<u4"), ("n_node", "<u2"), ("seq", "<i8"), ("t", "<f8"),
     ("n_digests", "<u4"), ("n_flows", "<u4")]
)  # fmt: skip
_DIGEST_DT = np.dtype(
    [("step", "<i8"), ("bad", "<u4"), ("n", "<u4"), ("n_ix", "<u4"), ("n_groups", "<u4")]
)
_GROUP_DT = np.dtype([("form", "u1"), ("first", "<i8"), ("nk", "<u4"), ("size", "<u4")])
_DIGEST_GROUP_DT = np.dtype([("digest", _DIGEST_DT), ("group", _GROUP_DT)])
assert (_HEAD_DT.itemsize, _DIGEST_DT.itemsize, _GROUP_DT.itemsize) == (
    _HEAD.size, _DIGEST.size, _GROUP.size,
)  # fmt: skip


def _uniform_round(blobs: list[bytes]) -> Round | None:
    """:func:`decode_round` of a round whose every window holds one digest of the
    same step, its one key group a run of the same keys (a steady job's
    round: most), read for every node at once: each fixed field one numpy
    read for the round, each column cut from each blob and joined, and a
    node costs only the objects it keeps (its window, its key group, and
    what its JSON and flow rows hold, if any). None when the round is not
    such, or not whole (it is then read window by window, which finds what
    is wrong with which blob).

    Node by node, reading 2,048 heads cost ~5 us each: a fifth of a 16k-rank
    leader's window. Each blob must be exactly as long as its fields say.
    """
    if not blobs:
        return None
    try:
        n_digests = _HEAD.unpack_from(blobs[0])[5]
    except struct.error:
        return None
    if n_digests != 1:  # the first window says enough, most often
        return None
    count = len(blobs)
    lens = np.fromiter(map(len, blobs), np.int64, count)
    if lens.min() < _HEAD.size:
        return None
    head = _fields(blobs, repeat(0), _HEAD_DT)
    if not ((head["magic"] == MAGIC).all() and (head["n_digests"] == 1).all()):
        return None
    n_node, n_json = head["n_node"].astype(np.int64), head["n_json"].astype(np.int64)
    n_flows = head["n_flows"].astype(np.int64)
    # in each blob: its digest, after its name, JSON and flow rows
    d_at = _HEAD.size + n_node + n_json + ROW.itemsize * n_flows
    x_at = d_at + _DIGEST.size + _GROUP.size  # its group's extremes, then its columns
    if (x_at > lens).any():
        return None
    at_digest = d_at.tolist()
    fixed = _fields(blobs, at_digest, _DIGEST_GROUP_DT)
    dig, grp = fixed["digest"], fixed["group"]
    step, first, nk = int(dig["step"][0]), int(grp["first"][0]), int(grp["nk"][0])
    if not ((dig["n_groups"] == 1).all() and (grp["form"] == _RUN).all()
            and (dig["step"] == step).all() and (grp["first"] == first).all()
            and (grp["nk"] == nk).all()):  # fmt: skip
        return None
    n, n_ix = dig["n"].astype(np.int64), dig["n_ix"].astype(np.int64)
    f_at = x_at + 16 * nk
    i_at = f_at + 32 * n
    if not np.array_equal(i_at + 16 * n + 4 * n_ix, lens):
        return None
    name_end = (_HEAD.size + n_node).tolist()  # then the JSON, if any
    try:
        nodes = [str(b[_HEAD.size : k], "utf-8") for b, k in zip(blobs, name_end, strict=True)]
    except UnicodeDecodeError:
        return None
    keys = _run(first, nk)  # once a round
    cuts = list(zip(blobs, x_at.tolist(), f_at.tolist(), i_at.tolist(), strict=True))
    ext = b"".join([b[x:f] for b, x, f, _ in cuts])
    # Each group's longest, then its shortest waits: a tuple each, unpacked
    # straight from the joined bytes (no list made and copied per group).
    waits = struct.Struct(f"<{nk}d").iter_unpack(ext) if nk else iter([()] * (2 * count))
    groups = [
        new_tuple(KeyGroup, (keys, hi, lo, size))
        for hi, lo, size in zip(waits, waits, grp["size"].tolist(), strict=True)
    ]
    joined = _joined_columns(
        step,
        n,
        n_ix,
        np.frombuffer(b"".join([b[f:i] for b, _, f, i in cuts]), "<f8"),
        np.frombuffer(b"".join([b[i:] for b, _, _, i in cuts]), "<i4").astype(np.int64),
        groups,
        np.ones(count, dtype=np.int64),
        int(dig["bad"].sum()),
        lambda: ext,
    )
    if joined is None:
        return None
    empty = ()
    windows = [
        new_tuple(Window, (node, seq, t, empty, empty, empty, empty, NO_FLOWS))
        for node, seq, t in zip(nodes, head["seq"].tolist(), head["t"].tolist(), strict=True)
    ]
    more = np.flatnonzero(n_json + n_flows)  # windows with JSON or flow rows
    try:
        flows, plain = (
            _round_flows(blobs, windows, more, name_end, n_json[more], n_flows[more])
            if len(more)
            else (NO_TABLE, True)
        )
    except _NOT_A_WINDOW:
        return None
    return Round(windows, {step: joined}, 0, flows, plain)


def _round_flows(
    blobs: list[bytes],
    windows: list[Window],
    more: np.ndarray,
    json_at: list[int],
    n_json: np.ndarray,
    n_flows: np.ndarray,
) -> tuple[FlowTable, bool]:
    """The flow rows of a steady round's windows ``more`` (those with JSON or flow
    rows; ``json_at``: where each blob's JSON begins, ``n_json`` and ``n_flows``
    theirs), joined; a window whose JSON is more than its rows' strings is
    read whole (:func:`_window_of`) and replaces its entry in ``windows``.
    And whether none was (every window still holds digests and rows alone).

    A window whose JSON only lists its rows' strings, read before (the same
    bytes every round: ``_STRINGS_ONLY``), is cut: its strings looked up by
    its JSON, its rows a slice of its blob. When every such window holds the
    very JSON bytes the window in its place held last round (a steady job's
    nodes send the same flows every round), they are checked in place, with
    no copy made or hashed (``_LAST_FLOWS``).
    """
    width = ROW.itemsize
    at = more.tolist()
    starts = [json_at[i] for i in at]
    sel = [blobs[i] for i in at]
    last = _LAST_FLOWS
    if (
        np.array_equal(n_json, last[0])
        and n_flows.all()
        and set(map(type, sel)) == {bytes}
        and all(map(bytes.startswith, sel, last[1], starts))
    ):
        ends = (np.asarray(starts) + n_json).tolist()
        stops = (np.asarray(ends) + width * n_flows).tolist()
        rows_of = [b[e:z] for b, e, z in zip(sel, ends, stops, strict=True)]
        return joined_table(last[2], rows_of, at, n_flows), True
    known = _STRINGS_ONLY.get
    lists: list[Any] = []
    rows_of = []
    placed: list[int] = []
    raws: list[bytes] = []
    cut_all = bool(n_flows.all())  # every window cut: this round's JSON kept for the next
    plain = True
    rows: Any
    for i, b, a, nj, nf in zip(at, sel, starts, n_json.tolist(), n_flows.tolist(), strict=True):
        raw = b[a : a + nj]
        strings = known(raw) if nj else None
        if strings is None:
            cut_all = False
            w = windows[i]
            w = _window_of(b, a, nj, nf, w.node, w.seq, w.t)[0]
            windows[i] = w._replace(flows=NO_FLOWS)
            plain = plain and not (w.records or w.progress or w.heard)
            if not w.flows.rows:
                continue
            strings, rows = w.flows.strings, w.flows.rows
        elif nf:
            rows = b[a + nj : a + nj + nf * width]
        else:
            continue
        lists.append(strings)
        rows_of.append(rows)
        placed.append(i)
        raws.append(raw)
    if not rows_of:
        return NO_TABLE, plain
    table = joined_table(lists, rows_of, placed)
    _LAST_FLOWS[:] = (n_json.copy(), raws, lists) if cut_all else (None, [], [])
    return table, plain


#: The last steady round's windows with flow rows, when every one was cut
#: (_round_flows): their JSON's lengths, bytes and strings, in order.
_LAST_FLOWS: list[Any] = [None, [], []]


def _fields(blobs: list[bytes], at: Iterable[int], dtype: np.dtype) -> np.ndarray:
    """Each blob's fixed fields of ``dtype`` from its offset in ``at`` (all there:
    the caller checked the lengths), one record a blob."""
    width = dtype.itemsize
    return np.frombuffer(
        b"".join([b[a : a + width] for b, a in zip(blobs, at, strict=False)]), dtype
    )


def _round_of_windows(blobs: list[bytes]) -> Round:
    """:func:`decode_round`, a window at a time (:func:`decode` finds the bad ones)."""
    windows: list[Window] = []
    by_step: dict[int, list[StepDigest]] = {}
    bad = 0
    for data in blobs:
        try:
            w = decode(data)
        except ValueError:
            bad += 1
            continue
        windows.append(w._replace(digests=()))
        for d in w.digests:
            by_step.setdefault(d.step, []).append(d)
    steps = {s: join_digests(ds) for s, ds in by_step.items()}
    return Round(_without_rows(windows), steps, bad, flow_table([w.flows for w in windows]))


def _without_rows(windows: list[Window]) -> list[Window]:
    """The windows as a :class:`Round` holds them: their rows are its ``flows``."""
    return [w._replace(flows=NO_FLOWS) if w.flows.rows else w for w in windows]


def _head_and_parts(data: bytes) -> tuple[Window, list[tuple[int, _Part]]]:
    """A blob's window (without digests) and where each digest's columns lie;
    what :func:`decode` raises for a blob cut short, too long, or whose head
    does not describe its body."""
    magic, n_json, n_node, seq, clock, n_digests, n_flows = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a packed window (starts {bytes(data[:4])!r})")
    at = _HEAD.size + n_node
    node = str(data[_HEAD.size : at], "utf-8")
    if n_json or n_flows:
        w, listed, at = _window_of(data, at, n_json, n_flows, node, seq, clock)
    else:  # a window of digests alone (most)
        w, listed = new_tuple(Window, (node, seq, clock, (), (), (), (), NO_FLOWS)), ()
    view = memoryview(data)
    found: list[tuple[int, _Part]] = []
    n_listed = 0
    for _ in range(n_digests):
        step, bad, n, n_ix, n_groups = _DIGEST.unpack_from(data, at)
        at += _DIGEST.size
        groups = []
        extremes = []
        for _ in range(n_groups):
            form, first, nk, size = _GROUP.unpack_from(data, at)
            at += _GROUP.size
            if at + 16 * nk > len(data):  # before any key is made: a damaged count
                raise ValueError("a group's extremes run past the end")
            if form == _RUN:
                k = _RUNS.get((first, nk)) or _run(first, nk)
            elif form == _LISTED:
                k = _keys_in(listed[n_listed])
                n_listed += 1
                if len(k) != nk:
                    raise ValueError("a group's keys and extremes differ in length")
            else:
                raise ValueError(f"keys sent in an unknown form ({form})")
            unpack = (_EXTREMES.get(nk) or _extremes_struct(nk)).unpack_from
            hi, lo = unpack(data, at), unpack(data, at + 8 * nk)  # struct.error when short
            extremes.append(view[at : at + 16 * nk])
            at += 16 * nk
            groups.append(new_tuple(KeyGroup, (k, hi, lo, size)))
        f_end = at + 32 * n
        i_end = f_end + 16 * n + 4 * n_ix
        if i_end > len(data):
            raise ValueError("a column runs past the end")
        part = (tuple(groups), n, n_ix, view[at:f_end], view[f_end:i_end], bad, extremes)
        found.append((step, new_tuple(_Part, part)))
        at = i_end
    if at != len(data):
        raise ValueError(f"{len(data) - at} bytes past the last column")
    return w, found


#: A window's JSON that lists only its flow rows' strings, read: a node's is
#: the same bytes round after round (its flows, in the same order), so it is
#: parsed once and its strings are the very same objects every round. The
#: leader looks every row's flow up by them (``Correlator.add_flow_rows``):
#: with their hashes kept, a 16k-rank round's lookups cost a third.
_STRINGS_ONLY: dict[bytes, tuple[str, ...]] = {}
#: How many, and how many of their JSON bytes, are kept: 16k nodes' worth at
#: ~1 kB a node; a stream that sends more (a node whose flows change every
#: round, or a hostile one) empties it and starts again.
_STRINGS_KEPT, _STRINGS_KEPT_BYTES = 16384, 64 << 20
_strings_bytes = [0]  # the JSON bytes kept now


def _window_of(
    data: bytes, at: int, n_json: int, n_flows: int, node: str, seq: int, clock: float
) -> tuple[Window, Any, int]:
    """A window's JSON (from ``at``) and flow rows read: the window without its
    digests, the JSON's listed keys, and where its digests begin."""
    records: Any = ()
    progress: Any = ()
    heard: Any = ()
    listed: Any = ()
    strings: Any = ()
    if n_json:
        raw = data[at : at + n_json]
        at += n_json
        strings = _STRINGS_ONLY.get(raw)
        if strings is None:
            o = orjson.loads(raw)
            records, progress, heard, listed = o["records"], o["progress"], o["heard"], o["keys"]
            strings = o["strings"]
            if isinstance(strings, list):
                strings = tuple(strings)
            if type(strings) is tuple and not (records or progress or heard or listed):
                if (
                    len(_STRINGS_ONLY) >= _STRINGS_KEPT
                    or _strings_bytes[0] + len(raw) > _STRINGS_KEPT_BYTES
                ):
                    _STRINGS_ONLY.clear()
                    _strings_bytes[0] = 0
                _STRINGS_ONLY[raw] = strings
                _strings_bytes[0] += len(raw)
    flows = NO_FLOWS
    if n_flows:
        end = at + n_flows * ROW.itemsize
        if end > len(data) or type(strings) is not tuple:
            raise ValueError("flow rows run past the end")
        flows = FlowRows(strings, bytes(data[at:end]))
        at = end
    w = Window(
        node,
        seq,
        clock,
        tuple(records),
        (),
        tuple((int(r), float(t), int(s), int(q)) for r, t, s, q in progress) if progress else (),
        tuple((str(h), float(t), float(dt)) for h, t, dt in heard) if heard else (),
        flows,
    )
    return w, listed, at


def _joined_parts(step: int, parts: list[_Part]) -> StepDigest | None:
    """Every node's digest of ``step`` joined, columns read in one go; None when
    one node's columns do not agree (:func:`_check`'s rules)."""
    return _joined_columns(
        step,
        np.array([p.n for p in parts], dtype=np.int64),
        np.array([p.n_ix for p in parts], dtype=np.int64),
        np.frombuffer(b"".join([p.floats for p in parts]), dtype="<f8"),
        np.frombuffer(b"".join([p.ints for p in parts]), dtype="<i4").astype(np.int64),
        [g for p in parts for g in p.groups],
        np.array([len(p.groups) for p in parts], dtype=np.int64),
        sum(p.malformed for p in parts),
        lambda: b"".join([e for p in parts for e in p.extremes]),
    )


def _joined_columns(
    step: int,
    n: np.ndarray,
    n_ix: np.ndarray,
    floats: np.ndarray,
    ints: np.ndarray,
    groups: list[KeyGroup],
    n_groups: np.ndarray,
    malformed: int,
    extremes: Callable[[], bytes],
) -> StepDigest | None:
    """The joined digest of ``step`` from every node's columns laid end to end
    (per node: ``n`` ranks, ``n_ix`` last positions, ``n_groups`` of
    ``groups``; ``floats`` its four float columns, ``ints`` its four int
    columns then its last positions; ``extremes()`` every group's extremes'
    bytes), checked as :func:`_check` checks each node's; None when one
    node's do not agree."""
    nodes = len(n)
    total, total_ix = int(n.sum()), int(n_ix.sum())
    node = np.repeat(np.arange(nodes), n)  # each rank's part
    pos = np.arange(total) - _starts(n)[node]  # a rank's place in its part
    f_at = _starts(4 * n)[node] + pos
    i_start = _starts(4 * n + n_ix)
    i_at = i_start[node] + pos
    per = n[node]

    def f(c: int) -> np.ndarray:
        return floats[f_at + c * per]

    def i(c: int) -> np.ndarray:
        return ints[i_at + c * per]

    ranks, n_coll, group, last_n = i(0), i(1), i(2), i(3)
    ix_node = np.repeat(np.arange(nodes), n_ix)
    ix = ints[(i_start + 4 * n)[ix_node] + np.arange(total_ix) - _starts(n_ix)[ix_node]]
    # The checks decode makes of each node's digest, for every node at once.
    ok = np.bincount(node, weights=last_n, minlength=nodes) == n_ix
    ok &= np.bincount(node, weights=(group < -1) | (group >= n_groups[node]),
                      minlength=nodes) == 0  # fmt: skip
    if not ok.all():
        return None
    at = np.where(group >= 0, group + _starts(n_groups)[node], -1)
    keys = np.array([len(g.keys) for g in groups] + [0], dtype=np.int64)
    if not np.array_equal(keys[at], n_coll):  # -1 (no group): the 0 at the end
        return None
    widest = np.zeros(nodes + 1, dtype=np.int64)
    g_node = np.repeat(np.arange(nodes), n_groups)
    np.maximum.at(widest, g_node, keys[:-1])
    if total_ix and ((ix < 0).any() or (ix >= widest[ix_node]).any()):
        return None
    return StepDigest(
        step,
        tuple(groups),
        _column(ranks, "i"),
        _column(f(0), "d"),
        _column(f(1), "d"),
        _column(n_coll, "i"),
        _column(at, "i"),
        _column(f(2), "d"),
        _column(f(3), "d"),
        _column(last_n, "i"),
        _column(ix, "i"),
        malformed,
        _extremes_joined(extremes, keys[:-1]),
    )


def _extremes_joined(extremes: Callable[[], bytes], widths: np.ndarray) -> np.ndarray | None:
    """Every group's extremes as one (groups, 2, keys) array, when every group
    has as many keys (else None: each group's own tuples serve)."""
    if not len(widths) or (widths != widths[0]).any():
        return None
    raw = np.frombuffer(extremes(), dtype="<f8")
    return raw.astype(np.float64).reshape(len(widths), 2, int(widths[0]))
