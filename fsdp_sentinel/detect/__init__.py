"""Detect: from correlated summaries to straggler verdicts (pure; no I/O, no clock).

:func:`detect` takes one :class:`~fsdp_sentinel.correlate.Summary` (a completed
step, or a clock tick), the previous :class:`DetectState` and a
:class:`DetectConfig`, and returns a :class:`Report` holding the scores, the
typed verdicts (:class:`~fsdp_sentinel.trace.Verdict`; the trace layer writes
them as records) and the next state. The input state is never changed, so the
same summaries in the same order always give the same verdicts: live, in
replay and in tests.

One module per rule, each pure and small; ``detector`` only orders them
(docs/detection.md has the long form of each):

* ``compute``: the rank arrives last at its collectives, by at least the bar.
* ``network``: the job's step stretched while nobody arrives late, and the
  flows touching the rank are slower than the rest, or carry most of the
  retransmits.
* ``lost``: ``rank_lost``, its records stopped and its connections went, or
  it fell silent while the others carried on.
* ``persistence``: flag after ``flag_after`` bad windows, clear after
  ``clear_after`` clean ones.
* ``baseline`` and ``noise``: what the job's step time and a quiet step's
  score look like; ``stats``: the robust statistics they all use;
  ``config``: the thresholds, grouped by rule.
"""

from fsdp_sentinel.detect.config import (
    BaselineConfig,
    ComputeConfig,
    DetectConfig,
    LostConfig,
    NetworkConfig,
    NoiseConfig,
    PersistenceConfig,
    StallConfig,
)
from fsdp_sentinel.detect.detector import detect
from fsdp_sentinel.detect.state import CAUSES, DetectState, RankScore, RankTrack, Report
from fsdp_sentinel.trace import Verdict

__all__ = [
    "CAUSES",
    "BaselineConfig",
    "ComputeConfig",
    "DetectConfig",
    "DetectState",
    "LostConfig",
    "StallConfig",
    "NetworkConfig",
    "NoiseConfig",
    "PersistenceConfig",
    "RankScore",
    "RankTrack",
    "Report",
    "Verdict",
    "detect",
]
