"""The classifier: ``classify.bpf.c`` loaded with bcc, and its flow map.

One program per device tree (the class ids are compiled in); the daemon puts
the job's flows in ``job_flows`` as they appear and takes them out as they
close. Keys are the packet's own bytes (network order), made here from the
probes' ``"ip:port"`` strings, local end first: what the device sends.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("classify.bpf.c")
FUNC = "fss_classify"


def program_text() -> str:
    return SOURCE.read_text()


def flow_key_bytes(src: str, dst: str) -> bytes | None:
    """The map key for a flow (``"ip:port"`` each, local first); None unless IPv4."""
    try:
        sip, sport = src.rsplit(":", 1)
        dip, dport = dst.rsplit(":", 1)
        a = ipaddress.ip_address(sip.strip("[]"))
        b = ipaddress.ip_address(dip.strip("[]"))
        if a.version != 4 or b.version != 4:
            return None
        return a.packed + b.packed + int(sport).to_bytes(2, "big") + int(dport).to_bytes(2, "big")
    except ValueError:
        return None


class Classifier:
    """A loaded program (``fd``, ``name``) and its maps; ``close()`` frees this process's hold.

    The filter that uses the program holds its own reference, so after a
    crash the program keeps classifying until the next start restores the
    device (and with it removes the filter).
    """

    def __init__(self, job_classid: int, other_classid: int) -> None:
        from bcc import BPF

        self._bpf: Any = BPF(
            text=program_text().encode(),
            cflags=[f"-DJOB_CLASSID={job_classid}U", f"-DOTHER_CLASSID={other_classid}U"],
        )
        fn = self._bpf.load_func(FUNC.encode(), BPF.SCHED_CLS)
        self.fd = int(fn.fd)
        self.name = fn.name.decode() if isinstance(fn.name, bytes) else str(fn.name)
        self._flows = self._bpf[b"job_flows"]
        self._bytes = self._bpf[b"class_bytes"]
        self.keys: set[bytes] = set()

    def _key(self, raw: bytes) -> Any:
        key = self._flows.Key()
        ctypes.memmove(ctypes.addressof(key), raw, len(raw))
        return key

    def set_flows(self, flows: list[tuple[str, str]]) -> tuple[int, int]:
        """Make the map hold exactly these flows; returns (added, removed)."""
        want = {k for k in (flow_key_bytes(s, d) for s, d in flows) if k is not None}
        added = removed = 0
        for raw in want - self.keys:
            self._flows[self._key(raw)] = ctypes.c_uint8(1)
            added += 1
        for raw in self.keys - want:
            with contextlib.suppress(KeyError):
                del self._flows[self._key(raw)]
            removed += 1
        self.keys = want
        return added, removed

    def class_bytes(self) -> tuple[int, int]:
        """Bytes classified so far: (job's class, everything else)."""
        return int(self._bytes[ctypes.c_int(0)].value), int(self._bytes[ctypes.c_int(1)].value)

    def close(self) -> None:
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None
