"""Size a machine-dependent fault from what the victim really uses, so it has the intended effect.

A CFS quota of ``f`` of a core only slows a rank that uses more than ``f``:
on a quiet machine a rank of the demo's job uses ~0.25 of a core, on a busy
one less (it waits for the CPU it shares), so a fixed quota is a cliff whose
edge moves with the load (measured here: 0.25 and 0.3 slowed nothing, 0.22
gave 1.14x, 0.21 gave 1.24x). The model used instead: over a step of
``T`` seconds the rank needs ``u * T`` CPU-seconds (``u``: the share of one
core it used in the clean steps); under a quota ``f`` it gets at most
``f * T'`` in a step of ``T'``, so ``T' >= T * u / f``. For a slow-down
``s``, ``f = u / s``. The share is measured from the victim host's cgroup
members' own CPU time (``/proc/PID/stat`` utime + stime, every thread
included), not from the machine's, so other load does not skew it.

Pure but for :class:`CpuMeter`, whose ``/proc`` root and clock are injected.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

#: A quota below this starves the rank of its heartbeat threads too (the
#: kernel's own floor is 1 ms of a 100 ms period).
MIN_FRACTION = 0.02
MAX_FRACTION = 1.0


def process_cpu_seconds(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> float | None:
    """utime + stime of ``pid`` (all its threads) in seconds; None once it is gone."""
    try:
        text = Path(proc_root, str(pid), "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    ticks = int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    return ticks / os.sysconf("SC_CLK_TCK")


def quota_for(used_fraction: float, slowdown: float) -> float:
    """The share of one core that slows a rank using ``used_fraction`` by ``slowdown``."""
    if not slowdown > 1.0:
        raise ValueError(f"slowdown must be > 1, not {slowdown!r}")
    if not used_fraction > 0.0:
        raise ValueError(f"used_fraction must be > 0, not {used_fraction!r}")
    return min(MAX_FRACTION, max(MIN_FRACTION, used_fraction / slowdown))


@dataclass(frozen=True)
class CpuUse:
    """What one measurement saw: CPU-seconds of the host's processes over ``wall`` seconds."""

    cpu: float
    wall: float

    @property
    def fraction(self) -> float:
        """Share of one core the host used (0 when nothing was measured)."""
        return self.cpu / self.wall if self.wall > 0 else 0.0


class CpuMeter:
    """CPU time of a set of processes between :meth:`start` and :meth:`stop`.

    ``pids()`` is asked at both ends; a process present at both counts by its
    own delta (one that came or went in between is left out, so a restart
    cannot count a whole lifetime as one step's use).
    """

    def __init__(
        self,
        pids: Callable[[], Iterable[int]],
        *,
        proc_root: str | os.PathLike[str] = "/proc",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pids = pids
        self._proc_root = proc_root
        self._clock = clock
        self._t0: float | None = None
        self._cpu0: dict[int, float] = {}

    def _sample(self) -> dict[int, float]:
        out = {}
        for pid in self._pids():
            cpu = process_cpu_seconds(pid, self._proc_root)
            if cpu is not None:
                out[pid] = cpu
        return out

    @property
    def started(self) -> bool:
        return self._t0 is not None

    def start(self) -> None:
        self._cpu0 = self._sample()
        self._t0 = self._clock()

    def stop(self) -> CpuUse:
        if self._t0 is None:
            raise RuntimeError("CpuMeter.stop() before start()")
        cpu1 = self._sample()
        wall = self._clock() - self._t0
        cpu = sum(c - self._cpu0[p] for p, c in cpu1.items() if p in self._cpu0)
        return CpuUse(max(cpu, 0.0), wall)
