/* nccl.c: uprobes on libnccl's exported API (x86-64 SysV argument
 * registers). Counts calls and bytes (count x datatype size, as passed) per
 * (process, communicator, operation), and maps communicators to ranks
 * through ncclCommInitRank / ncclCommInitRankConfig and their return.
 *
 * ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank):
 * the 128-byte id is passed in memory, so rank is the 3rd integer register. */

BPF_TABLE("lru_hash", struct nccl_key, struct nccl_counters, nccl_calls, SENTINEL_MAX_EVENTS);
BPF_TABLE("lru_hash", u64, struct nccl_comm_info, nccl_comms, SENTINEL_MAX_EVENTS);
BPF_TABLE("lru_hash", u64, struct nccl_init_args, nccl_inits, SENTINEL_MAX_PIDS);

/* ncclDataType_t -> bytes (0: unknown) */
static __always_inline u32 nccl_dtype_size(u32 dt)
{
    switch (dt) {
    case 0: /* ncclInt8 */
    case 1: /* ncclUint8 */
    case 10: /* ncclFloat8e4m3 */
    case 11: /* ncclFloat8e5m2 */
        return 1;
    case 6: /* ncclFloat16 */
    case 9: /* ncclBfloat16 */
        return 2;
    case 2: /* ncclInt32 */
    case 3: /* ncclUint32 */
    case 7: /* ncclFloat32 */
        return 4;
    case 4: /* ncclInt64 */
    case 5: /* ncclUint64 */
    case 8: /* ncclFloat64 */
        return 8;
    }
    return 0;
}

static __always_inline int nccl_count(u32 op, u64 count, u32 dtype, u64 comm, int has_dtype)
{
    u32 tgid = current_tgid();
    if (!tgid_allowed(tgid))
        return 0;
    struct nccl_key k = {};
    k.tgid = tgid;
    k.op = op;
    k.comm = comm;
    struct nccl_counters *c = nccl_calls.lookup(&k);
    if (!c) {
        struct nccl_counters zero = {};
        if (nccl_calls.insert(&k, &zero) == 0)
            stat_add(SENTINEL_STAT_NCCL_NEW, 1);
        c = nccl_calls.lookup(&k);
        if (!c)
            return 0;
    }
    __sync_fetch_and_add(&c->calls, 1);
    if (has_dtype) {
        u32 size = nccl_dtype_size(dtype);
        if (size)
            __sync_fetch_and_add(&c->bytes, count * size);
        else
            __sync_fetch_and_add(&c->bad_dtype, 1);
    }
    return 0;
}

/* ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream) */
int nccl_all_gather(struct pt_regs *ctx)
{
    return nccl_count(SENTINEL_NCCL_ALL_GATHER, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                      PT_REGS_PARM5(ctx), 1);
}

/* ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream) */
int nccl_reduce_scatter(struct pt_regs *ctx)
{
    return nccl_count(SENTINEL_NCCL_REDUCE_SCATTER, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                      PT_REGS_PARM6(ctx), 1);
}

/* ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream) */
int nccl_all_reduce(struct pt_regs *ctx)
{
    return nccl_count(SENTINEL_NCCL_ALL_REDUCE, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                      PT_REGS_PARM6(ctx), 1);
}

/* ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream) */
int nccl_broadcast(struct pt_regs *ctx)
{
    return nccl_count(SENTINEL_NCCL_BROADCAST, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                      PT_REGS_PARM6(ctx), 1);
}

/* ncclSend(sendbuff, count, datatype, peer, comm, stream) */
int nccl_send(struct pt_regs *ctx)
{
    return nccl_count(SENTINEL_NCCL_SEND, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx),
                      PT_REGS_PARM5(ctx), 1);
}

/* ncclRecv(recvbuff, count, datatype, peer, comm, stream) */
int nccl_recv(struct pt_regs *ctx)
{
    return nccl_count(SENTINEL_NCCL_RECV, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx),
                      PT_REGS_PARM5(ctx), 1);
}

int nccl_group_start(struct pt_regs *ctx)
{
    return nccl_count(SENTINEL_NCCL_GROUP_START, 0, 0, 0, 0);
}

int nccl_group_end(struct pt_regs *ctx)
{
    return nccl_count(SENTINEL_NCCL_GROUP_END, 0, 0, 0, 0);
}

/* ncclCommInitRank(comm *, nranks, id (in memory), rank) and
 * ncclCommInitRankConfig(comm *, nranks, id (in memory), rank, config *) */
int nccl_comm_init_rank(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!tgid_allowed(id >> 32))
        return 0;
    struct nccl_init_args a = {};
    a.commp = PT_REGS_PARM1(ctx);
    a.nranks = (s32)PT_REGS_PARM2(ctx);
    a.rank = (s32)PT_REGS_PARM3(ctx);
    nccl_inits.update(&id, &a);
    return 0;
}

int nccl_comm_init_rank_ret(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct nccl_init_args *a = nccl_inits.lookup(&id);
    if (!a)
        return 0;
    u64 commp = a->commp;
    struct nccl_comm_info info = {};
    info.tgid = id >> 32;
    info.rank = a->rank;
    info.nranks = a->nranks;
    nccl_inits.delete(&id);
    if (PT_REGS_RC(ctx) != 0) /* ncclSuccess is 0 */
        return 0;
    u64 comm = 0;
    if (bpf_probe_read_user(&comm, sizeof(comm), (void *)commp) != 0 || !comm)
        return 0;
    nccl_comms.update(&comm, &info);
    return 0;
}
