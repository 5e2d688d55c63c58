"""What a straggler costs the job, in plain numbers (pure).

A synchronous job runs at the pace of its slowest rank: when one rank
stretches the job's step from ``baseline`` to ``job`` seconds, every rank
pays the difference on every step. So a verdict's cost is

- ``added_share`` = (job - baseline) / baseline: how much longer each step
  takes (the compute verdict's relative score);
- ``seconds_per_step`` = job - baseline: the seconds each step loses;
- ``rank_hours_per_hour`` = world_size * (job - baseline) / job: of every
  wall-clock hour, the rank-hours the whole job spends waiting for the
  straggler (1,024 ranks at a 20 % stretch: ~171 rank-hours an hour).

A rank that is lost or hung stops the whole job: its cost is every rank's
time (``added_share`` None, ``rank_hours_per_hour`` = world_size). The
figures let a user weigh evicting a node now against letting the job run.
"""

from __future__ import annotations

from typing import Any

#: Causes that stop every rank of the job until they are resolved.
STOPPING_CAUSES = frozenset({"rank_lost", "hang"})


def straggler_cost(
    cause: str,
    job_step_s: float | None,
    baseline_step_s: float | None,
    world_size: int | None,
) -> dict[str, Any] | None:
    """``evidence.cost`` of a flagged verdict; None when the figures to price it are missing."""
    ranks = world_size if world_size and world_size > 0 else None
    if cause in STOPPING_CAUSES:
        return {
            "added_share": None,
            "seconds_per_step": None,
            "rank_hours_per_hour": float(ranks) if ranks else None,
            "stops_job": True,
        }
    if not job_step_s or not baseline_step_s or job_step_s <= 0 or baseline_step_s <= 0:
        return None
    extra = max(0.0, job_step_s - baseline_step_s)
    return {
        "added_share": round(extra / baseline_step_s, 4),
        "seconds_per_step": round(extra, 4),
        "rank_hours_per_hour": round(ranks * extra / job_step_s, 3) if ranks else None,
        "stops_job": False,
    }


def describe_cost(cost: dict[str, Any] | None) -> str:
    """``evidence.cost`` in words, for the demo summary and the report."""
    if not cost:
        return ""
    rh = cost.get("rank_hours_per_hour")
    hours = f"{rh:.3g} rank-hours an hour" if isinstance(rh, (int, float)) else ""
    if cost.get("stops_job"):
        return "stops the job" + (f": {hours}" if hours else "")
    share, secs = cost.get("added_share"), cost.get("seconds_per_step")
    parts = []
    if isinstance(share, (int, float)) and isinstance(secs, (int, float)):
        parts.append(f"+{share * 100:.0f} % a step ({secs:.3g} s)")
    if hours:
        parts.append(hours)
    return ", ".join(parts)
