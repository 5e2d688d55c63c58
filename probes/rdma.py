"""RDMA port counters from sysfs, as deltas (``rdma`` records).

RDMA data moves between NIC and user memory without entering the kernel's
network stack, so no tracepoint sees it; the NIC's own port counters are the
one honest source. Layout (mlx5 and other providers):

    /sys/class/infiniband/DEV/ports/N/counters/port_xmit_data   (4-byte words)
    /sys/class/infiniband/DEV/ports/N/counters/port_rcv_data    (4-byte words)
    /sys/class/infiniband/DEV/ports/N/counters/port_xmit_wait   (ticks with data
        queued but no credit to send: the fabric is pushing back)
    /sys/class/infiniband/DEV/ports/N/hw_counters/*             (provider-specific)

The sysfs root is injected, so tests read a fixture tree.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: counters that count 4-byte words, not bytes (IBTA PortCounters)
WORD_COUNTERS = ("port_xmit_data", "port_rcv_data")


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _read_counters(folder: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in _entries(folder):
        try:
            out[f.name] = int(f.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # unreadable or not a number (some files are write-only)
    return out


def read_ports(root: Path) -> dict[tuple[str, int], dict[str, int]]:
    """Every (device, port) -> {counter: value}; hw_counters prefixed with "hw."."""
    ports: dict[tuple[str, int], dict[str, int]] = {}
    for dev in _entries(root):
        for pdir in _entries(dev / "ports"):
            if not pdir.name.isdigit():
                continue
            vals = _read_counters(pdir / "counters")
            vals.update({f"hw.{k}": v for k, v in _read_counters(pdir / "hw_counters").items()})
            ports[(dev.name, int(pdir.name))] = vals
    return ports


class RdmaReader:
    """Reads the port counters each ``poll()`` and returns their deltas."""

    def __init__(
        self,
        root: str | Path = "/sys/class/infiniband",
        host: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = Path(root)
        self.host = host or socket.gethostname()
        self._clock = clock
        self._last: dict[tuple[str, int], dict[str, int]] = {}
        self._last_t: float | None = None

    def present(self) -> bool:
        return self.root.is_dir()

    def poll(self) -> list[dict[str, Any]]:
        """``rdma`` records since the previous poll (none on the first)."""
        now = self._clock()
        cur = read_ports(self.root)
        prev, prev_t = self._last, self._last_t
        self._last, self._last_t = cur, now
        if prev_t is None:
            return []
        out = []
        for (dev, port), vals in sorted(cur.items()):
            old = prev.get((dev, port))
            if old is None:
                continue  # appeared since last poll: baseline now
            delta: dict[str, int] = {}
            reset = False
            for name, v in vals.items():
                if name not in old:
                    continue
                d = v - old[name]
                if d < 0:  # counter reset (driver reload, explicit clear)
                    reset, d = True, v
                delta[name] = d
            rec: dict[str, Any] = {
                "kind": "rdma",
                "t": now,
                "dt": now - prev_t,
                "host": self.host,
                "dev": dev,
                "port": port,
                "tx_bytes": 4 * delta.get("port_xmit_data", 0),
                "rx_bytes": 4 * delta.get("port_rcv_data", 0),
                "tx_packets": delta.get("port_xmit_packets", 0),
                "rx_packets": delta.get("port_rcv_packets", 0),
                "xmit_wait": delta.get("port_xmit_wait", 0),
                "pause": {k: d for k, d in delta.items() if "pause" in k},
                "counters": {
                    k: d
                    for k, d in delta.items()
                    if d and k not in WORD_COUNTERS and "pause" not in k
                },
            }
            if reset:
                rec["reset"] = True
            out.append(rec)
        return out
