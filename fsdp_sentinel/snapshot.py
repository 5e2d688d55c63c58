"""A read-only picture of the job at one moment, for the live view and exporters.

The pipeline (``fsdp_sentinel.pipeline``) builds a :class:`Snapshot` from the
records it has seen; the live table, ``top``, the Prometheus collector and the
HTML report read it and never reach into the pipeline's own state. Totals are
monotonic counters since the pipeline started (Prometheus ``_total`` style);
``*_rate`` fields are bytes per second over the latest probe interval.
"""

from __future__ import annotations

import dataclasses
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
    run id the rank announced (``""`` when it announced none).

    ``step_buckets`` counts summarised step durations per bucket of
    :data:`fsdp_sentinel.buckets.STEP_DURATION_BOUNDS` (not cumulative; the
    last one is above every bound; their sum is ``steps_total``);
    ``coll_wait_buckets[op]`` does the same for the time the rank waited for
    each collective (:data:`~fsdp_sentinel.buckets.COLLECTIVE_WAIT_BOUNDS`;
    sum ``coll_count_total[op]``, total time ``coll_seconds_total[op]``).
    ``wait_seconds_total`` is the part of ``step_seconds_total`` spent
    blocked in collectives.
    """

    rank: int
    host: str = ""
    job: str = ""
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
    #: of ``retrans_total``, segments the receivers reported they already had
    #: (D-SACK): spurious retransmits (late ACKs), not losses
    retrans_spurious_total: int = 0
    state: str = "ok"
    cause: str | None = None
    score: float | None = None
    cost: dict[str, Any] | None = None
    scope: str | None = None
    peer_rank: int | None = None
    coll_count_total: dict[str, int] = field(default_factory=dict)
    coll_bytes_total: dict[str, int] = field(default_factory=dict)
    coll_seconds_total: dict[str, float] = field(default_factory=dict)
    wait_seconds_total: float = 0.0
    step_buckets: tuple[int, ...] = ()
    coll_wait_buckets: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerView:
    """Traffic from ``rank`` to ``peer_rank`` (tx) and back (rx), summed over flows."""

    rank: int
    peer_rank: int
    tx_bytes_total: int = 0
    rx_bytes_total: int = 0
    srtt_us: float | None = None
    retrans_total: int = 0
    retrans_spurious_total: int = 0  # of them, D-SACKed (RankView's)
    job: str = ""


@dataclass(frozen=True)
class RemediationView:
    """One device the remediator manages; ``active``: its priority tree is in place."""

    host: str
    dev: str
    active: bool


@dataclass(frozen=True)
class RdmaPortView:
    """Totals of one RDMA port's sysfs counters since the pipeline started.

    ``errors`` holds the error and discard counters by their sysfs name
    (``symbol_error``, ``port_rcv_errors``, ...), only those that moved.
    """

    host: str
    dev: str
    port: int
    tx_bytes_total: int = 0
    rx_bytes_total: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NcclView:
    """NCCL calls one rank made through libnccl (from the uprobes), by op."""

    host: str
    rank: int | None
    op: str
    calls_total: int = 0
    bytes_total: int = 0
    job: str = ""


@dataclass(frozen=True)
class JobView:
    """One live job on the node (``fsdp_sentinel.jobs``): its id (``""``: the
    ranks announced none), which attempt (1, then one more per elastic
    restart), its world size and the ranks seen on this node."""

    job: str
    attempt: int = 1
    world_size: int | None = None
    ranks: int = 0


@dataclass(frozen=True)
class ClusterView:
    """A node daemon's part in cluster mode for one job (docs/cluster.md).

    ``view``: ``"cluster"`` while the job's store answers (the leader's
    verdicts are acted on), ``"node"`` while it does not (the node's own);
    ``leader``: the node it follows (None: none yet); ``leading``: it is that
    node; ``takeovers``: times this node began to lead; ``windows``: windows
    it published; ``failover_windows``: at the last change of leader away
    from a node gone dark, this node's windows from that node's last
    heartbeat to following the next (None: no such change yet).
    """

    job: str
    node: str
    view: str
    leader: str | None = None
    leading: bool = False
    takeovers: int = 0
    windows: int = 0
    failover_windows: int | None = None


@dataclass(frozen=True)
class BpfProgramView:
    """Kernel run statistics of one loaded BPF program (``run_cnt``,
    ``run_time_ns`` in its fdinfo; they count only while BPF stats are on)."""

    program: str
    runs_total: int = 0
    run_ns_total: int = 0


@dataclass(frozen=True)
class Snapshot:
    """Everything a view needs; ``t`` is the newest record time seen.

    The pipeline fills the job's part; the daemon adds what only it knows:
    ``ingest_messages_total`` (records by result: ``accepted`` or a drop
    reason), ``events_lost_total`` (kernel-side losses by source),
    ``bpf_programs`` and, from the remediator, ``remediation``.
    """

    t: float = 0.0
    world_size: int | None = None
    ranks: tuple[RankView, ...] = ()
    peers: tuple[PeerView, ...] = ()
    verdicts_total: dict[str, int] = field(default_factory=dict)  # by cause
    records_total: dict[str, int] = field(default_factory=dict)  # by kind
    ingest_dropped_total: int = 0
    ingest_malformed_total: int = 0
    ingest_messages_total: dict[str, int] = field(default_factory=dict)
    events_lost_total: dict[str, int] = field(default_factory=dict)
    bpf_programs: tuple[BpfProgramView, ...] = ()
    rdma_ports: tuple[RdmaPortView, ...] = ()
    nccl: tuple[NcclView, ...] = ()
    remediation: tuple[RemediationView, ...] = ()
    jobs: tuple[JobView, ...] = ()
    #: Records the stream guard refused, by reason (fsdp_sentinel.stream).
    stream_refused_total: dict[str, int] = field(default_factory=dict)
    #: Sources (ranks, hosts) whose clock jump was taken off their records.
    clock_resets_total: int = 0
    #: What the correlator's caps and time-to-live dropped, by kind (correlate.StateLimits).
    evictions_total: dict[str, int] = field(default_factory=dict)
    #: The daemon's supervised threads (ingest, pipeline, http): times each was started again.
    thread_restarts_total: dict[str, int] = field(default_factory=dict)
    #: The daemon's output files (``trace``, ``verdicts``): write errors, each
    #: of which switched that file off (a full disk), and the records not
    #: written since. Empty when the daemon writes none.
    trace_write_errors_total: dict[str, int] = field(default_factory=dict)
    trace_records_lost_total: dict[str, int] = field(default_factory=dict)
    #: Cluster mode (``run --cluster``): this node's view per job; empty otherwise.
    cluster: tuple[ClusterView, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Snapshot:
        rest = {k: v for k, v in obj.items() if k not in _NESTED}
        nested = {k: tuple(cls(**x) for x in obj.get(k, ())) for k, cls in _NESTED.items()}
        ranks = tuple(
            dataclasses.replace(
                r,
                step_buckets=tuple(r.step_buckets),
                coll_wait_buckets={op: tuple(c) for op, c in r.coll_wait_buckets.items()},
            )
            for r in nested.pop("ranks")
        )
        return Snapshot(ranks=ranks, **nested, **rest)  # type: ignore[arg-type]


#: Snapshot fields that hold views, and the view each item is.
_NESTED: dict[str, type] = {
    "ranks": RankView,
    "peers": PeerView,
    "bpf_programs": BpfProgramView,
    "rdma_ports": RdmaPortView,
    "nccl": NcclView,
    "remediation": RemediationView,
    "jobs": JobView,
    "cluster": ClusterView,
}
