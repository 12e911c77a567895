/* The verbs calls of the RDMA data loop (_rdmaloop.c), as a table of function pointers.
 *
 * The loop never calls libibverbs directly: rl_ops_verbs() is the table over the real
 * library (ibv_post_send and ibv_poll_cq are static inline in verbs.h, so its entries are
 * small wrappers), rl_ops_stub() a device that completes every work request at once without
 * moving a byte (the stub ceiling of `mooncake bench transfer --stub-device`), and the tests
 * bring a strict fake RC provider (tests/transfer/fake_rdma.c) through the same table.
 * Every call returns what its libibverbs namesake returns: NULL with errno set, or an errno
 * value (post_send, modify_qp, destroy and dereg calls), or a count (poll_cq; < 0 an error).
 */
#ifndef MOONCAKE_RDMALOOP_H
#define MOONCAKE_RDMALOOP_H

#include <infiniband/verbs.h>
#include <stddef.h>
#include <stdint.h>

struct mc_verbs_ops {
    const char *name; /* "verbs", "stub", "fake" */
    /* control plane: opening, registering, creating and connecting */
    struct ibv_context *(*open_device)(const char *name);
    int (*close_device)(struct ibv_context *ctx);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *ctx);
    int (*dealloc_pd)(struct ibv_pd *pd);
    struct ibv_cq *(*create_cq)(struct ibv_context *ctx, int cqe);
    int (*destroy_cq)(struct ibv_cq *cq);
    struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
    int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
    int (*destroy_qp)(struct ibv_qp *qp);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t length, int access);
    struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *pd, uint64_t offset, size_t length,
                                    uint64_t iova, int fd, int access);
    int (*dereg_mr)(struct ibv_mr *mr);
    /* data plane: what the loop calls per chain and per poll */
    int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
    int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
};

#endif
