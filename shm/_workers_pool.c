/*
 * The worker pool of shm._workers (the Workers type): its threads, the job queue and the finished
 * list, the wake-ups, and the loop's wait() and help().
 *
 * Lock protocol: one mutex guards the job queue, the finished list, the counters and the stop flag.
 * Workers sleep on `work`, the progress loop on `finished`, both with bounded or signalled waits.
 * Memory ordering: a worker writes a job's bytes (fencing streaming stores first), then takes the mutex
 * to put the job on the finished list; the loop takes the same mutex in drain() before it tells any
 * rank, so the data is visible before the completion is published (mutex acquire/release).
 *
 * Wake-ups: a queued job wakes one idle worker, if any, with the mutex released, and each worker
 * sleeps on a condvar of its own so that the waker chooses whom it wakes. Signalling under the mutex,
 * any worker, made the loop's submission of a message trickle on a crowded node (seen with perf
 * sched): the worker woken on the loop's CPU preempted it at once, found the mutex held and slept,
 * was woken by the unlock, preempted the loop again, ran its job and slept on an empty queue; the loop
 * queued the next job only then, so a large message went to the workers two chunks at a time, a
 * round of wake-ups each, with the other CPU idle in between. On a crowded node (caller-runs, below)
 * the workers are spread one per CPU and the loop wakes none on the CPU it runs on, where it runs
 * jobs itself (the kernel places a wakee beside its waker, and the keep-awake guards make an idle CPU
 * look busy to its search). wait() and help() first wake idle workers for jobs still queued
 * (wait(): any worker). The finished condvar is signalled only when the loop waits on it, also with
 * the mutex released. On a crowded node the loop polls a while before it sleeps there (wait's
 * `poll`): once it has run out of queued jobs the others finish within a job's length, and a sleeping
 * loop woken from another CPU comes back tens of microseconds later (the measurement:
 * docs/decisions.md; the CPU would otherwise run a keep-awake guard).
 *
 * Caller-runs (help): on a crowded node the progress loop has no core of its own; its CPU is one the
 * workers need. Waiting for them there is the worst of both: the loop's CPU idles (or the loop spins
 * on it) while two workers woken onto the other CPU take turns (a scheduler trace showed a large
 * message moved by one worker at a time, a cross-CPU wake-up per chunk: docs/decisions.md). help()
 * lets the loop take jobs off the same queue and run them itself, GIL released, exactly as a worker
 * would (same execute, same finished list, so drain() and the memory-ordering argument above are
 * unchanged).
 * Whichever thread is on a CPU first takes the next job: a late worker costs nothing, a quick one
 * shares the work.
 */
#include "_workers.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

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
void _sw_pin_current_thread(const int *cpus, int n) {
    if (n <= 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int i = 0; i < n; i++)
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) CPU_SET(cpus[i], &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

/* A sequence of CPU numbers as a calloc'ed array in *out (freed by the caller, also on error):
 * its length, or -1 with an exception (`what` is the TypeError's message). */
Py_ssize_t _sw_parse_cpus(PyObject *obj, const char *what, int **out) {
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
 * a CPU whose spinning guard wakes them (relay_covers, "Relayed wake-ups" in shm/_workers_awake.c);
 * or, with `only` >= 0, those pinned to CPU `only` alone (that CPU's guard, relay_wake). Mark them
 * woken (mutex held); their indices go to woken[], their number is returned. The caller signals them
 * once it has released the mutex: a worker woken under it would only block on it, after preempting
 * the caller on its CPU. */
int _sw_pick_locked(Pool *p, int skip, int only, int *woken) {
    int n = 0;
    for (int i = 0; i < p->nthreads && n < p->queued; i++) {
        Worker *w = &p->workers[i];
        int eligible = only >= 0 ? w->cpu == only
                                 : (skip < 0 || w->cpu != skip) && !_sw_relay_covers(p, w->cpu);
        if (w->idle && eligible) {
            w->idle = 0;
            woken[n++] = i;
        }
    }
    return n;
}

/* Signal the workers _sw_pick_locked chose (mutex released). */
void _sw_signal_workers(Pool *p, const int *woken, int n) {
    for (int i = 0; i < n; i++) pthread_cond_signal(&p->workers[woken[i]].wake);
}

/* Wake idle workers for the queued jobs; when `here`, none pinned to the caller's CPU. */
static void kick(Pool *p, int here) {
    int skip = here && p->spread ? sched_getcpu() : -1;
    int woken[MAX_THREADS];
    pthread_mutex_lock(&p->mu);
    int n = _sw_pick_locked(p, skip, -1, woken);
    pthread_mutex_unlock(&p->mu);
    _sw_signal_workers(p, woken, n);
}

static void *worker_main(void *arg) {
    Worker *w = arg;
    Pool *p = w->pool;
    pthread_setname_np(pthread_self(), "shmproxy-copy");    /* what tests and ps show */
    if (w->cpu >= 0) _sw_pin_current_thread(&w->cpu, 1);
    else _sw_pin_current_thread(p->cpus, p->ncpus);
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->stopping) {
            w->idle = 1;
            _sw_relay_vouch(p, w->cpu);
            pthread_cond_wait(&w->wake, &p->mu);
        }
        w->idle = 0;
        if (p->stopping) break;
        Job *j = pop_locked(p);
        pthread_mutex_unlock(&p->mu);
        _sw_job_execute(j);
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
    int n = _sw_pick_locked(p, skip, -1, woken);
    pthread_mutex_unlock(&p->mu);
    _sw_signal_workers(p, woken, n);
}

static int check_running(Pool *p) {
    if (p->stopping || !p->workers) {
        PyErr_SetString(PyExc_RuntimeError, "the worker pool is stopped");
        return -1;
    }
    return 0;
}

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
        Py_ssize_t n = _sw_parse_cpus(cpus_obj, "cpus must be a sequence of ints or None", &p->cpus);
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
        _sw_free_jobs(p->head);
        _sw_free_jobs(p->done_head);
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
    char *dst = _sw_as_addr(args[1]);
    if (!dst) return NULL;
    char *src = _sw_as_addr(args[2]);
    if (!src) return NULL;
    unsigned long long n = PyLong_AsUnsignedLongLong(args[3]);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Job *j = _sw_job_new(args[0], 1, 0);
    if (!j) return PyErr_NoMemory();
    j->one.kind = STEP_COPY;
    j->one.dst = dst;
    j->one.src = src;
    j->one.n = (size_t)n;
    enqueue(p, j);
    Py_RETURN_NONE;
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
    Job *j = _sw_job_new(args[0], (size_t)n, streaming);
    if (!j) { Py_DECREF(steps); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (_sw_parse_step(PySequence_Fast_GET_ITEM(steps, i), &j->steps[i]) < 0) {
            Py_DECREF(steps);
            _sw_job_free(j);
            return NULL;
        }
    }
    Py_DECREF(steps);
    enqueue(p, j);
    Py_RETURN_NONE;
}

static PyObject *Pool_done(Pool *p, PyObject *token) {
    if (!p->workers) return PyErr_Format(PyExc_RuntimeError, "the worker pool is not initialised");
    Job *j = _sw_job_new(token, 0, 0);
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
        _sw_job_free(j);
    }
    if (failed) { Py_DECREF(out); return NULL; }
    return out;
}

static PyObject *Pool_wait(Pool *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 4 || nargs == 3) {
        PyErr_SetString(PyExc_TypeError, "wait(timeout, poll=0[, word, seen])");
        return NULL;
    }
    double timeout = PyFloat_AsDouble(args[0]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    double poll = nargs > 1 ? PyFloat_AsDouble(args[1]) : 0.0;
    if (poll == -1.0 && PyErr_Occurred()) return NULL;
    /* word, seen: the poll also ends when the u64 at `word` differs from `seen` (the pool's EVENTS: news
     * for the loop, e.g. the collective wire's tokens, shm/_wire.c); the sleep after it does not */
    const uint64_t *word = NULL;
    uint64_t seen = 0;
    if (nargs == 4) {
        word = (const uint64_t *)PyLong_AsVoidPtr(args[2]);
        seen = PyLong_AsUnsignedLongLongMask(args[3]);
        if (PyErr_Occurred()) return NULL;
    }
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
        while (!__atomic_load_n(&p->done_head, __ATOMIC_ACQUIRE) && mono_ns() - t0 < limit) {
            if (word && __atomic_load_n(word, __ATOMIC_ACQUIRE) != seen) break;
            for (int i = 0; i < 16; i++) __builtin_ia32_pause();
        }
        if (word && __atomic_load_n(word, __ATOMIC_ACQUIRE) != seen)
            clock_gettime(CLOCK_MONOTONIC, &ts);   /* the news first: no sleep below */
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
        _sw_job_execute(j);
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

static PyObject *Pool_get_submitted(Pool *p, void *unused) {
    if (!p->workers) return PyLong_FromLong(0);
    pthread_mutex_lock(&p->mu);
    unsigned long long n = p->submitted;
    pthread_mutex_unlock(&p->mu);
    return PyLong_FromUnsignedLongLong(n);
}

static PyMethodDef Pool_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))Pool_copy, METH_FASTCALL, "copy(token, dst, src, n): one memmove"},
    {"run", (PyCFunction)(void (*)(void))Pool_run, METH_FASTCALL,
     "run(token, steps, streaming=False): steps in order, one thread"},
    {"done", (PyCFunction)Pool_done, METH_O, "done(token): report a job finished outside the pool"},
    {"drain", (PyCFunction)Pool_drain, METH_NOARGS, "drain() -> tokens of the jobs finished since the last call"},
    {"wait", (PyCFunction)(void (*)(void))Pool_wait, METH_FASTCALL,
     "wait(timeout, poll=0[, word, seen]) -> True once a job has finished (GIL released; polls `poll` s "
     "first, ending early when the u64 at word differs from seen)"},
    {"help", (PyCFunction)Pool_help, METH_O, "help(max_jobs) -> how many queued jobs the caller ran itself"},
    {"stop", (PyCFunction)Pool_stop, METH_NOARGS, "stop(): workers exit after their current job"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"pending", (getter)Pool_get_pending, NULL, "jobs submitted and not yet finished", NULL},
    {"nthreads", (getter)Pool_get_nthreads, NULL, "worker threads started", NULL},
    {"submitted", (getter)Pool_get_submitted, NULL, "jobs handed to the workers since the start", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject _sw_PoolType = {
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
