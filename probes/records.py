"""Turns decoded kernel map entries into trace-v1 records (pure functions).

Nothing here touches the kernel: the loader hands in plain Python values, so
these conversions are tested without root.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

AF_INET = 2
AF_INET6 = 10

CONN_WHAT = {1: "open", 2: "close", 3: "reset", 4: "reset"}
RESET_DIRECTION = {3: "sent", 4: "received"}

NCCL_OPS = {
    1: "all_gather",
    2: "reduce_scatter",
    3: "all_reduce",
    4: "broadcast",
    5: "send",
    6: "recv",
    7: "group_start",
    8: "group_end",
}


@dataclass(frozen=True, order=True)
class Tuple:
    """A connection as its local end names it (addresses as IP strings)."""

    family: int
    laddr: str
    lport: int
    raddr: str
    rport: int

    @property
    def src(self) -> str:
        return endpoint(self.family, self.laddr, self.lport)

    @property
    def dst(self) -> str:
        return endpoint(self.family, self.raddr, self.rport)


def endpoint(family: int, addr: str, port: int) -> str:
    """``ip:port`` (``[ip]:port`` for IPv6, so the last colon splits)."""
    return f"[{addr}]:{port}" if family == AF_INET6 else f"{addr}:{port}"


def format_addr(family: int, raw: bytes) -> str:
    if family == AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, bytes(raw[:16]))
    return socket.inet_ntop(socket.AF_INET, bytes(raw[:4]))


def make_tuple(family: int, lport: int, rport: int, laddr: bytes, raddr: bytes) -> Tuple:
    return Tuple(family, format_addr(family, laddr), lport, format_addr(family, raddr), rport)


@dataclass
class FlowFigures:
    """What one poll learned about one (process, connection)."""

    tx_bytes: int = 0
    rx_bytes: int = 0
    retrans: int = 0
    #: retransmitted segments the receiver reported it already had (D-SACK):
    #: spurious retransmits (a late ACK, not a lost packet)
    dsack_dups: int = 0
    srtt_us: int | None = None
    cwnd: int | None = None
    snd_wnd: int | None = None

    def add(self, tx: int, rx: int) -> None:
        self.tx_bytes += tx
        self.rx_bytes += rx


def flow_records(
    flows: dict[tuple[int, Tuple], FlowFigures], t: float, dt: float, host: str
) -> list[dict[str, Any]]:
    """One ``flow`` record per (pid, connection) that moved bytes or retransmitted."""
    out: list[dict[str, Any]] = []
    for (pid, tup), fig in sorted(flows.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if not (fig.tx_bytes or fig.rx_bytes or fig.retrans or fig.dsack_dups):
            continue
        rec: dict[str, Any] = {
            "kind": "flow",
            "t": t,
            "dt": dt,
            "host": host,
            "pid": pid,
            "src": tup.src,
            "dst": tup.dst,
            "tx_bytes": fig.tx_bytes,
            "rx_bytes": fig.rx_bytes,
            "retrans": fig.retrans,
        }
        if fig.dsack_dups:
            rec["dsack_dups"] = fig.dsack_dups
        if fig.srtt_us is not None:
            rec["srtt_us"] = fig.srtt_us
        if fig.cwnd is not None:
            rec["cwnd"] = fig.cwnd
        if fig.snd_wnd is not None:
            rec["snd_wnd"] = fig.snd_wnd
        out.append(rec)
    return out


def netdev_records(
    devs: dict[str, tuple[dict[str, int], Any]], t: float, dt: float, host: str
) -> list[dict[str, Any]]:
    """One ``netdev`` record per device, zero deltas included, from
    DeviceStats.poll() (probes/devstats.py): the driver's own counter deltas,
    the qdiscs' ``drops`` delta and their ``backlog`` (bytes) and ``qlen``
    (packets) now."""
    out = []
    for name in sorted(devs):
        delta, sample = devs[name]
        rec: dict[str, Any] = {"kind": "netdev", "t": t, "dt": dt, "host": host, "dev": name}
        rec.update(delta)
        rec["backlog"] = int(sample.backlog)
        rec["qlen"] = int(sample.qlen)
        out.append(rec)
    return out


@dataclass
class Evictions:
    """Entries each drained map created vs. those user space harvested; the
    shortfall is what the LRU evicted (accurate to the entries created
    during one drain)."""

    created: dict[str, int] = field(default_factory=dict)
    harvested: dict[str, int] = field(default_factory=dict)

    def harvest(self, name: str, n: int) -> None:
        self.harvested[name] = self.harvested.get(name, 0) + n

    def evicted(self) -> dict[str, int]:
        return {
            name: max(0, made - self.harvested.get(name, 0)) for name, made in self.created.items()
        }


def nccl_records(
    entries: Iterable[tuple[Any, Any]], comms: dict[int, Any], t: float, dt: float, host: str
) -> list[dict[str, Any]]:
    """``nccl`` records from drained (nccl_key, nccl_counters) entries;
    ``comms`` maps communicator address -> nccl_comm_info."""
    out = []
    for k, v in entries:
        rec: dict[str, Any] = {
            "kind": "nccl",
            "t": t,
            "dt": dt,
            "host": host,
            "pid": int(k.tgid),
            "op": NCCL_OPS.get(int(k.op), f"op{int(k.op)}"),
            "calls": int(v.calls),
            "bytes": int(v.bytes),
        }
        comm = int(k.comm)
        if comm:
            rec["comm"] = f"{comm:#x}"
            info = comms.get(comm)
            if info is not None:
                rec["rank"] = int(info.rank)
                rec["nranks"] = int(info.nranks)
        if int(v.bad_dtype):
            rec["unknown_dtype_calls"] = int(v.bad_dtype)
        out.append(rec)
    return sorted(out, key=lambda r: (r["pid"], r.get("comm", ""), r["op"]))


def qp_records(entries: Iterable[tuple[Any, Any]], t: float, host: str) -> list[dict[str, Any]]:
    """``qp`` records (one per kind of call that happened) from drained
    (qp_key, qp_counters) entries."""
    out = []
    for k, v in entries:
        base: dict[str, Any] = {
            "kind": "qp",
            "t": t,
            "host": host,
            "pid": int(k.tgid),
            "qp_num": int(k.qp_num),
        }
        if int(v.qp_type):
            base["qp_type"] = int(v.qp_type)
        for what, count in (("create", v.creates), ("modify", v.modifies), ("destroy", v.destroys)):
            if not int(count):
                continue
            rec = dict(base, what=what, calls=int(count))
            if what == "modify":
                if int(v.state) >= 0:
                    rec["state"] = int(v.state)
                if int(v.dest_qp_num):
                    rec["dest_qp_num"] = int(v.dest_qp_num)
            out.append(rec)
    return out
