/* sentinel.h: the structs shared by the kernel programs (tcp_flows.c,
 * nccl.c, verbs.c) and the user-side loader (probes/loader.py),
 * which decodes map keys and values through the ctypes bcc builds from these
 * very declarations.
 *
 * Every figure here comes from a tracepoint argument or a uprobe argument,
 * never from a kernel struct read through header offsets: the headers bcc
 * compiles against may belong to another kernel than the one running.
 *
 * (Device counters are not here: probes/devstats.py reads them from netlink.)
 *
 * Compile-time tunables (read-only once loaded; the loader passes -D flags):
 *   SENTINEL_FILTER_PIDS  1: count only processes registered in `pids`
 *   SENTINEL_MAX_*        map sizes (LRU-bounded)
 *   SENTINEL_HAVE_*       which tracepoints exist on this kernel
 */
#ifndef SENTINEL_H
#define SENTINEL_H

#ifndef SENTINEL_FILTER_PIDS
#define SENTINEL_FILTER_PIDS 0
#endif
#ifndef SENTINEL_MAX_FLOWS
#define SENTINEL_MAX_FLOWS 16384
#endif
#ifndef SENTINEL_MAX_SOCKS
#define SENTINEL_MAX_SOCKS 65536
#endif
#ifndef SENTINEL_MAX_EVENTS
#define SENTINEL_MAX_EVENTS 8192
#endif
#ifndef SENTINEL_MAX_PIDS
#define SENTINEL_MAX_PIDS 4096
#endif

#define SENTINEL_AF_INET 2
#define SENTINEL_AF_INET6 10
#define SENTINEL_IPPROTO_TCP 6
#define SENTINEL_MSG_PEEK 2

/* TCP states as the inet_sock_set_state format file prints them. */
#define SENTINEL_TCP_ESTABLISHED 1
#define SENTINEL_TCP_SYN_SENT 2
#define SENTINEL_TCP_SYN_RECV 3
#define SENTINEL_TCP_FIN_WAIT1 4
#define SENTINEL_TCP_CLOSE 7
#define SENTINEL_TCP_LAST_ACK 9
#define SENTINEL_TCP_LISTEN 10
#define SENTINEL_TCP_NEW_SYN_RECV 12

/* conn_key.what */
#define SENTINEL_CONN_OPEN 1
#define SENTINEL_CONN_CLOSE 2
#define SENTINEL_CONN_RESET_SENT 3
#define SENTINEL_CONN_RESET_RECV 4

/* Index into the per-CPU `stats` array: how many entries each drained map
 * created, so user space can tell LRU evictions (created - harvested). */
#define SENTINEL_STAT_FLOW_NEW 0
#define SENTINEL_STAT_ORPHAN_NEW 1
#define SENTINEL_STAT_SOCK_NEW 2
#define SENTINEL_STAT_CONN_NEW 3
#define SENTINEL_STAT_CLOSED_NEW 4 /* was retrans (now tcp_info via sock_diag) */
#define SENTINEL_STAT_ORPHAN_CLOSED 5 /* orphans entries folded into closed at CLOSE */
#define SENTINEL_STAT_NCCL_NEW 6
#define SENTINEL_STAT_QP_NEW 7
#define SENTINEL_STAT_SOCK_DEL 8
#define SENTINEL_STAT_ORPHAN_BYTES 9
#define SENTINEL_STAT_HOT_CLAIM 10
#define SENTINEL_STAT_HOT_STEAL 11
#define SENTINEL_NSTATS 12

/* A TCP connection as its local end sees it. IPv4 addresses use the first 4
 * bytes of laddr/raddr; IPv4-mapped IPv6 addresses are folded to IPv4 so that
 * every tracepoint names a connection the same way. Ports in host order. */
struct flow_tuple {
    u16 family;
    u16 lport;
    u16 rport;
    u16 pad;
    u8 laddr[16];
    u8 raddr[16];
};

/* flows: bytes per (process, connection) of a process other than the
 * socket's owner (a socket shared across fork), drained every interval. The
 * owner's bytes are counted in the socket's own sock_info. */
struct flow_key {
    u32 tgid;
    u32 pad;
    struct flow_tuple t;
};

struct flow_counters {
    u64 tx_bytes;
    u64 rx_bytes;
};

/* orphans: bytes on a socket whose 4-tuple was not yet known when counted
 * (a connection older than the probes, before its first tcp_probe);
 * user space attributes them through `socks` at the next poll. */
struct orphan_key {
    u32 tgid;
    u32 pad;
    u64 sk;
};

/* socks: socket address -> 4-tuple, owner and the owner's byte counts
 * since the socket was named (cumulative: user space reads them in place
 * and takes deltas, so no map syscall deletes under a running program).
 * Deleted by the kernel when the socket closes, after it copied the final
 * counts to `closed`. (srtt, cwnd and retransmits are not here:
 * probes/sockdiag.py reads the kernel's tcp_info at each poll.) */
struct sock_info {
    struct flow_tuple t;
    u32 tgid;   /* the owner: first process to move bytes (0: none yet) */
    u32 known;  /* 1 once t is filled */
    u32 ignore; /* set by user space: not a TCP socket, count nothing */
    u32 pad;
    u64 tx_bytes;
    u64 rx_bytes;
};

/* hot: the byte counters of named sockets while their owner moves bytes,
 * in a direct-mapped array indexed by a hash of the socket address. An
 * array slot is reached without a helper call (the verifier inlines array
 * lookups), where socks costs a hash lookup: the per-call byte programs pay
 * for one or the other on every send and receive. A slot belongs to one
 * socket at a time (claimed with a compare-and-swap by its owner's first
 * call after the socket was named, freed when it closes or is named again);
 * a socket whose slot is taken counts in its sock_info as before. A socket's
 * bytes are its sock_info's plus its slot's (user space reads the array
 * through mmap: no map syscall). One cache line a slot, so two sockets busy
 * on two CPUs never share a line. */
#ifndef SENTINEL_HOT_BITS
#define SENTINEL_HOT_BITS 12
#endif
#define SENTINEL_HOT_SLOTS (1 << SENTINEL_HOT_BITS)
#define SENTINEL_HOT_CLAIMING 1 /* sk while a claim or a release is under way */

struct hot_slot {
    u64 sk;     /* 0: free; SENTINEL_HOT_CLAIMING; else the socket address */
    u32 tgid;   /* the socket's owner (only its calls count here) */
    u32 pad;
    u64 tx_bytes;
    u64 rx_bytes;
    u64 pad2[4];
};

/* closed: a socket's final sock_info counts, copied as it closes (keyed by
 * address and 4-tuple: an address reused within one interval is another
 * key), drained every interval. */
struct closed_key {
    u64 sk;
    struct flow_tuple t;
};

struct closed_counts {
    u32 tgid;
    u32 pad;
    u64 tx_bytes;
    u64 rx_bytes;
};

/* conn_events: connection life events, drained every interval. */
struct conn_key {
    struct flow_tuple t;
    u32 what;
    u32 pad;
};

struct conn_counters {
    u64 count;
    u64 sk;   /* socket address, to resolve the process when tgid is 0 */
    u32 tgid; /* 0 when the event ran in softirq context */
    u32 pad;
};

/* NCCL: calls and bytes per (process, communicator, operation). */
#define SENTINEL_NCCL_ALL_GATHER 1
#define SENTINEL_NCCL_REDUCE_SCATTER 2
#define SENTINEL_NCCL_ALL_REDUCE 3
#define SENTINEL_NCCL_BROADCAST 4
#define SENTINEL_NCCL_SEND 5
#define SENTINEL_NCCL_RECV 6
#define SENTINEL_NCCL_GROUP_START 7
#define SENTINEL_NCCL_GROUP_END 8

struct nccl_key {
    u32 tgid;
    u32 op;
    u64 comm;
};

struct nccl_counters {
    u64 calls;
    u64 bytes;     /* count x datatype size, as passed */
    u64 bad_dtype; /* calls with a datatype we do not know */
};

/* Communicator -> rank, from ncclCommInitRank (+ its return). */
struct nccl_init_args {
    u64 commp; /* ncclComm_t * the caller passed */
    s32 nranks;
    s32 rank;
};

struct nccl_comm_info {
    u32 tgid;
    s32 rank;
    s32 nranks;
    u32 pad;
};

/* libibverbs control path: queue pairs per process. */
struct qp_key {
    u32 tgid;
    u32 qp_num;
};

struct qp_counters {
    u64 creates;
    u64 modifies;
    u64 destroys;
    s32 state;       /* last IBV_QPS_* set through ibv_modify_qp (-1: none) */
    u32 dest_qp_num; /* last IBV_QP_DEST_QPN (0: none) */
    u32 qp_type;     /* IBV_QPT_* from create (0: unknown) */
    u32 pad;
};

#endif /* SENTINEL_H */
