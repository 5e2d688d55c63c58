"""Every demo scenario end to end, for real: lab, daemon with eBPF probes, FSDP2 on gloo.

Each test runs ``fsdp-sentinel demo`` (a small model, few steps) and checks
the outcome against the ground truth the lab wrote into the trace: the
faulty rank is flagged with the right cause after the onset, and nothing else
is flagged (nothing at all for a clean run and for a fault shorter than the
detector's persistence rule). Afterwards no namespace, link or process of the
lab is left. About a minute per scenario on a 2-core machine.

With ``FSS_CAPTURE_DIR=tests/traces`` each run's trace and truth are also
kept there as a golden trace (lab-<case>.jsonl.zst, lab-<case>.truth.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_sentinel.demo.outcome import judge
from fsdp_sentinel.demo.scenarios import QUICK_RUNS
from fsdp_sentinel.report import load

pytestmark = [pytest.mark.root, pytest.mark.lab, pytest.mark.torch, pytest.mark.kernel]

LAB = "fss-ft"


def leftovers() -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [n.split()[0] for n in names.splitlines() if n.startswith(LAB + "-")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    left += [ln.split(":")[1].strip() for ln in links.splitlines() if f" {LAB}-" in ln]
    cg = Path("/sys/fs/cgroup/cpu")
    left += [p.name for p in cg.glob(LAB + "-*")] if cg.is_dir() else []
    return left


@pytest.fixture(autouse=True)
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")


@pytest.mark.parametrize("case", list(QUICK_RUNS))
def test_scenario_end_to_end(case: str, tmp_path: Path) -> None:
    scenario = case.removesuffix("-transient")
    out = tmp_path / "demo"
    argv = [
        sys.executable, "-m", "fsdp_sentinel", "demo",
        *QUICK_RUNS[case], "--plain", "--lab-name", LAB, "--out", str(out),
    ]  # fmt: skip
    res = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    log = res.stdout[-6000:] + res.stderr[-3000:]
    assert res.returncode == 0, log
    assert leftovers() == [], log

    trace = out / "trace.jsonl.zst"
    truth = json.loads((out / "trace.truth.json").read_text())
    data = load([trace], strict=False)
    # Ground truth from the trace itself, not from the demo's table.
    faults = [f["what"] for f in data.faults]
    if scenario == "clean":
        assert faults == [] and truth["stragglers"] == []
    else:
        what = {"hang": "rank_hang"}.get(scenario, scenario.replace("-", "_"))
        assert faults == [what]
        assert data.faults[0]["rank"] == 2
    if case.endswith("-transient"):
        assert truth["transient"] is True and truth["stragglers"] == []
    elif scenario != "clean":
        cause = {
            "slow-compute": "compute",
            "rank-kill": "rank_lost",
            "hang": "hang",
            "silent-node": "rank_lost",
        }.get(scenario, "network")
        assert [(e["rank"], e["cause"]) for e in truth["stragglers"]] == [(2, cause)]
    assert (out / "report.html").stat().st_size > 20_000
    keep = os.environ.get("FSS_CAPTURE_DIR")
    if keep:  # bench/capture_golden does the same; this saves a second run
        from fsdp_sentinel.demo.capture import capture

        capture(trace, out / "trace.truth.json", Path(keep), scenario, name=case)
    out_ = judge(data, truth["stragglers"])
    assert out_.correct, log
