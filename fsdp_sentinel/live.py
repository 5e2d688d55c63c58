"""The live per-rank table, and ``fsdp-sentinel top`` that shows it for a running daemon.

:func:`render` is pure: a :class:`~fsdp_sentinel.snapshot.Snapshot` in, a rich
renderable out (one row per rank: step time, compute, wait, tx/rx rate,
srtt, retransmits, state, cause; flagged ranks highlighted), narrower than 80
columns. ``fsdp-sentinel run --live`` refreshes it from the daemon's own
snapshot; ``fsdp-sentinel top`` polls a daemon's ``/api/v1/snapshot``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime, timezone
from io import StringIO
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from fsdp_sentinel.snapshot import RankView, Snapshot

HELP = "show a running daemon's live per-rank table"
DESCRIPTION = (
    "Poll a running `fsdp-sentinel run` daemon's /api/v1/snapshot and show its\n"
    "per-rank table (step time, compute, wait, tx/rx rate, srtt, retransmits,\n"
    "state, cause), refreshed every second. Flagged ranks are highlighted."
)
EPILOG = """examples:
  fsdp-sentinel top                         # daemon on the default 127.0.0.1:18965
  fsdp-sentinel top --addr 10.0.0.5:18965
  fsdp-sentinel top --once                  # print one table and exit
"""

DEFAULT_ADDR = "127.0.0.1:18965"

#: Row styles by rank state; "ok" rows are plain.
STATE_STYLE = {"flagged": "bold red", "lost": "bold magenta"}


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def fmt_rate(bps: float | None) -> str:
    """Bytes per second, 5 characters at most: ``980``, ``12.3k``, ``118M``."""
    if bps is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bps >= scale:
            v = bps / scale
            return f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"
    return f"{bps:.0f}"


def _row(r: RankView) -> list[str]:
    return [
        str(r.rank),
        "-" if r.step is None else str(r.step),
        _num(r.step_seconds, ".3f"),
        _num(r.compute_seconds, ".3f"),
        _num(r.wait_seconds, ".3f"),
        fmt_rate(r.tx_rate),
        fmt_rate(r.rx_rate),
        _num(None if r.srtt_us is None else r.srtt_us / 1000, ".2f"),
        str(r.retrans_total),
        r.state,
        r.cause or "",
    ]


_COLUMNS = (
    "rank",
    "step",
    "step s",
    "comp s",
    "wait s",
    "tx B/s",
    "rx B/s",
    "srtt ms",
    "retx",
    "state",
    "cause",
)


def _title(snap: Snapshot, now: float | None) -> str:
    when = "-"
    if snap.t:
        when = datetime.fromtimestamp(snap.t, tz=timezone.utc).strftime("%H:%M:%S UTC")
    parts = [f"fsdp-sentinel  ranks {len(snap.ranks)}/{snap.world_size or '?'}", f"last {when}"]
    if now is not None and snap.t:
        parts.append(f"age {max(0.0, now - snap.t):.0f}s")
    return "  ".join(parts)


def render(snap: Snapshot, *, now: float | None = None, note: str = "") -> RenderableType:
    """The live view of ``snap`` (pure). ``now`` adds the snapshot's age;
    ``note`` adds a line (e.g. "daemon unreachable")."""
    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 0),  # the box's blank separator is the only gap
        title=_title(snap, now),
        title_justify="left",
    )
    for i, name in enumerate(_COLUMNS):
        table.add_column(name, justify="left" if i >= len(_COLUMNS) - 2 else "right", no_wrap=True)
    for r in sorted(snap.ranks, key=lambda r: r.rank):
        table.add_row(*_row(r), style=STATE_STYLE.get(r.state))
    lines: list[RenderableType] = [table]
    if not snap.ranks:
        lines.append(Text("waiting for ranks to announce themselves ...", style="dim"))
    verdicts = " ".join(f"{c} {n}" for c, n in sorted(snap.verdicts_total.items())) or "none"
    lines.append(Text(f"verdicts: {verdicts}", style="dim"))
    lines.append(
        Text(
            f"ingest dropped {snap.ingest_dropped_total} (malformed {snap.ingest_malformed_total})",
            style="dim",
        )
    )
    if note:
        lines.append(Text(note, style="bold yellow"))
    return Group(*lines)


def render_text(
    snap: Snapshot, *, width: int = 200, now: float | None = None, note: str = ""
) -> str:
    """:func:`render` as plain text on a console ``width`` columns wide."""
    buf = StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False)
    console.print(render(snap, now=now, note=note))
    return buf.getvalue()


# --------------------------------------------------------------------------- top


def fetch_snapshot(addr: str, timeout: float = 2.0) -> Snapshot:
    """GET a daemon's ``/api/v1/snapshot``; raises OSError/ValueError on failure."""
    from fsdp_sentinel.exporters.http import SNAPSHOT_PATH

    url = f"http://{addr}{SNAPSHOT_PATH}"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        obj: Any = json.load(resp)
    if not isinstance(obj, dict):
        raise ValueError(f"{url}: not a snapshot object")
    return Snapshot.from_json(obj)


def run_live(
    source: Callable[[], tuple[Snapshot, str]],
    *,
    interval: float = 1.0,
    console: Console | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """Redraw ``render(*source())`` every ``interval`` seconds until ``stop()``."""
    from rich.live import Live

    def draw() -> RenderableType:
        snap, note = source()
        return render(snap, now=time.time(), note=note)

    with Live(
        get_renderable=draw,
        console=console,
        auto_refresh=False,  # one fetch per interval, driven below
        redirect_stdout=False,
    ) as live:
        while not stop():
            time.sleep(interval)
            live.refresh()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--addr",
        default=DEFAULT_ADDR,
        metavar="HOST:PORT",
        help=f"the daemon's --metrics-addr (default {DEFAULT_ADDR})",
    )
    parser.add_argument("--once", action="store_true", help="print one table and exit")
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="refresh period (default 1 s)"
    )


def main(args: argparse.Namespace) -> int:
    from fsdp_sentinel.exporters.http import parse_addr

    try:
        parse_addr(args.addr)
    except ValueError as e:
        print(f"fsdp-sentinel top: error: --addr: {e}", file=sys.stderr)
        return 2
    if args.interval <= 0:
        print("fsdp-sentinel top: error: --interval must be > 0", file=sys.stderr)
        return 2
    if args.once:
        try:
            snap = fetch_snapshot(args.addr)
        except (OSError, ValueError) as e:
            print(f"fsdp-sentinel top: cannot read {args.addr}: {e}", file=sys.stderr)
            return 1
        Console().print(render(snap, now=time.time()))
        return 0

    last = Snapshot()

    def source() -> tuple[Snapshot, str]:
        nonlocal last
        try:
            last = fetch_snapshot(args.addr)
            return last, ""
        except (OSError, ValueError) as e:
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            return last, f"daemon at {args.addr} unreachable: {reason}"

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how one leaves top
        run_live(source, interval=args.interval)
    return 0
