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

/* completion slots: u64 words */
enum { SLOT_DONE_SEQ, SLOT_NBYTES, SLOT_STATUS, SLOT_TAG, SLOT_WORDS };

/* per-rank areas */
#define RANK_AREA_BYTES 64
#define RANK_WAKE_OFF 8        /* uint32 futex word */
#define RANK_WAITING_OFF 16    /* u64: the rank may sleep: (its CPU + 1) | the word it sleeps on << 32 */
#define RANK_COMPLETED_OFF 40  /* u64 statistics */
#define RANK_PENDING_OFF 48    /* u64: (first + 1) << 32 | (last + 1) of a chain handed off; 0 = none */

#endif
