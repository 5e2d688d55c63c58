"""Loads the probes into the kernel and turns their maps into trace-v1 records.

``ProbeSet(config).start()`` compiles one program (probes/program.py) with
bcc, attaches every tracepoint this kernel offers and reports the rest;
``poll()`` drains the kernel's counting maps (batch lookup-and-delete where
the kernel has it) and returns ``flow``, ``netdev``, ``conn``, ``nccl`` and
``qp`` records holding the deltas since the previous poll (``netdev`` from
netlink link and qdisc stats, probes/devstats.py: no kernel program). Uprobes on libnccl
and libibverbs are attached once a traced process maps those libraries.

bcc is imported only in ``start()``, so this module imports on any machine.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import errno
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import records as R
from .bpfstats import read_fdinfo
from .devstats import DeviceStats
from .libscan import LibraryScanner
from .program import Program, build_program
from .rdma import RdmaReader
from .sockdiag import DiagSocket, SockDiag
from .sockowners import SocketOwners
from .tracefs import find_tracefs
from .uprobes import NCCL_UPROBES, VERBS_UPROBES, UprobeSpec, resolve_symbol

log = logging.getLogger(__name__)

STAT_NAMES = {
    0: "flows",
    1: "orphans",
    2: "socks",
    3: "conn_events",
    4: "closed",
    6: "nccl_calls",
    7: "qps",
}
STAT_ORPHAN_CLOSED = 5
STAT_SOCK_DEL = 8
STAT_ORPHAN_BYTES = 9
STAT_HOT_CLAIM = 10
STAT_HOT_STEAL = 11
NSTATS = 12  # sentinel.h: SENTINEL_NSTATS

#: bytes of one hot slot (sentinel.h: struct hot_slot)
HOT_SLOT_BYTES = 64

#: drained map -> the stats slot that counts the entries the kernel created
#: in it (sentinel.h SENTINEL_STAT_*_NEW). A drained map whose count has not
#: moved since the stats read before its last drain holds nothing: the poll
#: skips it (no map syscall, no walk of its buckets).
CREATED_STAT = {"flows": 0, "orphans": 1, "conn_events": 3, "closed": 4, "nccl_calls": 6, "qps": 7}

#: entries a batch read takes per call (buffers kept between polls)
BATCH_ENTRIES = 256

#: maps emptied at every poll (the rest are read in place)
DRAINED_MAPS = (
    "sock_owner_hint",
    "flows",
    "closed",
    "orphans",
    "conn_events",
    "nccl_calls",
    "qps",
)
START_SETTLE_S = 0.3

#: orphans whose socket is still unnamed are kept this many polls, then counted lost.
ORPHAN_POLLS = 5
#: conn events of sockets no registered process has claimed yet (pid filter on).
CONN_POLLS = 3
#: the tracepoint that names sockets older than the probes; attached only
#: while one waits for a name (tcp_flows.c)
NAMING_TRACEPOINT = "tcp:tcp_probe"
TCP_CLOSE = 7  # the state of a socket in a destroy message
#: a whole sock_diag read (every socket of every namespace) at least every
#: this many polls; between them the sockets of interest (the probes know
#: their 4-tuples, or their figures went to a registered process) are read
#: by exact lookups: a dump walks the kernel's whole established-socket
#: table, whose size follows the host's memory (~1 ms a walk for 262,144
#: buckets here, two walks per namespace), a lookup costs one hash probe.
DIAG_FULL_EVERY = 10


class ProbePermissionError(RuntimeError):
    """Loading eBPF programs needs root (or CAP_BPF with CAP_PERFMON)."""


class ProbeLoadError(RuntimeError):
    """bcc is missing or the program did not compile/load."""


@dataclass
class ProbeConfig:
    """What to trace and how often.

    ``pid_filter``: False traces every process; True counts only pids given
    to ``register_pid`` (an in-kernel filter fixed at load). ``interval`` is
    the caller's polling period (0.1 s .. 3600 s), used by ``flows`` and the
    daemon; ``poll()`` itself reports the real ``dt``.
    """

    interval: float = 1.0
    pid_filter: bool = False
    host: str = field(default_factory=socket.gethostname)
    families: tuple[str, ...] = ("tcp", "netdev", "nccl", "verbs")
    tracefs_root: str | None = None  # None: find it
    proc_root: str = "/proc"
    #: named network namespaces whose devices ``netdev`` reads too (None: only ours)
    netns_dir: str | None = "/run/netns"
    #: only these named namespaces' devices, not our own nor the rest (a node daemon
    #: for one lab host or pod); None: ours and every one under ``netns_dir``
    netns_only: tuple[str, ...] | None = None
    rdma_root: str | None = "/sys/class/infiniband"  # None: no RDMA port counters
    library_scan_interval: float = 5.0
    max_flows: int = 16384
    max_socks: int = 65536
    max_events: int = 8192
    #: log2 of the hot slots (tcp_flows.c): 4,096 slots of 64 bytes hold the
    #: sockets busy at once on a node many times over; a socket whose slot is
    #: taken still counts exactly, one hash lookup dearer per call
    hot_bits: int = 12

    def __post_init__(self) -> None:
        if not 0.1 <= self.interval <= 3600:
            raise ValueError(f"interval must be between 0.1 and 3600 s, not {self.interval}")
        unknown = set(self.families) - {"tcp", "netdev", "nccl", "verbs"}
        if unknown:
            raise ValueError(f"unknown probe families: {', '.join(sorted(unknown))}")
        if not 1 <= self.hot_bits <= 16:
            raise ValueError(f"hot_bits must be between 1 and 16, not {self.hot_bits}")


@dataclass
class AttachReport:
    """What got attached (by name) and what did not (name, reason)."""

    attached: list[str] = field(default_factory=list)
    missing: list[tuple[str, str]] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"attached {name}" for name in self.attached]
        out += [f"missing  {name}: {why}" for name, why in self.missing]
        return out


def check_privileges(status_path: str = "/proc/self/status") -> None:
    """Raise ProbePermissionError unless this process may load tracing programs.

    Decided by the effective capabilities, not the uid: root with its
    capabilities dropped cannot load eBPF either.
    """
    caps = None
    try:
        for line in Path(status_path).read_text().splitlines():
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    if caps is None:  # no /proc: trust the uid
        if os.geteuid() == 0:
            return
        caps = 0
    cap_sys_admin, cap_perfmon, cap_bpf = 21, 38, 39
    if caps & (1 << cap_sys_admin) or (caps & (1 << cap_bpf) and caps & (1 << cap_perfmon)):
        return
    raise ProbePermissionError(
        "loading eBPF probes needs root (or CAP_BPF and CAP_PERFMON); "
        "run as root, e.g. `sudo fsdp-sentinel flows`"
    )


def _drain(table: Any, batch: bool) -> Iterator[tuple[Any, Any]]:
    """Every (key, value) of ``table``, deleted as read.

    Batch lookup-and-delete (Linux 5.6+) empties the map in a few syscalls;
    otherwise each key is looked up and deleted on its own. Either way an
    increment that lands between the copy and the delete of its entry is
    lost (nanoseconds per entry per poll; see docs/probes.md).
    """
    if batch:
        yield from table.items_lookup_and_delete_batch()
        return
    for k in list(table.keys()):
        try:
            v = table[k]
            del table[k]
        except KeyError:
            continue
        yield k, v


def _read_all(table: Any, batch: bool) -> list[tuple[Any, Any]]:
    if batch:
        return list(table.items_lookup_batch())
    return list(table.items())


class MapReader:
    """A whole map read with the kernel's batch calls into buffers kept from
    one read to the next. bcc's ``items_lookup_batch`` allocates and zeroes
    two arrays of ``max_entries`` elements at every call (4.7 MB for
    ``socks``) for the dozen entries a poll finds; here ``BATCH_ENTRIES`` at
    a time, and the entries copied out, so the buffers can be used again."""

    def __init__(self, table: Any, entries: int = BATCH_ENTRIES) -> None:
        self._fd = table.map_fd
        self._key, self._leaf = table.Key, table.Leaf
        self._ksize, self._vsize = ct.sizeof(self._key), ct.sizeof(self._leaf)
        # The batch token: a bucket number (hash maps) or a key (arrays).
        self._token = (ct.c_uint8 * max(8, self._ksize))()
        self._token_p = ct.cast(self._token, ct.POINTER(ct.c_uint32))
        self._count = ct.c_uint32()
        self._size(min(entries, int(table.max_entries)))

    def _size(self, n: int) -> None:
        self._n = n
        self._keys = (self._key * n)()
        self._vals = (self._leaf * n)()

    def read(self, delete: bool = False) -> list[tuple[Any, Any]]:
        """Every (key, value), deleted as read when ``delete``."""
        from bcc.libbcc import lib  # type: ignore[import-not-found]

        call = lib.bpf_lookup_and_delete_batch if delete else lib.bpf_lookup_batch
        out: list[tuple[Any, Any]] = []
        first = True
        while True:
            self._count.value = self._n
            res = call(self._fd, None if first else self._token_p, self._token_p,
                       self._keys, self._vals, ct.byref(self._count))  # fmt: skip
            err = ct.get_errno()
            got = self._count.value
            if got:
                kb, vb = self._keys, self._vals
                key, leaf, ks, vs = self._key, self._leaf, self._ksize, self._vsize
                out += [
                    (key.from_buffer_copy(kb, i * ks), leaf.from_buffer_copy(vb, i * vs))
                    for i in range(got)
                ]
            if res == 0:
                first = False
                continue
            if err == errno.ENOENT:  # the whole map has been read
                return out
            if err == errno.ENOSPC and not got:  # one bucket holds more than the buffer
                self._size(self._n * 2)
                continue
            raise OSError(err, f"BPF map batch read: {os.strerror(err)}")


def _int(v: Any) -> int:
    """A scalar map key/value: bcc yields ctypes scalars or plain ints."""
    return int(getattr(v, "value", v))


def _fields(v: Any, *names: str) -> list[int]:
    return [int(getattr(v, name)) for name in names]


def _tuple(t: Any) -> R.Tuple:
    return R.make_tuple(t.family, t.lport, t.rport, bytes(t.laddr), bytes(t.raddr))


class ProbeSet:
    """The loaded probes; see the module docstring. Not reentrant: call
    ``poll()`` from one thread (``register_pid`` may come from another)."""

    def __init__(self, config: ProbeConfig | None = None, clock: Callable[[], float] = time.time):
        self.config = config or ProbeConfig()
        self._clock = clock
        self._bpf: Any = None
        self._program: Program | None = None
        self._batch = False
        self._last_t = 0.0
        self._lock = threading.Lock()
        self.report = AttachReport()
        self.evictions = R.Evictions()
        self._orphans: dict[tuple[int, int], tuple[R.FlowFigures, int]] = {}
        # (socket address, 4-tuple) -> (tx, rx) its sock_info showed last poll
        self._sock_seen: dict[tuple[int, R.Tuple], tuple[int, int]] = {}
        self._pending_conns: list[tuple[dict[str, Any], int, R.Tuple, int]] = []
        self._stats: dict[int, int] = {}
        self._readers: dict[str, MapReader] = {}
        # drained map -> its CREATED_STAT count read before its last drain
        self._drained_at: dict[str, int] = {}
        self.skipped_drains: Counter[str] = Counter()  # by map: nothing created since
        self.lost_orphan_bytes = 0
        self._devstats: DeviceStats | None = None
        self._sockdiag: SockDiag | None = None
        self._hot: HotSlots | None = None
        # (namespace, cookie) -> the process a live socket's figures went to
        self._cookie_owner: dict[tuple[tuple[int, int], int], int] = {}
        # The sockets the next poll may read by exact lookups (None: dump all).
        self._diag_keep: dict[tuple[int, int], list[DiagSocket]] | None = None
        self._diag_keep_tuples: set[R.Tuple] = set()
        self._diag_pids: frozenset[int] = frozenset()
        self._diag_age = 0  # polls since the last whole read
        self.diag_reads = {"whole": 0, "lookup": 0}  # polls by how they read sock_diag
        self._owners = SocketOwners(self.config.proc_root)
        self._naming_on = False  # NAMING_TRACEPOINT attached now
        self.naming_polls = 0  # polls it stayed attached for (bench, tests)
        self._registered: set[int] = set()
        self._attached_libs: set[tuple[int, int]] = set()
        self._scanner = LibraryScanner(self.config.proc_root, self.config.library_scan_interval)
        self._last_scan = float("-inf")
        self._rdma = (
            RdmaReader(self.config.rdma_root, host=self.config.host, clock=clock)
            if self.config.rdma_root
            else None
        )

    # ------------------------------------------------------------------ loading

    def program_text(self) -> str:
        """The exact C text ``start()`` compiles (or would compile)."""
        return self._build().text

    def _build(self) -> Program:
        if self._program is None:
            root = Path(self.config.tracefs_root) if self.config.tracefs_root else find_tracefs()
            self._program = build_program(
                root,
                families=self.config.families,
                filter_pids=self.config.pid_filter,
                defines={
                    "SENTINEL_MAX_FLOWS": self.config.max_flows,
                    "SENTINEL_MAX_SOCKS": self.config.max_socks,
                    "SENTINEL_MAX_EVENTS": self.config.max_events,
                    "SENTINEL_HOT_BITS": self.config.hot_bits,
                },
            )
        return self._program

    def start(self) -> AttachReport:
        """Compile, load and attach; raises ProbePermissionError when not
        privileged, ProbeLoadError when bcc is unusable. A missing optional
        tracepoint is reported in the returned AttachReport, not raised."""
        check_privileges()
        prog = self._build()
        try:
            from bcc import BPF  # type: ignore[import-not-found]
        except ImportError as e:
            raise ProbeLoadError(f"bcc is not importable ({e}); install python3-bpfcc") from e
        try:
            # TRACEPOINT_PROBE functions are attached by bcc as it loads them.
            self._bpf = BPF(text=prog.text.encode())
        except Exception as e:
            raise ProbeLoadError(f"eBPF program failed to load: {e}") from e
        self.report.attached += [tp.name + (" (raw)" if tp.raw else "") for tp in prog.tracepoints]
        self.report.missing += [(chk.name, chk.reason or "") for chk in prog.missing]
        self._batch = self._probe_batch_support()
        if "tcp" in self.config.families:
            self._hot = HotSlots(self._bpf[b"hot"], self._batch, self.config.hot_bits)
        self._naming_on = any(tp.name == NAMING_TRACEPOINT for tp in prog.tracepoints)
        for pid in sorted(self._registered):  # registered before start()
            self._bpf[b"pids"][ct.c_uint(pid)] = ct.c_ubyte(1)
        # Freshly attached tracepoints were seen to miss a few packets in
        # their first milliseconds; let them settle, then start from empty.
        time.sleep(START_SETTLE_S)
        for name in DRAINED_MAPS:
            try:
                self._bpf[name.encode()]
            except KeyError:  # its family is not compiled in
                continue
            self.evictions.harvest(name, len(self._read(name, delete=True)))
        if "tcp" in self.config.families:  # bytes already counted are the baseline
            self._owner_bytes(*self._read_socks())
        self._last_t = self._clock()
        self._stats = self._read_stats()
        if "tcp" in self.config.families:
            self._sockdiag = SockDiag(self.config.netns_dir, self.config.proc_root)
            self._sockdiag.deltas(self._sockdiag.read(self._registered))  # baseline
            self.report.attached.append("sock_diag:tcp_info")
        if "netdev" in self.config.families:
            self._devstats = DeviceStats(self.config.netns_dir, only=self.config.netns_only)
            self._devstats.poll()  # baseline
            self.report.attached.append("netlink:link+qdisc stats")
        self.scan_libraries(force=True)
        if self._rdma is not None and self._rdma.present():
            self._rdma.poll()  # baseline
            self.report.attached.append(f"sysfs:{self.config.rdma_root}")
        return self.report

    def _probe_batch_support(self) -> bool:
        for name in DRAINED_MAPS:
            try:
                table = self._bpf[name.encode()]
            except KeyError:  # its family is not compiled in
                continue
            try:
                list(table.items_lookup_batch())
                return True
            except Exception:
                return False
        return False

    def _set_naming(self, on: bool) -> None:
        """Attach or detach NAMING_TRACEPOINT (tcp_probe: it runs once per
        received segment, so it is attached only while a socket older than
        the probes waits for its 4-tuple)."""
        if on == self._naming_on or self._bpf is None or self._program is None:
            return
        tp = next((t for t in self._program.tracepoints if t.name == NAMING_TRACEPOINT), None)
        if tp is None:
            return
        if on:
            self._bpf.attach_tracepoint(tp=tp.name.encode(), fn_name=tp.function.encode())
        else:
            self._bpf.detach_tracepoint(tp.name.encode())
        self._naming_on = on

    def set_tracepoints_attached(self, on: bool) -> None:
        """Detach (False) or re-attach (True) the tracepoint programs while
        keeping the loaded program and its maps, e.g. to measure overhead."""
        if self._bpf is None or self._program is None:
            raise RuntimeError("set_tracepoints_attached() before start()")
        if not on:
            self._set_naming(False)  # re-attached by poll() when a socket needs it
        for tp in self._program.tracepoints:
            if tp.name == NAMING_TRACEPOINT:
                continue
            fn = tp.function.encode()
            if tp.raw:
                event = tp.name.split(":", 1)[1].encode()
                if on:
                    self._bpf.attach_raw_tracepoint(tp=event, fn_name=fn)
                else:
                    self._bpf.detach_raw_tracepoint(tp=event)
            elif on:
                self._bpf.attach_tracepoint(tp=tp.name.encode(), fn_name=fn)
            else:
                self._bpf.detach_tracepoint(tp.name.encode())

    def program_fds(self) -> dict[str, int]:
        """Loaded BPF function name -> program fd (for run-time statistics)."""
        if self._bpf is None:
            return {}
        return {
            (name.decode() if isinstance(name, bytes) else str(name)): fn.fd
            for name, fn in self._bpf.funcs.items()
        }

    def close(self) -> None:
        """Detach everything (idempotent)."""
        if self._devstats is not None:
            self._devstats.close()
            self._devstats = None
        if self._sockdiag is not None:
            self._sockdiag.close()
            self._sockdiag = None
        if self._hot is not None:
            self._hot.close()
            self._hot = None
        if self._bpf is not None:
            try:
                self._bpf.cleanup()
            finally:
                self._bpf = None

    def __enter__(self) -> ProbeSet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ pids

    def register_pid(self, pid: int) -> None:
        """Count this process (with the pid filter on) and look for its libraries."""
        with self._lock:
            self._registered.add(pid)
            if self._bpf is not None:
                self._bpf[b"pids"][ct.c_uint(pid)] = ct.c_ubyte(1)
        if self._bpf is not None:
            # Read now (a new process), then on the scanner's backoff: the
            # hooks announce a rank again after every daemon restart.
            self._attach_found(self._scanner.scan([pid], time.monotonic()))

    def unregister_pid(self, pid: int) -> None:
        with self._lock:
            self._registered.discard(pid)
            self._scanner.forget(pid)
            if self._bpf is not None:
                with contextlib.suppress(KeyError):
                    del self._bpf[b"pids"][ct.c_uint(pid)]

    # ------------------------------------------------------------------ uprobes

    def scan_libraries(self, force: bool = False) -> None:
        """Attach uprobes to libnccl/libibverbs mapped by traced processes."""
        if self._bpf is None or not ({"nccl", "verbs"} & set(self.config.families)):
            return
        now = time.monotonic()
        if not force and now - self._last_scan < self.config.library_scan_interval:
            return
        self._last_scan = now
        pids = sorted(self._registered) if self.config.pid_filter else None
        # Each process's maps on its own backoff (libscan.LibraryScanner);
        # ``force`` reads every one now.
        self._attach_found(self._scanner.scan(pids, None if force else now))

    def attach_library(self, path: str, kind: str) -> list[str]:
        """Attach the ``kind`` ("nccl" or "verbs") uprobes to the library at
        ``path`` now; returns the probe names attached."""
        specs = NCCL_UPROBES if kind == "nccl" else VERBS_UPROBES
        return self._attach_specs(path, specs)

    def _attach_found(self, found: list[tuple[str, str]]) -> None:
        for kind, path in found:
            if kind in self.config.families:
                self.attach_library(path, kind)

    def _attach_specs(self, path: str, specs: tuple[UprobeSpec, ...]) -> list[str]:
        try:
            st = os.stat(path)
        except OSError as e:
            self.report.missing.append((f"uprobe:{path}", f"cannot stat: {e.strerror}"))
            return []
        ident = (st.st_dev, st.st_ino)
        if ident in self._attached_libs or self._bpf is None:
            return []
        self._attached_libs.add(ident)
        done = []
        for spec in specs:
            name = f"uprobe:{spec.symbol}{'(ret)' if spec.ret else ''}@{path}"
            addr = resolve_symbol(path, spec.symbol)
            if addr is None:
                self.report.missing.append((name, f"symbol {spec.symbol} not exported"))
                continue
            attach = self._bpf.attach_uretprobe if spec.ret else self._bpf.attach_uprobe
            try:
                attach(name=path.encode(), addr=addr, fn_name=spec.fn.encode())
            except Exception as e:
                self.report.missing.append((name, f"attach failed: {e}"))
                continue
            self.report.attached.append(name)
            done.append(name)
        return done

    # ------------------------------------------------------------------ polling

    def _read_stats(self) -> dict[int, int]:
        """Each stats slot summed over the CPUs (one batch read where the kernel has it)."""
        if self._batch:
            return {_int(k): int(sum(v)) for k, v in self._read("stats")}
        out: dict[int, int] = {}
        table = self._bpf[b"stats"]
        for idx in range(NSTATS):
            vals = table[ct.c_int(idx)]
            out[idx] = int(sum(vals))
        return out

    def _read(self, name: str, delete: bool = False) -> list[tuple[Any, Any]]:
        """Every entry of map ``name`` (deleted as read when ``delete``)."""
        table = self._bpf[name.encode()]
        if not self._batch:
            return list(_drain(table, False)) if delete else _read_all(table, False)
        reader = self._readers.get(name)
        if reader is None:
            reader = self._readers[name] = MapReader(table)
        return reader.read(delete)

    def _harvest(self, name: str) -> list[tuple[Any, Any]]:
        """Drain map ``name``, counting what came out (for eviction figures).
        Skipped when the kernel created nothing in it since the stats read
        before its last drain (this poll's stats: read first): it is empty."""
        idx = CREATED_STAT.get(name)
        if idx is not None:
            created = self._stats.get(idx, 0)
            if self._drained_at.get(name) == created:
                self.skipped_drains[name] += 1
                self.evictions.harvest(name, 0)
                return []
            self._drained_at[name] = created
        got = self._read(name, delete=True)
        self.evictions.harvest(name, len(got))
        return got

    def _stat(self, idx: int) -> int:
        return self._stats.get(idx, 0)

    def poll(self) -> list[dict[str, Any]]:
        """Records for the deltas since the previous poll (or start)."""
        if self._bpf is None:
            raise RuntimeError("ProbeSet.poll() before start()")
        self.scan_libraries()
        b, batch = self._bpf, self._batch
        now = self._clock()
        dt = max(0.0, now - self._last_t)
        self._last_t = now
        host = self.config.host
        stats = self._stats = self._read_stats()
        for idx, name in STAT_NAMES.items():
            self.evictions.created[name] = stats.get(idx, 0)
        # Parked entries of sockets that closed unnamed were taken into closed
        # by the kernel itself (tcp_flows.c): neither harvested nor evicted.
        self.evictions.created["orphans"] -= stats.get(STAT_ORPHAN_CLOSED, 0)
        out: list[dict[str, Any]] = []
        fams = set(self.config.families)
        if "tcp" in fams:
            out += self._poll_tcp(b, batch, now, dt, host)
        if "netdev" in fams:
            out += self._poll_netdev(now, dt, host)
        if "nccl" in fams:
            out += self._poll_nccl(b, batch, now, dt, host)
        if "verbs" in fams:
            out += self._poll_qps(b, batch, now, host)
        if self._rdma is not None and self._rdma.present():
            out += self._rdma.poll()
        return out

    def _poll_tcp(self, b: Any, batch: bool, now: float, dt: float, host: str) -> list[dict]:
        socks, hot = self._read_socks(self._stat(STAT_HOT_CLAIM) + self._stat(STAT_HOT_STEAL))
        by_tuple: dict[R.Tuple, Any] = {_tuple(v.t): v for v in socks.values() if v.known}
        # socks is not drained: what it lost to the LRU is what was created
        # minus what the kernel deleted minus what is still there.
        self.evictions.harvested["socks"] = self._stat(STAT_SOCK_DEL) + len(socks)
        flows = self._owner_bytes(socks, hot)
        for k, v in self._harvest("flows"):
            key = (int(k.tgid), _tuple(k.t))
            flows.setdefault(key, R.FlowFigures()).add(*_fields(v, "tx_bytes", "rx_bytes"))
        # Bytes counted before a socket's 4-tuple was known.
        for k, v in self._harvest("orphans"):
            okey = (int(k.tgid), int(k.sk))
            fig, age = self._orphans.get(okey, (R.FlowFigures(), 0))
            fig.add(*_fields(v, "tx_bytes", "rx_bytes"))
            self._orphans[okey] = (fig, age)
        diag = self._read_diag({tgid for tgid, _ in self._orphans}, by_tuple)
        self._name_orphans(b, socks, flows, by_tuple, diag)
        owners: dict[R.Tuple, int] = {}
        for pid, tup in flows:
            best = owners.get(tup)
            if best is None or flows[(pid, tup)].tx_bytes > flows[(best, tup)].tx_bytes:
                owners[tup] = pid
        self._add_tcp_info(flows, owners, by_tuple, diag)
        self._keep_for_lookup(diag, by_tuple)
        out = R.flow_records(flows, now, dt, host)
        out += self._conn_records(b, batch, now, host, socks, owners)
        return out

    def _read_socks(
        self, claims: int | None = None
    ) -> tuple[dict[int, Any], dict[int, tuple[int, int, int]]]:
        """``(socks, hot)`` for :meth:`_owner_bytes`: the hot slots read before
        socks, as socks is before closed (tcp_flows.c frees a slot only after
        socks lost its socket, and folds it into closed first): each byte
        counts once. ``claims``: the slot claims the stats counted, read
        before (:meth:`HotSlots.read`)."""
        hot = self._hot.read(claims) if self._hot is not None else {}
        return {_int(k): v for k, v in self._read("socks")}, hot

    def _owner_bytes(
        self, socks: dict[int, Any], hot: dict[int, tuple[int, int, int]]
    ) -> dict[tuple[int, R.Tuple], R.FlowFigures]:
        """Each socket owner's bytes since the last poll: the cumulative
        counts in its sock_info and its hot slot (``hot``: socket -> (owner,
        tx, rx), read first), minus those seen last time,
        then the final counts of sockets that closed since (drained from
        `closed`), minus what was seen of them. Read in that order, a socket
        that closes between the two reads is counted once."""
        flows: dict[tuple[int, R.Tuple], R.FlowFigures] = {}
        seen = self._sock_seen
        now: dict[tuple[int, R.Tuple], tuple[int, int]] = {}

        def add(key: tuple[int, R.Tuple], tgid: int, tx: int, rx: int) -> None:
            tx0, rx0 = seen.get(key, (0, 0))
            if tx > tx0 or rx > rx0:
                flows.setdefault((tgid, key[1]), R.FlowFigures()).add(
                    max(0, tx - tx0), max(0, rx - rx0)
                )

        for sk, v in socks.items():
            if v.known and v.tgid:
                key = (sk, _tuple(v.t))
                cur = (int(v.tx_bytes), int(v.rx_bytes))
                slot = hot.get(sk)
                if slot is not None and slot[0] == v.tgid:
                    cur = (cur[0] + slot[1], cur[1] + slot[2])
                add(key, int(v.tgid), *cur)
                now[key] = seen[key] = cur
        for k, v in self._harvest("closed"):
            sk, tgid = int(k.sk), int(v.tgid)
            key = (sk, _tuple(k.t))
            add(key, tgid, int(v.tx_bytes), int(v.rx_bytes))
            now.pop(key, None)
            # What earlier polls parked of it: the close named it at last.
            if (tgid, sk) in self._orphans:
                self._name_parked(flows, (tgid, sk), key[1])
        self._sock_seen = now  # the rest closed or were evicted
        return flows

    def _read_diag(
        self, extra_pids: set[int], by_tuple: dict[R.Tuple, Any]
    ) -> list[tuple[tuple[int, int], DiagSocket]]:
        """Every TCP socket's tcp_info now, in the namespaces of the
        registered processes and of ``extra_pids`` too (probes/sockdiag.py);
        or, when nothing new can be there, only the sockets of interest
        (:meth:`_keep_for_lookup`). A whole read is due every
        ``DIAG_FULL_EVERY`` polls, and whenever a socket may be new to it:
        bytes wait for a name (``extra_pids``: orphans are named from it), the
        probes know a 4-tuple it did not keep, or the registered set changed;
        with no pid filter every socket is of interest."""
        if self._sockdiag is None:
            return []
        pids = self._registered | extra_pids
        only = None
        if (
            self.config.pid_filter
            and not extra_pids
            and self._diag_keep is not None
            and self._diag_age < DIAG_FULL_EVERY
            and pids == self._diag_pids
            and by_tuple.keys() <= self._diag_keep_tuples
        ):
            only = self._diag_keep
            self._diag_age += 1
            self.diag_reads["lookup"] += 1
        else:
            self._diag_age = 0
            self.diag_reads["whole"] += 1
        self._diag_pids = frozenset(pids)
        return self._sockdiag.read(pids, only)

    def _keep_for_lookup(
        self, diag: list[tuple[tuple[int, int], DiagSocket]], by_tuple: dict[R.Tuple, Any]
    ) -> None:
        """The sockets the next poll may read by exact lookups: the live ones of
        this read whose 4-tuple the probes know or whose figures went to a
        registered process (the rest of a namespace is no one's of interest
        until a whole read says otherwise)."""
        keep: dict[tuple[int, int], list[DiagSocket]] = {}
        tuples: set[R.Tuple] = set()
        owned = self._cookie_owner
        for ns, sk in diag:
            if sk.state == TCP_CLOSE:
                continue
            tup = R.make_tuple(sk.family, sk.lport, sk.rport, sk.laddr, sk.raddr)
            if tup in by_tuple or (ns, sk.cookie) in owned:
                keep.setdefault(ns, []).append(sk)
                tuples.add(tup)
        self._diag_keep, self._diag_keep_tuples = keep, tuples

    def _name_orphans(
        self,
        b: Any,
        socks: dict[int, Any],
        flows: dict[tuple[int, R.Tuple], R.FlowFigures],
        by_tuple: dict[R.Tuple, Any],
        diag: list[tuple[tuple[int, int], DiagSocket]],
    ) -> None:
        """Bytes parked under a socket address go to its flow once the kernel
        named the socket. A process's parked socket can be TCP only while the
        process holds a TCP socket the kernel has not named (one older than
        the probes: sock_diag lists it, inet_sock_set_state never saw it
        open); then NAMING_TRACEPOINT is attached until it is named, for
        ORPHAN_POLLS polls at most (then it is no TCP either). Sockets
        of other processes are no TCP (unix, udp): their bytes are counted
        lost and the kernel told to skip them from then on."""
        unnamed_tcp = {
            sk.inode
            for _, sk in diag
            if sk.inode
            and R.make_tuple(sk.family, sk.lport, sk.rport, sk.laddr, sk.raddr) not in by_tuple
        }
        may_be_tcp: dict[int, bool] = {}
        need_naming = False
        for okey, (fig, age) in list(self._orphans.items()):
            tgid, sk_addr = okey
            info = socks.get(sk_addr)
            if info is not None and info.known:
                self._name_parked(flows, okey, _tuple(info.t))
                continue
            if tgid not in may_be_tcp:
                may_be_tcp[tgid] = bool(self._owners.inodes(tgid) & unnamed_tcp)
            if not may_be_tcp[tgid] or age + 1 >= ORPHAN_POLLS:
                self.lost_orphan_bytes += fig.tx_bytes + fig.rx_bytes
                del self._orphans[okey]
                # Parked through ORPHAN_POLLS polls with tcp_probe attached and
                # still not named: no TCP socket either. A TCP socket moving
                # bytes receives segments (data or ACKs), and each names it.
                # Without this, a process holding one idle unnamed TCP socket
                # (a store connection older than the probes) kept its unix
                # socket's bytes parked for good: a whole sock_diag read every
                # poll and tcp_probe attached and detached every few polls.
                if not may_be_tcp[tgid] or self._naming_on:
                    self._ignore_socket(b, sk_addr, tgid)
            else:
                self._orphans[okey] = (fig, age + 1)
                need_naming = True
        self._set_naming(need_naming)
        if self._naming_on:
            self.naming_polls += 1

    def _name_parked(
        self,
        flows: dict[tuple[int, R.Tuple], R.FlowFigures],
        okey: tuple[int, int],
        tup: R.Tuple,
    ) -> None:
        """The bytes parked under ``okey`` (tgid, socket) go to that process's flow ``tup``."""
        fig, _age = self._orphans.pop(okey)
        flows.setdefault((okey[0], tup), R.FlowFigures()).add(fig.tx_bytes, fig.rx_bytes)

    def _ignore_socket(self, b: Any, sk: int, tgid: int) -> None:
        table = b[b"socks"]
        leaf = table.Leaf()
        leaf.tgid = tgid
        leaf.ignore = 1
        with contextlib.suppress(Exception):  # full map: it is parked again later
            table[table.Key(sk)] = leaf

    def _add_tcp_info(
        self,
        flows: dict[tuple[int, R.Tuple], R.FlowFigures],
        owners: dict[R.Tuple, int],
        by_tuple: dict[R.Tuple, Any],
        read: list[tuple[tuple[int, int], DiagSocket]],
    ) -> None:
        """srtt, cwnd and the send window now, and the retransmitted segments
        (and those the peer reported as duplicates: D-SACK) since the last
        poll, from the kernel's tcp_info (probes/sockdiag.py); sockets
        destroyed since the last poll add their last counts (the destroy
        broadcast), and carry no srtt. A connection that only
        retransmitted goes to the process that moved its bytes, else the one
        it went to at an earlier poll, else the one the kernel saw open it,
        else the registered process holding its inode."""
        if self._sockdiag is None:
            return
        counts = self._sockdiag.deltas(read)
        destroyed = self._sockdiag.destroyed
        self._owners.round += 1
        info: dict[R.Tuple, DiagSocket] = {}
        cache = self._cookie_owner
        for ns, sk in [*read, *destroyed]:
            tup = R.make_tuple(sk.family, sk.lport, sk.rport, sk.laddr, sk.raddr)
            live = sk.state != TCP_CLOSE
            if live:
                info[tup] = sk
            n = counts.get((ns, sk.cookie))
            owner = owners.get(tup)
            if owner is None and n:
                owner = cache.get((ns, sk.cookie))
                if owner is None:
                    known = by_tuple.get(tup)
                    owner = int(known.tgid) if known is not None else 0
                if not owner:
                    owner = self._owners.owner(sk.inode, self._owner_candidates())
                if self.config.pid_filter and owner not in self._registered:
                    continue
                owners[tup] = owner
            if owner and live:
                cache[(ns, sk.cookie)] = owner
            elif not live:
                cache.pop((ns, sk.cookie), None)
            if n:
                fig = flows.setdefault((owner or 0, tup), R.FlowFigures())
                fig.retrans += n.retrans
                fig.dsack_dups += n.dsack_dups
        while len(cache) > self.config.max_socks:  # oldest first
            del cache[next(iter(cache))]
        for (_, tup), fig in flows.items():
            now = info.get(tup)
            if now is not None:
                fig.srtt_us = now.srtt_us or None
                fig.cwnd = now.cwnd or None
                fig.snd_wnd = now.snd_wnd or None

    def _owner_candidates(self) -> list[int]:
        if self.config.pid_filter:
            return sorted(self._registered)
        root = self.config.proc_root
        with contextlib.suppress(OSError):
            return [int(d) for d in os.listdir(root) if d.isdigit()]
        return []

    def _conn_records(
        self,
        b: Any,
        batch: bool,
        now: float,
        host: str,
        socks: dict[int, Any],
        owners: dict[R.Tuple, int],
    ) -> list[dict]:
        fresh: list[tuple[dict[str, Any], int, R.Tuple, int]] = []
        for k, v in self._harvest("conn_events"):
            tup = _tuple(k.t)
            rec: dict[str, Any] = {
                "kind": "conn",
                "t": now,
                "host": host,
                "pid": int(v.tgid),
                "src": tup.src,
                "dst": tup.dst,
                "what": R.CONN_WHAT.get(int(k.what), "unknown"),
                "count": int(v.count),
            }
            if int(k.what) in R.RESET_DIRECTION:
                rec["direction"] = R.RESET_DIRECTION[int(k.what)]
            fresh.append((rec, int(v.sk), tup, 0))
        out = []
        keep = []
        for rec, sk, tup, age in self._pending_conns + fresh:
            if not rec["pid"]:
                # Softirq events: the socket's owner, else this poll's sender.
                info = socks.get(sk)
                rec["pid"] = (int(info.tgid) if info is not None else 0) or owners.get(tup, 0)
            if self.config.pid_filter and rec["pid"] not in self._registered:
                if age + 1 < CONN_POLLS:  # no registered process claimed it yet
                    rec["pid"] = 0
                    keep.append((rec, sk, tup, age + 1))
                continue
            out.append(rec)
        self._pending_conns = keep
        return out

    def _poll_netdev(self, now: float, dt: float, host: str) -> list[dict]:
        if self._devstats is None:
            return []
        return R.netdev_records(self._devstats.poll(), now, dt, host)

    def _poll_nccl(self, b: Any, batch: bool, now: float, dt: float, host: str) -> list[dict]:
        calls = self._harvest("nccl_calls")
        if not calls:
            return []
        comms = {_int(k): v for k, v in self._read("nccl_comms")}
        return R.nccl_records(calls, comms, now, dt, host)

    def _poll_qps(self, b: Any, batch: bool, now: float, host: str) -> list[dict]:
        return R.qp_records(self._harvest("qps"), now, host)

    def program_stats(self) -> dict[str, dict[str, int]]:
        """Per loaded program, the kernel's ``run_cnt``, ``run_time_ns`` (they
        move only while BPF stats are on: :class:`.bpfstats.RunStats`) and
        ``recursion_misses``, from this process's fdinfo."""
        return read_fdinfo(self.program_fds())

    def missed_events(self, stats: dict[str, dict[str, int]] | None = None) -> dict[str, int]:
        """Per program, events the kernel skipped because another BPF tracing
        program (any tool's) or a BPF map syscall held this CPU at that moment
        (``recursion_misses`` in the program's fdinfo; ``stats``: a
        :meth:`program_stats` answer just read, so it is not read twice)."""
        return {
            name: figs["recursion_misses"]
            for name, figs in (self.program_stats() if stats is None else stats).items()
            if "recursion_misses" in figs
        }

    def lost_events(self, stats: dict[str, dict[str, int]] | None = None) -> dict[str, int]:
        """Events lost on the kernel side so far, by source (the exporter's
        ``events_lost_total``): ``map_eviction`` (entries the LRU maps evicted
        before a poll read them), ``tracepoint_miss`` (program runs the kernel
        skipped), ``sock_diag_read_error`` (namespace reads of tcp_info that
        failed: that poll's srtt/cwnd of the namespace, and the retransmits
        since its last read, are lost), ``sock_diag_destroy_overflow`` (times
        a destroy listener's buffer overflowed: closing sockets' last
        retransmits lost). A source added here is exported with no other
        change. ``stats``: as for :meth:`missed_events`."""
        return {
            "map_eviction": sum(self.evictions.evicted().values()),
            "tracepoint_miss": sum(self.missed_events(stats).values()),
            "sock_diag_read_error": self._sockdiag.read_errors if self._sockdiag else 0,
            "sock_diag_destroy_overflow": self._sockdiag.destroy_overflows if self._sockdiag else 0,
        }

    def stats(self) -> dict[str, Any]:
        """Health of the probes: LRU evictions per map, bytes parked on
        sockets never named (non-TCP sockets of traced processes included),
        events the kernel skipped."""
        return {
            "evicted": self.evictions.evicted(),
            "unattributed_bytes": self.lost_orphan_bytes,
            "missed_events": self.missed_events(),
            "batch_lookup_and_delete": self._batch,
            "hot_slots": {
                "claimed": self._stat(STAT_HOT_CLAIM),
                "stolen": self._stat(STAT_HOT_STEAL),
                "mmap": self._hot.mapped if self._hot is not None else False,
            },
            "sock_diag": {
                **self.diag_reads,
                "dumps": self._sockdiag.dumps if self._sockdiag else 0,
                "lookups": self._sockdiag.lookups if self._sockdiag else 0,
                "lookup_fallbacks": self._sockdiag.lookup_fallbacks if self._sockdiag else 0,
            },
        }


class HotSlots:
    """The ``hot`` array (tcp_flows.c), read through mmap: no map syscall, so
    reading it never holds a CPU where a classic tracepoint would then be
    skipped. Where the kernel or bcc does not map it, read with lookups."""

    def __init__(self, table: Any, batch: bool, bits: int) -> None:
        import mmap

        self._table, self._batch = table, batch
        self._held: list[int] | None = None  # slots held at the last read
        self.whole_reads = 0  # reads of every slot (the others read the held ones)
        self._claims: int | None = None  # the claim count read before the last whole read
        self._mm: Any = None
        self._words: memoryview | None = None
        size = -(-((1 << bits) * HOT_SLOT_BYTES) // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            self._mm = mmap.mmap(table.map_fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            self._words = memoryview(self._mm).cast("Q")
        except (OSError, ValueError, AttributeError) as e:
            log.info("hot slots not mmap-able (%s): read with map lookups", e)
            self._mm = None

    @property
    def mapped(self) -> bool:
        return self._words is not None

    def read(self, claims: int | None = None) -> dict[int, tuple[int, int, int]]:
        """Socket address -> (owner tgid, tx bytes, rx bytes) of every held slot.

        ``claims``: the kernel's count of slot claims (and steals), read
        before this call. While it has not moved since the last whole read,
        no slot was taken since: the held ones are then all there is to read
        (a slot is only freed meanwhile), not all 4,096. None: read them all."""
        out: dict[int, tuple[int, int, int]] = {}
        w = self._words
        if w is None:
            for _, v in _read_all(self._table, self._batch):
                if v.sk > 1:
                    out[int(v.sk)] = (int(v.tgid), int(v.tx_bytes), int(v.rx_bytes))
            return out
        per = HOT_SLOT_BYTES // 8
        if claims is None or claims != self._claims or self._held is None:
            sks = w[::per].tolist()
            slots: Iterable[int] = range(len(sks))
            held: list[int] = []
            self.whole_reads += 1
        else:
            slots, held = self._held, []
            sks = None
        for i in slots:
            base = i * per
            sk = w[base] if sks is None else sks[i]
            if sk > 1:  # 0 free, 1 being claimed or released
                held.append(i)
                tgid, tx, rx = w[base + 1] & 0xFFFFFFFF, w[base + 2], w[base + 3]
                if w[base] == sk:  # not reclaimed while it was read
                    out[sk] = (tgid, tx, rx)
        self._held, self._claims = held, claims
        return out

    def close(self) -> None:
        if self._words is not None:
            self._words.release()
            self._words = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None
