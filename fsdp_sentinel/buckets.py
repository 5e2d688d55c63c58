"""Histogram bucket bounds shared by the correlator (which counts) and the exporter.

The correlator files every summarised step duration and collective wait into
these buckets; :class:`~fsdp_sentinel.snapshot.RankView` carries the counts
(one per bucket, not cumulative, the last one for values above every bound) and
the exporter turns them into Prometheus histograms. One definition, so a
count can never be read against the wrong bounds.
"""

from __future__ import annotations

from bisect import bisect_left

#: Step durations: FSDP steps run from ~50 ms (small models) to a minute
#: (large ones, or a stalled rank); about three buckets per decade.
STEP_DURATION_BOUNDS: tuple[float, ...] = (
    0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
    2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
)  # fmt: skip

#: Time a rank waited for one collective: from well under a millisecond (the
#: data was already there) to seconds (waiting for a straggler).
COLLECTIVE_WAIT_BOUNDS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


def empty(bounds: tuple[float, ...]) -> list[int]:
    """Zero counts for ``bounds`` (one more than the bounds: the +Inf bucket)."""
    return [0] * (len(bounds) + 1)


def observe(counts: list[int], bounds: tuple[float, ...], value: float) -> None:
    """Count ``value`` in the first bucket whose bound is >= it (Prometheus ``le``)."""
    counts[bisect_left(bounds, value)] += 1
