"""``demo --daemons per-host``: one node daemon per lab host, meeting in the job's own store.

Each lab host gets its own ``fsdp-sentinel run --cluster --netns <host's
namespace>``: its own ingest socket (the host's ranks send there, through
``FSDP_SENTINEL_SOCKET``), its own trace, probes that count only the pids of
its own ranks and read only its own namespace's devices, remediation of only
its own link. The daemons find each other and elect a leader through the
TCPStore torchrun serves at the job's ``MASTER_ADDR:MASTER_PORT`` (the
``store`` field of the ranks' ``rank`` records), reached from inside the
host's namespace, over the host's own lab link: nothing else joins them.
Every node writes the leader's verdicts into its own trace.

The daemons themselves stay in the root namespace, like the single daemon,
so their ``/metrics`` ports answer the demo on 127.0.0.1.

At the end :func:`merge_node_traces` makes the one ``trace.jsonl.zst`` the
rest of the demo reads (truth, report, summary): every node's records in time
order, each verdict the leader published once (every node heard it), each
node-view verdict as its node said it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fsdp_sentinel.demo.daemon_proc import DaemonError, DaemonProcess
from fsdp_sentinel.snapshot import Snapshot


class NodeDaemons:
    """Context-managed daemons, one per lab host (host order); the demo's
    ``DaemonProcess`` interface over all of them (``snapshot()`` merges)."""

    def __init__(
        self,
        lab: Any,
        out: Path,
        *,
        remediate: str = "off",
        interval: float = 0.5,
        probes: bool = True,
    ) -> None:
        from fsdp_sentinel.lab.topology import HOST_ENV

        self.hosts = [h.name for h in lab.hosts]
        self.daemons: dict[str, DaemonProcess] = {}
        for h in lab.hosts:
            where = out / "nodes" / h.name
            own_dev = ["--remediate-dev", f"{h.name}={h.netns}/{h.ifname}"]
            self.daemons[h.name] = DaemonProcess(
                socket_path=where / "ingest.sock",
                trace_out=where / "trace.jsonl.zst",
                log_path=where / "daemon.log",
                remediate=remediate,
                interval=interval,
                probes=probes,
                extra=["--cluster", "--netns", h.netns, *(own_dev if remediate != "off" else [])],
                # The store client looks its own address up (torch logs the
                # name); a lab namespace has no DNS server, and glibc's default
                # 5 s timeouts then hold the first connect ~8 s: one try, 1 s.
                env={HOST_ENV: h.name, "RES_OPTIONS": "timeout:1 attempts:1"},
            )

    def socket(self, host: str) -> Path:
        return self.daemons[host].socket_path

    def traces(self) -> list[Path]:
        return [d.trace_out for d in self.daemons.values()]

    @property
    def log_path(self) -> Path:
        """The log of the first daemon that died, else host 0's."""
        for d in self.daemons.values():
            if not d.alive():
                return d.log_path
        return next(iter(self.daemons.values())).log_path

    def __enter__(self) -> NodeDaemons:
        with contextlib.ExitStack() as stack:
            for d in self.daemons.values():
                stack.enter_context(d)  # all start at once: the probes compile side by side
            stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 180.0) -> Snapshot:
        for d in self.daemons.values():
            d.wait_ready(timeout)
        snap = self.snapshot()
        if snap is None:
            raise DaemonError("the node daemons stopped answering")
        return snap

    def alive(self) -> bool:
        return all(d.alive() for d in self.daemons.values())

    def snapshot(self) -> Snapshot | None:
        """Every node's snapshot as one: its ranks and managed devices side by side.
        A rank's state is its own node's view (the demo's summary reads the
        leader's verdicts from the traces)."""
        snaps = [s for s in (d.snapshot() for d in self.daemons.values()) if s is not None]
        if not snaps:
            return None
        return dataclasses.replace(
            snaps[0],
            t=max(s.t for s in snaps),
            ranks=tuple(sorted((r for s in snaps for r in s.ranks), key=lambda r: r.rank)),
            remediation=tuple(v for s in snaps for v in s.remediation),
        )

    def stop(self) -> int | None:
        """Stop every daemon (SIGINT, flushed); the first non-zero status, else 0."""
        codes = [d.stop() for d in self.daemons.values()]
        return next((c for c in codes if c not in (0, None)), codes[0] if codes else None)


def _verdict_key(rec: dict[str, Any]) -> tuple[Any, ...]:
    """Every node writes the leader's verdict as published: its time, step and rank name it."""
    ev = rec.get("evidence")
    view = ev.get("view") if isinstance(ev, dict) else None
    return (rec.get("job"), rec.get("t"), rec.get("step"), rec.get("rank"), rec.get("state"),
            rec.get("cause"), view)  # fmt: skip


def merged_records(traces: list[Path]) -> Iterator[dict[str, Any]]:
    """The node traces as one stream (time order), each leader verdict once."""
    from fsdp_sentinel.trace import TraceReader, merge_traces

    seen: set[tuple[Any, ...]] = set()
    readers = [TraceReader(p, strict=False) for p in traces if p.exists()]
    for rec in merge_traces(readers):
        if rec.get("kind") == "verdict":
            key = _verdict_key(rec)
            if key in seen:
                continue
            seen.add(key)
        yield rec


def merge_node_traces(traces: list[Path], out: Path) -> int:
    """Write :func:`merged_records` to ``out``; the number of records written."""
    from fsdp_sentinel.trace import TraceWriter

    out.unlink(missing_ok=True)
    writer = TraceWriter(out)
    n = 0
    try:
        for rec in merged_records(traces):
            writer.write(rec)
            n += 1
    finally:
        writer.close()
    return n
