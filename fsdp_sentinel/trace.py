"""Trace format v1: the interchange contract (see docs/trace-format.md).

JSON Lines, one object per line, optionally zstd-compressed (``.zst``). The
first line is a ``header``. Readers ignore unknown kinds and unknown fields; a
record of a known kind missing a required field is an error naming file and
line (strict mode), or is skipped and counted (lenient mode).

This module is the lowest layer: it imports nothing else of the package.
"""

from __future__ import annotations

import errno
import heapq
import io
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

try:  # orjson parses a record ~4x faster than json; replay is parse-bound.
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - orjson is a dependency; json is the fallback
    _loads = json.loads

FORMAT = "fsdp-sentinel-trace"
VERSION = 1

Record = dict[str, Any]

#: kind -> fields every record of that kind must carry.
REQUIRED: dict[str, tuple[str, ...]] = {
    "header": ("format", "version"),
    "rank": ("t", "rank", "world_size", "host", "pid", "addrs"),
    "step": ("rank", "step", "start", "end"),
    "coll": ("rank", "step", "seq", "op", "bytes", "issue", "end"),
    "pending": ("t", "rank", "step", "seq", "op", "issue"),
    "clock": ("t", "host"),
    "flow": ("t", "dt", "host", "pid", "src", "dst", "tx_bytes", "rx_bytes"),
    "netdev": ("t", "dt", "host", "dev", "tx_bytes", "rx_bytes"),
    "conn": ("t", "host", "pid", "src", "dst", "what"),
    "verdict": ("t", "step", "rank", "state", "cause", "score"),
    "action": ("t", "host", "dev", "what", "state"),
    "fault": ("t", "host", "rank", "what", "params"),
    "nccl": ("t", "dt", "host", "pid", "op", "calls", "bytes"),
    "qp": ("t", "host", "pid", "qp_num", "what"),
    "rdma": ("t", "dt", "host", "dev", "port", "tx_bytes", "rx_bytes"),
}


def _wire_keys(names: Iterable[str]) -> dict[str, str]:
    """``names`` as the very str objects the parser makes for object keys.

    orjson keeps the key strings it creates in a cache (keys up to 64 bytes)
    and hands the same object to every record that has that key. A dict
    lookup with that object is an identity hit; with an equal string made
    elsewhere (a literal in this code) every lookup also compares the bytes,
    which was 18 % of the time spent parsing a trace. So the hot paths look
    fields up with these objects. Nothing depends on it being so: when the
    parser does not cache (the json fallback, or a cache slot taken over by
    another key) the lookups are just as correct, only slower.
    """
    return {k: k for k in _loads(json.dumps(dict.fromkeys(names, 0)).encode())}


#: Every field name of the format, as the parser's key objects (see :func:`_wire_keys`).
KEY: dict[str, str] = _wire_keys(
    sorted({"kind", "group", "direction", *(f for fs in REQUIRED.values() for f in fs)})
)
_KIND = KEY["kind"]
_REQUIRED_SETS: dict[str, frozenset[str]] = {
    k: frozenset(KEY[f] for f in v) for k, v in REQUIRED.items()
}

#: Field that places a record of each kind on the time line (for merging).
TIME_FIELD: dict[str, str] = {
    "header": "",
    "rank": "t",
    "step": "end",
    "coll": "end",
    "pending": "t",
    "clock": "t",
    "flow": "t",
    "netdev": "t",
    "conn": "t",
    "verdict": "t",
    "action": "t",
    "fault": "t",
    "nccl": "t",
    "qp": "t",
    "rdma": "t",
}


class TraceError(ValueError):
    """A malformed trace line; ``path`` and ``line`` say where."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


def header() -> Record:
    return {"kind": "header", "format": FORMAT, "version": VERSION}


@dataclass(frozen=True)
class Verdict:
    """One detection verdict, typed until :meth:`record` writes it as a ``verdict`` record.

    ``score`` is the rule's own figure (relative score, srtt ratio, silence in
    seconds); ``peer_rank`` the other end a network verdict names;
    ``evidence`` what the rule saw (docs/detection.md lists each rule's keys).
    The detector builds these; the trace layer alone decides their wire form.
    """

    t: float
    step: int
    rank: int
    state: str  # "flagged" | "cleared"
    cause: str  # "compute" | "network" | "rank_lost" | "hang"
    score: float
    host: str = ""
    peer_rank: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def record(self) -> Record:
        """The trace-v1 ``verdict`` record (times to the microsecond, scores to 4 places)."""
        rec: Record = {
            "kind": "verdict",
            "t": round(self.t, 6),
            "step": self.step,
            "rank": self.rank,
            "state": self.state,
            "cause": self.cause,
            "score": round(self.score, 4),
        }
        if self.host:
            rec["host"] = self.host
        if self.peer_rank is not None:
            rec["peer_rank"] = self.peer_rank
        rec["evidence"] = self.evidence
        return rec


def missing_fields(rec: Record) -> list[str]:
    """Required fields absent from ``rec`` (empty for unknown kinds)."""
    need = REQUIRED.get(rec.get("kind", ""), ())
    return [f for f in need if f not in rec]


def validate(rec: Any) -> str | None:
    """Why ``rec`` is not a valid record, or None when it is."""
    if not isinstance(rec, dict):
        return "record is not a JSON object"
    kind = rec.get("kind")
    if not isinstance(kind, str):
        return "record has no string 'kind'"
    miss = missing_fields(rec)
    if miss:
        return f"{kind} record missing required field(s): {', '.join(miss)}"
    return None


def record_time(rec: Record) -> float:
    """The time that places ``rec`` on the time line (0.0 when it has none)."""
    key = TIME_FIELD.get(rec.get("kind", ""), "t")
    value = rec.get(key) if key else None
    if value is None:
        value = rec.get("t", 0.0)
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def encode(rec: Record) -> bytes:
    """One record as one line of compact JSON (newline included)."""
    return (json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n").encode()


def _is_zst(path: str | os.PathLike[str]) -> bool:
    return str(path).endswith(".zst")


# --------------------------------------------------------------------------- writing


class TraceWriter:
    """Appends records to a trace file; thread-safe.

    Flushes and fsyncs every ``sync_interval`` seconds (checked on each write)
    and on ``close()``, so a crash loses at most one interval. A ``.zst`` path
    is written as a stream of independently flushed zstd frames, so a crash
    leaves every synced frame readable. The header is written once, when the
    file is new or empty.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        sync_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.sync_interval = sync_interval
        self._clock = clock
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._raw: IO[bytes] = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self._zst = _is_zst(self.path)
        self._compressor: Any = None
        self._zwriter: Any = None
        if self._zst:
            import zstandard

            self._compressor = zstandard.ZstdCompressor(level=3)
            self._zwriter = self._compressor.stream_writer(self._raw, closefd=False)
        self._last_sync = self._clock()
        self.records = 0
        self.closed = False
        if fresh:
            self.write(header())

    def write(self, rec: Record) -> None:
        data = encode(rec)
        with self._lock:
            if self.closed:
                return
            if self._zst:
                self._zwriter.write(data)
            else:
                self._raw.write(data)
            self.records += 1
            if self._clock() - self._last_sync >= self.sync_interval:
                self._sync_locked()

    def write_many(self, recs: Iterable[Record]) -> None:
        for rec in recs:
            self.write(rec)

    def sync(self) -> None:
        with self._lock:
            if not self.closed:
                self._sync_locked()

    def _sync_locked(self) -> None:
        if self._zst:
            import zstandard

            # End the frame so everything so far is decodable after a crash.
            self._zwriter.flush(zstandard.FLUSH_FRAME)
        self._raw.flush()
        try:
            os.fsync(self._raw.fileno())
        except OSError as e:
            # A pipe or terminal (``--verdicts-out /dev/stdout``) cannot be
            # synced; what was flushed to it is all there is to keep.
            if e.errno not in (errno.EINVAL, errno.EROFS, errno.ENOTSUP):
                raise
        self._last_sync = self._clock()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self._sync_locked()
            if self._zst:
                self._zwriter.close()
            self._raw.close()
            self.closed = True

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- reading


def _open_lines(path: str | os.PathLike[str], owner: Any = None) -> IO[bytes]:
    raw = open(path, "rb")  # noqa: SIM115 - returned to caller
    if owner is not None:
        owner._raw = raw  # its position is the reader's progress
    if not _is_zst(path):
        return raw
    import zstandard

    reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
    return io.BufferedReader(reader)  # type: ignore[arg-type]


@dataclass
class TraceReader:
    """Streams records from one trace file.

    ``strict`` (default): broken JSON or a missing required field raises
    :class:`TraceError` naming the file and line. Lenient: such lines are
    skipped and counted in ``skipped`` (their line numbers in ``skipped_lines``,
    the first 100). A last line with no newline that does not parse (a writer
    that crashed mid-line) counts as truncated in lenient mode and is an error
    in strict mode.
    """

    path: str | os.PathLike[str]
    strict: bool = True
    skipped: int = 0
    skipped_lines: list[int] = field(default_factory=list)
    lines: int = 0
    _raw: Any = field(default=None, repr=False, compare=False)

    def bytes_read(self) -> int:
        """How far into the file (its bytes on disk) reading has got: for progress."""
        raw = self._raw
        if raw is None or raw.closed:
            return os.path.getsize(self.path) if self.lines else 0
        return int(raw.tell())

    def __iter__(self) -> Iterator[Record]:
        name = str(self.path)
        loads = _loads
        # Hot loop (replay is parse-bound): a C-level subset test per record.
        required = _REQUIRED_SETS
        lineno = 0
        with _open_lines(self.path, self) as fh:
            try:
                for lineno, raw in enumerate(fh, 1):  # noqa: B007 - read in finally
                    try:
                        rec = loads(raw)
                    except (ValueError, UnicodeDecodeError) as e:
                        if not raw.strip():
                            continue
                        why = (
                            "truncated last line"
                            if not raw.endswith(b"\n")
                            else f"invalid JSON ({e})"
                        )
                        self._bad(name, lineno, why)
                        continue
                    kind = rec.get(_KIND) if type(rec) is dict else None
                    need = required.get(kind) if type(kind) is str else None
                    if need is not None and rec.keys() >= need:
                        if kind == "header" and rec.get("format") != FORMAT:
                            self._bad(
                                name, lineno, f"not an {FORMAT} header: {rec.get('format')!r}"
                            )
                            continue
                        yield rec
                        continue
                    reason = validate(rec)  # the slow path: say what is wrong
                    if reason is None:
                        # Unknown kind: readers ignore it, but pass it on;
                        # consumers dispatch on kind and drop what they do not know.
                        yield rec
                    else:
                        self._bad(name, lineno, reason)
            finally:
                self.lines = lineno

    def _bad(self, name: str, lineno: int, why: str) -> None:
        if self.strict:
            raise TraceError(name, lineno, why)
        self.skipped += 1
        if len(self.skipped_lines) < 100:
            self.skipped_lines.append(lineno)


def read_trace(path: str | os.PathLike[str], strict: bool = True) -> Iterator[Record]:
    """Records of one trace file, in file order (see :class:`TraceReader`)."""
    return iter(TraceReader(path, strict=strict))


def merge_traces(readers: Iterable[Iterable[Record]]) -> Iterator[Record]:
    """Merge several record streams into one, ordered by :func:`record_time`.

    Each stream is assumed roughly time-ordered (as writers produce them); the
    merge is stable (ties keep stream order) and streams are consumed lazily,
    so memory stays flat. Header records are dropped.
    """
    iters = [iter(r) for r in readers]
    if len(iters) == 1:
        for rec in iters[0]:
            if rec.get("kind") != "header":
                yield rec
        return
    heap: list[tuple[float, int, int, Record]] = []
    counter = 0
    for idx, it in enumerate(iters):
        for rec in it:
            if rec.get("kind") == "header":
                continue
            heap.append((record_time(rec), counter, idx, rec))
            counter += 1
            break
    heapq.heapify(heap)
    while heap:
        _, _, idx, rec = heapq.heappop(heap)
        yield rec
        for nxt in iters[idx]:
            if nxt.get("kind") == "header":
                continue
            heapq.heappush(heap, (record_time(nxt), counter, idx, nxt))
            counter += 1
            break
