/*
 * shm._native, continued: the records the progress loop took off the posted chain, as Op objects, in
 * one call (the loop's _unpack_taken). In Python, a record cost a struct unpack into a tuple, an
 * __init__ that unpacks the tuple into 26 slots, and a dictionary lookup of its rank: microseconds a
 * record on the slower hosts, on every message's path (docs/decisions.md, "Ops unpacked in C").
 *
 * Op (shmproxy.core.ops) stays a Python class with __slots__: bind_op finds each slot's member
 * descriptor once and keeps its offset in the instance, and unpack_ops allocates instances without
 * calling __init__ and stores each field's int object at its slot's offset, as the interpreter's
 * own slot assignment does. Record layout: shm/pool.py RECORD (little-endian, packed, 128 bytes).
 */
#include "_native.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

#include "_pool_layout.h"

/* The record's fields after `next`, in Op.__init__'s order: (name, offset, size, signed); the offsets
 * _pool_layout.h names (which shm/pool.py checks) by their names, and tests/test_native_ops.py checks
 * every one against shm/pool.py's RECORD. */
typedef struct {
    const char *name;
    int off, size, is_signed;
} Field;

static const Field FIELDS[] = {
    {"kind", 4, 1, 0},          {"dtype", 5, 1, 0},           {"redop", 6, 1, 0},
    {"flags", 7, 1, 0},         {"owner", REC_OWNER_OFF, 4, 1}, {"peer", 12, 4, 1},
    {"tag", 16, 8, 1},          {"opcount", REC_OPCOUNT_OFF, 8, 0}, {"req_seq", 32, 8, 0},
    {"req_slot", 40, 4, 0},     {"buf_id", 44, 4, 1},         {"offset", 48, 8, 0},
    {"nbytes", 56, 8, 0},       {"count", 64, 8, 0},          {"buf2_id", 72, 4, 1},
    {"mem", REC_MEM_OFF, 4, 1}, {"offset2", 80, 8, 0},        {"nbytes2", 88, 8, 0},
    {"coll_seq", 96, 8, 0},     {"t_post", 104, 8, 0},        {"coll", 112, 8, 0},
    {"pair_seq", 120, 8, 0},
};
enum { NFIELDS = sizeof(FIELDS) / sizeof(FIELDS[0]) };
/* The slots Op.__init__ sets besides the record's */
enum { X_INDEX, X_TMAP, X_RANK, X_T_FETCH, NEXTRA };
static const char *EXTRA[NEXTRA] = {"index", "tmap", "rank", "t_fetch"};

static PyTypeObject *op_type;                  /* bound by bind_op; a strong reference */
static Py_ssize_t field_off[NFIELDS], extra_off[NEXTRA];
static PyObject *s_rank;

static Py_ssize_t slot_offset(PyTypeObject *t, const char *name) {
    PyObject *d = PyObject_GetAttrString((PyObject *)t, name);
    if (!d) return -1;
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) off = m->offset;
    }
    Py_DECREF(d);
    if (off < 0)
        PyErr_Format(PyExc_TypeError, "bind_op: %s.%s is not a writable __slots__ entry", t->tp_name, name);
    return off;
}

/* bind_op(cls): the class unpack_ops makes; its slots' offsets are looked up here, once. */
PyObject *_sn_bind_op(PyObject *self, PyObject *cls) {
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "bind_op: a class is needed");
        return NULL;
    }
    PyTypeObject *t = (PyTypeObject *)cls;
    Py_ssize_t fo[NFIELDS], xo[NEXTRA];   /* committed only once all are found: a refused class leaves
                                             the bound one as it was */
    for (int i = 0; i < NFIELDS; i++)
        if ((fo[i] = slot_offset(t, FIELDS[i].name)) < 0) return NULL;
    for (int i = 0; i < NEXTRA; i++)
        if ((xo[i] = slot_offset(t, EXTRA[i])) < 0) return NULL;
    if (!s_rank && !(s_rank = PyUnicode_InternFromString("rank"))) return NULL;
    memcpy(field_off, fo, sizeof fo);
    memcpy(extra_off, xo, sizeof xo);
    Py_INCREF(cls);
    Py_XSETREF(op_type, t);
    Py_RETURN_NONE;
}

static PyObject *field_value(const char *r, const Field *f) {
    switch (f->size) {
    case 1: return PyLong_FromLong(*(const uint8_t *)(r + f->off));
    case 4: {
        int32_t v;
        memcpy(&v, r + f->off, 4);
        return f->is_signed ? PyLong_FromLong(v) : PyLong_FromUnsignedLong((uint32_t)v);
    }
    default: {
        uint64_t v;
        memcpy(&v, r + f->off, 8);
        return f->is_signed ? PyLong_FromLongLong((long long)v) : PyLong_FromUnsignedLongLong(v);
    }
    }
}

static int set_slot(PyObject *obj, Py_ssize_t off, PyObject *value) {
    if (!value) return -1;
    PyObject **p = (PyObject **)((char *)obj + off);
    Py_XSETREF(*p, value);
    return 0;
}

/* The global rank of local rank `owner`: ranks[owner].rank, -1 where it never initialised. */
static PyObject *rank_of(PyObject *ranks, int32_t owner) {
    PyObject *key = PyLong_FromLong(owner);
    if (!key) return NULL;
    PyObject *info = PyDict_GetItemWithError(ranks, key);   /* borrowed */
    Py_DECREF(key);
    if (!info) return PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
    return PyObject_GetAttr(info, s_rank);
}

/*
 * unpack_ops(out, n, idx, ranks, t_fetch) -> [Op, ...]
 * `out`: the address of n records (take_posted's copy); `idx`: the address of their n int32 record
 * indices; `ranks`: the engine's {local rank: RankInfo}. Each op is what Op(index, fields, rank,
 * t_fetch) makes.
 */
PyObject *_sn_unpack_ops(PyObject *self, PyObject *args) {
    unsigned long long out, idx, t_fetch;
    Py_ssize_t n;
    PyObject *ranks;
    if (!PyArg_ParseTuple(args, "KnKO!K", &out, &n, &idx, &PyDict_Type, &ranks, &t_fetch)) return NULL;
    if (!op_type) {
        PyErr_SetString(PyExc_RuntimeError, "unpack_ops: bind_op was never called");
        return NULL;
    }
    if (n < 0 || (n && (!out || !idx))) {
        PyErr_SetString(PyExc_ValueError, "unpack_ops: a null address or a negative count");
        return NULL;
    }
    PyObject *list = PyList_New(n), *t = PyLong_FromUnsignedLongLong(t_fetch);
    if (!list || !t) goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        const char *r = (const char *)(uintptr_t)out + k * RECORD_BYTES;
        PyObject *op = op_type->tp_alloc(op_type, 0);
        if (!op) goto fail;
        PyList_SET_ITEM(list, k, op);   /* the list owns it from here, also on failure */
        int32_t owner, index;
        memcpy(&owner, r + REC_OWNER_OFF, 4);
        memcpy(&index, (const char *)(uintptr_t)idx + 4 * k, 4);
        for (int i = 0; i < NFIELDS; i++)
            if (set_slot(op, field_off[i], field_value(r, &FIELDS[i])) < 0) goto fail;
        if (set_slot(op, extra_off[X_INDEX], PyLong_FromLong(index)) < 0 ||
            set_slot(op, extra_off[X_RANK], rank_of(ranks, owner)) < 0)
            goto fail;
        set_slot(op, extra_off[X_TMAP], Py_NewRef(Py_None));
        set_slot(op, extra_off[X_T_FETCH], Py_NewRef(t));
    }
    Py_DECREF(t);
    return list;
fail:
    Py_XDECREF(t);
    Py_XDECREF(list);
    return NULL;
}
