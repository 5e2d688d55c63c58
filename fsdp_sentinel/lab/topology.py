"""The lab: N hosts as network namespaces on one bridge, each with a shaped link and a cgroup.

``Lab(LabConfig(...))`` builds everything in its constructor and removes it
in ``close()`` (also on ``with``-exit, on an exception while building, and
best-effort at interpreter exit). The bridge lives in its own switch
namespace, so the root namespace gets nothing but the ``/run/netns`` entries
and the cpu cgroups. Faults (``faults.py``) change the lab through
``inject``/``clear``, which return the trace-v1 ``fault`` records.

Topology and qdisc trees: docs/lab.md.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_sentinel.lab import cleanup, netlink, registry
from fsdp_sentinel.lab.config import (
    LabConfig,
    LabError,
    LabHost,
    bridge_name,
    plan_hosts,
    plan_storage,
    switch_netns,
    tbf_sizes,
)

if TYPE_CHECKING:
    from fsdp_sentinel.lab.faults import Fault

log = logging.getLogger(__name__)

#: Environment variable a rank reads for its host name (fsdp_sentinel.hostinfo):
#: lab hosts share the machine's UTS name, so the lab names them explicitly.
HOST_ENV = "FSDP_SENTINEL_HOST"

#: (network namespace, interface) of one end of a lab link.
LinkEnd = tuple[str, str]


@dataclass
class _Active:
    """A fault in force: its onset record and whatever ``undo`` needs."""

    record: dict[str, Any]
    state: Any


class Lab:
    """A built lab. ``hosts[i]`` is host ``i`` (rank ``i`` by convention); ``storage`` is the
    extra host at the far end of noisy-neighbour traffic."""

    def __init__(
        self,
        config: LabConfig | None = None,
        *,
        ipr_factory: netlink.IPRouteFactory = netlink.open_or_create,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config or LabConfig()
        self.hosts: list[LabHost] = plan_hosts(self.config)
        self.storage: LabHost = plan_storage(self.config)
        self.switch_netns = switch_netns(self.config.name)
        self.bridge = bridge_name(self.config.name)
        self._ipr_factory = ipr_factory
        self._clock = clock
        self._procs: list[subprocess.Popen[Any]] = []
        self._tbf: dict[LinkEnd, tuple[float, int]] = {}  # end -> (rate_mbit, burst)
        self._tbf_limit: dict[LinkEnd, int] = {}  # end -> the tbf's queue limit, bytes
        # Keyed by the fault object itself (faults hash by identity), which also
        # keeps it alive while in force.
        self._active: dict[Fault, _Active] = {}
        self._closed = False
        # A forked child (pyroute2 forks for every namespace socket) inherits this
        # object, its atexit hook and any exception path: only the process that
        # built the lab may tear it down.
        self._owner_pid = os.getpid()
        self._build()

    # ---- life cycle -------------------------------------------------------
    def _build(self) -> None:
        name = self.config.name
        match = cleanup.lab_matcher(name)
        if cleanup.netns_names(match) or cleanup.cgroup_dirs(match, self.config.cgroup_root):
            if not self.config.replace_existing:
                raise LabError(
                    f"lab {name} exists; remove it with: fsdp-sentinel lab down --name {name}"
                )
            log.warning("removing leftovers of an earlier lab %s", name)
            cleanup.teardown(name, cgroup_root=self.config.cgroup_root, root_links=False)
        registry.record(name, self.config.state_dir)  # before anything is made
        atexit.register(self.close)
        try:
            self._build_network()
            self._build_cgroups()
        except BaseException:
            self.close()
            raise

    def _build_network(self) -> None:
        from pyroute2 import netns

        sw = self.switch_netns
        every = [*self.hosts, self.storage]
        for ns in [sw, *(h.netns for h in every)]:
            netns.create(ns)
            # IPv4 only: no router solicitations or MLD in the counters, and
            # gloo cannot pick an IPv6 link-local address off the link.
            subprocess.run(
                ["ip", "netns", "exec", ns, "sysctl", "-qw",
                 "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
                check=True,
            )  # fmt: skip
        with netlink.handle(self._ipr_factory, sw) as ipr:
            ipr.link("add", ifname=self.bridge, kind="bridge")
            netlink.link_up(ipr, "lo")
            netlink.link_up(ipr, self.bridge)
            for h in every:
                # Both ends are born in their namespaces: nothing passes the root one.
                netlink.add_veth(ipr, h.switch_ifname, h.ifname, f"{cleanup.RUN_NETNS}/{h.netns}")
                netlink.link_up(ipr, h.switch_ifname, master=self.bridge)
        for h in every:
            with netlink.handle(self._ipr_factory, h.netns) as ipr:
                idx = netlink.index_of(ipr, h.ifname)
                ipr.addr("add", index=idx, address=h.addr, prefixlen=h.prefixlen)
                netlink.link_up(ipr, h.ifname)
                netlink.link_up(ipr, "lo")
        if self.config.rate_mbit is not None:
            for h in self.hosts:
                for end in self.link_ends(h, "both"):
                    self.set_rate(end, self.config.rate_mbit)

    def _build_cgroups(self) -> None:
        for h in self.hosts:
            assert h.cgroup is not None
            os.mkdir(h.cgroup)

    def close(self) -> None:
        """Remove every process, namespace and cgroup of this lab. Safe to call twice."""
        if self._closed or os.getpid() != self._owner_pid:
            return
        self._closed = True
        atexit.unregister(self.close)
        for active in self._active.values():
            closer = getattr(active.state, "close", None)
            if closer is not None:
                closer()
        self._active.clear()
        removed = cleanup.teardown(
            self.config.name, cgroup_root=self.config.cgroup_root, root_links=False
        )
        registry.forget(self.config.name, self.config.state_dir)
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("process %d outlived the lab", p.pid)
        log.debug("lab %s removed: %s", self.config.name, removed)

    def detach(self) -> None:
        """Leave the lab up for good (``fsdp-sentinel lab down`` removes it later)."""
        self._closed = True
        atexit.unregister(self.close)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- lookup -------------------------------------------------------------
    def host(self, ref: int | str | LabHost) -> LabHost:
        """A host by index, name or itself (the storage host by its name)."""
        if isinstance(ref, LabHost):
            return ref
        if isinstance(ref, int):
            if not 0 <= ref < len(self.hosts):
                raise LabError(f"no host {ref}: lab {self.config.name} has {len(self.hosts)}")
            return self.hosts[ref]
        for h in [*self.hosts, self.storage]:
            if ref in (h.name, h.netns):
                return h
        raise LabError(f"no host named {ref!r} in lab {self.config.name}")

    def link_ends(self, ref: int | str | LabHost, direction: str) -> list[LinkEnd]:
        """Where to shape a host's traffic: ``out`` = its own egress, ``in`` = the switch
        port towards it, ``both``."""
        h = self.host(ref)
        ends = {"out": [(h.netns, h.ifname)], "in": [(self.switch_netns, h.switch_ifname)]}
        ends["both"] = ends["out"] + ends["in"]
        if direction not in ends:
            raise LabError(f"direction must be out, in or both, not {direction!r}")
        return ends[direction]

    # ---- link shaping -----------------------------------------------------
    def set_rate(self, end: LinkEnd, rate_mbit: float) -> None:
        """Shape one link end to ``rate_mbit``, in place, never shrinking its burst."""
        netns, ifname = end
        burst, limit = tbf_sizes(rate_mbit, self.config.burst_ms, self.config.latency_ms)
        old = self._tbf.get(end)
        if old is not None and old[1] > burst:
            limit += old[1] - burst
            burst = old[1]
        with netlink.handle(self._ipr_factory, netns) as ipr:
            netlink.set_tbf(ipr, ifname, rate_mbit, burst, limit)
        self._tbf[end] = (rate_mbit, burst)
        self._tbf_limit[end] = limit

    def restore_tbf_queue(self, end: LinkEnd) -> None:
        """Give a shaped end's tbf its own inner queue back (a bfifo of the tbf's limit)
        in place of a child qdisc a fault hung under it. Deleting the child is
        not the same: the kernel then grafts ``noop``, which drops every packet."""
        netns, ifname = end
        limit = self._tbf_limit[end]
        subprocess.run(
            ["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", ifname,
             "parent", "1:1", "bfifo", "limit", str(limit)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip

    def rate(self, end: LinkEnd) -> float | None:
        got = self._tbf.get(end)
        return got[0] if got else None

    def reset_rate(self, end: LinkEnd) -> None:
        """Back to the configured rate (or unshaped, for an unshaped lab)."""
        base = self.config.rate_mbit
        if base is not None:
            self.set_rate(end, base)
            return
        netns, ifname = end
        with netlink.handle(self._ipr_factory, netns) as ipr:
            ipr.tc("del", "tbf", netlink.index_of(ipr, ifname), handle="1:")
        self._tbf.pop(end, None)

    def netlink_handle(self, netns: str) -> Any:
        """A context-managed pyroute2 handle inside one of this lab's namespaces."""
        return netlink.handle(self._ipr_factory, netns)

    # ---- processes ----------------------------------------------------------
    def popen(
        self,
        host: int | str | LabHost,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        cgroup: bool = True,
        **kw: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the host's namespace (via ``ip netns exec``) and cgroup.

        ``env`` is added to this process's environment (plus ``FSDP_SENTINEL_HOST``
        = the host's name). ``cgroup=False`` keeps the process out of the host's
        cgroup (traffic that is not the job's). The process gets its own session
        unless ``start_new_session`` says otherwise, so a terminal's Ctrl-C
        reaches only the caller, whose cleanup then removes it.
        """
        h = self.host(host)
        if self._closed:
            raise LabError(f"lab {self.config.name} is closed")
        cmd = ["ip", "netns", "exec", h.netns, *argv]
        if cgroup and h.cgroup is not None:
            # The shell joins the cgroup, then execs: the final program keeps its pid.
            procs = f"{h.cgroup}/cgroup.procs"
            cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *cmd]
        full_env = {**os.environ, HOST_ENV: h.name, **(env or {})}
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(cmd, env=full_env, **kw)
        self._procs.append(p)
        return p

    def python(
        self, host: int | str | LabHost, args: Sequence[str], **kw: Any
    ) -> subprocess.Popen[Any]:
        """``popen`` of this interpreter (the venv's python, which has the package)."""
        return self.popen(host, [sys.executable, *args], **kw)

    def cgroup_pids(self, host: int | str | LabHost) -> list[int]:
        h = self.host(host)
        return cleanup.cgroup_pids(h.cgroup) if h.cgroup else []

    def write_cgroup(self, host: int | str | LabHost, key: str, value: str) -> None:
        h = self.host(host)
        if h.cgroup is None:
            raise LabError(f"host {h.name} has no cgroup")
        Path(h.cgroup, key).write_text(value)

    def read_cgroup(self, host: int | str | LabHost, key: str) -> str:
        h = self.host(host)
        if h.cgroup is None:
            raise LabError(f"host {h.name} has no cgroup")
        return Path(h.cgroup, key).read_text().strip()

    # ---- faults ---------------------------------------------------------------
    def inject(self, fault: Fault, *, step: int | None = None) -> dict[str, Any]:
        """Apply ``fault`` now; returns its trace-v1 ``fault`` record (onset)."""
        if fault in self._active:
            raise LabError(f"fault {fault!r} is already in force")
        h = self.host(fault.host)
        params, state = fault.apply(self)
        rec: dict[str, Any] = {
            "kind": "fault",
            "t": self._clock(),
            "host": h.name,
            "rank": h.index,
            "what": fault.what,
            "params": params,
        }
        if step is not None:
            rec["step"] = step
        self._active[fault] = _Active(rec, state)
        return dict(rec)

    def clear(self, fault: Fault, *, step: int | None = None) -> dict[str, Any]:
        """Undo ``fault``; returns the onset record with ``end`` (and ``end_step``) added."""
        active = self._active.pop(fault, None)
        if active is None:
            raise LabError(f"fault {fault!r} is not in force")
        fault.undo(self, active.state)
        rec = dict(active.record)
        rec["end"] = self._clock()
        if step is not None:
            rec["end_step"] = step
        return rec

    def active_faults(self) -> list[dict[str, Any]]:
        return [dict(a.record) for a in self._active.values()]
