"""A node's side of cluster mode: its own ranks' records in, one :class:`Window` per interval out (pure).

The node daemon hands every record of its ranks to :meth:`NodeWindows.feed`
(the same records its local pipeline gets). ``coll`` records stay here: at the
end of a step they become a :class:`~fsdp_sentinel.cluster.summary.StepDigest`.
A step is complete on the node when every local rank sent its ``step`` record
for it, or one of them is ``finalize_lag`` steps further on (a rank whose
record was lost holds nobody back), the pipeline's own rule. A step's
``step`` records are held back and go inside its digest, so the leader never
summarises a step before it has every node's collectives of it.

Probe ``netdev`` records are not forwarded: only the time of each host's
probe polls is (``Window.heard``: what silent-loss detection reads, and what
moves the leader's clock as the records moved the single daemon's), unless
a flow row of the window shows the poll already. Flow
records the probes wrote go as fixed-width rows (``flowrows``: at 16k ranks,
16k a probe interval); everything else the leader needs is small and
forwarded as is.
"""

from __future__ import annotations

from typing import Any

from fsdp_sentinel.cluster.flowrows import FlowRowsBuilder, plain
from fsdp_sentinel.cluster.summary import StepDigest, Window, digest_step, step_times

Record = dict[str, Any]

#: Record kinds forwarded to the leader as they are (small, few).
FORWARDED = frozenset({"rank", "flow", "conn", "pending"})


class NodeWindows:
    """Collects one node's records and cuts them into windows (see the module docstring)."""

    def __init__(self, node: str, finalize_lag: int = 2) -> None:
        self.node = node
        self.finalize_lag = finalize_lag
        self.seq = 0
        self.now = 0.0
        self._ranks: set[int] = set()
        self._colls: dict[int, dict[int, list[Record]]] = {}  # step -> rank -> colls
        self._steps: dict[int, dict[int, Record]] = {}  # step -> rank -> step record
        self._done = -(10**18)  # newest step digested
        self._out: list[Record] = []
        self._flows = FlowRowsBuilder()  # plain flow records, as rows
        self._digests: list[StepDigest] = []
        self._progress: dict[tuple[int, int], list[Any]] = {}  # (rank, step) -> [t, top seq]
        self._heard: dict[tuple[str, float], float] = {}  # (host, poll time) -> dt
        # (host, poll time) -> dt of the plain flow rows: polls they show
        self._row_polls: dict[tuple[str, float], float] = {}
        self.late = 0  # step/coll records for a step already digested (dropped)

    def _touch(self, rank: int, t: Any, step: int = -1, seq: Any = -1) -> None:
        # One progress point per rank and step a window: when its newest
        # record of that step arrived, and its newest seq.
        if type(t) not in (int, float):
            return
        p = self._progress.get((rank, step))
        if p is None:
            self._progress[(rank, step)] = [float(t), seq if type(seq) is int else -1]
            return
        if t > p[0]:
            p[0] = float(t)
        if type(seq) is int and seq > p[1]:
            p[1] = seq

    def _open_step(self, rec: Record) -> tuple[int, int] | None:
        """A ``coll`` or ``step`` record's (step, rank), or None: ill-typed, or
        of a step already windowed (counted as late)."""
        step, rank = rec.get("step"), rec.get("rank")
        if type(step) is not int or type(rank) is not int:
            return None
        if step <= self._done:
            self.late += 1
            return None
        return step, rank

    def feed(self, rec: Record) -> None:
        """File one record of this node's ranks or probes."""
        kind = rec.get("kind")
        t: Any = rec.get("t", rec.get("end"))
        if type(t) in (int, float) and t > self.now:
            self.now = float(t)
        if kind == "coll":
            key = self._open_step(rec)
            if key is None:
                return
            step, rank = key
            self._colls.setdefault(step, {}).setdefault(rank, []).append(rec)
            self._touch(rank, rec.get("end"), step, rec.get("seq"))
        elif kind == "step":
            key = self._open_step(rec)
            if key is None:
                return
            step, rank = key
            self._steps.setdefault(step, {})[rank] = rec
            self._ranks.add(rank)
            self._finalize(step)
        elif kind in ("netdev", "flow"):
            host = rec.get("host")
            dt: Any = rec.get("dt")
            # One entry per host and poll (a poll's records share its time):
            # the leader's clock then moves as the single daemon's would.
            poll = None
            if isinstance(host, str) and type(t) in (int, float) and type(dt) in (int, float):
                poll = (host, float(t))
                self._heard[poll] = float(dt)
            if kind == "flow":
                if plain(rec):
                    self._flows.add(rec)
                    if poll is not None:
                        self._row_polls[poll] = float(dt)
                else:
                    self._out.append(rec)
        elif kind in FORWARDED:
            if kind == "rank" and type(rec.get("rank")) is int:
                self._ranks.add(rec["rank"])
                self._touch(rec["rank"], t)
            self._out.append(rec)

    def _finalize(self, step: int) -> None:
        ready = len(self._steps.get(step, ())) >= len(self._ranks)
        last = step if ready else step - self.finalize_lag
        for s in sorted(set(self._steps) | set(self._colls)):
            if s > last:
                break
            # The step records go inside the digest (as its start/end columns).
            self._digests.append(digest_step(s, self._colls.pop(s, {}), self._steps.pop(s, {})))
            self._done = s

    def window(self, now: float | None = None) -> Window:
        """Everything filed since the last window, as the next one (even when empty:
        a window is also the node's heartbeat)."""
        if now is not None and now > self.now:
            self.now = now
        # A step whose step record goes in this window needs no progress point
        # (the record's end is later than its collectives; the digest has its seq).
        sent = {(r, d.step) for d in self._digests for r, _s, _e in step_times(d)}
        progress = tuple(
            (r, p[0], s, p[1]) for (r, s), p in sorted(self._progress.items()) if (r, s) not in sent
        )
        # One poll time per host and probe interval (a poll's records may
        # differ by a little in time: the first of them stands for it), and
        # none that a flow row of the window shows as well (same host, time
        # and interval): the leader notes each row's host as heard, as the
        # single daemon notes each flow record's. At 16k ranks that is 2,048
        # entries a round fewer on the leader's time line.
        heard: list[tuple[str, float, float]] = []
        first: tuple[str, float] | None = None  # the poll's first record
        rows = self._row_polls
        for (h, t), dt in sorted(self._heard.items()):
            if first is not None and first[0] == h and t - first[1] < dt / 2:
                continue
            first = (h, t)
            if rows.get(first) != dt:
                heard.append((h, t, dt))
        w = Window(
            self.node,
            self.seq,
            self.now,
            tuple(self._out),
            tuple(self._digests),
            progress,
            tuple(heard),
            self._flows.take(),
        )
        self.seq += 1
        self._out = []
        self._digests = []
        self._heard = {}
        self._row_polls = {}
        self._progress = {}
        return w
