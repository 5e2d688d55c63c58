"""Small pieces of the observability bundle, offline: the BPF run-statistics
switch and fdinfo reader, the rdma/nccl totals, the hooks' job id."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_sentinel.fabric import FabricTotals, is_error_counter
from fsdp_sentinel.hooks import attempt_of, job_id
from fsdp_sentinel.probes import bpfstats
from fsdp_sentinel.snapshot import NcclView, RdmaPortView

FDINFO = """pos:\t0
flags:\t02000002
mnt_id:\t15
prog_type:\t5
prog_jited:\t1
prog_tag:\t1e7c5cb8d7d1d1b0
memlock:\t4096
prog_id:\t42
run_time_ns:\t123456
run_cnt:\t789
recursion_misses:\t3
verified_insns:\t77
"""


def test_read_fdinfo_from_a_proc_tree(tmp_path: Path) -> None:
    fdinfo = tmp_path / "4242" / "fdinfo"
    fdinfo.mkdir(parents=True)
    (fdinfo / "7").write_text(FDINFO)
    got = bpfstats.read_fdinfo({"tp_send": 7, "gone": 9}, pid=4242, proc_root=str(tmp_path))
    # a closed fd (detached program) reports nothing rather than zeros
    assert got == {"tp_send": {"run_time_ns": 123456, "run_cnt": 789, "recursion_misses": 3}}


def test_sysctl_fallback_sets_and_restores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bpfstats, "_enable_stats_fd", lambda: None)  # a pre-5.8 kernel
    sysctl = tmp_path / "bpf_stats_enabled"
    sysctl.write_text("0\n")
    stats = bpfstats.RunStats(str(sysctl))
    assert stats.how == "sysctl" and sysctl.read_text().strip() == "1"
    stats.close()
    stats.close()  # idempotent
    assert sysctl.read_text().strip() == "0"
    # already on (another tool's): left on
    sysctl.write_text("1\n")
    bpfstats.RunStats(str(sysctl)).close()
    assert sysctl.read_text().strip() == "1"


def test_fabric_totals() -> None:
    fab = FabricTotals(lambda host, pid: {("h", 10): 3}.get((host, pid)))
    for _ in range(2):
        fab.add_rdma({"host": "h", "dev": "mlx5_0", "port": 1, "tx_bytes": 40, "rx_bytes": 8,
                      "counters": {"symbol_error": 1, "port_xmit_packets": 9,
                                   "hw.out_of_sequence": 2, "hw.np_cnp_sent": 5}})  # fmt: skip
        fab.add_nccl({"host": "h", "pid": 10, "op": "all_reduce", "calls": 2, "bytes": 64})
        fab.add_nccl({"host": "h", "pid": 11, "rank": 5, "op": "send", "calls": 1, "bytes": 8})
    assert fab.rdma_ports() == (
        RdmaPortView("h", "mlx5_0", 1, 80, 16, {"hw.out_of_sequence": 4, "symbol_error": 2}),
    )
    assert fab.nccl() == (NcclView("h", 3, "all_reduce", 4, 128), NcclView("h", 5, "send", 2, 16))
    assert not is_error_counter("port_xmit_packets") and is_error_counter("port_rcv_errors")


@pytest.mark.parametrize(
    "env,want",
    [
        ({"FSDP_SENTINEL_JOB": "mine", "TORCHELASTIC_RUN_ID": "te"}, "mine"),
        ({"TORCHELASTIC_RUN_ID": "te", "SLURM_JOB_ID": "77"}, "te"),
        ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}, "77"),
        ({}, ""),
    ],
)
def test_job_id_order(env: dict[str, str], want: str) -> None:
    assert job_id(env) == want


def test_job_id_from_the_rendezvous_is_shared_and_hides_the_port() -> None:
    a = job_id({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "0"})
    b = job_id({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "3"})
    c = job_id({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"})
    assert a == b != c and a.startswith("rdzv-") and "29500" not in a


def test_announced_job_reaches_every_rank_series() -> None:
    from fsdp_sentinel.exporters.prometheus import families
    from fsdp_sentinel.pipeline import Pipeline

    pipe = Pipeline()
    for rank in (0, 1):
        pipe.feed({"kind": "rank", "t": 1.0, "rank": rank, "world_size": 2, "host": f"h{rank}",
                   "pid": 100 + rank, "addrs": [], "job": "run-9"})  # fmt: skip
    snap = pipe.snapshot()
    assert {r.job for r in snap.ranks} == {"run-9"}
    rank_samples = [s for f in families(snap) for s in f.samples if "rank" in s.labels]
    assert rank_samples and all(s.labels["job"] == "run-9" for s in rank_samples)


def test_attempt_is_torchelastics_restart_count() -> None:
    assert attempt_of({"TORCHELASTIC_RESTART_COUNT": "0"}) == 0
    assert attempt_of({"TORCHELASTIC_RESTART_COUNT": "3"}) == 3
    assert attempt_of({}) is None
    assert attempt_of({"TORCHELASTIC_RESTART_COUNT": "-1"}) is None
    assert attempt_of({"TORCHELASTIC_RESTART_COUNT": "x"}) is None
