"""The ops pool: the one shared-memory segment of a communicator on a node, and its layout.

All offsets are computed here, once, from (nlocal, max_ops, max_subs); both sides derive the same
layout from the numbers in the header, and a magic + version mismatch fails fast. Records link by
int32 index, never by address or pickle. Everything is little-endian, 8-byte aligned.

    offset  field                         writer (protection)
    ------  ----------------------------  ---------------------------------------------------
    0       magic u64, version u32,       progress process, before anyone attaches
            header_bytes u32, nlocal u32,
            max_ops u32, max_subs u32,
            reserved u32, total_bytes u64
    64      pthread_mutex_t (40 B)        -
    104     next_ops i32, next_ops_end i32   ranks and progress, under the mutex (posted chain); in the
                                          mutex's cache line, so a critical section moves one line less
    128     pthread_cond_t  (64 B)        -
    192     pending_mask u64              bit r: local rank r handed a chain off in its RANK_PENDING
                                          slot (atomics; shm/_pool_lock.h "Hand-off")
    256     control counters (u64 each)   see CTRL_* below, one writer each
    512     error message (512 B, utf-8)  progress, before ERR_SEQ is stored
    1024    free_ops[nlocal] i32          progress pushes, owner rank takes all; under the mutex
    A       rank areas [nlocal] x 64 B    see RANK_* below
    I       info blob (INFO_BYTES)        progress, at start: u64 length + JSON (params, affinity)
    S       request slots [nlocal][max_ops] x 32 B   progress (completion of one request)
    T       sub table [max_subs] x 96 B   progress (per-sub counters, for the dump tool)
    R       op records [nlocal][max_ops] x 128 B     owner rank while private, read by progress
                                          after it was posted; `next` under the mutex once spliced
    F       the fast path (only when the header's fast_bytes is not 0), below

Fast path (shm/_fast.h holds the protocol; every line has one writer unless said):
    F       per local rank, 64 B:  recv_done (progress); doorbell (senders, atomic add); its rank in
            the communicator + 1 (the rank, once attached); cells written to it (senders, atomic add),
            taken by it (the rank), drained (progress)
    P       per (sender, receiver) pair, s * nlocal + d:  line 0 the sender's (cells written, slow
            sends posted), line 1 the receiver's (cells taken), line 2 progress's (cells drained, slow
            sends fetched, messages waiting unexpected), then FAST_CELLS cells of a 64 B header and
            fast_bytes of payload
    C       small collectives: a 64 B header (futex word, waiters), then per rank a 64 B line (done,
            slow collectives posted) and two slots (by the collective's parity) of a 64 B header
            and fast_bytes of payload

Each local rank owns the contiguous records [r*max_ops, (r+1)*max_ops) and request slots of the same
indices. A record is private to its owner while it is in the owner's process-local free list or
being filled; posting hands it to the progress process (spliced onto the posted chain, or left in the
rank's pending slot for the progress process to splice), which copies it out and returns it to
free_ops[owner] in the same critical section (NCCL's freeOps).
"""
from __future__ import annotations

import json
import struct

from shmproxy.shm import _native, counters, sync

MAGIC = 0x5958_4F52_5048_4D53  # b"SHMPROXY" little-endian
VERSION = 5   # 3: posts hand chains off through RANK_PENDING without the mutex (_pool_lock.h);
              # 4: CTRL_EVENTS (news for the loop from its own threads), the record's memory kind;
              # 5: the fast path's region (fast_bytes in the header), RANK_RECV_POSTED, the record's
              #    pair number (x2)

HEADER_FMT = struct.Struct("<QIIIIIIQ")  # magic, version, header_bytes, nlocal, max_ops, max_subs, fast_bytes,
                                         # total
assert HEADER_FMT.size == 40
MUTEX_OFF = 64
COND_OFF = 128
NEXT_OPS_OFF = 104
NEXT_OPS_END_OFF = 108
PENDING_MASK_OFF = 192
CTRL_OFF = 256
ERR_MSG_OFF = 512
ERR_MSG_BYTES = 512
FREE_OPS_OFF = 1024
assert sync.MUTEX_SIZE <= NEXT_OPS_OFF - MUTEX_OFF and sync.COND_SIZE <= PENDING_MASK_OFF - COND_OFF

# Control counters: u64 index relative to CTRL_OFF // 8.
CTRL_STOP = 0          # progress: 1 once it stops fetching (close)
CTRL_ABORT = 1         # anyone, 0 -> 1 only (idempotent): every loop and wait exits
CTRL_PROXY_PID = 2     # progress
CTRL_HEARTBEAT = 3     # progress: time.monotonic_ns() every HEARTBEAT_MS while alive
CTRL_STATE = 4         # progress: PROXY_STARTING / RUNNING / STOPPING / EXITED
CTRL_ERR_SEQ = 5       # progress: 0 = no error; set to 1 after the ERR_* fields below
CTRL_ERR_CODE = 6      # progress: shmproxy.core.errors code of the first error
CTRL_ERR_RANK = 7      # progress: rank involved (2**64-1 = none; -1 stored as that)
CTRL_ERR_PID = 8       # progress
CTRL_SLEEPING = 9      # progress: 1 while it may be blocked on the condvar (atomics: _pool_lock.h "Hand-off")
CTRL_N_FETCH = 10      # progress: statistics shown by the dump
CTRL_N_OPS = 11
CTRL_N_ARGS = 12
CTRL_N_SLEEP = 13
CTRL_N_PASSES = 14
CTRL_ACTIVE_SUBS = 15
CTRL_EVENTS = 16       # threads of the progress process other than its loop: bumped with news for the loop
                       # (_native.post_event; the loop does not sleep past a change: sleep_unless_posted)
CTRL_N_BUFFERED = 17   # progress: sends it copied into its own memory (buffered standard mode), for the dump
CTRL_N_COPY_JOBS = 18  # progress: jobs handed to its copy workers so far, for the dump
CTRL_COUNT = 32

PROXY_STARTING, PROXY_RUNNING, PROXY_STOPPING, PROXY_EXITED = 0, 1, 2, 3
NO_RANK = 2**64 - 1

# Per-rank area (64 bytes): u64 index relative to the rank's area start // 8.
RANK_AREA_BYTES = 64
RANK_PID = 0           # progress (from the service's SO_PEERCRED)
RANK_WAKE = 1          # low 32 bits: futex word, bumped by progress on completions and by abort
RANK_WAITING = 2       # the rank, while it may sleep on its futex: (CPU + 1) | word it sleeps on << 32; else 0
RANK_POSTED = 3        # the rank: ops posted (statistics)
RANK_CONN_STATE = 4    # progress: shmproxy.control.protocol.ConnState of the rank's service connection
RANK_COMPLETED = 5     # progress: requests of this rank completed (statistics)
RANK_PENDING = 6       # the rank sets, a mutex holder clears (atomics): (first + 1) << 32 | (last + 1) of
                       # a chain it handed off, not yet spliced (shm/_pool_lock.h "Hand-off"); 0 = none
RANK_RECV_POSTED = 7   # the rank: receives and probes it posted (the fast path: FRANK_RECV_DONE)

# The fast path's region (see the module header; offsets mirror shm/_pool_layout.h).
FAST_CELLS = 4
FAST_LINE = 64
FRANK_RECV_DONE, FRANK_DOORBELL, FRANK_RANK = 0, 2, 3       # u64 indices in a rank's line
FRANK_CELLS_WRITTEN, FRANK_CELLS_TAKEN, FRANK_CELLS_DRAINED = 4, 5, 6
PAIR_F_WRITTEN, PAIR_SLOW_SENT = 0, 1                           # u64 indices in a pair block
PAIR_F_TAKEN = 8
PAIR_F_DRAINED, PAIR_FETCHED_SLOW, PAIR_UNEXP = 16, 17, 18
PAIR_HDR_BYTES = 192
CELL_HDR_BYTES = 64
CELL = struct.Struct("<IIQQqQQQ")   # state, code, fseq, slow_before, tag, nbytes, count, t_post
CELL_EMPTY, CELL_FULL, CELL_TAKING, CELL_DRAINING = 0, 1, 2, 3
CRANK_DONE, CRANK_SLOW_COLLS, CRANK_SLOW_FP, CRANK_SLOW_COUNT = 0, 1, 2, 3   # u64 indices, a rank's coll line
CSLOT = struct.Struct("<QQQ")        # seq, fingerprint, slow_before


def waiting_value(cpu: int, word: int) -> int:
    """RANK_WAITING of a rank about to sleep on CPU ``cpu`` on futex word value ``word``."""
    return (cpu + 1) | (word << 32)


def waiting_cpu(waiting: int) -> int:
    """The CPU a RANK_WAITING value says its rank sleeps on; -1 when it is 0 (not sleeping)."""
    return (waiting & 0xFFFFFFFF) - 1


INFO_BYTES = 16384

# Request completion slot (40 bytes), u64 index relative to slot start // 8.
SLOT_BYTES = 40
SLOT_DONE_SEQ = 0      # stored last: equals the request's seq once complete
SLOT_NBYTES = 1        # bytes received (receives) or sent
SLOT_STATUS = 2        # low 32 bits: 0 or an error code; high 32 bits: source rank
SLOT_TAG = 3           # tag of the matched message (two's complement)
SLOT_STREAM_SEQ = 4    # low 32 bits: the request's seq, stored by the rank's GPU stream once the work it
#                        queued before a device op is done (transports/cuda_order.py); no one else writes it

# Op record (128 bytes). `next` must stay at offset 0 (shm/_poster.c and shm._native.take_posted rely on it).
RECORD = struct.Struct(
    "<i"      # next
    "BBBB"    # kind, dtype, redop, flags
    "ii"      # owner (local rank), peer (global rank; root for collectives)
    "q"       # tag
    "QQ"      # opcount (group number of the owner), req_seq
    "Ii"      # req_slot, buf_id
    "QQQ"     # offset, nbytes, count (elements)
    "ii"      # buf2_id, mem (memory kind | device << 8 of the op's buffers: shmproxy.core.memory)
    "QQ"      # offset2, nbytes2
    "QQ"      # coll_seq, t_post_ns
    "QQ"      # reserved for the collective layer
)
RECORD_BYTES = 128
assert RECORD.size == RECORD_BYTES

# shm/_pool_layout.h hard-codes these for the C helpers (shm._native, shm._poster): it must agree.
if _native.POOL_LAYOUT != (MUTEX_OFF, NEXT_OPS_OFF, NEXT_OPS_END_OFF, COND_OFF, PENDING_MASK_OFF,
                           CTRL_OFF + 8 * CTRL_SLEEPING, CTRL_OFF + 8 * CTRL_EVENTS, FREE_OPS_OFF, RECORD_BYTES,
                           struct.calcsize("<iBBBB"), struct.calcsize("<iBBBBiiq"),
                           struct.calcsize("<iBBBBiiqQQIiQQQi"), SLOT_BYTES, RANK_AREA_BYTES,
                           8 * RANK_WAKE, 8 * RANK_WAITING, 8 * RANK_COMPLETED, 8 * RANK_PENDING):
    raise ImportError("shm/_pool_layout.h and shm/pool.py disagree on the ops pool layout (or shm._native "
                      "is stale: pip install -e .)")

if _native.FAST_LAYOUT != (28, FAST_CELLS, FAST_LINE, 8 * FRANK_RECV_DONE, 8 * PAIR_UNEXP, 8 * FRANK_DOORBELL,
                           8 * PAIR_F_WRITTEN, 8 * PAIR_SLOW_SENT, 8 * PAIR_F_TAKEN, 8 * PAIR_F_DRAINED,
                           8 * PAIR_FETCHED_SLOW, PAIR_HDR_BYTES, CELL_HDR_BYTES, 24, 8 * RANK_RECV_POSTED, 0, 8,
                           8 * CRANK_DONE, 8 * CRANK_SLOW_COLLS, 0, 16):
    raise ImportError("shm/_pool_layout.h and shm/pool.py disagree on the fast path's layout (or shm._native is "
                      "stale: pip install -e .)")
CAREA_WORD_OFF = 0

# Sub table entry (96 bytes): progress counters of one sub, mirrored for the dump tool.
SUB = struct.Struct("<IIiiQQQQQQQQq")  # state, kind, src, dst, opcount, nbytes, nsteps,
SUB_BYTES = 96                           # posted, transmitted, received, done, args_id, tag
assert SUB.size <= SUB_BYTES
SUB_POSTED, SUB_TRANSMITTED, SUB_RECEIVED, SUB_DONE = 5, 6, 7, 8  # u64 indices in an entry
SUB_FREE, SUB_READY, SUB_PROGRESS, SUB_NONE = 0, 1, 2, 3
SUB_STATE_LETTER = {SUB_FREE: "-", SUB_READY: "R", SUB_PROGRESS: "P", SUB_NONE: "N"}


def _align(x: int, a: int = 64) -> int:
    return (x + a - 1) // a * a


class Layout:
    """Offsets of every region, computed once (they sit on the posting hot path)."""

    __slots__ = ("nlocal", "max_ops", "max_subs", "rank_area_off", "info_off", "slots_off", "subs_off",
                 "records_off", "total_bytes", "nrecords", "fast_bytes", "fast_off", "pairs_off", "cell_stride",
                 "pair_stride", "coll_off", "crank_stride")

    def __init__(self, nlocal: int, max_ops: int, max_subs: int, fast_bytes: int = 0):
        self.nlocal, self.max_ops, self.max_subs, self.fast_bytes = nlocal, max_ops, max_subs, fast_bytes
        self.rank_area_off = _align(FREE_OPS_OFF + 4 * nlocal)
        self.info_off = _align(self.rank_area_off + RANK_AREA_BYTES * nlocal)
        self.slots_off = _align(self.info_off + INFO_BYTES)
        self.subs_off = _align(self.slots_off + SLOT_BYTES * nlocal * max_ops)
        self.records_off = _align(self.subs_off + SUB_BYTES * max_subs)
        end = _align(self.records_off + RECORD_BYTES * nlocal * max_ops)
        self.fast_off = end
        self.cell_stride = CELL_HDR_BYTES + _align(fast_bytes)
        self.pair_stride = PAIR_HDR_BYTES + FAST_CELLS * self.cell_stride
        self.crank_stride = FAST_LINE + 2 * self.cell_stride
        self.pairs_off = self.fast_off + FAST_LINE * nlocal
        self.coll_off = self.pairs_off + self.pair_stride * nlocal * nlocal
        if fast_bytes:
            end = self.coll_off + FAST_LINE + self.crank_stride * nlocal
        self.total_bytes = _align(end, 4096)
        self.nrecords = nlocal * max_ops

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and (self.nlocal, self.max_ops, self.max_subs, self.fast_bytes) == (
            other.nlocal, other.max_ops, other.max_subs, other.fast_bytes)

    def __hash__(self) -> int:
        return hash((self.nlocal, self.max_ops, self.max_subs, self.fast_bytes))

    def __repr__(self) -> str:
        return (f"Layout(nlocal={self.nlocal}, max_ops={self.max_ops}, max_subs={self.max_subs}, "
                f"fast_bytes={self.fast_bytes})")

    def frank_q(self, local_rank: int, field: int) -> int:
        """u64 index of a fast-path field of a local rank's line (FRANK_*)."""
        return (self.fast_off + FAST_LINE * local_rank) // 8 + field

    def pair_off(self, src: int, dst: int) -> int:
        """Offset of the fast-path block of (sender, receiver), local ranks."""
        return self.pairs_off + self.pair_stride * (src * self.nlocal + dst)

    def cell_off(self, src: int, dst: int, k: int) -> int:
        return self.pair_off(src, dst) + PAIR_HDR_BYTES + self.cell_stride * k

    def crank_off(self, rank: int) -> int:
        """Offset of a rank's line in the small collectives' area (its slots follow)."""
        return self.coll_off + FAST_LINE + self.crank_stride * rank

    def rank_q(self, local_rank: int, field: int) -> int:
        """u64 index of a per-rank field."""
        return (self.rank_area_off + RANK_AREA_BYTES * local_rank) // 8 + field

    def wake_word_offset(self, local_rank: int) -> int:
        return self.rank_area_off + RANK_AREA_BYTES * local_rank + 8 * RANK_WAKE

    def slot_q(self, record_index: int) -> int:
        """u64 index of completion slot ``record_index`` (slots are numbered like records)."""
        return (self.slots_off + SLOT_BYTES * record_index) // 8

    def record_off(self, index: int) -> int:
        return self.records_off + RECORD_BYTES * index

    def sub_off(self, index: int) -> int:
        return self.subs_off + SUB_BYTES * index


class PoolView:
    """Typed access to a mapped pool. Works on a read-write mapping or a read-only one (dump tool)."""

    def __init__(self, mm, addr: int = 0):
        magic, version, hdr, nlocal, max_ops, max_subs, fast_bytes, total = HEADER_FMT.unpack_from(mm, 0)
        if magic != MAGIC:
            raise ValueError(f"not a shmproxy ops pool (magic {magic:#x})")
        if version != VERSION:
            raise ValueError(f"ops pool layout version {version}, this shmproxy speaks {VERSION}")
        if hdr != FREE_OPS_OFF or not (0 < nlocal <= 4096 and 0 < max_ops <= 1 << 20 and 0 < max_subs <= 1 << 24
                                       and fast_bytes <= 1 << 20):
            raise ValueError(f"ops pool header is corrupt (nlocal {nlocal}, max_ops {max_ops}, max_subs {max_subs}, "
                             f"fast_bytes {fast_bytes})")
        self.layout = Layout(nlocal, max_ops, max_subs, fast_bytes)
        if total != self.layout.total_bytes or len(mm) < total:
            raise ValueError(f"ops pool size mismatch: header says {total}, layout {self.layout.total_bytes}")
        self.mm = mm
        self.buf = memoryview(mm)
        self.q = counters.u64_view(mm)
        self.i32 = counters.i32_view(mm)
        self.addr = addr
        if addr:
            self.mutex = sync.SharedMutex(addr + MUTEX_OFF)
            self.cond = sync.SharedCond(addr + COND_OFF, self.mutex)

    @staticmethod
    def initialize(mm, addr: int, layout: Layout) -> "PoolView":
        """Write a fresh header, sync objects and free lists (the creator, before anyone attaches)."""
        HEADER_FMT.pack_into(mm, 0, MAGIC, VERSION, FREE_OPS_OFF, layout.nlocal, layout.max_ops,
                             layout.max_subs, layout.fast_bytes, layout.total_bytes)
        view = PoolView(mm, addr)
        view.mutex.initialize()
        view.cond.initialize()
        view.i32[NEXT_OPS_OFF // 4] = -1
        view.i32[NEXT_OPS_END_OFF // 4] = -1
        for r in range(layout.nlocal):
            first = r * layout.max_ops
            for k in range(layout.max_ops):
                idx = first + k
                nxt = idx + 1 if k + 1 < layout.max_ops else -1
                view.i32[layout.record_off(idx) // 4] = nxt
            view.i32[FREE_OPS_OFF // 4 + r] = first
        return view

    def release(self) -> None:
        """Drop the views so that the mapping can be closed."""
        self.q.release()
        self.i32.release()
        self.buf.release()

    # --- control counters ---
    def ctrl(self, field: int) -> int:
        return self.q[CTRL_OFF // 8 + field]

    def set_ctrl(self, field: int, value: int) -> None:
        self.q[CTRL_OFF // 8 + field] = value

    def error_message(self) -> str:
        raw = bytes(self.buf[ERR_MSG_OFF:ERR_MSG_OFF + ERR_MSG_BYTES])
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    # --- info blob ---
    def write_info(self, info: dict) -> None:
        data = json.dumps(info, default=str).encode()
        if len(data) > INFO_BYTES - 8:  # never store a cut (invalid) document
            data = json.dumps({"truncated": True, "pid": info.get("pid"), "cpus": info.get("cpus")}).encode()
        off = self.layout.info_off
        self.buf[off + 8: off + 8 + len(data)] = data
        self.q[off // 8] = len(data)

    def read_info(self) -> dict:
        off = self.layout.info_off
        n = self.q[off // 8]
        if not 0 < n <= INFO_BYTES - 8:
            return {}
        try:
            return json.loads(bytes(self.buf[off + 8: off + 8 + n]))
        except (ValueError, RecursionError):
            return {"error": "info blob is not valid JSON (being rewritten, or corrupt)"}

    # --- records and lists (the dump tool and tests read these) ---
    def _check_record(self, index: int) -> None:
        if not 0 <= index < self.layout.nrecords:
            raise IndexError(f"record index {index} out of range [0, {self.layout.nrecords})")

    def record_next(self, index: int) -> int:
        self._check_record(index)
        return self.i32[self.layout.record_off(index) // 4]

    def read_record(self, index: int) -> tuple:
        self._check_record(index)
        return RECORD.unpack_from(self.buf, self.layout.record_off(index))

    def walk(self, head: int, limit: int) -> tuple[list[int], bool]:
        """Follow a chain from head. Returns (indices, loop_or_corrupt). Bounds-checks every link."""
        seen: set[int] = set()
        out: list[int] = []
        idx = head
        while idx != -1:
            if not 0 <= idx < self.layout.nrecords or idx in seen or len(out) >= limit:
                return out, True
            seen.add(idx)
            out.append(idx)
            idx = self.record_next(idx)
        return out, False

    def read_sub(self, index: int) -> tuple:
        if not 0 <= index < self.layout.max_subs:
            raise IndexError(f"sub index {index} out of range [0, {self.layout.max_subs})")
        return SUB.unpack_from(self.buf, self.layout.sub_off(index))
