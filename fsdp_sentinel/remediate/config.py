"""What the remediator may touch and how: the managed devices and the tree's shape.

A remediator changes only the devices named here (``DeviceRef``); a verdict
for a host with no device here is explained ("not managed here") and left
alone. In cluster mode each node daemon lists only its own devices, so the
same verdict stream can be handed to every node.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Where the state file lives (restored from on the next start after a crash).
STATE_DIR = "/run/fsdp-sentinel"


@dataclass(frozen=True)
class DeviceRef:
    """One egress device the remediator may manage.

    ``host``: the host name verdicts carry for the ranks behind this device;
    ``ifname``: the device; ``netns``: the named network namespace it lives
    in (None: this process's own).
    """

    host: str
    ifname: str
    netns: str | None = None

    @property
    def key(self) -> str:
        """A stable name for files and labels: ``netns/ifname`` or ``ifname``."""
        return f"{self.netns}/{self.ifname}" if self.netns else self.ifname


def parse_device(spec: str, default_host: str) -> DeviceRef:
    """``[HOST=][NETNS/]IFNAME`` (the ``--remediate-dev`` syntax)."""
    host, sep, rest = spec.partition("=")
    if not sep:
        host, rest = default_host, spec
    netns, slash, ifname = rest.rpartition("/")
    if not ifname or not host or (slash and not netns) or "/" in netns:
        raise ValueError(f"not [HOST=][NETNS/]IFNAME: {spec!r}")
    return DeviceRef(host=host, ifname=ifname, netns=netns or None)


@dataclass(frozen=True)
class RemediateConfig:
    """The remediator's knobs (defaults measured in the lab: docs/remediation.md)."""

    #: Devices it may manage (nothing else is ever touched).
    devices: tuple[DeviceRef, ...] = ()
    #: The link's rate in Mbit/s when neither a shaper nor sysfs gives it.
    rate_mbit: float | None = None
    #: Share of the link rate guaranteed to the job's collective flows; the
    #: rest is guaranteed to everything else, and either borrows what the
    #: other leaves unused.
    job_share: float = 0.9
    #: Act only when at least this share of the device's egress bytes is not
    #: the job's (headers alone make ~5 % on a clean link).
    min_foreign_share: float = 0.25
    #: Seconds of records the contention figures are taken over.
    window_s: float = 2.0
    #: Undo after the rank has been clean (no open verdict, no foreign
    #: traffic worth prioritising against) for this many windows in a row.
    clean_windows: int = 3
    #: The HTB qdisc's major handle (must not collide with an operator's).
    htb_major: int = 0x5EB
    #: Folder of the state file.
    state_dir: str = STATE_DIR

    def device_for(self, host: str | None) -> DeviceRef | None:
        for d in self.devices:
            if d.host == host:
                return d
        return None
