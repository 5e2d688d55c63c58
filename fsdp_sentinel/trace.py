"""Trace format v1: the interchange contract (see docs/trace-format.md).

JSON Lines, one object per line, optionally zstd-compressed (``.zst``). The
first line is a ``header``. Readers ignore unknown kinds and unknown fields; a
record of a known kind missing a required field is an error naming file and
line (strict mode), or is skipped and counted (lenient mode).

This module is the lowest layer: it imports nothing else of the package.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, ClassVar


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _json_loads(data: bytes | memoryview) -> Any:  # pragma: no cover - the fallback
    return json.loads(bytes(data), parse_constant=_reject_constant)


try:  # orjson parses a record ~4x faster than json; replay is parse-bound.
    import orjson

    # It also refuses what a trace must not hold: NaN and infinities (1e999
    # included), invalid UTF-8 and lone surrogates, and nesting past 1,024
    # levels (an error, not a RecursionError).
    _loads: Callable[[bytes | memoryview], Any] = orjson.loads
    # And writes a decoded record ~14x faster than json (encode_decoded).
    _dumps_line: Callable[[Any], bytes] = partial(orjson.dumps, option=orjson.OPT_APPEND_NEWLINE)
except ImportError:  # pragma: no cover - orjson is a dependency; json is the fallback
    _loads = _json_loads

    def _dumps_line(rec: Any) -> bytes:
        return encode(rec)


def decode(data: bytes) -> Any:
    """One line or datagram of JSON, by the trace format's one decoder;
    raises ValueError (or UnicodeDecodeError) on anything that is not a JSON
    text the format can carry."""
    return _loads(data)


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
    sorted({"kind", "group", "direction", "host_pid", *(f for fs in REQUIRED.values() for f in fs)})
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


# --------------------------------------------------------------------------- values

#: Largest time accepted (seconds since the epoch, the year 2286): past it a
#: record is a clock gone wrong or a hostile one, and would stretch every
#: time axis and histogram it reaches.
MAX_TIME = 1e10
#: Largest rank, step, seq, pid or world size: what fits in a C int.
MAX_INT = 2**31 - 1
#: Largest byte or event count (an unsigned 63-bit counter).
MAX_COUNT = 2**63 - 1
#: Longest string field (host names, endpoints, ops) and list of addresses.
MAX_STR = 256
MAX_ADDRS = 64

# A rule is a Python expression over ``v`` (the field's value, never None);
# each kind's checker is generated from its fields' rules (see _compile),
# because replay runs it on every record and a loop of calls cost 3x more.
# The field families, each with one rule (and one fast form, below).
_TIME_FIELDS = ("t", "start", "end", "issue")
_INT_FIELDS = ("rank", "step", "seq", "pid", "peer_rank", "port", "qp_num", "host_pid", "attempt")
_COUNT_FIELDS = (
    "bytes", "tx_bytes", "rx_bytes", "calls", "retrans", "dsack_dups", "drops", "backlog",
)  # fmt: skip
_STR_FIELDS = ("host", "op", "src", "dst", "dev", "what", "state", "cause", "job", "direction")
_NUMBER = "(type(v) is float or type(v) is int)"
_RULES: dict[str, str] = {
    **dict.fromkeys(_TIME_FIELDS, f"{_NUMBER} and 0 <= v <= {MAX_TIME!r}"),
    "dt": f"{_NUMBER} and 0 <= v <= 1e6",
    **dict.fromkeys(_INT_FIELDS, f"type(v) is int and 0 <= v <= {MAX_INT}"),
    **dict.fromkeys(("world_size", "group_size"), f"type(v) is int and 1 <= v <= {MAX_INT}"),
    "group": f"type(v) is str and len(v) <= {MAX_STR}",
    **dict.fromkeys(_COUNT_FIELDS, f"type(v) is int and 0 <= v <= {MAX_COUNT}"),
    **dict.fromkeys(("score", "srtt_us", "cwnd"), f"{_NUMBER} and -1e15 < v < 1e15"),
    **dict.fromkeys(_STR_FIELDS, f"type(v) is str and len(v) <= {MAX_STR}"),
    "addrs": f"type(v) is list and len(v) <= {MAX_ADDRS}"
    f" and all(type(a) is str and len(a) <= {MAX_STR} for a in v)",
    "version": "type(v) is int",
}


def _compile(fields: Iterable[str]) -> Callable[[Record], str | None]:
    """A checker for records with ``fields``: the first field whose value
    breaks its rule, or None. Absent fields pass (required ones are checked
    before); fields without a rule (``params``, ``evidence``) are free."""
    body = ["def check(r):", "    get = r.get"]
    scope: dict[str, Any] = {}
    for i, f in enumerate(fields):
        rule = _RULES.get(f)
        if rule is None:
            continue
        # Look the field up with the parser's own key object where there is one.
        scope[f"k{i}"] = KEY.get(f, f)
        body.append(f"    v = get(k{i})")
        body.append(f"    if v is not None and not ({rule}): return {f!r}")
    body.append("    return None")
    exec("\n".join(body), scope)  # noqa: S102 - our own constant rules, as namedtuple does
    return scope["check"]  # type: ignore[no-any-return]


#: Optional fields that known kinds carry (docs/trace-format.md), checked too.
OPTIONAL: dict[str, tuple[str, ...]] = {
    "rank": ("job", "host_pid", "attempt"),
    "coll": ("group", "group_size"),
    "pending": ("group",),
    "flow": ("srtt_us", "retrans", "dsack_dups", "cwnd", "rank", "peer_rank"),
    "netdev": ("drops", "backlog"),
    "verdict": ("host", "peer_rank", "job"),
    "fault": ("step", "end"),
}
_CHECKS: dict[str, Callable[[Record], str | None]] = {}


#: The fast form of each rule family, over several required fields at once:
#: ``(a | b | c)`` of non-negative ints is within a bit width iff each is,
#: and any non-int raises TypeError (caught: the slow checker names the field).
_FAST = {
    "int": (_INT_FIELDS, "0 <= ({}) <= " + str(MAX_INT), " | "),
    "count": (_COUNT_FIELDS, "0 <= ({}) <= " + str(MAX_COUNT), " | "),
    "time": (_TIME_FIELDS, f"0 <= {{}} <= {MAX_TIME!r}", None),
    "str": (_STR_FIELDS, f"type({{0}}) is str and len({{0}}) <= {MAX_STR}", None),
}


def _compile_fast(kind: str) -> Callable[[Record], str | None]:
    """The per-record checker replay runs: the required fields' rules as one
    expression over one ``itemgetter`` pass (a third of the slow checker's
    cost on a ``coll`` record), the optional fields and any failure handed
    to the slow checker, which names the field."""
    from operator import itemgetter

    slow = _compile((*REQUIRED[kind], *OPTIONAL.get(kind, ())))
    req = REQUIRED[kind]
    names: list[str] = []
    terms: list[str] = []
    covered: set[str] = set()
    for fields, form, join in _FAST.values():
        mine = [f for f in req if f in fields]
        if not mine:
            continue
        start = len(names)
        names += mine
        covered.update(mine)
        vars_ = [f"a{start + i}" for i in range(len(mine))]
        if join is not None:
            terms.append(form.format(join.join(vars_)))
        else:
            terms += [form.format(v) for v in vars_]
    rest = [f for f in (*req, *OPTIONAL.get(kind, ())) if f in _RULES and f not in covered]
    if not names:
        return slow
    scope: dict[str, Any] = {
        "ig": itemgetter(*(KEY.get(f, f) for f in names)),
        "slow": slow,
        "rest": _compile(rest) if rest else None,
    }
    unpack = ", ".join(f"a{i}" for i in range(len(names))) + ("," if len(names) == 1 else "")
    body = [
        "def check(r):",
        "    try:",
        f"        {unpack} = ig(r)",
        f"        if {' and '.join(terms)}:",
        "            return rest(r) if rest is not None else None",
        "    except TypeError:",
        "        pass",
        "    return slow(r)",
    ]
    exec("\n".join(body), scope)  # noqa: S102 - our own constant rules
    return scope["check"]  # type: ignore[no-any-return]


def bad_field(rec: Record) -> str | None:
    """The first field of ``rec`` (a record of a known kind with its required
    fields) whose value is of the wrong type or out of range, or None.

    The one schema of the format: live ingest and replay both refuse what it
    refuses, so the same bytes get the same verdict either way."""
    kind = rec.get(_KIND)
    check = _CHECKS.get(kind) if type(kind) is str else None
    if check is None:
        if type(kind) is not str or kind not in REQUIRED:
            return None if type(kind) is str and len(kind) <= MAX_STR else "kind"
        check = _CHECKS[kind] = _compile_fast(kind)
    return check(rec)


class TraceError(ValueError):
    """A malformed trace line; ``path`` and ``line`` say where."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


def header() -> Record:
    return {"kind": "header", "format": FORMAT, "version": VERSION}


# --------------------------------------------------------------------------- checked frames

#: The schema's own version: bumped whenever a rule of :data:`_RULES` or
#: :data:`REQUIRED` tightens, so that marks made under an older schema stop
#: vouching for their frames (a reader trusts only a mark of its own schema).
SCHEMA = 1

#: A zstd *skippable* frame (magic 0x184D2A5E) that our writer puts before
#: each data frame whose records all passed :func:`validate` when written.
#: Its payload: ``FSS1``, the file's 16-byte token (the header's
#: ``checked.token``), the data frame's compressed length and the frame's own
#: checksum field (its last 4 bytes: the low 32 bits of the content's xxh64).
#: zstd tools skip such frames and never copy them: a trace decompressed and
#: recompressed (edited or not) keeps the header's text but loses every mark,
#: so it is checked in full.
MARK_MAGIC = struct.pack("<I", 0x184D2A5E)
_MARK = struct.Struct("<4sI4s16sI4s")  # magic, payload size, FSS1, token, length, checksum
_MARK_TAG = b"FSS1"
#: A marked frame holds at most this much text (the writer ends one sooner);
#: a mark claiming more is not ours and is ignored.
FRAME_TEXT_MAX = 1 << 20


def _mark(token: bytes, frame: bytes) -> bytes:
    return _MARK.pack(MARK_MAGIC, _MARK.size - 8, _MARK_TAG, token, len(frame), frame[-4:])


def header_token(rec: Any) -> bytes | None:
    """The token of a ``header`` record's ``checked`` mark, when it is one of
    this schema's (``{"schema": SCHEMA, "token": 32 hex digits}``), else None."""
    if type(rec) is not dict or rec.get("kind") != "header" or rec.get("format") != FORMAT:
        return None
    mark = rec.get("checked")
    if type(mark) is not dict or mark.get("schema") != SCHEMA:
        return None
    token = mark.get("token")
    if type(token) is not str or len(token) != 32:
        return None
    try:
        return bytes.fromhex(token)
    except ValueError:
        return None


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
    bad = bad_field(rec)
    if bad is not None:
        return f"{kind[:40]} field {bad!r}: {_why(rec, bad)}"
    return None


def _why(rec: Record, name: str) -> str:
    """What is wrong with field ``name`` of ``rec``, in a few words (for errors)."""
    v = rec.get(name)
    text = repr(v)
    shown = text if len(text) <= 40 else text[:37] + "..."
    return f"{shown} is of the wrong type or out of range"


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


def encode_decoded(rec: Record) -> bytes:
    """:func:`encode` for a record that came out of :func:`decode` (a line of a
    trace or a datagram, perhaps with fields of JSON types added): the same
    values, written ~8x faster.

    Only for such records: orjson writes a NaN as ``null`` where ``encode``
    refuses it, and a decoded record holds none (the decoder refuses them),
    nor a key that is not a string, nor an int past 64 bits (it reads those as
    floats). Its text may differ from ``encode``'s (``1e-05`` is ``0.00001``,
    ``\u00e9`` is the UTF-8 bytes); decoded, the records are equal. Anything
    orjson refuses goes to ``encode``.
    """
    try:
        return _dumps_line(rec)
    except TypeError:
        return encode(rec)


def _is_zst(path: str | os.PathLike[str]) -> bool:
    return str(path).endswith(".zst")


# --------------------------------------------------------------------------- writing


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def repair_tail(path: str | os.PathLike[str]) -> int:
    """Cut a torn last write off a trace before appending to it; bytes removed.

    A writer killed mid-write leaves half a zstd frame (or half a line) at
    the end; appending after it would make the rest of the file unreadable.
    So the file is cut back to its last complete frame (line). What the cut
    removes was never synced: at most one sync interval of records."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        return 0
    keep = _first_damaged_frame(p) if _is_zst(p) else _after_last_newline(p, size)
    keep = size if keep is None else keep
    if keep < size:
        with open(p, "r+b") as fh:
            fh.truncate(keep)
            fh.flush()
            os.fsync(fh.fileno())
    return size - keep


class _Damaged(Exception):
    """Stops a frame walk at its first damaged frame (``offset``: where it starts)."""

    def __init__(self, offset: int) -> None:
        self.offset = offset


def _first_damaged_frame(path: Path) -> int | None:
    """Where the first cut or corrupt frame of a ``.zst`` trace starts, or None:
    the reader's own frame walk (memory-flat), stopped at the first damage."""

    try:
        for _ in _FrameLines(path, _stop_at_damage):
            pass
    except _Damaged as d:
        return d.offset
    return None


def _file_token(path: Path) -> bytes | None:
    """The mark token of an existing ``.zst`` trace's header (None: it has none)."""
    try:
        for line in _FrameLines(path, _stop_at_damage):
            return header_token(_loads(line))
    except (_Damaged, ValueError, OSError):
        pass
    return None


def _stop_at_damage(frame: int, offset: int, what: str, line: int) -> None:
    raise _Damaged(offset)


def _after_last_newline(path: Path, size: int) -> int | None:
    """Where a torn last line of a ``.jsonl`` trace starts, or None when the
    file ends with a newline; read backwards, never the whole file."""
    chunk = 1 << 16
    with open(path, "rb") as fh:
        end = size
        while end > 0:
            start = max(0, end - chunk)
            fh.seek(start)
            data = fh.read(end - start)
            if end == size and data.endswith(b"\n"):
                return None
            i = data.rfind(b"\n")
            if i >= 0:
                return start + i + 1
            end = start
    return 0


class TraceWriter:
    """Appends records to a trace file; thread-safe; never raises after it opened.

    Flushes and fsyncs every ``sync_interval`` seconds (checked on each write)
    and on ``close()``, so a crash loses at most one interval. A ``.zst`` path
    is written as a stream of independently flushed zstd frames, each with
    its checksum, so a crash leaves every synced frame readable and a flipped
    byte is caught. Reopening a file for append first cuts a torn last frame
    (or line) off (:func:`repair_tail`). The header is written once, when the
    file is new or empty.

    A ``.zst`` file is *checked*: every record is held to :func:`validate`
    as it is written, and a frame all of whose records pass is marked (a
    skippable frame before it, see :data:`MARK_MAGIC`) so that replay can
    trust its values once its checksum holds; a frame with a record that
    fails goes out unmarked, and its reader checks every line (and refuses
    that one, as it always did). A frame ends at each sync and whenever it
    holds :data:`FRAME_TEXT_MAX` bytes of text.

    A record that cannot be encoded (a non-finite number) is skipped and
    counted in ``unencodable``. A failed write or sync (a full disk: ENOSPC,
    EIO) switches the writer off: ``failed`` holds the error, ``lost`` counts
    the records not written from then on, and the caller's work goes on (the
    daemon keeps detecting; a trace is a record of the run, not the run).
    """

    #: Text a frame holds before it is ended even without a sync (a marked
    #: frame is decompressed whole by the reader: this bounds its memory).
    FRAME_TEXT = 1 << 18

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
        self.repaired = repair_tail(self.path) if self.path.is_file() else 0
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._zst = _is_zst(self.path)
        # The file's mark: a new token for a new file; an existing file's own
        # (from its header), or none when it has none (then nothing is marked).
        self._token: bytes | None = None
        if self._zst:
            self._token = os.urandom(16) if fresh else _file_token(self.path)
        self._raw: IO[bytes] = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self._compressor: Any = None
        if self._zst:
            import zstandard

            self._compressor = zstandard.ZstdCompressor(level=3, write_checksum=True)
        self._frame: list[bytes] = []  # the open frame's lines (.zst)
        self._frame_bytes = 0
        self._frame_clean = True  # every line of the open frame passed validate()
        self._last_sync = self._clock()
        self.records = 0
        self.unencodable = 0
        self.unchecked = 0  # records written that failed validate() (in unmarked frames)
        self.lost = 0
        self.failed: OSError | None = None
        self.closed = False
        if fresh:
            head = header()
            if self._token is not None:
                head["checked"] = {"schema": SCHEMA, "token": self._token.hex()}
            self.write(head)

    def write(self, rec: Record, decoded: bool = False) -> None:
        """Append ``rec``. ``decoded``: it came out of :func:`decode` and passed
        :func:`validate`'s checks on the way (the ingest socket's records: the
        daemon's hot path), so it is encoded by :func:`encode_decoded` and not
        checked a second time."""
        try:
            data = encode_decoded(rec) if decoded else encode(rec)
        except (ValueError, TypeError):
            with self._lock:
                self.unencodable += 1
            return
        with self._lock:
            if self.closed:
                return
            if self.failed is not None:
                self.lost += 1
                return
            try:
                if self._zst:
                    if self._token is not None and not decoded and validate(rec) is not None:
                        self._frame_clean = False
                        self.unchecked += 1
                    self._frame.append(data)
                    self._frame_bytes += len(data)
                    self.records += 1
                    if self._frame_bytes >= self.FRAME_TEXT:
                        self._end_frame()
                else:
                    self._raw.write(data)
                    self.records += 1
                if self._clock() - self._last_sync >= self.sync_interval:
                    self._sync_locked()
            except OSError as e:
                self._fail(e)

    def _end_frame(self) -> None:
        """Write the open frame (marked when all its records passed validate())."""
        if not self._frame:
            return
        text = b"".join(self._frame)
        n = len(self._frame)
        self._frame.clear()
        self._frame_bytes = 0
        clean, self._frame_clean = self._frame_clean, True
        frame = self._compressor.compress(text)
        try:
            if clean and self._token is not None and len(text) <= FRAME_TEXT_MAX:
                self._raw.write(_mark(self._token, frame) + frame)
            else:
                self._raw.write(frame)
        except OSError:
            self.lost += n - 1  # the frame's records are lost; _fail counts one
            raise

    def _fail(self, e: OSError) -> None:
        """Switch off after a write error; what could not be written is counted."""
        if self.failed is None:
            self.failed = e
            self.lost += 1

    def write_many(self, recs: Iterable[Record]) -> None:
        for rec in recs:
            self.write(rec)

    def size(self) -> int:
        """Bytes in the file so far: those written out (buffered ones included),
        not the open ``.zst`` frame's (what ``trace_segments`` rotates on)."""
        with self._lock:
            if self.closed:
                return self.path.stat().st_size if self.path.exists() else 0
            return self._raw.tell()

    def sync(self) -> None:
        with self._lock:
            if not self.closed and self.failed is None:
                try:
                    self._sync_locked()
                except OSError as e:
                    self._fail(e)

    def _sync_locked(self) -> None:
        # The interval runs from cut to cut (what reaches the OS), not from the
        # end of the fsync: a crash loses what came after the last flush, so
        # an fsync that takes 50 ms on a busy disk must not stretch what a
        # crash can lose past ``sync_interval``.
        self._last_sync = self._clock()
        if self._zst:
            # End the frame so everything so far is decodable after a crash.
            self._end_frame()
        self._raw.flush()
        try:
            os.fsync(self._raw.fileno())
        except OSError as e:
            # A pipe or terminal (``--verdicts-out /dev/stdout``) cannot be
            # synced; what was flushed to it is all there is to keep.
            if e.errno not in (errno.EINVAL, errno.EROFS, errno.ENOTSUP):
                raise

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                if self.failed is None:
                    self._sync_locked()
            except OSError as e:
                self._fail(e)
            finally:
                with contextlib.suppress(OSError):
                    self._raw.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- reading


class _FrameLines:
    """The lines of a ``.zst`` trace, frame by frame, knowing where each frame
    starts: a frame cut short (a truncated file) or corrupt (a flipped byte:
    its checksum fails) is reported through ``on_damage(frame, offset, what,
    lines_so_far)``, which raises (strict) or returns (lenient: the reader
    skips to the next frame, found by its magic number, and counts it)."""

    #: Compressed input read at a time: 16 KiB, whose text stays in cache
    #: (145 ns a line against 166 and more at 32 KiB and up, measured).
    CHUNK = 1 << 14

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_damage: Callable[[int, int, str, int], None],
        owner: Any = None,
    ) -> None:
        self.path = path
        self.on_damage = on_damage
        self.owner = owner  # gets the open file as ``_raw``: its position is the progress
        self.lines = 0  # lines given so far (for the line a damage report names)

    def __enter__(self) -> _FrameLines:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __iter__(self) -> Iterator[bytes]:
        # Lines come in lists, one per decompressed piece, flattened at C
        # speed: a generator step per line cost a third of the parse.
        return itertools.chain.from_iterable(lines for lines, _ in self.batches())

    def batches(self) -> Iterator[tuple[list[bytes], bytes | None]]:
        """The lines in lists, each with the token of the mark that vouches for
        them: a whole marked frame whose length and checksum match its mark
        and whose content decoded (zstd checked the content against the
        checksum before any line is given); None for everything else."""
        for text, token in self.frames():
            if isinstance(text, bytes):
                lines = text.splitlines(keepends=True)
                self.took(len(lines))
                yield lines, token
            else:
                yield text, token

    def frames(self) -> Iterator[tuple[bytes | list[bytes], bytes | None]]:
        """:meth:`batches`, but a vouched frame comes as its whole text (bytes,
        every line ending in a newline), not split into lines: a reader that
        trusts it can parse it in a few calls (:meth:`TraceReader.batches`).
        Its lines are not counted here (that is a pass over every byte): the
        reader says how many it took (:meth:`took`) before it asks for more."""
        import zstandard

        dctx = zstandard.ZstdDecompressor()
        frame = 0
        with open(self.path, "rb") as fh:
            if self.owner is not None:
                self.owner._raw = fh
            start = 0  # file offset where the current frame starts
            data = b""  # bytes read and not yet given to a frame
            while True:
                if not data:
                    data = fh.read(self.CHUNK)
                    if not data:
                        return
                if data.startswith(MARK_MAGIC[:1]):
                    marked, data = self._marked(fh, data, dctx)
                    if marked is not None:
                        text, token, used, data = marked
                        frame += 2  # the mark and its data frame
                        start += used
                        yield text, token
                        continue
                frame += 1
                dobj = zstandard.ZstdDecompressor().decompressobj()
                tail = b""
                used = 0  # bytes of this frame fed so far
                try:
                    while True:
                        # Lines are given as they come (a frame written in one go
                        # can hold a whole trace: memory stays flat). A damage
                        # found later in the frame is reported when it is met.
                        text = dobj.decompress(data)
                        if text:
                            lines = (tail + text if tail else text).splitlines(keepends=True)
                            tail = lines.pop() if not lines[-1].endswith(b"\n") else b""
                            self.lines += len(lines)
                            yield lines, None
                        if dobj.eof:
                            rest = dobj.unused_data
                            used += len(data) - len(rest)
                            data = rest
                            break
                        used += len(data)
                        data = fh.read(self.CHUNK)
                        if not data:
                            break
                except zstandard.ZstdError as e:
                    self.on_damage(frame, start, f"corrupt ({e})", self.lines)
                    start, data = self._resync(fh, start + 1)
                    continue
                if not dobj.eof:
                    # Cut short, or a damaged header made it claim more than
                    # it has: a frame after it tells the two apart.
                    nxt, more = self._resync(fh, start + 1)
                    if more:
                        self.on_damage(
                            frame, start, "corrupt (runs into the next frame)", self.lines
                        )
                        start, data = nxt, more
                        continue
                    # The torn last line (if any) is not given.
                    self.on_damage(frame, start, "truncated (the file ends inside it)", self.lines)
                    return
                if tail:  # a frame ends where its writer flushed: after a whole record
                    self.lines += 1
                    yield [tail], None
                start += used

    def took(self, lines: int) -> None:
        """A reader of :meth:`frames` took this many lines of a vouched frame."""
        self.lines += lines

    @staticmethod
    def _marked(
        fh: Any, data: bytes, dctx: Any
    ) -> tuple[tuple[bytes, bytes, int, bytes] | None, bytes]:
        """The marked frame at the start of ``data`` (more read from ``fh`` as
        needed) as (its text, its token, the bytes it took, mark included, and
        the bytes after it), or None when ``data`` does not start with a mark
        whose frame holds; second, ``data`` with what was read onto it (when
        None, nothing of it was used: the caller reads it the ordinary way,
        which reports any damage)."""
        import zstandard

        while len(data) < _MARK.size:
            more = fh.read(_FrameLines.CHUNK)
            if not more:
                return None, data
            data += more
        magic, size, tag, token, length, checksum = _MARK.unpack_from(data)
        # A frame our writer could not have made (too long) is not vouched for.
        if magic != MARK_MAGIC or size != _MARK.size - 8 or tag != _MARK_TAG:
            return None, data
        end = _MARK.size + length
        if length > FRAME_TEXT_MAX:
            return None, data
        while len(data) < end:
            more = fh.read(max(_FrameLines.CHUNK, end - len(data)))
            if not more:
                return None, data
            data += more
        body = data[_MARK.size : end]
        if not body.startswith(ZSTD_MAGIC) or body[-4:] != checksum:
            return None, data
        try:
            params = zstandard.get_frame_parameters(body)
            if not params.has_checksum or not 0 <= params.content_size <= FRAME_TEXT_MAX:
                return None, data
            text = dctx.decompress(body)
        except zstandard.ZstdError:
            return None, data
        if len(text) != params.content_size or (text and not text.endswith(b"\n")):
            return None, data
        return (text, token, end, data[end:]), data

    @staticmethod
    def _resync(fh: Any, offset: int) -> tuple[int, bytes]:
        """The next frame at or after ``offset``, found by its magic number."""
        fh.seek(offset)
        carry = b""
        base = offset
        while True:
            chunk = fh.read(_FrameLines.CHUNK)
            if not chunk:
                return base + len(carry), b""
            buf = carry + chunk
            i = buf.find(ZSTD_MAGIC)
            if i >= 0:
                return base + i, buf[i:]
            keep = len(ZSTD_MAGIC) - 1
            base += len(buf) - keep
            carry = buf[-keep:]


def _open_lines(
    path: str | os.PathLike[str],
    on_damage: Callable[[int, int, str, int], None],
    owner: Any = None,
) -> Any:
    if not _is_zst(path):
        raw = open(path, "rb")  # noqa: SIM115 - returned to caller
        if owner is not None:
            owner._raw = raw  # its position is the reader's progress
        return raw
    return _FrameLines(path, on_damage, owner)


@dataclass
class TraceReader:
    """Streams records from one trace file.

    ``strict`` (default): broken JSON or a missing required field raises
    :class:`TraceError` naming the file and line. Lenient: such lines are
    skipped and counted in ``skipped`` (their line numbers in ``skipped_lines``,
    the first 100). A last line with no newline that does not parse (a writer
    that crashed mid-line) counts as truncated in lenient mode and is an error
    in strict mode.

    A ``.zst`` file written by :class:`TraceWriter` says in its header
    (``checked``) that its marked frames hold only records that passed
    :func:`validate` when written; the lines of such a frame, once its
    length and checksum match its mark (a flipped byte fails the checksum
    before any line is given), are parsed without the per-record checks.
    Everything else (a ``.jsonl``, unmarked frames, a file whose header has
    no valid mark, a frame that fails) is checked line by line.
    ``trust_marks=False`` checks every line of every file.
    """

    path: str | os.PathLike[str]
    strict: bool = True
    trust_marks: bool = True
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

    damaged_frames: list[tuple[int, int, str]] = field(default_factory=list)

    #: A marked frame (~2,000 records) is parsed and given about this many
    #: bytes of it at a time (~250 of the daemon's records, the whole lines
    #: that begin in them). Its records are consumed while they are still in
    #: the CPU's caches, and the cyclic GC's young-generation passes (one per
    #: 700 new containers) find a few hundred live records to walk instead of
    #: the whole frame's: replay of the 300k bench trace ~6 % faster than
    #: whole frames at the same instruction count (BENCHMARKS.md, "Replay
    #: speed, the gap to the start explained").
    PIECE_BYTES: ClassVar[int] = 48 << 10

    def __iter__(self) -> Iterator[Record]:
        # Flattened at C speed: a generator step per record cost more than the
        # records' own filing on replay's hot path.
        return itertools.chain.from_iterable(self.batches())

    def batches(self) -> Iterator[list[Record]]:
        """The records in lists, in file order (a marked frame's records,
        :attr:`PIECE` at a time, or the checked records of one decompressed
        piece): what replay feeds a pipeline a list at a time
        (:meth:`Pipeline.feed_batch`). In strict mode the records before a bad
        line are given before the error."""
        name = str(self.path)
        loads = _loads
        # Hot loop (replay is parse-bound): a C-level subset test per record.
        required = _REQUIRED_SETS
        checks = _CHECKS
        token: bytes | None = None  # the file's mark (from its header), once read
        lineno = 0
        with _open_lines(self.path, self._damaged, self) as fh:
            if isinstance(fh, _FrameLines):
                batches: Iterable[tuple[bytes | list[bytes], bytes | None]] = fh.frames()
            else:  # a plain file, in pieces of about 64 KiB (memory stays flat)
                batches = ((lines, None) for lines in iter(partial(fh.readlines, 1 << 16), []))
            try:
                for chunk, mark in batches:
                    if isinstance(chunk, list):
                        lines = chunk
                    elif mark is None or mark != token:
                        lines = chunk.splitlines(keepends=True)
                        fh.took(len(lines))  # type: ignore[union-attr]
                    else:
                        # Vouched for by our writer's check (the checksum held):
                        # parsed at C speed, the records given as they are, a
                        # piece at a time (see PIECE_BYTES), each piece's lines
                        # read as one JSON array: no line split off on its own.
                        for recs in _vouched_pieces(chunk, self.PIECE_BYTES):
                            if isinstance(recs, list):
                                lineno += len(recs)
                                fh.took(len(recs))  # type: ignore[union-attr]
                                yield recs
                                continue
                            # Not what our writer writes: this piece and the rest
                            # of the frame are checked line by line.
                            lines = chunk[recs:].splitlines(keepends=True)
                            fh.took(len(lines))  # type: ignore[union-attr]
                            break
                        else:
                            continue
                    good: list[Record] = []
                    try:
                        for lineno, raw in enumerate(lines, lineno + 1):  # noqa: B007, B020
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
                                if kind == "header":
                                    if rec.get("format") != FORMAT:
                                        self._bad(
                                            name,
                                            lineno,
                                            f"not an {FORMAT} header: {rec.get('format')!r}",
                                        )
                                        continue
                                    if lineno == 1 and self.trust_marks:
                                        token = header_token(rec)
                                check = checks.get(kind)  # type: ignore[arg-type]
                                bad = check(rec) if check is not None else bad_field(rec)
                                if bad is not None:
                                    self._bad(
                                        name, lineno, f"{kind} field {bad!r}: {_why(rec, bad)}"
                                    )
                                    continue
                                good.append(rec)
                                continue
                            reason = validate(rec)  # the slow path: say what is wrong
                            if reason is None:
                                # Unknown kind: readers ignore it, but pass it on;
                                # consumers dispatch on kind and drop what they do not know.
                                good.append(rec)
                            else:
                                self._bad(name, lineno, reason)
                    except TraceError:
                        if good:
                            yield good  # the records before the bad line, as before
                        raise
                    if good:
                        yield good
            finally:
                self.lines = lineno

    def _damaged(self, frame: int, offset: int, what: str, line: int) -> None:
        """A damaged zstd frame: an error (strict) or counted and skipped (lenient).
        ``line``: the lines read before it (the error names the next one)."""
        if self.strict:
            raise TraceError(
                str(self.path), line + 1, f"zstd frame {frame} at byte {offset}: {what}"
            )
        self.damaged_frames.append((frame, offset, what))

    def _bad(self, name: str, lineno: int, why: str) -> None:
        if self.strict:
            raise TraceError(name, lineno, why)
        self.skipped += 1
        if len(self.skipped_lines) < 100:
            self.skipped_lines.append(lineno)


def _vouched_pieces(text: bytes, size: int) -> Iterator[list[Record] | int]:
    """A vouched frame's records, a piece of about ``size`` bytes of whole
    lines at a time, each piece parsed as one JSON array (its newlines made
    commas); or, where a piece does not parse so, the offset of that piece
    (and no more pieces): the caller checks the rest line by line.

    The writer's check vouches for one record a line, as it vouches for the
    records themselves (they are given unchecked): a forged frame whose line
    holds two values (``{..},{..}``) gives two records, as it could give any.
    """
    n = len(text)
    pos = 0
    loads = _loads
    # The frame's text once, shifted one byte on, its newlines made commas: a
    # piece text[pos:cut] is then the JSON array arr[pos:cut + 1] once the
    # comma before it (or the lead byte) is made "[" and its last one "]".
    arr = bytearray(b"[")
    arr += text.replace(b"\n", b",")
    view = memoryview(arr)
    try:
        while pos < n:
            cut = text.find(b"\n", min(pos + size, n) - 1) + 1
            arr[pos] = 0x5B  # [
            arr[cut] = 0x5D  # ]
            try:
                recs = loads(view[pos : cut + 1])
            except ValueError:
                recs = None
            if type(recs) is not list:
                yield pos
                return
            yield recs
            pos = cut
    finally:
        view.release()


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
