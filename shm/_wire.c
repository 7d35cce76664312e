/*
 * shm._wire: a collective's frames between two nodes, moved by C threads that never take the GIL.
 *
 *   w = Wire(peer, nsocks, pool, part_min, max_total)
 *                                  one link's collective sockets (transports/net_wire.py, Link); pool:
 *                                  the ops pool's address, whose EVENTS word wakes the loop (0: none)
 *   w.attach(index, fd)            socket `index` is connected: the wire owns the fd and starts its
 *                                  reader and writer threads
 *   w.send(key, addr, n, token)    send n bytes at addr as the frame of `key`
 *   w.recv(key, addr, n, token) -> bool
 *                                  land the frame of `key` at addr; True: it had arrived, done now
 *   w.poll() -> ([token, ...], lost or None)
 *                                  sends and receives finished since the last call; why the link
 *                                  broke, once
 *   w.cancel() -> int              forget every posted receive (the communicator failed)
 *   w.close(bound_s)               goodbye, drain and join, each wait bounded; idempotent
 *   w.describe() -> dict           for the dump
 *
 * Why: a collective between nodes moves every chunk as a frame each way. With Python reader and
 * writer threads, each frame cost them one or two GIL acquisitions, each queued behind the loop's
 * Python (up to the switch interval), so a link's second socket made collectives slower, not faster
 * (docs/decisions.md, "A collective's chunks take one socket"). These threads read straight into
 * the receive's registered memory and write straight from the send's, and hand the loop only a
 * token: the loop's cost per chunk no longer grows with the sockets that carry it.
 *
 * Frames: net_wire's 32-byte header, little-endian (type COLL, flags 0, length = key + part bytes,
 * a = key length, b = the part's offset, c = the frame's size), the key, the part. A send of n bytes
 * goes out as up to nsocks parts of at least part_min bytes, one per socket (the first socket
 * rotating), so one chunk crosses on several streams at once; a receive is done when its parts
 * cover it. Keys are unique per schedule entry, so parts need no order.
 *
 * Lock protocol: one mutex (`mu`) guards the queues, the posted receives, the stash, the finished
 * tokens and the state; no socket call and no copy runs under it. A reader writing into a receive
 * holds one `inflight` count on it, and a receive is finished (its token queued, the entry freed)
 * only by whoever drops inflight to 0 with every byte in: the reader of its last part, or the
 * loop's recv() copying in what the stash held. A frame whose receive is not posted yet lands in
 * malloc'd parts (the stash entry, the same struct); recv() turns the entry into the posted receive
 * in place, so a reader holding it finds it posted and copies its part over itself.
 *
 * Waking the loop: a finished token bumps the pool's EVENTS word and, if the loop may sleep, signals
 * its condvar under the pool mutex (shm/_native.c, post_event: the same protocol, without Python).
 *
 * Closing (net_wire's protocol): each writer sends what is queued, then BYE, then shuts its write
 * half down; each reader reads until EOF. An EOF without a BYE before it, or an error, while not
 * closing, is a lost link (poll() says why). The joins are bounded; past the bound the socket is
 * shut down both ways, which ends any blocked call at once.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "_kernel.h"
#include "_pool_layout.h"

#define MAX_SOCKS 16
#define MAX_KEY 512
#define HDR 32
#define PART_ALIGN 4096
#define FOLD_BYTES (64 * 1024)   /* a folding reader reads this much, then reduces it (L2-sized) */
enum { T_COLL = 4, T_BYE = 7 };   /* transports/net_wire.py's frame types */

typedef struct Part {             /* a part that arrived before its receive was posted */
    struct Part *next;
    uint64_t off, len;
    char *data;
} Part;

typedef struct Recv {             /* a posted receive, or (posted 0) a stash entry */
    struct Recv *next;
    uint32_t keylen;
    char key[MAX_KEY];
    char *addr;
    uint64_t nbytes, got;
    int inflight, arrived, posted, cancelled;
    long long token;
    Part *parts;
    struct Recv *job_next;        /* on the copier's queue */
    combine_fn fold;              /* not NULL: addr = a (op) the frame, element by element */
    int op, code;
    const char *a;
} Recv;

typedef struct Send {
    long long token;
    int left;                     /* parts not written yet */
    uint32_t keylen;
    char key[MAX_KEY];
} Send;

typedef struct Out {              /* one part queued on a socket (send NULL: the BYE) */
    struct Out *next;
    unsigned char hdr[HDR];
    const char *data;
    uint64_t len;
    Send *send;
} Out;

struct Wire;
typedef struct {
    struct Wire *w;
    int index, fd, started;
    pthread_t reader, writer;
    pthread_cond_t cv;            /* the writer waits on it (with mu) */
    Out *head, *tail;
    int queued, peer_bye;
} Sock;

typedef struct Wire {
    PyObject_HEAD
    pthread_mutex_t mu;
    int peer, nsocks, closed;
    pthread_t copier;             /* lands what arrived before its receive was posted */
    pthread_cond_t copier_cv;
    Recv *jobs, *jobs_tail;
    int copier_started;
    Sock s[MAX_SOCKS];
    uint64_t part_min, max_total;
    char *pool;
    Recv *posted, *stash;
    long long *done;
    size_t ndone, cap;
    int closing;
    char lost[256];
    int lost_told;
    unsigned rr;
    uint64_t bytes_in, bytes_out;
} Wire;

static void wake_loop(Wire *w) {
    char *p = w->pool;
    if (!p) return;
    __atomic_add_fetch((uint64_t *)(p + POOL_EVENTS_OFF), 1, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n((uint64_t *)(p + POOL_SLEEPING_OFF), __ATOMIC_SEQ_CST)) return;
    pthread_mutex_t *m = (pthread_mutex_t *)(p + POOL_MUTEX_OFF);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += 1;   /* should the lock time out, the loop's bounded sleep finds EVENTS moved */
    int r = pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &ts);
    if (r == EOWNERDEAD) pthread_mutex_consistent(m);   /* the loop learns who died through its watcher */
    if (r == 0 || r == EOWNERDEAD) {
        pthread_cond_broadcast((pthread_cond_t *)(p + POOL_COND_OFF));
        pthread_mutex_unlock(m);
    }
}

/* Under mu. */
static void push_done(Wire *w, long long token) {
    if (w->ndone == w->cap) {
        size_t cap = w->cap ? 2 * w->cap : 64;
        long long *d = realloc(w->done, cap * sizeof *d);
        if (!d) {   /* no memory for a token: the collective would hang, so the link fails instead */
            if (!w->lost[0]) snprintf(w->lost, sizeof w->lost, "out of memory queueing a completion");
            return;
        }
        w->cap = cap;
        w->done = d;
    }
    w->done[w->ndone++] = token;
}

/* Under mu: the first failure names the link's loss (unless closing: then EOF and errors are expected). */
static void set_lost(Wire *w, const char *fmt, int a, const char *b) {
    if (w->closing || w->lost[0]) return;
    snprintf(w->lost, sizeof w->lost, fmt, a, b);
}

static Recv *find(Recv *list, const char *key, uint32_t keylen) {
    for (Recv *r = list; r; r = r->next)
        if (r->keylen == keylen && memcmp(r->key, key, keylen) == 0) return r;
    return NULL;
}

static void unlink_recv(Recv **list, Recv *r) {
    for (Recv **p = list; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            return;
        }
}

static void free_parts(Part *p) {
    while (p) {
        Part *n = p->next;
        free(p->data);
        free(p);
        p = n;
    }
}

/* Under mu, after a writer of `r` dropped its inflight count: finish it if it is complete (1), free
 * it if it was cancelled and nobody writes into it any more. */
static int settle(Wire *w, Recv *r) {
    if (r->cancelled) {
        if (r->inflight == 0) free(r);
        return 0;
    }
    if (!(r->posted && r->arrived && r->got == r->nbytes && r->inflight == 0)) return 0;
    unlink_recv(&w->posted, r);
    return 1;
}

/* Fill n bytes at p: n, or fewer on EOF, or -errno. */
static long long read_full(int fd, char *p, uint64_t n) {
    uint64_t got = 0;
    while (got < n) {
        ssize_t k = recv(fd, p + got, (size_t)(n - got), 0);
        if (k > 0) got += (uint64_t)k;
        else if (k == 0) break;
        else if (errno != EINTR) return -errno;
    }
    return (long long)got;
}

static int write_all(int fd, struct iovec *iov, int niov) {
    struct msghdr msg = {0};
    while (niov > 0) {
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)niov;
        ssize_t k = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        size_t left = (size_t)k;
        while (niov > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            niov--;
        }
        if (niov > 0) {
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

static uint64_t le64(const unsigned char *b) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}

static void put64(unsigned char *b, uint64_t v) {
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
}

static void make_header(unsigned char *h, int type, uint32_t length, uint64_t a, uint64_t b, uint64_t c) {
    memset(h, 0, HDR);
    h[0] = (unsigned char)type;
    h[1] = (unsigned char)(type >> 8);
    for (int i = 0; i < 4; i++) h[4 + i] = (unsigned char)(length >> (8 * i));
    put64(h + 8, a);
    put64(h + 16, b);
    put64(h + 24, c);
}

/* ------------------------------------------------------------------ the threads */

/* Land `len` bytes of a frame at offset `off` of receive `e` from `src`: a copy, or for a folding
 * receive the reduction of its first operand and `src` (in that order: the schedule's bits). */
static void land(const Recv *e, uint64_t off, const char *src, uint64_t len) {
    if (!e->fold) {
        memcpy(e->addr + off, src, len);
        return;
    }
    size_t isz = itemsize[e->code];
    char *srcs[2] = {(char *)e->a + off, (char *)src};
    char *dst = e->addr + off;
    reduce_run(e->fold, e->op, e->code, (size_t)(len / isz), srcs, 2, &dst, 1, 0);
}

/* Read `part` bytes of a frame straight into folding receive `e` at `off`: FOLD_BYTES at a time into
 * `bounce`, each reduced into place before the next is read. Bytes read, or -errno. */
static long long read_folding(int fd, const Recv *e, uint64_t off, uint64_t part, char *bounce) {
    uint64_t done = 0;
    while (done < part) {
        uint64_t n = part - done < FOLD_BYTES ? part - done : FOLD_BYTES;
        long long r = read_full(fd, bounce, n);
        if (r != (long long)n) return r < 0 ? r : (long long)done + r;
        land(e, off + done, bounce, n);
        done += n;
    }
    return (long long)done;
}

/* The copier: parts that arrived before their receive was posted, landed off the loop (recv() queues
 * the entry, holding one inflight count on it, with its parts). */
static void *copier_main(void *arg) {
    Wire *w = arg;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->jobs && !w->closing) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&w->copier_cv, &w->mu, &ts);
        }
        Recv *e = w->jobs;
        if (!e) {
            pthread_mutex_unlock(&w->mu);
            return NULL;
        }
        w->jobs = e->job_next;
        if (!w->jobs) w->jobs_tail = NULL;
        Part *parts = e->parts;
        e->parts = NULL;
        int cancelled = e->cancelled;
        pthread_mutex_unlock(&w->mu);
        uint64_t sum = 0;
        for (Part *p = parts; p; p = p->next) {
            if (!cancelled) land(e, p->off, p->data, p->len);
            sum += p->len;
        }
        free_parts(parts);
        pthread_mutex_lock(&w->mu);
        e->got += sum;
        e->inflight--;
        long long token = e->token;
        int finished = settle(w, e);
        if (finished) {
            push_done(w, token);
            free(e);
        }
        pthread_mutex_unlock(&w->mu);
        if (finished) wake_loop(w);
    }
}

static void *reader_main(void *arg) {
    Sock *s = arg;
    Wire *w = s->w;
    unsigned char h[HDR];
    char key[MAX_KEY];
    char *bounce = malloc(FOLD_BYTES);
    if (!bounce) {
        pthread_mutex_lock(&w->mu);
        set_lost(w, "socket %d: out of memory for a reader%s", s->index, "");
        pthread_mutex_unlock(&w->mu);
        wake_loop(w);
        return NULL;
    }
    for (;;) {
        long long r = read_full(s->fd, (char *)h, HDR);
        if (r != HDR) {
            pthread_mutex_lock(&w->mu);
            if (r < 0)
                set_lost(w, "socket %d of the collective link: %s", s->index, strerror((int)-r));
            else if (r > 0)
                set_lost(w, "socket %d: protocol error: connection closed inside a header%s", s->index, "");
            else if (!s->peer_bye)
                set_lost(w, "socket %d: connection closed without a goodbye%s", s->index, "");
            int tell = w->lost[0] && !w->lost_told;
            pthread_mutex_unlock(&w->mu);
            if (tell) wake_loop(w);
            free(bounce);
            return NULL;
        }
        int type = h[0] | (h[1] << 8);
        uint64_t length = (uint64_t)h[4] | ((uint64_t)h[5] << 8) | ((uint64_t)h[6] << 16) | ((uint64_t)h[7] << 24);
        uint64_t keylen = le64(h + 8), off = le64(h + 16), total = le64(h + 24);
        const char *bad = NULL;
        if (type == T_BYE) {
            pthread_mutex_lock(&w->mu);
            s->peer_bye = 1;
            pthread_cond_broadcast(&s->cv);   /* its writer sends what is queued and says goodbye too */
            pthread_mutex_unlock(&w->mu);
            continue;
        }
        if (type != T_COLL) bad = "a frame that is not a collective's";
        else if (keylen == 0 || keylen > MAX_KEY || length < keylen) bad = "a bad key length";
        else if (total > w->max_total || off > total || length - keylen > total - off)
            bad = "a part outside its frame";
        uint64_t part = bad ? 0 : length - keylen;
        if (!bad && read_full(s->fd, key, keylen) != (long long)keylen) bad = "EOF or error inside a key";
        if (bad) {
            pthread_mutex_lock(&w->mu);
            set_lost(w, "socket %d: protocol error: %s", s->index, bad);
            pthread_mutex_unlock(&w->mu);
            wake_loop(w);
            free(bounce);
            return NULL;
        }
        pthread_mutex_lock(&w->mu);
        w->bytes_in += HDR + length;
        Recv *e = find(w->posted, key, (uint32_t)keylen);
        if (!e) e = find(w->stash, key, (uint32_t)keylen);
        if (!e) {
            e = calloc(1, sizeof *e);
            if (!e) bad = "out of memory for an early frame";
            else {
                e->keylen = (uint32_t)keylen;
                memcpy(e->key, key, keylen);
                e->nbytes = total;
                e->next = w->stash;
                w->stash = e;
            }
        } else if (e->nbytes != total) {
            bad = "a frame whose size differs from its receive's (the nodes called different collectives)";
        }
        if (bad) {
            set_lost(w, "socket %d: %s", s->index, bad);
            pthread_mutex_unlock(&w->mu);
            wake_loop(w);
            free(bounce);
            return NULL;
        }
        e->inflight++;
        e->arrived = 1;
        int direct = e->posted && !e->cancelled;
        pthread_mutex_unlock(&w->mu);

        char *buf = NULL;
        long long got;
        if (direct) {   /* (e's fields are the loop's until settled: read without the lock) */
            got = e->fold ? read_folding(s->fd, e, off, part, bounce) : read_full(s->fd, e->addr + off, part);
        } else {
            buf = malloc(part ? part : 1);
            got = buf ? read_full(s->fd, buf, part) : -ENOMEM;
        }
        int finished = 0;
        pthread_mutex_lock(&w->mu);
        if (got != (long long)part) {
            e->inflight--;
            settle(w, e);   /* (a cancelled entry is freed; a live one is left to the failure) */
            if (got < 0) set_lost(w, "socket %d of the collective link: %s", s->index, strerror((int)-got));
            else set_lost(w, "socket %d: connection closed inside a frame%s", s->index, "");
            pthread_mutex_unlock(&w->mu);
            free(buf);
            wake_loop(w);
            free(bounce);
            return NULL;
        }
        if (buf && !e->posted) {   /* still early: keep the part for recv() */
            Part *p = malloc(sizeof *p);
            if (p) {
                p->off = off;
                p->len = part;
                p->data = buf;
                p->next = e->parts;
                e->parts = p;
                e->got += part;
                buf = NULL;
            } else {
                set_lost(w, "socket %d: out of memory for an early frame%s", s->index, "");
            }
            e->inflight--;
        } else {
            if (buf && !e->cancelled) {   /* posted while we read: land the part, out of the lock */
                pthread_mutex_unlock(&w->mu);
                land(e, off, buf, part);
                pthread_mutex_lock(&w->mu);
            }
            e->got += part;
            e->inflight--;
            if (e->got > e->nbytes) set_lost(w, "socket %d: protocol error: %s", s->index, "parts overlap");
            long long token = e->token;
            int cancelled = e->cancelled;
            finished = settle(w, e);
            if (finished) {
                push_done(w, token);
                free(e);
            } else if (cancelled) {
                finished = 0;
            }
        }
        int tell = finished || (w->lost[0] && !w->lost_told);
        pthread_mutex_unlock(&w->mu);
        free(buf);
        if (tell) wake_loop(w);
    }
}

static void *writer_main(void *arg) {
    Sock *s = arg;
    Wire *w = s->w;
    int failed = 0;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!s->head && !w->closing && !s->peer_bye && !w->lost[0]) {
            struct timespec ts;   /* bounded: closing always broadcasts, but never wait on that alone */
            clock_gettime(CLOCK_MONOTONIC, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&s->cv, &w->mu, &ts);
        }
        Out *o = s->head;
        if (!o || w->lost[0]) {
            pthread_mutex_unlock(&w->mu);
            break;
        }
        s->head = o->next;
        if (!s->head) s->tail = NULL;
        s->queued--;
        pthread_mutex_unlock(&w->mu);

        struct iovec iov[3];
        int n = 0;
        iov[n].iov_base = o->hdr;
        iov[n++].iov_len = HDR;
        if (o->send) {
            iov[n].iov_base = o->send->key;
            iov[n++].iov_len = o->send->keylen;
        }
        if (o->len) {
            iov[n].iov_base = (void *)o->data;
            iov[n++].iov_len = (size_t)o->len;
        }
        int rc = write_all(s->fd, iov, n);
        int finished = 0;
        pthread_mutex_lock(&w->mu);
        if (rc < 0) {
            set_lost(w, "send on socket %d of the collective link failed: %s", s->index, strerror(-rc));
            failed = 1;
        } else {
            w->bytes_out += HDR + (o->send ? o->send->keylen : 0) + o->len;
            if (o->send && --o->send->left == 0) {
                push_done(w, o->send->token);
                free(o->send);
                finished = 1;
            }
        }
        if (failed && o->send && --o->send->left == 0) free(o->send);   /* (its token never comes: lost) */
        int tell = finished || (failed && w->lost[0] && !w->lost_told);
        pthread_mutex_unlock(&w->mu);
        free(o);
        if (tell) wake_loop(w);
        if (failed) return NULL;
    }
    if (!w->lost[0]) {   /* goodbye behind everything queued, then our half shuts down */
        unsigned char bye[HDR];
        make_header(bye, T_BYE, 0, 0, 0, 0);
        struct iovec iov = {bye, HDR};
        write_all(s->fd, &iov, 1);
    }
    shutdown(s->fd, SHUT_WR);
    return NULL;
}

/* ------------------------------------------------------------------ the object */

static void wire_close(Wire *w, double bound);

static int Wire_init(Wire *w, PyObject *args, PyObject *kw) {
    int peer, nsocks;
    unsigned long long pool, part_min, max_total;
    if (!PyArg_ParseTuple(args, "iiKKK", &peer, &nsocks, &pool, &part_min, &max_total)) return -1;
    if (nsocks < 1 || nsocks > MAX_SOCKS) {
        PyErr_Format(PyExc_ValueError, "Wire: %d sockets (1 to %d)", nsocks, MAX_SOCKS);
        return -1;
    }
    if (max_total > (1ull << 31)) {
        PyErr_Format(PyExc_ValueError, "Wire: frames of up to %llu bytes (at most 2 GiB)", max_total);
        return -1;
    }
    if (w->nsocks) {
        PyErr_SetString(PyExc_RuntimeError, "Wire: initialised twice");
        return -1;
    }
    pthread_mutex_init(&w->mu, NULL);
    w->peer = peer;
    w->nsocks = nsocks;
    w->pool = (char *)(uintptr_t)pool;
    w->part_min = part_min ? part_min : 1;
    w->max_total = max_total;
    for (int i = 0; i < nsocks; i++) {
        w->s[i].w = w;
        w->s[i].index = i;
        w->s[i].fd = -1;
        pthread_condattr_t a;
        pthread_condattr_init(&a);
        pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
        pthread_cond_init(&w->s[i].cv, &a);
        pthread_condattr_destroy(&a);
    }
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&w->copier_cv, &a);
    pthread_condattr_destroy(&a);
    int r = pthread_create(&w->copier, NULL, copier_main, w);
    if (r) {
        errno = r;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    w->copier_started = 1;
    return 0;
}

static void Wire_dealloc(Wire *w) {
    if (w->nsocks) {
        wire_close(w, 1.0);
        for (int i = 0; i < w->nsocks; i++) {
            for (Out *o = w->s[i].head; o;) {
                Out *n = o->next;
                if (o->send && --o->send->left == 0) free(o->send);
                free(o);
                o = n;
            }
            pthread_cond_destroy(&w->s[i].cv);
        }
        pthread_cond_destroy(&w->copier_cv);
        Recv *lists[2] = {w->posted, w->stash};
        for (int k = 0; k < 2; k++)
            for (Recv *r = lists[k]; r;) {
                Recv *n = r->next;
                free_parts(r->parts);
                free(r);
                r = n;
            }
        free(w->done);
        pthread_mutex_destroy(&w->mu);
    }
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *Wire_attach(Wire *w, PyObject *args) {
    int index, fd;
    if (!PyArg_ParseTuple(args, "ii", &index, &fd)) return NULL;
    if (index < 0 || index >= w->nsocks || fd < 0) {
        PyErr_Format(PyExc_ValueError, "Wire.attach: socket %d of %d, fd %d", index, w->nsocks, fd);
        return NULL;
    }
    Sock *s = &w->s[index];
    pthread_mutex_lock(&w->mu);
    int taken = s->fd >= 0 || w->closing;
    if (!taken) s->fd = fd;
    pthread_mutex_unlock(&w->mu);
    if (taken) {
        PyErr_Format(PyExc_ValueError, "Wire.attach: socket %d attached twice or after close", index);
        return NULL;
    }
    int r = pthread_create(&s->writer, NULL, writer_main, s);
    if (r == 0) {
        r = pthread_create(&s->reader, NULL, reader_main, s);
        if (r) {   /* no reader: stop the writer we started, and give the fd back */
            pthread_mutex_lock(&w->mu);
            set_lost(w, "cannot start a reader thread for socket %d%s", index, "");
            pthread_cond_broadcast(&s->cv);
            pthread_mutex_unlock(&w->mu);
            shutdown(fd, SHUT_RDWR);
            pthread_join(s->writer, NULL);
        }
    }
    if (r) {
        pthread_mutex_lock(&w->mu);
        s->fd = -1;
        pthread_mutex_unlock(&w->mu);
        close(fd);   /* it was ours since the call */
        errno = r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    s->started = 1;
    Py_RETURN_NONE;
}

static int parse_entry(PyObject *args, const char **key, Py_ssize_t *keylen, unsigned long long *addr,
                       unsigned long long *n, long long *token) {
    if (!PyArg_ParseTuple(args, "y#KKL", key, keylen, addr, n, token)) return -1;
    if (*keylen <= 0 || *keylen > MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "a key of %zd bytes (1 to %d)", *keylen, MAX_KEY);
        return -1;
    }
    if (*n && !*addr) {
        PyErr_SetString(PyExc_ValueError, "a null address");
        return -1;
    }
    return 0;
}

static PyObject *Wire_send(Wire *w, PyObject *args) {
    const char *key;
    Py_ssize_t keylen;
    unsigned long long addr, n;
    long long token;
    if (parse_entry(args, &key, &keylen, &addr, &n, &token) < 0) return NULL;
    if (n > w->max_total) return PyErr_Format(PyExc_ValueError, "a frame of %llu bytes (at most %llu)", n,
                                              (unsigned long long)w->max_total);
    uint64_t parts = n / w->part_min;
    if (parts < 1) parts = 1;
    if (parts > (uint64_t)w->nsocks) parts = (uint64_t)w->nsocks;
    uint64_t each = (n + parts - 1) / parts;
    each = (each + PART_ALIGN - 1) / PART_ALIGN * PART_ALIGN;
    Send *snd = malloc(sizeof *snd);
    Out *outs[MAX_SOCKS];
    int nout = 0;
    if (!snd) return PyErr_NoMemory();
    snd->token = token;
    snd->keylen = (uint32_t)keylen;
    memcpy(snd->key, key, (size_t)keylen);
    for (uint64_t off = 0; nout == 0 || off < n; off += each) {
        uint64_t len = n - off < each ? n - off : each;
        Out *o = malloc(sizeof *o);
        if (!o) {
            for (int i = 0; i < nout; i++) free(outs[i]);
            free(snd);
            return PyErr_NoMemory();
        }
        o->next = NULL;
        o->data = (const char *)(uintptr_t)addr + off;
        o->len = len;
        o->send = snd;
        make_header(o->hdr, T_COLL, (uint32_t)(keylen + len), (uint64_t)keylen, off, n);
        outs[nout++] = o;
    }
    snd->left = nout;
    pthread_mutex_lock(&w->mu);
    if (w->closing) {
        pthread_mutex_unlock(&w->mu);
        for (int i = 0; i < nout; i++) free(outs[i]);
        free(snd);
        PyErr_SetString(PyExc_RuntimeError, "Wire.send after close");
        return NULL;
    }
    for (int i = 0; i < nout; i++) {
        Sock *s = &w->s[(w->rr + (unsigned)i) % (unsigned)w->nsocks];
        if (s->tail) s->tail->next = outs[i];
        else s->head = outs[i];
        s->tail = outs[i];
        s->queued++;
        pthread_cond_signal(&s->cv);
    }
    w->rr++;
    pthread_mutex_unlock(&w->mu);
    Py_RETURN_NONE;
}

static PyObject *Wire_recv(Wire *w, PyObject *args) {
    const char *key;
    Py_ssize_t keylen;
    unsigned long long addr, n, a = 0;
    long long token;
    int op = -1, code = 0;
    if (!PyArg_ParseTuple(args, "y#KKL|iiK", &key, &keylen, &addr, &n, &token, &op, &code, &a)) return NULL;
    combine_fn fold = NULL;
    if (op >= 0) {
        fold = kernel_for(op, code);
        if (!fold || !a || n % itemsize[code])
            return PyErr_Format(PyExc_ValueError, "Wire.recv: cannot fold op %d on dtype code %d over %llu B", op,
                                code, n);
    }
    if (keylen <= 0 || keylen > MAX_KEY)
        return PyErr_Format(PyExc_ValueError, "a key of %zd bytes (1 to %d)", keylen, MAX_KEY);
    if (n && !addr) return PyErr_Format(PyExc_ValueError, "a null address");
    pthread_mutex_lock(&w->mu);
    if (find(w->posted, key, (uint32_t)keylen)) {
        pthread_mutex_unlock(&w->mu);
        return PyErr_Format(PyExc_ValueError, "a receive for key %.*s is posted already", (int)keylen, key);
    }
    Recv *e = find(w->stash, key, (uint32_t)keylen);
    if (e && e->nbytes != n) {
        uint64_t had = e->nbytes;
        pthread_mutex_unlock(&w->mu);
        return PyErr_Format(PyExc_ValueError, "%llu B arrived for a %llu B receive",
                            (unsigned long long)had, n);
    }
    if (!e) {
        e = calloc(1, sizeof *e);
        if (!e) {
            pthread_mutex_unlock(&w->mu);
            return PyErr_NoMemory();
        }
        e->keylen = (uint32_t)keylen;
        memcpy(e->key, key, (size_t)keylen);
        e->nbytes = n;
    } else {
        unlink_recv(&w->stash, e);
    }
    e->posted = 1;
    e->addr = (char *)(uintptr_t)addr;
    e->token = token;
    e->fold = fold;
    e->op = op;
    e->code = code;
    e->a = (const char *)(uintptr_t)a;
    e->next = w->posted;
    w->posted = e;
    int finished = 0;
    if (e->parts) {   /* what arrived early: the copier lands it, holding one inflight count */
        e->got = 0;
        e->inflight++;
        e->job_next = NULL;
        if (w->jobs_tail) w->jobs_tail->job_next = e;
        else w->jobs = e;
        w->jobs_tail = e;
        pthread_cond_signal(&w->copier_cv);
    } else {          /* nothing yet, or an empty frame that is all there */
        finished = settle(w, e);
        if (finished) free(e);
    }
    pthread_mutex_unlock(&w->mu);
    return PyBool_FromLong(finished);
}

static PyObject *Wire_poll(Wire *w, PyObject *unused) {
    pthread_mutex_lock(&w->mu);
    PyObject *list = PyList_New((Py_ssize_t)w->ndone);
    if (!list) {
        pthread_mutex_unlock(&w->mu);
        return NULL;
    }
    for (size_t i = 0; i < w->ndone; i++) {
        PyObject *t = PyLong_FromLongLong(w->done[i]);
        if (!t) {
            pthread_mutex_unlock(&w->mu);
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    w->ndone = 0;
    PyObject *lost = Py_None;
    char text[sizeof w->lost];
    if (w->lost[0] && !w->lost_told) {
        w->lost_told = 1;
        memcpy(text, w->lost, sizeof text);
        lost = NULL;
    }
    pthread_mutex_unlock(&w->mu);
    if (!lost) {
        lost = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
        if (!lost) {
            Py_DECREF(list);
            return NULL;
        }
        return Py_BuildValue("(NN)", list, lost);
    }
    return Py_BuildValue("(NO)", list, Py_None);
}

static PyObject *Wire_cancel(Wire *w, PyObject *unused) {
    long n = 0;
    pthread_mutex_lock(&w->mu);
    Recv *r = w->posted;
    w->posted = NULL;
    while (r) {
        Recv *next = r->next;
        r->cancelled = 1;
        r->next = NULL;
        if (r->inflight == 0) free(r);   /* else its reader frees it (settle) */
        r = next;
        n++;
    }
    pthread_mutex_unlock(&w->mu);
    return PyLong_FromLong(n);
}

/* Join `t` by `deadline` (CLOCK_REALTIME, pthread_timedjoin_np's clock); past it, shut its socket
 * down both ways, which ends its blocked call at once, and join. */
static void join_by(pthread_t t, int fd, const struct timespec *deadline) {
    if (pthread_timedjoin_np(t, NULL, deadline)) {
        shutdown(fd, SHUT_RDWR);
        pthread_join(t, NULL);
    }
}

/* Writers first (each sends what is queued and BYE), then readers (each until the peer's EOF), all
 * by one deadline `bound` seconds away. */
static void wire_close(Wire *w, double bound) {
    pthread_mutex_lock(&w->mu);
    int was = w->closed;
    w->closing = w->closed = 1;
    for (int i = 0; i < w->nsocks; i++) pthread_cond_broadcast(&w->s[i].cv);
    pthread_cond_broadcast(&w->copier_cv);
    pthread_mutex_unlock(&w->mu);
    if (was) return;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += (time_t)bound;
    deadline.tv_nsec += (long)((bound - (double)(time_t)bound) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    for (int i = 0; i < w->nsocks; i++)
        if (w->s[i].started) join_by(w->s[i].writer, w->s[i].fd, &deadline);
    for (int i = 0; i < w->nsocks; i++) {
        Sock *s = &w->s[i];
        if (!s->started) continue;
        join_by(s->reader, s->fd, &deadline);
        close(s->fd);
        s->started = 0;
    }
    if (w->copier_started) {   /* it only copies: it ends after its queue, whatever the sockets do */
        pthread_join(w->copier, NULL);
        w->copier_started = 0;
    }
}

static PyObject *Wire_close(Wire *w, PyObject *args) {
    double bound = 2.0;
    if (!PyArg_ParseTuple(args, "|d", &bound)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    wire_close(w, bound < 0 ? 0 : bound);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Wire_describe(Wire *w, PyObject *unused) {
    pthread_mutex_lock(&w->mu);
    int attached = 0, queued = 0, posted = 0, stashed = 0;
    for (int i = 0; i < w->nsocks; i++) {
        attached += w->s[i].fd >= 0;
        queued += w->s[i].queued;
    }
    for (Recv *r = w->posted; r; r = r->next) posted++;
    for (Recv *r = w->stash; r; r = r->next) stashed++;
    unsigned long long in = w->bytes_in, out = w->bytes_out;
    char lost[sizeof w->lost];
    memcpy(lost, w->lost, sizeof lost);
    const char *state = lost[0] ? "lost" : (w->closing ? "closed" : (attached == w->nsocks ? "up" : "connecting"));
    pthread_mutex_unlock(&w->mu);
    return Py_BuildValue("{s:i,s:i,s:K,s:K,s:i,s:i,s:i,s:s,s:s}", "sockets", attached, "of", w->nsocks,
                         "bytes_out", out, "bytes_in", in, "queued", queued, "receives_posted", posted,
                         "frames_early", stashed, "state", state, "lost", lost);
}

static PyMethodDef Wire_methods[] = {
    {"attach", (PyCFunction)Wire_attach, METH_VARARGS, "attach(index, fd): the wire owns fd from now"},
    {"send", (PyCFunction)Wire_send, METH_VARARGS, "send(key, addr, nbytes, token)"},
    {"recv", (PyCFunction)Wire_recv, METH_VARARGS,
     "recv(key, addr, nbytes, token, op=-1, code=0, a=0) -> done now; op >= 0: land a (op) the frame"},
    {"poll", (PyCFunction)Wire_poll, METH_NOARGS, "poll() -> ([token, ...], lost reason or None)"},
    {"cancel", (PyCFunction)Wire_cancel, METH_NOARGS, "cancel() -> receives forgotten"},
    {"close", (PyCFunction)Wire_close, METH_VARARGS, "close(bound_s=2.0): goodbye, drain, join"},
    {"describe", (PyCFunction)Wire_describe, METH_NOARGS, "describe() -> dict"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WireType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmproxy.shm._wire.Wire",
    .tp_basicsize = sizeof(Wire),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A link's collective sockets, driven by C threads (shm/_wire.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Wire_init,
    .tp_dealloc = (destructor)Wire_dealloc,
    .tp_methods = Wire_methods,
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "shmproxy.shm._wire", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__wire(void) {
    init_tables();
    if (PyType_Ready(&WireType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&WireType);
    if (PyModule_AddObject(m, "Wire", (PyObject *)&WireType) < 0) {
        Py_DECREF(&WireType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "MAX_KEY", MAX_KEY);
    PyModule_AddIntConstant(m, "MAX_SOCKS", MAX_SOCKS);
    return m;
}
