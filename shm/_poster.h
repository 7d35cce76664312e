/*
 * What the translation units of shm._poster share: the op constants, the objects' layouts, and the
 * functions one file calls in another (prefixed _sp_). The module's design is in shm/_poster.c's header.
 *
 * _pool_lock.h keeps the lock spin (lock_spin_ns) in a static variable, so every file that includes it
 * has its own copy. Only _poster_type.c splices (splice_chain), and the module's set_lock_spin is that
 * file's _sp_set_lock_spin, so the setting reaches the copy the splice reads. The other files include
 * the header for PostedChain and mono_ns only; its static set_lock_spin entry is unused there, which is
 * why that warning is silenced around the include.
 */
#ifndef SHM_POSTER_H
#define SHM_POSTER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "_pool_layout.h"
#include "_fast.h"
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "_pool_lock.h"
#pragma GCC diagnostic pop

#define KIND_SEND 1  /* proxy/core/ops.py; checked at import by proxy/rank/lifecycle.py */
#define KIND_RECV 2
#define KIND_COLL 3
#define KIND_PROBE 4
#define FLAG_IN_PLACE 1      /* proxy/core/ops.py */
#define FLAG_NO_RECV 2
enum { COLL_BARRIER = 1, COLL_BCAST, COLL_REDUCE, COLL_ALLREDUCE, COLL_ALLGATHER, COLL_REDUCE_SCATTER_BLOCK,
       COLL_ALLTOALL };  /* proxy/coll/sched.py Coll */
enum { REDOP_SUM = 1, REDOP_PROD, REDOP_MIN, REDOP_MAX, REDOP_AVG };  /* proxy/coll/sched.py ReduceOp */
#define CODE_BOOL 1          /* proxy/core/ops.py dtype codes: bool, then integers, then float16.. */
#define CODE_FIRST_FLOAT 10

/* ------------------------------------------------------------------ objects */

typedef struct {
    PyObject_HEAD
    PyObject *comm, *keep, *stage, *error, *status, *extra;
    PyObject *poster;  /* the Poster that owns the slot (Wait/Test read it), or NULL */
    PyObject *weaklist;
    long long seq, tag, nbytes, user_addr;
    int slot, kind, peer;
    char done;
} RequestObject;

typedef struct { uintptr_t start, end; int32_t bid; } Range;

/* The collectives whose declined calls go to a Python path (a declined Send/Recv posts through
 * Isend/Irecv in C: _poster_fast.c, post_and_wait) */
enum { FAST_BARRIER, FAST_ALLREDUCE, FAST_BCAST, FAST_REDUCE, FAST_CALLS };

typedef struct {
    PyObject_HEAD
    /* pool addresses (the Comm keeps the mapping alive for the Poster's lifetime) */
    PostedChain chain;   /* the records, the posted chain, its mutex, the hand-off slots (_pool_lock.h) */
    volatile uint64_t *err, *abort, *posted;
    int local_rank, size, rank;  /* rank: the communicator's (a Reduce's root), set by rank/lifecycle.py */
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
    /* the fast path (shm/_fast.h, shm/_poster_fast.c, shm/_poster_coll.c): off until set_fast() */
    FastLayout fl;
    int32_t *local_of;      /* comm rank -> local rank, -2 until looked up (lookup_local) */
    uint64_t *slow_to;      /* comm rank -> sends to it posted to the progress process */
    PyObject *fast_fallback[FAST_CALLS];  /* Barrier, Allreduce, Bcast, Reduce: the Python paths */
    PyObject *fast_failed;  /* Comm._fast_failed(code, message): raises what a failed fast call must */
    PyObject *fast_check;   /* Comm._fast_check(): raises if the progress process is gone */
    uint64_t coll_n;        /* small collectives this rank ran on the fast path */
    double slice_s;         /* a sleep's bound between checks (WAIT_SLICE_MS) */
    unsigned rr;            /* where an ANY_SOURCE Recv starts looking, for fairness */
    /* the middle collectives through the ranks' numpy arenas (shm/_poster_coll.c): off until set_arena() */
    uint64_t mapped_bytes;  /* the largest taken that way (bytes per rank); 0: off */
    uint64_t mapped_min;    /* and the largest the cells keep */
    uint64_t mapped_min_reduce;   /* the same for a Reduce (its root alone reads every cell) */
    char *arena;            /* this process's arena, NULL where it has none */
    uint64_t arena_size;
    char *scratch;          /* 2 * mapped_bytes in the arena: an input and an output that lie outside it */
    char **peer_arena;      /* comm rank -> its arena mapped here (this rank's own: arena), NULL until then */
    uint64_t *peer_arena_size;
    uint64_t ref_min, ref_max;   /* a blocking Send of this many bytes from the arena goes by reference (0: off) */
    PyObject *ref_failed;   /* fastpath.ref_failed(code, dest, nbytes): raises what a failed one must */
    uint64_t ref_sent, ref_taken;   /* Sends written by reference, and such cells this rank's Recvs took */
    int proxy_fd;           /* a pidfd of the progress process (-1: none), and when it was last seen alive */
    long long proxy_checked;
} PosterObject;

/* The fields of a record that a post chooses; the owner, opCount, seq and slot come with the post. */
typedef struct {
    int kind, code, redop, flags, peer;
    int64_t tag;
    int32_t bid, bid2;
    int32_t mem;   /* memory kind | device << 8 (shmproxy/core/memory.py): 0, host, for every array this
                    * C path takes; anything else declines to Python, which refuses device arrays */
    uint64_t off, nbytes, count, off2, nbytes2, coll_seq, x1;
} Rec;

/* A registered, non-empty array: its code, element count and (bid, off, nbytes) in *where. */
typedef struct { int32_t bid; uint64_t off, nbytes; int code; long long count; } Located;

/* ------------------------------------------------------------------ _poster_request.c */

extern PyTypeObject _sp_RequestType, _sp_StatusType;
PyObject *_sp_new_status(int source, long long tag, long long nbytes);

/* ------------------------------------------------------------------ _poster_array.c */

int _sp_read_array(PosterObject *self, PyObject *obj, int writable, uintptr_t *addr, int *code,
                   long long *nbytes, long long *count);
int _sp_verify_layout(PosterObject *self, PyObject *probes);
Py_ssize_t _sp_find_range(PosterObject *self, uintptr_t addr, size_t n);
int _sp_locate(PosterObject *self, PyObject *arr, int writable, Located *where);
PyObject *_sp_Poster_set_ranges(PosterObject *self, PyObject *arg);

/* ------------------------------------------------------------------ _poster_type.c */

extern PyTypeObject _sp_PosterType;
int _sp_check_mapped(PosterObject *self);
void _sp_write_record(char *r, const Rec *f, int owner, uint64_t opcount, uint64_t seq, uint32_t slot);
PyObject *_sp_enqueue(PosterObject *self, int32_t index);
PyObject *_sp_set_lock_spin(PyObject *self, PyObject *arg);

/* ------------------------------------------------------------------ _poster_post.c */

PyObject *_sp_Poster_post(PosterObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *_sp_Poster_isend(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_irecv(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_iallreduce(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_ibarrier(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_ibcast(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_ireduce(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_iallgather(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_ireduce_scatter_block(PosterObject *self, PyObject *const *args, size_t nargsf,
                                           PyObject *kwnames);
PyObject *_sp_Poster_ialltoall(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_set_coll_fallback(PosterObject *self, PyObject *args);

/* ------------------------------------------------------------------ _poster_fast.c, _poster_coll.c */

void _sp_fast_stamp(PosterObject *self, char *record, const Rec *f);
int _sp_fast_usable(PosterObject *self);
int _sp_args(PyObject *const *args, size_t nargsf, PyObject *kwnames, const char *const *names, int nnames,
             PyObject **out);
PyObject *_sp_Poster_set_fast(PosterObject *self, PyObject *args);
PyObject *_sp_Poster_send(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_send_or_isend(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_recv(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_try_recv(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_barrier(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_allreduce(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_try_allreduce(PosterObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *_sp_Poster_bcast(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_reduce(PosterObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
PyObject *_sp_Poster_coll_fast(PosterObject *self, PyObject *args);
PyObject *_sp_Poster_set_arena(PosterObject *self, PyObject *args);
PyObject *_sp_Poster_coll_decline(PosterObject *self, PyObject *args);
void _sp_unmap_arenas(PosterObject *self);
int _sp_coll_init(void);
int _sp_map_arena(PosterObject *self, long x);
void _sp_fast_notify(FastLayout *f);
int _sp_fast_wait(PosterObject *self, int (*ready)(void *), void *arg, void (*before_sleep)(void *));
int _sp_in_arena(PosterObject *self, const char *p, uint64_t nb);   /* the range lies in this process's arena */
PyObject *_sp_Poster_set_ref(PosterObject *self, PyObject *args);
enum { CW_OK, CW_FAILED, CW_TIMEOUT, CW_MISMATCH, CW_GONE, CW_EXC };   /* what a fast-path wait ended in */
PyObject *_sp_fast_kernel(PyObject *self, PyObject *args);

#endif
