/*
 * shm._poster's fast path for point-to-point: a blocking Send of at most fast_bytes to a rank of this
 * node writes the message into a cell of the pair and returns; a blocking Recv takes it from there
 * itself when nothing of the pair can be ahead of it in the progress process. The protocol (cells,
 * the order between the two paths, memory ordering) is in shm/_fast.h; this file is the rank's half.
 *
 * Every record this rank posts also passes through _sp_fast_stamp, which keeps the counters the
 * protocol orders by: slow sends per destination rank (slow_to, and the record's number in x2),
 * receives and probes posted, collectives posted.
 *
 * What the fast path declines goes to the Comm's Python method unchanged (fast_fallback), which
 * posts it to the progress process: a Send when the pair's cells are all in use (flow control), a
 * Recv after spinning WAIT_SPIN_US with nothing to take, or whenever the checks say the progress
 * process may hold an earlier message. Declining is always correct; only taking needs the checks.
 */
#include "_poster.h"

#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ANY_SOURCE (-1)
#define RESERVED_TAG_HI (-(1LL << 62))
#define RESERVED_TAG_LO (RESERVED_TAG_HI - (1LL << 32))

static long lookup_local(PosterObject *self, long rank);

/* The progress process is not needed by a fast call, but a job whose progress process died has
 * failed: a fast call looks at its pidfd at most every PROXY_CHECK_NS and declines once it is gone,
 * so that the full path raises the failure. */
#define PROXY_CHECK_NS 1000000LL

static int proxy_alive(PosterObject *self) {
    if (self->proxy_fd < 0) return 1;
    long long now = mono_ns();
    if (now - self->proxy_checked < PROXY_CHECK_NS) return 1;
    struct pollfd p = {.fd = self->proxy_fd, .events = POLLIN};
    if (poll(&p, 1, 0) != 0) return 0;   /* exited (or the fd is bad: let the full path tell) */
    self->proxy_checked = now;
    return 1;
}

int _sp_fast_usable(PosterObject *self) {
    return self->fl.fast && self->mapped && self->usable && !self->group_depth && !*self->err &&
           !*self->abort && proxy_alive(self);
}

/* Count a record about to be posted (see the header); the record's x2 is the pair's slow-send number
 * + 1 for a send to a local rank, else 0 as _sp_write_record left it. */
void _sp_fast_stamp(PosterObject *self, char *record, const Rec *f) {
    if (!self->fl.fast) return;
    if (f->kind == KIND_SEND) {
        /* counted by destination rank, whether or not it has attached yet: every slow send to it must
         * count before any cell to it does */
        if (f->peer < 0 || f->peer >= self->size) return;
        uint64_t j = ++self->slow_to[f->peer];
        memcpy(record + 120, &j, 8);
        long d = lookup_local(self, f->peer);
        if (d >= 0)   /* the receiver's spin looks at it (a message on its way), and the dump */
            __atomic_store_n(FAST_Q(fast_pair(&self->fl, self->local_rank, d), PAIR_SLOW_SENT_OFF), j,
                             __ATOMIC_RELEASE);
    } else if (f->kind == KIND_RECV || f->kind == KIND_PROBE) {
        volatile uint64_t *posted = fast_recv_posted(&self->fl, self->local_rank);
        __atomic_store_n(posted, *posted + 1, __ATOMIC_SEQ_CST);
    } else if (f->kind == KIND_COLL) {
        char *line = coll_rank(&self->fl, self->rank);
        volatile uint64_t *n = FAST_Q(line, CRANK_SLOW_COLLS_OFF);
        *FAST_Q(line, CRANK_SLOW_FP_OFF) = (f->x1 & 0xF) | ((uint64_t)(f->redop & 0xF) << 4) |
                                           ((uint64_t)(f->code & 0xFF) << 8) |
                                           ((uint64_t)(f->peer & 0xFFFF) << 16);
        *FAST_Q(line, CRANK_SLOW_COUNT_OFF) = f->count;
        __atomic_store_n(n, *n + 1, __ATOMIC_RELEASE);
    }
}

/* set_fast(pool, fast_off, fast_bytes, rank_area_off, nlocal, slice_s, fallbacks, failed, check, proxy_fd):
 * turn the fast path on (fallbacks: the four Python paths, FAST_BARRIER .. FAST_REDUCE) and publish
 * this rank's rank in its line, where its peers look it up (lookup_local). */
PyObject *_sp_Poster_set_fast(PosterObject *self, PyObject *args) {
    unsigned long long pool, fast_off, fast_bytes, area_off;
    long nlocal;
    double slice_s;
    PyObject *fallbacks, *failed, *check;
    int proxy_fd;
    if (!PyArg_ParseTuple(args, "KKKKldOOOi", &pool, &fast_off, &fast_bytes, &area_off, &nlocal, &slice_s,
                          &fallbacks, &failed, &check, &proxy_fd))
        return NULL;
    if (!_sp_check_mapped(self)) return NULL;
    if (nlocal <= 0 || !PyTuple_Check(fallbacks) || PyTuple_GET_SIZE(fallbacks) != FAST_CALLS ||
        self->local_rank >= nlocal) {
        PyErr_SetString(PyExc_ValueError, "set_fast: bad nlocal or fallbacks");
        return NULL;
    }
    int32_t *l = PyMem_Malloc(sizeof(int32_t) * (size_t)self->size);
    uint64_t *t = PyMem_Calloc((size_t)self->size, sizeof(uint64_t));
    if (!l || !t) {
        PyMem_Free(l); PyMem_Free(t);
        return PyErr_NoMemory();
    }
    for (long i = 0; i < self->size; i++) l[i] = -2;   /* not looked up yet */
    PyMem_Free(self->local_of);
    PyMem_Free(self->slow_to);
    self->local_of = l;
    self->slow_to = t;
    for (int i = 0; i < FAST_CALLS; i++) {
        PyObject *fn = PyTuple_GET_ITEM(fallbacks, i);
        Py_INCREF(fn);
        Py_XSETREF(self->fast_fallback[i], fn);
    }
    Py_INCREF(failed); Py_XSETREF(self->fast_failed, failed);
    Py_INCREF(check); Py_XSETREF(self->fast_check, check);
    self->slice_s = slice_s;
    self->proxy_fd = proxy_fd;
    self->proxy_checked = 0;
    fast_layout(&self->fl, (char *)(uintptr_t)pool, fast_off, nlocal, fast_bytes, area_off);
    __atomic_store_n(FAST_Q(fast_rank_line(&self->fl, self->local_rank), FRANK_RANK_OFF),
                     (uint64_t)self->rank + 1, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* The local rank of communicator rank `rank`, from the lines its peers published; -1 while it has not
 * attached (its sends and receives take the progress process's path meanwhile). */
static long lookup_local(PosterObject *self, long rank) {
    int32_t v = self->local_of[rank];
    if (v >= 0) return v;
    for (long lr = 0; lr < self->fl.nlocal; lr++) {
        if (__atomic_load_n(FAST_Q(fast_rank_line(&self->fl, lr), FRANK_RANK_OFF), __ATOMIC_ACQUIRE) ==
            (uint64_t)rank + 1) {
            self->local_of[rank] = (int32_t)lr;
            return lr;
        }
    }
    return -1;
}

static long rank_of_local(PosterObject *self, long lr) {
    return (long)__atomic_load_n(FAST_Q(fast_rank_line(&self->fl, lr), FRANK_RANK_OFF), __ATOMIC_ACQUIRE) - 1;
}

/* The receiver may be waiting in the progress process: ring its doorbell and wake the loop, as
 * _native.post_event does (sequentially consistent against sleep_unless_posted). */
static void ring(PosterObject *self, long d) {
    FastLayout *f = &self->fl;
    __atomic_add_fetch(FAST_Q(fast_rank_line(f, d), FRANK_DOORBELL_OFF), 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch((uint64_t *)(f->base + POOL_EVENTS_OFF), 1, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n(self->chain.sleeping, __ATOMIC_SEQ_CST)) return;
    int r = lock_bounded(self->chain.mutex, self->timeout);
    if (r == EOWNERDEAD) pthread_mutex_consistent(self->chain.mutex);   /* the loop learns who died */
    if (r == 0 || r == EOWNERDEAD) {
        pthread_cond_broadcast(self->chain.cond);
        pthread_mutex_unlock(self->chain.mutex);
    }
}

static int parse_peer_tag(PosterObject *self, PyObject *peer_o, PyObject *tag_o, long *peer, long long *tag) {
    if (!PyLong_CheckExact(peer_o) || !PyLong_CheckExact(tag_o)) return 0;
    int overflow = 0;
    *peer = PyLong_AsLongAndOverflow(peer_o, &overflow);
    if (overflow || PyErr_Occurred()) { PyErr_Clear(); return 0; }
    *tag = PyLong_AsLongLongAndOverflow(tag_o, &overflow);
    if (overflow || PyErr_Occurred()) { PyErr_Clear(); return 0; }
    return 1;
}

/* A Send by reference waits until its cell is consumed (its payload is the sender's buffer). */
typedef struct { PosterObject *self; char *pair; uint64_t fseq; long d; } RefWait;

static int ref_consumed(void *arg) {
    RefWait *r = arg;
    return fast_next(r->pair) > r->fseq;
}

/* The receiver has not taken it within the spin: the progress process drains it (its doorbell). */
static void ref_drain(void *arg) {
    RefWait *r = arg;
    ring(r->self, r->d);
}

/* Whether a blocking Send of nb bytes at addr may go by reference (shm/_fast.h, "By reference"): the
 * size in [ref_min, ref_max], the buffer in this process's arena and in one registration (its
 * (bid, off) into *where), and no receive of the destination waiting in the progress process (the
 * progress process's one copy serves that one better than a drain of the cell). */
static int by_reference(PosterObject *self, long d, uintptr_t addr, uint64_t nb, uint64_t *where) {
    if (!self->ref_max || nb < self->ref_min || nb > self->ref_max || self->fl.fast_bytes < 3 * 8 ||
        !_sp_in_arena(self, (const char *)addr, nb))
        return 0;
    Py_ssize_t ri = _sp_find_range(self, addr, (size_t)nb);
    if (ri < 0 || fast_recv_waiting(&self->fl, d)) return 0;
    where[0] = addr - (uintptr_t)self->arena;
    where[1] = (uint64_t)self->ranges[ri].bid;
    where[2] = addr - self->ranges[ri].start;
    return 1;
}

/* Until the cell of a Send by reference is consumed: the fast path's bounded wait, whose spin gives the
 * receiver spinning in its Recv the time to take it (microseconds); if it has not, the destination's
 * doorbell before the first sleep, so that the progress process drains it (the Send then returns as a
 * buffered one would). 1, or -1 with an exception (fastpath.ref_failed raises it). */
static int ref_wait(PosterObject *self, char *pair, uint64_t fseq, long d, long dest, uint64_t nb) {
    RefWait rw = {self, pair, fseq, d};
    int rc = _sp_fast_wait(self, ref_consumed, &rw, ref_drain);
    if (rc == CW_OK) return 1;
    if (rc != CW_EXC) {
        PyObject *r = PyObject_CallFunction(self->ref_failed, "ilK", rc, dest, (unsigned long long)nb);
        Py_XDECREF(r);
    }
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "a Send by reference failed");
    return -1;
}

/* 1: sent through a cell; 0: declined (nothing changed); -1: an error (set), the message written by
 * reference and the wait for its receiver failed. ``blocking``: the caller may wait for the receiver
 * (Send), so that a large message from the arena may go by reference. */
static int fast_send(PosterObject *self, PyObject *buf, PyObject *dest_o, PyObject *tag_o, int blocking) {
    long dest; long long tag;
    if (!_sp_fast_usable(self) || !self->fast || Py_TYPE(buf) != self->ndarray ||
        !parse_peer_tag(self, dest_o, tag_o, &dest, &tag) || dest < 0 || dest >= self->size ||
        tag == LLONG_MIN)
        return 0;
    long d = lookup_local(self, dest);
    uintptr_t addr; int code; long long nbytes, count;
    if (d < 0 || !_sp_read_array(self, buf, 0, &addr, &code, &nbytes, &count) || nbytes < 0)
        return 0;
    FastLayout *f = &self->fl;
    uint64_t where[3];
    uint64_t ref = blocking && by_reference(self, d, addr, (uint64_t)nbytes, where);
    if (!ref && (uint64_t)nbytes > f->fast_bytes)
        return 0;
    char *pair = fast_pair(f, self->local_rank, d);
    uint64_t w = *FAST_Q(pair, PAIR_F_WRITTEN_OFF);
    char *cell = fast_cell(f, pair, w);
    if (__atomic_load_n(CELL_STATE(cell), __ATOMIC_ACQUIRE) != CELL_EMPTY) return 0;   /* all in use */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint32_t c = (uint32_t)code;
    uint64_t slow = self->slow_to[dest], nb = (uint64_t)nbytes, cnt = (uint64_t)count;
    uint64_t t = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    memcpy(cell + CELL_CODE_OFF, &c, 4);
    memcpy(cell + CELL_FSEQ_OFF, &w, 8);
    memcpy(cell + CELL_SLOW_BEFORE_OFF, &slow, 8);
    memcpy(cell + CELL_TAG_OFF, &tag, 8);
    memcpy(cell + CELL_NBYTES_OFF, &nb, 8);
    memcpy(cell + CELL_COUNT_OFF, &cnt, 8);
    memcpy(cell + CELL_TPOST_OFF, &t, 8);
    memcpy(cell + CELL_REF_OFF, &ref, 8);
    if (ref) memcpy(cell + CELL_HDR_BYTES, where, sizeof where);
    else if (nb) memcpy(cell + CELL_HDR_BYTES, (const void *)addr, nb);
    __atomic_store_n(CELL_STATE(cell), CELL_FULL, __ATOMIC_RELEASE);
    __atomic_store_n(FAST_Q(pair, PAIR_F_WRITTEN_OFF), w + 1, __ATOMIC_RELEASE);
    /* counted for the progress process (any cell to d?); the RMW is also the full fence before the
     * loads of d's receive counters below */
    __atomic_add_fetch(FAST_Q(fast_rank_line(f, d), FRANK_CELLS_WRITTEN_OFF), 1, __ATOMIC_SEQ_CST);
    if (fast_recv_waiting(f, d))
        ring(self, d);
    if (!ref) return 1;
    self->ref_sent++;
    return ref_wait(self, pair, w, d, dest, nb);
}

/* set_ref(min_bytes, max_bytes, failed): Sends by reference (FAST_REF_MIN_BYTES, FAST_REF_MAX_BYTES;
 * max 0: off), after set_arena. */
PyObject *_sp_Poster_set_ref(PosterObject *self, PyObject *args) {
    unsigned long long lo, hi;
    PyObject *failed;
    if (!PyArg_ParseTuple(args, "KKO", &lo, &hi, &failed)) return NULL;
    if (!self->peer_arena) {
        PyErr_SetString(PyExc_ValueError, "set_ref: after set_arena");
        return NULL;
    }
    self->ref_min = lo;
    self->ref_max = hi;
    Py_INCREF(failed);
    Py_XSETREF(self->ref_failed, failed);
    Py_RETURN_NONE;
}

/* The arguments of a call by parameter: out[i] = the i-th of `names`, given by position or keyword,
 * NULL when absent. 0 when the call does not fit (too many, an unknown or repeated keyword, a
 * `stream` that is not None): the caller hands it to its Python method, which says what is wrong. */
int _sp_args(PyObject *const *args, size_t nargsf, PyObject *kwnames, const char *const *names, int nnames,
             PyObject **out) {
    Py_ssize_t n = PyVectorcall_NARGS(nargsf), nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (n > nnames) return 0;
    for (int i = 0; i < nnames; i++) out[i] = i < n ? args[i] : NULL;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int i = 0;
        while (i < nnames && PyUnicode_CompareWithASCIIString(key, names[i]) != 0) i++;
        if (i == nnames || out[i]) return 0;
        out[i] = args[n + k];
    }
    return !(nnames && !strcmp(names[nnames - 1], "stream") && out[nnames - 1] && out[nnames - 1] != Py_None);
}

/* A declined Send or Recv: the Isend/Irecv post (C, which hands what it cannot take to Python) and the
 * request's Wait, without a Python frame between: a large message must find its receive posted as
 * early as before, or it arrives unexpected and is copied once more (BENCHMARKS.md, the fast path's
 * A/B). Returns what Wait returns. */
static PyObject *post_and_wait(PosterObject *self,
                               PyObject *(*post)(PosterObject *, PyObject *const *, size_t, PyObject *),
                               PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *req = post(self, args, nargsf, kwnames);
    if (!req) return NULL;
    PyObject *res = PyObject_CallMethod(req, "Wait", NULL);
    Py_DECREF(req);
    return res;
}

/* Send's cell, with send's arguments as passed: 1 when the message went into one, 0 when the fast path
 * declined it, -1 on an error (set). */
static int send_cell(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames, int blocking) {
    static const char *const names[] = {"buf", "dest", "tag", "stream"};
    static PyObject *zero = NULL;
    if (!zero && !(zero = PyLong_FromLong(0))) return -1;
    PyObject *a[4];
    if (!_sp_args(args, nargsf, kwnames, names, 4, a) || !a[0] || !a[1]) return 0;
    return fast_send(self, a[0], a[1], a[2] ? a[2] : zero, blocking);
}

/* send(buf, dest, tag=0, stream=None): Comm.Send. */
PyObject *_sp_Poster_send(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    int r = send_cell(self, args, nargsf, kwnames, 1);
    if (r < 0) return NULL;
    if (r) Py_RETURN_NONE;
    return post_and_wait(self, _sp_Poster_isend, args, nargsf, kwnames);
}

/* send_or_isend(buf, dest, tag=0, stream=None): a Send through a cell of the pair when the fast path
 * takes it (None: done, the bytes are in the cell), else Comm.Isend's Request, posted and never
 * waited for here. For a caller whose send must not block, which a declined Send would (its Isend
 * is waited for): the torch backend's send, which torch's isend returns unwaited. */
PyObject *_sp_Poster_send_or_isend(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    int r = send_cell(self, args, nargsf, kwnames, 0);
    if (r < 0) return NULL;
    if (r) Py_RETURN_NONE;
    return _sp_Poster_isend(self, args, nargsf, kwnames);
}

static int tag_accepts(long long want, long long tag) {
    return want == tag || (want == LLONG_MIN && !(tag >= RESERVED_TAG_LO && tag < RESERVED_TAG_HI));
}

/* What a look at one sender's next cell found. */
enum { LOOK_NOTHING, LOOK_TAKEN, LOOK_DECLINE };

/* Look at the next cell from local rank s; take it into buf when every check of shm/_fast.h holds.
 * The cell is claimed first and checked after, so that nothing can change under the checks; a claim
 * that fails them is undone. */
static int look(PosterObject *self, long s, long long want_tag, uintptr_t addr, int code, long long cap,
                PyObject **status) {
    FastLayout *f = &self->fl;
    long me = self->local_rank;
    char *pair = fast_pair(f, s, me);
    uint64_t next = fast_next(pair);
    char *cell = fast_cell(f, pair, next);
    if (__atomic_load_n(CELL_STATE(cell), __ATOMIC_ACQUIRE) != CELL_FULL) {
        /* nothing in a cell: if a message of the pair is on its way through the progress process, or
         * one is waiting there for us, spinning here would only delay it */
        if (__atomic_load_n(FAST_Q(pair, PAIR_SLOW_SENT_OFF), __ATOMIC_ACQUIRE) >
                __atomic_load_n(FAST_Q(pair, PAIR_FETCHED_SLOW_OFF), __ATOMIC_ACQUIRE) ||
            __atomic_load_n(FAST_Q(pair, PAIR_UNEXP_OFF), __ATOMIC_ACQUIRE))
            return LOOK_DECLINE;
        return LOOK_NOTHING;
    }
    if (!fast_claim(cell, CELL_TAKING)) return LOOK_DECLINE;   /* the progress process drains it */
    uint64_t fseq, slow, nb; long long tag; uint32_t c;
    memcpy(&fseq, cell + CELL_FSEQ_OFF, 8);
    memcpy(&slow, cell + CELL_SLOW_BEFORE_OFF, 8);
    memcpy(&tag, cell + CELL_TAG_OFF, 8);
    memcpy(&nb, cell + CELL_NBYTES_OFF, 8);
    memcpy(&c, cell + CELL_CODE_OFF, 4);
    char *line = fast_rank_line(f, me);
    int ok = fseq == fast_next(pair) &&
             __atomic_load_n(FAST_Q(pair, PAIR_FETCHED_SLOW_OFF), __ATOMIC_ACQUIRE) >= slow &&
             __atomic_load_n(FAST_Q(pair, PAIR_UNEXP_OFF), __ATOMIC_ACQUIRE) == 0 &&
             __atomic_load_n(FAST_Q(line, FRANK_RECV_DONE_OFF), __ATOMIC_ACQUIRE) == *fast_recv_posted(f, me);
    if (!ok) {
        __atomic_store_n(CELL_STATE(cell), CELL_FULL, __ATOMIC_RELEASE);
        return LOOK_DECLINE;
    }
    if (!tag_accepts(want_tag, tag) || (int)c != code || (long long)nb > cap) {
        /* another message, or one the receive cannot take: the progress process decides (and names
         * the error of a truncation or a type mismatch) */
        __atomic_store_n(CELL_STATE(cell), CELL_FULL, __ATOMIC_RELEASE);
        return LOOK_DECLINE;
    }
    uint64_t ref;
    memcpy(&ref, cell + CELL_REF_OFF, 8);
    const char *from = cell + CELL_HDR_BYTES;
    long sr = rank_of_local(self, s);
    if (ref) {   /* the payload is in the sender's arena: mapped here once, then one copy */
        uint64_t at;
        memcpy(&at, cell + CELL_HDR_BYTES, 8);
        if (!self->peer_arena || !_sp_map_arena(self, sr) || at + nb > self->peer_arena_size[sr]) {
            __atomic_store_n(CELL_STATE(cell), CELL_FULL, __ATOMIC_RELEASE);
            return LOOK_DECLINE;   /* the progress process drains it from its registration */
        }
        from = self->peer_arena[sr] + at;
    }
    *status = _sp_new_status((int)sr, tag, (long long)nb);
    if (!*status) {
        __atomic_store_n(CELL_STATE(cell), CELL_FULL, __ATOMIC_RELEASE);
        return LOOK_DECLINE;
    }
    if (nb) memcpy((void *)addr, from, nb);
    fast_release(pair, cell, PAIR_F_TAKEN_OFF);
    volatile uint64_t *taken = FAST_Q(line, FRANK_CELLS_TAKEN_OFF);
    __atomic_store_n(taken, *taken + 1, __ATOMIC_RELEASE);
    if (ref) {
        self->ref_taken++;
        _sp_fast_notify(f);   /* its sender waits for this */
    }
    return LOOK_TAKEN;
}

/* A Status when received through a cell; NULL with no exception when declined. */
static PyObject *fast_recv(PosterObject *self, PyObject *buf, PyObject *src_o, PyObject *tag_o) {
    long src; long long tag;
    if (!_sp_fast_usable(self) || !self->fast || Py_TYPE(buf) != self->ndarray ||
        !parse_peer_tag(self, src_o, tag_o, &src, &tag) || src < ANY_SOURCE || src >= self->size)
        return NULL;
    FastLayout *f = &self->fl;
    long me = self->local_rank, s = src == ANY_SOURCE ? -1 : lookup_local(self, src);
    if (src != ANY_SOURCE && s < 0) return NULL;
    uintptr_t addr; int code; long long cap, count;
    if (!_sp_read_array(self, buf, 1, &addr, &code, &cap, &count)) return NULL;
    char *line = fast_rank_line(f, me);
    uint64_t cells_hold = f->fast_bytes > self->ref_max ? f->fast_bytes : self->ref_max;   /* by reference too */
    if ((uint64_t)cap > cells_hold &&
        __atomic_load_n(FAST_Q(line, FRANK_CELLS_WRITTEN_OFF), __ATOMIC_ACQUIRE) ==
            *FAST_Q(line, FRANK_CELLS_TAKEN_OFF) +
            __atomic_load_n(FAST_Q(line, FRANK_CELLS_DRAINED_OFF), __ATOMIC_ACQUIRE))
        return NULL;   /* a receive larger than a cell, and no cell to take: posted at once (below) */
    if (__atomic_load_n(FAST_Q(line, FRANK_RECV_DONE_OFF), __ATOMIC_ACQUIRE) != *fast_recv_posted(f, me))
        return NULL;   /* a receive or probe of ours is pending in the progress process */
    /* Spin for a cell only where a cell's message is what the receive expects (one with its payload,
     * or one by reference, up to FAST_REF_MAX_BYTES): a larger receive looks once, then is posted at
     * once, so that a large message finds it posted (a message that arrives before its receive is
     * copied once more, into the progress process's buffer; BENCHMARKS.md, the fast path's A/B). And
     * only where Wait would spin (WAIT_SPIN_MAX_BYTES: on a crowded node the copy workers need the
     * cores). */
    long long end = (uint64_t)cap <= cells_hold && cap <= self->spin_max
                        ? mono_ns() + (long long)(self->spin_s * 1e9) : 0;
    PyObject *status = NULL;
    for (;;) {
        int saw = 0;
        if (s >= 0) {
            int r = look(self, s, tag, addr, code, cap, &status);
            if (r == LOOK_TAKEN) return status;
            if (r == LOOK_DECLINE) return NULL;
        } else {
            long n = f->nlocal;
            for (long i = 0; i < n; i++) {
                long k = (long)((self->rr + (unsigned)i) % (unsigned)n);
                int r = look(self, k, tag, addr, code, cap, &status);
                if (r == LOOK_TAKEN) {
                    self->rr = (unsigned)(k + 1);
                    return status;
                }
                saw |= r == LOOK_DECLINE;
            }
            if (saw) return NULL;
        }
        if (mono_ns() >= end || *self->err || *self->abort) return NULL;
        Py_BEGIN_ALLOW_THREADS
        sched_yield();
        Py_END_ALLOW_THREADS
        if (!_sp_fast_usable(self)) return NULL;
    }
}

/* Recv's cell, with recv's arguments as passed: the Status when the fast path took the message, else
 * NULL (an error set only on a failure). */
static PyObject *recv_cell(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"buf", "source", "tag", "stream"};
    static PyObject *any_source = NULL, *any_tag = NULL;
    if (!any_source && !(any_source = PyLong_FromLong(ANY_SOURCE))) return NULL;
    if (!any_tag && !(any_tag = PyLong_FromLongLong(LLONG_MIN))) return NULL;
    PyObject *a[4];
    if (_sp_args(args, nargsf, kwnames, names, 4, a) && a[0])
        return fast_recv(self, a[0], a[1] ? a[1] : any_source, a[2] ? a[2] : any_tag);
    return NULL;
}

/* try_recv(buf, source=ANY_SOURCE, tag=ANY_TAG): Recv's fast path alone, its bounded spin for a cell
 * included: the Status when it took the message, else None, and nothing posted. For a caller that
 * must not wait inside the communicator (the torch backend's deferred receive, whose wait holds its
 * group's lock only this long). */
PyObject *_sp_Poster_try_recv(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *st = recv_cell(self, args, nargsf, kwnames);
    if (st || PyErr_Occurred()) return st;
    Py_RETURN_NONE;
}

/* recv(buf, source=ANY_SOURCE, tag=ANY_TAG, stream=None): Comm.Recv. */
PyObject *_sp_Poster_recv(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *st = recv_cell(self, args, nargsf, kwnames);
    if (st || PyErr_Occurred()) return st;
    return post_and_wait(self, _sp_Poster_irecv, args, nargsf, kwnames);
}
