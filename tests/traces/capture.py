#!/usr/bin/env python3
"""Re-capture the golden traces in this folder from real trainer runs.

Each scenario runs the bundled FSDP2 trainer under ``torchrun`` on this
machine (gloo on CPU, no daemon), with one rank stalled on purpose through the
trainer's ``--delay-*`` flags; the per-rank trace files are merged by time
into one ``<name>.jsonl.zst`` next to its ``<name>.truth.json``. The stall's
measured effect on step time goes into the truth as ``factor``.

    .venv/bin/python tests/traces/capture.py             # every scenario
    .venv/bin/python tests/traces/capture.py slow_compute_2r spike_2r

Lab scenarios (slow link, noisy neighbour, killed rank) are captured by the
lab/demo tools into this folder with the same truth format (docs/detection.md).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_sentinel import trace  # noqa: E402

#: Model shape: about 0.25 s a step for two ranks on two cores, small enough
#: for a fast capture and large enough that scheduling noise stays well under 10 %.
MODEL = ["--dim", "128", "--layers", "4", "--seed", "7"]
NICE = -15 if os.geteuid() == 0 else 0


@dataclass(frozen=True)
class Capture:
    name: str
    ranks: int
    steps: int
    delay_rank: int | None = None
    delay_s: float = 0.0
    delay_steps: tuple[int, int] | None = None  # [a, b)
    transient: bool = False  # the stall is a one-off the detector must ignore
    note: str = ""


CAPTURES = {
    c.name: c
    for c in [
        Capture("clean_2r", 2, 40, note="no fault"),
        Capture("slow_compute_2r", 2, 40, 1, 0.25, (12, 32), note="rank 1 sleeps 0.25 s a step"),
        Capture("mild_compute_2r", 2, 40, 1, 0.05, (12, 32), note="rank 1 sleeps 0.05 s a step"),
        Capture("spike_2r", 2, 40, 1, 0.6, (20, 21), transient=True, note="one 0.6 s stall"),
        Capture("slow_compute_4r", 4, 30, 2, 0.25, (10, 24), note="rank 2 sleeps 0.25 s a step"),
        Capture("clean_4r", 4, 30, note="no fault"),
    ]
}


def _run(cap: Capture, workdir: Path) -> list[str]:
    port = random.randint(20000, 39999)
    cmd = [
        # Above-normal priority: on a shared machine, other work preempting one
        # rank is itself a (real, unplanned) straggler, which a clean capture
        # must not contain.
        "nice",
        "-n",
        str(NICE),
        str(ROOT / ".venv/bin/torchrun"),
        "--nproc-per-node",
        str(cap.ranks),
        "--master-port",
        str(port),
        "-m",
        "fsdp_sentinel.trainer",
        "--steps",
        str(cap.steps),
        *MODEL,
        "--socket",
        "off",
        "--trace-out",
        str(workdir / "rank{rank}.jsonl"),
    ]
    if cap.delay_rank is not None and cap.delay_steps is not None:
        a, b = cap.delay_steps
        cmd += [
            "--delay-rank",
            str(cap.delay_rank),
            "--delay-seconds",
            str(cap.delay_s),
            "--delay-steps",
            f"{a}:{b}",
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, timeout=600)
    return cmd


def _step_times(recs: list[dict]) -> dict[int, float]:
    per: dict[int, list[float]] = {}
    for r in recs:
        if r.get("kind") == "step":
            per.setdefault(r["step"], []).append(r["end"] - r["start"])
    return {s: statistics.median(v) for s, v in per.items()}


def capture(cap: Capture, out: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="fss-capture-") as tmp:
        work = Path(tmp)
        cmd = _run(cap, work)
        files = sorted(work.glob("rank*.jsonl"))
        recs = list(trace.merge_traces([trace.read_trace(f) for f in files]))
    dest = out / f"{cap.name}.jsonl.zst"
    dest.unlink(missing_ok=True)
    with trace.TraceWriter(dest) as w:
        w.write_many(recs)
    steps = _step_times(recs)
    truth: dict = {
        "scenario": cap.name,
        "source": "real capture: bundled FSDP2 trainer, gloo on CPU, torchrun on one machine",
        "command": " ".join(Path(c).name if "/" in c else c for c in cmd),
        "world_size": cap.ranks,
        "steps": cap.steps,
        "note": cap.note,
        "stragglers": [],
    }
    if cap.delay_steps is not None and cap.delay_rank is not None:
        a, b = cap.delay_steps
        inside = [v for s, v in steps.items() if a <= s < b]
        outside = [v for s, v in steps.items() if (s < a or s >= b) and s > 0]
        factor = round(statistics.median(inside) / statistics.median(outside), 3)
        stall = {
            "rank": cap.delay_rank,
            "cause": "compute",
            "onset_step": a,
            "end_step": b - 1,
            "factor": factor,
        }
        if cap.transient:
            truth["transient"] = [stall]
        else:
            truth["stragglers"].append(stall)
    (out / f"{cap.name}.truth.json").write_text(json.dumps(truth, indent=2) + "\n")
    return dest


def main(argv: list[str]) -> int:
    names = argv or list(CAPTURES)
    unknown = [n for n in names if n not in CAPTURES]
    if unknown:
        print(
            f"unknown scenario(s): {', '.join(unknown)}; known: {', '.join(CAPTURES)}",
            file=sys.stderr,
        )
        return 2
    if shutil.which(str(ROOT / ".venv/bin/torchrun")) is None:
        print("needs .venv/bin/torchrun (bash scripts/setup.sh)", file=sys.stderr)
        return 2
    for n in names:
        dest = capture(CAPTURES[n], HERE)
        print(f"{dest.name}: {dest.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
