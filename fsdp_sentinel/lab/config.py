"""The lab's shape as data: its config, its hosts, and the names and addresses they get.

Pure (no system calls), so names and addresses are checked without root. Every
name derives from the lab's ``name`` and is unique machine-wide, because the
kernel's ``net:net_dev_xmit`` tracepoint carries only a device name, not its
namespace: two labs (or two hosts) must never share an interface name.

For a lab named ``fss`` with 2 hosts::

    netns fss-sw   bridge fss-br, ports fss-h0s fss-h1s fss-sts
    netns fss-h0   link fss-h0e  198.18.0.1/24   cgroup /sys/fs/cgroup/cpu/fss-h0
    netns fss-h1   link fss-h1e  198.18.0.2/24   cgroup /sys/fs/cgroup/cpu/fss-h1
    netns fss-st   link fss-ste  198.18.0.254/24 (the "storage host", no cgroup)
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

#: Every namespace, link and cgroup the lab makes starts with this.
PREFIX = "fss-"
#: Lab addresses come only from this range (RFC 2544 benchmarking).
ALLOWED_NET = ipaddress.IPv4Network("198.18.0.0/15")
#: Linux interface names hold at most 15 characters (IFNAMSIZ - 1).
IFNAME_MAX = 15
CGROUP_CPU_ROOT = "/sys/fs/cgroup/cpu"

_NAME_RE = re.compile(r"^fss-[a-z0-9]+(-[a-z0-9]+)*$|^fss$")


def valid_name(name: str) -> bool:
    """Whether ``name`` is a lab name (``fss`` or ``fss-`` and [a-z0-9-])."""
    return bool(_NAME_RE.match(name))


class LabError(RuntimeError):
    """The lab could not be built, changed or removed as asked."""


@dataclass(frozen=True)
class LabConfig:
    """What lab to build.

    ``rate_mbit`` shapes every host's link both ways (host egress, and the
    switch port towards the host); ``None`` leaves links unshaped. ``burst_ms``
    sizes the token bucket at that rate and ``latency_ms`` the queue behind it.
    ``replace_existing`` removes a leftover lab of the same name first.
    """

    name: str = "fss"
    hosts: int = 4
    rate_mbit: float | None = 1000.0
    subnet: str = "198.18.0.0/24"
    burst_ms: float = 2.0
    latency_ms: float = 20.0
    cgroup_root: str = CGROUP_CPU_ROOT
    replace_existing: bool = True
    #: Where the lab's state file goes (``lab.registry``).
    state_dir: str = "/run/fsdp-sentinel/labs"

    def __post_init__(self) -> None:
        problems = config_problems(self)
        if problems:
            raise LabError("bad lab config: " + "; ".join(problems))


@dataclass(frozen=True)
class LabHost:
    """One lab host: a network namespace with one link, an address and a cpu cgroup.

    ``index`` is the host's position (and, by the lab's convention, its rank);
    the storage host has index -1 and no cgroup. ``switch_ifname`` is the
    bridge port facing this host, in the switch namespace.
    """

    name: str
    netns: str
    ifname: str
    addr: str
    cgroup: str | None
    index: int
    switch_ifname: str
    prefixlen: int


def config_problems(cfg: LabConfig) -> list[str]:
    """Why ``cfg`` cannot be built (empty when it can)."""
    out: list[str] = []
    if not _NAME_RE.match(cfg.name):
        out.append(f"name {cfg.name!r} must start with {PREFIX!r} (or be 'fss'), [a-z0-9-]")
    if cfg.hosts < 1:
        out.append("hosts must be >= 1")
    longest = host_ifname(cfg.name, max(cfg.hosts - 1, 0))
    if len(longest) > IFNAME_MAX:
        out.append(f"name {cfg.name!r} too long: interface {longest!r} exceeds {IFNAME_MAX} chars")
    if cfg.rate_mbit is not None and not cfg.rate_mbit > 0:
        out.append("rate_mbit must be > 0 (or None for unshaped links)")
    try:
        net = ipaddress.ip_network(cfg.subnet)
    except ValueError as e:
        out.append(f"subnet: {e}")
    else:
        if not (isinstance(net, ipaddress.IPv4Network) and net.subnet_of(ALLOWED_NET)):
            out.append(f"subnet {cfg.subnet} must lie inside {ALLOWED_NET}")
        elif net.num_addresses - 3 < cfg.hosts:  # network, broadcast, storage host
            out.append(f"subnet {cfg.subnet} too small for {cfg.hosts} hosts")
    if cfg.burst_ms <= 0 or cfg.latency_ms <= 0:
        out.append("burst_ms and latency_ms must be > 0")
    return out


def host_netns(lab: str, i: int) -> str:
    return f"{lab}-h{i}"


def host_ifname(lab: str, i: int) -> str:
    return f"{lab}-h{i}e"


def switch_port(lab: str, i: int) -> str:
    return f"{lab}-h{i}s"


def switch_netns(lab: str) -> str:
    return f"{lab}-sw"


def bridge_name(lab: str) -> str:
    return f"{lab}-br"


def storage_netns(lab: str) -> str:
    return f"{lab}-st"


def plan_hosts(cfg: LabConfig) -> list[LabHost]:
    """The hosts of ``cfg``, in index order: host ``i`` gets the subnet's address ``i + 1``."""
    net = ipaddress.ip_network(cfg.subnet)
    out = []
    for i in range(cfg.hosts):
        name = host_netns(cfg.name, i)
        out.append(
            LabHost(
                name=name,
                netns=name,
                ifname=host_ifname(cfg.name, i),
                addr=str(net.network_address + 1 + i),
                cgroup=f"{cfg.cgroup_root}/{name}",
                index=i,
                switch_ifname=switch_port(cfg.name, i),
                prefixlen=net.prefixlen,
            )
        )
    return out


def plan_storage(cfg: LabConfig) -> LabHost:
    """The storage host: the far end of noisy-neighbour traffic, on the last usable address."""
    net = ipaddress.ip_network(cfg.subnet)
    name = storage_netns(cfg.name)
    return LabHost(
        name=name,
        netns=name,
        ifname=f"{name}e",
        addr=str(net.broadcast_address - 1),
        cgroup=None,
        index=-1,
        switch_ifname=f"{name}s",
        prefixlen=net.prefixlen,
    )


def tbf_sizes(rate_mbit: float, burst_ms: float, latency_ms: float) -> tuple[int, int]:
    """Token-bucket ``(burst, limit)`` in bytes for a rate.

    The burst holds at least one 64 KiB GSO packet plus an MTU, so big
    segments never wait for a bucket they cannot fill; the limit queues
    ``latency_ms`` at the rate on top of one burst.
    """
    bytes_per_s = rate_mbit * 1e6 / 8
    burst = max(int(bytes_per_s * burst_ms / 1000), 65536 + 1514)
    limit = int(bytes_per_s * latency_ms / 1000) + burst
    return burst, limit
