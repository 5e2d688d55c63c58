"""The live table: width under 80 columns, content, highlighting, and ``top``."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
from daemon_support import run_command
from rich.console import Group
from rich.table import Table

from fsdp_sentinel.exporters.http import MetricsServer
from fsdp_sentinel.exporters.prometheus import build_registry
from fsdp_sentinel.live import fmt_rate, render, render_text
from fsdp_sentinel.snapshot import RankView, Snapshot


def rank(i: int, **kw: object) -> RankView:
    base: dict[str, object] = dict(
        rank=i,
        host=f"fss-h{i}",
        step=41,
        step_seconds=0.431,
        compute_seconds=0.120,
        wait_seconds=0.311,
        tx_rate=52.4e6,
        rx_rate=51.0e6,
        srtt_us=2210.0,
        retrans_total=0,
    )
    base.update(kw)
    return RankView(**base)  # type: ignore[arg-type]


SNAP = Snapshot(
    t=1_764_576_000.0,  # 2025-12-01 08:00:00 UTC
    world_size=4,
    ranks=(
        rank(
            2,
            step_seconds=2.380,
            compute_seconds=0.118,
            wait_seconds=2.262,
            srtt_us=7800.0,
            retrans_total=12,
            state="flagged",
            cause="network",
            score=3.4,
        ),  # fmt: skip
        rank(0),
        rank(1),
        rank(3, state="lost", cause="rank_lost", step=39, tx_rate=None, rx_rate=None),
    ),
    verdicts_total={"network": 1, "rank_lost": 1},
    ingest_dropped_total=2,
    ingest_malformed_total=1,
)

# The widest figures each column may have to hold.
WIDE = Snapshot(
    t=1_764_576_000.0,
    world_size=1024,
    ranks=tuple(
        rank(
            1000 + i,
            step=999_999,
            step_seconds=99.999,
            compute_seconds=99.999,
            wait_seconds=99.999,
            tx_rate=999.9e9,
            rx_rate=999.9e9,
            srtt_us=9_999_990.0,
            retrans_total=99_999,
            state="flagged",
            cause="rank_lost",
        )
        for i in range(3)
    ),
    verdicts_total={"compute": 100, "network": 100, "rank_lost": 100},
    ingest_dropped_total=10**9,
    ingest_malformed_total=10**9,
)


def lines(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.splitlines()]


@pytest.mark.parametrize("snap", [SNAP, WIDE, Snapshot()], ids=["job", "widest", "empty"])
def test_table_fits_in_80_columns_on_a_wide_terminal(snap: Snapshot) -> None:
    text = render_text(snap, width=200, now=snap.t + 5)
    assert max(len(ln) for ln in text.splitlines()) <= 80
    # and it is not cut short: every rank has its row
    for r in snap.ranks:
        assert any(ln.split()[:1] == [str(r.rank)] for ln in lines(text))


def test_rows_worst_first_with_their_figures() -> None:
    text = render_text(SNAP, now=SNAP.t + 3)
    rows = [ln.split() for ln in lines(text) if ln.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    # lost, then flagged, then the rest by wait (all equal here: rank order)
    assert [r[0] for r in rows] == ["3", "2", "0", "1"]
    assert rows[2] == ["0", "fss-h0", "41", "0.431", "0.120", "0.311", "52.4M", "51.0M", "2.21",
                       "0", "ok"]  # fmt: skip
    assert rows[1] == ["2", "fss-h2", "41", "2.380", "0.118", "2.262", "52.4M", "51.0M", "7.80",
                       "12", "network"]  # fmt: skip
    assert rows[0][6:8] == ["-", "-"] and rows[0][-1] == "lost"
    assert "4 ranks" in text and "08:00:00 UTC" in text and "age 3s" in text
    assert "network 1" in text and "ingest dropped 2 (malformed 1)" in text


def test_a_network_verdict_says_host_or_link() -> None:
    from dataclasses import replace

    ranks = list(SNAP.ranks)
    i = next(i for i, r in enumerate(ranks) if r.rank == 2)
    ranks[i] = replace(ranks[i], scope="link", peer_rank=3)
    text = render_text(replace(SNAP, ranks=tuple(ranks)), width=200, now=SNAP.t + 3)
    row = next(ln.split() for ln in lines(text) if ln.split()[:1] == ["2"])
    assert row[-1] == "link>3"  # check the path to rank 3
    ranks[i] = replace(ranks[i], scope="node", peer_rank=3)
    text = render_text(replace(SNAP, ranks=tuple(ranks)), width=200, now=SNAP.t + 3)
    row = next(ln.split() for ln in lines(text) if ln.split()[:1] == ["2"])
    assert row[-2:] == ["net", "node"]
    assert max(len(ln) for ln in text.splitlines()) <= 80
    wide = replace(ranks[i], scope="link", peer_rank=1023)
    text = render_text(replace(SNAP, ranks=(wide,)), width=200)
    assert "link>1023" in text and max(len(ln) for ln in text.splitlines()) <= 80


def test_flagged_and_lost_rows_are_highlighted() -> None:
    group = render(SNAP, sort="rank")
    assert isinstance(group, Group)
    table = group.renderables[1]
    assert isinstance(table, Table)
    styles = [row.style for row in table.rows]  # rows in rank order 0..3
    assert styles[0] is None and styles[1] is None
    assert styles[2] and "red" in str(styles[2])
    assert styles[3] and "magenta" in str(styles[3])


def fleet(n: int = 1024) -> Snapshot:
    """A 1,024-rank job on 128 hosts: two compute stragglers, one network, one lost."""
    ranks = []
    for i in range(n):
        kw: dict[str, object] = dict(host=f"gpu-node-{i // 8:04d}", job="llama-70b-run7",
                                     step_seconds=0.5 + (i % 7) * 0.001,
                                     wait_seconds=0.2 + (i % 11) * 0.01)  # fmt: skip
        if i in (17, 900):
            cost = {"rank_hours_per_hour": 170.7 if i == 17 else 12.3, "seconds_per_step": 0.1}
            kw |= dict(state="flagged", cause="compute", score=0.2, cost=cost, wait_seconds=0.0)
        elif i == 513:
            kw |= dict(state="flagged", cause="network", score=3.1,
                       cost={"rank_hours_per_hour": 40.0})  # fmt: skip
        elif i == 64:
            kw |= dict(state="lost", cause="rank_lost", cost={"rank_hours_per_hour": 1024.0})
        ranks.append(rank(i, **kw))
    return Snapshot(t=SNAP.t, world_size=n, ranks=tuple(ranks), verdicts_total={"compute": 2})


def test_a_thousand_ranks_worst_first_in_80_columns() -> None:
    snap = fleet()
    text = render_text(snap, width=200, now=snap.t + 1, top=10)
    out = lines(text)
    assert max(len(ln) for ln in out) <= 80, text
    summary = out[0]
    assert summary.startswith("llama-70b-r~  1024 ranks  p50 0.503s p99 0.506s  flagged 4: 64")
    assert summary.endswith("1247 rh/h") and len(summary) <= 79
    rows = [ln.split() for ln in out if ln.split()[:1] and ln.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["64", "17", "513", "900", *[r[0] for r in rows[4:]]]
    assert len(rows) == 10 and "... 1014 more ranks" in text
    # after the flagged ones: the ranks that waited least (wait 0.2 s: i % 11 == 0)
    assert all(int(r[0]) % 11 == 0 for r in rows[4:])
    assert rows[1][-2:] == ["compute", "171"] and rows[1][1] == "…de-0002"
    by_score = render_text(snap, top=4, sort="score")
    assert [ln.split()[0] for ln in lines(by_score) if ln.split()[:1] and ln.split()[0].isdigit()] == [
        "64", "513", "17", "900"]  # fmt: skip


def test_live_view_is_cut_to_the_terminal_so_it_redraws_in_place() -> None:
    from rich.console import Console

    from fsdp_sentinel.live import CHROME_LINES, fit_rows, run_live

    assert fit_rows(24) == 24 - CHROME_LINES and fit_rows(3) == 1
    for height in (12, 24, 50):
        text = render_text(fleet(), width=80, top=fit_rows(height), now=SNAP.t)
        assert len(text.splitlines()) <= height - 1, (height, text)
    # The real redraw loop, on a 24-line console, three frames: each frame fits.
    import io

    buf = io.StringIO()
    con = Console(file=buf, width=80, height=24, force_terminal=True, color_system=None)
    frames = iter(range(3))
    run_live(lambda: (fleet(), ""), interval=0.001, console=con,
             stop=lambda: next(frames, None) is None)  # fmt: skip
    assert "1024 ranks" in buf.getvalue()


def test_empty_snapshot_says_it_is_waiting() -> None:
    assert "waiting for ranks" in render_text(Snapshot())


@pytest.mark.parametrize(
    "bps,text",
    [
        (None, "-"),
        (0, "0"),
        (999, "999"),
        (1000, "1.0k"),
        (52.4e6, "52.4M"),
        (118e6, "118M"),
        (1.25e9, "1.2G"),
        (999.9e9, "1000G"),
    ],  # fmt: skip
)
def test_fmt_rate(bps: float | None, text: str) -> None:
    assert fmt_rate(bps) == text


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    srv = MetricsServer(("127.0.0.1", 0), build_registry(lambda: SNAP, process=False), lambda: SNAP)
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


def top(*argv: str) -> subprocess.CompletedProcess[str]:
    return run_command("top", *argv, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})


def test_top_once_shows_a_running_servers_snapshot(server: MetricsServer) -> None:
    res = top("--once", "--addr", f"127.0.0.1:{server.port}")
    assert res.returncode == 0, res.stderr
    assert "flagged" in res.stdout and "rank_lost" in res.stdout
    assert max(len(ln) for ln in res.stdout.splitlines()) <= 80


def test_top_once_unreachable_and_bad_flags() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on (bound, not listening)
        s.bind(("127.0.0.1", 0))
        res = top("--once", "--addr", f"127.0.0.1:{s.getsockname()[1]}")
    assert res.returncode == 1 and "cannot read" in res.stderr
    bad = top("--addr", "nonsense")
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
    bad = top("--interval", "x")
    assert bad.returncode == 2 and "usage:" in bad.stderr
    for argv in (("--top", "0"), ("--top", "x"), ("--sort", "nope")):
        bad = top(*argv)
        assert bad.returncode == 2 and "usage:" in bad.stderr, argv


def test_top_once_cuts_to_the_worst_n(server: MetricsServer) -> None:
    res = top("--once", "--top", "1", "--addr", f"127.0.0.1:{server.port}")
    assert res.returncode == 0, res.stderr
    rows = [ln.split() for ln in res.stdout.splitlines() if ln.split()[:1] in (["2"], ["3"])]
    assert [r[0] for r in rows] == ["3"] and "3 more ranks" in res.stdout
