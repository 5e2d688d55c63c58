"""The compute bar on a noisy machine: what a clean step's relative score looks like (pure).

The bar is ``min_effect``, or ``noise_k`` robust standard deviations of the
relative scores of quiet steps when that is higher. A step's scores join the
pool only ``noise_lag`` steps later, and only if nothing was suspect then and
nobody is flagged now, so the onset of a real straggler cannot raise the bar
before it is flagged.
"""

from __future__ import annotations

from fsdp_sentinel.detect.config import DetectConfig
from fsdp_sentinel.detect.stats import mad

_MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation over its MAD


def warm(rel_noise: tuple[float, ...], cfg: DetectConfig) -> bool:
    """Enough quiet steps seen for the bar to mean something."""
    return len(rel_noise) >= 2 * cfg.baseline.min_history


def sigma(rel_noise: tuple[float, ...]) -> float:
    """One quiet step's relative score's robust standard deviation (``rel_noise`` not empty)."""
    # The pool is a tuple carried unchanged from step to step until it takes
    # a step's scores, and a big job's holds a score a rank: the last answer
    # is kept for the very same tuple (held here, so its id is not reused).
    last = _LAST_SIGMA
    if last[0] is rel_noise:
        return last[1]  # type: ignore[return-value]
    out = _MAD_TO_SIGMA * mad(rel_noise)
    last[:] = (rel_noise, out)
    return out


_LAST_SIGMA: list[object] = [None, 0.0]


def bar(rel_noise: tuple[float, ...], cfg: DetectConfig) -> float:
    out = cfg.baseline.min_effect
    if warm(rel_noise, cfg):
        out = max(out, cfg.noise.noise_k * sigma(rel_noise))
    return out


def next_pool(
    rel_noise: tuple[float, ...],
    rel_lag: tuple[tuple[bool, tuple[float, ...]], ...],
    seen: list[float],
    suspect: bool,
    anyone_flagged: bool,
    cfg: DetectConfig,
) -> tuple[tuple[float, ...], tuple[tuple[bool, tuple[float, ...]], ...]]:
    """The noise pool and its lag line after a step whose relative scores were ``seen``
    (called only once the job has a baseline)."""
    if not warm(rel_noise, cfg):
        # Warming up: every step counts at once (a median is robust to one
        # odd rank), so detection starts a few steps after the baseline.
        return rel_noise + tuple(seen), rel_lag
    rel_lag = (*rel_lag, (suspect, tuple(seen)))
    if len(rel_lag) > cfg.noise.noise_lag:
        (was_suspect, values), rel_lag = rel_lag[0], rel_lag[1:]
        if not was_suspect and not anyone_flagged:
            rel_noise = (rel_noise + values)[-4 * cfg.baseline.history :]
    return rel_noise, rel_lag
