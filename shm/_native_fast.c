/*
 * shm._native's half of the fast path (the protocol is in shm/_fast.h): the progress process drains
 * a pair's next cell into its matching, and wakes ranks sleeping in a small collective when it fails
 * the communicator.
 */
#include "_native.h"

#include <limits.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "_fast.h"

static char *addr_of(PyObject *o) {
    void *p = PyLong_AsVoidPtr(o);
    if (!p && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null address");
    return p;
}

/*
 * fast_take(pair, cell_stride, max_slow, line) -> (tag, code, nbytes, count, t_post, bytearray) | TAKE_*
 *     | (tag, code, nbytes, count, t_post, bid, off, cell) for a cell by reference (fast_ref_done ends it)
 * Drain the next cell of the pair whose block is at `pair`, if it is FULL, is the pair's next and
 * has no slow send before it that has not been taken in (slow_before <= max_slow): its payload is
 * copied out, F_DRAINED counted and the cell freed. Otherwise TAKE_NONE (nothing written, or not yet
 * this cell), TAKE_BUSY (the receiver is taking it this instant: try again) or TAKE_BLOCKED (a slow
 * send before it is still to come).
 */
enum { TAKE_NONE, TAKE_BUSY, TAKE_BLOCKED };

/* Bump the small collectives' futex word and wake every rank sleeping on it (shm/_poster_coll.c's
 * _sp_fast_wait: a small collective's ranks, a Send by reference). */
static void wake_word(char *word) {
    __atomic_add_fetch((uint32_t *)word, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* A claimed cell's message copied out: counted unexpected before the next cell can be consumed (until
 * the caller has it in its matching and stores the pair's true count, a receiver that claims the next
 * cell must see that something of the pair is ahead of it: shm/_fast.h, "Draining"), then the cell
 * freed and the drain counted on the receiver's line. */
static void drained(char *pair, char *cell, char *line) {
    volatile uint64_t *unexp = FAST_Q(pair, PAIR_UNEXP_OFF);
    __atomic_store_n(unexp, *unexp + 1, __ATOMIC_RELEASE);
    fast_release(pair, cell, PAIR_F_DRAINED_OFF);
    volatile uint64_t *n = FAST_Q(line, FRANK_CELLS_DRAINED_OFF);
    __atomic_store_n(n, *n + 1, __ATOMIC_RELEASE);
}

PyObject *_sn_fast_take(PyObject *self, PyObject *args) {
    PyObject *pair_o, *line_o;
    unsigned long long stride, max_slow;
    if (!PyArg_ParseTuple(args, "OKKO", &pair_o, &stride, &max_slow, &line_o)) return NULL;
    char *pair = addr_of(pair_o), *line = pair ? addr_of(line_o) : NULL;
    if (!pair || !line) return NULL;
    uint64_t next = fast_next(pair);
    char *cell = pair + PAIR_HDR_BYTES + stride * (next % FAST_CELLS);
    uint32_t st = __atomic_load_n(CELL_STATE(cell), __ATOMIC_ACQUIRE);
    if (st == CELL_TAKING) return PyLong_FromLong(TAKE_BUSY);
    if (st != CELL_FULL) return PyLong_FromLong(TAKE_NONE);
    uint64_t fseq, slow;
    memcpy(&fseq, cell + CELL_FSEQ_OFF, 8);
    memcpy(&slow, cell + CELL_SLOW_BEFORE_OFF, 8);
    if (fseq != next) return PyLong_FromLong(TAKE_NONE);
    if (slow > max_slow) return PyLong_FromLong(TAKE_BLOCKED);
    if (!fast_claim(cell, CELL_DRAINING)) return PyLong_FromLong(TAKE_BUSY);
    memcpy(&fseq, cell + CELL_FSEQ_OFF, 8);   /* claimed: nothing changes under us now */
    memcpy(&slow, cell + CELL_SLOW_BEFORE_OFF, 8);
    if (fseq != fast_next(pair) || slow > max_slow) {
        __atomic_store_n(CELL_STATE(cell), CELL_FULL, __ATOMIC_RELEASE);
        return PyLong_FromLong(TAKE_BUSY);
    }
    long long tag; uint64_t nb, count, t_post, ref; uint32_t code;
    memcpy(&tag, cell + CELL_TAG_OFF, 8);
    memcpy(&nb, cell + CELL_NBYTES_OFF, 8);
    memcpy(&count, cell + CELL_COUNT_OFF, 8);
    memcpy(&t_post, cell + CELL_TPOST_OFF, 8);
    memcpy(&code, cell + CELL_CODE_OFF, 4);
    memcpy(&ref, cell + CELL_REF_OFF, 8);
    if (ref) {
        /* by reference: the caller copies from its registration of the sender's buffer (bid, off) and
         * then ends the drain (fast_ref_done); the cell stays DRAINING until then */
        uint64_t where[3];
        memcpy(where, cell + CELL_HDR_BYTES, sizeof where);
        return Py_BuildValue("(LIKKKKKK)", tag, code, (unsigned long long)nb, (unsigned long long)count,
                             (unsigned long long)t_post, (unsigned long long)where[1], (unsigned long long)where[2],
                             (unsigned long long)(uintptr_t)cell);
    }
    PyObject *data = PyByteArray_FromStringAndSize(cell + CELL_HDR_BYTES, (Py_ssize_t)nb);
    if (!data) {
        __atomic_store_n(CELL_STATE(cell), CELL_FULL, __ATOMIC_RELEASE);
        return NULL;
    }
    drained(pair, cell, line);
    return Py_BuildValue("(LIKKKN)", tag, code, (unsigned long long)nb, (unsigned long long)count,
                         (unsigned long long)t_post, data);
}

/*
 * fast_ref_done(pair, cell, line, src, nbytes, word) -> bytearray
 * End the drain of a cell by reference that fast_take claimed: its payload copied from ``src`` (the
 * progress process's mapping of the sender's buffer), the cell freed as fast_take frees one, and the
 * sender, waiting for it, woken on the small collectives' futex word ``word``. ``src`` 0: the buffer
 * is not known here (a registration gone): the cell goes back to FULL and None is returned.
 */
PyObject *_sn_fast_ref_done(PyObject *self, PyObject *args) {
    PyObject *pair_o, *cell_o, *line_o, *word_o;
    unsigned long long src, nb;
    if (!PyArg_ParseTuple(args, "OOOKKO", &pair_o, &cell_o, &line_o, &src, &nb, &word_o)) return NULL;
    char *pair = addr_of(pair_o), *cell = pair ? addr_of(cell_o) : NULL, *line = cell ? addr_of(line_o) : NULL;
    char *word = line ? addr_of(word_o) : NULL;
    if (!word) return NULL;
    if (!src) {
        __atomic_store_n(CELL_STATE(cell), CELL_FULL, __ATOMIC_RELEASE);
        Py_RETURN_NONE;
    }
    PyObject *data = PyByteArray_FromStringAndSize((const char *)(uintptr_t)src, (Py_ssize_t)nb);
    if (!data) {
        __atomic_store_n(CELL_STATE(cell), CELL_FULL, __ATOMIC_RELEASE);
        return NULL;
    }
    drained(pair, cell, line);
    wake_word(word);
    return data;
}

/* fast_wake_coll(word): bump the small collectives' futex word and wake every rank sleeping on it. */
PyObject *_sn_fast_wake_coll(PyObject *self, PyObject *arg) {
    char *word = addr_of(arg);
    if (!word) return NULL;
    wake_word(word);
    Py_RETURN_NONE;
}
