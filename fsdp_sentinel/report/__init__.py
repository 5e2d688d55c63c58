"""``fsdp-sentinel report TRACE... -o report.html``: one self-contained HTML report.

Reads one or more trace files (plain or ``.zst``; several are merged on time,
e.g. the per-rank traces of a run without the daemon), summarises them
(``report.model``), draws the plots (``report.plots``) and writes one HTML file
(``report.page``) that needs nothing else to open.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

# Light: the plotting module imports matplotlib inside its functions.
from fsdp_sentinel.report import model, page

HELP = "write a self-contained HTML report (plots and tables) from trace files"
EPILOG = """examples:
  fsdp-sentinel report out/demo/trace.jsonl.zst -o out/demo/report.html
  fsdp-sentinel report rank0.jsonl rank1.jsonl -o run.html --title "run 42"
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace file(s), plain or .zst")
    p.add_argument(
        "-o", "--output", default="report.html", metavar="FILE", help="HTML file to write"
    )
    p.add_argument("--title", default=None, help="page title (default: from the trace)")
    p.add_argument(
        "--lenient",
        action="store_true",
        help="skip malformed lines (counted) instead of stopping at the first",
    )


def load_jobs(
    paths: Sequence[str | os.PathLike[str]], strict: bool = True
) -> list[model.ReportData]:
    """Read and merge ``paths`` and summarise them for the report, a job each."""
    from fsdp_sentinel.progress import ProgressLine, counted, wanted
    from fsdp_sentinel.trace import TraceReader, merge_traces

    readers = [TraceReader(p, strict=strict) for p in paths]
    total = sum(os.path.getsize(p) for p in paths)
    bar = (
        ProgressLine(total, lambda: sum(r.bytes_read() for r in readers)) if wanted(total) else None
    )
    return model.build_jobs(counted(merge_traces(readers), bar))


def load(paths: Sequence[str | os.PathLike[str]], strict: bool = True) -> model.ReportData:
    """:func:`load_jobs` of a trace of one job (the demo's); ValueError for several."""
    jobs = load_jobs(paths, strict)
    if len(jobs) > 1:
        raise ValueError(f"{', '.join(map(str, paths))} holds {len(jobs)} jobs")
    return jobs[0]


def write_report(
    paths: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    title: str | None = None,
    strict: bool = True,
) -> list[model.ReportData]:
    """Write the report for ``paths`` to ``output``; returns what it summarised, a job each."""
    jobs = load_jobs(paths, strict=strict)
    html = page.render_jobs(jobs, [str(p) for p in paths], title)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)  # a reader never sees half a page
    return jobs


def main(args: argparse.Namespace) -> int:
    from fsdp_sentinel.trace import TraceError

    for p in args.traces:
        if not os.path.isfile(p):
            print(
                "usage: fsdp-sentinel report TRACE... [-o FILE] [--title TEXT] [--lenient]\n"
                f"fsdp-sentinel report: error: no such trace file: {p}",
                file=sys.stderr,
            )
            return 2
    try:
        jobs = write_report(args.traces, args.output, args.title, strict=not args.lenient)
    except TraceError as e:
        print(f"fsdp-sentinel report: error: {e}", file=sys.stderr)
        return 1
    for i, data in enumerate(jobs):
        of = f" job {page.job_label(data, i)}:" if len(jobs) > 1 else ""
        print(
            f"wrote {args.output}:{of} {data.world_size or 0} ranks, {len(data.steps)} steps, "
            f"{len(data.verdicts)} verdicts, {len(data.faults)} faults"
        )
    return 0
