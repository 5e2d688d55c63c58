"""Launch the trainer (or any torchrun script) on this machine: argv and a free port.

Used by the tests, ``bench/hooks_overhead`` and ``make demo`` before the lab
exists; the lab launches ranks in its own namespaces (``lab.cluster``).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torchrun's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_argv(
    nproc: int,
    target: Sequence[str] = ("-m", "fsdp_sentinel.trainer"),
    args: Sequence[str] = (),
    *,
    master_port: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """``python -m torch.distributed.run ...`` for ``nproc`` local ranks on loopback.

    ``target`` is ``("-m", module)`` or ``(script,)``.
    """
    port = master_port or free_port()
    head = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
    ]
    return [*head, *target, *args]


def local_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for local ranks: gloo on loopback, one OpenMP thread each."""
    env = dict(os.environ if base is None else base)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
