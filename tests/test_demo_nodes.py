"""``demo --daemons per-host``'s merge of the node daemons' traces (pure, files only)."""

from __future__ import annotations

from pathlib import Path

from fsdp_sentinel import trace
from fsdp_sentinel.demo.nodes import merge_node_traces


def _write(path: Path, recs: list[dict]) -> Path:
    w = trace.TraceWriter(path)
    for r in recs:
        w.write(r)
    w.close()
    return path


def _verdict(t: float, rank: int, view: str, state: str = "flagged") -> dict:
    return {"kind": "verdict", "t": t, "step": 5, "rank": rank, "state": state,
            "cause": "compute", "score": 2.0, "job": "j", "evidence": {"view": view}}  # fmt: skip


def test_every_leader_verdict_once_every_node_verdict_as_said(tmp_path: Path) -> None:
    step = {"kind": "step", "rank": 0, "step": 5, "start": 9.0, "end": 10.0}
    leader = _verdict(11.0, 1, "cluster")
    a = _write(tmp_path / "a.jsonl.zst", [step, leader, _verdict(12.0, 0, "node")])
    b = _write(tmp_path / "b.jsonl.zst", [{**step, "rank": 1}, dict(leader),
                                          _verdict(12.5, 1, "node")])  # fmt: skip
    out = tmp_path / "merged.jsonl.zst"
    n = merge_node_traces([a, b, tmp_path / "gone.jsonl.zst"], out)  # a killed node: no file
    got = [r for r in trace.read_trace(out) if r["kind"] != "header"]
    assert n == len(got) == 5
    verdicts = [(v["t"], v["rank"], v["evidence"]["view"]) for v in got if v["kind"] == "verdict"]
    assert verdicts == [(11.0, 1, "cluster"), (12.0, 0, "node"), (12.5, 1, "node")]
    assert sorted(r["rank"] for r in got if r["kind"] == "step") == [0, 1]
    # A second merge replaces the file (the node traces are the record).
    assert merge_node_traces([a, b], out) == 5
