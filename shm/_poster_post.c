/*
 * shm._poster's fast posts: the point-to-point post (post(), isend(), irecv()) and the collectives'
 * (ibarrier(), iallreduce(), ibcast() .. ialltoall()), each either posting one record for a new
 * Request or declining to the Comm's Python method (the division of labour in shm/_poster.c's header).
 */
#include "_poster.h"

#include <string.h>

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
    _sp_write_record(self->chain.records + (Py_ssize_t)index * RECORD_BYTES, rec, self->local_rank,
                     (uint64_t)opcount, (uint64_t)seq, (uint32_t)slot);
    _sp_fast_stamp(self, self->chain.records + (Py_ssize_t)index * RECORD_BYTES, rec);
    PyObject *r = _sp_enqueue(self, (int32_t)index);
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
    if (kind == KIND_SEND && tag == LLONG_MIN) Py_RETURN_NONE;   /* ANY_TAG: Python raises, naming it */
    uintptr_t addr; int code; long long nbytes, count;
    if (!_sp_read_array(self, buf, kind == KIND_RECV, &addr, &code, &nbytes, &count) || nbytes <= 0)
        Py_RETURN_NONE;
    Py_ssize_t ri = _sp_find_range(self, addr, (size_t)nbytes);
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
 * the communicator failed, or arguments were given. Python's path costs several times more. */
PyObject *_sp_Poster_ibarrier(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
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
 * Python's post of these costs several times the C post (microseconds of frames and attribute
 * lookups).
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
        if (!root_ok(self, root_obj, &root) || !_sp_locate(self, sendbuf, 1, &rcv)) Py_RETURN_NONE;
        snd.nbytes = rcv.nbytes;
        rec.flags = FLAG_IN_PLACE;
        rec.count = (uint64_t)rcv.count;
        rec.code = rcv.code;
    } else if (coll == COLL_ALLREDUCE || coll == COLL_REDUCE) {
        /* every rank of an Allreduce is the root of a Reduce (root 0 in the record) */
        if (coll == COLL_REDUCE && !root_ok(self, root_obj, &root)) Py_RETURN_NONE;
        if (coll == COLL_ALLREDUCE || root == self->rank) {
            if (!_sp_locate(self, recvbuf, 1, &rcv)) Py_RETURN_NONE;
            if (in_place) {
                rec.flags = FLAG_IN_PLACE;
            } else if (!_sp_locate(self, sendbuf, 0, &snd) || snd.code != rcv.code ||
                       snd.count != rcv.count) {
                Py_RETURN_NONE;
            }
            rec.code = rcv.code;
            rec.count = (uint64_t)rcv.count;
        } else {
            /* a non-root's recvbuf is not significant: only None is taken here (Python checks others) */
            if (recvbuf != Py_None || in_place || !_sp_locate(self, sendbuf, 0, &snd)) Py_RETURN_NONE;
            rec.flags = FLAG_NO_RECV;
            rec.code = snd.code;
            rec.count = (uint64_t)snd.count;
        }
        if (!redop_ok(op_obj, rec.code, &op)) Py_RETURN_NONE;
    } else if (coll == COLL_ALLGATHER || coll == COLL_REDUCE_SCATTER_BLOCK || coll == COLL_ALLTOALL) {
        if (!_sp_locate(self, recvbuf, 1, &rcv)) Py_RETURN_NONE;
        if (in_place) {
            if (coll == COLL_ALLTOALL || rcv.count % size) Py_RETURN_NONE;
            rec.flags = FLAG_IN_PLACE;
            rec.count = (uint64_t)(rcv.count / size);
        } else {
            if (!_sp_locate(self, sendbuf, 0, &snd) || snd.code != rcv.code) Py_RETURN_NONE;
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

PyObject *_sp_Poster_ibcast(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"buf", "root"};
    return coll_entry(self, COLL_BCAST, names, 1, 2, args, nargsf, kwnames);
}

PyObject *_sp_Poster_ireduce(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"sendbuf", "recvbuf", "op", "root"};
    return coll_entry(self, COLL_REDUCE, names, 2, 4, args, nargsf, kwnames);
}

PyObject *_sp_Poster_iallgather(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"sendbuf", "recvbuf"};
    return coll_entry(self, COLL_ALLGATHER, names, 2, 2, args, nargsf, kwnames);
}

PyObject *_sp_Poster_ireduce_scatter_block(PosterObject *self, PyObject *const *args, size_t nargsf,
                                           PyObject *kwnames) {
    static const char *const names[] = {"sendbuf", "recvbuf", "op"};
    return coll_entry(self, COLL_REDUCE_SCATTER_BLOCK, names, 2, 3, args, nargsf, kwnames);
}

PyObject *_sp_Poster_ialltoall(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    static const char *const names[] = {"sendbuf", "recvbuf"};
    return coll_entry(self, COLL_ALLTOALL, names, 2, 2, args, nargsf, kwnames);
}

/* set_coll_fallback(coll, fn): what ibcast() .. ialltoall() call for what they decline. */
PyObject *_sp_Poster_set_coll_fallback(PosterObject *self, PyObject *args) {
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

/* post(kind, buf, peer, tag) -> Request, or None: take the Python path (see shm/_poster.c's header). */
PyObject *_sp_Poster_post(PosterObject *self, PyObject *const *args, Py_ssize_t nargs) {
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

PyObject *_sp_Poster_isend(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return post_or_fallback(self, do_post, KIND_SEND, "tag", 0, self->send_fallback, args, nargsf, kwnames);
}

PyObject *_sp_Poster_irecv(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return post_or_fallback(self, do_post, KIND_RECV, "tag", 0, self->recv_fallback, args, nargsf, kwnames);
}

PyObject *_sp_Poster_iallreduce(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return post_or_fallback(self, do_allreduce, KIND_COLL, "op", REDOP_SUM, self->allreduce_fallback, args, nargsf,
                            kwnames);
}
