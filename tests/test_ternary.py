"""Ternary (BitNet b1.58) layers and the packed FSDP2 all-gather.

Pure tests pin the quantisers and the 2-bit packing; torch tests run real
FSDP2 over gloo with 2 (and 3) ranks: the gathered weight equals the local
quantisation bit for bit, packed training matches unpacked and latent
training step for step, the loss falls, and the hooks' ``coll`` bytes are
the packed bytes an independent count of the model's shapes predicts.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from test_hooks_fsdp import json_objects  # ranks' lines can share a line

from fsdp_sentinel.trace import read_trace
from fsdp_sentinel.trainer.config import parse_args
from fsdp_sentinel.trainer.launch import local_env, torchrun_argv
from fsdp_sentinel.trainer.model import GPT, ModelConfig
from fsdp_sentinel.trainer.ternary import (
    BitLinear,
    TernaryWeight,
    pack_codes,
    packed_bytes,
    quantise_activation,
    quantise_weight,
    row_scales,
    ternarise,
    ternary_codes,
    unpack_codes,
)

RANKS_SCRIPT = Path(__file__).with_name("ternary_ranks.py")


# ------------------------------------------------------------------ pure
@pytest.mark.parametrize("cols", [1, 3, 4, 5, 64, 67])
def test_pack_round_trips_and_uses_two_bits(cols: int) -> None:
    g = torch.Generator().manual_seed(cols)
    codes = torch.randint(-1, 2, (6, cols), generator=g, dtype=torch.int8)
    packed = pack_codes(codes)
    assert packed.dtype == torch.uint8
    assert packed.shape == (6, math.ceil(cols / 4))
    assert torch.equal(unpack_codes(packed, cols), codes)


def test_packed_rows_concatenate_like_shards() -> None:
    """What FSDP2's all-gather does to packed shards (cat on dim 0) unpacks to the whole."""
    codes = torch.randint(-1, 2, (8, 10), dtype=torch.int8)
    gathered = torch.cat([pack_codes(codes[:4]), pack_codes(codes[4:])])
    assert torch.equal(unpack_codes(gathered, 10), codes)


def test_weight_quantiser_is_absmean_ternary() -> None:
    w = torch.tensor([[0.2, -0.9, 0.05, 0.5], [0.0, 0.0, 0.0, 0.0]])
    q = quantise_weight(w)
    mean0 = w[0].abs().mean()
    assert torch.allclose(q[0], torch.tensor([0.0, -1.0, 0.0, 1.0]) * mean0)
    assert torch.equal(q[1], torch.zeros(4))  # an all-zero row stays zero, finite
    assert set(ternary_codes(w, row_scales(w)).unique().tolist()) <= {-1, 0, 1}


def test_activation_quantiser_has_255_levels_per_token() -> None:
    x = torch.randn(3, 1000)
    q = quantise_activation(x)
    for row, qrow in zip(x, q, strict=True):
        step = row.abs().max() / 127
        levels = torch.round(qrow / step)
        assert torch.allclose(levels * step, qrow, atol=1e-6)
        assert levels.abs().max() == 127
    assert len(torch.unique(q[0])) <= 255


def test_row_scales_are_shard_exact_and_a_tensor_scale_is_not() -> None:
    """Why per-row: a shard of rows quantises exactly as those rows of the whole do."""
    w = torch.randn(8, 16) * torch.linspace(0.1, 3, 8)[:, None]
    whole = quantise_weight(w)
    assert torch.equal(torch.cat([quantise_weight(w[:4]), quantise_weight(w[4:])]), whole)

    def tensor_scale(t: torch.Tensor) -> torch.Tensor:
        m = t.abs().mean()
        return (t / m).round().clamp(-1, 1) * m

    split = torch.cat([tensor_scale(w[:4]), tensor_scale(w[4:])])
    assert not torch.equal(split, tensor_scale(w))


def test_straight_through_gradient_reaches_the_latent_weight() -> None:
    torch.manual_seed(0)
    layer = BitLinear(8, 4)
    x = torch.randn(2, 8)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    # STE: the gradient is the one of a plain linear layer evaluated at the
    # quantised weight and input, passed to the latent weight unchanged.
    xn = torch.nn.functional.rms_norm(x, (8,), eps=1e-5)
    xq = quantise_activation(xn)
    assert torch.allclose(layer.weight.grad, torch.ones(2, 4).T @ xq)


def test_subclass_survives_what_fsdp_does_to_a_shard() -> None:
    tw = TernaryWeight(torch.randn(8, 4), "packed")
    padded = tw.new_zeros((4, 4))
    padded.narrow(0, 0, 4).copy_(tw[:4])
    for t in (padded, padded.view(-1), padded.narrow(0, 0, 2), torch.nn.Parameter(tw)):
        assert isinstance(t, TernaryWeight)
    assert isinstance(padded, TernaryWeight)
    assert torch.equal(padded._data, tw._data[:4])
    assert type(tw * 2) is torch.Tensor  # arithmetic runs on the latent data


def test_an_unsharded_ternary_weight_still_quantises_in_the_layer() -> None:
    """Without FSDP2 no all-gather quantises the weight, so the layer must."""
    torch.manual_seed(1)
    plain = BitLinear(16, 8)
    wrapped = BitLinear(16, 8)
    wrapped.load_state_dict(plain.state_dict())
    model = torch.nn.Sequential(wrapped)
    assert ternarise(model, "packed", 1) == 1 and isinstance(wrapped.weight, TernaryWeight)
    x = torch.randn(3, 16)
    assert torch.equal(wrapped(x), plain(x))


def test_ternarise_skips_uneven_shards_and_rejects_unknown_modes() -> None:
    model = GPT(ModelConfig(layers=1, dim=64, heads=4, seq_len=8, vocab=32, ternary=True))
    assert ternarise(model, "latent", 2) == 0
    assert ternarise(model, "packed", 3) == 1  # only qkv (192 rows) splits 3 ways
    with pytest.raises(ValueError, match="gather mode"):
        ternarise(model, "int4", 2)


@pytest.mark.parametrize(
    "flags",
    [
        ["--ternary", "--param-dtype", "bf16"],
        ["--ternary-gather", "zip"],
        ["--param-dtype", "x"],
        ["--eval-steps", "-1"],
    ],
)
def test_bad_ternary_flags_exit_2(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(flags)
    assert e.value.code == 2


# ------------------------------------------------------------------ real FSDP2
def run(argv: list[str], timeout: float = 280) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, env=local_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.torch
@pytest.mark.parametrize("world", [2, 3])
def test_gathered_weights_equal_local_quantisation(world: int) -> None:
    proc = run(torchrun_argv(world, target=[str(RANKS_SCRIPT)], args=["packed", "64", "5"]))
    outs = json_objects(proc.stdout)
    assert sorted(o["rank"] for o in outs) == list(range(world))
    for o in outs:
        # 2 blocks x 4 layers at world 2; only the 192-row qkv splits 3 ways.
        assert o["wrapped"] == o["checked"] == (8 if world == 2 else 2)
        assert o["bad_before"] == 0 and o["bad_after"] == 0
        assert o["moved"] == o["checked"]  # training changed every latent weight
        assert o["still_subclass"] == o["checked"]  # the optimizer kept the subclass


STEPS = 15
TRAIN_ARGS = ["--layers=2", "--dim=64", f"--steps={STEPS}", "--seed=3", "--socket=off"]


def trainer_run(tmp_path: Path, name: str, world: int, *flags: str) -> dict[int, list[Any]]:
    out = tmp_path / name
    run(torchrun_argv(world, args=[*TRAIN_ARGS, f"--trace-out={out}.r{{rank}}.jsonl", *flags]))
    return {
        rank: [r for r in read_trace(Path(f"{out}.r{rank}.jsonl")) if r["kind"] != "header"]
        for rank in range(world)
    }


def losses(trace: dict[int, list[Any]]) -> dict[int, list[float]]:
    """Training losses per rank (steps after STEPS are the eval passes)."""
    return {
        r: [x["loss"] for x in recs if x["kind"] == "step" and x["step"] < STEPS]
        for r, recs in trace.items()
    }


def gather_bytes(recs: list[Any], step: int) -> list[int]:
    return [r["bytes"] for r in recs if r["kind"] == "coll" and r["op"] == "all_gather"
            and r["step"] == step]  # fmt: skip


@pytest.fixture(scope="module")
def three_modes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, list[Any]]]:
    tmp = tmp_path_factory.mktemp("ternary")
    return {
        mode: trainer_run(tmp, mode, 2, "--ternary", f"--ternary-gather={mode}", "--eval-steps=2")
        for mode in ("packed", "unpacked", "latent")
    }


@pytest.mark.torch
def test_packed_training_matches_unpacked_and_latent_step_for_step(
    three_modes: dict[str, dict[int, list[Any]]],
) -> None:
    packed = losses(three_modes["packed"])
    for other in ("unpacked", "latent"):
        ref = losses(three_modes[other])
        for rank in (0, 1):
            assert len(packed[rank]) == len(ref[rank]) == STEPS
            assert packed[rank] == pytest.approx(ref[rank], rel=1e-5, abs=1e-6), other


@pytest.mark.torch
def test_ternary_loss_falls(three_modes: dict[str, dict[int, list[Any]]]) -> None:
    for rank, ls in losses(three_modes["packed"]).items():
        assert ls[0] == pytest.approx(math.log(256), rel=0.1)  # starts near ln(vocab)
        assert sum(ls[-3:]) / 3 < 0.85 * ls[0], (rank, ls)


def expected_gather_bytes(world: int, mode: str) -> list[int]:
    """Each block's all-gather size from the model's shapes alone (independent of the hooks)."""
    model = GPT(ModelConfig(layers=2, dim=64, heads=4, seq_len=64, vocab=256, ternary=True))
    sizes = []
    for block in model.blocks:
        total = 0
        for m in block.modules():
            for name, p in m.named_parameters(recurse=False):
                rows = p.shape[0] // world
                if mode == "packed" and isinstance(m, BitLinear) and name == "weight":
                    total += packed_bytes(rows, p[0].numel())
                else:
                    total += p.numel() // world * 4
        sizes.append(total * world)
    return sizes


@pytest.mark.torch
def test_hooks_count_the_packed_bytes_and_reduce_scatter_is_unchanged(
    three_modes: dict[str, dict[int, list[Any]]],
) -> None:
    root = sum(p.numel() for n, p in GPT(ModelConfig(2, 64, 4, 64, 256)).named_parameters()
               if not n.startswith("blocks.")) * 4  # fmt: skip
    for mode, want in (("packed", "packed"), ("unpacked", "latent"), ("latent", "latent")):
        block = expected_gather_bytes(2, want)
        for recs in three_modes[mode].values():
            # Every step: the root (fp32 embeddings, head, norm) once, then each
            # block in forward and again in backward (reshard after forward).
            for step in (1, STEPS - 1):
                assert sorted(gather_bytes(recs, step)) == sorted([root, *block, *block]), mode
    packed_block, fp32_block = (
        expected_gather_bytes(2, "packed")[0],
        expected_gather_bytes(2, "x")[0],
    )
    assert 10 < fp32_block / packed_block < 16  # 2 bits + scales + fp32 biases/norms at dim 64

    def scatter(trace: dict[int, list[Any]]) -> list[int]:
        return [r["bytes"] for r in trace[0] if r["kind"] == "coll" and r["op"] == "reduce_scatter"]

    assert scatter(three_modes["packed"]) == scatter(three_modes["latent"])
    assert scatter(three_modes["packed"])  # and there were some


@pytest.mark.torch
def test_eval_passes_all_gather_and_never_reduce_scatter(
    three_modes: dict[str, dict[int, list[Any]]],
) -> None:
    for recs in three_modes["packed"].values():
        evals = [r for r in recs if r["kind"] == "step" and r["step"] >= STEPS]
        assert [r["step"] for r in evals] == [STEPS, STEPS + 1]
        assert all(math.isfinite(r["loss"]) for r in evals)
        ops = {r["op"] for r in recs if r["kind"] == "coll" and r["step"] >= STEPS}
        assert ops == {"all_gather"}


@pytest.mark.torch
def test_packed_all_gather_under_hsdp_matches_latent(tmp_path: Path) -> None:
    """HSDP (2 replicas x 2 shards): the extension gathers over the shard group only."""
    runs = {
        mode: losses(
            trainer_run(tmp_path, mode, 4, "--ternary", f"--ternary-gather={mode}", "--replicate=2")
        )  # fmt: skip
        for mode in ("packed", "latent")
    }
    for rank in range(4):
        assert len(runs["packed"][rank]) == STEPS
        assert runs["packed"][rank] == pytest.approx(runs["latent"][rank], rel=1e-5, abs=1e-6)
