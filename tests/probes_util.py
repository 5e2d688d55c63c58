"""Helpers shared by the probe tests: a peer process, an `ss -tin` reader
(the independent oracle) and a two-namespace fixture (fss-pb-*)."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PEER = str(Path(__file__).with_name("probe_peer.py"))
NS_A, NS_B = "fss-pb-a", "fss-pb-b"
DEV_A, DEV_B = "fss-pb-a0", "fss-pb-b0"
ADDR_A, ADDR_B = "198.18.200.1", "198.18.200.2"


class Peer:
    """probe_peer.py in a subprocess (optionally inside a namespace)."""

    def __init__(self, *args: str, netns: str | None = None) -> None:
        cmd = [sys.executable, PEER, *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    @property
    def pid(self) -> int:
        # `ip netns exec` execs the command in place, so the pid is the peer's.
        return self.proc.pid

    def expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line.startswith(word), f"peer said {line!r}, expected {word!r}"
        words = line.split()
        return words[1] if len(words) > 1 else ""

    def tell(self, text: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def release(*peers: Peer | None) -> None:
    """Let every peer that started go on (``tell``) and end it."""
    for p in peers:
        if p is not None:
            p.tell()
            p.close()


@dataclass
class SsSocket:
    local: str
    peer: str
    info: dict[str, str]

    def num(self, key: str) -> int:
        return int(self.info.get(key, "0"))

    @property
    def rtt_ms(self) -> float:
        return float(self.info["rtt"].split("/")[0])


def ss_tin(netns: str | None = None) -> list[SsSocket]:
    """Established TCP sockets as `ss -tin` reports them."""
    cmd = ["ss", "-tinH", "state", "established"]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    out: list[SsSocket] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            parts = line.split()
            out.append(SsSocket(parts[2], parts[3], {}))
        elif out:
            for m in re.finditer(r"(\w+):(\S+)", line):
                out[-1].info.setdefault(m.group(1), m.group(2))
    return out


def ss_find(local: str, netns: str | None = None) -> SsSocket:
    for s in ss_tin(netns):
        if s.local == local:
            return s
    raise AssertionError(f"ss shows no established socket {local}")


def proc_net_dev(dev: str, netns: str | None = None) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of ``dev`` from /proc/net/dev (inside ``netns``)."""
    cmd = ["cat", "/proc/net/dev"]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == dev:
            f = rest.split()
            return int(f[0]), int(f[8])
    raise AssertionError(f"{dev} not in /proc/net/dev")


def _tbf(dev: str, netns: str, rate: str, verb: str, limit: str | None = None) -> None:
    queue = ["limit", limit] if limit else ["latency", "20ms"]
    _run(
        "ip",
        "netns",
        "exec",
        netns,
        "tc",
        "qdisc",
        verb,
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        "32kb",
        *queue,
    )


@contextlib.contextmanager
def shaped(dev: str, netns: str, rate: str, limit: str | None = None) -> Iterator[None]:
    """A tbf of ``rate`` on ``dev``'s egress for the duration; a small
    ``limit`` (queue bytes) makes it drop, so TCP retransmits (no netem here)."""
    _tbf(dev, netns, rate, "add", limit)
    try:
        yield
    finally:
        subprocess.run(
            ["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"],
            capture_output=True,
        )


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def remove_netns() -> None:
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", DEV_A], capture_output=True)


@contextlib.contextmanager
def two_namespaces(rate: str | None = None) -> Iterator[None]:
    """fss-pb-a (198.18.200.1 on fss-pb-a0) <-> fss-pb-b (198.18.200.2 on
    fss-pb-b0) over a veth pair; ``rate`` shapes a's egress with tbf."""
    if shutil.which("ip") is None:
        raise RuntimeError("iproute2 missing")
    remove_netns()
    try:
        _run("ip", "netns", "add", NS_A)
        _run("ip", "netns", "add", NS_B)
        _run(
            "ip",
            "link",
            "add",
            DEV_A,
            "netns",
            NS_A,
            "type",
            "veth",
            "peer",
            "name",
            DEV_B,
            "netns",
            NS_B,
        )
        for ns, dev, addr in ((NS_A, DEV_A, ADDR_A), (NS_B, DEV_B, ADDR_B)):
            # No IPv6 chatter (router solicitations, MLD): the link is silent
            # unless a test sends, so device counts can be bracketed exactly.
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        if rate:
            _tbf(DEV_A, NS_A, rate, "add")
        yield
    finally:
        remove_netns()


def nstat(counter: str, netns: str | None = None) -> int:
    """The namespace's absolute SNMP ``counter`` (e.g. TcpRetransSegs) from
    `nstat -as` (absolute, history file left alone)."""
    cmd = ["nstat", "-asz", counter]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == counter:
            return int(parts[1])
    raise AssertionError(f"nstat shows no {counter}: {text!r}")


@contextlib.contextmanager
def lossy(dev: str, netns: str, p: float) -> Iterator[None]:
    """Drop a random fraction ``p`` of the packets arriving on ``dev``: the
    lab's own drop classifier (cls_bpf on clsact ingress; this kernel has no
    netem), so the far end's TCP retransmits."""
    from fsdp_sentinel.lab import loss, netlink

    bpf, fd, name = loss.load_drop_program(p)
    ipr = netlink.open_existing(netns)
    try:
        netlink.attach_bpf(ipr, dev, fd, name, netlink.CLSACT_INGRESS)
        yield
    finally:
        netlink.remove_clsact(ipr, dev)
        ipr.close()
        bpf.cleanup()
