"""The whole observability bundle against reality.

A real FSDP2 job (the bundled trainer, 3 ranks over gloo, rank 1 stalled
0.4 s every step) reports to a real daemon with its eBPF probes loaded; Debian's
Prometheus scrapes the daemon every second with the shipped scrape settings
(`honor_labels`) and evaluates the shipped recording and alert rules. Then,
through Prometheus's HTTP API:

- the straggler alert is pending or firing for rank 1 and for no other;
- every PromQL expression of the dashboard parses and returns data (three
  named exceptions whose series cannot exist in this run), every rule
  expression parses and every series selector in it returns data;
- rank series carry the training job's run id as `job` (no `exported_job`);
- BPF run statistics are on while the daemon runs (the programs' ``run_cnt``
  moves, which the kernel counts only then) and ``kernel.bpf_stats_enabled``
  reads as found, during (the daemon holds statistics on through
  ``BPF_ENABLE_STATS``, which the sysctl does not show) and after.

The RDMA and NCCL series come from a stand-in (`FakeRdmaNic`): this machine
has no RDMA NIC and no GPU, so those records are sent to the ingest socket
the way the daemon's own probes would produce them.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_support import DaemonProcess, wait_for
from prometheus_support import api, dashboard_exprs, prometheus_server, query, rule_exprs
from test_exporter_http import promtool_check_metrics

from fsdp_sentinel.emit import Emitter
from fsdp_sentinel.probes.bpfstats import SYSCTL
from fsdp_sentinel.trainer.launch import free_port, local_env, torchrun_argv

pytestmark = [pytest.mark.prometheus, pytest.mark.torch, pytest.mark.kernel, pytest.mark.root]

SLOW_RANK = "1"

#: Dashboard expressions whose series cannot exist in this run, and why.
EXPECTED_EMPTY = {
    "fsdp_sentinel_straggler_srtt_ratio": "a compute straggler: no network verdict is open",
    "fsdp_sentinel_rank_silent_seconds": "no rank is lost",
    "fsdp_sentinel_remediation_active": "the daemon runs with --remediate off",
}

SELECTOR = re.compile(r"\b(?:fsdp_sentinel_\w+|up)(?:\{[^}]*\})?")


class FakeRdmaNic:
    """Sends ``rdma`` and ``nccl`` records as the probes would on an RDMA node
    with NCCL (deltas each half second), on its own thread."""

    def __init__(self, sock: str, host: str) -> None:
        self._em = Emitter(sock)
        self._host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeRdmaNic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._em.close()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            t = time.time()
            self._em.emit({"kind": "rdma", "t": t, "dt": 0.5, "host": self._host,
                           "dev": "fake_mlx5_0", "port": 1, "tx_bytes": 1 << 20,
                           "rx_bytes": 1 << 19, "counters": {"symbol_error": 1}})  # fmt: skip
            self._em.emit({"kind": "nccl", "t": t, "dt": 0.5, "host": self._host, "pid": 1,
                           "rank": 0, "op": "all_reduce", "calls": 4, "bytes": 4096})  # fmt: skip
            self._em.flush()


@pytest.fixture
def bpf_stats_before() -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root to load eBPF programs")
    return Path(SYSCTL).read_text().strip()


@pytest.fixture
def stack(tmp_path: Path, bpf_stats_before: str) -> Iterator[dict[str, Any]]:
    sock = str(tmp_path / "run" / "ingest.sock")
    d = DaemonProcess(
        [
            "--socket",
            sock,
            "--metrics-addr",
            "127.0.0.1:0",
            "--interval",
            "0.5",
            "--trace-out",
            str(tmp_path / "trace.jsonl.zst"),
        ]
    )  # kept for a failure
    trainer = None
    try:
        url = d.wait_log(r"serving (http://127\.0\.0\.1:\d+)/metrics", timeout=240).group(1)
        d.wait_log(r"ready \(pid", timeout=240)  # bcc compiles the probes first
        stats_during = Path(SYSCTL).read_text().strip()
        argv = torchrun_argv(3, args=["--steps", "400", "--socket", sock, "--delay-rank",
                                      SLOW_RANK, "--delay-seconds", "0.4", "--delay-steps", "3:",
                                      "--log-every", "1000"], master_port=free_port())  # fmt: skip
        trainer = subprocess.Popen(argv, env=local_env(), stdout=subprocess.DEVNULL,
                                   stderr=(tmp_path / "trainer.log").open("w"))  # fmt: skip
        with (
            prometheus_server(tmp_path, url.removeprefix("http://"), rules=True) as prom,
            FakeRdmaNic(sock, host="fake-rdma-node"),
        ):
            yield {"prom": prom, "url": url, "daemon": d, "trainer": trainer,
                   "stats_during": stats_during, "stats_before": bpf_stats_before, "log": tmp_path / "trainer.log"}  # fmt: skip
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.terminate()
            try:
                trainer.wait(30)
            except subprocess.TimeoutExpired:
                trainer.kill()
                trainer.wait()
        rc = d.stop() if d.proc.poll() is None else d.proc.returncode
        d.kill()
        assert rc == 0, d.log[-3000:]
        # BPF statistics back as found (the kernel drops our hold with the fd)
        assert Path(SYSCTL).read_text().strip() == bpf_stats_before


def alerts(prom: str, name: str) -> list[dict[str, Any]]:
    return [a for a in api(prom, "/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == name]


def test_dashboard_and_rules_on_a_real_job_with_a_slow_rank(stack: dict[str, Any]) -> None:
    prom, trainer = stack["prom"], stack["trainer"]
    assert stack["stats_during"] == stack["stats_before"]
    assert "probes attached" in stack["daemon"].log
    assert "BPF run statistics on (BPF_ENABLE_STATS" in stack["daemon"].log

    def straggler_alert() -> bool:
        assert trainer.poll() is None, stack["log"].read_text()[-3000:]
        return bool(alerts(prom, "FsdpSentinelStraggler"))

    wait_for(straggler_alert, timeout=240, what="the straggler alert to be pending")
    # let the rate() windows fill with the job's steady state
    time.sleep(8)

    got = alerts(prom, "FsdpSentinelStraggler")
    assert {a["labels"]["rank"] for a in got} == {SLOW_RANK}, got
    assert all(a["state"] in ("pending", "firing") for a in got)
    assert {a["labels"]["cause"] for a in got} == {"compute"}
    flagged = query(prom, "fsdp_sentinel_straggler == 1")
    assert {(s["metric"]["rank"], s["metric"]["cause"]) for s in flagged} == {
        (SLOW_RANK, "compute")
    }

    # `job` is the training run id the hooks announced, kept by honor_labels
    ranks = query(prom, "fsdp_sentinel_step_duration_seconds_count")
    assert {s["metric"]["rank"] for s in ranks} == {"0", "1", "2"}
    jobs = {s["metric"]["job"] for s in ranks}
    assert len(jobs) == 1 and jobs != {"fsdp-sentinel"}, jobs
    assert not query(prom, '{exported_job!=""}')
    assert all(s["metric"]["host"] for s in ranks)

    empty = []
    for where, expr in dashboard_exprs().items():
        result = query(prom, expr)  # raises unless it parses and runs
        reason = next((why for key, why in EXPECTED_EMPTY.items() if key in expr), None)
        if reason:
            assert not result, f"{where}: expected no data ({reason}), got {result[:2]}"
            empty.append(where)
        else:
            assert result, f"{where}: no data for {expr}"
    assert len(empty) == 3, empty

    for name, expr in rule_exprs().items():
        query(prom, expr)
        for sel in SELECTOR.findall(expr):
            assert query(prom, sel), f"rule {name}: no series for {sel}"
    # the recording rules have evaluated, and the fleet view has data
    assert query(prom, "job:fsdp_sentinel_step_duration_seconds:p50_5m")

    # probe-backed families are real: runs and run time counted (so statistics
    # are on: the kernel counts neither otherwise), losses counted (zero or more)
    for fam in ("runs_total", "run_seconds_total"):
        got = query(prom, f"sum(rate(fsdp_sentinel_bpf_program_{fam}[15s]))")
        assert float(got[0]["value"][1]) > 0, fam
    assert {s["metric"]["source"] for s in query(prom, "fsdp_sentinel_events_lost_total")} == {
        "map_eviction", "tracepoint_miss", "sock_diag_read_error",
        "sock_diag_destroy_overflow"}  # fmt: skip

    # the live exposition of a real job passes promtool and reads back
    import urllib.request

    with urllib.request.urlopen(stack["url"] + "/metrics", timeout=5) as r:
        assert promtool_check_metrics(r.read()) == (0, [])
