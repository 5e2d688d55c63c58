/* verbs.c: uprobes on libibverbs' exported control calls, to map RDMA queue
 * pairs to processes. The data path (ibv_post_send, polling) is inline in
 * the provider library and never enters the kernel: it is not visible here.
 *
 * struct ibv_qp is the library's stable user-space ABI (IBVERBS_1.1):
 * six pointers, then handle (offset 48), qp_num (52), state (56),
 * qp_type (60). struct ibv_qp_attr: qp_state at 0, dest_qp_num at 28. */

#define SENTINEL_IBV_QP_NUM_OFF 52
#define SENTINEL_IBV_QP_TYPE_OFF 60
#define SENTINEL_IBV_ATTR_DEST_QPN_OFF 28
#define SENTINEL_IBV_QP_STATE 1
#define SENTINEL_IBV_QP_DEST_QPN (1 << 20)

BPF_TABLE("lru_hash", struct qp_key, struct qp_counters, qps, SENTINEL_MAX_EVENTS);

static __always_inline struct qp_counters *qp_slot(u32 tgid, u64 qp)
{
    struct qp_key k = {};
    k.tgid = tgid;
    bpf_probe_read_user(&k.qp_num, 4, (void *)(qp + SENTINEL_IBV_QP_NUM_OFF));
    struct qp_counters *c = qps.lookup(&k);
    if (c)
        return c;
    struct qp_counters zero = {};
    zero.state = -1;
    bpf_probe_read_user(&zero.qp_type, 4, (void *)(qp + SENTINEL_IBV_QP_TYPE_OFF));
    if (qps.insert(&k, &zero) == 0)
        stat_add(SENTINEL_STAT_QP_NEW, 1);
    return qps.lookup(&k);
}

/* ibv_create_qp(pd, init_attr) -> struct ibv_qp * (uretprobe) */
int ibv_create_qp_ret(struct pt_regs *ctx)
{
    u32 tgid = current_tgid();
    u64 qp = PT_REGS_RC(ctx);
    if (!qp || !tgid_allowed(tgid))
        return 0;
    struct qp_counters *c = qp_slot(tgid, qp);
    if (c)
        __sync_fetch_and_add(&c->creates, 1);
    return 0;
}

/* ibv_modify_qp(qp, attr, attr_mask) */
int ibv_modify_qp_entry(struct pt_regs *ctx)
{
    u32 tgid = current_tgid();
    u64 qp = PT_REGS_PARM1(ctx);
    u64 attr = PT_REGS_PARM2(ctx);
    int mask = (int)PT_REGS_PARM3(ctx);
    if (!qp || !tgid_allowed(tgid))
        return 0;
    struct qp_counters *c = qp_slot(tgid, qp);
    if (!c)
        return 0;
    __sync_fetch_and_add(&c->modifies, 1);
    if (attr && (mask & SENTINEL_IBV_QP_STATE)) {
        s32 st = -1;
        bpf_probe_read_user(&st, 4, (void *)attr);
        c->state = st;
    }
    if (attr && (mask & SENTINEL_IBV_QP_DEST_QPN)) {
        u32 d = 0;
        bpf_probe_read_user(&d, 4, (void *)(attr + SENTINEL_IBV_ATTR_DEST_QPN_OFF));
        c->dest_qp_num = d;
    }
    return 0;
}

/* ibv_destroy_qp(qp) */
int ibv_destroy_qp_entry(struct pt_regs *ctx)
{
    u32 tgid = current_tgid();
    u64 qp = PT_REGS_PARM1(ctx);
    if (!qp || !tgid_allowed(tgid))
        return 0;
    struct qp_counters *c = qp_slot(tgid, qp);
    if (c)
        __sync_fetch_and_add(&c->destroys, 1);
    return 0;
}
