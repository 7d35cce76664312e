/*
 * shm._native, continued: armed routes, the loop's launch of a repeated device message at the fetch
 * of its second half (proxy/engine/armed.py has the protocol and the rules that make it safe).
 *
 * A message between the same two device buffers that ran last time as a publishing graph
 * (transports/cuda_publish.py) will most likely run again. The loop arms an entry for it: both halves'
 * records, field for field, and the graph's launch. Either one half already waits in matching
 * (ARM_ARMED: its completion item is in the entry), or neither has come yet (ARM_PAIR). fire_armed,
 * called right after the loop took the posted chain and before any of it becomes Python objects,
 * scans the taken records in order. A record equal to a pair's half is claimed (ARM_HALF: the loop
 * holds it out of matching); a record equal to the other half of an entry holding one fires it (the
 * slots, the cell and cuGraphLaunch, as publish_launch does), and the copy runs while Python does the
 * bookkeeping of the match. A record that may change what the halves match voids the entry (see
 * interferes), as does a half that cannot go now: a fast-path cell waiting for the receiver, another
 * device current on the loop thread, the graph relaunched since the arming or its last run not acked.
 * A voided or fired entry is the loop's to free (and a claimed half to put in matching, in its place);
 * a collective's record touches no entry.
 *
 * Entry layout: ARM_WORDS u64 words (the engine checks ARMED_LAYOUT against its own names).
 */
#include "_native.h"

#include <stdint.h>
#include <time.h>

#include "_pool_layout.h"

enum {
    A_STATE,                         /* ARM_FREE; ARM_ARMED, ARM_PAIR (loop); ARM_HALF, ARM_FIRED, ARM_VOID */
    A_SEND,                          /* the send's record: kind, owner, peer, tag, dtype, flags, buffer, */
    A_RECV = A_SEND + 10,            /*   offset, bytes, memory; then the receive's */
    A_HELD = A_RECV + 10,            /* the half waiting (HELD_SEND, HELD_RECV; 0 for a pair) */
    A_HELD_SLOT, A_HELD_SEQ,         /* its completion slot and sequence number */
    A_HELD_POS,                      /* ARM_HALF: its record's place in this batch */
    A_MSG_BYTES,                     /* the message's bytes, as both slots say */
    A_DEVICE, A_ACK, A_LAST_TOKEN,   /* the graph's device, ack word, and its last run */
    A_CELL, A_DELTA, A_EXE, A_STREAM, A_RUNS,   /* its cell, the slots' device delta, its launch; tokens */
    A_CELLS,                         /* the receiver's cell counters (written, taken, drained), 0: none */
    A_POS, A_TOKEN, A_PUBLISHED, A_RC, A_T_FIRE,   /* out, once fired */
    ARM_WORDS
};
enum { ARM_FREE, ARM_ARMED, ARM_PAIR, ARM_HALF, ARM_FIRED, ARM_VOID };
enum { HELD_SEND = 1, HELD_RECV = 2 };
enum { F_KIND, F_OWNER, F_PEER, F_TAG, F_DTYPE, F_FLAGS, F_BUF, F_OFFSET, F_NBYTES, F_MEM };
enum { KIND_SEND = 1, KIND_RECV = 2, KIND_COLL = 3, KIND_CANCEL = 5 };   /* core/ops.py */

/* The record fields an entry compares (shm/pool.py RECORD; _native_ops.c lists them all). */
#define R_U8(r, off) (*(const uint8_t *)((r) + (off)))
#define R_I32(r, off) (*(const int32_t *)((r) + (off)))
#define R_U32(r, off) (*(const uint32_t *)((r) + (off)))
#define R_U64(r, off) (*(const uint64_t *)((r) + (off)))
#define R_KIND(r) R_U8(r, 4)
#define R_OWNER(r) ((int64_t)R_I32(r, REC_OWNER_OFF))
#define R_PEER(r) ((int64_t)R_I32(r, 12))

static int same(const uint64_t *f, const char *r) {
    return R_KIND(r) == f[F_KIND] && R_OWNER(r) == (int64_t)f[F_OWNER] && R_PEER(r) == (int64_t)f[F_PEER] &&
           R_U64(r, 16) == f[F_TAG] && R_U8(r, 5) == f[F_DTYPE] && R_U8(r, 7) == f[F_FLAGS] &&
           (int64_t)R_I32(r, 44) == (int64_t)f[F_BUF] && R_U64(r, 48) == f[F_OFFSET] &&
           R_U64(r, 56) == f[F_NBYTES] && (int64_t)R_I32(r, REC_MEM_OFF) == (int64_t)f[F_MEM];
}

/* Which half `r` is, of an entry still waiting for it (HELD_SEND, HELD_RECV), or 0. */
static int half_of(const uint64_t *e, const char *r) {
    if (e[A_HELD] != HELD_SEND && same(e + A_SEND, r)) return HELD_SEND;
    if (e[A_HELD] != HELD_RECV && same(e + A_RECV, r)) return HELD_RECV;
    return 0;
}

/* Whether `r`, not a half of the entry, may change what the entry's halves match: any receive, probe
 * or cancel of the receiver, and any send or cancel of the sender to the receiver's rank. */
static int interferes(const uint64_t *e, const char *r) {
    int64_t owner = R_OWNER(r);
    unsigned kind = R_KIND(r);
    if (owner == (int64_t)e[A_RECV + F_OWNER]) return kind != KIND_SEND;
    if (owner == (int64_t)e[A_SEND + F_OWNER])
        return kind == KIND_CANCEL || (kind == KIND_SEND && R_PEER(r) == (int64_t)e[A_SEND + F_PEER]);
    return 0;
}

/* No fast-path cell waits for the receiver: one written before the send matches first, and a receive
 * takes the cells to its rank first (engine/fastpath.py cells_waiting). */
static int cells_idle(const uint64_t *e) {
    if (!e[A_CELLS]) return 1;
    const uint64_t *q = (const uint64_t *)(uintptr_t)e[A_CELLS];
    return __atomic_load_n(&q[0], __ATOMIC_ACQUIRE) ==
           __atomic_load_n(&q[1], __ATOMIC_ACQUIRE) + __atomic_load_n(&q[2], __ATOMIC_ACQUIRE);
}

static int can_launch(const uint64_t *e, long long device) {
    if ((long long)e[A_DEVICE] != device) return 0;
    /* the graph not launched since the arming (the cell's token is its last launch's) and that run done */
    if (((volatile uint64_t *)(uintptr_t)e[A_CELL])[1] != e[A_LAST_TOKEN]) return 0;
    return __atomic_load_n((uint64_t *)(uintptr_t)e[A_ACK], __ATOMIC_ACQUIRE) >= e[A_LAST_TOKEN];
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Launch entry `e`'s graph for its held half and record `r` (the other): both requests' slots, the cell,
 * cuGraphLaunch, as publish_launch does; the receive's item first. */
static void fire(uint64_t *e, const char *r, int half, Py_ssize_t pos, uint64_t slots, long long max_ops,
                 uint64_t launch) {
    long long slot[2], rseq[2], source[2], owner[2];
    uint64_t tag[2];
    int ri = half == HELD_RECV ? 0 : 1, hi = 1 - ri;   /* the record's item and the held half's */
    slot[ri] = R_U32(r, 40), rseq[ri] = (long long)R_U64(r, 32), owner[ri] = R_OWNER(r);
    slot[hi] = (long long)e[A_HELD_SLOT], rseq[hi] = (long long)e[A_HELD_SEQ];
    owner[hi] = (long long)e[(e[A_HELD] == HELD_RECV ? A_RECV : A_SEND) + F_OWNER];
    source[0] = (long long)e[A_RECV + F_PEER];   /* the receive's: the sender's rank */
    source[1] = (long long)e[A_SEND + F_PEER];   /* the send's: the receiver's rank */
    tag[0] = tag[1] = e[A_SEND + F_TAG];
    int ok = 1;   /* as publish_launch: every slot in its owner's region, or the loop completes both */
    for (int i = 0; i < 2; i++) ok &= owner[i] >= 0 && slot[i] >= 0 && slot[i] / max_ops == owner[i];
    uint64_t *runs = (uint64_t *)(uintptr_t)e[A_RUNS];
    uint64_t token = ++*runs;
    _sn_fill_cell(slots, e[A_CELL], token, e[A_DELTA], e[A_MSG_BYTES], ok ? 2 : 0, slot, rseq, source, tag);
    graph_launch_fn graph_launch = (graph_launch_fn)(uintptr_t)launch;
    int rc = graph_launch((void *)(uintptr_t)e[A_EXE], (void *)(uintptr_t)e[A_STREAM]);
    e[A_POS] = (uint64_t)pos;
    e[A_TOKEN] = token;
    e[A_PUBLISHED] = (uint64_t)ok;
    e[A_RC] = (uint64_t)(uint32_t)rc;
    e[A_T_FIRE] = now_ns();
    e[A_STATE] = ARM_FIRED;
}

static int append_index(PyObject *list, Py_ssize_t k) {
    PyObject *x = PyLong_FromSsize_t(k);
    int rc = x ? PyList_Append(list, x) : -1;
    Py_XDECREF(x);
    return rc;
}

/*
 * fire_armed(table, nentries, records, first, n, slots, max_ops, device, launch)
 *     -> ([fired], [claimed])
 * `table`: nentries entries of ARM_WORDS u64; `records`: the records the loop took (RECORD_BYTES
 * each, in posting order), of which those from `first` to `n` are new (a second take of the same
 * fetch follows the first's, and places count from the first); `slots`: the completion slots'
 * address here; `device`: the device current on the calling thread; `launch`: cuGraphLaunch. A pair
 * entry's first half is *claimed* (ARM_HALF, A_HELD_POS): the loop keeps that op out of matching
 * while the entry holds it, and puts it in matching in its place if the entry is voided. Runs with
 * the GIL held: a launch is microseconds.
 */
PyObject *_sn_fire_armed(PyObject *self, PyObject *args) {
    unsigned long long table, records, slots, launch;
    Py_ssize_t nentries, first, n;
    long long max_ops, device;
    if (!PyArg_ParseTuple(args, "KnKnnKLLK", &table, &nentries, &records, &first, &n, &slots, &max_ops,
                          &device, &launch))
        return NULL;
    if (!table || !records || !slots || !launch || max_ops <= 0 || nentries < 0 || first < 0) {
        PyErr_SetString(PyExc_ValueError, "fire_armed: null address, max_ops <= 0 or a negative count");
        return NULL;
    }
    uint64_t *t = (uint64_t *)(uintptr_t)table;
    PyObject *fired = PyList_New(0), *claimed = PyList_New(0);
    if (!fired || !claimed) goto fail;
    for (Py_ssize_t i = first; i < n; i++) {
        const char *r = (const char *)(uintptr_t)(records + (uint64_t)i * RECORD_BYTES);
        if (R_KIND(r) == KIND_COLL) continue;
        int used = 0;   /* a record is one entry's half at most */
        for (Py_ssize_t k = 0; k < nentries; k++) {
            uint64_t *e = t + k * ARM_WORDS;
            uint64_t state = e[A_STATE];
            if (state != ARM_ARMED && state != ARM_PAIR && state != ARM_HALF) continue;
            int half = used ? 0 : half_of(e, r);
            if (!half) {
                if (interferes(e, r)) e[A_STATE] = ARM_VOID;
                continue;
            }
            used = 1;
            if (!cells_idle(e)) {
                e[A_STATE] = ARM_VOID;
            } else if (state == ARM_PAIR) {
                e[A_HELD] = (uint64_t)half;
                e[A_HELD_SLOT] = R_U32(r, 40);
                e[A_HELD_SEQ] = R_U64(r, 32);
                e[A_HELD_POS] = (uint64_t)i;
                e[A_STATE] = ARM_HALF;
                if (append_index(claimed, k) < 0) goto fail;
            } else if (can_launch(e, device)) {
                fire(e, r, half, i, slots, max_ops, launch);
                if (append_index(fired, k) < 0) goto fail;
            } else {
                e[A_STATE] = ARM_VOID;
            }
        }
    }
    return Py_BuildValue("(NN)", fired, claimed);
fail:
    Py_XDECREF(fired);
    Py_XDECREF(claimed);
    return NULL;
}

_Static_assert(A_SEND == 1 && A_RECV == 11 && A_HELD == 21 && A_DEVICE == 26 && A_POS == 35 &&
               ARM_WORDS == 40, "shm/_native.c's ARMED_LAYOUT must name these words");
