/*
 * shm._wire: a collective's frames between two nodes, moved by C threads that never take the GIL.
 *
 *   w = Wire(peer, nsocks, pool, part_min, max_total, direct_max=0)
 *                                  one link's collective sockets (transports/net_wire.py, Link); pool:
 *                                  the ops pool's address, whose EVENTS word wakes the loop (0: none);
 *                                  direct_max: see "Direct writes" below
 *   w.attach(index, fd)            socket `index` is connected: the wire owns the fd and starts its
 *                                  reader and writer threads
 *   w.send(key, addr, n, token) -> bool
 *                                  send n bytes at addr as the frame of `key`; True: it went now (no
 *                                  token will come)
 *   w.recv(key, addr, n, token[, op, code, a[, then, then_key, then_token]]) -> bool
 *                                  land the frame of `key` at addr (op >= 0: fold, addr = a op frame);
 *                                  True: it had arrived, done now. `then` (a Wire, this one or
 *                                  another link's): once every byte is in, that wire sends the n
 *                                  bytes at addr as the frame of then_key, token then_token, from
 *                                  the thread that finished the receive (a ring's next step, without
 *                                  the loop between)
 *   w.poll() -> ([token, ...], lost or None)
 *                                  sends and receives finished since the last call; why the link
 *                                  broke, once
 *   w.cancel() -> int              forget every posted receive (the communicator failed)
 *   w.close(bound_s)               goodbye, drain and join, each wait bounded; idempotent
 *   w.describe() -> dict           for the dump
 *
 * This file is the Python type; the threads and the frame protocol are shm/_wire_threads.c, the
 * state they share shm/_wire.h.
 *
 * Why: a collective between nodes moves every chunk as a frame each way. With Python reader and
 * writer threads, each frame cost them one or two GIL acquisitions, each queued behind the loop's
 * Python (up to the switch interval), so a link's second socket made collectives slower, not faster
 * (docs/decisions.md, "A collective's chunks take one socket"). These threads read straight into
 * the receive's registered memory and write straight from the send's, and hand the loop only a
 * token: the loop's cost per chunk no longer grows with the sockets that carry it.
 *
 * Frames: net_wire's 32-byte header, little-endian (type COLL, flags 0, length = key + part bytes,
 * a = key length, b = the part's offset, c = the frame's size), the key, the part. A send of n bytes
 * goes out as up to nsocks parts of at least part_min bytes, one per socket (the first socket
 * rotating), so one chunk crosses on several streams at once; a receive is done when its parts
 * cover it. Keys are unique per schedule entry, so parts need no order.
 *
 * Lock protocol: one mutex (`mu`) guards the queues, the posted receives, the stash, the finished
 * tokens and the state; no socket call and no copy runs under it. A reader writing into a receive
 * holds one `inflight` count on it, and a receive is finished (its token queued, the entry freed)
 * only by whoever drops inflight to 0 with every byte in: the reader of its last part, or the
 * loop's recv() copying in what the stash held. A frame whose receive is not posted yet lands in
 * malloc'd parts (the stash entry, the same struct); recv() turns the entry into the posted receive
 * in place, so a reader holding it finds it posted and copies its part over itself.
 *
 * Forwarding (recv's `then`): the thread that finishes a receive (its last part's reader, the
 * copier, or recv() itself) queues the chained send on the other wire after dropping this one's
 * mutex, so no two wires' mutexes are ever held at once. The chain holds a reference on the other
 * wire, taken under the GIL in recv(); threads cannot drop it, so a fired or dropped chain waits on
 * the `spent` list until poll(), cancel() or dealloc (all under the GIL) release it.
 *
 * Direct writes: a frame of one part up to direct_max bytes whose socket has nothing queued is
 * written by its sender (the loop's send(), or the thread that fires a chain) with MSG_DONTWAIT,
 * the socket claimed meanwhile (`writing`: its writer waits); what does not fit in the socket's
 * buffer goes to the head of its queue, the writer resuming at the byte it stopped at. A small
 * frame so crosses without waking the writer thread, and a send that went whole is done at once.
 * Likewise recv() lands a frame of at most direct_max bytes that arrived whole before it itself,
 * rather than handing it to the copier.
 *
 * Waking the loop: a finished token bumps the pool's EVENTS word and, if the loop may sleep, signals
 * its condvar under the pool mutex (shm/_native.c, post_event: the same protocol, without Python).
 *
 * Closing (net_wire's protocol): each writer sends what is queued, then BYE, then shuts its write
 * half down; each reader reads until EOF. An EOF without a BYE before it, or an error, while not
 * closing, is a lost link (poll() says why). The joins are bounded; past the bound the socket is
 * shut down both ways, which ends any blocked call at once.
 */
#define _GNU_SOURCE
#include "_wire.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ the object */

static void wire_close(Wire *w, double bound);
static PyTypeObject WireType;

static void drop_chain(Chain *c) {   /* GIL held */
    if (!c) return;
    Py_XDECREF(c->ref);
    free(c);
}

/* Drop the references of the spent chains (GIL held; takes mu). */
static void release_spent(Wire *w) {
    pthread_mutex_lock(&w->mu);
    Chain *c = w->spent;
    w->spent = NULL;
    pthread_mutex_unlock(&w->mu);
    while (c) {
        Chain *n = c->next;
        Py_XDECREF(c->ref);
        free(c);
        c = n;
    }
}

static int Wire_init(Wire *w, PyObject *args, PyObject *kw) {
    int peer, nsocks;
    unsigned long long pool, part_min, max_total, direct_max = 0;
    if (!PyArg_ParseTuple(args, "iiKKK|K", &peer, &nsocks, &pool, &part_min, &max_total, &direct_max))
        return -1;
    if (nsocks < 1 || nsocks > MAX_SOCKS) {
        PyErr_Format(PyExc_ValueError, "Wire: %d sockets (1 to %d)", nsocks, MAX_SOCKS);
        return -1;
    }
    if (max_total > (1ull << 31)) {
        PyErr_Format(PyExc_ValueError, "Wire: frames of up to %llu bytes (at most 2 GiB)", max_total);
        return -1;
    }
    if (w->nsocks) {
        PyErr_SetString(PyExc_RuntimeError, "Wire: initialised twice");
        return -1;
    }
    pthread_mutex_init(&w->mu, NULL);
    w->peer = peer;
    w->nsocks = nsocks;
    w->pool = (char *)(uintptr_t)pool;
    w->part_min = part_min ? part_min : 1;
    w->max_total = max_total;
    w->direct_max = direct_max;
    for (int i = 0; i < nsocks; i++) {
        w->s[i].w = w;
        w->s[i].index = i;
        w->s[i].fd = -1;
        pthread_condattr_t a;
        pthread_condattr_init(&a);
        pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
        pthread_cond_init(&w->s[i].cv, &a);
        pthread_condattr_destroy(&a);
    }
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&w->copier_cv, &a);
    pthread_condattr_destroy(&a);
    int r = pthread_create(&w->copier, NULL, _sw_copier_main, w);
    if (r) {
        errno = r;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    w->copier_started = 1;
    return 0;
}

static void Wire_dealloc(Wire *w) {
    if (w->nsocks) {
        wire_close(w, 1.0);
        for (int i = 0; i < w->nsocks; i++) {
            for (Out *o = w->s[i].head; o;) {
                Out *n = o->next;
                if (o->send && --o->send->left == 0) free(o->send);
                free(o);
                o = n;
            }
            pthread_cond_destroy(&w->s[i].cv);
        }
        pthread_cond_destroy(&w->copier_cv);
        Recv *lists[2] = {w->posted, w->stash};
        for (int k = 0; k < 2; k++)
            for (Recv *r = lists[k]; r;) {
                Recv *n = r->next;
                _sw_free_parts(r->parts);
                _sw_free_recv(w, r);
                r = n;
            }
        release_spent(w);
        free(w->done);
        pthread_mutex_destroy(&w->mu);
    }
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *Wire_attach(Wire *w, PyObject *args) {
    int index, fd;
    if (!PyArg_ParseTuple(args, "ii", &index, &fd)) return NULL;
    if (index < 0 || index >= w->nsocks || fd < 0) {
        PyErr_Format(PyExc_ValueError, "Wire.attach: socket %d of %d, fd %d", index, w->nsocks, fd);
        return NULL;
    }
    Sock *s = &w->s[index];
    pthread_mutex_lock(&w->mu);
    int taken = s->fd >= 0 || w->closing;
    if (!taken) s->fd = fd;
    pthread_mutex_unlock(&w->mu);
    if (taken) {
        PyErr_Format(PyExc_ValueError, "Wire.attach: socket %d attached twice or after close", index);
        return NULL;
    }
    int r = pthread_create(&s->writer, NULL, _sw_writer_main, s);
    if (r == 0) {
        r = pthread_create(&s->reader, NULL, _sw_reader_main, s);
        if (r) {   /* no reader: stop the writer we started, and give the fd back */
            pthread_mutex_lock(&w->mu);
            _sw_set_lost(w, "cannot start a reader thread for socket %d%s", index, "");
            pthread_cond_broadcast(&s->cv);
            pthread_mutex_unlock(&w->mu);
            shutdown(fd, SHUT_RDWR);
            pthread_join(s->writer, NULL);
        }
    }
    if (r) {
        pthread_mutex_lock(&w->mu);
        s->fd = -1;
        pthread_mutex_unlock(&w->mu);
        close(fd);   /* it was ours since the call */
        errno = r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    s->started = 1;
    Py_RETURN_NONE;
}

static int parse_entry(PyObject *args, const char **key, Py_ssize_t *keylen, unsigned long long *addr,
                       unsigned long long *n, long long *token) {
    if (!PyArg_ParseTuple(args, "y#KKL", key, keylen, addr, n, token)) return -1;
    if (*keylen <= 0 || *keylen > MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "a key of %zd bytes (1 to %d)", *keylen, MAX_KEY);
        return -1;
    }
    if (*n && !*addr) {
        PyErr_SetString(PyExc_ValueError, "a null address");
        return -1;
    }
    return 0;
}

static PyObject *Wire_send(Wire *w, PyObject *args) {
    const char *key;
    Py_ssize_t keylen;
    unsigned long long addr, n;
    long long token;
    if (parse_entry(args, &key, &keylen, &addr, &n, &token) < 0) return NULL;
    /* with the GIL: nothing here blocks (a direct write is MSG_DONTWAIT, of at most direct_max), and
     * giving the GIL away for a few microseconds cost the loop a turn behind the Python threads */
    int rc = _sw_queue_send(w, key, (uint32_t)keylen, (const char *)(uintptr_t)addr, n, token, 1);
    if (rc == -E2BIG)
        return PyErr_Format(PyExc_ValueError, "a frame of %llu bytes (at most %llu)", n,
                            (unsigned long long)w->max_total);
    if (rc == -EPIPE) {
        PyErr_SetString(PyExc_RuntimeError, "Wire.send after close");
        return NULL;
    }
    if (rc == -ENOMEM) return PyErr_NoMemory();
    return PyBool_FromLong(rc == 1);   /* (a failed direct write is the link's loss, told by poll) */
}

static PyObject *Wire_recv(Wire *w, PyObject *args) {
    const char *key;
    Py_ssize_t keylen;
    unsigned long long addr, n, a = 0;
    long long token;
    int op = -1, code = 0;
    PyObject *then = Py_None;
    const char *then_key = NULL;
    Py_ssize_t then_keylen = 0;
    long long then_token = 0;
    if (!PyArg_ParseTuple(args, "y#KKL|iiKOy#L", &key, &keylen, &addr, &n, &token, &op, &code, &a, &then,
                          &then_key, &then_keylen, &then_token))
        return NULL;

    if (op >= 0) {
        if (!_sw_can_fold(op, code, n) || !a)
            return PyErr_Format(PyExc_ValueError, "Wire.recv: cannot fold op %d on dtype code %d over %llu B", op,
                                code, n);
    }
    if (keylen <= 0 || keylen > MAX_KEY)
        return PyErr_Format(PyExc_ValueError, "a key of %zd bytes (1 to %d)", keylen, MAX_KEY);
    if (n && !addr) return PyErr_Format(PyExc_ValueError, "a null address");
    Chain *chain = NULL;
    if (then != Py_None) {
        if (!PyObject_TypeCheck(then, &WireType))
            return PyErr_Format(PyExc_TypeError, "Wire.recv: then must be a Wire, not %s", Py_TYPE(then)->tp_name);
        if (!then_key || then_keylen <= 0 || then_keylen > MAX_KEY)
            return PyErr_Format(PyExc_ValueError, "a forwarded key of %zd bytes (1 to %d)", then_keylen, MAX_KEY);
        if (n > ((Wire *)then)->max_total)
            return PyErr_Format(PyExc_ValueError, "a forwarded frame of %llu bytes (at most %llu)", n,
                                (unsigned long long)((Wire *)then)->max_total);
        chain = calloc(1, sizeof *chain);
        if (!chain) return PyErr_NoMemory();
        chain->to = (Wire *)then;
        if (then != (PyObject *)w) {   /* no reference on ourselves: it would keep us alive */
            Py_INCREF(then);
            chain->ref = then;
        }
        chain->keylen = (uint32_t)then_keylen;
        memcpy(chain->key, then_key, (size_t)then_keylen);
        chain->token = then_token;
    }
    pthread_mutex_lock(&w->mu);
    if (_sw_find(w->posted, key, (uint32_t)keylen)) {
        pthread_mutex_unlock(&w->mu);
        drop_chain(chain);
        return PyErr_Format(PyExc_ValueError, "a receive for key %.*s is posted already", (int)keylen, key);
    }
    Recv *e = _sw_find(w->stash, key, (uint32_t)keylen);
    if (e && e->nbytes != n) {
        uint64_t had = e->nbytes;
        pthread_mutex_unlock(&w->mu);
        drop_chain(chain);
        return PyErr_Format(PyExc_ValueError, "%llu B arrived for a %llu B receive",
                            (unsigned long long)had, n);
    }
    if (!e) {
        e = calloc(1, sizeof *e);
        if (!e) {
            pthread_mutex_unlock(&w->mu);
            drop_chain(chain);
            return PyErr_NoMemory();
        }
        e->keylen = (uint32_t)keylen;
        memcpy(e->key, key, (size_t)keylen);
        e->nbytes = n;
    } else {
        _sw_unlink_recv(&w->stash, e);
    }
    e->posted = 1;
    e->addr = (char *)(uintptr_t)addr;
    e->token = token;
    e->fold = op >= 0;
    e->op = op;
    e->code = code;
    e->a = (const char *)(uintptr_t)a;
    e->then = chain;
    e->next = w->posted;
    w->posted = e;
    int finished = 0;
    Chain *fire = NULL;
    if (e->parts && e->inflight == 0 && e->arrived && e->got == n && w->direct_max && n <= w->direct_max) {
        /* a small frame all here: landed now, by us (a hand-off to the copier costs more than it) */
        _sw_unlink_recv(&w->posted, e);
        w->direct_in++;
        w->chained += chain != NULL;
        pthread_mutex_unlock(&w->mu);
        for (Part *p = e->parts; p; p = p->next) _sw_land(e, p->off, p->data, p->len);   /* (GIL: as send) */
        if (chain) {
            chain->addr = e->addr;
            chain->n = n;
            _sw_fire(w, chain);
        }
        _sw_free_parts(e->parts);
        free(e);
        Py_RETURN_TRUE;
    }
    if (e->parts) {   /* what arrived early: the copier lands it, holding one inflight count */
        e->got = 0;
        e->inflight++;
        e->job_next = NULL;
        if (w->jobs_tail) w->jobs_tail->job_next = e;
        else w->jobs = e;
        w->jobs_tail = e;
        pthread_cond_signal(&w->copier_cv);
    } else {          /* nothing yet, or an empty frame that is all there (done now: no token) */
        finished = _sw_finish(w, e, 0, &fire);
    }
    pthread_mutex_unlock(&w->mu);   /* (unfinished, the chain is the receive's: whoever finishes it fires it) */
    if (fire) _sw_fire(w, fire);
    return PyBool_FromLong(finished);
}

static PyObject *Wire_poll(Wire *w, PyObject *unused) {
    if (__atomic_load_n(&w->spent, __ATOMIC_RELAXED)) release_spent(w);   /* (one spent meanwhile: next poll) */
    pthread_mutex_lock(&w->mu);
    PyObject *list = PyList_New((Py_ssize_t)w->ndone);
    if (!list) {
        pthread_mutex_unlock(&w->mu);
        return NULL;
    }
    for (size_t i = 0; i < w->ndone; i++) {
        PyObject *t = PyLong_FromLongLong(w->done[i]);
        if (!t) {
            pthread_mutex_unlock(&w->mu);
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    w->ndone = 0;
    PyObject *lost = Py_None;
    char text[sizeof w->lost];
    if (w->lost[0] && !w->lost_told) {
        w->lost_told = 1;
        memcpy(text, w->lost, sizeof text);
        lost = NULL;
    }
    pthread_mutex_unlock(&w->mu);
    if (!lost) {
        lost = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
        if (!lost) {
            Py_DECREF(list);
            return NULL;
        }
        return Py_BuildValue("(NN)", list, lost);
    }
    return Py_BuildValue("(NO)", list, Py_None);
}

static PyObject *Wire_cancel(Wire *w, PyObject *unused) {
    long n = 0;
    pthread_mutex_lock(&w->mu);
    Recv *r = w->posted;
    w->posted = NULL;
    while (r) {
        Recv *next = r->next;
        r->cancelled = 1;
        r->next = NULL;
        if (r->inflight == 0) _sw_free_recv(w, r);   /* else its reader frees it (_sw_settle) */
        r = next;
        n++;
    }
    pthread_mutex_unlock(&w->mu);
    release_spent(w);
    return PyLong_FromLong(n);
}

/* Join `t` by `deadline` (CLOCK_REALTIME, pthread_timedjoin_np's clock); past it, shut its socket
 * down both ways, which ends its blocked call at once, and join. */
static void join_by(pthread_t t, int fd, const struct timespec *deadline) {
    if (pthread_timedjoin_np(t, NULL, deadline)) {
        shutdown(fd, SHUT_RDWR);
        pthread_join(t, NULL);
    }
}

/* Writers first (each sends what is queued and BYE), then readers (each until the peer's EOF), all
 * by one deadline `bound` seconds away. */
static void wire_close(Wire *w, double bound) {
    pthread_mutex_lock(&w->mu);
    int was = w->closed;
    w->closing = w->closed = 1;
    for (int i = 0; i < w->nsocks; i++) pthread_cond_broadcast(&w->s[i].cv);
    pthread_cond_broadcast(&w->copier_cv);
    pthread_mutex_unlock(&w->mu);
    if (was) return;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += (time_t)bound;
    deadline.tv_nsec += (long)((bound - (double)(time_t)bound) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    for (int i = 0; i < w->nsocks; i++)
        if (w->s[i].started) join_by(w->s[i].writer, w->s[i].fd, &deadline);
    for (int i = 0; i < w->nsocks; i++) {
        Sock *s = &w->s[i];
        if (!s->started) continue;
        join_by(s->reader, s->fd, &deadline);
        close(s->fd);
        s->started = 0;
    }
    if (w->copier_started) {   /* it only copies: it ends after its queue, whatever the sockets do */
        pthread_join(w->copier, NULL);
        w->copier_started = 0;
    }
}

static PyObject *Wire_close(Wire *w, PyObject *args) {
    double bound = 2.0;
    if (!PyArg_ParseTuple(args, "|d", &bound)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    wire_close(w, bound < 0 ? 0 : bound);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Wire_describe(Wire *w, PyObject *unused) {
    pthread_mutex_lock(&w->mu);
    int attached = 0, queued = 0, posted = 0, stashed = 0;
    for (int i = 0; i < w->nsocks; i++) {
        attached += w->s[i].fd >= 0;
        queued += w->s[i].queued;
    }
    for (Recv *r = w->posted; r; r = r->next) posted++;
    unsigned long long early = 0;   /* bytes of the early frames read whole so far */
    for (Recv *r = w->stash; r; r = r->next) {
        stashed++;
        early += r->inflight ? 0 : r->got;
    }
    unsigned long long in = w->bytes_in, out = w->bytes_out, chained = w->chained;
    unsigned long long direct_out = w->direct_out, direct_in = w->direct_in;
    char lost[sizeof w->lost];
    memcpy(lost, w->lost, sizeof lost);
    const char *state = lost[0] ? "lost" : (w->closing ? "closed" : (attached == w->nsocks ? "up" : "connecting"));
    pthread_mutex_unlock(&w->mu);
    return Py_BuildValue("{s:i,s:i,s:K,s:K,s:i,s:i,s:i,s:K,s:K,s:K,s:K,s:s,s:s}", "sockets", attached, "of",
                         w->nsocks, "bytes_out", out, "bytes_in", in, "queued", queued,
                         "receives_posted", posted, "frames_early", stashed, "bytes_early", early,
                         "forwarded", chained, "written_direct", direct_out,
                         "landed_by_recv", direct_in, "state", state, "lost", lost);
}

static PyMethodDef Wire_methods[] = {
    {"attach", (PyCFunction)Wire_attach, METH_VARARGS, "attach(index, fd): the wire owns fd from now"},
    {"send", (PyCFunction)Wire_send, METH_VARARGS, "send(key, addr, nbytes, token)"},
    {"recv", (PyCFunction)Wire_recv, METH_VARARGS,
     "recv(key, addr, nbytes, token, op=-1, code=0, a=0, then=None, then_key=b'', then_token=0) -> done now; "
     "op >= 0: land a (op) the frame; then: that wire sends what landed once it is all in"},
    {"poll", (PyCFunction)Wire_poll, METH_NOARGS, "poll() -> ([token, ...], lost reason or None)"},
    {"cancel", (PyCFunction)Wire_cancel, METH_NOARGS, "cancel() -> receives forgotten"},
    {"close", (PyCFunction)Wire_close, METH_VARARGS, "close(bound_s=2.0): goodbye, drain, join"},
    {"describe", (PyCFunction)Wire_describe, METH_NOARGS, "describe() -> dict"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WireType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmproxy.shm._wire.Wire",
    .tp_basicsize = sizeof(Wire),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A link's collective sockets, driven by C threads (shm/_wire.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Wire_init,
    .tp_dealloc = (destructor)Wire_dealloc,
    .tp_methods = Wire_methods,
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "shmproxy.shm._wire", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__wire(void) {
    _sw_kernels_init();
    if (PyType_Ready(&WireType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&WireType);
    if (PyModule_AddObject(m, "Wire", (PyObject *)&WireType) < 0) {
        Py_DECREF(&WireType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "MAX_KEY", MAX_KEY);
    PyModule_AddIntConstant(m, "MAX_SOCKS", MAX_SOCKS);
    return m;
}
