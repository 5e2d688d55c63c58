"""The remediator's pure parts: contention figures, policy, hysteresis, tc plan, state file."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_sentinel import trace
from fsdp_sentinel.pipeline import Pipeline
from fsdp_sentinel.remediate import statefile
from fsdp_sentinel.remediate.config import DeviceRef, RemediateConfig, parse_device
from fsdp_sentinel.remediate.contention import Contention, ContentionTracker
from fsdp_sentinel.remediate.plan import Found, Refused, TbfParams, handle, plan
from fsdp_sentinel.remediate.policy import EGRESS, INGRESS, NONE, Hysteresis, assess

CFG = RemediateConfig()


def feed(tracker: ContentionTracker, *, dev_tx: int, job_tx: int, dev_rx: int = 0,
         job_rx: int = 0, n: int = 4) -> None:  # fmt: skip
    tracker.observe({"kind": "rank", "t": 0.0, "rank": 1, "world_size": 2, "host": "h1",
                     "pid": 7, "addrs": ["10.0.0.2"]})  # fmt: skip
    for k in range(n):
        t = 1.0 + 0.5 * k
        tracker.observe({"kind": "netdev", "t": t, "dt": 0.5, "host": "vm", "dev": "eth1",
                         "tx_bytes": dev_tx, "rx_bytes": dev_rx})  # fmt: skip
        tracker.observe({"kind": "flow", "t": t, "dt": 0.5, "host": "vm", "pid": 7,
                         "src": "10.0.0.2:5000", "dst": "10.0.0.1:6000", "tx_bytes": job_tx,
                         "rx_bytes": job_rx})  # fmt: skip


def test_foreign_share_is_device_bytes_the_job_did_not_send() -> None:
    tr = ContentionTracker(window_s=2.0)
    feed(tr, dev_tx=1000, job_tx=250, dev_rx=100, job_rx=95)
    c = tr.contention("h1", "eth1")
    assert c.foreign_tx_share == pytest.approx(0.75)
    assert c.foreign_rx_share == pytest.approx(0.05)
    assert c.seconds == pytest.approx(2.0)
    assert tr.flows("h1") == [("10.0.0.2:5000", "10.0.0.1:6000")]
    assert tr.contention("h9", "eth1").job_tx_bytes == 0  # another host: none of its flows


def test_window_drops_old_records_and_closed_flows_leave_the_map() -> None:
    tr = ContentionTracker(window_s=1.0)
    feed(tr, dev_tx=1000, job_tx=1000, n=8)  # t = 1.0 .. 4.5
    assert tr.contention("h1", "eth1").dev_tx_bytes == 2000  # 4.0 and 4.5 only
    tr.observe({"kind": "conn", "t": 5.0, "host": "vm", "pid": 7, "src": "10.0.0.2:5000",
                "dst": "10.0.0.1:6000", "what": "close"})  # fmt: skip
    assert tr.flows("h1") == []


def test_a_flow_of_a_process_that_is_not_a_rank_is_foreign() -> None:
    tr = ContentionTracker()
    feed(tr, dev_tx=1000, job_tx=1000)
    tr.observe({"kind": "flow", "t": 3.0, "dt": 0.5, "host": "vm", "pid": 99, "src": "10.0.0.2:1",
                "dst": "10.0.0.9:2", "tx_bytes": 10**6, "rx_bytes": 0})  # fmt: skip
    assert tr.flows("h1") == [("10.0.0.2:5000", "10.0.0.1:6000")]


V = {"kind": "verdict", "rank": 1, "host": "h1", "cause": "network", "state": "flagged"}


@pytest.mark.parametrize(
    "c,managed,act,where,words",
    [
        (Contention(1, 1000, 100, 300, 95), True, True, EGRESS, "not the job's"),
        (Contention(1, 1000, 100, 300, 95), False, False, EGRESS, "not managed"),
        (Contention(1, 1000, 1000, 950, 200), True, False, INGRESS, "ingress, not egress"),
        (Contention(1, 1000, 1000, 960, 950), True, False, NONE, "no competing traffic"),
        (Contention(1, 0, 0, 0, 0), True, False, NONE, "no byte counts"),
        (None, True, False, NONE, "no byte counts"),
    ],
)
def test_assess_acts_only_on_contended_egress_and_says_why(c, managed, act, where, words) -> None:
    a = assess(V, c, managed, CFG)
    assert (a.act, a.contended) == (act, where)
    assert words in a.why
    assert a.evidence()["tc"] == ("prioritise" if act else "left alone")


def test_hysteresis_acts_once_holds_while_flagged_or_contended_then_undoes() -> None:
    h = Hysteresis(clean_windows=3, min_foreign_share=0.25)
    busy, quiet = Contention(1, 1000, 0, 100, 0), Contention(1, 1000, 0, 990, 0)
    assert h.on_verdict(1, True, True) is True
    assert h.on_verdict(1, True, True) is False  # already in place: no churn
    assert [h.on_window(quiet) for _ in range(5)] == [False] * 5  # still flagged
    h.on_verdict(1, False, False)
    assert [h.on_window(busy) for _ in range(5)] == [False] * 5  # the neighbour is still there
    assert [h.on_window(quiet) for _ in range(3)] == [False, False, True]
    assert not h.active
    assert h.on_window(quiet) is False


def test_hysteresis_a_new_flag_resets_the_clean_count() -> None:
    h = Hysteresis(clean_windows=2)
    quiet = Contention(1, 1000, 0, 990, 0)
    h.on_verdict(1, True, True)
    h.on_verdict(1, False, False)
    assert h.on_window(quiet) is False
    h.on_verdict(1, True, False)
    h.on_verdict(1, False, False)
    assert h.on_window(quiet) is False
    assert h.on_window(quiet) is True


def test_hysteresis_does_not_act_when_assess_says_no() -> None:
    h = Hysteresis()
    assert h.on_verdict(1, True, False) is False and not h.active


TBF = TbfParams(handle(1), rate=125_000_000, buffer=25000, limit=500000, mtu=0)


def test_plan_under_a_tbf_hangs_beneath_it_and_undoes_by_reissuing_its_own_parameters() -> None:
    p = plan(Found("tbf", handle(1), TBF), 1e9, major=0x5EB, job_share=0.9, prog_name="f")
    lines = [o.tc("eth1") for o in p.ops]
    assert lines[0] == "tc qdisc replace dev eth1 parent 1:1 handle 5eb: htb default 32"
    assert "classid 5eb:10 htb rate 900000kbit ceil 1000000kbit prio 0" in lines[2]
    assert "classid 5eb:20 htb rate 100000kbit ceil 1000000kbit prio 1" in lines[3]
    assert lines[4].startswith("tc filter replace dev eth1 parent 5eb: prio 1 handle 1 bpf")
    assert [o.command for o in p.undo] == ["del", "change"]
    assert dict(p.undo[1].params) == {"rate": 125_000_000, "buffer": 25000, "limit": 500000,
                                      "mtu": 0}  # fmt: skip
    assert p.where == "under tbf 1:"


def test_plan_at_a_default_root_undoes_by_deleting_its_own_qdisc_only() -> None:
    p = plan(Found("noqueue", 0), 1e8, major=0x5EB, job_share=0.8, prog_name="f")
    assert p.ops[0].tc("e") == "tc qdisc replace dev e root handle 5eb: htb default 32"
    assert [(o.command, o.handle) for o in p.undo] == [("del", handle(0x5EB))]


@pytest.mark.parametrize(
    "found,words",
    [
        (Found("htb", handle(1)), "someone's htb 1:"),
        (Found("tbf", handle(1), TBF, ("bfifo", handle(0x77))), "someone's bfifo 77:"),
        (Found("tbf", handle(1), TbfParams(handle(1), 1, 1, 1, 1, peak=5)), "peak rate"),
    ],
)
def test_plan_refuses_what_is_not_its_to_replace(found: Found, words: str) -> None:
    with pytest.raises(Refused, match=words):
        plan(found, 1e9, major=0x5EB, job_share=0.9, prog_name="f")


def test_plan_converges_on_its_own_tree() -> None:
    ours_root = Found("htb", handle(0x5EB), ours=True)
    assert plan(ours_root, 1e9, major=0x5EB, job_share=0.9, prog_name="f").where == "root"
    ours_child = Found("tbf", handle(1), TBF, ("htb", handle(0x5EB)), ours=True)
    assert "tbf" in plan(ours_child, 1e9, major=0x5EB, job_share=0.9, prog_name="f").where


@pytest.mark.parametrize(
    "spec,want",
    [
        ("eth0", DeviceRef("me", "eth0")),
        ("h2=ns2/veth2", DeviceRef("h2", "veth2", "ns2")),
        ("ns/eth1", DeviceRef("me", "eth1", "ns")),
    ],
)
def test_parse_device(spec: str, want: DeviceRef) -> None:
    assert parse_device(spec, "me") == want


@pytest.mark.parametrize("spec", ["", "h=", "/eth0", "a/b/c", "h="])
def test_parse_device_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_device(spec, "me")


def test_state_file_round_trips_and_is_removed(tmp_path) -> None:
    dev = DeviceRef("h1", "veth1", "ns1")
    p = plan(Found("tbf", handle(1), TBF), 1e9, major=0x5EB, job_share=0.9, prog_name="f")
    path = statefile.save(str(tmp_path), dev, 0x5EB, p.undo, {"root": "tbf"})
    assert path.parent == tmp_path and path.name.startswith("remediation-")
    (saved,) = statefile.load_all(str(tmp_path))
    assert saved.device == dev and saved.undo == p.undo and saved.major == 0x5EB
    statefile.remove(str(tmp_path), dev)
    assert statefile.load_all(str(tmp_path)) == []


def test_a_corrupt_state_file_is_an_error_naming_it(tmp_path) -> None:
    (tmp_path / "remediation-x.json").write_text("{nope")
    with pytest.raises(ValueError, match="remediation-x.json"):
        statefile.load_all(str(tmp_path))


# Real lab captures (tests/traces): the same records the daemon's remediator sees.
TRACES = Path(__file__).parent / "traces"
CAPTURES = {
    "lab-noisy-neighbor": (True, EGRESS),  # bulk upload from the host: tc can help
    "lab-slow-link": (False, NONE),  # slow, nothing competing: it cannot
    "lab-packet-loss": (False, NONE),
}


@pytest.mark.parametrize("name", sorted(CAPTURES))
def test_captured_network_faults_get_the_right_remediation_decision(name: str) -> None:
    tracker, pipe, seen = ContentionTracker(CFG.window_s), Pipeline(), []
    for rec in trace.read_trace(TRACES / f"{name}.jsonl.zst"):
        if rec["kind"] in ("verdict", "action"):
            continue
        tracker.observe(rec)
        for v in pipe.feed(rec):
            if v["cause"] == "network" and v["state"] == "flagged":
                # The lab names a host's own link <host>e (fsdp_sentinel.lab.config).
                c = tracker.contention(v["host"], v["host"] + "e")
                seen.append((assess(v, c, True, CFG), c))
    assert seen, "the capture has a network verdict"
    a, c = seen[0]
    assert (a.act, a.contended) == CAPTURES[name], (a, c.evidence())
    share = c.foreign_tx_share
    assert share is not None and (share > 0.8 if a.act else share < 0.15)


def test_summary_says_what_tc_did_and_the_step_time_after_it() -> None:
    from fsdp_sentinel.demo.outcome import remediation_lines
    from fsdp_sentinel.report.model import ReportData, StepRow

    def row(step: int, start: float, secs: float) -> StepRow:
        return StepRow(rank=0, step=step, start=start, end=start + secs, wait=0.0, colls=0)

    data = ReportData(
        steps=[row(0, 0.0, 2.0), row(1, 2.0, 2.0), row(2, 4.5, 0.5), row(3, 5.0, 0.5)],
        faults=[{"kind": "fault", "t": 0.0, "end": 10.0, "host": "h2", "rank": 2,
                 "what": "noisy_neighbor"}],
        actions=[{"kind": "action", "t": 4.2, "host": "h2", "dev": "h2e", "what": "prioritise",
                  "state": "applied", "step": 1},
                 {"kind": "action", "t": 11.0, "host": "h2", "dev": "h2e", "what": "restore",
                  "state": "rolled_back", "why": "clean for 3 windows"}],
    )  # fmt: skip
    lines = remediation_lines(data)
    assert lines[0].startswith("tc        prioritised the job's flows on h2 h2e at step 1")
    assert "2.00 s before it, 0.50 s after it" in lines[1]
    assert "restored h2 h2e (clean for 3 windows)" in lines[2]
    assert all(len(line) < 80 for line in lines)


def test_live_view_shows_where_tc_prioritises() -> None:
    from fsdp_sentinel.live import render_text
    from fsdp_sentinel.snapshot import RemediationView, Snapshot

    snap = Snapshot(remediation=(RemediationView("h2", "h2e", True),
                                 RemediationView("h1", "h1e", False)))  # fmt: skip
    text = render_text(snap)
    assert "prioritising the job's flows on h2 h2e" in text and "h1e" not in text
    assert Snapshot.from_json(snap.to_json()) == snap
