"""One demo run, start to end: lab, daemon, job, fault, then truth, report and summary.

:func:`run_demo` builds the lab, starts the daemon (``daemon_proc``), launches
the bundled trainer on every host (``lab.cluster.launch_torchrun``, one rank
per host, gloo over the lab links), follows the job's progress through the
daemon's snapshot, injects the scenario's fault when the job reaches its
onset step (and clears it after its duration), and sends each ``fault``
record to the daemon through an :class:`~fsdp_sentinel.emit.Emitter`, so the
trace carries its own ground truth. Every resource sits in one ``ExitStack``:
an exception or Ctrl-C unwinds it in reverse order (job, fault, daemon, lab).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_sentinel.demo.daemon_proc import DaemonProcess, log_tail
from fsdp_sentinel.demo.progress import Progress
from fsdp_sentinel.demo.scenarios import SCENARIOS, calibration_start, is_transient
from fsdp_sentinel.snapshot import Snapshot
from fsdp_sentinel.truth import truth_path

#: Rendezvous port inside host 0's namespace (a lab has its own ports).
MASTER_PORT = 29500


@dataclass(frozen=True)
class DemoConfig:
    scenario: str = "slow-link"
    ranks: int = 4
    steps: int | None = None  # None: the scenario's
    onset: int | None = None
    fault_steps: int | None = None  # None: the scenario's; 0: to the end
    # A transient spike: clear the fault this many seconds after its onset.
    # Wall time, not steps: the step count the demo follows lags the job by up
    # to two steps, so "one step" of fault could really cover two or three.
    fault_seconds: float | None = None
    victim: int | None = None
    cpu_fraction: float | None = None  # compute scenarios: None is the scenario's
    remediate: str = "off"
    out: Path = Path("out/demo")
    lab_name: str = "fss-demo"
    rate_mbit: float = 1000.0
    layers: int = 4
    dim: int = 256
    # Few tokens per step keep compute small next to the ~29 MB each rank
    # moves per step: the network, not the shared CPU, sets the step time.
    batch: int = 2
    seq_len: int = 32
    interval: float = 0.5
    probes: bool = True
    timeout: float | None = None
    report: bool = True
    live: bool | None = None  # None: when stdout is a terminal
    # "one": one daemon for every lab host; "per-host": a node daemon per host,
    # meeting in the job's store (demo.nodes, docs/cluster.md)
    daemons: str = "one"

    @property
    def plan(self) -> Any:
        return SCENARIOS[self.scenario]

    def total_steps(self) -> int:
        return self.steps or self.plan.steps

    def onset_step(self) -> int:
        return self.plan.onset if self.onset is None else self.onset

    def duration(self) -> int | None:
        """Steps the fault lasts (None: to the end); see fault_seconds for timed faults."""
        if self.fault_steps is not None:
            return self.fault_steps or None
        return self.plan.duration  # type: ignore[no-any-return]

    def victim_rank(self) -> int:
        from fsdp_sentinel.demo.scenarios import victim_rank

        return victim_rank(self.ranks) if self.victim is None else self.victim


@dataclass
class DemoResult:
    trace: Path
    truth_path: Path
    report: Path | None
    elapsed: float
    truth: dict[str, Any] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    worked: bool = False
    correct: bool = False
    finding: Any = None  # demo.outcome.Finding, once the trace was judged
    data: Any = None  # the trace's report.model.ReportData, once loaded


def _stop_job(procs: list[subprocess.Popen[Any]], grace: float = 5.0) -> None:
    """SIGTERM each torchrun agent's session (its workers too), then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _current_step(snap: Snapshot | None) -> int:
    """The step the fastest rank is in (0 before any step completed)."""
    if snap is None:
        return 0
    steps = [r.step for r in snap.ranks if r.step is not None]
    return max(steps) + 1 if steps else 0


def remediate_devices(lab: Any) -> list[str]:
    """``--remediate-dev`` for each lab host's own link: the only devices the
    demo's daemon may change (it serves every lab host, like a node daemon each)."""
    out: list[str] = []
    for h in lab.hosts:
        out += ["--remediate-dev", f"{h.name}={h.netns}/{h.ifname}"]
    return out


def trainer_args(cfg: DemoConfig, socket_path: Path | None) -> list[str]:
    """The trainer's flags; ``socket_path`` None: each rank's socket from its environment."""
    return [
        "--steps", str(cfg.total_steps()),
        "--layers", str(cfg.layers),
        "--dim", str(cfg.dim),
        "--batch", str(cfg.batch),
        "--seq-len", str(cfg.seq_len),
        "--threads", "1",
        # Rank 0 says each step's end: the fault driver counts a fault's
        # steps by it (``TrainerSteps``), not by the daemon's snapshot.
        "--log-every", "1",
        *(["--socket", str(socket_path)] if socket_path is not None else []),
    ]  # fmt: skip


class TrainerSteps:
    """The step rank 0 is in, from the end-of-step lines it writes to its host's log
    (``trainer.loop.step_line``), read as the log grows.

    The daemon's snapshot trails the job by its poll interval and the
    emitter's drain, about a second: two of a clean lab step's 0.6 s, but
    half of a step the fault has slowed to 2 s. A fault counted in snapshot
    steps therefore lasted ~1.5 steps fewer than asked (6 asked, 4-5 seen
    in the trace), enough for a persistence rule to miss it; this count
    trails by at most the driver's own check interval.
    """

    def __init__(self, log: Path) -> None:
        self.log = log
        self._at = 0
        self._tail = b""
        self.step: int | None = None

    def poll(self) -> int | None:
        """The step in progress (the last one ended + 1); None before rank 0 ended one."""
        from fsdp_sentinel.trainer.loop import STEP_LINE

        try:
            with open(self.log, "rb") as f:
                f.seek(self._at)
                got = f.read()
        except OSError:
            return self.step
        self._at += len(got)
        lines = (self._tail + got).split(b"\n")
        self._tail = lines.pop()  # a line still being written
        for line in lines:
            m = STEP_LINE.match(line)
            if m:
                self.step = int(m.group(1)) + 1
        return self.step


class _FaultDriver:
    """Injects the scenario's fault at its onset and clears it after its duration.

    A fault whose effect depends on the machine (the scenario has a
    ``slowdown``) is sized at the onset from the victim host's CPU use over
    the clean steps before it (``demo.calibrate``), unless ``--cpu-fraction``
    fixed it; how it was sized goes into the fault record's ``params``.
    """

    def __init__(self, cfg: DemoConfig, lab: Any, emitter: Any, progress: Progress) -> None:
        self.cfg = cfg
        self.lab = lab
        self.emitter = emitter
        self.progress = progress
        make = cfg.plan.make
        self.fault = make(cfg.victim_rank()) if make is not None else None
        if cfg.cpu_fraction is not None and self.fault is not None:
            self.fault = dataclasses.replace(self.fault, cpu_fraction=cfg.cpu_fraction)
        self.onset = cfg.onset_step()
        self.slowdown: float | None = cfg.plan.slowdown if cfg.cpu_fraction is None else None
        self.calibrate_from = calibration_start(self.onset) if self.slowdown else None
        self.meter: Any = None
        self.calibration: dict[str, Any] | None = None
        self.measured_from = 0
        self.seconds = cfg.fault_seconds if cfg.fault_seconds is not None else cfg.plan.seconds
        self.duration = None if self.seconds is not None else cfg.duration()
        self.injected_at: float | None = None
        self.injected_step: int | None = None  # the trainer's own step then (TrainerSteps)
        self.active = False
        self.records: list[dict[str, Any]] = []

    @property
    def killed(self) -> bool:
        """Whether this run killed a rank (its job is expected to fail)."""
        return self.injected_at is not None and getattr(self.fault, "what", "") == "rank_kill"

    def _send(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        self.emitter.emit(rec)

    def _calibrate(self, step: int) -> None:
        """Measure the victim's clean steps, then size the fault at the onset."""
        from fsdp_sentinel.demo.calibrate import CpuMeter, quota_for

        if self.calibrate_from is None or self.slowdown is None or self.fault is None:
            return
        if self.meter is None and self.calibrate_from <= step < self.onset:
            host = self.fault.host
            self.meter = CpuMeter(lambda: self.lab.cgroup_pids(host))
            self.meter.start()
            self.measured_from = step
        elif self.meter is not None and step >= self.onset and self.calibration is None:
            use = self.meter.stop()
            self.calibration = {
                "cpu_used": round(use.fraction, 4),
                "measured_s": round(use.wall, 2),
                "steps": f"{self.measured_from}-{step - 1}",
                "target_slowdown": self.slowdown,
            }
            if use.fraction > 0 and use.wall > 0:
                share = round(quota_for(use.fraction, self.slowdown), 4)
                self.fault = dataclasses.replace(self.fault, cpu_fraction=share)
            else:  # nothing measurable: the scenario's own share, and say so
                self.calibration["fallback"] = True
            self.progress.event(
                f"calibrated: rank {self.fault.host} used {use.fraction:.2f} of a core; "
                f"quota {self.fault.cpu_fraction:.3f} for ~{self.slowdown:g}x"
            )

    def on_step(self, step: int, trainer_step: int | None = None) -> None:
        """``step``: the job's step by the daemon's snapshot (the onset is judged by
        it); ``trainer_step``: rank 0's own (``TrainerSteps``), by which a fault's
        ``duration`` is counted when it is known."""
        if self.fault is None:
            return
        self._calibrate(step)
        if self.injected_at is None and step >= self.onset:
            self.injected_step = trainer_step
            rec = self.lab.inject(self.fault, step=step)
            if self.calibration is not None:
                rec.setdefault("params", {})["calibration"] = self.calibration
            self.injected_at = time.monotonic()
            self.active = True
            self._send(rec)
            self.progress.event(
                f"injected {rec['what']} on {rec['host']} (rank {rec['rank']}) at step {step}"
            )
            self.progress.note(f"{rec['what']} on rank {rec['rank']}")
        elif self.active and self.duration is not None:
            if self.injected_step is not None and trainer_step is not None:
                due = trainer_step >= self.injected_step + self.duration
            else:
                due = step >= self.onset + self.duration
            if due:
                self.clear(step)

    @property
    def counting_steps(self) -> bool:
        """A fault in force that ends after a number of steps."""
        return self.active and self.duration is not None

    def on_time(self, now: float) -> float | None:
        """Clear a timed fault when its time is up; seconds until then, or None."""
        if not self.active or self.seconds is None or self.injected_at is None:
            return None
        left = self.injected_at + self.seconds - now
        if left <= 0:
            self.clear(None)
            return None
        return left

    def clear(self, step: int | None) -> None:
        if not self.active or self.fault is None:
            return
        self.active = False
        rec = self.lab.clear(self.fault, step=step)
        self._send(rec)
        where = f" at step {step}" if step is not None else ""
        self.progress.event(f"cleared {rec['what']} on {rec['host']}{where}")
        self.progress.note("fault cleared")


def _follow(
    cfg: DemoConfig,
    daemon: Any,
    procs: list[subprocess.Popen[Any]],
    driver: _FaultDriver,
    progress: Progress,
    problems: list[str],
    trainer: TrainerSteps,
) -> None:
    """Until the job ends (or must be ended): progress, fault timing, events."""
    total = cfg.total_steps()
    timeout = cfg.timeout or 90.0 + 8.0 * total
    deadline = time.monotonic() + timeout
    flagged: dict[int, str] = {}
    prioritised: set[tuple[str, str]] = set()
    step = 0
    while True:
        snap = daemon.snapshot()
        if snap is not None:
            if cfg.daemons == "per-host":
                # A node's own view of its rank is not the leader's: leave the
                # rank states to the summary, which reads the leader's verdicts.
                snap = dataclasses.replace(
                    snap, ranks=tuple(dataclasses.replace(r, state="ok") for r in snap.ranks)
                )
            progress.update(snap)
            now_on = {(v.host, v.dev) for v in snap.remediation if v.active}
            for host, dev in sorted(now_on ^ prioritised):
                what = "prioritising the job's flows" if (host, dev) in now_on else "restored"
                progress.event(f"tc: {what} on {host} {dev} at step {step}")
            prioritised = now_on
            step = max(step, _current_step(snap))
            for r in snap.ranks:
                state = f"{r.state}:{r.cause}" if r.state != "ok" else "ok"
                if flagged.get(r.rank, "ok") != state:
                    if state != "ok":
                        progress.event(
                            f"rank {r.rank} {r.state} (cause {r.cause}) at step {r.step}"
                        )
                    elif r.rank in flagged:
                        progress.event(f"rank {r.rank} cleared at step {r.step}")
                    flagged[r.rank] = state
        driver.on_step(step, trainer.poll())
        left = driver.on_time(time.monotonic())
        if all(p.poll() is not None for p in procs):
            return
        if not daemon.alive():
            problems.append(f"the daemon died; {daemon.log_path}:\n{log_tail(daemon.log_path)}")
            return
        # After a kill the survivors fail on their next collective with the
        # dead rank; give detection and torchrun time, then end what is left.
        if driver.killed and time.monotonic() - (driver.injected_at or 0.0) > 30.0:
            return
        if time.monotonic() > deadline:
            problems.append(f"the job had not finished after {timeout:.0f} s; stopped it")
            return
        if left is not None and left < 0.5:
            time.sleep(max(left, 0.0))
            driver.on_time(time.monotonic())
        elif driver.counting_steps:
            # Its end is a step of the trainer's: looked for more often than
            # the snapshot (whose step stays put between the checks).
            for _ in range(5):
                time.sleep(0.1)
                driver.on_step(step, trainer.poll())
        else:
            time.sleep(0.5)


def _linger(daemon: Any, seconds: float, progress: Progress) -> None:
    """Keep the daemon running a little after the job, for its last polls and verdicts."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and daemon.alive():
        snap = daemon.snapshot()
        if snap is not None:
            progress.update(snap)
        time.sleep(0.5)


def run_demo(cfg: DemoConfig) -> DemoResult:
    from fsdp_sentinel.emit import Emitter
    from fsdp_sentinel.lab import Lab, LabConfig
    from fsdp_sentinel.lab.cluster import launch_torchrun

    out = cfg.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl.zst"
    result = DemoResult(trace, truth_path(trace), None, 0.0)
    for stale in (trace, result.truth_path, out / "report.html", out / "ingest.sock"):
        stale.unlink(missing_ok=True)
    shutil.rmtree(out / "logs", ignore_errors=True)
    shutil.rmtree(out / "nodes", ignore_errors=True)  # node daemons' traces append
    sock = out / "ingest.sock"
    start = time.monotonic()
    procs: list[subprocess.Popen[Any]] = []
    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(Progress(cfg.total_steps(), live=cfg.live))
        progress.event(
            f"building lab {cfg.lab_name}: {cfg.ranks} hosts, {cfg.rate_mbit:g} Mbit/s links"
        )
        lab = stack.enter_context(
            Lab(LabConfig(name=cfg.lab_name, hosts=cfg.ranks, rate_mbit=cfg.rate_mbit))
        )
        daemon: Any
        host_env: dict[str, dict[str, str]] | None = None
        if cfg.daemons == "per-host":
            from fsdp_sentinel.demo.nodes import NodeDaemons
            from fsdp_sentinel.emit import SOCKET_ENV

            progress.event(f"starting {cfg.ranks} node daemons (compiling probes)")
            daemon = stack.enter_context(
                NodeDaemons(
                    lab, out, remediate=cfg.remediate, interval=cfg.interval, probes=cfg.probes
                )
            )
            host_env = {h: {SOCKET_ENV: str(daemon.socket(h))} for h in daemon.hosts}
            # Ground truth goes to host 0's daemon: the fault records need one trace.
            sock = daemon.socket(daemon.hosts[0])
        else:
            progress.event("starting the daemon (compiling probes)")
            daemon = stack.enter_context(
                DaemonProcess(
                    socket_path=sock,
                    trace_out=trace,
                    log_path=out / "daemon.log",
                    remediate=cfg.remediate,
                    interval=cfg.interval,
                    probes=cfg.probes,
                    extra=remediate_devices(lab) if cfg.remediate != "off" else None,
                )
            )
        daemon.wait_ready()
        emitter = Emitter(socket_path=str(sock))
        stack.callback(emitter.close)
        driver = _FaultDriver(cfg, lab, emitter, progress)
        # Clear a fault still in force before the daemon stops, so its record
        # in the trace carries an end (callbacks run in reverse order).
        stack.callback(driver.clear, None)
        progress.event(f"launching the trainer: {cfg.total_steps()} steps on {cfg.ranks} ranks")
        procs = launch_torchrun(
            lab,
            trainer_args(cfg, sock if host_env is None else None),
            master_port=MASTER_PORT,
            log_dir=out / "logs",
            host_env=host_env,
        )
        stack.callback(_stop_job, procs)
        progress.note("training")
        trainer = TrainerSteps(out / "logs" / f"{lab.hosts[0].name}.log")
        _follow(cfg, daemon, procs, driver, progress, result.problems, trainer)
        _stop_job(procs)
        killed = driver.killed
        for h, p in zip(lab.hosts, procs, strict=True):
            if p.returncode not in (0, None) and not killed:
                result.problems.append(
                    f"trainer on {h.name} exited with status {p.returncode}; "
                    f"{out / 'logs' / (h.name + '.log')}:\n{log_tail(out / 'logs' / (h.name + '.log'), 8)}"
                )
        driver.clear(None)
        _linger(daemon, 2.0 + 2 * cfg.interval, progress)
        progress.note("stopping")
        rc = daemon.stop()
        if rc not in (0, None):
            result.problems.append(f"the daemon exited with status {rc}; see {daemon.log_path}")
        if driver.fault is not None and driver.injected_at is None:
            result.problems.append(f"the job ended before the fault's onset step {driver.onset}")
    if cfg.daemons == "per-host":
        from fsdp_sentinel.demo.nodes import merge_node_traces

        merge_node_traces(daemon.traces(), trace)
    result.elapsed = time.monotonic() - start
    _finish(cfg, result)
    return result


def _finish(cfg: DemoConfig, result: DemoResult) -> None:
    """Truth file, report and summary from the trace the daemon wrote."""
    from fsdp_sentinel.demo.outcome import classify, fault_steps, summary_lines, truth
    from fsdp_sentinel.demo.scenarios import STALL_CAUSES
    from fsdp_sentinel.detect import DetectConfig
    from fsdp_sentinel.report import load, write_report

    if not result.trace.exists():
        result.problems.append(f"no trace was written at {result.trace}")
        result.summary = [f"problem   {p}" for p in result.problems]
        return
    data = load([result.trace], strict=False)
    if cfg.daemons == "per-host" and data.verdicts_replayed:
        # The node daemons said nothing: that is the finding, not a replay's verdicts.
        data.verdicts, data.spans, data.verdicts_replayed = [], [], False
    result.data = data
    dc = DetectConfig()
    if cfg.fault_seconds is None and cfg.plan.seconds is None:
        duration = cfg.duration()
    else:  # a timed fault: the steps it really covered, from the trace
        spans = [fault_steps(data, f) for f in data.faults]
        ends = [(on, end) for on, end in spans if on is not None and end is not None]
        duration = max((end - on + 1 for on, end in ends), default=None)
    transient = (
        cfg.plan.what is not None
        and cfg.plan.cause not in STALL_CAUSES
        and is_transient(duration, dc.persistence.window, dc.persistence.flag_after)
    )
    result.truth = truth(
        data,
        scenario=cfg.scenario,
        world_size=cfg.ranks,
        steps=cfg.total_steps(),
        transient=transient,
    )
    if cfg.plan.what is not None and not data.faults:
        result.problems.append("the trace holds no fault record (the fault was not injected)")
    result.truth_path.write_text(json.dumps(result.truth, indent=2) + "\n")
    if cfg.report:
        result.report = result.trace.parent / "report.html"
        write_report(
            [result.trace], result.report, title=f"fsdp-sentinel demo: {cfg.scenario}", strict=False
        )
    result.finding = classify(data, result.truth)
    result.correct = result.finding.outcome.correct
    result.worked = not result.problems and bool(data.steps)
    result.summary = summary_lines(
        data,
        result.truth,
        scenario=cfg.scenario,
        elapsed=result.elapsed,
        trace=str(result.trace),
        truth_file=str(result.truth_path),
        report=str(result.report) if result.report else None,
        problems=result.problems,
    )
