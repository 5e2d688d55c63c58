/* nccl_stub.c: a STUB of libnccl for the probe tests. It exports the same
 * symbols with the same C signatures (x86-64 ABI) as NCCL 2.x's nccl.h, and
 * does no communication: each call returns ncclSuccess. The tests build it
 * as libnccl-stub.so, so the probes' /proc/PID/maps scan finds it the way it
 * finds the real libnccl.so.2. */
#include <stddef.h>
#include <stdlib.h>

typedef enum { ncclSuccess = 0, ncclInvalidArgument = 4 } ncclResult_t;
typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef struct CUstream_st *cudaStream_t;
typedef struct { size_t size; unsigned int magic, version; int blocking; } ncclConfig_t;

struct ncclComm { int nranks, rank; };

#define EXPORT __attribute__((visibility("default"), noinline))

/* Keeps the compiler from folding calls away. */
volatile size_t nccl_stub_sink;

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    for (int i = 0; i < 128; i++)
        id->internal[i] = (char)i;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    struct ncclComm *c = malloc(sizeof(*c));
    if (!c)
        return ncclInvalidArgument;
    c->nranks = nranks;
    c->rank = rank;
    nccl_stub_sink += (size_t)id.internal[5];
    *comm = c;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id,
                                           int rank, ncclConfig_t *config)
{
    (void)config;
    return ncclCommInitRank(comm, nranks, id, rank);
}

EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    free(comm);
    return ncclSuccess;
}

EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                  ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
    nccl_stub_sink += sendcount + (size_t)datatype + (size_t)sendbuff + (size_t)recvbuff +
                      (size_t)comm + (size_t)stream;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream)
{
    nccl_stub_sink += recvcount + (size_t)datatype + (size_t)op + (size_t)sendbuff +
                      (size_t)recvbuff + (size_t)comm + (size_t)stream;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                                  ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream)
{
    nccl_stub_sink += count + (size_t)datatype + (size_t)op + (size_t)sendbuff +
                      (size_t)recvbuff + (size_t)comm + (size_t)stream;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                                  ncclDataType_t datatype, int root, ncclComm_t comm,
                                  cudaStream_t stream)
{
    nccl_stub_sink += count + (size_t)datatype + (size_t)root + (size_t)sendbuff +
                      (size_t)recvbuff + (size_t)comm + (size_t)stream;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype,
                             int peer, ncclComm_t comm, cudaStream_t stream)
{
    nccl_stub_sink += count + (size_t)datatype + (size_t)peer + (size_t)sendbuff +
                      (size_t)comm + (size_t)stream;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                             ncclComm_t comm, cudaStream_t stream)
{
    nccl_stub_sink += count + (size_t)datatype + (size_t)peer + (size_t)recvbuff +
                      (size_t)comm + (size_t)stream;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGroupStart(void)
{
    nccl_stub_sink++;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGroupEnd(void)
{
    nccl_stub_sink++;
    return ncclSuccess;
}
