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

A :class:`Window` is what one node publishes at one interval: the digests of
the steps it completed, its ranks' small records (``rank``, ``step``,
``flow``, ``conn``, ``pending``; the leader resolves flows to peers by their
endpoints, across nodes, with the ranks' own ``addrs`` and local endpoints),
each host's newest probe time, and each rank's progress (last heard, newest
step and seq with collectives), for liveness. :func:`encode` makes it compact
JSON; its length is the store traffic (``bench/leader_scale`` prints it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import reduce
from operator import add, le
from typing import Any, NamedTuple

import orjson

from fsdp_sentinel.correlate import RankStep, _blocked, _coll_ok, _columns, _top_seq

Record = dict[str, Any]


class KeyGroup(NamedTuple):
    """Ranks of one node that issued the same collectives (``keys``) in one step.

    ``longest`` / ``shortest``: per key, the longest and shortest wait among
    ``ranks`` (the node's share of the group-wide extremes).
    """

    keys: tuple[Any, ...]
    longest: tuple[float, ...]
    shortest: tuple[float, ...]
    ranks: tuple[int, ...]


class RankDigest(NamedTuple):
    """One rank's collectives in one step, as far as detection needs them.

    ``wait_s``: time blocked (union of intervals); ``total_wait``: the plain
    sum of its waits; ``local_late``: its lateness against its node's group
    only (``sum(longest) - total_wait``); ``last_ix``: the key positions at
    which it waited least on its node; ``group``: its :class:`KeyGroup`'s index.
    """

    rank: int
    wait_s: float
    total_wait: float
    local_late: float
    last_ix: tuple[int, ...]
    n_coll: int
    group: int
    top_seq: int


class StepDigest(NamedTuple):
    """A node's collectives of one step: its key groups and its ranks; ``malformed``
    counts coll records dropped for a bad field (as the correlator would)."""

    step: int
    groups: tuple[KeyGroup, ...]
    ranks: tuple[RankDigest, ...]
    malformed: int = 0


class Window(NamedTuple):
    """What one node publishes at one interval (see the module docstring).

    ``progress``: ``(rank, t, step, top_seq)`` per rank and step it sent
    collectives of in the window (``t`` its newest record's); ``heard``:
    ``(host, t, dt)`` of each probe poll in the window; ``t``: the node's clock.
    """

    node: str
    seq: int
    t: float
    records: tuple[Record, ...]
    digests: tuple[StepDigest, ...]
    progress: tuple[tuple[int, float, int, int], ...]
    heard: tuple[tuple[str, float, float], ...]


def digest_step(step: int, colls_by_rank: Mapping[int, list[Record]]) -> StepDigest:
    """Digest one node's ``coll`` records of ``step`` (rank -> its records)."""
    bad = 0
    cols_of: dict[int, Any] = {}
    for rank in sorted(colls_by_rank):
        colls = colls_by_rank[rank]
        if not colls:
            continue
        try:
            cols_of[rank] = _columns(colls)
        except (KeyError, TypeError, ValueError, AttributeError):
            good = [c for c in colls if _coll_ok(c)]
            bad += len(colls) - len(good)
            if good:
                cols_of[rank] = _columns(good)
    by_keys: dict[tuple[Any, ...], list[int]] = {}
    for rank, cols in cols_of.items():
        by_keys.setdefault(tuple(cols.keys), []).append(rank)
    groups: list[KeyGroup] = []
    ranks: list[RankDigest] = []
    for gi, (keys, members) in enumerate(by_keys.items()):
        by_coll = list(zip(*[cols_of[r].waits for r in members], strict=True))
        longest = tuple(map(max, by_coll))
        shortest = tuple(map(min, by_coll))
        groups.append(KeyGroup(keys, longest, shortest, tuple(members)))
        top = reduce(add, longest, 0.0)
        for r in members:
            cols = cols_of[r]
            last_ix = tuple(i for i, hit in enumerate(map(le, cols.waits, shortest)) if hit)
            ranks.append(
                RankDigest(
                    r,
                    _blocked(cols),
                    cols.total_wait,
                    top - cols.total_wait,
                    last_ix,
                    len(cols.waits),
                    gi,
                    _top_seq(cols.keys),
                )
            )
    ranks.sort()
    return StepDigest(step, tuple(groups), tuple(ranks), bad)


def rank_steps(
    digests: Iterable[StepDigest], step_s: Mapping[int, float | None]
) -> tuple[RankStep, ...]:
    """Every rank's :class:`RankStep` of one step, from every node's digest of it.

    ``step_s``: each rank's step time from its ``step`` record (a rank with
    collectives but no step record gets None, as in the correlator). When
    every rank issued the same keys (FSDP's usual case) the figures are the
    correlator's to the last bit: the same maxima, summed in the same order.
    """
    groups: list[KeyGroup] = []
    members: list[tuple[RankDigest, KeyGroup]] = []
    for d in digests:
        base = len(groups)
        groups.extend(d.groups)
        for rd in d.ranks:
            members.append((rd, groups[base + rd.group]))
    out: dict[int, RankStep] = {}
    keys0 = groups[0].keys if groups else None
    if len(members) >= 2 and all(g.keys == keys0 for g in groups):
        longest = list(map(max, zip(*[g.longest for g in groups], strict=True)))
        shortest = list(map(min, zip(*[g.shortest for g in groups], strict=True)))
        top = reduce(add, longest, 0.0)
        for rd, g in members:
            nmin = g.shortest
            last = sum(1 for i in rd.last_ix if nmin[i] <= shortest[i])
            out[rd.rank] = _rank_step(rd, step_s, max(0.0, top - rd.total_wait), last, rd.n_coll)
    else:
        span: dict[Any, list[float]] = {}  # key -> [longest, shortest, ranks]
        for g in groups:
            n = float(len(g.ranks))
            for k, hi, lo in zip(g.keys, g.longest, g.shortest, strict=True):
                s = span.get(k)
                if s is None:
                    span[k] = [hi, lo, n]
                else:
                    s[0] = max(s[0], hi)
                    s[1] = min(s[1], lo)
                    s[2] += n
        for rd, g in members:
            late = rd.local_late if len(g.ranks) >= 2 else 0.0
            matched = last = 0
            ix = set(rd.last_ix)
            for i, (k, hi, lo) in enumerate(zip(g.keys, g.longest, g.shortest, strict=True)):
                s = span[k]
                if s[2] < 2:
                    continue
                matched += 1
                late += s[0] - hi
                if i in ix and lo <= s[1]:
                    last += 1
            out[rd.rank] = _rank_step(rd, step_s, late, last, matched)
    for rank, st in step_s.items():
        if rank not in out:
            compute = None if st is None else max(0.0, st)
            out[rank] = RankStep(rank, st, 0.0, compute, 0.0, 0.0, 0, 0)
    return tuple(out[r] for r in sorted(out))


def _rank_step(
    rd: RankDigest, step_s: Mapping[int, float | None], late: float, last: int, matched: int
) -> RankStep:
    st = step_s.get(rd.rank)
    compute = None if st is None else max(0.0, st - rd.wait_s)
    return RankStep(
        rd.rank, st, rd.wait_s, compute, late, (last / matched) if matched else 0.0, matched,
        rd.n_coll,
    )  # fmt: skip


# ------------------------------------------------------------ wire form


def _keys_out(keys: Sequence[Any]) -> Any:
    # FSDP's keys are usually consecutive seqs: send the first and the count.
    if keys and all(type(k) is int for k in keys):
        k0 = keys[0]
        if all(k == k0 + i for i, k in enumerate(keys)):
            return {"from": k0, "n": len(keys)}
    return [list(k) if isinstance(k, tuple) else k for k in keys]


def _keys_in(obj: Any) -> tuple[Any, ...]:
    if isinstance(obj, dict):
        return tuple(range(int(obj["from"]), int(obj["from"]) + int(obj["n"])))
    return tuple(tuple(k) if isinstance(k, list) else k for k in obj)


def encode(w: Window) -> bytes:
    """The window as compact JSON (what goes through the store)."""
    return orjson.dumps(
        {
            "node": w.node,
            "seq": w.seq,
            "t": w.t,
            "records": w.records,
            "digests": [
                {
                    "step": d.step,
                    "bad": d.malformed,
                    "groups": [
                        [_keys_out(g.keys), g.longest, g.shortest, g.ranks] for g in d.groups
                    ],
                    "ranks": [list(r) for r in d.ranks],
                }
                for d in w.digests
            ],
            "progress": w.progress,
            "heard": w.heard,
        }
    )


def decode(data: bytes) -> Window:
    """A window back from :func:`encode`'s bytes; ValueError when they are not one."""
    try:
        o = orjson.loads(data)
        digests = tuple(
            StepDigest(
                int(d["step"]),
                tuple(
                    KeyGroup(_keys_in(k), tuple(hi), tuple(lo), tuple(int(r) for r in rs))
                    for k, hi, lo, rs in d["groups"]
                ),
                tuple(
                    RankDigest(
                        int(r[0]),
                        float(r[1]),
                        float(r[2]),
                        float(r[3]),
                        tuple(r[4]),
                        int(r[5]),
                        int(r[6]),
                        int(r[7]),
                    )  # fmt: skip
                    for r in d["ranks"]
                ),
                int(d.get("bad", 0)),
            )
            for d in o["digests"]
        )
        return Window(
            str(o["node"]),
            int(o["seq"]),
            float(o["t"]),
            tuple(o["records"]),
            digests,
            tuple((int(r), float(t), int(s), int(q)) for r, t, s, q in o["progress"]),
            tuple((str(h), float(t), float(dt)) for h, t, dt in o["heard"]),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"not a cluster window: {e}") from e
