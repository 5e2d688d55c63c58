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


def test_rows_in_rank_order_with_their_figures() -> None:
    text = render_text(SNAP, now=SNAP.t + 3)
    rows = [ln.split() for ln in lines(text) if ln.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert rows[0] == ["0", "41", "0.431", "0.120", "0.311", "52.4M", "51.0M", "2.21", "0", "ok"]
    assert rows[2] == ["2", "41", "2.380", "0.118", "2.262", "52.4M", "51.0M", "7.80", "12",
                       "flagged", "network"]  # fmt: skip
    assert rows[3][5:7] == ["-", "-"] and rows[3][-2:] == ["lost", "rank_lost"]
    assert "ranks 4/4" in text and "08:00:00 UTC" in text and "age 3s" in text
    assert "network 1" in text and "ingest dropped 2 (malformed 1)" in text


def test_a_network_verdict_says_host_or_link() -> None:
    from dataclasses import replace

    ranks = list(SNAP.ranks)
    i = next(i for i, r in enumerate(ranks) if r.rank == 2)
    ranks[i] = replace(ranks[i], scope="link", peer_rank=3)
    text = render_text(replace(SNAP, ranks=tuple(ranks)), width=200, now=SNAP.t + 3)
    row = next(ln.split() for ln in lines(text) if ln.split()[:1] == ["2"])
    assert row[-3:] == ["flagged", "net", "link>3"]  # check the path to rank 3
    ranks[i] = replace(ranks[i], scope="node", peer_rank=3)
    text = render_text(replace(SNAP, ranks=tuple(ranks)), width=200, now=SNAP.t + 3)
    row = next(ln.split() for ln in lines(text) if ln.split()[:1] == ["2"])
    assert row[-3:] == ["flagged", "net", "node"]
    assert max(len(ln) for ln in text.splitlines()) <= 80


def test_flagged_and_lost_rows_are_highlighted() -> None:
    group = render(SNAP)
    assert isinstance(group, Group)
    table = group.renderables[0]
    assert isinstance(table, Table)
    styles = [row.style for row in table.rows]  # rows are in rank order 0..3
    assert styles[0] is None and styles[1] is None
    assert styles[2] and "red" in str(styles[2])
    assert styles[3] and "magenta" in str(styles[3])


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
