"""Least privilege, measured on the real kernel (docs/deploy.md, "Least privilege").

The real daemon (`fsdp-sentinel run`, probes on, `--remediate apply`) runs
under `setpriv` with exactly CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN: it
starts, counts a rank's bytes exactly (the oracle: what the sender wrote), the
apply-mode remediator puts its tree on a veth (`tc -j`) and takes it off
again. Without CAP_BPF it fails at once, with exit 1 and a message that names
the capability. The Slurm prolog/epilog pair starts a daemon with those
three and nothing more, and leaves nothing behind. deploy/capcheck.py does
the measuring; its --table gives the table in docs/deploy.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_sentinel.trace import read_trace

pytestmark = [pytest.mark.root, pytest.mark.kernel]

ROOT = Path(__file__).resolve().parent.parent
CAPCHECK = ROOT / "deploy" / "capcheck.py"
SLURM = ROOT / "deploy" / "slurm"
CAP_NET_ADMIN, CAP_PERFMON, CAP_BPF = 12, 38, 39


def capcheck(*args: str) -> tuple[int, list[dict]]:
    res = subprocess.run([sys.executable, str(CAPCHECK), *args], capture_output=True, text=True,
                         timeout=240)  # fmt: skip
    rows = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert rows, res.stderr
    return res.returncode, rows


@pytest.mark.lab  # capcheck builds an fss- network namespace (and removes it)
def test_the_daemon_works_with_exactly_the_three_capabilities() -> None:
    rc, (row,) = capcheck("--caps", "bpf,perfmon,net_admin")
    assert row["start"] and row["exit"] == 0, row
    assert row["flows_ok"], row  # every byte the rank sent, counted by the probes
    assert row["tc"] and row["rollback"], row  # tree applied (tc -j), then exactly undone
    assert rc == 0


def test_without_cap_bpf_the_daemon_exits_1_and_names_it(tmp_path: Path) -> None:
    res = subprocess.run(
        ["setpriv", "--bounding-set", "-all,+perfmon,+net_admin", "--inh-caps", "-all", "--",
         sys.executable, "-m", "fsdp_sentinel", "run", "--socket", str(tmp_path / "s.sock"),
         "--metrics-addr", "off"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert "CAP_BPF" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "s.sock").exists()  # nothing left


def caps_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    raise AssertionError("no CapEff")


def test_slurm_prolog_starts_a_daemon_with_the_three_and_the_epilog_leaves_nothing(
    tmp_path: Path,
) -> None:
    run_dir, traces = tmp_path / "run", tmp_path / "traces"
    bin_ = tmp_path / "fsdp-sentinel"
    bin_.write_text(f'#!/bin/sh\nexec {sys.executable} -m fsdp_sentinel "$@"\n')
    bin_.chmod(0o755)
    conf = tmp_path / "conf"
    conf.write_text(
        f"FSDP_SENTINEL_BIN={bin_}\nFSDP_SENTINEL_RUN_DIR={run_dir}\n"
        f"FSDP_SENTINEL_TRACE_DIR={traces}\nFSDP_SENTINEL_METRICS_ADDR=127.0.0.1:0\n"
        "FSDP_SENTINEL_REMEDIATE=off\nFSDP_SENTINEL_STOP_TIMEOUT=20\n"
    )
    env = {**os.environ, "FSDP_SENTINEL_CONF": str(conf), "SLURM_JOB_ID": "4242",
           "SLURM_JOB_GID": str(os.getgid())}  # fmt: skip
    job = run_dir / "job-4242"
    try:
        subprocess.run(["bash", str(SLURM / "prolog.sh")], env=env, check=True, timeout=150)
        sock = job / "ingest.sock"
        assert sock.is_socket(), (job / "daemon.log").read_text()
        pid = int((job / "daemon.pid").read_text())
        want = (1 << CAP_BPF) | (1 << CAP_PERFMON) | (1 << CAP_NET_ADMIN)
        assert caps_of(pid) == want  # exactly the three, though started by root
        task = subprocess.run(["bash", str(SLURM / "task-prolog.sh")], env=env, check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
        assert f"export FSDP_SENTINEL_SOCKET={sock}" in task
        assert "export FSDP_SENTINEL_JOB=4242" in task
        time.sleep(1.5)  # a poll or two, so the trace has the daemon's own records
    finally:
        subprocess.run(["bash", str(SLURM / "epilog.sh")], env=env, check=True, timeout=60)
    assert not job.exists()  # socket, pid file and log gone with the job's folder
    assert not Path(f"/proc/{pid}").exists()
    kinds = {r["kind"] for r in read_trace(traces / "job-4242.jsonl.zst")}
    assert "clock" in kinds  # a whole trace (strict read): the daemon stopped cleanly
