/*
 * The Poster type of shm._poster: its state (set up, collected), the record writer and the splice of
 * records onto the posted chain, the Python path's way in (write(), enqueue(), flush()), comm.group(),
 * and the method table over the fast posts (shm/_poster_post.c) and the ranges (shm/_poster_array.c).
 *
 * Record layout: shm/pool.py RECORD (little-endian, packed, 128 bytes); tests/test_poster.py checks
 * that a record written here unpacks there. Lock protocol: shm/_pool_lock.h.
 *
 * This is the only file of the module that splices (splice_chain), so the lock spin the module's
 * set_lock_spin sets is this file's copy (see shm/_poster.h).
 */
#include "_poster.h"

#include <string.h>
#include <structmember.h>
#include <time.h>

/* ------------------------------------------------------------------ Poster */

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
    for (int i = 0; i < FAST_CALLS; i++) Py_VISIT(self->fast_fallback[i]);
    Py_VISIT(self->fast_failed);
    Py_VISIT(self->fast_check);
    Py_VISIT(self->ref_failed);
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
    for (int i = 0; i < FAST_CALLS; i++) Py_CLEAR(self->fast_fallback[i]);
    Py_CLEAR(self->fast_failed);
    Py_CLEAR(self->fast_check);
    Py_CLEAR(self->ref_failed);
    self->fl.fast = NULL;
    return 0;
}

static void Poster_dealloc(PosterObject *self) {
    PyObject_GC_UnTrack(self);
    Poster_clear(self);
    PyMem_Free(self->ranges);
    PyMem_Free(self->local_of);
    PyMem_Free(self->slow_to);
    _sp_unmap_arenas(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/*
 * Poster(comm, request_type, ndarray_type, records, mutex, cond, head, tail, pend_mask, rank_areas,
 *        sleeping, err, abort, posted, local_rank, size, timeout, free_slots, free_records, pending,
 *        dtypes, probes, on_splice_error)
 * Addresses are ints; free_slots/free_records are lists of ints used as stacks (pop from the end),
 * pending a dict slot -> request, dtypes a dict dtype char -> (code, itemsize), probes a list for
 * _sp_verify_layout, on_splice_error a callable(rc) run when a splice did not return OK (it raises, or
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
    if (!PyType_Check(rtype) || !PyType_IsSubtype((PyTypeObject *)rtype, &_sp_RequestType)) {
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
    self->fast = _sp_verify_layout(self, probes);
    self->mapped = 1;
    return 0;
}

/* Every entry point that touches the pool checks this first: after detach() they raise instead. */
int _sp_check_mapped(PosterObject *self) {
    if (self->mapped) return 1;
    PyErr_SetString(PyExc_RuntimeError, "the communicator's ops pool is no longer mapped (closed)");
    return 0;
}

/* Fill record r (the layout above): the fields the post chose, its owner, opCount, sequence number and
 * completion slot, and the time of the post; `next` is -1 until it is linked. */
void _sp_write_record(char *r, const Rec *f, int owner, uint64_t opcount, uint64_t seq, uint32_t slot) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t t_post = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    int32_t next = -1;
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
    memcpy(r + REC_MEM_OFF, &f->mem, 4);
    memcpy(r + 80, &f->off2, 8);
    memcpy(r + 88, &f->nbytes2, 8);
    memcpy(r + 96, &f->coll_seq, 8);
    memcpy(r + 104, &t_post, 8);
    memcpy(r + 112, &f->x1, 8);
    memcpy(r + 120, &zero64, 8);
}

/* Link a written record into the open group, or splice it now. NULL when on_splice_error raised. */
PyObject *_sp_enqueue(PosterObject *self, int32_t index) {
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

/* set_lock_spin(ns) of the module: the lock spin of this file's splices (_pool_lock.h). */
PyObject *_sp_set_lock_spin(PyObject *self, PyObject *arg) {
    return py_set_lock_spin(self, arg);
}

/*
 * write(index, slot, kind, code, redop, flags, peer, tag, bid, off, nbytes, count, bid2, off2, nbytes2,
 *       coll_seq, x1) -> seq
 * Fill a record for the Python path (numbers already checked) and take the next sequence number.
 */
static PyObject *Poster_write(PosterObject *self, PyObject *args) {
    int index, slot;
    long long tag, x1;
    unsigned long long off, nbytes, count, off2, nbytes2, coll_seq;
    Rec f = {0};   /* mem: host unless the caller names another kind */
    if (!PyArg_ParseTuple(args, "iiiiiiiLiKKKiKKKL|i", &index, &slot, &f.kind, &f.code, &f.redop, &f.flags, &f.peer,
                          &tag, &f.bid, &off, &nbytes, &count, &f.bid2, &off2, &nbytes2, &coll_seq, &x1, &f.mem))
        return NULL;
    if (!_sp_check_mapped(self)) return NULL;
    f.tag = tag; f.off = off; f.nbytes = nbytes; f.count = count; f.off2 = off2; f.nbytes2 = nbytes2;
    f.coll_seq = coll_seq; f.x1 = (uint64_t)x1;
    long long seq = ++self->seq;
    if (!self->group_depth) self->opcount++;
    _sp_write_record(self->chain.records + (Py_ssize_t)index * RECORD_BYTES, &f, self->local_rank,
                     (uint64_t)self->opcount, (uint64_t)seq, (uint32_t)slot);
    _sp_fast_stamp(self, self->chain.records + (Py_ssize_t)index * RECORD_BYTES, &f);
    return PyLong_FromLongLong(seq);
}

/* enqueue(index): link the written record into the open group, or splice it. */
static PyObject *Poster_enqueue(PosterObject *self, PyObject *arg) {
    long index = PyLong_AsLong(arg);
    if ((index == -1 && PyErr_Occurred()) || !_sp_check_mapped(self)) return NULL;
    return _sp_enqueue(self, (int32_t)index);
}

/* flush(): splice the group's private chain, if any, under one lock. */
static PyObject *Poster_flush(PosterObject *self, PyObject *unused) {
    if (self->chain_first < 0) Py_RETURN_NONE;
    if (!_sp_check_mapped(self)) return NULL;
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
 * manager cost several times as much per empty group (a group of 8 posts pays it per op). */
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
    _sp_unmap_arenas(self);   /* the peers' arenas: the middle collectives end with the pool */
    Py_RETURN_NONE;
}

/* set_wait(slots_addr, nslots, spin_s, spin_max, spin_max_coll): where the completion slots are and
 * how Request.Wait spins (proxy/rank/lifecycle.py decides both). Until called, Wait and Test go to Python. */
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
    {"post", (PyCFunction)(void (*)(void))_sp_Poster_post, METH_FASTCALL,
     "post(kind, buf, peer, tag) -> Request, or None for the Python path"},
    {"isend", (PyCFunction)(void (*)(void))_sp_Poster_isend, METH_FASTCALL | METH_KEYWORDS,
     "isend(buf, dest, tag=0) -> Request (see Comm.Isend)"},
    {"irecv", (PyCFunction)(void (*)(void))_sp_Poster_irecv, METH_FASTCALL | METH_KEYWORDS,
     "irecv(buf, source, tag=0) -> Request (see Comm.Irecv)"},
    {"iallreduce", (PyCFunction)(void (*)(void))_sp_Poster_iallreduce, METH_FASTCALL | METH_KEYWORDS,
     "iallreduce(sendbuf, recvbuf, op=SUM) -> Request (see Comm.Iallreduce)"},
    {"ibarrier", (PyCFunction)(void (*)(void))_sp_Poster_ibarrier, METH_FASTCALL | METH_KEYWORDS,
     "ibarrier() -> Request (see Comm.Ibarrier)"},
    {"ibcast", (PyCFunction)(void (*)(void))_sp_Poster_ibcast, METH_FASTCALL | METH_KEYWORDS,
     "ibcast(buf, root=0) -> Request (see Comm.Ibcast)"},
    {"ireduce", (PyCFunction)(void (*)(void))_sp_Poster_ireduce, METH_FASTCALL | METH_KEYWORDS,
     "ireduce(sendbuf, recvbuf, op=SUM, root=0) -> Request (see Comm.Ireduce)"},
    {"iallgather", (PyCFunction)(void (*)(void))_sp_Poster_iallgather, METH_FASTCALL | METH_KEYWORDS,
     "iallgather(sendbuf, recvbuf) -> Request (see Comm.Iallgather)"},
    {"ireduce_scatter_block", (PyCFunction)(void (*)(void))_sp_Poster_ireduce_scatter_block,
     METH_FASTCALL | METH_KEYWORDS, "ireduce_scatter_block(sendbuf, recvbuf, op=SUM) -> Request"},
    {"ialltoall", (PyCFunction)(void (*)(void))_sp_Poster_ialltoall, METH_FASTCALL | METH_KEYWORDS,
     "ialltoall(sendbuf, recvbuf) -> Request (see Comm.Ialltoall)"},
    {"set_coll_fallback", (PyCFunction)_sp_Poster_set_coll_fallback, METH_VARARGS,
     "set_coll_fallback(coll, fn): the Python path of a collective's C post"},
    {"set_fast", (PyCFunction)_sp_Poster_set_fast, METH_VARARGS,
     "set_fast(pool, fast_off, fast_bytes, rank_area_off, nlocal, slice_s, fallbacks, failed, check, proxy_fd)"},
    {"send", (PyCFunction)(void (*)(void))_sp_Poster_send, METH_FASTCALL | METH_KEYWORDS,
     "send(buf, dest, tag=0) (see Comm.Send)"},
    {"send_or_isend", (PyCFunction)(void (*)(void))_sp_Poster_send_or_isend, METH_FASTCALL | METH_KEYWORDS,
     "send_or_isend(buf, dest, tag=0) -> None when sent through a cell at once, else Isend's Request"},
    {"recv", (PyCFunction)(void (*)(void))_sp_Poster_recv, METH_FASTCALL | METH_KEYWORDS,
     "recv(buf, source=ANY_SOURCE, tag=ANY_TAG) -> Status (see Comm.Recv)"},
    {"try_recv", (PyCFunction)(void (*)(void))_sp_Poster_try_recv, METH_FASTCALL | METH_KEYWORDS,
     "try_recv(buf, source=ANY_SOURCE, tag=ANY_TAG) -> Status when the fast path took it, else None"},
    {"barrier", (PyCFunction)(void (*)(void))_sp_Poster_barrier, METH_FASTCALL | METH_KEYWORDS,
     "barrier() (see Comm.Barrier)"},
    {"allreduce", (PyCFunction)(void (*)(void))_sp_Poster_allreduce, METH_FASTCALL | METH_KEYWORDS,
     "allreduce(sendbuf, recvbuf, op=SUM) (see Comm.Allreduce)"},
    {"try_allreduce", (PyCFunction)(void (*)(void))_sp_Poster_try_allreduce, METH_FASTCALL,
     "try_allreduce(sendbuf, recvbuf, op): a small Allreduce between the ranks, or NotImplemented"},
    {"bcast", (PyCFunction)(void (*)(void))_sp_Poster_bcast, METH_FASTCALL | METH_KEYWORDS,
     "bcast(buf, root=0) (see Comm.Bcast)"},
    {"reduce", (PyCFunction)(void (*)(void))_sp_Poster_reduce, METH_FASTCALL | METH_KEYWORDS,
     "reduce(sendbuf, recvbuf, op=SUM, root=0) (see Comm.Reduce)"},
    {"set_ref", (PyCFunction)_sp_Poster_set_ref, METH_VARARGS,
     "set_ref(min_bytes, max_bytes, failed): a blocking Send of that size from the arena by reference"},
    {"set_arena", (PyCFunction)_sp_Poster_set_arena, METH_VARARGS,
     "set_arena(mapped_bytes, mapped_min, mapped_min_reduce, arena, arena_size, arena_fd, scratch): the middle collectives"},
    {"coll_decline", (PyCFunction)_sp_Poster_coll_decline, METH_VARARGS,
     "coll_decline(coll, nbytes, code, count, op, root): decline a middle collective with every rank"},
    {"coll_fast", (PyCFunction)_sp_Poster_coll_fast, METH_VARARGS,
     "coll_fast(coll, sendbuf, recvbuf, op, root): a small collective between the ranks"},
    {"write", (PyCFunction)Poster_write, METH_VARARGS, "Fill a record; returns the request's seq."},
    {"enqueue", (PyCFunction)Poster_enqueue, METH_O, "Link a record into the group, or splice it."},
    {"flush", (PyCFunction)Poster_flush, METH_NOARGS, "Splice the group's chain."},
    {"set_ranges", (PyCFunction)_sp_Poster_set_ranges, METH_O, "Replace the registered ranges."},
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
    PM("fast", T_BOOL, fast, READONLY), PM("coll_n", T_ULONGLONG, coll_n, READONLY),
    PM("ref_sent", T_ULONGLONG, ref_sent, READONLY), PM("ref_taken", T_ULONGLONG, ref_taken, READONLY),
    PM("send_fallback", T_OBJECT, send_fallback, 0), PM("recv_fallback", T_OBJECT, recv_fallback, 0),
    PM("allreduce_fallback", T_OBJECT, allreduce_fallback, 0), PM("barrier_fallback", T_OBJECT, barrier_fallback, 0),
    PM("in_place", T_OBJECT, in_place, 0),
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject _sp_PosterType = {
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
