"""The job's own step time and srtt history: what "stretched" is measured against (pure)."""

from __future__ import annotations

from fsdp_sentinel.detect.config import DetectConfig
from fsdp_sentinel.detect.stats import median, push


def baseline(job_hist: tuple[float, ...], cfg: DetectConfig) -> float | None:
    """Median job step time of the unstretched history (None while too short)."""
    return median(job_hist) if len(job_hist) >= cfg.baseline.min_history else None


def next_job_hist(
    job_hist: tuple[float, ...],
    stretched: int,
    job_recent: tuple[float, ...],
    job_step: float | None,
    base: float | None,
    blamed: bool,
    cfg: DetectConfig,
) -> tuple[tuple[float, ...], int]:
    """The job's step-time history and stretched-step count after this step.

    A step joins the history while it is not stretched; a stretch that lasts
    ``baseline_adapt_steps`` with nobody to blame (``blamed`` false: no open
    verdict, no candidate) becomes the new normal.
    """
    if job_step is None:
        return job_hist, stretched
    b = cfg.baseline
    if base is None or job_step <= base * (1.0 + b.min_effect):
        return push(job_hist, job_step, b.history), 0
    stretched += 1
    if stretched >= b.baseline_adapt_steps and not blamed:
        return job_recent, 0
    return job_hist, stretched


def next_srtt_hist(
    srtt_hist: tuple[float, ...],
    all_median_us: float | None,
    stretch: float | None,
    cfg: DetectConfig,
) -> tuple[float, ...]:
    """The job's srtt history: the median srtt of every flow in unstretched steps."""
    if all_median_us is not None and (stretch is None or stretch < cfg.baseline.min_effect):
        return push(srtt_hist, all_median_us, cfg.baseline.history)
    return srtt_hist
