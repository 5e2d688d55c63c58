"""Real probes on traffic between two network namespaces (fss-pb-a ->
fss-pb-b over a veth, tbf-shaped for the RTT test), checked against the
sender's count, `ss -tin` and /proc/net/dev read inside each namespace."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator

import pytest
from probes_util import (
    ADDR_A,
    ADDR_B,
    DEV_A,
    DEV_B,
    NS_A,
    NS_B,
    Peer,
    lossy,
    nstat,
    proc_net_dev,
    release,
    shaped,
    ss_find,
    two_namespaces,
)

from fsdp_sentinel.probes.loader import DIAG_FULL_EVERY, ProbeConfig, ProbeSet

pytestmark = [pytest.mark.kernel, pytest.mark.root, pytest.mark.lab]

N = 23 * 1024 * 1024 + 7
PORT = 47001
FRAME = 1514


@pytest.fixture(scope="module")
def lab() -> Iterator[ProbeSet]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    with two_namespaces():
        ps = ProbeSet(ProbeConfig(families=("tcp", "netdev")))
        try:
            ps.start()
            yield ps
        finally:
            ps.close()


def _dev(recs: list[dict], dev: str) -> tuple[int, int]:
    rs = [r for r in recs if r["kind"] == "netdev" and r["dev"] == dev]
    return sum(r["rx_bytes"] for r in rs), sum(r["tx_bytes"] for r in rs)


def test_transfer_across_namespaces(lab: ProbeSet) -> None:
    rcv = Peer("recv", ADDR_B, str(PORT), str(N), netns=NS_B)
    snd = None
    try:
        rcv.expect("listening")
        lab.poll()
        before = {DEV_A: proc_net_dev(DEV_A, NS_A), DEV_B: proc_net_dev(DEV_B, NS_B)}
        missed_before = lab.missed_events()
        recs: list[dict] = []
        snd = Peer("send", ADDR_B, str(PORT), str(N), netns=NS_A)
        cport = snd.expect("port")
        snd.expect("sent")
        recs += lab.poll()
        assert rcv.expect("got") == str(N)
        client, server = f"{ADDR_A}:{cport}", f"{ADDR_B}:{PORT}"
        ss_c, ss_s = ss_find(client, NS_A), ss_find(server, NS_B)
        # Until everything is acked a (spurious) retransmit may still leave
        # after the last poll; wait for that so both windows close together.
        deadline = time.monotonic() + 10
        while ss_c.num("bytes_acked") <= N and time.monotonic() < deadline:
            time.sleep(0.05)
            ss_c = ss_find(client, NS_A)
        time.sleep(0.05)
        recs += lab.poll()
        after = {DEV_A: proc_net_dev(DEV_A, NS_A), DEV_B: proc_net_dev(DEV_B, NS_B)}
    finally:
        release(snd, rcv)
    assert snd is not None
    tx = sum(r["tx_bytes"] for r in recs if r["kind"] == "flow" and r["src"] == client)
    rx = sum(r["rx_bytes"] for r in recs if r["kind"] == "flow" and r["src"] == server)
    assert tx == N and rx == N
    assert abs(tx - ss_c.num("bytes_acked")) <= 0.005 * N
    assert abs(rx - ss_s.num("bytes_received")) <= 0.005 * N
    pids = {r["pid"] for r in recs if r["kind"] == "flow" and r["src"] == client}
    assert pids == {snd.pid}
    missed = lab.missed_events()
    skipped = {k: missed.get(k, 0) - missed_before.get(k, 0) for k in missed}
    # Device counters are the driver's own, read over netlink: exact, save
    # for what moved between the last poll and the /proc read (a window
    # update on a direction that carries only ACKs: one frame).
    for dev in (DEV_A, DEV_B):
        want_rx = after[dev][0] - before[dev][0]
        want_tx = after[dev][1] - before[dev][1]
        got_rx, got_tx = _dev(recs, dev)
        why = (dev, got_tx, want_tx, got_rx, want_rx)
        assert want_tx - FRAME <= got_tx <= want_tx, why
        assert want_rx - FRAME <= got_rx <= want_rx, why
    # Reading the maps must not make the kernel skip any program run.
    assert all(v == 0 for v in skipped.values()), skipped


def test_srtt_matches_ss_on_shaped_link(lab: ProbeSet) -> None:
    with shaped(DEV_A, NS_A, "200mbit"):
        _srtt_vs_ss(lab)


def _srtt_vs_ss(lab: ProbeSet) -> None:
    sink = Peer("sink", ADDR_B, str(PORT + 1), netns=NS_B)
    sink.expect("listening")
    src = Peer("stream", ADDR_B, str(PORT + 1), "--cubic", netns=NS_A)
    ratios = []
    try:
        cport = src.expect("port")
        client = f"{ADDR_A}:{cport}"
        time.sleep(1.0)  # past slow start
        lab.poll()
        for _ in range(6):
            time.sleep(0.3)
            _, ratio = _srtt_poll(lab, client)
            assert ratio is not None, "a poll of a busy stream without its srtt"
            ratios.append(ratio)
    finally:
        src.close()
        sink.close()
    assert abs(statistics.median(ratios) - 1.0) <= 0.2, ratios


def _srtt_poll(ps: ProbeSet, client: str) -> tuple[list[dict], float | None]:
    """One poll, bracketed by `ss -ti` of ``client`` just before and just after:
    its records, and its srtt for ``client`` over the bracket (1.0 inside it,
    else over the nearer end; None without a figure). srtt moves by tens of
    percent a few ms apart on a lossy link, and ``ss`` takes ~20 ms to run:
    the bracket is what "at the same instant" can mean."""
    lo = ss_find(client, NS_A).rtt_ms * 1000
    recs = ps.poll()
    hi = ss_find(client, NS_A).rtt_ms * 1000
    flow = [r for r in recs if r["kind"] == "flow" and r["src"] == client]
    if not flow or "srtt_us" not in flow[0]:
        return recs, None
    got, low, high = flow[0]["srtt_us"], min(lo, hi), max(lo, hi)
    return recs, 1.0 if low <= got <= high else got / (low if got < low else high)


def _bracketed_poll(lab: ProbeSet) -> tuple[list[dict], dict, dict]:
    """/proc/net/dev of both ends read just before and just after a poll:
    the poll's device counters lie between the two readings."""
    devs = ((DEV_A, NS_A), (DEV_B, NS_B))
    lo = {dev: proc_net_dev(dev, ns) for dev, ns in devs}
    recs = lab.poll()
    hi = {dev: proc_net_dev(dev, ns) for dev, ns in devs}
    return recs, lo, hi


@pytest.fixture(scope="module")
def lossy_run(lab: ProbeSet) -> dict:
    """One transfer over a shaped, lossy link, with the kernel's own figures
    read beside the probes' (several tests assert on it)."""
    # 100 Mbit out of a, 1 % of what arrives at b dropped: a retransmits.
    with shaped(DEV_A, NS_A, "100mbit"), lossy(DEV_B, NS_B, 0.01):
        rcv = Peer("recv", ADDR_B, str(PORT + 2), str(2 * N), netns=NS_B)
        snd = None
        try:
            rcv.expect("listening")
            recs0, lo0, hi0 = _bracketed_poll(lab)
            missed_before = lab.missed_events()
            retrans_before = nstat("TcpRetransSegs", NS_A)
            snd = Peer("send", ADDR_B, str(PORT + 2), str(2 * N), "--cubic", netns=NS_A)
            cport = snd.expect("port")
            client = f"{ADDR_A}:{cport}"
            recs: list[dict] = []
            ratios = []
            time.sleep(0.5)  # past slow start
            for _ in range(5):
                time.sleep(0.25)
                got, ratio = _srtt_poll(lab, client)
                recs += got
                if ratio is not None:
                    ratios.append(ratio)
            _wait_delivered(snd, rcv, client)
            time.sleep(0.3)  # a last retransmit's tracepoint lands before the poll
            got, lo1, hi1 = _bracketed_poll(lab)
            recs += got
            retrans_after = nstat("TcpRetransSegs", NS_A)
            skipped = {k: v - missed_before.get(k, 0) for k, v in lab.missed_events().items()}
        finally:
            release(snd, rcv)
    return {
        "recs": recs,
        "client": client,
        "ratios": ratios,
        "want_retrans": retrans_after - retrans_before,
        "proc": (lo0, hi0, lo1, hi1),
        "skipped": skipped,
    }


def _wait_delivered(snd: Peer, rcv: Peer, client: str) -> None:
    """Until the sender is done, the receiver has all ``2 * N`` bytes, and every
    byte is acked (the last retransmits and ACKs are in)."""
    snd.expect("sent")
    assert rcv.expect("got") == str(2 * N)
    deadline = time.monotonic() + 10
    while ss_find(client, NS_A).num("bytes_acked") <= 2 * N:
        assert time.monotonic() < deadline, "transfer never fully acked"
        time.sleep(0.05)


def _retrans(run: dict) -> int:
    return sum(
        r["retrans"] for r in run["recs"] if r["kind"] == "flow" and r["src"] == run["client"]
    )


def test_lossy_link_srtt_matches_ss_at_the_same_instant(lossy_run: dict) -> None:
    ratios = lossy_run["ratios"]
    assert len(ratios) >= 4, ratios
    assert abs(statistics.median(ratios) - 1.0) <= 0.10, ratios


def test_lossy_link_devices_and_no_missed_events(lossy_run: dict) -> None:
    recs = lossy_run["recs"]
    lo0, hi0, lo1, hi1 = lossy_run["proc"]
    for dev in (DEV_A, DEV_B):
        for i, field in ((0, "rx_bytes"), (1, "tx_bytes")):
            got_b = sum(r[field] for r in recs if r["kind"] == "netdev" and r["dev"] == dev)
            low, high = lo1[dev][i] - hi0[dev][i], hi1[dev][i] - lo0[dev][i]
            assert low <= got_b <= high, (dev, field, low, got_b, high)
    assert all(v == 0 for v in lossy_run["skipped"].values()), lossy_run["skipped"]
    # Every retransmit event is one the kernel counted too.
    assert lossy_run["want_retrans"] > 0, "the lossy link lost nothing: the oracle proves nothing"
    assert 0 < _retrans(lossy_run) <= lossy_run["want_retrans"]


def test_lossy_link_retransmits_equal_tcpretranssegs(lossy_run: dict) -> None:
    assert _retrans(lossy_run) == lossy_run["want_retrans"]


def test_connections_closed_between_polls_keep_their_retransmits(lab: ProbeSet) -> None:
    """20 connections over the lossy link open, retransmit and close between
    two polls: sock_diag never sees them alive, the destroy broadcast hands
    out their final tcp_info, and the retransmits equal TcpRetransSegs."""
    k, size = 20, 200_000
    with shaped(DEV_A, NS_A, "100mbit"), lossy(DEV_B, NS_B, 0.01):
        srv = Peer("sinks", ADDR_B, str(PORT + 3), str(k), netns=NS_B)
        cl = None
        try:
            srv.expect("listening")
            lab.poll()
            before = nstat("TcpRetransSegs", NS_A)
            cl = Peer("short", ADDR_B, str(PORT + 3), str(k), str(size), netns=NS_A)
            cl.expect("done")
            srv.expect("done")
            time.sleep(0.3)  # the kernel frees closed sockets from a work queue
            want = nstat("TcpRetransSegs", NS_A) - before
            recs = lab.poll()
            health = lab.stats()  # says why, should a count below fall short
        finally:
            for p in (cl, srv):
                if p:
                    p.close()
    server = f"{ADDR_B}:{PORT + 3}"
    flows = [r for r in recs if r["kind"] == "flow" and r["dst"] == server]
    assert want > 0, "the lossy link lost nothing: the oracle proves nothing"
    assert sum(r["retrans"] for r in flows) == want, (flows, health)
    assert all("srtt_us" not in r for r in flows)  # closed: no path figures
    assert sorted(r["tx_bytes"] for r in flows) == [size + i for i in range(k)], (flows, health)


def test_with_the_pid_filter_the_job_s_sockets_are_read_by_lookup_and_still_match(
    lab: ProbeSet,
) -> None:
    """With the pid filter (the daemon's mode), polls between whole sock_diag
    reads read the registered process's sockets by exact lookups: the
    transfer's srtt still tracks `ss -ti` and its retransmits still equal
    TcpRetransSegs, and most reads were lookups, not dumps."""
    ps = ProbeSet(ProbeConfig(families=("tcp",), pid_filter=True))
    ps.start()
    with shaped(DEV_A, NS_A, "100mbit"), lossy(DEV_B, NS_B, 0.01):
        rcv = Peer("recv", ADDR_B, str(PORT + 4), str(2 * N), netns=NS_B)
        snd = None
        try:
            rcv.expect("listening")
            before = nstat("TcpRetransSegs", NS_A)
            snd = Peer("send", ADDR_B, str(PORT + 4), str(2 * N), "--cubic", netns=NS_A)
            ps.register_pid(snd.pid)
            client = f"{ADDR_A}:{snd.expect('port')}"
            recs: list[dict] = []
            ratios = []
            polls = 0
            while ss_find(client, NS_A).num("bytes_acked") <= 2 * N:
                assert polls < 200, "transfer never fully acked"
                time.sleep(0.25)
                got, ratio = _srtt_poll(ps, client)
                polls += 1
                recs += got
                if ratio is not None:
                    ratios.append(ratio)
            snd.expect("sent")
            time.sleep(0.3)  # a last retransmit's tracepoint lands before the poll
            recs += ps.poll()
            want = nstat("TcpRetransSegs", NS_A) - before
            diag = ps.stats()["sock_diag"]
        finally:
            release(snd, rcv)
            ps.close()
    got_retrans = sum(r["retrans"] for r in recs if r["kind"] == "flow" and r["src"] == client)
    assert want > 0, "the lossy link lost nothing: the oracle proves nothing"
    assert got_retrans == want, (got_retrans, want, diag)
    # Whole reads: the first poll, one a socket waited for its name, then one
    # every DIAG_FULL_EVERY polls; every other poll looked the sockets up.
    assert diag["lookup"] >= polls - 2 - polls // DIAG_FULL_EVERY, (diag, polls)
    assert diag["lookups"] >= diag["lookup"] and diag["lookup_fallbacks"] == 0, diag
    assert len(ratios) >= 4, ratios
    assert abs(statistics.median(ratios) - 1.0) <= 0.10, ratios


def test_retransmits_of_data_that_arrived_are_counted_as_d_sacked(lab: ProbeSet) -> None:
    """ACK blackouts: twice, every packet arriving at a (b's ACKs) is dropped for
    0.4 s while a sends to b. b has all the data, yet a's timers resend it; b
    reports the duplicates that reach it once ACKs flow again (D-SACK). The
    flows' `dsack_dups` equal the kernel's own counts, TcpExtTCPDSACKRecvSegs
    and the socket's `dsack_dups` in `ss -tin`, and their retransmits equal
    TcpRetransSegs: a late ACK is told apart from a lost packet."""
    with shaped(DEV_A, NS_A, "100mbit"):
        rcv = Peer("recv", ADDR_B, str(PORT + 5), str(2 * N), netns=NS_B)
        snd = None
        try:
            rcv.expect("listening")
            lab.poll()
            before = {c: nstat(c, NS_A) for c in ("TcpRetransSegs", "TcpExtTCPDSACKRecvSegs")}
            snd = Peer("send", ADDR_B, str(PORT + 5), str(2 * N), "--cubic", netns=NS_A)
            client = f"{ADDR_A}:{snd.expect('port')}"
            recs: list[dict] = []
            for _ in range(2):
                time.sleep(0.5)
                with lossy(DEV_A, NS_A, 1.0):
                    time.sleep(0.4)
                recs += lab.poll()
            _wait_delivered(snd, rcv, client)
            seen_by_ss = ss_find(client, NS_A).num("dsack_dups")
            recs += lab.poll()
            after = {c: nstat(c, NS_A) for c in before}
        finally:
            release(snd, rcv)
    mine = [r for r in recs if r["kind"] == "flow" and r["src"] == client]
    retrans = sum(r["retrans"] for r in mine)
    dsack = sum(r.get("dsack_dups", 0) for r in mine)
    assert dsack > 0, "nothing was D-SACKed: the oracle proves nothing"
    assert (
        dsack == seen_by_ss == after["TcpExtTCPDSACKRecvSegs"] - before["TcpExtTCPDSACKRecvSegs"]
    ), (mine, seen_by_ss, before, after)
    assert retrans == after["TcpRetransSegs"] - before["TcpRetransSegs"]
    assert dsack <= retrans
