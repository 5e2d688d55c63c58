"""Fire-and-forget sender of trace records from a training process.

:meth:`Emitter.emit` only appends the record to an in-memory queue (a deque
append, well under a microsecond) and returns; it never blocks and never
raises into training. A background thread wakes every ``flush_interval``
seconds and drains the queue: each record goes as one JSON datagram on a
non-blocking AF_UNIX SOCK_DGRAM socket to the daemon's ingest socket, and,
with ``trace_out``, into a trace file. Sending off the training thread matters:
a datagram that wakes a sleeping receiver costs tens of microseconds in the
sender's ``sendto`` on a small machine, and the file's periodic fsync more.

When the daemon is absent (``ENOENT``, ``ECONNREFUSED``), slow (``EAGAIN``,
``ENOBUFS``: its receive queue is full) or gone, the record is dropped and
counted in ``dropped``; training never waits. After the daemon is found
absent the emitter stops trying for ``retry_interval`` seconds (dropping and
counting meanwhile), then tries again, so it picks up a daemon that starts
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
record is ~200 bytes. A bigger record is dropped and counted in ``oversize``.
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


#: Largest datagram the emitter sends (bytes); bigger records are dropped.
MAX_DATAGRAM = 65_000

# errnos meaning "nobody is listening at that path": back off before retrying.
_ABSENT = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR, errno.EACCES})


class Emitter:
    """Sends records to the daemon (and optionally a trace file); never blocks.

    Counters (final after :meth:`flush` or :meth:`close`): ``sent`` (datagrams
    the kernel accepted), ``dropped`` (records not delivered to the daemon,
    for any reason), ``oversize`` (the part of ``dropped`` that was too big),
    ``written`` (records written to the trace file), ``write_errors`` (records
    the trace file refused). A record passed to :meth:`emit` must not be
    mutated afterwards.
    """

    def __init__(
        self,
        socket_path: str | None = DEFAULT_SOCKET,
        trace_out: str | None = None,
        *,
        flush_interval: float = 0.02,
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
        """Send (or drop) everything queued so far, on the calling thread."""
        with self._drain_lock:
            pending = self._pending
            while pending:
                rec = pending.popleft()
                if self._writer is not None:
                    self._write(rec)
                if self._sock is not None:
                    self._send(rec)

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
        while not self._stop.wait(self.flush_interval):
            for tick in self._tickers:
                try:
                    tick()
                except Exception:  # noqa: BLE001 - a ticker must not stop the sender
                    self.ticker_errors += 1
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the sender thread must outlive any record
                self._dropped_send += 1

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

    def _send(self, rec: dict[str, Any]) -> None:
        if self._retry_at and self._clock() < self._retry_at:
            self._dropped_send += 1
            return
        if self._absent and self._greeting is not None:
            # The daemon was away: say who we are before the record, which a
            # daemon that does not know us could not place.
            try:
                hello = self._greeting()
            except Exception:  # noqa: BLE001 - a bad greeting must not stop the sender
                hello = []
            for g in hello:
                # A greeting is a copy of a record already counted when first
                # sent: only rec is counted as dropped if the daemon is still away.
                if not self._deliver(g, counted=False):
                    self._dropped_send += 1
                    return
            self.greetings += 1
        self._deliver(rec)

    def _deliver(self, rec: dict[str, Any], *, counted: bool = True) -> bool:
        """One datagram; False when it was dropped (counted in ``dropped``
        unless ``counted`` is False: a greeting's copy of an earlier record)."""
        try:
            data = json.dumps(rec, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError):
            self._dropped_send += 1 if counted else 0
            return False
        if len(data) > MAX_DATAGRAM:
            self._dropped_send += 1 if counted else 0
            self.oversize += 1
            return False
        try:
            self._sock.sendto(data, self.socket_path)  # type: ignore[union-attr,arg-type]
        except OSError as e:
            if e.errno in _ABSENT:
                self._retry_at = self._clock() + self.retry_interval
                self._absent = True
            self._dropped_send += 1 if counted else 0
            return False
        self._retry_at = 0.0
        self._absent = False
        self.sent += 1
        return True
