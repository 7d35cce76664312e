/*
 * What the translation units of shm._workers share: the job, worker and pool layouts, and the functions
 * one file calls in another (prefixed _sw_). The module's design is in the headers of shm/_workers.c
 * and shm/_workers_pool.c. The reduction kernel's header is not included here: its tables are static,
 * so only shm/_workers_jobs.c, which fills and reads them, includes it.
 */
#ifndef SHM_WORKERS_H
#define SHM_WORKERS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

enum { STEP_COPY = 0, STEP_REDUCE = 1 };
#define MAX_THREADS 1024

typedef struct {
    int kind, op, code;
    void (*fn)(void *acc, const void *x, size_t n);  /* REDUCE: a combine_fn (_kernel.h) */
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

static inline uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ _workers_jobs.c */

void _sw_job_free(Job *j);
void _sw_free_jobs(Job *j);
void _sw_job_execute(const Job *j);
Job *_sw_job_new(PyObject *token, size_t nsteps, int streaming);
void *_sw_as_addr(PyObject *o);
int _sw_parse_step(PyObject *t, Step *s);
void _sw_init_kernels(void);

/* ------------------------------------------------------------------ _workers_pool.c */

extern PyTypeObject _sw_PoolType;
void _sw_pin_current_thread(const int *cpus, int n);
Py_ssize_t _sw_parse_cpus(PyObject *obj, const char *what, int **out);
int _sw_pick_locked(Pool *p, int skip, int only, int *woken);
void _sw_signal_workers(Pool *p, const int *woken, int n);

/* ------------------------------------------------------------------ _workers_awake.c */

extern PyTypeObject _sw_KeepAwakeType;
int _sw_relay_covers(Pool *p, int cpu);
void _sw_relay_vouch(Pool *p, int cpu);

#endif
