"""The daemon's ingest queue is capped in bytes as well as in records.

A count cap alone let 200,000 datagrams of 64 KiB wait for the pipeline:
12 GiB. Now what waits is also capped in datagram bytes; a record past
either cap is refused at once under its own reason (``queue_bytes``,
``queue_full``), the sender never waits, the counts add up, and once the
pipeline catches up records are taken again. Real socket, real daemon; the
pipeline loop is simply not running yet, so the queue fills.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

from fsdp_sentinel.daemon import Daemon, DaemonConfig
from fsdp_sentinel.emit import Emitter
from fsdp_sentinel.ingest import QUEUE_BYTES, QUEUE_FULL
from fsdp_sentinel.pipeline import Pipeline


def _step(i: int, pad: int) -> bytes:
    rec = {"kind": "step", "rank": 0, "step": i, "start": 1.0, "end": 2.0, "pad": "x" * pad}
    return json.dumps(rec).encode()


def _settled(d: Daemon, n: int) -> None:
    assert d.ingest is not None
    deadline = time.monotonic() + 20
    while d.ingest.received < n and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the last one's hand-off


def test_bytes_past_the_cap_are_refused_counted_and_never_block_the_sender(
    tmp_path: Path,
) -> None:
    cap = 64 * 1024
    cfg = DaemonConfig(socket_path=str(tmp_path / "run" / "ingest.sock"), metrics_addr=None,
                       interval=0.05, queue_max_bytes=cap, trust_record_pid=True)  # fmt: skip
    d = Daemon(cfg, pipeline=Pipeline(), wall_clock=None)
    d.start()
    t = threading.Thread(target=d.run)
    try:
        sizes = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)  # a sender that would have to wait raises here
            for i in range(40):
                data = _step(i, 4000)
                sizes.append(len(data))
                s.sendto(data, cfg.socket_path)
                time.sleep(0.001)
        _settled(d, 40)
        ing = d.ingest
        assert ing is not None
        kept = 0
        for n in sizes:  # the queue keeps datagrams in order until the next would pass the cap
            if kept + n > cap:
                break
            kept += n
        assert d.queued_bytes == kept <= cap
        assert ing.accepted == kept // sizes[0]
        assert ing.dropped[QUEUE_BYTES] == 40 - ing.accepted > 0
        assert ing.dropped[QUEUE_FULL] == 0
        assert ing.received == ing.accepted + ing.dropped_total == 40
        # The pipeline catches up: the bytes are handed back and records taken again.
        t.start()
        deadline = time.monotonic() + 10
        while d.queued_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert d.queued_bytes == 0
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(_step(99, 4000), cfg.socket_path)
        _settled(d, 41)
        assert ing.accepted == kept // sizes[0] + 1
        snap_counts = {"accepted": ing.accepted, **ing.dropped}
        assert sum(snap_counts.values()) == ing.received
    finally:
        d.request_stop()
        if t.is_alive():
            t.join(timeout=30)
        d.close()


def test_records_past_the_count_cap_have_their_own_reason(tmp_path: Path) -> None:
    cfg = DaemonConfig(socket_path=str(tmp_path / "run" / "ingest.sock"), metrics_addr=None,
                       queue_max=5, trust_record_pid=True)  # fmt: skip
    d = Daemon(cfg, pipeline=Pipeline(), wall_clock=None)
    d.start()
    try:
        em = Emitter(cfg.socket_path)
        for i in range(12):
            em.emit(json.loads(_step(i, 0)))
            em.flush()
        em.close()
        _settled(d, 12)
        ing = d.ingest
        assert ing is not None
        assert (ing.accepted, ing.dropped[QUEUE_FULL], ing.dropped[QUEUE_BYTES]) == (5, 7, 0)
        assert em.dropped == 0  # the sender's datagrams were all taken by the kernel
    finally:
        d.close()


def test_the_byte_cap_counts_each_line_of_a_packed_datagram(tmp_path: Path) -> None:
    cap = 64 * 1024
    cfg = DaemonConfig(socket_path=str(tmp_path / "run" / "ingest.sock"), metrics_addr=None,
                       interval=0.05, queue_max_bytes=cap, trust_record_pid=True)  # fmt: skip
    d = Daemon(cfg, pipeline=Pipeline(), wall_clock=None)
    d.start()
    try:
        lines = [_step(i, 2000) for i in range(60)]  # ~2 KiB each, 30 to a datagram
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"\n".join(lines[:30]), cfg.socket_path)
            s.sendto(b"\n".join(lines[30:]), cfg.socket_path)
        _settled(d, 60)
        ing = d.ingest
        assert ing is not None
        kept = n = 0
        for line in lines:  # each line weighs its own bytes, newline not counted
            if kept + len(line) > cap:
                break
            kept += len(line)
            n += 1
        assert 30 < n < 60
        assert d.queued_bytes == kept <= cap
        assert (ing.accepted, ing.dropped[QUEUE_BYTES]) == (n, 60 - n)
        assert ing.received == ing.accepted + ing.dropped_total == 60
    finally:
        d.close()
