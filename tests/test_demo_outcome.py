"""The demo's scenario table, truth file and judgement, from hand-made records (no root)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_sentinel.demo.outcome import fault_steps, judge, summary_lines, truth
from fsdp_sentinel.demo.run import DemoConfig, TrainerSteps, _FaultDriver, trainer_args, truth_path
from fsdp_sentinel.demo.scenarios import (
    SCENARIOS,
    is_transient,
    min_persistent_steps,
    victim_rank,
)
from fsdp_sentinel.report.model import build
from fsdp_sentinel.trainer.loop import step_line

T0 = 2_000.0


def steps(n: int, ranks: int = 2, dur: float = 1.0) -> list[dict]:
    return [
        {"kind": "step", "rank": r, "step": s, "start": T0 + s * dur, "end": T0 + (s + 1) * dur}
        for s in range(n)
        for r in range(ranks)
    ]


def fault(t: float, end: float | None = None, what: str = "slow_link", rank: int = 1) -> dict:
    rec = {"kind": "fault", "t": t, "host": "h1", "rank": rank, "what": what, "params": {}}
    if end is not None:
        rec["end"] = end
    return rec


def verdict(step: int, rank: int, cause: str, state: str = "flagged") -> dict:
    return {
        "kind": "verdict",
        "t": T0 + step + 0.9,
        "step": step,
        "rank": rank,
        "state": state,
        "cause": cause,
        "score": 2.0,
    }


def test_every_scenario_of_the_issue_is_there_with_its_cause() -> None:
    assert list(SCENARIOS) == [
        "clean",
        "slow-link",
        "slow-path",
        "noisy-neighbor",
        "slow-compute",
        "mild-compute",
        "packet-loss",
        "rank-kill",
        "hang",
        "silent-node",
    ]
    causes = {name: s.cause for name, s in SCENARIOS.items()}
    assert causes == {
        "clean": None,
        "slow-link": "network",
        "slow-path": "network",
        "noisy-neighbor": "network",
        "slow-compute": "compute",
        "mild-compute": "compute",
        "packet-loss": "network",
        "rank-kill": "rank_lost",
        "hang": "hang",
        "silent-node": "rank_lost",
    }
    for s in SCENARIOS.values():
        assert (s.make is None) == (s.what is None)
        if s.what:
            assert s.onset + (s.duration or 0) < s.steps


def test_victim_is_never_rank_zero() -> None:
    assert [victim_rank(n) for n in (2, 3, 4, 8)] == [1, 2, 2, 2]


def test_persistence_rule() -> None:
    # window 3, flag_after 2: two bad of three steps, for two windows in a row
    assert min_persistent_steps(3, 2) == 3
    assert is_transient(1, 3, 2) and is_transient(2, 3, 2)
    assert not is_transient(3, 3, 2) and not is_transient(None, 3, 2)


def test_fault_steps_come_from_the_step_records() -> None:
    # steps s run [T0+s, T0+s+1); onset in step 4, end in step 7 -> steps 4..7
    data = build(steps(10) + [fault(T0 + 4.5, T0 + 7.2)])
    assert fault_steps(data, data.faults[0]) == (4, 7)
    open_ended = build(steps(10) + [fault(T0 + 4.5)])
    assert fault_steps(open_ended, open_ended.faults[0]) == (4, 9)


def test_truth_expects_the_fault_unless_transient() -> None:
    data = build(steps(10) + [fault(T0 + 4.5, T0 + 7.2)])
    doc = truth(data, scenario="slow-link", world_size=2, steps=10)
    assert doc["stragglers"] == [
        {
            "rank": 1,
            "cause": "network",
            "onset_step": 4,
            "end_step": 7,
            "what": "slow_link",
            "onset_t": T0 + 4.5,
        }
    ]
    assert doc["faults"][0]["what"] == "slow_link" and "kind" not in doc["faults"][0]
    assert truth(data, scenario="x", world_size=2, steps=10, transient=True)["stragglers"] == []
    assert truth(build(steps(3)), scenario="clean", world_size=2, steps=3)["stragglers"] == []


@pytest.mark.parametrize(
    ("verdicts", "correct", "hits", "alarms", "missed"),
    [
        ([verdict(6, 1, "network")], True, 1, 0, 0),
        ([], False, 0, 0, 1),
        ([verdict(6, 1, "compute")], False, 0, 1, 1),  # wrong cause
        ([verdict(6, 0, "network")], False, 0, 1, 1),  # wrong rank
        ([verdict(2, 1, "network"), verdict(6, 1, "network")], False, 1, 1, 0),  # before onset
        ([verdict(6, 1, "network"), verdict(7, 0, "network")], False, 1, 1, 0),
        ([verdict(6, 1, "network"), verdict(9, 1, "network", "cleared")], True, 1, 0, 0),
    ],
)
def test_judge(verdicts: list, correct: bool, hits: int, alarms: int, missed: int) -> None:
    data = build(steps(10) + [fault(T0 + 4.5, T0 + 7.2)] + verdicts)
    doc = truth(data, scenario="slow-link", world_size=2, steps=10)
    out = judge(data, doc["stragglers"])
    assert (out.correct, len(out.hits), len(out.false_alarms), len(out.missed)) == (
        correct,
        hits,
        alarms,
        missed,
    )


def test_clean_run_is_correct_only_without_flags() -> None:
    assert judge(build(steps(5)), []).correct
    assert not judge(build(steps(5) + [verdict(3, 0, "compute")]), []).correct


def test_summary_says_what_was_found_in_80_columns() -> None:
    ev = {"srtt_ratio": 3.51234, "srtt_us_touching": 7600.0, "note": "x" * 300, "none": None}
    v = verdict(6, 1, "network") | {"evidence": ev}
    data = build(steps(10, dur=0.5) + [fault(T0 + 2.2, T0 + 3.6), v])
    doc = truth(data, scenario="slow-link", world_size=2, steps=10)
    lines = summary_lines(
        data,
        doc,
        scenario="slow-link",
        elapsed=61.0,
        trace="out/trace.jsonl.zst",
        truth_file="out/trace.truth.json",
        report="out/report.html",
        problems=[],
    )
    text = "\n".join(lines)
    assert all(len(line) < 80 for line in lines), text
    assert "flagged   rank 1 at step 6: cause network" in text
    assert "srtt_ratio=3.51, srtt_us_touching=7600" in text and "none=" not in text
    assert "verdict   correct: rank 1 network, 2 steps after onset" in text
    assert "report    out/report.html" in text


def test_truth_path() -> None:
    assert truth_path(Path("o/trace.jsonl.zst")) == Path("o/trace.truth.json")
    assert truth_path(Path("o/t.jsonl")) == Path("o/t.truth.json")


def test_cpu_fraction_replaces_the_scenarios_share_only() -> None:
    from fsdp_sentinel.demo.run import _FaultDriver

    def fault(**kw: object) -> object:
        return _FaultDriver(DemoConfig(**kw), None, None, None).fault  # type: ignore[arg-type]

    assert fault(scenario="mild-compute").cpu_fraction == 0.2  # type: ignore[attr-defined]
    tuned = fault(scenario="mild-compute", cpu_fraction=0.22, victim=1)
    assert (tuned.cpu_fraction, tuned.host) == (0.22, 1)  # type: ignore[attr-defined]


def test_trainer_args_follow_the_config() -> None:
    cfg = DemoConfig(scenario="slow-compute", steps=12, layers=2, dim=64)
    args = trainer_args(cfg, Path("/s.sock"))
    assert args[args.index("--steps") + 1] == "12"
    assert args[args.index("--socket") + 1] == "/s.sock"
    assert cfg.onset_step() == 8 and cfg.duration() == 10
    assert DemoConfig(fault_steps=0).duration() is None
    assert DemoConfig(fault_steps=1).duration() == 1


def test_trainer_steps_follow_rank_zeros_step_lines_as_the_log_grows(tmp_path: Path) -> None:
    log = tmp_path / "h0.log"
    steps_ = TrainerSteps(log)
    assert steps_.poll() is None  # no log yet
    log.write_text("[W1203 socket.cpp:207] [c10d] a warning\n" + step_line(0, 5.1) + "\n")
    assert steps_.poll() == 1  # step 0 ended: step 1 is in progress
    with log.open("a") as f:
        f.write(step_line(1, 4.9) + "\n" + "step 2 lo")  # the last line half written
    assert steps_.poll() == 2
    with log.open("a") as f:
        f.write("ss 4.7000\nstep_s=0.6 is not a step line\n")
    assert steps_.poll() == 3
    assert steps_.poll() == 3  # nothing new


class _Lab:
    def __init__(self) -> None:
        self.did: list[tuple[str, int | None]] = []

    def inject(self, fault: object, step: int | None = None) -> dict:
        self.did.append(("inject", step))
        return {"kind": "fault", "what": "packet_loss", "host": "h2", "rank": 2}

    def clear(self, fault: object, step: int | None = None) -> dict:
        self.did.append(("clear", step))
        return {"kind": "fault_end", "what": "packet_loss", "host": "h2", "rank": 2}


class _Quiet:
    def emit(self, rec: object) -> None: ...
    def event(self, line: str) -> None: ...
    def note(self, line: str) -> None: ...


def _driver(**kw: object) -> tuple[_FaultDriver, _Lab]:
    lab = _Lab()
    q = _Quiet()
    return _FaultDriver(DemoConfig(**kw), lab, q, q), lab  # type: ignore[arg-type]


def test_a_fault_lasts_its_steps_of_the_trainer_though_the_snapshot_trails() -> None:
    d, lab = _driver(scenario="packet-loss", onset=6, fault_steps=6)
    d.on_step(6, 8)  # the snapshot says 6 while rank 0 is in step 8: onset
    assert lab.did == [("inject", 6)] and d.counting_steps
    d.on_step(12, 13)  # snapshot steps alone would end it here, a step and a half short
    assert lab.did == [("inject", 6)]
    d.on_step(12, 14)
    assert lab.did == [("inject", 6), ("clear", 12)] and not d.counting_steps


def test_without_the_trainers_steps_a_fault_is_counted_in_snapshot_steps() -> None:
    d, lab = _driver(scenario="packet-loss", onset=6, fault_steps=6)
    d.on_step(6)
    d.on_step(11, None)
    assert lab.did == [("inject", 6)]
    d.on_step(12, None)
    assert lab.did == [("inject", 6), ("clear", 12)]


def demo_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_sentinel", "demo", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scenario", "nope"], "invalid choice"),
        (["--ranks", "0"], "must be >= 1"),
        (["--steps", "x"], "not an integer"),
        (["--ranks", "1"], "--ranks must be >= 2"),
        (["--victim", "4"], "--victim 4 is not a rank of 4"),
        (["--scenario", "rank-kill", "--victim", "0"], "rendezvous"),
        (["--lab-name", "demo"], "must start with fss-"),
        (["--steps", "5"], "onset step 8 is not before the last step"),
        (["--scenario", "slow-link", "--cpu-fraction", "0.2"], "for the compute scenarios"),
        (["--scenario", "slow-compute", "--cpu-fraction", "0"], "must be > 0"),
        (["--scenario", "slow-compute", "--cpu-fraction", "1.5"], "at most 1"),
        (["--scenario", "all", "--cpu-fraction", "0.2"], "takes neither"),
        (["--scenario", "all", "--steps", "5"], "slow-link: onset step 8 is not before"),
    ],
)
def test_bad_flags_exit_2(args: list[str], message: str) -> None:
    res = demo_cli(*args)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "usage:" in res.stderr


def test_plain_progress_lines_with_eta() -> None:
    import io

    from fsdp_sentinel.demo.progress import Progress
    from fsdp_sentinel.snapshot import RankView, Snapshot

    now = [0.0]
    buf = io.StringIO()

    def snap(done: int) -> Snapshot:
        return Snapshot(
            ranks=tuple(RankView(rank=r, step=done - 1, steps_total=done) for r in (0, 1))
        )

    with Progress(10, stream=buf, live=False, every=0.0, clock=lambda: now[0]) as p:
        p.update(snap(2))  # first step seen at t=0
        now[0] = 4.0
        p.update(snap(4))  # 2 steps in 4 s: 6 to go -> 12 s
        p.event("injected x")
    lines = buf.getvalue().splitlines()
    assert lines[0] == "[  0.0 s] steps 2/10 (starting)"
    assert lines[1] == "[  4.0 s] steps 4/10, ETA 12 s (starting)"
    assert lines[2] == "[  4.0 s] injected x"
