"""Find and remove what a lab made: its processes, namespaces, leftover links and cgroups.

Used by ``Lab.close()`` (one lab, by name) and by ``fsdp-sentinel lab down``
(every lab, or one by name), which is how the leftovers of a crashed run go
away. Everything is found from the system itself (``/run/netns``, ``/proc``,
the cpu cgroup tree), not from a state file, so a run killed with SIGKILL is
cleaned up too. The roots are injectable for tests.

Order matters: processes first (a namespace lives on while a process is in
it, and a cgroup cannot be removed while it has members), then namespaces
(their veths and bridge go with them), then cgroups. Only the errors that
mean "already gone" are tolerated.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_sentinel.lab.config import CGROUP_CPU_ROOT, PREFIX

RUN_NETNS = "/run/netns"


def lab_matcher(name: str | None) -> Callable[[str], bool]:
    """Predicate for names that belong to lab ``name`` (any lab when ``None``).

    One lab's names are ``<name>-h<i>``, ``-sw``, ``-st``, ``-br`` and those
    followed by ``e``/``s``: matching them exactly keeps lab ``fss-a`` from
    touching lab ``fss-a-b``.
    """
    if name is None:
        return lambda s: s.startswith(PREFIX)
    pat = re.compile(rf"^{re.escape(name)}-(h\d+|sw|st|br)[es]?$")
    return lambda s: bool(pat.match(s))


def netns_names(match: Callable[[str], bool], run_netns: str = RUN_NETNS) -> list[str]:
    try:
        names = os.listdir(run_netns)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if match(n))


def _ns_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in_netns(netns: str, run_netns: str = RUN_NETNS, proc: str = "/proc") -> list[int]:
    """Processes whose network namespace is ``netns`` (what ``ip netns pids`` does)."""
    want = _ns_id(f"{run_netns}/{netns}")
    if want is None:
        return []
    out = []
    for ent in os.listdir(proc):
        if ent.isdigit() and _ns_id(f"{proc}/{ent}/ns/net") == want:
            out.append(int(ent))
    return sorted(out)


def cgroup_dirs(match: Callable[[str], bool], cgroup_root: str = CGROUP_CPU_ROOT) -> list[Path]:
    root = Path(cgroup_root)
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and match(p.name))
    except FileNotFoundError:
        return []


def cgroup_pids(cgroup: str | os.PathLike[str]) -> list[int]:
    try:
        text = Path(cgroup, "cgroup.procs").read_text()
    except FileNotFoundError:
        return []
    return sorted(int(x) for x in text.split())


def _alive(pid: int, proc: str = "/proc") -> bool:
    """Running (a zombie counts as gone: it holds no namespace and no CPU)."""
    try:
        stat = Path(proc, str(pid), "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_pids(pids: Iterable[int], grace_s: float = 2.0) -> list[int]:
    """SIGTERM, then SIGKILL whatever is left after ``grace_s``; returns the pids signalled."""
    me = os.getpid()
    todo = sorted({p for p in pids if p != me and p > 1})
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in todo:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(_alive(p) for p in todo):
            time.sleep(0.02)
        if not any(_alive(p) for p in todo):
            break
    return todo


def remove_netns(name: str, run_netns: str = RUN_NETNS) -> bool:
    """Unmount and unlink ``/run/netns/<name>`` (what ``ip netns del`` does)."""
    from pyroute2 import netns

    try:
        netns.remove(f"{run_netns}/{name}")
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.EINVAL):
            return False
        raise
    return True


def remove_cgroup(path: str | os.PathLike[str], timeout_s: float = 5.0) -> bool:
    """rmdir a cgroup, retrying while exiting members still hold it (EBUSY)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def remove_root_links(match: Callable[[str], bool]) -> list[str]:
    """Delete matching links left in the root namespace (the lab makes none; old runs might)."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    gone = []
    with IPRoute(groups=0) as ipr:
        for link in ipr.get_links():
            name = link.get_attr("IFLA_IFNAME")
            if name and match(name):
                try:
                    ipr.link("del", index=link["index"])
                    gone.append(name)
                except NetlinkError as e:
                    if e.code not in (errno.ENODEV, errno.ENOENT):
                        raise
    return gone


@dataclass
class Removed:
    """What a teardown removed (for ``lab down``'s summary and the tests)."""

    pids: list[int] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.pids or self.netns or self.links or self.cgroups)


def teardown(
    name: str | None,
    *,
    run_netns: str = RUN_NETNS,
    cgroup_root: str = CGROUP_CPU_ROOT,
    root_links: bool = True,
) -> Removed:
    """Remove lab ``name`` (every ``fss-`` lab when ``None``), whatever state it is in."""
    match = lab_matcher(name)
    out = Removed()
    spaces = netns_names(match, run_netns)
    groups = cgroup_dirs(match, cgroup_root)
    pids: set[int] = set()
    for ns in spaces:
        pids.update(pids_in_netns(ns, run_netns))
    for cg in groups:
        pids.update(cgroup_pids(cg))
    out.pids = kill_pids(pids)
    for ns in spaces:
        if remove_netns(ns, run_netns):
            out.netns.append(ns)
    if root_links:
        out.links = remove_root_links(match)
    for cg in groups:
        if remove_cgroup(cg):
            out.cgroups.append(cg.name)
    return out
