"""Rule ``network``: the job's step stretched while nobody arrives late, on slow or lossy flows.

From one flow matrix (each directed pair's figures over an evidence window
sized in steps, :func:`window_s`), :func:`network_view` weighs every
hypothesis against every other candidate:

* **node** ``r``: every flow touching ``r`` (sent by it *or* to it: a slow
  host delays its own data and the ACKs it returns) is slow. Its score is the
  *lowest* median srtt of those flows over the median of the flows not
  touching it, so a ring neighbour, with one slow flow (to the slow host)
  and normal others, scores ~1. Or ``r`` touches at least ``retrans_share``
  of the window's retransmits, more than chance allows for the bytes its
  flows carry (``retrans_p``), and no other rank does. A retransmit counts
  only as a loss (:func:`lost`): one the receiver reports it already had
  (D-SACK) was spurious.
* **link** ``a``-``b``: the flows between the two are slow (or carry the
  retransmits) while each end's other flows are normal: a cable, port or
  switch path, not a host. Two or more slow links with one end in common are
  that end's node.

A flow is judged by the median srtt of its busy samples over the window
(:func:`figures`), never by one sample. Loopback flows are no evidence at all
(:func:`routed`): between two processes of one host, srtt and retransmits
measure how promptly each ran. :func:`is_candidate` says whether the view blames a rank (a link
is carried by its lower rank, with the other end as ``peer_rank``). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from fsdp_sentinel.correlate import PairFlow, RankStep
from fsdp_sentinel.detect.config import NetworkConfig
from fsdp_sentinel.detect.stats import (
    median,
    median_sorted,
    median_without,
    median_without_all,
    rnd,
)
from fsdp_sentinel.flowstore import routed_srtts


class Flow(NamedTuple):
    """One directed pair's flow as the rule judges it (:func:`figures` of a ``PairFlow``).

    ``srtt_med_us``: the median srtt of its busy samples over the window
    (:func:`busy_median`); ``srtt_new_us``: the same over the newest poll only
    (fresh, not robust: strong evidence only); ``cwnd``: median cwnd.
    """

    rank: int
    peer: int
    tx_bytes: int
    retrans: int
    srtt_med_us: float | None
    srtt_new_us: float | None
    cwnd: float | None
    dsack_dups: int = 0


def lost(p: PairFlow | Flow) -> int:
    """``p``'s retransmits that were losses: all but those the receiver reported as
    duplicates (D-SACK), which had arrived and were resent only because their
    ACK came late. A CPU-starved receiver ACKs late (inferred: what arrives
    while its throttled process owns the socket waits in the backlog, un-ACKed,
    until the process runs again) and draws such retransmits from every
    sender, as a lossy host does: a lab rank throttled to 0.15 of a core drew
    51 from one neighbour, every one D-SACKed, and in a CI run the retransmit
    rule named such a rank's host lossy. A flow out of a 10 % lossy host:
    3 of 13,957 D-SACKed.
    The receiver reports a duplicate per ACK, so a timeout that resends a
    whole window has most of it unreported (an ACK blackout in
    test_probes_netns: ~100 retransmits, 2 D-SACKed): this discounts tail
    probes and single resends, and errs toward counting a loss. Clamped at 0:
    a duplicate the network made itself is D-SACKed without a retransmit."""
    return max(0, p.retrans - p.dsack_dups)


def _lost_in(sample: tuple[Any, ...]) -> int:
    """:func:`lost` of one window sample (``PairFlow.samples``)."""
    return max(0, sample[5] - sample[7])


def busy_median(samples: list[tuple[float, int]]) -> float:
    """The median srtt of ``(srtt_us, tx_bytes)`` samples (not empty), over the busy ones:
    those that sent at least a quarter of the pair's mean a sample (an idle
    socket's srtt is stale). An even count averages the middle two, so the
    figure never depends on which of two samples carried a few more bytes."""
    floor = 0.25 * sum(w for _, w in samples) / len(samples)
    busy = sorted(v for v, w in samples if w >= floor)
    n = len(busy)
    mid = n // 2
    return busy[mid] if n % 2 else (busy[mid - 1] + busy[mid]) / 2.0


def figures(p: PairFlow) -> Flow:
    """The medians of ``p``'s window samples (computed only when the rule needs them)."""
    weighted: list[tuple[float, int]] = []
    newest: list[tuple[float, int]] = []
    cwnds: list[float] = []
    if p.samples:
        last = p.samples[-1]
        since = last[0] - 0.5 * last[1]  # the newest poll's samples
        for st, _dt, stx, _rx, srtt, _re, cwnd, *_ in p.samples:
            if srtt is not None:
                w = stx if stx > 0 else 1
                weighted.append((srtt, w))
                if st >= since:
                    newest.append((srtt, w))
            if cwnd is not None:
                cwnds.append(cwnd)
    elif p.srtt_us is not None:  # a matrix made by hand: its srtt is all there is
        weighted = newest = [(p.srtt_us, max(p.tx_bytes, 1))]
    return Flow(
        p.rank,
        p.peer,
        p.tx_bytes,
        p.retrans,
        busy_median(weighted) if weighted else None,
        busy_median(newest) if newest else None,
        median(cwnds) if cwnds else None,
        p.dsack_dups,
    )


def _srtt(p: Flow) -> float:
    return p.srtt_med_us or 0.0


def _newest(p: Flow) -> float:
    return p.srtt_new_us or p.srtt_med_us or 0.0


class NetView(NamedTuple):
    """Network scores of every rank, and the node and link hypotheses that pass, from one
    flow matrix.

    ``ratio``: each rank's node score; ``share``: its share of the window's
    retransmits (:func:`lost` ones; ``total_retrans`` of them, besides
    ``spurious`` D-SACKed ones); ``node``: rank -> what localised it (``"srtt"`` or
    ``"retrans"``); ``links``: carrier rank -> (other end, ``"srtt"`` or
    ``"retrans"``, the link's score).
    """

    ratio: dict[int, float]
    share: dict[int, float]
    touching: dict[int, list[Flow]]  # rank -> the active flows it sends or receives
    touching_us: dict[int, float]
    others_us: dict[int, float]
    ambiguous: bool
    all_median_us: float | None
    total_retrans: int
    node: dict[int, str]
    links: dict[int, tuple[int, str, float]]
    suppressed: frozenset[int] = frozenset()
    uses_base: bool = False  # some rank was judged against ``srtt_base``
    spurious: int = 0


def stall_explains(
    job_step: float | None, base: float | None, lates_sorted: list[float], min_effect: float
) -> bool:
    """Does one rank's late arrival explain the step's stretch (no network to blame)?

    ``lates_sorted``: every matched rank's lateness this step, ascending. The
    latest rank's excess over the others' median is time the others spent
    waiting for it, and a waiting receiver stretches its peers' srtt: data it
    has not asked for yet sits unread in its socket, the kernel delays the
    ACK until the application reads (or the delayed-ACK timer fires), and the
    sender's smoothed RTT takes that wait in. A polled ``tcp_info`` srtt sees
    it at its worst (the last ACK of a message sets the value the socket then
    idles with: 5-8 ms against 0.2 ms on loopback, on flows *to* the late rank
    and on flows to ranks waiting on it). So the step without that excess must
    itself be stretched (``min_effect``) before flows are blamed; a slow link
    or host delays data, and nobody arrives late (seen: 0.01-0.26 s of excess
    on 0.6-2.1 s of stretch in every lab network capture)."""
    if job_step is None or not base or len(lates_sorted) < 2:
        return False
    top = lates_sorted[-1]
    excess = top - median_without(lates_sorted, top)
    return job_step - excess < base * (1.0 + min_effect)


def window_s(base_step_s: float | None, interval_s: float | None, cfg: NetworkConfig) -> float:
    """Seconds of flow history the evidence covers: ``flow_window_steps`` baseline steps,
    never fewer than ``flow_floor_intervals`` probe intervals; ``flow_window_s``
    until both are known."""
    if not base_step_s or not interval_s:
        return cfg.flow_window_s
    return max(cfg.flow_window_steps * base_step_s, cfg.flow_floor_intervals * interval_s)


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), in log space (n may be thousands)."""
    if k <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    base = math.lgamma(n + 1)
    terms = [
        base - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
        for i in range(k, n + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(x - top) for x in terms))


def _others_median(
    everyone: list[float], mine: list[Flow], key: Callable[[Flow], float] | None = None
) -> float | None:
    """Median srtt (``key``: of which figure) of every active flow but ``mine``, from
    ``everyone``'s sorted figures (None when none is left)."""
    if len(mine) >= len(everyone):
        return None
    return median_without_all(everyone, list(map(key or _srtt, mine)))


def routed(flows: Sequence[PairFlow]) -> Sequence[PairFlow]:
    """The flows that crossed a network: all but the loopback ones.

    A loopback flow has no wire and no queue between its ends. Its srtt is how
    soon the receiving process was scheduled to take the data (and ACK it),
    and its retransmits are timers that fired while it was not. On a real
    4-rank loopback job slowed 27-44 % by the hypervisor's steal, one rank's
    flows showed 1.5-1.9x the others' srtt with half of ~50 spurious
    retransmits, and the rule named that rank's "network" as the cause.
    """
    if not any(p.loopback for p in flows):
        return flows
    return tuple(p for p in flows if not p.loopback)


def network_view(
    flows: Sequence[PairFlow],
    ranks: Sequence[int],
    srtt_base: float | None,
    cfg: NetworkConfig,
    flagged: frozenset[int] = frozenset(),
) -> NetView:
    flows = routed(flows)
    active = [
        f
        for f in map(figures, (p for p in flows if p.tx_bytes >= cfg.net_min_bytes))
        if f.srtt_med_us is not None
    ]
    ratio: dict[int, float] = {}
    touching_us: dict[int, float] = {}
    others_us: dict[int, float] = {}
    ambiguous = False
    uses_base = False
    unlocalised: list[int] = []
    everyone: list[float] = sorted(map(_srtt, active))
    touching: dict[int, list[Flow]] = {}
    between: dict[tuple[int, int], list[Flow]] = {}
    for p in active:
        touching.setdefault(p.rank, []).append(p)
        if p.peer != p.rank:
            touching.setdefault(p.peer, []).append(p)
        between.setdefault((min(p.rank, p.peer), max(p.rank, p.peer)), []).append(p)
    # A link's srtt: the median of its flows' (both directions): a slow host
    # is slow on every one of its links, its neighbour only on the link to it.
    link_us = {k: median(list(map(_srtt, v))) for k, v in between.items()}
    # The same from the newest poll alone: fresh but not robust, so it counts
    # only as strong evidence (``net_fast_ratio``), found a few samples sooner.
    link_new = {k: median(list(map(_newest, v))) for k, v in between.items()}
    newest: list[float] = sorted(map(_newest, active))
    links_of: dict[int, list[tuple[int, int]]] = {}
    for k in between:
        links_of.setdefault(k[0], []).append(k)
        links_of.setdefault(k[1], []).append(k)
    fast: dict[int, float] = {}
    for r in ranks:
        touch = touching.get(r)
        if not touch:
            continue
        mine_links = links_of[r]
        t_low = min(link_us[k] for k in mine_links)
        t_new = min(link_new[k] for k in mine_links)
        touching_us[r] = t_low
        o_med = _others_median(everyone, touch)
        if o_med is None:
            if not srtt_base:
                uses_base = True
                continue
            o_med = srtt_base
            ambiguous = True
            unlocalised.append(r)
        others_us[r] = o_med
        ratio[r] = t_low / o_med if o_med > 0 else 1.0
        # ... against the others' newest too: a fabric-wide change moves all at once.
        o_new = _others_median(newest, touch, _newest) if len(touch) < len(active) else o_med
        o_new = o_med if o_new is None else o_new
        fast[r] = t_new / o_new if o_new > 0 else 1.0
    # Ranks whose every flow touches them all see the same flows (two ranks):
    # name one, the one whose own sockets are slowest, and say it is a guess.
    suppressed: frozenset[int] = frozenset()
    if len(unlocalised) > 1:

        def own(r: int) -> float:
            mine = [_srtt(p) for p in active if p.rank == r]
            return median(mine) if mine else 0.0

        # A rank already flagged keeps the verdict, so the guess does not flip.
        keep = max(unlocalised, key=lambda r: (r in flagged, own(r), -r))
        suppressed = frozenset(r for r in unlocalised if r != keep)

    node = {
        r: "srtt"
        for r, x in ratio.items()
        if (x >= cfg.net_ratio or fast[r] >= cfg.net_fast_ratio) and r not in suppressed
    }
    # The one that touches all of it wins: a candidate with a neighbour that
    # scores higher (or is flagged already and still scores higher) shares its
    # slow link with the culprit, and is the culprit's neighbour.
    for r in sorted(node):
        for n in _neighbours(between, r):
            if n != r and (n in node or n in flagged) and ratio.get(n, 0.0) > ratio[r]:
                del node[r]
                break
    links: dict[int, tuple[int, str, float]] = {}
    if not ambiguous:
        _slow_links(between, touching, flagged, node, links, cfg)
    share, total_retrans = _retransmits(flows, ranks, between, node, links, suppressed, cfg)
    spurious = sum(p.retrans for p in flows) - total_retrans
    return NetView(
        ratio=ratio,
        share=share,
        touching=touching,
        touching_us=touching_us,
        others_us=others_us,
        ambiguous=ambiguous,
        all_median_us=job_srtt(flows, cfg),
        total_retrans=total_retrans,
        node=node,
        links=links,
        suppressed=suppressed,
        uses_base=uses_base or bool(unlocalised),
        spurious=spurious,
    )


def _slow_links(
    between: dict[tuple[int, int], list[Flow]],
    touching: dict[int, list[Flow]],
    flagged: frozenset[int],
    node: dict[int, str],
    links: dict[int, tuple[int, str, float]],
    cfg: NetworkConfig,
) -> None:
    """Links that stand out against every other candidate (into ``links``): their flows,
    both directions, slower than the rest of the job *and* than each end's
    other flows; a node candidate that such a link explains is not a node.
    Slow links sharing one end make that end a node (into ``node``)."""
    slow: list[tuple[int, int, float]] = []
    n_active = sum(map(len, between.values()))
    link_bytes = {k: sum(p.tx_bytes for p in v) for k, v in between.items()}
    min_bytes = cfg.link_min_share * median(list(link_bytes.values())) if between else 0.0
    # Every active flow's figures, sorted once: "the rest of the job" for each
    # link is these without the link's own (a copy per link was quadratic).
    everyone: list[float] | None = None
    everyone_new: list[float] = []
    for (a, b), mine in between.items():
        if len({(p.rank, p.peer) for p in mine}) < 2:
            continue  # data one way only: one flow is too little to blame a cable
        if link_bytes[(a, b)] < min_bytes:
            continue  # a side group's sparse traffic: nothing the job waits on
        if b in flagged and a not in flagged:
            # ``b`` (the end that does not carry a link verdict) is flagged as
            # a host already: the verdict stays put.
            continue
        ids = {id(p) for p in mine}
        rests = [[p for p in touching[end] if id(p) not in ids] for end in (a, b)]
        if len(mine) >= n_active or not all(rests):
            continue  # an end with no other flow: host or link cannot be told
        low = min(map(_srtt, mine))
        low_new = min(map(_newest, mine))
        # Against the whole job, and against each end's own other flows: a
        # host that is slow on all its links (even mildly) is no link's.
        # The ends are judged on the window's medians always (one poll's
        # sample of a host's other link can dip); the newest poll counts only
        # for the whole-job comparison, as strong evidence.
        ends_ok = all(low >= cfg.net_ratio * median(list(map(_srtt, r))) for r in rests)
        if not ends_ok:
            continue
        if everyone is None:
            everyone = sorted(_srtt(p) for v in between.values() for p in v)
            everyone_new = sorted(_newest(p) for v in between.values() for p in v)
        others_med = median_without_all(everyone, list(map(_srtt, mine)))
        others_new = median_without_all(everyone_new, list(map(_newest, mine)))
        by_median = low >= cfg.net_ratio * others_med
        by_newest = low_new >= cfg.net_fast_ratio * others_new and all(
            low_new >= cfg.net_ratio * median(list(map(_newest, r))) for r in rests
        )
        if by_median or by_newest:
            worst_end = max(median(list(map(_srtt, r))) for r in rests)
            slow.append((a, b, low / worst_end if worst_end > 0 else 1.0))
    ends: dict[int, int] = {}
    for a, b, _ in slow:
        ends[a] = ends.get(a, 0) + 1
        ends[b] = ends.get(b, 0) + 1
    shared = {r for r, n in ends.items() if n >= 2}
    if len(shared) == 1:  # the one end all of them touch wins: a node
        (r,) = shared
        node[r] = "srtt"
    for a, b, score in slow:
        if shared & {a, b}:
            continue
        # The link explains its ends' slow flows: neither end is a host to blame.
        node.pop(a, None)
        node.pop(b, None)
        links[a] = (b, "srtt", score)


def _retransmits(
    flows: Sequence[PairFlow],
    ranks: Sequence[int],
    between: dict[tuple[int, int], list[Flow]],
    node: dict[int, str],
    links: dict[int, tuple[int, str, float]],
    suppressed: frozenset[int],
    cfg: NetworkConfig,
) -> tuple[dict[int, float], int]:
    """Each rank's share of the window's retransmits, and the node or link they localise
    (into ``node`` / ``links``) when one rank, or one pair of ranks, alone carries them.

    The case must hold without the window's largest single sample (one flow's
    one poll) of retransmits, as a flow's srtt is judged by its median and not
    by one sample: a lossy host or cable loses all along, while one burst (a
    queue overflowing once) carries a window's share on its own."""
    total = sum(map(lost, flows))
    if not total:
        return {}, 0
    re_touch: dict[int, int] = {}
    bytes_touch: dict[int, int] = {}
    burst_touch: dict[int, int] = {}
    all_bytes = 0
    for p in flows:
        n = lost(p)
        burst = max(map(_lost_in, p.samples), default=0) if n else 0
        for r in (p.rank, p.peer) if p.peer != p.rank else (p.rank,):
            re_touch[r] = re_touch.get(r, 0) + n
            bytes_touch[r] = bytes_touch.get(r, 0) + p.tx_bytes
            if burst > burst_touch.get(r, 0):
                burst_touch[r] = burst
        all_bytes += p.tx_bytes
    share = {r: re_touch.get(r, 0) / total for r in ranks if r in re_touch}
    if total < cfg.retrans_min or len(ranks) < 3 or not all_bytes:
        return share, total

    def localised(k: int, byte_share: float, burst: int, of: int = total) -> bool:
        """``k`` of ``of`` retransmits (the window's) on flows carrying ``byte_share`` of
        their bytes are enough, unlikely by chance, with and without the largest
        sample ``burst``."""
        return all(
            n >= cfg.retrans_min
            and m >= cfg.retrans_share * n
            and binomial_tail(m, n, min(byte_share, 1.0)) <= cfg.retrans_p
            for m, n in ((k, of), (k - burst, of - burst))
        )

    high = sorted(
        (r for r, x in share.items() if x >= cfg.retrans_share and r not in suppressed),
        key=lambda r: (-share[r], r),
    )
    if not high:
        return share, total
    top = high[0]
    if not localised(re_touch[top], bytes_touch[top] / all_bytes, burst_touch.get(top, 0)):
        return share, total
    if len(high) == 1:
        node.setdefault(top, "retrans")
    elif len(high) == 2:
        a, b = sorted(high)
        mine = between.get((a, b), [])
        on_link = sum(map(lost, mine))
        link_bytes = sum(p.tx_bytes for p in mine)
        if (
            a not in node
            and b not in node
            and localised(on_link, link_bytes / all_bytes, _largest_sample(flows, a, b))
        ):
            # The end that resent (nearly) all of them carries the case: its
            # packets are the ones lost. A lossy host's losses fall on the
            # link its ring traffic takes in one window and on all of its
            # links in the next, so its link and node windows name the same
            # rank, and persistence can count them together (named by its
            # lower rank, the link window named the host's peer instead, and
            # every other window flipped the candidate: regress-packet-loss-
            # flipping-link-and-node). Resent both ways, the lower rank.
            sent_b = sum(lost(p) for p in mine if p.rank == b)
            if on_link and sent_b >= cfg.retrans_share * on_link:
                a, b = b, a
            links.setdefault(a, (b, "retrans", on_link / total))
        elif _off_link_localised(flows, top, a + b - top, localised):
            # The link between the two does not carry the case, and ``top``
            # does (localised above), and so do its losses off that link: a
            # lossy host's ring traffic put 79 % of a window's losses on one
            # of its links and the rest on another, the link failed without
            # its largest sample, no hypothesis was left, and the window broke
            # the run of bad windows that flags the host (a CI run missed a
            # 10 % lossy host for all six of its steps). A lossy link's ends
            # lose nothing else but the background, which never localises.
            node.setdefault(top, "retrans")
    return share, total


def _off_link_localised(
    flows: Sequence[PairFlow], top: int, other: int, localised: Callable[..., bool]
) -> bool:
    """Are the retransmits off the ``top``-``other`` link localised to ``top``: enough of
    them on its other flows, unlikely by chance for the bytes those carry?"""
    link = {top, other}
    k = n = mine_bytes = all_bytes = burst = 0
    for p in flows:
        if {p.rank, p.peer} == link:
            continue
        m = lost(p)
        n += m
        all_bytes += p.tx_bytes
        if top in (p.rank, p.peer):
            k += m
            mine_bytes += p.tx_bytes
            if m:
                burst = max(burst, max(map(_lost_in, p.samples), default=0))
    return bool(all_bytes) and localised(k, mine_bytes / all_bytes, burst, n)


def _largest_sample(flows: Sequence[PairFlow], a: int, b: int) -> int:
    """The most retransmits one sample of a flow between ``a`` and ``b`` carries."""
    return max(
        (_lost_in(x) for p in flows if {p.rank, p.peer} == {a, b} for x in p.samples), default=0
    )


def _neighbours(between: dict[tuple[int, int], list[Flow]], r: int) -> list[int]:
    return [b if a == r else a for a, b in between if r in (a, b)]


def job_srtt(flows: Sequence[PairFlow], cfg: NetworkConfig) -> float | None:
    """The median byte-weighted srtt of the active flows: the job's srtt, whose history
    (in unstretched steps) is the reference when every flow touches a rank."""
    srtts = routed_srtts(flows, cfg.net_min_bytes)
    return float(median_sorted(srtts)) if len(srtts) else None


def quiet_view(flows: Sequence[PairFlow], cfg: NetworkConfig) -> NetView:
    """The view of a step the rule need not judge (the job is not stretched and no rank
    is flagged ``network``): the job's srtt only, none of the medians."""
    return NetView({}, {}, {}, {}, {}, False, job_srtt(flows, cfg), 0, {}, {})


def network_view_memo(
    memo: tuple[Any, ...],
    flows: Sequence[PairFlow],
    ranks: tuple[int, ...],
    srtt_base: float | None,
    cfg: NetworkConfig,
    flagged: frozenset[int],
    judge: bool = True,
) -> tuple[NetView, tuple[Any, ...]]:
    """:func:`network_view` (or, unless ``judge``, :func:`quiet_view`), or the view kept
    in ``memo`` when its inputs are equal."""
    key = (flows, ranks, flagged, cfg, judge)
    if memo and memo[0] == key:
        view: NetView = memo[2]
        if not view.uses_base or memo[1] == srtt_base:
            return view, memo
    view = network_view(flows, ranks, srtt_base, cfg, flagged) if judge else quiet_view(flows, cfg)
    return view, (key, srtt_base, view)


def memo_view(memo: tuple[Any, ...]) -> NetView | None:
    """The view kept in a :func:`network_view_memo` memo: the last one computed
    (None before the first)."""
    return memo[2] if memo else None


def excess_us(rank: int, net: NetView) -> float:
    """How far the srtt of the flows touching ``rank`` is above the others' (us)."""
    touching, others = net.touching_us.get(rank), net.others_us.get(rank)
    if touching is None or others is None:
        return 0.0
    return touching - others


def _link_of(rank: int, net: NetView) -> tuple[int, str, float] | None:
    """The link ``rank`` carries, unless it is blamed as a node."""
    return net.links.get(rank) if rank not in net.node else None


def score_of(rank: int, net: NetView) -> float:
    """The score of the case against ``rank``: its link's, when it carries a link
    verdict and is no node, else its node score."""
    link = _link_of(rank, net)
    return link[2] if link is not None else net.ratio.get(rank, 1.0)


def stands_beside(rank: int, net: NetView, cfg: NetworkConfig) -> bool:
    """Does the case against ``rank`` stand beside another rank that explains the job's
    stretch already (late, or lossy)? The ranks waiting on that one show their
    delayed ACKs, up to ~1.9x srtt and ~1.3 ms above the others' in the lab,
    so both the queueing (``explained_excess_us``) and the score
    (``net_fast_ratio``, strong evidence) must exceed what waiting shows."""
    return (
        excess_us(rank, net) >= cfg.explained_excess_us
        and score_of(rank, net) >= cfg.net_fast_ratio
    )


def is_candidate(rank: int, net: NetView, held: bool, cfg: NetworkConfig) -> bool:
    """Does the view blame ``rank``: as a node, or as the carrier of a link? (the job's
    stretch is checked by the caller). ``held``: it is flagged ``network`` already,
    and stays a candidate while its node score holds ``net_hold_ratio``
    (hysteresis: a mild straggler's noisy score must not flap the verdict)."""
    if rank in net.node or rank in net.links:
        return True
    return held and net.ratio.get(rank, 0.0) >= cfg.net_hold_ratio


def _flow(p: Flow) -> dict[str, Any]:
    return {
        "from": p.rank,
        "to": p.peer,
        "srtt_us": rnd(p.srtt_med_us, 1),
        "retrans": p.retrans,
        **({"dsack_dups": p.dsack_dups} if p.dsack_dups else {}),
        "tx_bytes": p.tx_bytes,
        **({"cwnd": rnd(p.cwnd, 1)} if p.cwnd is not None else {}),
    }


def evidence(
    rs: RankStep, relative: float | None, net: NetView, stretch: float | None
) -> tuple[float, dict[str, Any], int | None]:
    """Score, evidence and peer rank of a new ``network`` verdict.

    ``scope`` is ``node`` (check the host) or ``link`` (check the cable, port
    or switch path between ``rank`` and ``peer_rank``); ``flows`` lists the
    flows that carried the case, slowest first.
    """
    rank = rs.rank
    ratio = net.ratio.get(rank, 1.0)
    link = _link_of(rank, net)
    score = score_of(rank, net)
    peer: int | None
    if link is not None:
        peer, why, _ = link
        a, b = min(rank, peer), max(rank, peer)
        carried = [p for p in net.touching.get(rank, []) if {p.rank, p.peer} == {a, b}]
    else:
        why = net.node.get(rank, "srtt")
        carried = list(net.touching.get(rank, []))
        peer = worst_peer(net, rank) if carried else None
    carried.sort(key=lambda p: (-_srtt(p), -p.retrans, p.rank, p.peer))
    ev: dict[str, Any] = {
        "scope": "link" if link is not None else "node",
        "by": why,
        "srtt_ratio": rnd(ratio),
        "srtt_us_touching": rnd(net.touching_us.get(rank), 1),
        "srtt_us_others": rnd(net.others_us.get(rank), 1),
        "retrans_share": rnd(net.share.get(rank)),
        "retrans": net.total_retrans,
        **({"retrans_spurious": net.spurious} if net.spurious else {}),
        "stretch": rnd(stretch),
        "relative": rnd(relative),
        "flows": [_flow(p) for p in carried[:8]],
    }
    if link is not None:
        ev["link_score"] = rnd(score)
    if net.ambiguous:
        ev["unsure"] = "every flow touches this rank: cannot tell which end is slow"
        ev["candidates"] = sorted({rank, *net.suppressed})
    return score, ev, peer


def worst_peer(net: NetView, rank: int) -> int:
    """The other end of the slowest active flow touching ``rank`` (ties: lowest ranks)."""
    _s, top_rank, top_peer = max((_srtt(p), -p.rank, -p.peer) for p in net.touching[rank])
    return -top_peer if -top_rank == rank else -top_rank
