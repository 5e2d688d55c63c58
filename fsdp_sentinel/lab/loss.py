"""Load the lab's packet-drop classifier (drop.bpf.c) with bcc.

The kernel has ``cls_bpf`` but no ``netem``, so loss is a BPF program that
returns ``TC_ACT_SHOT`` for a random fraction of packets. The drop
probability is compiled in as a constant; ``faults.PacketLoss`` hangs the
program on a link's clsact egress hook with pyroute2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("drop.bpf.c")
FUNC = "fss_drop"


def drop_threshold(p: float) -> int:
    """``p`` as a threshold on a uniform u32 (``2**32`` drops everything)."""
    return min(max(round(p * 2**32), 0), 2**32)


def program_text() -> str:
    return SOURCE.read_text()


def load_drop_program(p: float) -> tuple[Any, int, str]:
    """Compile and load; returns (bcc object that owns the fd, prog fd, prog name)."""
    try:
        from bcc import BPF
    except ImportError as e:  # Debian's python3-bpfcc, linked into the venv by setup.sh
        from fsdp_sentinel.lab.config import LabError

        raise LabError(f"packet loss needs bcc (python3-bpfcc): {e}") from e

    bpf = BPF(text=program_text().encode(), cflags=[f"-DDROP_THRESH={drop_threshold(p)}ULL"])
    fn = bpf.load_func(FUNC.encode(), BPF.SCHED_CLS)
    name = fn.name.decode() if isinstance(fn.name, bytes) else str(fn.name)
    return bpf, int(fn.fd), name
