"""The kernel's run statistics of our BPF programs (``run_cnt``, ``run_time_ns``).

The kernel counts a program's runs and run time only while BPF statistics are
enabled (they cost a clock read per run). :class:`RunStats` enables them for
as long as the daemon runs: through ``bpf(BPF_ENABLE_STATS)``, which returns a
file descriptor and keeps statistics on until the descriptor is closed, so the
kernel turns them back off even if the daemon is killed; where that call is
missing (kernels before 5.8) it sets ``kernel.bpf_stats_enabled`` and puts the
previous value back on :meth:`RunStats.close`. The sysctl shows only what
was written to it, so with the first way it keeps reading as before while
statistics are on (the programs' ``run_cnt`` moving is the sign).

:func:`read_fdinfo` reads each program's figures from ``/proc/PID/fdinfo/FD``
(the loading process holds the program fds).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
from pathlib import Path

log = logging.getLogger(__name__)

SYSCTL = "/proc/sys/kernel/bpf_stats_enabled"
_BPF_ENABLE_STATS = 32  # enum bpf_cmd
_BPF_STATS_RUN_TIME = 0  # enum bpf_stats_type
_NR_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}

#: fdinfo fields read per program.
FIELDS = ("run_cnt", "run_time_ns", "recursion_misses")


class RunStats:
    """Holds BPF run statistics on (see the module docstring); ``how`` says
    which way: ``"fd"``, ``"sysctl"`` or ``""`` (could not: figures stay 0)."""

    def __init__(self, sysctl: str = SYSCTL) -> None:
        self._sysctl = Path(sysctl)
        self._fd: int | None = None
        self._restore: str | None = None
        self.how = ""
        fd = _enable_stats_fd()
        if fd is not None:
            self._fd, self.how = fd, "fd"
            return
        try:
            before = self._sysctl.read_text().strip()
            if before != "1":
                self._sysctl.write_text("1\n")
                self._restore = before
            self.how = "sysctl"
        except OSError as e:
            log.warning("cannot enable BPF run statistics (%s): program run figures stay 0", e)

    def describe(self) -> str:
        return {
            "fd": "BPF_ENABLE_STATS, until the daemon exits",
            "sysctl": f"{self._sysctl.name}=1, restored at exit",
        }.get(self.how, "not available: program run figures stay 0")

    def close(self) -> None:
        """Stop holding statistics on (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._restore is not None:
            try:
                self._sysctl.write_text(self._restore + "\n")
            except OSError as e:
                log.warning("cannot restore %s to %s: %s", self._sysctl, self._restore, e)
            self._restore = None


def _enable_stats_fd() -> int | None:
    nr = _NR_BPF.get(platform.machine())
    if nr is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    attr = ctypes.c_uint32(_BPF_STATS_RUN_TIME)  # union bpf_attr.enable_stats.type
    fd = int(libc.syscall(nr, _BPF_ENABLE_STATS, ctypes.byref(attr), ctypes.sizeof(attr)))
    if fd < 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
            log.debug("BPF_ENABLE_STATS failed: %s", os.strerror(err))
        return None
    return fd


def read_fdinfo(
    fds: dict[str, int], pid: int | None = None, proc_root: str = "/proc"
) -> dict[str, dict[str, int]]:
    """Program name -> its :data:`FIELDS` (those the kernel shows), for the
    program fds ``fds`` of process ``pid`` (default: this one)."""
    base = f"{proc_root}/{pid or os.getpid()}/fdinfo/"
    out: dict[str, dict[str, int]] = {}
    for name, fd in fds.items():
        try:  # read each tick for every program: no pathlib, no text layer
            with open(base + str(fd), "rb") as fh:
                text = fh.read().decode()
        except OSError:
            continue  # closed since (detached): nothing to report
        got: dict[str, int] = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key in FIELDS:
                got[key] = int(value.split()[0])
        out[name] = got
    return out
