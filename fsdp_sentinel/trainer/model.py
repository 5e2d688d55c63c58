"""A small GPT-style decoder: token + position embeddings, pre-norm blocks, a head.

Each :class:`Block` is one unit for ``fully_shard``; the embeddings, final norm
and head stay with the root. The head is not tied to the embedding, so every
parameter belongs to exactly one FSDP unit. With ``ternary`` the blocks' linear
layers are :class:`~fsdp_sentinel.trainer.ternary.BitLinear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_sentinel.trainer.ternary import BitLinear


@dataclass(frozen=True)
class ModelConfig:
    layers: int
    dim: int
    heads: int
    seq_len: int
    vocab: int
    ternary: bool = False  # BitLinear (BitNet b1.58) for every linear layer in the blocks


def _linear(cfg: ModelConfig) -> type[nn.Linear]:
    # BitNet keeps the embeddings and the head full precision; only the
    # blocks' projections are ternary.
    return BitLinear if cfg.ternary else nn.Linear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        linear = _linear(cfg)
        self.qkv = linear(cfg.dim, 3 * cfg.dim)
        self.proj = linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        linear = _linear(cfg)
        self.mlp = nn.Sequential(
            linear(cfg.dim, 4 * cfg.dim), nn.GELU(), linear(4 * cfg.dim, cfg.dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
