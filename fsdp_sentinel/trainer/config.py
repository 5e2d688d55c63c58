"""The trainer's flags, parsed into one frozen :class:`TrainConfig`.

No torch import here, so bad flags fail (exit 2, with a usage line) before
torch loads.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from fsdp_sentinel.emit import DEFAULT_SOCKET, SOCKET_ENV, socket_from_env

EPILOG = """\
examples:
  torchrun --nproc-per-node 2 -m fsdp_sentinel.trainer --steps 30
  torchrun --nproc-per-node 4 -m fsdp_sentinel.trainer --replicate 2 \\
      --trace-out /tmp/run/rank{rank}.jsonl
  torchrun --nproc-per-node 2 -m fsdp_sentinel.trainer --steps 40 \\
      --delay-rank 1 --delay-seconds 0.2 --delay-steps 10:20
  torchrun --nproc-per-node 2 -m fsdp_sentinel.trainer --ternary --dim 256
  torchrun --nproc-per-node 4 --max-restarts 3 -m fsdp_sentinel.trainer --steps 200 \\
      --checkpoint-dir /tmp/ckpt --checkpoint-every 10
"""

# What FSDP2 all-gathers for --ternary layers (fsdp_sentinel.trainer.ternary).
GATHER_MODES = ("packed", "unpacked", "latent")
PARAM_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class TrainConfig:
    layers: int = 2
    dim: int = 64
    heads: int = 4
    seq_len: int = 64
    vocab: int = 256
    batch: int = 8
    steps: int = 20
    step_sleep: float = 0.0  # pace: every rank sleeps this long at each step's end
    seed: int = 0
    lr: float = 3e-3
    text: str | None = None
    replicate: int = 1
    param_dtype: str = "fp32"  # bf16: MixedPrecisionPolicy(param_dtype=bf16) all-gathers
    ternary: bool = False  # BitLinear layers in the blocks (BitNet b1.58)
    ternary_gather: str = "packed"  # what FSDP2 all-gathers for them (GATHER_MODES)
    socket: str | None = DEFAULT_SOCKET
    trace_out: str | None = None
    hooks: bool = True
    threads: int = 0  # 0: cores / local ranks
    log_every: int = 10
    eval_steps: int = 0  # forward-only passes after training (all-gathers, no reduce-scatter)
    eval_gap: float = 0.0  # idle seconds before them, so interval-based probes see them apart
    delay_rank: int | None = None
    delay_seconds: float = 0.0
    delay_start: int = 0
    delay_stop: int | None = None  # exclusive; None: to the end
    checkpoint_dir: str | None = None  # async DCP checkpoints here; resume from the newest
    checkpoint_every: int = 0  # save after every N-th step (0: only resume, never save)

    def delayed(self, rank: int, step: int) -> bool:
        """Whether ``rank`` stalls in ``step`` (steps delay_start .. delay_stop-1)."""
        return (
            self.delay_rank == rank
            and self.delay_seconds > 0
            and step >= self.delay_start
            and (self.delay_stop is None or step < self.delay_stop)
        )


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _nonneg_float(text: str) -> float:
    v = float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def _step_range(text: str) -> tuple[int, int | None]:
    a, sep, b = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected A:B (or A:), got {text!r}")
    try:
        start = int(a) if a else 0
        stop = int(b) if b else None
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected A:B integers, got {text!r}") from e
    if start < 0 or (stop is not None and stop <= start):
        raise argparse.ArgumentTypeError(f"need 0 <= A < B, got {text!r}")
    return start, stop


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fsdp_sentinel.trainer",
        description="Small GPT-style decoder trained with FSDP2 (launch with torchrun).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=_positive, default=2, help="decoder blocks (default 2)")
    m.add_argument("--dim", type=_positive, default=64, help="model width (default 64)")
    m.add_argument("--heads", type=_positive, default=4, help="attention heads (default 4)")
    m.add_argument("--seq-len", type=_positive, default=64, help="tokens per sample (default 64)")
    m.add_argument("--vocab", type=_positive, default=256, help="vocabulary size (default 256)")
    t = p.add_argument_group("training")
    t.add_argument("--batch", type=_positive, default=8, help="samples per rank per step")
    t.add_argument("--steps", type=_positive, default=20, help="optimizer steps (default 20)")
    t.add_argument(
        "--step-sleep",
        type=_nonneg_float,
        default=0.0,
        metavar="S",
        help="pace the job: every rank sleeps S seconds at the end of each step, so a test "
        "knows how long the job lives whatever the CPU (default 0: no pacing)",
    )
    t.add_argument("--seed", type=int, default=0, help="seed for weights and data")
    t.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    t.add_argument(
        "--text", metavar="FILE", help="train on this file's bytes (needs --vocab >= 256)"
    )
    t.add_argument(
        "--replicate",
        type=_positive,
        default=1,
        metavar="N",
        help="HSDP: N replica groups on a 2-D mesh (N must divide the world size)",
    )
    t.add_argument(
        "--param-dtype",
        choices=PARAM_DTYPES,
        default="fp32",
        help="dtype FSDP2 all-gathers and computes in (bf16: MixedPrecisionPolicy; "
        "gradients reduce in fp32)",
    )
    t.add_argument(
        "--ternary",
        action="store_true",
        help="BitNet b1.58 layers: ternary weights, 8-bit activations, fp32 latent weights",
    )
    t.add_argument(
        "--ternary-gather",
        choices=GATHER_MODES,
        default="packed",
        help="with --ternary, what FSDP2 all-gathers: packed 2-bit codes + row scales "
        "(default), unpacked ternary values, or the latent weights",
    )
    t.add_argument("--threads", type=int, default=0, help="torch threads (0: cores / local ranks)")
    t.add_argument(
        "--log-every", type=int, default=10, metavar="K", help="rank 0 prints loss every K steps"
    )
    o = p.add_argument_group("observability")
    o.add_argument(
        "--socket",
        metavar="PATH",
        help=f"daemon ingest socket ('off' for none; default ${SOCKET_ENV}, else {DEFAULT_SOCKET})",
    )
    o.add_argument(
        "--trace-out", metavar="PATH", help="also write this rank's records here ({rank} replaced)"
    )
    o.add_argument("--no-hooks", action="store_true", help="train without instrumentation")
    c = p.add_argument_group("checkpoints (trainer.checkpoint)")
    c.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="resume from the newest whole checkpoint here (e.g. after torchrun restarts "
        "a failed job) and save into it",
    )
    c.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="with --checkpoint-dir, save asynchronously after every N-th step (default 0: never)",
    )
    e = p.add_argument_group("evaluation (a phase with all-gathers only, for measurements)")
    e.add_argument(
        "--eval-steps",
        type=int,
        default=0,
        metavar="N",
        help="after training, N forward passes without gradients (FSDP2 all-gathers, "
        "never reduce-scatters); their step records number on from --steps",
    )
    e.add_argument(
        "--eval-gap",
        type=_nonneg_float,
        default=0.0,
        metavar="S",
        help="sleep S seconds between training and evaluation",
    )
    d = p.add_argument_group("deliberate stall (tests and captures)")
    d.add_argument("--delay-rank", type=int, metavar="R", help="the rank that stalls")
    d.add_argument(
        "--delay-seconds",
        type=_nonneg_float,
        default=0.0,
        metavar="S",
        help="seconds of sleep per stalled step, between forward and backward",
    )
    d.add_argument(
        "--delay-steps",
        type=_step_range,
        default=(0, None),
        metavar="A:B",
        help="stall in steps A..B-1 (A: to the end; default all)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Flags -> config; exits 2 with a usage line on bad flags."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.dim % a.heads:
        p.error(f"--dim {a.dim} is not a multiple of --heads {a.heads}")
    if a.text and a.vocab < 256:
        p.error("--text trains on bytes: --vocab must be >= 256")
    if a.delay_rank is not None and a.delay_rank < 0:
        p.error("--delay-rank must be >= 0")
    if a.delay_rank is not None and a.delay_seconds <= 0:
        p.error("--delay-rank needs --delay-seconds > 0")
    if a.eval_steps < 0:
        p.error("--eval-steps must be >= 0")
    if a.ternary and a.param_dtype != "fp32":
        p.error("--ternary all-gathers its own format: leave --param-dtype fp32")
    if a.checkpoint_every < 0:
        p.error("--checkpoint-every must be >= 0")
    if a.checkpoint_every and not a.checkpoint_dir:
        p.error("--checkpoint-every needs --checkpoint-dir")
    start, stop = a.delay_steps
    return TrainConfig(
        layers=a.layers,
        dim=a.dim,
        heads=a.heads,
        seq_len=a.seq_len,
        vocab=a.vocab,
        batch=a.batch,
        steps=a.steps,
        step_sleep=a.step_sleep,
        seed=a.seed,
        lr=a.lr,
        text=a.text,
        replicate=a.replicate,
        param_dtype=a.param_dtype,
        ternary=a.ternary,
        ternary_gather=a.ternary_gather,
        socket=socket_from_env(os.environ if a.socket is None else {SOCKET_ENV: a.socket}),
        trace_out=a.trace_out,
        hooks=not a.no_hooks,
        threads=a.threads,
        log_every=a.log_every,
        eval_steps=a.eval_steps,
        eval_gap=a.eval_gap,
        delay_rank=a.delay_rank,
        delay_seconds=a.delay_seconds,
        delay_start=start,
        delay_stop=stop,
        checkpoint_dir=a.checkpoint_dir,
        checkpoint_every=a.checkpoint_every,
    )
