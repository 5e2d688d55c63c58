"""Job streams for the tests of several jobs on one node (not a test module).

A synthetic or captured job is moved to its own pids and times and stamped the
way the ingest socket stamps real ones (``host_pid``); the node's own records
(``clock``, ``netdev``) are one stream shared by every job on it.
"""

from __future__ import annotations

import heapq
import json
from typing import Any

from fsdp_sentinel import trace

Record = dict[str, Any]
NODE_KINDS = ("netdev", "clock")


def shifted(rec: Record, dt: float) -> Record:
    rec = dict(rec)
    for k in ("t", "start", "end", "issue"):
        if k in rec:
            rec[k] += dt
    return rec


def as_job(recs: list[Record], job: str | None, pid_base: int, dt: float = 0.0,
           stamp: bool = True) -> tuple[list[Record], list[Record]]:  # fmt: skip
    """A job's own records and its node records: pids moved to ``pid_base + rank``,
    times by ``dt``, ``job`` on its rank records, and (``stamp``) every rank
    record's ``host_pid`` on that rank's records, as the ingest socket does."""
    own: list[Record] = []
    node: list[Record] = []
    pids: dict[int, int] = {}
    for rec in recs:
        rec = shifted(rec, dt)
        if rec["kind"] in NODE_KINDS:
            node.append(rec)
            continue
        if "pid" in rec:
            rec["pid"] = pid_base + rec["pid"] % 1000
        if rec["kind"] == "rank":
            if job is not None:
                rec["job"] = job
            pids[rec["rank"]] = rec["pid"]
        own.append(rec)
    if stamp:
        for rec in own:
            if rec["kind"] in ("rank", "step", "coll", "pending"):
                rec["host_pid"] = pids[rec["rank"]]
    return own, node


def merged(*streams: list[Record]) -> list[Record]:
    # heapq.merge keeps each stream's own order and interleaves by time, so
    # the records of one job and the node keep their order with or without
    # another job in between.
    return [json.loads(json.dumps(r)) for r in heapq.merge(*streams, key=trace.record_time)]
