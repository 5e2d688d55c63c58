"""One pipeline per job: a long-running daemon (or a replay) that sees several jobs.

A node daemon outlives the jobs it watches (a DaemonSet, a systemd unit): jobs
come one after another and sometimes at once, each with its own ranks 0..N-1,
its own steps from 0 and its own pids. One :class:`~fsdp_sentinel.pipeline.Pipeline`
fed all of them mixes them (rank 0 of the second job "is" rank 0 of the first,
its steps are "late", the first job's end looks like a lost rank). The
:class:`JobRouter` keeps them apart:

* **Who a record belongs to.** A ``rank`` record names its job (``job``; absent:
  the job ``""``, every such record one job) and its process: ``host_pid``,
  the pid the kernel gave the daemon for the sender (the ingest socket's
  ``SCM_CREDENTIALS``), else ``pid``. Later records are routed by ``host_pid``
  (every record that came through the ingest socket has one), then, for probe
  records (``flow``, ``conn``, ``nccl``, keyed by the host's tgid), by ``pid``,
  then by ``rank`` (the job that announced that rank last: traces written
  before ``host_pid`` existed). Records of no single job (``clock``,
  ``netdev``, ``rdma``, a flow of a process no rank announced) go to every
  live job on the node.
* **Life cycle.** A job's pipeline is made on its first ``rank`` record and
  retired when none of its ranks has been heard from for ``grace_s`` seconds
  of stream time (every rank done or lost, then the grace period); its records
  after that are dropped and counted (``stale``), its series leave the
  snapshot. A new **attempt** (an elastic restart: a ``rank`` record of a known
  rank with another ``attempt``, or, without one, another pid) replaces the
  attempt's pipeline with a fresh one (liveness, steps, open verdicts start
  over) that keeps the detector's history (the job's step-time and srtt
  baselines, the noise floor, each rank's own compute history). A job with no
  id cannot be told from another job, so a new pid there starts a new job
  with no history.
* **Output.** Every verdict gets its job's ``job`` (when the job has an id);
  :meth:`JobRouter.snapshot` is one :class:`~fsdp_sentinel.snapshot.Snapshot`
  over every live job, each rank and peer series carrying its ``job``.

The router only routes: each pipeline sees exactly the records of its job and
of the node, in stream order, so a job judged beside others gets the verdicts
it gets alone (``tests/test_jobs.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_sentinel.detect import DetectConfig, DetectState
from fsdp_sentinel.detect.state import restart_tracks
from fsdp_sentinel.pipeline import Pipeline, feed_all
from fsdp_sentinel.snapshot import JobView, Snapshot
from fsdp_sentinel.trace import KEY

Record = dict[str, Any]

_KIND, _HOST_PID, _PID, _RANK = KEY["kind"], KEY["host_pid"], KEY["pid"], KEY["rank"]
_T = KEY["t"]

#: Probe records keyed by the host's tgid (``pid``), not by a rank.
PID_KINDS = frozenset({"flow", "conn", "nccl"})

#: Default seconds of stream time a job outlives the last record of its ranks.
DEFAULT_GRACE_S = 60.0

#: A retired job comes back when one of its processes is heard from within
#: this many grace periods (a quiet spell: a long checkpoint or evaluation).
REVIVE_FACTOR = 10

#: Retired attempts remembered (for replay's summary and for revival).
RETIRED_KEPT = 64

_NOTHING: tuple[Record, ...] = ()

#: Rank records' kinds that carry a ``rank`` and name no process of their own.
_RANK_KEYED = frozenset({"coll", "step", "pending"})


@dataclass(slots=True)
class Job:
    """One attempt of one job and the pipeline judging it (the router's bookkeeping)."""

    job: str
    attempt: int
    pipeline: Pipeline
    started_t: float
    #: The node's time (:attr:`JobRouter.now`) when its ranks were last heard
    #: from (a record routed to it alone); -inf until the node's clock is known.
    heard_t: float
    #: The ``attempt`` its rank records announced (None: they carry none).
    announced_attempt: Any = None
    #: rank -> the process (host pid) that announced it in this attempt.
    rank_pids: dict[Any, Any] = field(default_factory=dict)
    #: Node-wide records it was given, by kind (not its own: counted once node-wide).
    shared: dict[str, int] = field(default_factory=dict)
    verdicts: int = 0
    retired_t: float | None = None
    #: ``pipeline.feed``, bound once (the router's hot path calls it per record).
    feed: Callable[[Record], Sequence[Record]] = field(init=False)

    def __post_init__(self) -> None:
        self.feed = self.pipeline.feed


@dataclass(frozen=True)
class JobSummary:
    """What a job (one attempt) came to, for replay's summary."""

    job: str
    attempt: int
    ranks: int
    steps: int
    verdicts: int
    started_t: float
    retired_t: float | None
    open: tuple[tuple[int, str], ...]  # (rank, cause) of verdicts still open


def restart_state(old: DetectState, warmup: int = 0) -> DetectState:
    """The detector's state for a new attempt of a job: its history, no liveness.

    Kept: the job's step-time and srtt baselines, the noise floor, each rank's
    own compute history (what "slower than it used to" is measured against).
    Dropped: open verdicts, lost and hung ranks, the recent window, the
    persistence counters and the network memo. The attempt's first ``warmup``
    steps are a warm-up (``restart_warmup``), as a job's first steps are.
    """
    return DetectState(
        tracks=restart_tracks(old.tracks),
        job_hist=old.job_hist,
        srtt_hist=old.srtt_hist,
        rel_noise=old.rel_noise,
        warmup=warmup,
    )


class JobRouter:
    """Routes a record stream to one :class:`Pipeline` per job (see the module docstring).

    ``feed(rec)`` returns the verdict records the record caused, each with its
    job's ``job``; ``snapshot()`` covers every live job. ``jobs`` holds the
    live ones by id, ``retired`` every attempt that ended (oldest first).
    """

    def __init__(
        self,
        config: DetectConfig | None = None,
        *,
        grace_s: float = DEFAULT_GRACE_S,
        pipeline_factory: Callable[[DetectConfig | None], Pipeline] = Pipeline,
    ) -> None:
        self.config = config
        self.grace_s = grace_s
        self._make = pipeline_factory
        self.jobs: dict[str, Job] = {}
        #: The latest retired attempts, oldest first (a bounded memory of them).
        self.retired: deque[Job] = deque(maxlen=RETIRED_KEPT)
        self._by_pid: dict[Any, Job] = {}
        self._by_rank: dict[Any, Job] = {}
        self._stale: dict[Any, Job] = {}  # pid of a retired attempt -> that attempt
        self._next_check = -math.inf
        #: The node's time: the newest time of a record of no single job (the
        #: daemon's ``clock``, ``netdev``), against which silence is measured
        #: (the ranks' clocks may differ from it); -inf until one arrives.
        self.now = -math.inf
        self.stale = 0  # records of a replaced attempt's processes, dropped
        self.revived = 0  # retired jobs heard from again
        self.records = 0
        self.verdicts_total: dict[str, int] = {}
        # Totals of retired jobs, so node-wide counters never go backwards.
        self._retired_totals: dict[str, int] = {}
        self._shared_totals: dict[str, int] = {}

    # ------------------------------------------------------------ feeding

    def feed(self, rec: Record) -> Sequence[Record]:
        """Route one record; return the verdict records it caused (usually none)."""
        self.records += 1
        pid = rec.get(_HOST_PID)
        try:
            if pid is not None:
                # The hot path (every record from the ingest socket but rank ones).
                job = self._by_pid.get(pid)
                if job is not None and rec.get(_KIND) != "rank":
                    out = job.feed(rec)
                    job.heard_t = self.now
                    return self._stamp(job, out) if out else _NOTHING
            else:
                # The hot paths of a trace from before host_pid (every captured
                # trace), each finding the job ``_route`` would: the one that
                # announced the rank, or (a flow's) the process.
                kind = rec.get(_KIND)
                if kind in _RANK_KEYED:
                    job = self._by_rank.get(rec.get(_RANK))
                elif kind in PID_KINDS:
                    job = self._by_pid.get(rec.get(_PID))
                else:
                    job = None
                if job is not None:
                    out = job.feed(rec)
                    job.heard_t = self.now
                    return self._stamp(job, out) if out else _NOTHING
        except TypeError:  # an unhashable pid or rank: routed as if it had none
            pid = _hashable(pid)
        return self._route(rec, pid)

    def _route(self, rec: Record, pid: Any) -> Sequence[Record]:
        kind = rec.get(_KIND)
        if kind == "rank":
            return self._on_rank(rec)
        if pid is None and kind in PID_KINDS:
            pid = _hashable(rec.get(_PID))
        job = self._by_pid.get(pid) if pid is not None else None
        if job is None:
            rank = _hashable(rec.get(_RANK))
            if pid is not None and pid in self._stale:
                job = self._back(pid)
                if job is None:
                    return _NOTHING  # a replaced attempt's process: counted
            elif kind not in PID_KINDS and rank is not None:
                # No process to go by (a trace from before host_pid), or one
                # that never announced itself: the job that announced the rank
                # last, else (a trace cut at the start) the job with no id.
                job = self._by_rank.get(rank) or self._job_for("", rec, None)
            else:
                return self._broadcast(rec, kind)
        return self._feed_one(job, rec)

    def _back(self, pid: Any) -> Job | None:
        """A retired attempt's process heard again: the job was only quiet (a long
        checkpoint) and comes back, unless another attempt took its place (then
        None: the record is stale, and counted)."""
        old = self._stale[pid]
        if old.job in self.jobs:
            self.stale += 1
            return None
        self._revive(old)
        return old

    def feed_many(self, recs: Iterable[Record]) -> list[Record]:
        if type(recs) is list:
            return self.feed_batch(recs)
        return feed_all(self.feed, recs)

    def feed_batch(self, recs: Sequence[Record]) -> list[Record]:
        """``feed`` each of ``recs`` in order; the verdict records they caused.

        While one job is live (a trace of one job), the runs of its ``coll``
        records that need nothing but filing go straight to its pipeline
        (:meth:`Pipeline.file_run`, gated on the very lookups ``feed`` routes
        by); every other record is routed by ``feed``. The same verdicts.
        """
        out: list[Record] = []
        n = len(recs)
        i = 0
        jobs = self.jobs
        feed = self.feed
        while i < n:
            # Only a coll record can start a run: the others (a step's,
            # probes') skip the call.
            if len(jobs) == 1 and recs[i].get(_KIND) == "coll":
                for job in jobs.values():
                    j = job.pipeline.file_run(recs, i, (self._by_rank, self._by_pid, job))
                    if j > i:
                        self.records += j - i
                        job.heard_t = self.now
                        i = j
                if i == n:
                    break
            v = feed(recs[i])
            if v:
                out.extend(v)
            i += 1
        return out

    def end(self) -> list[Record]:
        """The input ended: every live job's pipeline releases what its stream
        guard still holds aside (:meth:`Pipeline.end`), stamped with its job."""
        out: list[Record] = []
        for job in list(self.jobs.values()):
            held = job.pipeline.end()
            if held:
                out.extend(self._stamp(job, held))
        return out

    def _feed_one(self, job: Job, rec: Record) -> Sequence[Record]:
        out = job.feed(rec)
        job.heard_t = self.now
        return self._stamp(job, out) if out else _NOTHING

    def _broadcast(self, rec: Record, kind: Any) -> Sequence[Record]:
        key = kind if type(kind) is str else "other"
        self._shared_totals[key] = self._shared_totals.get(key, 0) + 1
        out: list[Record] = []
        t = rec.get(_T)
        if (type(t) is float or type(t) is int) and t > self.now:
            self.now = float(t)
        for job in list(self.jobs.values()):
            job.shared[key] = job.shared.get(key, 0) + 1
            v = job.pipeline.feed(rec)
            if v:
                out.extend(self._stamp(job, v))
            if job.heard_t == -math.inf:
                job.heard_t = self.now
        if self.now >= self._next_check:
            self._next_check = self.now + 1.0
            self._retire_idle(self.now)
        return out

    def _on_rank(self, rec: Record) -> Sequence[Record]:
        jid = rec.get("job") or ""
        if type(jid) is not str:
            jid = str(jid)
        pid = rec.get(_HOST_PID)
        if pid is None:
            pid = rec.get(_PID)
        old = self._stale.get(pid)
        if old is not None and old.job == jid and jid not in self.jobs:
            self._revive(old)
        job = self._job_for(jid, rec, pid)
        rank = rec.get(_RANK)
        job.rank_pids[rank] = pid
        self._by_pid[pid] = job
        self._by_rank[rank] = job
        self._stale.pop(pid, None)
        return self._feed_one(job, rec)

    def _job_for(self, jid: str, rec: Record, pid: Any) -> Job:
        """The live attempt ``rec`` (a rank record, or a stray rank's record) belongs to."""
        job = self.jobs.get(jid)
        t = rec.get("t", rec.get("end"))
        t = float(t) if isinstance(t, (int, float)) else max(self.now, 0.0)
        if job is None:
            return self._start(jid, 1, t, rec.get("attempt"), None)
        if rec.get(_KIND) != "rank":
            return job
        attempt = rec.get("attempt")
        known = job.rank_pids.get(rec.get(_RANK))
        if attempt is not None:
            new = job.announced_attempt is not None and attempt != job.announced_attempt
        else:
            new = known is not None and known != pid
        if not new:
            if job.announced_attempt is None:
                job.announced_attempt = attempt
            return job
        self._retire(job, self.now)
        history = job.pipeline.state if jid else None  # no id: another job, no history
        return self._start(jid, job.attempt + 1, t, attempt, history)

    def _start(self, jid: str, attempt: int, t: float, announced: Any, history: Any) -> Job:
        pipe = self._make(self.config)
        if history is not None:
            pipe.state = restart_state(history, pipe.config.baseline.restart_warmup)
        job = Job(jid, attempt, pipe, t, self.now, announced)
        self.jobs[jid] = job
        return job

    def _stamp(self, job: Job, verdicts: Sequence[Record]) -> Sequence[Record]:
        for v in verdicts:
            if job.job:
                v["job"] = job.job
            job.verdicts += 1
            if v.get("state") == "flagged":
                cause = str(v["cause"])
                self.verdicts_total[cause] = self.verdicts_total.get(cause, 0) + 1
        return verdicts

    # ------------------------------------------------------------ life cycle

    def _retire_idle(self, now: float) -> None:
        for job in [j for j in self.jobs.values() if now - j.heard_t >= self.grace_s]:
            self._retire(job, now)
        # A retired job's processes are remembered long enough to come back
        # from a long quiet spell, then forgotten (pids are reused).
        keep = REVIVE_FACTOR * self.grace_s
        for pid in [p for p, j in self._stale.items() if now - (j.retired_t or now) >= keep]:
            del self._stale[pid]

    def _retire(self, job: Job, t: float) -> None:
        """Stop judging ``job``: its series leave the snapshot, its totals stay counted."""
        job.retired_t = t
        if self.jobs.get(job.job) is job:
            del self.jobs[job.job]
        self.retired.append(job)
        for k, n in self._own_totals(job).items():
            self._retired_totals[k] = self._retired_totals.get(k, 0) + n
        for pid in [p for p, j in self._by_pid.items() if j is job]:
            del self._by_pid[pid]
            self._stale[pid] = job
        for rank in [r for r, j in self._by_rank.items() if j is job]:
            del self._by_rank[rank]

    def _revive(self, job: Job) -> None:
        """A retired job's process spoke again: it was quiet, not over."""
        self.revived += 1
        job.retired_t = None
        self.jobs[job.job] = job
        if job in self.retired:
            self.retired.remove(job)
        for k, n in self._own_totals(job).items():
            left = self._retired_totals.get(k, 0) - n
            if left > 0:
                self._retired_totals[k] = left
            else:
                self._retired_totals.pop(k, None)
        for rank, pid in job.rank_pids.items():
            self._stale.pop(pid, None)
            self._by_pid[pid] = job
            self._by_rank.setdefault(rank, job)

    @staticmethod
    def _own_totals(job: Job) -> dict[str, int]:
        """Records ``job`` was fed that were its own (node-wide ones are counted once)."""
        own = dict(job.pipeline.records_total)
        for k, n in job.shared.items():
            left = own.get(k, 0) - n
            if left > 0:
                own[k] = left
            else:
                own.pop(k, None)
        return own

    # ------------------------------------------------------------ views

    @property
    def records_total(self) -> dict[str, int]:
        """Records fed, by kind, each counted once (node-wide ones too), retired jobs included."""
        out = dict(self._retired_totals)
        for src in (self._shared_totals, *(self._own_totals(j) for j in self.jobs.values())):
            for k, n in src.items():
                out[k] = out.get(k, 0) + n
        return out

    @property
    def stats(self) -> dict[str, int]:
        """The pipelines' stats summed over every job (``records``: fed to the router)."""
        out: dict[str, int] = {}
        for job in self.all_jobs():
            for k, n in job.pipeline.stats.items():
                out[k] = out.get(k, 0) + n
        out["records"] = self.records
        out["stale"] = self.stale
        out["jobs"] = len(self.retired) + len(self.jobs)
        return out

    def job_of_rank(self, rank: Any) -> Job | None:
        """The live job that announced ``rank`` last (None: none does)."""
        try:
            return self._by_rank.get(rank)
        except TypeError:  # unhashable
            return None

    def all_jobs(self) -> list[Job]:
        """Every attempt seen, oldest first: retired ones, then the live ones."""
        return sorted([*self.retired, *self.jobs.values()], key=lambda j: j.started_t)

    def summaries(self) -> list[JobSummary]:
        return [
            JobSummary(
                job=j.job,
                attempt=j.attempt,
                ranks=len(j.pipeline.corr.ranks),
                steps=j.pipeline.stats["steps"],
                verdicts=j.verdicts,
                started_t=j.started_t,
                retired_t=j.retired_t,
                open=tuple((r, str(v["cause"])) for r, v in sorted(j.pipeline.open.items())),
            )
            for j in self.all_jobs()
        ]

    def snapshot(self) -> Snapshot:
        """One snapshot over every live job: each rank and peer series carries its job."""
        snaps = [(j, j.pipeline.snapshot()) for j in sorted(self.jobs.values(), key=_order)]
        ranks = tuple(
            r if r.job == j.job else dataclasses.replace(r, job=j.job)
            for j, s in snaps
            for r in s.ranks
        )
        # The pipeline names each peer's job already (its ranks'); replace is slow.
        peers = tuple(
            p if p.job == j.job else dataclasses.replace(p, job=j.job)
            for j, s in snaps
            for p in s.peers
        )
        nccl = tuple(dataclasses.replace(n, job=j.job) for j, s in snaps for n in s.nccl)
        newest = snaps[-1][1] if snaps else Snapshot()
        return Snapshot(
            t=max([0.0, self.now, *(s.t for _, s in snaps)]),
            world_size=newest.world_size,
            ranks=ranks,
            peers=peers,
            verdicts_total=dict(self.verdicts_total),
            records_total=self.records_total,
            # Node-wide: every live pipeline holds the same port counters.
            rdma_ports=newest.rdma_ports,
            nccl=nccl,
            jobs=tuple(
                JobView(job=j.job, attempt=j.attempt, world_size=s.world_size, ranks=len(s.ranks))
                for j, s in snaps
            ),
        )


def _hashable(key: Any) -> Any:
    """``key``, or None when it cannot be looked up (an ill-typed field: the
    pipeline it reaches counts the record as malformed)."""
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _order(job: Job) -> tuple[float, str]:
    return (job.started_t, job.job)
