"""Per-device counters from netlink: the kernel's own link and qdisc stats.

The kernel already counts every device's bytes, packets, errors and drops
(``IFLA_STATS64``, the figures ``/proc/net/dev`` prints) and every qdisc's
drops and backlog (``TCA_STATS2``). Reading them once per poll through
pyroute2 costs a few netlink messages per namespace and nothing per packet,
where a tracepoint program per sent and per received packet cost ~half of
all probe events (see BENCHMARKS.md). The figures are exact by construction:
they *are* the driver's counters.

Namespaces read: the caller's own and every named one under ``netns_dir``
(``ip netns add`` puts them there; the lab's hosts live there), rescanned at
every poll; or, with ``only``, just those named (a node daemon for one host). A device name already seen in an earlier namespace (every
namespace has its own ``lo``) is reported as ``name@netns``.

pyroute2 is imported only when a reader opens, so this module imports on any
machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: IFLA_STATS64 field -> netdev record field (deltas).
LINK_FIELDS = {
    "tx_bytes": "tx_bytes",
    "rx_bytes": "rx_bytes",
    "tx_packets": "tx_packets",
    "rx_packets": "rx_packets",
    "tx_errors": "tx_errors",
    "rx_errors": "rx_errors",
    "tx_dropped": "tx_dropped",
    "rx_dropped": "rx_dropped",
}


@dataclass(frozen=True)
class DevSample:
    """One device's cumulative counters and its qdiscs' state at one instant."""

    counters: dict[str, int]  # LINK_FIELDS values + "drops" (qdisc drops, cumulative)
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


def sample_link(link: Any, qdiscs: list[Any]) -> DevSample:
    """A DevSample from one RTM_NEWLINK message and that device's RTM_NEWQDISC
    messages (pyroute2 nlmsg objects)."""
    st = link.get_attr("IFLA_STATS64") or {}
    counters = {rec: int(st.get(nl, 0) or 0) for nl, rec in LINK_FIELDS.items()}
    drops = backlog = qlen = 0
    for q in qdiscs:
        s2 = q.get_attr("TCA_STATS2")
        queue = s2.get_attr("TCA_STATS_QUEUE") if s2 is not None else None
        if queue is None:
            continue
        drops += int(queue["drops"])
        backlog += int(queue["backlog"])
        qlen += int(queue["qlen"])
    counters["drops"] = drops
    return DevSample(counters, backlog, qlen)


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
            from pyroute2 import IPRoute, NetNS  # type: ignore[import-untyped]

            sock = IPRoute() if not ns else NetNS(ns)
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
                links = list(sock.get_links())
                by_dev: dict[int, list[Any]] = {}
                for q in sock.get_qdiscs():
                    by_dev.setdefault(int(q["index"]), []).append(q)
            except Exception as e:  # namespace vanished mid-read, or no netlink
                self.errors[ns] = str(e)
                self._drop(ns)
                continue
            self.errors.pop(ns, None)
            for link in links:
                name = link.get_attr("IFLA_IFNAME")
                idx = int(link["index"])
                out[(ns, idx, name)] = sample_link(link, by_dev.get(idx, []))
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
