"""Each lab fault, injected into a real lab and measured by something other than the lab.

Oracles: bytes per time as a receiver of our own (written here, not the
lab's bulk tool) counts them, ``tc -s -j`` counters, ``ip -s -j link``
counters, a UDP packet count, a process's own CPU time from the kernel
(``os.times``), and whether a pid still runs. Rates are checked with
generous bounds (the machine's 2 cores are shared), never timed asserts.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_sentinel.lab import (
    HangRank,
    KillRank,
    Lab,
    LabConfig,
    LabError,
    NoisyNeighbor,
    PacketLoss,
    SilentNode,
    SlowCompute,
    SlowLink,
    SlowPath,
)
from fsdp_sentinel.lab.cleanup import teardown
from fsdp_sentinel.trace import validate

pytestmark = [pytest.mark.root, pytest.mark.lab]

NAME = "fss-lt"
RATE = 400.0
#: TCP payload per byte on the wire at MTU 1500 (tbf counts Ethernet frames).
GOODPUT = 1448 / 1514

# Receiver: one connection, prints [time, total bytes] every WIN seconds and at the end.
RECV = """
import json, socket, sys, time
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
c, _ = srv.accept(); c.settimeout(0.05)
buf = bytearray(1 << 20); n = 0; win = float(sys.argv[2]); nxt = time.time() + win
while True:
    try:
        k = c.recv_into(buf)
        if not k:
            break
        n += k
    except TimeoutError:
        pass
    if time.time() >= nxt:
        print(json.dumps([time.time(), n]), flush=True); nxt += win
print(json.dumps([time.time(), n]), flush=True)
"""

SEND = """
import socket, sys, time
for _ in range(200):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError:
        time.sleep(0.05)
data = b"x" * (1 << 18); end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    s.sendall(data)
s.close()
"""

UDP_RECV = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(1.0); print("ready", flush=True); n = 0
try:
    while True:
        s.recv(2048); n += 1
except TimeoutError:
    pass
print(n, flush=True)
"""

UDP_SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    s.sendto(b"x" * 100, (sys.argv[1], int(sys.argv[2])))
    if i % 50 == 49:
        time.sleep(0.002)  # stay far below any queue limit
"""

BUSY = """
import json, os, time
t0 = time.monotonic(); c0 = os.times()
while time.monotonic() - t0 < float(__import__("sys").argv[1]):
    pass
c1 = os.times(); wall = time.monotonic() - t0
print(json.dumps({"cpu": (c1.user + c1.system - c0.user - c0.system), "wall": wall}))
"""


def sh_json(*argv: str) -> Any:
    return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)


def tbf(netns: str, dev: str) -> dict[str, Any]:
    q = sh_json("tc", "-n", netns, "-s", "-j", "qdisc", "show", "dev", dev)
    return [x for x in q if x["kind"] == "tbf"][0]


def clsact(netns: str, dev: str) -> dict[str, Any] | None:
    q = sh_json("tc", "-n", netns, "-s", "-j", "qdisc", "show", "dev", dev)
    found = [x for x in q if x["kind"] == "clsact"]
    return found[0] if found else None


def rx_bytes(netns: str, dev: str) -> int:
    return int(
        sh_json("ip", "-n", netns, "-s", "-j", "link", "show", "dev", dev)[0]["stats64"]["rx"][
            "bytes"
        ]
    )


def alive(pid: int) -> bool:
    """Still there (the lab reaps what it started, so a stopped one leaves no zombie)."""
    return Path(f"/proc/{pid}").exists()


def assert_fault_record(rec: dict[str, Any], what: str, lab: Lab, host: int) -> None:
    assert validate(rec) is None
    assert rec["what"] == what and rec["rank"] == host and rec["host"] == lab.hosts[host].name


@pytest.fixture
def lab() -> Iterator[Lab]:
    teardown(NAME)
    with Lab(LabConfig(name=NAME, hosts=2, rate_mbit=RATE, subnet="198.18.8.0/24")) as lab:
        # Resolve ARP before any measurement, so counters hold only test traffic.
        for h in lab.hosts:
            lab.popen(h, ["ping", "-c1", "-W2", lab.storage.addr], stdout=subprocess.DEVNULL).wait()
        lab.popen(0, ["ping", "-c1", "-W2", lab.hosts[1].addr], stdout=subprocess.DEVNULL).wait()
        yield lab
    teardown(NAME)


def transfer(
    lab: Lab, seconds: float, port: int, win: float = 0.5
) -> tuple[subprocess.Popen[str], subprocess.Popen[bytes]]:
    recv = lab.python(1, ["-c", RECV, str(port), str(win)], stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
    send = lab.python(0, ["-c", SEND, lab.hosts[1].addr, str(port), str(seconds)])
    return recv, send


def windows(recv: subprocess.Popen[str]) -> list[tuple[float, float]]:
    """(window end time, Mbit/s of payload in that window) from the receiver's output."""
    out, _ = recv.communicate(timeout=30)
    points = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [
        (t1, (n1 - n0) * 8 / (t1 - t0) / 1e6)
        for (t0, n0), (t1, n1) in zip(points, points[1:], strict=False)
        if t1 - t0 > 0.2
    ]


def test_shaped_rate_matches_config(lab: Lab) -> None:
    before = tbf(lab.hosts[0].netns, lab.hosts[0].ifname)["bytes"]
    t0 = time.time()
    recv, send = transfer(lab, 2.5, 7001)
    assert send.wait(timeout=30) == 0
    wins = windows(recv)
    wire_mbit = (
        (tbf(lab.hosts[0].netns, lab.hosts[0].ifname)["bytes"] - before)
        * 8
        / (time.time() - t0)
        / 1e6
    )
    steady = statistics.median(r for _, r in wins[1:])
    # Receiver's payload rate within 10% of what the rate allows after headers.
    assert steady == pytest.approx(RATE * GOODPUT, rel=0.10), wins
    # And the qdisc's own counter agrees (bytes on the wire over the whole run).
    assert 0.75 * RATE < wire_mbit < 1.05 * RATE


def test_slow_link_lowers_throughput_and_clear_restores_it(lab: Lab) -> None:
    h0 = lab.hosts[0]
    burst = tbf(h0.netns, h0.ifname)["options"]["burst"]
    recv, send = transfer(lab, 6.0, 7002)
    time.sleep(2.0)
    fault = SlowLink(0, 40.0)
    on = lab.inject(fault, step=7)
    assert_fault_record(on, "slow_link", lab, 0)
    assert on["step"] == 7 and on["params"]["rate_mbit"] == 40.0
    q = tbf(h0.netns, h0.ifname)
    assert q["options"]["rate"] == 40_000_000 // 8 and q["options"]["burst"] >= burst
    time.sleep(2.0)
    off = lab.clear(fault, step=9)
    assert off["end"] >= on["t"] and off["end_step"] == 9 and validate(off) is None
    assert tbf(h0.netns, h0.ifname)["options"]["rate"] == int(RATE * 1e6 / 8)
    # No wedge: the same TCP connection finishes at full rate.
    assert send.wait(timeout=30) == 0
    wins = windows(recv)
    slow = [r for t, r in wins if on["t"] + 0.6 < t < off["end"]]
    after = [r for t, r in wins if t > off["end"] + 0.6]
    before = [r for t, r in wins if t < on["t"]]
    assert statistics.median(slow) == pytest.approx(40.0 * GOODPUT, rel=0.2), wins
    assert statistics.median(after) > 0.8 * statistics.median(before), wins
    assert statistics.median(after) > 0.8 * RATE * GOODPUT, wins


def path_rate(lab: Lab, src: int, dst: int, port: int, seconds: float = 2.5) -> float:
    """Median payload Mbit/s of one TCP transfer src -> dst, as our receiver counts it."""
    recv = lab.python(dst, ["-c", RECV, str(port), "0.5"], stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
    send = lab.python(src, ["-c", SEND, lab.hosts[dst].addr, str(port), str(seconds)])
    assert send.wait(timeout=30) == 0
    return statistics.median(r for _, r in windows(recv)[1:])


def test_slow_path_slows_only_the_two_hosts_traffic_both_ways() -> None:
    name = "fss-lp"
    teardown(name)
    with Lab(LabConfig(name=name, hosts=3, rate_mbit=RATE, subnet="198.18.9.0/24")) as lab:
        for a, b in ((0, 1), (0, 2), (1, 2)):
            lab.popen(
                a, ["ping", "-c1", "-W2", lab.hosts[b].addr], stdout=subprocess.DEVNULL
            ).wait()
        fault = SlowPath(0, 40.0, peer=1)
        on = lab.inject(fault, step=3)
        assert_fault_record(on, "slow_path", lab, 0)
        assert on["params"]["peer_rank"] == 1 and on["params"]["rate_mbit"] == 40.0
        # The path 0 <-> 1 runs at the slow rate, in both directions ...
        assert path_rate(lab, 0, 1, 7101) == pytest.approx(40.0 * GOODPUT, rel=0.2)
        assert path_rate(lab, 1, 0, 7102) == pytest.approx(40.0 * GOODPUT, rel=0.2)
        # ... while each end's traffic to the third host keeps the lab's rate.
        assert path_rate(lab, 0, 2, 7103) > 0.75 * RATE * GOODPUT
        assert path_rate(lab, 1, 2, 7104) > 0.75 * RATE * GOODPUT
        # tc's own counters: the slow class carried the path's bytes on both ends
        # (this iproute2 prints htb classes as text even with -j).
        for h in (0, 1):
            host = lab.hosts[h]
            text = subprocess.run(
                ["tc", "-n", host.netns, "-s", "class", "show", "dev", host.ifname],
                check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            sent = re.search(r"class htb 10:2 .*?\n\s*Sent (\d+) bytes", text)
            assert sent and int(sent.group(1)) > 5_000_000, text
        off = lab.clear(fault, step=6)
        assert validate(off) is None
        for h in (0, 1):
            host = lab.hosts[h]
            kinds = [
                q["kind"]
                for q in sh_json("tc", "-n", host.netns, "-j", "qdisc", "show", "dev", host.ifname)
            ]
            # the tbf's own inner queue is back (not noop, which would drop everything)
            assert "htb" not in kinds and "tbf" in kinds and "bfifo" in kinds, kinds
        assert path_rate(lab, 0, 1, 7105) > 0.75 * RATE * GOODPUT
    teardown(name)


def test_noisy_neighbor_out_shares_the_host_link(lab: Lab) -> None:
    h0, st = lab.hosts[0], lab.storage
    tc0, rx0 = tbf(h0.netns, h0.ifname)["bytes"], rx_bytes(st.netns, st.ifname)
    fault = NoisyNeighbor(0, direction="out")
    rec = lab.inject(fault)
    assert_fault_record(rec, "noisy_neighbor", lab, 0)
    t0 = time.time()
    time.sleep(2.0)
    sent = tbf(h0.netns, h0.ifname)["bytes"] - tc0
    got = rx_bytes(st.netns, st.ifname) - rx0
    mbit = sent * 8 / (time.time() - t0) / 1e6
    # The host's own egress carried it to the storage host (how fast depends on
    # the CPU the shared machine leaves a Python sender).
    assert mbit > 0.1 * RATE
    assert got > 0.9 * sent - 2e6
    # The noise is not the job's: outside the host's cgroup.
    assert lab.cgroup_pids(0) == []
    lab.clear(fault)
    assert not any(alive(p) for p in rec["params"]["pids"])
    idle = tbf(h0.netns, h0.ifname)["bytes"]
    time.sleep(0.5)
    assert tbf(h0.netns, h0.ifname)["bytes"] - idle < 50_000


def test_noisy_neighbor_in_paced_arrives_through_the_switch_port(lab: Lab) -> None:
    h0 = lab.hosts[0]
    before = tbf(lab.switch_netns, h0.switch_ifname)["bytes"]
    host_before = tbf(h0.netns, h0.ifname)["bytes"]
    fault = NoisyNeighbor(0, direction="in", rate_mbit=100.0, streams=2)
    lab.inject(fault)
    t0 = time.time()
    time.sleep(2.5)
    mbit = (
        (tbf(lab.switch_netns, h0.switch_ifname)["bytes"] - before) * 8 / (time.time() - t0) / 1e6
    )
    lab.clear(fault)
    # Pacing caps it; below the cap it is as fast as the shared CPU allows.
    assert 20.0 < mbit < 110.0
    # The host only sent ACKs back.
    assert tbf(h0.netns, h0.ifname)["bytes"] - host_before < 0.1 * (mbit * 1e6 / 8 * 2.5)


def test_slow_compute_sets_the_quota_and_caps_cpu(lab: Lab) -> None:
    fault = SlowCompute(1, 0.25)
    rec = lab.inject(fault)
    assert_fault_record(rec, "slow_compute", lab, 1)
    cg = lab.hosts[1].cgroup
    assert Path(f"{cg}/cpu.cfs_quota_us").read_text().strip() == "25000"
    # A large weight, so that other work on this shared machine cannot keep the
    # loop below its quota: the quota is then the only limit it meets.
    Path(f"{cg}/cpu.shares").write_text("100000")
    busy = lab.python(1, ["-c", BUSY, "2.0"], stdout=subprocess.PIPE, text=True)
    out, _ = busy.communicate(timeout=30)
    got = json.loads(out)
    frac = got["cpu"] / got["wall"]
    assert 0.15 < frac < 0.30, got
    stat = dict(line.split() for line in Path(f"{cg}/cpu.stat").read_text().splitlines())
    assert int(stat["nr_throttled"]) > 5, stat
    lab.clear(fault)
    assert Path(f"{cg}/cpu.cfs_quota_us").read_text().strip() == "-1"
    with pytest.raises(LabError):
        lab.clear(fault)


def udp_count(lab: Lab, n: int, port: int) -> int:
    recv = lab.python(1, ["-c", UDP_RECV, str(port)], stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
    assert (
        lab.python(0, ["-c", UDP_SEND, lab.hosts[1].addr, str(port), str(n)]).wait(timeout=30) == 0
    )
    out, _ = recv.communicate(timeout=30)
    return int(out)


@pytest.mark.kernel
@pytest.mark.parametrize("direction", ["out", "in"])
def test_packet_loss_drops_about_p(lab: Lab, direction: str) -> None:
    # Traffic goes h0 -> h1: lossy as it leaves h0 ("out") or as it reaches h1 ("in").
    host = 0 if direction == "out" else 1
    fault = PacketLoss(host, 0.2, direction=direction)
    ns, dev, _hook = fault.hooks(lab)[0]
    assert (ns, dev) == (lab.switch_netns, lab.hosts[host].switch_ifname)  # on the wire
    rec = lab.inject(fault)
    assert_fault_record(rec, "packet_loss", lab, host)
    n = 3000
    got = udp_count(lab, n, 7003)
    lost = 1 - got / n
    assert lost == pytest.approx(0.2, abs=0.04)  # 4+ sigma for n=3000
    q = clsact(ns, dev)
    assert q is not None and abs(q["drops"] - (n - got)) <= 3  # the classifier's own count
    # Stacked on the rate: the tbf is still there and unchanged.
    assert tbf(ns, dev)["options"]["rate"] == int(RATE * 1e6 / 8)
    lab.clear(fault)
    assert clsact(ns, dev) is None
    assert udp_count(lab, 500, 7004) == 500


def test_kill_rank_kills_only_the_rank(lab: Lab) -> None:
    rank = lab.popen(1, ["sleep", "300"], env={"RANK": "1"})
    helper = lab.popen(1, ["sleep", "300"])
    other_host = lab.popen(0, ["sleep", "300"], env={"RANK": "0"})
    time.sleep(0.2)
    with pytest.raises(LabError, match="no rank process"):
        lab.inject(KillRank(lab.storage))  # the storage host has no cgroup, hence no ranks
    rec = lab.inject(KillRank(1))
    assert_fault_record(rec, "rank_kill", lab, 1)
    assert rec["params"] == {"pids": [rank.pid], "signal": "SIGKILL"}
    assert rank.wait(timeout=5) == -9
    assert helper.poll() is None and other_host.poll() is None


def test_faults_are_cleaned_up_by_close() -> None:
    teardown(NAME)
    with Lab(LabConfig(name=NAME, hosts=1, rate_mbit=RATE)) as lab:
        noisy = lab.inject(NoisyNeighbor(0))
        lab.inject(SlowCompute(0, 0.5))
        pids = noisy["params"]["pids"]
        assert all(alive(p) for p in pids)
    assert not any(alive(p) for p in pids)
    assert not Path(f"/sys/fs/cgroup/cpu/{NAME}-h0").exists()


@pytest.mark.kernel
def test_stacked_faults_keep_a_flat_qdisc_tree(lab: Lab) -> None:
    h1 = lab.hosts[1]
    slow = SlowLink(1, 50.0, direction="both")
    loss = PacketLoss(1, 0.1)
    lab.inject(slow)
    lab.inject(loss)
    for ns, dev in ((h1.netns, h1.ifname), (lab.switch_netns, h1.switch_ifname)):
        assert tbf(ns, dev)["options"]["rate"] == 50_000_000 // 8
    assert clsact(lab.switch_netns, h1.switch_ifname) is not None
    assert clsact(h1.netns, h1.ifname) is None  # loss is on the wire: the switch's port
    assert {f["what"] for f in lab.active_faults()} == {"slow_link", "packet_loss"}
    lab.clear(slow)
    for ns, dev in ((h1.netns, h1.ifname), (lab.switch_netns, h1.switch_ifname)):
        assert tbf(ns, dev)["options"]["rate"] == int(RATE * 1e6 / 8)
    assert clsact(lab.switch_netns, h1.switch_ifname) is not None  # the other fault is untouched
    lab.clear(loss)
    assert clsact(lab.switch_netns, h1.switch_ifname) is None and lab.active_faults() == []


def proc_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (T: stopped), from /proc/PID/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def established(netns: str, port: int) -> int:
    out = subprocess.run(["ss", "-N", netns, "-tnH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return len([ln for ln in out.splitlines() if ln.strip()])


# A rank that holds a TCP connection to host 0 and sleeps: what a hung rank looks like.
HOLD = """
import socket, sys, time
for _ in range(200):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError:
        time.sleep(0.05)
time.sleep(300)
"""
ACCEPT = """
import socket, sys, time
srv = socket.create_server(("0.0.0.0", int(sys.argv[1]))); print("ready", flush=True)
c, _ = srv.accept(); time.sleep(300)
"""


def test_hang_rank_stops_the_rank_keeps_its_socket_and_continues_on_clear(lab: Lab) -> None:
    port = 7011
    server = lab.python(0, ["-c", ACCEPT, str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    rank = lab.python(1, ["-c", HOLD, lab.hosts[0].addr, str(port)], env={"RANK": "1"})
    helper = lab.popen(1, ["sleep", "300"])
    for _ in range(100):
        if established(lab.hosts[0].netns, port):
            break
        time.sleep(0.05)
    assert established(lab.hosts[0].netns, port) == 1
    fault = HangRank(1)
    rec = lab.inject(fault)
    assert_fault_record(rec, "rank_hang", lab, 1)
    assert rec["params"] == {"pids": [rank.pid], "signal": "SIGSTOP"}
    time.sleep(0.2)
    assert proc_state(rank.pid) == "T" and proc_state(helper.pid) != "T"
    # Stopped, not gone: no FIN, no RST, the peer still sees it connected.
    time.sleep(1.0)
    assert established(lab.hosts[0].netns, port) == 1
    lab.clear(fault)
    time.sleep(0.2)
    assert proc_state(rank.pid) != "T" and rank.poll() is None


def ping(lab: Lab, src: int, dst: int) -> bool:
    p = lab.popen(src, ["ping", "-c1", "-W1", lab.hosts[dst].addr], stdout=subprocess.DEVNULL)
    return p.wait(timeout=10) == 0


def link_flags(netns: str, dev: str) -> list[str]:
    return list(sh_json("ip", "-n", netns, "-j", "link", "show", "dev", dev)[0]["flags"])


def test_silent_node_cuts_the_host_off_without_a_reset_and_clear_restores_it(lab: Lab) -> None:
    h1 = lab.hosts[1]
    assert ping(lab, 0, 1)
    fault = SilentNode(1)
    rec = lab.inject(fault)
    assert_fault_record(rec, "silent_node", lab, 1)
    # The switch's end is down; the host's own end stays configured (up, no carrier).
    assert "UP" not in link_flags(lab.switch_netns, h1.switch_ifname)
    host_end = link_flags(h1.netns, h1.ifname)
    assert "UP" in host_end and "NO-CARRIER" in host_end
    assert not ping(lab, 0, 1) and not ping(lab, 1, 0)
    # Its shaping is untouched: the link comes back as it was.
    assert tbf(lab.switch_netns, h1.switch_ifname)["options"]["rate"] == int(RATE * 1e6 / 8)
    lab.clear(fault)
    assert "UP" in link_flags(lab.switch_netns, h1.switch_ifname)
    for _ in range(20):
        if ping(lab, 0, 1):
            break
    assert ping(lab, 0, 1) and ping(lab, 1, 0)


def test_hang_and_silent_node_are_undone_by_close() -> None:
    teardown(NAME)
    with Lab(LabConfig(name=NAME, hosts=2, rate_mbit=RATE, subnet="198.18.8.0/24")) as lab:
        rank = lab.popen(1, ["sleep", "300"], env={"RANK": "1"})
        time.sleep(0.2)
        lab.inject(HangRank(1))
        lab.inject(SilentNode(0))
        time.sleep(0.2)
        assert proc_state(rank.pid) == "T"
    # Lab.close undid both before tearing down: the stopped rank was continued
    # (then ended with the lab), nothing is left stopped.
    assert not alive(rank.pid) or proc_state(rank.pid) != "T"
    teardown(NAME)
