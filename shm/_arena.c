/*
 * shm._arena: numpy's array data born in registered memory (NEP 49), the C half of
 * shmproxy.rank.arena (which says when it is on and registers it).
 *
 * The arena is one memfd per process, sized once (sparse: no page exists until touched) and mapped
 * MAP_SHARED once. Every communicator the process opens registers that fd with its progress process
 * as it does a comm.alloc buffer, so an array whose data lies in the arena is zero-copy to every
 * operation. numpy asks the handler installed here for array data (PyDataMem_SetHandler, numpy >=
 * 1.22; the handler is a context variable: the thread that installs it and the contexts it starts):
 * requests of at least `min_bytes` come from the arena, smaller ones from libc as numpy's default.
 *
 * Allocator: power-of-two size classes from 64 KiB (a multiple of the page, which hole punching
 * wants), a free list per class; a class with none free carves its block from the arena's unused
 * top. Blocks never change class (no splitting, no coalescing): that costs virtual space, of which
 * the arena has plenty, never pages, since only the bytes an array touches are ever faulted in.
 * Physical memory: a freed block keeps its pages while the free blocks hold at most `keep_bytes`
 * in all, and gives them back past that (FALLOC_FL_PUNCH_HOLE). A calloc zeroes a block that kept
 * its pages by hand (punching it and faulting its pages in again costs several times more: shmem
 * has 4 KiB pages where numpy's own large arrays get huge ones); a fresh or punched block is zero.
 * A request the arena cannot place (its top reached) goes to libc, and is staged as before.
 * `units` holds, per 64 KiB of the arena, the class + 1 of the live block starting there (0: none):
 * a free's check that the pointer is one of ours, realloc's old size, and the live set.
 *
 * Locking: numpy may call the handler without the GIL (nothing promises it holds it), so a mutex
 * guards the allocator; the fork hook re-initialises it in the child (another thread may have held
 * it at the fork).
 *
 * fork: the child inherits the MAP_SHARED mapping, so its writes would reach the parent's arrays.
 * `after_fork_child` maps the memfd MAP_PRIVATE over the used part and anonymous memory over the
 * rest: the child's writes are its own, copied on write as malloc'd memory is; what differs from
 * malloc's snapshot is that a page the child has not written yet still shows the parent's later
 * writes (docs/decisions.md). The arena is then a plain allocator in the child, never registered.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 1U
#endif

#define UNIT_SHIFT 16                 /* 64 KiB: the smallest class */
#define UNIT ((size_t)1 << UNIT_SHIFT)
#define NCLASS 48                     /* classes 2^16 .. 2^63 */
#define API_FEATURE_VERSION 211       /* numpy's C API table: PyArray_GetNDArrayCFeatureVersion */
#define API_SET_HANDLER 304           /* PyDataMem_SetHandler (feature version 0xf, numpy 1.22) */
#define NPY_1_22_FEATURE 0xf

typedef struct {                      /* numpy's PyDataMemAllocator / PyDataMem_Handler, version 1 */
    void *ctx;
    void *(*malloc)(void *ctx, size_t size);
    void *(*calloc)(void *ctx, size_t nelem, size_t elsize);
    void *(*realloc)(void *ctx, void *ptr, size_t new_size);
    void (*free)(void *ctx, void *ptr, size_t size);
} MemAllocator;
typedef struct {
    char name[127];
    uint8_t version;
    MemAllocator allocator;
} MemHandler;

typedef struct {
    uint64_t *items;                  /* offset | 1 where the block still holds its pages */
    size_t n, cap;
} FreeList;

static struct {
    pthread_mutex_t lock;
    char *base;
    size_t size, top;                 /* bytes reserved; bytes carved so far */
    int fd;
    int forked;                       /* this process is a fork of the one that made the arena */
    size_t min_bytes, keep_bytes;
    size_t live_bytes, live_blocks, resident_free, fallbacks;
    uint8_t *units;                   /* size >> UNIT_SHIFT entries */
    FreeList free[NCLASS];
} A = {.lock = PTHREAD_MUTEX_INITIALIZER, .fd = -1};

static PyObject *previous;            /* the handler ours replaced (install / uninstall) */
static PyObject *(*set_handler)(PyObject *);

static int class_of(size_t n) {
    int c = 0;
    size_t s = UNIT;
    while (s < n && c < NCLASS - 1) { s <<= 1; c++; }
    return s >= n ? c : -1;
}

static int owns(const void *p) {
    return A.base && (const char *)p >= A.base && (const char *)p < A.base + A.size;
}

static void punch(size_t off, size_t n) {
    /* best effort: where punching is refused the pages stay, which is only memory. A forked child's
     * arena is private: dropping its pages would show the file's (the parent's) again, so it keeps them */
    if (!A.forked) (void)fallocate(A.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)n);
}

/* The block of class c at a fresh or freed place, or NULL; *resident: it may hold pages. */
static char *take(int c, int *resident) {
    size_t bytes = UNIT << c;
    FreeList *fl = &A.free[c];
    uint64_t off;
    if (fl->n) {
        off = fl->items[--fl->n];
        *resident = (int)(off & 1);
        off &= ~(uint64_t)1;
        if (*resident) A.resident_free -= bytes;
    } else {
        if (A.top + bytes > A.size || A.top + bytes < A.top) return NULL;
        off = A.top;
        A.top += bytes;
        *resident = 0;
    }
    A.units[off >> UNIT_SHIFT] = (uint8_t)(c + 1);
    A.live_bytes += bytes;
    A.live_blocks++;
    return A.base + off;
}

static void give(char *p) {
    size_t off = (size_t)(p - A.base);
    int c = A.units[off >> UNIT_SHIFT] - 1;
    if (c < 0 || (off & (UNIT - 1))) return;   /* not a block start: refuse quietly rather than corrupt */
    size_t bytes = UNIT << c;
    A.units[off >> UNIT_SHIFT] = 0;
    A.live_bytes -= bytes;
    A.live_blocks--;
    FreeList *fl = &A.free[c];
    if (fl->n == fl->cap) {
        size_t cap = fl->cap ? fl->cap * 2 : 16;
        uint64_t *items = realloc(fl->items, cap * sizeof(uint64_t));
        if (!items) { punch(off, bytes); return; }   /* the block is lost to reuse, not its memory */
        fl->items = items;
        fl->cap = cap;
    }
    int resident = A.resident_free + bytes <= A.keep_bytes;
    if (resident) A.resident_free += bytes;
    else punch(off, bytes);
    fl->items[fl->n++] = (uint64_t)off | (uint64_t)resident;
}

/* A block of at least n bytes, zeroed if asked, or NULL where the arena has no room. */
static char *block(size_t n, int zero) {
    int c = class_of(n ? n : 1), resident = 0;
    char *p = NULL;
    if (c >= 0) {
        pthread_mutex_lock(&A.lock);
        p = take(c, &resident);
        if (!p) A.fallbacks++;
        pthread_mutex_unlock(&A.lock);
    }
    if (p && zero && (resident || A.forked)) memset(p, 0, n);   /* else fresh or punched: zero already */
    return p;
}

static void *arena_malloc(void *ctx, size_t n) {
    (void)ctx;
    char *p = n >= A.min_bytes && A.base ? block(n, 0) : NULL;
    return p ? p : malloc(n ? n : 1);
}

static void *arena_calloc(void *ctx, size_t nelem, size_t elsize) {
    (void)ctx;
    if (elsize && nelem > SIZE_MAX / elsize) return NULL;
    size_t n = nelem * elsize;
    char *p = n >= A.min_bytes && A.base ? block(n, 1) : NULL;
    return p ? p : calloc(nelem ? nelem : 1, elsize ? elsize : 1);
}

static void arena_free(void *ctx, void *p, size_t n) {
    (void)ctx; (void)n;
    if (!owns(p)) { free(p); return; }
    pthread_mutex_lock(&A.lock);
    give(p);
    pthread_mutex_unlock(&A.lock);
}

static void *arena_realloc(void *ctx, void *p, size_t n) {
    if (!p) return arena_malloc(ctx, n);
    if (!owns(p)) return realloc(p, n);
    pthread_mutex_lock(&A.lock);
    int c = A.units[(size_t)((char *)p - A.base) >> UNIT_SHIFT] - 1;
    pthread_mutex_unlock(&A.lock);
    size_t have = c >= 0 ? UNIT << c : 0;
    if (n <= have && n >= A.min_bytes) return p;   /* fits its block still */
    void *q = arena_malloc(ctx, n);
    if (!q) return NULL;
    memcpy(q, p, n < have ? n : have);
    arena_free(ctx, p, have);
    return q;
}

static MemHandler handler = {
    "shmproxy_arena", 1, {NULL, arena_malloc, arena_calloc, arena_realloc, arena_free}};

/* ---- Python API ---------------------------------------------------------------------------- */

static PyObject *py_create(PyObject *self, PyObject *args) {
    unsigned long long size, min_bytes, keep_bytes;
    if (!PyArg_ParseTuple(args, "KKK", &size, &min_bytes, &keep_bytes)) return NULL;
    if (A.base) { PyErr_SetString(PyExc_RuntimeError, "the arena exists already"); return NULL; }
    size = (size + UNIT - 1) & ~(unsigned long long)(UNIT - 1);
    if (!size) { PyErr_SetString(PyExc_ValueError, "arena size 0"); return NULL; }
    int fd = memfd_create("shmproxy-arena", MFD_CLOEXEC);
    if (fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
    if (ftruncate(fd, (off_t)size) < 0) { int e = errno; close(fd); errno = e; return PyErr_SetFromErrno(PyExc_OSError); }
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (base == MAP_FAILED) { int e = errno; close(fd); errno = e; return PyErr_SetFromErrno(PyExc_OSError); }
    uint8_t *units = calloc(size >> UNIT_SHIFT, 1);
    if (!units) { munmap(base, size); close(fd); return PyErr_NoMemory(); }
    pthread_mutex_lock(&A.lock);
    A.base = base; A.size = size; A.top = 0; A.fd = fd; A.units = units;
    A.min_bytes = min_bytes < UNIT ? UNIT : min_bytes;
    A.keep_bytes = keep_bytes;
    pthread_mutex_unlock(&A.lock);
    return Py_BuildValue("iK", fd, (unsigned long long)(uintptr_t)base);
}

static int find_set_handler(void) {
    if (set_handler) return 0;
    PyObject *mod = PyImport_ImportModule("numpy._core._multiarray_umath");
    if (!mod && PyErr_ExceptionMatches(PyExc_ModuleNotFoundError)) {
        PyErr_Clear();
        mod = PyImport_ImportModule("numpy.core._multiarray_umath");
    }
    if (!mod) return -1;
    PyObject *cap = PyObject_GetAttrString(mod, "_ARRAY_API");
    Py_DECREF(mod);
    if (!cap) return -1;
    void **api = PyCapsule_GetPointer(cap, NULL);
    Py_DECREF(cap);
    if (!api) return -1;
    unsigned int feature = ((unsigned int (*)(void))api[API_FEATURE_VERSION])();
    if (feature < NPY_1_22_FEATURE) {
        PyErr_Format(PyExc_RuntimeError, "numpy's C API feature version %u has no memory handlers (1.22+)", feature);
        return -1;
    }
    set_handler = (PyObject * (*)(PyObject *))api[API_SET_HANDLER];
    return 0;
}

static PyObject *py_install(PyObject *self, PyObject *unused) {
    if (!A.base) { PyErr_SetString(PyExc_RuntimeError, "no arena"); return NULL; }
    if (find_set_handler() < 0) return NULL;
    PyObject *cap = PyCapsule_New(&handler, "mem_handler", NULL);
    if (!cap) return NULL;
    PyObject *old = set_handler(cap);
    Py_DECREF(cap);
    if (!old) return NULL;
    Py_XSETREF(previous, old);
    Py_RETURN_NONE;
}

static PyObject *py_uninstall(PyObject *self, PyObject *unused) {
    if (!previous) Py_RETURN_NONE;
    if (find_set_handler() < 0) return NULL;
    PyObject *old = set_handler(previous);
    if (!old) return NULL;
    Py_DECREF(old);
    Py_CLEAR(previous);
    Py_RETURN_NONE;
}

static PyObject *py_configure(PyObject *self, PyObject *args) {
    unsigned long long min_bytes, keep_bytes;
    if (!PyArg_ParseTuple(args, "KK", &min_bytes, &keep_bytes)) return NULL;
    pthread_mutex_lock(&A.lock);
    A.min_bytes = min_bytes < UNIT ? UNIT : min_bytes;
    A.keep_bytes = keep_bytes;
    pthread_mutex_unlock(&A.lock);
    Py_RETURN_NONE;
}

static PyObject *py_stats(PyObject *self, PyObject *unused) {
    pthread_mutex_lock(&A.lock);
    size_t nfree = 0;
    for (int c = 0; c < NCLASS; c++) nfree += A.free[c].n;
    PyObject *d = Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsi}", "base", (unsigned long long)(uintptr_t)A.base, "size", (unsigned long long)A.size,
        "top", (unsigned long long)A.top, "live_bytes", (unsigned long long)A.live_bytes,
        "live_blocks", (unsigned long long)A.live_blocks, "free_blocks", (unsigned long long)nfree,
        "resident_free", (unsigned long long)A.resident_free, "fallbacks", (unsigned long long)A.fallbacks,
        "min_bytes", (unsigned long long)A.min_bytes, "forked", A.forked);
    pthread_mutex_unlock(&A.lock);
    return d;
}

static PyObject *py_owns(PyObject *self, PyObject *arg) {
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(owns((void *)(uintptr_t)addr));
}

static PyObject *py_block(PyObject *self, PyObject *args) {
    unsigned long long n;
    int zero;
    if (!PyArg_ParseTuple(args, "Kp", &n, &zero)) return NULL;
    char *p = A.base ? block(n, zero) : NULL;
    if (!p) { PyErr_SetString(PyExc_MemoryError, "no room in the arena"); return NULL; }
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)p);
}

static PyObject *py_release(PyObject *self, PyObject *arg) {
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    arena_free(NULL, (void *)(uintptr_t)addr, 0);
    Py_RETURN_NONE;
}

static PyObject *py_after_fork_child(PyObject *self, PyObject *unused) {
    pthread_mutex_init(&A.lock, NULL);
    if (!A.base || A.forked) Py_RETURN_NONE;
    A.forked = 1;
    if (A.top && mmap(A.base, A.top, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, A.fd, 0)
                     == MAP_FAILED)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (A.size > A.top && mmap(A.base + A.top, A.size - A.top, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED)
        return PyErr_SetFromErrno(PyExc_OSError);
    close(A.fd);   /* the child's mapping no longer needs the file; its pages are its own from here */
    A.fd = -1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"create", py_create, METH_VARARGS, "create(size, min_bytes, keep_bytes) -> (fd, base): the arena, once"},
    {"install", py_install, METH_NOARGS, "numpy's array data from the arena in this context from now on"},
    {"uninstall", py_uninstall, METH_NOARGS, "numpy's handler before install back (arrays made keep theirs)"},
    {"configure", py_configure, METH_VARARGS, "configure(min_bytes, keep_bytes)"},
    {"stats", py_stats, METH_NOARGS, "the allocator's counters"},
    {"owns", py_owns, METH_O, "owns(addr) -> whether addr lies in the arena"},
    {"block", py_block, METH_VARARGS, "block(nbytes, zero) -> the address of a block of the arena, for shmproxy"},
    {"release", py_release, METH_O, "release(addr): a block back"},
    {"after_fork_child", py_after_fork_child, METH_NOARGS, "make the arena private in a forked child"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_arena", NULL, -1, methods};

PyMODINIT_FUNC PyInit__arena(void) { return PyModule_Create(&module); }
