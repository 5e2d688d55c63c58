"""Correlate trace-v1 records into the summaries the detector reads.

The :class:`Correlator` keeps just enough state to answer three questions:

* who is who: pid -> rank from ``rank`` records, flow -> (rank, peer rank) from
  the flow's pid, the ranks' ``addrs``, and the local endpoints seen in other
  flows and in ``conn`` records (on one machine every rank shares one address,
  so the endpoint ``ip:port`` is what tells the peer);
* per step and rank (:class:`RankStep`): step time, time blocked in
  collectives, compute time, and how late the rank arrived at each collective
  compared with its group. Lateness is computed from *wait durations*
  (``end - issue``, both read on one host), so clock offsets between hosts
  cancel: the last rank to arrive waits least, and its lateness at one
  collective is ``max wait in the group - its own wait``;
* per pair of ranks (:class:`PairFlow`), over the latest ``flow_window_s``
  seconds of ``flow`` records: bytes, byte-weighted srtt and retransmits; and
  per rank (:class:`RankLiveness`) when it was last heard from and whether its
  connections were torn down.

Heavy work happens once per completed step (:meth:`Correlator.step_summary`);
the per-record methods only file records away, so a busy stream stays cheap.
This module does no I/O and keeps no clock: the caller says what time it is.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import reduce
from operator import add, itemgetter, le, sub
from typing import Any

Record = dict[str, Any]

_SEQ = itemgetter("seq")
_ISSUE_END = itemgetter("issue", "end")
_OP = itemgetter("op")


@dataclass(frozen=True)
class RankStep:
    """One rank in one step.

    ``step_s`` is ``end - start`` of its step record (None when that record was
    lost); ``wait_s`` the union of its collective intervals (time blocked);
    ``compute_s`` = ``step_s - wait_s``; ``late_s`` the sum, over the step's
    collectives that at least one other rank also reported, of ``max wait of
    the group - own wait``; ``last_frac`` the share of those collectives where
    this rank waited least (it arrived last); ``matched`` how many there were.
    """

    rank: int
    step_s: float | None
    wait_s: float
    compute_s: float | None
    late_s: float
    last_frac: float
    matched: int
    n_coll: int


@dataclass(frozen=True)
class PairFlow:
    """Traffic ``rank`` -> ``peer`` as ``rank``'s sockets saw it over ``dt`` seconds.

    ``srtt_us`` is weighted by bytes sent (None when no flow reported one).
    """

    rank: int
    peer: int
    tx_bytes: int
    rx_bytes: int
    dt: float
    srtt_us: float | None
    retrans: int


@dataclass(frozen=True)
class RankLiveness:
    """When a rank was last heard from and what happened to its connections.

    ``last_t``: time of its latest hook record (step/coll/rank) on its own
    clock; ``done_step``: its latest completed step (-1 before the first);
    ``torn_peers``: peers whose connection to it closed or reset (``torn_t`` the
    first such time); ``peers``: peers it was ever seen talking to.
    """

    rank: int
    host: str
    last_t: float
    done_step: int
    torn_peers: int
    peers: int
    torn_t: float | None
    self_closed: bool


@dataclass(frozen=True)
class Summary:
    """What the detector sees at time ``t``.

    ``step`` is the job step these ``ranks`` summarise, or None for a clock
    tick (then ``ranks`` is empty and only liveness is judged). ``job_done``
    is the newest step any rank completed; ``mid_step`` says some rank has
    reported collectives of a step past ``job_done`` (the job is inside a step,
    not between steps or finished).
    """

    t: float
    step: int | None
    ranks: tuple[RankStep, ...]
    flows: tuple[PairFlow, ...]
    liveness: tuple[RankLiveness, ...]
    job_done: int
    mid_step: bool


class _Rank:
    """Everything the correlator keeps about one rank (bounded)."""

    __slots__ = (
        "rank",
        "host",
        "pid",
        "addrs",
        "steps",
        "colls",
        "last_t",
        "first_step",
        "done_step",
        "max_coll_step",
        "lost",
        "last",
        "steps_total",
        "step_seconds_total",
        "coll_count",
        "coll_bytes",
        "coll_seconds",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.host = ""
        self.pid: int | None = None
        self.addrs: tuple[str, ...] = ()
        self.steps: dict[int, Record] = {}
        self.colls: dict[int, list[Record]] = {}
        self.last_t = 0.0
        self.first_step: int | None = None
        self.done_step = -1
        self.max_coll_step = -1
        self.lost = False
        self.last: RankStep | None = None
        self.steps_total = 0
        self.step_seconds_total = 0.0
        self.coll_count: dict[str, int] = {}
        self.coll_bytes: dict[str, int] = {}
        self.coll_seconds: dict[str, float] = {}


class _Pair:
    """A directed pair's flow samples over the window, and its totals."""

    __slots__ = (
        "samples",
        "tx_total",
        "rx_total",
        "retrans_total",
        "srtt_us",
        "tx_rate",
        "rx_rate",
        "view",
    )

    def __init__(self) -> None:
        # (t, dt, tx, rx, srtt_us or None, retrans)
        self.samples: deque[tuple[float, float, int, int, float | None, int]] = deque()
        self.tx_total = 0
        self.rx_total = 0
        self.retrans_total = 0
        self.srtt_us: float | None = None
        self.tx_rate: float | None = None
        self.rx_rate: float | None = None
        # flow_matrix's figures for these samples; None once they change.
        self.view: PairFlow | None = None


def _ip(endpoint: str) -> str:
    """The address part of ``ip:port`` (``[v6]:port`` too)."""
    host, _, _port = endpoint.rpartition(":")
    return host.strip("[]") if host else endpoint


def _merged_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals`` (collectives may overlap)."""
    intervals.sort()
    total = 0.0
    cur_a, cur_b = intervals[0]
    for a, b in intervals[1:]:
        if a > cur_b:
            total += cur_b - cur_a
            cur_a, cur_b = a, b
        elif b > cur_b:
            cur_b = b
    return total + (cur_b - cur_a)


class Correlator:
    """Files records by rank and step; builds :class:`Summary` objects on demand.

    ``flow_window_s`` is how far back flow samples count for the pair figures.
    """

    def __init__(self, flow_window_s: float = 3.0) -> None:
        self.flow_window_s = flow_window_s
        self.ranks: dict[int, _Rank] = {}
        self.world_size: int | None = None
        self.pairs: dict[tuple[int, int], _Pair] = {}
        self._pid_rank: dict[tuple[str, int], int] = {}
        self._pid_only: dict[int, int | None] = {}  # pid -> rank, None when ambiguous
        self._addr_rank: dict[str, int | None] = {}  # ip -> rank, None when shared
        self._endpoint_rank: dict[str, int] = {}  # "ip:port" local end -> rank
        self._flow_cache: dict[tuple[str, int, str, str], tuple[int, int]] = {}
        self._torn: dict[int, dict[int, float]] = {}  # rank -> peer -> first torn time
        self._self_closed: dict[int, float] = {}
        self._peers: dict[int, set[int]] = {}
        self._pair_keys: list[tuple[int, int]] | None = None  # sorted(self.pairs), cached
        self.job_done = -1
        self.late_records = 0
        self.unattributed_flows = 0

    # ------------------------------------------------------------ per record

    def rank_of(self, rank: int) -> _Rank:
        rs = self.ranks.get(rank)
        if rs is None:
            rs = self.ranks[rank] = _Rank(rank)
        return rs

    def add_rank(self, rec: Record) -> _Rank:
        rank = int(rec["rank"])
        rs = self.rank_of(rank)
        rs.host = str(rec["host"])
        rs.pid = int(rec["pid"])
        rs.addrs = tuple(str(a) for a in rec["addrs"])
        t = float(rec["t"])
        if t > rs.last_t:
            rs.last_t = t
        self.world_size = int(rec["world_size"])
        self._pid_rank[(rs.host, rs.pid)] = rank
        prev = self._pid_only.get(rs.pid, rank)
        self._pid_only[rs.pid] = rank if prev == rank else None
        for a in rs.addrs:
            prev = self._addr_rank.get(a, rank)
            self._addr_rank[a] = rank if prev == rank else None
        self._flow_cache.clear()  # attributions may change
        return rs

    def add_step(self, rec: Record) -> tuple[_Rank, int]:
        rs = self.rank_of(int(rec["rank"]))
        step = int(rec["step"])
        end = float(rec["end"])
        float(rec["start"])  # validate now, not at summary time
        rs.steps[step] = rec
        if end > rs.last_t:
            rs.last_t = end
        if rs.first_step is None or step < rs.first_step:
            rs.first_step = step
        if step > rs.done_step:
            rs.done_step = step
        if step > self.job_done:
            self.job_done = step
        return rs, step

    def add_coll(self, rec: Record) -> Any:
        """File a ``coll`` record; return its ``end`` (checked to be a number)."""
        # The hot path: file the record itself (no copy); check the fields the
        # summary will use, so a bad record fails here and not a whole step.
        rank = rec["rank"]
        rs = self.ranks.get(rank)
        if rs is None:
            rs = self.rank_of(int(rank))
        step = rec["step"]
        end = rec["end"]
        end - rec["issue"]  # noqa: B018 - both numbers, or TypeError now
        rec["seq"]  # noqa: B018
        lst = rs.colls.get(step)
        if lst is None:
            step = int(step)
            lst = rs.colls[step] = []
            if step > rs.max_coll_step:
                rs.max_coll_step = step
            if rs.first_step is None or step < rs.first_step:
                rs.first_step = step
        lst.append(rec)
        if end > rs.last_t:
            rs.last_t = end
        return end

    def _local_rank(self, host: str, pid: int) -> int | None:
        r = self._pid_rank.get((host, pid))
        if r is None:
            r = self._pid_only.get(pid)
        return r

    def _remote_rank(self, dst: str) -> int | None:
        r = self._endpoint_rank.get(dst)
        if r is None:
            r = self._addr_rank.get(_ip(dst))
        return r

    def _attribute(self, rec: Record) -> tuple[int, int] | None:
        host = rec["host"]
        pid = rec["pid"]
        src = rec["src"]
        dst = rec["dst"]
        key = (host, pid, src, dst)
        hit = self._flow_cache.get(key)
        if hit is not None:
            return hit
        rank = rec.get("rank")
        if rank is None:
            rank = self._local_rank(host, pid)
        if rank is None:
            return None
        self._endpoint_rank[src] = rank
        peer = rec.get("peer_rank")
        if peer is None:
            peer = self._remote_rank(dst)
        if peer is None or peer == rank:
            return None
        hit = (int(rank), int(peer))
        self._flow_cache[key] = hit
        self._peers.setdefault(hit[0], set()).add(hit[1])
        self._peers.setdefault(hit[1], set()).add(hit[0])
        return hit

    def add_flow(self, rec: Record) -> None:
        hit = self._attribute(rec)
        if hit is None:
            self.unattributed_flows += 1
            return
        pair = self.pairs.get(hit)
        if pair is None:
            pair = self.pairs[hit] = _Pair()
            self._pair_keys = None
        tx = int(rec["tx_bytes"])
        rx = int(rec["rx_bytes"])
        dt = float(rec["dt"])
        srtt = rec.get("srtt_us")
        retrans = int(rec.get("retrans") or 0)
        t = float(rec["t"])
        samples = pair.samples
        samples.append((t, dt, tx, rx, srtt, retrans))
        pair.view = None
        # Keep memory flat when no step ever completes (probes, no trainer).
        while samples[0][0] < t - 2 * self.flow_window_s:
            samples.popleft()
        pair.tx_total += tx
        pair.rx_total += rx
        pair.retrans_total += retrans
        if srtt is not None:
            pair.srtt_us = float(srtt)
        if dt > 0:
            pair.tx_rate = tx / dt
            pair.rx_rate = rx / dt

    def add_conn(self, rec: Record) -> None:
        host = rec["host"]
        pid = rec["pid"]
        src = rec["src"]
        dst = rec["dst"]
        what = rec["what"]
        local = self._local_rank(host, pid) if pid is not None else None
        if local is None:
            local = self._endpoint_rank.get(src)
        elif what == "open":
            self._endpoint_rank[src] = local
        remote = self._remote_rank(dst)
        if what not in ("close", "reset"):
            if local is not None and remote is not None and local != remote:
                self._peers.setdefault(local, set()).add(remote)
                self._peers.setdefault(remote, set()).add(local)
            return
        t = float(rec["t"])
        if local is not None and what == "close" and local not in self._self_closed:
            self._self_closed[local] = t
        for a, b in ((local, remote), (remote, local)):
            if a is None or b is None or a == b:
                continue
            torn = self._torn.setdefault(a, {})
            if b not in torn:
                torn[b] = t
            self._peers.setdefault(a, set()).add(b)

    def revive(self, rank: int) -> None:
        """Forget torn connections of a rank that is heard from again."""
        self._torn.pop(rank, None)
        self._self_closed.pop(rank, None)
        for torn in self._torn.values():
            torn.pop(rank, None)

    # ------------------------------------------------------------ per step

    def expected(self, step: int, lag: int = 2) -> int:
        """How many ranks should report ``step``: live ones that had started by
        then and have not fallen more than ``lag`` steps silent (a stray
        emitter, or a rank about to be declared lost, holds nobody back)."""
        n = 0
        for rs in self.ranks.values():
            if rs.lost or rs.first_step is None or rs.first_step > step:
                continue
            if max(rs.done_step, rs.max_coll_step) >= step - lag:
                n += 1
        return n

    def reported(self, step: int) -> int:
        """How many ranks have a step record for ``step`` filed."""
        return sum(1 for rs in self.ranks.values() if step in rs.steps)

    def step_summary(self, step: int, now: float) -> Summary:
        """Summarise ``step`` across ranks and forget its records."""
        # Pass 1 files each collective's wait under its group key (``seq``, or
        # ``(group, seq)`` when records name their group: the same on every
        # member); pass 2 turns the group's longest and shortest wait into
        # each member's lateness. Column lists keep the per-record work small.
        per_rank: list[
            tuple[_Rank, Record | None, list[Record], list[Any], list[float], list[Any]]
        ] = []
        ranks = self.ranks
        for rank in sorted(ranks):
            rs = ranks[rank]
            srec = rs.steps.pop(step, None)
            colls = rs.colls.pop(step, None) or []
            if srec is None and not colls:
                continue
            if colls and "group" in colls[0]:  # a rank's records all name a group, or none
                keys: list[Any] = [(str(c.get("group")), c["seq"]) for c in colls]
            else:
                keys = list(map(_SEQ, colls))
            if len(set(keys)) != len(keys):  # a datagram delivered twice counts once
                first: dict[Any, Record] = {}
                for key, c in zip(keys, colls, strict=True):
                    first.setdefault(key, c)
                keys, colls = list(first), list(first.values())
            spans = list(map(_ISSUE_END, colls))
            waits = [e - i for i, e in spans]
            per_rank.append((rs, srec, colls, keys, waits, spans))
        # The group's longest and shortest wait at each key. Usually every rank
        # reported the same collectives in the same order: then the groups are
        # the columns, no dict needed; otherwise file each wait under its key.
        with_colls = [p for p in per_rank if p[3]]
        keys0 = with_colls[0][3] if with_colls else None
        columns: tuple[list[float], list[float]] | None = None
        span: dict[Any, tuple[float, float]] = {}
        if len(with_colls) >= 2 and all(p[3] == keys0 for p in with_colls):
            cols = list(zip(*[p[4] for p in with_colls], strict=True))
            columns = (list(map(max, cols)), list(map(min, cols)))
        else:
            waits_of: dict[Any, list[float]] = {}
            for p in with_colls:
                for key, w in zip(p[3], p[4], strict=True):
                    lst = waits_of.get(key)
                    if lst is None:
                        waits_of[key] = [w]
                    else:
                        lst.append(w)
            span = {k: (max(v), min(v)) for k, v in waits_of.items() if len(v) >= 2}
        out: list[RankStep] = []
        for rs, srec, colls, keys, waits, spans in per_rank:
            late = 0.0
            matched = last = 0
            if columns is not None:
                if keys:
                    # Left to right from 0.0, as the loop below adds: same float.
                    late = reduce(add, map(sub, columns[0], waits), 0.0)
                    last = sum(map(le, waits, columns[1]))
                    matched = len(keys)
            else:
                for key, w in zip(keys, waits, strict=True):
                    hit = span.get(key)
                    if hit is not None:
                        late += hit[0] - w
                        matched += 1
                        if w <= hit[1]:
                            last += 1
            wait = _merged_length(spans) if spans else 0.0
            step_s: float | None = None
            compute: float | None = None
            if srec is not None:
                step_s = srec["end"] - srec["start"]
                compute = max(0.0, step_s - wait)
                rs.steps_total += 1
                rs.step_seconds_total += step_s
            cnt, nbytes, secs = rs.coll_count, rs.coll_bytes, rs.coll_seconds
            for op, c, w in zip(map(_OP, colls), colls, waits, strict=True):
                if op in cnt:
                    cnt[op] += 1
                    nbytes[op] += c["bytes"]
                    secs[op] += w
                else:
                    op = str(op)
                    cnt[op] = 1
                    nbytes[op] = int(c["bytes"])
                    secs[op] = w
            rstep = RankStep(
                rank=rs.rank,
                step_s=step_s,
                wait_s=wait,
                compute_s=compute,
                late_s=late,
                last_frac=(last / matched) if matched else 0.0,
                matched=matched,
                n_coll=len(colls),
            )
            rs.last = rstep
            out.append(rstep)
        # Anything older than this step that is still filed arrived too late.
        for rs in self.ranks.values():
            if rs.steps and min(rs.steps) < step:
                for old in [s for s in rs.steps if s < step]:
                    del rs.steps[old]
                    self.late_records += 1
            if rs.colls and min(rs.colls) < step:
                for old in [s for s in rs.colls if s < step]:
                    self.late_records += len(rs.colls.pop(old))
        return self._summary(now, step, tuple(out))

    def tick_summary(self, now: float) -> Summary:
        return self._summary(now, None, ())

    # ------------------------------------------------------------ views

    def _summary(self, now: float, step: int | None, ranks: tuple[RankStep, ...]) -> Summary:
        return Summary(
            t=now,
            step=step,
            ranks=ranks,
            flows=self.flow_matrix(now) if step is not None else (),
            liveness=self.liveness(),
            job_done=self.job_done,
            mid_step=any(rs.max_coll_step > self.job_done for rs in self.ranks.values()),
        )

    def flow_matrix(self, now: float) -> tuple[PairFlow, ...]:
        """Each directed pair's figures over the latest ``flow_window_s`` seconds."""
        horizon = now - self.flow_window_s
        out: list[PairFlow] = []
        keys = self._pair_keys
        if keys is None or len(keys) != len(self.pairs):
            keys = self._pair_keys = sorted(self.pairs)
        pairs = self.pairs
        for key in keys:
            pair = pairs[key]
            samples = pair.samples
            while samples and samples[0][0] < horizon:
                samples.popleft()
                pair.view = None
            if not samples:
                continue
            # Pairs report about once a second, steps come faster: the same
            # samples give the same figures, so reuse them until they change.
            view = pair.view
            if view is not None:
                out.append(view)
                continue
            tx = rx = retrans = 0
            dt = 0.0
            wsum = 0.0
            wbytes = 0
            for _t, sdt, stx, srx, srtt, sre in samples:
                tx += stx
                rx += srx
                dt += sdt
                retrans += sre
                if srtt is not None:
                    w = stx if stx > 0 else 1
                    wsum += srtt * w
                    wbytes += w
            view = pair.view = PairFlow(
                rank=key[0],
                peer=key[1],
                tx_bytes=tx,
                rx_bytes=rx,
                dt=dt,
                srtt_us=(wsum / wbytes) if wbytes else None,
                retrans=retrans,
            )
            out.append(view)
        return tuple(out)

    def liveness(self) -> tuple[RankLiveness, ...]:
        out = []
        for rank in sorted(self.ranks):
            rs = self.ranks[rank]
            torn = self._torn.get(rank, {})
            out.append(
                RankLiveness(
                    rank=rank,
                    host=rs.host,
                    last_t=rs.last_t,
                    done_step=rs.done_step,
                    torn_peers=len(torn),
                    peers=len(self._peers.get(rank, ())),
                    torn_t=min(torn.values()) if torn else None,
                    self_closed=rank in self._self_closed,
                )
            )
        return tuple(out)

    def pending_steps(self) -> list[int]:
        steps: set[int] = set()
        for rs in self.ranks.values():
            steps.update(rs.steps)
            steps.update(rs.colls)
        return sorted(steps)
