/* A fake RDMA provider for the C data loop's tests: the loop's verbs table
 * (mooncake/native/_rdmaloop.h) over RC queue pairs emulated in this process, as strict as
 * hardware on what the loop relies on. Built by tests/transfer/rdmaloop_helpers.py.
 *
 * - QPs go RESET -> INIT -> RTR -> RTS; post_send on a QP not in RTS (or ERR) is EINVAL.
 *   RTR names the peer QP by number; both ends live in this process.
 * - post_send takes a chain (wr->next) in one call; past max_send_wr outstanding requests
 *   it stops with ENOMEM and *bad_wr at the first one not posted (those before it are).
 * - The "device" executes posted requests when a CQ is polled (unless fake_hold(1)), in
 *   order per QP: RDMA WRITE and READ copy bytes between registered ranges (memcpy); the
 *   lkey must be a live MR of the QP's PD covering the range (else LOC_PROT_ERR), the rkey
 *   a live MR of the peer QP's PD (else REM_ACCESS_ERR).
 * - A completion is queued only for a signalled request, or for one that failed (an error
 *   completes anyway). Send-queue slots are freed when a completion is polled: every slot
 *   up to that request's, so an unsignalled request's slot comes back with the next
 *   signalled completion.
 * - An error completion puts the QP in ERR; every request still queued, or posted later,
 *   completes with WR_FLUSH_ERR (signalled or not). fake_fail_qp makes the n-th next
 *   request of a QP fail with a given status (a QP forced into error mid-batch).
 * - Use of a deregistered MR's lkey, posting to a destroyed QP, a CQ overrun or destroying
 *   a CQ still in use is what crashes or corrupts memory on hardware: each is recorded as
 *   a fatal (fake_num_fatal, fake_last_fatal), which the tests check is zero.
 * One global lock serialises everything: the loop's concurrency is what is under test.
 */
#define _GNU_SOURCE
#include "_rdmaloop.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_OBJECTS 65536

typedef struct {
    struct ibv_cq cq;
    int cap, head, count, destroyed, num_qps;
    struct ibv_wc *ring;
    struct fake_qp **owner; /* the QP of each queued completion */
    uint64_t *seq;          /* and its send-queue sequence number */
} fake_cq;

typedef struct {
    struct ibv_mr mr;
    int live;
} fake_mr;

typedef struct {
    uint64_t wr_id, laddr, raddr;
    uint32_t length, lkey, rkey;
    int opcode, signaled;
} fake_sqe;

typedef struct fake_qp {
    struct ibv_qp qp;
    fake_cq *cq;
    uint32_t max_send_wr, dest_qpn;
    uint64_t head, exec, tail; /* slots [head, tail) held; [exec, tail) not yet executed */
    fake_sqe *sq;
    int destroyed, fail_after, fail_status;
} fake_qp;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static fake_mr *mrs[MAX_OBJECTS]; /* by key: never freed, so a dead key is recognised */
static fake_qp *qps[MAX_OBJECTS]; /* by QP number */
static uint32_t next_key = 1, next_qpn = 1;
static int hold;
static int num_fatal;
static char last_fatal[256];
static uint64_t max_sq_used, num_post_calls, num_wrs, num_completions;

static void fatal(const char *what, uint64_t value) {
    num_fatal++;
    snprintf(last_fatal, sizeof(last_fatal), "%s (%#llx)", what, (unsigned long long)value);
}

/* ---- objects ---------------------------------------------------------------------------- */

static struct ibv_context *f_open_device(const char *name) {
    (void)name;
    return calloc(1, sizeof(struct ibv_context));
}
static int f_close_device(struct ibv_context *c) {
    free(c);
    return 0;
}
static struct ibv_pd *f_alloc_pd(struct ibv_context *c) {
    struct ibv_pd *pd = calloc(1, sizeof(*pd));
    if (pd) pd->context = c;
    return pd;
}
static int f_dealloc_pd(struct ibv_pd *pd) {
    free(pd);
    return 0;
}
static struct ibv_cq *f_create_cq(struct ibv_context *c, int cqe) {
    fake_cq *cq = calloc(1, sizeof(*cq));
    cq->ring = calloc((size_t)cqe, sizeof(struct ibv_wc));
    cq->owner = calloc((size_t)cqe, sizeof(fake_qp *));
    cq->seq = calloc((size_t)cqe, sizeof(uint64_t));
    cq->cap = cqe;
    cq->cq.context = c;
    cq->cq.cqe = cqe;
    return &cq->cq;
}
static int f_destroy_cq(struct ibv_cq *c) {
    fake_cq *cq = (fake_cq *)c;
    pthread_mutex_lock(&lock);
    int busy = cq->num_qps > 0;
    if (busy) fatal("destroy_cq with QPs attached", 0);
    cq->destroyed = 1; /* NOTE: kept: a later poll of it is recorded, not a crash here */
    pthread_mutex_unlock(&lock);
    return busy ? EBUSY : 0;
}
static struct ibv_qp *f_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *a) {
    pthread_mutex_lock(&lock);
    fake_qp *q = NULL;
    if (next_qpn >= MAX_OBJECTS || a->qp_type != IBV_QPT_RC || a->send_cq == NULL) {
        errno = EINVAL;
        goto out;
    }
    q = calloc(1, sizeof(*q));
    q->sq = calloc(a->cap.max_send_wr, sizeof(fake_sqe));
    q->max_send_wr = a->cap.max_send_wr;
    q->cq = (fake_cq *)a->send_cq;
    q->cq->num_qps++;
    q->fail_after = -1;
    q->qp.pd = pd;
    q->qp.context = pd->context;
    q->qp.send_cq = a->send_cq;
    q->qp.recv_cq = a->recv_cq;
    q->qp.qp_type = IBV_QPT_RC;
    q->qp.state = IBV_QPS_RESET;
    q->qp.qp_num = next_qpn++;
    qps[q->qp.qp_num] = q;
out:
    pthread_mutex_unlock(&lock);
    return q ? &q->qp : NULL;
}
static int f_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask) {
    fake_qp *q = (fake_qp *)qp;
    int rc = 0;
    pthread_mutex_lock(&lock);
    if (!(mask & IBV_QP_STATE)) {
        rc = EINVAL;
    } else if (a->qp_state == IBV_QPS_ERR) {
        qp->state = IBV_QPS_ERR;
    } else if (a->qp_state == IBV_QPS_INIT && qp->state == IBV_QPS_RESET) {
        rc = (mask & IBV_QP_PORT) && a->port_num >= 1 ? 0 : EINVAL;
        if (!rc) qp->state = IBV_QPS_INIT;
    } else if (a->qp_state == IBV_QPS_RTR && qp->state == IBV_QPS_INIT) {
        rc = (mask & IBV_QP_DEST_QPN) && (mask & IBV_QP_PATH_MTU) ? 0 : EINVAL;
        if (!rc) qp->state = IBV_QPS_RTR, q->dest_qpn = a->dest_qp_num;
    } else if (a->qp_state == IBV_QPS_RTS && qp->state == IBV_QPS_RTR) {
        rc = (mask & IBV_QP_SQ_PSN) ? 0 : EINVAL;
        if (!rc) qp->state = IBV_QPS_RTS;
    } else {
        rc = EINVAL;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}
static int f_destroy_qp(struct ibv_qp *qp) {
    fake_qp *q = (fake_qp *)qp;
    pthread_mutex_lock(&lock);
    q->destroyed = 1; /* NOTE: kept, so a later post is recorded as a use after free */
    q->cq->num_qps--;
    fake_cq *cq = q->cq; /* mlx5 cleans its completions out of the CQ */
    int kept = 0;
    for (int i = 0; i < cq->count; i++) {
        int from = (cq->head + i) % cq->cap, to = (cq->head + kept) % cq->cap;
        if (cq->owner[from] == q) continue;
        cq->ring[to] = cq->ring[from], cq->owner[to] = cq->owner[from];
        cq->seq[to] = cq->seq[from];
        kept++;
    }
    cq->count = kept;
    pthread_mutex_unlock(&lock);
    return 0;
}
static struct ibv_mr *f_reg(struct ibv_pd *pd, void *addr, size_t length) {
    pthread_mutex_lock(&lock);
    fake_mr *m = NULL;
    if (next_key >= MAX_OBJECTS) {
        errno = ENOMEM;
        goto out;
    }
    m = calloc(1, sizeof(*m));
    m->mr.pd = pd;
    m->mr.context = pd->context;
    m->mr.addr = addr;
    m->mr.length = length;
    m->mr.lkey = m->mr.rkey = next_key++;
    m->live = 1;
    mrs[m->mr.lkey] = m;
out:
    pthread_mutex_unlock(&lock);
    return m ? &m->mr : NULL;
}
static struct ibv_mr *f_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access) {
    (void)access;
    return f_reg(pd, addr, length);
}
static struct ibv_mr *f_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length,
                                      uint64_t iova, int fd, int access) {
    (void)pd, (void)offset, (void)length, (void)iova, (void)fd, (void)access;
    errno = EOPNOTSUPP; /* no dma-buf here */
    return NULL;
}
static int f_dereg_mr(struct ibv_mr *mr) {
    pthread_mutex_lock(&lock);
    ((fake_mr *)mr)->live = 0; /* NOTE: the record stays: its key is recognised as dead */
    pthread_mutex_unlock(&lock);
    return 0;
}

/* ---- the device ------------------------------------------------------------------------- */

/* The MR of `key` covering [addr, addr + length) in `pd`; NULL when refused (a dead key
 * is also recorded as a fatal when `local`: the NIC would use freed memory). */
static fake_mr *lookup_mr(uint32_t key, struct ibv_pd *pd, uint64_t addr, uint32_t length,
                          int local) {
    fake_mr *m = key < MAX_OBJECTS ? mrs[key] : NULL;
    if (m == NULL) return NULL;
    if (!m->live) {
        if (local) fatal("work request with a deregistered MR's lkey", key);
        return NULL;
    }
    uint64_t start = (uint64_t)(uintptr_t)m->mr.addr;
    if (m->mr.pd != pd || addr < start || addr + length > start + m->mr.length) return NULL;
    return m;
}

static void push_completion(fake_qp *q, uint64_t seq, enum ibv_wc_status status) {
    fake_cq *cq = q->cq;
    if (cq->count == cq->cap) { /* the completion is lost and every QP of the CQ fails */
        fatal("CQ overrun", cq->cap);
        return;
    }
    int at = (cq->head + cq->count++) % cq->cap;
    fake_sqe *e = &q->sq[seq % q->max_send_wr];
    struct ibv_wc *wc = &cq->ring[at];
    memset(wc, 0, sizeof(*wc));
    wc->wr_id = e->wr_id;
    wc->status = status;
    wc->opcode = e->opcode == IBV_WR_RDMA_WRITE ? IBV_WC_RDMA_WRITE : IBV_WC_RDMA_READ;
    wc->qp_num = q->qp.qp_num;
    wc->byte_len = e->length;
    cq->owner[at] = q;
    cq->seq[at] = seq;
}

static enum ibv_wc_status execute(fake_qp *q, fake_sqe *e) {
    if (q->fail_after >= 0 && q->fail_after-- == 0) return (enum ibv_wc_status)q->fail_status;
    fake_qp *peer = q->dest_qpn < MAX_OBJECTS ? qps[q->dest_qpn] : NULL;
    if (lookup_mr(e->lkey, q->qp.pd, e->laddr, e->length, 1) == NULL) return IBV_WC_LOC_PROT_ERR;
    if (peer == NULL || peer->destroyed || peer->qp.state < IBV_QPS_RTR ||
        peer->qp.state == IBV_QPS_ERR)
        return IBV_WC_RETRY_EXC_ERR;
    if (lookup_mr(e->rkey, peer->qp.pd, e->raddr, e->length, 0) == NULL)
        return IBV_WC_REM_ACCESS_ERR;
    void *local = (void *)(uintptr_t)e->laddr, *remote = (void *)(uintptr_t)e->raddr;
    if (e->opcode == IBV_WR_RDMA_WRITE)
        memcpy(remote, local, e->length);
    else
        memcpy(local, remote, e->length);
    return IBV_WC_SUCCESS;
}

/* Execute the queued requests of every QP on `cq`, in order per QP. */
static void run_device(fake_cq *cq) {
    if (hold) return;
    for (uint32_t n = 1; n < next_qpn; n++) {
        fake_qp *q = qps[n];
        if (q == NULL || q->cq != cq || q->destroyed) continue;
        for (; q->exec < q->tail; q->exec++) {
            fake_sqe *e = &q->sq[q->exec % q->max_send_wr];
            enum ibv_wc_status st = IBV_WC_WR_FLUSH_ERR;
            if (q->qp.state != IBV_QPS_ERR && (st = execute(q, e)) != IBV_WC_SUCCESS)
                q->qp.state = IBV_QPS_ERR;
            if (st != IBV_WC_SUCCESS || e->signaled) push_completion(q, q->exec, st);
        }
    }
}

static int f_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
    fake_qp *q = (fake_qp *)qp;
    int rc = 0;
    pthread_mutex_lock(&lock);
    num_post_calls++;
    if (q->destroyed) {
        fatal("post_send on a destroyed QP", qp->qp_num);
        rc = EINVAL;
    } else if (qp->state != IBV_QPS_RTS && qp->state != IBV_QPS_ERR) {
        rc = EINVAL;
    }
    for (; rc == 0 && wr != NULL; wr = wr->next) {
        if (wr->num_sge != 1 ||
            (wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_READ)) {
            rc = EINVAL;
            break;
        }
        if (q->tail - q->head == q->max_send_wr) {
            rc = ENOMEM;
            break;
        }
        fake_sqe *e = &q->sq[q->tail % q->max_send_wr];
        *e = (fake_sqe){wr->wr_id, wr->sg_list[0].addr, wr->wr.rdma.remote_addr,
                        wr->sg_list[0].length, wr->sg_list[0].lkey, wr->wr.rdma.rkey,
                        wr->opcode, (wr->send_flags & IBV_SEND_SIGNALED) != 0};
        q->tail++;
        num_wrs++;
        if (q->tail - q->head > max_sq_used) max_sq_used = q->tail - q->head;
    }
    if (rc) *bad = wr;
    pthread_mutex_unlock(&lock);
    return rc;
}

static int f_poll_cq(struct ibv_cq *c, int n, struct ibv_wc *wc) {
    fake_cq *cq = (fake_cq *)c;
    pthread_mutex_lock(&lock);
    if (cq->destroyed) fatal("poll_cq on a destroyed CQ", 0);
    run_device(cq);
    int k = 0;
    for (; k < n && cq->count > 0; k++) {
        wc[k] = cq->ring[cq->head];
        fake_qp *q = cq->owner[cq->head];
        if (cq->seq[cq->head] + 1 > q->head) q->head = cq->seq[cq->head] + 1; /* slots freed */
        cq->head = (cq->head + 1) % cq->cap;
        cq->count--;
    }
    num_completions += (uint64_t)k;
    pthread_mutex_unlock(&lock);
    return k;
}

static const struct mc_verbs_ops fake_ops = {
    "fake",      f_open_device, f_close_device,  f_alloc_pd,  f_dealloc_pd,
    f_create_cq, f_destroy_cq,  f_create_qp,     f_modify_qp, f_destroy_qp,
    f_reg_mr,    f_reg_dmabuf_mr, f_dereg_mr,    f_post_send, f_poll_cq,
};

/* ---- what the tests call ---------------------------------------------------------------- */

const struct mc_verbs_ops *fake_provider(void) { return &fake_ops; }

/* 1: the device executes nothing (work stays in flight); 0: it runs again. */
void fake_hold(int on) {
    pthread_mutex_lock(&lock);
    hold = on;
    pthread_mutex_unlock(&lock);
}

/* The request `after` requests from now on QP `qpn` fails with `status`; 0 or -EINVAL. */
int fake_fail_qp(uint32_t qpn, int after, int status) {
    pthread_mutex_lock(&lock);
    fake_qp *q = qpn < MAX_OBJECTS ? qps[qpn] : NULL;
    if (q) q->fail_after = after, q->fail_status = status;
    pthread_mutex_unlock(&lock);
    return q ? 0 : -EINVAL;
}

/* Run the device for QP `qpn`'s CQ now (its completions stay queued for a poll). */
void fake_run(uint32_t qpn) {
    pthread_mutex_lock(&lock);
    if (qpn < MAX_OBJECTS && qps[qpn]) run_device(qps[qpn]->cq);
    pthread_mutex_unlock(&lock);
}

int fake_num_fatal(void) { return num_fatal; }
const char *fake_last_fatal(void) { return last_fatal; }

/* Post one signalled WRITE with raw keys on QP `qpn` (for checking the fake itself); its
 * wr_id names no QP of the loop, which counts its completion as stale. */
int fake_post_raw(uint32_t qpn, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                  uint32_t length) {
    fake_qp *q = qpn < MAX_OBJECTS ? qps[qpn] : NULL;
    if (q == NULL) return -EINVAL;
    struct ibv_sge sge = {laddr, length, lkey};
    struct ibv_send_wr wr = {.wr_id = ~0ULL, .sg_list = &sge, .num_sge = 1,
                             .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED};
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    struct ibv_send_wr *bad;
    return f_post_send(&q->qp, &wr, &bad);
}

/* Counters: post_send calls, work requests posted, completions polled, the most send-queue
 * slots any QP held at once, live MRs. */
void fake_stats(uint64_t *out) {
    pthread_mutex_lock(&lock);
    uint64_t live = 0;
    for (uint32_t k = 1; k < next_key; k++) live += mrs[k] && mrs[k]->live;
    out[0] = num_post_calls, out[1] = num_wrs, out[2] = num_completions, out[3] = max_sq_used;
    out[4] = live;
    pthread_mutex_unlock(&lock);
}
