"""The detector's order-statistics shortcuts equal the plain definitions they replace.

Verdicts are compared byte for byte across versions (golden traces), so each
shortcut must give the very float the straightforward computation gives, not
one close to it.
"""

from __future__ import annotations

import random
from itertools import repeat
from operator import sub

import pytest

from fsdp_sentinel.detect.stats import mad as _mad
from fsdp_sentinel.detect.stats import median as _median
from fsdp_sentinel.detect.stats import median_sorted as _median_sorted
from fsdp_sentinel.detect.stats import median_without as _median_without
from fsdp_sentinel.detect.stats import median_without_all as _median_without_all
from fsdp_sentinel.detect.stats import push as _push
from fsdp_sentinel.detect.stats import push_sorted as _push_sorted


def values(rng: random.Random, n: int) -> list[float]:
    # Ties and signed zeros are where a shortcut would slip: draw many.
    pool = [0.0, -0.0, 0.25, -0.25, 1e-9]
    return [rng.choice(pool) if rng.random() < 0.3 else rng.gauss(0.0, 0.05) for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_mad_is_median_of_absolute_deviations(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
        xs = values(rng, rng.randint(1, 130))
        med = _median(xs)
        assert _mad(xs) == _median(list(map(abs, map(sub, xs, repeat(med)))))


@pytest.mark.parametrize("seed", range(4))
def test_median_without_equals_median_of_the_rest(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
        xs = values(rng, rng.randint(2, 64))
        value = rng.choice(xs)
        rest = list(xs)
        rest.remove(value)
        assert _median_without(sorted(xs), value) == _median(rest)
        assert _median_sorted(sorted(xs)) == _median(xs)


@pytest.mark.parametrize("seed", range(4))
def test_median_without_all_equals_median_of_the_rest(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
        xs = values(rng, rng.randint(2, 64))
        gone = rng.sample(xs, rng.randint(1, len(xs) - 1))
        ordered = sorted(xs)
        rest = list(ordered)
        for v in gone:  # what the per-call copy did: the leftmost equal one goes
            rest.remove(v)
        # repr: the very float, signed zero included.
        assert repr(_median_without_all(ordered, gone)) == repr(_median_sorted(rest))


@pytest.mark.parametrize("keep", [1, 3, 30])
def test_push_sorted_keeps_the_sorted_copy_of_the_history(keep: int) -> None:
    rng = random.Random(keep)
    hist: tuple[float, ...] = ()
    ordered: tuple[float, ...] = ()
    for value in values(rng, 500):
        expected = _push(hist, value, keep)
        hist, ordered = _push_sorted(hist, ordered, value, keep)
        assert hist == expected
        assert ordered == tuple(sorted(hist))


def test_push_sorted_follows_a_history_that_shrinks() -> None:
    # ``history`` can be lowered while running (set_config): several values fall out at once.
    hist = tuple(float(i % 7) for i in range(30))
    new, ordered = _push_sorted(hist, tuple(sorted(hist)), 2.5, 10)
    assert new == _push(hist, 2.5, 10)
    assert ordered == tuple(sorted(new))
