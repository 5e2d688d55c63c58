"""A read-only picture of the job at one moment, for the live view and exporters.

The pipeline (``fsdp_sentinel.pipeline``) builds a :class:`Snapshot` from the
records it has seen; the live table, ``top``, the Prometheus collector and the
HTML report read it and never reach into the pipeline's own state. Totals are
monotonic counters since the pipeline started (Prometheus ``_total`` style);
``*_rate`` fields are bytes per second over the latest probe interval.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RankView:
    """One rank as the pipeline sees it now.

    ``state`` is ``"ok"``, ``"flagged"`` or ``"lost"``; ``cause``, ``score``
    and ``cost`` (``fsdp_sentinel.cost``: added share, seconds per step,
    rank-hours per hour) are those of the rank's open verdict (None when it
    has none); for a network verdict, ``scope`` is ``"node"`` (the host) or
    ``"link"`` (the path between the rank and ``peer_rank``). ``job`` is the
    job id the rank announced.
    """

    rank: int
    host: str = ""
    pid: int | None = None
    step: int | None = None
    step_seconds: float | None = None
    compute_seconds: float | None = None
    wait_seconds: float | None = None
    steps_total: int = 0
    step_seconds_total: float = 0.0
    tx_bytes_total: int = 0
    rx_bytes_total: int = 0
    tx_rate: float | None = None
    rx_rate: float | None = None
    srtt_us: float | None = None
    retrans_total: int = 0
    state: str = "ok"
    cause: str | None = None
    score: float | None = None
    cost: dict[str, Any] | None = None
    job: str | None = None
    scope: str | None = None
    peer_rank: int | None = None
    coll_count_total: dict[str, int] = field(default_factory=dict)
    coll_bytes_total: dict[str, int] = field(default_factory=dict)
    coll_seconds_total: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerView:
    """Traffic from ``rank`` to ``peer_rank`` (tx) and back (rx), summed over flows."""

    rank: int
    peer_rank: int
    tx_bytes_total: int = 0
    rx_bytes_total: int = 0
    srtt_us: float | None = None
    retrans_total: int = 0


@dataclass(frozen=True)
class RemediationView:
    """One device the remediator manages; ``active``: its priority tree is in place."""

    host: str
    dev: str
    active: bool


@dataclass(frozen=True)
class Snapshot:
    """Everything a view needs; ``t`` is the newest record time seen."""

    t: float = 0.0
    world_size: int | None = None
    ranks: tuple[RankView, ...] = ()
    peers: tuple[PeerView, ...] = ()
    verdicts_total: dict[str, int] = field(default_factory=dict)  # by cause
    records_total: dict[str, int] = field(default_factory=dict)  # by kind
    ingest_dropped_total: int = 0
    ingest_malformed_total: int = 0
    remediation: tuple[RemediationView, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Snapshot:
        ranks = tuple(RankView(**r) for r in obj.get("ranks", ()))
        peers = tuple(PeerView(**p) for p in obj.get("peers", ()))
        remediation = tuple(RemediationView(**v) for v in obj.get("remediation", ()))
        rest = {k: v for k, v in obj.items() if k not in ("ranks", "peers", "remediation")}
        return Snapshot(ranks=ranks, peers=peers, remediation=remediation, **rest)
