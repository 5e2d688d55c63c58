"""Netlink work inside one lab namespace: links, addresses, and the lab's two qdiscs.

Everything goes through pyroute2's ``IPRoute(netns=...)``, opened per call by
an injectable factory, so the root namespace is never touched. The qdisc tree
of a lab link is deliberately flat (docs/lab.md):

- ``root 1: tbf`` shapes the link's egress to the host's rate. A rate change
  is done in place with the *same* burst (a TBF changed to a smaller burst
  while packets are queued can wedge for good: machine-notes), which also
  keeps any child a remediator hung under ``1:1``.
- ``clsact`` carries the packet-loss classifier on its egress hook; it runs
  before the root qdisc and is independent of it.

Cleanup helpers tolerate only the errors that mean "already gone".
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

#: Opens a netlink handle inside the named network namespace.
IPRouteFactory = Callable[[str], Any]

#: errnos that mean the thing to remove is already gone.
GONE = (errno.ENOENT, errno.ENODEV, errno.EINVAL)
#: clsact's egress hook (TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_EGRESS)).
CLSACT_EGRESS = "ffff:fff3"
#: clsact's ingress hook (TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS)).
CLSACT_INGRESS = "ffff:fff2"


def open_existing(netns: str) -> Any:
    """A handle in an existing namespace (never creates one: flags=0); no event groups."""
    return IPRoute(netns=netns, flags=0, groups=0)


def open_or_create(netns: str) -> Any:
    return IPRoute(netns=netns, groups=0)


@contextmanager
def handle(factory: IPRouteFactory, netns: str) -> Iterator[Any]:
    ipr = factory(netns)
    try:
        yield ipr
    finally:
        ipr.close()


def index_of(ipr: Any, ifname: str) -> int:
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise NetlinkError(errno.ENODEV, f"no link {ifname}")
    return int(found[0])


def add_veth(ipr: Any, ifname: str, peer: str, peer_netns_path: str) -> None:
    """A veth pair: ``ifname`` in ``ipr``'s namespace, ``peer`` born in another one.

    The namespace goes by an fd we open and close around the call, so its
    lifetime does not depend on pyroute2's own name lookup.
    """
    fd = os.open(peer_netns_path, os.O_RDONLY)
    try:
        ipr.link("add", ifname=ifname, kind="veth", peer={"ifname": peer, "net_ns_fd": fd})
    finally:
        os.close(fd)


def link_up(ipr: Any, ifname: str, *, master: str | None = None) -> None:
    kw: dict[str, Any] = {"state": "up"}
    if master is not None:
        kw["master"] = index_of(ipr, master)
    ipr.link("set", index=index_of(ipr, ifname), **kw)


def set_tbf(ipr: Any, ifname: str, rate_mbit: float, burst: int, limit: int) -> None:
    """Install or re-rate ``root 1: tbf`` (``replace`` converges; same handle+kind = change)."""
    ipr.tc(
        "replace",
        "tbf",
        index_of(ipr, ifname),
        handle="1:",
        rate=f"{round(rate_mbit * 1000)}kbit",
        burst=burst,
        limit=limit,
    )


def attach_bpf(ipr: Any, ifname: str, prog_fd: int, prog_name: str, hook: str) -> None:
    """Hang a direct-action BPF classifier on the link's clsact ``hook``
    (:data:`CLSACT_EGRESS` or :data:`CLSACT_INGRESS`)."""
    idx = index_of(ipr, ifname)
    try:
        ipr.tc("add", "clsact", idx)
    except NetlinkError as e:
        if e.code != errno.EEXIST:
            raise
    ipr.tc(
        "add-filter",
        "bpf",
        idx,
        ":1",
        fd=prog_fd,
        name=prog_name,
        parent=hook,
        classid=1,
        direct_action=True,
    )


def remove_clsact(ipr: Any, ifname: str) -> None:
    """Remove clsact (and with it every classifier on the link); gone already is fine."""
    try:
        ipr.tc("del", "clsact", index_of(ipr, ifname))
    except NetlinkError as e:
        if e.code not in GONE:
            raise
