"""``--socket-group``: the ingest socket gets a group, mode 0660, so ranks
running as a non-root user in that group can send, and nobody else can.

The root tests send from real child processes that run as other uids
(``setpriv --reuid/--regid/--groups``): one in the group as a supplementary
group only (the usual case: a training user added to the daemon's group),
one outside it. The kernel decides: the member's datagram is accepted, the
outsider's ``sendto`` fails with EACCES.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_support import DaemonProcess, run_command, wait_for

from fsdp_sentinel.ingest import IngestServer

GROUP = 54_321  # a gid no account uses: the kernel needs no name for it
MEMBER_UID, MEMBER_GID = 54_322, 54_323  # in GROUP only as a supplementary group
OUTSIDER = 54_324

needs_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)

# The child sends one step record and prints its pid and the errno (0: sent).
_SENDER = """
import errno, json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
rec = {"kind": "step", "rank": 0, "step": 0, "start": 1.0, "end": 2.0}
try:
    s.sendto(json.dumps(rec).encode(), sys.argv[1]); e = 0
except OSError as x:
    e = x.errno
print(os.getpid(), e)
"""


def send_as(path: Path, uid: int, gid: int, groups: list[int]) -> tuple[int, int]:
    ids = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    res = subprocess.run(
        ["setpriv", "--reuid", str(uid), "--regid", str(gid), *ids, "--",
         sys.executable, "-I", "-c", _SENDER, str(path)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    pid, err = res.stdout.split()
    return int(pid), int(err)


@pytest.fixture
def top() -> Iterator[Path]:
    # Not under pytest's tmp_path: its folders are 0700, so no other uid
    # could reach a socket there, group or not.
    d = Path(tempfile.mkdtemp(prefix="fss-sockgroup-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d)


@pytest.mark.root
@needs_setpriv
@pytest.mark.parametrize("made_here", [True, False], ids=["folder_made", "folder_existing"])
def test_a_member_of_the_socket_group_can_send_an_outsider_gets_eacces(
    top: Path, made_here: bool
) -> None:
    folder = top / "run"
    if not made_here:
        folder.mkdir()
        os.chmod(folder, 0o755)  # an open folder (like /tmp): only the socket's mode guards
    path = folder / "ingest.sock"
    got: list[dict[str, Any]] = []
    srv = IngestServer(path, got.append, socket_group=GROUP).start()
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert (st.st_uid, st.st_gid) == (0, GROUP)
        fst = os.stat(folder)
        if made_here:  # the folder the server made: 0750 and the group, so members traverse it
            assert (stat.S_IMODE(fst.st_mode), fst.st_gid) == (0o750, GROUP)
        else:  # an existing folder is left as it was
            assert (stat.S_IMODE(fst.st_mode), fst.st_gid) == (0o755, 0)

        pid, err = send_as(path, MEMBER_UID, MEMBER_GID, [GROUP])
        assert err == 0
        wait_for(lambda: srv.accepted == 1, 10, "the member's record accepted")
        assert got[0]["host_pid"] == pid and got[0]["step"] == 0

        _, err = send_as(path, OUTSIDER, OUTSIDER, [])
        assert err == 13  # EACCES: the kernel refused it; nothing reached the server
        _, err = send_as(path, MEMBER_UID, MEMBER_GID, [])  # the same user, not in the group
        assert err == 13
        assert (srv.received, srv.accepted, srv.dropped_total) == (1, 1, 0)
    finally:
        srv.close()
    assert not path.exists()


@pytest.mark.root
@needs_setpriv
def test_run_socket_group_by_name_gives_the_socket_that_group(top: Path) -> None:
    path = top / "s" / "ingest.sock"
    d = DaemonProcess(["--no-probes", "--metrics-addr", "off", "--socket", str(path),
                       "--socket-group", "nogroup", "--log-level", "info"])  # fmt: skip
    try:
        d.wait_log(r"listening on")
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, 65534)
        assert os.stat(path.parent).st_gid == 65534
        _, err = send_as(path, MEMBER_UID, MEMBER_GID, [65534])
        assert err == 0
        _, err = send_as(path, OUTSIDER, OUTSIDER, [])
        assert err == 13
    finally:
        assert d.stop() == 0
    assert not path.exists()


def test_without_a_group_the_socket_keeps_the_daemons(tmp_path: Path) -> None:
    path = tmp_path / "ingest.sock"
    with IngestServer(path, lambda rec: True):
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, os.getegid())
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:  # the owner still sends
            s.sendto(json.dumps({"kind": "x", "t": 1.0}).encode(), str(path))


@pytest.mark.parametrize("name", ["fss-no-such-group", "4294967296", "", "-1"])
def test_a_bad_socket_group_exits_2_with_a_usage_line(tmp_path: Path, name: str) -> None:
    sock = tmp_path / "s.sock"
    res = run_command("run", "--no-probes", "--metrics-addr", "off", "--socket", str(sock),
                      "--socket-group", name)  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "usage: fsdp-sentinel" in res.stderr and "no such group" in res.stderr
    assert not sock.exists()
