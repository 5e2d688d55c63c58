"""A TCP peer for the probe tests (run as a separate process, often inside a
network namespace), so the probes see traffic from a known pid with a known
byte count. Talks to the test over stdin/stdout, one line per step.

  probe_peer.py recv ADDR PORT N       accept, read N bytes, "got N", wait, close
  probe_peer.py send ADDR PORT N [--linger0] [--die]
                                       connect, "port P", send N (1 MiB writes), "sent N", wait,
                                       close (--linger0: with RST; --die: exit at once)
  probe_peer.py sink ADDR PORT         accept, read until EOF
  probe_peer.py stream ADDR PORT [--cubic]
                                       connect, "port P", send until stdin closes
  probe_peer.py short ADDR PORT K [SIZE]
                                       K connections, the i-th sends SIZE+i bytes (1000)
  probe_peer.py sinks ADDR PORT K      accept K connections, read each until EOF, "done"
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading

SEND_CHUNK = 1 << 20  # bytes per write of `send` (see main)


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def recv_exact(conn: socket.socket, n: int) -> int:
    got = 0
    while got < n:
        d = conn.recv(min(1 << 20, n - got))
        if not d:
            break
        got += len(d)
    return got


def main(argv: list[str]) -> int:
    mode, addr, port = argv[0], argv[1], int(argv[2])
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    if mode == "sinks":
        srv = socket.socket(fam, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, port))
        srv.listen(64)
        say(f"listening {srv.getsockname()[1]}")
        for _ in range(int(argv[3])):
            conn, _ = srv.accept()
            while conn.recv(1 << 20):
                pass
            conn.close()
        say("done")
        return 0
    if mode in ("recv", "sink"):
        srv = socket.socket(fam, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, port))
        srv.listen(64)
        say(f"listening {srv.getsockname()[1]}")
        conn, _ = srv.accept()
        if mode == "recv":
            say(f"got {recv_exact(conn, int(argv[3]))}")
            sys.stdin.readline()
        else:
            while conn.recv(1 << 20):
                pass
        conn.close()
        return 0
    if mode == "short":
        size = int(argv[4]) if len(argv) > 4 else 1000
        for i in range(int(argv[3])):
            c = socket.create_connection((addr, port))
            c.sendall(b"s" * (size + i))
            c.close()
        say("done")
        return 0
    c = socket.socket(fam, socket.SOCK_STREAM)
    if "--cubic" in argv:
        # A loss-based sender keeps the shaper's queue full, so the RTT holds
        # still long enough for two tools to read the same value.
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")
    c.connect((addr, port))
    say(f"port {c.getsockname()[1]}")
    if mode == "stream":
        stop = threading.Event()

        def wait_for_eof() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=wait_for_eof, daemon=True).start()
        chunk = b"z" * 65536
        while not stop.is_set():
            c.sendall(chunk)
        c.close()
        return 0
    n = int(argv[3])
    # In bounded writes, as gloo's and NCCL's transports write: the probes
    # count a send when its call returns, and one blocking sendall of the
    # whole payload returns only when the last byte is queued, so every poll
    # before that would see the busy sender move nothing.
    data = memoryview(b"x" * n)
    for off in range(0, n, SEND_CHUNK):
        c.sendall(data[off : off + SEND_CHUNK])
    say(f"sent {n}")
    sys.stdin.readline()
    if "--linger0" in argv:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    if "--die" in argv:
        os._exit(0)  # the kernel closes the socket for the dead process
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
