"""Ternary (BitNet b1.58) layers and an FSDP2 all-gather of their packed weights.

BitNet b1.58 keeps a full-precision latent weight for the optimizer and, in
every forward, uses its ternary image ``t * s`` with ``t`` in {-1, 0, +1}
(absmean scaling: ``t = clamp(round(w / mean|w|), -1, 1)``); activations are
quantised to 8 bits per token (absmax). Gradients pass both quantisers
unchanged (the straight-through estimator), so the latent weight, its
gradient and the optimizer stay full precision.

The weight in the forward pass needs only 2 bits per value, yet plain FSDP2
all-gathers the latent one at 16 or 32 bits. :class:`TernaryWeight` is a
tensor subclass for the latent weight that implements FSDP2's all-gather
extension points (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, the
ones torchao uses for float8): each rank quantises its own shard, packs four
2-bit codes per byte, and FSDP2 all-gathers those bytes plus the scales; each
rank then unpacks the full ternary weight. The reduce-scatter of gradients is
FSDP2's own, unchanged.

Scale granularity: one absmean scale per output row (dim 0). FSDP2 shards
dim 0, so every row lies whole on one rank: a shard's rows quantise exactly
as the same rows of the full weight do, and the gathered weight equals the
locally quantised full weight bit for bit. A per-tensor scale (the paper's)
would need the mean over all shards first (an extra all-reduce per tensor
before each all-gather), and column groups would cost more scales for no
gain in exactness. The price is one fp32 scale per row: 32 bits per
``in_features`` weights (0.5 bit per weight at width 64, 0.03 at 1024).

Gather modes (``--ternary-gather``): ``packed`` (2 bits + row scales),
``unpacked`` (the same ternary values at full width through the same
extension: the reference the packed path is tested against), ``latent``
(no extension: FSDP2 gathers latent weights and each layer quantises them,
the recipe as published).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from fsdp_sentinel.trainer.config import GATHER_MODES

EPS = 1e-5  # the recipe's clamp: an all-zero row or token keeps a finite scale
CODES_PER_BYTE = 4  # 2-bit codes


# ------------------------------------------------------------------ quantisers
def row_scales(w: torch.Tensor) -> torch.Tensor:
    """``1 / mean|w|`` per row (dim 0), the absmean scale of BitNet b1.58 per output row."""
    flat = w.reshape(w.shape[0], -1)
    return 1.0 / flat.abs().mean(dim=1).clamp(min=EPS)


def ternary_codes(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The ternary values of ``w`` (int8 in {-1, 0, 1}) under per-row ``scales``."""
    flat = w.reshape(w.shape[0], -1)
    return (flat * scales[:, None]).round().clamp(-1, 1).to(torch.int8).reshape(w.shape)


def dequantise(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes / scales`` per row, in ``dtype``: the weight the forward pass uses."""
    flat = codes.reshape(codes.shape[0], -1).to(dtype) / scales.to(dtype)[:, None]
    return flat.reshape(codes.shape)


def quantise_weight(w: torch.Tensor) -> torch.Tensor:
    """The ternary image of a full weight, computed locally (no communication)."""
    s = row_scales(w)
    return dequantise(ternary_codes(w, s), s, w.dtype)


def quantise_activation(x: torch.Tensor) -> torch.Tensor:
    """8-bit absmax quantisation per token (last dim), as BitNet b1.58 does."""
    scale = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=EPS)
    return (x * scale).round().clamp(-128, 127) / scale


class _StraightThrough(torch.autograd.Function):
    """Forward ``q``, backward the identity to ``x``.

    The recipe writes ``x + (q - x).detach()``; in floating point that sum is
    ``q`` only to within rounding. Returning ``q`` itself keeps the forward
    weight bit-equal to the one the packed all-gather delivers.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return q

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def straight_through(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _StraightThrough.apply(x, q.detach())
    return out


# ------------------------------------------------------------------ packing
def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Ternary codes (rows, cols) -> uint8 (rows, ceil(cols / 4)), four 2-bit codes a byte.

    Each row is packed on its own (the last byte zero-padded), so packed rows
    concatenate along dim 0 exactly as FSDP2's all-gather concatenates shards.
    """
    rows = codes.shape[0]
    flat = (codes.reshape(rows, -1) + 1).to(torch.uint8)  # {-1,0,1} -> {0,1,2}
    pad = -flat.shape[1] % CODES_PER_BYTE
    if pad:
        flat = F.pad(flat, (0, pad))
    q = flat.view(rows, -1, CODES_PER_BYTE)
    return q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)


def unpack_codes(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 (rows, ceil(cols / 4)) -> int8 codes (rows, cols); inverse of :func:`pack_codes`."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    q = (packed[..., None] >> shifts) & 3
    return q.reshape(packed.shape[0], -1)[:, :cols].to(torch.int8) - 1


def packed_bytes(rows: int, cols: int) -> int:
    """Bytes one rank sends for a (rows, cols) shard in ``packed`` mode: codes + fp32 scales."""
    return rows * -(-cols // CODES_PER_BYTE) + rows * 4


# ------------------------------------------------------------------ the subclass
# Ops FSDP2 applies to a parameter while sharding it (pad, narrow, view, copy,
# detach for nn.Parameter): their results must stay TernaryWeight, so the
# shard FSDP2 all-gathers still carries the extension. Everything else (the
# optimizer's arithmetic, zeros_like for its state) runs on the plain latent data.
_aten = torch.ops.aten
_KEEP_SUBCLASS = {
    _aten.new_zeros,
    _aten.empty_like,
    _aten.slice,
    _aten.narrow,
    _aten.view,
    _aten.as_strided,
    _aten.copy_,
    _aten.detach,
    _aten.alias,
    _aten.clone,
    _aten._to_copy,
    _aten.split,
    _aten._pin_memory,
}


class TernaryWeight(torch.Tensor):
    """A latent full-precision weight whose FSDP2 all-gather sends its ternary image.

    ``gather_mode`` is ``packed`` or ``unpacked`` (see the module docstring). The
    subclass only changes what crosses the wire; as a tensor it is the latent
    weight, so optimizer updates and gradients are full precision.
    """

    _data: torch.Tensor
    gather_mode: str

    @staticmethod
    def __new__(cls, data: torch.Tensor, mode: str = "packed") -> TernaryWeight:
        t: TernaryWeight = torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=data.requires_grad,
        )
        return t

    def __init__(self, data: torch.Tensor, mode: str = "packed") -> None:
        if mode not in ("packed", "unpacked"):
            raise ValueError(f"TernaryWeight mode must be packed or unpacked, got {mode!r}")
        self._data = data
        self.gather_mode = mode

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]
        return f"TernaryWeight(mode={self.gather_mode}, {self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], str]:
        return ["_data"], self.gather_mode

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], mode: str, outer_size: Any, outer_stride: Any
    ) -> TernaryWeight:
        return TernaryWeight(inner["_data"], mode)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        mode = next(a.gather_mode for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func.overloadpacket not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, mode), out)

    # ---- FSDP2 all-gather extension (signatures of torch 2.13's _fsdp_param.py)
    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: Any,
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Quantise this rank's shard; return what FSDP2 all-gathers (row-major, dim 0 first)."""
        w = self._data
        s = row_scales(w)
        codes = ternary_codes(w, s)
        cols = w[0].numel() if w.shape[0] else int(outer_size.numel() // outer_size[0])
        if self.gather_mode == "packed":
            return (pack_codes(codes), s), (outer_size, cols)
        return (dequantise(codes, s, w.dtype),), (outer_size, cols)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """Rebuild the full ternary weight from the gathered shards (into ``out`` after the first)."""
        outer_size, cols = metadata
        if self.gather_mode == "packed":
            packed, scales = all_gather_outputs
            w = dequantise(unpack_codes(packed, cols), scales, param_dtype).view(outer_size)
        else:
            w = all_gather_outputs[0].to(param_dtype).view(outer_size)
        if out is not None:
            # FSDP2 re-allocated the storage returned below and wants it refilled.
            # Autograd saved this weight in forward; a refill for backward holds
            # the same values, so keep the version counter as FSDP2's copy-out does.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(w)
            return None
        # The weight is the one inner tensor FSDP2 frees after use and reallocates.
        return w, (w,)


# ------------------------------------------------------------------ the layer
class BitLinear(nn.Linear):
    """``nn.Linear`` with BitNet b1.58 quantisation: RMS-normed 8-bit inputs, ternary weights.

    ``gathered_ternary``: the weight arrives already ternary (a
    :class:`TernaryWeight` all-gather) and is used as is; otherwise the layer
    quantises its (latent) weight itself, with the straight-through estimator.
    """

    gathered_ternary: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The recipe normalises inside the layer (no learned gain) before quantising.
        x = F.rms_norm(x, (x.shape[-1],), eps=EPS)
        x = straight_through(x, quantise_activation(x))
        w = self.weight
        if not self.gathered_ternary or isinstance(w, TernaryWeight):
            w = straight_through(w, quantise_weight(w))
        return F.linear(x, w, self.bias)


def shardable(weight: torch.Tensor, shard_world: int) -> bool:
    """Whether FSDP2 shards ``weight`` evenly on dim 0 (what the extension needs:
    on an uneven shard FSDP2 demands inputs of the padded, unpacked size)."""
    return weight.dim() >= 1 and weight.shape[0] % shard_world == 0


def ternarise(model: nn.Module, mode: str, shard_world: int) -> int:
    """Give every evenly shardable :class:`BitLinear` a :class:`TernaryWeight` (before
    ``fully_shard``); returns how many. ``latent`` mode changes nothing."""
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode must be one of {GATHER_MODES}, got {mode!r}")
    if mode == "latent":
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, BitLinear) and shardable(m.weight, shard_world):
            m.weight = nn.Parameter(TernaryWeight(m.weight.data, mode))
            m.gathered_ternary = True
            n += 1
    return n
