"""A real Prometheus server scrapes a running daemon; the test asks Prometheus.

Prometheus (Debian's /usr/bin/prometheus) runs with its own config and data
directory on a free port and is killed afterwards. The expected values are
worked out from the records the test sent, not from the exporter.
"""

from __future__ import annotations

import json
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_support import DaemonProcess, send_paced, wait_for
from prometheus_support import prometheus_server, query

from fsdp_sentinel.emit import Emitter
from fsdp_sentinel.synth import Scenario, SlowCompute, generate

pytestmark = pytest.mark.prometheus


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[DaemonProcess, str, list[dict[str, Any]]]]:
    sock = tmp_path / "run" / "ingest.sock"
    d = DaemonProcess(["--no-probes", "--trust-record-pid", "--socket", str(sock),
                       "--metrics-addr", "127.0.0.1:0", "--interval", "0.2"])  # fmt: skip
    try:
        url = d.wait_log(r"serving (http://127\.0\.0\.1:\d+)/metrics").group(1)
        d.wait_log("ready")
        scn = Scenario(steps=20, faults=(SlowCompute(rank=2, factor=3.0, start=6, end=20),))
        recs, _ = generate(scn)
        with Emitter(str(sock)) as em:
            send_paced(em, recs)
        yield d, url, recs
        assert d.stop() == 0
    finally:
        d.kill()


@pytest.fixture
def prometheus(tmp_path: Path, daemon) -> Iterator[str]:
    _, url, _ = daemon
    with prometheus_server(tmp_path, url.removeprefix("http://")) as base:
        yield base


def values(result: list[dict[str, Any]], *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for s in result}


def test_prometheus_scrapes_the_daemon(prometheus: str, daemon) -> None:
    _, url, recs = daemon

    def scraped_everything() -> bool:
        try:
            got = query(prometheus, "sum(fsdp_sentinel_records_total)")
        except OSError:
            return False  # Prometheus still starting
        return bool(got) and float(got[0]["value"][1]) >= len(recs)

    wait_for(scraped_everything, timeout=90, what="Prometheus to scrape all records")

    assert values(query(prometheus, 'up{job="fsdp-sentinel"}'), "job") == {("fsdp-sentinel",): 1.0}
    # Prometheus negotiated OpenMetrics (its default Accept) and stored the histograms
    assert query(prometheus, 'fsdp_sentinel_step_duration_seconds_bucket{le="+Inf"}')

    steps: dict[str, int] = defaultdict(int)
    coll_bytes: dict[str, int] = defaultdict(int)
    for r in recs:
        if r["kind"] == "step":
            steps[str(r["rank"])] += 1
        elif r["kind"] == "coll":
            coll_bytes[r["op"]] += r["bytes"]
    got_steps = values(query(prometheus, "fsdp_sentinel_step_duration_seconds_count"), "rank")
    assert got_steps == {(rank,): float(n) for rank, n in steps.items()}

    got_bytes = values(
        query(prometheus, "sum by (op) (fsdp_sentinel_collective_bytes_total)"), "op"
    )
    assert got_bytes == {(op,): float(n) for op, n in coll_bytes.items()}

    # What the exporter says is open agrees with the daemon's own snapshot
    # (the detector's findings are tested in test_daemon_cli.py).
    with urllib.request.urlopen(url + "/api/v1/snapshot", timeout=5) as r:
        snap = json.load(r)
    open_ = {(str(x["rank"]), x["cause"]): 1.0 for x in snap["ranks"] if x["state"] != "ok"}
    flagged = values(query(prometheus, "fsdp_sentinel_straggler == 1"), "rank", "cause")
    assert flagged == open_
    verdicts = values(query(prometheus, "fsdp_sentinel_verdicts_total"), "cause")
    assert {c: v for (c,), v in verdicts.items() if v} == {
        c: float(n) for c, n in snap["verdicts_total"].items() if n
    }
    # the daemon's own process metrics come along
    assert query(prometheus, 'process_cpu_seconds_total{job="fsdp-sentinel"}')
