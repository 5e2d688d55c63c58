"""unwinding_on_signals: Ctrl-C and SIGTERM unwind the owner, even when SIGINT was ignored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from fsdp_sentinel.interrupts import unwinding_on_signals

# Run in a fresh interpreter whose SIGINT is ignored from the start, as for
# anything a non-interactive shell starts in the background: Python then
# installs no KeyboardInterrupt handler of its own.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from fsdp_sentinel.interrupts import unwinding_on_signals

    sig = getattr(signal, sys.argv[1])
    try:
        with unwinding_on_signals():
            os.kill(os.getpid(), sig)
            time.sleep(5)
        print("not interrupted")
    except KeyboardInterrupt:
        print("unwound")
    print("restored", signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
    """
)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signal_unwinds_the_owner_even_when_sigint_was_ignored(sig: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, sig],
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["unwound", "restored True"]


def test_a_forked_child_exits_instead_of_unwinding() -> None:
    with unwinding_on_signals():
        pid = os.fork()
        if pid == 0:  # the child: a copy of this stack that must not unwind
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                signal.pause()
            finally:
                os._exit(99)  # only reached if the handler raised
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), status
    assert os.WEXITSTATUS(status) == 128 + signal.SIGTERM
