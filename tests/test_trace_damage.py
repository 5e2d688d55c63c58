"""Traces that check themselves: torn, truncated, corrupted and full-disk traces, no root.

Each case is one of the hardening issue's rows: before, a cut ``.zst`` replayed
as a clean run, a flipped byte gave a raw zstandard traceback, a torn write
followed by an append made the whole file unreadable, and a full disk ended
the daemon. Now each is a :class:`TraceError` naming file and frame (strict),
a count of what was skipped (lenient), or a writer that switches itself off.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

from fsdp_sentinel.trace import MARK_MAGIC, TraceError, TraceReader, TraceWriter, read_trace


def _zstd_frames(data: bytes) -> Iterator[tuple[int, int, bytes | None]]:
    """The test's own oracle of a file's frames: ``(offset, end, text)`` each,
    ``text`` None for one cut short; zstandard alone, not the reader's walk."""
    import zstandard

    pos = 0
    while pos < len(data):
        dobj = zstandard.ZstdDecompressor().decompressobj()
        text = dobj.decompress(data[pos:])
        if not dobj.eof:
            yield pos, len(data), None
            return
        end = len(data) - len(dobj.unused_data)
        yield pos, end, text
        pos = end


def step(i: int) -> dict:
    return {"kind": "step", "rank": 0, "step": i, "start": 1000.0 + i, "end": 1000.5 + i}


def write(path: Path, n: int = 60, per_frame: int = 3) -> list[bytes]:
    """A trace of ``n`` step records, a zstd frame every ``per_frame`` records."""
    now = [0.0]
    with TraceWriter(path, sync_interval=1.0, clock=lambda: now[0]) as w:
        for i in range(n):
            w.write(step(i))
            if i % per_frame == per_frame - 1:
                now[0] += 1.0  # the next write ends the frame
    return [text for _, _, text in _zstd_frames(path.read_bytes()) if text is not None]


def boundaries(path: Path) -> set[int]:
    return {end for _, end, _ in _zstd_frames(path.read_bytes())}


def test_every_frame_has_a_checksum_and_ends_after_a_whole_record(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.zst"
    frames = write(path)
    assert len(frames) > 15 and all(f.endswith(b"\n") for f in frames if f)
    data = path.read_bytes()
    # frame header descriptor byte: bit 2 is the content checksum flag (of
    # every data frame; the writer's marks are skippable frames, no content)
    offsets = [off for off, _, _ in _zstd_frames(data)]
    data_frames = [off for off in offsets if not data.startswith(MARK_MAGIC, off)]
    assert len(data_frames) == len(offsets) // 2
    assert all(data[off + 4] & 0x04 for off in data_frames)
    assert [r["step"] for r in read_trace(path) if r["kind"] == "step"] == list(range(60))


def test_a_trace_cut_inside_a_frame_fails_strict_and_lenient_says_so(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.zst"
    write(path)
    data = path.read_bytes()
    ends = boundaries(path)
    cut = tmp_path / "cut.jsonl.zst"
    passed_strict = 0
    for n in range(1, len(data), 5):
        cut.write_bytes(data[:n])
        try:
            steps = [r["step"] for r in read_trace(cut) if r["kind"] == "step"]
        except TraceError as e:
            assert "zstd frame" in str(e) and str(cut) in str(e) and "truncated" in str(e)
            reader = TraceReader(cut, strict=False)
            got = [r["step"] for r in reader if r["kind"] == "step"]
            assert got == list(range(len(got)))  # a clean prefix, nothing invented
            assert len(reader.damaged_frames) == 1
        else:
            # Only a cut exactly between frames reads as a (shorter) whole trace.
            assert n in ends, n
            assert steps == list(range(len(steps)))
            passed_strict += 1
    assert passed_strict <= len(ends)


def test_a_flipped_byte_is_a_trace_error_never_a_zstd_traceback(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.zst"
    write(path)
    data = path.read_bytes()
    whole = list(read_trace(path))
    flipped = tmp_path / "flip.jsonl.zst"
    # The writer's marks (skippable frames): a flip there only unmarks a frame,
    # which is then checked line by line and reads the same.
    # (Its first 8 bytes are the skippable frame's own magic and size: a flip
    # there breaks the zstd stream itself, caught like any other.)
    marks = [(off, end) for off, end, _ in _zstd_frames(data) if data.startswith(MARK_MAGIC, off)]
    in_mark = {p for off, end in marks for p in range(off + 8, end)}
    mark_heads = {p for off, _ in marks for p in range(off, off + 8)}
    assert in_mark
    harmless = 0
    for pos in range(0, len(data), 3):
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        flipped.write_bytes(bytes(bad))
        try:
            got_strict = list(read_trace(flipped))
        except TraceError as e:
            assert pos not in in_mark, pos
            assert str(flipped) in str(e) and "zstd frame" in str(e)
        else:
            # A byte no record depends on (a frame's window size, a mark): same records.
            assert got_strict == whole, pos
            harmless += pos not in in_mark and pos not in mark_heads
            continue
        reader = TraceReader(flipped, strict=False)
        got = [r["step"] for r in reader if r["kind"] == "step"]
        # Lenient loses the damaged frame (3 records) and keeps the others.
        assert len(got) >= 60 - 6 and got == sorted(got), pos
        assert reader.damaged_frames or reader.skipped
    assert harmless < len(data) // 3 // 10  # nearly every flip is caught


def test_a_torn_write_is_cut_off_when_the_file_is_reopened_for_append(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.zst"
    write(path, n=30)
    whole = path.read_bytes()
    with open(path, "ab") as fh:  # a writer killed half way through a frame
        other = tmp_path / "o.jsonl.zst"
        write(other, n=9, per_frame=9)
        (_, end, _), *_ = _zstd_frames(other.read_bytes())
        fh.write(other.read_bytes()[: end // 2])
    with TraceWriter(path) as w:
        assert w.repaired > 0
        w.write(step(30))
    steps = [r["step"] for r in read_trace(path) if r["kind"] == "step"]
    assert steps == list(range(31))
    assert path.read_bytes().startswith(whole)


def test_a_torn_jsonl_line_is_cut_off_too(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write(step(0))
    with open(path, "ab") as fh:
        fh.write(b'{"kind":"step","rank":0,"st')
    with TraceWriter(path) as w:
        w.write(step(1))
    assert [r["step"] for r in read_trace(path) if r["kind"] == "step"] == [0, 1]


def test_a_full_disk_switches_the_writer_off_and_nothing_raises(tmp_path: Path) -> None:
    w = TraceWriter("/dev/full", sync_interval=0.0)  # every write: ENOSPC
    for i in range(5):
        w.write(step(i))
    w.sync()
    w.close()
    assert w.failed is not None and w.failed.errno == errno.ENOSPC
    assert w.lost >= 5


def test_an_unencodable_record_is_counted_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write({"kind": "x", "t": float("inf")})
        w.write(step(0))
    assert w.unencodable == 1 and w.failed is None
    assert [r["kind"] for r in read_trace(path)] == ["header", "step"]


def test_a_torn_line_longer_than_the_tail_read_is_cut_off_whole(tmp_path: Path) -> None:
    # The tail is read backwards in 64 KiB pieces: a torn line of 200 KB spans several.
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write(step(0))
    whole = path.read_bytes()
    with open(path, "ab") as fh:
        fh.write(b'{"kind":"fault","note":"' + b"x" * 200_000)
    with TraceWriter(path) as w:
        assert w.repaired == 200_000 + len(b'{"kind":"fault","note":"')
    assert path.read_bytes() == whole
