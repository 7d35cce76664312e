/*
 * shm._wire, continued: the threads of a link's collective sockets and the frame protocol they speak
 * (the reader, the writer, the copier; the wake-up of the loop). What they share with the Python
 * type is in shm/_wire.h; why and how, at the top of shm/_wire.c. The reduction kernel (_kernel.h,
 * whose tables are this file's) is used only here.
 */
#define _GNU_SOURCE
#include "_wire.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "_kernel.h"
#include "_sockio.h"
#include "_pool_layout.h"

void _sw_kernels_init(void) { init_tables(); }

int _sw_can_fold(int op, int code, uint64_t nbytes) {
    return kernel_for(op, code) != NULL && nbytes % itemsize[code] == 0;
}

void _sw_wake_loop(Wire *w) {
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
void _sw_push_done(Wire *w, long long token) {
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
void _sw_set_lost(Wire *w, const char *fmt, int a, const char *b) {
    if (w->closing || w->lost[0]) return;
    snprintf(w->lost, sizeof w->lost, fmt, a, b);
}

Recv *_sw_find(Recv *list, const char *key, uint32_t keylen) {
    for (Recv *r = list; r; r = r->next)
        if (r->keylen == keylen && memcmp(r->key, key, keylen) == 0) return r;
    return NULL;
}

void _sw_unlink_recv(Recv **list, Recv *r) {
    for (Recv **p = list; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            return;
        }
}

void _sw_free_parts(Part *p) {
    while (p) {
        Part *n = p->next;
        free(p->data);
        free(p);
        p = n;
    }
}

/* Under mu, after a writer of `r` dropped its inflight count: finish it if it is complete (1), free
 * it if it was cancelled and nobody writes into it any more. */
int _sw_settle(Wire *w, Recv *r) {
    if (r->cancelled) {
        if (r->inflight == 0) _sw_free_recv(w, r);
        return 0;
    }
    if (!(r->posted && r->arrived && r->got == r->nbytes && r->inflight == 0)) return 0;
    _sw_unlink_recv(&w->posted, r);
    return 1;
}

/* Under mu, after a writer of `r` dropped its inflight count (or recv() found it all there): 1 when
 * it is done (_sw_settle), its token then queued (`push`: recv() returns done instead) and the entry
 * freed; *then gets its chain, holding what it landed, for the caller to fire once mu is dropped. */
int _sw_finish(Wire *w, Recv *r, int push, Chain **then) {
    long long token = r->token;   /* (read first: _sw_settle frees a cancelled r) */
    Chain *c = r->then;
    const char *addr = r->addr;
    uint64_t n = r->nbytes;
    *then = NULL;
    if (!_sw_settle(w, r)) return 0;
    if (push) _sw_push_done(w, token);
    if (c) {
        c->addr = addr;
        c->n = n;
        w->chained++;
        *then = c;
    }
    free(r);
    return 1;
}

void _sw_free_recv(Wire *w, Recv *r) {
    if (r->then) {
        r->then->next = w->spent;
        w->spent = r->then;
    }
    free(r);
}

/* Build the iovec of `o` (header, key, data) past its first `o->skip` bytes; returns the count. */
static int out_iov(const Out *o, struct iovec *iov) {
    int n = 0;
    iov[n].iov_base = (void *)o->hdr;
    iov[n++].iov_len = HDR;
    if (o->send) {
        iov[n].iov_base = o->send->key;
        iov[n++].iov_len = o->send->keylen;
    }
    if (o->len) {
        iov[n].iov_base = (void *)o->data;
        iov[n++].iov_len = (size_t)o->len;
    }
    uint64_t skip = o->skip;
    int k = 0;
    while (k < n && skip >= iov[k].iov_len) skip -= iov[k++].iov_len;
    if (k == n) return 0;
    iov[k].iov_base = (char *)iov[k].iov_base + skip;
    iov[k].iov_len -= skip;
    for (int i = 0; i < n - k; i++) iov[i] = iov[i + k];
    return n - k;
}

/* The direct write (shm/_wire.c, "Direct writes"): `o`, the one part of a frame, on socket `s` that
 * the caller claimed (s->writing) with nothing queued, without blocking. 1: all of it went; 0: the
 * rest is queued at the head for the writer (o->skip says how much went); -errno: the socket failed
 * (o is freed, the link lost). Takes w->mu after the write. */
static int write_direct(Wire *w, Sock *s, Out *o) {
    struct iovec iov[3];
    int niov = out_iov(o, iov);
    struct msghdr msg = {0};
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)niov;
    ssize_t k;
    do k = sendmsg(s->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (k < 0 && errno == EINTR);
    int err = k < 0 && errno != EAGAIN && errno != EWOULDBLOCK ? errno : 0;
    uint64_t total = HDR + o->send->keylen + o->len;
    pthread_mutex_lock(&w->mu);
    s->writing = 0;
    if (err) {   /* (the token never comes: the loop learns of the loss from poll) */
        _sw_set_lost(w, "send on socket %d of the collective link failed: %s", s->index, strerror(err));
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&w->mu);
        free(o->send);
        free(o);
        _sw_wake_loop(w);
        return -err;
    }
    if (k > 0 && (uint64_t)k == total) {
        w->bytes_out += total;
        w->direct_out++;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&w->mu);
        free(o->send);
        free(o);
        return 1;
    }
    o->skip = k > 0 ? (uint64_t)k : 0;   /* the writer sends the rest, before anything queued since */
    o->next = s->head;
    s->head = o;
    if (!s->tail) s->tail = o;
    s->queued++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&w->mu);
    return 0;
}

/* Queue a frame of n bytes at addr on w's sockets, split in parts (shm/_wire.c, "Frames"), or with
 * `direct`, a frame of one part up to direct_max bytes whose socket is idle, write it now (1: no token
 * comes). 0: queued; -EPIPE once the wire is closing, -E2BIG past its frame limit, -ENOMEM, or the
 * direct write's -errno. Takes w->mu. */
int _sw_queue_send(Wire *w, const char *key, uint32_t keylen, const char *addr, uint64_t n, long long token,
                   int direct) {
    if (n > w->max_total) return -E2BIG;
    uint64_t parts = n / w->part_min;
    if (parts < 1) parts = 1;
    if (parts > (uint64_t)w->nsocks) parts = (uint64_t)w->nsocks;
    uint64_t each = (n + parts - 1) / parts;
    each = (each + PART_ALIGN - 1) / PART_ALIGN * PART_ALIGN;
    Send *snd = malloc(sizeof *snd);
    Out *outs[MAX_SOCKS];
    int nout = 0;
    if (!snd) return -ENOMEM;
    snd->token = token;
    snd->keylen = keylen;
    memcpy(snd->key, key, keylen);
    for (uint64_t off = 0; nout == 0 || off < n; off += each) {
        uint64_t len = n - off < each ? n - off : each;
        Out *o = malloc(sizeof *o);
        if (!o) {
            for (int i = 0; i < nout; i++) free(outs[i]);
            free(snd);
            return -ENOMEM;
        }
        o->next = NULL;
        o->data = addr + off;
        o->len = len;
        o->skip = 0;
        o->send = snd;
        _sw_make_header(o->hdr, T_COLL, (uint32_t)(keylen + len), (uint64_t)keylen, off, n);
        outs[nout++] = o;
    }
    snd->left = nout;
    pthread_mutex_lock(&w->mu);
    if (w->closing) {
        pthread_mutex_unlock(&w->mu);
        for (int i = 0; i < nout; i++) free(outs[i]);
        free(snd);
        return -EPIPE;
    }
    if (direct && nout == 1 && w->direct_max && n <= w->direct_max) {
        Sock *s = &w->s[w->rr % (unsigned)w->nsocks];
        if (s->fd >= 0 && !s->head && !s->writing && !s->busy && !s->peer_bye && !w->lost[0]) {
            s->writing = 1;
            w->rr++;
            pthread_mutex_unlock(&w->mu);
            return write_direct(w, s, outs[0]);
        }
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
    return 0;
}

/* A receive of w finished with chain c: send what it landed (c->addr, c->n) on c->to, from this thread,
 * without the loop. A send that cannot be queued fails c->to's link (unless it is closing: the
 * communicator is going down anyway). The chain then waits on w's `spent` list for poll(). */
void _sw_fire(Wire *w, Chain *c) {
    int rc = _sw_queue_send(c->to, c->key, c->keylen, c->addr, c->n, c->token, 1);
    if (rc == 1) {   /* written here: its token is ours to queue */
        pthread_mutex_lock(&c->to->mu);
        _sw_push_done(c->to, c->token);
        pthread_mutex_unlock(&c->to->mu);
        _sw_wake_loop(c->to);
    } else if (rc < 0 && rc != -EPIPE) {
        pthread_mutex_lock(&c->to->mu);
        _sw_set_lost(c->to, "a collective's frame forwarded from another link could not be queued (errno %d)%s",
                     -rc, "");
        pthread_mutex_unlock(&c->to->mu);
        _sw_wake_loop(c->to);
    }
    pthread_mutex_lock(&w->mu);
    c->next = w->spent;
    w->spent = c;
    pthread_mutex_unlock(&w->mu);
}

static uint64_t le64(const unsigned char *b) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}

static void put64(unsigned char *b, uint64_t v) {
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
}

void _sw_make_header(unsigned char *h, int type, uint32_t length, uint64_t a, uint64_t b, uint64_t c) {
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
void _sw_land(const Recv *e, uint64_t off, const char *src, uint64_t len) {
    if (!e->fold) {
        memcpy(e->addr + off, src, len);
        return;
    }
    char *srcs[2] = {(char *)e->a + off, (char *)src};
    char *dst = e->addr + off;
    reduce_run(kernel_for(e->op, e->code), e->op, e->code, (size_t)(len / itemsize[e->code]), srcs, 2, &dst, 1, 0);
}

/* Read `part` bytes of a frame straight into folding receive `e` at `off`: FOLD_BYTES at a time into
 * `bounce`, each reduced into place before the next is read. Bytes read, or -errno. */
static long long read_folding(int fd, const Recv *e, uint64_t off, uint64_t part, char *bounce) {
    uint64_t done = 0;
    while (done < part) {
        uint64_t n = part - done < FOLD_BYTES ? part - done : FOLD_BYTES;
        long long r = sock_read_full(fd, bounce, n);
        if (r != (long long)n) return r < 0 ? r : (long long)done + r;
        _sw_land(e, off + done, bounce, n);
        done += n;
    }
    return (long long)done;
}

/* The copier: parts that arrived before their receive was posted, landed off the loop (recv() queues
 * the entry, holding one inflight count on it, with its parts). */
void *_sw_copier_main(void *arg) {
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
            if (!cancelled) _sw_land(e, p->off, p->data, p->len);
            sum += p->len;
        }
        _sw_free_parts(parts);
        pthread_mutex_lock(&w->mu);
        e->got += sum;
        e->inflight--;
        Chain *then;
        int finished = _sw_finish(w, e, 1, &then);
        pthread_mutex_unlock(&w->mu);
        if (then) _sw_fire(w, then);
        if (finished) _sw_wake_loop(w);
    }
}

void *_sw_reader_main(void *arg) {
    Sock *s = arg;
    Wire *w = s->w;
    unsigned char h[HDR];
    char key[MAX_KEY];
    char *bounce = malloc(FOLD_BYTES);
    if (!bounce) {
        pthread_mutex_lock(&w->mu);
        _sw_set_lost(w, "socket %d: out of memory for a reader%s", s->index, "");
        pthread_mutex_unlock(&w->mu);
        _sw_wake_loop(w);
        return NULL;
    }
    for (;;) {
        long long r = sock_read_full(s->fd, (char *)h, HDR);
        if (r != HDR) {
            pthread_mutex_lock(&w->mu);
            if (r < 0)
                _sw_set_lost(w, "socket %d of the collective link: %s", s->index, strerror((int)-r));
            else if (r > 0)
                _sw_set_lost(w, "socket %d: protocol error: connection closed inside a header%s", s->index, "");
            else if (!s->peer_bye)
                _sw_set_lost(w, "socket %d: connection closed without a goodbye%s", s->index, "");
            int tell = w->lost[0] && !w->lost_told;
            pthread_mutex_unlock(&w->mu);
            if (tell) _sw_wake_loop(w);
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
        if (!bad && sock_read_full(s->fd, key, keylen) != (long long)keylen) bad = "EOF or error inside a key";
        if (bad) {
            pthread_mutex_lock(&w->mu);
            _sw_set_lost(w, "socket %d: protocol error: %s", s->index, bad);
            pthread_mutex_unlock(&w->mu);
            _sw_wake_loop(w);
            free(bounce);
            return NULL;
        }
        pthread_mutex_lock(&w->mu);
        w->bytes_in += HDR + length;
        Recv *e = _sw_find(w->posted, key, (uint32_t)keylen);
        if (!e) e = _sw_find(w->stash, key, (uint32_t)keylen);
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
            _sw_set_lost(w, "socket %d: %s", s->index, bad);
            pthread_mutex_unlock(&w->mu);
            _sw_wake_loop(w);
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
            got = e->fold ? read_folding(s->fd, e, off, part, bounce) : sock_read_full(s->fd, e->addr + off, part);
        } else {
            buf = malloc(part ? part : 1);
            got = buf ? sock_read_full(s->fd, buf, part) : -ENOMEM;
        }
        int finished = 0;
        Chain *then = NULL;
        pthread_mutex_lock(&w->mu);
        if (got != (long long)part) {
            e->inflight--;
            _sw_settle(w, e);   /* (a cancelled entry is freed; a live one is left to the failure) */
            if (got < 0) _sw_set_lost(w, "socket %d of the collective link: %s", s->index, strerror((int)-got));
            else _sw_set_lost(w, "socket %d: connection closed inside a frame%s", s->index, "");
            pthread_mutex_unlock(&w->mu);
            free(buf);
            _sw_wake_loop(w);
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
                _sw_set_lost(w, "socket %d: out of memory for an early frame%s", s->index, "");
            }
            e->inflight--;
        } else {
            if (buf && !e->cancelled) {   /* posted while we read: land the part, out of the lock */
                pthread_mutex_unlock(&w->mu);
                _sw_land(e, off, buf, part);
                pthread_mutex_lock(&w->mu);
            }
            e->got += part;
            e->inflight--;
            if (e->got > e->nbytes) _sw_set_lost(w, "socket %d: protocol error: %s", s->index, "parts overlap");
            finished = _sw_finish(w, e, 1, &then);
        }
        int tell = finished || (w->lost[0] && !w->lost_told);
        pthread_mutex_unlock(&w->mu);
        free(buf);
        if (then) _sw_fire(w, then);
        if (tell) _sw_wake_loop(w);
    }
}

void *_sw_writer_main(void *arg) {
    Sock *s = arg;
    Wire *w = s->w;
    int failed = 0;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while ((!s->head || s->writing) && !w->closing && !s->peer_bye && !w->lost[0]) {
            struct timespec ts;   /* bounded: closing always broadcasts, but never wait on that alone */
            clock_gettime(CLOCK_MONOTONIC, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&s->cv, &w->mu, &ts);
        }
        while (s->writing) {   /* closing or a goodbye: the direct write ends first (it never blocks) */
            struct timespec ts;
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
        s->busy = 1;
        pthread_mutex_unlock(&w->mu);

        struct iovec iov[3];
        int n = out_iov(o, iov);
        int rc = sock_write_all(s->fd, iov, n);
        int finished = 0;
        pthread_mutex_lock(&w->mu);
        s->busy = 0;
        if (rc < 0) {
            _sw_set_lost(w, "send on socket %d of the collective link failed: %s", s->index, strerror(-rc));
            failed = 1;
        } else {
            w->bytes_out += HDR + (o->send ? o->send->keylen : 0) + o->len;
            if (o->send && --o->send->left == 0) {
                _sw_push_done(w, o->send->token);
                free(o->send);
                finished = 1;
            }
        }
        if (failed && o->send && --o->send->left == 0) free(o->send);   /* (its token never comes: lost) */
        int tell = finished || (failed && w->lost[0] && !w->lost_told);
        pthread_mutex_unlock(&w->mu);
        free(o);
        if (tell) _sw_wake_loop(w);
        if (failed) return NULL;
    }
    if (!w->lost[0]) {   /* goodbye behind everything queued, then our half shuts down */
        unsigned char bye[HDR];
        _sw_make_header(bye, T_BYE, 0, 0, 0, 0);
        struct iovec iov = {bye, HDR};
        sock_write_all(s->fd, &iov, 1);
    }
    shutdown(s->fd, SHUT_WR);
    return NULL;
}
