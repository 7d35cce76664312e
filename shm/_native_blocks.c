/*
 * copy_blocks: the gather/scatter of a derived datatype's message, in the progress process.
 *
 * Each side of a copy is a block table (int64 pairs: byte displacement, byte length, in type-map
 * order) repeated every ``extent`` bytes: instance i of the type is the table shifted by i * extent.
 * A contiguous side is the table {(0, n)} with extent n. The copy walks both sides' byte streams at
 * once and moves the largest run both have contiguous, so the two tables may have different shapes as
 * long as the streams' lengths agree (the caller checked them and the buffers' bounds). Zero-length
 * blocks never reach here (the rank drops them when it flattens the type), so each step moves bytes.
 */
#include "_native.h"

#include <stdint.h>
#include <string.h>

typedef struct {
    char *base;              /* the buffer's first byte (the type's true lower bound) */
    const int64_t *tab;      /* nblocks x (displacement, length) */
    int64_t nblocks, extent;
    int64_t inst, block;     /* where the cursor is: instance, block within it */
    int64_t used;            /* bytes of the current block already moved */
} cursor;

static inline char *cur_ptr(const cursor *c) {
    return c->base + c->inst * c->extent + c->tab[2 * c->block] + c->used;
}

static inline int64_t cur_left(const cursor *c) { return c->tab[2 * c->block + 1] - c->used; }

static inline void cur_advance(cursor *c, int64_t n) {
    c->used += n;
    if (c->used == c->tab[2 * c->block + 1]) {
        c->used = 0;
        if (++c->block == c->nblocks) {
            c->block = 0;
            c->inst++;
        }
    }
}

static void copy_stream(cursor *d, cursor *s, int64_t n) {
    while (n > 0) {
        int64_t m = cur_left(d), k = cur_left(s);
        if (k < m) m = k;
        if (n < m) m = n;
        memmove(cur_ptr(d), cur_ptr(s), (size_t)m);
        cur_advance(d, m);
        cur_advance(s, m);
        n -= m;
    }
}

/* copy_blocks(dst, dst_table, dst_nblocks, dst_extent, src, src_table, src_nblocks, src_extent, nbytes):
 * the addresses are ints (raw pointers); the tables are int64 arrays. The GIL is released. */
PyObject *_sn_copy_blocks(PyObject *self, PyObject *args) {
    PyObject *dp, *dt, *sp, *st;
    long long dn, de, sn, se, n;
    if (!PyArg_ParseTuple(args, "OOLLOOLLL", &dp, &dt, &dn, &de, &sp, &st, &sn, &se, &n)) return NULL;
    cursor d = {PyLong_AsVoidPtr(dp), PyLong_AsVoidPtr(dt), dn, de, 0, 0, 0};
    cursor s = {PyLong_AsVoidPtr(sp), PyLong_AsVoidPtr(st), sn, se, 0, 0, 0};
    if (PyErr_Occurred()) return NULL;
    if (n < 0 || (n > 0 && (dn <= 0 || sn <= 0))) {
        PyErr_SetString(PyExc_ValueError, "copy_blocks: empty block table for a non-empty message");
        return NULL;
    }
    for (int64_t i = 0; i < dn + sn; i++) {
        const int64_t len = i < dn ? d.tab[2 * i + 1] : s.tab[2 * (i - dn) + 1];
        if (len <= 0) {
            PyErr_SetString(PyExc_ValueError, "copy_blocks: a block of no bytes");
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    copy_stream(&d, &s, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
