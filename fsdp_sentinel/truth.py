"""Ground truth for traces (``<trace>.truth.json``) and scoring verdicts against it.

A truth file says which ranks a trace's faults slowed or killed, from which
step, and why (format in docs/detection.md)::

    {"scenario": "slow_compute_2r", "world_size": 2, "steps": 40,
     "stragglers": [{"rank": 1, "cause": "compute", "onset_step": 12, "end_step": 31,
                 "factor": 1.45}],
     "transient": [{"rank": 1, "cause": "compute", "onset_step": 20, "end_step": 20}]}

``stragglers`` lists what must be flagged; an empty one means nothing may be
(a clean trace, a transient spike, a fabric-wide slow-down). ``transient``
(a list of one-off faults, or a flag, as the lab's truth files write it)
documents faults that must *not* be flagged; ``end_step`` may be null (the
fault lasted to the end of the trace). A slow link lists one end as ``rank``
and the other as ``peer_rank`` (with ``"scope": "link"``; a verdict on
either end names it); a slow host ``"scope": "node"``; a slow ageing
``deadline_step``, the step by which it must be flagged. Used by the tests
and by ``bench/detect_accuracy``; pure, no I/O except :func:`load_truth`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def truth_path(trace_path: str | Path) -> Path:
    """``x.jsonl.zst`` / ``x.jsonl`` -> ``x.truth.json``.

    A file named literally ``<trace>.truth.json`` (suffix kept) wins when it
    exists, so both spellings of the name in docs/trace-format.md work.
    """
    p = Path(trace_path)
    literal = p.with_name(p.name + ".truth.json")
    if literal.exists():
        return literal
    name = p.name
    for suffix in (".jsonl.zst", ".jsonl"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return p.with_name(name + ".truth.json")


def load_truth(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("stragglers"), list):
        raise ValueError(f"{path}: a truth file needs a 'stragglers' list")
    for e in data["stragglers"]:
        for key in ("rank", "cause", "onset_step"):
            if key not in e:
                raise ValueError(f"{path}: expectation {e} lacks {key!r}")
    return data


@dataclass(frozen=True)
class Judgement:
    """How one trace's verdicts compare with its truth.

    ``found``: (expectation, first matching flagged verdict); ``missed``:
    expectations nothing flagged; ``false``: flagged verdicts that match no
    expectation (wrong rank, or before its onset, or after its end plus
    slack). ``matched``: flagged verdicts that match one (for precision).
    """

    found: tuple[tuple[dict[str, Any], Record], ...]
    missed: tuple[dict[str, Any], ...]
    false: tuple[Record, ...]
    matched: int

    @property
    def cause_ok(self) -> int:
        return sum(1 for e, v in self.found if v["cause"] == e["cause"])

    @property
    def delays(self) -> list[int]:
        return [int(v["step"]) - int(e["onset_step"] or 0) for e, v in self.found]

    @property
    def ok(self) -> bool:
        return not self.missed and not self.false and self.cause_ok == len(self.found)


def judge(verdicts: Iterable[Record], truth: dict[str, Any], slack_steps: int = 3) -> Judgement:
    """Match ``flagged`` verdicts to the truth's expectations (see :class:`Judgement`)."""
    flagged = [v for v in verdicts if v.get("state") == "flagged"]
    expect = truth.get("stragglers", [])
    found: list[tuple[dict[str, Any], Record]] = []
    missed: list[dict[str, Any]] = []
    used: set[int] = set()
    for e in expect:
        lo = int(e["onset_step"] or 0)
        end = e.get("end_step")
        hi = (10**12 if end is None else int(end)) + slack_steps
        # A link has two ends: a verdict on either names it.
        ends = {e["rank"], e.get("peer_rank", e["rank"])}
        hits = [i for i, v in enumerate(flagged) if v["rank"] in ends and lo <= v["step"] <= hi]
        if hits:
            found.append((e, flagged[hits[0]]))
            used.update(hits)
        else:
            missed.append(e)
    false = tuple(v for i, v in enumerate(flagged) if i not in used)
    return Judgement(found=tuple(found), missed=tuple(missed), false=false, matched=len(used))
