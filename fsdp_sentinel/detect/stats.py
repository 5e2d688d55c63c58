"""Robust statistics the rules share: medians, the MAD, bounded histories.

Verdicts are compared byte for byte across versions, so each shortcut here
gives the very float the plain definition gives (tests/test_detect_order_stats.py).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from itertools import repeat
from operator import sub

import numpy as np


def median(xs: Sequence[float]) -> float:
    return median_sorted(sorted(xs))


def median_without(ordered: list[float], value: float) -> float:
    """The median of sorted ``ordered`` with one occurrence of ``value`` left out.

    Equals ``median`` of that shorter list (the same elements are read), in
    O(log n) instead of a copy and a sort per rank.
    """
    i = bisect_left(ordered, value)  # the left-out value's place: later ones shift down
    n = len(ordered) - 1
    mid = n // 2
    upper = ordered[mid] if mid < i else ordered[mid + 1]
    if n % 2:
        return upper
    lower = ordered[mid - 1] if mid - 1 < i else ordered[mid]
    return (lower + upper) / 2.0


def median_without_all(ordered: Sequence[float], values: Sequence[float]) -> float:
    """The median of sorted ``ordered`` with one occurrence of each of ``values`` left out
    (each must be in it; fewer than ``len(ordered)`` of them).

    Equals ``median`` of that shorter list (the same elements are read), in
    O(k log n) for k values instead of a copy of the whole list per call
    (quadratic when every rank asks for the median of the others' flows).
    """
    # Where each left-out value sits: its leftmost place, one further per repeat.
    gone: list[int] = []
    prev: float | None = None
    at = 0
    for v in sorted(values):
        at = at + 1 if v == prev else bisect_left(ordered, v)
        prev = v
        gone.append(at)
    n = len(ordered) - len(gone)
    mid = n // 2

    def kept(i: int) -> float:  # the i-th element that is left (0-based)
        for g in gone:
            if g <= i:
                i += 1
            else:
                break
        return ordered[i]

    return kept(mid) if n % 2 else (kept(mid - 1) + kept(mid)) / 2.0


def median_sorted(ordered: Sequence[float]) -> float:
    """``median`` of values already in ascending order (no copy, no sort)."""
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


#: From this many values on, :func:`mad` sorts with numpy (a big job's noise
#: pool: a step's relative scores, one a rank); below it Python's merge is faster.
_MAD_NUMPY = 512


def mad(xs: Sequence[float]) -> float:
    """The median absolute deviation from the median of ``xs`` (not empty).

    Sorted once: the deviations of the values below the median, read from the
    median outwards, and of those above it, are two ascending runs, which
    ``sorted`` merges in one linear pass instead of sorting them afresh.
    """
    if len(xs) >= _MAD_NUMPY:
        a = np.sort(np.asarray(xs, dtype=np.float64))
        m = float(median_sorted(a))  # type: ignore[arg-type]
        # abs(x - m) is m - x below the median, exactly: the same floats.
        return float(median_sorted(np.sort(np.abs(a - m))))  # type: ignore[arg-type]
    s = sorted(xs)
    med = median_sorted(s)
    cut = bisect_left(s, med)
    # med - x is exactly -(x - med), so these are the values abs(x - med) gives.
    devs = sorted([*map(sub, repeat(med), reversed(s[:cut])), *map(sub, s[cut:], repeat(med))])
    return median_sorted(devs)


def push(hist: tuple[float, ...], value: float, keep: int) -> tuple[float, ...]:
    return (hist + (value,))[-keep:]


def push_sorted(
    hist: tuple[float, ...], ordered: tuple[float, ...], value: float, keep: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``push`` onto ``hist``, and the same change to ``ordered`` (``hist`` sorted).

    Keeping the sorted copy makes a long history's median a lookup instead of
    a sort every step.
    """
    new = (hist + (value,))[-keep:]
    lst = list(ordered)
    for old in hist[: len(hist) + 1 - len(new)]:  # the values that fell out
        del lst[bisect_left(lst, old)]
    insort(lst, value)
    return new, tuple(lst)


def rnd(x: float | None, nd: int = 4) -> float | None:
    """``round`` that lets None through (evidence fields may be absent)."""
    return None if x is None else round(x, nd)


def median_array(xs: np.ndarray) -> float | None:
    """``median`` of a 1-d float array (None when empty): the same float."""
    n = len(xs)
    if not n:
        return None
    s = np.sort(xs)
    mid = n // 2
    return float(s[mid]) if n % 2 else float((s[mid - 1] + s[mid]) / 2.0)


def row_medians(vals: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each row's ``median`` of its first ``counts[i]`` values (NaN where none): the
    very floats :func:`median` gives, a sort per distinct count."""
    if len(counts) and counts[0] > 0 and (counts == counts[0]).all():
        # Every row as long (the usual case: ranks with the same history).
        k = int(counts[0])
        s = np.sort(vals[:, :k], axis=1)
        mid = k // 2
        return s[:, mid] if k % 2 else (s[:, mid - 1] + s[:, mid]) / 2.0
    out = np.full(len(counts), np.nan)
    for k in np.unique(counts).tolist():
        if k <= 0:
            continue
        sel = np.flatnonzero(counts == k)
        s = np.sort(vals[sel, :k], axis=1)
        mid = k // 2
        out[sel] = s[:, mid] if k % 2 else (s[:, mid - 1] + s[:, mid]) / 2.0
    return out
