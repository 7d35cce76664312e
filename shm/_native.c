/*
 * shm._native: the few operations that Python cannot do fast enough or at all.
 *
 * Why compiled: a lock through ctypes costs several microseconds on the 2-core development VM, one
 * call into this module well under one (DESIGN.md section 12). ctypes also holds the GIL while it
 * blocks unless told otherwise, and cannot do futex(2) or a GIL-free copy. The rank's post path is
 * in shm/_poster.c; the lock protocol both share is in shm/_pool_lock.h.
 *
 * Everything takes raw addresses (Python ints) inside mappings that the caller keeps alive; the
 * Python side (shm/sync.py, shm/pool.py) owns lifetimes and layout. Nothing here allocates.
 *
 * Blocking calls (lock, cond_wait, futex_wait, large copies) release the GIL. Every wait takes a
 * timeout in seconds: nothing here can block forever, so the abort flag is always seen by the caller.
 *
 * Return codes shared with shm/sync.py: OK=0, OWNERDEAD=1 (the lock is held, its previous owner
 * died, the caller must repair the protected state and call consistent()), TIMEDOUT=2, BUSY=3.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "_copy.h"
#include "_pool_lock.h"

/* Below this size a copy is faster than dropping and retaking the GIL. */
#define GIL_FREE_COPY_BYTES (64 * 1024)

static void *as_ptr(PyObject *o) { return PyLong_AsVoidPtr(o); }

static PyObject *errno_error(int err, const char *what) {
    errno = err;
    return PyErr_SetFromErrnoWithFilename(PyExc_OSError, what);
}

/* Map a pthread result to our codes; NULL (with an exception) for anything unexpected. */
static PyObject *lock_result(int r, const char *what) {
    switch (r) {
    case 0: return PyLong_FromLong(RC_OK);
    case EOWNERDEAD: return PyLong_FromLong(RC_OWNERDEAD);
    case ETIMEDOUT: return PyLong_FromLong(RC_TIMEDOUT);
    case EBUSY: return PyLong_FromLong(RC_BUSY);
    default: return errno_error(r, what);
    }
}

static PyObject *py_mutex_init(PyObject *self, PyObject *arg) {
    pthread_mutex_t *m = as_ptr(arg);
    if (!m && PyErr_Occurred()) return NULL;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    int r = pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
    if (r) return errno_error(r, "pthread_mutex_init");
    Py_RETURN_NONE;
}

static PyObject *py_cond_init(PyObject *self, PyObject *arg) {
    pthread_cond_t *c = as_ptr(arg);
    if (!c && PyErr_Occurred()) return NULL;
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    int r = pthread_cond_init(c, &a);
    pthread_condattr_destroy(&a);
    if (r) return errno_error(r, "pthread_cond_init");
    Py_RETURN_NONE;
}

static PyObject *py_lock(PyObject *self, PyObject *args) {
    PyObject *addr; double timeout;
    if (!PyArg_ParseTuple(args, "Od", &addr, &timeout)) return NULL;
    pthread_mutex_t *m = as_ptr(addr);
    if (!m && PyErr_Occurred()) return NULL;
    return lock_result(lock_bounded(m, timeout), "pthread_mutex_clocklock");
}

static PyObject *py_trylock(PyObject *self, PyObject *arg) {
    pthread_mutex_t *m = as_ptr(arg);
    if (!m && PyErr_Occurred()) return NULL;
    return lock_result(pthread_mutex_trylock(m), "pthread_mutex_trylock");
}

static PyObject *py_unlock(PyObject *self, PyObject *arg) {
    pthread_mutex_t *m = as_ptr(arg);
    if (!m && PyErr_Occurred()) return NULL;
    int r = pthread_mutex_unlock(m);
    if (r) return errno_error(r, "pthread_mutex_unlock");
    Py_RETURN_NONE;
}

static PyObject *py_consistent(PyObject *self, PyObject *arg) {
    pthread_mutex_t *m = as_ptr(arg);
    if (!m && PyErr_Occurred()) return NULL;
    int r = pthread_mutex_consistent(m);
    if (r) return errno_error(r, "pthread_mutex_consistent");
    Py_RETURN_NONE;
}

static PyObject *py_cond_wait(PyObject *self, PyObject *args) {
    PyObject *caddr, *maddr; double timeout;
    if (!PyArg_ParseTuple(args, "OOd", &caddr, &maddr, &timeout)) return NULL;
    pthread_cond_t *c = as_ptr(caddr);
    pthread_mutex_t *m = as_ptr(maddr);
    if (PyErr_Occurred()) return NULL;
    struct timespec ts = deadline_after(timeout);
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = pthread_cond_timedwait(c, m, &ts);
    Py_END_ALLOW_THREADS
    return lock_result(r, "pthread_cond_timedwait");
}

static PyObject *py_cond_signal(PyObject *self, PyObject *arg) {
    pthread_cond_t *c = as_ptr(arg);
    if (!c && PyErr_Occurred()) return NULL;
    int r = pthread_cond_signal(c);
    if (r) return errno_error(r, "pthread_cond_signal");
    Py_RETURN_NONE;
}

static PyObject *py_cond_broadcast(PyObject *self, PyObject *arg) {
    pthread_cond_t *c = as_ptr(arg);
    if (!c && PyErr_Occurred()) return NULL;
    int r = pthread_cond_broadcast(c);
    if (r) return errno_error(r, "pthread_cond_broadcast");
    Py_RETURN_NONE;
}

/* futex_wait(addr, expected, timeout) -> 0 when woken or the word changed, 2 on timeout. */
static PyObject *py_futex_wait(PyObject *self, PyObject *args) {
    PyObject *addr; unsigned int expected; double timeout;
    if (!PyArg_ParseTuple(args, "OId", &addr, &expected, &timeout)) return NULL;
    uint32_t *w = as_ptr(addr);
    if (!w && PyErr_Occurred()) return NULL;
    if (timeout < 0) timeout = 0;
    struct timespec rel;
    rel.tv_sec = (time_t)timeout;
    rel.tv_nsec = (long)((timeout - (double)rel.tv_sec) * 1e9);
    long r; int err = 0;
    Py_BEGIN_ALLOW_THREADS
    r = syscall(SYS_futex, w, FUTEX_WAIT, expected, &rel, NULL, 0);
    if (r < 0) err = errno;
    Py_END_ALLOW_THREADS
    if (r == 0 || err == EAGAIN || err == EINTR) return PyLong_FromLong(RC_OK);
    if (err == ETIMEDOUT) return PyLong_FromLong(RC_TIMEDOUT);
    return errno_error(err, "futex(FUTEX_WAIT)");
}

static PyObject *py_futex_wake(PyObject *self, PyObject *args) {
    PyObject *addr; int n;
    if (!PyArg_ParseTuple(args, "Oi", &addr, &n)) return NULL;
    uint32_t *w = as_ptr(addr);
    if (!w && PyErr_Occurred()) return NULL;
    long r = syscall(SYS_futex, w, FUTEX_WAKE, n, NULL, NULL, 0);
    if (r < 0) return errno_error(errno, "futex(FUTEX_WAKE)");
    return PyLong_FromLong(r);
}

/* Atomically add to a uint32 word (the futex words have several writers). */
static PyObject *py_fetch_add_u32(PyObject *self, PyObject *args) {
    PyObject *addr; unsigned int v;
    if (!PyArg_ParseTuple(args, "OI", &addr, &v)) return NULL;
    uint32_t *w = as_ptr(addr);
    if (!w && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLong(__atomic_fetch_add(w, v, __ATOMIC_SEQ_CST));
}

/*
 * buffer_info(obj, writable) -> (address, nbytes)
 * One C-contiguous buffer request: raises BufferError or ValueError (numpy) for non-contiguous objects
 * and for read-only ones when writable is true. Far cheaper than ndarray.__array_interface__.
 */
static PyObject *py_buffer_info(PyObject *self, PyObject *args) {
    PyObject *obj; int writable;
    if (!PyArg_ParseTuple(args, "Op", &obj, &writable)) return NULL;
    Py_buffer view;
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view, flags) < 0) return NULL;
    PyObject *res = Py_BuildValue("(Nn)", PyLong_FromVoidPtr(view.buf), view.len);
    PyBuffer_Release(&view);
    return res;
}


static void copy_plain(char *d, const char *s, size_t n) { memmove(d, s, n); }

/* Parse (dst, src, n) and copy with ``fn``, without the GIL for large sizes. */
static PyObject *copy_call(PyObject *args, void (*fn)(char *, const char *, size_t)) {
    PyObject *daddr, *saddr; unsigned long long n;
    if (!PyArg_ParseTuple(args, "OOK", &daddr, &saddr, &n)) return NULL;
    char *d = as_ptr(daddr);
    const char *s = as_ptr(saddr);
    if (PyErr_Occurred()) return NULL;
    if (n >= GIL_FREE_COPY_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        fn(d, s, (size_t)n);
        Py_END_ALLOW_THREADS
    } else if (n) {
        memmove(d, s, (size_t)n);
    }
    Py_RETURN_NONE;
}

/* memcopy(dst, src, n): memmove between raw addresses. */
static PyObject *py_memcopy(PyObject *self, PyObject *args) { return copy_call(args, copy_plain); }

/* memcopy_nt(dst, src, n): the same with streaming stores. */
static PyObject *py_memcopy_nt(PyObject *self, PyObject *args) { return copy_call(args, copy_streaming); }

static PyMethodDef methods[] = {
    {"mutex_init", py_mutex_init, METH_O, "Initialise a process-shared robust mutex at addr."},
    {"cond_init", py_cond_init, METH_O, "Initialise a process-shared CLOCK_MONOTONIC condvar at addr."},
    {"lock", py_lock, METH_VARARGS, "lock(mutex, timeout) -> OK | OWNERDEAD | TIMEDOUT"},
    {"trylock", py_trylock, METH_O, "trylock(mutex) -> OK | OWNERDEAD | BUSY"},
    {"unlock", py_unlock, METH_O, "unlock(mutex)"},
    {"consistent", py_consistent, METH_O, "Mark a robust mutex consistent after OWNERDEAD."},
    {"cond_wait", py_cond_wait, METH_VARARGS, "cond_wait(cond, mutex, timeout) -> OK | OWNERDEAD | TIMEDOUT"},
    {"cond_signal", py_cond_signal, METH_O, "cond_signal(cond)"},
    {"cond_broadcast", py_cond_broadcast, METH_O, "cond_broadcast(cond)"},
    {"futex_wait", py_futex_wait, METH_VARARGS, "futex_wait(addr, expected, timeout) -> OK | TIMEDOUT"},
    {"futex_wake", py_futex_wake, METH_VARARGS, "futex_wake(addr, n) -> number woken"},
    {"fetch_add_u32", py_fetch_add_u32, METH_VARARGS, "fetch_add_u32(addr, v) -> old value"},
    {"buffer_info", py_buffer_info, METH_VARARGS, "buffer_info(obj, writable) -> (address, nbytes)"},
    {"memcopy", py_memcopy, METH_VARARGS, "memcopy(dst, src, n): memmove, GIL released when large"},
    {"memcopy_nt", py_memcopy_nt, METH_VARARGS, "memcopy_nt(dst, src, n): copy with streaming stores"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "shm._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    PyModule_AddIntConstant(m, "MUTEX_SIZE", (long)sizeof(pthread_mutex_t));
    PyModule_AddIntConstant(m, "COND_SIZE", (long)sizeof(pthread_cond_t));
    PyModule_AddIntConstant(m, "OK", RC_OK);
    PyModule_AddIntConstant(m, "OWNERDEAD", RC_OWNERDEAD);
    PyModule_AddIntConstant(m, "TIMEDOUT", RC_TIMEDOUT);
    PyModule_AddIntConstant(m, "BUSY", RC_BUSY);
    return m;
}
