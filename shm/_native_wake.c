/*
 * shm._native, continued: completing requests and waking their ranks (complete_coll, wake_owners).
 *
 * The progress process publishes a request's completion slot, then wakes its rank through the rank's
 * futex word. These two calls do it for many ranks at once: every slot (or word) first, then the wake
 * system calls, so that ranks that spin leave together and none that sleeps misses its wake-up (the
 * argument is in proxy/engine/completion.py, wake_ranks). No lock is taken here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "_native.h"
#include "_pool_layout.h"

static void *as_ptr(PyObject *o) { return PyLong_AsVoidPtr(o); }

/*
 * The wake-up half of a completion, for ranks whose slots are published: bump every owner's futex word
 * (seq_cst: the full barrier of the lost-wake-up argument in proxy/engine/completion.py, wake_ranks), then wake
 * each owner that said it may sleep (RANK_WAITING = CPU + 1 | word << 32), those asleep on the caller's
 * CPU last (such a wakee preempts the caller before it wakes the others), none asleep on a CPU whose
 * bit is set in `relayed` (that CPU's keep-awake guard wakes them: shm/_workers.c). Owners are read
 * `stride` long longs apart. Bumping all before waking any lets spinning ranks leave together.
 */
static void wake_owners(char *pool, Py_ssize_t area_off, const long long *owner, Py_ssize_t stride,
                        Py_ssize_t n, uint64_t relayed) {
    for (Py_ssize_t i = 0; i < n; i++) {
        char *area = pool + area_off + owner[i * stride] * RANK_AREA_BYTES;
        __atomic_fetch_add((uint32_t *)(area + RANK_WAKE_OFF), 1, __ATOMIC_SEQ_CST);
    }
    int here = -2;
    for (int local = 0; local < 2; local++) {   /* other CPUs first, then the caller's */
        for (Py_ssize_t i = 0; i < n; i++) {
            char *area = pool + area_off + owner[i * stride] * RANK_AREA_BYTES;
            uint64_t w = __atomic_load_n((uint64_t *)(area + RANK_WAITING_OFF), __ATOMIC_SEQ_CST);
            if (!w) continue;
            if (here == -2) here = sched_getcpu();
            int cpu = (int)(uint32_t)w - 1;
            if ((cpu == here) != local || (cpu >= 0 && cpu < 64 && (relayed >> cpu) & 1)) continue;
            syscall(SYS_futex, (uint32_t *)(area + RANK_WAKE_OFF), FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
        }
    }
}

/*
 * complete_coll(pool, slots_off, rank_area_off, max_ops, ops, nbytes, relayed=0) -> -1 | index of a bad op
 * Finish every rank's op of one collective (proxy/engine/completion.py, ProgressEngine.complete_coll): first
 * publish each op's completion slot (nbytes, status 0 with the op's peer as source, tag 0, then the
 * request's seq with a release store: shm/counters.py's protocol), then bump each owner's COMPLETED
 * counter, then wake_owners (above). Publishing all before waking any lets spinning ranks leave
 * together. Checks every op's slot lies in its owner's region before writing anything: on a bad one
 * nothing is written and its position in `ops` is returned.
 */

PyObject *_sn_s_req_slot, *_sn_s_owner, *_sn_s_req_seq, *_sn_s_peer;   /* shm/_native.h */

int _sn_op_field(PyObject *op, PyObject *name, long long *out) {
    PyObject *v = PyObject_GetAttr(op, name);
    if (!v) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

PyObject *_sn_complete_coll(PyObject *self, PyObject *args) {
    PyObject *pool_o, *ops;
    Py_ssize_t slots_off, area_off, max_ops;
    unsigned long long nbytes, relayed = 0;
    if (!PyArg_ParseTuple(args, "OnnnOK|K", &pool_o, &slots_off, &area_off, &max_ops, &ops, &nbytes, &relayed))
        return NULL;
    char *pool = as_ptr(pool_o);
    if (!pool && PyErr_Occurred()) return NULL;
    PyObject *seq = PySequence_Fast(ops, "complete_coll: ops must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (max_ops <= 0) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "complete_coll: bad arguments");
        return NULL;
    }
    long long (*f)[4] = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *f);   /* slot, owner, seq, peer */
    if (!f) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (_sn_op_field(items[i], _sn_s_req_slot, &f[i][0]) || _sn_op_field(items[i], _sn_s_owner, &f[i][1]) ||
            _sn_op_field(items[i], _sn_s_req_seq, &f[i][2]) || _sn_op_field(items[i], _sn_s_peer, &f[i][3])) {
            Py_DECREF(seq);
            PyMem_Free(f);
            return NULL;
        }
        if (f[i][0] < 0 || f[i][1] < 0 || f[i][0] / max_ops != f[i][1]) {
            Py_DECREF(seq);
            PyMem_Free(f);
            return PyLong_FromSsize_t(i);
        }
    }
    Py_DECREF(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t *slot = (uint64_t *)(pool + slots_off) + f[i][0] * SLOT_WORDS;
        slot[SLOT_NBYTES] = nbytes;
        slot[SLOT_STATUS] = (uint64_t)(uint32_t)f[i][3] << 32;   /* status 0, the source above it */
        slot[SLOT_TAG] = 0;
        __atomic_store_n(&slot[SLOT_DONE_SEQ], (uint64_t)f[i][2], __ATOMIC_RELEASE);
    }
    for (Py_ssize_t i = 0; i < n; i++)   /* statistics; the progress process is their only writer */
        *(uint64_t *)(pool + area_off + f[i][1] * RANK_AREA_BYTES + RANK_COMPLETED_OFF) += 1;
    wake_owners(pool, area_off, &f[0][1], 4, n, relayed);
    PyMem_Free(f);
    return PyLong_FromLong(-1);
}

/*
 * wake_owners(pool, rank_area_off, owners, relayed=0) -> None
 * The same wake-ups for ranks whose completion slots the caller has already published
 * (proxy/engine/completion.py, wake_ranks: the two sides of a message, or one rank).
 */
PyObject *_sn_wake_owners(PyObject *self, PyObject *args) {
    PyObject *pool_o, *owners;
    Py_ssize_t area_off;
    unsigned long long relayed = 0;
    if (!PyArg_ParseTuple(args, "OnO|K", &pool_o, &area_off, &owners, &relayed)) return NULL;
    char *pool = as_ptr(pool_o);
    if (!pool) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "wake_owners: no pool");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(owners, "wake_owners: owners must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    long long few[8], *own = n <= 8 ? few : PyMem_Malloc((size_t)n * sizeof *own);
    if (!own) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int bad = 0;
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        own[i] = PyLong_AsLongLong(items[i]);
        bad = own[i] < 0;
    }
    Py_DECREF(seq);
    if (!bad) wake_owners(pool, area_off, own, 1, n, relayed);
    if (own != few) PyMem_Free(own);
    if (bad) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "wake_owners: a negative rank");
        return NULL;
    }
    Py_RETURN_NONE;
}


int _sn_wake_init(void) {
    _sn_s_req_slot = PyUnicode_InternFromString("req_slot");
    _sn_s_owner = PyUnicode_InternFromString("owner");
    _sn_s_req_seq = PyUnicode_InternFromString("req_seq");
    _sn_s_peer = PyUnicode_InternFromString("peer");
    return (_sn_s_req_slot && _sn_s_owner && _sn_s_req_seq && _sn_s_peer) ? 0 : -1;
}
