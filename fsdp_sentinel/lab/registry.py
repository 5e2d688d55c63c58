"""Which labs this machine's ``fss-`` names belong to: one state file per lab we built.

``fsdp-sentinel lab down`` used to remove every name starting with ``fss-``
(interfaces, namespaces, cgroups), whoever made them, and ``--name docker``
matched ``docker-br``. Now a lab writes ``<dir>/<name>.json`` before it
creates anything and removes it once it is gone, so a lab killed with
SIGKILL still leaves its record behind; ``lab down`` removes exactly the labs
recorded there (or the one it is named, which must be a valid lab name).
The directory is under ``/run``: a reboot removes the labs and the records
together.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from fsdp_sentinel.lab.config import LabConfig, LabError, valid_name

STATE_DIR = LabConfig.state_dir


def _path(name: str, state_dir: str | os.PathLike[str]) -> Path:
    if not valid_name(name):
        raise LabError(f"not a lab name: {name!r} (fss-[a-z0-9-]...)")
    return Path(state_dir, f"{name}.json")


def record(name: str, state_dir: str | os.PathLike[str] = STATE_DIR) -> Path:
    """Note that this process is building lab ``name`` (before it makes anything)."""
    path = _path(name, state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"name": name, "pid": os.getpid(), "created": time.time()}) + "\n")
    tmp.replace(path)
    return path


def forget(name: str, state_dir: str | os.PathLike[str] = STATE_DIR) -> None:
    """Lab ``name`` is gone: remove its record."""
    with contextlib.suppress(FileNotFoundError):
        _path(name, state_dir).unlink()


def recorded(state_dir: str | os.PathLike[str] = STATE_DIR) -> list[str]:
    """The labs built here and not yet removed (records with bad names are ignored)."""
    try:
        names = [p.stem for p in Path(state_dir).glob("*.json")]
    except OSError:
        return []
    return sorted(n for n in names if valid_name(n))
