"""What a demo run found, against what was injected: the truth file and the summary (pure).

Everything here reads a :class:`~fsdp_sentinel.report.model.ReportData` (the
same summary of the trace the HTML report draws), so the terminal summary and
the report agree. The truth file (``<trace>.truth.json``: ``trace.jsonl.zst`` -> ``trace.truth.json``) is made from the
trace's own ``fault`` records; its ``stragglers`` list uses the format of
``fsdp_sentinel.synth.truth_of`` (rank, cause, onset_step, end_step
inclusive), which the detection golden tests read.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from fsdp_sentinel.cost import describe_cost
from fsdp_sentinel.demo.scenarios import CAUSE_OF
from fsdp_sentinel.report.model import ReportData, _median

Record = dict[str, Any]


def fault_steps(data: ReportData, fault: Record) -> tuple[int | None, int | None]:
    """The steps a fault covered, from the trace's step records: the newest step
    any rank had started at its onset, and the newest started before its end
    (inclusive; the last step of the trace when it never ended)."""
    t = float(fault["t"])
    started = [s.step for s in data.steps if s.start <= t]
    onset = max(started) if started else fault.get("step")
    end_t = data.fault_end(fault)
    before_end = [s.step for s in data.steps if s.start < end_t]
    end = max(before_end) if before_end else fault.get("end_step")
    return onset, end


def truth(
    data: ReportData,
    *,
    scenario: str,
    world_size: int,
    steps: int,
    transient: bool = False,
    source: str = "lab capture (fsdp-sentinel demo)",
) -> dict[str, Any]:
    """The ``.truth.json`` of a run: its faults, and the verdicts a correct
    detector gives (none for a clean run or a fault too short to persist)."""
    expect = []
    for f in data.faults:
        cause = CAUSE_OF.get(str(f["what"]))
        if cause is None or transient:
            continue
        onset, end = fault_steps(data, f)
        e: dict[str, Any] = {
            "rank": f["rank"],
            "cause": cause,
            "onset_step": onset,
            "end_step": end,
            "what": f["what"],
            "onset_t": f["t"],
        }
        peer = (f.get("params") or {}).get("peer_rank")
        if f["what"] == "slow_path" and peer is not None:
            # A path has two ends; the verdict may name either (truth.judge).
            e.update(peer_rank=peer, scope="link")
        expect.append(e)
    return {
        "scenario": scenario,
        "source": source,
        "world_size": world_size,
        "steps": steps,
        "transient": transient,
        "faults": [{k: v for k, v in f.items() if k != "kind"} for f in data.faults],
        "stragglers": expect,
    }


@dataclass(frozen=True)
class Outcome:
    """``hits``: flags of an expected rank with the expected cause within its
    span; ``false_alarms``: every other flag (the right rank with the wrong
    cause too); ``missed``: expectations no flag met. ``correct``: nothing
    missed and no false alarm (expecting nothing: no flag at all)."""

    hits: list[Record]
    false_alarms: list[Record]
    missed: list[dict[str, Any]]

    @property
    def correct(self) -> bool:
        return not self.missed and not self.false_alarms


def judge(data: ReportData, expect: list[dict[str, Any]]) -> Outcome:
    """The detection tests' own judgement (:func:`fsdp_sentinel.truth.judge`:
    a flag counts from the onset to 3 steps past the end), split by cause."""
    from fsdp_sentinel.truth import judge as judge_truth

    j = judge_truth(data.verdicts, {"stragglers": expect})
    hits = [v for e, v in j.found if v["cause"] == e["cause"]]
    wrong = [(e, v) for e, v in j.found if v["cause"] != e["cause"]]
    return Outcome(hits, [*(v for _, v in wrong), *j.false], [*(e for e, _ in wrong), *j.missed])


#: A fault that stretched the job's median step by less than this share did
#: not measurably slow it: the detector's own ``min_effect`` (checked equal in
#: the tests), the smallest effect it promises to find.
NO_EFFECT_BELOW = 0.10

#: What a run came to, as :func:`classify` names it.
FOUND, MISSED, NO_EFFECT, CLEAN, FALSE_ALARM = (
    "found",
    "missed",
    "no effect",
    "clean",
    "false alarm",
)


@dataclass(frozen=True)
class Finding:
    """A run's result in one word, and the figures behind it.

    ``status``: ``found`` (every expected rank flagged with its cause, nothing
    else), ``missed`` (an expected rank not flagged while the fault slowed the
    job measurably), ``no effect`` (the fault did not stretch the median step
    by ``NO_EFFECT_BELOW``: nothing to find, so not flagging it is no miss),
    ``clean`` (nothing injected or expected, nothing flagged), ``false alarm``
    (a flag nobody expected, whatever else happened). ``delay``: steps from the
    onset to the first right flag. ``before``/``during``: median step seconds.
    """

    status: str
    delay: int | None
    before: float | None
    during: float | None
    outcome: Outcome

    @property
    def slowdown(self) -> float | None:
        if self.before and self.during:
            return self.during / self.before
        return None

    @property
    def wrong(self) -> bool:
        """A detector error: what ``--strict`` turns into a non-zero exit."""
        return self.status in (MISSED, FALSE_ALARM)


def classify(data: ReportData, truth_doc: dict[str, Any]) -> Finding:
    """Judge a run against its truth, telling a miss from a fault that did nothing."""
    expect = truth_doc["stragglers"]
    out = judge(data, expect)
    ph = data.phases()
    delay = None
    if out.hits and expect and expect[0].get("onset_step") is not None:
        delay = int(out.hits[0]["step"]) - int(expect[0]["onset_step"])
    killed = any(f.get("what") == "rank_kill" for f in data.faults)
    measurable = killed or (
        ph.before is not None
        and ph.during is not None
        and ph.during >= ph.before * (1.0 + NO_EFFECT_BELOW)
    )
    if out.false_alarms:
        status = FALSE_ALARM
    elif out.missed:
        status = MISSED if measurable else NO_EFFECT
    elif out.hits:
        status = FOUND
    else:
        status = CLEAN
    return Finding(status, delay, ph.before, ph.during, out)


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _evidence(ev: Any, lines: int = 3) -> list[str]:
    """``k=v`` pairs (None left out, floats to 3 digits), wrapped to fit 80
    columns after the 10-column label, at most ``lines`` lines."""
    if isinstance(ev, dict):
        parts = []
        for k, v in ev.items():
            if v is None:
                continue
            if isinstance(v, float):
                v = f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
            elif isinstance(v, (list, dict)) and len(str(v)) > 40:
                v = "[...]"
            parts.append(f"{k}={v}")
        text = ", ".join(parts)
    else:
        text = str(ev)
    out = textwrap.wrap(text, 68) or [""]
    if len(out) > lines:
        out = out[:lines]
        out[-1] = out[-1][:64] + " ..."
    return out


def _labelled(label: str, rows: list[str]) -> list[str]:
    return [f"{label if i == 0 else '':10}{row}" for i, row in enumerate(rows)]


def remediation_lines(data: ReportData) -> list[str]:
    """What remediation did (or why not), and the step time falling back after it."""
    out = []
    for v in data.verdicts:
        why = (v.get("evidence") or {}).get("remediation")
        if v.get("state") == "flagged" and isinstance(why, dict) and why.get("tc") != "prioritise":
            out += _labelled("tc", textwrap.wrap(f"rank {v['rank']}: left alone: {why['why']}", 68))
    for a in data.actions:
        state, where = a.get("state"), f"{a.get('host')} {a.get('dev')}"
        if state == "applied":
            t = float(a["t"])
            faults = [f for f in data.faults if float(f["t"]) <= t < data.fault_end(f)]
            end = data.fault_end(faults[0]) if faults else float("inf")
            start = float(faults[0]["t"]) if faults else t
            before = [s.seconds for s in data.steps if start <= s.start and s.end <= t]
            after = [s.seconds for s in data.steps if t <= s.start and s.end <= end]
            out.append(f"tc        prioritised the job's flows on {where} at step {a.get('step')}")
            if before or after:
                out.append(f"          step time {_secs(_median(before))} before it, "
                           f"{_secs(_median(after))} after it (fault in force)")  # fmt: skip
        elif state == "rolled_back":
            out.append(f"tc        restored {where} ({a.get('why', '')})")
        elif state in ("failed", "dry_run"):
            out += _labelled(
                "tc",
                textwrap.wrap(
                    f"{a.get('what')} {state} on {where}: {a.get('why') or a.get('errno') or ''}",
                    68,
                ),
            )
    return out


def summary_lines(
    data: ReportData,
    truth_doc: dict[str, Any],
    *,
    scenario: str,
    elapsed: float,
    trace: str,
    truth_file: str,
    report: str | None,
    problems: list[str],
) -> list[str]:
    """The end-of-run summary, one string per line, under 80 columns."""
    expect = truth_doc["stragglers"]
    found = classify(data, truth_doc)
    out = found.outcome
    steps = data.step_range()
    lines = [
        f"scenario  {scenario}: {data.world_size or 0} ranks, "
        f"{f'steps {steps[0]}-{steps[1]}' if steps else 'no steps'}, {elapsed:.0f} s",
    ]
    for f in data.faults:
        onset, end = fault_steps(data, f)
        if f["what"] == "rank_kill" or f.get("end") is None:
            span = f"at step {onset}"
        else:
            span = f"steps {onset}-{end}"
        lines.append(f"fault     {f['what']} on {f['host']} (rank {f['rank']}), {span}")
        if f.get("params"):
            lines += _labelled("", _evidence(f["params"], lines=1))
    if not data.faults:
        lines.append("fault     none injected")
    if not any(v.get("state") == "flagged" for v in data.verdicts):
        lines.append("flagged   no rank")
    for v in data.verdicts:
        if v.get("state") == "flagged":
            lines.append(
                f"flagged   rank {v['rank']} at step {v['step']}: cause {v['cause']}, "
                f"score {float(v['score']):.2f}"
            )
            ev = v.get("evidence")
            if isinstance(ev, dict) and ev.get("cost"):
                lines += _labelled("cost", textwrap.wrap(describe_cost(ev["cost"]), 68))
                ev = {k: x for k, x in ev.items() if k != "cost"}
            if ev:
                lines += _labelled("evidence", _evidence(ev))
        elif v.get("state") == "cleared":
            lines.append(f"cleared   rank {v['rank']} at step {v['step']}")
    want = ", ".join(f"rank {e['rank']} {e['cause']}" for e in expect) or "nothing flagged"
    lag = found.delay
    if out.correct and out.hits:
        verdict = f"correct: {want}" + (f", {_steps(lag)} after onset" if lag is not None else "")
    elif out.correct:
        verdict = f"correct: {want}"
    elif found.status == NO_EFFECT:
        verdict = (
            f"the fault did not measurably slow the job (before {_secs(found.before)}, "
            f"during {_secs(found.during)}): nothing to find"
        )
    elif out.missed:
        verdict = f"MISSED: expected {want}"
    else:
        verdict = f"found {want}" if out.hits else f"expected {want}"
    if out.false_alarms:
        alarms = ", ".join(f"rank {v['rank']} {v['cause']} @{v['step']}" for v in out.false_alarms)
        verdict += f"; false alarms: {alarms}"
    lines += _labelled("verdict", textwrap.wrap(verdict, 68))
    ph = data.phases()
    if data.faults:
        lines.append(
            f"step time before {_secs(ph.before)}, during {_secs(ph.during)}, after {_secs(ph.after)}"
            " (median, all ranks)"
        )
    else:
        lines.append(f"step time {_secs(ph.before)} (median, all ranks)")
    lines += remediation_lines(data)
    lines.append(f"trace     {trace}")
    lines.append(f"truth     {truth_file}")
    if report:
        lines.append(f"report    {report}")
    for p in problems:
        lines.append(f"problem   {p}")
    return lines


def table_lines(rows: list[tuple[str, ReportData | None, Finding | None]]) -> list[str]:
    """``--scenario all``'s closing table, one row a scenario, under 80 columns:
    the fault, what came of it, the delay and the median step before/during."""
    head = f"{'scenario':15} {'fault':15} {'result':12} {'delay':>5} {'before':>8} {'during':>8}"
    lines = [head, "-" * len(head)]
    for name, data, found in rows:
        if data is None or found is None:
            lines.append(f"{name:15} {'-':15} {'did not run':12}")
            continue
        fault = ",".join(str(f["what"]) for f in data.faults) or "none"
        delay = "-" if found.delay is None else str(found.delay)
        status = found.status.upper() if found.wrong else found.status
        lines.append(
            f"{name:15} {fault[:15]:15} {status:12} {delay:>5} "
            f"{_secs(found.before):>8} {_secs(found.during):>8}"
        )
    return lines
