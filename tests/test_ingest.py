"""The ingest socket: order, drops by reason, permissions, stale sockets, bursts."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_support import wait_for

from fsdp_sentinel.emit import Emitter
from fsdp_sentinel.ingest import IngestServer, parse_lines

Record = dict[str, Any]


def step(rank: int, n: int) -> Record:
    return {"kind": "step", "rank": rank, "step": n, "start": 100.0 + n, "end": 100.5 + n}


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    # A fresh directory, so the server creates it (and sets its mode).
    return tmp_path / "run" / "ingest.sock"


@pytest.fixture
def server(sock_path: Path) -> Iterator[tuple[IngestServer, list[Record]]]:
    got: list[Record] = []
    srv = IngestServer(sock_path, got.append).start()
    try:
        yield srv, got
    finally:
        srv.close()


def by_us(rec: Record) -> Record:
    """``rec`` as the server hands it on: stamped with the kernel's pid for its sender."""
    return {**rec, "host_pid": os.getpid()}


@pytest.fixture
def sender() -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        yield s
    finally:
        s.close()


def test_valid_records_arrive_in_order(server, sender, sock_path) -> None:
    srv, got = server
    sent = [step(r, n) for n in range(50) for r in range(4)]
    for rec in sent:
        sender.sendto(json.dumps(rec).encode(), str(sock_path))
    wait_for(lambda: len(got) == len(sent))
    assert got == [by_us(r) for r in sent]
    assert srv.received == srv.accepted == len(sent)
    assert srv.dropped_total == 0


def test_malformed_datagrams_are_dropped_and_counted(server, sender, sock_path) -> None:
    srv, got = server
    before = step(0, 1)
    after = step(1, 2)
    datagrams = [
        json.dumps(before).encode(),
        b'{"kind": "step", "rank": 0',  # broken JSON
        b"\xff\xfe not utf-8",  # not text
        b'[{"kind": "step"}]',  # not an object
        b'"just a string"',  # not an object
        b'{"rank": 0, "step": 1}',  # no kind
        b'{"kind": 7}',  # kind not a string
        b'{"kind": "step", "rank": 0, "step": 1, "start": 1.0}',  # missing "end"
        b'{"kind": "step", "rank": 0, "step": 1, "start": NaN, "end": 2}',  # not JSON
        json.dumps(
            {
                "kind": "verdict",
                "t": 1,
                "step": 1,
                "rank": 0,
                "state": "flagged",
                "cause": "network",
                "score": 1,
            }
        ).encode(),  # fmt: skip
        json.dumps(after).encode(),
    ]
    for d in datagrams:
        sender.sendto(d, str(sock_path))
    wait_for(lambda: srv.received == len(datagrams))
    wait_for(lambda: len(got) == 2)
    assert got == [by_us(before), by_us(after)]
    assert {why: n for why, n in srv.dropped.items() if n} == {
        "invalid_json": 3,
        "not_object": 2,
        "no_kind": 2,
        "missing_field": 1,
        "reserved_kind": 1,
    }
    assert srv.malformed_total == 8
    assert srv.dropped_total == 9


def test_unknown_kinds_pass_through(server, sender, sock_path) -> None:
    # Readers ignore unknown kinds but the trace keeps them (format v1).
    _, got = server
    rec = {"kind": "future_thing", "x": 1}
    sender.sendto(json.dumps(rec).encode(), str(sock_path))
    wait_for(lambda: got == [by_us(rec)])


def test_oversize_datagram_is_dropped(server, sender, sock_path) -> None:
    srv, got = server
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    big = {"kind": "future_thing", "pad": "x" * 70_000}
    sender.sendto(json.dumps(big).encode(), str(sock_path))
    sender.sendto(json.dumps(step(0, 0)).encode(), str(sock_path))
    wait_for(lambda: len(got) == 1)
    assert got == [by_us(step(0, 0))]
    assert srv.dropped["too_large"] == 1


def test_refused_records_count_as_dropped_not_malformed(sock_path, sender) -> None:
    got: list[Record] = []

    def on_record(rec: Record) -> bool:
        if rec["step"] % 2:
            return False
        got.append(rec)
        return True

    with IngestServer(sock_path, on_record) as srv:
        for n in range(6):
            sender.sendto(json.dumps(step(0, n)).encode(), str(sock_path))
        wait_for(lambda: srv.received == 6)
        assert [r["step"] for r in got] == [0, 2, 4]
        assert srv.dropped["refused"] == 3
        assert srv.malformed_total == 0


def test_permissions_and_removal(sock_path) -> None:
    srv = IngestServer(sock_path, lambda rec: None).start()
    try:
        st = os.stat(sock_path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert stat.S_IMODE(os.stat(sock_path.parent).st_mode) == 0o750
    finally:
        srv.close()
    assert not sock_path.exists()


def test_existing_directory_keeps_its_mode(tmp_path) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o755)
    with IngestServer(d / "ingest.sock", lambda rec: None):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o755


def test_stale_socket_is_replaced(sock_path, sender) -> None:
    sock_path.parent.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dead.bind(str(sock_path))
    dead.close()  # leaves the file behind, as a crashed daemon would
    assert sock_path.exists()
    got: list[Record] = []
    with IngestServer(sock_path, got.append):
        sender.sendto(json.dumps(step(0, 0)).encode(), str(sock_path))
        wait_for(lambda: len(got) == 1)


def test_live_socket_and_regular_file_are_not_replaced(sock_path, tmp_path) -> None:
    with IngestServer(sock_path, lambda rec: None), pytest.raises(FileExistsError):
        IngestServer(sock_path, lambda rec: None)
    plain = tmp_path / "plain"
    plain.write_text("keep me")
    with pytest.raises(FileExistsError):
        IngestServer(plain, lambda rec: None)
    assert plain.read_text() == "keep me"


def test_records_from_emitter_and_a_burst_of_four_ranks(sock_path) -> None:
    """Four ranks' emitters (non-blocking, drop when the kernel refuses) send a
    burst each; with the enlarged queue nothing is dropped anywhere."""
    got: list[Record] = []
    per_rank = 150  # below one emitter's send-buffer worth of queued datagrams
    with IngestServer(sock_path, got.append) as srv:
        emitters = [Emitter(str(sock_path)) for _ in range(4)]
        barrier = threading.Barrier(4)

        def burst(rank: int) -> None:
            barrier.wait()
            for n in range(per_rank):
                emitters[rank].emit(step(rank, n))

        threads = [threading.Thread(target=burst, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wait_for(lambda: len(got) == 4 * per_rank)
        for e in emitters:
            assert (e.sent, e.dropped) == (per_rank, 0)
            e.close()
        for rank in range(4):  # each rank's records keep their order
            assert [r["step"] for r in got if r["rank"] == rank] == list(range(per_rank))
        assert srv.dropped_total == 0
        assert srv.backlog >= 4 * per_rank
        assert srv.rcvbuf >= 1 << 20


def test_queue_length_sysctl_is_restored(sock_path, tmp_path) -> None:
    fake = tmp_path / "max_dgram_qlen"  # a stand-in file: the real one is machine-wide
    fake.write_text("10\n")
    with IngestServer(sock_path, lambda rec: None, backlog=2048, qlen_sysctl=str(fake)) as srv:
        assert srv.backlog == 2048
    assert fake.read_text().strip() == "10"


def lines(*recs: Record) -> bytes:
    return b"\n".join(json.dumps(r).encode() for r in recs)


def test_a_datagram_of_json_lines_is_one_record_a_line(server, sender, sock_path) -> None:
    srv, got = server
    sent = [step(r, n) for n in range(30) for r in range(4)]
    sender.sendto(lines(*sent), str(sock_path))
    sender.sendto(json.dumps(step(9, 0)).encode() + b"\n", str(sock_path))  # one, newline-ended
    wait_for(lambda: len(got) == len(sent) + 1)
    assert got == [by_us(r) for r in [*sent, step(9, 0)]]
    assert (srv.datagrams, srv.received, srv.accepted) == (2, len(sent) + 1, len(sent) + 1)
    assert srv.dropped_total == 0


def test_a_bad_line_drops_only_itself_counted_by_its_reason(server, sender, sock_path) -> None:
    srv, got = server
    data = b"\n".join([
        json.dumps(step(0, 1)).encode(),
        b'{"kind": "step", "rank": 0',  # broken JSON
        b"",  # a blank line: skipped, not a record
        b'{"kind": "step", "rank": 0, "step": 1, "start": 1.0}',  # missing "end"
        b'{"kind": "header", "format": "fsdp-sentinel-trace", "version": 1}',  # reserved
        b'{"kind":"step","rank":0,"step":1000000000000,"start":1.0,"end":2.0}',  # bad value
        json.dumps(step(0, 2)).encode(),
    ])  # fmt: skip
    sender.sendto(data, str(sock_path))
    wait_for(lambda: srv.received == 6 and len(got) == 2)
    assert got == [by_us(step(0, 1)), by_us(step(0, 2))]
    assert {why: n for why, n in srv.dropped.items() if n} == {
        "invalid_json": 1,
        "missing_field": 1,
        "reserved_kind": 1,
        "bad_value": 1,
    }
    assert srv.received == srv.accepted + srv.dropped_total == 6


def test_parse_lines_rules() -> None:
    a, b = step(0, 1), step(0, 2)
    assert parse_lines(lines(a, b)) == [(a, None), (b, None)]
    assert parse_lines(lines(a) + b"\n") == [(a, None)]  # a newline at the end: one record
    assert parse_lines(lines(a, b) + b"\n\r\n \n") == [(a, None), (b, None)]
    assert parse_lines(json.dumps(a, indent=1).encode()) == [(a, None)]  # pretty-printed: one
    assert parse_lines(b"") == [(None, "invalid_json")]
    assert parse_lines(b"\n \n") == [(None, "invalid_json")]  # nothing but blank lines
    assert parse_lines(lines(a) + b"\n[1]\n{") == [(a, None), (None, "not_object"),
                                                   (None, "invalid_json")]  # fmt: skip


def test_each_record_of_a_datagram_is_sized_by_its_line(sock_path, sender) -> None:
    got: list[tuple[Record, int]] = []
    with IngestServer(sock_path, lambda rec, n: got.append((rec, n)), sized=True) as srv:
        recs = [step(0, 1), {**step(0, 2), "pad": "x" * 100}]
        sender.sendto(lines(*recs), str(sock_path))
        one = json.dumps(step(0, 3)).encode()
        sender.sendto(one, str(sock_path))
        wait_for(lambda: srv.received == 3)
    assert [n for _, n in got] == [len(json.dumps(r)) for r in recs] + [len(one)]


def test_a_dead_loop_mid_datagram_counts_the_rest_refused(sock_path, sender) -> None:
    got: list[Record] = []

    def on_record(rec: Record) -> None:
        if rec["step"] == 2:
            raise RuntimeError("a bug downstream")
        got.append(rec)

    with IngestServer(sock_path, on_record) as srv:
        sender.sendto(lines(*(step(0, n) for n in range(1, 6))), str(sock_path))
        sender.sendto(lines(step(0, 6)), str(sock_path))
        wait_for(lambda: len(got) == 2)
        assert [r["step"] for r in got] == [1, 6]
        assert srv.restarts == 1
        assert srv.dropped["refused"] == 4  # the one that raised, the three after it
        assert srv.received == srv.accepted + srv.dropped_total == 6


def test_the_emitter_s_packed_drains_arrive_whole(sock_path) -> None:
    got: list[Record] = []
    with IngestServer(sock_path, got.append) as srv:
        em = Emitter(str(sock_path), flush_interval=3600)
        sent = [step(r, n) for n in range(500) for r in range(4)]
        for rec in sent:
            em.emit(rec)
        em.close()
        assert (em.sent, em.dropped) == (len(sent), 0)
        assert em.datagrams < len(sent) / 100
        wait_for(lambda: len(got) == len(sent))
        assert got == [by_us(r) for r in sent]
        assert (srv.datagrams, srv.received) == (em.datagrams, len(sent))
