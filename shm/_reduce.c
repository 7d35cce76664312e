/*
 * shm._reduce: the reduction kernel of collective schedules (REDUCE entries of proxy/sched.py).
 *
 *   reduce(op, code, count, srcs, dsts, streaming)
 *     for every element i: acc = srcs[0][i] op srcs[1][i] op ... (in that order), divided by
 *     len(srcs) for AVG, then stored to dsts[0][i], dsts[1][i], ...
 *
 * Why compiled: with numpy a chunk of an 8-rank Allreduce was 14 calls (7 ufuncs, 7 copies), each
 * retaking the GIL, and the progress process's copy workers spent their time queueing for it: on the
 * 32-core GPU host 512 KiB chunks gave 4.0 GB/s bus bandwidth where 2 MiB chunks (4x fewer GIL
 * round trips) gave 7.4 (BENCHMARKS.md). Here a chunk is one call, without the GIL.
 *
 * Block by block: BLOCK_BYTES of every source are reduced into a small buffer that stays in L1 and
 * written to every destination before the next block is read. Each input is read once and each
 * output written once, and a destination may alias a source (in-place Allreduce: a rank's receive
 * buffer is its send buffer), since a block is read whole before any of it is written.
 *
 * Same results as numpy's ufuncs, element for element: the same order of operations and rounding
 * (built with -ffp-contract=off, so no fused multiply-add), integer arithmetic wraps (done in
 * unsigned types), MIN/MAX return a NaN operand like np.minimum/np.maximum, bool MIN/MAX are and/or.
 * float16, complex products (numpy fuses them with FMA where the CPU has it, so only numpy itself
 * matches numpy there) and complex MIN/MAX stay with numpy: supported() says which.
 *
 * dtype and op codes are proxy/ops.py's and proxy/sched.py's (ReduceOp); tests/test_units.py checks
 * every supported pair against numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_copy.h"

#define BLOCK_BYTES 8192
#define GIL_FREE_BYTES (64 * 1024)

enum { OP_SUM = 1, OP_PROD = 2, OP_MIN = 3, OP_MAX = 4, OP_AVG = 5, N_OPS = 6 };
enum {
    T_BOOL = 1, T_I8, T_U8, T_I16, T_U16, T_I32, T_U32, T_I64, T_U64, T_F16, T_F32, T_F64, T_C64, T_C128,
    N_TYPES
};

typedef struct { float re, im; } c64;
typedef struct { double re, im; } c128;
typedef void (*combine_fn)(void *acc, const void *x, size_t n);

#define COMBINE(NAME, T, EXPR)                                        \
    static void NAME(void *acc_, const void *x_, size_t n) {          \
        T *acc = acc_;                                                \
        const T *x = x_;                                              \
        for (size_t i = 0; i < n; i++) {                              \
            T a = acc[i], b = x[i];                                   \
            acc[i] = (EXPR);                                          \
        }                                                             \
    }

/* Sums and products in unsigned types: two's complement wrap-around, like numpy. */
COMBINE(sum_u8, uint8_t, (uint8_t)(a + b))
COMBINE(sum_u16, uint16_t, (uint16_t)(a + b))
COMBINE(sum_u32, uint32_t, a + b)
COMBINE(sum_u64, uint64_t, a + b)
COMBINE(sum_f32, float, a + b)
COMBINE(sum_f64, double, a + b)
COMBINE(prod_u8, uint8_t, (uint8_t)((uint32_t)a * b))
COMBINE(prod_u16, uint16_t, (uint16_t)((uint32_t)a * b))
COMBINE(prod_u32, uint32_t, a * b)
COMBINE(prod_u64, uint64_t, a * b)
COMBINE(prod_f32, float, a * b)
COMBINE(prod_f64, double, a * b)

#define MINMAX(T, SUF)                                     \
    COMBINE(min_##SUF, T, (b < a ? b : a))                 \
    COMBINE(max_##SUF, T, (b > a ? b : a))
MINMAX(int8_t, i8)
MINMAX(uint8_t, u8)
MINMAX(int16_t, i16)
MINMAX(uint16_t, u16)
MINMAX(int32_t, i32)
MINMAX(uint32_t, u32)
MINMAX(int64_t, i64)
MINMAX(uint64_t, u64)
/* np.minimum/np.maximum: a NaN operand wins. */
COMBINE(min_f32, float, ((a < b || a != a) ? a : b))
COMBINE(max_f32, float, ((a > b || a != a) ? a : b))
COMBINE(min_f64, double, ((a < b || a != a) ? a : b))
COMBINE(max_f64, double, ((a > b || a != a) ? a : b))

#define COMPLEX(T, SUF)                                                                     \
    static void sum_##SUF(void *acc_, const void *x_, size_t n) {                           \
        T *acc = acc_;                                                                      \
        const T *x = x_;                                                                    \
        for (size_t i = 0; i < n; i++) {                                                    \
            acc[i].re = acc[i].re + x[i].re;                                                \
            acc[i].im = acc[i].im + x[i].im;                                                \
        }                                                                                   \
    }
COMPLEX(c64, c64)
COMPLEX(c128, c128)

static combine_fn table[N_OPS][N_TYPES];
static size_t itemsize[N_TYPES];

static void init_tables(void) {
    static const size_t sizes[N_TYPES] = {0, 1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 4, 8, 8, 16};
    memcpy(itemsize, sizes, sizeof(sizes));
    combine_fn sum[N_TYPES] = {0, NULL, sum_u8, sum_u8, sum_u16, sum_u16, sum_u32, sum_u32, sum_u64, sum_u64,
                               NULL, sum_f32, sum_f64, sum_c64, sum_c128};
    combine_fn prod[N_TYPES] = {0, NULL, prod_u8, prod_u8, prod_u16, prod_u16, prod_u32, prod_u32, prod_u64,
                                prod_u64, NULL, prod_f32, prod_f64, NULL, NULL};
    combine_fn mn[N_TYPES] = {0, min_u8, min_i8, min_u8, min_i16, min_u16, min_i32, min_u32, min_i64, min_u64,
                              NULL, min_f32, min_f64, NULL, NULL};
    combine_fn mx[N_TYPES] = {0, max_u8, max_i8, max_u8, max_i16, max_u16, max_i32, max_u32, max_i64, max_u64,
                              NULL, max_f32, max_f64, NULL, NULL};
    for (int t = 0; t < N_TYPES; t++) {
        table[OP_SUM][t] = sum[t];
        table[OP_PROD][t] = prod[t];
        table[OP_MIN][t] = mn[t];
        table[OP_MAX][t] = mx[t];
        /* AVG: the sum, then a division; floating types only (proxy/sched.py check_op) */
        table[OP_AVG][t] = (t >= T_F32) ? sum[t] : NULL;
    }
}

static void divide(void *acc, int code, size_t n, double by) {
    switch (code) {
    case T_F32: { float *a = acc; float d = (float)by; for (size_t i = 0; i < n; i++) a[i] = a[i] / d; break; }
    case T_F64: { double *a = acc; for (size_t i = 0; i < n; i++) a[i] = a[i] / by; break; }
    case T_C64: {
        c64 *a = acc; float d = (float)by;
        for (size_t i = 0; i < n; i++) { a[i].re = a[i].re / d; a[i].im = a[i].im / d; }
        break;
    }
    case T_C128: {
        c128 *a = acc;
        for (size_t i = 0; i < n; i++) { a[i].re = a[i].re / by; a[i].im = a[i].im / by; }
        break;
    }
    }
}

static void run(combine_fn fn, int op, int code, size_t count, char **srcs, Py_ssize_t nsrc, char **dsts,
                Py_ssize_t ndst, int streaming) {
    _Alignas(64) char acc[BLOCK_BYTES];
    size_t isz = itemsize[code], per = BLOCK_BYTES / isz;
    for (size_t lo = 0; lo < count; lo += per) {
        size_t n = count - lo < per ? count - lo : per, off = lo * isz, nb = n * isz;
        memcpy(acc, srcs[0] + off, nb);
        for (Py_ssize_t s = 1; s < nsrc; s++) fn(acc, srcs[s] + off, n);
        if (op == OP_AVG) divide(acc, code, n, (double)nsrc);
        for (Py_ssize_t d = 0; d < ndst; d++) {
            if (streaming)
                copy_streaming_unfenced(dsts[d] + off, acc, nb, 1024);
            else
                memcpy(dsts[d] + off, acc, nb);
        }
    }
    if (streaming) streaming_fence();
}

/* Addresses of a sequence of ints into a new array (PyMem), or NULL with an exception. */
static char **addresses(PyObject *seq_obj, Py_ssize_t *n, const char *what) {
    PyObject *seq = PySequence_Fast(seq_obj, what);
    if (!seq) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    char **out = PyMem_Malloc(sizeof(char *) * (*n ? *n : 1));
    if (!out) { Py_DECREF(seq); PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < *n; i++) {
        out[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(seq, i));
        if (!out[i] && PyErr_Occurred()) { PyMem_Free(out); Py_DECREF(seq); return NULL; }
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *py_supported(PyObject *self, PyObject *args) {
    int op, code;
    if (!PyArg_ParseTuple(args, "ii", &op, &code)) return NULL;
    return PyBool_FromLong(op > 0 && op < N_OPS && code > 0 && code < N_TYPES && table[op][code] != NULL);
}

static PyObject *py_reduce(PyObject *self, PyObject *args) {
    int op, code, streaming;
    unsigned long long count;
    PyObject *srcs_obj, *dsts_obj;
    if (!PyArg_ParseTuple(args, "iiKOOp", &op, &code, &count, &srcs_obj, &dsts_obj, &streaming)) return NULL;
    if (op <= 0 || op >= N_OPS || code <= 0 || code >= N_TYPES || !table[op][code]) {
        PyErr_Format(PyExc_ValueError, "reduce: op %d on dtype code %d is not supported here", op, code);
        return NULL;
    }
    Py_ssize_t nsrc, ndst;
    char **srcs = addresses(srcs_obj, &nsrc, "srcs must be a sequence of addresses");
    if (!srcs) return NULL;
    char **dsts = addresses(dsts_obj, &ndst, "dsts must be a sequence of addresses");
    if (!dsts) { PyMem_Free(srcs); return NULL; }
    if (nsrc < 1) {
        PyMem_Free(srcs); PyMem_Free(dsts);
        PyErr_SetString(PyExc_ValueError, "reduce needs at least one source");
        return NULL;
    }
    combine_fn fn = table[op][code];
    if (count * itemsize[code] * (size_t)(nsrc + ndst) >= GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        run(fn, op, code, (size_t)count, srcs, nsrc, dsts, ndst, streaming);
        Py_END_ALLOW_THREADS
    } else {
        run(fn, op, code, (size_t)count, srcs, nsrc, dsts, ndst, streaming);
    }
    PyMem_Free(srcs);
    PyMem_Free(dsts);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"reduce", py_reduce, METH_VARARGS,
     "reduce(op, code, count, srcs, dsts, streaming): dsts[j][i] = op over srcs[k][i] (see the module)"},
    {"supported", py_supported, METH_VARARGS, "supported(op, code) -> whether reduce() takes the pair"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "shm._reduce", NULL, -1, methods};

PyMODINIT_FUNC PyInit__reduce(void) {
    init_tables();
    return PyModule_Create(&moddef);
}
