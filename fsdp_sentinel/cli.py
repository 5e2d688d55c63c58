"""The ``fsdp-sentinel`` command line: one table of subcommands.

Each subcommand lives in its own module exposing ``HELP`` (one line),
``add_arguments(parser)`` and ``main(args) -> int``. Command modules keep heavy
imports (torch, bcc, pyroute2, matplotlib) inside functions so that ``--help``
and flag errors stay instant. Bad flags exit 2 with a usage line (argparse).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: subcommand -> module implementing it (stable names: docs/architecture.md).
COMMANDS: dict[str, str] = {
    "run": "fsdp_sentinel.daemon",
    "replay": "fsdp_sentinel.replay",
    "flows": "fsdp_sentinel.probes.flows_cmd",
    "demo": "fsdp_sentinel.demo",
    "report": "fsdp_sentinel.report",
    "top": "fsdp_sentinel.live",
    "lab": "fsdp_sentinel.lab.cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-sentinel",
        description="eBPF network observability and straggler detection for FSDP training.",
    )
    from fsdp_sentinel import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, modname in COMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name is None or not modname.startswith(e.name):
                raise
            continue  # a subcommand whose module is not installed
        p = sub.add_parser(
            name,
            help=mod.HELP,
            description=getattr(mod, "DESCRIPTION", mod.HELP),
            epilog=getattr(mod, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
