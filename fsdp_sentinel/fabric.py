"""Running totals of ``rdma`` and ``nccl`` records, for the snapshot.

Detection does not use these records yet; the exporter shows them (on
InfiniBand the TCP panels are empty and these are the network figures). Both
record kinds carry deltas over one probe interval, so the totals are plain
sums. Their keys are bounded by the hardware (devices, ports, counter names)
and the job (ranks, ops), never by pids or time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdp_sentinel.snapshot import NcclView, RdmaPortView

Record = dict[str, Any]

#: sysfs counters of an RDMA port that count errors or discards (see
#: docs/rdma.md); the byte and packet counters are exported on their own.
RDMA_ERROR_COUNTERS = frozenset(
    {
        "symbol_error",
        "link_error_recovery",
        "link_downed",
        "port_rcv_errors",
        "port_rcv_remote_physical_errors",
        "port_rcv_switch_relay_errors",
        "port_xmit_discards",
        "port_xmit_constraint_errors",
        "port_rcv_constraint_errors",
        "local_link_integrity_errors",
        "excessive_buffer_overrun_errors",
        "VL15_dropped",
    }
)


def is_error_counter(name: str) -> bool:
    """An error, discard or retransmission counter (``hw.``: provider counters)."""
    base = name.removeprefix("hw.")
    return base in RDMA_ERROR_COUNTERS or any(w in base for w in _ERROR_WORDS)


_ERROR_WORDS = ("err", "discard", "drop", "out_of_sequence", "retrans")


class FabricTotals:
    """Sums of ``rdma`` records per (host, dev, port) and of ``nccl`` records
    per (host, rank, op). ``rank_of(host, pid)`` names the rank of a process
    that has no communicator rank in its record (None when unknown)."""

    def __init__(self, rank_of: Callable[[str, int], int | None]) -> None:
        self._rank_of = rank_of
        self._ports: dict[tuple[str, str, int], list[Any]] = {}
        self._nccl: dict[tuple[str, int | None, str], list[int]] = {}

    def add_rdma(self, rec: Record) -> None:
        key = (str(rec["host"]), str(rec["dev"]), int(rec["port"]))
        tot = self._ports.get(key)
        if tot is None:
            tot = self._ports[key] = [0, 0, {}]
        tot[0] += int(rec["tx_bytes"])
        tot[1] += int(rec["rx_bytes"])
        errors: dict[str, int] = tot[2]
        for name, n in (rec.get("counters") or {}).items():
            if n and is_error_counter(name):
                errors[name] = errors.get(name, 0) + int(n)

    def add_nccl(self, rec: Record) -> None:
        host = str(rec["host"])
        rank = rec.get("rank")
        rank = int(rank) if rank is not None else self._rank_of(host, int(rec["pid"]))
        key = (host, rank, str(rec["op"]))
        tot = self._nccl.get(key)
        if tot is None:
            tot = self._nccl[key] = [0, 0]
        tot[0] += int(rec["calls"])
        tot[1] += int(rec["bytes"])

    def rdma_ports(self) -> tuple[RdmaPortView, ...]:
        return tuple(
            RdmaPortView(host, dev, port, tx, rx, dict(sorted(err.items())))
            for (host, dev, port), (tx, rx, err) in sorted(self._ports.items())
        )

    def nccl(self) -> tuple[NcclView, ...]:
        order = sorted(self._nccl.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1, kv[0][2]))
        return tuple(NcclView(h, r, op, c, b) for (h, r, op), (c, b) in order)
