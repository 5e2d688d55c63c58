"""Series counts stay within the bound docs/metrics.md states, and every
family the exporter writes is documented there.

Jobs of several sizes run through the real pipeline (synthetic records, one
with a straggler so verdict series exist); the bound is computed from the
snapshot's own R, P and O, and the series set must not grow with steps.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fsdp_sentinel.exporters.prometheus import families
from fsdp_sentinel.exporters.sanitize import MAX_RANK_SERIES
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.snapshot import Snapshot
from fsdp_sentinel.synth import Scenario, SlowCompute, generate

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def series(snap: Snapshot) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    out = set()
    for fam in families(snap):
        for s in fam.samples:
            out.add((s.name, tuple(sorted(s.labels.items()))))
    return out


def snapshot_of(ranks: int, steps: int) -> Snapshot:
    scn = Scenario(
        ranks=ranks, steps=steps, faults=(SlowCompute(rank=1, factor=3.0, start=5, end=10_000),)
    )
    pipe = Pipeline()
    pipe.feed_many(generate(scn)[0])
    return pipe.snapshot()


def documented_bound(snap: Snapshot) -> int:
    """docs/metrics.md, "Series in all" (no RDMA, NCCL, remediation or probes)."""
    r, p = len(snap.ranks), len(snap.peers)
    o = len({op for rv in snap.ranks for op in rv.coll_count_total})
    return r * (38 + 19 * o) + 5 * p + 51


@pytest.mark.parametrize("ranks", [3, 8, 32])
def test_series_within_the_documented_bound(ranks: int) -> None:
    snap = snapshot_of(ranks, steps=14)
    got = series(snap)
    assert len(snap.ranks) == ranks and snap.peers
    assert any(rv.state != "ok" for rv in snap.ranks)  # verdict series are counted too
    assert len(got) <= documented_bound(snap)
    # the per-rank part is exact: 26 step series and 4 straggler series a rank, ...
    per_family: dict[str, int] = {}
    for name, _ in got:
        per_family[name] = per_family.get(name, 0) + 1
    assert per_family["fsdp_sentinel_step_duration_seconds_bucket"] == 21 * ranks
    assert per_family["fsdp_sentinel_straggler"] == 4 * ranks
    assert per_family["fsdp_sentinel_flow_bytes_total"] == 2 * len(snap.peers)


def test_series_do_not_grow_with_steps() -> None:
    # The same job 12 or 36 steps on (the straggler still slow): the very same series.
    short, long = snapshot_of(4, steps=12), snapshot_of(4, steps=36)
    assert [rv.state for rv in short.ranks] == [rv.state for rv in long.ranks]
    assert series(short) == series(long)


def test_every_family_is_documented() -> None:
    documented = set(re.findall(r"^\| `(fsdp_sentinel_\w+)`", DOC.read_text(), re.M))
    import dataclasses

    from test_exporter_prometheus import SNAP, text_of

    from fsdp_sentinel.snapshot import ClusterView

    # Cluster mode's families too (a node daemon of `run --cluster`).
    snap = dataclasses.replace(SNAP, cluster=(ClusterView("j", "n0", "node"),))
    exported = {f.name for f in text_string_to_metric_families(text_of(snap))}
    # the text parser names counters without _total and histograms by family
    exported = {n for n in exported if n.startswith("fsdp_sentinel_")}
    doc_families = {re.sub(r"_total$", "", n) for n in documented}
    assert exported == doc_families, exported ^ doc_families


def test_past_the_rank_cap_the_rest_are_one_other_and_the_sums_hold() -> None:
    # A real pipeline's snapshot of 8 ranks, made 300 by relabelling (jobs of
    # thousands of ranks are what the cap is for; the fold only reads views).
    base = snapshot_of(8, 20)
    ranks = [dataclasses.replace(base.ranks[i % 8], rank=i) for i in range(300)]
    flagged = next(r for r in ranks if r.state != "ok" and r.rank >= MAX_RANK_SERIES)
    peers = [dataclasses.replace(base.peers[i % len(base.peers)], rank=i) for i in range(300)]
    snap = dataclasses.replace(base, ranks=tuple(ranks), peers=tuple(peers))
    got: dict[str, set[str | None]] = {}
    values: dict[str, float] = {}
    for fam in families(snap):
        for s in fam.samples:
            got.setdefault(s.name, set()).add(s.labels.get("rank"))
            values[s.name] = values.get(s.name, 0.0) + s.value
    kept = got["fsdp_sentinel_wait_seconds_total"]
    assert len(kept) == MAX_RANK_SERIES and "other" in kept
    assert str(flagged.rank) in kept  # a rank with an open verdict is always its own
    assert values["fsdp_sentinel_rank_series_folded"] == 300 - (MAX_RANK_SERIES - 1)
    # Counters and histograms keep their sums over every rank.
    assert values["fsdp_sentinel_wait_seconds_total"] == pytest.approx(
        sum(r.wait_seconds_total for r in ranks)
    )
    assert values["fsdp_sentinel_network_bytes_total"] == pytest.approx(
        sum(r.tx_bytes_total + r.rx_bytes_total for r in ranks)
    )
    assert values["fsdp_sentinel_flow_bytes_total"] == pytest.approx(
        sum(p.tx_bytes_total + p.rx_bytes_total for p in peers)
    )
    assert len(got["fsdp_sentinel_flow_bytes_total"]) <= MAX_RANK_SERIES
    # Under the cap nothing is folded.
    assert values.get("fsdp_sentinel_rank_series_folded") and not any(
        s.value for fam in families(base) for s in fam.samples
        if s.name == "fsdp_sentinel_rank_series_folded"
    )  # fmt: skip
