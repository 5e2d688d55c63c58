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
    "Poll a running `fsdp-sentinel run` daemon's /api/v1/snapshot and show a\n"
    "one-line job summary and its per-rank table (host, step time, compute,\n"
    "wait, tx/rx rate, srtt, retransmits, state or cause, cost), worst first,\n"
    "refreshed every second in place. Flagged ranks are highlighted."
)
EPILOG = """examples:
  fsdp-sentinel top                         # daemon on the default 127.0.0.1:18965
  fsdp-sentinel top --addr 10.0.0.5:18965
  fsdp-sentinel top --once                  # print one table and exit
  fsdp-sentinel top --top 20 --sort score   # the 20 worst ranks by verdict score

The first line sums the job up: ranks, step time p50/p99, who is flagged and
what they cost (rh/h: rank-hours an hour the job spends waiting on them).
Rows come worst first: lost, flagged (by cost), then the rest by their wait,
least first (the rank the others wait for waits least).
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


def _state(r: RankView) -> str:
    """One word for the rank: its cause when flagged, ``lost``, else ``ok``; a
    network verdict says where: ``link>2`` (the path to rank 2: check the
    cable) or ``net node`` (the host)."""
    if r.state == "lost" or r.cause == "rank_lost":
        return "lost"
    if r.state != "flagged":
        return r.state
    if r.cause == "network" and r.scope is not None:
        return f"link>{r.peer_rank}" if r.scope == "link" else "net node"
    return r.cause or "flagged"


def rank_hours(r: RankView) -> float | None:
    """The rank-hours per hour its open verdict costs the job (``fsdp_sentinel.cost``)."""
    value = (r.cost or {}).get("rank_hours_per_hour")
    return float(value) if isinstance(value, (int, float)) else None


def _cost(r: RankView) -> str:
    rh = rank_hours(r)
    return "" if rh is None else fmt_count(rh)


#: Worst first: lost, then flagged, then the rest.
_SEVERITY = {"lost": 0, "flagged": 1}

#: ``--sort`` keys. ``cost``: flagged and lost ranks by what they cost the
#: job, then the rest by the time they waited, least first: the rank the
#: others wait for waits least, while the rank with the longest waits is
#: usually a fast one (nvidia-resiliency-ext's lesson). ``score``: by the
#: open verdict's score. ``rank``: in rank order.
SORTS = ("cost", "score", "rank")


def order(ranks: tuple[RankView, ...] | list[RankView], by: str = "cost") -> list[RankView]:
    """``ranks`` worst first by ``by`` (one of ``SORTS``); ties in rank order."""
    if by == "rank":
        return sorted(ranks, key=lambda r: r.rank)
    inf = float("inf")

    def key(r: RankView) -> tuple[int, float, float, int]:
        sev = _SEVERITY.get(r.state, 2)
        if by == "score":
            return (sev, -(r.score or 0.0), 0.0, r.rank)
        rh = rank_hours(r)
        wait = r.wait_seconds if r.wait_seconds is not None else inf
        return (sev, -(rh if rh is not None else r.score or 0.0), wait, r.rank)

    return sorted(ranks, key=key)


def _percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of a sorted list (nearest rank)."""
    i = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[i]


def fmt_count(n: float) -> str:
    """A count in 4 characters at most: ``999``, ``9999``, ``12k``, ``1.2M``."""
    if n < 10_000:
        return f"{n:.0f}" if n >= 10 or n == int(n) else f"{n:.2g}"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return f"{n:.0f}"


def job_summary(snap: Snapshot, width: int = 79) -> str:
    """One line of at most ``width`` columns at any size: the job, ranks, step
    p50/p99, who is flagged (worst first, as many as fit) and what they cost."""
    steps = sorted(r.step_seconds for r in snap.ranks if r.step_seconds is not None)
    jobs = sorted({r.job for r in snap.ranks if r.job})
    job = jobs[0] if len(jobs) == 1 else (f"{len(jobs)} jobs" if jobs else "")
    if len(job) > 12:
        job = job[:11] + "~"
    n = len(snap.ranks)
    ranks = f"{n} ranks" if n == snap.world_size else f"{n}/{snap.world_size or '?'} ranks"
    if steps:
        p50, p99 = _percentile(steps, 0.5), _percentile(steps, 0.99)
        step = f"p50 {p50:.3g}s p99 {p99:.3g}s"
    else:
        step = "no step yet"
    bad = order([r for r in snap.ranks if r.state in _SEVERITY])
    head = "  ".join(x for x in (job, ranks, step) if x)
    if not bad:
        return f"{head}  flagged none"[:width]
    rh = sum(rank_hours(r) or 0.0 for r in bad)
    tail = f"  {fmt_count(rh)} rh/h" if rh else ""
    flagged = f"  flagged {len(bad)}"
    room = width - len(head) - len(flagged) - len(tail)
    names: list[str] = []
    for i, r in enumerate(bad):
        left = len(bad) - i - 1
        trial = ": " + " ".join([*names, str(r.rank)]) + (f" +{left}" if left else "")
        if len(trial) > room:
            break
        names.append(str(r.rank))
    if names:
        rest = len(bad) - len(names)
        flagged += ": " + " ".join(names) + (f" +{rest}" if rest else "")
    return f"{head}{flagged}{tail}"[:width]


def _secs(x: float | None) -> str:
    """Seconds in 6 characters at most: ``0.431``, ``12.34``, ``1234``."""
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else (f"{x:.2f}" if x < 100 else f"{x:.0f}")


def _ms(us: float | None) -> str:
    """Microseconds as milliseconds in 6 characters at most."""
    if us is None:
        return "-"
    ms = us / 1000
    return f"{ms:.2f}" if ms < 10 else (f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}")


def _tail(text: str, width: int) -> str:
    """``text`` cut from the left: fleet host names differ at their end."""
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _row(r: RankView, with_job: bool) -> list[str]:
    # With several jobs in view the job column takes compute's place: compute
    # is about step minus wait, and one job's own view (--job) shows it.
    middle = [r.job or ""] if with_job else [_secs(r.compute_seconds)]
    return [
        str(r.rank),
        _tail(r.host, _COLUMNS[1][2]),
        "-" if r.step is None else str(r.step),
        _secs(r.step_seconds),
        *middle,
        _secs(r.wait_seconds),
        fmt_rate(r.tx_rate),
        fmt_rate(r.rx_rate),
        _ms(r.srtt_us),
        fmt_count(r.retrans_total),
        _state(r),
        _cost(r),
    ]


#: (name, right-aligned, widest it may get); text columns are cut with an
#: ellipsis. Their widths and one space between add up to 80 columns.
_COLUMNS = (
    ("rank", True, 5),
    ("host", False, 8),
    ("step", True, 6),
    ("step s", True, 6),
    ("comp s", True, 6),
    ("wait s", True, 6),
    ("tx/s", True, 5),
    ("rx/s", True, 5),
    ("rtt ms", True, 6),
    ("retx", True, 4),
    ("state", False, 9),
    ("rh/h", True, 4),
)
_JOB_COLUMN = ("job", False, 6)


def _title(snap: Snapshot, now: float | None) -> str:
    when = "-"
    if snap.t:
        when = datetime.fromtimestamp(snap.t, tz=timezone.utc).strftime("%H:%M:%S UTC")
    parts = [f"fsdp-sentinel  last {when}"]
    if now is not None and snap.t:
        parts.append(f"age {max(0.0, now - snap.t):.0f}s")
    return "  ".join(parts)


def render(
    snap: Snapshot,
    *,
    now: float | None = None,
    note: str = "",
    top: int | None = None,
    sort: str = "cost",
) -> RenderableType:
    """The live view of ``snap`` (pure): a one-line job summary, then the
    ``top`` worst ranks (all when None) sorted by ``sort``. ``now`` adds the
    snapshot's age; ``note`` adds a line (e.g. "daemon unreachable")."""
    with_job = len({r.job for r in snap.ranks if r.job}) > 1
    columns = list(_COLUMNS)
    if with_job:
        columns[4] = _JOB_COLUMN
    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 0),  # the box's blank separator is the only gap
        title=_title(snap, now),
        title_justify="left",
    )
    for name, right, widest in columns:
        table.add_column(
            name,
            justify="right" if right else "left",
            no_wrap=True,
            max_width=widest,
            overflow="ellipsis",
        )
    rows = order(snap.ranks, sort)
    shown = rows if top is None else rows[:top]
    for r in shown:
        table.add_row(*_row(r, with_job), style=STATE_STYLE.get(r.state))
    lines: list[RenderableType] = [Text(job_summary(snap), style="bold"), table]
    if len(shown) < len(rows):
        lines.append(Text(f"... {len(rows) - len(shown)} more ranks (--top N)", style="dim"))
    if not snap.ranks:
        lines.append(Text("waiting for ranks to announce themselves ...", style="dim"))
    verdicts = " ".join(f"{c} {n}" for c, n in sorted(snap.verdicts_total.items())) or "none"
    lines.append(Text(f"verdicts: {verdicts}", style="dim"))
    active = [f"{v.host} {v.dev}" for v in snap.remediation if v.active]
    if active:
        lines.append(Text(f"tc: prioritising the job's flows on {', '.join(active)}", style="bold"))
    lines.append(
        Text(
            f"ingest dropped {snap.ingest_dropped_total} (malformed {snap.ingest_malformed_total})",
            style="dim",
        )
    )
    if note:
        lines.append(Text(note, style="bold yellow"))
    return Group(*lines)


def render_text(snap: Snapshot, *, width: int = 200, **kw: Any) -> str:
    """:func:`render` (its keywords) as plain text on a console ``width`` columns wide."""
    buf = StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False)
    console.print(render(snap, **kw))
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


#: Lines of the view that are not rank rows: summary, title, header, rule,
#: "more ranks", verdicts, ingest, note, and one spare so the cursor never scrolls.
CHROME_LINES = 10


def fit_rows(height: int) -> int:
    """How many rank rows fit a terminal ``height`` lines tall (at least 1).

    A live view taller than the terminal cannot be redrawn in place (the
    top has scrolled away), which is what makes a big table flicker and
    smear; so the table is cut to the screen instead."""
    return max(1, height - CHROME_LINES)


def run_live(
    source: Callable[[], tuple[Snapshot, str]],
    *,
    interval: float = 1.0,
    console: Console | None = None,
    stop: Callable[[], bool] = lambda: False,
    top: int | None = None,
    sort: str = "cost",
) -> None:
    """Redraw ``render(*source())`` every ``interval`` seconds until ``stop()``,
    in place: rows beyond the terminal's height are left out (``top`` caps
    them further), and anything still too tall is cropped, never scrolled."""
    from rich.live import Live

    con = console or Console()

    def draw() -> RenderableType:
        snap, note = source()
        rows = fit_rows(con.size.height)
        return render(snap, now=time.time(), note=note, top=min(top or rows, rows), sort=sort)

    with Live(
        get_renderable=draw,
        console=con,
        auto_refresh=False,  # one fetch per interval, driven below
        redirect_stdout=False,
        vertical_overflow="crop",
    ) as live:
        while not stop():
            time.sleep(interval)
            live.refresh()


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return n


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
    parser.add_argument(
        "--top",
        type=_at_least_one,
        metavar="N",
        help="show the N worst ranks (default: as many as fit the terminal; --once: all)",
    )
    parser.add_argument(
        "--sort",
        choices=SORTS,
        default="cost",
        help="worst first by what the straggler costs the job (default), by score, or by rank",
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
        Console().print(render(snap, now=time.time(), top=args.top, sort=args.sort))
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
        run_live(source, interval=args.interval, top=args.top, sort=args.sort)
    return 0
