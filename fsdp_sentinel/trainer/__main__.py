"""``python -m fsdp_sentinel.trainer`` (launched by torchrun, one process per rank)."""

import os
import sys

from fsdp_sentinel.trainer.loop import main

code = main()
# Out without the interpreter's teardown: the group is destroyed and the
# hooks closed by now, and tearing down torch's C++ statics while a gloo
# thread still runs aborts a rank that finished cleanly now and then
# ("terminate called without an active exception": CI, sessions 29-30).
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
