"""The HTML report in headless Chromium: it loads without console errors, every
plot is in the rendered DOM, and a screenshot shows the plots drawn.

Inputs are real traces: a two-rank run of the bundled trainer (gloo on
loopback) with a deliberate compute stall on rank 1, and the lab's captured
golden traces when they exist (tests/traces/lab-*.jsonl.zst, which carry flows,
verdicts and faults from a real run).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fsdp_sentinel.report import write_report
from fsdp_sentinel.trace import TraceWriter, merge_traces, read_trace, record_time

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = sorted((ROOT / "tests" / "traces").glob("lab-*.jsonl.zst"))
CHROMIUM = shutil.which("chromium")
DELAY_STEPS = (4, 7)  # steps [4, 7) of rank 1 stall


def chromium(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    if CHROMIUM is None:
        pytest.skip("chromium not installed (scripts/setup.sh installs it)")
    with tempfile.TemporaryDirectory(prefix="fss-rb-chrome-") as profile:
        return subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                "--enable-logging=stderr",
                "--v=0",
                *extra,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def trainer_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-rank trainer run, merged into one trace.

    The stall is real (the trainer's --delay-rank), and the trainer writes its
    own ``fault`` record for it. Verdicts come from the real detection
    pipeline (replay) when it is installed.
    """
    pytest.importorskip("torch")
    try:
        import fsdp_sentinel.trainer.loop  # noqa: F401
    except ImportError as e:
        pytest.skip(f"trainer not available: {e}")
    out = tmp_path_factory.mktemp("fss-rb-trainer")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "fsdp_sentinel.trainer",
        "--steps",
        "10",
        "--layers",
        "2",
        "--dim",
        "64",
        "--socket",
        str(out / "absent.sock"),
        "--trace-out",
        str(out / "rank{rank}.jsonl"),
        "--delay-rank",
        "1",
        "--delay-seconds",
        "0.4",
        "--delay-steps",
        f"{DELAY_STEPS[0]}:{DELAY_STEPS[1]}",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    recs = list(merge_traces([read_trace(out / f"rank{r}.jsonl") for r in range(2)]))
    steps = {(r["rank"], r["step"]): r for r in recs if r["kind"] == "step"}
    assert len(steps) == 20
    faults = [r for r in recs if r["kind"] == "fault"]
    assert [(f["rank"], f["step"]) for f in faults] == [(1, DELAY_STEPS[0])]
    verdicts: list[dict] = []
    try:
        from fsdp_sentinel.replay import replay_paths
    except ImportError:
        pass
    else:
        verdicts = list(replay_paths([out / f"rank{r}.jsonl" for r in range(2)], strict=False))
    merged = out / "merged.jsonl.zst"
    with TraceWriter(merged) as w:
        w.write_many(sorted([*recs, *verdicts], key=record_time))
    return merged


def report_traces() -> list[str]:
    return ["trainer", *(p.name for p in GOLDEN)]


@pytest.fixture(params=report_traces())
def trace(request: pytest.FixtureRequest) -> Path:
    if request.param == "trainer":
        return request.getfixturevalue("trainer_trace")  # type: ignore[no-any-return]
    return ROOT / "tests" / "traces" / request.param


def distinct_colours(png: Path) -> set[tuple[int, ...]]:
    from PIL import Image

    with Image.open(png) as im:
        rgb = im.convert("RGB")
        return {tuple(c) for _, c in rgb.getcolors(maxcolors=1 << 24) or []}  # type: ignore[arg-type]


def near(colours: set[tuple[int, ...]], target: tuple[int, int, int], tol: int = 12) -> bool:
    return any(all(abs(a - b) <= tol for a, b in zip(c, target, strict=False)) for c in colours)


def test_report_loads_and_every_plot_renders(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    (data,) = write_report([trace], out)
    url = out.as_uri()
    expected = ["timeline", "computewait"] + (["peers", "matrix"] if data.peers else [])

    dom = chromium(url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    console = [ln for ln in dom.stderr.splitlines() if ":CONSOLE" in ln]
    assert console == [], console
    for name in expected:
        m = re.search(rf'<div class="plot" id="plot-{name}">\s*<svg\b', dom.stdout)
        assert m, f"plot {name} not in the rendered DOM"
    if not data.peers:
        assert "No flow records" in dom.stdout

    shot = tmp_path / "shot.png"
    res = chromium(url, f"--screenshot={shot}", "--window-size=1200,3000")
    assert res.returncode == 0 and shot.exists(), res.stderr[-3000:]
    assert shot.stat().st_size > 60_000
    colours = distinct_colours(shot)
    assert len(colours) > 500  # antialiased lines, text, shading: not a blank page
    # every rank's line colour (matplotlib tab10) is on screen
    tab10 = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
    for r in data.rank_ids()[:4]:
        assert near(colours, tab10[r]), f"rank {r} line colour missing"
    # compute/wait bars (#1f77b4 and #aec7e8)
    assert near(colours, (174, 199, 232), tol=3)
    if data.faults:
        assert near(colours, (148, 103, 189), tol=20)  # fault marker
    keep = os.environ.get("FSS_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, Path(keep) / f"report-{trace.name}.png")


def test_trainer_report_shows_the_real_stall(trainer_trace: Path, tmp_path: Path) -> None:
    # Oracle independent of the report: the stall is a 0.4 s sleep, which every
    # rank waits for; the step records themselves give the steps after it.
    recs = [r for r in read_trace(trainer_trace) if r["kind"] == "step"]
    fast = [r["end"] - r["start"] for r in recs if r["step"] >= DELAY_STEPS[1]]
    (data,) = write_report([trainer_trace], tmp_path / "r.html")
    ph = data.phases()
    assert ph.during is not None and ph.after is not None
    assert ph.during >= 0.4
    assert ph.after == pytest.approx(sorted(fast)[len(fast) // 2], rel=0.5) and ph.after < 0.3
    # the stall is compute on rank 1 and waiting on rank 0
    r1 = [s for s in data.steps_of(1) if DELAY_STEPS[0] <= s.step < DELAY_STEPS[1]]
    r0 = [s for s in data.steps_of(0) if DELAY_STEPS[0] <= s.step < DELAY_STEPS[1]]
    assert min(s.compute for s in r1) > 0.3
    assert sum(s.wait for s in r0) > sum(s.wait for s in r1)


FLEET = 1024


@pytest.fixture(scope="module")
def fleet_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fsdp_sentinel.synth import fleet_job

    path = tmp_path_factory.mktemp("fss-rb-fleet") / "fleet.jsonl.zst"
    with TraceWriter(path) as w:
        w.write_many(fleet_job(FLEET))
    return path


def test_a_thousand_rank_report_is_one_self_contained_heatmap_page(
    fleet_trace: Path, tmp_path: Path
) -> None:
    out = tmp_path / "fleet.html"
    (data,) = write_report([fleet_trace], out)
    html = out.read_text()
    assert len(data.rank_ids()) == FLEET
    # one file: nothing fetched from anywhere
    assert not re.search(r'(src|href)="(https?:|//|file:)', html)
    dom = chromium(out.as_uri(), "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert [ln for ln in dom.stderr.splitlines() if ":CONSOLE" in ln] == []
    # the per-rank lines became a heatmap, flagged ranks named on it, open at end
    timeline = re.search(r'<div class="plot" id="plot-timeline">(.*?)</div>', dom.stdout, re.S)
    assert timeline and "step time per rank and step" in timeline.group(1)
    assert "rank 17 (compute, open at end)" in timeline.group(1)
    assert "rank 512 (network, open at end)" in timeline.group(1)
    assert timeline.group(1).count("<path") < 400  # one image, not a line per rank
    # the rank table shows the flagged ranks and folds the rest
    assert f"<summary>all {FLEET} ranks</summary>" in dom.stdout
    assert "1016 more hosts" in dom.stdout
    shot = tmp_path / "fleet.png"
    res = chromium(out.as_uri(), f"--screenshot={shot}", "--window-size=1200,2000")
    assert res.returncode == 0 and shot.stat().st_size > 60_000, res.stderr[-2000:]
    assert near(distinct_colours(shot), (214, 39, 40), tol=10)  # the network outline
