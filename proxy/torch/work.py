"""Work objects and the completion thread of a shmproxy process group.

Why a thread: DDP (and any communication hook) chains callbacks on ``work.get_future()`` and later
waits on the chained future from C++, never calling ``Work.wait``. So something must complete the
futures while nobody waits: one daemon thread per process group, the *completer*, started with the
group. Lazy completion in ``wait`` would leave DDP's reducer waiting forever.

What the completer does, in passes: under the group's lock it tests every pending operation's
requests (``Request.Test`` reaps completed ones); outside the lock it runs the finished operations'
copies back (non-contiguous outputs, bfloat16 casts, large tensors the group staged: tensors.py)
and marks their Work and Future completed, so the Future's callbacks run on this thread (as gloo
runs them on its worker threads). When a pass finished nothing, it sleeps on the rank's wake-up
word of the communicator, *without* the lock: the progress process wakes it on a completion, and
the sleep is a bounded slice that checks the communicator's error, the abort flag and the progress
process, so a dead peer fails every pending Work within a slice. Posting threads (DDP's autograd
threads included) only take the lock to post, never to wait, so a bucket's allreduce is posted while
the previous one is still in flight.

The sleep is the communicator's own bounded sleep (``Comm._waiter.sleep_slice``): the Comm has no public
"sleep until one of my requests completes" that does not also reap, and reaping must stay under
the lock.

Who completes a Work. Posting does not wake the completer: a blocking call (torch calls ``wait``
right after posting) of a small operation *claims* its Work (takes it out of the pending list) and
completes it on the waiting thread, with the communicator's own Wait under the group's lock (for
such an operation microseconds, and it takes part in the ranks' fast path): waking the completer
and being woken by it cost far more than the operation. Not a receive, which waits for its peer:
holding the lock meanwhile hung a rank whose other thread's send on the group was what the peer
waited for (a small receive takes its message itself first: ``_receive_here``, process_group.py
"Point-to-point"). A Work whose Future is taken (``watch``:
DDP), a larger one being waited for, or any Work once the completer is awake for another, is the
completer's, which sets an Event that every waiting thread waits on. ``is_completed`` of a Work
nobody watches tests it once (``poll``). A Work's completion runs exactly once: whoever removed it
from the pending list under the lock completes it.

CUDA Works whose requests a stream can wait for on the GPU (Request.wait_on_stream; not across
nodes, no copies back) take the completer off the path to the result. ``wait`` makes the current
stream wait for the requests' completion words and returns; ``get_future`` returns NCCL's kind of
Future, completed at once on a stream of the group that waits for the requests, so DDP's callbacks
and its final wait queue their kernels behind the all_reduce instead of holding its thread until
the completer saw the completion. Such a Work is still completed on the host (its tensors let go,
its slots reaped), but lazily: the group's next post completes those whose requests finished
(``Completer.reap``), unless someone watches it (``is_completed``, the completer's Future). Waking
the completer for each of them cost more than the operation: its passes took the lock the next
post needs, and the GIL.

A blocking call that torch announces (``opts.asyncOp`` False: torch waits on its Work right away)
of small CPU tensors (not bfloat16) does not get a Work of this kind at all when TORCH_BLOCKING_DIRECT
is on: the group runs the communicator's blocking call on the calling thread, under its lock, and
returns a ``Completed`` Work (process_group.py, "Blocking calls"). No Event, no Future until asked.

Caveat: a callback chained on a Future runs on the completer; a *blocking* collective on the same
group inside such a callback would wait for the thread that is running it. Such a call raises an
InvalidUsage saying so instead of hanging.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from shmproxy.core import errors
from shmproxy.rank.request import Request
from shmproxy.torch import ops
from shmproxy.torch.tensors import Staged


SMALL_WAIT_BYTES = 64 << 10   # outputs up to this: the waiting thread completes the Work itself
_FUTURES = threading.Lock()   # a Work's Future made (get_future) against its completion (Work._resolve)


class Work(dist.Work):
    """One posted operation of a shmproxy process group: its requests, what runs at completion, and
    the value of its Future (the output tensors, as torch's backends give)."""

    def __init__(self, pg: Any, name: str, requests: list, stage: Staged, result: list[torch.Tensor],
                 on_done: Callable[["Work"], None] | None = None, receive: bool = False):
        super().__init__()
        self._pg = pg
        self.name = name
        self.requests = requests
        self.stage = stage
        self.result_tensors = result
        self.on_done = on_done
        self.source = -1              # the sender of recv_anysource, known at completion
        self._event = threading.Event()
        self._exc: BaseException | None = None
        # The Future that torch sees is chained on a private one: a callback that raises marks the
        # chained Future failed in C++ (torch.futures.Future.set_exception would instead complete it
        # *successfully* with the exception object as its value, which DDP's reducer reads as tensors).
        # Both are made when asked for (get_future): the pair cost more than a small call's whole
        # trip on a CUDA host, and a blocking call never asks. ``_resolved`` under _FUTURES says
        # whether the completion came first; whichever of the two comes second sets the result.
        self._trigger: torch.futures.Future | None = None
        self._future: torch.futures.Future | None = None
        self._resolved = False
        self.deadline = time.monotonic() + pg.timeout_s
        self._watched = False   # the completer was told of it (get_future): see Completer.add
        # A small operation's wait completes it on the waiting thread, under the group's lock (its
        # wait is microseconds, so other threads' posts are not held up): no hand-off to the
        # completer and back, which cost more than the operation. A larger one is the completer's.
        # Not a receive, which waits for its peer, not microseconds: see "Who completes a Work".
        self.small = not receive and sum(t.numel() * t.element_size() for t in result) <= SMALL_WAIT_BYTES
        self._on_stream = False   # a stream waits on the GPU for this Work's requests (_stream_wait)
        # A small CPU receive not posted yet, (source, tag): received by ``wait`` itself, or posted as
        # an Irecv as soon as anything else needs it to be (ProcessGroupShmproxy.recv, "Deferred").
        self._deferred: tuple[int, int] | None = None
        self._recv_req: Any = None   # a receive's request once posted (its Status names the source)

    # ---- set by the completer -------------------------------------------------------------------
    def _complete(self) -> None:
        try:
            self.stage.done()
            if self.on_done is not None:
                self.on_done(self)
        except BaseException as exc:   # a copy-back that failed is this Work's error, not the thread's
            self._fail(exc)
            return
        self._event.set()
        self._resolve()

    def _fail(self, exc: BaseException) -> None:
        if self._event.is_set():
            return
        self._exc = exc
        self.stage.after.clear()
        self._event.set()
        self._resolve()
        if self._on_stream and isinstance(exc, errors.Timeout):
            # A stream waits on the GPU for a completion that did not come in time and may never come:
            # the group fails (as NCCL's watchdog aborts its communicator), which lets every waiting
            # stream go (Request.wait_on_stream) and fails the group's other Works.
            self._pg.abort(exc)

    def _resolve(self) -> None:
        with _FUTURES:
            self._resolved = True
            trigger = self._trigger
        if trigger is not None:
            trigger.set_result(None)

    def _outcome(self, _trigger: torch.futures.Future) -> list[torch.Tensor]:
        if self._exc is not None:
            raise self._exc
        return self.result_tensors

    # ---- torch's Work API -------------------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the operation completed; raise its error (shmproxy's, naming the rank). A
        ``timeout`` (timedelta or seconds; 0 or None: the group's timeout) that expires raises
        shmproxy.Timeout. On CUDA tensors, as NCCL's: the caller's current stream waits for the
        result and the host goes on (shmproxy.torch.cuda, "What Work.wait does"); with a
        ``timeout`` the host waits, as on the CPU."""
        secs = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if not self._event.is_set():
            if threading.current_thread() is self._pg.completer.thread:
                raise errors.InvalidUsage(
                    f"rank {self._pg.rank()}: a blocking wait for {self.name} on the shmproxy completion "
                    "thread (inside a Future callback): chain another callback instead of waiting")
            if self.stage.device is not None and not secs and self._stream_wait():
                return True
            if self._deferred is not None:
                if not secs and self._receive_here():
                    if self._exc is not None:
                        raise self._exc
                    return True
                with self._pg.lock:
                    self.post_deferred()   # the usual wait below needs it posted
                if self._event.is_set():   # its post failed
                    if self._exc is not None:
                        raise self._exc
                    return True
            limit = secs if secs else max(self.deadline - time.monotonic(), 0.0) + 1.0
            if self.small and self._pg.completer.claim(self):
                self._finish_here(limit)   # no hand-off: this thread waits and completes it
            else:
                self._pg.completer.watch(self)   # the completer completes it: it must be awake
            if not self._event.wait(limit):
                raise errors.Timeout(
                    f"rank {self._pg.rank()}: {self.name} did not complete within {limit:.1f} s")
        if self._exc is not None:
            raise self._exc
        return True

    def _streamable(self) -> bool:
        """Whether a stream can wait for this Work on the GPU: not where its result is in place only
        once the host did something at completion."""
        if self._pg.comm.node_layout is not None:
            # Across nodes the rank stages device tensors through host memory: a request's result is
            # copied back when the rank reaps it, which a stream cannot wait for.
            return False
        # Copies back (a strided output, a list of outputs) are launched by the completion thread once
        # the requests completed: a stream waiting for the requests alone would run ahead of them.
        return not self.stage.after

    def _arm(self, stream: Any) -> bool:
        """Have ``stream`` wait on the GPU for this Work's requests and the call's own copies (the
        group's lock held: the requests are the communicator's); False where a request declined
        (those armed wait for requests the host then waits for too: harmless)."""
        if not all(r.wait_on_stream(stream) for r in self.requests if not r._done):
            return False
        if self.stage.posted is not None:
            stream.wait_event(self.stage.posted)   # the call's own copies, queued after its posts
        self._on_stream = True
        return True

    def _stream_wait(self) -> bool:
        """Have the current stream wait on the GPU for this Work's requests instead of the host; False
        where the host waits: a small Work on an idle stream (microseconds), or one a stream cannot
        wait for (``_streamable``, Request.wait_on_stream)."""
        if not self._streamable():
            return False
        stream = torch.cuda.current_stream(self.stage.device)
        if self.small and stream.query():
            return False
        with self._pg.lock:
            if self._event.is_set() or not self._arm(stream):
                return False
        # Nobody waits for it on the host, and the completer is not woken for it: the group's next
        # post completes it once its requests did (Completer.reap), unless its Future is taken
        # (get_future: the completer's then) or someone asks (is_completed).
        return True

    def _take_deferred(self) -> tuple[int, int] | None:
        """The deferred receive's (source, tag), no longer deferred (the group's lock held); None if
        it was not."""
        d, self._deferred = self._deferred, None
        if self._pg.deferred_recv is self:
            self._pg.deferred_recv = None
        return d

    def post_deferred(self) -> None:
        """Post a deferred receive as the Irecv it stands for (the group's lock held); a failed
        communicator fails the Work."""
        d = self._take_deferred()
        if d is None:
            return
        pg = self._pg
        try:
            self.requests = ops.recv(pg, self.result_tensors[0], d[0], d[1], self.stage)
        except errors.ProxyError as exc:
            self._fail(exc)
            return
        self._recv_req = self.requests[0]

    def _receive_here(self) -> bool:
        """``wait`` of a deferred receive: the ranks' fast path takes the message on this thread if it
        comes within the fast path's spin (the group's lock held that long, no longer). False where
        it did not, or the Work was posted meanwhile: the receive is then posted and waited for as
        any other (``wait``, below; a receive's wait never holds the lock: another thread's send on
        this group may be what its peer waits for before sending)."""
        pg = self._pg
        with pg.lock:
            d = self._deferred
            if d is None or not pg.completer.claim(self):
                return False
            try:
                status = ops.try_recv(pg, self.result_tensors[0], d[0], d[1])
            except errors.ProxyError as exc:
                self._deferred = None
                self._fail(exc)
                return True
            if status is None:
                pg.completer.add(self)   # back among the pending, for the completer to finish
                return False
            self._take_deferred()
        self.source = status.source
        self._complete()
        return True

    def _finish_here(self, limit: float) -> None:
        """Complete a Work this thread claimed from the completer: the communicator's own Wait (which
        spins in C, and takes part in a small collective of the ranks' fast path), under the group's
        lock (a Comm serves one thread at a time), then complete it here. Other threads post on this
        group after it; the progress process moves the requests either way, so nothing they wait on
        waits on them."""
        pg = self._pg
        try:
            with pg.lock:
                Request.Waitall(self.requests, limit)
                self.requests = []
        except errors.ProxyError as exc:
            self._fail(exc)
            return
        self._complete()

    def is_completed(self) -> bool:
        if not self._event.is_set():
            self._pg.completer.poll(self)
        return self._event.is_set()

    def is_success(self) -> bool:
        return self.is_completed() and self._exc is None

    def exception(self) -> BaseException | None:  # type: ignore[override]
        self.is_completed()
        return self._exc

    def get_future(self) -> torch.futures.Future:
        """The Future of the outputs; from now on the completer completes this Work even if nobody
        waits (DDP chains its callbacks here and waits on the chained Future from C++). On CUDA
        tensors, NCCL's Future where the requests allow it (``_stream_future``)."""
        if self.stage.device is not None:
            fut = self._stream_future()
            if fut is not None:
                return fut
        self._pg.completer.watch(self)
        with _FUTURES:
            if self._future is None:
                trigger: torch.futures.Future = torch.futures.Future()
                self._future = trigger.then(self._outcome)
                self._trigger = trigger
                resolved = self._resolved
            else:
                resolved = False
        if resolved:
            trigger.set_result(None)
        return self._future

    def _stream_future(self) -> torch.futures.Future | None:
        """NCCL's Future of an operation on CUDA tensors: completed at once, its value ordered on the
        GPU after the operation. A stream of the group's (``order_streams``) waits for the requests'
        completion words (Request.wait_on_stream) and the Future is completed on it: torch records an
        event there, which every stream that waits on the Future or runs its callbacks waits for. So
        DDP's hooks and its wait at the end of backward queue their work behind the all_reduce and go
        on, where a Future completed by the completion thread held DDP's thread until the completer
        had seen the completion. None where the requests do not allow it
        (``_streamable``) or the Work failed: the completer's Future then. As NCCL's, the Future
        does not see a failure after the post: the group's next call raises it."""
        if self._future is not None:
            return self._future
        pg = self._pg
        device = self.stage.device
        if device is None or self._exc is not None or not self._streamable():
            return None
        with pg.lock:
            order = pg.order_streams.get(device)
            if not self._event.is_set() and not self._arm(order):
                return None
        fut: torch.futures.Future = torch.futures.Future(devices=[device])
        with torch.cuda.stream(order):
            fut.set_result(self.result_tensors)
        with _FUTURES:
            if self._future is None:
                self._future = fut
            return self._future

    def result(self) -> list[torch.Tensor]:  # type: ignore[override]
        self.wait()
        return self.result_tensors

    def _source_rank(self) -> int:
        self.wait()
        return self.source

    source_rank = _source_rank

    def __repr__(self) -> str:
        state = "failed" if self._exc is not None else ("done" if self._event.is_set() else "pending")
        return f"<shmproxy.torch.Work {self.name} {state}>"


class Completed(dist.Work):
    """A call the group ran to its end on the calling thread (a blocking call run directly:
    ProcessGroupShmproxy._run_now), or queued on the current stream of ``device`` (the ranks' own
    kernels: ProcessGroupShmproxy._on_gpus): nothing to wait for on the host; its Future is made when
    asked for, on the device a CUDA Future of the stream (as NCCL's)."""

    def __init__(self, name: str, result: list[torch.Tensor], exc: BaseException | None = None,
                 device: torch.device | None = None, stream: torch.cuda.Stream | None = None):
        super().__init__()
        self.name = name
        self.result_tensors = result
        self._exc = exc
        self._device = device
        self._stream = stream   # the group's stream its kernels were queued on (None: the current one)
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """As NCCL's: the caller's current stream waits for the call's kernels (on ``stream``)."""
        if self._exc is not None:
            raise self._exc
        if self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._exc is None

    def exception(self) -> BaseException | None:  # type: ignore[override]
        return self._exc

    def get_future(self) -> torch.futures.Future:
        """A completed Future of the outputs (failed with the call's error), chained as Work's is."""
        if self._future is None:
            if self._device is not None and self._exc is None:
                # completed on the stream of its kernels: its users wait on the GPU for what is queued there
                self._future = torch.futures.Future(devices=[self._device])
                if self._stream is None:
                    self._future.set_result(self.result_tensors)
                else:
                    with torch.cuda.stream(self._stream):
                        self._future.set_result(self.result_tensors)
                return self._future
            trigger: torch.futures.Future = torch.futures.Future()
            self._future = trigger.then(self._outcome)
            trigger.set_result(None)
        return self._future

    def _outcome(self, _trigger: torch.futures.Future) -> list[torch.Tensor]:
        if self._exc is not None:
            raise self._exc
        return self.result_tensors

    def result(self) -> list[torch.Tensor]:  # type: ignore[override]
        self.wait()
        return self.result_tensors

    def __repr__(self) -> str:
        return f"<shmproxy.torch.Work {self.name} {'failed' if self._exc is not None else 'done'}>"


class Completer:
    """The completion thread of one process group (see the module header)."""

    def __init__(self, pg: Any):
        self._pg = pg
        self._pending: list[Work] = []
        self._cond = threading.Condition(pg.lock)   # the group's lock: adding work and testing share it
        self._stop = False
        self.passes = 0   # passes over the pending Works (a count for tests and dumps)
        self.thread = threading.Thread(target=self._run, name=f"shmproxy-completer-{pg.group_label}",
                                       daemon=True)
        self.thread.start()

    def add(self, work: Work) -> None:
        """Called with the group's lock held, right after posting. The thread is not woken for it:
        a blocking call's ``wait`` claims its Work at once and completes it itself (``claim``), and
        waking a thread for each small call cost more than the call. It is woken when the Work's
        Future is taken (``watch``: nobody may ever wait on that Work); when it is awake anyway, its
        passes test every pending Work, this one too."""
        self._pending.append(work)

    def watch(self, work: Work) -> None:
        with self._cond:
            if not work._watched:
                work._watched = True
                self._cond.notify()

    def claim(self, work: Work) -> bool:
        """Take ``work`` out of the pending list for the calling thread to complete; False when the
        completer has it already (its pass found it finished: it completes it)."""
        with self._cond:
            try:
                self._pending.remove(work)
            except ValueError:
                return False
            return True

    def reap(self) -> list[Work]:
        """With the group's lock held, before a post: take out the Works that streams wait for on the
        GPU and nobody watches (Work._stream_wait), whose requests completed; the caller completes
        them once it released the lock. Waking this thread for each of them cost a blocking call on
        CUDA tensors more than the operation: its passes took the lock that the next post needs, and
        the GIL. A communicator's failure seen here is left to this thread, woken for it."""
        done: list[Work] = []
        keep: list[Work] = []
        for w in self._pending:
            if w._on_stream and not w._watched:
                try:
                    w.requests = [r for r in w.requests if not r.Test()]
                except errors.ProxyError:
                    w._watched = True   # _test_all sorts out what failed
                    self._cond.notify()
                else:
                    if not w.requests:
                        done.append(w)
                        continue
            keep.append(w)
        if done:
            self._pending = keep
        return done

    def poll(self, work: Work) -> None:
        """``is_completed`` of a Work nobody waits on: test it once, complete it here if it finished."""
        with self._cond:
            if work not in self._pending:
                return
            work.post_deferred()
            if work._event.is_set():   # its post failed
                self._pending.remove(work)
                return
            try:
                work.requests = [r for r in work.requests if not r.Test()]
            except errors.ProxyError as exc:
                self._pending.remove(work)
                failed: BaseException | None = exc
            else:
                if work.requests:
                    return
                self._pending.remove(work)
                failed = None
        if failed is not None:
            work._fail(failed)
        else:
            work._complete()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def fail_all(self, exc: BaseException) -> None:
        with self._cond:
            pending, self._pending = self._pending, []
        for w in pending:
            w._fail(exc)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if self._stop and not self._pending:
                    return
            try:
                self._pass()
            except Exception as exc:   # a bug here must fail the pending Works, not end the thread silently
                what = f"{type(exc).__name__}: {exc}"
                self.fail_all(errors.InternalError(
                    f"rank {self._pg.rank()}: the shmproxy completion thread failed: {what}"))

    def _pass(self) -> None:
        """Test every pending operation, complete the finished ones; sleep when none finished."""
        comm = self._pg.comm
        with self._cond:
            self.passes += 1
            finished, failure, head = self._test_all()
        for w in finished:
            w._complete()
        if failure is not None:
            self.fail_all(failure)
            return
        if finished or head is None:
            return
        work, req = head
        try:
            # The lock is not held: posting threads go on while this one sleeps.
            comm._waiter.sleep_slice(work.deadline, f"{work.name} ({req.describe()})",
                                     comm._layout.slot_q(req._slot), req._seq)
        except errors.Timeout as exc:
            with self._cond:
                if work in self._pending:
                    self._pending.remove(work)
            work._fail(exc)
        except errors.ProxyError as exc:
            self.fail_all(exc)

    def _test_all(self) -> tuple[list[Work], BaseException | None, tuple[Work, Any] | None]:
        """One pass under the lock: the finished Works (removed from the pending list), the
        communicator's failure if one was seen, and a (work, request) still pending to sleep on."""
        finished: list[Work] = []
        head: tuple[Work, Any] | None = None
        keep: list[Work] = []
        failure: BaseException | None = None
        for w in self._pending:
            if w._deferred is not None:
                w.post_deferred()   # this thread completes it: it must be posted
                if w._event.is_set():
                    continue
            try:
                left = [r for r in w.requests if not r.Test()]
            except (errors.PeerDiedError, errors.Aborted, errors.Closed) as exc:
                failure = exc
                keep.append(w)
                continue
            except errors.ProxyError as exc:   # this operation's own error (truncation, mismatch)
                w._fail(exc)
                continue
            w.requests = left
            if left:
                keep.append(w)
                if head is None:
                    head = (w, left[0])
            else:
                finished.append(w)
        self._pending = keep
        return finished, failure, head
