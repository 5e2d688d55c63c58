"""The trainer's checkpoints: async DCP saves, resuming from the newest whole one.

The torch test runs the real trainer twice under torchrun (FSDP2 over gloo):
the second run resumes from the first's newest checkpoint, and its losses at
the steps both ran must equal the first run's (the same weights, optimizer
moments and batches). A checkpoint is taken while the next step trains, so a
save that did not copy the shards first would be caught here too: the
weights it wrote would be a later step's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_sentinel.trainer.checkpoint import KEEP, Checkpointer, latest, whole
from fsdp_sentinel.trainer.config import parse_args
from fsdp_sentinel.trainer.launch import local_env, torchrun_argv

# Not anchored to a line: both ranks share torchrun's stdout, so another
# process's output can land on the same line as rank 0's (seen once in CI).
STEP = re.compile(r"step (\d+) loss (\d+\.\d+)")
RESUMED = re.compile(r"resumed step=(\d+) from=(\S+) load_s=(\S+)")


@pytest.mark.parametrize(
    "flags",
    [["--checkpoint-every", "3"], ["--checkpoint-dir", "d", "--checkpoint-every", "-1"]],
)
def test_bad_checkpoint_flags_exit_2_with_usage(flags: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "fsdp_sentinel.trainer", *flags],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: python -m fsdp_sentinel.trainer")


def test_checkpoint_flags_parse() -> None:
    cfg = parse_args(["--checkpoint-dir", "/x", "--checkpoint-every", "5"])
    assert (cfg.checkpoint_dir, cfg.checkpoint_every) == ("/x", 5)
    assert parse_args([]).checkpoint_dir is None


def _fake(root: Path, step: int, complete: bool) -> Path:
    p = root / f"step-{step}"
    p.mkdir(parents=True)
    (p / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (p / ".metadata").write_bytes(b"m")
    return p


def test_only_folders_with_metadata_count_and_the_newest_wins(tmp_path: Path) -> None:
    _fake(tmp_path, 4, True)
    _fake(tmp_path, 12, True)
    _fake(tmp_path, 16, False)  # a rank killed mid-save: never resumed from
    (tmp_path / "step-x").mkdir()
    (tmp_path / "notes").write_text("")
    assert [s for s, _ in whole(tmp_path)] == [4, 12]
    assert latest(tmp_path) == (12, tmp_path / "step-12")
    assert latest(tmp_path / "absent") is None


def test_pruning_keeps_the_newest_whole_ones_and_any_newer_half_one(tmp_path: Path) -> None:
    for s in (2, 4, 6):
        _fake(tmp_path, s, True)
    _fake(tmp_path, 3, False)  # older than the newest whole one: a dead save
    _fake(tmp_path, 8, False)  # newer: may be the save in flight
    ck = Checkpointer.__new__(Checkpointer)  # _prune needs only the root
    ck.root = tmp_path
    ck._prune()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["step-4", "step-6", "step-8"] and KEEP == 2


def _train(steps: int, ckpt: Path, every: int) -> str:
    argv = torchrun_argv(2, args=["--steps", str(steps), "--socket", "off", "--log-every", "1",
                                  "--checkpoint-dir", str(ckpt), "--checkpoint-every",
                                  str(every)])  # fmt: skip
    proc = subprocess.run(argv, env=local_env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.torch
def test_a_second_run_resumes_where_the_first_left_off(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = {int(s): float(v) for s, v in STEP.findall(_train(8, ckpt, 3))}
    assert sorted(first) == list(range(8)) and first[7] < first[0]  # it learns
    assert [s for s, _ in whole(ckpt)] == [3, 6]  # saved after steps 3 and 6; none at the end
    out = _train(10, ckpt, 3)
    (resumed,) = RESUMED.findall(out)
    assert int(resumed[0]) == 6 and resumed[1].endswith("step-6")
    second = {int(s): float(v) for s, v in STEP.findall(out)}
    assert sorted(second) == [6, 7, 8, 9]  # steps 0-5 were not run again
    # Steps 6 and 7 ran in both runs: same state, same batches, same loss.
    assert [second[s] for s in (6, 7)] == [first[s] for s in (6, 7)]
    assert second[9] < second[6]
    assert [s for s, _ in whole(ckpt)] == [6, 9]  # pruned to the newest KEEP
