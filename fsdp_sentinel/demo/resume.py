"""Kill a rank of a checkpointing job on the lab; measure how it is seen and how it resumes.

One lab, one daemon (``fsdp-sentinel run``, probes on unless asked), and per
run one job of the bundled trainer with ``--checkpoint-every`` under torchrun
``--max-restarts 1``. Once rank 0 has logged ``kill_step``, the victim host's
rank is SIGKILLed (``lab.KillRank``, its ``fault`` record sent to the daemon
as ground truth); torchrun's agents start every rank again, which resume from
the newest whole checkpoint. From the daemon's own trace (:func:`measure`):

- ``lost_s``: the kill to the daemon's first ``rank_lost`` verdict of the job;
- ``resumed_s``: the kill to the end of the first step of the new attempt
  (processes that announced themselves after the kill);
- the loss of every step run by both attempts, rank by rank: the resumed
  attempt's against the first's (same weights, optimizer state and batch, so
  equal up to floating-point noise), beside the loss's own step-to-step change;
- whether the daemon judged the new attempt as the same job (one ``job`` id
  across both attempts, the snapshot's attempt 2) and flagged nothing once
  it had resumed.

Used by ``tests/test_resume_lab.py`` (one short run) and
``bench/rank_kill_resume`` (the median of several).
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_sentinel.demo.daemon_proc import DaemonProcess

Record = dict[str, Any]

_STEP_LINE = re.compile(rb"^step (\d+) loss", re.M)


@dataclass(frozen=True)
class ResumeConfig:
    out: Path
    lab_name: str = "fss-rsm"
    subnet: str = "198.18.40.0/24"
    ranks: int = 4
    rate_mbit: float = 1000.0
    runs: int = 1
    steps: int = 24
    every: int = 4  # --checkpoint-every
    kill_step: int = 10  # SIGKILL once rank 0 has logged this step
    victim: int = 1
    probes: bool = True
    interval: float = 0.5
    master_port: int = 29_640
    timeout_s: float = 240.0  # per run


@dataclass
class RunFigures:
    """One run's figures (see the module docstring); None where it never happened."""

    job: str | None = None
    lost_s: float | None = None
    lost_rank: int | None = None
    resumed_s: float | None = None
    resumed_step: int | None = None
    overlap_steps: list[int] = field(default_factory=list)
    max_loss_diff: float | None = None
    loss_step_change: float | None = None  # median |loss(s) - loss(s-1)|, first attempt
    flagged_after_resume: list[tuple[str, int]] = field(default_factory=list)
    jobs_seen: list[str] = field(default_factory=list)
    attempt_seen: int | None = None  # the daemon's attempt number of the job after resuming
    exit_codes: list[int | None] = field(default_factory=list)


def trainer_args(cfg: ResumeConfig, sock: Path, ckpt: Path) -> list[str]:
    return [
        "--steps", str(cfg.steps), "--threads", "1", "--log-every", "1",
        "--socket", str(sock),
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(cfg.every),
    ]  # fmt: skip


def logged_step(log: Path) -> int:
    """The newest ``step N loss`` line rank 0 printed (-1 before any)."""
    try:
        found = _STEP_LINE.findall(log.read_bytes())
    except OSError:
        return -1
    return int(found[-1]) if found else -1


def measure(recs: Iterable[Record], kill: Record) -> RunFigures:
    """One run's figures from the daemon's trace and the kill's ``fault`` record."""
    t_kill = float(kill["t"])
    recs = list(recs)
    ranks = [r for r in recs if r.get("kind") == "rank"]
    first = [r for r in ranks if float(r["t"]) <= t_kill]
    fig = RunFigures()
    if not first:
        return fig
    fig.job = str(first[-1].get("job", ""))
    mine = [r for r in ranks if r.get("job", "") == fig.job and "host_pid" in r]
    # A process announced after the kill is the new attempt's (new pids all).
    attempt_of = {r["host_pid"]: int(float(r["t"]) > t_kill) for r in mine}
    fig.jobs_seen = sorted({str(r.get("job", "")) for r in ranks if float(r["t"]) >= t_kill})
    steps = [r for r in recs if r.get("kind") == "step" and r.get("host_pid") in attempt_of]
    resumed = [s for s in steps if attempt_of[s["host_pid"]] >= 1]
    if resumed:
        s0 = min(resumed, key=lambda s: float(s["end"]))
        fig.resumed_s = float(s0["end"]) - t_kill
        fig.resumed_step = int(s0["step"])
    verdicts = [r for r in recs if r.get("kind") == "verdict" and r.get("job", "") == fig.job]
    lost = [v for v in verdicts if v.get("cause") == "rank_lost" and v.get("state") == "flagged"
            and float(v["t"]) >= t_kill]  # fmt: skip
    if lost:
        fig.lost_s = float(lost[0]["t"]) - t_kill
        fig.lost_rank = int(lost[0]["rank"])
    if resumed:
        t_res = t_kill + (fig.resumed_s or 0.0)
        fig.flagged_after_resume = [(str(v["cause"]), int(v["rank"])) for v in verdicts
                                    if v.get("state") == "flagged" and float(v["t"]) > t_res]  # fmt: skip
    _compare_losses(fig, steps, attempt_of)
    return fig


def _compare_losses(fig: RunFigures, steps: list[Record], attempt_of: dict[Any, int]) -> None:
    loss: dict[tuple[int, int, int], float] = {}
    for s in steps:
        if "loss" in s:
            loss[(min(attempt_of[s["host_pid"]], 1), int(s["rank"]), int(s["step"]))] = s["loss"]
    both = sorted({k[1:] for k in loss if k[0] == 1 and (0, *k[1:]) in loss})
    fig.overlap_steps = sorted({st for _, st in both})
    if both:
        fig.max_loss_diff = max(abs(loss[(1, r, s)] - loss[(0, r, s)]) for r, s in both)
    rank0 = sorted((s, v) for (a, r, s), v in loss.items() if a == 0 and r == 0)
    change = [
        abs(b - a) for (s1, a), (s2, b) in zip(rank0, rank0[1:], strict=False) if s2 == s1 + 1
    ]
    fig.loss_step_change = statistics.median(change) if change else None


def _wait_step(log: Path, step: int, procs: list[Any], deadline: float) -> None:
    while logged_step(log) < step:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"the job never reached step {step}: see {log}")
        time.sleep(0.05)


def run_resume(cfg: ResumeConfig) -> list[RunFigures]:
    """Every run of ``cfg`` on one lab and one daemon; their figures, in order.
    Everything made (lab, daemon, jobs) is removed on the way out, whatever happens."""
    from fsdp_sentinel.demo.run import _stop_job
    from fsdp_sentinel.emit import Emitter
    from fsdp_sentinel.lab import KillRank, Lab, LabConfig
    from fsdp_sentinel.lab.cluster import launch_torchrun
    from fsdp_sentinel.trace import read_trace

    out = cfg.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    trace, sock = out / "trace.jsonl", out / "ingest.sock"
    trace.unlink(missing_ok=True)
    kills: list[Record] = []
    attempts: list[dict[str, int]] = []
    codes: list[list[int | None]] = []
    with contextlib.ExitStack() as stack:
        lab = stack.enter_context(Lab(LabConfig(name=cfg.lab_name, hosts=cfg.ranks,
                                                rate_mbit=cfg.rate_mbit, subnet=cfg.subnet)))  # fmt: skip
        daemon = stack.enter_context(DaemonProcess(socket_path=sock, trace_out=trace,
                                                   log_path=out / "daemon.log",
                                                   interval=cfg.interval, probes=cfg.probes))  # fmt: skip
        daemon.wait_ready()
        emitter = Emitter(socket_path=str(sock))
        stack.callback(emitter.close)
        for i in range(cfg.runs):
            run_dir = out / f"run-{i}"
            logs = run_dir / "logs"
            with contextlib.suppress(FileNotFoundError):
                for old in logs.iterdir():
                    old.unlink()
            procs = launch_torchrun(lab, trainer_args(cfg, sock, run_dir / f"ckpt-{time.time_ns()}"),
                                    master_port=cfg.master_port + i, log_dir=logs,
                                    max_restarts=1)  # fmt: skip
            try:
                deadline = time.monotonic() + cfg.timeout_s
                _wait_step(logs / f"{lab.hosts[0].name}.log", cfg.kill_step, procs, deadline)
                kill = lab.inject(KillRank(cfg.victim), step=cfg.kill_step)
                emitter.emit(kill)
                kills.append(kill)
                for p in procs:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                time.sleep(2 * cfg.interval + 1.0)  # the last records reach the trace
                snap = daemon.snapshot()
                attempts.append({j.job: j.attempt for j in (snap.jobs if snap else ())})
            finally:
                _stop_job(procs)
            codes.append([p.returncode for p in procs])
        emitter.flush()
        time.sleep(2 * cfg.interval)
        daemon.stop()
    recs = list(read_trace(trace, strict=False))
    figs = []
    for kill, att, rc in zip(kills, attempts, codes, strict=True):
        nxt = [k["t"] for k in kills if k["t"] > kill["t"]]
        window = [r for r in recs if _t(r) < (min(nxt) - 1.0 if nxt else float("inf"))]
        f = measure(window, kill)
        f.attempt_seen, f.exit_codes = att.get(f.job or ""), rc
        figs.append(f)
    return figs


def _t(rec: Record) -> float:
    for k in ("t", "end"):
        v = rec.get(k)
        if isinstance(v, (int, float)):
            return float(v)
    return 0.0
