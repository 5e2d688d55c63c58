"""``python -m fsdp_sentinel.trainer`` (launched by torchrun, one process per rank)."""

from fsdp_sentinel.trainer.loop import leave, main

leave(main())
