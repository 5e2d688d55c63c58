"""The ingest socket takes the sender's pid from the kernel (SO_PASSCRED / SCM_CREDENTIALS).

A rank in a container knows itself by its pid namespace's pid; the probes key
on the host's tgid. The kernel translates the sender's pid into the daemon's
namespace: the server stamps it as ``host_pid``, keeps the record's ``pid`` (the
rank's own view), and refuses a rank record whose pid is neither (counted).
The namespace case uses a real child pid namespace (``unshare --pid --fork``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_support import wait_for

from fsdp_sentinel.ingest import NOT_SENDER, IngestServer, is_sender, ns_pids

Record = dict[str, Any]


def rank_rec(pid: int, rank: int = 0) -> Record:
    return {"kind": "rank", "t": 1.0, "rank": rank, "world_size": 2, "host": "h",
            "pid": pid, "addrs": ["198.18.0.1"], "job": "j1"}  # fmt: skip


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[IngestServer, list[Record], Path]]:
    got: list[Record] = []
    path = tmp_path / "run" / "ingest.sock"
    srv = IngestServer(path, got.append).start()
    try:
        yield srv, got, path
    finally:
        srv.close()


def send(path: Path, rec: Record) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(json.dumps(rec).encode(), str(path))


def test_own_pid_is_accepted_and_stamped_a_forged_host_pid_replaced(server) -> None:
    srv, got, path = server
    send(path, {**rank_rec(os.getpid()), "host_pid": 1})  # a sender may not say host_pid
    send(path, {"kind": "step", "rank": 0, "step": 0, "start": 1.0, "end": 2.0})
    wait_for(lambda: len(got) == 2)
    assert [r["host_pid"] for r in got] == [os.getpid(), os.getpid()]
    assert got[0]["pid"] == os.getpid()


def test_a_rank_record_announcing_another_process_is_refused_and_counted(server) -> None:
    srv, got, path = server
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        send(path, rank_rec(other.pid))  # a live process, but not the sender
        send(path, rank_rec(os.getpid(), rank=1))
        wait_for(lambda: srv.received == 2)
        wait_for(lambda: len(got) == 1)
    finally:
        other.kill()
        other.wait()
    assert [r["rank"] for r in got] == [1]
    assert srv.dropped[NOT_SENDER] == 1
    assert srv.received == srv.accepted + srv.dropped_total


def test_trusting_the_record_takes_it_as_sent(tmp_path: Path) -> None:
    got: list[Record] = []
    path = tmp_path / "ingest.sock"
    with IngestServer(path, got.append, trust_pid=True) as srv:
        send(path, rank_rec(4242))
        wait_for(lambda: len(got) == 1)
        assert got == [rank_rec(4242)]
        assert srv.dropped_total == 0


def test_nspid_is_read_from_the_status_file(tmp_path: Path) -> None:
    (tmp_path / "700").mkdir()
    (tmp_path / "700" / "status").write_text("Name:\tpython\nPid:\t700\nNSpid:\t700\t12\t1\n")
    assert ns_pids(700, str(tmp_path)) == (700, 12, 1)
    assert is_sender(1, 700, str(tmp_path)) and is_sender(12, 700, str(tmp_path))
    assert is_sender(700, 700, str(tmp_path))
    assert not is_sender(13, 700, str(tmp_path))
    assert not is_sender("1", 700, str(tmp_path))
    assert ns_pids(701, str(tmp_path)) == ()  # gone: nothing to match


SENDER = """
import json, os, socket, sys
outer = int(os.readlink("/proc/self"))  # /proc is the parent namespace's mount
announce = os.getpid() + int(sys.argv[2])
rec = {"kind": "rank", "t": 1.0, "rank": 0, "world_size": 1, "host": "h",
       "pid": announce, "addrs": [], "job": "ns"}
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.sendto(json.dumps(rec).encode(), sys.argv[1])
print(json.dumps({"inner": os.getpid(), "outer": outer}))
"""


def in_child_pid_namespace(path: Path, offset: int) -> dict[str, int]:
    if shutil.which("unshare") is None:
        pytest.skip("unshare not installed")
    out = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", SENDER, str(path), str(offset)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if out.returncode != 0 and "Operation not permitted" in out.stderr:
        pytest.skip("cannot create pid namespaces here")
    assert out.returncode == 0, out.stderr
    seen: dict[str, int] = json.loads(out.stdout)
    return seen


@pytest.mark.root
def test_a_rank_in_a_child_pid_namespace_gets_the_host_pid(server) -> None:
    srv, got, path = server
    seen = in_child_pid_namespace(path, 0)
    assert seen["inner"] != seen["outer"]  # really another namespace (pid 1 there)
    wait_for(lambda: len(got) == 1)
    assert got[0]["pid"] == seen["inner"]  # the rank's own view, kept
    assert got[0]["host_pid"] == seen["outer"]  # what the probes key on
    assert srv.dropped[NOT_SENDER] == 0


@pytest.mark.root
def test_a_rank_in_a_child_pid_namespace_announcing_a_pid_not_its_own_is_refused(server) -> None:
    srv, got, path = server
    in_child_pid_namespace(path, 5)  # inner pid + 5: nobody's pid, in any namespace
    wait_for(lambda: srv.received == 1)
    wait_for(lambda: srv.dropped[NOT_SENDER] == 1)
    assert got == []
