"""Rules ``hang``, silent loss and a lossy link: why a collective stalled (pure).

A collective that never completes shows in the trace only through the
``pending`` records of the ranks blocked in it (the hooks send one a second
from 1 s on). Once the oldest such collective has been pending
``hang_after_s`` (and ``hang_after_steps`` of the job's recent step time,
so a slow job whose collectives do complete never stalls), this rule asks
who is missing:

* a rank that sends no pending record, whose newest ``seq`` is behind the
  stalled one and that sent no hook record for ``catching_up_s`` (one that
  did is still completing collectives: catching up) never issued it. If its
  host's own probe records go on (or no
  host's are known, as in the one-daemon lab), the rank is alive and stuck:
  ``hang``, with the collective (op, seq, step) in the evidence;
* a host whose own probe records (``netdev``, ``flow``) stopped while another
  host's go on is gone, power or cable: ``rank_lost`` for every rank on it,
  with no close or reset needed (a rank simply gone, records and all, is the
  same case);
* when every rank is waiting, so nobody is behind, and every flow TCP has been
  retransmitting on since the stall began touches one rank, and no bytes
  crossed that rank's flows since the resends began, that rank's host is cut
  off (its peers resend into a dead link, and so does it): ``rank_lost`` for
  every rank on that host. Bytes still crossing say the link is lossy, not
  dead: ``network`` on that rank, the stall's cause (``detect`` opens its
  network track, which the network rule then holds or clears).

A job that ends normally has nothing pending, so none of this can fire; nor
once a rank is lost (its loss is the stall, the rest are its casualties). A hung
rank is cleared once it issues the collective it was missing (or completes a
step); a lost one by the ``lost`` rule, when it is heard from again.
"""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_sentinel.correlate import RankLiveness, Stall, Summary
from fsdp_sentinel.detect.config import StallConfig
from fsdp_sentinel.detect.stats import median
from fsdp_sentinel.trace import Verdict


def judge_stall(
    summary: Summary,
    lost_before: dict[int, float],
    hung_before: dict[int, int],
    cfg: StallConfig,
    base: float | None,
    recent: Sequence[float] = (),
) -> tuple[dict[int, float], dict[int, int], list[Verdict]]:
    """Ranks hung or lost by this summary (and hangs cleared), and their verdicts
    (with a ``network`` one for a lossy link that stalls the job: not kept in
    either map, ``detect`` opens its track).

    ``lost_before`` / ``hung_before`` are the ``lost`` rule's map (rank ->
    ``last_t`` when lost) and this rule's (rank -> the ``seq`` it never
    issued); new maps are returned, the inputs are not changed (and are
    returned as they are when nothing changed). ``base`` and ``recent`` are
    the job's baseline and recent step times: its pace.
    """
    stall = summary.stall
    judging = summary.step is None and bool(stall.pending) and not lost_before
    if not hung_before and not judging:
        return lost_before, hung_before, []  # the common case, every step: nothing to do
    lost = dict(lost_before)
    hung = dict(hung_before)
    out: list[Verdict] = []
    by_rank = {lv.rank: lv for lv in summary.liveness}
    if hung:
        out += _clear_hangs(summary, hung, lost, by_rank)
    if not judging:
        # (Once a rank is lost it explains the stall: the survivors blocked on
        # it, or failing their collectives as they go down, are its casualties.)
        return lost, hung, out
    step_s = max(base or 0.0, median(recent) if recent else 0.0)
    t = summary.t
    waiting = [p for p in stall.pending if t - p.t <= cfg.pending_stale_s and p.rank not in lost]
    if not waiting:
        return lost, hung, out
    # The stalled collective: the earliest in issue order that anyone waits on.
    first_seq = min(p.seq for p in waiting)
    first = min((p for p in waiting if p.seq == first_seq), key=lambda p: (p.issue, p.rank))
    stalled_s = t - first.issue
    if stalled_s < max(cfg.hang_after_s, cfg.hang_after_steps * (step_s or 0.0)):
        return lost, hung, out
    waiting_set = {p.rank for p in waiting}  # membership per rank: a set, not the list
    waiting_ranks = sorted(waiting_set)
    ctx = {
        "op": first.op,
        "seq": first.seq,
        "step": first.step,
        "stalled_s": round(stalled_s, 3),
        "waiting_ranks": waiting_ranks,
    }
    silent = _silent_hosts(stall, t, cfg)
    newest = dict(stall.newest_seq)
    gone: list[tuple[RankLiveness, dict[str, object]]] = []
    for lv in summary.liveness:
        if lv.rank in lost or lv.host not in silent:
            continue
        heard_t = silent[lv.host]
        gone.append((lv, {**ctx, "host_silent_s": round(t - heard_t, 3), "others_heard": True}))
    named = {lv.rank for lv, _ in gone}
    for lv in summary.liveness:
        r = lv.rank
        if r in lost or r in named or r in hung or r in waiting_set or lv.torn_peers:
            continue  # (a hung rank keeps its connections: a torn one is going down)
        if newest.get(r, -1) < first.seq and t - lv.last_t >= cfg.catching_up_s:
            hung[r] = first.seq
            ev = {**ctx, "newest_seq": newest.get(r, -1)}
            out.append(Verdict(t, first.step, r, "flagged", "hang", stalled_s, lv.host, None, ev))
    if not gone and waiting_set >= {r for r in by_rank if r not in lost}:
        target = _resend_target(stall, by_rank, lost, cfg)
        if target is not None:
            rank, flows = target
            resent: dict[str, object] = {"retrans_flows": [list(f) for f in flows]}
            got = [list(d) for d in stall.delivered if rank in d[:2]]
            if got:
                out.append(_lossy(t, first.step, by_rank[rank], stalled_s, base, ctx, resent, got))
            else:
                gone = _cut_off(by_rank, rank, lost, {**ctx, "unreachable": True, **resent})
    for lv, ev in gone:
        lost[lv.rank] = lv.last_t
        hung.pop(lv.rank, None)
        out.append(
            Verdict(
                t, lv.done_step + 1, lv.rank, "flagged", "rank_lost", stalled_s, lv.host, None, ev
            )
        )
    return lost, hung, out


def _silent_hosts(stall: Stall, t: float, cfg: StallConfig) -> dict[str, float]:
    """Hosts whose own probe records stopped while another host's go on: host -> last heard."""
    quiet: dict[str, float] = {}
    fresh = False
    for host, heard_t, dt in stall.hosts_heard:
        if t - heard_t >= max(cfg.host_silence_s, cfg.host_silence_intervals * dt):
            quiet[host] = heard_t
        else:
            fresh = True
    return quiet if fresh else {}


def _resend_target(
    stall: Stall, by_rank: dict[int, RankLiveness], lost: dict[int, float], cfg: StallConfig
) -> tuple[int, list[tuple[int, int, int]]] | None:
    """Every rank waits: the one rank every flow TCP resent on touches, and those flows."""
    flows = [(a, b, n) for a, b, n in stall.retrans if a not in lost and b not in lost]
    if len(flows) < 2 or sum(n for _, _, n in flows) < cfg.unreachable_retrans:
        return None
    common = set.intersection(*({a, b} for a, b, _ in flows))
    if len(common) != 1:
        return None  # two ranks share every such flow (a 2-rank job): no telling which end
    (rank,) = common
    lv = by_rank.get(rank)
    return (rank, flows) if lv is not None and lv.host else None


def _cut_off(
    by_rank: dict[int, RankLiveness], cut: int, lost: dict[int, float], ev: dict[str, object]
) -> list[tuple[RankLiveness, dict[str, object]]]:
    """Every rank on ``cut``'s host, lost: nothing crosses its links (see the module docstring)."""
    host = by_rank[cut].host
    return [
        (lv, {**ev, "via_rank": cut} if lv.rank != cut else ev)
        for lv in by_rank.values()
        if lv.host == host and lv.rank not in lost
    ]


def _lossy(
    t: float,
    step: int,
    lv: RankLiveness,
    stalled_s: float,
    base: float | None,
    ctx: dict[str, object],
    resent: dict[str, object],
    got: list[list[int]],
) -> Verdict:
    """``network`` on the rank whose lossy links hold every rank in a collective.

    Its bytes still cross while TCP resends on its flows alone: a link losing
    enough to stall the job, not a cut. Named now, not once the collective
    completes (a heavy loss of a few seconds makes one step and no other).
    The step is at least ``stalled_s`` long, so that prices it (a lower bound).
    ``detect`` opens the rank's network track with it, and the network rule
    holds or clears it from then on."""
    ev = {
        **ctx,
        "scope": "node",
        "by": "retrans",
        "lossy": True,
        **resent,
        "delivered": got,
        "job_step_s": round(stalled_s, 3),
        "baseline_step_s": None if base is None else round(base, 4),
    }
    return Verdict(t, step, lv.rank, "flagged", "network", stalled_s, lv.host, None, ev)


def _clear_hangs(
    summary: Summary,
    hung: dict[int, int],
    lost: dict[int, float],
    by_rank: dict[int, RankLiveness],
) -> list[Verdict]:
    """Hung ranks that issued the collective they were missing (or finished a step)."""
    newest = dict(summary.stall.newest_seq)
    stepped = {rs.rank for rs in summary.ranks if rs.n_coll}
    out = []
    for r, seq in sorted(hung.items()):
        if r in lost:  # its rank_lost verdict stands for it now
            del hung[r]
        elif r in stepped or newest.get(r, -1) >= seq:
            del hung[r]
            lv = by_rank.get(r)
            out.append(
                Verdict(
                    summary.t,
                    summary.step if summary.step is not None else (lv.done_step + 1 if lv else 0),
                    r,
                    "cleared",
                    "hang",
                    0.0,
                    lv.host if lv else "",
                    None,
                    {"missing_seq": seq},
                )
            )
    return out
