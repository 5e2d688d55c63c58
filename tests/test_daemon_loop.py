"""The daemon's pipeline loop in-process: record order, probes seam, remediator seam.

The daemon runs with a real ingest socket and real trace files. The
pipeline, the probe source and the remediator are small real stand-ins passed
through the constructor, so these tests pin the daemon's own contract (order,
seams) whatever the detector's thresholds are: LateRankPipeline is a
deterministic function of the record stream, as the real Pipeline is (the
subprocess tests in test_daemon_cli.py use the real one). The input records
come from fsdp_sentinel.synth (a synthetic job, for tests only).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from daemon_support import wait_for

from fsdp_sentinel.daemon import Daemon, DaemonConfig
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.snapshot import Snapshot
from fsdp_sentinel.synth import Hang, Scenario, SlowCompute, generate
from fsdp_sentinel.trace import read_trace

Record = dict[str, Any]


class LateRankPipeline:
    """Flags a rank that issues its collectives, on average over a step, more
    than ``lag`` seconds after the median rank (the others wait for it); clears
    it once it is back under. Judged when every rank's step record is in."""

    def __init__(self, lag: float = 0.03) -> None:
        self.lag = lag
        self.world = 0
        self.issues: dict[tuple[int, int], dict[int, float]] = {}  # (step, seq) -> rank -> issue
        self.reported: dict[int, int] = {}  # step -> step records seen
        self.flagged: set[int] = set()
        self.records_total: dict[str, int] = {}
        self.verdicts_total: dict[str, int] = {}

    def feed(self, rec: Record) -> list[Record]:
        kind = rec["kind"]
        self.records_total[kind] = self.records_total.get(kind, 0) + 1
        if kind == "rank":
            self.world = max(self.world, int(rec["world_size"]))
        elif kind == "coll":
            self.issues.setdefault((rec["step"], rec["seq"]), {})[rec["rank"]] = rec["issue"]
        elif kind == "step":
            n = self.reported[rec["step"]] = self.reported.get(rec["step"], 0) + 1
            if n == self.world:
                return self._judge(rec["step"], rec["end"])
        return []

    def _judge(self, step: int, t: float) -> list[Record]:
        late: dict[int, list[float]] = {}
        for key in [k for k in self.issues if k[0] == step]:
            by_rank = self.issues.pop(key)
            ordered = sorted(by_rank.values())
            median = ordered[len(ordered) // 2]
            for rank, issue in by_rank.items():
                late.setdefault(rank, []).append(issue - median)
        out = []
        for rank, lags in sorted(late.items()):
            mean = sum(lags) / len(lags)
            slow = mean > self.lag
            if slow != (rank in self.flagged):
                (self.flagged.add if slow else self.flagged.discard)(rank)
                out.append({"kind": "verdict", "t": t, "step": step, "rank": rank,
                            "state": "flagged" if slow else "cleared", "cause": "compute",
                            "score": round(mean, 4)})  # fmt: skip
                self.verdicts_total["compute"] = self.verdicts_total.get("compute", 0) + 1
        return out

    def snapshot(self) -> Snapshot:
        return Snapshot(
            records_total=dict(self.records_total), verdicts_total=dict(self.verdicts_total)
        )


@dataclass
class Report:
    attached: list[str] = field(default_factory=lambda: ["stand-in"])
    missing: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class ListProbes:
    """A probe source that hands out prepared records, a batch per poll."""

    batches: list[list[Record]] = field(default_factory=list)
    registered: list[int] = field(default_factory=list)
    unregistered: list[int] = field(default_factory=list)
    polls: int = 0
    closed: bool = False

    def start(self) -> Report:
        return Report()

    def register_pid(self, pid: int) -> None:
        self.registered.append(pid)

    def unregister_pid(self, pid: int) -> None:
        self.unregistered.append(pid)

    def poll(self) -> list[Record]:
        self.polls += 1
        return self.batches.pop(0) if self.batches else []

    def close(self) -> None:
        self.closed = True


class TaggingRemediator:
    """Answers each flagged verdict with a dry-run action; rolls back at close."""

    def __init__(self) -> None:
        self.seen: list[Record] = []

    def on_verdict(self, verdict: Record) -> list[Record]:
        self.seen.append(verdict)
        return [
            {
                "kind": "action",
                "t": verdict["t"],
                "host": "h",
                "dev": "fss-x",
                "what": "prio",
                "state": "dry_run",
                "rank": verdict["rank"],
            }  # fmt: skip
        ]

    def close(self) -> list[Record]:
        return [{"kind": "action", "t": 0.0, "host": "h", "dev": "fss-x", "what": "prio",
                 "state": "rolled_back"}]  # fmt: skip


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, Path]:
    return {
        "socket": tmp_path / "run" / "ingest.sock",
        "trace": tmp_path / "trace.jsonl",
        "verdicts": tmp_path / "verdicts.jsonl",
    }


class Running:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.thread = threading.Thread(target=daemon.run)

    def stop(self) -> None:
        self.daemon.request_stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        self.daemon.close()


@pytest.fixture
def running(paths) -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def start(**kw: Any) -> Running:
        cfg = DaemonConfig(
            socket_path=str(paths["socket"]),
            trace_out=str(paths["trace"]),
            verdicts_out=str(paths["verdicts"]),
            metrics_addr=None,
            interval=kw.pop("interval", 0.05),
            pid_check_interval=kw.pop("pid_check_interval", 5.0),
            take_every=kw.pop("take_every", 1.0),
            # This process sends for every synthetic rank (none of their pids).
            trust_record_pid=True,
        )
        # The synthetic jobs' records carry times of 2023: the daemon's real
        # wall-clock heartbeat would move their stream clock years on. Tests
        # of the heartbeat pass a wall clock of their own.
        kw.setdefault("wall_clock", None)
        d = Daemon(cfg, pipeline=kw.pop("pipeline", LateRankPipeline()), **kw)
        d.start()
        r = Running(d)
        r.thread.start()
        started.append(r)
        return r

    yield start
    for r in started:
        if r.thread.is_alive():
            r.stop()


def send_all(path: Path, recs: list[Record]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for i, rec in enumerate(recs):
            s.sendto(json.dumps(rec).encode(), str(path))
            if i % 100 == 99:
                time.sleep(0.002)  # the synthetic job is faster than any real one


def replay(recs: list[Record]) -> list[Record]:
    """The oracle: a fresh pipeline over the trace's inputs, in file order."""
    p = LateRankPipeline()
    return [v for r in recs if r["kind"] not in ("verdict", "action") for v in p.feed(r)]


def assert_verdicts_follow_their_records(body: list[Record]) -> None:
    """Feeding a fresh pipeline the trace's inputs one by one, each record's
    verdicts must be exactly the verdicts written right after it."""
    p = LateRankPipeline()
    i = 0
    while i < len(body):
        x = body[i]
        i += 1
        assert x["kind"] != "verdict", f"verdict at {i} does not follow the record that caused it"
        if x["kind"] == "action":
            continue
        for v in p.feed(x):
            assert body[i] == v
            i += 1
            while i < len(body) and body[i]["kind"] == "action":
                i += 1  # the remediator's answer to that verdict


def job() -> list[Record]:
    recs, _ = generate(
        Scenario(steps=20, faults=(SlowCompute(rank=2, factor=3.0, start=6, end=20),))
    )
    return recs


def test_trace_order_is_pipeline_order_and_replays_to_same_verdicts(running, paths) -> None:
    recs = job()
    r = running()
    send_all(paths["socket"], recs)
    wait_for(lambda: sum(r.daemon.snapshot().records_total.values()) >= len(recs))
    r.stop()

    trace = list(read_trace(paths["trace"]))
    assert trace[0]["kind"] == "header"
    body = trace[1:]
    inputs = [x for x in body if x["kind"] not in ("verdict", "action")]
    assert inputs == recs  # everything, in the order sent
    verdicts = [x for x in body if x["kind"] == "verdict"]
    assert verdicts, "the slow rank should have been flagged"
    assert {(v["rank"], v["cause"]) for v in verdicts if v["state"] == "flagged"} == {
        (2, "compute")
    }
    assert_verdicts_follow_their_records(body)
    assert replay(body) == verdicts
    assert [x for x in read_trace(paths["verdicts"]) if x["kind"] != "header"] == verdicts
    snap = r.daemon.snapshot()
    assert snap.verdicts_total == {"compute": 1}
    assert snap.ingest_dropped_total == 0


def test_probe_records_are_traced_and_pids_registered(running, paths, tmp_path) -> None:
    now = time.time()
    netdev = [
        {
            "kind": "netdev",
            "t": now + i,
            "dt": 1.0,
            "host": "h",
            "dev": "lo",
            "tx_bytes": i,
            "rx_bytes": i,
        }  # fmt: skip
        for i in range(3)
    ]
    probes = ListProbes(batches=[[n] for n in netdev])
    proc = tmp_path / "proc"
    (proc / "4001").mkdir(parents=True)
    (proc / "4002").mkdir()
    r = running(probes=probes, proc_root=str(proc), pid_check_interval=0.05)
    rank = {"kind": "rank", "t": now, "rank": 0, "world_size": 2, "host": "h", "pid": 4001,
            "addrs": []}  # fmt: skip
    send_all(paths["socket"], [rank, {**rank, "rank": 1, "pid": 4002}, rank])
    wait_for(lambda: probes.registered == [4001, 4002] and probes.polls > 4)
    (proc / "4002").rmdir()  # rank 1's process exits
    wait_for(lambda: probes.unregistered == [4002])
    r.stop()
    assert probes.closed
    kinds = [x["kind"] for x in read_trace(paths["trace"])]
    assert kinds.count("netdev") == 3 and kinds.count("rank") == 3


def test_remediator_sees_verdicts_and_its_actions_follow_them(running, paths) -> None:
    rem = TaggingRemediator()
    r = running(remediator=rem)
    recs = job()
    send_all(paths["socket"], recs)
    wait_for(lambda: sum(r.daemon.snapshot().records_total.values()) >= len(recs))
    r.stop()
    body = [x for x in read_trace(paths["trace"]) if x["kind"] != "header"]
    verdicts = [x for x in body if x["kind"] == "verdict"]
    assert rem.seen == verdicts and verdicts
    for i, x in enumerate(body):
        if x["kind"] == "verdict":
            assert body[i + 1]["kind"] == "action" and body[i + 1]["rank"] == x["rank"]
    assert body[-1]["state"] == "rolled_back"  # undone at exit, before the trace closed
    assert replay(body) == verdicts  # actions do not disturb replay
    assert_verdicts_follow_their_records(body)


class TimedPipeline(LateRankPipeline):
    """Notes when (monotonic) each record reached the pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self.fed: list[tuple[float, str]] = []

    def feed(self, rec: Record) -> list[Record]:
        self.fed.append((time.monotonic(), rec["kind"]))
        return super().feed(rec)


def test_records_are_taken_in_one_go_not_one_wake_a_datagram(running, paths) -> None:
    # Ten datagrams 30 ms apart (a rank's emitter sends every 250 ms; four
    # ranks, 16 a second): the pipeline thread takes them in at most two
    # bursts (a take every second, at most one falls inside 0.3 s), not ten.
    p = TimedPipeline()
    r = running(pipeline=p, interval=1.0)
    recs = [{"kind": "step", "rank": 0, "step": n, "start": n, "end": n + 0.5} for n in range(10)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for rec in recs:
            s.sendto(json.dumps(rec).encode(), str(paths["socket"]))
            time.sleep(0.03)
    wait_for(lambda: r.daemon.counts["step"] == 10)
    r.stop()
    times = [t for t, kind in p.fed if kind == "step"]
    gaps = [round(b - a, 3) for a, b in zip(times, times[1:], strict=False)]
    bursts = 1 + sum(1 for g in gaps if g > 0.015)
    assert bursts <= 2, f"{bursts} bursts, gaps {gaps}"
    assert [x for x in read_trace(paths["trace"]) if x["kind"] == "step"] == recs


def test_a_rank_record_is_taken_at_once_so_its_pid_is_counted(running, paths) -> None:
    # Takes every 5 s here: the rank record alone wakes the pipeline thread,
    # so the probes count the new rank's process within milliseconds.
    probes = ListProbes()
    r = running(probes=probes, interval=5.0, take_every=5.0)
    time.sleep(0.2)  # past the first tick
    rank = {"kind": "rank", "t": time.time(), "rank": 0, "world_size": 1, "host": "h",
            "pid": 4001, "addrs": []}  # fmt: skip
    t0 = time.monotonic()
    send_all(paths["socket"], [rank])
    wait_for(lambda: probes.registered == [4001], timeout=2.0)
    assert time.monotonic() - t0 < 2.0 and probes.polls == 1
    r.stop()


class ExplodingPipeline(LateRankPipeline):
    def feed(self, rec: Record) -> list[Record]:
        if rec.get("step") == 3:
            raise RuntimeError("boom")
        return super().feed(rec)


def test_a_pipeline_failure_on_one_record_does_not_stop_the_daemon(running, paths) -> None:
    recs = [{"kind": "step", "rank": 0, "step": n, "start": n, "end": n + 0.5} for n in range(6)]
    r = running(pipeline=ExplodingPipeline())
    send_all(paths["socket"], recs)
    wait_for(lambda: r.daemon.counts["step"] == 6)
    r.stop()
    assert r.daemon.pipeline_errors == 1
    assert [x for x in read_trace(paths["trace"]) if x["kind"] == "step"] == recs


def test_start_failure_closes_what_was_opened(paths) -> None:
    paths["socket"].parent.mkdir(parents=True)
    paths["socket"].write_text("not a socket")
    probes = ListProbes()
    d = Daemon(
        DaemonConfig(socket_path=str(paths["socket"]), metrics_addr=None),
        pipeline=Pipeline(),
        probes=probes,
    )
    with pytest.raises(FileExistsError):
        d.start()
    assert probes.closed


def test_close_is_idempotent_and_rolls_back_once(paths) -> None:
    calls: list[int] = []

    class CountingRemediator(TaggingRemediator):
        def close(self) -> list[Record]:
            calls.append(1)
            return []

    rem = CountingRemediator()
    d = Daemon(
        DaemonConfig(socket_path=str(paths["socket"]), metrics_addr=None),
        pipeline=LateRankPipeline(),
        remediator=rem,
    )
    d.start()
    d.close()
    d.close()
    assert calls == [1]
    assert not paths["socket"].exists()


# ----------------------------------------------------------------- the daemon's own clock


def hung_job() -> tuple[list[Record], float]:
    """A --no-probes job whose rank 2 hangs in step 8: its records up to the
    waiting ranks' first pending records, after which nothing comes at all."""
    recs, _ = generate(Scenario(seed=3, steps=12, probes=False, faults=(Hang(2, 8),)))
    first = min(r["t"] for r in recs if r["kind"] == "pending")
    kept = [r for r in recs if r["kind"] != "pending" or r["t"] < first + 0.5]
    return kept, max(float(r["t"] if "t" in r else r["end"]) for r in kept)


@pytest.mark.parametrize("heartbeat", [True, False])
def test_the_daemon_clock_alone_moves_time_when_every_rank_blocks(
    running, paths, heartbeat: bool
) -> None:
    recs, last = hung_job()
    m0 = time.monotonic()
    # The wall clock of this synthetic job's world: its last record, now.
    wall = (lambda: last + (time.monotonic() - m0)) if heartbeat else None
    r = running(pipeline=Pipeline(), wall_clock=wall)
    send_all(paths["socket"], recs)

    def hang_named() -> bool:
        return any(v.state == "flagged" and v.cause == "hang" for v in r.daemon.snapshot().ranks)

    if heartbeat:
        wait_for(hang_named, timeout=10.0)
    else:
        time.sleep(3.0)  # longer than the hang takes to be named with a clock
        assert not hang_named()
    r.stop()
    body = [x for x in read_trace(paths["trace"]) if x["kind"] != "header"]
    clocks = [x for x in body if x["kind"] == "clock"]
    assert bool(clocks) == heartbeat
    hangs = [x for x in body if x["kind"] == "verdict" and x["cause"] == "hang"]
    assert [(v["rank"], v["state"]) for v in hangs] == ([(2, "flagged")] if heartbeat else [])
    if heartbeat:
        # After every rank's last record, only the daemon's clock moved time on.
        assert hangs[0]["t"] > last and clocks[-1]["t"] >= hangs[0]["t"]
        # And the trace holds that clock: its replay names the same hang.
        replayed = Pipeline().feed_many(x for x in body if x["kind"] != "verdict")
        assert replayed == [x for x in body if x["kind"] == "verdict"]
