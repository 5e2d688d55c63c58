"""Per-device counters from netlink: the kernel's own link and qdisc stats.

The kernel already counts every device's bytes, packets, errors and drops
(``IFLA_STATS64``, the figures ``/proc/net/dev`` prints) and every qdisc's
drops and backlog (``TCA_STATS2``). Reading them once per poll costs two
rtnetlink dumps per namespace (``RTM_GETLINK``, ``RTM_GETQDISC``) and nothing
per packet, where a tracepoint program per sent and per received packet cost
~half of all probe events (see BENCHMARKS.md). The figures are exact by
construction: they *are* the driver's counters.

The dumps are read from a raw netlink socket and only the attributes used
are decoded (the name, ``IFLA_STATS64``, ``TCA_STATS_QUEUE``): pyroute2's
``IPRoute`` decodes every attribute of every message through its asyncio
core, 11 ms of CPU per poll here for a handful of devices against ~1 ms
(BENCHMARKS.md, "the poll"). pyroute2 still does every tc change
(remediate/).

Namespaces read: the caller's own and every named one under ``netns_dir``
(``ip netns add`` puts them there; the lab's hosts live there), rescanned at
every poll; or, with ``only``, just those named (a node daemon for one host). A device name already seen in an earlier namespace (every
namespace has its own ``lo``) is reported as ``name@netns``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .sockdiag import nl_dump, nl_request, open_in_namespace

log = logging.getLogger(__name__)

NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWQDISC, RTM_GETQDISC = 36, 38
IFLA_IFNAME, IFLA_STATS64 = 3, 23
TCA_STATS2, TCA_STATS_QUEUE = 7, 3
_IFINFO = struct.Struct("=BxHiII")  # family, type, index, flags, change
_TCMSG = struct.Struct("=BxxxiIII")  # family, ifindex, handle, parent, info
_RTATTR = struct.Struct("=HH")  # len, type
_QUEUE = struct.Struct("=III")  # gnet_stats_queue: qlen, backlog, drops (then requeues, overlimits)
_NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER

#: struct rtnl_link_stats64's first fields, in order (u64 each): the netdev
#: record's fields (deltas).
STATS64_FIELDS = (
    "rx_packets",
    "tx_packets",
    "rx_bytes",
    "tx_bytes",
    "rx_errors",
    "tx_errors",
    "rx_dropped",
    "tx_dropped",
)
_STATS64 = struct.Struct(f"={len(STATS64_FIELDS)}Q")


@dataclass(frozen=True)
class DevSample:
    """One device's cumulative counters and its qdiscs' state at one instant."""

    counters: dict[str, int]  # STATS64_FIELDS + "drops" (qdisc drops, cumulative)
    backlog: int  # bytes queued in its qdiscs now (a gauge)
    qlen: int  # packets queued in its qdiscs now


def deltas(prev: DevSample | None, cur: DevSample) -> dict[str, int]:
    """Counter deltas from ``prev`` to ``cur``. A counter that went down (the
    device was recreated under the same name, or a qdisc replaced) restarts
    from zero: its new value is the delta. No previous sample: all zero (the
    first poll only sets the baseline)."""
    if prev is None:
        return dict.fromkeys(cur.counters, 0)
    out = {}
    for key, value in cur.counters.items():
        before = prev.counters.get(key, 0)
        out[key] = value - before if value >= before else value
    return out


def attrs(data: bytes, off: int) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of each netlink attribute in ``data`` from ``off``."""
    while off + _RTATTR.size <= len(data):
        length, kind = _RTATTR.unpack_from(data, off)
        if length < _RTATTR.size:
            break
        yield kind & _NLA_TYPE_MASK, data[off + _RTATTR.size : off + length]
        off += (length + 3) & ~3


def parse_link(body: bytes) -> tuple[int, str, dict[str, int]] | None:
    """An RTM_NEWLINK payload -> (ifindex, name, IFLA_STATS64 counters); None
    if it has no name."""
    if len(body) < _IFINFO.size:
        return None
    index = _IFINFO.unpack_from(body, 0)[2]
    name, stats = None, dict.fromkeys(STATS64_FIELDS, 0)
    for kind, val in attrs(body, _IFINFO.size):
        if kind == IFLA_IFNAME:
            name = val.split(b"\0", 1)[0].decode(errors="replace")
        elif kind == IFLA_STATS64 and len(val) >= _STATS64.size:
            stats = dict(zip(STATS64_FIELDS, _STATS64.unpack_from(val, 0), strict=True))
    return None if name is None else (index, name, stats)


def parse_qdisc(body: bytes) -> tuple[int, tuple[int, int, int]] | None:
    """An RTM_NEWQDISC payload -> (ifindex, (qlen, backlog, drops)); None
    without TCA_STATS_QUEUE."""
    if len(body) < _TCMSG.size:
        return None
    index = _TCMSG.unpack_from(body, 0)[1]
    for kind, val in attrs(body, _TCMSG.size):
        if kind == TCA_STATS2:
            for sub, q in attrs(val, 0):
                if sub == TCA_STATS_QUEUE and len(q) >= _QUEUE.size:
                    return index, _QUEUE.unpack_from(q, 0)
    return None


def sample_link(stats: dict[str, int], queues: list[tuple[int, int, int]]) -> DevSample:
    """A DevSample from a device's IFLA_STATS64 counters and its qdiscs'
    (qlen, backlog, drops)."""
    counters = {k: int(stats.get(k, 0)) for k in STATS64_FIELDS}
    counters["drops"] = sum(q[2] for q in queues)
    return DevSample(counters, sum(q[1] for q in queues), sum(q[0] for q in queues))


def dump(sock: socket.socket, msg_type: int, body: bytes, seq: int) -> Iterator[tuple[int, bytes]]:
    """Send one rtnetlink dump request; (type, payload) of every reply message."""
    return nl_dump(sock, nl_request(msg_type, body, seq), 1 << 17)


class DeviceStats:
    """Reads every device's counters in the namespaces named above.

    ``poll()`` returns ``{name: (deltas, sample)}`` since the previous poll;
    ``close()`` closes the netlink sockets (idempotent)."""

    def __init__(
        self, netns_dir: str | None = "/run/netns", only: tuple[str, ...] | None = None
    ) -> None:
        self.netns_dir = netns_dir
        self.only = only  # just these named namespaces (a node daemon for one of them)
        self._socks: dict[str, Any] = {}  # "" = our own namespace
        self._prev: dict[tuple[str, int, str], DevSample] = {}
        self.errors: dict[str, str] = {}  # namespace -> last read error

    def _namespaces(self) -> list[str]:
        if self.only is not None:
            return list(self.only)
        names = [""]
        if self.netns_dir:
            with contextlib.suppress(OSError):
                names += sorted(os.listdir(self.netns_dir))
        return names

    def _socket(self, ns: str) -> Any:
        sock = self._socks.get(ns)
        if sock is None:
            path = os.path.join(self.netns_dir or "/run/netns", ns) if ns else None
            sock = open_in_namespace(path, protocol=NETLINK_ROUTE)
            self._socks[ns] = sock
        return sock

    def _drop(self, ns: str) -> None:
        sock = self._socks.pop(ns, None)
        if sock is not None:
            with contextlib.suppress(Exception):
                sock.close()

    def read(self) -> dict[tuple[str, int, str], DevSample]:
        """(namespace, ifindex, name) -> its sample now."""
        out: dict[tuple[str, int, str], DevSample] = {}
        wanted = self._namespaces()
        for ns in set(self._socks) - set(wanted):
            self._drop(ns)  # namespace deleted
        for ns in wanted:
            try:
                sock = self._socket(ns)
                links = []
                for kind, body in dump(sock, RTM_GETLINK, _IFINFO.pack(0, 0, 0, 0, 0), 1):
                    link = parse_link(body) if kind == RTM_NEWLINK else None
                    if link is not None:
                        links.append(link)
                by_dev: dict[int, list[tuple[int, int, int]]] = {}
                for kind, body in dump(sock, RTM_GETQDISC, _TCMSG.pack(0, 0, 0, 0, 0), 2):
                    q = parse_qdisc(body) if kind == RTM_NEWQDISC else None
                    if q is not None:
                        by_dev.setdefault(q[0], []).append(q[1])
            except (OSError, struct.error) as e:  # namespace vanished mid-read, or no netlink
                self.errors[ns] = str(e)
                self._drop(ns)
                continue
            self.errors.pop(ns, None)
            for idx, name, stats in links:
                out[(ns, idx, name)] = sample_link(stats, by_dev.get(idx, []))
        return out

    def poll(self) -> dict[str, tuple[dict[str, int], DevSample]]:
        """Device name -> (counter deltas since the previous poll, sample now)."""
        now = self.read()
        out: dict[str, tuple[dict[str, int], DevSample]] = {}
        for key, cur in now.items():
            ns, _, name = key
            shown = name if name not in out else f"{name}@{ns}"
            out[shown] = (deltas(self._prev.get(key), cur), cur)
        self._prev = now
        return out

    def close(self) -> None:
        for ns in list(self._socks):
            self._drop(ns)
