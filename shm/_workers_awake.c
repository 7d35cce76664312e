/*
 * The keep-awake guards of shm._workers (the KeepAwake type), and the wake-ups they relay.
 *
 * Idle-priority threads that keep the progress process's CPUs from going idle while the job is busy.
 *
 * On a virtual machine an idle vCPU halts, and waking a halted vCPU is an interrupt the hypervisor
 * delivers when it next schedules that vCPU: while other guests load the host, that is much later
 * (under heavy steal, idle-priority spinners beside a large ping-pong made it up to twice as fast:
 * docs/decisions.md). Every hand-off of a message (rank -> loop -> workers -> loop ->
 * rank) is such a wake-up when the node is crowded. A SCHED_IDLE thread runs only when nothing else
 * wants its CPU and is preempted the moment something does, so it takes no time from ranks or workers;
 * it only keeps the vCPU running. Each spins for `window` after the last touch() and then sleeps on a
 * condvar: an idle job costs nothing.
 *
 * A guard calls sched_yield() between its pause bursts. A thread that yields is not woken, so
 * nothing preempts the guard it hands its CPU to: under EEVDF a guard freshly woken by touch() is
 * eligible, takes the yield, and kept the CPU for its whole window while the progress loop, which
 * yields between passes, sat runnable beside it, so a tail of round trips lasted a whole window
 * (docs/decisions.md, "Keep-awake guards yield between pause bursts"). Yielding back costs a guard
 * nothing, since it runs only when nobody else wants to.
 *
 * Protocol: touch() stores the deadline, then reads `sleepers`; a guard increments `sleepers`, then
 * reads the deadline, under the mutex, before it waits (both seq_cst): either the guard sees the new
 * deadline or touch() sees it asleep and signals under the mutex, so no touch is lost.
 *
 * Relayed wake-ups (KeepAwake(cpus, window, workers, rank_areas, nranks)): waking a thread on another
 * vCPU is an IPI, and on a virtual machine each one costs the waker about ten microseconds inside the
 * syscall (the exit to the hypervisor) and the wakee as much again before it runs, several times a
 * wake-up on the wakee's own CPU (perf with ipi:ipi_send_cpu; the figures: docs/decisions.md, "On a
 * crowded node, what sleeps on a CPU is woken by that CPU's keep-awake guard"). A guard in its window
 * is running on its CPU anyway, so it wakes what sleeps there itself: the wake-up is local, no IPI,
 * and the wakee preempts the guard at once.
 *  - workers: the pool signals none of a live guard's workers when it queues a job (relay_covers); the
 *    guard sees `queued` between its pause bursts, takes the mutex and signals its CPU's idle workers,
 *    one per queued job. Nothing waits on a guard that is not there: a job no worker took stays
 *    queued, and the loop, which runs queued jobs itself on a crowded node (help()), takes it.
 *  - ranks: a rank about to sleep stores WAITING = (its CPU + 1) | the futex word it sleeps on << 32
 *    (shm/_pool_layout.h); the guard of that CPU wakes it once the word moved. The progress loop asks
 *    live_mask() which CPUs those are and then only bumps the word; it remembers each wake-up so
 *    left, and makes it itself should the rank still sleep on that word after a grace period
 *    (proxy/engine/completion.py, check_relayed): a guard preempted just after it proved live
 *    delays, never loses.
 * A guard is live while its heartbeat (one per pass, a few us apart) is under RELAY_FRESH_NS old; it
 * clears it before it sleeps, then makes one last pass. Against a waker that read the heartbeat
 * before it was cleared, both sides are seq_cst: the waker publishes (queue, futex word), then reads
 * the heartbeat; the guard clears it, then reads what was published.
 */
#include "_workers.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "_pool_layout.h"

typedef struct KeepAwake {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t deadline_ns;  /* CLOCK_MONOTONIC */
    uint64_t window_ns;
    int sleepers, stopping;
    int n;
    pthread_t *threads;
    int *cpus;
    uint64_t *beats;       /* guard i's last pass (CLOCK_MONOTONIC ns) at beats[i * BEAT_STRIDE]; 0 asleep */
    Pool *pool;            /* whose pinned workers the guards wake (a reference), or NULL */
    char *rank_areas;      /* an ops pool's rank areas, whose sleeping ranks the guards wake, or NULL */
    int nranks;
} KeepAwake;

#define BEAT_STRIDE 8          /* one cache line per guard's heartbeat */
#define RELAY_FRESH_NS 10000   /* a guard is live if it passed this recently (a pass takes a few us) */

typedef struct { KeepAwake *k; int cpu, index; } GuardArg;

/* Whether guard i ran within RELAY_FRESH_NS of `now`. */
static int guard_live(KeepAwake *k, int i, uint64_t now) {
    uint64_t beat = __atomic_load_n(&k->beats[i * BEAT_STRIDE], __ATOMIC_SEQ_CST);
    return beat && now - beat < RELAY_FRESH_NS;
}

/* The index of the guard pinned to `cpu`, or -1. */
static int guard_on(KeepAwake *k, int cpu) {
    for (int i = 0; cpu >= 0 && i < k->n; i++)
        if (k->cpus[i] == cpu) return i;
    return -1;
}

/* Whether a live guard wakes the workers pinned to `cpu` (pool mutex held; see "Relayed wake-ups"). */
int _sw_relay_covers(Pool *p, int cpu) {
    KeepAwake *k = p->relay;
    int i = k ? guard_on(k, cpu) : -1;
    return i >= 0 && guard_live(k, i, mono_ns());
}

/* A worker pinned to `cpu` is about to sleep (pool mutex held): in its window, that CPU's guard runs
 * next, so it counts as live from now. Its heartbeat had gone stale while the worker ran, and the loop,
 * completing that worker's job a few us later, sent the ranks' wake-ups across (IPI) in half the
 * 4 MiB round trips before the guard's next pass. */
void _sw_relay_vouch(Pool *p, int cpu) {
    KeepAwake *k = p->relay;
    int i = k ? guard_on(k, cpu) : -1;
    if (i < 0 || __atomic_load_n(&k->sleepers, __ATOMIC_SEQ_CST)) return;
    uint64_t now = mono_ns();
    if (now < __atomic_load_n(&k->deadline_ns, __ATOMIC_SEQ_CST))
        __atomic_store_n(&k->beats[i * BEAT_STRIDE], now, __ATOMIC_SEQ_CST);
}

/* A guard on `cpu`: wake the ranks that sleep on this CPU and whose futex word moved since they went
 * to sleep (a rank stores WAITING = (its CPU + 1) | the word it sleeps on << 32; see
 * proxy/rank/waiting.py). */
static void relay_ranks(KeepAwake *k, int cpu) {
    for (int r = 0; r < k->nranks; r++) {
        char *area = k->rank_areas + (size_t)r * RANK_AREA_BYTES;
        uint64_t w = __atomic_load_n((uint64_t *)(area + RANK_WAITING_OFF), __ATOMIC_SEQ_CST);
        if ((uint32_t)w != (uint32_t)cpu + 1) continue;
        uint32_t *word = (uint32_t *)(area + RANK_WAKE_OFF);
        if (__atomic_load_n(word, __ATOMIC_SEQ_CST) != (uint32_t)(w >> 32))
            syscall(SYS_futex, word, FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
    }
}

/* A guard on `cpu`: wake this CPU's idle workers for the queued jobs, one per job, from here. */
static void relay_wake(Pool *p, int cpu) {
    if (__atomic_load_n(&p->queued, __ATOMIC_SEQ_CST) <= 0) return;
    int woken[MAX_THREADS];
    pthread_mutex_lock(&p->mu);
    int n = p->stopping ? 0 : _sw_pick_locked(p, -1, cpu, woken);
    pthread_mutex_unlock(&p->mu);
    _sw_signal_workers(p, woken, n);
}

/* One relay pass of the guard on `cpu`: its workers, then its ranks. */
static void relay_pass(KeepAwake *k, int cpu) {
    if (k->pool) relay_wake(k->pool, cpu);
    if (k->rank_areas) relay_ranks(k, cpu);
}

static void *guard_main(void *arg) {
    GuardArg a = *(GuardArg *)arg;
    free(arg);
    KeepAwake *k = a.k;
    struct sched_param sp = {0};
    pthread_setname_np(pthread_self(), "shmproxy-awake");    /* what tests and ps show */
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp);   /* best effort: unprivileged is allowed */
    _sw_pin_current_thread(&a.cpu, 1);
    for (;;) {
        uint64_t *beat = &k->beats[a.index * BEAT_STRIDE], now;
        while (!__atomic_load_n(&k->stopping, __ATOMIC_RELAXED) &&
               (now = mono_ns()) < __atomic_load_n(&k->deadline_ns, __ATOMIC_RELAXED)) {
            __atomic_store_n(beat, now, __ATOMIC_SEQ_CST);
            relay_pass(k, a.cpu);
            for (int i = 0; i < 64; i++) __builtin_ia32_pause();
            sched_yield();   /* hand the CPU back to a thread that yielded to us (above) */
        }
        __atomic_store_n(beat, 0, __ATOMIC_SEQ_CST);   /* from now on wakers do it themselves */
        relay_pass(k, a.cpu);                           /* what arrived since the last pass */
        pthread_mutex_lock(&k->mu);
        __atomic_fetch_add(&k->sleepers, 1, __ATOMIC_SEQ_CST);
        while (!k->stopping && mono_ns() >= __atomic_load_n(&k->deadline_ns, __ATOMIC_SEQ_CST)) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            ts.tv_sec += 1;                                            /* bounded: stop is rechecked */
            pthread_cond_timedwait(&k->cv, &k->mu, &ts);
        }
        __atomic_fetch_sub(&k->sleepers, 1, __ATOMIC_SEQ_CST);
        int stop = k->stopping;
        pthread_mutex_unlock(&k->mu);
        if (stop) return NULL;
    }
}

static int KeepAwake_init(KeepAwake *k, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"cpus", "window_s", "workers", "rank_areas", "nranks", NULL};
    PyObject *cpus_obj, *pool_obj = Py_None, *areas_obj = Py_None;
    int nranks = 0;
    double window_s;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Od|OOi", kwlist, &cpus_obj, &window_s, &pool_obj, &areas_obj,
                                     &nranks))
        return -1;
    if (areas_obj != Py_None) {
        if (!(k->rank_areas = _sw_as_addr(areas_obj))) return -1;
        if (nranks < 1 || nranks > MAX_THREADS) {
            PyErr_Format(PyExc_ValueError, "KeepAwake: nranks must be in 1..%d with rank_areas", MAX_THREADS);
            return -1;
        }
        k->nranks = nranks;
    }
    if (k->threads) {
        PyErr_SetString(PyExc_RuntimeError, "KeepAwake is already initialised");
        return -1;
    }
    if (pool_obj != Py_None) {
        if (!PyObject_TypeCheck(pool_obj, &_sw_PoolType) || !((Pool *)pool_obj)->workers) {
            PyErr_SetString(PyExc_TypeError, "KeepAwake: workers must be an initialised Workers pool or None");
            return -1;
        }
        Pool *p = (Pool *)pool_obj;
        pthread_mutex_lock(&p->mu);
        int taken = p->relay != NULL;
        pthread_mutex_unlock(&p->mu);
        if (taken) {
            PyErr_SetString(PyExc_RuntimeError, "KeepAwake: that Workers pool already has guards relaying for it");
            return -1;
        }
    }
    if (window_s <= 0 || window_s > 1.0) {
        PyErr_SetString(PyExc_ValueError, "KeepAwake: window must be in (0, 1] s");
        return -1;
    }
    Py_ssize_t n = _sw_parse_cpus(cpus_obj, "KeepAwake: cpus must be a sequence of ints", &k->cpus);
    if (n < 0) return -1;
    if (n < 1 || n > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "KeepAwake: 1..%d cpus, not %zd", MAX_THREADS, n);
        return -1;
    }
    if (!(k->threads = calloc((size_t)n, sizeof(pthread_t)))) { PyErr_NoMemory(); return -1; }
    if (!(k->beats = calloc((size_t)n * BEAT_STRIDE, sizeof(uint64_t)))) { PyErr_NoMemory(); return -1; }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&k->mu, NULL);
    pthread_cond_init(&k->cv, &ca);
    pthread_condattr_destroy(&ca);
    k->window_ns = (uint64_t)(window_s * 1e9);
    for (Py_ssize_t i = 0; i < n; i++) {
        GuardArg *a = malloc(sizeof *a);
        if (!a) { PyErr_NoMemory(); return -1; }
        a->k = k;
        a->cpu = k->cpus[i];
        a->index = (int)i;
        int rc = pthread_create(&k->threads[i], NULL, guard_main, a);
        if (rc) {
            free(a);
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;  /* the guards already started are stopped by dealloc */
        }
        k->n = (int)i + 1;
    }
    if (pool_obj != Py_None) {   /* after the guards exist: a live relay needs them running */
        Pool *p = (Pool *)pool_obj;
        Py_INCREF(pool_obj);
        k->pool = p;
        pthread_mutex_lock(&p->mu);
        p->relay = k;
        pthread_mutex_unlock(&p->mu);
    }
    return 0;
}

static void keepawake_stop(KeepAwake *k) {
    if (k->pool) {   /* first: from now on the pool wakes its workers itself */
        pthread_mutex_lock(&k->pool->mu);
        k->pool->relay = NULL;
        pthread_mutex_unlock(&k->pool->mu);
    }
    if (!k->n) return;
    pthread_mutex_lock(&k->mu);
    k->stopping = 1;
    pthread_cond_broadcast(&k->cv);
    pthread_mutex_unlock(&k->mu);
    for (int i = 0; i < k->n; i++) pthread_join(k->threads[i], NULL);
    k->n = 0;
}

static PyObject *KeepAwake_stop(KeepAwake *k, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    keepawake_stop(k);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *KeepAwake_touch(KeepAwake *k, PyObject *unused) {
    if (!k->n) Py_RETURN_NONE;
    __atomic_store_n(&k->deadline_ns, mono_ns() + k->window_ns, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&k->sleepers, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&k->mu);
        pthread_cond_broadcast(&k->cv);
        pthread_mutex_unlock(&k->mu);
    }
    Py_RETURN_NONE;
}

static void KeepAwake_dealloc(KeepAwake *k) {
    if (k->threads) {
        Py_BEGIN_ALLOW_THREADS
        keepawake_stop(k);
        Py_END_ALLOW_THREADS
        pthread_mutex_destroy(&k->mu);
        pthread_cond_destroy(&k->cv);
    }
    free(k->threads);
    free(k->cpus);
    free(k->beats);
    Py_XDECREF((PyObject *)k->pool);
    Py_TYPE(k)->tp_free((PyObject *)k);
}

static PyObject *KeepAwake_get_nthreads(KeepAwake *k, void *unused) { return PyLong_FromLong(k->n); }

/* live_mask() -> bit c set: the guard on CPU c (< 64) is live and wakes the ranks sleeping there, so a
 * waker on another CPU leaves them to it. Never the caller's own CPU: that guard is not running. */
static PyObject *KeepAwake_live_mask(KeepAwake *k, PyObject *unused) {
    unsigned long long mask = 0;
    if (k->n && k->rank_areas) {
        uint64_t now = mono_ns();
        int here = sched_getcpu();
        for (int i = 0; i < k->n; i++)
            if (k->cpus[i] >= 0 && k->cpus[i] < 64 && k->cpus[i] != here && guard_live(k, i, now))
                mask |= 1ULL << k->cpus[i];
    }
    return PyLong_FromUnsignedLongLong(mask);
}

static PyObject *KeepAwake_get_spinning(KeepAwake *k, void *unused) {
    return PyBool_FromLong(k->n && mono_ns() < __atomic_load_n(&k->deadline_ns, __ATOMIC_SEQ_CST));
}

static PyMethodDef KeepAwake_methods[] = {
    {"touch", (PyCFunction)KeepAwake_touch, METH_NOARGS, "touch(): the job is busy; spin for another window"},
    {"stop", (PyCFunction)KeepAwake_stop, METH_NOARGS, "stop(): the guards exit; idempotent"},
    {"live_mask", (PyCFunction)KeepAwake_live_mask, METH_NOARGS,
     "live_mask() -> bitmask of the other CPUs (< 64) whose live guard wakes the ranks sleeping there"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeepAwake_getset[] = {
    {"nthreads", (getter)KeepAwake_get_nthreads, NULL, "guard threads running", NULL},
    {"spinning", (getter)KeepAwake_get_spinning, NULL, "within a window of the last touch()", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject _sw_KeepAwakeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmproxy.shm._workers.KeepAwake",
    .tp_basicsize = sizeof(KeepAwake),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KeepAwake(cpus, window_s, workers=None): one SCHED_IDLE guard per CPU, spinning for window_s "
               "after each touch(); they wake the pool's workers pinned to their CPUs.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)KeepAwake_init,
    .tp_dealloc = (destructor)KeepAwake_dealloc,
    .tp_methods = KeepAwake_methods,
    .tp_getset = KeepAwake_getset,
};

