"""A full disk under the daemon's trace: the writer switches off, the daemon
counts it (``fsdp_sentinel_trace_write_errors_total``,
``fsdp_sentinel_trace_records_lost_total``), keeps detecting, and ``close()``
does not raise.

Two full disks: ``/dev/full`` (every write ENOSPC, from the first) and a real
small file system, a tmpfs mounted with ``size=64k`` and filled to its last
page, so the trace's first few KiB are written and the next write fails as
on a real disk (root: mount).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import daemon_running, send_job

from fsdp_sentinel.daemon import Daemon, DaemonConfig
from fsdp_sentinel.synth import Scenario, SlowCompute, generate


def run_job_with_trace(sock: Path, trace_out: str) -> tuple[Daemon, str]:
    """A synthetic job with a slow-compute rank through a real daemon writing
    ``trace_out``; returns the closed daemon and its last /metrics text."""
    cfg = DaemonConfig(socket_path=str(sock), trace_out=trace_out, metrics_addr=("127.0.0.1", 0),
                       interval=0.05, trust_record_pid=True)  # fmt: skip
    with daemon_running(cfg) as d:
        recs, _ = generate(
            Scenario(steps=30, faults=(SlowCompute(rank=2, factor=3.0, start=8, end=30),))
        )
        send_job(d, recs)
        time.sleep(0.3)  # a few ticks: the failure is published with the snapshot
        with urllib.request.urlopen(d.http.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    return d, text


def assert_counted_and_detecting(d: Daemon, text: str) -> None:
    snap = d.snapshot()
    assert snap.verdicts_total.get("compute") == 1  # detection went on
    assert snap.trace_write_errors_total == {"trace": 1}
    lost = snap.trace_records_lost_total["trace"]
    assert lost > 0
    assert 'fsdp_sentinel_trace_write_errors_total{output="trace"} 1.0' in text
    assert 'fsdp_sentinel_trace_records_lost_total{output="trace"}' in text
    assert d._trace is not None and d._trace.failed is not None
    assert d._trace.failed.errno == 28  # ENOSPC


def test_dev_full_is_counted_and_detection_goes_on(tmp_path: Path) -> None:
    d, text = run_job_with_trace(tmp_path / "run" / "ingest.sock", "/dev/full")
    assert_counted_and_detecting(d, text)


def test_a_trace_that_writes_fine_counts_zero(tmp_path: Path) -> None:
    d, text = run_job_with_trace(tmp_path / "run" / "ingest.sock", str(tmp_path / "t.jsonl"))
    snap = d.snapshot()
    assert snap.trace_write_errors_total == {"trace": 0}
    assert snap.trace_records_lost_total == {"trace": 0}
    assert 'fsdp_sentinel_trace_write_errors_total{output="trace"} 0.0' in text


@pytest.fixture
def tiny_fs() -> Iterator[Path]:
    """A 64 KiB tmpfs with one free page left (unmounted however the test ends)."""
    top = Path(tempfile.mkdtemp(prefix="fss-enospc-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(top)],
                   check=True, timeout=30)  # fmt: skip
    try:
        with open(top / "filler", "wb") as fh:
            fh.write(b"\0" * (60 * 1024))
        yield top
    finally:
        subprocess.run(["umount", str(top)], check=True, timeout=30)
        shutil.rmtree(top)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
@pytest.mark.parametrize("name", ["run.jsonl", "run.jsonl.zst"])
def test_a_small_filesystem_filling_up_is_counted_and_detection_goes_on(
    tiny_fs: Path, tmp_path: Path, name: str
) -> None:
    trace = tiny_fs / name
    d, text = run_job_with_trace(tmp_path / "run" / "ingest.sock", str(trace))
    assert_counted_and_detecting(d, text)
    assert d._trace is not None and d._trace.records > 0  # some went out before it filled
    assert trace.stat().st_size > 0
