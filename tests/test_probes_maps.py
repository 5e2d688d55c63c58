"""Reading a BPF map whole (probes.loader.MapReader): the kernel's batch calls
into buffers kept between reads, checked against bcc's own batch read on a
real map with more entries than one call takes."""

from __future__ import annotations

import ctypes as ct
import os
from collections.abc import Iterator
from typing import Any

import pytest

from fsdp_sentinel.probes.loader import MapReader

pytestmark = [pytest.mark.kernel, pytest.mark.root]

TEXT = """
struct val { u64 a; u32 b; u32 c; };
BPF_HASH(h, u64, struct val, 4096);
BPF_PERCPU_ARRAY(pc, u64, 12);
int noop(void *ctx) { return 0; }
"""


@pytest.fixture(scope="module")
def bpf() -> Iterator[Any]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    bcc = pytest.importorskip("bcc")
    b = bcc.BPF(text=TEXT.encode())
    try:
        yield b
    finally:
        b.cleanup()


def _fill(table: Any, n: int) -> dict[int, tuple[int, int, int]]:
    want = {}
    for i in range(n):
        k = 0xFFFF_8880_0000_0000 + i * 64
        v = table.Leaf()
        v.a, v.b, v.c = i * 1_000_003, i, 7
        table[table.Key(k)] = v
        want[k] = (v.a, v.b, v.c)
    return want


@pytest.mark.parametrize("entries", [1, 256])
def test_a_whole_read_matches_bcc_and_a_delete_read_empties_the_map(bpf: Any, entries: int) -> None:
    h = bpf[b"h"]
    h.clear()
    want = _fill(h, 700)  # several calls of 256, and (entries=1) buckets of two or more
    reader = MapReader(h, entries)
    got = {int(k.value): (v.a, v.b, v.c) for k, v in reader.read()}
    assert got == want
    assert got == {int(k): (v.a, v.b, v.c) for k, v in h.items_lookup_batch()}
    # The entries are copies: a second read into the same buffers leaves them be.
    first = reader.read()
    h.clear()
    _fill(h, 3)
    assert len(reader.read()) == 3
    assert {int(k.value): (v.a, v.b, v.c) for k, v in first} == want
    taken = reader.read(delete=True)
    assert len(taken) == 3 and list(h.items()) == []
    assert reader.read(delete=True) == []


def test_a_per_cpu_array_reads_every_slot_with_every_cpu(bpf: Any) -> None:
    pc = bpf[b"pc"]
    for i in range(12):
        vals = pc.Leaf()
        for cpu in range(len(vals)):
            vals[cpu] = i * 10 + cpu
        pc[ct.c_int(i)] = vals
    got = {int(k.value): list(v) for k, v in MapReader(pc).read()}
    assert got == {i: list(pc[ct.c_int(i)]) for i in range(12)}
