"""Asynchronous distributed checkpoints of the trainer, and resuming from the last whole one.

``--checkpoint-dir D --checkpoint-every N`` saves the FSDP2 model and the
optimizer after every N-th step with ``torch.distributed.checkpoint.async_save``
into ``D/step-<S>/`` (``S``: the next step to run). Each rank writes only its
own shards; the state dicts come from ``get_state_dict`` (DTensor shards, the
optimizer keyed by parameter name) and go back with ``set_state_dict``, so a
checkpoint loads into the same world whatever the mesh was.

Why the pieces are the way they are:

- **A gloo group of its own.** ``async_save`` copies the shards to CPU
  memory on the training thread, then plans and writes on a background
  thread, whose gather, scatter and final barrier are collectives. On the
  default group they would interleave with FSDP2's all-gathers and
  reduce-scatters issued by the training thread at the same time, and the
  ranks would disagree about which collective is which. A separate group
  keeps the two streams apart (DCP's own recipe does the same).
- **Whole means ``.metadata``.** DCP's coordinator writes ``.metadata`` only
  after every rank has written its files, so a folder without it (a rank
  killed mid-save) is never resumed from, and never deleted before a newer
  whole one exists.
- **One save in flight.** The next save waits for the previous one (a rank
  that falls that far behind would otherwise stage copy after copy in RAM).
- **The data picks up where it left off.** The sources are seeded streams;
  resuming at step S draws and drops S batches, so step S trains on the
  batch it trained on the first time and the loss curve continues.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: ``step-<S>``: the checkpoint taken before step S (S steps done).
_NAME = re.compile(r"^step-(\d+)$")

#: Whole checkpoints kept: the newest and the one before it (the newest may
#: turn out unreadable, and a half-written one never counts).
KEEP = 2


def folder(root: str | Path, step: int) -> Path:
    return Path(root, f"step-{step}")


def whole(root: str | Path) -> list[tuple[int, Path]]:
    """``(S, folder)`` of every whole checkpoint under ``root``, oldest first."""
    out: list[tuple[int, Path]] = []
    base = Path(root)
    if not base.is_dir():
        return out
    for p in base.iterdir():
        m = _NAME.match(p.name)
        if m and (p / ".metadata").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest(root: str | Path) -> tuple[int, Path] | None:
    """The newest whole checkpoint, or None."""
    found = whole(root)
    return found[-1] if found else None


@dataclass
class Resumed:
    """What :meth:`Checkpointer.resume` found: the step to run next, and how long loading took."""

    step: int
    path: Path | None
    load_s: float


class Checkpointer:
    """Saves every ``every`` steps and loads the newest whole checkpoint; one per rank.

    Made after the model and optimizer, on every rank (the group it makes is
    a collective call)."""

    def __init__(self, root: str, every: int, model: Any, optimizer: Any, rank: int) -> None:
        import torch.distributed as dist

        self.root = Path(root)
        self.every = every
        self.model = model
        self.optimizer = optimizer
        self.rank = rank
        self.group = dist.new_group(backend="gloo")
        self._inflight: Any = None  # the Future of the save being written
        self._inflight_step = -1
        self.saved = 0
        self.stage_s: list[float] = []  # training-thread time per save (copy to CPU)
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ load

    def resume(self) -> Resumed:
        """Load the newest whole checkpoint into the model and optimizer (every rank
        the same one); step 0 when there is none."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        # Rank 0 chooses, so a save finishing between two ranks' listings
        # cannot have them load different steps.
        found = latest(self.root) if self.rank == 0 else None
        choice: list[Any] = [None if found is None else (found[0], str(found[1]))]
        dist.broadcast_object_list(choice, src=0, group=self.group)
        if choice[0] is None:
            return Resumed(0, None, 0.0)
        step, path = int(choice[0][0]), Path(choice[0][1])
        t0 = time.perf_counter()
        msd, osd = get_state_dict(self.model, self.optimizer)
        # DCP loads in place: into the tensors of these very state dicts.
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path), process_group=self.group)
        set_state_dict(self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd)
        return Resumed(step, path, time.perf_counter() - t0)

    # ------------------------------------------------------------ save

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0

    def save(self, steps_done: int) -> None:
        """Start saving the state after ``steps_done`` steps; returns once the
        shards are copied to CPU memory (the write goes on in the background)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(self.model, self.optimizer)
        self._inflight = dcp.async_save(
            {"model": msd, "optim": osd},
            checkpoint_id=str(folder(self.root, steps_done)),
            process_group=self.group,
        )
        self._inflight_step = steps_done
        self.stage_s.append(time.perf_counter() - t0)

    def wait(self) -> None:
        """Until the save in flight is whole; then older checkpoints are pruned."""
        fut, self._inflight = self._inflight, None
        if fut is None:
            return
        fut.result()
        self.saved += 1
        if self.rank == 0:
            self._prune()

    def _prune(self) -> None:
        # Only whole ones older than the newest KEEP, and half-written ones
        # older than the newest whole one (a save killed mid-write).
        found = whole(self.root)
        keep = {p for _, p in found[-KEEP:]}
        newest = found[-1][0] if found else -1
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m and p not in keep and int(m.group(1)) < newest:
                shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        """Finish the save in flight (a clean exit leaves no half checkpoint)."""
        self.wait()
