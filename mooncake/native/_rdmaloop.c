/* The RDMA data loop in C: one-sided READ/WRITE batches posted as chains of work requests
 * on RC queue pairs and completed by one poller thread per NIC, with no Python and no GIL.
 * Loaded by mooncake/native/rdmaloop.py: the calls that may block (rl_wait, rl_finish with a
 * timeout, opening and closing) release the GIL; those that return at once (rl_submit, the
 * poll form of rl_finish, rl_result, rl_free) keep it, since a thread that gives the GIL
 * up waits a whole switch interval (5 ms) to get it back from a busy Python thread.
 *
 * Who owns what. C owns the data-plane verbs objects it posts to: per NIC a device context,
 * a protection domain and its completion queues; queue pairs; memory regions ("regions",
 * each registered on every NIC, all or none, host memory or a dma-buf). Python keeps
 * discovery (which devices, ports and GIDs), the connection handshake (it passes the peer's
 * GID, QPN, PSN and MTU down to rl_qp_connect), path choice, pausing and retries.
 *
 * A batch (rl_submit) is a set of requests in arrays, one entry per request: op, local
 * region handle, offset in it, offset in the remote segment, length; and the paths it may
 * use: a QP handle each with the remote NIC's base address and rkey of that segment (keys
 * differ per NIC, so they belong to the path, not the request). C cuts the requests into
 * slices of slice_bytes and hands them out through one atomic cursor to the batch's QPs
 * in turn, each QP posting a chain of up to max_chain work requests in one post_send,
 * signalled every signal_every-th request and on the chain's last.
 *
 * Send-queue room is counted by signalled requests: every posted request takes a slot in
 * its QP's ring (ring[seq % depth]), and a polled completion frees every slot up to its
 * own (RC completes in order), so an unsignalled request's slot comes back with the next
 * signalled one's completion. A CQ has room for the full send queue of every QP on it (a
 * QP in error flushes each request with its own completion), so it cannot overrun; a QP
 * that finds no CQ with room gets a new one (cq_depth entries, up to RL_MAX_CQS per NIC),
 * so the number of peers is not bounded by one CQ.
 *
 * A NIC's poller thread polls its CQs while that NIC has requests in flight and sleeps on a
 * condition otherwise; after each completion it refills that QP from the batches it
 * serves. The waiter of a batch (rl_wait) blocks on the batch's eventfd, written once when
 * the batch's last slice finished (after an optional short spin); the eventfd is made only
 * when someone has to sleep, so a batch polled after it finished costs no system call.
 *
 * Failures. An error completion moves its QP to the error state (the slices before it in
 * the ring succeeded: RC completes in order); every later completion of that QP is a flush,
 * and once its ring is empty the QP is FAILED: its in-flight slices were recorded as failed
 * with the QP's handle and status, the batch's unposted slices go to its other live QPs,
 * or, when none is left, are recorded as failed too (RL_ST_NO_PATH). rl_result then gives
 * per request its status and per failed slice (request, offset, length, QP, status): one
 * report for Python's retry logic. A post_send refused (a bug: room is counted) fails the
 * unposted slices of that chain (RL_ST_POST) and moves the QP to error.
 *
 * Regions and closing. A request names its local memory by region handle; a closed or
 * unknown region or a range outside it fails that request at submit (RL_ST_BAD_REGION),
 * never posted. Every request of an unfinished batch holds a reference on its region:
 * rl_region_close deregisters at once when none is held, else the last batch to release it
 * does, so a key the NIC may still use is never deregistered under it.
 *
 * Handles. QP handles are indices never reused within an engine (a destroyed QP keeps a
 * small record: a batch may still name it and its stale completions are recognised);
 * region handles carry a generation. wr_id = QP handle << 40 | sequence number.
 */
#define _GNU_SOURCE
#include "_rdmaloop.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#define RL_MAX_NICS 16
#define RL_MAX_QPS 65536
#define RL_MAX_CQS 64 /* per NIC */
#define RL_MAX_REGIONS 4096
#define RL_POLL_BATCH 64
#define RL_SEQ_BITS 40
#define RL_SEQ_MASK ((1ULL << RL_SEQ_BITS) - 1)
#define RL_ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE)

enum { RL_OP_READ = 0, RL_OP_WRITE = 1 };
/* a request's status: 0 done, > 0 the ibv_wc_status of its first failed slice, < 0: */
enum { RL_ST_BAD_REGION = -1, RL_ST_NO_PATH = -2, RL_ST_POST = -3 };
enum { QP_NEW, QP_READY, QP_ERROR, QP_FAILED, QP_DESTROYED };
enum { REGION_FREE, REGION_LIVE, REGION_CLOSING, REGION_DEREGISTERING };

typedef struct rl_engine rl_engine;
typedef struct rl_batch rl_batch;

typedef struct {
    rl_batch *batch;
    uint32_t slice;
} rl_entry; /* one posted work request: ring[seq % depth] */

typedef struct rl_use { /* one path of a batch, linked into its QP's list of users */
    struct rl_use *prev, *next;
    rl_batch *batch;
    _Atomic int linked; /* changed under its QP's lock */
} rl_use;

typedef struct {
    pthread_mutex_t lock; /* ring, users, posting */
    rl_engine *e;
    struct ibv_qp *qp;
    uint32_t index, nic, cq, depth, qpn; /* cq: its index in the NIC's cqs */
    _Atomic int state;
    uint64_t head, tail; /* sequence numbers: [head, tail) posted, slots not yet freed */
    rl_entry *ring;
    uint32_t since_signal;
    rl_use users; /* sentinel of the batches this QP serves, oldest first */
    struct ibv_send_wr *wrs;
    struct ibv_sge *sges;
} rl_qp;

typedef struct {
    rl_engine *e;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    /* CQs of cq_depth entries each, added as QPs need room: cq_reserved[i] entries of
     * cqs[i] are promised to its QPs' send queues (written under the engine's lock;
     * num_cqs is stored after the CQ it counts, so the poller reads only created ones) */
    struct ibv_cq *cqs[RL_MAX_CQS];
    int cq_reserved[RL_MAX_CQS];
    _Atomic int num_cqs;
    int cq_depth;
    pthread_t poller;
    int has_poller;
    pthread_mutex_t lock; /* the poller's sleep; held by it while it handles completions */
    pthread_cond_t cond;
    _Atomic int sleeping;
    _Atomic int64_t inflight; /* posted work requests whose slots are not freed */
    _Atomic int stop;
    pthread_mutex_t busy; /* held while completions are handled; rl_qp_destroy takes it */
} rl_nic;

typedef struct {
    _Atomic int state;
    _Atomic int64_t refs; /* requests of unfinished batches naming it */
    uint32_t gen;
    uint64_t length;
    struct ibv_mr *mr[RL_MAX_NICS];
    uint64_t base[RL_MAX_NICS]; /* the address work requests name byte 0 by, per NIC */
} rl_region;

enum {
    STAT_POST_CALLS,
    STAT_WRS,
    STAT_SIGNALLED,
    STAT_COMPLETIONS,
    STAT_POLLS,
    STAT_POST_ERRORS,
    STAT_STALE,
    STAT_BATCHES,
    STAT_WAKEUPS,
    NUM_STATS
};

struct rl_engine {
    const struct mc_verbs_ops *ops;
    uint32_t signal_every, max_chain, spin_us;
    pthread_mutex_t lock; /* the tables below */
    uint32_t num_nics, num_qps;
    rl_nic nics[RL_MAX_NICS];
    rl_qp *_Atomic qps[RL_MAX_QPS];
    rl_region regions[RL_MAX_REGIONS];
    _Atomic uint64_t stats[NUM_STATS];
};

typedef struct {
    uint32_t req, len;
    uint64_t off; /* bytes into the request */
} rl_slice;

typedef struct {
    uint32_t slice, qp;
    int32_t status;
} rl_fail;

typedef struct {
    rl_qp *qp;
    uint64_t remote_base;
    uint32_t rkey;
} rl_path;

struct rl_batch {
    rl_engine *e;
    /* the eventfd a blocked waiter sleeps on: made by the first rl_wait that has to sleep
     * (-1 until then), so a batch finished before anyone waits costs no system call;
     * `finished` (set before efd is read) and efd (set before finished is read) are the
     * two sides of that handshake: one of them sees the other (seq_cst) */
    _Atomic int efd;
    _Atomic int finished;
    uint32_t num_reqs, num_slices, num_paths;
    uint8_t *op;
    uint32_t *region; /* index into e->regions, valid when req_status is 0 */
    uint64_t *loff, *roff;
    int32_t *req_status; /* refusals at submit */
    rl_slice *slices;
    rl_path *paths;
    rl_use *uses;
    _Atomic uint64_t cursor;    /* next slice to post */
    _Atomic uint32_t remaining; /* slices not finished */
    _Atomic uint32_t num_failed;
    _Atomic int done; /* set last (after any eventfd write): nothing touches it after */
    rl_fail *failed;
    int released;
};

static inline void stat_add(rl_engine *e, int which, uint64_t n) {
    atomic_fetch_add_explicit(&e->stats[which], n, memory_order_relaxed);
}

/* ---- the real table: libibverbs ------------------------------------------------------ */

static struct ibv_context *v_open_device(const char *name) {
    int num = 0;
    struct ibv_device **list = ibv_get_device_list(&num);
    if (list == NULL) return NULL;
    struct ibv_context *ctx = NULL;
    errno = ENODEV;
    for (int i = 0; i < num; i++)
        if (strcmp(ibv_get_device_name(list[i]), name) == 0) ctx = ibv_open_device(list[i]);
    ibv_free_device_list(list);
    return ctx;
}
static int v_close_device(struct ibv_context *c) { return ibv_close_device(c); }
static struct ibv_pd *v_alloc_pd(struct ibv_context *c) { return ibv_alloc_pd(c); }
static int v_dealloc_pd(struct ibv_pd *pd) { return ibv_dealloc_pd(pd); }
static struct ibv_cq *v_create_cq(struct ibv_context *c, int cqe) {
    return ibv_create_cq(c, cqe, NULL, NULL, 0);
}
static int v_destroy_cq(struct ibv_cq *cq) { return ibv_destroy_cq(cq); }
static struct ibv_qp *v_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *a) {
    return ibv_create_qp(pd, a);
}
static int v_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask) {
    return ibv_modify_qp(qp, a, mask);
}
static int v_destroy_qp(struct ibv_qp *qp) { return ibv_destroy_qp(qp); }
static struct ibv_mr *v_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access) {
    return ibv_reg_mr(pd, addr, len, access);
}
static struct ibv_mr *v_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len,
                                      uint64_t iova, int fd, int access) {
    return ibv_reg_dmabuf_mr(pd, offset, len, iova, fd, access);
}
static int v_dereg_mr(struct ibv_mr *mr) { return ibv_dereg_mr(mr); }
static int v_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
    return ibv_post_send(qp, wr, bad);
}
static int v_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc) { return ibv_poll_cq(cq, n, wc); }

static const struct mc_verbs_ops verbs_ops = {
    "verbs",      v_open_device, v_close_device,  v_alloc_pd,      v_dealloc_pd,
    v_create_cq,  v_destroy_cq,  v_create_qp,     v_modify_qp,     v_destroy_qp,
    v_reg_mr,     v_reg_dmabuf_mr, v_dereg_mr,    v_post_send,     v_poll_cq,
};

const struct mc_verbs_ops *rl_ops_verbs(void) { return &verbs_ops; }

/* ---- the stub table: every work request completes at once, nothing moves --------------- */

typedef struct {
    struct ibv_cq cq;
    pthread_spinlock_t lock;
    uint32_t cap, head, count;
    struct ibv_wc *ring;
} stub_cq;

static _Atomic uint32_t stub_next_key = 1, stub_next_qpn = 1;

static struct ibv_context *s_open_device(const char *name) {
    (void)name;
    return calloc(1, sizeof(struct ibv_context));
}
static int s_free(void *p) {
    free(p);
    return 0;
}
static int s_close_device(struct ibv_context *c) { return s_free(c); }
static struct ibv_pd *s_alloc_pd(struct ibv_context *c) {
    struct ibv_pd *pd = calloc(1, sizeof(*pd));
    if (pd) pd->context = c;
    return pd;
}
static int s_dealloc_pd(struct ibv_pd *pd) { return s_free(pd); }
static struct ibv_cq *s_create_cq(struct ibv_context *c, int cqe) {
    stub_cq *s = calloc(1, sizeof(*s));
    if (s == NULL) return NULL;
    s->ring = calloc((size_t)cqe, sizeof(struct ibv_wc));
    if (s->ring == NULL) {
        free(s);
        return NULL;
    }
    pthread_spin_init(&s->lock, PTHREAD_PROCESS_PRIVATE);
    s->cap = (uint32_t)cqe;
    s->cq.context = c;
    s->cq.cqe = cqe;
    return &s->cq;
}
static int s_destroy_cq(struct ibv_cq *cq) {
    stub_cq *s = (stub_cq *)cq;
    free(s->ring);
    return s_free(s);
}
static struct ibv_qp *s_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *a) {
    struct ibv_qp *qp = calloc(1, sizeof(*qp));
    if (qp == NULL) return NULL;
    qp->pd = pd;
    qp->context = pd->context;
    qp->send_cq = a->send_cq;
    qp->recv_cq = a->recv_cq;
    qp->qp_type = a->qp_type;
    qp->qp_num = atomic_fetch_add(&stub_next_qpn, 1);
    qp->state = IBV_QPS_RESET;
    return qp;
}
static int s_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask) {
    if (mask & IBV_QP_STATE) qp->state = a->qp_state;
    return 0;
}
static int s_destroy_qp(struct ibv_qp *qp) { return s_free(qp); }
static struct ibv_mr *s_reg(struct ibv_pd *pd, void *addr, size_t len) {
    struct ibv_mr *mr = calloc(1, sizeof(*mr));
    if (mr == NULL) return NULL;
    mr->pd = pd;
    mr->context = pd->context;
    mr->addr = addr;
    mr->length = len;
    mr->lkey = mr->rkey = atomic_fetch_add(&stub_next_key, 1);
    return mr;
}
static struct ibv_mr *s_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access) {
    (void)access;
    return s_reg(pd, addr, len);
}
static struct ibv_mr *s_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len,
                                      uint64_t iova, int fd, int access) {
    (void)offset, (void)fd, (void)access;
    return s_reg(pd, (void *)(uintptr_t)iova, len);
}
static int s_dereg_mr(struct ibv_mr *mr) { return s_free(mr); }
static int s_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
    stub_cq *s = (stub_cq *)qp->send_cq;
    pthread_spin_lock(&s->lock);
    for (; wr != NULL; wr = wr->next) {
        if (!(wr->send_flags & IBV_SEND_SIGNALED)) continue;
        if (s->count == s->cap) { /* an overrun: the loop sizes the CQ, so a bug of ours */
            pthread_spin_unlock(&s->lock);
            *bad = wr;
            return ENOSPC;
        }
        struct ibv_wc *wc = &s->ring[(s->head + s->count++) % s->cap];
        memset(wc, 0, sizeof(*wc));
        wc->wr_id = wr->wr_id;
        wc->status = IBV_WC_SUCCESS;
        wc->qp_num = qp->qp_num;
        wc->byte_len = wr->sg_list[0].length;
    }
    pthread_spin_unlock(&s->lock);
    return 0;
}
static int s_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc) {
    stub_cq *s = (stub_cq *)cq;
    pthread_spin_lock(&s->lock);
    int k = 0;
    for (; k < n && s->count > 0; k++) {
        wc[k] = s->ring[s->head];
        s->head = (s->head + 1) % s->cap;
        s->count--;
    }
    pthread_spin_unlock(&s->lock);
    return k;
}

static const struct mc_verbs_ops stub_ops = {
    "stub",      s_open_device, s_close_device,  s_alloc_pd,  s_dealloc_pd,
    s_create_cq, s_destroy_cq,  s_create_qp,     s_modify_qp, s_destroy_qp,
    s_reg_mr,    s_reg_dmabuf_mr, s_dereg_mr,    s_post_send, s_poll_cq,
};

const struct mc_verbs_ops *rl_ops_stub(void) { return &stub_ops; }

/* ---- batches: finishing slices ---------------------------------------------------------- */

static void finish_slices(rl_batch *b, uint32_t count) {
    if (count == 0) return;
    if (atomic_fetch_sub(&b->remaining, count) != count) return;
    atomic_store(&b->finished, 1);
    int fd = atomic_load(&b->efd);
    if (fd >= 0) { /* a waiter sleeps (or is about to) */
        uint64_t one = 1;
        ssize_t rc = write(fd, &one, sizeof(one));
        (void)rc;
        stat_add(b->e, STAT_WAKEUPS, 1);
    }
    atomic_store(&b->done, 1); /* NOTE: the last touch: the waiter may free b from here on */
}

/* Record slices [first, first + count) of b as failed on QP qp_index (finished by caller). */
static void record_failed(rl_batch *b, uint64_t first, uint32_t count, uint32_t qp_index,
                          int32_t status) {
    uint32_t at = atomic_fetch_add(&b->num_failed, count);
    for (uint32_t i = 0; i < count; i++)
        b->failed[at + i] = (rl_fail){(uint32_t)(first + i), qp_index, status};
}

/* Pop ring entries [q->head, upto) of q: ok ones finish, others are recorded as failed.
 * Consecutive entries of one batch finish together (one atomic per run). */
static void pop_entries(rl_qp *q, uint64_t upto, int32_t status) {
    rl_batch *run = NULL;
    uint32_t run_len = 0;
    for (; q->head < upto; q->head++) {
        rl_entry *en = &q->ring[q->head % q->depth];
        if (status != 0) record_failed(en->batch, en->slice, 1, q->index, status);
        if (en->batch != run) {
            if (run) finish_slices(run, run_len);
            run = en->batch;
            run_len = 0;
        }
        run_len++;
    }
    if (run) finish_slices(run, run_len);
}

/* ---- posting ---------------------------------------------------------------------------- */

/* Whether a QP of b still serves it: a QP unlinks a batch once every slice is posted or
 * when it failed (drained), and then checks this, so one of them sees the other gone. */
static int batch_has_live_path(rl_batch *b) {
    for (uint32_t p = 0; p < b->num_paths; p++)
        if (atomic_load(&b->uses[p].linked)) return 1;
    return 0;
}

static void unlink_use(rl_use *u) {
    if (!u->linked) return;
    u->prev->next = u->next;
    u->next->prev = u->prev;
    u->linked = 0;
}

static void qp_to_error(rl_qp *q) {
    int ready = QP_READY;
    if (!atomic_compare_exchange_strong(&q->state, &ready, QP_ERROR)) return;
    struct ibv_qp_attr attr = {.qp_state = IBV_QPS_ERR};
    q->e->ops->modify_qp(q->qp, &attr, IBV_QP_STATE); /* NOTE: its work flushes either way */
}

/* Under q->lock, a QP in error whose ring is empty: FAILED. Batches with no live path
 * left get their unposted slices recorded as failed. */
static void maybe_drained(rl_qp *q) {
    if (atomic_load(&q->state) != QP_ERROR || q->head != q->tail) return;
    atomic_store(&q->state, QP_FAILED);
    while (q->users.next != &q->users) {
        rl_use *u = q->users.next;
        unlink_use(u);
        rl_batch *b = u->batch;
        if (batch_has_live_path(b)) continue; /* its other QPs take the rest */
        uint64_t first = atomic_fetch_add(&b->cursor, b->num_slices);
        if (first >= b->num_slices) continue;
        uint32_t count = b->num_slices - (uint32_t)first;
        record_failed(b, first, count, q->index, RL_ST_NO_PATH);
        finish_slices(b, count);
    }
}

/* Under q->lock: post one chain of the next slices of the batches q serves; returns the
 * number of work requests posted (0: no room or no work). */
static uint32_t post_chain(rl_qp *q) {
    rl_engine *e = q->e;
    if (atomic_load(&q->state) != QP_READY) return 0;
    uint32_t room = q->depth - (uint32_t)(q->tail - q->head);
    if (room == 0) return 0;
    uint32_t want = room < e->max_chain ? room : e->max_chain;
    rl_batch *b = NULL;
    rl_path *path = NULL;
    uint64_t first = 0;
    uint32_t count = 0;
    while (q->users.next != &q->users) {
        rl_use *u = q->users.next;
        b = u->batch;
        first = atomic_fetch_add(&b->cursor, want);
        if (first < b->num_slices) {
            count = b->num_slices - (uint32_t)first;
            if (count > want) count = want;
            path = &b->paths[u - b->uses];
            break;
        }
        unlink_use(u); /* every slice of it is posted */
    }
    if (count == 0) return 0;
    rl_nic *nic = &e->nics[q->nic];
    uint32_t num_signalled = 0;
    for (uint32_t i = 0; i < count; i++) {
        rl_slice *s = &b->slices[first + i];
        rl_region *r = &e->regions[b->region[s->req]];
        uint64_t seq = q->tail + i;
        struct ibv_sge *sge = &q->sges[i];
        struct ibv_send_wr *wr = &q->wrs[i];
        sge->addr = r->base[q->nic] + b->loff[s->req] + s->off;
        sge->length = s->len;
        sge->lkey = r->mr[q->nic]->lkey;
        wr->wr_id = (uint64_t)q->index << RL_SEQ_BITS | (seq & RL_SEQ_MASK);
        wr->next = i + 1 < count ? &q->wrs[i + 1] : NULL;
        wr->sg_list = sge;
        wr->num_sge = 1;
        wr->opcode = b->op[s->req] == RL_OP_WRITE ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
        wr->wr.rdma.remote_addr = path->remote_base + b->roff[s->req] + s->off;
        wr->wr.rdma.rkey = path->rkey;
        int signal = ++q->since_signal >= e->signal_every || i + 1 == count;
        wr->send_flags = signal ? IBV_SEND_SIGNALED : 0;
        if (signal) q->since_signal = 0, num_signalled++;
        q->ring[seq % q->depth] = (rl_entry){b, (uint32_t)(first + i)};
    }
    atomic_fetch_add(&nic->inflight, count);
    q->tail += count;
    struct ibv_send_wr *bad = NULL;
    int rc = e->ops->post_send(q->qp, q->wrs, &bad);
    stat_add(e, STAT_POST_CALLS, 1);
    if (rc != 0) { /* room is counted, so a refusal is a bug or a dying device */
        uint32_t posted = bad ? (uint32_t)(bad - q->wrs) : 0;
        uint32_t unposted = count - posted;
        stat_add(e, STAT_POST_ERRORS, 1);
        q->tail -= unposted;
        atomic_fetch_sub(&nic->inflight, unposted);
        record_failed(b, first + posted, unposted, q->index, RL_ST_POST);
        finish_slices(b, unposted);
        qp_to_error(q);
        maybe_drained(q);
        count = posted;
    }
    stat_add(e, STAT_WRS, count);
    stat_add(e, STAT_SIGNALLED, num_signalled);
    if (atomic_load(&nic->sleeping)) { /* NOTE: pairs with the poller's check of inflight */
        pthread_mutex_lock(&nic->lock);
        pthread_cond_signal(&nic->cond);
        pthread_mutex_unlock(&nic->lock);
    }
    return count;
}

static void refill(rl_qp *q) {
    while (post_chain(q) > 0) {
    }
}

/* ---- completions ------------------------------------------------------------------------ */

static void handle_completion(rl_engine *e, struct ibv_wc *wc) {
    uint64_t index = wc->wr_id >> RL_SEQ_BITS;
    rl_qp *q = index < RL_MAX_QPS ? atomic_load(&e->qps[index]) : NULL;
    if (q == NULL) {
        stat_add(e, STAT_STALE, 1);
        return;
    }
    pthread_mutex_lock(&q->lock);
    uint64_t pending = q->tail - q->head;
    uint64_t at = ((wc->wr_id & RL_SEQ_MASK) - (q->head & RL_SEQ_MASK)) & RL_SEQ_MASK;
    if (atomic_load(&q->state) >= QP_FAILED || at >= pending) { /* destroyed or not ours */
        pthread_mutex_unlock(&q->lock);
        stat_add(e, STAT_STALE, 1);
        return;
    }
    uint64_t seq = q->head + at;
    uint64_t before = q->tail - q->head;
    if (wc->status == IBV_WC_SUCCESS) {
        pop_entries(q, seq + 1, 0);
    } else if (atomic_load(&q->state) == QP_READY) { /* the first error: earlier ones ok */
        pop_entries(q, seq, 0);
        pop_entries(q, seq + 1, (int32_t)wc->status);
        qp_to_error(q);
    } else { /* flushed (or failed after we moved it to error) */
        pop_entries(q, seq + 1, (int32_t)wc->status);
    }
    atomic_fetch_sub(&e->nics[q->nic].inflight, (int64_t)(before - (q->tail - q->head)));
    maybe_drained(q);
    refill(q);
    pthread_mutex_unlock(&q->lock);
}

static void *poll_loop(void *arg) {
    rl_nic *nic = arg;
    rl_engine *e = nic->e;
    struct ibv_wc wcs[RL_POLL_BATCH];
    uint32_t empty = 0;
    while (!atomic_load(&nic->stop)) {
        if (atomic_load(&nic->inflight) == 0) {
            pthread_mutex_lock(&nic->lock);
            atomic_store(&nic->sleeping, 1);
            while (atomic_load(&nic->inflight) == 0 && !atomic_load(&nic->stop))
                pthread_cond_wait(&nic->cond, &nic->lock);
            atomic_store(&nic->sleeping, 0);
            pthread_mutex_unlock(&nic->lock);
            continue;
        }
        int num_cqs = atomic_load(&nic->num_cqs), got = 0;
        for (int c = 0; c < num_cqs; c++) {
            int n = e->ops->poll_cq(nic->cqs[c], RL_POLL_BATCH, wcs);
            stat_add(e, STAT_POLLS, 1);
            if (n <= 0) continue;
            got += n;
            stat_add(e, STAT_COMPLETIONS, (uint64_t)n);
            pthread_mutex_lock(&nic->busy);
            for (int i = 0; i < n; i++) handle_completion(e, &wcs[i]);
            pthread_mutex_unlock(&nic->busy);
        }
        if (got > 0) {
            empty = 0;
        } else if (++empty >= 64) { /* a slow device: let other threads run */
            empty = 0;
            sched_yield();
        }
    }
    return NULL;
}

/* ---- engine, NICs, regions, QPs --------------------------------------------------------- */

rl_engine *rl_engine_new(const struct mc_verbs_ops *ops, uint32_t signal_every,
                         uint32_t max_chain, uint32_t spin_us) {
    if (ops == NULL || signal_every == 0 || max_chain == 0) return NULL;
    rl_engine *e = calloc(1, sizeof(*e));
    if (e == NULL) return NULL;
    e->ops = ops;
    e->signal_every = signal_every;
    e->max_chain = max_chain;
    e->spin_us = spin_us;
    pthread_mutex_init(&e->lock, NULL);
    return e;
}

/* Open device `name` with a CQ of cq_depth entries (more are added as QPs need room) and
 * start its poller: the NIC's index, or -errno. */
int rl_nic_open(rl_engine *e, const char *name, int cq_depth) {
    pthread_mutex_lock(&e->lock);
    int rc = -ENOSPC;
    if (e->num_nics == RL_MAX_NICS) goto out;
    rl_nic *nic = &e->nics[e->num_nics];
    memset(nic, 0, sizeof(*nic));
    nic->e = e;
    nic->cq_depth = cq_depth;
    errno = 0;
    if ((nic->ctx = e->ops->open_device(name)) == NULL) goto fail;
    if ((nic->pd = e->ops->alloc_pd(nic->ctx)) == NULL) goto fail_ctx;
    if ((nic->cqs[0] = e->ops->create_cq(nic->ctx, cq_depth)) == NULL) goto fail_pd;
    atomic_store(&nic->num_cqs, 1);
    pthread_mutex_init(&nic->lock, NULL);
    pthread_mutex_init(&nic->busy, NULL);
    pthread_cond_init(&nic->cond, NULL);
    if ((rc = pthread_create(&nic->poller, NULL, poll_loop, nic)) != 0) {
        e->ops->destroy_cq(nic->cqs[0]);
        errno = rc;
        goto fail_pd;
    }
    char thread_name[16] = "rl-poll-";
    strncat(thread_name, name, sizeof(thread_name) - strlen(thread_name) - 1);
    pthread_setname_np(nic->poller, thread_name);
    nic->has_poller = 1;
    rc = (int)e->num_nics++;
    goto out;
fail_pd:
    e->ops->dealloc_pd(nic->pd);
fail_ctx:
    e->ops->close_device(nic->ctx);
fail:
    rc = errno ? -errno : -EIO;
out:
    pthread_mutex_unlock(&e->lock);
    return rc;
}

/* Pin NIC `nic`'s poller thread to `cpus` (the CPUs of the NIC's NUMA node, so its
 * completions and refills run next to the NIC): 0 or -errno. */
int rl_nic_pin(rl_engine *e, uint32_t nic_index, const uint32_t *cpus, uint32_t num_cpus) {
    if (nic_index >= e->num_nics || num_cpus == 0) return -EINVAL;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (uint32_t i = 0; i < num_cpus; i++) {
        if (cpus[i] >= CPU_SETSIZE) return -EINVAL;
        CPU_SET(cpus[i], &set);
    }
    return -pthread_setaffinity_np(e->nics[nic_index].poller, sizeof(set), &set);
}

/* Register [addr, addr + length) on every NIC (dma-buf `fd` at `offset` when fd >= 0, its
 * work requests then name byte 0 by `offset`), all or none. Returns the region's handle
 * (gen << 16 | index) and fills lkeys, rkeys and bases per NIC; -errno on failure. */
int64_t rl_region_register(rl_engine *e, uint64_t addr, uint64_t length, int fd,
                           uint64_t offset, uint32_t *lkeys, uint32_t *rkeys, uint64_t *bases) {
    pthread_mutex_lock(&e->lock);
    int64_t rc = -ENOSPC;
    uint32_t i = 0;
    while (i < RL_MAX_REGIONS && atomic_load(&e->regions[i].state) != REGION_FREE) i++;
    if (i == RL_MAX_REGIONS) goto out;
    rl_region *r = &e->regions[i];
    uint32_t n = 0;
    for (; n < e->num_nics; n++) {
        struct ibv_pd *pd = e->nics[n].pd;
        errno = 0;
        r->mr[n] = fd >= 0 ? e->ops->reg_dmabuf_mr(pd, offset, length, offset, fd, RL_ACCESS)
                           : e->ops->reg_mr(pd, (void *)(uintptr_t)addr, length, RL_ACCESS);
        if (r->mr[n] == NULL) break;
        r->base[n] = fd >= 0 ? offset : addr;
        lkeys[n] = r->mr[n]->lkey;
        rkeys[n] = r->mr[n]->rkey;
        bases[n] = r->base[n];
    }
    if (n < e->num_nics) { /* NOTE: all or none: the others are deregistered again */
        rc = errno ? -errno : -EIO;
        while (n-- > 0) e->ops->dereg_mr(r->mr[n]);
        goto out;
    }
    r->length = length;
    r->gen = (r->gen + 1) & 0xffff;
    atomic_store(&r->refs, 0);
    atomic_store(&r->state, REGION_LIVE);
    rc = (int64_t)r->gen << 16 | i;
out:
    pthread_mutex_unlock(&e->lock);
    return rc;
}

static rl_region *region_of(rl_engine *e, uint32_t handle) {
    uint32_t i = handle & 0xffff;
    if (i >= RL_MAX_REGIONS || e->regions[i].gen != handle >> 16) return NULL;
    return &e->regions[i];
}

static void region_dereg(rl_engine *e, rl_region *r) {
    int closing = REGION_CLOSING;
    if (!atomic_compare_exchange_strong(&r->state, &closing, REGION_DEREGISTERING)) return;
    for (uint32_t n = 0; n < e->num_nics; n++) e->ops->dereg_mr(r->mr[n]);
    atomic_store(&r->state, REGION_FREE);
}

static void region_release(rl_engine *e, rl_region *r, int64_t count) {
    if (atomic_fetch_sub(&r->refs, count) == count && atomic_load(&r->state) == REGION_CLOSING)
        region_dereg(e, r);
}

/* Close a region: 0 deregistered now, 1 once its last batch finishes, -EINVAL unknown. */
int rl_region_close(rl_engine *e, uint32_t handle) {
    rl_region *r = region_of(e, handle);
    int live = REGION_LIVE;
    if (r == NULL || !atomic_compare_exchange_strong(&r->state, &live, REGION_CLOSING))
        return -EINVAL;
    if (atomic_load(&r->refs) == 0) region_dereg(e, r);
    return atomic_load(&r->state) == REGION_FREE ? 0 : 1;
}

/* A CQ of `nic` with room for max_send_wr more entries (a new one when none has): its
 * index, or -errno (-ENOSPC: larger than a CQ, or RL_MAX_CQS already). Under e->lock. */
static int cq_with_room(rl_engine *e, rl_nic *nic, uint32_t max_send_wr) {
    if ((int)max_send_wr > nic->cq_depth) return -ENOSPC;
    int n = atomic_load(&nic->num_cqs);
    for (int i = 0; i < n; i++)
        if (nic->cq_reserved[i] + (int)max_send_wr <= nic->cq_depth) return i;
    if (n == RL_MAX_CQS) return -ENOSPC;
    errno = 0;
    if ((nic->cqs[n] = e->ops->create_cq(nic->ctx, nic->cq_depth)) == NULL)
        return errno ? -errno : -EIO;
    nic->cq_reserved[n] = 0;
    atomic_store(&nic->num_cqs, n + 1); /* NOTE: after the CQ: the poller may read it now */
    return n;
}

/* A new RC QP on NIC `nic` with max_send_wr slots, in INIT on port_num: its handle, its
 * QP number in *qpn; -errno (-ENOSPC: its send queue is larger than a CQ, or the NIC has
 * RL_MAX_CQS full CQs). */
int rl_qp_create(rl_engine *e, uint32_t nic_index, uint32_t max_send_wr, uint8_t port_num,
                 uint32_t *qpn) {
    pthread_mutex_lock(&e->lock);
    int rc = -EINVAL;
    if (nic_index >= e->num_nics || max_send_wr == 0) goto out;
    rl_nic *nic = &e->nics[nic_index];
    rc = -ENOSPC;
    if (e->num_qps == RL_MAX_QPS) goto out;
    int cq = cq_with_room(e, nic, max_send_wr);
    if ((rc = cq) < 0) goto out;
    rc = -ENOMEM;
    rl_qp *q = calloc(1, sizeof(*q));
    if (q == NULL) goto out;
    q->ring = calloc(max_send_wr, sizeof(rl_entry));
    q->wrs = calloc(e->max_chain, sizeof(struct ibv_send_wr));
    q->sges = calloc(e->max_chain, sizeof(struct ibv_sge));
    if (q->ring == NULL || q->wrs == NULL || q->sges == NULL) goto fail;
    struct ibv_qp_init_attr init = {
        .send_cq = nic->cqs[cq],
        .recv_cq = nic->cqs[cq],
        .cap = {.max_send_wr = max_send_wr, .max_recv_wr = 1, .max_send_sge = 1,
                .max_recv_sge = 1},
        .qp_type = IBV_QPT_RC,
        .sq_sig_all = 0,
    };
    errno = 0;
    if ((q->qp = e->ops->create_qp(nic->pd, &init)) == NULL) {
        rc = errno ? -errno : -EIO;
        goto fail;
    }
    struct ibv_qp_attr attr = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = port_num,
                               .qp_access_flags = RL_ACCESS};
    int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    if ((rc = e->ops->modify_qp(q->qp, &attr, mask)) != 0) {
        e->ops->destroy_qp(q->qp);
        rc = -rc;
        goto fail;
    }
    pthread_mutex_init(&q->lock, NULL);
    q->e = e;
    q->nic = nic_index;
    q->cq = (uint32_t)cq;
    q->depth = max_send_wr;
    q->qpn = *qpn = q->qp->qp_num;
    q->users.next = q->users.prev = &q->users;
    atomic_store(&q->state, QP_NEW);
    q->index = e->num_qps++;
    nic->cq_reserved[cq] += (int)max_send_wr;
    atomic_store(&e->qps[q->index], q);
    rc = (int)q->index;
    goto out;
fail:
    free(q->ring);
    free(q->wrs);
    free(q->sges);
    free(q);
out:
    pthread_mutex_unlock(&e->lock);
    return rc;
}

static rl_qp *qp_of(rl_engine *e, uint32_t handle) {
    return handle < RL_MAX_QPS ? atomic_load(&e->qps[handle]) : NULL;
}

/* Move a new QP to RTR toward the remote QP (remote_gid: 16 bytes) and then RTS, as
 * mooncake/native/rdma.py does for the Python path: 0 or -errno. */
int rl_qp_connect(rl_engine *e, uint32_t handle, const uint8_t *remote_gid, uint16_t remote_lid,
                  uint32_t remote_qpn, uint32_t remote_psn, uint32_t local_psn, uint8_t port_num,
                  uint8_t gid_index, uint8_t mtu, uint8_t hop_limit, uint8_t traffic_class,
                  uint8_t service_level, uint8_t max_rd_atomic, uint8_t max_dest_rd_atomic) {
    rl_qp *q = qp_of(e, handle);
    if (q == NULL || atomic_load(&q->state) != QP_NEW) return -EINVAL;
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)mtu;
    a.dest_qp_num = remote_qpn;
    a.rq_psn = remote_psn;
    a.max_dest_rd_atomic = max_dest_rd_atomic;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    a.ah_attr.dlid = remote_lid;
    a.ah_attr.sl = service_level;
    a.ah_attr.port_num = port_num;
    memcpy(a.ah_attr.grh.dgid.raw, remote_gid, 16);
    a.ah_attr.grh.sgid_index = gid_index;
    a.ah_attr.grh.hop_limit = hop_limit;
    a.ah_attr.grh.traffic_class = traffic_class;
    int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    int rc = e->ops->modify_qp(q->qp, &a, mask);
    if (rc != 0) return -rc;
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14; /* 4.096 us * 2^14 = 67 ms per retry */
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = local_psn;
    a.max_rd_atomic = max_rd_atomic;
    mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
           IBV_QP_MAX_QP_RD_ATOMIC;
    if ((rc = e->ops->modify_qp(q->qp, &a, mask)) != 0) return -rc;
    atomic_store(&q->state, QP_READY);
    return 0;
}

/* Move a QP to the error state (its work flushes; unposted slices go to other QPs). */
int rl_qp_to_error(rl_engine *e, uint32_t handle) {
    rl_qp *q = qp_of(e, handle);
    if (q == NULL) return -EINVAL;
    pthread_mutex_lock(&q->lock);
    int state = QP_NEW;
    if (atomic_compare_exchange_strong(&q->state, &state, QP_FAILED)) {
        pthread_mutex_unlock(&q->lock);
        return 0;
    }
    qp_to_error(q);
    maybe_drained(q);
    pthread_mutex_unlock(&q->lock);
    return 0;
}

/* The QP's state: 0 new, 1 ready, 2 error (draining), 3 failed (drained), 4 destroyed. */
int rl_qp_state(rl_engine *e, uint32_t handle) {
    rl_qp *q = qp_of(e, handle);
    return q == NULL ? -EINVAL : atomic_load(&q->state);
}

/* Destroy a QP that is new or failed (drained): 0, -EBUSY while it may still post. */
int rl_qp_destroy(rl_engine *e, uint32_t handle) {
    rl_qp *q = qp_of(e, handle);
    if (q == NULL) return -EINVAL;
    rl_nic *nic = &e->nics[q->nic];
    pthread_mutex_lock(&nic->busy); /* NOTE: no completion of it is being handled */
    pthread_mutex_lock(&q->lock);
    int state = atomic_load(&q->state);
    int rc = 0;
    if (state == QP_READY || state == QP_ERROR) {
        rc = -EBUSY;
    } else if (state != QP_DESTROYED) {
        rc = e->ops->destroy_qp(q->qp);
        rc = rc ? -rc : 0;
        atomic_store(&q->state, QP_DESTROYED);
        free(q->ring), free(q->wrs), free(q->sges);
        q->ring = NULL, q->wrs = NULL, q->sges = NULL;
        pthread_mutex_lock(&e->lock);
        nic->cq_reserved[q->cq] -= (int)q->depth;
        pthread_mutex_unlock(&e->lock);
    }
    pthread_mutex_unlock(&q->lock);
    pthread_mutex_unlock(&nic->busy);
    return rc;
}

/* ---- submitting and waiting ------------------------------------------------------------- */

static void batch_free_memory(rl_batch *b) {
    if (atomic_load(&b->efd) >= 0) close(atomic_load(&b->efd));
    free(b->op), free(b->region), free(b->loff), free(b->roff), free(b->req_status);
    free(b->slices), free(b->paths), free(b->uses), free(b->failed);
    free(b);
}

/* Submit a batch of num_reqs requests over num_paths paths, cut into slice_bytes slices.
 * Requests: op (RL_OP_READ/WRITE), region handle, offset in it, offset in the remote
 * segment, length. Paths: QP handle, the remote NIC's base address and rkey of the
 * segment. Returns the batch (wait for it with rl_wait, then rl_result and rl_free), or
 * NULL with *err = -errno (-EINVAL: an unknown QP or a bad slice size). */
rl_batch *rl_submit(rl_engine *e, uint32_t num_reqs, const uint8_t *op, const uint32_t *region,
                    const uint64_t *loff, const uint64_t *roff, const uint64_t *len,
                    uint32_t num_paths, const uint32_t *qp, const uint64_t *remote_base,
                    const uint32_t *rkey, uint64_t slice_bytes, int *err) {
    *err = -EINVAL;
    if (slice_bytes == 0 || slice_bytes > (1u << 31)) return NULL;
    for (uint32_t p = 0; p < num_paths; p++)
        if (qp_of(e, qp[p]) == NULL) return NULL;
    *err = -ENOMEM;
    rl_batch *b = calloc(1, sizeof(*b));
    if (b == NULL) return NULL;
    b->e = e;
    atomic_store(&b->efd, -1);
    b->num_reqs = num_reqs;
    b->num_paths = num_paths;
    b->op = malloc(num_reqs + 1);
    b->region = malloc(sizeof(uint32_t) * (num_reqs + 1));
    b->loff = malloc(sizeof(uint64_t) * (num_reqs + 1));
    b->roff = malloc(sizeof(uint64_t) * (num_reqs + 1));
    b->req_status = calloc(num_reqs + 1, sizeof(int32_t));
    b->paths = calloc(num_paths + 1, sizeof(rl_path));
    b->uses = calloc(num_paths + 1, sizeof(rl_use));
    if (!b->op || !b->region || !b->loff || !b->roff || !b->req_status ||
        !b->paths || !b->uses) {
        batch_free_memory(b);
        return NULL;
    }
    memcpy(b->op, op, num_reqs);
    memcpy(b->loff, loff, sizeof(uint64_t) * num_reqs);
    memcpy(b->roff, roff, sizeof(uint64_t) * num_reqs);
    /* NOTE: take the region's reference before checking it is live (rl_region_close checks
     * the other way round), so a region is never deregistered under a posted request */
    uint64_t num_slices = 0;
    for (uint32_t i = 0; i < num_reqs; i++) {
        rl_region *r = region_of(e, region[i]);
        b->region[i] = region[i] & 0xffff;
        if (r != NULL) atomic_fetch_add(&r->refs, 1);
        if (r == NULL || atomic_load(&r->state) != REGION_LIVE || loff[i] > r->length ||
            len[i] > r->length - loff[i] || op[i] > RL_OP_WRITE) {
            if (r != NULL) region_release(e, r, 1);
            b->req_status[i] = RL_ST_BAD_REGION;
            continue;
        }
        num_slices += (len[i] + slice_bytes - 1) / slice_bytes;
    }
    if (num_slices >= UINT32_MAX) {
        *err = -E2BIG;
        for (uint32_t i = 0; i < num_reqs; i++)
            if (b->req_status[i] == 0) region_release(e, &e->regions[b->region[i]], 1);
        batch_free_memory(b);
        return NULL;
    }
    b->slices = malloc(sizeof(rl_slice) * (num_slices + 1));
    b->failed = malloc(sizeof(rl_fail) * (num_slices + 1));
    if (!b->slices || !b->failed) {
        for (uint32_t i = 0; i < num_reqs; i++)
            if (b->req_status[i] == 0) region_release(e, &e->regions[b->region[i]], 1);
        batch_free_memory(b);
        return NULL;
    }
    uint32_t k = 0;
    for (uint32_t i = 0; i < num_reqs; i++) {
        if (b->req_status[i] != 0) continue;
        for (uint64_t off = 0; off < len[i]; off += slice_bytes) {
            uint64_t left = len[i] - off;
            b->slices[k++] = (rl_slice){i, (uint32_t)(left < slice_bytes ? left : slice_bytes), off};
        }
    }
    b->num_slices = k;
    atomic_store(&b->remaining, k + 1); /* NOTE: + 1 held by this call until it is done */
    stat_add(e, STAT_BATCHES, 1);
    for (uint32_t p = 0; p < num_paths; p++) {
        rl_qp *q = qp_of(e, qp[p]);
        b->paths[p] = (rl_path){q, remote_base[p], rkey[p]};
        rl_use *u = &b->uses[p];
        u->batch = b;
        pthread_mutex_lock(&q->lock);
        if (atomic_load(&q->state) == QP_READY) { /* a failed QP takes no new work */
            u->prev = q->users.prev;
            u->next = &q->users;
            q->users.prev->next = u;
            q->users.prev = u;
            u->linked = 1;
        }
        pthread_mutex_unlock(&q->lock);
    }
    /* one chain per path here, the rest by the NIC's poller as completions free room: the
     * caller (who may hold the GIL) returns after at most num_paths chains, and the posting
     * goes on in the poller's thread while the caller's thread waits or does other work */
    for (uint32_t p = 0; p < num_paths && atomic_load(&b->cursor) < k; p++) {
        rl_qp *q = b->paths[p].qp;
        if (!b->uses[p].linked) continue;
        pthread_mutex_lock(&q->lock);
        post_chain(q);
        pthread_mutex_unlock(&q->lock);
    }
    if (!batch_has_live_path(b)) { /* nothing will post the rest */
        uint64_t first = atomic_fetch_add(&b->cursor, k);
        if (first < k) {
            record_failed(b, first, k - (uint32_t)first, UINT32_MAX, RL_ST_NO_PATH);
            finish_slices(b, k - (uint32_t)first);
        }
    }
    finish_slices(b, 1);
    *err = 0;
    return b;
}

int rl_free(rl_batch *b);

/* Wait for a batch: 1 when every slice finished, 0 when timeout_ms passed first (-1: no
 * limit; 0: a poll, returning at once). Spins up to the engine's spin_us before sleeping on
 * the eventfd. */
int rl_wait(rl_batch *b, int timeout_ms) {
    if (atomic_load(&b->done)) return 1;
    if (timeout_ms == 0) return 0;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        if (atomic_load(&b->done)) return 1;
        clock_gettime(CLOCK_MONOTONIC, &t);
        int64_t ns = (t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec);
        if (ns >= (int64_t)b->e->spin_us * 1000) break;
    }
    if (atomic_load(&b->efd) < 0) {
        int fd = eventfd(0, EFD_CLOEXEC), none = -1;
        if (fd < 0) return -errno;
        if (!atomic_compare_exchange_strong(&b->efd, &none, fd)) close(fd); /* another's */
    }
    if (atomic_load(&b->finished)) { /* finished before it saw the eventfd: no wake-up */
        while (!atomic_load(&b->done)) sched_yield(); /* the finisher's last store */
        return 1;
    }
    struct pollfd pfd = {.fd = atomic_load(&b->efd), .events = POLLIN};
    for (;;) {
        if (atomic_load(&b->done)) return 1;
        int rc = poll(&pfd, 1, timeout_ms);
        if (rc == 0) return atomic_load(&b->done) ? 1 : 0;
        if (rc < 0 && errno != EINTR) return -errno;
        if (rc > 0) {
            while (!atomic_load(&b->done)) sched_yield(); /* the writer's last store */
            return 1;
        }
    }
}

/* After rl_wait returned 1: per request its status (0 done, > 0 the wc status of its
 * first failed slice, < 0 RL_ST_*) and failing QP handle (UINT32_MAX: none); per failed
 * slice (up to max_failed) its request, offset in the request, length, QP and status.
 * Returns the number of failed slices. */
uint32_t rl_result(rl_batch *b, int32_t *req_status, uint32_t *req_qp, uint32_t max_failed,
                   uint32_t *f_req, uint64_t *f_off, uint64_t *f_len, uint32_t *f_qp,
                   int32_t *f_status) {
    for (uint32_t i = 0; i < b->num_reqs; i++) {
        req_status[i] = b->req_status[i];
        req_qp[i] = UINT32_MAX;
    }
    uint32_t n = atomic_load(&b->num_failed);
    for (uint32_t i = 0; i < n; i++) {
        rl_fail *f = &b->failed[i];
        rl_slice *s = &b->slices[f->slice];
        if (req_status[s->req] == 0) {
            req_status[s->req] = f->status;
            req_qp[s->req] = f->qp;
        }
        if (i < max_failed) {
            f_req[i] = s->req;
            f_off[i] = s->off;
            f_len[i] = s->len;
            f_qp[i] = f->qp;
            f_status[i] = f->status;
        }
    }
    return n;
}

/* rl_wait, then per request its status and failing QP as rl_result gives them: the number
 * of failed slices (rl_result gives them; then rl_free), -1 when timeout_ms passed first
 * (wait again), -errno. A batch with no failed slice is freed here: one call per batch. */
int64_t rl_finish(rl_batch *b, int timeout_ms, int32_t *req_status, uint32_t *req_qp) {
    int rc = rl_wait(b, timeout_ms);
    if (rc <= 0) return rc == 0 ? -1 : rc;
    uint32_t n = rl_result(b, req_status, req_qp, 0, NULL, NULL, NULL, NULL, NULL);
    if (n == 0) rl_free(b);
    return n;
}

/* The common case in one call: -1 while slices are in flight (never blocks), 0 when every
 * request of the batch is done (the batch is freed), 1 when one failed (rl_finish then
 * gives the statuses; the batch is kept). */
int rl_finish_ok(rl_batch *b) {
    if (!atomic_load(&b->done)) return -1;
    if (atomic_load(&b->num_failed)) return 1;
    for (uint32_t i = 0; i < b->num_reqs; i++)
        if (b->req_status[i]) return 1;
    rl_free(b);
    return 0;
}

static void release_regions(rl_batch *b) {
    if (b->released) return;
    b->released = 1;
    rl_engine *e = b->e;
    uint32_t run = UINT32_MAX;
    int64_t count = 0;
    for (uint32_t i = 0; i < b->num_reqs; i++) {
        if (b->req_status[i] == RL_ST_BAD_REGION) continue;
        if (b->region[i] != run && count) region_release(e, &e->regions[run], count), count = 0;
        run = b->region[i];
        count++;
    }
    if (count) region_release(e, &e->regions[run], count);
}

/* Free a finished batch: 0, or -EBUSY while slices are in flight (wait first). */
int rl_free(rl_batch *b) {
    if (!atomic_load(&b->done)) return -EBUSY;
    for (uint32_t p = 0; p < b->num_paths; p++) {
        rl_qp *q = b->paths[p].qp;
        pthread_mutex_lock(&q->lock);
        unlink_use(&b->uses[p]);
        pthread_mutex_unlock(&q->lock);
    }
    release_regions(b);
    batch_free_memory(b);
    return 0;
}

/* Counters: post_send calls, work requests, signalled ones, completions, polls, refused
 * posts, stale completions, batches, wake-ups (eventfd writes: batches whose waiter slept);
 * then per NIC its poller's CPU ns. Returns
 * the number written (at most max). */
uint32_t rl_stats(rl_engine *e, uint64_t *out, uint32_t max) {
    uint32_t n = 0;
    for (; n < NUM_STATS && n < max; n++) out[n] = atomic_load(&e->stats[n]);
    for (uint32_t i = 0; i < e->num_nics && n < max; i++, n++) {
        clockid_t clock;
        struct timespec ts = {0};
        if (e->nics[i].has_poller && pthread_getcpuclockid(e->nics[i].poller, &clock) == 0)
            clock_gettime(clock, &ts);
        out[n] = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
    }
    return n;
}

/* Close the engine: QPs to error, their work drained (up to 2 s), pollers stopped, then
 * QPs, regions, CQs, PDs and devices destroyed. Batches must have been waited for. */
void rl_engine_close(rl_engine *e) {
    for (uint32_t i = 0; i < e->num_qps; i++) rl_qp_to_error(e, i);
    for (int spins = 0; spins < 2000; spins++) {
        int64_t left = 0;
        for (uint32_t n = 0; n < e->num_nics; n++) left += atomic_load(&e->nics[n].inflight);
        if (left == 0) break;
        usleep(1000);
    }
    for (uint32_t n = 0; n < e->num_nics; n++) {
        rl_nic *nic = &e->nics[n];
        pthread_mutex_lock(&nic->lock);
        atomic_store(&nic->stop, 1);
        pthread_cond_signal(&nic->cond);
        pthread_mutex_unlock(&nic->lock);
        pthread_join(nic->poller, NULL);
    }
    for (uint32_t i = 0; i < e->num_qps; i++) {
        rl_qp *q = e->qps[i];
        if (atomic_load(&q->state) != QP_DESTROYED) e->ops->destroy_qp(q->qp);
        free(q->ring), free(q->wrs), free(q->sges);
        free(q);
    }
    for (uint32_t i = 0; i < RL_MAX_REGIONS; i++) {
        rl_region *r = &e->regions[i];
        if (atomic_load(&r->state) == REGION_FREE) continue;
        for (uint32_t n = 0; n < e->num_nics; n++) e->ops->dereg_mr(r->mr[n]);
    }
    for (uint32_t n = 0; n < e->num_nics; n++) {
        for (int c = 0; c < atomic_load(&e->nics[n].num_cqs); c++)
            e->ops->destroy_cq(e->nics[n].cqs[c]);
        e->ops->dealloc_pd(e->nics[n].pd);
        e->ops->close_device(e->nics[n].ctx);
    }
    free(e);
}
