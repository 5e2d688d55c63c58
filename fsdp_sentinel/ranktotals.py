"""A big job's per-rank running totals, kept as columns (pure).

What the correlator adds up for each rank over its summarised steps (the
snapshot's counters and histograms: steps, step seconds, seconds blocked,
per-op collectives, bytes and seconds, the step and wait histograms, the
newest step's figures and collective keys) is, once a job is summarised as
columns, held here as one array per figure, a row per rank. A step then adds
to every rank it holds in a few numpy operations, where a ``_Rank`` at a time
cost a Python pass over thousands of ranks per step (a sixth of a 4,096-rank
replay; the same pass over 16,384 ranks in the cluster leader).

While a :class:`RankTotals` is held its arrays are the truth and each rank's
own fields are a copy made by :meth:`RankTotals.sync` (the snapshot's and the
stall view's reads sync first). A step added the scalar way folds the arrays
back first (:meth:`RankTotals.sync`, then dropped), so every running sum is
added to in the same order either way: the same floats to the last bit
(``tests/test_detect_columnar.py``). Anything the arrays cannot hold exactly
(an op past ``max_ops``, a byte count past int64, a non-finite figure) is
refused, and the step is added the scalar way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fsdp_sentinel import buckets
from fsdp_sentinel.rankstep import StepRanks

_STEP_BOUNDS = np.asarray(buckets.STEP_DURATION_BOUNDS, dtype=np.float64)
_WAIT_BOUNDS = np.asarray(buckets.COLLECTIVE_WAIT_BOUNDS, dtype=np.float64)
#: Byte counts the int64 columns take (far beyond a step's real transfers).
_MAX_BYTES = 1 << 52
#: Newest-figure tables kept before the unreferenced ones are dropped.
_TABLES = 32


class RankTotals:
    """Running totals of ``states`` (``_Rank`` objects, ascending rank order) as columns."""

    def __init__(self, states: Sequence[Any], max_ops: int) -> None:
        self.states = list(states)
        self.max_ops = max_ops
        n = len(self.states)
        self.ranks = np.fromiter((s.rank for s in self.states), np.int64, n)
        self.steps = np.fromiter((s.steps_total for s in self.states), np.int64, n)
        self.step_s = np.fromiter((s.step_seconds_total for s in self.states), np.float64, n)
        self.wait_s = np.fromiter((s.wait_seconds_total for s in self.states), np.float64, n)
        self.bad = np.fromiter((s.bad_fields for s in self.states), np.int64, n)
        self.step_hist = np.array([s.step_buckets for s in self.states], dtype=np.int64).reshape(
            n, len(_STEP_BOUNDS) + 1
        )
        hists = [s.wait_buckets() for s in self.states]  # counts each rank's backlog
        self.keys: list[str] = []
        seen: set[str] = set()
        for s in self.states:
            for k in s.coll_count:
                if k not in seen:
                    seen.add(k)
                    self.keys.append(k)
        self.count: dict[str, np.ndarray] = {}
        self.nbytes: dict[str, np.ndarray] = {}
        self.secs: dict[str, np.ndarray] = {}
        self.wait_hist: dict[str, np.ndarray] = {}
        for k in self.keys:
            self.count[k] = np.fromiter((s.coll_count.get(k, 0) for s in self.states), np.int64, n)
            self.nbytes[k] = np.array([s.coll_bytes.get(k, 0) for s in self.states], np.int64)
            self.secs[k] = np.fromiter(
                (s.coll_seconds.get(k, 0.0) for s in self.states), np.float64, n
            )
            empty = buckets.empty(buckets.COLLECTIVE_WAIT_BOUNDS)
            self.wait_hist[k] = np.array([h.get(k, empty) for h in hists], dtype=np.int64)
        # Newest figures: row ``last_row`` of table ``last_ref`` (-1: the rank's own).
        self.tables: list[tuple[StepRanks, Sequence[Any]]] = []
        self.last_ref = np.full(n, -1, dtype=np.int64)
        self.last_row = np.zeros(n, dtype=np.int64)
        self.keys_ref = np.full(n, -1, dtype=np.int64)
        self.plan: Any = None  # the newest op plan added (each rank's _op_plan, a cache)

    def rows_of(self, ranks: np.ndarray) -> np.ndarray | None:
        """Each rank's row (None when one of them is not held)."""
        if not len(ranks):
            return ranks.astype(np.int64)
        rows = np.searchsorted(self.ranks, ranks)
        if rows.max() >= len(self.ranks) or not np.array_equal(self.ranks[rows], ranks):
            return None
        return rows

    # ------------------------------------------------------------ adding

    def fits_ops(self, plan: Any) -> bool:
        """Whether a step's op ``plan`` adds up exactly here: every op within the
        cap for every rank, and byte counts int64 holds."""
        new = {key for key, *_ in plan.per_op if key not in self.count}
        if len(self.keys) + len(new) > self.max_ops:
            return False
        return all(0 <= b < _MAX_BYTES for _, _, b, _, _ in plan.per_op) and all(
            not len(a) or int(a.max()) < _MAX_BYTES for a in self.nbytes.values()
        )

    def add_ops(
        self, rows: np.ndarray, plan: Any, op_secs: Sequence[np.ndarray], waits: np.ndarray
    ) -> None:
        """Each of ``rows`` issued the step's collectives of ``plan``: per op its
        summed wait (``op_secs``, in the plan's order) and each wait (``waits``,
        a row per rank)."""
        n = len(self.states)
        nb = len(_WAIT_BOUNDS) + 1
        for (key, cnt, b, pick, at), secs in zip(plan.per_op, op_secs, strict=True):
            if key not in self.count:
                self.keys.append(key)
                self.count[key] = np.zeros(n, np.int64)
                self.nbytes[key] = np.zeros(n, np.int64)
                self.secs[key] = np.zeros(n, np.float64)
                self.wait_hist[key] = np.zeros((n, nb), np.int64)
            self.count[key][rows] += cnt
            self.nbytes[key][rows] += b
            self.secs[key][rows] += secs
            picked = waits if pick is None else waits[:, list(at)]
            # bisect_left per wait (buckets.observe), counted per rank.
            flat = (rows[:, None] * nb + np.searchsorted(_WAIT_BOUNDS, picked, side="left")).ravel()
            self.wait_hist[key] += np.bincount(flat, minlength=n * nb).reshape(n, nb)
        if plan.bad:
            self.bad[rows] += plan.bad
        self.plan = plan

    def add_steps(
        self, rows: np.ndarray, step_s: np.ndarray, wait: np.ndarray, histogram: bool = True
    ) -> None:
        """Each of ``rows`` took ``step_s`` seconds, ``wait`` of them blocked."""
        self.steps[rows] += 1
        self.step_s[rows] += step_s
        self.wait_s[rows] += np.minimum(wait, step_s)
        if histogram:
            nb = len(_STEP_BOUNDS) + 1
            flat = rows * nb + np.searchsorted(_STEP_BOUNDS, step_s, side="left")
            n = len(self.states)
            self.step_hist += np.bincount(flat, minlength=n * nb).reshape(n, nb)

    def set_newest(
        self,
        rows: np.ndarray,
        table: StepRanks,
        keys: Sequence[Any] | None = None,
        key_rows: np.ndarray | None = None,
    ) -> None:
        """``table``'s row ``i`` is now the newest step of ``rows[i]``; ``keys``,
        the newest collective keys of ``key_rows``."""
        if len(self.tables) >= _TABLES:
            self._compact()
        ref = len(self.tables)
        self.tables.append((table, keys or ()))
        self.last_ref[rows] = ref
        self.last_row[rows] = np.arange(len(rows))
        if keys is not None and key_rows is not None:
            self.keys_ref[key_rows] = ref

    def _compact(self) -> None:
        used = np.unique(np.concatenate([self.last_ref, self.keys_ref]))
        used = used[used >= 0]
        remap = np.full(len(self.tables) + 1, -1, dtype=np.int64)  # [-1] stays -1
        remap[used] = np.arange(len(used))
        self.tables = [self.tables[i] for i in used.tolist()]
        self.last_ref = remap[self.last_ref]
        self.keys_ref = remap[self.keys_ref]

    # ------------------------------------------------------------ reading

    def sync(self) -> None:
        """Copy the arrays into each rank's own fields (they stay the truth)."""
        steps, step_s, wait_s = self.steps.tolist(), self.step_s.tolist(), self.wait_s.tolist()
        bad, hist = self.bad.tolist(), self.step_hist.tolist()
        ops = [
            (k, self.count[k].tolist(), self.nbytes[k].tolist(), self.secs[k].tolist(),
             self.wait_hist[k].tolist())
            for k in self.keys
        ]  # fmt: skip
        last_ref, last_row = self.last_ref.tolist(), self.last_row.tolist()
        keys_ref = self.keys_ref.tolist()
        tables, plan = self.tables, self.plan
        for i, s in enumerate(self.states):
            s.steps_total = steps[i]
            s.step_seconds_total = step_s[i]
            s.wait_seconds_total = wait_s[i]
            s.bad_fields = bad[i]
            s.step_buckets = hist[i]
            for k, cnt, nb, sec, wh in ops:
                if cnt[i]:
                    s.coll_count[k] = cnt[i]
                    s.coll_bytes[k] = nb[i]
                    s.coll_seconds[k] = sec[i]
                    s._wait_buckets[k] = wh[i]
            if last_ref[i] >= 0:
                s.last = (tables[last_ref[i]][0], last_row[i])
            if keys_ref[i] >= 0:
                s.keys_done = tables[keys_ref[i]][1]
            if plan is not None and s.coll_count:
                s._op_plan = plan
