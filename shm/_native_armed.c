/*
 * shm._native, continued: armed routes, the loop's launch of a repeated device message at the fetch
 * of its second half (proxy/engine/armed.py has the protocol and the rules that make it safe).
 *
 * A message between the same two device buffers that ran last time as a publishing graph
 * (transports/cuda_publish.py) will most likely run again. When one half of it (a receive, or a send
 * that found no receive) waits in matching, the loop *arms* an entry: the other half's record field
 * for field, the armed half's completion item, and the graph's launch. fire_armed, called right after
 * the loop took the posted chain and before any of it becomes Python objects, scans the taken records
 * in order: a record equal to an armed entry's expected one fires it (the slots, the cell and
 * cuGraphLaunch, as publish_launch does), and the copy runs while Python does the bookkeeping of the
 * match. Any other point-to-point record of either rank of the entry before it voids the entry (it
 * might match first, or change what the armed half matches), as does a record that is expected but
 * cannot fire now: another device current on the loop thread, the graph's last run not acked yet, or
 * a fast-path cell waiting for the receiver (one written before the send must match first). A voided
 * or fired entry is the loop's to free; a collective's record touches no entry.
 *
 * Entry layout: ARM_WORDS u64 words (the engine checks ARMED_LAYOUT against its own names).
 */
#include "_native.h"

#include <stdint.h>
#include <time.h>

#include "_pool_layout.h"

enum {
    A_STATE,                                       /* ARM_FREE, ARM_ARMED; ARM_FIRED, ARM_VOID (set here) */
    A_KIND, A_OWNER, A_PEER, A_TAG, A_DTYPE, A_FLAGS, A_BUF, A_OFFSET, A_NBYTES, A_MEM,   /* the record */
    A_OTHER,                                       /* the armed half's owner (local rank) */
    A_ARMED_SLOT, A_ARMED_SEQ, A_ARMED_SOURCE, A_ARMED_TAG,   /* the armed half's completion item */
    A_FIRE_SOURCE, A_FIRE_TAG,                     /* the firing half's item: source and tag */
    A_MSG_BYTES,                                   /* the message's bytes, as both slots say */
    A_DEVICE, A_ACK, A_LAST_TOKEN,                 /* the graph's device, ack word, and its last run */
    A_CELL, A_DELTA, A_EXE, A_STREAM, A_RUNS,      /* its cell, the slots' device delta, its launch; tokens */
    A_CELLS,                                       /* the receiver's cell counters (written, taken, drained) */
    A_POS, A_TOKEN, A_PUBLISHED, A_RC, A_T_FIRE,   /* out, once fired */
    ARM_WORDS
};
enum { ARM_FREE, ARM_ARMED, ARM_FIRED, ARM_VOID };
enum { KIND_COLL = 3 };   /* core/ops.py */

/* The record fields an entry compares (shm/pool.py RECORD; _native_ops.c lists them all). */
#define R_U8(r, off) (*(const uint8_t *)((r) + (off)))
#define R_I32(r, off) (*(const int32_t *)((r) + (off)))
#define R_U32(r, off) (*(const uint32_t *)((r) + (off)))
#define R_U64(r, off) (*(const uint64_t *)((r) + (off)))

static int expected(const uint64_t *e, const char *r) {
    return R_U8(r, 4) == e[A_KIND] && (int64_t)R_I32(r, REC_OWNER_OFF) == (int64_t)e[A_OWNER] &&
           (int64_t)R_I32(r, 12) == (int64_t)e[A_PEER] && R_U64(r, 16) == e[A_TAG] &&
           R_U8(r, 5) == e[A_DTYPE] && R_U8(r, 7) == e[A_FLAGS] &&
           (int64_t)R_I32(r, 44) == (int64_t)e[A_BUF] && R_U64(r, 48) == e[A_OFFSET] &&
           R_U64(r, 56) == e[A_NBYTES] && (int64_t)R_I32(r, REC_MEM_OFF) == (int64_t)e[A_MEM];
}

static int can_fire(const uint64_t *e, long long device) {
    if ((long long)e[A_DEVICE] != device) return 0;
    /* the graph not launched since the arming (the cell's token is its last launch's) and that run done */
    if (((volatile uint64_t *)(uintptr_t)e[A_CELL])[1] != e[A_LAST_TOKEN]) return 0;
    if (__atomic_load_n((uint64_t *)(uintptr_t)e[A_ACK], __ATOMIC_ACQUIRE) < e[A_LAST_TOKEN]) return 0;
    if (e[A_CELLS]) {   /* cells_waiting (engine/fastpath.py): written != taken + drained */
        const uint64_t *q = (const uint64_t *)(uintptr_t)e[A_CELLS];
        if (__atomic_load_n(&q[0], __ATOMIC_ACQUIRE) !=
            __atomic_load_n(&q[1], __ATOMIC_ACQUIRE) + __atomic_load_n(&q[2], __ATOMIC_ACQUIRE))
            return 0;
    }
    return 1;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void fire(uint64_t *e, const char *r, Py_ssize_t pos, uint64_t slots, long long max_ops,
                 uint64_t launch) {
    long long slot[2], rseq[2], source[2];
    uint64_t tag[2];
    long long owner = R_I32(r, REC_OWNER_OFF);
    slot[0] = (long long)e[A_ARMED_SLOT], rseq[0] = (long long)e[A_ARMED_SEQ];
    source[0] = (long long)e[A_ARMED_SOURCE], tag[0] = e[A_ARMED_TAG];
    slot[1] = R_U32(r, 40), rseq[1] = (long long)R_U64(r, 32);
    source[1] = (long long)e[A_FIRE_SOURCE], tag[1] = e[A_FIRE_TAG];
    /* as publish_launch: every slot in its owner's region, or the loop completes both requests */
    int ok = slot[0] / max_ops == (long long)e[A_OTHER] && owner >= 0 && slot[1] / max_ops == owner;
    uint64_t *runs = (uint64_t *)(uintptr_t)e[A_RUNS];
    uint64_t token = ++*runs;
    _sn_fill_cell(slots, e[A_CELL], token, e[A_DELTA], e[A_MSG_BYTES], ok ? 2 : 0, slot, rseq, source, tag);
    int rc = ((graph_launch_fn)(uintptr_t)launch)((void *)(uintptr_t)e[A_EXE], (void *)(uintptr_t)e[A_STREAM]);
    e[A_POS] = (uint64_t)pos;
    e[A_TOKEN] = token;
    e[A_PUBLISHED] = (uint64_t)ok;
    e[A_RC] = (uint64_t)(uint32_t)rc;
    e[A_T_FIRE] = now_ns();
    e[A_STATE] = ARM_FIRED;
}

/*
 * fire_armed(table, nentries, records, n, slots, max_ops, device, launch) -> (entry, ...) fired
 * `table`: nentries entries of ARM_WORDS u64; `records`: the n records the loop took (RECORD_BYTES
 * each, in posting order); `slots`: the completion slots' address here; `device`: the device current
 * on the calling thread; `launch`: cuGraphLaunch. Runs with the GIL held: a launch is microseconds,
 * and the loop has nothing else to do meanwhile.
 */
PyObject *_sn_fire_armed(PyObject *self, PyObject *args) {
    unsigned long long table, records, slots, launch;
    Py_ssize_t nentries, n;
    long long max_ops, device;
    if (!PyArg_ParseTuple(args, "KnKnKLLK", &table, &nentries, &records, &n, &slots, &max_ops, &device, &launch))
        return NULL;
    if (!table || !records || !slots || !launch || max_ops <= 0 || nentries < 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "fire_armed: null address, max_ops <= 0 or a negative count");
        return NULL;
    }
    uint64_t *t = (uint64_t *)(uintptr_t)table;
    PyObject *fired = PyList_New(0);
    if (!fired) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *r = (const char *)(uintptr_t)(records + (uint64_t)i * RECORD_BYTES);
        if (R_U8(r, 4) == KIND_COLL) continue;
        int64_t owner = R_I32(r, REC_OWNER_OFF);
        int used = 0;   /* a record fires one entry at most */
        for (Py_ssize_t k = 0; k < nentries; k++) {
            uint64_t *e = t + k * ARM_WORDS;
            if (e[A_STATE] != ARM_ARMED) continue;
            if (!used && expected(e, r) && can_fire(e, device)) {
                fire(e, r, i, slots, max_ops, launch);
                used = 1;
                PyObject *x = PyLong_FromSsize_t(k);
                if (!x || PyList_Append(fired, x) < 0) {
                    Py_XDECREF(x);
                    Py_DECREF(fired);
                    return NULL;
                }
                Py_DECREF(x);
            } else if (owner == (int64_t)e[A_OWNER] || owner == (int64_t)e[A_OTHER]) {
                e[A_STATE] = ARM_VOID;
            }
        }
    }
    return fired;
}

_Static_assert(A_KIND == 1 && A_ARMED_SLOT == 12 && A_DEVICE == 19 && A_POS == 28 && ARM_WORDS == 33,
               "shm/_native.c's ARMED_LAYOUT must name these words");
