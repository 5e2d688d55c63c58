"""Per-socket TCP path figures from sock_diag: the kernel's own ``tcp_info``.

``srtt``, ``cwnd``, the send window and the retransmit count of a connection
are fields the kernel keeps in every TCP socket, and ``inet_diag``
(``NETLINK_SOCK_DIAG`` with ``INET_DIAG_INFO``, what ``ss -ti`` reads) hands
them out for every socket of a network namespace in one dump. Reading them
once per poll costs a few netlink messages per namespace and nothing per
packet, where the ``tcp:tcp_probe`` tracepoint ran once per received segment
(~46k runs per GiB, the largest share of the probes' kernel time; see
BENCHMARKS.md). ``tcpi_total_retrans`` counts retransmitted *segments*, the
unit of the kernel's ``TcpRetransSegs``, where ``tcp:tcp_retransmit_skb`` fires
once per skb (a GSO skb is many segments).

What this view cannot see: a socket that opened and closed between two
reads (its last retransmits are not counted; its bytes still are, by the
byte tracepoints), and figures between reads (srtt is the value at the read).

Namespaces read: our own, every named one under ``netns_dir`` and those of
the processes the caller names (a rank may live in a namespace nobody
named), each once (deduplicated by the namespace's inode). A netlink socket
is opened inside a namespace by entering it on this thread only (setns),
and keeps reading that namespace after the thread has returned.

The decoder (``parse_dump``) is pure and tested on bytes; the rest is a thin
shell around sockets.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
INET_DIAG_INFO = 2
CLONE_NEWNET = 0x40000000

#: states whose sockets carry tcp_info: all but LISTEN, TIME_WAIT, CLOSE,
#: SYN_RECV (request socks) and NEW_SYN_RECV.
TCP_STATES = sum(1 << s for s in (1, 2, 4, 5, 8, 9, 11))

_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# inet_diag_req_v2: family, protocol, ext, pad, states, then inet_diag_sockid
# (sport, dport big-endian, src[16], dst[16], if, cookie[2]): 56 bytes.
_REQ = struct.Struct("=BBBxI48x")
# inet_diag_msg (72 bytes): family, state, timer, retrans; sockid (sport,
# dport big-endian at 4, src at 8, dst at 24, if, cookie at 44); expires,
# rqueue, wqueue, uid at 64, inode at 68; then attributes.
_NLA = struct.Struct("=HH")

# struct tcp_info offsets (UAPI, fields only ever appended).
_TI_RTT, _TI_SND_CWND, _TI_TOTAL_RETRANS = 68, 80, 100
_TI_BYTES_ACKED, _TI_BYTES_RECEIVED, _TI_SND_WND = 120, 128, 228


@dataclass(frozen=True)
class DiagSocket:
    """One TCP socket as sock_diag reports it at one instant."""

    family: int
    laddr: bytes  # 4 bytes (IPv4, v4-mapped IPv6 folded) or 16
    lport: int
    raddr: bytes
    rport: int
    cookie: int  # the kernel's socket cookie: unique while the socket lives
    inode: int  # 0 once no process holds it
    uid: int
    state: int
    srtt_us: int  # tcpi_rtt (smoothed, microseconds), as tcp_probe's srtt and ss's rtt
    cwnd: int  # segments
    total_retrans: int  # segments retransmitted over the socket's life
    bytes_acked: int
    bytes_received: int
    snd_wnd: int | None  # None on kernels whose tcp_info predates the field


def request(family: int, seq: int = 1) -> bytes:
    """A dump request for every TCP socket of ``family`` with tcp_info."""
    body = _REQ.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), TCP_STATES)
    return (
        _NLMSG.pack(
            _NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0
        )
        + body
    )


def _is_v4mapped(a: bytes) -> bool:
    return a[:10] == b"\0" * 10 and a[10:12] == b"\xff\xff"


def _addrs(family: int, src: bytes, dst: bytes) -> tuple[int, bytes, bytes]:
    """Fold v4-mapped IPv6 to IPv4, as the kernel programs do (common.c)."""
    if family == socket.AF_INET6 and not (_is_v4mapped(src) and _is_v4mapped(dst)):
        return socket.AF_INET6, src, dst
    if family == socket.AF_INET6:
        return socket.AF_INET, src[12:16], dst[12:16]
    return socket.AF_INET, src[:4], dst[:4]


def _u32(b: bytes, off: int) -> int | None:
    return struct.unpack_from("=I", b, off)[0] if len(b) >= off + 4 else None


def _u64(b: bytes, off: int) -> int:
    return struct.unpack_from("=Q", b, off)[0] if len(b) >= off + 8 else 0


def _decode(payload: bytes) -> DiagSocket | None:
    if len(payload) < 72:
        return None
    family, state = payload[0], payload[1]
    sport, dport = struct.unpack_from(">HH", payload, 4)
    src, dst = payload[8:24], payload[24:40]
    cookie = struct.unpack_from("=Q", payload, 44)[0]
    uid, inode = struct.unpack_from("=II", payload, 64)
    info = b""
    off = 72
    while off + 4 <= len(payload):
        nla_len, nla_type = _NLA.unpack_from(payload, off)
        if nla_len < 4:
            break
        if nla_type & 0x3FFF == INET_DIAG_INFO:
            info = payload[off + 4 : off + nla_len]
        off += (nla_len + 3) & ~3
    if len(info) < _TI_BYTES_RECEIVED + 8:
        return None  # not a full socket (no tcp_info)
    fam, laddr, raddr = _addrs(family, src, dst)
    return DiagSocket(
        family=fam,
        laddr=laddr,
        lport=sport,
        raddr=raddr,
        rport=dport,
        cookie=cookie,
        inode=inode,
        uid=uid,
        state=state,
        srtt_us=_u32(info, _TI_RTT) or 0,
        cwnd=_u32(info, _TI_SND_CWND) or 0,
        total_retrans=_u32(info, _TI_TOTAL_RETRANS) or 0,
        bytes_acked=_u64(info, _TI_BYTES_ACKED),
        bytes_received=_u64(info, _TI_BYTES_RECEIVED),
        snd_wnd=_u32(info, _TI_SND_WND),
    )


def parse_dump(data: bytes) -> tuple[list[DiagSocket], bool]:
    """The sockets in a chunk of dump replies, and whether NLMSG_DONE was seen.

    Raises OSError on a netlink error message (its errno)."""
    out: list[DiagSocket] = []
    off = 0
    while off + _NLMSG.size <= len(data):
        length, kind, _, _, _ = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size:
            break
        body = data[off + _NLMSG.size : off + length]
        if kind == NLMSG_DONE:
            return out, True
        if kind == NLMSG_ERROR:
            err = -struct.unpack_from("=i", body, 0)[0]
            if err:
                raise OSError(err, os.strerror(err))
        elif kind == SOCK_DIAG_BY_FAMILY:
            sk = _decode(body)
            if sk is not None:
                out.append(sk)
        off += (length + 3) & ~3
    return out, False


def dump(
    sock: socket.socket, families: Iterable[int] = (socket.AF_INET, socket.AF_INET6)
) -> list[DiagSocket]:
    """Every TCP socket with tcp_info that ``sock``'s namespace holds."""
    out: list[DiagSocket] = []
    for seq, family in enumerate(families, start=1):
        sock.send(request(family, seq))
        done = False
        while not done:
            got, done = parse_dump(sock.recv(1 << 16))
            out += got
    return out


_libc: ctypes.CDLL | None = None


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def open_in_namespace(ns_path: str | None) -> socket.socket:
    """A sock_diag socket reading the namespace at ``ns_path`` (None: ours).

    The thread enters that namespace for the socket() call only and always
    returns to its own, even on error."""
    if ns_path is None:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    target = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
    home = os.open(
        f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY | os.O_CLOEXEC
    )
    try:
        _setns(target)
        try:
            return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


class SockDiag:
    """Reads every TCP socket's tcp_info in the namespaces named above.

    ``read(pids)`` returns every socket now, each tagged with its namespace;
    ``retrans_delta()`` turns consecutive reads into per-socket retransmit
    deltas. ``close()`` closes the sockets (idempotent)."""

    def __init__(self, netns_dir: str | None = "/run/netns", proc_root: str = "/proc") -> None:
        self.netns_dir = netns_dir
        self.proc_root = proc_root
        self._socks: dict[tuple[int, int], socket.socket] = {}
        self._prev: dict[tuple[int, int], dict[int, int]] = {}  # ns -> cookie -> total_retrans
        self.last_read: set[tuple[int, int]] = set()  # namespaces the last read() read
        self.errors: dict[str, str] = {}  # namespace path -> last read error
        self.read_errors = 0  # namespace reads that failed (their figures lost)

    def _paths(self, pids: Iterable[int]) -> Iterator[str | None]:
        yield None
        if self.netns_dir:
            with contextlib.suppress(OSError):
                for name in sorted(os.listdir(self.netns_dir)):
                    yield os.path.join(self.netns_dir, name)
        for pid in sorted(set(pids)):
            yield f"{self.proc_root}/{pid}/ns/net"

    def read(self, pids: Iterable[int] = ()) -> list[tuple[tuple[int, int], DiagSocket]]:
        """(namespace id, socket) for every TCP socket now."""
        out: list[tuple[tuple[int, int], DiagSocket]] = []
        read: set[tuple[int, int]] = set()
        wanted: dict[tuple[int, int], str | None] = {}
        for path in self._paths(pids):
            try:  # a namespace is known by its inode, however many names it has
                st = os.stat(path or f"/proc/self/task/{threading.get_native_id()}/ns/net")
            except OSError:  # process or namespace gone
                continue
            wanted.setdefault((st.st_dev, st.st_ino), path)
        for ident in set(self._socks) - set(wanted):
            self._drop(ident)  # namespace gone
        for ident, path in wanted.items():
            try:
                sock = self._socks.get(ident)
                if sock is None:
                    sock = self._socks[ident] = open_in_namespace(path)
                got = dump(sock)
            except OSError as e:  # namespace vanished mid-read, or no sock_diag
                self.errors[path or "self"] = str(e)
                self.read_errors += 1
                self._drop(ident)
                continue
            self.errors.pop(path or "self", None)
            out += [(ident, sk) for sk in got]
            read.add(ident)
        self.last_read = read
        return out

    def retrans_delta(
        self,
        read: list[tuple[tuple[int, int], DiagSocket]],
        namespaces: set[tuple[int, int]] | None = None,
    ) -> dict[tuple[tuple[int, int], int], int]:
        """(namespace, cookie) -> segments retransmitted since the namespace
        was last read. ``namespaces``: those this read covered (default
        ``last_read``); one not covered keeps its figures for the next. A
        socket first seen in a namespace read before is new: all its
        retransmits count; the first read of a namespace is its baseline
        (its sockets may be older than the probes)."""
        covered = self.last_read if namespaces is None else namespaces
        cur: dict[tuple[int, int], dict[int, int]] = {ns: {} for ns in covered}
        for ns, sk in read:
            cur.setdefault(ns, {})[sk.cookie] = sk.total_retrans
        out: dict[tuple[tuple[int, int], int], int] = {}
        for ns, socks in cur.items():
            prev = self._prev.get(ns)
            for cookie, total in socks.items():
                before = total if prev is None else prev.get(cookie, 0)
                if total > before:
                    out[(ns, cookie)] = total - before
            self._prev[ns] = socks
        return out

    def _drop(self, ident: tuple[int, int]) -> None:
        self._prev.pop(ident, None)  # read again, it starts from a baseline
        sock = self._socks.pop(ident, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for ident in list(self._socks):
            self._drop(ident)
