"""``python -m fsdp_sentinel`` is the ``fsdp-sentinel`` command."""

import sys

from fsdp_sentinel.cli import main

sys.exit(main())
