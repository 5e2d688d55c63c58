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

Sockets that close between two reads are not lost: in each namespace read
a second sock_diag socket listens on the kernel's destroy broadcast
(multicast groups ``SKNLGRP_INET_TCP_DESTROY`` and ``SKNLGRP_INET6_TCP_DESTROY``,
needs ``CAP_NET_ADMIN``), which hands out every TCP socket's final
``tcp_info`` as the kernel frees it, a socket born and gone between two reads
included. Its retransmits since the last read count at the next read. What
this view still cannot see: figures between reads (srtt is the value at the
read), and destroy messages the kernel dropped because the listener's buffer
was full (counted in ``destroy_overflows``).

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
import errno
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

log = logging.getLogger(__name__)

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
INET_DIAG_INFO = 2
CLONE_NEWNET = 0x40000000
#: sock_diag multicast groups (linux/sock_diag.h): TCP sockets destroyed, v4 and v6
SKNLGRP_INET_TCP_DESTROY, SKNLGRP_INET6_TCP_DESTROY = 1, 3
DESTROY_GROUPS = (1 << (SKNLGRP_INET_TCP_DESTROY - 1)) | (1 << (SKNLGRP_INET6_TCP_DESTROY - 1))
SO_RCVBUFFORCE = 33
DESTROY_RCVBUF = 4 << 20
#: a socket gone from the dump (closed, its destroy message not read yet, or
#: still held in CLOSE by its process) keeps its last figures this many reads
VANISHED_READS = 600

#: states whose sockets carry tcp_info: all but LISTEN, TIME_WAIT, CLOSE,
#: SYN_RECV (request socks) and NEW_SYN_RECV.
TCP_STATES = sum(1 << s for s in (1, 2, 4, 5, 8, 9, 11))

_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# inet_diag_req_v2: family, protocol, ext, pad, states, then inet_diag_sockid
# (sport, dport big-endian, src[16], dst[16], if, cookie[2]): 56 bytes.
_REQ_HEAD = struct.Struct("=BBBxI")  # family, protocol, ext, pad, states
_REQ = struct.Struct(_REQ_HEAD.format + "48x")  # a dump's: any socket
# inet_diag_msg (72 bytes): family, state, timer, retrans; sockid (sport,
# dport big-endian at 4, src at 8, dst at 24, if, cookie at 44); expires,
# rqueue, wqueue, uid at 64, inode at 68; then attributes.
_NLA = struct.Struct("=HH")

# struct tcp_info offsets (UAPI, fields only ever appended).
_TI_RTT, _TI_SND_CWND, _TI_TOTAL_RETRANS = 68, 80, 100
_TI_BYTES_ACKED, _TI_BYTES_RECEIVED, _TI_SND_WND = 120, 128, 228
_TI_BYTES_SENT, _TI_BYTES_RETRANS, _TI_DSACK_DUPS = 200, 208, 216


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
    #: payload bytes sent, retransmits included, and those retransmitted
    #: (tcpi_bytes_sent, tcpi_bytes_retrans: Linux 4.19+; 0 before)
    bytes_sent: int = 0
    bytes_retrans: int = 0
    rqueue: int = 0  # rcv_nxt - copied_seq: received, not read by the process (FIN included)
    #: segments the peer reported receiving twice (D-SACK, RFC 2883;
    #: tcpi_dsack_dups, Linux 5.0+, 0 before): a retransmit the peer reports
    #: so had already arrived, so it was spurious, not a loss
    dsack_dups: int = 0


class Counts(NamedTuple):
    """What one socket's counters rose by between two reads."""

    retrans: int  # segments retransmitted (tcpi_total_retrans)
    dsack_dups: int  # of those, reported back as duplicates (tcpi_dsack_dups)


def nl_request(
    msg_type: int, body: bytes, seq: int, flags: int = NLM_F_REQUEST | NLM_F_DUMP
) -> bytes:
    """A netlink request (a dump unless ``flags`` says otherwise): the header for
    ``msg_type`` and ``seq``, then ``body``."""
    return _NLMSG.pack(_NLMSG.size + len(body), msg_type, flags, seq, 0) + body


def request(family: int, seq: int = 1) -> bytes:
    """A dump request for every TCP socket of ``family`` with tcp_info."""
    body = _REQ.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), TCP_STATES)
    return nl_request(SOCK_DIAG_BY_FAMILY, body, seq)


_SOCKID_PORTS = struct.Struct(">HH")  # inet_diag_sockid: sport, dport (big-endian)
_SOCKID_TAIL = struct.Struct("=IQ")  # if, cookie (two u32, low word first)
#: exact lookups sent in one datagram: their replies (~0.5 kB each) must fit
#: the receive buffer, since the kernel answers them all inside send()
LOOKUP_BATCH = 64


def lookup_request(sk: DiagSocket, seq: int) -> bytes:
    """A request for exactly ``sk`` (4-tuple and cookie), with tcp_info: the kernel
    finds it by one hash lookup, where a dump walks its whole established
    table (262,144 buckets on this 24 GiB machine, ~1 ms a walk; the table
    grows with the host's memory, not with its sockets)."""
    body = (
        _REQ_HEAD.pack(sk.family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), TCP_STATES)
        + _SOCKID_PORTS.pack(sk.lport, sk.rport)
        + sk.laddr.ljust(16, b"\0")
        + sk.raddr.ljust(16, b"\0")
        + _SOCKID_TAIL.pack(0, sk.cookie)
    )
    return nl_request(SOCK_DIAG_BY_FAMILY, body, seq, NLM_F_REQUEST)


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
    rqueue = struct.unpack_from("=I", payload, 56)[0]
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
        bytes_sent=_u64(info, _TI_BYTES_SENT),
        bytes_retrans=_u64(info, _TI_BYTES_RETRANS),
        rqueue=rqueue,
        dsack_dups=_u32(info, _TI_DSACK_DUPS) or 0,
    )


def parse_dump(data: bytes) -> tuple[list[DiagSocket], bool]:
    """The sockets in a chunk of dump replies, and whether NLMSG_DONE was seen.

    Raises OSError on a netlink error message (its errno)."""
    out: list[DiagSocket] = []
    for kind, body in nl_messages(data):
        if kind == NLMSG_DONE:
            return out, True
        if kind == SOCK_DIAG_BY_FAMILY:
            sk = _decode(body)
            if sk is not None:
                out.append(sk)
    return out, False


def nl_messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of every netlink message in ``data``, in order (an
    acknowledgement, an error message with errno 0, is skipped).

    Raises OSError on a netlink error message (its errno)."""
    off = 0
    while off + _NLMSG.size <= len(data):
        length, kind, _, _, _ = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size:
            break
        body = data[off + _NLMSG.size : off + length]
        if kind == NLMSG_ERROR:
            err = -struct.unpack_from("=i", body, 0)[0]
            if err:
                raise OSError(err, os.strerror(err))
        else:
            yield kind, body
        off += (length + 3) & ~3


def nl_dump(
    sock: socket.socket, message: bytes, bufsize: int = 1 << 16
) -> Iterator[tuple[int, bytes]]:
    """Send one netlink dump request ``message`` (:func:`nl_request`); (type,
    payload) of every reply message up to NLMSG_DONE. The one dump loop of
    sock_diag here and of rtnetlink (``devstats``).

    Raises OSError on a netlink error message (its errno)."""
    sock.send(message)
    while True:
        for kind, payload in nl_messages(sock.recv(bufsize)):
            if kind == NLMSG_DONE:
                return
            yield kind, payload


def dump(
    sock: socket.socket, families: Iterable[int] = (socket.AF_INET, socket.AF_INET6)
) -> list[DiagSocket]:
    """Every TCP socket with tcp_info that ``sock``'s namespace holds."""
    out: list[DiagSocket] = []
    for seq, family in enumerate(families, start=1):
        for kind, body in nl_dump(sock, request(family, seq)):
            if kind == SOCK_DIAG_BY_FAMILY:
                sk = _decode(body)
                if sk is not None:
                    out.append(sk)
    return out


def lookup(sock: socket.socket, sockets: list[DiagSocket]) -> list[DiagSocket] | None:
    """``sockets`` read again, each by an exact request (:func:`lookup_request`),
    in their order; None when any of them is gone (closed, in TIME_WAIT, or its
    4-tuple taken by another socket: the cookie differs) or a reply is
    missing: the caller dumps the namespace instead. Never blocks: the kernel
    queues every reply before ``send`` returns."""
    out: list[DiagSocket] = []
    for i in range(0, len(sockets), LOOKUP_BATCH):
        chunk = sockets[i : i + LOOKUP_BATCH]
        sock.send(b"".join(lookup_request(sk, n) for n, sk in enumerate(chunk, start=1)))
        got = 0
        try:
            while got < len(chunk):
                for kind, body in nl_messages(sock.recv(1 << 16, socket.MSG_DONTWAIT)):
                    got += 1
                    sk = _decode(body) if kind == SOCK_DIAG_BY_FAMILY else None
                    if sk is None:
                        raise OSError(errno.ENOENT, "socket gone")
                    out.append(sk)
        except OSError:  # ENOENT/ESTALE from the kernel, no more replies, ENOBUFS
            _discard(sock)  # what is left must not reach the next dump
            return None
    return out


def _discard(sock: socket.socket) -> None:
    """Read and drop whatever replies are still queued on ``sock``."""
    while True:
        try:
            sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            continue  # an error message or ENOBUFS: keep draining


def drain_destroyed(sock: socket.socket) -> tuple[list[DiagSocket], int]:
    """The destroyed sockets queued on a ``DESTROY_GROUPS`` listener (non-
    blocking), and how often the kernel said it dropped some (ENOBUFS: the
    buffer was full)."""
    out: list[DiagSocket] = []
    overflows = 0
    while True:
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return out, overflows
        except OSError as e:
            if e.errno != errno.ENOBUFS:
                raise
            overflows += 1
            continue
        out += parse_dump(data)[0]


_libc: ctypes.CDLL | None = None


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _diag_socket(groups: int, protocol: int = NETLINK_SOCK_DIAG) -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol)
    if groups:
        try:
            with contextlib.suppress(OSError):  # a bigger buffer needs CAP_NET_ADMIN too
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, DESTROY_RCVBUF)
            sock.bind((0, groups))  # EPERM without CAP_NET_ADMIN
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
    return sock


def open_in_namespace(
    ns_path: str | None, groups: int = 0, protocol: int = NETLINK_SOCK_DIAG
) -> socket.socket:
    """A sock_diag socket (or another netlink ``protocol``'s: devstats.py
    reads rtnetlink) reading the namespace at ``ns_path`` (None: ours);
    ``groups``: multicast groups to join (``DESTROY_GROUPS``: a non-blocking
    listener for the namespace's destroyed TCP sockets).

    The thread enters that namespace for the socket() call only and always
    returns to its own, even on error."""
    if ns_path is None:
        return _diag_socket(groups, protocol)
    target = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
    home = os.open(
        f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY | os.O_CLOEXEC
    )
    try:
        _setns(target)
        try:
            return _diag_socket(groups, protocol)
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


class SockDiag:
    """Reads every TCP socket's tcp_info in the namespaces named above.

    ``read(pids)`` returns every socket now, each tagged with its namespace,
    and leaves in ``destroyed`` the sockets the kernel freed since the last
    read (their final tcp_info, from the destroy broadcast);
    ``deltas()`` turns consecutive reads into per-socket retransmit (and
    D-SACK) deltas. ``close()`` closes the sockets (idempotent)."""

    def __init__(self, netns_dir: str | None = "/run/netns", proc_root: str = "/proc") -> None:
        self.netns_dir = netns_dir
        self.proc_root = proc_root
        self._socks: dict[tuple[int, int], socket.socket] = {}
        # ns -> destroy listener (None: it could not be opened, e.g. no CAP_NET_ADMIN)
        self._listeners: dict[tuple[int, int], socket.socket | None] = {}
        # ns -> cookie -> (total_retrans, dsack_dups) at the last read
        self._prev: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        # ns -> cookie -> reads since a known socket left the dump undestroyed
        self._vanished: dict[tuple[int, int], dict[int, int]] = {}
        self.destroyed: list[tuple[tuple[int, int], DiagSocket]] = []  # since the last read
        self.destroy_overflows = 0  # ENOBUFS on a destroy listener: destroy messages lost
        self.listen_errors: dict[str, str] = {}  # namespace path -> why it has no listener
        self.last_read: set[tuple[int, int]] = set()  # namespaces the last read() read
        self.errors: dict[str, str] = {}  # namespace path -> last read error
        self.read_errors = 0  # namespace reads that failed (their figures lost)
        self.dumps = 0  # whole-namespace dumps
        self.lookups = 0  # sockets read by an exact lookup
        self.lookup_fallbacks = 0  # exact reads that found a socket gone (dumped instead)

    def _paths(self, pids: Iterable[int]) -> Iterator[str | None]:
        yield None
        if self.netns_dir:
            with contextlib.suppress(OSError):
                for name in sorted(os.listdir(self.netns_dir)):
                    yield os.path.join(self.netns_dir, name)
        for pid in sorted(set(pids)):
            yield f"{self.proc_root}/{pid}/ns/net"

    def read(
        self,
        pids: Iterable[int] = (),
        only: dict[tuple[int, int], list[DiagSocket]] | None = None,
    ) -> list[tuple[tuple[int, int], DiagSocket]]:
        """(namespace id, socket) for every TCP socket now.

        ``only``: read just these sockets again, each by an exact lookup (a
        namespace not in it is not read, and its figures wait for the next
        read that covers it); a namespace where any of them is gone is dumped
        whole instead (counted in ``lookup_fallbacks``)."""
        out: list[tuple[tuple[int, int], DiagSocket]] = []
        gone: list[tuple[tuple[int, int], DiagSocket]] = []
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
            known = only.get(ident) if only is not None else None
            if only is not None and ident in self._prev and not known:
                continue  # read before, and nothing of interest there now
            try:
                sock = self._socks.get(ident)
                if sock is None:
                    sock = self._socks[ident] = open_in_namespace(path)
                    self._listeners[ident] = self._open_listener(path)
                got = lookup(sock, known) if known else None
                if got is None:
                    self.lookup_fallbacks += bool(known)
                    got = dump(sock)
                    self.dumps += 1
                else:
                    self.lookups += len(got)
                # after the dump: a socket freed in between is in both, and
                # the destroy message (the later figures) wins
                gone += [(ident, sk) for sk in self._drain(ident)]
            except OSError as e:  # namespace vanished mid-read, or no sock_diag
                self.errors[path or "self"] = str(e)
                self.read_errors += 1
                self._drop(ident)
                continue
            self.errors.pop(path or "self", None)
            out += [(ident, sk) for sk in got]
            read.add(ident)
        self.last_read = read
        self.destroyed = gone
        return out

    def _open_listener(self, path: str | None) -> socket.socket | None:
        try:
            sock = open_in_namespace(path, DESTROY_GROUPS)
        except OSError as e:  # EPERM without CAP_NET_ADMIN: closing sockets' last figures lost
            if (path or "self") not in self.listen_errors:
                log.warning(
                    "no sock_diag destroy listener in %s (%s): retransmits of sockets "
                    "that close between polls are lost",
                    path or "our namespace",
                    e,
                )
            self.listen_errors[path or "self"] = str(e)
            return None
        self.listen_errors.pop(path or "self", None)
        return sock

    def _drain(self, ident: tuple[int, int]) -> list[DiagSocket]:
        sock = self._listeners.get(ident)
        if sock is None:
            return []
        got, overflows = drain_destroyed(sock)
        self.destroy_overflows += overflows
        return got

    def deltas(
        self,
        read: list[tuple[tuple[int, int], DiagSocket]],
        namespaces: set[tuple[int, int]] | None = None,
        destroyed: list[tuple[tuple[int, int], DiagSocket]] | None = None,
    ) -> dict[tuple[tuple[int, int], int], Counts]:
        """(namespace, cookie) -> what the socket's counters (:class:`Counts`:
        retransmitted segments, and those the peer reported as duplicates)
        rose by since the namespace was last read; only sockets where one rose.
        ``namespaces``: those this read covered (default ``last_read``); one
        not covered keeps its figures for the next. ``destroyed``: the sockets
        freed since (default ``destroyed``); a destroyed socket counts up to
        its final figures, and once. A socket first seen in a namespace read
        before is new: all of its counts count (one born and destroyed between
        two reads too); the first read of a namespace is its baseline (its
        sockets may be older than the probes). A socket that left the dump
        without a destroy message yet keeps its last figures for
        ``VANISHED_READS`` reads."""
        covered = self.last_read if namespaces is None else namespaces
        gone_list = self.destroyed if destroyed is None else destroyed
        zero = (0, 0)
        cur: dict[tuple[int, int], dict[int, tuple[int, int]]] = {ns: {} for ns in covered}
        for ns, sk in read:
            cur.setdefault(ns, {})[sk.cookie] = (sk.total_retrans, sk.dsack_dups)
        gone: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        for ns, sk in gone_list:
            if ns in cur:
                g = gone.setdefault(ns, {})
                r, d = g.get(sk.cookie, zero)
                g[sk.cookie] = (max(r, sk.total_retrans), max(d, sk.dsack_dups))
        out: dict[tuple[tuple[int, int], int], Counts] = {}
        for ns, socks in cur.items():
            prev = self._prev.get(ns)
            freed = gone.get(ns, {})
            if prev is None:  # baseline: nothing counts, freed sockets are forgotten
                self._prev[ns] = {c: t for c, t in socks.items() if c not in freed}
                self._vanished[ns] = {}
                continue
            for cookie, (r, d) in {**socks, **freed}.items():
                r_now, d_now = socks.get(cookie, zero)
                r0, d0 = prev.get(cookie, zero)
                dr, dd = max(r, r_now) - r0, max(d, d_now) - d0
                if dr > 0 or dd > 0:
                    out[(ns, cookie)] = Counts(max(dr, 0), max(dd, 0))
            ages = self._vanished.setdefault(ns, {})
            nxt = {c: t for c, t in socks.items() if c not in freed}
            for cookie, total in prev.items():
                if cookie in nxt or cookie in freed or cookie in socks:
                    ages.pop(cookie, None)
                    continue
                age = ages.get(cookie, 0) + 1
                if age <= VANISHED_READS:
                    nxt[cookie] = total
                    ages[cookie] = age
                else:
                    ages.pop(cookie, None)
            for cookie in list(ages):
                if cookie not in nxt:
                    del ages[cookie]
            self._prev[ns] = nxt
        return out

    def _drop(self, ident: tuple[int, int]) -> None:
        self._prev.pop(ident, None)  # read again, it starts from a baseline
        self._vanished.pop(ident, None)
        for sock in (self._socks.pop(ident, None), self._listeners.pop(ident, None)):
            if sock is not None:
                sock.close()

    def close(self) -> None:
        for ident in list(self._socks):
            self._drop(ident)
