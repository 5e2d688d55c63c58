"""How a demo run shows itself while it runs: a progress bar with an ETA over the live table.

On a terminal: a ``rich`` live display that redraws a progress bar (steps done
of steps planned, elapsed, ETA) above the daemon's per-rank table
(``fsdp_sentinel.live.render`` of its latest snapshot), with events (fault
injected, rank flagged) printed above it as they happen. Elsewhere (a pipe, a
test): the events and a short status line every ``every`` seconds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from fsdp_sentinel.snapshot import Snapshot


def steps_done(snap: Snapshot) -> int:
    """Steps every rank has completed (the slowest rank's count)."""
    done = [r.steps_total for r in snap.ranks if r.state != "lost"]
    return min(done) if done else 0


class Progress:
    """``with Progress(total) as p: p.update(snapshot); p.event("...")``."""

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        live: bool | None = None,
        every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(1, total)
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.every = every
        self._clock = clock
        self._start = clock()
        self._last_line = -1e9
        self._snap = Snapshot()
        self._note = "starting"
        self._first: tuple[float, int] | None = None  # (time, steps) of the first step seen
        self._display: Any = None
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.live:
            from rich.console import Console, Group
            from rich.live import Live
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as Bar

            from fsdp_sentinel.live import render

            console = Console(file=self.stream)
            self._bar = Bar(
                TextColumn("steps"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._bar.add_task("steps", total=self.total)
            self._display = Live(
                get_renderable=lambda: Group(
                    self._bar, render(self._snap, now=time.time(), note=self._note)
                ),
                console=console,
                refresh_per_second=2,
                transient=False,
            )
            self._display.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._display is not None:
            self._display.__exit__(None, None, None)
            self._display = None

    def note(self, text: str) -> None:
        self._note = text

    def event(self, text: str) -> None:
        stamp = f"[{self._clock() - self._start:5.1f} s]"
        if self._display is not None:
            self._display.console.print(f"{stamp} {text}", markup=False, highlight=False)
        else:
            print(f"{stamp} {text}", file=self.stream, flush=True)

    def eta(self, done: int, now: float) -> float | None:
        """Seconds to the last step at the pace since the first step was seen."""
        if self._first is None or done <= self._first[1]:
            return None
        t0, d0 = self._first
        return (now - t0) / (done - d0) * (self.total - done)

    def update(self, snap: Snapshot) -> None:
        self._snap = snap
        done = min(self.total, steps_done(snap))
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
            return
        now = self._clock()
        if done and self._first is None:
            self._first = (now, done)
        if now - self._last_line >= self.every:
            self._last_line = now
            flagged = [f"{r.rank}:{r.cause}" for r in snap.ranks if r.state != "ok"]
            step = [r.step_seconds for r in snap.ranks if r.step_seconds is not None]
            print(
                f"[{now - self._start:5.1f} s] steps {done}/{self.total}"
                + (f", step {max(step):.2f} s" if step else "")
                + (f", ETA {eta:.0f} s" if (eta := self.eta(done, now)) is not None else "")
                + (f", flagged {' '.join(flagged)}" if flagged else "")
                + f" ({self._note})",
                file=self.stream,
                flush=True,
            )
