"""The short version of bench/trace_crash: 30 SIGKILL-and-reopen cycles.

A forked writer appends to a ``.zst`` trace and is killed at a random moment;
the file is reopened for append (the torn tail cut off) and read strict.
Every read must pass, earlier cycles keep every record, and what a crash
loses spans at most the sync interval (0.2 s here, so the cycles are short;
the 1,000-cycle run at the daemon's 1 s is in docs/reliability.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "trace_crash"


def test_30_kill_and_reopen_cycles_read_strict_and_lose_at_most_one_sync(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(BENCH), "--cycles", "30", "--lanes", "1", "--max-run", "0.6",
         "--sync", "0.2", "--cycles-per-file", "10", "--dir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(p.stdout)
    assert got["cycles"] == got["strict_reads_ok"] == 30 and got["failures_total"] == 0
    assert got["files"] == 3 and got["records_kept"] > 0
    assert got["lost_s_max"] <= 0.2 + 0.05
