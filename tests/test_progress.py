"""The progress line of ``replay`` and ``report``: what it says, and that only a terminal sees it."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

from fsdp_sentinel import synth
from fsdp_sentinel.progress import ProgressLine, counted, wanted
from fsdp_sentinel.trace import TraceWriter

ROOT = Path(__file__).resolve().parents[1]


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_line_gives_share_rate_and_eta() -> None:
    now = [100.0]
    pos = [0]
    out = Tty()
    bar = ProgressLine(1000, lambda: pos[0], stream=out, width=10, every=0.0, clock=lambda: now[0])
    now[0], pos[0] = 102.0, 250
    bar.update(500_000)  # a quarter in 2 s: 250k records/s, 6 s to go
    assert out.getvalue() == "\r[##........]  25%  500,000 records  250k/s  ETA 0:06"
    now[0], pos[0] = 108.0, 1000
    bar.close(2_000_000)
    assert out.getvalue().endswith("\r[##########] 100%  2,000,000 records  250k/s  ETA 0:00\n")


def test_counted_passes_items_through_and_checks_every_n() -> None:
    calls: list[int] = []

    class Bar:
        def update(self, n: int) -> None:
            calls.append(n)

        def close(self, n: int) -> None:
            calls.append(-n)

    assert list(counted(range(25), Bar(), check=10)) == list(range(25))  # type: ignore[arg-type]
    assert calls == [10, 20, -25]
    assert list(counted(range(3), None)) == [0, 1, 2]


def test_only_large_inputs_on_a_terminal() -> None:
    assert wanted(10 << 20, Tty())
    assert not wanted(10 << 20, io.StringIO())  # a pipe or a log
    assert not wanted(1 << 20, Tty())  # small: done before a bar would help


def big_trace(path: Path) -> Path:
    recs, _ = synth.generate(synth.Scenario(ranks=8, steps=400, n_coll=24))
    with TraceWriter(path) as w:
        for r in recs:
            w.write(r)
    assert path.stat().st_size >= 4 << 20
    return path


def test_replay_shows_progress_on_a_terminal_and_not_in_a_pipe(tmp_path: Path) -> None:
    trace = big_trace(tmp_path / "big.jsonl")
    cmd = [sys.executable, "-m", "fsdp_sentinel", "replay", str(trace)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    piped = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert piped.returncode == 0 and "records/s" not in piped.stderr and "ETA" not in piped.stderr
    # stderr a terminal (a pty): the line is drawn there, stdout unchanged
    master, slave = pty.openpty()
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=slave, env=env, timeout=120)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert res.returncode == 0
    assert b"100%" in seen and b"records" in seen and b"ETA" in seen
    assert res.stdout.decode() == piped.stdout
