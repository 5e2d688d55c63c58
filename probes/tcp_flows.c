/* tcp_flows.c: per-connection TCP bytes, path figures and life events, from
 * tracepoint arguments only.
 *
 *   sock:sock_send_length / sock_recv_length  bytes per (process, socket),
 *       in process context, so the tgid is the process that moved the bytes;
 *       a named socket's owner counts in its `hot` slot (an array: no hash
 *       lookup per call), everyone else in hash maps
 *   sock:inet_sock_set_state socket -> 4-tuple, open/close
 *   tcp:tcp_probe            socket -> 4-tuple for sockets older than the
 *       probes; attached by the loader only while such a socket waits for a
 *       name (it runs once per received segment: the dearest hook here)
 *   tcp:tcp_send_reset / tcp_receive_reset   resets per 4-tuple
 *
 * srtt, cwnd, the send window and retransmits are not counted here: the
 * kernel keeps them per socket, and probes/sockdiag.py reads them (tcp_info)
 * at every poll for nothing per packet.
 *
 * The socket pointer is used only as a map key, never dereferenced. */

BPF_TABLE("lru_hash", struct flow_key, struct flow_counters, flows, SENTINEL_MAX_FLOWS);
BPF_TABLE("lru_hash", struct orphan_key, struct flow_counters, orphans, SENTINEL_MAX_EVENTS);
BPF_TABLE("lru_hash", u64, struct sock_info, socks, SENTINEL_MAX_SOCKS);
BPF_TABLE("lru_hash", struct conn_key, struct conn_counters, conn_events, SENTINEL_MAX_EVENTS);
BPF_TABLE("lru_hash", struct closed_key, struct closed_counts, closed, SENTINEL_MAX_EVENTS);
/* socket -> the process that last moved bytes on it before it was named */
BPF_TABLE("lru_hash", u64, u32, sock_owner_hint, SENTINEL_MAX_EVENTS);
/* named sockets' counters on the hot path (sentinel.h: struct hot_slot) */
BPF_F_TABLE("array", u32, struct hot_slot, hot, SENTINEL_HOT_SLOTS, BPF_F_MMAPABLE);

/* The 4-tuple of tracepoints that carry family, sport, dport and separate
 * v4/v6 address fields (inet_sock_set_state, tcp_receive_reset). The fields sit at unaligned offsets in some of these
 * records, so they are copied with probe reads rather than loaded. */
#define TUPLE_FROM_ARGS(t, args)                                          \
    do {                                                                  \
        u8 l4_[4], r4_[4], l6_[16], r6_[16];                              \
        bpf_probe_read_kernel(l4_, 4, (args)->saddr);                     \
        bpf_probe_read_kernel(r4_, 4, (args)->daddr);                     \
        bpf_probe_read_kernel(l6_, 16, (args)->saddr_v6);                 \
        bpf_probe_read_kernel(r6_, 16, (args)->daddr_v6);                 \
        tuple_addrs(&(t), (args)->family, l4_, r4_, l6_, r6_);            \
        (t).lport = (args)->sport;                                        \
        (t).rport = (args)->dport;                                        \
    } while (0)

static __always_inline struct flow_counters *flow_slot(struct flow_key *k)
{
    struct flow_counters *c = flows.lookup(k);
    if (c)
        return c;
    struct flow_counters zero = {};
    if (flows.insert(k, &zero) == 0)
        stat_add(SENTINEL_STAT_FLOW_NEW, 1);
    return flows.lookup(k);
}

static __always_inline struct flow_counters *orphan_slot(struct orphan_key *k)
{
    struct flow_counters *c = orphans.lookup(k);
    if (c)
        return c;
    struct flow_counters zero = {};
    if (orphans.insert(k, &zero) == 0)
        stat_add(SENTINEL_STAT_ORPHAN_NEW, 1);
    return orphans.lookup(k);
}

static __always_inline void add_bytes(u64 *tx, u64 *rx, int ret, int is_rx)
{
    if (is_rx)
        __sync_fetch_and_add(rx, (u64)ret);
    else
        __sync_fetch_and_add(tx, (u64)ret);
}

/* The slot a socket address maps to (Fibonacci hashing: the top bits of a
 * multiplication, so addresses that differ only in their low bits spread). */
static __always_inline struct hot_slot *hot_slot_of(u64 sk)
{
    u32 idx = (u32)((sk * 0x9E3779B97F4A7C15ULL) >> (64 - SENTINEL_HOT_BITS));
    return hot.lookup(&idx);
}

/* Give sk's slot to it (owner tgid, counters from 0) if the slot is free, or
 * held by a socket that socks no longer has (closed or evicted unseen: user
 * space can no longer see its counts either). The final store is an atomic
 * exchange, so the zeroed counters are visible before the socket is. */
static __always_inline void hot_claim(struct hot_slot *h, u64 sk, u32 tgid)
{
    u64 cur = h->sk;
    if (cur == SENTINEL_HOT_CLAIMING)
        return;
    int steal = 0;
    if (cur) {
        if (socks.lookup(&cur))
            return; /* a live socket's: this one counts in its sock_info */
        steal = 1;
    }
    if (__sync_val_compare_and_swap(&h->sk, cur, SENTINEL_HOT_CLAIMING) != cur)
        return;
    h->tgid = tgid;
    h->tx_bytes = 0;
    h->rx_bytes = 0;
    __sync_lock_test_and_set(&h->sk, sk);
    stat_add(steal ? SENTINEL_STAT_HOT_STEAL : SENTINEL_STAT_HOT_CLAIM, 1);
}

/* Free sk's slot if it holds one (after its counts were read or reset). */
static __always_inline void hot_release(struct hot_slot *h, u64 sk)
{
    if (h && h->sk == sk)
        __sync_val_compare_and_swap(&h->sk, sk, 0);
}

static __always_inline void count_io(u64 sk, int ret, int flags, int rx)
{
    if (ret <= 0 || (flags & SENTINEL_MSG_PEEK))
        return;
    u32 tgid = current_tgid();
    struct hot_slot *h = hot_slot_of(sk);
    if (!h)
        return; /* never: the index is always in range */
    /* Hottest path: a named socket's owner, its slot claimed. No helper
     * call: the owner passed the pid filter when it claimed the slot. */
    if (h->sk == sk && h->tgid == tgid) {
        add_bytes(&h->tx_bytes, &h->rx_bytes, ret, rx);
        return;
    }
    /* The pid filter first: another process's traffic costs this lookup. */
    if (!tgid_allowed(tgid))
        return;
    struct sock_info *si = socks.lookup(&sk);
    if (si && si->known && si->tgid == tgid) {
        add_bytes(&si->tx_bytes, &si->rx_bytes, ret, rx);
        hot_claim(h, sk, tgid); /* its next calls take the hot path */
        return;
    }
    if (si && si->ignore)
        return; /* user space found it is no TCP socket (unix, udp) */
    struct flow_counters *c = 0;
    if (si && si->known) {
        if (!si->tgid) { /* passively opened: its first user owns it */
            si->tgid = tgid;
            add_bytes(&si->tx_bytes, &si->rx_bytes, ret, rx);
            hot_claim(h, sk, tgid);
            return;
        }
        struct flow_key fk = {}; /* another process on the owner's socket */
        fk.tgid = tgid;
        fk.t = si->t;
        c = flow_slot(&fk);
    } else {
        /* Not (yet) a socket we can name: park the bytes under its address
         * and remember its owner, so tcp_probe can name it (and, with the
         * pid filter, knows it belongs to a registered process). */
        if (!si)
            sock_owner_hint.update(&sk, &tgid);
        struct orphan_key ok = {};
        ok.tgid = tgid;
        ok.sk = sk;
        c = orphan_slot(&ok);
        stat_add(SENTINEL_STAT_ORPHAN_BYTES, ret);
    }
    if (c)
        add_bytes(&c->tx_bytes, &c->rx_bytes, ret, rx);
}

/* sock_send_length / sock_recv_length run in the caller's context. As raw
 * tracepoints (args: sk, ret, flags) they do not hold the kernel's global
 * "a BPF tracing program runs on this CPU" flag, so softirq networking that
 * interrupts them still runs the net/tcp probes; as classic tracepoints they
 * made those skip whole softirq batches. (Both tracepoints date from Linux
 * 6.3, long after raw tracepoints, 4.17.) The raw form cannot see the
 * socket's family/protocol: a socket counts only once a TCP probe named it;
 * other sockets' bytes stay parked and expire. */
#ifdef SENTINEL_HAVE_sock__sock_send_length
RAW_TRACEPOINT_PROBE(sock_send_length)
{
    count_io((u64)ctx->args[0], (int)ctx->args[1], (int)ctx->args[2], 0);
    return 0;
}
#endif

#ifdef SENTINEL_HAVE_sock__sock_recv_length
RAW_TRACEPOINT_PROBE(sock_recv_length)
{
    count_io((u64)ctx->args[0], (int)ctx->args[1], (int)ctx->args[2], 1);
    return 0;
}
#endif

#ifdef SENTINEL_HAVE_tcp__tcp_probe
TRACEPOINT_PROBE(tcp, tcp_probe)
{
    u64 sk = (u64)args->skaddr;
    struct sock_info *si = socks.lookup(&sk);
    if (si && si->known)
        return 0; /* named already: nothing else is read here */
    if (!si) {
        u32 *hint = sock_owner_hint.lookup(&sk);
        if (SENTINEL_FILTER_PIDS && !(hint && tgid_allowed(*hint)))
            return 0; /* not a registered process's socket */
        struct sock_info fresh = {};
        if (hint)
            fresh.tgid = *hint;
        if (socks.insert(&sk, &fresh) == 0)
            stat_add(SENTINEL_STAT_SOCK_NEW, 1);
        si = socks.lookup(&sk);
        if (!si)
            return 0;
    }
    u8 ls[28] = {}, rs[28] = {};
    bpf_probe_read_kernel(ls, sizeof(ls), args->saddr);
    bpf_probe_read_kernel(rs, sizeof(rs), args->daddr);
    tuple_sockaddrs(&si->t, ls, rs);
    si->t.lport = args->sport;
    si->t.rport = args->dport;
    if (si->ignore) { /* a stale entry at a reused address */
        si->tgid = 0;
        si->ignore = 0;
    }
    si->tx_bytes = 0; /* bytes before this instant are parked in orphans */
    si->rx_bytes = 0;
    hot_release(hot_slot_of(sk), sk);
    si->known = 1;
    return 0;
}
#endif

static __always_inline void conn_event(struct flow_tuple *t, u32 what, u64 sk, u32 tgid)
{
    struct conn_key ck = {};
    ck.t = *t;
    ck.what = what;
    struct conn_counters *c = conn_events.lookup(&ck);
    if (!c) {
        struct conn_counters zero = {};
        if (conn_events.insert(&ck, &zero) == 0)
            stat_add(SENTINEL_STAT_CONN_NEW, 1);
        c = conn_events.lookup(&ck);
        if (!c)
            return;
    }
    __sync_fetch_and_add(&c->count, 1);
    c->sk = sk;
    if (tgid)
        c->tgid = tgid;
}

#ifdef SENTINEL_HAVE_sock__inet_sock_set_state
TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != SENTINEL_IPPROTO_TCP)
        return 0;
    int olds = args->oldstate, news = args->newstate;
    u64 sk = (u64)args->skaddr;
    struct flow_tuple t = {};
    TUPLE_FROM_ARGS(t, args);

    u32 tgid = 0;
    struct sock_info *si = socks.lookup(&sk);
    if (news == SENTINEL_TCP_SYN_SENT) {
        /* connect(): the one transition surely in the caller's context. The
         * local port is not bound yet, so the tuple waits for ESTABLISHED. */
        tgid = current_tgid();
        if (!tgid_allowed(tgid))
            return 0;
        struct sock_info fresh = {};
        fresh.tgid = tgid;
        if (socks.update(&sk, &fresh) == 0 && !si)
            stat_add(SENTINEL_STAT_SOCK_NEW, 1);
        return 0;
    }
    if (si)
        tgid = si->tgid;
    /* A passive open runs in softirq before any process owns the socket: it
     * is always recorded, and user space drops it if no registered process
     * claims the socket. */
    int allowed = !SENTINEL_FILTER_PIDS || (si && tgid_allowed(tgid)) ||
                  (news == SENTINEL_TCP_ESTABLISHED && olds == SENTINEL_TCP_SYN_RECV);
    if (news == SENTINEL_TCP_CLOSE) {
        if (allowed && olds != SENTINEL_TCP_LISTEN && olds != SENTINEL_TCP_NEW_SYN_RECV)
            conn_event(&t, SENTINEL_CONN_CLOSE, sk, tgid);
        /* Final counts: sock_info's and its slot's. The slot is freed only
         * after socks lost the socket, and user space reads the slots before
         * socks, then closed: whichever it sees, each byte counts once. */
        struct hot_slot *h = 0;
        u64 tx = 0, rx = 0;
        u32 owner = si ? si->tgid : 0;
        if (si && si->known) {
            tx = si->tx_bytes;
            rx = si->rx_bytes;
            h = hot_slot_of(sk);
            if (h && h->sk == sk) {
                tx += h->tx_bytes;
                rx += h->rx_bytes;
            }
        }
        /* Bytes still parked under the socket's address go with it: its name
         * is in this very event. A socket is parked when the event that names
         * it never ran (the kernel skips a classic tracepoint that fires
         * while another BPF program or a map syscall holds the CPU: an
         * ESTABLISHED in softirq, say); after this event nothing could name
         * it, and a short connection's bytes were lost whole. Taken by
         * exchange, so a user-space read racing this one sees them or not. */
        if (!owner) {
            u32 *hint = sock_owner_hint.lookup(&sk);
            if (hint)
                owner = *hint;
        }
        if (owner) {
            struct orphan_key ok = {};
            ok.tgid = owner;
            ok.sk = sk;
            struct flow_counters *oc = orphans.lookup(&ok);
            if (oc) {
                tx += __sync_lock_test_and_set(&oc->tx_bytes, 0);
                rx += __sync_lock_test_and_set(&oc->rx_bytes, 0);
                if (orphans.delete(&ok) == 0) /* not evicted: user space counts it */
                    stat_add(SENTINEL_STAT_ORPHAN_CLOSED, 1);
            }
        }
        if (owner && (tx || rx)) {
            struct closed_key key = {};
            key.sk = sk;
            key.t = (si && si->known) ? si->t : t;
            struct closed_counts last = {};
            last.tgid = owner;
            last.tx_bytes = tx;
            last.rx_bytes = rx;
            if (closed.update(&key, &last) == 0)
                stat_add(SENTINEL_STAT_CLOSED_NEW, 1);
        }
        if (si && socks.delete(&sk) == 0)
            stat_add(SENTINEL_STAT_SOCK_DEL, 1);
        hot_release(h, sk);
        return 0;
    }
    if (!allowed)
        return 0;
    if (news == SENTINEL_TCP_ESTABLISHED) {
        if (!si) {
            struct sock_info fresh = {};
            fresh.t = t;
            fresh.known = 1;
            if (socks.insert(&sk, &fresh) == 0)
                stat_add(SENTINEL_STAT_SOCK_NEW, 1);
        } else {
            if (olds != SENTINEL_TCP_SYN_SENT) {
                /* a stale entry at a reused address: this socket is new */
                tgid = 0;
                si->tgid = 0;
                si->tx_bytes = 0;
                si->rx_bytes = 0;
            }
            hot_release(hot_slot_of(sk), sk); /* an earlier socket's, if any */
            si->t = t;
            si->known = 1;
            si->ignore = 0;
        }
        conn_event(&t, SENTINEL_CONN_OPEN, sk, tgid);
    }
    return 0;
}
#endif

static __always_inline u32 sock_owner(u64 sk, int *allowed)
{
    struct sock_info *si = sk ? socks.lookup(&sk) : 0;
    u32 tgid = si ? si->tgid : 0;
    *allowed = !SENTINEL_FILTER_PIDS || (si && tgid_allowed(tgid));
    return tgid;
}

#ifdef SENTINEL_HAVE_tcp__tcp_send_reset
TRACEPOINT_PROBE(tcp, tcp_send_reset)
{
    u64 sk = (u64)args->skaddr;
    int allowed = 0;
    u32 tgid = sock_owner(sk, &allowed);
    if (!allowed)
        return 0;
    struct flow_tuple t = {};
    u8 ls[28] = {}, rs[28] = {};
    bpf_probe_read_kernel(ls, sizeof(ls), args->saddr);
    bpf_probe_read_kernel(rs, sizeof(rs), args->daddr);
    tuple_sockaddrs(&t, ls, rs);
    u16 lp = 0, rp = 0; /* sockaddr ports are network order */
    __builtin_memcpy(&lp, ls + 2, 2);
    __builtin_memcpy(&rp, rs + 2, 2);
    t.lport = __builtin_bswap16(lp);
    t.rport = __builtin_bswap16(rp);
    conn_event(&t, SENTINEL_CONN_RESET_SENT, sk, tgid);
    return 0;
}
#endif

#ifdef SENTINEL_HAVE_tcp__tcp_receive_reset
TRACEPOINT_PROBE(tcp, tcp_receive_reset)
{
    u64 sk = (u64)args->skaddr;
    int allowed = 0;
    u32 tgid = sock_owner(sk, &allowed);
    if (!allowed)
        return 0;
    struct flow_tuple t = {};
    TUPLE_FROM_ARGS(t, args);
    conn_event(&t, SENTINEL_CONN_RESET_RECV, sk, tgid);
    return 0;
}
#endif
