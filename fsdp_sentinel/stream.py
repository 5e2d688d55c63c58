"""Stream sanity: one source's clock or step counter cannot move the whole stream.

The pipeline's only clock is the newest record time it has seen, so before
this guard one record at t+3600 (or one rank whose clock jumped +60 s) moved
"now" for everyone, and every other rank looked silent: 263 ``rank_lost``
verdicts on a clean job. A step number far ahead of the job (still inside
the schema's range) made steps finalise early and left the detector blind.

:class:`StreamGuard` sits in front of :meth:`Pipeline.feed` (live and replay
alike, so the same records still give the same verdicts). A record whose time
is more than ``ahead_s`` past the stream clock is *held aside*, per source (a
rank for hook records, a host for probe records), and then:

* another source jumps with it (or the daemon's own ``clock`` record says
  the time is real): the whole stream moved (a gap in a trace, a wall-clock
  step), so the held records are released in their order and move the clock;
* the same source sends a record in step with the stream again: what was
  held was an outlier, refused and counted (``clock_ahead``);
* the source keeps sending far-ahead records (``confirm`` of them, or for
  ``2 * ahead_s`` of stream time while others go on): its clock jumped, so
  that source alone is re-based: its records, held and later, have the offset
  taken off their times (copies; the trace keeps what was sent) and count as
  heard from now. A re-based source that comes back in step drops its offset.

A ``step``, ``coll`` or ``pending`` record whose step is more than
``step_ahead`` past the job's newest step is refused (``step_ahead``).

Pure: no I/O, no clock; the caller (the pipeline) says what the stream clock
is and feeds on what the guard lets through.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_sentinel import trace

Record = dict[str, Any]

#: Kinds whose time moves the pipeline's stream clock (passive kinds do not),
#: and the field that carries it (the trace format's own placing field).
CLOCKED = ("coll", "step", "rank", "pending", "clock", "flow", "netdev", "conn", "rdma", "nccl")
TIME_FIELD = {k: trace.TIME_FIELD.get(k) or "t" for k in CLOCKED}
#: Kinds a rank sends (its source is the rank); the rest are a host's probes'.
RANK_KINDS = frozenset({"rank", "step", "coll", "pending"})
#: Kinds that carry a step number.
STEP_KINDS = frozenset({"step", "coll", "pending"})
#: Fields of any kind that are times on the sender's clock (shifted when re-based).
TIME_FIELDS = ("t", "start", "end", "issue")

CLOCK_AHEAD = "clock_ahead"
STEP_AHEAD = "step_ahead"
SOURCES_FULL = "held_sources_full"
REASONS = (CLOCK_AHEAD, STEP_AHEAD, SOURCES_FULL)


@dataclass(frozen=True)
class StreamConfig:
    """How far a record may run ahead of the stream before it is held aside."""

    ahead_s: float = 3.0
    """A record this many seconds past the stream clock is held. Below
    ``lost.lost_silence_s`` (5 s), so one record can no longer make the
    others look silent; far above the milliseconds hosts' clocks differ by."""

    confirm: int = 8
    """Far-ahead records from one source, consistent with each other, that
    say its clock jumped (a rank sends several a step)."""

    step_ahead: int = 100_000
    """A step this far past the job's newest is refused (a resumed job goes
    back to its checkpoint's step, never far forward)."""

    max_sources: int = 64
    """Sources with records held at once; more are refused (bounded memory)."""


class _Held:
    """One source's records held aside, and what the stream did meanwhile."""

    __slots__ = ("recs", "first_t", "since_now", "others")

    def __init__(self, first_t: float, now: float) -> None:
        self.recs: list[Record] = []
        self.first_t = first_t  # the first held record's time
        self.since_now = now  # the stream clock when it was held
        self.others = False  # another source spoke in step since


Feed = Callable[[Record], Sequence[Record]]


class StreamGuard:
    """Holds, releases, re-bases or refuses records (see the module docstring).

    ``counts``: records refused by reason, ``held`` records ever held,
    ``released`` records released with their whole stream, ``resets`` sources
    re-based (clock jumps taken off one source).
    """

    def __init__(self, config: StreamConfig | None = None) -> None:
        self.config = config or StreamConfig()
        self.offsets: dict[Any, float] = {}  # source -> seconds taken off its times
        self._held: dict[Any, _Held] = {}  # insertion order = order of first hold
        self._order: list[tuple[Any, Record]] = []  # every held record, arrival order
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.held = 0
        self.released = 0
        self.resets = 0

    @property
    def active(self) -> bool:
        """True while any record is held or any source re-based (the slow path)."""
        return bool(self._held) or bool(self.offsets)

    def refuse(self, reason: str) -> None:
        self.counts[reason] += 1

    # ------------------------------------------------------------ the slow path

    def admit(self, rec: Record, now: float, horizon: float, feed: Feed) -> list[Record]:
        """Judge one record that failed the pipeline's fast check (or came while
        the guard is active); ``feed`` files what passes. Returns verdicts."""
        kind = rec.get("kind")
        field = TIME_FIELD.get(kind)  # type: ignore[arg-type]
        if field is None:
            return list(feed(rec))  # no stream time: nothing to judge
        if kind == "clock":
            # The daemon's own clock is trusted: far ahead, it says the jump
            # is real (release what is held, in order); in step, it says the
            # held records ran ahead of the time.
            if rec.get(field, 0) > horizon:
                out = self._release_all(feed)
            else:
                out = self._in_step(None, feed)
            out.extend(feed(rec))
            return out
        source = ("rank", rec.get("rank")) if kind in RANK_KINDS else ("host", rec.get("host"))
        off = self.offsets.get(source)
        t = rec.get(field)
        if off is not None and isinstance(t, (int, float)):
            if abs(t - now) <= self.config.ahead_s:
                del self.offsets[source]  # its clock came back in step
            else:
                rec = shifted(rec, off)
                t = t - off
        if not isinstance(t, (int, float)) or t <= horizon:
            out = self._in_step(source, feed)
            out.extend(feed(rec))
            return out
        return self._ahead(source, rec, t, now, feed)

    def _in_step(self, source: Any, feed: Feed) -> list[Record]:
        # A record in step with the stream: its own source's held records
        # were outliers; for the other held sources, the stream went on.
        mine = self._held.pop(source, None)
        if mine is not None:
            self.counts[CLOCK_AHEAD] += len(mine.recs)
            self._order = [(s, r) for s, r in self._order if s != source]
        for h in self._held.values():
            h.others = True
        return []

    def _ahead(self, source: Any, rec: Record, t: float, now: float, feed: Feed) -> list[Record]:
        cfg = self.config
        h = self._held.get(source)
        if h is None:
            if len(self._held) >= cfg.max_sources:
                self.counts[SOURCES_FULL] += 1
                return []
            # Another source already jumped to about the same time: the stream moved.
            if any(abs(o.first_t - t) <= cfg.ahead_s for o in self._held.values()):
                out = self._release_all(feed)
                out.extend(feed(rec))
                return out
            h = self._held[source] = _Held(t, now)
        h.recs.append(rec)
        self._order.append((source, rec))
        self.held += 1
        if len(h.recs) < cfg.confirm and not (h.others and now - h.since_now >= 2 * cfg.ahead_s):
            return []
        if not h.others:
            # Nobody else spoke while it ran ahead: the whole stream has a gap.
            return self._release_all(feed)
        return self._rebase(source, h, now, feed)

    def _rebase(self, source: Any, h: _Held, now: float, feed: Feed) -> list[Record]:
        del self._held[source]
        self._order = [(s, r) for s, r in self._order if s != source]
        off = h.first_t - h.since_now
        self.offsets[source] = self.offsets.get(source, 0.0) + off
        self.resets += 1
        out: list[Record] = []
        for rec in h.recs:
            out.extend(feed(shifted(rec, off)))
        return out

    def release(self, feed: Feed) -> list[Record]:
        """Feed every held record, in arrival order (the end of the input)."""
        return self._release_all(feed) if self._order else []

    def _release_all(self, feed: Feed) -> list[Record]:
        order = self._order
        self._order = []
        self._held.clear()
        self.released += len(order)
        out: list[Record] = []
        for _source, rec in order:
            out.extend(feed(rec))
        return out

    def step_limit(self, newest: int) -> float:
        """The largest step the pipeline accepts while the job's newest is ``newest``."""
        return newest + self.config.step_ahead if newest >= 0 else math.inf


def shifted(rec: Record, off: float) -> Record:
    """A copy of ``rec`` with ``off`` seconds taken off each of its times."""
    out = dict(rec)
    for name in TIME_FIELDS:
        v = out.get(name)
        if isinstance(v, (int, float)):
            out[name] = v - off
    return out
