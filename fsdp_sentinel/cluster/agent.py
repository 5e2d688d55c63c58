"""One node daemon's part in cluster mode: publish its windows, elect, lead, hear verdicts.

The daemon hands :meth:`ClusterAgent.feed` every record of its node (the
records its own pipeline gets) and calls :meth:`ClusterAgent.step` once an
interval, off its record thread (:class:`AgentThread`): store calls may
wait up to the store's timeout, and the record thread never should.

Each step: cut a window, publish it (it is also the heartbeat), read the
roster and every node's heartbeat, and work out who leads
(:func:`~fsdp_sentinel.cluster.leader.leader_of`: rank 0's node, else the
next by lowest rank whose heartbeat still moves). The leader takes every
node's new windows, runs :class:`~fsdp_sentinel.cluster.leader.LeaderDetector`
and publishes its verdicts; every node (the leader too) reads them back, so
each daemon logs, exports and can remediate them locally.

A leader that takes over starts a fresh detector seeded with every node's
``rank`` records (``ranks/<node>``); it judges again once it has its own
baseline (``detect.baseline``), so it can be late but is not wrong. While the
store cannot be reached the node says so (``view == "node"``) and
:meth:`ClusterAgent.local` passes its own pipeline's verdicts through, each
marked ``evidence.view = "node"``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from fsdp_sentinel.cluster.flowrows import joined_rows
from fsdp_sentinel.cluster.leader import (
    LeaderDetector,
    Liveness,
    collector_held,
    decode_round,
    leader_of,
    seed_windows,
)
from fsdp_sentinel.cluster.node import NodeWindows
from fsdp_sentinel.cluster.store import ClusterStore, KVStore, StoreUnreachable, tcp_store
from fsdp_sentinel.cluster.summary import Window, encode
from fsdp_sentinel.detect import DetectConfig
from fsdp_sentinel.snapshot import ClusterView

Record = dict[str, Any]

log = logging.getLogger("fsdp_sentinel.cluster")


class ClusterAgent:
    """See the module docstring. ``connect(address)`` makes the store client
    (the job's TCPStore by default); ``address`` and ``job`` come from the
    ranks' ``rank`` records unless given."""

    def __init__(
        self,
        node: str,
        *,
        config: DetectConfig | None = None,
        miss: int = 2,
        connect: Callable[[str], KVStore] = tcp_store,
        address: str | None = None,
        job: str | None = None,
        retry_s: float = 5.0,
        hold_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.config = config
        self.connect = connect
        self.address = address
        self.job = job
        self.retry_s = retry_s
        # While the store is away a node keeps filing (its next window holds
        # it all, so the leader misses nothing of a short outage), up to
        # ``hold_s``; after that it cuts and drops windows (bounded memory).
        self.hold_s = hold_s
        self._away_since: float | None = None
        self._unsent: Window | None = None  # cut, but its publish failed
        self.clock = clock
        self.windows = NodeWindows(node)
        self.liveness = Liveness(miss)
        self.wait = 2 * miss  # windows to wait for rank 0's node to join
        self.view = "node"  # "cluster" once the store answers
        self.leader: str | None = None
        self.detector: LeaderDetector | None = None
        self.store: ClusterStore | None = None
        self._lock = threading.Lock()
        self._ranks: dict[int, Record] = {}
        self._ranks_sent = 0  # rank records published so far
        self._joined = False
        self._vseq = 0
        self._retry_at = -float("inf")
        self.stats: dict[str, Any] = {
            "windows": 0,
            "leader_windows": 0,
            "takeovers": 0,
            "store_errors": 0,
            "verdicts_heard": 0,
            "windows_dropped": 0,
            "windows_malformed": 0,  # taken from the store, not a window (left out alone)
        }  # and "failover_windows" once the leader changed away from a dark node

    # ------------------------------------------------------------ record thread

    def feed(self, rec: Record) -> None:
        """File one record of this node (cheap; called on the daemon's record thread)."""
        if rec.get("kind") == "rank" and type(rec.get("rank")) is int:
            with self._lock:
                self._ranks[rec["rank"]] = rec
                if self.address is None and isinstance(rec.get("store"), str):
                    self.address = rec["store"]
                if self.job is None and isinstance(rec.get("job"), str):
                    self.job = rec["job"]
        with self._lock:
            self.windows.feed(rec)

    def local(self, verdicts: Sequence[Record]) -> list[Record]:
        """The node pipeline's own verdicts to act on: all of them (marked
        ``view: node``) while the store is away, none while the leader speaks."""
        if self.view != "node":
            return []
        for v in verdicts:
            ev = v.get("evidence")
            if not isinstance(ev, dict):
                ev = v["evidence"] = {}
            ev["view"] = "node"
        return list(verdicts)

    # ------------------------------------------------------------ agent thread

    def step(self, now: float | None = None) -> list[Record]:
        """One interval: publish, elect, lead when elected; the leader's new verdicts."""
        store = self._store_now()
        with self._lock:
            ranks = [self._ranks[r] for r in sorted(self._ranks)]
            if not ranks:  # no job on this node yet: nothing to keep (probe polls only)
                self.windows.window(now)
                return []
            if store is None:
                away = self._away_since
                if away is None:
                    away = self._away_since = self.clock()
                if self.clock() - away > self.hold_s:
                    self.windows.window(now)  # the store has been away too long: drop it
                    self.stats["windows_dropped"] += 1
                return []
            window = self.windows.window(now)
            if self._unsent is not None:  # cut before the store failed: it goes with this one
                window = _joined(self._unsent, window)
                self._unsent = None
        try:
            if not self._joined:
                beats = store.heartbeats([self.node])
                if self.node in beats:  # a restarted daemon carries on its numbering
                    with self._lock:
                        self.windows.seq = beats[self.node] + 2
                    window = window._replace(seq=beats[self.node] + 1)
                store.join(self.node, min(r["rank"] for r in ranks), ranks)
                self._joined, self._ranks_sent = True, len(ranks)
            elif len(ranks) != self._ranks_sent:
                store.set_ranks(self.node, ranks)
                self._ranks_sent = len(ranks)
            try:
                store.publish(self.node, window.seq, encode(window))
            except StoreUnreachable:
                self._unsent = window
                raise
            self.stats["windows"] += 1
            roster = store.roster()
            beats = store.heartbeats([n for _, n in roster])
            dark = self.liveness.observe(beats)
            before, self.leader = self.leader, leader_of(roster, dark)
            if self.leader is not None and roster[0][0] != 0 and self.liveness.tick < self.wait:
                # Rank 0's node has not joined yet (daemons start in any order):
                # wait for it a while rather than hand the lead over at once.
                self.leader = None
            if before is not None and self.leader not in (None, before) and before in dark:
                # How long the job went without a leader, as this node counts.
                self.stats["failover_windows"] = self.liveness.windows_since(before)
                log.info("cluster: %s follows %s (%s went dark)", self.node, self.leader, before)
            if self.leader == self.node:
                verdicts = self._lead(store, roster, beats, dark)
                if verdicts:
                    store.publish_verdicts(verdicts)
            else:
                self.detector = None  # a later turn starts afresh
            live = max(1, len(roster) - len(dark & {n for _, n in roster}))
            self._vseq, heard = store.read_verdicts(self._vseq, live)
            self.stats["verdicts_heard"] += len(heard)
            if self.view != "cluster":
                log.info("cluster: %s meets the other nodes in %s (job %r)", self.node,
                         self.address, self.job)  # fmt: skip
            self.view = "cluster"
            self._away_since = None
            return heard
        except StoreUnreachable as e:
            self._lost_store(e)
            return []

    def _store_now(self) -> ClusterStore | None:
        if self.store is not None:
            return self.store
        if self.address is None or self.clock() < self._retry_at:
            return None
        try:
            self.store = ClusterStore(self.connect(self.address), self.job or "")
        except StoreUnreachable as e:
            self._lost_store(e)
        return self.store

    def _lost_store(self, why: object = "") -> None:
        if self.view == "cluster" or self.stats["store_errors"] == 0:
            log.warning("cluster: %s cannot reach the store (%s); detecting within the node, "
                        "trying again in %g s", self.node, (str(why).splitlines() or [""])[0][:200],
                        self.retry_s)  # fmt: skip
        self.stats["store_errors"] += 1
        if self._away_since is None:
            self._away_since = self.clock()
        self.view = "node"
        self.store = None
        self.detector = None
        self._joined = False
        self._retry_at = self.clock() + self.retry_s

    def _lead(
        self,
        store: ClusterStore,
        roster: list[tuple[int, str]],
        beats: dict[str, int],
        dark: frozenset[str],
    ) -> list[Record]:
        # Read from the store first, then decoded and judged with the cyclic
        # collector held off for the whole round (collector_held).
        blobs = [b for _, n in roster if n in beats for b in store.take_windows(n, beats[n])]
        with collector_held():
            out = self._judge_round(store, roster, blobs, dark)
        return out

    def _judge_round(
        self,
        store: ClusterStore,
        roster: list[tuple[int, str]],
        blobs: list[bytes],
        dark: frozenset[str],
    ) -> list[Record]:
        # The round's windows live only in this frame: freed when it returns,
        # before the collector is back on, so its first young pass walks only
        # what the round kept (at 16k ranks the windows alone are thousands
        # of containers, walked for nothing).
        rnd = decode_round(blobs)
        self.stats["windows_malformed"] += rnd.bad
        self.stats["leader_windows"] += len(rnd.windows)
        det = self.detector
        if det is None:
            det = self.detector = LeaderDetector(self.config)
            self.stats["takeovers"] += 1
            log.info("cluster: %s leads job %r (nodes dark: %s)", self.node, self.job,
                     ", ".join(sorted(dark)) or "none")  # fmt: skip
            store.set_leader(self.node)
            # A successor learns every rank from the nodes' rank records and
            # presumes each alive as it takes over (had one been lost, the
            # previous leader would have said so): silence is counted from now.
            now = max((w.t for w in rnd.windows), default=0.0)
            det.ingest(seed_windows({n: store.rank_records(n) for _, n in roster}, now))
        det.set_dark(dark)
        return det.ingest(rnd)

    def cluster_view(self) -> ClusterView:
        """This node's part, for the snapshot (and the ``cluster_*`` metrics)."""
        return ClusterView(
            job=self.job or "",
            node=self.node,
            view=self.view,
            leader=self.leader,
            leading=self.leader == self.node and self.view == "cluster",
            takeovers=self.stats["takeovers"],
            windows=self.stats["windows"],
            failover_windows=self.stats.get("failover_windows"),
        )

    @property
    def bytes_sent(self) -> int:
        return self.store.sent if self.store is not None else 0


def _joined(a: Window, b: Window) -> Window:
    """Two windows of one node as one (the later's seq and time)."""
    return b._replace(
        records=a.records + b.records,
        digests=a.digests + b.digests,
        progress=a.progress + b.progress,
        heard=a.heard + b.heard,
        flows=joined_rows(a.flows, b.flows),
    )


class AgentThread:
    """Runs :meth:`ClusterAgent.step` every ``interval_s`` on its own thread; the
    daemon collects the verdicts heard with :meth:`drain`."""

    def __init__(self, agent: ClusterAgent, interval_s: float = 0.5) -> None:
        self.agent = agent
        self.interval_s = interval_s
        self._out: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fss-cluster", daemon=True)

    def start(self) -> AgentThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                got = self.agent.step(time.time())
            except Exception:  # never take the daemon down; count and go on
                self.agent.stats["store_errors"] += 1
                continue
            if got:
                with self._lock:
                    self._out.extend(got)

    def drain(self) -> list[Record]:
        with self._lock:
            out, self._out = self._out, []
        return out

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop and join: a store call in flight (a connect retried up to its
        timeout twice) must end before the interpreter does, or torch aborts it."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)


class ClusterPipeline:
    """The daemon's pipeline in cluster mode (``fsdp-sentinel run --cluster``).

    Wraps the node's own :class:`~fsdp_sentinel.pipeline.Pipeline` (what the
    daemon already runs over its node's records): every record also goes to
    the agent; the verdicts handed back are the leader's, as they arrive
    (each record the daemon handles, its own clock record every interval at
    least, collects them), or, while the store is away, the node pipeline's
    own, marked ``view: node``. The snapshot is the node's own.
    """

    def __init__(self, pipeline: Any, agent: ClusterAgent, interval_s: float = 0.5) -> None:
        self.pipeline = pipeline
        self.agent = agent
        self.thread = AgentThread(agent, interval_s)

    def start(self) -> ClusterPipeline:
        self.thread.start()
        return self

    def feed(self, rec: Record) -> Sequence[Record]:
        self.agent.feed(rec)
        out = self.agent.local(self.pipeline.feed(rec))
        heard = self.thread.drain()
        return out + heard if heard else out

    def snapshot(self) -> Any:
        return dataclasses.replace(self.pipeline.snapshot(), cluster=(self.agent.cluster_view(),))

    def close(self) -> None:
        self.thread.stop()
