"""Open a socket inside another network namespace, from one thread, for one call.

A node daemon may live in the root namespace (where its probes and its
``/metrics`` port are) while its node's ranks, and so the job's store, are
reachable only from the node's own namespace (the lab's hosts, a pod's
network). The namespace is per thread in Linux (``setns(2)``) and a socket
stays in the namespace it was made in, so :func:`in_netns` moves the calling
thread there for the duration of one call (the store client's connect) and
back: the rest of the daemon never leaves its own namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
#: Where ``ip netns add`` names namespaces.
NETNS_DIR = "/run/netns"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(name: str, netns_dir: str = NETNS_DIR) -> Iterator[None]:
    """The calling thread inside namespace ``name`` (``/run/netns/<name>``), then back."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(os.path.join(netns_dir, name), os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)  # failing here would leave the thread astray: let it raise
    finally:
        os.close(own)


def in_netns(name: str | None, fn: Callable[[], T]) -> T:
    """``fn()`` run inside namespace ``name`` (None: where we are)."""
    if not name:
        return fn()
    with entered(name):
        return fn()
