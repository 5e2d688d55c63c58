"""Who and where this process is: host name and the network namespace's addresses.

A ``rank`` record carries these so the daemon can map the probes' TCP flows
(``src``/``dst`` addresses) to ranks. Addresses come from ``/proc/net`` (which
shows the reading process's network namespace), with the root injectable for
tests: IPv4 from ``fib_trie`` (the ``/32 host LOCAL`` entries), IPv6 from
``if_inet6``; loopback, link-local and host-scope addresses are left out.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

#: Environment variable that overrides the host name in records (lab hosts are
#: network namespaces that share the machine's UTS name).
HOST_ENV = "FSDP_SENTINEL_HOST"


def host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def _ipv4_local(text: str) -> list[str]:
    out: list[str] = []
    prev = ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("/"):
            # "/32 host LOCAL" under a "|-- 10.0.0.5" leaf: a local address.
            if s.startswith("/32 host LOCAL") and prev:
                out.append(prev)
            continue
        parts = s.split()
        prev = parts[1] if len(parts) == 2 and parts[0] == "|--" else ""
    return out


def _ipv6_addrs(text: str) -> list[str]:
    out: list[str] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6 or len(parts[0]) != 32:
            continue
        scope = int(parts[3], 16)
        if scope in (0x10, 0x20):  # host, link
            continue
        out.append(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    return out


def local_addrs(proc_net: str | os.PathLike[str] = "/proc/net") -> list[str]:
    """This network namespace's non-loopback IP addresses, sorted, IPv4 first."""
    root = Path(proc_net)
    found: set[str] = set()
    for name, parse in (("fib_trie", _ipv4_local), ("if_inet6", _ipv6_addrs)):
        try:
            text = (root / name).read_text()
        except OSError:
            continue
        for a in parse(text):
            try:
                ip = ipaddress.ip_address(a)
            except ValueError:
                continue
            if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
                found.add(str(ip))
    return sorted(found, key=lambda a: (ipaddress.ip_address(a).version, ipaddress.ip_address(a)))
