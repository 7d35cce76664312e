/*
 * shm._reduce: the reduction kernel of collective schedules (REDUCE entries of proxy/coll/sched.py).
 *
 *   reduce(op, code, count, srcs, dsts, streaming)
 *     for every element i: acc = srcs[0][i] op srcs[1][i] op ... (in that order), divided by
 *     len(srcs) for AVG, then stored to dsts[0][i], dsts[1][i], ...
 *
 * Why compiled: with numpy a chunk of an 8-rank Allreduce was 14 calls (7 ufuncs, 7 copies), each
 * retaking the GIL, and the progress process's copy workers spent their time queueing for it: 4x
 * larger chunks (4x fewer GIL round trips) nearly doubled the bus bandwidth (docs/bench/HISTORY.md).
 * Here a chunk is one call, without the GIL.
 *
 * Block by block: BLOCK_BYTES of every source are reduced into a small buffer that stays in L1 and
 * written to every destination before the next block is read. Each input is read once and each
 * output written once, and a destination may alias a source (in-place Allreduce: a rank's receive
 * buffer is its send buffer), since a block is read whole before any of it is written.
 *
 * Same results as numpy's ufuncs, element for element: the same order of operations and rounding
 * (built with -ffp-contract=off, so no fused multiply-add), integer arithmetic wraps (done in
 * unsigned types), MIN/MAX return a NaN operand like np.minimum/np.maximum, bool MIN/MAX are and/or.
 * float16, complex products (numpy fuses them with FMA where the CPU has it, so only numpy itself
 * matches numpy there) and complex MIN/MAX stay with numpy: supported() says which.
 *
 * dtype and op codes are proxy/core/ops.py's and proxy/coll/sched.py's (ReduceOp); tests/test_native.py
 * checks every supported pair against numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_kernel.h"

#define GIL_FREE_BYTES (64 * 1024)

/* Addresses of a sequence of ints into a new array (PyMem), or NULL with an exception. */
static char **addresses(PyObject *seq_obj, Py_ssize_t *n, const char *what) {
    PyObject *seq = PySequence_Fast(seq_obj, what);
    if (!seq) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    char **out = PyMem_Malloc(sizeof(char *) * (*n ? *n : 1));
    if (!out) { Py_DECREF(seq); PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < *n; i++) {
        out[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(seq, i));
        if (!out[i] && PyErr_Occurred()) { PyMem_Free(out); Py_DECREF(seq); return NULL; }
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *py_supported(PyObject *self, PyObject *args) {
    int op, code;
    if (!PyArg_ParseTuple(args, "ii", &op, &code)) return NULL;
    return PyBool_FromLong(kernel_for(op, code) != NULL);
}

static PyObject *py_reduce(PyObject *self, PyObject *args) {
    int op, code, streaming;
    unsigned long long count;
    PyObject *srcs_obj, *dsts_obj;
    if (!PyArg_ParseTuple(args, "iiKOOp", &op, &code, &count, &srcs_obj, &dsts_obj, &streaming)) return NULL;
    combine_fn fn = kernel_for(op, code);
    if (!fn) {
        PyErr_Format(PyExc_ValueError, "reduce: op %d on dtype code %d is not supported here", op, code);
        return NULL;
    }
    Py_ssize_t nsrc, ndst;
    char **srcs = addresses(srcs_obj, &nsrc, "srcs must be a sequence of addresses");
    if (!srcs) return NULL;
    char **dsts = addresses(dsts_obj, &ndst, "dsts must be a sequence of addresses");
    if (!dsts) { PyMem_Free(srcs); return NULL; }
    if (nsrc < 1) {
        PyMem_Free(srcs); PyMem_Free(dsts);
        PyErr_SetString(PyExc_ValueError, "reduce needs at least one source");
        return NULL;
    }
    if (count * itemsize[code] * (size_t)(nsrc + ndst) >= GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        reduce_run(fn, op, code, (size_t)count, srcs, (size_t)nsrc, dsts, (size_t)ndst, streaming);
        Py_END_ALLOW_THREADS
    } else {
        reduce_run(fn, op, code, (size_t)count, srcs, (size_t)nsrc, dsts, (size_t)ndst, streaming);
    }
    PyMem_Free(srcs);
    PyMem_Free(dsts);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"reduce", py_reduce, METH_VARARGS,
     "reduce(op, code, count, srcs, dsts, streaming): dsts[j][i] = op over srcs[k][i] (see the module)"},
    {"supported", py_supported, METH_VARARGS, "supported(op, code) -> whether reduce() takes the pair"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "shmproxy.shm._reduce", NULL, -1, methods};

PyMODINIT_FUNC PyInit__reduce(void) {
    init_tables();
    return PyModule_Create(&moddef);
}
