/* nccl_caller.c: calls the NCCL API a known number of times with known
 * sizes, for the probe tests. Linked against the stub (nccl_stub.c) here,
 * but written against nccl.h's declarations, so it runs against real NCCL's
 * symbols the same way. Prints "ready" once loaded, waits for a line on
 * stdin, makes the calls, prints "done". Argument: the rank to init with. */
#include <stdio.h>
#include <stdlib.h>

typedef int ncclResult_t;
typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct CUstream_st *cudaStream_t;

ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclAllGather(const void *s, void *r, size_t n, int dt, ncclComm_t c, cudaStream_t st);
ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, int dt, int op, ncclComm_t c,
                               cudaStream_t st);
ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, ncclComm_t c,
                           cudaStream_t st);
ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, ncclComm_t c,
                           cudaStream_t st);
ncclResult_t ncclSend(const void *s, size_t n, int dt, int peer, ncclComm_t c, cudaStream_t st);
ncclResult_t ncclRecv(void *r, size_t n, int dt, int peer, ncclComm_t c, cudaStream_t st);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

enum { ncclInt8 = 0, ncclInt32 = 2, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9 };

int main(int argc, char **argv)
{
    int rank = argc > 1 ? atoi(argv[1]) : 0;
    char line[16];
    static char buf[1 << 16];
    ncclUniqueId id;
    ncclComm_t comm;
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof(line), stdin))
        return 1;
    ncclGetUniqueId(&id);
    if (ncclCommInitRank(&comm, 4, id, rank) != 0)
        return 2;
    for (int i = 0; i < 3; i++)
        ncclAllGather(buf, buf, 1000, ncclFloat32, comm, 0); /* 3 x 4000 B */
    for (int i = 0; i < 2; i++)
        ncclReduceScatter(buf, buf, 250, ncclBfloat16, 0, comm, 0); /* 2 x 500 B */
    ncclAllReduce(buf, buf, 7, ncclFloat64, 0, comm, 0); /* 56 B */
    ncclBroadcast(buf, buf, 5, ncclInt8, 0, comm, 0);    /* 5 B */
    ncclAllReduce(buf, buf, 3, 99, 0, comm, 0);          /* unknown datatype */
    ncclGroupStart();
    ncclSend(buf, 10, ncclInt32, 1, comm, 0); /* 40 B */
    ncclRecv(buf, 10, ncclInt32, 3, comm, 0); /* 40 B */
    ncclGroupEnd();
    printf("done %p\n", (void *)comm);
    fflush(stdout);
    fgets(line, sizeof(line), stdin);
    ncclCommDestroy(comm);
    return 0;
}
