"""Ctrl-C and SIGTERM unwind the command that owns the machine's changes.

The demo and ``lab up`` remove what they built in ``finally`` blocks, so both
signals must raise :class:`KeyboardInterrupt` in them, and only in them:

* SIGINT explicitly, not by inheritance. A process started with SIGINT
  ignored (anything launched in the background by a non-interactive shell)
  keeps it ignored, and Python then installs no handler of its own: Ctrl-C
  or ``kill -INT`` would do nothing and the lab would stay up.
* Not in forked children. pyroute2 forks short-lived helpers (one per
  namespace socket) and stops them with SIGTERM, and a terminal's Ctrl-C
  reaches the whole process group: a helper that raised would unwind a copy
  of our stack and run the cleanup from the wrong process. It just exits.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def unwinding_on_signals() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise KeyboardInterrupt in this process."""
    owner = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            os._exit(128 + signum)
        raise KeyboardInterrupt

    previous = [(sig, signal.signal(sig, handler)) for sig in SIGNALS]
    try:
        yield
    finally:
        for sig, old in previous:
            signal.signal(sig, old)
