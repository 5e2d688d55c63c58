"""What labs exist right now, read from the system (for ``fsdp-sentinel lab status``).

Labs are found by their namespaces (``<lab>-h<i>``, ``-sw``, ``-st``), so this
also shows the leftovers of a crashed run. Per host: its link's address,
the qdiscs on both ends of its link (kind, rate, drops), its cgroup's CFS
quota and how many processes it holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from fsdp_sentinel.lab import cleanup, netlink
from fsdp_sentinel.lab.config import CGROUP_CPU_ROOT

_NS_RE = re.compile(r"^(?P<lab>.+)-(?P<role>h\d+|sw|st)$")


def lab_names(match: Callable[[str], bool], run_netns: str = cleanup.RUN_NETNS) -> list[str]:
    names = set()
    for ns in cleanup.netns_names(match, run_netns):
        m = _NS_RE.match(ns)
        if m:
            names.add(m["lab"])
    return sorted(names)


def _qdiscs(ipr: Any, ifname: str) -> list[dict[str, Any]]:
    idx = netlink.index_of(ipr, ifname)
    out = []
    for q in ipr.get_qdiscs(index=idx):
        kind = q.get_attr("TCA_KIND")
        item: dict[str, Any] = {"kind": kind}
        if kind == "tbf":
            item["rate_mbit"] = (
                q.get_attr("TCA_OPTIONS").get_attr("TCA_TBF_PARMS")["rate"] * 8 / 1e6
            )
        stats = q.get_attr("TCA_STATS2")
        if stats is not None:
            item["bytes"] = stats.get_attr("TCA_STATS_BASIC")["bytes"]
            item["drops"] = stats.get_attr("TCA_STATS_QUEUE")["drops"]
        out.append(item)
    return out


def _link(netns: str, ifname: str) -> dict[str, Any]:
    try:
        with netlink.handle(netlink.open_existing, netns) as ipr:
            addrs = [
                f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}"
                for a in ipr.get_addr(family=2, label=ifname)
            ]
            return {"addrs": addrs, "qdiscs": _qdiscs(ipr, ifname)}
    except OSError as e:  # NetlinkError is an OSError: a half-removed lab
        return {"error": str(e)}


def describe(name: str | None = None, cgroup_root: str = CGROUP_CPU_ROOT) -> list[dict[str, Any]]:
    """One dict per lab found (all ``fss-`` labs, or just ``name``)."""
    labs = []
    for lab in lab_names(cleanup.lab_matcher(name)):
        spaces = cleanup.netns_names(cleanup.lab_matcher(lab))
        hosts = []
        for ns in spaces:
            role = ns[len(lab) + 1 :]
            if role == "sw":
                continue
            host: dict[str, Any] = {"name": ns, "ifname": f"{ns}e"}
            host["host_end"] = _link(ns, f"{ns}e")
            host["switch_end"] = _link(f"{lab}-sw", f"{ns}s")
            host["pids"] = len(cleanup.pids_in_netns(ns))
            cg = f"{cgroup_root}/{ns}"
            try:
                with open(f"{cg}/cpu.cfs_quota_us") as f:
                    host["cfs_quota_us"] = int(f.read())
            except FileNotFoundError:
                host["cfs_quota_us"] = None
            hosts.append(host)
        labs.append({"lab": lab, "switch": f"{lab}-sw" in spaces, "hosts": hosts})
    return labs


def _qdisc_text(end: dict[str, Any]) -> str:
    if "error" in end:
        return "?"
    parts = []
    for q in end["qdiscs"]:
        if q["kind"] == "tbf":
            parts.append(f"tbf {q['rate_mbit']:g}M")
        elif q["kind"] == "clsact":
            parts.append(f"drop {q.get('drops', 0)}")  # the loss classifier
        elif q["kind"] not in ("noqueue",):
            parts.append(q["kind"])
    return ",".join(parts) or "-"


def format_table(labs: list[dict[str, Any]]) -> str:
    """Under 80 columns: one line per host."""
    if not labs:
        return "no labs"
    lines = []
    for lab in labs:
        lines.append(f"lab {lab['lab']}" + ("" if lab["switch"] else " (no switch: broken)"))
        lines.append(
            f"  {'host':<14} {'addr':<17} {'egress':<18} {'ingress':<12} {'quota':>6} pids"
        )
        for h in lab["hosts"]:
            addrs = h["host_end"].get("addrs") or ["?"]
            q = h["cfs_quota_us"]
            quota = "-" if q is None else ("none" if q < 0 else f"{q // 1000}ms")
            lines.append(
                f"  {h['name']:<14} {addrs[0]:<17} {_qdisc_text(h['host_end']):<18} "
                f"{_qdisc_text(h['switch_end']):<12} {quota:>6} {h['pids']}"
            )
    return "\n".join(lines)
