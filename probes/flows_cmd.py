"""``fsdp-sentinel flows``: the probes alone, printing per-flow figures.

A table (under 80 columns) per interval, or trace-v1 ``flow`` records as JSON
lines with ``--json``; ``--ebpf`` prints the program text and exits.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any, TextIO

HELP = "probes only: per-flow TCP figures for a pid or all, as a table or JSON lines"
DESCRIPTION = (
    "Load the eBPF probes and print, every interval, each TCP flow's bytes\n"
    "sent and received, smoothed RTT and retransmits (deltas over the interval)."
)
EPILOG = """examples:
  fsdp-sentinel flows                      # every process, a table each second
  fsdp-sentinel flows --pid 4242           # only process 4242 (in-kernel filter)
  fsdp-sentinel flows --interval 0.1 --duration 5 --json > flows.jsonl
  fsdp-sentinel flows --ebpf               # print the eBPF program and exit
"""

ROW = "{pid:>7} {src:<21} {dst:<21} {tx:>6} {rx:>6} {rtt:>7} {retr:>4}"


def _interval(text: str) -> float:
    value = float(text)
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError("interval must be between 0.1 and 3600 seconds")
    return value


def _duration(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("duration must be >= 0 (0: until Ctrl-C)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pid",
        type=int,
        action="append",
        metavar="P",
        help="trace only this process (repeatable); default: all",
    )
    parser.add_argument(
        "--interval",
        type=_interval,
        default=1.0,
        metavar="S",
        help="seconds between reports (0.1..3600, default 1)",
    )
    parser.add_argument(
        "--duration",
        type=_duration,
        default=0.0,
        metavar="S",
        help="stop after S seconds (default 0: until Ctrl-C)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print trace-v1 flow records as JSON lines"
    )
    parser.add_argument("--ebpf", action="store_true", help="print the eBPF program text and exit")


def human_bytes(n: int) -> str:
    """At most 6 characters: 999B, 12.3K, 4.5G."""
    value = float(n)
    for unit in ("B", "K", "M", "G", "T", "P"):
        if value < 999.5 or unit == "P":
            return f"{int(value)}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{n}B"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def format_table(recs: list[dict[str, Any]], t: float) -> list[str]:
    """The table lines for one interval's flow records."""
    lines = [
        time.strftime("%H:%M:%S", time.localtime(t)) + f"  {len(recs)} flow(s)",
        ROW.format(pid="PID", src="SRC", dst="DST", tx="TX", rx="RX", rtt="RTT_MS", retr="RETR"),
    ]
    for r in sorted(recs, key=lambda r: -(r["tx_bytes"] + r["rx_bytes"])):
        srtt = r.get("srtt_us")
        lines.append(
            ROW.format(
                pid=r["pid"],
                src=_clip(r["src"], 21),
                dst=_clip(r["dst"], 21),
                tx=human_bytes(r["tx_bytes"]),
                rx=human_bytes(r["rx_bytes"]),
                rtt=f"{srtt / 1000:.2f}" if srtt else "-",
                retr=r.get("retrans", 0),
            )
        )
    return lines


def main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from .loader import ProbeConfig, ProbeLoadError, ProbePermissionError, ProbeSet

    pids = args.pid or []
    config = ProbeConfig(interval=args.interval, pid_filter=bool(pids), families=("tcp",))
    probes = ProbeSet(config)
    if args.ebpf:
        out.write(probes.program_text())
        return 0
    try:
        report = probes.start()
    except (ProbePermissionError, ProbeLoadError) as e:
        print(f"fsdp-sentinel flows: {e}", file=sys.stderr)
        return 1
    # SIGTERM ends the loop like Ctrl-C, so the probes are always detached.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for line in report.lines():
            if line.startswith("missing"):
                print(f"fsdp-sentinel flows: {line}", file=sys.stderr)
        for pid in pids:
            probes.register_pid(pid)
        print(
            f"fsdp-sentinel flows: {len(report.attached)} probes attached, tracing "
            + (", ".join(map(str, pids)) if pids else "every process"),
            file=sys.stderr,
            flush=True,
        )
        start = time.monotonic()
        while True:
            left = args.duration - (time.monotonic() - start) if args.duration else args.interval
            time.sleep(max(0.0, min(args.interval, left)))
            recs = [r for r in probes.poll() if r["kind"] == "flow"]
            if args.json:
                for r in recs:
                    out.write(json.dumps(r, separators=(",", ":")) + "\n")
            else:
                out.write("\n".join(format_table(recs, time.time())) + "\n\n")
            out.flush()
            if args.duration and time.monotonic() - start >= args.duration:
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        probes.close()
