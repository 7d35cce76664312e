/*
 * The reduction kernel, shared by shm/_reduce.c (called from Python) and shm/_workers.c (called by
 * the progress process's worker threads, without the GIL). Its contract (order of operations, numpy
 * equality, aliasing, which pairs it takes) is described at the top of shm/_reduce.c.
 * Build with -ffp-contract=off: a fused multiply-add would round differently from numpy.
 */
#ifndef SHM_KERNEL_H
#define SHM_KERNEL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_copy.h"

#define BLOCK_BYTES 8192

enum { OP_SUM = 1, OP_PROD = 2, OP_MIN = 3, OP_MAX = 4, OP_AVG = 5, N_OPS = 6 };
enum {
    T_BOOL = 1, T_I8, T_U8, T_I16, T_U16, T_I32, T_U32, T_I64, T_U64, T_F16, T_F32, T_F64, T_C64, T_C128,
    N_TYPES
};

typedef struct { float re, im; } c64;
typedef struct { double re, im; } c128;
/* Each combine loop is compiled twice, for AVX2 and for baseline x86-64, and the loader picks one
 * (GCC function multiversioning): numpy dispatches the same way, and without it the kernel ran at
 * half numpy's speed on an AVX2 host. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KERNEL_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KERNEL_CLONES
#endif

typedef void (*combine_fn)(void *acc, const void *x, size_t n);

#define COMBINE(NAME, T, EXPR)                                        \
    KERNEL_CLONES static void NAME(void *acc_, const void *x_, size_t n) { \
        T *restrict acc = acc_;                                       \
        const T *restrict x = x_;                                     \
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
    KERNEL_CLONES static void sum_##SUF(void *acc_, const void *x_, size_t n) {             \
        T *restrict acc = acc_;                                                             \
        const T *restrict x = x_;                                                           \
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
        /* AVG: the sum, then a division; floating types only (proxy/coll/sched.py check_op) */
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

static void reduce_run(combine_fn fn, int op, int code, size_t count, char *const *srcs, size_t nsrc,
                       char *const *dsts, size_t ndst, int streaming) {
    _Alignas(64) char acc[BLOCK_BYTES];
    size_t isz = itemsize[code], per = BLOCK_BYTES / isz;
    for (size_t lo = 0; lo < count; lo += per) {
        size_t n = count - lo < per ? count - lo : per, off = lo * isz, nb = n * isz;
        memcpy(acc, srcs[0] + off, nb);
        for (size_t s = 1; s < nsrc; s++) fn(acc, srcs[s] + off, n);
        if (op == OP_AVG) divide(acc, code, n, (double)nsrc);
        for (size_t d = 0; d < ndst; d++) {
            if (streaming)
                copy_streaming_unfenced(dsts[d] + off, acc, nb, 1024);
            else
                memcpy(dsts[d] + off, acc, nb);
        }
    }
    if (streaming) streaming_fence();
}

/* The kernel for (op, code), or NULL when numpy must do it. */
static inline combine_fn kernel_for(int op, int code) {
    return (op > 0 && op < N_OPS && code > 0 && code < N_TYPES) ? table[op][code] : NULL;
}

#endif
