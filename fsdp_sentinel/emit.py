"""Fire-and-forget sender of trace records from a training process.

:meth:`Emitter.emit` only appends the record to an in-memory queue (a deque
append, well under a microsecond) and returns; it never blocks and never
raises into training. A background thread wakes every ``flush_interval``
seconds (:data:`FLUSH_INTERVAL`, 250 ms; at the multiples of it on the
monotonic clock, so a node's ranks drain together and the daemon wakes once
for all of their datagrams) and drains the queue: the drained
records go as JSON lines (``\n``-separated, no trailing newline), packed
into as few datagrams of at most :data:`MAX_DATAGRAM` bytes as they fit in,
on a non-blocking AF_UNIX SOCK_DGRAM socket to the daemon's ingest socket,
and, with ``trace_out``, into a trace file. Sending off the training thread matters: a datagram that wakes a
sleeping receiver costs tens of microseconds in the sender's ``sendto`` on a
small machine, and the file's periodic fsync more. Packing matters too: one
``sendto`` and one daemon wake-up per drain instead of one per record (a
4-rank job sends a few hundred records a second), and a few large datagrams
use the kernel's per-socket queue (``net.unix.max_dgram_qlen`` datagrams,
``SO_SNDBUF`` bytes counted with a ~1 KiB overhead per datagram) far better
than many small ones. The daemon (``ingest``) reads each line as a record.

When the daemon is absent (``ENOENT``, ``ECONNREFUSED``), slow (``EAGAIN``,
``ENOBUFS``: its receive queue is full) or gone, the record is dropped and
counted in ``dropped`` (a datagram refused drops, and counts, every record
it held); training never waits. After the daemon is found
absent the emitter stops trying for ``retry_interval`` seconds (dropping and
counting meanwhile, without encoding what it drops: a job that runs with no
daemon pays for its records' queueing, not their JSON), then tries again, so it picks up a daemon that starts
later, or one started again after a crash (same path: the new daemon takes
the socket over); a greeting (:meth:`Emitter.set_greeting`: the hooks' own
``rank`` record) then goes ahead of the first record it gets. If the queue itself grows past ``max_pending`` records (the thread
starved), new records are dropped and counted.

Producers that must report on time rather than on an event (the hooks'
``pending`` records for a collective still in flight) register a *ticker*
with :meth:`Emitter.add_ticker`: the sender thread calls it before each
drain, so the record is made and sent off the training thread, even while
that thread is blocked.

Datagrams are capped at :data:`MAX_DATAGRAM` bytes (far below Linux's AF_UNIX
datagram limit, the socket send buffer, ~208 KiB by default); a ``coll``
record is ~200 bytes, so a datagram holds some 300 of them. A record bigger
than the cap on its own is dropped and counted in ``oversize``.
"""

from __future__ import annotations

import collections
import errno
import json
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from fsdp_sentinel.trace import TraceWriter

DEFAULT_SOCKET = "/run/fsdp-sentinel/ingest.sock"

#: Environment variable that names the daemon's socket for a job whose code
#: does not (docs/hooks.md, "Opting a job in from the launcher").
SOCKET_ENV = "FSDP_SENTINEL_SOCKET"


def socket_from_env(env: Mapping[str, str]) -> str | None:
    """The socket a launcher chose through :data:`SOCKET_ENV`: unset gives
    :data:`DEFAULT_SOCKET`, ``off`` (or empty) gives None (no socket)."""
    value = env.get(SOCKET_ENV)
    if value is None:
        return DEFAULT_SOCKET
    return None if value.strip() in ("", "off") else value


#: Largest datagram the emitter sends (bytes): records are packed up to it,
#: and a record bigger than it on its own is dropped.
MAX_DATAGRAM = 65_000

#: Seconds between the sender thread's drains (the default ``flush_interval``).
#: Each drain wakes this thread in the rank (the GIL with it) and the
#: daemon's ingest and pipeline threads; at 100 ms a 4-rank job's 40
#: datagrams a second cost the daemon's ingest thread 6-7 ms of CPU a second,
#: at 250 ms 3.5-4 (BENCHMARKS.md). Liveness is judged over seconds.
FLUSH_INTERVAL = 0.25

# errnos meaning "nobody is listening at that path": back off before retrying.
_ABSENT = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR, errno.EACCES})


class Emitter:
    """Sends records to the daemon (and optionally a trace file); never blocks.

    Counters (final after :meth:`flush` or :meth:`close`), all of records
    except ``datagrams``: ``sent`` (records in datagrams the kernel accepted,
    a greeting's copies included), ``datagrams`` (datagrams the kernel
    accepted, greetings' included), ``dropped`` (records not delivered to the
    daemon, for any reason; every record emitted is either sent or dropped,
    greetings aside), ``oversize`` (the part of ``dropped`` that was too big
    on its own), ``written`` (records written to the trace file),
    ``write_errors`` (records the trace file refused). A record passed to
    :meth:`emit` must not be mutated afterwards.
    """

    def __init__(
        self,
        socket_path: str | None = DEFAULT_SOCKET,
        trace_out: str | None = None,
        *,
        flush_interval: float = FLUSH_INTERVAL,
        retry_interval: float = 1.0,
        max_pending: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket_path = socket_path
        self.flush_interval = flush_interval
        self.retry_interval = retry_interval
        self.max_pending = max_pending
        self._clock = clock
        self.sent = 0
        self.datagrams = 0
        self._dropped_send = 0  # written by the draining thread only
        self._dropped_full = 0  # written by emit() only
        self.oversize = 0
        self.written = 0
        self.write_errors = 0
        self._retry_at = 0.0
        # Set when a send found nobody listening; the next delivery is then
        # preceded by the greeting (set_greeting).
        self._absent = False
        self._greeting: Callable[[], list[dict[str, Any]]] | None = None
        self.greetings = 0
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._drain_lock = threading.Lock()  # one drainer at a time, in order
        self._sock: socket.socket | None = None
        if socket_path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        self._writer = TraceWriter(trace_out) if trace_out else None
        self.closed = False
        self._tickers: list[Callable[[], None]] = []
        self.ticker_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fsdp-sentinel-emit", daemon=True)
        self._thread.start()

    def emit(self, rec: dict[str, Any]) -> None:
        """Queue ``rec`` for sending; returns at once."""
        if self.closed:
            return
        if len(self._pending) >= self.max_pending:
            self._dropped_full += 1
            return
        self._pending.append(rec)

    def add_ticker(self, fn: Callable[[], None]) -> None:
        """Have the sender thread call ``fn()`` before each drain (every
        ``flush_interval``); what it emits goes out in that same drain. Its
        exceptions are counted in ``ticker_errors``, never raised."""
        self._tickers.append(fn)

    @property
    def dropped(self) -> int:
        return self._dropped_send + self._dropped_full

    def flush(self) -> None:
        """Send (or drop) everything queued so far, on the calling thread: the
        records packed into as few datagrams as they fit in, in order."""
        with self._drain_lock:
            pending = self._pending
            sock = self._sock is not None
            # The daemon was found absent and is not tried again yet: the
            # records would be dropped at the send, so they are dropped (and
            # counted) before the CPU of encoding them is spent.
            away = sock and bool(self._retry_at) and self._clock() < self._retry_at
            batch: list[bytes] = []
            size = -1  # the batch's bytes joined with "\n": one less than the sum
            while pending:
                rec = pending.popleft()
                if self._writer is not None:
                    self._write(rec)
                if not sock:
                    continue
                if away:
                    self._dropped_send += 1
                    continue
                data = self._encode(rec)
                if data is None:
                    continue
                if batch and size + 1 + len(data) > MAX_DATAGRAM:
                    self._send(batch)
                    batch, size = [], -1
                batch.append(data)
                size += 1 + len(data)
            if batch:
                self._send(batch)

    def close(self) -> None:
        """Stop the thread, flush what is queued, close the file and socket. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._thread.join()
        self.flush()
        if self._writer is not None:
            self._writer.close()
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> Emitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _run(self) -> None:
        while not self._stop.wait(self._until_next()):
            for tick in self._tickers:
                try:
                    tick()
                except Exception:  # noqa: BLE001 - a ticker must not stop the sender
                    self.ticker_errors += 1
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the sender thread must outlive any record
                self._dropped_send += 1

    def _until_next(self) -> float:
        """Seconds to the next multiple of ``flush_interval`` on the clock.
        The ranks of a node share one monotonic clock, so they drain at the
        same instants and the daemon's ingest thread wakes once for all
        their datagrams, not once for each rank's (a wake-up costs the
        daemon more than the records it brings)."""
        step = self.flush_interval
        return step - self._clock() % step if step > 0 else 0.0

    def _write(self, rec: dict[str, Any]) -> None:
        try:
            assert self._writer is not None
            self._writer.write(rec)
            self.written += 1
        except (OSError, TypeError, ValueError):
            self.write_errors += 1  # a trace-file problem must not stop the sender

    def set_greeting(self, fn: Callable[[], list[dict[str, Any]]]) -> None:
        """Records that go ahead of anything else whenever the daemon answers
        after being away (not started yet, or restarted after a crash): a new
        daemon knows nothing of the sender (``hooks``: its ``rank`` record).
        Called on the sender thread; counted in ``greetings``."""
        self._greeting = fn

    def _encode(self, rec: dict[str, Any]) -> bytes | None:
        """``rec`` as one JSON line (no newline: JSON escapes those in
        strings), or None when it cannot go (dropped and counted)."""
        try:
            data = json.dumps(rec, separators=(",", ":"), allow_nan=False).encode()
        except Exception:  # noqa: BLE001 - TypeError, ValueError, RecursionError: not one lost batch
            self._dropped_send += 1
            return None
        if len(data) > MAX_DATAGRAM:
            self._dropped_send += 1
            self.oversize += 1
            return None
        return data

    def _send(self, batch: list[bytes]) -> None:
        """One datagram of ``batch``'s encoded records (their sizes joined fit
        :data:`MAX_DATAGRAM`); every one of them dropped and counted if it fails."""
        if self._retry_at and self._clock() < self._retry_at:
            self._dropped_send += len(batch)
            return
        if self._absent and self._greeting is not None:
            # The daemon was away: say who we are before the records, which a
            # daemon that does not know us could not place.
            try:
                hello = [self._encode_greeting(g) for g in self._greeting()]
            except Exception:  # noqa: BLE001 - a bad greeting must not stop the sender
                hello = []
            # A greeting is a copy of records already counted when first sent:
            # only the batch's records count as dropped if the daemon is still away.
            good = [g for g in hello if g is not None]
            if good and not self._deliver(good):
                self._dropped_send += len(batch)
                return
            self.greetings += 1
        if not self._deliver(batch):
            self._dropped_send += len(batch)

    @staticmethod
    def _encode_greeting(rec: dict[str, Any]) -> bytes | None:
        try:
            data = json.dumps(rec, separators=(",", ":"), allow_nan=False).encode()
        except Exception:  # noqa: BLE001 - a bad greeting must not stop the sender
            return None
        return data if len(data) <= MAX_DATAGRAM else None

    def _deliver(self, batch: list[bytes]) -> bool:
        """Send ``batch`` (greeting records: packed into as many datagrams as
        they need; records of a flush: exactly one) and count what went; False
        as soon as one datagram is refused."""
        chunks: list[list[bytes]] = [[]]
        size = -1
        for data in batch:
            if chunks[-1] and size + 1 + len(data) > MAX_DATAGRAM:
                chunks.append([])
                size = -1
            chunks[-1].append(data)
            size += 1 + len(data)
        for chunk in chunks:
            try:
                self._sock.sendto(b"\n".join(chunk), self.socket_path)  # type: ignore[union-attr,arg-type]
            except OSError as e:
                if e.errno in _ABSENT:
                    self._retry_at = self._clock() + self.retry_interval
                    self._absent = True
                return False
            self._retry_at = 0.0
            self._absent = False
            self.sent += len(chunk)
            self.datagrams += 1
        return True
