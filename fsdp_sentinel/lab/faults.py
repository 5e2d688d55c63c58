"""The faults the lab can inject; each is a small dataclass with ``apply`` and ``undo``.

Callers decide onset and end (a step or a time) and call ``Lab.inject(fault)``
/ ``Lab.clear(fault)``, which return the trace-v1 ``fault`` records, so a
trace carries its own ground truth. ``what`` names (stable, used by
detection's truth files): ``slow_link``, ``slow_path``, ``noisy_neighbor``,
``slow_compute``, ``packet_loss``, ``rank_kill``, ``rank_hang`` (SIGSTOP),
``silent_node`` (the switch's end of the host's link down).

Stacking: a host's link may carry a rate (tbf) and packet loss (clsact, on
the switch's port; one packet-loss fault per host at a time) at once; a
slow link changes the tbf's rate in place and its clear restores the lab's
rate. Noisy-neighbour processes live in the host's namespace but not in
its cgroup, so they neither count against a CPU quota nor get killed as the
rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from fsdp_sentinel.lab.config import LabError, LabHost

if TYPE_CHECKING:
    from fsdp_sentinel.lab.topology import Lab

HostArg = int | str | LabHost
#: Base TCP port of noisy-neighbour sinks (one per host index).
NOISE_PORT = 5300
CFS_PERIOD_US = 100_000


class Fault(Protocol):
    what: ClassVar[str]
    host: HostArg

    def apply(self, lab: Lab) -> tuple[dict[str, Any], Any]: ...

    def undo(self, lab: Lab, state: Any) -> None: ...


@dataclass(eq=False)
class SlowLink:
    """The host's link drops to ``rate_mbit`` (tbf rate, changed in place, burst kept)."""

    host: HostArg
    rate_mbit: float
    direction: str = "out"
    what: ClassVar[str] = "slow_link"

    def apply(self, lab: Lab) -> tuple[dict[str, Any], Any]:
        if not self.rate_mbit > 0:
            raise LabError("SlowLink rate_mbit must be > 0")
        ends = lab.link_ends(self.host, self.direction)
        for end in ends:
            lab.set_rate(end, self.rate_mbit)
        params = {
            "rate_mbit": self.rate_mbit,
            "direction": self.direction,
            "base_rate_mbit": lab.config.rate_mbit,
        }
        return params, ends

    def undo(self, lab: Lab, state: Any) -> None:
        for end in state:
            lab.reset_rate(end)


@dataclass(eq=False)
class SlowPath:
    """Only the path between the host and ``peer`` drops to ``rate_mbit``, both ways:
    a bad cable, port or switch path between two nodes. Each end's other
    traffic keeps the lab's rate.

    On each end's egress an HTB hangs under the link's tbf (``parent 1:1``;
    at the root on an unshaped lab) with two classes: the default at the
    lab's rate, and the slow one, which a u32 filter on the other end's
    address feeds. ``peer`` None: the next host in the ring (a ring
    neighbour, so the job's traffic crosses the path).
    """

    host: HostArg
    rate_mbit: float
    peer: HostArg | None = None
    what: ClassVar[str] = "slow_path"

    HANDLE: ClassVar[str] = "10:"

    def ends(self, lab: Lab) -> tuple[LabHost, LabHost]:
        h = lab.host(self.host)
        peer = self.peer if self.peer is not None else (h.index + 1) % len(lab.hosts)
        p = lab.host(peer)
        if p is h:
            raise LabError("SlowPath needs two different hosts")
        return h, p

    def apply(self, lab: Lab) -> tuple[dict[str, Any], Any]:
        if not self.rate_mbit > 0:
            raise LabError("SlowPath rate_mbit must be > 0")
        h, p = self.ends(lab)
        done: list[tuple[str, str, str]] = []
        try:
            for src, dst in ((h, p), (p, h)):
                end = (src.netns, src.ifname)
                base = lab.rate(end) or 10_000.0
                parent = ["parent", "1:1"] if lab.rate(end) else ["root"]
                tc = ["ip", "netns", "exec", src.netns, "tc"]
                dev = ["dev", src.ifname]
                cmds = [
                    [*tc, "qdisc", "add", *dev, *parent, "handle", self.HANDLE, "htb", "default", "1"],
                    [*tc, "class", "add", *dev, "parent", self.HANDLE, "classid", "10:1",
                     "htb", "rate", f"{base}mbit", "ceil", f"{base}mbit", "quantum", "60000"],
                    [*tc, "class", "add", *dev, "parent", self.HANDLE, "classid", "10:2",
                     "htb", "rate", f"{self.rate_mbit}mbit", "ceil", f"{self.rate_mbit}mbit",
                     "quantum", "60000"],
                    [*tc, "filter", "add", *dev, "parent", self.HANDLE, "protocol", "ip",
                     "prio", "1", "u32", "match", "ip", "dst", f"{dst.addr}/32", "flowid", "10:2"],
                ]  # fmt: skip
                done.append((*end, "1:1" if lab.rate(end) else "root"))
                for cmd in cmds:
                    subprocess.run(cmd, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            self.undo(lab, done)
            raise LabError(f"tc failed: {' '.join(e.cmd)}: {e.stderr.strip()}") from e
        except BaseException:
            self.undo(lab, done)
            raise
        params = {
            "rate_mbit": self.rate_mbit,
            "peer_host": p.name,
            "peer_rank": p.index,
            "peer_addr": p.addr,
            "base_rate_mbit": lab.config.rate_mbit,
        }
        return params, done

    def undo(self, lab: Lab, state: Any) -> None:
        """Take the HTB off each end: under a tbf, the tbf's own inner queue goes back
        in its place (deleting it would leave ``noop``, which drops everything);
        at the root, deleting it restores the default qdisc."""
        for netns, ifname, parent in state:
            if parent != "root":
                try:
                    lab.restore_tbf_queue((netns, ifname))
                except subprocess.CalledProcessError as e:
                    if not _gone(e.stderr):
                        raise LabError(f"tc on {netns}/{ifname}: {e.stderr.strip()}") from e
                continue
            res = subprocess.run(
                ["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", ifname, "root"],
                capture_output=True, text=True,
            )  # fmt: skip
            if res.returncode and not _gone(res.stderr):
                raise LabError(f"tc qdisc del on {netns}/{ifname}: {res.stderr.strip()}")


def _gone(stderr: str) -> bool:
    """tc's words for a namespace, link or qdisc that is gone already (the lab torn
    down first): fine to find on cleanup, nothing else is."""
    return any(w in stderr for w in ("No such", "Cannot find", "Invalid handle", "Cannot open"))


class _Procs:
    """Processes a fault started; ``close`` stops them (also called by ``Lab.close``)."""

    def __init__(self, procs: list[subprocess.Popen[Any]]) -> None:
        self.procs = procs

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=3)


@dataclass(eq=False)
class NoisyNeighbor:
    """Bulk TCP that is not the job's on the host's link, to or from the storage host.

    ``direction="out"``: the host uploads (like a checkpoint) to the storage
    host; ``"in"``: the storage host sends to it. ``rate_mbit`` paces the
    sender (``None``: as fast as the link allows); ``streams`` parallel TCP
    connections.
    """

    host: HostArg
    direction: str = "out"
    rate_mbit: float | None = None
    streams: int = 4
    what: ClassVar[str] = "noisy_neighbor"

    def apply(self, lab: Lab) -> tuple[dict[str, Any], Any]:
        h = lab.host(self.host)
        if self.direction not in ("out", "in"):
            raise LabError(f"NoisyNeighbor direction must be out or in, not {self.direction!r}")
        src, dst = (h, lab.storage) if self.direction == "out" else (lab.storage, h)
        port = NOISE_PORT + h.index
        bulk = ["-m", "fsdp_sentinel.lab.bulk"]
        quiet = {"stdout": subprocess.DEVNULL}
        sink = lab.python(dst, [*bulk, "sink", "--bind", dst.addr, "--port", str(port)],
                          cgroup=False, **quiet)  # fmt: skip
        send_args = [*bulk, "send", "--to", f"{dst.addr}:{port}", "--streams", str(self.streams)]
        if self.rate_mbit is not None:
            send_args += ["--rate-mbit", str(self.rate_mbit)]
        sender = lab.python(src, send_args, cgroup=False, **quiet)
        params = {
            "direction": self.direction,
            "rate_mbit": self.rate_mbit,
            "streams": self.streams,
            "src": f"{src.addr}",
            "dst": f"{dst.addr}:{port}",
            "pids": [sender.pid, sink.pid],
        }
        return params, _Procs([sender, sink])

    def undo(self, lab: Lab, state: Any) -> None:
        state.close()


@dataclass(eq=False)
class SlowCompute:
    """A CFS quota on the host's cgroup: its processes get ``cpu_fraction`` of one core."""

    host: HostArg
    cpu_fraction: float
    what: ClassVar[str] = "slow_compute"

    def apply(self, lab: Lab) -> tuple[dict[str, Any], Any]:
        if not self.cpu_fraction > 0:
            raise LabError("SlowCompute cpu_fraction must be > 0")
        period = int(lab.read_cgroup(self.host, "cpu.cfs_period_us"))
        quota = max(1000, round(self.cpu_fraction * period))  # the kernel's minimum is 1 ms
        old = lab.read_cgroup(self.host, "cpu.cfs_quota_us")
        lab.write_cgroup(self.host, "cpu.cfs_quota_us", str(quota))
        params = {"cpu_fraction": self.cpu_fraction, "cfs_quota_us": quota, "cfs_period_us": period}
        return params, old

    def undo(self, lab: Lab, state: Any) -> None:
        lab.write_cgroup(self.host, "cpu.cfs_quota_us", state)


class _LossProgram:
    """A loaded drop classifier: the bcc object that owns the program, and where it hangs."""

    def __init__(self, bpf: Any, ends: list[tuple[str, str]]) -> None:
        self.bpf = bpf
        self.ends = ends

    def close(self) -> None:
        if self.bpf is not None:
            self.bpf.cleanup()
            self.bpf = None


@dataclass(eq=False)
class PacketLoss:
    """Drop each packet with probability ``p`` on the wire (a BPF classifier on
    clsact; no netem here).

    The classifier sits on the *switch's* port of the host's link: its
    ingress for ``out`` (packets the host sent), its egress for ``in``
    (packets on their way to the host). Not on the host's own egress: a
    packet its own qdisc layer drops is reported back to the sending socket
    (``NET_XMIT_DROP``), and TCP then simply sends it again later, without a
    retransmission, loss recovery or any of the signs that loss on a real
    link leaves. Measured here: 20 % dropped on the host's egress stretched
    every step ~2x with almost no retransmits on its flows.
    """

    host: HostArg
    p: float
    direction: str = "out"
    what: ClassVar[str] = "packet_loss"

    def hooks(self, lab: Lab) -> list[tuple[str, str, str]]:
        """Where the classifier hangs: ``(netns, ifname, clsact hook)``."""
        from fsdp_sentinel.lab import netlink

        h = lab.host(self.host)
        port = (lab.switch_netns, h.switch_ifname)
        out = [(*port, netlink.CLSACT_INGRESS)]
        into = [(*port, netlink.CLSACT_EGRESS)]
        by = {"out": out, "in": into, "both": out + into}
        if self.direction not in by:
            raise LabError(f"direction must be out, in or both, not {self.direction!r}")
        return by[self.direction]

    def apply(self, lab: Lab) -> tuple[dict[str, Any], Any]:
        from fsdp_sentinel.lab import loss, netlink

        if not 0.0 <= self.p <= 1.0:
            raise LabError("PacketLoss p must be within [0, 1]")
        hooks = self.hooks(lab)
        bpf, fd, name = loss.load_drop_program(self.p)
        state = _LossProgram(bpf, [])
        try:
            for netns, ifname, hook in hooks:
                with lab.netlink_handle(netns) as ipr:
                    netlink.attach_bpf(ipr, ifname, fd, name, hook)
                if (netns, ifname) not in state.ends:
                    state.ends.append((netns, ifname))
        except BaseException:
            self.undo(lab, state)
            raise
        # The filters hold their own reference to the program: the fd can go now.
        state.close()
        return {"p": self.p, "direction": self.direction}, state

    def undo(self, lab: Lab, state: Any) -> None:
        from fsdp_sentinel.lab import netlink

        for netns, ifname in state.ends:
            with lab.netlink_handle(netns) as ipr:
                netlink.remove_clsact(ipr, ifname)
        state.close()


def rank_pids(pids: list[int], proc: str = "/proc") -> list[int]:
    """Those of ``pids`` that are ranks: their environment names a ``RANK``
    (torchrun sets it for its workers, not for itself)."""
    out = []
    for pid in pids:
        try:
            env = Path(proc, str(pid), "environ").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if any(kv.startswith(b"RANK=") for kv in env.split(b"\0")):
            out.append(pid)
    return out


def signal_pids(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids``; one that is already gone is skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def signal_ranks(lab: Lab, host: HostArg, sig: int) -> list[int]:
    """Send ``sig`` to the rank process(es) of ``host``; their pids. A host with
    no rank process (``RANK`` in its environment) is an error."""
    victims = rank_pids(lab.cgroup_pids(host))
    if not victims:
        raise LabError(f"no rank process (RANK in its environment) in {lab.host(host).cgroup}")
    signal_pids(victims, sig)
    return victims


@dataclass(eq=False)
class KillRank:
    """SIGKILL the host's rank process(es): members of its cgroup with ``RANK`` set."""

    host: HostArg
    sig: int = signal.SIGKILL
    what: ClassVar[str] = "rank_kill"

    def apply(self, lab: Lab) -> tuple[dict[str, Any], Any]:
        victims = signal_ranks(lab, self.host, self.sig)
        return {"pids": victims, "signal": signal.Signals(self.sig).name}, None

    def undo(self, lab: Lab, state: Any) -> None:
        """Nothing to undo: a killed rank stays dead (the record just gets its ``end``)."""


# ---------------------------------------------------------------- hangs and silent loss


@dataclass(eq=False)
class HangRank:
    """SIGSTOP the host's rank process(es), SIGCONT on clear: a hung rank.

    Like a deadlocked rank or a hung GPU, the process stops sending and
    receiving but its sockets stay open (the kernel keeps them, with no FIN
    or RST), so the other ranks block in their next collective until gloo's
    timeout. Its hooks' sender thread stops too, so it sends no ``pending``
    record: that is what tells it from the ranks waiting for it.
    """

    host: HostArg
    what: ClassVar[str] = "rank_hang"

    def apply(self, lab: Lab) -> tuple[dict[str, Any], Any]:
        victims = signal_ranks(lab, self.host, signal.SIGSTOP)
        return {"pids": victims, "signal": "SIGSTOP"}, victims

    def undo(self, lab: Lab, state: Any) -> None:
        # A stopped process left so would hang its job (and its cleanup) for good.
        signal_pids(state, signal.SIGCONT)


@dataclass(eq=False)
class SilentNode:
    """The host is cut off: the switch's end of its link set down, up on clear.

    As a node that loses power or its cable: nothing it sends arrives and
    nothing reaches it, and neither side sees a FIN or RST (the host's own
    end stays configured; TCP just retransmits into the void). No reset is
    sent and the link's qdiscs are left as they are.
    """

    host: HostArg
    what: ClassVar[str] = "silent_node"

    def apply(self, lab: Lab) -> tuple[dict[str, Any], Any]:
        h = lab.host(self.host)
        _set_link(lab, lab.switch_netns, h.switch_ifname, "down")
        return {"netns": lab.switch_netns, "dev": h.switch_ifname}, h.switch_ifname

    def undo(self, lab: Lab, state: Any) -> None:
        _set_link(lab, lab.switch_netns, state, "up")


def _set_link(lab: Lab, netns: str, ifname: str, state: str) -> None:
    from fsdp_sentinel.lab import netlink

    with lab.netlink_handle(netns) as ipr:
        ipr.link("set", index=netlink.index_of(ipr, ifname), state=state)
