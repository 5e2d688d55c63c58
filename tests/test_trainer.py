"""The bundled trainer: flags, a learning run with no daemon, a stall, HSDP."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fsdp_sentinel.trace import read_trace
from fsdp_sentinel.trainer.config import parse_args
from fsdp_sentinel.trainer.launch import free_port, local_env, torchrun_argv

DONE = re.compile(
    r"done rank=(\d+) steps=(\d+) loss=(\S+) step_s=(\S+) sent=(\d+) dropped=(\d+) hook_errors=(\d+)"
)


def run(argv: list[str], timeout: float = 280) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=local_env(), capture_output=True, text=True, timeout=timeout)


def records(path: Path) -> list[dict[str, Any]]:
    return [r for r in read_trace(path) if r["kind"] != "header"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--bogus"],
        ["--layers", "0"],
        ["--steps", "many"],
        ["--dim", "30", "--heads", "4"],
        ["--delay-steps", "5"],
        ["--delay-steps", "5:3"],
        ["--delay-rank", "1"],
        ["--text", "x.txt", "--vocab", "100"],
    ],
)
def test_bad_flags_exit_2_with_usage(flags: list[str]) -> None:
    proc = run([sys.executable, "-m", "fsdp_sentinel.trainer", *flags], timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: python -m fsdp_sentinel.trainer")


def test_delay_steps_are_half_open() -> None:
    cfg = parse_args(["--delay-rank", "1", "--delay-seconds", "0.5", "--delay-steps", "3:5"])
    assert [s for s in range(8) if cfg.delayed(1, s)] == [3, 4]
    assert not any(cfg.delayed(0, s) for s in range(8))
    open_ended = parse_args(["--delay-rank", "0", "--delay-seconds", "1", "--delay-steps", "6:"])
    assert [s for s in range(9) if open_ended.delayed(0, s)] == [6, 7, 8]
    assert parse_args(["--socket", "off"]).socket is None


@pytest.mark.torch
def test_learns_with_no_daemon_and_reports_drops(tmp_path: Path) -> None:
    steps, stall = 30, 0.25
    proc = run(
        torchrun_argv(
            2,
            args=[
                f"--steps={steps}",
                "--seed=1",
                f"--socket={tmp_path}/nobody-listens.sock",
                f"--trace-out={tmp_path}/rank{{rank}}.jsonl.zst",
                "--delay-rank=1",
                f"--delay-seconds={stall}",
                "--delay-steps=10:12",
            ],
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = {int(m[1]): m for m in DONE.finditer(proc.stdout)}
    assert sorted(done) == [0, 1]
    for rank, m in done.items():
        recs = records(tmp_path / f"rank{rank}.jsonl.zst")
        assert int(m[2]) == steps
        assert int(m[5]) == 0  # sent: nobody listens
        assert int(m[6]) == len(recs)  # every record was dropped, and counted
        assert int(m[7]) == 0
        # The loss really falls: the synthetic tokens follow a learnable pattern.
        losses = [r["loss"] for r in recs if r["kind"] == "step"]
        assert len(losses) == steps
        assert statistics.mean(losses[-5:]) < 0.6 * statistics.mean(losses[:5])
    stalled = records(tmp_path / "rank1.jsonl.zst")
    span = {r["step"]: r["end"] - r["start"] for r in stalled if r["kind"] == "step"}
    assert span[10] >= stall and span[11] >= stall
    faults = [r for r in stalled if r["kind"] == "fault"]
    assert len(faults) == 1
    assert (faults[0]["rank"], faults[0]["step"], faults[0]["end_step"]) == (1, 10, 12)
    assert not [r for r in records(tmp_path / "rank0.jsonl.zst") if r["kind"] == "fault"]


@pytest.mark.torch
def test_hsdp_on_a_2x2_mesh_with_a_text_file(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    proc = run(
        torchrun_argv(
            4,
            args=[
                "--replicate=2",
                "--steps=3",
                "--layers=1",
                "--dim=32",
                "--seq-len=16",
                "--batch=2",
                f"--text={text}",
                "--socket=off",
                f"--trace-out={tmp_path}/rank{{rank}}.jsonl",
            ],
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    views = []
    keys: list[set[tuple[str, int]]] = []
    for rank in range(4):
        recs = records(tmp_path / f"rank{rank}.jsonl")
        assert recs[0]["world_size"] == 4
        colls = [r for r in recs if r["kind"] == "coll"]
        # Sharding is within a replica group of 2; the gradient all-reduce across
        # groups is not an FSDP all-gather/reduce-scatter and is not timed.
        assert {c["group_size"] for c in colls} == {2}
        assert {c["op"] for c in colls} == {"all_gather", "reduce_scatter"}
        # The 2x2 mesh's shard groups are its rows: ranks 0,1 and 2,3.
        assert {c["group"] for c in colls} == {"0-1" if rank < 2 else "2-3"}
        views.append([(c["seq"], c["op"], c["bytes"]) for c in colls])
        keys.append({(c["group"], c["seq"]) for c in colls})
    assert all(v == views[0] for v in views)
    # The same seq in the two shard groups is two collectives: (group, seq) tells them apart.
    assert keys[0] == keys[1] and keys[2] == keys[3] and not keys[0] & keys[2]


@pytest.mark.torch
def test_replicate_that_does_not_divide_the_world_exits_2() -> None:
    env = local_env()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_sentinel.trainer", "--replicate=2", "--socket=off"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "usage: python -m fsdp_sentinel.trainer" in proc.stderr
    assert "--replicate 2 does not divide world size 1" in proc.stderr


@pytest.mark.torch
def test_no_hooks_trains_without_records(tmp_path: Path) -> None:
    proc = run(
        torchrun_argv(
            2,
            args=["--no-hooks", "--steps=2", "--layers=1", "--dim=32", "--seq-len=16", "--batch=2"],
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = list(DONE.finditer(proc.stdout))
    assert len(done) == 2
    assert all((m[5], m[6], m[7]) == ("0", "0", "0") for m in done)
