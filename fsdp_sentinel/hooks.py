"""Collective timing for any FSDP2 model, through FSDP2's own extension points.

Three lines instrument a model that ``fully_shard`` has wrapped::

    from fsdp_sentinel.hooks import instrument
    inst = instrument(model)            # after fully_shard, after init_process_group
    with inst.step(step_no): ...        # around each optimizer step

``model`` may also be a list of model parts (pipeline stages, several FSDP
roots in one process): one :class:`Instrumentation` serves them all.

:func:`instrument` wraps the all-gather and reduce-scatter comm that each
FSDP parameter group of every ``FSDPModule`` already has (FSDP's default, a
ProcessGroup-allocated or symmetric-memory one, or one the user set with
``set_custom_all_gather``), so the collective itself, its buffers and its
allocator are unchanged; no torch internals are patched. The timed comm is
an instance of the FSDP comm class it wraps, so FSDP's own checks
(``set_symm_mem_for_comm``, ``set_allocate_memory_from_process_group_for_comm``)
accept or refuse it exactly as they would the comm underneath. A comm the user
sets after :func:`instrument` runs as set and is wrapped again at the start of
the next ``inst.step`` (see docs/hooks.md).

Each collective gives one trace-v1 ``coll`` record: ``bytes`` the full tensor
(all-gather output, reduce-scatter input), ``issue`` the wall time it was
issued, ``end`` the wall time this rank observed it complete, ``group`` the
process group's name (from its global ranks, so the same on every member:
:func:`group_id`), ``group_size``, and ``seq`` its place in this rank's issue
order *within that group* (FSDP issues a group's collectives in the same order
on every member, so ``(group, seq)`` names one collective across ranks, also
when a rank belongs to several groups: HSDP, pipeline stages, experts). The
rank announces itself with a ``rank`` record; ``inst.step`` emits a ``step``
record.

While a collective is in flight longer than ``pending_after_s`` (default
1 s), a ``pending`` record (``t``, ``rank``, ``step``, ``seq``, ``op``,
``issue``, ``group``) says so, then again each ``pending_every_s`` while it
stays in flight: a rank blocked in a collective that never completes (its
peer hung or gone) is then visible long before the NCCL/gloo timeout. These
records are made and sent by the emitter's sender thread (a tick it runs
before each drain), never by the training thread, which only files the
collective in a dict at issue and takes it out at completion. A process that
is stopped (SIGSTOP) or dead sends none, which is what names it.

Completion is observed without blocking training: a synchronous CPU (gloo)
collective has completed when the call returns; an asynchronous one is
stamped by a callback on its ``Work``'s future; a CUDA collective by a
watcher thread that waits on a CUDA event recorded after it, or polls an
asynchronous ``Work`` (one thread per op, since each op runs on its own
stream, in order). The CUDA path is untested here (no GPU on the build
machine).

Hooks never break training: any exception inside them is swallowed and
counted in ``Instrumentation.errors`` (the first one kept in ``first_error``).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fsdp_sentinel.emit import Emitter, socket_from_env
from fsdp_sentinel.hostinfo import host_name, local_addrs

if TYPE_CHECKING:
    import torch
    from torch import nn

Clock = Callable[[], float]


class _StepSpan:
    """Context manager for one optimizer step; set ``.loss`` to record it."""

    __slots__ = ("_inst", "step", "start", "loss")

    def __init__(self, inst: Instrumentation, step: int) -> None:
        self._inst = inst
        self.step = step
        self.start = 0.0
        self.loss: float | None = None

    def __enter__(self) -> _StepSpan:
        self._inst.rewrap()
        self._inst.current_step = self.step
        self.start = self._inst.clock()
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self._inst._step_done(self)


class Instrumentation:
    """The state behind :func:`instrument`: counters, the step, the emitter.

    ``colls`` counts coll records emitted, ``errors`` exceptions swallowed
    inside hooks; ``sent``/``dropped`` are the emitter's.
    """

    def __init__(
        self,
        emitter: Emitter,
        *,
        rank: int,
        world_size: int,
        host: str,
        clock: Clock = time.time,
        owns_emitter: bool = False,
        pending_after_s: float = 1.0,
        pending_every_s: float = 1.0,
    ) -> None:
        self.emitter = emitter
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.job = job_id(os.environ)
        self.store = store_address(os.environ)
        self.clock = clock
        self._owns_emitter = owns_emitter
        self.current_step = 0
        self.colls = 0
        self.errors = 0
        self.first_error: BaseException | None = None
        self._seqs: dict[str | None, int] = {}  # group -> its next seq on this rank
        # id(process group) -> (the group, its name, its size); the group is
        # kept so that its id cannot be reused by another object meanwhile.
        self._groups: dict[int, tuple[Any, str | None, int]] = {}
        self._lock = threading.Lock()
        self._watchers: dict[str, _CudaWatcher] = {}
        self.modules: list[Any] = []
        self._param_groups: list[Any] = []  # FSDP parameter groups whose comms we time
        self.rewrapped = 0  # comms the user set after instrument(), wrapped at a step start
        self.pending_after_s = pending_after_s
        self.pending_every_s = pending_every_s
        self.pendings = 0  # pending records emitted
        # (group, seq) -> [its coll record, when its next pending record is
        # due]. The training thread only sets and pops keys (each one operation
        # under the GIL); the sender thread reads a copy (see _report_pending).
        self._inflight: dict[tuple[str | None, int], list[Any]] = {}
        add_ticker = getattr(emitter, "add_ticker", None)
        if add_ticker is not None:  # an emitter without a sender thread: no pending records
            add_ticker(self._report_pending)

    # ------------------------------------------------------------ public
    def step(self, step_no: int) -> _StepSpan:
        """``with inst.step(n) as s:`` wraps step ``n``; ``s.loss = ...`` is optional."""
        return _StepSpan(self, step_no)

    @property
    def sent(self) -> int:
        return self.emitter.sent

    @property
    def dropped(self) -> int:
        return self.emitter.dropped

    def announce(self) -> None:
        """Emit this rank's ``rank`` record (done once by :func:`instrument`; the
        emitter sends it again ahead of anything else to a daemon that comes
        back after a crash, which knows nothing of this rank).

        No ``attempt``: torchrun's ``TORCHELASTIC_RESTART_COUNT`` counts one
        agent's failures, not the job's restarts. When a rank dies, its
        host's agent counts 1 while the other agents restart their workers
        for the new rendezvous round and still count 0 (seen in the lab: the
        restarted ranks announced 1, 0, 0, 0), which would fold new processes
        into the old attempt. Every restarted rank has a new pid, which is
        what the daemon goes by without ``attempt`` (``jobs.JobRouter``)."""
        self._safe_emit(self.rank_record)
        set_greeting = getattr(self.emitter, "set_greeting", None)
        if set_greeting is not None:
            set_greeting(lambda: [self.rank_record()])

    def rank_record(self) -> dict[str, Any]:
        return {
            "kind": "rank",
            "t": self.clock(),
            "rank": self.rank,
            "world_size": self.world_size,
            "host": self.host,
            "pid": os.getpid(),
            "addrs": local_addrs(),
            **({"job": self.job} if self.job else {}),
            **({"store": self.store} if self.store else {}),
        }

    def attach(self, model: nn.Module | Iterable[nn.Module]) -> None:
        """Time the comms of every FSDPModule in ``model`` (a module, or a list
        of model parts); parts attached before stay attached. Each parameter
        group's current all-gather and reduce-scatter comm is wrapped, whatever
        it is; one already timed is left as it is."""
        from torch import nn
        from torch.distributed.fsdp import FSDPModule

        parts = [model] if isinstance(model, nn.Module) else list(model)
        known = {id(m) for m in self.modules}
        mods = []
        for part in parts:  # parts may share modules: each is attached once
            for m in part.modules():
                if isinstance(m, FSDPModule) and id(m) not in known:
                    known.add(id(m))
                    mods.append(m)
        if not mods and not self.modules:
            raise ValueError("instrument(): no FSDPModule in the model; call fully_shard first")
        for mod in mods:
            groups = _param_groups(mod)
            if groups is None:
                warnings.warn(
                    "fsdp_sentinel: this torch's FSDP2 keeps its comms where the hooks do not "
                    f"look ({type(mod).__name__}); its collectives are not timed",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            self._param_groups.extend(groups)
        self.modules.extend(mods)
        self.rewrap(count=False)

    def rewrap(self, *, count: bool = True) -> None:
        """Wrap any comm on an attached module that is not timed (one the user
        set since): run at the start of each ``inst.step``, so a comm set after
        :func:`instrument` is the one that runs, and is timed from the next
        step on. Two attribute reads per parameter group when nothing changed."""
        try:
            for pg in self._param_groups:
                for attr, kind in _COMM_SLOTS:
                    comm = getattr(pg, attr, None)
                    if comm is not None and not isinstance(comm, _TimedComm):
                        # What FSDPModule.set_custom_all_gather / _reduce_scatter
                        # do, per parameter group (they refuse a module with
                        # several groups; we wrap each group's own comm).
                        setattr(pg, attr, _wrap_comm(self, kind, comm))
                        self.rewrapped += count
        except Exception as e:  # noqa: BLE001 - hooks must never break training
            self._error(e)

    def detach(self) -> None:
        """Put back, on every instrumented module, the comm each timed one wraps."""
        for pg in self._param_groups:
            for attr, _ in _COMM_SLOTS:
                comm = getattr(pg, attr, None)
                if isinstance(comm, _TimedComm) and comm.inst is self:
                    setattr(pg, attr, comm.inner)
        self._param_groups = []
        self.modules = []

    def close(self) -> None:
        """Stop watcher threads (after their pending records) and the emitter if owned."""
        for w in self._watchers.values():
            w.stop()
        self._watchers.clear()
        if self._owns_emitter:
            self.emitter.close()

    # ------------------------------------------------------------ internals
    def _error(self, e: BaseException) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = e

    def _safe_emit(self, build: Callable[[], dict[str, Any]]) -> None:
        try:
            self.emitter.emit(build())
        except Exception as e:  # noqa: BLE001 - hooks must never break training
            self._error(e)

    def _step_done(self, span: _StepSpan) -> None:
        try:
            rec: dict[str, Any] = {
                "kind": "step",
                "rank": self.rank,
                "step": span.step,
                "start": span.start,
                "end": self.clock(),
            }
            if span.loss is not None:
                rec["loss"] = float(span.loss)
            self.emitter.emit(rec)
        except Exception as e:  # noqa: BLE001
            self._error(e)

    def _group(self, group: Any) -> tuple[str | None, int]:
        """A process group's name (:func:`group_id`; None when it has no global
        ranks to name it by) and size, looked up once per group."""
        hit = self._groups.get(id(group))
        if hit is not None and hit[0] is group:
            return hit[1], hit[2]
        size = group.size()
        try:
            import torch.distributed as dist

            name: str | None = group_id(dist.get_process_group_ranks(group))
        except Exception:  # noqa: BLE001 - not a c10d group (a stand-in in tests)
            name = None
        self._groups[id(group)] = (group, name, size)
        return name, size

    def _issue(self, op: str, full: torch.Tensor, group: Any) -> dict[str, Any] | None:
        """The record of a collective about to be issued (None if that failed)."""
        try:
            name, size = self._group(group)
            with self._lock:
                seq = self._seqs.get(name, 0)
                self._seqs[name] = seq + 1
            issue = self.clock()
            rec: dict[str, Any] = {
                "kind": "coll",
                "rank": self.rank,
                "step": self.current_step,
                "seq": seq,
                "op": op,
                "bytes": full.numel() * full.element_size(),
                "group_size": size,
                "issue": issue,
                "end": None,
            }
            if name is not None:
                rec["group"] = name
            self._inflight[(name, seq)] = [rec, issue + self.pending_after_s]
            return rec
        except Exception as e:  # noqa: BLE001
            self._error(e)
            return None

    def _issued(self, rec: dict[str, Any] | None, work: Any, full: torch.Tensor) -> None:
        """Arrange for ``rec`` to be stamped and emitted when the collective completes."""
        if rec is None:
            return
        try:
            if full.device.type == "cuda":
                watcher = self._watchers.get(rec["op"])
                if watcher is None:
                    watcher = self._watchers[rec["op"]] = _CudaWatcher(self)
                watcher.put(rec, _cuda_done_waiter(work))
            elif work is None:  # synchronous: complete on return
                self._complete(rec)
            else:
                work.get_future().add_done_callback(lambda _f: self._complete(rec))
        except Exception as e:  # noqa: BLE001
            self._error(e)

    def _complete(self, rec: dict[str, Any]) -> None:
        try:
            self._inflight.pop((rec.get("group"), rec["seq"]), None)
            rec["end"] = self.clock()
            self.colls += 1
            self.emitter.emit(rec)
        except Exception as e:  # noqa: BLE001
            self._error(e)

    def _report_pending(self) -> None:
        """On the sender thread: a ``pending`` record for each collective due one.

        ``list(dict.values())`` copies in one C call that holds the GIL, so
        the training thread's inserts and pops cannot change the dict under
        it; an entry popped after the copy at worst yields one last pending
        record just before its ``coll`` record, which readers expect anyway.
        """
        if not self._inflight:
            return
        now = self.clock()
        every = self.pending_every_s
        for entry in list(self._inflight.values()):
            rec, due = entry
            if now < due:
                continue
            # The next one is due a period after this one was due, not after
            # this tick: the sender's ticks fall on a fixed grid (emit: the
            # multiples of its flush interval), and a tick a little earlier
            # past its grid point than the last one must not push the record
            # to the tick after. Behind by a period or more (a starved
            # sender): a period from now, no burst to catch up.
            entry[1] = due + every if now - due < every else now + every
            self.pendings += 1
            self._safe_emit(functools.partial(self._pending_record, rec, now))

    def _pending_record(self, rec: dict[str, Any], now: float) -> dict[str, Any]:
        out = {
            "kind": "pending",
            "t": now,
            "rank": self.rank,
            "step": rec["step"],
            "seq": rec["seq"],
            "op": rec["op"],
            "issue": rec["issue"],
        }
        if "group" in rec:
            out["group"] = rec["group"]
        return out


def _cuda_done_waiter(work: Any) -> Callable[[], None]:
    """A blocking call that returns once a CUDA collective has completed.

    Synchronous (``work is None``): the current stream already waits for the
    collective, so an event recorded on it now completes after it; waiting on
    the event releases the GIL. Asynchronous: the current stream does not
    wait, so poll the ``Work`` (a non-blocking query) instead.
    """
    if work is None:
        import torch

        event = torch.cuda.Event()
        event.record()
        return event.synchronize

    def poll() -> None:
        while not work.is_completed():
            time.sleep(0.0002)

    return poll


class _CudaWatcher:
    """A thread that stamps CUDA collectives complete, in issue order, off the training thread."""

    def __init__(self, inst: Instrumentation) -> None:
        self._inst = inst
        self._q: queue.SimpleQueue[tuple[dict[str, Any], Callable[[], None]] | None] = (
            queue.SimpleQueue()
        )
        self._t = threading.Thread(target=self._run, name="fsdp-sentinel-cuda", daemon=True)
        self._t.start()

    def put(self, rec: dict[str, Any], wait: Callable[[], None]) -> None:
        self._q.put((rec, wait))

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            rec, wait = item
            try:
                wait()  # blocks only this thread
            except Exception as e:  # noqa: BLE001
                self._inst._error(e)
                continue
            self._inst._complete(rec)

    def stop(self) -> None:
        self._q.put(None)
        self._t.join(timeout=5.0)


# Where an FSDP parameter group keeps each comm (torch 2.13: FSDPParamGroup).
_COMM_SLOTS = (("_all_gather_comm", "all_gather"), ("_reduce_scatter_comm", "reduce_scatter"))


def _param_groups(mod: Any) -> list[Any] | None:
    """The FSDP parameter groups of ``mod`` (None if this torch keeps them elsewhere)."""
    groups = getattr(mod._get_fsdp_state(), "_fsdp_param_groups", None)
    if groups is None or not all(hasattr(pg, attr) for pg in groups for attr, _ in _COMM_SLOTS):
        return None
    return list(groups)


class _TimedComm:
    """What both timed comms share: the hooks' state and the comm they wrap,
    whose allocator (default, ProcessGroup, symmetric memory) is used as is."""

    def __init__(self, inst: Instrumentation, inner: Any) -> None:
        # FSDP's own comm classes are bases of the timed ones only for
        # isinstance; their __init__ (a barrier, for symmetric memory) is not run.
        self.inst = inst
        self.inner = inner

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __getattr__(self, name: str) -> Any:
        # Anything else the wrapped comm has (a ProcessGroup comm's group) reads through.
        if name in ("inst", "inner"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class _TimedAllGather(_TimedComm):
    def __call__(
        self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False
    ) -> Any:
        rec = self.inst._issue("all_gather", output_tensor, group)
        work = self.inner(output_tensor, input_tensor, group, async_op)
        self.inst._issued(rec, work, output_tensor)
        return work


class _TimedReduceScatter(_TimedComm):
    def __call__(
        self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        rec = self.inst._issue("reduce_scatter", input_tensor, group)
        work = self.inner(output_tensor, input_tensor, group, op, async_op)
        self.inst._issued(rec, work, input_tensor)
        return work


@functools.cache
def _timed_class(kind: str, inner_type: type) -> type:
    """The timed comm class for a comm of ``inner_type`` (built once per type).

    Its FSDP base is the most derived of FSDP's own comm classes that
    ``inner_type`` is (``DefaultAllGather``, ``ProcessGroupAllocAllGather``,
    ``SymmMemAllGather``, ...; the abstract ``AllGather`` for a comm of the
    user's own): FSDP decides with ``isinstance`` whether
    ``set_symm_mem_for_comm`` and ``set_allocate_memory_from_process_group_for_comm``
    may replace a comm, and whether a reduce-scatter uses symmetric memory, so
    the timed comm answers as the one it wraps would.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    mixin, abstract = (
        (_TimedAllGather, AllGather)
        if kind == "all_gather"
        else (_TimedReduceScatter, ReduceScatter)
    )
    base = next(
        (
            c
            for c in inner_type.__mro__
            if c.__module__ == _fsdp_collectives.__name__ and issubclass(c, abstract)
        ),
        abstract,
    )
    return type(f"Timed{base.__name__}", (mixin, base), {"__module__": __name__})


def _wrap_comm(inst: Instrumentation, kind: str, comm: Any) -> Any:
    """``comm`` timed for ``inst`` (``kind``: ``all_gather`` or ``reduce_scatter``)."""
    cls: Any = type(comm)  # a class is hashable, as the cache needs
    return _timed_class(kind, cls)(inst, comm)


def group_id(ranks: Sequence[int]) -> str:
    """A process group's name from its global ranks, the same on every member
    and short at any size: ``"0-3"`` (ranks 0..3), ``"1-7:2"`` (1, 3, 5, 7),
    ``"5"`` (one rank); any other set is ``"h"`` and 12 hex digits of a hash of
    the ranks in group order (docs/trace-format.md, ``coll.group``)."""
    rs = [int(r) for r in ranks]
    if len(rs) == 1:
        return str(rs[0])
    step = rs[1] - rs[0] if len(rs) > 1 else 0
    if step > 0 and all(b - a == step for a, b in zip(rs, rs[1:], strict=False)):
        return f"{rs[0]}-{rs[-1]}" + (f":{step}" if step != 1 else "")
    return "h" + hashlib.sha256(",".join(map(str, rs)).encode()).hexdigest()[:12]


def job_id(env: Mapping[str, str]) -> str:
    """The run id of this job, the same on every rank (docs/trace-format.md,
    ``rank.job``): ``FSDP_SENTINEL_JOB``, else torchelastic's run id (unless
    torchrun's default ``none``), else Slurm's job id, else a hash of the
    rendezvous address; ``""`` when there is none of these."""
    for name in ("FSDP_SENTINEL_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = env.get(name, "")
        if value and value != "none":
            return value
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if addr and port:
        return "rdzv-" + hashlib.sha256(f"{addr}:{port}".encode()).hexdigest()[:8]
    return ""


class _Env(enum.Enum):
    """``instrument(socket_path=FROM_ENV)``: the socket comes from the environment."""

    FROM_ENV = "from the environment"


#: ``socket_path``'s default: :data:`fsdp_sentinel.emit.SOCKET_ENV`, else the default socket.
FROM_ENV = _Env.FROM_ENV


def socket_for(socket_path: str | None | _Env, env: Mapping[str, str]) -> str | None:
    """The socket :func:`instrument` sends to: ``socket_path`` when given (None:
    none), else the launcher's choice in ``env`` (``emit.socket_from_env``)."""
    return socket_from_env(env) if socket_path is FROM_ENV else socket_path  # type: ignore[return-value]


def store_address(env: Mapping[str, str]) -> str:
    """The job's own c10d store (torchrun's TCPStore at ``MASTER_ADDR:MASTER_PORT``),
    which node daemons join in cluster mode (docs/cluster.md); ``""`` when unset."""
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if addr and port.isdigit():
        return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
    return ""


def instrument(
    model: nn.Module | Iterable[nn.Module],
    *,
    emitter: Emitter | None = None,
    socket_path: str | None | _Env = FROM_ENV,
    trace_out: str | None = None,
    rank: int | None = None,
    clock: Clock = time.time,
    pending_after_s: float = 1.0,
) -> Instrumentation:
    """Time every all-gather and reduce-scatter FSDP2 issues for ``model``.

    ``model`` is a module or a list of model parts (pipeline stages: each may
    be its own FSDP root). Call after ``fully_shard`` (some module in it must be
    an ``FSDPModule``) and after the process group is up. Without ``emitter``
    one is made from ``socket_path`` and ``trace_out`` (``{rank}`` replaced)
    and is closed by ``Instrumentation.close()``. ``socket_path``: a path, or
    None for no socket; left out, ``$FSDP_SENTINEL_SOCKET`` (``off``: none),
    else ``/run/fsdp-sentinel/ingest.sock``: an argument given wins over the
    variable. Emits the ``rank`` record at once. A collective in flight longer
    than ``pending_after_s`` gets ``pending`` records (see the module docstring).
    """
    import torch.distributed as dist

    up = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if up else int(os.environ.get("RANK", "0"))
    world_size = dist.get_world_size() if up else int(os.environ.get("WORLD_SIZE", "1"))
    owns = emitter is None
    if emitter is None:
        path = trace_out.replace("{rank}", str(rank)) if trace_out else None
        emitter = Emitter(socket_for(socket_path, os.environ), path)
    inst = Instrumentation(
        emitter,
        rank=rank,
        world_size=world_size,
        host=host_name(),
        clock=clock,
        owns_emitter=owns,
        pending_after_s=pending_after_s,
    )
    inst.attach(model)
    inst.announce()
    return inst
