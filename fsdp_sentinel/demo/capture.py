"""Copy a demo run's trace and truth into a golden-trace folder (tests/traces by convention).

Names: ``lab-<name>.jsonl.zst`` and ``lab-<name>.truth.json``, where the name
is the scenario's (``-transient`` added for a fault too short to be flagged),
so the detection tests find each capture next to its truth.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def capture(
    trace: Path, truth_file: Path, folder: Path, scenario: str, name: str | None = None
) -> list[Path]:
    """Copy ``trace`` and ``truth_file`` into ``folder`` as ``lab-<name>``
    (default name: the scenario's); returns the new paths."""
    truth = json.loads(truth_file.read_text())
    if name is None:
        name = scenario + ("-transient" if truth.get("transient") else "")
    name = f"lab-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    dst_trace = folder / f"{name}.jsonl.zst"
    dst_truth = folder / f"{name}.truth.json"
    shutil.copyfile(trace, dst_trace)
    truth["trace"] = dst_trace.name
    dst_truth.write_text(json.dumps(truth, indent=2) + "\n")
    return [dst_trace, dst_truth]
