/*
 * shm._native, continued: the progress loop's two per-message steps for work a GPU runs and publishes
 * itself (transports/cuda_publish.py has the protocol; this file never links the CUDA driver, whose
 * entry point the caller passes as an address, so host-only builds and jobs carry none of it).
 *
 * - publish_launch: write each request's completion slot but its done_seq, fill the graph's cell with
 *   the (device address of done_seq, seq) pairs and a fresh token, then call cuGraphLaunch. In Python
 *   these stores cost the loop more than the launch call itself on the slower GPU hosts.
 * - watch_words: while the loop has nothing in flight but such work, wait here instead of in Python
 *   passes: return as soon as a rank posts, another thread has news for the loop, the job aborts, or
 *   an ack word reaches its token. A Python pass costs several microseconds, and a post arriving in
 *   the middle of one waits for its end.
 *
 * Ordering: the slot fields and the cell are plain stores made before the launch call, which the GPU
 * follows (the driver's doorbell write is ordered after them on x86-64 and by the release fence here
 * elsewhere); the kernel stores done_seq after the copy, and the ack last (cuda_publish.py).
 */
#include "_native.h"

#include <stdint.h>
#include <time.h>

#include "_pool_layout.h"

/* A publish cell's u64 words (transports/cuda_publish.py checks PUBLISH_CELL against its own). */
enum { CELL_COUNT = 0, CELL_TOKEN = 1, CELL_FIRST_PAIR = 2 };


/*
 * Write `n` requests' completion slots but their done_seq, then the cell: token first, the (device
 * address of done_seq, seq) pairs, the count (0: the graph publishes nothing), and a release fence
 * ahead of the launch call that follows. publish_launch and fire_armed (shm/_native_armed.c) share it.
 */
void _sn_fill_cell(uint64_t slots, uint64_t cell, uint64_t token, uint64_t delta, uint64_t nbytes, int n,
                   const long long *slot, const long long *rseq, const long long *source,
                   const uint64_t *tag) {
    volatile uint64_t *c = (volatile uint64_t *)(uintptr_t)cell;
    c[CELL_TOKEN] = token;
    for (int i = 0; i < n; i++) {
        uint64_t *s = (uint64_t *)(uintptr_t)(slots + (uint64_t)slot[i] * SLOT_WORDS * 8);
        s[SLOT_NBYTES] = nbytes;
        s[SLOT_STATUS] = ((uint64_t)(uint32_t)source[i]) << 32;   /* status 0, peer dtype 0 */
        s[SLOT_TAG] = tag[i];
        c[CELL_FIRST_PAIR + 2 * i] = (uint64_t)(uintptr_t)&s[SLOT_DONE_SEQ] + delta;
        c[CELL_FIRST_PAIR + 2 * i + 1] = (uint64_t)rseq[i];
    }
    c[CELL_COUNT] = (uint64_t)n;
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

/*
 * publish_launch(slots, max_ops, items, nbytes, cell, cell_pairs, token, delta, launch, exe, stream)
 *     -> (CUresult, published)
 * `items`: (op, source, tag) for each request the graph completes; `slots`: the completion slots'
 * address in this process; `delta`: a device address minus this process's address of pinned memory.
 * There must be 1 to `cell_pairs` items, every op a local rank's with its slot in its own region;
 * otherwise nothing is published (count 0), published is False, and the loop completes
 * the requests when it sees the graph done (complete() then names a bad slot). The graph is launched
 * either way, and its token stored first.
 */
PyObject *_sn_publish_launch(PyObject *self, PyObject *args) {
    unsigned long long slots, cell, token, delta, launch, exe, stream, nbytes;
    long long max_ops;
    Py_ssize_t cell_pairs;
    PyObject *items;
    if (!PyArg_ParseTuple(args, "KLOKKnKKKKK", &slots, &max_ops, &items, &nbytes, &cell, &cell_pairs, &token,
                          &delta, &launch, &exe, &stream))
        return NULL;
    if (!slots || !cell || !launch || max_ops <= 0) {
        PyErr_SetString(PyExc_ValueError, "publish_launch: null address or max_ops <= 0");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(items, "publish_launch: items must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    long long slot[n ? n : 1], rseq[n ? n : 1], source[n ? n : 1];
    unsigned long long tag[n ? n : 1];
    int ok = n > 0 && n <= cell_pairs;   /* none: nothing published, the loop completes the work */
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
        long long owner;
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 3) {
            PyErr_SetString(PyExc_TypeError, "publish_launch: an item is (op, source, tag)");
            Py_DECREF(seq);
            return NULL;
        }
        PyObject *op = PyTuple_GET_ITEM(it, 0);
        if (_sn_op_field(op, _sn_s_owner, &owner) < 0 || _sn_op_field(op, _sn_s_req_slot, &slot[i]) < 0 ||
            _sn_op_field(op, _sn_s_req_seq, &rseq[i]) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        source[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(it, 1));
        tag[i] = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(it, 2));
        if (PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        ok = owner >= 0 && slot[i] >= 0 && slot[i] / max_ops == owner;
    }
    Py_DECREF(seq);
    _sn_fill_cell(slots, cell, token, delta, nbytes, ok ? (int)n : 0, slot, rseq, source, tag);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ((graph_launch_fn)(uintptr_t)launch)((void *)(uintptr_t)exe, (void *)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(iO)", rc, ok ? Py_True : Py_False);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/*
 * watch_words(pool, seen_events, abort, words, timeout_ns) -> WATCH_*
 * Spin (GIL released) until the posted chain has a record or a rank handed a chain off (POSTED), the
 * events word moved from `seen_events` (EVENTS), the u64 at `abort` is set (ABORT), one of `words`
 * ((address, value), ...) holds its value or a greater one (WORD: tokens only grow), or `timeout_ns`
 * passed (TIMEOUT). The loop's other duties (heartbeat, failure checks) wait at most that bound.
 */
enum { WATCH_TIMEOUT, WATCH_POSTED, WATCH_EVENTS, WATCH_ABORT, WATCH_WORD };

PyObject *_sn_watch_words(PyObject *self, PyObject *args) {
    unsigned long long pool, seen, abort_at, timeout_ns;
    PyObject *words;
    if (!PyArg_ParseTuple(args, "KKKOK", &pool, &seen, &abort_at, &words, &timeout_ns)) return NULL;
    if (!pool || !abort_at) {
        PyErr_SetString(PyExc_ValueError, "watch_words: null address");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(words, "watch_words: words must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint64_t addr[n ? n : 1], want[n ? n : 1];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 2) {
            PyErr_SetString(PyExc_TypeError, "watch_words: a word is (address, value)");
            Py_DECREF(seq);
            return NULL;
        }
        addr[i] = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(it, 0));
        want[i] = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(it, 1));
        if (PyErr_Occurred() || !addr[i]) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "watch_words: null address");
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    char *p = (char *)(uintptr_t)pool;
    int32_t *head = (int32_t *)(p + POOL_NEXT_OPS_OFF);
    uint64_t *mask = (uint64_t *)(p + POOL_PENDING_MASK_OFF), *events = (uint64_t *)(p + POOL_EVENTS_OFF);
    uint64_t *abort_w = (uint64_t *)(uintptr_t)abort_at;
    int why = WATCH_TIMEOUT;
    Py_BEGIN_ALLOW_THREADS
    uint64_t deadline = now_ns() + timeout_ns;
    for (unsigned spins = 0;; spins++) {
        if (__atomic_load_n(head, __ATOMIC_ACQUIRE) != -1 || __atomic_load_n(mask, __ATOMIC_ACQUIRE)) {
            why = WATCH_POSTED;
            break;
        }
        if (__atomic_load_n(events, __ATOMIC_ACQUIRE) != seen) {
            why = WATCH_EVENTS;
            break;
        }
        if (__atomic_load_n(abort_w, __ATOMIC_ACQUIRE)) {
            why = WATCH_ABORT;
            break;
        }
        for (Py_ssize_t i = 0; i < n && why == WATCH_TIMEOUT; i++)
            if (__atomic_load_n((uint64_t *)(uintptr_t)addr[i], __ATOMIC_ACQUIRE) >= want[i])
                why = WATCH_WORD;
        if (why != WATCH_TIMEOUT) break;
        if ((spins & 63) == 63 && now_ns() >= deadline) break;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(why);
}
