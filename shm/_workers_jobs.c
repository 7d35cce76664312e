/*
 * The jobs of shm._workers: building one from Python's arguments (copy(), run()'s steps), running it
 * (a worker or a helping caller), and freeing it. The reduction kernel (_kernel.h) is included here
 * only: its tables are static, one copy per file, and this file fills them (_sw_init_kernels) and
 * reads them.
 *
 * Tokens are Python objects owned by their job: referenced at submission and handed back by drain(),
 * both with the GIL held. Workers only ever touch C data, and every address they use was bounds-checked
 * by the progress process against a mapped buffer before submission.
 */
#include "_workers.h"

#include <stdlib.h>
#include <string.h>

#include "_kernel.h"

/* Free a job, its steps' address arrays and its reference to the token. */
void _sw_job_free(Job *j) {
    if (j->steps) {
        for (size_t i = 0; i < j->nsteps; i++) free(j->steps[i].addrs);
        if (j->steps != &j->one) free(j->steps);
    }
    Py_XDECREF(j->token);
    free(j);
}

/* Free a list of jobs linked through `next`. */
void _sw_free_jobs(Job *j) {
    for (Job *nx; j; j = nx) {
        nx = j->next;
        _sw_job_free(j);
    }
}

/* Run a job's steps in order (without the GIL: C data only). */
void _sw_job_execute(const Job *j) {
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

/* A zeroed job of nsteps steps holding a reference to token, or NULL (out of memory). */
Job *_sw_job_new(PyObject *token, size_t nsteps, int streaming) {
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

/* An int as an address; NULL with an exception (a null address is refused). */
void *_sw_as_addr(PyObject *o) {
    void *p = PyLong_AsVoidPtr(o);
    if (!p && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a null address");
    return p;
}

/* Addresses of a sequence into out[0..n), or -1 with an exception. */
static int parse_addrs(PyObject *seq_obj, char **out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = _sw_as_addr(PySequence_Fast_GET_ITEM(seq_obj, i));
        if (!out[i]) return -1;
    }
    return 0;
}

/* One of run()'s steps into *s: 0, or -1 with an exception (its allocations go with the job). */
int _sw_parse_step(PyObject *t, Step *s) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 1) {
        PyErr_SetString(PyExc_TypeError, "a step is a tuple (COPY, dst, src, n) or (REDUCE, op, code, count, srcs, dsts)");
        return -1;
    }
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
    if (kind == STEP_COPY && PyTuple_GET_SIZE(t) == 4) {
        s->kind = STEP_COPY;
        if (!(s->dst = _sw_as_addr(PyTuple_GET_ITEM(t, 1))) ||
            !(s->src = _sw_as_addr(PyTuple_GET_ITEM(t, 2))))
            return -1;
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

/* Fill the kernel tables (at import, before any job runs). */
void _sw_init_kernels(void) {
    init_tables();
}
