"""The report's plots, drawn with matplotlib and returned as inline SVG text.

Figures are built with ``matplotlib.figure.Figure`` (no pyplot, so no global
figure state and no GUI backend) and written with the SVG backend. Text stays
text (``svg.fonttype = none``) to keep the page small, and each figure gets its
own ``svg.hashsalt`` so element ids never collide between the SVGs of one page.
Each function returns None when the trace holds nothing to draw.
"""

from __future__ import annotations

import io
import re
from typing import Any

from fsdp_sentinel.report.model import ReportData

CAUSE_COLOURS = {
    "network": "#d62728",
    "compute": "#ff7f0e",
    "rank_lost": "#7f7f7f",
    "hang": "#8c564b",
}
#: Above this many ranks one line per rank is unreadable: step time becomes a
#: ranks x steps heatmap, per-rank lines keep only the flagged ranks against
#: the job's median and p10-p90 band, and per-peer lines only the worst pairs.
HEATMAP_RANKS = 32
#: Per-peer lines drawn when there are too many pairs: the slowest by mean srtt.
WORST_PAIRS = 12
#: Matrix cells get their figure written in them up to this many ranks.
MATRIX_TEXT_RANKS = 16
FAULT_COLOUR = "#9467bd"
ACTION_COLOUR = "#2ca02c"  # remediation: tc tree in (solid) and out (dotted)
MBIT = 1e6 / 8  # bytes per second in one Mbit/s


def _svg(fig: Any, salt: str) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    # Drop the XML prolog and the RDF metadata (creation date, tool links): the
    # page stays byte-for-byte the same for the same trace.
    text = text[text.index("<svg") :]
    return re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)


def _figure(height: float, ncols: int = 1, nrows: int = 1) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _rank_colour(rank: int) -> Any:
    import matplotlib

    return matplotlib.colormaps["tab10"](rank % 10)


def _mark_events(ax: Any, data: ReportData, label: bool) -> None:
    """Shade flagged spans and mark faults on a time axis (seconds since the
    job's first step). A span still open when the job ended is shaded to its
    last step and says so."""
    t0 = data.origin
    seen: set[str] = set()
    for span in data.spans:
        colour = CAUSE_COLOURS.get(span.cause, "#bcbd22")
        name = f"flagged: {span.cause}"
        ax.axvspan(
            span.start - t0,
            span.end - t0,
            color=colour,
            alpha=0.15,
            label=name if label and name not in seen else None,
        )
        seen.add(name)
        if label:
            ax.annotate(
                f"rank {span.rank}" + (" (open at end)" if span.open else ""),
                (span.start - t0, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, -10),
                textcoords="offset points",
                fontsize=8,
                color=colour,
            )
    applied = [a for a in data.actions if a.get("state") in ("applied", "rolled_back")]
    for a in applied:
        on = a["state"] == "applied"
        name = "tc: prioritised" if on else "tc: restored"
        ax.axvline(float(a["t"]) - t0, color=ACTION_COLOUR, linestyle="-" if on else ":",
                   linewidth=1.4, label=name if label and name not in seen else None)  # fmt: skip
        seen.add(name)
    for i, f in enumerate(data.faults):
        ax.axvline(
            float(f["t"]) - t0,
            color=FAULT_COLOUR,
            linestyle="--",
            linewidth=1.2,
            label="fault onset" if label and i == 0 else None,
        )
        end = data.fault_end(f)
        if end != float("inf"):
            ax.axvline(end - t0, color=FAULT_COLOUR, linestyle=":", linewidth=1.2)
        if label:
            ax.annotate(
                f"{f['what']} (rank {f['rank']})",
                (float(f["t"]) - t0, 0.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, 4),
                textcoords="offset points",
                fontsize=8,
                color=FAULT_COLOUR,
            )


def _rank_line(ax: Any, data: ReportData, rank: int, ys: list[float], **style: Any) -> None:
    """One rank's per-step figure against its steps' end times."""
    xs = [s.end - data.origin for s in data.steps_of(rank)]
    ax.plot(xs, ys, linewidth=1.2, color=_rank_colour(rank), label=f"rank {rank}", **style)


def _time_axes(ax: Any, data: ReportData, ylabel: str | None, label: bool) -> None:
    """Events, labels and grid of a plot against time since the job's first step."""
    _mark_events(ax, data, label=label)
    ax.set_xlabel(TIME_LABEL)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    _from_job_start(ax, data)
    ax.grid(alpha=0.3)


TIME_LABEL = "time since the job's first step (s)"


def _from_job_start(ax: Any, data: ReportData) -> None:
    """Start the axis at the job's first step (earlier only for a fault injected before it)."""
    if data.steps:
        onsets = [float(f["t"]) - data.origin for f in data.faults]
        ax.set_xlim(left=min([0.0, *onsets]))


def _many(data: ReportData) -> bool:
    return len(data.rank_ids()) > HEATMAP_RANKS


def step_timeline(data: ReportData) -> str | None:
    """Step time per rank over the run, flagged spans shaded, faults marked
    (a heatmap of ranks x steps past ``HEATMAP_RANKS`` ranks)."""
    if not data.steps:
        return None
    if _many(data):
        return step_heatmap(data)
    fig, axes = _figure(4.2)
    ax = axes[0][0]
    for rank in data.rank_ids():
        rows = data.steps_of(rank)
        if rows:
            _rank_line(ax, data, rank, [s.seconds for s in rows], marker="o", markersize=3)
    _time_axes(ax, data, "step time (s)", label=True)
    # Above the axes, so it never hides the lines it explains.
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=8, ncols=8, frameon=False)
    return _svg(fig, "timeline")


def _step_of(data: ReportData, t: float) -> int | None:
    """The newest step any rank had started at time ``t``."""
    started = [s.step for s in data.steps if s.start <= t]
    return max(started) if started else None


def step_heatmap(data: ReportData) -> str | None:
    """Ranks x steps, each cell the rank's step time over that step's median
    over ranks; flagged ranks outlined over their flagged steps and named on
    the rank axis, fault onsets marked. One image, whatever the job's size."""
    import numpy as np
    from matplotlib.patches import Rectangle

    if not data.steps:
        return None
    ranks = data.rank_ids()
    first, last = data.step_range() or (0, 0)
    index = {r: i for i, r in enumerate(ranks)}
    grid = np.full((len(ranks), last - first + 1), np.nan)
    for s in data.steps:
        grid[index[s.rank], s.step - first] = s.seconds
    with np.errstate(all="ignore"):
        median = np.nanmedian(grid, axis=0)
        rel = grid / median
    fig, axes = _figure(min(9.0, 3.0 + 0.012 * len(ranks)))
    ax = axes[0][0]
    extent = (first - 0.5, last + 0.5, len(ranks) - 0.5, -0.5)
    im = ax.imshow(rel, cmap="magma_r", aspect="auto", interpolation="nearest",
                   vmin=1.0, vmax=max(1.5, float(np.nanpercentile(rel, 99.5))),
                   extent=extent)  # fmt: skip
    fig.colorbar(im, ax=ax, shrink=0.8, label="step time / median over ranks")
    flagged: dict[int, str] = {}
    for span in data.spans:
        colour = CAUSE_COLOURS.get(span.cause, "#bcbd22")
        start = span.step
        end = _step_of(data, span.end) if not span.open else last
        end = max(start, end if end is not None else last)
        y = index.get(span.rank)
        if y is None:
            continue
        ax.add_patch(Rectangle((start - 0.5, y - 0.5), end - start + 1, 1.0, fill=False,
                               edgecolor=colour, linewidth=1.5))  # fmt: skip
        flagged[span.rank] = span.cause + (", open at end" if span.open else "")
    for f in data.faults:
        step = _step_of(data, float(f["t"]))
        if step is not None:
            ax.axvline(step - 0.5, color=FAULT_COLOUR, linestyle="--", linewidth=1.2)
    ticks = sorted(flagged)
    ax.set_yticks([index[r] for r in ticks], [f"rank {r} ({flagged[r]})" for r in ticks],
                  fontsize=8)  # fmt: skip
    for label, r in zip(ax.get_yticklabels(), ticks, strict=True):
        label.set_color(CAUSE_COLOURS.get(flagged[r].split(",")[0], "#bcbd22"))
    ax.set_xlabel("step")
    ax.set_ylabel(f"{len(ranks)} ranks (flagged ones named)")
    ax.set_title("step time per rank and step, relative to the step's median", fontsize=10)
    return _svg(fig, "heatmap")


def _band(ax: Any, data: ReportData, value: Any) -> None:
    """The job's median and p10-p90 band of a per-step figure, over ranks."""
    import numpy as np

    by_step: dict[int, list[float]] = {}
    ends: dict[int, float] = {}
    for s in data.steps:
        by_step.setdefault(s.step, []).append(value(s))
        ends[s.step] = max(ends.get(s.step, s.end), s.end)
    steps = sorted(by_step)
    xs = [ends[k] - data.origin for k in steps]
    q = np.array([np.percentile(by_step[k], (10, 50, 90)) for k in steps])
    ax.fill_between(xs, q[:, 0], q[:, 2], color="#1f77b4", alpha=0.2, label="p10-p90, all ranks")
    ax.plot(xs, q[:, 1], color="#1f77b4", linewidth=1.2, label="median, all ranks")


def compute_wait(data: ReportData) -> str | None:
    """Mean compute vs wait per rank, and compute time per step over the run."""
    if not data.steps:
        return None
    fig, axes = _figure(3.8, ncols=2)
    bars, lines = axes[0]
    ranks = [r for r in data.rank_ids() if data.steps_of(r)]
    comp = [sum(s.compute for s in data.steps_of(r)) / len(data.steps_of(r)) for r in ranks]
    wait = [sum(s.wait for s in data.steps_of(r)) / len(data.steps_of(r)) for r in ranks]
    xs = list(range(len(ranks)))
    bars.bar(xs, comp, color="#1f77b4", label="compute")
    bars.bar(xs, wait, bottom=comp, color="#aec7e8", label="wait (in collectives)")
    bars.set_xticks(xs, [f"rank {r}" for r in ranks])
    bars.tick_params(axis="x", labelsize=8)
    bars.set_ylabel("mean seconds per step")
    bars.set_title("compute vs wait per rank", fontsize=10)
    bars.legend(fontsize=8)
    if _many(data):  # the job's band, and the flagged ranks' own lines
        _band(lines, data, lambda s: s.compute)
        shown = sorted({span.rank for span in data.spans} & set(ranks))
        bars.set_xticks([], [])
        bars.set_xlabel(f"{len(ranks)} ranks")
    else:
        shown = ranks
    for rank in shown:
        rows = data.steps_of(rank)
        _rank_line(lines, data, rank, [s.compute for s in rows], marker=".")
    _time_axes(lines, data, "compute per step (s)", label=False)
    lines.set_title("compute time per step", fontsize=10)
    lines.legend(fontsize=8)
    return _svg(fig, "computewait")


def peer_series(data: ReportData) -> str | None:
    """Throughput and srtt of each rank -> peer pair over the run."""
    if not data.peers:
        return None
    import matplotlib

    fig, axes = _figure(6.5, nrows=2)
    tput, rtt = axes[0][0], axes[1][0]
    cmap = matplotlib.colormaps["tab20"]
    pairs = sorted(data.peers.items())
    if len(pairs) > WORST_PAIRS and _many(data):
        pairs = sorted(_worst_pairs(data, WORST_PAIRS).items())
        tput.set_title(f"the {WORST_PAIRS} slowest of {len(data.peers)} pairs", fontsize=9)
    for i, ((rank, peer), pts) in enumerate(pairs):
        colour = cmap(i % 20)
        xs = [p.t - data.origin for p in pts]
        label = f"{rank}\u2192{peer}"
        tput.plot(xs, [p.tx_rate / MBIT for p in pts], linewidth=1, color=colour, label=label)
        sx = [x for x, p in zip(xs, pts, strict=True) if p.srtt_us is not None]
        sy = [p.srtt_us / 1000 for p in pts if p.srtt_us is not None]
        if sy:
            rtt.plot(sx, sy, linewidth=1, color=colour, label=label)
    for ax in (tput, rtt):
        _time_axes(ax, data, None, label=False)
    tput.set_xlabel("")
    tput.set_ylabel("sent to peer (Mbit/s)")
    tput.set_title("per-peer throughput (rank \u2192 peer)", fontsize=10)
    tput.legend(fontsize=7, ncols=6, loc="upper right")
    rtt.set_ylabel("srtt (ms)")
    rtt.set_title("per-peer smoothed RTT", fontsize=10)
    return _svg(fig, "peers")


def _worst_pairs(data: ReportData, n: int) -> dict[tuple[int, int], Any]:
    """The ``n`` pairs with the highest mean srtt (then the lowest throughput)."""

    def badness(item: tuple[tuple[int, int], Any]) -> tuple[float, float]:
        pts = item[1]
        srtts = [p.srtt_us for p in pts if p.srtt_us is not None]
        mean_srtt = sum(srtts) / len(srtts) if srtts else 0.0
        return (-mean_srtt, sum(p.tx_rate for p in pts) / max(1, len(pts)))

    return dict(sorted(data.peers.items(), key=badness)[:n])


def peer_matrix(data: ReportData) -> str | None:
    """Rank x peer matrices of mean throughput and mean srtt over the run."""
    if not data.peers:
        return None
    import numpy as np

    ranks = data.rank_ids()
    index = {r: i for i, r in enumerate(ranks)}
    n = len(ranks)
    tput = np.full((n, n), np.nan)
    rtt = np.full((n, n), np.nan)
    for (rank, peer), pts in data.peers.items():
        tput[index[rank], index[peer]] = sum(p.tx_rate for p in pts) / len(pts) / MBIT
        srtts = [p.srtt_us for p in pts if p.srtt_us is not None]
        if srtts:
            rtt[index[rank], index[peer]] = sum(srtts) / len(srtts) / 1000
    fig, axes = _figure(min(4.5, 1.6 + 0.5 * n), ncols=2)
    for ax, grid, title, cmap in (
        (axes[0][0], tput, "mean throughput rank\u2192peer (Mbit/s)", "Blues"),
        (axes[0][1], rtt, "mean srtt rank\u2192peer (ms)", "Reds"),
    ):
        im = ax.imshow(grid, cmap=cmap, aspect="auto", interpolation="nearest")
        if n <= HEATMAP_RANKS:
            ax.set_xticks(range(n), [str(r) for r in ranks])
            ax.set_yticks(range(n), [str(r) for r in ranks])
        ax.set_xlabel("peer rank")
        ax.set_ylabel("rank")
        ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax, shrink=0.8)
        for i in range(n if n <= MATRIX_TEXT_RANKS else 0):
            for j in range(n):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=8)
    return _svg(fig, "matrix")
