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

CAUSE_COLOURS = {"network": "#d62728", "compute": "#ff7f0e", "rank_lost": "#7f7f7f"}
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
    """Shade flagged spans and mark faults on a time axis (seconds since t0)."""
    t0 = data.t0
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
                f"rank {span.rank}",
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
    xs = [s.end - data.t0 for s in data.steps_of(rank)]
    ax.plot(xs, ys, linewidth=1.2, color=_rank_colour(rank), label=f"rank {rank}", **style)


def _time_axes(ax: Any, data: ReportData, ylabel: str, label: bool) -> None:
    """Events, labels and grid of a plot against time since the trace start."""
    _mark_events(ax, data, label=label)
    ax.set_xlabel("time since trace start (s)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def step_timeline(data: ReportData) -> str | None:
    """Step time per rank over the run, flagged spans shaded, faults marked."""
    if not data.steps:
        return None
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
    bars.set_ylabel("mean seconds per step")
    bars.set_title("compute vs wait per rank", fontsize=10)
    bars.legend(fontsize=8)
    for rank in ranks:
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
    for i, ((rank, peer), pts) in enumerate(sorted(data.peers.items())):
        colour = cmap(i % 20)
        xs = [p.t - data.t0 for p in pts]
        label = f"{rank}\u2192{peer}"
        tput.plot(xs, [p.tx_rate / MBIT for p in pts], linewidth=1, color=colour, label=label)
        sx = [x for x, p in zip(xs, pts, strict=True) if p.srtt_us is not None]
        sy = [p.srtt_us / 1000 for p in pts if p.srtt_us is not None]
        if sy:
            rtt.plot(sx, sy, linewidth=1, color=colour, label=label)
    for ax in (tput, rtt):
        _mark_events(ax, data, label=False)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    tput.set_ylabel("sent to peer (Mbit/s)")
    tput.set_title("per-peer throughput (rank \u2192 peer)", fontsize=10)
    tput.legend(fontsize=7, ncols=6, loc="upper right")
    rtt.set_ylabel("srtt (ms)")
    rtt.set_xlabel("time since trace start (s)")
    rtt.set_title("per-peer smoothed RTT", fontsize=10)
    return _svg(fig, "peers")


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
        im = ax.imshow(grid, cmap=cmap, aspect="auto")
        ax.set_xticks(range(n), [str(r) for r in ranks])
        ax.set_yticks(range(n), [str(r) for r in ranks])
        ax.set_xlabel("peer rank")
        ax.set_ylabel("rank")
        ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax, shrink=0.8)
        for i in range(n):
            for j in range(n):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=8)
    return _svg(fig, "matrix")
