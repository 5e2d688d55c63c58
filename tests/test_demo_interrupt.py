"""Ctrl-C in the middle of a demo run removes everything: job, daemon, lab."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.lab, pytest.mark.torch, pytest.mark.kernel]

LAB = "fss-fi"


def lab_leftovers() -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [n.split()[0] for n in ns.splitlines() if n.startswith(LAB + "-")]
    cg = Path("/sys/fs/cgroup/cpu")
    left += [p.name for p in cg.glob(LAB + "-*")] if cg.is_dir() else []
    return left


def processes_with(*texts: str) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if all(t in ln for t in texts) and "ps -eo" not in ln]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_sigint_while_training_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fsdp_sentinel",
            "demo",
            "--plain",
            "--lab-name",
            LAB,
            "--out",
            str(out),
            "--steps",
            "40",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    try:
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            lines.append(line)
            if "launching the trainer" in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        # Interrupt once torchrun has started the ranks themselves (its workers
        # run "python -u -m fsdp_sentinel.trainer"), while they train.
        while len(processes_with("-u -m fsdp_sentinel.trainer", str(out))) < 4:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.5)
        time.sleep(8)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines) + rest
    assert proc.returncode == 130, text
    assert "interrupted" in text
    assert lab_leftovers() == [], text
    assert processes_with(str(out)) == [], text  # no daemon, agent or rank left
