"""The demo's scenarios as data: which fault, on which rank, from which step, for how long.

Pure (the lab's fault classes are imported only when a fault is built), so
the table, its defaults and the expected verdicts are checked without root.

Sizes follow what was measured on a 2-core machine (docs/demo.md): every
host's link shaped to 1 Gbit/s and a model of ~3.5 M parameters make a 4-rank
step ~0.4 s, with the network as the bottleneck; one host cut to 150 Mbit/s
makes every step ~2.4 s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The lab's fault ``what`` -> the cause a correct detector reports.
CAUSE_OF = {
    "slow_link": "network",
    "slow_path": "network",
    "noisy_neighbor": "network",
    "packet_loss": "network",
    "slow_compute": "compute",
    "compute_stall": "compute",
    "rank_kill": "rank_lost",
    "rank_hang": "hang",
    "silent_node": "rank_lost",
}

#: Causes judged on the clock, not by persistence over steps: a fault of
#: theirs is never too short to be flagged (it stops the job while it lasts).
STALL_CAUSES = frozenset({"hang", "rank_lost"})


@dataclass(frozen=True)
class Scenario:
    """One demo scenario.

    ``onset``: the step during which the fault is injected; ``duration``:
    steps it lasts (None: to the end of the run); ``seconds``: instead, the
    seconds it lasts (a fault that stops the job makes no steps to count);
    ``steps``: default run length. ``make(victim)`` builds the lab fault
    (None for a clean run). ``slowdown``: for a fault whose effect depends on
    the machine (a CPU quota), the intended stretch of the victim's step; the
    demo measures the victim's use in the clean steps before the onset and
    sizes the fault to give it (``demo.calibrate``). None: the fault is the
    same on any machine.
    """

    name: str
    summary: str
    what: str | None
    make: Callable[[int], Any] | None
    onset: int = 8
    duration: int | None = 10
    steps: int = 24
    slowdown: float | None = None
    seconds: float | None = None

    @property
    def cause(self) -> str | None:
        return CAUSE_OF.get(self.what or "")


def _slow_link(victim: int) -> Any:
    from fsdp_sentinel.lab import SlowLink

    return SlowLink(victim, rate_mbit=150.0)


def _slow_path(victim: int) -> Any:
    from fsdp_sentinel.lab import SlowPath

    # Only the path between the victim's host and the next one in the ring.
    return SlowPath(victim, rate_mbit=150.0)


def _noisy_neighbor(victim: int) -> Any:
    from fsdp_sentinel.lab import NoisyNeighbor

    # An upload from the host (a checkpoint going to storage) that fills its link.
    return NoisyNeighbor(victim, direction="out", streams=4)


def _slow_compute(victim: int) -> Any:
    from fsdp_sentinel.lab import SlowCompute

    # The share used when calibration cannot run (an onset before step 2);
    # otherwise the demo sizes it from the victim's measured use.
    return SlowCompute(victim, cpu_fraction=0.1)


def _mild_compute(victim: int) -> Any:
    from fsdp_sentinel.lab import SlowCompute

    # Uncalibrated fallback: 0.2 of a core was ~1.2x on a quiet machine here,
    # and nothing at all on a busier one (the rank used less than 0.2).
    return SlowCompute(victim, cpu_fraction=0.2)


def _packet_loss(victim: int) -> Any:
    from fsdp_sentinel.lab import PacketLoss

    return PacketLoss(victim, p=0.1)


def _rank_hang(victim: int) -> Any:
    from fsdp_sentinel.lab import HangRank

    return HangRank(victim)


def _silent_node(victim: int) -> Any:
    from fsdp_sentinel.lab import SilentNode

    return SilentNode(victim)


def _rank_kill(victim: int) -> Any:
    from fsdp_sentinel.lab import KillRank

    return KillRank(victim)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "clean", "no fault: nothing should be flagged", None, None, duration=None, steps=20
        ),
        Scenario(
            "slow-link", "one host's link cut from 1 Gbit/s to 150 Mbit/s", "slow_link", _slow_link
        ),
        Scenario(
            "slow-path",
            "the path between two hosts (a cable, a port) cut to 150 Mbit/s, both ways",
            "slow_path",
            _slow_path,
        ),
        Scenario(
            "noisy-neighbor",
            "bulk TCP from one host to a storage host shares its link",
            "noisy_neighbor",
            _noisy_neighbor,
        ),
        Scenario(
            "slow-compute",
            "one host's CPU quota sized from its use to slow it ~1.8x",
            "slow_compute",
            _slow_compute,
            slowdown=1.8,
        ),
        Scenario(
            "mild-compute",
            "one host's CPU quota sized from its use to slow it ~1.2x",
            "slow_compute",
            _mild_compute,
            # Long enough for a mild effect: the sustained median reads 9
            # steps, and a quota bites in bursts (steps of 1.0x among 1.3x
            # ones), so 12 steps left it found in the last one or missed.
            duration=16,
            steps=28,
            slowdown=1.2,
        ),
        Scenario(
            "packet-loss",
            "one host's link loses 10% of the packets it sends",
            "packet_loss",
            _packet_loss,
        ),
        Scenario(
            "rank-kill", "one rank is killed (SIGKILL)", "rank_kill", _rank_kill, duration=None
        ),
        Scenario(
            "hang",
            "one rank hangs (SIGSTOP, its sockets open) for 6 s, then goes on",
            "rank_hang",
            _rank_hang,
            duration=None,
            seconds=6.0,
            steps=16,
        ),
        Scenario(
            "silent-node",
            "one host is cut off (its switch port down, no reset) for 5 s",
            "silent_node",
            _silent_node,
            duration=None,
            seconds=5.0,
            steps=16,
        ),
    )
}

DEFAULT = "slow-link"

#: ``--scenario all`` runs every scenario in this order.
ALL = "all"

#: Clean steps measured before the onset to calibrate a machine-dependent
#: fault (the first steps, with the model's warm-up, are left out).
CALIBRATION_STEPS = 4


def calibration_start(onset: int) -> int | None:
    """The step at which to start measuring the victim for a fault at ``onset``:
    up to ``CALIBRATION_STEPS`` clean steps, never step 0 (warm-up); None when
    the onset leaves no clean step to measure."""
    start = max(1, onset - CALIBRATION_STEPS)
    return start if start < onset else None


def victim_rank(ranks: int) -> int:
    """The rank that gets the fault: not rank 0 (its host serves the rendezvous
    store, so killing it ends the job for everyone at once), else the middle."""
    if ranks < 2:
        return 0
    return min(2, ranks - 1)


def min_persistent_steps(window: int, flag_after: int) -> int:
    """Fewest bad steps in a row that can get a rank flagged: the rolling
    median of ``window`` steps turns bad once more than half of them are, and
    must then stay bad for ``flag_after`` windows."""
    return window // 2 + flag_after


def is_transient(duration: int | None, window: int, flag_after: int) -> bool:
    """Whether a fault of ``duration`` steps is too short to be flagged."""
    return duration is not None and duration < min_persistent_steps(window, flag_after)


#: Short runs of every scenario (and a transient slow link), for the
#: end-to-end tests and the golden-trace captures: name -> demo flags.
QUICK_RUNS: dict[str, list[str]] = {
    "clean": ["--scenario", "clean", "--steps", "10"],
    "slow-link": ["--scenario", "slow-link", "--steps", "15", "--onset", "6", "--fault-steps", "6"],
    "slow-link-transient": [
        "--scenario", "slow-link", "--steps", "10", "--onset", "6", "--fault-seconds", "0.3",
    ],
    "slow-path": ["--scenario", "slow-path", "--steps", "15", "--onset", "6", "--fault-steps", "6"],
    "noisy-neighbor": [
        "--scenario", "noisy-neighbor", "--steps", "15", "--onset", "6", "--fault-steps", "6",
    ],
    "slow-compute": [
        "--scenario", "slow-compute", "--steps", "17", "--onset", "8", "--fault-steps", "6",
    ],
    "packet-loss": [
        "--scenario", "packet-loss", "--steps", "15", "--onset", "6", "--fault-steps", "6",
    ],
    "rank-kill": ["--scenario", "rank-kill", "--steps", "10", "--onset", "6"],
    "hang": ["--scenario", "hang", "--steps", "12", "--onset", "6"],
    "silent-node": ["--scenario", "silent-node", "--steps", "12", "--onset", "6"],
}  # fmt: skip
