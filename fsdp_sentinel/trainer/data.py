"""Training batches: seeded synthetic tokens with a learnable pattern, or a text file.

Synthetic tokens follow a fixed random permutation (the same on every rank):
each token is ``perm[previous]`` with probability ``1 - noise``, otherwise
uniform. A model that learns the permutation drives the loss from ``ln(vocab)``
towards the noise floor, so a falling loss is a real signal. Each rank draws
its own samples (its generator is seeded with the seed and the rank).
"""

from __future__ import annotations

from pathlib import Path

import torch


class MarkovTokens:
    def __init__(self, vocab: int, seq_len: int, seed: int, rank: int, noise: float = 0.1) -> None:
        self.vocab, self.seq_len, self.noise = vocab, seq_len, noise
        shared = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(vocab, generator=shared)
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    def batch(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, n = self.gen, self.seq_len + 1
        toks = torch.empty(batch, n, dtype=torch.long)
        toks[:, 0] = torch.randint(self.vocab, (batch,), generator=g)
        rand = torch.randint(self.vocab, (batch, n), generator=g)
        keep = torch.rand(batch, n, generator=g) >= self.noise
        for i in range(1, n):
            toks[:, i] = torch.where(keep[:, i], self.perm[toks[:, i - 1]], rand[:, i])
        return toks[:, :-1], toks[:, 1:]


class TextBytes:
    """Random windows of a file's bytes (tokens 0..255)."""

    def __init__(self, path: str, seq_len: int, seed: int, rank: int) -> None:
        data = Path(path).read_bytes()
        if len(data) <= seq_len + 1:
            raise ValueError(f"{path}: {len(data)} bytes, need more than --seq-len + 1")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    def batch(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.seq_len + 1
        starts = torch.randint(len(self.data) - n, (batch,), generator=self.gen)
        toks = torch.stack([self.data[s : s + n] for s in starts.tolist()])
        return toks[:, :-1], toks[:, 1:]


def make_source(
    vocab: int, seq_len: int, seed: int, rank: int, text: str | None = None
) -> MarkovTokens | TextBytes:
    if text:
        return TextBytes(text, seq_len, seed, rank)
    return MarkovTokens(vocab, seq_len, seed, rank)
