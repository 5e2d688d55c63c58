"""``python -m fsdp_sentinel.trainer`` (launched by torchrun, one process per rank)."""

import sys

from fsdp_sentinel.trainer.loop import main

sys.exit(main())
