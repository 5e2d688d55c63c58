"""Trace format v1: writer and reader, plain and .zst, strict and lenient, merge, fsync."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_sentinel.trace import (
    TraceError,
    TraceReader,
    TraceWriter,
    merge_traces,
    read_trace,
)

SUFFIXES = [".jsonl", ".jsonl.zst"]

STEP = {"kind": "step", "rank": 0, "step": 1, "start": 10.0, "end": 11.0}
COLL = {
    "kind": "coll",
    "rank": 0,
    "step": 1,
    "seq": 7,
    "op": "all_gather",
    "bytes": 4096,
    "issue": 10.1,
    "end": 10.2,
}


def write_lines(path: Path, lines: list[str]) -> None:
    """Write raw lines (plain, or one zstd frame) without going through TraceWriter."""
    data = "".join(lines).encode()
    if path.suffix == ".zst":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


def header_line() -> str:
    return '{"kind":"header","format":"fsdp-sentinel-trace","version":1}\n'


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_round_trip(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"t{suffix}"
    with TraceWriter(path) as w:
        w.write(STEP)
        w.write_many([COLL, {**COLL, "seq": 8, "extra": [1, 2]}])
    recs = list(read_trace(path))
    head = dict(recs[0])
    # A .zst file is checked as it is written, and says so (docs/trace-format.md).
    mark = head.pop("checked", None)
    assert head == {"kind": "header", "format": "fsdp-sentinel-trace", "version": 1}
    assert (mark is not None) == suffix.endswith(".zst")
    if mark is not None:
        assert mark["schema"] == 1 and len(bytes.fromhex(mark["token"])) == 16
    assert recs[1:] == [STEP, COLL, {**COLL, "seq": 8, "extra": [1, 2]}]


def test_zst_file_is_zstd(tmp_path: Path) -> None:
    import zstandard

    path = tmp_path / "t.jsonl.zst"
    with TraceWriter(path) as w:
        w.write(STEP)
    data = path.read_bytes()
    # A skippable frame (the writer's mark), then zstd data: any zstd reads it.
    body = 8 + int.from_bytes(data[4:8], "little")  # after the skippable frame
    assert data[:4] == b"\x5e\x2a\x4d\x18" and data[body : body + 4] == b"\x28\xb5\x2f\xfd"
    text = zstandard.ZstdDecompressor().decompressobj().decompress(data[body:])
    assert text.decode().splitlines()[1] == json.dumps(STEP, separators=(",", ":"))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_append_keeps_one_header(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"t{suffix}"
    with TraceWriter(path) as w:
        w.write(STEP)
    with TraceWriter(path) as w:
        w.write(COLL)
    kinds = [r["kind"] for r in read_trace(path)]
    assert kinds == ["header", "step", "coll"]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_strict_broken_json_names_file_and_line(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"bad{suffix}"
    write_lines(path, [header_line(), json.dumps(STEP) + "\n", '{"kind": "step", \n'])
    with pytest.raises(TraceError) as ei:
        list(read_trace(path))
    assert ei.value.line == 3
    assert ei.value.path == str(path)
    assert str(ei.value).startswith(f"{path}:3:")


def test_strict_missing_field_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    no_bytes = {k: v for k, v in COLL.items() if k != "bytes"}
    write_lines(path, [header_line(), json.dumps(STEP) + "\n", json.dumps(no_bytes) + "\n"])
    with pytest.raises(
        TraceError, match=r"bad\.jsonl:3: coll record missing required field\(s\): bytes"
    ):
        list(read_trace(path))


def test_strict_rejects_foreign_header(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    write_lines(path, ['{"kind":"header","format":"other","version":1}\n'])
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: not an fsdp-sentinel-trace header"):
        list(read_trace(path))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_lenient_skips_and_counts(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"bad{suffix}"
    lines = [
        header_line(),
        "not json\n",
        json.dumps(STEP) + "\n",
        "[1, 2]\n",
        json.dumps({"kind": "step", "rank": 0}) + "\n",
        json.dumps(COLL) + "\n",
    ]
    write_lines(path, lines)
    reader = TraceReader(path, strict=False)
    recs = list(reader)
    assert [r["kind"] for r in recs] == ["header", "step", "coll"]
    assert reader.skipped == 3
    assert reader.skipped_lines == [2, 4, 5]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_truncated_last_line(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"cut{suffix}"
    full = json.dumps(COLL)
    write_lines(path, [header_line(), json.dumps(STEP) + "\n", full[: len(full) // 2]])
    with pytest.raises(TraceError, match="truncated last line") as ei:
        list(read_trace(path))
    assert ei.value.line == 3
    reader = TraceReader(path, strict=False)
    assert [r["kind"] for r in reader] == ["header", "step"]
    assert reader.skipped == 1


def test_unknown_kinds_and_fields_pass_without_checks(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    odd = {"kind": "from_the_future", "whatever": 1}
    write_lines(
        path, [header_line(), json.dumps(odd) + "\n", json.dumps({**STEP, "new": 2}) + "\n"]
    )
    recs = list(read_trace(path))  # strict: unknown kind is not an error
    assert recs[1] == odd
    assert recs[2]["new"] == 2


def test_blank_lines_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_lines(path, [header_line(), "\n", json.dumps(STEP) + "\n", "  \n"])
    reader = TraceReader(path)
    assert [r["kind"] for r in reader] == ["header", "step"]
    assert reader.skipped == 0


def test_merge_orders_by_time_field_and_is_stable() -> None:
    a = [
        {"kind": "header", "format": "fsdp-sentinel-trace", "version": 1},
        {"kind": "coll", "issue": 0.0, "end": 1.0, "id": "a1"},
        {"kind": "step", "start": 0.0, "end": 3.0, "id": "a2"},
        {"kind": "netdev", "t": 5.0, "id": "a3"},
    ]
    b = [
        {"kind": "header", "format": "fsdp-sentinel-trace", "version": 1},
        {"kind": "flow", "t": 1.0, "id": "b1"},  # ties with a1: stream order wins
        {"kind": "coll", "issue": 1.5, "end": 2.0, "id": "b2"},
        {"kind": "rank", "t": 4.0, "id": "b3"},
    ]
    got = [r["id"] for r in merge_traces([a, b])]
    assert got == ["a1", "b1", "b2", "a2", "b3", "a3"]


def test_merge_single_stream_drops_header() -> None:
    recs: list[dict[str, Any]] = [
        {"kind": "header"},
        {"kind": "step", "end": 2.0},
        {"kind": "step", "end": 1.0},
    ]
    assert list(merge_traces([recs])) == recs[1:]  # one stream: file order kept


def test_merge_is_lazy() -> None:
    def endless(start: float) -> Iterator[dict[str, Any]]:
        t = start
        while True:
            yield {"kind": "flow", "t": t}
            t += 1.0

    merged = merge_traces([endless(0.0), endless(0.5)])
    first = [next(merged)["t"] for _ in range(4)]
    assert first == [0.0, 0.5, 1.0, 1.5]


def test_sync_interval_uses_injected_clock(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "t.jsonl"
    w = TraceWriter(path, sync_interval=1.0, clock=lambda: now[0])
    w.write(STEP)  # before the interval: still in the process's buffer
    assert path.read_bytes() == b""
    now[0] = 1.5
    w.write(COLL)  # past the interval: flushed to the file
    assert [r["kind"] for r in read_trace(path)] == ["header", "step", "coll"]
    w.close()


# A child that syncs a record, then writes another it never syncs, then waits to be killed.
CHILD = textwrap.dedent(
    """
    import sys, time
    from fsdp_sentinel.trace import TraceWriter
    w = TraceWriter(sys.argv[1], sync_interval=3600.0)
    w.write({"kind": "step", "rank": 0, "step": 1, "start": 1.0, "end": 2.0})
    w.sync()
    w.write({"kind": "step", "rank": 0, "step": 2, "start": 2.0, "end": 3.0})
    print("synced", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_synced_record_survives_sigkill(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"crash{suffix}"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "synced"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    recs = list(TraceReader(path, strict=False))
    assert recs[0]["kind"] == "header"
    assert recs[1]["step"] == 1  # the synced record is on disk


def test_wire_keys_find_the_same_fields(tmp_path: Path) -> None:
    """The hot paths look fields up with ``trace.KEY`` (see ``_wire_keys``).

    Correctness must never depend on the parser's key cache: a lookup with a
    KEY object finds the field whether or not it is the very object in the
    record (orjson's cache has collisions: ``seq`` and ``bytes`` evict each
    other, so one of them is a fresh string in every ``coll`` record). The key
    every record is dispatched on, ``kind``, is the parser's own object, which
    is what makes the reader's checks cheap.
    """
    from fsdp_sentinel.trace import KEY

    path = tmp_path / "t.jsonl.zst"
    with TraceWriter(path) as w:
        w.write(COLL)
        w.write(STEP)
    recs = [r for r in TraceReader(path) if r["kind"] != "header"]
    assert recs == [COLL, STEP]
    for rec in recs:
        assert {k: rec[KEY[k]] for k in rec} == rec
        assert next(iter(rec)) is KEY["kind"]
