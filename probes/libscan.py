"""Finds libnccl and libibverbs in the memory maps of traced processes.

Reads ``/proc/PID/maps`` (root injected for tests); a library is reported as
``/proc/PID/root/<path>``, which names the same file from any mount
namespace (a container's library as well as the host's).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: kind -> basename pattern
LIBRARIES: dict[str, re.Pattern[str]] = {
    "nccl": re.compile(r"^libnccl[^/]*\.so(\.[0-9.]+)?$"),
    "verbs": re.compile(r"^libibverbs\.so(\.[0-9.]+)?$"),
}


#: What every basename LIBRARIES matches begins with.
_STEMS = ("libnccl", "libibverbs.so")


#: The longest wait between two reads of one process's maps (seconds).
RESCAN_MAX_S = 60.0


class LibraryScanner:
    """Reads the maps of the processes it is given, each only when due.

    Reading ``/proc/PID/maps`` makes the kernel walk and name every mapping:
    3.5-6.5 ms of CPU for four torch ranks (~1,800 mappings) here, paid every
    scan. So with ``now`` passed to :meth:`scan`, a process is read when first
    seen, then after ``first_gap`` seconds, and twice as long after each read
    that found nothing new, up to :data:`RESCAN_MAX_S`; one that maps every
    library of :data:`LIBRARIES` is not read again. A library loaded late
    (``dlopen`` at the first collective) is found within that gap.
    """

    def __init__(self, proc_root: str = "/proc", first_gap: float = 5.0) -> None:
        self.proc_root = Path(proc_root)
        self.first_gap = first_gap
        self._seen: set[tuple[int, str]] = set()
        self._due: dict[int, tuple[float, float]] = {}  # pid -> (next read, gap after it)
        self._kinds: dict[int, set[str]] = {}  # pid -> kinds found mapped
        self.reads = 0  # maps files read, for the tests and the curious

    def _pids(self) -> list[int]:
        try:
            return [int(d) for d in os.listdir(self.proc_root) if d.isdigit()]
        except OSError:
            return []

    def scan(
        self, pids: list[int] | None = None, now: float | None = None
    ) -> list[tuple[str, str]]:
        """(kind, path) for libraries newly seen mapped by ``pids`` (all when None).

        ``now`` (monotonic seconds): read only the processes that are due (see
        the class); without it every one is read."""
        found: dict[tuple[str, str], str] = {}
        for pid in self._pids() if pids is None else pids:
            if now is not None and not self._is_due(pid, now):
                continue
            try:
                text = (self.proc_root / str(pid) / "maps").read_text()
            except (OSError, UnicodeDecodeError):
                self.forget(pid)
                continue
            self.reads += 1
            # A trainer maps hundreds of files and rarely these: one search of
            # the text, not a split of every line, in the usual case.
            if not any(stem in text for stem in _STEMS):
                continue
            for line in text.splitlines():
                parts = line.split(None, 5)
                if len(parts) < 6 or not parts[5].startswith("/"):
                    continue
                path = parts[5].strip()
                base = os.path.basename(path)
                for kind, pat in LIBRARIES.items():
                    if pat.match(base):
                        self._kinds.setdefault(pid, set()).add(kind)
                        if (pid, path) not in self._seen:
                            self._seen.add((pid, path))
                            found.setdefault((kind, path), f"{self.proc_root}/{pid}/root{path}")
        return [(kind, where) for (kind, _), where in found.items()]

    def _is_due(self, pid: int, now: float) -> bool:
        """Whether ``pid``'s maps are to be read at ``now``; books its next read if so."""
        if len(self._kinds.get(pid, ())) == len(LIBRARIES):
            return False  # every library it could map is mapped already
        due = self._due.get(pid)
        if due is None:
            self._due[pid] = (now + self.first_gap, self.first_gap)
            return True
        at, gap = due
        if now < at:
            return False
        gap = min(gap * 2.0, RESCAN_MAX_S)
        self._due[pid] = (now + gap, gap)
        return True

    def forget(self, pid: int) -> None:
        """A process gone (or never there): a new one with its pid starts afresh."""
        self._due.pop(pid, None)
        self._kinds.pop(pid, None)
