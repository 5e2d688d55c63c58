"""``--trace-max-bytes`` / ``--trace-keep``: a trace cut into whole segments.

Each segment reads alone in strict mode, replay of the set gives back the
one stream (and the same verdicts), old segments go past ``keep``, a crash
then reopen goes on numbering after the highest segment, and a rotation that
fails switches the trace off without raising.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.synth import Scenario, SlowCompute, generate
from fsdp_sentinel.trace import merge_traces, read_trace
from fsdp_sentinel.trace_segments import SegmentedTraceWriter, segment_path, segments

CAP = 64 * 1024


def _job() -> list[dict]:
    recs, _ = generate(
        Scenario(ranks=4, steps=150, faults=(SlowCompute(rank=2, factor=3.0, start=20, end=150),))
    )
    return recs


def _verdicts(recs) -> list[dict]:  # type: ignore[no-untyped-def]
    pipe = Pipeline()
    return [v for rec in recs if rec.get("kind") != "header" for v in pipe.feed(rec)]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
def test_each_segment_reads_alone_and_the_set_replays_as_one(tmp_path: Path, suffix: str) -> None:
    recs = _job()
    path = tmp_path / f"run{suffix}"
    cap = CAP if suffix == ".jsonl" else 16 * 1024  # a .zst frame holds ~25 KiB
    with SegmentedTraceWriter(path, cap) as w:
        for rec in recs:
            w.write(rec)
    closed = segments(path)
    assert len(closed) >= 2 and w.rotations == len(closed)
    assert closed[0] == segment_path(path, 1) and closed[0].name == f"run.000001{suffix}"
    parts = [*closed, path]
    got: list[dict] = []
    for part in parts:
        one = list(read_trace(part, strict=True))  # each a whole trace, header first
        assert one[0]["kind"] == "header"
        assert part.stat().st_size <= cap + 64 * 1024  # a frame or a check past the cap at most
        got.extend(r for r in one if r["kind"] != "header")
    assert got == recs and w.records == len(recs) + len(parts)  # one header a segment
    merged = list(merge_traces(read_trace(p) for p in parts))
    assert _verdicts(merged) == _verdicts(recs) and any(
        v["state"] == "flagged" and v["rank"] == 2 for v in _verdicts(merged)
    )


def test_keep_removes_the_oldest_segments(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with SegmentedTraceWriter(path, CAP, keep=2) as w:
        for rec in _job():
            w.write(rec)
    closed = segments(path)
    assert len(closed) == 2 and w.removed == w.rotations - 2 > 0
    assert closed[-1] == segment_path(path, w.rotations)  # the newest kept


def test_a_crash_then_reopen_repairs_the_tail_and_numbers_on(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl.zst"
    recs = _job()
    w = SegmentedTraceWriter(path, 16 * 1024)
    for rec in recs[:6000]:
        w.write(rec)
    w.sync()
    n = w.rotations
    assert n >= 1
    # a crash mid-frame: half a frame at the end of the active file, no close()
    with open(path, "ab") as fh:
        fh.write(b"\x28\xb5\x2f\xfd" + b"\x00" * 37)
    w2 = SegmentedTraceWriter(path, 16 * 1024)
    for rec in recs[6000:]:
        w2.write(rec)
    w2.close()
    assert [int(p.name.split(".")[1]) for p in segments(path)] == list(
        range(1, n + 1 + w2.rotations)
    )
    got = [
        r
        for p in [*segments(path), path]
        for r in read_trace(p, strict=True)
        if r["kind"] != "header"
    ]
    assert got == recs


def test_a_failed_rotation_switches_the_trace_off_and_never_raises(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    segment_path(path, 1).mkdir()  # the rename target is a directory: EISDIR
    recs = _job()
    with SegmentedTraceWriter(path, CAP) as w:
        for rec in recs:
            w.write(rec)
    assert isinstance(w.failed, OSError) and w.rotations == 0
    assert w.lost > 0 and w.records + w.lost == len(recs) + 1  # + the header
    assert list(read_trace(path, strict=True))  # what was written reads


@pytest.mark.parametrize(
    "argv",
    [
        ["--trace-keep", "3"],
        ["--trace-out", "x.jsonl", "--trace-max-bytes", "12"],
        ["--trace-out", "x.jsonl", "--trace-max-bytes", "lots"],
        ["--trace-out", "x.jsonl", "--trace-max-bytes", "inf"],
        ["--trace-out", "x.jsonl", "--trace-max-bytes", "1M", "--trace-keep", "0"],
    ],
)
def test_bad_rotation_flags_exit_2_with_a_usage_line(argv: list[str], tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "fsdp_sentinel", "run", "--no-probes", "--metrics-addr", "off",
         "--socket", str(tmp_path / "s.sock"), *argv],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "usage:" in p.stderr
