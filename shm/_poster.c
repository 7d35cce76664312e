/*
 * shm._poster: the rank's post path in C.
 *
 * Why compiled: a point-to-point post written in Python costs 4-6 us on the 2-core development VM
 * (argument checks, buffer lookup, struct packing, the Request object, the splice), against a
 * budget of 3 us for a single post and 1 us per op inside comm.group() (BENCHMARKS.md). Here it
 * is one call.
 *
 * Division of labour with proxy/rank/comm.py:
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
 * Record layout: shm/pool.py RECORD (little-endian, packed, 128 bytes); tests/test_units.py checks
 * that a record written here unpacks there. Lock protocol: shm/_pool_lock.h.
 *
 * Arrays: the Python buffer protocol costs ~300 ns per numpy array here (numpy builds a format
 * string), a third of the budget, so the post reads the array's header directly: the leading fields
 * of numpy's PyArrayObject_fields and PyArray_Descr, unchanged from numpy 1.7 through 2.x. The
 * Poster checks that reading against probe arrays whose facts Python supplies; if it ever disagrees
 * (a future numpy), the fast path stays off (Poster.fast is False) and every post takes Python's.
 *
 * Requests: RequestBase is the C part of shmproxy.rank.request.Request (which subclasses it with
 * __slots__ = () and adds the methods), so a post allocates it and fills its fields directly. Its
 * Wait() and Test() are here too (see "Wait and Test" below), and so is shmproxy.Status.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>

#include "_pool_layout.h"
#include "_pool_lock.h"

#define KIND_SEND 1  /* proxy/core/ops.py; checked at import by proxy/rank/comm.py */
#define KIND_RECV 2
#define KIND_COLL 3
#define FLAG_IN_PLACE 1      /* proxy/core/ops.py */
#define FLAG_NO_RECV 2
enum { COLL_BARRIER = 1, COLL_BCAST, COLL_REDUCE, COLL_ALLREDUCE, COLL_ALLGATHER, COLL_REDUCE_SCATTER_BLOCK,
       COLL_ALLTOALL };  /* proxy/coll/sched.py Coll */
enum { REDOP_SUM = 1, REDOP_PROD, REDOP_MIN, REDOP_MAX, REDOP_AVG };  /* proxy/coll/sched.py ReduceOp */
#define CODE_BOOL 1          /* proxy/core/ops.py dtype codes: bool, then integers, then float16.. */
#define CODE_FIRST_FLOAT 10

/* ------------------------------------------------------------------ RequestBase */

typedef struct {
    PyObject_HEAD
    PyObject *comm, *keep, *stage, *error, *status, *extra;
    PyObject *poster;  /* the Poster that owns the slot (Wait/Test read it), or NULL */
    PyObject *weaklist;
    long long seq, tag, nbytes, user_addr;
    int slot, kind, peer;
    char done;
} RequestObject;

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

static PyTypeObject RequestType = {
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
    .tp_members = Request_members,
};

/* ------------------------------------------------------------------ Status */

/* What a completed request got, like MPI_Status: exported as shmproxy.Status. In C so that a Wait
 * that completes in C builds it without a Python frame. */
typedef struct {
    PyObject_HEAD
    long long tag, nbytes;
    int source;
} StatusObject;

static PyObject *Status_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"source", "tag", "nbytes", NULL};
    int source; long long tag, nbytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iLL", kw, &source, &tag, &nbytes)) return NULL;
    StatusObject *st = (StatusObject *)type->tp_alloc(type, 0);
    if (!st) return NULL;
    st->source = source; st->tag = tag; st->nbytes = nbytes;
    return (PyObject *)st;
}

static PyObject *Status_repr(StatusObject *st) {
    return PyUnicode_FromFormat("Status(source=%d, tag=%lld, nbytes=%lld)", st->source, st->tag, st->nbytes);
}

static PyMemberDef Status_members[] = {
    {"source", T_INT, offsetof(StatusObject, source), 0, "rank the message came from"},
    {"tag", T_LONGLONG, offsetof(StatusObject, tag), 0, "tag of the message"},
    {"nbytes", T_LONGLONG, offsetof(StatusObject, nbytes), 0, "bytes received (receives) or sent"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject StatusType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmproxy.Status",
    .tp_basicsize = sizeof(StatusObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Status(source, tag, nbytes): what a completed request got (like MPI_Status; nbytes in bytes).",
    .tp_new = Status_new,
    .tp_repr = (reprfunc)Status_repr,
    .tp_members = Status_members,
};

/* ------------------------------------------------------------------ Poster */

typedef struct { uintptr_t start, end; int32_t bid; } Range;

/* The stable leading fields of numpy's PyArrayObject_fields and PyArray_Descr (see the header). */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} ArrayHead;
typedef struct {
    PyObject_HEAD
    PyTypeObject *typeobj;
    char kind, type, byteorder, flags;
    int type_num;
} DescrHead;
#define NPY_C_CONTIGUOUS 0x0001
#define NPY_WRITEABLE 0x0400

typedef struct {
    PyObject_HEAD
    /* pool addresses (the Comm keeps the mapping alive for the Poster's lifetime) */
    PostedChain chain;   /* the records, the posted chain, its mutex, the hand-off slots (_pool_lock.h) */
    volatile uint64_t *err, *abort, *posted;
    int local_rank, size, rank;  /* rank: the communicator's, set by proxy/rank/comm.py (a Reduce's root) */
    double timeout;
    /* post state shared with the Python path */
    long long seq, opcount, coll_seq;
    int group_depth, usable;
    int32_t chain_first, chain_last;
    /* Python objects owned by the Comm */
    PyTypeObject *ndarray, *request_type;
    PyObject *comm, *free_slots, *free_records, *pending, *on_splice_error;
    PyObject *send_fallback, *recv_fallback;  /* isend()/irecv() hand everything else to these */
    PyObject *allreduce_fallback;             /* and iallreduce() to this */
    PyObject *barrier_fallback;               /* and ibarrier() to this */
    PyObject *coll_fallback[COLL_ALLTOALL + 1]; /* ibcast() .. ialltoall() to these, by Coll */
    PyObject *in_place;                       /* shmproxy.IN_PLACE */
    /* registered ranges (sorted by start); dtype char -> code and itemsize (0: unsupported) */
    Range *ranges;
    Py_ssize_t nranges;
    uint8_t dtype_code[256];
    uint8_t dtype_size[256];
    /* completion slots (shm/pool.py SLOT_*), and how a Wait spins before Python sleeps (set_wait) */
    volatile uint64_t *slots;
    long nslots;
    double spin_s;
    long long spin_max, spin_max_coll;
    char fast;  /* the array header reading was verified against the probes */
    char mapped;  /* the pool addresses are valid: cleared by detach() before the pool is unmapped */
} PosterObject;

static int Poster_traverse(PosterObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->ndarray);
    Py_VISIT(self->request_type);
    Py_VISIT(self->comm);
    Py_VISIT(self->free_slots);
    Py_VISIT(self->free_records);
    Py_VISIT(self->pending);
    Py_VISIT(self->on_splice_error);
    Py_VISIT(self->send_fallback);
    Py_VISIT(self->recv_fallback);
    Py_VISIT(self->allreduce_fallback);
    Py_VISIT(self->barrier_fallback);
    for (int i = 0; i <= COLL_ALLTOALL; i++) Py_VISIT(self->coll_fallback[i]);
    Py_VISIT(self->in_place);
    return 0;
}

static int Poster_clear(PosterObject *self) {
    self->usable = 0;
    Py_CLEAR(self->ndarray);
    Py_CLEAR(self->request_type);
    Py_CLEAR(self->comm);
    Py_CLEAR(self->free_slots);
    Py_CLEAR(self->free_records);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->on_splice_error);
    Py_CLEAR(self->send_fallback);
    Py_CLEAR(self->recv_fallback);
    Py_CLEAR(self->allreduce_fallback);
    Py_CLEAR(self->barrier_fallback);
    for (int i = 0; i <= COLL_ALLTOALL; i++) Py_CLEAR(self->coll_fallback[i]);
    Py_CLEAR(self->in_place);
    return 0;
}

static void Poster_dealloc(PosterObject *self) {
    PyObject_GC_UnTrack(self);
    Poster_clear(self);
    PyMem_Free(self->ranges);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Read an array's address, dtype code, bytes and element count; 0 when the fast path cannot take it. */
static int read_array(PosterObject *self, PyObject *obj, int writable, uintptr_t *addr, int *code,
                      long long *nbytes, long long *count) {
    ArrayHead *a = (ArrayHead *)obj;
    if (!(a->flags & NPY_C_CONTIGUOUS) || (writable && !(a->flags & NPY_WRITEABLE))) return 0;
    DescrHead *d = (DescrHead *)a->descr;
    if (d->byteorder == '>' || (d->byteorder == '<' && !PY_LITTLE_ENDIAN)) return 0;
    unsigned char t = (unsigned char)d->type;
    if (!self->dtype_code[t]) return 0;
    long long n = 1;
    for (int i = 0; i < a->nd; i++) n *= a->dimensions[i];
    *addr = (uintptr_t)a->data;
    *code = self->dtype_code[t];
    *count = n;
    *nbytes = n * self->dtype_size[t];
    return 1;
}

/* The probes: (array, address, nbytes, dtype char, writable, C-contiguous) as Python sees them. */
static int verify_layout(PosterObject *self, PyObject *probes) {
    if (!PyList_Check(probes)) return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(probes); i++) {
        PyObject *arr; unsigned long long want_addr; long long want_nbytes; int want_char, want_w, want_c;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(probes, i), "OKLCpp", &arr, &want_addr, &want_nbytes,
                              &want_char, &want_w, &want_c)) {
            PyErr_Clear();
            return 0;
        }
        if (Py_TYPE(arr) != self->ndarray) return 0;
        ArrayHead *a = (ArrayHead *)arr;
        DescrHead *d = (DescrHead *)a->descr;
        if ((unsigned char)d->type != (unsigned)want_char || !!(a->flags & NPY_WRITEABLE) != want_w ||
            !!(a->flags & NPY_C_CONTIGUOUS) != want_c)
            return 0;
        uintptr_t addr; int code; long long nbytes, count;
        if (want_c && (!read_array(self, arr, 0, &addr, &code, &nbytes, &count) ||
                       addr != (uintptr_t)want_addr || nbytes != want_nbytes))
            return 0;
    }
    return 1;
}

/*
 * Poster(comm, request_type, ndarray_type, records, mutex, cond, head, tail, pend_mask, rank_areas,
 *        sleeping, err, abort, posted, local_rank, size, timeout, free_slots, free_records, pending,
 *        dtypes, probes, on_splice_error)
 * Addresses are ints; free_slots/free_records are lists of ints used as stacks (pop from the end),
 * pending a dict slot -> request, dtypes a dict dtype char -> (code, itemsize), probes a list for
 * verify_layout, on_splice_error a callable(rc) run when a splice did not return OK (it raises, or
 * returns to accept the post).
 */
static int Poster_init(PosterObject *self, PyObject *args, PyObject *kwds) {
    PyObject *comm, *rtype, *ntype, *slots, *records, *pending, *dtypes, *probes, *on_err;
    unsigned long long recs, m, c, h, t, pm, ra, sl, e, a, p;
    int local_rank, size; double timeout;
    if (!PyArg_ParseTuple(args, "OOOKKKKKKKKKKKiidO!O!O!O!OO", &comm, &rtype, &ntype, &recs, &m, &c, &h,
                          &t, &pm, &ra, &sl, &e, &a, &p, &local_rank, &size, &timeout, &PyList_Type, &slots,
                          &PyList_Type, &records, &PyDict_Type, &pending, &PyDict_Type, &dtypes,
                          &probes, &on_err))
        return -1;
    if (!PyType_Check(rtype) || !PyType_IsSubtype((PyTypeObject *)rtype, &RequestType)) {
        PyErr_SetString(PyExc_TypeError, "request_type must subclass RequestBase");
        return -1;
    }
    if (!PyType_Check(ntype) || !PyCallable_Check(on_err)) {
        PyErr_SetString(PyExc_TypeError, "ndarray_type must be a type, on_splice_error a callable");
        return -1;
    }
    memset(self->dtype_code, 0, sizeof(self->dtype_code));
    memset(self->dtype_size, 0, sizeof(self->dtype_size));
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(dtypes, &pos, &key, &value)) {
        int ch, code, itemsize;
        if (!PyUnicode_Check(key) || PyUnicode_GetLength(key) != 1 ||
            !PyArg_ParseTuple(value, "ii", &code, &itemsize) || code < 1 || code > 255 ||
            itemsize < 1 || itemsize > 255) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "dtypes: one-char str -> (code 1-255, itemsize 1-255)");
            return -1;
        }
        ch = (int)PyUnicode_READ_CHAR(key, 0);
        if (ch > 255) continue;
        self->dtype_code[ch] = (uint8_t)code;
        self->dtype_size[ch] = (uint8_t)itemsize;
    }
    self->chain = (PostedChain){(pthread_mutex_t *)(uintptr_t)m, (pthread_cond_t *)(uintptr_t)c,
                                (volatile int32_t *)(uintptr_t)h, (volatile int32_t *)(uintptr_t)t,
                                (char *)(uintptr_t)recs, (uint64_t *)(uintptr_t)pm, (char *)(uintptr_t)ra,
                                (uint64_t *)(uintptr_t)sl};
    self->err = (volatile uint64_t *)(uintptr_t)e;
    self->abort = (volatile uint64_t *)(uintptr_t)a;
    self->posted = (volatile uint64_t *)(uintptr_t)p;
    self->local_rank = local_rank;
    self->size = size;
    self->timeout = timeout;
    self->seq = self->opcount = self->coll_seq = 0;
    self->group_depth = 0;
    self->chain_first = self->chain_last = -1;
    self->usable = 1;
    Py_INCREF(ntype); Py_XSETREF(self->ndarray, (PyTypeObject *)ntype);
    Py_INCREF(rtype); Py_XSETREF(self->request_type, (PyTypeObject *)rtype);
    Py_INCREF(comm); Py_XSETREF(self->comm, comm);
    Py_INCREF(slots); Py_XSETREF(self->free_slots, slots);
    Py_INCREF(records); Py_XSETREF(self->free_records, records);
    Py_INCREF(pending); Py_XSETREF(self->pending, pending);
    Py_INCREF(on_err); Py_XSETREF(self->on_splice_error, on_err);
    self->fast = verify_layout(self, probes);
    self->mapped = 1;
    return 0;
}

/* Every entry point that touches the pool checks this first: after detach() they raise instead. */
static int check_mapped(PosterObject *self) {
    if (self->mapped) return 1;
    PyErr_SetString(PyExc_RuntimeError, "the communicator's ops pool is no longer mapped (closed)");
    return 0;
}

/* The fields of a record that a post chooses; the owner, opCount, seq and slot come with the post. */
typedef struct {
    int kind, code, redop, flags, peer;
    int64_t tag;
    int32_t bid, bid2;
    uint64_t off, nbytes, count, off2, nbytes2, coll_seq, x1;
} Rec;

static void write_record(char *r, const Rec *f, int owner, uint64_t opcount, uint64_t seq, uint32_t slot) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t t_post = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    int32_t next = -1, zero32 = 0;
    uint64_t zero64 = 0;
    uint8_t b[4] = {(uint8_t)f->kind, (uint8_t)f->code, (uint8_t)f->redop, (uint8_t)f->flags};
    memcpy(r + 0, &next, 4);
    memcpy(r + 4, b, 4);
    memcpy(r + 8, &owner, 4);
    memcpy(r + 12, &f->peer, 4);
    memcpy(r + 16, &f->tag, 8);
    memcpy(r + 24, &opcount, 8);
    memcpy(r + 32, &seq, 8);
    memcpy(r + 40, &slot, 4);
    memcpy(r + 44, &f->bid, 4);
    memcpy(r + 48, &f->off, 8);
    memcpy(r + 56, &f->nbytes, 8);
    memcpy(r + 64, &f->count, 8);
    memcpy(r + 72, &f->bid2, 4);
    memcpy(r + 76, &zero32, 4);
    memcpy(r + 80, &f->off2, 8);
    memcpy(r + 88, &f->nbytes2, 8);
    memcpy(r + 96, &f->coll_seq, 8);
    memcpy(r + 104, &t_post, 8);
    memcpy(r + 112, &f->x1, 8);
    memcpy(r + 120, &zero64, 8);
}

/* Link a written record into the open group, or splice it now. NULL when on_splice_error raised. */
static PyObject *enqueue(PosterObject *self, int32_t index) {
    if (self->group_depth) {
        if (self->chain_last >= 0)
            *(volatile int32_t *)(self->chain.records + (Py_ssize_t)self->chain_last * RECORD_BYTES) = index;
        else
            self->chain_first = index;
        self->chain_last = index;
        Py_RETURN_NONE;
    }
    int rc = splice_chain(&self->chain, self->local_rank, index, index, self->timeout);
    *self->posted += 1;  /* statistics; this rank is its only writer */
    if (rc == RC_OK) Py_RETURN_NONE;
    return PyObject_CallFunction(self->on_splice_error, "i", rc);
}

/* Pop the last int of a list used as a stack (a new reference to it in *item); -1 when empty. The
 * capacity is kept, as list.pop() of the last item does until the list shrinks a lot. */
static long pop_int(PyObject *list, PyObject **item) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n == 0) return -1;
    PyObject *o = PyList_GET_ITEM(list, n - 1);
    long v = PyLong_AsLong(o);
    if (v < 0) {
        PyErr_Clear();
        return -1;
    }
    Py_SET_SIZE(list, n - 1);  /* the list's reference moves to the caller */
    *item = o;
    return v;
}

/* Registered range holding [addr, addr + n): its index, or -1. */
static Py_ssize_t find_range(PosterObject *self, uintptr_t addr, size_t n) {
    Py_ssize_t lo = 0, hi = self->nranges;
    while (lo < hi) {  /* first range with start > addr */
        Py_ssize_t mid = (lo + hi) / 2;
        if (self->ranges[mid].start <= addr) lo = mid + 1; else hi = mid;
    }
    if (lo == 0) return -1;
    Range *r = &self->ranges[lo - 1];
    return addr + n <= r->end ? lo - 1 : -1;
}

/* Everything a fast post needs before it looks at its arguments. */
static int can_post(PosterObject *self) {
    return self->mapped && self->fast && self->usable && !*self->err && !*self->abort &&
           PyList_GET_SIZE(self->free_slots) > 0 && PyList_GET_SIZE(self->free_records) > 0;
}

/* Post one record for a new Request (kind, peer, tag, nbytes as the Request reports them; ``keep``
 * alive until completion): allocate the Request, take a completion slot and a record, register the
 * Request as pending, write and enqueue the record. Returns the Request; None when no slot or record
 * is free after all (nothing changed); NULL with an exception. */
static PyObject *post_record(PosterObject *self, const Rec *rec, PyObject *keep, int req_peer, long long req_tag,
                             long long req_nbytes) {
    /* Allocate first: past this point nothing can fail before the record is handed over, except
     * the pending-dict insert, which puts the slot and the record back. */
    RequestObject *req = (RequestObject *)self->request_type->tp_alloc(self->request_type, 0);
    if (!req) return NULL;
    PyObject *slot_obj, *index_obj;
    long slot = pop_int(self->free_slots, &slot_obj);
    if (slot < 0) {
        Py_DECREF(req);
        Py_RETURN_NONE;
    }
    long index = pop_int(self->free_records, &index_obj);
    if (index < 0) {
        int r = PyList_Append(self->free_slots, slot_obj);
        Py_DECREF(slot_obj);
        Py_DECREF(req);
        if (r < 0) return NULL;
        Py_RETURN_NONE;
    }
    long long seq = self->seq + 1;
    long long opcount = self->group_depth ? self->opcount : self->opcount + 1;
    Py_INCREF(self->comm); req->comm = self->comm;
    Py_INCREF(keep); req->keep = keep;
    Py_INCREF(Py_None); req->stage = Py_None;
    Py_INCREF(Py_None); req->error = Py_None;
    Py_INCREF(Py_None); req->status = Py_None;
    Py_INCREF(Py_None); req->extra = Py_None;
    Py_INCREF(self); req->poster = (PyObject *)self;
    req->seq = seq; req->tag = req_tag; req->nbytes = req_nbytes; req->user_addr = 0;
    req->slot = (int)slot; req->kind = rec->kind; req->peer = req_peer; req->done = 0;
    if (PyDict_SetItem(self->pending, slot_obj, (PyObject *)req) < 0) {
        /* out of memory: give the slot and the record back (appending to a list that just had
         * them popped needs no new memory), nothing was posted */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        PyList_Append(self->free_records, index_obj);
        PyList_Append(self->free_slots, slot_obj);
        Py_DECREF(index_obj);
        Py_DECREF(slot_obj);
        Py_DECREF(req);
        PyErr_Restore(et, ev, etb);
        return NULL;
    }
    Py_DECREF(index_obj);
    Py_DECREF(slot_obj);
    self->seq = seq;
    self->opcount = opcount;
    write_record(self->chain.records + (Py_ssize_t)index * RECORD_BYTES, rec, self->local_rank,
                 (uint64_t)opcount, (uint64_t)seq, (uint32_t)slot);
    PyObject *r = enqueue(self, (int32_t)index);
    if (!r) {
        Py_DECREF(req);
        return NULL;
    }
    Py_DECREF(r);
    return (PyObject *)req;
}

/* The fast point-to-point post: a new Request, or None (a new reference) when Python must take it,
 * or NULL. */
static PyObject *do_post(PosterObject *self, long kind, PyObject *buf, PyObject *peer_obj, PyObject *tag_obj) {
    if (!can_post(self) || Py_TYPE(buf) != self->ndarray || !PyLong_CheckExact(peer_obj) ||
        !PyLong_CheckExact(tag_obj))
        Py_RETURN_NONE;
    int overflow = 0;
    long peer = PyLong_AsLongAndOverflow(peer_obj, &overflow);
    if (overflow || peer < 0 || peer >= self->size) Py_RETURN_NONE;
    long long tag = PyLong_AsLongLongAndOverflow(tag_obj, &overflow);
    if (overflow || PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    uintptr_t addr; int code; long long nbytes, count;
    if (!read_array(self, buf, kind == KIND_RECV, &addr, &code, &nbytes, &count) || nbytes <= 0)
        Py_RETURN_NONE;
    Py_ssize_t ri = find_range(self, addr, (size_t)nbytes);
    if (ri < 0) Py_RETURN_NONE;
    Rec rec = {.kind = (int)kind, .code = code, .peer = (int)peer, .tag = tag, .bid = self->ranges[ri].bid,
               .off = addr - self->ranges[ri].start, .nbytes = (uint64_t)nbytes, .count = (uint64_t)count,
               .bid2 = -1};
    return post_record(self, &rec, buf, (int)peer, tag, nbytes);
}

/* Hand a declined call to its Python method (the Comm installs one for every C entry point). */
static PyObject *call_fallback(PyObject *fallback, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (!fallback) {
        PyErr_SetString(PyExc_RuntimeError, "Poster has no fallback for this call");
        return NULL;
    }
    return PyObject_Vectorcall(fallback, args, nargsf, kwnames);
}

/* ibarrier(): the record Comm._coll writes for a Barrier (dtype code 1, no buffers, root 0, the
 * collective's kind in x1), or the fallback (Comm.Ibarrier itself) when no slot or record is free,
 * the communicator failed, or arguments were given. Python's path costs ~5.7 us on the VM. */
static PyObject *Poster_ibarrier(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) == 0 && !kwnames && can_post(self)) {
        Rec rec = {.kind = KIND_COLL, .code = 1, .peer = 0, .bid = 0, .bid2 = 0,
                   .coll_seq = (uint64_t)(self->coll_seq + 1), .x1 = COLL_BARRIER};
        PyObject *r = post_record(self, &rec, Py_None, 0, COLL_BARRIER, 0);
        if (r != Py_None) {
            if (r) self->coll_seq++;
            return r;
        }
        Py_DECREF(r);
    }
    return call_fallback(self->barrier_fallback, args, nargsf, kwnames);
}

/*
 * The buffer collectives: Iallreduce, Ibcast, Ireduce, Iallgather, Ireduce_scatter_block, Ialltoall.
 * The record is the one Comm._coll writes (unit tests compare them field by field): the send side in
 * (bid, off, nbytes), the receive side in (bid2, off2, nbytes2), one rank's element count, the root in
 * peer, the collective in x1. Only the common case is taken here: arrays in registered memory (so
 * nothing is staged), the dtypes and ops the Python path accepts, counts that fit. Anything else, an
 * error included, returns None so that the Python path decides, and raises, exactly as before.
 * Python's post of these cost 10-12 us on the VM (an Allreduce's C post ~1.5 us).
 */
static int redop_ok(PyObject *op_obj, int code, long *op) {
    if (!PyLong_Check(op_obj) || PyBool_Check(op_obj)) return 0;
    int overflow = 0;
    *op = PyLong_AsLongAndOverflow(op_obj, &overflow);
    if (overflow || *op < REDOP_SUM || *op > REDOP_AVG) {
        PyErr_Clear();
        return 0;
    }
    return !((code == CODE_BOOL && *op != REDOP_MIN && *op != REDOP_MAX) ||
             (*op == REDOP_AVG && code < CODE_FIRST_FLOAT));
}

/* A registered, non-empty array: its code, element count and (bid, off, nbytes) in *where. */
typedef struct { int32_t bid; uint64_t off, nbytes; int code; long long count; } Located;

static int locate(PosterObject *self, PyObject *arr, int writable, Located *where) {
    uintptr_t addr; long long nb;
    if (Py_TYPE(arr) != self->ndarray || !read_array(self, arr, writable, &addr, &where->code, &nb, &where->count) ||
        nb <= 0)
        return 0;
    Py_ssize_t ri = find_range(self, addr, (size_t)nb);
    if (ri < 0) return 0;
    where->bid = self->ranges[ri].bid;
    where->off = addr - self->ranges[ri].start;
    where->nbytes = (uint64_t)nb;
    return 1;
}

static int root_ok(PosterObject *self, PyObject *root_obj, long *root) {
    if (!PyLong_Check(root_obj) || PyBool_Check(root_obj)) return 0;
    int overflow = 0;
    *root = PyLong_AsLongAndOverflow(root_obj, &overflow);
    if (overflow) PyErr_Clear();
    return !overflow && *root >= 0 && *root < self->size;
}

static PyObject *do_coll(PosterObject *self, int coll, PyObject *sendbuf, PyObject *recvbuf, PyObject *op_obj,
                         PyObject *root_obj) {
    if (!can_post(self)) Py_RETURN_NONE;
    long op = 0, root = 0;
    long long size = self->size;
    int in_place = self->in_place && sendbuf == self->in_place;
    Located snd = {0}, rcv = {0};
    Rec rec = {.kind = KIND_COLL, .x1 = (uint64_t)coll, .coll_seq = (uint64_t)(self->coll_seq + 1)};
    if (coll == COLL_BCAST) {
        /* writable on every rank, the root included (Comm._coll: the check must pass or fail alike) */
        if (!root_ok(self, root_obj, &root) || !locate(self, sendbuf, 1, &rcv)) Py_RETURN_NONE;
        snd.nbytes = rcv.nbytes;
        rec.flags = FLAG_IN_PLACE;
        rec.count = (uint64_t)rcv.count;
        rec.code = rcv.code;
    } else if (coll == COLL_ALLREDUCE || coll == COLL_REDUCE) {
        /* every rank of an Allreduce is the root of a Reduce (root 0 in the record) */
        if (coll == COLL_REDUCE && !root_ok(self, root_obj, &root)) Py_RETURN_NONE;
        if (coll == COLL_ALLREDUCE || root == self->rank) {
            if (!locate(self, recvbuf, 1, &rcv)) Py_RETURN_NONE;
            if (in_place) {
                rec.flags = FLAG_IN_PLACE;
            } else if (!locate(self, sendbuf, 0, &snd) || snd.code != rcv.code || snd.count != rcv.count) {
                Py_RETURN_NONE;
            }
            rec.code = rcv.code;
            rec.count = (uint64_t)rcv.count;
        } else {
            /* a non-root's recvbuf is not significant: only None is taken here (Python checks others) */
            if (recvbuf != Py_None || in_place || !locate(self, sendbuf, 0, &snd)) Py_RETURN_NONE;
            rec.flags = FLAG_NO_RECV;
            rec.code = snd.code;
            rec.count = (uint64_t)snd.count;
        }
        if (!redop_ok(op_obj, rec.code, &op)) Py_RETURN_NONE;
    } else if (coll == COLL_ALLGATHER || coll == COLL_REDUCE_SCATTER_BLOCK || coll == COLL_ALLTOALL) {
        if (!locate(self, recvbuf, 1, &rcv)) Py_RETURN_NONE;
        if (in_place) {
            if (coll == COLL_ALLTOALL || rcv.count % size) Py_RETURN_NONE;
            rec.flags = FLAG_IN_PLACE;
            rec.count = (uint64_t)(rcv.count / size);
        } else {
            if (!locate(self, sendbuf, 0, &snd) || snd.code != rcv.code) Py_RETURN_NONE;
            if (coll == COLL_ALLGATHER && rcv.count != snd.count * size) Py_RETURN_NONE;
            if (coll == COLL_REDUCE_SCATTER_BLOCK && snd.count != rcv.count * size) Py_RETURN_NONE;
            if (coll == COLL_ALLTOALL && (snd.count != rcv.count || snd.count % size)) Py_RETURN_NONE;
            rec.count = (uint64_t)(coll == COLL_ALLGATHER ? snd.count
                                   : coll == COLL_REDUCE_SCATTER_BLOCK ? rcv.count : snd.count / size);
        }
        rec.code = rcv.code;
        if (coll == COLL_REDUCE_SCATTER_BLOCK && !redop_ok(op_obj, rec.code, &op)) Py_RETURN_NONE;
    } else {
        Py_RETURN_NONE;
    }
    rec.redop = (int)op;
    rec.peer = (int)root;
    rec.bid = snd.bid; rec.off = snd.off; rec.nbytes = snd.nbytes;
    rec.bid2 = rcv.bid; rec.off2 = rcv.off; rec.nbytes2 = rcv.nbytes;
    PyObject *keep = PyTuple_Pack(2, sendbuf, recvbuf);
    if (!keep) return NULL;
    PyObject *r = post_record(self, &rec, keep, (int)root, coll,
                              (long long)(snd.nbytes > rcv.nbytes ? snd.nbytes : rcv.nbytes));
    Py_DECREF(keep);
    if (r && r != Py_None) self->coll_seq++;
    return r;
}

/* iallreduce()'s fast path, in post_or_fallback's form: an Allreduce has no root. */
static PyObject *do_allreduce(PosterObject *self, long kind, PyObject *sendbuf, PyObject *recvbuf,
                              PyObject *op_obj) {
    (void)kind;
    return do_coll(self, COLL_ALLREDUCE, sendbuf, recvbuf, op_obj, NULL);
}

/* Bind positional and keyword arguments to ``names`` (the first ``nreq`` required, the others
 * defaulting to ``dflt``). 0: the call does not fit (a missing or unknown argument): the fallback
 * takes it, and raises what Python would. */
static int bind_args(PyObject *const *args, size_t nargsf, PyObject *kwnames, const char *const *names, int nreq,
                     int nmax, PyObject **dflt, PyObject **out) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > nmax) return 0;
    for (int i = 0; i < nmax; i++) out[i] = i < nargs ? args[i] : NULL;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        int i = 0;
        while (i < nmax && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, k), names[i]) != 0) i++;
        if (i == nmax || out[i]) return 0;
        out[i] = args[nargs + k];
    }
    for (int i = 0; i < nmax; i++) {
        if (out[i]) continue;
        if (i < nreq) return 0;
        out[i] = dflt[i];
    }
    return 1;
}

static PyObject *coll_entry(PosterObject *self, int coll, const char *const *names, int nreq, int nmax,
                            PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *sum = PyLong_FromLong(REDOP_SUM), *zero = PyLong_FromLong(0);
    if (!sum || !zero) { Py_XDECREF(sum); Py_XDECREF(zero); return NULL; }
    PyObject *dflt[4] = {NULL, NULL, NULL, NULL}, *a[4];
    /* defaults by name: op=SUM, root=0, recvbuf=None (Bcast's sendbuf is its only buffer) */
    for (int i = 0; i < nmax; i++)
        dflt[i] = !strcmp(names[i], "op") ? sum : !strcmp(names[i], "root") ? zero : NULL;
    PyObject *r = Py_None;
    Py_INCREF(r);
    if (bind_args(args, nargsf, kwnames, names, nreq, nmax, dflt, a)) {
        Py_DECREF(r);
        PyObject *buf2 = coll == COLL_BCAST ? Py_None : a[1];
        PyObject *op = coll == COLL_REDUCE || coll == COLL_REDUCE_SCATTER_BLOCK ? a[2] : sum;
        PyObject *root = coll == COLL_BCAST ? a[1] : coll == COLL_REDUCE ? a[3] : zero;
        r = do_coll(self, coll, a[0], buf2, op, root);
    }
    Py_DECREF(sum); Py_DECREF(zero);
    if (r != Py_None) return r;
    Py_DECREF(r);
    return call_fallback(self->coll_fallback[coll], args, nargsf, kwnames);
}

static PyObject *Poster_ibcast(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"buf", "root"};
    return coll_entry(self, COLL_BCAST, names, 1, 2, args, nargsf, kwnames);
}

static PyObject *Poster_ireduce(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"sendbuf", "recvbuf", "op", "root"};
    return coll_entry(self, COLL_REDUCE, names, 2, 4, args, nargsf, kwnames);
}

static PyObject *Poster_iallgather(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"sendbuf", "recvbuf"};
    return coll_entry(self, COLL_ALLGATHER, names, 2, 2, args, nargsf, kwnames);
}

static PyObject *Poster_ireduce_scatter_block(PosterObject *self, PyObject *const *args, size_t nargsf,
                                              PyObject *kwnames) {
    static const char *const names[] = {"sendbuf", "recvbuf", "op"};
    return coll_entry(self, COLL_REDUCE_SCATTER_BLOCK, names, 2, 3, args, nargsf, kwnames);
}

static PyObject *Poster_ialltoall(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"sendbuf", "recvbuf"};
    return coll_entry(self, COLL_ALLTOALL, names, 2, 2, args, nargsf, kwnames);
}

/* set_coll_fallback(coll, fn): what ibcast() .. ialltoall() call for what they decline. */
static PyObject *Poster_set_coll_fallback(PosterObject *self, PyObject *args) {
    int coll; PyObject *fn;
    if (!PyArg_ParseTuple(args, "iO", &coll, &fn)) return NULL;
    if (coll < COLL_BCAST || coll > COLL_ALLTOALL || coll == COLL_ALLREDUCE) {
        PyErr_Format(PyExc_ValueError, "no C post for collective %d", coll);
        return NULL;
    }
    Py_INCREF(fn);
    Py_XSETREF(self->coll_fallback[coll], fn);
    Py_RETURN_NONE;
}

/* post(kind, buf, peer, tag) -> Request, or None: take the Python path (see the header). */
static PyObject *Poster_post(PosterObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyLong_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "post(kind: int, buf, peer, tag)");
        return NULL;
    }
    long kind = PyLong_AsLong(args[0]);
    return do_post(self, kind, args[1], args[2], args[3]);
}

/* A fast post of three arguments, the last of them optional: do_post or do_allreduce. */
typedef PyObject *(*fast_post_fn)(PosterObject *self, long kind, PyObject *a, PyObject *b, PyObject *c);

/* isend(buf, dest, tag=0) / irecv(buf, source, tag=0) / iallreduce(sendbuf, recvbuf, op=SUM): the
 * Isend/Irecv/Iallreduce of a communicator (bound per instance, so that a post costs no Python frame);
 * other keywords and every declined case go to the fallback, the Python method itself. */
static PyObject *post_or_fallback(PosterObject *self, fast_post_fn fn, long kind, const char *third,
                                  long third_default, PyObject *fallback, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    /* the third argument by keyword (Isend(buf, dest, tag=5), mpi4py's spelling) is positional here */
    if (kwnames && nargs == 2 && PyTuple_GET_SIZE(kwnames) == 1 &&
        PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), third) == 0) {
        PyObject *r = fn(self, kind, args[0], args[1], args[2]);
        if (r != Py_None) return r;
        Py_DECREF(r);
    } else if (!kwnames && (nargs == 2 || nargs == 3)) {
        PyObject *dflt = NULL;
        if (nargs == 2 && !(dflt = PyLong_FromLong(third_default))) return NULL;
        PyObject *r = fn(self, kind, args[0], args[1], nargs == 3 ? args[2] : dflt);
        Py_XDECREF(dflt);
        if (r != Py_None) return r;
        Py_DECREF(r);
    }
    return call_fallback(fallback, args, nargsf, kwnames);
}

static PyObject *Poster_isend(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return post_or_fallback(self, do_post, KIND_SEND, "tag", 0, self->send_fallback, args, nargsf, kwnames);
}

static PyObject *Poster_irecv(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return post_or_fallback(self, do_post, KIND_RECV, "tag", 0, self->recv_fallback, args, nargsf, kwnames);
}

static PyObject *Poster_iallreduce(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return post_or_fallback(self, do_allreduce, KIND_COLL, "op", REDOP_SUM, self->allreduce_fallback, args, nargsf,
                            kwnames);
}


/* ------------------------------------------------------------------ Wait and Test
 *
 * The common end of a request in C: its slot says complete with no error, and nothing was staged
 * (comm.alloc memory), so reaping it is reading the slot, returning the slot, and a Status. A
 * blocking Send or Recv thereby costs no Python frame between the post and the return (on the VM
 * the Python reap was ~4 us of a ~45 us one-way message). The spin is only here. Everything else
 * (an error, a staged buffer to copy out, a timeout, the sleep on the futex, a Wait inside a group)
 * is Python's: Request._wait_slow and Request._test_slow, which own every message.
 *
 * Ordering: the progress process writes the slot's fields, then done_seq (shm/counters.py); the
 * acquire load of done_seq orders the reads of the fields after it.
 */

static PyTypeObject PosterType;  /* defined below */

/* The request's poster when the C path may look at its slot; NULL sends the caller to Python. */
static PosterObject *wait_poster(RequestObject *r) {
    PosterObject *p = (PosterObject *)r->poster;
    if (!p || Py_TYPE(p) != &PosterType || !p->mapped || !p->slots || p->group_depth || r->slot < 0 ||
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
    StatusObject *st = (StatusObject *)StatusType.tp_alloc(&StatusType, 0);
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

/*
 * write(index, slot, kind, code, redop, flags, peer, tag, bid, off, nbytes, count, bid2, off2, nbytes2,
 *       coll_seq, x1) -> seq
 * Fill a record for the Python path (numbers already checked) and take the next sequence number.
 */
static PyObject *Poster_write(PosterObject *self, PyObject *args) {
    int index, slot;
    long long tag, x1;
    unsigned long long off, nbytes, count, off2, nbytes2, coll_seq;
    Rec f;
    if (!PyArg_ParseTuple(args, "iiiiiiiLiKKKiKKKL", &index, &slot, &f.kind, &f.code, &f.redop, &f.flags, &f.peer,
                          &tag, &f.bid, &off, &nbytes, &count, &f.bid2, &off2, &nbytes2, &coll_seq, &x1))
        return NULL;
    if (!check_mapped(self)) return NULL;
    f.tag = tag; f.off = off; f.nbytes = nbytes; f.count = count; f.off2 = off2; f.nbytes2 = nbytes2;
    f.coll_seq = coll_seq; f.x1 = (uint64_t)x1;
    long long seq = ++self->seq;
    if (!self->group_depth) self->opcount++;
    write_record(self->chain.records + (Py_ssize_t)index * RECORD_BYTES, &f, self->local_rank,
                 (uint64_t)self->opcount, (uint64_t)seq, (uint32_t)slot);
    return PyLong_FromLongLong(seq);
}

/* enqueue(index): link the written record into the open group, or splice it. */
static PyObject *Poster_enqueue(PosterObject *self, PyObject *arg) {
    long index = PyLong_AsLong(arg);
    if ((index == -1 && PyErr_Occurred()) || !check_mapped(self)) return NULL;
    return enqueue(self, (int32_t)index);
}

/* flush(): splice the group's private chain, if any, under one lock. */
static PyObject *Poster_flush(PosterObject *self, PyObject *unused) {
    if (self->chain_first < 0) Py_RETURN_NONE;
    if (!check_mapped(self)) return NULL;
    int32_t first = self->chain_first, last = self->chain_last;
    self->chain_first = self->chain_last = -1;
    int rc = splice_chain(&self->chain, self->local_rank, first, last, self->timeout);
    *self->posted += 1;
    if (rc == RC_OK) Py_RETURN_NONE;
    return PyObject_CallFunction(self->on_splice_error, "i", rc);
}

/* The context manager comm.group() returns: __enter__ opens a group (one opCount for everything
 * posted inside, records linked privately), __exit__ closes it and splices the chain once the
 * outermost group ends, also when the block raised. In C because the generator-based context
 * manager cost 3.7 us per empty group on the VM, this 0.5 us (a group of 8 posts pays it per op). */
static PyObject *Poster_enter(PosterObject *self, PyObject *unused) {
    if (!self->usable || !self->mapped || *self->err || *self->abort) {
        PyObject *r = PyObject_CallMethod(self->comm, "_check_usable", NULL);  /* raises what applies */
        if (!r) return NULL;
        Py_DECREF(r);
    }
    if (self->group_depth == 0) self->opcount++;
    self->group_depth++;
    Py_INCREF(self->comm);
    return self->comm;
}

static PyObject *Poster_exit(PosterObject *self, PyObject *args) {
    if (self->group_depth > 0) self->group_depth--;
    if (self->group_depth == 0 && self->mapped) {
        PyObject *r = Poster_flush(self, NULL);
        if (!r) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_FALSE;  /* an exception from the block propagates */
}

/* detach(): the pool is about to be unmapped; nothing here touches it again. */
static PyObject *Poster_detach(PosterObject *self, PyObject *unused) {
    self->mapped = 0;
    self->usable = 0;
    self->chain_first = self->chain_last = -1;
    Py_RETURN_NONE;
}

/* set_ranges([(start, end, buf_id), ...] sorted by start): the rank's registered memory. */
static PyObject *Poster_set_ranges(PosterObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "set_ranges takes a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Range *rs = PyMem_Malloc(sizeof(Range) * (n ? n : 1));
    if (!rs) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long start, end; int bid;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKi", &start, &end, &bid) ||
            (i && start < rs[i - 1].start)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "ranges must be sorted by start");
            PyMem_Free(rs);
            Py_DECREF(seq);
            return NULL;
        }
        rs[i].start = (uintptr_t)start; rs[i].end = (uintptr_t)end; rs[i].bid = bid;
    }
    Py_DECREF(seq);
    PyMem_Free(self->ranges);
    self->ranges = rs;
    self->nranges = n;
    Py_RETURN_NONE;
}

/* set_wait(slots_addr, nslots, spin_s, spin_max, spin_max_coll): where the completion slots are and
 * how Request.Wait spins (proxy/rank/comm.py decides both). Until called, Wait and Test go to Python. */
static PyObject *Poster_set_wait(PosterObject *self, PyObject *args) {
    unsigned long long addr; long n; double spin_s; long long m, mc;
    if (!PyArg_ParseTuple(args, "KldLL", &addr, &n, &spin_s, &m, &mc)) return NULL;
    self->slots = (volatile uint64_t *)(uintptr_t)addr;
    self->nslots = n;
    self->spin_s = spin_s;
    self->spin_max = m;
    self->spin_max_coll = mc;
    Py_RETURN_NONE;
}

static PyMethodDef Poster_methods[] = {
    {"post", (PyCFunction)(void (*)(void))Poster_post, METH_FASTCALL,
     "post(kind, buf, peer, tag) -> Request, or None for the Python path"},
    {"isend", (PyCFunction)(void (*)(void))Poster_isend, METH_FASTCALL | METH_KEYWORDS,
     "isend(buf, dest, tag=0) -> Request (see Comm.Isend)"},
    {"irecv", (PyCFunction)(void (*)(void))Poster_irecv, METH_FASTCALL | METH_KEYWORDS,
     "irecv(buf, source, tag=0) -> Request (see Comm.Irecv)"},
    {"iallreduce", (PyCFunction)(void (*)(void))Poster_iallreduce, METH_FASTCALL | METH_KEYWORDS,
     "iallreduce(sendbuf, recvbuf, op=SUM) -> Request (see Comm.Iallreduce)"},
    {"ibarrier", (PyCFunction)(void (*)(void))Poster_ibarrier, METH_FASTCALL | METH_KEYWORDS,
     "ibarrier() -> Request (see Comm.Ibarrier)"},
    {"ibcast", (PyCFunction)(void (*)(void))Poster_ibcast, METH_FASTCALL | METH_KEYWORDS,
     "ibcast(buf, root=0) -> Request (see Comm.Ibcast)"},
    {"ireduce", (PyCFunction)(void (*)(void))Poster_ireduce, METH_FASTCALL | METH_KEYWORDS,
     "ireduce(sendbuf, recvbuf, op=SUM, root=0) -> Request (see Comm.Ireduce)"},
    {"iallgather", (PyCFunction)(void (*)(void))Poster_iallgather, METH_FASTCALL | METH_KEYWORDS,
     "iallgather(sendbuf, recvbuf) -> Request (see Comm.Iallgather)"},
    {"ireduce_scatter_block", (PyCFunction)(void (*)(void))Poster_ireduce_scatter_block,
     METH_FASTCALL | METH_KEYWORDS, "ireduce_scatter_block(sendbuf, recvbuf, op=SUM) -> Request"},
    {"ialltoall", (PyCFunction)(void (*)(void))Poster_ialltoall, METH_FASTCALL | METH_KEYWORDS,
     "ialltoall(sendbuf, recvbuf) -> Request (see Comm.Ialltoall)"},
    {"set_coll_fallback", (PyCFunction)Poster_set_coll_fallback, METH_VARARGS,
     "set_coll_fallback(coll, fn): the Python path of a collective's C post"},
    {"write", (PyCFunction)Poster_write, METH_VARARGS, "Fill a record; returns the request's seq."},
    {"enqueue", (PyCFunction)Poster_enqueue, METH_O, "Link a record into the group, or splice it."},
    {"flush", (PyCFunction)Poster_flush, METH_NOARGS, "Splice the group's chain."},
    {"set_ranges", (PyCFunction)Poster_set_ranges, METH_O, "Replace the registered ranges."},
    {"detach", (PyCFunction)Poster_detach, METH_NOARGS, "The pool is being unmapped: stop touching it."},
    {"set_wait", (PyCFunction)Poster_set_wait, METH_VARARGS, "Where the slots are and how Wait spins."},
    {"__enter__", (PyCFunction)Poster_enter, METH_NOARGS, "Open a group (comm.group())."},
    {"__exit__", (PyCFunction)Poster_exit, METH_VARARGS, "Close the group; splice it if outermost."},
    {NULL, NULL, 0, NULL},
};

#define PM(name, type, field, flags) {name, type, offsetof(PosterObject, field), flags, NULL}
static PyMemberDef Poster_members[] = {
    PM("rank", T_INT, rank, 0), PM("seq", T_LONGLONG, seq, 0), PM("opcount", T_LONGLONG, opcount, 0), PM("coll_seq", T_LONGLONG, coll_seq, 0),
    PM("group_depth", T_INT, group_depth, 0), PM("usable", T_INT, usable, 0),
    PM("chain_first", T_INT, chain_first, READONLY), PM("nranges", T_PYSSIZET, nranges, READONLY),
    PM("fast", T_BOOL, fast, READONLY),
    PM("send_fallback", T_OBJECT, send_fallback, 0), PM("recv_fallback", T_OBJECT, recv_fallback, 0),
    PM("allreduce_fallback", T_OBJECT, allreduce_fallback, 0), PM("barrier_fallback", T_OBJECT, barrier_fallback, 0),
    PM("in_place", T_OBJECT, in_place, 0),
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject PosterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmproxy.shm._poster.Poster",
    .tp_basicsize = sizeof(PosterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A rank's post path over one ops pool (see the module header).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Poster_init,
    .tp_dealloc = (destructor)Poster_dealloc,
    .tp_traverse = (traverseproc)Poster_traverse,
    .tp_clear = (inquiry)Poster_clear,
    .tp_methods = Poster_methods,
    .tp_members = Poster_members,
};

static PyMethodDef module_methods[] = {
    {"set_lock_spin", py_set_lock_spin, METH_O, "set_lock_spin(ns): contended pool locks retry this long first"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "shmproxy.shm._poster", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__poster(void) {
    RequestType.tp_methods = Request_methods;  /* defined after the Poster, whose slots they read */
    if (PyType_Ready(&StatusType) < 0 || PyType_Ready(&RequestType) < 0 || PyType_Ready(&PosterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&RequestType);
    Py_INCREF(&PosterType);
    Py_INCREF(&StatusType);
    if (PyModule_AddObject(m, "RequestBase", (PyObject *)&RequestType) < 0 ||
        PyModule_AddObject(m, "Status", (PyObject *)&StatusType) < 0 ||
        PyModule_AddObject(m, "Poster", (PyObject *)&PosterType) < 0 ||
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
