"""The demo's daemon: ``fsdp-sentinel run`` as a child process, and its snapshot over HTTP.

The daemon runs in the root network namespace (where its probes see every
namespace's TCP traffic); the lab's ranks reach its ingest socket by path.
It gets its own session so a terminal's Ctrl-C reaches only the demo, which
then stops it in order (SIGINT: last poll, trace flushed and closed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fsdp_sentinel.snapshot import Snapshot


class DaemonError(RuntimeError):
    """The daemon did not start, or died; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class DaemonProcess:
    """``with DaemonProcess(...) as d: d.wait_ready(); d.snapshot(); ...`` (stopped on exit)."""

    def __init__(
        self,
        *,
        socket_path: Path,
        trace_out: Path,
        log_path: Path,
        remediate: str = "off",
        interval: float = 0.5,
        probes: bool = True,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.socket_path = socket_path
        self.trace_out = trace_out
        self.env = {**os.environ, **env} if env else None
        self.url = f"http://127.0.0.1:{self.port}/api/v1/snapshot"
        self.log_path = log_path
        self.argv = [
            sys.executable, "-m", "fsdp_sentinel", "run",
            "--socket", str(socket_path),
            "--trace-out", str(trace_out),
            "--metrics-addr", f"127.0.0.1:{self.port}",
            "--remediate", remediate,
            "--interval", str(interval),
            *([] if probes else ["--no-probes"]),
            *(extra or []),
        ]  # fmt: skip
        self.proc: subprocess.Popen[Any] | None = None

    def __enter__(self) -> DaemonProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _died(self) -> DaemonError:
        rc = self.proc.returncode if self.proc else None
        return DaemonError(
            f"the daemon exited (status {rc}); {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def wait_ready(self, timeout: float = 120.0) -> Snapshot:
        """Until ``/api/v1/snapshot`` answers (the probes are compiled and attached by then)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise self._died()
            snap = self.snapshot()
            if snap is not None:
                return snap
            time.sleep(0.25)
        raise DaemonError(f"the daemon was not ready after {timeout:.0f} s; {self.log_path}:\n"
                          f"{log_tail(self.log_path)}")  # fmt: skip

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def snapshot(self) -> Snapshot | None:
        """The daemon's latest snapshot, or None when it does not answer."""
        try:
            with urllib.request.urlopen(self.url, timeout=2.0) as resp:
                return Snapshot.from_json(json.loads(resp.read()))
        except (OSError, ValueError, TypeError, urllib.error.URLError):
            return None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT (a clean, flushed exit), then SIGKILL after ``timeout``; its status."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        return p.returncode
