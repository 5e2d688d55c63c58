"""``fsdp-sentinel demo``: a lab cluster, the bundled trainer, a chosen fault, the daemon.

Builds a namespace lab (one host per rank, 1 Gbit/s links), starts the daemon,
trains the bundled FSDP2 model on every host with torchrun (gloo over the lab
links), injects the scenario's fault at its onset step, shows progress, and
ends with a summary (which rank was flagged, at which step, why, the
evidence, step time before / during / after) plus a trace with its truth file
and an HTML report. ``run.run_demo`` does the work; this module is the
command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_sentinel.demo.scenarios import ALL, DEFAULT, SCENARIOS
from fsdp_sentinel.interrupts import unwinding_on_signals

HELP = "a lab cluster, the bundled trainer, a chosen fault and the daemon, end to end"
DESCRIPTION = (
    "Build a network-namespace lab (one host per rank), start the daemon, train\n"
    "the bundled FSDP2 model on every host, inject a fault, and show which rank\n"
    "the daemon flags and why. Needs root. Ends with a summary, the trace (with\n"
    "its .truth.json) and an HTML report under --out.\n\n"
    "scenarios:\n"
    + "\n".join(f"  {s.name:15} {s.summary}" for s in SCENARIOS.values())
    + f"\n  {ALL:15} every scenario in a row, ending with one table"
)
EPILOG = """examples:
  fsdp-sentinel demo                          # slow-link, 4 ranks, ~2 minutes
  fsdp-sentinel demo --scenario slow-compute --out out/slow-compute
  fsdp-sentinel demo --scenario slow-link --fault-seconds 0.3  # transient: not flagged
  fsdp-sentinel demo --scenario packet-loss --remediate dry-run
  fsdp-sentinel demo --daemons per-host       # a node daemon per host, a leader
  fsdp-sentinel demo --scenario all --strict  # every scenario; exit 3 on a miss

Exit status 0 when the run worked (whatever was found), 1 when it did not;
with --strict, 3 when it worked but the daemon missed a fault that slowed the
job or flagged a rank wrongly (a fault that did not slow the job is no miss).
"""

#: ``--strict``'s exit status for a detector error (1 is a run that failed).
EXIT_WRONG = 3


def _number(kind: type, low: float, strict: bool = False) -> Callable[[str], Any]:
    """An argparse type: ``kind`` (int or float) at least ``low`` (above it if ``strict``)."""
    noun = "an integer" if kind is int else "a number"
    bound = f"> {low:g}" if strict else f">= {low:g}"

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if v < low or (strict and v == low):
            raise argparse.ArgumentTypeError(f"must be {bound}: {text!r}")
        return v

    return parse


_positive = _number(int, 1)
_nonneg = _number(int, 0)
_seconds = _number(float, 0, strict=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scenario",
        choices=[*SCENARIOS, ALL],
        default=DEFAULT,
        help=f"default {DEFAULT}; {ALL}: each in a row (outputs under --out/NAME)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help=f"exit {EXIT_WRONG} on a miss or a false alarm (for scripts and CI)",
    )
    p.add_argument("--ranks", type=_positive, default=4, help="ranks, one per lab host (default 4)")
    p.add_argument("--steps", type=_positive, help="training steps (default: the scenario's)")
    p.add_argument(
        "--remediate",
        choices=("off", "dry-run", "apply"),
        default="off",
        help="passed to the daemon (default off)",
    )
    p.add_argument("--out", type=Path, default=Path("out/demo"), metavar="DIR",
                   help="where the trace, truth, report and logs go (default out/demo)")  # fmt: skip
    f = p.add_argument_group("fault timing")
    f.add_argument("--onset", type=_nonneg, metavar="STEP", help="step of the fault's onset")
    f.add_argument(
        "--fault-steps",
        type=_nonneg,
        metavar="K",
        help="steps the fault lasts (0: to the end); below the detector's persistence it is transient",
    )
    f.add_argument(
        "--fault-seconds",
        type=_seconds,
        metavar="S",
        help="clear the fault S seconds after its onset: a transient spike (overrides --fault-steps)",
    )
    f.add_argument("--victim", type=_nonneg, metavar="RANK", help="the rank that gets the fault")
    f.add_argument(
        "--cpu-fraction",
        type=_seconds,
        metavar="F",
        help="slow-compute, mild-compute: the victim host's share of one core (the scenario's by"
        " default; here 0.22 slows the job ~1.14x, 0.25 not at all)",
    )
    m = p.add_argument_group("lab and job")
    m.add_argument(
        "--lab-name", default="fss-demo", help="lab name, starts with fss- (default fss-demo)"
    )
    m.add_argument(
        "--rate-mbit", type=_seconds, default=1000.0, help="every link's rate (default 1000)"
    )
    m.add_argument("--layers", type=_positive, default=4, help="trainer decoder blocks (default 4)")
    m.add_argument("--dim", type=_positive, default=256, help="trainer model width (default 256)")
    m.add_argument(
        "--interval", type=_seconds, default=0.5, help="daemon poll period (default 0.5 s)"
    )
    m.add_argument("--no-probes", action="store_true", help="run the daemon without eBPF probes")
    m.add_argument(
        "--daemons",
        choices=("one", "per-host"),
        default="one",
        help="one daemon for every lab host (default), or one per host that meet in the "
        "job's own store and follow a leader (docs/cluster.md)",
    )
    m.add_argument("--timeout", type=_seconds, metavar="S", help="stop a job that runs longer")
    m.add_argument("--no-report", action="store_true", help="skip the HTML report")
    m.add_argument(
        "--capture",
        type=Path,
        metavar="DIR",
        help="also copy the trace and truth to DIR/lab-<scenario>.jsonl.zst / .truth.json",
    )
    view = m.add_mutually_exclusive_group()
    view.add_argument("--live", dest="live", action="store_true", default=None,
                      help="live table and progress bar (default on a terminal)")  # fmt: skip
    view.add_argument("--plain", dest="live", action="store_false", help="plain progress lines")


def _check(args: argparse.Namespace) -> str | None:
    if args.ranks < 2:
        return "--ranks must be >= 2 (a job of one rank has no collectives to watch)"
    if args.victim is not None and args.victim >= args.ranks:
        return f"--victim {args.victim} is not a rank of {args.ranks}"
    if args.scenario == "rank-kill" and args.victim == 0:
        return "--victim 0 cannot be killed: its host serves the job's rendezvous store"
    if args.scenario == ALL and (args.victim == 0 or args.cpu_fraction is not None):
        return (
            f"--scenario {ALL} takes neither --victim 0 nor --cpu-fraction (not every scenario can)"
        )
    if args.scenario == ALL:
        return None
    if args.cpu_fraction is not None and SCENARIOS[args.scenario].what != "slow_compute":
        return f"--cpu-fraction is for the compute scenarios, not {args.scenario}"
    if args.cpu_fraction is not None and args.cpu_fraction > 1:
        return "--cpu-fraction must be at most 1 (one core)"
    if not args.lab_name.startswith("fss-"):
        return "--lab-name must start with fss-"
    return None


USAGE = (
    "usage: fsdp-sentinel demo [--scenario NAME] [--ranks N] [--steps N] [--remediate MODE]"
    " [--out DIR] ... (see --help)"
)


def _usage_error(problem: str) -> None:
    """The argparse way: a usage line, then the error (exit status 2 by the caller)."""
    print(f"{USAGE}\nfsdp-sentinel demo: error: {problem}", file=sys.stderr)


def _config(args: argparse.Namespace, scenario: str, out: Path) -> Any:
    from fsdp_sentinel.demo.run import DemoConfig

    return DemoConfig(
        scenario=scenario,
        ranks=args.ranks,
        steps=args.steps,
        onset=args.onset,
        fault_steps=args.fault_steps,
        fault_seconds=args.fault_seconds,
        victim=args.victim,
        cpu_fraction=args.cpu_fraction,
        remediate=args.remediate,
        out=out,
        lab_name=args.lab_name,
        rate_mbit=args.rate_mbit,
        layers=args.layers,
        dim=args.dim,
        interval=args.interval,
        probes=not args.no_probes,
        timeout=args.timeout,
        report=not args.no_report,
        live=args.live,
        daemons=args.daemons,
    )


def main(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        _usage_error(problem)
        return 2
    names = list(SCENARIOS) if args.scenario == ALL else [args.scenario]
    outs = {n: args.out / n if args.scenario == ALL else args.out for n in names}
    cfgs = [_config(args, n, outs[n]) for n in names]
    for cfg in cfgs:
        if cfg.onset_step() >= cfg.total_steps() and cfg.plan.what is not None:
            _usage_error(
                f"{cfg.scenario}: onset step {cfg.onset_step()} is not before the last step"
                f" ({cfg.total_steps()} steps)"
            )
            return 2
    if os.geteuid() != 0:
        print(
            "fsdp-sentinel demo: error: needs root (it builds network namespaces, shapes "
            "links with tc and loads eBPF probes)",
            file=sys.stderr,
        )
        return 1
    results = []
    for cfg in cfgs:
        result = _run_one(cfg, args)
        if result is None or isinstance(result, int):
            return result or 1
        results.append(result)
    if args.scenario == ALL:
        from fsdp_sentinel.demo.outcome import table_lines

        print()
        for line in table_lines(
            [(r.truth.get("scenario", "?"), r.data, r.finding) for r in results]
        ):
            print(line)
    if not all(r.worked for r in results):
        return 1
    if args.strict and any(r.finding is not None and r.finding.wrong for r in results):
        return EXIT_WRONG
    return 0


def _run_one(cfg: Any, args: argparse.Namespace) -> Any:
    """One scenario: its result, or an exit status when it could not run at all."""
    from fsdp_sentinel.demo.run import run_demo

    try:
        with unwinding_on_signals():
            result = run_demo(cfg)
    except KeyboardInterrupt:
        print("fsdp-sentinel demo: interrupted; lab, job and daemon removed", file=sys.stderr)
        return 130
    except Exception as e:  # a lab or daemon that could not start: say what, exit 1
        print(f"fsdp-sentinel demo: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print()
    for line in result.summary:
        print(line)
    if args.capture and result.worked:
        from fsdp_sentinel.demo.capture import capture

        for path in capture(result.trace, result.truth_path, args.capture, cfg.scenario):
            print(f"captured  {path}")
    return result
