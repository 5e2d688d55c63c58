"""Rule ``network``: the job's step stretched while nobody arrives late, on slow or lossy flows.

From one flow matrix, :func:`network_view` scores every rank: the lowest srtt
of the flows touching it (sent by it *or* to it: a slow host delays its own
data and the ACKs it returns) over the median srtt of the flows not touching
it, and its share of the window's retransmits. :func:`is_candidate` then asks
whether that localises the stretch to the rank. Pure.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, NamedTuple

from fsdp_sentinel.correlate import PairFlow, RankStep
from fsdp_sentinel.detect.config import NetworkConfig
from fsdp_sentinel.detect.stats import median, median_sorted, rnd

_SRTT = attrgetter("srtt_us")


class NetView(NamedTuple):
    """Network scores of every rank from one flow matrix."""

    ratio: dict[int, float]
    share: dict[int, float]
    touching: dict[int, list[PairFlow]]  # rank -> the active flows it sends or receives
    touching_us: dict[int, float]
    others_us: dict[int, float]
    ambiguous: bool
    all_median_us: float | None
    total_retrans: int
    sent_share: dict[int, float]
    suppressed: frozenset[int] = frozenset()
    uses_base: bool = False  # some rank was judged against ``srtt_base``


def network_view(
    flows: tuple[PairFlow, ...],
    ranks: Sequence[int],
    srtt_base: float | None,
    cfg: NetworkConfig,
    flagged: frozenset[int] = frozenset(),
) -> NetView:
    active = [p for p in flows if p.srtt_us is not None and p.tx_bytes >= cfg.net_min_bytes]
    ratio: dict[int, float] = {}
    share: dict[int, float] = {}
    touching_us: dict[int, float] = {}
    others_us: dict[int, float] = {}
    ambiguous = False
    uses_base = False
    total_retrans = sum(p.retrans for p in flows)
    unlocalised: list[int] = []
    sent_share: dict[int, float] = {}
    # Each rank's active flows in one pass (same order as ``active``), and its
    # retransmits touching / sent, instead of a scan of every flow per rank.
    # The srtt of every active flow, ascending: the flows not touching a rank
    # are these less its own (srtt is never None here).
    everyone: list[float] = sorted(p.srtt_us or 0.0 for p in active)
    touching: dict[int, list[PairFlow]] = {}
    for p in active:
        touching.setdefault(p.rank, []).append(p)
        if p.peer != p.rank:
            touching.setdefault(p.peer, []).append(p)
    re_touch: dict[int, int] = {}
    re_sent: dict[int, int] = {}
    if total_retrans:
        for p in flows:
            re_touch[p.rank] = re_touch.get(p.rank, 0) + p.retrans
            if p.peer != p.rank:
                re_touch[p.peer] = re_touch.get(p.peer, 0) + p.retrans
            re_sent[p.rank] = re_sent.get(p.rank, 0) + p.retrans
    for r in ranks:
        touch = touching.get(r)
        if not touch:
            continue
        # The lowest srtt of its flows: a slow host slows every flow it touches,
        # while its neighbours have one slow flow (to it) and normal others.
        t_med = min(map(_SRTT, touch))
        touching_us[r] = t_med
        if len(touch) < len(active):
            rest = everyone.copy()
            for p in touch:
                del rest[bisect_left(rest, p.srtt_us or 0.0)]
            o_med = median_sorted(rest)
        elif srtt_base:
            o_med = srtt_base
            ambiguous = True
            unlocalised.append(r)
        else:
            uses_base = True
            continue
        others_us[r] = o_med
        ratio[r] = t_med / o_med if o_med > 0 else 1.0
        if total_retrans:
            share[r] = re_touch.get(r, 0) / total_retrans
            sent_share[r] = re_sent.get(r, 0) / total_retrans
    # Ranks whose every flow touches them all see the same flows (two ranks):
    # name one, the one whose own sockets are slowest, and say it is a guess.
    suppressed: frozenset[int] = frozenset()
    if len(unlocalised) > 1:

        def own(r: int) -> float:
            mine = [p.srtt_us for p in active if p.rank == r and p.srtt_us is not None]
            return median(mine) if mine else 0.0

        # A rank already flagged keeps the verdict, so the guess does not flip.
        keep = max(unlocalised, key=lambda r: (r in flagged, own(r), -r))
        suppressed = frozenset(r for r in unlocalised if r != keep)
    return NetView(
        uses_base=uses_base or bool(unlocalised),
        suppressed=suppressed,
        ratio=ratio,
        share=share,
        touching=touching,
        touching_us=touching_us,
        others_us=others_us,
        ambiguous=ambiguous,
        all_median_us=median_sorted(everyone) if everyone else None,
        total_retrans=total_retrans,
        sent_share=sent_share,
    )


def network_view_memo(
    memo: tuple[Any, ...],
    flows: tuple[PairFlow, ...],
    ranks: tuple[int, ...],
    srtt_base: float | None,
    cfg: NetworkConfig,
    flagged: frozenset[int],
) -> tuple[NetView, tuple[Any, ...]]:
    """:func:`network_view`, or the view kept in ``memo`` when its inputs are equal."""
    key = (flows, ranks, flagged, cfg.net_min_bytes)
    if memo and memo[0] == key:
        view: NetView = memo[2]
        if not view.uses_base or memo[1] == srtt_base:
            return view, memo
    view = network_view(flows, ranks, srtt_base, cfg, flagged)
    return view, (key, srtt_base, view)


def is_candidate(rank: int, net: NetView, n_present: int, cfg: NetworkConfig) -> bool:
    """Does the view localise the job's stretch to ``rank``? (the stretch checked by the caller)"""
    if rank not in net.ratio or rank in net.suppressed:
        return False
    if net.ratio[rank] >= cfg.net_ratio:
        return True
    if n_present >= 3 and net.total_retrans >= cfg.retrans_min:
        # Both ends of a lossy flow touch it; the sender's socket counts
        # the retransmits, so of the two it is the sender that is named.
        share = net.share.get(rank, 0.0)
        return share >= cfg.retrans_share and net.sent_share.get(rank, 0.0) >= share / 2
    return False


def evidence(
    rs: RankStep, relative: float | None, net: NetView, stretch: float | None
) -> tuple[float, dict[str, Any], int | None]:
    """Score, evidence and peer rank of a new ``network`` verdict."""
    ratio = net.ratio.get(rs.rank, 1.0)
    ev: dict[str, Any] = {
        "srtt_ratio": rnd(ratio),
        "srtt_us_touching": rnd(net.touching_us.get(rs.rank), 1),
        "srtt_us_others": rnd(net.others_us.get(rs.rank), 1),
        "retrans_share": rnd(net.share.get(rs.rank)),
        "retrans": net.total_retrans,
        "stretch": rnd(stretch),
        "relative": rnd(relative),
    }
    if net.ambiguous:
        ev["unsure"] = "every flow touches this rank: cannot tell which end is slow"
        ev["candidates"] = sorted({rs.rank, *net.suppressed})
    return ratio, ev, worst_peer(net, rs.rank)


def worst_peer(net: NetView, rank: int) -> int:
    """The other end of the slowest active flow touching ``rank`` (ties: lowest ranks)."""
    _s, top_rank, top_peer = max((p.srtt_us, -p.rank, -p.peer) for p in net.touching[rank])
    return -top_peer if -top_rank == rank else -top_rank
