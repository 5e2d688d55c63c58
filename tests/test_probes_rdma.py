"""RDMA port counters: deltas from a fixture tree laid out like a real mlx5
device's /sys/class/infiniband (the machine has no RDMA NIC)."""

from __future__ import annotations

import shutil
from pathlib import Path

from fsdp_sentinel import trace
from fsdp_sentinel.probes.rdma import RdmaReader, read_ports

FIXTURE = Path(__file__).parent / "fixtures" / "sys_infiniband_mlx5"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _bump(root: Path, dev: str, rel: str, by: int) -> None:
    f = root / dev / "ports" / "1" / rel
    f.write_text(f"{int(f.read_text()) + by}\n")


def test_fixture_reads_like_sysfs() -> None:
    ports = read_ports(FIXTURE)
    assert set(ports) == {("mlx5_0", 1), ("mlx5_1", 1)}
    vals = ports[("mlx5_0", 1)]
    assert vals["port_xmit_data"] == 3000000000
    assert vals["hw.np_cnp_sent"] == 5


def test_deltas_in_bytes_not_words(tmp_path: Path) -> None:
    root = tmp_path / "infiniband"
    shutil.copytree(FIXTURE, root)
    clock = Clock()
    rd = RdmaReader(root, host="h", clock=clock)
    assert rd.poll() == []  # baseline
    _bump(root, "mlx5_0", "counters/port_xmit_data", 250_000)  # 1,000,000 bytes
    _bump(root, "mlx5_0", "counters/port_rcv_data", 1_000)
    _bump(root, "mlx5_0", "counters/port_xmit_packets", 300)
    _bump(root, "mlx5_0", "counters/port_xmit_wait", 42)
    _bump(root, "mlx5_0", "hw_counters/np_cnp_sent", 3)
    clock.t += 0.5
    recs = {r["dev"]: r for r in rd.poll()}
    r = recs["mlx5_0"]
    assert trace.validate(r) is None and r["kind"] == "rdma"
    assert (r["tx_bytes"], r["rx_bytes"], r["tx_packets"]) == (1_000_000, 4_000, 300)
    assert r["xmit_wait"] == 42 and r["dt"] == 0.5 and r["port"] == 1
    assert r["counters"] == {"port_xmit_packets": 300, "port_xmit_wait": 42, "hw.np_cnp_sent": 3}
    idle = recs["mlx5_1"]
    assert (idle["tx_bytes"], idle["rx_bytes"], idle["counters"]) == (0, 0, {})


def test_counter_reset_is_flagged(tmp_path: Path) -> None:
    root = tmp_path / "infiniband"
    shutil.copytree(FIXTURE, root)
    rd = RdmaReader(root, host="h", clock=Clock())
    rd.poll()
    (root / "mlx5_0/ports/1/counters/port_xmit_data").write_text("10\n")
    r = next(x for x in rd.poll() if x["dev"] == "mlx5_0")
    assert r["reset"] is True and r["tx_bytes"] == 40


def test_no_rdma_devices_means_no_records(tmp_path: Path) -> None:
    rd = RdmaReader(tmp_path / "absent", host="h")
    assert not rd.present()
    assert rd.poll() == [] and rd.poll() == []
