"""Persistence: a rank is flagged after ``flag_after`` consecutive bad windows and cleared
after ``clear_after`` clean ones, so a one-step spike (a GC pause, a burst of
jitter) never is (pure)."""

from __future__ import annotations

from fsdp_sentinel.detect.config import PersistenceConfig

FLAG = "flag"
CLEAR = "clear"


def step(
    bad: int,
    clean: int,
    cause: str | None,
    candidate: str | None,
    informative: bool,
    cfg: PersistenceConfig,
) -> tuple[int, int, str | None]:
    """``(bad, clean, action)`` after one report: the run counts, and FLAG, CLEAR or None.

    ``informative``: this report said something about the rank (a score, a
    candidate, or a job stretch figure); a report that said nothing leaves
    the counts alone.
    """
    if candidate is not None:
        bad, clean = bad + 1, 0
    elif informative:
        bad, clean = 0, clean + 1
    if cause is None and candidate is not None and bad >= cfg.flag_after:
        return bad, clean, FLAG
    if cause is not None and candidate is None and clean >= cfg.clear_after:
        return bad, clean, CLEAR
    return bad, clean, None
