"""Node daemons in the lab: real torchrun jobs, real daemons, the job's own TCPStore.

Two claims of docs/cluster.md, each on a short real job (3 hosts, a small
model, a few seconds of steps), without probes (what is tested is the daemons'
meeting and their verdicts, not the flow figures):

- the leader's daemon SIGKILLed mid-run: every surviving node follows the next
  node within 3 of its own windows, and nothing is flagged;
- two jobs one after another through one long-running daemon: each job's
  delayed rank is flagged ``compute`` under that job, and nothing else is
  flagged (no ``rank_lost`` when the first job ends).

Oracles: the trainer's own delay flags (which rank stalls, from which step),
the daemons' traces (every verdict they wrote) and their snapshots. Every
namespace, daemon and rank is removed on exit, Ctrl-C and failure (the lab's
and the daemons' context managers).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_sentinel import trace
from fsdp_sentinel.demo.daemon_proc import DaemonProcess
from fsdp_sentinel.demo.nodes import NodeDaemons
from fsdp_sentinel.demo.run import _stop_job
from fsdp_sentinel.lab import Lab, LabConfig
from fsdp_sentinel.lab.cleanup import teardown
from fsdp_sentinel.lab.cluster import launch_torchrun

pytestmark = [pytest.mark.root, pytest.mark.lab, pytest.mark.torch]

NAME = "fss-nd"
INTERVAL = 0.5
# The job must outlive the takeover (a job that ends takes its store along): paced,
# it lives STEPS * PACE_S seconds at least however fast or loaded the CPU (CI had
# 40 unpaced steps end before the nodes had even met, and nobody could take over).
STEPS = 100
PACE_S = 0.15
SMALL = ["--layers", "2", "--dim", "64", "--batch", "2", "--seq-len", "32", "--threads", "1",
         "--log-every", "0"]  # fmt: skip


@pytest.fixture
def lab() -> Iterator[Lab]:
    teardown(NAME)
    with Lab(LabConfig(name=NAME, hosts=3, rate_mbit=1000.0, subnet="198.18.14.0/24")) as lab:
        yield lab
    teardown(NAME)


def _verdicts(path: Path) -> list[dict[str, Any]]:
    return [r for r in trace.read_trace(path, strict=False) if r.get("kind") == "verdict"]


def _flags(path: Path) -> list[tuple[str, int, str]]:
    return [(v.get("job", ""), v["rank"], v["cause"]) for v in _verdicts(path)
            if v["state"] == "flagged"]  # fmt: skip


def _wait_jobs(procs: list[Any], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    _stop_job(procs)
    return [p.returncode for p in procs]


def test_leader_daemon_killed_mid_run_next_node_leads_within_3_windows(
    lab: Lab, tmp_path: Path
) -> None:
    with NodeDaemons(lab, tmp_path, interval=INTERVAL, probes=False) as nodes:
        nodes.wait_ready()
        env = {h: {"FSDP_SENTINEL_SOCKET": str(nodes.socket(h))} for h in nodes.hosts}
        procs = launch_torchrun(
            lab, ["--steps", str(STEPS), "--step-sleep", str(PACE_S), *SMALL],
            master_port=29641, log_dir=tmp_path / "logs",
            host_env=env,
        )  # fmt: skip
        try:
            h0, h1, h2 = nodes.hosts
            survivors = [nodes.daemons[h1], nodes.daemons[h2]]

            def cluster(d: DaemonProcess) -> Any:
                snap = d.snapshot()
                return snap.cluster[0] if snap is not None and snap.cluster else None

            # Until every node follows rank 0's node through the store (view
            # "cluster"; a node that has not reached the store yet names the same
            # leader from the rank records alone), with steps under way.
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                views = [cluster(d) for d in survivors]
                snap = nodes.daemons[h1].snapshot()
                steps = [r.step for r in snap.ranks if r.step is not None] if snap else []
                if (
                    all(v is not None and v.view == "cluster" and v.leader == h0 for v in views)
                    and steps
                    and max(steps) >= 4
                ):
                    break
                if steps and max(steps) > STEPS // 2:
                    pytest.fail(f"half the job went by before the nodes met: {views}")
                time.sleep(0.1)
            else:
                pytest.fail(f"the nodes never followed {h0}: {[cluster(d) for d in survivors]}")
            # (h1 may have led once already, had h0's daemon joined the store late.)
            takeovers_before = views[0].takeovers
            killed = nodes.daemons[h0].proc
            assert killed is not None
            os.killpg(killed.pid, signal.SIGKILL)  # the leader's daemon, mid-run
            killed.wait()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                views = [cluster(d) for d in survivors]
                if all(v is not None and v.leader == h1 for v in views):
                    break
                time.sleep(0.1)
            else:
                pytest.fail(f"nobody took over from {h0}: {views}")
            # Each survivor counted, in its own windows, from the dead leader's
            # last heartbeat to following the next node.
            for v in views:
                assert v.failover_windows is not None and v.failover_windows <= 3, v
            assert views[0].leading and views[0].takeovers == takeovers_before + 1
            assert not views[1].leading
            codes = _wait_jobs(procs, 120)
            assert codes == [0, 0, 0], codes  # training never noticed
            time.sleep(3 * INTERVAL)  # the last windows reach the new leader
        finally:
            _stop_job(procs)
    # A clean job: nothing flagged by anyone, and rank 0 (whose daemon died,
    # while the rank trained on) is not called lost.
    for h in (h1, h2):
        flagged = [v for v in _verdicts(tmp_path / "nodes" / h / "trace.jsonl.zst")
                   if v["state"] == "flagged"]  # fmt: skip
        assert flagged == [], json.dumps(flagged)  # with its evidence, should it ever fail
        own = [
            r for r in trace.read_trace(tmp_path / "nodes" / h / "trace.jsonl.zst", strict=False)
            if r.get("kind") == "step"
        ]  # fmt: skip
        assert len(own) == STEPS  # its own rank's every step reached its daemon


def test_two_jobs_one_after_another_through_one_daemon(lab: Lab, tmp_path: Path) -> None:
    sock = tmp_path / "ingest.sock"
    out = tmp_path / "trace.jsonl.zst"
    delays = {"job-a": 1, "job-b": 2}  # each job's slow rank
    with DaemonProcess(
        socket_path=sock, trace_out=out, log_path=tmp_path / "daemon.log",
        interval=INTERVAL, probes=False,
    ) as daemon:  # fmt: skip
        daemon.wait_ready()
        for i, (job, slow) in enumerate(delays.items()):
            args = ["--steps", "20", *SMALL, "--socket", str(sock), "--delay-rank", str(slow),
                    "--delay-seconds", "0.6", "--delay-steps", "6:"]  # fmt: skip
            procs = launch_torchrun(
                lab, args, master_port=29651 + i, log_dir=tmp_path / job,
                env={"FSDP_SENTINEL_JOB": job},
            )  # fmt: skip
            try:
                assert _wait_jobs(procs, 150) == [0, 0, 0]
            finally:
                _stop_job(procs)
        time.sleep(4 * INTERVAL)  # the second job's last steps are judged
        assert daemon.alive()
    flags = _flags(out)
    for job, slow in delays.items():
        mine = [(r, c) for j, r, c in flags if j == job]
        assert (slow, "compute") in mine, (job, flags)
        assert set(mine) == {(slow, "compute")}, (job, flags)  # no rank_lost at any job's end
    assert {j for j, _, _ in flags} == set(delays)
