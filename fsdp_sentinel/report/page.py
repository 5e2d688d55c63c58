"""Assembles the report's single self-contained HTML page.

Everything is inline: the CSS, the plots (SVG text from ``report.plots``) and
the tables. The page loads nothing (no scripts, fonts, images or styles from
anywhere), so it opens offline and can be attached to a ticket as one file.
Every value from the trace is HTML-escaped.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from html import escape
from typing import Any

from fsdp_sentinel.cost import describe_cost
from fsdp_sentinel.report import plots
from fsdp_sentinel.report.model import ReportData, cause_text

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 1150px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: .2em; }
h2 { font-size: 1.15em; border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.flagged td { background: #fdecea; }
.summary td:first-child { font-weight: 600; }
.note { color: #666; font-style: italic; }
.plot svg { max-width: 100%; height: auto; }
code { font-size: 12px; }
"""


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "\u2013"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(", ", ": "), sort_keys=True)
    return str(value)


def _table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    row_class: Callable[[int], str] | None = None,
) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cells = []
        for v in row:
            cls = ' class="num"' if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
            cells.append(f"<td{cls}>{escape(_fmt(v))}</td>")
        cls = row_class(i) if row_class else ""
        attr = f' class="{cls}"' if cls else ""
        body.append(f"<tr{attr}>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _note(text: str) -> str:
    return f'<p class="note">{escape(text)}</p>'


def _section(title: str, body: str, ident: str, level: int = 2) -> str:
    return f'<section id="{ident}"><h{level}>{escape(title)}</h{level}>{body}</section>'


def _plot(svg: str | None, ident: str, missing: str) -> str:
    if svg is None:
        return _note(missing)
    return f'<div class="plot" id="plot-{ident}">{svg}</div>'


def _rel(data: ReportData, t: Any) -> float | None:
    """Seconds since the job's first step (the plots' time axis)."""
    return None if t is None else float(t) - data.origin


def _scenario(data: ReportData) -> str:
    if not data.faults:
        return "no fault records (a clean run, or faults not recorded)"
    parts = []
    for f in data.faults:
        when = f" at step {f['step']}" if f.get("step") is not None else ""
        end = data.fault_end(f)
        span = f" for {end - float(f['t']):.1f} s" if end != float("inf") else ""
        parts.append(f"{f['what']} on {f['host']} (rank {f['rank']}){when}{span}")
    return "; ".join(parts)


def _findings(data: ReportData) -> str:
    flags = data.first_flags()
    if not flags:
        return "no rank flagged"
    return "; ".join(
        f"rank {v['rank']} flagged at step {v['step']} (cause: {cause_text(v)}, score {_fmt(v['score'], 2)})"
        for v in flags
    )


#: Host names listed in the summary before the rest are counted.
SUMMARY_HOSTS = 8
#: Above this many ranks the rank table is folded (flagged ranks first, shown).
FOLD_RANKS = 32


def _some(names: list[str]) -> str:
    """The first few names, then how many more."""
    if len(names) <= SUMMARY_HOSTS:
        return ", ".join(names)
    return ", ".join(names[:SUMMARY_HOSTS]) + f", \u2026 {len(names) - SUMMARY_HOSTS} more hosts"


def summary(data: ReportData, paths: Sequence[str], title: str | None) -> str:
    steps = data.step_range()
    hosts = sorted({r.host for r in data.ranks.values() if r.host})
    phases = data.phases()
    rows = [
        ("trace", ", ".join(paths)),
        ("faults", _scenario(data)),
        ("found", _findings(data)),
        ("ranks", f"{data.world_size or 0} ({_some(hosts) or 'no rank records'})"),
        (
            "steps",
            f"{steps[0]}\u2013{steps[1]} ({len(data.steps)} step records)" if steps else "none",
        ),
        (
            "duration",
            f"{data.job_end() - data.origin:.1f} s of steps, trace {data.t1 - data.t0:.1f} s",
        ),
        (
            "step time (median)",
            f"before {_fmt(phases.before)} s, during {_fmt(phases.during)} s, "
            f"after {_fmt(phases.after)} s"
            if data.faults
            else f"{_fmt(phases.before)} s",
        ),
        ("records", ", ".join(f"{k} {n}" for k, n in sorted(data.counts.items()))),
    ]
    if title:
        rows.insert(1, ("title", title))
    body = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="summary">{body}</table>'


def _rank_table(data: ReportData) -> str:
    flagged = {s.rank for s in data.spans}
    ranks = data.rank_ids()
    by_rank: dict[int, list[Any]] = {}
    for (a, _), pts in data.peers.items():  # one pass, not one per rank
        by_rank.setdefault(a, []).append(pts)
    rows = []
    for r in ranks:
        info = data.ranks.get(r)
        st = data.steps_of(r)
        mine = by_rank.get(r, [])
        sent = sum(sum(p.tx_rate for p in pts) / max(1, len(pts)) for pts in mine)
        srtts = [p.srtt_us for pts in mine for p in pts if p.srtt_us]
        rows.append(
            (
                r,
                info.host if info else "",
                info.pid if info else None,
                ", ".join(info.addrs) if info else "",
                len(st),
                statistics.median([s.seconds for s in st]) if st else None,
                statistics.fmean([s.compute for s in st]) if st else None,
                statistics.fmean([s.wait for s in st]) if st else None,
                sent / plots.MBIT if sent else None,
                statistics.median(srtts) / 1000 if srtts else None,
                "flagged" if r in flagged else "ok",
            )
        )
    headers = (
        "rank",
        "host",
        "pid",
        "addrs",
        "steps",
        "median step (s)",
        "mean compute (s)",
        "mean wait (s)",
        "mean sent (Mbit/s)",
        "median srtt (ms)",
        "state",
    )
    if len(rows) <= FOLD_RANKS:
        return _table(headers, rows, lambda i: "flagged" if rows[i][-1] == "flagged" else "")
    # A fleet: the flagged ranks in view, every rank one click away.
    bad = [row for row in rows if row[-1] == "flagged"]
    shown = _table(headers, bad, lambda i: "flagged") if bad else _note("No rank flagged.")
    every = _table(headers, rows, lambda i: "flagged" if rows[i][-1] == "flagged" else "")
    return f"{shown}<details><summary>all {len(rows)} ranks</summary>{every}</details>"


def _verdict_table(data: ReportData) -> str:
    if not data.verdicts:
        return _note(
            "No verdict records in this trace: nothing was flagged (or detection did not run)."
        )
    head = ""
    if data.verdicts_replayed:
        head = _note(
            "The trace holds no verdict records: these are the verdicts a replay of it"
            " gives (fsdp-sentinel replay, default thresholds)."
        )
    rows = [
        (
            _rel(data, v["t"]),
            v["step"],
            v["rank"],
            v.get("host"),
            v["state"],
            cause_text(v),
            v["score"],
            v.get("peer_rank"),
            describe_cost((v.get("evidence") or {}).get("cost")) or None,
            v.get("evidence"),
        )
        for v in data.verdicts
    ]
    headers = (
        "t (s)", "step", "rank", "host", "state", "cause", "score", "peer", "cost", "evidence",
    )  # fmt: skip
    return head + _table(headers, rows, lambda i: "flagged" if rows[i][4] == "flagged" else "")


def _action_table(data: ReportData) -> str:
    if not data.actions:
        return _note("No action records in this trace: remediation was off or took no action.")
    known = {"kind", "t", "host", "dev", "what", "state"}
    rows = [
        (
            _rel(data, a["t"]),
            a["host"],
            a["dev"],
            a["what"],
            a["state"],
            {k: v for k, v in a.items() if k not in known} or None,
        )
        for a in data.actions
    ]
    return _table(("t (s)", "host", "dev", "what", "state", "details"), rows)


def _fault_table(data: ReportData) -> str:
    if not data.faults:
        return _note("No fault records in this trace.")
    rows = [
        (
            _rel(data, f["t"]),
            _rel(data, data.fault_end(f)) if data.fault_end(f) != float("inf") else None,
            f.get("step"),
            f["host"],
            f["rank"],
            f["what"],
            f["params"],
        )
        for f in data.faults
    ]
    return _table(("onset t (s)", "end t (s)", "step", "host", "rank", "what", "params"), rows)


def _job_sections(data: ReportData, paths: Sequence[str], title: str | None,
                  prefix: str = "", level: int = 2) -> list[str]:  # fmt: skip
    """One job's sections (ids and plot ids start with ``prefix``)."""
    no_steps = "No step records in this trace (no trainer hooks): step-time plots omitted."
    no_flows = (
        "No flow records mapped to ranks in this trace (probes not running, or flows"
        " without matching rank records): per-peer plots omitted."
    )
    if data.flows_unmapped and not data.peers:
        no_flows += f" {data.flows_unmapped} flow records could not be mapped to a rank pair."

    def section(name: str, body: str, ident: str) -> str:
        return _section(name, body, prefix + ident, level)

    return [
        section("Summary", summary(data, paths, title), "summary"),
        section("Ranks", _rank_table(data), "ranks"),
        section(
            "Step time per rank",
            _plot(plots.step_timeline(data), prefix + "timeline", no_steps)
            + _note(
                "Shaded: a rank flagged (from flagged to cleared verdict). Dashed: fault onset;"
                " dotted: fault end."
            ),
            "timeline",
        ),
        section(
            "Compute vs wait",
            _plot(plots.compute_wait(data), prefix + "computewait", no_steps)
            + _note(
                "Wait: time inside the rank's collectives during the step (union of coll"
                " issue..end), as the detector and /metrics count it; compute: step time"
                " minus wait."
            ),
            "computewait",
        ),
        section(
            "Per-peer throughput and srtt",
            _plot(plots.peer_series(data), prefix + "peers", no_flows)
            + (_plot(plots.peer_matrix(data), prefix + "matrix", "") if data.peers else ""),
            "peers",
        ),
        section("Verdicts", _verdict_table(data), "verdicts"),
        section("Actions", _action_table(data), "actions"),
        section("Faults (ground truth)", _fault_table(data), "faults"),
    ]


def _page(title: str | None, sections: list[str]) -> str:
    heading = escape(title or "fsdp-sentinel report")
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f"<title>{heading}</title><style>{CSS}</style></head>"
        f"<body><h1>{heading}</h1>{''.join(sections)}</body></html>\n"
    )


def render(data: ReportData, paths: Sequence[str], title: str | None = None) -> str:
    """The whole report page of one job as one HTML string."""
    return _page(title, _job_sections(data, paths, title))


def job_label(data: ReportData, i: int) -> str:
    """How the page names a job: its id, else its place in the trace."""
    return data.job or f"job {i + 1} (no id)"


def _jobs_index(jobs: Sequence[ReportData]) -> str:
    rows = []
    for i, data in enumerate(jobs):
        steps = data.step_range()
        flags = "; ".join(f"rank {v['rank']} {cause_text(v)}" for v in data.first_flags())
        rows.append(
            f'<tr><td><a href="#job{i}">{escape(job_label(data, i))}</a></td>'
            f'<td class="num">{data.world_size or 0}</td>'
            f"<td>{escape(f'{steps[0]}–{steps[1]}' if steps else 'none')}</td>"
            f"<td>{escape(flags or 'no rank flagged')}</td></tr>"
        )
    head = "<tr><th>job</th><th>ranks</th><th>steps</th><th>found</th></tr>"
    note = _note("Each job was judged on its own, as replay and the daemon judge them.")
    return f"<table>{head}{''.join(rows)}</table>{note}"


def render_jobs(jobs: Sequence[ReportData], paths: Sequence[str], title: str | None = None) -> str:
    """The report page of a trace of one job or several (a section each, after an index)."""
    if len(jobs) == 1:
        return render(jobs[0], paths, title)
    sections = [_section(f"{len(jobs)} jobs in this trace", _jobs_index(jobs), "jobs")]
    for i, data in enumerate(jobs):
        body = "".join(_job_sections(data, paths, None, f"job{i}-", level=3))
        sections.append(
            f'<section class="job" id="job{i}"><h2>Job {escape(job_label(data, i))}</h2>'
            f"{body}</section>"
        )
    return _page(title, sections)
