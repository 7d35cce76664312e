"""The rank-side API: ``shmproxy.init()`` and ``shmproxy.Comm``.

A Comm is attached to the progress process of its node (started by local rank 0) through two
channels: the service socket for control (init, buffer registration, close) and the ops pool for the
data path. Posting an operation never talks to the socket:

    validate (raise before anything is posted) -> find or stage the buffer -> take a record from the
    private free list -> pack it -> splice it onto the posted chain under the pool mutex, in one call
    into shm._native, signalling the progress process only if the chain was empty.

Inside ``with comm.group():`` records are linked privately and spliced once at the end (one lock for
the whole group, and one opCount, so the progress process batches them into one args).

Waiting spins for SHMPROXY_WAIT_SPIN_US (only for requests up to SHMPROXY_WAIT_SPIN_MAX_BYTES:
larger ones are copied by the progress process's workers, which a spinning rank would slow down on
a machine with few cores), then sleeps on the rank's futex word in slices of
SHMPROXY_WAIT_SLICE_MS; between slices it checks the communicator's error, the abort flag and that
the progress process is alive. So every wait is bounded and sees failures: never a silent hang.
The spin and the reaping of a request that completed cleanly in registered memory are in C
(Request.Wait/Test in shm/_poster.c); the sleep and everything else is _wait/_test here.

A Comm is meant to be used by one thread at a time (like MPI_THREAD_SERIALIZED).
"""
from __future__ import annotations

import atexit
import hashlib
import os
import select
import signal
import subprocess
import sys
import time
import traceback
import weakref
from typing import Any

import numpy as np

from shmproxy.engine import affinity
from shmproxy.control import bootstrap
from shmproxy.core import errors, log, params as params_mod
from shmproxy.rank.buffers import Registry, StagingCache
from shmproxy.rank import objects
from shmproxy.coll import sched
from shmproxy.core.ops import (CODE_DTYPE, DTYPE_CODE, FLAG_IN_PLACE, FLAG_NO_RECV, IN_PLACE, KIND_COLL, KIND_RECV, KIND_SEND,
                       SUPPORTED_DTYPES, TAG_MAX, TAG_MIN, UNDEFINED)
from shmproxy.control.protocol import MsgType
from shmproxy.rank.request import Request
from shmproxy.control.client import ServiceClient
from shmproxy.shm import _native, _poster, pool as P, sync
from shmproxy.shm.counters import u32_view
from shmproxy.shm.segment import Segment
from shmproxy import transports

_log = log.get("INIT")
OWNER_DEAD_REPORT_S = 5.0  # how long a rank that repaired the pool mutex waits to learn who died
_buffer_info = _native.buffer_info
_DTYPE_CODE = DTYPE_CODE
# What shm._poster needs to read arrays itself: dtype char -> (code, itemsize), and probe arrays
# whose facts it checks its reading against (shm/_poster.c, verify_layout).
_DTYPES = {ch: (code, np.dtype(ch).itemsize) for ch, code in DTYPE_CODE.items()}

_ABORT_TEXT_MAX = 240   # characters of an exception's message that a with block's Abort passes on
# Where this process imported shmproxy from. The progress process starts there: `python -m` puts its
# working directory first on sys.path, so started from the rank's directory it would import any
# other `shmproxy` package found there (another checkout, a decoy) instead of the code this rank runs.
# (The folder that holds the `shmproxy` package, or for an editable install the repository, where
# no folder of that name shadows the installed finder.)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["shmproxy"].__file__)))


def _probes() -> list[tuple]:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = np.zeros(5, np.complex128)
    b.flags.writeable = False
    return [(x, x.ctypes.data, x.nbytes, x.dtype.char, x.flags.writeable, x.flags.c_contiguous)
            for x in (a, a[:, :2], b, np.zeros((0, 4), np.float16))]


assert (_poster.KIND_SEND, _poster.KIND_RECV, _poster.RECORD_BYTES) == (KIND_SEND, KIND_RECV, P.RECORD_BYTES)
assert (_poster.KIND_COLL, _poster.FLAG_IN_PLACE, _poster.FLAG_NO_RECV, _poster.COLL_ALLREDUCE, _poster.COLL_BARRIER,
        _poster.COLL_ALLTOALL) == (KIND_COLL, FLAG_IN_PLACE, FLAG_NO_RECV, sched.Coll.ALLREDUCE, sched.Coll.BARRIER,
                                   max(sched.Coll))
assert _poster.CODE_BOOL == DTYPE_CODE["?"] and _poster.CODE_FIRST_FLOAT == DTYPE_CODE["e"] == max(
    c for c, t in CODE_DTYPE.items() if t.kind not in "fc") + 1


def init(timeout: float | None = None, **overrides: Any) -> "Comm":
    """Join the job: read the launcher's environment, start or find the node's progress process.

    ``overrides`` may set rank, size, local_rank, local_size (they win over the launcher) and any
    parameter by name (e.g. ``chunk_size='1M'``). ``timeout`` bounds every step (SHMPROXY_TIMEOUT).
    Raises InvalidArgument for bad parameters, Timeout when the rendezvous does not complete,
    PeerDiedError when the progress process dies while starting.
    """
    launch = {k: overrides.pop(k) for k in ("rank", "size", "local_rank", "local_size") if k in overrides}
    if timeout is not None:
        overrides["TIMEOUT"] = timeout
    params = params_mod.Params(overrides=overrides) if overrides else params_mod.get()
    log.configure(params)
    transports.allowed(params.TRANSPORTS)   # an unknown name fails here, before a process is started
    info = bootstrap.detect(**launch)
    log.set_rank(info.rank)
    if bootstrap.requires_store(info):
        raise errors.InvalidUsage(bootstrap.store_required_message(info))
    return Comm._create(info, params, comm_id=0)


def _cwd_args() -> list[str]:
    """The progress process goes back to this directory once it has imported our code, so that
    relative paths (DEBUG_FILE, PROFILE_FILE, ...) mean there what they mean here."""
    try:
        return ["--cwd", os.getcwd()]
    except FileNotFoundError:   # our directory was removed: a relative path means nothing anyway
        return []


class Comm:
    """A communicator. Attributes: rank, size, local_rank, local_size."""

    # ------------------------------------------------------------------ creation
    @classmethod
    def _create(cls, info: bootstrap.LaunchInfo, params: params_mod.Params, comm_id: int,
                key: str | None = None) -> "Comm":
        self = cls.__new__(cls)
        self._closed = False
        self._failure: errors.ProxyError | None = None
        self.rank, self.size = info.rank, info.size
        self.local_rank, self.local_size = info.local_rank, info.local_size
        self.params = params
        self._timeout = params.TIMEOUT
        self._proc: subprocess.Popen | None = None
        self._client: ServiceClient | None = None
        self._seg: Segment | None = None
        self._view: P.PoolView | None = None
        self._pidfd = -1
        key = key or bootstrap.job_key(info, params)
        self._job_key, self._comm_id, self._nchildren = key, comm_id, 0
        self._path = bootstrap.service_path(bootstrap.run_dir(params), key, comm_id)
        try:
            self._start(info, params, key, comm_id)
        except BaseException:
            self._teardown(wait_proxy=False)
            raise
        atexit.register(_close_at_exit, weakref.ref(self))
        return self

    def _start(self, info: bootstrap.LaunchInfo, params: params_mod.Params, key: str, comm_id: int) -> None:
        deadline = self._deadline(None)
        if info.local_rank == 0:
            if os.path.exists(self._path):
                # The job key is unique per job; a leftover socket is from a crashed run of it.
                _log.warning("removing stale service socket %s", self._path)
                os.unlink(self._path)
            env = dict(os.environ)
            env.update(params.to_env())
            cmd = [sys.executable, "-m", "shmproxy.engine.progress", "--path", self._path,
                   "--nlocal", str(info.local_size), "--size", str(info.size), "--job-key", key,
                   "--comm-id", str(comm_id), "--parent", str(os.getpid()), *_cwd_args()]
            self._proc = subprocess.Popen(cmd, env=env, cwd=_PACKAGE_ROOT, stdin=subprocess.DEVNULL,
                                          close_fds=True)
            _log.info("started progress process pid %d", self._proc.pid)
        proc = self._proc
        self._client = ServiceClient.connect(
            self._path, max(deadline - self._now(), 0.001),
            should_abort=(lambda: proc.poll() is not None) if proc is not None else None)
        c = self._client
        resp, _ = c.call(MsgType.INIT, {
            "token": key, "rank": info.rank, "local_rank": info.local_rank, "size": info.size,
            "local_size": info.local_size, "host": bootstrap.host_identity(),
            "affinity": sorted(os.sched_getaffinity(0))}, timeout=self._left(deadline))
        self._proxy_pid = int(resp["proxy_pid"])
        try:
            self._pidfd = os.pidfd_open(self._proxy_pid)
        except ProcessLookupError as exc:
            raise errors.PeerDiedError("the progress process exited during init", rank=-1,
                                       pid=self._proxy_pid) from exc
        resp, _ = c.call(MsgType.SHARED_INIT, {}, timeout=self._left(deadline))
        self._pool_name = resp["pool"]
        self._seg = Segment.attach(resp["pool"], int(resp["bytes"]))
        c.call(MsgType.SETUP, {}, timeout=self._left(deadline))
        c.call(MsgType.CONNECT, {"peers": list(range(self.size))}, timeout=self._left(deadline))
        self._attach_pool()

    def _attach_pool(self) -> None:
        seg = self._seg
        assert seg is not None
        view = P.PoolView(seg.mm, seg.addr)
        layout = view.layout
        if layout.nlocal != self.local_size:
            raise errors.InternalError(f"pool built for {layout.nlocal} local ranks, we have {self.local_size}")
        self._view, self._layout, self._q, self._i32 = view, layout, view.q, view.i32
        self._u32 = u32_view(seg.mm)
        lr, max_ops = self.local_rank, layout.max_ops
        self._rec_base = lr * max_ops
        self._free_records: list[int] = []
        self._free_slots = list(range(self._rec_base + max_ops - 1, self._rec_base - 1, -1))
        self._pending: dict[int, Request] = {}
        self._abort_q = P.CTRL_OFF // 8 + P.CTRL_ABORT
        self._err_q = P.CTRL_OFF // 8 + P.CTRL_ERR_SEQ
        self._waiting_q = layout.rank_q(lr, P.RANK_WAITING)
        self._posted_q = layout.rank_q(lr, P.RANK_POSTED)
        self._wake_addr = seg.addr + layout.wake_word_offset(lr)
        self._wake_u32 = layout.wake_word_offset(lr) // 4
        # The post path (shm/_poster.c): sequence numbers, opCount, groups, and the fast post.
        self._pp = _poster.Poster(
            self, Request, np.ndarray, seg.addr + layout.records_off, seg.addr + P.MUTEX_OFF,
            seg.addr + P.COND_OFF, seg.addr + P.NEXT_OPS_OFF, seg.addr + P.NEXT_OPS_END_OFF,
            seg.addr + P.PENDING_MASK_OFF, seg.addr + layout.rank_area_off,
            seg.addr + P.CTRL_OFF + 8 * P.CTRL_SLEEPING, seg.addr + 8 * self._err_q,
            seg.addr + 8 * self._abort_q, seg.addr + 8 * self._posted_q, lr,
            self.size, self._timeout, self._free_slots, self._free_records, self._pending, _DTYPES,
            _probes(), self._splice_failed)
        sync.set_lock_spin(self.params.LOCK_SPIN_US)   # contended pool locks retry briefly first
        if not self._pp.fast:
            _log.warning("numpy's array layout is not the one shm/_poster.c reads: every post takes "
                         "the slower Python path")
        # Isend/Irecv of this instance are the poster's C entry points (a post then costs no Python
        # frame: ~250 ns of ~700 on the VM); what they decline goes to the methods below.
        cls = type(self)
        self._pp.send_fallback, self._pp.recv_fallback = cls.Isend.__get__(self), cls.Irecv.__get__(self)
        self.Isend, self.Irecv = self._pp.isend, self._pp.irecv
        # ... and so is Iallreduce, for buffers in registered memory.
        self._pp.allreduce_fallback, self._pp.in_place = cls.Iallreduce.__get__(self), IN_PLACE
        self.Iallreduce = self._pp.iallreduce
        # ... and Ibarrier (5.7 -> ~1 us on the VM; Barrier() goes through it).
        self._pp.barrier_fallback = cls.Ibarrier.__get__(self)
        self.Ibarrier = self._pp.ibarrier
        # ... and the other buffer collectives (Ibcast's Python post: 10-12 us on the VM). The blocking
        # forms go through these instance attributes too.
        self._pp.rank = self.rank
        C = sched.Coll
        for coll, name in ((C.BCAST, "Ibcast"), (C.REDUCE, "Ireduce"), (C.ALLGATHER, "Iallgather"),
                           (C.REDUCE_SCATTER_BLOCK, "Ireduce_scatter_block"), (C.ALLTOALL, "Ialltoall")):
            self._pp.set_coll_fallback(coll, getattr(cls, name).__get__(self))
            setattr(self, name, getattr(self._pp, name.lower()))
        # How Request.Wait spins before it sleeps (the spin is in C): up to WAIT_SPIN_US, and on a
        # crowded node only for requests the progress loop completes itself, since larger ones are
        # copied by workers that need the cores (measured: docs/decisions.md).
        p = self.params
        crowded = affinity.crowded(self.local_size)
        spin_max = p.WAIT_SPIN_MAX_BYTES or (p.eager_limit if crowded else 1 << 62)
        spin_max_coll = p.WAIT_SPIN_MAX_BYTES or (p.COLL_INLINE_BYTES if crowded else 1 << 62)
        self._pp.set_wait(seg.addr + layout.slots_off, layout.nrecords, p.WAIT_SPIN_US * 1e-6, spin_max,
                          spin_max_coll)
        self._slice_s = p.WAIT_SLICE_MS * 1e-3
        self._registry = Registry(self._register, self._pp.set_ranges)
        self._staging = StagingCache(self._registry, self.params.STAGING_CACHE)

    # ------------------------------------------------------------------ small helpers
    @staticmethod
    def _now() -> float:
        return time.monotonic()

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self._timeout if timeout is None else timeout)

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise errors.Timeout(f"rank {self.rank}: init did not complete within {self._timeout} s")
        return left

    def _register(self, buf_id: int, fd: int, nbytes: int) -> None:
        self._control(MsgType.REGISTER, {"buf_id": buf_id, "bytes": nbytes}, fds=(fd,))

    def _control(self, msg: MsgType, payload: dict, fds: tuple = ()) -> dict:
        """A blocking service call. If the service is gone because the communicator failed, the
        error raised is the communicator's (it names who died), not the broken socket."""
        assert self._client is not None
        try:
            if self._registry.dead_ids and msg != MsgType.DEREGISTER:
                ids, self._registry.dead_ids = self._registry.dead_ids, []
                self._client.call(MsgType.DEREGISTER, {"buf_ids": ids}, timeout=self._timeout)
            resp, _ = self._client.call(msg, payload, fds=fds, timeout=self._timeout)
        except errors.RemoteError as exc:
            if self._view is not None and (self._q[self._err_q] or self._q[self._abort_q]):
                raise self._record_failure() from exc
            raise
        return resp

    def _check_usable(self) -> None:
        if self._closed:
            raise errors.Closed(f"rank {self.rank}: the communicator is closed")
        if self._failure is not None:
            raise self._failure
        if self._q[self._err_q] or self._q[self._abort_q]:
            raise self._record_failure()

    def _record_failure(self) -> errors.ProxyError:
        """Turn the pool's asyncResult (or a dead progress process) into the error every call raises."""
        if self._failure is not None:
            return self._failure
        view = self._view
        assert view is not None
        if view.ctrl(P.CTRL_ERR_SEQ):
            rank = view.ctrl(P.CTRL_ERR_RANK)
            exc = errors.from_code(view.ctrl(P.CTRL_ERR_CODE), view.error_message(),
                                   rank=None if rank == P.NO_RANK else rank, pid=view.ctrl(P.CTRL_ERR_PID))
        elif view.ctrl(P.CTRL_ABORT):
            exc = errors.Aborted(f"rank {self.rank}: the communicator was aborted")
        else:
            exc = errors.PeerDiedError(f"the progress process (pid {self._proxy_pid}) died", rank=-1,
                                       pid=self._proxy_pid)
        self._set_failure(exc)
        return exc

    def _proxy_dead(self, wait_s: float = 0.0) -> bool:
        return bool(select.select([self._pidfd], [], [], wait_s)[0])

    def _proxy_doomed(self) -> bool:
        """At teardown: the progress process exited, or is exiting from a SIGKILL. Its exit completes
        only once every thread has run, and its idle-priority keep-awake guards may wait a scheduler
        tick for a CPU; a survivor that judged by the pidfd alone could leave the socket file behind.
        A failed communicator also gives the pidfd a short bounded wait."""
        if self._proxy_dead(0.2 if self._failure is not None else 0.0):
            return True
        try:
            with open(f"/proc/{self._proxy_pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            return False
        sigkill = 1 << (signal.SIGKILL - 1)
        return fields.get("State", "").strip()[:1] in ("Z", "X") or bool(
            int(fields.get("ShdPnd", "0"), 16) & sigkill or int(fields.get("SigPnd", "0"), 16) & sigkill)

    # ------------------------------------------------------------------ buffers
    def alloc(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """A zeroed numpy array in registered shared memory: the zero-copy path for Send/Recv."""
        self._check_usable()
        dt = np.dtype(dtype)
        if dt.char not in DTYPE_CODE:
            raise errors.InvalidArgument(f"unsupported dtype {dt}; supported: {SUPPORTED_DTYPES}")
        shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if any(int(s) < 0 for s in shp):
            raise errors.InvalidArgument(f"negative dimension in shape {shp}")
        return self._registry.alloc(tuple(int(s) for s in shp), dt)

    # ------------------------------------------------------------------ posting
    def _check_peer(self, peer: Any, what: str) -> int:
        if type(peer) is not int:
            if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool):
                raise errors.InvalidArgument(f"{what} must be an int, got {type(peer).__name__}")
            peer = int(peer)
        if not 0 <= peer < self.size:
            raise errors.InvalidArgument(f"{what} {peer} out of range: the communicator has {self.size} ranks")
        return peer

    def _check_tag(self, tag: Any) -> int:
        if type(tag) is not int:
            if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool):
                raise errors.InvalidArgument(f"tag must be an int, got {type(tag).__name__}")
            tag = int(tag)
        if not TAG_MIN <= tag <= TAG_MAX:
            raise errors.InvalidArgument(f"tag {tag} does not fit in 64 bits")
        return tag

    def _post(self, kind: int, buf: Any, peer: int, tag: int) -> Request:
        """The full post path: every check with its message, and staging. Isend/Irecv come here only
        when shm._poster's fast path declined (the uncommon cases: see shm/_poster.c)."""
        self._check_usable()
        if type(buf) is not np.ndarray:
            raise errors.InvalidArgument(f"buffer must be a numpy array, got {type(buf).__name__}")
        code = _DTYPE_CODE.get(buf.dtype.char)
        if code is None:
            raise errors.InvalidArgument(f"unsupported dtype {buf.dtype}; supported: {SUPPORTED_DTYPES}")
        if type(peer) is not int or not 0 <= peer < self.size:
            peer = self._check_peer(peer, "destination" if kind == KIND_SEND else "source")
        if type(tag) is not int or not TAG_MIN <= tag <= TAG_MAX:
            tag = self._check_tag(tag)
        nbytes = buf.nbytes
        stage = None
        user_addr = 0
        if kind == KIND_RECV:
            try:
                addr = _buffer_info(buf, True)[0]
            except (BufferError, ValueError):
                why = "read-only" if not buf.flags.writeable else "not C-contiguous"
                raise errors.InvalidArgument(f"receive buffer is {why}") from None
            found = self._registry.find(addr, nbytes)
            if found is None:
                stage = self._staging.get(nbytes)
                found = (stage[0], 0)
                user_addr = addr
        else:
            try:
                addr = _buffer_info(buf, False)[0]
                found = self._registry.find(addr, nbytes)
            except (BufferError, ValueError):
                addr, found = 0, None
            if found is None:
                found, stage = self._stage_send(buf, addr, nbytes)
        return self._emit(kind, code, 0, 0, peer, tag, found[0], found[1], nbytes, buf.size, -1, 0, 0, 0,
                          buf, stage, user_addr)

    def _stage_send(self, buf: np.ndarray, addr: int, nbytes: int) -> tuple[tuple[int, int], Any]:
        """Copy a send buffer that is not in registered memory into a staging buffer."""
        stage = self._staging.get(nbytes)
        if addr:
            _native.memcopy(stage[1].addr, addr, nbytes)
        else:  # not contiguous: numpy gathers it
            view = np.frombuffer(stage[1].mm, dtype=buf.dtype, count=buf.size).reshape(buf.shape)
            np.copyto(view, buf)
            del view
        return (stage[0], 0), stage

    def _splice_failed(self, rc: int) -> None:
        """Called by the poster when a splice did not return OK (the op is posted or lost; either way
        the communicator cannot go on)."""
        if rc == _native.OWNERDEAD:
            # We repaired the mutex, but cannot tell who died holding it; the progress process
            # learns that from the dead process's pidfd within milliseconds and records it. Wait
            # (bounded) for that report, so that this rank raises the same named error as the others.
            deadline = time.monotonic() + OWNER_DEAD_REPORT_S
            try:
                while True:
                    self._sleep_slice(deadline, "the report of who died holding the pool mutex")
            except errors.Timeout:
                self._q[self._abort_q] = 1
                self._set_failure(errors.PeerDiedError(
                    f"rank {self.rank}: a process died holding the ops pool mutex"))
                raise self._failure from None
        if rc == _native.TIMEDOUT:
            raise errors.Timeout(f"rank {self.rank}: the ops pool mutex was not released within "
                                 f"{self._timeout} s (a wedged process holds it)")
        raise errors.InternalError(f"rank {self.rank}: splice returned {rc}")

    def _set_failure(self, exc: errors.ProxyError) -> None:
        self._failure = exc
        pp = self.__dict__.get("_pp")
        if pp is not None:
            pp.usable = 0   # the fast path declines, so the full path raises this

    def _take_record(self) -> int:
        free = self._free_records
        if free:
            return free.pop()
        deadline = self._deadline(None)
        while True:
            self._refill_records()
            if free:
                return free.pop()
            if self._pp.group_depth and self._pp.chain_first >= 0:
                self._pp.flush()   # our own unposted group holds the records: post what we have
                continue
            self._sleep_slice(deadline, f"a free op record (all {self._layout.max_ops} are in flight)")

    def _refill_records(self) -> None:
        view, i32 = self._view, self._i32
        assert view is not None
        free_i = P.FREE_OPS_OFF // 4 + self.local_rank
        if i32[free_i] == -1:
            return
        view.mutex.lock(self._timeout)
        try:
            head = i32[free_i]
            i32[free_i] = -1
        finally:
            view.mutex.unlock()
        lo, hi = self._rec_base, self._rec_base + self._layout.max_ops
        idx, n = head, 0
        while idx != -1:
            if not lo <= idx < hi or n >= hi - lo:
                raise errors.InternalError(f"rank {self.rank}: free list corrupt at record {idx}")
            self._free_records.append(idx)
            idx = i32[self._layout.record_off(idx) // 4]
            n += 1

    def _take_slot(self) -> int:
        slots = self._free_slots
        if slots:
            return slots.pop()
        deadline = self._deadline(None)
        while True:
            self._reap()
            if slots:
                return slots.pop()
            if self._pp.group_depth and self._pp.chain_first >= 0:
                self._pp.flush()   # requests of our own unposted group can only finish once posted
                continue
            self._sleep_slice(deadline, f"a free request slot ({self._layout.max_ops} requests pending)")

    def _reap(self) -> None:
        """Collect every completed request (their slots and staging buffers come back)."""
        q, layout = self._q, self._layout
        for slot, req in list(self._pending.items()):
            if q[layout.slot_q(slot)] == req._seq:
                self._collect(req)

    def _collect(self, req: Request) -> None:
        q = self._q
        base = self._layout.slot_q(req._slot)
        nbytes, status, tag = q[base + P.SLOT_NBYTES], q[base + P.SLOT_STATUS], q[base + P.SLOT_TAG]
        del self._pending[req._slot]
        self._free_slots.append(req._slot)
        req._finish(nbytes, status, tag)

    # ------------------------------------------------------------------ waiting
    def _test(self, req: Request) -> None:
        if self._q[self._layout.slot_q(req._slot)] == req._seq:
            self._collect(req)
        elif self._failure is None and (self._q[self._err_q] or self._q[self._abort_q]):
            raise self._record_failure()

    def _wait(self, req: Request, timeout: float | None) -> None:
        """The sleeping half of Request.Wait (the C half already spun on the slot)."""
        if self._pp.group_depth:
            raise errors.InvalidUsage("Wait() inside comm.group(): the group's ops are posted at its end")
        q, sq, seq = self._q, self._layout.slot_q(req._slot), req._seq
        if q[sq] != seq:
            deadline = self._deadline(timeout)
            while q[sq] != seq:
                self._sleep_slice(deadline, req.describe(), sq, seq)
        self._collect(req)

    def _sleep_slice(self, deadline: float, what: str, sq: int = -1, seq: int = 0) -> None:
        """One bounded sleep on our futex word; raises on failure, abort, dead proxy or timeout."""
        q = self._q
        if q[self._err_q] or q[self._abort_q] or self._failure is not None:
            raise self._record_failure()
        if self._proxy_dead():
            raise self._record_failure()
        left = deadline - time.monotonic()
        if left <= 0:
            raise errors.Timeout(f"rank {self.rank}: timed out waiting for {what}")
        # WAITING says where we sleep and on which word: the progress process, or the keep-awake guard
        # of this CPU (shm/_workers.c, "Relayed wake-ups"), wakes us once the word moved.
        word = self._u32[self._wake_u32]
        q[self._waiting_q] = P.waiting_value(_native.getcpu(), word)
        if sq < 0 or q[sq] != seq:
            _native.futex_wait(self._wake_addr, word, min(self._slice_s, left))
        q[self._waiting_q] = 0

    # ------------------------------------------------------------------ point-to-point API
    def Isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        """Post a send of ``buf`` to ``dest``; returns a Request. ``buf`` must stay unchanged until
        the request completes (arrays outside comm.alloc memory are copied at post time).

        Each communicator binds its own ``Isend``/``Irecv`` to the C post path (shm/_poster.c); these
        methods are what that path falls back to, so they go straight to the full Python path."""
        return self._post(KIND_SEND, buf, dest, tag)

    def Irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        """Post a receive into ``buf`` (writable, C-contiguous) from ``source``; returns a Request.
        (The C path bound per communicator falls back to this method, as for Isend.)"""
        return self._post(KIND_RECV, buf, source, tag)

    def Send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        """Blocking send: returns when the message has been delivered."""
        self.Isend(buf, dest, tag).Wait()

    def Recv(self, buf: np.ndarray, source: int, tag: int = 0) -> Any:
        """Blocking receive; returns the Status (source, tag, nbytes)."""
        return self.Irecv(buf, source, tag).Wait()

    def group(self) -> Any:
        """``with comm.group():`` everything posted inside is spliced onto the pool under one lock, as
        one opCount, when the outermost group ends (also if the block raises). Groups nest. The
        context manager is the poster's (shm/_poster.c)."""
        return self._pp

    # ------------------------------------------------------------------ collectives
    def _locate(self, arr: np.ndarray, writable: bool, copy_in: bool, what: str) -> tuple:
        """(buf_id, offset, stage, user_addr) of an array: registered, or staged (copied in when
        ``copy_in``; a writable staged array is copied out by its request at completion)."""
        nbytes = arr.nbytes
        try:
            addr = _buffer_info(arr, writable)[0]
        except (BufferError, ValueError):
            if writable:
                why = "read-only" if not arr.flags.writeable else "not C-contiguous"
                raise errors.InvalidArgument(f"{what} is {why}") from None
            addr = 0
        found = self._registry.find(addr, nbytes) if addr else None
        if found is not None:
            return found[0], found[1], None, addr
        if not writable:
            loc, stage = self._stage_send(arr, addr, nbytes)
            return loc[0], 0, stage, 0
        stage = self._staging.get(nbytes)
        if copy_in and nbytes:
            _native.memcopy(stage[1].addr, addr, nbytes)
        return stage[0], 0, stage, addr

    def _check_buf(self, buf: Any, what: str) -> int:
        if type(buf) is not np.ndarray:
            raise errors.InvalidArgument(f"{what} must be a numpy array, got {type(buf).__name__}")
        code = _DTYPE_CODE.get(buf.dtype.char)
        if code is None:
            raise errors.InvalidArgument(f"{what}: unsupported dtype {buf.dtype}; supported: {SUPPORTED_DTYPES}")
        return code

    def _block_count(self, name: str, full: np.ndarray, part: np.ndarray | None, full_name: str,
                     part_name: str) -> int:
        """Elements per block of a buffer holding one block per rank (``full``), checked against the
        one-block buffer ``part`` (None with IN_PLACE)."""
        size = self.size
        if part is None:
            if full.size % size:
                raise errors.InvalidArgument(f"{name}: {full_name} of {full.size} elements is not "
                                             f"{size} equal blocks")
            return full.size // size
        if full.size != part.size * size:
            raise errors.InvalidArgument(f"{name}: {full_name} needs {size} x {part.size} elements "
                                         f"(the {part_name} of every rank), has {full.size}")
        return part.size

    def _check_root(self, root: Any) -> int:
        return self._check_peer(root, "root")

    def _coll(self, coll: int, sendbuf: Any, recvbuf: Any, op: Any = 0, root: int = 0) -> Request:
        """Validate one collective call (before anything is posted), locate its buffers, post it."""
        self._check_usable()
        C = sched.Coll
        size, me = self.size, self.rank
        in_place = sendbuf is IN_PLACE
        redop = 0
        if coll in (C.BCAST, C.REDUCE):
            root = self._check_root(root)
        name = sched.COLL_NAMES[coll]
        send_loc = recv_loc = (0, 0, None, 0)
        flags = FLAG_IN_PLACE if in_place else 0
        keep: tuple = (sendbuf, recvbuf)
        if coll == C.BARRIER:
            code, count, snb, rnb = 1, 0, 0, 0
        elif coll == C.BCAST:
            code = self._check_buf(sendbuf, f"{name} buffer")
            count, snb, rnb = sendbuf.size, sendbuf.nbytes, sendbuf.nbytes
            # Writable and contiguous on every rank, the root included: a check that passed on some
            # ranks and failed on others would put their sequences of collectives out of step.
            recv_loc = self._locate(sendbuf, True, copy_in=(me == root), what=f"{name} buffer")
            if me == root:
                recv_loc = recv_loc[:3] + (0,)  # the root's buffer is only read: no copy-out
            flags = FLAG_IN_PLACE
        else:
            rcode = None
            if coll != C.REDUCE or me == root:  # a non-root's Reduce recvbuf is not significant
                rcode = self._check_buf(recvbuf, f"{name} recvbuf")
            elif recvbuf is not None:
                # ... but it is checked like the root's, so that the same call passes or fails on
                # every rank alike (see Bcast above).
                self._check_buf(recvbuf, f"{name} recvbuf")
                try:
                    _buffer_info(recvbuf, True)
                except (BufferError, ValueError):
                    why = "read-only" if not recvbuf.flags.writeable else "not C-contiguous"
                    raise errors.InvalidArgument(f"{name} recvbuf is {why}") from None
            if in_place:
                if coll in (C.ALLTOALL,) or (coll == C.REDUCE and me != root):
                    raise errors.InvalidArgument(f"{name}: IN_PLACE is not allowed here"
                                                 + (" (only on the root)" if coll == C.REDUCE else ""))
                code = rcode
            else:
                code = self._check_buf(sendbuf, f"{name} sendbuf")
                if rcode is not None and rcode != code:
                    raise errors.InvalidArgument(f"{name}: sendbuf is {sendbuf.dtype}, recvbuf {recvbuf.dtype}")
            if in_place and rcode is None:
                raise errors.InvalidArgument(f"{name}: IN_PLACE needs a recvbuf")
            dtype = (recvbuf if in_place else sendbuf).dtype
            if coll in (C.REDUCE, C.ALLREDUCE, C.REDUCE_SCATTER_BLOCK):
                redop = int(op) if isinstance(op, (int, np.integer)) and not isinstance(op, bool) else -1
                sched.check_op(redop, dtype)
            # element counts: count = one rank's contribution
            if coll in (C.ALLREDUCE, C.REDUCE):
                count = recvbuf.size if in_place else sendbuf.size
                if rcode is not None and recvbuf.size != count:
                    raise errors.InvalidArgument(f"{name}: sendbuf has {count} elements, recvbuf {recvbuf.size}")
            elif coll == C.ALLGATHER:
                count = self._block_count(name, recvbuf, None if in_place else sendbuf, "recvbuf", "sendbuf")
            elif coll == C.REDUCE_SCATTER_BLOCK:
                count = (self._block_count(name, recvbuf, None, "recvbuf", "") if in_place
                         else self._block_count(name, sendbuf, recvbuf, "sendbuf", "recvbuf"))
            else:  # ALLTOALL
                if sendbuf.size != recvbuf.size or sendbuf.size % size:
                    raise errors.InvalidArgument(f"{name}: sendbuf and recvbuf need the same number of "
                                                 f"elements, a multiple of {size}")
                count = sendbuf.size // size
            snb = 0 if in_place else sendbuf.nbytes
            rnb = 0 if rcode is None else recvbuf.nbytes
            if not in_place:
                send_loc = self._locate(sendbuf, False, False, f"{name} sendbuf")
            if rcode is not None:
                recv_loc = self._locate(recvbuf, True, copy_in=in_place, what=f"{name} recvbuf")
            else:
                flags |= FLAG_NO_RECV
        pp = self._pp
        pp.coll_seq += 1
        req = self._emit(KIND_COLL, code, redop, flags, root, coll, send_loc[0], send_loc[1], snb, count,
                         recv_loc[0], recv_loc[1], rnb, pp.coll_seq, keep, recv_loc[2], recv_loc[3])
        if send_loc[2] is not None or recv_loc[2] is not None:
            req._extra = (send_loc[2], rnb)
        return req

    def _emit(self, kind: int, code: int, redop: int, flags: int, peer: int, tag: int, bid: int, off: int,
              nbytes: int, count: int, bid2: int, off2: int, nbytes2: int, coll_seq: int, keep: Any,
              stage: Any, user_addr: int) -> Request:
        """Fill a record and its request and post it (or link it into the open group)."""
        slot = self._free_slots.pop() if self._free_slots else self._take_slot()
        index = self._free_records.pop() if self._free_records else self._take_record()
        coll = kind == KIND_COLL
        pp = self._pp
        seq = pp.write(index, slot, kind, code, redop, flags, peer, 0 if coll else tag, bid, off, nbytes, count,
                       bid2, off2, nbytes2, coll_seq, tag if coll else 0)
        req = Request(self, slot, seq, kind, peer, tag, max(nbytes, nbytes2), keep, stage, user_addr, pp)
        self._pending[slot] = req
        pp.enqueue(index)
        return req

    def Iallreduce(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = sched.ReduceOp.SUM) -> Request:
        """Nonblocking Allreduce; ``sendbuf`` may be shmproxy.IN_PLACE. (Each communicator binds its own
        Iallreduce to the C post path, which falls back to this method for everything uncommon.)"""
        return self._coll(sched.Coll.ALLREDUCE, sendbuf, recvbuf, op)

    def Allreduce(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = sched.ReduceOp.SUM) -> None:
        """recvbuf = op over every rank's sendbuf (or recvbuf, with IN_PLACE), on every rank."""
        self.Iallreduce(sendbuf, recvbuf, op).Wait()

    def Ireduce(self, sendbuf: Any, recvbuf: np.ndarray | None, op: Any = sched.ReduceOp.SUM, root: int = 0) -> Request:
        return self._coll(sched.Coll.REDUCE, sendbuf, recvbuf, op, root)

    def Reduce(self, sendbuf: Any, recvbuf: np.ndarray | None, op: Any = sched.ReduceOp.SUM, root: int = 0) -> None:
        """The root's recvbuf = op over every rank's sendbuf; recvbuf may be None elsewhere."""
        self.Ireduce(sendbuf, recvbuf, op, root).Wait()

    def Ibcast(self, buf: np.ndarray, root: int = 0) -> Request:
        return self._coll(sched.Coll.BCAST, buf, None, 0, root)

    def Bcast(self, buf: np.ndarray, root: int = 0) -> None:
        """Every rank's buf = the root's buf."""
        self.Ibcast(buf, root).Wait()

    def Iallgather(self, sendbuf: Any, recvbuf: np.ndarray) -> Request:
        return self._coll(sched.Coll.ALLGATHER, sendbuf, recvbuf)

    def Allgather(self, sendbuf: Any, recvbuf: np.ndarray) -> None:
        """Block r of every rank's recvbuf = rank r's sendbuf (IN_PLACE: already in block r)."""
        self.Iallgather(sendbuf, recvbuf).Wait()

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = sched.ReduceOp.SUM) -> Request:
        return self._coll(sched.Coll.REDUCE_SCATTER_BLOCK, sendbuf, recvbuf, op)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: np.ndarray, op: Any = sched.ReduceOp.SUM) -> None:
        """Rank r's recvbuf = op over every rank's block r of sendbuf."""
        self.Ireduce_scatter_block(sendbuf, recvbuf, op).Wait()

    def Ialltoall(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> Request:
        return self._coll(sched.Coll.ALLTOALL, sendbuf, recvbuf)

    def Alltoall(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        """Block r of rank q's recvbuf = block q of rank r's sendbuf."""
        self.Ialltoall(sendbuf, recvbuf).Wait()

    def Ibarrier(self) -> Request:
        return self._coll(sched.Coll.BARRIER, None, None)

    def Barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self.Ibarrier().Wait()

    # ------------------------------------------------------------------ objects (mpi4py lower case)
    # Pickle protocol 5 with out-of-band buffers; the wire format is in proxy/rank/objects.py.
    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send any picklable object (large arrays inside travel without a pickle copy)."""
        objects.send(self, obj, dest, tag)

    def recv(self, source: int, tag: int = 0) -> Any:
        """Receive an object sent with ``send`` (no size needs to be known in advance)."""
        return objects.recv(self, source, tag)

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        return objects.bcast(self, obj, root)

    def gather(self, obj: Any, root: int = 0) -> list | None:
        return objects.gather(self, obj, root)

    def allgather(self, obj: Any) -> list:
        return objects.allgather(self, obj)

    def allreduce(self, obj: Any, op: Any = sched.ReduceOp.SUM) -> Any:
        """Reduce objects in rank order (op: shmproxy.SUM/PROD/MIN/MAX or a callable); same result everywhere."""
        return objects.allreduce(self, obj, op)

    def barrier(self) -> None:
        objects.barrier(self)

    # ------------------------------------------------------------------ sub-communicators
    def Split(self, color: int, key: int = 0) -> "Comm | None":
        """A new communicator of the ranks that pass the same ``color``, ordered by (key, rank);
        ``shmproxy.UNDEFINED`` gives None. Collective over this communicator. The new communicator has
        its own progress process and ops pool, and progresses independently of this one."""
        for name, v in (("color", color), ("key", key)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise errors.InvalidArgument(f"Split: {name} must be an int, got {type(v).__name__}")
        if color < 0 and color != UNDEFINED:
            raise errors.InvalidArgument(f"Split: color must be >= 0 or shmproxy.UNDEFINED, got {color}")
        table = np.zeros((self.size, 2), np.int64)
        self.Allgather(np.array([color, key], np.int64), table)
        self._nchildren += 1
        if color == UNDEFINED:
            return None
        members = sorted((int(table[r, 1]), r) for r in range(self.size) if table[r, 0] == color)
        ranks = [r for _k, r in members]
        me = ranks.index(self.rank)
        digest = hashlib.blake2b(f"{self._comm_id}/{self._nchildren}/{color}".encode(), digest_size=4).digest()
        child_id = int.from_bytes(digest, "little") & 0x7FFFFFFF or 1
        info = bootstrap.LaunchInfo(rank=me, size=len(ranks), local_rank=me, local_size=len(ranks),
                                    launcher="split")
        child = Comm._create(info, self.params, child_id, key=self._job_key)
        child.parent_ranks = ranks
        return child

    def Dup(self) -> "Comm":
        """A new communicator with the same ranks (its own progress process and ops pool)."""
        child = self.Split(0, self.rank)
        assert child is not None
        return child

    # ------------------------------------------------------------------ errors, abort, close
    def get_async_error(self) -> errors.ProxyError | None:
        """The communicator's error if it failed (a peer died, abort, progress crash), else None."""
        if self._failure is not None:
            return self._failure
        if self._view is None or self._closed:
            return None
        if self._q[self._err_q] or self._q[self._abort_q] or self._proxy_dead():
            return self._record_failure()
        return None

    def Abort(self, reason: str = "") -> None:
        """Fail the communicator on every rank now, then release this rank's resources. Idempotent."""
        if self._closed:
            return
        # Ask the progress process first, so that peers see the reason (asyncResult) with the flag;
        # if it cannot be asked, raise the flag ourselves.
        delivered = False
        if self._client is not None and self._failure is None:
            try:
                self._client.call(MsgType.ABORT, {"reason": reason}, timeout=5.0)
                delivered = True
            except errors.ProxyError as exc:
                _log.info("ABORT message not delivered (%s); raising the abort flag directly", exc)
        if self._view is not None and not delivered:
            self._q[self._abort_q] = 1
            for lr in range(self.local_size):
                addr = self._seg.addr + self._layout.wake_word_offset(lr)  # type: ignore[union-attr]
                _native.fetch_add_u32(addr, 1)
                _native.futex_wake(addr, 0x7FFFFFFF)
            self._view.cond.broadcast()
        self._set_failure(self._failure or errors.Aborted(f"rank {self.rank} called Abort()"))
        self._closed = True
        self._teardown(wait_proxy=True)

    def close(self) -> None:
        """Finish: wait for this rank's pending requests, detach, and (local rank 0) wait for the
        progress process to exit once every local rank closed. Idempotent; after a failure it only
        releases local resources."""
        if self._closed:
            return
        first: BaseException | None = None
        if self._failure is None and self._client is not None:
            try:
                for req in list(self._pending.values()):
                    req.Wait()
                self._control(MsgType.CLOSE, {})
            except errors.ProxyError as exc:
                first = exc
        self._closed = True
        self._teardown(wait_proxy=True)
        if first is not None and not isinstance(first, (errors.PeerDiedError, errors.Aborted)):
            raise first

    def _teardown(self, wait_proxy: bool) -> None:
        """Release everything this process holds; safe to call in any state."""
        proxy_dead = self._pidfd >= 0 and self._proxy_doomed()
        pp = self.__dict__.get("_pp")
        if pp is not None:
            pp.detach()   # it holds raw pool addresses: never again after this
        if getattr(self, "_staging", None) is not None:
            self._staging.close()
        for name in ("_q", "_i32", "_u32"):
            mv = self.__dict__.pop(name, None)
            if mv is not None:
                mv.release()
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._seg is not None:
            self._seg.close()
            self._seg = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        proc = self._proc
        if proc is not None:
            self._proc = None
            if wait_proxy:
                try:
                    proc.wait(timeout=self._timeout)
                except subprocess.TimeoutExpired:
                    _log.warning("progress process %d did not exit within %.0f s; killing it",
                                 proc.pid, self._timeout)
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            if proc.returncode is not None and proc.returncode < 0:
                proxy_dead = True  # killed by a signal: it unlinked nothing
        # The socket file and the pool's name are the progress process's to remove. Only if it died
        # before doing so does the job have to: then any survivor may, idempotently (local rank 0,
        # its parent, may be dead too).
        if proxy_dead or proc is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass  # it, or another survivor, got there first
        pool = getattr(self, "_pool_name", None)
        if pool is not None and proxy_dead:
            Segment.unlink_name(pool)

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and not isinstance(exc, errors.ProxyError):
            self.Abort(_abort_reason(exc_type, exc, tb))
        else:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self._failure else "open")
        return f"<shmproxy.Comm rank {self.rank}/{self.size} local {self.local_rank}/{self.local_size} {state}>"


def _close_at_exit(ref: "weakref.ref[Comm]") -> None:
    comm = ref()
    if comm is None or comm._closed:
        return
    try:
        comm.close()
    except errors.ProxyError as exc:
        _log.warning("close at exit failed: %s", exc)


def _abort_reason(exc_type: Any, exc: BaseException, tb: Any) -> str:
    """What the peers are told when a ``with`` block raised: the exception, where, and its message
    (shortened: it travels in the pool's 512-byte error field). A survivor's error then names the
    root cause, even if the failing rank is killed before it prints its own traceback."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    text = str(exc)
    if len(text) > _ABORT_TEXT_MAX:
        text = text[:_ABORT_TEXT_MAX - 3] + "..."
    return f"{exc_type.__name__} raised in the with block{where}" + (f": {text}" if text else "")
