"""The tc operations that build the priority tree on a device, and those that undo it (pure).

From what is on the device now (:class:`Found`) and the link's rate,
:func:`plan` returns a :class:`Plan`: the operations to make, in order, and
the operations that put the device back exactly as found. Nothing here talks
to the kernel; the netlink applier runs the operations, ``dry-run`` prints
them (``Op.tc``, the equivalent ``tc`` command line).

The tree (``M`` is ``RemediateConfig.htb_major``)::

    [operator's tbf T: root]                  when a shaper is in place
      └─ htb M: (parent T:1, else root)  default M:20
          └─ class M:1   rate R  ceil R
              ├─ class M:10  job's flows   rate share*R  ceil R  prio 0
              └─ class M:20  everything    rate rest*R   ceil R  prio 1
          filter: bpf direct-action on M:, sets M:10 for flows in its map

The filter is given ``classid M:`` (bound to the qdisc): measured on this
kernel, without it HTB ignored the class a direct-action program chose and
every packet went to the default class.

Under a shaper the queue forms in HTB (the TBF only dequeues from it), which
is where class priority works. Undo:

- tree at the root, replacing the kernel's default qdisc (handle ``0:``):
  delete ``M:``; the kernel puts its default back;
- tree under a TBF that had its default child (a bfifo the TBF made
  itself): delete ``M:`` (the TBF is then left with no child at all), then
  ``change`` the TBF with the very parameters it had, which makes the TBF
  create its default child again. The burst is the same as before, so this
  is not the "shrunk burst" change that can wedge a TBF (machine-notes).

What it refuses (and says why): a root qdisc of someone else that is not a
TBF, a TBF whose child is someone's own qdisc, a TBF with a peak rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

JOB_MINOR = 0x10
OTHER_MINOR = 0x20
ROOT_MINOR = 0x1
FILTER_PRIO = 1
FILTER_HANDLE = 1
TC_H_ROOT = 0xFFFFFFFF


def handle(major: int, minor: int = 0) -> int:
    return ((major & 0xFFFF) << 16) | (minor & 0xFFFF)


def handle_str(h: int) -> str:
    if h == TC_H_ROOT:
        return "root"
    return f"{h >> 16:x}:{h & 0xFFFF:x}" if h & 0xFFFF else f"{h >> 16:x}:"


@dataclass(frozen=True)
class TbfParams:
    """An operator's TBF exactly as the kernel reports it (``TCA_TBF_PARMS``)."""

    handle: int
    rate: int  # bytes/s
    buffer: int  # ticks
    limit: int  # bytes
    mtu: int
    peak: int = 0

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Found:
    """What the device has now: its root qdisc and, under a TBF, the TBF's child."""

    root_kind: str | None  # None: no root qdisc reported
    root_handle: int = 0
    tbf: TbfParams | None = None
    #: The TBF's visible child (kind, handle): someone's own qdisc; None: its default.
    tbf_child: tuple[str, int] | None = None
    #: Whether our own tree is there already (a re-run, or a crash: converge).
    ours: bool = False


@dataclass(frozen=True)
class Op:
    """One tc operation as pyroute2 ``IPRoute.tc(command, kind, index, handle, **params)``."""

    command: str  # replace, del, change, replace-class, replace-filter
    kind: str
    handle: int
    parent: int | None = None
    params: tuple[tuple[str, Any], ...] = ()

    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    def tc(self, dev: str) -> str:
        """The equivalent ``tc`` command line, for people (dry-run) and records."""
        obj, verb = {"replace": ("qdisc", "replace"), "del": ("qdisc", "del"),
                     "change": ("qdisc", "change"), "replace-class": ("class", "replace"),
                     "replace-filter": ("filter", "replace")}[self.command]  # fmt: skip
        parent = "root" if self.parent in (None, TC_H_ROOT) else f"parent {handle_str(self.parent)}"
        if obj == "filter":
            where = f"{parent} prio {FILTER_PRIO} handle {self.handle}"
        else:
            where = (
                f"{parent} {'classid' if obj == 'class' else 'handle'} {handle_str(self.handle)}"
            )
        opts = " ".join(f"{k} {v}" for k, v in self.params if k != "fd")
        return " ".join(x for x in ("tc", obj, verb, "dev", dev, where, self.kind, opts) if x)


@dataclass(frozen=True)
class Plan:
    ops: tuple[Op, ...]
    undo: tuple[Op, ...]
    #: Where the tree hangs: "root" or "under tbf T:".
    where: str


class Refused(Exception):
    """The device holds something the remediator must not replace; the message says what."""


def _kbit(bits_per_s: float) -> str:
    return f"{max(8, round(bits_per_s / 1000))}kbit"


def plan(found: Found, rate_bits: float, *, major: int, job_share: float, prog_name: str) -> Plan:
    """The operations for the tree on a device (module docstring); raises :class:`Refused`."""
    if not 0.0 < job_share < 1.0:
        raise ValueError(f"job_share must be within (0, 1), not {job_share}")
    if rate_bits <= 0:
        raise ValueError("the link rate must be > 0")
    top = handle(major)
    if found.tbf is not None:
        tbf = found.tbf
        if tbf.peak:
            raise Refused(f"the root tbf {handle_str(tbf.handle)} has a peak rate: not managed")
        if found.tbf_child is not None and not (found.ours and found.tbf_child[1] == top):
            kind, h = found.tbf_child
            raise Refused(f"the root tbf's child is someone's {kind} {handle_str(h)}")
        parent = handle(tbf.handle >> 16, 1)
        where = f"under tbf {handle_str(tbf.handle)}"
        undo: tuple[Op, ...] = (
            Op("del", "htb", top, parent),
            Op("change", "tbf", tbf.handle, TC_H_ROOT, (
                ("rate", tbf.rate), ("buffer", tbf.buffer), ("limit", tbf.limit),
                ("mtu", tbf.mtu))),
        )  # fmt: skip
    elif (
        found.root_kind is None
        or found.root_handle == 0
        or (found.ours and found.root_handle == top)
    ):
        parent = TC_H_ROOT
        where = "root"
        undo = (Op("del", "htb", top, TC_H_ROOT),)
    else:
        raise Refused(
            f"the root qdisc is someone's {found.root_kind} {handle_str(found.root_handle)}"
        )
    # Bursts hold a 64 KiB GSO packet and ~5 ms at rate: at 1 Gbit/s HTB's
    # default (rate/HZ + mtu) cannot keep the link full.
    burst = int(max(rate_bits / 8 * 0.005, 65536 + 1514))
    cls = {"burst": burst, "cburst": burst, "quantum": 65536 + 1514}
    rate, job, rest = rate_bits, rate_bits * job_share, rate_bits * (1.0 - job_share)

    def klass(minor: int, parent_minor: int, r: float, prio: int) -> Op:
        p = (("rate", _kbit(r)), ("ceil", _kbit(rate)), ("prio", prio), *cls.items())
        return Op("replace-class", "htb", handle(major, minor), handle(major, parent_minor), p)

    ops = (
        Op("replace", "htb", top, parent, (("default", OTHER_MINOR),)),
        klass(ROOT_MINOR, 0, rate, 0),
        klass(JOB_MINOR, ROOT_MINOR, job, 0),
        klass(OTHER_MINOR, ROOT_MINOR, rest, 1),
        Op("replace-filter", "bpf", FILTER_HANDLE, top, (
            ("fd", None), ("name", prog_name), ("prio", FILTER_PRIO),
            ("classid", top), ("direct_action", True))),
    )  # fmt: skip
    return Plan(ops, undo, where)
