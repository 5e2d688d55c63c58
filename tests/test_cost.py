"""What a straggler costs, from the step times its verdict carries (pure), and where it shows."""

from __future__ import annotations

import pytest

from fsdp_sentinel.cost import describe_cost, straggler_cost
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.synth import Lost, Scenario, SlowCompute, generate


def test_a_stretched_step_priced_per_step_and_per_hour() -> None:
    cost = straggler_cost("compute", job_step_s=1.2, baseline_step_s=1.0, world_size=1024)
    assert cost == {
        "added_share": 0.2,
        "seconds_per_step": 0.2,
        "rank_hours_per_hour": pytest.approx(1024 * 0.2 / 1.2, abs=1e-3),
        "stops_job": False,
    }
    assert describe_cost(cost) == "+20 % a step (0.2 s), 171 rank-hours an hour"


def test_a_lost_or_hung_rank_costs_every_rank() -> None:
    for cause in ("rank_lost", "hang"):
        cost = straggler_cost(cause, None, None, 8)
        assert cost is not None and cost["rank_hours_per_hour"] == 8.0 and cost["stops_job"]
    assert describe_cost(straggler_cost("hang", None, None, 8)) == (
        "stops the job: 8 rank-hours an hour"
    )


def test_missing_or_faster_figures() -> None:
    assert straggler_cost("network", None, 1.0, 4) is None
    assert straggler_cost("network", 1.0, 0.0, 4) is None
    faster = straggler_cost("network", 0.9, 1.0, 4)
    assert faster is not None and faster["seconds_per_step"] == 0.0
    assert straggler_cost("compute", 1.5, 1.0, None)["rank_hours_per_hour"] is None  # type: ignore[index]
    assert describe_cost(None) == ""


def test_every_flagged_verdict_of_a_replayed_job_carries_its_cost() -> None:
    recs, _ = generate(Scenario(ranks=4, steps=30, faults=(SlowCompute(2, 1.6, 10, 30),)))
    pipe = Pipeline()
    verdicts = [v for r in recs for v in pipe.feed(r)]
    flagged = [v for v in verdicts if v["state"] == "flagged"]
    assert flagged, "the synthetic straggler was not flagged"
    for v in flagged:
        ev = v["evidence"]
        expect = straggler_cost(v["cause"], ev["job_step_s"], ev["baseline_step_s"], 4)
        assert ev["cost"] == expect and ev["cost"]["seconds_per_step"] > 0
    snap = pipe.snapshot()
    (view,) = [r for r in snap.ranks if r.rank == 2]
    if view.state == "flagged":
        assert view.cost == pipe.open[2]["evidence"]["cost"]


def test_a_lost_rank_is_priced_as_stopping_the_job() -> None:
    recs, _ = generate(Scenario(ranks=4, steps=20, faults=(Lost(2, 10),), tail_s=10.0))
    pipe = Pipeline()
    lost = [v for r in recs for v in pipe.feed(r) if v["cause"] == "rank_lost"]
    assert lost and lost[0]["evidence"]["cost"]["stops_job"] is True
    assert lost[0]["evidence"]["cost"]["rank_hours_per_hour"] == 4.0


def test_the_cost_is_exported_for_the_flagged_rank_only() -> None:
    from fsdp_sentinel.exporters.prometheus import families

    recs, _ = generate(Scenario(ranks=4, steps=30, faults=(SlowCompute(2, 1.6, 10, 30),)))
    pipe = Pipeline()
    pipe.feed_many(recs)
    snap = pipe.snapshot()
    (flagged,) = [r for r in snap.ranks if r.state != "ok"]
    got = {
        (f.name, s.labels["rank"]): s.value
        for f in families(snap)
        if f.name.startswith("fsdp_sentinel_straggler_cost")
        for s in f.samples
    }
    assert flagged.cost is not None
    want = flagged.cost["rank_hours_per_hour"]
    assert got == {
        ("fsdp_sentinel_straggler_cost_idle_ranks", str(flagged.rank)): want,
        ("fsdp_sentinel_straggler_cost_step_seconds", str(flagged.rank)): flagged.cost[
            "seconds_per_step"
        ],
    }
