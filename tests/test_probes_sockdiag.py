"""sock_diag decoding and retransmit deltas (probes/sockdiag.py), offline.

The fixture is a real inet_diag dump of one loopback connection, captured
beside `ss -tnie` at the same instant (sockdiag_loopback.ss.txt): the decoded
figures must be those ss printed from the same replies. One test (marked
``kernel``) asks the running kernel for exact lookups of its own sockets."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import socket
import struct
from pathlib import Path
from typing import Any

import pytest

from fsdp_sentinel.probes import sockdiag as D
from fsdp_sentinel.probes.sockowners import SocketOwners

FIX = Path(__file__).parent / "fixtures"


def _ss_sockets() -> dict[int, dict[str, str]]:
    """ss -tnie's sockets by local port: its key:value words and the rest."""
    lines = (FIX / "sockdiag_loopback.ss.txt").read_text().splitlines()[1:]
    out = {}
    for head, detail in zip(lines[::2], lines[1::2], strict=True):
        cols = head.split()
        words = dict(re.findall(r"(\w+):([\w./]+)", head + " " + detail))
        words["local"] = cols[3]
        out[int(cols[3].rsplit(":", 1)[1])] = words
    return out


def test_real_dump_decodes_to_what_ss_printed() -> None:
    socks, done = D.parse_dump((FIX / "sockdiag_loopback.bin").read_bytes())
    assert done
    want = _ss_sockets()
    assert sorted(sk.lport for sk in socks) == sorted(want)
    for sk in socks:
        ss = want[sk.lport]
        assert sk.family == socket.AF_INET
        assert f"{socket.inet_ntoa(sk.laddr)}:{sk.lport}" == ss["local"]
        assert sk.inode == int(ss["ino"])
        assert sk.cookie == int(ss["sk"], 16)
        assert sk.srtt_us == round(float(ss["rtt"].split("/")[0]) * 1000)
        assert sk.cwnd == int(ss["cwnd"])
        assert sk.bytes_acked == int(ss.get("bytes_acked", 0))
        assert sk.bytes_received == int(ss.get("bytes_received", 0))
        assert sk.snd_wnd == int(ss["snd_wnd"])
        assert sk.total_retrans == 0 and sk.state == 1
        assert sk.dsack_dups == int(ss.get("dsack_dups", 0))  # ss prints it when not 0


def _message(family: int, src: bytes, dst: bytes, info: bytes, cookie: int = 7) -> bytes:
    head = struct.pack("=BBBB", family, 1, 0, 0) + struct.pack(">HH", 1000, 2000)
    body = head + src + dst + struct.pack("=IQIIIII", 0, cookie, 0, 0, 0, 0, 42)
    nla = struct.pack("=HH", 4 + len(info), D.INET_DIAG_INFO) + info
    body += nla + b"\0" * (-len(nla) % 4)
    return struct.pack("=IHHII", 16 + len(body), D.SOCK_DIAG_BY_FAMILY, 2, 1, 0) + body


def _info(size: int, rtt: int = 1500, retrans: int = 3) -> bytes:
    b = bytearray(size)
    struct.pack_into("=I", b, 68, rtt)
    struct.pack_into("=I", b, 80, 10)
    struct.pack_into("=I", b, 100, retrans)
    return bytes(b)


DONE = struct.pack("=IHHIIi", 20, D.NLMSG_DONE, 2, 1, 0, 0)


def test_v4_mapped_ipv6_folds_to_ipv4_and_old_tcp_info_has_no_snd_wnd() -> None:
    mapped = lambda a: b"\0" * 10 + b"\xff\xff" + socket.inet_aton(a)  # noqa: E731
    data = _message(socket.AF_INET6, mapped("10.0.0.1"), mapped("10.0.0.2"), _info(136)) + DONE
    (sk,), done = D.parse_dump(data)
    assert done and sk.family == socket.AF_INET
    assert (sk.laddr, sk.raddr) == (socket.inet_aton("10.0.0.1"), socket.inet_aton("10.0.0.2"))
    assert (sk.lport, sk.rport, sk.inode, sk.cookie) == (1000, 2000, 42, 7)
    assert (sk.srtt_us, sk.cwnd, sk.total_retrans, sk.snd_wnd) == (1500, 10, 3, None)
    assert sk.dsack_dups == 0  # a tcp_info before Linux 5.0 has no D-SACK count


def test_d_sack_count_is_read_where_the_uapi_puts_it() -> None:
    info = bytearray(_info(232))
    struct.pack_into("=I", info, 216, 5)  # tcpi_dsack_dups, after tcpi_bytes_retrans
    z = socket.inet_aton("10.0.0.1")
    (sk,), _ = D.parse_dump(_message(socket.AF_INET, z + b"\0" * 12, z + b"\0" * 12, bytes(info)))
    assert (sk.total_retrans, sk.dsack_dups) == (3, 5)


def test_real_ipv6_stays_ipv6_and_a_socket_without_tcp_info_is_skipped() -> None:
    a6, b6 = (
        socket.inet_pton(socket.AF_INET6, "fd00::1"),
        socket.inet_pton(socket.AF_INET6, "fd00::2"),
    )
    data = _message(socket.AF_INET6, a6, b6, _info(232)) + _message(socket.AF_INET, a6, b6, b"")
    socks, done = D.parse_dump(data)
    assert not done  # no NLMSG_DONE yet: the caller reads on
    assert [(sk.family, sk.laddr) for sk in socks] == [(socket.AF_INET6, a6)]


def test_netlink_error_raises_with_its_errno() -> None:
    err = struct.pack("=IHHIIi", 20, D.NLMSG_ERROR, 0, 1, 0, -errno.EPERM)
    with pytest.raises(OSError) as e:
        D.parse_dump(err)
    assert e.value.errno == errno.EPERM


def _Sk(cookie: int, total: int, dsack: int = 0) -> D.DiagSocket:  # noqa: N802
    z = b"\0" * 4
    return D.DiagSocket(2, z, 1, z, 2, cookie, 0, 0, 1, 0, 0, total, 0, 0, None, dsack_dups=dsack)


class _Retrans:
    """``SockDiag.deltas`` seen as retransmits alone (the D-SACK half has its own test)."""

    def __init__(self, diag: D.SockDiag) -> None:
        self.diag = diag

    def __call__(self, *a: Any) -> dict[Any, int]:
        return {k: c.retrans for k, c in self.diag.deltas(*a).items() if c.retrans}


def test_retransmit_deltas_baseline_first_read_then_count_new_sockets_whole() -> None:
    diag = D.SockDiag(netns_dir=None)
    retrans_delta = _Retrans(diag)
    ns, other = (1, 10), (1, 11)
    assert retrans_delta([(ns, _Sk(1, 5))], {ns}) == {}  # baseline: may predate us
    read = [(ns, _Sk(1, 9)), (ns, _Sk(2, 4)), (other, _Sk(3, 6))]
    # socket 1 moved by 4; socket 2 is new in a namespace read before: all 4
    # count; namespace `other` is read for the first time: its baseline.
    assert retrans_delta(read, {ns, other}) == {(ns, 1): 4, (ns, 2): 4}
    # `ns` not read this time: it keeps its figures, nothing is counted twice.
    assert retrans_delta([(other, _Sk(3, 8))], {other}) == {(other, 3): 2}
    assert retrans_delta([(ns, _Sk(1, 9)), (ns, _Sk(2, 5))], {ns}) == {(ns, 2): 1}


def test_d_sack_deltas_ride_with_the_retransmits_and_count_alone_too() -> None:
    """A socket's D-SACKed segments rise with, or after, its retransmits (the
    report comes an RTT later), or alone (a duplicate the network made)."""
    diag = D.SockDiag(netns_dir=None)
    ns = (1, 10)
    assert diag.deltas([(ns, _Sk(1, 5, 2))], {ns}) == {}  # baseline
    assert diag.deltas([(ns, _Sk(1, 9, 2))], {ns}) == {(ns, 1): D.Counts(4, 0)}
    assert diag.deltas([(ns, _Sk(1, 9, 5))], {ns}) == {(ns, 1): D.Counts(0, 3)}
    assert diag.deltas([(ns, _Sk(1, 9, 5))], {ns}) == {}
    # new sockets count whole, destroyed ones up to their final figures
    got = diag.deltas([(ns, _Sk(2, 3, 3))], {ns}, [(ns, _Sk(1, 10, 7))])
    assert got == {(ns, 1): D.Counts(1, 2), (ns, 2): D.Counts(3, 3)}


def test_socket_owner_scans_only_the_given_pids_once_per_poll(tmp_path: Path) -> None:
    for pid, fds in ((100, {"3": "socket:[555]", "4": "/dev/null"}), (200, {"5": "socket:[777]"})):
        d = tmp_path / str(pid) / "fd"
        d.mkdir(parents=True)
        for fd, target in fds.items():
            os.symlink(target, d / fd)
    owners = SocketOwners(str(tmp_path))
    assert owners.owner(555, [100]) == 100
    assert owners.owner(777, [100]) == 0  # pid 200 was not asked about
    assert owners.scans == 1  # the miss did not rescan within the same poll
    owners.round += 1
    assert owners.owner(777, [100, 200]) == 200
    assert owners.owner(0, [100]) == 0


def test_destroyed_sockets_count_their_last_retransmits_once() -> None:
    diag = D.SockDiag(netns_dir=None)
    retrans_delta = _Retrans(diag)
    ns = (1, 10)
    assert retrans_delta([(ns, _Sk(1, 5)), (ns, _Sk(2, 1))], {ns}, []) == {}  # baseline
    # socket 1 closed after retransmitting 2 more; socket 9 was born and died
    # between two reads (never dumped): all its retransmits count.
    got = retrans_delta([(ns, _Sk(2, 1))], {ns}, [(ns, _Sk(1, 7)), (ns, _Sk(9, 3))])
    assert got == {(ns, 1): 2, (ns, 9): 3}
    # socket 2 left the dump at this read (closing); its destroy message comes
    # one read later and counts from the figure it had, not from zero.
    assert retrans_delta([], {ns}, []) == {}
    assert retrans_delta([], {ns}, [(ns, _Sk(2, 4))]) == {(ns, 2): 3}
    # freed after the dump of the same read: in both, counted once, up to the final figure
    assert retrans_delta([(ns, _Sk(5, 2))], {ns}, []) == {(ns, 5): 2}
    assert retrans_delta([(ns, _Sk(5, 3))], {ns}, [(ns, _Sk(5, 4))]) == {(ns, 5): 2}
    assert retrans_delta([], {ns}, [(ns, _Sk(5, 4))]) == {(ns, 5): 4}  # a later copy: new


def test_destroyed_sockets_of_a_namespace_first_read_are_its_baseline() -> None:
    diag = D.SockDiag(netns_dir=None)
    retrans_delta = _Retrans(diag)
    ns = (1, 10)
    assert retrans_delta([(ns, _Sk(1, 5))], {ns}, [(ns, _Sk(3, 9))]) == {}
    assert retrans_delta([(ns, _Sk(1, 6))], {ns}, []) == {(ns, 1): 1}


def test_destroy_listener_drain_decodes_every_queued_message() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    b.setblocking(False)
    info = bytearray(_info(240, retrans=4))
    struct.pack_into("=QQ", info, 200, 5000, 1000)  # bytes_sent, bytes_retrans
    try:
        lo = socket.inet_aton("127.0.0.1") + b"\0" * 12
        a.send(_message(socket.AF_INET, lo, lo, bytes(info), cookie=11))
        a.send(_message(socket.AF_INET, lo, lo, _info(240), cookie=12))
        got, overflows = D.drain_destroyed(b)
    finally:
        a.close()
        b.close()
    assert overflows == 0
    assert [(sk.cookie, sk.total_retrans) for sk in got] == [(11, 4), (12, 3)]
    assert (got[0].bytes_sent, got[0].bytes_retrans) == (5000, 1000)


def test_a_lookup_request_names_one_socket_by_4_tuple_and_cookie() -> None:
    sk = D.DiagSocket(2, b"\x7f\0\0\x01", 4242, b"\xc6\x12\0\x02", 80, 0x1122334455667788,
                      0, 0, 1, 0, 0, 0, 0, 0, None)  # fmt: skip
    msg = D.lookup_request(sk, 7)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", msg)
    assert (length, kind, seq) == (len(msg), D.SOCK_DIAG_BY_FAMILY, 7)
    assert flags == D.NLM_F_REQUEST  # one answer, no dump
    body = msg[16:]
    assert len(body) == 56 and body[0] == socket.AF_INET and body[1] == socket.IPPROTO_TCP
    assert struct.unpack_from(">HH", body, 8) == (4242, 80)
    assert body[12:16] == sk.laddr and body[28:32] == sk.raddr
    assert struct.unpack_from("=Q", body, 48)[0] == sk.cookie


@pytest.mark.kernel
def test_lookups_return_what_the_dump_does_and_none_once_a_socket_is_gone() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    ends = []
    try:
        for _ in range(3):
            c = socket.create_connection(srv.getsockname())
            a, _ = srv.accept()
            c.sendall(b"x" * 1000)
            a.recv(1000)
            ends += [c, a]
        sock = D.open_in_namespace(None)
        ports = {e.getsockname()[1] for e in ends}
        mine = [sk for sk in D.dump(sock) if sk.lport in ports and sk.rport in ports]
        assert len(mine) == 6
        got = D.lookup(sock, mine)
        assert got is not None
        assert [(g.lport, g.rport, g.cookie, g.bytes_acked) for g in got] == [
            (m.lport, m.rport, m.cookie, m.bytes_acked) for m in mine
        ]
        # Another socket's cookie on the same 4-tuple: not it.
        assert D.lookup(sock, [dataclasses.replace(mine[0], cookie=mine[0].cookie ^ 1)]) is None
        ends[0].close()
        ends[1].close()
        assert D.lookup(sock, mine) is None
        # Nothing of the failed lookups is left to spoil the next dump.
        left = [sk for sk in D.dump(sock) if sk.lport in ports and sk.rport in ports]
        assert {sk.cookie for sk in left} <= {m.cookie for m in mine}
        assert all(type(sk) is D.DiagSocket for sk in left)
        sock.close()
    finally:
        for e in ends:
            e.close()
        srv.close()
