"""The demo's fault calibration and its three-way outcome (found / missed / no effect), no root.

The CPU meter reads a fake ``/proc`` tree written by the test, so the
figures it must give are known exactly; the outcome is judged on hand-made
records whose step times say whether the fault slowed the job.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsdp_sentinel.demo.calibrate import CpuMeter, process_cpu_seconds, quota_for
from fsdp_sentinel.demo.outcome import (
    FALSE_ALARM,
    FOUND,
    MISSED,
    NO_EFFECT,
    NO_EFFECT_BELOW,
    classify,
    summary_lines,
    table_lines,
    truth,
)
from fsdp_sentinel.demo.scenarios import SCENARIOS, calibration_start
from fsdp_sentinel.report.model import build

TCK = os.sysconf("SC_CLK_TCK")
T0 = 5_000.0


def write_stat(root: Path, pid: int, utime: int, stime: int, comm: str = "py thon) x") -> None:
    # Fields after the command: state, then 10 more, then utime (14) and stime (15).
    rest = ["S", *["0"] * 10, str(utime), str(stime), *["0"] * 30]
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")


def test_process_cpu_seconds_reads_utime_and_stime_past_odd_names(tmp_path: Path) -> None:
    write_stat(tmp_path, 7, utime=3 * TCK, stime=TCK)
    assert process_cpu_seconds(7, tmp_path) == pytest.approx(4.0)
    assert process_cpu_seconds(8, tmp_path) is None
    # The meter's own process, for real: it has used some CPU, less than its age.
    me = process_cpu_seconds(os.getpid())
    assert me is not None and me > 0


def test_meter_counts_only_processes_seen_at_both_ends(tmp_path: Path) -> None:
    now = [100.0]
    pids = [1, 2]
    write_stat(tmp_path, 1, TCK, 0)
    write_stat(tmp_path, 2, TCK, 0)
    meter = CpuMeter(lambda: list(pids), proc_root=tmp_path, clock=lambda: now[0])
    meter.start()
    now[0] = 104.0
    write_stat(tmp_path, 1, 2 * TCK, TCK)  # +2 s
    pids[:] = [1, 3]  # 2 left, 3 came: neither counts
    write_stat(tmp_path, 3, 50 * TCK, 0)
    use = meter.stop()
    assert (use.cpu, use.wall) == (pytest.approx(2.0), pytest.approx(4.0))
    assert use.fraction == pytest.approx(0.5)


def test_quota_gives_the_intended_slowdown_and_stays_in_bounds() -> None:
    # The model: T' = T * u / f. Measured here: a rank using ~0.26 of a core
    # was slowed 1.14x by 0.22 and 1.24x by 0.21 (BENCHMARKS.md).
    assert quota_for(0.26, 1.2) == pytest.approx(0.26 / 1.2)
    assert 0.26 / quota_for(0.26, 1.8) == pytest.approx(1.8)
    assert quota_for(0.001, 1.8) == 0.02
    assert quota_for(5.0, 1.2) == 1.0
    for bad in ((0.0, 1.2), (0.3, 1.0)):
        with pytest.raises(ValueError):
            quota_for(*bad)


def test_machine_dependent_scenarios_calibrate_and_others_do_not() -> None:
    slow = {n: s.slowdown for n, s in SCENARIOS.items() if s.slowdown}
    assert slow == {"slow-compute": 1.8, "mild-compute": 1.2}
    assert calibration_start(8) == 4 and calibration_start(2) == 1
    assert calibration_start(1) is None and calibration_start(0) is None


class FakeLab:
    """Stands in for the lab's fault API (no root): records what was injected."""

    def __init__(self) -> None:
        self.injected: list = []

    def cgroup_pids(self, host: int) -> list[int]:
        return [os.getpid()]

    def inject(self, fault: object, *, step: int | None = None) -> dict:
        self.injected.append(fault)
        return {"kind": "fault", "what": "slow_compute", "host": "h2", "rank": 2, "params": {}}


class Sink:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def emit(self, rec: dict) -> None:
        self.records.append(rec)


class Quiet:
    def event(self, text: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass


def test_driver_sizes_the_quota_from_the_clean_steps() -> None:
    from fsdp_sentinel.demo.run import DemoConfig, _FaultDriver

    lab, sink = FakeLab(), Sink()
    driver = _FaultDriver(DemoConfig(scenario="mild-compute"), lab, sink, Quiet())  # type: ignore[arg-type]
    for step in range(0, 9):
        driver.on_step(step)
        sum(i * i for i in range(200_000))  # this process's own CPU, measured for real
    (fault,) = lab.injected
    cal = sink.records[0]["params"]["calibration"]
    assert cal["steps"] == "4-7" and cal["target_slowdown"] == 1.2
    assert cal["cpu_used"] > 0 and "fallback" not in cal
    assert fault.cpu_fraction == pytest.approx(max(0.02, min(1.0, cal["cpu_used"] / 1.2)), abs=1e-3)


def test_a_fixed_cpu_fraction_is_not_calibrated() -> None:
    from fsdp_sentinel.demo.run import DemoConfig, _FaultDriver

    lab, sink = FakeLab(), Sink()
    cfg = DemoConfig(scenario="mild-compute", cpu_fraction=0.22)
    driver = _FaultDriver(cfg, lab, sink, Quiet())  # type: ignore[arg-type]
    for step in range(0, 9):
        driver.on_step(step)
    assert lab.injected[0].cpu_fraction == 0.22
    assert "calibration" not in sink.records[0]["params"]


def steps(n: int, slow_from: int, slow_to: int, factor: float) -> list[dict]:
    out, t = [], T0
    for s in range(n):
        dur = factor if slow_from <= s <= slow_to else 1.0
        out += [{"kind": "step", "rank": r, "step": s, "start": t, "end": t + dur} for r in (0, 1)]
        t += dur
    return out


def fault_at(step_start: float, end: float) -> dict:
    return {
        "kind": "fault", "t": step_start, "end": end, "host": "h1", "rank": 1,
        "what": "slow_compute", "params": {},
    }  # fmt: skip


def flag(step: int, rank: int = 1, cause: str = "compute") -> dict:
    return {
        "kind": "verdict", "t": T0 + step + 0.5, "step": step, "rank": rank,
        "state": "flagged", "cause": cause, "score": 1.0,
    }  # fmt: skip


def judged(factor: float, verdicts: list[dict]) -> tuple:
    recs = steps(14, 4, 9, factor)
    onset = next(r["start"] for r in recs if r["step"] == 4)
    end = next(r["start"] for r in recs if r["step"] == 10)
    data = build([*recs, fault_at(onset, end), *verdicts])
    doc = truth(data, scenario="mild-compute", world_size=2, steps=14)
    return data, doc, classify(data, doc)


def test_a_fault_that_did_not_slow_the_job_is_not_a_miss() -> None:
    data, doc, found = judged(1.0 + NO_EFFECT_BELOW / 2, [])
    assert found.status == NO_EFFECT and not found.wrong
    lines = summary_lines(data, doc, scenario="mild-compute", elapsed=1, trace="t",
                          truth_file="u", report=None, problems=[])  # fmt: skip
    text = "\n".join(lines)
    assert "did not measurably slow the job (before 1.00 s," in text and "MISSED" not in text
    assert "nothing to find" in text and all(len(ln) < 80 for ln in lines), text


def test_a_fault_that_slowed_the_job_and_went_unflagged_is_missed() -> None:
    _, _, found = judged(1.3, [])
    assert found.status == MISSED and found.wrong
    assert found.slowdown == pytest.approx(1.3)


def test_found_and_false_alarm() -> None:
    _, _, found = judged(1.3, [flag(6)])
    assert (found.status, found.delay) == (FOUND, 2)
    _, _, wrong = judged(1.3, [flag(6), flag(7, rank=0)])
    assert wrong.status == FALSE_ALARM and wrong.wrong


def test_the_threshold_is_the_detectors_own_minimum_effect() -> None:
    from fsdp_sentinel.detect import DetectConfig

    assert DetectConfig().baseline.min_effect == NO_EFFECT_BELOW


def test_the_all_table_fits_80_columns_and_shouts_only_errors() -> None:
    d1, _, f1 = judged(1.3, [flag(6)])
    d2, _, f2 = judged(1.3, [])
    d3, _, f3 = judged(1.02, [])
    lines = table_lines([("mild-compute", d1, f1), ("slow-compute", d2, f2),
                         ("x", d3, f3), ("rank-kill", None, None)])  # fmt: skip
    assert all(len(ln) < 80 for ln in lines)
    assert lines[2].split()[:4] == ["mild-compute", "slow_compute", "found", "2"]
    assert " MISSED " in lines[3] and "no effect" in lines[4] and "did not run" in lines[5]
