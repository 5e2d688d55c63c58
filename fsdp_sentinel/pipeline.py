"""The detection pipeline: records in, verdict records out, one record at a time.

``Pipeline.feed(rec)`` files each trace-v1 record with the correlator; when a
step is complete on every live rank (or a rank is already ``finalize_lag``
steps further on) it summarises that step once and runs the pure detector on
it. The pipeline's only clock is the record stream: "now" is the newest record
time seen, and every ``tick_s`` of stream time it checks liveness (probe
``netdev``/``flow`` records and the daemon's own ``clock`` record keep
arriving every interval even while all ranks are blocked, which is what lets
``rank_lost`` and ``hang`` fire); a ``pending`` record is checked at once. So
the same records in the same order give byte-identical verdicts, live or in
replay.

Robust to what a live stream does: records slightly out of order across
ranks (a step is only summarised once complete), records lost (a step with a
missing rank is summarised when another rank is ``finalize_lag`` steps on),
fields of the wrong type (counted as malformed, never raised), unknown kinds
(counted, ignored), a record far ahead of the stream clock or a step far
ahead of the job (held aside or refused, :mod:`fsdp_sentinel.stream`), and input ``verdict``/``action`` records (ignored, so a
trace with the daemon's own verdicts replays to the same verdicts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from fsdp_sentinel.correlate import Correlator, RankStep, StateLimits
from fsdp_sentinel.cost import straggler_cost
from fsdp_sentinel.detect import DetectConfig, DetectState, Report, detect
from fsdp_sentinel.detect.network import window_s as evidence_window_s
from fsdp_sentinel.fabric import FabricTotals
from fsdp_sentinel.snapshot import PeerView, RankView, Snapshot
from fsdp_sentinel.stream import STEP_AHEAD, STEP_KINDS, TIME_FIELD, StreamConfig, StreamGuard
from fsdp_sentinel.trace import KEY

# Looked up with the parser's own key objects on the hot path (see trace.KEY).
_KIND, _END, _STEP, _RANK, _T = KEY["kind"], KEY["end"], KEY["step"], KEY["rank"], KEY["t"]
#: Each kind's stream time field but coll's, for the stream guard's fast check.
_TIME_OF = {k: KEY[f] for k, f in TIME_FIELD.items() if k != "coll"}

Record = dict[str, Any]

#: Kinds that carry nothing for detection (outputs, ground truth, headers).
PASSIVE_KINDS = frozenset({"header", "verdict", "action", "fault"})

#: Stream seconds between the correlator's time-to-live sweeps (StateLimits.ttl_s).
SWEEP_S = 30.0

#: What ``feed`` returns for a record that caused no verdict (most of them):
#: one shared empty tuple rather than a new list per record.
_NOTHING: tuple[Record, ...] = ()


def feed_all(feed: Callable[[Record], Sequence[Record]], recs: Any) -> list[Record]:
    """Every verdict record ``feed`` returns for ``recs``, in order."""
    out: list[Record] = []
    for rec in recs:
        v = feed(rec)
        if v:
            out.extend(v)
    return out


class Observer(Protocol):
    """What a consumer that draws the pipeline's own figures (the HTML report) is told.

    ``on_step``: a step summarised, with each rank's figures exactly as the
    detector judged them; ``on_flow``: a flow sample and the ``(rank, peer)``
    pair the correlator filed it under.
    """

    def on_step(self, step: int, ranks: Sequence[RankStep]) -> None: ...

    def on_flow(self, rec: Record, pair: tuple[int, int]) -> None: ...


class Pipeline:
    """Correlate + detect over a record stream (see the module docstring).

    ``stats`` counts: ``records`` fed, ``malformed`` (a known kind with fields
    of the wrong type), ``late`` (step/coll records for a step already
    summarised), ``unattributed_flows``, ``steps`` summarised, ``ticks``,
    ``verdicts`` emitted; from the stream guard (:mod:`fsdp_sentinel.stream`),
    ``held`` (records held aside), ``clock_resets`` (sources re-based) and
    ``refused_<reason>``.
    """

    def __init__(
        self,
        config: DetectConfig | None = None,
        finalize_lag: int = 2,
        observer: Observer | None = None,
        stream: StreamConfig | None = None,
        limits: StateLimits | None = None,
    ) -> None:
        self.config = config or DetectConfig()
        # Stream sanity (fsdp_sentinel.stream): a record past ``_horizon`` (the
        # stream clock at the last tick + ahead_s; -inf while the guard holds
        # or re-bases anything, so every record is judged) or a step past
        # ``_step_limit`` goes to the guard; the rest cost two compares.
        self.guard = StreamGuard(stream)
        self._clock_horizon = math.inf
        self._horizon = math.inf
        self._step_limit = math.inf
        self.observer = observer
        self.finalize_lag = finalize_lag
        self.corr = Correlator(flow_window_s=self.config.network.flow_window_s, limits=limits)
        self._next_sweep = -math.inf  # the correlator's time-to-live sweep, every SWEEP_S
        self.state = DetectState()
        self.now = 0.0
        self.last_report: Report | None = None
        self.open: dict[int, Record] = {}  # rank -> its open flagged verdict
        self.verdicts_total: dict[str, int] = {}
        self._totals: dict[str, int] = {}  # records by kind, but coll
        self._colls_bad = 0  # coll records refused before filing (malformed)
        self._next_tick = -math.inf  # -inf: not started (set by the first timed record)
        self._need: dict[int, tuple[int, int]] = {}  # step -> (lost epoch, ranks expected)
        self._lost_epoch = 0  # bumped whenever a rank is declared lost or back
        self._late = 0
        self._malformed = 0
        self._steps = 0
        self._ticks = 0
        self._verdicts = 0
        self._add_coll = self.corr.add_coll
        self.fabric = FabricTotals(self.corr.local_rank)
        self._handlers: dict[str, Callable[[Record], list[Record]]] = {
            "rank": self._on_rank,
            "step": self._on_step,
            "flow": self._on_flow,
            "netdev": self._on_netdev,
            "conn": self._on_conn,
            "pending": self._on_pending,
            "clock": self._on_clock,
            "rdma": self._on_rdma,
            "nccl": self._on_nccl,
        }

    # ------------------------------------------------------------ public

    def feed(self, rec: Record) -> Sequence[Record]:
        """File one record; return the verdict records it caused (usually none)."""
        kind: str = rec.get(_KIND)  # type: ignore[assignment]
        if kind == "coll":
            # The hot path (most records): filed (and counted, or dropped as
            # late) by the correlator, the stream clock moved; the rest of the
            # checks happen a step at a time when the step is summarised.
            try:
                if rec[_END] > self._horizon or rec[_STEP] > self._step_limit:
                    return self._guarded(rec)
            except (KeyError, TypeError):
                pass  # ill-typed: filing it below counts it as malformed
            try:
                end = self._add_coll(rec)
                if end > self.now:
                    self.now = float(end)
                    if end >= self._next_tick:
                        return self._advance(end)
                return _NOTHING
            except (KeyError, TypeError, ValueError, AttributeError):
                self._malformed += 1
                self._colls_bad += 1
                return _NOTHING
        tf = _TIME_OF.get(kind)
        if tf is not None:
            try:
                if rec[tf] > self._horizon or (
                    kind in STEP_KINDS and rec[_STEP] > self._step_limit
                ):
                    return self._guarded(rec)
            except (KeyError, TypeError):
                pass  # ill-typed: its handler counts it as malformed
        totals = self._totals
        handler = self._handlers.get(kind)
        if handler is None:
            key = kind if kind in PASSIVE_KINDS else "other"
            totals[key] = totals.get(key, 0) + 1
            return []
        totals[kind] = totals.get(kind, 0) + 1
        try:
            return handler(rec)
        except (KeyError, TypeError, ValueError, AttributeError):
            self._malformed += 1
            return []

    def end(self) -> list[Record]:
        """The input ended: records the stream guard still holds aside are fed
        as they are (nothing came to say they ran ahead of the stream)."""
        out = self.guard.release(self._admit)
        self._arm()
        return out

    def feed_many(self, recs: Any) -> list[Record]:
        if type(recs) is list:
            return self.feed_batch(recs)
        return feed_all(self.feed, recs)

    def feed_batch(self, recs: Sequence[Record]) -> list[Record]:
        """``feed`` each of ``recs`` in order; the verdict records they caused.

        The same records, the same verdicts (``tests/test_feed_batch.py``):
        runs of ``coll`` records that need no guard, tick or first filing are
        filed by one :meth:`Correlator.add_coll_run` call, runs of ``flow``
        records by :meth:`file_flows`, the rest by ``feed``.
        """
        out: list[Record] = []
        n = len(recs)
        i = 0
        file_run = self.file_run
        feed = self.feed
        file_flows = self.file_flows
        while i < n:
            kind = recs[i].get(_KIND)
            if kind == "coll":  # only a coll or a flow record starts a run
                i = file_run(recs, i)
            elif kind == "flow":
                i = file_flows(recs, i)
            if i < n:
                v = feed(recs[i])
                if v:
                    out.extend(v)
                i += 1
        return out

    def file_run(self, recs: Sequence[Record], i: int, gate: Any = None) -> int:
        """File the run of ``coll`` records from ``recs[i]`` on that need nothing
        but filing (:meth:`Correlator.add_coll_run`; ``gate``: a router's, that
        they are this job's); the index of the first record left to ``feed``."""
        # The bounds: each record's end within the guard's horizon and before
        # the next tick, its step within the step limit.
        bounds = (self._horizon, self._step_limit, self._next_tick)
        i, self.now = self.corr.add_coll_run(recs, i, bounds, self.now, gate)
        return i

    def file_flows(self, recs: Sequence[Record], i: int) -> int:
        """File the run of ``flow`` records from ``recs[i]`` on that need nothing
        but filing: each as ``feed`` files it (counted; malformed when filing it
        raises), while its time is within the guard's horizon and before the
        next tick; the index of the first record left to ``feed``.

        A leader's window of a big job carries a flow record a rank each
        second; through ``feed``, each cost a dispatch and three calls more.
        A pipeline with an observer (it sees each flow's pair) feeds them.
        """
        if self.observer is not None:
            return i
        horizon, tick = self._horizon, self._next_tick
        add_flow = self.corr.add_flow
        now = self.now
        start, n, bad = i, len(recs), 0
        for i in range(start, n):  # i: where the run stopped, at a break
            rec = recs[i]
            if type(rec) is not dict or rec.get(_KIND) != "flow":
                break
            t = rec.get(_T)
            # An ill-typed time, or one due the guard or a tick: feed's.
            if (type(t) is not float and type(t) is not int) or t > horizon or t >= tick:
                break
            try:
                add_flow(rec)
            except (KeyError, TypeError, ValueError, AttributeError):
                bad += 1  # as feed counts it: the clock is not moved
                continue
            if t > now:
                now = t
        else:
            i = n
        if i > start:
            self._totals["flow"] = self._totals.get("flow", 0) + i - start
            self._malformed += bad
            self.now = float(now)
        return i

    def _guarded(self, rec: Record) -> Sequence[Record]:
        """A record the fast check sent to the stream guard (see __init__)."""
        step = rec.get("step")
        if rec.get("kind") in STEP_KINDS and type(step) is int:
            newest = max(self.corr.job_done, self.corr.max_coll_step)
            if step > self.guard.step_limit(newest):
                self.guard.refuse(STEP_AHEAD)
                return _NOTHING
        try:
            return self.guard.admit(rec, self.now, self._clock_horizon, self._admit)
        finally:
            self._arm()

    def _admit(self, rec: Record) -> Sequence[Record]:
        """Feed a record the guard let through, past the fast check."""
        self._horizon = self._step_limit = math.inf
        try:
            # This class's own feed, not an override: a subclass that sees each
            # record as it is fed (the report's) sees a held one once.
            return Pipeline.feed(self, rec)
        finally:
            self._arm()

    def _arm(self) -> None:
        self._horizon = -math.inf if self.guard.active else self._clock_horizon
        newest = max(self.corr.job_done, self.corr.max_coll_step)
        self._step_limit = self.guard.step_limit(newest)

    def set_config(self, config: DetectConfig) -> None:
        """Use new thresholds from the next summary on (history is kept)."""
        self.config = config
        self.corr.flow_window_s = config.network.flow_window_s

    @property
    def records_total(self) -> dict[str, int]:
        """Records fed, by kind (kinds not known to the pipeline as ``other``)."""
        out = dict(self._totals)
        colls = self.corr.coll_records() + self._colls_bad
        if colls:
            out["coll"] = colls
        return out

    @property
    def stats(self) -> dict[str, int]:
        return {
            "records": sum(self.records_total.values()),
            "malformed": self._malformed + self.corr.malformed_total(),
            "late": self._late + self.corr.late_records,
            "unattributed_flows": self.corr.unattributed_flows,
            "steps": self._steps,
            "ticks": self._ticks,
            "verdicts": self._verdicts,
            "held": self.guard.held,
            "clock_resets": self.guard.resets,
            **{f"refused_{why}": n for why, n in self.guard.counts.items()},
        }

    def snapshot(self) -> Snapshot:
        """A picture of every rank and pair now (see :mod:`fsdp_sentinel.snapshot`)."""
        corr = self.corr
        corr.sync_totals()
        per_rank_pairs: dict[int, list[Any]] = {}
        peers: list[PeerView] = []
        for (a, b), pair in sorted(corr.pairs.items()):
            per_rank_pairs.setdefault(a, []).append(pair)
            peers.append(
                PeerView(
                    rank=a,
                    peer_rank=b,
                    tx_bytes_total=pair.tx_total,
                    rx_bytes_total=pair.rx_total,
                    srtt_us=pair.srtt_us,
                    retrans_total=pair.retrans_total,
                    retrans_spurious_total=pair.dsack_total,
                    job=corr.ranks[a].job if a in corr.ranks else "",
                )
            )
        ranks: list[RankView] = []
        for r in sorted(corr.ranks):
            rs = corr.ranks[r]
            pairs = per_rank_pairs.get(r, [])
            srtts = [(p.srtt_us, p.tx_rate or 0.0) for p in pairs if p.srtt_us is not None]
            weight = sum(w for _, w in srtts)
            srtt = (
                (
                    sum(s * w for s, w in srtts) / weight
                    if weight
                    else sum(s for s, _ in srtts) / len(srtts)
                )
                if srtts
                else None
            )
            tx_rates = [p.tx_rate for p in pairs if p.tx_rate is not None]
            rx_rates = [p.rx_rate for p in pairs if p.rx_rate is not None]
            verdict = self.open.get(r)
            state = "lost" if rs.lost else ("flagged" if verdict else "ok")
            last = rs.last
            ranks.append(
                RankView(
                    rank=r,
                    host=rs.host,
                    job=rs.job,
                    pid=rs.pid,
                    step=rs.done_step if rs.done_step >= 0 else None,
                    step_seconds=last.step_s if last else None,
                    compute_seconds=last.compute_s if last else None,
                    wait_seconds=last.wait_s if last else None,
                    steps_total=rs.steps_total,
                    step_seconds_total=rs.step_seconds_total,
                    tx_bytes_total=sum(p.tx_total for p in pairs),
                    rx_bytes_total=sum(p.rx_total for p in pairs),
                    tx_rate=sum(tx_rates) if tx_rates else None,
                    rx_rate=sum(rx_rates) if rx_rates else None,
                    srtt_us=srtt,
                    retrans_total=sum(p.retrans_total for p in pairs),
                    retrans_spurious_total=sum(p.dsack_total for p in pairs),
                    state=state,
                    cause=verdict["cause"] if verdict else None,
                    score=verdict["score"] if verdict else None,
                    cost=(verdict.get("evidence") or {}).get("cost") if verdict else None,
                    scope=(verdict.get("evidence") or {}).get("scope") if verdict else None,
                    peer_rank=verdict.get("peer_rank") if verdict else None,
                    coll_count_total=dict(rs.coll_count),
                    coll_bytes_total=dict(rs.coll_bytes),
                    coll_seconds_total=dict(rs.coll_seconds),
                    wait_seconds_total=rs.wait_seconds_total,
                    step_buckets=tuple(rs.step_buckets),
                    coll_wait_buckets={op: tuple(c) for op, c in rs.wait_buckets().items()},
                )
            )
        return Snapshot(
            t=self.now,
            world_size=corr.world_size,
            ranks=tuple(ranks),
            peers=tuple(peers),
            verdicts_total=dict(self.verdicts_total),
            records_total=self.records_total,
            rdma_ports=self.fabric.rdma_ports(),
            nccl=self.fabric.nccl(),
            stream_refused_total=dict(self.guard.counts),
            clock_resets_total=self.guard.resets,
            evictions_total=dict(self.corr.evicted),
        )

    # ------------------------------------------------------------ handlers

    def _advance(self, t: float) -> list[Record]:
        """Move the stream clock to ``t``; run a liveness tick when one is due."""
        if t > self.now:
            self.now = t
        if self.now < self._next_tick:
            return []
        self._clock_horizon = self.now + self.guard.config.ahead_s
        self._arm()
        first = self._next_tick == -math.inf
        self._next_tick = self.now + self.config.lost.tick_s
        if first:
            return []
        self._ticks += 1
        if self.now >= self._next_sweep:
            self._next_sweep = self.now + SWEEP_S
            self.corr.sweep(self.now)
        tick = self.corr.tick_summary(self.now)
        out = self._run(tick)
        # A rank just declared lost no longer holds its step back. The steps
        # summarised now see the tick's liveness: nothing is filed between
        # (a verdict marks ranks lost or back, which liveness does not show),
        # and at 16k ranks it is a pass over every rank.
        self.corr.held_liveness = tick.liveness
        try:
            out.extend(self._finalize_ready())
        finally:
            self.corr.held_liveness = None
        return out

    def _on_rank(self, rec: Record) -> list[Record]:
        self.corr.add_rank(rec)
        return self._advance(float(rec["t"]))

    def _clock_to(self, t: float) -> list[Record]:
        # Hot path: most records move the clock a little and are not due a tick.
        if t > self.now:
            self.now = float(t)
            if t >= self._next_tick:
                return self._advance(t)
        return []

    def _on_clock(self, rec: Record) -> list[Record]:
        return self._clock_to(rec["t"])

    def _on_netdev(self, rec: Record) -> list[Record]:
        self.corr.heard_host(rec)
        return self._clock_to(rec["t"])

    def _on_pending(self, rec: Record) -> list[Record]:
        # Checked at once rather than at the next tick: the record that shows
        # a collective stalled long enough names the rank missing from it,
        # half a tick sooner (pending records are few, one a second a rank).
        self.corr.add_pending(rec)
        t = float(rec["t"])
        if t > self.now:
            self.now = t
        if self._next_tick != -math.inf:
            self._next_tick = self.now
        return self._advance(self.now)

    def _on_flow(self, rec: Record) -> list[Record]:
        pair = self.corr.add_flow(rec)
        if pair is not None and self.observer is not None:
            self.observer.on_flow(rec, pair)
        return self._on_clock(rec)

    def _on_conn(self, rec: Record) -> list[Record]:
        self.corr.add_conn(rec)
        return self._advance(float(rec["t"]))

    def _on_rdma(self, rec: Record) -> list[Record]:
        self.fabric.add_rdma(rec)
        return self._on_clock(rec)

    def _on_nccl(self, rec: Record) -> list[Record]:
        self.fabric.add_nccl(rec)
        return self._on_clock(rec)

    def _on_step(self, rec: Record) -> list[Record]:
        step = rec[_STEP]
        if step <= self.corr.summarised:
            self._late += 1
            self.corr.heard_late(rec[_RANK], step, rec[_END], done=True)
            return []
        rs, step = self.corr.add_step(rec)
        t = float(rec[_END])
        if t > self.now:
            self.now = t
        out = self._advance(t) if self.now >= self._next_tick else []
        if step <= self.corr.summarised:
            # That tick summarised the step (every rank had reported): nothing
            # is left to wait for, and no count of the ranks expected is needed.
            return out
        # Count ranks, not records: a datagram delivered twice is one report.
        n = self.corr.reported(step)
        ready = n >= len(self.corr.ranks)
        if not ready:
            # How many ranks the step waits for only grows (ranks start, move
            # on, join) until one is declared lost or back: the count found for
            # the step's first report stands until this one reaches it.
            need = self._need.get(step)
            if need is None or need[0] != self._lost_epoch or n >= need[1]:
                need = (self._lost_epoch, self.corr.expected(step, self.finalize_lag))
                self._need[step] = need
            ready = n >= need[1]
        if ready:
            out.extend(self._finalize_through(step))
        elif step - self.finalize_lag > self.corr.summarised:
            out.extend(self._finalize_through(step - self.finalize_lag))
        return out

    # ------------------------------------------------------------ steps

    def _finalize_through(self, last: int) -> list[Record]:
        """Summarise every pending step up to ``last``, oldest first."""
        out: list[Record] = []
        for step in self.corr.pending_steps():
            if step > last:
                break
            out.extend(self._finalize(step))
        return out

    def _finalize_ready(self) -> list[Record]:
        out: list[Record] = []
        corr = self.corr
        for step in corr.reported_steps():
            n = corr.reported(step)
            # Every rank reported: no count of those expected can exceed that
            # (a pass over every rank, skipped).
            if n >= len(corr.ranks) or n >= corr.expected(step, self.finalize_lag):
                out.extend(self._finalize_through(step))
        return out

    def _finalize(self, step: int) -> list[Record]:
        if step <= self.corr.summarised:
            return []
        for old in [s for s in self._need if s <= step]:
            del self._need[old]
        self._steps += 1
        summary = self.corr.step_summary(step, self.now)
        if self.observer is not None:
            self.observer.on_step(step, summary.ranks)
        return self._run(summary)

    def summarise_pending(self) -> None:
        """At the end of the input, summarise for the observer every step still
        waiting for a rank (its record lost, or the rank gone), without judging
        them: no verdicts, no state change in the detector."""
        for step in self.corr.pending_steps():
            if step > self.corr.summarised:
                summary = self.corr.step_summary(step, self.now)
                if self.observer is not None:
                    self.observer.on_step(step, summary.ranks)

    def _price(self, verdict: Record, report: Report) -> None:
        """Add ``evidence.cost`` (``fsdp_sentinel.cost``) to a flagged verdict."""
        ev = verdict.get("evidence")
        if not isinstance(ev, dict):
            ev = verdict["evidence"] = {}
        job = ev.get("job_step_s", report.job_step_s)
        base = ev.get("baseline_step_s", report.baseline_step_s)
        cost = straggler_cost(verdict["cause"], job, base, self.corr.world_size)
        if cost is not None:
            ev["cost"] = cost

    def _run(self, summary: Any) -> list[Record]:
        warming = self.state.warmup
        report = detect(summary, self.state, self.config)
        self.state = report.state
        if warming and not report.state.warmup:
            # A new attempt's warm-up is over: its flow samples are no evidence.
            self.corr.drop_flows_before(summary.t)
        self.last_report = report
        if report.step is not None:
            # Evidence windows are counted in the job's own steps (a floor in
            # probe intervals): the same number of steps for fast and slow jobs.
            self.corr.flow_window_s = evidence_window_s(
                report.baseline_step_s, self.corr.flow_dt, self.config.network
            )
        if not report.verdicts:
            return []
        out = [v.record() for v in report.verdicts]
        for v in out:
            rank = v["rank"]
            if v["state"] == "flagged":
                self._price(v, report)
                self.open[rank] = v
                if v["cause"] == "rank_lost":
                    self.corr.mark_lost(rank)
                    self._lost_epoch += 1
            else:
                self.open.pop(rank, None)
                if v["cause"] == "rank_lost":
                    self.corr.revive(rank)
                    self._lost_epoch += 1
            self._verdicts += 1
            if v["state"] == "flagged":
                self.verdicts_total[v["cause"]] = self.verdicts_total.get(v["cause"], 0) + 1
        return out
