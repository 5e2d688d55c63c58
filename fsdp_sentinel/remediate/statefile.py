"""What the remediator changed, on disk, so a crash never leaves a device changed for good.

Before its first change to a device the remediator writes one JSON file per
device under ``/run/fsdp-sentinel/`` (tmpfs: gone at reboot, like the tc
state it describes): the device, the pid that made the change, what was on
the device before, and the operations that put it back. The file goes when
the device is restored. On start, files left by a process that is no longer
alive are restored before anything else (a SIGKILLed daemon leaves its tree
and its classifier in place; the kernel keeps both).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_sentinel.remediate.config import DeviceRef
from fsdp_sentinel.remediate.plan import Op

PREFIX = "remediation-"
VERSION = 1


@dataclass(frozen=True)
class Saved:
    """One device's entry: who changed it, and how to undo it."""

    path: Path
    device: DeviceRef
    pid: int
    major: int
    undo: tuple[Op, ...]
    before: dict[str, Any]


def _file(state_dir: str, dev: DeviceRef) -> Path:
    safe = dev.key.replace("/", "+")
    return Path(state_dir, f"{PREFIX}{safe}.json")


def op_to_json(op: Op) -> dict[str, Any]:
    return {"command": op.command, "kind": op.kind, "handle": op.handle, "parent": op.parent,
            "params": [list(p) for p in op.params]}  # fmt: skip


def op_from_json(obj: dict[str, Any]) -> Op:
    params = tuple((str(k), v) for k, v in obj.get("params", ()))
    return Op(str(obj["command"]), str(obj["kind"]), int(obj["handle"]), obj.get("parent"), params)


def save(
    state_dir: str, dev: DeviceRef, major: int, undo: tuple[Op, ...], before: dict[str, Any]
) -> Path:
    """Write (atomically: temp file, fsync, rename) before the first change."""
    path = _file(state_dir, dev)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    body = {
        "format": "fsdp-sentinel-remediation", "version": VERSION, "pid": os.getpid(),
        "device": {"host": dev.host, "ifname": dev.ifname, "netns": dev.netns},
        "major": major, "before": before, "undo": [op_to_json(o) for o in undo],
    }  # fmt: skip
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def remove(state_dir: str, dev: DeviceRef) -> None:
    _file(state_dir, dev).unlink(missing_ok=True)


def load_all(state_dir: str) -> list[Saved]:
    """Every entry in the folder; an unreadable file raises ValueError naming it."""
    out = []
    for path in sorted(Path(state_dir).glob(f"{PREFIX}*.json")):
        try:
            obj = json.loads(path.read_text())
            d = obj["device"]
            dev = DeviceRef(str(d["host"]), str(d["ifname"]), d.get("netns"))
            undo = tuple(op_from_json(o) for o in obj["undo"])
            out.append(Saved(path, dev, int(obj["pid"]), int(obj["major"]), undo,
                             dict(obj.get("before") or {})))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a remediation state file: {e}") from e
    return out


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own earlier entry (a restarted remediator in one process)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
