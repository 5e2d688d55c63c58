/* verbs_caller.c: calls Debian's real libibverbs.so.1 control entry points
 * with hand-made queue-pair structs, for the uprobe attach test. There is
 * no RDMA device here, so each call crashes inside the library after the
 * uprobe on its entry has fired; a SIGSEGV handler turns that into a clean
 * exit of a forked child. Layouts: struct ibv_qp (qp_num at 52, qp_type at
 * 60) and struct ibv_qp_attr (qp_state at 0, dest_qp_num at 28), per
 * <infiniband/verbs.h>. */
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_segv(int sig)
{
    (void)sig;
    _exit(0);
}

typedef int (*modify_fn)(void *qp, void *attr, int mask);
typedef int (*destroy_fn)(void *qp);

static void in_child(void (*fn)(void *), void *lib)
{
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGSEGV, on_segv);
        signal(SIGBUS, on_segv);
        fn(lib);
        _exit(0);
    }
    waitpid(pid, NULL, 0);
}

static unsigned char qp[256], attr[256], fake_ctx[4096];

static void fill_qp(void)
{
    uint32_t qp_num = 4242, qp_type = 2; /* IBV_QPT_RC */
    void *ctx = fake_ctx + 2048;
    memset(qp, 0, sizeof(qp));
    memcpy(qp, &ctx, sizeof(ctx));
    memcpy(qp + 52, &qp_num, 4);
    memcpy(qp + 60, &qp_type, 4);
}

static void do_modify(void *lib)
{
    modify_fn f = (modify_fn)dlsym(lib, "ibv_modify_qp");
    uint32_t state = 3, dest = 777; /* IBV_QPS_RTR */
    memset(attr, 0, sizeof(attr));
    memcpy(attr, &state, 4);
    memcpy(attr + 28, &dest, 4);
    fill_qp();
    f(qp, attr, 1 | (1 << 20)); /* IBV_QP_STATE | IBV_QP_DEST_QPN */
}

static void do_destroy(void *lib)
{
    destroy_fn f = (destroy_fn)dlsym(lib, "ibv_destroy_qp");
    fill_qp();
    f(qp);
}

int main(void)
{
    char line[16];
    void *lib = dlopen("libibverbs.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof(line), stdin))
        return 1;
    in_child(do_modify, lib);
    in_child(do_destroy, lib);
    printf("done\n");
    fflush(stdout);
    return 0;
}
