"""The report command end to end on small hand-written traces (no browser)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_sentinel.report import write_report
from fsdp_sentinel.trace import TraceWriter

T0 = 1_700_000_000.0
PLOTS = ("timeline", "computewait", "peers", "matrix")


def coll(rank: int, step: int, issue: float, end: float) -> dict:
    """One all-gather per step (``seq`` = step), as a rank's hooks record it."""
    return {
        "kind": "coll",
        "rank": rank,
        "step": step,
        "seq": step,
        "op": "all_gather",
        "bytes": 64,
        "issue": issue,
        "end": end,
    }


def full_trace(path: Path, host0: str = "fss-rp-h0") -> Path:
    """Two ranks, ten steps, flows both ways, one fault, one flag/clear, one action."""
    with TraceWriter(path) as w:
        for r in range(2):
            w.write(
                {
                    "kind": "rank",
                    "t": T0,
                    "rank": r,
                    "world_size": 2,
                    "host": host0 if r == 0 else "fss-rp-h1",
                    "pid": 10 + r,
                    "addrs": [f"198.18.0.{r + 1}"],
                }
            )
        t = T0 + 1
        for s in range(10):
            d = 1.0 if 4 <= s < 7 else 0.3
            # In time order, as the daemon receives them: every rank's
            # collectives of the step end before any rank's step does.
            for r in range(2):
                w.write(coll(r, s, t + 0.1, t + d - 0.05))
            for r in range(2):
                w.write({"kind": "step", "rank": r, "step": s, "start": t, "end": t + d})
                w.write(
                    {
                        "kind": "flow",
                        "t": t + d,
                        "dt": d,
                        "host": "root",
                        "pid": 10 + r,
                        "src": f"198.18.0.{r + 1}:{4000 + r}",
                        "dst": f"198.18.0.{2 - r}:29500",
                        "tx_bytes": 1_000_000,
                        "rx_bytes": 10_000,
                        "srtt_us": 2000 + 5000 * (4 <= s < 7),
                    }
                )
            t += d
            if s == 4:
                w.write(
                    {
                        "kind": "fault",
                        "t": t - d,
                        "end": t + 2,
                        "step": 4,
                        "host": "fss-rp-h1",
                        "rank": 1,
                        "what": "slow_link",
                        "params": {"rate_mbit": 150},
                    }
                )
            if s == 5:
                w.write(
                    {
                        "kind": "verdict",
                        "t": t,
                        "step": 5,
                        "rank": 1,
                        "state": "flagged",
                        "cause": "network",
                        "score": 3.5,
                        "evidence": {"srtt_ratio": 3.5},
                    }
                )
                w.write(
                    {
                        "kind": "action",
                        "t": t,
                        "host": "root",
                        "dev": "fss-rp-v1",
                        "what": "prio",
                        "state": "dry_run",
                    }
                )
            if s == 8:
                w.write(
                    {
                        "kind": "verdict",
                        "t": t,
                        "step": 8,
                        "rank": 1,
                        "state": "cleared",
                        "cause": "network",
                        "score": 0.5,
                    }
                )
    return path


def external_refs(html: str) -> list[str]:
    """Any reference the page would fetch: src/href not to '#' or inline data, @import, url(...)."""
    refs = re.findall(r'(?:src|href)\s*=\s*["\'](?!#|data:)([^"\']*)', html)
    refs += re.findall(r"@import|url\(\s*['\"]?(?!#)[^)]*\)", html)
    refs += re.findall(r"<(?:script|link|img|iframe|object|embed)\b", html, flags=re.I)
    return refs


def test_full_trace_renders_every_plot_and_table(tmp_path: Path) -> None:
    trace = full_trace(tmp_path / "t.jsonl.zst")
    out = tmp_path / "r.html"
    (data,) = write_report([trace], out)
    html = out.read_text()
    for name in PLOTS:
        m = re.search(rf'<div class="plot" id="plot-{name}"><svg\b.*?</svg>', html, flags=re.S)
        assert m, f"plot {name} missing"
        assert "<path" in m.group(0)
    assert external_refs(html) == []
    assert "slow_link on fss-rp-h1 (rank 1) at step 4" in html
    assert "rank 1 flagged at step 5 (cause: network" in html
    assert html.count('<tr class="flagged">') >= 2  # rank table row + verdict row
    assert "dry_run" in html and "srtt_ratio" in html
    assert len(data.steps) == 20 and data.world_size == 2


def test_same_trace_gives_the_same_page(tmp_path: Path) -> None:
    trace = full_trace(tmp_path / "t.jsonl")
    write_report([trace], tmp_path / "a.html")
    write_report([trace], tmp_path / "b.html")
    assert (tmp_path / "a.html").read_bytes() == (tmp_path / "b.html").read_bytes()


def test_trace_values_are_escaped(tmp_path: Path) -> None:
    trace = full_trace(tmp_path / "t.jsonl", host0="<script>x</script>")
    out = tmp_path / "r.html"
    write_report([trace], out, title="a & <b>")
    html = out.read_text()
    assert "<script>x" not in html and "&lt;script&gt;x" in html
    assert "<title>a &amp; &lt;b&gt;</title>" in html


def test_missing_kinds_still_render_and_say_so(tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    with TraceWriter(trace) as w:
        for s in range(3):
            w.write({"kind": "step", "rank": 0, "step": s, "start": T0 + s, "end": T0 + s + 0.5})
    out = tmp_path / "r.html"
    write_report([trace], out)
    html = out.read_text()
    assert 'id="plot-timeline"' in html and 'id="plot-computewait"' in html
    assert 'id="plot-peers"' not in html
    assert "No flow records" in html and "No verdict records" in html
    assert "No action records" in html and "No fault records" in html

    empty = tmp_path / "empty.jsonl"
    TraceWriter(empty).close()
    write_report([empty], out)
    html = out.read_text()
    assert "No step records" in html and "<svg" not in html


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_sentinel", "report", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_merges_per_rank_traces(tmp_path: Path) -> None:
    a, b = tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl"
    for r, path in ((0, a), (1, b)):
        with TraceWriter(path) as w:
            w.write(
                {
                    "kind": "rank",
                    "t": T0,
                    "rank": r,
                    "world_size": 2,
                    "host": "h",
                    "pid": 10 + r,
                    "addrs": [],
                }
            )
            for s in range(4):
                w.write(coll(r, s, T0 + s + 0.1, T0 + s + 0.3))
                w.write(
                    {"kind": "step", "rank": r, "step": s, "start": T0 + s, "end": T0 + s + 0.4}
                )
    out = tmp_path / "r.html"
    res = run_cli(str(a), str(b), "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert "2 ranks, 8 steps" in res.stdout
    assert out.read_text().count("<svg") == 2


def test_cli_errors(tmp_path: Path) -> None:
    res = run_cli()
    assert res.returncode == 2 and "usage:" in res.stderr
    res = run_cli("--bogus", "x")
    assert res.returncode == 2 and "usage:" in res.stderr
    res = run_cli(str(tmp_path / "nope.jsonl"))
    assert res.returncode == 2 and "nope.jsonl" in res.stderr and "usage:" in res.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"kind":"header","format":"fsdp-sentinel-trace","version":1}\n'
        '{"kind":"step","rank":0,"step":0,"start":1.0}\n'
    )
    res = run_cli(str(bad), "-o", str(tmp_path / "r.html"))
    assert res.returncode == 1
    assert f"{bad}:2:" in res.stderr and "end" in res.stderr
    assert not (tmp_path / "r.html").exists()
    res = run_cli(str(bad), "-o", str(tmp_path / "r.html"), "--lenient")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("n", [1, 3])
def test_world_size_from_rank_records(tmp_path: Path, n: int) -> None:
    trace = tmp_path / "t.jsonl"
    with TraceWriter(trace) as w:
        for r in range(n):
            w.write(
                {
                    "kind": "rank",
                    "t": T0,
                    "rank": r,
                    "world_size": n,
                    "host": "h",
                    "pid": r,
                    "addrs": [],
                }
            )
    (data,) = write_report([trace], tmp_path / "r.html")
    assert data.world_size == n
