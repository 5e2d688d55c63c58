"""Whatever reaches the pipeline, /metrics and /api/v1/snapshot answer 200.

The strict decoder keeps lone surrogates, control characters, overlong
strings and non-finite numbers out of the ingest path, but the exporter does
not rely on it: these records are fed to the pipeline directly (as a probe,
a bug or a future record kind could bring them) and the exporter, over a real
HTTP server, still answers every scrape, with label values that are UTF-8
without controls, finite numbers in the JSON, and label-keyed families
folded into ``other`` past their cap.
"""

from __future__ import annotations

import contextlib
import json
import math
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families

from fsdp_sentinel.exporters.http import MetricsServer
from fsdp_sentinel.exporters.prometheus import build_registry, families
from fsdp_sentinel.exporters.sanitize import MAX_LABEL_CHARS, MAX_LABEL_VALUES, label, sanitize
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.snapshot import RankView, Snapshot
from fsdp_sentinel.synth import Scenario, generate

OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"

POISON: dict[str, list[dict]] = {
    "lone_surrogate_host": [
        {"kind": "rank", "t": 1.0, "rank": 5, "world_size": 8, "host": "h\ud800x", "pid": 7,
         "addrs": []},
    ],
    "control_chars": [
        {"kind": "rank", "t": 1.0, "rank": 5, "world_size": 8, "host": "a\x00b\x1b[31m\n\x85",
         "pid": 7, "addrs": [], "job": "j\tob"},
    ],
    "overlong": [
        {"kind": "rank", "t": 1.0, "rank": 5, "world_size": 8, "host": "h" * 100_000, "pid": 7,
         "addrs": []},
    ],
    "huge_span": [
        {"kind": "step", "rank": 0, "step": 3, "start": -1e308, "end": 1e308},
    ],
    "nan_and_inf": [
        {"kind": "step", "rank": 1, "step": 3, "start": float("nan"), "end": float("inf")},
        {"kind": "coll", "rank": 1, "step": 3, "seq": 0, "op": "all_gather", "bytes": 10**400,
         "issue": float("-inf"), "end": float("nan")},
    ],
}  # fmt: skip


def _poisoned(case: str) -> Pipeline:
    pipe = Pipeline()
    recs = generate(Scenario(ranks=4, steps=6))[0]
    pipe.feed_many(recs[: len(recs) // 2])
    for rec in POISON[case]:
        # The pipeline may refuse one by raising; the exporter is what is under test.
        with contextlib.suppress(Exception):
            pipe.feed(rec)
    pipe.feed_many(recs[len(recs) // 2 :])
    return pipe


def _get(url: str, accept: str = "") -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.read()


@pytest.fixture
def serve() -> Iterator:
    servers: list[MetricsServer] = []

    def start(snap_fn) -> MetricsServer:  # type: ignore[no-untyped-def]
        srv = MetricsServer(("127.0.0.1", 0), build_registry(snap_fn), snap_fn).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.close()


def _check_scrapes(srv: MetricsServer) -> list:
    code, text = _get(srv.url + "/metrics")
    assert code == 200
    fams = list(text_string_to_metric_families(text.decode("utf-8")))
    code, om = _get(srv.url + "/metrics", OPENMETRICS)
    assert code == 200
    list(parse_openmetrics(om.decode("utf-8")))
    code, body = _get(srv.url + "/api/v1/snapshot")
    assert code == 200
    json.loads(body, parse_constant=lambda c: pytest.fail(f"{c} in the snapshot JSON"))
    code, _ = _get(srv.url + "/healthz")
    assert code == 200
    for fam in fams:
        for s in fam.samples:
            for v in s.labels.values():
                assert len(v) <= MAX_LABEL_CHARS
                assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in v), v
    return fams


@pytest.mark.parametrize("case", sorted(POISON))
def test_a_poisoned_pipeline_is_still_scraped(case: str, serve) -> None:  # type: ignore[no-untyped-def]
    pipe = _poisoned(case)
    snap = pipe.snapshot()
    srv = serve(lambda: snap)
    fams = _check_scrapes(srv)
    names = {f.name for f in fams}
    assert "fsdp_sentinel_step" in names  # the job itself is still exported


def test_raw_poison_in_a_snapshot_is_made_safe(serve) -> None:  # type: ignore[no-untyped-def]
    # Values no pipeline makes today, straight into the snapshot: each of
    # these answered 500 (UnicodeEncodeError, OverflowError, "Out of range float").
    bad = RankView(
        rank=0, host="\udc80" + "x" * 500, job="a\x00", step_seconds_total=math.inf,
        step_buckets=(1,) * 21, tx_bytes_total=10**400, srtt_us=math.nan, score=-math.inf,
        state="flagged", cause="compute", coll_seconds_total={"all_gather": math.nan},
        coll_count_total={"all_gather": 1}, coll_bytes_total={"all_gather": 10**30},
    )  # fmt: skip
    snap = Snapshot(t=math.inf, ranks=(bad,), records_total={"\ud800": 3})
    srv = serve(lambda: snap)
    _check_scrapes(srv)
    clean = sanitize(snap)
    r = clean.ranks[0]
    assert r.host == "\ufffd" + "x" * (MAX_LABEL_CHARS - 1) and r.job == "a\ufffd"
    assert (r.srtt_us, r.score, r.step_seconds_total, clean.t) == (None, None, 0.0, 0.0)
    assert r.tx_bytes_total == (1 << 63) - 1 and r.coll_bytes_total == {"all_gather": (1 << 63) - 1}
    assert clean.records_total == {"\ufffd": 3}


def test_label_keyed_families_fold_into_other_past_their_cap(serve) -> None:  # type: ignore[no-untyped-def]
    n = 1000
    ops = {f"op{i:04d}": i for i in range(n)}
    rank = RankView(rank=0, host="h", coll_count_total=ops, coll_bytes_total=dict(ops),
                    coll_wait_buckets={op: (1,) * 13 for op in ops})  # fmt: skip
    snap = Snapshot(ranks=(rank,), records_total={f"kind{i}": 1 for i in range(n)})
    srv = serve(lambda: snap)
    fams = {f.name: f for f in _check_scrapes(srv)}
    kinds = {s.labels["kind"]: s.value for s in fams["fsdp_sentinel_records"].samples}
    assert len(kinds) == MAX_LABEL_VALUES and "other" in kinds
    assert sum(kinds.values()) == n  # nothing lost: folded
    by_op = {s.labels["op"]: s.value for s in fams["fsdp_sentinel_collective_bytes"].samples}
    assert len(by_op) == MAX_LABEL_VALUES and sum(by_op.values()) == sum(ops.values())
    assert by_op["op0000"] == 0 and by_op["other"] == sum(range(MAX_LABEL_VALUES - 1, n))
    clean = sanitize(snap).ranks[0]
    assert clean.coll_wait_buckets["other"] == (n - MAX_LABEL_VALUES + 1,) * 13


def test_a_clean_snapshot_is_returned_as_it_is() -> None:
    pipe = Pipeline()
    pipe.feed_many(generate(Scenario(ranks=8, steps=8))[0])
    snap = pipe.snapshot()
    assert sanitize(snap) is snap
    assert list(families(snap))  # and exported


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("ok", "ok"),
        ("\ud800", "\ufffd"),
        ("a\nb", "a\ufffdb"),
        ("é✓", "é✓"),
        ("x" * 200, "x" * 128),
    ],
)
def test_label(raw: str, want: str) -> None:
    assert label(raw) == want
