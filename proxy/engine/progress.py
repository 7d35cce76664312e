"""The progress process: one per communicator per node, started by local rank 0.

    python -m shmproxy.engine.progress --path SOCK --nlocal N --size S --job-key K --comm-id C --parent PID

It creates the ops pool, serves the control socket (shmproxy.control.handler, on a thread), and runs the loop
that moves every byte (docs/architecture.md, "The progress loop"):

    while not abort and not (stop and nothing active):
        idle = progress_once()            # advance every active args through its transport
        mode = fetch_mode(idle, len(active), passes, PROGRESS_APPENDOP_FREQ)
        fetch(mode)                       # NONE | TRY (trylock) | BLOCK (spin, then condvar sleep)
        sched_yield() when idle and nothing was added

Fetching copies posted records out of the pool under the mutex (at most APPEND_BATCH_SIZE opCount
groups), returns each record to its owner's free list in the same critical section, then matches
sends with receives per (source, destination, tag) in FIFO order, which is what keeps messages of
one pair and tag from overtaking each other. A matched message becomes subs of an args keyed by
(connection, opCount); the transport advances the subs' step counters; a finished message writes
both requests' completion slots and wakes their ranks.

The loop never raises into a void: the first error is stored with its context in the pool's
asyncResult fields and the communicator is aborted, so every rank raises it at its next call.
"""
from __future__ import annotations

import argparse
import collections
import enum
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Sequence

import numpy as np

from shmproxy.engine import affinity
from shmproxy.core import errors, log, params as params_mod
from shmproxy.coll import sched
from shmproxy.engine.args import PROGRESS, READY, Args, ArgsPool, CollWork, Sub, Transfer
from shmproxy.engine.copyengine import CopyEngine
from shmproxy.core.ops import CODE_DTYPE, FLAG_IN_PLACE, KIND_COLL, KIND_RECV, KIND_SEND, Op
from shmproxy.engine.profiler import Profiler
from shmproxy.shm import _native, _reduce, _workers, pool as P, sync
from shmproxy.shm.segment import MemfdBuffer, Segment
from shmproxy import transports
from shmproxy.engine.context import EngineContext
from shmproxy.transports.base import CONN_CONNECTED, CONN_SETUP, Connector, MemKind, PeerInfo, Transport

_log = log.get("PROXY")
MASK64 = (1 << 64) - 1
INLINE_ENTRY_BYTES = 64 << 10  # schedule entries smaller than this run in the loop, not on a worker
OWNER_DEAD_GRACE_S = 2.0     # how long the pidfd watcher may take to name who died holding the mutex
AUTO_KEEP_AWAKE_US = 2000.0  # KEEP_AWAKE_US=-1 on a crowded node: covers a message's hand-offs
AUTO_LOOP_POLL_US = 100.0    # LOOP_POLL_US=-1 where the loop runs copy jobs itself: a few 512 KiB jobs
AUTO_CROWDED_COLL_CHUNK = 4 << 20  # COLL_CHUNK_SIZE=-1 where the loop runs copy jobs: ~0.3 ms of work
AUTO_STREAMING_MIN_BYTES = 16 << 20  # STREAMING_MIN_BYTES=-1: at most this (a shared 300 MiB L3 did not hold more)
WORKER_WAIT_S = 200e-6       # how long the idle loop blocks on copy workers before it looks for ops
RELAY_GRACE_NS = 200_000     # a rank left to a keep-awake guard to wake and still asleep after this: wake it
SWITCH_INTERVAL_S = 100e-6   # GIL switch interval of the progress process (default 5 ms)

# Collective kinds as plain ints for the per-op path: looking up an IntEnum member costs ~150 ns
# on the development VM, and a small Allreduce's whole budget in this process is ~10 us.
_BARRIER, _BCAST, _REDUCE, _ALLREDUCE = (int(sched.Coll.BARRIER), int(sched.Coll.BCAST), int(sched.Coll.REDUCE),
                                         int(sched.Coll.ALLREDUCE))
_ALLGATHER, _RSB, _ALLTOALL = (int(sched.Coll.ALLGATHER), int(sched.Coll.REDUCE_SCATTER_BLOCK),
                               int(sched.Coll.ALLTOALL))
_BLOCK_PER_RANK = frozenset((_ALLGATHER, _RSB, _ALLTOALL))  # a rank's buffer holds one block per rank
_WITH_REDOP = frozenset(map(int, (sched.Coll.REDUCE, sched.Coll.ALLREDUCE, sched.Coll.REDUCE_SCATTER_BLOCK)))
_WITH_ROOT = frozenset(map(int, (sched.Coll.BCAST, sched.Coll.REDUCE)))
_ITEMSIZE = {code: dt.itemsize for code, dt in CODE_DTYPE.items()}
_SLOT_WORDS = P.SLOT_BYTES // 8
_MASK_Q = P.PENDING_MASK_OFF // 8   # the pending mask: ranks handed chains off (shm/_pool_lock.h)


class FetchMode(enum.IntEnum):
    NONE = 0    # keep progressing, do not look at the posted chain this pass
    TRY = 1     # look, with trylock: never block the loop while it has work in hand
    BLOCK = 2   # nothing active: spin briefly, then a bounded sleep on the pool condvar


_F_NONE, _F_TRY, _F_BLOCK = FetchMode.NONE, FetchMode.TRY, FetchMode.BLOCK  # globals: no enum lookup per pass


def fetch_mode(idle: bool, nactive: int, passes: int, appendop_freq: int) -> FetchMode:
    """The fetch policy: fetch only when idle, when nothing is active, or every FREQ passes."""
    if nactive == 0:
        return _F_BLOCK
    if idle or passes % appendop_freq == 0:
        return _F_TRY
    return _F_NONE


def coll_chunk_limit(params: params_mod.Params, loop_copies: bool) -> int:
    """The largest chunk of a collective (per rank's buffer): COLL_CHUNK_SIZE, automatically CHUNK_SIZE.

    Where the loop runs copy jobs beside one worker per CPU (``loop_copies``), every job it hands over
    costs cross-CPU wake-ups and a pass of its Python, so a collective is cut in one chunk per CPU
    (2-rank Allreduce on the VM, 512 KiB chunks against one per CPU: 4 MiB ~255 -> ~215 us, 8 MiB
    ~650 -> ~545), up to AUTO_CROWDED_COLL_CHUNK, so that the loop, running one itself, still looks
    for new work every few hundred us."""
    if params.COLL_CHUNK_SIZE >= 0:
        return params.COLL_CHUNK_SIZE
    return AUTO_CROWDED_COLL_CHUNK if loop_copies else params.CHUNK_SIZE


def streaming_threshold(params: params_mod.Params, cpus: list[int], loop_copies: bool) -> int:
    """How many bytes a collective must write (every output together, sched.written_bytes) for its
    copies and reductions to use non-temporal stores, on a progress process running on ``cpus``.

    Streaming stores skip the read-for-ownership of every output line but leave the data in DRAM.
    Where the progress process has cores of its own they paid at every size measured (a 16-core Xeon
    host, 2 and 8 ranks, 1-64 MiB: equal or better, 2 ranks at 1 MiB ~160 against ~240 us), so
    there they are always used. On a crowded node (``loop_copies``: the loop and one worker per CPU)
    they lost while the data fit in the cache (the 2-vCPU VM, 32 MiB L3: 2-rank 4 MiB Allreduce ~400
    -> ~250 us without them) and won beyond: there the threshold is half the last-level cache (a
    collective reads about as much as it writes), at most AUTO_STREAMING_MIN_BYTES. BENCHMARKS.md,
    eleventh session."""
    if not params.COPY_STREAMING:
        return 1 << 62
    if params.STREAMING_MIN_BYTES >= 0:
        return params.STREAMING_MIN_BYTES
    if not loop_copies:
        return 0
    llc = affinity.last_level_cache_bytes(cpus[0] if cpus else 0)
    return min(llc // 2, AUTO_STREAMING_MIN_BYTES) if llc else AUTO_STREAMING_MIN_BYTES


class RankInfo:
    __slots__ = ("rank", "local_rank", "pid", "host", "affinity", "closed", "dead", "mapped")

    def __init__(self, rank: int, local_rank: int, pid: int, host: str, affinity_: list[int]):
        self.rank, self.local_rank, self.pid, self.host = rank, local_rank, pid, host
        self.affinity = affinity_
        self.closed = self.dead = self.mapped = False


class ProgressEngine:
    def __init__(self, params: params_mod.Params, path: str, nlocal: int, size: int, job_key: str,
                 comm_id: int, parent: int):
        self.params = params
        self.path, self.nlocal, self.size = path, nlocal, size
        self.job_key, self.comm_id, self.parent = job_key, comm_id, parent
        layout = P.Layout(nlocal, params.MAX_OPS_PER_RANK, params.MAX_SUBS)
        self.seg = Segment.create(f"{job_key[:8]}-c{comm_id}", layout.total_bytes, params.SHM_DIR)
        self.view = P.PoolView.initialize(self.seg.mm, self.seg.addr, layout)
        self.layout = layout
        self.view.mutex.on_owner_dead = self._mutex_owner_died
        self.view.set_ctrl(P.CTRL_PROXY_PID, os.getpid())
        self.view.set_ctrl(P.CTRL_STATE, P.PROXY_STARTING)
        self.q = self.view.q
        self.steps = params.STEPS
        self.chunk = params.CHUNK_SIZE
        self.coll_min_chunk = params.COLL_MIN_CHUNK
        self.eager = params.eager_limit
        self.coll_inline = params.COLL_INLINE_BYTES
        self.spin_ns = int(params.PROXY_SPIN_US * 1000)
        # On a crowded node the loop does not spin right after it completed work of the copy
        # workers: the ranks it just woke need the CPUs to come back and post (see complete_large).
        self.crowded = affinity.crowded(nlocal)
        self.spin_skip = False
        self.loop_copies = bool(params.LOOP_COPIES) if params.LOOP_COPIES >= 0 else self.crowded
        poll_us = params.LOOP_POLL_US if params.LOOP_POLL_US >= 0 else (AUTO_LOOP_POLL_US if self.loop_copies else 0.0)
        self.loop_poll_s = poll_us / 1e6
        self.coll_chunk = coll_chunk_limit(params, self.loop_copies)
        self.timeout = params.TIMEOUT
        self.batch = params.APPEND_BATCH_SIZE
        # fetch() copies records here under the mutex (shm._native.take_posted) and unpacks them after
        self.take_out = bytearray(P.RECORD_BYTES * layout.nrecords)
        self.take_idx = np.zeros(layout.nrecords, np.int32)
        self.take_out_addr = _native.buffer_info(self.take_out, True)[0]
        self.take_idx_addr = _native.buffer_info(self.take_idx, True)[0]
        # Per local rank: (u64 index of its COMPLETED counter, address of its futex word, u64 index of
        # its WAITING flag), and where the completion slots start: complete() runs for every op.
        self.rank_words = [(layout.rank_q(lr, P.RANK_COMPLETED), self.seg.addr + layout.wake_word_offset(lr),
                            layout.rank_q(lr, P.RANK_WAITING)) for lr in range(nlocal)]
        self.slots_q = layout.slot_q(0)
        self.transports = transports.allowed(params.TRANSPORTS)
        self.streaming_min = streaming_threshold(params, sorted(os.sched_getaffinity(0)), self.loop_copies)
        self.argspool = ArgsPool(self.view)
        self.copy = CopyEngine(0, None)
        self.awake: Any = None  # shm._workers.KeepAwake on a crowded node (start_keep_awake)
        # Wake-ups left to a guard (wake_ranks): (deadline ns, WAITING index, its value, futex address)
        self.relayed: list[tuple[int, int, int, int]] = []
        self.profiler = Profiler(params.PROFILE)
        self.active: list[Args] = []
        self.ready: dict[tuple, Args] = {}
        self.colls: dict[int, list[Op | None]] = {}   # collective seq -> each local rank's op
        self.rendezvous = sched.Rendezvous()
        self.sends: dict[tuple, collections.deque] = {}
        self.recvs: dict[tuple, collections.deque] = {}
        self.ranks: dict[int, RankInfo] = {}          # by local rank
        self.local_of: dict[int, int] = {}            # global rank -> local rank
        self.conns: dict[tuple[int, int, MemKind], Connector] = {}   # (src, dst global ranks, kind)
        self.buffers: dict[tuple[int, int], MemfdBuffer] = {}
        self.ctx = EngineContext(self)   # all that transports see of this engine
        self.retired: collections.deque = collections.deque()
        self.cpus: list[int] | None = None
        self.affinity_reason = "not decided yet (waiting for every local rank to connect)"
        self.pending_affinity: tuple[list[int] | None, str, list[int] | None] | None = None
        self.stopping = False
        self.dump_requested = False
        self.progressed = False
        self.failed = False
        self.failure: errors.ProxyError | None = None   # the first error, for ranks still joining
        self.told: set[int] = set()     # local ranks whose join the service refused with it
        self.joins = threading.Condition()  # notified by the service thread on every message and exit
        self.owner_died_at = 0.0
        self.passes = 0
        self.t_start = time.monotonic()
        self._write_info()
        # Imported here: the control module needs ProgressEngine's names only at run time.
        from shmproxy.control.handler import ControlHandler
        from shmproxy.control.service import ServiceServer
        self.server = ServiceServer(path, ControlHandler(self), token=job_key)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        sync.set_lock_spin(self.params.LOCK_SPIN_US)   # contended pool locks retry briefly first
        self.server.start()
        self.view.set_ctrl(P.CTRL_STATE, P.PROXY_RUNNING)
        _log.info("progress process up: pool %s (%d bytes), %d local ranks, socket %s",
                  self.seg.name, self.layout.total_bytes, self.nlocal, self.path)

    def shutdown(self) -> None:
        """Tear everything down; safe after any failure, and nothing of ours is left behind."""
        self.view.set_ctrl(P.CTRL_STATE, P.PROXY_STOPPING)
        if self.failed:
            self.wait_until_told(self.params.FAIL_LINGER_S)
        self.server.stop(timeout=5.0)
        self.copy.stop()
        if self.awake is not None:
            self.awake.stop()
        self.view.set_ctrl(P.CTRL_STATE, P.PROXY_EXITED)
        if self.profiler.enabled and self.params.PROFILE_FILE:
            self.profiler.write(self.params.PROFILE_FILE)
        self.seg.unlink()
        self.active.clear()  # schedules hold numpy views of the buffers closed below
        self.colls.clear()
        self.rendezvous.waiting.clear()
        self.retired.extend(self.buffers.values())
        self.buffers.clear()
        self._close_retired()
        self.view.release()
        self.seg.close()
        _log.info("progress process exiting")

    def _close_retired(self) -> None:
        """Unmap deregistered buffers; one still viewed by a numpy array is retried later."""
        keep = []
        while self.retired:
            buf = self.retired.popleft()
            try:
                buf.close()
            except BufferError:
                keep.append(buf)
        if keep:
            _log.info("%d deregistered buffer(s) still referenced; unmapping later", len(keep))
            self.retired.extend(keep)

    def _write_info(self) -> None:
        self.view.write_info({
            "pid": os.getpid(), "job_key": self.job_key, "comm_id": self.comm_id, "nlocal": self.nlocal,
            "size": self.size, "socket": self.path, "pool": self.seg.name, "cpus": self.cpus,
            "affinity_reason": self.affinity_reason, "copy_threads": self.copy.nworkers,
            "params": {p.env_name(): {"value": p.value, "origin": p.origin} for p in self.params.items()},
            "ranks": {r.local_rank: {"rank": r.rank, "pid": r.pid, "host": r.host}
                      for r in self.ranks.values()},
        })

    # ------------------------------------------------------------------ called by the control thread
    def wake_loop(self) -> None:
        """Wake the loop if it sleeps on the condvar (after stop/abort/state changes)."""
        self.view.mutex.lock(self.params.TIMEOUT)
        try:
            self.view.cond.broadcast()
        finally:
            self.view.mutex.unlock()

    def decide_affinity(self) -> None:
        rank_sets = [set(r.affinity) for r in self.ranks.values()]
        try:
            allowed = affinity.allowed_cpus()
            cpus, reason = affinity.choose_proxy_cpus(self.params, rank_sets, allowed)
            floating = None if cpus else affinity.float_cpus(self.params, rank_sets, allowed)
            self.pending_affinity = (cpus, reason, floating)
        except errors.ProxyError as exc:
            self.fail(exc.code, f"cannot choose progress cores: {exc}")

    def rank_closed(self, info: RankInfo) -> None:
        info.closed = True
        for key, q in list(self.recvs.items()):
            if key[0] == info.rank:
                for op in q:
                    self.complete(op, errors.InvalidUsage.code, 0)
                del self.recvs[key]
        if len(self.ranks) == self.nlocal and all(r.closed or r.dead for r in self.ranks.values()):
            self.stopping = True
            self.view.set_ctrl(P.CTRL_STOP, 1)
            self.wake_loop()

    def not_told(self) -> list[int]:
        """The local ranks that cannot yet learn of the failure without the service: none of mapping the
        pool (its error record), dying, closing, or having its join refused with the failure happened."""
        out = []
        for lr in range(self.nlocal):
            info = self.ranks.get(lr)
            if lr not in self.told and not (info is not None and (info.mapped or info.dead or info.closed)):
                out.append(lr)
        return out

    def wait_until_told(self, bound_s: float) -> None:
        """After a failure, keep the service answering (ControlHandler refuses every join with the
        failure) until not_told is empty, at most ``bound_s``: a rank still joining when another died
        learns who died, instead of finding the service gone (a reset, or no socket until its
        TIMEOUT)."""
        deadline = time.monotonic() + bound_s
        with self.joins:
            while left_out := self.not_told():
                left = deadline - time.monotonic()
                if left <= 0:
                    _log.info("failed; local ranks %s never learned it from the service", left_out)
                    return
                self.joins.wait(left)

    def rank_died(self, info: RankInfo, how: str = "") -> None:
        if info.closed or info.dead:
            return
        info.dead = True
        inflight = self._inflight_with(info.rank)
        if self.owner_died_at and not how:
            how = "holding the ops pool mutex"
        self.fail(errors.PeerDiedError.code,
                  f"rank {info.rank} (local rank {info.local_rank}, pid {info.pid}) died"
                  + (f" {how}" if how else "")
                  + (f"; in flight with it: {inflight}" if inflight else ""),
                  rank=info.rank, pid=info.pid)

    # ------------------------------------------------------------------ failure
    def fail(self, code: int, message: str, rank: int | None = None, pid: int | None = None) -> None:
        """Keep the first error (asyncResult), abort the communicator, wake everybody."""
        q, base = self.q, P.CTRL_OFF // 8
        if not self.failed:
            self.failed = True
            self.failure = errors.from_code(code, message, rank=rank, pid=pid)
            data = message.encode("utf-8", "replace")[: P.ERR_MSG_BYTES - 1] + b"\0"
            self.view.buf[P.ERR_MSG_OFF:P.ERR_MSG_OFF + len(data)] = data
            q[base + P.CTRL_ERR_CODE] = code
            q[base + P.CTRL_ERR_RANK] = P.NO_RANK if rank is None else rank & MASK64
            q[base + P.CTRL_ERR_PID] = pid or 0
            q[base + P.CTRL_ERR_SEQ] = 1
            _log.warning("communicator failed: %s", message)
        q[base + P.CTRL_ABORT] = 1
        self._wake_all_ranks()

    def _wake_all_ranks(self) -> None:
        self.wake_ranks(tuple(range(self.nlocal)))

    def _mutex_owner_died(self) -> None:
        """We got the pool mutex with EOWNERDEAD. The kernel releases a robust mutex early in the
        owner's exit, before the process is a zombie, so asking now "who is dead?" can find nobody:
        stop trusting the posted chain, and let the pidfd watcher (rank_died) name the dead rank;
        tick() falls back to an anonymous report after OWNER_DEAD_GRACE_S."""
        dead = [r for r in self.ranks.values() if not _alive(r.pid)]
        if dead:
            self.rank_died(dead[0], "holding the ops pool mutex")
        elif not self.owner_died_at:
            self.owner_died_at = time.monotonic()

    def _inflight_with(self, rank: int) -> str:
        items = []
        for key, q in list(self.sends.items()) + list(self.recvs.items()):
            if rank in key[:2]:
                items.extend(op.describe() for op in q)
        for a in self.active:
            if rank in a.conn:
                items.append(f"args {a.id} {a.conn[0]}->{a.conn[1]} opCount {a.opcount} ({len(a.subs)} subs)")
        return "; ".join(items[:8]) + (f" (+{len(items) - 8} more)" if len(items) > 8 else "")

    # ------------------------------------------------------------------ fetch
    def fetch(self, mode: FetchMode) -> int:
        view, i32 = self.view, self.view.i32
        head_i = P.NEXT_OPS_OFF // 4
        if mode != _F_TRY:
            self._spin_for_work()
        if (i32[head_i] != -1 or self.q[_MASK_Q]) and not (self.failed or self.owner_died_at):
            n = self._fetch_posted(mode != _F_TRY)   # lock, take, unlock: one C call
        elif mode == _F_TRY:
            return 0
        else:
            view.mutex.lock(self.timeout)
            try:
                if i32[head_i] == -1 and not self.q[_MASK_Q] and not self._should_exit():
                    self._sleep_locked()
                n = self._take_locked() if not (self.failed or self.owner_died_at) else 0
            finally:
                view.mutex.unlock()
        ops = self._unpack_taken(n)
        for op in ops:
            self.append(op)
        if ops:
            self.q[P.CTRL_OFF // 8 + P.CTRL_N_FETCH] += 1
            self.q[P.CTRL_OFF // 8 + P.CTRL_N_OPS] += len(ops)
        return len(ops)

    def _spin_for_work(self) -> None:
        spin_ns = self.spin_ns
        if self.spin_skip:
            self.spin_skip = False
            return
        if spin_ns <= 0:
            return
        i32, head_i, q = self.view.i32, P.NEXT_OPS_OFF // 4, self.q
        deadline = time.monotonic_ns() + spin_ns
        while (i32[head_i] == -1 and not q[_MASK_Q] and time.monotonic_ns() < deadline
               and not self._should_exit()):
            os.sched_yield()

    def _sleep_locked(self) -> None:
        self.q[P.CTRL_OFF // 8 + P.CTRL_N_SLEEP] += 1
        t0 = time.monotonic_ns()
        # While a guard has a wake-up to deliver, wake in time to deliver it ourselves (check_relayed).
        # Not at all if a rank handed a chain off meanwhile (shm/_pool_lock.h, "Hand-off").
        rc = _native.sleep_unless_posted(self.seg.addr, RELAY_GRACE_NS / 1e9 if self.relayed
                                         else self.params.PROXY_SLEEP_MS / 1000.0)
        self.view.mutex._handle(rc)
        if self.profiler.enabled:
            self.profiler.span("sleep", t0, time.monotonic_ns())

    def _fetch_posted(self, blocking: bool) -> int:
        """_take_locked with the lock and unlock in the same C call (_native.fetch_posted): no interpreter
        inside the critical section. 0 when a trylock lost."""
        layout = self.layout
        n, err, at, rc = _native.fetch_posted(self.seg.addr, layout.records_off, layout.rank_area_off,
                                              layout.nrecords, layout.max_ops, self.batch, self.take_out_addr,
                                              self.take_idx_addr, blocking, self.timeout)
        if rc == sync.TIMEDOUT:
            raise errors.Timeout(f"pool mutex not acquired within {self.timeout:.1f} s "
                                 f"(held by a wedged process?)")
        if rc == sync.OWNERDEAD:
            self._mutex_owner_died()
            return 0
        return self._check_taken(n, err, at)

    def _take_locked(self) -> int:
        """Take at most APPEND_BATCH_SIZE opCount groups off the posted chain (mutex held): in C, which
        copies the records to ``take_out`` and returns each to its owner's free list (NCCL's freeOps),
        so that ranks posting meanwhile wait nanoseconds per record, not the microsecond of unpacking."""
        layout = self.layout
        n, err, at = _native.take_posted(self.seg.addr, layout.records_off, layout.rank_area_off,
                                         layout.nrecords, layout.max_ops, self.batch, self.take_out_addr,
                                         self.take_idx_addr)
        return self._check_taken(n, err, at)

    def _check_taken(self, n: int, err: int, at: int) -> int:
        if err == 1:
            self.fail(errors.InternalError.code, f"ops pool corrupt: posted chain links to record {at}")
            return 0
        if err == 2:
            self.fail(errors.InternalError.code, f"ops pool corrupt: record {at} claims owner "
                                                 f"{self.view.read_record(at)[5]}, region of "
                                                 f"{at // self.layout.max_ops}")
            return 0
        return n

    def _unpack_taken(self, n: int) -> list[Op]:
        """The ``n`` records that _take_locked copied, as Op objects (after the mutex is released)."""
        if not n:
            return []
        now, ranks, idx = time.monotonic_ns(), self.ranks, self.take_idx
        ops = []
        for k, fields in enumerate(P.RECORD.iter_unpack(memoryview(self.take_out)[:n * P.RECORD_BYTES])):
            info = ranks.get(fields[5])
            ops.append(Op(int(idx[k]), fields, info.rank if info else -1, now))
        return ops

    # ------------------------------------------------------------------ append (match + batch)
    def append(self, op: Op) -> None:
        if op.rank < 0:
            self.fail(errors.InternalError.code, f"op from local rank {op.owner}, which never initialised")
            return
        if op.kind == KIND_COLL:
            self.coll_arrive(op)
            return
        if not 0 <= op.peer < self.size:
            self.complete(op, errors.InvalidArgument.code, 0)
            return
        if op.kind == KIND_SEND:
            key = (op.rank, op.peer, op.tag)
            mine, theirs = self.sends, self.recvs
        elif op.kind == KIND_RECV:
            key = (op.peer, op.rank, op.tag)
            mine, theirs = self.recvs, self.sends
        else:
            self.complete(op, errors.InternalError.code, 0)
            return
        q = theirs.get(key)
        if q:
            other = q.popleft()
            if not q:
                del theirs[key]
            if op.kind == KIND_SEND:
                self.match(op, other)
            else:
                self.match(other, op)
            return
        peer_local = self.local_of.get(op.peer)
        if peer_local is not None and self.ranks[peer_local].closed and op.peer != op.rank:
            self.complete(op, errors.InvalidUsage.code, 0)
            return
        mine.setdefault(key, collections.deque()).append(op)

    def match(self, send: Op, recv: Op) -> None:
        """A send met its receive: check what only the pair can tell (truncation, dtype), then hand the
        message to the connector of (sender, receiver, memory kind), which moves it."""
        n = send.nbytes
        if n > recv.nbytes:
            self.complete(recv, errors.TruncationError.code, n, source=send.rank, tag=send.tag)
            self.complete(send, 0, n)
            return
        if send.dtype != recv.dtype:
            self.complete(recv, errors.InvalidUsage.code, n, source=send.rank, tag=send.tag,
                          peer_dtype=send.dtype)
            self.complete(send, errors.InvalidUsage.code, n, source=recv.rank, tag=send.tag,
                          peer_dtype=recv.dtype)
            return
        conn = self.conns.get((send.rank, recv.rank, MemKind.HOST))
        if conn is None:
            conn = self.connect(send.rank, recv.rank, MemKind.HOST)
        t = Transfer(send, recv, n, time.monotonic_ns())
        try:
            done = conn.transport.proxy_start(self.ctx, conn, t)
        except errors.InvalidArgument as exc:
            _log.warning("%s", exc)
            self.complete(recv, exc.code, n, source=send.rank, tag=send.tag)
            self.complete(send, exc.code, n)
            return
        conn.nmsgs += 1
        conn.nbytes += n
        if done:
            self.finish_transfer(t)

    def connect(self, src: int, dst: int, kind: MemKind) -> Connector:
        """The connector of (src, dst, kind): the first allowed transport that can carry it, both
        sides set up and connected. Both sides are ranks of this node, so the connect-info blobs are
        handed over here; across nodes they travel between progress processes."""
        a = self.ranks[self.local_of[src]]
        b = self.ranks[self.local_of[dst]]
        me = PeerInfo(a.rank, a.local_rank, a.host, a.pid)
        peer = PeerInfo(b.rank, b.local_rank, b.host, b.pid)
        t = transports.select(me, peer, kind, self.transports)
        conn = Connector(t, me, peer, kind)
        send_info = t.send_setup(self.ctx, conn)
        recv_info = t.recv_setup(self.ctx, conn)
        conn.state = CONN_SETUP
        t.send_connect(self.ctx, conn, recv_info)
        t.recv_connect(self.ctx, conn, send_info)
        conn.send_info, conn.recv_info, conn.state = send_info, recv_info, CONN_CONNECTED
        self.conns[(src, dst, kind)] = conn
        _log.info("connection %d->%d (%s memory) over %s", src, dst, kind.name.lower(), t.name)
        return conn

    def coll_transport(self) -> Transport:
        """The transport of this node's collectives: the one a local rank's connector to itself (the
        loopback) uses, for host memory: every local buffer is mapped here."""
        r = self.ranks[0].rank
        conn = self.conns.get((r, r, MemKind.HOST)) or self.connect(r, r, MemKind.HOST)
        if conn.transport.proxy_progress_coll is None:
            raise errors.InvalidUsage(f"transport {conn.transport.name} runs no collectives between the "
                                      f"ranks of a node")
        return conn.transport

    # ------------------------------------------------------------------ collectives
    def coll_arrive(self, op: Op) -> None:
        """Collect every local rank's op of one collective (by sequence number), then start it."""
        ops = self.colls.get(op.coll_seq)
        if ops is None:
            ops = self.colls[op.coll_seq] = [None] * self.nlocal
        if ops[op.owner] is not None:
            self.fail(errors.InternalError.code, f"{op.describe()}: local rank {op.owner} posted collective "
                      f"#{op.coll_seq} twice")
            return
        ops[op.owner] = op
        if None not in ops:
            del self.colls[op.coll_seq]
            self.start_coll(ops)  # type: ignore[arg-type]

    @staticmethod
    def fingerprint(op: Op) -> tuple:
        c = op.coll
        if c == _BARRIER:
            return (c, 0, 0, 0, -1)
        return (c, op.dtype, op.count, op.redop if c in _WITH_REDOP else 0, op.peer if c in _WITH_ROOT else -1)

    @staticmethod
    def describe_fingerprint(fp: tuple) -> str:
        c, dtype, count, redop, root = fp
        parts = [CODE_DTYPE[dtype].name if dtype in CODE_DTYPE else f"dtype {dtype}", f"count {count}"]
        if redop:
            parts.append(sched.REDUCE_OP_NAMES.get(redop, str(redop)))
        if root >= 0:
            parts.append(f"root {root}")
        return f"{sched.COLL_NAMES.get(c, c)}({', '.join(parts)})"

    def start_coll(self, ops: list[Op]) -> None:
        fingerprint = self.fingerprint
        first = fingerprint(ops[0])
        for other in ops[1:]:
            fp = fingerprint(other)
            if fp != first:
                self.fail(errors.InvalidUsage.code,
                          f"collective #{ops[0].coll_seq} mismatch: rank {ops[0].rank} called "
                          f"{self.describe_fingerprint(first)} but rank {other.rank} called "
                          f"{self.describe_fingerprint(fp)}")
                return
        try:
            if self.small_coll(ops):
                return
            work, builder, nchunks, chunk_bytes = self.build_coll(ops)
        except errors.ProxyError as exc:
            for op in ops:
                self.complete(op, exc.code, 0)
            _log.warning("collective #%d refused: %s", ops[0].coll_seq, exc)
            return
        if nchunks == 0:
            self.finish_coll(work)
            return
        if work.nbytes <= self.coll_inline:
            # Small: run every chunk schedule now, inline (the latency path).
            for k in range(nchunks):
                sch = builder(k)
                while not sch.advance(self.start_entry_inline):
                    pass
            self.finish_coll(work)
            return
        op0 = ops[0]
        if sched.written_bytes(op0.coll, op0.count, _ITEMSIZE.get(op0.dtype, 1), len(ops)) > self.streaming_min:
            builder = sched.streaming_schedules(builder)
            work.streaming = True
        conn = (-1, -1)
        args = self.argspool.get_args(conn, op0.opcount, self.coll_transport())
        args.coll = work
        self.active.append(args)
        self.q[P.CTRL_OFF // 8 + P.CTRL_N_ARGS] += 1
        channels = max(1, min(self.copy.nworkers or 1, nchunks))
        per = -(-nchunks // channels)
        k0 = 0
        while k0 < nchunks:
            n = min(per, nchunks - k0)
            s = self.argspool.add_sub(args, work, 0, 0, n * chunk_bytes, chunk_bytes)
            s.nsteps, s.make, s.k0, s.inflight = n, builder, k0, collections.deque()
            k0 += n

    def small_coll(self, ops: list[Op]) -> bool:
        """The latency path: a Barrier, or a collective of at most COLL_INLINE_BYTES per rank, done here
        and now with one C call per copy or reduction, without numpy views or schedules (those cost
        20-40 us of this process's Python per small collective on the VM). Every address is resolved
        (and bounds-checked) before any byte moves. False when it does not apply: one rank, empty, a
        reduction the C kernel does not do, an in-place Reduce_scatter_block (whose blocks alias
        across the steps); the general path then runs."""
        op0 = ops[0]
        c = op0.coll
        if c == _BARRIER:
            self.complete_coll(ops, 0)
            self._profile_coll(ops, 0)
            return True
        size, n, itemsize = len(ops), op0.count, _ITEMSIZE.get(op0.dtype, 0)
        blk = n * itemsize
        nbytes = blk * size if c in _BLOCK_PER_RANK else blk
        if size < 2 or not 0 < nbytes <= self.coll_inline:
            return False
        if c in _WITH_REDOP and not _reduce.supported(op0.redop, op0.dtype):
            return False
        addr, copy, reduce = self.buffer_addr, _native.memcopy, _reduce.reduce
        if c == _ALLREDUCE:
            dsts = [addr(op, True, blk) for op in ops]
            srcs = [d if op.flags & FLAG_IN_PLACE else addr(op, False, blk) for op, d in zip(ops, dsts)]
            reduce(op0.redop, op0.dtype, n, srcs, dsts, False)
        elif c == _BCAST:
            root = op0.peer
            bufs = [addr(op, True, blk) for op in ops]
            for i, dst in enumerate(bufs):
                if i != root:
                    copy(dst, bufs[root], blk)
        elif c == _REDUCE:
            dst = addr(ops[op0.peer], True, blk)
            srcs = [dst if op.flags & FLAG_IN_PLACE else addr(op, False, blk) for op in ops]
            reduce(op0.redop, op0.dtype, n, srcs, [dst], False)
        elif c == _ALLGATHER:
            outs = [addr(op, True, nbytes) for op in ops]
            ins = [outs[r] + r * blk if op.flags & FLAG_IN_PLACE else addr(op, False, blk) for r, op in enumerate(ops)]
            for r, src in enumerate(ins):
                for d, out in enumerate(outs):
                    if out + r * blk != src:   # a rank's own block, in place, is already there
                        copy(out + r * blk, src, blk)
        elif c == _ALLTOALL:
            ins = [addr(op, False, nbytes) for op in ops]
            outs = [addr(op, True, nbytes) for op in ops]
            for q, out in enumerate(outs):
                for r, src in enumerate(ins):
                    copy(out + r * blk, src + q * blk, blk)
        elif c == _RSB:
            if any(op.flags & FLAG_IN_PLACE for op in ops):
                return False
            ins = [addr(op, False, nbytes) for op in ops]
            outs = [addr(op, True, blk) for op in ops]
            for d, out in enumerate(outs):
                reduce(op0.redop, op0.dtype, n, [src + d * blk for src in ins], [out], False)
        else:
            return False
        self.complete_coll(ops, nbytes)
        self._profile_coll(ops, nbytes)
        return True

    def _profile_coll(self, ops: list[Op], nbytes: int, **extra: int) -> None:
        """A finished collective's span: first post to now, with the last post and fetch times."""
        if self.profiler.enabled:
            op0 = ops[0]
            self.profiler.span(f"{sched.COLL_NAMES.get(op0.coll, op0.coll)} #{op0.coll_seq}",
                               min(op.t_post for op in ops), time.monotonic_ns(), bytes=nbytes,
                               last_post_ns=max(op.t_post for op in ops), fetch_ns=max(op.t_fetch for op in ops),
                               **extra)

    def buffer_of(self, op: Op, second: bool, nbytes: int) -> tuple[MemfdBuffer, int]:
        """(registered buffer, offset) of ``nbytes`` of an op's send (second=False) or receive
        buffer, bounds-checked."""
        key = (op.owner, op.buf2_id if second else op.buf_id)
        off = op.offset2 if second else op.offset
        buf = self.buffers.get(key)
        if buf is None or off + nbytes > buf.size:
            raise errors.InvalidArgument(f"{op.describe()}: buffer {key[1]} offset {off} + {nbytes} B is "
                                         f"outside the registered buffer")
        return buf, off

    def buffer_addr(self, op: Op, second: bool, nbytes: int) -> int:
        if second:
            buf, off = self.buffers.get((op.owner, op.buf2_id)), op.offset2
        else:
            buf, off = self.buffers.get((op.owner, op.buf_id)), op.offset
        if buf is None or off + nbytes > buf.size:
            buf, off = self.buffer_of(op, second, nbytes)  # raises the error
        return buf.addr + off

    def buffer_view(self, op: Op, second: bool, count: int) -> Any:
        """A numpy view of an op's send (second=False) or receive buffer, bounds-checked."""
        dt = CODE_DTYPE.get(op.dtype)
        if dt is None:
            raise errors.InvalidArgument(f"{op.describe()}: unknown dtype code {op.dtype}")
        buf, off = self.buffer_of(op, second, count * dt.itemsize)
        return np.frombuffer(buf.mm, dtype=dt, count=count, offset=off)

    def build_coll(self, ops: list[Op]) -> tuple:
        """Views of every rank's buffers and the chunk-schedule builder of one collective."""
        op0 = ops[0]
        c, n, size = op0.coll, op0.count, len(ops)
        dt = CODE_DTYPE.get(op0.dtype)
        itemsize = dt.itemsize if dt is not None else 1
        # COLL_CHUNK_SIZE, or less when that would leave copy workers idle (a 2 MiB Allreduce in
        # 512 KiB chunks would keep 4 of 8 busy); chunks of a reduction are per rank's buffer.
        workers = max(1, self.copy.nworkers)
        chunk_bytes = max(self.coll_min_chunk, min(self.coll_chunk, -(-n * itemsize // workers)))
        per = max(1, chunk_bytes // itemsize)
        now = time.monotonic_ns()
        in_place = [bool(op.flags & FLAG_IN_PLACE) for op in ops]
        if c == sched.Coll.BARRIER:
            return CollWork(ops, 0, [], now), None, 0, chunk_bytes
        if c == sched.Coll.BCAST:
            bufs = [self.buffer_view(op, True, n) for op in ops]
            nchunks, make = sched.bcast(bufs, op0.peer, chunk_bytes)
            return CollWork(ops, n * itemsize, bufs, now), make, nchunks, chunk_bytes
        if c == sched.Coll.ALLREDUCE:
            outs = [self.buffer_view(op, True, n) for op in ops]
            ins = [outs[i] if in_place[i] else self.buffer_view(op, False, n) for i, op in enumerate(ops)]
            nchunks, make = sched.allreduce(ins, outs, op0.redop, per)
            return CollWork(ops, n * itemsize, ins + outs, now), make, nchunks, per * itemsize
        if c == sched.Coll.REDUCE:
            root = op0.peer
            out = self.buffer_view(ops[root], True, n)
            ins = [out if in_place[i] else self.buffer_view(op, False, n) for i, op in enumerate(ops)]
            nchunks, make = sched.reduce_to_root(ins, out, op0.redop, root, per)
            return CollWork(ops, n * itemsize, ins + [out], now), make, nchunks, per * itemsize
        if c == sched.Coll.ALLGATHER:
            outs = [self.buffer_view(op, True, n * size) for op in ops]
            ins = [outs[i][i * n:(i + 1) * n] if in_place[i] else self.buffer_view(op, False, n)
                   for i, op in enumerate(ops)]
            nchunks, make = sched.allgather(ins, outs, n * itemsize, chunk_bytes)
            return CollWork(ops, n * itemsize * size, ins + outs, now), make, nchunks, chunk_bytes
        if c == sched.Coll.ALLTOALL:
            outs = [self.buffer_view(op, True, n * size) for op in ops]
            ins = [self.buffer_view(op, False, n * size) for op in ops]
            nchunks, make = sched.alltoall(ins, outs, n * itemsize, chunk_bytes)
            return CollWork(ops, n * itemsize * size, ins + outs, now), make, nchunks, chunk_bytes
        if c == sched.Coll.REDUCE_SCATTER_BLOCK:
            if any(in_place) and not all(in_place):
                raise errors.InvalidUsage("Reduce_scatter_block: IN_PLACE must be used by every rank or none")
            if in_place[0]:
                full = [self.buffer_view(op, True, n * size) for op in ops]
                ins, outs = full, [f[:n] for f in full]
            else:
                ins = [self.buffer_view(op, False, n * size) for op in ops]
                outs = [self.buffer_view(op, True, n) for op in ops]
            nchunks, make = sched.reduce_scatter_block(ins, outs, op0.redop, per, in_place[0])
            return CollWork(ops, n * itemsize * size, ins + outs, now), make, nchunks, per * itemsize
        raise errors.InvalidArgument(f"unknown collective {c}")

    def start_entry(self, sch: sched.Schedule, e: sched.Entry) -> bool:
        """Start one schedule entry: True when it completed inline."""
        if e.kind == sched.SEND or e.kind == sched.RECV:
            matched = self.rendezvous.offer(sch, e)
            for other_sch, other in matched:
                if other is not e:
                    other_sch.entry_done(other)
            return bool(matched)
        if e.nbytes >= INLINE_ENTRY_BYTES and self.copy.nworkers:
            step = sched.native_step(e)
            if step is not None:
                self.copy.run((sch, e), [step], sch.streaming)
            else:
                self.copy.submit((sch, e), sched.execute, e)   # numpy or a callback: no stores to choose
            return False
        sched.execute(e, sch.streaming)
        return True

    def start_schedule(self, sch: sched.Schedule) -> bool:
        """Hand a whole chunk schedule to one worker when it can run there alone; False otherwise
        (the caller then starts it entry by entry)."""
        if not self.copy.nworkers or not sch.local_only:
            return False
        steps = sch.native_steps()
        sch.claim()
        if steps is not None:
            self.copy.run(sch, steps, sch.streaming)
        else:
            self.copy.submit(sch, sched.Schedule.run_all, sch)
        return True

    def start_entry_inline(self, sch: sched.Schedule, e: sched.Entry) -> bool:
        if e.kind == sched.SEND or e.kind == sched.RECV:
            return self.start_entry(sch, e)
        sched.execute(e)
        return True

    def finish_coll(self, work: CollWork) -> None:
        self.complete_coll(work.ops, work.nbytes)
        if work.nbytes > self.coll_inline:
            self.complete_large()
        work.views = []
        self._profile_coll(work.ops, work.nbytes, match_ns=work.t_match, streaming=int(work.streaming))

    # ------------------------------------------------------------------ progress and completion
    def progress_once(self) -> bool:
        """Advance every active args once. Returns True when nothing moved (idle)."""
        self.progressed = False
        if self.copy.nworkers:
            for tok in self.copy.drain():
                if type(tok) is tuple:   # (schedule, entry) of a collective
                    tok[0].entry_done(tok[1])
                elif type(tok) is sched.Schedule:  # a whole chunk schedule
                    tok.all_done()
                else:
                    tok.chunk_done()
                self.progressed = True
        if self.active:
            if self.ready:
                self.ready.clear()
            still: list[Args] = []
            ctx = self.ctx
            for a in self.active:
                if a.state == READY:
                    self.argspool.set_state(a, PROGRESS)
                done = (a.transport.proxy_progress_coll(ctx, a) if a.coll is not None
                        else a.transport.proxy_progress(ctx, a))
                if done:
                    self.argspool.release(a)
                    self.progressed = True
                else:
                    still.append(a)
            self.active = still
        return not self.progressed

    def sub_finished(self, s: Sub) -> None:
        t = s.transfer
        t.parts_left -= 1
        if t.parts_left == 0:
            t.finish(self)

    def finish_transfer(self, t: Transfer) -> None:
        # Both sides are published before either is woken: a woken rank may preempt this loop on
        # its CPU at once, and the other side would wait behind it (~90 us on the 2-vCPU VM).
        self.complete(t.recv, 0, t.nbytes, source=t.send.rank, tag=t.send.tag, wake=False)
        self.complete(t.send, 0, t.nbytes, source=t.recv.rank, tag=t.send.tag, wake=False)
        if t.send.owner != t.recv.owner:
            self.wake_ranks((t.recv.owner, t.send.owner))
        else:
            self.wake_rank(t.recv.owner)
        if t.nbytes > self.eager:
            self.complete_large()
        if self.profiler.enabled:
            s, r = t.send, t.recv
            self.profiler.span(f"msg {s.rank}->{r.rank}", min(s.t_post, r.t_post), time.monotonic_ns(),
                               bytes=t.nbytes, tag=s.tag, fetch_ns=max(s.t_fetch, r.t_fetch),
                               match_ns=t.t_match, last_post_ns=max(s.t_post, r.t_post))

    def complete(self, op: Op, status: int, nbytes: int, source: int = -1, tag: int = 0,
                 peer_dtype: int = 0, wake: bool = True) -> None:
        """Publish a request's result in its completion slot, then wake its rank if it sleeps (unless
        ``wake`` is False: the caller wakes it once it has published everything it completes)."""
        q = self.q
        slot, owner = op.req_slot, op.owner
        if slot // self.layout.max_ops != owner:
            self.fail(errors.InternalError.code, f"{op.describe()}: completion slot {slot} out of range")
            return
        base = self.slots_q + _SLOT_WORDS * slot
        q[base + P.SLOT_NBYTES] = nbytes
        q[base + P.SLOT_STATUS] = (status & 0xFFFF) | (peer_dtype << 16) | ((source & 0xFFFFFFFF) << 32)
        q[base + P.SLOT_TAG] = tag & MASK64
        q[base + P.SLOT_DONE_SEQ] = op.req_seq  # publishes the fields above (shm/counters.py)
        q[self.rank_words[owner][0]] += 1
        if wake:
            self.wake_rank(owner)

    def complete_coll(self, ops: list[Op], nbytes: int) -> None:
        """Complete every rank's op of a collective in one C call: all slots are published before any
        rank is woken, so ranks leave together (the barrier-exit skew of a Python loop was ~1.5 us per
        rank). Same protocol as complete() and wake_rank()."""
        layout = self.layout
        relayed = self.awake.live_mask() if self.awake is not None else 0
        bad = _native.complete_coll(self.seg.addr, layout.slots_off, layout.rank_area_off, layout.max_ops,
                                    ops, nbytes, relayed)
        if bad >= 0:
            self.fail(errors.InternalError.code, f"{ops[bad].describe()}: completion slot {ops[bad].req_slot} "
                                                 f"out of range")
        elif relayed:
            self._note_relayed([op.owner for op in ops], relayed)

    def complete_large(self) -> None:
        """After completing work the copy workers did: on a crowded node, sleep at once the next time
        the loop runs out of work instead of spinning. Its ranks slept on such requests and were just
        woken; a spinning loop holds a CPU, so the kernel queues both of them on the other one and
        they come back one after the other (perf sched on the 2-vCPU VM: ~90 us apart). Their posts
        then wake the loop through the condvar."""
        if self.crowded:
            self.spin_skip = True
        if self.awake is not None:
            self.awake.touch()

    def wake_rank(self, local_rank: int) -> None:
        """Wake one rank whose completion is published: wake_ranks((local_rank,))."""
        self.wake_ranks((local_rank,))

    def wake_ranks(self, local_ranks: tuple[int, ...]) -> None:
        """Wake ranks whose completions are published, in one C call (_native.wake_owners, the same
        ordering complete_coll uses): every futex word bumped first, then the wake syscall for those
        that said they may sleep, those asleep on this CPU last (such a wakee preempts the loop at
        once), none asleep on a CPU whose keep-awake guard wakes them (shm/_workers.c, "Relayed
        wake-ups"); those are remembered, so that check_relayed wakes them should the guard not run.

        Lost wake-ups are impossible: the rank reads the word, stores WAITING (its CPU and that word),
        re-checks its slot and sleeps only while the word is unchanged (the futex compares it); we
        publish the slot, bump the word atomically (a full barrier), then read WAITING. Either the rank
        sees the new slot, or its futex_wait sees the bump, or we (or the guard) see WAITING set.
        """
        q, words, relayed = self.q, self.rank_words, 0
        if self.awake is not None and any(q[words[lr][2]] for lr in local_ranks):
            relayed = self.awake.live_mask()       # only where some rank may sleep (it costs a getcpu)
        _native.wake_owners(self.seg.addr, self.layout.rank_area_off, local_ranks, relayed)
        if relayed:
            self._note_relayed(local_ranks, relayed)

    def _note_relayed(self, local_ranks: Sequence[int], relayed: int) -> None:
        """Of ``local_ranks``, just woken with ``relayed`` (KeepAwake.live_mask), remember those asleep on
        a CPU whose keep-awake guard wakes them, so that check_relayed wakes them should the guard not
        run in time (a guard preempted just after it proved live)."""
        for lr in local_ranks:
            _completed, wake_addr, waiting = self.rank_words[lr]
            w = self.q[waiting]
            if not w:
                continue
            cpu = P.waiting_cpu(w)
            if 0 <= cpu < 64 and (relayed >> cpu) & 1:
                self.relayed.append((time.monotonic_ns() + RELAY_GRACE_NS, waiting, w, wake_addr))

    def check_relayed(self) -> None:
        """Forget the relayed wake-ups whose rank woke; wake those still asleep after RELAY_GRACE_NS."""
        now, q, keep = time.monotonic_ns(), self.q, []
        for item in self.relayed:
            deadline, waiting, w, wake_addr = item
            if q[waiting] != w:
                continue
            if now >= deadline:
                _log.debug("a relayed wake-up was late; waking the rank directly")
                _native.futex_wake(wake_addr, 0x7FFFFFFF)
            else:
                keep.append(item)
        self.relayed = keep

    # ------------------------------------------------------------------ driver
    def _should_exit(self) -> bool:
        return bool(self.q[P.CTRL_OFF // 8 + P.CTRL_ABORT]) or (self.stopping and not self.active)

    def run(self) -> None:
        freq = self.params.PROGRESS_APPENDOP_FREQ
        hb_ns = int(self.params.HEARTBEAT_MS * 1e6)
        next_tick = 0
        while not self._should_exit():
            idle = self.progress_once()
            if self.relayed:
                self.check_relayed()
            self.passes += 1
            mode = fetch_mode(idle, len(self.active), self.passes, freq)
            added = self.fetch(mode) if mode else 0
            if self.copy.in_flight and self.awake is not None:
                self.awake.touch()
            if idle and not added and mode != _F_BLOCK:
                if self.copy.in_flight:
                    # With no core of its own the loop runs queued jobs itself rather than leave its
                    # CPU to workers that would take turns on the other one (shm/_workers.c help()).
                    if not (self.loop_copies and self.copy.help()):
                        self.copy.wait(WORKER_WAIT_S, self.loop_poll_s)  # GIL released: copyengine.py
                else:
                    os.sched_yield()
            now = time.monotonic_ns()
            # An affinity decided (the last rank connected) is applied at once, not a heartbeat later:
            # until then there are no copy workers, and a job's first ~100 ms ran on the loop alone.
            if now >= next_tick or self.pending_affinity is not None:
                next_tick = now + hb_ns
                self.tick(now)

    def tick(self, now: int) -> None:
        """Housekeeping every HEARTBEAT_MS: heartbeat, affinity, retired buffers, dumps, orphaning."""
        base = P.CTRL_OFF // 8
        self.q[base + P.CTRL_HEARTBEAT] = now
        self.q[base + P.CTRL_N_PASSES] = self.passes
        self.q[base + P.CTRL_ACTIVE_SUBS] = sum(len(a.subs) for a in self.active)
        if self.pending_affinity is not None:
            self.apply_affinity(*self.pending_affinity)
            self.pending_affinity = None
        if self.retired and not self.active:
            self._close_retired()
        if self.dump_requested:
            self.dump_requested = False
            self.write_dump()
        if self.owner_died_at and not self.failed and time.monotonic() - self.owner_died_at > OWNER_DEAD_GRACE_S:
            self.fail(errors.PeerDiedError.code, "a process died holding the ops pool mutex")
        if not self.ranks and time.monotonic() - self.t_start > self.params.TIMEOUT:
            self.fail(errors.Timeout.code, f"no rank connected within {self.params.TIMEOUT} s")
        if not self.ranks and os.getppid() != self.parent:
            self.fail(errors.PeerDiedError.code, f"local rank 0 (pid {self.parent}) exited before connecting",
                      rank=None, pid=self.parent)

    def apply_affinity(self, cpus: list[int] | None, reason: str, floating: list[int] | None = None) -> None:
        """Pin every thread to ``cpus`` (CPUs of its own), or let them float over ``floating`` (the
        ranks' CPUs, when none are spare), or leave the affinity as it is (both None)."""
        self.cpus, self.affinity_reason = cpus, reason
        mask = cpus or floating
        if mask:
            affinity.pin_self(mask)
        running_on = sorted(mask or os.sched_getaffinity(0))
        n = self.params.COPY_THREADS or (len(cpus) if cpus else min(len(running_on), 8))
        if n > self.copy.nworkers:
            self.copy.stop()
            if self.loop_copies and not cpus:   # crowded: one worker per CPU, the loop beside them
                self.copy = CopyEngine(n, running_on, spread=True)
            else:
                self.copy = CopyEngine(n, cpus)
        self.streaming_min = streaming_threshold(self.params, running_on, self.loop_copies)
        self.start_keep_awake(running_on)
        where = cpus if cpus else f"unpinned, on CPUs {affinity.format_cpu_list(running_on)}"
        _log.info("progress affinity: %s (%s); %d copy threads", where, reason, n)
        self._write_info()

    def start_keep_awake(self, cpus: list[int]) -> None:
        """One idle-priority guard per CPU we run on (shm/_workers.c, KeepAwake), when KEEP_AWAKE_US
        asks for them: on a crowded node by default."""
        us = self.params.KEEP_AWAKE_US
        if us < 0:
            us = AUTO_KEEP_AWAKE_US if self.crowded else 0.0
        if self.awake is not None:
            self.awake.stop()
            self.awake = None
        if us > 0:
            # Guards wake spread workers on their own CPUs: no IPI (shm/_workers.c, "Relayed wake-ups").
            relay = self.copy.pool if self.copy.spread else None
            self.awake = _workers.KeepAwake(cpus, us / 1e6, relay, self.seg.addr + self.layout.rank_area_off,
                                            self.nlocal)
            _log.info("keep-awake: %d idle-priority guard(s) on cpus %s, %g us after the last work%s",
                      len(cpus), affinity.format_cpu_list(cpus), us,
                      ", waking the copy workers there" if relay is not None else "")

    # ------------------------------------------------------------------ dump
    def dump_state(self) -> dict:
        """Everything a person debugging a hang needs, from inside the process."""
        from shmproxy.tools import dump
        state = dump.read_pool(self.view)
        state["in_process"] = {
            "passes": self.passes,
            "stopping": self.stopping,
            "failed": self.failed,
            "active_args": [
                {"id": a.id, "conn": list(a.conn), "opcount": a.opcount,
                 "state": P.SUB_STATE_LETTER.get(a.state, "?"), "transport": a.transport.name,
                 "subs": [{"slot": s.slot, "nbytes": s.nbytes, "nsteps": s.nsteps, "posted": s.posted,
                           "transmitted": s.transmitted, "received": s.received, "done": s.done}
                          for s in a.subs]}
                for a in self.active],
            "unmatched_sends": [op.describe() for q in self.sends.values() for op in q],
            "unmatched_recvs": [op.describe() for q in self.recvs.values() for op in q],
            "connections": {f"{s}->{d}": c.describe() for (s, d, _kind), c in self.conns.items()},
            "service": [{"rank": c.rank, "pid": c.pid, "state": c.state.name} for c in self.server.connections()],
            "registered_buffers": {f"{lr}:{bid}": b.size for (lr, bid), b in self.buffers.items()},
            "copy_threads": self.copy.nworkers,
            "profile_events": len(self.profiler.events),
        }
        return state

    def dump_path(self) -> str:
        return self.path.removesuffix(".sock") + f"-{os.getpid()}.dump.json"

    def write_dump(self) -> None:
        path = self.dump_path()
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.dump_state(), f, indent=1, default=str)
        os.replace(tmp, path)
        _log.warning("state dumped to %s", path)
        print(f"shmproxy: progress process {os.getpid()} dumped its state to {path}", file=sys.stderr,
              flush=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmproxy.engine.progress", description=__doc__.split("\n")[0])
    ap.add_argument("--path", required=True)
    ap.add_argument("--nlocal", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--job-key", required=True)
    ap.add_argument("--comm-id", type=int, default=0)
    ap.add_argument("--parent", type=int, default=0)
    ap.add_argument("--cwd", default="", help="the starting rank's working directory (we start in "
                    "the package root, so that `-m` imports the rank's own code; proxy/rank/comm.py)")
    ns = ap.parse_args(argv)
    cwd_error = None
    if ns.cwd:      # before logging opens DEBUG_FILE, which may be relative
        try:
            os.chdir(ns.cwd)
        except OSError as exc:   # removed since: stay where we are, relative paths resolve there
            cwd_error = exc
    params = params_mod.get()
    log.set_rank("proxy")
    log.configure(params)
    if cwd_error is not None:
        _log.warning("cannot return to the rank's directory %s (%s)", ns.cwd, cwd_error)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    engine = ProgressEngine(params, ns.path, ns.nlocal, ns.size, ns.job_key, ns.comm_id, ns.parent)

    def on_term(signum: int, frame: Any) -> None:  # only sets flags; the loop acts
        engine.q[P.CTRL_OFF // 8 + P.CTRL_ABORT] = 1

    def on_dump(signum: int, frame: Any) -> None:
        engine.dump_requested = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    if params.DUMP_SIGNAL:
        signal.signal(params.DUMP_SIGNAL, on_dump)
    rc = 0
    try:
        engine.start()
        engine.run()
    except BaseException as exc:  # the loop never raises into a void: record, abort, exit non-zero
        rc = 1
        engine.fail(getattr(exc, "code", errors.InternalError.code),
                    f"progress loop crashed: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    finally:
        engine.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
