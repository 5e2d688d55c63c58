"""Remediation in the kernel: give a straggler's collective flows priority on its egress.

On a ``network`` verdict for a host whose egress is shared with traffic that
is not the job's, an HTB tree goes on the host's device (beneath a shaper
already there), with one bcc ``SCHED_CLS`` direct-action classifier that
looks the job's flows up in a BPF map; it comes out again when the rank
stays clean, at exit, and (from a state file) at the next start after a
crash. Modules, one job each:

- ``config``: the devices it may manage and the tree's knobs;
- ``contention`` (pure): device bytes vs the job's flow bytes, per host;
- ``policy`` (pure): act or not, and why; the hysteresis;
- ``plan`` (pure): the tc operations and their exact undo;
- ``netlink``: reading the device and running operations (pyroute2);
- ``classifier`` + ``classify.bpf.c``: the program and its flow map;
- ``statefile``: what was changed, under ``/run/fsdp-sentinel/``;
- ``remediator``: the daemon's remediator (docs/remediation.md).
"""

from __future__ import annotations

from typing import Any

from fsdp_sentinel.remediate.config import DeviceRef, RemediateConfig, parse_device
from fsdp_sentinel.remediate.remediator import TcRemediator

__all__ = ["DeviceRef", "RemediateConfig", "TcRemediator", "build_remediator", "parse_device"]


def default_device(host: str) -> DeviceRef | None:
    """This host's default-route device in this namespace (None when there is none)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        for route in ipr.get_default_routes():
            oif = route.get_attr("RTA_OIF")
            if oif:
                name = ipr.get_links(oif)[0].get_attr("IFLA_IFNAME")
                return DeviceRef(host, str(name))
    return None


def build_remediator(
    mode: str,
    *,
    host: str,
    devices: list[str] | None = None,
    rate_mbit: float | None = None,
    **knobs: Any,
) -> TcRemediator:
    """The remediator for ``--remediate MODE``; ``devices`` are ``[HOST=][NETNS/]IFNAME``
    specs (none: this host's default-route device)."""
    refs = [parse_device(s, host) for s in devices or []]
    if not refs:
        found = default_device(host)
        refs = [found] if found is not None else []
    cfg = RemediateConfig(devices=tuple(refs), rate_mbit=rate_mbit, **knobs)
    return TcRemediator(mode, host, cfg)
