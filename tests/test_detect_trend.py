"""Slow ageing: a rank that drifts slower step by step is flagged before it is large.

Synthetic jobs (fsdp_sentinel.synth) with the realistic noise of
tests/test_detect_network.py; the oracle is the generator's fault list.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from fsdp_sentinel import synth as S
from fsdp_sentinel.detect.compute import trend
from fsdp_sentinel.pipeline import Pipeline

REAL: dict[str, Any] = {"srtt_sigma": 0.25, "duplex": True, "retrans_bg_per_s": 1.0}


def flags(scn: S.Scenario) -> tuple[list[dict], dict]:
    recs, truth = S.generate(scn)
    return [v for v in Pipeline().feed_many(recs) if v["state"] == "flagged"], truth


@pytest.mark.parametrize(("seed", "jitter"), [(s, j) for s in range(3) for j in (0.08, 0.15)])
def test_drift_to_1_3x_over_40_steps_is_flagged_before_1_2x_with_its_trend(
    seed: int, jitter: float
) -> None:
    scn = S.Scenario(
        seed=seed, jitter=jitter, steps=70, faults=(S.SlowDrift(1, 1.3, 10, 50),), **REAL
    )
    found, truth = flags(scn)
    (expect,) = truth["stragglers"]
    assert expect["deadline_step"] == 37  # 1.0 -> 1.3 over steps 10..50 reaches 1.2 here
    assert [(v["rank"], v["cause"]) for v in found] == [(1, "compute")]
    v = found[0]
    assert v["step"] < expect["deadline_step"]
    ev = v["evidence"]["trend"]
    assert ev["slope_per_100_steps"] > 0.2 and ev["steps"] == 20


@pytest.mark.parametrize("seed", range(4))
def test_job_wide_drift_flags_nobody(seed: int) -> None:
    found, _ = flags(S.Scenario(seed=seed, steps=70, faults=(S.JobDrift(1.4, 10, 50),), **REAL))
    assert found == []


def test_trend_is_theil_sen() -> None:
    line = tuple(0.01 * i - 0.05 for i in range(20))
    slope, level, concord = trend(line)
    assert slope == pytest.approx(0.01) and level == pytest.approx(0.14) and concord == 1.0
    # one wild step moves neither the slope nor the level much
    spiked = line[:10] + (5.0,) + line[11:]
    s2, l2, _ = trend(spiked)
    assert s2 == pytest.approx(0.01, rel=0.1) and l2 == pytest.approx(0.14, abs=0.01)
    # noise around a flat line: no slope to speak of, concordance near a half
    rng = random.Random(3)
    fits = [trend(tuple(rng.gauss(0.0, 0.05) for _ in range(20))) for _ in range(200)]
    assert abs(sorted(f[0] for f in fits)[100]) < 0.001
    assert 0.47 < sum(f[2] for f in fits) / len(fits) < 0.53
    # and the rule's bar (0.7) is rare for noise: about 3 % of windows
    assert sum(f[2] >= 0.7 for f in fits) <= 0.06 * len(fits)
