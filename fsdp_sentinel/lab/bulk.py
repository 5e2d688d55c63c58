"""Bulk TCP traffic for the noisy-neighbour fault: a sender and a sink.

``python -m fsdp_sentinel.lab.bulk sink --bind ADDR --port P`` accepts any
number of connections and discards what they send; ``send --to ADDR:P
[--streams N] [--rate-mbit R] [--seconds S]`` opens N connections and sends
as fast as the link allows, or paced to R Mbit/s in total. The sender keeps
retrying its connect for a while, so it may start before the sink. Both run
until killed (or ``--seconds``) and print their byte count on exit.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

CHUNK = 256 * 1024
CONNECT_TIMEOUT_S = 10.0


class _Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0

    def add(self, k: int) -> None:
        with self.lock:
            self.n += k


def _drain(conn: socket.socket, count: _Counter) -> None:
    buf = bytearray(CHUNK)
    with conn:
        while True:
            try:
                k = conn.recv_into(buf)
            except OSError:
                return
            if not k:
                return
            count.add(k)


def run_sink(bind: str, port: int) -> _Counter:
    count = _Counter()
    srv = socket.create_server((bind, port), backlog=64)  # sets SO_REUSEADDR
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_drain, args=(conn, count), daemon=True).start()


def _connect(addr: str, port: int) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return socket.create_connection((addr, port), timeout=2.0)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _send(addr: str, port: int, rate_bps: float | None, until: float, count: _Counter) -> None:
    sock = _connect(addr, port)
    sock.settimeout(None)
    data = b"\0" * CHUNK
    start = time.monotonic()
    sent = 0
    with sock:
        while time.monotonic() < until:
            if rate_bps:
                # Pace: never run ahead of rate * elapsed.
                ahead = sent * 8 / rate_bps - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(min(ahead, 0.05))
                    continue
            try:
                sock.sendall(data)
            except OSError:
                return
            sent += CHUNK
            count.add(CHUNK)


def run_sender(
    addr: str, port: int, streams: int, rate_mbit: float | None, seconds: float
) -> _Counter:
    count = _Counter()
    until = time.monotonic() + seconds
    per_stream = rate_mbit * 1e6 / streams if rate_mbit else None
    threads = [
        threading.Thread(target=_send, args=(addr, port, per_stream, until, count), daemon=True)
        for _ in range(streams)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return count


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fsdp_sentinel.lab.bulk", description=__doc__)
    sub = ap.add_subparsers(dest="role", required=True)
    sink = sub.add_parser("sink")
    sink.add_argument("--bind", default="0.0.0.0")
    sink.add_argument("--port", type=int, required=True)
    send = sub.add_parser("send")
    send.add_argument("--to", required=True, metavar="ADDR:PORT")
    send.add_argument("--streams", type=int, default=4)
    send.add_argument("--rate-mbit", type=float, default=None)
    send.add_argument("--seconds", type=float, default=float("inf"))
    args = ap.parse_args(argv)
    # SIGTERM ends the run like Ctrl-C does, so the byte count still prints.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    count = _Counter()
    try:
        if args.role == "sink":
            run_sink(args.bind, args.port)
        else:
            addr, _, port = args.to.rpartition(":")
            count = run_sender(addr, int(port), args.streams, args.rate_mbit, args.seconds)
    except KeyboardInterrupt:
        pass
    print(f"{args.role} bytes={count.n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
