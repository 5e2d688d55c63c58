"""torchrun across lab hosts: gloo traffic crosses the shaped links, ranks sit in their cgroups.

Runs ``fsdp_sentinel.lab.gloo_check`` (a tiny all-reduce) and, when the
trainer is installed, a few steps of the real FSDP2 trainer. Oracles: the
ranks' own reports (rank, world size, result, the cgroup from
/proc/self/cgroup), ``tc -s -j`` byte counters of the hosts' links, and the
trainer's trace records.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdp_sentinel.lab import KillRank, Lab, LabConfig
from fsdp_sentinel.lab.cleanup import teardown
from fsdp_sentinel.lab.cluster import launch_torchrun

pytestmark = [pytest.mark.root, pytest.mark.lab, pytest.mark.torch]

NAME = "fss-lt"
PORT = 29611


def tx_bytes(netns: str, dev: str) -> int:
    out = subprocess.run(
        ["tc", "-n", netns, "-s", "-j", "qdisc", "show", "dev", dev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return int([q for q in json.loads(out) if q["kind"] == "tbf"][0]["bytes"])


def reports(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


@pytest.fixture
def lab() -> Iterator[Lab]:
    teardown(NAME)
    with Lab(LabConfig(name=NAME, hosts=2, rate_mbit=1000.0, subnet="198.18.10.0/24")) as lab:
        yield lab
    teardown(NAME)


def test_gloo_all_reduce_over_the_lab(lab: Lab, tmp_path: Path) -> None:
    before = [tx_bytes(h.netns, h.ifname) for h in lab.hosts]
    procs = launch_torchrun(
        lab,
        ["--mb", "4", "--iters", "3"],
        master_port=PORT,
        module="fsdp_sentinel.lab.gloo_check",
        log_dir=tmp_path,
    )
    codes = [p.wait(timeout=120) for p in procs]
    logs = {h.name: (tmp_path / f"{h.name}.log").read_text()[-3000:] for h in lab.hosts}
    assert codes == [0, 0], logs
    for h in lab.hosts:
        (rep,) = reports(tmp_path / f"{h.name}.log")
        assert rep["ok"] and rep["world_size"] == 2 and rep["rank"] == h.index
        assert rep["ifname"] == h.ifname and rep["host"] == h.name
        assert rep["cgroup"] == "/" + h.name  # ran inside the host's cgroup
    # Each rank sent at least half the tensor per all-reduce through its shaped link.
    for h, b in zip(lab.hosts, before, strict=True):
        assert tx_bytes(h.netns, h.ifname) - b > 0.5 * 4e6 * 3


def test_kill_rank_hits_the_worker_not_the_agent(lab: Lab, tmp_path: Path) -> None:
    procs = launch_torchrun(
        lab,
        ["--mb", "1", "--iters", "100000"],
        master_port=PORT + 1,
        module="fsdp_sentinel.lab.gloo_check",
        log_dir=tmp_path,
    )
    agent = procs[1]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        cmdlines = {
            pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            for pid in lab.cgroup_pids(1)
            if Path(f"/proc/{pid}/cmdline").exists()
        }
        workers = [
            pid
            for pid, c in cmdlines.items()
            if b"fsdp_sentinel.lab.gloo_check" in c and pid != agent.pid
        ]
        if workers and tx_bytes(lab.hosts[1].netns, lab.hosts[1].ifname) > 2e6:
            break
        time.sleep(0.2)
    else:
        pytest.fail("worker never started")
    rec = lab.inject(KillRank(1))
    assert rec["params"]["pids"] == workers and agent.pid not in rec["params"]["pids"]
    # torchrun notices its worker died and fails the job on every host.
    assert [p.wait(timeout=90) != 0 for p in procs] == [True, True]


@pytest.mark.skipif(
    importlib.util.find_spec("fsdp_sentinel.trainer") is None, reason="trainer not installed"
)
def test_real_trainer_runs_on_the_lab(lab: Lab, tmp_path: Path) -> None:
    trace = tmp_path / "rank{rank}.jsonl"
    procs = launch_torchrun(
        lab,
        ["--steps", "3", "--socket", "off", "--trace-out", str(trace)],
        master_port=PORT + 2,
        log_dir=tmp_path,
    )
    codes = [p.wait(timeout=180) for p in procs]
    assert codes == [0, 0], [(tmp_path / f"{h.name}.log").read_text()[-2000:] for h in lab.hosts]
    for h in lab.hosts:
        recs = [json.loads(x) for x in (tmp_path / f"rank{h.index}.jsonl").read_text().splitlines()]
        ranks = [r for r in recs if r.get("kind") == "rank"]
        assert ranks and ranks[0]["host"] == h.name and h.addr in ranks[0]["addrs"]
        assert len([r for r in recs if r.get("kind") == "step"]) == 3
