"""The correlator's pending steps, kept as a count instead of a pass over every rank.

``pending_steps`` was a union of every rank's filed steps, asked for once per
step record while the first step waited: quadratic in ranks. It is now a
count per step kept as records are filed, summarised and dropped as late;
these tests hold it to the union itself (the oracle) through all three.
"""

from __future__ import annotations

import random

from fsdp_sentinel.correlate import Correlator


def union(c: Correlator) -> list[int]:
    steps: set[int] = set()
    for rs in c.ranks.values():
        steps.update(rs.steps)
        steps.update(rs.colls)
    return sorted(steps)


def test_pending_steps_match_the_union_of_every_ranks_filed_steps() -> None:
    rnd = random.Random(3)
    c = Correlator()
    seq = {r: 0 for r in range(6)}
    summarised = -1
    for _ in range(600):
        r = rnd.randrange(6)
        step = rnd.randrange(max(0, summarised - 1), summarised + 5)  # some late ones
        if rnd.random() < 0.7:
            t = 100.0 + step
            c.add_coll({"kind": "coll", "rank": r, "step": step, "seq": seq[r], "op": "all_gather",
                        "bytes": 8, "issue": t, "end": t + 0.01})  # fmt: skip
            seq[r] += 1
        elif step > c.summarised:
            c.add_step({"kind": "step", "rank": r, "step": step, "start": 100.0 + step,
                        "end": 100.5 + step})  # fmt: skip
        if rnd.random() < 0.05 and c.pending_steps():
            summarised = c.pending_steps()[min(1, len(c.pending_steps()) - 1)]
            c.step_summary(summarised, 200.0)  # drops older steps as late too
        assert c.pending_steps() == union(c)
    assert c.late_records > 0  # the drop path was taken
