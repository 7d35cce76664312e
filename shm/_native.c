/*
 * shm._native: the few operations that Python cannot do fast enough or at all.
 *
 * Why compiled: a lock through ctypes costs several microseconds on the 2-core development VM, one
 * call into this module well under one (docs/architecture.md, "Lock protocol"). ctypes also holds the GIL while it
 * blocks unless told otherwise, and cannot do futex(2) or a GIL-free copy. The rank's post path is
 * in shm/_poster.c; the lock protocol both share is in shm/_pool_lock.h. Completions and rank wake-ups
 * (complete_coll, wake_owners) are in shm/_native_wake.c.
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
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "_copy.h"
#include "_native.h"
#include "_pool_layout.h"
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

/* getcpu() -> the CPU the caller runs on (sched_getcpu; a rank publishes it before it sleeps). */
static PyObject *py_getcpu(PyObject *self, PyObject *unused) { return PyLong_FromLong(sched_getcpu()); }

/* Atomically add to a uint32 word (the futex words have several writers). */
static PyObject *py_fetch_add_u32(PyObject *self, PyObject *args) {
    PyObject *addr; unsigned int v;
    if (!PyArg_ParseTuple(args, "OI", &addr, &v)) return NULL;
    uint32_t *w = as_ptr(addr);
    if (!w && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLong(__atomic_fetch_add(w, v, __ATOMIC_SEQ_CST));
}

/*
 * take_posted(pool, records_off, rank_area_off, nrecords, max_ops, batch, out, idx) -> (n, err, at)
 * The progress process's fetch, with the pool mutex held by the caller: splice the chains ranks handed
 * off (shm/_pool_lock.h, "Hand-off"), then detach records from the
 * head of the posted chain (at most `batch` distinct (owner, opCount) groups), copy each one's 128
 * bytes to out[k] and its index to idx[k], and push the record back on its owner's free list (NCCL's
 * freeOps), all in C so that the mutex is held for nanoseconds per record, not the microsecond that
 * unpacking into Python objects costs (ranks posting meanwhile would block on the mutex). The caller
 * builds its Op objects from `out` after unlocking. `out` holds nrecords * 128 bytes, `idx` nrecords
 * int32s. err: 0 = ok; 1 = the chain links to index `at`, out of range; 2 = record `at` names an owner
 * outside its region. On an error nothing after the records already taken is touched.
 */
#define MAX_BATCH 1024   /* APPEND_BATCH_SIZE's maximum (proxy/core/params.py) */

/* The arguments of a take: the pool, the record copies' buffer and index array, the layout numbers. */
typedef struct {
    char *pool, *out;
    int32_t *idxs;
    Py_ssize_t records_off, rank_area_off, nrec, max_ops, batch;
} Take;

/* Resolve and check a take's buffers (the numbers were parsed into t); 0 with an exception if bad. */
static int take_resolve(Take *t, PyObject *pool_o, PyObject *out_o, PyObject *idx_o, const char *who) {
    t->pool = as_ptr(pool_o);
    t->out = as_ptr(out_o);
    t->idxs = as_ptr(idx_o);
    if (PyErr_Occurred()) return 0;
    if (!t->pool || !t->out || !t->idxs || t->max_ops <= 0 || t->batch <= 0 || t->batch > MAX_BATCH) {
        PyErr_Format(PyExc_ValueError, "%s: bad arguments", who);
        return 0;
    }
    return 1;
}

/* The take itself (mutex held): returns n; *err_out and *at_out as above. */
static Py_ssize_t take_locked(const Take *t, int *err_out, int32_t *at_out) {
    char *pool = t->pool;
    int32_t *head = (int32_t *)(pool + POOL_NEXT_OPS_OFF), *tail = (int32_t *)(pool + POOL_NEXT_OPS_END_OFF);
    /* chains handed off by ranks: splice them first (_pool_lock.h, "Hand-off") */
    PostedChain chain = {NULL, NULL, head, tail, pool + t->records_off,
                         (uint64_t *)(pool + POOL_PENDING_MASK_OFF), pool + t->rank_area_off,
                         (uint64_t *)(pool + POOL_SLEEPING_OFF)};
    drain_pending_locked(&chain);
    int32_t *freel = (int32_t *)(pool + POOL_FREE_OPS_OFF);
    int32_t g_owner[MAX_BATCH];
    uint64_t g_count[MAX_BATCH];
    Py_ssize_t ngroups = 0, n = 0;
    int err = 0;
    int32_t i = *head, at = -1;
    while (i != -1) {
        if (i < 0 || i >= t->nrec) { err = 1; at = i; break; }
        char *rec = pool + t->records_off + (Py_ssize_t)i * RECORD_BYTES;
        int32_t owner;
        uint64_t opcount;
        memcpy(&owner, rec + REC_OWNER_OFF, 4);
        memcpy(&opcount, rec + REC_OPCOUNT_OFF, 8);
        if (owner != i / t->max_ops) { err = 2; at = i; break; }
        Py_ssize_t g = 0;
        while (g < ngroups && !(g_owner[g] == owner && g_count[g] == opcount)) g++;
        if (g == ngroups) {
            if (ngroups >= t->batch) break;
            g_owner[ngroups] = owner;
            g_count[ngroups++] = opcount;
        }
        memcpy(t->out + n * RECORD_BYTES, rec, RECORD_BYTES);
        t->idxs[n++] = i;
        int32_t next;
        memcpy(&next, rec, 4);
        memcpy(rec, &freel[owner], 4);
        freel[owner] = i;
        i = next;
    }
    *head = i;   /* on an error: the records taken are gone from the chain, the bad link stays for the dump */
    if (i == -1) *tail = -1;
    *err_out = err;
    *at_out = at;
    return n;
}

static PyObject *py_take_posted(PyObject *self, PyObject *args) {
    PyObject *pool_o, *out_o, *idx_o;
    Take t;
    if (!PyArg_ParseTuple(args, "OnnnnnOO", &pool_o, &t.records_off, &t.rank_area_off, &t.nrec, &t.max_ops,
                          &t.batch, &out_o, &idx_o) ||
        !take_resolve(&t, pool_o, out_o, idx_o, "take_posted"))
        return NULL;
    int err;
    int32_t at;
    Py_ssize_t n = take_locked(&t, &err, &at);
    return Py_BuildValue("(nii)", n, err, at);
}

/*
 * fetch_posted(pool, records_off, rank_area_off, nrecords, max_ops, batch, out, idx, blocking, timeout)
 *   -> (n, err, at, rc)
 * The progress process's fetch when the posted chain or a pending slot is not empty: lock (trylock
 * only, unless `blocking`: then the bounded lock of _pool_lock.h), take_posted, unlock, in one call
 * rather than three with the interpreter between them holding the mutex. rc: OK; BUSY (trylock
 * lost; nothing taken); TIMEDOUT (nothing taken); OWNERDEAD (the mutex is made consistent and
 * released, nothing taken: the caller reports the death and stops trusting the chain, as
 * sync.SharedMutex does).
 */
static PyObject *py_fetch_posted(PyObject *self, PyObject *args) {
    PyObject *pool_o, *out_o, *idx_o;
    Take t;
    int blocking;
    double timeout;
    if (!PyArg_ParseTuple(args, "OnnnnnOOpd", &pool_o, &t.records_off, &t.rank_area_off, &t.nrec, &t.max_ops,
                          &t.batch, &out_o, &idx_o, &blocking, &timeout) ||
        !take_resolve(&t, pool_o, out_o, idx_o, "fetch_posted"))
        return NULL;
    char *pool = t.pool;
    pthread_mutex_t *m = (pthread_mutex_t *)(pool + POOL_MUTEX_OFF);
    int r = blocking ? lock_bounded(m, timeout) : pthread_mutex_trylock(m);
    int rc;
    if (r == EBUSY) rc = RC_BUSY;
    else if (r == ETIMEDOUT) rc = RC_TIMEDOUT;
    else if (r == EOWNERDEAD) {
        pthread_mutex_consistent(m);
        pthread_mutex_unlock(m);
        rc = RC_OWNERDEAD;
    } else if (r) return errno_error(r, blocking ? "pthread_mutex_clocklock" : "pthread_mutex_trylock");
    else rc = RC_OK;
    int err = 0;
    int32_t at = -1;
    Py_ssize_t n = 0;
    if (rc == RC_OK) {
        n = take_locked(&t, &err, &at);
        pthread_mutex_unlock(m);
    }
    return Py_BuildValue("(niii)", n, err, at, rc);
}

/*
 * sleep_unless_posted(pool, timeout, seen_events) -> OK | TIMEDOUT | OWNERDEAD
 * The progress process's condvar sleep, pool mutex held, the posted chain found empty: store
 * SLEEPING = 1, then sleep only if no rank handed a chain off meanwhile (the pending mask is empty)
 * and no thread of this process posted an event (EVENTS still equals `seen_events`), all sequentially
 * consistent, against a poster's mask bit (or an event's increment) then SLEEPING load
 * (shm/_pool_lock.h, "Hand-off"; post_event below): either we see its bit or increment, or it sees
 * SLEEPING and signals under the mutex. Bounded by `timeout` s; SLEEPING is 0 again on return, and
 * the mutex held (made consistent by the caller on OWNERDEAD, as sync.SharedCond.wait).
 */
static PyObject *py_sleep_unless_posted(PyObject *self, PyObject *args) {
    PyObject *pool_o;
    double timeout;
    unsigned long long seen_events;
    if (!PyArg_ParseTuple(args, "OdK", &pool_o, &timeout, &seen_events)) return NULL;
    char *pool = as_ptr(pool_o);
    if (!pool) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "sleep_unless_posted: no pool");
        return NULL;
    }
    uint64_t *sleeping = (uint64_t *)(pool + POOL_SLEEPING_OFF);
    uint64_t *mask = (uint64_t *)(pool + POOL_PENDING_MASK_OFF);
    uint64_t *events = (uint64_t *)(pool + POOL_EVENTS_OFF);
    int r = 0;
    __atomic_store_n(sleeping, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(mask, __ATOMIC_SEQ_CST) == 0 && __atomic_load_n(events, __ATOMIC_SEQ_CST) == seen_events) {
        struct timespec ts = deadline_after(timeout);
        Py_BEGIN_ALLOW_THREADS
        r = pthread_cond_timedwait((pthread_cond_t *)(pool + POOL_COND_OFF),
                                   (pthread_mutex_t *)(pool + POOL_MUTEX_OFF), &ts);
        Py_END_ALLOW_THREADS
    }
    __atomic_store_n(sleeping, 0, __ATOMIC_RELEASE);
    return lock_result(r, "pthread_cond_timedwait");
}

/*
 * post_event(pool, timeout) -> OK | TIMEDOUT | OWNERDEAD
 * A thread of the progress process other than its loop (the service thread, a transport's helper
 * thread watching sockets or device events) has news for the loop, already queued where the loop
 * looks: bump EVENTS, then, if the loop may be asleep (SLEEPING), take the pool mutex and broadcast
 * the condvar. Both accesses are sequentially consistent against the loop's SLEEPING store and EVENTS
 * load in sleep_unless_posted, so the news is never left until the loop's bounded sleep ends. The
 * ranks' post path is untouched: they never read EVENTS.
 */
static PyObject *py_post_event(PyObject *self, PyObject *args) {
    PyObject *pool_o;
    double timeout;
    if (!PyArg_ParseTuple(args, "Od", &pool_o, &timeout)) return NULL;
    char *pool = as_ptr(pool_o);
    if (!pool) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "post_event: no pool");
        return NULL;
    }
    __atomic_add_fetch((uint64_t *)(pool + POOL_EVENTS_OFF), 1, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n((uint64_t *)(pool + POOL_SLEEPING_OFF), __ATOMIC_SEQ_CST))
        return PyLong_FromLong(RC_OK);
    pthread_mutex_t *m = (pthread_mutex_t *)(pool + POOL_MUTEX_OFF);
    int r = lock_bounded(m, timeout);   /* releases the GIL itself before it blocks */
    if (r == EOWNERDEAD) pthread_mutex_consistent(m);   /* the loop learns who died through its watcher */
    if (r == 0 || r == EOWNERDEAD) {
        pthread_cond_broadcast((pthread_cond_t *)(pool + POOL_COND_OFF));
        pthread_mutex_unlock(m);
    }
    return lock_result(r, "pthread_mutex_clocklock");
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
    {"getcpu", py_getcpu, METH_NOARGS, "getcpu() -> the CPU the caller runs on"},
    {"wake_owners", _sn_wake_owners, METH_VARARGS,
     "wake_owners(pool, rank_area_off, owners, relayed=0) -> None"},
    {"complete_coll", _sn_complete_coll, METH_VARARGS,
     "complete_coll(pool, slots_off, rank_area_off, max_ops, ops, nbytes, relayed=0) -> -1 | index of a bad op"},
    {"fetch_posted", py_fetch_posted, METH_VARARGS,
     "fetch_posted(pool, records_off, rank_area_off, nrecords, max_ops, batch, out, idx, blocking, timeout) "
     "-> (n, err, at, rc): lock, take_posted, unlock in one call"},
    {"fast_take", _sn_fast_take, METH_VARARGS,
     "fast_take(pair, cell_stride, max_slow, line) -> message | TAKE_NONE | TAKE_BUSY | TAKE_BLOCKED (shm/_fast.h)"},
    {"fast_wake_coll", _sn_fast_wake_coll, METH_O, "fast_wake_coll(word): wake ranks in a small collective"},
    {"fast_ref_done", _sn_fast_ref_done, METH_VARARGS,
     "fast_ref_done(pair, cell, line, src, nbytes, word) -> bytearray | None: end a drain by reference"},
    {"sleep_unless_posted", py_sleep_unless_posted, METH_VARARGS,
     "sleep_unless_posted(pool, timeout, seen_events) -> OK | TIMEDOUT | OWNERDEAD: the progress process's condvar sleep"},
    {"post_event", py_post_event, METH_VARARGS,
     "post_event(pool, timeout) -> OK | TIMEDOUT | OWNERDEAD: news for the progress loop from another thread"},
    {"take_posted", py_take_posted, METH_VARARGS,
     "take_posted(pool, records_off, rank_area_off, nrecords, max_ops, batch, out, idx) -> (n, err, at)"},
    {"buffer_info", py_buffer_info, METH_VARARGS, "buffer_info(obj, writable) -> (address, nbytes)"},
    {"sock_recv_into", _sn_sock_recv_into, METH_VARARGS,
     "sock_recv_into(fd, addr, n) -> bytes read (n, or fewer on EOF): GIL released once (shm/_native_net.c)"},
    {"sock_send_parts", _sn_sock_send_parts, METH_VARARGS,
     "sock_send_parts(fd, parts): sendmsg every part until all went out, GIL released once"},
    {"memcopy", py_memcopy, METH_VARARGS, "memcopy(dst, src, n): memmove, GIL released when large"},
    {"memcopy_nt", py_memcopy_nt, METH_VARARGS, "memcopy_nt(dst, src, n): copy with streaming stores"},
    {"copy_blocks", _sn_copy_blocks, METH_VARARGS,
     "copy_blocks(dst, dtab, dn, dext, src, stab, sn, sext, nbytes): a derived datatype's gather/scatter"},
    {"publish_launch", _sn_publish_launch, METH_VARARGS,
     "publish_launch(slots, max_ops, items, nbytes, cell, cell_pairs, token, delta, launch, exe, stream) -> "
     "(CUresult, published): a publishing graph's slots, cell and launch (shm/_native_device.c)"},
    {"fire_armed", _sn_fire_armed, METH_VARARGS,
     "fire_armed(table, nentries, records, first, n, slots, max_ops, device, launch) -> "
     "([fired], [claimed]): armed routes (shm/_native_armed.c)"},
    {"watch_words", _sn_watch_words, METH_VARARGS,
     "watch_words(pool, seen_events, abort, words, timeout_ns) -> WATCH_*: the loop's wait on GPU-published work"},
    {"set_lock_spin", py_set_lock_spin, METH_O, "set_lock_spin(ns): contended pool locks retry this long first"},
    {"bind_op", _sn_bind_op, METH_O, "bind_op(cls): the Op class unpack_ops makes (shm/_native_ops.c)"},
    {"unpack_ops", _sn_unpack_ops, METH_VARARGS,
     "unpack_ops(out, n, idx, ranks, t_fetch) -> [Op]: taken records as ops, as Op(index, fields, rank, t_fetch)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "shmproxy.shm._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    if (_sn_wake_init() < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    PyModule_AddIntConstant(m, "MUTEX_SIZE", (long)sizeof(pthread_mutex_t));
    PyModule_AddIntConstant(m, "COND_SIZE", (long)sizeof(pthread_cond_t));
    PyModule_AddIntConstant(m, "OK", RC_OK);
    PyModule_AddIntConstant(m, "OWNERDEAD", RC_OWNERDEAD);
    PyModule_AddIntConstant(m, "TIMEDOUT", RC_TIMEDOUT);
    PyModule_AddIntConstant(m, "BUSY", RC_BUSY);
    /* shm/_pool_layout.h, which shm/pool.py checks against its own layout */
    PyModule_AddObject(m, "POOL_LAYOUT", Py_BuildValue(
        "(iiiiiiiiiiiiiiiiii)", POOL_MUTEX_OFF, POOL_NEXT_OPS_OFF, POOL_NEXT_OPS_END_OFF, POOL_COND_OFF,
        POOL_PENDING_MASK_OFF, POOL_SLEEPING_OFF, POOL_EVENTS_OFF, POOL_FREE_OPS_OFF, RECORD_BYTES, REC_OWNER_OFF,
        REC_OPCOUNT_OFF, REC_MEM_OFF, SLOT_WORDS * 8, RANK_AREA_BYTES, RANK_WAKE_OFF,
        RANK_WAITING_OFF, RANK_COMPLETED_OFF, RANK_PENDING_OFF));
    PyModule_AddObject(m, "FAST_LAYOUT", Py_BuildValue(
        "(iiiiiiiiiiiiiiiiiiiii)", POOL_FAST_BYTES_OFF, FAST_CELLS, FAST_LINE, FRANK_RECV_DONE_OFF, PAIR_UNEXP_OFF,
        FRANK_DOORBELL_OFF, PAIR_F_WRITTEN_OFF, PAIR_SLOW_SENT_OFF, PAIR_F_TAKEN_OFF, PAIR_F_DRAINED_OFF,
        PAIR_FETCHED_SLOW_OFF, PAIR_HDR_BYTES, CELL_HDR_BYTES, CELL_TAG_OFF, RANK_RECV_POSTED_OFF, CAREA_WORD_OFF,
        CAREA_WAITERS_OFF, CRANK_DONE_OFF, CRANK_SLOW_COLLS_OFF, CSLOT_SEQ_OFF, CSLOT_SLOW_BEFORE_OFF));
    PyModule_AddObject(m, "PUBLISH_CELL", Py_BuildValue("(iii)", 0, 1, 2));   /* count, token, first pair */
    /* an armed entry's words (shm/_native_armed.c): state, the send's record, the receive's, the held
     * half, the graph's device, the out words' first, and how many in all */
    PyModule_AddObject(m, "ARMED_LAYOUT", Py_BuildValue("(iiiiiii)", 0, 1, 11, 21, 26, 35, 40));
    PyModule_AddIntConstant(m, "WATCH_TIMEOUT", 0);
    PyModule_AddIntConstant(m, "WATCH_POSTED", 1);
    PyModule_AddIntConstant(m, "WATCH_EVENTS", 2);
    PyModule_AddIntConstant(m, "WATCH_ABORT", 3);
    PyModule_AddIntConstant(m, "WATCH_WORD", 4);
    PyModule_AddIntConstant(m, "TAKE_NONE", 0);
    PyModule_AddIntConstant(m, "TAKE_BUSY", 1);
    PyModule_AddIntConstant(m, "TAKE_BLOCKED", 2);
    return m;
}
