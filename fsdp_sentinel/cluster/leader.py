"""The leader: every node's windows in, the job's verdicts out; and who leads (pure).

:class:`LeaderDetector` runs the very :class:`~fsdp_sentinel.pipeline.Pipeline`
a single daemon runs, with one difference: its correlator
(:class:`LeaderCorrelator`) has no ``coll`` records, and takes each rank's
collective figures from the nodes' step digests instead
(:func:`~fsdp_sentinel.cluster.summary.rank_steps`). Everything else reaches
it as records (``rank``, ``step``, ``flow``, ``conn``, ``pending``), so it
attributes flows to ``(rank, peer)`` across nodes by their endpoints just as
one daemon does, and the pure ``detect()`` sees the same summaries: the same
verdicts, a slow link between two nodes told from a slow node.

A node whose daemon stopped publishing is *dark* (:meth:`LeaderDetector.set_dark`):
its ranks and hosts are left out of liveness (a daemon gone says nothing
about its ranks, so they are not called lost), and steps stop waiting for them.

:func:`leader_of` is the election every node computes alike from the same
store contents: the first node in roster order (by the lowest rank it holds,
so rank 0's node leads) that is not dark.
"""

from __future__ import annotations

import gc
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from fsdp_sentinel.cluster.flowrows import FlowTable, flow_table, sample_columns
from fsdp_sentinel.cluster.rankcols import ColumnRank, ProgressColumns, slots_of
from fsdp_sentinel.cluster.summary import (
    Round,
    StepDigest,
    Window,
    group_top_seqs,
    join_digests,
    newest_end,
    rank_steps,
)
from fsdp_sentinel.cluster.summary import decode_round as summary_decode_round
from fsdp_sentinel.correlate import (
    Correlator,
    FlowKey,
    LivenessColumns,
    RankLiveness,
    StateLimits,
    Summary,
)
from fsdp_sentinel.detect import DetectConfig
from fsdp_sentinel.fabric import FabricTotals
from fsdp_sentinel.flowstore import TableStore, run_bounds
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.rankstep import StepRanks, none_if_nan
from fsdp_sentinel.trace import record_time

Record = dict[str, Any]

#: The leader's caps: it keeps every rank of the job (the single daemon's
#: defaults stop at 4,096 ranks and hosts), up to 131,072, and a flow matrix
#: of 16 peers a rank.
LEADER_LIMITS = StateLimits(
    max_ranks=1 << 17, max_hosts=1 << 17, max_pairs=1 << 21, max_endpoints=1 << 21
)


class _KnownRanks(NamedTuple):
    """The states of one digest's ranks (``LeaderCorrelator._digest_states``): its
    ranks' bytes, the rank evictions counted when they were looked up, the
    states and their progress slots."""

    key: bytes | None
    evicted: int
    states: list[Any]
    slots: np.ndarray


def _ints(col: Sequence[int]) -> np.ndarray:
    """A digest's int column as an array (a decoded one's buffer, not copied)."""
    return np.frombuffer(col, dtype=col.typecode) if type(col) is array else np.asarray(col)


class LeaderCorrelator(Correlator):
    """A :class:`Correlator` fed step digests instead of ``coll`` and ``step`` records.

    A node's digest of a step reaches it as one ``step`` record that carries
    the digest (``digest``: see :meth:`LeaderDetector.ingest`): its ranks'
    step times are filed together, and the step summary is built from the
    digests' columns (:func:`~fsdp_sentinel.cluster.summary.rank_steps`), so
    no per-rank record, dict or column is made for them. The leader's own
    per-rank totals (the snapshot's) are not kept: each node daemon exports
    its own ranks.
    """

    def __init__(self, flow_window_s: float = 3.0, limits: StateLimits | None = None) -> None:
        # A sample a rank every probe interval: filed as rows of one table.
        super().__init__(flow_window_s, limits=limits or LEADER_LIMITS, store=TableStore)
        self.digests: dict[int, list[StepDigest]] = {}
        self.step_filed: dict[int, set[int]] = {}  # step -> ranks whose step record is filed
        # Every rank's progress figures as columns (cluster.rankcols), and the
        # newest seq of a rank forgotten (kept as the columns cannot).
        self.progress = ProgressColumns()
        self._forgotten_seq: dict[int, int] = {}
        # The states of the last digest's ranks (_digest_states); most rounds
        # name the same ranks, so the same list serves again.
        self._known: _KnownRanks | None = None
        # _progress_of's last states list and their slots
        self._live_slots: tuple[list[Any], np.ndarray] | None = None
        self.dark_ranks: frozenset[int] = frozenset()
        self.dark_hosts: frozenset[str] = frozenset()

    def add_digest(self, d: StepDigest) -> None:
        if d.step <= self.summarised:
            self.late_records += sum(d.n_coll)
            return
        self.digests.setdefault(d.step, []).append(d)
        self.malformed += d.malformed
        step = d.step
        slots = self._digest_states(d).slots
        cols = self.progress
        cols.first_step[slots] = np.minimum(cols.first_step[slots], step)
        # Ranks with collectives: their newest step and seq (a group's seq is
        # every member's: they issued the same keys).
        has = _ints(d.n_coll) != 0
        if not has.any():
            return
        every = bool(has.all())
        busy = slots if every else slots[has]
        cols.max_coll_step[busy] = np.maximum(cols.max_coll_step[busy], step)
        if step > self.max_coll_step:
            self.max_coll_step = step
        tops = np.asarray(group_top_seqs(d), dtype=np.int64)
        group = _ints(d.group)
        # at: a rank may be named twice (a node in error): each seq counts
        np.maximum.at(cols.top_seq, busy, tops[group if every else group[has]])

    def _digest_states(self, d: StepDigest) -> _KnownRanks:
        """The states of ``d``'s ranks, in order (made for any not yet known): the
        last digest's list again when ``d`` names the same ranks and no rank has
        been replaced since (a rank's state is only ever replaced by forgetting
        it, which counts an eviction)."""
        ranks = d.ranks
        key = ranks.tobytes() if type(ranks) is array else None
        evicted = self.evicted["rank"]
        known = self._known
        if (key is not None and known is not None and known.evicted == evicted
                and known.key == key):  # fmt: skip
            return known
        # The evictions before the lookup: one it makes (an idle rank dropped to
        # make room) leaves the list unfit to serve again.
        states = self._states(ranks)
        known = _KnownRanks(key, evicted, states, slots_of(states, self.progress))
        if key is not None:
            self._known = known
        return known

    def _states(self, ranks: Iterable[int]) -> list[Any]:
        """The states of ``ranks`` (made for any not yet known), in order."""
        states = list(map(self.ranks.get, ranks))
        if None in states:
            states = [rs or self.rank_of(r) for r, rs in zip(ranks, states, strict=True)]
        return states

    def add_step(self, rec: Record) -> tuple[Any, int]:
        """A ``step`` record; one that carries a digest files all its ranks' at once."""
        d: StepDigest | None = rec.get("digest")
        if d is None:
            return super().add_step(rec)
        step = d.step
        filed = self.step_filed.setdefault(step, set())
        before = len(filed)
        ranks, states = self.note_digest(d)
        filed.update(ranks)
        rs: Any = states[-1] if states else None
        if len(filed) > before:
            self._reports[step] = self._reports.get(step, 0) + len(filed) - before
        return rs, step

    def note_digest(self, d: StepDigest) -> tuple[Sequence[int], list[Any]]:
        """:meth:`~Correlator.note_steps` for every step record in ``d``, over the
        progress columns; their ranks, and those ranks' states."""
        end = np.asarray(d.end, dtype=np.float64)
        timed = end == end  # NaN: no step record
        known = self._digest_states(d)
        if timed.all():
            ranks, states, slots = d.ranks, known.states, known.slots
        else:
            at = np.flatnonzero(timed)
            ranks = np.asarray(d.ranks)[at].tolist()
            states, slots, end = [known.states[i] for i in at.tolist()], known.slots[at], end[at]
        if not len(slots):
            return ranks, states
        step = d.step
        cols = self.progress
        np.maximum.at(cols.last_t, slots, end)  # at: a rank named twice keeps its newest
        cols.first_step[slots] = np.minimum(cols.first_step[slots], step)
        done = cols.done_step[slots]
        # A rank's first step done: it is no longer idle (Correlator.note_steps).
        for i in np.flatnonzero(done < 0).tolist() if step >= 0 else ():
            self._busy(states[i])
        cols.done_step[slots] = np.maximum(done, step)
        if step > self.job_done:
            self.job_done = step
        return ranks, states

    def add_progress(self, rank: int, last_t: float, coll_step: int, top_seq: int) -> None:
        """A node's word on its rank: last heard, newest step and seq with collectives."""
        rs: Any = self.rank_of(rank)  # a ColumnRank (_new_rank)
        if last_t > rs.last_t:
            rs.last_t = last_t
        if coll_step > rs.max_coll_step:
            rs.max_coll_step = coll_step
            if coll_step > self.max_coll_step:
                self.max_coll_step = coll_step
        if top_seq > rs.top_seq:
            rs.top_seq = top_seq

    def pending_steps(self) -> list[int]:
        return sorted(set(super().pending_steps()) | set(self.digests) | set(self.step_filed))

    def step_summary(self, step: int, now: float) -> Summary:
        if step > self.summarised:
            self.summarised = step
        digests = self.digests.pop(step, [])
        self.step_filed.pop(step, None)
        # Anything older than this step that is still filed arrived too late.
        reports = self._reports
        for old in [s for s in reports if s <= step]:
            del reports[old]
        for old in [s for s in self.step_filed if s < step]:
            self.late_records += len(self.step_filed.pop(old))
        for old in [s for s in self.digests if s < step]:
            self.late_records += sum(sum(d.n_coll) for d in self.digests.pop(old))
        out = rank_steps(digests)
        if isinstance(out, StepRanks) and self._add_columns(out):
            return self._summary(now, step, out)
        self._fold_totals()
        ranks = self.ranks
        rows: Iterable[tuple[int, float | None, float, Any]]
        if isinstance(out, StepRanks):
            rows = zip(
                out.rank.tolist(),
                map(none_if_nan, out.step_s.tolist()),  # NaN: no step record
                out.wait_s.tolist(),
                ((out, k) for k in range(len(out))),  # read as a RankStep when asked
                strict=True,
            )
        else:
            rows = ((r.rank, r.step_s, r.wait_s, r) for r in out)
        for r, st, w, last in rows:
            rs = ranks[r]
            rs.last = last
            if st is not None:
                rs.steps_total += 1
                rs.step_seconds_total += st
                rs.wait_seconds_total += min(w, st)
        return self._summary(now, step, out)

    def _add_columns(self, out: StepRanks) -> bool:
        """A big step's figures added to the job's totals as columns
        (:mod:`fsdp_sentinel.ranktotals`): no pass over its ranks. False when
        the columns cannot take them exactly (added a rank at a time then)."""
        timed = out.step_s == out.step_s  # NaN: no step record
        st, w = out.step_s[timed], out.wait_s[timed]
        if not (np.isfinite(st).all() and np.isfinite(w).all()):
            return False
        got = self._totals_for(out.rank)
        if got is None:
            return False
        tot, at = got
        # The leader keeps no histograms: each node daemon exports its own ranks.
        tot.add_steps(at[timed], st, w, histogram=False)
        tot.set_newest(at, out)
        return True

    def newest_seq(self, rs: Any) -> int:
        return max(super().newest_seq(rs), rs.top_seq)

    def _new_rank(self, rank: int) -> ColumnRank:
        rs = ColumnRank(rank, self.progress)
        seq = self._forgotten_seq.pop(rank, None)
        if seq is not None:
            rs.top_seq = seq
        return rs

    def forget_rank(self, rank: int) -> None:
        rs: Any = self.ranks.get(rank)
        super().forget_rank(rank)
        if rs is not None and rank not in self.ranks:
            if rs.top_seq >= 0:  # the newest seq a node said it reached outlives it
                self._forgotten_seq[rank] = rs.top_seq
            rs.detach()

    def _progress_of(self, states: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        got = self._live_slots
        if got is None or got[0] is not states:  # the list is kept until ranks change
            got = self._live_slots = (states, slots_of(states, self.progress))
        cols, slots = self.progress, got[1]
        return cols.last_t[slots], cols.done_step[slots]

    def liveness(self) -> Sequence[RankLiveness]:
        live = super().liveness()
        if not self.dark_ranks:
            return live
        if isinstance(live, LivenessColumns):
            return live.without(self.dark_ranks)
        return tuple(lv for lv in live if lv.rank not in self.dark_ranks)

    def stall(self, keep_s: float = 30.0) -> Any:
        st = super().stall(keep_s)
        if not self.dark_hosts:
            return st
        return st._replace(
            hosts_heard=tuple(h for h in st.hosts_heard if h[0] not in self.dark_hosts)
        )

    def expected(self, step: int, lag: int = 2) -> int:
        n = super().expected(step, lag)
        for r in self.dark_ranks:
            rs = self.ranks.get(r)
            if (
                rs is not None
                and not rs.lost
                and rs.first_step is not None
                and rs.first_step <= step
                and max(rs.done_step, rs.max_coll_step) >= step - lag
            ):
                n -= 1
        return n


class LeaderPipeline(Pipeline):
    """The single daemon's :class:`Pipeline` over a :class:`LeaderCorrelator`, which
    also takes the nodes' ``progress`` points (rank, its newest record's time,
    step and seq) in time order with the other records, as ``coll`` records
    would have moved the correlator and the clock."""

    def __init__(
        self,
        config: DetectConfig | None = None,
        finalize_lag: int = 2,
        limits: StateLimits | None = None,
    ) -> None:
        super().__init__(config, finalize_lag)
        corr = self.lcorr = LeaderCorrelator(self.config.network.flow_window_s, limits)
        self.corr = corr
        self._add_coll = corr.add_coll
        self.fabric = FabricTotals(corr.local_rank)
        self._handlers["progress"] = self._on_progress
        self._handlers["step"] = self._on_node_step

    def _on_node_step(self, rec: Record) -> list[Record]:
        # A node that joins late (its daemon reached the store after the
        # leader began) sends its backlog in one window, of steps the leader
        # already summarised: too late to judge, but still word that the rank
        # lives and how far it got (else it looks silent since it announced).
        # What every one of its step records says of its rank is noted
        # (``Correlator.note_step``, as for a step in time); the step is late.
        step = rec["step"]
        if type(step) is int and step <= self.corr.summarised:
            corr = self.lcorr
            d: StepDigest | None = rec.get("digest")
            if d is not None:
                corr.note_digest(d)
            else:
                corr.note_step(corr.rank_of(int(rec["rank"])), step, float(rec["end"]))
        return self._on_step(rec)

    def _on_progress(self, rec: Record) -> list[Record]:
        self.lcorr.add_progress(rec["rank"], rec["t"], rec["step"], rec["seq"])
        return self._clock_to(rec["t"])

    def clock(self, t: float) -> list[Record]:
        """``feed`` of a ``clock`` record at ``t``, without the record (one per node
        per window: 2,048 a round at 16k ranks)."""
        if not t <= self._horizon:  # past the stream's horizon (or NaN): the guard's
            return list(self.feed({"kind": "clock", "t": t}))
        totals = self._totals
        totals["clock"] = totals.get("clock", 0) + 1
        return self._clock_to(t)

    def clocks(self, ts: list[Any], i: int, j: int) -> int:
        """:meth:`clock` of ``ts[i:j]`` (node clocks, in order) at once, up to the
        first that meets the guard or is due a tick (it and those after are
        fed one at a time): they only count and move the clock. Where it
        stopped."""
        if ts[j - 1] != ts[j - 1]:  # a NaN (sorted last): each its own
            return i
        m = self._quiet_until(ts, i, j)
        if m > i:
            totals = self._totals
            totals["clock"] = totals.get("clock", 0) + m - i
            if ts[m - 1] > self.now:
                self.now = float(ts[m - 1])
        return m

    def heard(self, item: Heard) -> list[Record]:
        """``feed`` of the netdev record of no device that says a node heard its
        host's probes (``item``), without the record (one per node per probe
        interval: 2,048 a round at 16k ranks)."""
        t = item.t
        if not t <= self._horizon:  # the guard's (or NaN): as the record
            return list(self.feed(item.record()))
        totals = self._totals
        totals["netdev"] = totals.get("netdev", 0) + 1
        try:
            self.corr.heard_host_at(item.host, t, item.dt)
            return self._clock_to(t)
        except (KeyError, TypeError, ValueError, AttributeError):
            self._malformed += 1
            return []

    def quiet(self, item: Any, hosts: set[str]) -> bool:
        """Does handling time-line ``item`` leave the flow state alone, so the flow
        rows before it may be filed after it as they would have been before
        (``_ingest``'s runs)? A clock, progress point or heard host that
        neither ticks (a tick reads the flows), nor notes one of ``hosts``
        (the held rows' hosts: a tie's interval would change), nor meets the
        guard, nor makes a rank or a heard host (the last three matter only
        through the guard's bookkeeping and at the state's caps: kept out to
        be sure). ``tests/test_flowrows.py`` holds a round's held rows to
        its records fed in turn, at every tick and step summary."""
        kind = type(item)
        if kind is float:
            t = item
        elif kind is tuple:
            t = item[0]
            if item[1] not in self.corr.ranks:
                return False
        elif kind is Heard:
            t = item.t
            if item.host in hosts or item.host not in self.corr.hosts_heard:
                return False
        else:
            return False
        return t <= self._horizon and not (t >= self._next_tick and t > self.now)

    def _quiet_until(self, ts: Sequence[Any], i: int, j: int) -> int:
        """Where the times ``ts[i:j]`` (in order) first meet the guard's horizon
        or the next tick: those before need nothing but filing now."""
        return min(bisect_right(ts, self._horizon, i, j), bisect_left(ts, self._next_tick, i, j))

    def can_hold(self, line: FlowLine, k: int, end: int) -> bool:
        """Would rows ``k .. end - 1`` be filed as one run (:meth:`file_flow_rows`)
        now: within the guard's horizon, before the next tick, no observer?"""
        t = line.t[end - 1]  # the newest: the line is in time order
        return self.observer is None and t <= self._horizon and t < self._next_tick

    def file_flow_rows(self, line: FlowLine, k: int, end: int) -> list[Record]:
        """File rows ``k .. end - 1`` of a round's flow line as ``feed`` would file
        their records, in turn; the verdict records that caused.

        Rows that need nothing but filing (their time within the guard's
        horizon and before the next tick, as :meth:`file_flows` asks) are
        filed together (:meth:`Correlator.add_flow_rows`); any other row, and
        every row while an observer watches flows, is fed as its record.
        """
        out: list[Record] = []
        ts = line.t
        while k < end:
            j = k
            if self.observer is None:  # the line is in time order
                j = self._quiet_until(ts, k, end)
            if j > k:
                self.corr.add_flow_rows(
                    line.keys[k:j], ts[k:j], line.dt[k:j], line.cols, k,
                    line.newest_by_host(k, j), line.slots(self.corr, k, j),
                )  # fmt: skip
                self._totals["flow"] = self._totals.get("flow", 0) + j - k
                if ts[j - 1] > self.now:
                    self.now = ts[j - 1]
            if j < end:
                said = self.feed(line.record(j))
                if said:
                    out.extend(said)
                j += 1
            k = j
        return out

    def progress(self, t: float, rank: int, step: int, seq: int) -> list[Record]:
        """``feed`` of a ``progress`` record with these fields, without the record:
        the leader gets one per rank per window (16k a window at 16k ranks)."""
        totals = self._totals
        totals["progress"] = totals.get("progress", 0) + 1
        try:
            self.lcorr.add_progress(rank, t, step, seq)
            return self._clock_to(t)
        except (KeyError, TypeError, ValueError, AttributeError):
            self._malformed += 1
            return []


class LeaderDetector:
    """Detection over every node's windows (see the module docstring).

    ``ingest(windows)`` takes one round of windows (any nodes, any number
    each) and returns the verdict records they caused, each with
    ``evidence.view = "cluster"``.
    """

    def __init__(
        self,
        config: DetectConfig | None = None,
        finalize_lag: int = 2,
        limits: StateLimits | None = None,
    ) -> None:
        self.pipeline = LeaderPipeline(config, finalize_lag, limits)
        self.corr = self.pipeline.lcorr
        self.node_ranks: dict[str, set[int]] = {}
        self.node_hosts: dict[str, set[str]] = {}
        # the (window, host)s of the last round's rows noted in node_hosts, and
        # that round's nodes, in order
        self._hosts_noted: tuple[list[tuple[int, str]] | None, list[str]] = (None, [])
        self.windows = 0
        self._last_line: FlowLine | None = None  # the newest round's flow rows

    def set_dark(self, nodes: Iterable[str]) -> None:
        """Nodes whose daemons stopped publishing (their ranks are not judged)."""
        dark = set(nodes)
        self.corr.dark_ranks = frozenset(r for n in dark for r in self.node_ranks.get(n, ()))
        self.corr.dark_hosts = frozenset(h for n in dark for h in self.node_hosts.get(n, ()))

    def ingest(self, windows: Sequence[Window] | Round) -> list[Record]:
        """One round: windows as nodes made them, or as :func:`decode_round` read
        them from the store (each step's digests already joined)."""
        with collector_held():
            if isinstance(windows, Round):
                rnd = windows
                return self._ingest(rnd.windows, rnd.steps, rnd.flows, rnd.plain)
            return self._ingest(windows, None, flow_table([w.flows for w in windows]))

    def _ingest(
        self,
        windows: Sequence[Window],
        joined: Mapping[int, StepDigest] | None,
        flows: FlowTable,
        plain: bool = False,
    ) -> list[Record]:
        corr = self.corr
        # records, progress points (t, rank, step, seq), and node clocks (t)
        recs: list[Any] = []
        # A round's digests of one step, every node's, are filed as one
        # (summary.join_digests): the round's step records of the step as one
        # record at the newest one's end, when the last of them would have
        # come. Each rank is still noted at its own end. A node at a time,
        # the filing cost a node's worth of Python each (2,048 a round at
        # 16k ranks), and its records were late if the step's summary came
        # between two nodes' records of one round.
        if joined is None:
            by_step: dict[int, list[StepDigest]] = {}
            for w in windows:
                for d in w.digests:
                    by_step.setdefault(d.step, []).append(d)
            joined = {step: join_digests(ds) for step, ds in by_step.items()}
        for d in joined.values():
            corr.add_digest(d)
            end = newest_end(d)
            if end is not None:
                recs.append(
                    {"kind": "step", "rank": d.ranks[0], "step": d.step, "start": end,
                     "end": end, "digest": d}
                )  # fmt: skip
        self.windows += len(windows)
        # Where each window's flow rows go in ``recs``: after its records,
        # before its clock (as if its records had ended with them).
        flows_at: list[int] = []
        if plain:  # every window its clock alone (Round.plain): one after another
            flows_at = list(range(len(recs), len(recs) + len(windows)))
            recs.extend([w.t for w in windows])
        for w in () if plain else windows:
            if not (w.progress or w.heard or w.records):
                flows_at.append(len(recs))
                recs.append(float(w.t))
                continue  # a window of digests alone (most, in a steady job)
            ranks = self.node_ranks.setdefault(w.node, set())
            hosts = self.node_hosts.setdefault(w.node, set())
            for rank, t, step, seq in w.progress:
                ranks.add(rank)
                # Known from its window on, as a single daemon knows a rank
                # from its first coll record: steps wait for it.
                rs = corr.rank_of(rank)
                if step >= 0 and (rs.first_step is None or step < rs.first_step):
                    rs.first_step = step
                # A progress point, fed as a record would be (LeaderPipeline.progress).
                recs.append((t, rank, step, seq))
            for host, t, dt in w.heard:
                hosts.add(host)
                # A netdev record of no device: the host's probes were heard.
                recs.append(Heard(t, host, dt))
            for rec in w.records:
                if rec.get("kind") == "rank":
                    ranks.add(rec["rank"])
                    hosts.add(rec["host"])
            recs.extend(w.records)
            flows_at.append(len(recs))
            recs.append(float(w.t))  # after the window's own records (a stable sort)
        times = np.fromiter(map(_when, recs), np.float64, len(recs))
        ranked = np.argsort(times, kind="stable")  # a time that is not a number: last
        recs = list(map(recs.__getitem__, ranked.tolist()))
        out: list[Record] = []
        pipe = self.pipeline
        feed, progress, clock, file_flows = pipe.feed, pipe.progress, pipe.clock, pipe.file_flows
        i, n = 0, len(recs)
        # The flow rows go between: before item i, rows up to due[i].
        line = FlowLine(flows, self._last_line) if len(flows) else None
        if line is not None:
            self._last_line = line
            # A poll that a window's flow rows show is not in its heard
            # entries (cluster.node): its host is the node's all the same.
            # Noted once while rounds name the same (window, host)s of the
            # same nodes (a steady job: 2,048 set additions a round at 16k).
            pairs, nodes = line.window_hosts(), [w.node for w in windows]
            if pairs is not self._hosts_noted[0] or nodes != self._hosts_noted[1]:
                for at, host in pairs:
                    self.node_hosts.setdefault(nodes[at], set()).add(host)
                self._hosts_noted = (pairs, nodes)
        due = line.due(times[ranked], ranked, np.array(flows_at)) if line else []
        run_end = _clock_runs(ranked, flows_at, due)
        clocks = pipe.clocks
        k = 0
        # Rows held to be filed as one run (hold .. k - 1): while the items
        # between are quiet (LeaderPipeline.quiet), filing them later files
        # them as they would have been filed before; a round's rows come a
        # node's few at a time between its heard entries.
        hold = 0
        held_hosts: set[str] = set()
        said: Sequence[Record]
        heard, quiet = pipe.heard, pipe.quiet
        while i < n:
            if line is not None and due[i] > k:
                if pipe.can_hold(line, k, due[i]):
                    held_hosts.update(line.hosts[k : due[i]])
                else:
                    if hold < k:
                        out.extend(pipe.file_flow_rows(line, hold, k))
                        held_hosts.clear()
                    out.extend(pipe.file_flow_rows(line, k, due[i]))
                    hold = due[i]
                k = due[i]
            rec = recs[i]
            if hold < k and not quiet(rec, held_hosts):
                out.extend(pipe.file_flow_rows(line, hold, k))  # type: ignore[arg-type]
                hold = k
                held_hosts.clear()
            kind = type(rec)
            if kind is float:
                # A run of node clocks (no row due between): as many at once
                # as neither meet the guard nor tick (most: 2,048 a round).
                j = run_end[i]
                if j > i + 1:
                    j = clocks(recs, i, j)
                    if j > i:
                        i = j
                        continue
                said = clock(rec)
            elif kind is tuple:
                said = progress(*rec)
            elif kind is Heard:
                said = heard(rec)
            else:
                if rec.get("kind") == "flow":  # a round's flows come together: a run
                    j = file_flows(recs, i)
                    if j > i:
                        i = j
                        continue
                said = feed(rec)
            if said:
                out.extend(said)
            i += 1
        if line is not None and hold < len(line):
            out.extend(pipe.file_flow_rows(line, hold, len(line)))
        for v in out:
            ev = v.get("evidence")
            if not isinstance(ev, dict):
                ev = v["evidence"] = {}
            ev["view"] = "cluster"
        return out


def _clock_runs(ranked: np.ndarray, clocks_at: list[int], due: list[int]) -> list[int]:
    """Per item of a round's time line (``ranked``: each one's place before it
    was sorted; the node clocks were at ``clocks_at``), where the run of
    node clocks it begins ends: the next item that is not one, or before
    which flow rows are due (``due``: rows before each item)."""
    n = len(ranked)
    is_clock = np.zeros(n, dtype=bool)
    is_clock[clocks_at] = True
    breaks = ~is_clock[ranked]
    if len(due):
        d = np.asarray(due[:n])
        breaks[1:] |= d[1:] != d[:-1]
    stops = np.append(np.flatnonzero(breaks), n)
    return stops[np.searchsorted(stops, np.arange(n), side="right")].tolist()


class Heard(NamedTuple):
    """A node heard its host's probes (a window's ``heard`` entry) at ``t``: on
    the leader's time line, it is fed as a netdev record of no device."""

    t: float
    host: str
    dt: float

    def record(self) -> Record:
        return {"kind": "netdev", "t": self.t, "dt": self.dt, "host": self.host, "dev": "",
                "tx_bytes": 0, "rx_bytes": 0}  # fmt: skip


class FlowLine:
    """A round's flow rows (:class:`~fsdp_sentinel.cluster.flowrows.FlowTable`) in
    time order, as the correlator files them: ``keys``, ``t``, ``dt`` and the
    sample columns ``cols`` (:meth:`Correlator.add_flow_rows`), made for every
    row at once.

    Rows of one time keep their windows' order, and a window's rows their own.

    ``last``: the round before's line. When this round's rows name the very
    flows of that one, in the same order, through the very same strings (a
    steady job: the nodes' strings are read once, and ``flow_table`` joins
    them once), its keys, hosts and looked-up slots serve again: at 16k
    ranks, a tuple and a lookup a row.
    """

    hosts: list[str]
    keys: list[FlowKey]
    _host_code: np.ndarray
    _slots: dict[tuple[int, int, int], list[Any]]
    _window_hosts: list[tuple[int, str]] | None

    def __init__(self, table: FlowTable, last: FlowLine | None = None) -> None:
        rows = table.rows
        self.table = table
        t = rows["t"]
        if (t[1:] >= t[:-1]).all():  # in order already (a round's rows: one poll time, most)
            self.order, got = np.arange(len(t)), rows
        else:
            self.order = np.argsort(t, kind="stable")
            got = rows[self.order]
        self._t = got["t"]  # in time order, as an array (due) and as floats
        self.t: list[float] = self._t.tolist()
        self._dt = got["dt"]
        self.dt: list[float] = self._dt.tolist()
        self.cols = sample_columns(got, table.strings)
        # Which flow each row is: its strings' indices and its pid.
        self._ids = np.stack([got["host"].astype(np.int64), got["pid"],
                              got["src"].astype(np.int64), got["dst"].astype(np.int64)])  # fmt: skip
        if (
            last is not None
            and table.strings is last.table.strings
            and np.array_equal(self._ids, last._ids)
        ):
            self.hosts, self.keys = last.hosts, last.keys
            self._host_code, self._slots = last._host_code, last._slots
            # the same rows in the same windows' places: the same (window, host)s
            same_at = np.array_equal(table.window, last.table.window)
            self._window_hosts = last._window_hosts if same_at else None
            return
        s = table.strings
        self.hosts = s[got["host"]].tolist()
        self.keys = list(
            zip(self.hosts, got["pid"].tolist(), s[got["src"]].tolist(), s[got["dst"]].tolist(),
                strict=True)
        )  # fmt: skip
        # Each row's host as a number, one a host name (a round's windows
        # each list their own strings: one host may have several indices).
        ix, inverse = np.unique(got["host"], return_inverse=True)
        codes: dict[str, int] = {}
        canon = [codes.setdefault(h, len(codes)) for h in s[ix].tolist()]
        self._host_code = np.asarray(canon, np.int64)[inverse]
        self._slots = {}  # (rows k, end, the correlator's flow_slots_version) -> slots
        self._window_hosts = None

    def slots(self, corr: Correlator, k: int, end: int) -> list[Any]:
        """Rows ``k .. end - 1``'s flows' slots, as ``corr.flow_slots`` says now
        (looked up once while its flow cache is unchanged)."""
        at = (k, end, corr.flow_slots_version)
        got = self._slots.get(at)
        if got is None:
            if len(self._slots) >= 64:
                self._slots.clear()
            got = self._slots[at] = corr.flow_slots(self.keys[k:end])
        return got

    def __len__(self) -> int:
        return len(self.t)

    def newest_by_host(self, k: int, end: int) -> list[tuple[str, float, float]]:
        """Per host of rows ``k .. end - 1``, in the order they first name it: the
        time and interval of its first row of the newest time (what noting
        each row's host in turn leaves: ``Correlator.add_flow_rows``)."""
        code, t = self._host_code[k:end], self._t[k:end]
        at = np.arange(len(code))
        by_host = np.lexsort((at, code))  # by host, each in order
        starts = run_bounds(code[by_host])[:-1]
        lead = np.lexsort((at, -t, code))[starts]  # each host's first of its newest
        lead = lead[np.argsort(by_host[starts])]  # hosts in the order they first appear
        hosts = self.hosts
        return [
            (hosts[k + i], ti, dt)
            for i, ti, dt in zip(lead.tolist(), t[lead].tolist(), self._dt[k + lead].tolist(),
                                 strict=True)
        ]  # fmt: skip

    def window_hosts(self) -> list[tuple[int, str]]:
        """Each window's hosts that its rows name, as ``(window, host)``, once each."""
        if self._window_hosts is not None:
            return self._window_hosts
        rows = self.table.rows
        width = len(self.table.strings)
        both = np.unique(self.table.window * width + rows["host"].astype(np.int64))
        names = self.table.strings[both % width].tolist()
        self._window_hosts = list(zip((both // width).tolist(), names, strict=True))
        return self._window_hosts

    def record(self, j: int) -> Record:
        """Row ``j`` (in time order) as its record."""
        return self.table.record(int(self.order[j]))

    def due(self, times: np.ndarray, slots: np.ndarray, flows_at: np.ndarray) -> list[int]:
        """Per item of the round's time line (``times``: in order; ``slots``: each
        one's place before it was sorted), how many rows go before it; one more
        entry, all of them.

        A row goes where its record would have gone in the time line: by
        time, then by place, its window's ``flows_at`` (a row goes before the
        item it shares its place with: its window's clock).
        """
        t = self._t
        at = flows_at[self.table.window[self.order]]
        # (time, place) pairs as one integer each, to compare both at once.
        codes = np.unique(np.concatenate([times, t]))
        width = len(times) + 1
        items = np.searchsorted(codes, times).astype(np.int64) * width + slots
        rows = np.searchsorted(codes, t).astype(np.int64) * width + at
        before = np.searchsorted(items, rows, side="left")  # items ahead of each row
        return np.searchsorted(before, np.arange(len(times) + 1), side="right").tolist()  # type: ignore[no-any-return]


@contextmanager
def collector_held() -> Iterator[None]:
    """The cyclic collector held off while a round of windows is read or judged.

    A round makes a few short-lived objects per rank (decoding: ~30 containers
    a node) and replaces each rank's state, so left on the collector runs
    dozens of young and several full collections over the leader's whole heap
    (~10 containers a rank) per round: 60 % of a 16k-rank window. The round's
    own garbage is freed by reference counts; what it left in cycles waits
    for the next collection.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def decode_round(blobs: Iterable[bytes]) -> Round:
    """Every packed window of one round, each step's digests joined
    (:func:`~fsdp_sentinel.cluster.summary.decode_round`), with the collector
    held off (:func:`collector_held`); a blob that is not a window is left out
    alone and counted (``Round.bad``): the others still count."""
    with collector_held():
        return summary_decode_round(blobs)


def _when(item: Record | tuple[float, int, int, int] | Heard | float) -> float:
    """Where a window's record, progress point ``(t, rank, step, seq)``, heard
    host or clock goes on the time line."""
    kind = type(item)
    if kind is float:
        return item  # type: ignore[return-value]
    return item[0] if kind is tuple or kind is Heard else _time(item)  # type: ignore[index,arg-type]


def _time(rec: Record) -> float:
    """Where a record goes on the time line (``trace.record_time``'s rule for the
    kinds a window holds, inlined: it runs for every record of every window)."""
    t = rec.get("t")
    if t is None:
        t = rec.get("end")
    return t if type(t) is float or type(t) is int else record_time(rec)


def seed_windows(rank_records: Mapping[str, Iterable[Record]], now: float) -> list[Window]:
    """What a new leader ingests first: each node's rank records, and every rank
    heard from, all at ``now`` (the newest window it holds).

    At one instant, so no rank is silent against another before the nodes'
    windows speak. Seeded at the round's oldest window instead, a first
    leader elected seconds after the daemons began (their windows reach back
    to before the job) met the ranks' own announcements seconds after the
    seeded ones, called every rank but the first to announce lost, and
    cleared them aloud at the next round (a seed's verdicts are not said).
    """
    out = []
    for node, recs in rank_records.items():
        got = tuple({**r, "t": now} for r in recs)
        alive = tuple((int(r["rank"]), now, -1, -1) for r in got)
        out.append(Window(node, -1, now, got, (), alive, ()))
    return out


def leader_of(roster: Sequence[tuple[int, str]], dark: Iterable[str]) -> str | None:
    """The node that leads: first by lowest rank held (``roster``: (rank, node)) and not dark."""
    gone = set(dark)
    for _, node in sorted(roster):
        if node not in gone:
            return node
    return None


class Liveness:
    """Which nodes went dark: a node is dark once its heartbeat (its window
    ``seq``) has not moved for ``miss`` of the watcher's own windows."""

    def __init__(self, miss: int = 2) -> None:
        self.miss = miss
        self._seen: dict[str, tuple[int, int]] = {}  # node -> (its seq, my window then)
        self.tick = 0

    def observe(self, beats: dict[str, int]) -> frozenset[str]:
        """One of my windows: every node's latest heartbeat; returns the dark ones."""
        self.tick += 1
        for node, seq in beats.items():
            old = self._seen.get(node)
            if old is None or seq != old[0]:
                self._seen[node] = (seq, self.tick)
        return frozenset(n for n, (_, at) in self._seen.items() if self.tick - at >= self.miss)

    def windows_since(self, node: str) -> int | None:
        """My windows since ``node``'s heartbeat last moved (None: never seen)."""
        seen = self._seen.get(node)
        return None if seen is None else self.tick - seen[1]
