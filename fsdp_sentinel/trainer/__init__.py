"""The bundled FSDP2 trainer: ``torchrun ... -m fsdp_sentinel.trainer``.

A small GPT-style decoder on seeded synthetic tokens (or a text file), AdamW,
``fully_shard`` on every block and the root (HSDP with ``--replicate N``),
instrumented with :mod:`fsdp_sentinel.hooks`. Modules: ``config`` (flags),
``model``, ``data``, ``loop`` (the train loop, top to bottom).
"""
