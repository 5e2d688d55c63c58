"""A tiny gloo job for checking a lab cluster: all-reduce a tensor and report.

Run by ``torchrun`` on every lab host (``cluster.launch_torchrun(...,
module="fsdp_sentinel.lab.gloo_check")``). Each rank prints one JSON line:
its rank, world size, the all-reduce result check, the seconds per
all-reduce, the network interface gloo was told to use and the cpu cgroup
it runs in, so a test can see that ranks ran where the lab put them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence


def cpu_cgroup(text: str) -> str:
    """The cpu controller's path from a /proc/PID/cgroup text (cgroup v1)."""
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fsdp_sentinel.lab.gloo_check")
    ap.add_argument("--mb", type=float, default=4.0, help="tensor size in MB")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(int(args.mb * 1e6 / 4))
    t0 = time.perf_counter()
    for _ in range(args.iters):
        x.fill_(rank + 1)
        dist.all_reduce(x)
    dt = (time.perf_counter() - t0) / args.iters
    ok = bool(torch.all(x == world * (world + 1) / 2))
    with open("/proc/self/cgroup") as f:
        cg = cpu_cgroup(f.read())
    print(json.dumps({
        "rank": rank, "world_size": world, "ok": ok, "seconds_per_all_reduce": dt,
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "cgroup": cg,
        "host": os.environ.get("FSDP_SENTINEL_HOST"),
    }), flush=True)  # fmt: skip
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
