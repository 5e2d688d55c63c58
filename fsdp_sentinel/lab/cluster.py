"""Launch a torchrun job on a lab: one torchrun agent per host, gloo over the lab links.

Host ``i`` runs ``torchrun --nnodes N --node-rank i --nproc-per-node K
--master-addr <host 0's address> --master-port P -m MODULE ARGS`` inside its
namespace and cgroup (``Lab.popen``), with ``GLOO_SOCKET_IFNAME`` set to its
lab link so every collective crosses the shaped veth. Static rendezvous:
host 0's agent serves the store on the master port. With one process per
host, rank ``i`` is host ``i``, the convention fault records rely on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdp_sentinel.lab.topology import Lab

DEFAULT_MODULE = "fsdp_sentinel.trainer"


def torchrun_argv(
    lab: Lab,
    node_rank: int,
    module: str,
    module_args: Sequence[str],
    *,
    master_port: int,
    nproc_per_host: int = 1,
    max_restarts: int = 0,
) -> list[str]:
    if max_restarts:
        # Static rendezvous cannot restart a job of several agents: each agent
        # restarts on its own, reads the last round's keys and its workers
        # connect to peers that are not there yet (seen: every host's second
        # attempt failed in connectFullMesh). c10d rendezvous makes every agent
        # join a new round together; hosts keep their ranks (participants are
        # ordered by agent pid, the hosts' launch order).
        where = [
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{lab.hosts[0].addr}:{master_port}",
            "--rdzv-id", f"{lab.config.name}-{master_port}",
            # Host 0 serves the store: torchrun would look for the endpoint's
            # address among the machine's host names, never a namespace's.
            "--rdzv-conf", f"is_host={int(node_rank == 0)}",
            # ...and the workers' MASTER_ADDR is the lab address of host 0,
            # not the machine's host name (unreachable from a namespace).
            "--local-addr", lab.hosts[node_rank].addr,
        ]  # fmt: skip
        head = ["--nnodes", str(len(lab.hosts)), "--nproc-per-node", str(nproc_per_host)]
    else:
        head = ["--nnodes", str(len(lab.hosts)), "--node-rank", str(node_rank)]
        head += ["--nproc-per-node", str(nproc_per_host)]
        where = ["--master-addr", lab.hosts[0].addr, "--master-port", str(master_port)]
    return [
        sys.executable, "-m", "torch.distributed.run",
        *head,
        *where,
        "--max-restarts", str(max_restarts),
        "-m", module, *module_args,
    ]  # fmt: skip


def launch_torchrun(
    lab: Lab,
    module_args: Sequence[str],
    *,
    master_port: int,
    env: Mapping[str, str] | None = None,
    nproc_per_host: int = 1,
    module: str = DEFAULT_MODULE,
    log_dir: str | os.PathLike[str] | None = None,
    max_restarts: int = 0,
    host_env: Mapping[str, Mapping[str, str]] | None = None,
) -> list[subprocess.Popen[Any]]:
    """Start the job on every host; returns the torchrun agents' processes, host order.

    ``env`` is added to each host's environment (after the lab's own:
    ``GLOO_SOCKET_IFNAME``, ``OMP_NUM_THREADS=1`` unless given, and
    ``FSDP_SENTINEL_HOST``), then ``host_env[host name]`` to that host's alone
    (each host's own daemon socket, say). ``max_restarts``: how often each host's
    agent starts its workers again after one fails (torchrun's ``--max-restarts``;
    0: a failed rank ends the job). With ``log_dir`` each host's output goes to
    ``<log_dir>/<host>.log``; otherwise it is inherited.
    """
    procs = []
    try:
        for h in lab.hosts:
            own = (host_env or {}).get(h.name, {})
            full = {"OMP_NUM_THREADS": "1", **(env or {}), **own, "GLOO_SOCKET_IFNAME": h.ifname}
            if max_restarts:
                # A store of the workers' own each round: on the agents' shared
                # store the new round's ranks read the old round's gloo
                # addresses and fail to connect (seen, torch 2.13).
                full.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
            argv = torchrun_argv(
                lab, h.index, module, module_args,
                master_port=master_port, nproc_per_host=nproc_per_host,
                max_restarts=max_restarts,
            )  # fmt: skip
            kw: dict[str, Any] = {}
            if log_dir is not None:
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                out = open(Path(log_dir, f"{h.name}.log"), "wb")  # noqa: SIM115 (child owns it)
                kw = {"stdout": out, "stderr": subprocess.STDOUT}
            try:
                procs.append(lab.popen(h, argv, env=full, **kw))
            finally:
                if "stdout" in kw:
                    kw["stdout"].close()
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    return procs
