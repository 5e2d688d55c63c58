"""A rank SIGKILLed in a checkpointing job on the lab: seen lost, resumed, judged as one job.

The whole chain, real: a 4-host lab, the daemon (``fsdp-sentinel run`` with
its probes), the bundled FSDP2 trainer under torchrun ``--max-restarts 1``
with async DCP checkpoints, host 1's rank killed with SIGKILL mid-run
(``fsdp_sentinel.demo.resume``). Oracles: the daemon's own trace (its
verdicts, the ranks' step records with their losses), the lab's fault
record, torchrun's exit codes, the checkpoint folder.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fsdp_sentinel.demo.resume import ResumeConfig, run_resume

pytestmark = [pytest.mark.root, pytest.mark.lab, pytest.mark.torch]

NAME = "fss-rsm"


def test_a_killed_rank_is_flagged_and_the_job_resumes_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    cfg = ResumeConfig(out=tmp_path, lab_name=NAME, steps=16, every=4, kill_step=9)
    try:
        (f,) = run_resume(cfg)
    finally:
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert NAME not in left  # the lab is gone, whatever happened
    assert f.exit_codes == [0, 0, 0, 0]  # every agent finished the job after the restart
    assert f.lost_rank == cfg.victim and f.lost_s is not None and f.lost_s <= 30
    assert f.resumed_s is not None and f.resumed_s <= 30  # the goal, here
    # The newest whole checkpoint at the kill: saved after step 4 or 8.
    assert f.resumed_step in (4, 8) and f.resumed_step <= cfg.kill_step
    assert f.overlap_steps and f.overlap_steps[0] == f.resumed_step
    # The loss curve continues: the steps run twice give the same loss, far
    # inside the loss's own change from one step to the next.
    assert f.max_loss_diff is not None and f.loss_step_change is not None
    assert f.max_loss_diff <= 1e-4 < f.loss_step_change
    # One job, its second attempt, and none of its ranks judged lost or hung
    # once it had resumed (the old attempt's verdicts stay with the old attempt).
    assert f.jobs_seen == [f.job] and f.attempt_seen == 2
    assert not [c for c, _ in f.flagged_after_resume if c in ("rank_lost", "hang")]
