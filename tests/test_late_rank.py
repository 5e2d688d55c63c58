"""A rank whose records come late is alive; a rank that goes silent is lost.

``bench/load`` (64 ranks, each rank's whole step sent at once, rank 0 first)
gave 63 ``rank_lost`` verdicts on a clean job: rank 0's step record came
before any other rank had sent a record, so step 0 was summarised on rank 0
alone, every other rank's records were dropped as late before they ever
counted as started, no later step waited for them, and they looked silent
while they sent every step. The same happens to any rank whose emitter runs
a step behind. A late record still says its rank is alive
(``Correlator.heard_late``); a rank that really stops is still flagged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from fsdp_sentinel.jobs import JobRouter
from fsdp_sentinel.synth import load_job

RANKS, STEPS = 8, 300  # 15 s of job time at 20 steps/s: three times the 5 s silence


def judge(recs: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], JobRouter]:
    router = JobRouter()
    out: list[dict[str, Any]] = []
    for rec in recs:
        out.extend(router.feed(rec))
    return out, router


def late(router: JobRouter) -> int:
    return router.jobs["load"].pipeline.stats["late"]


def test_a_rank_at_a_time_gives_no_verdict_though_its_first_step_is_late() -> None:
    verdicts, router = judge(load_job(RANKS, STEPS, 2, 1000.0, 20.0, order="rank"))
    assert verdicts == []
    # Step 0 was summarised on rank 0 alone: the others' step-0 records were
    # late (the path this test is about), and nothing after it.
    assert late(router) == (RANKS - 1) * 3


def test_records_in_the_order_they_end_give_no_verdict() -> None:
    verdicts, router = judge(load_job(RANKS, STEPS, 2, 1000.0, 20.0))
    assert verdicts == []
    assert late(router) == 0


def test_a_rank_that_goes_silent_is_still_lost() -> None:
    for order in ("time", "rank"):
        recs = load_job(RANKS, STEPS, 2, 1000.0, 20.0, order=order, silent=(3, 150))
        verdicts, _ = judge(recs)
        flagged = [(v["rank"], v["cause"]) for v in verdicts if v["state"] == "flagged"]
        assert flagged == [(3, "rank_lost")], order
        # Lost after the silence rule's 5 s (100 steps), not before.
        assert verdicts[0]["evidence"]["silent_s"] >= 5.0


def delayed(recs: Iterator[dict[str, Any]], rank: int, steps: int) -> Iterator[dict[str, Any]]:
    """``recs`` with every record of ``rank`` held back until the others are
    ``steps`` steps further on (an emitter that runs that far behind)."""
    held: list[dict[str, Any]] = []
    for rec in recs:
        if rec.get("rank") == rank and rec["kind"] != "rank":
            held.append(rec)
            continue
        if rec["kind"] == "step":
            while held and held[0]["step"] <= rec["step"] - steps:
                yield held.pop(0)
        yield rec
    yield from held


def test_a_rank_whose_emitter_runs_behind_is_not_lost() -> None:
    verdicts, router = judge(delayed(load_job(RANKS, STEPS, 2, 1000.0, 20.0), rank=5, steps=3))
    assert [v for v in verdicts if v["cause"] == "rank_lost"] == []
    assert late(router) > 0  # its records were too late for the summaries, every step
