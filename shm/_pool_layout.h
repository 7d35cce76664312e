/*
 * The ops pool layout the C helpers read and write directly (shm/pool.py owns it and documents every
 * field). shm._poster (the rank's post and Wait) and shm._native (the progress process's fetch and
 * collective completion) both include this, and shm/pool.py checks shm._native.POOL_LAYOUT against
 * its own layout at import, so a change on one side cannot go unnoticed.
 */
#ifndef SHM_POOL_LAYOUT_H
#define SHM_POOL_LAYOUT_H

/* header: the pool mutex and condvar, the posted chain's head and tail (int32 record indices, in the
 * mutex's cache line), the pending mask (u64, bit r: local rank r handed a chain off in its pending
 * slot; shm/_pool_lock.h, "Hand-off"), SLEEPING, per-rank free lists */
#define POOL_MUTEX_OFF 64
#define POOL_NEXT_OPS_OFF 104
#define POOL_NEXT_OPS_END_OFF 108
#define POOL_COND_OFF 128
#define POOL_PENDING_MASK_OFF 192
#define POOL_SLEEPING_OFF 328   /* CTRL_SLEEPING (shm/pool.py): u64, 1 while the progress process may sleep */
#define POOL_EVENTS_OFF 384     /* CTRL_EVENTS: u64, bumped by a thread of the progress process with news for its loop */
#define POOL_FREE_OPS_OFF 1024

/* op records: `next` (int32) at 0 */
#define RECORD_BYTES 128
#define REC_OWNER_OFF 8      /* int32 local rank */
#define REC_OPCOUNT_OFF 24   /* uint64 */
#define REC_MEM_OFF 76       /* int32: memory kind | device << 8 of the op's buffers */

/* completion slots: u64 words (SLOT_STREAM_SEQ: written by the rank's GPU stream, transports/cuda_order.py) */
enum { SLOT_DONE_SEQ, SLOT_NBYTES, SLOT_STATUS, SLOT_TAG, SLOT_STREAM_SEQ, SLOT_WORDS };

/* per-rank areas */
#define RANK_AREA_BYTES 64
#define RANK_WAKE_OFF 8        /* uint32 futex word */
#define RANK_WAITING_OFF 16    /* u64: the rank may sleep: (its CPU + 1) | the word it sleeps on << 32 */
#define RANK_COMPLETED_OFF 40  /* u64 statistics */
#define RANK_PENDING_OFF 48    /* u64: (first + 1) << 32 | (last + 1) of a chain handed off; 0 = none */
#define RANK_RECV_POSTED_OFF 56 /* u64: receives and probes the rank posted (the fast path, shm/_fast.h) */

/* The fast path's region (shm/pool.py "Fast path", shm/_fast.h): present when the header's fast_bytes
 * (the u32 at POOL_FAST_BYTES_OFF) is not 0. Offsets below are relative to a line, pair or cell. */
#define POOL_FAST_BYTES_OFF 28
#define FAST_CELLS 4
#define FAST_LINE 64
#define FRANK_RECV_DONE_OFF 0    /* u64, progress: receives and probes of the rank it completed */
#define FRANK_DOORBELL_OFF 16    /* u64, senders (atomic add): a cell written while the rank had a receive posted */
#define FRANK_RANK_OFF 24        /* u64, the rank itself once attached: its rank in the communicator + 1 */
#define FRANK_CELLS_WRITTEN_OFF 32 /* u64, senders (atomic add): cells written to the rank, every pair */
#define FRANK_CELLS_TAKEN_OFF 40   /* u64, the rank: cells it took itself */
#define FRANK_CELLS_DRAINED_OFF 48 /* u64, progress: cells to the rank it drained (the three say whether any
                                    * cell to the rank is waiting, in three loads) */
#define PAIR_F_WRITTEN_OFF 0     /* line 0, the sender: cells written */
#define PAIR_SLOW_SENT_OFF 8     /*   and sends it posted to the progress process */
#define PAIR_F_TAKEN_OFF 64      /* line 1, the receiver: cells it took itself */
#define PAIR_F_DRAINED_OFF 128   /* line 2, progress: cells it took into its matching */
#define PAIR_FETCHED_SLOW_OFF 136 /*  and the highest slow send (its number + 1) it has taken in */
#define PAIR_UNEXP_OFF 144       /*   and the pair's messages waiting unexpected in its matching */
#define PAIR_HDR_BYTES 192
#define CELL_STATE_OFF 0         /* u32: CELL_EMPTY, FULL, TAKING (the receiver), DRAINING (the progress process) */
#define CELL_CODE_OFF 4          /* u32 dtype code */
#define CELL_FSEQ_OFF 8          /* u64 the cell's number in its pair (F_WRITTEN when written) */
#define CELL_SLOW_BEFORE_OFF 16  /* u64 the pair's slow sends posted before it */
#define CELL_TAG_OFF 24          /* i64 */
#define CELL_NBYTES_OFF 32
#define CELL_COUNT_OFF 40
#define CELL_TPOST_OFF 48
#define CELL_REF_OFF 56          /* u64 1: the payload stays in the sender's arena (shm/_fast.h, "By reference") */
#define CELL_HDR_BYTES 64
enum { CELL_EMPTY = 0, CELL_FULL = 1, CELL_TAKING = 2, CELL_DRAINING = 3 };
#define CAREA_WORD_OFF 0         /* u32 futex word of the small collectives (bumped to wake sleepers) */
#define CAREA_WAITERS_OFF 8      /* u64 ranks that may sleep on it (atomic) */
#define CRANK_DONE_OFF 0         /* u64, the rank: the last small collective it finished reading */
#define CRANK_SLOW_COLLS_OFF 8   /* u64, the rank: collectives it posted to the progress process */
#define CRANK_SLOW_FP_OFF 16     /* u64, the rank: the last of them (kind, op, dtype, root; CRANK_SLOW_COLLS */
#define CRANK_SLOW_COUNT_OFF 24  /*   publishes it) and its element count, named by a mismatch */
#define CRANK_ARENA_OFF 32       /* u64, the rank: its numpy arena (shm/_arena.c) as pid << 32 | fd + 1; 0 not
                                  * yet told, ARENA_NONE none (the middle collectives: shm/_poster_coll.c) */
#define CRANK_ARENA_SIZE_OFF 40  /* u64, the rank: the arena's bytes (stored before CRANK_ARENA_OFF) */
#define ARENA_NONE (~(uint64_t)0)
#define CSLOT_SEQ_OFF 0          /* u64, stored last: the small collective this slot holds */
#define CSLOT_FP_OFF 8           /* u64 what it is (kind, op, dtype, bytes, root) */
#define CSLOT_SLOW_BEFORE_OFF 16 /* u64 the rank's slow collectives before it */
#define CSLOT_IN_OFF 24          /* u64 a middle collective's: where the rank's input lies in its arena */
#define CSLOT_OUT_OFF 32         /* u64   and its output */
#define CSLOT_MAPPED_OFF 40      /* u64   1: the rank maps every rank's arena (else every rank declines) */

#endif
