"""``fsdp-sentinel lab up|down|status``: build a lab by hand, remove leftovers, look at labs.

``up`` builds a lab and keeps it until Ctrl-C or SIGTERM (then removes it),
or with ``--detach`` leaves it for a later ``down``. ``down`` removes every
lab recorded as built on this machine (``lab.registry``), or the one named
with ``--name``, in whatever state a crashed run left it: processes in its
namespaces and cgroups, the namespaces, links, cgroups. Names that merely
start with ``fss-`` and were not made by a lab of ours are left alone.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from fsdp_sentinel.interrupts import unwinding_on_signals

HELP = "build, inspect or remove a network-namespace lab (hosts on a shaped bridge)"
EPILOG = """examples:
  fsdp-sentinel lab up --hosts 4 --rate-mbit 1000     # until Ctrl-C
  fsdp-sentinel lab up --name fss-x --detach          # leave it up
  fsdp-sentinel lab status
  fsdp-sentinel lab down                              # every lab built here
  fsdp-sentinel lab down --name fss-x
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lab_command", metavar="ACTION")
    sub.required = True
    up = sub.add_parser("up", help="build a lab (removed on Ctrl-C unless --detach)")
    up.add_argument("--name", default="fss", help="lab name, starts with fss (default fss)")
    up.add_argument("--hosts", type=int, default=4, help="number of hosts (default 4)")
    up.add_argument("--rate-mbit", type=float, default=1000.0,
                    help="each host's link rate both ways; 0 = unshaped (default 1000)")  # fmt: skip
    up.add_argument("--subnet", default="198.18.0.0/24", help="inside 198.18.0.0/15")
    up.add_argument("--detach", action="store_true", help="leave the lab up and exit")
    down = sub.add_parser("down", help="remove the labs built here (or one), with their processes")
    down.add_argument("--name", default=None,
                      help="only this lab (default: every lab recorded as built on this machine)")  # fmt: skip
    st = sub.add_parser("status", help="show the labs that exist now")
    st.add_argument("--name", default=None)
    st.add_argument("--json", action="store_true", help="JSON instead of a table")


def _up(args: argparse.Namespace) -> int:
    from fsdp_sentinel.lab import status
    from fsdp_sentinel.lab.config import LabConfig, LabError
    from fsdp_sentinel.lab.topology import Lab

    try:
        cfg = LabConfig(
            name=args.name,
            hosts=args.hosts,
            rate_mbit=args.rate_mbit or None,
            subnet=args.subnet,
        )
    except LabError as e:
        print(f"fsdp-sentinel lab up: {e}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM raise KeyboardInterrupt: the finally below removes the lab.
    with unwinding_on_signals():
        lab = Lab(cfg)
        try:
            print(status.format_table(status.describe(cfg.name)), flush=True)
            if args.detach:
                lab.detach()
                print(f"left up; remove with: fsdp-sentinel lab down --name {cfg.name}")
                return 0
            print("lab up; Ctrl-C removes it", flush=True)
            try:
                while True:
                    signal.pause()
            except KeyboardInterrupt:
                pass
            return 0
        finally:
            lab.close()


def _down(name: str | None) -> int:
    """Remove the labs this machine recorded building (or lab ``name``), nothing else."""
    from fsdp_sentinel.lab import cleanup, registry
    from fsdp_sentinel.lab.config import valid_name

    if name is not None and not valid_name(name):
        print(f"usage: fsdp-sentinel lab down [--name NAME]\nfsdp-sentinel lab down: error: "
              f"--name {name!r} is not a lab name (fss-[a-z0-9-]...)", file=sys.stderr)  # fmt: skip
        return 2
    names = [name] if name is not None else registry.recorded()
    total = cleanup.Removed()
    for lab in names:
        removed = cleanup.teardown(lab)
        registry.forget(lab)
        for part in ("pids", "netns", "links", "cgroups"):
            getattr(total, part).extend(getattr(removed, part))
    if total.empty():
        print("nothing to remove" + ("" if names else " (no lab recorded in "
              f"{registry.STATE_DIR}; name one with --name)"))  # fmt: skip
    else:
        print(f"removed {len(total.netns)} namespaces, {len(total.cgroups)} cgroups, "
              f"{len(total.links)} links, {len(total.pids)} processes")  # fmt: skip
    return 0


def main(args: argparse.Namespace) -> int:
    from fsdp_sentinel.lab import status

    if args.lab_command == "up":
        return _up(args)
    if args.lab_command == "down":
        return _down(args.name)
    labs = status.describe(args.name)
    print(json.dumps(labs, indent=2) if args.json else status.format_table(labs))
    return 0
