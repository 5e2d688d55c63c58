"""The kernel's sock_diag destroy broadcast on real loopback sockets: every
TCP socket that opens and closes between two reads arrives with its final
tcp_info, checked against what the two ends wrote and read."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from fsdp_sentinel.probes.sockdiag import SockDiag

pytestmark = [pytest.mark.root]


def test_sockets_born_and_gone_between_reads_arrive_with_their_bytes() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_NET_ADMIN for the destroy groups)")
    diag = SockDiag(netns_dir=None)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    port = srv.getsockname()[1]
    k = 25
    got: list[int] = []

    def serve() -> None:
        for _ in range(k):
            c, _ = srv.accept()
            n = 0
            while b := c.recv(65536):
                n += len(b)
            got.append(n)
            c.close()

    try:
        diag.read()  # baseline, and the listener opens
        assert not diag.listen_errors, diag.listen_errors
        t = threading.Thread(target=serve)
        t.start()
        for i in range(k):
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(b"s" * (1000 + i))
        t.join(10)
        deadline = time.monotonic() + 5
        gone = []
        while time.monotonic() < deadline:  # the kernel frees them from a work queue
            diag.read()
            gone += [sk for _, sk in diag.destroyed if port in (sk.lport, sk.rport) and sk.rport]
            if len(gone) >= 2 * k:
                break
            time.sleep(0.05)
    finally:
        srv.close()
        diag.close()
    assert got == [1000 + i for i in range(k)]
    sent = sorted(sk.bytes_sent - sk.bytes_retrans for sk in gone if sk.rport == port)
    assert sent == [1000 + i for i in range(k)]  # payload, no SYN/FIN, retransmits once
    # the server read each to EOF: bytes_received counts the FIN, which it consumed
    server = [sk for sk in gone if sk.lport == port]
    assert sorted(sk.bytes_received - 1 for sk in server) == [1000 + i for i in range(k)]
    assert all(sk.rqueue == 0 for sk in server)
    assert len({sk.cookie for sk in gone}) == 2 * k
    assert diag.destroy_overflows == 0
