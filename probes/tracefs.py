"""Which tracepoints this kernel offers, and with which fields.

Reads the tracepoints' ``format`` files under tracefs (the kernel's own
description of each tracepoint's arguments), so the probes never depend on
kernel headers. The tracefs root is injected for tests.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

#: Where tracefs is usually mounted, in the order tried.
TRACEFS_ROOTS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")

_FIELD = re.compile(r"field:(?P<decl>[^;]+);")


@dataclass(frozen=True)
class TracepointCheck:
    """Outcome of looking for one tracepoint: ``reason`` is None when usable."""

    name: str  # "category:event"
    reason: str | None


def find_tracefs(roots: tuple[str, ...] = TRACEFS_ROOTS) -> Path | None:
    for root in roots:
        if os.path.isdir(os.path.join(root, "events")):
            return Path(root)
    return None


def field_names(format_text: str) -> set[str]:
    """Names of the fields a tracepoint ``format`` file declares."""
    names: set[str] = set()
    for m in _FIELD.finditer(format_text):
        decl = m.group("decl").strip()
        last = decl.split()[-1]  # "saddr[28]", "*sk", "name"
        names.add(last.split("[")[0].lstrip("*"))
    return names


NOT_MOUNTED = "tracefs not mounted (mount -t tracefs tracefs /sys/kernel/tracing)"


def why_no_tracefs(roots: tuple[str, ...] = TRACEFS_ROOTS) -> str:
    """Why :func:`find_tracefs` found none: not mounted, or mounted where this
    process may not look (a dedicated user without CAP_DAC_READ_SEARCH sees
    tracefs's root as mode 0700): a permission problem, said as one."""
    for root in roots:
        try:
            os.stat(os.path.join(root, "events"))
        except PermissionError:
            return (
                f"tracefs at {root} is not readable by this process (permission denied): "
                "run as root, or grant CAP_DAC_READ_SEARCH (docs/deploy.md)"
            )
        except OSError:
            continue
    return NOT_MOUNTED


def check_tracepoint(root: Path | None, name: str, fields: tuple[str, ...]) -> TracepointCheck:
    """Does tracepoint ``name`` exist under ``root`` with every one of ``fields``?"""
    if root is None:
        return TracepointCheck(name, why_no_tracefs())
    category, event = name.split(":", 1)
    fmt = root / "events" / category / event / "format"
    try:
        text = fmt.read_text()
    except FileNotFoundError:
        return TracepointCheck(name, f"kernel has no tracepoint {name}")
    except OSError as e:
        return TracepointCheck(name, f"cannot read {fmt}: {e.strerror}")
    have = field_names(text)
    missing = [f for f in fields if f not in have]
    if missing:
        return TracepointCheck(name, f"tracepoint {name} lacks field(s) {', '.join(missing)}")
    return TracepointCheck(name, None)
