"""What the HTML report shows, computed from trace records (pure; no I/O, no plotting).

:func:`build` turns a stream of trace-v1 records into a :class:`ReportData`:
per-rank steps with their compute/wait split, per-peer throughput and srtt
series, flagged spans from verdicts, and the verdict, action and fault tables.
Both the report page and the demo's end-of-run summary read it, so the figures
a user sees in the terminal and in the HTML agree.

Definitions (the report's legend repeats them):

- *wait* of a step: the length of the union of that rank's ``coll``
  ``[issue, end]`` intervals for the step, clipped to the step's
  ``[start, end]``; *compute* is the step time minus the wait.
- a *flagged span*: from a rank's ``flagged`` verdict to its next ``cleared``
  verdict; when none follows it is *open at end*, and runs to the end of the
  job's last step (a lost or hung rank's: to the end of the trace, the job
  being stopped from then on).
- times on the page count from the job's first step (``origin``), not from
  the first probe record, which may come long before the job starts.
- per-peer figures: flows mapped to ``(rank, peer_rank)``, taken from the flow
  record's own ``rank``/``peer_rank`` when present, otherwise from the ``rank``
  records (``(host, pid)`` -> rank for the local end, ``addrs`` -> rank for the
  remote address). Throughput is the bytes a rank sent to the peer per second.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fsdp_sentinel.trace import record_time

Record = dict[str, Any]


@dataclass(frozen=True)
class RankInfo:
    rank: int
    host: str = ""
    pid: int | None = None
    addrs: tuple[str, ...] = ()
    world_size: int | None = None


@dataclass(frozen=True)
class StepRow:
    """One optimizer step on one rank, with its compute/wait split."""

    rank: int
    step: int
    start: float
    end: float
    wait: float
    colls: int

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def compute(self) -> float:
        return max(0.0, self.seconds - self.wait)


@dataclass(frozen=True)
class Span:
    """A rank flagged from ``start`` to ``end`` (``open`` when never cleared)."""

    rank: int
    cause: str
    start: float
    end: float
    step: int
    open: bool = False


@dataclass(frozen=True)
class PeerPoint:
    t: float
    tx_rate: float  # bytes/s, rank -> peer
    rx_rate: float  # bytes/s, peer -> rank
    srtt_us: float | None
    retrans: int


@dataclass(frozen=True)
class Phases:
    """Median step time (s) before, during and after a fault, over all ranks."""

    before: float | None
    during: float | None
    after: float | None


@dataclass
class ReportData:
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    steps: list[StepRow] = field(default_factory=list)
    verdicts: list[Record] = field(default_factory=list)
    actions: list[Record] = field(default_factory=list)
    faults: list[Record] = field(default_factory=list)
    peers: dict[tuple[int, int], list[PeerPoint]] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    flows_unmapped: int = 0
    t0: float = 0.0
    t1: float = 0.0

    @property
    def world_size(self) -> int | None:
        sizes = [r.world_size for r in self.ranks.values() if r.world_size]
        if sizes:
            return max(sizes)
        ranks = self.rank_ids()
        return len(ranks) if ranks else None

    def rank_ids(self) -> list[int]:
        ids = set(self.ranks) | {s.rank for s in self.steps}
        ids |= {a for a, _ in self.peers} | {b for _, b in self.peers}
        return sorted(ids)

    def steps_of(self, rank: int) -> list[StepRow]:
        # Indexed once: a 1,000-rank report asks for every rank's steps several times.
        index = self.__dict__.get("_steps_by_rank")
        if index is None or index[0] is not self.steps or index[1] != len(self.steps):
            by_rank: dict[int, list[StepRow]] = defaultdict(list)
            for s in self.steps:
                by_rank[s.rank].append(s)
            index = self.__dict__["_steps_by_rank"] = (self.steps, len(self.steps), by_rank)
        return list(index[2].get(rank, ()))

    @property
    def origin(self) -> float:
        """Where the page's time axis starts: the job's first step, else the trace's start."""
        return min(s.start for s in self.steps) if self.steps else self.t0

    def job_end(self) -> float:
        """The end of the job's last step, else the trace's end."""
        return max(s.end for s in self.steps) if self.steps else self.t1

    def step_range(self) -> tuple[int, int] | None:
        if not self.steps:
            return None
        nums = [s.step for s in self.steps]
        return min(nums), max(nums)

    def first_flags(self) -> list[Record]:
        """The first ``flagged`` verdict of each rank, in time order."""
        seen: set[int] = set()
        out = []
        for v in self.verdicts:
            if v.get("state") == "flagged" and v["rank"] not in seen:
                seen.add(v["rank"])
                out.append(v)
        return out

    def phases(self, fault: Record | None = None) -> Phases:
        """Step times around ``fault`` (default: the first fault in the trace).

        A step is *during* when it overlaps ``[fault.t, end)`` (see
        :meth:`fault_end`), *before* when it ended by the onset and *after*
        when it started at or after the end.
        """
        if fault is None:
            if not self.faults:
                return Phases(_median([s.seconds for s in self.steps]), None, None)
            fault = self.faults[0]
        onset = float(fault["t"])
        stop = self.fault_end(fault)
        before = [s.seconds for s in self.steps if s.end <= onset]
        during = [s.seconds for s in self.steps if s.end > onset and s.start < stop]
        after = [s.seconds for s in self.steps if s.start >= stop]
        return Phases(_median(before), _median(during), _median(after))

    def fault_end(self, fault: Record) -> float:
        """When ``fault`` ended: its ``end``; else the first start of step
        ``end_step`` (the trainer's own stalls say when they stop by step);
        else never (``inf``)."""
        if fault.get("end") is not None:
            return float(fault["end"])
        end_step = fault.get("end_step")
        if end_step is not None:
            starts = [s.start for s in self.steps if s.step >= int(end_step)]
            if starts:
                return min(starts)
        return float("inf")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[lo, hi]``."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals)
    total = 0.0
    cur_a = cur_b = None
    for a, b in clipped:
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None and cur_a is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None and cur_a is not None:
        total += cur_b - cur_a
    return total


def _ip(endpoint: str) -> str:
    """``"1.2.3.4:80"`` -> ``"1.2.3.4"``; ``"[::1]:80"`` -> ``"::1"``."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        return endpoint
    return host.strip("[]")


def _spans(verdicts: list[Record], last_step_end: float, trace_end: float) -> list[Span]:
    """Flagged spans; one never cleared is open at end: a straggler's span ends
    with the job's last step (the probes' samples after it say nothing of the
    straggler), a lost or hung rank's with the trace (the job stays stopped)."""
    open_: dict[int, Record] = {}
    out: list[Span] = []
    for v in verdicts:
        rank = v["rank"]
        if v.get("state") == "flagged":
            if rank not in open_:
                open_[rank] = v
        elif v.get("state") == "cleared" and rank in open_:
            f = open_.pop(rank)
            out.append(Span(rank, str(f["cause"]), float(f["t"]), float(v["t"]), int(f["step"])))
    for rank, f in open_.items():
        t_end = trace_end if f["cause"] in ("rank_lost", "hang") else last_step_end
        out.append(
            Span(
                rank,
                str(f["cause"]),
                float(f["t"]),
                max(t_end, float(f["t"])),
                int(f["step"]),
                True,
            )
        )
    out.sort(key=lambda s: (s.start, s.rank))
    return out


class _FlowMapper:
    """Maps a flow record to ``(rank, peer_rank)`` (either may stay None)."""

    def __init__(self, ranks: dict[int, RankInfo]) -> None:
        self.by_host_pid: dict[tuple[str, Any], int] = {
            (r.host, r.pid): r.rank for r in ranks.values() if r.pid is not None
        }
        pids = Counter(r.pid for r in ranks.values() if r.pid is not None)
        # A pid alone names a rank only when no two ranks share it (ranks in
        # separate pid namespaces could).
        self.by_pid: dict[Any, int] = {
            r.pid: r.rank for r in ranks.values() if r.pid is not None and pids[r.pid] == 1
        }
        # Likewise an address names a rank only when one rank alone owns it
        # (ranks sharing one host share its addresses).
        owners = Counter(a for r in ranks.values() for a in set(r.addrs))
        self.by_addr = {a: r.rank for r in ranks.values() for a in r.addrs if owners[a] == 1}

    def __call__(self, rec: Record) -> tuple[int | None, int | None]:
        rank = rec.get("rank")
        if rank is None:
            rank = self.by_host_pid.get((rec.get("host", ""), rec.get("pid")))
        if rank is None:
            rank = self.by_pid.get(rec.get("pid"))
        if rank is None:
            rank = self.by_addr.get(_ip(str(rec.get("src", ""))))
        peer = rec.get("peer_rank")
        if peer is None:
            peer = self.by_addr.get(_ip(str(rec.get("dst", ""))))
        return rank, peer


def _peer_series(
    flows: list[Record], mapper: _FlowMapper
) -> tuple[dict[tuple[int, int], list[PeerPoint]], int]:
    # One probe poll gives every flow the same t; group by (pair, t) and sum.
    buckets: dict[tuple[int, int], dict[float, list[Record]]] = defaultdict(
        lambda: defaultdict(list)
    )
    unmapped = 0
    for rec in flows:
        rank, peer = mapper(rec)
        if rank is None or peer is None or rank == peer:
            unmapped += 1
            continue
        buckets[(int(rank), int(peer))][round(float(rec["t"]), 3)].append(rec)
    out: dict[tuple[int, int], list[PeerPoint]] = {}
    for pair, by_t in sorted(buckets.items()):
        pts = []
        for t, recs in sorted(by_t.items()):
            dt = max(float(r["dt"]) for r in recs) or 1.0
            tx = sum(float(r["tx_bytes"]) for r in recs)
            rx = sum(float(r["rx_bytes"]) for r in recs)
            srtts = [float(r["srtt_us"]) for r in recs if r.get("srtt_us") is not None]
            retrans = sum(int(r.get("retrans") or 0) for r in recs)
            srtt = statistics.fmean(srtts) if srtts else None
            pts.append(PeerPoint(t, tx / dt, rx / dt, srtt, retrans))
        out[pair] = pts
    return out, unmapped


def merge_faults(faults: Iterable[Record]) -> list[Record]:
    """One record per fault: the lab writes a fault's onset record and, when
    it clears it, the same record again with ``end`` added (same ``t``)."""
    by_key: dict[tuple[Any, ...], Record] = {}
    for f in faults:
        key = (f.get("host"), f.get("rank"), f.get("what"), f.get("t"))
        by_key[key] = {**by_key.get(key, {}), **f}
    return list(by_key.values())


def build(records: Iterable[Record]) -> ReportData:
    """Summarise a (merged, time-ordered) record stream for the report."""
    data = ReportData()
    step_recs: list[Record] = []
    colls: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    flows: list[Record] = []
    lo, hi = float("inf"), float("-inf")
    for rec in records:
        kind = rec.get("kind", "")
        data.counts[kind] += 1
        if kind == "header":
            continue
        # The trace's extent is every record's time (netdev and conn records
        # go on after the ranks die), plus step starts and fault ends.
        t = record_time(rec)
        extra = rec.get("start") if kind == "step" else rec.get("end") if kind == "fault" else None
        lo = min(lo, t, float(extra) if extra is not None else t)
        hi = max(hi, t, float(extra) if extra is not None else t)
        if kind == "rank":
            data.ranks[int(rec["rank"])] = RankInfo(
                int(rec["rank"]),
                str(rec.get("host", "")),
                rec.get("pid"),
                tuple(str(a) for a in rec.get("addrs") or ()),
                rec.get("world_size"),
            )
        elif kind == "step":
            step_recs.append(rec)
        elif kind == "coll":
            colls[(int(rec["rank"]), int(rec["step"]))].append(
                (float(rec["issue"]), float(rec["end"]))
            )
        elif kind == "flow":
            flows.append(rec)
        elif kind in ("verdict", "action", "fault"):
            getattr(data, kind + "s").append(rec)
    if lo <= hi:
        data.t0, data.t1 = lo, hi
    for rec in step_recs:
        key = (int(rec["rank"]), int(rec["step"]))
        start, end = float(rec["start"]), float(rec["end"])
        ivs = colls.get(key, [])
        data.steps.append(
            StepRow(key[0], key[1], start, end, union_length(ivs, start, end), len(ivs))
        )
    data.steps.sort(key=lambda s: (s.rank, s.step))
    data.faults = merge_faults(data.faults)
    for kind in ("verdicts", "actions", "faults"):
        getattr(data, kind).sort(key=lambda r: float(r["t"]))
    data.spans = _spans(data.verdicts, data.job_end(), data.t1)
    data.peers, data.flows_unmapped = _peer_series(flows, _FlowMapper(data.ranks))
    return data
