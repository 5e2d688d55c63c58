"""The uprobes on libnccl and libibverbs, and a symbol resolver that knows
ELF symbol versions.

libibverbs exports each control call twice (``ibv_create_qp@IBVERBS_1.0``, a
compat entry taking an old struct, and the default ``@@IBVERBS_1.1``); bcc's
own lookup may pick either, so the address comes from ``resolve_symbol``,
which takes the default version (the one the dynamic linker binds to).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class UprobeSpec:
    symbol: str
    fn: str  # BPF function in nccl.c / verbs.c
    ret: bool = False


NCCL_UPROBES: tuple[UprobeSpec, ...] = (
    UprobeSpec("ncclAllGather", "nccl_all_gather"),
    UprobeSpec("ncclReduceScatter", "nccl_reduce_scatter"),
    UprobeSpec("ncclAllReduce", "nccl_all_reduce"),
    UprobeSpec("ncclBroadcast", "nccl_broadcast"),
    UprobeSpec("ncclSend", "nccl_send"),
    UprobeSpec("ncclRecv", "nccl_recv"),
    UprobeSpec("ncclGroupStart", "nccl_group_start"),
    UprobeSpec("ncclGroupEnd", "nccl_group_end"),
    UprobeSpec("ncclCommInitRank", "nccl_comm_init_rank"),
    UprobeSpec("ncclCommInitRank", "nccl_comm_init_rank_ret", ret=True),
    UprobeSpec("ncclCommInitRankConfig", "nccl_comm_init_rank"),
    UprobeSpec("ncclCommInitRankConfig", "nccl_comm_init_rank_ret", ret=True),
)

VERBS_UPROBES: tuple[UprobeSpec, ...] = (
    UprobeSpec("ibv_create_qp", "ibv_create_qp_ret", ret=True),
    UprobeSpec("ibv_modify_qp", "ibv_modify_qp_entry"),
    UprobeSpec("ibv_destroy_qp", "ibv_destroy_qp_entry"),
)

SHT_DYNSYM = 11
SHT_GNU_VERSYM = 0x6FFFFFFF
STT_FUNC = 2
STT_GNU_IFUNC = 10
VERSYM_HIDDEN = 0x8000


def resolve_symbol(path: str, name: str) -> int | None:
    """Virtual address of the default-version function ``name`` exported by
    the ELF64 little-endian file at ``path`` (None when absent)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    dynsym = next((s for s in sections if s[1] == SHT_DYNSYM), None)
    if dynsym is None:
        return None
    versym = next((s for s in sections if s[1] == SHT_GNU_VERSYM), None)
    strtab = sections[dynsym[6]]  # sh_link
    str_off = strtab[4]
    sym_off, sym_size, entsize = dynsym[4], dynsym[5], dynsym[9] or 24
    want = name.encode()
    fallback = None
    for i in range(sym_size // entsize):
        st_name, st_info, _other, st_shndx, st_value, _sz = struct.unpack_from(
            "<IBBHQQ", data, sym_off + i * entsize
        )
        if st_shndx == 0 or (st_info & 0xF) not in (STT_FUNC, STT_GNU_IFUNC):
            continue
        end = data.index(b"\0", str_off + st_name)
        if data[str_off + st_name : end] != want:
            continue
        if versym is None:
            return int(st_value)
        ver = struct.unpack_from("<H", data, versym[4] + 2 * i)[0]
        if not ver & VERSYM_HIDDEN:
            return int(st_value)
        fallback = int(st_value)
    return fallback
