"""``lab down`` removes only labs of ours: the state-file registry (pure), and for real (root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_sentinel.lab import registry
from fsdp_sentinel.lab.config import LabError, valid_name


def test_records_come_and_go_and_bad_names_never_count(tmp_path: Path) -> None:
    assert registry.recorded(tmp_path) == []
    registry.record("fss-a", tmp_path)
    registry.record("fss-b-2", tmp_path)
    (tmp_path / "docker.json").write_text("{}")  # not a lab name: ignored
    assert registry.recorded(tmp_path) == ["fss-a", "fss-b-2"]
    registry.forget("fss-a", tmp_path)
    registry.forget("fss-a", tmp_path)  # twice is fine
    assert registry.recorded(tmp_path) == ["fss-b-2"]
    with pytest.raises(LabError):
        registry.record("docker", tmp_path)
    with pytest.raises(LabError):
        registry.record("fss-../../etc", tmp_path)


def test_lab_names() -> None:
    assert valid_name("fss") and valid_name("fss-demo") and valid_name("fss-a-1")
    for bad in ("docker", "fss-", "fss-A", "fss_x", "fss-a/b", "", "fssx"):
        assert not valid_name(bad), bad


def lab_down(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsdp_sentinel", "lab", "down", *argv],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_down_refuses_a_name_that_is_not_a_labs() -> None:
    res = lab_down("--name", "docker")
    assert res.returncode == 2 and "usage:" in res.stderr and "not a lab name" in res.stderr


@pytest.mark.root
@pytest.mark.lab
def test_down_leaves_foreign_fss_names_alone_and_removes_a_crashed_lab() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    foreign = "fss-foreign0"  # someone else's interface that happens to start with fss-
    # a veth pair: this kernel has no dummy links
    subprocess.run(["ip", "link", "add", foreign, "type", "veth", "peer", "name", "fss-foreign1"],
                   check=True)  # fmt: skip
    try:
        crash = (
            "import os, signal\n"
            "from fsdp_sentinel.lab import Lab, LabConfig\n"
            "Lab(LabConfig(name='fss-lrg', hosts=1, rate_mbit=None))\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n"
        )
        out = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True)
        assert out.returncode == -9
        assert "fss-lrg" in registry.recorded()
        res = lab_down()
        assert res.returncode == 0, res.stderr
        assert "removed 3 namespaces" in res.stdout, res.stdout
        assert "fss-lrg" not in registry.recorded()
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "fss-lrg" not in netns
        link = subprocess.run(["ip", "link", "show", foreign], capture_output=True, text=True)
        assert link.returncode == 0, "lab down removed an interface no lab of ours made"
    finally:
        subprocess.run(["ip", "link", "del", foreign], capture_output=True)
        lab_down("--name", "fss-lrg")
