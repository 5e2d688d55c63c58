"""``fsdp-sentinel run`` as a user starts it: a subprocess, records from a real
Emitter, the HTTP endpoints, SIGTERM, the trace it leaves, and bad flags.

Runs without torch and without eBPF (``--no-probes``); the records come from
fsdp_sentinel.synth (a synthetic job, for tests only).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_support import DaemonProcess, run_command, send_paced, wait_for

from fsdp_sentinel.emit import Emitter
from fsdp_sentinel.synth import Scenario, SlowCompute, generate
from fsdp_sentinel.trace import read_trace

Record = dict[str, Any]


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., DaemonProcess]]:
    procs: list[DaemonProcess] = []

    def start(argv: list[str], trust: bool = True) -> DaemonProcess:
        # One test process sends every synthetic rank's records: it is none of
        # the pids they announce, so the daemon is told to take them as sent
        # (tests/test_ingest_credentials.py covers the default, strict check).
        d = DaemonProcess(["--trust-record-pid", *argv] if trust else argv)
        procs.append(d)
        return d

    yield start
    for d in procs:
        d.kill()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_ingests_serves_and_leaves_a_replayable_trace(start_daemon, tmp_path, sig) -> None:
    sock = tmp_path / "run" / "ingest.sock"
    trace = tmp_path / "trace.jsonl.zst"
    verdicts_out = tmp_path / "verdicts.jsonl"
    d = start_daemon(
        [
            "--no-probes",
            "--socket",
            str(sock),
            "--trace-out",
            str(trace),
            "--verdicts-out",
            str(verdicts_out),
            "--metrics-addr",
            "127.0.0.1:0",
            "--interval",
            "0.2",
        ]  # fmt: skip
    )
    url = d.wait_log(r"serving (http://127\.0\.0\.1:\d+)/metrics").group(1)
    d.wait_log(r"ready \(pid \d+\)")
    assert "without probes" in d.log

    recs, _ = generate(
        Scenario(steps=20, faults=(SlowCompute(rank=2, factor=3.0, start=6, end=20),))
    )
    with Emitter(str(sock)) as em, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
        send_paced(em, recs[:10])
        # malformed datagrams in the middle are dropped, not fatal
        raw.sendto(b"{broken", str(sock))
        raw.sendto(b'{"kind": "step", "rank": 1}', str(sock))
        send_paced(em, recs[10:])
        assert em.sent == len(recs)

    def consumed() -> bool:
        snap = get_json(url + "/api/v1/snapshot")
        # The daemon's own heartbeat (``clock`` records) is not one of ours.
        total = sum(n for k, n in snap["records_total"].items() if k != "clock")
        return total >= len(recs)

    wait_for(consumed, what="all records in the published snapshot")
    snap = get_json(url + "/api/v1/snapshot")
    assert snap["world_size"] == 4 and [r["rank"] for r in snap["ranks"]] == [0, 1, 2, 3]
    assert snap["ingest_malformed_total"] == 2
    metrics = get_text(url + "/metrics")
    assert (
        'fsdp_sentinel_step_duration_seconds_count{host="synth-h0",job="",rank="0"} 20.0' in metrics
    )
    dropped = re.findall(r'fsdp_sentinel_ingest_messages_total\{result="(\w+)"\} (\d+)\.0', metrics)
    assert sum(int(n) for why, n in dropped if why not in ("accepted", "refused")) == 2
    on = set(
        re.findall(
            r'fsdp_sentinel_straggler\{cause="(\w+)",host="[^"]*",job="[^"]*",rank="(\d+)"\} 1\.0',
            metrics,
        )
    )

    assert d.stop(sig) == 0, d.log
    assert not sock.exists()
    assert "stopped: " in d.log

    body = [x for x in read_trace(trace) if x["kind"] != "header"]
    assert [x for x in body if x["kind"] not in ("verdict", "clock")] == recs
    # The daemon's heartbeat: a clock record every interval, its time moving on.
    clocks = [x["t"] for x in body if x["kind"] == "clock"]
    assert len(clocks) >= 2 and all(b > a for a, b in zip(clocks, clocks[1:], strict=False))
    written = [x for x in body if x["kind"] == "verdict"]
    assert [x for x in read_trace(verdicts_out) if x["kind"] != "header"] == written
    # `fsdp-sentinel replay` of the trace gives the very verdicts the daemon wrote.
    res = run_command("replay", str(trace), "--json")
    assert res.returncode == 0, res.stderr
    assert [json.loads(ln) for ln in res.stdout.splitlines()] == written
    # The exporter showed what the verdicts left open.
    last = {v["rank"]: v for v in written}
    assert on == {(v["cause"], str(r)) for r, v in last.items() if v["state"] == "flagged"}
    # And the detector found the rank the synthetic job slowed down.
    assert {(v["rank"], v["cause"]) for v in written} == {(2, "compute")}, written


def test_socket_reachable_from_another_network_namespace(start_daemon, tmp_path) -> None:
    """A rank in its own network namespace reaches the daemon by path."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("unshare not installed")
    sock = tmp_path / "run" / "ingest.sock"
    trace = tmp_path / "t.jsonl"
    d = start_daemon(["--no-probes", "--socket", str(sock), "--trace-out", str(trace),
                      "--metrics-addr", "off"], trust=False)  # fmt: skip
    d.wait_log(r"ready")
    rec = {"kind": "step", "rank": 0, "step": 0, "start": 1.0, "end": 2.0}
    code = (
        "import json,socket,sys; s=socket.socket(socket.AF_UNIX,socket.SOCK_DGRAM);"
        f"s.sendto(json.dumps({rec!r}).encode(),{str(sock)!r});"
        "print(open('/proc/net/dev').read().count(':'))"
    )
    out = subprocess.run(["unshare", "--net", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    if out.returncode != 0 and "Operation not permitted" in out.stderr:
        pytest.skip("cannot create network namespaces here")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"  # only "lo": it really was another namespace
    deadline = time.monotonic() + 10
    while "step" not in trace.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.stop() == 0
    steps = [x for x in read_trace(trace) if x["kind"] == "step"]
    # Stamped with the sender's pid as the kernel gave it (SCM_CREDENTIALS).
    assert [{k: v for k, v in x.items() if k != "host_pid"} for x in steps] == [rec]
    assert all(type(x.get("host_pid")) is int and x["host_pid"] > 0 for x in steps)


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return run_command("run", *argv)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--interval", "0"], "between 0.1 and 3600"),
        (["--interval", "soon"], "not a number"),
        (["--metrics-addr", "9464"], "HOST:PORT"),
        (["--remediate", "maybe"], "invalid choice"),
        (["--bogus"], "unrecognized arguments"),
        (["--netns", "fss-no-such-namespace"], "no network namespace"),
        (["--netns", "../etc"], "no network namespace"),
    ],
)
def test_bad_flags_exit_2_with_usage(argv: list[str], message: str) -> None:
    res = run_cli(*argv)
    assert res.returncode == 2
    assert "usage: fsdp-sentinel" in res.stderr and message in res.stderr


def test_bad_config_file_exits_2_naming_it(tmp_path) -> None:
    cfg = tmp_path / "thresholds.json"
    cfg.write_text("{not json")
    res = run_cli("--no-probes", "--config", str(cfg), "--socket", str(tmp_path / "s"))
    assert res.returncode == 2 and str(cfg) in res.stderr
    res = run_cli("--no-probes", "--config", str(tmp_path / "absent.toml"))
    assert res.returncode == 2 and "absent.toml" in res.stderr


def test_socket_in_use_exits_1(start_daemon, tmp_path) -> None:
    sock = tmp_path / "run" / "ingest.sock"
    d = start_daemon(["--no-probes", "--socket", str(sock), "--metrics-addr", "off"])
    d.wait_log("ready")
    res = run_cli("--no-probes", "--socket", str(sock), "--metrics-addr", "off")
    assert res.returncode == 1 and "another process is listening" in res.stderr
    assert d.stop() == 0


def test_help_lists_the_flags() -> None:
    res = run_cli("--help")
    assert res.returncode == 0
    for flag in ("--socket", "--trace-out", "--verdicts-out", "--metrics-addr", "--remediate",
                 "--live", "--interval", "--config", "--no-probes"):  # fmt: skip
        assert flag in res.stdout


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    p = tmp_path / "detect.json"
    p.write_text(json.dumps({"flag_after": 3}))
    return p


def test_valid_config_is_accepted(start_daemon, tmp_path, config_path) -> None:
    d = start_daemon(["--no-probes", "--config", str(config_path), "--socket",
                      str(tmp_path / "r" / "s"), "--metrics-addr", "off"])  # fmt: skip
    d.wait_log("ready")
    assert d.stop() == 0


@pytest.mark.parametrize("spec", ["/eth0", "a/b/c", "h="])
def test_bad_remediate_dev_exits_2_with_usage(spec: str) -> None:
    res = run_cli("--remediate", "dry-run", "--remediate-dev", spec)
    assert res.returncode == 2
    assert "usage: fsdp-sentinel" in res.stderr and "IFNAME" in res.stderr
