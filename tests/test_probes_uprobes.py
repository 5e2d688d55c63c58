"""Uprobes, for real: NCCL's API through a stub library built here (the
machine has no GPU and no NCCL), and Debian's real libibverbs.so.1."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fsdp_sentinel.probes.loader import ProbeConfig, ProbeSet

pytestmark = [pytest.mark.kernel, pytest.mark.root]

STUBS = Path(__file__).with_name("stubs")
LIBIBVERBS = "/usr/lib/x86_64-linux-gnu/libibverbs.so.1"


def _need_root_and_gcc() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")


def _gcc(*args: str) -> None:
    subprocess.run(["gcc", "-O2", *args], check=True, capture_output=True)


class Caller:
    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def step(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


def test_nccl_calls_and_bytes_counted_exactly(tmp_path: Path) -> None:
    _need_root_and_gcc()
    lib = tmp_path / "libnccl-stub.so"
    exe = tmp_path / "nccl_caller"
    _gcc("-shared", "-fPIC", "-o", str(lib), str(STUBS / "nccl_stub.c"))
    _gcc(
        "-o",
        str(exe),
        str(STUBS / "nccl_caller.c"),
        f"-L{tmp_path}",
        "-l:libnccl-stub.so",
        f"-Wl,-rpath,{tmp_path}",
    )
    ps = ProbeSet(ProbeConfig(pid_filter=True, families=("nccl",)))
    ps.start()
    other = Caller(str(exe), "0")  # not registered: must not be counted
    caller = Caller(str(exe), "2")
    try:
        ps.register_pid(caller.proc.pid)  # finds the stub in its maps, attaches
        assert any("ncclAllGather@" in name for name in ps.report.attached), ps.report.lines()
        assert caller.step().startswith("done")
        assert other.step().startswith("done")
        recs = [r for r in ps.poll() if r["kind"] == "nccl"]
    finally:
        caller.close()
        other.close()
        ps.close()
    by_op = {r["op"]: r for r in recs if r["op"] != "all_reduce"}
    assert {r["pid"] for r in recs} == {caller.proc.pid}
    assert (by_op["all_gather"]["calls"], by_op["all_gather"]["bytes"]) == (3, 12000)
    assert (by_op["reduce_scatter"]["calls"], by_op["reduce_scatter"]["bytes"]) == (2, 1000)
    assert (by_op["broadcast"]["calls"], by_op["broadcast"]["bytes"]) == (1, 5)
    assert (by_op["send"]["calls"], by_op["send"]["bytes"]) == (1, 40)
    assert (by_op["recv"]["calls"], by_op["recv"]["bytes"]) == (1, 40)
    assert by_op["group_start"]["calls"] == 1 and by_op["group_end"]["calls"] == 1
    allreduce = [r for r in recs if r["op"] == "all_reduce"]
    assert len(allreduce) == 1
    assert (allreduce[0]["calls"], allreduce[0]["bytes"]) == (2, 56)
    assert allreduce[0]["unknown_dtype_calls"] == 1
    # Communicator -> rank from ncclCommInitRank (+ its uretprobe).
    for r in recs:
        if r["op"] not in ("group_start", "group_end"):
            assert (r["rank"], r["nranks"]) == (2, 4), r


def test_ibverbs_uprobes_attach_and_read_arguments(tmp_path: Path) -> None:
    _need_root_and_gcc()
    if not os.path.exists(LIBIBVERBS):
        pytest.skip("Debian's libibverbs1 is not installed")
    exe = tmp_path / "verbs_caller"
    _gcc("-o", str(exe), str(STUBS / "verbs_caller.c"), "-ldl")
    ps = ProbeSet(ProbeConfig(families=("verbs",)))
    ps.start()
    caller = Caller(str(exe))
    try:
        ps.register_pid(caller.proc.pid)  # finds libibverbs in its maps
        names = [n for n in ps.report.attached if n.startswith("uprobe:ibv_")]
        assert len(names) == 3, ps.report.lines()
        assert caller.step() == "done"
        recs = [r for r in ps.poll() if r["kind"] == "qp" and r["qp_num"] == 4242]
    finally:
        caller.close()
        ps.close()
    whats = {r["what"]: r for r in recs}
    assert set(whats) == {"modify", "destroy"}, recs
    assert whats["modify"]["state"] == 3 and whats["modify"]["dest_qp_num"] == 777
    assert whats["modify"]["qp_type"] == 2
    assert whats["modify"]["pid"] != caller.proc.pid  # a forked child made the call
