"""How a Comm starts, attaches to, watches and leaves its node's progress process.

Local rank 0 starts the progress process (``python -m shmproxy.engine.progress``); every rank then
joins it over the service socket (INIT, SHARED_INIT, SETUP, CONNECT), maps the ops pool and builds
its poster (shm/_poster.c). From then on the rank watches the progress process through a pidfd and
the pool's error and abort words, so that every call raises the communicator's named error once it
failed. Abort, close and the teardown that releases everything in any state are here too.

The part of shmproxy.rank.comm.Comm under its public calls: ``Lifecycle`` declares, with their
types, the state it sets (the Comm's calls and the rank's other modules read it), and the three
calls it makes into comm.py, as abstract methods. When the pool is mapped it makes the Comm's two
components, its waiting (rank/waiting.py, ``_waiter``) and its posting (rank/posting.py,
``_posting``), and answers their questions: whether the communicator is usable or failed, a
service call.
"""
from __future__ import annotations

import abc
import atexit
import os
import sys
import time
import traceback
import weakref
from typing import Any

import numpy as np

from shmproxy.control import bootstrap, netif, rendezvous
from shmproxy.core import errors, host, log, params as params_mod
from shmproxy.rank import arena
from shmproxy.rank.buffers import Registry, StagingCache
from shmproxy.core.ops import (COLL_LAST_NATIVE, CODE_DTYPE, DTYPE_CODE, FLAG_IN_PLACE, FLAG_NO_RECV,
                               KIND_COLL, KIND_RECV, KIND_SEND, Coll)
from shmproxy.control.protocol import MsgType
from shmproxy.rank.progressproc import ProgressProcess
from shmproxy.rank.posting import CommCalls, Posting
from shmproxy.rank.request import Request
from shmproxy.rank.waiting import Failure, Waiter
from shmproxy.control.client import ServiceClient
from shmproxy.shm import _native, _poster, pool as P, sync
from shmproxy.shm.counters import u32_view
from shmproxy.shm.segment import Segment

_log = log.get("INIT")
# What shm._poster needs to read arrays itself: dtype char -> (code, itemsize), and probe arrays
# whose facts it checks its reading against (shm/_poster.c, verify_layout).
_DTYPES = {ch: (code, np.dtype(ch).itemsize) for ch, code in DTYPE_CODE.items()}

_ABORT_TEXT_MAX = 240   # characters of an exception's message that a with block's Abort passes on
_PENDING_SHOWN = 8      # requests a close names when it abandons them
# Where this process imported shmproxy from. The progress process starts there: `python -m` puts its
# working directory first on sys.path, so started from the rank's directory it would import any
# other `shmproxy` package found there (another checkout, a decoy) instead of the code this rank runs.
# (The folder that holds the `shmproxy` package, or for an editable install the repository, where
# no folder of that name shadows the installed finder.)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(str(sys.modules["shmproxy"].__file__))))


def _probes() -> list[tuple]:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = np.zeros(5, np.complex128)
    b.flags.writeable = False
    return [(x, x.ctypes.data, x.nbytes, x.dtype.char, x.flags.writeable, x.flags.c_contiguous)
            for x in (a, a[:, :2], b, np.zeros((0, 4), np.float16))]


assert (_poster.KIND_SEND, _poster.KIND_RECV, _poster.RECORD_BYTES) == (KIND_SEND, KIND_RECV, P.RECORD_BYTES)
assert (_poster.KIND_COLL, _poster.FLAG_IN_PLACE, _poster.FLAG_NO_RECV, _poster.COLL_ALLREDUCE, _poster.COLL_BARRIER,
        _poster.COLL_ALLTOALL) == (KIND_COLL, FLAG_IN_PLACE, FLAG_NO_RECV, Coll.ALLREDUCE, Coll.BARRIER,
                                   COLL_LAST_NATIVE)
assert _poster.CODE_BOOL == DTYPE_CODE["?"] and _poster.CODE_FIRST_FLOAT == DTYPE_CODE["e"] == max(
    c for c, t in CODE_DTYPE.items() if t.kind not in "fc") + 1


def _cwd_args() -> list[str]:
    """The progress process goes back to this directory once it has imported our code, so that
    relative paths (DEBUG_FILE, PROFILE_FILE, ...) mean there what they mean here."""
    try:
        return ["--cwd", os.getcwd()]
    except FileNotFoundError:   # our directory was removed: a relative path means nothing anyway
        return []


# The communicators this process has joined, by service socket path. Joining one again (a second
# shmproxy.init() of the same job) would take its live socket for a crashed run's and start a second
# progress process beside the first, while the other local ranks are refused by the first.
_JOINED: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


class Lifecycle(abc.ABC):
    """Creation, the service calls, failure state, Abort/close and teardown of a Comm."""

    # ---- the Comm's state: this part sets it (_create, _start, _attach_pool), the Comm's calls read it
    # who this rank is, and what the communicator was made with
    rank: int
    size: int
    local_rank: int
    local_size: int
    params: params_mod.Params
    node_layout: dict | None        # the nodes' layout, when the communicator spans nodes
    parent_ranks: list[int]         # a Split child's ranks in its parent
    _timeout: float
    _job_key: str
    _comm_id: int
    _nchildren: int                 # Splits made so far: a child's id depends on it
    _split_layout: Any              # where a Split child across nodes gets its layout (rank/splitting.py)
    _path: str                      # the service socket
    _closed: bool
    _failure: errors.ProxyError | None

    # the progress process and the service
    _proxy: ProgressProcess         # its pid, pidfd and fault report (rank/progressproc.py)
    _client: ServiceClient | None

    # the ops pool, mapped (_attach_pool)
    _seg: Segment | None
    _view: P.PoolView | None
    _layout: P.Layout
    _q: memoryview                  # the pool as uint64 words
    _i32: memoryview
    _u32: memoryview
    _abort_q: int                   # word indices of the control block's abort and error words
    _err_q: int
    _pp: Any                        # the C poster (shm/_poster.c)
    _registry: Registry
    _arena_held: bool   # registered the numpy arena (shmproxy.rank.arena) and holds its handler
    _staging: StagingCache
    # the components, made once the pool is mapped
    _waiter: Waiter                 # waiting, and the records, slots and pending requests (waiting.py)
    _posting: Posting               # the Python post path (posting.py)

    # ---- what the fast path sets on binding (rank/fastpath.py)
    _fast_bytes = 0   # the fast path's size limit once on (rank/fastpath.py)
    _mapped_bytes = 0   # the middle collectives' once on (fastpath.bind_arena), and their minimum
    _mapped_min = 0
    _mapped_min_reduce = 0
    _arena_scratch = 0   # their scratch block in the arena

    # ---- the calls this part makes into comm.py
    @abc.abstractmethod
    def _bind_entries(self, seg_addr: int, layout: P.Layout) -> None: ...

    @abc.abstractmethod
    def _bind_arena(self) -> None: ...

    @abc.abstractmethod
    def Barrier(self) -> None: ...

    # ------------------------------------------------------------------ creation
    @classmethod
    def _create(cls, info: bootstrap.LaunchInfo, params: params_mod.Params, comm_id: int,
                key: str | None = None, split_layout: Any = None) -> Any:
        self = cls.__new__(cls)
        self.node_layout = None            # the nodes' layout, when the communicator spans nodes
        self._split_layout = split_layout  # where a Split child across nodes gets it (rank/splitting.py)
        self._closed = False
        self._failure = None
        self.rank, self.size = info.rank, info.size
        self.local_rank, self.local_size = info.local_rank, info.local_size
        self.params = params
        self._timeout = params.TIMEOUT
        self._proxy = ProgressProcess()
        self._client = None
        self._seg = None
        self._view = None
        key = key or bootstrap.job_key(info, params)
        self._job_key, self._comm_id, self._nchildren = key, comm_id, 0
        self._path = bootstrap.service_path(bootstrap.run_dir(params), key, comm_id)
        other = _JOINED.get(self._path)
        if other is not None and not other._closed:
            raise errors.InvalidUsage(
                f"rank {info.rank}: this process has joined communicator {comm_id} of this job already "
                f"(shmproxy.init() twice?): use that communicator, or its Dup(); shmproxy.MPI takes it "
                f"with MPI.attach_world(comm)")
        try:
            self._start(info, params, key, comm_id)
        except BaseException:
            self._teardown(wait_proxy=False)
            raise
        _JOINED[self._path] = self
        atexit.register(_close_at_exit, weakref.ref(self))
        return self

    def _start(self, info: bootstrap.LaunchInfo, params: params_mod.Params, key: str, comm_id: int) -> None:
        deadline = self._deadline(None)
        multi = info.size > info.local_size   # across nodes: the layout comes from the rendezvous
        if info.local_rank == 0:
            if os.path.exists(self._path):
                # The job key is unique per job; a leftover socket is from a crashed run of it.
                _log.warning("removing stale service socket %s", self._path)
                os.unlink(self._path)
            for stale in bootstrap.sweep_stale_sockets(os.path.dirname(self._path)):
                _log.info("removed the service socket %s of a job that did not end cleanly", stale)
            for stale in bootstrap.sweep_stale_pools(params.SHM_DIR):
                _log.info("removed the ops pool %s of a job that did not end cleanly", stale)
            env = dict(os.environ)
            env.update(params.to_env())
            cmd = [sys.executable, "-m", "shmproxy.engine.progress", "--path", self._path,
                   "--nlocal", str(info.local_size), "--size", str(info.size), "--job-key", key,
                   "--comm-id", str(comm_id), "--parent", str(os.getpid()), *_cwd_args()]
            if multi:
                cmd += ["--net-ip", netif.choose_ip(params.SOCKET_IFNAME, rendezvous.target_host(info, params))]
            self._proxy.start(cmd, env, _PACKAGE_ROOT)
        self._client = ServiceClient.connect(
            self._path, max(deadline - self._now(), 0.001),
            should_abort=self._proxy.child_exited if self._proxy.proc is not None else None)
        c = self._client
        host = params.HOSTNAME or bootstrap.host_identity()
        resp, fds = c.call(MsgType.INIT, {
            "token": key, "rank": info.rank, "local_rank": info.local_rank, "size": info.size,
            "local_size": info.local_size, "host": host,
            "affinity": sorted(os.sched_getaffinity(0))}, timeout=self._left(deadline))
        for fd in fds[1:]:
            os.close(fd)
        resp0 = resp
        self._proxy.adopt(int(resp["proxy_pid"]), fds[0] if fds else -1)
        resp, fds = c.call(MsgType.SHARED_INIT, {}, timeout=self._left(deadline))
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise errors.RemoteError(f"the progress process sent {len(fds)} fds for the pool, not 1")
        self._seg = Segment.from_fd(fds[0], int(resp["bytes"]), resp["pool"])
        try:
            c.call(MsgType.SETUP, {}, timeout=self._left(deadline))
            connect: dict[str, Any] = {"peers": list(range(self.size))}
            if multi:
                connect["net"] = self.node_layout = self._meet_nodes(info, host, bytes.fromhex(resp0.get("net", "")),
                                                                     deadline)
            c.call(MsgType.CONNECT, connect, timeout=self._left(deadline))
        except errors.RemoteError as exc:
            # Once this rank mapped the pool (SETUP), a failed communicator's progress process stops
            # answering it (engine/failure.py, not_told): the pool's record names who failed. Said as
            # the service says it to a join it refuses (control/handler.py, _refuse_join): which of
            # the two a joining rank meets is a race with the failure.
            recorded = self._recorded_failure()
            if recorded is not None:
                raise errors.while_joining(recorded) from exc
            raise
        try:
            self._attach_pool()   # registers the numpy arena: still the join
        except errors.ProxyError as exc:
            if exc is self._failure:   # the communicator's, read from the pool (_record_failure)
                raise errors.while_joining(exc) from exc
            raise

    def _meet_nodes(self, info: bootstrap.LaunchInfo, host: str, net_info: bytes, deadline: float) -> dict:
        """The node layout (control/rendezvous.py): through the job's rendezvous for the world, through
        the parent communicator for a Split across nodes (``_split_layout``, set by Split)."""
        split = self._split_layout
        if split is not None:
            return split(net_info)
        return rendezvous.node_layout(info, self.params, host, net_info, self._left(deadline))

    def _attach_pool(self) -> None:
        seg = self._seg
        assert seg is not None
        view = P.PoolView(seg.mm, seg.addr)
        layout = view.layout
        if layout.nlocal != self.local_size:
            raise errors.InternalError(f"pool built for {layout.nlocal} local ranks, we have {self.local_size}")
        self._view, self._layout, self._q, self._i32 = view, layout, view.q, view.i32
        self._u32 = u32_view(seg.mm)
        lr, p = self.local_rank, self.params
        # Waiting, and the records and slots a post takes (rank/waiting.py)
        w = self._waiter = Waiter(self.rank, lr, view, self._u32, seg.addr, self._timeout, p.WAIT_SLICE_MS * 1e-3,
                                  Failure(lambda: self._failure, self._record_failure, self._set_failure,
                                          self._proxy.dead))
        self._abort_q, self._err_q = w.abort_q, w.err_q   # the control block's abort and error words
        posted_q = layout.rank_q(lr, P.RANK_POSTED)
        # The post path (shm/_poster.c): sequence numbers, opCount, groups, and the fast post.
        self._pp = _poster.Poster(
            self, Request, np.ndarray, seg.addr + layout.records_off, seg.addr + P.MUTEX_OFF,
            seg.addr + P.COND_OFF, seg.addr + P.NEXT_OPS_OFF, seg.addr + P.NEXT_OPS_END_OFF,
            seg.addr + P.PENDING_MASK_OFF, seg.addr + layout.rank_area_off,
            seg.addr + P.CTRL_OFF + 8 * P.CTRL_SLEEPING, seg.addr + 8 * self._err_q,
            seg.addr + 8 * self._abort_q, seg.addr + 8 * posted_q, lr,
            self.size, self._timeout, w.free_slots, w.free_records, w.pending, _DTYPES,
            _probes(), w.splice_failed)
        w.attach(self._pp)
        sync.set_lock_spin(self.params.LOCK_SPIN_US)   # contended pool locks retry briefly first
        if not self._pp.fast:
            _log.warning("numpy's array layout is not the one shm/_poster.c reads: every post takes "
                         "the slower Python path")
        # How Request.Wait spins before it sleeps (the spin is in C): up to WAIT_SPIN_US, and on a
        # crowded node only for requests the progress loop completes itself, since larger ones are
        # copied by workers that need the cores (measured: docs/decisions.md).
        crowded = host.crowded(self.local_size)
        spin_max = p.WAIT_SPIN_MAX_BYTES or (p.eager_limit if crowded else 1 << 62)
        spin_max_coll = p.WAIT_SPIN_MAX_BYTES or (p.coll_inline_bytes(self.local_size) if crowded else 1 << 62)
        self._pp.set_wait(seg.addr + layout.slots_off, layout.nrecords, p.WAIT_SPIN_US * 1e-6, spin_max,
                          spin_max_coll)
        self._bind_entries(seg.addr, layout)   # which calls of this instance are C entry points (comm.py)
        self._registry = Registry(self._register, self._pp.set_ranges)
        self._staging = StagingCache(self._registry, self.params.STAGING_CACHE)
        # The Python post path (rank/posting.py): what the C entries fall back to, and what they never take
        # this rank's completion slots: (address of slot 0, the first, how many)
        slots = (seg.addr + layout.slots_off, lr * layout.max_ops, layout.max_ops)
        calls = CommCalls(self._check_usable, self._control, self._failed_now)
        self._posting = Posting(self, self.rank, self.size, p, self.node_layout, self._pp, w, self._registry,
                                self._staging, slots, calls)
        # numpy arrays born in registered memory (shmproxy.rank.arena): this communicator maps it too
        self._arena_held = arena.attach(self._registry, self.params)
        self._bind_arena()   # the middle collectives read the ranks' arenas (comm.py)

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
        self._control(MsgType.REGISTER, {"buf_id": buf_id, "bytes": nbytes, "kind": "host", "device": 0}, fds=(fd,))

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
            if self._view is not None and (self._q[self._err_q] or self._q[self._abort_q]
                                           or self._proxy.dead(0.5)):
                raise self._record_failure() from exc   # names who failed, or how the progress process died
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
        exc = self._failure_in(view) or errors.PeerDiedError(
            f"the progress process (pid {self._proxy.pid}) died" + self._proxy.death(), rank=-1, pid=self._proxy.pid)
        self._set_failure(exc)
        return exc

    def _failure_in(self, view: P.PoolView) -> errors.ProxyError | None:
        """The failure the pool records (asyncResult, or the abort flag), or None."""
        if view.ctrl(P.CTRL_ERR_SEQ):
            rank = view.ctrl(P.CTRL_ERR_RANK)
            return errors.from_code(view.ctrl(P.CTRL_ERR_CODE), view.error_message(),
                                    rank=None if rank == P.NO_RANK else rank, pid=view.ctrl(P.CTRL_ERR_PID))
        if view.ctrl(P.CTRL_ABORT):
            return errors.Aborted(f"rank {self.rank}: the communicator was aborted")
        return None

    def _recorded_failure(self) -> errors.ProxyError | None:
        """While joining, before the pool is attached: the failure its mapping records, or None."""
        seg = self._seg
        if seg is None:
            return None
        view = P.PoolView(seg.mm)   # no address: it only reads
        try:
            return self._failure_in(view)
        finally:
            view.release()

    def _set_failure(self, exc: errors.ProxyError) -> None:
        self._failure = exc
        pp = self.__dict__.get("_pp")
        if pp is not None:
            pp.usable = 0   # the fast path declines, so the full path raises this
        posting = self.__dict__.get("_posting")
        device = posting.device if posting is not None else None
        if device is not None:
            device.release_waits(exc.code)   # no GPU stream waits for a completion that may never come
        shot = self.__dict__.get("_oneshot")
        if shot:
            shot.release()   # nor a kernel of the ranks' own for its peers (shmproxy.rank.devcoll)

    def _failed_now(self) -> bool:
        """Whether the communicator failed, recorded if so (for the device memory's failure watch, on a
        thread of its own: it stops before the views it reads go, in _teardown)."""
        return self._failure is not None or self.get_async_error() is not None

    # ------------------------------------------------------------------ errors, abort, close
    def get_async_error(self) -> errors.ProxyError | None:
        """The communicator's error if it failed (a peer died, abort, progress crash), else None."""
        if self._failure is not None:
            return self._failure
        if self._view is None or self._closed:
            return None
        if self._q[self._err_q] or self._q[self._abort_q] or self._proxy.dead():
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
        """Finish: wait for this rank's pending sends and collectives, abandon its unmatched receives
        (saying so on stderr, as MPI implementations do at finalize), detach, and (local rank 0) wait
        for the progress process to exit once every local rank closed. Idempotent; after a failure it
        only releases local resources."""
        self._close(wait=True)

    def _close(self, wait: bool) -> None:
        """close(); with ``wait`` False (a ``with`` block left by an error) nothing pending is waited
        for: the error already took its bound, and a second wait would double it."""
        if self._closed:
            return
        first: BaseException | None = None
        if self._failure is None and self._client is not None:
            try:
                shot = self.__dict__.get("_oneshot")
                if shot and wait:
                    shot.close(barrier=self.Barrier)   # every rank's kernels ended: the scratch goes
                self._settle_pending(wait)
                self._control(MsgType.CLOSE, {})
            except errors.ProxyError as exc:
                first = exc
        self._closed = True
        self._teardown(wait_proxy=True)
        if first is not None and not isinstance(first, (errors.PeerDiedError, errors.Aborted)):
            raise first

    def _settle_pending(self, wait: bool) -> None:
        """Before CLOSE: wait for pending sends and collectives (``wait``), which complete once their
        peers act, or fail once those close; leave unmatched receives (and, without ``wait``, everything)
        to the progress process, which drops what the closing rank posted, and name them on stderr."""
        left = []
        # The object layer's sends returned to their caller as if delivered: they are waited for. Any
        # other send no receive took yet is cancelled (engine/p2p.py), so that a peer that never
        # receives it does not hold this close for the whole timeout; a matched one completes.
        promised = {id(r) for r in self.__dict__.get("_objects_unwaited", ())}
        for req in list(self._waiter.pending.values()):
            if wait and req._kind != KIND_RECV:
                if (req._kind == KIND_SEND and id(req) not in promised and not req.Test()
                        and self._posting.cancel(req)):
                    req.Wait()
                    left.append(req)
                    continue
                req.Wait()
                continue
            try:
                if req.Test():
                    continue
            except errors.PeerClosed:
                # Unmatched, and its sender closed meanwhile: abandoned like one still pending (which
                # of the two closes reached the progress process first is a race, not a difference)
                pass
            except errors.ProxyError:
                if wait:
                    raise      # a receive that failed otherwise (truncation, dtype): as Wait would
                continue
            left.append(req)
        if left:
            shown = "; ".join(r.describe() for r in left[:_PENDING_SHOWN])
            more = f" and {len(left) - _PENDING_SHOWN} more" if len(left) > _PENDING_SHOWN else ""
            print(f"shmproxy: rank {self.rank} closed with {len(left)} request(s) still pending, abandoned: "
                  f"{shown}{more}", file=sys.stderr, flush=True)

    def _teardown(self, wait_proxy: bool) -> None:
        """Release everything this process holds; safe to call in any state."""
        proxy_dead = self._proxy.doomed(failed=self._failure is not None)
        shot = self.__dict__.pop("_oneshot", None)
        if shot:
            shot.close(barrier=None)   # if not closed above: its kernels end, its memory is the exit's
        posting = self.__dict__.get("_posting")
        device = posting.device if posting is not None else None
        if device is not None:
            device.stop_watch()   # it reads the views released below
        pp = self.__dict__.get("_pp")
        if pp is not None:
            pp.detach()   # it holds raw pool addresses: never again after this
        if getattr(self, "_staging", None) is not None:
            self._staging.close()
        scratch = self.__dict__.pop("_arena_scratch", 0)
        if scratch:
            arena.release(scratch)   # the poster is detached: no collective reads it any more
        if self.__dict__.pop("_arena_held", False):
            arena.detach()   # the last communicator gives numpy its allocator back
        for name in ("_q", "_i32", "_u32"):
            mv = self.__dict__.pop(name, None)
            if mv is not None:
                mv.release()
        if self._view is not None:
            self._view.release()
            self._view = None
        if posting is not None:
            posting.close()   # its device memory unpins the pool's completion slots: before the unmap
        if self._seg is not None:
            self._seg.close()
            self._seg = None
        if self._client is not None:
            self._client.close()
            self._client = None
        ours = self._proxy.release(self._timeout if wait_proxy else None)   # killed past the bound
        # The socket file is the progress process's to remove. Only if it died before doing so does
        # the job have to: then any survivor may, idempotently (local rank 0, its parent, may be dead
        # too). The pool has no name to remove (shm/segment.py).
        if proxy_dead or ours:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass  # it, or another survivor, got there first

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and not isinstance(exc, errors.ProxyError):
            self.Abort(_abort_reason(exc_type, exc, tb))
        else:
            self._close(wait=exc_type is None)   # after shmproxy's own error: one bound, not two


def _close_at_exit(ref: "weakref.ref[Lifecycle]") -> None:
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
