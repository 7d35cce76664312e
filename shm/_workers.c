/*
 * shm._workers: the copy and reduction workers of the progress process, as threads that never take
 * the GIL.
 *
 *   pool = Workers(nthreads, cpus, spread)
 *                                        nthreads 0: jobs run only where a caller help()s; spread: worker
 *                                        i is pinned to cpus[i % len(cpus)] alone (else all to cpus)
 *   pool.copy(token, dst, src, n)        one memmove of n bytes (a chunk of a message)
 *   pool.run(token, steps, streaming=False)
 *                                        the steps in order, on one thread (a chunk of a collective),
 *                                        writing with non-temporal stores if streaming:
 *                                          (COPY, dst, src, n)
 *                                          (REDUCE, op, code, count, srcs, dsts)   see shm/_reduce.c
 *   pool.done(token)                     report a job finished elsewhere (a Python worker thread)
 *   pool.drain() -> [token, ...]         jobs finished since the last call
 *   pool.wait(timeout, poll=0) -> bool   block, GIL released, until a job has finished or timeout;
 *                                        poll: seconds of polling before it sleeps (see Wake-ups)
 *   pool.help(max_jobs) -> int           the caller runs up to max_jobs queued jobs itself (see below)
 *   pool.stop()                          workers exit after their current job; idempotent
 *
 *   awake = KeepAwake(cpus, window_s, workers=None)
 *                                        one SCHED_IDLE guard thread pinned to each CPU (see below); with
 *                                        a spread pool, the guards wake its workers on their CPUs
 *   awake.touch()                        large work in flight: the guards spin for window_s more
 *   awake.stop()                         the guards exit; idempotent
 *
 * Why compiled: a Python worker thread costs a queue wake-up and two GIL acquisitions per job (one to
 * pick it up, one to report it), while the progress loop holds the GIL most of the time. That hand-off
 * was ~100 us on the 32-core GPU host and ~300 us on the 2-core VM, and with 16 workers they queued
 * for the GIL behind each other: it was the main cost of 1-16 MiB collectives (BENCHMARKS.md).
 *
 * Lock protocol: one mutex guards the job queue, the finished list, the counters and the stop flag.
 * Workers sleep on `work`, the progress loop on `finished`, both with bounded or signalled waits.
 * Memory ordering: a worker writes a job's bytes (fencing streaming stores first), then takes the mutex
 * to put the job on the finished list; the loop takes the same mutex in drain() before it tells any
 * rank, so the data is visible before the completion is published (mutex acquire/release).
 *
 * Wake-ups: a queued job wakes one idle worker, if any, with the mutex released, and each worker
 * sleeps on a condvar of its own so that the waker chooses whom it wakes. Signalling under the mutex,
 * any worker, made the loop's submission of a message trickle on a crowded node (perf sched on the
 * 2-vCPU VM): the worker woken on the loop's CPU preempted it at once, found the mutex held and slept,
 * was woken by the unlock, preempted the loop again, ran its job and slept on an empty queue; the loop
 * queued the next job only then, so a 4 MiB message went to the workers two chunks at a time (~40 us
 * a round) with the other CPU idle in between. On a crowded node (caller-runs, below) the workers are
 * spread one per CPU and the loop wakes none on the CPU it runs on, where it runs jobs itself (the
 * kernel places a wakee beside its waker, and the keep-awake guards make an idle CPU look busy to its
 * search). wait() and help() first wake idle workers for jobs still queued (wait(): any worker).
 * The finished condvar is signalled only when the loop waits on it, also with the mutex released.
 * On a crowded node the loop polls a while before it sleeps there (wait's `poll`): once it has run out
 * of queued jobs the others finish within a job's length, and a sleeping loop woken from the other
 * vCPU came back ~20 us later (4 MiB one-way 150-176 -> 129-183 us in five interleaved pairs; the CPU
 * would otherwise run a keep-awake guard).
 *
 * Caller-runs (help): on a crowded node the progress loop has no core of its own; its CPU is one the
 * workers need. Waiting for them there is the worst of both: the loop's CPU idles (or the loop spins
 * on it) while two workers woken onto the other CPU take turns (perf sched on the 2-vCPU VM: a 4 MiB
 * message moved by one worker at a time, ~16 cross-CPU wake-ups per message). help() lets the loop
 * take jobs off the same queue and run them itself, GIL released, exactly as a worker would (same
 * execute, same finished list, so drain() and the memory-ordering argument above are unchanged).
 * Whichever thread is on a CPU first takes the next job: a late worker costs nothing, a quick one
 * shares the work.
 *
 * Tokens are Python objects owned by their job: referenced at submission and handed back by drain(),
 * both with the GIL held. Workers only ever touch C data, and every address they use was bounds-checked
 * by the progress process against a mapped buffer before submission.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "_kernel.h"
#include "_pool_layout.h"

enum { STEP_COPY = 0, STEP_REDUCE = 1 };
#define MAX_THREADS 1024

typedef struct {
    int kind, op, code;
    combine_fn fn;
    size_t n;             /* COPY: bytes; REDUCE: elements */
    char *dst, *src;      /* COPY */
    size_t nsrc, ndst;
    char **addrs;         /* REDUCE: nsrc sources, then ndst destinations */
} Step;

typedef struct Job {
    struct Job *next;
    PyObject *token;
    int streaming;
    size_t nsteps;
    Step *steps;
    Step one;             /* the storage of a single-step job */
} Job;

struct Pool;
struct KeepAwake;

typedef struct {
    struct Pool *pool;
    pthread_t thread;
    pthread_cond_t wake;  /* this worker sleeps here */
    int idle;             /* asleep on `wake` and not yet signalled (mutex) */
    int cpu;              /* the one CPU it is pinned to, or -1 */
} Worker;

typedef struct Pool {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t finished;
    Job *head, *tail;     /* queued jobs, FIFO */
    long queued;          /* jobs on that queue */
    int loop_waiting;     /* threads waiting on `finished` (the loop, in wait()) */
    Job *done_head, *done_tail;
    int stopping, spread;
    int nthreads;
    Worker *workers;      /* NULL until initialised */
    int *cpus;
    int ncpus;
    unsigned long long submitted, completed;
    struct KeepAwake *relay;  /* guards that wake this pool's pinned workers from their own CPU, or NULL */
} Pool;

static void job_free(Job *j) {
    if (j->steps) {
        for (size_t i = 0; i < j->nsteps; i++) free(j->steps[i].addrs);
        if (j->steps != &j->one) free(j->steps);
    }
    Py_XDECREF(j->token);
    free(j);
}

static void free_jobs(Job *j) {
    for (Job *nx; j; j = nx) {
        nx = j->next;
        job_free(j);
    }
}

static void job_execute(const Job *j) {
    for (size_t i = 0; i < j->nsteps; i++) {
        const Step *s = &j->steps[i];
        if (s->kind == STEP_COPY) {
            if (j->streaming)
                copy_streaming_unfenced(s->dst, s->src, s->n, 4096);
            else
                memmove(s->dst, s->src, s->n);
        } else {
            reduce_run(s->fn, s->op, s->code, s->n, s->addrs, s->nsrc, s->addrs + s->nsrc, s->ndst, j->streaming);
        }
    }
    if (j->streaming) streaming_fence();
}

/* Put a job on the finished list (mutex held). Returns whether the loop waits for it: the caller then
 * signals `finished` once it has released the mutex. */
static int finish_locked(Pool *p, Job *j) {
    j->next = NULL;
    if (p->done_tail) p->done_tail->next = j; else p->done_head = j;
    p->done_tail = j;
    p->completed++;
    return p->loop_waiting > 0;
}

/* Pin the calling thread to cpus[0..n) (nothing when n is 0); best effort, as affinity.pin_thread. */
static void pin_current_thread(const int *cpus, int n) {
    if (n <= 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int i = 0; i < n; i++)
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) CPU_SET(cpus[i], &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

/* A sequence of CPU numbers as a calloc'ed array in *out (freed by the caller, also on error):
 * its length, or -1 with an exception (`what` is the TypeError's message). */
static Py_ssize_t parse_cpus(PyObject *obj, const char *what, int **out) {
    PyObject *seq = PySequence_Fast(obj, what);
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (!(*out = calloc(n ? (size_t)n : 1, sizeof(int)))) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long c = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (c == -1 && PyErr_Occurred()) { Py_DECREF(seq); return -1; }
        (*out)[i] = (int)c;
    }
    Py_DECREF(seq);
    return n;
}

/* The oldest queued job, taken off the queue (mutex held, queue not empty). */
static Job *pop_locked(Pool *p) {
    Job *j = p->head;
    p->head = j->next;
    if (!p->head) p->tail = NULL;
    __atomic_store_n(&p->queued, p->queued - 1, __ATOMIC_SEQ_CST);   /* guards read it unlocked */
    return j;
}

/* Choose idle workers to wake, one per queued job at most, none pinned to CPU `skip` (-1: any) nor to
 * a CPU whose spinning guard wakes them (relay_covers, "Relayed wake-ups" below); or, with `only` >= 0,
 * those pinned to CPU `only` alone (that CPU's guard, relay_wake). Mark them woken (mutex held); their
 * indices go to woken[], their number is returned. The caller signals them once it has released the
 * mutex: a worker woken under it would only block on it, after preempting the caller on its CPU. */
static int relay_covers(Pool *p, int cpu);
static void relay_vouch(Pool *p, int cpu);

static int pick_locked(Pool *p, int skip, int only, int *woken) {
    int n = 0;
    for (int i = 0; i < p->nthreads && n < p->queued; i++) {
        Worker *w = &p->workers[i];
        int eligible = only >= 0 ? w->cpu == only
                                 : (skip < 0 || w->cpu != skip) && !relay_covers(p, w->cpu);
        if (w->idle && eligible) {
            w->idle = 0;
            woken[n++] = i;
        }
    }
    return n;
}

static void signal_workers(Pool *p, const int *woken, int n) {
    for (int i = 0; i < n; i++) pthread_cond_signal(&p->workers[woken[i]].wake);
}

/* Wake idle workers for the queued jobs; when `here`, none pinned to the caller's CPU. */
static void kick(Pool *p, int here) {
    int skip = here && p->spread ? sched_getcpu() : -1;
    int woken[MAX_THREADS];
    pthread_mutex_lock(&p->mu);
    int n = pick_locked(p, skip, -1, woken);
    pthread_mutex_unlock(&p->mu);
    signal_workers(p, woken, n);
}

static void *worker_main(void *arg) {
    Worker *w = arg;
    Pool *p = w->pool;
    pthread_setname_np(pthread_self(), "shmproxy-copy");    /* what tests and ps show */
    if (w->cpu >= 0) pin_current_thread(&w->cpu, 1);
    else pin_current_thread(p->cpus, p->ncpus);
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->stopping) {
            w->idle = 1;
            relay_vouch(p, w->cpu);
            pthread_cond_wait(&w->wake, &p->mu);
        }
        w->idle = 0;
        if (p->stopping) break;
        Job *j = pop_locked(p);
        pthread_mutex_unlock(&p->mu);
        job_execute(j);
        pthread_mutex_lock(&p->mu);
        if (finish_locked(p, j)) {
            pthread_mutex_unlock(&p->mu);
            pthread_cond_signal(&p->finished);
            pthread_mutex_lock(&p->mu);
        }
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* Queue a job and wake a worker for it (spread: not the one on the caller's CPU; see "Wake-ups"). */
static void enqueue(Pool *p, Job *j) {
    int skip = p->spread ? sched_getcpu() : -1;
    int woken[MAX_THREADS];
    j->next = NULL;
    pthread_mutex_lock(&p->mu);
    if (p->tail) p->tail->next = j; else p->head = j;
    p->tail = j;
    __atomic_store_n(&p->queued, p->queued + 1, __ATOMIC_SEQ_CST);
    p->submitted++;
    int n = pick_locked(p, skip, -1, woken);
    pthread_mutex_unlock(&p->mu);
    signal_workers(p, woken, n);
}

static int check_running(Pool *p) {
    if (p->stopping || !p->workers) {
        PyErr_SetString(PyExc_RuntimeError, "the worker pool is stopped");
        return -1;
    }
    return 0;
}

static Job *job_new(PyObject *token, size_t nsteps, int streaming) {
    Job *j = calloc(1, sizeof(Job));
    if (!j) return NULL;
    if (nsteps <= 1) {
        j->steps = &j->one;
    } else if (!(j->steps = calloc(nsteps, sizeof(Step)))) {
        free(j);
        return NULL;
    }
    j->nsteps = nsteps;
    j->streaming = streaming;
    Py_INCREF(token);
    j->token = token;
    return j;
}

static void *as_addr(PyObject *o) {
    void *p = PyLong_AsVoidPtr(o);
    if (!p && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a null address");
    return p;
}

/* ------------------------------------------------------------------------------------ KeepAwake */
/*
 * Idle-priority threads that keep the progress process's CPUs from going idle while the job is busy.
 *
 * On a virtual machine an idle vCPU halts, and waking a halted vCPU is an interrupt the hypervisor
 * delivers when it next schedules that vCPU: while other guests load the host, that is much later
 * (2-vCPU VM at 30-45 % steal: a 4 MiB ping-pong went from ~2.2 ms to ~1.1 ms one-way with two
 * idle-priority spinners beside it). Every hand-off of a message (rank -> loop -> workers -> loop ->
 * rank) is such a wake-up when the node is crowded. A SCHED_IDLE thread runs only when nothing else
 * wants its CPU and is preempted the moment something does, so it takes no time from ranks or workers;
 * it only keeps the vCPU running. Each spins for `window` after the last touch() and then sleeps on a
 * condvar: an idle job costs nothing.
 *
 * A guard calls sched_yield() between its pause bursts. A thread that yields is not woken, so
 * nothing preempts the guard it hands its CPU to: on the VM's kernel (6.18, EEVDF) a guard freshly
 * woken by touch() is eligible, takes the yield, and kept the CPU for its whole window (2 ms) while
 * the progress loop, which yields between passes, sat runnable beside it: 1 % of 4 MiB round trips
 * took 1.2-2 ms. Yielding back costs a guard nothing, since it runs only when nobody else wants to.
 *
 * Protocol: touch() stores the deadline, then reads `sleepers`; a guard increments `sleepers`, then
 * reads the deadline, under the mutex, before it waits (both seq_cst): either the guard sees the new
 * deadline or touch() sees it asleep and signals under the mutex, so no touch is lost.
 *
 * Relayed wake-ups (KeepAwake(cpus, window, workers, rank_areas, nranks)): waking a thread on another
 * vCPU is an IPI, and on the VM each one cost the waker ~12 us inside the syscall (the exit to the
 * hypervisor) and the wakee ~12 us more before it ran (perf with ipi:ipi_send_cpu, 4 MiB ping-pong:
 * 641 of 643 worker wake-ups took that path, ~23 us from sched_waking to running; a wake-up on the
 * wakee's own CPU took ~5). A guard in its window is running on its CPU anyway, so it wakes what
 * sleeps there itself: the wake-up is local, no IPI, and the wakee preempts the guard at once.
 *  - workers: the pool signals none of a live guard's workers when it queues a job (relay_covers); the
 *    guard sees `queued` between its pause bursts, takes the mutex and signals its CPU's idle workers,
 *    one per queued job. Nothing waits on a guard that is not there: a job no worker took stays
 *    queued, and the loop, which runs queued jobs itself on a crowded node (help()), takes it.
 *  - ranks: a rank about to sleep stores WAITING = (its CPU + 1) | the futex word it sleeps on << 32
 *    (shm/_pool_layout.h); the guard of that CPU wakes it once the word moved. The progress loop asks
 *    live_mask() which CPUs those are and then only bumps the word; it remembers each wake-up so
 *    left, and makes it itself should the rank still sleep on that word after a grace period
 *    (progress.py, check_relayed): a guard preempted just after it proved live delays, never loses.
 * A guard is live while its heartbeat (one per pass, ~2 us apart) is under RELAY_FRESH_NS old; it
 * clears it before it sleeps, then makes one last pass. Against a waker that read the heartbeat
 * before it was cleared, both sides are seq_cst: the waker publishes (queue, futex word), then reads
 * the heartbeat; the guard clears it, then reads what was published.
 */
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
#define RELAY_FRESH_NS 10000   /* a guard is live if it passed this recently (a pass is ~2 us) */

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

typedef struct { KeepAwake *k; int cpu, index; } GuardArg;

static PyTypeObject PoolType;

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
static int relay_covers(Pool *p, int cpu) {
    KeepAwake *k = p->relay;
    int i = k ? guard_on(k, cpu) : -1;
    return i >= 0 && guard_live(k, i, mono_ns());
}

/* A worker pinned to `cpu` is about to sleep (pool mutex held): in its window, that CPU's guard runs
 * next, so it counts as live from now. Its heartbeat had gone stale while the worker ran, and the loop,
 * completing that worker's job a few us later, sent the ranks' wake-ups across (IPI) in half the
 * 4 MiB round trips before the guard's next pass. */
static void relay_vouch(Pool *p, int cpu) {
    KeepAwake *k = p->relay;
    int i = k ? guard_on(k, cpu) : -1;
    if (i < 0 || __atomic_load_n(&k->sleepers, __ATOMIC_SEQ_CST)) return;
    uint64_t now = mono_ns();
    if (now < __atomic_load_n(&k->deadline_ns, __ATOMIC_SEQ_CST))
        __atomic_store_n(&k->beats[i * BEAT_STRIDE], now, __ATOMIC_SEQ_CST);
}

/* A guard on `cpu`: wake the ranks that sleep on this CPU and whose futex word moved since they went
 * to sleep (a rank stores WAITING = (its CPU + 1) | the word it sleeps on << 32; see comm.py). */
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
    int n = p->stopping ? 0 : pick_locked(p, -1, cpu, woken);
    pthread_mutex_unlock(&p->mu);
    signal_workers(p, woken, n);
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
    pin_current_thread(&a.cpu, 1);
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
        if (!(k->rank_areas = as_addr(areas_obj))) return -1;
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
        if (!PyObject_TypeCheck(pool_obj, &PoolType) || !((Pool *)pool_obj)->workers) {
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
    Py_ssize_t n = parse_cpus(cpus_obj, "KeepAwake: cpus must be a sequence of ints", &k->cpus);
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

static PyTypeObject KeepAwakeType = {
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

/* ---------------------------------------------------------------------------------- Python API */

static int Pool_init(Pool *p, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"nthreads", "cpus", "spread", NULL};
    int nthreads, spread = 0;
    PyObject *cpus_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i|Op", kwlist, &nthreads, &cpus_obj, &spread))
        return -1;
    if (p->workers) {
        PyErr_SetString(PyExc_RuntimeError, "Workers is already initialised");
        return -1;
    }
    if (nthreads < 0 || nthreads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "nthreads must be in 0..%d, not %d", MAX_THREADS, nthreads);
        return -1;
    }
    if (cpus_obj != Py_None) {
        Py_ssize_t n = parse_cpus(cpus_obj, "cpus must be a sequence of ints or None", &p->cpus);
        if (n < 0) return -1;
        p->ncpus = (int)n;
    }
    if (spread && p->ncpus == 0) {
        PyErr_SetString(PyExc_ValueError, "spread needs the cpus to spread the workers over");
        return -1;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    p->spread = spread;
    p->workers = calloc(nthreads ? (size_t)nthreads : 1, sizeof(Worker));   /* non-NULL: initialised */
    if (!p->workers) { pthread_condattr_destroy(&ca); PyErr_NoMemory(); return -1; }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->finished, &ca);
    for (int i = 0; i < nthreads; i++) {
        Worker *w = &p->workers[i];
        w->pool = p;
        w->cpu = spread ? p->cpus[i % p->ncpus] : -1;
        pthread_cond_init(&w->wake, &ca);
    }
    pthread_condattr_destroy(&ca);
    for (int i = 0; i < nthreads; i++) {
        int rc = pthread_create(&p->workers[i].thread, NULL, worker_main, &p->workers[i]);
        if (rc) {
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;  /* the threads already started are stopped by dealloc */
        }
        p->nthreads = i + 1;
    }
    return 0;
}

static void pool_stop(Pool *p) {
    if (!p->workers || p->stopping) return;
    pthread_mutex_lock(&p->mu);
    p->stopping = 1;
    for (int i = 0; i < p->nthreads; i++) pthread_cond_signal(&p->workers[i].wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nthreads; i++) pthread_join(p->workers[i].thread, NULL);  /* a job always ends */
}

static PyObject *Pool_stop(Pool *p, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    pool_stop(p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void Pool_dealloc(Pool *p) {
    if (p->workers) {
        Py_BEGIN_ALLOW_THREADS
        pool_stop(p);
        Py_END_ALLOW_THREADS
        free_jobs(p->head);
        free_jobs(p->done_head);
        for (int i = 0; i < p->nthreads; i++) pthread_cond_destroy(&p->workers[i].wake);
        pthread_mutex_destroy(&p->mu);
        pthread_cond_destroy(&p->finished);
        free(p->workers);
    }
    free(p->cpus);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyObject *Pool_copy(Pool *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "copy(token, dst, src, n)");
        return NULL;
    }
    if (check_running(p) < 0) return NULL;
    char *dst = as_addr(args[1]);
    if (!dst) return NULL;
    char *src = as_addr(args[2]);
    if (!src) return NULL;
    unsigned long long n = PyLong_AsUnsignedLongLong(args[3]);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Job *j = job_new(args[0], 1, 0);
    if (!j) return PyErr_NoMemory();
    j->one.kind = STEP_COPY;
    j->one.dst = dst;
    j->one.src = src;
    j->one.n = (size_t)n;
    enqueue(p, j);
    Py_RETURN_NONE;
}

/* Addresses of a sequence into out[0..n), or -1 with an exception. */
static int parse_addrs(PyObject *seq_obj, char **out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = as_addr(PySequence_Fast_GET_ITEM(seq_obj, i));
        if (!out[i]) return -1;
    }
    return 0;
}

static int parse_step(PyObject *t, Step *s) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 1) {
        PyErr_SetString(PyExc_TypeError, "a step is a tuple (COPY, dst, src, n) or (REDUCE, op, code, count, srcs, dsts)");
        return -1;
    }
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
    if (kind == STEP_COPY && PyTuple_GET_SIZE(t) == 4) {
        s->kind = STEP_COPY;
        if (!(s->dst = as_addr(PyTuple_GET_ITEM(t, 1))) || !(s->src = as_addr(PyTuple_GET_ITEM(t, 2)))) return -1;
        unsigned long long n = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 3));
        if (n == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        s->n = (size_t)n;
        return 0;
    }
    if (kind == STEP_REDUCE && PyTuple_GET_SIZE(t) == 6) {
        s->kind = STEP_REDUCE;
        s->op = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 1));
        s->code = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 2));
        unsigned long long count = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 3));
        if (PyErr_Occurred()) return -1;
        if (!(s->fn = kernel_for(s->op, s->code))) {
            PyErr_Format(PyExc_ValueError, "REDUCE step: op %d on dtype code %d is not supported here", s->op, s->code);
            return -1;
        }
        s->n = (size_t)count;
        PyObject *srcs = PySequence_Fast(PyTuple_GET_ITEM(t, 4), "srcs must be a sequence of addresses");
        if (!srcs) return -1;
        PyObject *dsts = PySequence_Fast(PyTuple_GET_ITEM(t, 5), "dsts must be a sequence of addresses");
        if (!dsts) { Py_DECREF(srcs); return -1; }
        s->nsrc = (size_t)PySequence_Fast_GET_SIZE(srcs);
        s->ndst = (size_t)PySequence_Fast_GET_SIZE(dsts);
        int rc = -1;
        if (s->nsrc < 1) {
            PyErr_SetString(PyExc_ValueError, "REDUCE step needs at least one source");
        } else if (!(s->addrs = malloc(sizeof(char *) * (s->nsrc + s->ndst)))) {
            PyErr_NoMemory();
        } else if (parse_addrs(srcs, s->addrs, (Py_ssize_t)s->nsrc) == 0 &&
                   parse_addrs(dsts, s->addrs + s->nsrc, (Py_ssize_t)s->ndst) == 0) {
            rc = 0;
        }
        Py_DECREF(srcs);
        Py_DECREF(dsts);
        return rc;
    }
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "unknown step kind %ld or wrong length %zd", kind, PyTuple_GET_SIZE(t));
    return -1;
}

static PyObject *Pool_run(Pool *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "run(token, steps, streaming=False)");
        return NULL;
    }
    int streaming = nargs > 2 ? PyObject_IsTrue(args[2]) : 0;
    if (streaming < 0) return NULL;
    if (check_running(p) < 0) return NULL;
    PyObject *steps = PySequence_Fast(args[1], "steps must be a sequence of tuples");
    if (!steps) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(steps);
    Job *j = job_new(args[0], (size_t)n, streaming);
    if (!j) { Py_DECREF(steps); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_step(PySequence_Fast_GET_ITEM(steps, i), &j->steps[i]) < 0) {
            Py_DECREF(steps);
            job_free(j);
            return NULL;
        }
    }
    Py_DECREF(steps);
    enqueue(p, j);
    Py_RETURN_NONE;
}

static PyObject *Pool_done(Pool *p, PyObject *token) {
    if (!p->workers) return PyErr_Format(PyExc_RuntimeError, "the worker pool is not initialised");
    Job *j = job_new(token, 0, 0);
    if (!j) return PyErr_NoMemory();
    pthread_mutex_lock(&p->mu);
    p->submitted++;
    int signal = finish_locked(p, j);
    pthread_mutex_unlock(&p->mu);
    if (signal) pthread_cond_signal(&p->finished);
    Py_RETURN_NONE;
}

static PyObject *Pool_drain(Pool *p, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (!out || !p->workers) return out;
    pthread_mutex_lock(&p->mu);
    Job *j = p->done_head;
    p->done_head = p->done_tail = NULL;
    pthread_mutex_unlock(&p->mu);
    int failed = 0;
    for (Job *nx; j; j = nx) {
        nx = j->next;
        if (!failed && PyList_Append(out, j->token) < 0) failed = 1;  /* jobs are freed either way */
        job_free(j);
    }
    if (failed) { Py_DECREF(out); return NULL; }
    return out;
}

static PyObject *Pool_wait(Pool *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "wait(timeout, poll=0)");
        return NULL;
    }
    double timeout = PyFloat_AsDouble(args[0]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    double poll = nargs > 1 ? PyFloat_AsDouble(args[1]) : 0.0;
    if (poll == -1.0 && PyErr_Occurred()) return NULL;
    if (!p->workers) Py_RETURN_FALSE;
    int ready;
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    if (timeout < 0) timeout = 0;
    long long ns = ts.tv_nsec + (long long)(timeout * 1e9);
    ts.tv_sec += ns / 1000000000LL;
    ts.tv_nsec = ns % 1000000000LL;
    kick(p, 0);
    if (poll > 0) {   /* a hint read without the mutex; the mutex below decides */
        uint64_t t0 = mono_ns(), limit = (uint64_t)(poll * 1e9);
        while (!__atomic_load_n(&p->done_head, __ATOMIC_ACQUIRE) && mono_ns() - t0 < limit)
            for (int i = 0; i < 16; i++) __builtin_ia32_pause();
    }
    pthread_mutex_lock(&p->mu);
    p->loop_waiting++;
    while (!p->done_head && pthread_cond_timedwait(&p->finished, &p->mu, &ts) != ETIMEDOUT) {}
    p->loop_waiting--;
    ready = p->done_head != NULL;
    pthread_mutex_unlock(&p->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ready);
}

/* help(max_jobs): run up to max_jobs queued jobs on the calling thread, GIL released; returns how many
 * ran (0: the queue was empty, every job is with a worker or finished). See "Caller-runs" above. */
static PyObject *Pool_help(Pool *p, PyObject *arg) {
    long max_jobs = PyLong_AsLong(arg);
    if (max_jobs == -1 && PyErr_Occurred()) return NULL;
    if (!p->workers) return PyLong_FromLong(0);
    long ran = 0;
    Py_BEGIN_ALLOW_THREADS
    kick(p, 1);
    pthread_mutex_lock(&p->mu);
    while (ran < max_jobs && p->head && !p->stopping) {
        Job *j = pop_locked(p);
        pthread_mutex_unlock(&p->mu);
        job_execute(j);
        pthread_mutex_lock(&p->mu);
        finish_locked(p, j);  /* the loop itself is the only thread that waits on `finished` */
        ran++;
    }
    pthread_mutex_unlock(&p->mu);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(ran);
}

static PyObject *Pool_get_pending(Pool *p, void *unused) {
    if (!p->workers) return PyLong_FromLong(0);
    pthread_mutex_lock(&p->mu);
    unsigned long long n = p->submitted - p->completed;
    pthread_mutex_unlock(&p->mu);
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *Pool_get_nthreads(Pool *p, void *unused) { return PyLong_FromLong(p->nthreads); }

static PyMethodDef Pool_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))Pool_copy, METH_FASTCALL, "copy(token, dst, src, n): one memmove"},
    {"run", (PyCFunction)(void (*)(void))Pool_run, METH_FASTCALL,
     "run(token, steps, streaming=False): steps in order, one thread"},
    {"done", (PyCFunction)Pool_done, METH_O, "done(token): report a job finished outside the pool"},
    {"drain", (PyCFunction)Pool_drain, METH_NOARGS, "drain() -> tokens of the jobs finished since the last call"},
    {"wait", (PyCFunction)(void (*)(void))Pool_wait, METH_FASTCALL,
     "wait(timeout, poll=0) -> True once a job has finished (GIL released; polls `poll` s first)"},
    {"help", (PyCFunction)Pool_help, METH_O, "help(max_jobs) -> how many queued jobs the caller ran itself"},
    {"stop", (PyCFunction)Pool_stop, METH_NOARGS, "stop(): workers exit after their current job"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"pending", (getter)Pool_get_pending, NULL, "jobs submitted and not yet finished", NULL},
    {"nthreads", (getter)Pool_get_nthreads, NULL, "worker threads started", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmproxy.shm._workers.Workers",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Copy and reduction worker threads that run without the GIL (see the module).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "shmproxy.shm._workers", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__workers(void) {
    init_tables();
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&KeepAwakeType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Workers", (PyObject *)&PoolType) < 0) { Py_DECREF(&PoolType); Py_DECREF(m); return NULL; }
    Py_INCREF(&KeepAwakeType);
    if (PyModule_AddObject(m, "KeepAwake", (PyObject *)&KeepAwakeType) < 0) {
        Py_DECREF(&KeepAwakeType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "COPY", STEP_COPY);
    PyModule_AddIntConstant(m, "REDUCE", STEP_REDUCE);
    return m;
}
