"""Shared by the daemon's tests: run ``fsdp-sentinel run`` (or a ``Daemon`` in
this process) and feed it.

Not a test module; ``tests/test_daemon_*.py``, the hostile-input and full-disk
tests and the Prometheus server test import it.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fsdp_sentinel.daemon import Daemon, DaemonConfig
from fsdp_sentinel.emit import Emitter
from fsdp_sentinel.pipeline import Pipeline

Record = dict[str, Any]


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met in {timeout} s")
        time.sleep(0.02)


@contextlib.contextmanager
def daemon_running(cfg: DaemonConfig) -> Iterator[Daemon]:
    """A real ``Daemon`` (its own pipeline) run on a thread; stopped, joined and
    closed however the block ends (``close()`` must not raise, full disk or not)."""
    d = Daemon(cfg, pipeline=Pipeline())
    d.start()
    t = threading.Thread(target=d.run)
    t.start()
    try:
        yield d
    finally:
        d.request_stop()
        t.join(timeout=30)
        d.close()
    assert not t.is_alive()


def send_job(
    d: Daemon, recs: list[Record], *, every_50: Callable[[socket.socket], None] | None = None
) -> None:
    """Send ``recs`` as datagrams to ``d``'s socket (``every_50`` may slip in more
    before every 50th), then wait until the daemon has taken them all."""
    path = d.config.socket_path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for i, rec in enumerate(recs):
            if every_50 is not None and i % 50 == 0:
                every_50(s)
            s.sendto(json.dumps(rec).encode(), path)
            if i % 100 == 99:
                time.sleep(0.002)  # a breath for the receive thread on two cores
    wait_for(
        lambda: sum(d.snapshot().records_total.values()) >= len(recs),
        what="the daemon took every record",
    )


def send_paced(em: Emitter, recs: list[Record]) -> None:
    """Send through a real Emitter, in order, resending what it had to drop.

    The synthetic job produces records far faster than any real one; on a
    busy machine the daemon's queue (or this sender's socket buffer) fills,
    the emitter drops and counts, as it must in training, and the test waits
    a moment and sends that record again so the trace can be compared whole.
    """
    for rec in recs:
        for _ in range(1000):
            before = em.dropped
            em.emit(rec)
            em.flush()  # send now, on this thread, so a drop is seen at once
            if em.dropped == before:
                break
            time.sleep(0.005)
        else:
            raise AssertionError("the daemon stopped taking records")


class DaemonProcess:
    """``python -m fsdp_sentinel run ...`` with its stderr collected line by line."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fsdp_sentinel", "run", *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_log(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        rx = re.compile(pattern)
        found: list[re.Match[str]] = []

        def seen() -> bool:
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log}")
            found[:] = [m for m in map(rx.search, list(self.lines)) if m][:1]
            return bool(found)

        wait_for(seen, timeout, f"log line {pattern!r}")
        return found[0]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_command(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m fsdp_sentinel ARGV...`` to completion, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "fsdp_sentinel", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
