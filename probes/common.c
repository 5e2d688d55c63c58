/* common.c: maps and helpers every probe family uses: the registered-pid
 * filter, the per-CPU statistics array and address folding. Prepended to
 * each family by the loader (probes/program.py). */
#include <uapi/linux/ptrace.h>
#include "sentinel.h"

/* Registered processes (tgid -> 1); consulted only when
 * SENTINEL_FILTER_PIDS is 1, a read-only tunable fixed at load time. */
BPF_HASH(pids, u32, u8, SENTINEL_MAX_PIDS);
BPF_PERCPU_ARRAY(stats, u64, SENTINEL_NSTATS);

static __always_inline void stat_add(u32 idx, u64 n)
{
    u64 *v = stats.lookup(&idx);
    if (v)
        *v += n; /* per-CPU slot: no atomics needed */
}

static __always_inline u32 current_tgid(void)
{
    return bpf_get_current_pid_tgid() >> 32;
}

static __always_inline int tgid_allowed(u32 tgid)
{
    if (!SENTINEL_FILTER_PIDS)
        return 1;
    return pids.lookup(&tgid) != 0;
}

/* ::ffff:a.b.c.d ? */
static __always_inline int is_v4mapped(const u8 *a)
{
    u64 hi = 0;
    u32 mid = 0;
    __builtin_memcpy(&hi, a, 8);
    __builtin_memcpy(&mid, a + 8, 4);
    return hi == 0 && mid == 0xffff0000; /* bytes 00 00 ff ff, little endian */
}

/* Fill t's addresses from separate v4/v6 tracepoint fields (already copied
 * to the stack); v4-mapped IPv6 is folded to IPv4. */
static __always_inline void tuple_addrs(struct flow_tuple *t, u16 family, const u8 *l4,
                                        const u8 *r4, const u8 *l6, const u8 *r6)
{
    if (family == SENTINEL_AF_INET6 && !(is_v4mapped(l6) && is_v4mapped(r6))) {
        t->family = SENTINEL_AF_INET6;
        __builtin_memcpy(t->laddr, l6, 16);
        __builtin_memcpy(t->raddr, r6, 16);
    } else {
        t->family = SENTINEL_AF_INET;
        __builtin_memcpy(t->laddr, l4, 4);
        __builtin_memcpy(t->raddr, r4, 4);
    }
}

/* Same from two 28-byte sockaddr buffers (tcp_probe, tcp_send_reset):
 * sockaddr_in keeps the address at offset 4, sockaddr_in6 at offset 8. */
static __always_inline void tuple_sockaddrs(struct flow_tuple *t, const u8 *ls, const u8 *rs)
{
    u16 fam = 0;
    __builtin_memcpy(&fam, ls, 2);
    if (fam == SENTINEL_AF_INET6) {
        tuple_addrs(t, fam, ls + 20, rs + 20, ls + 8, rs + 8);
    } else {
        tuple_addrs(t, SENTINEL_AF_INET, ls + 4, rs + 4, ls + 8, rs + 8);
    }
}
