"""One datagram can no longer kill, blind or poison the daemon (no root).

Each row of the hardening issue's table that a datagram can cause, sent for
real to a real ingest socket: before, ``[`` x 995 killed the receive thread
(a RecursionError), ``{"kind":"x","t":1e999}`` ended the daemon once it
reached the trace writer, a lone surrogate or ``start=-1e308, end=1e308``
broke every later scrape, and a step of 10**12 blinded the detector. Now
each is refused by the one decoder live and replay share, counted by reason,
and the daemon goes on judging the job beside it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from daemon_support import daemon_running, send_job

from fsdp_sentinel.daemon import Daemon, DaemonConfig
from fsdp_sentinel.ingest import BAD_JSON, BAD_VALUE, IngestServer, parse_datagram
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.synth import Scenario, SlowCompute, generate
from fsdp_sentinel.trace import TraceError, read_trace

HOSTILE: list[tuple[bytes, str]] = [
    (b"[" * 995, BAD_JSON),
    (b"[" * 5000 + b"]" * 5000, BAD_JSON),
    (b'{"kind":"x","t":1e999}', BAD_JSON),
    (b'{"kind":"x","t":NaN}', BAD_JSON),
    (
        b'{"kind":"rank","t":1,"rank":0,"world_size":1,"host":"\\ud800","pid":1,"addrs":[]}',
        BAD_JSON,
    ),  # fmt: skip
    (b"\xff\xfe{}", BAD_JSON),
    (b'{"kind":"step","rank":0,"step":1,"start":-1e308,"end":1e308}', BAD_VALUE),
    (b'{"kind":"step","rank":0,"step":1000000000000,"start":1.0,"end":2.0}', BAD_VALUE),
    (b'{"kind":"step","rank":"0","step":1,"start":1.0,"end":2.0}', BAD_VALUE),
    (
        b'{"kind":"rank","t":1,"rank":0,"world_size":1,"host":"'
        + b"h" * 300
        + b'","pid":1,"addrs":[]}',
        BAD_VALUE,
    ),  # fmt: skip
    (
        b'{"kind":"rank","t":1,"rank":0,"world_size":1,"host":"h","pid":1,"addrs":'
        + json.dumps(["198.18.0.1"] * 100).encode()
        + b"}",
        BAD_VALUE,
    ),  # fmt: skip
]


@pytest.mark.parametrize(("data", "reason"), HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_each_hostile_datagram_is_refused_with_its_reason(data: bytes, reason: str) -> None:
    assert parse_datagram(data) == (None, reason)


@pytest.mark.parametrize(("data", "reason"), HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_replay_refuses_the_same_bytes(data: bytes, reason: str, tmp_path: Path) -> None:
    # The same bytes as a trace line: strict names file and line; lenient skips.
    path = tmp_path / "t.jsonl"
    path.write_bytes(
        b'{"kind":"header","format":"fsdp-sentinel-trace","version":1}\n' + data + b"\n"
    )
    with pytest.raises(TraceError) as e:
        list(read_trace(path))
    assert e.value.line == 2 and str(path) in str(e.value)
    assert [r["kind"] for r in read_trace(path, strict=False)] == ["header"]


def test_the_receive_thread_survives_every_one_and_the_counts_add_up(tmp_path: Path) -> None:
    got: list[dict] = []
    path = tmp_path / "s" / "ingest.sock"
    good = {"kind": "step", "rank": 0, "step": 1, "start": 1.0, "end": 2.0}
    with (
        IngestServer(path, got.append) as srv,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s,
    ):
        for data, _ in HOSTILE:
            s.sendto(data, str(path))
        s.sendto(json.dumps(good).encode(), str(path))
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv._thread is not None and srv._thread.is_alive()
        assert got == [{**good, "host_pid": os.getpid()}]  # the kernel's word for the sender
        assert srv.received == len(HOSTILE) + 1
        assert srv.received == srv.accepted + srv.dropped_total
        assert srv.dropped[BAD_JSON] == sum(r == BAD_JSON for _, r in HOSTILE)
        assert srv.dropped[BAD_VALUE] == sum(r == BAD_VALUE for _, r in HOSTILE)


def test_the_daemon_with_a_full_disk_trace_still_flags_the_straggler(tmp_path: Path) -> None:
    # --trace-out on a full disk (/dev/full: every write ENOSPC), hostile
    # datagrams in the stream: the slow rank is still flagged, the daemon runs on.
    cfg = DaemonConfig(socket_path=str(tmp_path / "run" / "ingest.sock"), trace_out="/dev/full",
                       metrics_addr=None, interval=0.05, trust_record_pid=True)  # fmt: skip

    def hostile(s: socket.socket) -> None:
        for data, _ in HOSTILE:
            s.sendto(data, cfg.socket_path)

    with daemon_running(cfg) as d:
        recs, _ = generate(
            Scenario(steps=20, faults=(SlowCompute(rank=2, factor=3.0, start=6, end=20),))
        )
        send_job(d, recs, every_50=hostile)
        snap = d.snapshot()
        assert snap.verdicts_total.get("compute") == 1
        assert d._trace is not None and d._trace.failed is not None


def test_a_dead_receive_loop_is_started_again_and_counts_still_add_up(tmp_path: Path) -> None:
    # on_record raising (a bug downstream) used to end the receive thread
    # silently: the daemon ran on, deaf. Now the loop is started again.
    got: list[dict] = []

    def on_record(rec: dict) -> None:
        if rec["step"] == 2:
            raise RuntimeError("a bug downstream")
        got.append(rec)

    path = tmp_path / "s" / "ingest.sock"
    with (
        IngestServer(path, on_record) as srv,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s,
    ):
        for step in (1, 2, 3):
            rec = {"kind": "step", "rank": 0, "step": step, "start": 1.0, "end": 2.0}
            s.sendto(json.dumps(rec).encode(), str(path))
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r["step"] for r in got] == [1, 3]
        assert srv.restarts == 1
        assert srv.received == srv.accepted + srv.dropped_total == 3


def test_a_dead_pipeline_loop_is_started_again(tmp_path: Path) -> None:
    cfg = DaemonConfig(socket_path=str(tmp_path / "run" / "ingest.sock"), metrics_addr=None,
                       interval=0.05)  # fmt: skip
    d = Daemon(cfg, pipeline=Pipeline())
    calls = {"n": 0}
    real = d._tick

    def tick_dies_once() -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a bug in the loop")
        real()

    d._tick = tick_dies_once  # type: ignore[method-assign]
    d.start()
    t = threading.Thread(target=d.run)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while calls["n"] < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert calls["n"] >= 6 and d.restarts == 1
        assert d.snapshot().thread_restarts_total["pipeline"] == 1
    finally:
        d.request_stop()
        t.join(timeout=30)
        d.close()
    assert not t.is_alive()
