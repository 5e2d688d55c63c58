"""Checked frames: what a ``.zst`` trace's mark vouches for, and what it never can.

Our writer holds every record of a ``.zst`` trace to the format's schema as
it writes it and marks each frame whose records all passed (a skippable
frame naming the data frame's length and checksum, and the file's token from
its header); replay then parses such a frame without the per-record value
checks. These tests tamper with marked files the ways a file gets changed
(a flipped byte, an edit recompressed by zstd, an edited frame put back
behind its old mark, an unmarked frame from elsewhere) and check that no bad
value slips through: each is refused exactly as a file without marks is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zstandard

from fsdp_sentinel import synth
from fsdp_sentinel.replay import replay_paths
from fsdp_sentinel.trace import (
    MARK_MAGIC,
    TraceError,
    TraceReader,
    TraceWriter,
    encode,
    read_trace,
    validate,
)

TRACES = Path(__file__).parent / "traces"


def step(i: int) -> dict:
    return {"kind": "step", "rank": 0, "step": i, "start": 1000.0 + i, "end": 1000.5 + i}


def write(path: Path, n: int = 30, per_frame: int = 5) -> None:
    """``n`` step records, a frame every ``per_frame`` (a sync ends one)."""
    now = [0.0]
    with TraceWriter(path, sync_interval=1.0, clock=lambda: now[0]) as w:
        for i in range(n):
            w.write(step(i))
            if i % per_frame == per_frame - 1:
                now[0] += 1.0


def frames(data: bytes) -> list[tuple[int, int, bool]]:
    """(offset, end, is a mark) of every frame: zstandard's own walk, the oracle."""
    out = []
    pos = 0
    while pos < len(data):
        dobj = zstandard.ZstdDecompressor().decompressobj()
        dobj.decompress(data[pos:])
        end = len(data) - len(dobj.unused_data)
        out.append((pos, end, data.startswith(MARK_MAGIC, pos)))
        pos = end
    return out


def marked_frames(path: Path) -> int:
    """How many frames the reader took as vouched for (its batches with a token)."""
    from fsdp_sentinel.trace import _FrameLines

    def boom(*a: object) -> None:
        raise AssertionError(a)

    return sum(1 for _, token in _FrameLines(path, boom).batches() if token is not None)


def test_every_data_frame_of_our_writer_is_marked_and_reads_the_same_unmarked(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl.zst"
    write(path)
    fs = frames(path.read_bytes())
    data_frames = [f for f in fs if not f[2]]
    assert len(data_frames) == 6
    # Each data frame comes right after its mark.
    assert [f[2] for f in fs] == [True, False] * 6
    assert marked_frames(path) == 6
    fast = list(read_trace(path))
    slow = list(TraceReader(path, trust_marks=False))
    assert fast == slow and [r["step"] for r in fast[1:]] == list(range(30))


def _recompressed(path: Path, out: Path, edit: dict[int, bytes]) -> None:
    """``zstd -dc path | edit | zstd > out``: the text kept, lines replaced."""
    lines = b"".join(
        zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes()[o:e])
        for o, e, mark in frames(path.read_bytes())
        if not mark
    ).splitlines(keepends=True)
    for i, line in edit.items():
        lines[i] = line
    out.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(b"".join(lines)))


BAD = encode({"kind": "step", "rank": -7, "step": 3, "start": 1003.0, "end": 1003.5})


def test_an_edit_recompressed_by_zstd_keeps_the_header_text_but_loses_every_mark(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl.zst"
    write(path)
    out = tmp_path / "edited.jsonl.zst"
    _recompressed(path, out, {4: BAD})
    head = next(iter(read_trace(out)))
    assert "checked" in head  # the header's claim survived as text ...
    assert marked_frames(out) == 0  # ... but no frame is vouched for
    with pytest.raises(TraceError, match=r"edited\.jsonl\.zst:5: step field 'rank'"):
        list(read_trace(out))
    lenient = TraceReader(out, strict=False)
    assert [r["step"] for r in lenient if r["kind"] == "step"] == [i for i in range(30) if i != 3]
    assert lenient.skipped_lines == [5]


def test_an_edited_frame_put_back_behind_its_old_mark_is_checked_in_full(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.zst"
    write(path)
    data = path.read_bytes()
    fs = frames(data)
    off, end, _ = fs[1]  # the first data frame: header + steps 0-4
    text = zstandard.ZstdDecompressor().decompress(data[off:end])
    lines = text.splitlines(keepends=True)
    lines[4] = BAD  # step 3's line
    edited = zstandard.ZstdCompressor(write_checksum=True).compress(b"".join(lines))
    forged = tmp_path / "forged.jsonl.zst"
    forged.write_bytes(data[:off] + edited + data[end:])
    assert marked_frames(forged) == 5  # the other frames still vouched for
    with pytest.raises(TraceError, match=r"forged\.jsonl\.zst:5: step field 'rank'"):
        list(read_trace(forged))


def test_a_flipped_byte_in_a_marked_frame_is_caught_before_any_record_of_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl.zst"
    write(path)
    data = path.read_bytes()
    off, end, _ = frames(data)[5]  # the third data frame: steps 10-14
    caught = 0
    for pos in range(off + 6, end - 4):  # past the frame header, before the checksum
        bad = bytearray(data)
        bad[pos] ^= 0x10
        p = tmp_path / "flip.jsonl.zst"
        p.write_bytes(bytes(bad))
        try:
            recs = list(read_trace(p))
        except TraceError as e:
            assert "zstd frame" in str(e) or "field" in str(e) or "JSON" in str(e), e
            caught += 1
            continue
        assert recs == list(read_trace(path)), pos  # never a changed record
    assert caught >= (end - 4 - off - 6) * 0.9


def test_a_frame_with_a_bad_record_goes_out_unmarked_and_is_refused_as_always(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl.zst"
    now = [0.0]
    with TraceWriter(path, sync_interval=1.0, clock=lambda: now[0]) as w:
        for i in range(12):
            w.write(json.loads(BAD) if i == 7 else step(i))
            if i % 4 == 3:
                now[0] += 1.0
    assert w.unchecked == 1 and w.records == 13
    assert marked_frames(path) == 2  # frames of steps 0-3 and 8-11
    with pytest.raises(TraceError, match=r":9: step field 'rank'"):
        list(read_trace(path))
    lenient = TraceReader(path, strict=False)
    assert [r["step"] for r in lenient if r["kind"] == "step"] == [i for i in range(12) if i != 7]


def test_an_append_keeps_the_files_own_mark_and_an_unmarked_file_stays_unmarked(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl.zst"
    write(path, n=10)
    head = next(iter(read_trace(path)))
    with TraceWriter(path) as w:
        w.write(step(10))
    assert next(iter(read_trace(path))) == head
    assert marked_frames(path) == 3
    old = tmp_path / "old.jsonl.zst"  # written before marks existed: one plain frame
    text = b"".join(encode(r) for r in [{"kind": "header", "format": "fsdp-sentinel-trace",
                                         "version": 1}, step(0)])  # fmt: skip
    old.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(text))
    with TraceWriter(old) as w:
        w.write(step(1))
    assert marked_frames(old) == 0
    assert [r["step"] for r in read_trace(old) if r["kind"] == "step"] == [0, 1]


def test_a_forged_mark_in_the_header_vouches_for_nothing_without_its_frames(
    tmp_path: Path,
) -> None:
    # A header that claims a mark, frames that carry none (another producer).
    path = tmp_path / "claim.jsonl.zst"
    head = {"kind": "header", "format": "fsdp-sentinel-trace", "version": 1,
            "checked": {"schema": 1, "token": "00" * 16}}  # fmt: skip
    text = encode(head) + encode(step(0)) + BAD
    path.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(text))
    with pytest.raises(TraceError, match=r":3: step field 'rank'"):
        list(read_trace(path))


def test_the_daemons_own_records_pass_the_schema_so_its_frames_are_marked(
    tmp_path: Path,
) -> None:
    # Verdicts (as replay makes them, the daemon's own code path) over every
    # golden trace and a synthetic job of each cause, the clock record the
    # daemon writes, and an action record as the remediator makes it.
    verdicts = []
    for p in sorted(TRACES.glob("*.jsonl.zst")):
        verdicts += list(replay_paths([p]))
    for faults in (
        (synth.SlowNetwork(2, 2.5, 10, 30),),
        (synth.SlowLink(1, 2, 2.5, 10, 30),),
        (synth.Lost(1, 12),),
        (synth.Hang(1, 12),),
    ):
        recs, _ = synth.generate(synth.Scenario(ranks=4, steps=30, faults=faults))
        path = tmp_path / "synth.jsonl"
        with TraceWriter(path) as w:
            w.write_many(recs)
        verdicts += list(replay_paths([path]))
    causes = {v["cause"] for v in verdicts}
    assert {"compute", "network", "rank_lost", "hang"} <= causes
    own = [
        *verdicts,
        {"kind": "clock", "t": 1_700_000_000.5, "host": "node-1"},
        {"kind": "action", "t": 1_700_000_001.0, "host": "node-1", "dev": "eth0",
         "what": "prioritise", "state": "dry_run"},
    ]  # fmt: skip
    assert [validate(r) for r in own] == [None] * len(own)
    out = tmp_path / "own.jsonl.zst"
    with TraceWriter(out) as w:
        w.write_many(own)
    assert w.unchecked == 0 and marked_frames(out) >= 1
    assert list(read_trace(out))[1:] == json.loads(json.dumps(own))


def test_a_marked_frame_is_given_in_pieces_and_one_that_fails_to_parse_is_checked_from_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_sentinel.trace import _mark, header_token

    size = 4096
    monkeypatch.setattr(TraceReader, "PIECE_BYTES", size)
    path = tmp_path / "t.jsonl.zst"
    n = 5 + 400
    now = [0.0]
    with TraceWriter(path, sync_interval=1.0, clock=lambda: now[0]) as w:
        for i in range(n):  # a first frame (the header, steps 0-5: the sync), then the rest
            w.write(step(i))
            if i == 4:
                now[0] += 1.0
    sizes = [len(b) for b in TraceReader(path).batches()]
    assert sizes[0] == 7 and sum(sizes) == n + 1  # the first frame is checked: it has the header
    assert list(read_trace(path))[1:] == [step(i) for i in range(n)]
    data = path.read_bytes()
    fs = frames(data)
    assert [m for _, _, m in fs] == [True, False, True, False]
    (moff, _, _), (off, end, _) = fs[2], fs[3]
    lines = zstandard.ZstdDecompressor().decompress(data[off:end]).splitlines(keepends=True)
    # The vouched frame in pieces of whole lines: each (but the last) the
    # first that reach `size` bytes.
    assert len(sizes) > 4
    at = 0
    for k in sizes[1:-1]:
        held = sum(map(len, lines[at : at + k]))
        assert size <= held < size + len(lines[at + k - 1])
        at += k

    # The second frame behind a mark that holds (the file's token, the frame's
    # own length and checksum), with a line no JSON parser takes in its third
    # piece and a valid line with a bad value after it: what our writer cannot write.
    token = header_token(next(read_trace(path)))
    assert token is not None
    third = 7 + sizes[1] + sizes[2]  # the last line before the third piece, in the file
    bad_json, bad_value = third + 10, third + sizes[3] + 5  # line numbers in the file
    lines[bad_json - 8] = b'{"kind": "step", "rank": \n'
    lines[bad_value - 8] = BAD
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(b"".join(lines))
    forged = tmp_path / "forged.jsonl.zst"
    forged.write_bytes(data[:moff] + _mark(token, frame) + frame + data[end:])
    assert marked_frames(forged) == 2  # still vouched for: only the parse can tell

    lenient = TraceReader(forged, strict=False)
    recs = list(lenient)
    assert lenient.skipped_lines == [bad_json, bad_value]  # the rest checked line by line
    assert recs[1:] == [step(i) for i in range(n) if i + 2 not in (bad_json, bad_value)]
    given: list[dict] = []
    with pytest.raises(TraceError, match=rf"forged\.jsonl\.zst:{bad_json}: invalid JSON"):
        for b in TraceReader(forged).batches():
            given.extend(b)
    assert given[1:] == [step(i) for i in range(bad_json - 2)]  # what came before it


# A datagram's records as the ingest socket decodes them: floats that the two
# encoders write differently (exponents, small ones), text past ASCII, nesting.
DECODED_LINES = [
    b'{"kind":"coll","rank":1,"step":3,"seq":7,"op":"all_gather","bytes":147968,'
    b'"issue":1.733221234123456e+9,"end":1733221234.2,"group":"g\\u00e9","wait":1e-05}',
    b'{"kind":"step","rank":1,"step":3,"start":0.00001,"end":2.5,"extra":{"a":[1,null,true]}}',
    b'{"kind":"rank","t":1.0,"rank":1,"world_size":4,"host":"h\xc3\xa9","pid":12,'
    b'"addrs":["198.18.0.2"],"host_pid":4194000}',
]


def test_a_decoded_record_is_written_fast_and_reads_back_equal_in_marked_frames(
    tmp_path: Path,
) -> None:
    from fsdp_sentinel.trace import decode, encode_decoded

    recs = [decode(line) for line in DECODED_LINES]
    assert all(validate(r) is None for r in recs)
    for r in recs:  # the values of encode's text, whatever the bytes
        assert decode(encode_decoded(r)) == decode(encode(r)) == r
    path = tmp_path / "t.jsonl.zst"
    with TraceWriter(path) as w:
        for r in recs:
            w.write(r, decoded=True)
        assert w.unchecked == 0
    data = path.read_bytes()
    assert any(mark for _, _, mark in frames(data))  # vouched for, not checked again
    assert [r for r in read_trace(path) if r["kind"] != "header"] == recs
    assert [r for r in TraceReader(path) if r["kind"] != "header"] == recs


def test_a_record_orjson_refuses_goes_to_the_json_encoder() -> None:
    from fsdp_sentinel.trace import encode_decoded

    rec = {"kind": "step", "rank": 0, "step": 1, "start": 0.0, "end": 1.0, "big": 2**70}
    assert json.loads(encode_decoded(rec)) == rec  # written exactly, by json
