"""SIGKILL the daemon under a running job on the lab; start another; see what each side felt.

One job of the bundled trainer on a lab, the daemon (``fsdp-sentinel run``)
beside it. With ``kill``, the daemon is SIGKILLed once rank 0 has logged
``kill_step`` and a new one is started on the same socket path
``restart_after_s`` later. The training side must not notice: its hooks only
queue records, a sender thread drops what nobody receives (counted), and
each rank's own ``--trace-out`` file (the oracle for step times here, written
whatever the daemon does) shows the same step times with and without the
kill (``bench/daemon_kill`` compares the arms, interleaved).

With ``noisy``, a noisy neighbour fills host ``noisy_host``'s link first, so
the first daemon (``--remediate apply``) puts its tc tree on that link; the
SIGKILL leaves the tree, its classifier and its state file behind (the
kernel keeps them). The new daemon must find them and roll them back before
it is ready, re-learn the ranks (the hooks greet a daemon that comes back
with their ``rank`` records) and flag the straggler that starts after it.

:func:`run_daemon_kill` returns a :class:`KillFigures`; the lab test asserts
on it, the bench prints it.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_sentinel.demo.daemon_proc import DaemonProcess
from fsdp_sentinel.demo.resume import logged_step

Record = dict[str, Any]

#: What the remediator logs when its tree is in (``remediate.remediator``).
APPLIED_LINE = "prioritised the job's flows on"


@dataclass(frozen=True)
class KillConfig:
    out: Path
    kill: bool = True
    noisy: bool = False
    lab_name: str = "fss-dkl"
    subnet: str = "198.18.42.0/24"
    ranks: int = 4
    rate_mbit: float = 1000.0
    steps: int = 40
    layers: int = 2
    dim: int = 64
    kill_step: int = 12
    restart_after_s: float = 2.0
    noisy_host: int = 1
    noisy_step: int = 3
    applied_within_s: float = 60.0  # how long the first daemon gets to put its tree in
    straggler_rank: int = 2
    straggler_step: int | None = None  # --delay-steps from here (None: no straggler)
    straggler_s: float = 0.3
    probes: bool = True
    interval: float = 0.5
    master_port: int = 29_680
    timeout_s: float = 300.0


@dataclass
class KillFigures:
    kill_t: float | None = None
    killed_at_step: int | None = None
    restarted_t: float | None = None  # the new daemon ready
    steps: dict[int, float] = field(default_factory=dict)  # step -> slowest rank's seconds
    rank_done: list[str] = field(default_factory=list)  # each rank's "done ..." line
    exit_codes: list[int | None] = field(default_factory=list)
    applied: bool = False  # the first daemon's tree went in
    tree_after_kill: bool = False  # ...and was still there after its SIGKILL
    state_after_kill: bool = False  # ...with its state file
    tree_after_restart: bool | None = None  # still there once the new daemon was ready
    restore_actions: list[tuple[str, str]] = field(default_factory=list)
    reannounced: list[int] = field(default_factory=list)  # ranks the new daemon heard of
    same_pids: bool = False
    flagged: list[tuple[str, int, int]] = field(
        default_factory=list
    )  # new daemon: cause, rank, step


def trainer_args(cfg: KillConfig, sock: Path, trace: Path) -> list[str]:
    args = [
        "--steps", str(cfg.steps), "--layers", str(cfg.layers), "--dim", str(cfg.dim),
        "--threads", "1", "--log-every", "1", "--socket", str(sock),
        "--trace-out", str(trace),
    ]  # fmt: skip
    if cfg.straggler_step is not None:
        args += ["--delay-rank", str(cfg.straggler_rank), "--delay-seconds",
                 str(cfg.straggler_s), "--delay-steps", f"{cfg.straggler_step}:"]  # fmt: skip
    return args


def has_tree(netns: str, dev: str, major: int) -> bool:
    """An HTB qdisc with our major handle on ``dev`` (``tc -j``, the kernel's own answer)."""
    out = subprocess.run(["tc", "-n", netns, "-j", "qdisc", "show", "dev", dev],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return any(q.get("kind") == "htb" and q.get("handle") == f"{major:x}:"
               for q in json.loads(out or "[]"))  # fmt: skip


def step_seconds(rank_traces: list[Path]) -> dict[int, float]:
    """step -> the slowest rank's duration, from the ranks' own trace files."""
    from fsdp_sentinel.trace import read_trace

    by: dict[int, float] = {}
    for p in rank_traces:
        for r in read_trace(p, strict=False):
            if r.get("kind") == "step":
                s = int(r["step"])
                by[s] = max(by.get(s, 0.0), float(r["end"]) - float(r["start"]))
    return dict(sorted(by.items()))


def _wait(cond: Any, timeout: float, what: str, procs: list[Any]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{what}: not within {timeout:.0f} s (or the job ended)")
        time.sleep(0.05)


def _daemon(cfg: KillConfig, out: Path, sock: Path, tag: str, lab: Any) -> DaemonProcess:
    from fsdp_sentinel.demo.run import remediate_devices

    return DaemonProcess(socket_path=sock, trace_out=out / f"daemon-{tag}.jsonl",
                         log_path=out / f"daemon-{tag}.log",
                         remediate="apply" if cfg.noisy else "off",
                         interval=cfg.interval, probes=cfg.probes,
                         extra=remediate_devices(lab) if cfg.noisy else None)  # fmt: skip


def run_daemon_kill(cfg: KillConfig) -> KillFigures:
    """One job, as ``cfg`` says; everything made is removed on the way out."""
    from fsdp_sentinel.demo.run import _stop_job
    from fsdp_sentinel.emit import Emitter
    from fsdp_sentinel.lab import Lab, LabConfig, NoisyNeighbor
    from fsdp_sentinel.lab.cluster import launch_torchrun
    from fsdp_sentinel.remediate.config import STATE_DIR, RemediateConfig

    out = cfg.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sock = out / "ingest.sock"
    for old in out.glob("*.jsonl"):
        old.unlink()
    fig = KillFigures()
    major = RemediateConfig().htb_major
    with contextlib.ExitStack() as stack:
        lab = stack.enter_context(Lab(LabConfig(name=cfg.lab_name, hosts=cfg.ranks,
                                                rate_mbit=cfg.rate_mbit, subnet=cfg.subnet)))  # fmt: skip
        first = stack.enter_context(_daemon(cfg, out, sock, "a", lab))
        first.wait_ready()
        emitter = Emitter(socket_path=str(sock))
        stack.callback(emitter.close)
        log0 = out / "logs" / f"{lab.hosts[0].name}.log"
        log0.unlink(missing_ok=True)
        procs = launch_torchrun(lab, trainer_args(cfg, sock, out / "rank{rank}.jsonl"),
                                master_port=cfg.master_port, log_dir=out / "logs")  # fmt: skip
        stack.callback(_stop_job, procs)
        noisy = NoisyNeighbor(cfg.noisy_host, direction="out", streams=4)
        if cfg.noisy:
            _wait(lambda: logged_step(log0) >= cfg.noisy_step, cfg.timeout_s, "noisy step", procs)
            emitter.emit(lab.inject(noisy, step=cfg.noisy_step))
            stack.callback(lambda: lab.active_faults() and lab.clear(noisy))
            _wait(lambda: APPLIED_LINE in first.log_path.read_text(errors="replace"),
                  cfg.applied_within_s, "the first daemon's tc tree", procs)  # fmt: skip
            fig.applied = True
        h = lab.hosts[cfg.noisy_host]
        if cfg.kill:
            _wait(lambda: logged_step(log0) >= cfg.kill_step, cfg.timeout_s, "kill step", procs)
            assert first.proc is not None
            first.proc.kill()  # SIGKILL: no signal handler, no cleanup, no last poll
            fig.kill_t = time.time()
            first.proc.wait()
            fig.killed_at_step = logged_step(log0)
            if cfg.noisy:
                lab.clear(noisy)
                fig.tree_after_kill = has_tree(h.netns, h.ifname, major)
                fig.state_after_kill = any(Path(STATE_DIR).glob(f"remediation-{h.netns}+*"))
            time.sleep(cfg.restart_after_s)
            second = stack.enter_context(_daemon(cfg, out, sock, "b", lab))
            second.wait_ready()
            fig.restarted_t = time.time()
            if cfg.noisy:
                fig.tree_after_restart = has_tree(h.netns, h.ifname, major)
        for p in procs:
            p.wait(timeout=cfg.timeout_s)
        fig.exit_codes = [p.returncode for p in procs]
        time.sleep(2 * cfg.interval + 1.0)  # the last records reach the daemon's trace
    fig.steps = step_seconds([out / f"rank{r}.jsonl" for r in range(cfg.ranks)])
    fig.rank_done = [line for h in lab.hosts
                     for line in (out / "logs" / f"{h.name}.log").read_text(errors="replace")
                     .splitlines() if line.startswith("done rank=")]  # fmt: skip
    if cfg.kill:
        _judge_second(fig, out)
    return fig


def _judge_second(fig: KillFigures, out: Path) -> None:
    from fsdp_sentinel.trace import read_trace

    a = list(read_trace(out / "daemon-a.jsonl", strict=False))
    b = list(read_trace(out / "daemon-b.jsonl", strict=False))
    pids_a = {r["rank"]: r.get("host_pid") for r in a if r.get("kind") == "rank"}
    pids_b = {r["rank"]: r.get("host_pid") for r in b if r.get("kind") == "rank"}
    fig.reannounced = sorted(pids_b)
    fig.same_pids = bool(pids_b) and all(pids_a.get(k) == v for k, v in pids_b.items())
    fig.restore_actions = [
        (str(r["what"]), str(r["state"])) for r in b if r.get("kind") == "action"
    ]
    fig.flagged = [(str(v["cause"]), int(v["rank"]), int(v["step"])) for v in b
                   if v.get("kind") == "verdict" and v.get("state") == "flagged"]  # fmt: skip


def window(fig: KillFigures, first: int, n: int) -> list[float]:
    """The job's step times of steps ``first`` .. ``first + n - 1`` (those it has)."""
    return [fig.steps[s] for s in range(first, first + n) if s in fig.steps]


def median_or_none(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
