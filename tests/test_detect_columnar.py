"""The columnar paths give the scalar paths' answers, to the last bit.

A step of ``COLUMNAR_RANKS`` ranks or more is summarised as columns
(``Correlator._rank_steps_columnar``, ``cluster.summary._aligned_columns``)
and judged over columns (``detect.columnar``). Real jobs that big cannot run
here, so the thresholds are lowered to 2 and every golden capture and a
synthetic suite are replayed both ways: the verdicts, every report's scores
and figures, the detector's state, the per-rank totals of the snapshot and
cluster mode's leader verdicts must be equal. Then the columnar paths must
actually have run, so a threshold that silently never trips fails here too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fsdp_sentinel import correlate, synth, trace
from fsdp_sentinel.cluster.split import run_split
from fsdp_sentinel.detect import columnar
from fsdp_sentinel.detect.state import TrackColumns
from fsdp_sentinel.jobs import JobRouter
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.rankstep import RankStep, StepRanks

TRACES = Path(__file__).parent / "traces"
GOLDEN = sorted(TRACES.glob("*.jsonl.zst"))


class Seen:
    """What one replay said: verdicts, each step's report, the final tracks and totals."""

    def __init__(self) -> None:
        self.reports: list[Any] = []
        self.columnar_steps = 0
        self.columnar_judged = 0


def _replay(recs: list[dict], monkeypatch: pytest.MonkeyPatch, big: bool) -> dict[str, Any]:
    with monkeypatch.context() as m:
        m.setattr(correlate, "COLUMNAR_RANKS", 2 if big else 1 << 30)
        m.setattr(columnar, "COLUMNAR_RANKS", 2 if big else 1 << 30)
        seen = Seen()
        run, summarise, judge = Pipeline._run, correlate.Correlator.step_summary, columnar.judge

        def spy_run(self: Pipeline, summary: Any) -> Any:
            out = run(self, summary)
            rep = self.last_report
            if rep is not None and rep.step is not None:
                seen.reports.append((rep[:6], tuple(rep.scores), rep.verdicts))
            return out

        def spy_summary(self: correlate.Correlator, step: int, now: float) -> Any:
            s = summarise(self, step, now)
            seen.columnar_steps += isinstance(s.ranks, StepRanks)
            return s

        def spy_judge(*a: Any) -> Any:
            seen.columnar_judged += 1
            return judge(*a)

        m.setattr(Pipeline, "_run", spy_run)
        m.setattr(correlate.Correlator, "step_summary", spy_summary)
        m.setattr(columnar, "judge", spy_judge)
        router = JobRouter()
        verdicts = router.feed_many(recs) + router.end()
        snap = router.snapshot()
        states = [j.pipeline.state for j in router.jobs.values()]
        leader = run_split(recs)
    return {
        "verdicts": verdicts,
        "reports": seen.reports,
        "totals": [
            (
                r.rank,
                r.steps_total,
                r.step_seconds_total,
                r.wait_seconds_total,
                r.step_seconds,
                r.compute_seconds,
                r.wait_seconds,
                r.coll_count_total,
                r.coll_bytes_total,
                r.coll_seconds_total,
                r.step_buckets,
                r.coll_wait_buckets,
            )
            for r in snap.ranks
        ],  # fmt: skip
        "tracks": [sorted(columnar.as_dict(s.tracks).items()) for s in states],
        "leader": leader,
        "columnar": (seen.columnar_steps, seen.columnar_judged),
    }


def _cases() -> Iterator[tuple[str, list[dict]]]:
    for p in GOLDEN:
        yield (
            p.name.split(".")[0],
            [r for r in trace.read_trace(p) if r.get("kind") not in ("verdict", "action")],
        )
    compute, net = synth.SlowCompute, synth.SlowNetwork
    for name, scn in (
        ("compute_8", synth.Scenario(ranks=8, seed=3, faults=(compute(5, 1.45, 10, 30),))),
        ("network_8", synth.Scenario(ranks=8, seed=4, faults=(net(4, 1.6, 10, 30),))),
        ("lost_4", synth.Scenario(seed=5, faults=(synth.Lost(2, 20),))),
        ("drift_4", synth.Scenario(steps=60, seed=6, faults=(synth.SlowDrift(1, 1.4, 10, 60),))),
    ):
        yield name, synth.generate(scn)[0]


CASES = list(_cases())


@pytest.mark.parametrize("recs", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_columns_give_the_scalar_paths_answers(
    recs: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    scalar = _replay(recs, monkeypatch, big=False)
    cols = _replay(recs, monkeypatch, big=True)
    assert scalar["columnar"] == (0, 0)
    assert cols["columnar"][0] > 0 and cols["columnar"][1] > 0, cols["columnar"]
    for key in ("verdicts", "reports", "totals", "tracks", "leader"):
        assert cols[key] == scalar[key], key


def test_a_job_of_many_ranks_is_judged_over_columns_and_flags_its_straggler() -> None:
    scn = synth.Scenario(
        ranks=200, steps=24, mesh=False, faults=(synth.SlowCompute(67, 1.5, 8, 24),)
    )
    pipe = Pipeline()
    flagged = {(v["rank"], v["cause"]) for v in pipe.feed_many(synth.generate(scn)[0])}
    assert flagged == {(67, "compute")}
    assert isinstance(pipe.state.tracks, TrackColumns)
    assert isinstance(pipe.last_report.scores[0].rank, int)  # type: ignore[union-attr]


def _arrays(tracks: TrackColumns) -> list[bytes]:
    hists = (tracks.rel, tracks.ind, tracks.rel_long, tracks.rel_trend, tracks.compute)
    return [a.tobytes() for h in hists for a in h] + [
        a.tobytes() for a in (tracks.ranks, tracks.bad, tracks.clean, tracks.cause)
    ]


def test_a_steps_judgement_leaves_the_last_states_tracks_as_they_were() -> None:
    # The columnar judge pushes onto new histories (the last state's are read,
    # never written), so a state once made stays what it was: a straggler
    # flagged and cleared, every history full, ranks that join late.
    scn = synth.Scenario(
        ranks=80, steps=60, mesh=False, faults=(synth.SlowCompute(11, 1.6, 8, 30),)
    )
    pipe = Pipeline()
    kept: list[tuple[TrackColumns, list[bytes]]] = []
    flagged = set()
    for rec in synth.generate(scn)[0]:
        for v in pipe.feed(rec):
            flagged.add((v["rank"], v["cause"], v["state"]))
        tracks = pipe.state.tracks
        if isinstance(tracks, TrackColumns) and (not kept or kept[-1][0] is not tracks):
            kept.append((tracks, _arrays(tracks)))
    assert (11, "compute", "flagged") in flagged and len(kept) > 40
    assert all(np.all(t.compute.n == 30) for t, _ in kept[-5:])  # full: pushed as one block
    for tracks, was in kept:
        assert _arrays(tracks) == was
    # A history no push replaced is copied for the next state (a rank judged
    # alone writes its row into it).
    last = kept[-1][0]
    nxt = last.with_hists(last.rel, last.ind, last.rel_long, last.rel_trend, last.compute, last)
    assert nxt.rel is not last.rel and nxt.compute.vals is not last.compute.vals
    assert _arrays(nxt) == _arrays(last)


def test_step_ranks_read_back_as_the_rank_steps_they_were_made_of() -> None:
    rows = (
        RankStep(0, 1.5, 0.25, 1.25, 0.0, 0.5, 4, 4),
        RankStep(3, None, 0.5, None, 0.125, 0.0, 0, 2),
    )
    cols = StepRanks.of(rows)
    assert list(cols) == list(rows) and cols[1] == rows[1] and len(cols) == 2
    assert np.isnan(cols.step_s[1]) and cols == rows


def _big_job(ranks: int = 70) -> list[dict]:
    scn = synth.Scenario(
        ranks=ranks, steps=16, seed=9, mesh=False, faults=(synth.SlowCompute(23, 1.5, 6, 16),)
    )
    return synth.generate(scn)[0]


def _edit(recs: list[dict], how: str) -> list[dict]:
    """A big job's records with one step made unusual, as a live stream can make it."""
    out = [dict(r) for r in recs]
    colls = [r for r in out if r["kind"] == "coll" and r["step"] == 7]
    if how == "duplicate":  # a datagram delivered twice
        out.insert(out.index(colls[5]) + 1, dict(colls[5]))
    elif how == "missing":  # one rank's collective lost on the way
        out.remove(colls[9])
    elif how == "groups":  # every record names its group (HSDP-style keys)
        for r in out:
            if r["kind"] == "coll":
                r["group"] = "shard" if r["seq"] % 2 else "replicate"
    elif how == "ill-typed":  # fed straight in: no trace reader checked it
        colls[3]["issue"] = "soon"
    elif how == "float-bytes":  # fits no int64 column, mid-step: the step is kept as records
        colls[len(colls) // 2]["bytes"] = 1.5
    elif how == "other-op":  # one rank's collectives of another op
        for r in colls:
            if r["rank"] == 4:
                r["op"] = "all_reduce"
    return out


@pytest.mark.parametrize(
    ("how", "scalar_steps"),
    [
        ("duplicate", [7]),
        ("missing", [7]),
        ("ill-typed", [7]),
        ("float-bytes", [7]),
        ("groups", []),
        ("other-op", []),
    ],
)
def test_an_unusual_big_step_is_summarised_as_the_scalar_path_does(
    how: str, scalar_steps: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the default threshold, a 70-rank job: the unusual step goes the scalar
    way (group keys and a rank's other op stay columns) and every figure,
    the malformed count included, stays the scalar path's."""
    recs = _edit(_big_job(), how)
    with monkeypatch.context() as m:
        m.setattr(correlate, "COLUMNAR_RANKS", 1 << 30)
        m.setattr(columnar, "COLUMNAR_RANKS", 1 << 30)
        scalar = _summaries(recs)
    cols = _summaries(recs)
    assert not any(scalar.pop("kinds"))
    assert [i for i, k in enumerate(cols.pop("kinds")) if k is None] == scalar_steps
    for key, want in scalar.items():
        assert cols[key] == want, key


def _summaries(recs: list[dict], limits: correlate.StateLimits | None = None) -> dict[str, Any]:
    pipe = Pipeline(limits=limits)
    kinds: list[Any] = []
    steps: list[Any] = []
    summarise = pipe.corr.step_summary

    def spy(step: int, now: float) -> Any:
        s = summarise(step, now)
        kinds.append(s.ranks)
        steps.append((step, tuple(s.ranks)))
        return s

    pipe.corr.step_summary = spy  # type: ignore[method-assign]
    verdicts = pipe.feed_many(recs)
    snap = pipe.snapshot()
    return {
        "verdicts": verdicts,
        "steps": steps,
        "kinds": [k if isinstance(k, StepRanks) else None for k in kinds],
        "malformed": pipe.stats["malformed"],
        "totals": [
            (
                r.rank,
                r.coll_count_total,
                r.coll_bytes_total,
                r.coll_seconds_total,
                r.coll_wait_buckets,
            )
            for r in snap.ranks
        ],  # fmt: skip
    }


def test_a_big_jobs_evicted_steps_are_summarised_from_their_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank past its cap of pending steps drops its oldest: the step's
    records, kept only in the step's columns, come back as records first, and
    every figure stays the scalar path's."""
    limits = correlate.StateLimits(max_pending_steps=1)
    # Rank 11's step record of step 7 lost: the step waits, steps pile up.
    recs = [
        r for r in _big_job() if not (r["kind"] == "step" and r["rank"] == 11 and r["step"] == 7)
    ]
    filed = correlate.Correlator._materialize
    made: list[Any] = []

    def spy(self: correlate.Correlator, step: Any, *a: Any) -> None:
        made.append(step)
        filed(self, step, *a)

    with monkeypatch.context() as m:
        m.setattr(correlate, "COLUMNAR_RANKS", 1 << 30)
        m.setattr(columnar, "COLUMNAR_RANKS", 1 << 30)
        scalar = _summaries(recs, limits)
    monkeypatch.setattr(correlate.Correlator, "_materialize", spy)
    cols = _summaries(recs, limits)
    assert made, "no step of the big job was evicted"
    scalar.pop("kinds")
    cols.pop("kinds")
    for key, want in scalar.items():
        assert cols[key] == want, key


@pytest.mark.parametrize("change", [{"window": 5}, {"window": 2, "sustained_window": 5}])
def test_new_windows_mid_run_give_the_scalar_paths_verdicts(
    change: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thresholds swapped while running (``Pipeline.set_config``): a history
    longer than its new window is shortened only by its next push, so the
    columns step aside (one rank at a time) until every track fits again."""
    from fsdp_sentinel.detect import DetectConfig

    recs = _big_job()
    cut = next(i for i, r in enumerate(recs) if r["kind"] == "step" and r["step"] == 9)

    def run() -> tuple[list[dict], list[Any]]:
        pipe = Pipeline()
        out = pipe.feed_many(recs[:cut])
        pipe.set_config(DetectConfig().with_(**change))
        out += pipe.feed_many(recs[cut:])
        return out, sorted(columnar.as_dict(pipe.state.tracks).items())

    with monkeypatch.context() as m:
        m.setattr(correlate, "COLUMNAR_RANKS", 1 << 30)
        m.setattr(columnar, "COLUMNAR_RANKS", 1 << 30)
        scalar = run()
    cols = run()
    assert cols == scalar
    assert any(v["cause"] == "compute" for v in scalar[0])
