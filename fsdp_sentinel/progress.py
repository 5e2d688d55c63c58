"""A progress line on stderr for long reads (``replay``, ``report``): records/s and ETA.

Shown only when the input is large (``min_bytes``, a few MB) and the stream
is a terminal: a pipe, a log or a test sees nothing. Progress is the share
of the input files' bytes read so far (compressed bytes for ``.zst``: what
the disk gives), so the ETA needs no first pass to count records. The line
is redrawn at most every ``every`` seconds and is checked only every
``check`` records, so the replay loop pays one counter a record.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

MIN_BYTES = 4 << 20


class ProgressLine:
    """``bar.update(records)`` redraws ``[####....]  42%  1,234,567 records  251k/s  ETA 0:12``."""

    def __init__(
        self,
        total_bytes: int,
        position: Callable[[], int],
        *,
        stream: TextIO | None = None,
        width: int = 24,
        every: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(1, total_bytes)
        self.position = position
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.every = every
        self.clock = clock
        self.t0 = clock()
        self.next_draw = self.t0
        self.drawn = False

    def line(self, records: int, now: float) -> str:
        done = min(1.0, max(0.0, self.position() / self.total))
        spent = max(now - self.t0, 1e-9)
        rate = records / spent
        left = spent * (1.0 - done) / done if done > 0 else None
        eta = "-:--" if left is None else f"{int(left) // 60}:{int(left) % 60:02d}"
        fill = round(done * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        per_s = f"{rate / 1000:.0f}k/s" if rate >= 1000 else f"{rate:.0f}/s"
        return f"[{bar}] {done:4.0%}  {records:,} records  {per_s}  ETA {eta}"

    def update(self, records: int) -> None:
        now = self.clock()
        if now < self.next_draw:
            return
        self.next_draw = now + self.every
        self.stream.write("\r" + self.line(records, now))
        self.stream.flush()
        self.drawn = True

    def close(self, records: int) -> None:
        """Draw the last line (100 %) and end it, if anything was drawn."""
        if self.drawn:
            self.stream.write("\r" + self.line(records, self.clock()) + "\n")
            self.stream.flush()


def wanted(total_bytes: int, stream: Any = None, min_bytes: int = MIN_BYTES) -> bool:
    """Whether to show progress: a large input and a terminal to show it on."""
    s = stream if stream is not None else sys.stderr
    return total_bytes >= min_bytes and bool(getattr(s, "isatty", lambda: False)())


def counted(items: Iterable[T], bar: ProgressLine | None, check: int = 8192) -> Iterator[T]:
    """``items`` unchanged, with ``bar`` updated every ``check`` of them (and closed at the end)."""
    if bar is None:
        yield from items
        return
    n = 0
    try:
        for n, item in enumerate(items, 1):
            if not n % check:
                bar.update(n)
            yield item
    finally:
        bar.close(n)
