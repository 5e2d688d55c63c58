"""A small in-suite fuzz of the decoder and the trace reader (hypothesis).

bench/fuzz runs 10^6 mutated inputs each (a mutational fuzzer; hypothesis
is too slow an example for that); here hypothesis draws a few thousand:
arbitrary bytes, JSON-shaped records of every kind with hostile values, and
damaged trace files. Nothing but a counted refusal or a ``TraceError`` may
come out, and every accepted record reads back identical through the
daemon's writer and strict replay.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_sentinel.ingest import ALL_REASONS, parse_datagram
from fsdp_sentinel.synth import Scenario, generate
from fsdp_sentinel.trace import REQUIRED, TraceError, TraceReader, TraceWriter, read_trace

FAST = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))

HOSTILE_NUMBERS = st.sampled_from(
    [math.inf, -math.inf, math.nan, 1e308, -1e308, 10**12, 2**63, -1, 0, 1.5, True, None]
)
HOSTILE_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\ud800", "\x00", "h" * 300, "", "a\nb"]),
)
VALUE = st.one_of(HOSTILE_NUMBERS, HOSTILE_TEXT, st.integers(), st.floats(), st.booleans())


@st.composite
def records(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(sorted(REQUIRED) + ["future_kind"]))
    fields = sorted(REQUIRED.get(kind, ("t",)))
    rec: dict = {"kind": kind}
    for name in fields:
        if draw(st.integers(0, 9)):  # now and then leave one out
            rec[name] = draw(VALUE if draw(st.booleans()) else st.integers(0, 100))
    return rec


def _encode(rec: dict) -> bytes:
    return json.dumps(rec, allow_nan=True).encode("utf-8", "surrogatepass")


def _round_trips(rec: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "t.jsonl.zst"
        with TraceWriter(p) as w:
            w.write(rec)
        assert [r for r in read_trace(p, strict=True) if r["kind"] != "header"] == [rec]


@FAST
@given(st.binary(max_size=300))
def test_any_bytes_are_a_record_or_a_counted_reason(data: bytes) -> None:
    rec, why = parse_datagram(data)
    assert (rec is None) != (why is None)
    assert why is None or why in ALL_REASONS


@FAST
@given(records())
def test_records_with_hostile_values_are_refused_or_round_trip(rec: dict) -> None:
    got, why = parse_datagram(_encode(rec))
    assert why is None or why in ALL_REASONS
    if got is not None:
        _round_trips(got)


def _seed_trace(suffix: str) -> bytes:
    recs, _ = generate(Scenario(ranks=2, steps=2))
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / f"s{suffix}"
        with TraceWriter(p, sync_interval=0.0) as w:
            for rec in recs[:10]:
                w.write(rec)
        return p.read_bytes()


SEEDS = {s: _seed_trace(s) for s in (".jsonl", ".jsonl.zst")}


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.sampled_from(sorted(SEEDS)),
    st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), max_size=4),
    st.integers(0, 4000),
)
def test_a_damaged_trace_is_a_trace_error_or_reads(suffix: str, flips, cut: int) -> None:  # type: ignore[no-untyped-def]
    data = bytearray(SEEDS[suffix])
    for at, byte in flips:
        if data:
            data[at % len(data)] = byte
    del data[len(data) - cut % (len(data) + 1) :]
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / f"f{suffix}"
        p.write_bytes(bytes(data))
        for strict in (True, False):
            try:
                for _ in TraceReader(p, strict=strict):
                    pass
            except TraceError:
                pass


def _cluster_blobs() -> list[bytes]:
    """Packed node windows of two shapes: steady ones (one digest of the same
    run of keys: the first, the third, and the last with flow rows and a
    probe time), and one with records, progress points, probe times, flow
    rows and keys that are not a run."""
    from fsdp_sentinel.cluster.flowrows import FlowRowsBuilder
    from fsdp_sentinel.cluster.summary import Window, digest_step, encode

    def rows(host: str, n: int) -> Any:
        b = FlowRowsBuilder()
        for i in range(n):
            b.add({"kind": "flow", "t": 12.0, "dt": 1.0, "host": host, "pid": 40 + i,
                   "src": f"198.18.0.{i}:1", "dst": "198.18.1.1:2", "tx_bytes": 1 << i,
                   "rx_bytes": 3, "srtt_us": 90 + i, "cwnd": 10})  # fmt: skip
        return b.take()

    def colls(rank: int, keys: list) -> list[dict]:
        out = []
        for i, k in enumerate(keys):
            rec = {"kind": "coll", "rank": rank, "step": 2, "op": "all_gather", "bytes": 8,
                   "issue": 10.0 + i + rank / 100, "end": 10.5 + i}  # fmt: skip
            if isinstance(k, tuple):
                rec["group"], rec["seq"] = k
            else:
                rec["seq"] = k
            out.append(rec)
        return out

    steps = {r: {"start": 9.0, "end": 14.0 + r} for r in range(3)}
    run = digest_step(2, {r: colls(r, [5, 6, 7]) for r in range(3)}, steps)
    odd = digest_step(2, {r: colls(r, [("dp", 1), ("tp", 4)]) for r in range(3, 5)})
    flow = {"kind": "flow", "t": 12.0, "dt": 1.0, "src": "198.18.0.1:1", "dst": "198.18.0.2:2"}
    again = digest_step(2, {r: colls(r, [5, 6, 7]) for r in range(5, 7)}, {5: steps[0]})
    more = digest_step(2, {r: colls(r, [5, 6, 7]) for r in range(7, 9)})
    return [
        encode(Window("n0", 3, 12.5, (), (run,), (), ())),
        encode(
            Window(
                "n1",
                3,
                12.5,
                (flow,),
                (odd,),
                ((3, 12.0, 2, 4),),
                (("h1", 12.0, 1.0),),
                rows("h1", 2),
            )
        ),  # fmt: skip
        encode(Window("node2", 4, 12.75, (), (again,), (), ())),
        encode(Window("n3", 4, 12.75, (), (more,), (), (("h3", 12.0, 1.0),), rows("h3", 3))),
    ]


CLUSTER_BLOBS = _cluster_blobs()
STEADY_BLOBS = [CLUSTER_BLOBS[0], CLUSTER_BLOBS[2], CLUSTER_BLOBS[3]]


@st.composite
def damaged_blobs(draw: st.DrawFn, sources: list[bytes] = CLUSTER_BLOBS) -> bytes:
    blob = bytearray(draw(st.sampled_from(sources)))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.integers(0, 3))
        at = draw(st.integers(0, len(blob)))
        if how == 0 and at < len(blob):
            blob[at] = draw(st.integers(0, 255))
        elif how == 1:
            del blob[at : at + draw(st.integers(1, 16))]
        elif how == 2:
            blob[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:  # a field's bytes made an extreme value
            blob[at : at + 8] = draw(st.sampled_from([b"\xff" * 8, b"\x00" * 8, b"\x7f" * 8]))
    return bytes(blob)


@FAST
@given(damaged_blobs())
def test_a_damaged_cluster_window_is_refused_alike_by_both_readers(blob: bytes) -> None:
    """The leader reads a round at once (``decode_round``); one window alone is
    read by ``decode``. A damaged window is a ValueError to the one and left
    out, counted, by the other (the good windows beside it still read), and
    nothing else comes out of either."""
    from fsdp_sentinel.cluster.summary import decode, decode_round

    try:
        decode(blob)
        alone_ok = True
    except ValueError:
        alone_ok = False
    rnd = decode_round([CLUSTER_BLOBS[0], blob, CLUSTER_BLOBS[1]])
    assert rnd.bad == (0 if alone_ok else 1)
    assert len(rnd.windows) == (3 if alone_ok else 2)


def _round_text(rnd: Any) -> str:
    """A decoded round as comparable text (NaN equal to NaN; columns as lists).
    A joined digest's ``extremes`` (an optional array of its groups' extremes)
    is held to its groups' own, not compared."""
    cols = {}
    for s, d in rnd.steps.items():
        if d.extremes is not None:
            own = [[list(g.longest), list(g.shortest)] for g in d.groups]
            assert repr(d.extremes.tolist()) == repr(own)
        cols[s] = tuple(f if isinstance(f, (int, tuple)) else list(f) for f in d[:-1])
    f = rnd.flows
    flows = (f.rows.tobytes(), f.strings.tolist(), f.window.tolist())
    return repr((rnd.windows, cols, rnd.bad, flows))


@FAST
@given(damaged_blobs(STEADY_BLOBS))
def test_a_steady_round_read_at_once_is_every_window_read_alone(blob: bytes) -> None:
    """A steady round (every window one digest of the same run of keys, beside
    JSON and flow rows or not) is read for every node at once
    (``summary._uniform_round``); with any one of its blobs damaged or not,
    it reads as window by window."""
    from fsdp_sentinel.cluster import summary

    blobs = [STEADY_BLOBS[0], blob, STEADY_BLOBS[1], STEADY_BLOBS[2]]
    if blob in STEADY_BLOBS:
        assert summary._uniform_round(blobs) is not None  # read at once
    assert _round_text(summary.decode_round(blobs)) == _round_text(summary._round_of_windows(blobs))
