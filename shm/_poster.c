/*
 * shm._poster: the rank's post path in C.
 *
 * Why compiled: a point-to-point post written in Python costs several microseconds (argument
 * checks, buffer lookup, struct packing, the Request object, the splice), over the project's targets
 * of 3 us for a single post and 1 us per op inside comm.group() (docs/bench/HISTORY.md). Here it is
 * one call.
 *
 * Division of labour with the Python path (proxy/rank/comm.py and posting.py):
 *   - Poster.post() (and isend()/irecv(), which a Comm installs as its Isend/Irecv) takes the
 *     common case only: an exact numpy array of a supported dtype in native
 *     byte order, C-contiguous (writable for a receive), non-empty and inside memory the rank
 *     registered (comm.alloc); an exact int peer in range and tag in int64; a free completion slot
 *     and a free record at hand; a usable communicator. Anything else returns None and the caller
 *     takes the Python path, which owns every error message, staging and the waits for resources.
 *     So the fast path never raises for bad input and never changes anything before it declines.
 *     The collectives' entries (iallreduce(), ibarrier(), and ibcast() .. ialltoall() through
 *     do_coll()) follow the same rule, declining to the Comm's Python methods.
 *   - Both paths share the state kept here: the request sequence number, the opCount, the group
 *     depth and the group's private chain; write() and enqueue() are the Python path's way in.
 *
 * The module's files: _poster_request.c (RequestBase, Status, Wait and Test), _poster_array.c (reading
 * an array's header, the registered ranges), _poster_type.c (the Poster's state, record writing and the
 * splice, comm.group()), _poster_post.c (the fast posts), _poster_fast.c and _poster_coll.c (the fast
 * path: small blocking calls the rank completes itself, shm/_fast.h); _poster.h, what they share.
 */
#include "_poster.h"

static PyMethodDef module_methods[] = {
    {"fast_kernel", _sp_fast_kernel, METH_VARARGS,
     "fast_kernel(op, code) -> bool: a small collective reduces (op, dtype code) itself"},
    {"set_lock_spin", _sp_set_lock_spin, METH_O,
     "set_lock_spin(ns): contended pool locks retry this long first"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "shmproxy.shm._poster", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__poster(void) {
    if (PyType_Ready(&_sp_StatusType) < 0 || PyType_Ready(&_sp_RequestType) < 0 ||
        PyType_Ready(&_sp_PosterType) < 0)
        return NULL;
    _sp_coll_init();
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&_sp_RequestType);
    Py_INCREF(&_sp_PosterType);
    Py_INCREF(&_sp_StatusType);
    if (PyModule_AddObject(m, "RequestBase", (PyObject *)&_sp_RequestType) < 0 ||
        PyModule_AddObject(m, "Status", (PyObject *)&_sp_StatusType) < 0 ||
        PyModule_AddObject(m, "Poster", (PyObject *)&_sp_PosterType) < 0 ||
        PyModule_AddIntConstant(m, "RECORD_BYTES", RECORD_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "KIND_RECV", KIND_RECV) < 0 ||
        PyModule_AddIntConstant(m, "KIND_SEND", KIND_SEND) < 0 ||
        PyModule_AddIntConstant(m, "KIND_COLL", KIND_COLL) < 0 ||
        PyModule_AddIntConstant(m, "FLAG_IN_PLACE", FLAG_IN_PLACE) < 0 ||
        PyModule_AddIntConstant(m, "COLL_ALLREDUCE", COLL_ALLREDUCE) < 0 ||
        PyModule_AddIntConstant(m, "COLL_BARRIER", COLL_BARRIER) < 0 ||
        PyModule_AddIntConstant(m, "COLL_ALLTOALL", COLL_ALLTOALL) < 0 ||
        PyModule_AddIntConstant(m, "FLAG_NO_RECV", FLAG_NO_RECV) < 0 ||
        PyModule_AddIntConstant(m, "CODE_BOOL", CODE_BOOL) < 0 ||
        PyModule_AddIntConstant(m, "CODE_FIRST_FLOAT", CODE_FIRST_FLOAT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
