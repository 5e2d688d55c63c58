"""``fsdp-sentinel run`` with the real eBPF probes: a registered pid's loopback
traffic shows up as flow records in the trace, exactly; an unregistered pid's
does not (the pid filter is fed by the ranks' announcements).

The oracle is the byte count the test itself sent and received.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from daemon_support import DaemonProcess

from fsdp_sentinel.trace import read_trace

pytestmark = [pytest.mark.kernel, pytest.mark.root]

PAYLOAD = 3_000_000

# A "rank": announces itself, waits for the daemon to register it, then
# sends PAYLOAD bytes over loopback to a server thread in the same process.
RANK = r"""
import json, os, socket, sys, threading, time
from fsdp_sentinel.emit import Emitter
sock_path, payload = sys.argv[1], int(sys.argv[2])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
got = []
def serve():
    c, _ = srv.accept(); n = 0
    while n < payload:
        b = c.recv(1 << 16)
        if not b: break
        n += len(b)
    got.append(n); c.close()
t = threading.Thread(target=serve); t.start()
with Emitter(sock_path) as em:
    em.emit({"kind": "rank", "t": time.time(), "rank": 0, "world_size": 1,
             "host": "kernel-test", "pid": os.getpid(), "addrs": ["127.0.0.1"]})
    time.sleep(2.0)  # > one poll interval: the daemon has registered us
    cli = socket.create_connection(srv.getsockname())
    cli.sendall(b"x" * payload); cli.close(); t.join()
    time.sleep(2.0)  # let a poll see the counts while we are alive
    em.flush()
    print(json.dumps({"pid": os.getpid(), "server_port": srv.getsockname()[1], "received": got[0], "sent": em.sent}))
"""


def loopback_traffic(nbytes: int) -> int:
    """Unregistered traffic from the test process itself; returns its pid."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        c, _ = srv.accept()
        while c.recv(1 << 16):
            pass
        c.close()

    t = threading.Thread(target=serve)
    t.start()
    with socket.create_connection(srv.getsockname()) as cli:
        cli.sendall(b"y" * nbytes)
    t.join()
    srv.close()
    return os.getpid()


def test_registered_pids_loopback_traffic_becomes_flow_records(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to load eBPF programs")
    sock = tmp_path / "run" / "ingest.sock"
    trace = tmp_path / "trace.jsonl"
    d = DaemonProcess(["--socket", str(sock), "--trace-out", str(trace), "--metrics-addr", "off",
                       "--interval", "0.5"])  # fmt: skip
    try:
        d.wait_log(r"ready \(pid", timeout=240)  # bcc compiles the probes first
        assert "probes attached" in d.log
        rank = subprocess.Popen(
            [sys.executable, "-c", RANK, str(sock), str(PAYLOAD)],
            stdout=subprocess.PIPE,
            text=True,
        )
        mine = loopback_traffic(PAYLOAD // 3)
        out, _ = rank.communicate(timeout=120)
        assert rank.returncode == 0
        info = json.loads(out)
        assert info["received"] == PAYLOAD and info["sent"] == 1
        assert d.stop() == 0, d.log
    finally:
        d.kill()

    recs = list(read_trace(trace))
    flows = [r for r in recs if r["kind"] == "flow"]
    assert any(r["kind"] == "rank" and r["pid"] == info["pid"] for r in recs)
    assert not [f for f in flows if f["pid"] == mine], "unregistered pid was counted"
    port = f"127.0.0.1:{info['server_port']}"
    sent = sum(f["tx_bytes"] for f in flows if f["pid"] == info["pid"] and f["dst"] == port)
    received = sum(f["rx_bytes"] for f in flows if f["pid"] == info["pid"] and f["src"] == port)
    assert (sent, received) == (PAYLOAD, PAYLOAD)
    assert any(r["kind"] == "netdev" and r["dev"] == "lo" for r in recs)
