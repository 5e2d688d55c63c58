"""What the HTML report shows, computed from trace records (pure; no I/O, no plotting).

:func:`build` runs the records through the detection :class:`~fsdp_sentinel.pipeline.Pipeline`
and draws every figure from what the pipeline itself computed, so the report,
``/metrics`` and the verdicts can never disagree about a step: per-rank steps
with the compute/wait split the detector judged, per-peer throughput and srtt
series from the flows as the correlator attributed them, flagged spans from
verdicts, and the verdict, action and fault tables. Both the report page and
the demo's end-of-run summary read it, so the figures a user sees in the
terminal and in the HTML agree.

Definitions (the report's legend repeats them):

- *wait* of a step: the correlator's blocked time for that rank and step (the
  union of its ``coll`` ``[issue, end]`` intervals); *compute* is the step
  time minus the wait. Steps the pipeline never summarised (their ``step``
  record came after the step was judged) are not shown.
- a *flagged span*: from a rank's ``flagged`` verdict to its next ``cleared``
  verdict; when none follows it is *open at end*, and runs to the end of the
  job's last step (a lost or hung rank's: to the end of the trace, the job
  being stopped from then on). The verdicts are the trace's own (what the
  daemon said live); a trace without any shows the verdicts the pipeline
  gives it in replay (``verdicts_replayed``).
- times on the page count from the job's first step (``origin``), not from
  the first probe record, which may come long before the job starts.
- per-peer figures: flows under the ``(rank, peer_rank)`` pair the
  correlator filed them under (``flows_unmapped``: those it could not).
  Throughput is the bytes a rank sent to the peer per second; the srtt of one
  poll's flows of a pair is weighted by bytes, as the detector weighs them.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_sentinel.correlate import RankStep, weighted_srtt
from fsdp_sentinel.detect import DetectConfig
from fsdp_sentinel.pipeline import Pipeline
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
    verdicts_replayed: bool = False
    #: The job's id ("" for a job without one, or a trace of no job).
    job: str = ""
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


def cause_text(v: Record) -> str:
    """A verdict's cause as the report says it: a network verdict says whether the
    host or the path between two ranks is to blame (its evidence's ``scope``)."""
    cause = str(v.get("cause", ""))
    scope = (v.get("evidence") or {}).get("scope")
    if cause != "network" or scope is None:
        return cause
    if scope == "link":
        return f"network: link rank {v['rank']} - rank {v.get('peer_rank')} (check the cable, port, switch path)"
    return f"network: node (check the host{' ' + str(v['host']) if v.get('host') else ''})"


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


class _Collector:
    """The pipeline's observer: its step figures and its flows' pairs, kept for the report."""

    def __init__(self) -> None:
        self.steps: dict[tuple[int, int], RankStep] = {}
        # One probe poll gives every flow the same t: (pair, t) -> that poll's flows.
        self.flows: dict[tuple[int, int], dict[float, list[Record]]] = defaultdict(
            lambda: defaultdict(list)
        )

    def on_step(self, step: int, ranks: Sequence[RankStep]) -> None:
        for rs in ranks:
            self.steps[(rs.rank, step)] = rs

    def on_flow(self, rec: Record, pair: tuple[int, int]) -> None:
        self.flows[pair][round(float(rec["t"]), 3)].append(rec)

    def peer_series(self) -> dict[tuple[int, int], list[PeerPoint]]:
        out: dict[tuple[int, int], list[PeerPoint]] = {}
        for pair, by_t in sorted(self.flows.items()):
            pts = []
            for t, recs in sorted(by_t.items()):
                dt = max(float(r["dt"]) for r in recs) or 1.0
                tx = sum(float(r["tx_bytes"]) for r in recs)
                rx = sum(float(r["rx_bytes"]) for r in recs)
                srtt = weighted_srtt((r.get("srtt_us"), int(r["tx_bytes"])) for r in recs)
                retrans = sum(int(r.get("retrans") or 0) for r in recs)
                pts.append(PeerPoint(t, tx / dt, rx / dt, srtt, retrans))
            out[pair] = pts
        return out


def merge_faults(faults: Iterable[Record]) -> list[Record]:
    """One record per fault: the lab writes a fault's onset record and, when
    it clears it, the same record again with ``end`` added (same ``t``)."""
    by_key: dict[tuple[Any, ...], Record] = {}
    for f in faults:
        key = (f.get("host"), f.get("rank"), f.get("what"), f.get("t"))
        by_key[key] = {**by_key.get(key, {}), **f}
    return list(by_key.values())


class _Book:
    """What the report keeps of a stream: the trace's whole, or one pipeline's
    records (one attempt of one job, as the router fed it)."""

    def __init__(self) -> None:
        self.seen = _Collector()
        self.counts: Counter[str] = Counter()
        self.ranks: dict[int, RankInfo] = {}
        self.step_recs: list[Record] = []
        self.kept: dict[str, list[Record]] = {"verdict": [], "action": [], "fault": []}
        self.lo, self.hi = float("inf"), float("-inf")

    def take(self, rec: Record) -> None:
        kind = rec.get("kind", "")
        self.counts[kind] += 1
        if kind == "header":
            return
        # The extent is every record's time (netdev and conn records go on
        # after the ranks die), plus step starts and fault ends.
        t = record_time(rec)
        extra = rec.get("start") if kind == "step" else rec.get("end") if kind == "fault" else None
        self.lo = min(self.lo, t, float(extra) if extra is not None else t)
        self.hi = max(self.hi, t, float(extra) if extra is not None else t)
        if kind == "rank":
            self.ranks[int(rec["rank"])] = RankInfo(
                int(rec["rank"]),
                str(rec.get("host", "")),
                rec.get("pid"),
                tuple(str(a) for a in rec.get("addrs") or ()),
                rec.get("world_size"),
            )
        elif kind == "step":
            self.step_recs.append(rec)
        elif kind in self.kept:
            self.kept[kind].append(rec)


class _BookedPipeline(Pipeline):
    """A job's pipeline that also keeps the report's book of every record it is fed."""

    def __init__(self, config: DetectConfig | None, book: _Book) -> None:
        super().__init__(config, observer=book.seen)
        self.book = book

    def feed(self, rec: Record) -> Sequence[Record]:
        self.book.take(rec)
        return super().feed(rec)


def build_jobs(records: Iterable[Record], config: DetectConfig | None = None) -> list[ReportData]:
    """Summarise a (merged, time-ordered) record stream for the report: one
    :class:`ReportData` per job, in the order the jobs started.

    The records go through a :class:`~fsdp_sentinel.jobs.JobRouter`, as in
    ``replay`` (``config``: its thresholds, for the verdicts of a trace that
    has none recorded), so each job is judged on its own and every step and
    flow figure is its pipeline's own. The attempts of one job (an elastic
    restart) are one report; a job without an id is never joined to another
    (it cannot be told apart). A trace of one job reports the whole trace:
    its extent and record counts. The trace's verdict and action records go to
    the job they name (``job``), else to the job that announced their rank.
    """
    from fsdp_sentinel.jobs import JobRouter

    router = JobRouter(config, pipeline_factory=lambda cfg: _BookedPipeline(cfg, _Book()))
    whole = _Book()
    replayed: list[Record] = []
    said: dict[str, list[Record]] = defaultdict(list)  # job id -> its verdicts and actions
    for rec in records:
        whole.take(rec)
        if rec.get("kind") in ("verdict", "action"):
            said[_job_named(rec, router)].append(rec)
        caused = router.feed(rec)
        if caused:
            replayed.extend(caused)
    replayed.extend(router.end())
    groups: dict[Any, list[Any]] = {}
    for job in sorted(router.all_jobs(), key=lambda j: (j.started_t, j.attempt)):
        job.pipeline.summarise_pending()
        # A job without an id is each attempt on its own (another job, for all we know).
        groups.setdefault(job.job or ("", job.attempt), []).append(job)
    if len(groups) <= 1:  # one job (or none): the page covers the whole trace
        jobs = next(iter(groups.values()), [])
        attempts = [_book_of(j) for j in jobs] if jobs else [whole]
        data = _assemble(attempts, [r for recs in said.values() for r in recs], replayed)
        data.job = jobs[0].job if jobs else ""
        data.counts = whole.counts
        if whole.lo <= whole.hi:
            data.t0, data.t1 = whole.lo, whole.hi
            data.spans = _spans(data.verdicts, data.job_end(), data.t1)
        data.flows_unmapped = sum(j.pipeline.stats["unattributed_flows"] for j in jobs)
        return [data]
    by_job: dict[str, list[Record]] = defaultdict(list)
    for v in replayed:
        by_job[str(v.get("job", ""))].append(v)
    out: list[ReportData] = []
    for key, jobs in groups.items():
        jid = key if isinstance(key, str) else ""
        mine, again = said.get(jid, []), by_job.get(jid, [])
        if not jid:  # of the jobs without an id, this attempt's by time
            lo, hi = jobs[0].started_t, jobs[0].retired_t
            mine, again = _between(mine, lo, hi), _between(again, lo, hi)
        data = _assemble([_book_of(j) for j in jobs], mine, again)
        data.job = jid
        data.flows_unmapped = sum(j.pipeline.stats["unattributed_flows"] for j in jobs)
        out.append(data)
    return out


def _book_of(job: Any) -> _Book:
    """The book a job's pipeline kept (every pipeline of this router is booked)."""
    pipe: _BookedPipeline = job.pipeline
    return pipe.book


def _between(recs: list[Record], lo: float, hi: float | None) -> list[Record]:
    return [r for r in recs if lo <= float(r["t"]) and (hi is None or float(r["t"]) < hi)]


def _job_named(rec: Record, router: Any) -> str:
    """The job a trace's verdict or action record belongs to."""
    jid = rec.get("job")
    if isinstance(jid, str):
        return jid
    job = router.job_of_rank(rec.get("rank"))
    return job.job if job is not None else ""


def _merged(books: list[_Book]) -> _Book:
    """The attempts of one job as one book (their records in order; each
    attempt's steps stay its own pipeline's, see :func:`_step_rows`)."""
    if len(books) == 1:
        return books[0]
    out = _Book()
    for b in books:
        out.counts.update(b.counts)
        out.ranks.update(b.ranks)
        for k, recs in b.kept.items():
            out.kept[k].extend(recs)
        out.lo, out.hi = min(out.lo, b.lo), max(out.hi, b.hi)
        for pair, by_t in b.seen.flows.items():
            for t, recs in by_t.items():
                out.seen.flows[pair][t].extend(recs)
    return out


def _step_rows(book: _Book) -> list[StepRow]:
    """The steps of one pipeline's records, with the compute/wait split it judged."""
    judged = dict(book.seen.steps)
    rows = []
    for rec in book.step_recs:
        key = (int(rec["rank"]), int(rec["step"]))
        rs = judged.get(key)
        if rs is None or rs.step_s is None:
            continue  # the pipeline never judged it (late); nor do we show it
        start, end = float(rec["start"]), float(rec["end"])
        rows.append(StepRow(key[0], key[1], start, end, rs.wait_s, rs.n_coll))
        del judged[key]  # a step record delivered twice is one row
    return rows


def _assemble(books: list[_Book], said: list[Record], replayed: list[Record]) -> ReportData:
    """One job's :class:`ReportData` from its attempts' books: steps as each
    attempt's pipeline judged them, the trace's own verdicts (else the replayed
    ones), spans and peers."""
    book = _merged(books)
    data = ReportData()
    data.counts = book.counts
    data.ranks = dict(book.ranks)
    if book.lo <= book.hi:
        data.t0, data.t1 = book.lo, book.hi
    data.steps = [row for b in books for row in _step_rows(b)]
    data.steps.sort(key=lambda s: (s.rank, s.step, s.start))
    data.faults = merge_faults(book.kept["fault"])
    data.verdicts = [r for r in said if r.get("kind") == "verdict"]
    data.actions = [r for r in said if r.get("kind") == "action"]
    if not data.verdicts and replayed:
        data.verdicts, data.verdicts_replayed = list(replayed), True
    for kind in ("verdicts", "actions", "faults"):
        getattr(data, kind).sort(key=lambda r: float(r["t"]))
    data.spans = _spans(data.verdicts, data.job_end(), data.t1)
    data.peers = book.seen.peer_series()
    return data


def build(records: Iterable[Record], config: DetectConfig | None = None) -> ReportData:
    """:func:`build_jobs` of a trace of one job (a ValueError names the jobs
    of a trace that holds several)."""
    jobs = build_jobs(records, config)
    if len(jobs) > 1:
        names = ", ".join(repr(d.job) for d in jobs)
        raise ValueError(f"the trace holds {len(jobs)} jobs ({names}): use build_jobs")
    return jobs[0]
