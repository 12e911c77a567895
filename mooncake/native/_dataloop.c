/* The data plane's request loop in C: READ and WRITE requests of mooncake's transfer wire
 * protocol (mooncake/transfer/wire.py), served on one authenticated connection with no
 * Python and no GIL (ctypes releases it for the call). Loaded by mooncake/native/dataloop.py;
 * mooncake/transfer/server.py falls back to its Python loop when this library is absent.
 *
 * Everything that is not a well-formed READ or WRITE of a known segment within its bounds
 * (a control op, an unknown token, a bad range, an oversized length) is handed back to
 * Python with its header, after every queued reply was sent: Python answers, logs and
 * closes exactly as its own loop does.
 *
 * Segments live in a table (token -> base, size) guarded by a reader-writer lock that
 * prefers writers. A loop holds it for reading from its first READ/WRITE of a group until
 * the group's replies are sent, and never while it waits for a new request; dl_remove takes
 * it for writing, so once it returns no loop touches that segment's memory again.
 *
 * Wire formats (big-endian): request "!BBHIQQQ" (op, flags, pad, id, token, offset,
 * length; a WRITE's payload follows), reply "!BxxxIQ" (status, id, length; a READ's data
 * follows). Replies are queued and sent together when the request carries FLAG_FLUSH, when
 * flush_bytes of READ data are queued, or when the client has nothing more in flight.
 */
#define _GNU_SOURCE
#include <endian.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define REQ_BYTES 32
#define RESP_BYTES 16
#define OP_READ 1
#define OP_WRITE 2
#define FLAG_FLUSH 1
#define MAX_SEGMENTS 1024
#define MAX_PENDING 128 /* replies queued at most before they are sent */

typedef struct {
    uint64_t token;
    char *base;
    uint64_t size;
} segment_t;

typedef struct {
    pthread_rwlock_t lock;
    int count;
    segment_t segments[MAX_SEGMENTS];
} table_t;

/* A table lives as long as its process: a serving thread may still be inside dl_serve when
 * its server closes, so it is never freed. */
table_t *dl_table_new(void) {
    table_t *t = calloc(1, sizeof(table_t));
    if (t == NULL) return NULL;
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&t->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    return t;
}

/* The table locked for writing within timeout_ms: 0, else 1 (a loop is stuck on a stalled
 * peer: the caller drops the connections and tries again). */
static int lock_for_change(table_t *t, int timeout_ms) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    return pthread_rwlock_timedwrlock(&t->lock, &until) == 0 ? 0 : 1;
}

/* 0: added; -1: the table is full (Python serves that segment); 1: timed out (see above). */
int dl_add(table_t *t, uint64_t token, char *base, uint64_t size, int timeout_ms) {
    if (lock_for_change(t, timeout_ms) != 0) return 1;
    int rc = -1;
    if (t->count < MAX_SEGMENTS) {
        t->segments[t->count++] = (segment_t){token, base, size};
        rc = 0;
    }
    pthread_rwlock_unlock(&t->lock);
    return rc;
}

/* 0: gone from the table (or never there), no loop touches it any more; 1: timed out. */
int dl_remove(table_t *t, uint64_t token, int timeout_ms) {
    if (lock_for_change(t, timeout_ms) != 0) return 1;
    for (int i = 0; i < t->count; i++) {
        if (t->segments[i].token == token) {
            t->segments[i] = t->segments[--t->count];
            break;
        }
    }
    pthread_rwlock_unlock(&t->lock);
    return 0;
}

static const segment_t *find(const table_t *t, uint64_t token) {
    for (int i = 0; i < t->count; i++)
        if (t->segments[i].token == token) return &t->segments[i];
    return NULL;
}

/* Fill buf[0:n); 1 done, 0 EOF before the first byte, -1 error or EOF midway. */
static int recv_all(int fd, char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(fd, buf + got, n - got, MSG_WAITALL);
        if (r > 0) {
            got += (size_t)r;
        } else if (r < 0 && errno == EINTR) {
            continue;
        } else {
            return (r == 0 && got == 0) ? 0 : -1;
        }
    }
    return 1;
}

typedef struct {
    struct iovec iov[2 * MAX_PENDING];
    unsigned char heads[MAX_PENDING][RESP_BYTES];
    int n_iov, n_replies;
    uint64_t data_bytes;
} pending_t;

/* Send every queued reply; 0 ok, -1 the connection broke. */
static int flush(int fd, pending_t *p) {
    struct msghdr msg = {0};
    msg.msg_iov = p->iov;
    msg.msg_iovlen = (size_t)p->n_iov;
    while (msg.msg_iovlen > 0) {
        ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        size_t sent = (size_t)r;
        while (msg.msg_iovlen > 0 && sent >= msg.msg_iov[0].iov_len) {
            sent -= msg.msg_iov[0].iov_len;
            msg.msg_iov++;
            msg.msg_iovlen--;
        }
        if (msg.msg_iovlen > 0) {
            msg.msg_iov[0].iov_base = (char *)msg.msg_iov[0].iov_base + sent;
            msg.msg_iov[0].iov_len -= sent;
        }
    }
    p->n_iov = p->n_replies = 0;
    p->data_bytes = 0;
    return 0;
}

static void queue_reply(pending_t *p, uint32_t req_id, uint64_t length, char *data) {
    unsigned char *h = p->heads[p->n_replies++];
    memset(h, 0, RESP_BYTES); /* status OK = 0 */
    uint32_t id = htobe32(req_id);
    uint64_t len = htobe64(length);
    memcpy(h + 4, &id, 4);
    memcpy(h + 8, &len, 8);
    p->iov[p->n_iov++] = (struct iovec){h, RESP_BYTES};
    if (data != NULL) {
        p->iov[p->n_iov++] = (struct iovec){data, length};
        p->data_bytes += length;
    }
}

/* Serve READ/WRITE requests on `fd` until something else comes. Returns 0 when the peer
 * closed the connection between requests, -1 when the connection broke (or closed
 * midway), 1 when `hdr_out` holds a request header for Python to answer (every queued
 * reply has been sent by then, and the request's payload, if any, is still unread). */
int dl_serve(table_t *t, int fd, unsigned char *hdr_out, uint64_t flush_bytes,
             uint64_t max_data_bytes) {
    static __thread pending_t p; /* one per serving thread; empty between calls */
    unsigned char h[REQ_BYTES];
    int locked = 0, rc;
    p.n_iov = p.n_replies = 0;
    p.data_bytes = 0;
    for (;;) {
        ssize_t got = 0;
        if (p.n_replies > 0) { /* replies queued: send them unless more requests are here */
            got = recv(fd, h, REQ_BYTES, MSG_DONTWAIT);
            if (got == 0) {
                rc = 0;
                goto out;
            }
            if (got < 0) {
                if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                    rc = -1;
                    goto out;
                }
                got = 0;
                if (flush(fd, &p) != 0) {
                    rc = -1;
                    goto out;
                }
                pthread_rwlock_unlock(&t->lock);
                locked = 0;
            }
        }
        if (got == 0) {
            rc = recv_all(fd, (char *)h, REQ_BYTES);
            if (rc <= 0) goto out;
        } else if (got < REQ_BYTES) {
            if (recv_all(fd, (char *)h + got, (size_t)(REQ_BYTES - got)) != 1) {
                rc = -1;
                goto out;
            }
        }
        uint8_t op = h[0], flags = h[1];
        uint32_t req_id;
        uint64_t token, offset, length;
        memcpy(&req_id, h + 4, 4);
        memcpy(&token, h + 8, 8);
        memcpy(&offset, h + 16, 8);
        memcpy(&length, h + 24, 8);
        req_id = be32toh(req_id);
        token = be64toh(token);
        offset = be64toh(offset);
        length = be64toh(length);
        const segment_t *seg = NULL;
        if ((op == OP_READ || op == OP_WRITE) && length > 0 && length <= max_data_bytes) {
            if (!locked) {
                pthread_rwlock_rdlock(&t->lock);
                locked = 1;
            }
            seg = find(t, token);
            if (seg != NULL && (offset > seg->size || length > seg->size - offset)) seg = NULL;
        }
        if (seg == NULL) { /* Python's: send what is queued, then hand the header over */
            rc = (p.n_replies > 0 && flush(fd, &p) != 0) ? -1 : 1;
            if (rc == 1) memcpy(hdr_out, h, REQ_BYTES);
            goto out;
        }
        char *mem = seg->base + offset;
        if (op == OP_WRITE) {
            if (recv_all(fd, mem, length) != 1) {
                rc = -1;
                goto out;
            }
            queue_reply(&p, req_id, 0, NULL);
        } else {
            queue_reply(&p, req_id, length, mem);
        }
        if ((flags & FLAG_FLUSH) || p.data_bytes >= flush_bytes || p.n_replies >= MAX_PENDING) {
            if (flush(fd, &p) != 0) {
                rc = -1;
                goto out;
            }
            pthread_rwlock_unlock(&t->lock);
            locked = 0;
        }
    }
out:
    if (locked) pthread_rwlock_unlock(&t->lock);
    p.n_iov = p.n_replies = 0;
    p.data_bytes = 0;
    return rc;
}
