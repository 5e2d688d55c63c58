"""A network-namespace lab: one machine as a small cluster with real slow links and slow ranks.

``Lab(LabConfig(...))`` builds hosts (namespaces on a bridge, shaped links,
cpu cgroups); ``faults`` change it and return trace-v1 ``fault`` records;
``cluster.launch_torchrun`` runs a job on it; ``cleanup.teardown`` removes a
lab in any state. See docs/lab.md.
"""

from __future__ import annotations

from fsdp_sentinel.lab.config import LabConfig, LabError, LabHost
from fsdp_sentinel.lab.faults import (
    Fault,
    HangRank,
    KillRank,
    NoisyNeighbor,
    PacketLoss,
    SilentNode,
    SlowCompute,
    SlowLink,
    SlowPath,
)
from fsdp_sentinel.lab.topology import Lab

__all__ = [
    "Fault",
    "HangRank",
    "KillRank",
    "Lab",
    "LabConfig",
    "LabError",
    "LabHost",
    "NoisyNeighbor",
    "PacketLoss",
    "SilentNode",
    "SlowCompute",
    "SlowLink",
    "SlowPath",
]
