"""``fsdp-sentinel replay`` and replay_paths: merging files, live captures, bad input."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_sentinel import replay, synth, trace
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.truth import judge

SCN = synth.Scenario(clock_offset_s=0.02, faults=(synth.SlowCompute(1, 1.5, 10, 30),))


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-sentinel replay")
    replay.add_arguments(parser)
    return replay.main(parser.parse_args(argv))


def write_synthetic(path: Path) -> Path:
    with trace.TraceWriter(path) as w:
        w.write_many(synth.generate(SCN)[0])
    return path


def per_rank_files(tmp: Path, recs: list[dict], ranks: int) -> list[Path]:
    """One file per rank/host, as emitters and per-host daemons would write them."""
    paths = [tmp / f"rank{r}.jsonl" for r in range(ranks)]
    writers = [trace.TraceWriter(p) for p in paths]
    for rec in recs:
        r = rec.get("rank")
        if r is None:
            r = int(str(rec["host"]).rsplit("h", 1)[1])
        writers[r].write(rec)
    for w in writers:
        w.close()
    return paths


def test_per_rank_files_merge_to_the_truth(tmp_path: Path) -> None:
    recs, truth = synth.generate(SCN)
    paths = per_rank_files(tmp_path, recs, SCN.ranks)
    # Give the files in reverse order: the merge is by time, not by argument.
    verdicts = list(replay.replay_paths(list(reversed(paths))))
    assert judge(verdicts, truth).ok, verdicts


def test_live_capture_replays_to_the_verdicts_recorded_in_it(tmp_path: Path) -> None:
    # What the daemon does: feed each record, write it, then the verdicts it caused.
    recs, _ = synth.generate(
        synth.Scenario(faults=(synth.SlowCompute(2, 1.5, 8, 20), synth.Lost(0, 28)))
    )
    live = Pipeline()
    path = tmp_path / "capture.jsonl.zst"
    with trace.TraceWriter(path) as w:
        for rec in recs:
            w.write(rec)
            for v in live.feed(rec):
                w.write(v)
    recorded = replay.recorded_verdicts([path])
    assert len(recorded) >= 3
    assert list(replay.replay_paths([path])) == recorded


def test_cli_prints_a_summary_and_writes_verdicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_synthetic(tmp_path / "t.jsonl")
    out = tmp_path / "v.jsonl"
    assert run_cli([str(src), "--verdicts-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rank   1  flagged  compute" in text
    written = [r for r in trace.read_trace(out) if r["kind"] == "verdict"]
    assert [(v["rank"], v["state"]) for v in written] == [(1, "flagged"), (1, "cleared")]


def test_verdicts_can_go_to_a_pipe(tmp_path: Path) -> None:
    # A pipe cannot be fsync'ed; the writer must still deliver every verdict.
    src = write_synthetic(tmp_path / "t.jsonl")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_sentinel",
            "replay",
            str(src),
            "--verdicts-out",
            "/dev/stdout",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    verdicts = [
        json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"kind":"verdict"')
    ]
    assert [(v["rank"], v["state"]) for v in verdicts] == [(1, "flagged"), (1, "cleared")]


def test_truncated_last_line_fails_strict_and_is_skipped_lenient(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_synthetic(tmp_path / "crashed.jsonl")
    n_recs = len(synth.generate(SCN)[0])
    with open(src, "ab") as fh:
        fh.write(b'{"kind":"coll","rank":1,"st')  # the writer died mid-line
    lines = n_recs + 2  # the header, the records, the broken line
    assert run_cli([str(src)]) == 1
    err = capsys.readouterr().err
    assert f"{src}:{lines}: truncated last line" in err
    assert run_cli([str(src), "--lenient"]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 malformed line(s)" in out
    assert "flagged  compute" in out


def test_cli_config_file_changes_thresholds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_synthetic(tmp_path / "t.jsonl")
    cfg = tmp_path / "detect.toml"
    cfg.write_text("[detect]\nmin_effect = 0.9\n")
    assert run_cli([str(src), "--config", str(cfg), "--json"]) == 0
    assert capsys.readouterr().out == ""  # a 1.5x straggler is under a 90 % bar
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"min_efect": 0.2}))
    assert run_cli([str(src), "--config", str(bad)]) == 2
    assert "unknown setting(s): min_efect" in capsys.readouterr().err


def test_cli_missing_file_and_bad_flag_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli([str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run_cli(["--no-such-flag", "x"])
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err
