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
 *                                        poll: seconds of polling before it sleeps (Wake-ups in
 *                                        _workers_pool.c)
 *   pool.help(max_jobs) -> int           the caller runs up to max_jobs queued jobs itself (Caller-runs
 *                                        in _workers_pool.c)
 *   pool.stop()                          workers exit after their current job; idempotent
 *
 *   awake = KeepAwake(cpus, window_s, workers=None)
 *                                        one SCHED_IDLE guard thread pinned to each CPU (_workers_awake.c);
 *                                        with a spread pool, the guards wake its workers on their CPUs
 *   awake.touch()                        large work in flight: the guards spin for window_s more
 *   awake.stop()                         the guards exit; idempotent
 *
 * Why compiled: a Python worker thread costs a queue wake-up and two GIL acquisitions per job (one to
 * pick it up, one to report it), while the progress loop holds the GIL most of the time. That hand-off
 * cost hundreds of microseconds, and with many workers they queued for the GIL behind each other: it
 * was the main cost of megabyte collectives (docs/bench/HISTORY.md).
 *
 * The module's files: _workers_pool.c (the Workers type), _workers_jobs.c (building and running a
 * job), _workers_awake.c (the KeepAwake type); _workers.h, what they share.
 */
#include "_workers.h"

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "shmproxy.shm._workers", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__workers(void) {
    _sw_init_kernels();
    if (PyType_Ready(&_sw_PoolType) < 0 || PyType_Ready(&_sw_KeepAwakeType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&_sw_PoolType);
    if (PyModule_AddObject(m, "Workers", (PyObject *)&_sw_PoolType) < 0) {
        Py_DECREF(&_sw_PoolType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&_sw_KeepAwakeType);
    if (PyModule_AddObject(m, "KeepAwake", (PyObject *)&_sw_KeepAwakeType) < 0) {
        Py_DECREF(&_sw_KeepAwakeType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "COPY", STEP_COPY);
    PyModule_AddIntConstant(m, "REDUCE", STEP_REDUCE);
    return m;
}
