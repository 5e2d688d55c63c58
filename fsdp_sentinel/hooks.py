"""Collective timing for any FSDP2 model, through FSDP2's own extension points.

Three lines instrument a model that ``fully_shard`` has wrapped::

    from fsdp_sentinel.hooks import instrument
    inst = instrument(model)            # after fully_shard, after init_process_group
    with inst.step(step_no): ...        # around each optimizer step

:func:`instrument` installs a timed all-gather and a timed reduce-scatter on
every ``FSDPModule`` in the model with ``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter`` (no torch internals are patched). Each wraps
FSDP's default communication, so the collective itself is unchanged, and
emits one trace-v1 ``coll`` record per collective: ``bytes`` the full tensor
(all-gather output, reduce-scatter input), ``issue`` the wall time it was
issued, ``end`` the wall time this rank observed it complete, ``seq`` its
place in this rank's issue order (FSDP issues the same collectives in the same
order on every rank, so ``seq`` matches across ranks). The rank announces
itself with a ``rank`` record; ``inst.step`` emits a ``step`` record.

While a collective is in flight longer than ``pending_after_s`` (default
1 s), a ``pending`` record (``t``, ``rank``, ``step``, ``seq``, ``op``,
``issue``) says so, then again each ``pending_every_s`` while it stays in
flight: a rank blocked in a collective that never completes (its peer hung
or gone) is then visible long before the NCCL/gloo timeout. These records
are made and sent by the emitter's sender thread (a tick it runs before each
drain), never by the training thread, which only files the collective in a
dict at issue and takes it out at completion. A process that is stopped
(SIGSTOP) or dead sends none, which is what names it.

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

import functools
import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsdp_sentinel.emit import DEFAULT_SOCKET, Emitter
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
        self._seq = 0
        self._lock = threading.Lock()
        self._watchers: dict[str, _CudaWatcher] = {}
        self.modules: list[Any] = []
        self.pending_after_s = pending_after_s
        self.pending_every_s = pending_every_s
        self.pendings = 0  # pending records emitted
        # seq -> [its coll record, when its next pending record is due]. The
        # training thread only sets and pops keys (each one operation under
        # the GIL); the sender thread reads a copy (see _report_pending).
        self._inflight: dict[int, list[Any]] = {}
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
        """Emit this rank's ``rank`` record (done once by :func:`instrument`)."""
        self._safe_emit(
            lambda: {
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
        )

    def attach(self, model: nn.Module) -> None:
        """Install the timed all-gather / reduce-scatter on every FSDPModule in ``model``."""
        from torch.distributed.fsdp import FSDPModule

        mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not mods:
            raise ValueError("instrument(): no FSDPModule in the model; call fully_shard first")
        timed_all_gather, timed_reduce_scatter = _timed_comm_classes()
        for mod in mods:
            mod.set_custom_all_gather(timed_all_gather(self))
            mod.set_custom_reduce_scatter(timed_reduce_scatter(self))
        self.modules = mods

    def detach(self) -> None:
        """Put FSDP's default communication back on every instrumented module."""
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )

        for mod in self.modules:
            mod.set_custom_all_gather(DefaultAllGather())
            mod.set_custom_reduce_scatter(DefaultReduceScatter())
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

    def _issue(self, op: str, full: torch.Tensor, group: Any) -> dict[str, Any] | None:
        """The record of a collective about to be issued (None if that failed)."""
        try:
            with self._lock:
                seq = self._seq
                self._seq += 1
            rec = {
                "kind": "coll",
                "rank": self.rank,
                "step": self.current_step,
                "seq": seq,
                "op": op,
                "bytes": full.numel() * full.element_size(),
                "group_size": group.size(),
                "issue": self.clock(),
                "end": None,
            }
            self._inflight[seq] = [rec, rec["issue"] + self.pending_after_s]
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
            self._inflight.pop(rec["seq"], None)
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
        for entry in list(self._inflight.values()):
            rec, due = entry
            if now < due:
                continue
            entry[1] = now + self.pending_every_s
            self.pendings += 1
            self._safe_emit(functools.partial(self._pending_record, rec, now))

    def _pending_record(self, rec: dict[str, Any], now: float) -> dict[str, Any]:
        return {
            "kind": "pending",
            "t": now,
            "rank": self.rank,
            "step": rec["step"],
            "seq": rec["seq"],
            "op": rec["op"],
            "issue": rec["issue"],
        }


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


@functools.cache
def _timed_comm_classes() -> tuple[type, type]:
    """Timed all-gather / reduce-scatter classes wrapping FSDP's defaults (built once)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    class TimedComm:
        """What both timed comms share: the hooks' state and FSDP's default allocator."""

        def __init__(self, inst: Instrumentation, inner: Any) -> None:
            self.inst = inst
            self.inner = inner

        def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
            return self.inner.allocate(size, dtype=dtype, device=device)

    class TimedAllGather(TimedComm, AllGather):
        def __init__(self, inst: Instrumentation) -> None:
            super().__init__(inst, DefaultAllGather())

        def __call__(
            self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False
        ) -> Any:
            rec = self.inst._issue("all_gather", output_tensor, group)
            work = self.inner(output_tensor, input_tensor, group, async_op)
            self.inst._issued(rec, work, output_tensor)
            return work

    class TimedReduceScatter(TimedComm, ReduceScatter):
        def __init__(self, inst: Instrumentation) -> None:
            super().__init__(inst, DefaultReduceScatter())

        def __call__(
            self,
            output_tensor: Any,
            input_tensor: Any,
            group: Any,
            op: Any,
            async_op: bool = False,
        ) -> Any:
            rec = self.inst._issue("reduce_scatter", input_tensor, group)
            work = self.inner(output_tensor, input_tensor, group, op, async_op)
            self.inst._issued(rec, work, input_tensor)
            return work

    return TimedAllGather, TimedReduceScatter


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


def store_address(env: Mapping[str, str]) -> str:
    """The job's own c10d store (torchrun's TCPStore at ``MASTER_ADDR:MASTER_PORT``),
    which node daemons join in cluster mode (docs/cluster.md); ``""`` when unset."""
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if addr and port.isdigit():
        return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
    return ""


def instrument(
    model: nn.Module,
    *,
    emitter: Emitter | None = None,
    socket_path: str | None = DEFAULT_SOCKET,
    trace_out: str | None = None,
    rank: int | None = None,
    clock: Clock = time.time,
    pending_after_s: float = 1.0,
) -> Instrumentation:
    """Time every all-gather and reduce-scatter FSDP2 issues for ``model``.

    Call after ``fully_shard`` (the model, or any module in it, must be an
    ``FSDPModule``) and after the process group is up. Without ``emitter`` one
    is made from ``socket_path`` and ``trace_out`` (``{rank}`` replaced) and is
    closed by ``Instrumentation.close()``. Emits the ``rank`` record at once.
    A collective in flight longer than ``pending_after_s`` gets ``pending``
    records (see the module docstring).
    """
    import torch.distributed as dist

    up = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if up else int(os.environ.get("RANK", "0"))
    world_size = dist.get_world_size() if up else int(os.environ.get("WORLD_SIZE", "1"))
    owns = emitter is None
    if emitter is None:
        path = trace_out.replace("{rank}", str(rank)) if trace_out else None
        emitter = Emitter(socket_path, path)
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
