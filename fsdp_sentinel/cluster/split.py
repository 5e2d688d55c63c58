"""A one-daemon trace cut into what each host's daemon would have seen (pure).

Hook records (``rank``, ``step``, ``coll``, ``pending``) belong to their
rank's host; ``flow`` and ``conn`` records to the host of the process (``pid``)
or of the local address (``src``) they name; probe-time records (``netdev``,
``clock``) go to the host they name, or to every host when they name none of
the ranks' hosts (a lab capture's one daemon saw every namespace). Used to
check that cluster mode gives the single daemon's verdicts on real captures
(tests, ``bench/leader_scale``), and by :func:`run_split` to replay a trace
as per-host daemons and a leader, with windows cut every ``interval_s`` of
stream time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from fsdp_sentinel.cluster.leader import LeaderDetector, decode_round
from fsdp_sentinel.cluster.node import NodeWindows
from fsdp_sentinel.cluster.summary import Window, encode
from fsdp_sentinel.detect import DetectConfig

Record = dict[str, Any]

_SKIP = frozenset({"header", "verdict", "action", "fault"})


def split_by_host(records: list[Record]) -> Iterator[tuple[tuple[str, ...], Record]]:
    """``(hosts, record)`` for each input record: the hosts whose daemon sees it."""
    host_of_rank: dict[int, str] = {}
    host_of_pid: dict[int, str] = {}
    host_of_ip: dict[str, str] = {}
    for r in records:
        if r.get("kind") == "rank":
            host_of_rank[r["rank"]] = r["host"]
            host_of_pid[r["pid"]] = r["host"]
            for a in r.get("addrs") or ():
                host_of_ip[a] = r["host"]
    everyone = tuple(sorted(set(host_of_rank.values())))
    hosts = frozenset(everyone)
    for r in records:
        kind = r.get("kind")
        if kind in _SKIP:
            continue
        if kind in ("coll", "step", "rank", "pending"):
            h = host_of_rank.get(r.get("rank"))  # type: ignore[arg-type]
            yield ((h,) if h else everyone), r
        elif kind in ("flow", "conn"):
            h = host_of_pid.get(r.get("pid"))  # type: ignore[arg-type]
            if h is None:
                h = host_of_ip.get(str(r.get("src", "")).rsplit(":", 1)[0])
            yield ((h,) if h else everyone), r
        else:  # probe-time records: their host's, or (one daemon saw them all) everyone's
            h = r.get("host")
            yield ((h,) if h in hosts else everyone), r


def run_split(
    records: Iterable[Record],
    interval_s: float = 0.5,
    config: DetectConfig | None = None,
    leader: LeaderDetector | None = None,
    wire: bool = True,
) -> list[Record]:
    """The leader's verdicts for ``records`` cut by host into node windows (no store:
    each round's windows go straight to the leader, packed and read back as
    the store would hand them over; ``wire=False``: as the nodes made them)."""
    recs = list(records)
    nodes: dict[str, NodeWindows] = {}
    det = leader if leader is not None else LeaderDetector(config)
    out: list[Record] = []
    due: float | None = None
    now = 0.0
    for hosts, r in split_by_host(recs):
        for h in hosts:
            nw = nodes.get(h)
            if nw is None:
                nw = nodes[h] = NodeWindows(h)
            nw.feed(r)
            if nw.now > now:
                now = nw.now
        if due is None:
            due = now + interval_s
        elif now >= due:
            out.extend(_hand_over(det, [nw.window() for nw in nodes.values()], wire))
            due = now + interval_s
    out.extend(_hand_over(det, [nw.window() for nw in nodes.values()], wire))
    return out


def _hand_over(det: LeaderDetector, windows: list[Window], wire: bool) -> list[Record]:
    if not wire:
        return det.ingest(windows)
    rnd = decode_round([encode(w) for w in windows])
    if rnd.bad:
        raise RuntimeError(f"{rnd.bad} of the nodes' own windows did not read back")
    return det.ingest(rnd)
