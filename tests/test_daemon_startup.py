"""What the daemon says when it cannot start, and what it releases when it stops.

- ``--remediate apply`` without CAP_BPF (or CAP_NET_ADMIN) exits 1 with a
  message naming the capability and the remediation, before bcc compiles
  anything (before, bcc's compile error was all a user saw);
- tracefs that is mounted but not readable by this process is reported as a
  permission problem, not as "not mounted";
- at shutdown the daemon hands the stream guard's held records to the
  pipeline (``end()``), as replay does at the end of its input.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fsdp_sentinel.daemon import Daemon, DaemonConfig, _missing_capabilities
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.probes.tracefs import NOT_MOUNTED, why_no_tracefs
from fsdp_sentinel.stream import shifted
from fsdp_sentinel.synth import Scenario, generate
from fsdp_sentinel.trace import read_trace


def _status(tmp_path: Path, caps: int) -> str:
    p = tmp_path / "status"
    p.write_text(f"Name:\tx\nCapEff:\t{caps:016x}\n")
    return str(p)


@pytest.mark.parametrize(
    ("caps", "missing"),
    [
        ((1 << 39) | (1 << 12), []),
        (1 << 12, ["CAP_BPF"]),
        (1 << 39, ["CAP_NET_ADMIN"]),
        (0, ["CAP_BPF", "CAP_NET_ADMIN"]),
        ((1 << 21) | (1 << 12), []),  # CAP_SYS_ADMIN stands in for CAP_BPF
    ],
)
def test_remediation_names_the_capabilities_it_lacks(
    tmp_path: Path, caps: int, missing: list[str]
) -> None:
    assert _missing_capabilities("apply", _status(tmp_path, caps)) == missing
    assert _missing_capabilities("off", _status(tmp_path, 0)) == []
    assert _missing_capabilities("dry-run", _status(tmp_path, 0)) == []


needs_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)


@pytest.mark.root
@needs_setpriv
def test_remediation_without_cap_bpf_exits_1_naming_it(tmp_path: Path) -> None:
    res = subprocess.run(
        ["setpriv", "--bounding-set", "-all,+perfmon,+net_admin", "--inh-caps", "-all", "--",
         sys.executable, "-m", "fsdp_sentinel", "run", "--no-probes", "--remediate", "apply",
         "--socket", str(tmp_path / "s.sock"), "--metrics-addr", "off"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert "CAP_BPF" in res.stderr and "--remediate apply" in res.stderr
    assert (
        "Traceback" not in res.stderr
        and "error:" not in res.stderr.lower().split("cap_bpf")[0][-200:]
    )
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.root
@needs_setpriv
def test_tracefs_not_readable_is_a_permission_problem() -> None:
    top = Path(tempfile.mkdtemp(prefix="fss-tracefs-"))
    try:
        os.chmod(top, 0o755)
        root = top / "tracing"
        (root / "events").mkdir(parents=True)
        os.chmod(root, 0o700)  # as tracefs's root is for a non-root user
        code = (f"from fsdp_sentinel.probes.tracefs import why_no_tracefs as w; "
                f"print(w(({str(root)!r},)))")  # fmt: skip
        res = subprocess.run(
            ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--",
             sys.executable, "-c", code],
            capture_output=True, text=True, timeout=60, env={**os.environ},
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert "not readable" in res.stdout and "permission denied" in res.stdout
    finally:
        shutil.rmtree(top)


def test_tracefs_absent_is_not_mounted(tmp_path: Path) -> None:
    assert why_no_tracefs((str(tmp_path / "nothing"),)) == NOT_MOUNTED


def test_shutdown_releases_what_the_stream_guard_holds(tmp_path: Path) -> None:
    recs, _ = generate(Scenario(ranks=4, steps=12))
    ahead = shifted(recs[-1], -3600.0)  # the last record an hour ahead: held aside
    cfg = DaemonConfig(socket_path=str(tmp_path / "s" / "ingest.sock"), metrics_addr=None,
                       trace_out=str(tmp_path / "t.jsonl"))  # fmt: skip
    pipe = Pipeline()
    d = Daemon(cfg, pipeline=pipe, wall_clock=None)
    d.start()
    for rec in [*recs, ahead]:
        d._handle(rec)
    assert pipe.guard._held  # held, waiting to be judged
    d.close()
    assert not pipe.guard._held  # released to the pipeline at shutdown
    # and the trace replays to the same verdicts: replay ends with end() too
    assert list(read_trace(tmp_path / "t.jsonl", strict=True))[-1] == ahead
