/*
 * The pool mutex protocol shared by shm/_native.c and shm/_poster.c: a bounded lock of the robust
 * process-shared mutex, and the splice of a private record chain onto the posted chain.
 *
 * Lock protocol (DESIGN.md section 3): the posted chain's head/tail and the `next` link of its last
 * record are only written under the pool mutex. The progress process sleeps on the condvar only when
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
 * shm.sync.set_lock_spin in each C module, since each has its own copy) and only then sleeps. The spin is bounded, so a holder that lost its core (a crowded host) costs at
 * most that much before the sleep.
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

/* Fast path first (trylock, then the bounded spin, with the GIL held: both are short), then a
 * bounded blocking lock without the GIL. */
static inline int lock_bounded(pthread_mutex_t *m, double timeout) {
    int r = pthread_mutex_trylock(m);
    if (r != EBUSY) return r;
    if (lock_spin_ns > 0 && (r = lock_spin(m)) != EBUSY) return r;
    struct timespec ts = deadline_after(timeout);
    Py_BEGIN_ALLOW_THREADS
    r = pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &ts);
    Py_END_ALLOW_THREADS
    return r;
}

/*
 * Splice first..last (linked through each record's int32 `next` at offset 0, last->next == -1) onto
 * the posted chain. Returns RC_OK, RC_OWNERDEAD (spliced anyway: the caller reports the dead owner),
 * RC_TIMEDOUT, or -errno for an unexpected pthread error.
 */
static inline int splice_chain(pthread_mutex_t *m, pthread_cond_t *c, volatile int32_t *head,
                               volatile int32_t *tail, char *recs, Py_ssize_t rec_size, int32_t first,
                               int32_t last, double timeout) {
    int r = lock_bounded(m, timeout);
    if (r == ETIMEDOUT) return RC_TIMEDOUT;
    if (r != 0 && r != EOWNERDEAD) return -r;
    int rc = RC_OK;
    if (r == EOWNERDEAD) {
        /* The chain may be half spliced by the dead owner; the communicator is failed, so only
         * make the mutex usable again. */
        pthread_mutex_consistent(m);
        rc = RC_OWNERDEAD;
    }
    int32_t t = *tail;
    if (t < 0) {
        *head = first;
    } else {
        *(volatile int32_t *)(recs + (Py_ssize_t)t * rec_size) = first;
    }
    *tail = last;
    if (t < 0) pthread_cond_signal(c);
    pthread_mutex_unlock(m);
    return rc;
}

#endif
