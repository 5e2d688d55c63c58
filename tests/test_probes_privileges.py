"""Without capabilities the probes fail once, clearly. The test drops every
capability from a root process (setpriv), since other users cannot run this
venv's interpreter here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.root]


def _without_caps(code: str) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux)")
    return subprocess.run(
        ["setpriv", "--bounding-set", "-all", "--inh-caps", "-all", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_probeset_start_raises_permission_error() -> None:
    res = _without_caps(
        "from fsdp_sentinel.probes.loader import ProbeSet, ProbePermissionError\n"
        "try:\n    ProbeSet().start()\nexcept ProbePermissionError as e:\n    print('E', e)\n"
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("E loading eBPF probes needs root"), res.stdout


def test_flows_command_says_so_and_exits_1() -> None:
    res = _without_caps("import sys; from fsdp_sentinel.cli import main; sys.exit(main(['flows']))")
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "needs root (or CAP_BPF and CAP_PERFMON)" in res.stderr
    assert "Traceback" not in res.stderr
