/*
 * shm._poster's view of the rank's memory: which arrays a fast post may take, and where they lie.
 *
 * Arrays: the Python buffer protocol costs hundreds of nanoseconds per numpy array (numpy builds a
 * format string), a large share of the budget, so the post reads the array's header directly: the
 * leading fields of numpy's PyArrayObject_fields and PyArray_Descr, unchanged from numpy 1.7 through 2.x. The
 * Poster checks that reading against probe arrays whose facts Python supplies; if it ever disagrees
 * (a future numpy), the fast path stays off (Poster.fast is False) and every post takes Python's.
 *
 * The registered ranges (set_ranges, from comm.alloc) say which buffer id and offset an address has;
 * an array outside them is staged by the Python path.
 */
#include "_poster.h"

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

/* Read an array's address, dtype code, bytes and element count; 0 when the fast path cannot take it. */
int _sp_read_array(PosterObject *self, PyObject *obj, int writable, uintptr_t *addr, int *code,
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
int _sp_verify_layout(PosterObject *self, PyObject *probes) {
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
        if (want_c && (!_sp_read_array(self, arr, 0, &addr, &code, &nbytes, &count) ||
                       addr != (uintptr_t)want_addr || nbytes != want_nbytes))
            return 0;
    }
    return 1;
}

/* Registered range holding [addr, addr + n): its index, or -1. */
Py_ssize_t _sp_find_range(PosterObject *self, uintptr_t addr, size_t n) {
    Py_ssize_t lo = 0, hi = self->nranges;
    while (lo < hi) {  /* first range with start > addr */
        Py_ssize_t mid = (lo + hi) / 2;
        if (self->ranges[mid].start <= addr) lo = mid + 1; else hi = mid;
    }
    if (lo == 0) return -1;
    Range *r = &self->ranges[lo - 1];
    return addr + n <= r->end ? lo - 1 : -1;
}

/* A registered, non-empty array where the fast path can take it: 1 and *where filled, else 0. */
int _sp_locate(PosterObject *self, PyObject *arr, int writable, Located *where) {
    uintptr_t addr; long long nb;
    if (Py_TYPE(arr) != self->ndarray ||
        !_sp_read_array(self, arr, writable, &addr, &where->code, &nb, &where->count) || nb <= 0)
        return 0;
    Py_ssize_t ri = _sp_find_range(self, addr, (size_t)nb);
    if (ri < 0) return 0;
    where->bid = self->ranges[ri].bid;
    where->off = addr - self->ranges[ri].start;
    where->nbytes = (uint64_t)nb;
    return 1;
}

/* set_ranges([(start, end, buf_id), ...] sorted by start): the rank's registered memory. */
PyObject *_sp_Poster_set_ranges(PosterObject *self, PyObject *arg) {
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
