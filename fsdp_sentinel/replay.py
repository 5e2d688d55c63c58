"""``fsdp-sentinel replay``: run the daemon's detection pipeline over trace files.

Merges one or more trace files (one per rank or per host; ``.zst`` or plain)
by record time, feeds them to the very :class:`~fsdp_sentinel.jobs.JobRouter`
the live daemon runs (one :class:`~fsdp_sentinel.pipeline.Pipeline` per job, so
a trace holding several jobs, one after another or at once, has each judged
on its own), and prints a summary of the jobs and their verdicts. ``verdict`` and
``action`` records already in the input are skipped, so replaying a live
capture gives back the verdicts the daemon recorded in it. On a terminal, an
input of a few MB or more shows a progress line on stderr (records/s, ETA).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from fsdp_sentinel import trace
from fsdp_sentinel.detect import DetectConfig
from fsdp_sentinel.jobs import JobRouter, JobSummary
from fsdp_sentinel.progress import ProgressLine, counted, wanted

HELP = "run the detection pipeline over trace files and print its verdicts"
DESCRIPTION = (
    "Merge TRACE files by time and run the same detection pipeline as `fsdp-sentinel run`.\n"
    "Verdict and action records in the input are skipped."
)
EPILOG = """examples:
  fsdp-sentinel replay capture.jsonl.zst
  fsdp-sentinel replay rank0.jsonl rank1.jsonl --verdicts-out verdicts.jsonl
  fsdp-sentinel replay capture.jsonl.zst --config detect.toml --lenient --json
"""

Record = dict[str, Any]


class Feeder(Protocol):
    """What replay feeds: a :class:`JobRouter`, or one :class:`Pipeline` (one job)."""

    def feed(self, rec: Record) -> Sequence[Record]: ...

    def end(self) -> Sequence[Record]: ...


def replay_paths(
    paths: Sequence[str | Path],
    config: DetectConfig | None = None,
    strict: bool = True,
    pipeline: Feeder | None = None,
) -> Iterator[Record]:
    """Verdict records from replaying ``paths`` (merged by time) through a JobRouter.

    ``strict=False`` skips malformed lines (counted by each reader). Pass
    ``pipeline`` (a router, or one Pipeline to judge everything as one job)
    to read its stats or snapshot afterwards.
    """
    pipe = pipeline if pipeline is not None else JobRouter(config)
    return replay_readers([trace.TraceReader(p, strict=strict) for p in paths], pipe)


def progress_bar(readers: Sequence[trace.TraceReader]) -> ProgressLine | None:
    """A progress line on stderr for inputs of a few MB and more, on a terminal."""
    total = sum(os.path.getsize(r.path) for r in readers)
    if not wanted(total):
        return None
    return ProgressLine(total, lambda: sum(r.bytes_read() for r in readers))


def replay_readers(
    readers: Sequence[trace.TraceReader], pipe: Feeder, bar: ProgressLine | None = None
) -> Iterator[Record]:
    """Verdict records from feeding the merged ``readers`` to ``pipe`` (``bar``: progress)."""
    # The cyclic collector's young generation is made roomier for the replay:
    # a step's summary and judgement build a few objects per rank that live
    # until the next step, so at the default threshold (700) a 4,096-rank
    # replay ran ~3,000 collections, two dozen of them full ones over the whole
    # heap, a quarter of its time (BENCHMARKS.md, issue 12, session 15). The
    # pipeline's garbage is freed by reference counts; what sits in cycles
    # waits a little longer. Restored when the replay ends.
    thresholds = gc.get_threshold()
    if thresholds[0] < REPLAY_GC_THRESHOLD:
        gc.set_threshold(REPLAY_GC_THRESHOLD, *thresholds[1:])
    try:
        yield from _replay(readers, pipe, bar)
    finally:
        if gc.get_threshold()[0] == REPLAY_GC_THRESHOLD:
            gc.set_threshold(*thresholds)


#: The young-generation threshold replay runs the cyclic collector with.
REPLAY_GC_THRESHOLD = 100_000


def _replay(
    readers: Sequence[trace.TraceReader], pipe: Feeder, bar: ProgressLine | None
) -> Iterator[Record]:
    # The pipeline ignores header, verdict and action records by itself, so a
    # single file needs no merge and no filter in between (the hot loop): its
    # records go a list at a time to a feeder that takes lists (the same
    # verdicts as one at a time, fewer calls a record).
    feed_batch = getattr(pipe, "feed_batch", None)
    if len(readers) == 1 and feed_batch is not None:
        batches: Iterable[list[Record]] = readers[0].batches()
        if bar is not None:
            batches = _counted_batches(batches, bar)
        for recs in batches:
            out = feed_batch(recs)
            if out:
                yield from out
    else:
        stream: Iterable[Record] = readers[0] if len(readers) == 1 else trace.merge_traces(readers)
        if bar is not None:
            stream = counted(stream, bar)
        feed = pipe.feed
        for rec in stream:
            out = feed(rec)
            if out:
                yield from out
    yield from pipe.end()  # what the stream guard still held aside


def _counted_batches(batches: Iterable[list[Record]], bar: ProgressLine) -> Iterator[list[Record]]:
    """``batches`` unchanged, with ``bar`` told the records given so far."""
    n = 0
    try:
        for recs in batches:
            n += len(recs)
            bar.update(n)
            yield recs
    finally:
        bar.close(n)


def recorded_verdicts(paths: Sequence[str | Path], strict: bool = True) -> list[Record]:
    """The ``verdict`` records stored in trace files (what a live daemon wrote)."""
    readers = [trace.TraceReader(p, strict=strict) for p in paths]
    return [r for r in trace.merge_traces(readers) if r.get("kind") == "verdict"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "traces", nargs="+", metavar="TRACE", help="trace file(s), .jsonl or .jsonl.zst"
    )
    parser.add_argument(
        "--verdicts-out", metavar="FILE", help="write verdict records to this trace file"
    )
    parser.add_argument("--config", metavar="FILE", help="detector settings (JSON or TOML)")
    parser.add_argument(
        "--lenient", action="store_true", help="skip malformed lines (counted) instead of failing"
    )
    parser.add_argument("--json", action="store_true", help="print verdicts as JSON lines")
    parser.add_argument(
        "--check-all",
        action="store_true",
        help="check every record's values, even in frames our writer marked as checked"
        " (a trace from a source you do not trust; docs/trace-format.md)",
    )


def _fmt(v: Record) -> str:
    peer = f" peer={v['peer_rank']}" if "peer_rank" in v else ""
    host = f" host={v['host']}" if v.get("host") else ""
    host += f" job={v['job']}" if v.get("job") else ""
    ev = v.get("evidence") or {}
    unsure = "  (unsure)" if "unsure" in ev else ""
    return (
        f"step {v['step']:>6}  rank {v['rank']:>3}  {v['state']:<8} {v['cause']:<9}"
        f" score {v['score']:<8g}{host}{peer}{unsure}"
    )


def main(args: argparse.Namespace) -> int:
    for p in args.traces:
        if not Path(p).is_file():
            print(f"fsdp-sentinel replay: error: no such file: {p}", file=sys.stderr)
            return 2
    try:
        config = DetectConfig.from_file(args.config) if args.config else None
    except (OSError, ValueError) as e:
        print(f"fsdp-sentinel replay: error: {e}", file=sys.stderr)
        return 2
    pipe = JobRouter(config)
    readers = [
        trace.TraceReader(p, strict=not args.lenient, trust_marks=not args.check_all)
        for p in args.traces
    ]
    writer = trace.TraceWriter(args.verdicts_out) if args.verdicts_out else None
    verdicts: list[Record] = []
    try:
        for v in replay_readers(readers, pipe, progress_bar(readers)):
            verdicts.append(v)
            if writer is not None:
                writer.write(v)
            if args.json:
                print(json.dumps(v, separators=(",", ":")))
    except trace.TraceError as e:
        print(f"fsdp-sentinel replay: error: {e}", file=sys.stderr)
        return 1
    finally:
        if writer is not None:
            writer.close()
    if not args.json:
        st = pipe.stats
        jobs = pipe.summaries()
        print(
            f"{st['records']} records, {st['steps']} steps, "
            f"{sum(j.ranks for j in jobs)} ranks, {len(verdicts)} verdicts"
            + (f", {st['malformed']} malformed" if st["malformed"] else "")
            + (f", {st['late']} late" if st["late"] else "")
            + (f", {st['stale']} stale" if st["stale"] else "")
        )
        if len(jobs) > 1 or any(j.job for j in jobs):
            print(f"{len(jobs)} job(s), each judged on its own:")
            t0 = min(j.started_t for j in jobs)
            for j in jobs:
                print(_fmt_job(j, t0))
        for r in readers:
            if r.skipped:
                print(
                    f"{r.path}: skipped {r.skipped} malformed line(s), first at {r.skipped_lines[:5]}"
                )
        for v in verdicts:
            print(_fmt(v))
        still = [(j, r, c) for j in jobs for r, c in j.open]
        if still:
            print(
                "open at end: "
                + ", ".join(f"rank {r} ({c})" + _job_tag(j, jobs) for j, r, c in still)
            )
        elif not verdicts:
            print("no straggler found")
    return 0


def _job_tag(j: JobSummary, jobs: Sequence[JobSummary]) -> str:
    return f" of job {j.job or '(no id)'}#{j.attempt}" if len(jobs) > 1 else ""


def _fmt_job(j: JobSummary, t0: float) -> str:
    """One line per job (attempt): its size, what was judged, when it ran."""
    end = f"retired at +{j.retired_t - t0:.1f} s" if j.retired_t is not None else "live at end"
    return (
        f"  job {j.job or '(no id)'} attempt {j.attempt}: {j.ranks} ranks, {j.steps} steps,"
        f" {j.verdicts} verdicts; from +{j.started_t - t0:.1f} s, {end}"
    )
