"""The probes' user side without a kernel: record building, tracefs
detection, program assembly, symbol versions, library scan, CLI table."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import pytest

from fsdp_sentinel import trace
from fsdp_sentinel.probes import flows_cmd
from fsdp_sentinel.probes import records as R
from fsdp_sentinel.probes.devstats import (
    IFLA_IFNAME,
    IFLA_STATS64,
    STATS64_FIELDS,
    deltas,
    parse_link,
    parse_qdisc,
    sample_link,
)
from fsdp_sentinel.probes.libscan import LibraryScanner
from fsdp_sentinel.probes.loader import (
    ProbeConfig,
    ProbePermissionError,
    ProbeSet,
    check_privileges,
)
from fsdp_sentinel.probes.program import TRACEPOINTS, build_program
from fsdp_sentinel.probes.tracefs import check_tracepoint, field_names
from fsdp_sentinel.probes.uprobes import resolve_symbol

SEND_FORMAT = """name: sock_send_length
ID: 1670
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:void * sk;\toffset:8;\tsize:8;\tsigned:0;
\tfield:__u16 family;\toffset:16;\tsize:2;\tsigned:0;
\tfield:__u16 protocol;\toffset:18;\tsize:2;\tsigned:0;
\tfield:int ret;\toffset:20;\tsize:4;\tsigned:1;
\tfield:int flags;\toffset:24;\tsize:4;\tsigned:1;
\tfield:__u8 saddr[28];\toffset:28;\tsize:28;\tsigned:0;
\tfield:__data_loc char[] name;\toffset:56;\tsize:4;\tsigned:0;
"""


def _fake_tracefs(root: Path, events: dict[str, str]) -> Path:
    for name, text in events.items():
        cat, ev = name.split(":")
        d = root / "events" / cat / ev
        d.mkdir(parents=True)
        (d / "format").write_text(text)
    return root


def test_field_names_from_format_file() -> None:
    names = field_names(SEND_FORMAT)
    assert {"sk", "family", "protocol", "ret", "flags", "saddr", "name"} <= names


def test_missing_tracepoint_and_field_are_reported(tmp_path: Path) -> None:
    root = _fake_tracefs(tmp_path, {"sock:sock_send_length": SEND_FORMAT})
    assert check_tracepoint(root, "sock:sock_send_length", ("sk", "ret")).reason is None
    why = check_tracepoint(root, "sock:sock_send_length", ("sk", "srtt")).reason
    assert why == "tracepoint sock:sock_send_length lacks field(s) srtt"
    assert "no tracepoint tcp:tcp_probe" in str(check_tracepoint(root, "tcp:tcp_probe", ()).reason)
    assert "not mounted" in str(check_tracepoint(None, "tcp:tcp_probe", ()).reason)


def test_program_compiles_in_only_what_exists(tmp_path: Path) -> None:
    root = _fake_tracefs(tmp_path, {"sock:sock_send_length": SEND_FORMAT})
    prog = build_program(root, families=("tcp", "netdev"), filter_pids=True)
    assert [tp.name for tp in prog.tracepoints] == ["sock:sock_send_length"]
    assert "#define SENTINEL_HAVE_sock__sock_send_length 1" in prog.text
    assert "#define SENTINEL_HAVE_tcp__tcp_probe" not in prog.text
    assert "#define SENTINEL_FILTER_PIDS 1" in prog.text
    assert {m.name for m in prog.missing} == {
        tp.name
        for tp in TRACEPOINTS
        if tp.family in ("tcp", "netdev") and tp.name != "sock:sock_send_length"
    }
    assert '#include "sentinel.h"' not in prog.text  # inlined once
    assert "struct flow_key" in prog.text


def test_program_text_needs_no_root(tmp_path: Path) -> None:
    ps = ProbeSet(ProbeConfig(tracefs_root=str(tmp_path), families=("nccl",)))
    text = ps.program_text()
    assert "int nccl_all_gather(struct pt_regs *ctx)" in text
    assert "TRACEPOINT_PROBE" not in text


def test_config_rejects_bad_interval_and_family() -> None:
    ProbeConfig(interval=0.1)
    with pytest.raises(ValueError):
        ProbeConfig(interval=0.05)
    with pytest.raises(ValueError):
        ProbeConfig(families=("tcp", "udp"))
    with pytest.raises(ValueError):
        ProbeConfig(hot_bits=0)  # the slot index shifts by 64 - bits


def test_hot_slot_count_reaches_the_program(tmp_path: Path) -> None:
    text = ProbeSet(ProbeConfig(tracefs_root=str(tmp_path), hot_bits=5)).program_text()
    assert "#define SENTINEL_HOT_BITS 5" in text
    assert (
        'BPF_F_TABLE("array", u32, struct hot_slot, hot, SENTINEL_HOT_SLOTS, BPF_F_MMAPABLE)'
        in text
    )


def test_tuples_render_as_ip_port() -> None:
    v4 = R.make_tuple(2, 5000, 80, socket.inet_aton("198.18.0.1"), socket.inet_aton("198.18.0.2"))
    assert (v4.src, v4.dst) == ("198.18.0.1:5000", "198.18.0.2:80")
    v6 = R.make_tuple(10, 1, 2, socket.inet_pton(socket.AF_INET6, "2001:db8::1"), bytes(16))
    assert (v6.src, v6.dst) == ("[2001:db8::1]:1", "[::]:2")


def test_flow_records_are_trace_v1() -> None:
    tup = R.make_tuple(2, 1, 2, bytes(4), bytes(4))
    figs = {
        (7, tup): R.FlowFigures(tx_bytes=10, rx_bytes=3, srtt_us=250, cwnd=10),
        (8, tup): R.FlowFigures(),  # nothing moved: no record
    }
    recs = R.flow_records(figs, t=100.0, dt=1.0, host="h")
    assert len(recs) == 1
    assert trace.validate(recs[0]) is None
    assert recs[0]["srtt_us"] == 250 and recs[0]["pid"] == 7 and "snd_wnd" not in recs[0]


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + bytes(-n % 4)


def _nlmsg(kind: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, 2, 1, 0) + body


def _link_msg(idx: int, name: str, **stats: int) -> bytes:
    st = struct.pack("=23Q", *[stats.get(f, 0) for f in STATS64_FIELDS], *[99] * 15)
    body = struct.pack("=BxHiII", 0, 1, idx, 0, 0)
    body += _attr(IFLA_IFNAME, name.encode() + b"\0") + _attr(4, b"\xff" * 4)
    return _nlmsg(16, body + _attr(IFLA_STATS64, st))


def _qdisc_msg(idx: int, drops: int, backlog: int, qlen: int) -> bytes:
    queue = _attr(3, struct.pack("=IIIII", qlen, backlog, drops, 7, 8))
    stats2 = _attr(1, bytes(16)) + queue  # TCA_STATS_BASIC first, as the kernel sends it
    body = struct.pack("=BxxxiIII", 0, idx, 0x10000, 0xFFFFFFFF, 1)
    return _nlmsg(36, body + _attr(1, b"tbf\0") + _attr(0x8000 | 7, stats2))


def test_rtnetlink_dump_messages_decode_to_device_samples() -> None:
    from fsdp_sentinel.probes.sockdiag import nl_messages

    data = _link_msg(3, "eth0", tx_bytes=1000, rx_bytes=50, rx_dropped=4)
    data += _qdisc_msg(3, 2, 300, 2) + _nlmsg(3, bytes(4))  # ... NLMSG_DONE
    kinds = [(k, b) for k, b in nl_messages(data)]
    assert [k for k, _ in kinds] == [16, 36, 3]
    link = parse_link(kinds[0][1])
    assert link is not None
    idx, name, stats = link
    assert (idx, name) == (3, "eth0")
    assert stats["tx_bytes"] == 1000 and stats["rx_dropped"] == 4 and stats["tx_packets"] == 0
    assert parse_qdisc(kinds[1][1]) == (3, (2, 300, 2))
    assert parse_qdisc(struct.pack("=BxxxiIII", 0, 3, 0, 0, 0)) is None  # no stats


def test_a_netlink_error_message_raises_its_errno() -> None:
    from fsdp_sentinel.probes.sockdiag import nl_messages

    with pytest.raises(OSError) as e:
        list(nl_messages(_nlmsg(2, struct.pack("=i", -1) + bytes(16))))
    assert e.value.errno == 1
    assert list(nl_messages(_nlmsg(2, struct.pack("=i", 0) + bytes(16)))) == []  # an ack


def test_device_sample_sums_qdiscs_and_deltas_restart_after_a_reset() -> None:
    first = sample_link({"tx_bytes": 1000, "rx_bytes": 50}, [(2, 300, 2)])
    assert first.counters["tx_bytes"] == 1000 and first.counters["drops"] == 2
    cur = sample_link(
        {"tx_bytes": 1500, "rx_bytes": 20, "rx_dropped": 4},
        [(1, 100, 5), (1, 28, 1)],  # root + child qdisc: (qlen, backlog, drops)
    )
    assert (cur.backlog, cur.qlen) == (128, 2)
    d = deltas(first, cur)
    assert d["tx_bytes"] == 500 and d["drops"] == 4 and d["rx_dropped"] == 4
    assert d["rx_bytes"] == 20  # went down: recreated device, counted from zero
    assert set(deltas(None, cur).values()) == {0}  # first sight sets the baseline


def test_netdev_records_carry_every_device_and_the_qdisc_gauges() -> None:
    idle = sample_link({}, [])
    busy = sample_link({"tx_bytes": 10}, [(1, 64, 0)])
    devs = {
        "busy0": ({"tx_bytes": 10, "rx_bytes": 0, "drops": 0}, busy),
        "idle0": (deltas(idle, idle), idle),
    }
    recs = {r["dev"]: r for r in R.netdev_records(devs, 5.0, 1.0, "h")}
    assert set(recs) == {"busy0", "idle0"}
    assert recs["busy0"]["tx_bytes"] == 10 and recs["busy0"]["backlog"] == 64
    assert recs["idle0"]["tx_bytes"] == 0 and trace.validate(recs["idle0"]) is None


def test_evictions_are_created_minus_harvested() -> None:
    ev = R.Evictions(created={"flows": 10, "devs": 2})
    ev.harvest("flows", 7)
    ev.harvest("devs", 3)  # harvested one created after the stats read
    assert ev.evicted() == {"flows": 3, "devs": 0}


def test_resolve_symbol_takes_default_version() -> None:
    lib = "/usr/lib/x86_64-linux-gnu/libibverbs.so.1"
    if not os.path.exists(lib):
        pytest.skip("libibverbs1 not installed")
    # ibv_create_qp has a compat @IBVERBS_1.0 and a default @@IBVERBS_1.1
    # entry; the default one sits next to modify/destroy in the 1.1 code.
    addrs = {s: resolve_symbol(lib, s) for s in ("ibv_create_qp", "ibv_modify_qp")}
    assert all(addrs.values())
    assert abs(addrs["ibv_create_qp"] - addrs["ibv_modify_qp"]) < 0x1000  # type: ignore[operator]
    assert resolve_symbol(lib, "no_such_function") is None
    assert resolve_symbol("/nonexistent", "x") is None


def test_library_scan_finds_nccl_and_verbs(tmp_path: Path) -> None:
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "maps").write_text(
        "7f00-7f10 r-xp 00000000 08:01 1 /opt/nv/lib/libnccl.so.2.21.5\n"
        "7f10-7f20 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0\n"
        "7f20-7f30 r-xp 00000000 08:01 3 /usr/lib/libncurses.so.6\n"
        "7f30-7f40 rw-p 00000000 00:00 0 [heap]\n"
    )
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "maps").write_text(
        "7f00-7f10 r-xp 00000000 08:01 1 /opt/nv/lib/libnccl.so.2.21.5\n"
    )
    scan = LibraryScanner(str(tmp_path))
    found = scan.scan()
    assert sorted(k for k, _ in found) == ["nccl", "verbs"]
    assert (
        "nccl",
        f"{tmp_path}/41/root/opt/nv/lib/libnccl.so.2.21.5",
    ) in found or ("nccl", f"{tmp_path}/42/root/opt/nv/lib/libnccl.so.2.21.5") in found
    assert scan.scan() == []  # nothing new


def test_library_scan_reads_each_process_on_a_backoff(tmp_path: Path) -> None:
    """Reading maps costs the kernel a walk of every mapping: a process is read
    when first seen, then after 5, 10, 20, 40, 60, 60 s...; a library it maps
    late is found at the next read; one that maps both is never read again."""
    from fsdp_sentinel.probes.libscan import RESCAN_MAX_S

    heap = "7f30-7f40 rw-p 00000000 00:00 0 [heap]\n"
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "maps").write_text(heap)
    scan = LibraryScanner(str(tmp_path), first_gap=5.0)
    reads_at = []
    for t in range(0, 200):
        before = scan.reads
        scan.scan([41], float(t))
        if scan.reads > before:
            reads_at.append(t)
    assert reads_at == [0, 5, 15, 35, 75, 135, 195]
    assert RESCAN_MAX_S == 60.0
    # NCCL is dlopened late: found at the next read that is due, not before.
    (tmp_path / "41" / "maps").write_text(
        heap + "7f00-7f10 r-xp 00000000 08:01 1 /opt/nv/lib/libnccl.so.2.21.5\n"
    )
    assert scan.scan([41], 254.0) == []
    assert scan.scan([41], 255.0) == [("nccl", f"{tmp_path}/41/root/opt/nv/lib/libnccl.so.2.21.5")]
    # A process that maps both libraries is done with.
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "maps").write_text(
        "7f00-7f10 r-xp 00000000 08:01 1 /opt/nv/lib/libnccl.so.2.21.5\n"
        "7f10-7f20 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0\n"
    )
    before = scan.reads
    assert len(scan.scan([42], 0.0)) == 2
    for t in range(1, 400, 7):
        scan.scan([42], float(t))
    assert scan.reads == before + 1
    # A pid forgotten (its process exited) is read at once when seen again.
    scan.forget(41)
    before = scan.reads
    scan.scan([41], 256.0)
    assert scan.reads == before + 1
    # Without ``now`` (a forced scan) every process is read.
    before = scan.reads
    scan.scan([41, 42])
    assert scan.reads == before + 2


def test_flows_table_fits_80_columns() -> None:
    rec = {
        "pid": 4194304,
        "src": "[2001:db8:aaaa:bbbb::1]:65535",
        "dst": "255.255.255.255:65535",
        "tx_bytes": 10**12,
        "rx_bytes": 10**9,
        "srtt_us": 123456,
        "retrans": 12,
    }
    lines = flows_cmd.format_table([rec], 0.0)
    assert all(len(line) < 80 for line in lines), [len(x) for x in lines]
    assert "123.46" in lines[-1]


@pytest.mark.parametrize(
    ("capeff", "ok"),
    [
        ("0000000000000000", False),
        (f"{1 << 21:016x}", True),  # CAP_SYS_ADMIN
        (f"{(1 << 39) | (1 << 38):016x}", True),  # CAP_BPF + CAP_PERFMON
        (f"{1 << 39:016x}", False),  # CAP_BPF alone cannot attach tracepoints
    ],
)
def test_privileges_follow_effective_capabilities(tmp_path: Path, capeff: str, ok: bool) -> None:
    status = tmp_path / "status"
    status.write_text(f"Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t{capeff}\n")
    if ok:
        check_privileges(str(status))
    else:
        with pytest.raises(ProbePermissionError, match="needs root"):
            check_privileges(str(status))
