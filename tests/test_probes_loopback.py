"""Real probes on real loopback traffic, checked against the sender's own
count and `ss -tin` (the kernel's sock_diag view, an independent oracle)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest
from probes_util import Peer, release, ss_find

from fsdp_sentinel.probes.loader import ProbeConfig, ProbeSet

pytestmark = [pytest.mark.kernel, pytest.mark.root]

N = 23 * 1024 * 1024 + 7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def probes() -> Iterator[ProbeSet]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    ps = ProbeSet(ProbeConfig(families=("tcp", "netdev")))
    ps.start()
    try:
        yield ps
    finally:
        ps.close()


def _collect(ps: ProbeSet, recs: list[dict], polls: int = 1) -> list[dict]:
    for _ in range(polls):
        recs += ps.poll()
    return recs


def _sum(recs: list[dict], src: str, dst: str) -> tuple[int, int, set[int]]:
    tx = rx = 0
    pids = set()
    for r in recs:
        if r["kind"] == "flow" and r["src"] == src and r["dst"] == dst:
            tx += r["tx_bytes"]
            rx += r["rx_bytes"]
            pids.add(r["pid"])
    return tx, rx, pids


def test_known_transfer_matches_sender_and_ss(probes: ProbeSet) -> None:
    port = _free_port()
    recs: list[dict] = []
    rcv = Peer("recv", "127.0.0.1", str(port), str(N))
    snd = None
    try:
        rcv.expect("listening")
        _collect(probes, recs)
        snd = Peer("send", "127.0.0.1", str(port), str(N))
        cport = snd.expect("port")
        # Poll while the transfer runs: deltas must add up across polls.
        sent = snd.expect("sent")
        _collect(probes, recs)
        assert rcv.expect("got") == str(N)
        client, server = f"127.0.0.1:{cport}", f"127.0.0.1:{port}"
        ss_c, ss_s = ss_find(client), ss_find(server)
        time.sleep(0.05)
        _collect(probes, recs)
        tx, rx, pids = _sum(recs, client, server)
        assert int(sent) == N
        assert tx == N, f"probe counted {tx} sent, the sender sent {N}"
        assert rx == 0
        assert pids == {snd.pid}
        s_tx, s_rx, s_pids = _sum(recs, server, client)
        assert s_rx == N and s_tx == 0 and s_pids == {rcv.pid}
        # ss: bytes_acked counts the SYN as well; within 0.5% either way.
        assert abs(tx - ss_c.num("bytes_acked")) <= 0.005 * N
        assert abs(s_rx - ss_s.num("bytes_received")) <= 0.005 * N
        # Open connection: the flow carries path figures from tcp_probe.
        flows = [r for r in recs if r["kind"] == "flow" and r["src"] == client]
        assert any("srtt_us" in r and "cwnd" in r for r in flows)
        # The bytes went through hot slots (read through mmap), not only socks.
        hot = probes.stats()["hot_slots"]
        assert hot["mmap"] is True and hot["claimed"] >= 2, hot
    finally:
        release(snd, rcv)
    recs = probes.poll()
    opens = [r for r in recs if r["kind"] == "conn" and r["src"] == client]
    assert {r["what"] for r in opens} >= {"close"}


def test_reset_appears_when_peer_dies(probes: ProbeSet) -> None:
    port = _free_port()
    rcv = Peer("recv", "127.0.0.1", str(port), "1000")
    rcv.expect("listening")
    snd = Peer("send", "127.0.0.1", str(port), "1000", "--linger0", "--die")
    try:
        cport = snd.expect("port")
        snd.expect("sent")
        rcv.expect("got")
        probes.poll()
        snd.tell()  # the sender arms SO_LINGER 0 and dies: its kernel sends RST
        snd.proc.wait(timeout=10)
        time.sleep(0.1)
        recs = probes.poll()
    finally:
        rcv.tell()
        rcv.close()
        snd.close()
    client, server = f"127.0.0.1:{cport}", f"127.0.0.1:{port}"
    resets = [r for r in recs if r["kind"] == "conn" and r["what"] == "reset"]
    got = {(r["src"], r["dst"], r["direction"]) for r in resets}
    assert (client, server, "sent") in got
    assert (server, client, "received") in got
    received = next(r for r in resets if r["src"] == server)
    assert received["pid"] == rcv.pid


def test_short_lived_connections_are_counted(probes: ProbeSet) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    port = srv.getsockname()[1]
    k = 25
    probes.poll()
    peer = Peer("short", "127.0.0.1", str(port), str(k))
    try:
        for _ in range(k):
            c, _ = srv.accept()
            while c.recv(65536):
                pass
            c.close()
        peer.expect("done")
    finally:
        peer.close()
        srv.close()
    time.sleep(0.05)
    recs = probes.poll()
    server = f"127.0.0.1:{port}"
    sent = sorted(r["tx_bytes"] for r in recs if r["kind"] == "flow" and r["dst"] == server)
    assert sent == [1000 + i for i in range(k)]
    got = sorted(r["rx_bytes"] for r in recs if r["kind"] == "flow" and r["src"] == server)
    assert got == [1000 + i for i in range(k)]
    conns = [r for r in recs if r["kind"] == "conn" and r["dst"] == server]
    assert sum(r["count"] for r in conns if r["what"] == "open") == k
    assert sum(r["count"] for r in conns if r["what"] == "close") == k
    assert {r["pid"] for r in conns} == {peer.pid}


def test_sockets_sharing_too_few_hot_slots_count_exactly() -> None:
    """Two hot slots for 16 busy sockets (8 connections, both ends here): most
    sockets collide and count in socks, slots are claimed, freed at close and
    claimed again by the next round; polled mid-transfer, every socket's
    bytes come out exact."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    import threading

    ps = ProbeSet(ProbeConfig(families=("tcp",), hot_bits=1))
    ps.start()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    port = srv.getsockname()[1]
    server = f"127.0.0.1:{port}"
    conns = 8
    want: dict[str, int] = {}  # client address -> bytes it sent
    got: dict[str, int] = {}  # client address -> bytes the server read
    recs: list[dict] = []
    try:
        ps.poll()
        for rnd in range(2):

            def sink() -> None:
                for _ in range(conns):
                    c, addr = srv.accept()
                    threading.Thread(target=drain, args=(c, f"{addr[0]}:{addr[1]}")).start()

            def drain(c: socket.socket, who: str) -> None:
                n = 0
                while k := len(c.recv(1 << 16)):
                    n += k
                got[who] = n
                c.close()

            t = threading.Thread(target=sink)
            t.start()
            clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(conns)]
            for step in range(40):
                for i, c in enumerate(clients):
                    c.sendall(b"h" * (4096 * (i + 1) + 13 * rnd + step))
                if step == 20:
                    recs += ps.poll()
            for i, c in enumerate(clients):
                host, cport = c.getsockname()
                want[f"{host}:{cport}"] = sum(4096 * (i + 1) + 13 * rnd + s for s in range(40))
                c.close()
            t.join()
            deadline = time.monotonic() + 5
            while len(got) < len(want) and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.05)
        recs += ps.poll()
        hot = ps.stats()["hot_slots"]
    finally:
        srv.close()
        ps.close()
    assert got == want
    for client, n in want.items():
        tx, rx, _ = _sum(recs, client, server)
        s_tx, s_rx, _ = _sum(recs, server, client)
        assert (tx, rx, s_tx, s_rx) == (n, 0, 0, n), client
    assert hot["claimed"] >= 2, hot  # both slots used, then freed and used again


def test_netdev_records_every_device_every_poll(probes: ProbeSet) -> None:
    probes.poll()
    recs = [r for r in probes.poll() if r["kind"] == "netdev"]
    assert "lo" in {r["dev"] for r in recs}
    assert all(r["dt"] > 0 and r["tx_bytes"] >= 0 for r in recs)


def test_pid_filter_counts_only_registered() -> None:
    ps = ProbeSet(ProbeConfig(pid_filter=True, families=("tcp",)))
    ps.start()
    port = _free_port()
    rcv = Peer("recv", "127.0.0.1", str(port), "500000")
    snd = None
    try:
        rcv.expect("listening")
        snd = Peer("send", "127.0.0.1", str(port), "500000")
        ps.register_pid(snd.pid)
        time.sleep(0.05)  # registered before it sends: it waits on "port"
        cport = snd.expect("port")
        snd.expect("sent")
        rcv.expect("got")
        recs = ps.poll()
        ps.unregister_pid(snd.pid)
    finally:
        release(snd, rcv)
        ps.close()
    flows = [r for r in recs if r["kind"] == "flow"]
    assert {r["pid"] for r in flows} == {snd.pid}
    assert sum(r["tx_bytes"] for r in flows if r["src"] == f"127.0.0.1:{cport}") == 500000


def test_quiet_polls_skip_the_drains_and_read_only_the_held_slots_yet_count_exactly() -> None:
    # Only this process registered: nothing else creates entries. A poll with
    # nothing created since the last drain skips it (and rereads only the
    # slots held at the last whole read); the next connection, its bytes
    # moved and closed between two polls, comes out whole all the same.
    ps = ProbeSet(ProbeConfig(pid_filter=True, families=("tcp",)))
    ps.start()
    ps.register_pid(os.getpid())
    try:
        ps.poll()  # the first poll drains every map
        hot = ps._hot
        assert hot is not None and hot.mapped
        for _ in range(3):
            ps.poll()
        assert all(ps.skipped_drains[m] >= 3 for m in ("flows", "closed", "conn_events")), (
            ps.skipped_drains
        )
        whole = hot.whole_reads
        srv, c, a, cli, ser = _connection()
        c.sendall(b"x" * 300_001)
        got = 0
        while got < 300_001:
            got += len(a.recv(1 << 16))
        a.sendall(b"y" * 17)
        assert c.recv(64) == b"y" * 17
        recs = ps.poll()  # the connection is open: its bytes through socks and a slot
        assert hot.whole_reads == whole + 1  # a claim since: every slot read
        c.sendall(b"z" * 5)
        assert a.recv(64) == b"z" * 5
        recs += ps.poll()  # no claim since: the held slots only
        assert hot.whole_reads == whole + 1
        c.sendall(b"w" * 11)  # then closed: these bytes only the closed map holds
        assert a.recv(64) == b"w" * 11
        for sock in (c, a, srv):
            sock.close()
        time.sleep(0.05)
        skipped = dict(ps.skipped_drains)
        recs += ps.poll()  # closed since the last poll: drained from closed
        assert ps.skipped_drains["closed"] == skipped["closed"]
    finally:
        ps.close()
    assert _sum(recs, cli, ser)[:2] == (300_017, 17)
    assert _sum(recs, ser, cli)[:2] == (17, 300_017)
    assert {r["what"] for r in recs if r["kind"] == "conn" and r["src"] == cli} >= {"close"}


def test_flows_command_prints_trace_v1_json() -> None:
    import json
    import subprocess
    import sys

    from fsdp_sentinel import trace

    cmd = [sys.executable, "-m", "fsdp_sentinel", "flows", "--duration", "4", "--interval", "0.5"]
    proc = subprocess.Popen(
        [*cmd, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        # wait until it has compiled and attached ("missing ..." lines may come first)
        while "probes attached" not in (line := proc.stderr.readline()):
            assert line, "flows exited before attaching"
        port = _free_port()
        rcv = Peer("recv", "127.0.0.1", str(port), "300000")
        rcv.expect("listening")
        snd = Peer("send", "127.0.0.1", str(port), "300000")
        cport = snd.expect("port")
        snd.expect("sent")
        rcv.expect("got")
        for p in (snd, rcv):
            p.tell()
            p.close()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    recs = [json.loads(line) for line in out.splitlines()]
    assert recs and all(trace.validate(r) is None and r["kind"] == "flow" for r in recs)
    sent = sum(r["tx_bytes"] for r in recs if r["src"] == f"127.0.0.1:{cport}")
    assert sent == 300000


def _connection() -> tuple[socket.socket, socket.socket, socket.socket, str, str]:
    """A loopback connection: (listener, client end, server end, "ip:port" of each end)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    c = socket.create_connection(srv.getsockname())
    a, _ = srv.accept()
    return srv, c, a, "{}:{}".format(*c.getsockname()), "{}:{}".format(*a.getsockname())


def test_connection_older_than_the_probes_is_named_on_demand() -> None:
    """A connection made before the probes loaded was never seen opening:
    tcp_probe is attached until it is named, its early bytes wait parked and
    all count; a unix socket of the same process is then recognised as no
    TCP socket, and tcp_probe goes away although it keeps sending."""
    srv, c, a, client, server = _connection()
    u1, u2 = socket.socketpair()
    ps = ProbeSet(ProbeConfig(pid_filter=True, families=("tcp",)))
    ps.register_pid(os.getpid())
    ps.start()
    chunk = 100_003
    try:
        ps.poll()
        recs: list[dict] = []

        def burst() -> None:
            c.sendall(b"x" * chunk)
            got = 0
            while got < chunk:
                got += len(a.recv(1 << 20))
            u1.send(b"y" * 1000)
            u2.recv(1000)
            time.sleep(0.05)
            recs.extend(ps.poll())

        for _ in range(4):
            burst()
        named_after = ps.naming_polls
        for _ in range(3):
            burst()
    finally:
        ps.close()
        for s in (c, a, srv, u1, u2):
            s.close()
    tx, _, _ = _sum(recs, client, server)
    _, rx, _ = _sum(recs, server, client)
    assert (tx, rx) == (7 * chunk, 7 * chunk), recs
    assert {r["pid"] for r in recs if r["kind"] == "flow"} == {os.getpid()}
    assert named_after >= 1, "tcp_probe was never needed: the test proves nothing"
    assert ps.naming_polls == named_after, "tcp_probe stayed attached for the unix socket"


def test_a_unix_socket_beside_an_idle_unnamed_connection_is_given_up_on() -> None:
    """A process holding an idle TCP connection older than the probes (never
    named: it moves no bytes, so no segment names it) and a unix socket that
    keeps sending: the unix socket's bytes wait ORPHAN_POLLS polls with
    tcp_probe attached (twice at most), then the socket is skipped for good: tcp_probe stays
    detached and sock_diag goes back to exact lookups (as in a training job:
    the c10d store's connection, the emitter's datagram socket). Once the old
    connection moves bytes it is named and counted in full."""
    from fsdp_sentinel.probes.loader import ORPHAN_POLLS

    srv, c, a, client, server = _connection()
    u1, u2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ps = ProbeSet(ProbeConfig(pid_filter=True, families=("tcp",)))
    ps.register_pid(os.getpid())
    ps.start()
    recs: list[dict] = []
    try:
        ps.poll()

        def tick() -> None:
            u1.send(b"y" * 1000)
            u2.recv(1000)
            time.sleep(0.02)
            recs.extend(ps.poll())

        # Bytes that come between a poll's read of the parked ones and its
        # verdict park once more: given up on at the second expiry at most.
        for _ in range(2 * ORPHAN_POLLS + 1):
            tick()
        assert ps.naming_polls >= 1, "tcp_probe was never needed: the test proves nothing"
        named, lookups = ps.naming_polls, ps.diag_reads["lookup"]
        for _ in range(4):
            tick()
        assert ps.naming_polls == named, "tcp_probe still attached for the unix socket"
        assert ps.diag_reads["lookup"] == lookups + 4, ps.diag_reads
        chunk = 70_001
        for _ in range(3):  # the old connection wakes up: named, counted
            c.sendall(b"x" * chunk)
            got = 0
            while got < chunk:
                got += len(a.recv(1 << 20))
            time.sleep(0.05)
            recs.extend(ps.poll())
        recs.extend(ps.poll())
    finally:
        ps.close()
        for s in (c, a, srv, u1, u2):
            s.close()
    tx, _, _ = _sum(recs, client, server)
    assert tx == 3 * chunk, recs


def _forget_opening(ps: ProbeSet, client_port: int, server_port: int) -> None:
    """Make the probes' state what it is when the kernel skipped both ends'
    ESTABLISHED events (a classic tracepoint firing while another BPF program
    or a map syscall holds the CPU is skipped, and counted as missed): the
    client's entry as SYN_SENT left it (its owner, no name), none for the
    server's end (a passive open is first seen at ESTABLISHED)."""
    table = ps._bpf[b"socks"]
    ends = 0
    for k, v in list(table.items()):
        if v.known and (v.t.lport, v.t.rport) == (client_port, server_port):
            leaf = table.Leaf()
            leaf.tgid = os.getpid()
            table[k] = leaf
            ends += 1
        elif v.known and (v.t.lport, v.t.rport) == (server_port, client_port):
            del table[k]
            ends += 1
    assert ends == 2, "the connection's ends were not in socks"


@pytest.mark.parametrize("poll_between", [False, True], ids=["closed-unseen", "polled-open"])
def test_a_connection_whose_opening_was_missed_counts_its_bytes_when_it_closes(
    poll_between: bool,
) -> None:
    """A short connection the probes never saw become ESTABLISHED moves its
    bytes parked under its socket's address; its CLOSE event names it, so
    every byte still counts: folded into closed by the kernel, and what a
    poll before the close had parked named by that closed entry (seen in CI
    under load: one of 20 short connections' bytes missing whole)."""
    ps = ProbeSet(ProbeConfig(families=("tcp",)))
    ps.start()
    recs: list[dict] = []
    try:
        ps.poll()
        srv, c, a, client, server = _connection()
        _forget_opening(ps, c.getsockname()[1], a.getsockname()[1])
        sent = [0, 0]

        def exchange(n: int) -> None:
            c.sendall(b"x" * n)
            got = 0
            while got < n:
                got += len(a.recv(1 << 20))
            a.sendall(b"y" * (n // 7))
            got = 0
            while got < n // 7:
                got += len(c.recv(1 << 20))
            sent[0] += n
            sent[1] += n // 7

        exchange(150_001)
        if poll_between:
            recs.extend(ps.poll())  # parked in user space now
            exchange(90_003)
        c.close()
        a.close()
        srv.close()
        time.sleep(0.1)
        recs.extend(ps.poll())
        recs.extend(ps.poll())
        lost = ps.stats()["unattributed_bytes"]
    finally:
        ps.close()
    tx, rx, _ = _sum(recs, client, server)
    assert (tx, rx) == (sent[0], sent[1]), (tx, rx, sent, lost)
    tx, rx, _ = _sum(recs, server, client)
    assert (tx, rx) == (sent[1], sent[0]), (tx, rx, sent, lost)
