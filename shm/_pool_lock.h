/*
 * The pool mutex protocol shared by shm/_native.c and shm/_poster.c: a bounded lock of the robust
 * process-shared mutex, and the splice of a private record chain onto the posted chain.
 *
 * Lock protocol (DESIGN.md section 3): the posted chain's head/tail and the `next` link of its last
 * record are only written under the pool mutex (by the poster, or for it by the holder: "Flat
 * combining" below). The progress process sleeps on the condvar only when
 * the chain is empty, so a poster signals only when it makes the chain non-empty. A record's fields
 * are written before it is spliced; the unlock publishes them (release), the progress process's lock
 * acquires them.
 */
#ifndef SHM_POOL_LOCK_H
#define SHM_POOL_LOCK_H

#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "_pool_layout.h"

enum { RC_OK = 0, RC_OWNERDEAD = 1, RC_TIMEDOUT = 2, RC_BUSY = 3 };

static inline struct timespec deadline_after(double seconds) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    if (seconds < 0) seconds = 0;
    if (seconds > 1e9) seconds = 1e9;
    time_t whole = (time_t)seconds;
    long frac = (long)((seconds - (double)whole) * 1e9);
    ts.tv_sec += whole;
    ts.tv_nsec += frac;
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec += 1; ts.tv_nsec -= 1000000000L; }
    return ts;
}

/*
 * Contention: every critical section on the pool mutex is a few stores (a splice, the take of a
 * batch), but after a barrier all local ranks post at the same instant. A robust mutex has no
 * adaptive type, so glibc puts each loser to sleep in the kernel and wakes them one by one: on the
 * 32-core GPU host 8 ranks posting at once paid a mean of 5-6 us per Iallreduce post, against 0.4 us
 * alone. So a loser first retries for up to lock_spin_ns (SHMPROXY_LOCK_SPIN_US, set at start by
 * shm.sync.set_lock_spin in each C module, since each has its own copy) and only then sleeps. The
 * spin is bounded, so a holder that lost its core (a crowded host) costs at most that much before the
 * sleep.
 */
static long long lock_spin_ns = 0;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline long long mono_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline int lock_spin(pthread_mutex_t *m) {
    long long end = mono_ns() + lock_spin_ns;
    int r;
    do {
        for (int i = 0; i < 8; i++) cpu_relax();
        r = pthread_mutex_trylock(m);
    } while (r == EBUSY && mono_ns() < end);
    return r;
}

/* set_lock_spin(ns): how long a contended lock retries before it sleeps (see above). */
static PyObject *py_set_lock_spin(PyObject *self, PyObject *arg) {
    long long ns = PyLong_AsLongLong(arg);
    if (ns == -1 && PyErr_Occurred()) return NULL;
    if (ns < 0 || ns > 1000000000LL) {
        PyErr_SetString(PyExc_ValueError, "lock spin must be in 0..1e9 ns");
        return NULL;
    }
    lock_spin_ns = ns;
    Py_RETURN_NONE;
}

/* The bounded blocking lock, without the GIL. */
static inline int lock_blocking(pthread_mutex_t *m, double timeout) {
    struct timespec ts = deadline_after(timeout);
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &ts);
    Py_END_ALLOW_THREADS
    return r;
}

/* A trylock found the mutex held: the bounded spin (GIL held: it is short), then the blocking lock. */
static inline int lock_contended(pthread_mutex_t *m, double timeout) {
    int r;
    if (lock_spin_ns > 0 && (r = lock_spin(m)) != EBUSY) return r;
    return lock_blocking(m, timeout);
}

/* Fast path first (trylock, then the bounded spin), then a bounded blocking lock without the GIL. */
static inline int lock_bounded(pthread_mutex_t *m, double timeout) {
    int r = pthread_mutex_trylock(m);
    return r != EBUSY ? r : lock_contended(m, timeout);
}

/*
 * Flat combining (ninth session): after a barrier every local rank posts at the same instant, and
 * with one mutex the last of 8 ranks waited for 7 critical sections (a post cost 2-2.6 us on the
 * 32-core GPU host against 0.5 us alone). So a poster that finds the mutex held does not queue for it:
 * it leaves its chain in its pending slot (rank area, RANK_PENDING_OFF), sets its bit in the pending
 * mask, and spins until either a holder spliced the chain for it (the slot reads 0: done) or the
 * mutex is free and it splices everything pending itself. Every holder (rank or progress process)
 * splices all pending chains before it unlocks. The posted chain is still only written under the
 * mutex; a rank returns only once its chain is on it, so a sleeping progress process is signalled by
 * whoever spliced onto an empty chain, as before.
 *   Ordering: the poster writes its records, then the slot (release), then the mask bit; a holder
 * exchanges the mask, then each flagged slot (acquire), so it sees the records. A rank has at most
 * one chain pending (it waits for it). When the bounded lock fails, the poster takes its chain back
 * with an exchange: a 0 there means a holder spliced it after all, and the post succeeded.
 *   Local ranks >= 64 (beyond the mask) always queue for the mutex.
 */
typedef struct {
    pthread_mutex_t *mutex;
    pthread_cond_t *cond;
    volatile int32_t *head, *tail;  /* the posted chain */
    char *records;                  /* record i at records + i * RECORD_BYTES, `next` at offset 0 */
    uint64_t *pend_mask;            /* POOL_PENDING_MASK_OFF */
    char *rank_areas;               /* rank r's area at rank_areas + r * RANK_AREA_BYTES */
} PostedChain;

static inline uint64_t *pending_slot(const PostedChain *c, int r) {
    return (uint64_t *)(c->rank_areas + (Py_ssize_t)r * RANK_AREA_BYTES + RANK_PENDING_OFF);
}

/* Mutex held: append first..last (linked, last->next == -1) to the posted chain. */
static inline void link_locked(const PostedChain *c, int32_t first, int32_t last) {
    int32_t t = *c->tail;
    if (t < 0)
        *c->head = first;
    else
        *(volatile int32_t *)(c->records + (Py_ssize_t)t * RECORD_BYTES) = first;
    *c->tail = last;
}

/* Mutex held: append every chain left in a pending slot. */
static inline void drain_pending_locked(const PostedChain *c) {
    if (!__atomic_load_n(c->pend_mask, __ATOMIC_RELAXED)) return;
    uint64_t m = __atomic_exchange_n(c->pend_mask, 0, __ATOMIC_ACQUIRE);
    while (m) {
        int r = __builtin_ctzll(m);
        m &= m - 1;
        uint64_t p = __atomic_exchange_n(pending_slot(c, r), 0, __ATOMIC_ACQUIRE);
        if (p) link_locked(c, (int32_t)(p >> 32) - 1, (int32_t)(uint32_t)p - 1);
    }
}

/* A hint only (trylock decides): glibc's mutex word is nonzero while the mutex is held. Reading it
 * instead of retrying trylock keeps the holder's cache line (the mutex, head and tail) in its core. */
static inline int mutex_looks_held(pthread_mutex_t *m) {
    return __atomic_load_n((int *)m, __ATOMIC_RELAXED) != 0;
}

/* The mutex was busy: leave first..last in our pending slot and wait. Returns 1 when a holder
 * spliced it; 0 with *lockr = 0 or EOWNERDEAD when we hold the mutex (our chain may still be pending:
 * the caller drains it); 0 with *lockr = an error when the bounded lock failed and the chain was
 * taken back (not posted). */
static inline int post_pending(const PostedChain *c, int me, int32_t first, int32_t last, double timeout,
                               int *lockr) {
    uint64_t *slot = pending_slot(c, me);
    __atomic_store_n(slot, ((uint64_t)(uint32_t)(first + 1) << 32) | (uint32_t)(last + 1), __ATOMIC_RELEASE);
    __atomic_fetch_or(c->pend_mask, 1ull << me, __ATOMIC_RELEASE);
    long long end = mono_ns() + lock_spin_ns;
    int r = EBUSY;
    for (;;) {
        if (__atomic_load_n(slot, __ATOMIC_ACQUIRE) == 0) return 1;
        if (!mutex_looks_held(c->mutex) && (r = pthread_mutex_trylock(c->mutex)) != EBUSY) break;
        if (mono_ns() >= end) {
            r = lock_blocking(c->mutex, timeout);
            break;
        }
        cpu_relax();
    }
    if (r != 0 && r != EOWNERDEAD && __atomic_exchange_n(slot, 0, __ATOMIC_ACQ_REL) == 0)
        return 1;   /* spliced by a holder while our lock failed */
    *lockr = r;
    return 0;
}

/*
 * Post first..last (linked through each record's int32 `next`, last->next == -1) as local rank `me`.
 * Returns RC_OK, RC_OWNERDEAD (spliced anyway: the caller reports the dead owner), RC_TIMEDOUT (not
 * posted), or -errno for an unexpected pthread error (not posted).
 */
static inline int splice_chain(const PostedChain *c, int me, int32_t first, int32_t last, double timeout) {
    int r = pthread_mutex_trylock(c->mutex);
    if (r == EBUSY) {
        if (me >= 0 && me < 64) {
            if (post_pending(c, me, first, last, timeout, &r)) return RC_OK;
            first = -1;   /* ours is pending, or taken back on an error: drained below, or not posted */
        } else {
            r = lock_contended(c->mutex, timeout);
        }
    }
    if (r == ETIMEDOUT) return RC_TIMEDOUT;
    if (r != 0 && r != EOWNERDEAD) return -r;
    int rc = RC_OK;
    if (r == EOWNERDEAD) {
        /* The chain may be half spliced by the dead owner; the communicator is failed, so only
         * make the mutex usable again. */
        pthread_mutex_consistent(c->mutex);
        rc = RC_OWNERDEAD;
    }
    int was_empty = *c->tail < 0;
    drain_pending_locked(c);
    if (first >= 0) link_locked(c, first, last);
    if (was_empty && *c->tail >= 0) pthread_cond_signal(c->cond);
    pthread_mutex_unlock(c->mutex);
    return rc;
}

#endif
