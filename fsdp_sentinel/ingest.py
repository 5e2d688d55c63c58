"""The daemon's ingest socket: trace-v1 records from the ranks, as JSON lines in datagrams.

An :class:`IngestServer` binds an AF_UNIX SOCK_DGRAM socket at a path (its
directory made 0750 when the server creates it, the socket 0660; with
``socket_group`` both get that group, so ranks running as a non-root user in
it can reach and send, and everyone else gets ``EACCES``) and runs one
receive thread. A datagram holds one record or several, one JSON object a
line (``\n``-separated: the emitter packs what it drains into as few
datagrams as it can); :func:`parse_lines` parses and checks each line on its
own with the trace reader's own decoder and schema (:func:`parse_datagram`),
and each good record is handed to ``on_record``. A malformed line is dropped
and counted by reason, the datagram's other lines are taken; the thread
carries on. A datagram of one record, with or without a newline at its end,
is read as before (senders that know nothing of lines keep working).

A path socket lives in the file system, not in a network namespace, so ranks
in other network namespaces of the same machine reach it through the path.
The sender's pid comes from the kernel, not from the record: the socket has
``SO_PASSCRED`` on, so every datagram arrives with the sender's
``SCM_CREDENTIALS``, its pid already translated into the daemon's pid
namespace (a rank in a container without the host's pid namespace knows
itself by another pid than the one the probes key on). The server stamps it
on every record as ``host_pid``; a ``rank`` record whose ``pid`` is neither
that pid nor one of the sender's own pids in a child namespace (the ``NSpid``
line of ``/proc/<pid>/status``) is refused and counted (``pid_not_sender``).

The receive buffer (``SO_RCVBUF``) and the datagram queue length (Linux's
``net.unix.max_dgram_qlen``, 10 by default) are enlarged so a burst from
several ranks waits in the kernel instead of being refused to the senders,
whose emitters drop (and count) what the kernel will not queue.

This module sits just above ``trace``; it knows nothing of pipelines or probes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import stat
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fsdp_sentinel.trace import bad_field, decode, missing_fields

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/run/fsdp-sentinel/ingest.sock"

#: Largest datagram accepted; a bigger one is truncated by the kernel and dropped.
MAX_DATAGRAM = 65_536

#: Requested receive buffer (the kernel doubles it and caps it at rmem_max,
#: unless we are root and SO_RCVBUFFORCE works).
DEFAULT_RCVBUF = 8 * 1024 * 1024

#: Datagrams the socket may hold unread. Linux caps an AF_UNIX datagram
#: socket's queue at ``net.unix.max_dgram_qlen`` (10 by default) whatever its
#: buffer size, read once when the socket is created; so the server raises the
#: sysctl for the instant of creation (when it may) and puts it back.
DEFAULT_BACKLOG = 4096
QLEN_SYSCTL = "/proc/sys/net/unix/max_dgram_qlen"

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux value; Python lacks the name

#: Kinds only the daemon itself writes; a rank sending one would corrupt the
#: trace's "replay gives the same verdicts" property (and a rank's clock records
#: could move the stream clock for everyone), so they are refused.
RESERVED_KINDS = frozenset({"header", "verdict", "action", "clock"})

# Drop reasons (keys of IngestServer.dropped).
BAD_JSON = "invalid_json"
NOT_OBJECT = "not_object"
NO_KIND = "no_kind"
MISSING_FIELD = "missing_field"
BAD_VALUE = "bad_value"  # a field of the wrong type or out of range (trace.bad_field)
TOO_LARGE = "too_large"
RESERVED = "reserved_kind"
REFUSED = "refused"  # on_record returned False (refused downstream for no named reason)
NOT_SENDER = "pid_not_sender"  # a rank record announcing a pid that is not the sender's
QUEUE_FULL = "queue_full"  # the daemon's queue holds its cap of records
QUEUE_BYTES = "queue_bytes"  # the daemon's queue holds its cap of datagram bytes

#: Reasons that mean the datagram itself was malformed (vs. refused downstream).
MALFORMED_REASONS = frozenset({BAD_JSON, NOT_OBJECT, NO_KIND, MISSING_FIELD, BAD_VALUE, TOO_LARGE})
#: Reasons ``on_record`` may give for refusing a record (returned as the string).
REFUSAL_REASONS = (REFUSED, QUEUE_FULL, QUEUE_BYTES)
ALL_REASONS = (*sorted(MALFORMED_REASONS), RESERVED, *REFUSAL_REASONS, NOT_SENDER)

#: ``struct ucred`` (pid, uid, gid) of an ``SCM_CREDENTIALS`` message.
_UCRED = struct.Struct("=iII")
SO_PASSCRED = getattr(socket, "SO_PASSCRED", 16)  # Linux values
SCM_CREDENTIALS = getattr(socket, "SCM_CREDENTIALS", 2)
_ANCBUF = socket.CMSG_SPACE(_UCRED.size)


def sender_pid(ancdata: list[tuple[int, int, bytes]]) -> int | None:
    """The sender's pid from a datagram's ``SCM_CREDENTIALS`` (None without one)."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SCM_CREDENTIALS and len(data) >= _UCRED.size:
            pid = _UCRED.unpack_from(data)[0]
            return pid if pid > 0 else None
    return None


def ns_pids(pid: int, proc_root: str = "/proc") -> tuple[int, ...]:
    """Process ``pid``'s pids in every pid namespace it is in, outermost first
    (the ``NSpid`` line of its status; ``(pid,)`` where the kernel has none, ``()`` if gone)."""
    try:
        with open(f"{proc_root}/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return tuple(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        return ()
    return (pid,)


def is_sender(announced: object, kernel_pid: int, proc_root: str = "/proc") -> bool:
    """Whether a rank announcing ``announced`` as its pid is the process that sent it:
    the same pid, or the sender's own pid in a child pid namespace (a container)."""
    if announced == kernel_pid:
        return True
    return type(announced) is int and announced in ns_pids(kernel_pid, proc_root)[1:]


def parse_datagram(data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One record (a line of a datagram, or a whole one) -> (record, None) or
    (None, drop reason).

    The trace reader's own decoder and schema (``trace.decode``,
    ``trace.bad_field``): nesting past the parser's limit, non-finite
    numbers, invalid UTF-8 or lone surrogates are ``invalid_json``; a field
    of the wrong type or out of range is ``bad_value``. Nothing a datagram
    holds can raise past this function.
    """
    try:
        rec = decode(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, BAD_JSON
    if type(rec) is not dict:
        return None, NOT_OBJECT
    kind = rec.get("kind")
    if type(kind) is not str:
        return None, NO_KIND
    if missing_fields(rec):
        return None, MISSING_FIELD
    if bad_field(rec) is not None:
        return None, BAD_VALUE
    if kind in RESERVED_KINDS:
        return None, RESERVED
    return rec, None


def parse_lines(data: bytes) -> list[tuple[dict[str, Any] | None, str | None]]:
    """A datagram -> one :func:`parse_datagram` result per record it holds.

    A record a line (``\n``-separated); blank lines (whitespace only) are
    skipped, as the trace reader skips them; a datagram with no other line
    is one ``invalid_json``. A datagram without a newline is one record, as
    is one whose lines do not each parse but which as a whole is one JSON
    text (a sender's pretty-printed record). Never empty, never raises.
    """
    return _parse_lines(data)[0]


def _parse_lines(
    data: bytes,
) -> tuple[list[tuple[dict[str, Any] | None, str | None]], list[int]]:
    """:func:`parse_lines`, and each record's length in bytes (its line's)."""
    if b"\n" in data:
        lines = [line for line in data.split(b"\n") if line.strip()]
        if len(lines) > 1:
            out = [parse_datagram(line) for line in lines]
            if any(why == BAD_JSON for _, why in out):
                whole = parse_datagram(data)
                if whole[1] != BAD_JSON:
                    return [whole], [len(data)]
            return out, [len(line) for line in lines]
    return [parse_datagram(data)], [len(data)]


def _prepare_path(path: Path, gid: int | None = None) -> None:
    """Create the socket's directory (0750, group ``gid`` when given) and clear
    a stale socket file.

    An existing directory keeps its mode and group (it may be /tmp or shared,
    or made by systemd's ``RuntimeDirectory=``). A path
    that is a live socket (someone answers) or not a socket at all is an error:
    we never steal another daemon's socket or delete a regular file.
    """
    parent = path.parent
    if not parent.exists():
        parent.mkdir(mode=0o750, parents=True)
        if gid is not None:
            os.chown(parent, -1, gid)  # the group must traverse it to reach the socket
        os.chmod(parent, 0o750)  # mkdir's mode is filtered by the umask
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a socket", str(path))
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        log.info("replacing stale socket %s", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise FileExistsError(errno.EADDRINUSE, "another process is listening on", str(path))


@contextlib.contextmanager
def _dgram_qlen_at_least(want: int, sysctl: str) -> Iterator[int]:
    """Raise ``net.unix.max_dgram_qlen`` to ``want`` inside the block (if we
    may), restoring it after; yields the queue length sockets created inside get."""
    try:
        with open(sysctl) as fh:
            old = int(fh.read().strip())
    except (OSError, ValueError):
        yield want  # unknown: not Linux, or no /proc; nothing to do
        return
    if old >= want:
        yield old
        return
    try:
        with open(sysctl, "w") as fh:
            fh.write(str(want))
    except OSError as e:
        log.warning(
            "cannot raise %s to %d (%s): the socket queues only %d datagrams", sysctl, want, e, old
        )
        yield old
        return
    try:
        yield want
    finally:
        with open(sysctl, "w") as fh:
            fh.write(str(old))


class IngestServer:
    """Receives records on an AF_UNIX datagram socket and passes them on.

    ``on_record(rec)`` is called on the receive thread for every valid record,
    in arrival order; it must be quick (the daemon puts the record on a queue).
    Returning ``False`` refuses the record (counted as ``refused``), returning
    one of :data:`REFUSAL_REASONS` refuses it under that reason. With
    ``sized=True`` it is called as ``on_record(rec, nbytes)``, ``nbytes`` the
    record's length in the datagram, its line (what the daemon's byte cap
    counts; the whole datagram's for a datagram of one record).

    Counters (read from any thread; single writer), all of records, not
    datagrams: ``received`` (records that came in: a datagram's lines, blank
    ones aside; a datagram too large to read counts one), ``accepted``,
    ``dropped`` by reason (every reason, zeros too), ``malformed_total`` and
    ``dropped_total``; ``received == accepted + dropped_total`` once the
    thread has handed a datagram's records on. ``datagrams`` counts the
    datagrams read. ``rcvbuf`` is the receive buffer the kernel granted,
    ``backlog`` the datagram queue length (see :data:`DEFAULT_BACKLOG`).
    ``socket_group`` (a gid) is given to the socket (and to its directory when
    the server creates it): with mode 0660, the members of that group may send.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_record: Callable[..., bool | str | None],
        *,
        rcvbuf: int = DEFAULT_RCVBUF,
        backlog: int = DEFAULT_BACKLOG,
        socket_mode: int = 0o660,
        socket_group: int | None = None,
        qlen_sysctl: str = QLEN_SYSCTL,
        proc_root: str = "/proc",
        trust_pid: bool = False,
        sized: bool = False,
    ) -> None:
        self.path = Path(path)
        self._on_record = on_record
        self._sized = sized
        self._proc_root = proc_root
        # A relay or a recorded stream replayed into the socket sends for ranks
        # it is not: then records are taken as sent (no check, no host_pid).
        self._trust_pid = trust_pid
        self.received = 0
        self.datagrams = 0
        self.accepted = 0
        # Every reason is present from the start, so the dict never changes
        # size while another thread sums it.
        self.dropped: Counter[str] = Counter(dict.fromkeys(ALL_REASONS, 0))
        _prepare_path(self.path, socket_group)
        with _dgram_qlen_at_least(backlog, qlen_sysctl) as granted:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.backlog = granted
        try:
            self._set_rcvbuf(rcvbuf)
            self._sock.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
            self._sock.bind(str(self.path))
            if socket_group is not None:
                # Group before mode: the socket is never 0660 with the wrong group.
                os.chown(self.path, -1, socket_group)
            os.chmod(self.path, socket_mode)
            self._inode = os.stat(self.path).st_ino
        except BaseException:
            self._sock.close()
            raise
        self.rcvbuf = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        # A pipe wakes the receive thread at close(): closing a socket another
        # thread is blocked in does not reliably wake it.
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self.closed = False
        self.restarts = 0  # times the receive loop died and was started again
        # Records of the datagram in hand counted received, not yet accepted or dropped.
        self._inflight = 0

    def _set_rcvbuf(self, size: int) -> None:
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, size)
        except OSError:
            # Not CAP_NET_ADMIN: the plain option, capped at net.core.rmem_max.
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)

    @property
    def malformed_total(self) -> int:
        return sum(n for why, n in self.dropped.items() if why in MALFORMED_REASONS)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def start(self) -> IngestServer:
        self._thread = threading.Thread(target=self._run, name="fsdp-sentinel-ingest", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        # Supervised: a receive loop that dies (on_record raised, say) is
        # logged, counted and started again; the records of the datagram it
        # held not yet handed on are counted as refused, so received ==
        # accepted + dropped still holds.
        while True:
            try:
                self._loop()
                return
            except Exception:
                if self._inflight:
                    self.dropped[REFUSED] += self._inflight
                    self._inflight = 0
                if self.closed:
                    return
                self.restarts += 1
                log.exception("ingest receive loop died; starting it again")

    def _loop(self) -> None:
        sock, wake = self._sock, self._wake_r
        fd = sock.fileno()
        buf = bytearray(MAX_DATAGRAM + 1)
        view = memoryview(buf)
        flags = socket.MSG_DONTWAIT
        while True:
            ready, _, _ = select.select([fd, wake], [], [])
            # Drain everything queued before sleeping again; at close this
            # also delivers what was sent before close() was called.
            while True:
                try:
                    n, anc, mflags, _ = sock.recvmsg_into([view], _ANCBUF, flags)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:
                    if e.errno == errno.EBADF:
                        return
                    log.warning("ingest receive failed: %s", e)
                    break
                self.datagrams += 1
                if mflags & socket.MSG_TRUNC or n > MAX_DATAGRAM:
                    self.received += 1
                    self.dropped[TOO_LARGE] += 1
                    continue
                self._take(bytes(view[:n]), anc)
            if wake in ready:
                return

    def _take(self, data: bytes, anc: list[tuple[int, int, bytes]]) -> None:
        """Hand on the records of one datagram, counting each."""
        results, sizes = _parse_lines(data)
        self.received += len(results)
        self._inflight = len(results)
        pid = None if self._trust_pid else sender_pid(anc)
        for (rec, why), size in zip(results, sizes, strict=True):
            # _inflight: this record and those after it; each settled below.
            if rec is None:
                assert why is not None
                if not self.dropped[why]:
                    log.warning("ingest: dropping record (%s); further ones counted", why)
                self.dropped[why] += 1
            elif self._trust_pid or self._credit(rec, pid):
                verdict = self._on_record(rec, size) if self._sized else self._on_record(rec)
                if verdict is False or type(verdict) is str:
                    self._refuse(REFUSED if verdict is False else verdict)
                else:
                    self.accepted += 1
            self._inflight -= 1

    def _refuse(self, why: Any) -> None:
        why = why if why in REFUSAL_REASONS else REFUSED
        if not self.dropped[why]:
            log.warning("ingest: refusing records (%s); further ones counted", why)
        self.dropped[why] += 1

    def _credit(self, rec: dict[str, Any], pid: int | None) -> bool:
        """Stamp the kernel's pid for the sender on ``rec`` (``host_pid``, replacing
        any the sender wrote); refuse a ``rank`` record announcing another process."""
        if pid is None:
            rec.pop("host_pid", None)  # only the kernel may say it
            return True
        if rec["kind"] == "rank" and not is_sender(rec["pid"], pid, self._proc_root):
            if not self.dropped[NOT_SENDER]:
                log.warning("ingest: a rank record's pid %r is not its sender's (%d); "
                            "further ones counted", rec["pid"], pid)  # fmt: skip
            self.dropped[NOT_SENDER] += 1
            return False
        rec["host_pid"] = pid
        return True

    def close(self) -> None:
        """Stop the thread, close the socket and remove its file (if still ours)."""
        if self.closed:
            return
        self.closed = True
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with contextlib.suppress(FileNotFoundError):
            # Another daemon may have replaced a socket it thought stale.
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)

    def __enter__(self) -> IngestServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()
