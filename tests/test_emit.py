"""The emitter: datagrams to a real AF_UNIX socket; drops and counts, never blocks.

A drain goes as JSON lines packed into as few datagrams as fit
(``MAX_DATAGRAM``); ``sent`` and ``dropped`` count records, ``datagrams``
datagrams."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdp_sentinel.emit import MAX_DATAGRAM, Emitter
from fsdp_sentinel.trace import read_trace

REC = {"kind": "step", "rank": 0, "step": 1, "start": 1.0, "end": 2.0}


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return str(tmp_path / "ingest.sock")


@pytest.fixture
def receiver(sock_path: str) -> Iterator[socket.socket]:
    """A daemon stand-in: a bound datagram socket that reads only when asked."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(sock_path)
    s.setblocking(False)
    yield s
    s.close()


def datagrams(s: socket.socket) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(s.recv(MAX_DATAGRAM + 1))
        except BlockingIOError:
            return out


def drain(s: socket.socket) -> list[dict[str, object]]:
    return [json.loads(line) for d in datagrams(s) for line in d.split(b"\n")]


def test_a_drain_goes_as_one_datagram_of_json_lines(
    sock_path: str, receiver: socket.socket
) -> None:
    with Emitter(sock_path, flush_interval=3600) as em:
        for i in range(5):
            em.emit({**REC, "step": i})
        em.flush()
        assert (em.sent, em.dropped, em.datagrams) == (5, 0, 1)
    got = datagrams(receiver)
    assert len(got) == 1 and not got[0].endswith(b"\n")
    assert [json.loads(line)["step"] for line in got[0].split(b"\n")] == [0, 1, 2, 3, 4]


def test_a_big_drain_is_packed_into_few_datagrams_under_the_cap(
    sock_path: str, receiver: socket.socket
) -> None:
    # ~60 bytes a record, ~1,000 a datagram: 4 datagrams, within the
    # receiver's queue (10 datagrams by default) and the sender's buffer.
    n = 4000
    with Emitter(sock_path, flush_interval=3600) as em:
        em._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # type: ignore[union-attr]
        for i in range(n):
            em.emit({**REC, "step": i})
        em.flush()
        got = datagrams(receiver)
        assert (em.sent, em.dropped) == (n, 0)
        assert em.datagrams == len(got)
    size = len(json.dumps({**REC, "step": n}, separators=(",", ":")))
    assert len(got) <= -(-n * (size + 1) // MAX_DATAGRAM) + 1 < n / 500  # packed full
    assert all(len(d) <= MAX_DATAGRAM for d in got)
    assert all(len(d) > MAX_DATAGRAM - size - 1 for d in got[:-1])  # each one full
    assert [json.loads(line)["step"] for d in got for line in d.split(b"\n")] == list(range(n))


def test_no_daemon_drops_and_counts(tmp_path: Path) -> None:
    with Emitter(str(tmp_path / "nobody" / "ingest.sock")) as em:
        for _ in range(1000):
            em.emit(REC)
        em.flush()
        assert (em.sent, em.dropped) == (0, 1000)


def test_socket_file_without_listener_drops(sock_path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(sock_path)
    s.close()  # the file stays, nobody listens: ECONNREFUSED
    with Emitter(sock_path) as em:
        em.emit(REC)
        em.flush()
        assert (em.sent, em.dropped) == (0, 1)


def test_full_receiver_queue_drops_instead_of_blocking(
    sock_path: str, receiver: socket.socket
) -> None:
    # The receiver never reads, so its queue fills; a blocking sender would
    # hang here (pytest-timeout would fail the test).
    n = 20_000
    with Emitter(sock_path) as em:
        for i in range(n):
            em.emit({**REC, "step": i})
        em.flush()
        assert em.dropped > 0
        assert em.sent > 0
        assert em.sent + em.dropped == n
        got = drain(receiver)
        assert len(got) == em.sent  # a datagram refused drops every record it held
        # Once the queue has room again, records flow again at once.
        em.emit({**REC, "step": -1})
        em.flush()
        assert em.sent == len(got) + 1
    assert drain(receiver) == [{**REC, "step": -1}]


def test_picks_up_a_daemon_that_starts_later(sock_path: str) -> None:
    now = [100.0]
    with Emitter(sock_path, retry_interval=1.0, clock=lambda: now[0]) as em:
        em.emit(REC)  # nobody there: backs off for a second
        em.flush()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(sock_path)
        s.setblocking(False)
        try:
            em.emit(REC)  # still backing off: dropped without trying
            em.flush()
            assert (em.sent, em.dropped) == (0, 2)
            assert drain(s) == []
            now[0] += 1.5
            em.emit({**REC, "step": 9})
            em.flush()
            assert (em.sent, em.dropped) == (1, 2)
            assert drain(s) == [{**REC, "step": 9}]
        finally:
            s.close()


def test_records_dropped_while_backing_off_are_not_encoded(
    sock_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that runs with no daemon pays for queueing its records, not for
    their JSON: while the sender backs off, what it drops is never encoded;
    once it tries again, encoding resumes."""
    now = [100.0]
    encoded: list[dict] = []
    real = Emitter._encode

    def counting(self: Emitter, rec: dict) -> bytes | None:
        encoded.append(rec)
        return real(self, rec)

    monkeypatch.setattr(Emitter, "_encode", counting)
    with Emitter(sock_path, retry_interval=1.0, clock=lambda: now[0]) as em:
        em.emit(REC)  # nobody there: encoded, refused, backs off
        em.flush()
        assert len(encoded) == 1
        for step in range(5):
            em.emit({**REC, "step": step})
        em.flush()
        assert (len(encoded), em.sent, em.dropped) == (1, 0, 6)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(sock_path)
        s.setblocking(False)
        try:
            now[0] += 1.5
            em.emit({**REC, "step": 9})
            em.flush()
            assert (len(encoded), em.sent, em.dropped) == (2, 1, 6)
            assert drain(s) == [{**REC, "step": 9}]
        finally:
            s.close()


def test_daemon_gone_midway(sock_path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(sock_path)
    with Emitter(sock_path) as em:
        em.emit(REC)
        em.flush()
        s.close()
        Path(sock_path).unlink()
        em.emit(REC)
        em.emit(REC)
        em.flush()
        assert (em.sent, em.dropped) == (1, 2)


def test_a_daemon_back_after_a_crash_hears_the_greeting_first(sock_path: str) -> None:
    """A SIGKILLed daemon leaves its socket file with nobody bound (ECONNREFUSED);
    a new one takes the path over. The greeting (the hooks' rank record) goes
    ahead of the first record the new one gets, and only then."""
    now = [100.0]
    hello = {"kind": "rank", "t": 1.0, "rank": 0, "world_size": 1, "host": "h", "pid": 1,
             "addrs": []}  # fmt: skip
    first = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    first.bind(sock_path)
    first.setblocking(False)
    with Emitter(sock_path, retry_interval=1.0, clock=lambda: now[0]) as em:
        em.set_greeting(lambda: [hello])
        em.emit({**REC, "step": 1})
        em.flush()
        assert drain(first) == [{**REC, "step": 1}]  # no greeting while all is well
        first.close()  # the crash: the file stays, nobody reads it
        em.emit({**REC, "step": 2})
        em.flush()
        assert (em.sent, em.dropped, em.greetings) == (1, 1, 0)
        Path(sock_path).unlink()  # what the new daemon does with a stale socket
        second = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        second.bind(sock_path)
        second.setblocking(False)
        try:
            now[0] += 1.5
            em.emit({**REC, "step": 3})
            em.emit({**REC, "step": 4})
            em.flush()
            assert drain(second) == [hello, {**REC, "step": 3}, {**REC, "step": 4}]
            assert (em.sent, em.dropped, em.greetings) == (4, 1, 1)
        finally:
            second.close()


def test_a_greeting_to_nobody_is_not_counted_as_a_dropped_record(sock_path: str) -> None:
    """While nobody listens, each retry tries the greeting first and fails: only
    the record in hand counts as dropped, so ``dropped`` stays the number of
    records the sender could not deliver (the trainer prints it; the test of a
    job with no daemon compares it with the records it wrote)."""
    now = [100.0]
    hello = {"kind": "rank", "t": 1.0, "rank": 0, "world_size": 1, "host": "h", "pid": 1,
             "addrs": []}  # fmt: skip
    with Emitter(sock_path, retry_interval=1.0, clock=lambda: now[0]) as em:
        em.set_greeting(lambda: [hello])
        for step in range(6):
            em.emit({**REC, "step": step})
            em.flush()
            now[0] += 1.5  # every record past the retry interval: a greeting tried each time
        assert (em.sent, em.dropped, em.greetings) == (0, 6, 0)


def test_oversize_and_unencodable_records_are_dropped(
    sock_path: str, receiver: socket.socket
) -> None:
    with Emitter(sock_path) as em:
        em.emit({**REC, "blob": "x" * (MAX_DATAGRAM + 1)})
        em.emit({**REC, "bad": object()})
        em.emit(REC)
        em.flush()
        assert (em.sent, em.dropped, em.oversize) == (1, 2, 1)
    assert drain(receiver) == [REC]


def test_a_record_that_fills_a_datagram_alone_goes_alone_and_its_neighbours_go(
    sock_path: str, receiver: socket.socket
) -> None:
    blob = "x" * (MAX_DATAGRAM - len(json.dumps({**REC, "blob": ""}, separators=(",", ":"))))
    just, too_big = {**REC, "blob": blob}, {**REC, "blob": blob + "x"}
    with Emitter(sock_path, flush_interval=3600) as em:
        em._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # type: ignore[union-attr]
        for rec in ({**REC, "step": 1}, just, too_big, {**REC, "step": 2}):
            em.emit(rec)
        em.flush()
        assert (em.sent, em.dropped, em.oversize, em.datagrams) == (3, 1, 1, 3)
    got = datagrams(receiver)
    assert [len(d) for d in got][1] == MAX_DATAGRAM
    assert [json.loads(d) for d in got] == [{**REC, "step": 1}, just, {**REC, "step": 2}]


def test_close_sends_everything_pending(sock_path: str, receiver: socket.socket) -> None:
    em = Emitter(sock_path, flush_interval=3600)  # the thread never drains by itself
    for i in range(2000):
        em.emit({**REC, "step": i})
    assert em.sent == 0
    em.close()
    assert (em.sent, em.dropped) == (2000, 0)
    assert 1 <= em.datagrams < 10
    assert [r["step"] for r in drain(receiver)] == list(range(2000))


def test_trace_out_keeps_every_record_even_without_daemon(tmp_path: Path) -> None:
    out = tmp_path / "rank0.jsonl"
    with Emitter(str(tmp_path / "none.sock"), trace_out=str(out)) as em:
        for i in range(50):
            em.emit({**REC, "step": i})
        em.flush()
        assert (em.dropped, em.written) == (50, 50)
    recs = list(read_trace(out))
    assert recs[0]["kind"] == "header"
    assert [r["step"] for r in recs[1:]] == list(range(50))


def test_socket_off_writes_trace_only(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl.zst"
    with Emitter(None, trace_out=str(out)) as em:
        em.emit(REC)
        em.flush()
        assert (em.sent, em.dropped, em.written) == (0, 0, 1)
    assert list(read_trace(out))[1:] == [REC]


def test_emit_only_queues_the_background_thread_sends(
    sock_path: str, receiver: socket.socket
) -> None:
    with Emitter(sock_path, flush_interval=0.01) as em:
        em.emit(REC)
        for _ in range(200):  # up to 2 s for the sender thread on a busy machine
            if em.sent:
                break
            threading.Event().wait(0.01)
        assert em.sent == 1
    assert drain(receiver) == [REC]


def test_queue_cap_drops_and_counts(sock_path: str, receiver: socket.socket) -> None:
    with Emitter(sock_path, flush_interval=3600, max_pending=3) as em:
        for i in range(5):
            em.emit({**REC, "step": i})
        assert em.dropped == 2  # counted at once, before any send
        em.flush()
        assert (em.sent, em.dropped) == (3, 2)
    assert [r["step"] for r in drain(receiver)] == [0, 1, 2]


def test_emit_after_close_is_a_no_op(sock_path: str, receiver: socket.socket) -> None:
    em = Emitter(sock_path)
    em.close()
    em.close()
    em.emit(REC)
    assert (em.sent, em.dropped) == (0, 0)


def test_emitters_started_apart_drain_together(sock_path: str, receiver: socket.socket) -> None:
    # Two ranks' emitters started 100 ms apart drain at the same instants
    # (multiples of flush_interval on the shared monotonic clock): the
    # daemon's ingest thread then wakes once for both datagrams. Unaligned,
    # their drains stayed 100 ms apart for good.
    import time

    receiver.setblocking(True)
    receiver.settimeout(5)
    first = Emitter(sock_path, flush_interval=0.3)
    time.sleep(0.1)
    second = Emitter(sock_path, flush_interval=0.3)
    try:
        arrivals: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(3):
            first.emit({**REC, "rank": 0})
            second.emit({**REC, "rank": 1})
            for _ in range(2):
                rec = json.loads(receiver.recv(MAX_DATAGRAM + 1))
                arrivals[rec["rank"]].append(time.monotonic())
        gaps = [abs(a - b) for a, b in zip(arrivals[0], arrivals[1], strict=True)]
        assert max(gaps) < 0.05, gaps
        # ... on the clock's multiples of the interval
        assert all(0.3 - t % 0.3 < 0.05 or t % 0.3 < 0.05 for t in arrivals[0]), arrivals[0]
    finally:
        first.close()
        second.close()


def test_the_next_drain_is_at_the_next_multiple_of_the_interval() -> None:
    em = Emitter(None, flush_interval=0.25, clock=lambda: 1000.37)
    try:
        assert abs(em._until_next() - 0.13) < 1e-9
    finally:
        em.close()
