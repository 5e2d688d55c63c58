"""Correlate trace-v1 records into the summaries the detector reads.

The :class:`Correlator` keeps just enough state to answer three questions:

* who is who: pid -> rank from ``rank`` records, flow -> (rank, peer rank) from
  the flow's pid, the ranks' ``addrs``, and the local endpoints seen in other
  flows and in ``conn`` records (on one machine every rank shares one address,
  so the endpoint ``ip:port`` is what tells the peer);
* per step and rank (:class:`RankStep`): step time, time blocked in
  collectives, compute time, and how late the rank arrived at each collective
  compared with its group. Lateness is computed from *wait durations*
  (``end - issue``, both read on one host), so clock offsets between hosts
  cancel: the last rank to arrive waits least, and its lateness at one
  collective is ``max wait in the group - its own wait``;
* per pair of ranks (:class:`PairFlow`), over the latest ``flow_window_s``
  seconds of ``flow`` records (the pipeline sizes it in steps): bytes,
  byte-weighted srtt, retransmits and the samples themselves; and
  per rank (:class:`RankLiveness`) when it was last heard from and whether its
  connections were torn down.

Heavy work happens once per completed step (:meth:`Correlator.step_summary`);
the per-record methods only file records away, so a busy stream stays cheap.
This module does no I/O and keeps no clock: the caller says what time it is.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import islice, repeat
from operator import add, attrgetter, gt, itemgetter, le, sub
from typing import Any, NamedTuple

import numpy as np

from fsdp_sentinel import buckets
from fsdp_sentinel.flowstore import (
    DequeStore,
    PairFlow,
    PairMap,
    PairStore,
)
from fsdp_sentinel.rankstep import RankStep, Rows, StepRanks, row_of
from fsdp_sentinel.ranktotals import RankTotals
from fsdp_sentinel.trace import KEY

_WAIT_BOUNDS = buckets.COLLECTIVE_WAIT_BOUNDS

Record = dict[str, Any]

# The hot paths look fields up with the parser's own key objects (an identity
# hit in each record's dict; see trace.KEY).
_END, _RANK, _STEP, _GROUP = KEY["end"], KEY["rank"], KEY["step"], KEY["group"]
_KIND, _HOST_PID, _START = KEY["kind"], KEY["host_pid"], KEY["start"]
_T, _DT, _HOST = KEY["t"], KEY["dt"], KEY["host"]
_OP, _BYTES = KEY["op"], KEY["bytes"]

#: A step of at least this many ranks is summarised as columns
#: (:class:`~fsdp_sentinel.rankstep.StepRanks`, :meth:`Correlator._rank_steps_columnar`):
#: below it a RankStep per rank costs less than numpy's calls.
COLUMNAR_RANKS = 64

# Every field the step summary and the per-op totals read, in one lookup pass
# per record: the per-op totals then work on these columns, so no record has
# to be kept (or read again) after its step is summarised.
_FIELDS = itemgetter(*(KEY[f] for f in ("seq", "issue", "end", "op", "bytes")))

# The summaries below are NamedTuples, not frozen dataclasses: one step builds
# dozens of them, and a tuple is built several times faster (replay is bound by
# exactly this kind of per-step work). They are just as immutable.


class RankLiveness(NamedTuple):
    """When a rank was last heard from and what happened to its connections.

    ``last_t``: time of its latest hook record (step/coll/rank) on its own
    clock; ``done_step``: its latest completed step (-1 before the first);
    ``torn_peers``: peers whose connection to it closed or reset (``torn_t`` the
    first such time); ``peers``: peers it was ever seen talking to;
    ``self_closed``: one of its own sockets recorded a close; ``reset_peers``:
    peers whose connection *it* reset (a reset its peer received from it, or one
    it sent). A process that dies leaves its kernel to reset connections with
    data in flight, while an orderly exit closes them, so this tells a killed
    rank from the peers that exit after it. ``pending_t``: its newest
    ``pending`` record (0.0: none filed): alive, but blocked, so not silent.
    """

    rank: int
    host: str
    last_t: float
    done_step: int
    torn_peers: int
    peers: int
    torn_t: float | None
    self_closed: bool
    reset_peers: int
    pending_t: float = 0.0


class LivenessColumns(Rows[RankLiveness]):
    """Every rank's :class:`RankLiveness` as columns, in rank order (a job of
    thousands of ranks: ``detect.lost`` screens them with array operations and
    reads a RankLiveness only for the few it must judge). Dense figures are
    numpy columns; the sparse ones (torn connections, own closes, resets) are
    maps of the few ranks that have them. A sequence of RankLiveness on demand.
    """

    __slots__ = (
        "rank",
        "host",
        "last_t",
        "done_step",
        "pending_t",
        "peers",
        "torn",
        "closed",
        "reset",
    )

    def __init__(
        self,
        rank: np.ndarray,
        host: list[str],
        last_t: np.ndarray,
        done_step: np.ndarray,
        pending_t: np.ndarray,
        peers: np.ndarray,
        torn: dict[int, tuple[int, float]],
        closed: frozenset[int],
        reset: dict[int, int],
    ) -> None:
        self.rank = rank
        self.host = host
        self.last_t = last_t
        self.done_step = done_step
        self.pending_t = pending_t
        self.peers = peers
        self.torn = torn  # rank -> (peers whose connection to it went, first such time)
        self.closed = closed
        self.reset = reset  # rank -> peers whose connection it reset

    def __len__(self) -> int:
        return len(self.rank)

    def row_of(self, rank: int) -> int | None:
        return row_of(self.rank, rank)

    def _row(self, i: int) -> RankLiveness:
        r = int(self.rank[i])
        torn_peers, torn_t = self.torn.get(r, (0, None))
        return RankLiveness(
            r,
            self.host[i],
            float(self.last_t[i]),
            int(self.done_step[i]),
            torn_peers,
            int(self.peers[i]),
            torn_t,
            r in self.closed,
            self.reset.get(r, 0),
            float(self.pending_t[i]),
        )

    def without(self, ranks: frozenset[int]) -> LivenessColumns:
        """The columns of every rank but ``ranks``."""
        keep = ~np.isin(self.rank, np.fromiter(ranks, np.int64, len(ranks)))
        return LivenessColumns(
            self.rank[keep],
            [h for h, k in zip(self.host, keep.tolist(), strict=True) if k],
            self.last_t[keep],
            self.done_step[keep],
            self.pending_t[keep],
            self.peers[keep],
            {r: v for r, v in self.torn.items() if r not in ranks},
            self.closed - ranks,
            {r: v for r, v in self.reset.items() if r not in ranks},
        )


class Pending(NamedTuple):
    """A collective a rank still reports in flight (its newest ``pending`` record).

    ``t`` is when that record was made, ``issue`` when the collective was
    issued (both on the rank's clock); ``newest_seq`` in :class:`Stall` says
    how far each rank got.
    """

    rank: int
    seq: int
    step: int
    op: str
    issue: float
    t: float


class Stall(NamedTuple):
    """What the liveness rules (hang, silent loss) read, at time ``t``.

    ``pending``: the live pending collectives, one per rank at most (its
    oldest still in flight; a rank whose pending records stopped, or whose
    collective completed, has none). ``newest_seq``: per rank, the newest
    ``seq`` it was seen to issue (a ``coll`` or ``pending`` record; -1 when
    none). ``hosts_heard``: per host, when its own probe records (``netdev``,
    ``flow``) last arrived, and their interval (``dt``). ``retrans``: per
    directed pair ``(rank, peer, n)``, retransmits in flow samples since the
    oldest pending collective was issued (TCP resending into a dead link).
    ``delivered``: per directed pair ``(rank, peer, bytes)``, what ``rank``
    read from ``peer`` in flow samples after the first one in the stall that
    retransmitted: a link that still carries bytes while TCP resends is
    lossy, not cut (a link dead either way soon carries none either way: the
    far end's window fills with data it never hears acknowledged).
    """

    pending: tuple[Pending, ...] = ()
    newest_seq: tuple[tuple[int, int], ...] = ()
    hosts_heard: tuple[tuple[str, float, float], ...] = ()
    retrans: tuple[tuple[int, int, int], ...] = ()
    delivered: tuple[tuple[int, int, int], ...] = ()


_NO_STALL = Stall()


class Summary(NamedTuple):
    """What the detector sees at time ``t``.

    ``step`` is the job step these ``ranks`` summarise, or None for a clock
    tick (then ``ranks`` is empty and only liveness is judged). ``job_done``
    is the newest step any rank completed; ``mid_step`` says some rank has
    reported collectives of a step past ``job_done`` (the job is inside a step,
    not between steps or finished).
    """

    t: float
    step: int | None
    ranks: Sequence[RankStep]
    flows: Sequence[PairFlow]  # a FlowMatrix, or a tuple
    liveness: Sequence[RankLiveness]
    job_done: int
    mid_step: bool
    stall: Stall = _NO_STALL


def weighted_srtt(samples: Iterable[tuple[float | None, int]]) -> float | None:
    """The srtt of several ``(srtt_us, tx_bytes)`` samples, weighted by bytes sent (a sample
    that sent nothing weighs as one byte); None when none has an srtt. The flow
    matrix weighs its window's samples the same way (inline there: it runs per step)."""
    wsum = 0.0
    wbytes = 0
    for srtt, tx in samples:
        if srtt is not None:
            w = tx if tx > 0 else 1
            wsum += srtt * w
            wbytes += w
    return (wsum / wbytes) if wbytes else None


@dataclass(frozen=True)
class StateLimits:
    """Caps on what the correlator keeps, so no stream can grow it without end.

    Far above any real job's shape (FSDP keeps 1-3 steps in flight a rank,
    a few ops, each rank a handful of peers); what passes a cap is evicted
    (the oldest first) or folded, and counted in :attr:`Correlator.evicted`.
    """

    max_ranks: int = 4096
    """Ranks kept. When full, the longest-idle rank that only announced itself
    (never a step or collective) makes room; otherwise the new rank is refused."""

    max_pending_steps: int = 64
    """Steps not yet summarised, a rank (a rank whose step records never come
    otherwise files collectives for ever); the oldest is dropped."""

    max_colls_per_step: int = 16_384
    """Collectives of one rank in one step (FSDP issues a few per layer)."""

    max_ops: int = 16
    """Distinct ``op`` values a rank's totals keep; the rest add up as ``other``."""

    max_pairs: int = 65_536
    """Directed (rank, peer) pairs with flow figures."""

    max_endpoints: int = 65_536
    """Local ``ip:port`` endpoints remembered (the oldest half goes when full)."""

    max_hosts: int = 4096
    """Hosts whose probe records' arrival is tracked."""

    ttl_s: float = 600.0
    """Stream seconds after which a pair with no new sample, a host not heard
    from, or a rank that only announced itself is forgotten (:meth:`Correlator.sweep`)."""


#: What the evictions are counted under (``fsdp_sentinel_state_evictions_total{kind}``).
EVICTION_KINDS = ("rank", "step", "coll", "op", "pair", "endpoint", "host")
OTHER_OP = "other"


class _Rank:
    """Everything the correlator keeps about one rank (bounded)."""

    __slots__ = (
        "rank",
        "host",
        "job",
        "pid",
        "addrs",
        "steps",
        "colls",
        "last_t",
        "first_step",
        "done_step",
        "max_coll_step",
        "lost",
        "_last",
        "steps_total",
        "step_seconds_total",
        "coll_count",
        "coll_bytes",
        "coll_seconds",
        "wait_seconds_total",
        "step_buckets",
        "_wait_buckets",
        "_wait_backlog",
        "_backlog_n",
        "_op_plan",
        "bad_fields",
        "pending",
        "seq_done",
        "keys_done",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.host = ""
        self.job = ""
        self.pid: int | None = None
        self.addrs: tuple[str, ...] = ()
        self.steps: dict[int, Record] = {}
        self.colls: dict[int, list[Record]] = {}
        self.last_t = 0.0
        self.first_step: int | None = None
        self.done_step = -1
        self.max_coll_step = -1
        self.lost = False
        # Its newest step's figures: a RankStep, or (StepRanks, row) until read.
        self._last: RankStep | tuple[StepRanks, int] | None = None
        self.steps_total = 0
        self.step_seconds_total = 0.0
        # Per-op totals of summarised collectives (the exporter's counters).
        self.coll_count: dict[str, int] = {}
        self.coll_bytes: dict[str, int] = {}
        self.coll_seconds: dict[str, float] = {}
        # Histogram counts of the same (the exporter's step and wait histograms).
        self.wait_seconds_total = 0.0
        self.step_buckets = buckets.empty(buckets.STEP_DURATION_BOUNDS)
        self._wait_buckets: dict[str, list[int]] = {}
        # Waits summarised but not yet counted into _wait_buckets, by op (see
        # wait_buckets): at most _WAIT_BACKLOG values a rank.
        self._wait_backlog: dict[str, list[float]] = {}
        self._backlog_n = 0
        self._op_plan: _OpPlan | None = None
        self.bad_fields = 0  # op or bytes fields of coll records that could not be added up
        self.pending: dict[int, Pending] = {}  # seq -> its newest pending record
        self.seq_done = -1  # newest seq of its summarised coll records (see keys_done)
        self.keys_done: Sequence[Any] = ()  # the newest summarised step's collective keys

    @property
    def last(self) -> RankStep | None:
        """Its newest summarised step's figures (None before the first)."""
        last = self._last
        if last is None or isinstance(last, RankStep):
            return last
        cols, row = last
        made = self._last = cols[row]
        return made

    @last.setter
    def last(self, value: RankStep | tuple[StepRanks, int] | None) -> None:
        self._last = value

    def add_step_time(self, step_s: float, wait: float) -> None:
        """One summarised step of ``step_s`` seconds, ``wait`` of them blocked."""
        self.steps_total += 1
        self.step_seconds_total += step_s
        self.wait_seconds_total += min(wait, step_s)
        buckets.observe(self.step_buckets, buckets.STEP_DURATION_BOUNDS, step_s)

    def add_ops(self, cols: _Columns, max_ops: int, evicted: dict[str, int]) -> None:
        """Add one summarised step's collectives to the per-op totals (at most
        ``max_ops`` ops; past it, ``other``, counted in ``evicted``)."""
        plan = self._op_plan
        # FSDP issues the same collectives every step: the plan made for the
        # last step still says how to add this one up (one tuple compare).
        if plan is None or plan.ops != cols.ops or plan.nbytes != cols.nbytes:
            plan = self._op_plan = _op_plan(cols.ops, cols.nbytes)
        self.bad_fields += plan.bad
        waits = cols.waits
        for key, n, b, pick, _at in plan.per_op:
            picked = waits if pick is None else pick(waits)
            self._add_op(
                key,
                n,
                b,
                cols.total_wait if pick is None else sum(picked),
                picked,
                max_ops,
                evicted,
            )
        self._backlog_n += len(waits)
        if self._backlog_n >= _WAIT_BACKLOG:
            self._count_backlog()

    def add_op_sums(
        self,
        plan: _OpPlan,
        waits: list[float],
        secs: list[float],
        max_ops: int,
        evicted: dict[str, int],
    ) -> None:
        """:meth:`add_ops` with the step's ``plan`` made and each op's summed wait
        (``secs``, in the plan's order) already added up, for the whole step at once
        (``Correlator._rank_steps_columnar``)."""
        self._op_plan = plan
        self.bad_fields += plan.bad
        for (key, n, b, pick, _at), w in zip(plan.per_op, secs, strict=True):
            self._add_op(key, n, b, w, waits if pick is None else pick(waits), max_ops, evicted)
        self._backlog_n += len(waits)
        if self._backlog_n >= _WAIT_BACKLOG:
            self._count_backlog()

    def _add_op(
        self,
        key: str,
        n: int,
        b: int,
        w: float,
        picked: Sequence[float],
        max_ops: int,
        evicted: dict[str, int],
    ) -> None:
        """One op's ``n`` collectives of one step (``b`` bytes, ``w`` seconds waited,
        each wait in ``picked``) into the totals."""
        cnt = self.coll_count
        if key not in cnt and len(cnt) >= max_ops:
            evicted["op"] += n  # a rank's ops past the cap add up as one
            key = OTHER_OP
        backlog = self._wait_backlog
        pend = backlog.get(key)
        if pend is None:
            backlog[key] = list(picked)
        else:
            pend += picked
        if key in cnt:
            cnt[key] += n
            self.coll_bytes[key] += b
            self.coll_seconds[key] += w
        else:
            cnt[key] = n
            self.coll_bytes[key] = b
            self.coll_seconds[key] = w

    def wait_buckets(self) -> dict[str, list[int]]:
        """Histogram counts of the summarised collectives' waits, by op
        (``buckets.COLLECTIVE_WAIT_BOUNDS``; the exporter's wait histograms)."""
        if self._backlog_n:
            self._count_backlog()
        return self._wait_buckets

    def _count_backlog(self) -> None:
        # Counted a few steps at a time: a step's dozen waits per op cost
        # _count_into's sort and bisections as much as several steps' do.
        hists = self._wait_buckets
        for key, values in self._wait_backlog.items():
            counts = hists.get(key)
            if counts is None:
                counts = hists[key] = buckets.empty(_WAIT_BOUNDS)
            _count_into(counts, values)
        self._wait_backlog = {}
        self._backlog_n = 0


#: Waits a rank holds back before counting them into its histograms (see
#: _Rank.wait_buckets): a few steps' worth, so that at 4,096 ranks the
#: backlog stays a few MiB.
_WAIT_BACKLOG = 64


def _count_into(counts: list[int], values: Sequence[float]) -> None:
    """Add ``values`` to histogram ``counts`` (bucket ``bisect_left(_WAIT_BOUNDS, x)``
    for each ``x``, as ``buckets`` has it), by bucket instead of by value.

    A step's waits fall in a few adjacent buckets: sorted (in C), each bucket
    they span takes its count from one bisection, so a step costs a few
    Python steps rather than one per collective (that was a seventh of
    replay's pipeline work).
    """
    if not values:
        return
    ordered = sorted(values)
    first = bisect_left(_WAIT_BOUNDS, ordered[0])
    last = bisect_left(_WAIT_BOUNDS, ordered[-1])
    below = 0  # values in the buckets before bucket k
    for k in range(first, last):
        upto = bisect_right(ordered, _WAIT_BOUNDS[k])  # values <= bound k: buckets <= k
        counts[k] += upto - below
        below = upto
    counts[last] += len(ordered) - below


class _OpPlan(NamedTuple):
    """How a step with these ``ops`` and ``nbytes`` adds up, per op: its key,
    count, bytes and what picks its waits out of the step's (None: all of them)."""

    ops: Sequence[Any]
    nbytes: Sequence[Any]
    # (op, count, bytes, picker of its waits or None for all of them, their positions)
    per_op: tuple[
        tuple[str, int, int, Callable[[Sequence[float]], Sequence[float]] | None, tuple[int, ...]],
        ...,
    ]
    bad: int  # ill-typed op or bytes fields in such a step


def _op_plan(ops: Sequence[Any], nbytes: Sequence[Any]) -> _OpPlan:
    # A bad op or byte count (never from our hooks): the collective still
    # counted in its step's summary; here it is counted under str(op) with
    # no bytes, and the bad field as malformed.
    bad = 0
    where: dict[str, list[int]] = {}
    total: dict[str, int] = {}
    for i, (op, b) in enumerate(zip(ops, nbytes, strict=True)):
        if type(op) is not str:
            bad += 1
            op = str(op)
        if type(b) not in (int, float):
            bad += 1
            b = 0
        where.setdefault(op, []).append(i)
        total[op] = total.get(op, 0) + int(b)
    single = len(where) == 1
    per_op = tuple(
        (op, len(idx), total[op], None if single else _picker(idx), tuple(idx))
        for op, idx in where.items()
    )
    return _OpPlan(tuple(ops), tuple(nbytes), per_op, bad)


def _picker(idx: list[int]) -> Callable[[Sequence[float]], Sequence[float]]:
    """The items at ``idx`` of a sequence, as a tuple, in one C call."""
    if len(idx) == 1:
        (i,) = idx
        return lambda seq: (seq[i],)
    return itemgetter(*idx)


#: A flow's identity: (host, pid, local endpoint, remote endpoint).
FlowKey = tuple[Any, Any, Any, Any]
#: What a flow sample without a record names of its ranks: nothing.
_NO_RANKS: Record = {}


def _ip(endpoint: str) -> str:
    """The address part of ``ip:port`` (``[v6]:port`` too)."""
    host, _, _port = endpoint.rpartition(":")
    return host.strip("[]") if host else endpoint


def _merged_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals`` (collectives may overlap)."""
    intervals.sort()
    total = 0.0
    cur_a, cur_b = intervals[0]
    for a, b in intervals[1:]:
        if a > cur_b:
            total += cur_b - cur_a
            cur_a, cur_b = a, b
        elif b > cur_b:
            cur_b = b
    return total + (cur_b - cur_a)


def _as_index(name: str, value: Any) -> int:
    """``value`` as a rank or step number: an integer (not a bool), or TypeError."""
    if type(value) is not int:
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


# ------------------------------------------------------------ step columns
#
# One rank's collectives of one step as columns, and what they say: its
# lateness inputs (waits), its time blocked, its newest seq. Public because
# cluster mode's node daemons (``cluster.summary.digest_step``) digest their
# ranks' collectives with the very functions the correlator's step summary
# uses, which is what makes the leader's figures the single daemon's to the
# last bit.


class CollColumns(NamedTuple):
    """One rank's collectives in one step, a sequence per field (duplicates
    dropped). ``ops`` and ``nbytes`` are checked only when they are added to
    the rank's totals (:meth:`_Rank.add_ops`)."""

    keys: Sequence[Any]
    issues: Sequence[Any]
    ends: Sequence[Any]
    waits: list[float]
    total_wait: float  # sum of ``waits``, added left to right
    ops: Sequence[Any]
    nbytes: Sequence[Any]


def coll_columns(colls: list[Record]) -> CollColumns:
    """Columns of ``colls`` (not empty); raises (KeyError, TypeError, ValueError,
    AttributeError) on a bad record (:func:`step_columns` drops it instead)."""
    try:
        seqs, issues, ends, ops, nbytes = zip(*map(_FIELDS, colls), strict=True)
    except KeyError:
        # No op or bytes (never from our hooks): the collective still counts;
        # the missing field is counted when the totals are added up.
        seqs, issues, ends, ops, nbytes = zip(
            *[(c["seq"], c["issue"], c["end"], c.get("op"), c.get("bytes")) for c in colls],
            strict=True,
        )
    keys: Sequence[Any] = seqs
    if _GROUP in colls[0]:  # a rank's records all name a group, or none
        keys = [(str(c.get("group")), seq) for c, seq in zip(colls, seqs, strict=True)]
    if len(set(keys)) != len(keys):  # a datagram delivered twice counts once
        first: dict[Any, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        idx = list(first.values())
        keys, issues, ends, ops, nbytes = (
            tuple(col[i] for i in idx) for col in (keys, issues, ends, ops, nbytes)
        )
    waits = list(map(sub, ends, issues))  # TypeError unless both are numbers
    return CollColumns(keys, issues, ends, waits, reduce(add, waits, 0.0), ops, nbytes)


def top_seq(keys: Sequence[Any]) -> int:
    """The newest ``seq`` among a step's collective keys (``seq`` or ``(group, seq)``)."""
    try:
        if type(keys[0]) is tuple:
            return int(max(k[1] for k in keys))
        return int(max(keys))
    except (TypeError, ValueError, IndexError):
        return -1  # an ill-typed seq: counted elsewhere, says nothing here


def coll_ok(rec: Record) -> bool:
    """Whether one ``coll`` record makes columns (every field the summary reads is sound)."""
    try:
        coll_columns([rec])
    except (KeyError, TypeError, ValueError, AttributeError):
        return False
    return True


def step_columns(colls: list[Record]) -> tuple[CollColumns | None, int]:
    """``(columns, records dropped)``: the columns of ``colls`` with every record
    that has a missing or ill-typed field left out (None when none is left)."""
    try:
        return coll_columns(colls), 0
    except (KeyError, TypeError, ValueError, AttributeError):
        good = [c for c in colls if coll_ok(c)]
        return (coll_columns(good) if good else None), len(colls) - len(good)


def blocked_s(cols: CollColumns) -> float:
    """Time blocked in collectives: the length of the union of their intervals."""
    # A rank's collectives usually run one after another: then the union is
    # the plain sum of the waits, added left to right as the merge would.
    if min(cols.waits) >= 0.0 and all(map(gt, islice(cols.issues, 1, None), cols.ends)):
        return cols.total_wait
    return _merged_length(list(zip(cols.issues, cols.ends, strict=True)))


# The names the correlator's own code (and its history) uses.
_Columns = CollColumns
_columns = coll_columns
_top_seq = top_seq
_blocked = blocked_s


#: A coll record without a ``group`` field, as :class:`StepColumns` files its group.
_NO_GROUP = object()

#: What a big job's ``coll`` record is filed as under its rank (``_Rank.colls``):
#: the record itself is in its step's :class:`StepColumns` and is not kept.
#: Read the records back with :meth:`StepColumns.records`.
_FILED: Any = object()


def _fill(lst: list[Any], recs: Sequence[Record]) -> None:
    """Replace each :data:`_FILED` in ``lst``, in order, with the next of ``recs``."""
    it = iter(recs)
    for j, c in enumerate(lst):
        if c is _FILED:
            lst[j] = next(it)


_RANK_OF, _SEQ_OF = itemgetter(KEY["rank"]), itemgetter(KEY["seq"])
_ISSUE_OF, _END_OF, _BYTES_OF = itemgetter(KEY["issue"]), itemgetter(_END), itemgetter(KEY["bytes"])
_START_OF, _RANK_ATTR = itemgetter(_START), attrgetter("rank")
_LAST_T, _DONE_STEP = attrgetter("last_t"), attrgetter("done_step")
_LOST, _FIRST_STEP = attrgetter("lost"), attrgetter("first_step")
_MAX_COLL_STEP = attrgetter("max_coll_step")
F64 = np.float64


class StepColumns:
    """One step's filed ``coll`` records as columns, every rank's, in filing order.

    Filled as the records are filed, while each is still in the cache: at
    thousands of ranks a step's records are spread over tens of megabytes by
    the time the step is summarised, and reading them then costs a cache miss
    for every field of every record (a step of 4,096 ranks: ~2 us a record
    read late, against ~0.2 us here). What the columnar step summary reads
    instead of the records: ``rank``, ``seq`` and ``nbytes`` as int64,
    ``issue`` and ``end`` as float64, ``op`` and ``group`` as indices into
    ``names`` (each distinct value once; :data:`_NO_GROUP` for a record that
    names no group). ``ok`` turns false for good when a record's field does
    not fit its column (never for a record the trace format let through):
    then the step is summarised from the records.

    The records themselves are not kept: each is filed under its rank as
    :data:`_FILED` and freed with the batch it came in, while still in the
    cache. Kept until the summary, a step's records were freed there cold
    (a 4,096-rank replay spent 11 % of its time on that alone), and the step
    summary reads only the columns. The rare reader that needs records (the
    per-rank summary of an unusual step, the stall view's newest ``seq``)
    gets them back from :meth:`records`: every field the summary reads, as
    the record had it. A step whose columns stop taking its records (a field
    unfit for its column, or a rank's step evicted) has them rebuilt at once
    and keeps records from then on (``Correlator._materialize``).
    """

    __slots__ = ("rank", "seq", "issue", "end", "nbytes", "op", "group", "names", "ok", "_tops")

    def __init__(self) -> None:
        self.rank = array("q")
        self.seq = array("q")
        self.issue = array("d")
        self.end = array("d")
        self.nbytes = array("q")
        self.op = array("q")
        self.group = array("q")
        # value -> its index (a new value gets the next one, in C)
        self.names: defaultdict[Any, int] = defaultdict()
        self.names.default_factory = self.names.__len__
        self.ok = True
        self._tops: dict[int, int] | None = None  # top_seqs, until more is filed

    def __len__(self) -> int:
        return len(self.rank)

    def extend(self, recs: Sequence[Record]) -> bool:
        """File ``recs`` (records already filed under their ranks, all of this step);
        False when the columns do not take them (then they hold what they held)."""
        if not self.ok:
            return False
        intern = self.names.__getitem__
        before = len(self.rank)
        try:
            self.rank.extend(map(_RANK_OF, recs))
            self.seq.extend(map(_SEQ_OF, recs))
            self.issue.extend(map(_ISSUE_OF, recs))
            self.end.extend(map(_END_OF, recs))
            self.nbytes.extend(map(_BYTES_OF, recs))
            self.op.extend(map(intern, map(dict.get, recs, repeat(_OP))))
            self.group.extend(map(intern, map(dict.get, recs, repeat(_GROUP), repeat(_NO_GROUP))))
        except (KeyError, TypeError, ValueError, OverflowError):
            for col in self._cols():
                del col[before:]
            self.ok = False  # the columns no longer line up: the records say it all
            return False
        self._tops = None
        return True

    def _cols(self) -> tuple[array, ...]:  # type: ignore[type-arg]
        return (self.rank, self.seq, self.issue, self.end, self.nbytes, self.op, self.group)

    def records(self, step: Any) -> dict[int, list[Record]]:
        """Each rank's records rebuilt from the columns, in filing order: every
        field the summary reads, as the trace format's record had it."""
        names = list(self.names)  # index -> value
        out: dict[int, list[Record]] = {}
        for r, q, t0, t1, b, o, g in zip(*self._cols(), strict=True):
            rec = {"kind": "coll", "rank": r, "step": step, "seq": q, "op": names[o],
                   "bytes": b, "issue": t0, "end": t1}  # fmt: skip
            group = names[g]
            if group is not _NO_GROUP:
                rec["group"] = group
            lst = out.get(r)
            if lst is None:
                out[r] = [rec]
            else:
                lst.append(rec)
        return out

    def drop(self) -> None:
        """Hold nothing more (the step's records are kept as records)."""
        for col in self._cols():
            del col[:]
        self.ok = False

    def top_seqs(self) -> dict[int, int]:
        """Each rank's newest ``seq`` in the columns."""
        if self._tops is None:
            tops: dict[int, int] = {}
            for r, q in zip(self.rank, self.seq, strict=True):
                if q > tops.get(r, -1):
                    tops[r] = q
            self._tops = tops
        return self._tops


class Correlator:
    """Files records by rank and step; builds :class:`Summary` objects on demand.

    ``flow_window_s`` is how far back flow samples count for the pair figures.
    """

    def __init__(
        self,
        flow_window_s: float = 3.0,
        limits: StateLimits | None = None,
        store: type[PairStore] = DequeStore,
    ) -> None:
        self.flow_window_s = flow_window_s
        self.limits = limits or StateLimits()
        #: What the caps and time-to-live dropped or folded, by kind (EVICTION_KINDS).
        self.evicted: dict[str, int] = dict.fromkeys(EVICTION_KINDS, 0)
        # Ranks that only announced themselves so far, oldest first: the
        # ones a full rank map evicts.
        self._idle: dict[int, None] = {}
        self.flow_dt: float | None = None  # the probes' interval: the latest flow sample's dt
        self.ranks: dict[int, _Rank] = {}
        self.world_size: int | None = None
        # Every directed pair's flow samples and totals (fsdp_sentinel.flowstore):
        # a deque a pair (a daemon's few); a leader's thousands, one table.
        self.flows: PairStore = store(flow_window_s, self.limits.max_pairs)
        self._pid_rank: dict[tuple[str, int], int] = {}
        self._pid_only: dict[int, int | None] = {}  # pid -> rank, None when ambiguous
        self._addr_rank: dict[str, int | None] = {}  # ip -> rank, None when shared
        self._endpoint_rank: dict[str, int] = {}  # "ip:port" local end -> rank
        # A flow's (host, pid, src, dst) -> the slot its samples file into
        # (``_flow_slot``); or its (rank, peer) while that pair cannot be made
        # (the pair map full) or is swept (``_flow_pair``). A flow is in one
        # of the two at most. One lookup a sample: a big job's leader files a
        # flow record a rank every second (a round's all at once when every
        # one is a slot: ``add_flow_rows``).
        self._flow_slot: dict[FlowKey, int] = {}
        self._flow_pair: dict[FlowKey, tuple[int, int]] = {}
        # Bumped whenever a flow's cached slot is set or dropped: a list of
        # slots looked up (flow_slots) holds while it is unchanged.
        self.flow_slots_version = 0
        self._torn: dict[int, dict[int, float]] = {}  # rank -> peer -> first torn time
        self._self_closed: dict[int, float] = {}
        self._reset_by: dict[int, set[int]] = {}  # rank -> peers whose connection it reset
        self._peers: dict[int, set[int]] = {}
        self._matrix: Sequence[PairFlow] | None = None  # flow_matrix's last answer
        self._matrix_oldest = math.inf  # its oldest sample's time
        # Flow samples whose interval began before this are no evidence (a new
        # attempt's warm-up: ``drop_flows_before``); -inf: every sample counts.
        self._flow_floor = -math.inf
        self.job_done = -1
        self.max_coll_step = -1  # newest step any rank reported collectives of
        self._reports: dict[int, int] = {}  # step -> ranks whose step record is filed
        # step -> (rank, step) filings of step or coll records not yet summarised:
        # ``pending_steps`` without a pass over every rank (quadratic at scale).
        self._filed: dict[int, int] = {}
        # step -> its filed coll records as columns (the columnar step summary's)
        self._step_cols: dict[int, StepColumns] = {}
        self.summarised = -(10**18)  # newest step summarised
        self._colls_done = 0  # coll records no longer filed: summarised, or dropped as late
        self.late_records = 0
        self.malformed = 0  # coll records dropped at summary time for a bad field
        self.unattributed_flows = 0
        # host -> [when its own probe records last arrived, their interval]
        self.hosts_heard: dict[str, list[float]] = {}
        self._pending_ranks: set[int] = set()  # ranks with pending records filed
        # A big job's per-rank totals as columns, the truth while held (see
        # fsdp_sentinel.ranktotals): each rank's own fields are then a copy.
        self._totals: RankTotals | None = None
        # _liveness_columns' ranks in order, their states and hosts; peer counts
        self._live: tuple[np.ndarray, list[_Rank], list[str]] | None = None
        self._live_peers: np.ndarray | None = None
        self._colls_cap = self.limits.max_colls_per_step  # read per coll record
        # The liveness a tick read, for the steps it summarises at the same
        # instant (Pipeline._advance: no record is filed in between).
        self.held_liveness: Sequence[RankLiveness] | None = None

    # ------------------------------------------------------------ per record

    def rank_of(self, rank: int) -> _Rank:
        rs = self.ranks.get(rank)
        if rs is None:
            if len(self.ranks) >= self.limits.max_ranks and not self._evict_idle_rank():
                self.evicted["rank"] += 1
                raise ValueError(f"rank map full ({self.limits.max_ranks}): rank {rank} refused")
            rs = self.ranks[rank] = self._new_rank(rank)
            self._live = None
        return rs

    def _new_rank(self, rank: int) -> _Rank:
        """A new rank's state (cluster mode's leader keeps some of it as columns)."""
        return _Rank(rank)

    def _evict_idle_rank(self) -> bool:
        """Forget the longest-idle rank that never sent a step or collective."""
        for rank in self._idle:
            self.forget_rank(rank)
            return True
        return False

    def forget_rank(self, rank: int) -> None:
        """Drop everything kept about ``rank`` (evicted), but what others say of it."""
        if rank in self.ranks:
            self._fold_totals()
            self._live = None
        rs = self.ranks.pop(rank, None)
        self._idle.pop(rank, None)
        if rs is None:
            return
        self.evicted["rank"] += 1
        if rs.pid is not None:
            if self._pid_rank.get((rs.host, rs.pid)) == rank:
                del self._pid_rank[(rs.host, rs.pid)]
            if self._pid_only.get(rs.pid) == rank:
                del self._pid_only[rs.pid]
        for a in rs.addrs:
            if self._addr_rank.get(a) == rank:
                del self._addr_rank[a]
        for table in (self._torn, self._self_closed, self._reset_by, self._peers):
            table.pop(rank, None)  # type: ignore[attr-defined]
        self._pending_ranks.discard(rank)
        self._forget_flows()

    def _busy(self, rs: _Rank) -> None:
        """``rs`` sent a step or collective: it is no longer idle (never evicted for room)."""
        self._idle.pop(rs.rank, None)

    def add_rank(self, rec: Record) -> _Rank:
        rank = int(rec["rank"])
        if rank >= int(rec["world_size"]):
            raise ValueError(f"rank {rank} outside its own world of {rec['world_size']}")
        rs = self.rank_of(rank)
        if rs.done_step < 0 and rs.max_coll_step < 0:
            self._idle.pop(rank, None)
            self._idle[rank] = None  # announced again: the newest idle rank
        rs.host = str(rec["host"])
        self._live = None  # its host may have changed
        rs.job = str(rec.get("job") or "")
        rs.pid = int(rec["pid"])
        rs.addrs = tuple(str(a) for a in rec["addrs"])
        t = float(rec["t"])
        if t > rs.last_t:
            rs.last_t = t
        self.world_size = int(rec["world_size"])
        # Probes key flows on the host's tgid: the kernel's pid for the sender
        # (``host_pid``, from the ingest socket) where the rank's own view
        # (``pid``) is a container's.
        key = int(rec.get("host_pid", rs.pid))
        self._pid_rank[(rs.host, key)] = rank
        prev = self._pid_only.get(key, rank)
        self._pid_only[key] = rank if prev == rank else None
        for a in rs.addrs:
            prev = self._addr_rank.get(a, rank)
            self._addr_rank[a] = rank if prev == rank else None
        self._forget_flows()  # attributions may change
        return rs

    def _forget_flows(self) -> None:
        """Empty the flow cache (refilled from the maps as flows come)."""
        self._flow_slot.clear()
        self._flow_pair.clear()
        self.flow_slots_version += 1

    def add_step(self, rec: Record) -> tuple[_Rank, int]:
        rs = self.rank_of(int(rec[_RANK]))
        step = int(rec[_STEP])
        end = float(rec[_END])
        float(rec[_START])  # validate now, not at summary time
        if step not in rs.steps:  # a datagram delivered twice is one report
            if len(rs.steps) >= self.limits.max_pending_steps:
                old = min(rs.steps)
                del rs.steps[old]
                self._reports[old] -= 1
                if not self._reports[old]:
                    del self._reports[old]
                self._unfile(old)
                self.evicted["step"] += 1
            self._reports[step] = self._reports.get(step, 0) + 1
            self._filed[step] = self._filed.get(step, 0) + 1
        rs.steps[step] = rec
        self.note_step(rs, step, end)
        return rs, step

    def note_step(self, rs: _Rank, step: int, end: float) -> None:
        """What a step record ending at ``end`` says of its rank and the job."""
        self.note_steps(step, ((rs, end),))

    def note_steps(self, step: int, rows: Iterable[tuple[_Rank, float]]) -> None:
        """:meth:`note_step` for each ``(rank state, end)`` of ``rows``, all of
        ``step`` (cluster mode's leader files a node's step records at once)."""
        noted = False
        for rs, end in rows:
            noted = True
            if end > rs.last_t:
                rs.last_t = end
            if rs.first_step is None or step < rs.first_step:
                rs.first_step = step
            if step > rs.done_step:
                if rs.done_step < 0:
                    self._busy(rs)
                rs.done_step = step
        if noted and step > self.job_done:
            self.job_done = step

    def heard_late(self, rank: Any, step: Any, end: Any, done: bool) -> None:
        """A record for a step already summarised (``done``: a ``step`` record,
        else a ``coll``): too late for the summaries, but its rank is alive.

        Its rank counts as heard from (``last_t``) and as having started and
        reached that step, so the next steps wait for it. Without this a rank
        whose records arrive after the others' step records (an emitter a
        step behind, a relay) had every record dropped as late before it
        ever counted as started, so no step waited for it and it was flagged
        ``rank_lost`` while it sent every step. Only an announced rank, and
        only well-typed fields (the ordinary path reports the rest).
        """
        rs = self.ranks.get(rank) if type(rank) is int else None
        if rs is None or type(step) is not int or type(end) not in (int, float):
            return
        if done:
            self.note_step(rs, step, end)  # what any step record says of its rank
            return
        if end > rs.last_t:
            rs.last_t = end
        if rs.first_step is None or step < rs.first_step:
            rs.first_step = step
        if rs.done_step < 0 and rs.max_coll_step < 0:
            self._busy(rs)
        if step > rs.max_coll_step:
            rs.max_coll_step = step

    def add_coll(self, rec: Record) -> Any:
        """File a ``coll`` record under its rank and step; return its ``end``.

        The hot path of the whole pipeline (most records are ``coll``): the
        record itself is filed, not a copy (in a big job, into its step's
        :class:`StepColumns` instead: see there), and only ``end`` (the clock) and
        the filing keys are checked here. The fields the summary reads are
        checked there, a whole step's columns at a time (:func:`_columns`),
        where a bad record is dropped alone and counted in ``malformed``.
        A record for a step already summarised is counted late and dropped;
        then the returned time is -inf (it moves no clock).
        """
        end = rec[_END]
        rank = rec[_RANK]
        rs = self.ranks.get(rank)
        if rs is not None:
            step = rec[_STEP]
            lst = rs.colls.get(step)
            if lst is not None:  # not its step's first record: just file it
                if end > rs.last_t:  # a number, or TypeError before anything is filed
                    rs.last_t = end
                if len(lst) < self._colls_cap:
                    if len(self.ranks) >= COLUMNAR_RANKS:
                        lst.append(_FILED)
                        self._file_columns(step, (rec,))
                    else:
                        lst.append(rec)
                else:
                    self.evicted["coll"] += 1
                    self._colls_done += 1
                return end
        end = self._add_first_coll(rec, end, rank)
        if end != -math.inf and len(self.ranks) >= COLUMNAR_RANKS:  # filed, in a big job
            self._file_columns(rec[_STEP], (rec,))
        return end

    def _cols_of(self, step: Any) -> StepColumns:
        cols = self._step_cols.get(step)
        if cols is None:
            cols = self._step_cols[step] = StepColumns()
        return cols

    def _file_columns(self, step: Any, recs: Sequence[Record]) -> None:
        """File ``recs`` (filed under their ranks as :data:`_FILED`) into their
        step's columns; when the columns cannot take them, the step's records
        are kept as records from then on (:meth:`_materialize`)."""
        cols = self._cols_of(step)
        if not cols.extend(recs):
            self._materialize(step, cols, recs)

    def _materialize(self, step: Any, cols: StepColumns, tail: Sequence[Record]) -> None:
        """Every :data:`_FILED` of ``step`` becomes its record again: rebuilt
        from the columns, then ``tail`` (the records filed since the columns
        last took any); the columns hold nothing more of the step."""
        rebuilt = cols.records(step)
        cols.drop()
        for rec in tail:
            rebuilt.setdefault(rec[_RANK], []).append(rec)
        for rank, recs in rebuilt.items():
            rs = self.ranks.get(rank)
            lst = rs.colls.get(step) if rs is not None else None
            if lst:
                _fill(lst, recs)

    def _restore(
        self,
        step: int,
        taken: Sequence[tuple[Any, Any, list[Record] | None]],
        filed: StepColumns | None,
    ) -> None:
        """The records of ``taken`` (a step's, already taken from their ranks)
        rebuilt from ``filed`` where they were filed as :data:`_FILED`."""
        if filed is None or not len(filed):
            return
        rebuilt = filed.records(step)
        for rs, _, colls in taken:
            if colls and rs.rank in rebuilt:
                _fill(colls, rebuilt[rs.rank])

    def add_coll_run(
        self,
        recs: Sequence[Record],
        i: int,
        bounds: tuple[float, float, float],
        now: float,
        gate: tuple[dict[Any, Any], dict[Any, Any], object] | None = None,
    ) -> tuple[int, float]:
        """:meth:`add_coll` for ``recs[i]``, ``recs[i + 1]``, ... while each is
        a ``coll`` record that takes its fast path; returns the index of the
        first record it left alone (untouched: the caller feeds it the
        ordinary way) and the stream clock ``now`` moved by the filed ones.

        The batch form of a replay's hot loop: one call files a run of
        records, where :meth:`Pipeline.feed` costs three calls a record. A
        record stays on the fast path when its rank is known (its step's
        first record or a late one included, room left under the cap) and ``bounds`` (the
        pipeline's time horizon, step limit and next tick) say no guard or
        tick is due: then filing it is exactly what ``feed`` would do.
        ``gate`` (a router's records by rank, by host pid, and the job): also
        the record must belong to that job. Anything else (a missing or
        ill-typed field too) stops the run before any change is made.
        """
        horizon, step_limit, tick = bounds
        by_rank, by_pid, job_of_run = gate if gate is not None else (None, None, None)
        ranks = self.ranks
        cap = self._colls_cap
        first = self._add_first_coll
        n = len(recs)
        start = i
        # In a job big enough to be summarised as columns, the run's filed
        # records go to their step's columns a stretch at a time (consecutive
        # filed records of one step), while hot.
        cols_on = len(ranks) >= COLUMNAR_RANKS
        mark = _FILED if cols_on else None  # what a record is filed as under its rank
        seg, seg_step = i, None
        try:
            for i in range(start, n):  # i: where the run stopped, at a break
                rec = recs[i]
                if rec.get(_KIND) != "coll":
                    break
                end = rec[_END]
                step = rec[_STEP]
                if end > horizon or step > step_limit or end >= tick:
                    break
                rank = rec[_RANK]
                if by_rank is not None:
                    pid = rec.get(_HOST_PID)
                    job = by_rank.get(rank) if pid is None else by_pid.get(pid)  # type: ignore[union-attr]
                    if job is not job_of_run:
                        break
                rs = ranks.get(rank)
                if rs is None:
                    break
                lst = rs.colls.get(step)
                if lst is None:
                    # Its step's first record (or a late one): what add_coll
                    # does with it, here rather than through feed (it raises,
                    # if at all, before it changes anything).
                    end = first(rec, end, rank)
                    if end == -math.inf and cols_on:  # late: not filed, so no column's
                        if seg_step is not None:
                            self._file_columns(seg_step, recs[seg:i])
                        seg, seg_step = i + 1, None
                        continue
                elif len(lst) < cap:
                    if end > rs.last_t:
                        rs.last_t = end
                    lst.append(mark or rec)
                else:
                    break
                if cols_on and step != seg_step:
                    if seg_step is not None:
                        self._file_columns(seg_step, recs[seg:i])
                    seg, seg_step = i, step
                    if step not in self._step_cols:
                        self._step_cols[step] = StepColumns()
                if end > now:
                    now = end  # made a float once, on the way out
            else:
                i = n
        except (KeyError, TypeError, AttributeError):
            pass  # the ordinary path says what is wrong with it
        if seg_step is not None:
            self._file_columns(seg_step, recs[seg:i])
        return i, float(now)

    def _add_first_coll(self, rec: Record, end: Any, rank: Any) -> Any:
        """:meth:`add_coll` for the first record of a (rank, step), or a late one."""
        step = rec[_STEP]
        # A summarised step's records are gone, so every late record comes here.
        if step <= self.summarised:
            self.late_records += 1
            self._colls_done += 1
            self.heard_late(rank, step, end, done=False)
            return -math.inf
        step = _as_index("step", step)
        rs = self.ranks.get(rank)
        if rs is None:
            rs = self.rank_of(_as_index("rank", rank))
        if end > rs.last_t:  # a number, or TypeError before anything is filed
            rs.last_t = end
        colls = rs.colls
        if len(colls) >= self.limits.max_pending_steps:
            oldest = min(colls)
            cols = self._step_cols.get(oldest)
            if cols is not None and cols.ok:
                # A rank's records leave the step's columns: the step is
                # summarised from its records (kept as records from now on).
                self._materialize(oldest, cols, ())
            n = len(colls.pop(oldest))
            self._unfile(oldest)
            self.evicted["coll"] += n
            self._colls_done += n
        if rs.max_coll_step < 0 and rs.done_step < 0:
            self._busy(rs)
        # A big job's record is filed into its step's columns by the caller.
        colls[step] = [_FILED if len(self.ranks) >= COLUMNAR_RANKS else rec]
        self._filed[step] = self._filed.get(step, 0) + 1
        if step > rs.max_coll_step:
            rs.max_coll_step = step
            if step > self.max_coll_step:
                self.max_coll_step = step
        if rs.first_step is None or step < rs.first_step:
            rs.first_step = step
        return end

    def coll_records(self) -> int:
        """``coll`` records filed (pending, summarised or dropped as late)."""
        pending = sum(len(lst) for rs in self.ranks.values() for lst in rs.colls.values())
        return self._colls_done + pending

    def local_rank(self, host: str, pid: int) -> int | None:
        """The rank of process ``pid`` on ``host`` (None when none announced it)."""
        return self._local_rank(host, pid)

    def _local_rank(self, host: str, pid: int) -> int | None:
        r = self._pid_rank.get((host, pid))
        if r is None:
            r = self._pid_only.get(pid)
        return r

    def _remote_rank(self, dst: str) -> int | None:
        r = self._endpoint_rank.get(dst)
        if r is None:
            r = self._addr_rank.get(_ip(dst))
        return r

    def _attribute(self, key: FlowKey, rec: Record) -> tuple[int, int] | None:
        """The ``(rank, peer)`` of a flow not in the cache, from the maps (then
        cached); None when it names no pair of the job's."""
        host, pid, src, dst = key
        rank = rec.get("rank")
        if rank is None:
            rank = self._local_rank(host, pid)
        if rank is None:
            return None
        self._remember_endpoint(src, rank)
        peer = rec.get("peer_rank")
        if peer is None:
            peer = self._remote_rank(dst)
        if peer is None or peer == rank:
            return None
        hit = (int(rank), int(peer))
        ws = self.world_size
        if ws is not None and not (0 <= hit[0] < ws and 0 <= hit[1] < ws):
            return None  # a rank outside the announced world: no pair of the job's
        if len(self._flow_slot) + len(self._flow_pair) >= self.limits.max_endpoints:
            self._forget_flows()  # a cache: refilled from the maps as flows come
        self._flow_pair[key] = hit
        self._peers.setdefault(hit[0], set()).add(hit[1])
        self._peers.setdefault(hit[1], set()).add(hit[0])
        self._live_peers = None
        return hit

    def _remember_endpoint(self, src: str, rank: int) -> None:
        eps = self._endpoint_rank
        if src not in eps and len(eps) >= self.limits.max_endpoints:
            # Full: the older half goes (dicts keep insertion order).
            gone = list(islice(eps, len(eps) // 2))
            for old in gone:
                del eps[old]
            self.evicted["endpoint"] += len(gone)
        eps[src] = rank

    def add_pending(self, rec: Record) -> None:
        """File a ``pending`` record: the rank's collective ``seq`` is still in flight.

        It does not count as the rank being heard from (``last_t``): a rank
        blocked in a collective is not carrying on, so the others' pending
        records must not make a quiet rank look left behind.
        """
        rank = _as_index("rank", rec["rank"])
        seq = _as_index("seq", rec["seq"])
        p = Pending(
            rank, seq, _as_index("step", rec["step"]), str(rec["op"]),
            float(rec["issue"]), float(rec["t"]),
        )  # fmt: skip
        rs = self.rank_of(rank)
        old = rs.pending.get(seq)
        if old is None or p.t >= old.t:
            rs.pending[seq] = p
        self._pending_ranks.add(rank)

    def heard_host(self, rec: Record) -> None:
        """A host's own probe record (``netdev``, ``flow``) arrived: note when.

        Per probe record, so kept to a few lookups; a time that is not a
        number raises TypeError here (the record counts as malformed).
        """
        self.heard_host_at(rec[_HOST], rec[_T], rec[_DT])

    def heard_host_at(self, host: Any, t: Any, dt: Any) -> None:
        """:meth:`heard_host` of a record's ``host``, ``t`` and ``dt``."""
        heard = self.hosts_heard
        h = heard.get(host)
        if h is None:
            if len(heard) >= self.limits.max_hosts:
                float(t)  # a bad time is still malformed, not an eviction
                self.evicted["host"] += 1
                return
            heard[str(host)] = [float(t), float(dt)]
        elif t > h[0]:
            h[0] = t
            h[1] = dt

    @property
    def pairs(self) -> PairMap:
        """Every directed pair's totals and live samples, by ``(rank, peer)``."""
        return self.flows.pairs

    def add_flow(self, rec: Record) -> tuple[int, int] | None:
        """File one flow sample; return the ``(rank, peer)`` it was attributed to, or None."""
        self.heard_host(rec)
        key = (rec["host"], rec["pid"], rec["src"], rec["dst"])
        slot = self._flow_slot.get(key)
        if slot is None:
            slot = self._pair_of(key, rec)
            if slot is None:
                return None
        dt = float(rec["dt"])
        self.flows.add(
            slot,
            rec["src"],
            (float(rec["t"]), dt, int(rec["tx_bytes"]), int(rec["rx_bytes"]),
             rec.get("srtt_us"), int(rec.get("retrans") or 0), rec.get("cwnd"),
             int(rec.get("dsack_dups") or 0)),
        )  # fmt: skip
        self.flow_dt = dt
        self._matrix = None
        return self.flows.key_of(slot)

    def add_flow_rows(
        self,
        keys: Sequence[FlowKey],
        times: Sequence[float],
        dts: Sequence[float],
        source: Mapping[str, np.ndarray],
        first: int,
        hosts: Sequence[tuple[str, float, float]] | None = None,
        slots: list[Any] | None = None,
    ) -> None:
        """File flow samples as :meth:`add_flow` files their records, in order:
        sample ``i`` is row ``first + i`` of ``source`` (the columns
        :meth:`PairStore.add_rows` takes), ``keys[i]`` its ``(host, pid, src,
        dst)``, ``times[i]`` and ``dts[i]`` its time and interval; no rank or
        peer named; ``slots``, when given, what :meth:`flow_slots` says of
        ``keys`` now. ``hosts``, when given: per host of the samples, in the
        order they first name it, the time and interval of its first sample
        of the newest time (all times numbers): what noting every sample's
        host in turn leaves (:meth:`heard_host_at`), when no host has to be
        evicted for it.

        A leader's round of a big job carries a flow sample a rank each
        second (``cluster.flowrows``): made from a round's columns, they are
        filed without a record, a dict or a conversion each.
        """
        heard = self.heard_host_at
        if slots is None:
            slots = self.flow_slots(keys)
        rows: Sequence[int] = range(first, first + len(slots))
        known = self.hosts_heard
        if None in slots:
            # A flow to attribute: a sample at a time (attributing one may
            # change the maps, or empty the cache, for the next).
            rows, slots = [], []
            for i, (key, t) in enumerate(zip(keys, times, strict=True)):
                heard(key[0], t, dts[i])
                slot = self._flow_slot.get(key)
                if slot is None:
                    slot = self._pair_of(key, _NO_RANKS)
                    if slot is None:
                        continue
                rows.append(first + i)
                slots.append(slot)
        elif hosts is not None and (
            not (new := sum(h not in known for h, _t, _dt in hosts))
            or len(known) + new <= self.limits.max_hosts  # none evicted
        ):
            for h, t, dt in hosts:  # each host once: as noting every sample leaves it
                heard(h, t, dt)
        else:
            for key, t, dt in zip(keys, times, dts, strict=True):
                heard(key[0], t, dt)
        if rows:
            self.flows.add_rows(source, rows, slots)
            self.flow_dt = float(dts[rows[-1] - first])
            self._matrix = None

    def flow_slots(self, keys: Sequence[FlowKey]) -> list[Any]:
        """Each flow's cached slot (None where it has none yet), as they stand
        at :attr:`flow_slots_version`."""
        return list(map(self._flow_slot.get, keys))

    def _pair_of(self, key: FlowKey, rec: Record) -> int | None:
        """The slot a flow files into when the cache has no slot for it (its pair
        made, and cached, when there is room); None when none (counted)."""
        hit = self._flow_pair.get(key)
        if hit is None:
            hit = self._attribute(key, rec)
            if hit is None:
                self.unattributed_flows += 1
                return None
        slot = self.flows.slots.get(hit)
        if slot is None:
            slot = self.flows.make(hit)
            if slot is None:
                self.evicted["pair"] += 1
                return None
        self._flow_pair.pop(key, None)
        self._flow_slot[key] = slot
        self.flow_slots_version += 1
        return slot

    def add_conn(self, rec: Record) -> None:
        host = rec["host"]
        pid = rec["pid"]
        src = rec["src"]
        dst = rec["dst"]
        what = rec["what"]
        local = self._local_rank(host, pid) if pid is not None else None
        if local is None:
            local = self._endpoint_rank.get(src)
        elif what == "open":
            self._remember_endpoint(src, local)
        remote = self._remote_rank(dst)
        if what not in ("close", "reset"):
            if local is not None and remote is not None and local != remote:
                self._peers.setdefault(local, set()).add(remote)
                self._peers.setdefault(remote, set()).add(local)
                self._live_peers = None
            return
        t = float(rec["t"])
        if local is not None and what == "close" and local not in self._self_closed:
            self._self_closed[local] = t
        if what == "reset":
            # Who reset whom: a reset received came from the remote end.
            direction = rec.get("direction")
            if direction == "received":
                resetter, victim = remote, local
            elif direction == "sent":
                resetter, victim = local, remote
            else:
                resetter = victim = None  # an older probe: no direction, no blame
            if resetter is not None and victim is not None and resetter != victim:
                self._reset_by.setdefault(resetter, set()).add(victim)
        for a, b in ((local, remote), (remote, local)):
            if a is None or b is None or a == b:
                continue
            torn = self._torn.setdefault(a, {})
            if b not in torn:
                torn[b] = t
            self._peers.setdefault(a, set()).add(b)
            self._live_peers = None

    def sweep(self, now: float) -> None:
        """Forget what has been quiet for ``limits.ttl_s`` of stream time:
        pairs with no sample since, hosts not heard from, ranks that only
        announced themselves (counted in :attr:`evicted`)."""
        horizon = now - self.limits.ttl_s
        stale = self.flows.sweep(horizon)
        if stale:
            # Flows cached to a pair now gone fall back to its (rank, peer):
            # their next sample makes a new pair.
            gone = dict(stale)
            for flow, slot in list(self._flow_slot.items()):
                if slot in gone:
                    del self._flow_slot[flow]
                    self._flow_pair[flow] = gone[slot]
            self.evicted["pair"] += len(stale)
            self._matrix = None
            self.flow_slots_version += 1
        for host in [h for h, v in self.hosts_heard.items() if v[0] < horizon]:
            del self.hosts_heard[host]
            self.evicted["host"] += 1
        for rank in [r for r in self._idle if self.ranks[r].last_t < horizon]:
            self.forget_rank(rank)

    def mark_lost(self, rank: int) -> None:
        """The detector declared ``rank`` lost: no step waits for it from now on."""
        self.rank_of(rank).lost = True

    def revive(self, rank: int) -> None:
        """A lost rank is heard from again: steps wait for it, its torn connections are forgotten."""
        self.held_liveness = None  # its liveness figures change
        self.rank_of(rank).lost = False
        self._torn.pop(rank, None)
        self._self_closed.pop(rank, None)
        self._reset_by.pop(rank, None)
        for torn in self._torn.values():
            torn.pop(rank, None)

    # ------------------------------------------------------------ per step

    def expected(self, step: int, lag: int = 2) -> int:
        """How many ranks should report ``step``: live ones that had started by
        then and have not fallen more than ``lag`` steps silent (a stray
        emitter, or a rank about to be declared lost, holds nobody back)."""
        if len(self.ranks) >= COLUMNAR_RANKS:
            return self._expected_columns(step, lag)
        expects = self._expects
        return sum(1 for rs in self.ranks.values() if expects(rs, step, lag))

    def _expected_columns(self, step: int, lag: int) -> int:
        """:meth:`expected` for a big job: each figure read into an array once
        (a pass per figure in C), compared as columns."""
        states = self._in_order()[1]
        n = len(states)
        firsts = list(map(_FIRST_STEP, states))
        if None in firsts:  # not started: counted as starting after this step
            firsts = [step + 1 if f is None else f for f in firsts]
        try:
            first = np.array(firsts, dtype=np.int64)
            newest = np.maximum(
                np.fromiter(map(_DONE_STEP, states), np.int64, n),
                np.fromiter(map(_MAX_COLL_STEP, states), np.int64, n),
            )
        except OverflowError:  # a step past int64: a rank at a time
            return sum(1 for rs in states if self._expects(rs, step, lag))
        lost = np.fromiter(map(_LOST, states), bool, n)
        return int(np.count_nonzero(~lost & (first <= step) & (newest >= step - lag)))

    @staticmethod
    def _expects(rs: _Rank, step: int, lag: int) -> bool:
        if rs.lost or rs.first_step is None or rs.first_step > step:
            return False
        return max(rs.done_step, rs.max_coll_step) >= step - lag

    def reported(self, step: int) -> int:
        """How many ranks have a step record for ``step`` filed."""
        return self._reports.get(step, 0)

    def reported_steps(self) -> list[int]:
        """Steps not yet summarised that some rank has a step record filed for, oldest first."""
        return sorted(self._reports)

    def step_summary(self, step: int, now: float) -> Summary:
        """Summarise ``step`` across ranks and forget its records."""
        if step > self.summarised:
            self.summarised = step
        taken: list[tuple[_Rank, Record | None, list[Record] | None]] = []
        filed = self._step_cols.pop(step, None)
        unfiled = colls_done = 0
        for rs in self._in_order()[1]:
            srec = rs.steps.pop(step, None)
            colls = rs.colls.pop(step, None)
            if srec is not None:
                unfiled += 1
            if colls is not None:
                unfiled += 1
                colls_done += len(colls)
            if srec is None and not colls:
                continue
            taken.append((rs, srec, colls))
        self._colls_done += colls_done
        if unfiled:
            self._unfile(step, unfiled)
        out: Sequence[RankStep] | None = None
        if len(taken) >= COLUMNAR_RANKS and filed:
            out = self._rank_steps_columnar(taken, filed)
        if out is None:
            self._restore(step, taken, filed)
            out = self._rank_steps(taken)
        # Anything older than this step that is still filed arrived too late
        # (``_filed`` says whether any rank holds such a step: usually none,
        # and then no pass over every rank).
        reports = self._reports
        for old in [s for s in reports if s <= step]:
            del reports[old]
        if not self._filed or min(self._filed) >= step:
            return self._summary(now, step, out)
        for rs in self.ranks.values():
            if rs.steps and min(rs.steps) < step:
                for old in [s for s in rs.steps if s < step]:
                    del rs.steps[old]
                    self._unfile(old)
                    self.late_records += 1
            if rs.colls and min(rs.colls) < step:
                for old in [s for s in rs.colls if s < step]:
                    n = len(rs.colls.pop(old))
                    self._unfile(old)
                    self.late_records += n
                    self._colls_done += n
        return self._summary(now, step, out)

    def _rank_steps(
        self, taken: list[tuple[_Rank, Record | None, list[Record] | None]]
    ) -> tuple[RankStep, ...]:
        """Each rank's :class:`RankStep` of one step, one rank at a time."""
        self._fold_totals()  # its totals are added a rank at a time too
        # Each rank's collectives become columns (keys, issue, end, wait) in a
        # few C-level passes; lateness needs, per collective, the longest and
        # shortest wait in its group (the same key on every member).
        per_rank = [
            (rs, srec, self._columns(colls) if colls else None) for rs, srec, colls in taken
        ]
        # Usually every rank reported the same collectives in the same order:
        # then the groups are the columns, no dict needed; otherwise file each
        # wait under its key.
        with_colls = [c for _, _, c in per_rank if c is not None]
        keys0 = with_colls[0].keys if with_colls else None
        columns: tuple[float, list[float]] | None = None
        span: dict[Any, tuple[float, float]] = {}
        if len(with_colls) >= 2 and all(c.keys == keys0 for c in with_colls):
            by_coll = list(zip(*[c.waits for c in with_colls], strict=True))
            longest = list(map(max, by_coll))
            # Lateness = sum(longest wait - own wait) = sum(longest) - sum(own).
            columns = (reduce(add, longest, 0.0), list(map(min, by_coll)))
        else:
            waits_of: dict[Any, list[float]] = {}
            for c in with_colls:
                for key, w in zip(c.keys, c.waits, strict=True):
                    lst = waits_of.get(key)
                    if lst is None:
                        waits_of[key] = [w]
                    else:
                        lst.append(w)
            span = {k: (max(v), min(v)) for k, v in waits_of.items() if len(v) >= 2}
        out: list[RankStep] = []
        for rs, srec, cols in per_rank:
            late = 0.0
            matched = last = 0
            wait = 0.0
            n_coll = 0
            if cols is not None:
                waits = cols.waits
                n_coll = len(waits)
                if columns is not None:
                    late = max(0.0, columns[0] - cols.total_wait)
                    last = sum(map(le, waits, columns[1]))
                    matched = n_coll
                else:
                    for key, w in zip(cols.keys, waits, strict=True):
                        hit = span.get(key)
                        if hit is not None:
                            late += hit[0] - w
                            matched += 1
                            if w <= hit[1]:
                                last += 1
                wait = _blocked(cols)
                rs.add_ops(cols, self.limits.max_ops, self.evicted)
                # Its newest seq is read only when a stall is judged: keep the
                # keys (one store per rank and step), not their maximum.
                rs.keys_done = cols.keys
            step_s: float | None = None
            compute: float | None = None
            if srec is not None:
                step_s = srec["end"] - srec["start"]
                compute = max(0.0, step_s - wait)
                rs.add_step_time(step_s, wait)
            rstep = RankStep(
                rs.rank,
                step_s,
                wait,
                compute,
                late,
                (last / matched) if matched else 0.0,
                matched,
                n_coll,
            )
            rs.last = rstep
            out.append(rstep)
        return tuple(out)

    def _rank_steps_columnar(
        self,
        taken: list[tuple[_Rank, Record | None, list[Record] | None]],
        filed: StepColumns,
    ) -> StepRanks | None:
        """:meth:`_rank_steps` for a step of many ranks, as columns (:class:`StepRanks`),
        from its :class:`StepColumns` (``filed``), when every rank with collectives
        reported the same ones in the same order (FSDP's usual step); None otherwise.

        The same figures to the last bit as the scalar path for the trace
        format's records (times read as floats): the waits are the same
        subtractions, each rank's total wait and the longest waits are summed
        left to right as :func:`coll_columns` and the scalar path sum them, and
        every ``max(0.0, x)`` keeps the scalar path's choice of zero.
        """
        with_colls = [(rs, c) for rs, _, c in taken if c]
        n_ranks = len(with_colls)
        if n_ranks < 2 or not filed.ok or len(filed) != sum(len(c) for _, c in with_colls):
            return None  # a rank's records evicted, or a field unfit for its column
        n, rem = divmod(len(filed), n_ranks)
        if rem:
            return None
        ids = np.frombuffer(filed.rank, dtype=np.int64)
        # Rank by rank, each rank's records in filing order (its own list's order).
        order = np.argsort(ids, kind="stable")
        by_rank = ids[order].reshape(n_ranks, n)
        want = np.array([rs.rank for rs, _ in with_colls])
        if not (by_rank == want[:, None]).all():
            return None  # some rank sent more collectives than another

        def rows(col: array) -> np.ndarray:  # type: ignore[type-arg]
            a = np.frombuffer(col, dtype=np.int64 if col.typecode == "q" else np.float64)
            return a[order].reshape(n_ranks, n)

        seq_m, op_m, bytes_m, group_m = (
            rows(filed.seq),
            rows(filed.op),
            rows(filed.nbytes),
            rows(filed.group),
        )
        if not ((seq_m == seq_m[0]).all() and (group_m == group_m[0]).all()):
            return None  # not the same collectives
        names = list(filed.names)  # index -> value
        seq0 = seq_m[0].tolist()
        groups0 = [names[g] for g in group_m[0].tolist()]
        keys: Sequence[Any]
        if all(g is _NO_GROUP for g in groups0):
            keys = tuple(seq0)
        elif all(type(g) is str for g in groups0):
            keys = [(g, q) for g, q in zip(groups0, seq0, strict=True)]
        else:
            return None  # some name a group and some not, or not as a string
        if len(set(keys)) != n:
            return None  # a datagram delivered twice: the scalar path drops the copy
        ops0 = [names[o] for o in op_m[0].tolist()]
        if not all(type(o) is str for o in ops0):
            return None
        same_ops = bool((op_m == op_m[0]).all() and (bytes_m == bytes_m[0]).all())
        issue = rows(filed.issue)
        end = rows(filed.end)
        waits = end - issue
        total = np.zeros(n_ranks)
        for j in range(n):  # left to right, as reduce(add, waits, 0.0)
            total += waits[:, j]
        shortest = waits.min(axis=0)
        top = reduce(add, waits.max(axis=0).tolist(), 0.0)
        late = top - total
        late = np.where(late > 0.0, late, 0.0)
        last_frac = (waits <= shortest).sum(axis=1) / n
        # Time blocked: the plain sum when the collectives ran one after another
        # (the usual case), else the union of their intervals (blocked_s).
        serial = waits.min(axis=1) >= 0.0
        if n > 1:
            serial &= (issue[:, 1:] > end[:, :-1]).all(axis=1)
        blocked = total.copy()
        for i in np.flatnonzero(~serial).tolist():
            blocked[i] = _merged_length(list(zip(issue[i].tolist(), end[i].tolist(), strict=True)))
        # The columns of every rank in rank order: ranks without collectives
        # (a step record alone) between them.
        count = len(taken)
        states = [rs for rs, _, _ in taken]
        srecs = [srec for _, srec, _ in taken]
        ci = np.flatnonzero(np.fromiter((bool(c) for _, _, c in taken), bool, count))
        si = np.flatnonzero(np.fromiter((x is not None for x in srecs), bool, count))
        # srec["end"] - srec["start"], as the scalar path subtracts them.
        timed: list[Record] = [srecs[k] for k in si.tolist()]  # type: ignore[misc]
        step_s = np.fromiter(map(sub, map(_END_OF, timed), map(_START_OF, timed)), F64, len(si))
        wait_out = np.zeros(count)
        wait_out[ci] = blocked
        late_out = np.zeros(count)
        late_out[ci] = late
        frac_out = np.zeros(count)
        frac_out[ci] = last_frac
        ncoll_out = np.zeros(count, dtype=np.int64)
        ncoll_out[ci] = n
        step_out = np.full(count, math.nan)
        step_out[si] = step_s
        compute_out = np.full(count, math.nan)
        x = step_s - wait_out[si]
        compute_out[si] = np.where(x > 0.0, x, 0.0)  # max(0.0, x)
        ranks_out = np.fromiter(map(_RANK_ATTR, states), np.int64, count)
        out = StepRanks(
            ranks_out,
            step_out,
            wait_out,
            compute_out,
            late_out,
            frac_out,
            ncoll_out.copy(),
            ncoll_out,
        )
        # Per-op totals: one plan for every rank when they all issued the same ops.
        plan = _op_plan(ops0, bytes_m[0].tolist()) if same_ops else None
        op_secs: list[np.ndarray] = []
        if plan is not None:
            for _key, _cnt, _b, pick, _at in plan.per_op:
                if pick is None:
                    op_secs.append(total)
                    continue
                acc = np.zeros(n_ranks)  # left to right from zero, as sum(picked)
                for j in _at:
                    acc += waits[:, j]
                op_secs.append(acc)
        got = None
        if plan is not None and np.isfinite(waits).all() and np.isfinite(step_s).all():
            got = self._totals_for(ranks_out)
        if got is not None and got[0].fits_ops(plan):
            tot, at = got
            tot.add_ops(at[ci], plan, op_secs, waits)
            tot.add_steps(at[si], step_s, wait_out[si])
            tot.set_newest(at, out, keys, at[ci])
            return out
        # A rank at a time: ops differ between ranks, or a figure the columns
        # cannot add up exactly.
        self._fold_totals()
        max_ops, evicted = self.limits.max_ops, self.evicted
        wait_rows = waits.tolist()
        secs_rows = [a.tolist() for a in op_secs]
        total_l = total.tolist()
        issue_rows, end_rows = issue.tolist(), end.tolist()
        step_l, wait_l = step_out.tolist(), wait_out.tolist()
        i = 0  # row of the next rank with collectives
        for k, (rs, srec, colls) in enumerate(taken):
            if colls:
                if plan is not None:
                    rs.add_op_sums(plan, wait_rows[i], [s[i] for s in secs_rows], max_ops, evicted)
                else:
                    rs.add_ops(
                        CollColumns(
                            keys, issue_rows[i], end_rows[i], wait_rows[i], total_l[i],
                            [names[o] for o in op_m[i].tolist()], bytes_m[i].tolist(),
                        ),
                        max_ops,
                        evicted,
                    )  # fmt: skip
                rs.keys_done = keys
                i += 1
            if srec is not None:
                rs.add_step_time(step_l[k], wait_l[k])
            rs.last = (out, k)
        return out

    def _totals_for(self, ranks: np.ndarray) -> tuple[RankTotals, np.ndarray] | None:
        """The job's totals as columns and the rows of ``ranks`` in them (made, or
        made again with a rank they lack, from each rank's own fields)."""
        tot = self._totals
        if tot is not None:
            rows = tot.rows_of(ranks)
            if rows is not None:
                return tot, rows
            self._fold_totals()
        try:
            tot = RankTotals(self._in_order()[1], self.limits.max_ops)
        except OverflowError:
            return None  # a total past int64: added a rank at a time
        rows = tot.rows_of(ranks)
        if rows is None:
            return None
        self._totals = tot
        return tot, rows

    def sync_totals(self) -> None:
        """Make every rank's own totals current (read by the snapshot)."""
        if self._totals is not None:
            self._totals.sync()

    def _fold_totals(self) -> None:
        """Back to adding up a rank at a time: the columns' totals go to the ranks."""
        if self._totals is not None:
            self._totals.sync()
            self._totals = None

    def _columns(self, colls: list[Record]) -> _Columns | None:
        """``colls`` as columns; records with a missing or ill-typed field dropped."""
        cols, bad = step_columns(colls)
        self.malformed += bad
        return cols

    def tick_summary(self, now: float) -> Summary:
        summary = self._summary(now, None, ())
        # Only a rank waiting in a collective can make a stall: otherwise the
        # rules have nothing to judge, and the view is not built.
        if self._pending_ranks:
            summary = summary._replace(stall=self.stall())
        return summary

    def newest_seq(self, rs: _Rank) -> int:
        """The newest ``seq`` ``rs`` completed: summarised or still filed."""
        if rs.keys_done:
            rs.seq_done = max(rs.seq_done, _top_seq(rs.keys_done))
            rs.keys_done = ()
        top = rs.seq_done
        for step, lst in rs.colls.items():
            for c in lst:
                seq: Any
                if c is _FILED:  # in its step's columns
                    cols = self._step_cols.get(step)
                    seq = cols.top_seqs().get(rs.rank, -1) if cols is not None else -1
                else:
                    seq = c.get("seq")
                if type(seq) is int and seq > top:
                    top = seq
        return top

    def stall(self, keep_s: float = 30.0) -> Stall:
        """The liveness rules' view (:class:`Stall`); forgets pending records
        of completed collectives and those older than ``keep_s`` seconds."""
        pending: list[Pending] = []
        newest: list[tuple[int, int]] = []
        self.sync_totals()  # each rank's newest keys (newest_seq)
        for rank in sorted(self.ranks):
            rs = self.ranks[rank]
            done = self.newest_seq(rs)
            top = done
            if rs.pending:
                latest = max(p.t for p in rs.pending.values())
                for seq in [q for q, p in rs.pending.items() if q <= done or p.t < latest - keep_s]:
                    del rs.pending[seq]
                if rs.pending:
                    pending.append(rs.pending[min(rs.pending)])
                    top = max(top, max(rs.pending))
                else:
                    self._pending_ranks.discard(rank)
            newest.append((rank, top))
        heard = tuple((h, v[0], v[1]) for h, v in sorted(self.hosts_heard.items()))
        retrans: list[tuple[int, int, int]] = []
        delivered: list[tuple[int, int, int]] = []
        if pending:
            # Only samples wholly inside the stall: retransmits of the moments
            # before it are the ordinary kind. Bytes read once the first
            # resending sample is over: those read during it may be the last
            # that crossed before a cut (a peer's in-flight window arrives
            # within a round trip, the first resend comes an RTO, >= 200 ms,
            # later). Another host's polls may lag this one's by up to half an
            # interval. Nothing resent: no pass.
            retrans, delivered = self.flows.stall_figures(min(p.issue for p in pending))
        return Stall(tuple(pending), tuple(newest), heard, tuple(retrans), tuple(delivered))

    # ------------------------------------------------------------ views

    def _summary(self, now: float, step: int | None, ranks: Sequence[RankStep]) -> Summary:
        return Summary(
            t=now,
            step=step,
            ranks=ranks,
            flows=self.flow_matrix(now) if step is not None else (),
            liveness=self.liveness() if self.held_liveness is None else self.held_liveness,
            job_done=self.job_done,
            mid_step=self.max_coll_step > self.job_done,
        )

    def drop_flows_before(self, t: float) -> None:
        """From now on a flow sample counts only if its interval began at ``t`` or later.

        A polled srtt is the socket's smoothed RTT at the poll, so a sample whose
        interval overlaps a new attempt's warm-up (fresh connections in slow
        start, a checkpoint being loaded) still carries it."""
        self._flow_floor = t
        self._matrix = None

    def flow_matrix(self, now: float) -> Sequence[PairFlow]:
        """Each directed pair's figures over the latest ``flow_window_s`` seconds, by
        key: a tuple of ``PairFlow``, or a leader's
        :class:`~fsdp_sentinel.flowstore.FlowMatrix`; ``()`` when no pair has a
        sample."""
        horizon = now - self.flow_window_s
        # Steps come faster than flow samples: while no sample arrived and none
        # aged out, the matrix is the one already built (the very same object,
        # which also lets the detector reuse what it derived from it).
        if self._matrix is not None and horizon <= self._matrix_oldest:
            return self._matrix
        matrix, oldest = self.flows.matrix(horizon, self._flow_floor)
        self._matrix = matrix if len(matrix) else ()
        self._matrix_oldest = oldest
        return self._matrix

    def liveness(self) -> Sequence[RankLiveness]:
        """Every rank's :class:`RankLiveness`, in rank order: a tuple, or for a job of
        ``COLUMNAR_RANKS`` ranks or more :class:`LivenessColumns`."""
        if len(self.ranks) >= COLUMNAR_RANKS:
            return self._liveness_columns()
        out = []
        ranks, torn_of, peers_of, closed = self.ranks, self._torn, self._peers, self._self_closed
        reset_by = self._reset_by
        for rank in sorted(ranks):
            rs = ranks[rank]
            torn = torn_of.get(rank)
            peers = peers_of.get(rank)
            out.append(
                RankLiveness(
                    rank,
                    rs.host,
                    rs.last_t,
                    rs.done_step,
                    len(torn) if torn else 0,
                    len(peers) if peers else 0,
                    min(torn.values()) if torn else None,
                    rank in closed,
                    len(reset_by.get(rank, ())),
                    max(p.t for p in rs.pending.values()) if rs.pending else 0.0,
                )
            )
        return tuple(out)

    def _liveness_columns(self) -> LivenessColumns:
        """:meth:`liveness` as columns: the same figures, a generator pass per
        column over the ranks instead of a tuple made per rank."""
        ranks = self.ranks
        # What changes only when ranks come, go or announce themselves (the
        # order, each rank's state and host) or a pair appears (peer counts)
        # is kept between calls; the rest is read afresh.
        rank_col, states, hosts = self._in_order()
        n = len(states)
        if self._live_peers is None:
            peers_of = self._peers
            self._live_peers = np.fromiter(
                (len(peers_of.get(r, ())) for r in rank_col.tolist()), np.int64, n
            )
        pending_t = np.zeros(n)
        if self._pending_ranks:  # every rank with pending records (see add_pending)
            for r in self._pending_ranks:
                rs = ranks.get(r)
                if rs is not None and rs.pending:
                    pending_t[row_of(rank_col, r)] = max(p.t for p in rs.pending.values())
        torn = {r: (len(t), min(t.values())) for r, t in self._torn.items() if t and r in ranks}
        last_t, done_step = self._progress_of(states)
        return LivenessColumns(
            rank_col,
            hosts,
            last_t,
            done_step,
            pending_t,
            self._live_peers,
            torn,
            frozenset(r for r in self._self_closed if r in ranks),
            {r: len(v) for r, v in self._reset_by.items() if v and r in ranks},
        )

    def _progress_of(self, states: list[_Rank]) -> tuple[np.ndarray, np.ndarray]:
        """Each of ``states``' last heard time and newest step done, as arrays (a
        pass in C a figure)."""
        n = len(states)
        return (
            np.fromiter(map(_LAST_T, states), np.float64, n),
            np.fromiter(map(_DONE_STEP, states), np.int64, n),
        )

    def _in_order(self) -> tuple[np.ndarray, list[_Rank], list[str]]:
        """Every rank, its state and host, in rank order (kept until a rank
        comes, goes or announces itself)."""
        if self._live is None:
            ranks = self.ranks
            order = sorted(ranks)
            states = [ranks[r] for r in order]
            self._live = (np.array(order, dtype=np.int64), states, [rs.host for rs in states])
            self._live_peers = None
        return self._live

    def malformed_total(self) -> int:
        """Coll records dropped at summary time, plus bad op/bytes fields met
        when adding up the per-op totals."""
        bad = sum(rs.bad_fields for rs in self.ranks.values())
        tot = self._totals
        if tot is not None:  # the held ranks' own counts are a copy: the columns' instead
            bad += int(tot.bad.sum()) - sum(rs.bad_fields for rs in tot.states)
        return self.malformed + bad

    def pending_steps(self) -> list[int]:
        """Steps some rank has step or coll records filed for, oldest first."""
        return sorted(self._filed)

    def _unfile(self, step: int, gone: int = 1) -> None:
        """``gone`` (rank, step) filings of ``step`` are gone (summarised or dropped)."""
        n = self._filed[step] - gone
        if n:
            self._filed[step] = n
        else:
            del self._filed[step]
            self._step_cols.pop(step, None)
