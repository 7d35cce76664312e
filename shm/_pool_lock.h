/*
 * The pool mutex protocol shared by shm/_native.c and shm/_poster.c: a bounded lock of the robust
 * process-shared mutex, and the splice of a private record chain onto the posted chain.
 *
 * Lock protocol (docs/architecture.md, "Lock protocol"): the posted chain's head/tail and the `next` link of its last
 * record are only written under the pool mutex (by a poster that locks, or for a rank that handed its
 * chain off by the progress process: "Hand-off" below). The progress process sleeps on the condvar
 * only when the chain is empty and nothing is handed off, so a poster signals only when it makes the
 * chain non-empty. A record's fields are written before it is spliced or handed off; the unlock (or
 * the slot's release store) publishes them, the progress process's lock (or exchange) acquires them.
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
 * adaptive type, so glibc puts each loser to sleep in the kernel and wakes them one by one: 8 ranks
 * posting at once paid an order of magnitude more per post than one alone (docs/decisions.md, "A
 * contended pool lock spins briefly before it sleeps"). So a loser first retries for up to
 * lock_spin_ns (SHMPROXY_LOCK_SPIN_US, set at start by shm.sync.set_lock_spin in each C module, since
 * each has its own copy) and only then sleeps. The spin is bounded, so a holder that lost its core (a
 * crowded host) costs at most that much before the sleep.
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
 * Hand-off (it replaced flat combining; both in docs/decisions.md). After a barrier every local rank
 * posts at the same instant, and with one mutex the last of 8 ranks waited for the others' critical
 * sections and the progress process's take: a post inside OSU's overlap loop cost several times what
 * it costs alone, most of the overlap lost at 64 KiB. So a rank
 * (local rank < 64) does not lock to post while the progress process is awake: it appends its chain to
 * its pending slot (rank area, RANK_PENDING_OFF), sets its bit in the pending mask and returns. The
 * progress process, which polls the chain head and the mask, splices every pending chain onto the
 * posted chain under the mutex before it takes (drain_pending_locked; every other holder does too).
 * The posted chain is still written only under the mutex.
 *   The slot: a rank exchanges it with 0 first; a chain still there is its own earlier post, not yet
 * spliced, and the new chain is linked behind it (per-rank order holds). A splicer exchanges the mask,
 * then each flagged slot, with 0: whichever exchange gets the chain owns it. The records are written
 * before the slot (release); the splicer's exchanges acquire them.
 *   Sleep: the progress process sleeps on the condvar only after storing SLEEPING = 1 and then finding
 * the mask empty (sleep_unless_posted, _native.c); a poster sets its mask bit and then loads
 * SLEEPING, all sequentially consistent. So either the progress process sees the bit and stays awake,
 * or the poster sees SLEEPING and locks, splices and signals as a plain post does. Its lock
 * waits until the sleeper is inside the condvar wait (which released the mutex), so the signal is not
 * lost. Should that lock fail, the chain stays handed off: the sleep is bounded (PROXY_SLEEP_MS) and
 * the progress process drains the slots when it wakes.
 *   A rank killed between its exchange and its store loses its own unspliced chain with it (the
 * records show in a dump as in no list); its death fails the communicator either way.
 *   Local ranks >= 64 (beyond the mask) lock and splice every time.
 */
typedef struct {
    pthread_mutex_t *mutex;
    pthread_cond_t *cond;
    volatile int32_t *head, *tail;  /* the posted chain */
    char *records;                  /* record i at records + i * RECORD_BYTES, `next` at offset 0 */
    uint64_t *pend_mask;            /* POOL_PENDING_MASK_OFF */
    char *rank_areas;               /* rank r's area at rank_areas + r * RANK_AREA_BYTES */
    uint64_t *sleeping;             /* POOL_SLEEPING_OFF: the progress process may be in the condvar wait */
} PostedChain;

static inline uint64_t *pending_slot(const PostedChain *c, int r) {
    return (uint64_t *)(c->rank_areas + (Py_ssize_t)r * RANK_AREA_BYTES + RANK_PENDING_OFF);
}

static inline void set_next(const PostedChain *c, int32_t rec, int32_t next) {
    *(volatile int32_t *)(c->records + (Py_ssize_t)rec * RECORD_BYTES) = next;
}

/* Mutex held: append first..last (linked, last->next == -1) to the posted chain. */
static inline void link_locked(const PostedChain *c, int32_t first, int32_t last) {
    int32_t t = *c->tail;
    if (t < 0)
        *c->head = first;
    else
        set_next(c, t, first);
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

/* Leave first..last in our pending slot, behind any earlier chain of ours still there. Returns 1 when
 * the progress process is awake (it will splice the chain), 0 when it may be asleep. */
static inline int hand_off(const PostedChain *c, int me, int32_t first, int32_t last) {
    uint64_t *slot = pending_slot(c, me);
    uint64_t old = __atomic_exchange_n(slot, 0, __ATOMIC_ACQUIRE);
    if (old) {
        set_next(c, (int32_t)(uint32_t)old - 1, first);
        first = (int32_t)(old >> 32) - 1;
    }
    __atomic_store_n(slot, ((uint64_t)(uint32_t)(first + 1) << 32) | (uint32_t)(last + 1), __ATOMIC_RELEASE);
    __atomic_fetch_or(c->pend_mask, 1ull << me, __ATOMIC_SEQ_CST);
    return __atomic_load_n(c->sleeping, __ATOMIC_SEQ_CST) == 0;
}

/*
 * Post first..last (linked through each record's int32 `next`, last->next == -1) as local rank `me`.
 * Returns RC_OK, RC_OWNERDEAD (spliced anyway: the caller reports the dead owner), RC_TIMEDOUT (not
 * posted), or -errno for an unexpected pthread error (not posted). A handed-off chain is posted: its
 * wake-up's lock failing leaves it for the progress process's bounded sleep, and returns RC_OK.
 */
static inline int splice_chain(const PostedChain *c, int me, int32_t first, int32_t last, double timeout) {
    int handed = me >= 0 && me < 64;
    if (handed && hand_off(c, me, first, last)) return RC_OK;
    int r = pthread_mutex_trylock(c->mutex);
    if (r == EBUSY) r = lock_contended(c->mutex, timeout);
    if (r != 0 && r != EOWNERDEAD) return handed ? RC_OK : (r == ETIMEDOUT ? RC_TIMEDOUT : -r);
    int rc = RC_OK;
    if (r == EOWNERDEAD) {
        /* The chain may be half spliced by the dead owner; the communicator is failed, so only
         * make the mutex usable again. */
        pthread_mutex_consistent(c->mutex);
        rc = RC_OWNERDEAD;
    }
    int was_empty = *c->tail < 0;
    drain_pending_locked(c);
    if (!handed) link_locked(c, first, last);
    if (was_empty && *c->tail >= 0) pthread_cond_signal(c->cond);
    pthread_mutex_unlock(c->mutex);
    return rc;
}

#endif
