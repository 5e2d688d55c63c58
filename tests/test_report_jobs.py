"""The report of a trace that holds several jobs: each judged and shown on its own.

A node daemon's trace outlives its jobs; one after another or at once, each
job has ranks 0..N-1 and steps from 0. Oracles: each job reported alone (its
own trace), the synthetic truth, and the lab captures' own verdicts.
"""

from __future__ import annotations

import re
from pathlib import Path

from jobs_support import as_job, merged, shifted

from fsdp_sentinel import synth, trace
from fsdp_sentinel.report import page, write_report
from fsdp_sentinel.report.model import build, build_jobs
from fsdp_sentinel.synth import Scenario, SlowCompute
from fsdp_sentinel.trace import TraceWriter

TRACES = Path(__file__).parent / "traces"


def flags(data: object) -> set[tuple[int, str]]:
    return {(v["rank"], v["cause"]) for v in data.first_flags()}  # type: ignore[attr-defined]


def two_at_once() -> tuple[list[dict], list[dict], list[dict]]:
    """Two synthetic jobs with ids, overlapping in time, and their node records."""
    ra, _ = synth.generate(Scenario(steps=30, faults=(SlowCompute(2, 1.8, 10, 30),), seed=1))
    rb, _ = synth.generate(
        Scenario(steps=30, faults=(SlowCompute(1, 1.8, 12, 30),), seed=2, ranks=3)
    )
    a, node_a = as_job(ra, "job-a", 20000)
    b, node_b = as_job(rb, "job-b", 30000, dt=7.3)
    return a, b, merged(node_a, node_b)


def test_two_jobs_at_once_are_each_reported_as_alone() -> None:
    a, b, node = two_at_once()
    jobs = build_jobs(merged(a, b, node))
    assert [d.job for d in jobs] == ["job-a", "job-b"]
    for data, own in zip(jobs, (a, b), strict=True):
        alone = build(merged(own, node))
        assert data.world_size == alone.world_size
        assert data.steps == alone.steps  # the same split of every step
        assert flags(data) == flags(alone)
        assert data.verdicts_replayed and all(v["job"] == data.job for v in data.verdicts)
    assert flags(jobs[0]) == {(2, "compute")} and flags(jobs[1]) == {(1, "compute")}


def test_two_captures_one_after_another_without_ids_are_two_jobs() -> None:
    first = list(trace.read_trace(TRACES / "lab-clean.jsonl.zst"))
    second = list(trace.read_trace(TRACES / "lab-slow-compute.jsonl.zst"))
    gap = (
        max(trace.record_time(r) for r in first)
        + 5.0
        - min(trace.record_time(r) for r in second if r["kind"] != "header")
    )
    second = [shifted(r, gap) for r in second if r["kind"] != "header"]
    jobs = build_jobs(first + second)
    assert len(jobs) == 2 and [d.job for d in jobs] == ["", ""]  # told apart by their pids
    for data, alone in zip(jobs, (build(first), build(second)), strict=True):
        assert len(data.steps) == len(alone.steps) and data.world_size == alone.world_size
        # The captures' own (live) verdicts, each with the job it was said in.
        assert data.verdicts == alone.verdicts and not data.verdicts_replayed
        assert flags(data) == flags(alone)
    assert flags(jobs[0]) == set() and flags(jobs[1])


def test_the_page_has_an_index_and_a_section_per_job(tmp_path: Path) -> None:
    a, b, node = two_at_once()
    path = tmp_path / "node.jsonl.zst"
    with TraceWriter(path) as w:
        for rec in merged(a, b, node):
            w.write(rec)
    out = tmp_path / "r.html"
    jobs = write_report([path], out)
    html = out.read_text()
    assert len(jobs) == 2 and "2 jobs in this trace" in html
    for i, data in enumerate(jobs):
        section = re.search(rf'<section class="job" id="job{i}">(.*?)</section></section>', html,
                            flags=re.S)  # fmt: skip
        assert section, f"no section for job {i}"
        body = section.group(1)
        assert f"Job {data.job}" in body and f'href="#job{i}"' in html
        assert f'id="plot-job{i}-timeline"' in body
        (flag,) = data.first_flags()
        assert f"rank {flag['rank']} flagged" in body
    # A trace of one job is the one-job page, unchanged.
    one = tmp_path / "a.jsonl.zst"
    with TraceWriter(one) as w:
        for rec in merged(a, node):
            w.write(rec)
    (data,) = write_report([one], tmp_path / "a.html")
    assert (tmp_path / "a.html").read_text() == page.render(data, [str(one)])
    assert 'class="job"' not in (tmp_path / "a.html").read_text()
