"""Who shares a host's link: the device's bytes against the job's own flow bytes (pure).

Fed the pipeline's own records (``rank``, ``netdev``, ``flow``, ``conn``), in
stream order, it answers two questions about one host and its device over
the last ``window_s`` seconds of stream time:

- ``foreign_tx_share``: the share of the device's egress bytes that are not
  the job's flows (``1 - job_tx / dev_tx``). A noisy neighbour, a checkpoint
  upload or a data loader on the same link shows here; TCP/IP headers alone
  make a few per cent on a clean link, because flows count payload and the
  device counts frames.
- ``foreign_rx_share``: the same for ingress (others sending *into* the
  host), which host tc on the egress cannot fix.

It also keeps the job's live flows per host (their 4-tuples, local end
first, as the probes report them), which the classifier's map is filled from.
The job's flows are those of the ranks' processes (``rank`` records name each
pid and its host), so traffic of other processes on the same address is
foreign, as it should be.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

Record = dict[str, Any]
#: (local "ip:port", remote "ip:port"): one TCP flow as the probes name it.
FlowKey = tuple[str, str]


@dataclass(frozen=True)
class Contention:
    """One host's device over one window; shares are None without device bytes."""

    seconds: float
    dev_tx_bytes: int
    dev_rx_bytes: int
    job_tx_bytes: int
    job_rx_bytes: int

    @staticmethod
    def _share(dev: int, job: int) -> float | None:
        if dev <= 0:
            return None
        return max(0.0, 1.0 - job / dev)

    @property
    def foreign_tx_share(self) -> float | None:
        return self._share(self.dev_tx_bytes, self.job_tx_bytes)

    @property
    def foreign_rx_share(self) -> float | None:
        return self._share(self.dev_rx_bytes, self.job_rx_bytes)

    def evidence(self) -> dict[str, Any]:
        """The figures as verdict evidence (rounded like detect's)."""
        out: dict[str, Any] = {}
        for name, value in (("foreign_tx_share", self.foreign_tx_share),
                            ("foreign_rx_share", self.foreign_rx_share)):  # fmt: skip
            if value is not None:
                out[name] = round(value, 4)
        if self.seconds > 0:
            out["dev_tx_mbit"] = round(self.dev_tx_bytes * 8 / self.seconds / 1e6, 1)
            out["job_tx_mbit"] = round(self.job_tx_bytes * 8 / self.seconds / 1e6, 1)
        return out


class ContentionTracker:
    """Rolling per-device and per-host byte counts (see the module docstring)."""

    def __init__(self, window_s: float = 2.0, flow_ttl_s: float = 30.0) -> None:
        self.window_s = window_s
        self.flow_ttl_s = flow_ttl_s
        self.now = 0.0
        self._pid_host: dict[int, str] = {}
        self._dev: dict[str, deque[tuple[float, float, int, int]]] = {}  # ifname -> (t, dt, tx, rx)
        self._job: dict[str, deque[tuple[float, float, int, int]]] = {}  # host -> (t, dt, tx, rx)
        self._flows: dict[str, dict[FlowKey, float]] = {}  # host -> flow -> last seen

    # ------------------------------------------------------------ feeding

    def observe(self, rec: Record) -> None:
        """File one record (other kinds and malformed ones are ignored)."""
        try:
            kind = rec.get("kind")
            if kind == "netdev":
                self._add(self._dev, str(rec["dev"]), rec)
            elif kind == "flow":
                host = self._pid_host.get(rec["pid"])
                if host is not None:
                    self._add(self._job, host, rec)
                    if rec.get("tx_bytes") or rec.get("rx_bytes"):
                        self._flows.setdefault(host, {})[(rec["src"], rec["dst"])] = rec["t"]
            elif kind == "rank":
                self._pid_host[int(rec["pid"])] = str(rec["host"])
            elif kind == "conn" and rec.get("what") in ("close", "reset"):
                host = self._pid_host.get(rec.get("pid"))  # type: ignore[arg-type]
                if host is not None:
                    self._flows.get(host, {}).pop((rec["src"], rec["dst"]), None)
        except (KeyError, TypeError, ValueError):
            return

    def _add(self, table: dict[str, deque[Any]], key: str, rec: Record) -> None:
        t = float(rec["t"])
        self.now = max(self.now, t)
        q = table.setdefault(key, deque())
        q.append((t, float(rec.get("dt") or 0.0), int(rec["tx_bytes"]), int(rec["rx_bytes"])))
        horizon = self.now - 4 * self.window_s  # keep a little more than one window
        while q and q[0][0] < horizon:
            q.popleft()

    # ------------------------------------------------------------ questions

    def _sum(
        self, q: deque[tuple[float, float, int, int]] | None, since: float
    ) -> tuple[float, int, int]:
        dt = tx = rx = 0
        for t, d, a, b in q or ():
            if t > since:
                dt += d  # type: ignore[assignment]
                tx += a
                rx += b
        return dt, tx, rx

    def contention(self, host: str, ifname: str) -> Contention:
        """The host's device over the last window ending at the newest record."""
        since = self.now - self.window_s
        seconds, dev_tx, dev_rx = self._sum(self._dev.get(ifname), since)
        _, job_tx, job_rx = self._sum(self._job.get(host), since)
        return Contention(seconds, dev_tx, dev_rx, job_tx, job_rx)

    def flows(self, host: str) -> list[FlowKey]:
        """The job's flows on ``host`` seen within ``flow_ttl_s`` and not closed."""
        live = self._flows.get(host, {})
        for key in [k for k, t in live.items() if t < self.now - self.flow_ttl_s]:
            del live[key]
        return sorted(live)

    def hosts_of_job(self) -> set[str]:
        return set(self._pid_host.values())
