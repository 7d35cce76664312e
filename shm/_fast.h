/*
 * The fast path's protocol: small messages and small collectives that a blocked rank completes
 * itself, through the pool's fast region (layout: shm/pool.py "Fast path", offsets in
 * shm/_pool_layout.h), while the progress process keeps everything else. The rank's half is
 * shm/_poster_fast.c and shm/_poster_coll.c, the progress process's shm/_native_fast.c and
 * proxy/engine/fastpath.py; docs/architecture.md, "The fast path", tells the whole story.
 *
 * Cells. Each ordered pair (s, d) of local ranks has FAST_CELLS cells, used in turn: the sender's
 * k-th fast message (fseq k) goes in cell k % FAST_CELLS, only when that cell is EMPTY. A cell is
 * consumed in fseq order by exactly one of two parties, whoever wins the compare-and-swap from FULL:
 * the receiver (TAKING, in a blocking Recv that may take it, below), or the progress process
 * (DRAINING, into its matching as a buffered send). The next cell to consume is F_TAKEN + F_DRAINED
 * (one counter each, bumped by the winner before the cell is EMPTY again), checked against the
 * cell's fseq, so a stale view never consumes the wrong message.
 *
 * Order between the two paths of one pair (MPI's non-overtaking). The sender numbers its slow sends
 * per destination rank (whether that rank has attached yet or not) and stamps each slow record with
 * its number (the record's x2, from 1) and each cell with the slow sends before it (slow_before); it
 * also publishes the count in the pair's SLOW_SENT, so a receiver with nothing in a cell can tell that
 * a message is on its way through the progress process and stop spinning. The progress process
 * takes a slow send into matching only after draining the cells written before it (slow_before <=
 * its number), and drains a cell only once every slow send before it is in (slow_before <=
 * FETCHED_SLOW): arrivals in its matching follow the sender's order. The receiver takes a cell itself
 * only when nothing of the pair can be ahead of it in the progress process: every slow send before
 * the cell has been fetched (FETCHED_SLOW >= slow_before), the progress process holds no unexpected
 * message of the pair (the pair's UNEXP is 0), and it has no receive or probe of its own pending
 * there (RECV_POSTED == RECV_DONE), which also
 * keeps a later blocking Recv from taking what an earlier Irecv should get. Anything else: the
 * receive is posted to the progress process like any other, and the cells are drained into it.
 *
 * Draining. The progress process moves a drained cell's message into its matching in Python, after
 * the cell is free and the pair's next cell may be consumed. In between, the message is in neither
 * place a receiver looks at: so the drain (fast_take) counts it in the pair's UNEXP before it frees
 * the cell, and the progress process stores the pair's true count once the message is in matching
 * (unexpected, or already matched to a posted receive). A receiver that claimed the next cell therefore
 * sees UNEXP > 0 and declines, and its receive, posted, matches the drained message first.
 *
 * By reference. A blocking Send of FAST_REF_MIN_BYTES to FAST_REF_MAX_BYTES from an array in the
 * sender's numpy arena (shm/_arena.c) whose receiver has no receive waiting in the progress process
 * writes a cell whose payload stays in the sender's array: CELL_REF is 1, and the cell's payload area
 * holds {offset in the arena, the arena's registration id, offset in that registration}. The cell
 * keeps its place in the pair's order, and is consumed as any cell is, by whoever claims it: the
 * receiver's Recv copies straight from its mapping of the sender's arena (the middle collectives'
 * mapping, shm/_poster_coll.c), one copy where a cell takes two; the progress process's drain copies
 * from its registration of it (fast_take hands the claimed cell over, fast_ref_done frees it). The
 * sender cannot return before then (its array may change), so it waits, bounded by TIMEOUT and
 * watching the error and abort words: a spin first, then it rings the receiver's doorbell, so that
 * the progress process drains the cell if the receiver does not come (the Send returns as a buffered
 * one would, never waiting on its receiver: an exchange of Sends completes), then a sleep on the small
 * collectives' futex word, which the consumer wakes. A Send that may not block (send_or_isend, the
 * torch backend's) never goes by reference. A receiver that cannot map the sender's arena declines
 * the cell, and the progress process drains it.
 *
 * Memory ordering (x86-64 TSO, made explicit with __atomic): the progress process stores UNEXP and
 * RECV_DONE before FETCHED_SLOW, and the receiver loads FETCHED_SLOW first, so a receiver that sees
 * a slow send fetched also sees it counted as unexpected. A sender stores the cell FULL (release),
 * then, behind a full fence, loads the receiver's RECV_POSTED and RECV_DONE: if they differ, the
 * receiver may be waiting in the progress process, so it rings the receiver's DOORBELL and wakes the
 * loop (as post_event does). Either it sees the receive posted, or the receive's post (which comes
 * after the RECV_POSTED store) is fetched after the cell was FULL and its drain finds it.
 */
#ifndef SHM_FAST_H
#define SHM_FAST_H

#include <stdint.h>

#include "_pool_layout.h"

#define FAST_Q(base, off) ((volatile uint64_t *)((char *)(base) + (off)))
#define CELL_STATE(cell) ((uint32_t *)((char *)(cell) + CELL_STATE_OFF))

typedef struct {
    char *base;               /* the pool */
    char *fast;               /* its fast region (FRANK lines), NULL when the pool has none */
    char *pairs, *coll;       /* the pair blocks, the small collectives' area */
    long nlocal;
    uint64_t fast_bytes, cell_stride, pair_stride, crank_stride;
    uint64_t rank_area_off;
} FastLayout;

/* The layout shm/pool.py computes (Layout.fast_off and the strides after it). */
static inline void fast_layout(FastLayout *f, char *pool, uint64_t fast_off, long nlocal, uint64_t fast_bytes,
                               uint64_t rank_area_off) {
    uint64_t payload = (fast_bytes + 63) / 64 * 64;
    f->base = pool;
    f->fast = fast_bytes ? pool + fast_off : NULL;
    f->nlocal = nlocal;
    f->fast_bytes = fast_bytes;
    f->cell_stride = CELL_HDR_BYTES + payload;
    f->pair_stride = PAIR_HDR_BYTES + FAST_CELLS * f->cell_stride;
    f->crank_stride = FAST_LINE + 2 * f->cell_stride;
    f->pairs = pool + fast_off + FAST_LINE * (uint64_t)nlocal;
    f->coll = f->pairs + f->pair_stride * (uint64_t)nlocal * (uint64_t)nlocal;
    f->rank_area_off = rank_area_off;
}

static inline char *fast_rank_line(const FastLayout *f, long lr) { return f->fast + FAST_LINE * lr; }
static inline char *fast_pair(const FastLayout *f, long s, long d) {
    return f->pairs + f->pair_stride * (uint64_t)(s * f->nlocal + d);
}
static inline char *fast_cell(const FastLayout *f, char *pair, uint64_t fseq) {
    return pair + PAIR_HDR_BYTES + f->cell_stride * (fseq % FAST_CELLS);
}
static inline volatile uint64_t *fast_recv_posted(const FastLayout *f, long lr) {
    return FAST_Q(f->base, f->rank_area_off + (uint64_t)RANK_AREA_BYTES * lr + RANK_RECV_POSTED_OFF);
}
/* Whether local rank lr has a receive or probe of its own waiting in the progress process. */
static inline int fast_recv_waiting(const FastLayout *f, long lr) {
    return __atomic_load_n(fast_recv_posted(f, lr), __ATOMIC_SEQ_CST) !=
           __atomic_load_n(FAST_Q(fast_rank_line(f, lr), FRANK_RECV_DONE_OFF), __ATOMIC_SEQ_CST);
}
/* The next cell of a pair to consume, whoever consumes it. */
static inline uint64_t fast_next(char *pair) {
    return __atomic_load_n(FAST_Q(pair, PAIR_F_TAKEN_OFF), __ATOMIC_ACQUIRE) +
           __atomic_load_n(FAST_Q(pair, PAIR_F_DRAINED_OFF), __ATOMIC_ACQUIRE);
}
/* Claim a FULL cell (to TAKING or DRAINING): 1 when this caller won it. */
static inline int fast_claim(char *cell, uint32_t to) {
    uint32_t want = CELL_FULL;
    return __atomic_compare_exchange_n(CELL_STATE(cell), &want, to, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
/* After consuming a claimed cell: count it on the consumer's counter, then free the cell. */
static inline void fast_release(char *pair, char *cell, uint64_t counter_off) {
    volatile uint64_t *c = FAST_Q(pair, counter_off);
    __atomic_store_n(c, *c + 1, __ATOMIC_RELEASE);
    __atomic_store_n(CELL_STATE(cell), CELL_EMPTY, __ATOMIC_RELEASE);
}

/* Small collectives: the area's header, a rank's line and its slot of parity p. */
static inline char *coll_rank(const FastLayout *f, long r) {
    return f->coll + FAST_LINE + f->crank_stride * r;
}
static inline char *coll_slot(const FastLayout *f, long r, uint64_t seq) {
    return coll_rank(f, r) + FAST_LINE + f->cell_stride * (seq & 1);
}

#endif
