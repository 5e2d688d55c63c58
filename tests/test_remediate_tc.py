"""The remediator on real devices: real tc in lab namespaces, checked with the ``tc`` command.

The oracle is ``tc -j [-s] qdisc/class/filter show`` (iproute2, not
pyroute2): the tree is what was intended, the job's flows land in the
priority class (its byte counter grows, the other class's does not take
them), and after rollback -- at close, and after a SIGKILL at the next
start -- the device's configuration is exactly what it was before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_sentinel.lab import Lab, LabConfig
from fsdp_sentinel.remediate import DeviceRef, RemediateConfig, TcRemediator
from fsdp_sentinel.remediate.plan import handle

pytestmark = [pytest.mark.root, pytest.mark.kernel, pytest.mark.lab]

NAME = "fss-rt"
MAJOR = 0x5EB
JOB_PID = 4242  # the "rank" the records speak of (any pid: only the records use it)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(LabConfig(name=NAME, hosts=2, rate_mbit=400.0, replace_existing=True)) as lab:
        yield lab


def tc(netns: str, *args: str) -> Any:
    out = subprocess.run(["ip", "netns", "exec", netns, "tc", "-j", *args],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    return json.loads(out or "[]")


def tc_text(netns: str, *args: str) -> str:
    return subprocess.run(["ip", "netns", "exec", netns, "tc", *args],
                          check=True, capture_output=True, text=True).stdout  # fmt: skip


def config_of(netns: str, ifname: str) -> dict[str, Any]:
    """The device's whole tc configuration (no counters), as iproute2 shows it (a tbf's
    class has no JSON form: text for classes)."""
    return {
        "qdisc": tc(netns, "qdisc", "show", "dev", ifname),
        "invisible": tc_text(netns, "qdisc", "show", "dev", ifname, "invisible"),
        "class": tc_text(netns, "class", "show", "dev", ifname),
        "filter": tc(netns, "filter", "show", "dev", ifname),
        "egress": tc(netns, "filter", "show", "dev", ifname, "egress"),
    }


def classes(netns: str, ifname: str) -> dict[str, dict[str, Any]]:
    """``tc -s class show`` parsed (this iproute2 has no JSON for classes): handle ->
    its words as key/value pairs, plus ``bytes`` sent."""
    out: dict[str, dict[str, Any]] = {}
    cur: dict[str, Any] = {}
    for line in tc_text(netns, "-s", "class", "show", "dev", ifname).splitlines():
        words = line.split()
        if words[:1] == ["class"]:
            cur = {"kind": words[1], **dict(zip(words[3::2], words[4::2], strict=False))}
            out[words[2]] = cur
        elif words[:1] == ["Sent"]:
            cur["bytes"] = int(words[1])
    return out


def class_bytes(netns: str, ifname: str) -> dict[str, int]:
    """Bytes sent by the classes of the tree (``tc -s``)."""
    return {h: c["bytes"] for h, c in classes(netns, ifname).items() if h.startswith("5eb:")}


def ss_flows(netns: str, dport: int) -> list[tuple[str, str]]:
    out = subprocess.run(["ip", "netns", "exec", netns, "ss", "-tnH", "state", "established",
                          f"( dport = :{dport} )"], check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    return [(line.split()[2], line.split()[3]) for line in out.splitlines() if line.strip()]


def records(lab: Lab, host: int, flows: list[tuple[str, str]], t: float) -> list[dict[str, Any]]:
    """A rank on ``host`` whose flows are ``flows``, and a device sending 10x their bytes."""
    h = lab.hosts[host]
    out: list[dict[str, Any]] = [{"kind": "rank", "t": t, "rank": host, "world_size": 2,
                                  "host": h.name, "pid": JOB_PID, "addrs": [h.addr]}]  # fmt: skip
    for k in range(4):
        tk = t + 0.5 * (k + 1)
        out.append({"kind": "netdev", "t": tk, "dt": 0.5, "host": "vm", "dev": h.ifname,
                    "tx_bytes": 10_000_000, "rx_bytes": 100_000})  # fmt: skip
        for src, dst in flows:
            out.append({"kind": "flow", "t": tk, "dt": 0.5, "host": "vm", "pid": JOB_PID,
                        "src": src, "dst": dst, "tx_bytes": 1_000_000 // len(flows),
                        "rx_bytes": 10_000})  # fmt: skip
    return out


def verdict(lab: Lab, host: int, state: str = "flagged") -> dict[str, Any]:
    return {"kind": "verdict", "t": time.time(), "step": 10, "rank": host, "state": state,
            "cause": "network", "score": 3.0, "host": lab.hosts[host].name,
            "evidence": {"scope": "node"}}  # fmt: skip


def remediator(lab: Lab, tmp: Path, host: int = 1, **kw: Any) -> TcRemediator:
    h = lab.hosts[host]
    cfg = RemediateConfig(devices=(DeviceRef(h.name, h.ifname, h.netns),), htb_major=MAJOR,
                          state_dir=str(tmp / "state"), **kw)  # fmt: skip
    return TcRemediator("apply", "vm", cfg)


@pytest.fixture
def traffic(lab: Lab) -> Iterator[dict[str, Any]]:
    """A paced flow from host 1 to host 0 (the job's) and one to the storage host (not)."""
    h0, h1, st = lab.hosts[0], lab.hosts[1], lab.storage
    bulk = ["-m", "fsdp_sentinel.lab.bulk"]
    quiet = {"stdout": subprocess.DEVNULL, "cgroup": False}
    procs = [
        lab.python(h0, [*bulk, "sink", "--bind", h0.addr, "--port", "5401"], **quiet),
        lab.python(st, [*bulk, "sink", "--bind", st.addr, "--port", "5402"], **quiet),
        lab.python(h1, [*bulk, "send", "--to", f"{h0.addr}:5401", "--streams", "1",
                        "--rate-mbit", "40"], **quiet),
        lab.python(h1, [*bulk, "send", "--to", f"{st.addr}:5402", "--streams", "1",
                        "--rate-mbit", "40"], **quiet),
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (ss_flows(h1.netns, 5401)
                                                   and ss_flows(h1.netns, 5402)):  # fmt: skip
            time.sleep(0.2)
        yield {"job": ss_flows(h1.netns, 5401), "other": ss_flows(h1.netns, 5402)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)


def test_tree_under_the_lab_tbf_carries_the_job_flows_and_rolls_back_exactly(
    lab: Lab, traffic: dict[str, Any], tmp_path: Path
) -> None:
    h = lab.hosts[1]
    assert traffic["job"] and traffic["other"]
    before = config_of(h.netns, h.ifname)
    rem = remediator(lab, tmp_path)
    try:
        for rec in records(lab, 1, traffic["job"], time.time()):
            rem.observe(rec)
        v = verdict(lab, 1)
        actions = rem.on_verdict(v)
        assert [a["state"] for a in actions] == ["applied"], actions
        assert v["evidence"]["foreign_tx_share"] > 0.8
        assert v["evidence"]["remediation"]["tc"] == "prioritise"
        assert (tmp_path / "state").glob("remediation-*.json")

        qd = {q["handle"]: q for q in tc(h.netns, "qdisc", "show", "dev", h.ifname)}
        assert qd["1:"]["kind"] == "tbf" and qd["5eb:"]["kind"] == "htb"
        assert qd["5eb:"]["parent"] == "1:1"  # beneath the shaper, not replacing it
        got = classes(h.netns, h.ifname)
        assert got["5eb:10"]["prio"] == "0" and got["5eb:20"]["prio"] == "1"
        assert got["5eb:10"]["rate"] == "360Mbit" and got["5eb:20"]["rate"] == "40Mbit"
        assert got["5eb:10"]["parent"] == got["5eb:20"]["parent"] == "5eb:1"
        filters = tc(h.netns, "filter", "show", "dev", h.ifname, "parent", "5eb:")
        bpf = [f for f in filters if f.get("kind") == "bpf" and "options" in f]
        assert bpf and bpf[0]["options"].get("bpf_name", "").startswith("fss_classify")

        # Counters: the job's paced 40 Mbit/s in 5eb:10, the other 40 Mbit/s in 5eb:20.
        a = class_bytes(h.netns, h.ifname)
        time.sleep(2.0)
        b = class_bytes(h.netns, h.ifname)
        job, other = b["5eb:10"] - a["5eb:10"], b["5eb:20"] - a["5eb:20"]
        assert job > 2 * 40e6 / 8 * 0.5, (job, other)  # >= half of 2 s at 40 Mbit/s
        assert other > 2 * 40e6 / 8 * 0.5, (job, other)
        assert abs(job - other) < 0.5 * max(job, other)  # both paced alike: split, not lumped
        assert rem.views() == [(h.name, h.ifname, True)]
    finally:
        done = rem.close()
    assert [x["state"] for x in done] == ["rolled_back"]
    assert config_of(h.netns, h.ifname) == before
    assert not list((tmp_path / "state").glob("remediation-*.json"))


def test_a_flow_the_map_gains_later_moves_to_the_job_class(
    lab: Lab, traffic: dict[str, Any], tmp_path: Path
) -> None:
    h = lab.hosts[1]
    rem = remediator(lab, tmp_path)
    try:
        t = time.time()
        for rec in records(lab, 1, traffic["job"], t):
            rem.observe(rec)
        assert rem.on_verdict(verdict(lab, 1))[0]["state"] == "applied"
        a = class_bytes(h.netns, h.ifname)
        time.sleep(1.0)
        b = class_bytes(h.netns, h.ifname)
        assert b["5eb:20"] - a["5eb:20"] > 1e6  # the storage flow: not the job's yet
        # The "storage" flow becomes a job flow: one flow record, one map update.
        for src, dst in traffic["other"]:
            rem.observe({"kind": "flow", "t": t + 2.5, "dt": 0.5, "host": "vm", "pid": JOB_PID,
                         "src": src, "dst": dst, "tx_bytes": 10, "rx_bytes": 0})  # fmt: skip
        rem.tick()
        c = class_bytes(h.netns, h.ifname)
        time.sleep(1.0)
        d = class_bytes(h.netns, h.ifname)
        assert d["5eb:20"] - c["5eb:20"] < 0.1 * (d["5eb:10"] - c["5eb:10"])
    finally:
        rem.close()


def test_tree_at_the_root_of_an_unshaped_device_rolls_back_to_the_kernel_default(
    lab: Lab, tmp_path: Path
) -> None:
    st = lab.storage  # the lab leaves the storage host's link unshaped (noqueue)
    before = config_of(st.netns, st.ifname)
    assert before["qdisc"][0]["kind"] == "noqueue"
    cfg = RemediateConfig(devices=(DeviceRef(st.name, st.ifname, st.netns),), htb_major=MAJOR,
                          state_dir=str(tmp_path), rate_mbit=100.0)  # fmt: skip
    rem = TcRemediator("apply", "vm", cfg)
    try:
        rem.observe({"kind": "netdev", "t": 1.0, "dt": 1.0, "host": "vm", "dev": st.ifname,
                     "tx_bytes": 10**6, "rx_bytes": 0})  # fmt: skip
        v = verdict(lab, 0) | {"host": st.name}
        assert rem.on_verdict(v)[0]["state"] == "applied"
        qd = tc(st.netns, "qdisc", "show", "dev", st.ifname)
        assert qd[0]["kind"] == "htb" and qd[0]["root"] and qd[0]["handle"] == "5eb:"
    finally:
        assert [x["state"] for x in rem.close()] == ["rolled_back"]
    assert config_of(st.netns, st.ifname) == before


def test_someone_elses_root_qdisc_and_clsact_programs_are_left_alone(
    lab: Lab, tmp_path: Path
) -> None:
    h = lab.hosts[0]
    ns, dev = h.netns, h.ifname
    sh = ["ip", "netns", "exec", ns, "tc"]
    subprocess.run([*sh, "qdisc", "add", "dev", dev, "clsact"], check=True)
    subprocess.run([*sh, "filter", "add", "dev", dev, "egress", "prio", "7", "matchall",
                    "action", "pass"], check=False)  # fmt: skip
    subprocess.run([*sh, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "77:", "bfifo",
                    "limit", "100000"], check=True)  # fmt: skip
    try:
        before = config_of(ns, dev)
        rem = remediator(lab, tmp_path, host=0)
        rem.observe({"kind": "netdev", "t": 1.0, "dt": 1.0, "host": "vm", "dev": dev,
                     "tx_bytes": 10**6, "rx_bytes": 0})  # fmt: skip
        actions = rem.on_verdict(verdict(lab, 0))
        assert [a["state"] for a in actions] == ["failed"]
        assert "bfifo 77:" in actions[0]["why"]
        assert config_of(ns, dev) == before  # nothing touched
        assert rem.close() == []
    finally:
        subprocess.run([*sh, "qdisc", "del", "dev", dev, "clsact"], check=False)
        # Put the lab's own tbf child back (a TBF re-given its own limit re-creates it).
        subprocess.run([*sh, "qdisc", "del", "dev", dev, "parent", "1:1", "handle", "77:"],
                       check=False)  # fmt: skip
        lab.set_rate((ns, dev), 400.0)


def test_a_failed_netlink_call_is_a_failed_action_with_its_errno(lab: Lab, tmp_path: Path) -> None:
    h = lab.hosts[1]
    cfg = RemediateConfig(devices=(DeviceRef(h.name, "fss-rt-nope", h.netns),),
                          state_dir=str(tmp_path))  # fmt: skip
    rem = TcRemediator("apply", "vm", cfg)
    rem.observe({"kind": "netdev", "t": 1.0, "dt": 1.0, "host": "vm", "dev": "fss-rt-nope",
                 "tx_bytes": 10**6, "rx_bytes": 0})  # fmt: skip
    (a,) = rem.on_verdict(verdict(lab, 1))
    assert a["state"] == "failed" and a["errno"] == "ENODEV" and a["dev"] == "fss-rt-nope"
    rem.close()


CRASHER = textwrap.dedent(
    """
    import json, sys, time
    from fsdp_sentinel.remediate import DeviceRef, RemediateConfig, TcRemediator
    host, ifname, netns, state, recs, v = json.loads(sys.argv[1])
    cfg = RemediateConfig(devices=(DeviceRef(host, ifname, netns),), htb_major=MAJOR,
                          state_dir=state)
    rem = TcRemediator("apply", "vm", cfg)
    for r in recs:
        rem.observe(r)
    print(json.dumps(rem.on_verdict(v)), flush=True)
    time.sleep(600)
    """
).replace("MAJOR,", f"{MAJOR},", 1)


def test_after_a_sigkill_the_next_start_restores_the_device_first(
    lab: Lab, traffic: dict[str, Any], tmp_path: Path
) -> None:
    h = lab.hosts[1]
    before = config_of(h.netns, h.ifname)
    state = tmp_path / "state"
    arg = json.dumps([h.name, h.ifname, h.netns, str(state),
                      records(lab, 1, traffic["job"], time.time()), verdict(lab, 1)])  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", CRASHER, arg], stdout=subprocess.PIPE, text=True,
                         env={**os.environ})  # fmt: skip
    try:
        line = p.stdout.readline() if p.stdout else ""
        assert json.loads(line)[0]["state"] == "applied", line
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # The kernel keeps the tree and the classifier after the crash...
    kinds = {q["handle"]: q["kind"] for q in tc(h.netns, "qdisc", "show", "dev", h.ifname)}
    assert kinds.get("5eb:") == "htb"
    assert list(state.glob("remediation-*.json"))
    a = class_bytes(h.netns, h.ifname)["5eb:10"]
    time.sleep(1.0)
    assert class_bytes(h.netns, h.ifname)["5eb:10"] > a  # ...and it still classifies
    # ...until the next start, which restores before anything else.
    rem = remediator(lab, tmp_path)
    assert [x["state"] for x in rem.pending] == ["rolled_back"]
    assert config_of(h.netns, h.ifname) == before
    assert not list(state.glob("remediation-*.json"))
    assert rem.close()[0]["state"] == "rolled_back"  # the pending record still reaches the trace


def test_major_handle_is_the_configured_one() -> None:
    assert handle(MAJOR, 0x10) == 0x05EB0010


def test_dry_run_records_the_exact_operations_and_changes_nothing(
    lab: Lab, traffic: dict[str, Any], tmp_path: Path
) -> None:
    h = lab.hosts[1]
    before = config_of(h.netns, h.ifname)
    cfg = RemediateConfig(devices=(DeviceRef(h.name, h.ifname, h.netns),), htb_major=MAJOR,
                          state_dir=str(tmp_path))  # fmt: skip
    rem = TcRemediator("dry-run", "vm", cfg)
    for rec in records(lab, 1, traffic["job"], time.time()):
        rem.observe(rec)
    (a,) = rem.on_verdict(verdict(lab, 1))
    assert a["state"] == "dry_run" and a["where"] == "under tbf 1:"
    assert a["ops"][0] == f"tc qdisc replace dev {h.ifname} parent 1:1 handle 5eb: htb default 32"
    assert len(a["ops"]) == 5
    assert config_of(h.netns, h.ifname) == before
    assert not list(tmp_path.glob("remediation-*"))
    assert [x["state"] for x in rem.close()] == ["dry_run"]  # the undo it would make


def test_the_daemon_restores_a_crashed_runs_tree_at_start_and_records_it(
    lab: Lab, traffic: dict[str, Any], tmp_path: Path
) -> None:
    """End to end: a remediator SIGKILLed with its tree in place (state in the real
    /run/fsdp-sentinel), then ``fsdp-sentinel run --remediate apply`` on that device."""
    from fsdp_sentinel.remediate.config import STATE_DIR
    from fsdp_sentinel.trace import read_trace

    h = lab.hosts[1]
    before = config_of(h.netns, h.ifname)
    arg = json.dumps([h.name, h.ifname, h.netns, STATE_DIR,
                      records(lab, 1, traffic["job"], time.time()), verdict(lab, 1)])  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", CRASHER, arg], stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(p.stdout.readline() if p.stdout else "")[0]["state"] == "applied"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert config_of(h.netns, h.ifname) != before
    trace_path, log = tmp_path / "t.jsonl", tmp_path / "daemon.log"
    with open(log, "w") as out:
        d = subprocess.Popen([sys.executable, "-m", "fsdp_sentinel", "run", "--no-probes",
                              "--metrics-addr", "off", "--socket", str(tmp_path / "s.sock"),
                              "--trace-out", str(trace_path), "--remediate", "apply",
                              "--remediate-dev", f"{h.name}={h.netns}/{h.ifname}",
                              "--interval", "0.2"], stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "ready" not in log.read_text() and time.monotonic() < deadline:
            assert d.poll() is None, log.read_text()
            time.sleep(0.1)
        assert config_of(h.netns, h.ifname) == before  # restored before it was ready
        time.sleep(0.5)  # a tick or two: the restore's record reaches the trace
    finally:
        d.send_signal(signal.SIGINT)
        assert d.wait(timeout=30) == 0, log.read_text()
    actions = [r for r in read_trace(trace_path) if r["kind"] == "action"]
    assert [(a["what"], a["state"]) for a in actions] == [("restore", "rolled_back")]
    assert actions[0]["dev"] == h.ifname and "gone" in actions[0]["why"]
    assert not list(Path(STATE_DIR).glob(f"remediation-{h.netns}+*"))
