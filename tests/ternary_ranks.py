"""Run by torchrun from tests/test_ternary.py: is the packed all-gather exact?

Each rank builds the trainer's ternary model, keeps an unsharded copy of the
latent weights, shards it with a packed TernaryWeight all-gather, and checks
after ``unshard()`` that every gathered weight is bit-equal to the local
quantisation of the full latent weight. Then it trains a few steps, gathers
the (updated) latent shards with a plain all-gather of their data, and checks
again. Prints one JSON line per rank.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from fsdp_sentinel.trainer.data import MarkovTokens
from fsdp_sentinel.trainer.loop import leave
from fsdp_sentinel.trainer.model import GPT, ModelConfig, loss_fn
from fsdp_sentinel.trainer.ternary import TernaryWeight, quantise_weight, ternarise


def full_latent(weight: torch.Tensor) -> torch.Tensor:
    """The whole latent weight, from this rank's shard and everyone else's."""
    local = weight.to_local()._data.contiguous()  # type: ignore[attr-defined]
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts)


def check(model: GPT, mods: list[torch.nn.Module], reference: dict[str, torch.Tensor]) -> int:
    """Count gathered weights that are not bit-equal to the local quantisation."""
    bad = 0
    for block in model.blocks:
        block.unshard()  # type: ignore[operator]
        for name, m in block.named_modules():
            if m in mods:
                key = f"{id(block)}.{name}"
                want = quantise_weight(reference[key])
                bad += not torch.equal(m.weight, want)
        block.reshard()  # type: ignore[operator]
    return bad


def main() -> int:
    mode, dim, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(ModelConfig(layers=2, dim=dim, heads=4, seq_len=16, vocab=64, ternary=True))
    wrapped = ternarise(model, mode, world)
    mods = [m for m in model.modules() if isinstance(getattr(m, "weight", None), TernaryWeight)]
    reference = {
        f"{id(block)}.{name}": m.weight._data.clone()  # type: ignore[union-attr]
        for block in model.blocks
        for name, m in block.named_modules()
        if m in mods
    }
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    before = check(model, mods, reference)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = MarkovTokens(64, 16, seed=0, rank=rank)
    for _ in range(steps):
        x, y = data.batch(4)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    latest = {}
    for block in model.blocks:
        for name, m in block.named_modules():
            if m in mods:
                latest[f"{id(block)}.{name}"] = full_latent(m.weight)
    moved = sum(not torch.equal(latest[k], reference[k]) for k in latest)
    after = check(model, mods, latest)
    locals_ = [m.weight.to_local() for m in mods]  # type: ignore[operator, union-attr]
    still_subclass = sum(isinstance(t, TernaryWeight) for t in locals_)
    out = {
        "rank": rank,
        "wrapped": wrapped,
        "checked": len(mods),
        "bad_before": before,
        "bad_after": after,
        "moved": moved,
        "still_subclass": still_subclass,
    }
    print(json.dumps(out), flush=True)
    # Every rank done before any tears gloo down: a rank destroying its group
    # while a peer still talks to it aborted once ("terminate called without
    # an active exception", a 3-rank run of the full suite).
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())  # with the barrier above it still aborted once at teardown
