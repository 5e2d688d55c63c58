"""Detect: from correlated summaries to straggler verdicts (pure; no I/O, no clock).

:func:`detect` takes one :class:`~fsdp_sentinel.correlate.Summary` (a completed
step, or a clock tick), the previous :class:`DetectState` and a
:class:`DetectConfig`, and returns a :class:`Report` holding the scores, the
verdict records to emit and the next state. The input state is never changed,
so the same summaries in the same order always give the same verdicts: live,
in replay and in tests.

Causes, and the evidence each needs (docs/detection.md has the long form):

* ``compute``: the rank arrives last at its collectives. Its lateness beyond
  the median of its peers, as a share of the step it would take without it,
  is at least ``min_effect`` over a rolling window.
* ``network``: the job's step time stretched by at least ``min_effect``
  against its own history while nobody arrives late, and the flows touching
  the rank (sent by it *or* to it: a slow host delays its own data and the
  ACKs it returns) show a higher srtt than flows not touching it, or carry
  most of the retransmits.
* ``rank_lost``: its records stopped and all its connections were closed or
  reset while the job was inside a step (or, between steps, it reset some of
  them: a process that dies does, one that exits in order does not), or it
  has been silent for a long time while the others carried on.

A change counts only when it persists: a rank is flagged after
``flag_after`` consecutive bad windows and cleared after ``clear_after``
clean ones, so a one-step spike (a GC pause, a burst of jitter) never is.
"""

from __future__ import annotations

import json
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import repeat
from operator import attrgetter, sub
from pathlib import Path
from typing import Any, NamedTuple

import tomllib

from fsdp_sentinel.correlate import PairFlow, RankLiveness, RankStep, Summary

CAUSES = ("compute", "network", "rank_lost")

_SRTT = attrgetter("srtt_us")


@dataclass(frozen=True)
class DetectConfig:
    """Thresholds of the detector; all in one place, swappable while running.

    ``min_effect``: smallest effect on step time that counts (0.10 = 10 %).
    ``noise_k``: on a noisy machine the bar rises to ``noise_k`` robust
    standard deviations of the relative score seen in quiet steps, counted
    ``noise_lag`` steps late.
    ``individual_share``: when above 0, a compute flag also needs the rank's
    own compute to have grown by this share of the bar against its own
    history (when it has one). Off by default: on a shared machine every
    rank's own history drifts with the load, which hid real stalls.
    ``sustained_window`` / ``sustained_share``: a smaller compute effect also
    counts when the median relative score over the last ``sustained_window``
    steps reaches ``sustained_share`` of the bar (never under
    ``min_effect``); 0 turns this off.
    ``window``: steps in the rolling window whose median is scored.
    ``flag_after`` / ``clear_after``: consecutive bad / clean windows before a
    rank is flagged / cleared. ``history`` / ``min_history``: steps of own
    history kept / needed for the individual and baseline figures.
    ``net_ratio``: srtt of flows touching a rank over srtt of flows not
    touching it that counts as localised. ``net_min_bytes``: bytes a pair must
    send in the flow window to count. ``retrans_min`` / ``retrans_share``:
    retransmits in the window, and the share of them on a rank's flows, that
    localise a problem to it. ``lost_grace_s``: silence after its connections
    were torn before a rank is lost; ``lost_silence_s`` /
    ``lost_silence_steps``: silence (the larger of seconds and baseline steps)
    while others carry on. ``baseline_adapt_steps``: after this many stretched
    steps with nobody to blame, the new step time becomes the baseline.
    ``flow_window_s``: how much flow history the matrix covers; ``tick_s``:
    stream seconds between liveness checks.
    """

    min_effect: float = 0.10
    noise_k: float = 3.0
    noise_lag: int = 6
    individual_share: float = 0.0
    sustained_share: float = 0.6
    sustained_window: int = 9
    window: int = 3
    flag_after: int = 2
    clear_after: int = 3
    history: int = 30
    min_history: int = 5
    net_ratio: float = 1.5
    net_min_bytes: int = 65536
    retrans_min: int = 8
    retrans_share: float = 0.75
    lost_grace_s: float = 0.5
    lost_silence_s: float = 5.0
    lost_silence_steps: float = 5.0
    baseline_adapt_steps: int = 50
    flow_window_s: float = 3.0
    tick_s: float = 0.5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = float if f.type in ("float", float) else int
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"config {f.name}: expected a number, got {value!r}")
            if kind is int and not isinstance(value, int):
                raise ValueError(f"config {f.name}: expected an integer, got {value!r}")
            if value < 0:
                raise ValueError(f"config {f.name}: must be >= 0, got {value!r}")
        if self.window < 1 or self.flag_after < 1 or self.clear_after < 1:
            raise ValueError("config window, flag_after and clear_after must be >= 1")

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str = "config") -> DetectConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown setting(s): {', '.join(unknown)}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e

    @classmethod
    def from_file(cls, path: str | Path) -> DetectConfig:
        """Read a JSON or TOML file (by suffix) of settings; a missing key keeps its default.

        A TOML file may hold the settings at top level or under ``[detect]``.
        """
        p = Path(path)
        text = p.read_text()
        try:
            data: Any = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"{p}: not valid {p.suffix.lstrip('.') or 'JSON'}: {e}") from e
        if isinstance(data, dict) and isinstance(data.get("detect"), dict):
            data = data["detect"]
        if not isinstance(data, dict):
            raise ValueError(f"{p}: expected an object of settings")
        return cls.from_mapping(data, str(p))

    def with_(self, **changes: Any) -> DetectConfig:
        return replace(self, **changes)


class RankTrack(NamedTuple):
    """One rank's rolling figures between reports (part of :class:`DetectState`)."""

    rel: tuple[float, ...] = ()
    ind: tuple[float, ...] = ()
    compute_hist: tuple[float, ...] = ()
    bad: int = 0
    clean: int = 0
    cause: str | None = None
    flagged_step: int | None = None
    rel_long: tuple[float, ...] = ()  # the last ``sustained_window`` relative scores
    compute_sorted: tuple[float, ...] = ()  # ``compute_hist`` in ascending order


@dataclass(frozen=True)
class DetectState:
    """Everything :func:`detect` remembers; a new one comes back in each :class:`Report`.

    ``lost`` maps a rank flagged ``rank_lost`` to the ``last_t`` it had then.
    """

    tracks: dict[int, RankTrack] = field(default_factory=dict)
    job_recent: tuple[float, ...] = ()
    job_hist: tuple[float, ...] = ()
    stretched: int = 0
    srtt_hist: tuple[float, ...] = ()
    rel_noise: tuple[float, ...] = ()
    rel_lag: tuple[tuple[bool, tuple[float, ...]], ...] = ()
    lost: dict[int, float] = field(default_factory=dict)
    # The last flow matrix's network view, reused while the matrix and what it
    # was judged with are unchanged (steps come faster than flow samples).
    net_memo: tuple[Any, ...] = ()


class RankScore(NamedTuple):
    """One rank's scores in one report.

    ``relative``: median over the last ``window`` steps of its lateness beyond
    the median lateness of its peers, divided by the step time without that
    lateness: the share by which this rank alone stretches the step (0.25 =
    the job would be 25 % faster without the wait for it).
    ``individual``: its compute time now minus the median of its own compute
    history, over the baseline step time (how much slower it computes than it
    used to; None without enough history).
    ``network``: lowest srtt of the flows touching it (both directions) over
    the median srtt of flows not touching it (None without flows; with only
    flows touching it, against the job's srtt baseline, and then ambiguous).
    ``retrans_share``: share of the window's retransmits on flows touching it.
    ``candidate``: the cause it looks like in this report before persistence;
    ``state``/``cause``: its open verdict after this report.
    """

    rank: int
    relative: float | None
    individual: float | None
    network: float | None
    retrans_share: float | None
    late_s: float | None
    compute_s: float | None
    wait_s: float | None
    last_frac: float | None
    candidate: str | None
    state: str
    cause: str | None


class Report(NamedTuple):
    """The detector's answer to one summary.

    ``job_step_s``: median step time over ranks in this step;
    ``baseline_step_s``: median job step time of the unstretched history;
    ``stretch``: median job step over the window / baseline - 1 (None without
    a baseline). ``bar``: the relative score a compute flag needs now
    (``min_effect``, or more on a noisy machine; None while warming up). ``verdicts``: trace-v1 ``verdict`` records, in rank order.
    """

    t: float
    step: int | None
    job_step_s: float | None
    baseline_step_s: float | None
    stretch: float | None
    bar: float | None
    scores: tuple[RankScore, ...]
    verdicts: tuple[dict[str, Any], ...]
    state: DetectState


def _median(xs: Sequence[float]) -> float:
    return _median_sorted(sorted(xs))


def _median_without(ordered: list[float], value: float) -> float:
    """The median of sorted ``ordered`` with one occurrence of ``value`` left out.

    Equals ``_median`` of that shorter list (the same elements are read), in
    O(log n) instead of a copy and a sort per rank.
    """
    i = bisect_left(ordered, value)  # the left-out value's place: later ones shift down
    n = len(ordered) - 1
    mid = n // 2
    upper = ordered[mid] if mid < i else ordered[mid + 1]
    if n % 2:
        return upper
    lower = ordered[mid - 1] if mid - 1 < i else ordered[mid]
    return (lower + upper) / 2.0


def _median_sorted(ordered: Sequence[float]) -> float:
    """``_median`` of values already in ascending order (no copy, no sort)."""
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def _mad(xs: Sequence[float]) -> float:
    """The median absolute deviation from the median of ``xs`` (not empty).

    Sorted once: the deviations of the values below the median, read from the
    median outwards, and of those above it, are two ascending runs, which
    ``sorted`` merges in one linear pass instead of sorting them afresh.
    """
    s = sorted(xs)
    med = _median_sorted(s)
    cut = bisect_left(s, med)
    # med - x is exactly -(x - med), so these are the values abs(x - med) gives.
    devs = sorted([*map(sub, repeat(med), reversed(s[:cut])), *map(sub, s[cut:], repeat(med))])
    return _median_sorted(devs)


def _push(hist: tuple[float, ...], value: float, keep: int) -> tuple[float, ...]:
    return (hist + (value,))[-keep:]


def _push_sorted(
    hist: tuple[float, ...], ordered: tuple[float, ...], value: float, keep: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``_push`` onto ``hist``, and the same change to ``ordered`` (``hist`` sorted).

    Keeping the sorted copy makes a long history's median a lookup instead of
    a sort every step.
    """
    new = (hist + (value,))[-keep:]
    lst = list(ordered)
    for old in hist[: len(hist) + 1 - len(new)]:  # the values that fell out
        del lst[bisect_left(lst, old)]
    insort(lst, value)
    return new, tuple(lst)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _host(summary: Summary, rank: int) -> str:
    """The host a rank runs on, for a verdict (looked up only when one is made)."""
    return next((lv.host for lv in summary.liveness if lv.rank == rank), "")


_NEW_TRACK = RankTrack()


def _verdict(
    t: float,
    step: int,
    rank: int,
    state: str,
    cause: str,
    score: float,
    host: str,
    evidence: dict[str, Any],
    peer_rank: int | None = None,
) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "kind": "verdict",
        "t": round(t, 6),
        "step": step,
        "rank": rank,
        "state": state,
        "cause": cause,
        "score": round(score, 4),
    }
    if host:
        rec["host"] = host
    if peer_rank is not None:
        rec["peer_rank"] = peer_rank
    rec["evidence"] = evidence
    return rec


class _NetView(NamedTuple):
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


def _network_view(
    flows: tuple[PairFlow, ...],
    ranks: Sequence[int],
    srtt_base: float | None,
    cfg: DetectConfig,
    flagged: frozenset[int] = frozenset(),
) -> _NetView:
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
            o_med = _median_sorted(rest)
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
            return _median(mine) if mine else 0.0

        # A rank already flagged keeps the verdict, so the guess does not flip.
        keep = max(unlocalised, key=lambda r: (r in flagged, own(r), -r))
        suppressed = frozenset(r for r in unlocalised if r != keep)
    return _NetView(
        uses_base=uses_base or bool(unlocalised),
        suppressed=suppressed,
        ratio=ratio,
        share=share,
        touching=touching,
        touching_us=touching_us,
        others_us=others_us,
        ambiguous=ambiguous,
        all_median_us=_median_sorted(everyone) if everyone else None,
        total_retrans=total_retrans,
        sent_share=sent_share,
    )


def _network_view_memo(
    memo: tuple[Any, ...],
    flows: tuple[PairFlow, ...],
    ranks: tuple[int, ...],
    srtt_base: float | None,
    cfg: DetectConfig,
    flagged: frozenset[int],
) -> tuple[_NetView, tuple[Any, ...]]:
    """:func:`_network_view`, or the view kept in ``memo`` when its inputs are equal."""
    key = (flows, ranks, flagged, cfg.net_min_bytes)
    if memo and memo[0] == key:
        view: _NetView = memo[2]
        if not view.uses_base or memo[1] == srtt_base:
            return view, memo
    view = _network_view(flows, ranks, srtt_base, cfg, flagged)
    return view, (key, srtt_base, view)


def detect(summary: Summary, state: DetectState, config: DetectConfig) -> Report:
    """Score one summary against the state so far; return the report and the next state."""
    cfg = config
    verdicts: list[dict[str, Any]] = []
    base = _median(state.job_hist) if len(state.job_hist) >= cfg.min_history else None

    lost, lost_verdicts = _judge_lost(summary, state, cfg, base)
    if summary.step is None:
        verdicts.extend(lost_verdicts)
        return Report(
            t=summary.t,
            step=None,
            job_step_s=None,
            baseline_step_s=base,
            stretch=None,
            bar=None,
            scores=(),
            verdicts=tuple(sorted(verdicts, key=lambda v: v["rank"])),
            state=state if lost == state.lost else replace(state, lost=lost),
        )

    step = summary.step
    tracks = dict(state.tracks)
    present = [rs for rs in summary.ranks if rs.rank not in lost]
    steps = [rs.step_s for rs in present if rs.step_s is not None]
    job_step = _median(steps) if steps else None
    job_recent = state.job_recent
    if job_step is not None:
        job_recent = _push(job_recent, job_step, cfg.window)
    stretch = (_median(job_recent) / base - 1.0) if (base and job_recent) else None

    net, net_memo = _network_view_memo(
        state.net_memo,
        summary.flows,
        tuple(rs.rank for rs in present),
        _median(state.srtt_hist) if state.srtt_hist else None,
        cfg,
        frozenset(r for r, tr in tracks.items() if tr.cause == "network"),
    )
    lates = {rs.rank: rs.late_s for rs in present if rs.matched}
    lates_sorted = sorted(lates.values())
    bar = cfg.min_effect
    if len(state.rel_noise) >= 2 * cfg.min_history:
        bar = max(bar, cfg.noise_k * 1.4826 * _mad(state.rel_noise))
    rel_seen: list[float] = []
    suspect = False
    warm = len(state.rel_noise) >= 2 * cfg.min_history
    ref_step = job_step if job_step is not None else base
    scores: list[RankScore] = []
    any_candidate = False
    need = (cfg.window + 1) // 2  # scores in the window before it has a median
    low = max(cfg.min_effect, cfg.sustained_share * bar)  # the sustained rule's bar
    for rs in present:
        tr = tracks.get(rs.rank)
        if tr is None:
            tr = _NEW_TRACK
        rel_now: float | None = None
        if ref_step and rs.matched and len(lates) >= 2:
            excess = rs.late_s - _median_without(lates_sorted, rs.late_s)
            rel_now = excess / max(ref_step - rs.late_s, 0.1 * ref_step, 1e-9)
        rel_hist = _push(tr.rel, rel_now, cfg.window) if rel_now is not None else tr.rel
        relative = _median(rel_hist) if len(rel_hist) >= need else None
        ind_now = None
        if rs.compute_s is not None and len(tr.compute_hist) >= cfg.min_history and base:
            ind_now = (rs.compute_s - _median_sorted(tr.compute_sorted)) / base
        ind_hist = _push(tr.ind, ind_now, cfg.window) if ind_now is not None else tr.ind
        individual = _median(ind_hist) if len(ind_hist) >= need and ind_now is not None else None
        if rel_now is not None:
            rel_seen.append(rel_now)
        if relative is not None and relative >= cfg.min_effect:
            suspect = True

        # A smaller effect counts when it lasts: the median over a longer
        # window (``sustained_window`` steps, robust to dips and to bursts
        # alike) against a lower bar. A median of n steps spreads about
        # sqrt(pi / 2n) of one step, so 9 steps need ~0.6 of the 3-step bar.
        rel_long = tr.rel_long
        sustained = False
        if cfg.sustained_window:
            if rel_now is not None:
                rel_long = _push(rel_long, rel_now, cfg.sustained_window)
            if len(rel_long) >= cfg.sustained_window:
                sustained = _median(rel_long) >= low
        # Hysteresis: a compute flag holds while the window stays above the
        # lower bar, and clears once under it (the long median would hold a
        # recovered rank for half its window).
        if relative is None:
            slow = False
        elif tr.cause == "compute":
            slow = relative >= (low if cfg.sustained_window else bar)
        else:
            slow = relative >= bar or sustained
        candidate: str | None = None
        if (
            warm
            and relative is not None
            and slow
            and (individual is None or individual >= cfg.individual_share * bar)
        ):
            candidate = "compute"
        elif (
            stretch is not None
            and stretch >= cfg.min_effect
            and rs.rank in net.ratio
            and rs.rank not in net.suppressed
        ):
            localised = net.ratio[rs.rank] >= cfg.net_ratio
            if not localised and len(present) >= 3 and net.total_retrans >= cfg.retrans_min:
                # Both ends of a lossy flow touch it; the sender's socket counts
                # the retransmits, so of the two it is the sender that is named.
                share = net.share.get(rs.rank, 0.0)
                localised = (
                    share >= cfg.retrans_share and net.sent_share.get(rs.rank, 0.0) >= share / 2
                )
            if localised:
                candidate = "network"
        if candidate is not None:
            any_candidate = True

        informative = rel_now is not None or candidate is not None
        bad, clean = tr.bad, tr.clean
        if candidate is not None:
            bad, clean = bad + 1, 0
        elif informative or stretch is not None:
            bad, clean = 0, clean + 1
        cause, flagged_step = tr.cause, tr.flagged_step
        compute_hist, compute_sorted = tr.compute_hist, tr.compute_sorted
        if (
            candidate is None
            and cause is None
            and rs.compute_s is not None
            and (rel_now is None or rel_now < bar)
        ):
            compute_hist, compute_sorted = _push_sorted(
                compute_hist, compute_sorted, rs.compute_s, cfg.history
            )

        if cause is None and candidate is not None and bad >= cfg.flag_after:
            cause, flagged_step = candidate, step
            score, evidence, peer = _evidence(candidate, rs, relative, individual, net, stretch)
            if candidate == "compute" and relative is not None and relative < bar:
                # Found by the sustained rule: say so, with what it compared.
                evidence["sustained"] = _r(_median(rel_long))
                evidence["bar"] = _r(bar)
            evidence["job_step_s"] = _r(job_step)
            evidence["baseline_step_s"] = _r(base)
            verdicts.append(
                _verdict(
                    summary.t,
                    step,
                    rs.rank,
                    "flagged",
                    cause,
                    score,
                    _host(summary, rs.rank),
                    evidence,
                    peer,
                )
            )
        elif cause is not None and candidate is None and clean >= cfg.clear_after:
            verdicts.append(
                _verdict(
                    summary.t,
                    step,
                    rs.rank,
                    "cleared",
                    cause,
                    (relative or 0.0) if cause == "compute" else net.ratio.get(rs.rank, 0.0),
                    _host(summary, rs.rank),
                    {"clean_steps": clean, "flagged_step": flagged_step},
                )
            )
            cause, flagged_step = None, None
        # Positional, in field order: a NamedTuple called with keywords takes
        # twice as long, and this runs for every rank of every step.
        tracks[rs.rank] = RankTrack(
            rel_hist,
            ind_hist,
            compute_hist,
            bad,
            clean,
            cause,
            flagged_step,
            rel_long,
            compute_sorted,
        )
        matched = rs.matched
        scores.append(
            RankScore(
                rs.rank,
                relative,
                individual,
                net.ratio.get(rs.rank),  # network
                net.share.get(rs.rank),  # retrans_share
                rs.late_s if matched else None,
                rs.compute_s,
                rs.wait_s,
                rs.last_frac if matched else None,
                candidate,
                "flagged" if cause else "ok",  # state
                cause,
            )
        )

    # Baseline: the job's step time while it is not stretched; a stretch that
    # lasts with nobody to blame becomes the new normal.
    job_hist, stretched = state.job_hist, state.stretched
    if job_step is not None:
        if base is None or job_step <= base * (1.0 + cfg.min_effect):
            job_hist = _push(job_hist, job_step, cfg.history)
            stretched = 0
        else:
            stretched += 1
            open_verdict = any(t.cause for t in tracks.values())
            if stretched >= cfg.baseline_adapt_steps and not open_verdict and not any_candidate:
                job_hist, stretched = job_recent, 0
    srtt_hist = state.srtt_hist
    if net.all_median_us is not None and (stretch is None or stretch < cfg.min_effect):
        srtt_hist = _push(srtt_hist, net.all_median_us, cfg.history)

    # Noise of the relative score: what a clean step looks like on this
    # machine. A step's scores join the pool only ``noise_lag`` steps later,
    # and only if nothing was suspect then and nobody is flagged now, so the
    # onset of a real straggler cannot raise the bar before it is flagged.
    rel_noise = state.rel_noise
    rel_lag = state.rel_lag
    if base is not None and not warm:
        # Warming up: every step counts at once (a median is robust to one
        # odd rank), so detection starts a few steps after the baseline.
        rel_noise = rel_noise + tuple(rel_seen)
    elif base is not None:
        rel_lag = (*rel_lag, (suspect or any_candidate, tuple(rel_seen)))
        if len(rel_lag) > cfg.noise_lag:
            (was_suspect, values), rel_lag = rel_lag[0], rel_lag[1:]
            if not was_suspect and not any(t.cause for t in tracks.values()):
                rel_noise = (rel_noise + values)[-4 * cfg.history :]

    verdicts.extend(lost_verdicts)
    new_state = DetectState(
        rel_noise=rel_noise,
        rel_lag=rel_lag,
        tracks=tracks,
        job_recent=job_recent,
        job_hist=job_hist,
        stretched=stretched,
        srtt_hist=srtt_hist,
        lost=lost,
        net_memo=net_memo,
    )
    return Report(
        t=summary.t,
        step=step,
        job_step_s=job_step,
        baseline_step_s=base,
        stretch=stretch,
        bar=bar if warm else None,
        scores=tuple(scores),
        verdicts=tuple(sorted(verdicts, key=lambda v: (v["rank"], v["cause"]))),
        state=new_state,
    )


def _evidence(
    cause: str,
    rs: RankStep,
    relative: float | None,
    individual: float | None,
    net: _NetView,
    stretch: float | None,
) -> tuple[float, dict[str, Any], int | None]:
    """Score, evidence dict and peer rank of a new flagged verdict."""
    if cause == "compute":
        ev: dict[str, Any] = {
            "relative": _r(relative),
            "individual": _r(individual),
            "late_s": _r(rs.late_s),
            "arrived_last_frac": _r(rs.last_frac, 3),
            "compute_s": _r(rs.compute_s),
            "wait_s": _r(rs.wait_s),
        }
        if rs.last_frac == 0.0:
            ev["unsure"] = "late in sum, yet never the last to arrive at a collective"
        if net.ratio.get(rs.rank, 1.0) >= 1.5:
            ev["also_network"] = _r(net.ratio[rs.rank])
        return relative or 0.0, ev, None
    ratio = net.ratio.get(rs.rank, 1.0)
    ev = {
        "srtt_ratio": _r(ratio),
        "srtt_us_touching": _r(net.touching_us.get(rs.rank), 1),
        "srtt_us_others": _r(net.others_us.get(rs.rank), 1),
        "retrans_share": _r(net.share.get(rs.rank)),
        "retrans": net.total_retrans,
        "stretch": _r(stretch),
        "relative": _r(relative),
    }
    if net.ambiguous:
        ev["unsure"] = "every flow touches this rank: cannot tell which end is slow"
        ev["candidates"] = sorted({rs.rank, *net.suppressed})
    return ratio, ev, _worst_peer(net, rs.rank)


def _worst_peer(net: _NetView, rank: int) -> int:
    """The other end of the slowest active flow touching ``rank`` (ties: lowest ranks)."""
    _s, top_rank, top_peer = max((p.srtt_us, -p.rank, -p.peer) for p in net.touching[rank])
    return -top_peer if -top_rank == rank else -top_rank


def _judge_lost(
    summary: Summary, state: DetectState, cfg: DetectConfig, base: float | None
) -> tuple[dict[int, float], list[dict[str, Any]]]:
    """Ranks lost (or back) by this summary's time; their verdicts."""
    lost = dict(state.lost)
    out: list[dict[str, Any]] = []
    t = summary.t
    live = summary.liveness
    for lv in live:
        if lv.rank in lost and lv.last_t > lost[lv.rank]:
            del lost[lv.rank]
            out.append(
                _verdict(
                    t,
                    lv.done_step + 1,
                    lv.rank,
                    "cleared",
                    "rank_lost",
                    0.0,
                    lv.host,
                    {"heard_again_t": round(lv.last_t, 6)},
                )
            )
    silence = max(cfg.lost_silence_s, cfg.lost_silence_steps * (base or 0.0))
    torn: list[RankLiveness] = []
    quiet: list[RankLiveness] = []
    for lv in live:
        if lv.rank in lost or lv.last_t <= 0.0:
            continue
        silent = t - lv.last_t
        if (
            lv.torn_peers
            and lv.torn_peers >= lv.peers
            and silent >= cfg.lost_grace_s
            # Torn between steps is how every job ends, unless the rank reset
            # its connections: an orderly exit closes them, a dead process's
            # kernel resets the ones with data in flight.
            and (summary.mid_step or lv.done_step < summary.job_done or lv.reset_peers)
        ):
            torn.append(lv)
        elif silent >= silence:
            others = [o.last_t for o in live if o.rank != lv.rank and o.rank not in lost]
            if others and max(others) >= lv.last_t + silence:
                quiet.append(lv)
    ambiguous = False
    casualties: list[int] = []
    if torn and state.lost:
        torn = []  # the job is already down; later teardown is a consequence
    if len(torn) > 1:
        # A lost rank takes its peers down within milliseconds (their
        # collectives fail and they exit), so several ranks torn in one
        # judgement are one loss and its casualties. Suspects: those that
        # reset their connections (died), then those whose own sockets closed
        # (the probes saw that end go); of them, name the first to go.
        suspects = torn
        for sign in ("reset_peers", "self_closed"):
            marked = [lv for lv in suspects if getattr(lv, sign)]
            if marked and len(marked) < len(suspects):
                suspects = marked
        ambiguous = len(suspects) > 1 and len(torn) >= len(
            [lv for lv in live if lv.rank not in lost]
        )
        first = min(suspects, key=lambda lv: (lv.torn_t or t, lv.last_t, lv.rank))
        casualties = sorted(lv.rank for lv in torn if lv is not first)
        torn = [first]
    for lv in torn + quiet:
        lost[lv.rank] = lv.last_t
        ev: dict[str, Any] = {
            "silent_s": round(t - lv.last_t, 3),
            "last_step": lv.done_step,
            "torn_peers": lv.torn_peers,
            "peers": lv.peers,
        }
        if lv.reset_peers:
            ev["reset_peers"] = lv.reset_peers
        if lv in quiet:
            ev["others_continued"] = True
        elif casualties:
            ev["casualties"] = casualties
        if ambiguous:
            ev["unsure"] = "every rank lost its connections at once: picked the first to go quiet"
        out.append(
            _verdict(
                t, lv.done_step + 1, lv.rank, "flagged", "rank_lost", t - lv.last_t, lv.host, ev
            )
        )
    return lost, out
