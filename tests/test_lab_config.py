"""The lab's pure parts: names, addresses, config checks, token-bucket sizes, matchers.

No root needed. Names must be unique machine-wide and fit IFNAMSIZ because
the kernel's net_dev_xmit tracepoint identifies a device by name alone.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from pathlib import Path

import pytest

from fsdp_sentinel import cli
from fsdp_sentinel.lab import LabConfig, LabError
from fsdp_sentinel.lab.cleanup import lab_matcher
from fsdp_sentinel.lab.cluster import torchrun_argv
from fsdp_sentinel.lab.config import IFNAME_MAX, plan_hosts, plan_storage, tbf_sizes
from fsdp_sentinel.lab.faults import rank_pids
from fsdp_sentinel.lab.gloo_check import cpu_cgroup
from fsdp_sentinel.lab.loss import drop_threshold


def test_names_and_addresses_of_a_default_lab() -> None:
    cfg = LabConfig()
    hosts = plan_hosts(cfg)
    st = plan_storage(cfg)
    assert [h.netns for h in hosts] == ["fss-h0", "fss-h1", "fss-h2", "fss-h3"]
    assert [h.addr for h in hosts] == ["198.18.0.1", "198.18.0.2", "198.18.0.3", "198.18.0.4"]
    assert st.addr == "198.18.0.254" and st.cgroup is None and st.index == -1
    assert hosts[2].cgroup == "/sys/fs/cgroup/cpu/fss-h2"
    names = [n for h in [*hosts, st] for n in (h.ifname, h.switch_ifname)]
    assert len(set(names)) == len(names)
    assert all(n.startswith("fss-") and len(n) <= IFNAME_MAX for n in names)


def test_longest_allowed_names_fit_ifnamsiz() -> None:
    cfg = LabConfig(name="fss-abcdefg", hosts=10)  # fss-abcdefg-h9e: 15 chars
    assert max(len(h.ifname) for h in plan_hosts(cfg)) == IFNAME_MAX
    with pytest.raises(LabError, match="too long"):
        LabConfig(name="fss-abcdefg", hosts=11)


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"name": "lab"}, "must start"),
        ({"name": "fss-A"}, "must start"),
        ({"hosts": 0}, "hosts"),
        ({"subnet": "10.0.0.0/24"}, "inside 198.18.0.0/15"),
        ({"subnet": "198.18.0.0/30", "hosts": 2}, "too small"),
        ({"subnet": "nonsense"}, "subnet"),
        ({"rate_mbit": 0.0}, "rate_mbit"),
    ],
)
def test_bad_configs_say_why(kw: dict[str, object], why: str) -> None:
    with pytest.raises(LabError, match=why):
        LabConfig(**kw)  # type: ignore[arg-type]


def test_addresses_stay_in_the_benchmark_range() -> None:
    net = ipaddress.ip_network("198.18.0.0/15")
    cfg = LabConfig(subnet="198.19.255.0/24", hosts=8)
    for h in [*plan_hosts(cfg), plan_storage(cfg)]:
        assert ipaddress.ip_address(h.addr) in net


def test_tbf_burst_holds_a_gso_packet_and_scales_with_rate() -> None:
    burst, limit = tbf_sizes(1000.0, 2.0, 20.0)
    assert burst == 250_000 and limit == 2_500_000 + 250_000
    small, _ = tbf_sizes(10.0, 2.0, 20.0)
    assert small >= 65536 + 1514


def test_matcher_keeps_labs_apart() -> None:
    m = lab_matcher("fss-a")
    assert m("fss-a-h0") and m("fss-a-h12e") and m("fss-a-sw") and m("fss-a-sts")
    assert not m("fss-a-b-h0") and not m("fss-ab-h0") and not m("fss-a-h0x")
    anylab = lab_matcher(None)
    assert anylab("fss-a-b-h0") and not anylab("eth0")


def test_rank_pids_reads_the_environment(tmp_path: Path) -> None:
    for pid, env in ((10, b"A=1\0RANK=3\0"), (11, b"MYRANK=3\0"), (12, b"")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "environ").write_bytes(env)
    assert rank_pids([10, 11, 12, 13], proc=str(tmp_path)) == [10]


def test_drop_threshold_ends() -> None:
    assert drop_threshold(0.0) == 0
    assert drop_threshold(1.0) == 2**32
    assert drop_threshold(0.25) == 2**30


def test_cpu_cgroup_line() -> None:
    text = "2:cpuacct:/\n1:cpu:/fss-h1\n0::/\n"
    assert cpu_cgroup(text) == "/fss-h1"
    assert cpu_cgroup("3:cpu,cpuacct:/x\n") == "/x"


def test_torchrun_argv_shape() -> None:
    class _Lab:
        hosts = plan_hosts(LabConfig(hosts=3))

    argv = torchrun_argv(_Lab(), 2, "m.od", ["--x", "1"], master_port=29500)  # type: ignore[arg-type]
    s = " ".join(argv)
    assert "--nnodes 3 --node-rank 2 --nproc-per-node 1" in s
    assert "--master-addr 198.18.0.1 --master-port 29500" in s
    assert argv[-4:] == ["-m", "m.od", "--x", "1"]


def test_cli_lab_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_sentinel.lab import cmd

    # The lab's own parser, as cli.py builds it (other subcommands stay out of it).
    parser = argparse.ArgumentParser(prog="fsdp-sentinel lab")
    cmd.add_arguments(parser)
    assert cli.COMMANDS["lab"] == "fsdp_sentinel.lab.cmd"
    for argv in ([], ["sideways"], ["up", "--hosts", "many"], ["down", "--bogus"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2
        assert "usage:" in capsys.readouterr().err


def test_cli_lab_up_rejects_bad_name_before_touching_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fsdp_sentinel.lab import cmd

    args = argparse.Namespace(
        lab_command="up", name="nope", hosts=2, rate_mbit=100.0, subnet="198.18.0.0/24", detach=True
    )
    assert cmd.main(args) == 2
    assert "must start with" in capsys.readouterr().err
    assert not os.path.exists("/run/netns/nope-h0")


def test_cleanup_finds_lab_processes_and_cgroups_from_the_system_roots(tmp_path: Path) -> None:
    from fsdp_sentinel.lab import cleanup

    run = tmp_path / "netns"
    proc = tmp_path / "proc"
    cg = tmp_path / "cpu"
    run.mkdir()
    for name in ("fss-a-h0", "fss-a-sw", "fss-ab-h0", "other"):
        (run / name).write_text("")
    # A process "is in" a namespace when its ns/net is the same file (dev, inode).
    for pid, ns in ((101, "fss-a-h0"), (102, "other"), (103, None)):
        (proc / str(pid) / "ns").mkdir(parents=True)
        if ns is not None:
            os.link(run / ns, proc / str(pid) / "ns" / "net")
    (proc / "self").mkdir()
    for name, procs in (("fss-a-h0", "101\n104\n"), ("fss-ab-h0", "")):
        (cg / name).mkdir(parents=True)
        (cg / name / "cgroup.procs").write_text(procs)
    match = cleanup.lab_matcher("fss-a")
    assert cleanup.netns_names(match, str(run)) == ["fss-a-h0", "fss-a-sw"]
    assert cleanup.pids_in_netns("fss-a-h0", str(run), str(proc)) == [101]
    assert [p.name for p in cleanup.cgroup_dirs(match, str(cg))] == ["fss-a-h0"]
    assert cleanup.cgroup_pids(cg / "fss-a-h0") == [101, 104]
    assert cleanup.netns_names(match, str(tmp_path / "absent")) == []


def test_status_table_fits_80_columns() -> None:
    from fsdp_sentinel.lab.status import format_table

    end = {"addrs": ["198.18.0.1/24"], "qdiscs": [{"kind": "tbf", "rate_mbit": 1000.0}]}
    lossy = {
        "addrs": [],
        "qdiscs": [{"kind": "tbf", "rate_mbit": 150.0}, {"kind": "clsact", "drops": 7}],
    }
    labs = [
        {
            "lab": "fss",
            "switch": True,
            "hosts": [
                {
                    "name": "fss-h0",
                    "host_end": end,
                    "switch_end": end,
                    "cfs_quota_us": -1,
                    "pids": 2,
                },
                {
                    "name": "fss-h1",
                    "host_end": lossy,
                    "switch_end": end,
                    "cfs_quota_us": 10000,
                    "pids": 2,
                },
            ],
        }
    ]
    text = format_table(labs)
    assert all(len(line) < 80 for line in text.splitlines())
    assert "tbf 1000M" in text and "tbf 150M,drop 7" in text and "10ms" in text
    assert format_table([]) == "no labs"
