"""Flow records as rows: packed by a node, read back, filed by the leader as records are.

A node packs the probes' flow records as fixed-width rows (``cluster.flowrows``)
and the leader files a round's rows without a dict (``FlowLine``,
``LeaderPipeline.file_flow_rows``, ``Correlator.add_flow_rows``). These tests
hold it to the records: a row reads back as its record, a damaged row costs
its window alone, and a leader fed rows says and keeps exactly what a leader
fed the same flows as records (after each window's other records) does, on
every golden capture and on streams built to leave the fast path (ticks
inside a round, the stream guard, unattributed flows, a full host table).
"""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sentinel import trace
from fsdp_sentinel.cluster import summary as CS
from fsdp_sentinel.cluster.flowrows import (
    NO_FLOWS,
    ROW,
    FlowRows,
    FlowRowsBuilder,
    cwnd_values,
    flow_table,
    plain,
    srtt_values,
)
from fsdp_sentinel.cluster.leader import FlowLine, LeaderDetector, LeaderPipeline
from fsdp_sentinel.cluster.node import NodeWindows
from fsdp_sentinel.cluster.split import run_split
from fsdp_sentinel.correlate import StateLimits
from fsdp_sentinel.synth import Scenario, SlowLink, generate

Record = dict[str, Any]
TRACES = Path(__file__).parent / "traces"
GOLDEN = sorted(TRACES.glob("*.jsonl*"))


def _probe_flow(i: int, t: float = 10.0) -> Record:
    """A flow record as probes/records.py writes it (int srtt, snd_wnd)."""
    rec: Record = {
        "kind": "flow", "t": t, "dt": 1.0, "host": "h0", "pid": 4000 + i,
        "src": f"198.18.0.1:{40000 + i}", "dst": "198.18.0.2:29500",
        "tx_bytes": 1 << 20, "rx_bytes": 512, "retrans": i % 3,
    }  # fmt: skip
    if i % 2:
        rec["dsack_dups"] = 1
    rec["srtt_us"] = 180 + i
    rec["cwnd"] = 10
    rec["snd_wnd"] = 65535
    return rec


def _without_snd_wnd(rec: Record) -> Record:
    return {k: v for k, v in rec.items() if k != "snd_wnd"}


def test_the_probes_flow_records_are_plain_and_read_back_as_filed() -> None:
    recs = [_probe_flow(i) for i in range(5)]
    assert all(map(plain, recs))
    b = FlowRowsBuilder()
    for r in recs:
        b.add(r)
    rows = b.take()
    assert rows.n_rows == 5 and len(rows.rows) == 5 * ROW.itemsize
    # each string listed once
    assert sorted(rows.strings) == sorted({"h0", "198.18.0.2:29500", *(r["src"] for r in recs)})
    table = flow_table([rows])
    back = [table.record(i) for i in range(len(table))]
    assert back == [_without_snd_wnd(r) for r in recs]
    assert type(back[0]["srtt_us"]) is int
    assert b.take() == NO_FLOWS  # taken: the next window starts empty


@pytest.mark.parametrize(
    "change",
    [
        {"t": 10},  # an int time: comes back a float, so it travels as JSON
        {"t": math.nan},
        {"dt": math.inf},
        {"pid": True},
        {"tx_bytes": 1 << 63},
        {"rx_bytes": "7"},
        {"host": None},
        {"srtt_us": None},
        {"srtt_us": math.inf},
        {"srtt_us": (1 << 53) + 1},
        {"cwnd": 1.5},
        {"cwnd": (1 << 53) + 1},  # the leader's flow store keeps a cwnd as a float
        {"rank": 3},  # a correlated record names its ranks: JSON
        {"peer_rank": 4},
        {"extra": 1},
    ],
)
def test_what_a_row_cannot_carry_travels_as_a_record(change: Record) -> None:
    assert plain(_probe_flow(1))
    assert not plain({**_probe_flow(1), **change})
    missing = _probe_flow(1)
    del missing["tx_bytes"]
    assert not plain(missing)


_text = st.text(min_size=0, max_size=12)
_i64 = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
_finite = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def _plain_flows(draw: Any) -> Record:
    rec: Record = {
        "kind": "flow", "t": draw(_finite), "dt": draw(_finite), "host": draw(_text),
        "pid": draw(_i64), "src": draw(_text), "dst": draw(_text), "tx_bytes": draw(_i64),
        "rx_bytes": draw(_i64),
    }  # fmt: skip
    for key in ("retrans", "dsack_dups"):
        if draw(st.booleans()):
            rec[key] = draw(_i64)
    if draw(st.booleans()):
        rec["cwnd"] = draw(st.integers(min_value=-(1 << 53), max_value=1 << 53))
    srtt = draw(st.none() | _finite | st.integers(min_value=-(1 << 53), max_value=1 << 53))
    if srtt is not None:
        rec["srtt_us"] = srtt
    return rec


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_plain_flows(), max_size=6), min_size=1, max_size=4))
def test_rows_read_back_as_their_records_through_the_wire(windows: list[list[Record]]) -> None:
    blobs = []
    for i, recs in enumerate(windows):
        assert all(map(plain, recs))
        b = FlowRowsBuilder()
        for r in recs:
            b.add(r)
        blobs.append(CS.encode(CS.Window(f"n{i}", 0, 1.0, (), (), (), (), b.take())))
    rnd = CS.decode_round(blobs)
    assert rnd.bad == 0
    got = [rnd.flows.record(i) for i in range(len(rnd.flows))]
    want = [r for recs in windows for r in recs]
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    # the figures the leader files, for every row at once: the same values, types too
    srtt = [r.get("srtt_us") for r in want]
    assert json.dumps(srtt_values(rnd.flows.rows)) == json.dumps(srtt)
    assert json.dumps(cwnd_values(rnd.flows.rows)) == json.dumps([r.get("cwnd") for r in want])
    # which window each row came from
    assert rnd.flows.window.tolist() == [i for i, recs in enumerate(windows) for _ in recs]


def _blob_with_rows(node: str, recs: list[Record]) -> bytes:
    b = FlowRowsBuilder()
    for r in recs:
        b.add(r)
    return CS.encode(CS.Window(node, 0, 1.0, (), (), (), (("h0", 10.0, 1.0),), b.take()))


def _row_at(blob: bytes, i: int) -> int:
    _, n_json, n_node, *_ = CS._HEAD.unpack_from(blob)
    return CS._HEAD.size + n_node + n_json + i * ROW.itemsize


@pytest.mark.parametrize(
    "field, value",
    [
        ("t", struct.pack("<d", math.nan)),
        ("dt", struct.pack("<d", math.inf)),
        ("srtt", struct.pack("<d", math.nan)),  # the row has an srtt
        ("srtt", struct.pack("<d", 2.0**60)),  # an int srtt past 2**53
        ("host", struct.pack("<I", 99)),  # not among its window's strings
        ("src", struct.pack("<I", 1 << 31)),
        ("form", bytes([64])),
    ],
)
def test_a_damaged_row_costs_its_window_alone(field: str, value: bytes) -> None:
    good = [_blob_with_rows(f"n{i}", [_probe_flow(i), _probe_flow(i + 10)]) for i in range(3)]
    bad = bytearray(good[1])
    assert ROW.fields is not None
    at = _row_at(good[1], 1) + ROW.fields[field][1]
    bad[at : at + len(value)] = value
    rnd = CS.decode_round([good[0], bytes(bad), good[2]])
    assert rnd.bad == 1 and [w.node for w in rnd.windows] == ["n0", "n2"]
    assert len(rnd.flows) == 4
    with pytest.raises(ValueError):
        CS.decode(bytes(bad))


def test_rows_cut_short_or_strings_of_another_type_are_not_a_window() -> None:
    blob = _blob_with_rows("n0", [_probe_flow(1)])
    with pytest.raises(ValueError):
        CS.decode(blob[:-3])  # the head counts a row the blob has not
    with pytest.raises(ValueError):
        flow_table([FlowRows(("h0", 5), b"\0" * ROW.itemsize)])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        flow_table([FlowRows(("h0",), b"\0" * (ROW.itemsize - 1))])


# ------------------------------------------------ the leader: rows as records


class RecordsLeader(LeaderDetector):
    """A leader handed each window's flow rows as records, after its others."""

    def ingest(self, windows: Any) -> list[Record]:
        out = []
        for w in windows:
            table = flow_table([w.flows])
            more = tuple(table.record(i) for i in range(len(table)))
            out.append(w._replace(records=w.records + more, flows=NO_FLOWS))
        return super().ingest(out)


def _state(det: LeaderDetector) -> str:
    p = det.pipeline
    c = p.corr
    pairs = [
        (k, pf.tx_total, pf.rx_total, pf.retrans_total, pf.dsack_total, list(pf.samples),
         pf.last_t, pf.srtt_us, pf.tx_rate, pf.loopback)
        for k, pf in sorted(c.pairs.items())
    ]  # fmt: skip
    return json.dumps(
        [p.stats, p.records_total, p.now, pairs, sorted(c.hosts_heard.items()),
         c.unattributed_flows, c.evicted, c.flow_dt, [list(f) for f in c.flow_matrix(p.now)]],
        sort_keys=True, default=str,
    )  # fmt: skip


def _same_as_records(recs: list[Record], interval_s: float = 0.5, **kw: Any) -> list[Record]:
    rows = LeaderDetector(**kw)
    said = run_split(recs, interval_s, leader=rows)
    records = RecordsLeader(**kw)
    assert run_split(recs, interval_s, leader=records, wire=False) == said
    assert _state(rows) == _state(records)
    assert rows.pipeline.records_total.get("flow", 0) > 0
    return said


#: The captures with flow records (a few hook-only ones have none).
WITH_FLOWS = [p for p in GOLDEN if any(r.get("kind") == "flow" for r in trace.read_trace(p))]


@pytest.mark.parametrize("path", WITH_FLOWS, ids=lambda p: p.name.split(".")[0])
def test_a_leader_fed_rows_does_what_one_fed_records_does(path: Path) -> None:
    _same_as_records([r for r in trace.read_trace(path) if r.get("kind") != "header"])


def _slow_link_job(seed: int) -> list[Record]:
    scn = Scenario(
        ranks=8, steps=30, seed=seed, ranks_per_host=2, faults=(SlowLink(2, 3, 3.0, 5, 15),)
    )
    recs, _truth = generate(scn)
    return [r for r in recs if r.get("kind") != "header"]


@pytest.mark.parametrize("seed", [1, 2])
def test_rows_through_ticks_the_guard_and_strangers(seed: int) -> None:
    rng = random.Random(seed)
    recs = _slow_link_job(seed)
    flows = [r for r in recs if r.get("kind") == "flow"]
    assert flows
    more = []
    for r in rng.sample(flows, k=min(40, len(flows))):
        kind = rng.randrange(4)
        if kind == 0:  # far ahead of the stream: the guard holds it
            more.append({**r, "t": r["t"] + 500.0})
        elif kind == 1:  # a process no rank announced: not attributed
            more.append({**r, "pid": 999_999, "src": "198.19.9.9:1", "dst": "198.19.9.8:2"})
        elif kind == 2:  # at the very time of another record (a tie on the time line)
            other = rng.choice(recs).get("t")
            more.append({**r, "t": float(other) if isinstance(other, float) else r["t"]})
        else:  # on a whole second
            more.append({**r, "t": math.floor(r["t"]) + 0.0})
    mixed = sorted(recs + more, key=trace.record_time)
    _same_as_records(mixed, interval_s=rng.choice([0.25, 1.0, 3.0]))
    # a host table too small for the job's hosts: each sample of a new one counted
    _same_as_records(mixed, limits=StateLimits(max_hosts=1))


def _primed() -> LeaderPipeline:
    """A leader's pipeline that knows ranks 0-3 (pid 4000 + r, 198.18.0.r) and
    whose clock stands at 100 s, its first tick set."""
    p = LeaderPipeline()
    for r in range(4):
        p.feed({"kind": "rank", "t": 99.0, "rank": r, "world_size": 4, "host": f"h{r}",
                "pid": 4000 + r, "addrs": [f"198.18.0.{r}"]})  # fmt: skip
    p.feed({"kind": "clock", "t": 100.0})
    return p


def test_rows_stop_at_the_tick_and_the_guards_horizon_as_records_do() -> None:
    # A row at the very time of the next tick, and rows past the guard's
    # horizon: fed as their records, in turn (a tick runs after the flow
    # that reaches it is filed; what runs ahead is held aside).
    rows, records = _primed(), _primed()
    tick, horizon = rows._next_tick, rows._horizon
    assert 100.0 < tick < horizon < math.inf
    # the last: host h3 in step again, while its row ahead is held (the guard
    # is active: every row goes through it, which refuses the one held)
    times = [100.2, tick - 1e-9, tick, tick, tick + 0.1, horizon, horizon + 1e-6, horizon + 9.0,
             horizon + 0.1]  # fmt: skip
    recs = []
    for i, t in enumerate(times):
        r, peer = (i % 4, (i + 1) % 4) if i < 8 else (3, 0)
        rec = {"kind": "flow", "t": t, "dt": 1.0, "host": f"h{r}", "pid": 4000 + r,
               "src": f"198.18.0.{r}:4000{r}", "dst": f"198.18.0.{peer}:29500",
               "tx_bytes": 1000 + i, "rx_bytes": 10, "srtt_us": 100 + i}  # fmt: skip
        recs.append(rec)
    assert rows.stats["malformed"] == 0
    # up to the tick and just past; on to the guard; h3 (the next round)
    for lo, hi in ((0, 5), (5, 8), (8, 9)):
        b = FlowRowsBuilder()
        for rec in recs[lo:hi]:
            b.add(rec)
        said = rows.file_flow_rows(FlowLine(flow_table([b.take()])), 0, hi - lo)
        assert said == [v for rec in recs[lo:hi] for v in records.feed(rec)]
        # the tick ran when the records ran it: at the row at its time
        assert rows._next_tick == records._next_tick
        assert rows.stats == records.stats
    assert rows.stats["ticks"] == 3 and rows.stats["refused_clock_ahead"] == 1
    assert len(rows.lcorr.pairs) == 4
    for p in (rows, records):
        p.end()
    det = [LeaderDetector(), LeaderDetector()]
    for d, p in zip(det, (rows, records), strict=True):
        d.pipeline, d.corr = p, p.lcorr
    assert _state(det[0]) == _state(det[1])


def test_a_window_kept_back_for_the_store_keeps_its_flows() -> None:
    # A window the store refused goes with the next (agent._joined): both
    # windows' rows, in order, each naming its own strings.
    from fsdp_sentinel.cluster.agent import _joined

    def window(seq: int, recs: list[Record]) -> CS.Window:
        b = FlowRowsBuilder()
        for r in recs:
            b.add(r)
        return CS.Window("n0", seq, float(seq), (), (), (), (), b.take())

    first = [_probe_flow(i, 10.0) for i in range(3)]
    second = [{**_probe_flow(i + 7, 11.0), "host": "h9"} for i in range(2)]
    both = _joined(window(0, first), window(1, second))
    rnd = CS.decode_round([CS.encode(both)])
    got = [rnd.flows.record(i) for i in range(len(rnd.flows))]
    assert got == [_without_snd_wnd(r) for r in first + second]
    assert _joined(window(0, first), window(1, [])).flows == window(0, first).flows
    assert _joined(window(0, []), window(1, second)).flows == window(1, second).flows


# ------------------------------------------------ the leader: a round's rows held as one run


def _ticks_seen(det: LeaderDetector) -> list[Any]:
    """Each tick and step summary of ``det``'s pipeline, with the flow state it
    met: when, samples filed, flows not attributed, the hosts heard."""
    seen: list[Any] = []
    p, c = det.pipeline, det.pipeline.corr

    def log(name: str, fn: Any) -> Any:
        def run(*a: Any) -> Any:
            seen.append((name, p.now, c.flows.filed, c.unattributed_flows,
                         sorted(c.hosts_heard.items())))  # fmt: skip
            return fn(*a)

        return run

    p._advance = log("tick", p._advance)  # type: ignore[method-assign]
    p._on_step = log("step", p._on_step)  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_held_rows_meet_every_tick_and_step_as_records_do(seed: int) -> None:
    # A round's rows are held and filed as one run while the items between
    # them are quiet (LeaderPipeline.quiet): every tick and step summary must
    # still find the flow state the records, fed in turn, leave it.
    rng = random.Random(seed)
    recs = _slow_link_job(seed)
    flows = [r for r in recs if r.get("kind") == "flow"]
    strangers = [{**r, "pid": 999_999, "src": "198.19.9.9:1", "dst": "198.19.9.8:2"}
                 for r in rng.sample(flows, k=10)]  # fmt: skip
    mixed = sorted(recs + strangers, key=trace.record_time)
    for interval_s in (0.25, 1.0, 3.0):
        rows, records = LeaderDetector(), RecordsLeader()
        a, b = _ticks_seen(rows), _ticks_seen(records)
        assert run_split(mixed, interval_s, leader=rows) == run_split(
            mixed, interval_s, leader=records, wire=False
        )
        assert a == b and len(a) > 20
        assert _state(rows) == _state(records)


def _window(node: str, t: float, heard: tuple[Any, ...], flows: list[Record] = (),  # type: ignore[assignment]
            records: tuple[Record, ...] = ()) -> CS.Window:  # fmt: skip
    b = FlowRowsBuilder()
    for rec in flows:
        b.add(rec)
    return CS.Window(node, 1, t, records, (), (), heard, b.take())


def test_a_heard_host_after_its_held_rows_is_noted_after_them() -> None:
    # Node n0's rows of host h0 (t 5.0, dt 1.0), then node n1's word that
    # h0 was heard at the same time with another interval: fed in turn, the
    # rows note h0 first and the tie keeps their interval. A held run must
    # not let the heard entry go first.
    ranks = tuple({"kind": "rank", "t": 4.9, "rank": r, "world_size": 2, "host": f"h{r}",
                   "pid": 4000 + r, "addrs": [f"198.18.0.{r}"]} for r in range(2))  # fmt: skip
    flow = {"kind": "flow", "t": 5.0, "dt": 1.0, "host": "h0", "pid": 4000,
            "src": "198.18.0.0:40000", "dst": "198.18.0.1:29500", "tx_bytes": 10,
            "rx_bytes": 0}  # fmt: skip
    said = []
    for det in (LeaderDetector(), RecordsLeader()):
        det.ingest([_window("n0", 4.9, (("h0", 4.9, 1.0), ("h1", 4.9, 1.0)), records=ranks)])
        assert det.pipeline._next_tick > 5.0  # the round's rows come before a tick
        det.ingest([_window("n0", 5.5, (), [flow]), _window("n1", 5.5, (("h0", 5.0, 2.0),))])
        said.append(det.pipeline.corr.hosts_heard["h0"])
    assert said[0] == said[1] == [5.0, 1.0]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["h0", "h1", "h2", "h3"]), st.sampled_from([4.0, 5.0, 5.5]),
                  st.sampled_from([0.5, 1.0, 2.0]), st.integers(0, 1)),
        min_size=1, max_size=24,
    ),
    st.lists(st.tuples(st.sampled_from(["h0", "h2", "h9"]), st.sampled_from([3.0, 5.0, 6.0])),
             max_size=3),
    st.data(),
)  # fmt: skip
def test_a_runs_newest_row_a_host_leaves_what_noting_every_row_leaves(
    rows: list[tuple[str, float, float, int]], before: list[tuple[str, float]], data: Any
) -> None:
    # Rows of a few hosts over two windows (one host has an index in each),
    # times and intervals tied on purpose; the hosts already heard before.
    # Noting the run's rows one by one (as records) and noting only each
    # host's newest_by_host entry leave the same table, its order included.
    windows = [FlowRowsBuilder(), FlowRowsBuilder()]
    for i, (host, t, dt, w) in enumerate(rows):
        windows[w].add({"kind": "flow", "t": t, "dt": dt, "host": host, "pid": i,
                        "src": "198.18.0.1:1", "dst": "198.18.0.2:2", "tx_bytes": 1,
                        "rx_bytes": 0})  # fmt: skip
    line = FlowLine(flow_table([b.take() for b in windows]))
    k = data.draw(st.integers(0, len(line) - 1))
    end = data.draw(st.integers(k + 1, len(line)))
    one_by_one, newest = LeaderPipeline().corr, LeaderPipeline().corr
    for c in (one_by_one, newest):
        for host, t in before:
            c.heard_host_at(host, t, 1.0)
    for j in range(k, end):
        one_by_one.heard_host_at(line.hosts[j], line.t[j], line.dt[j])
    got = line.newest_by_host(k, end)
    assert len({h for h, _t, _dt in got}) == len(got)
    for host, t, dt in got:
        newest.heard_host_at(host, t, dt)
    assert list(newest.hosts_heard.items()) == list(one_by_one.hosts_heard.items())


class _KeysSeen(LeaderDetector):
    """A leader that notes, each round, whether its flow line took the round
    before's keys (FlowLine's ``last``)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.reused: list[bool] = []

    def ingest(self, windows: Any) -> list[Record]:
        before = self._last_line
        out = super().ingest(windows)
        if self._last_line is not before and before is not None:
            self.reused.append(self._last_line.keys is before.keys)  # type: ignore[union-attr]
        return out


def test_a_rounds_flows_named_as_the_last_rounds_serve_again_as_records_would() -> None:
    # A round a second, each with one probe poll: the same ring of flows,
    # through the store's wire form, so a round's line takes the round
    # before's keys and slots. Between, the flow cache changes as in a job:
    # a rank joins (every cached slot forgotten), a flow comes and goes, a
    # pair goes quiet and is swept, and every flow stops long enough for all
    # pairs to be swept, then comes back as before (the last line's slots are
    # gone). Each round the leader keeps what one fed the rows as records
    # keeps. A line that reused its slots whatever the correlator's
    # flow_slots_version fails here; the version's three bumps each also
    # coincide with others in this story, so their mutants alone survive.
    ranks = [{"kind": "rank", "t": 0.5, "rank": r, "world_size": 4, "host": f"h{r // 2}",
              "pid": 4000 + r, "addrs": [f"198.18.0.{r + 1}"]} for r in range(4)]  # fmt: skip
    limits = StateLimits(ttl_s=5.0)
    rows, records = _KeysSeen(limits=limits), RecordsLeader(limits=limits)
    nodes = {h: NodeWindows(h) for h in ("h0", "h1", "h2")}
    rounds: list[list[bytes]] = []
    for s in range(75):
        t = float(s)
        recs: list[Record] = list(ranks) if s == 0 else []
        ring = [(r, (r + 1) % 4) for r in range(4) if not (r == 3 and s >= 20)]
        if 8 <= s <= 10:
            ring.append((0, 2))
        if 40 <= s <= 65:
            ring = []
        for r, p in ring if s else ():
            recs.append({"kind": "flow", "t": t, "dt": 1.0, "host": f"h{r // 2}",
                         "pid": 4000 + r, "src": f"198.18.0.{r + 1}:{40000 + p}",
                         "dst": f"198.18.0.{p + 1}:29500", "tx_bytes": 1000 * s + r,
                         "rx_bytes": s, "srtt_us": 100 + s % 7 + r})  # fmt: skip
        for h in ("h0", "h1"):
            recs.append({"kind": "netdev", "t": t, "dt": 1.0, "host": h, "dev": "eth0",
                         "tx_bytes": 0, "rx_bytes": 0})  # fmt: skip
        # Steps keep the ranks alive (a rank that only announced itself is swept).
        recs += [{"kind": "step", "rank": r, "step": s, "start": t - 0.9, "end": t + 0.05}
                 for r in range(4 if s < 6 else 5)]  # fmt: skip
        if s == 5:  # on a node of its own, whose windows carry no flows
            recs.append({**ranks[3], "t": t + 0.1, "rank": 4, "world_size": 5, "host": "h2",
                         "pid": 4004, "addrs": ["198.18.0.5"]})  # fmt: skip
        for rec in recs:
            nodes[rec["host"] if "host" in rec else f"h{min(rec['rank'] // 2, 2)}"].feed(rec)
        rounds.append([CS.encode(nw.window(t + 0.1)) for nw in nodes.values()])
    # The records first, then the rows: flow_table keeps only its last call's
    # strings, so the two leaders taking turns would read nothing twice.
    want = [(records.ingest([CS.decode(b) for b in blobs]), _state(records)) for blobs in rounds]
    for s, blobs in enumerate(rounds):
        assert (rows.ingest(CS.decode_round(blobs)), _state(rows)) == want[s], s
    assert rows.node_hosts == records.node_hosts == {"h0": {"h0"}, "h1": {"h1"}, "h2": {"h2"}}
    corr = rows.pipeline.corr
    assert corr.evicted["pair"] >= 3  # as the story goes
    assert 40 <= sum(rows.reused) < len(rows.reused)  # most rounds, not the changed ones


def _pipe_state(p: LeaderPipeline) -> tuple[Any, ...]:
    return (p.now, p._next_tick, p._ticks, p._horizon, dict(p._totals), dict(p.guard.counts))


@settings(max_examples=300, deadline=None)
@given(
    rounds=st.lists(
        st.tuples(
            st.floats(-4.0, 5.0),
            st.lists(st.floats(0.0, 1.0), max_size=12),
            st.booleans(),
            st.one_of(st.none(), st.floats(3.5, 8.0)),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_a_run_of_node_clocks_at_once_is_each_fed_alone(
    rounds: list[tuple[float, list[float], bool, float | None]],
) -> None:
    # Rounds of node clocks, each in order, as LeaderPipeline.clocks takes a
    # run of them (as many at once as neither meet the guard nor tick, then
    # one alone), against each fed to clock() in turn: the same clock, ticks,
    # guard horizon, counts and verdicts. Rounds jump back and ahead, so the
    # clocks cross ticks (every 0.5 s) and the guard's horizon (3 s past the
    # clock at a tick), and come while the guard holds a host's record aside
    # (a probe record that far ahead of the clock).
    alone, at_once = LeaderPipeline(), LeaderPipeline()
    out_alone: list[Any] = []
    out_at_once: list[Any] = []
    for p in (alone, at_once):
        p.feed({"kind": "clock", "t": 100.0})
    t = 100.0
    for jump, gaps, nan, ahead in rounds:
        if ahead is not None:
            rec = {"kind": "netdev", "t": alone.now + ahead, "dt": 1.0, "host": "h9",
                   "dev": "eth0", "tx_bytes": 0, "rx_bytes": 0}  # fmt: skip
            out_alone.extend(alone.feed(dict(rec)))
            out_at_once.extend(at_once.feed(dict(rec)))
        ts = []
        t += jump
        for gap in gaps:
            t += gap
            ts.append(t)
        if nan:
            ts.append(math.nan)  # sorted last, as the time line sorts it
        for c in ts:
            out_alone.extend(alone.clock(c))
        i = 0
        while i < len(ts):
            j = at_once.clocks(ts, i, len(ts))
            if j > i:
                i = j
                continue
            out_at_once.extend(at_once.clock(ts[i]))
            i += 1
        assert out_at_once == out_alone
        assert _pipe_state(at_once) == _pipe_state(alone)
