"""A real lab comes up, its hosts reach each other over the bridge, and it all goes away.

Oracles are the system's own tools: ``ip netns list``, ``ip -j link``,
``ping``, ``tc -j qdisc``, the cgroup tree. Every lab here is named
``fss-lt...`` so parallel helpers' labs are never touched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdp_sentinel.lab import Lab, LabConfig, LabError
from fsdp_sentinel.lab.cleanup import teardown

pytestmark = [pytest.mark.root, pytest.mark.lab]

NAME = "fss-lt"
CG = "/sys/fs/cgroup/cpu"


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def netns_list() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def links(netns: str | None = None) -> list[dict]:
    pre = ["-n", netns] if netns else []
    return json.loads(sh("ip", *pre, "-j", "link", "show"))


def leftovers(name: str) -> list[str]:
    """Anything of lab ``name`` still on the machine, as readable strings."""
    mine = [n for n in netns_list() if n.startswith(name + "-")]
    mine += [f"link {lk['ifname']}" for lk in links() if lk["ifname"].startswith(name + "-")]
    mine += [f"cgroup {p}" for p in os.listdir(CG) if p.startswith(name + "-")]
    return mine


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    for n in (NAME, NAME + "k", NAME + "i"):
        teardown(n)
    yield
    for n in (NAME, NAME + "k", NAME + "i"):
        teardown(n)


def test_lab_comes_up_hosts_ping_root_untouched_and_all_goes_away() -> None:
    root_links_before = {lk["ifname"] for lk in links()}
    lab = Lab(LabConfig(name=NAME, hosts=3, rate_mbit=500.0, subnet="198.18.7.0/24"))
    with lab:
        spaces = netns_list()
        for ns in ("fss-lt-sw", "fss-lt-st", "fss-lt-h0", "fss-lt-h1", "fss-lt-h2"):
            assert ns in spaces
        # Nothing new in the root namespace: the bridge lives in the switch namespace.
        assert {lk["ifname"] for lk in links()} == root_links_before
        sw = {lk["ifname"]: lk for lk in links("fss-lt-sw")}
        assert sw["fss-lt-br"]["operstate"] == "UP"
        for i in range(3):
            assert sw[f"fss-lt-h{i}s"]["master"] == "fss-lt-br"
        # Interface names are unique across every namespace of the lab.
        every = [lk["ifname"] for ns in spaces if ns.startswith(NAME + "-") for lk in links(ns)]
        named = [n for n in every if n != "lo"]
        assert len(named) == len(set(named)) == 1 + 2 * 4  # bridge + 2 per host (4 with storage)
        h1 = json.loads(sh("ip", "-n", "fss-lt-h1", "-j", "addr", "show", "dev", "fss-lt-h1e"))
        assert h1[0]["addr_info"][0]["local"] == "198.18.7.2"
        lo = [lk for lk in links("fss-lt-h1") if lk["ifname"] == "lo"][0]
        assert "UP" in lo["flags"]
        # Shaped both ways: host egress and the switch port towards the host.
        for ns, dev in (("fss-lt-h2", "fss-lt-h2e"), ("fss-lt-sw", "fss-lt-h2s")):
            q = json.loads(sh("tc", "-n", ns, "-j", "qdisc", "show", "dev", dev))
            tbf = [x for x in q if x["kind"] == "tbf"]
            assert tbf and tbf[0]["handle"] == "1:" and tbf[0]["options"]["rate"] == 62_500_000
        # Every host reaches every other host and the storage host, over the bridge.
        targets = [h.addr for h in lab.hosts] + [lab.storage.addr]
        for h in lab.hosts:
            for addr in targets:
                if addr != h.addr:
                    out = subprocess.run(
                        ["ip", "netns", "exec", h.netns, "ping", "-c1", "-W2", addr],
                        capture_output=True,
                        text=True,
                    )
                    assert out.returncode == 0, out.stdout + out.stderr
        for h in lab.hosts:
            assert os.path.isdir(f"{CG}/{h.name}")
        sleeper = lab.popen(1, ["sleep", "300"])
        time.sleep(0.1)
        assert lab.cgroup_pids(1) == [sleeper.pid]
    assert sleeper.poll() is not None
    assert leftovers(NAME) == []
    lab.close()  # twice is fine


def test_cleanup_on_exception_inside_with() -> None:
    pid = None
    with pytest.raises(RuntimeError, match="boom"), Lab(LabConfig(name=NAME, hosts=2)) as lab:
        pid = lab.popen(0, ["sleep", "300"]).pid
        assert leftovers(NAME)
        raise RuntimeError("boom")
    assert pid is not None and not alive(pid)
    assert leftovers(NAME) == []


def test_cleanup_when_building_fails(tmp_path: Path) -> None:
    # A cgroup root that does not exist: the network is built first, then mkdir fails.
    with pytest.raises(FileNotFoundError):
        Lab(LabConfig(name=NAME, hosts=2, cgroup_root=str(tmp_path / "nope")))
    assert leftovers(NAME) == []


def test_existing_lab_is_refused_without_replace() -> None:
    with Lab(LabConfig(name=NAME, hosts=1)):
        with pytest.raises(LabError, match="lab down --name fss-lt"):
            Lab(LabConfig(name=NAME, hosts=1, replace_existing=False))
        assert "fss-lt-h0" in netns_list()


CRASH = """
import os, signal, subprocess
from fsdp_sentinel.lab import Lab, LabConfig
lab = Lab(LabConfig(name="fss-ltk", hosts=2, rate_mbit=100.0))
p = lab.popen(1, ["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(p.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no cleanup at all
"""


def test_lab_down_removes_the_leftovers_of_a_crashed_run() -> None:
    out = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True)
    assert out.returncode == -signal.SIGKILL
    sleeper = int(out.stdout.split()[0])
    assert alive(sleeper)
    assert "fss-ltk-h1" in netns_list() and os.path.isdir(f"{CG}/fss-ltk-h1")
    down = subprocess.run(
        [sys.executable, "-m", "fsdp_sentinel", "lab", "down", "--name", "fss-ltk"],
        capture_output=True,
        text=True,
    )
    assert down.returncode == 0, down.stderr
    assert "removed 4 namespaces, 2 cgroups" in down.stdout
    assert not alive(sleeper)
    assert leftovers("fss-ltk") == []


def test_cli_up_status_and_ctrl_c() -> None:
    up = subprocess.Popen(
        [sys.executable, "-m", "fsdp_sentinel", "lab", "up", "--name", "fss-lti", "--hosts", "2",
         "--rate-mbit", "200", "--subnet", "198.18.9.0/24"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert up.stdout is not None
        lines: list[str] = []
        while not lines or "Ctrl-C removes it" not in lines[-1]:
            lines.append(up.stdout.readline())
            assert lines[-1], f"lab up ended early: {lines}"
        assert any(line.split()[:2] == ["fss-lti-h1", "198.18.9.2/24"] for line in lines), lines
        st = subprocess.run(
            [sys.executable, "-m", "fsdp_sentinel", "lab", "status", "--name", "fss-lti", "--json"],
            capture_output=True,
            text=True,
            check=True,
        )
        labs = json.loads(st.stdout)
        assert [lab["lab"] for lab in labs] == ["fss-lti"]
        hosts = {h["name"]: h for h in labs[0]["hosts"]}
        assert hosts["fss-lti-h1"]["host_end"]["addrs"] == ["198.18.9.2/24"]
        tbf = [q for q in hosts["fss-lti-h1"]["switch_end"]["qdiscs"] if q["kind"] == "tbf"]
        assert tbf[0]["rate_mbit"] == pytest.approx(200.0)
        assert hosts["fss-lti-h0"]["cfs_quota_us"] == -1
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=20) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert leftovers("fss-lti") == []
