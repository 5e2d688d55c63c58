"""The train loop: process group, sharded model, instrumented steps, a final line.

Read top to bottom: :func:`train` is the whole run. gloo on CPU, NCCL when
CUDA is present; with ``--replicate N`` the mesh is 2-D (replicate x shard),
which makes ``fully_shard`` HSDP.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from fsdp_sentinel.trainer.config import TrainConfig, build_parser, parse_args

#: Rank 0's line at the end of a step (``--log-every``); the demo follows the
#: job's own pace from it (``demo.run.TrainerSteps``), so keep the two together.
STEP_LINE = re.compile(rb"^step (\d+) loss ")


def step_line(step: int, loss: float) -> str:
    return f"step {step} loss {loss:.4f}"


@dataclass
class Cluster:
    rank: int
    world_size: int
    local_world_size: int
    device: Any  # torch.device
    mesh: Any  # DeviceMesh


def setup_cluster(cfg: TrainConfig) -> Cluster:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    if world % cfg.replicate:
        dist.destroy_process_group()
        build_parser().error(f"--replicate {cfg.replicate} does not divide world size {world}")
    shape = (world,) if cfg.replicate == 1 else (cfg.replicate, world // cfg.replicate)
    names = ("shard",) if cfg.replicate == 1 else ("replicate", "shard")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return Cluster(dist.get_rank(), world, local_world, device, mesh)


def set_threads(cfg: TrainConfig, cluster: Cluster) -> None:
    import torch

    # Ranks on one machine share its cores; oversubscribing them makes every
    # step slower and noisier than the collectives we are here to time.
    n = cfg.threads or max(1, (os.cpu_count() or 1) // max(1, cluster.local_world_size))
    torch.set_num_threads(n)
    # Interop threads can be set once per process; a second call raises.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


def build_model(cfg: TrainConfig, cluster: Cluster) -> Any:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_sentinel.trainer.model import GPT, ModelConfig
    from fsdp_sentinel.trainer.ternary import ternarise

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    mcfg = ModelConfig(cfg.layers, cfg.dim, cfg.heads, cfg.seq_len, cfg.vocab, cfg.ternary)
    model = GPT(mcfg)
    model.to(cluster.device)
    if cfg.ternary:
        # Before fully_shard: FSDP2 finds the all-gather extension on the shards.
        ternarise(model, cfg.ternary_gather, cluster.mesh.size(-1))
    # bf16 narrows the all-gather and compute only: gradients still reduce in
    # fp32. fp32 keeps FSDP2's default policy (and its default code path).
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.param_dtype == "bf16"
        else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        fully_shard(block, mesh=cluster.mesh, mp_policy=mp)
    fully_shard(model, mesh=cluster.mesh, mp_policy=mp)
    return model


class _PlainStep:
    """Stands in for ``inst.step(n)`` when training without hooks."""

    loss: float | None = None

    def __enter__(self) -> _PlainStep:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def train(cfg: TrainConfig) -> int:
    import torch
    import torch.distributed as dist

    from fsdp_sentinel.hooks import instrument
    from fsdp_sentinel.trainer.data import make_source
    from fsdp_sentinel.trainer.model import loss_fn

    cluster = setup_cluster(cfg)
    set_threads(cfg, cluster)
    rank = cluster.rank
    model = build_model(cfg, cluster)
    inst = instrument(model, socket_path=cfg.socket, trace_out=cfg.trace_out) if cfg.hooks else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    data = make_source(cfg.vocab, cfg.seq_len, cfg.seed, rank, cfg.text)
    ckpt, first = resume(cfg, model, opt, data, rank)

    step_times: list[float] = []
    loss_value = float("nan")
    eval_loss: float | None = None
    try:
        for step in range(first, cfg.steps):
            x, y = (t.to(cluster.device) for t in data.batch(cfg.batch))
            t0 = time.perf_counter()
            with inst.step(step) if inst else _PlainStep() as span:
                loss = loss_fn(model(x), y)
                if cfg.delayed(rank, step):
                    if inst and step == cfg.delay_start:
                        inst.emitter.emit(_stall_fault(cfg, inst.host, rank))
                    time.sleep(cfg.delay_seconds)  # a deliberate compute stall
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss_value = loss.item()
                span.loss = loss_value
                if cfg.step_sleep > 0:
                    # The same sleep on every rank, not "the rest of S": a deadline
                    # from each rank's own step start would keep a rank that
                    # started late arriving last at every later step (a straggler).
                    time.sleep(cfg.step_sleep)
            step_times.append(time.perf_counter() - t0)
            if (
                rank == 0
                and cfg.log_every > 0
                and (step % cfg.log_every == 0 or step == cfg.steps - 1)
            ):
                print(step_line(step, loss_value), flush=True)
            if ckpt and ckpt.due(step + 1) and step + 1 < cfg.steps:
                ckpt.save(step + 1)
        if ckpt:
            ckpt.close()  # a clean exit leaves no half-written checkpoint
        eval_loss = evaluate(cfg, model, data, inst, cluster.device) if cfg.eval_steps else None
        # Every rank done before any tears gloo down: a rank destroying its
        # group while a peer's last collective still talks to it aborts the
        # peer ("terminate called without an active exception": CI, session
        # 29, test_no_hooks_trains_without_records; tests/ternary_ranks.py
        # met it first). Only on the way out of a clean run: a failed one
        # must not wait on its peers.
        dist.barrier()
    finally:
        if inst:
            inst.close()
        dist.destroy_process_group()

    # Median over the steps after the first (which pays for lazy init).
    median = statistics.median(step_times[1:] or step_times or [0.0])
    sent, dropped, errors = (inst.sent, inst.dropped, inst.errors) if inst else (0, 0, 0)
    print(
        f"done rank={rank} steps={cfg.steps} loss={loss_value:.4f} step_s={median:.5f} "
        f"sent={sent} dropped={dropped} hook_errors={errors}"
        + (f" eval_loss={eval_loss:.4f}" if eval_loss is not None else ""),
        flush=True,
    )
    return 0


def resume(cfg: TrainConfig, model: Any, opt: Any, data: Any, rank: int) -> tuple[Any, int]:
    """The checkpointer (None without ``--checkpoint-dir``) and the first step to run:
    after the newest whole checkpoint, with the data stream moved on to it."""
    if not cfg.checkpoint_dir:
        return None, 0
    from fsdp_sentinel.trainer.checkpoint import Checkpointer

    ckpt = Checkpointer(cfg.checkpoint_dir, cfg.checkpoint_every, model, opt, rank)
    got = ckpt.resume()
    for _ in range(got.step):
        data.batch(cfg.batch)  # the batches those steps drew, drawn again and dropped
    if rank == 0 and got.path is not None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(
            f"resumed step={got.step} from={got.path} load_s={got.load_s:.3f} attempt={attempt}",
            flush=True,
        )
    return ckpt, got.step


def evaluate(cfg: TrainConfig, model: Any, data: Any, inst: Any, device: Any) -> float:
    """``cfg.eval_steps`` forward passes without gradients, after ``cfg.eval_gap`` idle
    seconds; the mean loss. FSDP2 all-gathers for them and never reduce-scatters,
    which lets a measurement see all-gather traffic alone."""
    import torch

    from fsdp_sentinel.trainer.model import loss_fn

    time.sleep(cfg.eval_gap)
    total = 0.0
    with torch.no_grad():
        for i in range(cfg.eval_steps):
            x, y = (t.to(device) for t in data.batch(cfg.batch))
            with inst.step(cfg.steps + i) if inst else _PlainStep() as span:
                span.loss = loss_fn(model(x), y).item()
            total += span.loss
    return total / cfg.eval_steps


def _stall_fault(cfg: TrainConfig, host: str, rank: int) -> dict[str, Any]:
    """The ground truth of a ``--delay-*`` stall, as a trace-v1 ``fault`` record."""
    return {
        "kind": "fault",
        "t": time.time(),
        "host": host,
        "rank": rank,
        "what": "compute_stall",
        "params": {"seconds": cfg.delay_seconds},
        "step": cfg.delay_start,
        "end_step": cfg.delay_stop,
    }


def leave(code: int) -> NoReturn:
    """Exit with ``code`` without the interpreter's teardown, once a rank's
    group is destroyed and its hooks closed: tearing down torch's C++ statics
    while a gloo thread still runs aborted ranks that had finished cleanly
    now and then ("terminate called without an active exception": CI,
    sessions 29-30, even after a barrier before the teardown)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        return train(cfg)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
