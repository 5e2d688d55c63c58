"""Which process holds a socket: its inode among a process's open files.

sock_diag names a socket's inode, not its process. The byte tracepoints
already say which process moved bytes on a connection (they run in that
process's context); this is the fallback for a connection that only
retransmitted during a poll, and it reads ``/proc/<pid>/fd`` of the
processes it is given only (the daemon's ranks: a few hundred links, not
the whole machine's), at most once per poll, and only when asked about an
inode it has not seen.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable


class SocketOwners:
    """inode -> pid for the sockets of the processes passed to ``owner``."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._owners: dict[int, int] = {}
        self._scanned_round = -1
        self.round = 0  # bumped by the caller once per poll
        self.scans = 0  # how many scans ran (for tests and the bench)

    def inodes(self, pid: int) -> set[int]:
        """The inodes of every socket ``pid`` holds now (empty if it is gone)."""
        out: set[int] = set()
        fd_dir = f"{self.proc_root}/{pid}/fd"
        with contextlib.suppress(OSError):
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"{fd_dir}/{fd}")
                    if link.startswith("socket:["):
                        out.add(int(link[8:-1]))
        return out

    def _scan(self, pids: Iterable[int]) -> None:
        self.scans += 1
        found: dict[int, int] = {}
        for pid in sorted(set(pids)):
            for inode in self.inodes(pid):
                found.setdefault(inode, pid)
        self._owners = found

    def owner(self, inode: int, pids: Iterable[int]) -> int:
        """The pid among ``pids`` holding socket ``inode`` (0: none of them)."""
        if not inode:
            return 0
        pid = self._owners.get(inode)
        if pid is None and self._scanned_round != self.round:
            self._scanned_round = self.round
            self._scan(pids)
            pid = self._owners.get(inode)
        return pid or 0
