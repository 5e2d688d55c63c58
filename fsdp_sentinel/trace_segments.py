"""A size-capped trace: ``--trace-out`` cut into segments, the oldest removed.

A daemon beside a week-long job writes its trace for a week. With
``--trace-max-bytes`` the file at ``--trace-out`` (the *active* segment) is
closed once it holds that many bytes, renamed to the next numbered segment
(``run.jsonl.zst`` -> ``run.000001.jsonl.zst``: the number goes before the
suffixes, so a segment is still a ``.zst`` trace) and a new active file is
started; with ``--trace-keep K`` only the newest K closed segments stay.

Every segment is a whole trace of its own (its own header, and for ``.zst``
its own mark token), so each reads alone in strict mode, and replay of a
set of them (``fsdp-sentinel replay run.*.jsonl.zst run.jsonl.zst``) merges
them back into the one stream in time order. The rename is atomic: after a
crash the active file is reopened for append (its torn tail cut off by
:func:`~fsdp_sentinel.trace.repair_tail`) and numbering goes on after the
highest segment on disk.

:class:`SegmentedTraceWriter` has the :class:`~fsdp_sentinel.trace.TraceWriter`
surface the daemon uses (``write``, ``sync``, ``close``, ``records``,
``failed``, ``lost``, ``unencodable``, ``path``), so the daemon holds either.
A write error, in a segment or in a rotation, switches the whole trace off
(``failed``), like a full disk in one file; detection goes on.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

from fsdp_sentinel.trace import TraceWriter

Record = dict[str, Any]

#: Records between two looks at the active segment's size (a look is a tell()).
CHECK_EVERY = 256


def split_name(path: Path) -> tuple[str, str]:
    """``run.jsonl.zst`` -> (``run``, ``.jsonl.zst``): the stem and the suffixes
    a segment number goes between."""
    name = path.name
    stem, dot, rest = name.partition(".")
    return (stem, dot + rest) if stem else (name, "")


def segment_path(path: Path, n: int) -> Path:
    stem, suffixes = split_name(path)
    return path.with_name(f"{stem}.{n:06d}{suffixes}")


def segments(path: str | os.PathLike[str]) -> list[Path]:
    """The closed segments of the trace at ``path``, oldest first (the active
    file itself not included)."""
    p = Path(path)
    stem, suffixes = split_name(p)
    rx = re.compile(re.escape(stem) + r"\.(\d{6,})" + re.escape(suffixes) + r"\Z")
    found = []
    if p.parent.is_dir():
        for q in p.parent.iterdir():
            m = rx.match(q.name)
            if m and q.is_file():
                found.append((int(m.group(1)), q))
    return [q for _, q in sorted(found)]


def _number(seg: Path, path: Path) -> int:
    stem, suffixes = split_name(path)
    return int(seg.name[len(stem) + 1 : len(seg.name) - len(suffixes)])


class SegmentedTraceWriter:
    """A :class:`~fsdp_sentinel.trace.TraceWriter` at ``path``, rotated at
    ``max_bytes`` (see the module docstring); ``keep``: closed segments kept
    (None: all). ``rotations`` counts the segments closed by this writer,
    ``removed`` the old ones it deleted."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int,
        keep: int | None = None,
        **writer_options: Any,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if keep is not None and keep < 0:
            raise ValueError(f"keep must be 0 or more, got {keep}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self._options = writer_options
        self._lock = threading.RLock()
        self._writer = TraceWriter(self.path, **writer_options)
        closed = segments(self.path)
        self._next = _number(closed[-1], self.path) + 1 if closed else 1
        self._since_check = 0
        self._done_records = 0  # records of the segments closed so far
        self._done_lost = 0
        self._done_unencodable = 0
        self.rotations = 0
        self.removed = 0
        self.failed: OSError | None = None
        self.closed = False

    # The TraceWriter surface the daemon reads.
    @property
    def records(self) -> int:
        return self._done_records + self._writer.records

    @property
    def lost(self) -> int:
        return self._done_lost + self._writer.lost

    @property
    def unencodable(self) -> int:
        return self._done_unencodable + self._writer.unencodable

    def write(self, rec: Record, decoded: bool = False) -> None:
        with self._lock:
            w = self._writer
            if w.closed:  # a rotation failed: the trace is off, the record lost
                self._done_lost += 1
                return
            w.write(rec, decoded)
            if self.failed is None and w.failed is not None:
                self.failed = w.failed
            self._since_check += 1
            if self._since_check >= CHECK_EVERY and self.failed is None and not self.closed:
                self._since_check = 0
                if w.size() >= self.max_bytes:
                    self.rotate()

    def write_many(self, recs: Any) -> None:
        for rec in recs:
            self.write(rec)

    def sync(self) -> None:
        with self._lock:
            self._writer.sync()
            if self.failed is None and self._writer.failed is not None:
                self.failed = self._writer.failed
            if self.failed is None and not self.closed and self._writer.size() >= self.max_bytes:
                self.rotate()

    def rotate(self) -> None:
        """Close the active segment, give it the next number, start a new one."""
        with self._lock:
            w = self._writer
            w.close()
            if w.failed is not None:
                self.failed = w.failed
                return
            try:
                os.rename(self.path, segment_path(self.path, self._next))
                fresh = TraceWriter(self.path, **self._options)
            except OSError as e:
                # The closed segment stays where it is; the trace goes off,
                # and what comes is counted lost (see write()).
                self.failed = e
                return
            self._done_records += w.records
            self._done_lost += w.lost
            self._done_unencodable += w.unencodable
            self._writer = fresh
            self._next += 1
            self.rotations += 1
            self._drop_old()

    def _drop_old(self) -> None:
        if self.keep is None:
            return
        old = segments(self.path)
        for seg in old[: max(0, len(old) - self.keep)]:
            try:
                seg.unlink()
                self.removed += 1
            except FileNotFoundError:
                pass

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._writer.close()
            if self.failed is None and self._writer.failed is not None:
                self.failed = self._writer.failed

    def __enter__(self) -> SegmentedTraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
