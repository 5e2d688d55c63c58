"""``fsdp-sentinel run``: the live daemon (probes + ingest socket + detection + exporter).

Threads, and who owns what:

- the **ingest** thread (:class:`~fsdp_sentinel.ingest.IngestServer`) receives
  the ranks' records and puts them on a queue; it touches nothing else;
- the **pipeline** thread (the one that calls :meth:`Daemon.run`; the main
  thread under ``fsdp-sentinel run``) owns the probes, the pipeline, the
  remediator and the trace writers. Once a second (``take_every``; at once
  for a ``rank`` record) it takes the records queued so far, in one go, and
  every ``interval`` seconds it takes them and then polls the probes. Each
  record is written to the trace and then fed to the pipeline, and the
  verdicts the pipeline returns (and the
  remediator's actions) are written right after it, so the trace's order is
  the pipeline's order and ``fsdp-sentinel replay`` of the trace reproduces the
  verdicts. After each poll it publishes an immutable snapshot;
- the **HTTP** thread serves ``/metrics`` and ``/api/v1/snapshot`` from the
  published snapshot, and ``--live`` redraws the table from it: readers never
  touch the pipeline, so the hot path takes no lock of ours.

SIGINT/SIGTERM end the loop; the queue is drained, the probes polled a last
time, the remediator undoes its changes, the probes are detached and the trace
is flushed and closed; the exit status is 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fsdp_sentinel.ingest import DEFAULT_SOCKET, QUEUE_BYTES, QUEUE_FULL, IngestServer
from fsdp_sentinel.snapshot import Snapshot
from fsdp_sentinel.trace import TIME_FIELD, TraceWriter
from fsdp_sentinel.trace_segments import SegmentedTraceWriter

log = logging.getLogger("fsdp_sentinel.daemon")

HELP = "the live daemon: probes, ingest socket, detection, exporter"
DESCRIPTION = (
    "Run the live daemon. Training ranks announce themselves and send their step and\n"
    "collective records to the ingest socket; kernel probes measure their TCP flows;\n"
    "the detection pipeline flags the rank that holds the job back and why. Metrics\n"
    "are served for Prometheus, the live table for `fsdp-sentinel top`, and one\n"
    "trace file holds everything (replay it to get the same verdicts)."
)
EPILOG = """examples:
  fsdp-sentinel run --trace-out run.jsonl.zst
  fsdp-sentinel run --live --verdicts-out verdicts.jsonl
  fsdp-sentinel run --no-probes --socket /tmp/s/ingest.sock --metrics-addr off
  fsdp-sentinel top                       # the table of a running daemon

SIGINT/SIGTERM: detach probes, undo tc changes, flush the trace, exit 0.
"""

DEFAULT_METRICS_ADDR = "127.0.0.1:18965"  # exporters.http.DEFAULT_ADDR (a test checks)
REMEDIATE_MODES = ("off", "dry-run", "apply")

Record = dict[str, Any]


# --------------------------------------------------------------------------- seams


class ProbeSource(Protocol):
    """What the daemon needs of :class:`fsdp_sentinel.probes.loader.ProbeSet`."""

    def start(self) -> Any: ...
    def register_pid(self, pid: int) -> None: ...
    def unregister_pid(self, pid: int) -> None: ...
    def poll(self) -> list[Record]: ...
    def close(self) -> None: ...


class PipelineLike(Protocol):
    """What the daemon needs of :class:`fsdp_sentinel.jobs.JobRouter` (or one
    :class:`fsdp_sentinel.pipeline.Pipeline`)."""

    def feed(self, rec: Record) -> Sequence[Record]: ...
    def snapshot(self) -> Snapshot: ...


class Remediator(Protocol):
    """Receives every verdict; returns the ``action`` records of what it did.

    ``close()`` undoes every change still in place (returning its
    ``rolled_back`` actions); it is called once, at exit. A remediator may
    also have ``observe(rec)`` (every input record, before the pipeline gets
    it), ``tick()`` (once per poll, returning actions) and ``views()``
    (``(host, dev, active)`` per managed device, for the snapshot); the
    daemon calls them when present. ``on_verdict`` runs before the verdict is
    written, so evidence it adds to the verdict is in the trace.
    """

    def on_verdict(self, verdict: Record) -> list[Record]: ...
    def close(self) -> list[Record]: ...


class NullRemediator:
    """``--remediate off``: looks at nothing, changes nothing."""

    def on_verdict(self, verdict: Record) -> list[Record]:
        return []

    def close(self) -> list[Record]:
        return []


def make_remediator(mode: str, host: str, **options: Any) -> Remediator:
    """The remediator for ``--remediate MODE`` (``off`` is built in); ``options`` go to
    :func:`fsdp_sentinel.remediate.build_remediator`."""
    if mode == "off":
        return NullRemediator()
    from fsdp_sentinel import remediate

    built: Remediator = remediate.build_remediator(mode, host=host, **options)
    return built


def default_probes(interval: float, host: str, netns: str | None = None) -> ProbeSource:
    """The probes, counting only registered pids; ``netns``: read only that named
    namespace's devices (a node daemon for one lab host or pod), else every one's."""
    from fsdp_sentinel.probes.loader import ProbeConfig, ProbeSet

    only = (netns,) if netns else None
    config = ProbeConfig(interval=interval, pid_filter=True, host=host, netns_only=only)
    probes: ProbeSource = ProbeSet(config)
    return probes


def default_pipeline(config_path: str | None) -> PipelineLike:
    """One pipeline per job (:class:`fsdp_sentinel.jobs.JobRouter`): a daemon outlives its jobs."""
    from fsdp_sentinel.jobs import JobRouter

    config = None
    if config_path:
        from fsdp_sentinel.detect import DetectConfig

        config = DetectConfig.from_file(config_path)
    pipeline: PipelineLike = JobRouter(config)
    return pipeline


# --------------------------------------------------------------------------- daemon


@dataclass(frozen=True)
class DaemonConfig:
    socket_path: str = DEFAULT_SOCKET
    #: Group (gid) given to the ingest socket, mode 0660: its non-root members
    #: may send (``--socket-group``); None: the daemon's own group.
    socket_group: int | None = None
    trace_out: str | None = None
    #: Rotate ``trace_out`` at this many bytes (``trace_segments``); None: one file.
    trace_max_bytes: int | None = None
    #: Closed segments kept when rotating (None: all).
    trace_keep: int | None = None
    verdicts_out: str | None = None
    #: (host, port) for /metrics and /api/v1/snapshot; None disables; port 0 picks one.
    metrics_addr: tuple[str, int] | None = ("127.0.0.1", 18965)
    interval: float = 1.0
    #: Records waiting for the pipeline beyond this are refused (counted ``queue_full``).
    queue_max: int = 200_000
    #: Record bytes (each record's line of its datagram) waiting for the
    #: pipeline beyond this are refused (counted ``queue_bytes``): a count cap
    #: alone lets 200,000 datagrams of 64 KiB hold 12 GiB. A parsed record
    #: takes a few times its line's bytes.
    queue_max_bytes: int = 32 * 1024 * 1024
    #: How often registered pids are checked for having exited.
    pid_check_interval: float = 5.0
    #: Take a rank record's pid as sent (``--trust-record-pid``: a relay, a
    #: replayed stream); by default the kernel's pid for the sender decides.
    trust_record_pid: bool = False
    #: The pipeline thread takes what the ingest queue holds in one go this
    #: often (and before every tick; at once for a ``rank`` record), instead
    #: of waking for each datagram: see :meth:`Daemon._loop`. Capped at ``interval``.
    take_every: float = 1.0


class Daemon:
    """The live daemon; see the module docstring for its threads.

    Boundaries are injected: ``pipeline``, ``probes`` (None: no probes),
    ``remediator``, ``clock`` (monotonic, for the poll timer) and
    ``proc_root`` (to notice registered pids that exited).
    """

    def __init__(
        self,
        config: DaemonConfig,
        *,
        pipeline: PipelineLike,
        probes: ProbeSource | None = None,
        remediator: Remediator | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] | None = time.time,
        host: str = "",
        proc_root: str = "/proc",
    ) -> None:
        self.config = config
        self._wall = wall_clock
        self.host = host
        self.pipeline = pipeline
        self.probes = probes
        self.remediator: Remediator = remediator or NullRemediator()
        # The optional parts of the remediator seam (see Remediator).
        self._observe: Callable[[Record], None] | None = getattr(remediator, "observe", None)
        self._clock = clock
        self._proc = Path(proc_root)
        # Items are (record, its bytes in the datagram). The bytes waiting are
        # _bytes_in - _bytes_out: each counter has one writer (the ingest
        # thread, the pipeline thread), so neither needs a lock. Nobody waits
        # on it: the pipeline thread waits on _wake (a stop, a rank record)
        # or for its next take (see _loop).
        self._queue: queue.SimpleQueue[tuple[Record, int]] = queue.SimpleQueue()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._bytes_in = 0
        self._bytes_out = 0
        self._stopping = False
        self._snapshot = Snapshot()
        self.pids: set[int] = set()
        self.counts: Counter[str] = Counter()  # records by kind, plus "verdict", "action"
        self.pipeline_errors = 0
        self.restarts = 0  # times the pipeline loop died and was started again
        self.ingest: IngestServer | None = None
        self.http: Any = None
        self._bpf_stats: Any = None  # probes.bpfstats.RunStats while probes run
        self._trace: TraceWriter | SegmentedTraceWriter | None = None
        self._verdicts: TraceWriter | None = None
        self._failed: set[int] = set()  # writers whose failure was logged
        self._synced: dict[int, int] = {}  # id(writer) -> records at its last sync
        self._started = False
        self._closed = False

    # ----------------------------------------------------------------- life cycle

    def start(self) -> None:
        """Open outputs, attach probes, bind the socket, serve HTTP. On failure
        everything opened so far is closed again and the error re-raised."""
        try:
            cfg = self.config
            if cfg.trace_out and cfg.trace_max_bytes:
                self._trace = SegmentedTraceWriter(
                    cfg.trace_out, cfg.trace_max_bytes, cfg.trace_keep
                )
            elif cfg.trace_out:
                self._trace = TraceWriter(cfg.trace_out)
            if cfg.verdicts_out:
                self._verdicts = TraceWriter(cfg.verdicts_out)
            if self.probes is not None:
                from fsdp_sentinel.probes.bpfstats import RunStats

                self._bpf_stats = RunStats()
                log.info("BPF run statistics on (%s)", self._bpf_stats.describe())
                report = self.probes.start()
                attached = getattr(report, "attached", [])
                log.info("probes attached: %s", ", ".join(attached) or "none")
                for name, why in getattr(report, "missing", []):
                    log.warning("probe %s not attached: %s", name, why)
            else:
                log.warning("running without probes (--no-probes): no flow figures")
            self.ingest = IngestServer(
                cfg.socket_path,
                self._enqueue,
                socket_group=cfg.socket_group,
                trust_pid=cfg.trust_record_pid,
                sized=True,
            ).start()
            log.info(
                "listening on %s (receive buffer %d KiB)",
                cfg.socket_path,
                self.ingest.rcvbuf // 1024,
            )
            if cfg.metrics_addr is not None:
                from fsdp_sentinel.exporters.http import MetricsServer
                from fsdp_sentinel.exporters.prometheus import build_registry

                registry = build_registry(self.snapshot)
                self.http = MetricsServer(cfg.metrics_addr, registry, self.snapshot).start()
                log.info("serving %s/metrics and %s/api/v1/snapshot", self.http.url, self.http.url)
            self._started = True
        except BaseException:
            self.close()
            raise

    def _enqueue(self, rec: Record, nbytes: int = 0) -> bool | str:
        """Runs on the ingest thread: a bounded hand-off, nothing more. Over
        either cap the record is refused under its reason (the ingest server
        counts it); the sender never waits: its datagram was already taken."""
        if self._queue.qsize() >= self.config.queue_max:
            return QUEUE_FULL
        if self._bytes_in - self._bytes_out + nbytes > self.config.queue_max_bytes:
            return QUEUE_BYTES
        self._bytes_in += nbytes
        self._queue.put((rec, nbytes))
        if rec.get("kind") == "rank":
            # A new rank's pid goes to the probes' filter now, not at the
            # next take: its first connections are counted as before.
            self._wake.put(None)
        return True

    @property
    def queued_bytes(self) -> int:
        """Datagram bytes waiting for the pipeline now."""
        return self._bytes_in - self._bytes_out

    def request_stop(self) -> None:
        """Ask :meth:`run` to return; safe from a signal handler or another thread."""
        self._stopping = True
        self._wake.put(None)  # SimpleQueue.put is reentrant

    def run(self) -> None:
        """The pipeline loop, until :meth:`request_stop`; then drains and polls once more.

        Supervised: a loop that dies (a bug past every ``_safely``) is logged,
        counted (``thread_restarts_total{thread="pipeline"}``) and run again."""
        while True:
            try:
                self._loop()
                return
            except Exception:
                self.restarts += 1
                log.exception("pipeline loop died; starting it again")
                if self._stopping:
                    return

    def _loop(self) -> None:
        """Every ``take_every`` seconds (at most ``interval``) the records
        queued so far are handled in one go, in arrival order; at each tick
        first those, then the tick's own (clock, probe records), then the
        snapshot is published. The thread sleeps in between: a wake-up per
        take, not one per datagram (16 a second from 4 ranks), and the
        pipeline's code runs warm over a burst of records. Verdicts, the
        trace's order and every published snapshot are as they were (the
        snapshot, the one view of the pipeline between ticks, holds every
        record that arrived before its tick); a verdict is found up to
        ``take_every`` later by the wall clock, never later in the stream.
        A ``rank`` record is taken at once (its pid goes to the probes)."""
        interval = self.config.interval
        every = min(self.config.take_every, interval)
        clock = self._clock
        wait = self._wake.get
        next_poll = clock() + interval
        next_take = clock() + every
        next_pid_check = clock() + self.config.pid_check_interval
        self._tick()
        while not self._stopping:
            now = clock()
            if now >= next_poll:
                self._take()
                self._tick()
                # Skip missed ticks rather than bursting to catch up.
                next_poll = max(next_poll + interval, now + interval / 2)
                next_take = now + every
                if now >= next_pid_check:
                    self._forget_exited_pids()
                    next_pid_check = now + self.config.pid_check_interval
                continue
            if now >= next_take:
                self._take()
                next_take = now + every
                continue
            try:
                wait(timeout=min(next_poll, next_take) - now)
            except queue.Empty:
                continue
            self._take()
        self._drain()
        self._tick()

    def _take(self) -> None:
        """The records queued now, in order (those that arrive meanwhile wait
        for the next take: a flood cannot hold the tick off)."""
        get = self._queue.get_nowait
        for _ in range(self._queue.qsize()):
            rec, nbytes = get()
            self._bytes_out += nbytes
            self._handle(rec, decoded=True)

    def _drain(self) -> None:
        while True:
            try:
                rec, nbytes = self._queue.get_nowait()
            except queue.Empty:
                return
            self._bytes_out += nbytes
            self._handle(rec, decoded=True)

    def close(self) -> None:
        """Stop receiving, undo remediation, detach probes, close outputs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.ingest is not None:
            self.ingest.close()
            self._drain()  # what arrived before the socket closed
        self._end_stream()
        for action in self._safely("remediator close", self.remediator.close) or []:
            self._write_action(action)
        if self.probes is not None:
            self._safely("probe detach", self.probes.close)
            self.probes = None
        if self._bpf_stats is not None:
            self._bpf_stats.close()
            self._bpf_stats = None
        if self.http is not None:
            self.http.close()
            self.http = None
        for writer in (self._trace, self._verdicts):
            if writer is not None:
                writer.close()
        if self._started:
            self._started = False
            self._log_summary()

    def _end_stream(self) -> None:
        """The input ended: what the stream guard still holds aside is fed as
        it is (``JobRouter.end()``), as replay does at the end of its input, so
        the verdicts it gives are the same live and in replay, and in the trace."""
        end = getattr(self.pipeline, "end", None)
        if end is None or not self._started:
            return
        for verdict in self._safely("pipeline end", end) or []:
            self._handle_verdict(verdict)

    def _safely(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:
            log.exception("%s failed", what)
            return None

    # ----------------------------------------------------------------- hot path

    def _handle(self, rec: Record, decoded: bool = False) -> None:
        """One record through trace, remediator and pipeline. ``decoded``: it came
        from the ingest socket, which decoded and checked it (``parse_datagram``):
        the trace writer then neither checks it again nor encodes it the slow way."""
        kind = rec["kind"]
        # Counted by kind, unknown kinds as one: a stream of new kinds grows nothing.
        self.counts[kind if kind in TIME_FIELD else "other"] += 1
        if kind == "rank":
            # The probes key on host tgids: the kernel's pid for the sender.
            self._register(rec.get("host_pid", rec.get("pid")))
        if self._trace is not None:
            self._trace.write(rec, decoded)
        if self._observe is not None:
            self._safely("remediator observe", self._observe, rec)
        try:
            verdicts = self.pipeline.feed(rec)
        except Exception:
            # A record the pipeline cannot digest must not stop the daemon;
            # replay of the trace will meet (and report) the same record.
            self.pipeline_errors += 1
            if self.pipeline_errors <= 10:
                log.exception("pipeline failed on a %s record; record kept in the trace", kind)
            return
        for verdict in verdicts:
            self._handle_verdict(verdict)

    def _handle_verdict(self, verdict: Record) -> None:
        self.counts["verdict"] += 1
        # The remediator first: it may add its evidence to the verdict, and
        # its actions are written right after the verdict they answer.
        actions = self._safely("remediator", self.remediator.on_verdict, verdict) or []
        if self._trace is not None:
            self._trace.write(verdict)
        if self._verdicts is not None:
            self._verdicts.write(verdict)
        log.warning(
            "verdict: rank %s %s (cause %s, score %.3g) at step %s",
            verdict.get("rank"),
            verdict.get("state"),
            verdict.get("cause"),
            float(verdict.get("score") or 0.0),
            verdict.get("step"),
        )
        for action in actions:
            self._write_action(action)

    def _write_action(self, action: Record) -> None:
        self.counts["action"] += 1
        log.info("action: %s %s on %s %s", action.get("what"), action.get("state"),
                 action.get("host"), action.get("dev"))  # fmt: skip
        if self._trace is not None:
            self._trace.write(action)

    def _tick(self) -> None:
        # The daemon's own heartbeat first: the stream clock moves every
        # interval even when no rank and no probe says anything (every rank
        # blocked, --no-probes), so silence and hangs can be judged. It goes
        # through _handle like any record, into the trace, so replay feeds it
        # at the same place. ``wall_clock=None`` (tests) writes none.
        if self._wall is not None:
            self._handle({"kind": "clock", "t": self._wall(), "host": self.host})
        if self.probes is not None:
            recs = self._safely("probe poll", self.probes.poll) or []
            for rec in recs:
                self._handle(rec)
        tick = getattr(self.remediator, "tick", None)
        if tick is not None:
            for action in self._safely("remediator tick", tick) or []:
                self._write_action(action)
        self._publish()
        self._sync_outputs()

    def _sync_outputs(self) -> None:
        # TraceWriter syncs on write only; when records stop coming the last
        # ones would wait in a buffer. Sync at the tick if anything is new.
        for writer in (self._trace, self._verdicts):
            if writer is not None and writer.records != self._synced.get(id(writer)):
                writer.sync()
                self._synced[id(writer)] = writer.records
            if writer is not None and writer.failed is not None and id(writer) not in self._failed:
                # The writer switched itself off (a full disk: ENOSPC); the
                # daemon goes on detecting, exporting and remediating.
                self._failed.add(id(writer))
                log.error("%s: write failed (%s); writing it stopped, detection goes on",
                          writer.path, writer.failed)  # fmt: skip

    def _publish(self) -> None:
        try:
            snap = self.pipeline.snapshot()
        except Exception:
            log.exception("pipeline snapshot failed")
            return
        ingest = self.ingest
        http = self.http
        restarts = {"pipeline": self.restarts}
        if ingest is not None:
            restarts["ingest"] = ingest.restarts
        if http is not None:
            restarts["http"] = http.restarts
        snap = dataclasses.replace(snap, thread_restarts_total=restarts)
        outputs = {"trace": self._trace, "verdicts": self._verdicts}
        writers = {name: w for name, w in outputs.items() if w is not None}
        if writers:  # a write error is logged once by _sync_outputs, counted here
            snap = dataclasses.replace(
                snap,
                trace_write_errors_total={n: int(w.failed is not None) for n, w in writers.items()},
                trace_records_lost_total={n: w.lost for n, w in writers.items()},
            )
        if ingest is not None:
            snap = dataclasses.replace(
                snap,
                ingest_dropped_total=ingest.dropped_total,
                ingest_malformed_total=ingest.malformed_total,
                ingest_messages_total={"accepted": ingest.accepted, **ingest.dropped},
            )
        views = getattr(self.remediator, "views", None)
        if views is not None:
            from fsdp_sentinel.snapshot import RemediationView

            got = self._safely("remediator views", views) or []
            snap = dataclasses.replace(
                snap, remediation=tuple(RemediationView(h, d, bool(a)) for h, d, a in got)
            )
        if self.probes is not None:
            snap = self._with_probe_health(snap, self.probes)
        self._snapshot = snap  # one reference swap: readers see old or new

    def _with_probe_health(self, snap: Snapshot, probes: ProbeSource) -> Snapshot:
        # Optional on a ProbeSource: ProbeSet has both; a stand-in may have neither.
        from fsdp_sentinel.snapshot import BpfProgramView

        lost = getattr(probes, "lost_events", None)
        stats = getattr(probes, "program_stats", None)
        progs = (self._safely("program stats", stats) or {}) if stats else {}
        # One read of the programs' fdinfo a tick: the lost events' count of
        # skipped runs comes from the same figures.
        return dataclasses.replace(
            snap,
            events_lost_total=(self._safely("lost events", lost, progs) or {}) if lost else {},
            bpf_programs=tuple(
                BpfProgramView(name, f.get("run_cnt", 0), f.get("run_time_ns", 0))
                for name, f in sorted(progs.items())
            ),
        )

    def snapshot(self) -> Snapshot:
        """The latest published snapshot (any thread)."""
        return self._snapshot

    # ----------------------------------------------------------------- pids

    def _register(self, pid: Any) -> None:
        if not isinstance(pid, int) or pid <= 0 or pid in self.pids:
            return
        self.pids.add(pid)
        log.info("rank process %d announced itself", pid)
        if self.probes is not None:
            self._safely("register pid", self.probes.register_pid, pid)

    def _forget_exited_pids(self) -> None:
        # A pid that exited may be reused by an unrelated process: stop counting it.
        for pid in [p for p in self.pids if not (self._proc / str(p)).exists()]:
            self.pids.discard(pid)
            log.info("rank process %d exited", pid)
            if self.probes is not None:
                self._safely("unregister pid", self.probes.unregister_pid, pid)

    def _log_summary(self) -> None:
        ingest = self.ingest
        dropped = {why: n for why, n in ingest.dropped.items() if n} if ingest is not None else {}
        log.info(
            "stopped: %d records (%s), %d verdicts, %d actions, ingest dropped %s",
            sum(n for k, n in self.counts.items() if k not in ("verdict", "action")),
            ", ".join(
                f"{k} {n}" for k, n in sorted(self.counts.items()) if k not in ("verdict", "action")
            )
            or "none",  # fmt: skip
            self.counts["verdict"],
            self.counts["action"],
            dropped or 0,
        )
        if self.pipeline_errors:
            log.error("the pipeline failed on %d records", self.pipeline_errors)
        for writer in (self._trace, self._verdicts):
            if writer is not None and (writer.failed is not None or writer.unencodable):
                log.error("%s: %d records not written after %s, %d not encodable", writer.path,
                          writer.lost, writer.failed, writer.unencodable)  # fmt: skip


# --------------------------------------------------------------------------- command


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is now, so ``--live`` can redirect logs
    above its table."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup_logging(level: str) -> None:
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("fsdp_sentinel")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        default=DEFAULT_SOCKET,
        metavar="PATH",
        help=f"ingest socket the ranks send to (default {DEFAULT_SOCKET})",
    )
    parser.add_argument(
        "--socket-group",
        type=_group,
        metavar="NAME",
        help="give the ingest socket this group (name or gid), mode 0660, so ranks "
        "running as non-root members of it can send (default: the daemon's group)",
    )
    parser.add_argument("--trace-out", metavar="FILE", help="write every record here (.zst ok)")
    parser.add_argument(
        "--trace-max-bytes",
        type=_size,
        metavar="SIZE",
        help="rotate --trace-out at this size (e.g. 512M, 2G): the full file becomes "
        "FILE's stem.NNNNNN.suffixes, each segment a whole trace (default: no cap)",
    )
    parser.add_argument(
        "--trace-keep",
        type=_count,
        metavar="N",
        help="with --trace-max-bytes: keep only the newest N closed segments (default: all)",
    )
    parser.add_argument("--verdicts-out", metavar="FILE", help="write verdict records here")
    parser.add_argument(
        "--metrics-addr",
        default=DEFAULT_METRICS_ADDR,
        metavar="HOST:PORT",
        type=_metrics_addr,
        help=f"serve /metrics and /api/v1/snapshot here, or 'off' (default {DEFAULT_METRICS_ADDR})",
    )
    parser.add_argument(
        "--remediate",
        choices=REMEDIATE_MODES,
        default="off",
        help="reprioritise a straggler's traffic with tc: off (default), dry-run, apply",
    )
    parser.add_argument(
        "--remediate-dev",
        action="append",
        type=_device_spec,
        metavar="[HOST=][NETNS/]IFNAME",
        help="a device remediation may manage, for verdicts of HOST (default: this host); "
        "repeatable (default: this host's default-route device)",
    )
    parser.add_argument(
        "--remediate-rate-mbit",
        type=float,
        metavar="MBIT",
        help="the link rate when neither a shaper on the device nor sysfs gives it",
    )
    parser.add_argument(
        "--trust-record-pid",
        action="store_true",
        help="take a rank record's pid as sent, not the kernel's pid for its sender "
        "(a relay or a replayed stream sends for ranks it is not)",
    )
    parser.add_argument("--live", action="store_true", help="show the live per-rank table")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="one daemon per node: meet the other nodes' daemons in the job's own c10d "
        "store (found from the ranks' rank records), elect a leader, act on its verdicts",
    )
    parser.add_argument(
        "--netns",
        metavar="NAME",
        type=_netns_name,
        help="the node is this named network namespace (/run/netns/NAME): read only its "
        "devices, and reach the job's store from inside it (the daemon itself stays here)",
    )
    parser.add_argument(
        "--interval",
        type=_interval,
        default=1.0,
        metavar="S",
        help="probe poll and snapshot period in seconds (default 1)",
    )
    parser.add_argument("--config", metavar="FILE", help="detection thresholds (DetectConfig file)")
    parser.add_argument(
        "--no-probes",
        action="store_true",
        help="do not load eBPF probes (hosts without eBPF, tests): no flow figures",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="stderr log level (default info)",
    )


def _metrics_addr(text: str) -> tuple[str, int] | None:
    if text == "off":
        return None
    from fsdp_sentinel.exporters.http import parse_addr

    try:
        return parse_addr(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _group(text: str) -> int:
    """A group name (or a numeric gid that names a group) -> its gid."""
    import grp

    try:
        return grp.getgrgid(int(text)).gr_gid if text.isdigit() else grp.getgrnam(text).gr_gid
    except (KeyError, OverflowError, ValueError):
        raise argparse.ArgumentTypeError(f"no such group: {text!r}") from None


def _netns_name(text: str) -> str:
    from fsdp_sentinel.cluster.netns import NETNS_DIR

    if "/" in text or text in ("", ".", "..") or not os.path.exists(os.path.join(NETNS_DIR, text)):
        raise argparse.ArgumentTypeError(f"no network namespace {text!r} in {NETNS_DIR}")
    return text


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(text: str) -> int:
    """``1048576``, ``512K``, ``64M``, ``2G`` -> bytes (at least 64 KiB: a
    segment holds whole frames)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _SIZE_UNITS else ""
    try:
        value = int(float(t[: len(t) - len(unit)]) * _SIZE_UNITS[unit])
    except (ValueError, OverflowError):  # "x", "inf", "nan"
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M)") from None
    if value < 64 * 1024:
        raise argparse.ArgumentTypeError(f"at least 64K: {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def _device_spec(text: str) -> str:
    from fsdp_sentinel.remediate.config import parse_device

    try:
        parse_device(text, "-")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    # The probes' own bounds: shorter polls cost CPU, longer ones blur steps.
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 3600 s: {text!r}")
    return value


#: Capability numbers (linux/capability.h) remediation needs, by name.
_REMEDIATION_CAPS = {"CAP_BPF": 39, "CAP_NET_ADMIN": 12}
_CAP_SYS_ADMIN = 21


def _missing_capabilities(mode: str, status_path: str = "/proc/self/status") -> list[str]:
    """Capabilities ``--remediate MODE`` needs and this process lacks (its
    effective set; CAP_SYS_ADMIN stands in for CAP_BPF on older kernels). Checked
    before anything is compiled, so the message names the capability, not bcc's error."""
    if mode != "apply":
        return []
    try:
        text = Path(status_path).read_text()
    except OSError:
        return []
    caps = next(
        (int(ln.split()[1], 16) for ln in text.splitlines() if ln.startswith("CapEff:")), None
    )
    if caps is None:
        return []
    have = {name for name, bit in _REMEDIATION_CAPS.items() if caps >> bit & 1}
    if caps >> _CAP_SYS_ADMIN & 1:
        have.add("CAP_BPF")
    return [name for name in _REMEDIATION_CAPS if name not in have]


def _install_signals(daemon: Daemon) -> Iterable[tuple[int, Any]]:
    def handler(signum: int, frame: object) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        daemon.request_stop()

    previous = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous.append((sig, signal.signal(sig, handler)))
    return previous


def main(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    from fsdp_sentinel.hostinfo import host_name

    host = host_name()
    if args.trace_keep is not None and not (args.trace_out and args.trace_max_bytes):
        print("usage: fsdp-sentinel run ... --trace-out FILE --trace-max-bytes SIZE "
              "--trace-keep N", file=sys.stderr)  # fmt: skip
        print("fsdp-sentinel run: error: --trace-keep needs --trace-out and --trace-max-bytes",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        pipeline = default_pipeline(args.config)
    except (OSError, ValueError, TypeError) as e:
        print(f"fsdp-sentinel run: error: --config {args.config}: {e}", file=sys.stderr)
        return 2
    missing = _missing_capabilities(args.remediate)
    if missing:
        log.error("--remediate %s needs %s (to load its tc classifier and change qdiscs); "
                  "grant %s or run with --remediate off (docs/deploy.md)", args.remediate,
                  " and ".join(missing), ", ".join(missing))  # fmt: skip
        return 1
    try:
        remediator = make_remediator(
            args.remediate, host, devices=args.remediate_dev, rate_mbit=args.remediate_rate_mbit
        )
    except Exception as e:
        log.error("--remediate %s: cannot start remediation: %s", args.remediate, e)
        return 1
    config = DaemonConfig(
        socket_path=args.socket,
        socket_group=args.socket_group,
        trace_out=args.trace_out,
        trace_max_bytes=args.trace_max_bytes,
        trace_keep=args.trace_keep,
        verdicts_out=args.verdicts_out,
        metrics_addr=args.metrics_addr,
        interval=args.interval,
        trust_record_pid=args.trust_record_pid,
    )
    if args.cluster:
        # One daemon per node; the job's own store joins them (docs/cluster.md).
        from fsdp_sentinel.cluster.agent import ClusterAgent, ClusterPipeline

        agent = ClusterAgent(
            host, config=getattr(pipeline, "config", None), connect=_store_client(args.netns)
        )
        pipeline = ClusterPipeline(pipeline, agent, args.interval).start()
    daemon = Daemon(config, pipeline=pipeline, remediator=remediator, host=host)
    previous = _install_signals(daemon)
    try:
        try:
            if not args.no_probes:
                daemon.probes = default_probes(args.interval, host, args.netns)
            daemon.start()
        except Exception as e:
            if type(e).__name__ == "ProbePermissionError":
                log.error("cannot load probes: %s (run as root, or pass --no-probes)", e)
            else:
                log.error("cannot start: %s", e)
            return 1
        log.info("ready (pid %d)", os.getpid())
        if args.live:
            _run_with_live_table(daemon, args.interval)
        else:
            daemon.run()
    finally:
        daemon.close()
        if args.cluster:
            pipeline.close()  # type: ignore[attr-defined]
        for sig, old in previous:
            signal.signal(sig, old)
    return 0


def _store_client(netns: str | None) -> Callable[[str], Any]:
    """The cluster agent's store client: the job's TCPStore, reached from ``netns``."""
    from fsdp_sentinel.cluster.netns import in_netns
    from fsdp_sentinel.cluster.store import StoreUnreachable, tcp_store

    def connect(address: str) -> Any:
        try:
            return in_netns(netns, lambda: tcp_store(address, timeout_s=5.0))
        except OSError as e:  # the namespace went away: the store is out of reach
            raise StoreUnreachable(f"{address} from netns {netns}: {e}") from e

    return connect


def _run_with_live_table(daemon: Daemon, interval: float) -> None:
    from rich.live import Live

    from fsdp_sentinel.live import render

    with Live(
        get_renderable=lambda: render(daemon.snapshot(), now=time.time()),
        refresh_per_second=1.0 / interval,
        redirect_stdout=True,
        redirect_stderr=True,
    ):
        daemon.run()
