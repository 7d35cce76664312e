/*
 * shm._poster's small collectives: a blocking Barrier, Allreduce, Bcast or Reduce of at most
 * fast_bytes per rank, on a communicator whose ranks all live on this node, runs between the ranks
 * themselves through the pool's collective area, never through the progress process.
 *
 * Protocol, for the n-th small collective of the communicator (every rank counts them alike, since
 * whether a collective is small depends only on what all ranks must pass alike: its kind, size,
 * dtype and op). Each rank has two slots, used by the collective's parity:
 *   1. wait until every rank finished reading collective n - 2 (its DONE >= n - 2), which used the
 *      same slots; a rank about to write them has finished n - 1, so this rarely waits;
 *   2. write its contribution (Allreduce, Reduce, the root of a Bcast), the collective's fingerprint
 *      and the number of collectives it posted to the progress process before this one, then the
 *      slot's SEQ = n (release), and wake sleepers (notify);
 *   3. wait for every rank's slot to say SEQ = n, comparing fingerprints (also where a rank reads
 *      nothing, as a Bcast's root does: so a mismatch is found on every rank, as the progress
 *      process finds it for its collectives);
 *   4. reduce the slots in rank order (a Reduce's root first) into its output: the order of the
 *      progress process's collectives, so every rank and both paths give the same bits; or copy the
 *      root's;
 *   5. DONE = n, and notify again.
 * A rank whose slot lags while it posted more collectives to the progress process than this rank
 * had when it wrote its own went the other way for this collective (a device buffer, a different
 * size): that is a mismatch, reported as the progress process reports one, and the communicator
 * fails on every rank.
 *
 * The middle collectives. An Allreduce, Bcast or Reduce of more than mapped_min (a Reduce:
 * mapped_min_reduce, lower: its root alone would read every cell; where the cells would take it,
 * they cost a handshake less below that) and at most mapped_bytes per rank runs
 * between the ranks, through their numpy arenas (shm/_arena.c): each
 * rank maps every other's arena (/proc/<pid>/fd/<fd>, as its line publishes them), and a slot carries
 * where the rank's input and output lie in its arena instead of the data (an array outside the arena
 * is copied into the rank's scratch block there, and out of it). Allreduce and Reduce: rank r reduces
 * share r of every input, in the order of step 4, and writes it into every output (the root's alone,
 * for a Reduce): each byte is read once and written once, and every rank works. Bcast: each rank
 * copies the root's. Then DONE, and a rank returns only once every rank is DONE (its input was read
 * and its output written by the others). Whether a rank maps every arena is its own state (an arena
 * it cannot open), so its slot says; where one does not, every rank sees it in the slots and declines
 * alike after the handshake, and the call is posted to the progress process (declined).
 *
 * Waits spin (yielding) for WAIT_SPIN_US, then sleep on the futex word in slices of WAIT_SLICE_MS;
 * each wake-up re-checks the slots, the communicator's error and abort flags (the progress process
 * also wakes this word when it fails the communicator) and, between slices, that the progress
 * process is alive. The whole wait is bounded by TIMEOUT.
 */
#include "_poster.h"

#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "_kernel.h"
#pragma GCC diagnostic pop

int _sp_coll_init(void) {
    init_tables();
    return 0;
}

PyObject *_sp_fast_kernel(PyObject *self, PyObject *args) {
    int op, code;
    if (!PyArg_ParseTuple(args, "ii", &op, &code)) return NULL;
    return PyBool_FromLong(kernel_for(op, code) != NULL && !(op == REDOP_AVG && code < CODE_FIRST_FLOAT));
}

static uint64_t fingerprint(int coll, int op, int code, uint64_t nbytes, long root) {
    return (uint64_t)coll | ((uint64_t)op << 4) | ((uint64_t)code << 8) | ((uint64_t)(root & 0xFFFF) << 16) |
           (nbytes << 32);
}

/* Wake the ranks sleeping in _sp_fast_wait, after this rank's store of its slot or DONE. The futex word
 * is bumped only when someone may sleep: a bump on every arrival made each rank take the area's line
 * for an atomic twice per collective, which at 16 ranks cost as much as the collective. Ordering
 * (Dekker's): this rank stores its state, fences, loads WAITERS; a sleeper adds itself to WAITERS
 * (a full barrier) after reading the word, then re-checks the slots before FUTEX_WAIT. So either
 * the sleeper sees the new state and does not sleep, or this rank sees it waiting and bumps the
 * word it waits on, which ends or prevents the sleep. */
void _sp_fast_notify(FastLayout *f) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(FAST_Q(f->coll, CAREA_WAITERS_OFF), __ATOMIC_SEQ_CST)) {
        __atomic_add_fetch((uint32_t *)(f->coll + CAREA_WORD_OFF), 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, f->coll + CAREA_WORD_OFF, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
}

typedef struct {
    PosterObject *self;
    uint64_t n, fp, slow_before;
    long bad;        /* the rank a mismatch is with */
    uint64_t bad_fp; /* its fingerprint, or 0 when it went to the progress process */
} CollWait;

static uint64_t slow_colls(FastLayout *f, long r) {
    return __atomic_load_n(FAST_Q(coll_rank(f, r), CRANK_SLOW_COLLS_OFF), __ATOMIC_ACQUIRE);
}

/* A lagging rank x posted more collectives to the progress process than this one had: a mismatch, unless
 * x went on since its slot or line was read. Between that load and the load of its count, x may have
 * arrived, finished collective n (this rank's slot was written already) and posted the next
 * nonblocking collective (a rank preempted between the two loads sees exactly that, and failed the
 * communicator). x stores SEQ = n (or DONE) before it counts a later post, both with release; the
 * acquire load of the count orders the second look after it. */
static int went_other_way(FastLayout *f, CollWait *w, long x, volatile uint64_t *seen, uint64_t ok_at) {
    if (slow_colls(f, x) <= w->slow_before) return 0;
    if (__atomic_load_n(seen, __ATOMIC_ACQUIRE) >= ok_at) return 0;   /* it went on: look again next time */
    w->bad = x; w->bad_fp = 0;
    return 1;
}

/* 1: every slot this rank reads holds collective n; 0: not yet; -1: a mismatch (w->bad). */
static int arrived(void *arg) {
    CollWait *w = arg;
    FastLayout *f = &w->self->fl;
    for (long x = 0; x < w->self->size; x++) {
        char *slot = coll_slot(f, x, w->n);
        /* no other value than n - 2 or n is possible here: x writes n + 2 only after this rank is DONE */
        if (__atomic_load_n(FAST_Q(slot, CSLOT_SEQ_OFF), __ATOMIC_ACQUIRE) != w->n)
            return went_other_way(f, w, x, FAST_Q(slot, CSLOT_SEQ_OFF), w->n) ? -1 : 0;
        uint64_t fp = *FAST_Q(slot, CSLOT_FP_OFF);
        if (fp != w->fp) {
            w->bad = x; w->bad_fp = fp;
            return -1;
        }
    }
    return 1;
}

/* 1: no rank still reads the slots of collective n - 2; 0: not yet; -1: a rank went the other way. */
static int reusable(void *arg) {
    CollWait *w = arg;
    FastLayout *f = &w->self->fl;
    for (long x = 0; x < w->self->size; x++) {
        volatile uint64_t *done = FAST_Q(coll_rank(f, x), CRANK_DONE_OFF);
        if (__atomic_load_n(done, __ATOMIC_ACQUIRE) + 2 >= w->n) continue;
        return went_other_way(f, w, x, done, w->n - 2) ? -1 : 0;
    }
    return 1;
}

/* Wait until ready(arg) (1: CW_OK; -1: CW_MISMATCH), bounded by TIMEOUT, seeing the communicator's error
 * and abort words: spin (yielding) for WAIT_SPIN_US, then sleep on the small collectives' futex word in
 * slices of WAIT_SLICE_MS, checking between them that the progress process is alive. Whoever makes
 * ready true wakes the word (_sp_fast_notify, or the progress process's fast_wake_coll). ``before_sleep``
 * (NULL: none) runs once, when the spin ends without ``ready``: a Send by reference asks the progress
 * process to drain its cell there. */
int _sp_fast_wait(PosterObject *self, int (*ready)(void *), void *w, void (*before_sleep)(void *)) {
    FastLayout *f = &self->fl;
    uint32_t *word = (uint32_t *)(f->coll + CAREA_WORD_OFF);
    uint64_t *waiters = (uint64_t *)(f->coll + CAREA_WAITERS_OFF);
    long long now = mono_ns(), spin_end = now + (long long)(self->spin_s * 1e9);
    long long end = now + (long long)(self->timeout * 1e9);
    for (;;) {
        int r = ready(w);
        if (r) return r > 0 ? CW_OK : CW_MISMATCH;
        if (*self->err || *self->abort) return CW_FAILED;
        now = mono_ns();
        if (now >= end) return CW_TIMEOUT;
        if (now < spin_end) {
            Py_BEGIN_ALLOW_THREADS
            sched_yield();
            Py_END_ALLOW_THREADS
            if (!self->mapped) return CW_GONE;
            continue;
        }
        if (before_sleep) {
            before_sleep(w);
            before_sleep = NULL;
        }
        uint32_t v = __atomic_load_n(word, __ATOMIC_SEQ_CST);
        __atomic_add_fetch(waiters, 1, __ATOMIC_SEQ_CST);
        r = ready(w);
        if (!r && !*self->err && !*self->abort) {
            double s = self->slice_s, left = (double)(end - now) / 1e9;
            if (left < s) s = left;
            struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
            Py_BEGIN_ALLOW_THREADS
            syscall(SYS_futex, word, FUTEX_WAIT, v, &ts, NULL, 0);
            Py_END_ALLOW_THREADS
        }
        __atomic_sub_fetch(waiters, 1, __ATOMIC_SEQ_CST);
        if (!r) r = ready(w);   /* what woke us first: a collective complete is not a failure */
        if (r) return r > 0 ? CW_OK : CW_MISMATCH;
        if (!self->mapped) return CW_GONE;
        PyObject *alive = PyObject_CallNoArgs(self->fast_check);   /* raises if the progress process died */
        if (!alive) return CW_EXC;
        Py_DECREF(alive);
    }
}


/* Hand a failed wait to Comm._fast_failed(code, (n, fingerprint, rank, its fingerprint)), which
 * raises (and words the message); returns NULL. */
static PyObject *failed(PosterObject *self, int code, CollWait *w, int coll) {
    if (code == CW_EXC) return NULL;
    (void)coll;
    uint64_t slow_fp = 0, slow_count = 0;   /* what the other rank posted to the progress process instead */
    if (code == CW_MISMATCH && !w->bad_fp && w->bad >= 0) {
        char *line = coll_rank(&self->fl, w->bad);
        slow_fp = __atomic_load_n(FAST_Q(line, CRANK_SLOW_FP_OFF), __ATOMIC_ACQUIRE);
        slow_count = __atomic_load_n(FAST_Q(line, CRANK_SLOW_COUNT_OFF), __ATOMIC_ACQUIRE);
    }
    PyObject *r = PyObject_CallFunction(self->fast_failed, "i(KKlKKK)", code, (unsigned long long)w->n,
                                        (unsigned long long)w->fp, w->bad, (unsigned long long)w->bad_fp,
                                        (unsigned long long)slow_fp, (unsigned long long)slow_count);
    Py_XDECREF(r);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "a small collective failed");
    return NULL;
}

/* The start of collective n, small or middle: its wait, once the slots of n - 2 are free again (a
 * rank about to write them has finished n - 1, so this rarely waits); CW_OK, or why not. */
static int begin(PosterObject *self, int coll, int op, int code, uint64_t nb, long root, CollWait *w) {
    FastLayout *f = &self->fl;
    uint64_t n = self->coll_n + 1;
    *w = (CollWait){.self = self, .n = n, .fp = fingerprint(coll, op, code, nb, root),
                    .slow_before = slow_colls(f, self->rank), .bad = -1};
    int rc = n > 2 ? _sp_fast_wait(self, reusable, w, NULL) : CW_OK;
    if (rc == CW_OK) self->coll_n = n;
    return rc;
}

/* 1: every rank is DONE with collective n (a middle one: it read its inputs and wrote its outputs). */
static int finished(void *arg) {
    CollWait *w = arg;
    FastLayout *f = &w->self->fl;
    for (long x = 0; x < w->self->size; x++)
        if (__atomic_load_n(FAST_Q(coll_rank(f, x), CRANK_DONE_OFF), __ATOMIC_ACQUIRE) < w->n) return 0;
    return 1;
}

/* Rank x's arena mapped here: 1, or 0 where it has none, has not published it yet, or cannot be
 * opened (a restricted /proc): the collective is then declined, and tried again next time. */
int _sp_map_arena(PosterObject *self, long x) {
    if (self->peer_arena[x]) return 1;
    if (x == self->rank) {
        self->peer_arena[x] = self->arena;
        self->peer_arena_size[x] = self->arena_size;
        return self->arena != NULL;
    }
    char *line = coll_rank(&self->fl, x);
    uint64_t who = __atomic_load_n(FAST_Q(line, CRANK_ARENA_OFF), __ATOMIC_ACQUIRE);
    if (!who || who == ARENA_NONE) return 0;
    uint64_t size = __atomic_load_n(FAST_Q(line, CRANK_ARENA_SIZE_OFF), __ATOMIC_ACQUIRE);
    char path[64];
    snprintf(path, sizeof path, "/proc/%u/fd/%u", (unsigned)(who >> 32), (unsigned)(who & 0xFFFFFFFFu) - 1);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return 0;
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return 0;
    self->peer_arena[x] = m;
    self->peer_arena_size[x] = size;
    return 1;
}

void _sp_unmap_arenas(PosterObject *self) {
    if (!self->peer_arena) return;
    for (long x = 0; x < self->size; x++)
        if (self->peer_arena[x] && self->peer_arena[x] != self->arena) munmap(self->peer_arena[x], self->peer_arena_size[x]);
    PyMem_Free(self->peer_arena);
    PyMem_Free(self->peer_arena_size);
    self->peer_arena = NULL;
    self->peer_arena_size = NULL;
    self->mapped_bytes = 0;
}

int _sp_in_arena(PosterObject *self, const char *p, uint64_t nb) {
    return self->arena && p >= self->arena && p + nb <= self->arena + self->arena_size;
}

/* A middle collective (the header): arguments as run's. Returns None, Ellipsis where every rank
 * declined it (the caller posts it: declined), or NULL with an exception. */
static PyObject *run_mapped(PosterObject *self, int coll, const char *send, char *recv, uint64_t nb, int code,
                            long long count, int op, long root, int decline) {
    FastLayout *f = &self->fl;
    long me = self->rank, size = self->size;
    CollWait w;
    int rc = begin(self, coll, op, code, nb, root, &w);
    if (rc != CW_OK) return failed(self, rc, &w, coll);
    uint64_t n = w.n;
    int ok = self->arena != NULL && !decline;
    for (long x = 0; ok && x < size; x++) ok = _sp_map_arena(self, x);
    /* what this rank offers: its input (Allreduce, Reduce, a Bcast's root), its output (Allreduce,
     * a Reduce's root; a Bcast's others copy into theirs themselves) */
    const char *in = send ? send : recv;
    int reads = coll != COLL_BCAST || me == root;
    int out = coll == COLL_ALLREDUCE || (coll == COLL_REDUCE && me == root);
    char *in_at = NULL, *out_at = NULL, *copy_out = NULL;
    if (ok && reads) {
        in_at = (char *)in;
        if (!_sp_in_arena(self, in, nb)) {
            in_at = self->scratch;
            memcpy(in_at, in, nb);
        }
    }
    if (ok && out) {
        out_at = recv;
        if (!send && in_at) out_at = in_at;   /* in place: the output is the input, wherever it lies */
        else if (!_sp_in_arena(self, recv, nb)) out_at = self->scratch + self->mapped_bytes;
        if (out_at != recv) copy_out = out_at;
    }
    char *slot = coll_slot(f, me, n);
    *FAST_Q(slot, CSLOT_FP_OFF) = w.fp;
    *FAST_Q(slot, CSLOT_SLOW_BEFORE_OFF) = w.slow_before;
    *FAST_Q(slot, CSLOT_IN_OFF) = in_at ? (uint64_t)(in_at - self->arena) : 0;
    *FAST_Q(slot, CSLOT_OUT_OFF) = out_at ? (uint64_t)(out_at - self->arena) : 0;
    *FAST_Q(slot, CSLOT_MAPPED_OFF) = (uint64_t)ok;
    __atomic_store_n(FAST_Q(slot, CSLOT_SEQ_OFF), n, __ATOMIC_RELEASE);
    _sp_fast_notify(f);
    if ((rc = _sp_fast_wait(self, arrived, &w, NULL)) != CW_OK) return failed(self, rc, &w, coll);
    int all = 1;
    for (long x = 0; x < size; x++) all &= *FAST_Q(coll_slot(f, x, n), CSLOT_MAPPED_OFF) == 1;
    if (all && coll == COLL_BCAST) {
        if (me != root)
            memcpy(recv, self->peer_arena[root] + *FAST_Q(coll_slot(f, root, n), CSLOT_IN_OFF), nb);
    } else if (all && count) {
        /* this rank's share, whole cache lines of elements: the same split on every rank */
        size_t isz = (size_t)(nb / (uint64_t)count), line = isz < 64 ? 64 / isz : 1;
        size_t per = ((size_t)count + (size_t)size - 1) / (size_t)size;
        per = (per + line - 1) / line * line;
        size_t lo = per * (size_t)me < (size_t)count ? per * (size_t)me : (size_t)count;
        size_t hi = lo + per < (size_t)count ? lo + per : (size_t)count;
        if (hi > lo) {
            char *srcs[64], *dsts[64];
            char **s = srcs, **d = dsts;
            if (size > 64) {
                s = PyMem_Malloc(sizeof(char *) * (size_t)size);
                d = PyMem_Malloc(sizeof(char *) * (size_t)size);
                if (!s || !d) {   /* give the collective up as a failure: the others wait for this share */
                    PyMem_Free(s); PyMem_Free(d);
                    return PyErr_NoMemory();
                }
            }
            long k = 0, nd = 0;
            if (coll == COLL_REDUCE)   /* step 4's order: a Reduce's root first */
                s[k++] = self->peer_arena[root] + *FAST_Q(coll_slot(f, root, n), CSLOT_IN_OFF) + lo * isz;
            for (long x = 0; x < size; x++) {
                char *sl = coll_slot(f, x, n);
                if (!(coll == COLL_REDUCE && x == root)) s[k++] = self->peer_arena[x] + *FAST_Q(sl, CSLOT_IN_OFF) + lo * isz;
                if (coll == COLL_ALLREDUCE || x == root) d[nd++] = self->peer_arena[x] + *FAST_Q(sl, CSLOT_OUT_OFF) + lo * isz;
            }
            reduce_run(kernel_for(op, code), op, code, hi - lo, s, (size_t)size, d, (size_t)nd, 0);
            if (s != srcs) { PyMem_Free(s); PyMem_Free(d); }
        }
    }
    __atomic_store_n(FAST_Q(coll_rank(f, me), CRANK_DONE_OFF), n, __ATOMIC_RELEASE);
    _sp_fast_notify(f);
    if (!all) return Py_NewRef(Py_Ellipsis);
    /* the others read this rank's input and write its output until they are DONE */
    if ((rc = _sp_fast_wait(self, finished, &w, NULL)) != CW_OK) return failed(self, rc, &w, coll);
    if (copy_out) memcpy(recv, copy_out, nb);
    Py_RETURN_NONE;
}

/* coll_decline(coll, nbytes, code, count, op, root): this rank's part of a middle collective it
 * cannot run this way (device arrays, which go to the progress process): the handshake, saying so,
 * so that every rank declines alike; returns Ellipsis (the caller posts the call), or raises what
 * a failed handshake raises. */
PyObject *_sp_Poster_coll_decline(PosterObject *self, PyObject *args) {
    int coll, code, op;
    unsigned long long nb;
    long long count;
    long root;
    if (!PyArg_ParseTuple(args, "iKiLil", &coll, &nb, &code, &count, &op, &root)) return NULL;
    if (!_sp_fast_usable(self) || !self->fast || !self->mapped_bytes) {
        CollWait w = {.self = self, .bad = -1};
        return failed(self, self->mapped ? CW_FAILED : CW_GONE, &w, coll);
    }
    return run_mapped(self, coll, NULL, NULL, nb, code, count, op, root, 1);
}

/* set_arena(mapped_bytes, mapped_min, mapped_min_reduce, arena, arena_size, arena_fd, scratch): the
 * middle collectives, above mapped_min (mapped_min_reduce for a Reduce: the cells keep those, where
 * fast_bytes allows) and up to mapped_bytes per rank
 * (0: off; every rank passes the same, with or without an arena: arena 0). Publishes the arena in
 * this rank's line. After set_fast. */
PyObject *_sp_Poster_set_arena(PosterObject *self, PyObject *args) {
    unsigned long long mapped, mapped_min, mapped_min_reduce, arena, arena_size, scratch;
    int fd;
    if (!PyArg_ParseTuple(args, "KKKKKiK", &mapped, &mapped_min, &mapped_min_reduce, &arena, &arena_size, &fd,
                          &scratch))
        return NULL;
    if (!_sp_check_mapped(self)) return NULL;
    if (!self->fl.fast) {
        PyErr_SetString(PyExc_ValueError, "set_arena: after set_fast");
        return NULL;
    }
    _sp_unmap_arenas(self);
    self->peer_arena = PyMem_Calloc((size_t)self->size, sizeof(char *));
    self->peer_arena_size = PyMem_Calloc((size_t)self->size, sizeof(uint64_t));
    if (!self->peer_arena || !self->peer_arena_size) {
        _sp_unmap_arenas(self);
        return PyErr_NoMemory();
    }
    self->arena = arena && scratch ? (char *)(uintptr_t)arena : NULL;
    self->arena_size = arena_size;
    self->scratch = (char *)(uintptr_t)scratch;
    self->mapped_bytes = mapped > mapped_min ? mapped : 0;
    self->mapped_min = mapped_min;
    self->mapped_min_reduce = mapped_min_reduce;
    char *line = coll_rank(&self->fl, self->rank);
    __atomic_store_n(FAST_Q(line, CRANK_ARENA_SIZE_OFF), (uint64_t)arena_size, __ATOMIC_RELEASE);
    __atomic_store_n(FAST_Q(line, CRANK_ARENA_OFF),
                     self->arena ? ((uint64_t)getpid() << 32) | (uint64_t)(fd + 1) : ARENA_NONE, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* Run one small collective (arguments checked: contiguous host arrays of the same dtype, nbytes of
 * at most fast_bytes, a kernel for (op, code)). send: NULL in place (Allreduce, Reduce at the root);
 * recv: the output (the buffer of a Bcast), NULL where a rank has none. */
static PyObject *run(PosterObject *self, int coll, const char *send, char *recv, uint64_t nb, int code,
                     long long count, int op, long root) {
    if (nb > self->fl.fast_bytes ||
        (self->mapped_bytes && nb > (coll == COLL_REDUCE ? self->mapped_min_reduce : self->mapped_min)))
        return run_mapped(self, coll, send, recv, nb, code, count, op, root, 0);
    FastLayout *f = &self->fl;
    long me = self->rank;
    CollWait w;
    int rc = begin(self, coll, op, code, nb, root, &w);
    if (rc != CW_OK) return failed(self, rc, &w, coll);
    uint64_t n = w.n;
    char *slot = coll_slot(f, me, n);
    int writes = coll != COLL_BARRIER && !(coll == COLL_BCAST && me != root);
    if (writes && nb) memcpy(slot + CELL_HDR_BYTES, send ? send : recv, nb);
    *FAST_Q(slot, CSLOT_FP_OFF) = w.fp;
    *FAST_Q(slot, CSLOT_SLOW_BEFORE_OFF) = w.slow_before;
    __atomic_store_n(FAST_Q(slot, CSLOT_SEQ_OFF), n, __ATOMIC_RELEASE);
    _sp_fast_notify(f);
    /* every rank waits for every other, also where it reads nothing (a Bcast's root, a Reduce's
     * others): so each compares every fingerprint, and a mismatch is found on every rank */
    if ((rc = _sp_fast_wait(self, arrived, &w, NULL)) != CW_OK) return failed(self, rc, &w, coll);
    if (coll == COLL_BCAST && me != root) {
        if (nb) memcpy(recv, coll_slot(f, root, n) + CELL_HDR_BYTES, nb);
    } else if ((coll == COLL_ALLREDUCE || (coll == COLL_REDUCE && me == root)) && count) {
        char *srcs[64];
        char **s = self->size <= 64 ? srcs : PyMem_Malloc(sizeof(char *) * (size_t)self->size);
        if (!s) return PyErr_NoMemory();
        /* the progress process's order (proxy/coll/algorithms.py): rank 0, 1, ..., a Reduce's root first */
        long k = 0;
        if (coll == COLL_REDUCE) s[k++] = coll_slot(f, root, n) + CELL_HDR_BYTES;
        for (long x = 0; x < self->size; x++)
            if (!(coll == COLL_REDUCE && x == root)) s[k++] = coll_slot(f, x, n) + CELL_HDR_BYTES;
        reduce_run(kernel_for(op, code), op, code, (size_t)count, s, (size_t)self->size, &recv, 1, 0);
        if (s != srcs) PyMem_Free(s);
    }
    __atomic_store_n(FAST_Q(coll_rank(f, me), CRANK_DONE_OFF), n, __ATOMIC_RELEASE);
    _sp_fast_notify(f);
    Py_RETURN_NONE;
}

/* The arguments a small collective takes here: 1 when the whole call is ours. */
static int host_array(PosterObject *self, PyObject *o, int writable, uintptr_t *addr, int *code,
                      long long *nb, long long *count) {
    return Py_TYPE(o) == self->ndarray && _sp_read_array(self, o, writable, addr, code, nb, count) &&
           ((uint64_t)*nb <= self->fl.fast_bytes || (uint64_t)*nb <= self->mapped_bytes);
}

static int small_op(PyObject *op_o, int code, long *op) {
    if (!PyLong_Check(op_o) || PyBool_Check(op_o)) return 0;   /* an int or a ReduceOp */
    int overflow = 0;
    *op = PyLong_AsLongAndOverflow(op_o, &overflow);
    if (overflow || PyErr_Occurred()) { PyErr_Clear(); return 0; }
    return *op >= REDOP_SUM && *op <= REDOP_AVG && !(*op == REDOP_AVG && code < CODE_FIRST_FLOAT) &&
           kernel_for((int)*op, code) != NULL;
}

static int small_root(PosterObject *self, PyObject *o, long *root) {
    if (!PyLong_Check(o) || PyBool_Check(o)) return 0;
    int overflow = 0;
    *root = PyLong_AsLongAndOverflow(o, &overflow);
    if (overflow || PyErr_Occurred()) { PyErr_Clear(); return 0; }
    return *root >= 0 && *root < self->size;
}

static PyObject *fallback(PosterObject *self, int which, PyObject *const *args, size_t nargsf, PyObject *kw) {
    return PyObject_Vectorcall(self->fast_fallback[which], args, nargsf, kw);
}

/* run's result, where every rank declined a middle collective (Ellipsis), posted instead with the
 * call's own arguments through the collective's nonblocking form (Iallreduce, Ibcast, Ireduce: the
 * C posts' own fallbacks) and waited for: never the fast fallback, which would run the handshake a
 * second time. */
static PyObject *declined(PosterObject *self, int which, PyObject *res, PyObject *const *args, size_t nargsf,
                          PyObject *kw) {
    if (res != Py_Ellipsis) return res;
    Py_DECREF(res);
    PyObject *post = which == FAST_ALLREDUCE ? self->allreduce_fallback
                     : self->coll_fallback[which == FAST_BCAST ? COLL_BCAST : COLL_REDUCE];
    PyObject *req = PyObject_Vectorcall(post, args, nargsf, kw);
    if (!req) return NULL;
    PyObject *st = PyObject_CallMethod(req, "Wait", NULL);
    Py_DECREF(req);
    if (!st) return NULL;
    Py_DECREF(st);
    Py_RETURN_NONE;
}

/* barrier(): Comm.Barrier. */
PyObject *_sp_Poster_barrier(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) == 0 && !kwnames && _sp_fast_usable(self))
        return run(self, COLL_BARRIER, NULL, NULL, 0, 1, 0, 0, 0);
    return fallback(self, FAST_BARRIER, args, nargsf, kwnames);
}

/* The Allreduce of small host arrays between the ranks (a[0] sendbuf or IN_PLACE, a[1] recvbuf,
 * a[2] op or NULL for SUM); NULL without an exception when the call is not one of those. */
static PyObject *allreduce_small(PosterObject *self, PyObject *const *a) {
    if (!a[0] || !a[1] || !_sp_fast_usable(self) || !self->fast) return NULL;
    uintptr_t r, s = 0; int rc, sc; long long rn, sn, rcount, scount; long op = REDOP_SUM;
    int in_place = self->in_place && a[0] == self->in_place;
    if (host_array(self, a[1], 1, &r, &rc, &rn, &rcount) && (a[2] ? small_op(a[2], rc, &op) :
                                                              kernel_for(REDOP_SUM, rc) != NULL) &&
        (in_place || (host_array(self, a[0], 0, &s, &sc, &sn, &scount) && sc == rc && scount == rcount)))
        return run(self, COLL_ALLREDUCE, in_place ? NULL : (const char *)s, (char *)r, (uint64_t)rn, rc,
                   rcount, (int)op, 0);
    return NULL;
}

/* allreduce(sendbuf, recvbuf, op=SUM, stream=None): Comm.Allreduce. */
PyObject *_sp_Poster_allreduce(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"sendbuf", "recvbuf", "op", "stream"};
    PyObject *a[4];
    if (_sp_args(args, nargsf, kwnames, names, 4, a)) {
        PyObject *res = allreduce_small(self, a);
        if (res || PyErr_Occurred()) return declined(self, FAST_ALLREDUCE, res, args, nargsf, kwnames);
    }
    return fallback(self, FAST_ALLREDUCE, args, nargsf, kwnames);
}

/* try_allreduce(sendbuf, recvbuf, op): the small Allreduce between the ranks, or NotImplemented
 * where the call is not one (no fallback). For a layer above Comm (shmproxy.MPI) whose own checks
 * of an argument cost more than this whole path: it tries here first, then checks. */
PyObject *_sp_Poster_try_allreduce(PosterObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "try_allreduce(sendbuf, recvbuf, op)");
        return NULL;
    }
    PyObject *res = allreduce_small(self, args);
    if (res || PyErr_Occurred()) return declined(self, FAST_ALLREDUCE, res, args, 3, NULL);
    Py_RETURN_NOTIMPLEMENTED;
}

/* bcast(buf, root=0, stream=None): Comm.Bcast. */
PyObject *_sp_Poster_bcast(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"buf", "root", "stream"};
    PyObject *a[3];
    if (_sp_args(args, nargsf, kwnames, names, 3, a) && a[0] && _sp_fast_usable(self) && self->fast) {
        uintptr_t p; int code; long long nb, count; long root = 0;
        if (host_array(self, a[0], 1, &p, &code, &nb, &count) && (!a[1] || small_root(self, a[1], &root)))
            return declined(self, FAST_BCAST, run(self, COLL_BCAST, NULL, (char *)p, (uint64_t)nb, code, count, 0, root),
                            args, nargsf, kwnames);
    }
    return fallback(self, FAST_BCAST, args, nargsf, kwnames);
}

/* reduce(sendbuf, recvbuf, op=SUM, root=0, stream=None): Comm.Reduce (recvbuf matters at the root). */
PyObject *_sp_Poster_reduce(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"sendbuf", "recvbuf", "op", "root", "stream"};
    PyObject *a[5];
    if (!_sp_args(args, nargsf, kwnames, names, 5, a) || !a[0] || !a[1] || !_sp_fast_usable(self) || !self->fast)
        goto slow;
    uintptr_t r = 0, s = 0;
    int rc = 0, sc;
    long long rn = 0, sn, rcount = 0, scount;
    long op = REDOP_SUM, root = 0;
    int in_place = self->in_place && a[0] == self->in_place;
    if (a[3] && !small_root(self, a[3], &root)) goto slow;
    int at_root = root == self->rank;
    if (at_root && !host_array(self, a[1], 1, &r, &rc, &rn, &rcount)) goto slow;
    /* elsewhere a recvbuf given is checked as the root's is (Comm._coll), so that a call passes or
     * fails on every rank alike */
    if (!at_root && a[1] != Py_None) {
        uintptr_t ignored; int c; long long b, k;
        if (!host_array(self, a[1], 1, &ignored, &c, &b, &k)) goto slow;
    }
    if (in_place) {
        if (!at_root) goto slow;
        sc = rc; scount = rcount; sn = rn;
    } else if (!host_array(self, a[0], 0, &s, &sc, &sn, &scount) ||
               (at_root && (sc != rc || scount != rcount))) {
        goto slow;
    }
    if (a[2] ? !small_op(a[2], sc, &op) : !kernel_for(REDOP_SUM, sc)) goto slow;
    return declined(self, FAST_REDUCE, run(self, COLL_REDUCE, in_place ? NULL : (const char *)s,
                                           at_root ? (char *)r : NULL, (uint64_t)sn, sc, scount, (int)op, root),
                    args, nargsf, kwnames);
slow:
    return fallback(self, FAST_REDUCE, args, nargsf, kwnames);
}

/* coll_fast(coll, sendbuf, recvbuf, op, root): the Python fallbacks' way in, with arguments they
 * made contiguous (sendbuf None: in place; recvbuf None where the rank has no output). Returns
 * None, or Ellipsis where every rank declined a middle collective (the caller then posts it). */
PyObject *_sp_Poster_coll_fast(PosterObject *self, PyObject *args) {
    int coll, op; long root; PyObject *so, *ro;
    if (!PyArg_ParseTuple(args, "iOOil", &coll, &so, &ro, &op, &root)) return NULL;
    if (!_sp_fast_usable(self) || !self->fast) {   /* failed, closed or in a group: say which */
        CollWait w = {.self = self, .bad = -1};
        return failed(self, self->mapped ? CW_FAILED : CW_GONE, &w, coll);
    }
    uintptr_t s = 0, r = 0; int sc = 0, rc = 0; long long sn = 0, rn = 0, scount = 0, rcount = 0;
    if ((so != Py_None && !host_array(self, so, 0, &s, &sc, &sn, &scount)) ||
        (ro != Py_None && !host_array(self, ro, 1, &r, &rc, &rn, &rcount))) {
        PyErr_SetString(PyExc_ValueError,
                        "coll_fast: buffers must be contiguous host arrays within FAST_BYTES or the middle limit");
        return NULL;
    }
    int code = so != Py_None ? sc : rc;
    uint64_t nb = (uint64_t)(so != Py_None ? sn : rn);
    long long count = so != Py_None ? scount : rcount;
    if (coll == COLL_BARRIER) { code = 1; nb = 0; count = 0; }
    if ((coll == COLL_ALLREDUCE || coll == COLL_REDUCE) && !kernel_for(op, code)) {
        PyErr_SetString(PyExc_ValueError, "coll_fast: no kernel for this op and dtype");
        return NULL;
    }
    return run(self, coll, (const char *)s, (char *)r, nb, code, count, op, root);
}
