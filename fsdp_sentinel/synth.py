"""Synthetic traces, for scale and unit tests ONLY (never a stand-in for a capture).

A small simulator of a synchronous FSDP job: every step each rank computes in
``n_coll + 1`` segments separated by collectives; a collective completes when
its last member has issued it plus a transfer time; each rank records its own
``issue``/``end`` on its own (offset) clock. Probe-style ``flow`` records (a
ring of data flows over a full mesh of connections), ``netdev`` records every
``interval`` seconds, and ``conn`` records (open at start; close/reset when a
rank dies) come with it. Faults shape the timing and the flows the way the
machine notes describe real ones: a slow host raises the srtt of flows sent by
it *and* to it; a fabric-wide slow-down raises everything.

Golden traces under tests/traces/ are real captures; this module exists so the
tests can cover what one laptop cannot run for real: 64 ranks, a million
records, two stragglers at once, exact onsets. :func:`generate` returns the
records in arrival order and a truth dict in the ``.truth.json`` format
(docs/detection.md).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

Record = dict[str, Any]


@dataclass(frozen=True)
class SlowCompute:
    """Rank ``rank`` computes ``factor`` times slower during steps [start, end).

    ``in_coll``: seconds a step its CPU starvation also adds inside the
    collectives, for every rank alike (a CFS quota stops the rank's
    collective threads mid-transfer too: on a host without an accelerator a
    collective is CPU work), where nobody arrives late."""

    rank: int
    factor: float
    start: int
    end: int
    in_coll: float = 0.0


@dataclass(frozen=True)
class SlowNetwork:
    """Rank ``rank``'s link is slow: collectives take ``factor`` x, its flows' srtt ``srtt_factor`` x."""

    rank: int
    factor: float
    start: int
    end: int
    srtt_factor: float = 3.5
    retrans_per_s: float = 0.0
    # Retransmits a second on the flows sent *to* the rank (its ring
    # neighbour's data, dropped on the way in): counted on the neighbour's socket.
    retrans_to_per_s: float = 0.0
    # Only every ``slow_every``-th step from ``start`` is ``factor`` x slower;
    # srtt and retransmits go on all along (a lossy host: TCP recovers some
    # steps' losses quickly, others only after timeouts).
    slow_every: int = 1


@dataclass(frozen=True)
class SlowLink:
    """The path between ranks ``a`` and ``b`` is slow (a bad cable, port or switch path):
    collectives take ``factor`` x, the flows between the two, both directions,
    ``srtt_factor`` x srtt; each end's other flows stay normal. ``retrans_per_s``
    retransmits a second on each of the two flows."""

    a: int
    b: int
    factor: float
    start: int
    end: int
    srtt_factor: float = 3.5
    retrans_per_s: float = 0.0


@dataclass(frozen=True)
class WaitingPeer:
    """Rank ``rank`` waits on a lossy peer's retransmits during steps [start, end):
    while it waits it reads none of its other sockets, the kernel delays the
    ACKs of the data queued there, and every flow touching it shows
    ``srtt_factor`` x srtt, though nothing of its own is slow (seen in lab
    packet-loss runs: the lossy host's ring neighbour at 1.3-1.9x). No straggler."""

    rank: int
    srtt_factor: float
    start: int
    end: int


@dataclass(frozen=True)
class SlowDrift:
    """Rank ``rank`` ages: its compute slows linearly from 1x at step ``start`` to
    ``final`` x at step ``end``, and stays there (a throttling GPU, a failing DIMM)."""

    rank: int
    final: float
    start: int
    end: int


@dataclass(frozen=True)
class JobDrift:
    """Every rank's compute slows together, linearly to ``final`` x from ``start`` to ``end``
    (a new data phase, a fabric-wide change): nobody is to blame."""

    final: float
    start: int
    end: int


@dataclass(frozen=True)
class RetransBurst:
    """``count`` retransmits at once on the flow ``rank`` -> ``peer``, in the first
    probe poll of step ``step`` or later (a queue that overflowed once): a burst,
    not a lossy host or link, so no straggler."""

    rank: int
    peer: int
    step: int
    count: int


@dataclass(frozen=True)
class FabricSlow:
    """Every link is slow: collectives ``factor`` x, every flow's srtt ``srtt_factor`` x."""

    factor: float
    start: int
    end: int
    srtt_factor: float = 3.0


@dataclass(frozen=True)
class Spike:
    """Rank ``rank`` stalls ``seconds`` once, in step ``step`` (a GC pause)."""

    rank: int
    step: int
    seconds: float


@dataclass(frozen=True)
class Lost:
    """Rank ``rank`` dies during step ``step``; the job hangs, then is torn down."""

    rank: int
    step: int
    teardown_s: float = 3.0


@dataclass(frozen=True)
class Hang:
    """Rank ``rank`` stops just before issuing collective ``coll`` of step ``step``
    (a deadlock, a hung GPU, SIGSTOP) for ``seconds`` (None: to the end of the
    trace). It sends nothing meanwhile; its host's probes go on; the others
    block in that collective and report it ``pending`` every second."""

    rank: int
    step: int
    seconds: float | None = None
    coll: int = 1


@dataclass(frozen=True)
class SilentHost:
    """Rank ``rank``'s host is cut off (power, cable) just before collective
    ``coll`` of step ``step``, to the end: from then on nothing of that host
    arrives, neither its ranks' records nor its own probe records (cluster
    mode: each host's daemon forwards them), and no connection closes."""

    rank: int
    step: int
    coll: int = 1


@dataclass(frozen=True)
class Scenario:
    """A synthetic job: shape, noise, clocks and faults."""

    ranks: int = 4
    steps: int = 40
    compute_s: float = 0.2
    n_coll: int = 8
    xfer_s: float = 0.01
    coll_bytes: int = 4 << 20
    jitter: float = 0.03
    clock_offset_s: float = 0.0  # host clocks spread over +- this
    interval: float = 1.0
    srtt_us: float = 2000.0
    drop: float = 0.0  # share of hook records (step/coll) lost
    late_join: dict[int, int] = field(default_factory=dict)  # rank -> first step
    faults: tuple[Any, ...] = ()
    seed: int = 0
    name: str = "synthetic"
    tail_s: float = 0.0  # stream time (probe records only) after the last step
    ranks_per_host: int = 1
    probes: bool = True  # netdev and flow records (False: a daemon run with --no-probes)
    daemon_clock: bool = False  # the daemon's own clock record every interval
    pending_after_s: float = 1.0  # the hooks' pending records: from then on, every second
    stall_tail_s: float = 8.0  # stream time after a stall that lasts to the end
    # A normal end: every rank closes its connections after its last step.
    close_at_end: bool = False
    # Per-sample srtt noise: lognormal with this sigma (0: uniform +-10 %, the
    # old default). The lab's own clean runs are far noisier than 0.25.
    srtt_sigma: float = 0.0
    # Data both ways on every ring link (gloo's rings do; the lab shows it),
    # instead of r -> r+1 only.
    duplex: bool = False
    # Background retransmits a second on every data flow (Poisson), as a clean
    # lab run shows: ~1 a second a flow.
    retrans_bg_per_s: float = 0.0
    # Every pair of ranks connected (gloo's full mesh); False: ring
    # neighbours only (NCCL's rings), for jobs of thousands of ranks, where a
    # mesh is n*(n-1) conn records.
    mesh: bool = True


def _factor(faults: tuple[Any, ...], kind: Any, step: int, rank: int | None = None) -> float:
    f = 1.0
    for x in faults:
        g: Any = x
        if (
            isinstance(g, kind)
            and g.start <= step < g.end
            and (rank is None or g.rank == rank)
            and (step - g.start) % getattr(g, "slow_every", 1) == 0  # SlowNetwork's
        ):
            f *= g.factor
    return f


def _drift(x: SlowDrift | JobDrift, step: int) -> float:
    if step < x.start:
        return 1.0
    if step >= x.end:
        return x.final
    return 1.0 + (x.final - 1.0) * (step - x.start) / (x.end - x.start)


def compute_factor(faults: tuple[Any, ...], step: int, rank: int) -> float:
    """How much slower ``rank`` computes in ``step`` (steps, drifts and job-wide drifts)."""
    f = _factor(faults, SlowCompute, step, rank)
    for x in faults:
        if isinstance(x, SlowDrift) and x.rank == rank or isinstance(x, JobDrift):
            f *= _drift(x, step)
    return f


def _in_coll(faults: tuple[Any, ...], step: int) -> float:
    """Seconds a step CPU-starved ranks add inside the collectives (``SlowCompute.in_coll``)."""
    return sum(x.in_coll for x in faults if isinstance(x, SlowCompute) and x.start <= step < x.end)


def _net_factor(faults: tuple[Any, ...], step: int) -> float:
    f = _factor(faults, SlowNetwork, step) * _factor(faults, FabricSlow, step)
    return f * _factor(faults, SlowLink, step)


def truth_of(scn: Scenario) -> dict[str, Any]:
    """The ``.truth.json`` dict for a scenario.

    ``factor`` is the fault's effect on step time (as captures measure it);
    ``rank_factor`` the factor the fault applies to the rank's compute or link.
    """
    base = scn.compute_s + scn.n_coll * scn.xfer_s
    expect: list[dict[str, Any]] = []
    for x in scn.faults:
        if isinstance(x, SlowCompute):
            eff = 1.0 + (scn.compute_s * (x.factor - 1.0) + x.in_coll) / base
            cause = "compute"
        elif isinstance(x, SlowNetwork):  # on average, over every step of it
            eff = 1.0 + scn.n_coll * scn.xfer_s * (x.factor - 1.0) / base / x.slow_every
            cause = "network"
        elif isinstance(x, SlowLink):
            eff = 1.0 + scn.n_coll * scn.xfer_s * (x.factor - 1.0) / base
            expect.append(
                {
                    "rank": min(x.a, x.b),
                    "peer_rank": max(x.a, x.b),
                    "cause": "network",
                    "scope": "link",
                    "onset_step": x.start,
                    "end_step": x.end - 1,
                    "factor": round(eff, 3),
                    "rank_factor": x.factor,
                }
            )
            continue
        elif isinstance(x, SlowDrift):
            # Flag it before its own slow-down reaches 1.2x: the step where it does.
            span = x.end - x.start
            reach = x.start + math.ceil(span * 0.2 / (x.final - 1.0)) if x.final > 1.2 else None
            expect.append(
                {
                    "rank": x.rank,
                    "cause": "compute",
                    "onset_step": x.start,
                    "end_step": None,
                    "deadline_step": reach,
                    "factor": round(1.0 + scn.compute_s * (x.final - 1.0) / base, 3),
                    "rank_factor": x.final,
                    "trend": True,
                }
            )
            continue
        elif isinstance(x, Lost):
            expect.append(
                {"rank": x.rank, "cause": "rank_lost", "onset_step": x.step, "end_step": x.step}
            )
            continue
        elif isinstance(x, Hang):
            expect.append({"rank": x.rank, "cause": "hang", "onset_step": x.step,
                           "end_step": x.step})  # fmt: skip
            continue
        elif isinstance(x, SilentHost):
            rph = scn.ranks_per_host
            first = x.rank // rph * rph
            expect += [
                {"rank": r, "cause": "rank_lost", "onset_step": x.step, "end_step": x.step}
                for r in range(first, min(first + rph, scn.ranks))
            ]
            continue
        else:
            continue
        expect.append(
            {
                "rank": x.rank,
                "cause": cause,
                "onset_step": x.start,
                "end_step": x.end - 1,
                "factor": round(eff, 3),
                "rank_factor": x.factor,
                **({"scope": "node"} if cause == "network" else {}),
            }
        )
    return {
        "scenario": scn.name,
        "source": "synthetic (fsdp_sentinel.synth), not a capture",
        "world_size": scn.ranks,
        "steps": scn.steps,
        "stragglers": expect,
    }


def _conn_pairs(n: int, mesh: bool) -> list[tuple[int, int]]:
    """The connected (local, remote) rank pairs, in the order records are made."""
    if mesh:
        return [(a, b) for a in range(n) for b in range(n) if a != b]
    return [(a, b) for a in range(n) for b in sorted({(a - 1) % n, (a + 1) % n} - {a})]


def _poisson(rnd: random.Random, lam: float) -> int:
    """A Poisson draw (Knuth; lam is small here)."""
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rnd.random()
        if p <= limit:
            return k
        k += 1


def generate(scn: Scenario) -> tuple[list[Record], dict[str, Any]]:
    """Records of the whole job in arrival order, and its truth."""
    rnd = random.Random(scn.seed)
    n = scn.ranks
    offs = [rnd.uniform(-scn.clock_offset_s, scn.clock_offset_s) for _ in range(n)]
    host = [f"synth-h{r // scn.ranks_per_host}" for r in range(n)]
    addr = [f"198.18.{r // 250}.{r % 250 + 1}" for r in range(n)]
    pid = [10000 + r for r in range(n)]

    def ep(a: int, b: int) -> str:  # a's local end of the (a, b) connection
        return f"{addr[a]}:{20000 + b}"

    lost = next((x for x in scn.faults if isinstance(x, Lost)), None)
    hang = next((x for x in scn.faults if isinstance(x, Hang)), None)
    cut = next((x for x in scn.faults if isinstance(x, SilentHost)), None)
    stop = hang or cut
    stall_t: float | None = None  # when the hang or the cut began
    stall_end: float | None = None  # when a stall to the end stops the trace
    cut_host = host[cut.rank] if cut is not None else None
    spikes = {(x.rank, x.step): x.seconds for x in scn.faults if isinstance(x, Spike)}
    timed: list[tuple[float, int, Record]] = []  # (true time, tiebreak, record)
    seq_no = 0

    def put(true_t: float, rank: int, rec: Record) -> None:
        nonlocal seq_no
        timed.append((true_t, seq_no, rec))
        seq_no += 1

    t0 = 1_700_000_000.0
    for r in range(n):
        put(
            t0 + r * 1e-4,
            r,
            {
                "kind": "rank",
                "t": t0 + offs[r],
                "rank": r,
                "world_size": n,
                "host": host[r],
                "pid": pid[r],
                "addrs": [addr[r]],
            },
        )
    pairs = _conn_pairs(n, scn.mesh)
    for a, b in pairs:
        put(
            t0 + 0.001,
            a,
            {
                "kind": "conn",
                "t": t0 + 0.001 + offs[a],
                "host": host[a],
                "pid": pid[a],
                "src": ep(a, b),
                "dst": ep(b, a),
                "what": "open",
            },
        )
    cur = [t0 + 0.01] * n
    step_starts: list[float] = []
    steps_done = scn.steps
    dead_t: float | None = None
    seg_w = 1.0 / (scn.n_coll + 1)
    seq = [0] * n
    for s in range(scn.steps):
        starts = cur[:]
        step_starts.append(min(starts))
        net = _net_factor(scn.faults, s)
        starved = _in_coll(scn.faults, s) / scn.n_coll
        die_at = None
        if lost is not None and s == lost.step:
            die_at = rnd.randrange(1, scn.n_coll)
        for k in range(scn.n_coll + 1):
            issue = []
            for r in range(n):
                seg = scn.compute_s * seg_w * compute_factor(scn.faults, s, r)
                seg *= math.exp(rnd.gauss(0.0, scn.jitter))
                if k == 1:
                    seg += spikes.get((r, s), 0.0)
                issue.append(cur[r] + seg)
            to_end = False
            if stop is not None and s == stop.step and k == stop.coll:
                stall_t = issue[stop.rank]
                seconds = stop.seconds if isinstance(stop, Hang) else None
                if seconds is not None:
                    issue[stop.rank] = stall_t + seconds  # it goes on where it stopped
                else:
                    to_end = True
                    stall_end = stall_t + scn.stall_tail_s
            if to_end:
                assert stall_end is not None and stop is not None
                # The others issue it and wait to the end of the trace.
                for r in range(n):
                    if r == stop.rank or (cut_host is not None and host[r] == cut_host):
                        continue
                    _pending(put, scn, r, s, seq[r], k, issue[r], stall_end, offs[r])
                steps_done = s
                break
            if die_at is not None and k == die_at:
                dead_t = issue[lost.rank] - 0.5 * scn.compute_s * seg_w  # type: ignore[union-attr]
                steps_done = s
                break
            if k == scn.n_coll:
                cur = issue
                break
            done = max(issue) + scn.xfer_s * net * math.exp(rnd.gauss(0.0, scn.jitter)) + starved
            op = "all_gather" if k < scn.n_coll // 2 else "reduce_scatter"
            for r in range(n):
                end = done + rnd.uniform(0.0, 2e-4)
                if s >= scn.late_join.get(r, 0):
                    _pending(put, scn, r, s, seq[r], k, issue[r], end, offs[r])
                    put(
                        end,
                        r,
                        {
                            "kind": "coll",
                            "rank": r,
                            "step": s,
                            "seq": seq[r],
                            "op": op,
                            "bytes": scn.coll_bytes,
                            "group_size": n,
                            "issue": issue[r] + offs[r],
                            "end": end + offs[r],
                        },
                    )
                seq[r] += 1
                cur[r] = end
        if dead_t is not None or stall_end is not None:
            break
        for r in range(n):
            if s >= scn.late_join.get(r, 0):
                put(
                    cur[r],
                    r,
                    {
                        "kind": "step",
                        "rank": r,
                        "step": s,
                        "start": starts[r] + offs[r],
                        "end": cur[r] + offs[r],
                    },
                )
            cur[r] += 1e-4

    t_end = (dead_t + lost.teardown_s + 2 * scn.interval) if (lost and dead_t) else max(cur)
    if stall_end is not None:
        t_end = stall_end
    if scn.close_at_end and stall_end is None and dead_t is None:
        for a, b in pairs:
            tc = cur[a] + 0.05
            put(tc, a, {"kind": "conn", "t": tc + offs[a], "host": host[a],
                        "pid": pid[a], "src": ep(a, b), "dst": ep(b, a),
                        "what": "close"})  # fmt: skip
    t_end += scn.tail_s
    if lost is not None and dead_t is not None:
        k = lost.rank
        for b in sorted({b for a, b in pairs if a == k}):
            put(
                dead_t,
                k,
                {
                    "kind": "conn",
                    "t": dead_t + offs[k],
                    "host": host[k],
                    "pid": pid[k],
                    "src": ep(k, b),
                    "dst": ep(b, k),
                    "what": "close",
                },
            )
            put(
                dead_t + 3e-4,
                b,
                {
                    "kind": "conn",
                    "t": dead_t + 3e-4 + offs[b],
                    "host": host[b],
                    "pid": pid[b],
                    "src": ep(b, k),
                    "dst": ep(k, b),
                    "what": "reset",
                    "direction": "received",
                },
            )
        td = dead_t + lost.teardown_s
        for a, b in pairs:
            if k not in (a, b):
                put(
                    td,
                    a,
                    {
                        "kind": "conn",
                        "t": td + offs[a],
                        "host": host[a],
                        "pid": pid[a],
                        "src": ep(a, b),
                        "dst": ep(b, a),
                        "what": "close",
                    },
                )

    # Probe records: ring data flows (r -> r+1) and their ACK paths, every interval.
    bursts = [x for x in scn.faults if isinstance(x, RetransBurst)]
    t = t0 + scn.interval
    while t <= t_end + 1e-9:
        if scn.daemon_clock:
            put(t, -1, {"kind": "clock", "t": t, "host": "synth-daemon"})
        s = max(0, bisect_right(step_starts, t) - 1)
        running = s < steps_done and (dead_t is None or t < dead_t)
        if stall_t is not None and stall_end is not None and t >= stall_t:
            running = False
        gone = cut_host if (stall_t is not None and t >= stall_t) else None
        if not scn.probes:
            t += scn.interval
            continue
        for r in range(n):
            if r % scn.ranks_per_host or host[r] == gone:
                continue  # one netdev record per host; none from a host cut off
            put(
                t,
                r,
                {
                    "kind": "netdev",
                    "t": t + offs[r],
                    "dt": scn.interval,
                    "host": host[r],
                    "dev": "eth0",
                    "tx_bytes": 0,
                    "rx_bytes": 0,
                },
            )
        if n >= 2:
            for r in range(n):
                for peer in {(r + 1) % n, (r - 1) % n}:
                    if (
                        lost is not None
                        and dead_t is not None
                        and t >= dead_t
                        and lost.rank in (r, peer)
                    ) or host[r] == gone:
                        continue
                    sending = scn.duplex or peer == (r + 1) % n
                    f = 1.0
                    for x in scn.faults:
                        if (
                            isinstance(x, SlowNetwork)
                            and x.start <= s < x.end
                            and x.rank in (r, peer)
                        ):
                            f *= x.srtt_factor
                        if isinstance(x, FabricSlow) and x.start <= s < x.end:
                            f *= x.srtt_factor
                        if (
                            isinstance(x, WaitingPeer)
                            and x.start <= s < x.end
                            and x.rank in (r, peer)
                        ):
                            f *= x.srtt_factor
                        if (
                            isinstance(x, SlowLink)
                            and x.start <= s < x.end
                            and {r, peer} == {x.a, x.b}
                        ):
                            f *= x.srtt_factor
                    rate = scn.coll_bytes * scn.n_coll / (scn.compute_s + scn.n_coll * scn.xfer_s)
                    tx = (
                        int(rate * scn.interval * rnd.uniform(0.9, 1.1))
                        if (running and sending)
                        else 0
                    )
                    rx = (
                        int(rate * scn.interval * rnd.uniform(0.9, 1.1))
                        if running and (scn.duplex or not sending)
                        else 0
                    )
                    retrans = 0
                    for x in scn.faults:
                        if (
                            not isinstance(x, (SlowNetwork, SlowLink))
                            or not x.start <= s < x.end
                            or not sending
                        ):
                            continue
                        if isinstance(x, SlowNetwork) and x.rank == r:
                            retrans += int(x.retrans_per_s * scn.interval)
                        if isinstance(x, SlowNetwork) and x.rank == peer:
                            retrans += int(x.retrans_to_per_s * scn.interval)
                        if isinstance(x, SlowLink) and {r, peer} == {x.a, x.b}:
                            retrans += int(x.retrans_per_s * scn.interval)
                    for x in bursts:
                        if (x.rank, x.peer) == (r, peer) and s >= x.step and running:
                            retrans += x.count
                            bursts.remove(x)  # once
                            break
                    if scn.retrans_bg_per_s and running and sending:
                        retrans += _poisson(rnd, scn.retrans_bg_per_s * scn.interval)
                    noise = (
                        math.exp(rnd.gauss(0.0, scn.srtt_sigma))
                        if scn.srtt_sigma
                        else rnd.uniform(0.9, 1.1)
                    )
                    put(
                        t,
                        r,
                        {
                            "kind": "flow",
                            "t": t + offs[r],
                            "dt": scn.interval,
                            "host": host[r],
                            "pid": pid[r],
                            "src": ep(r, peer),
                            "dst": ep(peer, r),
                            "tx_bytes": tx,
                            "rx_bytes": rx,
                            "srtt_us": round(scn.srtt_us * f * noise, 1),
                            "retrans": retrans,
                            "cwnd": 10,
                        },
                    )
        t += scn.interval

    timed.sort(key=lambda x: (x[0], x[1]))
    out = [rec for _, _, rec in timed]
    if cut_host is not None and stall_t is not None:
        # Nothing of a host cut off reaches the daemon: its ranks' records neither.
        out = [rec for rec in out if not _from_host_after(rec, host, cut_host, stall_t)]
    if scn.drop > 0:
        out = [
            rec for rec in out if rec["kind"] not in ("step", "coll") or rnd.random() >= scn.drop
        ]
    truth = truth_of(scn)
    if stall_t is not None:
        for e in truth["stragglers"]:
            if e["cause"] in ("hang", "rank_lost"):
                e["onset_t"] = round(stall_t, 6)
    return out, truth


def _pending(
    put: Any,
    scn: Scenario,
    rank: int,
    step: int,
    seq: int,
    k: int,
    issue: float,
    end: float,
    off: float,
) -> None:
    """The hooks' ``pending`` records of a collective in flight from ``issue`` to ``end``."""
    op = "all_gather" if k < scn.n_coll // 2 else "reduce_scatter"
    t = issue + scn.pending_after_s
    while t < end:
        put(t, rank, {"kind": "pending", "t": t + off, "rank": rank, "step": step, "seq": seq,
                      "op": op, "issue": issue + off})  # fmt: skip
        t += 1.0


def _from_host_after(rec: Record, host: list[str], cut: str, t_cut: float) -> bool:
    """Whether ``rec`` comes from host ``cut`` after ``t_cut`` (so never arrives)."""
    kind = rec["kind"]
    if kind in ("netdev", "flow", "conn"):
        return bool(rec["host"] == cut and rec["t"] >= t_cut)
    if kind in ("coll", "step", "pending"):
        t = rec["end"] if kind != "pending" else rec["t"]
        return bool(host[rec["rank"]] == cut and t >= t_cut)
    return False


def fleet_job(ranks: int, steps: int = 20) -> list[Record]:
    """A job of ``ranks`` ranks for views at fleet size (report, ``top``):
    a compute straggler (rank ``ranks // 60``) from step 8 and a network one
    (the middle rank) from step 10, both to the end, with their ``flagged``
    verdicts written as the detector words them and never cleared (open at
    end), so a page can be drawn without running the detector over it."""
    compute, network = ranks // 60, ranks // 2
    scn = Scenario(
        ranks=ranks,
        steps=steps,
        n_coll=4,
        faults=(SlowCompute(compute, 1.6, 8, steps), SlowNetwork(network, 2.5, 10, steps)),
        name=f"fleet-{ranks}",
    )
    recs, _ = generate(scn)
    first = {r: min(x["end"] for x in recs if x["kind"] == "step" and x["rank"] == r and x["step"] == s)
             for r, s in ((compute, 9), (network, 11))}  # fmt: skip
    verdicts = [
        {"kind": "verdict", "t": first[compute], "step": 9, "rank": compute, "state": "flagged",
         "cause": "compute", "score": 0.5, "host": f"synth-h{compute}", "evidence": {}},
        {"kind": "verdict", "t": first[network], "step": 11, "rank": network, "state": "flagged",
         "cause": "network", "score": 2.5, "host": f"synth-h{network}", "evidence": {}},
    ]  # fmt: skip
    from fsdp_sentinel.trace import record_time

    return sorted([*recs, *verdicts], key=record_time)


def load_job(
    ranks: int,
    steps: int,
    colls: int,
    t0: float,
    rate: float,
    *,
    order: str = "time",
    silent: tuple[int, int] | None = None,
) -> Iterator[Record]:
    """A clean job's hook records made on the fly, for load (``bench/load``).

    Every rank announces itself at ``t0``; then each step (``rate`` a second)
    each rank sends ``colls`` collectives (all-gathers, then reduce-scatters,
    100 MiB each) and its ``step`` record, the ranks a fraction of a ms apart.
    ``order``: ``"time"``, each step's records in the order they end (how a
    real job's records reach the daemon: each is sent when it ends);
    ``"rank"``, each rank's whole step at once, rank 0 first (rank 0's step
    record then arrives before the collectives the other ranks finished up
    to 45 ms earlier, as if their emitters ran a step behind).
    ``silent`` = (rank, step): that rank sends nothing from that step on.
    """
    if order not in ("time", "rank"):
        raise ValueError(f"order {order!r}: 'time' or 'rank'")
    dt = 1.0 / rate
    for r in range(ranks):
        yield {"kind": "rank", "t": t0, "rank": r, "world_size": ranks, "host": f"load-h{r // 8}",
               "pid": 20000 + r, "addrs": [f"198.18.{r // 250}.{r % 250 + 1}"], "job": "load"}  # fmt: skip
    per = dt * 0.8 / colls
    for s in range(steps):
        start = t0 + s * dt
        recs: list[Record] = []
        for r in range(ranks):
            if silent is not None and r == silent[0] and s >= silent[1]:
                continue
            skew = (r % 7) * 1e-4  # ranks a fraction of a ms apart
            for c in range(colls):
                issue = start + skew + c * per
                op = "all_gather" if c < colls // 2 else "reduce_scatter"
                recs.append({"kind": "coll", "rank": r, "step": s, "seq": s * colls + c, "op": op,
                             "bytes": 100 << 20, "issue": round(issue, 6),
                             "end": round(issue + per * 0.6, 6)})  # fmt: skip
            recs.append({"kind": "step", "rank": r, "step": s, "start": round(start + skew, 6),
                         "end": round(start + skew + dt * 0.95, 6)})  # fmt: skip
        if order == "time":
            recs.sort(key=_end_of)
        yield from recs


def _end_of(rec: Record) -> float:
    return float(rec["end"])
