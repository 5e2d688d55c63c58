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
