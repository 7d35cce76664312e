/*
 * shm._poster's requests: RequestBase, shmproxy.Status, and the C end of Request.Wait and Request.Test.
 *
 * Requests: RequestBase is the C part of shmproxy.rank.request.Request (which subclasses it with
 * __slots__ = () and adds the methods), so a post allocates it and fills its fields directly. Its
 * Wait() and Test() are here too (see "Wait and Test" below), and so is shmproxy.Status.
 */
#include "_poster.h"

#include <sched.h>
#include <structmember.h>

/* ------------------------------------------------------------------ RequestBase */

static int Request_traverse(RequestObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->comm);
    Py_VISIT(self->keep);
    Py_VISIT(self->stage);
    Py_VISIT(self->error);
    Py_VISIT(self->status);
    Py_VISIT(self->extra);
    Py_VISIT(self->poster);
    return 0;
}

static int Request_clear(RequestObject *self) {
    Py_CLEAR(self->comm);
    Py_CLEAR(self->keep);
    Py_CLEAR(self->stage);
    Py_CLEAR(self->error);
    Py_CLEAR(self->status);
    Py_CLEAR(self->extra);
    Py_CLEAR(self->poster);
    return 0;
}

static void Request_dealloc(RequestObject *self) {
    PyObject_GC_UnTrack(self);
    if (self->weaklist) PyObject_ClearWeakRefs((PyObject *)self);
    Request_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* RequestBase(comm, slot, seq, kind, peer, tag, nbytes, keep, stage, user_addr, poster=None) */
static int Request_init(RequestObject *self, PyObject *args, PyObject *kwds) {
    PyObject *comm, *keep, *stage, *poster = NULL;
    int slot, kind, peer;
    long long seq, tag, nbytes, user_addr;
    if (!PyArg_ParseTuple(args, "OiLiiLLOOL|O", &comm, &slot, &seq, &kind, &peer, &tag, &nbytes, &keep,
                          &stage, &user_addr, &poster))
        return -1;
    if (poster == Py_None) poster = NULL;
    Py_XINCREF(poster); Py_XSETREF(self->poster, poster);
    Py_INCREF(comm); Py_XSETREF(self->comm, comm);
    Py_INCREF(keep); Py_XSETREF(self->keep, keep);    /* the user's array: alive until completion */
    Py_INCREF(stage); Py_XSETREF(self->stage, stage); /* (buf_id, MemfdBuffer) when staged, else None */
    Py_INCREF(Py_None); Py_XSETREF(self->error, Py_None);
    Py_INCREF(Py_None); Py_XSETREF(self->status, Py_None);
    Py_INCREF(Py_None); Py_XSETREF(self->extra, Py_None); /* collectives: (send stage, bytes out) */
    self->slot = slot; self->seq = seq; self->kind = kind; self->peer = peer;
    self->tag = tag; self->nbytes = nbytes; self->user_addr = user_addr; /* where a staged receive goes */
    self->done = 0;
    return 0;
}

#define RQ(name, type, field) {name, type, offsetof(RequestObject, field), 0, NULL}
static PyMemberDef Request_members[] = {
    RQ("_comm", T_OBJECT, comm), RQ("_keep", T_OBJECT, keep), RQ("_stage", T_OBJECT, stage),
    RQ("_error", T_OBJECT, error), RQ("status", T_OBJECT, status), RQ("_extra", T_OBJECT, extra),
    RQ("_seq", T_LONGLONG, seq), RQ("_tag", T_LONGLONG, tag), RQ("_nbytes", T_LONGLONG, nbytes),
    RQ("_user_addr", T_LONGLONG, user_addr), RQ("_slot", T_INT, slot), RQ("_kind", T_INT, kind),
    RQ("_peer", T_INT, peer), RQ("_done", T_BOOL, done),
    {NULL, 0, 0, 0, NULL},
};

/* ------------------------------------------------------------------ Status */

/* What a completed request got, like MPI_Status: exported as shmproxy.Status. In C so that a Wait
 * that completes in C builds it without a Python frame. */
typedef struct {
    PyObject_HEAD
    long long tag, nbytes;
    int source;
    char cancelled;   /* the request was cancelled before it matched (Request.Cancel) */
} StatusObject;

static PyObject *Status_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"source", "tag", "nbytes", "cancelled", NULL};
    int source, cancelled = 0; long long tag, nbytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iLL|p", kw, &source, &tag, &nbytes, &cancelled)) return NULL;
    StatusObject *st = (StatusObject *)type->tp_alloc(type, 0);
    if (!st) return NULL;
    st->source = source; st->tag = tag; st->nbytes = nbytes; st->cancelled = (char)cancelled;
    return (PyObject *)st;
}

static PyObject *Status_repr(StatusObject *st) {
    if (st->cancelled)
        return PyUnicode_FromFormat("Status(source=%d, tag=%lld, nbytes=%lld, cancelled=True)", st->source,
                                    st->tag, st->nbytes);
    return PyUnicode_FromFormat("Status(source=%d, tag=%lld, nbytes=%lld)", st->source, st->tag, st->nbytes);
}

static PyMemberDef Status_members[] = {
    {"source", T_INT, offsetof(StatusObject, source), 0, "rank the message came from"},
    {"tag", T_LONGLONG, offsetof(StatusObject, tag), 0, "tag of the message"},
    {"nbytes", T_LONGLONG, offsetof(StatusObject, nbytes), 0, "bytes received (receives) or sent"},
    {"cancelled", T_BOOL, offsetof(StatusObject, cancelled), READONLY, "cancelled before it matched"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject _sp_StatusType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmproxy.Status",
    .tp_basicsize = sizeof(StatusObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Status(source, tag, nbytes, cancelled=False): what a completed request got (like MPI_Status; "
              "nbytes in bytes).",
    .tp_new = Status_new,
    .tp_repr = (reprfunc)Status_repr,
    .tp_members = Status_members,
};

/* A Status for a message received without a request (the fast path's Recv). */
PyObject *_sp_new_status(int source, long long tag, long long nbytes) {
    StatusObject *st = (StatusObject *)_sp_StatusType.tp_alloc(&_sp_StatusType, 0);
    if (!st) return NULL;
    st->source = source;
    st->tag = tag;
    st->nbytes = nbytes;
    return (PyObject *)st;
}

/* ------------------------------------------------------------------ Wait and Test
 *
 * The common end of a request in C: its slot says complete with no error, and nothing was staged
 * (comm.alloc memory), so reaping it is reading the slot, returning the slot, and a Status. A
 * blocking Send or Recv thereby costs no Python frame between the post and the return (the Python
 * reap was a noticeable share of a small message's one-way time). The spin is only here. Everything else
 * (an error, a staged buffer to copy out, a timeout, the sleep on the futex, a Wait inside a group)
 * is Python's: Request._wait_slow and Request._test_slow, which own every message.
 *
 * Ordering: the progress process writes the slot's fields, then done_seq (shm/counters.py); the
 * acquire load of done_seq orders the reads of the fields after it.
 */

/* The request's poster when the C path may look at its slot; NULL sends the caller to Python. */
static PosterObject *wait_poster(RequestObject *r) {
    PosterObject *p = (PosterObject *)r->poster;
    if (!p || Py_TYPE(p) != &_sp_PosterType || !p->mapped || !p->slots || p->group_depth || r->slot < 0 ||
        r->slot >= p->nslots)
        return NULL;
    return p;
}

static int slot_done(PosterObject *p, RequestObject *r) {
    return __atomic_load_n(&p->slots[(size_t)r->slot * SLOT_WORDS + SLOT_DONE_SEQ], __ATOMIC_ACQUIRE) ==
           (uint64_t)r->seq;
}

/* Yield until the slot completes, for at most spin_s, or until an error or abort is flagged. The GIL
 * is released around each yield only (other threads run, as they did around Python's
 * os.sched_yield); a close from another thread detaches the poster, which ends the spin. Returns the
 * poster if still usable, else NULL. */
static PosterObject *spin(PosterObject *p, RequestObject *r) {
    long long end = mono_ns() + (long long)(p->spin_s * 1e9);   /* mono_ns: shm/_pool_lock.h */
    while (!slot_done(p, r) && !*p->err && !*p->abort) {
        Py_BEGIN_ALLOW_THREADS
        sched_yield();
        Py_END_ALLOW_THREADS
        if (!(p = wait_poster(r)) || mono_ns() >= end) break;
    }
    return p;
}

/* 1: reaped here; 0: Python must reap it (an error code, a staging buffer, a collective's copy-out);
 * -1: an exception (nothing changed). The slot must say complete. */
static int reap(PosterObject *p, RequestObject *r) {
    volatile uint64_t *w = &p->slots[(size_t)r->slot * SLOT_WORDS];
    uint64_t status = w[SLOT_STATUS];
    if ((status & 0xFFFF) || r->stage != Py_None || r->extra != Py_None) return 0;
    StatusObject *st = (StatusObject *)_sp_StatusType.tp_alloc(&_sp_StatusType, 0);
    if (!st) return -1;
    st->source = (int32_t)(uint32_t)(status >> 32);
    st->tag = (long long)w[SLOT_TAG];
    st->nbytes = (long long)w[SLOT_NBYTES];
    PyObject *key = PyLong_FromLong(r->slot);
    if (!key) { Py_DECREF(st); return -1; }
    /* the caller holds a reference to r, so dropping the pending dict's one cannot free it */
    if (PyDict_DelItem(p->pending, key) < 0 || PyList_Append(p->free_slots, key) < 0) {
        Py_DECREF(key); Py_DECREF(st);
        return -1;
    }
    Py_DECREF(key);
    r->done = 1;
    Py_SETREF(r->status, (PyObject *)st);
    Py_INCREF(Py_None); Py_SETREF(r->keep, Py_None);
    return 1;
}

static PyObject *Request_Wait(RequestObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *timeout = Py_None;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw > 1 || (nkw && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "timeout"))) {
        PyErr_SetString(PyExc_TypeError, "Wait(timeout=None)");
        return NULL;
    }
    if (nargs + nkw == 1) timeout = args[0];
    if (!self->done) {
        PosterObject *p = wait_poster(self);
        int r = 0;
        if (p && !slot_done(p, self) &&
            self->nbytes <= (self->kind == KIND_COLL ? p->spin_max_coll : p->spin_max))
            p = spin(p, self);
        if (p && slot_done(p, self) && (r = reap(p, self)) < 0) return NULL;
        if (!r) return PyObject_CallMethod((PyObject *)self, "_wait_slow", "O", timeout);
    }
    if (self->error != Py_None) return PyObject_CallMethod((PyObject *)self, "_wait_slow", "O", timeout);
    Py_INCREF(self->status);
    return self->status;
}

static PyObject *Request_Test(RequestObject *self, PyObject *unused) {
    if (!self->done) {
        PosterObject *p = wait_poster(self);
        if (!p) return PyObject_CallMethod((PyObject *)self, "_test_slow", NULL);
        if (!slot_done(p, self)) {
            if (*p->err || *p->abort) return PyObject_CallMethod((PyObject *)self, "_test_slow", NULL);
            Py_RETURN_FALSE;
        }
        int r = reap(p, self);
        if (r < 0) return NULL;
        if (!r) return PyObject_CallMethod((PyObject *)self, "_test_slow", NULL);
    }
    if (self->error != Py_None) return PyObject_CallMethod((PyObject *)self, "_test_slow", NULL);
    Py_RETURN_TRUE;
}

static PyMethodDef Request_methods[] = {
    {"Wait", (PyCFunction)(void (*)(void))Request_Wait, METH_FASTCALL | METH_KEYWORDS,
     "Wait(timeout=None) -> Status\n\nBlock until complete; returns the Status (source, tag, nbytes).\n"
     "Raises Timeout after ``timeout`` seconds (default SHMPROXY_TIMEOUT) naming what is pending,\n"
     "PeerDiedError if a peer or the progress process died, or the operation's own error."},
    {"Test", (PyCFunction)Request_Test, METH_NOARGS,
     "Test() -> bool\n\nTrue once complete (raises the operation's error then). Never blocks."},
    {NULL, NULL, 0, NULL},
};

/* Defined after Wait and Test, its methods. */
PyTypeObject _sp_RequestType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmproxy.shm._poster.RequestBase",
    .tp_basicsize = sizeof(RequestObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Fields of a request; shmproxy.rank.request.Request adds the behaviour.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Request_init,
    .tp_dealloc = (destructor)Request_dealloc,
    .tp_traverse = (traverseproc)Request_traverse,
    .tp_clear = (inquiry)Request_clear,
    .tp_weaklistoffset = offsetof(RequestObject, weaklist),
    .tp_methods = Request_methods,
    .tp_members = Request_members,
};
