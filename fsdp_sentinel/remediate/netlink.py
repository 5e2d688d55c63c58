"""The netlink side: read what a device has, run a plan's operations, read class counters.

Everything goes through pyroute2 (``IPRoute(netns=...)`` for a device in a
named namespace), one handle per call, never creating a namespace. A failed
call raises :class:`TcError` carrying the errno's name, the device and the
operation, which the remediator turns into a ``failed`` action.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fsdp_sentinel.remediate.config import DeviceRef
from fsdp_sentinel.remediate.plan import (
    TC_H_ROOT,
    Found,
    Op,
    TbfParams,
    handle,
)

#: errnos that mean "already gone" when removing.
GONE = (errno.ENOENT, errno.ENODEV, errno.EINVAL)


class TcError(Exception):
    """A netlink call failed: ``errno_name`` (e.g. ``EPERM``), on ``dev``, doing ``what``."""

    def __init__(self, code: int, dev: str, what: str) -> None:
        self.code = code
        self.errno_name = errno.errorcode.get(code, str(code))
        self.dev = dev
        self.what = what
        super().__init__(f"{what} on {dev}: {self.errno_name}")


@contextmanager
def opened(dev: DeviceRef) -> Iterator[Any]:
    from pyroute2 import IPRoute

    ipr = IPRoute(netns=dev.netns, flags=0) if dev.netns else IPRoute()
    try:
        yield ipr
    finally:
        ipr.close()


def _code(e: Exception) -> int:
    return int(getattr(e, "code", 0) or getattr(e, "errno", 0) or errno.EIO)


def index_of(ipr: Any, dev: DeviceRef) -> int:
    found = ipr.link_lookup(ifname=dev.ifname)
    if not found:
        raise TcError(errno.ENODEV, dev.key, "look up the device")
    return int(found[0])


def inspect(ipr: Any, idx: int, major: int) -> Found:
    """What the device has now (see :class:`~fsdp_sentinel.remediate.plan.Found`)."""
    root: Any = None
    children: dict[int, Any] = {}  # parent -> qdisc
    for msg in ipr.get_qdiscs(index=idx):
        kind = msg.get_attr("TCA_KIND")
        if kind in ("clsact", "ingress"):
            continue  # hooks of others' programs: coexist, never touched
        if msg["parent"] == TC_H_ROOT:
            root = msg
        else:
            children[msg["parent"]] = msg
    if root is None:
        return Found(None)
    kind = root.get_attr("TCA_KIND")
    rh = int(root["handle"])
    ours = rh == handle(major) and kind == "htb"
    if kind != "tbf":
        return Found(kind, rh, ours=ours)
    parms = root.get_attr("TCA_OPTIONS").get_attr("TCA_TBF_PARMS")
    tbf = TbfParams(rh, int(parms["rate"]), int(parms["buffer"]), int(parms["limit"]),
                    int(parms["mtu"]), int(parms["peak"]))  # fmt: skip
    child = children.get(handle(rh >> 16, 1))
    if child is None:
        return Found("tbf", rh, tbf)
    ch = int(child["handle"])
    return Found("tbf", rh, tbf, (child.get_attr("TCA_KIND"), ch), ours=ch == handle(major))


def link_rate_bits(found: Found, dev: DeviceRef, sys_root: str = "/sys") -> float | None:
    """The link's rate: the shaper's when one is in place, else the device's speed (sysfs)."""
    if found.tbf is not None:
        return float(found.tbf.rate * 8)
    if dev.netns is None:
        try:
            speed = int(Path(sys_root, "class/net", dev.ifname, "speed").read_text())
        except (OSError, ValueError):
            return None
        if speed > 0:
            return speed * 1e6
    return None


def _burst_for(rate: int, buffer: int) -> int:
    """A burst (bytes) that pyroute2 turns back into exactly ``buffer`` ticks at ``rate``."""
    from pyroute2.netlink.rtnl.tcmsg.common import calc_xmittime

    lo, hi = 1, 1 << 31
    while lo < hi:
        mid = (lo + hi) // 2
        if calc_xmittime(rate, mid) < buffer:
            lo = mid + 1
        else:
            hi = mid
    return lo


def run_op(ipr: Any, idx: int, op: Op, dev: str, fd: int | None = None) -> None:
    """One operation; a netlink error becomes :class:`TcError`."""
    kw = op.kwargs()
    if op.command == "change" and op.kind == "tbf":
        kw = {"rate": kw["rate"], "burst": _burst_for(kw["rate"], kw["buffer"]),
              "limit": kw["limit"], "mtu": kw["mtu"]}  # fmt: skip
    if "fd" in kw:
        kw["fd"] = fd
    if op.parent is not None:
        kw["parent"] = op.parent
    try:
        ipr.tc(op.command, op.kind, idx, op.handle, **kw)
    except Exception as e:
        if op.command == "del" and _code(e) in GONE:
            return  # already gone (a crash mid-undo, or someone removed it)
        raise TcError(_code(e), dev, op.tc(dev)) from e


def class_bytes(ipr: Any, idx: int, major: int) -> dict[int, int]:
    """Bytes sent per class of our tree (minor -> bytes), from the kernel's own counters."""
    out: dict[int, int] = {}
    for msg in ipr.get_classes(index=idx):
        h = int(msg["handle"])
        if h >> 16 != major:
            continue
        stats = msg.get_attr("TCA_STATS2")
        basic = stats.get_attr("TCA_STATS_BASIC") if stats is not None else None
        if basic is not None:
            out[h & 0xFFFF] = int(basic["bytes"])
    return out
