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


class LibraryScanner:
    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = Path(proc_root)
        self._seen: set[tuple[int, str]] = set()

    def _pids(self) -> list[int]:
        try:
            return [int(d) for d in os.listdir(self.proc_root) if d.isdigit()]
        except OSError:
            return []

    def scan(self, pids: list[int] | None = None) -> list[tuple[str, str]]:
        """(kind, path) for libraries newly seen mapped by ``pids`` (all when None)."""
        found: dict[tuple[str, str], str] = {}
        for pid in self._pids() if pids is None else pids:
            try:
                text = (self.proc_root / str(pid) / "maps").read_text()
            except (OSError, UnicodeDecodeError):
                continue
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
                    if pat.match(base) and (pid, path) not in self._seen:
                        self._seen.add((pid, path))
                        found.setdefault((kind, path), f"{self.proc_root}/{pid}/root{path}")
        return [(kind, where) for (kind, _), where in found.items()]
